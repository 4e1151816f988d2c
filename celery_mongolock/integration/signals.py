"""The library's observable signals, and the worker lifecycle hooks.

Signals (``celery.utils.dispatch.Signal``; connect with ``@lease_acquired.connect``):

* ``lease_acquired(sender=task, key, lease)`` — before the body runs;
* ``lease_contended(sender=task, key, holder, policy)`` — the key was held; ``policy`` is what happens;
* ``lease_released(sender=task, key, lease)`` — after the body, on every exit path;
* ``run_parked``, ``run_handed_off``, ``run_superseded`` — queued tasks (``Queue``, ``Replace``);
* ``lease_lost(sender=None, key, lease, reason)`` — from the heartbeat thread: the running body no longer
  holds its key (``current_lease().lost`` is true; call ``current_lease().raise_if_lost()`` to stop).

Hooks: when a worker process shuts down, every lease it still holds is released.

This module imports nothing of the Celery glue above it (``config``, ``task``): the task registers its
apps here (``known_apps``), and the hooks find the leases through them.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

from celery.signals import worker_process_shutdown, worker_shutdown
from celery.utils.dispatch import Signal

if TYPE_CHECKING:
    from celery import Celery

    from celery_mongolock.core.lease import Lease

__all__ = [
    "lease_acquired",
    "lease_contended",
    "lease_lost",
    "lease_released",
    "run_handed_off",
    "run_parked",
    "run_superseded",
]

log = logging.getLogger("celery_mongolock.release")

lease_acquired = Signal(name="lease_acquired")
lease_contended = Signal(name="lease_contended")
lease_released = Signal(name="lease_released")
lease_lost = Signal(name="lease_lost")
#: ``run_parked(sender=task, key, task_id, position, stamp)``: a contended run of a queued task was
#: parked (its message acknowledged); ``position`` is 1 for the next to run.
run_parked = Signal(name="run_parked")
#: ``run_handed_off(sender=None, app, key, task_id, attempt, waited)``: the key was handed to a parked run and
#: its message published again.
run_handed_off = Signal(name="run_handed_off")
#: ``run_superseded(sender=task or None, key, task_id, by)`` (``app=`` when sent without a task): under
#: ``Replace``, a newer send replaced the run.
run_superseded = Signal(name="run_superseded")

#: The apps whose singleton tasks this process may run (``SingletonTask`` adds its app when bound).
known_apps: weakref.WeakSet[Celery] = weakref.WeakSet()


def send_lost(lease: Lease, reason: str) -> None:
    lease_lost.send(sender=None, key=lease.key, lease=lease, reason=reason)


def release_all_held(**_: Any) -> None:
    """Release every lease this process holds and write its queued lease history (graceful shutdown of a
    worker process)."""
    for app in list(known_apps):
        store = getattr(app, "_mongolock_store", None)
        if store is None:
            continue
        # Within a second whatever MongoDB does: a worker shutting down during an outage must not hang
        # (a lease whose release gets no answer expires on the server's clock).
        # A run's lease still held here did not end (a SystemExit before its body started: a pool
        # child's SIGTERM): given back unrun, so that its message, delivered again, runs it.
        released = store.release_held(timeout=1.0, unrun=True)
        if released:
            log.info("released %d lease(s) at worker shutdown", released)
        # The lease history this process queued since its heartbeat's last tick (the endings stay in the
        # lease documents' ``ends`` if MongoDB does not answer).
        store.flush_history(timeout=1.0)


worker_process_shutdown.connect(release_all_held, weak=False, dispatch_uid="celery_mongolock.release_all")
worker_shutdown.connect(release_all_held, weak=False, dispatch_uid="celery_mongolock.release_all_main")
