"""``DocumentLock``: a lock kept as fields of the document it protects (the SharpLock design).

For users who lock one record (an invoice, an account) rather than a name: the lock and the data are in
one document, so a write to the record and the check that its writer still holds the lock are one atomic
command (``locked.update_one``)::

    with DocumentLock(db.invoices, invoice_id, store=store, ttl=30) as locked:
        locked.update_one({"$set": {"state": "paid"}})  # applied only while the lock is held

The lock is a sub-document of the user's document (``documents.locked`` shows it). It is taken by one
``findAndModify`` on the document (a missing document is an error, nothing is created), kept alive by
the store's heartbeat (one ``update_many`` per collection per tick, beside the store's own leases),
released by clearing its fields, and expires on the server's clock like any lease when its holder dies.

A document lock belongs to a ``LeaseStore``: its commands go through the store's client, with the store's
write concern, timeouts and per-process client (safe across ``fork()``), and it lives in the store's
database. A collection of another database, or on another cluster, is refused.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import os
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import bson
from pymongo import MongoClient, ReadPreference, ReturnDocument
from pymongo.collection import Collection
from pymongo.errors import OperationFailure

from celery_mongolock.core.documents import locked as docs
from celery_mongolock.core.documents.base import holder_info
from celery_mongolock.core.lease import Lease, LostCallback
from celery_mongolock.core.lease_info import aware
from celery_mongolock.core.store_connection import AMBIGUOUS
from celery_mongolock.core.validation import MAX_LEASE_SECONDS, validate_lease_timing, validate_seconds
from celery_mongolock.exceptions import (
    ConfigurationError,
    DocumentLockLost,
    DocumentMissing,
    DocumentWriteUnknown,
    LockContended,
    StoreUnavailable,
)

if TYPE_CHECKING:
    from pymongo.write_concern import WriteConcern

    from celery_mongolock.core.clock import Clock
    from celery_mongolock.core.heartbeat import Heartbeat
    from celery_mongolock.core.store_connection import Connection

__all__ = [
    "DocumentLease",
    "DocumentLock",
    "DocumentLockInfo",
    "DocumentWrite",
    "LockedDocument",
    "force_release_document",
    "inspect_document",
    "renew_documents",
]

log = logging.getLogger("celery_mongolock.acquire")
log_release = logging.getLogger("celery_mongolock.release")


class DocumentLockStore(Protocol):
    """What a document lock needs from its ``LeaseStore``."""

    @property
    def clock(self) -> Clock: ...

    @property
    def connection(self) -> Connection: ...

    @property
    def heartbeat(self) -> Heartbeat: ...

    @property
    def lost_callbacks(self) -> Sequence[LostCallback]: ...

    lease_seconds: float
    heartbeat_seconds: float
    operation_timeout: float
    database_name: str
    write_concern: WriteConcern

    def forget(self, lease: Lease) -> None: ...


@dataclasses.dataclass(frozen=True)
class LockedDocument:
    """Which document a lock is in: the store's database, a collection of it, the ``_id``, the field."""

    collection: str
    id: Any
    field: str
    codec_options: Any = None

    def key(self, database: str) -> str:
        """How the lock is named in logs and errors: ``db.collection[_id]``."""
        return f"{database}.{self.collection}[{self.id!r}]"

    def on(self, store: DocumentLockStore) -> Collection[Any]:
        """The collection, through the store's client and with its settings (and the caller's codecs)."""
        db = store.connection.client[store.database_name]
        options = self.codec_options.with_options(tz_aware=True) if self.codec_options is not None else None
        return db.get_collection(
            self.collection,
            codec_options=options,
            write_concern=store.write_concern,
            read_preference=ReadPreference.PRIMARY,
        )


@dataclasses.dataclass(frozen=True)
class DocumentWrite:
    """What ``DocumentLease.update_one`` did: applied while the lock was held, ``modified`` or not."""

    modified: bool
    fence: int


@dataclasses.dataclass(frozen=True)
class DocumentLockInfo:
    """A document's lock as read (``inspect_document``, the CLI)."""

    key: str
    held: bool
    owner: str | None
    fence: int | None
    expires_at: _dt.datetime | None
    #: Seconds until ``expires_at`` on the server's clock at the read (negative: expired).
    expires_in: float | None
    holder: dict[str, Any]
    acquired_at: _dt.datetime | None
    renewed_at: _dt.datetime | None
    released_at: _dt.datetime | None
    forced_release: bool
    #: The document has the lock's field at all (False: never locked, or the field was removed).
    has_field: bool

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- checks ------------------------------------------------------------------------------------------------
def _addresses(client: MongoClient[Any]) -> set[tuple[str, int | None]]:
    def host(name: str) -> str:
        return "127.0.0.1" if name.lower() in ("localhost", "::1") else name.lower()

    return {(host(h), p) for h, p in client.topology_description.server_descriptions()}


def _document_id(document_or_id: Any) -> Any:
    if isinstance(document_or_id, Mapping):
        if "_id" not in document_or_id:
            raise ConfigurationError(
                "DocumentLock needs the document's _id (or a document that has one); the document given "
                "has no _id: insert it first (an _id that is itself a document: pass {'_id': that})"
            )
        document_or_id = document_or_id["_id"]
    if document_or_id is None:
        raise ConfigurationError("DocumentLock needs the document's _id, got None")
    return document_or_id


def locked_document(
    store: DocumentLockStore, collection: object, document_or_id: Any, field: object
) -> LockedDocument:
    """Check what ``DocumentLock`` was given; the document it names."""
    if not isinstance(collection, Collection):
        raise ConfigurationError(f"DocumentLock needs a pymongo Collection, got {type(collection).__name__}")
    name = validate_field(field)
    _id = _document_id(document_or_id)
    try:
        bson.encode({"_id": _id}, codec_options=collection.codec_options)
    except Exception as exc:
        raise ConfigurationError(
            f"DocumentLock: the _id {_id!r} cannot be sent to MongoDB with the collection's codec "
            f"options ({type(exc).__name__})"
        ) from None
    where = f"{collection.database.name}.{collection.name}"
    if collection.database.name != store.database_name:
        raise ConfigurationError(
            f"DocumentLock: {where} is in database {collection.database.name!r}, but the store's database "
            f"is {store.database_name!r}; a document lock lives in its store's database (use a "
            f"LeaseStore with database={collection.database.name!r})"
        )
    theirs, ours = collection.database.client, store.connection.client
    if theirs is not ours and not (_addresses(theirs) & _addresses(ours)):
        raise ConfigurationError(
            f"DocumentLock: the collection {where} is on another MongoDB deployment than the store "
            f"({sorted(_addresses(theirs))} vs {sorted(_addresses(ours))}); a document lock is sent "
            "through its store's client"
        )
    return LockedDocument(collection.name, _id, name, collection.codec_options)


def validate_field(field: object) -> str:
    """``documents.locked.validate_field``."""
    return docs.validate_field(field)


# -- the held lock -----------------------------------------------------------------------------------------
class _Backend:
    """A ``LeaseBackend`` for one document lock: renew and release the lock fields of its document."""

    def __init__(self, store: DocumentLockStore, target: LockedDocument) -> None:
        self.lock_store = store
        self.target = target

    @property
    def clock(self) -> Clock:
        return self.lock_store.clock

    @property
    def lost_callbacks(self) -> Sequence[LostCallback]:
        return self.lock_store.lost_callbacks

    def renew_lease(self, lease: Lease) -> bool:
        store, t = self.lock_store, self.target
        with store.connection.operation(f"renew document lock {lease.key!r}"):
            result = t.on(store).update_one(
                docs.held_filter(t.field, [t.id], [lease.owner]), docs.renew_pipeline(t.field)
            )
        return result.matched_count == 1

    def release_lease(self, lease: Lease) -> bool:
        store, t = self.lock_store, self.target
        with store.connection.operation(f"release document lock {lease.key!r}"):
            result = t.on(store).update_one(
                {"_id": t.id, f"{t.field}.owner": lease.owner}, docs.release_pipeline(t.field)
            )
        released = result.matched_count == 1
        log_release.info("released document lock %r%s", lease.key, "" if released else " (no longer ours)")
        return released

    def release_later(
        self, key: str, token: str, until: float, *, quiet: bool = False, maybe: bool = False
    ) -> None:
        # A document lock has no acquire that may land late (its take is a plain update, retried with the
        # same token): a lock whose release got no answer expires on the server's clock within its ttl.
        if not quiet:
            log_release.warning("document lock %r: release not answered; it expires on the server", key)

    def forget(self, lease: Lease) -> None:
        self.lock_store.forget(lease)

    def record_lost(self, lease: Lease, reason: str) -> None:
        """Document locks have no lease history (their document says who holds them)."""


class DocumentLease(Lease):
    """A held ``DocumentLock``: a ``Lease`` (``fence``, ``lost``, ``raise_if_lost()``, ``release()``) whose
    ``update_one`` writes the document only while the lock is held."""

    store: _Backend

    @property
    def document(self) -> LockedDocument:
        return self.store.target

    def update_one(self, update: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> DocumentWrite:
        """Apply ``update`` (operators, or a pipeline of ``$set``/``$addFields``/``$unset``) to the
        document in one command, only while this lock holds it: the filter names the holder, the fence
        and an expiry later than the server's now. Raises ``DocumentLockLost`` (and marks the lock lost)
        when it is not held, ``DocumentWriteUnknown`` when the answer did not come (the update may have
        been applied); an update that writes the lock's own field is refused.

        The command is sent once (a plain ``update`` command, not a retryable write): a retry, by the
        driver or by a server that runs it again, would be judged at a later time than the attempt that
        may have landed, and its "no match" would say "not applied" of an applied update."""
        t = self.document
        checked = docs.guarded_update(t.field, update)
        self.raise_if_lost_as(DocumentLockLost)
        lock_store = self.store.lock_store
        coll = t.on(lock_store)
        command = docs.update_command(
            t.collection,
            docs.held_filter(t.field, [t.id], [self.owner], self.fence),
            checked,
            lock_store.write_concern.document,
        )
        try:
            with lock_store.connection.operation(f"update locked document {self.key!r}", retryable=True):
                reply = coll.database.command(command, codec_options=coll.codec_options)
        except AMBIGUOUS as exc:
            raise DocumentWriteUnknown(self.key, self.fence, f"no answer: {type(exc).__name__}") from None
        except OperationFailure as exc:  # a refusal labelled retryable: it may have run before failing
            raise DocumentWriteUnknown(self.key, self.fence, f"error code {exc.code}") from None
        applied = docs.update_reply(reply)
        if applied.error is not None:
            with lock_store.connection.operation(f"update locked document {self.key!r}"):
                raise applied.error
        if applied.matched and applied.write_concern_failed:
            raise DocumentWriteUnknown(self.key, self.fence, "applied, but its write concern failed")
        if applied.matched:
            return DocumentWrite(modified=applied.modified, fence=self.fence)
        reason = "the document no longer names this holder: released by force, expired and taken, or removed"
        self.mark_lost(reason, release=False)
        raise DocumentLockLost(self.key, self.fence, reason)

    def raise_if_lost_as(self, error: type[DocumentLockLost]) -> None:
        if self.lost:
            raise error(self.key, self.fence, self.lost_reason or "lost")
        if self.released:
            raise error(self.key, self.fence, "it was released")

    def __repr__(self) -> str:
        state = "released" if self.released else ("lost" if self.lost else "held")
        return f"<DocumentLease {self.key!r} fence={self.fence} owner={self.owner[:8]} {state}>"


def renew_documents(leases: Sequence[DocumentLease], timeout: float | None = None) -> list[Lease]:
    """Renew document locks, one ``update_many`` per collection (and lock field); return those no longer
    held. A second read is made for a collection only when fewer documents matched than it has locks."""
    groups: dict[tuple[int, str, str], list[DocumentLease]] = {}
    for lease in leases:
        t = lease.document
        groups.setdefault((id(lease.store.lock_store), t.collection, t.field), []).append(lease)
    lost: list[Lease] = []
    for group in groups.values():
        store, t = group[0].store.lock_store, group[0].document
        ids, tokens = [lease.document.id for lease in group], [lease.owner for lease in group]
        match = docs.held_filter(t.field, ids, tokens)
        with store.connection.operation("renew document locks", timeout=timeout):
            coll = t.on(store)
            result = coll.update_many(match, docs.renew_pipeline(t.field))
            if result.matched_count == len(group):
                continue
            live = {
                d.get("o")
                for d in coll.aggregate([{"$match": match}, {"$project": {"o": f"${t.field}.owner"}}])
            }
        lost += [lease for lease in group if lease.owner not in live]
    return lost


# -- taking it -----------------------------------------------------------------------------------------------
class DocumentLock:
    """A lock stored as fields of the document it protects.

    ``DocumentLock(collection, _id, store=store, ttl=30, wait=0)``: ``collection`` is a pymongo collection
    of the store's database (on the store's deployment), ``_id`` the document's ``_id`` (any BSON type) or
    the document itself. ``with`` it to hold the lock: it yields a ``DocumentLease`` whose
    ``update_one(update)`` writes the document only while the lock is held; the heartbeat renews it; the
    block's end releases it. ``wait`` (seconds) waits for a held lock (polling with backoff up to
    ``max_poll_interval``), then raises ``LockContended`` naming the holder, as ``LeaseStore.hold``. A block
    that ends normally after its lock was lost raises ``DocumentLockLost``.

    ``field`` is the document's field the lock lives in (``mongolock``): a document whose field of that
    name is its own gets a clear error, never overwritten. A missing document raises ``DocumentMissing``.
    """

    def __init__(
        self,
        collection: Collection[Any],
        document_or_id: Any,
        *,
        store: DocumentLockStore,
        ttl: float | None = None,
        wait: float = 0.0,
        info: Mapping[str, Any] | None = None,
        heartbeat_seconds: float | None = None,
        field: str = docs.DEFAULT_FIELD,
        poll_interval: float = 0.05,
        max_poll_interval: float = 1.0,
    ) -> None:
        if not callable(getattr(type(store), "forget", None)):  # (on the type: no property evaluated)
            raise ConfigurationError(
                f"DocumentLock(store=...) must be the LeaseStore whose leases guard the document, got "
                f"{type(store).__name__}"
            )
        self.store = store
        self.target = locked_document(store, collection, document_or_id, field)
        self.key = self.target.key(store.database_name)
        self.ttl, self.heartbeat_seconds = validate_lease_timing(
            store.lease_seconds if ttl is None else ttl,
            heartbeat_seconds
            if heartbeat_seconds is not None
            else (store.heartbeat_seconds if ttl is None else None),
            name="lease_seconds" if ttl is None else "ttl",
        )
        self.wait = validate_seconds("wait", wait, low=0.0, high=MAX_LEASE_SECONDS)
        self.poll_interval = validate_seconds("poll_interval", poll_interval, low=0.001, high=60.0)
        self.max_poll_interval = validate_seconds(
            "max_poll_interval", max_poll_interval, low=0.001, high=60.0
        )
        self.holder = holder_info(store.connection.host, os.getpid(), info)
        self._held: list[DocumentLease] = []

    def try_acquire(self) -> tuple[DocumentLease | None, dict[str, Any]]:
        """One attempt (one ``findAndModify``, retried with the same token on an ambiguous outcome):
        ``(lease, lock fields)``, the lease None when another holder has it."""
        store, t = self.store, self.target
        token = uuid.uuid4().hex
        pipeline = docs.acquire_pipeline(t.field, token, int(self.ttl * 1000), self.holder)
        clock = store.clock
        sent = clock.monotonic()
        give_up_at = sent + store.operation_timeout
        while True:
            try:
                with store.connection.operation(f"lock document {self.key!r}", retryable=True):
                    doc = t.on(store).find_one_and_update(
                        {"_id": t.id}, pipeline, projection={t.field: 1}, return_document=ReturnDocument.AFTER
                    )
                break
            except AMBIGUOUS as exc:  # the same token again: a copy that landed reads as ours
                if clock.monotonic() >= give_up_at:
                    raise store.connection.unavailable(f"lock document {self.key!r}", exc) from None
                clock.sleep(0.05)
        state = docs.state_of(t.field, doc, token)
        if state == "missing":
            raise DocumentMissing(
                f"DocumentLock: no document {self.key} (a lock is kept inside its document)"
            )
        lock = dict((doc or {}).get(t.field) or {}) if state != "collision" else {}
        if state == "collision":
            raise ConfigurationError(
                f"DocumentLock: the document {self.key} has a field {t.field!r} of its own; the lock would "
                "overwrite it (pass field= another name)"
            )
        if state == "held":
            return None, lock
        lease = DocumentLease(
            _Backend(store, t),
            self.key,
            token,
            fence=int(lock["fence"]),
            ttl=self.ttl,
            heartbeat_seconds=self.heartbeat_seconds,
            expires_at=aware(lock.get("expires_at")),
            sent_at=sent,
            holder=self.holder,
            acquired_at=aware(lock.get("acquired_at")),
        )
        store.heartbeat.add(lease)
        log.info("locked document %s (fence %s)", self.key, lease.fence)
        return lease, lock

    def acquire(self) -> DocumentLease:
        """Take the lock, waiting up to ``wait`` seconds; ``LockContended`` if it stays held."""
        clock = self.store.clock
        give_up_at = clock.monotonic() + self.wait
        interval = self.poll_interval
        while True:
            lease, lock = self.try_acquire()
            if lease is not None:
                return lease
            remaining = give_up_at - clock.monotonic()
            if remaining <= 0:
                raise LockContended(self.key, lock.get("holder") or {}, aware(lock.get("expires_at")))
            clock.sleep(min(interval, remaining))
            interval = min(interval * 2, self.max_poll_interval)

    def __enter__(self) -> DocumentLease:
        lease = self.acquire()
        self._held.append(lease)
        return lease

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        lease = self._held.pop()
        try:
            lease.release()
        except StoreUnavailable as exc:
            log_release.warning("%s", exc)
        if exc_type is None and lease.lost:
            raise DocumentLockLost(lease.key, lease.fence, lease.lost_reason or "lost")


# -- an operator's view ------------------------------------------------------------------------------------
def inspect_document(store: DocumentLockStore, target: LockedDocument) -> DocumentLockInfo | None:
    """The lock of ``target``'s document (None: no such document)."""
    with store.connection.operation(f"inspect document lock {target.key(store.database_name)!r}"):
        rows = list(target.on(store).aggregate(docs.read_pipeline(target.field, target.id)))
    if not rows:
        return None
    lock = rows[0].get("lock")
    ours = isinstance(lock, Mapping) and lock.get("lock") == docs.MARKER
    lock = dict(lock) if ours and isinstance(lock, Mapping) else {}
    ms = rows[0].get("expires_in_ms")
    expires_in = None if ms is None else ms / 1000.0
    return DocumentLockInfo(
        key=target.key(store.database_name),
        held=bool(lock.get("owner")) and expires_in is not None and expires_in > 0,
        owner=lock.get("owner"),
        fence=lock.get("fence"),
        expires_at=aware(lock.get("expires_at")),
        expires_in=expires_in,
        holder=dict(lock.get("holder") or {}),
        acquired_at=aware(lock.get("acquired_at")),
        renewed_at=aware(lock.get("renewed_at")),
        released_at=aware(lock.get("released_at")),
        forced_release=bool(lock.get("forced_release")),
        has_field=ours,
    )


def force_release_document(store: DocumentLockStore, target: LockedDocument) -> bool:
    """Clear the lock of ``target``'s document whoever holds it (an operator's tool); True if it was held.
    The holder learns at its next renewal or write (its lock becomes lost)."""
    key = target.key(store.database_name)
    with store.connection.operation(f"force-release document lock {key!r}"):
        result = target.on(store).update_one(
            {"_id": target.id, f"{target.field}.lock": docs.MARKER, f"{target.field}.owner": {"$ne": None}},
            docs.force_release_pipeline(target.field),
        )
    log_release.warning(
        "force-released document lock %r: %s", key, "it was held" if result.matched_count else "it was free"
    )
    return result.matched_count == 1
