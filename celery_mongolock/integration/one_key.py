"""Admission of a run that needs one key (``key=``, also ``limit=N``): take the lease, or carry out the
contention policy; a ``Queue``/``Replace`` run is admitted by the engine (taken, claimed, or parked).

``OneKey`` takes its task as a narrow protocol (``runs.GuardedRun``); ``SingletonTask`` hands each run of a
one-key task to it and runs the body with the lease it returns.
"""

from __future__ import annotations

import datetime as _dt
from typing import TYPE_CHECKING, Any, NoReturn

from celery import states as celery_states
from celery.exceptions import Ignore

from celery_mongolock.admission.contention import ContendedRun, Outcome, skipped_result
from celery_mongolock.admission.policies import TRY_AGAIN, Fail, Queue, Replace
from celery_mongolock.core.outcomes import Admission, AdmitOutcome, Contended
from celery_mongolock.exceptions import LockContended, QueueTimeout, StoreUnavailable, Superseded
from celery_mongolock.integration import handoff as _queue
from celery_mongolock.integration import priority, results, signals
from celery_mongolock.integration.beatcheck import beat_tick, warn_if_sent_by_another_beat
from celery_mongolock.integration.config import get_store
from celery_mongolock.integration.duplicates import (
    DUPLICATE_HEADER,
    copy_of_a_retried_attempt,
    copy_of_an_ended_run,
    copy_run_ids,
    copy_with_a_result,
    ended_without_a_result,
    first_run_done,
    guard_run_ids,
    keep_a_debounced_copy_delivered_again,
    park_duplicate,
)
from celery_mongolock.integration.rate_gate import leave_rate
from celery_mongolock.integration.runs import (
    GuardedRun,
    contended_since,
    delivery,
    end_superseded,
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

__all__ = ["OneKey"]


class OneKey:
    """One run of a task that needs ``key``: ``take()`` returns its lease, or the policy's outcome (or
    raises: ``Ignore`` for a run parked or dropped, the policy's error, a contention retry)."""

    def __init__(self, task: GuardedRun, key: str, options: TaskOptions, *, direct: bool) -> None:
        self.task = task
        self.key = key
        self.options = options
        self.policy = options.on_contention
        #: Called directly (``task(...)``), not by a worker.
        self.direct = direct
        self.store = get_store(task.app)
        self.request = task.request
        #: A copy of a queued run's message (set by ``admit``).
        self.copy = False

    def take(self) -> Lease | Outcome:
        """Take the lease, or carry out the contention policy (which raises, or returns an outcome)."""
        task, request, key, policy = self.task, self.request, self.key, self.policy
        info: dict[str, Any] = {
            "task_name": task.name,
            "task_id": request.id,
            "worker": request.hostname,
            "delivery": delivery(request),
        }
        tick, hold_until_ms = beat_tick(request)
        if tick is not None:
            info["beat_tick"] = tick
        else:
            warn_if_sent_by_another_beat(task.name, request)
        if (
            policy.queued
            and tick is None
            and not (self.direct or request.is_eager or request.called_directly)
        ):
            # (A beat tick is not parked: it runs once per tick or not at all, see the acquire below.)
            return self.admit(info)
        try:
            done = first_run_done(task, self.store, key)
        except StoreUnavailable as exc:
            unavailable(task, key, exc, policy, self.direct)
        if done:
            return copy_of_an_ended_run(task, self.store, key, self.options)
        return self._acquire(info, tick, hold_until_ms)

    def _acquire(self, info: dict[str, Any], tick: int | None, hold_until_ms: int | None) -> Lease | Outcome:
        """Acquire the key (one ``findAndModify`` per attempt) until it is taken or the policy decides."""
        task, request, key, store, options = self.task, self.request, self.key, self.store, self.options
        run = ContendedRun(task, store, key, direct=self.direct)
        # A copy's acquire refuses the key when its run is remembered as over, in the same command: the
        # first run's release may land between the look above and this acquire (issue 32). So does a
        # contention retry's, whose attempt may have run in another line of retries (``guard_run_ids``).
        ended_runs = guard_run_ids(request)
        # How long this run has waited for its key (the lease history's ``waited_ms``): from its first
        # contention, carried across contention retries by a header; counted here while it waits.
        since = contended_since(request)
        contended_at: float | None = None
        while True:
            waited_ms = 0 if contended_at is None else int((store.clock.monotonic() - contended_at) * 1000)
            try:
                lease, doc = store.try_acquire(
                    key,
                    options.lease_seconds,
                    info=info,
                    heartbeat=True,
                    heartbeat_seconds=options.heartbeat_seconds,
                    min_hold=options.min_hold_seconds,
                    tick=tick,
                    hold_until_ms=hold_until_ms,
                    waited_ms=waited_ms,
                    waited_since_ms=since,
                    limit=options.limit,
                    ended_runs=ended_runs,
                )
                if lease is None and ended_runs and self._attempt_ran(doc, ended_runs):
                    return copy_of_an_ended_run(task, self.store, key, self.options)
            except StoreUnavailable as exc:
                return unavailable(task, key, exc, self.policy, self.direct)
            if lease is not None:
                return lease
            if contended_at is None:
                contended_at = store.clock.monotonic()
            outcome = self._contended(run, Contended.of(doc), tick)
            if outcome is TRY_AGAIN:
                continue
            assert isinstance(outcome, Outcome), f"{self.policy!r}.on_contended returned {outcome!r}"
            return outcome

    def _attempt_ran(self, doc: Any, run_ids: list[str]) -> bool:
        """After an acquire that did not get the key: is this message a copy of a run that ended
        (``first_run_done``), or a contention retry of an attempt that ran in another line of retries?
        The latter is read from the acquire's reply, which carries the key's ``seen`` when the acquire is
        guarded (a single lease's whole document; a ``limit=N`` key's too then): no round trip added."""
        task, request, key = self.task, self.request, self.key
        if copy_run_ids(request):
            return first_run_done(task, self.store, key)
        return bool(Contended.of(doc, whole=True).attempt_ran(run_ids))

    def _contended(self, run: ContendedRun, contended: Contended, tick: int | None) -> object:
        """The key is held: a tick that already ran is skipped, a duplicate delivery parked, and otherwise
        the policy decides (skip, fail, publish again later, or ``TRY_AGAIN``)."""
        task, request, key, policy = self.task, self.request, self.key, self.policy
        holder, expires_at = dict(contended.holder), contended.expires_at
        if contended.tick_ran(tick):
            # Another beat sent this tick too, and its run has taken (or is taking) the key.
            log_acquire.info("%s[%s]: tick %s of %r already ran; skipped", task.name, request.id, tick, key)
            signals.lease_contended.send(sender=task, key=key, holder=holder, policy="tick-already-ran")
            return Outcome(skipped_result(key, holder, expires_at, f"tick {tick} already ran"))
        if contended.held_by_run(request.id):
            # The same message delivered twice (broker visibility timeout, acks_late) while its first
            # run still holds the lease: do not run twice, and leave the first run's state alone.
            signals.lease_contended.send(sender=task, key=key, holder=holder, policy="duplicate")
            park_duplicate(task, key, self.options, self.direct)
            raise Ignore()
        signals.lease_contended.send(sender=task, key=key, holder=holder, policy=policy.name)
        # The policy decides (policies.py): skip, fail, publish again later, or wait and try again.
        return policy.on_contended(run.held_by(holder, expires_at, contended.message(key)))

    # -- a queued run (Queue, Replace) ---------------------------------------------------------------------

    def admit(self, info: dict[str, Any]) -> Lease | Outcome:
        """A run of a queued task (``Queue``, ``Replace``): take the key, claim it when it was handed to
        this run, or park the run (and acknowledge its message) until the key is handed to it."""
        policy = self.policy
        assert isinstance(policy, Queue)
        task, request, key = self.task, self.request, self.key
        stamp, _src = _queue.stamp_of(request)
        # A queued run is one run per task id and own retry: a contention retry (after MongoDB did not
        # answer) is the same run, and must find its own park if that landed.
        run_delivery = str(int(getattr(request, "retries", 0) or 0))
        info["delivery"] = run_delivery
        entry: dict[str, Any] = {
            "id": f"{request.id}/{run_delivery}",
            "t": request.id,
            "n": task.name,
            "r": run_delivery,
            "s": stamp,
            "src": _src,
            "th": policy.then.name,
            **priority.rank_field(task.app, request, policy),
            **_queue.message_of(task, request, stamp, f"{request.id}/{run_delivery}"),
        }
        _queue.install_publisher(task.app, self.store)
        debounced_copy = bool(_queue.header(request, _queue.DEBOUNCE_HEADER))
        claim = _queue.handoff_of(request, key, entry["id"])
        fresh = not (
            claim
            or debounced_copy
            or (request.headers or {}).get(DUPLICATE_HEADER)
            or (request.delivery_info or {}).get("redelivered")
        )
        # A copy of a message (redelivered, a parked duplicate, a handoff): its run may have run already.
        self.copy = not (fresh or debounced_copy)
        if fresh:
            # QUEUED before the admit, never after it: once parked, the run may be handed the key and end
            # at any moment, and a state written later would hide its result.
            since = _dt.datetime.now(_dt.timezone.utc).isoformat()
            set_state(task, results.QUEUED, {"key": key, "since": since}, unless_ready=True)
        admission = self._admission(entry, claim, debounced_copy, info)
        lease = admission.lease
        if lease is not None:
            set_state(task, celery_states.STARTED, {"key": key, "fence": lease.fence})
            return lease
        return self._not_admitted(admission, entry, stamp, debounced_copy)

    def _admission(
        self, entry: dict[str, Any], claim: str | None, debounced_copy: bool, info: dict[str, Any]
    ) -> Admission:
        """One admit (one ``findAndModify``), again as any run after a stale claim of a run with no result."""
        policy, options = self.policy, self.options
        assert isinstance(policy, Queue)
        while True:
            try:
                admission = Admission.of(
                    *self.store.admit(
                        self.key,
                        entry,
                        ttl=options.lease_seconds,
                        claim=claim,
                        timeout=policy.timeout,
                        max_length=policy.max_length,
                        replace=isinstance(policy, Replace),
                        debounce=policy.debounce if isinstance(policy, Replace) else None,
                        due=debounced_copy,
                        max_wait=policy.max_wait if isinstance(policy, Replace) else None,
                        min_hold=options.min_hold_seconds or 0.0,
                        info=info,
                        heartbeat=True,
                        heartbeat_seconds=options.heartbeat_seconds,
                        limit=options.limit,
                        cancel=isinstance(policy, Replace) and policy.cancel_running,
                    )
                )
            except StoreUnavailable as exc:
                unavailable(self.task, self.key, exc, policy, direct=False)
            if admission.outcome is AdmitOutcome.STALE and not has_final_state(self.task):
                # A handoff message whose claim failed, of a run that has no result: it claimed the key
                # and died (its worker killed), so it runs again, admitted as any run (a run timed out,
                # revoked or superseded has its result, and is dropped).
                claim = None
                continue
            return admission

    def _not_admitted(
        self, admission: Admission, entry: dict[str, Any], stamp: int, debounced_copy: bool
    ) -> Outcome:
        """The admit did not give this run the key: a copy is dropped (or parked, while its first run
        holds the key), a superseded run ends with that result, a full queue skips or fails it, and a
        parked run ends its delivery (``Ignore``)."""
        task, request, key, policy = self.task, self.request, self.key, self.policy
        assert isinstance(policy, Queue)
        outcome = admission.outcome
        holder, expires_at = dict(admission.holder), admission.expires_at
        who = (task.name, request.id)
        # (The admit judged a later attempt in its own command: ``retried``, not ``done``, when known.)
        if debounced_copy and outcome in (AdmitOutcome.ALREADY_RAN, AdmitOutcome.RUNNING):
            if outcome is AdmitOutcome.RUNNING:
                keep_a_debounced_copy_delivered_again(task, key, self.options)
            # The run was handed the key (due) before its delayed copy came, and ran or runs under its
            # own message (which reports a result lost with its worker): this copy has nothing to do.
            log_acquire.info("%s[%s]: delayed copy of a run that ran or runs on %r; dropped", *who, key)
            raise Ignore()
        if outcome is AdmitOutcome.ALREADY_RAN and not has_final_state(task, carried_on=lambda: False):
            # The run ran and released its key, and no result is stored: its worker may be storing it now,
            # or died first. Look again later, then end the task saying so (never run the body twice).
            return ended_without_a_result(task, key, self.options)
        if outcome in (AdmitOutcome.WAITING, AdmitOutcome.ALREADY_RAN, AdmitOutcome.STALE):
            what = {
                AdmitOutcome.WAITING: "parked or handed the key",
                AdmitOutcome.ALREADY_RAN: "over",
                AdmitOutcome.STALE: "no longer waiting (timed out, revoked, or handed again)",
            }[outcome]
            log_acquire.info("%s[%s]: copy of a run that is %s on %r; dropped", *who, what, key)
            ignored_as(request.id, f"is a copy of a run that is {what} on {key!r}: this copy is dropped")
            raise Ignore()
        if outcome is AdmitOutcome.RETRIED:
            copy_of_a_retried_attempt(task, key, entry)
        if outcome is AdmitOutcome.RUNNING:
            signals.lease_contended.send(sender=task, key=key, holder=holder, policy="duplicate")
            park_duplicate(task, key, self.options, False, resent=admission.resent and not self.copy)
            raise Ignore()
        signals.lease_contended.send(sender=task, key=key, holder=holder, policy=policy.name)
        if outcome is AdmitOutcome.SUPERSEDED and debounced_copy:
            # The delayed copy of a run that a newer send replaced: its result is written already.
            raise Ignore()
        if outcome is AdmitOutcome.SUPERSEDED and copy_with_a_result(task, self.copy or admission.resent):
            # A copy of a run whose body ran and stored its result (its lease was lost mid-body and a
            # newer send took the key: the key does not remember the run as over). Its result stands.
            log_acquire.info("%s[%s]: a copy of a run that ended, superseded on %r; dropped", *who, key)
            ignored_as(request.id, f"is a copy of a run that ended, superseded on {key!r}: dropped")
            raise Ignore()
        if outcome is AdmitOutcome.SUPERSEDED:
            by = str(admission.by)
            log_acquire.info(
                "%s[%s]: %r: a newer send (%s) supersedes this run: it ends %s, without running its body",
                *who,
                key,
                by,
                results.superseded_outcome_words(policy),
            )
            signals.run_superseded.send(sender=task, key=key, task_id=request.id, by=by)
            self.store.record_run_ending(key, "superseded", entry, fence=admission.fence, by=by)  # history
            leave_rate(task, [key], self.options)
            if getattr(policy, "fail_superseded", False):
                raise Superseded(key, None, by, held=False)
            return Outcome(results.superseded_result(key, by))
        if outcome is AdmitOutcome.FULL:
            reason = results.full_reason(
                key, admission.queued, policy.max_length, entry, in_document=len(admission.parked)
            )
            if isinstance(policy.then, Fail):
                raise QueueTimeout(key, reason)
            return ContendedRun(task, self.store, key, direct=False).held_by(holder, expires_at).skip(reason)
        self._parked(admission, stamp, debounced_copy)

    def _parked(self, admission: Admission, stamp: int, debounced_copy: bool) -> NoReturn:
        """Parked: its message is in the lease document; acknowledging it ends this delivery."""
        task, request, key, policy = self.task, self.request, self.key, self.policy
        assert isinstance(policy, Queue)
        mine = admission.superseded_by(request.id)
        if mine:
            end_superseded(task, self.store, key, mine, admission.fence)
        position = admission.position(request.id)
        if isinstance(policy, Replace) and policy.debounce and not debounced_copy:
            # Come back when the debounce has passed: the copy takes the key if no newer send came.
            # (Sooner when the burst it continues reaches max_wait first: its not-before time says.)
            due_in = admission.due_in(request.id)
            publish_debounced_copy(
                task, stamp, policy.debounce if due_in is None else min(due_in, policy.debounce)
            )
        signals.run_parked.send(sender=task, key=key, task_id=request.id, position=position, stamp=stamp)
        log_acquire.info(
            "%s[%s]: %s; policy %s: parked at position %d (state QUEUED, no worker slot held): it starts "
            "when the key is handed to it%s",
            task.name,
            request.id,
            LockContended(key, dict(admission.holder), admission.expires_at),
            policy.name,
            position,
            ", unless a newer send replaces it first" if isinstance(policy, Replace) else ", in send order",
        )
        ignored_as(
            request.id,
            f"parked at position {position} on {key!r}, not dropped: it starts when handed the key",
        )
        raise Ignore()
