"""A ``Replace(cancel_running=True)`` run of several keys that ends superseded, in-process on the embedded
server (no worker): its ending (the ``run_superseded`` signal, ``Superseded``, its result) names its first
key, as its result does, and is written once, whether the body raising ``Superseded`` or the grace's
terminator gets there first."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_mongolock import LeaseStore, Replace, is_superseded, signals, singleton_task
from celery_mongolock.integration import supersede

from .servers import wait_for
from .test_cancel_running_keys_store import DEADLINE, admit, holds
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
