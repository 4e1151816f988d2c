"""The lanes of a key's spilled runs (``spill``), as expressions and as a reply shows them: pure, and
imported by every layer of the lease documents (``key_state.WAITS``, ``reading``, the admit's judge).

Fields of the lease document::

    sp: [{r: rank, e: epoch, h: next number to refill, t: next number to allocate,
          sl: true: runs of a ``limit=N`` key (the last spilled run's shape),
          bk: true: the document could not take its next run at the last refill}, ...]  # a lane per rank

A lane's epoch (the server's time when it was made, ms) is in each of its runs' ``_id``: a key's document
made again after it was deleted (nothing waited) numbers its runs anew, never under a number of the
document before (a run of it left behind by a refill that stopped before its delete is never read).

A lane holds ``t - h`` numbers, each a spilled run or a hole (``spill``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "SPILL_PROJECTION",
    "SPILL_SUFFIX",
    "Lane",
    "any_blocked",
    "lanes_of",
    "low_lanes",
    "mark_blocked",
    "must_spill",
    "spill_fields",
    "spill_id",
    "spilled_ahead",
    "spilled_before",
    "spilled_total",
    "tombstone",
    "with_lane",
]

Document = dict[str, Any]

_Q: Document = {"$ifNull": ["$q", []]}
_SP: Document = {"$ifNull": ["$sp", []]}
#: The spill collection's name: the lease collection's, with this suffix.
SPILL_SUFFIX = ".parked"
#: What a reply needs to tell whether a lane runs low (``low_lanes``): the lanes, and each window
#: entry's rank.
SPILL_PROJECTION: Document = {"sp": 1, "q.pr": 1}


def spill_id(key: str, rank: int, epoch: int, number: int) -> str:
    """The ``_id`` of the ``number``-th spilled run of the lane of ``rank`` made at ``epoch``."""
    return f"{key}\x1f{int(rank)}\x1f{int(epoch)}\x1f{int(number):012d}"


def tombstone(key: str, ident: str) -> Document:
    """The document a refill stores under a number it found missing (a hole), kept: a worker that stores
    its run late finds the number taken (``spill``)."""
    return {"_id": ident, "k": key, "rid": f"gone:{ident}", "x": True}


def _get(field: str, doc: object) -> Document:
    return {"$getField": {"field": field, "input": doc}}


def _lane(rank: int) -> Document:
    """The lane of ``rank`` (an expression): ``{r, h, t}``, or nothing."""
    found = {"$filter": {"input": _SP, "as": "l", "cond": {"$eq": ["$$l.r", int(rank)]}}}
    return {"$arrayElemAt": [found, 0]}


def _held(lane: object) -> Document:
    return {"$subtract": [{"$ifNull": [_get("t", lane), 0]}, {"$ifNull": [_get("h", lane), 0]}]}


def spilled_total() -> Document:
    """How many numbers the key's lanes hold (spilled runs and holes)."""
    return {"$sum": {"$map": {"input": _SP, "as": "l", "in": {"$subtract": ["$$l.t", "$$l.h"]}}}}


def spilled_ahead(rank: int) -> Document:
    """How many spilled runs come before a new run of ``rank``: those of its rank (they parked before it)
    and of lower ranks (they go first)."""
    ahead = {"$filter": {"input": _SP, "as": "l", "cond": {"$lte": ["$$l.r", int(rank)]}}}
    return {"$sum": {"$map": {"input": ahead, "as": "l", "in": {"$subtract": ["$$l.t", "$$l.h"]}}}}


def spilled_before(rank: object) -> Document:
    """How many numbers the lanes of ranks lower than ``rank`` (an expression) hold: runs that go before a
    run of that rank, whatever its place in the window. A lane whose next run the key's document cannot
    take yet (``bk``, set by a refill that found it so) holds none back: the runs in the window go on, and
    make room for it."""
    lower = {"$and": [{"$lt": ["$$l.r", rank]}, {"$ne": [{"$ifNull": ["$$l.bk", False]}, True]}]}
    ahead = {"$filter": {"input": _SP, "as": "l", "cond": lower}}
    return {"$sum": {"$map": {"input": ahead, "as": "l", "in": {"$subtract": ["$$l.t", "$$l.h"]}}}}


def _window_count(rank: int) -> Document:
    of_rank = {"$filter": {"input": _Q, "as": "e", "cond": {"$eq": [{"$ifNull": ["$$e.pr", 0]}, int(rank)]}}}
    return {"$size": of_rank}


def must_spill(rank: int, window: int, too_big: object) -> Document:
    """A run of ``rank`` that would park here is spilled instead: its rank's lane holds runs already (they
    parked before it, and are handed the key before it), its rank's window is full, or the document could
    not take its message (``too_big``)."""
    return {"$or": [{"$gt": [_held(_lane(rank)), 0]}, {"$gte": [_window_count(rank), int(window)]}, too_big]}


def _kept(field: str) -> Document:
    """``field`` as it is, or no field at all when it is missing (never a null in its place)."""
    return {"$ifNull": [field, "$$REMOVE"]}


def with_lane(rank: int, fields: Document) -> Document:
    """``sp`` with the lane of ``rank`` given ``fields`` (expressions; ``$$l`` is the lane)."""
    changed = {"r": "$$l.r", "e": "$$l.e", "h": "$$l.h", "t": "$$l.t", "sl": _kept("$$l.sl"), **fields}
    return {
        "$map": {
            "input": _SP,
            "as": "l",
            "in": {"$cond": [{"$eq": ["$$l.r", int(rank)]}, changed, "$$l"]},
        }
    }


def mark_blocked(rank: int) -> Document:
    """The stage that marks the lane of ``rank`` blocked (``bk``: the key's document cannot take its next
    run yet, so the lane holds no run of the window back, ``spilled_before``)."""
    return {"$set": {"sp": with_lane(rank, {"bk": True})}}


def spill_fields(rank: int, spilled: object, *, slots: bool = False) -> Document:
    """The fields an admit that spills its run of ``rank`` (``spilled``) sets: its lane's next number
    taken (a lane made at 0, its epoch now; ``slots``: the run is of a ``limit=N`` key, whose refill hands
    slots), and the answer ``ls`` (``{r, e, n, at}``: the rank, the lane's epoch, the number, the
    server's time)."""
    lane = _lane(rank)
    number = {"$ifNull": [_get("t", lane), 0]}
    shape = {"sl": True} if slots else {}
    made = {"r": int(rank), "e": {"$toLong": "$$NOW"}, "h": 0, "t": 1, **shape}
    bumped = {
        "$cond": [
            {"$eq": [{"$ifNull": [lane, None]}, None]},  # (no lane: ``$arrayElemAt`` gives nothing)
            {"$concatArrays": [_SP, [made]]},
            with_lane(rank, {"t": {"$add": ["$$l.t", 1]}, "sl": True if slots else "$$REMOVE"}),
        ]
    }
    epoch = {"$ifNull": [_get("e", lane), {"$toLong": "$$NOW"}]}
    answer = {"r": int(rank), "e": epoch, "n": number, "at": "$$NOW"}
    return {
        "sp": {"$cond": [spilled, bumped, "$sp"]},
        "ls": {"$cond": [spilled, answer, "$$REMOVE"]},
    }


class Lane:
    """A lane as a reply shows it, and how many of its runs the window holds."""

    __slots__ = ("epoch", "head", "in_window", "rank", "slots", "tail")

    def __init__(
        self, rank: int, head: int, tail: int, in_window: int, epoch: int = 0, *, slots: bool = False
    ) -> None:
        self.rank, self.head, self.tail, self.in_window = rank, head, tail, in_window
        self.epoch = epoch
        #: Its runs are of a ``limit=N`` key: a refill hands the key's free slots (``slot_queue``).
        self.slots = slots

    def spill_id(self, key: str, number: int) -> str:
        return spill_id(key, self.rank, self.epoch, number)

    @property
    def held(self) -> int:
        return self.tail - self.head

    def __repr__(self) -> str:
        return (
            f"Lane(rank={self.rank}, epoch={self.epoch}, head={self.head}, tail={self.tail}, "
            f"in_window={self.in_window})"
        )


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
            head, tail, epoch = (int(lane.get(f) or 0) for f in ("h", "t", "e"))
            lanes.append(Lane(rank, head, tail, counts.get(rank, 0), epoch, slots=bool(lane.get("sl"))))
    return lanes


def any_blocked(doc: Mapping[str, Any] | None) -> bool:
    """Whether a reply shows a lane whose next run the document could not take at its last refill
    (``bk``)."""
    return any(isinstance(lane, Mapping) and lane.get("bk") for lane in (doc or {}).get("sp") or [])


def low_lanes(doc: Mapping[str, Any] | None, window: int) -> list[Lane]:
    """The lanes with spilled runs whose window has room for at least half a window (or is empty): a
    refill brings them in (lowest rank first: those runs go first)."""
    low = [
        lane
        for lane in lanes_of(doc)
        if lane.held > 0 and (lane.in_window == 0 or window - lane.in_window >= max(1, window // 2))
    ]
    return sorted(low, key=lambda lane: lane.rank)
