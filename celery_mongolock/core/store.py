"""Leases on MongoDB: ``LeaseStore`` (one document per key, taken and kept by owner token, judged on the
server's clock), a façade over the parts that each own one concern:

* ``store_connection``: the client per process (fork safety), the collections and their indexes,
  MongoDB's errors in our words (``operation``), ``close``;
* ``store_acquire``: ``try_acquire`` (the acquire algorithm, one round trip: see that module), ``acquire``,
  ``admit``; ``store_wait``: ``wait_free``; ``store_hold``: ``hold``; ``reentry``: the holds of each
  owner (reentrant holds);
* ``store_release``: renewals and releases, the heartbeat's background releases, ``release_held_by``,
  ``force_release``;
* ``store_handoffs``: the callbacks that publish the runs a command of this process handed a key to;
* ``store_queue``: the upkeep of parked runs (reservations, unparking, the sweeper's commands,
  ``run_ended``, written results), whose verbs ``LeaseStore`` has from ``store_parked.ParkedRuns``;
* ``store_history``: the lease history (records, ``why``, ``history``) and reads (``inspect``, ``list``).

This module imports pymongo only (no Celery): the Celery glue sits on top of it. The lease document, its
fencing token and every filter and pipeline sent are in ``documents``; the ``Lease`` value object is in
``lease``; the renewal thread is in ``heartbeat``.
"""

from __future__ import annotations

import builtins
import contextlib
import os
from collections.abc import Collection as _Collection
from collections.abc import Mapping, Sequence
from typing import Any

from pymongo import MongoClient, ReadPreference
from pymongo.collection import Collection
from pymongo.read_preferences import _ServerMode
from pymongo.write_concern import WriteConcern

from celery_mongolock.core.clock import Clock, SystemClock
from celery_mongolock.core.documents import base as documents
from celery_mongolock.core.documents.base import MAX_INFO_BYTES, Document
from celery_mongolock.core.heartbeat import Heartbeat
from celery_mongolock.core.history import KeyStory, LeaseEnding
from celery_mongolock.core.keys import normalize_key, user_key
from celery_mongolock.core.lease import Lease, LeaseInfo, LostCallback, local_ttl
from celery_mongolock.core.lease_watch import LeaseWatch
from celery_mongolock.core.reentry import Holds
from celery_mongolock.core.store_acquire import Acquisition
from celery_mongolock.core.store_connection import CLOSE_SECONDS, Connection, checked_settings
from celery_mongolock.core.store_handoffs import HandoffCallback, Handoffs
from celery_mongolock.core.store_history import Records
from celery_mongolock.core.store_hold import acquire_reentrant
from celery_mongolock.core.store_hold import hold as _hold
from celery_mongolock.core.store_parked import ParkedRuns
from celery_mongolock.core.store_queue import QueueUpkeep
from celery_mongolock.core.store_release import Releases
from celery_mongolock.core.store_spill import DEFAULT_WINDOW, Spill, validate_window
from celery_mongolock.core.store_wait import wait_free
from celery_mongolock.core.urls import validate_client_options, validate_mongo_url
from celery_mongolock.core.validation import (
    DEFAULT_HISTORY_DAYS,
    DEFAULT_LEASE_SECONDS,
    MAX_LEASE_SECONDS,
    MIN_LEASE_SECONDS,
    validate_history_days,
    validate_lease_timing,
    validate_names,
    validate_seconds,
)
from celery_mongolock.exceptions import ConfigurationError

__all__ = [
    "DEFAULT_LEASE_SECONDS",
    "MAX_INFO_BYTES",
    "MAX_LEASE_SECONDS",
    "MIN_LEASE_SECONDS",
    "Lease",
    "LeaseInfo",
    "LeaseStore",
    "validate_lease_timing",
    "validate_names",
]

# Names this module had before its parts were split out (the lock-set checker imports ``_local_ttl``).
_local_ttl = local_ttl


class LeaseStore(ParkedRuns):
    """Leases in one MongoDB collection.

    ``client_or_url`` is a ``pymongo.MongoClient`` (used as is) or a MongoDB URL, from which a client is
    created lazily *per process*, so a store made before ``fork()`` is safe to use in the children.

    ``watch_leases=True``: where the server has change streams, each process watches the leases its
    heartbeat renews with one change stream and marks a lease lost as soon as it is force-released, taken
    over or deleted (``False``: at the heartbeat's next renewal only).

    ``parked_window``: the most ``Queue`` runs of one priority a key's lease document keeps parked (one
    lease, not ``limit=N`` or ``keys=``); runs parked behind them wait in the collection
    ``<collection>.parked``, one document per run, and move into the lease document as it empties: a
    key's queue may be as deep as the database holds, and parking or handing over costs the same at any
    depth.

    The store holds the settings and is a façade over its parts, each owning one concern (its methods
    delegate to them): ``connection`` (``Connection``: client, collections, indexes, errors, ``close``),
    ``acquisition`` (``Acquisition``: ``try_acquire``, ``acquire``, ``admit``; ``wait_free`` is in
    ``store_wait``), ``holds`` (``Holds``: what each owner holds, for reentrant holds),
    ``releases`` (``Releases``: renew, release, ``release_tokens``, ``release_later``,
    ``release_held_by``, ``force_release``), ``handoffs`` (``Handoffs``: ``add_handoff_callback`` and the
    publishing of handoffs), ``queue`` (``QueueUpkeep``: ``reserve``, ``unpark``, ``give_back``,
    ``keys_state``, the sweeper's commands, ``run_ended``, ``record_run_ending``, ``forget_results``) and
    ``spill`` (``Spill``: runs parked beyond the window), ``records`` (``Records``: the lease history,
    ``why``, ``history``, ``inspect``, ``list``). The parts
    call ``try_acquire``, ``clock`` and the other settings through the store.
    """

    def __init__(
        self,
        client_or_url: MongoClient[Document] | str,
        database: str = "celery_mongolock",
        collection: str = "leases",
        *,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        heartbeat_seconds: float | None = None,
        operation_timeout: float = 10.0,
        write_concern: WriteConcern | None = None,
        read_preference: _ServerMode | None = None,
        client_options: Mapping[str, Any] | None = None,
        clock: Clock | None = None,
        on_lost: LostCallback | None = None,
        history_days: float = DEFAULT_HISTORY_DAYS,
        watch_leases: bool = True,
        parked_window: int = DEFAULT_WINDOW,
    ) -> None:
        if isinstance(client_or_url, str):
            url: str | None = validate_mongo_url(client_or_url)
            given_client: MongoClient[Document] | None = None
        elif isinstance(client_or_url, MongoClient):
            url, given_client = None, client_or_url
        else:
            raise ConfigurationError(
                f"LeaseStore needs a MongoDB URL or a pymongo.MongoClient, got {type(client_or_url).__name__}"
            )
        validate_names(database, collection)
        checked_settings(write_concern, read_preference, client_options)
        if not isinstance(watch_leases, bool):
            raise ConfigurationError(f"watch_leases must be True or False, got {watch_leases!r}")
        #: Watch the leases held with one change stream per process, so that a loss is noticed at once.
        self.watch_leases = watch_leases
        self.database_name = database
        self.collection_name = collection
        self.lease_seconds, self.heartbeat_seconds = validate_lease_timing(lease_seconds, heartbeat_seconds)
        self.operation_timeout = validate_seconds(
            "operation_timeout", operation_timeout, low=0.1, high=3600.0
        )
        # Majority + journal by default: an acknowledged acquisition survives a failover (no rollback, no
        # second holder). w:majority alone does not imply j on every server.
        self.write_concern = write_concern or WriteConcern(w="majority", j=True)
        self.read_preference = read_preference or ReadPreference.PRIMARY
        self.client_options = validate_client_options(client_options or {})
        #: Days the history collection keeps a lease's record (0: no history collection; the lease
        #: documents' ``ends`` are kept either way).
        self.history_days = validate_history_days(history_days)
        self.clock: Clock = clock or SystemClock()
        self._lost_callbacks: builtins.list[LostCallback] = [on_lost] if on_lost else []
        self.connection = Connection(self, url, given_client)
        self.handoffs = Handoffs()
        self.spill = Spill(self, validate_window(parked_window))
        self.handoffs.after_reply = self.spill.refill_if_low
        self.records = Records(self)
        self.releases = Releases(self)
        self.queue = QueueUpkeep(self)
        self.acquisition = Acquisition(self)
        self.holds = Holds()

    # -- connections (per process): ``connection`` -----------------------------------------------------
    @property
    def client(self) -> MongoClient[Document]:
        """This process's MongoClient (created on first use when the store was given a URL)."""
        return self.connection.client

    @property
    def collection(self) -> Collection[Document]:
        return self.connection.collection

    @property
    def history_collection_name(self) -> str:
        """``<collection>.history``: one record per ended lease and view (see ``history``)."""
        return self.connection.history_collection_name

    @property
    def history_collection(self) -> Collection[Document]:
        return self.connection.history_collection

    @property
    def url(self) -> str | None:
        """The URL with credentials masked (None when the store was given a client)."""
        return self.connection.url

    def close(self, timeout: float = CLOSE_SECONDS) -> None:
        """Release the leases the heartbeat keeps, stop it, and close the client this store created
        (a client given to the store is left open), all within ``timeout`` seconds whatever MongoDB does.

        A lease whose release gets no answer in time stays on the server until it expires there (on the
        server's clock): nobody else takes it early."""
        timeout = validate_seconds("timeout", timeout, low=0.01, high=3600.0)
        self.connection.close(timeout, self.release_held)

    def release_held(self, timeout: float = CLOSE_SECONDS, *, unrun: bool = False) -> int:
        """Release every lease this process holds with a heartbeat from this store, all within
        ``timeout`` seconds (a worker's shutdown); return how many were released. A lease whose release
        gets no answer in time is left to expire on the server's clock. ``unrun``: a task run's lease
        still held at its process's exit is given back unrun (``give_back``, with its beat tick)."""
        return self.releases.release_held(timeout, unrun=unrun)

    def __enter__(self) -> LeaseStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = self.url or "<client>"
        return f"<LeaseStore {where} {self.database_name}.{self.collection_name}>"

    def operation(
        self, action: str, timeout: float | None = None, *, retryable: bool = False
    ) -> contextlib.AbstractContextManager[None]:
        """Run MongoDB calls under one deadline (pymongo CSOT); turn driver errors into ``StoreUnavailable``.

        With ``retryable=True`` (acquire's own retry loop) errors after which the outcome is unknown are
        passed through as they are, for the caller to retry with the same owner token.
        """
        return self.connection.operation(action, timeout, retryable=retryable)

    def ensure_indexes(self) -> None:
        """Create the TTL index on ``gc_at``, the index on ``owner``, the one on ``wq`` (keys with
        parked runs) and the one on ``hs.o`` (the slots of ``limit=N`` keys) (idempotent,
        concurrent-safe); drop the TTL index on ``expires_at`` of earlier versions, which could delete a
        lease document that holds parked runs.

        Called automatically before the first acquire in each process.
        """
        self.connection.ensure_indexes()

    def has_writable_server(self) -> bool:
        """True if the driver currently knows a primary (no I/O): the heartbeat's budget depends on it."""
        return self.connection.has_writable_server()

    # -- acquire: ``acquisition`` ----------------------------------------------------------------------
    # The shapes sent are built by ``documents``; these names stay for code (benchmarks) that uses them.
    _acquire_pipeline = staticmethod(documents.acquire_pipeline)
    _renew_pipeline = staticmethod(documents.renew_pipeline)
    _release_pipeline = staticmethod(documents.release_pipeline)

    def acquire(
        self,
        key: str,
        ttl: float | None = None,
        *,
        info: Mapping[str, Any] | None = None,
        heartbeat: bool = False,
        heartbeat_seconds: float | None = None,
        min_hold: float = 0.0,
        tick: int | None = None,
        hold_until_ms: int | None = None,
        limit: int | None = None,
        reentrant: bool = False,
    ) -> Lease | None:
        """Try once to take ``key`` for ``ttl`` seconds (default: the store's ``lease_seconds``).

        Returns the ``Lease``, or ``None`` if someone else holds the key. ``info`` is stored with the
        holder (e.g. task name and id). With ``heartbeat=True`` the process's heartbeat thread keeps
        the lease alive until it is released. ``min_hold`` keeps the key taken for at least that many
        seconds from acquisition even if released sooner (ShedLock's lock-at-least-for);
        ``hold_until_ms`` (epoch milliseconds, server time) is the same as an absolute time, e.g. the end
        of a schedule tick. ``tick`` (an increasing int, such as a scheduled time in ms) makes the
        acquisition once-per-tick: refused for a tick at or before the last tick that took this key.
        ``limit=N`` (N > 1): up to N holds of the key at once, each in a slot of its own
        (``lease.slot``), with fences that strictly increase over all of them; ``min_hold``, ``tick`` and
        ``hold_until_ms`` are for single leases only. Raises ``StoreUnavailable`` if MongoDB cannot be
        reached: a lease is never assumed.

        ``reentrant=True``: a ``celery_mongolock.ReentrantHold`` at once when the caller holds ``key``
        through this store already (see ``hold``). The default, False, is one try like anyone else's (a
        second acquire of a held key returns None): a lease from ``acquire`` has no scope.
        """
        user_key(key)  # (not a set's gate)
        if reentrant is not False:
            return acquire_reentrant(
                self,
                key,
                ttl,
                info=info,
                heartbeat=heartbeat,
                heartbeat_seconds=heartbeat_seconds,
                plain=not min_hold and tick is None and hold_until_ms is None,
                limit=limit,
                reentrant=reentrant,
            )
        lease, _ = self.try_acquire(
            key,
            ttl,
            info=info,
            heartbeat=heartbeat,
            heartbeat_seconds=heartbeat_seconds,
            min_hold=min_hold,
            tick=tick,
            hold_until_ms=hold_until_ms,
            limit=limit,
        )
        return lease

    def try_acquire(
        self,
        key: str,
        ttl: float | None,
        *,
        info: Mapping[str, Any] | None = None,
        heartbeat: bool = False,
        heartbeat_seconds: float | None = None,
        min_hold: float = 0.0,
        tick: int | None = None,
        hold_until_ms: int | None = None,
        admission: Mapping[str, Any] | None = None,
        waited_ms: int | None = None,
        waited_since_ms: int | None = None,
        limit: int | None = None,
        ended_runs: Sequence[str] = (),
    ) -> tuple[Lease | None, Document | None]:
        """One acquire (with its retries on an ambiguous outcome): ``(lease, None)`` when taken, else
        ``(None, the document)`` (``Acquisition.try_acquire``)."""
        return self.acquisition.try_acquire(
            key,
            ttl,
            info=info,
            heartbeat=heartbeat,
            heartbeat_seconds=heartbeat_seconds,
            min_hold=min_hold,
            tick=tick,
            hold_until_ms=hold_until_ms,
            admission=admission,
            waited_ms=waited_ms,
            waited_since_ms=waited_since_ms,
            limit=limit,
            ended_runs=ended_runs,
        )

    def admit(
        self,
        key: str,
        entry: Mapping[str, Any],
        *,
        ttl: float | None = None,
        claim: str | None = None,
        timeout: float | None = None,
        max_length: int | None = None,
        replace: bool = False,
        debounce: float | None = None,
        due: bool = False,
        max_wait: float | None = None,
        min_hold: float = 0.0,
        info: Mapping[str, Any] | None = None,
        heartbeat: bool = False,
        heartbeat_seconds: float | None = None,
        limit: int | None = None,
        group: str | None = None,
        cancel: bool = False,
    ) -> tuple[Lease | None, Document]:
        """Admit a run of a queued task (one ``findAndModify``): take ``key``, claim the handoff
        ``claim``, or park the run; ``(lease, document)``, the outcome in ``lo`` (``Acquisition.admit``).
        ``cancel`` (``Replace(cancel_running=True)``): a run parked behind a running holder supersedes
        it too."""
        return self.acquisition.admit(
            key,
            entry,
            ttl=ttl,
            claim=claim,
            timeout=timeout,
            max_length=max_length,
            replace=replace,
            debounce=debounce,
            due=due,
            max_wait=max_wait,
            min_hold=min_hold,
            info=info,
            heartbeat=heartbeat,
            heartbeat_seconds=heartbeat_seconds,
            limit=limit,
            group=group,
            cancel=cancel,
        )

    def wait_free(
        self, key: str, timeout: float, *, poll_interval: float = 0.05, max_poll_interval: float = 1.0
    ) -> bool:
        """Block until ``key`` looks free or ``timeout`` passes; True if it is worth trying to acquire. Wakes
        at once when the lease document changes (a change stream, where the server has them) and at the
        holder's expiry; without change streams it polls with backoff, ``max_poll_interval`` apart at most."""
        return wait_free(self, key, timeout, poll_interval=poll_interval, max_poll_interval=max_poll_interval)

    def hold(
        self,
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
    ) -> contextlib.AbstractContextManager[Lease]:
        """Hold ``key`` while the ``with`` block runs, renewed by the heartbeat thread.

        Waits up to ``wait`` seconds for the key (woken by its release, see ``wait_free``), then raises
        ``LockContended`` naming the holder. The lease is released when the block exits, however it
        exits. Inside the block, ``lease.lost`` (or ``lease.raise_if_lost()``) tells whether the lease
        was lost; a block that ends normally after its lease was lost raises ``LeaseLost`` on exit.
        ``limit=N``: hold one of the key's N slots (as ``acquire``).

        Reentrant (the default): an owner (this store, and this thread or the running singleton run)
        that holds ``key`` already gets a ``celery_mongolock.ReentrantHold`` of its lease at once, with no
        command; ``reentrant=False``: an acquisition like anyone else's, ``LockContended`` at once (not
        waiting for itself) when the key is held.
        """
        user_key(key)  # (not a set's gate)
        return _hold(
            self,
            key,
            ttl,
            wait=wait,
            info=info,
            heartbeat_seconds=heartbeat_seconds,
            poll_interval=poll_interval,
            max_poll_interval=max_poll_interval,
            limit=limit,
            reentrant=reentrant,
        )

    def hold_count(self, key: str) -> int:
        """How many holds of ``key`` the caller (this thread, or the running singleton run) has open
        through this store: its lease and the reentrant holds of it (0: none). No MongoDB command."""
        return self.holds.count(normalize_key(key))

    # -- renew / release: ``releases`` -----------------------------------------------------------------
    def renew_lease(self, lease: Lease) -> bool:
        """Extend ``lease`` once, now (``Lease.renew`` calls this); True if it was still ours."""
        return self.releases.renew_lease(lease)

    def renew_many(self, leases: builtins.list[Lease], timeout: float | None = None) -> builtins.list[Lease]:
        """Renew all ``leases`` in one round trip; return those found lost, marked lost
        (``Releases.renew_many``)."""
        return self.releases.renew_many(leases, timeout)

    def mark_superseded(self, leases: builtins.list[Lease], timeout: float | None = None) -> int:
        """Read which of ``leases`` a newer send superseded, and mark them; how many were marked (the
        heartbeat's fallback for the lease watch, ``Releases.mark_superseded``)."""
        return self.releases.mark_superseded(leases, timeout)

    def release_lease(self, lease: Lease) -> bool:
        """Send the release of ``lease`` (``Lease.release`` calls this); True if it was still ours.

        With runs parked on the key, the same command hands the key to the oldest, and this process
        publishes that run (``add_handoff_callback``). If MongoDB does not answer, the release is retried
        in the background until the lease's deadline and ``StoreUnavailable`` is raised.
        """
        return self.releases.release_lease(lease)

    def release_tokens(
        self,
        tokens: _Collection[str],
        timeout: float | None = None,
        *,
        unconfirmed: _Collection[str] = (),
        superseded: Mapping[str, str] | None = None,
    ) -> int:
        """Release the leases of these owner tokens in one round trip (``Releases.release_tokens``)."""
        return self.releases.release_tokens(tokens, timeout, unconfirmed=unconfirmed, superseded=superseded)

    def release_later(
        self,
        key: str,
        token: str,
        until: float,
        *,
        quiet: bool = False,
        maybe: bool = False,
        superseded_by: str | None = None,
    ) -> None:
        """Release ``token`` on ``key`` from the heartbeat thread as soon as MongoDB answers, until ``until``
        (monotonic); ``maybe``, ``superseded_by``: ``Heartbeat.release_later``."""
        self.releases.release_later(key, token, until, quiet=quiet, maybe=maybe, superseded_by=superseded_by)

    def release_held_by(self, **holder: Any) -> int:
        """Release every lease whose holder info matches all of ``holder`` (e.g. ``task_id=..., pid=...``).

        For a supervisor that knows a process died holding leases (Celery's worker parent, when a child
        is killed), so the keys are free at once instead of at expiry; a key with parked runs goes to the
        oldest (published by this process). Returns how many were released.
        """
        return self.releases.release_held_by(**holder)

    def force_release(self, key: str) -> bool:
        """Release ``key`` whoever holds it (an operator's tool). True if it was held.

        The holder finds out at its next renewal (its lease becomes lost). The fence is kept, so the
        next acquisition still gets a larger one. A key with parked runs goes to the oldest.
        """
        return self.releases.force_release(key)

    # -- handoffs: ``handoffs`` ------------------------------------------------------------------------
    def add_handoff_callback(self, callback: HandoffCallback) -> None:
        """Call ``callback(key, entry)`` for every handoff a command of this process made and must
        publish (the Celery glue publishes the handed run's message). Without one, the sweeper of a
        worker publishes it."""
        self.handoffs.add_callback(callback)

    # -- history and reading: ``records`` --------------------------------------------------------------
    def record_lost(self, lease: Lease, reason: str) -> None:
        """Queue the holder's own view of a lease it lost ("lost", with the reason) for the history."""
        self.records.record_lost(lease, reason)

    def write_history(
        self,
        records: builtins.list[Document],
        copies: Sequence[Document] = (),
        timeout: float | None = None,
    ) -> int:
        """Insert history records and copy the endings of the lease documents ``copies`` match; return
        how many were new (``Records.write_history``)."""
        return self.records.write_history(records, copies, timeout)

    def flush_history(self, timeout: float | None = None) -> bool:
        """Insert the history records this process has queued now, instead of at the heartbeat's next
        tick (at a worker process's shutdown); False if MongoDB did not answer (they stay queued)."""
        return self.records.flush_history(timeout)

    def note_kind_wait(self, key: str, task_id: str, name: str, wants: str, since_ms: int | None) -> None:
        """Note that run ``task_id`` waits on ``key``, in use as the other kind (``documents.kind_waits``)."""
        self.records.note_kind_wait(key, task_id, name, wants, since_ms)

    def why(self, key: str, *, parked_limit: int | None = None) -> KeyStory | None:
        """Why ``key`` is (not) running (``celery mongolock why``): its lease document in one command, the
        newest history records in a second (runs that ended while parked are only there); None if it has
        no lease document. ``parked_limit``: read only the first that many parked runs."""
        return self.records.why(key, parked_limit=parked_limit)

    def history(self, key: str, limit: int = 20) -> builtins.list[LeaseEnding]:
        """How the last ``limit`` leases of ``key`` ended, newest first (``celery mongolock history``).

        The history collection (kept ``history_days``) merged with the lease document's ``ends`` (the
        last 8 endings, written by the ending commands themselves: they are there even when the process
        that ended a lease was killed before writing its history), one entry per acquisition (fence).
        """
        return self.records.history(key, limit)

    def inspect(self, key: str, *, parked_from: int = 0, parked_limit: int | None = None) -> LeaseInfo | None:
        """The lease document for ``key`` (held or not), or None if there is none. With ``parked_limit``,
        only that many of its parked runs, from position ``parked_from`` (0: the next to run), are read
        (the server cuts them out of a deep queue); ``LeaseInfo.parked_total`` says how many there are."""
        return self.records.inspect(key, parked_from=parked_from, parked_limit=parked_limit)

    def list(
        self, prefix: str | None = None, *, include_free: bool = False, parked_limit: int | None = None
    ) -> builtins.list[LeaseInfo]:
        """Leases whose key starts with ``prefix`` (all when None): held ones, or with runs parked, unless
        ``include_free``; ``parked_limit``: at most that many parked runs read per key (``inspect``)."""
        return self.records.list(prefix, include_free=include_free, parked_limit=parked_limit)

    # -- heartbeat -----------------------------------------------------------------------------------
    @property
    def heartbeat(self) -> Heartbeat:
        """This process's heartbeat (renewal) thread for this store, created on first use."""
        return self.connection.heartbeat(lambda: Heartbeat(self))

    def lease_watch(self, heartbeat: Heartbeat) -> LeaseWatch | None:
        """The change stream that tells ``heartbeat`` of a loss at once (None with ``watch_leases=False``)."""
        return LeaseWatch(self, lambda: heartbeat.leases, heartbeat.check_now) if self.watch_leases else None

    def held_leases(self) -> builtins.list[Lease]:
        """The leases this process holds with a heartbeat from this store (none if it never started one)."""
        hb = self.connection.started_heartbeat
        if hb is None or hb.pid != os.getpid():
            return []
        return hb.leases

    def forget(self, lease: Lease) -> None:
        """Stop renewing ``lease`` (it was released or lost); a released one is nobody's hold any more."""
        if lease.released:
            self.holds.forget(lease)
        hb = self.connection.started_heartbeat
        if hb is not None and lease.pid == os.getpid():
            hb.discard(lease)

    @property
    def lost_callbacks(self) -> Sequence[LostCallback]:
        """Called (each from a thread of its own) for every lease of this store that is lost."""
        return tuple(self._lost_callbacks)

    def add_lost_callback(self, callback: LostCallback) -> None:
        """Call ``callback(lease, reason)`` whenever a lease of this store is lost."""
        self._lost_callbacks.append(callback)
