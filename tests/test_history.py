"""The lease history (issue 17, part 3): every way a lease ends is recorded once, off the task's path, and
survives a process killed before it wrote its history (the lease document's ``ends``). Real server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from pymongo import MongoClient

from celery_mongolock import ConfigurationError, LeaseStore
from celery_mongolock.config import read_settings
from celery_mongolock.core.documents.base import HOLDER_VIEW, SERVER_VIEW, history_id, story_pipeline

from .conftest import CommandCounter
from .servers import wait_for

INFO = {"task_name": "app.upload", "task_id": "t-1", "worker": "w1@h1", "delivery": "0.0"}


def stored(store: LeaseStore, key: str) -> list[dict[str, Any]]:
    """The history collection's records of ``key``, oldest first (the server's view before the holder's)."""
    return list(store.history_collection.find({"k": key}).sort([("f", 1), ("v", -1)]))


def test_release_is_recorded_once_without_a_command_on_the_tasks_path(
    store: LeaseStore, counter: CommandCounter
) -> None:
    store.ensure_indexes()
    counter.clear()
    lease = store.acquire("k", info=INFO, heartbeat=True, heartbeat_seconds=1)
    assert lease is not None
    assert lease.release() is True
    # Acquire and release: the same two commands as without a history.
    assert counter.names() == ["findAndModify", "findAndModify"]
    # The heartbeat thread writes the record at its next tick, in one insert.
    wait_for(lambda: stored(store, "k"), timeout=10, message="the heartbeat to write the history")
    assert "insert" in counter.names()
    [record] = stored(store, "k")
    assert record["_id"] == history_id("k", lease.fence, SERVER_VIEW)
    assert record["how"] == "released" and record["f"] == lease.fence
    assert (record["t"], record["n"], record["worker"], record["run"]) == (
        "t-1",
        "app.upload",
        "w1@h1",
        "0.0",
    )
    assert record["host"] and record["pid"] == os.getpid() and record["a"] <= record["e"]
    [entry] = store.history("k")
    assert (entry.how, entry.fence, entry.task, entry.source) == (
        "released",
        lease.fence,
        "app.upload[t-1]",
        "ends",
    )
    assert entry.held_seconds is not None and entry.held_seconds >= 0
    # Written again (a retry after a lost reply): still one record.
    assert store.write_history([dict(record)]) == 0
    assert len(stored(store, "k")) == 1


def test_each_ending_kind_is_recorded_once_with_its_how(make_store: Any) -> None:
    worker = make_store(lease_seconds=1)  # no heartbeat on these leases: they may expire
    other = make_store(lease_seconds=30)
    # released
    released = worker.acquire("released", info=INFO)
    assert released is not None and released.release()
    # expired: taken over by another store once its lease ran out
    expired = worker.acquire("expired", info={**INFO, "task_id": "t-exp"})
    assert expired is not None
    taker = wait_for(lambda: other.acquire("expired", ttl=30), timeout=15, message="takeover after expiry")
    # holder-died: the worker's parent releases the leases of a child that died
    died = worker.acquire("died", ttl=30, info={**INFO, "task_id": "t-died"})
    assert died is not None
    assert other.release_held_by(task_id="t-died", pid=os.getpid()) == 1
    # forced, and the holder's own view: lost
    forced = worker.acquire("forced", ttl=30, info={**INFO, "task_id": "t-forced"}, heartbeat=True)
    assert forced is not None
    assert other.force_release("forced")
    assert worker.heartbeat.tick()  # the renewal matches nothing: the holder sees its lease lost
    assert forced.lost
    assert worker.flush_history() and other.flush_history()

    def hows(key: str) -> list[tuple[str, str]]:
        return [(r["how"], r["v"]) for r in stored(worker, key)]

    assert hows("released") == [("released", SERVER_VIEW)]
    assert hows("expired") == [("expired", SERVER_VIEW)]
    assert hows("died") == [("holder-died", SERVER_VIEW)]
    assert hows("forced") == [("forced", SERVER_VIEW), ("lost", HOLDER_VIEW)]
    [exp] = stored(worker, "expired")
    assert exp["f"] == expired.fence and exp["t"] == "t-exp" and exp["seen"] >= exp["e"]
    [lost] = [r for r in stored(worker, "forced") if r["v"] == HOLDER_VIEW]
    assert "released by force" in lost["why"] and lost["f"] == forced.fence
    # history(): one entry per acquisition; the holder's view beside the server's.
    assert [(e.how, e.fence) for e in worker.history("released")] == [("released", released.fence)]
    assert [(e.how, e.fence) for e in worker.history("expired")] == [("expired", expired.fence)]
    assert [(e.how, e.task_id) for e in worker.history("died")] == [("holder-died", "t-died")]
    [f] = worker.history("forced")
    assert (f.how, f.holder_saw, f.fence) == ("forced", "lost", forced.fence)
    assert f.holder_saw_why is not None and "released by force" in f.holder_saw_why
    taker.release()


def test_a_holder_that_gives_up_records_lost_beside_its_release(make_store: Any) -> None:
    """A lease that ran out on its holder's side: the holder records "lost" (its view), and the release it
    then sends in the background (so the key is not left taken for nobody) is the server's ending."""
    holder = make_store(lease_seconds=1)
    lease = holder.acquire("k", info=INFO)
    assert lease is not None
    wait_for(lambda: lease.lost, timeout=10, message="the local deadline to pass")

    def both_views() -> bool:
        # The background release is sent by the heartbeat thread, and the copy of its ending into the
        # history collection is queued when its reply comes: flush until both records are stored.
        assert holder.flush_history()
        return [(r["how"], r["v"]) for r in stored(holder, "k")] == [
            ("released", SERVER_VIEW),
            ("lost", HOLDER_VIEW),
        ]

    wait_for(both_views, timeout=10, message="the background release's ending and the holder's lost record")
    [entry] = holder.history("k")
    assert (entry.how, entry.holder_saw, entry.fence) == ("released", "lost", lease.fence)
    assert entry.holder_saw_why is not None and "deadline" in entry.holder_saw_why


def test_history_is_newest_first_limited_and_merged_with_ends(make_store: Any) -> None:
    store = make_store(lease_seconds=30)
    fences = []
    for _ in range(12):
        lease = store.acquire("k", info=INFO)
        assert lease is not None and lease.release()
        fences.append(lease.fence)
    # Nothing flushed yet: the last 8 come from ends alone.
    assert [e.fence for e in store.history("k", limit=20)] == fences[::-1][:8]
    assert store.flush_history()
    everything = store.history("k", limit=20)
    assert [e.fence for e in everything] == fences[::-1]
    assert {e.source for e in everything[:8]} == {"ends"} and {e.source for e in everything[8:]} == {
        "history"
    }
    assert [e.fence for e in store.history("k", limit=3)] == fences[::-1][:3]
    with pytest.raises(ConfigurationError, match="limit"):
        store.history("k", limit=0)


def test_a_process_killed_before_writing_its_history_still_shows_the_ending(
    mongo_url: str, db_name: str, make_store: Any
) -> None:
    script = textwrap.dedent(
        f"""
        import sys, time
        from celery_mongolock import LeaseStore
        store = LeaseStore({mongo_url!r}, database={db_name!r}, lease_seconds=60)
        lease = store.acquire("k", info={{"task_name": "app.upload", "task_id": "t-killed"}}, heartbeat=True)
        lease.release()
        print(lease.fence, flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        fence = int(proc.stdout.readline())
        proc.send_signal(signal.SIGKILL)  # long before its heartbeat's first tick (20 s)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    reader = make_store()
    reader.ensure_indexes()
    assert stored(reader, "k") == []  # it never wrote its history
    [entry] = reader.history("k")
    assert (entry.how, entry.fence, entry.task_id, entry.source) == ("released", fence, "t-killed", "ends")


def test_history_days_zero_writes_no_collection(make_store: Any, mongo_url: str, db_name: str) -> None:
    store = make_store(lease_seconds=30, history_days=0)
    lease = store.acquire("k", info=INFO, heartbeat=True)
    assert lease is not None and lease.release()
    held = store.acquire("k", info=INFO)
    assert held is not None and store.force_release("k")
    assert store.release_held_by(task_id="t-1") == 0
    assert store.flush_history() and store.write_history([{"_id": "x", "f": 1}]) == 0
    client: MongoClient[dict[str, Any]]
    with MongoClient(mongo_url) as client:
        names = client[db_name].list_collection_names()
    assert "leases" in names and "leases.history" not in names
    # The endings are still in the lease document.
    assert [e.how for e in store.history("k")] == ["forced", "released"]


def test_ttl_index_follows_history_days(make_store: Any) -> None:
    store = make_store(history_days=7)
    store.ensure_indexes()
    indexes = {ix["name"]: ix for ix in store.history_collection.list_indexes()}
    assert indexes["e_ttl"]["expireAfterSeconds"] == 7 * 86400 and dict(indexes["e_ttl"]["key"]) == {"e": 1}
    assert dict(indexes["k_f"]["key"]) == {"k": 1, "f": -1}
    shorter = make_store(history_days=0.5)
    shorter.ensure_indexes()  # a changed setting is applied to the index
    indexes = {ix["name"]: ix for ix in store.history_collection.list_indexes()}
    assert indexes["e_ttl"]["expireAfterSeconds"] == 43200


@pytest.mark.parametrize("bad", [-1, "7", True, float("nan"), 10**6, 1e-9])
def test_bad_history_days_are_refused_naming_the_setting(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="history_days"):
        LeaseStore("mongodb://localhost:1", history_days=bad)
    with pytest.raises(ConfigurationError, match="mongolock_history_days"):
        read_settings({"mongolock_history_days": bad})


def test_history_days_setting_reaches_the_store() -> None:
    assert read_settings({}).history_days == 7
    assert read_settings({"mongolock_history_days": 0}).history_days == 0
    assert read_settings({"mongolock_history_days": 1.5}).history_days == 1.5


def test_back_to_back_short_runs_do_not_put_the_history_off(store: LeaseStore) -> None:
    """Each acquire of an idle heartbeat puts its renewal tick off by a heartbeat interval; the history has
    a schedule of its own, so a worker that runs short tasks back to back still writes it."""
    fences: list[int] = []

    def one_more_run_then_look() -> bool:
        lease = store.acquire(f"k{len(fences) % 3}", info=INFO, heartbeat=True)
        assert lease is not None and lease.release()
        fences.append(lease.fence)
        return store.history_collection.count_documents({}) > 0

    # Runs at most 0.25 s apart: the renewal tick (1.7 s after the last acquire) never comes.
    wait_for(one_more_run_then_look, timeout=30, interval=0.05, message="the history to be written")


def test_why_reads_a_key_with_parked_runs_without_their_messages(store: LeaseStore) -> None:
    """The queue's fields, as the lead's queue work writes them, crafted into a held key's document."""
    lease = store.acquire("k", info=INFO, ttl=30)
    assert lease is not None
    now = store.why("k")
    assert now is not None and now.state == "held" and now.parked == () and now.handoff is None
    entry = {"id": "t-9/0.0", "t": "t-9", "n": "app.upload", "s": 1_795_000_000_000_000, "dl": None}
    store.collection.update_one(
        {"_id": "k"},
        [{"$set": {"q": [{**entry, "at": "$$NOW", "m": b"x" * 100_000}], "seen": ["a"] * 100}}],
    )
    story = store.why("k")
    assert story is not None and [run.task for run in story.parked] == ["app.upload[t-9]"]
    assert story.parked[0].parked_at is not None and story.parked[0].sent_at is not None
    assert (
        story.verdict.startswith("held by w1@h1 pid ")
        and "; 1 run parked; next: app.upload[t-9]" in story.verdict
    )
    assert 0 < (story.expires_in or 0) <= 30
    assert store.why("nope") is None
    [read] = store.collection.aggregate(story_pipeline("k"))
    assert "m" not in read["q"][0] and "seen" not in read and read["q"][0]["t"] == "t-9"


# -- endings written by the queue's and the slots' commands (issue 17, item 3) ----------------------------
def parked_entry(stamp: int, task_id: str, **extra: Any) -> dict[str, Any]:
    return {"id": f"{task_id}/0", "t": task_id, "n": "app.upload", "r": "0", "s": stamp, "m": b"m", **extra}


def expire(store: LeaseStore, key: str) -> None:
    """The holder's node died: its lease runs out now (on the server's clock)."""
    store.collection.update_one({"_id": key}, [{"$set": {"expires_at": "$$NOW"}}])


def test_a_key_handed_over_after_expiry_records_the_expired_lease_and_the_unclaimed_handoff(
    store: LeaseStore,
) -> None:
    holder = store.acquire("k", 30, info={**INFO, "task_id": "t-node-died"})
    assert holder is not None
    store.admit("k", parked_entry(1, "t-parked"))
    expire(store, "k")
    store.sweep("k")  # hands the expired key to the parked run
    handed = (store.collection.find_one({"_id": "k"}) or {})["fence"]
    expire(store, "k")  # the handed run never claimed it
    store.sweep("k")  # hands it to the same run again (a new acquisition)
    ends = (store.collection.find_one({"_id": "k"}) or {})["ends"]
    assert [(e["how"], e["f"], e["t"]) for e in ends] == [
        ("expired", holder.fence, "t-node-died"),
        ("handoff-expired", handed, "t-parked"),
    ]
    assert all(e["seen"] >= e["e"] for e in ends)
    # The sweeps' process copies them into the history at its heartbeat's next tick.
    wait_for(lambda: len(stored(store, "k")) == 2, timeout=15, message="the heartbeat to copy the endings")
    assert [(r["how"], r["f"]) for r in stored(store, "k")] == [
        ("expired", holder.fence),
        ("handoff-expired", handed),
    ]
    assert [e.how for e in store.history("k")] == ["handoff-expired", "expired"]


def test_an_admit_that_finds_the_key_expired_records_its_ending(store: LeaseStore) -> None:
    holder = store.acquire("k", 30, info={**INFO, "task_id": "t-gone"})
    assert holder is not None
    store.admit("k", parked_entry(1, "t-first"))
    expire(store, "k")
    _, doc = store.admit("k", parked_entry(2, "t-second"))  # parks, and hands the key to t-first
    assert doc["lo"] == "parked"
    assert store.flush_history()
    assert [(r["how"], r["t"]) for r in stored(store, "k")] == [("expired", "t-gone")]


def test_expired_slot_holds_reach_the_history(store: LeaseStore, counter: CommandCounter) -> None:
    short = store.acquire("tenant", 0.5, limit=2, info={**INFO, "task_id": "t-short"})
    other = store.acquire("tenant", 30, limit=2, info={**INFO, "task_id": "t-other"})
    assert short is not None and other is not None
    taken = wait_for(
        lambda: store.acquire("tenant", 30, limit=2, info=INFO), timeout=10, message="the expired slot"
    )
    assert taken is not None and taken.slot == short.slot
    # The acquire that dropped the expired hold was one command; its ending waits for the heartbeat.
    counter.clear()
    assert store.flush_history()
    assert counter.names() == ["insert"]
    [record] = stored(store, "tenant")
    assert (record["how"], record["f"], record["t"], record["slot"]) == (
        "expired",
        short.fence,
        "t-short",
        short.slot,
    )
    assert taken.release() and other.release()
    assert store.flush_history()
    assert [(e.how, e.fence) for e in store.history("tenant")] == [
        ("released", taken.fence),
        ("released", other.fence),
        ("expired", short.fence),
    ]
    assert {r["how"] for r in stored(store, "tenant")} == {"expired", "released"}


def test_a_flush_waits_for_the_heartbeat_s_own_write_under_way(
    make_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``flush_history`` returns once what was queued before it is in the collection, also when the
    heartbeat thread's own write of it is under way (before: the flush found the queue empty and returned
    at once; a CI run read the history too early and missed an ``expired`` record)."""
    import threading

    store = make_store(lease_seconds=30)
    lease = store.acquire("flushed", info=INFO)
    assert lease is not None and lease.release()  # its record is queued
    hb = store.heartbeat
    entered, go_on = threading.Event(), threading.Event()
    write = store.records.write_history

    def slow_write(*args: Any, **kwargs: Any) -> int:
        entered.set()
        assert go_on.wait(10)
        return int(write(*args, **kwargs))

    monkeypatch.setattr(store.records, "write_history", slow_write)
    tick = threading.Thread(target=hb.flush_history)  # as the heartbeat's tick writes it
    tick.start()
    assert entered.wait(10)
    flushed = threading.Thread(target=hb.flush_history)
    flushed.start()
    flushed.join(0.5)
    assert flushed.is_alive()  # it waits for the write under way
    go_on.set()
    flushed.join(10)
    tick.join(10)
    assert [r["how"] for r in stored(store, "flushed")] == ["released"]


def test_a_slot_s_ending_keeps_how_long_its_run_waited(store: LeaseStore) -> None:
    """``WAITED`` of a ``limit=N`` key (before: always ``-``, the slot's ending left out ``w``; found by a new
    user), as for a single lease."""
    slot, _ = store.try_acquire("waits", None, limit=2, info=INFO, waited_ms=1234)
    single, _ = store.try_acquire("waits-single", None, info=INFO, waited_ms=1234)
    assert slot is not None and single is not None
    assert slot.release() and single.release()
    assert store.flush_history()
    [one] = store.history("waits")
    [other] = store.history("waits-single")
    assert one.waited_ms == other.waited_ms == 1234


def test_a_handoff_s_reply_records_only_the_takeover_its_own_command_wrote(
    store: LeaseStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Records.record_takeovers``: of the endings a reply carries, a single lease's takeover is taken
    only when its ``seen`` is the ``hat`` of a handoff in the reply (the same command's time), not an older
    one still kept; a slot's (no ``seen``) is taken; a release is not."""
    import datetime as dt

    queued: list[dict[str, Any]] = []
    monkeypatch.setattr(store.heartbeat, "record", queued.append)
    now, before = dt.datetime(2026, 1, 2, 3, 4, 5), dt.datetime(2026, 1, 2, 3, 0, 0)
    ends = [
        {"f": 1, "how": "expired", "seen": before, "e": before},
        {"f": 2, "how": "released", "e": before},
        {"f": 3, "how": "handoff-expired", "seen": now, "e": now},
        {"f": 4, "how": "expired", "slot": 0, "e": now},
    ]
    store.records.record_takeovers("k", {"ho": {"t": "t-1", "hat": now}, "ends": ends})
    assert sorted(r["f"] for r in queued) == [3, 4]


def test_an_expired_lease_found_by_a_refill_of_the_window_is_recorded_from_its_reply(
    make_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key whose window of parked runs emptied (its runs left) while runs wait in the spill, and whose
    holder's node died: the refill that brings the spilled runs in finds the lease expired and hands the key
    to the oldest of them, in one command, which writes the dead holder's ending. That command's reply
    carries it, and it is recorded from there (not only copied from ``ends`` at the heartbeat's tick, by
    when more endings may have pushed it out)."""
    store = make_store(lease_seconds=30, parked_window=2)
    monkeypatch.setattr(store.heartbeat, "copy_endings", lambda match: None)
    key = "q:refilled-behind-a-dead-holder"
    holder = store.acquire(key, 30, info={**INFO, "task_id": "t-dead"})
    assert holder is not None
    for n in range(5):  # 2 in the window, 3 spilled
        assert store.admit(key, parked_entry(n, f"t-{n}"))[1]["lo"] == "parked"
    store.collection.update_one({"_id": key}, {"$set": {"q": []}})  # the window's runs left
    expire(store, key)
    assert store.spill.refill(key, 0) is not None
    assert (store.collection.find_one({"_id": key}) or {})["ho"]["t"] == "t-2"
    assert store.flush_history()
    assert [(r["how"], r["t"]) for r in stored(store, key)] == [("expired", "t-dead")]


@pytest.mark.parametrize("how", ["holder-died", "expired", "expired-found-by-an-admit"])
def test_a_dead_holder_s_ending_is_kept_when_the_runs_behind_it_end_before_the_tick(
    make_store: Any, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key with 12 runs parked behind a holder that died (its child killed: its parent releases the key;
    or its node: the sweeper, or a new send's admit, hands the expired key on). The parked runs then run
    and end, more of them than the lease document's ``ends`` keeps (8), before the heartbeat's tick: the
    dead holder's ending is in the history all the same (a new-user trial: ``history`` showed 10
    ``released`` lines and nothing for the dead holder; it was copied from ``ends`` at the tick, once it
    had dropped out)."""
    store = make_store(lease_seconds=30)
    # (no copy of ``ends`` at the tick, which a slow machine may reach while the ending is still there)
    monkeypatch.setattr(store.heartbeat, "copy_endings", lambda match: None)
    key = "q:behind-a-dead-holder"
    holder = store.acquire(key, 30, info={**INFO, "task_id": "t-dead", "pid": 4242})
    assert holder is not None
    for n in range(12):
        assert store.admit(key, parked_entry(n, f"t-{n}"))[1]["lo"] == "parked"
    runs = 12
    if how == "holder-died":
        assert store.release_held_by(task_id="t-dead", pid=4242) == 1
    elif how == "expired":
        expire(store, key)
        assert store.sweep(key) is not None
    else:  # a new send, before any sweep: its admit finds the lease expired and hands the key on
        expire(store, key)
        assert store.admit(key, parked_entry(12, "t-12"))[1]["lo"] == "parked"
        assert (store.collection.find_one({"_id": key}) or {})["ho"]["t"] == "t-0"
        runs, how = 13, "expired"
    for _ in range(runs):  # each run handed the key claims it and ends (as fast as a worker can)
        ho = (store.collection.find_one({"_id": key}) or {})["ho"]
        lease, doc = store.admit(key, {**parked_entry(int(ho["s"]), ho["t"]), "tk": ho["tk"]}, claim=ho["tk"])
        assert lease is not None and doc["lo"] == "claimed", doc.get("lo")
        assert lease.release()
    ends = (store.collection.find_one({"_id": key}) or {})["ends"]
    assert len(ends) == 8 and how not in {e["how"] for e in ends}  # dropped out of ``ends``
    assert store.flush_history()
    assert [(r["how"], r["t"]) for r in stored(store, key) if r["how"] == how] == [(how, "t-dead")]
    assert [e.how for e in store.history(key, limit=20)].count(how) == 1
