"""Several keys per run under Queue with a limit per key (``keys=`` + ``limit={...}``), in the lease store
on the embedded server: a run that got a slot of a ``limit=N`` key in an attempt that must wait keeps it
as a reservation (a slot handed to its entry, counted against the limit), is ready once every key is
reserved for it, claims them all with one token (the slot with its fence), and an expired slot
reservation goes back in send order, so that an older run is handed the slot first (no deadlock)."""

from __future__ import annotations

import datetime as _dt
from typing import Any

from celery_mongolock import LeaseStore

from .test_admission_store import Handoffs

T, G = "tenant:t", "group:g"  # T has 2 slots, G is a single lease
N = 2


def multi(stamp: int, task_id: str | None = None) -> dict[str, Any]:
    tid = task_id or f"upload-{stamp}"
    return {
        "id": f"{tid}/0", "t": tid, "n": "upload", "r": "0", "s": stamp, "m": b"msg", "ks": [G, T],
        "tk": f"tk-{tid}",
    }  # fmt: skip


def doc_of(store: LeaseStore, key: str) -> dict[str, Any]:
    return store.collection.find_one({"_id": key}) or {}


def parked(store: LeaseStore, key: str) -> list[str]:
    return [e["t"] for e in doc_of(store, key).get("q") or []]


def reserved_slots(store: LeaseStore) -> list[str]:
    return [h["ho"]["t"] for h in doc_of(store, T).get("hs") or [] if h.get("ho")]


def wait_on_g(store: LeaseStore, entry: dict[str, Any]) -> int:
    """The run's attempt: a slot of T is free (taken, then reserved), G is held (parked). Its slot."""
    _, doc = store.admit(G, entry, ttl=30)
    assert doc["lo"] == "parked"
    lease, doc = store.admit(T, entry, ttl=30, limit=N)
    assert lease is not None and lease.slot is not None, doc.get("lo")
    assert store.reserve(lease, entry)
    assert lease.released
    return lease.slot


def test_a_slot_is_reserved_counted_against_the_limit_and_claimed_with_its_fence(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    blocker = store.acquire(G, 30)
    assert blocker is not None
    e = multi(10)
    slot = wait_on_g(store, e)
    hold = next(h for h in doc_of(store, T)["hs"] if h.get("ho"))
    assert hold["o"] == e["tk"] and hold["s"] == slot and hold["ho"]["ks"] == [G, T]
    assert store.keys_state(e) == "waiting" and not store.reserved_for_all(e)
    # The reserved slot counts: one slot left; a plain acquire takes it, the next finds T full.
    other = store.acquire(T, 30, limit=N)
    assert other is not None and store.acquire(T, 30, limit=N) is None
    _, doc = store.admit(T, {"id": "late/0", "t": "late", "s": 5, "m": b"m"}, ttl=30, limit=N)
    assert doc["lo"] == "parked"

    blocker.release()
    assert handoffs.tasks == ["upload-10"]  # G handed to it; ready now
    assert store.reserved_for_all(e)
    fence_t = hold["f"]
    lg, doc = store.admit(G, e, ttl=30, claim=e["tk"])
    assert lg is not None and doc["lo"] == "claimed"
    lt, doc = store.admit(T, e, ttl=30, claim=e["tk"], limit=N)
    assert lt is not None and doc["lo"] == "claimed" and lt.slot == slot and lt.fence == fence_t
    lt.release()
    assert handoffs.tasks == ["upload-10", "late"]  # its slot goes on to the run that waited behind
    lg.release()
    other.release()


def test_an_expired_slot_reservation_goes_back_in_send_order(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    blocker = store.acquire(G, 30)
    holder = store.acquire(T, 30, limit=N)
    assert blocker is not None and holder is not None
    younger, older = multi(20), multi(10)
    wait_on_g(store, younger)  # reserves T's other slot, parks on G
    # The older run's message arrives late: T is full (a holder, the younger one's reservation), so
    # it parks there; on G it parks ahead of the younger one (send order).
    _, doc = store.admit(G, older, ttl=30)
    assert doc["lo"] == "parked"
    _, doc = store.admit(T, older, ttl=30, limit=N)
    assert doc["lo"] == "parked"
    assert parked(store, G) == ["upload-10", "upload-20"]
    blocker.release()
    assert handoffs.tasks == ["upload-10"]
    assert not store.reserved_for_all(older) and not store.reserved_for_all(younger)
    # The younger one's slot reservation expires; the sweep hands it again in send order: to the older.
    store.collection.update_one(
        {"_id": T}, {"$set": {"hs.$[h].x": _dt.datetime(2000, 1, 1)}}, array_filters=[{"h.o": younger["tk"]}]
    )
    store.sweep(T)
    assert handoffs.tasks == ["upload-10", "upload-10"]
    assert store.reserved_for_all(older)
    assert parked(store, T) == ["upload-20"]  # the younger one keeps its place, next in line
    assert reserved_slots(store) == ["upload-10"]


def test_a_single_key_run_handed_a_slot_that_expired_keeps_the_front(store: LeaseStore) -> None:
    """(Unchanged: a slot handed to a run of one key goes back first when it expires unclaimed.)"""
    handoffs = Handoffs(store)
    holders = [store.acquire(T, 30, limit=N) for _ in range(N)]
    assert all(h is not None for h in holders)
    for stamp in (20, 10):
        _, doc = store.admit(
            T, {"id": f"r{stamp}/0", "t": f"r{stamp}", "s": stamp, "m": b"m"}, ttl=30, limit=N
        )
        assert doc["lo"] == "parked"
    first = holders[0]
    assert first is not None and first.release()
    assert handoffs.tasks == ["r10"]
    store.admit(T, {"id": "r5/0", "t": "r5", "s": 5, "m": b"m"}, ttl=30, limit=N)  # an older one, late
    store.collection.update_one(
        {"_id": T}, {"$set": {"hs.$[h].x": _dt.datetime(2000, 1, 1)}}, array_filters=[{"h.ho.t": "r10"}]
    )
    store.sweep(T)
    assert handoffs.tasks[-1] == "r10"


def test_unpark_drops_a_slot_reservation_and_hands_the_slot_on(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    blocker = store.acquire(G, 30)
    holder = store.acquire(T, 30, limit=N)
    assert blocker is not None and holder is not None
    e = multi(10)
    wait_on_g(store, e)
    _, doc = store.admit(T, {"id": "late/0", "t": "late", "s": 50, "m": b"m"}, ttl=30, limit=N)
    assert doc["lo"] == "parked"
    store.unpark(T, e["id"])  # the run is revoked, or left its places (a full queue elsewhere)
    assert reserved_slots(store) == ["late"] and handoffs.tasks == ["late"]
    assert parked(store, G) == ["upload-10"] and store.keys_state(e) == "missing"  # (gone from T)


def _lapse_slot(store: LeaseStore, token: str) -> None:
    """The slot reserved with ``token`` lapsed a second ago, on the server's clock."""
    lapsed = {
        "$map": {
            "input": "$hs",
            "as": "h",
            "in": {
                "$cond": [
                    {"$eq": ["$$h.o", token]},
                    {"$mergeObjects": ["$$h", {"x": {"$subtract": ["$$NOW", 1000]}}]},
                    "$$h",
                ]
            },
        }
    }
    store.collection.update_one({"_id": T}, [{"$set": {"hs": lapsed}}])


def test_a_lone_slot_reservation_is_left_after_its_first_lapse_and_still_claimed(store: LeaseStore) -> None:
    """A run reserved a slot of T and waits for G. After its first lapse (handed again), a lapsed slot
    reservation that nobody waits behind is left alone by the sweeper, and its run claims it once G comes."""
    handoffs = Handoffs(store)
    blocker = store.acquire(G, 30)
    assert blocker is not None
    e = multi(10)
    slot = wait_on_g(store, e)
    _lapse_slot(store, e["tk"])
    (one,) = [w for w in store.waiting() if w.key == T]
    assert one.needs_sweep
    store.sweep(T)
    assert reserved_slots(store) == ["upload-10"]
    _lapse_slot(store, e["tk"])
    (one,) = [w for w in store.waiting() if w.key == T]
    assert not one.needs_sweep
    blocker.release()
    assert handoffs.tasks[-1] == "upload-10" and store.reserved_for_all(e)
    lg, doc = store.admit(G, e, ttl=30, claim=e["tk"])
    assert lg is not None and doc["lo"] == "claimed"
    lt, doc = store.admit(T, e, ttl=30, claim=e["tk"], limit=N)
    assert lt is not None and doc["lo"] == "claimed" and lt.slot == slot
    lt.release()
    lg.release()
