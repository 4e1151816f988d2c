"""One run of a singleton task, whatever its keys: its state, its republishing, a store that does not
answer, and Celery's "ignored" line in our words.

What admission (``plain_run``, ``queued_run``) and the guarded body share. They take the
task as a narrow protocol (``GuardedRun``: the public attributes of a Celery task), so that nothing here
imports the task class.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from celery import states as celery_states
from celery.exceptions import Ignore, Reject
from celery.exceptions import Retry as RetryTask
from kombu.exceptions import OperationalError

from celery_mongolock.admission.contention import ContendedRun, SingletonRun
from celery_mongolock.core.urls import redact
from celery_mongolock.exceptions import StoreUnavailable
from celery_mongolock.integration import handoff as _queue
from celery_mongolock.integration import results
from celery_mongolock.integration.config import get_store
from celery_mongolock.integration.endings import ending_publisher

if TYPE_CHECKING:
    from celery_mongolock.admission.policies import Policy
    from celery_mongolock.core.store import Lease, LeaseStore

__all__ = [
    "CONTENDED_SINCE_HEADER",
    "CONTENTION_HEADER",
    "GuardedRun",
    "contended_since",
    "contention_retry_meta",
    "delivery",
    "give_back_quietly",
    "handoff_of_an_attempt_that_ran",
    "has_final_state",
    "ignored_as",
    "publish_debounced_copy",
    "republish",
    "retry_patiently",
    "set_state",
    "settled_by_another_line",
    "unavailable",
]

log_acquire = logging.getLogger("celery_mongolock.acquire")
log_release = logging.getLogger("celery_mongolock.release")

#: Message header counting contention retries, kept apart from the task's own ``retries``.
CONTENTION_HEADER = "mongolock_contention_retries"
#: Epoch ms (the sender's clock) of a run's first contention, carried by its contention retries: the lease
#: history counts the run's wait for its key from it (``waited_ms``).
CONTENDED_SINCE_HEADER = "mongolock_contended_since"


class GuardedRun(SingletonRun, Protocol):
    """What admission needs of its task (``task.SingletonTask``): a Celery task's public attributes, and a
    way to be published again later (``SingletonRun``). A protocol, so that admission does not import the
    task class."""

    @property
    def app(self) -> Any: ...

    @property
    def backend(self) -> Any: ...

    @property
    def ignore_result(self) -> bool: ...

    @property
    def serializer(self) -> Any: ...

    def signature_from_request(
        self, request: Any = None, args: Any = None, kwargs: Any = None, **extra: Any
    ) -> Any: ...


def has_final_state(task: GuardedRun, carried_on: Callable[[], bool] | None = None) -> bool:
    """Whether this task id has a final state in the result backend, or a retry of it is on its way
    (``RETRY``: the body called ``self.retry()``, and that newer run will store the result): then a
    copy of an earlier run has nothing to do. True when there is no backend to ask (nothing would
    wait for a result).

    ``carried_on``, for a copy of a run whose body ran: whether a later attempt of the task is known.
    A body's ``RETRY`` says only that *some* attempt retried: for a copy of attempt 0 it was this very
    attempt, but a copy of attempt ``n > 0`` may be of the run that attempt's retry started, whose body
    ended and whose worker died before it stored the result (the lock-set checker's seed 86: the copy was
    dropped and the task stayed ``RETRY``). Then the ``RETRY`` counts only when ``carried_on()``, or, when
    the backend stored the attempt that retried (``result_extended``), when that attempt is this one or a
    later one."""
    meta = _stored_meta(task)
    if meta is None:
        return True  # nothing to ask, or cannot tell: drop the copy, as before
    return _final(task, meta, carried_on)


def _stored_meta(task: GuardedRun) -> dict[str, Any] | None:
    """The task's stored state in the result backend; None when it stores none (no backend,
    ``ignore_result``) or the backend does not answer."""
    if task.ignore_result or task.request.ignore_result or not results.has_backend(task.app):
        return None
    try:
        meta: dict[str, Any] = task.backend.get_task_meta(task.request.id)
    except Exception:
        return None
    return meta


def _final(task: GuardedRun, meta: dict[str, Any], carried_on: Callable[[], bool] | None) -> bool:
    """A stored state that is final, or a body's own retry (``RETRY`` not from a contention retry; see
    ``has_final_state`` for ``carried_on``)."""
    status = meta.get("status")
    if status in celery_states.READY_STATES:
        return True
    if status != celery_states.RETRY or contention_retry_meta(meta.get("result")):
        return False
    if carried_on is None:
        return True
    retries = int(getattr(task.request, "retries", 0) or 0)
    written_by = meta.get("retries")  # the attempt that retried, stored only with ``result_extended``
    if isinstance(written_by, int) and not isinstance(written_by, bool):
        return written_by >= retries
    return not retries or carried_on()


def settled_by_another_line(task: GuardedRun, copy: bool, carried_on: Callable[[], bool]) -> str | None:
    """Just before a body starts, with its keys taken: why the task's stored state says another line of
    it has settled the task already, or None. Asked only of a ``copy`` (a redelivered or parked message)
    and of a later attempt (``retries`` > 0, started by a body's ``self.retry()``).

    One attempt can go on in two lines: its body loses its lease (a fault), the broker delivers its
    message again, the copy finds the key free and runs the body, and the first body then calls
    ``self.retry()``, publishing attempt 1 (the lock-set checker on RabbitMQ: the copy ran, then attempt 1
    ran the body again, 13 s later). The keys cannot tell the lines apart (same task id and attempt), but
    the result backend can: a later attempt is a stale line when the task has a final state; a copy is one
    when the task has a final state or its body's own ``RETRY`` that a later attempt carries on
    (``has_final_state``, ``carried_on``). None without a result backend, for a direct call, or when the
    backend does not answer: the key's own duplicate guard has judged the run then."""
    request = task.request
    retries = int(getattr(request, "retries", 0) or 0)
    if not (copy or retries) or request.called_directly or request.is_eager:
        return None
    meta = _stored_meta(task)
    if meta is None:
        return None
    status = meta.get("status")
    if status in celery_states.READY_STATES:
        return f"the task has ended already ({status}) in another delivery of it"
    if copy and status == celery_states.RETRY and _final(task, meta, carried_on):
        return "its body retried, and a later attempt carries the task on"
    return None


def handoff_of_an_attempt_that_ran(task: GuardedRun) -> bool:
    """Whether this message is a handoff message of its own attempt (task id and own retries) while the
    task's stored state says that attempt's body ran already: a result, or the body's own ``RETRY``.

    Such a copy must not write a state: a contention retry's ``RETRY`` (MongoDB did not answer) would
    hide the body's, and a later copy of the handoff, its claim stale, would then read "no result" and
    run the attempt's body again (the lock-set checker's run-twice on a fault-gate key). An attempt
    writes ``QUEUED`` before it parks, so a final or body-``RETRY`` state seen by its handoff message
    was written after its park, by its own body or a later attempt's. False when it cannot tell."""
    request = task.request
    headers = getattr(request, "headers", None) or {}
    handoff = headers.get(_queue.HANDOFF_HEADER) or getattr(request, _queue.HANDOFF_HEADER, None)
    run = f"{request.id}/{int(getattr(request, 'retries', 0) or 0)}"
    if not isinstance(handoff, Mapping) or handoff.get("id", run) != run:
        return False
    meta = _stored_meta(task)
    if meta is None:
        return False  # cannot tell: retry as before
    # (An attempt writes QUEUED before it parks: a body's RETRY seen now is this attempt's or a later one's.)
    return _final(task, meta, None)


def set_state(task: GuardedRun, state: str, meta: dict[str, Any], *, unless_ready: bool = False) -> None:
    """Write this run's state (only for humans and ``AsyncResult.state``: failures are logged)."""
    if task.ignore_result or task.request.ignore_result or not results.has_backend(task.app):
        return
    task_id = task.request.id
    try:
        if unless_ready and task.backend.get_task_meta(task_id).get("status") in celery_states.READY_STATES:
            return  # an earlier run of this task id ended: leave its result alone
        task.backend.store_result(task_id, meta, state)
    except Exception as exc:
        log_acquire.warning("%s[%s]: could not set state %s: %s", task.name, task_id, state, exc)


def republish(task: GuardedRun, signature: Any, what: str) -> None:
    """Publish ``signature`` patiently (``REPUBLISH_RETRY_POLICY``); log an error if even that fails."""
    try:
        _queue.publish_patiently(task.app, signature)
    except Exception as exc:
        log_acquire.error(
            "%s[%s]: could not publish the %s; the broker did not take it for about a minute: %s",
            task.name,
            task.request.id,
            what,
            redact(str(exc)),
        )
        raise


def publish_debounced_copy(
    task: GuardedRun, stamp: int, seconds: float, burst: int | None = None, *, gated: bool = False
) -> None:
    """``Replace(debounce=seconds)``: publish the parked run's delayed copy (``DEBOUNCE_HEADER``, its send
    stamp kept), which comes back after ``seconds`` and takes the key (or its keys) if no newer send came.
    ``burst``: the run's burst (``max_wait`` with ``keys=``), which the copy keeps in its entry: once it took
    its set's gate its reply no longer shows it, and its reservation there must carry it. ``gated``: a run
    of a set parked on its set's gate (``gt``: a copy without it was published by an earlier version, whose
    runs of sets had no gate)."""
    request = task.request
    headers = dict(request.headers or {})
    copy: dict[str, Any] = {} if burst is None else {"bu": burst}
    if gated:
        copy["gt"] = 1
    headers[_queue.DEBOUNCE_HEADER] = copy or 1
    headers[_queue.SENT_HEADER] = stamp
    republish(task, task.signature_from_request(request, countdown=seconds, headers=headers), "debounce")


def unavailable(task: GuardedRun, key: str, exc: StoreUnavailable, policy: Policy, direct: bool) -> NoReturn:
    """MongoDB could not be reached: never run the body. Retry later (or fail, under Fail)."""
    request = task.request
    log_acquire.error("%s[%s]: cannot take %r, body not run: %s", task.name, request.id, key, exc)
    policy.on_unavailable(ContendedRun(task, get_store(task.app), key, direct=direct), exc)


def contention_retry_meta(result: Any) -> bool:
    """Whether a ``RETRY`` state's stored reason is one of this library's contention retries (the key was
    held, or MongoDB did not answer), not the body's own ``self.retry()``."""
    name = result.get("exc_type") if isinstance(result, dict) else type(result).__name__
    return name in ("LockContended", "StoreUnavailable")


def give_back_quietly(store: LeaseStore, leases: list[Lease], *, untick: int | None = None) -> None:
    """Give back keys taken by an attempt that does not run the body (in reverse order), without
    marking the run as over; one that cannot be given back now expires (its run never used it).
    ``untick``: the run's beat tick, which it did not run (``LeaseStore.give_back``)."""
    for lease in reversed(leases):
        try:
            store.give_back(lease, untick=untick)
        except StoreUnavailable as exc:
            log_release.warning("%s (it expires on its own)", exc)


def end_superseded(task: GuardedRun, store: LeaseStore, key: str, runs: list[Any], fence: int | None) -> None:
    """Write the results of the runs a run's admit on ``key`` superseded (``results.write_superseded``):
    only those that have written their state QUEUED (a run that has not yet would overwrite its result
    with it: it writes QUEUED before it parks, so this is rare); the run itself or the sweeper writes the
    others."""
    results.write_superseded(
        task.app,
        store,
        key,
        runs,
        ready=results.marked_queued(task.app),
        fence=fence,
        publish=ending_publisher(task.app),
    )


def delivery(request: Any) -> str:
    """Which run of a task id a message is: its own retries and its contention retries. A copy of the
    same message (redelivered, parked) has the same; ``Task.retry()`` and a contention retry do not."""
    headers = getattr(request, "headers", None) or {}
    return f"{int(getattr(request, 'retries', 0) or 0)}.{int(headers.get(CONTENTION_HEADER) or 0)}"


def contended_since(request: Any) -> int | None:
    """Epoch ms of the run's first contention, from the header its contention retries carry."""
    value = (getattr(request, "headers", None) or {}).get(CONTENDED_SINCE_HEADER)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


# -- Celery's "ignored" line, in our words ----------------------------------------------------------------
# A run that is parked, or a copy that is dropped, ends its delivery with ``Ignore``: Celery then logs
# "Task proj.upload[id] ignored", which reads as if the run were lost. For our runs the line says what
# became of it instead ("Task proj.upload[id] parked at position 1 on 'email-group:42', not dropped: ...").

_IGNORED_AS: collections.OrderedDict[str, str] = collections.OrderedDict()
_IGNORED_AS_MAX = 1000  # entries of runs whose line was never logged (INFO disabled) are forgotten


def ignored_as(task_id: Any, words: str) -> None:
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


def retry_patiently(task: GuardedRun, celery_retry: Callable[..., Any], options: dict[str, Any]) -> Any:
    """``SingletonTask.retry``: Celery's retry (``celery_retry``, given the publish ``options``) published
    with ``REPUBLISH_RETRY_POLICY`` on a patient producer; a retry the broker did not take even so is
    logged and raised (the run ends in FAILURE with it, never dropped in silence)."""
    options.setdefault("retry", True)
    options.setdefault("retry_policy", _queue.REPUBLISH_RETRY_POLICY)
    try:
        if "producer" in options or task.request.called_directly or task.request.is_eager:
            return celery_retry(**options)
        with _queue.patient_producer(task.app) as producer:
            options["producer"] = producer
            return celery_retry(**options)
    except OperationalError as unreachable:  # the connection could not be opened for about a minute
        log_acquire.error(
            "%s[%s]: could not publish the retry; the broker did not take it for about a minute: %s",
            task.name,
            task.request.id,
            redact(str(unreachable)),
        )
        raise
    except Reject as rejected:
        reason = rejected.reason
        if rejected.requeue or not isinstance(reason, Exception):
            raise
        log_acquire.error(
            "%s[%s]: could not publish the retry; the broker did not take it for about a minute: %s",
            task.name,
            task.request.id,
            redact(str(reason)),
        )
        raise reason from None


def retry_later(task: GuardedRun, policy: Any, exc: Exception, *, rate_parks: int = 0) -> NoReturn:
    """A contention retry (``SingletonTask.mongolock_retry_later``): publish the run again after
    ``policy``'s backoff (a ``Retry``), its send stamp kept; the task's own ``retries`` budget is not used.
    ``rate_parks``: how many of its earlier retries were waits for a rate (not contention)."""
    request = task.request
    name = getattr(task, "name", "?")
    if handoff_of_an_attempt_that_ran(task):
        # A stale handoff copy of an attempt whose body ran: its RETRY would hide that (see there).
        log_acquire.info("%s[%s]: %s; a stale handoff copy, dropped", name, request.id, exc)
        ignored_as(request.id, "is a stale handoff copy of an attempt that ran: this copy is dropped")
        raise Ignore()
    headers = dict(request.headers or {})
    attempt = int(headers.get(CONTENTION_HEADER) or 0)
    if policy.exhausted(attempt - rate_parks):  # (waits for a rate are not contention)
        log_acquire.info("%s[%s]: giving up after %d contention retries", name, request.id, attempt)
        raise exc
    countdown = policy.delay(attempt)
    headers[CONTENTION_HEADER] = attempt + 1
    headers.setdefault(CONTENDED_SINCE_HEADER, int(time.time() * 1000))
    signature = task.signature_from_request(request, countdown=countdown, headers=headers)
    republish(task, signature, "contention retry")
    # One INFO line per contention: Celery's own "Task ...[id] retry: <message>" carries the key, the
    # holder and the policy; ours is for debugging only.
    message = f"{exc}; policy {policy.name}: contention retry {attempt + 1} in {countdown:.2f}s"
    in_force = _policy_in_force(task)
    if in_force is not None and in_force.queued and isinstance(exc, StoreUnavailable):
        # A Queue/Replace run that could not park: it comes back as itself, in its place (its send stamp).
        message = (
            f"{exc}; policy {in_force.name}: not parked (MongoDB could not store it); tried again as a "
            f"{in_force.name} run in {countdown:.2f}s (attempt {attempt + 1}), its place in send order kept"
        )
    log_acquire.debug("%s[%s]: %s", name, request.id, message)
    raise RetryTask(message=message, exc=exc, when=countdown, sig=signature)


def _policy_in_force(task: GuardedRun) -> Any:
    options = getattr(task, "mongolock_options", None)
    try:
        return options().on_contention if callable(options) else None
    except Exception:  # (the message only)
        return None
