"""Deep queues in the lease store, on the embedded server (no Celery): a key's ``Queue`` runs beyond its
window of parked runs are spilled to ``<collection>.parked`` (``documents.spill``) and handed the key in
the same order as runs parked in the document; a copy of a spilled run is dropped; a number whose run
was never stored (its worker stopped) is skipped, and a late insert under it is admitted again; the
user's ``max_length`` counts spilled runs; the sweeper refills a window left empty."""

from __future__ import annotations

from typing import Any

import pytest
from pymongo import MongoClient

from celery_mongolock import ConfigurationError, LeaseStore
from celery_mongolock.core.documents import lanes as spill_docs

from .test_admission_store import KEY, Handoffs, entry

WINDOW = 2


@pytest.fixture
def deep(make_store: Any) -> LeaseStore:
    return make_store(lease_seconds=30, parked_window=WINDOW)  # type: ignore[no-any-return]


def window(store: LeaseStore, key: str = KEY) -> list[str]:
    doc = store.collection.find_one({"_id": key}) or {}
    return [e["t"] for e in doc.get("q") or []]


def spilled(store: LeaseStore, key: str = KEY) -> list[str]:
    docs = store.spill.collection.find({"k": key, "x": {"$ne": True}})
    return [d["e"]["t"] for d in sorted(docs, key=lambda d: d["_id"])]


def lanes(store: LeaseStore, key: str = KEY) -> list[dict[str, int]]:
    doc = store.collection.find_one({"_id": key}) or {}
    return [dict(lane) for lane in doc.get("sp") or []]


def run_all(store: LeaseStore, handoffs: Handoffs, holder: Any) -> list[str]:
    """Release the holder, then let each handed run claim the key and release it in turn."""
    order: list[str] = []
    assert holder.release()
    while len(order) < len(handoffs.seen):
        _, ho = handoffs.seen[len(order)]
        order.append(ho["t"])
        e = entry(int(ho["s"]), ho["t"])
        lease, doc = store.admit(KEY, {**e, "tk": ho["tk"]}, claim=ho["tk"])
        assert lease is not None and doc["lo"] == "claimed", doc.get("lo")
        assert lease.release()
    return order


def test_runs_beyond_the_window_are_spilled_and_handed_the_key_in_send_order(deep: LeaseStore) -> None:
    handoffs = Handoffs(deep)
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    for stamp in range(10, 20):
        lease, doc = deep.admit(KEY, entry(stamp))
        assert lease is None and doc["lo"] == "parked"
        assert doc["_position"] if stamp >= 10 + WINDOW else True
    assert window(deep) == ["task-10", "task-11"]
    assert spilled(deep) == [f"task-{s}" for s in range(12, 20)]
    assert lanes(deep) == [{"r": 0, "h": 0, "t": 8}]
    order = run_all(deep, handoffs, holder)
    assert order == [f"task-{s}" for s in range(10, 20)]
    assert spilled(deep) == [] and window(deep) == []
    assert deep.spill.collection.count_documents({"k": KEY}) == 0
    doc = deep.collection.find_one({"_id": KEY}) or {}
    assert "wq" not in doc  # nothing waits any more


def test_a_spilled_run_s_position_counts_every_run_ahead(deep: LeaseStore) -> None:
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    positions = [deep.admit(KEY, entry(stamp))[1].get("_position") for stamp in range(10, 15)]
    assert positions[WINDOW:] == [3, 4, 5]
    holder.release()


def test_a_copy_of_a_spilled_run_is_dropped(deep: LeaseStore) -> None:
    handoffs = Handoffs(deep)
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    for stamp in range(10, 14):
        deep.admit(KEY, entry(stamp))
    lease, doc = deep.admit(KEY, entry(13))  # the last one's message delivered again
    assert lease is None and doc["lo"] == "dup"
    lease, doc = deep.admit(KEY, entry(10))  # a copy of a run in the window: as before
    assert lease is None and doc["lo"] == "dup"
    assert run_all(deep, handoffs, holder) == ["task-10", "task-11", "task-12", "task-13"]


def test_a_number_never_stored_is_skipped_and_a_late_insert_under_it_admits_again(deep: LeaseStore) -> None:
    handoffs = Handoffs(deep)
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    for stamp in range(10, 13):
        deep.admit(KEY, entry(stamp))
    # A worker that stops between its admit and its insert: the admit took number 1, nothing stored.
    doc = deep.collection.find_one_and_update(
        {"_id": KEY}, [{"$set": {"sp": [{"r": 0, "h": 0, "t": 2}]}}], return_document=True
    )
    assert doc is not None
    for stamp in (13, 14):
        deep.admit(KEY, entry(stamp))
    order = run_all(deep, handoffs, holder)
    assert order == ["task-10", "task-11", "task-12", "task-13", "task-14"]
    # The tombstone the refill left under the hole was deleted with what it read.
    assert deep.spill.collection.count_documents({"k": KEY}) == 0
    # The late worker's insert under its number finds it given up: it is told to admit again.
    answer = {"r": 0, "n": 1, "at": None}
    deep.spill.collection.insert_one(spill_docs.tombstone(KEY, spill_docs.spill_id(KEY, 0, 1)))
    assert deep.spill.store_entry(KEY, entry(99), answer, None) == "again"


def test_max_length_counts_the_spilled_runs(deep: LeaseStore) -> None:
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    outcomes = [deep.admit(KEY, entry(stamp), max_length=5)[1]["lo"] for stamp in range(10, 17)]
    assert outcomes == ["parked"] * 5 + ["full"] * 2
    holder.release()


def test_a_newcomer_never_passes_spilled_runs_on_a_free_key(deep: LeaseStore) -> None:
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    for stamp in range(10, 15):
        deep.admit(KEY, entry(stamp))
    # The window emptied and not refilled (a worker stopped before its refill): the key is free.
    deep.collection.update_one({"_id": KEY}, {"$set": {"q": []}, "$unset": {"owner": 1}})
    lease, doc = deep.admit(KEY, entry(50))
    assert lease is None and doc["lo"] == "parked"  # behind the spilled runs, which the refill brings in
    doc = deep.collection.find_one({"_id": KEY}) or {}
    assert doc["ho"]["t"] == "task-12"  # the oldest spilled run was handed the key
    assert window(deep) == ["task-13", "task-14"]


def test_the_sweeper_refills_a_window_left_empty(deep: LeaseStore) -> None:
    handoffs = Handoffs(deep)
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    for stamp in range(10, 15):
        deep.admit(KEY, entry(stamp))
    holder.release()
    handed = handoffs.tasks[-1]
    deep.collection.update_one({"_id": KEY}, [{"$set": {"q": []}}])  # as if the refill never came
    doc = deep.collection.find_one({"_id": KEY}) or {}
    assert doc.get("wq") is True  # still on the sweeper's list: runs are spilled
    assert handed == "task-10"
    deep.force_release(KEY)  # (the handed run never claims)
    deep.sweep(KEY)
    assert window(deep)[:1] == ["task-13"] or handoffs.tasks[-1] == "task-12"


def test_the_window_is_checked() -> None:
    with pytest.raises(ConfigurationError, match="parked_window"):
        LeaseStore(MongoClient(connect=False), parked_window=0)


def test_runs_with_large_messages_are_spilled_not_refused_and_run_in_send_order(store: LeaseStore) -> None:
    # 1 MiB messages: the document takes about 14 (16 MiB); the others are spilled, whatever the window,
    # and come into the document as it empties.
    handoffs = Handoffs(store)
    holder = store.acquire(KEY, 60)
    assert holder is not None
    big = b"x" * 2**20
    outcomes = [store.admit(KEY, entry(i, m=big))[1]["lo"] for i in range(18)]
    assert outcomes == ["parked"] * 18
    assert 10 <= len(window(store)) < 16 and len(spilled(store)) == 18 - len(window(store))
    assert run_all(store, handoffs, holder) == [f"task-{i}" for i in range(18)]
