"""The sweeper and lapsed reservations of runs of several keys (``core.waiting.lone_reservations``): a
lapsed reservation that nobody waits behind is left alone while its run waits parked on another of its
keys (thousands of such keys cost the sweeper nothing), and swept as before otherwise: its handoff is what
publishes a run whose keys are all reserved (a publish lost to a broker outage is made again), or finds a
run missing from some of its keys."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_mongolock import LeaseStore
from celery_mongolock.config import get_store
from celery_mongolock.integration.sweeper import Sweeper

from .test_multi_key_admission import X, Y, doc_of, multi, wait_on_y


@pytest.fixture
def app(worker_app: Celery) -> Celery:
    return worker_app


def _lapse(store: LeaseStore, key: str, *, handed: int = 2) -> None:
    """The key's reservation lapsed a second ago, handed ``handed`` times already."""
    store.collection.update_one(
        {"_id": key},
        [{"$set": {"expires_at": {"$subtract": ["$$NOW", 1000]}, "ho.hn": handed}}],
    )


def _handed(store: LeaseStore, key: str) -> Any:
    return doc_of(store, key)["ho"]["hn"]


def test_a_lone_reservation_of_a_run_parked_on_another_key_is_left_alone(app: Celery) -> None:
    store = get_store(app)
    blocker = store.acquire(Y, 60)
    assert blocker is not None
    e = multi(20)
    wait_on_y(store, e)  # x reserved for it, parked on y
    _lapse(store, X)
    (one,) = [w for w in store.waiting() if w.key == X]
    assert not one.needs_sweep and one.lone == {"merge-20"}
    Sweeper(app, interval=1.0).sweep_once()
    assert _handed(store, X) == 2  # not handed again: its run waits parked on y
    blocker.release()


def test_a_run_whose_keys_are_all_reserved_is_handed_again_and_published_again(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both keys reserved for the run (it is ready; its publish may have been lost), both lapsed after a
    first re-hand, nothing parked anywhere: the sweeper hands them again, and publishes it."""
    from celery_mongolock.integration import handoff

    published: list[str] = []
    monkeypatch.setattr(
        handoff, "publish_handoff", lambda app, key, entry, store: published.append(entry["t"])
    )
    store = get_store(app)
    blocker = store.acquire(Y, 60)
    assert blocker is not None
    e = multi(20)
    wait_on_y(store, e)
    blocker.release()  # y handed to it: ready
    assert store.reserved_for_all(e)
    _lapse(store, X)
    _lapse(store, Y)
    assert all(w.lone == {"merge-20"} and not w.needs_sweep for w in store.waiting() if w.key in (X, Y))
    Sweeper(app, interval=1.0).sweep_once()
    assert _handed(store, X) == 3 and _handed(store, Y) == 3
    assert store.reserved_for_all(e) and "merge-20" in published


def test_a_lone_reservation_of_a_run_spilled_on_another_key_is_left_alone(app: Celery) -> None:
    """A run of several keys waits on its next key spilled beyond that key's window (a deep queue): its
    lapsed reservation is left alone as for a run parked in the window (one read of the spill per pass
    for all such runs), not handed again at every lapse."""
    from .test_admission_store import entry

    app.conf.mongolock_parked_window = 2
    store = get_store(app)
    blocker = store.acquire(Y, 60)
    assert blocker is not None
    for stamp in (1, 2):  # the window of y is full
        assert store.admit(Y, {**entry(stamp), "tk": f"tk-{stamp}"}, ttl=30)[1]["lo"] == "parked"
    e = multi(20)
    wait_on_y(store, e)
    assert store.spill.waits(Y, "merge-20")
    _lapse(store, X)
    (one,) = [w for w in store.waiting() if w.key == X]
    assert one.lone == {"merge-20"}
    Sweeper(app, interval=1.0).sweep_once()
    assert _handed(store, X) == 2  # not handed again: its run waits spilled on y
    blocker.release()
