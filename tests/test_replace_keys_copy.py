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

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore

from celery_mongolock import LeaseStore, Replace, singleton_task
from celery_mongolock.config import get_store
from celery_mongolock.core.documents.sets import gate_of, set_signature

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


def test_a_copy_told_superseded_before_a_paused_run_starts_its_body(app: Celery) -> None:
    """The one shape found that puts a supersession record before a body start of the same task (the
    checker's ``superseded-ran``): the run's leases were confirmed, then it stalled before its body (a
    stopped worker, a slow backend write of ``STARTED``) past its lease on the first key; a newer send of
    its set took that key, and a copy of its message was told superseded (its task has no final state:
    the copy stores ``superseded``). The stalled run's body then starts with a lease that is no longer its
    own there (its write is fenced out; in the checker's app it retries, and the retry is superseded)."""
    from celery_mongolock.integration import signals

    store: LeaseStore = get_store(app)
    ks = sorted([A, B])
    gate = gate_of(ks)
    newer: dict[str, Any] = {
        "id": "newer/0", "t": "newer", "n": "pair", "r": "0", "s": 20, "m": b"msg", "ks": [gate, *ks],
        "g": set_signature(ks), "tk": "tk-newer",
    }  # fmt: skip
    order: list[str] = []
    taken: list[Any] = []
    task_id = f"run-{uuid.uuid4().hex}"

    @singleton_task(keys=("a:{x}", "b:{x}"), app=app, name="replace_keys_copy.stall", on_contention=Replace())
    def stall(x: str) -> str:
        from celery_mongolock import current_lease

        lease_set = current_lease()
        own = (store.collection.find_one({"_id": A}) or {}).get("owner") == lease_set[A].owner  # type: ignore[index]
        order.append(f"body (own lease on {A}: {own})")
        return "ran"

    def stalled(sender: Any = None, key: str = "", **_: Any) -> None:
        if key != A or taken:
            return
        # (past its lease on its set's gate and on A: the newer send takes both, superseding it on the gate)
        store.collection.update_many({"_id": {"$in": [gate, A]}}, [{"$set": {"expires_at": "$$NOW"}}])
        info = {"task_id": "newer", "delivery": "0", "keys": ks}
        lease, _doc = store.admit(gate, newer, ttl=30, replace=True, group=newer["g"], info=info)
        assert lease is not None
        taken.append(lease)
        lease, _doc = store.admit(A, {k: v for k, v in newer.items() if k != "g"}, ttl=30, info=info)
        assert lease is not None
        taken.append(lease)
        got: list[Any] = []

        def copy() -> None:  # another thread: not inside the stalled run's holds (no reentry)
            try:
                got.append(_deliver(stall, task_id, redelivered=True))
            except BaseException as exc:
                got.append(repr(exc))

        thread = threading.Thread(target=copy)
        thread.start()
        thread.join(60)
        result = got[0] if got else "no answer"
        order.append(f"copy: {result.get('mongolock') if isinstance(result, dict) else result}")

    signals.lease_acquired.connect(stalled, weak=False)
    try:
        assert _deliver(stall, task_id, redelivered=False) == "ran"
    finally:
        signals.lease_acquired.disconnect(stalled)
    assert order == ["copy: superseded", f"body (own lease on {A}: False)"]
    for lease in taken:
        lease.release()
