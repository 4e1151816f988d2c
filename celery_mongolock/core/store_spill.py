"""Deep queues, the store's side (``documents.spill``): storing a spilled run under the number its admit
took, and refilling a key's window from its lanes.

A part of ``LeaseStore`` (``store``).
"""

from __future__ import annotations

import datetime as _dt
import logging
import time
import uuid
from collections.abc import Collection, Mapping
from typing import Any, Protocol

from pymongo import ReturnDocument
from pymongo.errors import DuplicateKeyError

from celery_mongolock.core.documents import key_state, lanes
from celery_mongolock.core.documents import spill as spill_docs
from celery_mongolock.core.documents.base import ENDS_KEPT, Document
from celery_mongolock.core.documents.entries import PARK_BUDGET
from celery_mongolock.core.documents.handoff import HANDOFF_PROJECTION
from celery_mongolock.core.documents.slot_queue import (
    SLOT_HANDOFF_PROJECTION,
    slot_fill_pipeline,
    slot_refill_pipeline,
)
from celery_mongolock.core.store_connection import AMBIGUOUS, Connection
from celery_mongolock.core.store_handoffs import Handoffs
from celery_mongolock.exceptions import ConfigurationError, StoreUnavailable

__all__ = [
    "DEFAULT_WINDOW",
    "REFILL_BYTES",
    "SPILL_MESSAGE_LIMIT",
    "Spill",
    "SpillOwner",
    "Stored",
    "validate_window",
]

log = logging.getLogger("celery_mongolock.acquire")

#: The most runs of one rank a key's lease document keeps parked; the others are spilled.
DEFAULT_WINDOW = 32
#: The largest message a spilled run may carry: it must fit, alone, into its key's lease document when
#: its turn comes (``PARK_BUDGET``, less room for the key's own fields).
SPILL_MESSAGE_LIMIT = PARK_BUDGET - 256 * 2**10
#: How many numbers past its room a refill reads, for runs past their deadline it may move to ``dead``.
_EXPIRED_LOOKAHEAD = 16
#: How many spilled runs one read asks for (``page``).
_READ_BATCH = 1000
#: Task ids per command of ``Spill.drop`` (one ``$in`` of 10,000 on the embedded server ran past the
#: operation timeout: a new-user trial's purge, stop 65; 500 took 1.1 s with 3,000 spilled runs).
DROP_BATCH = 500
#: How many refills one reply may lead to (``refill_if_low``).
_REFILLS = 8
#: The most runs one refill brings (its command has a stage per run: MongoDB takes at most 1,000).
_REFILL_MOST = 256
#: The most message bytes one refill brings into a lease document (it stays far below 16 MiB).
REFILL_BYTES = 4 * 2**20


def _server_now(doc: Mapping[str, Any] | None) -> _dt.datetime:
    """The server's time a read of ``doc`` carried (``__now``), else this process's."""
    now = (doc or {}).get("__now")
    return now if isinstance(now, _dt.datetime) else _dt.datetime.now(_dt.timezone.utc)


class EndingsRecorder(Protocol):
    """``store_history.Records``, as the spill uses it (a layer it may not import)."""

    def record_takeovers(self, key: str, doc: Mapping[str, Any]) -> None: ...


#: What a refill's reply carries besides what publishing its handoff needs: the endings kept, among them
#: the one it wrote when it found the key's lease (or a handoff) lapsed and handed the key on.
_ENDS: Document = {"ends": {"$slice": -ENDS_KEPT}}


class SpillOwner(Protocol):
    """What the spill needs of ``LeaseStore``."""

    @property
    def records(self) -> EndingsRecorder: ...

    @property
    def connection(self) -> Connection: ...

    @property
    def handoffs(self) -> Handoffs: ...

    @property
    def operation_timeout(self) -> float: ...


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


def _expired(entry: Mapping[str, Any], now: Any) -> bool:
    """The spilled run ``entry`` is past its deadline at the server's time ``now``."""
    deadline = entry.get("dl")
    if not isinstance(deadline, _dt.datetime) or not isinstance(now, _dt.datetime):
        return False
    if deadline.tzinfo is None:
        deadline = deadline.replace(tzinfo=_dt.timezone.utc)
    if now.tzinfo is None:
        now = now.replace(tzinfo=_dt.timezone.utc)
    return bool(deadline <= now)


def _slotted(doc: Mapping[str, Any], lane: lanes.Lane) -> bool:
    """Whether a refill of ``lane`` hands the key's free slots (``limit=N``) or the key as one lease: as
    the key is held now (holds in ``hs``, or an ``owner``), else as its runs were spilled (``sl``)."""
    kind = key_state.parked_kind_of(doc)
    if kind is not None:  # (the kind of the runs parked: ``qk``)
        return kind == key_state.KIND_SLOTS
    if doc.get("hs"):
        return True
    return False if doc.get("owner") else lane.slots


def _entry_size(entry: Mapping[str, Any]) -> int:
    message = entry.get("m")
    return (len(message) if isinstance(message, (bytes, str)) else 0) + 2048


class Spill:
    """Spilled runs of the store's keys. Every command names its key (``k``): with the collection sharded
    on ``{k: 1}``, each goes to one shard, where all of a key's runs are (docs/scaling.md). (``_id`` comes
    first in a filter that has it: the embedded server then reads by ``_id``, else it scans the key's
    runs through the ``(k, rid)`` index: 1.6 s instead of 2 ms with 50,000 runs spilled.)"""

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
        server's clock). Returns a ``Stored`` value. A key stores a task's run once (``(k, rid)``, the task
        id): a copy of it, or the same run admitted again after an answer was lost, is ``dup``; a run left
        behind by a refill that stopped before its delete (its number passed) is deleted first."""
        rank, epoch, number = int(answer["r"]), int(answer.get("e") or 0), int(answer["n"])
        at = answer.get("at")
        full = dict(entry)
        full["at"] = at
        full["dl"] = (
            at + _dt.timedelta(milliseconds=timeout_ms)
            if timeout_ms is not None and isinstance(at, _dt.datetime)
            else None
        )
        ident = lanes.spill_id(key, rank, epoch, number)
        doc = {"_id": ident, "k": key, "rid": str(entry["t"]), "r": rank, "ep": epoch, "n": number, "e": full}
        outcome = next((o for o in (self._insert(key, doc) for _ in range(3)) if o is not None), Stored.DUP)
        if outcome == Stored.DUP:  # (a stored run of the task kept coming back under a passed number: DUP)
            self._give_up(key, ident, at)
        return outcome

    def _give_up(self, key: str, ident: str, now: object) -> None:
        """The number ``ident`` a copy's admit took holds no run: a tombstone under it at once, so that the
        parked count leaves it out (``gone``) before a refill passes it. Best effort: else a hole."""
        when = now if isinstance(now, _dt.datetime) else None
        try:
            with self.store.connection.operation(f"give up a number of {key!r}"):
                self.collection.insert_one(lanes.tombstone(key, ident, when or _server_now(None)))
        except DuplicateKeyError:
            pass  # (a refill gave it up first)
        except StoreUnavailable as exc:
            log.debug("giving up a number of %r failed: %s", key, exc)

    def _insert(self, key: str, doc: Document) -> str | None:
        """One insert of the spilled run ``doc``, sent again while its outcome is unknown (the same
        ``_id``: idempotent). None when a run of the task left behind was deleted: insert again."""
        coll = self.collection
        connection = self.store.connection
        give_up = time.monotonic() + self.store.operation_timeout
        while True:
            try:
                with connection.operation(f"store a parked run of {key!r}", retryable=True):
                    coll.insert_one(doc)
                return Stored.PARKED
            except DuplicateKeyError:
                break
            except AMBIGUOUS as exc:
                if time.monotonic() >= give_up:
                    raise StoreUnavailable(
                        f"MongoDB did not answer while storing a parked run of {key!r}: {exc}"
                    ) from exc
                time.sleep(0.05)
        with connection.operation(f"store a parked run of {key!r}"):
            found = coll.find_one({"_id": doc["_id"], "k": key}, {"rid": 1, "x": 1})
            if found is not None:
                # Ours, landed before its answer was lost; else a tombstone (a refill gave the number up)
                return Stored.PARKED if found.get("rid") == doc["rid"] else Stored.AGAIN
            other = coll.find_one({"k": key, "rid": doc["rid"]}, {"r": 1, "ep": 1, "n": 1, "e.id": 1})
            if other is None:
                return Stored.AGAIN
            if self._waiting(key, other) or (other.get("e") or {}).get("id") == doc["e"].get("id"):
                # The task's run is stored and waits, or this very run (the same attempt) was moved into
                # the window (a refill between this copy's admit and its insert): this is a copy of it.
                return Stored.DUP
            coll.delete_one({"_id": other["_id"], "k": key, "rid": doc["rid"]})
        return None

    def spilled_runs(self, keys: Collection[str], task_ids: Collection[str]) -> set[str]:
        """Those of ``task_ids`` spilled beyond the window of any of ``keys`` (point reads on the ``(k,
        rid)`` index, a batch at a time): the sweeper's runs that wait spilled on a later key."""
        keys, ids, found = sorted(set(keys)), sorted(set(task_ids)), set()
        for at in range(0, len(ids), _READ_BATCH):
            with self.store.connection.operation("look for spilled runs"):
                match = {"k": {"$in": keys}, "rid": {"$in": ids[at : at + _READ_BATCH]}, "x": {"$ne": True}}
                found |= {str(d["rid"]) for d in self.collection.find(match, {"rid": 1})}
        return found

    def waits(self, key: str, task_id: str) -> bool:
        """Whether a run of ``task_id`` is spilled beyond the window of ``key`` and waits there to be
        refilled (two point reads: the run by ``(k, rid)``, then the key's lanes)."""
        with self.store.connection.operation(f"look for a spilled run of {key!r}"):
            stored = self.collection.find_one({"k": key, "rid": task_id}, {"r": 1, "ep": 1, "n": 1, "x": 1})
            return stored is not None and not stored.get("x") and self._waiting(key, stored)

    def _waiting(self, key: str, stored: Mapping[str, Any]) -> bool:
        """The spilled run ``stored`` is under a number its lane has not passed (it waits to be refilled)."""
        current = self.store.connection.collection.find_one({"_id": key}, {"sp": 1})
        for lane in lanes.lanes_of(current):
            if lane.rank == stored.get("r") and lane.epoch == stored.get("ep"):
                return lane.head <= int(stored.get("n") or 0) < lane.tail
        return False

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

    # -- reading ---------------------------------------------------------------------------------------
    def page(
        self, key: str, doc: Mapping[str, Any], start: int, limit: int | None
    ) -> list[Mapping[str, Any]]:
        """The parked runs of ``key`` from position ``start`` (0: the next), at most ``limit``: by rank,
        those in its lease document ``doc`` (its whole ``q``, without messages) then those spilled, in
        their lane's order; only the spilled runs of the page are read (by ``_id``)."""
        window = [e for e in doc.get("q") or [] if isinstance(e, Mapping)]
        lanes_by_rank = {lane.rank: lane for lane in lanes.lanes_of(doc)}
        places: list[Mapping[str, Any] | str] = []  # an entry, or the _id of a spilled one
        for rank in sorted({int(e.get("pr") or 0) for e in window} | set(lanes_by_rank)):
            places += [e for e in window if int(e.get("pr") or 0) == rank]
            lane = lanes_by_rank.get(rank)
            if lane is not None:
                places += [lane.spill_id(key, n) for n in range(lane.head, lane.tail)]
        chosen = places[start:] if limit is None else places[start : start + limit]
        ids = [p for p in chosen if isinstance(p, str)]
        found: dict[str, Mapping[str, Any]] = {}
        for at in range(0, len(ids), _READ_BATCH):
            with self.store.connection.operation(f"read the parked runs of {key!r}"):
                batch = ids[at : at + _READ_BATCH]
                for d in self.collection.find({"_id": {"$in": batch}, "k": key}, {"e.m": 0}):
                    if not d.get("x") and isinstance(d.get("e"), Mapping):
                        found[d["_id"]] = d["e"]
        return [
            p if not isinstance(p, str) else found[p] for p in chosen if not isinstance(p, str) or p in found
        ]

    def revoked_runs(self, key: str, task_ids: Collection[str]) -> list[Mapping[str, Any]]:
        """The spilled runs of ``key`` among ``task_ids`` (the sweeper's revoked ids), without messages."""
        ids = sorted(set(task_ids))
        found: list[Mapping[str, Any]] = []
        for at in range(0, len(ids), _READ_BATCH):
            with self.store.connection.operation(f"read revoked parked runs of {key!r}"):
                batch = ids[at : at + _READ_BATCH]
                for d in self.collection.find({"k": key, "rid": {"$in": batch}}, {"e.m": 0}):
                    if not d.get("x") and isinstance(d.get("e"), Mapping):
                        found.append(d["e"])
        return found

    def expire(self, key: str, ranks: Collection[int]) -> bool:
        """Move the runs past their deadline at the head of the lanes ``ranks`` of ``key`` to ``dead``,
        whatever room its window has (the sweeper's: their results are then written like those of runs
        timed out in the window). Whether any lane moved."""
        moved = False
        for rank in ranks:
            if self.refill(key, rank, room=0) is not None:
                moved = True
        return moved

    def drop(self, key: str, task_ids: Collection[str]) -> int:
        """Take the spilled runs of ``task_ids`` on ``key`` out of its queue (an operator's drop; a run that
        left before its turn): each becomes a tombstone where it is (``lanes.LEFT``), which the refills
        skip, the parked count leaves out (``gone``) and the server deletes a day later. Returns how many
        were taken out."""
        ids, dropped = list(task_ids), 0
        for start in range(0, len(ids), DROP_BATCH):  # (one $in of 10,000 ran past the timeout)
            with self.store.connection.operation(f"drop parked runs of {key!r}"):
                match = {"k": key, "rid": {"$in": ids[start : start + DROP_BATCH]}}
                dropped += int(self.collection.update_many(match, lanes.LEFT).modified_count)
        return dropped

    def gone_allowance(
        self, key: str, doc: Mapping[str, Any]
    ) -> tuple[int, tuple[tuple[int, int, int], ...]] | None:
        """The tombstones the lanes of ``key`` hold (its document ``doc``) and where each lane stood:
        what a ``max_length`` admit may leave out of its count (``admit_stages.gone_allowance``); None when
        there are none (or MongoDB did not answer the count: the admit's answer stands)."""
        if not any(lane.held > 0 for lane in lanes.lanes_of(doc)):
            return None
        try:
            count = self.gone(key, doc)
        except StoreUnavailable as exc:
            log.warning("counting the parked runs of %r that left failed: %s", key, exc)
            return None
        heads = tuple((lane.rank, lane.epoch, lane.head) for lane in lanes.lanes_of(doc))
        return (count, heads) if count else None

    def gone(self, key: str, doc: Mapping[str, Any]) -> int:
        """How many of the numbers the lanes of ``key`` (its document ``doc``) still hold are tombstones,
        not runs: a range of the ``(k, rid)`` index per lane, which reads only tombstones."""
        total = 0
        for lane in lanes.lanes_of(doc):
            if lane.held > 0:
                with self.store.connection.operation(f"count the parked runs of {key!r} that left"):
                    total += int(self.collection.count_documents(lanes.gone_between(key, lane)))
        return total

    # -- refill ----------------------------------------------------------------------------------------
    def refill_if_low(self, key: str, doc: Mapping[str, Any] | None) -> Document | None:
        """Refill the lanes of ``key`` that the reply ``doc`` shows running low (``low_lanes``), until none is
        (a few refills at most: each brings up to a window, at most 256 runs). MongoDB not answering is
        logged: the sweeper refills at its next pass."""
        last = None
        for _ in range(_REFILLS):
            low = lanes.low_lanes(doc, self.window) if doc and doc.get("sp") else []
            try:
                # (lowest rank first; a lane that brought nothing, its next run too large for the
                # document yet or moved by another refill, lets the next lane try: none is left unmarked)
                after = next(
                    (a for a in (self.refill(key, lane.rank) for lane in low) if a is not None), None
                )
            except StoreUnavailable as exc:
                log.warning("refilling the parked runs of %r failed (the sweeper will): %s", key, exc)
                break
            if after is None:
                break
            doc = last = after
        return last

    def after_claim(self, key: str, doc: Mapping[str, Any]) -> None:
        """A run claimed ``key`` handed to it (reply ``doc``): its message left the document, so the next run
        of a lane that did not fit (``bk``) may fit now, and comes in before the next release hands the key
        over it (a review of stop 49: before, one more run of the window went first). Never raises: the claim
        took the key whatever becomes of this refill (the next release's, or the sweeper's, tries again)."""
        if not lanes.any_blocked(doc):
            return
        try:
            self.refill_if_low(key, doc)
        except Exception:  # (refill_if_low logs MongoDB's failures itself: this is any other)
            log.exception("refilling a blocked lane of %r after a claim failed", key)

    def refill(self, key: str, rank: int, room: int | None = None) -> Document | None:
        """Bring the next spilled runs of lane ``rank`` into ``key``'s window: up to ``room`` runs (by default
        what the window has room for, at least one, at most 256), and the runs past their deadline among and
        before them, which go to ``dead`` instead (``room=0``: only those at the lane's head, the sweeper's).
        A handoff it makes is published. Returns the document after, or None when the lane had nothing to
        bring or another refill moved it first."""
        coll = self.collection
        connection = self.store.connection
        with connection.operation(f"refill the parked runs of {key!r}"):
            read_now: list[Document] = [
                {"$match": {"_id": key}},
                {
                    "$project": {
                        "sp": 1,
                        "q.pr": 1,
                        "q.ks": 1,
                        "q.g": 1,
                        "qk": 1,
                        "owner": 1,
                        "hs.o": 1,
                        "__now": "$$NOW",
                    }
                },
            ]
            current = next(iter(connection.collection.aggregate(read_now)), None)
            lane = next((la for la in lanes.lanes_of(current) if la.rank == rank), None)
            if current is None or lane is None or lane.held <= 0:
                return None
            if room is None:
                room = min(_REFILL_MOST, max(1, self.window - lane.in_window))
            numbers = list(range(lane.head, min(lane.tail, lane.head + room + _EXPIRED_LOOKAHEAD)))
            ids = [lane.spill_id(key, n) for n in numbers]
            found = {d["_id"]: d for d in coll.find({"_id": {"$in": ids}, "k": key})}
            if len(found) < len(ids) and self._moved(key, lane):
                # Another refill moved the lane since it was read, and deleted the runs it took: their
                # numbers are no holes (a tombstone under them would stay for ever; seen in a storm of
                # 3,000 runs: 144 tombstones left, in runs of 16).
                return None
            stored: list[tuple[str, Mapping[str, Any]]] = []
            size, read, live = 0, 0, 0
            for ident in ids:
                d = found.get(ident)
                if d is None:
                    try:
                        coll.insert_one(lanes.tombstone(key, ident, _server_now(current)))
                    except DuplicateKeyError:  # stored just now: read it
                        d = coll.find_one({"_id": ident, "k": key})
                if d is not None and not d.get("x") and isinstance(d.get("e"), Mapping):
                    if not _expired(d["e"], current.get("__now")):
                        if live >= room or (stored and size + _entry_size(d["e"]) > REFILL_BYTES):
                            break
                        live += 1
                        size += _entry_size(d["e"])
                    stored.append((ident, d["e"]))
                read += 1
            if read == 0:
                return None
            by = self.store.handoffs.by("refill:" + uuid.uuid4().hex)
            after, moved = self._move(key, lane, stored, ids[:read], by, slots=_slotted(current, lane))
            if after is None:
                return None
        # The handoff first; then the runs moved leave the spill (tombstones stay: a late store under
        # their number must fail). A delete that fails leaves them under passed numbers: never read
        # again, and deleted by a later store of their task (``store_entry``).
        self._hand_on(key, after, by)
        try:
            with connection.operation(f"delete the parked runs moved out of the spill of {key!r}"):
                coll.delete_many({"_id": {"$in": moved}, "k": key})
        except StoreUnavailable as exc:
            log.warning("deleting the parked runs refilled into %r failed: %s", key, exc)
        log.debug("refilled %d parked runs of %r (rank %d) from its spill", len(moved), key, rank)
        return after

    def _moved(self, key: str, lane: lanes.Lane) -> bool:
        """Whether ``lane`` of ``key`` is not where it was read any more (its head moved, or the key's
        document was made again): one read, only when a refill finds numbers missing."""
        current = self.store.connection.collection.find_one({"_id": key}, {"sp": 1})
        now = next((la for la in lanes.lanes_of(current) if la.rank == lane.rank), None)
        return now is None or (now.epoch, now.head) != (lane.epoch, lane.head)

    def _move(
        self,
        key: str,
        lane: lanes.Lane,
        stored: list[tuple[str, Mapping[str, Any]]],
        ids: list[str],
        by: str,
        *,
        slots: bool = False,
    ) -> tuple[Document | None, list[str]]:
        """Move the runs ``stored`` (``(id, entry)``, read under ``ids``, holes included) into the window:
        the document after, and the ids of the runs moved. When the document cannot take them all
        (16 MiB), the first of them alone (the lane's head moves past it and the holes before it). None
        when another refill moved the lane first, or when the document cannot take even one yet."""
        connection = self.store.connection
        projection = {**(SLOT_HANDOFF_PROJECTION if slots else HANDOFF_PROJECTION), **_ENDS}
        pipeline = slot_refill_pipeline if slots else spill_docs.refill_pipeline
        tries = [(stored, ids)]
        if len(stored) > 1:
            tries.append((stored[:1], ids[: ids.index(stored[0][0]) + 1]))
        for moved, read in tries:
            entries = [e for _, e in moved]
            after = connection.collection.find_one_and_update(
                spill_docs.refill_filter(
                    key, lane.rank, lane.epoch, lane.head, sum(_entry_size(e) for e in entries)
                ),
                pipeline(lane.rank, lane.head + len(read), entries, by),
                projection=projection,
                return_document=ReturnDocument.AFTER,
            )
            if after is not None:
                return after, [ident for ident, _ in moved]
        if not self._moved(key, lane):  # (not another refill's doing: the document cannot take the run)
            self._blocked(key, lane, slots=slots)
        return None, []

    def _blocked(self, key: str, lane: lanes.Lane, *, slots: bool) -> None:
        """Mark ``lane`` as one whose next run the key's document cannot take yet (``bk``): the runs in
        the window are handed the key (or its slots) before it (``lanes.spilled_before``), which makes
        room; the next change of the lane (a refill, a run spilled) clears the mark. A free key (or a
        ``limit=N`` key's free slots) held back for the lane's runs is handed in the same command.
        ``slots``: the refill's own reading of the key's shape (``_slotted``)."""
        at = {"r": lane.rank, "e": lane.epoch, "h": lane.head}
        by = self.store.handoffs.by("refill:" + uuid.uuid4().hex)
        if slots:
            pipeline = [lanes.mark_blocked(lane.rank), *slot_fill_pipeline(by)]
            projection = SLOT_HANDOFF_PROJECTION
        else:
            pipeline, projection = spill_docs.blocked_pipeline(lane.rank, by), HANDOFF_PROJECTION
        after = self.store.connection.collection.find_one_and_update(
            {"_id": key, "sp": {"$elemMatch": at}},
            pipeline,
            projection={**projection, **_ENDS},
            return_document=ReturnDocument.AFTER,
        )
        # The slots, or the key, held back for the lane's runs and now handed to the window's.
        self._hand_on(key, after, by)

    def _hand_on(self, key: str, after: Mapping[str, Any] | None, by: str) -> None:
        """Publish the handoff a refill's command (or a blocked lane's mark) made. When it found the key's
        lease, or a slot's, lapsed, it wrote that ending as it handed the key on, and nobody else records
        it: recorded from the reply (``Records.record_takeovers``)."""
        self.store.handoffs.publish(key, after, by, refill=False)
        if after:
            self.store.records.record_takeovers(key, after)
