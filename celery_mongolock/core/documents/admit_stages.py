"""The admit of a queued run, one engine for both key shapes: the stages that judge the run and record
what it did, written once for a key held as one lease (``queue``) and a key of N slots (``slot_admit``).

An admit is one command of five stages, in this order:

1. **expire the holders** (slots only: expired holds leave, handed ones go back to the queue);
2. **judge the run** (``judge``): one outcome of ``queue.ADMIT_OUTCOMES`` in ``__o``, decided in the
   same order for both shapes: its own hold again, a claim, its delayed copy due, a copy of a run the
   key knows (parked, handed, timed out, retried, over, running), a newer send (``Replace``), then take,
   park or full;
3. **take or park** (each shape's own fields: the lease, or a slot; the queue and the supersessions);
4. **hand over** (the key, or every free slot, to the oldest due parked run);
5. **record** (``gc_stage``).

A shape answers the questions of stage 2 as expressions (``Shape``); the order of the answers, the
copies' cases and the fields of ``Replace`` are the engine's (here), the same for both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery_mongolock.core.documents import sets
from celery_mongolock.core.documents.copies import later_attempt, retries_of
from celery_mongolock.core.documents.entries import MAX_PARKED, rank_of_entry, would_pass_budget
from celery_mongolock.core.documents.lanes import must_spill, spilled_total

__all__ = [
    "TOOK",
    "AdmitRun",
    "Shape",
    "judge",
    "newer_sends",
    "replace_fields",
    "sup_update",
    "without_entry",
]

Document = dict[str, Any]

_Q: Document = {"$ifNull": ["$q", []]}
#: The outcomes by which the run took the key (or a slot of it).
TOOK = ["acquired", "claimed", "due"]


@dataclass(frozen=True)
class AdmitRun:
    """The run an admit is for, and what its task's policy asks (the admit builders' arguments)."""

    entry: Mapping[str, Any]
    timeout_ms: int | None
    claim: str | None
    max_length: int | None
    replace: bool = False
    debounce_ms: int | None = None
    due: bool = False
    group: str | None = None
    max_wait_ms: int | None = None
    #: a plain ``Queue`` run on a single lease: the most runs of one rank the document keeps parked; the
    #: others are spilled (``spill``). None: every parked run in the document (up to ``cap``).
    window: int | None = None
    #: ``max_length``: how many numbers of the key's lanes a count found to be tombstones (runs that left
    #: before their turn), and each lane's ``(rank, epoch, head)`` then: left out of the count while no
    #: lane moved since (``gone_allowance``; a lane that moved may have passed them).
    gone: tuple[int, tuple[tuple[int, int, int], ...]] | None = None

    @property
    def ident(self) -> str:
        return str(self.entry["id"])

    @property
    def stamp(self) -> int:
        return int(self.entry["s"])

    @property
    def rank(self) -> int:
        """Its place among runs of other priorities (``entries.entry_ahead``)."""
        return rank_of_entry(self.entry)

    @property
    def burst(self) -> str | None:
        """``Replace(debounce=..., max_wait=...)`` with ``keys=``: the run's burst on this key, as the
        field ``__bu`` that ``burst_stages`` sets before the judge (``sets.run_burst``: its own entry's,
        else the one it learned on its set's gate, ``bu`` in its entry; null before it knows
        it), None for other runs."""
        return "$__bu" if self.by_set and self.max_wait_ms else None

    def burst_stages(self) -> list[Document]:
        """The stage that computes the run's burst once per command (``burst``), before the judge; none
        for other runs. Its field is removed with the command's other flags."""
        if self.burst is None:
            return []
        bu = self.entry.get("bu")
        return [{"$set": {"__bu": sets.run_burst(self.ident, bu if isinstance(bu, int) else None)}}]

    @property
    def by_set(self) -> bool:
        """``Replace`` with ``keys=``: supersession among the runs of one set of keys (``group``)."""
        return self.replace and self.group is not None

    @property
    def cap(self) -> int:
        """The longest queue: every parked run lives in the key's one document (16 MiB), so MAX_PARKED
        bounds it whatever the task says."""
        return MAX_PARKED if self.max_length is None else min(int(self.max_length), MAX_PARKED)


@dataclass(frozen=True)
class Shape:
    """A key shape's answers to the judge's questions, each an expression on the document."""

    #: this admit's own hold, taken by an earlier attempt whose reply was lost; and its outcome's name
    ours: Document
    ours_outcome: str
    #: the key (or a slot) is handed to this run and may be claimed with its token (``claim`` runs only)
    claimable: Document | None
    #: this run's delayed copy may take its entry's turn now (``due`` runs only)
    due_now: Document | None
    #: this run is handed the key or a slot and has not claimed it
    handed_here: Document
    #: this run holds the key or a slot now
    running: Document
    #: ``Replace`` with ``keys=``: the cases of a newer send of the run's set (empty otherwise)
    superseded_in_set: list[Document]
    #: the entries the key (or a slot of it) is handed or reserved to and not yet claimed, an array
    #: expression (``Replace``: among the newer sends)
    handed: object
    #: the run may take the key now (nobody older waits); and it may park and be handed the key at once
    free: Document
    room: Document
    #: the key is in use as the other kind of key (a single lease for a ``limit=N`` run, slots for a
    #: run of a single lease): the run does not park here (``mixed``)
    other_kind: Document


def copy_cases(run: AdmitRun, shape: Shape) -> list[Document]:
    """A copy of a run the key knows: parked, handed or timed out (``dup``), an attempt whose body
    retried (``retried``), over (``done``), holding the key now (``running``)."""
    lit = {"$literal": run.ident}
    ids = {"$map": {"input": _Q, "as": "e", "in": "$$e.id"}}
    dead_ids = {"$map": {"input": {"$ifNull": ["$dead", []]}, "as": "d", "in": "$$d.id"}}
    # (timed out while parked: its result is being written, never run it after that)
    cases = [
        {"case": {"$or": [{"$in": [lit, ids]}, shape.handed_here, {"$in": [lit, dead_ids]}]}, "then": "dup"}
    ]
    retries = retries_of(run.entry.get("r"))
    if retries is not None:
        # A copy of an attempt whose body retried (a later attempt is known here): never run again.
        cases.append({"case": later_attempt(str(run.entry["t"]), retries), "then": "retried"})
    cases += [
        {"case": {"$in": [lit, {"$ifNull": ["$seen", []]}]}, "then": "done"},
        {"case": shape.running, "then": "running"},
    ]
    return cases


def newer_sends(run: AdmitRun, shape: Shape) -> Document:
    """``Replace`` (one set of keys per key): ``[{s, t}, ...]``, the sends newer than this run the key
    knows: the newest that got it (``last``), the parked runs and those handed it (``shape.handed``).
    Never the run itself, whatever stamp a copy of it carries (``sets.other_run``): a run told it was
    superseded by itself would end without running."""
    task_id = str(run.entry["t"])
    last = {"$cond": [{"$ne": [{"$ifNull": ["$last", None]}, None]}, ["$last"], []]}
    newer = {"$and": [{"$gt": [{"$ifNull": ["$$e.s", -1]}, run.stamp]}, sets.other_run("$$e", task_id)]}
    known = {"$concatArrays": [last, _Q, shape.handed]}
    return {
        "$map": {
            "input": {"$filter": {"input": known, "as": "e", "cond": newer}},
            "as": "e",
            "in": {"s": "$$e.s", "t": "$$e.t"},
        }
    }


def newer_send_cases(run: AdmitRun, shape: Shape) -> list[Document]:
    """``Replace`` (one set of keys per key): a newer send got the key, is parked, or is handed it."""
    return [{"case": {"$gt": [{"$size": newer_sends(run, shape)}, 0]}, "then": "superseded"}]


def judge(run: AdmitRun, shape: Shape) -> Document:
    """Stage 2, judge the run: the outcome, an expression (``__o``), the first case that holds."""
    branches: list[Document] = [{"case": shape.ours, "then": shape.ours_outcome}]
    if shape.claimable is not None:
        branches.append({"case": shape.claimable, "then": "claimed"})
    if shape.due_now is not None:
        branches.append({"case": shape.due_now, "then": "due"})
    branches += copy_cases(run, shape)
    # (before ``stale``: a claim of a run whose reservation a newer send of its set took back)
    branches += shape.superseded_in_set
    if run.claim is not None:
        # A handoff message whose claim failed, of a run no longer parked or handed (timed out, revoked,
        # handed again with another token): never a new run.
        branches.append({"case": {"$literal": True}, "then": "stale"})
    # (before taking or parking: a run parked behind the other kind of key would be handed what it cannot
    # claim; it comes back later instead, as the contended runs of other policies do. And before a newer
    # send supersedes it: the runs of the other kind parked meanwhile are not sends it waits among, and a
    # Replace run that comes back would be superseded by them, never to run: a new user's trial, stop 62)
    branches.append({"case": shape.other_kind, "then": "mixed"})
    if run.replace and not run.by_set:
        branches += newer_send_cases(run, shape)
    if not run.debounce_ms:
        branches.append({"case": shape.free, "then": "acquired"})
    if run.window:
        if run.max_length is not None:
            # (the user's cap counts the spilled runs too; a free key still takes a run, as below)
            total = {"$subtract": [{"$add": [{"$size": _Q}, spilled_total()]}, gone_allowance(run.gone)]}
            at_cap = {"$and": [{"$not": [shape.room]}, {"$gte": [total, int(run.max_length)]}]}
            branches.append({"case": at_cap, "then": "full"})
        branches.append(
            {"case": must_spill(run.rank, run.window, would_pass_budget(run.entry)), "then": "spilled"}
        )
    # (The key's document cannot take this run's message: MongoDB's 16 MiB limit, before the count's cap.)
    branches.append({"case": would_pass_budget(run.entry), "then": "full"})
    branches.append({"case": shape.room, "then": "parked"})  # and handed to the oldest (when due)
    branches.append({"case": {"$gte": [{"$size": _Q}, run.cap]}, "then": "full"})
    return {"$switch": {"branches": branches, "default": "parked"}}


def gone_allowance(gone: tuple[int, tuple[tuple[int, int, int], ...]] | None) -> Document | int:
    """How many of the key's spilled numbers the ``max_length`` count leaves out (``AdmitRun.gone``): the
    tombstones counted, while every lane is where it was when they were counted (a tombstone leaves a
    lane only when a refill moves its head past it; one made since is not left out: never under the
    true count), else none."""
    if not gone or gone[0] <= 0:
        return 0
    count, heads = gone
    now = {
        "$map": {
            "input": {"$ifNull": ["$sp", []]},
            "as": "l",
            "in": [{"$ifNull": ["$$l.r", 0]}, {"$ifNull": ["$$l.e", 0]}, {"$ifNull": ["$$l.h", 0]}],
        }
    }
    unmoved = [{"$in": [{"$literal": [r, e, h]}, now]} for r, e, h in heads]
    return {"$cond": [{"$and": unmoved} if unmoved else False, int(count), 0]}


def without_entry(ident: str) -> Document:
    """The queue without the run ``ident`` (its delayed copy took its turn: ``due``)."""
    return {"$filter": {"input": _Q, "as": "e", "cond": {"$ne": ["$$e.id", ident]}}}


def sup_update(parked: object, superseded: object) -> Document:
    """``sup`` with the runs ``superseded`` by this run appended, when it parks (``parked``); never a run
    of its own task (``sets.sup_appended``)."""
    return sets.sup_appended(parked, superseded)


def replace_fields(run: AdmitRun, took: object, shape: Shape) -> Document:
    """``Replace`` (one set of keys per key), stage 3: who superseded this run (``lo_by``: the newest of
    the sends that decided it, ``newer_sends``), and the newest send that got the key (``last``) when
    this run took it (``took``)."""
    stamp = run.stamp
    newer_by = sets.newest_of(newer_sends(run, shape))
    last = {
        "$cond": [
            {"$and": [took, {"$gt": [stamp, {"$ifNull": ["$last.s", -1]}]}]},
            {"s": stamp, "t": {"$literal": run.entry["t"]}},
            "$last",
        ]
    }
    return {"lo_by": {"$cond": [{"$eq": ["$__o", "superseded"]}, newer_by, None]}, "last": last}
