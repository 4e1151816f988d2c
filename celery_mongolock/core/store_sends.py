"""The records of pending unique sends (``unique_send=True``), in ``<collection>.sends``: claim, forget,
list by key. The record and its update are in ``documents.sends``; this module only sends them.

Not a part of ``LeaseStore``'s façade: only tasks with ``unique_send`` use it (``sends_of(store)``), so a
store whose tasks never dedupe sends creates neither the collection nor its indexes.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pymongo
from pymongo import ReturnDocument
from pymongo.errors import DuplicateKeyError, OperationFailure

from celery_mongolock.core.documents.base import Document
from celery_mongolock.core.documents.sends import PendingSend, claim_update, started_after
from celery_mongolock.exceptions import StoreUnavailable

if TYPE_CHECKING:
    from pymongo.collection import Collection

    from celery_mongolock.core.store import LeaseStore

__all__ = ["SendRecords", "sends_of"]


class SendRecords:
    """The pending unique sends of one lease store."""

    def __init__(self, store: LeaseStore) -> None:
        self.store = store
        self._ready_pid: int | None = None

    @property
    def collection_name(self) -> str:
        return f"{self.store.collection_name}.sends"

    @property
    def collection(self) -> Collection[Document]:
        store = self.store
        return store.client[store.database_name].get_collection(
            self.collection_name, write_concern=store.write_concern, read_preference=store.read_preference
        )

    def _ready(self) -> Collection[Document]:
        """The collection, its indexes made first in this process: by task id (``forget``), by key
        (``pending``), and the TTL index on the bound ``x`` (a clean-up only: a record past its bound
        claims nothing whether or not it was deleted yet)."""
        coll = self.collection
        if self._ready_pid != os.getpid():
            with self.store.operation("create the unique-send indexes"):
                for field, ttl in (("t", None), ("k", None), ("x", 0)):
                    options: dict[str, Any] = {} if ttl is None else {"expireAfterSeconds": ttl}
                    try:
                        coll.create_index([(field, pymongo.ASCENDING)], name=f"{field}_1", **options)
                    except OperationFailure as exc:
                        if exc.code != 68:  # created meanwhile by another process
                            raise
            self._ready_pid = os.getpid()
        return coll

    def claim(
        self,
        digest: str,
        task_id: str,
        task_name: str,
        keys: Sequence[str],
        bound_ms: int,
        *,
        stamp: int | None = None,
    ) -> str:
        """One ``findAndModify``: make ``task_id`` (sent at ``stamp``) the pending run of ``digest`` unless
        a live record names another. Returns the task id the record names now (``task_id``: this send
        publishes)."""
        coll = self._ready()
        update = claim_update(task_id, task_name, keys, bound_ms, stamp)
        for _ in range(3):
            try:
                with self.store.operation(f"check for a pending send of {task_name!r}"):
                    doc = coll.find_one_and_update(
                        {"_id": digest}, update, upsert=True, return_document=ReturnDocument.AFTER
                    )
            except DuplicateKeyError:
                # Two upserts of a new record at once: one inserted it; the other, sent again, reads it.
                continue
            if doc is not None and doc.get("t") is not None:
                return str(doc["t"])
            # No record in the reply of an upsert: the embedded server's answer to the loser of two
            # upserts at once (MongoDB retries those itself); sent again, it reads the winner's record.
        raise StoreUnavailable(
            f"the pending send of {task_name!r} could not be checked: no answer named a run"
        )

    def overtaken(self, digest: str, pending: str, keys: Sequence[str]) -> bool:
        """Whether a record of another send of the same keys was claimed after (or in the same
        millisecond as) the record ``digest`` that names the pending run ``pending`` (``Replace``: that
        newer send supersedes the pending run, so a send equal to the pending one is newer still and must
        not be absorbed by it). A record past its bound counts too: publishing is the safe side. So does a
        newer send whose body has started (its record is gone): a key's newest send that got it was sent
        after the pending run's stamp (``p``)."""
        coll = self._ready()
        with self.store.operation(f"check for a newer send of {sorted(keys)}"):
            record = coll.find_one({"_id": digest, "t": pending}, {"s": 1, "p": 1})
            if record is None or record.get("s") is None:
                return False
            newer = coll.find_one(
                {
                    "k": sorted(keys),
                    "t": {"$ne": pending},
                    "s": {"$gte": record["s"]},
                },
                {"_id": 1},
            )
            if newer is None and isinstance(record.get("p"), int):
                newer = self.store.collection.find_one(started_after(keys, record["p"]), {"_id": 1})
        return newer is not None

    def take_over(
        self, digest: str, pending: str, task_id: str, bound_ms: int, stamp: int | None = None
    ) -> bool:
        """Make ``task_id`` (sent at ``stamp``) the pending run of the record ``digest`` in place of
        ``pending`` (one ``findAndModify``); False if the record no longer names ``pending``."""
        fields: Document = {"t": task_id, "s": "$$NOW", "x": {"$add": ["$$NOW", int(bound_ms)]}}
        if stamp is not None:
            fields["p"] = {"$literal": int(stamp)}
        update = [{"$set": fields}]
        with self.store.operation(f"take over the pending send of {pending}"):
            doc = self._ready().find_one_and_update({"_id": digest, "t": pending}, update, {"_id": 1})
        return doc is not None

    def forget(self, task_id: str) -> bool:
        """Remove the record whose pending run is ``task_id`` (its body starts, or it will never run)."""
        with self.store.operation(f"forget the pending send of {task_id}"):
            return bool(self._ready().delete_one({"t": task_id}).deleted_count)

    def pending(self, key: str, limit: int = 20) -> list[PendingSend]:
        """The pending sends whose run holds ``key``, oldest first (records past their bound included:
        ``until`` says so)."""
        with self.store.operation(f"read the pending sends of {key!r}"):
            docs = list(self.collection.find({"k": key}).sort("s", pymongo.ASCENDING).limit(limit))
        return [PendingSend.from_document(doc) for doc in docs]


_records: weakref.WeakKeyDictionary[LeaseStore, SendRecords] = weakref.WeakKeyDictionary()
_records_lock = threading.Lock()


def sends_of(store: LeaseStore) -> SendRecords:
    """The ``SendRecords`` of ``store`` (one per store)."""
    with _records_lock:
        records = _records.get(store)
        if records is None:
            records = _records[store] = SendRecords(store)
        return records
