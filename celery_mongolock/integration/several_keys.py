"""Admission of a run that needs several keys (``keys=(...)``): the body runs only while the run holds all
of them.

A plain run takes every key within one attempt, in sorted order, or none (``take_all``); a ``Queue`` or
``Replace`` run is admitted on each key by the engine, and parked on every key it did not get, with the
keys it got turned into reservations for it (``admit_all``). A ``Replace`` run carries its key set's
signature: on each key, a newer send of the same set supersedes it (``core.documents.sets``); told so on
any key, it gives back what it holds there and leaves the others. ``SeveralKeys`` takes its task as a
narrow protocol (``runs.GuardedRun``); ``SingletonTask`` hands each run of a several-keys task to it and
runs the body with the ``LeaseSet`` it returns.
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from celery import states as celery_states
from celery.exceptions import Ignore

from celery_mongolock.admission.contention import ContendedRun, Outcome
from celery_mongolock.admission.policies import TRY_AGAIN, Fail, Queue, Replace
from celery_mongolock.core.documents.sets import set_signature
from celery_mongolock.core.lease import LeaseSet
from celery_mongolock.core.outcomes import Admission, AdmitOutcome, Contended
from celery_mongolock.exceptions import QueueTimeout, StoreUnavailable, Superseded
from celery_mongolock.integration import handoff as _queue
from celery_mongolock.integration import priority, results, signals
from celery_mongolock.integration.config import get_store
from celery_mongolock.integration.duplicates import (
    DUPLICATE_HEADER,
    copy_of_a_retried_attempt,
    copy_of_an_ended_run,
    copy_with_a_result,
    ended_without_a_result,
    guard_run_ids,
    keep_a_debounced_copy_delivered_again,
    park_duplicate,
)
from celery_mongolock.integration.rate_gate import leave_rate
from celery_mongolock.integration.runs import (
    GuardedRun,
    delivery,
    end_superseded,
    give_back_quietly,
    has_final_state,
    ignored_as,
    log_acquire,
    publish_debounced_copy,
    set_state,
    unavailable,
)

if TYPE_CHECKING:
    from celery_mongolock.core.store import Lease
    from celery_mongolock.integration.config import TaskOptions

__all__ = ["SeveralKeys"]


class SeveralKeys:
    """One run of a task that needs ``keys`` (sorted, without repeats): ``take()`` returns a ``LeaseSet``
    of all of them, or the policy's outcome (or raises: ``Ignore`` for a run parked or dropped, the
    policy's error, a contention retry)."""

    def __init__(
        self,
        task: GuardedRun,
        keys: list[str],
        options: TaskOptions,
        *,
        direct: bool,
        limits: Mapping[str, int | None] | None = None,
    ) -> None:
        self.task = task
        self.keys = keys
        self.options = options
        #: Each key's limit (None: a single lease); ``options.limit`` for a key not in it.
        self.limits: Mapping[str, int | None] = limits or {}
        self.policy = options.on_contention
        #: Called directly (``task(...)``), not by a worker.
        self.direct = direct
        self.request = task.request
        self.store = get_store(task.app)
        #: A queued run's entry on each key, and the holder fields of its admits (set by ``admit_all``).
        self.entry: dict[str, Any] = {}
        self.info: dict[str, Any] = {}
        #: A copy of a queued run's message (set by ``admit_all``).
        self.copy = False
        #: ``Replace(debounce=...)``: this message is a parked run's delayed copy (set by ``admit_all``), and
        #: the longest wait until its entry is due on a key it parked on (``max_wait`` may shorten it).
        self.debounced_copy = False
        #: When (``time.monotonic()``) its entry is due on the last key where it is due latest: the delayed
        #: copy comes back then, not a whole wait after the last admit (a set's admits take time).
        self.due_at: float | None = None

    def take(self) -> LeaseSet | Outcome:
        request = self.request
        queued = self.policy.queued and not (self.direct or request.is_eager or request.called_directly)
        return self.admit_all() if queued else self.take_all()

    def _queue_policy(self) -> Queue:
        policy = self.policy
        assert isinstance(policy, Queue)
        return policy

    # -- a plain run (Retry, Skip, Wait, Fail) -------------------------------------------------------------

    def take_all(self) -> LeaseSet | Outcome:
        """Take every key, in sorted order, within one attempt: all of them, or none (the ones taken are
        released at once when one is held, so a run never holds some keys while it waits for others, and
        two runs that need overlapping keys cannot deadlock). Then the policy decides, as for one key."""
        task, request, keys, policy = self.task, self.request, self.keys, self.policy
        info: dict[str, Any] = {
            "task_name": task.name,
            "task_id": request.id,
            "worker": request.hostname,
            "delivery": delivery(request),
            "keys": keys,
        }
        # The duplicate guard, in each key's acquire (``guard_run_ids``): a copy of a run (redelivered,
        # parked), or a contention retry of an attempt that may have run in another line of retries, is
        # refused a key that remembers that attempt as over (``seen``). Only a body's release writes
        # ``seen``: the keys an attempt takes and gives back unrun are given back (``give_back``), never
        # released, so that they do not look like a finished run's (a copy dropped for that would be lost).
        ended_runs = guard_run_ids(request)
        run = ContendedRun(
            task, self.store, keys[0], direct=self.direct
        )  # one run: Wait's timeout counts once
        while True:
            taken, blocked = self._try_all(info, ended_runs)
            if blocked is None:
                if self._renewed(taken):
                    return LeaseSet(taken)
                continue
            # Given back, not released: this run did not run with them, so a minimum hold
            # (``min_hold_seconds``) does not keep them taken for nobody.
            give_back_quietly(self.store, taken)
            key, contended = blocked  # (limit=N: a slot held by this very run is the holder)
            if ended_runs and self._attempt_ran(key, contended, ended_runs):
                return copy_of_an_ended_run(task, self.store, key, self.options, list(self.keys))
            holder, expires_at = dict(contended.holder), contended.expires_at
            if contended.held_by_run(request.id):
                signals.lease_contended.send(sender=task, key=key, holder=holder, policy="duplicate")
                park_duplicate(task, key, self.options, self.direct)
                raise Ignore()
            signals.lease_contended.send(sender=task, key=key, holder=holder, policy=policy.name)
            run.key = key  # the key it waits for now
            outcome = policy.on_contended(run.held_by(holder, expires_at, contended.message(key)))
            if outcome is TRY_AGAIN:
                continue
            assert isinstance(outcome, Outcome), f"{policy!r}.on_contended returned {outcome!r}"
            return outcome

    def _try_all(
        self, info: dict[str, Any], ended_runs: list[str]
    ) -> tuple[list[Lease], tuple[str, Contended] | None]:
        """One attempt: the keys taken, in order, up to the first one held or refused (``(key,
        contended)``). ``ended_runs``: the duplicate guard's run ids, judged in each acquire (a refused
        acquire's reply then carries the key's ``seen``, also for a ``limit=N`` key)."""
        store, options, request = self.store, self.options, self.request
        taken: list[Lease] = []
        blocked: tuple[str, Contended] | None = None
        try:
            for key in self.keys:
                try:
                    lease, doc = store.try_acquire(
                        key,
                        options.lease_seconds,
                        info=info,
                        heartbeat=True,
                        heartbeat_seconds=options.heartbeat_seconds,
                        min_hold=options.min_hold_seconds or 0.0,
                        limit=self.limits.get(key, options.limit),
                        ended_runs=ended_runs,
                    )
                except StoreUnavailable as exc:
                    give_back_quietly(store, taken)
                    unavailable(self.task, key, exc, self.policy, self.direct)
                if lease is None:
                    contended = Contended.of(
                        doc, task_id=request.id, delivery=info["delivery"], whole=bool(ended_runs)
                    )
                    blocked = (key, contended)
                    break
                taken.append(lease)
        except BaseException:  # a time limit, a revoke: never keep the keys taken so far
            give_back_quietly(store, taken)
            raise
        return taken, blocked

    def _attempt_ran(self, key: str, contended: Contended, run_ids: list[str]) -> bool:
        """After an acquire refused or contended: is this attempt remembered as over on ``key``? Judged on
        the acquire's own reply (``seen``), no round trip added."""
        return bool(contended.attempt_ran(run_ids))

    def _renewed(self, taken: list[Lease]) -> bool:
        """One renewal confirms every lease before the body starts: an acquire slower than a lease must
        not let it run with a key that expired and was taken meanwhile. Else they are all released."""
        try:
            lost = self.store.renew_many(taken)
        except StoreUnavailable as exc:
            give_back_quietly(self.store, taken)
            unavailable(self.task, self.keys[0], exc, self.policy, self.direct)
        # ``renew_many`` leaves out leases already lost (their deadline passed while the other
        # keys were taken): those are not confirmed either.
        if not lost and not any(lease.lost for lease in taken):
            return True
        give_back_quietly(self.store, taken)
        return False

    # -- a queued run (Queue) ------------------------------------------------------------------------------

    def admit_all(self) -> LeaseSet | Outcome:
        """A run of a ``Queue`` task that needs several keys: take them all (in sorted order, one admit
        each), claim them all when they were handed to it, or park it on every key it did not get and
        turn the keys it got into reservations for it (``LeaseStore.reserve``): it keeps its place on
        each key, holds none while its body is not running, and is published once all are reserved.

        Keys taken or claimed by an attempt that does not run the body are given back without marking
        the run as over (``LeaseStore.give_back``), so that a retry or copy of it still runs; the body
        starts only after one renewal has confirmed every lease (an admit slower than a lease must not
        let it run with a key another worker took meanwhile)."""
        policy = self._queue_policy()
        task, request, keys = self.task, self.request, self.keys
        stamp, src = _queue.stamp_of(request)
        run_delivery = str(int(getattr(request, "retries", 0) or 0))
        ident = f"{request.id}/{run_delivery}"
        self.entry = {
            "id": ident,
            "t": request.id,
            "n": task.name,
            "r": run_delivery,
            "s": stamp,
            "src": src,
            "th": policy.then.name,
            "ks": keys,
            # One handoff token for all the keys (the same on every admit of this run).
            "tk": _queue.keys_token(ident, keys),
            **priority.rank_field(task.app, request, policy),
            **_queue.message_of(task, request, stamp, ident),
        }
        if isinstance(policy, Replace):
            # Its set of keys: only runs of the same set supersede each other (``documents.sets``).
            self.entry["g"] = set_signature(keys)
        #: Runs this run superseded on each key (their results are written once it is parked).
        self.superseded: dict[str, tuple[Admission, list[Any]]] = {}
        self.info = {
            "task_name": task.name,
            "task_id": request.id,
            "worker": request.hostname,
            "delivery": run_delivery,
            "keys": keys,
        }
        _queue.install_publisher(task.app, self.store)
        claim = _queue.handoff_of_keys(request, keys, ident)
        self.debounced_copy = bool(_queue.header(request, _queue.DEBOUNCE_HEADER))
        fresh = not (
            claim
            or self.debounced_copy
            or (request.headers or {}).get(DUPLICATE_HEADER)
            or (request.delivery_info or {}).get("redelivered")
        )
        # A copy of a message (redelivered, a parked duplicate, a handoff): its run may have run already.
        self.copy = not (fresh or self.debounced_copy)
        if fresh:
            since = _dt.datetime.now(_dt.timezone.utc).isoformat()
            set_state(task, results.QUEUED, {"key": keys[0], "keys": keys, "since": since}, unless_ready=True)
        try:
            return self._admit_attempts(claim, stamp)
        except StoreUnavailable as exc:
            unavailable(task, keys[0], exc, policy, direct=False)

    def _admit_attempts(self, claim: str | None, stamp: int) -> LeaseSet | Outcome:
        """Up to five attempts (a key may expire while the others are taken): claim the keys handed to
        this run, else admit it on each."""
        task, request, keys = self.task, self.request, self.keys
        for _attempt in range(5):
            if claim is not None:
                claimed, refused, key = self._claim_all(claim)
                outcome = None if refused is None else refused.outcome
                if claimed is not None:
                    if not self._confirmed(claimed):
                        claim = None
                        continue
                    self._write_superseded()
                    set_state(task, celery_states.STARTED, {"keys": keys})
                    return LeaseSet(claimed)
                if outcome is AdmitOutcome.RUNNING:  # a copy of the handoff while the first copy runs
                    park_duplicate(task, key, self.options, False, handoff_copy=True)
                    raise Ignore()
                if refused is not None and outcome is AdmitOutcome.SUPERSEDED:
                    self._leave_all()
                    return self._superseded(key, refused)
                if outcome is AdmitOutcome.WAITING:  # waiting again on that key: published when ready
                    self._parked_all(stamp)
                if outcome is AdmitOutcome.RETRIED:
                    copy_of_a_retried_attempt(task, key, self.entry)
                if has_final_state(task):
                    log_acquire.info("%s[%s]: stale handoff of %s; dropped", task.name, request.id, keys)
                    raise Ignore()
                claim = None  # claimed and died (its worker killed): admitted as any run, below
            taken, blocked = self._admit_each()
            if blocked is None:
                if not taken:  # parked or reserved on every key
                    self._parked_all(stamp)
                if self._confirmed(taken):  # every key taken in this attempt
                    self._write_superseded()  # (a slot taken back from an older run of its set)
                    set_state(task, celery_states.STARTED, {"keys": keys})
                    return LeaseSet(taken)
                continue
            return self._not_admitted(*blocked)
        raise StoreUnavailable(f"the keys {keys} kept expiring while they were taken")

    def _not_admitted(self, key: str, admission: Admission) -> Outcome:
        """A key that did not let the run wait: a copy of a run that ran, or that runs now, a full
        queue, or (``Replace``) a newer send of its set."""
        policy = self._queue_policy()
        outcome = admission.outcome
        if outcome is AdmitOutcome.SUPERSEDED and self.debounced_copy:
            # The delayed copy of a run that a newer send of its set replaced: its result is written.
            raise Ignore()
        if outcome is AdmitOutcome.SUPERSEDED:
            if copy_with_a_result(self.task, self.copy or admission.resent):
                # A copy of a run whose body ran and stored its result: ``seen`` remembers the run only on
                # the keys it still held at its release, and a key it lost mid-body (taken by a newer
                # send of its set) answers superseded first. Its result stands; the copy is dropped.
                log_acquire.info(
                    "%s[%s]: a copy of a run that ended, superseded on %r; dropped (its result stands)",
                    self.task.name,
                    self.request.id,
                    key,
                )
                raise Ignore()
            return self._superseded(key, admission)
        if self.debounced_copy and outcome in (AdmitOutcome.ALREADY_RAN, AdmitOutcome.RUNNING):
            if outcome is AdmitOutcome.RUNNING:
                keep_a_debounced_copy_delivered_again(self.task, key, self.options)
            # Handed its keys (due) before its delayed copy came: it ran or runs under its own message.
            raise Ignore()
        if outcome is AdmitOutcome.ALREADY_RAN:
            # (The admit judged a later attempt in its own command: ``retried``, not ``done``, when known.)
            if not has_final_state(self.task, carried_on=lambda: False):
                return ended_without_a_result(self.task, key, self.options, list(self.keys))
            raise Ignore()
        if outcome is AdmitOutcome.RUNNING:
            park_duplicate(self.task, key, self.options, False, resent=admission.resent and not self.copy)
            raise Ignore()
        if outcome is AdmitOutcome.RETRIED:
            copy_of_a_retried_attempt(self.task, key, self.entry)
        assert outcome is AdmitOutcome.FULL, outcome
        reason = results.full_reason(
            key, admission.queued, policy.max_length, self.entry, in_document=len(admission.parked)
        )
        if isinstance(policy.then, Fail):
            raise QueueTimeout(key, reason)
        return (
            ContendedRun(self.task, self.store, key, direct=False)
            .held_by(dict(admission.holder), admission.expires_at)
            .skip(reason)
        )

    def _superseded(self, key: str, admission: Admission) -> Outcome:
        """A newer send of this run's set of keys is known on ``key``: the run ends ``SUCCESS`` with a
        ``superseded`` result, without its body (what it held is given back, it is parked nowhere)."""
        task, request, keys = self.task, self.request, self.keys
        by = str(admission.by)
        log_acquire.info(
            "%s[%s]: %r: a newer send (%s) of the same keys %s supersedes this run: it ends %s, without "
            "running its body",
            task.name,
            request.id,
            key,
            by,
            keys,
            results.superseded_outcome_words(self.policy),
        )
        signals.run_superseded.send(sender=task, key=key, task_id=request.id, by=by)
        self.store.record_run_ending(key, "superseded", self.entry, fence=admission.fence, by=by)  # history
        leave_rate(task, keys, self.options)
        if getattr(self.policy, "fail_superseded", False):
            raise Superseded(keys[0], None, by, held=False)
        return Outcome(results.superseded_result(keys[0], by, keys))

    def _leave_all(self) -> None:
        """Leave every key: this run's parked entry, reservation or handoff (each key goes on to the next
        run, published by this process)."""
        for key in self.keys:
            self.store.unpark(key, self.entry["id"])

    def _admit(self, key: str, claim: str | None) -> Admission:
        """One admit of this run's entry on ``key`` (one ``findAndModify``)."""
        policy, options = self._queue_policy(), self.options
        replace = isinstance(policy, Replace)
        admission = Admission.of(
            *self.store.admit(
                key,
                self.entry,
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
                debounce=policy.debounce if isinstance(policy, Replace) else None,
                due=self.debounced_copy and claim is None,
                max_wait=policy.max_wait if isinstance(policy, Replace) else None,
                limit=self.limits.get(key, options.limit),
                # Replace(cancel_running=True): parked behind a running older run of its set, it tells it.
                cancel=isinstance(policy, Replace) and policy.cancel_running,
            )
        )
        due_in = admission.due_in(self.request.id)
        if due_in is not None:
            due_at = time.monotonic() + due_in
            self.due_at = max(due_at, self.due_at or due_at)
        if isinstance(policy, Replace) and policy.max_wait and "bu" not in self.entry:
            # Its burst, learned on the first key that answers it, goes with its admits of the others
            # (``sets.in_burst``): a burst its ceiling sealed is not superseded on a key by a newer send.
            burst = admission.burst_of(str(self.entry["id"]))
            if burst is not None:
                self.entry["bu"] = burst
        mine = admission.superseded_by(self.request.id)
        if mine:  # older runs of its set it superseded here: their results are written once it is parked
            self.superseded[key] = (admission, list(mine))
        return admission

    def _confirmed(self, leases: list[Lease]) -> bool:
        """All still ours on the server (one round trip); else all given back (also when MongoDB
        does not answer: the run retries later, and its keys must not stay held by no body)."""
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
        log_acquire.info(
            "%s[%s]: a key expired while the others were taken; again", self.task.name, self.request.id
        )
        return False

    def _claim_all(self, claim: str) -> tuple[list[Lease] | None, Admission | None, str]:
        """Claim every key handed to this run. ``(leases, None, "")`` when all were claimed; else the
        keys claimed so far are reservations again (given back when the run is superseded), and
        ``(None, admission, key)`` says why ``key`` failed."""
        claimed: list[Lease] = []
        try:
            for key in self.keys:
                admission = self._admit(key, claim)
                if admission.lease is not None:
                    claimed.append(admission.lease)
                    continue
                outcome = admission.outcome
                if outcome in (AdmitOutcome.RUNNING, AdmitOutcome.RETRIED, AdmitOutcome.SUPERSEDED):
                    # (RETRIED: a later attempt carries the task on; SUPERSEDED: a newer send of its set
                    # does: this one keeps no key.)
                    give_back_quietly(self.store, claimed)
                else:
                    # Not (or no longer) reserved for this run here: an older run was handed it, or its
                    # reservation expired and it waits again. Keep the keys claimed as reservations,
                    # unless a newer send of its set parked on one of them meanwhile (``Replace``).
                    newer = self._reserve_all(claimed)
                    if newer is not None:
                        return None, newer[1], newer[0]
                claimed = []
                return None, admission, key
        except BaseException:
            give_back_quietly(self.store, claimed)
            raise
        return claimed, None, ""

    def _admit_each(self) -> tuple[list[Lease], tuple[str, Admission] | None]:
        """One attempt over every key: ``(leases, None)`` when all were taken; ``([], None)`` when the
        run is parked or reserved on each; otherwise the keys taken are given back, this attempt's parks
        removed, and ``([], (key, admission))`` says which key did not let it wait, and why
        (``ALREADY_RAN``, ``RUNNING``, ``FULL``)."""
        store = self.store
        taken: list[Lease] = []
        waiting = False
        try:
            for key in self.keys:
                admission = self._admit(key, None)
                if admission.lease is not None:
                    taken.append(admission.lease)
                    continue
                if admission.outcome in (AdmitOutcome.PARKED, AdmitOutcome.WAITING):
                    waiting = True
                    continue
                # done, running, retried, full, superseded: this run does not wait. Give back what it took
                # and leave the queues it joined in this attempt (never another copy's places: only this
                # entry's).
                give_back_quietly(store, taken)
                taken = []
                leaves = (
                    AdmitOutcome.FULL,
                    AdmitOutcome.ALREADY_RAN,
                    AdmitOutcome.RETRIED,
                    AdmitOutcome.SUPERSEDED,
                )
                if admission.outcome in leaves:
                    for other in self.keys:
                        store.unpark(other, self.entry["id"])
                return [], (key, admission)
        except BaseException:
            give_back_quietly(store, taken)
            raise
        if not waiting:
            return taken, None
        superseded = self._reserve_all(taken)
        if superseded is not None:
            for other in self.keys:
                store.unpark(other, self.entry["id"])
        return [], superseded

    def _reserve_all(self, leases: list[Lease]) -> tuple[str, Admission] | None:
        """Keys taken by an attempt that must wait: each becomes a reservation for the run's entry. A key
        lost meanwhile (expired, forced) is admitted again: taken (and reserved) or parked on; or, when a
        newer send of its set came meanwhile (``Replace``), ``(key, admission)`` says so (the keys not yet
        reserved are given back; the caller leaves the others)."""
        store, policy = self.store, self._queue_policy()
        pending = list(leases)
        rounds = 0
        try:
            while pending:
                lease = pending.pop(0)
                if store.reserve(lease, self.entry, timeout=policy.timeout):
                    continue
                rounds += 1
                if rounds > 3 * len(leases):
                    raise StoreUnavailable(f"{lease.key!r} kept being lost while this run reserved it")
                again = self._admit(lease.key, None)
                if again.lease is not None:
                    pending.append(again.lease)
                elif again.outcome is AdmitOutcome.SUPERSEDED:
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

    def _write_superseded(self) -> None:
        """The results of the runs this run superseded on its keys (its admits' ``sup``)."""
        task, store = self.task, self.store
        for key, (admission, runs) in self.superseded.items():
            end_superseded(task, store, key, runs, admission.fence)
        self.superseded = {}

    def _parked_all(self, stamp: int) -> NoReturn:
        """Parked or reserved on every key: published when all are reserved for it (by whoever makes
        the last reservation; here if that was this attempt)."""
        task, keys, entry, store = self.task, self.keys, self.entry, self.store
        self._write_superseded()
        if store.reserved_for_all(entry):
            _queue.publish_handoff(task.app, keys[0], {**entry, "hn": 1}, store)
        policy = self.policy
        debounce = policy.debounce if isinstance(policy, Replace) else 0.0
        if debounce and not (self.debounced_copy or _queue.handoff_of_keys(self.request, keys, entry["id"])):
            # Come back when the debounce has passed: the copy takes the keys unless a newer send of the set
            # came.
            wait = debounce
            if self.due_at is not None:
                wait = min(max(0.0, self.due_at - time.monotonic()), debounce)
            publish_debounced_copy(task, stamp, wait)
        signals.run_parked.send(sender=task, key=keys[0], task_id=entry["t"], position=0, stamp=stamp)
        log_acquire.info(
            "%s[%s]: waits for %s (parked or reserved on each, no worker slot held): it starts once every "
            "key is handed to it",
            task.name,
            entry["t"],
            keys,
        )
        ignored_as(
            entry["t"], f"waits for {', '.join(map(repr, keys))}, not dropped: it starts once it has them all"
        )
        raise Ignore()
