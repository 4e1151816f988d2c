"""The lease store's acquisitions (a part of ``LeaseStore``): ``try_acquire`` (one command, retried with
the same token on an ambiguous outcome), ``acquire`` and ``admit`` (a queued run's acquire); ``hold`` is in
``store_hold``, ``wait_free`` in ``store_wait``. What is sent is chosen by ``acquire_command`` and built
in ``documents``.

The acquire algorithm (one round trip)
======================================
1. A fresh owner token is drawn for every acquisition.
2. One ``findAndModify`` with ``{_id: key}``, ``upsert: true`` and an *update pipeline*
   (``documents.acquire_pipeline``) that, on the server, computes
   ``free = owner is null OR expires_at <= $$NOW OR owner == token`` and, only when free, sets owner,
   ttl, holder, ``expires_at = $$NOW + ttl`` and ``fence = max(fence + 1, $$NOW in ms * 1000)``; when
   not free every field is left as it was. Expiry is therefore judged on the server clock, inside the
   same atomic write; no client clock is involved.
3. The document after the update says who holds the key: our token means acquired, anything else is
   contention (the holder's details are reported), not an error.
4. If the reply is lost (network error, timeout, primary step-down) the *same* command with the *same*
   token is sent again: the ``owner == token`` clause makes the retry take over our own half-finished
   acquisition instead of seeing it as contention. If no retry gets through, the token is handed to the
   heartbeat thread, which releases it as soon as the server answers, so an ambiguous acquire never
   blocks the key until expiry for nothing.
5. Concurrent upserts of a missing key may collide on ``_id`` (``DuplicateKeyError``): the loser
   simply repeats step 2, which now sees the winner's document.
"""

from __future__ import annotations

import logging
import os
import random
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pymongo import ReadPreference, ReturnDocument
from pymongo.collection import Collection
from pymongo.errors import DuplicateKeyError, OperationFailure

from celery_mongolock.core.acquire_command import acquire_command
from celery_mongolock.core.documents import base as documents
from celery_mongolock.core.documents import lanes
from celery_mongolock.core.documents import queue as admission_docs
from celery_mongolock.core.documents.base import Document
from celery_mongolock.core.documents.entries import PARK_BUDGET, entry_bytes
from celery_mongolock.core.documents.sets import as_on_key
from celery_mongolock.core.keys import normalize_key
from celery_mongolock.core.lease import Lease, LeaseBackend
from celery_mongolock.core.lease_info import aware
from celery_mongolock.core.outcomes import plain_admit_reply, untrusted_admit_reply
from celery_mongolock.core.store_connection import AMBIGUOUS
from celery_mongolock.core.store_spill import SPILL_MESSAGE_LIMIT, Spill, Stored
from celery_mongolock.core.validation import (
    MAX_LEASE_SECONDS,
    validate_lease_timing,
    validate_limit,
    validate_seconds,
)
from celery_mongolock.exceptions import ConfigurationError, MessageTooLarge, StoreUnavailable

if TYPE_CHECKING:
    from celery_mongolock.core.heartbeat import Heartbeat
    from celery_mongolock.core.store_connection import Connection
    from celery_mongolock.core.store_handoffs import Handoffs
    from celery_mongolock.core.store_history import Records

__all__ = ["Acquisition", "AcquisitionOwner", "Attempt", "acquire_command"]

log_acquire = logging.getLogger("celery_mongolock.acquire")


class AcquisitionOwner(LeaseBackend, Protocol):
    """What acquisitions need from the store that owns them (``LeaseStore`` implements it); the store is
    also the backend of the leases they issue."""

    @property
    def lease_seconds(self) -> float: ...

    @property
    def heartbeat_seconds(self) -> float: ...

    @property
    def operation_timeout(self) -> float: ...

    @property
    def history_days(self) -> float: ...

    @property
    def connection(self) -> Connection: ...

    @property
    def collection(self) -> Collection[Document]: ...

    @property
    def handoffs(self) -> Handoffs: ...

    @property
    def records(self) -> Records: ...

    @property
    def spill(self) -> Spill: ...

    @property
    def heartbeat(self) -> Heartbeat: ...

    def mark_superseded(self, leases: list[Lease], timeout: float | None = None) -> int: ...

    def try_acquire(
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
        admission: Mapping[str, Any] | None = None,
        waited_ms: int | None = None,
        waited_since_ms: int | None = None,
        limit: int | None = None,
        ended_runs: Sequence[str] = (),
    ) -> tuple[Lease | None, Document | None]: ...


@dataclass
class Attempt:
    """One acquisition: what is sent, and once sent, what came back."""

    key: str
    token: str
    ttl_s: float
    beat: float
    holder: Document
    limit: int | None
    admitting: bool
    heartbeat: bool
    pipeline: list[Document]
    projection: Document | None
    doc: Document | None = None
    sent_at: float = 0.0
    #: Some attempt may have reached the server with no answer back.
    ambiguous: bool = False
    #: Until when (monotonic) a copy of an unanswered attempt may still land on the server.
    landing_window: float = 0.0
    #: An admit's run (its task id): no answer naming it as the newer send is taken.
    run_id: str | None = None


class _NotOurReply(Exception):
    """An admit's reply that cannot be its own answer (``outcomes.untrusted_admit_reply``)."""


def _check_ticks(tick: int | None, hold_until_ms: int | None) -> None:
    if tick is not None and (isinstance(tick, bool) or not isinstance(tick, int)):
        raise ConfigurationError(f"tick must be an int, got {type(tick).__name__}")
    if hold_until_ms is not None and (isinstance(hold_until_ms, bool) or not isinstance(hold_until_ms, int)):
        raise ConfigurationError(
            f"hold_until_ms must be an int (epoch ms), got {type(hold_until_ms).__name__}"
        )


class Acquisition:
    """Taking the leases of one store."""

    def __init__(self, store: AcquisitionOwner) -> None:
        self.store = store

    def try_acquire(
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
        admission: Mapping[str, Any] | None = None,
        waited_ms: int | None = None,
        waited_since_ms: int | None = None,
        limit: int | None = None,
        ended_runs: Sequence[str] = (),
    ) -> tuple[Lease | None, Document | None]:
        """One acquire (with its retries on an ambiguous outcome): ``(lease, None)`` when taken, else
        ``(None, the document)``. ``admission``: the keyword arguments of ``queue.admit_pipeline``
        (a queued run's admit: the outcome is in the returned document's ``lo``). ``ended_runs``: a
        copy's run ids (not for an admission, which judges its copies itself): refused, even when free,
        when one of them is remembered as over (the duplicate guard, in the acquire itself).

        The command is built (``acquire_command``), sent (``send``) and its reply read (``reply``)."""
        store = self.store
        key = normalize_key(key)
        hold_s = validate_seconds("min_hold", min_hold, low=0.0, high=MAX_LEASE_SECONDS)
        _check_ticks(tick, hold_until_ms)
        default_beat = store.heartbeat_seconds if ttl is None else None
        ttl_s, beat = validate_lease_timing(
            store.lease_seconds if ttl is None else ttl,
            default_beat if heartbeat_seconds is None else heartbeat_seconds,
            name="lease_seconds" if ttl is None else "ttl",
        )
        holder = documents.holder_info(store.connection.host, os.getpid(), info)
        token = uuid.uuid4().hex
        limit = validate_limit(limit)
        pipeline, projection = acquire_command(
            token,
            int(ttl_s * 1000),
            holder,
            limit=limit,
            admission=admission,
            hold_ms=int(hold_s * 1000),
            tick=tick,
            hold_until_ms=hold_until_ms,
            waited_ms=waited_ms,
            waited_since_ms=waited_since_ms,
            ended_runs=ended_runs,
        )
        attempt = Attempt(
            key, token, ttl_s, beat, holder, limit, admission is not None, heartbeat, pipeline, projection
        )
        if admission is not None:
            attempt.run_id = str(admission["entry"]["t"])
        self.send(attempt)
        return self.reply(attempt)

    def send(self, attempt: Attempt) -> None:
        """Send ``attempt``'s command until it is answered (the reply in ``attempt.doc``), retrying with
        the same token on an ambiguous outcome until ``operation_timeout``. ``StoreUnavailable`` if no
        answer came: then a copy that may still land is released in the background."""
        store = self.store
        clock = store.clock
        give_up_at = clock.monotonic() + store.operation_timeout
        tries = 0
        last_error: BaseException | None = None
        attempt.sent_at = clock.monotonic()
        while True:
            tries += 1
            remaining = give_up_at - clock.monotonic()
            if remaining <= 0:
                break
            try:
                attempt.doc = self._send_once(attempt, remaining)
                last_error = None
                break
            except DuplicateKeyError:
                # Two upserts of a missing key raced; the other insert won. Run again: now it matches.
                if tries >= 5:
                    raise StoreUnavailable(f"acquire of {attempt.key!r} kept colliding on insert") from None
                continue
            except (*AMBIGUOUS, _NotOurReply) as exc:
                last_error = exc
                attempt.ambiguous = True
                log_acquire.info(
                    "acquire %r: ambiguous outcome (%s), retrying with the same token",
                    attempt.key,
                    exc if isinstance(exc, _NotOurReply) else type(exc).__name__,
                )
            except OperationFailure as exc:  # RetryableWriteError-labelled failures
                last_error = exc
                attempt.ambiguous = True
            except StoreUnavailable as exc:
                last_error = exc
                break
            backoff = 0.05 * (2 ** min(tries, 6)) * (0.5 + random.random())
            clock.sleep(min(backoff, max(0.0, give_up_at - clock.monotonic())))
        # A copy of an attempt that got no answer may still be queued on the server and land later
        # (until the server gives up on it, a little after our deadline). Our token must not be left
        # holding the key for nobody: release it in the background during that window.
        attempt.landing_window = clock.monotonic() + store.operation_timeout + 5.0
        if last_error is not None:
            if attempt.ambiguous:
                store.release_later(attempt.key, attempt.token, attempt.landing_window, maybe=True)
            if isinstance(last_error, StoreUnavailable):
                raise last_error
            raise store.connection.unavailable(f"acquire lease {attempt.key!r}", last_error) from None

    def _send_once(self, attempt: Attempt, remaining: float) -> Document | None:
        """One ``findAndModify`` of ``attempt`` (errors after which the outcome is unknown passed through)."""
        connection = self.store.connection
        coll = connection.ready_collection()
        # (``attempt.sent_at`` stays the first send's: the command that took the key may be that one, and a
        # later send with the same token may not extend the lease (a ``limit=N`` admit answers ``mine``
        # without renewing): a local deadline counted from a later send could outlive the server's.)
        with connection.operation(f"acquire lease {attempt.key!r}", timeout=remaining, retryable=True):
            doc: Document | None = coll.find_one_and_update(
                documents.acquire_filter(attempt.key),
                attempt.pipeline,
                projection=attempt.projection,
                upsert=True,
                return_document=ReturnDocument.AFTER,
            )
            if doc is None:
                # Seen on the embedded server under contention: the update was applied but no
                # document returned. Read it back; our token tells whether we got it.
                primary = coll.with_options(read_preference=ReadPreference.PRIMARY)
                doc = primary.find_one(documents.acquire_filter(attempt.key), attempt.projection)
                read_back = True
            else:
                read_back = False
        if attempt.admitting:
            why = untrusted_admit_reply(doc, attempt.token, attempt.run_id, read_back=read_back)
            if why is not None:
                raise _NotOurReply(why)
        return doc

    def reply(self, attempt: Attempt) -> tuple[Lease | None, Document | None]:
        """The outcome of an answered ``attempt``: the lease, or None and the document (contention)."""
        doc, key, token = attempt.doc, attempt.key, attempt.token
        if attempt.admitting and doc is not None:
            plain_admit_reply(doc, token, attempt.ambiguous)
        if attempt.limit is not None:
            return self.slot_lease(attempt)
        if doc is None or doc.get("owner") != token:
            if doc is not None:
                log_acquire.debug("lease %r is held by %s", key, doc.get("holder"))
            if attempt.ambiguous:
                self.store.release_later(key, token, attempt.landing_window, quiet=True, maybe=True)
            return None, doc
        lease = self._lease(
            attempt,
            fence=doc["fence"],
            expires=doc.get("expires_at"),
            acquired=doc.get("acquired_at"),
            waited=doc.get("waited_ms"),
        )
        taken_over = documents.ended_by_takeover(doc)
        if taken_over is not None:
            self.store.records.record(documents.history_record(key, taken_over))
        log_acquire.info("acquired lease %r fence=%s ttl=%gs", key, lease.fence, attempt.ttl_s)
        if attempt.heartbeat:
            self.store.heartbeat.add(lease)
        return lease, doc

    def slot_lease(self, attempt: Attempt) -> tuple[Lease | None, Document | None]:
        """The outcome of a ``limit=N`` acquire, from its reply: our hold is in ``hs``, or the key is full."""
        doc, key, token = attempt.doc, attempt.key, attempt.token
        for ending in documents.slots_expired_by(doc):
            self.store.records.record(documents.history_record(key, ending))
        if doc is not None:
            doc.pop("ends", None)
        mine = next((h for h in (doc or {}).get("hs") or [] if h.get("o") == token), None)
        if mine is None:
            if attempt.ambiguous:
                self.store.release_later(key, token, attempt.landing_window, quiet=True, maybe=True)
            return None, doc
        lease = self._lease(
            attempt,
            fence=mine["f"],
            expires=mine.get("x"),
            acquired=mine.get("a"),
            waited=mine.get("w"),
            slot=int(mine["s"]),
        )
        log_acquire.info(
            "acquired lease %r slot %s fence=%s ttl=%gs", key, lease.slot, lease.fence, attempt.ttl_s
        )
        if attempt.heartbeat:
            self.store.heartbeat.add(lease)
        return lease, doc

    def _lease(
        self,
        attempt: Attempt,
        *,
        fence: Any,
        expires: Any,
        acquired: Any,
        waited: Any,
        slot: int | None = None,
    ) -> Lease:
        lease = Lease(
            self.store,
            attempt.key,
            attempt.token,
            fence=int(fence),
            ttl=attempt.ttl_s,
            heartbeat_seconds=attempt.beat,
            expires_at=aware(expires),
            sent_at=attempt.sent_at,
            holder=attempt.holder,
            acquired_at=aware(acquired),
            waited_ms=waited,
            slot=slot,
        )
        if attempt.ambiguous:
            lease.ambiguous_until = attempt.landing_window
        return lease

    # -- on top of try_acquire -----------------------------------------------------------------------
    def admit(
        self,
        key: str,
        entry: Mapping[str, Any],
        *,
        ttl: float | None = None,
        claim: str | None = None,
        timeout: float | None = None,
        max_length: int | None = None,
        replace: bool = False,
        debounce: float | None = None,
        due: bool = False,
        max_wait: float | None = None,
        min_hold: float = 0.0,
        info: Mapping[str, Any] | None = None,
        heartbeat: bool = False,
        heartbeat_seconds: float | None = None,
        limit: int | None = None,
        group: str | None = None,
        cancel: bool = False,
    ) -> tuple[Lease | None, Document]:
        """Admit a run of a queued task (one ``findAndModify``): take ``key``, claim the handoff
        ``claim``, or park the run (``entry``: ``id``, ``t``, ``s`` and the fields listed in
        ``documents.queue``; ``tk`` and ``ttl`` are filled in). Returns ``(lease, document)``; the outcome
        is the document's ``lo`` (``queue.ADMIT_OUTCOMES``). ``timeout``: seconds the run may stay
        parked; ``max_length``: the longest queue (``full`` beyond); ``replace``: at most one parked
        run, a newer send supersedes it; ``debounce``: every run parks and may start only when no newer
        send came for that many seconds; ``due``: the run's own delayed copy, which takes the key for its
        entry once due; ``max_wait`` (with ``debounce``): a run that supersedes others is due no later
        than that many seconds after the first of them began waiting; ``limit``: the key has N slots
        (``limit=N``), a parked run is handed any one; ``group`` (with ``replace``): the run's key-set
        signature (``documents.sets``); ``cancel`` (with ``replace``): a run parked behind a running holder
        supersedes it too (``queue.cancel_mark``). A handoff this admit made (the key was found free with
        older runs parked) is published (``add_handoff_callback``). One ``store.try_acquire`` with
        ``admission``."""
        store = self.store
        # A plain Queue run may be spilled (``documents.spill``), of one key or of several (those take their
        # keys one at a time, ``key_set``), not a Replace run: on its set's gate (``g``), where a
        # newer send of the set must find it (on a later key it waits as a Queue run, without ``g``).
        spills = not (replace or debounce or group is not None or (entry.get("ks") and entry.get("g")))
        size, most = entry_bytes(entry), SPILL_MESSAGE_LIMIT if spills else PARK_BUDGET
        if size > most:  # (the command itself would pass MongoDB's limit; a spilled run must fit alone)
            raise MessageTooLarge(key, size, most)
        full_entry = _parked_entry(as_on_key(key, entry), store.lease_seconds if ttl is None else ttl)
        gone: tuple[int, tuple[tuple[int, int, int], ...]] | None = None
        for _ in range(_SPILL_TRIES):
            lease, doc = self._admit_once(
                key, full_entry, ttl, timeout=timeout, max_length=max_length, claim=claim, replace=replace,
                debounce=debounce, due=due, max_wait=max_wait, min_hold=min_hold, info=info,
                heartbeat=heartbeat, heartbeat_seconds=heartbeat_seconds, limit=limit, group=group,
                cancel=cancel, window=store.spill.window if spills else None, gone=gone,
            )  # fmt: skip
            if doc.get("lo") == "full" and max_length is not None and spills and gone is None:
                # Its lanes may hold runs that left before their turn: counted out, the admit is made again
                # (once; only when the queue looks full).
                gone = store.spill.gone_allowance(normalize_key(key), doc)
                if gone is not None:
                    continue
            if gone is not None and _unmoved(doc, gone[1]):
                doc = {**doc, "_gone": gone[0]}  # (tombstones still under the lanes: ``Admission.queued``)
            if lease is not None or doc.get("lo") != "spilled":
                return lease, doc
            if store.spill.park(normalize_key(key), full_entry, doc, timeout) != Stored.AGAIN:
                return lease, doc
        raise StoreUnavailable(
            f"could not park a run of {key!r}: the number its admit took was given up {_SPILL_TRIES} times"
        )

    def _admit_once(
        self,
        key: str,
        full_entry: dict[str, Any],
        ttl: float | None,
        *,
        timeout: float | None,
        max_length: int | None,
        claim: str | None,
        replace: bool,
        debounce: float | None,
        due: bool,
        max_wait: float | None,
        min_hold: float,
        info: Mapping[str, Any] | None,
        heartbeat: bool,
        heartbeat_seconds: float | None,
        limit: int | None,
        group: str | None,
        cancel: bool,
        window: int | None,
        gone: tuple[int, tuple[tuple[int, int, int], ...]] | None = None,
    ) -> tuple[Lease | None, Document]:
        """One admit command (``admit``)."""
        store = self.store
        entry = full_entry
        timeout_ms = (
            None
            if timeout is None
            else int(validate_seconds("timeout", timeout, low=0.0, high=MAX_LEASE_SECONDS) * 1000)
        )
        # The holder names the run, so that a copy of its message is recognised while it runs.
        run_info = {"task_id": entry["t"], "task_name": entry.get("n"), "delivery": entry.get("r")}
        run_info = {k: v for k, v in run_info.items() if v is not None}
        if group is not None:  # a run of a key set: which set, and its send (``sets.holder_older_of_set``)
            run_info.update({"set": group, "sent": int(entry["s"])})
        lease, doc = store.try_acquire(  # (through the store: a test's stand-in for it takes effect)
            key,
            ttl,
            info={**run_info, **(info or {})},
            heartbeat=heartbeat,
            heartbeat_seconds=heartbeat_seconds,
            min_hold=min_hold,
            admission={
                "entry": full_entry,
                "timeout_ms": timeout_ms,
                "claim": claim,
                "max_length": max_length,
                "replace": replace,
                "debounce_ms": int(debounce * 1000) if debounce else None,
                "due": due,
                **({} if group is None else {"group": group}),
                **({"cancel": True} if cancel else {}),
                **({"max_wait_ms": int(max_wait * 1000)} if max_wait and debounce else {}),
                **({"window": window} if window else {}),
                **({"gone": gone} if gone else {}),
            },
            limit=limit,
        )
        doc = dict(doc or {})
        if lease is not None:
            doc.setdefault("lo", "acquired")
            lease.notice_supersession = cancel
            if cancel and claim is not None:
                self._read_claim_mark(key, lease)
        self._admitted(normalize_key(key), lease, doc, limit)
        return lease, doc

    def _read_claim_mark(self, key: str, lease: Lease) -> None:
        """Handed the key before a newer send parked: the claim marked it superseded (one read, only for
        such claims: the reply of an acquisition carries no document)."""
        try:
            self.store.mark_superseded([lease])
        except StoreUnavailable as exc:  # the lease watch or the heartbeat reads the mark later
            log_acquire.warning("reading the supersession of %r after its claim failed: %s", key, exc)

    def _admitted(self, key: str, lease: Lease | None, doc: Document, limit: int | None) -> None:
        """Publish the handoffs an admit made (a key found free with older runs parked; any admit of a
        slotted key may hand free slots; a spilled run refills once stored: ``_store_spilled``)."""
        handed = None
        admit_token = str(doc.get("_admit_token") or "")
        marker = admission_docs.admit_marker(admit_token) if admit_token else ""
        if limit is not None:
            handed = self.store.handoffs.publish(key, doc, marker, refill=doc.get("lo") != "spilled")
        elif lease is None and doc.get("lo") in ("parked", "spilled"):
            handed = self.store.handoffs.publish(key, doc, marker, refill=doc.get("lo") == "parked")
        elif lease is not None and doc.get("lo") == "claimed":
            self.store.spill.after_claim(key, doc)
        if handed is not None and self.store.history_days:
            # The key was found vacant: the ending of a lease it found expired is in the reply's ``ends``
            # (``ADMIT_PROJECTION``), written by this command. (And copied at the tick, as before: a
            # ``limit=N`` key's slot endings were taken out of the reply by ``slot_lease``.)
            self.store.records.record_takeovers(key, doc)
            self.store.heartbeat.copy_endings({"_id": key})


#: How many times an admit whose run was spilled takes a new number when a refill gave its number up.
_SPILL_TRIES = 5


def _parked_entry(entry: Mapping[str, Any], ttl_seconds: float) -> dict[str, Any]:
    """A run's entry as an admit parks it: its fields checked, a handoff token (``tk``, unless given) and
    its lease time (``ttl``, ms)."""
    for field in ("id", "t", "s"):
        if field not in entry:
            raise ConfigurationError(f"a parked entry needs {field!r}, got {sorted(entry)}")
    full_entry = dict(entry)
    full_entry.setdefault("tk", uuid.uuid4().hex)
    full_entry["ttl"] = int(ttl_seconds * 1000)
    return full_entry


def _unmoved(doc: Mapping[str, Any], heads: tuple[tuple[int, int, int], ...]) -> bool:
    """Every lane of the reply ``doc`` is where it stood when its tombstones were counted (``heads``)."""
    now = {(lane.rank, lane.epoch, lane.head) for lane in lanes.lanes_of(doc)}
    return bool(heads) and all(head in now for head in heads)
