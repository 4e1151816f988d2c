"""Deep queues in the lease store, on the embedded server (no Celery): a key's ``Queue`` runs beyond its
window of parked runs are spilled to ``<collection>.parked`` (``documents.spill``) and handed the key in
the same order as runs parked in the document; a copy of a spilled run is dropped; a number whose run
was never stored (its worker stopped) is skipped, and a late insert under it is admitted again; the
user's ``max_length`` counts spilled runs; the sweeper refills a window left empty."""

from __future__ import annotations

import datetime as _dt
from typing import Any

import pytest
from pymongo import MongoClient
from pymongo.collection import Collection
from pymongo.errors import AutoReconnect

from celery_mongolock import ConfigurationError, LeaseStore, MessageTooLarge
from celery_mongolock.core.documents import lanes as spill_docs
from celery_mongolock.core.outcomes import Admission

from .servers import server_past, wait_for
from .test_admission_store import KEY, Handoffs, entry

WINDOW = 2


@pytest.fixture
def deep(make_store: Any) -> LeaseStore:
    return make_store(lease_seconds=30, parked_window=WINDOW)  # type: ignore[no-any-return]


#: The lease document's budget for parked runs in the tests of messages it cannot take (MongoDB's is
#: about 16 MiB): the embedded server fails under load with documents near 16 MiB (CI: "internal server
#: error", and the server stayed so), so these tests use small messages and a small budget.
BUDGET = 2**20


@pytest.fixture
def small(make_store: Any, monkeypatch: pytest.MonkeyPatch) -> LeaseStore:
    """A store with the default window (32), long leases (the tests hold them without renewing), and a
    lease document that takes ``BUDGET`` bytes of parked runs."""
    from celery_mongolock.core.documents import entries, spill

    monkeypatch.setattr(entries, "PARK_BUDGET", BUDGET)
    monkeypatch.setattr(spill, "PARK_BUDGET", BUDGET)
    return make_store(lease_seconds=120)  # type: ignore[no-any-return]


def window(store: LeaseStore, key: str = KEY) -> list[str]:
    doc = store.collection.find_one({"_id": key}) or {}
    return [e["t"] for e in doc.get("q") or []]


def spilled(store: LeaseStore, key: str = KEY) -> list[str]:
    docs = store.spill.collection.find({"k": key, "x": {"$ne": True}})
    return [d["e"]["t"] for d in sorted(docs, key=lambda d: d["_id"])]


def lanes(store: LeaseStore, key: str = KEY) -> list[dict[str, int]]:
    """The key's lanes, without their epochs."""
    doc = store.collection.find_one({"_id": key}) or {}
    return [{k: v for k, v in lane.items() if k != "e"} for lane in doc.get("sp") or []]


def lane_id(store: LeaseStore, number: int, key: str = KEY) -> str:
    (lane,) = (store.collection.find_one({"_id": key}) or {})["sp"]
    return spill_docs.spill_id(key, lane["r"], lane["e"], number)


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
    assert deep.spill.collection.count_documents({"k": KEY}) == 0  # no hole: no tombstone
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
    deep.collection.update_one({"_id": KEY}, {"$inc": {"sp.0.t": 1}})
    assert lanes(deep) == [{"r": 0, "h": 0, "t": 2}]
    for stamp in (13, 14):
        deep.admit(KEY, entry(stamp))
    order = run_all(deep, handoffs, holder)
    assert order == ["task-10", "task-11", "task-12", "task-13", "task-14"]
    # The refill left a tombstone under the hole, and keeps it: the late worker's insert under its number
    # finds it taken, and is told to admit its run again (never stored behind the lane's head).
    assert [d["_id"] for d in deep.spill.collection.find({"k": KEY})] == [lane_id(deep, 1)]
    doc = deep.collection.find_one({"_id": KEY}) or {}
    answer = {"r": 0, "e": doc["sp"][0]["e"], "n": 1, "at": None}
    assert deep.spill.store_entry(KEY, entry(99), answer, None) == "again"


def test_a_run_stored_after_a_refill_passed_its_number_is_admitted_again_not_lost(make_store: Any) -> None:
    slow = make_store(lease_seconds=30, parked_window=WINDOW)  # the worker that spills a run, slowly
    other = make_store(lease_seconds=30, parked_window=WINDOW)  # another worker, releasing
    handoffs = Handoffs(other)
    holder = other.acquire(KEY, 30)
    assert holder is not None
    for stamp in (10, 11):
        assert slow.admit(KEY, entry(stamp))[1]["lo"] == "parked"
    real = slow.spill.store_entry
    calls: list[int] = []

    def late(key: str, e: Any, answer: Any, timeout_ms: Any) -> str:
        # Between the admit that took number 0 and its insert, the other worker releases: its refill
        # finds number 0 missing, gives it up (a tombstone) and moves the head past it.
        if not calls:
            assert holder.release()
            assert lanes(other) == [{"r": 0, "h": 1, "t": 1}]
        calls.append(int(answer["n"]))
        return str(real(key, e, answer, timeout_ms))

    slow.spill.store_entry = late
    lease, doc = slow.admit(KEY, entry(12))
    assert lease is None and doc["lo"] == "parked"
    assert calls == [0] and "task-12" in window(other)  # admitted again: the window had room
    handed = [ho["t"] for _, ho in handoffs.seen]
    order = handed[:1] + run_all_from(other, handoffs, 1)
    assert sorted(order) == ["task-10", "task-11", "task-12"] and order.count("task-12") == 1


def run_all_from(store: LeaseStore, handoffs: Handoffs, claimed: int = 0) -> list[str]:
    """Let each run handed the key (from the ``claimed``-th on) claim it and release it, in turn; the
    first handed run too (it holds nothing yet): the task ids in the order they ran after the first."""
    order: list[str] = []
    i = 0
    while i < len(handoffs.seen):
        _, ho = handoffs.seen[i]
        lease, doc = store.admit(KEY, {**entry(int(ho["s"]), ho["t"]), "tk": ho["tk"]}, claim=ho["tk"])
        assert lease is not None and doc["lo"] == "claimed", doc.get("lo")
        if i >= claimed:
            order.append(ho["t"])
        assert lease.release()
        i += 1
    return order


def test_max_length_counts_the_spilled_runs(deep: LeaseStore) -> None:
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    outcomes = [deep.admit(KEY, entry(stamp), max_length=5)[1]["lo"] for stamp in range(10, 17)]
    assert outcomes == ["parked"] * 5 + ["full"] * 2
    holder.release()


@pytest.mark.parametrize("limit", [None, 2], ids=["single", "slots"])
def test_max_length_leaves_out_the_spilled_runs_that_left(deep: LeaseStore, limit: int | None) -> None:
    """A ``max_length`` queue whose spilled runs left before their turn (dropped, revoked, superseded):
    they no longer count, at once (before: until a refill passed them, and the key refused runs as full
    while fewer than ``max_length`` waited); the cap holds all the same."""
    holders = [deep.acquire(KEY, 30, limit=limit) for _ in range(limit or 1)]
    assert all(holders)
    outcomes = [deep.admit(KEY, entry(stamp), max_length=5, limit=limit)[1]["lo"] for stamp in range(10, 16)]
    assert outcomes == ["parked"] * 5 + ["full"]
    assert deep.spill.drop(KEY, ["task-12", "task-13"]) == 2  # (spilled: the window holds 10 and 11)
    answers = [
        Admission.of(*deep.admit(KEY, entry(stamp), max_length=5, limit=limit)) for stamp in range(20, 24)
    ]
    assert [a.outcome.value for a in answers] == ["parked", "parked", "full", "full"]
    # The count a full queue's answer gives (its refusal's words) leaves them out too.
    assert [a.queued for a in answers[2:]] == [5, 5]
    info = deep.inspect(KEY)
    assert info is not None and info.parked_total == 5
    assert [p["task_id"] for p in info.parked] == ["task-10", "task-11", "task-14", "task-20", "task-21"]
    for holder in holders:
        assert holder is not None
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


def test_runs_with_large_messages_are_spilled_not_refused_and_run_in_send_order(small: LeaseStore) -> None:
    # Messages of a 16th of what the document takes (MongoDB's 16 MiB, ``BUDGET`` here): it takes about
    # 14; the others are spilled, whatever the window, and come into the document as it empties.
    handoffs = Handoffs(small)
    holder = small.acquire(KEY, 60)
    assert holder is not None
    big = b"x" * (BUDGET // 16)
    outcomes = [small.admit(KEY, entry(i, m=big))[1]["lo"] for i in range(18)]
    assert outcomes == ["parked"] * 18
    assert 10 <= len(window(small)) < 16 and len(spilled(small)) == 18 - len(window(small))
    assert run_all(small, handoffs, holder) == [f"task-{i}" for i in range(18)]


def test_a_run_moved_whose_delete_failed_never_runs_again_after_the_key_is_forgotten(
    deep: LeaseStore,
) -> None:
    handoffs = Handoffs(deep)
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    for stamp in range(10, 14):
        deep.admit(KEY, entry(stamp))
    real = Collection.delete_many

    def failing(self: Collection[Any], *args: Any, **kwargs: Any) -> Any:
        if self.name.endswith(".parked"):
            raise AutoReconnect("connection reset")
        return real(self, *args, **kwargs)

    Collection.delete_many = failing  # type: ignore[method-assign]
    try:
        assert holder.release()  # hands task-10 and refills 12, 13: the move lands, its delete fails
    finally:
        Collection.delete_many = real  # type: ignore[method-assign]
    assert run_all_from(deep, handoffs) == ["task-10", "task-11", "task-12", "task-13"]
    assert spilled(deep)  # left behind, under numbers the lane passed
    # Hours later the TTL index deletes the idle key's document; a new burst numbers its runs anew.
    deep.collection.delete_one({"_id": KEY})
    handoffs.seen.clear()
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    for stamp in (20, 21, 22, 23):
        assert deep.admit(KEY, entry(stamp))[1]["lo"] == "parked"
    assert run_all(deep, handoffs, holder) == ["task-20", "task-21", "task-22", "task-23"]
    # A late copy of a run left behind is a copy (it ran); a later attempt of its task (``self.retry``)
    # deletes what was left and parks.
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    for stamp in (30, 31):
        deep.admit(KEY, entry(stamp))
    assert deep.admit(KEY, entry(12))[1]["lo"] == "dup"
    assert deep.admit(KEY, {**entry(12), "id": "task-12/1.0", "r": "1.0"})[1]["lo"] == "parked"
    assert [d["e"]["id"] for d in deep.spill.collection.find({"k": KEY, "rid": "task-12"})] == ["task-12/1.0"]


def test_a_lost_answer_to_a_spilled_run_s_insert_never_stores_it_twice(deep: LeaseStore) -> None:
    handoffs = Handoffs(deep)
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    for stamp in (10, 11):
        deep.admit(KEY, entry(stamp))
    real = Collection.insert_one
    lost = [True]

    def lossy(self: Collection[Any], doc: Any, *args: Any, **kwargs: Any) -> Any:
        out = real(self, doc, *args, **kwargs)
        if self.name.endswith(".parked") and lost and lost.pop():
            raise AutoReconnect("the answer was lost")
        return out

    Collection.insert_one = lossy  # type: ignore[method-assign,assignment]
    try:
        lease, doc = deep.admit(KEY, entry(12))  # sent again: its own insert is found, it is parked
    finally:
        Collection.insert_one = real  # type: ignore[method-assign]
    assert lease is None and doc["lo"] == "parked" and not lost
    # The same task admitted again under another delivery (a retry after an error): a copy.
    again = {**entry(12), "id": "task-12/0.1", "r": "0.1"}
    assert deep.admit(KEY, again)[1]["lo"] == "dup"
    assert run_all(deep, handoffs, holder) == ["task-10", "task-11", "task-12"]


def test_a_replace_run_of_a_set_is_never_spilled_and_a_queue_run_of_several_keys_is(deep: LeaseStore) -> None:
    """A ``Replace`` run of a set of keys (``g``) waits on every key of its set at once, in the lease
    documents; a ``Queue`` run of several keys takes them one at a time and is spilled like a run of one
    key (``test_stepwise_keys``)."""
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    for stamp in (10, 11, 12):
        assert deep.admit(KEY, {**entry(stamp), "ks": [KEY, "other"]})[1]["lo"] == "parked"
    assert window(deep) == ["task-10", "task-11"] and spilled(deep) == ["task-12"]
    assert deep.admit(KEY, {**entry(13), "ks": [KEY, "other"], "g": "ks:set"})[1]["lo"] == "parked"
    assert window(deep) == ["task-10", "task-11", "task-13"] and spilled(deep) == ["task-12"]
    holder.release()


def test_a_plain_acquire_never_passes_spilled_runs(deep: LeaseStore) -> None:
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    for stamp in range(10, 15):
        deep.admit(KEY, entry(stamp))
    # The window emptied and the refill has not come yet (or failed): the key looks free.
    deep.collection.update_one({"_id": KEY}, {"$set": {"q": []}, "$unset": {"owner": 1}})
    assert deep.acquire(KEY, 30) is None


def test_a_message_that_could_not_come_back_into_the_document_is_refused(store: LeaseStore) -> None:
    holder = store.acquire(KEY, 60)
    assert holder is not None
    with pytest.raises(MessageTooLarge, match=r"over the 15\.2 MiB a run of 'email-group:42'"):
        store.admit(KEY, entry(1, m=b"x" * (15 * 2**20 + 2**19)))
    assert spilled(store) == [] and window(store) == []


def test_inspect_pages_through_the_window_and_the_spill(deep: LeaseStore) -> None:
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    for stamp in range(10, 20):
        deep.admit(KEY, entry(stamp))
    info = deep.inspect(KEY)
    assert info is not None and info.parked_total == 10
    assert [p["task_id"] for p in info.parked] == [f"task-{s}" for s in range(10, 20)]
    assert [p["position"] for p in info.parked] == list(range(1, 11))
    page = deep.inspect(KEY, parked_from=1, parked_limit=3)
    assert page is not None and [(p["position"], p["task_id"]) for p in page.parked] == [
        (2, "task-11"),
        (3, "task-12"),
        (4, "task-13"),
    ]
    story = deep.why(KEY, parked_limit=3)
    assert story is not None and story.parked_total == 10
    holder.release()


def test_runs_parked_by_a_version_without_a_spill_are_served_first(deep: LeaseStore) -> None:
    # The upgrade: a key whose runs were all parked in its lease document (a queue deeper than the
    # window), then runs parked by this version, spilled behind them.
    handoffs = Handoffs(deep)
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    assert deep.admit(KEY, entry(10))[1]["lo"] == "parked"
    (template,) = (deep.collection.find_one({"_id": KEY}) or {})["q"]
    old = [{**template, **entry(s), "tk": f"tk-{s}"} for s in range(10, 16)]
    deep.collection.update_one({"_id": KEY}, {"$set": {"q": old}})
    for stamp in range(20, 24):
        assert deep.admit(KEY, entry(stamp))[1]["lo"] == "parked"
    assert window(deep) == [f"task-{s}" for s in range(10, 16)]
    assert spilled(deep) == [f"task-{s}" for s in range(20, 24)]
    order = run_all(deep, handoffs, holder)
    assert order == [f"task-{s}" for s in range(10, 16)] + [f"task-{s}" for s in range(20, 24)]


def test_spilled_runs_past_their_deadline_are_timed_out_at_the_lane_s_head(deep: LeaseStore) -> None:
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    for stamp in range(10, 15):
        assert deep.admit(KEY, entry(stamp), timeout=0.5)[1]["lo"] == "parked"
    assert len(spilled(deep)) == 3
    # The holder runs on: no refill comes from a release. The sweeper's pass moves the spilled runs past
    # their deadline (on the server's clock) to ``dead``, whatever room the window has.
    dl = max(d["e"]["dl"] for d in deep.spill.collection.find({"k": KEY}))
    wait_for(lambda: server_past(deep, dl), timeout=30, message="the spilled runs' deadline passed")
    assert deep.spill.expire(KEY, [0])
    assert spilled(deep) == []
    swept = deep.sweep(KEY)
    assert swept is not None
    assert sorted(r["t"] for r in swept.timed_out) == [f"task-{s}" for s in range(10, 15)]
    holder.release()


def test_revoked_spilled_runs_are_found_by_their_task_ids_and_dropped(deep: LeaseStore) -> None:
    handoffs = Handoffs(deep)
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    for stamp in range(10, 16):
        deep.admit(KEY, entry(stamp))
    found = deep.spill.revoked_runs(KEY, {"task-13", "task-15", "task-99", "task-10"})
    assert sorted(r["t"] for r in found) == ["task-13", "task-15"]  # (task-10 is in the window)
    assert deep.spill.drop(KEY, ["task-13", "task-15"]) == 2
    assert run_all(deep, handoffs, holder) == ["task-10", "task-11", "task-12", "task-14"]


def test_a_spilled_run_that_left_is_counted_out_at_once_and_its_tombstone_expires(deep: LeaseStore) -> None:
    """A spilled run that leaves before its turn (dropped, revoked, superseded) becomes a tombstone where
    it is: the parked count of ``inspect``, ``why`` and ``list`` leaves it out at once (before: until a
    refill passed its number; a new user's trial counted 485 runs and listed 299), the server deletes it a
    day later (before: never), and a late store of the run under its number still finds it taken."""
    from celery_mongolock.core.store_spill import Stored

    holder = deep.acquire(KEY, 30)
    assert holder is not None
    for stamp in range(10, 16):
        deep.admit(KEY, entry(stamp))
    info = deep.inspect(KEY)
    assert info is not None and info.parked_total == 6
    left = deep.spill.collection.find_one({"k": KEY, "rid": "task-13"})
    assert left is not None
    assert deep.spill.drop(KEY, ["task-13", "task-15"]) == 2
    assert deep.spill.drop(KEY, ["task-13"]) == 0  # (gone already)
    info = deep.inspect(KEY)
    assert info is not None and info.parked_total == 4
    assert [p["task_id"] for p in info.parked] == ["task-10", "task-11", "task-12", "task-14"]
    story = deep.why(KEY)
    assert story is not None and story.parked_total == 4
    assert [i.parked_total for i in deep.list(KEY)] == [4]
    tomb = deep.spill.collection.find_one({"_id": left["_id"]})
    assert tomb is not None and tomb["x"] is True and "e" not in tomb
    now = deep.collection.database.command("hello")["localTime"].replace(tzinfo=None)
    kept = tomb["xa"].replace(tzinfo=None) - now
    assert _dt.timedelta(hours=23) < kept <= _dt.timedelta(hours=24)
    ttl = deep.spill.collection.index_information()["xa_ttl"]
    assert ttl["key"] == [("xa", 1)] and ttl["expireAfterSeconds"] == 0
    late = {"r": left["r"], "e": left["ep"], "n": left["n"], "at": left["e"]["at"]}
    assert deep.spill.store_entry(KEY, entry(13), late, None) == Stored.AGAIN
    holder.release()


def test_a_refill_overtaken_by_another_leaves_no_tombstone(deep: LeaseStore, make_store: Any) -> None:
    """Two refills of one lane at once (two workers' releases): the second reads the lane's head, the
    first moves those runs and deletes them, and the second then finds their numbers empty. They are no
    holes: it stops there, writing no tombstone under them (a storm of 3,000 runs on one key left 144,
    never deleted)."""
    other = make_store(lease_seconds=30, parked_window=WINDOW)
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    for stamp in range(10, 18):
        deep.admit(KEY, entry(stamp))
    deep.collection.update_one({"_id": KEY}, {"$set": {"q": []}})  # the window emptied, no refill yet
    real_find = Collection.find
    overtaken: list[Any] = []

    def find(coll: Collection[Any], *args: Any, **kwargs: Any) -> Any:
        if coll.name.endswith(".parked") and not overtaken:
            overtaken.append(None)
            overtaken[0] = other.spill.refill(KEY, 0)  # the other refill, between the read and the find
        return real_find(coll, *args, **kwargs)

    Collection.find = find  # type: ignore[method-assign,assignment]
    try:
        assert deep.spill.refill(KEY, 0) is None  # overtaken: it moved nothing
    finally:
        Collection.find = real_find  # type: ignore[method-assign]
    assert overtaken and overtaken[0] is not None
    assert window(deep) == ["task-12", "task-13"] and spilled(deep) == [f"task-{s}" for s in range(14, 18)]
    assert deep.spill.collection.count_documents({"k": KEY, "x": True}) == 0
    holder.release()


def test_a_spilled_run_with_a_large_message_is_brought_back(deep: LeaseStore) -> None:
    """A spilled run's message of 10 MiB (under the 15.2 MiB a spilled run may carry): the refill's
    command carries it once (before: three times, and the driver refused the 30 MiB command with its own
    ``DocumentTooLarge``, out of the release that triggered the refill)."""
    handoffs = Handoffs(deep)
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    for stamp in (10, 11):
        deep.admit(KEY, entry(stamp))
    lease, doc = deep.admit(KEY, entry(12, m=b"x" * 10 * 2**20))
    assert lease is None and doc["lo"] == "parked" and spilled(deep) == ["task-12"]
    assert run_all(deep, handoffs, holder) == ["task-10", "task-11", "task-12"]


def _held_with_a_lower_priority_run(deep: LeaseStore) -> tuple[Handoffs, Any]:
    """The key held; five rank-0 runs parked (two in the window, three spilled), then a rank-1 run."""
    handoffs = Handoffs(deep)
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    for stamp in range(10, 15):
        deep.admit(KEY, entry(stamp))
    deep.admit(KEY, entry(5, "low-5", pr=1))
    return handoffs, holder


def test_spilled_runs_go_before_a_lower_priority_run_in_the_window(deep: LeaseStore) -> None:
    """A key held as one lease, its window holding rank-0 runs and a rank-1 run, more rank-0 runs spilled:
    every rank-0 run is handed the key before the rank-1 run (as ``inspect`` lists them), however the
    window empties."""
    handoffs, holder = _held_with_a_lower_priority_run(deep)
    info = deep.inspect(KEY)
    assert info is not None
    listed = [p["task_id"] for p in info.parked]
    assert listed == ["task-10", "task-11", "task-12", "task-13", "task-14", "low-5"]
    assert run_all(deep, handoffs, holder) == listed


def test_a_lower_priority_run_waits_for_spilled_runs_the_window_lost_sight_of(deep: LeaseStore) -> None:
    """The window holds only a rank-1 run while rank-0 runs are spilled (their refill never came: its
    worker stopped): the release hands the key to the spilled rank-0 runs first, not to the rank-1 run
    (before: the rank-1 run, the head of the window, was handed the key)."""
    handoffs, holder = _held_with_a_lower_priority_run(deep)
    # task-10 and task-11 ran (as if handed); the refill after them never came.
    deep.collection.update_one({"_id": KEY}, {"$pull": {"q": {"t": {"$in": ["task-10", "task-11"]}}}})
    assert window(deep) == ["low-5"] and spilled(deep) == ["task-12", "task-13", "task-14"]
    assert run_all(deep, handoffs, holder) == ["task-12", "task-13", "task-14", "low-5"]


def test_the_sweeper_hands_spilled_runs_a_key_left_vacant_for_them(deep: LeaseStore) -> None:
    """As above, but the releasing worker stopped before its refill: the key is vacant, its window holds
    the rank-1 run only, and the sweeper brings the rank-0 runs and hands the key to the oldest."""
    handoffs, _holder = _held_with_a_lower_priority_run(deep)
    deep.collection.update_one(
        {"_id": KEY},
        {"$pull": {"q": {"t": {"$in": ["task-10", "task-11"]}}}, "$unset": {"owner": 1}},
    )
    deep.sweep(KEY)
    assert handoffs.tasks[:1] == ["task-12"]


def test_a_spilled_run_the_document_cannot_take_yet_holds_the_key_back_for_nobody(small: LeaseStore) -> None:
    """A key held as one lease: lower-priority runs with large messages fill the window, and a run of a
    higher priority whose message the document cannot take beside them is spilled. The key goes to the
    window's runs until there is room for it (none would: nothing would make room), and the spilled run,
    once it fits, is handed the key next."""
    handoffs = Handoffs(small)
    holder = small.acquire(KEY, 120)
    assert holder is not None
    big = b"x" * (BUDGET // 6)
    for stamp in range(10, 15):
        assert small.admit(KEY, entry(stamp, pr=1, m=big))[1]["lo"] == "parked"
    assert window(small) == [f"task-{s}" for s in range(10, 15)]
    assert small.admit(KEY, entry(5, "urgent", m=b"y" * (BUDGET // 2)))[1]["lo"] == "parked"
    # Another run of its priority spilled behind it, and its worker stopped before its refill: the lane
    # changed, so its mark is gone until a refill finds again that the document cannot take the lane's
    # next run (the release's, here).
    assert small.admit(KEY, entry(6, "urgent-2"))[1]["lo"] == "parked"
    assert spilled(small) == ["urgent", "urgent-2"]
    small.collection.update_one({"_id": KEY}, {"$unset": {"sp.$[].bk": 1}})
    order = run_all(small, handoffs, holder)
    assert sorted(order) == sorted(["urgent", "urgent-2"] + [f"task-{s}" for s in range(10, 15)])
    # It goes as soon as it fits: once task-12's claim has taken its message out of the document (a
    # review of stop 49: before, task-12's release still handed the key to task-13 over it).
    assert order[:5] == ["task-10", "task-11", "task-12", "urgent", "urgent-2"], order


def test_a_run_whose_handoff_went_unclaimed_is_handed_again_whatever_is_spilled(deep: LeaseStore) -> None:
    """A rank-1 run is handed the key and does not claim it in time; meanwhile rank-0 runs fill the window
    and one is spilled. The sweeper hands the key to the rank-1 run again (a run handed the key keeps it),
    and then the rank-0 runs in send order (review of stop 49: with the handoff held back for the spilled
    run, the key stayed free with runs parked for good, since the rank-0 lane had no room to refill)."""
    handoffs = Handoffs(deep)
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    assert deep.admit(KEY, entry(5, "late", pr=1))[1]["lo"] == "parked"
    assert holder.release() and handoffs.tasks == ["late"]
    for stamp in range(10, 13):
        assert deep.admit(KEY, entry(stamp))[1]["lo"] == "parked"
    assert spilled(deep) == ["task-12"]
    past = _dt.datetime(2000, 1, 1, tzinfo=_dt.timezone.utc)
    deep.collection.update_one({"_id": KEY}, {"$set": {"expires_at": past}})  # its handoff lapsed
    deep.sweep(KEY)
    assert handoffs.tasks == ["late", "late"]
    order: list[str] = []
    while len(order) < len(handoffs.seen) - 1:
        _, ho = handoffs.seen[len(order) + 1]
        order.append(ho["t"])
        e = entry(int(ho["s"]), ho["t"], **({"pr": ho["pr"]} if ho.get("pr") else {}))
        lease, doc = deep.admit(KEY, {**e, "tk": ho["tk"]}, claim=ho["tk"])
        assert lease is not None and doc["lo"] == "claimed", doc.get("lo")
        assert lease.release()
    assert order == ["late", "task-10", "task-11", "task-12"]
