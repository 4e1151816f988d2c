"""``limit=N`` with Queue and Replace in the lease store, on the embedded server: runs park while all N
slots are held, each freed slot goes to the oldest parked run in the same command, the handed run claims
its slot, fences strictly increase over all slots, and expiry, revoke, a dead holder and an operator's
release all hand on."""

from __future__ import annotations

import datetime as _dt
from typing import Any

import pytest

from celery_mongolock import Lease, LeaseLost, LeaseStore

from .test_admission_store import Handoffs, entry

KEY = "tenant:7"
N = 3


def doc_of(store: LeaseStore, key: str = KEY) -> dict[str, Any]:
    return store.collection.find_one({"_id": key}) or {}


def fill(store: LeaseStore) -> list[Lease]:
    """Take all N slots (runs stamped 1..N)."""
    leases = [store.admit(KEY, entry(s), ttl=30, limit=N)[0] for s in range(1, N + 1)]
    taken = [lease for lease in leases if lease is not None]
    assert len(taken) == N
    return taken


def expire(store: LeaseStore, owner: str) -> None:
    """End the hold of ``owner`` on the server's clock, as if its holder had stopped renewing it."""
    store.collection.update_one(
        {"_id": KEY}, {"$set": {"hs.$[h].x": _dt.datetime(2000, 1, 1)}}, array_filters=[{"h.o": owner}]
    )


def parked(store: LeaseStore, key: str = KEY) -> list[str]:
    return [e["t"] for e in doc_of(store, key).get("q") or []]


def admit(store: LeaseStore, stamp: int, task_id: str | None = None, **kw: Any) -> tuple[Any, dict[str, Any]]:
    return store.admit(KEY, entry(stamp, task_id), ttl=30, limit=N, **kw)


def test_runs_take_free_slots_then_park_in_send_order_and_each_release_hands_a_slot(
    store: LeaseStore,
) -> None:
    handoffs = Handoffs(store)
    held = []
    for stamp in (1, 2, 3):
        lease, doc = admit(store, stamp)
        assert lease is not None and doc["lo"] == "acquired", doc.get("lo")
        held.append(lease)
    assert sorted(lease.slot for lease in held) == [0, 1, 2]
    assert [lease.fence for lease in held] == sorted({lease.fence for lease in held})  # strictly up
    for stamp in (30, 10, 20):
        lease, doc = admit(store, stamp)
        assert lease is None and doc["lo"] == "parked"
    assert parked(store) == ["task-10", "task-20", "task-30"]
    assert handoffs.tasks == []

    middle = held[1]
    assert middle.release()
    assert handoffs.tasks == ["task-10"]
    ho = handoffs.seen[0][1]
    assert ho["m"] == b"msg" and ho["hn"] == 1
    d = doc_of(store)
    handed = [h for h in d["hs"] if h.get("ho")]
    assert len(handed) == 1 and handed[0]["s"] == middle.slot and handed[0]["o"] == ho["tk"]
    assert handed[0]["f"] > max(lease.fence for lease in held)
    assert parked(store) == ["task-20", "task-30"]

    # The handed slot counts: nobody else gets a slot, and a newcomer parks behind.
    lease, doc = admit(store, 5, "newcomer")
    assert lease is None and doc["lo"] == "parked"
    assert store.acquire(KEY, 30, limit=N) is None

    # The handed run claims its slot and keeps the handoff's fence; a copy does not run twice.
    claimed, doc = admit(store, 10, claim=ho["tk"])
    assert claimed is not None and doc["lo"] == "claimed"
    assert claimed.slot == middle.slot and claimed.fence == handed[0]["f"]
    assert not [h for h in doc_of(store)["hs"] if h.get("ho")]
    _, doc = admit(store, 10, claim=ho["tk"])
    assert doc["lo"] == "running"
    _, doc = admit(store, 20)
    assert doc["lo"] == "dup"

    # Two releases hand two slots, oldest first (the newcomer's stamp 5 is the oldest now).
    held[0].release()
    held[2].release()
    assert handoffs.tasks == ["task-10", "newcomer", "task-20"]
    assert parked(store) == ["task-30"]
    fences = sorted(h["f"] for h in doc_of(store)["hs"])
    assert len(set(fences)) == N
    claimed.release()
    assert handoffs.tasks[-1] == "task-30"
    _, doc = admit(store, 10)
    assert doc["lo"] == "done"  # a late copy of a run that ran and released


def test_a_release_with_free_slots_and_nobody_parked_hands_nothing(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    lease, _ = admit(store, 1)
    assert lease is not None
    assert lease.release()
    assert handoffs.tasks == []
    assert doc_of(store)["hs"] == []


def test_an_unclaimed_slot_handoff_is_handed_again_after_expiry_and_not_lost(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    leases = fill(store)
    admit(store, 10)
    leases[0].release()
    assert handoffs.tasks == ["task-10"]
    tk = handoffs.seen[0][1]["tk"]
    # Nobody claims it; a plain acquire never drops it even once expired; the sweeper hands it again.
    expire(store, tk)
    assert store.acquire(KEY, 30, limit=N) is None
    assert [h for h in doc_of(store)["hs"] if h.get("o") == tk]
    store.sweep(KEY)
    assert handoffs.tasks == ["task-10", "task-10"]
    assert handoffs.seen[1][1]["hn"] == 2 and handoffs.seen[1][1]["tk"] == tk
    claimed, doc = store.admit(KEY, entry(10), ttl=30, limit=N, claim=tk)
    assert claimed is not None and doc["lo"] == "claimed"


def test_an_expired_hold_found_by_an_admit_hands_its_slot_to_the_oldest(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    leases = fill(store)
    admit(store, 10)
    # Expire slot 0's hold on the server (as if its holder died silently).
    expire(store, leases[0].owner)
    lease, doc = admit(store, 20)
    assert lease is None and doc["lo"] == "parked"
    assert handoffs.tasks == ["task-10"]  # the admit that found the expired hold handed its slot
    assert [e["how"] for e in doc_of(store)["ends"]] == ["expired"]
    with pytest.raises(LeaseLost):
        leases[0].renew()


def test_a_dead_holders_slot_and_an_operators_release_hand_on(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    a = store.admit(KEY, entry(1), ttl=30, limit=N, info={"pid": 4242})[0]
    b = store.admit(KEY, entry(2), ttl=30, limit=N)[0]
    c = store.admit(KEY, entry(3), ttl=30, limit=N)[0]
    assert a and b and c
    for stamp in (10, 20, 30, 40):
        admit(store, stamp)
    assert store.release_held_by(task_id="task-1", pid=4242) == 1
    assert handoffs.tasks == ["task-10"]
    assert store.force_release(KEY)
    # The two held slots were freed and handed; the pending handoff to task-10 stays handed.
    assert handoffs.tasks == ["task-10", "task-20", "task-30"]
    assert parked(store) == ["task-40"]
    assert len(doc_of(store)["hs"]) == N


def test_revoke_of_a_parked_or_handed_run_frees_its_place(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    leases = fill(store)
    for stamp in (10, 20, 30):
        admit(store, stamp)
    leases[0].release()
    assert handoffs.tasks == ["task-10"]
    store.sweep(KEY, revoked={"task-10", "task-20"})
    # task-10's slot was handed to it, then freed by the revoke: it goes to task-30 (task-20 is gone).
    assert handoffs.tasks == ["task-10", "task-30"]
    assert parked(store) == []


def test_replace_with_a_limit_keeps_one_parked_run_and_supersedes_older_sends(store: LeaseStore) -> None:
    Handoffs(store)
    for stamp in (1, 2, 3):
        assert admit(store, stamp, replace=True)[0] is not None
    assert admit(store, 10, replace=True)[1]["lo"] == "parked"
    _, doc = admit(store, 20, replace=True)
    assert doc["lo"] == "parked"
    assert parked(store) == ["task-20"]
    assert [s["t"] for s in doc_of(store)["sup"]] == ["task-10"]
    _, doc = admit(store, 15, replace=True)
    assert doc["lo"] == "superseded" and doc["lo_by"] == "task-20"


def test_max_length_with_a_limit_refuses_beyond_it(store: LeaseStore) -> None:
    for stamp in (1, 2, 3):
        assert admit(store, stamp)[0] is not None
    assert admit(store, 10, max_length=1)[1]["lo"] == "parked"
    assert admit(store, 20, max_length=1)[1]["lo"] == "full"


def test_replace_with_debounce_and_a_limit_starts_the_last_send_once_due(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    lease, doc = admit(store, 10, replace=True, debounce=30)
    assert lease is None and doc["lo"] == "parked"  # a free slot, but it waits out its debounce
    assert handoffs.tasks == []  # not handed before it is due
    _, doc = admit(store, 20, replace=True, debounce=30)
    assert doc["lo"] == "parked" and parked(store) == ["task-20"]
    early, doc = admit(store, 20, replace=True, debounce=30, due=True)
    assert early is None  # its delayed copy came back before the debounce ended
    store.collection.update_one({"_id": KEY}, {"$set": {"q.0.nb": _dt.datetime(2000, 1, 1)}})
    lease, doc = admit(store, 20, replace=True, debounce=30, due=True)
    assert lease is not None and doc["lo"] == "due"
    assert parked(store) == []
    _, doc = admit(store, 10, replace=True, debounce=30, due=True)
    assert doc["lo"] == "superseded"


def test_a_stale_copy_of_an_attempt_whose_body_retried_takes_no_slot(store: LeaseStore) -> None:
    """Seed 23's window on a ``limit=N`` key: a copy of attempt 0 (a stale handoff message, with its
    claim, or re-admitted without it) while attempt 1 of its task is parked, handed a slot, holding one
    or over is ``retried``, never parked or given a slot (it would run attempt 0's body again)."""
    first = entry(5, "run")
    retry = {**first, "id": "run/1.0", "r": "1.0"}
    held = fill(store)
    _, doc = store.admit(KEY, retry, ttl=30, limit=N)
    assert doc["lo"] == "parked"

    def copy_outcomes() -> set[str]:
        return {
            str(store.admit(KEY, first, ttl=30, limit=N, claim=c)[1]["lo"]) for c in ("an-old-token", None)
        }

    assert copy_outcomes() == {"retried"}  # parked
    handoffs = Handoffs(store)
    held[0].release()
    assert handoffs.tasks == ["run"]
    assert copy_outcomes() == {"retried"}  # handed a slot
    lease, _ = store.admit(KEY, retry, ttl=30, limit=N, claim=handoffs.seen[0][1]["tk"])
    assert lease is not None
    assert copy_outcomes() == {"retried"}  # holding it
    lease.release()
    assert copy_outcomes() == {"retried"}  # over
    assert parked(store) == []
    for other in held[1:]:
        other.release()


def test_a_bare_clients_release_hands_its_slot_unpublished_and_a_newcomer_takes_another(
    store: LeaseStore, make_store: Any
) -> None:
    """The shape of two soaks' ``barged`` reports (Redis, bounded, loaded): a run parks on a full key; a
    release with nobody publishing (a bare client's process: no handoff callback) hands its slot to the
    run, unmarked and unpublished; a newcomer then takes a slot freed later; the run's first *published*
    handoff is attempt 2, after its unpublished one expired. The run was handed its slot first (a smaller
    fence): nobody took a slot while it waited in the queue."""
    worker = store  # publishes handoffs
    handoffs = Handoffs(worker)
    client, newcomer = make_store(), make_store()  # bare clients: no handoff callback
    bare = client.acquire(KEY, 30, limit=N)
    assert bare is not None
    others = [admit(worker, s)[0] for s in (1, 2)]
    assert all(lease is not None for lease in others)
    lease, doc = admit(worker, 10)
    assert lease is None and doc["lo"] == "parked"

    assert bare.release()  # hands its slot to task-10, unmarked: nobody published it
    assert handoffs.tasks == [] and parked(worker) == []
    first = next(h for h in doc_of(worker)["hs"] if h.get("ho"))
    assert first["ho"]["t"] == "task-10" and first["ho"]["hn"] == 1 and first["ho"]["by"] == ""

    assert others[0] is not None and others[0].release()  # nobody parked: the slot stays free
    taken = newcomer.acquire(KEY, 30, limit=N)
    assert taken is not None and taken.fence > first["f"]  # the run got its slot before the newcomer

    expire(worker, first["o"])  # nobody claimed it (no sweeper passed before it expired)
    worker.sweep(KEY)
    assert handoffs.tasks == ["task-10"] and handoffs.seen[0][1]["hn"] == 2
