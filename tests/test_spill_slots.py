"""Deep queues on a ``limit=N`` key, in the lease store on the embedded server (no Celery): the key's
``Queue`` runs beyond its window are spilled (``documents.spill``) as on a key held as one lease, and a
refill hands the key's free slots to the runs it brings back (``slot_queue.slot_refill_pipeline``); a
plain acquire takes no slot while runs are spilled; a copy of a spilled run is dropped; the sweeper moves
spilled runs past their deadline to ``dead``; and nothing is run twice or lost with N runs at once."""

from __future__ import annotations

import datetime as _dt
from typing import Any

import pytest

from celery_mongolock import LeaseStore

from .test_admission_store import KEY, Handoffs, entry
from .test_spill_store import BUDGET, WINDOW, lanes, small, spilled, window

LIMIT = 2
__all__ = ["small"]  # (a fixture of this module's tests)


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
    assert lanes(deep) == [{"r": 0, "h": 0, "t": 8, "sl": True}]
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


def _parked_then_lost(store: LeaseStore, stamps: range) -> Handoffs:
    """Runs parked behind the key's holders (the window's, then spilled); then the window's runs and the
    holds gone at once, with no refill after (as after a refill that MongoDB did not answer, and holders
    whose leases lapsed). The handoffs from then on."""
    hold_all(store)
    for stamp in stamps:
        store.admit(KEY, entry(stamp), limit=LIMIT)
    store.collection.update_one({"_id": KEY}, {"$set": {"q": [], "hs": []}})
    return Handoffs(store)


def test_a_refill_hands_every_free_slot(deep: LeaseStore) -> None:
    handoffs = _parked_then_lost(deep, range(10, 16))
    assert deep.spill.refill(KEY, 0) is not None
    assert handoffs.tasks == ["task-12", "task-13"]  # both free slots, at once
    leases = [claim(deep, ho) for _, ho in handoffs.seen]
    assert drain(deep, handoffs, leases, claimed=2) == [f"task-{s}" for s in range(12, 16)]


def test_a_plain_acquire_takes_no_slot_while_runs_are_spilled(deep: LeaseStore) -> None:
    handoffs = _parked_then_lost(deep, range(10, 14))
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
    """(Their deadlines set in the past once all are parked, not waited for: with a short timeout, a busy
    machine let the first runs time out in the window before the last were admitted, and nothing spilled:
    ci41.)"""
    holders = hold_all(deep)
    for stamp in range(10, 14):
        deep.admit(KEY, entry(stamp), limit=LIMIT, timeout=600)
    assert window(deep) == ["task-10", "task-11"] and spilled(deep) == ["task-12", "task-13"]
    past = _dt.datetime(2000, 1, 1, tzinfo=_dt.timezone.utc)
    deep.collection.update_one({"_id": KEY}, {"$set": {"q.$[].dl": past}})
    deep.spill.collection.update_many({"k": KEY}, {"$set": {"e.dl": past}})
    assert deep.spill.expire(KEY, [0])
    doc = deep.collection.find_one({"_id": KEY}) or {}
    assert sorted(e["t"] for e in doc.get("dead") or []) == ["task-10", "task-11", "task-12", "task-13"]
    assert spilled(deep) == []
    for holder in holders:
        holder.release()


def test_large_messages_beyond_what_the_document_takes_are_spilled(small: LeaseStore) -> None:
    """With the default window (32), messages of a tenth of what the document takes would fill it after
    about 10: the runs behind are spilled (before: ``full``), and all are handed the slots in send
    order."""
    handoffs = Handoffs(small)
    holders = hold_all(small)
    big = b"x" * (BUDGET // 10)
    outcomes = [small.admit(KEY, entry(i, m=big), limit=LIMIT)[1]["lo"] for i in range(20)]
    assert outcomes == ["parked"] * 20
    assert 0 < len(window(small)) < 20 and len(window(small)) + len(spilled(small)) == 20
    assert drain(small, handoffs, holders) == [f"task-{i}" for i in range(20)]


def _holds_lapse(store: LeaseStore) -> None:
    """Every hold of the key past its end on the server's clock (what the server sees when their holders
    stopped renewing): set in the past, not waited for, so that no admit before it races the lapse."""
    past = _dt.datetime(2000, 1, 1, tzinfo=_dt.timezone.utc)
    store.collection.update_one({"_id": KEY}, {"$set": {"hs.$[].x": past}})


def test_slots_freed_at_once_go_to_spilled_runs_before_a_lower_priority_run(deep: LeaseStore) -> None:
    """Three slots freed by one sweep (their holds lapsed): the window holds two runs of rank 0 and one of
    rank 1, with more rank-0 runs spilled. The rank-1 run waits for them (before: it was handed the third
    slot, ahead of the spilled rank-0 runs that ``inspect`` lists before it)."""
    handoffs = Handoffs(deep)
    assert all(deep.acquire(KEY, 60, limit=3) for _ in range(3))
    for stamp in range(10, 15):
        deep.admit(KEY, entry(stamp), limit=3)
    deep.admit(KEY, entry(5, "low-5", pr=1), limit=3)
    assert window(deep) == ["task-10", "task-11", "low-5"]
    info = deep.inspect(KEY)
    assert info is not None and [p["task_id"] for p in info.parked][-1] == "low-5"
    _holds_lapse(deep)
    deep.sweep(KEY, slots=True)
    assert handoffs.tasks == ["task-10", "task-11", "task-12"]  # the refill brought task-12 for the third


def test_the_sweeper_refills_a_limit_key_whose_refill_failed(
    deep: LeaseStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refills after the releases failed (MongoDB did not answer): the slots are free, the window is
    empty, runs are spilled. The key needs a sweep (before: nothing did, and the spilled runs waited for
    the next admit), and the sweep's reply refills it and hands the slots."""
    from celery_mongolock import StoreUnavailable

    handoffs = Handoffs(deep)
    holders = hold_all(deep)
    for stamp in range(10, 16):
        deep.admit(KEY, entry(stamp), limit=LIMIT)

    def no_answer(*args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("MongoDB did not answer")

    real = deep.spill.refill
    monkeypatch.setattr(deep.spill, "refill", no_answer)
    for holder in holders:
        holder.release()
    for lease in [claim(deep, ho) for _, ho in handoffs.seen]:
        lease.release()
    monkeypatch.setattr(deep.spill, "refill", real)
    assert window(deep) == [] and len(spilled(deep)) == 4
    (one,) = [w for w in deep.waiting() if w.key == KEY]
    assert one.needs_sweep
    deep.sweep(KEY, slots=True)
    assert handoffs.tasks == [f"task-{s}" for s in range(10, 14)]


def test_a_key_once_taken_with_a_limit_hands_its_spilled_runs_the_key_as_one_lease(
    deep: LeaseStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key taken with ``limit=2`` once and held as one lease since (its document keeps ``lim``): a refill
    of its spilled runs hands the key as one lease (before: it handed two slots, whose claims were
    ``stale``)."""
    once = deep.acquire(KEY, 30, limit=2)
    assert once is not None and once.release()
    handoffs = Handoffs(deep)
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    for stamp in range(10, 15):
        deep.admit(KEY, entry(stamp))
    deep.collection.update_one({"_id": KEY}, {"$set": {"q": []}})  # the window emptied, no refill yet
    holder.release()  # (its reply: the window is empty, so a refill, which hands the vacant key)
    assert handoffs.tasks == ["task-12"]
    doc = deep.collection.find_one({"_id": KEY}) or {}
    assert (doc.get("ho") or {}).get("t") == "task-12" and not doc.get("hs")
    e = entry(12, "task-12")
    lease, reply = deep.admit(KEY, {**e, "tk": doc["ho"]["tk"]}, claim=doc["ho"]["tk"])
    assert lease is not None and reply["lo"] == "claimed"
    lease.release()


def test_a_spilled_run_the_document_cannot_take_yet_holds_no_slot_back(small: LeaseStore) -> None:
    """Lower-priority runs with large messages fill the window; a run of a higher priority whose message
    the document cannot take beside them is spilled. Freed slots go to the window's runs (before the
    spilled run could come in, none would: nothing would ever make room), and the spilled run, once
    there is room for it, is handed the next slot."""
    handoffs = Handoffs(small)
    holders = hold_all(small)
    big = b"x" * (BUDGET // 6)
    for stamp in range(10, 15):
        assert small.admit(KEY, entry(stamp, pr=1, m=big), limit=LIMIT)[1]["lo"] == "parked"
    assert window(small) == [f"task-{s}" for s in range(10, 15)]
    assert small.admit(KEY, entry(5, "urgent", m=b"y" * (BUDGET // 2)), limit=LIMIT)[1]["lo"] == "parked"
    assert spilled(small) == ["urgent"]
    order = drain(small, handoffs, holders)
    assert sorted(order) == sorted(["urgent"] + [f"task-{s}" for s in range(10, 15)])
    assert order.index("urgent") < order.index("task-14"), order  # it went first once it fit


def test_spilled_runs_of_two_priorities_the_document_cannot_take_hold_no_slot_back(small: LeaseStore) -> None:
    """As above, with spilled runs of two priorities above the window's: each lane whose next run does not
    fit is marked, so the window's runs are handed the freed slots (before: only the first lane was tried,
    the second held every slot back, and nothing was ever handed)."""
    handoffs = Handoffs(small)
    holders = hold_all(small)
    big = b"x" * (BUDGET // 6)
    for stamp in range(10, 15):
        assert small.admit(KEY, entry(stamp, pr=5, m=big), limit=LIMIT)[1]["lo"] == "parked"
    assert small.admit(KEY, entry(5, "urgent", m=b"y" * (BUDGET // 2)), limit=LIMIT)[1]["lo"] == "parked"
    assert small.admit(KEY, entry(6, "mid", pr=3, m=b"z" * (BUDGET // 4)), limit=LIMIT)[1]["lo"] == "parked"
    assert spilled(small) == ["urgent", "mid"]
    order = drain(small, handoffs, holders)
    assert sorted(order) == sorted(["urgent", "mid"] + [f"task-{s}" for s in range(10, 15)])


def test_a_refill_s_command_stays_within_mongodb_s_stage_limit(mongo_url: str, db_name: str) -> None:
    """With the largest window (1,000) empty and 300 runs spilled, one refill brings at most 256 of them:
    its command has a stage per run, and MongoDB refuses a pipeline of more than 1,000 stages (the
    embedded server does not: counted here)."""
    from pymongo import MongoClient, monitoring

    from celery_mongolock.core.documents.lanes import spill_id

    stages: list[int] = []

    class Stages(monitoring.CommandListener):
        def started(self, event: monitoring.CommandStartedEvent) -> None:
            if event.command_name == "findAndModify" and isinstance(event.command.get("update"), list):
                stages.append(len(event.command["update"]))

        def succeeded(self, event: Any) -> None: ...
        def failed(self, event: Any) -> None: ...

    client: MongoClient[dict[str, Any]] = MongoClient(mongo_url, event_listeners=[Stages()])
    # One refill of 256 runs takes the embedded server about 4 s on an idle machine (a stage per run) and
    # over 10 s on a busy one: this test counts stages, so its deadline is not the 10 s default.
    store = LeaseStore(client, database=db_name, lease_seconds=300, parked_window=1000, operation_timeout=600)
    try:
        holder = store.acquire(KEY, 300)
        assert holder is not None
        # 300 runs spilled, as parking them behind a full window leaves them (then the window emptied).
        store.spill.collection.insert_many(
            [
                {"_id": spill_id(KEY, 0, 1, n), "k": KEY, "rid": f"task-{n}", "r": 0, "ep": 1, "n": n,
                 "e": entry(100 + n)}
                for n in range(300)
            ]
        )  # fmt: skip
        lanes = [{"r": 0, "e": 1, "h": 0, "t": 300}]
        store.collection.update_one({"_id": KEY}, {"$set": {"sp": lanes, "q": [], "wq": True, "gc_at": None}})
        stages.clear()
        assert store.spill.refill(KEY, 0) is not None
        assert stages and max(stages) <= 300, stages
        assert len(window(store)) == 256 and len(spilled(store)) == 44
        holder.release()
    finally:
        store.close()
        client.close()
