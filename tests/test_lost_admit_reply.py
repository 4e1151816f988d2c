"""A run's first delivery whose admit reply was lost, after that lost send parked it.

The admit is sent again with the same token. Meanwhile the key can be handed to the run and its handoff
message can claim it, run the body and release it. The second send then finds the run over. Seen in CI
(``test_rate_workers``, a key with slots, run caf85af6): the first delivery ended the task
``already-ran`` 7 ms before the handoff run stored its real result, and the caller got ``already-ran``.
The first delivery must end as a parked delivery ends, and leave the result to the run that ran.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore
from celery.signals import before_task_publish
from pymongo.errors import AutoReconnect

from celery_mongolock import LeaseStore, Queue, singleton_task
from celery_mongolock.config import get_store
from celery_mongolock.core.store_acquire import Acquisition
from celery_mongolock.integration.handoff import HANDOFF_HEADER
from celery_mongolock.integration.one_key import OneKey

KEY = "upload:1"


@pytest.fixture
def app(mongo_url: str, db_name: str) -> Iterator[Celery]:
    app = Celery("lost_admit_reply", broker="memory://", backend="cache+memory://")
    app.conf.update(mongolock_url=mongo_url, mongolock_database=db_name, mongolock_lease_seconds=5.0)
    yield app
    get_store(app).close()


def _admit(task: Any, run: str, headers: dict[str, Any]) -> Any:
    """One delivery of ``task`` reaching admission in a worker."""
    task.push_request(
        id=run, args=(KEY,), kwargs={}, headers={"mongolock_sent": 100, **headers}, delivery_info={},
        hostname="w1", retries=0, is_eager=False,
    )  # fmt: skip
    try:
        info = {"task_name": task.name, "task_id": run, "worker": "w1", "delivery": "0.0"}
        return OneKey(task, KEY, task._options(), direct=False).admit(info)
    finally:
        task.pop_request()


@pytest.mark.parametrize("limit", [None, 2])
def test_a_first_delivery_whose_lost_send_parked_it_leaves_the_result_to_its_handoff_run(
    app: Celery, monkeypatch: pytest.MonkeyPatch, limit: int | None
) -> None:
    @singleton_task(
        key="{key}", app=app, name=f"lost_reply.upload{limit}", bind=True, on_contention=Queue(), limit=limit,
        shared=False,
    )  # fmt: skip
    def upload(self: Any, key: str) -> str:
        return key

    store: LeaseStore = get_store(app)
    holders = [store.acquire(KEY, ttl=30, limit=limit) for _ in range(limit or 1)]
    assert all(holders)
    run = f"run-{uuid.uuid4().hex}"
    handoffs: list[dict[str, Any]] = []

    def published(headers: dict[str, Any] | None = None, **_: Any) -> None:
        if headers and headers.get("id") == run and HANDOFF_HEADER in headers:
            handoffs.append(dict(headers))

    before_task_publish.connect(published, weak=False)
    send_once = Acquisition._send_once
    sends: list[str] = []

    def reply_lost_once(self: Acquisition, attempt: Any, remaining: float) -> Any:
        doc = send_once(self, attempt, remaining)
        if sends or not attempt.admitting:
            sends.append("answered")
            return doc
        sends.append("lost")
        # Before the reply reaches this worker: the lost send parked the run; a holder ends and the key is
        # handed to it; its handoff message claims the key, runs the body and releases the key.
        assert doc is not None and doc["lo"] == "parked", doc
        assert holders[0] is not None
        holders[0].release()
        assert len(handoffs) == 1, handoffs
        lease = _admit(upload, run, handoffs[0])
        assert lease.key == KEY
        lease.release()
        raise AutoReconnect("the reply was lost")

    monkeypatch.setattr(Acquisition, "_send_once", reply_lost_once)
    try:
        with pytest.raises(Ignore):
            _admit(upload, run, {})
    finally:
        before_task_publish.disconnect(published)
    # The lost send, the handoff run's own claim and release, then the same admit sent again.
    assert sends[0] == "lost" and sends[-1] == "answered", sends
    assert app.backend.get_task_meta(run, cache=False)["status"] != "SUCCESS"
    for lease in holders[1:]:
        assert lease is not None
        lease.release()


def test_the_same_for_a_run_that_needs_several_keys(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    from celery_mongolock.integration.several_keys import SeveralKeys

    @singleton_task(
        keys=("a:{a}", "b:{b}"), app=app, name="lost_reply.pair", bind=True, on_contention=Queue(),
        shared=False,
    )  # fmt: skip
    def pair(self: Any, a: int, b: int) -> str:
        return "ran"

    store: LeaseStore = get_store(app)
    keys = ["a:1", "b:1"]
    holders = [store.acquire(key, ttl=30) for key in keys]
    run = f"run-{uuid.uuid4().hex}"
    handoffs: list[dict[str, Any]] = []

    def published(headers: dict[str, Any] | None = None, **_: Any) -> None:
        if headers and headers.get("id") == run and HANDOFF_HEADER in headers:
            handoffs.append(dict(headers))

    def take(headers: dict[str, Any]) -> Any:
        pair.push_request(
            id=run, args=(1, 1), kwargs={}, headers={"mongolock_sent": 100, **headers}, delivery_info={},
            hostname="w1", retries=0, is_eager=False, called_directly=False,
        )  # fmt: skip
        try:
            return SeveralKeys(pair, keys, pair._options(), direct=False).take()
        finally:
            pair.pop_request()

    send_once = Acquisition._send_once
    sends: list[str] = []

    def reply_lost_once(self: Acquisition, attempt: Any, remaining: float) -> Any:
        doc = send_once(self, attempt, remaining)
        if "lost" in sends or not attempt.admitting or attempt.key != "b:1":
            sends.append(f"answered {attempt.key}")
            return doc
        sends.append("lost")
        assert doc is not None and doc["lo"] == "parked", doc
        for lease in holders:  # both holders end: the run is handed both keys, and published
            assert lease is not None
            lease.release()
        assert len(handoffs) == 1, handoffs
        taken = take(handoffs[0])
        assert sorted(taken.keys) == keys
        taken.release()
        raise AutoReconnect("the reply was lost")

    before_task_publish.connect(published, weak=False)
    monkeypatch.setattr(Acquisition, "_send_once", reply_lost_once)
    try:
        with pytest.raises(Ignore):
            take({})
    finally:
        before_task_publish.disconnect(published)
    assert "lost" in sends and sends[-1] == "answered b:1", sends
    assert app.backend.get_task_meta(run, cache=False)["status"] != "SUCCESS"
