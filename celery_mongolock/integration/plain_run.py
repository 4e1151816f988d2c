"""Admission of a run that is not parked, over its key set of any size: one key (also ``limit=N``) or
several (``keys=``, with a limit per key).

A run of ``Retry``, ``Skip``, ``Wait`` or ``Fail``, and any run a worker does not park (a direct call, an
eager run, a beat tick of a ``Queue`` task of one key), takes every key of its set in sorted order within
one attempt, or none: the keys taken are given back at once when one is held, so a run never holds some
keys while it waits for others, and two runs that need overlapping keys cannot deadlock. Then the policy
decides what the run does, whatever the shape of its key set (``Policy.on_contended``).

A task of one key is the same algorithm, one ``findAndModify`` an attempt; only a set of keys (a task of
``keys=(...)``) is confirmed by one renewal before its body starts (its first key may have expired while
the last was taken).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore

from celery_mongolock.admission.contention import ContendedRun, Outcome, skipped_result
from celery_mongolock.admission.policies import TRY_AGAIN
from celery_mongolock.core.outcomes import Contended
from celery_mongolock.exceptions import StoreUnavailable
from celery_mongolock.integration import signals
from celery_mongolock.integration.beatcheck import beat_tick, recorded_tick, warn_if_sent_by_another_beat
from celery_mongolock.integration.config import get_store
from celery_mongolock.integration.duplicates import (
    copy_of_an_ended_run,
    copy_run_ids,
    first_run_done,
    guard_run_ids,
    park_duplicate,
)
from celery_mongolock.integration.runs import (
    GuardedRun,
    contended_since,
    delivery,
    give_back_quietly,
    log_acquire,
    unavailable,
)

if TYPE_CHECKING:
    from celery_mongolock.core.store import Lease
    from celery_mongolock.integration.config import TaskOptions

__all__ = ["PlainRun", "parks"]


def parks(task: GuardedRun, policy: Any, direct: bool, *, one: bool) -> bool:
    """Whether a run is admitted by the engine as a queued run (``Queue``, ``Replace``), which may park
    it: a worker's run of a queued policy, except a beat tick of a task of one ``key=`` (its key records
    the tick: it runs once per tick or not at all, so it is never parked to run later) and a direct or
    eager call (nothing to park: no message). Every other run is a ``PlainRun``. Also says, once per
    process, when a beat without our scheduler sent the run."""
    request = task.request
    tick = beat_tick(request)[0]
    if tick is None:
        warn_if_sent_by_another_beat(task.name, request)
    return bool(
        policy.queued
        and (tick is None or not one)
        and not (direct or request.is_eager or request.called_directly)
    )


class PlainRun:
    """One run over ``keys`` (sorted, without repeats): ``take()`` returns the leases of all of them, in
    order, or the policy's outcome (or raises: ``Ignore`` for a copy dropped, the policy's error, a
    contention retry)."""

    def __init__(
        self,
        task: GuardedRun,
        keys: list[str],
        options: TaskOptions,
        *,
        direct: bool,
        limits: Mapping[str, int | None] | None = None,
        one: bool,
    ) -> None:
        self.task = task
        self.keys = keys
        #: A run of a task of ``keys=(...)`` (its results name its keys, whatever their number).
        self.several = not one
        #: The keys a result names (``keys``), for a run of a task of ``keys=(...)``.
        self.named_keys: list[str] | None = list(keys) if self.several else None
        self.options = options
        #: Each key's limit (None: a single lease); ``options.limit`` for a key not in it.
        self.limits: Mapping[str, int | None] = limits or {}
        self.policy = options.on_contention
        #: Called directly (``task(...)``), not by a worker.
        self.direct = direct
        self.store = get_store(task.app)
        self.request = task.request
        request = self.request
        self.info: dict[str, Any] = {
            "task_name": task.name,
            "task_id": request.id,
            "worker": request.hostname,
            "delivery": delivery(request),
        }
        if self.several:
            self.info["keys"] = keys
        # A beat tick of a task of one key runs once, however many beats sent it: the key remembers the
        # last tick that took it, and is held at least to the end of the tick's window (a single lease).
        self.tick, self.hold_until_ms = recorded_tick(request, one)
        if self.tick is not None:
            self.info["beat_tick"] = self.tick

    def take(self) -> list[Lease] | Outcome:
        """Every key taken (one attempt at a time), or the policy's outcome."""
        task, store, keys = self.task, self.store, self.keys
        try:
            done = first_run_done(task, store, keys[0])  # (a read, only for a copy of a message)
        except StoreUnavailable as exc:
            unavailable(task, keys[0], exc, self.policy, self.direct)
        if done:
            return copy_of_an_ended_run(task, store, keys[0], self.options, self.named_keys)
        # The duplicate guard, in each key's acquire (``guard_run_ids``): a copy of a run (redelivered,
        # parked), or a contention retry of an attempt that may have run in another line of retries, is
        # refused a key that remembers that attempt as over (``seen``), in the same command: the first
        # run's release may land between the look above and the acquire (issue 32). Only a body's release
        # writes ``seen``: the keys an attempt takes and gives back unrun are given back, never released.
        ended_runs = guard_run_ids(self.request)
        # How long this run has waited for its keys (the history's ``waited_ms``): from its first
        # contention, carried across contention retries by a header; counted here while it waits.
        since = contended_since(self.request)
        contended_at: float | None = None
        run = ContendedRun(task, store, keys[0], direct=self.direct)  # one run: Wait's timeout counts once
        while True:
            waited_ms = 0 if contended_at is None else int((store.clock.monotonic() - contended_at) * 1000)
            taken, blocked = self._try_all(ended_runs, waited_ms, since)
            if blocked is None:
                if self._confirmed(taken):
                    return taken
                continue
            # Given back, not released: this run did not run with them, so a minimum hold does not keep
            # them taken for nobody, and its tick is not spent.
            give_back_quietly(store, taken, untick=self.tick)
            key, contended = blocked
            try:
                ran = bool(ended_runs) and self._attempt_ran(key, contended, ended_runs)
            except StoreUnavailable as exc:  # (the read of a copy's run: never fail the task for it)
                unavailable(task, key, exc, self.policy, self.direct)
            if ran:
                return copy_of_an_ended_run(task, store, key, self.options, self.named_keys)
            if contended_at is None:
                contended_at = store.clock.monotonic()
            run.key = key  # the key it waits for now
            outcome = self._contended(run, key, contended)
            if outcome is TRY_AGAIN:
                continue
            assert isinstance(outcome, Outcome), f"{self.policy!r}.on_contended returned {outcome!r}"
            return outcome

    def _try_all(
        self, ended_runs: list[str], waited_ms: int, since: int | None
    ) -> tuple[list[Lease], tuple[str, Contended] | None]:
        """One attempt: the keys taken, in order, up to the first one held or refused (``(key,
        contended)``). ``ended_runs``: the duplicate guard's run ids, judged in each acquire (a refused
        acquire's reply then carries the key's ``seen``, also for a ``limit=N`` key)."""
        store, options, request, info = self.store, self.options, self.request, self.info
        taken: list[Lease] = []
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
                        tick=self.tick,
                        hold_until_ms=self.hold_until_ms,
                        waited_ms=waited_ms,
                        waited_since_ms=since,
                        limit=self.limits.get(key, options.limit),
                        ended_runs=ended_runs,
                    )
                except StoreUnavailable as exc:
                    give_back_quietly(store, taken, untick=self.tick)
                    unavailable(self.task, key, exc, self.policy, self.direct)
                if lease is None:
                    contended = Contended.of(
                        doc, task_id=request.id, delivery=info["delivery"], whole=bool(ended_runs)
                    )
                    return taken, (key, contended)
                taken.append(lease)
        except BaseException:  # a time limit, a revoke: never keep the keys taken so far
            give_back_quietly(store, taken, untick=self.tick)
            raise
        return taken, None

    def _attempt_ran(self, key: str, contended: Contended, run_ids: list[str]) -> bool:
        """After an acquire refused or contended: is this message a copy of a run that ended
        (``first_run_done``: one read), or a contention retry of an attempt that ran in another line of
        retries? The latter is judged on the acquire's own reply (``seen``), no round trip added."""
        if copy_run_ids(self.request):
            return first_run_done(self.task, self.store, key)
        return bool(contended.attempt_ran(run_ids))

    def _confirmed(self, taken: list[Lease]) -> bool:
        """A set of several keys is confirmed by one renewal before the body starts: an attempt slower
        than a lease must not let it run with a key that expired and was taken meanwhile (else they are
        all given back, and the run tries again). A task of one key took it in one command: nothing to
        confirm (the guarded body checks its lease's time left)."""
        if not self.several:
            return True
        store = self.store
        try:
            lost = store.renew_many(taken)
        except StoreUnavailable as exc:
            give_back_quietly(store, taken, untick=self.tick)
            unavailable(self.task, self.keys[0], exc, self.policy, self.direct)
        # ``renew_many`` leaves out leases already lost (their deadline passed while the other keys were
        # taken): those are not confirmed either.
        if not lost and not any(lease.lost for lease in taken):
            return True
        give_back_quietly(store, taken, untick=self.tick)
        return False

    def _contended(self, run: ContendedRun, key: str, contended: Contended) -> object:
        """``key`` is held: a tick that already ran is skipped, a duplicate delivery parked, and otherwise
        the policy decides (skip, fail, publish again later, or ``TRY_AGAIN``)."""
        task, request, tick = self.task, self.request, self.tick
        holder, expires_at = dict(contended.holder), contended.expires_at
        if contended.tick_ran(tick):
            # Another beat sent this tick too, and its run has taken (or is taking) the keys.
            log_acquire.info("%s[%s]: tick %s of %r already ran; skipped", task.name, request.id, tick, key)
            signals.lease_contended.send(sender=task, key=key, holder=holder, policy="tick-already-ran")
            return Outcome(skipped_result(key, holder, expires_at, f"tick {tick} already ran"))
        if contended.held_by_run(request.id):
            # The same message delivered twice (broker visibility timeout, acks_late) while its first run
            # still holds the key (for a ``limit=N`` key: a slot held by this very run is the holder): do
            # not run twice, and leave the first run's state alone.
            signals.lease_contended.send(sender=task, key=key, holder=holder, policy="duplicate")
            park_duplicate(task, key, self.options, self.direct)
            raise Ignore()
        signals.lease_contended.send(sender=task, key=key, holder=holder, policy=self.policy.name)
        # The policy decides (policies.py): skip, fail, publish again later, or wait and try again.
        return self.policy.on_contended(
            run.held_by(holder, expires_at, contended.message(key), contended.holders)
        )
