"""A copy of a single-key ``Replace`` run whose body ran and stored its result keeps that result.

The several-keys path had the hole (``test_replace_keys_copy``): the run lost its lease mid-body (a paused
server, a stopped worker), a newer send took the key, the body ended (its release matched nothing, so
the key does not remember the run as over: no ``seen``), and a copy of its message (redelivered: Redis's
visibility timeout, a worker lost before the ack) was answered ``superseded`` and stored that over the
body's own result. The same shape on one key.
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

K = "one:7"


@pytest.fixture
def app(mongo_url: str, db_name: str) -> Iterator[Celery]:
    app = Celery("replace_copy", broker="memory://", backend="cache+memory://")
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
    newer: dict[str, Any] = {"id": "newer/0", "t": "newer", "n": "one", "r": "0", "s": 20, "m": b"msg"}
    taken: list[Any] = []

    @singleton_task(key="one:{x}", app=app, name="replace_copy.one", on_contention=Replace())
    def one(x: str) -> str:
        # Mid-body: the lease runs out and a newer send takes the key.
        store.collection.update_one({"_id": K}, [{"$set": {"expires_at": "$$NOW"}}])
        lease, _ = store.admit(K, newer, ttl=30, replace=True)
        assert lease is not None
        taken.append(lease)
        return "ran"

    task_id = f"run-{uuid.uuid4().hex}"
    assert _deliver(one, task_id, redelivered=False) == "ran"
    app.backend.store_result(task_id, "ran", "SUCCESS")  # what the worker stores for the body
    assert task_id + "/0" not in ((store.collection.find_one({"_id": K}) or {}).get("seen") or [])

    # A redelivered copy: before, it returned (and the worker stored) a 'superseded' result.
    try:
        got = _deliver(one, task_id, redelivered=True)
    except Ignore:
        got = "dropped"
    assert got == "dropped"
    assert app.backend.get_task_meta(task_id)["result"] == "ran"
    taken[0].release()
