"""Expired ``limit=N`` holds do not linger (issue 24, 4c), on the real (embedded) server.

A hold whose holder died stayed in the key's ``hs`` until the next command that took a slot of the key;
the sweeper only visited keys some run waits on (``wq``), so on a key with Retry/Skip/Fail runs, or with
none coming, nothing removed it: its ending (``expired``) was never recorded, ``why`` said "free" with no
trace of it, and once every hold was gone the document's ``gc_at`` was null, so the TTL index never
deleted it. The sweeper now drops such holds, and ``gc_at`` follows the latest expiry a hold has had.
"""

from __future__ import annotations

import datetime as _dt
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_mongolock import LeaseStore
from celery_mongolock.config import get_store
from celery_mongolock.integration.sweeper import Sweeper
from celery_mongolock.testing import wait_for

KEY = "tenant:24"


def _dead_hold(make_store: Any, key: str = KEY, ttl: float = 0.5) -> Any:
    """A hold whose holder is gone: taken by a store of its own, never renewed nor released."""
    hold = make_store().acquire(key, ttl, limit=3)
    assert hold is not None
    return hold


def _expired_keys(store: LeaseStore) -> list[str]:
    return store.keys_with_expired_holds()


def _doc(store: LeaseStore, key: str = KEY) -> dict[str, Any]:
    doc = store.collection.find_one({"_id": key})
    assert doc is not None
    return doc


def test_an_expired_hold_is_listed_and_dropped_and_its_ending_recorded(
    store: LeaseStore, make_store: Any
) -> None:
    store.ensure_indexes()
    dead = _dead_hold(make_store)
    live = store.acquire(KEY, 30, limit=3)
    assert live is not None
    assert _expired_keys(store) == []  # nothing expired yet: not listed

    wait_for(lambda: _expired_keys(store) == [KEY], timeout=15, message="the dead hold to expire")
    # What lingered: the hold is still in hs, its ending nowhere.
    assert {h["o"] for h in _doc(store)["hs"]} == {dead.owner, live.owner}
    assert not _doc(store).get("ends")

    after = store.sweep_expired_holds(KEY)
    assert after is not None
    assert [h["o"] for h in after["hs"]] == [live.owner]
    ends = _doc(store)["ends"]
    assert [(e["how"], e["f"], e["slot"]) for e in ends] == [("expired", dead.fence, dead.slot)]
    assert _expired_keys(store) == []
    live.renew()  # the live hold is untouched: it renews (LeaseLost if it had been dropped)
    assert live.held

    store.flush_history(timeout=10)
    stored = list(store.history_collection.find({"k": KEY}))
    assert any(r.get("f") == dead.fence for r in stored), stored
    live.release()


def test_a_key_with_only_live_holds_is_not_listed(store: LeaseStore) -> None:
    holds = [store.acquire(KEY, 30, limit=3) for _ in range(2)]
    assert None not in holds
    assert _expired_keys(store) == []
    for hold in holds:
        assert hold is not None
        hold.release()


def test_gc_at_follows_the_latest_hold_and_stays_once_the_holds_are_gone(store: LeaseStore) -> None:
    """The TTL index's ``gc_at``: never before a live hold's expiry, and not null once the last hold is
    released (it was: the document of every key ever used with ``limit=N`` stayed for good)."""
    short = store.acquire(KEY, 30, limit=3)
    long = store.acquire(KEY, 120, limit=3)
    assert short is not None and long is not None
    doc = _doc(store)
    latest = max(h["x"] for h in doc["hs"])
    assert doc["gc_at"] >= latest  # the embedded server's $max over dates had kept the shorter one
    short.release()
    long.release()
    doc = _doc(store)
    assert doc["hs"] == []
    assert doc["gc_at"] is not None and doc["gc_at"] >= latest


@pytest.fixture
def app(mongo_url: str, db_name: str) -> Iterator[Celery]:
    app = Celery("slot_sweep", broker="memory://", backend="cache+memory://")
    app.conf.update(mongolock_url=mongo_url, mongolock_database=db_name, mongolock_lease_seconds=1.0)
    yield app
    get_store(app).close()


def test_the_sweeper_drops_expired_holds_of_keys_nothing_waits_on(app: Celery, make_store: Any) -> None:
    store: LeaseStore = get_store(app)
    gone = f"{KEY}:{uuid.uuid4().hex[:6]}"
    dead = [_dead_hold(make_store, gone) for _ in range(2)]
    busy = f"{KEY}:busy"
    live = store.acquire(busy, 60, limit=3)
    assert live is not None
    busy_before = _doc(store, busy)

    sweeper = Sweeper(app, interval=0.5)

    def swept() -> bool:
        sweeper.sweep_once()
        return not _doc(store, gone)["hs"]

    wait_for(swept, timeout=20, message="the sweeper to drop the expired holds")
    doc = _doc(store, gone)
    assert sorted(e["f"] for e in doc["ends"] if e["how"] == "expired") == sorted(h.fence for h in dead)
    assert doc["gc_at"] is not None  # the TTL index may now delete it
    assert _doc(store, busy) == busy_before  # live holds are left alone, not even rewritten

    story = store.why(gone)
    assert story is not None and story.state == "free"
    assert {e.fence for e in story.endings} >= {h.fence for h in dead}
    assert all(e.how == "expired" for e in story.endings if e.fence in {h.fence for h in dead})
    assert isinstance(doc["gc_at"], _dt.datetime)
    live.release()
