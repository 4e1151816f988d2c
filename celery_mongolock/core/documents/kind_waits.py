"""Runs waiting on a key in use as the other kind, as pure functions (no I/O): what ``why`` shows of them.

A ``Queue``/``Replace`` run that finds its key in use as the other kind of key (``limit=N`` slots while it
takes the key as a single lease, or the reverse: the admit answers ``mixed``) does not park there. It comes
back as a contention retry until the key is free of them, so no parked entry says it waits. Each time it
is kept aside, its worker notes it in the key's lease document (``kw``: one update, after the admit), and
``celery mongolock why`` shows the runs noted within the last ``FRESH_MS``::

    kw: [{t, n, w, sc, at}, ...]   # task id, task name, the kind it waits to take the key as ("single"
                                   # or "slots"), when it was first kept aside (ms), when last noted

The list keeps the newest ``KEPT`` runs, one record per run (a run noted again replaces its record), and
drops records older than ``FRESH_MS`` whenever a run is noted. A run that takes the key, parks or ends
is not taken out: its record ages out (a run comes back within ``MIXED_RETRY``'s 5 s while it waits).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
from collections.abc import Mapping
from typing import Any

from celery_mongolock.core.lease_info import aware

__all__ = ["FIELD", "FRESH_MS", "KEPT", "KindWait", "note_update", "views", "waits_in"]

Document = dict[str, Any]

FIELD = "kw"
#: A record older than this (ms, on the server's clock) is no longer shown, and is dropped at the next note:
#: three of ``MIXED_RETRY``'s longest countdowns (5 s), so a run that still waits is always shown, and one
#: that took the key, parked or ended is gone from ``why`` within 15 s.
FRESH_MS = 15_000
#: The most records a key keeps (the newest).
KEPT = 16


def note_update(task_id: str, task_name: str, kind: str, since_ms: int | None) -> list[Document]:
    """The update pipeline that notes run ``task_id`` kept aside on a key in use as the other kind: it
    waits to take the key as ``kind`` (``single`` or ``slots``) since ``since_ms`` (epoch ms; None: now)."""
    now_ms = {"$toLong": "$$NOW"}
    fresh = {
        "$filter": {
            "input": {"$ifNull": [f"${FIELD}", []]},
            "as": "w",
            "cond": {
                "$and": [
                    {"$ne": ["$$w.t", {"$literal": task_id}]},
                    {"$gt": [{"$toLong": "$$w.at"}, {"$subtract": [now_ms, FRESH_MS]}]},
                ]
            },
        }
    }
    record = {
        "t": {"$literal": task_id},
        "n": {"$literal": task_name},
        "w": {"$literal": kind},
        "sc": {"$literal": since_ms} if since_ms is not None else now_ms,
        "at": "$$NOW",
    }
    return [{"$set": {FIELD: {"$slice": [{"$concatArrays": [fresh, [record]]}, -KEPT]}}}]


@dataclasses.dataclass(frozen=True)
class KindWait:
    """A run noted waiting on a key in use as the other kind (``why``): its task id and name, the kind it
    waits to take the key as (``single``: a lease of its own; ``slots``: one of ``limit=N``), since when
    it waits, and when it was last kept aside."""

    task_id: str
    task_name: str
    wants: str
    since: _dt.datetime | None
    noted_at: _dt.datetime

    @property
    def task(self) -> str:
        return f"{self.task_name}[{self.task_id}]"

    def as_dict(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "task_name": self.task_name,
            "wants": self.wants,
            "since": None if self.since is None else self.since.isoformat(),
            "noted_at": self.noted_at.isoformat(),
        }


def waits_in(doc: Mapping[str, Any], now: _dt.datetime) -> tuple[KindWait, ...]:
    """The runs ``doc`` notes waiting as the other kind within ``FRESH_MS`` of ``now`` (the server's time),
    the longest waiting first."""
    found = []
    for w in doc.get(FIELD) or []:
        if not isinstance(w, Mapping):
            continue
        at = aware(w.get("at"))
        if at is None or (now - at).total_seconds() * 1000 > FRESH_MS:
            continue
        since = w.get("sc")
        found.append(
            KindWait(
                task_id=str(w.get("t") or "?"),
                task_name=str(w.get("n") or "?"),
                wants=str(w.get("w") or "?"),
                since=(
                    _dt.datetime.fromtimestamp(since / 1000, _dt.timezone.utc)
                    if isinstance(since, int) and not isinstance(since, bool)
                    else None
                ),
                noted_at=at,
            )
        )
    return tuple(sorted(found, key=lambda w: w.since or w.noted_at))


def views(doc: Mapping[str, Any], now_ms: Any) -> list[Document]:
    """``waits_in`` as ``LeaseInfo.other_kind`` shows them, at ``now_ms`` (the server's time, ms; no
    records without it): ``task_id``, ``task_name``, ``wants``, ``waiting_for`` and ``back_ago`` (s)."""
    if not isinstance(now_ms, int) or isinstance(now_ms, bool):
        return []
    now = _dt.datetime.fromtimestamp(now_ms / 1000, _dt.timezone.utc)
    return [
        {
            "task_id": w.task_id,
            "task_name": w.task_name,
            "wants": w.wants,
            "waiting_for": round((now - (w.since or w.noted_at)).total_seconds(), 3),
            "back_ago": round((now - w.noted_at).total_seconds(), 3),
        }
        for w in waits_in(doc, now)
    ]
