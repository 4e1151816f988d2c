"""``LeaseStore``'s verbs for parked runs (``ParkedRuns``, a base of ``LeaseStore``): each delegates to
the store's ``queue`` (``store_queue.QueueUpkeep``), which owns them. Apart from ``store`` so that the
façade reads in one screen per concern.
"""

from __future__ import annotations

import builtins
import datetime as _dt
from collections.abc import Collection as _Collection
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from celery_mongolock.core.documents.base import Document
from celery_mongolock.core.lease import Lease
from celery_mongolock.core.store_places import KeyPlaces
from celery_mongolock.core.waiting import Swept, WaitingKey

if TYPE_CHECKING:
    from celery_mongolock.core.store_queue import Claim, QueueUpkeep

__all__ = ["ParkedRuns"]


class ParkedRuns:
    """The parked-runs verbs of ``LeaseStore``: reservations of several-keys runs, unparking, giving a
    key back, the sweeper's list and commands, and the results and endings of parked runs."""

    queue: QueueUpkeep

    def reserve(self, lease: Lease, entry: Mapping[str, Any], *, timeout: float | None = None) -> bool:
        """Turn ``lease`` of a run that needs several keys into a reservation of its key for the run's
        parked ``entry`` (``QueueUpkeep.reserve``); False if the lease was no longer ours."""
        return self.queue.reserve(lease, entry, timeout=timeout)

    def unpark(self, key: str, entry_id: str) -> bool:
        """Remove the run ``entry_id`` from ``key`` (``QueueUpkeep.unpark``); whether it was there."""
        return self.queue.unpark(key, entry_id)

    def give_back(self, lease: Lease, *, untick: int | None = None) -> bool:
        """Release ``lease`` of a run that has not run, not remembering it as over (``QueueUpkeep.give_back``;
        ``untick``: its beat tick, which it did not run)."""
        return self.queue.give_back(lease, untick=untick)

    def unmark_handoff(self, key: str, entry: Mapping[str, Any]) -> bool:
        """Leave the handoff of ``key`` to the run ``entry`` for a worker's sweeper to publish
        (``QueueUpkeep.unmark_handoff``); False if the key is no longer handed to it."""
        return self.queue.unmark_handoff(key, entry)

    def reserved_for_all(self, entry: Mapping[str, Any]) -> bool:
        """Whether every key of the run ``entry`` (``ks``) is handed or reserved to it, not yet claimed:
        then its message is published (once per completion; copies collapse at the claims)."""
        return self.keys_state(entry) == "ready"

    def keys_state(self, entry: Mapping[str, Any]) -> str:
        """``ready``, ``waiting`` or ``missing``: where the multi-key run ``entry`` stands on its keys
        (``QueueUpkeep.keys_state``)."""
        return self.queue.keys_state(entry)

    def newer_of_set(self, key: str, entry: Mapping[str, Any]) -> str | None:
        """The newest send of the ``Replace`` set of ``entry`` newer than it that got ``key``, or None
        (``QueueUpkeep.newer_of_set``)."""
        return self.queue.newer_of_set(key, entry)

    def keys_places(self, entry: Mapping[str, Any]) -> builtins.list[tuple[str, str]]:
        """Where the multi-key run ``entry`` is on each of its keys, in key order: ``(key, place)``
        (``QueueUpkeep.keys_places``)."""
        return self.queue.keys_places(entry)

    def places_of(self, entry: Mapping[str, Any]) -> KeyPlaces:
        """``keys_places``, with when each reservation was made (``QueueUpkeep.places_of``)."""
        return self.queue.places_of(entry)

    def publish_once(self, entry: Mapping[str, Any], places: KeyPlaces) -> bool:
        """Whether the caller publishes the run ``entry``, read with every key reserved for it in
        ``places``: True for exactly one of the parties that read it so (``QueueUpkeep.publish_once``)."""
        return self.queue.publish_once(entry, places)

    def unpublish(self, entry: Mapping[str, Any]) -> None:
        """Undo ``publish_once`` for the run ``entry``: its message was left unpublished for a worker
        that has its task, which publishes it when it adopts the handoff (``QueueUpkeep.unpublish``)."""
        self.queue.unpublish(entry)

    def waiting_keys(self, limit: int = 1000, after: str | None = None) -> builtins.list[Document]:
        """Lease documents with parked runs, a pending handoff or results to write: the sweeper's list
        (``QueueUpkeep.waiting_keys``)."""
        return self.queue.waiting_keys(limit, after)

    def waiting(self, limit: int = 1000, after: str | None = None) -> builtins.list[WaitingKey]:
        """The sweeper's list, typed (``waiting_keys``): at most ``limit`` keys, after ``after``."""
        return [WaitingKey.of(doc) for doc in self.queue.waiting_keys(limit, after)]

    def sweep(self, key: str, *, revoked: _Collection[str] = (), slots: bool | None = None) -> Swept | None:
        """One sweep of ``key`` in one command (``QueueUpkeep.sweep``): what it left (None: no key
        waits there)."""
        doc = self.queue.sweep(key, revoked=revoked, slots=slots)
        return None if doc is None else Swept.of(doc)

    def keys_with_expired_holds(self, limit: int = 1000, after: str | None = None) -> builtins.list[str]:
        """``limit=N`` keys nothing waits on that keep an expired hold
        (``QueueUpkeep.keys_with_expired_holds``)."""
        return [str(doc["_id"]) for doc in self.queue.keys_with_expired_holds(limit, after)]

    def sweep_expired_holds(self, key: str) -> Document | None:
        """Drop the expired holds of ``limit=N`` key ``key`` (``QueueUpkeep.sweep_expired_holds``)."""
        return self.queue.sweep_expired_holds(key)

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
        """Queue the history record of a run that ended while parked, or of a running holder superseded
        (``running``) (``QueueUpkeep.record_run_ending``)."""
        self.queue.record_run_ending(
            key, how, run, fence=fence, ended_at=ended_at, parked_at=parked_at, by=by, running=running
        )

    def run_ended(
        self, key: str, run_ids: Sequence[str], *, task_id: str, delivery: Any, parked: bool = False
    ) -> bool:
        """Whether a run of ``run_ids`` ended and released ``key`` itself (``QueueUpkeep.run_ended``)."""
        return self.queue.run_ended(key, run_ids, task_id=task_id, delivery=delivery, parked=parked)

    def ended_superseded(self, key: str, task_id: str, retries: int) -> str | None:
        """The newer send a run stopped for before it released ``key`` (``QueueUpkeep``), or None."""
        return self.queue.ended_superseded(key, task_id, retries)

    def later_attempt(self, key: str, task_id: str, retries: int) -> bool:
        """Whether ``key`` knows an attempt of ``task_id`` after ``retries`` (``QueueUpkeep``)."""
        return self.queue.later_attempt(key, task_id, retries)

    def claim_results(
        self, key: str, field: str, task_ids: _Collection[str], *, hold: float = 30.0
    ) -> set[str]:
        """Claim entries of ``dead`` or ``sup`` before writing their results (``QueueUpkeep``)."""
        return self.queue.claim_results(key, field, task_ids, hold=hold)

    def claim_one(
        self, key: str, field: str, task_id: str, *, run_id: str | None = None, hold: float = 30.0
    ) -> Claim:
        """One run's entry of ``dead`` or ``sup``: ``got``, ``held`` by another writer, ``ended`` by one,
        or ``absent`` (``QueueUpkeep.claim_one``)."""
        return self.queue.claim_one(key, field, task_id, run_id=run_id, hold=hold)

    def forget_results(self, key: str, field: str, task_ids: _Collection[str]) -> None:
        """Remove entries of ``dead`` or ``sup`` whose results have been written
        (``QueueUpkeep.forget_results``)."""
        self.queue.forget_results(key, field, task_ids)
