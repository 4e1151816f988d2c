"""The admit of a queued run on a ``limit=N`` key, as a pure pipeline builder (no I/O): the engine of
``admit_stages`` with a key of N slots (``slots``) for its shape. The holds and the handoff of a slot are
described in ``slot_queue``'s module doc.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery_mongolock.core.documents import lanes, sets, slot_sets
from celery_mongolock.core.documents import slots as slot_docs
from celery_mongolock.core.documents.admit_stages import (
    TOOK,
    AdmitRun,
    Shape,
    judge,
    replace_fields,
    sup_update,
    without_entry,
)
from celery_mongolock.core.documents.entries import entry_due, field_of, none_ahead, park_exprs
from celery_mongolock.core.documents.handoff import admit_marker
from celery_mongolock.core.documents.key_state import (
    KIND_SLOTS,
    SINGLE_HELD,
    SINGLE_IN_USE,
    gc_stage,
    parked_kind,
)
from celery_mongolock.core.documents.slot_queue import (
    SET_RUNS,
    fence_base,
    fill_stages,
    has_handoff,
    normalize_stages,
)

__all__ = ["slot_admit_pipeline"]

Document = dict[str, Any]

_NOW_MS: Document = {"$toLong": "$$NOW"}
_HS: Document = {"$ifNull": ["$hs", []]}
_Q: Document = {"$ifNull": ["$q", []]}
#: The slots handed to parked runs and not yet claimed.
_HANDED: Document = {"$filter": {"input": _HS, "as": "e", "cond": has_handoff("$$e")}}


def slot_admit_pipeline(
    token: str,
    ttl_ms: int,
    holder: Mapping[str, Any],
    limit: int,
    *,
    entry: Mapping[str, Any],
    timeout_ms: int | None,
    claim: str | None,
    max_length: int | None,
    replace: bool = False,
    debounce_ms: int | None = None,
    due: bool = False,
    max_wait_ms: int | None = None,
    waited_ms: int | None = None,
    min_hold_ms: int = 0,
    group: str | None = None,
    window: int | None = None,
    gone: tuple[int, tuple[tuple[int, int, int], ...]] | None = None,
) -> list[Document]:
    """The admit of a queued run on a ``limit=N`` key (one command): take a free slot when no older run
    is parked, claim the slot handed to this run, or park the run; then hand every free slot to the
    oldest parked runs. The outcomes are those of ``queue.admit_pipeline`` (in ``lo``).
    ``min_hold_ms``: the slot taken or claimed stays taken at least that long (``slots`` module doc).
    ``group`` (with ``replace``): the signature of the run's set of keys (``Replace`` with ``keys=`` and a
    limit): supersession among the runs of that set only (``slot_sets``). ``window`` (a plain ``Queue``
    run): the most runs of one rank kept in ``q``; a run behind them is ``spilled`` (``spill``).

    The stages (``admit_stages``): expire the holders, judge the run, take or park, hand over, record.
    """
    run = AdmitRun(
        entry=entry,
        timeout_ms=timeout_ms,
        claim=claim,
        max_length=max_length,
        replace=replace,
        debounce_ms=debounce_ms,
        due=due,
        group=group,
        max_wait_ms=max_wait_ms,
        window=window if window and not (replace or debounce_ms or group) else None,
        gone=gone,
    )
    take_back: list[Document] = []
    if run.by_set and run.group is not None:
        # The newest send of its set the key knows (parked, taking, claiming or due a slot): the older
        # runs of its set leave the key, their reserved or handed slots freed (``slot_sets``).
        newest = {"$in": ["$__o", ["parked", "acquired", "claimed", "due"]]}
        if run.debounce_ms and run.max_wait_ms:
            # (computed before the older runs leave: the burst this run continues began with them)
            take_back.append(slot_sets.burst_stage(entry, run.group, run.burst, int(run.max_wait_ms)))
        take_back.append(slot_sets.take_back_stage(entry, run.group, newest, run.burst, run.max_wait_ms))
    taken = _Taken(token, int(ttl_ms), holder, waited_ms, min_hold_ms, int(limit))
    shape = _n_slots(run, token, int(limit))
    return [
        *normalize_stages(keep_owner=claim),
        *run.burst_stages(),
        {"$set": {"__o": judge(run, shape), "__base": fence_base()}},
        {"$set": {"__new": {"$in": ["$__o", ["acquired", "due"]]}}},
        *take_back,
        {"$set": _take_or_park_fields(run, shape, taken)},
        {"$unset": ["__o", "__new", "__base", "__bu", "__fw", "__bid"]},
        *fill_stages(admit_marker(token)),
        gc_stage(),
    ]


def _room(limit: int) -> Document:
    """A slot is free: fewer live holds than the limit, and the key not held as a single lease."""
    return {
        "$and": [{"$lt": [{"$size": _HS}, slot_docs.effective_limit(_HS, limit)]}, {"$not": [SINGLE_HELD]}]
    }


def _n_slots(run: AdmitRun, token: str, limit: int) -> Shape:
    """The judge's questions answered for a key of ``limit`` slots."""
    room = _room(limit)
    lit = {"$literal": run.ident}
    head = {"$arrayElemAt": [_Q, 0]}
    first = none_ahead(_Q, run.stamp, run.ident, run.rank)
    mine = {
        "$and": [
            {"$not": [has_handoff("$$e")]},
            {"$not": [slot_docs.released("$$e")]},  # (over: kept for its min hold)
            {"$eq": ["$$e.h.task_id", {"$literal": run.entry["t"]}]},
            {"$eq": ["$$e.h.delivery", {"$literal": run.entry.get("r")}]},
        ]
    }
    running = {"$gt": [{"$size": {"$filter": {"input": _HS, "as": "e", "cond": mine}}}, 0]}
    claimable = None
    if run.claim is not None:
        claim = {"$literal": run.claim}
        to_it = {"$and": [{"$eq": ["$$e.o", claim]}, {"$eq": ["$$e.ho.tk", claim]}]}
        handed_to_it = {"$gt": [{"$size": {"$filter": {"input": _HANDED, "as": "e", "cond": to_it}}}, 0]}
        # (never while the key is held or handed as a single lease: a key mixed with single leases)
        claimable = {"$and": [handed_to_it, {"$not": [SINGLE_HELD]}]}
    due_now = None
    if run.due:
        due_now = {
            "$and": [
                room,
                {"$eq": [field_of("id", head), lit]},
                entry_due(head),
                {"$not": [sets.behind_its_set(head, SET_RUNS)]},
            ]
        }
    handed_ids = {"$map": {"input": _HANDED, "as": "e", "in": "$$e.ho.id"}}
    in_set: list[Document] = []
    if run.by_set and run.group is not None:
        in_set = slot_sets.superseded_cases(
            run.group, run.stamp, task_id=str(run.entry["t"]), burst=run.burst
        )
    free: Document = {"$and": [room, first]}
    if run.window:  # (nobody spilled before it waits: a run spilled goes before a newer one)
        free["$and"].append({"$eq": [lanes.spilled_ahead(run.rank), 0]})
    elif run.entry.get("ks"):
        free["$and"].append(lanes.may_take(run.rank, run.stamp))
    return Shape(
        ours={"$in": [{"$literal": token}, {"$map": {"input": _HS, "as": "e", "in": "$$e.o"}}]},
        ours_outcome="mine",
        claimable=claimable,
        due_now=due_now,
        handed_here={"$in": [lit, handed_ids]},
        running=running,
        superseded_in_set=in_set,
        handed=slot_sets.HANDED_ENTRIES,
        free=free,
        room=room,
        other_kind=SINGLE_IN_USE,
    )


@dataclass(frozen=True)
class _Taken:
    """The hold a run takes or claims: its token, lease time, holder, wait and minimum hold."""

    token: str
    ttl_ms: int
    holder: Mapping[str, Any]
    waited_ms: int | None
    min_hold_ms: int
    limit: int

    def new_hold(self) -> Document:
        """A free slot taken (the lowest free slot number, the fence of this command)."""
        used = {"$map": {"input": _HS, "as": "e", "in": "$$e.s"}}
        return {
            "o": {"$literal": self.token},
            "f": "$__base",
            "s": {"$min": {"$setDifference": [{"$range": [0, self.limit]}, used]}},
            "x": {"$add": ["$$NOW", self.ttl_ms]},
            "t": self.ttl_ms,
            "a": "$$NOW",
            "h": {"$literal": dict(self.holder)},
            "w": None if self.waited_ms is None else int(self.waited_ms),
            **slot_docs.min_hold_fields(self.min_hold_ms),
        }

    def claimed_hold(self) -> Document:
        """The slot handed to the run (``$$e``), claimed: its fence kept, the wait counted from parking."""
        since_parked = {"$subtract": [_NOW_MS, {"$toLong": {"$ifNull": ["$$e.ho.at", "$$NOW"]}}]}
        return {
            "$mergeObjects": [
                "$$e",
                {
                    "o": {"$literal": self.token},
                    "x": {"$add": ["$$NOW", self.ttl_ms]},
                    "t": self.ttl_ms,
                    "h": {"$literal": dict(self.holder)},
                    "w": {"$max": [0, since_parked]},
                    "ho": None,
                    # from the claim: when the run takes the slot
                    **slot_docs.min_hold_fields(self.min_hold_ms),
                },
            ]
        }


def _holds(run: AdmitRun, taken: _Taken) -> Document:
    """Take or park, the holds: a new one appended (``__new``), or the claimed one taken over."""
    claimed = {"$cond": [{"$eq": ["$$e.o", {"$literal": run.claim}]}, taken.claimed_hold(), "$$e"]}
    return {
        "$switch": {
            "branches": [
                {"case": "$__new", "then": {"$concatArrays": [_HS, [taken.new_hold()]]}},
                {
                    "case": {"$eq": ["$__o", "claimed"]},
                    "then": {"$map": {"input": _HS, "as": "e", "in": claimed}},
                },
            ],
            "default": "$hs",
        }
    }


def _take_or_park_fields(run: AdmitRun, shape: Shape, taken: _Taken) -> Document:
    """Take or park, the fields: the holds, the fence and limit, the queue, the supersessions and the
    outcome (``lo``: ``mine``, an earlier attempt's own hold, is ``acquired``)."""
    parked_q: object
    superseded: object
    if run.by_set:
        parked_q = slot_sets.parked_queue(
            run.entry,
            run.timeout_ms,
            str(run.group),
            run.burst,
            debounce_ms=run.debounce_ms,
            max_wait_ms=run.max_wait_ms,
        )
        superseded = []
    else:
        parked_q, superseded = park_exprs(
            run.entry, run.timeout_ms, run.debounce_ms, replace=run.replace, max_wait_ms=run.max_wait_ms
        )
    parked = {"$eq": ["$__o", "parked"]}
    no_limit_yet = {"$eq": [{"$ifNull": ["$lim", None]}, None]}
    fields: Document = {
        "hs": _holds(run, taken),
        "fence": {"$cond": ["$__new", "$__base", "$fence"]},
        "lim": {
            "$cond": [
                {"$or": ["$__new", no_limit_yet]},
                slot_docs.effective_limit(_HS, taken.limit),
                "$lim",
            ]
        },
        "q": {
            "$switch": {
                "branches": [
                    {"case": parked, "then": parked_q},
                    {"case": {"$eq": ["$__o", "due"]}, "then": without_entry(run.ident)},
                ],
                "default": "$q",
            }
        },
        "sup": sup_update(parked, superseded),
        "qk": parked_kind(KIND_SLOTS, {"$in": ["$__o", ["parked", "spilled"]]}),
        "lo": {"$cond": [{"$eq": ["$__o", "mine"]}, "acquired", "$__o"]},
        "lt": {"$literal": taken.token},  # whose answer ``lo`` is (``queue``'s fields)
    }
    took = {"$in": ["$__o", TOOK]}
    if run.by_set and run.group is not None:
        newer = slot_sets.newer_by(run.group, run.stamp, task_id=str(run.entry["t"]), burst=run.burst)
        fields["lo_by"] = {"$cond": [{"$eq": ["$__o", "superseded"]}, newer, None]}
        fields["lg"] = sets.lg_update(run.group, run.stamp, str(run.entry["t"]), took)
    elif run.replace:
        fields.update(replace_fields(run, took, shape))
    if run.window:  # (a run spilled: its number in its rank's lane)
        fields.update(lanes.spill_fields(run.rank, {"$eq": ["$__o", "spilled"]}, slots=True))
    return fields
