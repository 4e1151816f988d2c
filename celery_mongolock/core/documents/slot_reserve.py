"""A slot of a ``limit=N`` key reserved for a ``Queue`` run that needs several keys, as pure pipeline
builders (no I/O).

A run that needs several keys (``keys=``) holds none of them while it waits for any: a key it took in an
attempt that found another held becomes a *reservation* for its parked entry (``queue.reserve_pipeline``
for a single lease). On a key with a limit, the reservation is a slot: the run's hold becomes a slot
handed to its entry (``o`` the entry's token ``tk``, ``ho`` the entry with ``ks``), exactly the shape of a
slot handed to a parked run (``slot_queue``), so that it counts against the limit, expires after a lease
when nobody claims it, and is claimed by the run once every one of its keys is reserved for it.

What keeps two runs that need overlapping keys from waiting on each other: an expired handed slot of a
several-keys entry goes back to its place in the key's queue (``requeue_in_send_order``: rank, then
send order), not at its front as a single-key run's does, so the first run waiting for the key is
handed it next; every reservation of a run behind it ends within a lease, and the first run gets all its
keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery_mongolock.core.documents import slots as _slots
from celery_mongolock.core.documents.entries import ahead_of, entry_expr
from celery_mongolock.core.documents.key_state import gc_stage

__all__ = ["requeue_in_send_order", "slot_reserve_pipeline"]

Document = dict[str, Any]

_HS: Document = {"$ifNull": ["$hs", []]}


def requeue_in_send_order(q: object, entries: object) -> Document:
    """``q`` with ``entries`` (an array expression of parked entries) each put back at its place in the
    queue's order (``entries.ahead_of``: rank, then send order)."""
    return {
        "$reduce": {
            "input": entries,
            "initialValue": q,
            "in": {
                "$concatArrays": [
                    {"$filter": {"input": "$$value", "as": "e", "cond": ahead_of("$$e", "$$this")}},
                    ["$$this"],
                    {
                        "$filter": {
                            "input": "$$value",
                            "as": "e",
                            "cond": {"$not": [ahead_of("$$e", "$$this")]},
                        }
                    },
                ]
            },
        }
    }


def slot_reserve_pipeline(
    owner: str, entry: Mapping[str, Any], timeout_ms: int | None, by: str
) -> list[Document]:
    """Turn the hold of ``owner`` (a slot taken by a several-keys run in an attempt that must wait) into
    a slot handed to the run's ``entry`` (``tk``, ``ks``, ``ttl`` ...), in one command: it keeps its slot
    number and fence, expires a lease from now unless claimed, and carries no minimum hold (its run has
    not run; the claim starts one). A hold already turned into this reservation is left as it is."""
    e = entry_expr(entry, timeout_ms)
    ho = {"$mergeObjects": [e, {"hat": "$$NOW", "hn": 1, "by": {"$literal": by}}]}
    ttl = int(entry["ttl"])
    reserved = {
        "o": {"$literal": entry["tk"]},
        "f": "$$e.f",
        "s": "$$e.s",
        "x": {"$add": ["$$NOW", ttl]},
        "t": ttl,
        "a": "$$e.a",
        "h": {
            "task_id": {"$literal": entry["t"]},
            "task_name": {"$literal": entry.get("n")},
            "delivery": {"$literal": entry.get("r")},
            "handed": True,
        },
        "w": "$$e.w",
        "ho": ho,
    }
    hs = {
        "$map": {
            "input": _HS,
            "as": "e",
            "in": {"$cond": [{"$eq": ["$$e.o", {"$literal": owner}]}, reserved, "$$e"]},
        }
    }
    return [{"$set": {"hs": hs}}, {"$set": {"sx": _slots.latest_expiry("$hs")}}, gc_stage()]
