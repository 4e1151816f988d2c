"""The start windows of rate-limited keys (``RateLimit``, ``Throttle``): one command per start.

The documents and their arithmetic are in ``documents.rate``; this module sends them. The collection is
``<lease collection>.rates`` (a TTL index on ``exp`` removes a key's window once nothing in it counts).
Starts are judged and recorded on the server's clock (``$$NOW``) in one ``findAndModify`` per key.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import uuid
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pymongo
from pymongo import ReturnDocument
from pymongo.errors import DuplicateKeyError, OperationFailure

from celery_mongolock.core.documents import rate as rate_docs
from celery_mongolock.core.documents.rate import RateWindow, next_start_ms

if TYPE_CHECKING:
    from pymongo.collection import Collection

    from celery_mongolock.core.store import LeaseStore

__all__ = ["RateTake", "RateWindows", "rate_windows"]

Document = dict[str, Any]

#: How long a parked run's entry keeps its place after its turn, if its run does not come back (its
#: delayed copy late on a busy worker; lost with a broker): later runs wait at most this much for it.
STALE_AFTER_TURN_MS = 15_000


@dataclasses.dataclass(frozen=True)
class RateTake:
    """The answer to one run's attempt to start on its keys: ``started`` (a start recorded in every
    key's window), or else the key whose window is full, how many runs wait before this one there,
    and how long until its turn (seconds, on the server's clock)."""

    started: bool
    start_id: str
    key: str | None = None
    in_window: int = 0
    position: int = 0
    wait_seconds: float = 0.0


class RateWindows:
    """The rate windows of one store's keys: ``take`` a start, ``give_back`` one, ``look`` at one."""

    def __init__(self, store: LeaseStore) -> None:
        self.store = store
        self._indexed_pid: int | None = None

    @property
    def plain_collection(self) -> Collection[Document]:
        """The windows' collection, as is (reads: no index made)."""
        store = self.store
        return store.connection.client[store.database_name].get_collection(
            f"{store.collection_name}.rates",
            write_concern=store.write_concern,
            read_preference=store.read_preference,
        )

    @property
    def collection(self) -> Collection[Document]:
        """The windows' collection, its TTL index made first in this process."""
        collection = self.plain_collection
        store = self.store
        if self._indexed_pid != os.getpid():
            with store.connection.operation("create the rate windows' index"):
                try:
                    collection.create_index(
                        [("exp", pymongo.ASCENDING)], name="exp_ttl", expireAfterSeconds=0
                    )
                except OperationFailure as exc:
                    if exc.code != 68:  # created meanwhile by another process
                        raise
            self._indexed_pid = os.getpid()
        return collection

    def take(
        self,
        keys: Sequence[str],
        *,
        run: str,
        stamp: int,
        n: int,
        period_ms: int,
        park: bool,
        rank: int = 0,
        replaces: str | None = None,
    ) -> RateTake:
        """One start for ``run`` in the window of every key in ``keys`` (in that order), or none: a key
        whose window is full (or has runs parked before this one) stops it, and the starts taken on the
        keys before it are given back. With ``park``, the run is recorded as waiting on that key, in the
        order of ``rank`` (its message priority as the key's queue orders it), then of its send.
        ``replaces``: a ``Replace`` run's group, whose older waiting runs it takes out (``take_update``)."""
        start_id = uuid.uuid4().hex
        stale_ms = period_ms + STALE_AFTER_TURN_MS
        taken: list[str] = []
        for key in keys:
            update = rate_docs.take_update(
                start_id=start_id,
                run=run,
                stamp=stamp,
                n=n,
                period_ms=period_ms,
                park=park,
                stale_ms=stale_ms,
                rank=rank,
                replaces=replaces,
            )
            window = self._take_one(key, update)
            if window.granted(start_id):
                taken.append(key)
                continue
            for earlier in taken:
                self.give_back(earlier, start_id)
            position = window.position(run)
            turn = next_start_ms(window.starts_ms, n, period_ms, window.now_ms, position)
            return RateTake(
                started=False,
                start_id=start_id,
                key=key,
                in_window=window.in_window(period_ms),
                position=position,
                wait_seconds=max(0.0, (turn - window.now_ms) / 1000),
            )
        return RateTake(started=True, start_id=start_id)

    def _take_one(self, key: str, update: list[Document]) -> RateWindow:
        collection = self.collection
        with self.store.connection.operation(f"take a start in the rate window of {key!r}"):
            for _ in range(3):
                try:
                    doc = collection.find_one_and_update(
                        {"_id": key}, update, upsert=True, return_document=ReturnDocument.AFTER
                    )
                    break
                except DuplicateKeyError:  # two first starts of a key upserted at once: the other won
                    continue
            else:
                doc = None
            if doc is None:
                # The embedded server may answer None to an upsert that was applied: read it back.
                doc = collection.find_one({"_id": key})
        return RateWindow.of(key, doc)

    def give_back(self, key: str, start_id: str) -> None:
        """Remove a start whose body never ran (another of the run's keys said wait)."""
        with self.store.connection.operation(f"give back a start in the rate window of {key!r}"):
            self.collection.update_one({"_id": key}, rate_docs.give_back_update(start_id))

    def leave(self, key: str, run: str) -> None:
        """Take ``run`` out of the runs parked on ``key`` (it was dropped, or started on another way)."""
        with self.store.connection.operation(f"leave the rate window of {key!r}"):
            self.collection.update_one({"_id": key}, {"$pull": {"w": {"id": run}}})

    def look(self, key: str) -> RateWindow | None:
        """The key's window as the last command left it, its clock brought to the server's now (None when
        the key has no window; never before the window's own clock, which does not go back:
        ``documents.rate``). Reads only (an operator's read-only role will do)."""
        store = self.store
        with store.connection.operation(f"read the rate window of {key!r}"):
            doc = self.plain_collection.find_one({"_id": key})
            if doc is None:
                return None
            now = store.connection.client.admin.command("hello")["localTime"]
            seen = doc.get("seen")
            doc["seen"] = now if seen is None else max(_aware(now), _aware(seen))
        return RateWindow.of(key, doc)


def _aware(value: _dt.datetime) -> _dt.datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=_dt.timezone.utc)


_windows: weakref.WeakKeyDictionary[LeaseStore, RateWindows] = weakref.WeakKeyDictionary()


def rate_windows(store: LeaseStore) -> RateWindows:
    """The ``RateWindows`` of ``store`` (one per store)."""
    windows = _windows.get(store)
    if windows is None:
        windows = _windows[store] = RateWindows(store)
    return windows
