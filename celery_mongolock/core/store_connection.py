"""The lease store's connection to MongoDB: one client per process (fork safety), the lease and history
collections and their indexes, MongoDB's errors in our words (``operation``), and ``close``.

A part of ``LeaseStore`` (``store``), which reads its settings from the store that owns it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import pymongo
from pymongo import MongoClient
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

from celery_mongolock.core.documents.base import Document
from celery_mongolock.core.documents.lanes import SPILL_SUFFIX
from celery_mongolock.core.urls import describe_refusal, redact
from celery_mongolock.exceptions import ConfigurationError, LeaseLost, LockContended, StoreUnavailable

if TYPE_CHECKING:
    from celery_mongolock.core.heartbeat import Heartbeat

__all__ = ["AMBIGUOUS", "CLOSE_SECONDS", "Connection", "ConnectionSettings", "checked_settings"]

log_history = logging.getLogger("celery_mongolock.history")

#: Seconds ``LeaseStore.close()`` and ``release_held()`` may take at most, whatever MongoDB does.
CLOSE_SECONDS = 1.0

#: Errors after which we cannot know whether the server applied the write.
AMBIGUOUS = (
    AutoReconnect,
    ConnectionFailure,
    NetworkTimeout,
    ExecutionTimeout,
    WTimeoutError,
    WriteConcernError,
)


class ConnectionSettings(Protocol):
    """What the connection reads from the store that owns it (``LeaseStore`` implements it)."""

    @property
    def database_name(self) -> str: ...

    @property
    def collection_name(self) -> str: ...

    @property
    def write_concern(self) -> WriteConcern: ...

    @property
    def read_preference(self) -> _ServerMode: ...

    @property
    def client_options(self) -> Mapping[str, Any]: ...

    @property
    def operation_timeout(self) -> float: ...

    @property
    def history_days(self) -> float: ...


# Every connection of the process, so that a forked child gets fresh locks: a lock another thread of the
# parent (a heartbeat, a release) held at the moment of fork would otherwise stay locked in the child.
_CONNECTIONS: weakref.WeakSet[Connection] = weakref.WeakSet()


def checked_settings(
    write_concern: WriteConcern | None,
    read_preference: _ServerMode | None,
    client_options: Mapping[str, Any] | None,
) -> None:
    """``LeaseStore``'s pymongo settings are of the types it uses (a clear error otherwise)."""
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


def _after_fork_in_child() -> None:
    for connection in list(_CONNECTIONS):
        connection.state_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Connection:
    """This process's client, collections and heartbeat slot for one store (``client_or_url``: a
    ``MongoClient`` used as is, or a validated URL from which a client is made lazily per process)."""

    def __init__(
        self, settings: ConnectionSettings, url: str | None, given_client: MongoClient[Document] | None
    ) -> None:
        self.settings = settings
        self.raw_url = url
        self.given_client = given_client
        self.state_lock = threading.Lock()
        self.pid = os.getpid()
        _CONNECTIONS.add(self)
        self.client_cache: MongoClient[Document] | None = None
        self.indexes_ready = False
        #: This process's heartbeat thread of the store (``heartbeat``), None until first used.
        self.started_heartbeat: Heartbeat | None = None
        # Heartbeat threads of this store that close() stopped but could not wait for: they get no new
        # client (one made after close() would never be closed).
        self.retired: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        #: This machine's name, in the holder of every lease taken.
        self.host = socket.gethostname()

    # -- per process ---------------------------------------------------------------------------------
    def check_pid(self) -> None:
        pid = os.getpid()
        if pid != self.pid:
            # A forked child: the parent's client, heartbeat thread and index flag are not ours.
            with self.state_lock:
                if pid != self.pid:
                    self.client_cache = None
                    self.started_heartbeat = None
                    self.indexes_ready = False
                    self.pid = pid

    @property
    def client(self) -> MongoClient[Document]:
        """This process's MongoClient (created on first use when the store was given a URL)."""
        if self.given_client is not None:
            return self.given_client
        self.check_pid()
        client = self.client_cache
        if client is None:
            if threading.current_thread() in self.retired:
                raise StoreUnavailable(f"{self.settings!r} was closed")
            with self.state_lock:
                client = self.client_cache
                if client is None:
                    client = self.client_cache = self._new_client()
        return client

    def _new_client(self) -> MongoClient[Document]:
        timeout = self.settings.operation_timeout
        options: dict[str, Any] = {
            "appname": "celery_mongolock",
            "serverSelectionTimeoutMS": int(timeout * 1000),
            "connectTimeoutMS": int(min(timeout, 10.0) * 1000),
            "tz_aware": True,
        }
        options.update(self.settings.client_options)
        assert self.raw_url is not None
        try:
            return MongoClient(self.raw_url, **options)
        except (PyMongoError, ValueError, TypeError, OSError) as exc:
            raise ConfigurationError(f"cannot create a MongoDB client: {redact(str(exc))}") from None

    def heartbeat(self, make: Callable[[], Heartbeat]) -> Heartbeat:
        """This process's heartbeat thread for the store, made by ``make`` on first use."""
        self.check_pid()
        hb = self.started_heartbeat
        if hb is None:
            with self.state_lock:
                hb = self.started_heartbeat
                if hb is None:
                    hb = self.started_heartbeat = make()
        return hb

    def has_writable_server(self) -> bool:
        """True if the driver currently knows a primary (no I/O)."""
        return bool(self.client.topology_description.has_writable_server())

    @property
    def collection(self) -> Collection[Document]:
        s = self.settings
        return self.client[s.database_name].get_collection(
            s.collection_name, write_concern=s.write_concern, read_preference=s.read_preference
        )

    @property
    def history_collection_name(self) -> str:
        return f"{self.settings.collection_name}.history"

    @property
    def history_collection(self) -> Collection[Document]:
        s = self.settings
        return self.client[s.database_name].get_collection(
            self.history_collection_name, write_concern=s.write_concern, read_preference=s.read_preference
        )

    @property
    def spill_collection(self) -> Collection[Document]:
        """Where a key's parked runs beyond its window are kept (``documents.spill``)."""
        s = self.settings
        return self.client[s.database_name].get_collection(
            s.collection_name + SPILL_SUFFIX, write_concern=s.write_concern, read_preference=s.read_preference
        )

    @property
    def url(self) -> str | None:
        """The URL with credentials masked (None when the store was given a client)."""
        return redact(self.raw_url) if self.raw_url else None

    def close(self, timeout: float, release_held: Callable[[float], int]) -> None:
        """``LeaseStore.close``: ``release_held`` the heartbeat's leases, stop it, close our client."""
        deadline = time.monotonic() + timeout
        # One deadline (pymongo CSOT, nested ones only shorten it) for every MongoDB call below, the
        # driver's own endSessions in MongoClient.close() included: that one waited a whole
        # serverSelectionTimeoutMS for a server that was gone.
        with pymongo.timeout(timeout):
            try:
                hb = self.started_heartbeat
                if hb is not None and hb.pid == os.getpid():
                    release_held(timeout)
                    hb.stop(timeout=max(0.0, deadline - time.monotonic()))
                    if hb.thread is not None and hb.thread.is_alive():  # in a call MongoDB does not answer
                        self.retired.add(hb.thread)
                    # the records of leases that ended since the last tick
                    hb.flush_history(timeout=max(0.01, deadline - time.monotonic()))
            finally:
                # Whatever happened above (a release or flush that raised at the deadline), the client
                # and its sockets are closed: a store that is closed holds no connection.
                self.started_heartbeat = None
                client, self.client_cache = self.client_cache, None
                if client is not None and self.pid == os.getpid():
                    client.close()

    # -- error handling ------------------------------------------------------------------------------
    def unavailable(self, action: str, exc: BaseException) -> StoreUnavailable:
        """``exc`` (a driver error while trying to ``action``) as the ``StoreUnavailable`` to raise."""
        refused = self.refused(action, exc)
        if refused is not None:
            return refused
        s = self.settings
        where = f"({s.database_name}.{s.collection_name})"
        if isinstance(exc, OperationFailure) and not isinstance(exc, AMBIGUOUS):
            # It answered, with an error (e.g. InternalError on a document it could not write).
            code = f" (code {exc.code})" if exc.code is not None else ""
            return StoreUnavailable(
                f"MongoDB answered with an error while trying to {action} {where}: {type(exc).__name__}"
                f"{code}: {redact(str(exc))[:500]}"
            )
        return StoreUnavailable(
            f"MongoDB did not answer while trying to {action} {where}: {type(exc).__name__}: "
            f"{redact(str(exc))[:500]}"
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
            with pymongo.timeout(timeout if timeout is not None else self.settings.operation_timeout):
                yield
        except (DuplicateKeyError, LeaseLost, LockContended):
            raise
        except OperationFailure as exc:
            refused = self.refused(action, exc)
            if refused is not None:
                raise refused from None
            if retryable and (isinstance(exc, AMBIGUOUS) or exc.has_error_label("RetryableWriteError")):
                raise
            raise self.unavailable(action, exc) from None
        except AMBIGUOUS as exc:
            if retryable and not isinstance(exc, ServerSelectionTimeoutError):
                raise
            raise self.unavailable(action, exc) from None
        except PyMongoError as exc:
            raise self.unavailable(action, exc) from None

    def refused(self, action: str, exc: BaseException) -> StoreUnavailable | None:
        """MongoDB's refusal of our login, rights or its TLS certificate, in our words (None if ``exc`` is
        not one); the server's own message, whose wording varies, is not shown."""
        s = self.settings
        client = self.given_client or self.client_cache
        credentials = None
        if self.raw_url is not None:
            credentials = "@" in self.raw_url.split("?", 1)[0] or any(
                k.lower() == "username" for k in s.client_options
            )
        why = describe_refusal(exc, client, s.database_name, credentials)
        if why is None:
            return None
        return StoreUnavailable(f"MongoDB refused to {action} ({s.database_name}.{s.collection_name}): {why}")

    # -- indexes -------------------------------------------------------------------------------------
    def ensure_indexes(self) -> None:
        """``LeaseStore.ensure_indexes``: the lease collection's indexes, and the history's."""
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
                        s = self.settings
                        raise ConfigurationError(
                            f"collection {s.database_name}.{s.collection_name} has an index that "
                            f"conflicts with {options['name']!r}: {exc.details and exc.details.get('errmsg')}"
                        ) from None
                    if exc.code != 68:
                        raise
            spill_indexes: tuple[tuple[list[tuple[str, int]], dict[str, Any]], ...] = (
                # A run stored once per key: a copy of a spilled run is told apart by its insert.
                ([("k", pymongo.ASCENDING), ("rid", pymongo.ASCENDING)], {"name": "k_rid", "unique": True}),
                # Tombstones (only they have ``xa``) are deleted by the server a day after they were made.
                ([("xa", pymongo.ASCENDING)], {"name": "xa_ttl", "expireAfterSeconds": 0}),
            )
            for spec, options in spill_indexes:
                try:
                    self.spill_collection.create_index(spec, **options)
                except OperationFailure as exc:
                    if exc.code != 68:
                        raise
            try:
                coll.drop_index("expires_at_ttl")
            except OperationFailure as exc:
                if exc.code != 27:  # IndexNotFound: the usual case
                    raise
        if self.settings.history_days:
            self.ensure_history_indexes()
        self.indexes_ready = True

    def ensure_history_indexes(self) -> None:
        """The history collection's indexes: by key and fence, and the TTL index on the end (``e``) with
        ``expireAfterSeconds = history_days * 86400``; a changed ``history_days`` is applied with
        ``collMod``."""
        coll = self.history_collection
        days = self.settings.history_days
        ttl = int(days * 86400)
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
                            f"collection {self.settings.database_name}.{self.history_collection_name} has "
                            f"an index that conflicts with {options['name']!r}: "
                            f"{exc.details and exc.details.get('errmsg')}"
                        ) from None
                    # Another history_days: apply ours (the setting says how long records are kept).
                    self.client[self.settings.database_name].command(
                        {
                            "collMod": self.history_collection_name,
                            "index": {"name": "e_ttl", "expireAfterSeconds": ttl},
                        }
                    )
                    log_history.info("lease history: records now kept %g days (was %g)", days, old / 86400)

    def ready_collection(self) -> Collection[Document]:
        """The lease collection, its indexes made first in this process."""
        self.check_pid()
        if not self.indexes_ready:
            self.ensure_indexes()
        return self.collection
