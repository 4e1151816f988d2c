"""``LeaseStore.hold``: hold a key while a ``with`` block runs (a part of ``LeaseStore``).

A hold is an acquisition with a heartbeat (``try_acquire``), waiting for the key with ``wait_free``, noted
in the store's ``holds`` under its owner (``reentry``). An owner that holds the key already gets a
``ReentrantHold`` of its outer lease at once, with no command (``reentrant=True``, the default); with
``reentrant=False`` its nested hold is an acquisition like anyone else's, and when that finds the key
held it fails at once (``LockContended``) instead of waiting for itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from celery_mongolock.core.clock import Clock
from celery_mongolock.core.documents.base import Document
from celery_mongolock.core.keys import normalize_key
from celery_mongolock.core.lease import Lease
from celery_mongolock.core.lease_info import aware
from celery_mongolock.core.outcomes import Contended
from celery_mongolock.core.reentry import Holds
from celery_mongolock.core.validation import (
    MAX_LEASE_SECONDS,
    validate_lease_timing,
    validate_limit,
    validate_seconds,
)
from celery_mongolock.exceptions import ConfigurationError, LeaseLost, LockContended

__all__ = ["HoldingStore", "acquire_reentrant", "hold"]


class HoldingStore(Protocol):
    """What a hold needs from its store (``LeaseStore`` implements it)."""

    @property
    def clock(self) -> Clock: ...

    @property
    def holds(self) -> Holds: ...

    def try_acquire(
        self,
        key: str,
        ttl: float | None,
        *,
        info: Mapping[str, Any] | None = None,
        heartbeat: bool = False,
        heartbeat_seconds: float | None = None,
        limit: int | None = None,
        ended_runs: Sequence[str] = (),
    ) -> tuple[Lease | None, Document | None]: ...

    def wait_free(
        self, key: str, timeout: float, *, poll_interval: float = 0.05, max_poll_interval: float = 1.0
    ) -> bool: ...


def _ended_lost(lease: Lease) -> None:
    if lease.lost:
        # The block ran (at least in part) without the lease: do not let it pass as protected.
        raise LeaseLost(lease.key, lease.fence, lease.lost_reason or "lost")


def _self_contended(key: str, doc: Document | None) -> LockContended:
    holder = (doc or {}).get("holder") or {}
    return LockContended(
        key,
        holder,
        aware((doc or {}).get("expires_at")),
        message=(
            f"lease {key!r} is held by this same owner (this thread or run, through this store), in a "
            "hold outside this one: a nested hold with reentrant=False fails at once instead of waiting "
            "for itself"
        ),
    )


def _contended(key: str, doc: Document | None) -> LockContended:
    """The key is held: by its holder, or for a ``limit=N`` key, by the holders of all its N slots."""
    contended = Contended.of(doc)
    return LockContended(key, dict(contended.holder), contended.expires_at, message=contended.message(key))


@contextlib.contextmanager
def hold(
    store: HoldingStore,
    key: str,
    ttl: float | None = None,
    *,
    wait: float = 0.0,
    info: Mapping[str, Any] | None = None,
    heartbeat_seconds: float | None = None,
    poll_interval: float = 0.05,
    max_poll_interval: float = 1.0,
    limit: int | None = None,
    reentrant: bool = True,
) -> Iterator[Lease]:
    """``LeaseStore.hold``: a reentrant hold when the owner holds ``key`` already, else
    ``store.try_acquire`` with a heartbeat, waiting with ``wait_free``."""
    wait_s = validate_seconds("wait", wait, low=0.0, high=MAX_LEASE_SECONDS)
    # (checked here, not only by a fresh acquire: a nested hold makes none, and must refuse them alike)
    if ttl is not None:
        validate_lease_timing(ttl, heartbeat_seconds, name="ttl")
    validate_seconds("poll_interval", poll_interval, low=0.001, high=60.0)
    validate_seconds("max_poll_interval", max_poll_interval, low=0.001, high=60.0)
    if not isinstance(reentrant, bool):
        raise ConfigurationError(f"reentrant must be True or False, got {type(reentrant).__name__}")
    limit = validate_limit(limit)
    name = normalize_key(key)
    if reentrant:
        inner = store.holds.reenter(name, ttl=ttl, heartbeat_seconds=heartbeat_seconds, limit=limit)
        if inner is not None:
            with inner:
                yield inner
                _ended_lost(inner)
            return
    # The owner holds the key in a hold it does not share (reentrant=False, inside or outside):
    # waiting would wait for itself.
    mine = store.holds.find(name, shared_only=False) is not None
    clock = store.clock
    give_up_at = clock.monotonic() + wait_s
    while True:
        lease, doc = store.try_acquire(
            key, ttl, info=info, heartbeat=True, heartbeat_seconds=heartbeat_seconds, limit=limit
        )
        if lease is not None:
            break
        if mine:
            raise _self_contended(name, doc)
        remaining = give_up_at - clock.monotonic()
        if remaining <= 0 or not store.wait_free(
            key, remaining, poll_interval=poll_interval, max_poll_interval=max_poll_interval
        ):
            raise _contended(name, doc)
    store.holds.add(lease, limit, shared=reentrant)
    with lease:
        yield lease
        _ended_lost(lease)


def acquire_reentrant(
    store: HoldingStore,
    key: str,
    ttl: float | None,
    *,
    info: Mapping[str, Any] | None,
    heartbeat: bool,
    heartbeat_seconds: float | None,
    plain: bool,
    limit: int | None,
    reentrant: object,
) -> Lease | None:
    """``LeaseStore.acquire(reentrant=True)``: a reentrant hold when the owner holds ``key`` already, else
    one try, the lease noted as the owner's. ``plain``: no ``min_hold``, ``tick`` or ``hold_until_ms``."""
    if reentrant is not True:
        raise ConfigurationError(f"reentrant must be True or False, got {type(reentrant).__name__}")
    if not plain:
        raise ConfigurationError(
            "reentrant=True is for plain holds: an acquire with min_hold, tick or hold_until_ms is never "
            "reentered (a tick runs once)"
        )
    limit = validate_limit(limit)
    inner = store.holds.reenter(normalize_key(key), ttl=ttl, heartbeat_seconds=heartbeat_seconds, limit=limit)
    if inner is not None:
        return inner
    lease, _ = store.try_acquire(
        key, ttl, info=info, heartbeat=heartbeat, heartbeat_seconds=heartbeat_seconds, limit=limit
    )
    if lease is not None:
        store.holds.add(lease, limit)
    return lease
