"""Deep queues: a key's parked runs beyond its **window** live in a collection of their own, one document
per run, addressed by a computed ``_id`` (pure builders, no I/O).

A key's lease document keeps, for each rank (``entries.rank_of_entry``: a run's priority as its broker
orders it), at most ``window`` parked runs in ``q``: everything the admit, the handoff and the sweeper
judge stays in the one document they update atomically, and its size stays bounded. A ``Queue`` run that
would park behind a full window (or behind runs of its rank already spilled) is **spilled**: the admit
allocates it the next number of its rank's **lane** (``sp``), and its worker then stores its entry in the
spill collection under ``spill_id(key, rank, number)``. When a lane's window runs low, a **refill** reads
the next numbers by ``_id`` (point reads, never a range scan or a sort: flat on the embedded server as on
MongoDB), moves them into ``q`` in one command conditioned on the lane's head, and then deletes them.

On a ``limit=N`` key the refill then hands every free slot to the runs it brought (``slot_queue``'s
``slot_refill_pipeline``), as a release does. The lanes (``sp``) and what reads them are in ``lanes``. A lane
holds ``t - h`` numbers, each a spilled run, or a **hole**: a number whose run was never stored (its worker
stopped between the admit and the insert; its message, not acknowledged, comes again and is spilled anew). A
refill that finds a number missing stores a **tombstone** under it first, so that a worker storing late finds
its number taken and admits its run again: no run is stored behind a lane's head, where nobody would read it.

A spilled document::

    {_id: spill_id(key, rank, n), k: key, rid: run id (unique per key), e: entry}   # a run
    {_id: spill_id(key, rank, n), k: key, rid: "gone:<_id>", x: true}            # a tombstone

The unique index on ``(k, rid)`` tells a copy of a spilled run (a message delivered again) from a new run:
its insert fails, and the copy is dropped like the copy of a parked run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from celery_mongolock.core.documents import lanes
from celery_mongolock.core.documents.entries import PARK_BUDGET, dead_entries, in_place, rank_of_entry
from celery_mongolock.core.documents.handoff import handoff_stages
from celery_mongolock.core.documents.key_state import VACANT, gc_stage

__all__ = ["HAS_HANDOFF", "VACANT", "blocked_pipeline", "refill_filter", "refill_pipeline", "refill_stages"]

Document = dict[str, Any]

_NOW_MS: Document = {"$toLong": "$$NOW"}
_Q: Document = {"$ifNull": ["$q", []]}
_SP: Document = {"$ifNull": ["$sp", []]}

#: A handoff is pending (made, not yet claimed).
HAS_HANDOFF: Document = {"$ne": [{"$ifNull": ["$ho", None]}, None]}


def _known(ident: str, task_id: str, delivery: object) -> Document:
    """The key knows the run ``ident`` already: parked, handed (the key, or a slot of a ``limit=N`` key),
    timed out, ended, or holding it (or a slot of it)."""
    lit = {"$literal": ident}
    ids = {"$map": {"input": _Q, "as": "e", "in": "$$e.id"}}
    dead = {"$map": {"input": {"$ifNull": ["$dead", []]}, "as": "d", "in": "$$d.id"}}
    slots = {"$ifNull": ["$hs", []]}
    run = {"task_id": {"$literal": task_id}, "delivery": {"$literal": delivery}}
    holding = {
        "$and": [
            {"$eq": ["$holder.task_id", run["task_id"]]},
            {"$eq": ["$holder.delivery", run["delivery"]]},
            {"$ne": [{"$ifNull": ["$owner", None]}, None]},
        ]
    }
    of_run = {
        "$and": [{"$eq": ["$$e.h.task_id", run["task_id"]]}, {"$eq": ["$$e.h.delivery", run["delivery"]]}]
    }
    return {
        "$or": [
            {"$in": [lit, ids]},
            {"$eq": ["$ho.id", lit]},
            {"$in": [lit, {"$map": {"input": slots, "as": "e", "in": {"$ifNull": ["$$e.ho.id", None]}}}]},
            {"$in": [lit, dead]},
            {"$in": [lit, {"$ifNull": ["$seen", []]}]},
            holding,
            {"$gt": [{"$size": {"$filter": {"input": slots, "as": "e", "cond": of_run}}}, 0]},
        ]
    }


def _insert_stage(entry: Mapping[str, Any], at: int) -> Document:
    """``q`` with the spilled run ``entry`` (the ``at``-th of ``__es``) in its place
    (``entries.entry_ahead``), unless the key knows it already (a copy of it was parked meanwhile, or it
    ran); past its deadline (``Queue(timeout=...)``), to ``dead`` instead (its result is written by the
    sweeper)."""
    ident, stamp = str(entry["id"]), int(entry["s"])
    e = {"$arrayElemAt": ["$__es", int(at)]}
    in_order = in_place(e, stamp, ident, rank_of_entry(entry))
    known = _known(ident, str(entry["t"]), entry.get("r"))
    dead = dead_entries([e])  # (empty unless past its deadline on the server's clock)
    expired = {"$gt": [{"$size": dead}, 0]}
    return {
        "$set": {
            "q": {"$cond": [{"$or": [known, expired]}, _Q, in_order]},
            "dead": {"$cond": [known, "$dead", {"$concatArrays": [{"$ifNull": ["$dead", []]}, dead]}]},
        }
    }


def refill_filter(key: str, rank: int, epoch: int, head: int, size: int) -> Document:
    """The refill's filter: lane ``rank`` of ``epoch`` still has its head at ``head`` (no other refill
    moved it, and the key's document was not made again meanwhile), and the document can take ``size``
    more bytes (``entries.PARK_BUDGET``)."""
    fits = {"$lte": [{"$add": [{"$bsonSize": "$$ROOT"}, int(size)]}, PARK_BUDGET]}
    lane = {"r": int(rank), "e": int(epoch), "h": int(head)}
    return {"_id": key, "sp": {"$elemMatch": lane}, "$expr": fits}


def refill_stages(rank: int, new_head: int, entries: Sequence[Mapping[str, Any]]) -> list[Document]:
    """The refill of lane ``rank`` (``refill_filter``), whatever the key's shape: ``entries`` (the runs
    stored under the numbers read, holes left out) join ``q`` in their places, and the lane's head moves
    to ``new_head``, past every number read; its passed mark (``pm``) goes up to the latest send stamp
    among ``entries`` (those moved to ``dead``, or known already, included: the lane passed them)."""
    # The entries are in the command once (``__es``), each inserted by a stage of its own: a message of up
    # to ``SPILL_MESSAGE_LIMIT`` keeps the command under MongoDB's 16 MiB.
    stages: list[Document] = [_insert_stage(e, at) for at, e in enumerate(entries)]
    moved: Document = {"h": {"$literal": int(new_head)}}
    if entries:  # (how far the refills got: ``pm``, for the runs of several keys, ``lanes.held_back``)
        latest = max(int(e["s"]) for e in entries)
        moved["pm"] = {"$max": [{"$ifNull": ["$$l.pm", None]}, {"$literal": latest}]}
    return [
        {"$set": {"__es": {"$literal": [dict(e) for e in entries]}}},
        *stages,
        {"$set": {"sp": lanes.with_lane(rank, moved)}},
        {"$unset": "__es"},
    ]


def refill_pipeline(
    rank: int, new_head: int, entries: Sequence[Mapping[str, Any]], by: str
) -> list[Document]:
    """The refill of a key held as one lease (``refill_stages``); then a free key goes to the oldest
    parked run (``by`` marks that handoff for its publisher). A ``limit=N`` key's is
    ``slot_queue.slot_refill_pipeline``."""
    return [
        *refill_stages(rank, new_head, entries),
        *handoff_stages({"$and": [VACANT, {"$not": [HAS_HANDOFF]}]}, _Q, by),
        gc_stage(),
    ]


def blocked_pipeline(rank: int, by: str) -> list[Document]:
    """Lane ``rank`` of a key held as one lease marked blocked (``bk``: the document cannot take its next
    run yet, so it holds no run of the window back, ``lanes.spilled_before``); then a free key goes to the
    oldest parked run (``by`` marks that handoff for its publisher), which a release may have held back for
    the lane's runs. A ``limit=N`` key's is ``[mark, *slot_queue.slot_fill_pipeline(by)]``."""
    return [
        lanes.mark_blocked(rank),
        *handoff_stages({"$and": [VACANT, {"$not": [HAS_HANDOFF]}]}, _Q, by),
        gc_stage(),
    ]
