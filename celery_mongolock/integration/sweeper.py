"""The sweeper: a thread in each worker's main process that completes what crashed processes left undone.

It looks at the keys with parked runs every ``min(lease / 2, 15 s)``: it hands over keys whose holder died
without a parent to release them, re-hands handoffs nobody took up, drops revoked runs, and writes the
results of runs that timed out while parked or were superseded (a run with callbacks, or in a chain or a
chord, is ended through Celery from its own message: ``endings``).
"""

from __future__ import annotations

import datetime as _dt
import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from celery import Celery

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

__all__ = ["PAGE", "Sweeper", "needs_sweep", "start_sweeper"]

log = logging.getLogger("celery_mongolock.queue")


def _revoked_ids() -> set[str]:
    try:
        from celery.worker import state

        return set(state.revoked)
    except Exception:  # pragma: no cover - not in a worker
        return set()


def _ms(value: Any) -> float | None:
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=_dt.timezone.utc)
        return float(value.timestamp() * 1000)
    return None


def needs_sweep(doc: Mapping[str, Any]) -> bool:
    """Whether a key read by ``waiting_keys`` has anything for the sweeper to do, judged on the server's
    time of the read (``__now``): a sweep is a write, so keys whose queue simply waits for a running
    holder are left alone."""
    now = _ms(doc.get("__now"))
    if now is None or doc.get("dead") or doc.get("sup"):
        return True
    if _slotted(doc):
        holds = [h for h in doc.get("hs") or [] if isinstance(h, Mapping)]
        for hold in holds:
            x = _ms(hold.get("x"))
            if x is None or x <= now:
                return True  # an expired hold (a handed one goes back to the queue)
            ho = hold.get("ho")
            if isinstance(ho, Mapping) and not ho.get("by"):
                return True  # a handoff nobody published
        if doc.get("q") and len(holds) < int(doc.get("lim") or 1):
            return True  # a free slot with runs parked
        return _past_deadline(doc, now)
    expires = _ms(doc.get("expires_at"))
    if doc.get("owner") is None or expires is None or expires <= now:
        return True  # free or expired, with runs parked or a handoff pending
    ho = doc.get("ho")
    if isinstance(ho, Mapping) and not ho.get("by"):
        return True  # a handoff nobody published
    return _past_deadline(doc, now)


def _past_deadline(doc: Mapping[str, Any], now: float) -> bool:
    for entry in doc.get("q") or []:
        deadline = _ms(entry.get("dl"))
        if deadline is not None and deadline <= now:
            return True
    return False


def _slotted(doc: Mapping[str, Any]) -> bool:
    """A ``limit=N`` key (its holds in ``hs``)."""
    return "hs" in doc or "lim" in doc


def _handed_ids(doc: Mapping[str, Any]) -> set[str]:
    """Task ids of the runs the key (or a slot of it) is handed to, not yet claimed."""
    handoffs = [doc.get("ho")] + [h.get("ho") for h in doc.get("hs") or [] if isinstance(h, Mapping)]
    return {str(ho.get("t")) for ho in handoffs if isinstance(ho, Mapping)}


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
        docs: list[dict[str, Any]] = []
        last_key: str | None = None
        while True:  # every waiting key, a page at a time
            page = store.waiting_keys(limit=PAGE, after=last_key)
            docs += page
            if len(page) < PAGE:
                break
            last_key = page[-1]["_id"]
        for doc in docs:
            key = doc["_id"]
            ids = {str(e.get("t")) for e in doc.get("q") or []}
            hits = sorted((ids | _handed_ids(doc)) & revoked)
            if not hits and not needs_sweep(doc):
                continue
            after = store.sweep(key, revoked=hits, slots=_slotted(doc))
            for task_id in hits:
                if task_id in ids and has_backend(self.app):
                    self.app.backend.mark_as_revoked(task_id, "revoked while parked")
            if after is None:
                continue
            fence = after.get("fence")
            fence = fence if isinstance(fence, int) else None
            if hits:
                runs = [e for e in doc.get("q") or [] if str(e.get("t")) in hits]
                handoffs = [doc.get("ho")] + [
                    h.get("ho") for h in doc.get("hs") or [] if isinstance(h, Mapping)
                ]
                runs += [ho for ho in handoffs if isinstance(ho, Mapping) and str(ho.get("t")) in hits]
                for run in runs:
                    store.record_run_ending(
                        key, "revoked", run, fence=fence, ended_at=doc.get("__now"), parked_at=run.get("at")
                    )
            ending = ending_publisher(self.app)
            if after.get("dead"):
                write_timed_out(self.app, store, key, list(after["dead"]), fence=fence, publish=ending)
            if after.get("sup"):
                write_superseded(
                    self.app,
                    store,
                    key,
                    list(after["sup"]),
                    ready=self._superseded_ready,
                    fence=fence,
                    publish=ending,
                )
        return len(docs) + self._sweep_expired_holds(store)

    def _sweep_expired_holds(self, store: LeaseStore) -> int:
        """Drop the expired holds of ``limit=N`` keys nothing waits on (not in ``waiting_keys``): a
        holder that died leaves its hold there until a slot is taken again, its ending unrecorded (and
        ``why`` shows no trace of it). Returns how many keys were swept."""
        swept = 0
        last_key: str | None = None
        while True:
            page = store.keys_with_expired_holds(limit=PAGE, after=last_key)
            for doc in page:
                store.sweep_expired_holds(doc["_id"])
            swept += len(page)
            if len(page) < PAGE:
                return swept
            last_key = page[-1]["_id"]

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
