"""Per-key admission: the parked runs of a key and the handoff, as pure pipeline builders (no I/O).

A run of a ``Queue`` or ``Replace`` task that finds its key held is **parked**: one entry in the lease
document's ``q`` array, kept in send order, carrying the run's message. When the key is released (by the
holder, the worker's parent for a dead child, an operator, or found expired), the *same command* hands it
to the oldest parked run: ``owner`` becomes a token reserved for that run (``tk``), the fence goes up, and
the entry moves to ``ho`` (a handoff not yet taken up). Whoever sees the handoff in the command's reply
(the releaser, or the sweeper for a handoff nobody published) publishes the run's message again; the run
then **claims** the key (``owner: tk`` -> its own token). No newcomer can take the key in between: every
acquire refuses a key with parked runs or a pending handoff.

Fields added to the lease document (see ``_documents`` for the rest)::

    q:     [entry, ...]     # parked runs, oldest send first (by (s, id))
    ho:    entry + {hat, hn, by} | null   # a handoff not yet claimed: handed at, attempt, by whom
    seen:  [run id, ...]    # the last SEEN_KEPT runs that ended with a normal release (duplicate guard)
    dead:  [entry, ...]     # parked runs past their deadline, whose result is not yet written
    sup:   [{t, by, at, n, r, pa}, ...] # Replace: runs superseded by a newer send (at; parked at pa),
                            # result not yet written
    last:  {s, t}           # Replace: the newest send that got the key (kept as long as ``seen``)
    lo, lo_by, lt           # the last admit's outcome, who superseded its run, and its token: a reply
                            # read back is that admit's answer, not necessarily the reader's
    cx:    {o, f, t, s, id, at} | null  # Replace(cancel_running=True): the running holder (token o)
                            # superseded by the newer run t (``cancel_mark``)
    wq:    true | absent    # something waits on this key (indexed: the sweeper's work list)
    gc_at: date | null      # the TTL index's field: expires_at when nothing waits, else null

An entry::

    {id: "<task id>/<delivery>", t: task id, n: task name, r: delivery, s: send stamp (int, us),
     src: where the stamp came from, tk: handoff token, ttl: lease ms, at: parked at, dl: deadline | null,
     th: "skip" | "fail", m: the message (Binary, the task's serializer) , ct: content type, ce: encoding}

All time is the server's (``$$NOW``); dates are compared through ``$toLong``.

This module is the admit of a key held as one lease; its parts live apart: the key's state (``key_state``),
the parked entries (``entries``), the duplicate guard (``copies``), the handoff and the sweeper's command
(``handoff``), and the stages both key shapes share (``admit_stages``). It re-exports the names its
callers used before they moved.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery_mongolock.core.documents import lanes, sets
from celery_mongolock.core.documents.admit_stages import (
    AdmitRun,
    Shape,
    judge,
    replace_fields,
    sup_update,
    without_entry,
)
from celery_mongolock.core.documents.copies import (
    SEEN_KEPT,
    later_attempt,
    ran,
    ran_any,
    retries_of,
    run_id,
    seen_append,
)
from celery_mongolock.core.documents.entries import (
    MAX_PARKED,
    burst_since,
    dead_entries,
    entry_ahead,
    entry_before,
    entry_due,
    entry_expr,
    field_of,
    live_entries,
    none_ahead,
    park_exprs,
    past_ceiling,
    rank_of_entry,
)
from celery_mongolock.core.documents.handoff import (
    ENDS_KEPT,
    HANDOFF_PROJECTION,
    admit_marker,
    handoff_stages,
    release_handoff_stages,
    requeue_handoff,
    reserve_pipeline,
    sweep_pipeline,
    unmark_slot_pipeline,
)
from celery_mongolock.core.documents.key_state import (
    KIND_ONE,
    NO_SLOT_HELD,
    SEEN_KEEP_MS,
    SINGLE_HELD,
    SLOTS_IN_USE,
    VACANT,
    WAITS,
    gc_stage,
    own_lease,
    own_live_lease,
    parked_kind,
)

__all__ = [
    "ADMIT_OUTCOMES",
    "ADMIT_PROJECTION",
    "HANDOFF_PROJECTION",
    "MAX_PARKED",
    "NO_SLOT_HELD",
    "SEEN_KEEP_MS",
    "SEEN_KEPT",
    "SINGLE_HELD",
    "SLOT_ADMIT_PROJECTION",
    "WAITS",
    "admit_marker",
    "admit_pipeline",
    "cancel_mark",
    "dead_entries",
    "entry_ahead",
    "entry_before",
    "entry_due",
    "entry_expr",
    "field_of",
    "gc_stage",
    "handoff_stages",
    "later_attempt",
    "live_entries",
    "own_lease",
    "own_live_lease",
    "ran",
    "ran_any",
    "rank_of_entry",
    "release_handoff_stages",
    "requeue_handoff",
    "reserve_pipeline",
    "retries_of",
    "run_id",
    "seen_append",
    "sweep_pipeline",
    "unmark_slot_pipeline",
]

Document = dict[str, Any]

_NOW_MS: Document = {"$toLong": "$$NOW"}
_Q: Document = {"$ifNull": ["$q", []]}
#: The helper fields of the admit's stages (removed before it records).
_FLAGS = ["__o", "__free", "__park", "__vac", "__tb", "__bu"]
#: The key is free for a single lease (``key_state.VACANT``).
_VACANT = VACANT
_HAS_HO: Document = {"$ne": [{"$ifNull": ["$ho", None]}, None]}


#: What an admit's reply carries: not the parked runs' messages, not the histories; the newest ending
#: only, which an admit that found the lease expired has just written (it records it: no other process
#: will, ``Acquisitions._admitted``).
ADMIT_PROJECTION: Document = {"q.m": 0, "seen": 0, "ends": {"$slice": -1}, "dead": 0}
#: A ``limit=N`` key's admit: one command can find several holds expired, so all the endings kept.
SLOT_ADMIT_PROJECTION: Document = {**ADMIT_PROJECTION, "ends": {"$slice": -ENDS_KEPT}}


#: What the admit pipeline can decide (``__o`` in the reply's ``lo``).
ADMIT_OUTCOMES = (
    "acquired",  # the run took the key (it was free and nobody older waits)
    "claimed",  # the run took the key handed to it
    "due",  # Replace(debounce=...): the run's delayed copy took the key for its parked entry
    "dup",  # a copy of a run that is parked or handed: drop it
    "done",  # a copy of a run that already ran and released: drop it
    "running",  # a copy of the run that holds the key now
    "retried",  # a copy of an attempt whose body retried: a later attempt is known on the key; drop it
    "stale",  # a handoff message of a run no longer parked or handed: drop it
    "parked",  # parked (and, when the key was found free with older runs parked, handed to the oldest)
    "spilled",  # a number in its rank's lane (``ls``): its worker stores it in the spill collection
    "full",  # the queue is at max_length: the policy's ``then``
    "mixed",  # the key is in use as the other kind (slots for a single lease, or the reverse): not parked
    "superseded",  # Replace: a newer send exists; this run ends superseded
)


def cancel_mark(
    entry: Mapping[str, Any], token: str, holder_of_set: Document | None = None, *, of_a_set: bool = False
) -> Document:
    """``Replace(cancel_running=True)``: the ``cx`` field of an admit that parks ``entry`` behind a
    running holder (the key held, no handoff pending): the holder's token ``o`` and fence ``f``, the
    newer run ``t`` (its send stamp ``s``, its run id ``id``) and when (``at``). The holder's process
    reads it (the lease watch at once, or its heartbeat) and marks its lease superseded. A run that
    **claims** the key handed to it while a newer send is parked (it parked after the handoff was made)
    is marked in its claim, with its own ``token`` and the newest parked run: it starts superseded (the
    claimer reads the mark at once, ``Acquisition.admit``). A mark whose ``o`` is not the owner any more is
    stale and harmless: every reader matches it on the token::

        cx: {o: holder's token, f: holder's fence, t: newer task id, s: its stamp, id: its run id, at}

    ``of_a_set`` (``Replace`` with ``keys=``): only the holder ``holder_of_set`` says (an older run of the
    newer run's own key set, ``sets.holder_older_of_set``) is marked, and a claim is not marked here: a
    newer send of the set takes back the handoff made to an older run of it before that run can claim
    (``sets``). A one-key run never marks the holder of a set (``holder.set``): runs of other sets, and
    one-key runs, wait their turn behind a set's run.
    """
    running = {
        "$and": [
            "$__park",
            {"$not": ["$__vac"]},
            {"$ne": [{"$ifNull": ["$owner", None]}, None]},
            {"$eq": [{"$ifNull": ["$ho", None]}, None]},
            {"$ne": [{"$ifNull": ["$cx.o", None]}, "$owner"]},  # the first newer send tells it
            holder_of_set
            if of_a_set and holder_of_set is not None
            else {"$eq": [{"$ifNull": ["$holder.set", None]}, None]},
        ]
    }
    mark = {
        "o": "$owner",
        "f": "$fence",
        "t": {"$literal": entry["t"]},
        "s": {"$literal": int(entry["s"])},
        "id": {"$literal": str(entry["id"])},
        "at": "$$NOW",
    }
    newest = {"$arrayElemAt": [_Q, -1]}
    claimed_behind_a_newer_send = {
        "$and": [
            {"$eq": ["$__o", "claimed"]},
            {"$gt": [{"$ifNull": [field_of("s", newest), -1]}, int(entry["s"])]},
        ]
    }
    claim_mark = {
        "o": {"$literal": token},
        "f": "$fence",
        "t": field_of("t", newest),
        "s": field_of("s", newest),
        "id": field_of("id", newest),
        "at": "$$NOW",
    }
    kept = {"$ifNull": ["$cx", None]}
    if of_a_set:
        return {"$cond": [running, mark, kept]}
    return {"$cond": [running, mark, {"$cond": [claimed_behind_a_newer_send, claim_mark, kept]}]}


def admit_pipeline(
    acquire_fields: Document,
    *,
    token: str,
    entry: Mapping[str, Any],
    timeout_ms: int | None,
    claim: str | None,
    max_length: int | None,
    replace: bool = False,
    debounce_ms: int | None = None,
    due: bool = False,
    group: str | None = None,
    cancel: bool = False,
    max_wait_ms: int | None = None,
    window: int | None = None,
    gone: tuple[int, tuple[tuple[int, int, int], ...]] | None = None,
) -> list[Document]:
    """The admit: one command that acquires the key, claims a handoff, or parks the run.

    ``acquire_fields`` are the ``$set`` fields of today's acquire, each written as
    ``{"$cond": ["$__free", new, old]}``; the admit sets ``__free`` for ``acquired`` and ``claimed``.
    ``entry`` is this run (``id``, ``t``, ``s`` ... without ``at``/``dl``); ``claim`` the handoff token of
    a handed run's message; ``max_length`` the longest queue. ``debounce_ms``: every run parks, to start
    only once no newer send came for that long; ``due``: this is the run's own delayed copy, which takes
    the key if its entry is at the head, due and the key free. ``group`` (with ``replace``): the
    signature of the run's set of keys (``Replace`` with ``keys=``): supersession is decided among the
    runs of that set only (``sets``). ``cancel`` (with ``replace``): a run that parks behind a running
    holder supersedes that holder too (``cx``, ``cancel_mark``); with ``group``, only a holder that is an
    older run of the same set. ``max_wait_ms`` (with ``debounce_ms``): a run that supersedes others is
    due no later than that long after the first of them began waiting. ``window`` (a plain ``Queue``
    run): the most runs of one rank kept in ``q``, a run behind them is ``spilled`` (``spill``); ``gone``:
    the tombstones ``max_length`` leaves out (``AdmitRun.gone``). The outcome is left in ``lo`` (the reply
    carries it); fields starting with ``__`` are removed. The stages (``admit_stages``): judge the run,
    take or park, hand over, record."""
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
    shape = _one_lease(run, token)
    stages: list[Document] = [
        *run.burst_stages(),
        {"$set": {"__o": judge(run, shape)}},
        {
            "$set": {
                "__free": {"$in": ["$__o", ["acquired", "claimed", "due"]]},
                "__park": {"$eq": ["$__o", "parked"]},
                "__vac": _VACANT,
                **({} if run.by_set else {"__tb": {"$literal": False}}),
            }
        },
    ]
    park_stages, parked_q, superseded = _park(run)
    stages += park_stages
    fields = _take_or_park_fields(
        run,
        shape,
        token=token,
        acquire_fields=acquire_fields,
        parked_q=parked_q,
        superseded=superseded,
        cancel=cancel,
    )
    stages.append({"$set": fields})
    # Found free with runs parked (or an unclaimed handoff): this run parked (or spilled), and the key
    # goes to the oldest, in this same command.
    parked = {"$or": ["$__park", {"$eq": ["$__o", "spilled"]}]}
    hand_when = {"$and": [parked, {"$or": ["$__vac", "$__tb"]}]}
    stages += handoff_stages(hand_when, requeue_handoff(), admit_marker(token))
    stages.append({"$unset": _FLAGS})
    stages.append(gc_stage())
    return stages


def _one_lease(run: AdmitRun, token: str) -> Shape:
    """The judge's questions answered for a key held as one lease."""
    ident, lit = run.ident, {"$literal": run.ident}
    first = none_ahead(live_entries(_Q), run.stamp, ident, run.rank)
    running = {
        "$and": [
            {"$eq": ["$holder.task_id", {"$literal": run.entry["t"]}]},
            {"$eq": ["$holder.delivery", {"$literal": run.entry.get("r")}]},
            {"$ne": [{"$ifNull": ["$owner", None]}, None]},
            # (its lease live: not ``not VACANT``, which slots held by others also make true, and a copy of a
            # run whose lease expired would be told it is a copy of the run holding the key)
            {"$gt": [{"$toLong": "$expires_at"}, _NOW_MS]},
        ]
    }
    claimable = None
    if run.claim is not None:
        claim = {"$literal": run.claim}
        # (a key mixed with limit=N holds: never two kinds at once)
        claimable = {"$and": [{"$eq": ["$owner", claim]}, {"$eq": ["$ho.tk", claim]}, NO_SLOT_HELD]}
    due_now = None
    if run.due:
        head = {"$arrayElemAt": [_Q, 0]}
        due_now = {
            "$and": [_VACANT, {"$not": [_HAS_HO]}, {"$eq": [field_of("id", head), lit]}, entry_due(head)]
        }
    free = {"$and": [_VACANT, {"$not": [_HAS_HO]}, first]}
    if run.window:
        # (nobody spilled before it waits: a run spilled goes before a newer one, as a parked one does)
        free["$and"].append({"$eq": [lanes.spilled_ahead(run.rank), 0]})
    elif run.entry.get("ks"):
        free["$and"].append(lanes.may_take(run.rank, run.stamp))
    return Shape(
        # A retry of this admit whose first attempt took the key (its reply lost): the same acquisition.
        ours=own_live_lease(token),
        ours_outcome="acquired",
        claimable=claimable,
        due_now=due_now,
        handed_here={"$eq": ["$ho.id", lit]},
        running=running,
        superseded_in_set=sets.superseded_cases(
            run.group, run.stamp, task_id=str(run.entry["t"]), burst=run.burst
        )
        if run.by_set and run.group is not None
        else [],
        handed={"$cond": [_HAS_HO, ["$ho"], []]},
        free=free,
        room=_VACANT,
        other_kind=SLOTS_IN_USE,
    )


def _park(run: AdmitRun) -> tuple[list[Document], object, object]:
    """Take or park, the queue: ``(stages, q, superseded)``, the stages before the fields (``__tb``, a
    handoff of an older run of the set taken back), the queue with this run parked, and the runs it
    supersedes."""
    if not (run.by_set and run.group is not None):
        parked_q, superseded = park_exprs(
            run.entry, run.timeout_ms, run.debounce_ms, replace=run.replace, max_wait_ms=run.max_wait_ms
        )
        return [], parked_q, superseded
    group, stamp, ident = run.group, run.stamp, run.ident
    # Parked: an older run of its set loses the key's reservation or handoff made to it (unless
    # max_wait: it was handed the key by its burst's ceiling, and runs; this run waits behind it).
    older_ho = sets.older_handoff(group, stamp, ident, run.burst)
    if run.max_wait_ms:
        # (A run that knows its burst takes back the handoff of an older run of that burst, ceiling or
        # not: that run was superseded where the burst began. One that does not, on the first key of its
        # set, leaves a run handed it by the ceiling alone, and begins a burst of its own: the seal.)
        knows = {"$ne": [run.burst, None]} if run.burst is not None else False
        sealed = {"$and": [{"$not": [knows]}, past_ceiling("$ho", run.max_wait_ms)]}
        older_ho = {"$and": [older_ho, {"$not": [sealed]}]}
    take_back = {"$and": ["$__park", older_ho]}
    # (A burst goes on through the older runs it supersedes: parked, or the handoff taken back.)
    taken_back = {"$cond": [older_ho, ["$ho"], []]}
    older = {"$concatArrays": [sets.entries_of(group, run.burst), taken_back]}
    # (A run that knows its burst keeps it on every key: the same ceiling everywhere.)
    since = burst_since(older, run.burst) if run.max_wait_ms else None
    e = entry_expr(run.entry, run.timeout_ms, run.debounce_ms, max_wait_ms=run.max_wait_ms, since=since)
    if run.burst is not None:
        # Its burst, kept as it is (``bu``): the one it knows, else the earliest of the runs it supersedes
        # here (their ``bu``; ``fw`` is when a burst began waiting, which a run that leaves the key unrun
        # may carry earlier: ``sets.carry_burst``), else now. The identity that ``sets.in_burst`` compares.
        e["bu"] = {"$ifNull": [run.burst, sets.burst_identity(older)]}
    ahead = entry_ahead("$$e", stamp, ident, run.rank)
    parked_q, superseded = sets.park_queue(
        e, group, ahead, by=str(run.entry["t"]), take_back="$__tb", burst=run.burst
    )
    return [{"$set": {"__tb": take_back}}], parked_q, superseded


def _take_or_park_fields(
    run: AdmitRun,
    shape: Shape,
    *,
    token: str,
    acquire_fields: Document,
    parked_q: object,
    superseded: object,
    cancel: bool,
) -> Document:
    """Take or park, the fields: the acquire's (when ``__free``), the queue, the supersessions, the
    handoff claimed or taken back, and the outcome (``lo``)."""
    ident = run.ident
    fields = dict(acquire_fields)
    fields.update(
        {
            "q": {
                "$cond": [
                    "$__park",
                    parked_q,
                    {"$cond": [{"$eq": ["$__o", "due"]}, without_entry(ident), "$q"]},
                ]
            },
            "sup": sup_update("$__park", superseded),
            "qk": parked_kind(KIND_ONE, {"$or": ["$__park", {"$eq": ["$__o", "spilled"]}]}),
            "ho": {"$cond": [{"$or": [{"$eq": ["$__o", "claimed"]}, "$__tb"]}, None, "$ho"]},
            "lo": "$__o",
            # Whose admit ``lo`` answers: a reply read back instead of returned is trusted only when it is
            # this very command's (``outcomes.untrusted_admit_reply``).
            "lt": {"$literal": token},
        }
    )
    if run.by_set and run.group is not None:
        taken_back = {"$and": ["$__tb", {"$eq": ["$owner", "$ho.tk"]}]}
        fields["owner"] = {"$cond": [taken_back, None, fields["owner"]]}
        newer = sets.newer_by(run.group, run.stamp, task_id=str(run.entry["t"]), burst=run.burst)
        fields["lo_by"] = {"$cond": [{"$eq": ["$__o", "superseded"]}, newer, None]}
        fields["lg"] = sets.lg_update(run.group, run.stamp, str(run.entry["t"]), "$__free")
        if cancel:
            holder = sets.holder_older_of_set(run.group, run.stamp, task_id=str(run.entry["t"]))
            fields["cx"] = cancel_mark(run.entry, token, holder, of_a_set=True)
    elif run.replace:
        replaced = replace_fields(run, "$__free", shape)
        fields["lo_by"] = replaced["lo_by"]
        if cancel:
            fields["cx"] = cancel_mark(run.entry, token)
        fields["last"] = replaced["last"]
    if run.window:  # (a run spilled: its number in its rank's lane)
        fields.update(lanes.spill_fields(run.rank, {"$eq": ["$__o", "spilled"]}))
    # Taking a key handed to us ends no one else's lease (the handoff is the same acquisition).
    claimed = {"$eq": ["$__o", "claimed"]}
    fields["ends"] = {"$cond": [claimed, "$ends", fields["ends"]]}
    if run.claim is not None:
        # The claim keeps the fence the handoff gave; the wait counts from when the run was parked.
        fields["fence"] = {"$cond": [claimed, "$fence", fields["fence"]]}
        since_parked = {"$subtract": [_NOW_MS, {"$toLong": {"$ifNull": ["$ho.at", "$$NOW"]}}]}
        fields["waited_ms"] = {"$cond": [claimed, {"$max": [0, since_parked]}, fields["waited_ms"]]}
    return fields
