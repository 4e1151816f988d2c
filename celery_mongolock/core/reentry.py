"""Reentrant holds: an owner that asks again for a key it holds gets it at once, counted, with no MongoDB
command (MongoDB's config-server distributed lock and Redisson's RLock do the same).

The owner
=========
An owner is explicit: the store object (``Holds`` lives in one ``LeaseStore``; another store never shares
a hold) and, within this process, either

* the running singleton run (``run_scope``: the Celery glue opens one around each run; the task's body,
  and a singleton function it calls in-process, are that run), or else
* the thread (``thread:<ident>``), for code outside a singleton run.

A lease taken in another process (``lease.pid``) is never shared, nor one taken by another thread or run.

What a reentrant hold is
========================
A ``ReentrantHold``: a view of the owner's outer lease (the same key, owner token, fence, slot, deadline,
heartbeat; ``outer``), counted in ``depth``. Ending it takes nothing from MongoDB: the key stays held
until the outer lease is released. The outer lease lost makes every reentrant hold of it lost (``lost``
reads the outer's). A reentrant hold asks for what the outer lease is: a different ``ttl`` or
``heartbeat_seconds`` (the outer lease's are the ones renewed), or a different ``limit`` (a single lease
against a slot of ``limit=N``, or another N) cannot mean anything for one lease and is refused with
``ConfigurationError``. ``ttl=None`` (the default) means the outer lease's.

Only live leases are reentered: one released, lost, or given away (a reservation) is dropped, and the
owner's next ask is an acquisition like anyone else's.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from celery_mongolock.core.lease import Lease, LostCallback, SupersededCallback
from celery_mongolock.exceptions import ConfigurationError, LeaseLost

__all__ = ["Held", "Holds", "ReentrantHold", "current_owner", "run_scope"]

log_acquire = logging.getLogger("celery_mongolock.acquire")

_run: contextvars.ContextVar[str | None] = contextvars.ContextVar("celery_mongolock_run", default=None)

#: A registry with more entries than this is swept of the ended ones at the next registration.
_SWEEP_AT = 256


def current_owner() -> str:
    """Who asks, in this process: the running singleton run (``run:...``), else this thread."""
    return _run.get() or f"thread:{threading.get_ident()}"


@contextlib.contextmanager
def run_scope(name: str = "") -> Iterator[str]:
    """Make the code in the block one owner, a run (``run:<name>:<unique>``); inside a scope already open
    (a singleton function called in-process by a running one), the open one stays the owner."""
    open_run = _run.get()
    if open_run is not None:
        yield open_run
        return
    token = _run.set(f"run:{name}:{uuid.uuid4().hex[:12]}")
    try:
        yield str(_run.get())
    finally:
        _run.reset(token)


@dataclass
class Held:
    """One owner's hold of a key: its outer lease, the ``limit`` it was taken with, whether it may be
    reentered (``shared``), and how many reentrant holds of it are open (``depth``)."""

    owner: str
    lease: Lease
    limit: int | None
    shared: bool
    depth: int = 0

    def live(self) -> bool:
        return self.lease.pid == os.getpid() and not self.lease.released and not self.lease.lost


class Holds:
    """The holds of one store's owners, in this process: what ``hold``, ``acquire(reentrant=True)`` and a
    singleton run took, by owner and key. In memory only: deciding a reentry sends no command."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], list[Held]] = {}

    def add(self, lease: Lease, limit: int | None, *, shared: bool = True) -> None:
        """Note ``lease`` as the current owner's (``shared=False``: it may not be reentered; a nested
        ``reentrant=False`` ask still learns that the owner holds the key, and fails fast)."""
        held = Held(current_owner(), lease, limit, shared)
        with self._lock:
            if len(self._held) > _SWEEP_AT:
                self._sweep()
            entries = self._held.setdefault((held.owner, lease.key), [])
            entries[:] = [h for h in entries if h.live()]
            entries.append(held)

    def forget(self, lease: Lease) -> None:
        """``lease`` ended (released or given away): it is nobody's outer lease any more."""
        with self._lock:
            for where, entries in list(self._held.items()):
                kept = [h for h in entries if h.lease is not lease]
                if len(kept) != len(entries):
                    if kept:
                        self._held[where] = kept
                    else:
                        del self._held[where]
                    return

    def _sweep(self) -> None:
        for where, entries in list(self._held.items()):
            kept = [h for h in entries if h.live()]
            if kept:
                self._held[where] = kept
            else:
                del self._held[where]

    def find(self, key: str, *, shared_only: bool = True) -> Held | None:
        """The current owner's live hold of ``key`` (the outermost), or None."""
        with self._lock:
            entries = self._held.get((current_owner(), key), [])
            for held in entries:
                if held.live() and (held.shared or not shared_only):
                    return held
        return None

    def count(self, key: str) -> int:
        """How many holds of ``key`` the current owner has open: its outer lease and the reentrant holds
        of it (0: none)."""
        held = self.find(key, shared_only=False)
        return 0 if held is None else 1 + held.depth

    def reenter(
        self,
        key: str,
        *,
        ttl: float | None = None,
        heartbeat_seconds: float | None = None,
        limit: int | None = None,
        check_timing: bool = True,
    ) -> ReentrantHold | None:
        """A reentrant hold of ``key`` when the current owner holds it (live, shareable), else None.
        Refuses (``ConfigurationError``) an ask the outer lease cannot mean: another ``limit``, or (with
        ``check_timing``) another ``ttl`` or ``heartbeat_seconds``."""
        held = self.find(key)
        if held is None:
            return None
        outer = held.lease
        if limit != held.limit:
            what = "a single lease" if held.limit is None else f"a slot of limit={held.limit}"
            raise ConfigurationError(
                f"a reentrant hold of {key!r} asks for limit={limit}, but its outer hold is {what}: "
                "a reentrant hold is the outer one's lease; ask with the same limit, or reentrant=False"
            )
        if check_timing:
            for name, asked, has in (
                ("ttl", ttl, outer.ttl),
                ("heartbeat_seconds", heartbeat_seconds, outer.heartbeat_seconds),
            ):
                if asked is not None and float(asked) != has:
                    raise ConfigurationError(
                        f"a reentrant hold of {key!r} asks for {name}={asked:g}, but its outer hold has "
                        f"{name}={has:g}: a reentrant hold is the outer one's lease, renewed as the outer "
                        f"one; pass {name}=None (or the same), or reentrant=False"
                    )
        with self._lock:
            held.depth += 1
            depth = held.depth
        log_acquire.info("reentered lease %r fence=%s depth=%d", key, outer.fence, depth)
        return ReentrantHold(self, held, depth)

    def exit(self, held: Held) -> None:
        with self._lock:
            held.depth = max(0, held.depth - 1)


class ReentrantHold(Lease):
    """A reentrant hold: the owner's outer lease of the same key, counted (``depth``: 1 for the first
    hold inside the outer one). The same ``key``, ``owner``, ``fence``, ``slot`` and deadline as
    ``outer``; ``lost`` when the outer lease is lost. ``release()`` ends this hold only: the key stays
    held until the outer lease is released."""

    def __init__(self, holds: Holds, held: Held, depth: int) -> None:  # a view: no Lease.__init__
        outer = held.lease
        self.outer = outer
        self.depth = depth
        self._holds = holds
        self._held = held
        self._released = False
        self.store = outer.store
        self.key = outer.key
        self.owner = outer.owner
        self.fence = outer.fence
        self.slot = outer.slot
        self.ttl = outer.ttl
        self.heartbeat_seconds = outer.heartbeat_seconds
        self.expires_at = outer.expires_at
        self.holder = dict(outer.holder)
        self.acquired_at = outer.acquired_at
        self.waited_ms = outer.waited_ms
        self.acquired_mono = outer.acquired_mono
        self.sent_mono = outer.sent_mono
        self.pid = outer.pid
        self.ambiguous_until = None

    @property
    def deadline(self) -> float:
        return self.outer.deadline

    @property
    def remaining(self) -> float:
        return 0.0 if self._released else self.outer.remaining

    @property
    def lost(self) -> bool:
        return self.outer.lost

    @property
    def lost_reason(self) -> str | None:
        return self.outer.lost_reason

    @property
    def released(self) -> bool:
        return self._released

    @property
    def held(self) -> bool:
        return not self._released and self.outer.held

    def raise_if_lost(self) -> None:
        if self._released:
            raise LeaseLost(self.key, self.fence, "this reentrant hold was released")
        self.outer.raise_if_lost()

    def wait_lost(self, timeout: float | None = None) -> bool:
        return self.outer.wait_lost(timeout)

    def on_lost(self, callback: LostCallback) -> None:
        self.outer.on_lost(callback)

    # -- supersession: the outer lease's (``Replace(cancel_running=True)``) ------------------------------
    @property
    def superseded(self) -> bool:
        return self.outer.superseded

    @property
    def superseded_by(self) -> str | None:
        return self.outer.superseded_by

    @property
    def superseded_at(self) -> float | None:
        return self.outer.superseded_at

    @property
    def ended_superseded_by(self) -> str | None:
        return self.outer.ended_superseded_by

    def raise_if_superseded(self) -> None:
        self.outer.raise_if_superseded()

    def wait_superseded(self, timeout: float | None = None) -> bool:
        return self.outer.wait_superseded(timeout)

    def on_superseded(self, callback: SupersededCallback) -> None:
        self.outer.on_superseded(callback)

    def mark_superseded(self, by: str) -> bool:
        return self.outer.mark_superseded(by)

    def end_superseded(self) -> None:
        self.outer.end_superseded()

    def renewed(self, sent_at: float, expires_at: object = None) -> None:
        pass  # the outer lease is the one renewed

    def renew(self) -> None:
        """Renew the outer lease (the one this hold is)."""
        if self._released:
            raise LeaseLost(self.key, self.fence, "this reentrant hold was released")
        self.outer.renew()

    def mark_lost(self, reason: str, *, release: bool = True) -> bool:
        return self.outer.mark_lost(reason, release=release)

    def handed_over(self) -> bool:
        return False  # only the outer lease can be given away

    def release(self) -> bool:
        """End this hold (no command: the outer lease keeps the key); False if it was ended already."""
        if self._released:
            return False
        self._released = True
        self._holds.exit(self._held)
        return True

    def __enter__(self) -> ReentrantHold:
        return self

    def __repr__(self) -> str:
        state = "released" if self._released else ("lost" if self.lost else "held")
        return f"<ReentrantHold {self.key!r} depth={self.depth} of {self.outer!r} {state}>"
