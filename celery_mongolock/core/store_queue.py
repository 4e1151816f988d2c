"""The lease store's upkeep of parked runs: reservations of a multi-key run's keys, unparking and giving
back, the sweeper's commands (keys with parked runs or expired slot holds), the duplicate guard's read
(``run_ended``), the records of runs that ended while parked and the cleanup of written results.

A part of ``LeaseStore`` (``store``).
"""

from __future__ import annotations

import builtins
import datetime as _dt
import logging
import uuid
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pymongo import ReturnDocument

from celery_mongolock.core.documents import base as documents
from celery_mongolock.core.documents import key_state, sets, slot_reserve, slot_sets
from celery_mongolock.core.documents import queue as admission_docs
from celery_mongolock.core.documents import slot_queue as slot_admission
from celery_mongolock.core.documents import slots as slots_docs
from celery_mongolock.core.documents.base import Document
from celery_mongolock.core.keys import normalize_key
from celery_mongolock.core.outcomes import (
    LATER_ATTEMPT_PROJECTION,
    RUN_ENDED_PROJECTION,
    ended_superseded_by,
    later_attempt_known,
    run_ended,
)
from celery_mongolock.core.store_places import KeyPlaces, mark_published, read_places, unmark_published
from celery_mongolock.core.validation import MAX_LEASE_SECONDS, validate_seconds
from celery_mongolock.exceptions import StoreUnavailable

if TYPE_CHECKING:
    from celery_mongolock.core.heartbeat import Heartbeat
    from celery_mongolock.core.lease import Lease
    from celery_mongolock.core.store_connection import Connection
    from celery_mongolock.core.store_handoffs import Handoffs
    from celery_mongolock.core.store_history import Records

__all__ = ["Claim", "QueueOwner", "QueueUpkeep"]

#: ``QueueUpkeep.claim_one``: this process got the run's entry, another writer holds it, another writer
#: ended it (it is remembered as over), or it is not there.
Claim = Literal["got", "held", "ended", "absent"]

log_acquire = logging.getLogger("celery_mongolock.acquire")

#: Which of a key's last endings (all it keeps, ``ENDS_KEPT``, read back) a sweep wrote: for a holder or
#: a handoff that lapsed (nobody else records them).
SWEPT_ENDINGS = documents.TAKEOVER_ENDINGS


class QueueOwner(Protocol):
    """What the queue's upkeep needs from the store that owns it (``LeaseStore`` implements it)."""

    @property
    def history_days(self) -> float: ...

    @property
    def connection(self) -> Connection: ...

    @property
    def handoffs(self) -> Handoffs: ...

    @property
    def records(self) -> Records: ...

    @property
    def heartbeat(self) -> Heartbeat: ...

    def forget(self, lease: Lease) -> None: ...

    def release_tokens(
        self, tokens: Collection[str], timeout: float | None = None, *, unconfirmed: Collection[str] = ()
    ) -> int: ...


def _timeout_ms(timeout: float | None) -> int | None:
    if timeout is None:
        return None
    return int(validate_seconds("timeout", timeout, low=0.0, high=MAX_LEASE_SECONDS) * 1000)


class QueueUpkeep:
    """The commands on one store's parked runs other than admitting them (``Acquisition.admit``)."""

    def __init__(self, store: QueueOwner) -> None:
        self.store = store

    # -- several keys per run under Queue (keys=) ----------------------------------------------------
    def reserve(self, lease: Lease, entry: Mapping[str, Any], *, timeout: float | None = None) -> bool:
        """Turn ``lease`` (taken by a run that needs several keys, in an attempt that found another of
        them held) into a reservation of its key for the run's parked ``entry`` (``id``, ``t``, ``s``,
        ``tk``, ``ks`` ...), in one command: the key is handed to the entry without being released, so
        the run keeps its place (``queue.reserve_pipeline``). False if the lease was no longer ours
        (the run must admit that key again); also when the key knows a newer send of the entry's set of
        keys (``Replace``, ``sets.no_newer_send``): the key is then given back unrun, to the oldest run
        parked on it, and the run's admit of it answers ``superseded``."""
        full_entry = sets.as_on_key(lease.key, entry)  # (on a set's gate, without its rank)
        full_entry["ttl"] = int(lease.ttl * 1000)
        timeout_ms = _timeout_ms(timeout)
        by = "reserve:" + uuid.uuid4().hex
        lease.handed_over()  # to the entry: not ours to renew or release
        self.store.forget(lease)  # (before the command: a renewal racing it would report the lease lost)
        # Ours, or already reserved for the entry by an attempt of this command whose reply was lost.
        match: Document = {
            "_id": lease.key,
            "$or": [{"owner": lease.owner}, {"owner": entry["tk"], "ho.id": entry["id"]}],
        }
        pipeline = admission_docs.reserve_pipeline(full_entry, timeout_ms, by)
        if lease.slot is not None:  # a slot of a limit=N key: the slot is reserved (``slot_reserve``)
            match = {
                "_id": lease.key,
                "$or": [
                    {"hs.o": lease.owner},
                    {"hs": {"$elemMatch": {"o": entry["tk"], "ho.id": entry["id"]}}},
                ],
            }
            pipeline = slot_reserve.slot_reserve_pipeline(lease.owner, full_entry, timeout_ms, by)
            if entry.get("g") is not None:  # Replace: never for a run a newer send of its set replaced
                match.update(
                    slot_sets.no_newer_send(
                        str(entry["g"]), int(entry["s"]), task_id=str(entry["t"]), burst=_burst(entry)
                    )
                )
        elif entry.get("g") is not None:
            match.update(
                sets.no_newer_send(
                    str(entry["g"]), int(entry["s"]), task_id=str(entry["t"]), burst=_burst(entry)
                )
            )
        connection = self.store.connection
        doc: Document | None = None
        for attempt in range(3):
            try:
                with connection.operation(f"reserve lease {lease.key!r}"):
                    doc = connection.collection.find_one_and_update(match, pipeline, projection={"_id": 1})
                break
            except StoreUnavailable:
                if attempt == 2:
                    raise
        if doc is None and entry.get("g") is not None and lease.slot is None:
            # Still ours: a newer send of its set parked here meanwhile. The key goes on, unrun.
            self._give_back_key(lease.key, lease.owner)
        elif doc is None and entry.get("g") is not None:
            # Still ours, maybe: a newer send of its set is known here. The slot goes on, unrun.
            self._give_back_slot(lease.key, lease.owner)
        log_acquire.info(
            "lease %r reserved for %s (%s)", lease.key, entry.get("t"), "kept" if doc else "not kept"
        )
        return doc is not None

    def _give_back_slot(self, key: str, owner: str, untick: int | None = None) -> bool:
        """Release the slot of ``key`` held by ``owner`` without remembering a run as over (``seen``), its
        ending marked unrun (``u``; ``untick``: as for a single lease): a run parked on the key is handed
        it in the same command (published here)."""
        store = self.store
        by = store.handoffs.by(owner)
        with store.connection.operation(f"give back lease {key!r}"):
            doc = store.connection.collection.find_one_and_update(
                {"_id": key, **slots_docs.slot_release_filter([owner])},
                slot_admission.slot_release_handoff_pipeline(
                    [owner], by, seen=False, unrun=True, untick=untick
                ),
                projection=slot_admission.SLOT_HANDOFF_PROJECTION,
                return_document=ReturnDocument.AFTER,
            )
        if doc is not None:
            store.handoffs.publish(key, doc, by)
        return doc is not None

    def unpark(self, key: str, entry_id: str) -> bool:
        """Remove the run ``entry_id`` from ``key``: its parked entry, or the handoff or reservation made
        to it (the key then goes to the next parked run, published by this process). Whether it was
        there."""
        key = normalize_key(key)
        by = self.store.handoffs.by(uuid.uuid4().hex)
        ident = {"$literal": entry_id}
        mine = {"$and": [{"$eq": [{"$ifNull": ["$ho.id", None]}, ident]}, {"$eq": ["$owner", "$ho.tk"]}]}
        pipeline: builtins.list[Document] = [
            {"$set": {"__mine": mine}},
            {
                "$set": {
                    # (the newer runs of its set parked here continue its burst: ``sets.carry_burst``)
                    "q": sets.queue_left_by(entry_id, "$__mine"),
                    "owner": {"$cond": ["$__mine", None, "$owner"]},
                    "ho": {"$cond": ["$__mine", None, "$ho"]},
                }
            },
            {"$unset": ["__mine"]},
            *admission_docs.release_handoff_stages(by),
            admission_docs.gc_stage(),
        ]
        connection = self.store.connection
        with connection.operation(f"unpark {entry_id} from {key!r}"):
            # A run of slots (limit=N) is unparked by the slots' pipeline, which hands slots, never the key
            # as a single lease; a run of a single lease by the other: chosen by the filter, by the kind of
            # the run (handed a slot, or parked where ``qk`` says runs of slots wait; by the key's holds for
            # a document from before ``qk``), in the same command. (By the holds alone, a key used as a
            # single lease that kept an expired slot's hold unparked its runs as runs of slots: the model
            # test's mixed key.)
            doc = connection.collection.find_one_and_update(
                {"_id": key, "$or": key_state.slot_run_filter(entry_id)},
                slot_admission.slot_unpark_pipeline(entry_id, by),
                projection=slot_admission.SLOT_HANDOFF_PROJECTION,
                return_document=ReturnDocument.AFTER,
            )
            if doc is None:
                doc = connection.collection.find_one_and_update(
                    {"_id": key, "$or": key_state.single_run_filter(entry_id)},
                    pipeline,
                    projection=admission_docs.HANDOFF_PROJECTION,
                    return_document=ReturnDocument.AFTER,
                )
        if doc is not None:
            self.store.handoffs.publish(key, doc, by)
        return doc is not None

    def give_back(self, lease: Lease, *, untick: int | None = None) -> bool:
        """Release ``lease`` of a run that has not run (an attempt that gives its keys back): as a
        release, but the run is not remembered as over (``seen``), so a copy of it may still run.
        ``untick``: the run's beat tick, no longer the key's last (``release_pipeline``)."""
        if not lease.handed_over():
            return False
        store = self.store
        store.forget(lease)
        if lease.slot is not None:  # a limit=N slot
            return self._give_back_slot(lease.key, lease.owner, untick)
        return self._give_back_key(lease.key, lease.owner, untick)

    def _give_back_key(self, key: str, owner: str, untick: int | None = None) -> bool:
        """Release ``key`` held by ``owner`` without remembering a run as over (``seen``); a run parked
        on it is handed the key in the same command (published here)."""
        store = self.store
        by = store.handoffs.by(owner)
        with store.connection.operation(f"give back lease {key!r}"):
            doc = store.connection.collection.find_one_and_update(
                documents.release_filter(key, owner),
                documents.release_pipeline(by, seen=False, unrun=True, untick=untick),
                projection=admission_docs.HANDOFF_PROJECTION,
                return_document=ReturnDocument.AFTER,
            )
        if doc is not None:
            store.handoffs.publish(key, doc, by)
        return doc is not None

    def unmark_handoff(self, key: str, entry: Mapping[str, Any]) -> bool:
        """Leave the handoff of ``key`` (or of a slot of it) to the run ``entry`` unpublished by this
        process: its publisher's mark is cleared, so the next sweep of a worker adopts and publishes it.
        False if the key is no longer handed to that run."""
        key = normalize_key(key)
        run_id, token = entry.get("id"), entry.get("tk")
        coll = self.store.connection.collection
        with self.store.connection.operation(f"leave the handoff of {key!r} to another worker"):
            done = coll.update_one({"_id": key, "ho.id": run_id, "ho.tk": token}, {"$set": {"ho.by": ""}})
            if done.matched_count:
                return True
            done = coll.update_one(
                {"_id": key, "hs": {"$elemMatch": {"ho.id": run_id, "ho.tk": token}}},
                admission_docs.unmark_slot_pipeline(str(run_id), str(token)),
            )
            return bool(done.matched_count)

    def keys_state(self, entry: Mapping[str, Any]) -> str:
        """Where the multi-key run ``entry`` stands on its keys (one read): ``ready`` (every key reserved
        for it), ``waiting`` (parked or reserved on each), or ``missing`` (absent from some key: its
        worker died between its admits and nothing brought its message back)."""
        places = [place for _, place in self.keys_places(entry)]
        if places and all(p == "reserved" for p in places):
            return "ready"
        return "waiting" if places and all(p in ("reserved", "parked") for p in places) else "missing"

    def newer_of_set(self, key: str, entry: Mapping[str, Any]) -> str | None:
        """The newest send of the set of the run ``entry`` (``g``, ``s``, ``t``) newer than it that got
        ``key`` (``lg``; one point read), or None."""
        store = self.store
        with store.connection.operation(f"read {key!r}"):
            doc = store.connection.collection.find_one({"_id": normalize_key(key)}, {"lg": 1}) or {}
        return sets.newest_that_got_it(
            doc.get("lg"), str(entry.get("g")), int(entry["s"]), str(entry.get("t"))
        )

    def keys_places(self, entry: Mapping[str, Any]) -> builtins.list[tuple[str, str]]:
        """Where the multi-key run ``entry`` is on each of its keys (``ks``, in order), from one read
        (``store_places.read_places``)."""
        return self.places_of(entry).places

    def places_of(self, entry: Mapping[str, Any]) -> KeyPlaces:
        """``keys_places`` with when each reservation was made (``store_places.read_places``)."""
        return read_places(self.store.connection, entry)

    def publish_once(self, entry: Mapping[str, Any], places: KeyPlaces) -> bool:
        """Whether this party publishes the run ``entry``, every key reserved for it in ``places``: True
        for exactly one of the parties that read it so (``store_places.mark_published``)."""
        return mark_published(self.store.connection, entry, places)

    def unpublish(self, entry: Mapping[str, Any]) -> None:
        """Undo ``publish_once`` for the run ``entry`` (``store_places.unmark_published``)."""
        unmark_published(self.store.connection, entry)

    # -- the sweeper ---------------------------------------------------------------------------------
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
        connection = self.store.connection
        with connection.operation("list keys with parked runs"):
            return builtins.list(connection.collection.aggregate(pipeline))

    def sweep(self, key: str, *, revoked: Collection[str] = (), slots: bool | None = None) -> Document | None:
        """One sweep of ``key`` (in one command): drop parked runs whose task ids are ``revoked``, move
        runs past their deadline to ``dead``, hand a free or expired key to the oldest parked run
        (re-handing a handoff nobody took up), and adopt a handoff nobody published. The handoff this
        command made or adopted is published (``add_handoff_callback``). Returns the document after.
        ``slots``: whether the key is a ``limit=N`` key (read from the document when not given)."""
        key = normalize_key(key)
        token = "sweep:" + uuid.uuid4().hex
        coll = self.store.connection.collection
        with self.store.connection.operation(f"sweep lease {key!r}"):
            if slots is None:
                found = coll.find_one({"_id": key}, key_state.SERVES_SLOTS_PROJECTION)
                slots = found is not None and key_state.serves_slots(found)
            pipeline = (
                slot_admission.slot_sweep_pipeline(token, builtins.list(revoked))
                if slots
                else admission_docs.sweep_pipeline(token, builtins.list(revoked))
            )
            doc = coll.find_one_and_update(
                {"_id": key, "wq": True},
                pipeline,
                projection={"q.m": 0, "seen": 0, "ends": {"$slice": -documents.ENDS_KEPT}},
                return_document=ReturnDocument.AFTER,
            )
        # The sweep may have ended an expired lease or handoff (its ending is in ``ends``): queued for
        # the history from the reply, with whatever else this process ended.
        return self._swept(key, doc, token)

    def _swept(self, key: str, doc: Document | None, token: str) -> Document | None:
        if doc is not None:
            self.store.handoffs.publish(key, doc, token)
            # (in hand: a copy at the heartbeat's tick came too late when more runs than ``ends`` keeps
            # ended on the key meanwhile, the parked runs behind the dead holder: a new-user trial)
            self.store.records.record_endings(key, doc, SWEPT_ENDINGS)
            doc.pop("ends", None)
            if self.store.history_days:  # (and copied at the tick, as before: more than it read back)
                self.store.heartbeat.copy_endings({"_id": key})
        return doc

    def keys_with_expired_holds(self, limit: int = 1000, after: str | None = None) -> builtins.list[Document]:
        """``limit=N`` keys that nothing waits on but that keep a hold past its expiry on the server's
        clock (its holder died or stopped renewing, and no slot was taken since): at most ``limit`` of
        them, by key, after ``after``, each as ``{"_id": key}``. The sweeper drops those holds
        (``sweep_expired_holds``)."""
        match: Document = slots_docs.keys_with_expired_holds_filter()
        if after is not None:
            match["_id"] = {"$gt": after}
        connection = self.store.connection
        with connection.operation("list keys with expired slot holds"):
            return builtins.list(connection.collection.find(match, {"_id": 1}).sort("_id", 1).limit(limit))

    def sweep_expired_holds(self, key: str) -> Document | None:
        """Drop the holds of ``limit=N`` key ``key`` that expired on the server's clock, as the next
        acquire of a slot would: their endings (``expired``) go to the document's ``ends`` and, at the
        heartbeat's next tick, to the history. One command; a key some run waits on gets the full
        ``sweep``. Returns the document after (None if there is none)."""
        key = normalize_key(key)
        token = "sweep:" + uuid.uuid4().hex
        connection = self.store.connection
        with connection.operation(f"drop expired slot holds of {key!r}"):
            doc = connection.collection.find_one_and_update(
                {"_id": key, "hs.o": {"$exists": True}},
                slot_admission.slot_sweep_pipeline(token, []),
                projection={"q.m": 0, "seen": 0, "ends": {"$slice": -documents.ENDS_KEPT}},
                return_document=ReturnDocument.AFTER,
            )
        # a run parked meanwhile may have been handed a freed slot
        return self._swept(key, doc, token)

    # -- runs that ended -----------------------------------------------------------------------------
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
        running: bool = False,
    ) -> None:
        """Queue the history record of a run that ended while parked, never holding ``key``
        (``superseded``, ``timeout``, ``revoked``), or (``running``) a holder a newer send superseded; the
        heartbeat thread writes it at its next tick. ``run``: its parked entry (``t``, ``n``,
        ``r``/``id``); ``fence``: the key's when it ended."""
        if not self.store.history_days:
            return
        self.store.records.record(
            documents.run_record(
                normalize_key(key),
                how,
                run,
                fence=fence,
                ended_at=ended_at,
                parked_at=parked_at,
                by=by,
                running=running,
            )
        )

    def run_ended(
        self, key: str, run_ids: Sequence[str], *, task_id: str, delivery: Any, parked: bool = False
    ) -> bool:
        """Whether a run of ``run_ids`` (a task id and attempt, ``queue.run_id``) ended and released
        ``key`` itself (one read; ``outcomes.run_ended`` says what counts). The key remembers the last
        ``SEEN_KEPT`` runs that ended so (``seen``), whoever took it since, for 2 hours after its last
        lease. For a copy of a run's message (a parked duplicate, a redelivery): then running it would be
        a second run of one submission."""
        key = normalize_key(key)
        connection = self.store.connection
        with connection.operation(f"inspect lease {key!r}"):
            doc = connection.collection.find_one({"_id": key}, RUN_ENDED_PROJECTION)
        return run_ended(doc, run_ids, task_id=task_id, delivery=delivery, parked=parked)

    def ended_superseded(self, key: str, task_id: str, retries: int) -> str | None:
        """The newer send that attempt ``retries`` of ``task_id`` stopped for before it released ``key``
        (one read; ``outcomes.ended_superseded_by``), or None."""
        key = normalize_key(key)
        connection = self.store.connection
        with connection.operation(f"inspect lease {key!r}"):
            doc = connection.collection.find_one({"_id": key}, RUN_ENDED_PROJECTION)
        return ended_superseded_by(doc, task_id, retries)

    def later_attempt(self, key: str, task_id: str, retries: int) -> bool:
        """Whether ``key`` knows an attempt of ``task_id`` later than ``retries`` (one read;
        ``outcomes.later_attempt_known``): a body of attempt ``retries`` called ``self.retry()``, and the
        attempt it started has reached the key (parked, handed, holding it, or ended)."""
        key = normalize_key(key)
        connection = self.store.connection
        with connection.operation(f"inspect lease {key!r}"):
            doc = connection.collection.find_one({"_id": key}, LATER_ATTEMPT_PROJECTION)
        return later_attempt_known(doc, task_id, retries)

    def claim_results(
        self, key: str, field: str, task_ids: Collection[str], *, hold: float = 30.0
    ) -> set[str]:
        """Claim the entries of ``dead`` or ``sup`` for ``task_ids`` whose results this process is about to
        write (one command): returns the task ids it got. An entry claimed by another writer less than
        ``hold`` seconds ago (server clock) is not given: two writers (the run that superseded it, the
        sweepers of other nodes) never end one run twice. A claim older than that is taken over (its
        writer died between its claim and ``forget_results``)."""
        return self._claim(key, field, task_ids, hold)[0]

    def claim_one(
        self, key: str, field: str, task_id: str, *, run_id: str | None = None, hold: float = 30.0
    ) -> Claim:
        """``claim_results`` of one run: ``got``, ``held`` (claimed by another writer), ``ended`` (not
        there, and ``run_id`` is remembered as over: a writer wrote it and forgot it) or ``absent``."""
        got, present, seen = self._claim(key, field, [task_id], hold)
        if task_id in got:
            return "got"
        if task_id in present:
            return "held"
        return "ended" if run_id is not None and run_id in seen else "absent"

    def _claim(
        self, key: str, field: str, task_ids: Collection[str], hold: float
    ) -> tuple[set[str], set[str], set[str]]:
        """``claim_results``: the task ids claimed, those found in ``field``, and the key's ``seen``."""
        if field not in ("dead", "sup"):
            raise ValueError(field)
        ids = builtins.list(task_ids)
        if not ids:
            return set(), set(), set()
        token = uuid.uuid4().hex
        entries = {"$ifNull": [f"${field}", []]}
        free = {
            "$or": [
                {"$eq": [{"$ifNull": ["$$e.cl", None]}, None]},
                {"$lte": [{"$add": [{"$toLong": "$$e.cl.at"}, int(hold * 1000)]}, {"$toLong": "$$NOW"}]},
            ]
        }
        mine = {"$mergeObjects": ["$$e", {"cl": {"tk": token, "at": "$$NOW"}}]}
        claim = {"$cond": [{"$and": [{"$in": ["$$e.t", ids]}, free]}, mine, "$$e"]}
        connection = self.store.connection
        with connection.operation(f"claim results of {key!r}"):
            doc = connection.collection.find_one_and_update(
                {"_id": normalize_key(key)},
                [{"$set": {field: {"$map": {"input": entries, "as": "e", "in": claim}}}}],
                projection={f"{field}.t": 1, f"{field}.cl": 1, "seen": 1},
                return_document=ReturnDocument.AFTER,
            )
        found = [e for e in (doc or {}).get(field) or [] if isinstance(e, Mapping)]
        claimed = {str(e.get("t")) for e in found if (e.get("cl") or {}).get("tk") == token}
        seen = {str(r) for r in (doc or {}).get("seen") or []}
        return claimed, {str(e.get("t")) for e in found} & {str(i) for i in ids}, seen

    def forget_results(self, key: str, field: str, task_ids: Collection[str]) -> None:
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
        keep = {"$filter": {"input": entries, "as": "e", "cond": {"$not": [{"$in": ["$$e.t", ids]}]}}}
        connection = self.store.connection
        with connection.operation(f"forget written results of {key!r}"):
            connection.collection.update_one(
                {"_id": normalize_key(key)},
                [{"$set": {field: keep, **remember}}, admission_docs.gc_stage()],
            )


def _burst(entry: Mapping[str, Any]) -> Document | None:
    """The burst a run of a set learned on its first key (``Replace(debounce=..., max_wait=...)``: ``bu``,
    ``sets.in_burst``): only newer sends of that burst keep it from reserving a key. None for others."""
    bu = entry.get("bu")
    return {"$literal": bu} if isinstance(bu, int) else None
