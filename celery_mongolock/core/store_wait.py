"""``LeaseStore.wait_free`` (a part of ``LeaseStore``): wait until a key looks free, on a change stream
where the server has them, else polling with backoff."""

from __future__ import annotations

import contextlib
import math
import random
from typing import TYPE_CHECKING, Protocol

from pymongo.collection import Collection
from pymongo.errors import OperationFailure, PyMongoError

from celery_mongolock.core.documents.base import Document
from celery_mongolock.core.keys import normalize_key
from celery_mongolock.core.store_connection import AMBIGUOUS
from celery_mongolock.exceptions import ConfigurationError, StoreUnavailable

if TYPE_CHECKING:
    from celery_mongolock.core.clock import Clock
    from celery_mongolock.core.store_connection import Connection
    from celery_mongolock.core.store_history import Records

__all__ = ["WaitOwner", "wait_free"]


class WaitOwner(Protocol):
    """What ``wait_free`` needs of the store."""

    @property
    def clock(self) -> Clock: ...

    @property
    def connection(self) -> Connection: ...

    @property
    def collection(self) -> Collection[Document]: ...

    @property
    def records(self) -> Records: ...


def wait_free(
    store: WaitOwner, key: str, timeout: float, *, poll_interval: float = 0.05, max_poll_interval: float = 1.0
) -> bool:
    """``LeaseStore.wait_free``: a change stream where the server has them, else polling."""
    key = normalize_key(key)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout):
        raise ConfigurationError(f"timeout must be a number of seconds, got {timeout!r}")
    clock = store.clock
    give_up_at = clock.monotonic() + max(0.0, timeout)
    try:
        with store.connection.operation(f"watch lease {key!r}", timeout=None):
            # (the store's collection: a store may stand in one without change streams, as a test's does)
            stream = store.collection.watch([{"$match": {"documentKey._id": key}}], max_await_time_ms=200)
    except (StoreUnavailable, OperationFailure, *AMBIGUOUS):
        stream = None  # no change streams here (standalone server, permissions): poll instead
    interval = poll_interval
    try:
        while True:
            info = store.records.inspect(key)
            queued = info is not None and bool(info.parked or info.handoff)
            if info is None or not (info.full or queued):
                return True
            remaining = give_up_at - clock.monotonic()
            if remaining <= 0:
                return False
            # Sleep until a change, the holder's expiry, or the deadline, whichever is first. A key
            # with runs parked is theirs first, even when nobody holds it: look again later.
            nap = min(remaining, max(0.01, (info.expires_in or 0.0) + 0.005))
            if queued and not info.full:
                nap = min(remaining, max_poll_interval)
            if stream is not None:
                wake_at = clock.monotonic() + nap
                try:
                    # Each try_next waits on the server up to max_await_time_ms for a change.
                    while stream.try_next() is None and clock.monotonic() < wake_at:
                        pass
                except (PyMongoError, *AMBIGUOUS):
                    stream = None
            else:
                # Jittered, but never past max_poll_interval: that bounds how late a release is seen.
                clock.sleep(min(nap, max_poll_interval, interval * (0.5 + random.random())))
                interval = min(max_poll_interval, interval * 2)
    finally:
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.close()
