"""Deep queues on a ``limit=N`` key, in the lease store on the embedded server (no Celery): the key's
``Queue`` runs beyond its window are spilled (``documents.spill``) as on a key held as one lease, and a
refill hands the key's free slots to the runs it brings back (``slot_queue.slot_refill_pipeline``); a
plain acquire takes no slot while runs are spilled; a copy of a spilled run is dropped; the sweeper moves
spilled runs past their deadline to ``dead``; and nothing is run twice or lost with N runs at once."""

from __future__ import annotations

from typing import Any

import pytest

from celery_mongolock import LeaseStore

from .servers import server_past, wait_for
from .test_admission_store import KEY, Handoffs, entry
from .test_spill_store import WINDOW, lanes, spilled, window

LIMIT = 2


@pytest.fixture
def deep(make_store: Any) -> LeaseStore:
    return make_store(lease_seconds=30, parked_window=WINDOW)  # type: ignore[no-any-return]


def hold_all(store: LeaseStore) -> list[Any]:
    holders = [store.acquire(KEY, 30, limit=LIMIT) for _ in range(LIMIT)]
    assert all(holders)
    return holders


def claim(store: LeaseStore, ho: dict[str, Any]) -> Any:
    e = entry(int(ho["s"]), ho["t"])
    lease, doc = store.admit(KEY, {**e, "tk": ho["tk"]}, claim=ho["tk"], limit=LIMIT)
    assert lease is not None and doc["lo"] == "claimed", doc.get("lo")
    return lease


def drain(store: LeaseStore, handoffs: Handoffs, holders: list[Any], claimed: int = 0) -> list[str]:
    """Release the holders, then let each handed run claim its slot and release it, the oldest handed
    first; never more than ``LIMIT`` holds at once. ``claimed``: the first handoffs, claimed already
    (``holders`` holds their leases)."""
    running = list(holders)
    started = handoffs.tasks[:claimed]
    while running:
        running.pop(0).release()
        while len(started) < len(handoffs.seen):
            _, ho = handoffs.seen[len(started)]
            started.append(ho["t"])
            running.append(claim(store, ho))
            assert len(running) <= LIMIT
    return started


def test_runs_beyond_the_window_are_spilled_and_handed_the_slots_in_send_order(deep: LeaseStore) -> None:
    handoffs = Handoffs(deep)
    holders = hold_all(deep)
    for stamp in range(10, 20):
        lease, doc = deep.admit(KEY, entry(stamp), limit=LIMIT)
        assert lease is None and doc["lo"] == "parked"
    assert window(deep) == ["task-10", "task-11"]
    assert spilled(deep) == [f"task-{s}" for s in range(12, 20)]
    assert lanes(deep) == [{"r": 0, "h": 0, "t": 8}]
    assert drain(deep, handoffs, holders) == [f"task-{s}" for s in range(10, 20)]
    assert spilled(deep) == [] and window(deep) == []
    doc = deep.collection.find_one({"_id": KEY}) or {}
    assert "wq" not in doc and deep.spill.collection.count_documents({"k": KEY}) == 0


def test_an_unpark_refills_the_window(deep: LeaseStore) -> None:
    handoffs = Handoffs(deep)
    holders = hold_all(deep)
    for stamp in range(10, 16):
        deep.admit(KEY, entry(stamp), limit=LIMIT)
    deep.unpark(KEY, "task-10/0.0")
    deep.unpark(KEY, "task-11/0.0")
    assert window(deep) == ["task-12", "task-13"] and spilled(deep) == ["task-14", "task-15"]
    assert drain(deep, handoffs, holders) == [f"task-{s}" for s in range(12, 16)]


def _lose_the_window_and_the_holds(store: LeaseStore) -> None:
    """The window's runs and the key's holds gone at once, with no refill after (as after a refill that
    MongoDB did not answer, and holders whose leases lapsed)."""
    store.collection.update_one({"_id": KEY}, {"$set": {"q": [], "hs": []}})


def test_a_refill_hands_every_free_slot(deep: LeaseStore) -> None:
    handoffs = Handoffs(deep)
    hold_all(deep)
    for stamp in range(10, 16):
        deep.admit(KEY, entry(stamp), limit=LIMIT)
    _lose_the_window_and_the_holds(deep)
    assert deep.spill.refill(KEY, 0) is not None
    assert handoffs.tasks == ["task-12", "task-13"]  # both free slots, at once
    leases = [claim(deep, ho) for _, ho in handoffs.seen]
    assert drain(deep, handoffs, leases, claimed=2) == [f"task-{s}" for s in range(12, 16)]


def test_a_plain_acquire_takes_no_slot_while_runs_are_spilled(deep: LeaseStore) -> None:
    handoffs = Handoffs(deep)
    hold_all(deep)
    for stamp in range(10, 14):
        deep.admit(KEY, entry(stamp), limit=LIMIT)
    _lose_the_window_and_the_holds(deep)
    # Runs are spilled: a newcomer (a plain acquire, or a Queue run) waits its turn behind them.
    assert deep.acquire(KEY, 30, limit=LIMIT) is None
    lease, doc = deep.admit(KEY, entry(20), limit=LIMIT)
    assert lease is None and doc["lo"] == "parked"
    # It was spilled behind them: the admit's reply refilled the window, whose runs were handed both
    # free slots, and then refilled it again.
    assert handoffs.tasks == ["task-12", "task-13"]
    assert window(deep) == ["task-20"] and spilled(deep) == []


def test_a_copy_of_a_spilled_run_is_dropped_and_a_slot_holder_s_copy_too(deep: LeaseStore) -> None:
    handoffs = Handoffs(deep)
    holders = hold_all(deep)
    for stamp in range(10, 14):
        deep.admit(KEY, entry(stamp), limit=LIMIT)
    lease, doc = deep.admit(KEY, entry(13), limit=LIMIT)  # a spilled run's message delivered again
    assert lease is None and doc["lo"] == "dup"
    assert drain(deep, handoffs, holders) == ["task-10", "task-11", "task-12", "task-13"]


def test_the_sweeper_moves_spilled_runs_past_their_deadline_to_dead(deep: LeaseStore) -> None:
    holders = hold_all(deep)
    for stamp in range(10, 14):
        deep.admit(KEY, entry(stamp), limit=LIMIT, timeout=0.2)
    last = max(d["e"]["dl"] for d in deep.spill.collection.find({"k": KEY}))
    wait_for(lambda: server_past(deep, last), timeout=30, message="the deadlines to pass")
    assert deep.spill.expire(KEY, [0])
    doc = deep.collection.find_one({"_id": KEY}) or {}
    assert sorted(e["t"] for e in doc.get("dead") or []) == ["task-10", "task-11", "task-12", "task-13"]
    assert spilled(deep) == []
    for holder in holders:
        holder.release()


def test_large_messages_beyond_what_the_document_takes_are_spilled(store: LeaseStore) -> None:
    """With the default window (32), 1 MiB messages would fill the key's document after about 15: the
    runs behind are spilled (before: ``full``), and all are handed the slots in send order."""
    handoffs = Handoffs(store)
    holders = hold_all(store)
    big = b"x" * 2**20
    outcomes = [store.admit(KEY, entry(i, m=big), limit=LIMIT)[1]["lo"] for i in range(20)]
    assert outcomes == ["parked"] * 20
    assert 0 < len(window(store)) < 20 and len(window(store)) + len(spilled(store)) == 20
    assert drain(store, handoffs, holders) == [f"task-{i}" for i in range(20)]
