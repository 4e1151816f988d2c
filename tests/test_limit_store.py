"""``limit=N`` in the lease store, on the embedded server: N holds of one key at once, each in a slot,
one atomic command to take one, fences strictly increasing over all slots, expiry per hold on the
server's clock, renewal and loss per hold, release by the worker's parent and by an operator."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from celery_mongolock import ConfigurationError, LeaseStore, LockContended
from celery_mongolock.core.documents.queue import gc_stage
from celery_mongolock.testing import wait_for

from .conftest import CommandCounter

KEY = "tenant:7"


def test_at_most_n_holds_each_in_a_slot_with_increasing_fences(
    store: LeaseStore, counter: CommandCounter
) -> None:
    store.ensure_indexes()
    counter.clear()
    leases = [store.acquire(KEY, 30, limit=3) for _ in range(3)]
    assert all(lease is not None for lease in leases)
    assert counter.names() == ["findAndModify"] * 3  # one atomic command per acquire
    assert sorted(lease.slot or 0 for lease in leases if lease) == [0, 1, 2]
    fences = [lease.fence for lease in leases if lease]
    assert fences == sorted(fences) and len(set(fences)) == 3
    assert store.acquire(KEY, 30, limit=3) is None  # full
    info = store.inspect(KEY)
    assert info is not None and info.held and info.full and info.limit == 3
    assert [s["slot"] for s in info.slots] == [0, 1, 2]
    # Releasing one frees that slot at once; the next hold gets it and a larger fence.
    assert leases[1] is not None and leases[1].release()
    again = store.acquire(KEY, 30, limit=3)
    assert again is not None and again.slot == leases[1].slot and again.fence > max(fences)
    inspected = store.inspect(KEY)
    assert inspected is not None and inspected.full


def test_a_single_lease_and_slots_of_one_key_exclude_each_other(store: LeaseStore) -> None:
    single = store.acquire(KEY, 30)
    assert single is not None
    assert store.acquire(KEY, 30, limit=3) is None
    single.release()
    slot = store.acquire(KEY, 30, limit=3)
    assert slot is not None
    assert store.acquire(KEY, 30) is None
    slot.release()
    assert store.acquire(KEY, 30) is not None


def test_a_hold_refused_for_a_full_key_names_its_slots_and_their_holders(store: LeaseStore) -> None:
    """All N slots held: ``LockContended`` says so and names each holder (before: "held by another
    owner"), with the first expiry as ``expires_at``."""
    for task_id in ("a", "b"):
        assert store.acquire("t:full", ttl=30, limit=2, info={"task_name": "sync", "task_id": task_id})
    with pytest.raises(LockContended) as caught, store.hold("t:full", limit=2):
        pass
    message = str(caught.value)
    assert message.startswith("lease 't:full': all 2 slots are held, by "), message
    assert "task_name=sync, task_id=a; " in message and message.count("task_name=sync") == 2, message
    assert caught.value.expires_at is not None and "another owner" not in message


def test_an_expired_hold_frees_its_slot_and_is_recorded(store: LeaseStore) -> None:
    short = store.acquire(KEY, 0.5, limit=2)
    other = store.acquire(KEY, 30, limit=2)
    assert short is not None and other is not None
    assert store.acquire(KEY, 30, limit=2) is None
    taken = wait_for(lambda: store.acquire(KEY, 30, limit=2), timeout=10, message="the expired slot")
    assert taken is not None
    assert taken.slot == short.slot and taken.fence > other.fence
    doc = store.collection.find_one({"_id": KEY}) or {}
    assert [e["how"] for e in doc["ends"]] == ["expired"] and doc["ends"][0]["f"] == short.fence


def test_renewal_keeps_each_hold_and_a_taken_slot_is_lost(store: LeaseStore) -> None:
    a = store.acquire(KEY, 1.0, limit=2)
    b = store.acquire(KEY, 1.0, limit=2)
    assert a is not None and b is not None
    assert store.renew_many([a, b]) == []
    # An operator frees b's slot: the next renewal finds it gone, a's hold is kept.
    store.collection.update_one({"_id": KEY}, {"$pull": {"hs": {"o": b.owner}}})
    assert store.renew_many([a, b]) == [b]
    assert b.lost and not a.lost


def test_one_command_renews_single_leases_and_slots_and_a_lost_one_is_found_at_the_next_tick(
    store: LeaseStore, counter: CommandCounter
) -> None:
    single = store.acquire("single", 30)
    slots = [store.acquire(f"tenant:{i}", 30, limit=3) for i in range(3)]
    other = store.acquire("tenant:0", 30, limit=3)  # another process's hold of one of those keys
    assert single is not None and other is not None and all(slots)
    leases = [single, *[s for s in slots if s]]
    before = {d["_id"]: (d.get("expires_at"), [h["x"] for h in d.get("hs") or []])
              for d in store.collection.find()}  # fmt: skip
    counter.clear()
    assert store.renew_many(leases) == []
    assert counter.names() == ["update"]  # one command a tick, both document shapes
    after = {d["_id"]: d for d in store.collection.find()}
    assert after["single"]["expires_at"] > before["single"][0]
    for lease in leases[1:]:
        [mine] = [h for h in after[lease.key]["hs"] if h["o"] == lease.owner]
        assert mine["x"] > lease.acquired_at  # renewed from now
    [theirs] = [h for h in after["tenant:0"]["hs"] if h["o"] == other.owner]
    assert theirs["x"] in before["tenant:0"][1]  # not ours: untouched
    # A slot taken from us (an operator), and the single lease expired on the server: both are found at
    # the next tick, with one more query to learn which.
    store.collection.update_one({"_id": "tenant:1"}, {"$pull": {"hs": {"o": leases[2].owner}}})
    store.collection.update_one({"_id": "single"}, [{"$set": {"expires_at": "$$NOW"}}])
    counter.clear()
    assert store.renew_many(leases) == [single, leases[2]]
    assert counter.names() == ["update", "aggregate"]
    assert single.lost and leases[2].lost and not leases[1].lost and not leases[3].lost
    counter.clear()
    assert store.renew_many(leases) == []  # the lost ones are no longer renewed
    assert counter.names() == ["update"]


def test_a_hold_and_a_lease_that_expired_in_place_are_found_lost_at_the_next_tick(
    store: LeaseStore, counter: CommandCounter
) -> None:
    """Expired on the server's clock (say its clock ran ahead) but still in the document, nobody having
    taken them over: the renewal does not revive them and leaves their documents unchanged, so its
    modified count tells."""
    short = store.acquire(KEY, 30, limit=2)
    single = store.acquire("single", 30)
    kept = store.acquire("other", 30, limit=2)
    assert short is not None and single is not None and kept is not None
    # Expire both now on the server, the derived fields kept as every command keeps them.
    hs = {"$map": {"input": "$hs", "as": "e", "in": {"$mergeObjects": ["$$e", {"x": "$$NOW"}]}}}
    store.collection.update_one(
        {"_id": KEY}, [{"$set": {"hs": hs}}, {"$set": {"sx": {"$max": "$hs.x"}}}, gc_stage()]
    )
    store.collection.update_one({"_id": "single"}, [{"$set": {"expires_at": "$$NOW"}}, gc_stage()])
    counter.clear()
    assert store.renew_many([short, single, kept]) == [short, single]
    assert counter.names() == ["update", "aggregate"]
    assert short.lost and single.lost and not kept.lost
    doc = store.collection.find_one({"_id": KEY}) or {}
    assert [h["o"] for h in doc["hs"]] == [short.owner]  # still there, not revived
    assert doc["hs"][0]["x"] < (store.collection.find_one({"_id": "other"}) or {})["hs"][0]["x"]


def test_two_slots_of_one_key_in_one_process_keep_loss_detection_exact(
    store: LeaseStore, counter: CommandCounter
) -> None:
    a = store.acquire(KEY, 30, limit=3)
    b = store.acquire(KEY, 30, limit=3)
    single = store.acquire("single", 30)
    assert a is not None and b is not None and single is not None
    counter.clear()
    assert store.renew_many([a, b, single]) == []
    # One document holds both: its match says only that one of them is live, so the tick asks which.
    assert counter.names() == ["update", "aggregate"]
    store.collection.update_one({"_id": KEY}, {"$pull": {"hs": {"o": b.owner}}})
    assert store.renew_many([a, b, single]) == [b]
    assert b.lost and not a.lost and not single.lost


def test_a_heartbeat_keeps_slot_leases_alive_past_their_length(make_store: Any) -> None:
    # The store's own length (60 s) is far from the slot's (4 s); the slot's is long enough that a busy
    # machine stalling the server for a second or two does not lose it before its first renewal (ci16:
    # a 1 s slot was lost to a 0.57 s renewal timeout under load).
    store = make_store(lease_seconds=60)
    lease = store.acquire(KEY, 4.0, limit=2, heartbeat=True, heartbeat_seconds=0.3)
    assert lease is not None
    first = (store.inspect(KEY) or pytest.fail("no lease")).slots[0]["expires_in"]
    wait_for(
        lambda: store.collection.find_one({"_id": KEY, "hs.x": {"$gt": lease.expires_at}}),
        timeout=30,
        message="a renewal",
    )
    # The slot's own length (4 s), not the store's 60 s. Not ``<= 4.0``: the embedded server binds ``$$NOW``
    # when a command starts, so a renewal that lands while ``inspect`` runs can show up to its delay more.
    assert not lease.lost and 0 < first < 30.0
    assert lease.release()


def test_the_parent_of_a_dead_child_frees_its_slots_only(store: LeaseStore) -> None:
    mine = store.acquire(KEY, 30, limit=3, info={"task_id": "dying", "pid": 99})
    theirs = store.acquire(KEY, 30, limit=3, info={"task_id": "alive", "pid": 98})
    assert mine is not None and theirs is not None
    assert store.release_held_by(task_id="dying", pid=99) == 1
    info = store.inspect(KEY)
    assert info is not None and [s["holder"]["task_id"] for s in info.slots] == ["alive"]
    doc = store.collection.find_one({"_id": KEY}) or {}
    assert doc["ends"][-1]["how"] == "holder-died" and doc["ends"][-1]["t"] == "dying"


def test_force_release_frees_every_slot_and_background_release_frees_tokens(store: LeaseStore) -> None:
    a = store.acquire(KEY, 30, limit=3)
    b = store.acquire(KEY, 30, limit=3)
    assert a is not None and b is not None
    assert store.release_tokens([a.owner]) == 1
    assert [s["fence"] for s in (store.inspect(KEY) or pytest.fail("gone")).slots] == [b.fence]
    assert store.force_release(KEY)
    assert not (store.inspect(KEY) or pytest.fail("gone")).held


def test_concurrent_acquires_never_exceed_the_limit(make_store: Any) -> None:
    stores = [make_store(lease_seconds=30) for _ in range(4)]
    taken: list[Any] = []
    lock = threading.Lock()
    barrier = threading.Barrier(len(stores))

    def grab(s: LeaseStore) -> None:
        barrier.wait()
        for _ in range(5):
            lease = s.acquire(KEY, limit=3)
            if lease is not None:
                with lock:
                    taken.append(lease)

    threads = [threading.Thread(target=grab, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(taken) == 3 and sorted(lease.slot or 0 for lease in taken) == [0, 1, 2]


@pytest.mark.parametrize("limit", [0, -1, 1001, 2.5, "3", True])
def test_a_bad_limit_is_refused(store: LeaseStore, limit: Any) -> None:
    with pytest.raises(ConfigurationError, match="limit must be an int from 1 to 1000"):
        store.acquire(KEY, 30, limit=limit)


def test_limit_one_is_a_single_lease(store: LeaseStore) -> None:
    lease = store.acquire(KEY, 30, limit=1)
    assert lease is not None and lease.slot is None
    assert (store.collection.find_one({"_id": KEY}) or {})["owner"] == lease.owner


def test_why_says_how_many_slots_are_held_and_by_whom(store: LeaseStore) -> None:
    a = store.acquire(KEY, 30, limit=2, info={"task_name": "sync", "task_id": "s-1"})
    assert a is not None
    story = store.why(KEY)
    assert story is not None and story.state == "slots"
    assert story.verdict.startswith("1 of 2 slots held (slot 0: sync[s-1]")
    assert story.verdict.endswith("the next run takes a slot at once")
    assert store.acquire(KEY, 30, limit=2) is not None
    full = store.why(KEY)
    assert full is not None and full.verdict.startswith("all 2 slots held (")


def test_a_beat_tick_takes_one_slot_once(store: LeaseStore) -> None:
    first = store.acquire(KEY, 30, limit=3, tick=1000, hold_until_ms=2000)
    assert first is not None
    assert store.acquire(KEY, 30, limit=3, tick=1000) is None  # another beat's copy of the same tick
    assert store.acquire(KEY, 30, limit=3, tick=2000) is not None  # the next tick, in another slot


def test_a_queued_run_does_not_take_a_key_whose_slots_are_held(store: LeaseStore) -> None:
    slot = store.acquire(KEY, 30, limit=3)
    assert slot is not None
    entry = {"id": "q/0", "t": "q", "n": "job", "r": "0", "s": 1, "m": b""}
    lease, doc = store.admit(KEY, entry)
    # Nor does it park behind them (``mixed``): a slot's release would hand it a slot, which a run of a
    # single lease cannot claim (``test_mixed_kinds``); it comes back later instead.
    assert lease is None and doc["lo"] == "mixed"


def test_a_slot_s_release_leaves_a_single_lease_s_expiry_alone(store: LeaseStore) -> None:
    stalled = store.acquire(KEY, 0.5, limit=2)
    assert stalled is not None
    single = wait_for(lambda: store.acquire(KEY, 60), timeout=10, message="the slot to expire")
    assert single is not None
    stalled.release()  # late: its hold had expired
    info = store.inspect(KEY)
    assert info is not None and info.held and info.owner == single.owner
    assert store.acquire(KEY, 60) is None
    single.renew()  # still ours


def test_a_stale_single_owner_neither_revives_nor_limits_the_slots(store: LeaseStore) -> None:
    old = store.acquire(KEY, 0.5)  # a single holder that died without releasing
    assert old is not None
    store.forget(old)
    taken = wait_for(lambda: store.acquire(KEY, 30, limit=3), timeout=10, message="the stale lease to expire")
    assert taken is not None
    assert store.acquire(KEY, 30, limit=3) is not None  # not limited to one by the stale owner
    assert store.renew_lease(old) is False  # and the dead holder's renewal does not revive it
    assert store.force_release(KEY)
    assert not (store.inspect(KEY) or pytest.fail("gone")).held  # slots released too


def test_a_copy_of_a_run_that_holds_a_slot_takes_none(store: LeaseStore) -> None:
    info = {"task_id": "same", "delivery": "0.0"}
    first = store.acquire(KEY, 30, limit=3, info=info)
    assert first is not None
    assert store.acquire(KEY, 30, limit=3, info=info) is None
    assert store.acquire(KEY, 30, limit=3, info={"task_id": "other", "delivery": "0.0"}) is not None


def test_a_task_refused_by_a_full_key_names_every_slot_holder(store: LeaseStore, worker_app: Any) -> None:
    """``limit=N`` with ``Fail()``: the run's ``LockContended`` names the N holders, as ``hold`` does
    (before: "lease 't:1' is held by another owner")."""
    from celery_mongolock import Fail, singleton_task

    @singleton_task(app=worker_app, key="t:{t}", limit=2, on_contention=Fail(), name="limit_store.full")
    def full(t: int) -> None: ...

    worker_app.finalize()
    for n in (1, 2):
        store.acquire(
            "t:1", 30, limit=2, info={"host": f"h{n}", "pid": n, "task_name": "x", "task_id": f"r{n}"}
        )
    with pytest.raises(LockContended) as caught:
        full.apply(args=(1,), throw=True)
    message = str(caught.value)
    assert "all 2 slots are held" in message and "task_id=r1" in message and "task_id=r2" in message
    assert caught.value.expires_at is not None  # the first slot's expiry


def test_a_task_skipped_by_a_full_key_names_every_slot_holder(store: LeaseStore, worker_app: Any) -> None:
    """``limit=N`` with ``Skip()``: the skipped result names each slot's holder (a new user's trial, stop
    55: ``holder: {}`` and "the key was held by another run")."""
    from celery_mongolock import Skip, singleton_task

    @singleton_task(app=worker_app, key="t:{t}", limit=2, on_contention=Skip(), name="limit_store.skip")
    def full(t: int) -> None: ...

    worker_app.finalize()
    for n in (1, 2):
        store.acquire("t:2", 30, limit=2, info={"task_name": "x", "task_id": f"r{n}"})
    result = full.apply(args=(2,)).get()
    assert result["mongolock"] == "skipped" and result["key"] == "t:2"
    assert [h["task_id"] for h in result["holders"]] == ["r1", "r2"]
    assert "all 2 slots are held" in result["reason"]
