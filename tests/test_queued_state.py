"""The ``QUEUED`` state of a parked run never overwrites the run's final state.

A parked run writes its own state ``QUEUED`` after its park; a newer ``Replace`` send may supersede it
and write its final ``SUCCESS`` ``superseded`` result in between (the lock-set checker found a run left
``QUEUED`` for good this way: seed 2 of the bounded run). Here the parked run's write is held inside the
result backend, between the backend's read and its write, until the newer send's admission is over.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore

from celery_mongolock import LeaseStore, Replace, singleton_task
from celery_mongolock._queue import Sweeper
from celery_mongolock.config import get_settings, get_store

KEY = "report:7"


@pytest.fixture
def app(mongo_url: str, db_name: str) -> Iterator[Celery]:
    app = Celery("queued_state", broker="memory://", backend="cache+memory://")
    app.conf.update(mongolock_url=mongo_url, mongolock_database=db_name, mongolock_lease_seconds=1.0)
    yield app
    get_store(app).close()


def _task(app: Celery) -> Any:
    @singleton_task(key="{key}", app=app, name="queued_state.latest", bind=True, on_contention=Replace())
    def latest(self: Any, key: str) -> str:
        return key

    return latest


def _admit(task: Any, task_id: str, stamp: int) -> None:
    """One delivery of ``task`` reaching admission in a worker (parked: it raises Ignore)."""
    task.push_request(
        id=task_id, args=(KEY,), kwargs={}, headers={"mongolock_sent": stamp}, delivery_info={},
        hostname="w1", retries=0, is_eager=False,
    )  # fmt: skip
    try:
        info = {"task_name": task.name, "task_id": task_id, "worker": "w1", "delivery": "0.0"}
        policy = task._options().on_contention
        with pytest.raises(Ignore):
            task._admit(KEY, task._options(), policy, info, get_store(task.app))
    finally:
        task.pop_request()


def test_a_run_superseded_while_it_writes_its_queued_state_ends_superseded(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = _task(app)
    store: LeaseStore = get_store(app)
    holder = store.acquire(KEY, ttl=30)
    assert holder is not None
    old_run, new_run = f"old-{uuid.uuid4().hex}", f"new-{uuid.uuid4().hex}"
    in_write, admitted = threading.Event(), threading.Event()
    backend_class = type(app.backend)  # one backend object per thread: hold the write in the class
    set_with_state = backend_class._set_with_state

    def held_write(self: Any, key: Any, value: Any, state: Any) -> Any:
        if state == "QUEUED" and old_run.encode() in (key if isinstance(key, bytes) else key.encode()):
            in_write.set()  # the backend has read the run's state (not final yet): hold its write
            assert admitted.wait(30)
        return set_with_state(self, key, value, state)

    monkeypatch.setattr(backend_class, "_set_with_state", held_write)
    old = threading.Thread(target=_admit, args=(task, old_run, 100))
    old.start()
    assert in_write.wait(30)
    _admit(task, new_run, 200)  # supersedes old_run while its QUEUED write is on its way
    admitted.set()
    old.join(30)
    meta = app.backend.get_task_meta(old_run, cache=False)
    assert meta["status"] == "SUCCESS", meta
    assert meta["result"] == {"mongolock": "superseded", "key": KEY, "by": new_run}
    assert app.backend.get_task_meta(new_run, cache=False)["status"] == "QUEUED"
    holder.release()


def test_the_sweeper_writes_the_result_of_a_superseded_run_that_never_wrote_its_state(app: Celery) -> None:
    task = _task(app)
    store: LeaseStore = get_store(app)
    holder = store.acquire(KEY, ttl=30)
    assert holder is not None
    old_run, new_run = f"old-{uuid.uuid4().hex}", f"new-{uuid.uuid4().hex}"
    # old_run parked and died before it wrote its state (no QUEUED): parked at the store level only.
    entry = {"id": f"{old_run}/0.0", "t": old_run, "n": task.name, "r": "0.0", "s": 100, "m": b"m"}
    assert store.admit(KEY, entry, replace=True)[1]["lo"] == "parked"
    _admit(task, new_run, 200)
    sweeper = Sweeper(app, interval=get_settings(app).lease_seconds / 2)
    deadline = time.monotonic() + 60
    while app.backend.get_task_meta(old_run, cache=False)["status"] != "SUCCESS":
        assert time.monotonic() < deadline, "the sweeper never wrote the superseded result"
        sweeper.sweep_once()
        time.sleep(0.05)
    assert app.backend.get_task_meta(old_run)["result"]["by"] == new_run
    holder.release()
