"""The heartbeat: one renewal thread per process (per store), all held leases in one round trip a tick.

The thread is created lazily on first use and is never inherited across ``fork()``: the store checks the
pid and a child builds its own. It sleeps on ``Event.wait`` (no busy loop), wakes on every change, and
each tick:

1. marks lost every lease whose local deadline is within the give-up margin (renewals kept failing);
2. renews all the others with a single ``update`` matched on their owner tokens;
3. retries background releases (of ambiguous acquires and of releases that failed) until they succeed
   or the lease they were for has expired anyway;
4. (only without a lease watch streaming) reads whether a newer send superseded a holder of
   ``Replace(cancel_running=True)`` (one read, only when such a lease is held);
5. inserts the lease history records queued since the last tick (the endings of leases this process
   ended, and its own view of leases it lost) in one ``insert_many``: writing the history never adds a
   round trip to a task's path. Queued records have a schedule of their own besides: they wait at most
   the store's heartbeat interval, even while short runs keep putting the renewal tick off.

A failed tick is retried sooner than the normal interval, so a blip costs little of the lease.

Where the server has change streams, the heartbeat also starts one watcher (``lease_watch``) with its
first lease: one stream for all the leases it renews, which marks a lease lost as soon as its document
shows it gone (a force release, a takeover, a deletion), without waiting for the next tick. The renewals
stay as they are: the watcher only brings the news sooner, and asks for a tick at once (``check_now``)
when its stream failed and may have missed something.

The heartbeat sees its store only through ``RenewalStore`` (renew many leases, release tokens, is a
primary known) and holds it by a weak reference, so a store that is dropped stops its heartbeat.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    from celery_mongolock.core.clock import Clock
    from celery_mongolock.core.lease import Lease
    from celery_mongolock.core.lease_watch import LeaseWatch

__all__ = ["Heartbeat", "RenewalStore", "give_up_margin"]

log = logging.getLogger("celery_mongolock.heartbeat")

#: At most this many history records wait for MongoDB; beyond, the oldest are dropped (their endings
#: are still in the lease documents' ``ends``).
MAX_QUEUED_RECORDS = 10_000
#: The longest an explicit ``flush_history()`` without a timeout waits for a history write under way.
FLUSH_WAIT_S = 10.0

#: How late pymongo may notice a server-selection deadline (it re-checks every 0.5 s), plus a little.
_SELECTION_SLACK = 0.55


def give_up_margin(lease: Lease) -> float:
    """How long before its deadline a lease whose renewals keep failing is declared lost.

    Giving up early leaves the task time to notice and stop before anyone else can take the key.
    """
    return min(lease.ttl * 0.1, 2.0, lease.heartbeat_seconds)


class _Pending(NamedTuple):
    """A release left to the heartbeat thread (``Heartbeat.release_later``)."""

    key: str
    until: float  # monotonic: give up then
    maybe: bool  # a copy of an acquire may still land: keep releasing until ``until``
    superseded_by: str | None  # the holder's body stopped for this newer send (its ending's ``for``)


class RenewalStore(Protocol):
    """What the heartbeat needs from a lease store (``LeaseStore`` implements it)."""

    @property
    def clock(self) -> Clock: ...

    @property
    def operation_timeout(self) -> float: ...

    @property
    def heartbeat_seconds(self) -> float:
        """The store's default renewal interval: queued history records wait at most this long."""
        ...

    def lease_watch(self, heartbeat: Heartbeat) -> LeaseWatch | None:
        """The change-stream watcher for ``heartbeat``'s leases (None: turned off, or not possible)."""
        ...

    def has_writable_server(self) -> bool:
        """True if the driver currently knows a primary (no I/O)."""
        ...

    def renew_many(self, leases: list[Lease], timeout: float | None = None) -> list[Lease]:
        """Renew ``leases`` in one round trip; mark lost and return those that no longer matched."""
        ...

    def mark_superseded(self, leases: list[Lease], timeout: float | None = None) -> int:
        """Read which of ``leases`` a newer send superseded, and mark them; return how many."""
        ...

    def release_tokens(
        self,
        tokens: Collection[str],
        timeout: float | None = None,
        *,
        unconfirmed: Collection[str] = (),
        superseded: Mapping[str, str] | None = None,
    ) -> int:
        """Release the leases of these owner tokens in one round trip; return how many were released.
        ``unconfirmed``: tokens whose acquire never answered (their run is not remembered as over).
        ``superseded``: tokens whose body stopped for a newer send, with its task id (``for``)."""
        ...

    def write_history(
        self,
        records: list[dict[str, Any]],
        copies: Sequence[dict[str, Any]] = (),
        timeout: float | None = None,
    ) -> int:
        """Insert history records, and copy the endings of the lease documents ``copies`` match; records
        already stored are skipped. Return how many were new."""
        ...


class Heartbeat:
    """Keeps a store's leases alive from one daemon thread."""

    def __init__(self, store: RenewalStore) -> None:
        self._store = weakref.ref(store)
        self._clock = store.clock
        self._pid = os.getpid()
        self._leases: dict[str, Lease] = {}
        self._pending: dict[str, _Pending] = {}  # token -> (key, give up at, maybe, superseded by)
        self._history: list[dict[str, Any]] = []  # history records to insert at the next tick
        self._copies: list[dict[str, Any]] = []  # lease documents whose endings to copy at the next tick
        self._history_delay = store.heartbeat_seconds
        self._history_due: float | None = None  # monotonic time to write the queued history by
        self.history_written = 0
        self._lock = threading.Lock()
        # One history write at a time: a flush asked for while this thread's own write is under way waits
        # for it, so that what was queued before the flush is in the collection when it returns.
        self._flush_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._tick_lock = threading.Lock()
        self._next_tick: float | None = None
        self.ticks = 0
        self.failures = 0
        #: The change-stream watcher of this heartbeat's leases (None: turned off for the store).
        self.watch = store.lease_watch(self)

    # -- registry ------------------------------------------------------------------------------------
    def add(self, lease: Lease) -> None:
        """Keep ``lease`` alive from now on; its first renewal is one heartbeat interval away."""
        due = self._clock.monotonic() + lease.heartbeat_seconds
        with self._lock:
            # With nothing else to renew, a tick still scheduled for a lease since released would renew
            # this one early, for nothing: start the schedule afresh from this lease.
            idle = not self._leases and not self._pending
            self._leases[lease.owner] = lease
            planned = self._next_tick
            if planned is None or due < planned or idle:
                self._next_tick = due
        self._ensure_thread()
        # Wake the thread only when it must tick sooner than it planned to wake: a wake-up for every
        # lease is a thread switch on each task's path (the thread re-reads a later schedule by itself).
        if planned is None or due < planned:
            self._wake.set()
        if self.watch is not None:
            self.watch.notify()

    def check_now(self) -> None:
        """Renew every lease at once (one tick now, not at its time): the watcher may have missed a loss."""
        with self._lock:
            if not self._leases:
                return
            self._next_tick = self._clock.monotonic()
        self._ensure_thread()
        self._wake.set()

    def discard(self, lease: Lease) -> None:
        with self._lock:
            self._leases.pop(lease.owner, None)

    def release_later(
        self, key: str, token: str, until: float, *, maybe: bool = False, superseded_by: str | None = None
    ) -> None:
        """Release ``token`` on ``key`` as soon as MongoDB answers, and give up at ``until``.

        ``maybe=True``: a copy of an acquire may still land; keep releasing until ``until`` (a short
        window: the server gives up on the command after its deadline). Otherwise one successful
        release settles it. ``superseded_by``: the holder's body stopped for this newer send; the
        release's ending says so (``for``), as the release it stands in for would have.
        """
        with self._lock:
            old = self._pending.get(token)
            if old is not None:
                maybe = maybe or old.maybe
                until = max(until, old.until)
                superseded_by = superseded_by or old.superseded_by
            self._pending[token] = _Pending(key, until, maybe, superseded_by)
            self._next_tick = self._clock.monotonic()
        self._ensure_thread()
        self._wake.set()

    def record(self, record: dict[str, Any]) -> None:
        """Queue a history record for the next tick (never a round trip of its own, never sooner)."""
        self._queue_history(record, None)

    def copy_endings(self, match: dict[str, Any]) -> None:
        """Copy the endings of the lease documents ``match`` selects into the history at the next tick."""
        self._queue_history(None, match)

    def _queue_history(self, record: dict[str, Any] | None, match: dict[str, Any] | None) -> None:
        with self._lock:
            if record is not None:
                self._history.append(record)
                if len(self._history) > MAX_QUEUED_RECORDS:
                    del self._history[: len(self._history) - MAX_QUEUED_RECORDS]
            if match is not None:
                self._copies.append(match)
            # The history has a schedule of its own: a renewal tick that comes first writes it too, but
            # back-to-back short runs put the renewal tick off again and again (see ``add``).
            wake = False
            if self._history_due is None:
                due = self._history_due = self._clock.monotonic() + self._history_delay
                wake = self._next_tick is None or due < self._next_tick
        self._ensure_thread()
        if wake:
            self._wake.set()  # the thread may be waiting for a later tick, or for nothing: let it re-plan

    def flush_history(self, timeout: float | None = None) -> bool:
        """Insert the queued history records now; False (records kept for the next try) if MongoDB did
        not answer. A write under way (this thread's tick) is waited for first, within ``timeout`` (10 s
        when None): False if it is still under way then."""
        start = self._clock.monotonic()
        if not self._flush_lock.acquire(timeout=FLUSH_WAIT_S if timeout is None else max(0.0, timeout)):
            return False
        try:  # (within what is left of ``timeout``)
            left = None if timeout is None else max(0.05, timeout - (self._clock.monotonic() - start))
            return self._flush_history(left)
        finally:
            self._flush_lock.release()

    def _flush_history(self, timeout: float | None) -> bool:
        store = self._store()
        if store is None:  # the store was dropped: so is what it queued, and this heartbeat stops
            self._stopped.set()
            return True
        with self._lock:
            records, self._history = self._history, []
            copies, self._copies = self._copies, []
            self._history_due = None
        if not (records or copies):
            return True
        try:
            written = store.write_history(records, copies, timeout=timeout)
        except Exception as exc:
            log.debug("writing %d history record(s) failed, will retry: %s", len(records), exc)
            with self._lock:  # back in front of those queued meanwhile, the oldest dropped beyond the cap
                self._history[:0] = records
                del self._history[: max(0, len(self._history) - MAX_QUEUED_RECORDS)]
                self._copies[:0] = copies
                self._history_due = self._clock.monotonic() + min(1.0, self._history_delay)
            return False
        self.history_written += written
        return True

    def _flush_history_budget(self) -> bool:
        """``flush_history`` within what the held leases can spare (never more than 2 s)."""
        give_up = self._earliest_give_up()
        budget = 2.0 if give_up is None else max(0.05, min(2.0, give_up - self._clock.monotonic()))
        # Never waits behind another thread's flush (it writes what was queued; the rest waits a tick):
        # this thread renews the leases.
        if not self._flush_lock.acquire(blocking=False):
            with self._lock:  # look again a little later, not at once (no spin while the other writes)
                self._history_due = self._clock.monotonic() + min(1.0, self._history_delay)
            return True
        try:
            return self._flush_history(budget)
        finally:
            self._flush_lock.release()

    @property
    def pid(self) -> int:
        """The process this heartbeat belongs to (it is never inherited across ``fork()``)."""
        return self._pid

    @property
    def leases(self) -> list[Lease]:
        with self._lock:
            return list(self._leases.values())

    @property
    def thread(self) -> threading.Thread | None:
        """The renewal thread (None until the first lease, record or pending release starts it)."""
        return self._thread

    def stop(self, timeout: float = 5.0) -> None:
        self._stopped.set()
        self._wake.set()
        if self.watch is not None:
            self.watch.stop(min(timeout, 2.0))
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
                history_due = self._history_due
            if next_tick is None and history_due is None:
                self._wake.wait()  # nothing to do until a lease, a pending release or a record arrives
                self._wake.clear()
                continue
            now = self._clock.monotonic()
            delay = min(t for t in (next_tick, history_due) if t is not None) - now
            if delay > 0:
                self._wake.wait(delay)
                self._wake.clear()
                continue  # re-read the schedule: add() may have moved it earlier
            if next_tick is None or next_tick > now:
                # Only the history is due: write it, and leave the renewals to their own schedule.
                try:
                    self._flush_history_budget()
                except Exception:  # pragma: no cover - flush_history catches what the store raises
                    log.exception("writing the lease history failed")
                continue
            try:
                ok = self.tick()
            except Exception:  # never let the thread die: leases would silently stop renewing
                log.exception("heartbeat tick failed")
                ok = False
            interval = self._interval()
            give_up = self._earliest_give_up()
            with self._lock:
                if interval is None:
                    self._next_tick = None
                else:
                    # After a failure retry soon (but never in a busy loop); else at the normal pace. Never
                    # later than the moment a lease must be given up, so that it is given up on time.
                    step = interval if ok else min(interval, max(0.05, interval / 4))
                    due = self._clock.monotonic() + step
                    self._next_tick = due if give_up is None else min(due, give_up)

    def _earliest_give_up(self) -> float | None:
        with self._lock:
            leases = list(self._leases.values())
        times = [lease.deadline - give_up_margin(lease) for lease in leases if not lease.released]
        return min(times) if times else None

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
                lease.mark_lost("renewals failed until just before the lease's deadline")
            elif not lease.lost:
                renew.append(lease)
        ok = True
        if renew:
            # The renewal must answer before the first lease has to be given up, not at its deadline.
            give_up_at = min(lease.deadline - give_up_margin(lease) for lease in renew)
            budget = give_up_at - now
            try:
                # With no reachable primary, pymongo's server selection only notices its deadline every
                # 0.5 s: leave that much slack, or the renewal would overrun the give-up time.
                if not store.has_writable_server():
                    budget -= _SELECTION_SLACK
                    if budget < 0.05:
                        raise TimeoutError("no reachable primary, and too little time left to wait for one")
                store.renew_many(renew, timeout=max(0.05, min(store.operation_timeout, budget)))
                self._read_supersessions(store, renew, budget)
            except Exception as exc:  # StoreUnavailable, or anything unexpected: retry soon
                ok = False
                self.failures += 1
                log.warning(
                    "renewal of %d lease(s) failed, will retry: %s: %s", len(renew), type(exc).__name__, exc
                )
                after = self._clock.monotonic()
                for lease in renew:
                    if after >= lease.deadline - give_up_margin(lease):
                        lease.mark_lost("renewals failed until just before the lease's deadline")
        if self._pending:
            ok = self._flush_pending(store, now) and ok
        if self._history or self._copies:
            ok = self._flush_history_budget() and ok
        return ok

    def _read_supersessions(self, store: RenewalStore, renewed: list[Lease], budget: float) -> None:
        """Without a lease watch streaming (a server without change streams, or a stream that failed), a
        holder that a newer send may supersede (``Replace(cancel_running=True)``) learns of it here, at
        the tick: one read, only for such leases."""
        if self.watch is not None and self.watch.watching:
            return
        asking = [lease for lease in renewed if lease.notice_supersession and not lease.superseded]
        if not asking:
            return
        try:
            store.mark_superseded(asking, timeout=max(0.05, min(store.operation_timeout, budget)))
        except Exception as exc:  # the renewal went through; the next tick reads again
            log.warning("reading supersessions failed, will retry: %s: %s", type(exc).__name__, exc)

    def _flush_pending(self, store: RenewalStore, now: float) -> bool:
        """Send every pending release in one update; never for longer than the leases can spare."""
        with self._lock:
            for token, pend in list(self._pending.items()):
                if now >= pend.until:
                    del self._pending[token]
            pending = dict(self._pending)
        if not pending:
            return True
        give_up = self._earliest_give_up()
        budget = 2.0 if give_up is None else max(0.05, min(2.0, give_up - self._clock.monotonic()))
        try:
            unconfirmed = [token for token, pend in pending.items() if pend.maybe]
            told = {token: pend.superseded_by for token, pend in pending.items() if pend.superseded_by}
            released = store.release_tokens(
                list(pending), timeout=budget, unconfirmed=unconfirmed, superseded=told
            )
        except Exception as exc:
            log.debug("background release of %d lease(s) failed, will retry: %s", len(pending), exc)
            return False
        with self._lock:
            for token, pend in pending.items():
                if not pend.maybe:
                    self._pending.pop(token, None)
            if released:  # their endings are in the lease documents: copy them into the history too
                self._copies.append({"_id": {"$in": sorted({pend.key for pend in pending.values()})}})
        if released:
            log.info("background release: %d lease(s) released", released)
        return True
