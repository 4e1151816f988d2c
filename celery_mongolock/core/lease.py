"""The lease value objects: ``Lease`` (a lease this process holds) and ``LeaseInfo`` (a lease document read).

No MongoDB call is made here: a ``Lease`` asks the store that issued it (``LeaseBackend``, which
``LeaseStore`` implements) to renew or release it, and keeps its own deadline.

Holder's deadline
=================
The holder measures its lease on the monotonic clock from the moment the acquire/renew was *sent*
(``sent + ttl``, shrunk by ``clock.MAX_DRIFT``), which is never later than the server's ``expires_at``.
Past that deadline ``lease.lost`` is true even if nobody told us; the heartbeat gives up a margin before it.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from celery_mongolock.core.clock import MAX_DRIFT, Clock
from celery_mongolock.core.lease_info import LeaseInfo
from celery_mongolock.exceptions import LeaseLost, StoreUnavailable, Superseded

__all__ = [
    "Lease",
    "LeaseBackend",
    "LeaseInfo",
    "LostCallback",
    "SupersededCallback",
    "local_ttl",
]

log_release = logging.getLogger("celery_mongolock.release")
log_renew = logging.getLogger("celery_mongolock.renew")

LostCallback = Callable[["Lease", str], None]
#: ``callback(lease, by)``: a newer send superseded the holder of ``lease`` (``by``: its task id).
SupersededCallback = Callable[["Lease", str], None]


class LeaseBackend(Protocol):
    """What a ``Lease`` needs from the store that issued it (``LeaseStore`` implements it)."""

    @property
    def clock(self) -> Clock: ...

    @property
    def lost_callbacks(self) -> Sequence[LostCallback]:
        """Called for every lease of the store that is lost."""
        ...

    def renew_lease(self, lease: Lease) -> bool:
        """Extend ``lease`` once, now; True if it was still ours (matched, not expired on the server)."""
        ...

    def release_lease(self, lease: Lease) -> bool:
        """Send the release of ``lease``; True if it was still ours. Retried in the background (until
        ``lease.deadline``) and ``StoreUnavailable`` raised if MongoDB does not answer."""
        ...

    def release_later(
        self, key: str, token: str, until: float, *, quiet: bool = False, maybe: bool = False
    ) -> None:
        """Release ``token`` on ``key`` in the background as soon as MongoDB answers, until ``until``."""
        ...

    def forget(self, lease: Lease) -> None:
        """Stop renewing ``lease`` (it was released or lost)."""
        ...

    def record_lost(self, lease: Lease, reason: str) -> None:
        """Queue the holder's own view of ``lease``'s end, "lost", for the lease history (no I/O)."""
        ...


def local_ttl(ttl: float) -> float:
    """How long the holder may count on a lease of ``ttl`` s, on its own monotonic clock.

    Shrunk by the drift allowance and 2 ms: the server's ``$$NOW`` has 1 ms resolution and the lease
    length sent is whole milliseconds.
    """
    return int(ttl * 1000) / 1000.0 * (1.0 - MAX_DRIFT) - 0.002


def _run_callbacks(callbacks: list[LostCallback], lease: Lease, reason: str) -> None:
    if not callbacks:
        return

    def run() -> None:
        for cb in callbacks:
            try:
                cb(lease, reason)
            except Exception:
                log_renew.exception("lost-lease callback %r failed", cb)

    threading.Thread(target=run, name="celery_mongolock-lost-callbacks", daemon=True).start()


class Lease:
    """A lease this process holds (or held) on one key.

    ``key``, ``owner`` (this acquisition's token), ``fence`` (fencing token), ``expires_at`` (server
    time, as of the acquisition) and ``lost``. Use it as a context manager to release on exit.

    A lease belongs to the process that took it: in a forked child, ``release`` and ``renew`` do
    nothing to it (the parent still holds it).
    """

    def __init__(
        self,
        store: LeaseBackend,
        key: str,
        owner: str,
        *,
        fence: int,
        ttl: float,
        heartbeat_seconds: float,
        expires_at: _dt.datetime | None,
        sent_at: float,
        holder: Mapping[str, Any],
        acquired_at: _dt.datetime | None = None,
        waited_ms: int | None = None,
        slot: int | None = None,
    ) -> None:
        self.store = store
        self.key = key
        self.owner = owner
        self.fence = fence
        #: Which of the key's slots this lease holds (``limit=N``: 0 to N-1); None for a single lease.
        self.slot = slot
        self.ttl = ttl
        self.heartbeat_seconds = heartbeat_seconds
        self.expires_at = expires_at
        self.holder = dict(holder)
        #: Server time of the acquisition, and how long the run waited for the key (None: not known).
        self.acquired_at = acquired_at
        self.waited_ms = waited_ms
        #: Monotonic time the acquisition's reply arrived: with ``acquired_at``, an estimate of the
        #: server's time later on (for the lease history).
        self.acquired_mono = store.clock.monotonic()
        #: Monotonic time the acquisition was sent (the grant came between this and ``acquired_mono``);
        #: unlike ``deadline - ttl``, a renewal does not move it.
        self.sent_mono = sent_at
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._deadline = sent_at + local_ttl(ttl)
        self._lost_reason: str | None = None
        #: Until then a copy of an acquire attempt with this token may still land late (see the store).
        self.ambiguous_until: float | None = None
        #: Set by the task layer once the run's body has ended (returned or raised): at its process's exit
        #: (``release_held(unrun=True)``) the lease is released as a run that ended, not given back.
        self.body_ended = False
        self._released = False
        self._lost_event = threading.Event()
        self._callbacks: list[LostCallback] = []
        #: ``Replace(cancel_running=True)``: the lease's holder is told when a newer send supersedes it
        #: (the lease watch, or the heartbeat's read where there is no change stream).
        self.notice_supersession = False
        self._superseded_by: str | None = None
        self._superseded_at: float | None = None
        self._superseded_event = threading.Event()
        self._superseded_callbacks: list[SupersededCallback] = []
        self._ended_superseded_by: str | None = None
        #: The other leases of its run's set (``LeaseSet.supersede_together``): one of them marked, it is.
        self._together: tuple[Lease, ...] = ()

    # -- state ---------------------------------------------------------------------------------------
    @property
    def deadline(self) -> float:
        """Monotonic time after which this process must assume the lease is gone."""
        return self._deadline

    @property
    def remaining(self) -> float:
        """Seconds until the local deadline (0 when lost or released)."""
        if self._lost_reason is not None or self._released:
            return 0.0
        return max(0.0, self._deadline - self.store.clock.monotonic())

    @property
    def lost(self) -> bool:
        """True once the lease is known or must be assumed to be held no more (not after a release)."""
        if self._lost_reason is not None:
            return True
        if self._released:
            return False
        if self.store.clock.monotonic() >= self._deadline:
            self.mark_lost("its deadline passed without a successful renewal")
            return True
        return False

    @property
    def lost_reason(self) -> str | None:
        _ = self.lost
        return self._lost_reason

    @property
    def released(self) -> bool:
        return self._released

    @property
    def held(self) -> bool:
        """True while the lease is neither released nor lost."""
        return not self._released and not self.lost

    def raise_if_lost(self) -> None:
        """Raise ``LeaseLost`` if the lease is lost (or was released): call it between steps of long work
        to stop promptly."""
        if self.lost:
            raise LeaseLost(self.key, self.fence, self._lost_reason or "lost")
        if self._released:
            raise LeaseLost(self.key, self.fence, "it was released")

    def wait_lost(self, timeout: float | None = None) -> bool:
        """Block until the lease is lost (True) or ``timeout`` passes (False)."""
        return self._lost_event.wait(timeout)

    # -- supersession (Replace(cancel_running=True)) -------------------------------------------------------
    @property
    def superseded(self) -> bool:
        """True once a newer send of the key superseded this holder (``Replace(cancel_running=True)``): the
        body should stop (``raise_if_superseded``); its fenced writes are refused from now on."""
        return self._marked() is not None

    @property
    def superseded_by(self) -> str | None:
        """The task id of the newer send that superseded this holder (None: not superseded)."""
        marked = self._marked()
        return self._superseded_by if marked is None else marked._superseded_by

    def _marked(self) -> Lease | None:
        """This lease if it was marked superseded, else a marked lease of its set (``supersede_together``:
        the moment the run learns of it on one key, a fenced write with any of its leases is refused),
        else None. (``mark_superseded`` marks the set's other leases too, at once: this only closes the
        instant between.)"""
        if self._superseded_event.is_set() or self._released or self._lost_reason is not None:
            return self if self._superseded_event.is_set() else None
        return next((lease for lease in self._together if lease._superseded_event.is_set()), None)

    def supersede_with(self, leases: Iterable[object]) -> None:
        """Superseded with the other leases of its run's set (``LeaseSet.supersede_together``): marked when
        one of them is, in the same call."""
        self._together = tuple(lease for lease in leases if isinstance(lease, Lease) and lease is not self)

    @property
    def superseded_at(self) -> float | None:
        """When this process learnt of the supersession (its clock's monotonic time; None: not yet)."""
        return self._superseded_at

    def raise_if_superseded(self) -> None:
        """Raise ``Superseded`` if a newer send superseded this holder: call it between steps of long
        work. Raised out of a singleton task's body, it ends the run as superseded, not as a failure."""
        if self.superseded:
            raise Superseded(self.key, self.fence, self.superseded_by)

    def wait_superseded(self, timeout: float | None = None) -> bool:
        """Block until a newer send supersedes this holder (True) or ``timeout`` passes (False)."""
        return self._superseded_event.wait(timeout)

    def on_superseded(self, callback: SupersededCallback) -> None:
        """Call ``callback(lease, by)`` when a newer send supersedes this holder, from a thread of its
        own."""
        with self._lock:
            by = self._superseded_by if self._superseded_event.is_set() else None
            if by is None:
                self._superseded_callbacks.append(callback)
        if by is not None:
            _run_callbacks([callback], self, by)

    def mark_superseded(self, by: str) -> bool:
        """A newer send (task id ``by``) superseded this holder (the store calls this when the lease
        document says so), and the other leases of its set with it (``supersede_with``); False if it
        already was, or the lease is released or lost."""
        callbacks = self._mark(by)
        if callbacks is None:
            return False
        marked = [(self, callbacks)]
        marked += [(mate, found) for mate in self._together if (found := mate._mark(by)) is not None]
        for lease, found in marked:  # (every lease marked before any callback runs)
            log_renew.info("lease %r (fence %s): superseded by a newer send (%s)", lease.key, lease.fence, by)
            _run_callbacks(found, lease, by)
        return True

    def _mark(self, by: str) -> list[SupersededCallback] | None:
        """Mark this lease superseded by ``by``: its callbacks to run, or None when it was already, or is
        released or lost."""
        with self._lock:
            if self._superseded_event.is_set() or self._released or self._lost_reason is not None:
                return None
            self._superseded_by = by
            self._superseded_at = self.store.clock.monotonic()
            self._superseded_event.set()
            return list(self._superseded_callbacks)

    def end_superseded(self) -> None:
        """The body stopped because a newer send superseded this holder (the Celery layer says so before
        the release): the release records it in the key's ending (``for``), so that a copy of the run that
        finds it over with no result stored ends it superseded, not ``already-ran``."""
        with self._lock:
            if self._superseded_event.is_set():
                self._ended_superseded_by = self._superseded_by

    @property
    def ended_superseded_by(self) -> str | None:
        """The newer send this holder's body stopped for (``end_superseded``); None: it did not."""
        return self._ended_superseded_by

    def on_lost(self, callback: LostCallback) -> None:
        """Call ``callback(lease, reason)`` when the lease is lost, from a thread of its own (a slow
        callback never delays the renewal of other leases)."""
        with self._lock:
            already = self._lost_reason
            if already is None:
                self._callbacks.append(callback)
        if already is not None:
            _run_callbacks([callback], self, already)

    def renewed(self, sent_at: float, expires_at: _dt.datetime | None = None) -> None:
        """A renewal sent at ``sent_at`` (monotonic) matched: the lease is ours for a ttl from then (the
        store calls this; ``expires_at``: the server's new expiry, when the reply carried it)."""
        with self._lock:
            if self._lost_reason is None:
                self._deadline = max(self._deadline, sent_at + local_ttl(self.ttl))
                if expires_at is not None:
                    self.expires_at = expires_at

    def handed_over(self) -> bool:
        """The lease is given away by a store command of its own (reserved for a parked run, given back
        unrun): from now on not this object's to renew or release. False if it was released already."""
        with self._lock:
            if self._released:
                return False
            self._released = True
            return True

    def mark_lost(self, reason: str, *, release: bool = True) -> bool:
        """Declare the lease lost (its renewals failed, or one matched nothing); False if it already was,
        or was released. ``release=True`` also releases its token in the background, in case a late copy
        of a renewal or of the acquire lands; pass False when the token was seen not to match."""
        with self._lock:
            if self._lost_reason is not None or self._released:
                return False
            self._lost_reason = reason
            callbacks = list(self._callbacks)
        self._lost_event.set()
        log_renew.warning("lease %r (fence %s) lost: %s", self.key, self.fence, reason)
        self.store.forget(self)
        if self.pid == os.getpid():
            self.store.record_lost(self, reason)
        if release and self.pid == os.getpid():
            # Make sure the token frees the key once MongoDB answers (a late copy of a renewal or of the
            # acquire must not leave it taken for nobody). Not needed when the token was seen not to match.
            # (``maybe``: a lost lease's run is not remembered as over; its body may not have started,
            # and a retry of it must still run.)
            self.store.release_later(
                self.key, self.owner, self.store.clock.monotonic() + self.ttl, quiet=True, maybe=True
            )
        _run_callbacks([*self.store.lost_callbacks, *callbacks], self, reason)
        return True

    # -- operations ----------------------------------------------------------------------------------
    def renew(self) -> None:
        """Extend the lease by its ttl from now (server time).

        Raises ``LeaseLost`` if it is no longer ours, ``StoreUnavailable`` if MongoDB did not answer
        (the lease is then still ours until its deadline).
        """
        if self.pid != os.getpid():
            raise LeaseLost(self.key, self.fence, f"it belongs to process {self.pid}, not this forked child")
        self.raise_if_lost()
        sent = self.store.clock.monotonic()
        matched = self.store.renew_lease(self)
        if not matched:
            self.mark_lost(
                "renewal matched nothing: released by force, or expired and taken over", release=False
            )
            raise LeaseLost(self.key, self.fence, self._lost_reason or "lost")
        self.renewed(sent)

    def release(self) -> bool:
        """Give the lease back. True if it was ours to release; False if already lost or released.

        If MongoDB cannot be reached, the release is retried in the background until the lease would
        have expired anyway, and ``StoreUnavailable`` is raised.
        """
        if self.pid != os.getpid():
            log_release.debug(
                "lease %r belongs to process %s; not released from this child", self.key, self.pid
            )
            return False
        with self._lock:
            if self._released:
                return False
            self._released = True
            was_lost = self._lost_reason is not None
        self.store.forget(self)
        if was_lost:
            return False  # its release is already queued (see mark_lost)
        released = self.store.release_lease(self)
        if self.ambiguous_until is not None and self.store.clock.monotonic() < self.ambiguous_until:
            # A delayed copy of the acquire could still land and take the key again with our token.
            self.store.release_later(self.key, self.owner, self.ambiguous_until, quiet=True)
        return released

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.release()
        except StoreUnavailable as exc:  # queued for background release; do not mask the block's error
            log_release.warning("%s", exc)

    def __repr__(self) -> str:
        state = "released" if self._released else ("lost" if self._lost_reason else "held")
        slot = "" if self.slot is None else f" slot={self.slot}"
        return f"<Lease {self.key!r} fence={self.fence}{slot} owner={self.owner[:8]} {state}>"
