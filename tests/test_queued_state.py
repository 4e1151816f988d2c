"""The ``QUEUED`` state of a parked run never overwrites the run's final state.

A parked run once wrote its state ``QUEUED`` after its park, and a newer ``Replace`` send could supersede
it and write its final ``SUCCESS`` ``superseded`` result in between (the lock-set checker found a run left
``QUEUED`` for good this way: seed 2 of the bounded run). The state is now written before the admit, so
every later write (a result) lands after it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore

from celery_mongolock import LeaseStore, LockContended, Queue, Replace, singleton_task
from celery_mongolock.config import get_settings, get_store
from celery_mongolock.integration.queued_run import QueuedRun
from celery_mongolock.integration.sweeper import Sweeper

KEY = "report:7"


def admit_one(task: Any, key: str) -> Any:
    """A queued run of one key reaching admission in a worker: its lease, or its outcome (or it raises)."""
    got = QueuedRun(task, [key], task._options(), one=True).take()
    return got[0] if isinstance(got, list) else got


@pytest.fixture
def app(mongo_url: str, db_name: str) -> Iterator[Celery]:
    app = Celery("queued_state", broker="memory://", backend="cache+memory://")
    app.conf.update(mongolock_url=mongo_url, mongolock_database=db_name, mongolock_lease_seconds=1.0)
    yield app
    get_store(app).close()


def _task(app: Celery) -> Any:
    @singleton_task(
        key="{key}", app=app, name="queued_state.latest", bind=True, on_contention=Replace(), shared=False
    )
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
        with pytest.raises(Ignore):
            admit_one(task, KEY)
    finally:
        task.pop_request()


def test_a_parked_run_s_queued_state_comes_before_its_park_so_never_over_its_result(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = _task(app)
    store: LeaseStore = get_store(app)
    holder = store.acquire(KEY, ttl=30)
    assert holder is not None
    old_run, new_run = f"old-{uuid.uuid4().hex}", f"new-{uuid.uuid4().hex}"
    writes: list[tuple[str, str, bool]] = []
    backend_class = type(app.backend)
    set_with_state = backend_class._set_with_state

    def logged(self: Any, key: Any, value: Any, state: Any) -> Any:
        name = key.decode() if isinstance(key, bytes) else str(key)
        parked = bool((store.collection.find_one({"_id": KEY}) or {}).get("q"))
        writes.append((name, str(state), parked))
        return set_with_state(self, key, value, state)

    monkeypatch.setattr(backend_class, "_set_with_state", logged)
    _admit(task, old_run, 100)  # parks
    _admit(task, new_run, 200)  # parks in its place: old_run is superseded
    mine = [(state, parked) for name, state, parked in writes if old_run in name]
    # QUEUED while nothing was parked yet (before its own park), then the final result, written once.
    assert mine == [("QUEUED", False), ("SUCCESS", True)], writes
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


def test_a_copy_of_a_run_that_ended_without_storing_its_result_ends_the_task(app: Celery) -> None:
    from celery_mongolock.admission.contention import Outcome

    task = _task(app)
    run = f"run-{uuid.uuid4().hex}"

    def admit(redelivered: bool = False) -> Any:
        task.push_request(
            id=run, args=(KEY,), kwargs={}, headers={"mongolock_sent": 100},
            delivery_info={"redelivered": redelivered}, hostname="w1", retries=0, is_eager=False,
        )  # fmt: skip
        try:
            return admit_one(task, KEY)
        finally:
            task.pop_request()

    lease = admit()
    assert lease.key == KEY
    lease.release()  # the body ended; its worker dies before Celery stores the result
    # (Called directly, as here, a copy answers at once; in a worker it first looks again one lease later,
    # in case the result is on its way: tests/test_lost_admit_reply.py.)
    copy = admit()  # the broker delivers the message again
    assert isinstance(copy, Outcome) and copy.value["mongolock"] == "already-ran"
    # After a contention retry (the key was held, or MongoDB did not answer), the state is RETRY and the
    # copy still ends the task; after the body's own self.retry(), a newer run will store the result:
    # the copy is dropped (the lock-set checker's false already-ran on seed 13).
    app.backend.mark_as_retry(run, LockContended(KEY))
    copy = admit(redelivered=True)
    assert isinstance(copy, Outcome) and copy.value["mongolock"] == "already-ran"
    app.backend.mark_as_retry(run, ValueError("the body asked for a retry"))
    with pytest.raises(Ignore):
        admit(redelivered=True)
    # With a final state stored, a copy is simply dropped.
    app.backend.store_result(run, "done", "SUCCESS")
    with pytest.raises(Ignore):
        admit()


def test_a_handed_run_that_died_after_its_claim_runs_again(app: Celery) -> None:
    task = _task(app)
    store: LeaseStore = get_store(app)
    holder = store.acquire(KEY, ttl=30)
    assert holder is not None
    run = f"run-{uuid.uuid4().hex}"
    handed: list[dict[str, Any]] = []
    store.add_handoff_callback(lambda key, ho, doc: handed.append(ho))

    def admit(headers: dict[str, Any]) -> Any:
        task.push_request(
            id=run, args=(KEY,), kwargs={}, headers={"mongolock_sent": 100, **headers}, delivery_info={},
            hostname="w1", retries=0, is_eager=False,
        )  # fmt: skip
        try:
            return admit_one(task, KEY)
        finally:
            task.pop_request()

    with pytest.raises(Ignore):
        admit({})  # parked
    holder.release()  # handed to it
    [ho] = [h for h in handed if h["t"] == run]
    handoff = {"mongolock_handoff": {"k": KEY, "tk": ho["tk"], "id": ho["id"]}}
    claimed = admit(handoff)
    assert claimed.key == KEY
    store.forget(claimed)
    assert store.release_held_by(task_id=run) == 1  # its worker died; the parent freed the key
    # The handoff message comes back: its claim fails, it has no result, so it runs again.
    again = admit(handoff)
    assert again.key == KEY and again.fence > claimed.fence
    again.release()


def test_a_lease_answered_after_its_time_ran_out_is_given_back_and_the_body_does_not_run(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery.exceptions import Retry as RetryTask

    from celery_mongolock.clock import SystemClock

    class Late(SystemClock):
        offset = 0.0

        def monotonic(self) -> float:
            return super().monotonic() + self.offset

    ran: list[str] = []

    @singleton_task(key="{key}", app=app, name="queued_state.slow_reply", on_contention=Queue())
    def slow_reply(key: str) -> str:
        ran.append(key)
        return key

    store: LeaseStore = get_store(app)
    clock = Late()
    monkeypatch.setattr(store, "clock", clock)
    original = store.try_acquire

    def answered_late(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        clock.offset += 3600.0  # the reply came after the whole lease (MongoDB paused)
        return result

    monkeypatch.setattr(store, "try_acquire", answered_late)
    run = f"run-{uuid.uuid4().hex}"
    slow_reply.push_request(
        id=run, args=(KEY,), kwargs={}, headers={"mongolock_sent": 100}, delivery_info={},
        hostname="w1", retries=0, is_eager=False, called_directly=False,
    )  # fmt: skip
    try:
        with pytest.raises(RetryTask):
            slow_reply._guarded((KEY,), {}, direct=False)
    finally:
        slow_reply.pop_request()
    assert ran == []
    doc = store.collection.find_one({"_id": KEY}) or {}
    assert doc.get("owner") is None
    assert f"{run}/0" not in (doc.get("seen") or [])  # its retry runs: it is not remembered as over


def test_a_multi_key_run_whose_confirming_renewal_fails_gives_its_keys_back(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock-set checker's seed 8 (lc3): the renewal that confirms every key before the body starts
    failed, and the keys stayed held by no body; the run's later copy then ended ``already-ran``."""
    from celery.exceptions import Retry as RetryTask

    from celery_mongolock import StoreUnavailable

    ran: list[str] = []

    @singleton_task(keys=("a:{x}", "b:{x}"), app=app, name="queued_state.pair", on_contention=Queue())
    def pair(x: str) -> str:
        ran.append(x)
        return x

    store: LeaseStore = get_store(app)

    def unreachable(*_: Any, **__: Any) -> Any:
        raise StoreUnavailable("renew leases: no answer (the test)")

    monkeypatch.setattr(store, "renew_many", unreachable)
    run = f"run-{uuid.uuid4().hex}"
    pair.push_request(
        id=run, args=("7",), kwargs={}, headers={"mongolock_sent": 100}, delivery_info={},
        hostname="w1", retries=0, is_eager=False, called_directly=False,
    )  # fmt: skip
    try:
        with pytest.raises(RetryTask):
            pair._guarded(("7",), {}, direct=False)
    finally:
        pair.pop_request()
    assert ran == []
    for key in ("a:7", "b:7"):
        doc = store.collection.find_one({"_id": key}) or {}
        assert doc.get("owner") is None, key
        assert f"{run}/0" not in (doc.get("seen") or []), key


def test_a_stale_handoff_copy_mongodb_did_not_answer_keeps_the_body_s_retry_and_never_runs_again(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock-set checker's run-twice on a fault-gate key (seed 0 of the reentrant soak): attempt 0 of a
    Queue run is handed the key, claims it, and its lease is lost while its body runs, so it is not
    remembered as over; the body retries (state RETRY; attempt 1 still in the broker). A stale copy of
    attempt 0's handoff message then finds MongoDB not answering: its contention retry wrote RETRY
    (StoreUnavailable) over the body's, and the next copy, its claim stale and the task with "no result",
    ran attempt 0's body again. The copy writes nothing now, and the next copy is dropped."""
    from celery.app.trace import build_tracer

    from celery_mongolock.exceptions import StoreUnavailable
    from celery_mongolock.integration.runs import contention_retry_meta

    @singleton_task(key="{key}", app=app, name="queued_state.cut", on_contention=Queue(), shared=False)
    def cut(key: str) -> str:
        return key

    store: LeaseStore = get_store(app)
    holder = store.acquire(KEY, ttl=30)
    assert holder is not None
    run = f"run-{uuid.uuid4().hex}"
    handed: list[dict[str, Any]] = []
    store.add_handoff_callback(lambda key, ho, doc: handed.append(ho))

    def request(headers: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": run, "headers": {"mongolock_sent": 100, **headers}, "delivery_info": {},
            "hostname": "w1", "retries": 0, "is_eager": False, **headers,
        }  # fmt: skip

    def admit(headers: dict[str, Any]) -> Any:
        cut.push_request(args=(KEY,), kwargs={}, **request(headers))
        try:
            return admit_one(cut, KEY)
        finally:
            cut.pop_request()

    with pytest.raises(Ignore):
        admit({})  # parked
    holder.release()  # handed to it
    [ho] = [h for h in handed if h["t"] == run]
    handoff = {"mongolock_handoff": {"k": KEY, "tk": ho["tk"], "id": ho["id"]}}
    claimed = admit(handoff)
    store.forget(claimed)
    assert store.force_release(KEY)  # its lease lost while its body ran: not remembered as over
    app.backend.mark_as_retry(run, RuntimeError("the body's own retry"))  # attempt 1 still in the broker

    def not_answering(*args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("admit: no answer (the test)")

    # A stale copy of the handoff message, MongoDB not answering, through Celery's tracer (which writes a
    # retry's state).
    with monkeypatch.context() as m:
        m.setattr(store, "admit", not_answering)
        traced = build_tracer(cut.name, cut, app=app, eager=False, propagate=False)
        traced(run, (KEY,), {}, request(handoff))
    meta = app.backend.get_task_meta(run)
    assert meta["status"] == "RETRY" and not contention_retry_meta(meta["result"])
    # The next copy, MongoDB answering: its claim is stale and its attempt's body ran, so it is dropped.
    with pytest.raises(Ignore):
        admit(handoff)
    assert (store.collection.find_one({"_id": KEY}) or {}).get("owner") is None
