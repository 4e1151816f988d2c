"""A worker's start-up: settings validated, and warnings about the lease store and the broker, before it
takes work (the ``celery_mongolock`` bootstep), and the handoff sweeper started once its pool runs.

The checks of the worker's singleton tasks are the task module's (``task``): they take the task class,
which this module does not import; the bootstep runs the ones it is given.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from celery import Celery
from celery import signals as celery_signals

from celery_mongolock.core.urls import redact
from celery_mongolock.exceptions import ConfigurationError
from celery_mongolock.integration import lanes, signals
from celery_mongolock.integration.config import get_settings
from celery_mongolock.integration.sweeper import start_sweeper

__all__ = ["check_broker_settings", "check_store", "check_task_policies", "install_bootstep"]

log_acquire = logging.getLogger("celery_mongolock.acquire")


def check_store(app: Celery, timeout: float = 2.0) -> None:
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


def check_task_policies(
    app: Celery, is_singleton: Callable[[Any], bool], check_keys: Callable[[Any], None]
) -> list[str]:
    """Warn about ``mongolock_task_policies`` entries naming no task this worker has (a typo applies to
    nothing); return those names. Only a warning: a worker may not import every task of the project.
    The entries of tasks it has are checked against them (``ConfigurationError``): ``"keys"`` and
    ``"limit"`` with the task's policy, keys and limit, and the templates against its signature."""
    policies = get_settings(app).task_policies
    for name in sorted(set(policies) & set(app.tasks)):
        task = app.tasks[name]
        if is_singleton(task) and ("keys" in policies[name] or "limit" in policies[name]):
            # its options (check_keys: a limit per key spec against the decorator's keys= too), then each
            # template against the signature
            check_keys(task)
    unknown = sorted(set(policies) - set(app.tasks))
    if unknown:
        log_acquire.warning(
            "celery_mongolock: mongolock_task_policies names task(s) this worker does not have: %s "
            "(misspelt? their options apply to no task here)",
            ", ".join(map(repr, unknown)),
        )
    return unknown


def check_broker_settings(app: Celery, is_singleton: Callable[[Any], bool]) -> list[str]:
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
    singletons = sorted(name for name, task in app.tasks.items() if is_singleton(task))
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


def install_bootstep(app: Celery, check_tasks: Callable[[Celery, Any], object]) -> None:
    """Once per app: validate the settings when a worker starts (``check_store``, then ``check_tasks``, the
    checks of its singleton tasks, given the worker's pool class), and start the handoff sweeper when it is
    ready."""
    if getattr(app, "_mongolock_bootstep", False):
        return
    app._mongolock_bootstep = True
    from celery import bootsteps

    class ValidateMongolockSettings(bootsteps.StartStopStep):  # type: ignore[misc]
        """Fail worker start-up with a message naming the bad ``mongolock_*`` setting."""

        label = "celery_mongolock"

        def __init__(self, worker: Any, **kwargs: Any) -> None:
            settings = get_settings(worker.app)  # raises ConfigurationError naming the setting
            signals.known_apps.add(worker.app)
            if settings.handoff_lane:
                # Before the consumer starts: it consumes each task queue's handoff lane too.
                lanes.add_lanes(worker.app)
            super().__init__(worker, **kwargs)

        def start(self, worker: Any) -> None:
            # Say where the leases live, and warn at once (not at the first task) if MongoDB does not
            # answer. Synchronous, on a short-lived client of its own: a thread here could hold a lock
            # while the pool forks a child, and the child would deadlock on it.
            try:
                check_store(worker.app)
                check_tasks(worker.app, getattr(worker, "pool_cls", None))
            except ConfigurationError as exc:
                # One line, as at the settings' first read, not Celery's "Unrecoverable error" and its
                # traceback (a bad template in mongolock_task_policies is found here); the worker stops
                # with status 1 (Celery's worker.start turns SystemExit into its exit code).
                # (the process's own stderr: the worker has redirected sys.stderr to its logger by now)
                stderr = sys.__stderr__ or sys.stderr
                stderr.write(f"celery_mongolock: cannot start: {exc}\n")
                stderr.flush()
                raise SystemExit(1) from None

    def sweep_when_ready(sender: Any = None, **_: Any) -> None:
        # After the pool has started its children: the sweeper's thread lives in the main process only.
        worker_app = getattr(sender, "app", None)
        if worker_app is app:
            start_sweeper(app)

    celery_signals.worker_ready.connect(sweep_when_ready, weak=False)

    app.steps["worker"].add(ValidateMongolockSettings)
