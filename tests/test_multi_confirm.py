"""A several-keys run starts its body only with every lease live.

The lock-set checker's seed 26 (issue 24): MongoDB paused while a ``keys=(a, b)`` Queue run took its
second key; the first lease's deadline passed (the heartbeat marked it lost), the second reply came after
its own deadline (lost from the start), and the renewal meant to confirm both before the body starts
renewed neither: ``renew_many`` leaves out leases already lost, so it reported none lost and the body
started with both leases lost (it then found them lost at its first write and retried: nothing written,
but a body that began without its keys). A lease already lost now fails the confirmation like one the
renewal finds gone: the keys are given back and taken again.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore

from celery_mongolock import LeaseStore, Queue, Retry, current_lease, singleton_task
from celery_mongolock.config import get_store
from celery_mongolock.lease import LeaseSet
from celery_mongolock.store import Lease


@pytest.fixture
def app(mongo_url: str, db_name: str) -> Iterator[Celery]:
    app = Celery("multi_confirm", broker="memory://", backend="cache+memory://")
    app.conf.update(mongolock_url=mongo_url, mongolock_database=db_name, mongolock_lease_seconds=5.0)
    yield app
    get_store(app).close()


def _first_lease_lapses_once(store: LeaseStore, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Wrap ``store.<name>`` (``admit`` or ``try_acquire``) so that, the first time a second key is
    taken, the first key's lease is marked lost, as the heartbeat marks a lease whose renewals failed
    until its deadline while the second acquire waited on a paused server."""
    original = getattr(store, name)
    taken: list[Lease] = []
    done = [False]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        lease, doc = original(*args, **kwargs)
        if lease is not None and not done[0]:
            if taken:
                taken[0].mark_lost("renewals failed until its deadline (the test)")
                done[0] = True
            taken.append(lease)
        return lease, doc

    monkeypatch.setattr(store, name, wrapped)


def _run(task: Any) -> None:
    task.push_request(
        id=f"run-{uuid.uuid4().hex}", args=("7",), kwargs={}, headers={"mongolock_sent": 100},
        delivery_info={}, hostname="w1", retries=0, is_eager=False, called_directly=False,
    )  # fmt: skip
    try:
        task._guarded(("7",), {}, direct=False)
    finally:
        task.pop_request()


@pytest.mark.parametrize(("policy", "takes"), [(Queue(), "admit"), (Retry(countdown=0.1), "try_acquire")])
def test_a_several_keys_body_never_starts_with_a_lease_already_lost(
    app: Celery, monkeypatch: pytest.MonkeyPatch, policy: Any, takes: str
) -> None:
    seen: list[list[bool]] = []

    @singleton_task(keys=("a:{x}", "b:{x}"), app=app, name=f"multi_confirm.{takes}", on_contention=policy)
    def pair(x: str) -> str:
        lease_set = current_lease()
        assert isinstance(lease_set, LeaseSet)
        seen.append([lease.lost for lease in lease_set])
        return x

    store: LeaseStore = get_store(app)
    _first_lease_lapses_once(store, monkeypatch, takes)
    try:
        _run(pair)
    except Ignore:
        # Retry: the lost lease's token is released in the background (as the heartbeat leaves it); an
        # attempt that comes first finds the key held by this very run and parks as its duplicate.
        assert takes == "try_acquire"
    # The body never ran with the lost lease: it ran with both keys live (taken again), or not yet.
    assert all(lost == [False, False] for lost in seen), seen
    if takes == "admit":  # the keys given back at once: taken again in the same run
        assert seen == [[False, False]]
        for key in ("a:7", "b:7"):
            assert (store.collection.find_one({"_id": key}) or {}).get("owner") is None, key
