"""Singleton Celery tasks: a lease per key, taken when the task *starts*, in the worker.

``SingletonTask.__call__`` runs in the worker process that executes the body, whatever path the message
took (``delay``, ``apply_async``, ``send_task``, chains, beat, ETA):

1. render the key from the call's arguments (``keys.KeyRenderer``);
2. take the lease with one ``findAndModify``; the heartbeat thread keeps it alive while the body runs;
3. run the body with ``current_lease()`` set;
4. release it (one update) on every exit: return, exception, ``retry()``, soft time limit, revoke.

When the key is held, the task's policy decides (``policies``). When MongoDB cannot be reached the body
does not run (fail closed) and the run is retried later (``Fail`` fails it instead), so nothing is lost.

A prefork child that dies holding a lease (hard time limit, OOM, SIGKILL, revoke with terminate) cannot
release it; ``SingletonRequest`` runs in the worker's parent process, sees the failure, and releases the
dead child's leases (matched on task id and child pid) before the message is acknowledged or requeued.
"""

from __future__ import annotations

import collections
import contextvars
import datetime as _dt
import inspect
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, NoReturn, TypeVar, overload

from celery import Celery, Task, shared_task
from celery import signals as celery_signals
from celery import states as celery_states
from celery.exceptions import Ignore, Reject
from celery.exceptions import Retry as RetryTask
from kombu.exceptions import OperationalError

from celery_mongolock.admission.contention import ContendedRun, skipped_result
from celery_mongolock.admission.contention import Outcome as _Outcome
from celery_mongolock.admission.limits import limits_by_key
from celery_mongolock.admission.policies import (
    TRY_AGAIN,
    Fail,
    Policy,
    PolicySpec,
    Queue,
    Replace,
    Retry,
    check_keys,
    check_limit,
    parse_policy,
)
from celery_mongolock.core.documents import queue as _admission
from celery_mongolock.core.keys import KeyRenderer, KeySpec
from celery_mongolock.core.lease import LeaseSet
from celery_mongolock.core.outcomes import Admission, AdmitOutcome, Contended
from celery_mongolock.core.store import Lease, LeaseStore
from celery_mongolock.core.urls import redact
from celery_mongolock.exceptions import ConfigurationError, LockContended, QueueTimeout, StoreUnavailable
from celery_mongolock.integration import handoff as _queue
from celery_mongolock.integration import signals
from celery_mongolock.integration.childwatch import ChildWatchedRequest
from celery_mongolock.integration.config import TaskOptions, get_settings, get_store
from celery_mongolock.integration.headers import BEAT_HEADER
from celery_mongolock.integration.options import (
    check_decorator_options,
    check_task_class,
    install_start_up_error_hook,
)

__all__ = [
    "CONTENTION_HEADER",
    "DUPLICATE_HEADER",
    "QUEUED",
    "REPUBLISH_RETRY_POLICY",
    "SingletonRequest",
    "SingletonTask",
    "current_lease",
    "singleton_task",
]

log_acquire = logging.getLogger("celery_mongolock.acquire")
log_release = logging.getLogger("celery_mongolock.release")

#: The state of a parked run (``Queue``, ``Replace``): its meta says ``key``, ``position``, ``since``.
QUEUED = _queue.QUEUED
#: Message header counting contention retries, kept apart from the task's own ``retries``.
CONTENTION_HEADER = "mongolock_contention_retries"
#: Epoch ms (the sender's clock) of a run's first contention, carried by its contention retries: the lease
#: history counts the run's wait for its key from it (``waited_ms``).
CONTENDED_SINCE_HEADER = "mongolock_contended_since"
#: Set on the copy of a message delivered again while its first run still held the key (see
#: ``SingletonTask._park_duplicate``).
DUPLICATE_HEADER = "mongolock_parked_duplicate"
#: How a run is published again (a contention retry, a parked duplicate): kombu retries the publish for
#: about a minute, so that a broker restart does not fail the run (Celery's default policy gives up
#: after 0.6 s). The run holds no lease meanwhile, and a worker cut off from its broker has nothing else
#: to do.
REPUBLISH_RETRY_POLICY: dict[str, float] = {
    "max_retries": 30,
    "interval_start": 0.2,
    "interval_step": 0.5,
    "interval_max": 2.0,
}

_current: contextvars.ContextVar[Lease | None] = contextvars.ContextVar(
    "celery_mongolock_lease", default=None
)
known_apps = signals.known_apps  # the apps the shutdown hook releases leases for


def _censor_url_in_celery_reports() -> None:
    """Have Celery mask ``mongolock_url`` where it prints settings (``celery report``, ``inspect conf``).

    Celery masks only settings whose names look secret (``...PASS...``, ``...KEY...``); the lease store's
    URL may carry a password.
    """
    import re

    from celery.app import utils

    hidden = utils.HIDDEN_SETTINGS
    if not hidden.search("mongolock_url"):
        utils.HIDDEN_SETTINGS = re.compile(f"{hidden.pattern}|MONGOLOCK_URL", hidden.flags | re.IGNORECASE)


_censor_url_in_celery_reports()

# Worker and beat send import_modules before they create the tasks and read the settings: from then on a
# ConfigurationError that stops them is shown as one line, not as a traceback through Celery's start-up.
celery_signals.import_modules.connect(install_start_up_error_hook, weak=False)


def current_lease() -> Lease | None:
    """The lease of the singleton task running in this thread (None outside one, e.g. in a test that calls
    the function body itself, or in a plain task). A bound task (``bind=True``) has ``self.lease``, which
    is never None: it raises a clear error outside a singleton run instead.

    ``current_lease().lost`` turns true if the lease is lost while the body runs (taken over after the
    heartbeat could not renew it, or force-released); ``current_lease().raise_if_lost()`` raises
    ``LeaseLost`` then, which is the documented way for a long task to stop promptly. ``.fence`` is the
    fencing token to attach to writes. A task with several keys (``keys=(...)``) gets a ``LeaseSet``:
    ``current_lease()["email-group:7"]`` is that key's lease, with its own fence.
    """
    return _current.get()


class SingletonTask(Task):  # type: ignore[misc]
    """A Celery task that runs at most once at a time per lease key.

    Use ``@singleton_task(key=...)``, or ``@app.task(base=SingletonTask, mongolock_key=...)``.
    """

    abstract = True
    #: The key spec (see ``keys.KeyRenderer``): None = the task's name.
    mongolock_key: ClassVar[KeySpec] = None
    mongolock_on_contention: ClassVar[PolicySpec | None] = None
    mongolock_lease_seconds: ClassVar[float | None] = None
    mongolock_heartbeat_seconds: ClassVar[float | None] = None
    #: Keep the key taken at least this long after the run starts (ShedLock's lock-at-least-for).
    mongolock_min_hold_seconds: ClassVar[float | None] = None
    #: At most this many runs of one key at once (``limit=N``); None or 1: one.
    mongolock_limit: ClassVar[int | Mapping[Any, int] | None] = None
    #: Several keys held together (``keys=(spec, ...)``), instead of ``mongolock_key``.
    mongolock_keys: ClassVar[Sequence[KeySpec] | None] = None
    #: Expected errors: logged at INFO without a traceback.
    throws = (LockContended,)
    Request = "celery_mongolock.task:SingletonRequest"

    _mongolock_renderer: KeyRenderer | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # @app.task(base=SingletonTask, mongolock_...=...) creates a subclass: check it as
        # @singleton_task checks its arguments (for a lazily declared task, at app.finalize()).
        super().__init_subclass__(**kwargs)
        check_task_class(cls)

    @classmethod
    def on_bound(cls, app: Celery) -> None:
        known_apps.add(app)
        _install_bootstep(app)

    def _renderer(self) -> KeyRenderer:
        renderer = self.__dict__.get("_mongolock_renderer")
        if renderer is None:
            # self.run is bound for bind=True tasks, so its signature has no ``self``.
            spec = self.mongolock_key
            if inspect.ismethod(spec) and spec.__self__ is self:
                # A function given as key= is a class attribute of the task, so reading it through the
                # task binds it; the key callable takes the task's arguments only.
                spec = spec.__func__
            renderer = KeyRenderer(spec, self.run, self.name)
            self.__dict__["_mongolock_renderer"] = renderer
        return renderer

    @property
    def lease(self) -> Lease:
        """The lease held by this task's running body: ``self.lease.raise_if_lost()``, ``.fence`` (for
        ``bind=True`` tasks). Set whenever the body runs as a singleton run (in a worker, ``apply()``,
        or a direct call); anywhere else ``RuntimeError`` says why, rather than an ``AttributeError`` on
        ``None`` later."""
        lease = _current.get()
        if lease is None:
            raise RuntimeError(
                f"task {self.name!r}: self.lease is set only while the task's body runs as a singleton "
                "run (a worker, task.apply() or a direct call task(...)); calling the body another way "
                "(task.run(...)) takes no lease"
            )
        return lease

    def _key_specs(self) -> Sequence[KeySpec] | None:
        """``keys=(spec, ...)`` in force: ``mongolock_task_policies``' ``"keys"``, else the decorator's."""
        return self._options().keys

    def _renderers(self) -> list[KeyRenderer]:
        specs = self._key_specs()
        cached = self.__dict__.get("_mongolock_renderers")
        if cached is None or cached[0] != specs:
            renderers = []
            for given in specs or ():
                spec = given.__func__ if inspect.ismethod(given) and given.__self__ is self else given
                renderers.append(KeyRenderer(spec, self.run, self.name))
            cached = self.__dict__["_mongolock_renderers"] = (specs, renderers)
        return list(cached[1])

    def mongolock_keys_for(self, *args: Any, **kwargs: Any) -> list[str]:
        """The lease keys a call with these arguments holds: sorted, without repeats (one key for a task
        with ``key=``)."""
        if self._key_specs():
            return sorted({r.render(args, kwargs) for r in self._renderers()})
        return [self.mongolock_key_for(*args, **kwargs)]

    def mongolock_limits_for(self, *args: Any, **kwargs: Any) -> dict[str, int | None]:
        """Each key a call with these arguments holds (``mongolock_keys_for``) -> its limit: None for a
        single lease, N for N slots (``limit=N``, or ``limit=`` per key spec with ``keys=``)."""
        options = self._options()
        if options.key_limits is None:
            return dict.fromkeys(self.mongolock_keys_for(*args, **kwargs), options.limit)
        rendered = [
            (renderer.render(args, kwargs), n)
            for renderer, n in zip(self._renderers(), options.key_limits, strict=True)
        ]
        return limits_by_key(rendered)

    def mongolock_key_for(self, *args: Any, **kwargs: Any) -> str:
        """The lease key a call with these arguments uses."""
        return self._renderer().render(args, kwargs)

    def retry(  # noqa: PLR0917 - Celery's signature
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: Any = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Celery's ``Task.retry``, with the retry published patiently and never dropped in silence.

        Celery publishes a retry with ``task_publish_retry_policy`` (about 0.6 s by default) and, if the
        broker does not take it by then, rejects the running message *without* requeueing it: with
        ``acks_late`` the message is acknowledged and the task is gone, its state left at PENDING or
        RETRY with nothing anywhere (the lock-set checker lost tasks this way when the broker restarted
        while a body retried). A singleton task publishes its retry like a contention retry (kombu
        retries for about a minute, ``REPUBLISH_RETRY_POLICY``); if even that fails, the run ends in
        FAILURE with the publish error, where callers see it.
        """
        options.setdefault("retry", True)
        options.setdefault("retry_policy", REPUBLISH_RETRY_POLICY)
        try:
            if "producer" in options or self.request.called_directly or self.request.is_eager:
                return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
            with _queue.patient_producer(self.app) as producer:
                options["producer"] = producer
                return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        except OperationalError as unreachable:  # the connection could not be opened for about a minute
            log_acquire.error(
                "%s[%s]: could not publish the retry; the broker did not take it for about a minute: %s",
                self.name,
                self.request.id,
                redact(str(unreachable)),
            )
            raise
        except Reject as rejected:
            reason = rejected.reason
            if rejected.requeue or not isinstance(reason, Exception):
                raise
            log_acquire.error(
                "%s[%s]: could not publish the retry; the broker did not take it for about a minute: %s",
                self.name,
                self.request.id,
                redact(str(reason)),
            )
            raise reason from None

    def _options(self) -> TaskOptions:
        decorator_policy = self.mongolock_on_contention
        if decorator_policy is not None and not isinstance(decorator_policy, Policy):
            decorator_policy = parse_policy(decorator_policy, f"task {self.name!r} on_contention")
        return get_settings(self.app).for_task(
            self.name,
            on_contention=decorator_policy,
            lease_seconds=self.mongolock_lease_seconds,
            heartbeat_seconds=self.mongolock_heartbeat_seconds,
            min_hold_seconds=self.mongolock_min_hold_seconds,
            limit=self.mongolock_limit,
            keys=self.mongolock_keys,
        )

    # -- the guarded call ------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.request_stack.top is None:
            # Called directly (task(...)), not by a worker: push a request like Task.__call__ does.
            self.push_request(args=args, kwargs=kwargs)
            try:
                return self._guarded(args, kwargs, direct=True)
            finally:
                self.pop_request()
        # In a worker the tracer has pushed the request already (so Task.__call__ must not run).
        return self._guarded(args, kwargs, direct=False)

    def _guarded(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, direct: bool) -> Any:
        if self._key_specs():
            return self._guarded_many(args, kwargs, direct=direct)
        key = self._renderer().render(args, kwargs)
        taken = self._take(key, self._options(), direct)
        if not isinstance(taken, Lease):
            return taken.value  # the policy's outcome (e.g. Skip's result); the body did not run
        lease = taken
        request = self.request
        if lease.remaining <= 0:  # (not ``lease.lost``: that would queue a release marking the run over)
            # Its acquire was answered after the lease's whole time had passed (MongoDB paused or slow):
            # the key may be someone else's by now. Fail closed: give it back, and try again later.
            get_store(self.app).give_back(lease)
            self._unavailable(
                key,
                StoreUnavailable(f"the acquire of {key!r} was answered after its lease had run out"),
                self._options().on_contention,
                direct,
            )
        log_acquire.info("%s[%s] acquired %r (fence %s)", self.name, request.id, key, lease.fence)
        signals.lease_acquired.send(sender=self, key=key, lease=lease)
        token = _current.set(lease)
        try:
            return self.run(*args, **kwargs)
        finally:
            _current.reset(token)
            try:
                lease.release()
            except StoreUnavailable as exc:
                log_release.warning("%s[%s]: %s (retrying in the background)", self.name, request.id, exc)
            signals.lease_released.send(sender=self, key=key, lease=lease)

    def _guarded_many(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, direct: bool) -> Any:
        """A run that needs several keys: the body runs only while it holds all of them."""
        keys = self.mongolock_keys_for(*args, **kwargs)
        options = self._options()
        request = self.request
        queued = options.on_contention.queued and not (direct or request.is_eager or request.called_directly)
        if queued:
            taken = self._admit_all(keys, options)
        else:
            taken = self._take_all(keys, options, direct, self.mongolock_limits_for(*args, **kwargs))
        if not isinstance(taken, LeaseSet):
            return taken.value
        request = self.request
        log_acquire.info("%s[%s] acquired %s (fences %s)", self.name, request.id, keys, taken.fences)
        for lease in taken:
            signals.lease_acquired.send(sender=self, key=lease.key, lease=lease)
        token = _current.set(taken)
        try:
            return self.run(*args, **kwargs)
        finally:
            _current.reset(token)
            try:
                taken.release()
            except StoreUnavailable as exc:
                log_release.warning("%s[%s]: %s (retrying in the background)", self.name, request.id, exc)
            for lease in taken:
                signals.lease_released.send(sender=self, key=lease.key, lease=lease)

    def _take_all(
        self, keys: list[str], options: TaskOptions, direct: bool, limits: Mapping[str, int | None]
    ) -> LeaseSet | _Outcome:
        """Take every key, in sorted order, within one attempt: all of them, or none (the ones taken are
        released at once when one is held, so a run never holds some keys while it waits for others, and
        two runs that need overlapping keys cannot deadlock). Then the policy decides, as for one key."""
        store = get_store(self.app)
        request = self.request
        policy = options.on_contention
        info: dict[str, Any] = {
            "task_name": self.name,
            "task_id": request.id,
            "worker": request.hostname,
            "delivery": _delivery(request),
            "keys": keys,
        }
        # (No "first run done" check here: the keys a run gives back within an attempt look like a
        # finished run's, and a redelivered copy dropped for that would be lost. At least once, as any
        # acks_late task.)
        run = ContendedRun(self, store, keys[0], direct=direct)  # one run: Wait's timeout counts once
        while True:
            taken: list[Lease] = []
            blocked: tuple[str, Contended] | None = None
            try:
                for key in keys:
                    try:
                        lease, doc = store.try_acquire(
                            key,
                            options.lease_seconds,
                            info=info,
                            heartbeat=True,
                            heartbeat_seconds=options.heartbeat_seconds,
                            limit=limits.get(key),
                        )
                    except StoreUnavailable as exc:
                        _release_quietly(taken)
                        self._unavailable(key, exc, policy, direct)
                    if lease is None:
                        blocked = (key, Contended.of(doc, task_id=request.id, delivery=info["delivery"]))
                        break
                    taken.append(lease)
            except BaseException:  # a time limit, a revoke: never keep the keys taken so far
                _release_quietly(taken)
                raise
            if blocked is None:
                # One renewal confirms every lease before the body starts: an acquire slower than a
                # lease must not let it run with a key that expired and was taken meanwhile.
                try:
                    lost = store.renew_many(taken)
                except StoreUnavailable as exc:
                    _release_quietly(taken)
                    self._unavailable(keys[0], exc, policy, direct)
                # ``renew_many`` leaves out leases already lost (their deadline passed while the other
                # keys were taken): those are not confirmed either.
                if not lost and not any(lease.lost for lease in taken):
                    return LeaseSet(taken)
                _release_quietly(taken)
                continue
            _release_quietly(taken)
            key, contended = blocked  # (limit=N: a slot held by this very run is the holder)
            holder, expires_at = dict(contended.holder), contended.expires_at
            if contended.held_by_run(request.id):
                signals.lease_contended.send(sender=self, key=key, holder=holder, policy="duplicate")
                self._park_duplicate(key, options, direct)
                raise Ignore()
            signals.lease_contended.send(sender=self, key=key, holder=holder, policy=policy.name)
            run.key = key  # the key it waits for now
            outcome = policy.on_contended(run.held_by(holder, expires_at))
            if outcome is TRY_AGAIN:
                continue
            assert isinstance(outcome, _Outcome), f"{policy!r}.on_contended returned {outcome!r}"
            return outcome

    def _admit_all(self, keys: list[str], options: TaskOptions) -> LeaseSet | _Outcome:
        """A run of a ``Queue`` task that needs several keys: take them all (in sorted order, one admit
        each), claim them all when they were handed to it, or park it on every key it did not get and
        turn the keys it got into reservations for it (``LeaseStore.reserve``): it keeps its place on
        each key, holds none while its body is not running, and is published once all are reserved.

        Keys taken or claimed by an attempt that does not run the body are given back without marking
        the run as over (``LeaseStore.give_back``), so that a retry or copy of it still runs; the body
        starts only after one renewal has confirmed every lease (an admit slower than a lease must not
        let it run with a key another worker took meanwhile)."""
        policy = options.on_contention
        assert isinstance(policy, Queue)
        store = get_store(self.app)
        request = self.request
        stamp, src = _queue.stamp_of(request)
        delivery = str(int(getattr(request, "retries", 0) or 0))
        ident = f"{request.id}/{delivery}"
        entry: dict[str, Any] = {
            "id": ident,
            "t": request.id,
            "n": self.name,
            "r": delivery,
            "s": stamp,
            "src": src,
            "th": policy.then.name,
            "ks": keys,
            # One handoff token for all the keys (the same on every admit of this run).
            "tk": _queue.keys_token(ident, keys),
            **_queue.message_of(self, request, stamp, ident),
        }
        info: dict[str, Any] = {
            "task_name": self.name,
            "task_id": request.id,
            "worker": request.hostname,
            "delivery": delivery,
            "keys": keys,
        }
        _queue.install_publisher(self.app, store)
        claim = _queue.handoff_of_keys(request, keys, ident)
        fresh = not (
            claim
            or (request.headers or {}).get(DUPLICATE_HEADER)
            or (request.delivery_info or {}).get("redelivered")
        )
        if fresh:
            since = _dt.datetime.now(_dt.timezone.utc).isoformat()
            self._set_state(QUEUED, {"key": keys[0], "keys": keys, "since": since}, unless_ready=True)

        def admit(key: str, claim: str | None) -> Admission:
            return Admission.of(
                *store.admit(
                    key,
                    entry,
                    ttl=options.lease_seconds,
                    claim=claim,
                    timeout=policy.timeout,
                    max_length=policy.max_length,
                    info=info,
                    heartbeat=True,
                    heartbeat_seconds=options.heartbeat_seconds,
                )
            )

        def confirmed(leases: list[Lease]) -> bool:
            """All still ours on the server (one round trip); else all given back (also when MongoDB
            does not answer: the run retries later, and its keys must not stay held by no body)."""
            try:
                lost = store.renew_many(leases)
            except StoreUnavailable:
                _give_back_quietly(store, leases)
                raise
            # ``renew_many`` leaves out leases already lost (their deadline passed while the other keys
            # were taken: the lock-set checker's seed 26): those are not confirmed either.
            if not lost and not any(lease.lost for lease in leases):
                return True
            _give_back_quietly(store, leases)
            log_acquire.info(
                "%s[%s]: a key expired while the others were taken; again", self.name, request.id
            )
            return False

        try:
            for _attempt in range(5):
                if claim is not None:
                    claimed, outcome, key = self._claim_all(keys, claim, admit, store, entry, policy)
                    if claimed is not None:
                        if not confirmed(claimed):
                            claim = None
                            continue
                        self._set_state(celery_states.STARTED, {"keys": keys})
                        return LeaseSet(claimed)
                    if outcome is AdmitOutcome.RUNNING:  # a copy of the handoff while the first copy runs
                        self._park_duplicate(key, options, False)
                        raise Ignore()
                    if outcome is AdmitOutcome.WAITING:  # waiting again on that key: published when ready
                        self._parked_all(keys, store, entry, stamp)
                    if outcome is AdmitOutcome.RETRIED:
                        self._copy_of_a_retried_attempt(key, entry)
                    if self._has_final_state():
                        log_acquire.info("%s[%s]: stale handoff of %s; dropped", self.name, request.id, keys)
                        raise Ignore()
                    claim = None  # claimed and died (its worker killed): admitted as any run, below
                taken, blocked = self._admit_each(keys, admit, store, entry, policy)
                if blocked is None:
                    if not taken:  # parked or reserved on every key
                        self._parked_all(keys, store, entry, stamp)
                    if confirmed(taken):  # every key taken in this attempt
                        self._set_state(celery_states.STARTED, {"keys": keys})
                        return LeaseSet(taken)
                    continue
                key, admission = blocked
                outcome = admission.outcome
                if outcome is AdmitOutcome.ALREADY_RAN:
                    if not self._has_final_state():
                        return _Outcome(_already_ran(key, request.id))
                    raise Ignore()
                if outcome is AdmitOutcome.RUNNING:
                    self._park_duplicate(key, options, False)
                    raise Ignore()
                if outcome is AdmitOutcome.RETRIED:
                    self._copy_of_a_retried_attempt(key, entry)
                assert outcome is AdmitOutcome.FULL, outcome
                reason = f"the queue of {key!r} is full ({policy.max_length} runs parked)"
                if isinstance(policy.then, Fail):
                    raise QueueTimeout(key, reason)
                return (
                    ContendedRun(self, store, key, direct=False)
                    .held_by(dict(admission.holder), admission.expires_at)
                    .skip(reason)
                )
            raise StoreUnavailable(f"the keys {keys} kept expiring while they were taken")
        except StoreUnavailable as exc:
            self._unavailable(keys[0], exc, policy, direct=False)

    def _claim_all(  # noqa: PLR0917 - the run's state, handed over as is
        self,
        keys: list[str],
        claim: str,
        admit: Callable[[str, str | None], Admission],
        store: LeaseStore,
        entry: dict[str, Any],
        policy: Queue,
    ) -> tuple[list[Lease] | None, AdmitOutcome | None, str]:
        """Claim every key handed to this run. ``(leases, None, "")`` when all were claimed; else the
        keys claimed so far are reservations again, and ``(None, outcome, key)`` says why ``key``
        failed."""
        claimed: list[Lease] = []
        try:
            for key in keys:
                admission = admit(key, claim)
                if admission.lease is not None:
                    claimed.append(admission.lease)
                    continue
                outcome = admission.outcome
                if outcome in (AdmitOutcome.RUNNING, AdmitOutcome.RETRIED):
                    # (RETRIED: a later attempt carries the task on; this one keeps no key.)
                    _give_back_quietly(store, claimed)
                else:
                    # Not (or no longer) reserved for this run here: an older run was handed it, or its
                    # reservation expired and it waits again. Keep the keys claimed as reservations.
                    self._reserve_all(claimed, admit, store, entry, policy)
                claimed = []
                return None, outcome, key
        except BaseException:
            _give_back_quietly(store, claimed)
            raise
        return claimed, None, ""

    def _admit_each(
        self,
        keys: list[str],
        admit: Callable[[str, str | None], Admission],
        store: LeaseStore,
        entry: dict[str, Any],
        policy: Queue,
    ) -> tuple[list[Lease], tuple[str, Admission] | None]:
        """One attempt over every key: ``(leases, None)`` when all were taken; ``([], None)`` when the
        run is parked or reserved on each; otherwise the keys taken are given back, this attempt's parks
        removed, and ``([], (key, admission))`` says which key did not let it wait, and why
        (``ALREADY_RAN``, ``RUNNING``, ``FULL``)."""
        taken: list[Lease] = []
        waiting = False
        try:
            for key in keys:
                admission = admit(key, None)
                if admission.lease is not None:
                    taken.append(admission.lease)
                    continue
                if admission.outcome in (AdmitOutcome.PARKED, AdmitOutcome.WAITING):
                    waiting = True
                    continue
                # done, running, retried, full: this run does not wait. Give back what it took and leave
                # the queues it joined in this attempt (never another copy's places: only this entry's).
                _give_back_quietly(store, taken)
                taken = []
                if admission.outcome in (AdmitOutcome.FULL, AdmitOutcome.ALREADY_RAN, AdmitOutcome.RETRIED):
                    for other in keys:
                        store.unpark(other, entry["id"])
                return [], (key, admission)
        except BaseException:
            _give_back_quietly(store, taken)
            raise
        if not waiting:
            return taken, None
        self._reserve_all(taken, admit, store, entry, policy)
        return [], None

    def _reserve_all(
        self,
        leases: list[Lease],
        admit: Callable[[str, str | None], Admission],
        store: LeaseStore,
        entry: dict[str, Any],
        policy: Queue,
    ) -> None:
        """Keys taken by an attempt that must wait: each becomes a reservation for the run's entry. A key
        lost meanwhile (expired, forced) is admitted again: taken (and reserved) or parked on."""
        pending = list(leases)
        rounds = 0
        try:
            while pending:
                lease = pending.pop(0)
                if store.reserve(lease, entry, timeout=policy.timeout):
                    continue
                rounds += 1
                if rounds > 3 * len(leases):
                    raise StoreUnavailable(f"{lease.key!r} kept being lost while this run reserved it")
                again = admit(lease.key, None)
                if again.lease is not None:
                    pending.append(again.lease)
                elif again.outcome not in (AdmitOutcome.PARKED, AdmitOutcome.WAITING):
                    raise StoreUnavailable(
                        f"{lease.key!r} was lost while this run reserved it, and it cannot wait there "
                        f"({again.outcome.value})"
                    )
        except BaseException:
            _give_back_quietly(store, pending)
            raise

    def _parked_all(self, keys: list[str], store: LeaseStore, entry: dict[str, Any], stamp: int) -> NoReturn:
        """Parked or reserved on every key: published when all are reserved for it (by whoever makes
        the last reservation; here if that was this attempt)."""
        if store.reserved_for_all(entry):
            _queue.publish_handoff(self.app, keys[0], {**entry, "hn": 1}, store)
        signals.run_parked.send(sender=self, key=keys[0], task_id=entry["t"], position=0, stamp=stamp)
        log_acquire.info(
            "%s[%s]: waits for %s (parked or reserved on each, no worker slot held): it starts once every "
            "key is handed to it",
            self.name,
            entry["t"],
            keys,
        )
        _ignored_as(
            entry["t"], f"waits for {', '.join(map(repr, keys))}, not dropped: it starts once it has them all"
        )
        raise Ignore()

    def _take(self, key: str, options: TaskOptions, direct: bool) -> Lease | _Outcome:
        """Take the lease, or carry out the contention policy (which raises, or returns an outcome)."""
        store = get_store(self.app)
        request = self.request
        policy = options.on_contention
        info: dict[str, Any] = {
            "task_name": self.name,
            "task_id": request.id,
            "worker": request.hostname,
            "delivery": _delivery(request),
        }
        tick, hold_until_ms = _beat_tick(request)
        if tick is not None:
            info["beat_tick"] = tick
        else:
            _warn_if_sent_by_another_beat(self.name, request)
        run = ContendedRun(self, store, key, direct=direct)
        if policy.queued and tick is None and not (direct or request.is_eager or request.called_directly):
            # (A beat tick is not parked: it runs once per tick or not at all, see the acquire below.)
            return self._admit(key, options, policy, info, store)
        try:
            first_run_done = self._first_run_done(store, key)
        except StoreUnavailable as exc:
            self._unavailable(key, exc, policy, direct)
        if first_run_done:
            return self._copy_of_an_ended_run(key)
        # A copy's acquire refuses the key when its run is remembered as over, in the same command: the
        # first run's release may land between the look above and this acquire (issue 32).
        ended_runs = _copy_run_ids(request)
        # How long this run has waited for its key (the lease history's ``waited_ms``): from its first
        # contention, carried across contention retries by a header; counted here while it waits.
        contended_since = _contended_since(request)
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
                    waited_since_ms=contended_since,
                    limit=options.limit,
                    ended_runs=ended_runs,
                )
                if lease is None and ended_runs and self._first_run_done(store, key):
                    return self._copy_of_an_ended_run(key)
            except StoreUnavailable as exc:
                return self._unavailable(key, exc, policy, direct)
            if lease is not None:
                return lease
            if contended_at is None:
                contended_at = store.clock.monotonic()
            contended = Contended.of(doc)
            holder, expires_at = dict(contended.holder), contended.expires_at
            if contended.tick_ran(tick):
                # Another beat sent this tick too, and its run has taken (or is taking) the key.
                log_acquire.info(
                    "%s[%s]: tick %s of %r already ran; skipped", self.name, request.id, tick, key
                )
                signals.lease_contended.send(sender=self, key=key, holder=holder, policy="tick-already-ran")
                return _Outcome(skipped_result(key, holder, expires_at, f"tick {tick} already ran"))
            if contended.held_by_run(request.id):
                # The same message delivered twice (broker visibility timeout, acks_late) while its first
                # run still holds the lease: do not run twice, and leave the first run's state alone.
                signals.lease_contended.send(sender=self, key=key, holder=holder, policy="duplicate")
                self._park_duplicate(key, options, direct)
                raise Ignore()
            signals.lease_contended.send(sender=self, key=key, holder=holder, policy=policy.name)
            # The policy decides (policies.py): skip, fail, publish again later, or wait and try again.
            outcome = policy.on_contended(run.held_by(holder, expires_at))
            if outcome is TRY_AGAIN:
                continue
            assert isinstance(outcome, _Outcome), f"{policy!r}.on_contended returned {outcome!r}"
            return outcome

    def _admit(
        self, key: str, options: TaskOptions, policy: Policy, info: dict[str, Any], store: LeaseStore
    ) -> Lease | _Outcome:
        """A run of a queued task (``Queue``, ``Replace``): take the key, claim it when it was handed to
        this run, or park the run (and acknowledge its message) until the key is handed to it."""
        assert isinstance(policy, Queue)
        request = self.request
        stamp, _src = _queue.stamp_of(request)
        # A queued run is one run per task id and own retry: a contention retry (after MongoDB did not
        # answer) is the same run, and must find its own park if that landed.
        delivery = str(int(getattr(request, "retries", 0) or 0))
        info["delivery"] = delivery
        entry: dict[str, Any] = {
            "id": f"{request.id}/{delivery}",
            "t": request.id,
            "n": self.name,
            "r": delivery,
            "s": stamp,
            "src": _src,
            "th": policy.then.name,
            **_queue.message_of(self, request, stamp, f"{request.id}/{delivery}"),
        }
        _queue.install_publisher(self.app, store)
        debounced_copy = bool(_queue.header(request, _queue.DEBOUNCE_HEADER))
        claim = _queue.handoff_of(request, key, entry["id"])
        fresh = not (
            claim
            or debounced_copy
            or (request.headers or {}).get(DUPLICATE_HEADER)
            or (request.delivery_info or {}).get("redelivered")
        )
        if fresh:
            # QUEUED before the admit, never after it: once parked, the run may be handed the key and end
            # at any moment, and a state written later would hide its result.
            since = _dt.datetime.now(_dt.timezone.utc).isoformat()
            self._set_state(QUEUED, {"key": key, "since": since}, unless_ready=True)
        while True:
            try:
                admission = Admission.of(
                    *store.admit(
                        key,
                        entry,
                        ttl=options.lease_seconds,
                        claim=claim,
                        timeout=policy.timeout,
                        max_length=policy.max_length,
                        replace=isinstance(policy, Replace),
                        debounce=policy.debounce if isinstance(policy, Replace) else None,
                        due=debounced_copy,
                        min_hold=options.min_hold_seconds or 0.0,
                        info=info,
                        heartbeat=True,
                        heartbeat_seconds=options.heartbeat_seconds,
                        limit=options.limit,
                    )
                )
            except StoreUnavailable as exc:
                self._unavailable(key, exc, policy, direct=False)
            if admission.outcome is AdmitOutcome.STALE and not self._has_final_state():
                # A handoff message whose claim failed, of a run that has no result: it claimed the key
                # and died (its worker killed), so it runs again, admitted as any run (a run timed out,
                # revoked or superseded has its result, and is dropped).
                claim = None
                continue
            break
        lease = admission.lease
        if lease is not None:
            self._set_state(celery_states.STARTED, {"key": key, "fence": lease.fence})
            return lease
        outcome = admission.outcome
        holder, expires_at = dict(admission.holder), admission.expires_at
        who = (self.name, request.id)
        if outcome is AdmitOutcome.ALREADY_RAN and not self._has_final_state():
            # The run ran and released its key, and its worker died before its result was stored: end
            # this copy with a result that says so (never run the body twice, never leave it waiting).
            return _Outcome(_already_ran(key, request.id))
        if outcome in (AdmitOutcome.WAITING, AdmitOutcome.ALREADY_RAN, AdmitOutcome.STALE):
            what = {
                AdmitOutcome.WAITING: "parked or handed the key",
                AdmitOutcome.ALREADY_RAN: "over",
                AdmitOutcome.STALE: "no longer waiting (timed out, revoked, or handed again)",
            }[outcome]
            log_acquire.info("%s[%s]: copy of a run that is %s on %r; dropped", *who, what, key)
            _ignored_as(request.id, f"is a copy of a run that is {what} on {key!r}: this copy is dropped")
            raise Ignore()
        if outcome is AdmitOutcome.RETRIED:
            self._copy_of_a_retried_attempt(key, entry)
        if outcome is AdmitOutcome.RUNNING:
            signals.lease_contended.send(sender=self, key=key, holder=holder, policy="duplicate")
            self._park_duplicate(key, options, False)
            raise Ignore()
        signals.lease_contended.send(sender=self, key=key, holder=holder, policy=policy.name)
        if outcome is AdmitOutcome.SUPERSEDED and debounced_copy:
            # The delayed copy of a run that a newer send replaced: its result is written already.
            raise Ignore()
        if outcome is AdmitOutcome.SUPERSEDED:
            by = str(admission.by)
            log_acquire.info(
                "%s[%s]: %r: a newer send (%s) supersedes this run: it ends SUCCESS with a 'superseded' "
                "result, without running its body",
                *who,
                key,
                by,
            )
            signals.run_superseded.send(sender=self, key=key, task_id=request.id, by=by)
            store.record_run_ending(key, "superseded", entry, fence=admission.fence, by=by)  # history
            return _Outcome(_queue.superseded_result(key, by))
        if outcome is AdmitOutcome.FULL:
            reason = f"the queue of {key!r} is full ({policy.max_length} runs parked)"
            if isinstance(policy.then, Fail):
                raise QueueTimeout(key, reason)
            return ContendedRun(self, store, key, direct=False).held_by(holder, expires_at).skip(reason)
        # Parked: its message is in the lease document; acknowledging it ends this delivery.
        mine = admission.superseded_by(request.id)
        if mine:
            # Only for runs that have written their state QUEUED: a run that has not yet would overwrite
            # its result with it (it writes QUEUED before it parks, so this is rare: the write failed).
            _queue.write_superseded(
                self.app, store, key, mine, ready=_queue.marked_queued(self.app), fence=admission.fence
            )
        position = admission.position(request.id)
        if isinstance(policy, Replace) and policy.debounce and not debounced_copy:
            # Come back when the debounce has passed: the copy takes the key if no newer send came.
            headers = dict(request.headers or {})
            headers[_queue.DEBOUNCE_HEADER] = 1
            headers[_queue.SENT_HEADER] = stamp
            self._republish(
                self.signature_from_request(request, countdown=policy.debounce, headers=headers),
                "debounce",
            )
        signals.run_parked.send(sender=self, key=key, task_id=request.id, position=position, stamp=stamp)
        log_acquire.info(
            "%s[%s]: %s; policy %s: parked at position %d (state QUEUED, no worker slot held): it starts "
            "when the key is handed to it%s",
            *who,
            LockContended(key, holder, expires_at),
            policy.name,
            position,
            ", unless a newer send replaces it first" if isinstance(policy, Replace) else ", in send order",
        )
        _ignored_as(
            request.id,
            f"parked at position {position} on {key!r}, not dropped: it starts when handed the key",
        )
        raise Ignore()

    def _has_final_state(self) -> bool:
        """Whether this task id has a final state in the result backend, or a retry of it is on its way
        (``RETRY``: the body called ``self.retry()``, and that newer run will store the result): then a
        copy of an earlier run has nothing to do. True when there is no backend to ask (nothing would
        wait for a result)."""
        if self.ignore_result or self.request.ignore_result or not _queue.has_backend(self.app):
            return True
        try:
            meta = self.backend.get_task_meta(self.request.id)
        except Exception:
            return True  # cannot tell: drop the copy, as before
        status = meta.get("status")
        return status in celery_states.READY_STATES or (
            status == celery_states.RETRY and not _contention_retry_meta(meta.get("result"))
        )

    def _set_state(self, state: str, meta: dict[str, Any], *, unless_ready: bool = False) -> None:
        """Write this run's state (only for humans and ``AsyncResult.state``: failures are logged)."""
        if self.ignore_result or self.request.ignore_result or not _queue.has_backend(self.app):
            return
        task_id = self.request.id
        try:
            if (
                unless_ready
                and self.backend.get_task_meta(task_id).get("status") in celery_states.READY_STATES
            ):
                return  # an earlier run of this task id ended: leave its result alone
            self.backend.store_result(task_id, meta, state)
        except Exception as exc:
            log_acquire.warning("%s[%s]: could not set state %s: %s", self.name, task_id, state, exc)

    def _park_duplicate(self, key: str, options: TaskOptions, direct: bool) -> None:
        """Keep a copy of a duplicate delivery until the first run's fate is known.

        Acknowledging the duplicate also acknowledges the first delivery (they share one broker message:
        kombu's Redis transport keeps one unacknowledged entry per message), so if the first run's worker
        then died nothing would bring the task back. The copy is published again, marked, to be looked
        at after one lease length: dropped if the first run has released the key, run if the first run
        died (its lease released for it or expired), parked again if it is still running.
        """
        request = self.request
        if direct or request.is_eager or request.called_directly:
            return
        countdown = max(1.0, min(options.lease_seconds, 300.0))
        headers = dict(request.headers or {})
        headers[DUPLICATE_HEADER] = int(headers.get(DUPLICATE_HEADER) or 0) + 1
        self._republish(
            self.signature_from_request(request, countdown=countdown, headers=headers), "parked duplicate"
        )
        log_acquire.warning(
            "%s[%s]: duplicate delivery while the first run holds %r; parked, looked at again in %gs",
            self.name,
            request.id,
            key,
            countdown,
        )

    def _copy_of_an_ended_run(self, key: str) -> _Outcome:
        """A copy of a run that ended and released ``key`` itself: end the task saying so when its result
        was never stored (the run's worker died in between), else drop the copy. Never runs the body."""
        request = self.request
        if not self._has_final_state():
            return _Outcome(_already_ran(key, request.id))
        log_acquire.info(
            "%s[%s]: %s of a run that has ended and released %r; dropped",
            self.name,
            request.id,
            "parked duplicate" if (request.headers or {}).get(DUPLICATE_HEADER) else "redelivery",
            key,
        )
        raise Ignore()

    def _copy_of_a_retried_attempt(self, key: str, entry: dict[str, Any]) -> NoReturn:
        """A copy of an attempt whose body called ``self.retry()`` (a stale handoff message, a redelivery):
        a later attempt of the task is parked, handed, running or over on ``key`` and carries the task
        on (its result is that attempt's to store). Never run, parked, or ended here."""
        request = self.request
        log_acquire.info(
            "%s[%s]: copy of attempt %s on %r, whose body retried: a later attempt of the task is parked, "
            "running or over; dropped",
            self.name,
            request.id,
            entry["r"],
            key,
        )
        _ignored_as(
            request.id,
            f"is a copy of attempt {entry['r']} on {key!r}, whose body retried: this copy is dropped",
        )
        raise Ignore()

    def _first_run_done(self, store: Any, key: str) -> bool:
        """For a parked duplicate, or a message the broker delivered again (a worker died before it
        acknowledged, a visibility timeout): did a run of this very delivery (same task id, same retry
        and contention-retry count) end and release the key itself? Then running it again would be a
        second run of one submission. One read, only for such messages. The key remembers the last
        ``SEEN_KEPT`` runs that ended so (``seen``), whoever took it since, for 2 hours after its last
        lease (``SEEN_KEEP_MS``); the holder fields cover a holder recorded without its delivery."""
        request = self.request
        ended_runs = _copy_run_ids(request)
        if not ended_runs:
            return False
        return bool(
            store.run_ended(
                key,
                ended_runs,
                task_id=request.id,
                delivery=_delivery(request),
                parked=bool((request.headers or {}).get(DUPLICATE_HEADER)),
            )
        )

    def _unavailable(self, key: str, exc: StoreUnavailable, policy: Policy, direct: bool) -> NoReturn:
        """MongoDB could not be reached: never run the body. Retry later (or fail, under Fail)."""
        request = self.request
        log_acquire.error("%s[%s]: cannot take %r, body not run: %s", self.name, request.id, key, exc)
        policy.on_unavailable(ContendedRun(self, get_store(self.app), key, direct=direct), exc)

    def mongolock_retry_later(self, policy: Retry, exc: Exception) -> NoReturn:
        """Publish this run again after a backoff; the task's own ``retries`` budget is not used."""
        request = self.request
        headers = dict(request.headers or {})
        attempt = int(headers.get(CONTENTION_HEADER) or 0)
        if policy.exhausted(attempt):
            log_acquire.info("%s[%s]: giving up after %d contention retries", self.name, request.id, attempt)
            raise exc
        countdown = policy.delay(attempt)
        headers[CONTENTION_HEADER] = attempt + 1
        headers.setdefault(CONTENDED_SINCE_HEADER, int(time.time() * 1000))
        signature = self.signature_from_request(request, countdown=countdown, headers=headers)
        self._republish(signature, "contention retry")
        # One INFO line per contention: Celery's own "Task ...[id] retry: <message>" carries the key, the
        # holder and the policy; ours is for debugging only.
        message = f"{exc}; policy {policy.name}: contention retry {attempt + 1} in {countdown:.2f}s"
        log_acquire.debug("%s[%s]: %s", self.name, request.id, message)
        raise RetryTask(message=message, exc=exc, when=countdown, sig=signature)

    def _republish(self, signature: Any, what: str) -> None:
        try:
            _queue.publish_patiently(self.app, signature)
        except Exception as exc:
            log_acquire.error(
                "%s[%s]: could not publish the %s; the broker did not take it for about a minute: %s",
                self.name,
                self.request.id,
                what,
                redact(str(exc)),
            )
            raise


def _already_ran(key: str, task_id: str) -> dict[str, Any]:
    """The result of a copy of a run whose body ran and ended, but whose result was never stored."""
    return {
        "mongolock": "already-ran",
        "key": key,
        "reason": f"the body of {task_id} ran and released {key!r}; its worker died before it stored "
        "the result, which is lost (the body is never run twice)",
    }


def _contention_retry_meta(result: Any) -> bool:
    """Whether a ``RETRY`` state's stored reason is one of this library's contention retries (the key was
    held, or MongoDB did not answer), not the body's own ``self.retry()``."""
    name = result.get("exc_type") if isinstance(result, dict) else type(result).__name__
    return name in ("LockContended", "StoreUnavailable")


def _give_back_quietly(store: LeaseStore, leases: list[Lease]) -> None:
    """Give back keys taken by an attempt that does not run the body (in reverse order), without
    marking the run as over; one that cannot be given back now expires (its run never used it)."""
    for lease in reversed(leases):
        try:
            store.give_back(lease)
        except StoreUnavailable as exc:
            log_release.warning("%s (it expires on its own)", exc)


def _release_quietly(leases: list[Lease]) -> None:
    """Give back the keys a multi-key run took before it found one held (in reverse order)."""
    for lease in reversed(leases):
        try:
            lease.release()
        except StoreUnavailable as exc:  # queued for the background release
            log_release.warning("%s", exc)


def _delivery(request: Any) -> str:
    """Which run of a task id a message is: its own retries and its contention retries. A copy of the
    same message (redelivered, parked) has the same; ``Task.retry()`` and a contention retry do not."""
    headers = getattr(request, "headers", None) or {}
    return f"{int(getattr(request, 'retries', 0) or 0)}.{int(headers.get(CONTENTION_HEADER) or 0)}"


def _copy_run_ids(request: Any) -> list[str]:
    """What a copy of a message (parked duplicate, or delivered again by the broker) is matched on in
    ``seen`` (``_admission.ran``); empty for any other message (a first delivery is never checked).

    Any run of the same attempt (task id and own retries), whatever its contention retries: a parked
    copy that MongoDB did not answer goes on as a contention retry (``<retries>.1``), and is still a copy
    of the run ``<retries>.0`` that holds the key. A parked copy also matches a holder recorded without its
    delivery (an older version, ``hold()``)."""
    parked = bool((getattr(request, "headers", None) or {}).get(DUPLICATE_HEADER))
    redelivered = bool((getattr(request, "delivery_info", None) or {}).get("redelivered"))
    task_id = getattr(request, "id", None)
    if not (parked or redelivered) or not task_id:
        return []
    ids = [_admission.run_id(task_id, f"{int(getattr(request, 'retries', 0) or 0)}.")]
    return [*ids, _admission.run_id(task_id, "")] if parked else ids


def _contended_since(request: Any) -> int | None:
    """Epoch ms of the run's first contention, from the header its contention retries carry."""
    value = (getattr(request, "headers", None) or {}).get(CONTENDED_SINCE_HEADER)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _beat_tick(request: Any) -> tuple[int | None, int | None]:
    """The nominal tick (epoch ms) and the end of its window, from the header our beat scheduler adds."""
    stamp = (request.headers or {}).get(BEAT_HEADER) if request is not None else None
    if not isinstance(stamp, dict):
        return None, None
    try:
        tick = int(stamp["tick"])
        window_ms = int(float(stamp.get("window") or 0) * 1000)
    except (KeyError, TypeError, ValueError):
        return None, None
    guard_ms = min(1000, window_ms // 10)  # free the key a little before the next tick is due
    return tick, tick + max(0, window_ms - guard_ms)


# -- Celery's "ignored" line, in our words ----------------------------------------------------------------
# A run that is parked, or a copy that is dropped, ends its delivery with ``Ignore``: Celery then logs
# "Task proj.upload[id] ignored", which reads as if the run were lost. For our runs the line says what
# became of it instead ("Task proj.upload[id] parked at position 1 on 'email-group:42', not dropped: ...").

_IGNORED_AS: collections.OrderedDict[str, str] = collections.OrderedDict()
_IGNORED_AS_MAX = 1000  # entries of runs whose line was never logged (INFO disabled) are forgotten


def _ignored_as(task_id: Any, words: str) -> None:
    """Have Celery's "ignored" line for ``task_id`` say ``words`` instead."""
    if task_id is None:
        return
    _IGNORED_AS[str(task_id)] = words
    while len(_IGNORED_AS) > _IGNORED_AS_MAX:
        _IGNORED_AS.popitem(last=False)


class _IgnoredInOurWords(logging.Filter):
    """On ``celery.app.trace``: the "ignored" line of a run we parked or dropped says what became of it."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, dict) and args.get("description") == "ignored":
            words = _IGNORED_AS.pop(str(args.get("id")), None)
            if words is not None:
                record.args = {**args, "description": words}
        return True


_trace_logger = logging.getLogger("celery.app.trace")
if not any(isinstance(f, _IgnoredInOurWords) for f in _trace_logger.filters):
    _trace_logger.addFilter(_IgnoredInOurWords())


# -- a beat that does not run our scheduler -------------------------------------------------------------

OUR_SCHEDULER = "celery_mongolock.beat:Scheduler"  # the path users write (the public shim's)
#: Every spelling of our scheduler's path: the public one and the class's own module, ":" or ".".
_OUR_SCHEDULER_PATHS = frozenset(
    f"{module}{sep}Scheduler"
    for module in ("celery_mongolock.beat", "celery_mongolock.ops.beat")
    for sep in ":."
)
#: Celery's own beat stamps this header on everything it sends (Celery 5.5 and later).
CELERY_BEAT_HEADER = "celery_beat_task"
_warned_beat_in_pid: int | None = None


def _is_our_scheduler(scheduler: Any) -> bool:
    cls = scheduler if isinstance(scheduler, type) else type(scheduler)
    return any(f"{c.__module__}:{c.__qualname__}" in _OUR_SCHEDULER_PATHS for c in cls.__mro__)


def _names_our_scheduler(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip() in _OUR_SCHEDULER_PATHS
    return isinstance(value, type) and _is_our_scheduler(value)


def _scheduler_name(scheduler: Any) -> str:
    return f"{type(scheduler).__module__}:{type(scheduler).__qualname__}"


def _warn_if_sent_by_another_beat(task_name: str, request: Any) -> None:
    """A run that Celery's beat sent without our tick header: the beat does not run our scheduler, so
    several beats each send every tick and a tick is not refused a second run. Said once per process."""
    global _warned_beat_in_pid
    headers = getattr(request, "headers", None) or {}
    if not headers.get(CELERY_BEAT_HEADER) or _warned_beat_in_pid == os.getpid():
        return
    _warned_beat_in_pid = os.getpid()
    log_acquire.warning(
        "celery_mongolock: %s[%s] was sent by a celery beat that does not run %s (no tick header): "
        "with two such beats every tick is sent twice, and a second run of one tick is not refused. Set "
        "beat_scheduler = %r where the app is created (a setting made in a tasks module comes too late "
        "for `celery beat`), or start every beat with -S %s. (Said once per worker process.)",
        task_name,
        getattr(request, "id", None),
        OUR_SCHEDULER,
        OUR_SCHEDULER,
        OUR_SCHEDULER,
    )


def _check_beat_scheduler(sender: Any = None, **_: Any) -> None:
    """At ``celery beat``'s start (``beat_init``): warn when it does not run our scheduler although
    ``beat_scheduler`` names it now (set after the beat chose its scheduler: in a tasks module), and say
    at INFO which singleton tasks of its schedule get no once-per-tick guarantee from it otherwise."""
    scheduler = getattr(sender, "scheduler", None)
    app = getattr(sender, "app", None)
    if scheduler is None or app is None or _is_our_scheduler(scheduler):
        return
    running = _scheduler_name(scheduler)
    if _names_our_scheduler(app.conf.get("beat_scheduler")):
        log_acquire.warning(
            "celery_mongolock: this beat runs %s, not %s, although beat_scheduler names it: the setting was "
            "made after `celery beat` chose its scheduler (in a module imported later, such as a tasks "
            "module). Every beat started like this sends every tick itself (with two, each tick is sent "
            "twice). Set beat_scheduler where the app is created, or start the beat with -S %s.",
            running,
            OUR_SCHEDULER,
            OUR_SCHEDULER,
        )
        return
    schedule = getattr(scheduler, "schedule", None) or {}
    singletons = sorted(
        {
            entry.task
            for entry in schedule.values()
            if isinstance(app.tasks.get(getattr(entry, "task", None)), SingletonTask)
        }
    )
    if singletons:
        log_acquire.info(
            "celery_mongolock: this beat runs %s, not %s: the singleton task(s) %s of its schedule are sent "
            "by every beat started like this (run one, or use -S %s for several)",
            running,
            OUR_SCHEDULER,
            ", ".join(singletons),
            OUR_SCHEDULER,
        )


celery_signals.beat_init.connect(
    _check_beat_scheduler, weak=False, dispatch_uid="celery_mongolock.beat_check"
)


class SingletonRequest(ChildWatchedRequest):
    """The worker-side request of a singleton task; runs in the worker's parent (main) process.

    When the child running the task dies (hard time limit, OOM killer, SIGKILL, revoke with terminate),
    the child's leases are released from there (``_childwatch.ChildWatchedRequest``), before the message
    is acknowledged or requeued.
    """


# -- the decorator ---------------------------------------------------------------------------------------

F = TypeVar("F", bound=Callable[..., Any])


@overload
def singleton_task(__func: F) -> Any: ...


@overload
def singleton_task(
    *,
    key: KeySpec = ...,
    on_contention: PolicySpec | None = ...,
    lease_seconds: float | None = ...,
    heartbeat_seconds: float | None = ...,
    min_hold_seconds: float | None = ...,
    limit: int | Mapping[Any, int] | None = ...,
    keys: Sequence[KeySpec] | None = ...,
    app: Celery | None = ...,
    base: type[SingletonTask] = ...,
    **task_options: Any,
) -> Callable[[F], Any]: ...


def singleton_task(
    __func: Callable[..., Any] | None = None,
    *,
    key: KeySpec = None,
    on_contention: PolicySpec | None = None,
    lease_seconds: float | None = None,
    heartbeat_seconds: float | None = None,
    min_hold_seconds: float | None = None,
    limit: int | Mapping[Any, int] | None = None,
    keys: Sequence[KeySpec] | None = None,
    app: Celery | None = None,
    base: type[SingletonTask] = SingletonTask,
    **task_options: Any,
) -> Any:
    """Declare a Celery task that runs at most once at a time per key.

    ``key``: None (the task's name), an argument name or list of names, a template such as
    ``"email-group:{group_id}"`` (rendered as the lease key as is), a brace-free fixed key, or a callable
    taking the task's arguments. ``on_contention``: ``Retry()`` (default), ``Skip()``, ``Wait()``,
    ``Fail()`` or their names. ``min_hold_seconds`` keeps the key taken at least that long after a run
    starts, even if it ends sooner (ShedLock's lock-at-least-for). ``limit=N``: up to N runs of one key
    at once (per-tenant concurrency), each holding a slot (``current_lease().slot``) with its own fence;
    ``Retry``, ``Skip``, ``Wait`` and ``Fail`` work with it. Other keyword arguments go to Celery
    (``bind``, ``name``, ``acks_late``,
    ...). Like ``shared_task`` unless ``app=`` binds it to one app. Mistakes in the key spec or the
    policy raise ``ConfigurationError`` here, at declaration time.
    """
    if not (base is SingletonTask or (isinstance(base, type) and issubclass(base, SingletonTask))):
        raise ConfigurationError(
            f"singleton_task(base=...) must be SingletonTask or a subclass, got {base!r}"
        )
    if on_contention is not None:
        on_contention = parse_policy(on_contention, "on_contention")
    check_limit(limit, on_contention, min_hold_seconds)
    keys = check_keys(keys, key, on_contention, limit)
    if on_contention is not None and on_contention.queued:
        # A parked run's message is acknowledged once it is parked; before that, only acks_late keeps
        # a run whose worker dies from being lost.
        task_options.setdefault("acks_late", True)
    if min_hold_seconds is not None:
        from celery_mongolock.core.validation import validate_seconds

        validate_seconds("min_hold_seconds", min_hold_seconds, low=0.0, high=30 * 24 * 3600.0)
    if lease_seconds is not None or heartbeat_seconds is not None:
        from celery_mongolock.core.store import DEFAULT_LEASE_SECONDS, validate_lease_timing

        validate_lease_timing(
            lease_seconds if lease_seconds is not None else DEFAULT_LEASE_SECONDS, heartbeat_seconds
        )

    def decorate(func: Callable[..., Any]) -> Any:
        if not callable(func):
            raise ConfigurationError(f"singleton_task decorates a function, got {func!r}")
        name = task_options.get("name") or f"{func.__module__}.{func.__qualname__}"
        check_decorator_options(f"task {name!r}", task_options)  # limit=3, lease_second=60, ...
        for spec in keys or [key]:  # fail now, not at the first run
            KeyRenderer(spec, func, name, skip_first=bool(task_options.get("bind")))
        options = {
            "base": base,
            "mongolock_key": key,
            "mongolock_on_contention": on_contention,
            "mongolock_lease_seconds": lease_seconds,
            "mongolock_heartbeat_seconds": heartbeat_seconds,
            "mongolock_min_hold_seconds": min_hold_seconds,
            "mongolock_limit": limit,
            "mongolock_keys": keys,
            **task_options,
        }
        if app is not None:
            return app.task(**options)(func)
        return shared_task(**options)(func)

    if __func is not None:
        return decorate(__func)
    return decorate


# -- worker start-up: validate settings before taking work ---------------------------------------------


def _check_store(app: Celery, timeout: float = 2.0) -> None:
    """Log where the leases live; warn if that MongoDB does not answer within ``timeout`` seconds."""
    from pymongo import MongoClient
    from pymongo.errors import PyMongoError

    settings = get_settings(app)
    where = f"{redact(settings.url)} ({settings.database}.{settings.collection})"
    ms = int(min(timeout, settings.operation_timeout) * 1000)
    client: MongoClient[dict[str, Any]] | None = None
    try:
        client = MongoClient(
            settings.url, serverSelectionTimeoutMS=ms, connectTimeoutMS=ms, socketTimeoutMS=ms, connect=False
        )
        client.admin.command("ping")
    except PyMongoError as exc:
        log_acquire.warning(
            "celery_mongolock: the lease store at %s does not answer: %s. Singleton tasks will not run "
            "their bodies until it does (their runs are handled by their contention policy).",
            where,
            redact(f"{type(exc).__name__}: {str(exc).split(' (configured timeouts')[0][:300]}"),
        )
    else:
        log_acquire.info(
            "celery_mongolock: leases in %s, lease %gs, heartbeat %gs",
            where,
            settings.lease_seconds,
            settings.heartbeat_seconds or settings.lease_seconds / 3,
        )
    finally:
        if client is not None:
            client.close()


def _check_task_policies(app: Celery) -> list[str]:
    """Warn about ``mongolock_task_policies`` entries naming no task this worker has (a typo applies to
    nothing); return those names. Only a warning: a worker may not import every task of the project.
    The entries of tasks it has are checked against them (``ConfigurationError``): ``"keys"`` with the
    task's policy and limit, and their templates against its signature."""
    policies = get_settings(app).task_policies
    for name in sorted(set(policies) & set(app.tasks)):
        task = app.tasks[name]
        if isinstance(task, SingletonTask) and "keys" in policies[name]:
            task._renderers()  # its options (check_keys), then each template against the signature
    unknown = sorted(set(policies) - set(app.tasks))
    if unknown:
        log_acquire.warning(
            "celery_mongolock: mongolock_task_policies names task(s) this worker does not have: %s "
            "(misspelt? their options apply to no task here)",
            ", ".join(map(repr, unknown)),
        )
    return unknown


def _check_broker_settings(app: Celery) -> list[str]:
    """On RabbitMQ, warn (once each, at worker start) about every setting with which a singleton run can
    be lost although the broker keeps what it acknowledged; return the warnings. The settings with which
    runs survive the faults the lock-set checker injects: ``task_acks_late``, ``task_reject_on_worker_lost``,
    publisher confirms, persistent messages, durable queues (docs/discussions/brokers.md). Only a warning:
    the app may accept the loss. Redis loses a popped message whatever the settings."""
    try:
        driver = app.connection_for_write().transport.driver_type
    except Exception:  # an unknown transport: Celery itself says so
        return []
    if driver != "amqp":
        return []
    problems: list[str] = []
    singletons = sorted(name for name, task in app.tasks.items() if isinstance(task, SingletonTask))
    not_late = [name for name in singletons if not app.tasks[name].acks_late]
    if not_late:
        problems.append(
            f"task_acks_late is off for {', '.join(not_late[:5])}{' ...' if len(not_late) > 5 else ''}: "
            "a message is acknowledged before its run, so a run cut short by a killed worker is lost"
        )
    not_rejected = [
        name for name in singletons if app.tasks[name].acks_late and not app.tasks[name].reject_on_worker_lost
    ]
    if not_rejected:
        problems.append(
            f"task_reject_on_worker_lost is off for {', '.join(not_rejected[:5])}"
            f"{' ...' if len(not_rejected) > 5 else ''}: the message of a run whose worker child dies is "
            "acknowledged (the run ends FAILURE) instead of going back to the queue"
        )
    if not (app.conf.broker_transport_options or {}).get("confirm_publish"):
        problems.append(
            "broker_transport_options has no confirm_publish=True: a retry or handoff the library publishes "
            "just before RabbitMQ goes down can be lost without anyone knowing"
        )
    if str(app.conf.task_default_delivery_mode) in ("1", "transient"):
        problems.append(
            "task_default_delivery_mode is transient: RabbitMQ keeps messages in memory only, and a broker "
            "restart loses every queued run"
        )
    try:
        queues = list(app.amqp.queues.consume_from.values())
    except Exception:  # queues Celery cannot build: Celery itself says so
        queues = []
    fragile = sorted(q.name for q in queues if not q.durable or q.auto_delete or q.exclusive)
    if fragile:
        problems.append(
            f"queue(s) {', '.join(fragile)} not durable (or auto-delete, or exclusive): a broker restart "
            "or a worker leaving loses their runs"
        )
    for problem in problems:
        log_acquire.warning("celery_mongolock: on RabbitMQ, %s", problem)
    return problems


def _install_bootstep(app: Celery) -> None:
    if getattr(app, "_mongolock_bootstep", False):
        return
    app._mongolock_bootstep = True
    from celery import bootsteps

    class ValidateMongolockSettings(bootsteps.StartStopStep):  # type: ignore[misc]
        """Fail worker start-up with a message naming the bad ``mongolock_*`` setting."""

        label = "celery_mongolock"

        def __init__(self, worker: Any, **kwargs: Any) -> None:
            get_settings(worker.app)  # raises ConfigurationError naming the setting
            known_apps.add(worker.app)
            super().__init__(worker, **kwargs)

        def start(self, worker: Any) -> None:
            # Say where the leases live, and warn at once (not at the first task) if MongoDB does not
            # answer. Synchronous, on a short-lived client of its own: a thread here could hold a lock
            # while the pool forks a child, and the child would deadlock on it.
            _check_store(worker.app)
            _check_task_policies(worker.app)
            _check_broker_settings(worker.app)

    def start_sweeper(sender: Any = None, **_: Any) -> None:
        # After the pool has started its children: the sweeper's thread lives in the main process only.
        worker_app = getattr(sender, "app", None)
        if worker_app is app:
            _queue.start_sweeper(app)

    celery_signals.worker_ready.connect(start_sweeper, weak=False)

    app.steps["worker"].add(ValidateMongolockSettings)
