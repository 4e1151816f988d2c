"""The lanes of a key's spilled runs (``spill``), as expressions and as a reply shows them: pure, and
imported by every layer of the lease documents (``key_state.WAITS``, ``reading``, the admit's judge).

Fields of the lease document::

    sp: [{r: rank, e: epoch, h: next number to refill, t: next number to allocate,
          sl: true: runs of a ``limit=N`` key (the last spilled run's shape),
          bk: true: the document could not take its next run at the last refill,
          pm: the greatest send stamp of the runs refills moved out of it (absent: none yet)}, ...]
                                                                                   # a lane per rank

A lane's epoch (the server's time when it was made, ms) is in each of its runs' ``_id``: a key's document
made again after it was deleted (nothing waited) numbers its runs anew, never under a number of the
document before (a run of it left behind by a refill that stopped before its delete is never read).

A lane holds ``t - h`` numbers, each a spilled run or a hole (``spill``).

A run of several keys (``ks``) is never spilled: it parks in the window, even past it. Runs of one key of
its rank may then be spilled before it (older), so it is **held back** (``held_back``: not handed the key
or a slot, and its admit takes no free one) while its rank's lane may still hold older runs: the lane
holds runs, is not blocked, and nothing it is known to have passed (``pm``, or a run of one key of its
rank in the window, which parked before every run of the lane) was sent after it. Lanes are in park
order, nearly send order: a run sent after it that left the lane (or never entered it) says the lane's
older runs have left too.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping
from typing import Any

__all__ = [
    "LEFT",
    "SPILL_PROJECTION",
    "SPILL_SUFFIX",
    "TOMBSTONE_KEEP_MS",
    "Lane",
    "any_blocked",
    "gone_between",
    "gone_rid",
    "held_back",
    "held_back_at",
    "lanes_of",
    "low_lanes",
    "mark_blocked",
    "may_take",
    "must_spill",
    "spill_bars",
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
#: entry's rank and whether it is a run of several keys.
SPILL_PROJECTION: Document = {"sp": 1, "q.pr": 1, "q.ks": 1, "q.g": 1}


def spill_id(key: str, rank: int, epoch: int, number: int) -> str:
    """The ``_id`` of the ``number``-th spilled run of the lane of ``rank`` made at ``epoch``."""
    return f"{key}\x1f{int(rank)}\x1f{int(epoch)}\x1f{int(number):012d}"


#: How long a tombstone is kept (``xa``, the spill collection's TTL index): far longer than a worker can
#: take between the admit that gave its run a number and the store under it (its store gives up after the
#: store's operation timeout).
TOMBSTONE_KEEP_MS = 24 * 3600 * 1000


def gone_rid(ident: str) -> str:
    """The ``rid`` of the tombstone under ``ident`` (the ``(k, rid)`` index counts a lane's tombstones)."""
    return f"gone:{ident}"


def tombstone(key: str, ident: str, now: _dt.datetime) -> Document:
    """The document a refill stores under a number it found missing (a hole): a worker that stores its run
    late finds the number taken (``spill``). Deleted by the server a day after ``now`` (``xa``)."""
    keep = _dt.timedelta(milliseconds=TOMBSTONE_KEEP_MS)
    return {"_id": ident, "k": key, "rid": gone_rid(ident), "x": True, "xa": now + keep}


#: A spilled run that left before its turn (superseded, revoked, dropped), made a tombstone where it is
#: (an update pipeline): counted out of its lane's runs by ``gone_between``, deleted by the server a day
#: later, and a late store of the run under its number still finds it taken.
LEFT: list[Document] = [
    {
        "$set": {
            "x": True,
            "rid": {"$concat": ["gone:", "$_id"]},
            "xa": {"$add": ["$$NOW", TOMBSTONE_KEEP_MS]},
        }
    },
    {"$unset": ["e"]},
]


def gone_between(key: str, lane: Lane) -> Document:
    """The filter of the tombstones among a lane's numbers still to refill (``[h, t)``: a range of the
    ``(k, rid)`` index, which reads only tombstones)."""
    return {
        "k": key,
        "rid": {
            "$gte": gone_rid(lane.spill_id(key, lane.head)),
            "$lt": gone_rid(lane.spill_id(key, lane.tail)),
        },
    }


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


def _single(e: str) -> Document:
    """Entry ``e`` takes its place as a run of one key does: a run of one key (no ``ks``), or a ``Queue``
    run of several keys, which takes them one at a time (no set signature ``g``: it may be spilled, and
    is never held back). Only a ``Replace`` run of a set, on its set's gate (where its entry
    carries ``g``), waits in send order in the document."""
    return {
        "$or": [
            {"$eq": [{"$ifNull": [f"{e}.ks", None]}, None]},
            {"$eq": [{"$ifNull": [f"{e}.g", None]}, None]},
        ]
    }


def spill_bars(q: object = _Q) -> Document:
    """``[{r, p}, ...]``: the lanes that may hold runs back from the window's runs of several keys
    (``held_back``): those that hold runs and are not blocked (``bk``), each with ``p``, the latest send
    stamp it is known to have passed (its ``pm``, or a run of one key of its rank in the window ``q``,
    which parked before every run of its lane; null: none). Computed once per command."""
    holding = {
        "$and": [
            {"$gt": [{"$subtract": ["$$bl.t", "$$bl.h"]}, 0]},
            {"$ne": [{"$ifNull": ["$$bl.bk", False]}, True]},
        ]
    }
    of_rank = {"$and": [_single("$$bw"), {"$eq": [{"$ifNull": ["$$bw.pr", 0]}, "$$bl.r"]}]}
    stamps = {
        "$map": {"input": {"$filter": {"input": q, "as": "bw", "cond": of_rank}}, "as": "bw", "in": "$$bw.s"}
    }
    passed = {"$max": [{"$ifNull": ["$$bl.pm", None]}, {"$max": stamps}]}
    return {
        "$map": {
            "input": {"$filter": {"input": _SP, "as": "bl", "cond": holding}},
            "as": "bl",
            "in": {"r": "$$bl.r", "p": passed},
        }
    }


def held_back_at(rank: object, stamp: object, bars: object) -> Document:
    """A run of several keys of ``rank`` sent at ``stamp`` (expressions) is held back: older runs of one
    key of its rank may still be spilled (``bars``: ``spill_bars``; a lane that passed no run sent after
    it)."""
    behind = {
        "$and": [
            {"$eq": ["$$sb.r", rank]},
            {"$lte": [{"$ifNull": ["$$sb.p", -1]}, stamp]},
        ]
    }
    return {
        "$gt": [{"$size": {"$filter": {"input": {"$ifNull": [bars, []]}, "as": "sb", "cond": behind}}}, 0]
    }


def held_back(entry: str, bars: object) -> Document:
    """The parked entry ``entry`` (``$$e``) is a run of several keys held back (``held_back_at``): not
    handed the key or a slot yet. A run of one key never is."""
    rank = {"$ifNull": [f"{entry}.pr", 0]}
    return {"$and": [{"$not": [_single(entry)]}, held_back_at(rank, f"{entry}.s", bars)]}


def may_take(rank: int, stamp: int) -> Document:
    """A run of several keys of ``rank`` sent at ``stamp`` may take a free key (or slot) at its admit, as
    its parked entry would be handed it: no run of a lower rank is spilled (``spilled_before``), and it
    is not held back for older runs of its rank spilled (``held_back_at``). Else it parks, and the refill
    its reply leads to brings those runs first."""
    return {
        "$and": [
            {"$eq": [spilled_before(int(rank)), 0]},
            {"$not": [held_back_at(int(rank), {"$literal": int(stamp)}, spill_bars())]},
        ]
    }


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
    changed = {
        "r": "$$l.r",
        "e": "$$l.e",
        "h": "$$l.h",
        "t": "$$l.t",
        "sl": _kept("$$l.sl"),
        "pm": _kept("$$l.pm"),
        **fields,
    }
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
    """The lanes of a lease document (or a reply with ``SPILL_PROJECTION``); ``in_window``: the runs of
    one key of its rank in the window."""
    doc = doc or {}
    counts: dict[int, int] = {}
    for e in doc.get("q") or []:
        # (runs of several keys are not counted: they park past the window, and one held back there,
        # ``held_back``, waits for the refill that this count decides)
        if isinstance(e, Mapping) and (e.get("ks") is None or e.get("g") is None):
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
