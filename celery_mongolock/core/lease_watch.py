"""Loss noticed at once: one change stream per process (per store) watching the leases it holds.

The heartbeat learns that a lease is gone only at its next renewal, up to a heartbeat interval later.
Where the server has change streams (replica sets, the embedded server), the heartbeat starts this
watcher with its first lease: a daemon thread with one stream on the lease collection, whatever the
number of leases held, filtered on the server to the changes that can end a lease of this process
(``documents.changes.loss_events_pipeline``: no renewal passes, nor another process's release). For
each event on a key this process holds, the document as it is now (``updateLookup``; one read when the
event has none, e.g. a deletion) is compared with the lease's token and fence
(``documents.changes.holds``); a lease whose token is gone from a document at least as new as its
acquisition is marked lost, on the same path a renewal that matched nothing takes (``Lease.mark_lost``:
``lease.lost``, ``raise_if_lost``, the lost callbacks and the ``lease_lost`` signal). A lease still held
whose document marks its holder superseded by a newer send (``Replace(cancel_running=True)``: ``cx``) is
marked superseded (``Lease.mark_superseded``).

Polling stays the safety net: the heartbeat renews as before, so nothing depends on the stream. When the
server has no change streams (a standalone mongod: ``IllegalOperation``), the watcher says so once and
stops for good. When the stream fails, it is reopened with backoff, resumed after the last event seen
where the server still has it, and the heartbeat is asked for one renewal at once so that a loss that
happened meanwhile is noticed now, not at the next tick. A stream opened for a new batch of leases starts
from just before the earliest acquisition it serves, so nothing between an acquisition and the opening of
the stream is missed (an old event is harmless: see ``holds``).

With no lease held for ``IDLE_CLOSE_SECONDS`` the stream is closed (a worker between runs keeps it; an
idle process does not keep a cursor open on the server).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from bson import Timestamp
from pymongo.errors import OperationFailure, PyMongoError

from celery_mongolock.core.documents import changes

if TYPE_CHECKING:
    import contextlib

    from pymongo.change_stream import CollectionChangeStream
    from pymongo.collection import Collection

    from celery_mongolock.core.clock import Clock
    from celery_mongolock.core.lease import Lease

__all__ = ["IDLE_CLOSE_SECONDS", "NO_CHANGE_STREAMS", "LeaseWatch", "WatchedStore"]

log = logging.getLogger("celery_mongolock.heartbeat")

#: Server error codes that say change streams are not available here (not a passing fault): a standalone
#: server (40573 IllegalOperation), change streams disabled (136), no permission (13 Unauthorized).
NO_CHANGE_STREAMS = frozenset({40573, 136, 13})
#: Server error codes that say a resume token cannot be resumed from: the history it points into is gone
#: (286 ChangeStreamHistoryLost, 280 ChangeStreamFatalError), or the token is not one (260, 9).
RESUME_LOST = frozenset({286, 280, 260, 9})
#: How long the server holds each ``getMore`` open waiting for a change (the stream's wake-up interval
#: when nothing happens; an event is returned as soon as it is written).
AWAIT_MS = 1000
#: With no lease held this long, the stream is closed (reopened with the next lease).
IDLE_CLOSE_SECONDS = 30.0
#: Backoff between attempts to reopen a failed stream.
RETRY_MIN_SECONDS, RETRY_MAX_SECONDS = 0.2, 5.0
_READ_FIELDS = {"owner": 1, "fence": 1, "hs.o": 1, "forced_release": 1, "cx": 1}


class WatchedStore(Protocol):
    """What the watcher needs from a lease store (``LeaseStore`` implements it)."""

    @property
    def clock(self) -> Clock: ...

    @property
    def operation_timeout(self) -> float: ...

    @property
    def collection(self) -> Collection[dict[str, Any]]: ...

    def operation(self, action: str, timeout: float | None = None) -> contextlib.AbstractContextManager[None]:
        """Run MongoDB calls under one deadline; driver errors become ``StoreUnavailable``."""
        ...


class LeaseWatch:
    """One change stream for the leases of one heartbeat (``leases``: the ones it renews now; ``check``:
    ask the heartbeat for a renewal at once)."""

    def __init__(
        self, store: WatchedStore, leases: Callable[[], list[Lease]], check: Callable[[], None]
    ) -> None:
        self._store = weakref.ref(store)
        self._clock = store.clock
        self._leases = leases
        self._check = check
        self._pid = os.getpid()
        #: None until a stream was tried; then whether the server has change streams.
        self.available: bool | None = None
        self.streams_opened = 0
        self.events = 0  # events that passed the server's filter
        self.losses = 0  # leases this watcher marked lost
        self.supersessions = 0  # holders this watcher told that a newer send superseded them
        self.failures = 0  # streams that failed (to open, or later)
        self._token: Mapping[str, Any] | None = None
        self._stream: CollectionChangeStream[dict[str, Any]] | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    @property
    def watching(self) -> bool:
        """True while a stream is open."""
        return self._stream is not None

    def notify(self) -> None:
        """A lease was added: start the thread if it is not running, and let it open its stream."""
        if self.available is False or self._stopped.is_set() or self._pid != os.getpid():
            return
        t = self._thread
        if t is None or not t.is_alive():
            with self._lock:
                t = self._thread
                if (t is None or not t.is_alive()) and not self._stopped.is_set():
                    t = threading.Thread(target=self._run, name="celery_mongolock-lease-watch", daemon=True)
                    self._thread = t
                    t.start()
        if self._stream is None:
            self._wake.set()

    def stop(self, timeout: float = 2.0) -> None:
        self._stopped.set()
        self._wake.set()
        stream = self._stream
        if stream is not None:  # cut a getMore the server holds open short (the server kills the cursor)
            try:
                stream.close()
            except Exception as exc:  # pragma: no cover - a dead connection: the thread ends by itself
                log.debug("closing the lease watch: %s", exc)
        t = self._thread
        if t is not None and t is not threading.current_thread() and t.is_alive():
            t.join(timeout)

    # -- the loop ------------------------------------------------------------------------------------
    def _run(self) -> None:
        retry = RETRY_MIN_SECONDS
        idle_since: float | None = None
        failed = False  # the last stream failed: a reopened one asks the heartbeat for a renewal
        try:
            while not self._stopped.is_set() and self._store() is not None:
                held = self._held()
                if not held:
                    idle_since = idle_since if idle_since is not None else self._clock.monotonic()
                    if self._stream is None or self._clock.monotonic() - idle_since >= IDLE_CLOSE_SECONDS:
                        self._close()
                        self._token = None  # nothing held: the next stream starts at its first lease
                        self._wake.wait(None if self._stream is None else IDLE_CLOSE_SECONDS)
                        self._wake.clear()
                        continue
                else:
                    idle_since = None
                if self._stream is None:
                    opened = self._open(held, after_failure=failed)
                    if opened is None:  # no change streams here: the heartbeat polls, as before
                        return
                    if not opened:
                        self._wake.wait(retry)
                        self._wake.clear()
                        retry = min(RETRY_MAX_SECONDS, retry * 2)
                        failed = True
                        continue
                    retry, failed = RETRY_MIN_SECONDS, False
                if not self._next_event():
                    failed = True
        except Exception:  # never die silently: the heartbeat still notices every loss at its tick
            log.exception("the lease watcher stopped; leases lost are noticed at the heartbeat's tick")
        finally:
            self._close()

    def _held(self) -> list[Lease]:
        return [lease for lease in self._leases() if not lease.released and not lease.lost]

    def _open(self, held: list[Lease], *, after_failure: bool) -> bool | None:
        """Open the stream: True, False (a fault: try again later), None (no change streams here)."""
        store = self._store()
        if store is None:
            return False
        options: dict[str, Any] = {"full_document": "updateLookup", "max_await_time_ms": AWAIT_MS}
        if self._token is not None:
            options["resume_after"] = self._token
        else:
            since = _earliest_acquisition(held)
            if since is not None:
                options["start_at_operation_time"] = since
            elif held:
                after_failure = True  # a lease of unknown acquisition time: the heartbeat looks at once
        try:
            collection = store.collection
            pipeline = changes.loss_events_pipeline(*_holder_of(held))
            try:
                stream = collection.watch(pipeline, **options)
            except OperationFailure as exc:
                if exc.code not in RESUME_LOST or "resume_after" not in options:
                    raise
                # The resume point is gone from the server's history: start afresh, and let the heartbeat
                # look at every lease at once for what the gap may have hidden.
                self._token = None
                options.pop("resume_after")
                stream = collection.watch(pipeline, **options)
                after_failure = True
        except OperationFailure as exc:
            if exc.code in NO_CHANGE_STREAMS:
                self.available = False
                log.info(
                    "no change streams on this server (code %s): leases lost are noticed at the heartbeat's "
                    "tick",
                    exc.code,
                )
                return None
            return self._failed("opening the lease watch failed", exc)
        except Exception as exc:  # a network error, no primary (the store's client errors included)
            return self._failed("opening the lease watch failed", exc)
        self.available = True
        self._stream = stream
        self.streams_opened += 1
        log.debug("lease watch opened (%d lease(s) held)", len(held))
        if after_failure:
            self._check()
        return True

    def _failed(self, what: str, exc: BaseException) -> bool:
        self._close()
        if self._stopped.is_set():  # the store is closing: its stream was closed under the getMore
            return False
        self.failures += 1
        log.warning("%s, retrying (the heartbeat polls meanwhile): %s: %s", what, type(exc).__name__, exc)
        return False

    def _close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            try:
                stream.close()
            except Exception as exc:  # pragma: no cover - closing a dead cursor
                log.debug("closing the lease watch: %s", exc)

    def _next_event(self) -> bool:
        """Wait up to ``AWAIT_MS`` for one event and act on it; False if the stream failed."""
        stream = self._stream
        if stream is None:
            return True
        try:
            event = stream.try_next()
            token = stream.resume_token
        except PyMongoError as exc:
            return self._failed("the lease watch failed", exc)
        if token is not None:
            self._token = token
        if event is None:
            if not stream.alive:  # invalidated (collection dropped): open a new one
                self._close()
                self._check()
            return True
        self.events += 1
        try:
            self.on_event(event)
        except Exception as exc:  # a read that failed: the heartbeat decides, at once
            log.warning("checking a change of a held lease failed: %s: %s", type(exc).__name__, exc)
            self._check()
        return True

    def on_event(self, event: Mapping[str, Any]) -> None:
        """Mark lost every lease of this process that ``event`` shows gone (``documents.changes.holds``)."""
        kind = event.get("operationType")
        if kind in changes.STREAM_END_TYPES:
            self._check()
            return
        key = (event.get("documentKey") or {}).get("_id")
        mine = [lease for lease in self._held() if lease.key == key]
        store = self._store()
        if not mine or store is None:
            return
        doc = event.get("fullDocument") if kind in ("update", "replace") else None
        if doc is None:  # a deletion, or a document gone since: it may be from before our acquisition
            with store.operation(f"read lease {key!r}", timeout=store.operation_timeout):
                doc = store.collection.find_one({"_id": key}, _READ_FIELDS)
        for lease in mine:
            verdict = changes.holds(doc, lease.owner, lease.fence, lease.slot)
            if verdict == changes.Verdict.GONE:
                if lease.mark_lost(changes.loss_reason(doc, lease.fence), release=False):
                    self.losses += 1
                continue
            by = changes.superseded_by(doc, lease.owner) if lease.notice_supersession else None
            if by is not None and lease.mark_superseded(by):
                self.supersessions += 1


def _holder_of(leases: list[Lease]) -> tuple[str | None, int | None]:
    """The ``host`` and ``pid`` every one of ``leases`` is stored with (this process's, unless a holder's
    info overrode them); (None, None) when they differ: the stream then passes every change that can end a
    lease."""
    pairs = {(lease.holder.get("host"), lease.holder.get("pid")) for lease in leases}
    if len(pairs) != 1:
        return None, None
    [(host, pid)] = pairs
    if not isinstance(host, str) or not isinstance(pid, int):
        return None, None
    return host, pid


def _earliest_acquisition(leases: list[Lease]) -> Timestamp | None:
    """The server time (a second before) of the earliest acquisition among ``leases``, for a stream that
    must see every change since; None when one of them has no acquisition time known."""
    times = [lease.acquired_at for lease in leases]
    if not times or any(t is None for t in times):
        return None
    earliest = min(t for t in times if t is not None)
    return Timestamp(max(1, int(earliest.timestamp()) - 1), 0)
