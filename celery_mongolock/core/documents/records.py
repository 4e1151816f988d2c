"""The history's records (no I/O): one per key, acquisition and view (``history_record``), one per run
that ended while parked (``run_record``), and the endings of ``limit=N`` holds an acquire found expired
(``slots_expired_by``). ``core.history`` writes them.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping
from typing import Any

from celery_mongolock.core.lease_info import aware

__all__ = [
    "HOLDER_VIEW",
    "RUN_VIEW",
    "SERVER_VIEW",
    "history_id",
    "history_record",
    "run_history_id",
    "run_record",
    "slots_expired_by",
]

Document = dict[str, Any]

#: The two views of one acquisition's end: the server's (the ending in ``ends``) and the holder's own (it
#: saw its lease lost).
SERVER_VIEW = "s"
HOLDER_VIEW = "h"
#: The view of a run that ended while parked, never holding the key (superseded, timed out, revoked).
RUN_VIEW = "q"


def history_id(key: str, fence: int, view: str) -> str:
    """``_id`` of a history record: one per key, acquisition (fence) and view, so a record written twice
    is stored once."""
    return f"{key}\x00{int(fence):020d}\x00{view}"


def history_record(key: str, ending: Mapping[str, Any], view: str = SERVER_VIEW) -> Document:
    """A record for the history collection: the ending's fields plus ``_id``, ``k`` and ``v``.

    ``e`` (the end, server time) is what the collection's TTL index counts from.
    """
    record: Document = {k: v for k, v in ending.items() if v is not None}
    record.update(_id=history_id(key, int(ending["f"]), view), k=key, v=view)
    return record


def run_history_id(key: str, task_id: str) -> str:
    """``_id`` of the record of a run that ended while parked: one per key and task id (a run ends once;
    two workers that both see it end, e.g. the sweeper and the revoke of its handoff message, store one
    record)."""
    return f"{key}\x00{RUN_VIEW}\x00{task_id}"


def run_record(
    key: str,
    how: str,
    run: Mapping[str, Any],
    *,
    fence: int | None,
    ended_at: _dt.datetime | None = None,
    parked_at: _dt.datetime | None = None,
    by: str | None = None,
    running: bool = False,
) -> Document:
    """The history record of a run that ended while parked (``how``: ``superseded``, ``timeout``,
    ``revoked``): ``f`` is the key's fence when it ended, ``w`` how long it was parked (ms), ``e`` when it
    ended (the server's time when known, else this process's clock). ``running``: the run held the key
    and a newer send superseded it (``Replace(cancel_running=True)``): ``rn``."""
    ended = aware(ended_at)
    if ended is None:
        now = _dt.datetime.now(_dt.timezone.utc)
        ended = now.replace(microsecond=now.microsecond // 1000 * 1000)
    parked = aware(parked_at)
    waited = None if parked is None else max(0, int((ended - parked).total_seconds() * 1000))
    task_id = str(run.get("t"))
    record: Document = {
        "_id": run_history_id(key, task_id),
        "k": key,
        "v": RUN_VIEW,
        "f": int(fence or 0),
        "t": task_id,
        "n": run.get("n"),
        "run": run.get("id") or run.get("r"),
        "how": how,
        "pa": parked,
        "e": ended,
        "w": waited,
        "by": by,
        "rn": True if running else None,
    }
    return {k: v for k, v in record.items() if v is not None}


def slots_expired_by(doc: Mapping[str, Any] | None) -> list[Document]:
    """The endings of ``limit=N`` holds that a slot acquire found expired (and dropped), from its reply
    (the document with its ``ends``): those written at this command's time, which is at or after every
    live hold's acquisition. An ending recorded earlier may be among them: writing it again is harmless
    (a history record's ``_id`` is per key, fence and view)."""
    if not doc:
        return []
    taken = [h["a"] for h in doc.get("hs") or [] if isinstance(h, Mapping) and h.get("a") is not None]
    newest = aware(max(taken)) if taken else None
    found = []
    for ending in doc.get("ends") or []:
        if not isinstance(ending, Mapping) or ending.get("how") != "expired" or ending.get("slot") is None:
            continue
        ended = aware(ending.get("e"))
        if ended is not None and (newest is None or ended >= newest):
            found.append(dict(ending))
    return found
