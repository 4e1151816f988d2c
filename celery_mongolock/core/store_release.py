"""The lease store's renewals and releases: one lease or all of a process's in one round trip, the
background releases of the heartbeat, and the releases of a dead holder's or any holder's leases. A
release of a key with runs parked hands it to the oldest in the same command (published through the
store's ``handoffs``).

A release sets ``owner`` to null (matching ``{_id, owner}``) and keeps the document, so the fence
survives; a renewal re-computes ``expires_at = $$NOW + ttl_ms`` for every lease the process holds in one
``update`` matched on their owner tokens.

A part of ``LeaseStore`` (``store``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import pymongo
from pymongo import ReadPreference, ReturnDocument
from pymongo.errors import OperationFailure

from celery_mongolock.core.document_lock import DocumentLease, renew_documents
from celery_mongolock.core.documents import base as documents
from celery_mongolock.core.documents import queue as admission_docs
from celery_mongolock.core.documents import slot_queue as slot_admission
from celery_mongolock.core.documents import slots as slots_docs
from celery_mongolock.core.documents.base import Document
from celery_mongolock.core.keys import normalize_key
from celery_mongolock.core.lease import Lease
from celery_mongolock.core.store_connection import AMBIGUOUS
from celery_mongolock.core.store_history import ENDING_FIELDS
from celery_mongolock.core.validation import validate_seconds
from celery_mongolock.exceptions import ConfigurationError, StoreUnavailable

if TYPE_CHECKING:
    from celery_mongolock.core.clock import Clock
    from celery_mongolock.core.heartbeat import Heartbeat
    from celery_mongolock.core.store_connection import Connection
    from celery_mongolock.core.store_handoffs import Handoffs
    from celery_mongolock.core.store_history import Records

__all__ = ["SLOT_HANDOFF_PROJECTION", "Releases", "ReleasesOwner"]

log_release = logging.getLogger("celery_mongolock.release")
log_renew = logging.getLogger("celery_mongolock.renew")

SLOT_HANDOFF_PROJECTION = slot_admission.SLOT_HANDOFF_PROJECTION


def ended_for(holder: Mapping[str, Any]) -> Document:
    """The lease documents with a ``holder-died`` ending for ``holder`` in ``ends``: found again at the
    heartbeat's tick even if the key has been taken again meanwhile (its ``holder`` replaced)."""
    fields = {ENDING_FIELDS.get(name): value for name, value in holder.items()}
    if None in fields:  # a holder field that endings do not record: match the documents' holder
        return {f"holder.{name}": value for name, value in holder.items()}
    return {"ends": {"$elemMatch": {"how": "holder-died", **fields}}}


class ReleasesOwner(Protocol):
    """What renewals and releases need from the store that owns them (``LeaseStore`` implements it)."""

    @property
    def clock(self) -> Clock: ...

    @property
    def operation_timeout(self) -> float: ...

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

    def held_leases(self) -> list[Lease]: ...

    def give_back(self, lease: Lease, *, untick: int | None = None) -> bool: ...


class Releases:
    """Renewing and releasing the leases of one store."""

    def __init__(self, store: ReleasesOwner) -> None:
        self.store = store

    # -- renew ---------------------------------------------------------------------------------------
    def renew_lease(self, lease: Lease) -> bool:
        """``LeaseStore.renew_lease``."""
        connection = self.store.connection
        timeout = max(0.1, min(self.store.operation_timeout, lease.remaining))
        if lease.slot is not None:
            return not self.renew_tokens([lease], timeout=timeout)
        with connection.operation(f"renew lease {lease.key!r}", timeout=timeout):
            result = connection.collection.update_one(
                documents.renew_filter(lease.key, lease.owner), documents.renew_pipeline()
            )
        log_renew.debug("renewed %r: matched=%s", lease.key, result.matched_count)
        return result.matched_count == 1

    def renew_many(self, leases: list[Lease], timeout: float | None = None) -> list[Lease]:
        """Renew all ``leases`` in one round trip, single leases and ``limit=N`` slots alike; return those
        found lost (and mark them lost).

        A second query is made only when the update renewed fewer documents than there are leases, or
        when one key holds two of them (a thread pool's two slots of one key: a renewed document then says
        only that one of them is live), to learn which are lost (see ``Releases.renew_tokens``)."""
        live = [lease for lease in leases if not lease.lost and not lease.released]
        if not live:
            return []
        sent = self.store.clock.monotonic()
        # Document locks (``DocumentLock``) live in the documents they protect: one update per collection.
        in_documents = [lease for lease in live if isinstance(lease, DocumentLease)]
        leases_here = [lease for lease in live if not isinstance(lease, DocumentLease)]
        lost = self.renew_tokens(leases_here, timeout=timeout) if leases_here else []
        if in_documents:
            lost += renew_documents(in_documents, timeout=timeout)
        for lease in live:
            if lease not in lost:
                lease.renewed(sent)
            elif isinstance(lease, DocumentLease):
                lease.mark_lost(
                    "renewal found the document's lock fields no longer ours: released by force, "
                    "expired and taken, or removed",
                    release=False,
                )
            elif lease.slot is not None:
                lease.mark_lost(
                    "renewal found its slot gone: released by force, or expired and taken", release=False
                )
            else:
                lease.mark_lost(
                    "renewal matched nothing: released by force, or expired and taken over", release=False
                )
        return lost

    def mark_superseded(self, leases: list[Lease], timeout: float | None = None) -> int:
        """One read of the lease documents of ``leases`` whose holder a newer send superseded
        (``Replace(cancel_running=True)``: ``cx`` names the holder's token, ``queue.cancel_mark``); mark
        those leases superseded and return how many were."""
        by_owner = {lease.owner: lease for lease in leases}
        if not by_owner:
            return 0
        connection = self.store.connection
        with connection.operation("read supersessions", timeout=timeout):
            found = list(
                connection.collection.find(
                    {
                        "_id": {"$in": sorted({lease.key for lease in leases})},
                        "cx.o": {"$in": list(by_owner)},
                    },
                    {"cx": 1},
                )
            )
        marked = 0
        for doc in found:
            mark = doc.get("cx") or {}
            lease = by_owner.get(str(mark.get("o")))
            if (
                lease is not None
                and lease.key == doc.get("_id")
                and lease.mark_superseded(str(mark.get("t")))
            ):
                marked += 1
        return marked

    def renew_tokens(self, leases: list[Lease], timeout: float | None = None) -> list[Lease]:
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
        connection = self.store.connection
        coll = connection.collection
        with connection.operation("renew leases", timeout=timeout):
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

    # -- release one lease ---------------------------------------------------------------------------
    def release_lease(self, lease: Lease) -> bool:
        """``LeaseStore.release_lease``."""
        if lease.slot is not None:
            return self.release_slot(lease)
        store = self.store
        key, token = lease.key, lease.owner
        by = store.handoffs.by(token)
        doc = self._send_release(
            lease,
            f"release lease {key!r}",
            documents.release_filter(key, token),
            documents.release_pipeline(by, superseded_by=lease.ended_superseded_by),
            admission_docs.HANDOFF_PROJECTION,
        )
        released = doc is not None
        log_release.info("released lease %r%s", key, "" if released else " (it was no longer ours)")
        if doc is not None:
            store.handoffs.publish(key, doc, by)
        if released:
            store.records.record(store.records.local_ending(lease, "released"))
        elif lease.acquired_at is not None:
            store.records.record_lost(
                lease, "its release matched nothing: released by force, or expired and taken over"
            )
        return released

    def release_slot(self, lease: Lease) -> bool:
        """The release of a ``limit=N`` slot (``release_lease``): a parked run may be handed it."""
        store = self.store
        key, token = lease.key, lease.owner
        by = store.handoffs.by(token)
        doc = self._send_release(
            lease,
            f"release lease {key!r} slot {lease.slot}",
            {"_id": key, **slots_docs.slot_release_filter([token])},
            slot_admission.slot_release_handoff_pipeline([token], by),
            SLOT_HANDOFF_PROJECTION,
        )
        released = doc is not None
        log_release.info(
            "released lease %r slot %s%s", key, lease.slot, "" if released else " (it was no longer ours)"
        )
        if doc is not None:
            store.handoffs.publish(key, doc, by)
        if released:
            store.records.record(store.records.local_ending(lease, "released"))
        return released

    def _send_release(
        self, lease: Lease, action: str, match: Document, pipeline: list[Document], projection: Document
    ) -> Document | None:
        """One release command; with no answer, the release is retried in the background until the
        lease's deadline and ``StoreUnavailable`` raised."""
        connection = self.store.connection
        try:
            with connection.operation(action):
                doc: Document | None = connection.collection.find_one_and_update(
                    match, pipeline, projection=projection, return_document=ReturnDocument.AFTER
                )
        except (*AMBIGUOUS, StoreUnavailable, OperationFailure) as exc:
            by = lease.ended_superseded_by  # (the release it stands in for would have recorded it)
            self.release_later(lease.key, lease.owner, lease.deadline, superseded_by=by)
            if isinstance(exc, StoreUnavailable):
                raise
            raise connection.unavailable(f"release lease {lease.key!r}", exc) from None
        return doc

    def release_held(self, timeout: float, *, unrun: bool = False) -> int:
        """``LeaseStore.release_held``."""
        timeout = validate_seconds("timeout", timeout, low=0.01, high=3600.0)
        released = 0
        with pymongo.timeout(timeout):
            for lease in self.store.held_leases():
                try:
                    if self._give_back_at_exit(lease) if unrun else lease.release():
                        released += 1
                except Exception as exc:
                    log_release.warning("could not release %r (it will expire): %s", lease.key, exc)
        return released

    def _give_back_at_exit(self, lease: Lease) -> bool:
        """A lease of a task's run (taken by the task layer: its holder names the task and the delivery)
        still held when its process exits, its body not ended: the run did not end (a ``SystemExit``
        between the key's take and the body's start: a pool child's SIGTERM), so it is given back unrun,
        with its beat tick. Any other lease (a ``DocumentLock``, a hold of the body's) is released."""
        holder = lease.holder
        ours = (
            type(lease) is Lease and holder.get("task_id") is not None and holder.get("delivery") is not None
        )
        if not ours or lease.body_ended or lease.pid != os.getpid():
            return lease.release()
        tick = lease.holder.get("beat_tick")
        return self.store.give_back(lease, untick=tick if isinstance(tick, int) else None)

    # -- background releases -------------------------------------------------------------------------
    def release_tokens(
        self,
        tokens: Collection[str],
        timeout: float | None = None,
        *,
        unconfirmed: Collection[str] = (),
        superseded: Mapping[str, str] | None = None,
    ) -> int:
        """Release the leases of these owner tokens in one round trip (the heartbeat's background
        releases); return how many were released. ``StoreUnavailable`` if MongoDB does not answer.
        ``unconfirmed``: tokens of acquires whose caller never got the lease (no answer came): their run
        did not run with them, so it is not remembered as over (``seen``). ``superseded``: tokens whose
        body stopped for a newer send (``Replace(cancel_running=True)``), with that send's task id: their
        endings say so (``for``), one command each (a key held as one lease: never a slot)."""
        maybe = set(unconfirmed)
        told = {t: by for t, by in (superseded or {}).items() if t not in maybe}
        groups = [
            ([t for t in tokens if t not in maybe and t not in told], True),
            ([t for t in tokens if t in maybe], False),
        ]
        released = 0
        connection = self.store.connection
        with connection.operation("release leases in the background", timeout=timeout):
            for token, by in told.items():
                result = connection.collection.update_many(
                    documents.release_tokens_filter([token]), documents.release_pipeline(superseded_by=by)
                )
                released += result.modified_count
            for toks, seen in groups:
                if not toks:
                    continue
                result = connection.collection.update_many(
                    documents.release_tokens_filter(toks), documents.release_pipeline(seen=seen)
                )
                # (a freed slot handed to a parked run is unmarked: a worker's sweeper publishes it)
                slotted = connection.collection.update_many(
                    slots_docs.slot_release_filter(toks),
                    slot_admission.slot_release_handoff_pipeline(toks, seen=seen),
                )
                released += result.modified_count + slotted.modified_count
        return released

    def release_later(
        self,
        key: str,
        token: str,
        until: float,
        *,
        quiet: bool = False,
        maybe: bool = False,
        superseded_by: str | None = None,
    ) -> None:
        """``LeaseStore.release_later``."""
        if not quiet:
            log_release.warning("lease %r: release queued for the background until MongoDB answers", key)
        self.store.heartbeat.release_later(key, token, until, maybe=maybe, superseded_by=superseded_by)

    # -- other holders' leases -----------------------------------------------------------------------
    def release_held_by(self, **holder: Any) -> int:
        """``LeaseStore.release_held_by``: single leases, then ``limit=N`` slots, one command per key."""
        store = self.store
        connection = store.connection
        match = documents.held_by_filter(holder)
        released = 0
        with connection.operation(f"release leases held by {holder}"):
            for key in [d["_id"] for d in connection.collection.find(match, {"_id": 1})]:
                token = store.handoffs.by(uuid.uuid4().hex)
                released += self._release_dead(
                    key,
                    {**match, "_id": key},
                    documents.release_dead_holder_pipeline(token),
                    admission_docs.HANDOFF_PROJECTION,
                    token,
                )
            match_slots = slots_docs.slot_held_by_filter(holder)
            for key in [d["_id"] for d in connection.collection.find(match_slots, {"_id": 1})]:
                token = store.handoffs.by(uuid.uuid4().hex)
                released += self._release_dead(
                    key,
                    {**match_slots, "_id": key},
                    slot_admission.slot_release_dead_handoff_pipeline(holder, token),
                    SLOT_HANDOFF_PROJECTION,
                    token,
                )
        if released:
            held_by = ", ".join(f"{k}={v}" for k, v in holder.items())  # (its caller says why, once)
            log_release.info("released %d lease(s) held by %s", released, held_by)
            if store.history_days:
                # The endings are in the documents (same update) and were queued from the replies; the
                # heartbeat copies them again at its tick (a reply that lost them: the same records).
                store.heartbeat.copy_endings(ended_for(holder))
        return released

    def _release_dead(
        self, key: str, match: Document, pipeline: list[Document], projection: Document, token: str
    ) -> int:
        """One key's release in ``release_held_by`` (inside its operation): 1 if released, else 0."""
        doc = self.store.connection.collection.find_one_and_update(
            match,
            pipeline,
            projection={**projection, "ends": {"$slice": -documents.ENDS_KEPT}},
            return_document=ReturnDocument.AFTER,
        )
        if doc is None:
            return 0
        self.store.handoffs.publish(key, doc, token)
        # Its ending, in hand: a copy at the heartbeat's tick came too late when more runs than ``ends``
        # keeps ended on the key meanwhile (the parked runs behind the dead holder: a new-user trial).
        self.store.records.record_endings(key, doc, ("holder-died",))
        return 1

    def force_release(self, key: str) -> bool:
        """``LeaseStore.force_release``: the single lease and every slot, in two commands."""
        store = self.store
        connection = store.connection
        key = normalize_key(key)
        token = store.handoffs.by(uuid.uuid4().hex)
        with connection.operation(f"force-release lease {key!r}"):
            doc = connection.collection.find_one_and_update(
                documents.force_release_filter(key),
                documents.force_release_pipeline(token),
                projection=admission_docs.HANDOFF_PROJECTION,
                return_document=ReturnDocument.AFTER,
            )
            slotted = connection.collection.find_one_and_update(  # a limit=N key: every slot too
                {"_id": key, "hs.0": {"$exists": True}},
                slot_admission.slot_force_release_handoff_pipeline(token),
                projection=SLOT_HANDOFF_PROJECTION,
                return_document=ReturnDocument.AFTER,
            )
            if slotted is not None:
                store.handoffs.publish(key, slotted, token)
            if doc is None:
                doc = slotted
        log_release.warning("force-released lease %r: %s", key, "it was held" if doc else "it was free")
        if doc is not None and store.history_days:
            # An operator's command, often from a process that exits right after: copy the ending into
            # the history now (two more commands, never on a task's path).
            with contextlib.suppress(StoreUnavailable, ConfigurationError):
                store.records.write_history([], [{"_id": key}], timeout=min(store.operation_timeout, 5.0))
        if doc is not None and doc is not slotted:
            store.handoffs.publish(key, doc, token)
        return doc is not None
