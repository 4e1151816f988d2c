"""The lease store's history and reads: the records of ended leases (queued for the heartbeat, written
in batches), ``why`` and ``history`` of a key, and ``inspect``/``list`` of lease documents.

A part of ``LeaseStore`` (``store``).
"""

from __future__ import annotations

import builtins
import datetime as _dt
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import pymongo
from pymongo.errors import BulkWriteError

from celery_mongolock.core.documents import base as documents
from celery_mongolock.core.documents import kind_waits
from celery_mongolock.core.documents.base import Document
from celery_mongolock.core.documents.lanes import lanes_of
from celery_mongolock.core.history import KeyStory, LeaseEnding, merge_endings
from celery_mongolock.core.keys import normalize_key
from celery_mongolock.core.lease import LeaseInfo
from celery_mongolock.exceptions import ConfigurationError

if TYPE_CHECKING:
    from celery_mongolock.core.clock import Clock
    from celery_mongolock.core.heartbeat import Heartbeat
    from celery_mongolock.core.lease import Lease
    from celery_mongolock.core.store_connection import Connection
    from celery_mongolock.core.store_spill import Spill

__all__ = ["ENDING_FIELDS", "Records", "RecordsOwner"]

#: Holder info fields and the ending fields they are recorded as (``documents.ending_expr``).
ENDING_FIELDS = {
    "task_id": "t",
    "task_name": "n",
    "delivery": "run",
    "host": "host",
    "pid": "pid",
    "worker": "worker",
}


class RecordsOwner(Protocol):
    """What the history part needs from the store that owns it (``LeaseStore`` implements it)."""

    @property
    def clock(self) -> Clock: ...

    @property
    def history_days(self) -> float: ...

    @property
    def connection(self) -> Connection: ...

    @property
    def heartbeat(self) -> Heartbeat: ...

    @property
    def spill(self) -> Spill: ...


class Records:
    """The history records of one store's leases, and its reads of lease documents."""

    def __init__(self, store: RecordsOwner) -> None:
        self.store = store

    # -- records of this process's leases (no I/O: the heartbeat writes them) --------------------------
    def server_now(self, lease: Lease) -> _dt.datetime:
        """The server's time now, estimated from the lease's acquisition (server time) carried forward on
        the monotonic clock: no round trip. Off by at most the acquire's round trip and the drift."""
        if lease.acquired_at is None:
            return _dt.datetime.now(_dt.timezone.utc)
        elapsed = max(0.0, self.store.clock.monotonic() - lease.acquired_mono)
        now = lease.acquired_at + _dt.timedelta(seconds=elapsed)
        return now.replace(microsecond=now.microsecond // 1000 * 1000)  # BSON dates are milliseconds

    def local_ending(
        self, lease: Lease, how: str, view: str = documents.SERVER_VIEW, **extra: Any
    ) -> Document:
        """The history record of ``lease``'s end as this process saw it (no I/O)."""
        holder = lease.holder
        ending: Document = {
            field: holder[name] for name, field in ENDING_FIELDS.items() if holder.get(name) is not None
        }
        if "n" not in ending and holder.get("role") is not None:
            ending["n"] = holder["role"]
        ending.update(
            f=lease.fence, a=lease.acquired_at, e=self.server_now(lease), w=lease.waited_ms, how=how, **extra
        )
        return documents.history_record(lease.key, ending, view)

    def record(self, record: Document) -> None:
        """Queue a history record; the heartbeat thread inserts it at its next tick."""
        if self.store.history_days:
            self.store.heartbeat.record(record)

    def record_endings(self, key: str, doc: Mapping[str, Any], hows: Sequence[str]) -> None:
        """Queue for the history the endings of ``doc`` (a command's reply with its last ``ends``) whose
        ``how`` is one of ``hows``: those that command wrote for a holder that did not end its lease itself
        (its own ending is recorded by its holder). A record already in the history is skipped there."""
        if not self.store.history_days:
            return
        for ending in doc.get("ends") or []:
            if isinstance(ending, Mapping) and ending.get("how") in hows and ending.get("f") is not None:
                self.record(documents.history_record(key, dict(ending)))

    def record_takeovers(self, key: str, doc: Mapping[str, Any]) -> None:
        """Queue for the history the endings that the command whose reply is ``doc`` wrote for a lease (or
        a handoff) it found lapsed as it handed the key on (``documents.TAKEOVER_ENDINGS``). A single
        lease's ending carries ``seen``, the command's time, which is the ``hat`` of the handoff it made:
        only those are taken, not an older takeover still among the endings kept. A slot's carries none:
        each is taken (one already in the history is skipped there)."""
        hats = [doc.get("ho")] + [h.get("ho") for h in doc.get("hs") or [] if isinstance(h, Mapping)]
        made = {ho.get("hat") for ho in hats if isinstance(ho, Mapping) and ho.get("hat") is not None}
        ends = [e for e in doc.get("ends") or [] if isinstance(e, Mapping)]
        mine = [e for e in ends if e.get("seen") is None or e.get("seen") in made]
        self.record_endings(key, {"ends": mine}, documents.TAKEOVER_ENDINGS)

    def record_lost(self, lease: Lease, reason: str) -> None:
        """``LeaseStore.record_lost``."""
        if lease.acquired_at is not None:  # a lease this store issued (not a made-up Lease object)
            self.record(self.local_ending(lease, "lost", documents.HOLDER_VIEW, why=reason))

    # -- the history collection ------------------------------------------------------------------------
    def write_history(
        self, records: builtins.list[Document], copies: Sequence[Document] = (), timeout: float | None = None
    ) -> int:
        """Insert history records (``insert_many``, unordered; a record already there is skipped: its
        ``_id`` is key + fence + view). ``copies``: lease documents (filters) whose endings are copied in
        as well, read in one ``find``. Returns how many were new. ``StoreUnavailable`` if MongoDB does not
        answer."""
        if not self.store.history_days:
            return 0
        records = builtins.list(records)
        connection = self.store.connection
        if not connection.indexes_ready:  # the TTL index before the first record (an operator's process)
            connection.ensure_indexes()
        with connection.operation("write the lease history", timeout=timeout):
            if copies:
                query = copies[0] if len(copies) == 1 else {"$or": list(copies)}
                for doc in connection.collection.find(query, {"ends": 1}):
                    records += [documents.history_record(doc["_id"], e) for e in doc.get("ends") or []]
            if not records:
                return 0
            try:
                return len(connection.history_collection.insert_many(records, ordered=False).inserted_ids)
            except BulkWriteError as exc:
                errors = exc.details.get("writeErrors") or []
                if any(e.get("code") != 11000 for e in errors):
                    raise
                return int(exc.details.get("nInserted") or 0)

    def flush_history(self, timeout: float | None = None) -> bool:
        """``LeaseStore.flush_history``."""
        hb = self.store.connection.started_heartbeat
        if hb is None or hb.pid != os.getpid():
            return True
        return hb.flush_history(timeout=timeout)

    def why(self, key: str, *, parked_limit: int | None = None) -> KeyStory | None:
        """``LeaseStore.why``: the document in one command, the newest history records in a second."""
        key = normalize_key(key)
        parked_limit = _page_size(parked_limit, "parked_limit")
        connection = self.store.connection
        with connection.operation(f"read lease {key!r}"):
            docs = list(connection.collection.aggregate(documents.story_pipeline(key, parked_limit)))
            stored: builtins.list[Document] = []
            if docs and self.store.history_days:
                # Endings ``ends`` does not keep: runs that ended while parked, and older ones.
                stored = list(
                    connection.history_collection.find({"k": key}).sort("f", pymongo.DESCENDING).limit(16)
                )
        if not docs:
            return None
        doc = self._without_gone(key, docs[0])
        window = doc.get("q") or []
        ranks = [
            int(la.get("r", 0)) for la in doc.get("sp") or [] if int(la.get("t", 0)) > int(la.get("h", 0))
        ]
        whole_window = parked_limit is None or len(window) < parked_limit
        last_rank = int(window[-1].get("pr") or 0) if window else 0
        if ranks and (whole_window or min(ranks) < last_rank):
            # Runs spilled beyond the window come before some of those shown (they follow the window's of
            # their rank, and go before those of a higher one): the first ones in queue order, from the
            # whole window and the spill (read by ``_id``).
            whole = doc if whole_window else self.read({"_id": key}, f"read lease {key!r}", raw=True)[0]
            doc = {**doc, "q": self.store.spill.page(key, whole, 0, parked_limit)}
        return KeyStory.from_document(doc, stored, documents.HOLDER_VIEW)

    def note_kind_wait(
        self, key: str, task_id: str, task_name: str, wants: str, since_ms: int | None
    ) -> None:
        """``LeaseStore.note_kind_wait``: one update of the key's document (none when it has none)."""
        key = normalize_key(key)
        connection = self.store.connection
        with connection.operation(f"note a run waiting on {key!r}"):
            connection.collection.update_one(
                {"_id": key}, kind_waits.note_update(task_id, task_name, wants, since_ms)
            )

    def history(self, key: str, limit: int = 20) -> builtins.list[LeaseEnding]:
        """``LeaseStore.history``: the history collection merged with the document's ``ends``."""
        key = normalize_key(key)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigurationError(f"limit must be a positive int, got {limit!r}")
        connection = self.store.connection
        with connection.operation(f"read the history of {key!r}"):
            doc = connection.collection.find_one({"_id": key}, {"ends": 1}) or {}
            stored: builtins.list[Document] = []
            if self.store.history_days:
                stored = list(
                    connection.history_collection.find({"k": key})
                    .sort("f", pymongo.DESCENDING)
                    .limit(limit * 2)
                )
        return merge_endings(key, doc.get("ends") or [], stored, limit, documents.HOLDER_VIEW)

    # -- reading lease documents -----------------------------------------------------------------------
    def read(
        self,
        match: Document,
        action: str,
        *,
        parked_from: int = 0,
        parked_limit: int | None = None,
        raw: bool = False,
    ) -> builtins.list[Any]:
        """The lease documents ``match`` finds, as ``LeaseInfo`` (one command); ``raw``: as read."""
        parked_limit = _page_size(parked_limit, "parked_limit")
        if isinstance(parked_from, bool) or not isinstance(parked_from, int) or parked_from < 0:
            raise ConfigurationError(f"parked_from must be an int >= 0, got {parked_from!r}")
        pipeline = documents.read_pipeline(match, parked_from=parked_from, parked_limit=parked_limit)
        connection = self.store.connection
        with connection.operation(action):
            docs = list(connection.collection.aggregate(pipeline))
        if raw:
            return docs
        return [documents.lease_info(d, parked_from if parked_limit is not None else 0) for d in docs]

    def inspect(self, key: str, *, parked_from: int = 0, parked_limit: int | None = None) -> LeaseInfo | None:
        """``LeaseStore.inspect``. A key with runs spilled beyond its window: its page of parked runs is
        read from its whole window and the spill (``Spill.page``)."""
        key = normalize_key(key)
        action = f"inspect lease {key!r}"
        found = self.read({"_id": key}, action, parked_from=parked_from, parked_limit=parked_limit, raw=True)
        if not found:
            return None
        doc = self._without_gone(key, found[0])
        if any(int(lane.get("t", 0)) > int(lane.get("h", 0)) for lane in doc.get("sp") or []):
            if parked_limit is not None:  # (the whole window: a key that spills keeps a short one)
                whole = self.read({"_id": key}, action, raw=True)
                # (its count as read first, less the runs that left: a trial's queue --page counted 2,288
                # tombstones as parked runs after a purge, stop 65)
                doc = {**whole[0], "__parked_total": doc["__parked_total"]} if whole else doc
            entries = self.store.spill.page(key, doc, parked_from, parked_limit)
            doc = {**doc, "q": entries}
        return documents.lease_info(doc, parked_from)

    def list(
        self, prefix: str | None = None, *, include_free: bool = False, parked_limit: int | None = None
    ) -> builtins.list[LeaseInfo]:
        """``LeaseStore.list``."""
        docs = self.read(documents.prefix_filter(prefix), "list leases", parked_limit=parked_limit, raw=True)
        infos = [documents.lease_info(self._without_gone(str(d["_id"]), d)) for d in docs]
        return infos if include_free else [i for i in infos if i.held or i.parked_total or i.handoff]

    def _without_gone(self, key: str, doc: Document) -> Document:
        """``doc`` with its parked count (``__parked_total``) less the spilled runs that left before their
        turn (tombstones its lanes still hold: ``Spill.gone``), when it has any lane to refill."""
        if "__parked_total" not in doc or not any(lane.held > 0 for lane in lanes_of(doc)):
            return doc
        gone = self.store.spill.gone(key, doc)
        return {**doc, "__parked_total": max(0, int(doc["__parked_total"]) - gone)} if gone else doc


def _page_size(value: int | None, name: str) -> int | None:
    """``value`` as a number of parked runs to read (None: all), or ``ConfigurationError`` naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be a positive int or None, got {value!r}")
    return value
