"""The plain admission path (``integration.plain_run``) treats a set of one key and a set of several the
same: a duplicate delivery is recognised by the slot its first delivery holds on a ``limit=N`` key, even
when that slot is not the key's newest (before one admission path served every shape, a run of one key
looked only at the newest holder, and ran its policy instead: here ``Skip`` would have dropped the
message, and with it the first delivery's, which shares the broker message)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore, Retry

from celery_mongolock import LeaseStore, Replace, Skip, StoreUnavailable, singleton_task
from celery_mongolock.config import get_store
from celery_mongolock.integration.admit import take_keys
from celery_mongolock.integration.duplicates import DUPLICATE_HEADER


@pytest.fixture
def app(worker_app: Celery) -> Celery:
    return worker_app


@pytest.mark.parametrize("several", [False, True], ids=["one-key", "keys"])
def test_a_duplicate_delivery_is_known_by_its_own_slot_not_only_the_newest(
    app: Celery, published: list[dict[str, Any]], several: bool
) -> None:
    name = f"plain_run_shapes.job{several}"
    if several:

        def pair(self: Any, a: str, b: str) -> str:
            return "ran"

        task = singleton_task(
            keys=("{a}", "{b}"), limit={"{a}": 2}, app=app, name=name, bind=True, on_contention=Skip(),
            shared=False,
        )(pair)  # fmt: skip
    else:

        def one(self: Any, a: str) -> str:
            return "ran"

        task = singleton_task(
            key="{a}", limit=2, app=app, name=name, bind=True, on_contention=Skip(), shared=False
        )(one)
    store: LeaseStore = get_store(app)
    slotted = f"slots-{uuid.uuid4().hex[:8]}"
    run = f"run-{uuid.uuid4().hex}"
    # The first delivery of ``run`` holds a slot; another run took the other slot after it (the newest).
    first = store.acquire(slotted, limit=2, info={"task_id": run, "delivery": "0.0"})
    other = store.acquire(slotted, limit=2, info={"task_id": "another-run", "delivery": "0.0"})
    assert first is not None and other is not None
    keys = [slotted, f"z-{slotted}"] if several else [slotted]
    args = tuple(keys)
    task.push_request(
        id=run, args=args, kwargs={}, headers={}, delivery_info={"redelivered": True}, hostname="w1",
        retries=0, is_eager=False, called_directly=False,
    )  # fmt: skip
    try:
        limits = {slotted: 2} if several else None
        with pytest.raises(Ignore):  # kept aside as a duplicate, not skipped
            take_keys(task, keys, task._options(), direct=False, limits=limits, one=not several)
    finally:
        task.pop_request()
    copies = [h for h in published if h.get(DUPLICATE_HEADER)]
    assert len(copies) == 1, published
    info = store.inspect(slotted)
    assert info is not None and info.held  # the first delivery's slot and the other run's, untouched
    first.release()
    other.release()


def test_a_copy_whose_read_of_its_run_gets_no_answer_is_retried_not_failed(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A redelivered message finds its key held; the read that asks whether its run ended gets no answer
    from MongoDB: the run is published again later (the policy's ``on_unavailable``), never failed with the
    store's error (which would be stored under the task id of its first delivery, maybe over its result)."""

    def one(self: Any, a: str) -> str:
        return "ran"

    name = "plain_run_shapes.copy"
    task = singleton_task(key="{a}", app=app, name=name, bind=True, on_contention=Skip())(one)
    store: LeaseStore = get_store(app)
    key = f"held-{uuid.uuid4().hex[:8]}"
    holder = store.acquire(key, info={"task_id": "another-run", "delivery": "0.0"})
    assert holder is not None
    reads = {"n": 0}
    answered = store.run_ended

    def run_ended(*args: Any, **kwargs: Any) -> Any:
        reads["n"] += 1
        if reads["n"] > 1:  # the first read (before the acquire) is answered, the second is not
            raise StoreUnavailable("MongoDB did not answer (test)")
        return answered(*args, **kwargs)

    monkeypatch.setattr(store, "run_ended", run_ended)
    task.push_request(
        id=f"run-{uuid.uuid4().hex}", args=(key,), kwargs={}, headers={}, delivery_info={"redelivered": True},
        hostname="w1", retries=0, is_eager=False, called_directly=False,
    )  # fmt: skip
    try:
        with pytest.raises(Retry):  # a contention retry (published again later), not StoreUnavailable
            take_keys(task, [key], task._options(), direct=False, limits={key: None}, one=True)
    finally:
        task.pop_request()
    assert reads["n"] == 2
    holder.release()


def test_a_set_of_keys_that_renders_to_one_key_stays_a_set(app: Celery) -> None:
    """``keys=("acct:{a}", "acct:{b}")`` with ``a == b`` needs one key: the run is still a run of its set
    (its parked entry carries its keys and, under ``Replace``, its set's signature), so a newer send of
    another set sharing that key does not supersede it, nor it them."""

    def transfer(self: Any, a: int, b: int) -> str:
        return "ran"

    task = singleton_task(
        keys=("acct:{a}", "acct:{b}"), app=app, name="plain_run_shapes.transfer", bind=True,
        on_contention=Replace(), shared=False,
    )(transfer)  # fmt: skip
    store: LeaseStore = get_store(app)
    n = uuid.uuid4().int % 10**8
    key = f"acct:{n}"
    holder = store.acquire(key)
    assert holder is not None
    run = f"run-{uuid.uuid4().hex}"
    task.push_request(
        id=run, args=(n, n), kwargs={}, headers={"mongolock_sent": 100}, delivery_info={}, hostname="w1",
        retries=0, is_eager=False, called_directly=False,
    )  # fmt: skip
    try:
        keys = task.mongolock_keys_for(n, n)
        assert keys == [key]
        with pytest.raises(Ignore):  # parked
            take_keys(task, keys, task._options(), direct=False, limits={key: None}, one=False)
    finally:
        task.pop_request()
    doc = store.collection.find_one({"_id": key}) or {}
    parked = [e for e in doc.get("q") or [] if e.get("t") == run]
    assert len(parked) == 1, doc
    assert parked[0].get("ks") == [key] and parked[0].get("g"), parked[0]
    holder.release()


def test_a_tick_whose_acquire_was_answered_too_late_gives_its_tick_back(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A beat tick's run of one key whose acquire was answered after its lease's whole time fails closed:
    its key is given back with its tick, so that its retry runs the tick (before: refused as "tick N
    already ran", and the tick never ran)."""
    from celery_mongolock.core.lease import Lease
    from celery_mongolock.integration.guarded import guarded
    from celery_mongolock.integration.headers import BEAT_HEADER

    def one(self: Any, a: str) -> str:
        return "ran"

    name = "plain_run_shapes.tick"
    task = singleton_task(key="{a}", app=app, name=name, bind=True, on_contention=Skip())(one)
    store: LeaseStore = get_store(app)
    key = f"tick-{uuid.uuid4().hex[:8]}"
    tick = 1_800_000_000_000
    answered = store.try_acquire

    def late(*args: Any, **kwargs: Any) -> Any:
        lease, doc = answered(*args, **kwargs)
        # Answered after its lease's whole time: from here on this process sees no time left on it.
        monkeypatch.setattr(Lease, "remaining", property(lambda self: 0.0))
        return lease, doc

    monkeypatch.setattr(store, "try_acquire", late)
    task.push_request(
        id=f"run-{uuid.uuid4().hex}", args=(key,), kwargs={}, hostname="w1", retries=0, is_eager=False,
        headers={BEAT_HEADER: {"tick": tick, "window": 60, "entry": "e"}}, delivery_info={},
        called_directly=False,
    )  # fmt: skip
    try:
        with pytest.raises(Retry):  # failed closed: retried later, its body not run
            guarded(task, [key], {key: None}, task._options(), lambda: "ran", direct=False, one=True)
    finally:
        task.pop_request()
        monkeypatch.undo()
    doc = store.collection.find_one({"_id": key}) or {}
    assert doc.get("last_tick") == tick - 1, doc  # its tick given back with the key
    assert doc.get("owner") is None, doc  # given back
