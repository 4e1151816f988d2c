"""The lease documents as read (no I/O): the pipelines that read them with the server's clock
(``read_pipeline``, ``story_pipeline``), the keys a listing matches (``prefix_filter``), and a document
read as a ``LeaseInfo`` (``lease_info``). The document's fields are described in ``base``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from celery_mongolock.core.documents import kind_waits
from celery_mongolock.core.documents.lanes import spilled_total
from celery_mongolock.core.keys import RESERVED_PREFIX
from celery_mongolock.core.lease_info import LeaseInfo, aware
from celery_mongolock.exceptions import ConfigurationError

__all__ = [
    "lease_info",
    "parked_views",
    "prefix_filter",
    "read_pipeline",
    "story_pipeline",
]

Document = dict[str, Any]

_NOW_MS: Document = {"$toLong": "$$NOW"}


# -- reading ---------------------------------------------------------------------------------------------
def prefix_filter(prefix: str | None) -> Document:
    """Keys starting with ``prefix`` (all keys when None)."""
    if prefix is None:
        return {}
    if not isinstance(prefix, str):
        raise ConfigurationError(f"prefix must be a str, got {type(prefix).__name__}")
    return {"_id": {"$regex": "^" + re.escape(prefix)}}


def _parked_page(start: int, limit: int | None) -> Document:
    """The fields that carry a key's parked runs to the reader: how many there are (``__parked_total``)
    and, with ``limit``, only ``limit`` of them from position ``start`` (0: the next to run) instead of
    all: the server cuts a deep queue, the reply carries the page."""
    q = {"$ifNull": ["$q", []]}
    # (the runs spilled beyond the document's window count too: ``spill``; the page shows the window's)
    fields: Document = {"__parked_total": {"$add": [{"$size": q}, spilled_total()]}}
    if limit is not None:
        fields["q"] = {"$slice": [q, int(start), int(limit)]}
    return fields


def read_pipeline(
    match: Document, *, parked_from: int = 0, parked_limit: int | None = None
) -> list[Document]:
    """The lease documents matching ``match``, by key, each with the server's ``expires_at - $$NOW``; with
    ``parked_limit``, at most that many parked runs each, from position ``parked_from`` (``_parked_page``)."""
    stage = {
        "$addFields": {
            "__expires_in_ms": {"$subtract": [{"$toLong": "$expires_at"}, _NOW_MS]},
            "__now_ms": _NOW_MS,
            **_parked_page(parked_from, parked_limit),
        }
    }
    hidden = {"ends": 0, "seen": 0, "q.m": 0, "ho.m": 0}
    return [{"$match": match}, {"$sort": {"_id": 1}}, stage, {"$project": hidden}]


def story_pipeline(key: str, parked_limit: int | None = None) -> list[Document]:
    """One key's whole document, ``ends`` included, with the server's ``$$NOW`` and
    ``expires_at - $$NOW`` (``celery mongolock why``); not the parked runs' messages (``m``) nor the
    queue's duplicate guard (``seen``), which can be large; with ``parked_limit``, only the first that
    many parked runs (and how many there are: ``_parked_page``)."""
    stage = {
        "$addFields": {
            "__expires_in_ms": {"$subtract": [{"$toLong": "$expires_at"}, _NOW_MS]},
            "__now": "$$NOW",
            # The key is handed to a parked run (or reserved for a multi-key run), not yet claimed.
            "__handed": {
                "$and": [{"$ne": [{"$ifNull": ["$ho", None]}, None]}, {"$eq": ["$owner", "$ho.tk"]}]
            },
            **_parked_page(0, parked_limit),
        }
    }
    # Rebuilt field by field: the embedded test server does not take a dotted exclusion inside an array.
    fields = ("id", "t", "n", "r", "s", "at", "dl", "hat", "hn", "ks", "pr")
    runs = {
        "q": {"$map": {"input": {"$ifNull": ["$q", []]}, "as": "e", "in": {f: f"$$e.{f}" for f in fields}}},
        "ho": {
            "$cond": [
                {"$eq": [{"$ifNull": ["$ho", None]}, None]},
                None,
                {f: f"$ho.{f}" for f in fields},
            ]
        },
    }
    return [{"$match": {"_id": key}}, stage, {"$addFields": runs}, {"$project": {"seen": 0}}]


def lease_info(doc: Document, first: int = 0) -> LeaseInfo:
    """A document read through ``read_pipeline`` as a ``LeaseInfo``: held means owned and not expired;
    ``first``: the position (from 0) of its first parked run read (``parked_from``)."""
    expires_in_ms = doc.get("__expires_in_ms")
    owner = doc.get("owner")
    expires_in = None if expires_in_ms is None else expires_in_ms / 1000.0
    now_ms = doc.get("__now_ms")
    slots = []
    for hold in doc.get("hs") or []:
        x = aware(hold.get("x"))
        left = None if x is None or not isinstance(now_ms, int) else x.timestamp() - now_ms / 1000.0
        if left is not None and left > 0:
            slots.append(
                {"slot": hold.get("s"), "fence": hold.get("f"), "holder": hold.get("h"), "expires_in": left}
            )
    slots.sort(key=lambda h: int(h["slot"] or 0))
    return LeaseInfo(
        key=doc["_id"],
        held=bool(slots) or (owner is not None and expires_in is not None and expires_in > 0),
        owner=owner,
        fence=int(doc.get("fence", 0)),
        expires_at=aware(doc.get("expires_at")),
        expires_in=expires_in,
        holder=dict((slots[0]["holder"] if slots else doc.get("holder")) or {}),
        acquired_at=aware(doc.get("acquired_at")),
        renewed_at=aware(doc.get("renewed_at")),
        released_at=aware(doc.get("released_at")),
        parked=parked_views(doc.get("q") or [], first, doc.get("__now_ms")),
        parked_total=int(doc.get("__parked_total", len(doc.get("q") or []))),
        handoff=_handoff_view(
            doc.get("ho") or next((h.get("ho") for h in doc.get("hs") or [] if h.get("ho")), None),
            doc.get("__now_ms"),
        ),
        slots=slots,
        limit=doc.get("lim") if slots or doc.get("hs") else None,
        other_kind=kind_waits.views(doc, now_ms),
    )


def _since(when: Any, now_ms: Any) -> float | None:
    if not isinstance(now_ms, int) or aware(when) is None:
        return None
    stamp = aware(when)
    assert stamp is not None
    return round(max(0.0, now_ms / 1000.0 - stamp.timestamp()), 3)


def parked_views(entries: Sequence[Mapping[str, Any]], first: int, now_ms: Any) -> list[Document]:
    """``LeaseInfo.parked`` for parked ``entries`` from position ``first`` (0: the next to run) on."""
    return [_parked_view(first + i + 1, e, now_ms) for i, e in enumerate(entries)]


def _parked_view(position: int, entry: Mapping[str, Any], now_ms: Any) -> Document:
    return {
        "position": position,
        "task_id": entry.get("t"),
        "task_name": entry.get("n"),
        "stamp": entry.get("s"),
        "parked_for": _since(entry.get("at"), now_ms),
        "deadline": aware(entry.get("dl")),
        # (the task's own keys: a Replace set's gate is not among them, ``sets.is_gate``)
        "keys": [str(k) for k in entry["ks"] if not str(k).startswith(RESERVED_PREFIX)]
        if isinstance(entry.get("ks"), list)
        else None,
        "rank": int(entry.get("pr") or 0),
    }


def _handoff_view(ho: Any, now_ms: Any) -> Document | None:
    if not isinstance(ho, Mapping):
        return None
    return {
        "task_id": ho.get("t"),
        "task_name": ho.get("n"),
        "handed_for": _since(ho.get("hat"), now_ms),
        "attempt": ho.get("hn"),
    }
