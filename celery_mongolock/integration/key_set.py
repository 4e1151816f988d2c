"""A queued run's admits over its key set (``Queue``, ``Replace``): one admit (one ``findAndModify``) a key,
in sorted order, and what a set of keys (a task of ``keys=(...)``) needs on top: the keys it got while it
waits for others turned into reservations for it, a confirming renewal before its body starts, and leaving
every key when it does not wait. A run of several keys stops at the first key where it waits
(``stepwise``: one key at a time); a ``Replace`` run of a set is one on its set's gate only, and
a ``Queue`` run after it (``entry_on``). For a task of one ``key=`` those steps are empty: one admit is the
whole attempt.

``KeySetAdmits`` knows the store and the run's entry, not Celery's outcomes: ``queued_run.QueuedRun``
decides what each answer means for the task.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from celery_mongolock.admission.policies import Queue, Replace
from celery_mongolock.core.outcomes import Admission, AdmitOutcome
from celery_mongolock.exceptions import MessageTooLarge, StoreUnavailable
from celery_mongolock.integration.duplicates import this_attempt_over
from celery_mongolock.integration.results import has_backend, leave_later_keys
from celery_mongolock.integration.runs import (
    GuardedRun,
    end_superseded,
    give_back_quietly,
    log_acquire,
)

if TYPE_CHECKING:
    from celery_mongolock.core.store import Lease, LeaseStore
    from celery_mongolock.integration.config import TaskOptions

__all__ = ["KeySetAdmits"]

#: Outcomes on a key after which a run of several keys leaves the queues its attempt joined.
_LEAVES = (
    AdmitOutcome.FULL,
    AdmitOutcome.ALREADY_RAN,
    AdmitOutcome.RETRIED,
    AdmitOutcome.SUPERSEDED,
    AdmitOutcome.MIXED,
)


class KeySetAdmits:
    """The admits of one queued run (``entry``, the same on every key) over ``keys``."""

    def __init__(
        self,
        task: GuardedRun,
        store: LeaseStore,
        keys: list[str],
        options: TaskOptions,
        policy: Queue,
        *,
        entry: dict[str, Any],
        info: dict[str, Any],
        limits: Mapping[str, int | None],
        debounced_copy: bool,
        several: bool,
        fresh: bool = False,
    ) -> None:
        self.task = task
        self.store = store
        self.keys = keys
        self.options = options
        self.policy = policy
        self.entry = entry
        self.info = info
        self.limits = limits
        self.debounced_copy = debounced_copy
        #: A run of a task of ``keys=(...)``: reservations, a confirming renewal and leaving every key apply,
        #: whatever the number of its keys.
        self.several = several
        #: The last admit's answer on each key.
        self.answers: dict[str, Admission] = {}
        #: Runs this run superseded on each key (their results are written once it is parked or runs).
        self.superseded: dict[str, tuple[Admission, list[Any]]] = {}
        #: When (``time.monotonic()``) its entry is due on the key where it is due latest: a
        #: ``Replace(debounce=...)`` run's delayed copy comes back then (``max_wait`` may make it sooner).
        self.due_at: float | None = None
        #: A run of several keys takes them **one at a time, in key order**: it waits on at most one key,
        #: the first it has not got, holding reservations on the keys before it only (ordered resource
        #: acquisition: no cycle of waits). Its place on a key is where it arrived there, so it may be
        #: spilled beyond the key's window like a run of one key (for a ``Replace`` run of a set: on every
        #: key after its set's gate, ``entry_on``).
        self.stepwise = several
        #: ``Replace`` with several keys: the first key it admits, where its runs supersede each other: its
        #: set's gate (``sets.gate_of``; ``QueuedRun.admit_keys``), or its one key for a set of one.
        self.set_gate: str | None = keys[0] if several and isinstance(policy, Replace) else None
        #: The key this run waits on (stepwise), once an attempt parked it there.
        self.waits_on: str | None = None
        #: The run's first message (not a copy, a handoff or a delayed copy): it is on no key yet.
        self.fresh = fresh

    def entry_on(self, key: str) -> dict[str, Any]:
        """This run's entry as it waits on ``key``. A ``Replace`` run of a set is one on its set's gate
        only (every run of the set admits it first: supersession, debounce, ``max_wait`` and
        ``cancel_running`` happen there); on a later key it waits as a ``Queue`` run does, without its
        set's signature (``g``) and burst (``bu``): there it may be spilled, and at most one run of its
        set waits there (the one that got the gate; an older one superseded there has left it, or leaves
        it when its turn comes)."""
        if self.set_gate is None or key == self.set_gate:
            return self.entry
        return {name: value for name, value in self.entry.items() if name not in ("g", "bu")}

    def admit(self, key: str, claim: str | None) -> Admission:
        """One admit of this run's entry on ``key`` (one ``findAndModify``)."""
        policy, options = self.policy, self.options
        # (a Replace run of a set, on a key after its set's gate: a Queue run there, ``entry_on``)
        rp = policy if isinstance(policy, Replace) and key == (self.set_gate or key) else None
        replace = rp is not None
        try:
            reply = self.store.admit(
                key,
                self.entry_on(key),
                ttl=options.lease_seconds,
                claim=claim,
                timeout=policy.timeout,
                max_length=policy.max_length,
                min_hold=options.min_hold_seconds or 0.0,
                info=self.info,
                heartbeat=True,
                heartbeat_seconds=options.heartbeat_seconds,
                replace=replace,
                group=self.entry.get("g") if replace else None,
                # Replace(debounce=...): every run parks; its delayed copy takes a key once due there.
                debounce=rp.debounce if rp is not None else None,
                due=self.debounced_copy and claim is None and replace,
                max_wait=rp.max_wait if rp is not None else None,
                limit=self.limits.get(key, options.limit),
                # Replace(cancel_running=True): parked behind a running older run of its set, it tells it.
                cancel=rp is not None and rp.cancel_running,
            )
        except MessageTooLarge as exc:  # (named with the task: the store knows only the key)
            raise MessageTooLarge(exc.key, exc.size, exc.limit, self.task.name) from None
        admission = Admission.of(*reply)
        self.answers[key] = admission
        request_id = self.task.request.id
        due_in = admission.due_in(request_id)
        if due_in is not None:
            due_at = time.monotonic() + due_in
            self.due_at = max(due_at, self.due_at or due_at)
        if rp is not None and self.several and rp.max_wait and "bu" not in self.entry:
            # Its burst, learned on the first key that answers it, goes with its admits of the others
            # (``sets.in_burst``): a burst its ceiling sealed is not superseded on a key by a newer send.
            burst = admission.burst_of(str(self.entry["id"]))
            if burst is not None:
                self.entry["bu"] = burst
        mine = admission.superseded_by(request_id)
        if mine:  # older runs it superseded here: their results are written once it is parked (or runs)
            self.superseded[key] = (admission, list(mine))
        return admission

    def write_superseded(self) -> None:
        """The results of the runs this run superseded on its keys (its admits' ``sup``). A run of its set
        whose reservation of the set's gate it took back may wait on a later key (it took them one
        at a time): this run leaves that key for it (the superseded run can claim nothing any more, and
        its place there would be handed to it for nothing)."""
        for key, (admission, runs) in self.superseded.items():
            for run in runs:  # (at once, also for a run whose result is left to the sweeper for now)
                leave_later_keys(self.store, key, run)
            end_superseded(self.task, self.store, key, runs, admission.fence)
        self.superseded = {}

    def confirmed(self, leases: list[Lease]) -> bool:
        """All still ours on the server: for several keys, one renewal (an admit slower than a lease must
        not let the run start with a key another worker took meanwhile); else all given back (also when
        MongoDB does not answer: the run retries later, and its keys must not stay held by no body). A
        task of one key took it by one command: nothing to confirm."""
        if not self.several:
            return True
        store = self.store
        try:
            lost = store.renew_many(leases)
        except StoreUnavailable:
            give_back_quietly(store, leases)
            raise
        # ``renew_many`` leaves out leases already lost (their deadline passed while the other keys
        # were taken: the lock-set checker's seed 26): those are not confirmed either.
        if not lost and not any(lease.lost for lease in leases):
            return True
        give_back_quietly(store, leases)
        request = self.task.request
        log_acquire.info(
            "%s[%s]: a key expired while the others were taken; again", self.task.name, request.id
        )
        return False

    def newer_past_gate(self, leases: list[Lease]) -> str | None:
        """A ``Replace`` run of a set whose first key has slots (``limit=N``), about to start with
        ``leases``: the newest send of its set that got that key after it did (``lg``), if any; then this
        run gives back its keys and leaves them. (Slots let two runs of a set past the first key at once:
        the newer may reach and run on the later keys first, and the older must not run after it. With
        one lease on the first key no other run of the set can be past it: no read.)"""
        gate = self.set_gate
        if gate is None or (self.limits.get(gate, self.options.limit) or 1) <= 1:
            return None
        newer = self.store.newer_of_set(gate, self.entry)
        if newer is not None:
            give_back_quietly(self.store, leases)
            self.leave_all()
        return newer

    def leave_all(self) -> None:
        """Leave every key of a set of several: this run's parked entry, reservation or handoff (each key
        goes on to the next run, published by this process). (A single key's admit left it already.)"""
        if self.several:
            for key in self.keys:
                self.store.unpark(key, self.entry["id"])
                if self.stepwise:  # (spilled on the key it waited on)
                    self.store.spill.drop(key, [str(self.entry["t"])])

    def claim_all(self, claim: str) -> tuple[list[Lease] | None, Admission | None, str]:
        """Claim every key handed to this run. ``(leases, None, "")`` when all were claimed; else the
        keys claimed so far are reservations again (given back when the run is superseded), and
        ``(None, admission, key)`` says why ``key`` failed."""
        claimed: list[Lease] = []
        try:
            for key in self.keys:
                admission = self.admit(key, claim)
                if self.stepwise and admission.outcome is AdmitOutcome.STALE:
                    # Not handed to it here: the keys before are, and this is the next it needs (it was
                    # handed the one before while it waited there). Admitted there as any run, unless the
                    # run ended meanwhile (a late handoff message of a run that timed out, or ran under
                    # another message): it gives back what it claimed and leaves its keys (dropped then). (An
                    # app with no result backend cannot tell: the keys that remember the run do.)
                    if has_backend(self.task.app) and this_attempt_over(self.task, self.store, self.keys):
                        give_back_quietly(self.store, claimed)
                        self.leave_all()
                        return None, admission, key
                    admission = self.admit(key, None)
                if admission.lease is not None:
                    claimed.append(admission.lease)
                    continue
                outcome = admission.outcome
                if self.stepwise and outcome in (AdmitOutcome.PARKED, AdmitOutcome.WAITING):
                    blocked = self._waits(key, claimed)
                    claimed = []
                    return (None, admission, key) if blocked is None else (None, blocked[1], blocked[0])
                if outcome in (AdmitOutcome.RUNNING, AdmitOutcome.RETRIED, AdmitOutcome.SUPERSEDED):
                    # (RETRIED: a later attempt carries the task on; SUPERSEDED: a newer send of its set
                    # does: this one keeps no key.)
                    give_back_quietly(self.store, claimed)
                elif self.stepwise and outcome is AdmitOutcome.ALREADY_RAN:
                    # (its run is over on that key: it keeps no key, and waits nowhere)
                    give_back_quietly(self.store, claimed)
                    self.leave_all()
                else:
                    # Not (or no longer) reserved for this run here: an older run was handed it, or its
                    # reservation expired and it waits again. Keep the keys claimed as reservations,
                    # unless a newer send of its set parked on one of them meanwhile (``Replace``).
                    newer = self.reserve_all(claimed)
                    if newer is not None:
                        return None, newer[1], newer[0]
                claimed = []
                return None, admission, key
        except BaseException:
            give_back_quietly(self.store, claimed)
            raise
        return claimed, None, ""

    def _waits(self, key: str, taken: list[Lease]) -> tuple[str, Admission] | None:
        """A stepwise run waits on ``key``: the keys before it that it got become reservations for it, and
        it leaves the keys after it (a place or a reservation left there by an earlier attempt or layout:
        it never holds a later key while it waits for an earlier one). ``(key, admission)`` when it cannot
        keep a reservation (``reserve_all``): it then left every key."""
        self.waits_on = key
        blocked = self.reserve_all(taken)
        if blocked is not None:
            self.leave_all()
            return blocked
        if not self.fresh:
            self.leave_after(key)
        return None

    def leave_after(self, key: str) -> None:
        """Leave the keys after ``key`` (stepwise): this run's places and reservations there, if any, a
        place spilled beyond a key's window included."""
        for later in self.keys[self.keys.index(key) + 1 :]:
            self.store.unpark(later, self.entry["id"])
            self.store.spill.drop(later, [str(self.entry["t"])])

    def admit_each(self) -> tuple[list[Lease], tuple[str, Admission] | None]:
        """One attempt over every key: ``(leases, None)`` when all were taken; ``([], None)`` when the
        run is parked (or, with several keys, reserved) on each; otherwise the keys taken are given back,
        this attempt's parks removed, and ``([], (key, admission))`` says which key did not let it wait,
        and why. (For a task of one key, ``WAITING`` is a copy of a run parked or handed the key: it does
        not wait; for a set of keys, it is this run's own place or reservation on that key.)"""
        store = self.store
        waits = (AdmitOutcome.PARKED, AdmitOutcome.WAITING) if self.several else (AdmitOutcome.PARKED,)
        taken: list[Lease] = []
        waiting = False
        try:
            for key in self.keys:
                admission = self.admit(key, None)
                if self.stepwise and admission.lease is None and admission.handed_to(str(self.entry["id"])):
                    # Reserved for it already (its handoff was made, this is another message of it): claimed
                    admission = self.admit(key, str(self.entry["tk"]))
                if admission.lease is not None:
                    taken.append(admission.lease)
                    continue
                if self.stepwise and admission.outcome in waits:
                    blocked = self._waits(key, taken)
                    taken = []
                    return [], blocked
                if admission.outcome in waits:
                    waiting = True
                    continue
                # This run does not wait. Give back what it took and leave the queues it joined in this
                # attempt (never another copy's places: only this entry's).
                give_back_quietly(store, taken)
                taken = []
                if admission.outcome in _LEAVES:
                    self.leave_all()
                return [], (key, admission)
        except BaseException:
            give_back_quietly(store, taken)
            raise
        if not waiting:
            return taken, None
        superseded = self.reserve_all(taken)
        if superseded is not None:
            self.leave_all()
        return [], superseded

    def reserve_all(self, leases: list[Lease]) -> tuple[str, Admission] | None:
        """Keys taken by an attempt that must wait: each becomes a reservation for the run's entry. A key
        lost meanwhile (expired, forced) is admitted again: taken (and reserved) or parked on; or, when a
        newer send of its set came meanwhile (``Replace``), or the key is in use as the other kind of key
        now (``mixed``), ``(key, admission)`` says so (the keys not yet reserved are given back; the caller
        leaves the others)."""
        store, policy = self.store, self.policy
        pending = list(leases)
        rounds = 0
        try:
            while pending:
                lease = pending.pop(0)
                if store.reserve(lease, self.entry_on(lease.key), timeout=policy.timeout):
                    continue
                rounds += 1
                if rounds > 3 * len(leases):
                    raise StoreUnavailable(f"{lease.key!r} kept being lost while this run reserved it")
                again = self.admit(lease.key, None)
                if again.lease is not None:
                    pending.append(again.lease)
                elif again.outcome in (AdmitOutcome.SUPERSEDED, AdmitOutcome.MIXED):
                    give_back_quietly(store, pending)
                    return lease.key, again
                elif again.outcome not in (AdmitOutcome.PARKED, AdmitOutcome.WAITING):
                    raise StoreUnavailable(
                        f"{lease.key!r} was lost while this run reserved it, and it cannot wait there "
                        f"({again.outcome.value})"
                    )
        except BaseException:
            give_back_quietly(store, pending)
            raise
        return None
