"""``Replace`` with ``keys=`` and a limit per key (``keys=("tenant:{tenant}", "group:{group}"),
limit={"tenant:{tenant}": N}``) in the lease store, on the embedded server (no Celery): on the key with
slots, a newer send of a set supersedes the older runs of that set parked there, takes back the slots
reserved or handed to them (handed on in the same command), and a slot an older run holds is never
reserved for it once a newer send of its set is known there (``core.documents.slot_sets``). Runs of
other sets keep their place and their slots, as under ``Queue``. Each admit below is what
``QueuedRun`` sends, key by key in sorted order."""

from __future__ import annotations

import time
from typing import Any

from celery_mongolock import LeaseStore
from celery_mongolock.core.documents.sets import set_signature

from .test_admission_store import Handoffs

T, G1, G2 = "rkl:tenant", "rkl:g1", "rkl:g2"  # T has N slots, G1 and G2 are single leases
N = 2


def run(stamp: int, group: str = G1, task_id: str | None = None) -> dict[str, Any]:
    tid = task_id or f"r{stamp}"
    ks = sorted([T, group])
    return {
        "id": f"{tid}/0", "t": tid, "n": "upload", "r": "0", "s": stamp, "m": b"msg", "ks": ks,
        "g": set_signature(ks), "tk": f"tk-{tid}",
    }  # fmt: skip


def admit(
    store: LeaseStore, key: str, e: dict[str, Any], claim: str | None = None, ttl: float = 30
) -> tuple[Any, dict[str, Any]]:
    info = {"task_id": e["t"], "delivery": e["r"], "keys": e["ks"]}
    return store.admit(
        key, e, ttl=ttl, claim=claim, replace=True, group=e["g"], info=info, limit=N if key == T else None
    )


def doc_of(store: LeaseStore, key: str) -> dict[str, Any]:
    return store.collection.find_one({"_id": key}) or {}


def parked(store: LeaseStore, key: str) -> list[str]:
    return [e["t"] for e in doc_of(store, key).get("q") or []]


def slots_for(store: LeaseStore) -> list[str]:
    """The runs T's slots are reserved or handed to (not yet claimed)."""
    return sorted(h["ho"]["t"] for h in doc_of(store, T).get("hs") or [] if h.get("ho"))


def superseded(store: LeaseStore, key: str) -> list[tuple[str, str]]:
    return [(s["t"], s["by"]) for s in doc_of(store, key).get("sup") or []]


def reserve_slot(store: LeaseStore, e: dict[str, Any]) -> None:
    """The run's attempt that must wait: it takes a slot of T, then turns it into its reservation."""
    lease, doc = admit(store, T, e)
    assert lease is not None and lease.slot is not None, doc.get("lo")
    assert store.reserve(lease, e)


def test_a_newer_send_supersedes_a_parked_older_run_of_its_set_on_the_slotted_key(store: LeaseStore) -> None:
    holders = [store.acquire(T, 30, limit=N) for _ in range(N)]
    blocker = store.acquire(G1, 30)
    assert all(holders) and blocker is not None
    old, new = run(10), run(20)
    for key in (G1, T):
        assert admit(store, key, old)[1]["lo"] == "parked"
    for key in (G1, T):
        lease, doc = admit(store, key, new)
        assert lease is None and doc["lo"] == "parked"
        assert parked(store, key) == ["r20"]
        assert superseded(store, key) == [("r10", "r20")]
    sup = doc_of(store, T)["sup"][0]
    assert sup["ks"] == sorted([T, G1]) and sup["g"] == old["g"]
    # A late copy of the older send, and an older send delivered late: superseded on the slotted key too.
    _, doc = admit(store, T, old)
    assert doc["lo"] == "superseded" and doc["lo_by"] == "r20"
    _, doc = admit(store, T, run(5))
    assert doc["lo"] == "superseded" and doc["lo_by"] == "r20"
    for h in holders:
        assert h is not None and h.release()
    blocker.release()


def test_a_slot_reserved_for_the_older_run_is_taken_back_and_handed_on_at_once(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    blocker = store.acquire(G1, 30)
    holder = store.acquire(T, 30, limit=N)  # one slot of two held by someone else
    assert blocker is not None and holder is not None
    old, new = run(10), run(20)
    assert admit(store, G1, old)[1]["lo"] == "parked"
    reserve_slot(store, old)  # the older run keeps T's other slot as its reservation
    assert slots_for(store) == ["r10"]
    fence_before = int(doc_of(store, T)["fence"])
    assert admit(store, G1, new)[1]["lo"] == "parked"
    lease, doc = admit(store, T, new)
    # Parked: the older run's reservation is taken back (recorded superseded) and the freed slot is
    # handed, in the same command, to the oldest run parked on T: the newer send.
    assert lease is None and doc["lo"] == "parked"
    assert superseded(store, T) == [("r10", "r20")]
    assert slots_for(store) == ["r20"] and parked(store, T) == []
    assert int(doc_of(store, T)["fence"]) > fence_before
    assert "r20" in handoffs.tasks
    # The older run's claim of T (its handoff, had it been published) is refused: superseded.
    _, doc = admit(store, T, old, claim=old["tk"])
    assert doc["lo"] == "superseded" and doc["lo_by"] == "r20"
    # The newer send gets G1 when the blocker ends, and claims both: it runs.
    blocker.release()
    assert store.reserved_for_all(new)
    lg, doc = admit(store, G1, new, claim=new["tk"])
    lt, doc_t = admit(store, T, new, claim=new["tk"])
    assert lg is not None and lt is not None and doc_t["lo"] == "claimed"
    lg.release()
    lt.release()
    holder.release()


def test_a_slot_held_by_the_older_run_is_not_reserved_for_it_after_a_newer_send_parked(
    store: LeaseStore,
) -> None:
    """The liveness bug of ``Replace`` with ``keys=`` (a reservation made by an older run after a newer
    send of its set parked on that key is never taken back), on the slotted key: the older run took a
    slot (acquired) and parks on G1; the newer send parks on G1 (the older run superseded there) and on
    T (full: the older run's hold is no reservation, nothing to take back). The older run's reserve of
    its slot is then refused and the slot goes on, in the same command, to the newer send."""
    handoffs = Handoffs(store)
    blocker = store.acquire(G1, 30)
    holder = store.acquire(T, 30, limit=N)
    assert blocker is not None and holder is not None
    old, new = run(10), run(20)
    assert admit(store, G1, old)[1]["lo"] == "parked"
    l_old, doc = admit(store, T, old)  # took T's last slot; its attempt must wait (G1 is held)
    assert l_old is not None
    assert admit(store, G1, new)[1]["lo"] == "parked"
    assert superseded(store, G1) == [("r10", "r20")]
    _, doc = admit(store, T, new)
    assert doc["lo"] == "parked" and parked(store, T) == ["r20"]  # T is full: a holder, the older run
    assert not store.reserve(l_old, old)  # refused: a newer send of its set is known on T
    assert slots_for(store) == ["r20"] and parked(store, T) == []
    assert handoffs.tasks[-1] == "r20"
    # What ``_reserve_all`` does next: admits T again, and is told superseded.
    _, doc = admit(store, T, old)
    assert doc["lo"] == "superseded" and doc["lo_by"] == "r20"
    blocker.release()
    assert store.reserved_for_all(new)
    holder.release()


def test_runs_of_another_set_sharing_the_slotted_key_keep_their_place_and_slot(store: LeaseStore) -> None:
    b1, b2 = store.acquire(G1, 30), store.acquire(G2, 30)
    assert b1 is not None and b2 is not None
    a_old, other, a_new = run(10, G1), run(15, G2), run(20, G1)
    assert admit(store, G1, a_old)[1]["lo"] == "parked"
    reserve_slot(store, a_old)
    assert admit(store, G2, other)[1]["lo"] == "parked"
    reserve_slot(store, other)
    assert slots_for(store) == ["r10", "r15"]  # T is full: two reservations
    assert admit(store, G1, a_new)[1]["lo"] == "parked"
    _, doc = admit(store, T, a_new)
    assert doc["lo"] == "parked"
    # Only the older run of its own set lost its slot; the run of the other set keeps its reservation.
    assert superseded(store, T) == [("r10", "r20")]
    assert slots_for(store) == ["r15", "r20"]
    # A send of the other set older than r15 is not superseded by r20 (another set): it parks.
    late = run(12, G2)
    assert admit(store, G2, late)[1]["lo"] == "superseded"  # (on G2: r15 of its own set is newer)
    b1.release()
    b2.release()


def test_a_newer_send_that_takes_a_free_slot_takes_back_the_older_runs_reservation(
    store: LeaseStore,
) -> None:
    """T has room: the newer send takes a slot (it does not park there), and the older run's reservation
    of T is taken back in that same command. Never handed again to the superseded run: at each expiry
    and sweep after, T's handed slots go to the newest send only (no slot kept for nobody)."""
    blocker = store.acquire(G1, 30)
    assert blocker is not None
    old, new = run(10), run(20)
    assert admit(store, G1, old, ttl=1)[1]["lo"] == "parked"
    reserve_slot_ttl = admit(store, T, old, ttl=1)[0]
    assert reserve_slot_ttl is not None and store.reserve(reserve_slot_ttl, old)
    assert admit(store, G1, new, ttl=1)[1]["lo"] == "parked"
    lease, doc = admit(store, T, new, ttl=1)
    assert lease is not None and doc["lo"] == "acquired"
    assert superseded(store, T) == [("r10", "r20")] and slots_for(store) == []
    assert store.reserve(lease, new)  # its attempt must wait for G1: the slot is its reservation
    assert slots_for(store) == ["r20"]
    handed = next(h for h in doc_of(store, T)["hs"] if h.get("ho"))["ho"]["hn"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        store.sweep(T)
        ho = [h for h in doc_of(store, T).get("hs") or [] if h.get("ho")]
        assert [h["ho"]["t"] for h in ho] in ([], ["r20"])
        if ho and ho[0]["ho"]["hn"] > handed:
            break
        time.sleep(0.1)
    assert slots_for(store) == ["r20"] and "r10" not in parked(store, T)
    blocker.release()


def test_the_group_key_held_by_the_older_run_is_not_reserved_for_it_after_a_newer_send_parked(
    store: LeaseStore,
) -> None:
    """The same shape on the group key (a single lease, taken first: sorted order): the older run took it
    and parks for a slot of the full tenant; the newer send parks on the group (held by the older run:
    nothing to take back) and on the tenant (the older run superseded there). The older run's reserve of
    the group must then be refused, the group handed to the newer send."""
    holders = [store.acquire(T, 30, limit=N) for _ in range(N)]
    assert all(holders)
    old, new = run(10), run(20)
    l_old, _ = admit(store, G1, old)
    assert l_old is not None
    assert admit(store, T, old)[1]["lo"] == "parked"
    assert admit(store, G1, new)[1]["lo"] == "parked"
    assert admit(store, T, new)[1]["lo"] == "parked"
    assert superseded(store, T) == [("r10", "r20")]
    assert not store.reserve(l_old, old)
    assert (doc_of(store, G1).get("ho") or {}).get("t") == "r20"
    for h in holders:
        assert h is not None
        h.release()


def test_runs_of_another_burst_keep_their_place_on_the_slotted_key(store: LeaseStore) -> None:
    """``Replace(debounce=..., max_wait=...)``: runs of one set that know different bursts (the older one
    sealed by its ceiling on another key, ``sets.in_burst``) do not supersede each other on the slotted
    key, and neither is dropped from its queue (review: the newer one's park removed the older one's entry,
    with no record)."""
    holders = [store.acquire(T, 30, limit=N) for _ in range(N)]
    assert all(holders)
    sealed, newer = {**run(10), "bu": 1_000}, {**run(20), "bu": 2_000}

    def park(e: dict[str, Any]) -> dict[str, Any]:
        _, doc = store.admit(
            T, e, ttl=30, replace=True, group=e["g"], limit=N, debounce=30, max_wait=60,
            info={"task_id": e["t"], "delivery": e["r"], "keys": e["ks"]},
        )  # fmt: skip
        return doc

    assert park(sealed)["lo"] == "parked"
    assert park(newer)["lo"] == "parked"
    assert parked(store, T) == ["r10", "r20"] and superseded(store, T) == []
    assert park({**run(30), "bu": 2_000})["lo"] == "parked"  # of the newer one's burst: supersedes it
    assert parked(store, T) == ["r10", "r30"] and superseded(store, T) == [("r20", "r30")]


def test_a_run_of_the_set_sent_at_the_same_stamp_is_never_dropped_unrecorded(store: LeaseStore) -> None:
    """Two sends of one set at the same stamp: neither is newer, and the one whose id sorts later is not
    older either (ties go by the entry's id). A run parked at that stamp must keep its place, or be
    recorded superseded; the slotted key's park dropped every parked run of the set, recording only the
    older ones (found by the model test, seed 13: ``r9`` vanished when ``r10`` parked)."""
    holders = [store.acquire(T, 30, limit=N) for _ in range(N)]
    assert all(holders)
    later_id, earlier_id = run(5, task_id="r9"), run(5, task_id="r10")  # "r10/0" < "r9/0"
    assert admit(store, T, later_id)[1]["lo"] == "parked"
    assert admit(store, T, earlier_id)[1]["lo"] == "parked"
    recorded = {t for t, _ in superseded(store, T)}
    assert {"r9", "r10"} <= set(parked(store, T)) | recorded
    assert parked(store, T) == ["r10", "r9"] and not recorded  # the tie-break's order: both run
    # The key hands them on in that order as the slots come free (the handoff is published in the release's
    # own command, so it is seen when the release returns).
    handed = Handoffs(store)
    for lease in holders:
        assert lease is not None and lease.release()
    assert handed.tasks == ["r10", "r9"]
