"""Deep queues, the store's side (``documents.spill``): storing a spilled run under the number its admit
took, and refilling a key's window from its lanes.

A part of ``LeaseStore`` (``store``).
"""

from __future__ import annotations

import datetime as _dt
import logging
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

from pymongo import ReturnDocument
from pymongo.errors import DuplicateKeyError

from celery_mongolock.core.documents import lanes
from celery_mongolock.core.documents import spill as spill_docs
from celery_mongolock.core.documents.base import Document
from celery_mongolock.core.store_connection import Connection
from celery_mongolock.core.store_handoffs import Handoffs
from celery_mongolock.exceptions import ConfigurationError, StoreUnavailable

__all__ = ["DEFAULT_WINDOW", "REFILL_BYTES", "Spill", "SpillOwner", "Stored", "validate_window"]

log = logging.getLogger("celery_mongolock.acquire")

#: The most runs of one rank a key's lease document keeps parked; the others are spilled.
DEFAULT_WINDOW = 32
#: How many refills one reply may lead to (``refill_if_low``).
_REFILLS = 8
#: The most message bytes one refill brings into a lease document (it stays far below 16 MiB).
REFILL_BYTES = 4 * 2**20


class SpillOwner(Protocol):
    """What the spill needs of ``LeaseStore``."""

    @property
    def connection(self) -> Connection: ...

    @property
    def handoffs(self) -> Handoffs: ...


class Stored:
    """What became of a spilled run's insert: ``parked`` (stored), ``dup`` (a copy of a run stored
    already), ``again`` (its number was given up as a hole meanwhile: admit it again)."""

    PARKED, DUP, AGAIN = "parked", "dup", "again"


def validate_window(window: object, name: str = "parked_window") -> int:
    """``LeaseStore(parked_window=...)`` (``name``: the setting it came from): a whole number of runs from
    1 to 1,000."""
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= 1000:
        raise ConfigurationError(f"{name} must be a whole number of runs from 1 to 1000, got {window!r}")
    return window


def _entry_size(entry: Mapping[str, Any]) -> int:
    message = entry.get("m")
    return (len(message) if isinstance(message, (bytes, str)) else 0) + 2048


class Spill:
    """Spilled runs of the store's keys."""

    def __init__(self, store: SpillOwner, window: int = DEFAULT_WINDOW) -> None:
        self.store = store
        self.window = int(window)

    @property
    def collection(self) -> Any:
        return self.store.connection.spill_collection

    # -- a spilled run ---------------------------------------------------------------------------------
    def store_entry(
        self, key: str, entry: Mapping[str, Any], answer: Mapping[str, Any], timeout_ms: int | None
    ) -> str:
        """Store the run ``entry`` under the number its admit took (``answer``: the reply's ``ls``);
        ``timeout_ms``: how long it may stay parked (its deadline counts from the admit, on the
        server's clock). Returns a ``Stored`` value."""
        rank, number = int(answer["r"]), int(answer["n"])
        at = answer.get("at")
        full = dict(entry)
        full["at"] = at
        full["dl"] = (
            at + _dt.timedelta(milliseconds=timeout_ms)
            if timeout_ms is not None and isinstance(at, _dt.datetime)
            else None
        )
        ident = lanes.spill_id(key, rank, number)
        doc = {"_id": ident, "k": key, "rid": str(entry["id"]), "e": full}
        coll = self.collection
        with self.store.connection.operation(f"store a parked run of {key!r}"):
            try:
                coll.insert_one(doc)
                return Stored.PARKED
            except DuplicateKeyError:
                found = coll.find_one({"_id": ident}, {"rid": 1})
                if found is None:  # the run is stored under another number: this is a copy of it
                    found = coll.find_one({"k": key, "rid": doc["rid"]}, {"rid": 1, "x": 1})
                    return Stored.AGAIN if found is None else Stored.DUP
        if found.get("rid") == doc["rid"]:
            return Stored.PARKED  # our own insert, landed before its reply was lost
        if found.get("x"):
            return Stored.AGAIN  # (a tombstone: a refill gave the number up)
        return Stored.AGAIN  # (another run's: a number is never given twice, but never overwrite one)

    def park(self, key: str, entry: Mapping[str, Any], doc: Document, timeout: float | None) -> str:
        """A run its admit spilled (reply ``doc``, outcome ``spilled``): store it under its number, then
        refill the key's window if it runs low. The reply then answers ``parked`` (with the run's place,
        ``_position``) or ``dup`` (a copy); ``again``: the number was given up, admit the run again."""
        answer = doc.get("ls") or {}
        timeout_ms = None if timeout is None else int(timeout * 1000)
        stored = self.store_entry(key, entry, answer, timeout_ms)
        if stored == Stored.AGAIN:
            return stored
        doc["lo"] = stored
        if stored == Stored.PARKED:
            doc["_position"] = self.position(doc, answer)
        self.refill_if_low(key, doc)
        return stored

    def position(self, doc: Mapping[str, Any], answer: Mapping[str, Any]) -> int:
        """A spilled run's place in its key's queue (1: next), from its admit's reply."""
        rank, number = int(answer["r"]), int(answer["n"])
        window = [e for e in doc.get("q") or [] if isinstance(e, Mapping) and int(e.get("pr") or 0) <= rank]
        ahead = sum(
            (lane.held if lane.rank < rank else number - lane.head)
            for lane in lanes.lanes_of(doc)
            if lane.rank <= rank
        )
        return len(window) + max(0, ahead) + 1

    # -- refill ----------------------------------------------------------------------------------------
    def refill_if_low(self, key: str, doc: Mapping[str, Any] | None) -> Document | None:
        """Refill the lanes of ``key`` that the reply ``doc`` shows running low (``low_lanes``), until
        none is (a few refills at most: each brings up to a window). MongoDB not answering is logged:
        the sweeper refills at its next pass."""
        last = None
        for _ in range(_REFILLS):
            low = lanes.low_lanes(doc, self.window) if doc and doc.get("sp") else []
            if not low:
                break
            try:
                after = self.refill(key, low[0].rank)
            except StoreUnavailable as exc:
                log.warning("refilling the parked runs of %r failed (the sweeper will): %s", key, exc)
                break
            if after is None:
                break
            doc = last = after
        return last

    def refill(self, key: str, rank: int) -> Document | None:
        """Bring the next spilled runs of lane ``rank`` into ``key``'s window (a handoff it makes is
        published). Returns the document after, or None when the lane had nothing to bring or another
        refill moved it first."""
        coll = self.collection
        connection = self.store.connection
        with connection.operation(f"refill the parked runs of {key!r}"):
            current = connection.collection.find_one({"_id": key}, lanes.SPILL_PROJECTION)
            lane = next((la for la in lanes.lanes_of(current) if la.rank == rank), None)
            if lane is None or lane.held <= 0:
                return None
            room = max(1, self.window - lane.in_window)
            numbers = list(range(lane.head, min(lane.tail, lane.head + room)))
            ids = [lanes.spill_id(key, rank, n) for n in numbers]
            found = {d["_id"]: d for d in coll.find({"_id": {"$in": ids}})}
            stored: list[tuple[str, Mapping[str, Any]]] = []
            size, read = 0, 0
            for ident in ids:
                d = found.get(ident)
                if d is None:
                    try:
                        coll.insert_one(lanes.tombstone(key, ident))
                    except DuplicateKeyError:  # stored just now: read it
                        d = coll.find_one({"_id": ident})
                if d is not None and not d.get("x") and isinstance(d.get("e"), Mapping):
                    if stored and size + _entry_size(d["e"]) > REFILL_BYTES:
                        break
                    size += _entry_size(d["e"])
                    stored.append((ident, d["e"]))
                read += 1
            by = self.store.handoffs.by("refill:" + uuid.uuid4().hex)
            after = self._move(key, lane, stored, ids[:read], by)
            if after is None:
                return None
        log.debug("refilled up to %d parked runs of %r (rank %d) from its spill", len(stored), key, rank)
        self.store.handoffs.publish(key, after, by, refill=False)
        return after

    def _move(
        self,
        key: str,
        lane: lanes.Lane,
        stored: list[tuple[str, Mapping[str, Any]]],
        ids: list[str],
        by: str,
    ) -> Document | None:
        """Move the runs ``stored`` (``(id, entry)``, read under ``ids``, holes included) into the window,
        then delete them from the spill. When the document cannot take them all (16 MiB), the first of
        them alone (the lane's head moves past it and the holes before it). None when another refill moved
        the lane first (what it read is its to delete), or when the document cannot take even one yet."""
        connection = self.store.connection
        projection = {"ho": 1, "owner": 1, "fence": 1, "sp": 1, "q.pr": 1}
        tries = [(stored, ids)]
        if len(stored) > 1:
            tries.append((stored[:1], ids[: ids.index(stored[0][0]) + 1]))
        for moved, read in tries:
            entries = [e for _, e in moved]
            after = connection.collection.find_one_and_update(
                spill_docs.refill_filter(key, lane.rank, lane.head, sum(_entry_size(e) for e in entries)),
                spill_docs.refill_pipeline(lane.rank, lane.head + len(read), entries, by),
                projection=projection,
                return_document=ReturnDocument.AFTER,
            )
            if after is not None:
                self.collection.delete_many({"_id": {"$in": read}})
                return after
        return None
