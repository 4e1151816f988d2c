"""``Replace(debounce=d, max_wait=m)`` with ``keys=`` where the keys have limits
(``limit={"tenant:{t}": 2, "group:{g}": 2}``), in the lease store on the embedded server (no Celery).

On a key with slots, a run of a set parks with its not-before time as on a key without (``nb``; with
``max_wait``, its burst's first wait ``fw`` and its burst ``bu``), so a free slot is not handed to it
before its debounce has passed. Before, the entry of a set parked on a key with a limit had no ``nb``:
a set whose keys all had limits was handed its slots at once, and the debounce was ignored. The seal of
the ceiling (``test_replace_max_wait``) and the burst carried on by a run that leaves unrun hold on such
keys too. Each admit below is what ``QueuedRun`` sends, key by key in sorted order."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from celery_mongolock import LeaseStore
from celery_mongolock.core.outcomes import Admission

from .servers import server_past, wait_for
from .test_replace_keys_store import run

X, Y = "rkd:x", "rkd:y"  # both keys have N slots
N = 2


def doc_of(store: LeaseStore, key: str) -> dict[str, Any]:
    return store.collection.find_one({"_id": key}) or {}


def parked_entries(store: LeaseStore, key: str) -> list[dict[str, Any]]:
    return [dict(e) for e in doc_of(store, key).get("q") or []]


def handed(store: LeaseStore, key: str) -> list[str]:
    """The runs the key's slots are handed or reserved to (not yet claimed)."""
    return sorted(h["ho"]["t"] for h in doc_of(store, key).get("hs") or [] if h.get("ho"))


def admit(
    store: LeaseStore, key: str, r: dict[str, Any], *, max_wait: float | None = 2, claim: str | None = None
) -> tuple[Any, dict[str, Any]]:
    """Admit run ``r`` on ``key`` as ``QueuedRun`` does: the burst it learns goes with its next admits."""
    info = {"task_id": r["t"], "delivery": r["r"], "keys": r["ks"]}
    lease, doc = store.admit(
        key, r, ttl=30, claim=claim, replace=True, group=r["g"], info=info, limit=N,
        debounce=30, max_wait=max_wait,
    )  # fmt: skip
    burst = Admission.of(lease, doc).burst_of(r["id"])
    if burst is not None:
        r.setdefault("bu", burst)
    return lease, doc


@pytest.mark.parametrize("max_wait", [None, 2])
def test_a_free_slot_is_not_handed_before_the_debounce_has_passed(
    store: LeaseStore, max_wait: float | None
) -> None:
    r = run(10, [X, Y])
    for key in (X, Y):
        lease, doc = admit(store, key, r, max_wait=max_wait)
        assert lease is None and doc["lo"] == "parked"
        (e,) = parked_entries(store, key)
        assert e["t"] == "r10" and "nb" in e
        assert handed(store, key) == []  # both slots free, none handed: it waits its debounce
        due_in = Admission.of(None, doc).due_in("r10")
        # (with max_wait, on its second key: the ceiling of the burst it began on the first)
        assert due_in is not None and 0 < due_in <= (30 if max_wait is None else 2)


def test_a_newer_send_keeps_the_bursts_first_wait_and_burst_on_each_key(store: LeaseStore) -> None:
    old, new = run(10, [X, Y]), run(20, [X, Y])
    for r in (old, new):
        for key in (X, Y):
            assert admit(store, key, r)[1]["lo"] == "parked"
    assert new["bu"] == old["bu"]
    for key in (X, Y):
        (e,) = parked_entries(store, key)
        assert e["t"] == "r20" and e["bu"] == old["bu"]
        assert e["fw"] < e["at"]  # the older send's
        assert (e["nb"] - e["fw"]).total_seconds() == pytest.approx(2, abs=0.01)
        assert [(s["t"], s["by"]) for s in doc_of(store, key)["sup"]] == [("r10", "r20")]


def test_at_its_due_time_the_run_is_handed_a_slot_of_each_key(store: LeaseStore) -> None:
    r = run(10, [X, Y])
    for key in (X, Y):
        admit(store, key, r)
    due = max(parked_entries(store, key)[0]["nb"] for key in (X, Y))
    wait_for(lambda: server_past(store, due), timeout=30, message="the run's due time passed")
    for key in (X, Y):  # its delayed copy's admits
        info = {"task_id": r["t"], "delivery": r["r"], "keys": r["ks"]}
        lease, doc = store.admit(
            key, r, ttl=30, replace=True, group=r["g"], info=info, limit=N, debounce=30, max_wait=2, due=True
        )
        assert lease is not None and lease.slot is not None, doc.get("lo")
        assert doc["lo"] == "due"


def test_the_run_the_ceiling_chose_keeps_its_slot_where_a_newer_send_came_first(store: LeaseStore) -> None:
    """The leapfrog on keys with slots (``test_replace_max_wait`` has it on single leases): the run
    handed a slot of the first key by its burst's ceiling is not superseded on the second key by a newer
    send that reached it first, which began a burst of its own (the seal)."""
    first, older, newer = run(10, [X, Y]), run(20, [X, Y]), run(30, [X, Y])
    for key in (X, Y):
        assert admit(store, key, first)[1]["lo"] == "parked"
    ceiling = parked_entries(store, Y)[0]["nb"]
    wait_for(lambda: server_past(store, ceiling), timeout=30, message="the burst's ceiling passed")
    admit(store, X, older)  # past the ceiling: handed a slot of X at once
    assert handed(store, X) == ["r20"]
    admit(store, X, newer)  # does not know its burst: leaves the ceiling's run its slot
    assert handed(store, X) == ["r20"]
    assert [e["t"] for e in parked_entries(store, X)] == ["r30"]
    assert newer["bu"] > older["bu"] == first["bu"]  # a burst of its own
    assert admit(store, Y, newer)[1]["lo"] == "parked"  # not its burst: the first send keeps its place
    _, doc = admit(store, Y, older)
    assert doc["lo"] != "superseded", doc.get("lo_by")
    assert handed(store, Y) == ["r20"]
    assert store.reserved_for_all(older)
    assert [e["t"] for e in parked_entries(store, Y)] == ["r30"]


def test_a_run_that_leaves_a_slot_unrun_passes_its_burst_on(store: LeaseStore) -> None:
    """The run handed a slot by the ceiling leaves it unrun (``QueuedRun`` told it superseded on the
    other key): the newer send of its set parked behind it continues the older burst, so it is due at
    once and handed the slot in the same command (not a whole new ceiling later)."""
    first, older, newer = run(10, [X, Y]), run(20, [X, Y]), run(30, [X, Y])
    for key in (X, Y):
        admit(store, key, first)
    ceiling = parked_entries(store, Y)[0]["nb"]
    wait_for(lambda: server_past(store, ceiling), timeout=30, message="the burst's ceiling passed")
    admit(store, X, older)
    admit(store, X, newer)
    assert handed(store, X) == ["r20"] and [e["t"] for e in parked_entries(store, X)] == ["r30"]
    store.unpark(X, older["id"])
    assert handed(store, X) == ["r30"]
    assert parked_entries(store, X) == []


def test_a_newer_burst_waits_until_the_ceilings_run_claimed_its_slot(store: LeaseStore) -> None:
    """The checker's ``replace-order`` (RabbitMQ, seed 1; docs/known-issues.md): the run the ceiling chose
    (sealed) is handed a slot of the first key and has not claimed it yet; a newer send of its set, of a
    burst of its own, reaches its ceiling too. On a single lease it would wait for the older run; on a
    key with slots a free slot was handed to it at once, and when the older run's handoff ran out and it
    was handed a slot again, its turn came after the newer one's. Now the newer run waits, on every key,
    until the older run of its set has claimed its slot (or left the key)."""
    first, older, newer = run(10, [X, Y]), run(20, [X, Y]), run(30, [X, Y])
    for key in (X, Y):
        admit(store, key, first)
    ceiling = parked_entries(store, Y)[0]["nb"]
    wait_for(lambda: server_past(store, ceiling), timeout=30, message="the first burst's ceiling passed")
    admit(store, X, older)  # past the ceiling: handed a slot of X at once (sealed)
    assert handed(store, X) == ["r20"]
    admit(store, X, newer)  # a burst of its own, parked behind
    assert [e["t"] for e in parked_entries(store, X)] == ["r30"]
    due = parked_entries(store, X)[0]["nb"]
    wait_for(lambda: server_past(store, due), timeout=30, message="the newer burst's ceiling passed")
    info = {"task_id": newer["t"], "delivery": newer["r"], "keys": newer["ks"]}
    lease, doc = store.admit(
        X, newer, ttl=30, replace=True, group=newer["g"], info=info, limit=N, debounce=30, max_wait=2,
        due=True,
    )  # fmt: skip
    assert lease is None, doc.get("lo")  # its delayed copy: not before the older run of its set
    assert handed(store, X) == ["r20"]
    store.sweep(X)  # nor by a command that hands free slots
    assert handed(store, X) == ["r20"]
    # The older run claims its slot (it runs): the newer one waits for it to end, as behind a single
    # lease (review: a slot the older run took but had not yet made its own on every key could come
    # back to it after the newer one's), then is handed a slot in the command that releases it.
    (hold,) = [h for h in doc_of(store, X)["hs"] if h.get("ho")]
    lease, _ = admit(store, X, older, claim=hold["ho"]["tk"])
    assert lease is not None
    assert handed(store, X) == []
    assert [e["t"] for e in parked_entries(store, X)] == ["r30"]
    lease.release()
    assert handed(store, X) == ["r30"]


def test_a_run_due_in_the_same_command_as_an_older_run_of_its_set_waits(store: LeaseStore) -> None:
    """Review: on the set's second key, the older run of the set (the ceiling's, sealed) takes a slot as
    due (its delayed copy) while a newer burst's run of the set is due too and a second slot is free; the
    fill of that same command must not hand the newer one a slot."""
    first, older, newer = run(10, [X, Y]), run(20, [X, Y]), run(30, [X, Y])
    blockers = [store.acquire(Y, 30, limit=N) for _ in range(N)]  # Y full
    assert all(blockers)
    for key in (X, Y):
        admit(store, key, first)
    ceiling = parked_entries(store, X)[0]["nb"]
    wait_for(lambda: server_past(store, ceiling), timeout=30, message="the first burst's ceiling passed")
    admit(store, X, older)  # past the ceiling: handed a slot of X (sealed)
    admit(store, X, newer)  # a burst of its own, parked behind it on X
    assert handed(store, X) == ["r20"] and newer["bu"] > older["bu"]
    admit(store, Y, older)  # the first send's entry taken back; due, but Y is full
    admit(store, Y, newer)  # of another burst: both parked on Y
    assert [e["t"] for e in parked_entries(store, Y)] == ["r20", "r30"]
    due = max(e["nb"] for e in parked_entries(store, Y))
    wait_for(lambda: server_past(store, due), timeout=30, message="both runs due on Y")
    # The blockers' holds expire (their holders died: the expiry written back, no command hands them on).
    store.collection.update_one({"_id": Y}, {"$set": {"hs.$[].x": datetime.datetime(2000, 1, 1)}})
    info = {"task_id": older["t"], "delivery": older["r"], "keys": older["ks"]}
    lease, doc = store.admit(
        Y, older, ttl=30, replace=True, group=older["g"], info=info, limit=N, debounce=30, max_wait=2,
        due=True,
    )  # fmt: skip
    assert lease is not None and doc["lo"] == "due"
    assert handed(store, Y) == []  # the newer run waits for the older one, though a slot is free
    assert [e["t"] for e in parked_entries(store, Y)] == ["r30"]
