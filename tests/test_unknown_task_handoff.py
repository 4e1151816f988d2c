"""A key handed to a parked run of a task this worker does not have (a worker per queue that does not
import every module, a deploy under way, another app sharing the collection): the worker does not refuse
the run, it leaves the handoff for a worker that has the task (unpublished, adopted by that worker's
sweeper), and its own sweeper passes the key by. A handoff nobody takes up lapses and is left again,
with a WARNING that says how to drop the run if no worker has its task any more; never refused for it.

On the embedded server, with real sweeps; nothing here publishes a message (the worker that would is the
one that has the task: ``test_trust_handoff`` runs one)."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_mongolock import LeaseStore, singleton_task
from celery_mongolock.config import get_store
from celery_mongolock.integration import handoff
from celery_mongolock.integration.sweeper import Sweeper

from .servers import wait_for

KEY = "resource:absent"


@pytest.fixture
def app(worker_app: Celery) -> Celery:
    """A worker's app that does not have the task ``proj.absent``."""
    return worker_app


def entry(task_id: str = "absent-1", ttl: float = 30) -> dict[str, Any]:
    return {"id": f"{task_id}/0", "t": task_id, "n": "proj.absent", "r": "0", "s": 10, "m": b"m", "ttl": ttl}


def handoff_of(store: LeaseStore) -> dict[str, Any]:
    return dict((store.collection.find_one({"_id": KEY}) or {}).get("ho") or {})


def hand_to_the_absent_task(app: Celery, ttl: float = 30) -> LeaseStore:
    """A holder of ``KEY`` in ``app``'s worker releases it while a run of ``proj.absent`` is parked."""
    store = get_store(app)
    handoff.install_publisher(app, store)
    held = store.acquire(KEY, 60)
    assert held is not None
    assert store.admit(KEY, entry(ttl=ttl), ttl=ttl)[1]["lo"] == "parked"
    assert held.release()
    return store


def test_a_run_of_a_task_this_worker_does_not_have_is_left_not_refused(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="celery_mongolock.queue"):
        store = hand_to_the_absent_task(app)
    ho = handoff_of(store)
    assert ho["t"] == "absent-1" and ho["by"] == ""  # handed, unpublished: any worker's sweeper adopts it
    assert "a task this worker does not have; left for a worker that has it" in caplog.text
    assert not [e for e in store.history(KEY) if e.how == "refused"]
    # Its own sweeper passes the key by: it does not adopt the handoff (to leave it again at every pass).
    (one,) = [w for w in store.waiting() if w.key == KEY]
    assert one.needs_sweep and one.handed_names == {"proj.absent"}
    Sweeper(app, interval=1.0).sweep_once()
    assert handoff_of(store) == ho


def test_a_worker_that_has_the_task_adopts_the_handoff_it_left(
    app: Celery, mongo_url: str, db_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = hand_to_the_absent_task(app)
    other = Celery("with_the_task", broker="memory://", backend="cache+memory://")
    other.conf.update(mongolock_url=mongo_url, mongolock_database=db_name)
    published: list[str] = []

    @singleton_task(app=other, name="proj.absent", key="resource:{name}", on_contention="queue")
    def absent(name: str) -> None: ...

    # (the message itself, published and run by a worker that has the task: test_trust_handoff)
    monkeypatch.setattr(
        handoff, "publish_handoff", lambda app, key, entry, store=None: published.append(entry["t"])
    )
    try:
        handoff.install_publisher(other, get_store(other))
        Sweeper(other, interval=1.0).sweep_once()
        assert published == ["absent-1"]
        assert handoff_of(store)["by"].startswith("sweep:")  # adopted: published by that sweep
    finally:
        get_store(other).close()


def test_a_run_no_worker_takes_up_is_never_refused_and_says_how_to_drop_it(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """No worker takes the handoff up (none has the task, or those that have it are busy): it lapses, is
    handed again and left again, with a WARNING that says how to drop the run; never refused for that (a
    busy worker that has the task may take it up later)."""
    store = hand_to_the_absent_task(app, ttl=0.5)
    sweeper = Sweeper(app, interval=1.0)

    def handed_again() -> bool:
        sweeper.sweep_once()  # a lapsed handoff: handed again, and left again
        return int(handoff_of(store).get("hn") or 1) >= 3

    with caplog.at_level("WARNING", logger="celery_mongolock.queue"):
        wait_for(handed_again, timeout=120, message="the handoff handed again after its lapses", interval=0.2)
    assert f"if no worker has that task any more: celery mongolock drop {KEY} absent-1" in caplog.text
    assert handoff_of(store)["t"] == "absent-1"  # still its run's: nothing refused or dropped
    assert not [e for e in store.history(KEY) if e.how == "refused"]
