"""Leases on MongoDB: the operations of ``LeaseStore`` (one document per key, taken and kept by owner
token, judged on the server's clock).

This module imports pymongo only (no Celery): the Celery glue sits on top of it. The lease document, its
fencing token and every filter and pipeline sent are in ``_documents``; the ``Lease`` value object is in
``lease``; the renewal thread is in ``heartbeat``.

The acquire algorithm (one round trip)
======================================
1. A fresh owner token is drawn for every acquisition.
2. One ``findAndModify`` with ``{_id: key}``, ``upsert: true`` and an *update pipeline*
   (``_documents.acquire_pipeline``) that, on the server, computes
   ``free = owner is null OR expires_at <= $$NOW OR owner == token`` and, only when free, sets owner,
   ttl, holder, ``expires_at = $$NOW + ttl`` and ``fence = max(fence + 1, $$NOW in ms * 1000)``; when
   not free every field is left as it was. Expiry is therefore judged on the server clock, inside the
   same atomic write; no client clock is involved.
3. The document after the update says who holds the key: our token means acquired, anything else is
   contention (the holder's details are reported), not an error.
4. If the reply is lost (network error, timeout, primary step-down) the *same* command with the *same*
   token is sent again: the ``owner == token`` clause makes the retry take over our own half-finished
   acquisition instead of seeing it as contention. If no retry gets through, the token is handed to the
   heartbeat thread, which releases it as soon as the server answers, so an ambiguous acquire never
   blocks the key until expiry for nothing.
5. Concurrent upserts of a missing key may collide on ``_id`` (``DuplicateKeyError``): the loser
   simply repeats step 2, which now sees the winner's document.

Release sets ``owner`` to null (matching ``{_id, owner}``) and keeps the document, so the fence survives;
renewal re-computes ``expires_at = $$NOW + ttl_ms`` for every lease the process holds in one
``update`` matched on their owner tokens.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime as _dt
import logging
import math
import os
import random
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from collections.abc import Collection as _Collection
from typing import Any

import pymongo
from pymongo import MongoClient, ReadPreference, ReturnDocument
from pymongo.collection import Collection
from pymongo.errors import (
    AutoReconnect,
    BulkWriteError,
    ConnectionFailure,
    DuplicateKeyError,
    ExecutionTimeout,
    NetworkTimeout,
    OperationFailure,
    PyMongoError,
    ServerSelectionTimeoutError,
    WriteConcernError,
    WTimeoutError,
)
from pymongo.read_preferences import _ServerMode
from pymongo.write_concern import WriteConcern

from celery_mongolock.core.clock import Clock, SystemClock
from celery_mongolock.core.documents import base as documents
from celery_mongolock.core.documents import queue as admission_docs
from celery_mongolock.core.documents import slot_queue as slot_admission
from celery_mongolock.core.documents import slots as slots_docs
from celery_mongolock.core.documents.base import MAX_INFO_BYTES, Document
from celery_mongolock.core.heartbeat import Heartbeat
from celery_mongolock.core.history import KeyStory, LeaseEnding, merge_endings
from celery_mongolock.core.keys import normalize_key
from celery_mongolock.core.lease import Lease, LeaseInfo, LostCallback, aware, local_ttl
from celery_mongolock.core.outcomes import RUN_ENDED_PROJECTION, run_ended
from celery_mongolock.core.urls import describe_refusal, redact, validate_client_options, validate_mongo_url
from celery_mongolock.core.validation import (
    DEFAULT_HISTORY_DAYS,
    DEFAULT_LEASE_SECONDS,
    MAX_LEASE_SECONDS,
    MIN_LEASE_SECONDS,
    validate_history_days,
    validate_lease_timing,
    validate_limit,
    validate_names,
    validate_seconds,
)
from celery_mongolock.exceptions import ConfigurationError, LeaseLost, LockContended, StoreUnavailable

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

# A name this module had before the lease core was split into modules (the lock-set checker imports it).
_local_ttl = local_ttl
#: What a release of a ``limit=N`` slot returns: enough to publish the handoffs it made.
SLOT_HANDOFF_PROJECTION: Document = {"hs": 1, "fence": 1, "sup": 1, "lim": 1}

#: ``callback(key, entry, document)``: publish the run a command of this process handed ``key`` to.
HandoffCallback = Callable[[str, Document, Document], None]

#: Seconds ``LeaseStore.close()`` and ``release_held()`` may take at most, whatever MongoDB does.
CLOSE_SECONDS = 1.0

log_acquire = logging.getLogger("celery_mongolock.acquire")
log_release = logging.getLogger("celery_mongolock.release")
log_renew = logging.getLogger("celery_mongolock.renew")
log_history = logging.getLogger("celery_mongolock.history")

#: Holder info fields and the ending fields they are recorded as (``_documents.ending_expr``).
_ENDING_FIELDS = {
    "task_id": "t",
    "task_name": "n",
    "delivery": "run",
    "host": "host",
    "pid": "pid",
    "worker": "worker",
}


def _ended_for(holder: Mapping[str, Any]) -> Document:
    """The lease documents with a ``holder-died`` ending for ``holder`` in ``ends``: found again at the
    heartbeat's tick even if the key has been taken again meanwhile (its ``holder`` replaced)."""
    fields = {_ENDING_FIELDS.get(name): value for name, value in holder.items()}
    if None in fields:  # a holder field that endings do not record: match the documents' holder
        return {f"holder.{name}": value for name, value in holder.items()}
    return {"ends": {"$elemMatch": {"how": "holder-died", **fields}}}


# Every store of the process, so that a forked child gets fresh locks: a lock another thread of the
# parent (a heartbeat, a release) held at the moment of fork would otherwise stay locked in the child.
_STORES: weakref.WeakSet[LeaseStore] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for store in list(_STORES):
        store._state_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)

# Errors after which we cannot know whether the server applied the write.
_AMBIGUOUS = (
    AutoReconnect,
    ConnectionFailure,
    NetworkTimeout,
    ExecutionTimeout,
    WTimeoutError,
    WriteConcernError,
)


class LeaseStore:
    """Leases in one MongoDB collection.

    ``client_or_url`` is a ``pymongo.MongoClient`` (used as is) or a MongoDB URL, from which a client is
    created lazily *per process*, so a store made before ``fork()`` is safe to use in the children.
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
    ) -> None:
        if isinstance(client_or_url, str):
            self._url: str | None = validate_mongo_url(client_or_url)
            self._given_client: MongoClient[Document] | None = None
        elif isinstance(client_or_url, MongoClient):
            self._url = None
            self._given_client = client_or_url
        else:
            raise ConfigurationError(
                f"LeaseStore needs a MongoDB URL or a pymongo.MongoClient, got {type(client_or_url).__name__}"
            )
        validate_names(database, collection)
        if write_concern is not None and not isinstance(write_concern, WriteConcern):
            raise ConfigurationError(
                f"write_concern must be a pymongo WriteConcern, got {type(write_concern).__name__}"
            )
        if read_preference is not None and not isinstance(read_preference, _ServerMode):
            raise ConfigurationError(
                f"read_preference must be a pymongo read preference, got {type(read_preference).__name__}"
            )
        if client_options is not None and not isinstance(client_options, Mapping):
            raise ConfigurationError(
                f"client_options must be a dict of MongoClient options, got {type(client_options).__name__}"
            )
        self.database_name = database
        self.collection_name = collection
        self.lease_seconds, self.heartbeat_seconds = validate_lease_timing(lease_seconds, heartbeat_seconds)
        self.operation_timeout = validate_seconds(
            "operation_timeout", operation_timeout, low=0.1, high=3600.0
        )
        if write_concern is None:
            # Majority + journal: an acknowledged acquisition survives a failover (no rollback, no
            # second holder). w:majority alone does not imply j on every server.
            write_concern = WriteConcern(w="majority", j=True)
        self.write_concern = write_concern
        self.read_preference = read_preference or ReadPreference.PRIMARY
        self.client_options = validate_client_options(client_options or {})
        #: Days the history collection keeps a lease's record (0: no history collection; the lease
        #: documents' ``ends`` are kept either way).
        self.history_days = validate_history_days(history_days)
        self.clock: Clock = clock or SystemClock()
        self._lost_callbacks: builtins.list[LostCallback] = [on_lost] if on_lost else []
        self._handoff_callbacks: builtins.list[HandoffCallback] = []
        self._state_lock = threading.Lock()
        self._pid = os.getpid()
        _STORES.add(self)
        self._client_cache: MongoClient[Document] | None = None
        self._indexes_ready = False
        self._heartbeat: Heartbeat | None = None
        # Heartbeat threads of this store that close() stopped but could not wait for: they get no new
        # client (one made after close() would never be closed).
        self._retired: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        self._host = socket.gethostname()

    # -- connections (per process) -------------------------------------------------------------------
    def _check_pid(self) -> None:
        pid = os.getpid()
        if pid != self._pid:
            # A forked child: the parent's client, heartbeat thread and index flag are not ours.
            with self._state_lock:
                if pid != self._pid:
                    self._client_cache = None
                    self._heartbeat = None
                    self._indexes_ready = False
                    self._pid = pid

    @property
    def client(self) -> MongoClient[Document]:
        """This process's MongoClient (created on first use when the store was given a URL)."""
        if self._given_client is not None:
            return self._given_client
        self._check_pid()
        client = self._client_cache
        if client is None:
            if threading.current_thread() in self._retired:
                raise StoreUnavailable(f"{self!r} was closed")
            with self._state_lock:
                client = self._client_cache
                if client is None:
                    options: dict[str, Any] = {
                        "appname": "celery_mongolock",
                        "serverSelectionTimeoutMS": int(self.operation_timeout * 1000),
                        "connectTimeoutMS": int(min(self.operation_timeout, 10.0) * 1000),
                        "tz_aware": True,
                    }
                    options.update(self.client_options)
                    assert self._url is not None
                    try:
                        client = MongoClient(self._url, **options)
                    except (PyMongoError, ValueError, TypeError, OSError) as exc:
                        raise ConfigurationError(
                            f"cannot create a MongoDB client: {redact(str(exc))}"
                        ) from None
                    self._client_cache = client
        return client

    @property
    def collection(self) -> Collection[Document]:
        return self.client[self.database_name].get_collection(
            self.collection_name, write_concern=self.write_concern, read_preference=self.read_preference
        )

    @property
    def history_collection_name(self) -> str:
        """``<collection>.history``: one record per ended lease and view (see ``history``)."""
        return f"{self.collection_name}.history"

    @property
    def history_collection(self) -> Collection[Document]:
        return self.client[self.database_name].get_collection(
            self.history_collection_name,
            write_concern=self.write_concern,
            read_preference=self.read_preference,
        )

    @property
    def url(self) -> str | None:
        """The URL with credentials masked (None when the store was given a client)."""
        return redact(self._url) if self._url else None

    def close(self, timeout: float = CLOSE_SECONDS) -> None:
        """Release the leases the heartbeat keeps, stop it, and close the client this store created
        (a client given to the store is left open), all within ``timeout`` seconds whatever MongoDB does.

        A lease whose release gets no answer in time stays on the server until it expires there (on the
        server's clock): nobody else takes it early.
        """
        timeout = validate_seconds("timeout", timeout, low=0.01, high=3600.0)
        deadline = time.monotonic() + timeout
        # One deadline (pymongo CSOT, nested ones only shorten it) for every MongoDB call below, the
        # driver's own endSessions in MongoClient.close() included: that one waited a whole
        # serverSelectionTimeoutMS for a server that was gone.
        with pymongo.timeout(timeout):
            try:
                hb = self._heartbeat
                if hb is not None and hb.pid == os.getpid():
                    self.release_held(timeout)
                    hb.stop(timeout=max(0.0, deadline - time.monotonic()))
                    if hb.thread is not None and hb.thread.is_alive():  # in a call MongoDB does not answer
                        self._retired.add(hb.thread)
                    # the records of leases that ended since the last tick
                    hb.flush_history(timeout=max(0.01, deadline - time.monotonic()))
            finally:
                # Whatever happened above (a release or flush that raised at the deadline), the client
                # and its sockets are closed: a store that is closed holds no connection.
                self._heartbeat = None
                client, self._client_cache = self._client_cache, None
                if client is not None and self._pid == os.getpid():
                    client.close()

    def release_held(self, timeout: float = CLOSE_SECONDS) -> int:
        """Release every lease this process holds with a heartbeat from this store, all within
        ``timeout`` seconds (a worker's shutdown); return how many were released. A lease whose release
        gets no answer in time is left to expire on the server's clock."""
        timeout = validate_seconds("timeout", timeout, low=0.01, high=3600.0)
        released = 0
        with pymongo.timeout(timeout):
            for lease in self.held_leases():
                try:
                    if lease.release():
                        released += 1
                except Exception as exc:
                    log_release.warning("could not release %r (it will expire): %s", lease.key, exc)
        return released

    def __enter__(self) -> LeaseStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = self.url or "<client>"
        return f"<LeaseStore {where} {self.database_name}.{self.collection_name}>"

    # -- error handling ------------------------------------------------------------------------------
    def _unavailable(self, action: str, exc: BaseException) -> StoreUnavailable:
        refused = self._refused(action, exc)
        if refused is not None:
            return refused
        return StoreUnavailable(
            f"MongoDB did not answer while trying to {action} "
            f"({self.database_name}.{self.collection_name}): {type(exc).__name__}: {redact(str(exc))[:500]}"
        )

    @contextlib.contextmanager
    def operation(
        self, action: str, timeout: float | None = None, *, retryable: bool = False
    ) -> Iterator[None]:
        """Run MongoDB calls under one deadline (pymongo CSOT); turn driver errors into ``StoreUnavailable``.

        With ``retryable=True`` (acquire's own retry loop) errors after which the outcome is unknown are
        passed through as they are, for the caller to retry with the same owner token.
        """
        try:
            with pymongo.timeout(timeout if timeout is not None else self.operation_timeout):
                yield
        except (DuplicateKeyError, LeaseLost, LockContended):
            raise
        except OperationFailure as exc:
            refused = self._refused(action, exc)
            if refused is not None:
                raise refused from None
            if retryable and (isinstance(exc, _AMBIGUOUS) or exc.has_error_label("RetryableWriteError")):
                raise
            raise self._unavailable(action, exc) from None
        except _AMBIGUOUS as exc:
            if retryable and not isinstance(exc, ServerSelectionTimeoutError):
                raise
            raise self._unavailable(action, exc) from None
        except PyMongoError as exc:
            raise self._unavailable(action, exc) from None

    def _refused(self, action: str, exc: BaseException) -> StoreUnavailable | None:
        """MongoDB's refusal of our login, rights or its TLS certificate, in our words (None if ``exc`` is
        not one); the server's own message, whose wording varies, is not shown."""
        client = self._given_client or self._client_cache
        credentials = None
        if self._url is not None:
            credentials = "@" in self._url.split("?", 1)[0] or any(
                k.lower() == "username" for k in self.client_options
            )
        why = describe_refusal(exc, client, self.database_name, credentials)
        if why is None:
            return None
        return StoreUnavailable(
            f"MongoDB refused to {action} ({self.database_name}.{self.collection_name}): {why}"
        )

    # -- indexes -------------------------------------------------------------------------------------
    def ensure_indexes(self) -> None:
        """Create the TTL index on ``gc_at``, the index on ``owner``, the one on ``wq`` (keys with
        parked runs) and the one on ``hs.o`` (the slots of ``limit=N`` keys) (idempotent,
        concurrent-safe); drop the TTL index on ``expires_at`` of earlier versions, which could delete a
        lease document that holds parked runs.

        Called automatically before the first acquire in each process.
        """
        coll = self.collection
        with self.operation("create lease indexes"):
            for spec, options in (
                ([("gc_at", pymongo.ASCENDING)], {"name": "gc_at_ttl", "expireAfterSeconds": 0}),
                ([("owner", pymongo.ASCENDING)], {"name": "owner"}),
                ([("wq", pymongo.ASCENDING)], {"name": "wq", "sparse": True}),
                # limit=N: the heartbeat finds a process's slots by hs.o (only keys with a limit have hs).
                ([("hs.o", pymongo.ASCENDING)], {"name": "hs_o", "sparse": True}),
            ):
                try:
                    coll.create_index(spec, **options)
                except OperationFailure as exc:
                    # 85 IndexOptionsConflict / 86 IndexKeySpecsConflict: someone made a different index
                    # of that name or keys. 68/"already exists" races between processes are benign.
                    if exc.code in (85, 86):
                        raise ConfigurationError(
                            f"collection {self.database_name}.{self.collection_name} has an index that "
                            f"conflicts with {options['name']!r}: {exc.details and exc.details.get('errmsg')}"
                        ) from None
                    if exc.code != 68:
                        raise
            try:
                coll.drop_index("expires_at_ttl")
            except OperationFailure as exc:
                if exc.code != 27:  # IndexNotFound: the usual case
                    raise
        if self.history_days:
            self._ensure_history_indexes()
        self._indexes_ready = True

    def _ensure_history_indexes(self) -> None:
        """The history collection's indexes: by key and fence, and the TTL index on the end (``e``) with
        ``expireAfterSeconds = history_days * 86400``; a changed ``history_days`` is applied with
        ``collMod``."""
        coll = self.history_collection
        ttl = int(self.history_days * 86400)
        with self.operation("create lease history indexes"):
            for spec, options in (
                ([("k", pymongo.ASCENDING), ("f", pymongo.DESCENDING)], {"name": "k_f"}),
                ([("e", pymongo.ASCENDING)], {"name": "e_ttl", "expireAfterSeconds": ttl}),
            ):
                try:
                    coll.create_index(spec, **options)
                except OperationFailure as exc:
                    if exc.code == 68:  # created meanwhile by another process
                        continue
                    current = {ix["name"]: ix for ix in coll.list_indexes()}.get(options["name"])
                    old = None if current is None else current.get("expireAfterSeconds")
                    if exc.code not in (85, 86) or "expireAfterSeconds" not in options or old is None:
                        raise ConfigurationError(
                            f"collection {self.database_name}.{self.history_collection_name} has an index "
                            f"that conflicts with {options['name']!r}: "
                            f"{exc.details and exc.details.get('errmsg')}"
                        ) from None
                    # Another history_days: apply ours (the setting says how long records are kept).
                    self.client[self.database_name].command(
                        {
                            "collMod": self.history_collection_name,
                            "index": {"name": "e_ttl", "expireAfterSeconds": ttl},
                        }
                    )
                    log_history.info(
                        "lease history: records now kept %g days (was %g)", self.history_days, old / 86400
                    )

    def _ready_collection(self) -> Collection[Document]:
        self._check_pid()
        if not self._indexes_ready:
            self.ensure_indexes()
        return self.collection

    # -- acquire -------------------------------------------------------------------------------------
    # The shapes sent are built by ``_documents``; these names stay for code (benchmarks) that uses them.
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
        """
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
        ``(None, the document)``. ``admission``: the keyword arguments of ``_admission.admit_pipeline``
        (a queued run's admit: the outcome is in the returned document's ``lo``). ``ended_runs``: a
        copy's run ids (not for an admission, which judges its copies itself): refused, even when free,
        when one of them is remembered as over (the duplicate guard, in the acquire itself)."""
        key = normalize_key(key)
        hold_s = validate_seconds("min_hold", min_hold, low=0.0, high=MAX_LEASE_SECONDS)
        if tick is not None and (isinstance(tick, bool) or not isinstance(tick, int)):
            raise ConfigurationError(f"tick must be an int, got {type(tick).__name__}")
        if hold_until_ms is not None and (
            isinstance(hold_until_ms, bool) or not isinstance(hold_until_ms, int)
        ):
            raise ConfigurationError(
                f"hold_until_ms must be an int (epoch ms), got {type(hold_until_ms).__name__}"
            )
        ttl_s, beat = validate_lease_timing(
            self.lease_seconds if ttl is None else ttl,
            heartbeat_seconds
            if heartbeat_seconds is not None
            else (self.heartbeat_seconds if ttl is None else None),
        )
        ttl_ms = int(ttl_s * 1000)
        holder = documents.holder_info(self._host, os.getpid(), info)
        token = uuid.uuid4().hex
        limit = validate_limit(limit)
        if limit is not None and hold_s:
            raise ConfigurationError("limit=N (N > 1) takes no minimum hold yet")
        projection: Document | None = documents.ACQUIRE_PROJECTION
        if limit is not None and admission is not None:
            pipeline = slot_admission.slot_admit_pipeline(
                token, ttl_ms, holder, limit, waited_ms=waited_ms, **admission
            )
            projection = admission_docs.ADMIT_PROJECTION
        elif limit is not None:
            if waited_since_ms is not None and waited_ms is None:
                waited_ms = max(0, int(time.time() * 1000) - waited_since_ms)
            # (A beat tick's hold_until_ms, the end of its window, is for single leases: a slot is held
            # while its run runs.)
            pipeline = slots_docs.slot_acquire_pipeline(
                token, ttl_ms, holder, limit, waited_ms=waited_ms, tick=tick, ended_runs=ended_runs
            )
            # With ``ends`` (at most 8): the endings of holds this acquire found expired go to the history.
            projection = {"q.m": 0, "seen": 0}
        elif admission is None:
            pipeline = documents.acquire_pipeline(
                token,
                ttl_ms,
                holder=holder,
                tick=tick,
                min_hold_ms=int(hold_s * 1000),
                hold_until_ms=hold_until_ms,
                waited_ms=waited_ms,
                waited_since_ms=waited_since_ms,
                ended_runs=ended_runs,
            )
        else:
            fields = documents.acquire_fields(
                token,
                ttl_ms,
                holder,
                min_hold_ms=int(hold_s * 1000),
                hold_until_ms=hold_until_ms,
                waited_ms=waited_ms,
                waited_since_ms=waited_since_ms,
            )
            pipeline = admission_docs.admit_pipeline(fields, token=token, **admission)
            projection = admission_docs.ADMIT_PROJECTION
        clock = self.clock
        give_up_at = clock.monotonic() + self.operation_timeout
        attempt = 0
        last_error: BaseException | None = None
        ambiguous = False  # some attempt may have reached the server with no answer back
        sent_at = clock.monotonic()
        doc: Document | None = None
        while True:
            attempt += 1
            remaining = give_up_at - clock.monotonic()
            if remaining <= 0:
                break
            try:
                coll = self._ready_collection()
                sent_at = clock.monotonic()
                with self.operation(f"acquire lease {key!r}", timeout=remaining, retryable=True):
                    doc = coll.find_one_and_update(
                        documents.acquire_filter(key),
                        pipeline,
                        projection=projection,
                        upsert=True,
                        return_document=ReturnDocument.AFTER,
                    )
                    if doc is None:
                        # Seen on the embedded server under contention: the update was applied but no
                        # document returned. Read it back; our token tells whether we got it.
                        primary = coll.with_options(read_preference=ReadPreference.PRIMARY)
                        doc = primary.find_one(documents.acquire_filter(key), projection)
                last_error = None
                break
            except DuplicateKeyError:
                # Two upserts of a missing key raced; the other insert won. Run again: now it matches.
                if attempt >= 5:
                    raise StoreUnavailable(f"acquire of {key!r} kept colliding on insert") from None
                continue
            except _AMBIGUOUS as exc:
                last_error = exc
                ambiguous = True
                log_acquire.info(
                    "acquire %r: ambiguous outcome (%s), retrying with the same token",
                    key,
                    type(exc).__name__,
                )
            except OperationFailure as exc:  # RetryableWriteError-labelled failures
                last_error = exc
                ambiguous = True
            except StoreUnavailable as exc:
                last_error = exc
                break
            clock.sleep(
                min(
                    0.05 * (2 ** min(attempt, 6)) * (0.5 + random.random()),
                    max(0.0, give_up_at - clock.monotonic()),
                )
            )

        # A copy of an attempt that got no answer may still be queued on the server and land later
        # (until the server gives up on it, a little after our deadline). Our token must not be left
        # holding the key for nobody: release it in the background during that window.
        landing_window = clock.monotonic() + self.operation_timeout + 5.0
        if last_error is not None:
            if ambiguous:
                self.release_later(key, token, landing_window, maybe=True)
            if isinstance(last_error, StoreUnavailable):
                raise last_error
            raise self._unavailable(f"acquire lease {key!r}", last_error) from None

        if admission is not None and doc is not None:
            doc["_admit_token"] = token  # a handoff this admit made is marked with admit_marker(token)
            outcome = doc.get("lo")
            if outcome == "dup" and ambiguous:
                doc["lo"] = "parked"  # an earlier attempt of this very admit parked the run
            mine = doc.get("owner") == token or any(
                h.get("o") == token for h in doc.get("hs") or [] if isinstance(h, dict)
            )
            if mine and outcome not in ("acquired", "claimed", "due"):
                doc["lo"] = "acquired"
        if limit is not None:
            return self._slot_lease(
                key, token, doc, ttl_s, beat, sent_at, holder, ambiguous, landing_window, heartbeat
            )
        if doc is None or doc.get("owner") != token:
            if doc is not None:
                log_acquire.debug("lease %r is held by %s", key, doc.get("holder"))
            if ambiguous:
                self.release_later(key, token, landing_window, quiet=True, maybe=True)
            return None, doc
        lease = Lease(
            self,
            key,
            token,
            fence=int(doc["fence"]),
            ttl=ttl_s,
            heartbeat_seconds=beat,
            expires_at=aware(doc.get("expires_at")),
            sent_at=sent_at,
            holder=holder,
            acquired_at=aware(doc.get("acquired_at")),
            waited_ms=doc.get("waited_ms"),
        )
        if ambiguous:
            lease.ambiguous_until = landing_window
        taken_over = documents.ended_by_takeover(doc)
        if taken_over is not None:
            self._record(documents.history_record(key, taken_over))
        log_acquire.info("acquired lease %r fence=%s ttl=%gs", key, lease.fence, ttl_s)
        if heartbeat:
            self.heartbeat.add(lease)
        return lease, doc

    def _slot_lease(  # noqa: PLR0917 - the acquire's state, handed over as is
        self,
        key: str,
        token: str,
        doc: Document | None,
        ttl_s: float,
        beat: float,
        sent_at: float,
        holder: Document,
        ambiguous: bool,
        landing_window: float,
        heartbeat: bool,
    ) -> tuple[Lease | None, Document | None]:
        """The outcome of a ``limit=N`` acquire, from its reply: our hold is in ``hs``, or the key is full."""
        for ending in documents.slots_expired_by(doc):
            self._record(documents.history_record(key, ending))
        if doc is not None:
            doc.pop("ends", None)
        mine = next((h for h in (doc or {}).get("hs") or [] if h.get("o") == token), None)
        if mine is None:
            if ambiguous:
                self.release_later(key, token, landing_window, quiet=True, maybe=True)
            return None, doc
        lease = Lease(
            self,
            key,
            token,
            fence=int(mine["f"]),
            ttl=ttl_s,
            heartbeat_seconds=beat,
            expires_at=aware(mine.get("x")),
            sent_at=sent_at,
            holder=holder,
            acquired_at=aware(mine.get("a")),
            waited_ms=mine.get("w"),
            slot=int(mine["s"]),
        )
        if ambiguous:
            lease.ambiguous_until = landing_window
        log_acquire.info("acquired lease %r slot %s fence=%s ttl=%gs", key, lease.slot, lease.fence, ttl_s)
        if heartbeat:
            self.heartbeat.add(lease)
        return lease, doc

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
        min_hold: float = 0.0,
        info: Mapping[str, Any] | None = None,
        heartbeat: bool = False,
        heartbeat_seconds: float | None = None,
        limit: int | None = None,
    ) -> tuple[Lease | None, Document]:
        """Admit a run of a queued task (one ``findAndModify``): take ``key``, claim the handoff
        ``claim``, or park the run (``entry``: ``id``, ``t``, ``s`` and the fields listed in
        ``_admission``; ``tk`` and ``ttl`` are filled in). Returns ``(lease, document)``; the outcome is
        the document's ``lo`` (``_admission.ADMIT_OUTCOMES``). ``timeout``: seconds the run may stay
        parked; ``max_length``: the longest queue (``full`` beyond); ``replace``: at most one parked
        run, a newer send supersedes it; ``debounce``: every run parks and may start only when no newer
        send came for that many seconds; ``due``: the run's own delayed copy, which takes the key for its
        entry once due; ``limit``: the key has N slots (``limit=N``), a parked run is handed any one. A
        handoff this admit made (the key was found free with older runs parked) is published
        (``add_handoff_callback``)."""
        for field in ("id", "t", "s"):
            if field not in entry:
                raise ConfigurationError(f"a parked entry needs {field!r}, got {sorted(entry)}")
        ttl_s = self.lease_seconds if ttl is None else ttl
        full_entry = dict(entry)
        full_entry.setdefault("tk", uuid.uuid4().hex)
        full_entry["ttl"] = int(ttl_s * 1000)
        timeout_ms = (
            None
            if timeout is None
            else int(validate_seconds("timeout", timeout, low=0.0, high=MAX_LEASE_SECONDS) * 1000)
        )
        # The holder names the run, so that a copy of its message is recognised while it runs.
        run_info = {"task_id": entry["t"], "task_name": entry.get("n"), "delivery": entry.get("r")}
        run_info = {k: v for k, v in run_info.items() if v is not None}
        lease, doc = self.try_acquire(
            key,
            ttl,
            info={**run_info, **(info or {})},
            heartbeat=heartbeat,
            heartbeat_seconds=heartbeat_seconds,
            min_hold=min_hold,
            admission={
                "entry": full_entry,
                "timeout_ms": timeout_ms,
                "claim": claim,
                "max_length": max_length,
                "replace": replace,
                "debounce_ms": int(debounce * 1000) if debounce else None,
                "due": due,
            },
            limit=limit,
        )
        doc = dict(doc or {})
        if lease is not None:
            doc.setdefault("lo", "acquired")
        key = normalize_key(key)
        handed = None
        admit_token = str(doc.get("_admit_token") or "")
        marker = admission_docs.admit_marker(admit_token) if admit_token else ""
        if limit is not None:
            # Any admit on a slotted key may hand free slots to parked runs (the command's last stages).
            handed = self._handed(key, doc, marker)
        elif lease is None and doc.get("lo") == "parked":
            handed = self._handed(key, doc, marker)
        if handed is not None and self.history_days:
            # The key was found vacant: an expired lease's ending may be in ``ends`` (same command).
            self.heartbeat.copy_endings({"_id": key})
        return lease, doc

    def wait_free(
        self, key: str, timeout: float, *, poll_interval: float = 0.05, max_poll_interval: float = 1.0
    ) -> bool:
        """Block until ``key`` looks free or ``timeout`` passes; True if it is worth trying to acquire.

        Wakes at once when the lease document changes (a MongoDB change stream, where the server has
        them), and at the holder's expiry; without change streams it polls with backoff, never sleeping
        longer than ``max_poll_interval`` between looks.
        """
        key = normalize_key(key)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout):
            raise ConfigurationError(f"timeout must be a number of seconds, got {timeout!r}")
        clock = self.clock
        give_up_at = clock.monotonic() + max(0.0, timeout)
        try:
            with self.operation(f"watch lease {key!r}", timeout=None):
                stream = self.collection.watch([{"$match": {"documentKey._id": key}}], max_await_time_ms=200)
        except (StoreUnavailable, OperationFailure, *_AMBIGUOUS):
            stream = None  # no change streams here (standalone server, permissions): poll instead
        interval = poll_interval
        try:
            while True:
                info = self.inspect(key)
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
                    except (PyMongoError, *_AMBIGUOUS):
                        stream = None
                else:
                    # Jittered, but never past max_poll_interval: that bounds how late a release is seen.
                    clock.sleep(min(nap, max_poll_interval, interval * (0.5 + random.random())))
                    interval = min(max_poll_interval, interval * 2)
        finally:
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.close()

    @contextlib.contextmanager
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
    ) -> Iterator[Lease]:
        """Hold ``key`` while the ``with`` block runs, renewed by the heartbeat thread.

        Waits up to ``wait`` seconds for the key (woken by its release, see ``wait_free``), then raises
        ``LockContended``
        naming the holder. The lease is released when the block exits, however it exits. Inside the
        block, ``lease.lost`` (or ``lease.raise_if_lost()``) tells whether the lease was lost; a block that
        ends normally after its lease was lost raises ``LeaseLost`` on exit.
        """
        wait_s = validate_seconds("wait", wait, low=0.0, high=MAX_LEASE_SECONDS)
        clock = self.clock
        give_up_at = clock.monotonic() + wait_s
        while True:
            lease, doc = self.try_acquire(
                key, ttl, info=info, heartbeat=True, heartbeat_seconds=heartbeat_seconds
            )
            if lease is not None:
                break
            remaining = give_up_at - clock.monotonic()
            if remaining <= 0 or not self.wait_free(
                key, remaining, poll_interval=poll_interval, max_poll_interval=max_poll_interval
            ):
                holder = (doc or {}).get("holder") or {}
                raise LockContended(normalize_key(key), holder, aware((doc or {}).get("expires_at")))
        with lease:
            yield lease
            if lease.lost:
                # The block ran (at least in part) without the lease: do not let it pass as protected.
                raise LeaseLost(lease.key, lease.fence, lease.lost_reason or "lost")

    # -- renew / release -----------------------------------------------------------------------------
    def renew_lease(self, lease: Lease) -> bool:
        """Extend ``lease`` once, now (``Lease.renew`` calls this); True if it was still ours."""
        if lease.slot is not None:
            return not self._renew_tokens(
                [lease], timeout=max(0.1, min(self.operation_timeout, lease.remaining))
            )
        with self.operation(
            f"renew lease {lease.key!r}", timeout=max(0.1, min(self.operation_timeout, lease.remaining))
        ):
            result = self.collection.update_one(
                documents.renew_filter(lease.key, lease.owner), documents.renew_pipeline()
            )
        log_renew.debug("renewed %r: matched=%s", lease.key, result.matched_count)
        return result.matched_count == 1

    def renew_many(self, leases: builtins.list[Lease], timeout: float | None = None) -> builtins.list[Lease]:
        """Renew all ``leases`` in one round trip, single leases and ``limit=N`` slots alike; return those
        found lost (and mark them lost).

        A second query is made only when the update renewed fewer documents than there are leases, or
        when one key holds two of them (a thread pool's two slots of one key: a renewed document then says
        only that one of them is live), to learn which are lost (see ``_renew_tokens``).
        """
        live = [lease for lease in leases if not lease.lost and not lease.released]
        if not live:
            return []
        sent = self.clock.monotonic()
        lost = self._renew_tokens(live, timeout=timeout)
        for lease in live:
            if lease not in lost:
                lease.renewed(sent)
            elif lease.slot is not None:
                lease.mark_lost(
                    "renewal found its slot gone: released by force, or expired and taken", release=False
                )
            else:
                lease.mark_lost(
                    "renewal matched nothing: released by force, or expired and taken over", release=False
                )
        return lost

    def _renew_tokens(
        self, leases: builtins.list[Lease], timeout: float | None = None
    ) -> builtins.list[Lease]:
        """One update renewing ``leases`` (both document shapes); return those no longer live.

        Single leases alone: the update matches only live ones (``documents.renew_tokens_filter``). With
        slots: the update modifies exactly the documents in which it renewed a lease (an expired lease is
        not revived and leaves its document unchanged). Either way, when each key holds one of
        ``leases``, a count equal to their number means every one was live and renewed. Otherwise (a
        lease lost, two renewals in one millisecond, two slots of one key) one read tells which are still
        live."""
        tokens = [lease.owner for lease in leases]
        one_per_key = len({lease.key for lease in leases}) == len(leases)
        slotted = any(lease.slot is not None for lease in leases)
        single = any(lease.slot is None for lease in leases)
        coll = self.collection
        with self.operation("renew leases", timeout=timeout):
            if not slotted:
                # Single leases only: the filter matches only the live ones (as before slots existed).
                result = coll.update_many(documents.renew_tokens_filter(tokens), documents.renew_pipeline())
                renewed = result.matched_count
            else:
                result = coll.update_many(
                    slots_docs.renew_tokens_filter(tokens, single=single, slots=True),
                    slots_docs.renew_tokens_pipeline(tokens, single=single),
                )
                renewed = result.modified_count
            if one_per_key and renewed == len(leases):
                return []  # every document held exactly one of them, live: all renewed
            primary = coll.with_options(read_preference=ReadPreference.PRIMARY)
            still = {
                token
                for d in primary.aggregate(slots_docs.live_tokens_pipeline(tokens))
                for token in d.get("live") or []
            }
        return [lease for lease in leases if lease.owner not in still]

    def release_lease(self, lease: Lease) -> bool:
        """Send the release of ``lease`` (``Lease.release`` calls this); True if it was still ours.

        With runs parked on the key, the same command hands the key to the oldest, and this process
        publishes that run (``add_handoff_callback``). If MongoDB does not answer, the release is retried
        in the background until the lease's deadline and ``StoreUnavailable`` is raised.
        """
        key, token = lease.key, lease.owner
        if lease.slot is not None:
            return self._release_slot(lease)
        by = self._handoff_by(token)
        try:
            with self.operation(f"release lease {key!r}"):
                doc = self.collection.find_one_and_update(
                    documents.release_filter(key, token),
                    documents.release_pipeline(by),
                    projection=admission_docs.HANDOFF_PROJECTION,
                    return_document=ReturnDocument.AFTER,
                )
            released = doc is not None
        except (*_AMBIGUOUS, StoreUnavailable, OperationFailure) as exc:
            self.release_later(key, token, lease.deadline)
            if isinstance(exc, StoreUnavailable):
                raise
            raise self._unavailable(f"release lease {key!r}", exc) from None
        log_release.info("released lease %r%s", key, "" if released else " (it was no longer ours)")
        if doc is not None:
            self._handed(key, doc, by)
        if released:
            self._record(self._local_ending(lease, "released"))
        elif lease.acquired_at is not None:
            self.record_lost(
                lease, "its release matched nothing: released by force, or expired and taken over"
            )
        return released

    def _release_slot(self, lease: Lease) -> bool:
        key, token = lease.key, lease.owner
        by = self._handoff_by(token)
        try:
            with self.operation(f"release lease {key!r} slot {lease.slot}"):
                doc = self.collection.find_one_and_update(
                    {"_id": key, "hs.o": token},
                    slot_admission.slot_release_handoff_pipeline([token], by),
                    projection=SLOT_HANDOFF_PROJECTION,
                    return_document=ReturnDocument.AFTER,
                )
        except (*_AMBIGUOUS, StoreUnavailable, OperationFailure) as exc:
            self.release_later(key, token, lease.deadline)
            if isinstance(exc, StoreUnavailable):
                raise
            raise self._unavailable(f"release lease {key!r}", exc) from None
        released = doc is not None
        log_release.info(
            "released lease %r slot %s%s", key, lease.slot, "" if released else " (it was no longer ours)"
        )
        if doc is not None:
            self._handed(key, doc, by)
        if released:
            self._record(self._local_ending(lease, "released"))
        return released

    # -- several keys per run under Queue (keys=) ----------------------------------------------------
    def reserve(self, lease: Lease, entry: Mapping[str, Any], *, timeout: float | None = None) -> bool:
        """Turn ``lease`` (taken by a run that needs several keys, in an attempt that found another of
        them held) into a reservation of its key for the run's parked ``entry`` (``id``, ``t``, ``s``,
        ``tk``, ``ks`` ...), in one command: the key is handed to the entry without being released, so
        the run keeps its place (``_admission.reserve_pipeline``). False if the lease was no longer ours
        (the run must admit that key again)."""
        full_entry = dict(entry)
        full_entry["ttl"] = int(lease.ttl * 1000)
        timeout_ms = (
            None
            if timeout is None
            else int(validate_seconds("timeout", timeout, low=0.0, high=MAX_LEASE_SECONDS) * 1000)
        )
        by = "reserve:" + uuid.uuid4().hex
        lease.handed_over()  # to the entry: not ours to renew or release
        self.forget(lease)  # (before the command: a renewal racing it would report the lease lost)
        # Ours, or already reserved for the entry by an attempt of this command whose reply was lost.
        match = {
            "_id": lease.key,
            "$or": [{"owner": lease.owner}, {"owner": entry["tk"], "ho.id": entry["id"]}],
        }
        doc: Document | None = None
        for attempt in range(3):
            try:
                with self.operation(f"reserve lease {lease.key!r}"):
                    doc = self.collection.find_one_and_update(
                        match,
                        admission_docs.reserve_pipeline(full_entry, timeout_ms, by),
                        projection={"_id": 1},
                    )
                break
            except StoreUnavailable:
                if attempt == 2:
                    raise
        log_acquire.info(
            "lease %r reserved for %s (%s)", lease.key, entry.get("t"), "kept" if doc else "lost"
        )
        return doc is not None

    def unpark(self, key: str, entry_id: str) -> None:
        """Remove the run ``entry_id`` from ``key``: its parked entry, or the handoff or reservation made
        to it (the key then goes to the next parked run, published by this process)."""
        key = normalize_key(key)
        by = self._handoff_by(uuid.uuid4().hex)
        ident = {"$literal": entry_id}
        mine = {"$and": [{"$eq": [{"$ifNull": ["$ho.id", None]}, ident]}, {"$eq": ["$owner", "$ho.tk"]}]}
        pipeline: builtins.list[Document] = [
            {"$set": {"__mine": mine}},
            {
                "$set": {
                    "q": {
                        "$filter": {
                            "input": {"$ifNull": ["$q", []]},
                            "as": "e",
                            "cond": {"$ne": ["$$e.id", ident]},
                        }
                    },
                    "owner": {"$cond": ["$__mine", None, "$owner"]},
                    "ho": {"$cond": ["$__mine", None, "$ho"]},
                }
            },
            {"$unset": ["__mine"]},
            *admission_docs.release_handoff_stages(by),
            admission_docs.gc_stage(),
        ]
        with self.operation(f"unpark {entry_id} from {key!r}"):
            doc = self.collection.find_one_and_update(
                {"_id": key, "$or": [{"q.id": entry_id}, {"ho.id": entry_id}]},
                pipeline,
                projection=admission_docs.HANDOFF_PROJECTION,
                return_document=ReturnDocument.AFTER,
            )
        if doc is not None:
            self._handed(key, doc, by)

    def give_back(self, lease: Lease) -> bool:
        """Release ``lease`` of a run that has not run (an attempt that gives its keys back): as a
        release, but the run is not remembered as over (``seen``), so a copy of it may still run."""
        if not lease.handed_over():
            return False
        self.forget(lease)
        if lease.slot is not None:  # a limit=N slot: released as the background release does
            return self.release_tokens([lease.owner], unconfirmed=[lease.owner]) > 0
        by = self._handoff_by(lease.owner)
        with self.operation(f"give back lease {lease.key!r}"):
            doc = self.collection.find_one_and_update(
                documents.release_filter(lease.key, lease.owner),
                documents.release_pipeline(by, seen=False),
                projection=admission_docs.HANDOFF_PROJECTION,
                return_document=ReturnDocument.AFTER,
            )
        if doc is not None:
            self._handed(lease.key, doc, by)
        return doc is not None

    def reserved_for_all(self, entry: Mapping[str, Any]) -> bool:
        """Whether every key of the run ``entry`` (``ks``) is handed or reserved to it, not yet claimed:
        then its message is published (once per completion; copies collapse at the claims)."""
        return self.keys_state(entry) == "ready"

    def keys_state(self, entry: Mapping[str, Any]) -> str:
        """Where the multi-key run ``entry`` stands on its keys (one read): ``ready`` (every key reserved
        for it), ``waiting`` (parked or reserved on each), or ``missing`` (absent from some key: its
        worker died between its admits and nothing brought its message back)."""
        keys = [normalize_key(k) for k in entry.get("ks") or []]
        if not keys:
            return "missing"
        ident = {"$literal": entry.get("id")}
        pipeline: builtins.list[Document] = [
            {"$match": {"_id": {"$in": keys}}},
            {
                "$project": {
                    "reserved": {
                        "$and": [
                            {"$eq": ["$ho.id", ident]},
                            {"$eq": ["$owner", {"$literal": entry.get("tk")}]},
                        ]
                    },
                    "parked": {
                        "$in": [
                            ident,
                            {"$map": {"input": {"$ifNull": ["$q", []]}, "as": "e", "in": "$$e.id"}},
                        ]
                    },
                }
            },
        ]
        with self.operation(f"read the keys of {entry.get('t')}"):
            docs = builtins.list(self.collection.aggregate(pipeline))
        reserved = {d["_id"] for d in docs if d.get("reserved")}
        present = reserved | {d["_id"] for d in docs if d.get("parked")}
        if reserved == set(keys):
            return "ready"
        return "waiting" if present == set(keys) else "missing"

    # -- handoffs ------------------------------------------------------------------------------------
    def add_handoff_callback(self, callback: HandoffCallback) -> None:
        """Call ``callback(key, entry)`` for every handoff a command of this process made and must
        publish (the Celery glue publishes the handed run's message). Without one, the sweeper of a
        worker publishes it."""
        if callback not in self._handoff_callbacks:
            self._handoff_callbacks.append(callback)

    def _handoff_by(self, token: str) -> str:
        """How a releasing command of this process marks a handoff it makes: with its token when this
        process publishes handoffs (a callback), else unmarked, so that a worker's sweeper adopts and
        publishes it at its next pass (a marked one would wait until it expired unclaimed)."""
        return token if self._handoff_callbacks else ""

    def _handed(self, key: str, doc: Mapping[str, Any] | None, by: str) -> Document | None:
        """If the command whose reply is ``doc`` handed ``key`` (or slots of it) to parked runs, publish
        those runs. Returns the (last) handoff published."""
        if not by:
            return None
        found = [(ho, (doc or {}).get("fence")) for ho in [(doc or {}).get("ho")]]
        found += [(h.get("ho"), h.get("f")) for h in (doc or {}).get("hs") or [] if isinstance(h, dict)]
        published: Document | None = None
        for ho, fence in found:
            if not isinstance(ho, dict) or ho.get("by") != by:
                continue
            log_release.info("lease %r handed to %s (fence %s)", key, ho.get("t"), fence)
            for callback in builtins.list(self._handoff_callbacks):
                try:
                    callback(key, ho, dict(doc or {}))
                except Exception:
                    log_release.exception("publishing the handoff of %r to %s failed", key, ho.get("t"))
            published = ho
        return published

    def waiting_keys(self, limit: int = 1000, after: str | None = None) -> builtins.list[Document]:
        """Lease documents with parked runs, a pending handoff or results to write (the sweeper's list),
        without the parked runs' messages, each with the server's time of the read (``__now``): at most
        ``limit`` of them, by key, after ``after`` (page through with the last key returned)."""
        match: Document = {"wq": True}
        if after is not None:
            match["_id"] = {"$gt": after}
        pipeline: builtins.list[Document] = [
            {"$match": match},
            {"$sort": {"_id": 1}},
            {"$limit": limit},
            {"$addFields": {"__now": "$$NOW"}},
            {"$project": {"q.m": 0, "ho.m": 0, "hs.ho.m": 0, "ends": 0, "seen": 0}},
        ]
        with self.operation("list keys with parked runs"):
            return builtins.list(self.collection.aggregate(pipeline))

    def sweep(
        self, key: str, *, revoked: _Collection[str] = (), slots: bool | None = None
    ) -> Document | None:
        """One sweep of ``key`` (in one command): drop parked runs whose task ids are ``revoked``, move
        runs past their deadline to ``dead``, hand a free or expired key to the oldest parked run
        (re-handing a handoff nobody took up), and adopt a handoff nobody published. The handoff this
        command made or adopted is published (``add_handoff_callback``). Returns the document after.
        ``slots``: whether the key is a ``limit=N`` key (read from the document when not given)."""
        key = normalize_key(key)
        token = "sweep:" + uuid.uuid4().hex
        with self.operation(f"sweep lease {key!r}"):
            if slots is None:
                found = self.collection.find_one({"_id": key}, {"lim": 1, "hs.s": 1})
                slots = found is not None and ("hs" in found or "lim" in found)
            pipeline = (
                slot_admission.slot_sweep_pipeline(token, builtins.list(revoked))
                if slots
                else admission_docs.sweep_pipeline(token, builtins.list(revoked))
            )
            doc = self.collection.find_one_and_update(
                {"_id": key, "wq": True},
                pipeline,
                projection={"q.m": 0, "ends": 0, "seen": 0},
                return_document=ReturnDocument.AFTER,
            )
        if doc is not None:
            self._handed(key, doc, token)
            if self.history_days:
                # The sweep may have ended an expired lease or handoff (its ending is in ``ends``): the
                # heartbeat copies it at its next tick, with whatever else this process ended.
                self.heartbeat.copy_endings({"_id": key})
        return doc

    def keys_with_expired_holds(self, limit: int = 1000, after: str | None = None) -> builtins.list[Document]:
        """``limit=N`` keys that nothing waits on but that keep a hold past its expiry on the server's
        clock (its holder died or stopped renewing, and no slot was taken since): at most ``limit`` of
        them, by key, after ``after``, each as ``{"_id": key}``. The sweeper drops those holds
        (``sweep_expired_holds``)."""
        match: Document = slots_docs.keys_with_expired_holds_filter()
        if after is not None:
            match["_id"] = {"$gt": after}
        with self.operation("list keys with expired slot holds"):
            return builtins.list(self.collection.find(match, {"_id": 1}).sort("_id", 1).limit(limit))

    def sweep_expired_holds(self, key: str) -> Document | None:
        """Drop the holds of ``limit=N`` key ``key`` that expired on the server's clock, as the next
        acquire of a slot would: their endings (``expired``) go to the document's ``ends`` and, at the
        heartbeat's next tick, to the history. One command; a key some run waits on gets the full
        ``sweep``. Returns the document after (None if there is none)."""
        key = normalize_key(key)
        token = "sweep:" + uuid.uuid4().hex
        with self.operation(f"drop expired slot holds of {key!r}"):
            doc = self.collection.find_one_and_update(
                {"_id": key, "hs.o": {"$exists": True}},
                slot_admission.slot_sweep_pipeline(token, []),
                projection={"q.m": 0, "ends": 0, "seen": 0},
                return_document=ReturnDocument.AFTER,
            )
        if doc is not None:
            self._handed(key, doc, token)  # a run parked meanwhile may have been handed a freed slot
            if self.history_days:
                self.heartbeat.copy_endings({"_id": key})
        return doc

    def record_run_ending(
        self,
        key: str,
        how: str,
        run: Mapping[str, Any],
        *,
        fence: int | None,
        ended_at: _dt.datetime | None = None,
        parked_at: _dt.datetime | None = None,
        by: str | None = None,
    ) -> None:
        """Queue the history record of a run that ended while parked, never holding ``key``
        (``superseded``, ``timeout``, ``revoked``); the heartbeat thread writes it at its next tick.
        ``run``: its parked entry (``t``, ``n``, ``r``/``id``); ``fence``: the key's when it ended."""
        if not self.history_days:
            return
        self._record(
            documents.run_record(
                normalize_key(key), how, run, fence=fence, ended_at=ended_at, parked_at=parked_at, by=by
            )
        )

    def run_ended(
        self, key: str, run_ids: Sequence[str], *, task_id: str, delivery: Any, parked: bool = False
    ) -> bool:
        """Whether a run of ``run_ids`` (a task id and attempt, ``_admission.run_id``) ended and released
        ``key`` itself (one read; ``_outcomes.run_ended`` says what counts). The key remembers the last
        ``SEEN_KEPT`` runs that ended so (``seen``), whoever took it since, for 2 hours after its last
        lease. For a copy of a run's message (a parked duplicate, a redelivery): then running it would be
        a second run of one submission."""
        key = normalize_key(key)
        with self.operation(f"inspect lease {key!r}"):
            doc = self.collection.find_one({"_id": key}, RUN_ENDED_PROJECTION)
        return run_ended(doc, run_ids, task_id=task_id, delivery=delivery, parked=parked)

    def forget_results(self, key: str, field: str, task_ids: _Collection[str]) -> None:
        """Remove entries of ``dead`` or ``sup`` whose results have been written. The runs of ``dead``
        (parked past their deadline) are remembered as over (``seen``): a late copy of one of their
        messages is dropped, as a copy of a run that ran is, not admitted as a new run."""
        if field not in ("dead", "sup"):
            raise ValueError(field)
        ids = builtins.list(task_ids)
        entries = {"$ifNull": [f"${field}", []]}
        written = {"$filter": {"input": entries, "as": "e", "cond": {"$in": ["$$e.t", ids]}}}
        remember: Document = {}
        if field == "dead":
            runs = {"$map": {"input": written, "as": "e", "in": "$$e.id"}}
            remember["seen"] = {
                "$slice": [{"$concatArrays": [{"$ifNull": ["$seen", []]}, runs]}, -admission_docs.SEEN_KEPT]
            }
        with self.operation(f"forget written results of {key!r}"):
            self.collection.update_one(
                {"_id": normalize_key(key)},
                [
                    {
                        "$set": {
                            field: {
                                "$filter": {
                                    "input": entries,
                                    "as": "e",
                                    "cond": {"$not": [{"$in": ["$$e.t", ids]}]},
                                }
                            },
                            **remember,
                        }
                    },
                    admission_docs.gc_stage(),
                ],
            )

    def release_tokens(
        self, tokens: _Collection[str], timeout: float | None = None, *, unconfirmed: _Collection[str] = ()
    ) -> int:
        """Release the leases of these owner tokens in one round trip (the heartbeat's background
        releases); return how many were released. ``StoreUnavailable`` if MongoDB does not answer.
        ``unconfirmed``: tokens of acquires whose caller never got the lease (no answer came): their run
        did not run with them, so it is not remembered as over (``seen``)."""
        maybe = set(unconfirmed)
        groups = [
            (builtins.list(t for t in tokens if t not in maybe), True),
            (builtins.list(t for t in tokens if t in maybe), False),
        ]
        released = 0
        with self.operation("release leases in the background", timeout=timeout):
            for toks, seen in groups:
                if not toks:
                    continue
                result = self.collection.update_many(
                    documents.release_tokens_filter(toks), documents.release_pipeline(seen=seen)
                )
                # (a freed slot handed to a parked run is unmarked: a worker's sweeper publishes it)
                slotted = self.collection.update_many(
                    slots_docs.slot_tokens_filter(toks),
                    slot_admission.slot_release_handoff_pipeline(toks, seen=seen),
                )
                released += result.modified_count + slotted.modified_count
        return released

    def release_later(
        self, key: str, token: str, until: float, *, quiet: bool = False, maybe: bool = False
    ) -> None:
        """Release ``token`` on ``key`` from the heartbeat thread as soon as MongoDB answers, giving up at
        ``until`` (monotonic). ``maybe``: a copy of an acquire may still land; keep releasing until then."""
        if not quiet:
            log_release.warning("lease %r: release queued for the background until MongoDB answers", key)
        self.heartbeat.release_later(key, token, until, maybe=maybe)

    def release_held_by(self, **holder: Any) -> int:
        """Release every lease whose holder info matches all of ``holder`` (e.g. ``task_id=..., pid=...``).

        For a supervisor that knows a process died holding leases (Celery's worker parent, when a child
        is killed), so the keys are free at once instead of at expiry; a key with parked runs goes to the
        oldest (published by this process). Returns how many were released.
        """
        match = documents.held_by_filter(holder)
        released = 0
        with self.operation(f"release leases held by {holder}"):
            keys = [d["_id"] for d in self.collection.find(match, {"_id": 1})]
            for key in keys:
                token = self._handoff_by(uuid.uuid4().hex)
                doc = self.collection.find_one_and_update(
                    {**match, "_id": key},
                    documents.release_dead_holder_pipeline(token),
                    projection=admission_docs.HANDOFF_PROJECTION,
                    return_document=ReturnDocument.AFTER,
                )
                if doc is not None:
                    released += 1
                    self._handed(key, doc, token)
            match_slots = slots_docs.slot_held_by_filter(holder)
            for key in [d["_id"] for d in self.collection.find(match_slots, {"_id": 1})]:
                token = self._handoff_by(uuid.uuid4().hex)
                doc = self.collection.find_one_and_update(
                    {**match_slots, "_id": key},
                    slot_admission.slot_release_dead_handoff_pipeline(holder, token),
                    projection=SLOT_HANDOFF_PROJECTION,
                    return_document=ReturnDocument.AFTER,
                )
                if doc is not None:
                    released += 1
                    self._handed(key, doc, token)
        if released:
            log_release.warning("released %d lease(s) held by %s", released, holder)
            if self.history_days:
                # The endings are in the documents (same update); the heartbeat copies them at its tick.
                self.heartbeat.copy_endings(_ended_for(holder))
        return released

    def force_release(self, key: str) -> bool:
        """Release ``key`` whoever holds it (an operator's tool). True if it was held.

        The holder finds out at its next renewal (its lease becomes lost). The fence is kept, so the
        next acquisition still gets a larger one. A key with parked runs goes to the oldest.
        """
        key = normalize_key(key)
        token = self._handoff_by(uuid.uuid4().hex)
        with self.operation(f"force-release lease {key!r}"):
            doc = self.collection.find_one_and_update(
                documents.force_release_filter(key),
                documents.force_release_pipeline(token),
                projection=admission_docs.HANDOFF_PROJECTION,
                return_document=ReturnDocument.AFTER,
            )
            slotted = self.collection.find_one_and_update(  # a limit=N key: every slot too
                {"_id": key, "hs.0": {"$exists": True}},
                slot_admission.slot_force_release_handoff_pipeline(token),
                projection=SLOT_HANDOFF_PROJECTION,
                return_document=ReturnDocument.AFTER,
            )
            if slotted is not None:
                self._handed(key, slotted, token)
            if doc is None:
                doc = slotted
        log_release.warning("force-released lease %r: %s", key, "it was held" if doc else "it was free")
        if doc is not None and self.history_days:
            # An operator's command, often from a process that exits right after: copy the ending into
            # the history now (two more commands, never on a task's path).
            with contextlib.suppress(StoreUnavailable, ConfigurationError):
                self.write_history([], [{"_id": key}], timeout=min(self.operation_timeout, 5.0))
        if doc is not None and doc is not slotted:
            self._handed(key, doc, token)
        return doc is not None

    # -- history -------------------------------------------------------------------------------------
    def _server_now(self, lease: Lease) -> _dt.datetime:
        """The server's time now, estimated from the lease's acquisition (server time) carried forward on
        the monotonic clock: no round trip. Off by at most the acquire's round trip and the drift."""
        if lease.acquired_at is None:
            return _dt.datetime.now(_dt.timezone.utc)
        elapsed = max(0.0, self.clock.monotonic() - lease.acquired_mono)
        now = lease.acquired_at + _dt.timedelta(seconds=elapsed)
        return now.replace(microsecond=now.microsecond // 1000 * 1000)  # BSON dates are milliseconds

    def _local_ending(
        self, lease: Lease, how: str, view: str = documents.SERVER_VIEW, **extra: Any
    ) -> Document:
        """The history record of ``lease``'s end as this process saw it (no I/O)."""
        holder = lease.holder
        ending: Document = {
            field: holder[name] for name, field in _ENDING_FIELDS.items() if holder.get(name) is not None
        }
        if "n" not in ending and holder.get("role") is not None:
            ending["n"] = holder["role"]
        ending.update(
            f=lease.fence, a=lease.acquired_at, e=self._server_now(lease), w=lease.waited_ms, how=how, **extra
        )
        return documents.history_record(lease.key, ending, view)

    def _record(self, record: Document) -> None:
        """Queue a history record; the heartbeat thread inserts it at its next tick."""
        if self.history_days:
            self.heartbeat.record(record)

    def record_lost(self, lease: Lease, reason: str) -> None:
        """Queue the holder's own view of a lease it lost ("lost", with the reason) for the history."""
        if lease.acquired_at is not None:  # a lease this store issued (not a made-up Lease object)
            self._record(self._local_ending(lease, "lost", documents.HOLDER_VIEW, why=reason))

    def write_history(
        self,
        records: builtins.list[Document],
        copies: Sequence[Document] = (),
        timeout: float | None = None,
    ) -> int:
        """Insert history records (``insert_many``, unordered; a record already there is skipped: its
        ``_id`` is key + fence + view). ``copies``: lease documents (filters) whose endings are copied in
        as well, read in one ``find``. Returns how many were new. ``StoreUnavailable`` if MongoDB does not
        answer."""
        if not self.history_days:
            return 0
        records = builtins.list(records)
        if not self._indexes_ready:  # the TTL index before the first record (an operator's process)
            self.ensure_indexes()
        with self.operation("write the lease history", timeout=timeout):
            if copies:
                query = copies[0] if len(copies) == 1 else {"$or": builtins.list(copies)}
                for doc in self.collection.find(query, {"ends": 1}):
                    records += [documents.history_record(doc["_id"], e) for e in doc.get("ends") or []]
            if not records:
                return 0
            try:
                return len(self.history_collection.insert_many(records, ordered=False).inserted_ids)
            except BulkWriteError as exc:
                errors = exc.details.get("writeErrors") or []
                if any(e.get("code") != 11000 for e in errors):
                    raise
                return int(exc.details.get("nInserted") or 0)

    def flush_history(self, timeout: float | None = None) -> bool:
        """Insert the history records this process has queued now, instead of at the heartbeat's next
        tick (at a worker process's shutdown); False if MongoDB did not answer (they stay queued)."""
        hb = self._heartbeat
        if hb is None or hb.pid != os.getpid():
            return True
        return hb.flush_history(timeout=timeout)

    def why(self, key: str) -> KeyStory | None:
        """Why ``key`` is (not) running: its lease document, holder, expiry on the server's clock, parked
        runs and last endings (``celery mongolock why``): the document in one command, and the newest
        records of the history collection in a second (runs that ended while parked are only there). None
        if there is no lease document for ``key`` (never taken, or removed by the TTL index after it
        expired)."""
        key = normalize_key(key)
        with self.operation(f"read lease {key!r}"):
            docs = builtins.list(self.collection.aggregate(documents.story_pipeline(key)))
            stored: builtins.list[Document] = []
            if docs and self.history_days:
                # Endings ``ends`` does not keep: runs that ended while parked, and older ones.
                stored = builtins.list(
                    self.history_collection.find({"k": key}).sort("f", pymongo.DESCENDING).limit(16)
                )
        return KeyStory.from_document(docs[0], stored, documents.HOLDER_VIEW) if docs else None

    def history(self, key: str, limit: int = 20) -> builtins.list[LeaseEnding]:
        """How the last ``limit`` leases of ``key`` ended, newest first (``celery mongolock history``).

        The history collection (kept ``history_days``) merged with the lease document's ``ends`` (the
        last 8 endings, written by the ending commands themselves: they are there even when the process
        that ended a lease was killed before writing its history), one entry per acquisition (fence).
        """
        key = normalize_key(key)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigurationError(f"limit must be a positive int, got {limit!r}")
        with self.operation(f"read the history of {key!r}"):
            doc = self.collection.find_one({"_id": key}, {"ends": 1}) or {}
            stored: builtins.list[Document] = []
            if self.history_days:
                stored = builtins.list(
                    self.history_collection.find({"k": key}).sort("f", pymongo.DESCENDING).limit(limit * 2)
                )
        return merge_endings(key, doc.get("ends") or [], stored, limit, documents.HOLDER_VIEW)

    # -- reading -------------------------------------------------------------------------------------
    def _read(self, match: Document, action: str) -> builtins.list[LeaseInfo]:
        with self.operation(action):
            docs = builtins.list(self.collection.aggregate(documents.read_pipeline(match)))
        return [documents.lease_info(d) for d in docs]

    def inspect(self, key: str) -> LeaseInfo | None:
        """The lease document for ``key`` (held or not), or None if there is none."""
        key = normalize_key(key)
        found = self._read({"_id": key}, f"inspect lease {key!r}")
        return found[0] if found else None

    def list(self, prefix: str | None = None, *, include_free: bool = False) -> builtins.list[LeaseInfo]:
        """Leases whose key starts with ``prefix`` (all when None): held ones, or with runs parked, unless
        ``include_free``."""
        infos = self._read(documents.prefix_filter(prefix), "list leases")
        return infos if include_free else [i for i in infos if i.held or i.parked or i.handoff]

    # -- heartbeat -----------------------------------------------------------------------------------
    @property
    def heartbeat(self) -> Heartbeat:
        """This process's heartbeat (renewal) thread for this store, created on first use."""
        self._check_pid()
        hb = self._heartbeat
        if hb is None:
            with self._state_lock:
                hb = self._heartbeat
                if hb is None:
                    hb = self._heartbeat = Heartbeat(self)
        return hb

    def held_leases(self) -> builtins.list[Lease]:
        """The leases this process holds with a heartbeat from this store (none if it never started one)."""
        hb = self._heartbeat
        if hb is None or hb.pid != os.getpid():
            return []
        return hb.leases

    def has_writable_server(self) -> bool:
        """True if the driver currently knows a primary (no I/O): the heartbeat's budget depends on it."""
        return bool(self.client.topology_description.has_writable_server())

    def forget(self, lease: Lease) -> None:
        """Stop renewing ``lease`` (it was released or lost)."""
        hb = self._heartbeat
        if hb is not None and lease.pid == os.getpid():
            hb.discard(lease)

    @property
    def lost_callbacks(self) -> Sequence[LostCallback]:
        """Called (each from a thread of its own) for every lease of this store that is lost."""
        return tuple(self._lost_callbacks)

    def add_lost_callback(self, callback: LostCallback) -> None:
        """Call ``callback(lease, reason)`` whenever a lease of this store is lost."""
        self._lost_callbacks.append(callback)
