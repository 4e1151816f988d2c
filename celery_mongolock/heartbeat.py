"""The heartbeat: one renewal thread per process (per store), all held leases in one round trip a tick.

The thread is created lazily on first use and is never inherited across ``fork()``: the store checks the
pid and a child builds its own. It sleeps on ``Event.wait`` (no busy loop), wakes on every change, and
each tick:

1. marks lost every lease whose local deadline is within the give-up margin (renewals kept failing);
2. renews all the others with a single ``update`` matched on their owner tokens;
3. retries background releases (of ambiguous acquires and of releases that failed) until they succeed
   or the lease they were for has expired anyway.

A failed tick is retried sooner than the normal interval, so a blip costs little of the lease.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING

from .exceptions import MongoLockError

if TYPE_CHECKING:
    from .store import Lease, LeaseStore

__all__ = ["Heartbeat", "give_up_margin"]

log = logging.getLogger("celery_mongolock.heartbeat")


def give_up_margin(lease: Lease) -> float:
    """How long before its deadline a lease whose renewals keep failing is declared lost.

    Giving up early leaves the task time to notice and stop before anyone else can take the key.
    """
    return min(lease.ttl * 0.1, 2.0, lease.heartbeat_seconds)


class Heartbeat:
    """Keeps a store's leases alive from one daemon thread."""

    def __init__(self, store: LeaseStore) -> None:
        self._store = weakref.ref(store)
        self._clock = store.clock
        self._pid = os.getpid()
        self._leases: dict[str, Lease] = {}
        self._pending: dict[str, tuple[str, float]] = {}  # token -> (key, give up at)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._tick_lock = threading.Lock()
        self._next_tick: float | None = None
        self.ticks = 0
        self.failures = 0

    # -- registry ------------------------------------------------------------------------------------
    def add(self, lease: Lease) -> None:
        """Keep ``lease`` alive from now on; its first renewal is one heartbeat interval away."""
        due = self._clock.monotonic() + lease.heartbeat_seconds
        with self._lock:
            self._leases[lease.owner] = lease
            if self._next_tick is None or due < self._next_tick:
                self._next_tick = due
        self._ensure_thread()
        self._wake.set()

    def discard(self, lease: Lease) -> None:
        with self._lock:
            self._leases.pop(lease.owner, None)

    def release_later(self, key: str, token: str, until: float) -> None:
        with self._lock:
            self._pending[token] = (key, until)
            self._next_tick = self._clock.monotonic()
        self._ensure_thread()
        self._wake.set()

    @property
    def leases(self) -> list[Lease]:
        with self._lock:
            return list(self._leases.values())

    def stop(self, timeout: float = 5.0) -> None:
        self._stopped.set()
        self._wake.set()
        t = self._thread
        if t is not None and t is not threading.current_thread() and t.is_alive():
            t.join(timeout)

    def _ensure_thread(self) -> None:
        if self._pid != os.getpid():  # pragma: no cover - the store replaces us after fork
            return
        t = self._thread
        if t is None or not t.is_alive():
            with self._lock:
                t = self._thread
                if (t is None or not t.is_alive()) and not self._stopped.is_set():
                    self._thread = threading.Thread(
                        target=self._run, name="celery_mongolock-heartbeat", daemon=True
                    )
                    self._thread.start()

    # -- the loop ------------------------------------------------------------------------------------
    def _interval(self) -> float | None:
        with self._lock:
            beats = [lease.heartbeat_seconds for lease in self._leases.values()]
            pending = bool(self._pending)
        if not beats:
            return 1.0 if pending else None
        return min(beats)

    def _run(self) -> None:
        while not self._stopped.is_set():
            with self._lock:
                next_tick = self._next_tick
            if next_tick is None:
                self._wake.wait()  # nothing to do until a lease or a pending release arrives
                self._wake.clear()
                continue
            delay = next_tick - self._clock.monotonic()
            if delay > 0:
                self._wake.wait(delay)
                self._wake.clear()
                continue  # re-read the schedule: add() may have moved it earlier
            try:
                ok = self.tick()
            except Exception:  # never let the thread die: leases would silently stop renewing
                log.exception("heartbeat tick failed")
                ok = False
            interval = self._interval()
            with self._lock:
                if interval is None:
                    self._next_tick = None
                else:
                    # After a failure retry soon (but never in a busy loop); else at the normal pace.
                    step = interval if ok else min(interval, max(0.05, interval / 4))
                    self._next_tick = self._clock.monotonic() + step

    def tick(self) -> bool:
        """One heartbeat: give up on overdue leases, renew the rest, retry pending releases."""
        with self._tick_lock:
            return self._tick()

    def _tick(self) -> bool:
        store = self._store()
        if store is None:
            self._stopped.set()
            return True
        self.ticks += 1
        now = self._clock.monotonic()
        leases = self.leases
        renew = []
        for lease in leases:
            if lease.released:
                self.discard(lease)
            elif now >= lease.deadline - give_up_margin(lease):
                lease._mark_lost("renewals failed until just before the lease's deadline")
            elif not lease.lost:
                renew.append(lease)
        ok = True
        if renew:
            earliest = min(lease.deadline for lease in renew) - now
            try:
                store.renew_many(renew, timeout=max(0.2, min(store.operation_timeout, earliest)))
            except MongoLockError as exc:
                ok = False
                self.failures += 1
                log.warning("renewal of %d lease(s) failed, will retry: %s", len(renew), exc)
            except Exception as exc:  # ambiguous driver errors surface as PyMongoError subclasses
                ok = False
                self.failures += 1
                log.warning(
                    "renewal of %d lease(s) failed, will retry: %s: %s", len(renew), type(exc).__name__, exc
                )
        if self._pending:
            ok = self._flush_pending(store, now) and ok
        return ok

    def _flush_pending(self, store: LeaseStore, now: float) -> bool:
        with self._lock:
            pending = dict(self._pending)
        ok = True
        for token, (key, until) in pending.items():
            if now >= until:
                with self._lock:
                    self._pending.pop(token, None)
                continue
            try:
                released = store._release_update(key, token, timeout=2.0)
            except Exception as exc:
                ok = False
                log.debug("background release of %r failed, will retry: %s", key, exc)
                continue
            if released:
                # Until then keep trying: after an ambiguous acquire the write may still land late
                # (a command stuck in the server's queue), and it must not be left holding the key.
                with self._lock:
                    self._pending.pop(token, None)
                log.info("background release of %r done", key)
        return ok
