"""The plain admission path (``integration.plain_run``) treats a set of one key and a set of several the
same: a duplicate delivery is recognised by the slot its first delivery holds on a ``limit=N`` key, even
when that slot is not the key's newest (before one admission path served every shape, a run of one key
looked only at the newest holder, and ran its policy instead: here ``Skip`` would have dropped the
message, and with it the first delivery's, which shares the broker message)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore
from celery.signals import before_task_publish

from celery_mongolock import LeaseStore, Skip, singleton_task
from celery_mongolock.config import get_store
from celery_mongolock.integration.admit import take_keys
from celery_mongolock.integration.duplicates import DUPLICATE_HEADER


@pytest.fixture
def app(mongo_url: str, db_name: str) -> Iterator[Celery]:
    app = Celery("plain_run_shapes", broker="memory://", backend="cache+memory://")
    app.conf.update(mongolock_url=mongo_url, mongolock_database=db_name, mongolock_lease_seconds=30.0)
    yield app
    get_store(app).close()


@pytest.fixture
def published() -> Iterator[list[dict[str, Any]]]:
    """The headers of every task message published during the test."""
    seen: list[dict[str, Any]] = []

    def record(headers: dict[str, Any] | None = None, **_: Any) -> None:
        seen.append(dict(headers or {}))

    before_task_publish.connect(record, weak=False)
    yield seen
    before_task_publish.disconnect(record)


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
            take_keys(task, keys, task._options(), direct=False, limits=limits)
    finally:
        task.pop_request()
    copies = [h for h in published if h.get(DUPLICATE_HEADER)]
    assert len(copies) == 1, published
    info = store.inspect(slotted)
    assert info is not None and info.held  # the first delivery's slot and the other run's, untouched
    first.release()
    other.release()
