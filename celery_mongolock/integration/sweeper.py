"""The sweeper: a thread in each worker's main process that completes what crashed processes left undone.

It looks at the keys with parked runs every ``min(lease / 2, 15 s)``: it hands over keys whose holder died
without a parent to release them, re-hands handoffs nobody took up, drops revoked runs, and writes the
results of runs that timed out while parked or were superseded (a run with callbacks, or in a chain or a
chord, is ended through Celery from its own message: ``endings``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from celery import Celery

from celery_mongolock.exceptions import StoreUnavailable
from celery_mongolock.integration import config
from celery_mongolock.integration.endings import ending_publisher
from celery_mongolock.integration.handoff import install_publisher
from celery_mongolock.integration.results import (
    QUEUED,
    has_backend,
    state_of,
    write_superseded,
    write_timed_out,
)

if TYPE_CHECKING:
    from celery_mongolock.core.store import LeaseStore
    from celery_mongolock.core.waiting import WaitingKey

__all__ = ["PAGE", "Sweeper", "start_sweeper"]

log = logging.getLogger("celery_mongolock.queue")


def _revoked_ids() -> set[str]:
    try:
        from celery.worker import state

        return set(state.revoked)
    except Exception:  # pragma: no cover - not in a worker
        return set()


#: Keys read per page by the sweeper.
PAGE = 500


class Sweeper:
    """The thread in a worker's main process that completes what crashed processes left undone."""

    def __init__(self, app: Celery, interval: float, grace: float | None = None) -> None:
        self.app = app
        self.interval = interval
        #: How long a superseded run that has not written its state ``QUEUED`` (it died first, or does
        #: not store results) waits for it before the sweeper writes its result anyway.
        self.grace = max(2 * interval, config.get_settings(app).lease_seconds) if grace is None else grace
        self._unmarked: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mongolock-sweeper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sweep_once()
            except Exception as exc:
                log.warning("sweeper pass failed (will try again): %s", exc)

    def sweep_once(self) -> int:
        """One pass; returns how many keys were looked at."""
        store = config.get_store(self.app)
        install_publisher(self.app, store)
        revoked = _revoked_ids()
        waiting: list[WaitingKey] = []
        last_key: str | None = None
        while True:  # every waiting key, a page at a time
            page = store.waiting(limit=PAGE, after=last_key)
            waiting += page
            if len(page) < PAGE:
                break
            last_key = page[-1].key
        # A lapsed reservation is left alone only while its run waits parked on another key (a review of
        # stop 50: else a sweep's handoff is what publishes it once all its keys are reserved, or finds it
        # missing from one).
        parked_somewhere = frozenset().union(*(one.parked_ids for one in waiting))
        parked_somewhere |= _spilled_somewhere(store, waiting, parked_somewhere)
        for one in waiting:
            hits = sorted((one.parked_ids | one.handed_ids) & revoked)
            expired = False
            if one.spilled_ranks:  # runs spilled beyond the key's window: revoked, or past their deadline
                self._drop_spilled(store, one, revoked)
                expired = store.spill.expire(one.key, one.spilled_ranks)
            if not hits and self._not_ours(one):
                continue  # handed to a run of a task this worker does not have: a worker that has it sweeps
            if hits or one.needs_sweep or expired or not one.lone <= parked_somewhere:
                self._sweep(store, one, hits)
        return len(waiting) + self._sweep_expired_holds(store)

    def _not_ours(self, one: WaitingKey) -> bool:
        """The key (or a slot of it) is handed to a run of a task this worker does not have, the handoff
        not lapsed: publishing it is for a worker that has the task (``handoff.leave``), so this one does
        not sweep the key (which would adopt the handoff and leave it again at every pass)."""
        return bool(one.handed_names) and not one.handed_names <= set(self.app.tasks)

    def _sweep(self, store: LeaseStore, one: WaitingKey, hits: list[str]) -> None:
        """Sweep the key ``one``: its revoked runs ``hits`` dropped (their results ``REVOKED``, their
        history written), and the results of the runs that timed out or were superseded written."""
        key = one.key
        after = store.sweep(key, revoked=hits, slots=one.slotted)
        for task_id in hits:
            if task_id in one.parked_ids and has_backend(self.app):
                self.app.backend.mark_as_revoked(task_id, "revoked while parked")
        if after is None:
            return
        for task_id in sorted(set(hits) & one.handed_ids - one.parked_ids - after.on_key):
            # Handed the key, its message not taken up: the sweep dropped the handoff (a run that claimed
            # it meanwhile is on the key, and one that started is not QUEUED).
            if has_backend(self.app) and state_of(self.app, task_id) == QUEUED:
                self.app.backend.mark_as_revoked(task_id, "revoked while handed the key")
        fence = after.fence
        for run in one.runs_of(hits):
            store.record_run_ending(
                key, "revoked", run, fence=fence, ended_at=one.read_at, parked_at=run.get("at")
            )
        ending = ending_publisher(self.app)
        if after.timed_out:
            write_timed_out(self.app, store, key, list(after.timed_out), fence=fence, publish=ending)
        if after.superseded:
            write_superseded(
                self.app,
                store,
                key,
                list(after.superseded),
                ready=self._superseded_ready,
                fence=fence,
                publish=ending,
            )

    def _drop_spilled(self, store: LeaseStore, one: WaitingKey, revoked: set[str]) -> None:
        """Drop the runs of ``one`` spilled beyond its window whose task ids are ``revoked``: their results
        ``REVOKED``, their history written (as ``_sweep`` does for the runs in the window)."""
        if not revoked:
            return
        runs = store.spill.revoked_runs(one.key, revoked)
        if not runs:
            return
        store.spill.drop(one.key, [str(run.get("t")) for run in runs])
        for run in runs:
            if has_backend(self.app):
                self.app.backend.mark_as_revoked(str(run.get("t")), "revoked while parked")
            store.record_run_ending(
                one.key, "revoked", run, fence=None, ended_at=one.read_at, parked_at=run.get("at")
            )

    def _sweep_expired_holds(self, store: LeaseStore) -> int:
        """Drop the expired holds of ``limit=N`` keys nothing waits on (not in ``waiting_keys``): a
        holder that died leaves its hold there until a slot is taken again, its ending unrecorded (and
        ``why`` shows no trace of it). Returns how many keys were swept."""
        swept = 0
        last_key: str | None = None
        while True:
            page = store.keys_with_expired_holds(limit=PAGE, after=last_key)
            for key in page:
                store.sweep_expired_holds(key)
            swept += len(page)
            if len(page) < PAGE:
                return swept
            last_key = page[-1]

    def _superseded_ready(self, task_id: str) -> bool:
        """A superseded run's result may be written: the run wrote its state ``QUEUED`` (a later write of
        that state would overwrite the result), or it has not for ``grace`` seconds."""
        now = time.monotonic()
        waited = now - self._unmarked.setdefault(task_id, now)
        if state_of(self.app, task_id) == QUEUED or waited > self.grace:
            self._unmarked.pop(task_id, None)
            return True
        return False


_sweepers: dict[int, Sweeper] = {}


def start_sweeper(app: Celery) -> Sweeper:
    """Start the app's sweeper in this process (once)."""
    sweeper = _sweepers.get(id(app))
    if sweeper is None:
        settings = config.get_settings(app)
        sweeper = Sweeper(app, max(0.5, min(settings.lease_seconds / 2, 15.0)))
        _sweepers[id(app)] = sweeper
        sweeper.start()
    return sweeper


def _spilled_somewhere(
    store: LeaseStore, waiting: list[WaitingKey], parked: frozenset[str]
) -> frozenset[str]:
    """The runs of lapsed lone reservations, not parked in any window, that wait spilled on another of
    their keys (a run of several keys reserves the keys before the one it waits on, where it may be
    spilled deep): left alone like those parked in a window. One read of the spill (point reads); none
    when MongoDB does not answer (their keys are swept, as before)."""
    ids: set[str] = set()
    keys: set[str] = set()
    for one in waiting:
        for run in one.runs_of(one.lone - parked):
            ids.add(str(run.get("t")))
            keys.update(str(k) for k in run.get("ks") or [])
    if not ids or not keys:
        return frozenset()
    try:
        return frozenset(store.spill.spilled_runs(keys, ids))
    except StoreUnavailable:
        return frozenset()
