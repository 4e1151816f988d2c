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

The task class renders the keys and runs the body; it hands each run to admission over its key set
(``admit.take_keys``), which takes it as a narrow protocol (``runs.GuardedRun``). Copies of a run
are handled in ``duplicates``, the beat checks in ``beatcheck``, a worker's start-up in ``startup``.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, NoReturn, TypeVar, overload

from billiard.exceptions import WorkerLostError
from celery import Celery, Task, shared_task
from celery import signals as celery_signals

from celery_mongolock.admission.limits import limits_by_key
from celery_mongolock.admission.policies import (
    Policy,
    PolicySpec,
    Retry,
    parse_policy,
)
from celery_mongolock.admission.rate import RateLimit
from celery_mongolock.core.documents.sends import check_unique_send
from celery_mongolock.core.keys import KeyRenderer, KeySpec
from celery_mongolock.core.reentry import run_scope
from celery_mongolock.core.store import Lease
from celery_mongolock.exceptions import ConfigurationError, LockContended, MessageTooLarge, Superseded
from celery_mongolock.integration import (
    forksafe,  # noqa: F401  (its fork hook: pool children start clean)
    results,
    signals,
    startup,
)
from celery_mongolock.integration import handoff as _queue
from celery_mongolock.integration.beatcheck import (
    OUR_SCHEDULER,  # noqa: F401  (re-exported)
    check_beat_scheduler,
)
from celery_mongolock.integration.childwatch import ChildWatchedRequest
from celery_mongolock.integration.config import (
    TaskOptions,
    censor_url_in_celery_reports,
    get_settings,
)
from celery_mongolock.integration.duplicates import DUPLICATE_HEADER, end_second_look, second_look_of
from celery_mongolock.integration.endings import end_run, ending_of
from celery_mongolock.integration.guarded import current_lease, guarded
from celery_mongolock.integration.options import (
    check_declaration,
    check_decorated,
    check_task_class,
    install_start_up_error_hook,
)
from celery_mongolock.integration.rate_gate import rate_parks_of
from celery_mongolock.integration.runs import (
    CONTENTION_HEADER,
    retry_later,
    retry_patiently,
)
from celery_mongolock.integration.supersede import check_pool, was_terminated_superseded
from celery_mongolock.integration.unique_send import send_unique, wants_unique_send

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
QUEUED = results.QUEUED
#: How a run is published again (``handoff.REPUBLISH_RETRY_POLICY``).
REPUBLISH_RETRY_POLICY: dict[str, float] = _queue.REPUBLISH_RETRY_POLICY

known_apps = signals.known_apps  # the apps the shutdown hook releases leases for


censor_url_in_celery_reports()

# Worker and beat send import_modules before they create the tasks and read the settings: from then on a
# ConfigurationError that stops them is shown as one line, not as a traceback through Celery's start-up.
celery_signals.import_modules.connect(install_start_up_error_hook, weak=False)


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
    mongolock_rate: ClassVar[RateLimit | None] = None  # rate=RateLimit(n, period) or Throttle(period)
    mongolock_unique_send: ClassVar[bool | str | None] = None  # True, "best_effort": unique_send
    mongolock_unique_send_seconds: ClassVar[float | None] = None
    #: Expected errors: logged at INFO without a traceback.
    throws = (LockContended, Superseded, MessageTooLarge)
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
        startup.install_bootstep(app, _check_tasks)

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
        lease = current_lease()
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

        def celery_retry(**publish: Any) -> Any:
            return super(SingletonTask, self).retry(
                args, kwargs, exc, throw, eta, countdown, max_retries, **publish
            )

        return retry_patiently(self, celery_retry, options)

    def mongolock_options(self) -> TaskOptions:
        """The options in force for this task: the decorator's, overridden by the app's settings."""
        return self._options()

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
            rate=self.mongolock_rate,
            unique_send=self.mongolock_unique_send,
            unique_send_seconds=self.mongolock_unique_send_seconds,
        )

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        """Celery's ``apply_async``; with ``unique_send``, see ``integration.unique_send``."""
        if self.request_stack is None:
            _wait_until_bound(self)
        if not wants_unique_send(self.app, self.name, self.mongolock_unique_send):  # no option parsed
            return super().apply_async(args, kwargs, **options)
        in_force, given, named = self._options(), tuple(args or ()), dict(kwargs or {})
        call = (args, kwargs, self.mongolock_keys_for(*given, **named), self._renderer().bind(given, named))
        return send_unique(self, in_force, call, options, super().apply_async)

    # -- the guarded call ------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.request_stack is None:
            _wait_until_bound(self)
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
        ending = None if direct else ending_of(self.request)
        options = self._options()
        if ending is not None:  # a parked run ended without its body, through Celery's trace (``endings``)
            policy = options.on_contention
            return end_run(self, ending, fail_superseded=getattr(policy, "fail_superseded", False))
        look = None if direct else second_look_of(self.request)
        if look is not None:  # a run found over with no result stored, looked at once more (``duplicates``)
            return end_second_look(self, look, options)
        limits = self.mongolock_limits_for(*args, **kwargs)

        def body() -> Any:
            return self.run(*args, **kwargs)

        # The run is one owner of its leases (a singleton function it calls in-process is the same run).
        with run_scope(self.name):
            keys = self.mongolock_keys_for(*args, **kwargs)
            return guarded(self, keys, limits, options, body, direct=direct, one=not self._key_specs())

    def mongolock_retry_later(self, policy: Retry, exc: Exception) -> NoReturn:
        """Publish this run again after a backoff; the task's own ``retries`` budget is not used."""
        retry_later(self, policy, exc, rate_parks=rate_parks_of(self.request))


class SingletonRequest(ChildWatchedRequest):
    """The worker-side request of a singleton task; runs in the worker's parent (main) process.

    When the child running the task dies (hard time limit, OOM killer, SIGKILL, revoke with terminate),
    the child's leases are released from there (``_childwatch.ChildWatchedRequest``), before the message
    is acknowledged or requeued. A child that terminated itself because a newer send superseded its run
    (``Replace(cancel_running=True, grace=...)``, ``supersede``) wrote the run's result first: that run is
    neither failed nor requeued.
    """

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> None:
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)  # billiard wraps pool errors in ExceptionWithTraceback
        if isinstance(exc, WorkerLostError) and was_terminated_superseded(self.task.app, self.id):
            from celery.worker.state import task_ready

            self._release_dead_child("terminated: a newer send superseded its run")
            task_ready(self)
            if self.task.acks_late:
                self.acknowledge()
            return
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)


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
    rate: RateLimit | Mapping[str, Any] | None = ...,
    unique_send: bool | str = ...,
    unique_send_seconds: float | None = ...,
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
    rate: RateLimit | Mapping[str, Any] | None = None,
    unique_send: bool | str = False,
    unique_send_seconds: float | None = None,
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
    ``Retry``, ``Skip``, ``Wait`` and ``Fail`` work with it. ``rate=RateLimit(n, period)``: at most n
    starts per key in any ``period`` s, the rest parked till their turn (``Throttle(period)``: one).
    ``unique_send``: see ``integration.unique_send``.
    Other keyword arguments go to Celery (``bind``, ``name``, ``acks_late``, ...). Like ``shared_task``
    unless ``app=`` binds it to one app. Mistakes raise ``ConfigurationError`` here, at declaration.
    """
    if not (base is SingletonTask or (isinstance(base, type) and issubclass(base, SingletonTask))):
        raise ConfigurationError(
            f"singleton_task(base=...) must be SingletonTask or a subclass, got {base!r}"
        )
    on_contention, keys, rate = check_declaration(
        key=key,
        on_contention=on_contention,
        lease_seconds=lease_seconds,
        heartbeat_seconds=heartbeat_seconds,
        min_hold_seconds=min_hold_seconds,
        limit=limit,
        keys=keys,
        rate=rate,
        unique_send_seconds=unique_send_seconds,
        task_options=task_options,
    )

    def decorate(func: Callable[..., Any]) -> Any:
        check_decorated(func, task_options, key=key, keys=keys, policy=on_contention)
        options = {
            "base": base,
            "mongolock_key": key,
            "mongolock_on_contention": on_contention,
            "mongolock_lease_seconds": lease_seconds,
            "mongolock_heartbeat_seconds": heartbeat_seconds,
            "mongolock_min_hold_seconds": min_hold_seconds,
            "mongolock_limit": limit,
            "mongolock_keys": keys,
            "mongolock_rate": rate,
            "mongolock_unique_send": check_unique_send(unique_send) or None,
            "mongolock_unique_send_seconds": unique_send_seconds,
            **task_options,
        }
        if app is not None:
            return app.task(**options)(func)
        return shared_task(**options)(func)

    if __func is not None:
        return decorate(__func)
    return decorate


# -- worker start-up and beat start-up: the checks of the singleton tasks ------------------------------


#: How long a send or a call waits for another thread to finish binding its task to its app.
BIND_WAIT_S = 30.0


def _wait_until_bound(task: Task) -> None:
    """Wait until the task's class is bound to its app. Celery registers a task made by a decorator
    before it binds it, without a lock: in a fresh process whose first sends come from several threads at
    once (a threaded web server's first requests), the other threads are handed the registered task while
    the first one binds it, and an unbound task reads its app's settings from the default app (a user's
    trial: 3 of 5 such processes failed a send with ``AttributeError``). Binding takes microseconds."""
    cls = type(task)
    if not getattr(cls, "__bound__", False):  # not bound yet: bind it (as Celery does a task at first use;
        cls.bind(task.app)  # binding twice, with a thread that was about to, changes nothing)
    deadline = time.monotonic() + BIND_WAIT_S
    while cls.request_stack is None:  # (``bind`` sets ``__bound__`` first and the request stack later)
        if time.monotonic() > deadline:
            raise ConfigurationError(
                f"task {task.name!r} was not bound to its app within {BIND_WAIT_S:g} s (Celery binds a "
                "task when its app is finalized: call app.finalize() before sending from threads)"
            )
        time.sleep(0.001)


def _is_singleton(task: Any) -> bool:
    return isinstance(task, SingletonTask)


def _check_keys(task: SingletonTask) -> None:
    task._renderers()  # its options (check_keys), then each template against the signature


def _check_task_policies(app: Celery) -> list[str]:
    """``startup.check_task_policies`` for this app's singleton tasks."""
    return startup.check_task_policies(app, _is_singleton, _check_keys)


def _check_broker_settings(app: Celery) -> list[str]:
    """``startup.check_broker_settings`` for this app's singleton tasks."""
    return startup.check_broker_settings(app, _is_singleton)


def _check_tasks(app: Celery, pool_cls: Any = None) -> None:
    """What the ``celery_mongolock`` bootstep checks of a starting worker's tasks, after the store."""
    _check_task_policies(app)
    _check_broker_settings(app)
    if pool_cls is not None:
        singletons = [(name, t) for name, t in app.tasks.items() if _is_singleton(t)]
        check_pool(pool_cls, [(name, t._options().on_contention) for name, t in singletons])


def _check_beat_scheduler(sender: Any = None, **_: Any) -> None:
    """``beatcheck.check_beat_scheduler`` at ``celery beat``'s start (``beat_init``)."""
    check_beat_scheduler(sender, _is_singleton)


celery_signals.beat_init.connect(
    _check_beat_scheduler, weak=False, dispatch_uid="celery_mongolock.beat_check"
)
