"""``limit=N`` with ``min_hold_seconds`` in the lease store, on the embedded server: a slot released
before its minimum hold stays taken until then (server clock), is never renewed again, has one ending
(its release); at the end of the hold the slot is free again, and with ``Queue``/``Replace`` the oldest
parked run is handed it (by the next command on the key or by the sweeper: nobody is stranded). A hold
given back by a run that never ran keeps no minimum."""

from __future__ import annotations

import datetime as _dt
from typing import Any

from celery_mongolock import LeaseStore
from celery_mongolock.core.documents import slots as slots_docs
from celery_mongolock.testing import wait_for

from .test_admission_store import Handoffs, entry

KEY = "tenant:min-hold"


def doc_of(store: LeaseStore, key: str = KEY) -> dict[str, Any]:
    return store.collection.find_one({"_id": key}) or {}


def hold_of(store: LeaseStore, owner: str) -> dict[str, Any]:
    return next(h for h in doc_of(store).get("hs") or [] if h["o"] == owner)


def end_min_hold(store: LeaseStore, owner: str) -> None:
    """Move the end of ``owner``'s minimum hold into the past (as if its time had passed)."""
    past = _dt.datetime(2000, 1, 1)
    store.collection.update_one(
        {"_id": KEY}, {"$set": {"hs.$[h].x": past, "hs.$[h].m": past}}, array_filters=[{"h.o": owner}]
    )


def test_a_slot_released_inside_its_minimum_hold_stays_taken_until_then(store: LeaseStore) -> None:
    a = store.acquire(KEY, 30, limit=2, min_hold=60)
    b = store.acquire(KEY, 30, limit=2, min_hold=60)
    assert a is not None and b is not None
    h = hold_of(store, a.owner)
    assert "m" in h and "rl" not in h
    assert a.release()
    # The slot stays taken: released, expiring at its minimum hold's end, never renewed again.
    kept = hold_of(store, a.owner)
    assert kept["rl"] is True and kept["x"] == kept["m"] == h["m"]
    assert store.acquire(KEY, 30, limit=2) is None
    info = store.inspect(KEY)
    assert info is not None and info.full
    renewed = store.collection.update_many(
        slots_docs.renew_tokens_filter([a.owner]), slots_docs.renew_tokens_pipeline([a.owner])
    )
    assert renewed.modified_count == 0 and hold_of(store, a.owner)["x"] == kept["x"]
    # A second release of it (a retry whose reply was lost) changes nothing: one ending, "released".
    assert store.collection.find_one_and_update(
        {"_id": KEY, "hs.o": a.owner}, slots_docs.slot_release_pipeline([a.owner])
    )
    ends = [e for e in doc_of(store).get("ends") or [] if e["f"] == a.fence]
    assert [e["how"] for e in ends] == ["released"]
    # Once the minimum hold has passed, the slot is free; the hold leaves without a second ending.
    end_min_hold(store, a.owner)
    c = store.acquire(KEY, 30, limit=2)
    assert c is not None and c.slot == a.slot and c.fence > b.fence
    ends = [e for e in doc_of(store).get("ends") or [] if e["f"] == a.fence]
    assert [e["how"] for e in ends] == ["released"]


def test_the_minimum_hold_is_on_the_server_clock_and_ends_by_itself(store: LeaseStore) -> None:
    a = store.acquire(KEY, 30, limit=1 + 1, min_hold=1.5)
    b = store.acquire(KEY, 30, limit=2)
    assert a is not None and b is not None
    assert a.release()
    taken = wait_for(lambda: store.acquire(KEY, 30, limit=2), timeout=30, message="the slot after its hold")
    assert taken is not None and taken.slot == a.slot
    assert a.acquired_at is not None and taken.acquired_at is not None
    assert (taken.acquired_at - a.acquired_at).total_seconds() >= 1.5


def test_a_release_after_the_minimum_hold_frees_the_slot_at_once(store: LeaseStore) -> None:
    a = store.acquire(KEY, 30, limit=1 + 1, min_hold=60)
    b = store.acquire(KEY, 30, limit=2)
    assert a is not None and b is not None
    end_min_hold(store, a.owner)  # (its x too: make it live again, the hold alone has passed)
    store.collection.update_one(
        {"_id": KEY},
        {"$set": {"hs.$[h].x": _dt.datetime(2100, 1, 1)}},
        array_filters=[{"h.o": a.owner}],
    )
    assert a.release()
    assert all(h["o"] != a.owner for h in doc_of(store)["hs"])
    assert store.acquire(KEY, 30, limit=2) is not None


def test_a_slot_given_back_by_a_run_that_never_ran_keeps_no_minimum_hold(store: LeaseStore) -> None:
    a = store.acquire(KEY, 30, limit=2, min_hold=60)
    b = store.acquire(KEY, 30, limit=2, min_hold=60)
    assert a is not None and b is not None
    assert store.give_back(a)
    assert all(h["o"] != a.owner for h in doc_of(store)["hs"])
    assert store.acquire(KEY, 30, limit=2) is not None
    # The same for a single lease: given back, it is free at once.
    single = store.acquire("single:min-hold", 30, min_hold=60)
    assert single is not None and store.give_back(single)
    assert store.acquire("single:min-hold", 30) is not None


def test_a_dead_holder_s_release_leaves_a_slot_its_run_released_inside_the_hold(store: LeaseStore) -> None:
    a = store.acquire(KEY, 30, limit=2, min_hold=60, info={"worker": "w1"})
    b = store.acquire(KEY, 30, limit=2, info={"worker": "w1"})
    assert a is not None and b is not None
    assert a.release()
    assert store.release_held_by(worker="w1") == 1  # b's slot; a's stays until its minimum hold
    owners = [h["o"] for h in doc_of(store)["hs"]]
    assert owners == [a.owner]


def test_queue_a_parked_run_is_handed_the_slot_when_its_minimum_hold_ends(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    held = [store.admit(KEY, entry(s), ttl=30, limit=2, min_hold=60)[0] for s in (1, 2)]
    assert all(lease is not None for lease in held)
    lease, doc = store.admit(KEY, entry(3), ttl=30, limit=2, min_hold=60)
    assert lease is None and doc["lo"] == "parked"
    first = held[0]
    assert first is not None and first.release()
    assert handoffs.tasks == []  # the released slot is kept for its minimum hold: nothing handed
    d = doc_of(store)
    assert [e["t"] for e in d["q"]] == ["task-3"] and d.get("wq") is True
    # The hold ends with nobody releasing anything: the sweeper's command hands the slot over.
    end_min_hold(store, first.owner)
    store.sweep(KEY)
    assert handoffs.tasks == ["task-3"]
    token = handoffs.seen[0][1]["tk"]
    claimed, cdoc = store.admit(KEY, entry(3), ttl=30, limit=2, min_hold=60, claim=token)
    assert claimed is not None and cdoc["lo"] == "claimed" and claimed.slot == first.slot
    assert "m" in hold_of(store, claimed.owner)  # the claim starts the run's own minimum hold
    # A copy of the first run, after its release: over, never run again.
    _, again = store.admit(KEY, entry(1), ttl=30, limit=2, min_hold=60)
    assert again["lo"] == "done"


def test_queue_a_new_admit_after_the_hold_hands_the_slot_to_the_oldest_parked_run(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    held = [store.admit(KEY, entry(s), ttl=30, limit=2, min_hold=60)[0] for s in (1, 2)]
    assert all(lease is not None for lease in held)
    assert store.admit(KEY, entry(3), ttl=30, limit=2, min_hold=60)[1]["lo"] == "parked"
    first = held[0]
    assert first is not None and first.release()
    end_min_hold(store, first.owner)
    lease, doc = store.admit(KEY, entry(4), ttl=30, limit=2, min_hold=60)
    assert lease is None and doc["lo"] == "parked"  # behind task-3, which is handed the slot
    assert handoffs.tasks == ["task-3"]


def test_the_heartbeat_stops_renewing_a_released_hold(store: LeaseStore) -> None:
    lease = store.acquire(KEY, 2.0, limit=2, min_hold=60, heartbeat=True)
    assert lease is not None
    assert lease.release()
    before = hold_of(store, lease.owner)["x"]
    # Another lease of this process keeps the heartbeat ticking; the released hold is left alone.
    other = store.acquire(KEY, 2.0, limit=2, heartbeat=True)
    assert other is not None
    first_x = hold_of(store, other.owner)["x"]
    wait_for(lambda: hold_of(store, other.owner)["x"] > first_x, timeout=30, message="a renewal")
    assert hold_of(store, lease.owner)["x"] == before
    other.release()
