"""Reentrant runs: a singleton run that asks again for a key it holds gets it at once (``core.reentry``).

Each run of a singleton task is one owner (``reentry.run_scope``, opened around the run). The leases it
takes are noted as that run's holds in the app's store, so that, while its body runs,

* ``get_store(app).hold(key)`` on one of its own keys is a reentrant hold of its lease, and
* a singleton function it calls in-process (``other_task(...)``) whose keys overlap its own reenters the
  keys it holds (the same fences, no command, no slot taken twice) and takes only the others.

A run that starts in a worker opens a new owner: it never shares another run's leases, nor those of the
code that sent it or that holds a key in the same thread outside any run (a test's ``holding``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from celery_mongolock.core.lease import Lease
from celery_mongolock.core.lease_set import LeaseSet
from celery_mongolock.core.reentry import ReentrantHold
from celery_mongolock.core.validation import validate_limit

if TYPE_CHECKING:
    from celery_mongolock.core.store import LeaseStore

__all__ = ["end_holds", "joined", "note_taken", "reentered"]


def reentered(store: LeaseStore, limits: Mapping[str, int | None]) -> dict[str, ReentrantHold]:
    """The reentrant holds of those of ``limits``' keys the running run holds already (by key). A key
    asked with another limit than the run holds it with is refused (``ConfigurationError``), and then
    none is kept. The ttl and heartbeat are the outer lease's, whatever the inner task's settings."""
    inner: dict[str, ReentrantHold] = {}
    try:
        for key, limit in limits.items():
            hold = store.holds.reenter(key, limit=validate_limit(limit), check_timing=False)
            if hold is not None:
                inner[key] = hold
    except BaseException:
        end_holds(inner)
        raise
    return inner


def end_holds(inner: Mapping[str, ReentrantHold]) -> None:
    """End reentrant holds a run will not use after all (no command)."""
    for hold in inner.values():
        hold.release()


def note_taken(store: LeaseStore, taken: Lease, limits: Mapping[str, int | None]) -> None:
    """Note the leases a run took as the run's holds (a ``LeaseSet``'s reentrant holds are noted already)."""
    for lease in taken.leases.values() if isinstance(taken, LeaseSet) else [taken]:
        if not isinstance(lease, ReentrantHold):
            store.holds.add(lease, validate_limit(limits.get(lease.key)))


def joined(inner: Mapping[str, ReentrantHold], taken: LeaseSet | None) -> LeaseSet:
    """One ``LeaseSet`` of the reentrant holds and the leases taken, in key order."""
    leases: list[Lease] = [*inner.values(), *(taken.leases.values() if taken else [])]
    return LeaseSet(sorted(leases, key=lambda lease: lease.key))
