"""Leases on MongoDB: one document per key, taken and kept by owner token, judged on the server's clock.

This module imports pymongo only (no Celery): the Celery glue sits on top of it.

The lease document
==================
::

    {
      _id:         "email-group:42",        # the lease key (see keys.normalize_key)
      owner:       "5f0c...e1" | null,      # token of the current acquisition; null once released
      fence:       1795383245193000,        # fencing token: strictly increasing per key, see below
      ttl_ms:      30000,                   # the lease length the holder asked for
      expires_at:  ISODate(...),            # server time; TTL index (expireAfterSeconds=0) cleans up
      acquired_at: ISODate(...),            # server time of this acquisition
      renewed_at:  ISODate(...),            # server time of the last renewal
      released_at: ISODate(...) | absent,   # server time of the release, when released
      holder:      {host, pid, ...info}     # who holds it: host, pid, and e.g. task_name, task_id
    }

The acquire algorithm (one round trip)
======================================
1. A fresh owner token is drawn for every acquisition.
2. One ``findAndModify`` with ``{_id: key}``, ``upsert: true`` and an *update pipeline* that, on the
   server, computes ``free = owner is null OR expires_at <= $$NOW OR owner == token`` and, only when
   free, sets owner, ttl, holder, ``expires_at = $$NOW + ttl`` and
   ``fence = max(fence + 1, $$NOW in ms * 1000)``; when not free every field is left as it was.
   Expiry is therefore judged on the server clock, inside the same atomic write; no client clock is
   involved. (Dates are compared through ``$toLong``: equivalent on MongoDB, and it sidesteps a
   date-comparison bug of the embedded test server.)
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

Fencing tokens
==============
``fence = max(previous fence + 1, server time in ms * 1000)``. The first term makes it strictly increase
while the document exists; the second makes it strictly increase after the document was deleted (by the
TTL index, which only removes leases whose ``expires_at`` is past, or by hand): a fresh document starts
from the server's clock, which has moved on since the deleted lease was taken. The one assumption is the
one every lease makes: the server's clock does not step backwards.

Holder's deadline
=================
The holder measures its lease on the monotonic clock from the moment the acquire/renew was *sent*
(``sent + ttl``, shrunk by ``clock.MAX_DRIFT``), which is never later than the server's ``expires_at``.
Past that deadline ``lease.lost`` is true even if nobody told us; the heartbeat gives up a margin before it.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import datetime as _dt
import logging
import math
import os
import random
import socket
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import pymongo
from pymongo import MongoClient, ReadPreference, ReturnDocument
from pymongo.collection import Collection
from pymongo.errors import (
    AutoReconnect,
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

from ._urls import redact, validate_mongo_url
from .clock import MAX_DRIFT, Clock, SystemClock
from .exceptions import ConfigurationError, LeaseLost, LockContended, StoreUnavailable
from .keys import normalize_key

if TYPE_CHECKING:
    from .heartbeat import Heartbeat

__all__ = ["DEFAULT_LEASE_SECONDS", "Lease", "LeaseInfo", "LeaseStore"]

log_acquire = logging.getLogger("celery_mongolock.acquire")
log_release = logging.getLogger("celery_mongolock.release")
log_renew = logging.getLogger("celery_mongolock.renew")

Document = dict[str, Any]
LostCallback = Callable[["Lease", str], None]

DEFAULT_LEASE_SECONDS = 30.0
MIN_LEASE_SECONDS = 0.5
MAX_LEASE_SECONDS = 30 * 24 * 3600.0
#: Info values stored with the holder are for humans: keep them small.
MAX_INFO_BYTES = 4096

# A renewal only extends a lease that has not expired on the server: a renewal that arrives late (its
# reply lost, or queued on the server) must not revive a lease its holder has already given up.
_NOT_EXPIRED: Document = {"$expr": {"$gt": [{"$toLong": "$expires_at"}, {"$toLong": "$$NOW"}]}}

# Errors after which we cannot know whether the server applied the write.
# Every store of the process, so that a forked child gets fresh locks: a lock another thread of the
# parent (a heartbeat, a release) held at the moment of fork would otherwise stay locked in the child.
_STORES: weakref.WeakSet[LeaseStore] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for store in list(_STORES):
        store._state_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)

_AMBIGUOUS = (
    AutoReconnect,
    ConnectionFailure,
    NetworkTimeout,
    ExecutionTimeout,
    WTimeoutError,
    WriteConcernError,
)


def _validate_seconds(name: str, value: object, *, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(f"{name} must be a number of seconds, got {type(value).__name__}: {value!r}")
    seconds = float(value)
    if math.isnan(seconds) or not (low <= seconds <= high):
        raise ConfigurationError(f"{name} must be between {low:g} and {high:g} seconds, got {value!r}")
    return seconds


#: Databases that would break the guarantees: ``local`` is not replicated (an acknowledged lease could be
#: lost in a failover), ``config`` belongs to sharded clusters.
_RESERVED_DATABASES = ("local", "config")


def validate_names(database: object, collection: object, *, prefix: str = "") -> tuple[str, str]:
    """Check a lease database and collection name as MongoDB and pymongo will; ``ConfigurationError`` if not.

    ``prefix`` is put before ``database``/``collection`` in messages (``"mongolock_"`` for the settings).
    """
    for name, value in (("database", database), ("collection", collection)):
        if (
            not isinstance(value, str)
            or not value
            or any(c in value for c in "$\x00")
            or value != value.strip()
        ):
            raise ConfigurationError(f"{prefix}{name} name {value!r} is not a valid MongoDB {name} name")
    assert isinstance(database, str)
    assert isinstance(collection, str)
    if any(c in database for c in '/\\. "'):
        raise ConfigurationError(
            f"{prefix}database name {database!r} must not contain / \\ . space or quotes"
        )
    if len(database.encode("utf-8")) > 63:
        raise ConfigurationError(f"{prefix}database name {database!r} is longer than MongoDB's 63 bytes")
    if database in _RESERVED_DATABASES:
        raise ConfigurationError(
            f"{prefix}database {database!r} cannot hold leases: 'local' is not replicated and 'config' is "
            "reserved for sharding"
        )
    if collection.startswith(".") or collection.endswith(".") or ".." in collection:
        raise ConfigurationError(
            f"{prefix}collection name {collection!r} must not start or end with '.' or contain '..'"
        )
    if collection.startswith("system."):
        raise ConfigurationError(f"{prefix}collection name {collection!r}: 'system.' names are reserved")
    if len(f"{database}.{collection}".encode()) > 255:
        raise ConfigurationError(f"{prefix}collection name {collection!r} is too long for MongoDB")
    return database, collection


def validate_lease_timing(lease_seconds: object, heartbeat_seconds: object | None) -> tuple[float, float]:
    """Check a lease length and heartbeat interval that must work together; return them as floats.

    The heartbeat must fit at least twice into the lease, so that one lost renewal is survived.
    """
    ttl = _validate_seconds("lease_seconds", lease_seconds, low=MIN_LEASE_SECONDS, high=MAX_LEASE_SECONDS)
    if heartbeat_seconds is None:
        return ttl, ttl / 3.0
    beat = _validate_seconds("heartbeat_seconds", heartbeat_seconds, low=0.05, high=MAX_LEASE_SECONDS)
    if beat > ttl / 2.0:
        raise ConfigurationError(
            f"heartbeat_seconds ({beat:g}) must be at most half of lease_seconds ({ttl:g}) so that a "
            f"missed renewal does not lose the lease; use {ttl / 3.0:g} or less"
        )
    return ttl, beat


def _aware(value: Any) -> _dt.datetime | None:
    if not isinstance(value, _dt.datetime):
        return None
    return value if value.tzinfo is not None else value.replace(tzinfo=_dt.timezone.utc)


@dataclasses.dataclass(frozen=True)
class LeaseInfo:
    """A snapshot of one lease document, as ``inspect`` and ``list`` report it."""

    key: str
    held: bool
    owner: str | None
    fence: int
    expires_at: _dt.datetime | None
    #: Seconds until ``expires_at`` on the server's clock at the time of the read (negative: expired).
    expires_in: float | None
    holder: dict[str, Any]
    acquired_at: _dt.datetime | None
    renewed_at: _dt.datetime | None
    released_at: _dt.datetime | None

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name in ("expires_at", "acquired_at", "renewed_at", "released_at"):
            if data[name] is not None:
                data[name] = data[name].isoformat()
        return data


def _local_ttl(ttl: float) -> float:
    """How long the holder may count on a lease of ``ttl`` s, on its own monotonic clock.

    Shrunk by the drift allowance and 2 ms: the server's ``$$NOW`` has 1 ms resolution and the lease
    length sent is whole milliseconds.
    """
    return int(ttl * 1000) / 1000.0 * (1.0 - MAX_DRIFT) - 0.002


def _run_callbacks(callbacks: builtins.list[LostCallback], lease: Lease, reason: str) -> None:
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
        store: LeaseStore,
        key: str,
        owner: str,
        *,
        fence: int,
        ttl: float,
        heartbeat_seconds: float,
        expires_at: _dt.datetime | None,
        sent_at: float,
        holder: Mapping[str, Any],
    ) -> None:
        self.store = store
        self.key = key
        self.owner = owner
        self.fence = fence
        self.ttl = ttl
        self.heartbeat_seconds = heartbeat_seconds
        self.expires_at = expires_at
        self.holder = dict(holder)
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._deadline = sent_at + _local_ttl(ttl)
        self._lost_reason: str | None = None
        #: Until then a copy of an acquire attempt with this token may still land late (see _try_acquire).
        self._ambiguous_until: float | None = None
        self._released = False
        self._lost_event = threading.Event()
        self._callbacks: builtins.list[LostCallback] = []

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
            self._mark_lost("its deadline passed without a successful renewal")
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

    def on_lost(self, callback: LostCallback) -> None:
        """Call ``callback(lease, reason)`` when the lease is lost, from a thread of its own (a slow
        callback never delays the renewal of other leases)."""
        with self._lock:
            already = self._lost_reason
            if already is None:
                self._callbacks.append(callback)
        if already is not None:
            _run_callbacks([callback], self, already)

    def _extend(self, sent_at: float, expires_at: _dt.datetime | None = None) -> None:
        with self._lock:
            if self._lost_reason is None:
                self._deadline = max(self._deadline, sent_at + _local_ttl(self.ttl))
                if expires_at is not None:
                    self.expires_at = expires_at

    def _mark_lost(self, reason: str, *, release: bool = True) -> bool:
        with self._lock:
            if self._lost_reason is not None or self._released:
                return False
            self._lost_reason = reason
            callbacks = builtins.list(self._callbacks)
        self._lost_event.set()
        log_renew.warning("lease %r (fence %s) lost: %s", self.key, self.fence, reason)
        self.store._forget(self)
        if release and self.pid == os.getpid():
            # Make sure the token frees the key once MongoDB answers (a late copy of a renewal or of the
            # acquire must not leave it taken for nobody). Not needed when the token was seen not to match.
            self.store._release_later(
                self.key, self.owner, self.store.clock.monotonic() + self.ttl, quiet=True
            )
        _run_callbacks([*self.store._lost_callbacks, *callbacks], self, reason)
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
        matched = self.store._renew_one(self)
        if not matched:
            self._mark_lost(
                "renewal matched nothing: released by force, or expired and taken over", release=False
            )
            raise LeaseLost(self.key, self.fence, self._lost_reason or "lost")
        self._extend(sent)

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
        self.store._forget(self)
        if was_lost:
            return False  # its release is already queued (see _mark_lost)
        released = self.store._release_token(self.key, self.owner, self._deadline)
        if self._ambiguous_until is not None and self.store.clock.monotonic() < self._ambiguous_until:
            # A delayed copy of the acquire could still land and take the key again with our token.
            self.store._release_later(self.key, self.owner, self._ambiguous_until, quiet=True)
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
        return f"<Lease {self.key!r} fence={self.fence} owner={self.owner[:8]} {state}>"


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
        self.operation_timeout = _validate_seconds(
            "operation_timeout", operation_timeout, low=0.1, high=3600.0
        )
        if write_concern is None:
            # Majority + journal: an acknowledged acquisition survives a failover (no rollback, no
            # second holder). w:majority alone does not imply j on every server.
            write_concern = WriteConcern(w="majority", j=True)
        self.write_concern = write_concern
        self.read_preference = read_preference or ReadPreference.PRIMARY
        self.client_options = dict(client_options or {})
        self.clock: Clock = clock or SystemClock()
        self._lost_callbacks: builtins.list[LostCallback] = [on_lost] if on_lost else []
        self._state_lock = threading.Lock()
        self._pid = os.getpid()
        _STORES.add(self)
        self._client_cache: MongoClient[Document] | None = None
        self._indexes_ready = False
        self._heartbeat: Heartbeat | None = None
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
    def url(self) -> str | None:
        """The URL with credentials masked (None when the store was given a client)."""
        return redact(self._url) if self._url else None

    def close(self) -> None:
        """Release the leases the heartbeat keeps, stop it, and close the client this store created
        (a client given to the store is left open)."""
        hb = self._heartbeat
        if hb is not None and hb._pid == os.getpid():
            for lease in hb.leases:
                with contextlib.suppress(Exception):
                    lease.release()
            hb.stop()
        self._heartbeat = None
        if self._client_cache is not None and self._pid == os.getpid():
            self._client_cache.close()
        self._client_cache = None

    def __enter__(self) -> LeaseStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = self.url or "<client>"
        return f"<LeaseStore {where} {self.database_name}.{self.collection_name}>"

    # -- error handling ------------------------------------------------------------------------------
    def _unavailable(self, action: str, exc: BaseException) -> StoreUnavailable:
        return StoreUnavailable(
            f"MongoDB did not answer while trying to {action} "
            f"({self.database_name}.{self.collection_name}): {type(exc).__name__}: {redact(str(exc))[:500]}"
        )

    @contextlib.contextmanager
    def _operation(
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
            if exc.code in (13, 18, 8000):  # Unauthorized, AuthenticationFailed, Atlas auth
                why = (exc.details or {}).get("errmsg") or str(exc)
                raise StoreUnavailable(
                    f"MongoDB refused to {action} ({self.database_name}.{self.collection_name}): "
                    f"{redact(str(why))[:500]} (code {exc.code})"
                ) from None
            if retryable and (isinstance(exc, _AMBIGUOUS) or exc.has_error_label("RetryableWriteError")):
                raise
            raise self._unavailable(action, exc) from None
        except _AMBIGUOUS as exc:
            if retryable and not isinstance(exc, ServerSelectionTimeoutError):
                raise
            raise self._unavailable(action, exc) from None
        except PyMongoError as exc:
            raise self._unavailable(action, exc) from None

    # -- indexes -------------------------------------------------------------------------------------
    def ensure_indexes(self) -> None:
        """Create the TTL index on ``expires_at`` and the index on ``owner`` (idempotent, concurrent-safe).

        Called automatically before the first acquire in each process.
        """
        coll = self.collection
        with self._operation("create lease indexes"):
            for spec, options in (
                ([("expires_at", pymongo.ASCENDING)], {"name": "expires_at_ttl", "expireAfterSeconds": 0}),
                ([("owner", pymongo.ASCENDING)], {"name": "owner"}),
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
        self._indexes_ready = True

    def _ready_collection(self) -> Collection[Document]:
        self._check_pid()
        if not self._indexes_ready:
            self.ensure_indexes()
        return self.collection

    # -- acquire -------------------------------------------------------------------------------------
    def _holder_info(self, info: Mapping[str, Any] | None) -> Document:
        holder: Document = {"host": self._host, "pid": os.getpid()}
        if info is not None and not isinstance(info, Mapping):
            raise ConfigurationError(f"holder info must be a dict, got {type(info).__name__}")
        if info:
            for k, v in info.items():
                if not isinstance(k, str) or not k or k.startswith("$") or "." in k:
                    raise ConfigurationError(f"holder info key {k!r} must be a plain non-empty string")
                holder[k] = v
            import bson

            try:
                size = len(bson.encode(holder))
            except Exception as exc:
                raise ConfigurationError(f"holder info cannot be stored in MongoDB: {exc}") from None
            if size > MAX_INFO_BYTES:
                raise ConfigurationError(
                    f"holder info is {size} bytes encoded; the limit is {MAX_INFO_BYTES}"
                )
        return holder

    @staticmethod
    def _acquire_pipeline(
        token: str,
        ttl_ms: int,
        holder: Document,
        *,
        tick: int | None = None,
        min_hold_ms: int = 0,
        hold_until_ms: int | None = None,
    ) -> builtins.list[Document]:
        now_ms = {"$toLong": "$$NOW"}
        vacant: Document = {
            "$or": [
                {"$eq": [{"$ifNull": ["$owner", None]}, None]},
                {"$lte": [{"$toLong": "$expires_at"}, now_ms]},
            ]
        }
        if tick is not None:
            # Once per tick: a run for a tick at or before the last one run is refused even when free.
            vacant = {"$and": [vacant, {"$lt": [{"$ifNull": ["$last_tick", -1]}, tick]}]}
        free = {"$or": [{"$eq": ["$owner", token]}, vacant]}
        hold_until: Document = {"$add": ["$$NOW", min_hold_ms]}
        if hold_until_ms is not None:
            # Compared as numbers: the embedded test server compares dates wrongly (see module doc).
            hold_until = {"$toDate": {"$max": [{"$add": [now_ms, min_hold_ms]}, hold_until_ms]}}

        def when_free(new: object, field: str) -> Document:
            return {"$cond": ["$__free", new, f"${field}"]}

        fields: Document = {
            "owner": when_free(token, "owner"),
            "ttl_ms": when_free(ttl_ms, "ttl_ms"),
            "holder": when_free({"$literal": holder}, "holder"),
            "fence": when_free(
                {"$max": [{"$add": [{"$ifNull": ["$fence", 0]}, 1]}, {"$multiply": [now_ms, 1000]}]},
                "fence",
            ),
            "expires_at": when_free({"$add": ["$$NOW", ttl_ms]}, "expires_at"),
            "acquired_at": when_free("$$NOW", "acquired_at"),
            "renewed_at": when_free("$$NOW", "renewed_at"),
            "hold_until": when_free(hold_until, "hold_until"),
            "released_at": when_free({"$literal": None}, "released_at"),
            "forced_release": when_free({"$literal": False}, "forced_release"),
            "released_for": when_free({"$literal": None}, "released_for"),
        }
        if tick is not None:
            fields["last_tick"] = when_free(tick, "last_tick")
        return [{"$set": {"__free": free}}, {"$set": fields}, {"$unset": "__free"}]

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
    ) -> Lease | None:
        """Try once to take ``key`` for ``ttl`` seconds (default: the store's ``lease_seconds``).

        Returns the ``Lease``, or ``None`` if someone else holds the key. ``info`` is stored with the
        holder (e.g. task name and id). With ``heartbeat=True`` the process's heartbeat thread keeps
        the lease alive until it is released. ``min_hold`` keeps the key taken for at least that many
        seconds from acquisition even if released sooner (ShedLock's lock-at-least-for);
        ``hold_until_ms`` (epoch milliseconds, server time) is the same as an absolute time, e.g. the end
        of a schedule tick. ``tick`` (an increasing int, such as a scheduled time in ms) makes the
        acquisition once-per-tick: refused for a tick at or before the last tick that took this key.
        Raises ``StoreUnavailable`` if MongoDB cannot be reached: a lease is never assumed.
        """
        lease, _ = self._try_acquire(
            key,
            ttl,
            info=info,
            heartbeat=heartbeat,
            heartbeat_seconds=heartbeat_seconds,
            min_hold=min_hold,
            tick=tick,
            hold_until_ms=hold_until_ms,
        )
        return lease

    def _try_acquire(
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
    ) -> tuple[Lease | None, Document | None]:
        key = normalize_key(key)
        hold_s = _validate_seconds("min_hold", min_hold, low=0.0, high=MAX_LEASE_SECONDS)
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
        holder = self._holder_info(info)
        token = uuid.uuid4().hex
        pipeline = self._acquire_pipeline(
            token,
            ttl_ms,
            holder=holder,
            tick=tick,
            min_hold_ms=int(hold_s * 1000),
            hold_until_ms=hold_until_ms,
        )
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
                with self._operation(f"acquire lease {key!r}", timeout=remaining, retryable=True):
                    doc = coll.find_one_and_update(
                        {"_id": key}, pipeline, upsert=True, return_document=ReturnDocument.AFTER
                    )
                    if doc is None:
                        # Seen on the embedded server under contention: the update was applied but no
                        # document returned. Read it back; our token tells whether we got it.
                        primary = coll.with_options(read_preference=ReadPreference.PRIMARY)
                        doc = primary.find_one({"_id": key})
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
                self._release_later(key, token, landing_window, maybe=True)
            if isinstance(last_error, StoreUnavailable):
                raise last_error
            raise self._unavailable(f"acquire lease {key!r}", last_error) from None

        if doc is None or doc.get("owner") != token:
            if doc is not None:
                log_acquire.debug("lease %r is held by %s", key, doc.get("holder"))
            if ambiguous:
                self._release_later(key, token, landing_window, quiet=True, maybe=True)
            return None, doc
        lease = Lease(
            self,
            key,
            token,
            fence=int(doc["fence"]),
            ttl=ttl_s,
            heartbeat_seconds=beat,
            expires_at=_aware(doc.get("expires_at")),
            sent_at=sent_at,
            holder=holder,
        )
        if ambiguous:
            lease._ambiguous_until = landing_window
        log_acquire.info("acquired lease %r fence=%s ttl=%gs", key, lease.fence, ttl_s)
        if heartbeat:
            self.heartbeat.add(lease)
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
            with self._operation(f"watch lease {key!r}", timeout=None):
                stream = self.collection.watch([{"$match": {"documentKey._id": key}}], max_await_time_ms=200)
        except (StoreUnavailable, OperationFailure, *_AMBIGUOUS):
            stream = None  # no change streams here (standalone server, permissions): poll instead
        interval = poll_interval
        try:
            while True:
                info = self.inspect(key)
                if info is None or not info.held:
                    return True
                remaining = give_up_at - clock.monotonic()
                if remaining <= 0:
                    return False
                # Sleep until a change, the holder's expiry, or the deadline, whichever is first.
                nap = min(remaining, max(0.01, (info.expires_in or 0.0) + 0.005))
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
        wait_s = _validate_seconds("wait", wait, low=0.0, high=MAX_LEASE_SECONDS)
        clock = self.clock
        give_up_at = clock.monotonic() + wait_s
        while True:
            lease, doc = self._try_acquire(
                key, ttl, info=info, heartbeat=True, heartbeat_seconds=heartbeat_seconds
            )
            if lease is not None:
                break
            remaining = give_up_at - clock.monotonic()
            if remaining <= 0 or not self.wait_free(
                key, remaining, poll_interval=poll_interval, max_poll_interval=max_poll_interval
            ):
                holder = (doc or {}).get("holder") or {}
                raise LockContended(normalize_key(key), holder, _aware((doc or {}).get("expires_at")))
        with lease:
            yield lease
            if lease.lost:
                # The block ran (at least in part) without the lease: do not let it pass as protected.
                raise LeaseLost(lease.key, lease.fence, lease.lost_reason or "lost")

    # -- renew / release -----------------------------------------------------------------------------
    @staticmethod
    def _renew_pipeline() -> builtins.list[Document]:
        return [{"$set": {"expires_at": {"$add": ["$$NOW", "$ttl_ms"]}, "renewed_at": "$$NOW"}}]

    def _renew_one(self, lease: Lease) -> bool:
        with self._operation(
            f"renew lease {lease.key!r}", timeout=max(0.1, min(self.operation_timeout, lease.remaining))
        ):
            result = self.collection.update_one(
                {"_id": lease.key, "owner": lease.owner, **_NOT_EXPIRED}, self._renew_pipeline()
            )
        log_renew.debug("renewed %r: matched=%s", lease.key, result.matched_count)
        return result.matched_count == 1

    def renew_many(self, leases: builtins.list[Lease], timeout: float | None = None) -> builtins.list[Lease]:
        """Renew all ``leases`` in one round trip; return those found lost (and mark them lost).

        A second query is made only when some lease did not match, to learn which.
        """
        live = [lease for lease in leases if not lease.lost and not lease.released]
        if not live:
            return []
        by_token = {lease.owner: lease for lease in live}
        sent = self.clock.monotonic()
        coll = self.collection
        with self._operation("renew leases", timeout=timeout):
            result = coll.update_many(
                {"owner": {"$in": builtins.list(by_token)}, **_NOT_EXPIRED}, self._renew_pipeline()
            )
            lost: builtins.list[Lease] = []
            if result.matched_count != len(by_token):
                primary = coll.with_options(read_preference=ReadPreference.PRIMARY)
                query = {"owner": {"$in": builtins.list(by_token)}, **_NOT_EXPIRED}
                still = {d["owner"] for d in primary.find(query, {"owner": 1})}
                lost = [lease for token, lease in by_token.items() if token not in still]
        for lease in live:
            if lease in lost:
                lease._mark_lost(
                    "renewal matched nothing: released by force, or expired and taken over", release=False
                )
            else:
                lease._extend(sent)
        return lost

    def _release_token(self, key: str, token: str, until: float) -> bool:
        try:
            released = self._release_update(key, token)
        except (*_AMBIGUOUS, StoreUnavailable, OperationFailure) as exc:
            self._release_later(key, token, until)
            if isinstance(exc, StoreUnavailable):
                raise
            raise self._unavailable(f"release lease {key!r}", exc) from None
        log_release.info("released lease %r%s", key, "" if released else " (it was no longer ours)")
        return released

    def _release_update(self, key: str, token: str, timeout: float | None = None) -> bool:
        """The release command: matched on ``{_id, owner}``, keeps the document (and so the fence)."""
        with self._operation(f"release lease {key!r}", timeout=timeout):
            result = self.collection.update_one({"_id": key, "owner": token}, self._release_pipeline())
        return result.matched_count == 1

    @staticmethod
    def _release_pipeline() -> builtins.list[Document]:
        # A lease with a minimum hold time that has not passed stays taken (owner kept) until then, and
        # simply expires at hold_until; otherwise the owner is cleared at once.
        holding = {"$gt": [{"$toLong": {"$ifNull": ["$hold_until", 0]}}, {"$toLong": "$$NOW"}]}
        return [
            {"$set": {"__hold": holding}},
            {
                "$set": {
                    "owner": {"$cond": ["$__hold", "$owner", None]},
                    "expires_at": {"$cond": ["$__hold", "$hold_until", "$expires_at"]},
                    "released_at": "$$NOW",
                }
            },
            {"$unset": "__hold"},
        ]

    def _release_later(
        self, key: str, token: str, until: float, *, quiet: bool = False, maybe: bool = False
    ) -> None:
        if not quiet:
            log_release.warning("lease %r: release queued for the background until MongoDB answers", key)
        self.heartbeat.release_later(key, token, until, maybe=maybe)

    def release_held_by(self, **holder: Any) -> int:
        """Release every lease whose holder info matches all of ``holder`` (e.g. ``task_id=..., pid=...``).

        For a supervisor that knows a process died holding leases (Celery's worker parent, when a child
        is killed), so the keys are free at once instead of at expiry. Returns how many were released.
        """
        if not holder:
            raise ConfigurationError("release_held_by needs at least one holder field to match")
        match: Document = {f"holder.{k}": v for k, v in holder.items()}
        match["owner"] = {"$ne": None}
        with self._operation(f"release leases held by {holder}"):
            result = self.collection.update_many(
                match, [{"$set": {"owner": None, "released_at": "$$NOW", "released_for": "holder died"}}]
            )
        if result.modified_count:
            log_release.warning("released %d lease(s) held by %s", result.modified_count, holder)
        return result.modified_count

    def force_release(self, key: str) -> bool:
        """Release ``key`` whoever holds it (an operator's tool). True if it was held.

        The holder finds out at its next renewal (its lease becomes lost). The fence is kept, so the
        next acquisition still gets a larger one.
        """
        key = normalize_key(key)
        with self._operation(f"force-release lease {key!r}"):
            result = self.collection.update_one(
                {"_id": key, "owner": {"$ne": None}},
                [{"$set": {"owner": None, "released_at": "$$NOW", "forced_release": True}}],
            )
        log_release.warning(
            "force-released lease %r: %s", key, "it was held" if result.matched_count else "it was free"
        )
        return result.matched_count == 1

    # -- reading -------------------------------------------------------------------------------------
    @staticmethod
    def _info(doc: Document) -> LeaseInfo:
        expires_in_ms = doc.get("__expires_in_ms")
        owner = doc.get("owner")
        expires_in = None if expires_in_ms is None else expires_in_ms / 1000.0
        return LeaseInfo(
            key=doc["_id"],
            held=owner is not None and expires_in is not None and expires_in > 0,
            owner=owner,
            fence=int(doc.get("fence", 0)),
            expires_at=_aware(doc.get("expires_at")),
            expires_in=expires_in,
            holder=dict(doc.get("holder") or {}),
            acquired_at=_aware(doc.get("acquired_at")),
            renewed_at=_aware(doc.get("renewed_at")),
            released_at=_aware(doc.get("released_at")),
        )

    def _read(self, match: Document, action: str) -> builtins.list[LeaseInfo]:
        stage = {
            "$addFields": {
                "__expires_in_ms": {"$subtract": [{"$toLong": "$expires_at"}, {"$toLong": "$$NOW"}]}
            }
        }
        with self._operation(action):
            docs = builtins.list(self.collection.aggregate([{"$match": match}, {"$sort": {"_id": 1}}, stage]))
        return [self._info(d) for d in docs]

    def inspect(self, key: str) -> LeaseInfo | None:
        """The lease document for ``key`` (held or not), or None if there is none."""
        key = normalize_key(key)
        found = self._read({"_id": key}, f"inspect lease {key!r}")
        return found[0] if found else None

    def list(self, prefix: str | None = None, *, include_free: bool = False) -> builtins.list[LeaseInfo]:
        """Leases whose key starts with ``prefix`` (all when None), held ones only unless ``include_free``."""
        match: Document = {}
        if prefix is not None:
            if not isinstance(prefix, str):
                raise ConfigurationError(f"prefix must be a str, got {type(prefix).__name__}")
            import re

            match["_id"] = {"$regex": "^" + re.escape(prefix)}
        infos = self._read(match, "list leases")
        return infos if include_free else [i for i in infos if i.held]

    # -- heartbeat -----------------------------------------------------------------------------------
    @property
    def heartbeat(self) -> Heartbeat:
        """This process's heartbeat (renewal) thread for this store, created on first use."""
        self._check_pid()
        hb = self._heartbeat
        if hb is None:
            from .heartbeat import Heartbeat

            with self._state_lock:
                hb = self._heartbeat
                if hb is None:
                    hb = self._heartbeat = Heartbeat(self)
        return hb

    def _forget(self, lease: Lease) -> None:
        hb = self._heartbeat
        if hb is not None and lease.pid == os.getpid():
            hb.discard(lease)

    def add_lost_callback(self, callback: LostCallback) -> None:
        """Call ``callback(lease, reason)`` whenever a lease of this store is lost."""
        self._lost_callbacks.append(callback)
