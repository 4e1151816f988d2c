"""A ``Replace(cancel_running=True)`` run of several keys that ends superseded, in-process on the embedded
server (no worker): its ending (the ``run_superseded`` signal, ``Superseded``, its result) names its first
key, as its result does, and is written once, whether the body raising ``Superseded`` or the grace's
terminator gets there first."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from celery_mongolock import (
    FencedOut,
    LeaseStore,
    Replace,
    Superseded,
    fenced_update_one,
    is_superseded,
    signals,
    singleton_task,
)
from celery_mongolock.integration import supersede

from .servers import wait_for
from .test_admission_store import entry
from .test_cancel_running_keys_store import DEADLINE, admit, holds
from .test_cancel_running_store import KEY, held
from .test_replace_keys_store import X, Y, run

POLICY = Replace(cancel_running=True, grace=3600.0)


@pytest.fixture
def task() -> Iterator[Any]:
    app = Celery("supersede_ending", broker="memory://", backend="cache+memory://", set_as_current=False)

    @singleton_task(keys=("{a}", "{b}"), app=app, on_contention=POLICY, name="merge")
    def merge(a: str, b: str) -> None:  # pragma: no cover - its body is the test's
        """Unused: the test runs its own body under the task's request."""

    merge.push_request(id="r10", retries=0)
    yield merge
    merge.pop_request()


def superseded_holder(store: LeaseStore) -> Any:
    holder = holds(store, run(10, [X, Y]))
    holder.supersede_together()
    admit(store, X, run(20, [X, Y]))  # a newer send of the set parks behind it: the holder is told
    assert holder.wait_superseded(DEADLINE)
    return holder


def records(store: LeaseStore, key: str) -> list[Any]:
    store.flush_history(timeout=DEADLINE)
    return [e for e in store.history(key, limit=50) if e.how == "superseded" and e.task_id == "r10"]


def once_on_each_key(store: LeaseStore) -> None:
    for key in (X, Y):
        wait_for(functools.partial(records, store, key), timeout=DEADLINE, message=f"the record on {key}")
        assert len(records(store, key)) == 1


def test_a_set_that_raises_superseded_ends_once_naming_its_first_key(store: LeaseStore, task: Any) -> None:
    holder = superseded_holder(store)
    sent: list[str] = []

    def note(key: str = "", **_: Any) -> None:
        sent.append(key)

    signals.run_superseded.connect(note, weak=False)
    try:
        result = supersede.run_body(task, store, holder, POLICY, holder.raise_if_superseded)
    finally:
        signals.run_superseded.disconnect(note)
    assert is_superseded(result) and result["by"] == "r20"
    assert sent == [sorted([X, Y])[0]]  # its first key, not the joined "A+B"
    once_on_each_key(store)


def test_the_grace_and_the_body_racing_write_the_ending_once(store: LeaseStore, task: Any) -> None:
    holder = superseded_holder(store)
    terminator = supersede._Terminator(task, store, holder.keys[0], holder, 0.0)
    terminator.done.set()  # (the body ended: it writes the ending, then does not kill this process)
    terminator.terminate("r20")
    assert not terminator.claim_ending()  # the body's own Superseded, second, writes nothing
    assert is_superseded(task.app.backend.get_task_meta("r10")["result"])
    once_on_each_key(store)


# -- a body stopped by a fenced write its supersession refused ----------------------------------------------


@pytest.fixture
def upload() -> Iterator[Any]:
    app = Celery("supersede_fenced", broker="memory://", backend="cache+memory://", set_as_current=False)

    @singleton_task(key="report:{n}", app=app, on_contention=POLICY, name="upload")
    def upload(n: int) -> None:  # pragma: no cover - its body is the test's
        """Unused: the test runs its own body under the task's request."""

    upload.push_request(id="task-10", retries=0)
    yield upload
    upload.pop_request()


def superseded_one_key_holder(store: LeaseStore) -> Any:
    holder = held(store, 10)
    store.admit(KEY, entry(20), replace=True, cancel=True)  # a newer send parks behind it: it is told
    assert holder.wait_superseded(DEADLINE)
    return holder


def fenced_write(store: LeaseStore, lease: Any) -> Callable[[], None]:
    """The body of the how-to's upload: its first act is a fenced write with its lease."""

    def body() -> None:
        groups = store.collection.database["groups"]
        fenced_update_one(groups, {"_id": 7}, {"$set": {"state": "uploading"}}, lease, upsert=True)

    return body


def test_a_fenced_write_refused_for_its_supersession_ends_the_run_superseded(
    store: LeaseStore, upload: Any
) -> None:
    holder = superseded_one_key_holder(store)
    sent: list[str] = []

    def note(key: str = "", **_: Any) -> None:
        sent.append(key)

    signals.run_superseded.connect(note, weak=False)
    try:
        result = supersede.run_body(upload, store, holder, POLICY, fenced_write(store, holder))
    finally:
        signals.run_superseded.disconnect(note)
    assert is_superseded(result) and result["by"] == "task-20" and result["key"] == KEY
    assert sent == [KEY]
    assert holder.ended_superseded_by == "task-20"  # (its release says so)
    store.flush_history(timeout=DEADLINE)
    assert [
        e.by for e in store.history(KEY, limit=50) if e.how == "superseded" and e.task_id == "task-10"
    ] == ["task-20"]


def test_with_fail_superseded_it_fails_with_superseded(store: LeaseStore, upload: Any) -> None:
    holder = superseded_one_key_holder(store)
    policy = Replace(cancel_running=True, grace=3600.0, fail_superseded=True)
    with pytest.raises(Superseded) as raised:
        supersede.run_body(upload, store, holder, policy, fenced_write(store, holder))
    assert raised.value.key == KEY and raised.value.by == "task-20" and raised.value.fence == holder.fence
    assert isinstance(raised.value.__cause__, FencedOut)


@pytest.mark.parametrize("which", ["one of its leases", "the set"])
def test_a_set_s_fenced_write_refused_for_its_supersession_ends_it_superseded(
    store: LeaseStore, task: Any, which: str
) -> None:
    holder = superseded_holder(store)
    lease = holder[Y] if which == "one of its leases" else holder
    wait_for(lambda: holder[Y].superseded, timeout=DEADLINE, message="the set to be told")
    result = supersede.run_body(task, store, holder, POLICY, fenced_write(store, lease))
    assert is_superseded(result) and result["by"] == "r20"
    once_on_each_key(store)


def test_a_fenced_out_that_is_not_its_supersession_fails_the_run(store: LeaseStore, upload: Any) -> None:
    holder = superseded_one_key_holder(store)
    other = FencedOut(KEY, holder.fence - 1, superseded_by="task-20")  # another holder's lease

    def raises(exc: Exception) -> Callable[[], None]:
        def body() -> None:
            raise exc

        return body

    for exc in (FencedOut(KEY, holder.fence, holder.fence + 1), other):  # a newer fence; another lease
        with pytest.raises(FencedOut) as raised:
            supersede.run_body(upload, store, holder, POLICY, raises(exc))
        assert raised.value is exc
    assert holder.ended_superseded_by is None
