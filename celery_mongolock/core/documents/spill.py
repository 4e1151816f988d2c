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

Fields of the lease document::

    sp: [{r: rank, h: next number to refill, t: next number to allocate}, ...]   # one lane per rank

A lane holds ``t - h`` numbers, each a spilled run, or a **hole**: a number whose run was never stored
(its worker stopped between the admit and the insert; its message, not acknowledged, comes again and is
spilled anew). A refill that finds a number missing stores a **tombstone** under it first, so that a
worker storing late finds its number taken and admits its run again: no run is stored behind a lane's
head, where nobody would read it.

A spilled document::

    {_id: spill_id(key, rank, n), k: key, rid: run id (unique per key), e: entry}   # a run
    {_id: spill_id(key, rank, n), k: key, rid: "gone:<_id>", x: true}            # a tombstone

The unique index on ``(k, rid)`` tells a copy of a spilled run (a message delivered again) from a new run:
its insert fails, and the copy is dropped like the copy of a parked run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from celery_mongolock.core.documents.entries import PARK_BUDGET, entry_ahead, field_of, rank_of_entry
from celery_mongolock.core.documents.handoff import handoff_stages
from celery_mongolock.core.documents.key_state import NO_SLOT_HELD, gc_stage

__all__ = [
    "HAS_HANDOFF",
    "SPILL_PROJECTION",
    "SPILL_SUFFIX",
    "VACANT",
    "Lane",
    "lanes_of",
    "low_lanes",
    "must_spill",
    "refill_filter",
    "refill_pipeline",
    "spill_fields",
    "spill_id",
    "spilled_ahead",
    "spilled_total",
    "tombstone",
]

Document = dict[str, Any]

_NOW_MS: Document = {"$toLong": "$$NOW"}
_Q: Document = {"$ifNull": ["$q", []]}
_SP: Document = {"$ifNull": ["$sp", []]}
#: The spill collection's name: the lease collection's, with this suffix.
SPILL_SUFFIX = ".parked"
#: What a reply needs to tell whether a lane runs low (``low_lanes``): the lanes, and each window
#: entry's rank.
SPILL_PROJECTION: Document = {"sp": 1, "q.pr": 1}

#: The key is free for a single lease: not held (or expired) and no ``limit=N`` hold live or handed.
VACANT: Document = {
    "$and": [
        {
            "$or": [
                {"$eq": [{"$ifNull": ["$owner", None]}, None]},
                {"$lte": [{"$toLong": "$expires_at"}, _NOW_MS]},
            ]
        },
        NO_SLOT_HELD,
    ]
}
#: A handoff is pending (made, not yet claimed).
HAS_HANDOFF: Document = {"$ne": [{"$ifNull": ["$ho", None]}, None]}


def spill_id(key: str, rank: int, number: int) -> str:
    """The ``_id`` of a lane's ``number``-th spilled run (numbers are never reused)."""
    return f"{key}\x1f{int(rank)}\x1f{int(number):012d}"


def tombstone(key: str, ident: str) -> Document:
    """The document a refill stores under a number it found missing (a hole)."""
    return {"_id": ident, "k": key, "rid": f"gone:{ident}", "x": True}


def _lane(rank: int) -> Document:
    """The lane of ``rank`` (an expression): ``{r, h, t}``, or null."""
    found = {"$filter": {"input": _SP, "as": "l", "cond": {"$eq": ["$$l.r", int(rank)]}}}
    return {"$arrayElemAt": [found, 0]}


def _held(lane: object) -> Document:
    return {"$subtract": [{"$ifNull": [field_of("t", lane), 0]}, {"$ifNull": [field_of("h", lane), 0]}]}


def spilled_total() -> Document:
    """How many numbers the key's lanes hold (spilled runs and holes)."""
    return {"$sum": {"$map": {"input": _SP, "as": "l", "in": {"$subtract": ["$$l.t", "$$l.h"]}}}}


def spilled_ahead(rank: int) -> Document:
    """How many spilled runs come before a new run of ``rank``: those of its rank (they parked before it)
    and of lower ranks (they go first)."""
    ahead = {"$filter": {"input": _SP, "as": "l", "cond": {"$lte": ["$$l.r", int(rank)]}}}
    return {"$sum": {"$map": {"input": ahead, "as": "l", "in": {"$subtract": ["$$l.t", "$$l.h"]}}}}


def _window_count(rank: int) -> Document:
    of_rank = {"$filter": {"input": _Q, "as": "e", "cond": {"$eq": [{"$ifNull": ["$$e.pr", 0]}, int(rank)]}}}
    return {"$size": of_rank}


def must_spill(entry: Mapping[str, Any], window: int, too_big: object) -> Document:
    """A run that would park here is spilled instead: its rank's lane holds runs already (they parked
    before it, and are handed the key before it), its rank's window is full, or the document could not
    take its message (``too_big``)."""
    rank = rank_of_entry(entry)
    return {"$or": [{"$gt": [_held(_lane(rank)), 0]}, {"$gte": [_window_count(rank), int(window)]}, too_big]}


def spill_fields(entry: Mapping[str, Any], spilled: object) -> Document:
    """The fields an admit that spills its run (``spilled``) sets: its lane's next number taken (a lane
    created at 0), and the answer ``ls`` (``{r, n, at}``: the rank, the number, the server's time)."""
    rank = rank_of_entry(entry)
    lane = _lane(rank)
    number = {"$ifNull": [field_of("t", lane), 0]}
    bumped = {
        "$cond": [
            {"$eq": [{"$ifNull": [lane, None]}, None]},  # (no lane: ``$arrayElemAt`` gives nothing)
            {"$concatArrays": [_SP, [{"r": int(rank), "h": 0, "t": 1}]]},
            {
                "$map": {
                    "input": _SP,
                    "as": "l",
                    "in": {
                        "$cond": [
                            {"$eq": ["$$l.r", int(rank)]},
                            {"r": "$$l.r", "h": "$$l.h", "t": {"$add": ["$$l.t", 1]}},
                            "$$l",
                        ]
                    },
                }
            },
        ]
    }
    answer = {"r": int(rank), "n": number, "at": "$$NOW"}
    return {
        "sp": {"$cond": [spilled, bumped, "$sp"]},
        "ls": {"$cond": [spilled, answer, "$$REMOVE"]},
    }


class Lane:
    """A lane as a reply shows it, and how many of its runs the window holds."""

    __slots__ = ("head", "in_window", "rank", "tail")

    def __init__(self, rank: int, head: int, tail: int, in_window: int) -> None:
        self.rank, self.head, self.tail, self.in_window = rank, head, tail, in_window

    @property
    def held(self) -> int:
        return self.tail - self.head

    def __repr__(self) -> str:
        return f"Lane(rank={self.rank}, head={self.head}, tail={self.tail}, in_window={self.in_window})"


def lanes_of(doc: Mapping[str, Any] | None) -> list[Lane]:
    """The lanes of a lease document (or a reply with ``SPILL_PROJECTION``)."""
    doc = doc or {}
    counts: dict[int, int] = {}
    for e in doc.get("q") or []:
        if isinstance(e, Mapping):
            rank = int(e.get("pr") or 0)
            counts[rank] = counts.get(rank, 0) + 1
    lanes = []
    for lane in doc.get("sp") or []:
        if isinstance(lane, Mapping):
            rank = int(lane.get("r") or 0)
            lanes.append(Lane(rank, int(lane.get("h") or 0), int(lane.get("t") or 0), counts.get(rank, 0)))
    return lanes


def low_lanes(doc: Mapping[str, Any] | None, window: int) -> list[Lane]:
    """The lanes with spilled runs whose window has room for at least half a window (or is empty): a
    refill brings them in (lowest rank first: those runs go first)."""
    low = [
        lane
        for lane in lanes_of(doc)
        if lane.held > 0 and (lane.in_window == 0 or window - lane.in_window >= max(1, window // 2))
    ]
    return sorted(low, key=lambda lane: lane.rank)


def _known(ident: str, task_id: str, delivery: object) -> Document:
    """The key knows the run ``ident`` already: parked, handed, timed out, ended, or holding it."""
    lit = {"$literal": ident}
    ids = {"$map": {"input": _Q, "as": "e", "in": "$$e.id"}}
    dead = {"$map": {"input": {"$ifNull": ["$dead", []]}, "as": "d", "in": "$$d.id"}}
    holding = {
        "$and": [
            {"$eq": ["$holder.task_id", {"$literal": task_id}]},
            {"$eq": ["$holder.delivery", {"$literal": delivery}]},
            {"$ne": [{"$ifNull": ["$owner", None]}, None]},
        ]
    }
    return {
        "$or": [
            {"$in": [lit, ids]},
            {"$eq": ["$ho.id", lit]},
            {"$in": [lit, dead]},
            {"$in": [lit, {"$ifNull": ["$seen", []]}]},
            holding,
        ]
    }


def _insert_stage(entry: Mapping[str, Any]) -> Document:
    """``q`` with the spilled run ``entry`` in its place (``entries.entry_ahead``), unless the key knows
    it already (a copy of it was parked meanwhile, or it ran)."""
    ident, stamp = str(entry["id"]), int(entry["s"])
    e = {k: {"$literal": v} for k, v in entry.items()}
    ahead = entry_ahead("$$e", stamp, ident, rank_of_entry(entry))
    in_order = {
        "$concatArrays": [
            {"$filter": {"input": _Q, "as": "e", "cond": ahead}},
            [e],
            {"$filter": {"input": _Q, "as": "e", "cond": {"$not": [ahead]}}},
        ]
    }
    known = _known(ident, str(entry["t"]), entry.get("r"))
    return {"$set": {"q": {"$cond": [known, _Q, in_order]}}}


def refill_filter(key: str, rank: int, head: int, size: int) -> Document:
    """The refill's filter: lane ``rank`` still has its head at ``head`` (no other refill moved it), and
    the document can take ``size`` more bytes (``entries.PARK_BUDGET``)."""
    fits = {"$lte": [{"$add": [{"$bsonSize": "$$ROOT"}, int(size)]}, PARK_BUDGET]}
    return {"_id": key, "sp": {"$elemMatch": {"r": int(rank), "h": int(head)}}, "$expr": fits}


def refill_pipeline(
    rank: int, new_head: int, entries: Sequence[Mapping[str, Any]], by: str
) -> list[Document]:
    """The refill of lane ``rank`` (``refill_filter``): ``entries`` (the runs stored under the numbers
    read, holes left out) join ``q`` in their places, the lane's head moves to ``new_head``, past every
    number read, and a free key goes to the oldest parked run (``by`` marks that handoff for its
    publisher)."""
    stages: list[Document] = [_insert_stage(e) for e in entries]
    return [
        *stages,
        {
            "$set": {
                "sp": {
                    "$map": {
                        "input": _SP,
                        "as": "l",
                        "in": {
                            "$cond": [
                                {"$eq": ["$$l.r", int(rank)]},
                                {"r": "$$l.r", "h": {"$literal": int(new_head)}, "t": "$$l.t"},
                                "$$l",
                            ]
                        },
                    }
                }
            }
        },
        *handoff_stages({"$and": [VACANT, {"$not": [HAS_HANDOFF]}]}, _Q, by),
        gc_stage(),
    ]
