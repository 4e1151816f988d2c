"""``Replace(cancel_running=True, grace=...)``: a newer send supersedes the run that holds the key.

The newer run parks as any ``Replace`` run does, and its admit marks the running holder superseded in the
same command (``core.documents.queue.cancel_mark``). The holder's process learns of it from its lease
watch (one change stream per process, ~0.1 s) or, without change streams, at its heartbeat's tick, and
marks the lease superseded (``Lease.mark_superseded``). From then on:

1. ``current_lease().superseded`` is True and ``current_lease().raise_if_superseded()`` raises
   ``Superseded``; raised out of the body, it ends the run ``SUCCESS`` with the superseded result
   (``ended_superseded``: not a failure, not retried), and the release hands the key to the newest run;
2. ``fenced_update_one`` with the lease refuses the holder's writes (``FencedOut`` with
   ``superseded_by``); raised out of the body, it ends the run as ``Superseded`` does;
3. if the body still runs ``grace`` seconds later, the pool child terminates itself (``_Terminator``):
   it writes the run's superseded result and its history record first, then kills itself with
   ``SIGKILL``. The worker's parent releases the dead child's lease at once (``childwatch``), which hands
   the key to the newest run; ``SingletonRequest`` sees the run's result and neither fails it nor
   requeues its message.

Only a prefork pool child can be terminated without taking the worker down with it: a worker with
another pool (threads, solo, eventlet, gevent) and a task with a finite ``grace`` is refused at start
(``check_pool``); ``grace=None`` is the cooperative-only mode, accepted everywhere.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from celery import signals as celery_signals

from celery_mongolock.admission.policies import Policy, Replace
from celery_mongolock.core.fencing import FencedOut
from celery_mongolock.core.lease_set import LeaseSet
from celery_mongolock.exceptions import ConfigurationError, Superseded
from celery_mongolock.integration import results, signals
from celery_mongolock.integration.endings import publish_own_ending
from celery_mongolock.integration.superseded import SupersededResult

if TYPE_CHECKING:
    from celery_mongolock.core.lease import Lease
    from celery_mongolock.core.store import LeaseStore
    from celery_mongolock.integration.runs import GuardedRun

__all__ = ["check_pool", "ended_superseded", "in_pool_child", "run_body", "was_terminated_superseded"]

log = logging.getLogger("celery_mongolock.acquire")

_pool_child_pid: int | None = None


def _note_pool_child(**_: Any) -> None:
    global _pool_child_pid
    _pool_child_pid = os.getpid()


celery_signals.worker_process_init.connect(
    _note_pool_child, weak=False, dispatch_uid="celery_mongolock.child"
)


def in_pool_child() -> bool:
    """True in a prefork pool child (where a terminated body takes only its own process down)."""
    return _pool_child_pid is not None and _pool_child_pid == os.getpid()


def _run_info(task: GuardedRun) -> dict[str, Any]:
    request = task.request
    delivery = str(int(getattr(request, "retries", 0) or 0))
    return {"t": request.id, "n": task.name, "r": delivery, "id": f"{request.id}/{delivery}"}


def _held(lease: Lease) -> list[Lease]:
    """The leases of a run: itself, or each of a ``LeaseSet``'s (``keys=``)."""
    return list(lease.leases.values()) if isinstance(lease, LeaseSet) else [lease]


def _result(lease: Lease, by: str) -> SupersededResult:
    if isinstance(lease, LeaseSet):
        return results.superseded_result(lease.keys[0], by, lease.keys)
    return results.superseded_result(lease.key, by)


def _record(store: LeaseStore, lease: Lease, info: Mapping[str, Any], by: str) -> None:
    """The run's ``superseded`` record in the history of each of its keys."""
    for one in _held(lease):  # (a set's gate included: its history tells of the set's runs)
        store.record_run_ending(one.key, "superseded", info, fence=one.fence, by=by, running=True)


def ended_superseded(task: GuardedRun, store: LeaseStore, key: str, lease: Lease) -> SupersededResult:
    """The run's body stopped because a newer send superseded it: its result (``SUCCESS``, the superseded
    result naming the newer run), its history record (on each of its keys) and the ``run_superseded``
    signal."""
    by = str(lease.superseded_by)
    request = task.request
    log.info(
        "%s[%s]: %r: a newer send (%s) superseded this running holder; it stopped and ends SUCCESS with a "
        "'superseded' result",
        task.name,
        request.id,
        key,
        by,
    )
    signals.run_superseded.send(sender=task, key=key, task_id=request.id, by=by)
    _record(store, lease, _run_info(task), by)
    return _result(lease, by)


class _Terminator:
    """After ``grace`` seconds from the notice, a body still running is ended with its process."""

    def __init__(
        self,
        task: GuardedRun,
        store: LeaseStore,
        key: str,
        lease: Lease,
        grace: float,
        *,
        fails: bool = False,
    ) -> None:
        self.task, self.store, self.key, self.lease, self.grace = task, store, key, lease, grace
        self.fails = fails  # Replace(fail_superseded=True): its result is FAILURE, Superseded
        self.request = task.request  # (the grace thread has no request of its own)
        self.request_id = task.request.id
        self.info = _run_info(task)
        self.done = threading.Event()  # the body returned or raised: nothing to terminate
        self._ending = threading.Lock()
        self._ended = False

    def claim_ending(self) -> bool:
        """Whoever ends the superseded run first, this terminator or the body raising ``Superseded``,
        writes its ending (result, history record, signal); False for the second: written once."""
        with self._ending:
            if self._ended:
                return False
            self._ended = True
            return True

    def notice(self, lease: Lease, by: str) -> None:
        """The holder was superseded: in a thread of its own (the other callbacks of the notice run on),
        wait ``grace`` (woken early when the body ends), then terminate."""

        def wait_then_terminate() -> None:
            if not self.done.wait(self.grace):
                self.terminate(by)

        threading.Thread(target=wait_then_terminate, name="celery_mongolock-grace", daemon=True).start()

    def terminate(self, by: str) -> None:
        task, key = self.task, self.key
        if self.lease.released or all(one.lost for one in _held(self.lease)):
            return  # (a set with a key still held is terminated: that key must go to the newest run)
        if not self.claim_ending():
            return  # the body raised ``Superseded`` meanwhile: it ends the run itself
        log.warning(
            "%s[%s]: %r: still running %gs after a newer send (%s) superseded it; terminating its pool "
            "child (pid %s): the key goes to the newest run",
            task.name,
            self.request_id,
            key,
            self.grace,
            by,
            os.getpid(),
        )
        try:
            if self.fails:
                task.app.backend.mark_as_failure(self.request_id, Superseded(key, self.lease.fence, by))
            else:
                task.app.backend.store_result(self.request_id, _result(self.lease, by), "SUCCESS")
            signals.run_superseded.send(sender=task, key=key, task_id=self.request_id, by=by)
            _record(self.store, self.lease, self.info, by)
            self.store.flush_history(timeout=2.0)
            # Its callbacks, chain or chord: called by a worker from its message (``endings``).
            keys = self.lease.keys if isinstance(self.lease, LeaseSet) else None
            first = keys[0] if keys else key
            publish_own_ending(task, self.request, results.superseded_ending(first, by, keys))
        except Exception as exc:  # the termination goes ahead: the key must go to the newest run
            log.warning(
                "%s[%s]: writing the superseded run's result failed: %s", task.name, self.request_id, exc
            )
        if self.done.is_set():  # the body ended meanwhile: its own release hands the key over
            return
        os.kill(os.getpid(), signal.SIGKILL)


def _is_this_runs_supersession(exc: Superseded | FencedOut, lease: Lease) -> bool:
    """``exc``, raised out of the body, says a newer send superseded this very run: ``Superseded`` of one
    of its keys, or ``FencedOut`` of a write made with its lease (or one of a set's), refused for the
    supersession (``superseded_by``), not for a newer holder's fence."""
    if not lease.superseded:
        return False
    if isinstance(exc, Superseded):
        return exc.key in {one.key for one in _held(lease)}
    if exc.superseded_by is None:
        return False
    return any(exc.key == one.key and exc.fence == one.fence for one in [lease, *_held(lease)])


def run_body(
    task: GuardedRun, store: LeaseStore, lease: Lease, policy: Policy, body: Callable[[], Any]
) -> Any:
    """Run ``body`` holding ``lease``; a ``Replace(cancel_running=True)`` run is told when a newer send
    supersedes it, ends superseded when its body raises ``Superseded`` (or a ``FencedOut`` the supersession
    refused), and is terminated after ``grace``
    (in a prefork pool child). ``lease`` may be a ``LeaseSet`` (``keys=``): a newer send of the set tells
    the run on whichever key it reaches first, and every lease of the set is superseded from then on."""
    if not (isinstance(policy, Replace) and policy.cancel_running):
        return body()
    # The key its ending names (the signal, ``Superseded``): a set's first, as its superseded result does.
    key = lease.keys[0] if isinstance(lease, LeaseSet) else lease.key
    if isinstance(lease, LeaseSet):
        lease.supersede_together()
    terminator: _Terminator | None = None
    if policy.grace is not None and in_pool_child():
        terminator = _Terminator(task, store, key, lease, policy.grace, fails=policy.fail_superseded)
        lease.on_superseded(terminator.notice)
    try:
        return body()
    except (Superseded, FencedOut) as exc:
        if not _is_this_runs_supersession(exc, lease):
            raise  # another lease's (a singleton run called in-process), or a plain fenced-out write
        lease.end_superseded()  # (its release says so: a copy finding it over answers superseded)
        if terminator is None or terminator.claim_ending():
            result = ended_superseded(task, store, key, lease)
        else:  # the grace ran out as it raised: the terminator writes the ending (once)
            result = _result(lease, str(lease.superseded_by))
        if policy.fail_superseded:
            # Replace(fail_superseded=True): it ends FAILURE with Superseded (its link_error callbacks are
            # called), also when the body stopped at a fenced write that the supersession refused.
            if isinstance(exc, Superseded):
                raise
            raise Superseded(key, lease.fence, str(lease.superseded_by)) from exc
        return result
    finally:
        if terminator is not None:
            terminator.done.set()


def was_terminated_superseded(app: Any, task_id: str) -> bool:
    """In the worker's parent, for a pool child that died: did it end its run as superseded (its result
    written before it terminated itself, ``_Terminator``)?"""
    try:
        meta = app.backend.get_task_meta(task_id)
    except Exception:  # the backend does not answer: Celery's own failure handling goes on
        return False
    return is_superseded_meta(meta)


def is_superseded_meta(meta: Mapping[str, Any]) -> bool:
    """A task's stored state (``backend.get_task_meta``) says it ended superseded: ``SUCCESS`` with the
    superseded result, or ``FAILURE`` with ``Superseded`` (``Replace(fail_superseded=True)``)."""
    result = meta.get("result")
    if meta.get("status") == "SUCCESS":
        return isinstance(result, dict) and result.get("mongolock") == "superseded"
    return meta.get("status") == "FAILURE" and (
        isinstance(result, Superseded)
        or (isinstance(result, Mapping) and result.get("exc_type") == Superseded.__name__)
    )


def check_pool(pool_cls: Any, tasks: Iterable[tuple[str, Policy]]) -> None:
    """Refuse to start a worker whose pool cannot terminate a body (threads, solo, eventlet, gevent) with a
    task of ``Replace(cancel_running=True)`` and a finite ``grace``: its grace would never be enforced.
    ``grace=None`` (cooperative only) is accepted on every pool."""
    try:
        from celery.concurrency.prefork import TaskPool
    except ImportError:  # pragma: no cover - Celery always ships it
        return
    if isinstance(pool_cls, type) and issubclass(pool_cls, TaskPool):
        return
    pool = getattr(pool_cls, "__module__", str(pool_cls)).rsplit(".", 1)[-1]
    terminating = sorted(name for name, policy in tasks if isinstance(policy, Replace) and policy.terminates)
    if terminating:
        raise ConfigurationError(
            f"task(s) {', '.join(map(repr, terminating))} use Replace(cancel_running=True, grace=...), which "
            f"terminates a superseded body's pool child after its grace; the {pool!r} pool runs bodies in "
            "the worker's own process, where that is impossible. Run them on a prefork worker (-P prefork), "
            "or use grace=None (cooperative only: the body stops when it calls raise_if_superseded())"
        )
