"""A copy of a several-keys ``Replace`` run whose body ran and stored its result keeps that result.

The run lost its lease on its first key mid-body (a paused server, a stopped worker) and a newer send of
its set took that key; the body ended and released the other key, which remembers the run as over
(``seen``). A copy of its message (redelivered: Redis's visibility timeout, a worker lost before the
ack) is admitted key by key in sorted order: the lost key answers ``superseded`` before the key that
remembers the run is asked, and the copy stored SUCCESS ``superseded`` over the body's own result (the
lock-set checker's ``superseded-ran`` investigation; the store-level paths are in
``test_replace_keys_superseded_ran``). The copy is now dropped when the task has a final state.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore

from celery_mongolock import LeaseStore, Replace, singleton_task
from celery_mongolock.config import get_store
from celery_mongolock.core.documents.sets import set_signature

A, B = "a:7", "b:7"


@pytest.fixture
def app(mongo_url: str, db_name: str) -> Iterator[Celery]:
    app = Celery("replace_keys_copy", broker="memory://", backend="cache+memory://")
    app.conf.update(mongolock_url=mongo_url, mongolock_database=db_name, mongolock_lease_seconds=5.0)
    yield app
    get_store(app).close()


def _deliver(task: Any, task_id: str, *, redelivered: bool) -> Any:
    task.push_request(
        id=task_id, args=("7",), kwargs={}, headers={"mongolock_sent": 10},
        delivery_info={"redelivered": redelivered}, hostname="w1", retries=0, is_eager=False,
        called_directly=False,
    )  # fmt: skip
    try:
        return task._guarded(("7",), {}, direct=False)
    finally:
        task.pop_request()


def test_a_copy_of_a_run_that_ended_keeps_its_result(app: Celery) -> None:
    store: LeaseStore = get_store(app)
    ks = sorted([A, B])
    newer: dict[str, Any] = {
        "id": "newer/0", "t": "newer", "n": "pair", "r": "0", "s": 20, "m": b"msg", "ks": ks,
        "g": set_signature(ks), "tk": "tk-newer",
    }  # fmt: skip
    taken: list[Any] = []

    @singleton_task(keys=("a:{x}", "b:{x}"), app=app, name="replace_keys_copy.pair", on_contention=Replace())
    def pair(x: str) -> str:
        # Mid-body: the lease on the first key runs out and a newer send of the set takes that key.
        store.collection.update_one({"_id": A}, [{"$set": {"expires_at": "$$NOW"}}])
        lease, _ = store.admit(A, newer, ttl=30, replace=True, group=newer["g"])
        assert lease is not None
        taken.append(lease)
        return "ran"

    task_id = f"run-{uuid.uuid4().hex}"
    assert _deliver(pair, task_id, redelivered=False) == "ran"
    app.backend.store_result(task_id, "ran", "SUCCESS")  # what the worker stores for the body
    assert task_id + "/0" in ((store.collection.find_one({"_id": B}) or {}).get("seen") or [])

    # A redelivered copy: before, it returned (and the worker stored) a 'superseded' result.
    with pytest.raises(Ignore):
        _deliver(pair, task_id, redelivered=True)
    assert app.backend.get_task_meta(task_id)["result"] == "ran"
    taken[0].release()
