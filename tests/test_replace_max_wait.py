"""``Replace(debounce=d, max_wait=m)``: the debounce's ceiling. A key (or set of keys) that keeps
receiving sends still runs at least ``m`` seconds after its burst began waiting, with the newest send's
arguments. In the lease store, on the embedded server (no Celery): each parked entry carries when its
burst began waiting (``fw``, carried on from the runs it supersedes) and a not-before time no later than
``fw + m``; and the policy's checks (no server)."""

from __future__ import annotations

from typing import Any

import pytest

from celery_mongolock import ConfigurationError, LeaseStore, Replace
from celery_mongolock.core.documents.sets import gate_of
from celery_mongolock.core.outcomes import Admission

from .servers import server_past, wait_for
from .test_admission_store import entry
from .test_replace_keys_store import run

KEY = "mw:one"
X, Y = "mw:x", "mw:y"


def parked_entry(store: LeaseStore, key: str) -> dict[str, Any]:
    (e,) = (store.collection.find_one({"_id": key}) or {})["q"]
    return dict(e)


def test_a_newer_send_keeps_the_bursts_first_wait_and_is_due_by_max_wait(store: LeaseStore) -> None:
    lease, doc = store.admit(KEY, entry(1), replace=True, debounce=30, max_wait=2)
    assert lease is None and doc["lo"] == "parked"
    first = parked_entry(store, KEY)
    assert first["fw"] == first["at"]
    assert (first["nb"] - first["at"]).total_seconds() == pytest.approx(2, abs=0.01)
    lease, doc = store.admit(KEY, entry(2), replace=True, debounce=30, max_wait=2)
    assert lease is None and doc["lo"] == "parked"
    newer = parked_entry(store, KEY)
    assert newer["t"] == "task-2" and newer["fw"] == first["fw"]  # the burst began with the first send
    assert (newer["nb"] - newer["fw"]).total_seconds() == pytest.approx(2, abs=0.01)
    # What the worker's delayed copy waits: until that ceiling, not the 30 s debounce.
    due_in = Admission.of(lease, doc).due_in("task-2")
    assert due_in is not None and due_in <= 2.0


def test_without_max_wait_each_send_waits_the_whole_debounce(store: LeaseStore) -> None:
    store.admit(KEY, entry(1), replace=True, debounce=30)
    _, doc = store.admit(KEY, entry(2), replace=True, debounce=30)
    newer = parked_entry(store, KEY)
    assert "fw" not in newer
    assert (newer["nb"] - newer["at"]).total_seconds() == pytest.approx(30, abs=0.01)
    assert Admission.of(None, doc).due_in("task-2") == pytest.approx(30, abs=0.01)


def test_a_set_of_keys_keeps_its_bursts_first_wait_on_each_key(store: LeaseStore) -> None:
    old, new = run(10, [X, Y]), run(20, [X, Y])
    for r in (old, new):
        for key in (X, Y):
            _, doc = store.admit(key, r, ttl=30, replace=True, group=r["g"], debounce=30, max_wait=2)
            assert doc["lo"] == "parked"
    for key in (X, Y):
        e = parked_entry(store, key)
        assert e["t"] == "r20"
        assert (e["nb"] - e["fw"]).total_seconds() == pytest.approx(2, abs=0.01)
        assert e["fw"] < e["at"]  # the older send's


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"max_wait": 10}, "needs debounce="),
        ({"debounce": 5, "max_wait": 2}, "must be at least debounce=5"),
        ({"debounce": 5, "max_wait": -1}, "max_wait=...) must be a number"),
        ({"debounce": 5, "max_wait": "10"}, "max_wait=...) must be a number"),
    ],
)
def test_bad_max_wait_is_refused(options: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigurationError, match=words.replace("(", r"\(").replace(")", r"\)")):
        Replace(**options)


def test_a_run_handed_a_key_by_the_ceiling_that_leaves_passes_its_burst_on(store: LeaseStore) -> None:
    """At the ceiling, the run handed the first key (by its burst's ceiling) can be superseded on the
    second by a newer send of its set handed that one; the newer send parked behind it on the first key
    began a burst of its own. When the older run leaves the first key, the newer send continues the
    older burst there: due at once, and handed the key in the same command (before: it waited a whole
    new ceiling; with real workers the race came back at each ceiling: one of the two causes of a set of
    keys not seen to run by max_wait, see CHANGELOG.md)."""
    first, older, newer = run(10, [X, Y]), run(20, [X, Y]), run(30, [X, Y])

    def admit(key: str, r: dict[str, Any]) -> dict[str, Any]:
        _, doc = store.admit(key, r, ttl=30, replace=True, group=r["g"], debounce=30, max_wait=2)
        return doc

    for key in (X, Y):
        assert admit(key, first)["lo"] == "parked"
    ceiling = parked_entry(store, Y)["nb"]
    wait_for(lambda: server_past(store, ceiling), timeout=30, message="the burst's ceiling passed")
    admit(X, older)  # past the ceiling: handed X at once
    assert (store.collection.find_one({"_id": X}) or {})["ho"]["t"] == "r20"
    admit(X, newer)  # parks behind the run handed X: a burst of its own
    assert parked_entry(store, X)["t"] == "r30"
    admit(Y, newer)  # supersedes the first send on Y, past the ceiling: handed Y at once
    assert (store.collection.find_one({"_id": Y}) or {})["ho"]["t"] == "r30"
    assert admit(Y, older)["lo"] == "superseded"
    for key in (X, Y):  # the older run leaves (as ``QueuedRun`` does, told superseded)
        store.unpark(key, older["id"])
    doc = store.collection.find_one({"_id": X}) or {}
    assert (doc.get("ho") or {}).get("t") == "r30", doc.get("q")
    assert store.reserved_for_all(newer)


def test_the_run_the_ceiling_chose_is_not_superseded_where_a_newer_send_came_first(store: LeaseStore) -> None:
    """The leapfrog, as ``QueuedRun`` admits (each run learns its burst on its first key, ``bu``, and
    passes it with its admits of the others): the run handed the first key by its burst's ceiling is not
    superseded on the second key by a newer send that reached it first (that send, parked behind it on
    the first key, began a burst of its own: the ceiling sealed the older one). It takes the second key
    back from the older run of its burst handed it there, and holds both; the newer send waits for its
    own burst. Before, it was superseded there and the keys went round from run to run while sends
    came (a set of keys with max_wait was refused at declaration)."""
    first, older, newer = run(10, [X, Y]), run(20, [X, Y]), run(30, [X, Y])

    def admit(key: str, r: dict[str, Any]) -> dict[str, Any]:
        _, doc = store.admit(key, r, ttl=30, replace=True, group=r["g"], debounce=30, max_wait=2)
        burst = Admission.of(None, doc).burst_of(r["id"])
        if burst is not None:
            r.setdefault("bu", burst)
        return doc

    for key in (X, Y):
        assert admit(key, first)["lo"] == "parked"
    ceiling = parked_entry(store, Y)["nb"]
    wait_for(lambda: server_past(store, ceiling), timeout=30, message="the burst's ceiling passed")
    admit(X, older)  # past the ceiling: handed X at once
    assert (store.collection.find_one({"_id": X}) or {})["ho"]["t"] == "r20"
    admit(X, newer)  # parks behind the run handed X: a burst of its own
    assert parked_entry(store, X)["t"] == "r30" and newer["bu"] > older["bu"] == first["bu"]
    assert admit(Y, newer)["lo"] == "parked"  # not a burst it supersedes: the first send keeps its place
    doc = admit(Y, older)
    assert doc["lo"] != "superseded", doc.get("lo_by")
    assert (store.collection.find_one({"_id": Y}) or {})["ho"]["t"] == "r20"
    assert store.reserved_for_all(older)
    assert [e["t"] for e in (store.collection.find_one({"_id": Y}) or {})["q"]] == ["r30"]
    assert "r10" in {s["t"] for s in (store.collection.find_one({"_id": Y}) or {}).get("sup") or []}


def test_a_reservation_made_by_the_ceiling_is_sealed_too(store: LeaseStore) -> None:
    """The run the ceiling chose took the first key and, waiting for the second, turned it into a
    reservation: a reservation carries its run's burst (``bu``) but no first wait (``fw``). A newer send
    that does not know its burst (its first key) must leave that reservation alone and begin a burst of its
    own, as it does a handoff made by the ceiling (review: it took the reservation back, and the burst
    went on)."""
    first, older, newer = run(10, [X, Y]), run(20, [X, Y]), run(30, [X, Y])

    def admit(key: str, r: dict[str, Any], **kw: Any) -> tuple[Any, dict[str, Any]]:
        lease, doc = store.admit(key, r, ttl=30, replace=True, group=r["g"], debounce=30, max_wait=2, **kw)
        burst = Admission.of(lease, doc).burst_of(r["id"])
        if burst is not None:
            r.setdefault("bu", burst)
        return lease, doc

    for key in (X, Y):
        assert admit(key, first)[1]["lo"] == "parked"
    ceiling = parked_entry(store, Y)["nb"]
    wait_for(lambda: server_past(store, ceiling), timeout=30, message="the burst's ceiling passed")
    admit(X, older)  # past the ceiling: handed X at once ...
    handoff = (store.collection.find_one({"_id": X}) or {})["ho"]
    lease, _ = admit(X, older, claim=handoff["tk"])  # ... which it claims, then keeps as a reservation
    assert lease is not None and store.reserve(lease, older)
    reserved = (store.collection.find_one({"_id": X}) or {})["ho"]
    assert reserved["t"] == "r20" and "fw" not in reserved and reserved["bu"] == older["bu"]
    _, doc = admit(X, newer)
    assert doc["lo"] == "parked"
    assert (store.collection.find_one({"_id": X}) or {})["ho"]["t"] == "r20"  # not taken back
    assert newer["bu"] > older["bu"]  # a burst of its own


def test_the_ceiling_s_reservation_that_lapses_again_and_again_stays_sealed(store: LeaseStore) -> None:
    """The run the ceiling chose reserved the first key of its set (waiting for the second) with a short
    lease, and its reservation lapses three times: once swept, then each time as a newer send that does
    not know its burst parks. Each lapse hands the key back to that run (a reservation keeps its place,
    and it is the oldest), and each newer send begins a burst of its own, superseding only the newer
    sends before it. This path keeps the seal past two lease times; the next test drives the other one
    (a run ahead of the ceiling's when its reservation goes back among the parked runs)."""
    first, older = run(10, [X, Y]), run(20, [X, Y])

    def admit(key: str, r: dict[str, Any], ttl: float = 30, **kw: Any) -> tuple[Any, dict[str, Any]]:
        lease, doc = store.admit(key, r, ttl=ttl, replace=True, group=r["g"], debounce=30, max_wait=2, **kw)
        burst = Admission.of(lease, doc).burst_of(r["id"])
        if burst is not None:
            r.setdefault("bu", burst)
        return lease, doc

    def lapse() -> None:
        expires = (store.collection.find_one({"_id": X}) or {})["expires_at"]
        wait_for(lambda: server_past(store, expires), timeout=30, message="the reservation lapsed")

    for key in (X, Y):
        assert admit(key, first)[1]["lo"] == "parked"
    ceiling = parked_entry(store, Y)["nb"]
    wait_for(lambda: server_past(store, ceiling), timeout=30, message="the burst's ceiling passed")
    admit(X, older)  # past the ceiling: handed X at once, claimed, kept as a reservation (1 s)
    lease, _ = admit(X, older, ttl=1, claim=(store.collection.find_one({"_id": X}) or {})["ho"]["tk"])
    assert lease is not None and store.reserve(lease, older)
    lapse()
    assert store.sweep(X) is not None
    sends, handed = [], (store.collection.find_one({"_id": X}) or {})["ho"]["hn"]
    for stamp in (31, 32, 33):
        lapse()
        sends.append(run(stamp, [X, Y]))
        assert admit(X, sends[-1])[1]["lo"] == "parked"
        doc = store.collection.find_one({"_id": X}) or {}
        assert doc["ho"]["t"] == "r20" and doc["ho"]["hn"] == handed + 1  # handed back to the ceiling's run
        handed += 1
        assert [e["t"] for e in doc["q"]] == [sends[-1]["t"]]  # the newer sends before it superseded
        assert sends[-1]["bu"] > older["bu"]  # a burst of its own
    assert {s["t"] for s in doc.get("sup") or []} == {"r10", "r31", "r32"}
    assert admit(X, older)[1]["lo"] != "superseded"


def test_a_newer_send_of_a_higher_priority_does_not_pass_the_ceiling_s_run_on_its_gate(
    store: LeaseStore,
) -> None:
    """The path of docs/known-issues.md ("the ceiling's run waiting long on a key"): the ceiling's run
    (r20) reserved its set's gate with a short lease; a newer send of a higher priority (r31, rank -9)
    parks behind that reservation (sealed: a burst of its own). The reservation lapses and goes back among
    the parked runs: on a gate in send order alone, so the sweeper hands it to the ceiling's run again.
    (Before, r31 was ranked ahead and handed the gate; the ceiling's run, left parked, was superseded by
    the next send, and then ran after r31 when there was none.) A fresh send (r32) supersedes r31 and
    waits behind the ceiling's run, which runs first."""
    gate = gate_of([X, Y])
    # (the ceiling's run of a lower priority than most, rank 5; the newer send of a higher one, -9)
    first, older = run(10, [gate, X, Y]), {**run(20, [gate, X, Y]), "pr": 5}
    urgent, fresh = {**run(31, [gate, X, Y]), "pr": -9}, run(32, [gate, X, Y])

    def admit(r: dict[str, Any], ttl: float = 30, **kw: Any) -> tuple[Any, dict[str, Any]]:
        lease, doc = store.admit(gate, r, ttl=ttl, replace=True, group=r["g"], debounce=30, max_wait=2, **kw)
        burst = Admission.of(lease, doc).burst_of(r["id"])
        if burst is not None:
            r.setdefault("bu", burst)
        return lease, doc

    def doc() -> dict[str, Any]:
        return store.collection.find_one({"_id": gate}) or {}

    assert admit(first)[1]["lo"] == "parked"
    ceiling = parked_entry(store, gate)["nb"]
    wait_for(lambda: server_past(store, ceiling), timeout=30, message="the burst's ceiling passed")
    admit(older)  # past the ceiling: handed the gate at once, claimed, kept as a reservation (1 s)
    lease, _ = admit(older, ttl=1, claim=doc()["ho"]["tk"])
    assert lease is not None and store.reserve(lease, older)
    assert admit(urgent)[1]["lo"] == "parked"  # behind the sealed reservation, not taking it back
    assert doc()["ho"]["t"] == "r20" and "pr" not in doc()["q"][0] and "pr" not in doc()["ho"]  # (no rank)
    urgent_due = doc()["q"][0]["nb"]
    wait_for(
        lambda: server_past(store, max(doc()["expires_at"], urgent_due)),
        timeout=30,
        message="the reservation lapsed and the urgent run came due",
    )
    assert store.sweep(gate) is not None
    assert doc()["ho"]["t"] == "r20" and doc()["ho"]["hn"] == 2  # the ceiling's run, handed it again
    assert [e["t"] for e in doc()["q"]] == ["r31"]
    assert admit(fresh)[1]["lo"] == "parked"
    assert [e["t"] for e in doc()["q"]] == ["r32"]  # r31 superseded (its own burst), r20 sealed
    assert {s["t"] for s in doc().get("sup") or []} == {"r10", "r31"}
    lease, _ = admit(older, claim=doc()["ho"]["tk"])
    assert lease is not None and lease.release()
    assert doc()["ho"]["t"] == "r32"


def test_max_wait_with_keys_is_accepted() -> None:
    from celery import Celery

    from celery_mongolock import singleton_task

    @singleton_task(
        app=Celery("mw", set_as_current=False),
        keys=("a:{x}", "b:{x}"),
        on_contention=Replace(debounce=1, max_wait=3),
    )
    def pair(x: str) -> None: ...

    assert pair.mongolock_keys_for("7") == ["a:7", "b:7"]


def test_max_wait_is_accepted_with_a_debounce_it_is_not_shorter_than() -> None:
    assert Replace(debounce=5, max_wait=5).max_wait == 5
    assert Replace(debounce=5, max_wait=60).max_wait == 60
