"""The duplicate guard, as aggregation expressions (no I/O): the runs a key remembers as over (``seen``)
and the later attempts it knows of, so that a copy of a run (a redelivered or parked message, a stale
handoff message) is never run again. ``ran`` and ``retries_of`` are their Python twins, for a document
already read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "SEEN_KEPT",
    "later_attempt",
    "ran",
    "ran_any",
    "retries_of",
    "run_id",
    "seen_append",
]

Document = dict[str, Any]

_Q: Document = {"$ifNull": ["$q", []]}
_BIG = 1 << 30
#: How many normally released runs a key remembers, to drop a late copy of one of their messages.
SEEN_KEPT = 128


def run_id(task_id: str, delivery: str) -> str:
    """One run of a task id (its own retries and contention retries): what duplicates are matched on."""
    return f"{task_id}/{delivery}"


def seen_append(when: object) -> Document:
    """``seen`` with the current holder's run appended (when ``when``), the last SEEN_KEPT kept."""
    rid = {
        "$concat": [
            {"$toString": {"$ifNull": ["$holder.task_id", ""]}},
            "/",
            {"$toString": {"$ifNull": ["$holder.delivery", ""]}},
        ]
    }
    appended = {"$slice": [{"$concatArrays": [{"$ifNull": ["$seen", []]}, [rid]]}, -SEEN_KEPT]}
    has_task = {"$ne": [{"$ifNull": ["$holder.task_id", None]}, None]}
    return {"$cond": [{"$and": [when, has_task]}, appended, "$seen"]}


def ran_any(run_ids: Sequence[str]) -> Document:
    """True when one of ``run_ids`` is remembered as over (``seen``: it ended with a normal release). The
    acquire of a copy of such a run (a redelivered or parked message) refuses the key with it, in the same
    command: a run whose release lands between the copy's look and its acquire is never run again.

    An id ending with ``.`` is a prefix (``"<task id>/<retries>."``: any contention retry of that attempt,
    see ``ran``); any other is matched whole."""
    seen = {"$ifNull": ["$seen", []]}
    tests: list[Document] = []
    for rid in run_ids:
        if rid.endswith("."):
            starts = {"$eq": [{"$indexOfCP": ["$$r", {"$literal": rid}]}, 0]}
            tests.append({"$anyElementTrue": [{"$map": {"input": seen, "as": "r", "in": starts}}]})
        else:
            tests.append({"$in": [{"$literal": rid}, seen]})
    return {"$or": tests}


def _attempt_of(delivery: object) -> Document:
    """The task's own retries of a delivery (``"2"``, or ``"2.1"`` with contention retries); -1 when it
    has none (a holder recorded without its delivery)."""
    first = {"$arrayElemAt": [{"$split": [{"$toString": {"$ifNull": [delivery, ""]}}, "."]}, 0]}
    return {"$convert": {"input": first, "to": "int", "onError": -1, "onNull": -1}}


def later_attempt(task_id: str, retries: int) -> Document:
    """True when the key knows an attempt of ``task_id`` later than ``retries`` (its body called
    ``self.retry()``, which starts attempt ``retries + 1``): parked, handed, holding the key, or ended
    (``seen``), on a single-lease key or a ``limit=N`` key (its holds and handed slots, ``hs``). A
    message of attempt ``retries`` is then a stale copy: that attempt's body ran, and the later one
    carries the task on (the lock-set checker's seed 23: a stale handoff message of a cut several-keys
    run was admitted as a new run beside its retry, and its body ran again)."""
    tid = {"$literal": task_id}
    prefix = f"{task_id}/"

    def later(task: object, delivery: object) -> Document:
        return {"$and": [{"$eq": [task, tid]}, {"$gt": [_attempt_of(delivery), retries]}]}

    parked = {"$anyElementTrue": [{"$map": {"input": _Q, "as": "e", "in": later("$$e.t", "$$e.r")}}]}
    handed = {"$and": [{"$ne": [{"$ifNull": ["$ho", None]}, None]}, later("$ho.t", "$ho.r")]}
    holding = {
        "$and": [
            {"$ne": [{"$ifNull": ["$owner", None]}, None]},
            later("$holder.task_id", "$holder.delivery"),
        ]
    }
    in_slots = {
        "$anyElementTrue": [
            {
                "$map": {
                    "input": {"$ifNull": ["$hs", []]},
                    "as": "h",
                    "in": {
                        "$or": [
                            later("$$h.h.task_id", "$$h.h.delivery"),
                            later("$$h.ho.t", "$$h.ho.r"),
                        ]
                    },
                }
            }
        ]
    }
    rest = {"$substrCP": ["$$r", len(prefix), _BIG]}
    ended = {
        "$anyElementTrue": [
            {
                "$map": {
                    "input": {"$ifNull": ["$seen", []]},
                    "as": "r",
                    "in": {
                        "$and": [
                            {"$eq": [{"$indexOfCP": ["$$r", {"$literal": prefix}]}, 0]},
                            {"$gt": [_attempt_of(rest), retries]},
                        ]
                    },
                }
            }
        ]
    }
    return {"$or": [parked, handed, holding, in_slots, ended]}


def retries_of(delivery: object) -> int | None:
    """``_attempt_of`` in Python, for an entry's ``r``; None when it has none."""
    try:
        return int(str(delivery).split(".")[0])
    except ValueError:
        return None


def ran(seen: Sequence[str], run_ids: Sequence[str]) -> bool:
    """``ran_any`` in Python, on a document's ``seen``."""
    return any(r == rid or (rid.endswith(".") and r.startswith(rid)) for rid in run_ids for r in seen)
