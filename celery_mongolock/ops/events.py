"""Lease events as Celery events, beside the task's own, when the worker sends task events (``-E``).

``celery events``, Flower and any ``app.events.Receiver`` see them. Each carries the run's task id
(``uuid``, so monitors file it under the task), the worker's ``hostname`` and the lease ``key``:

=============================  =====================================================================
event type                     fields
=============================  =====================================================================
``task-mongolock-acquired``    ``fence``, ``lease_seconds``: the body is about to run
``task-mongolock-contended``   ``policy`` (what happens to the run: ``retry``, ``skip``, ``wait``,
                               ``fail``, ``queue``, ``replace``, ``rate``, ``throttle``, ``duplicate``,
                               ``tick-already-ran``), ``holder_task_id``, ``holder_worker``
``task-mongolock-skipped``     ``reason``: the run ended without running its body (Skip)
``task-mongolock-parked``      ``position``, ``stamp``: the run was parked (Queue, Replace), its
                               message acknowledged, until the key is handed to it
``task-mongolock-handed``      ``attempt``: the key was handed to this parked run and its message
                               published again (sent by the worker whose command handed it)
``task-mongolock-superseded``  ``by``: a newer send replaced this run (Replace)
``task-mongolock-lost``        ``fence``, ``reason``: the running body no longer holds its key
=============================  =====================================================================

They are sent from the process that runs the task (a pool child under prefork), only by workers started
with task events on (``celery worker -E``, or ``worker_send_task_events = True``): Flower's remote
``enable_events`` reaches the worker's main process only, after the pool children were forked.
A monitoring broker that is down never fails a task: the event is dropped with a warning.

The handlers are connected to the library's own signals (:mod:`celery_mongolock.signals`) when this
module is imported, which ``import celery_mongolock`` does.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery.signals import task_postrun, worker_init

from celery_mongolock.integration import signals

__all__ = ["EVENT_TYPES", "events_enabled"]

log = logging.getLogger("celery_mongolock.events")

ACQUIRED = "task-mongolock-acquired"
CONTENDED = "task-mongolock-contended"
SKIPPED = "task-mongolock-skipped"
LOST = "task-mongolock-lost"
PARKED = "task-mongolock-parked"
HANDED = "task-mongolock-handed"
SUPERSEDED = "task-mongolock-superseded"
EVENT_TYPES = (ACQUIRED, CONTENDED, SKIPPED, LOST, PARKED, HANDED, SUPERSEDED)

# Publishing an event must not hold a run up for long when the broker is away.
_RETRY_POLICY = {"max_retries": 2, "interval_start": 0.1, "interval_step": 0.2, "interval_max": 0.5}

# Set in the worker's main process at start (``-E`` or ``worker_send_task_events``), inherited by the
# pool children it forks; None outside a worker.
_task_events: bool | None = None
# owner token -> (app, task id, hostname) of the leases held here, for ``lost`` (sent by the heartbeat
# thread, where the task's request is not visible).
_held: dict[str, tuple[Any, str | None, str | None]] = {}
_held_lock = threading.Lock()


def events_enabled() -> bool:
    """Whether this process belongs to a worker that sends task events."""
    return bool(_task_events)


def _on_worker_init(sender: Any = None, **_: Any) -> None:
    global _task_events
    _task_events = bool(getattr(sender, "task_events", False))


def _send(app: Any, hostname: str | None, type_: str, task_id: str | None, **fields: Any) -> None:
    try:
        with app.events.default_dispatcher(hostname=hostname) as dispatcher:
            dispatcher.send(type_, uuid=task_id, retry=True, retry_policy=_RETRY_POLICY, **fields)
    except Exception as exc:
        log.warning("could not send the %s event for task %s: %s", type_, task_id, exc)


def _on_acquired(sender: Any = None, key: str = "", lease: Any = None, **_: Any) -> None:
    if not _task_events or sender is None or lease is None:
        return
    request = sender.request
    with _held_lock:
        _held[lease.owner] = (sender.app, request.id, request.hostname)
    _send(
        sender.app,
        request.hostname,
        ACQUIRED,
        request.id,
        key=key,
        fence=lease.fence,
        lease_seconds=getattr(lease, "ttl", None),
    )


def _on_released(sender: Any = None, key: str = "", lease: Any = None, **_: Any) -> None:
    # A lost lease's entry stays for ``_on_lost``, which pops it: the body may notice the loss and end
    # (and release) before the lost-lease callbacks' thread has run, and the event must still be sent.
    if lease is not None and not getattr(lease, "lost", False):
        with _held_lock:
            _held.pop(lease.owner, None)


def _on_contended(
    sender: Any = None, key: str = "", holder: dict[str, Any] | None = None, policy: str = "", **_: Any
) -> None:
    if not _task_events or sender is None:
        return
    request = sender.request
    holder = holder or {}
    _send(
        sender.app,
        request.hostname,
        CONTENDED,
        request.id,
        key=key,
        policy=policy,
        holder_task_id=holder.get("task_id"),
        holder_worker=holder.get("worker"),
    )


def _on_lost(sender: Any = None, key: str = "", lease: Any = None, reason: str = "", **_: Any) -> None:
    if not _task_events or lease is None:
        return
    with _held_lock:
        found = _held.pop(lease.owner, None)
    if found is None:
        return  # not a task's lease (store.hold() outside Celery), or already released
    app, task_id, hostname = found
    _send(app, hostname, LOST, task_id, key=key, fence=lease.fence, reason=reason)


def _on_postrun(sender: Any = None, task_id: str | None = None, retval: Any = None, **_: Any) -> None:
    if not _task_events or sender is None:
        return
    from celery_mongolock.integration.task import SingletonTask

    if (
        isinstance(sender, SingletonTask)
        and isinstance(retval, dict)
        and retval.get("mongolock") == "skipped"
    ):
        _send(
            sender.app,
            sender.request.hostname,
            SKIPPED,
            task_id,
            key=retval.get("key"),
            reason=retval.get("reason"),
        )


def _on_parked(
    sender: Any = None, key: str = "", task_id: str = "", position: int = 0, stamp: int = 0, **_: Any
) -> None:
    if not _task_events or sender is None:
        return
    _send(sender.app, sender.request.hostname, PARKED, task_id, key=key, position=position, stamp=stamp)


def _on_handed(app: Any = None, key: str = "", task_id: str = "", attempt: int = 1, **_: Any) -> None:
    if not _task_events or app is None:
        return
    import socket

    _send(app, f"mongolock@{socket.gethostname()}", HANDED, task_id, key=key, attempt=attempt)


def _on_superseded(
    sender: Any = None, app: Any = None, key: str = "", task_id: str = "", by: str = "", **_: Any
) -> None:
    app = app if app is not None else getattr(sender, "app", None)
    if not _task_events or app is None:
        return
    hostname = getattr(getattr(sender, "request", None), "hostname", None)
    _send(app, hostname, SUPERSEDED, task_id, key=key, by=by)


signals.run_parked.connect(_on_parked, weak=False, dispatch_uid="celery_mongolock.events.parked")
signals.run_handed_off.connect(_on_handed, weak=False, dispatch_uid="celery_mongolock.events.handed")
signals.run_superseded.connect(_on_superseded, weak=False, dispatch_uid="celery_mongolock.events.superseded")
worker_init.connect(_on_worker_init, weak=False, dispatch_uid="celery_mongolock.events.worker_init")
signals.lease_acquired.connect(_on_acquired, weak=False, dispatch_uid="celery_mongolock.events.acquired")
signals.lease_released.connect(_on_released, weak=False, dispatch_uid="celery_mongolock.events.released")
signals.lease_contended.connect(_on_contended, weak=False, dispatch_uid="celery_mongolock.events.contended")
signals.lease_lost.connect(_on_lost, weak=False, dispatch_uid="celery_mongolock.events.lost")
task_postrun.connect(_on_postrun, weak=False, dispatch_uid="celery_mongolock.events.postrun")
