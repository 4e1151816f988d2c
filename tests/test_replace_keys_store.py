"""``Replace`` with ``keys=`` in the lease store, on the embedded server (no Celery): supersession is
decided per set of rendered keys (the entry's ``g``), on every key of the set; runs of other sets that
share a key keep their place in send order, as under ``Queue``; an older run's reservation is taken back
and handed on; the newest send of a set that got a key (``lg``) supersedes older sends delivered late."""

from __future__ import annotations

from typing import Any

from celery_mongolock import LeaseStore
from celery_mongolock.core.documents.sets import set_signature

from .test_admission_store import Handoffs

X, Y, Z = "rk:x", "rk:y", "rk:z"


def run(stamp: int, keys: list[str], task_id: str | None = None) -> dict[str, Any]:
    tid = task_id or f"r{stamp}"
    ks = sorted(keys)
    return {
        "id": f"{tid}/0",
        "t": tid,
        "n": "merge",
        "r": "0",
        "s": stamp,
        "m": b"msg",
        "ks": ks,
        "g": set_signature(ks),
        "tk": f"tk-{tid}",
    }


def admit(
    store: LeaseStore, key: str, e: dict[str, Any], claim: str | None = None
) -> tuple[Any, dict[str, Any]]:
    return store.admit(key, e, ttl=30, claim=claim, replace=True, group=e["g"])


def doc_of(store: LeaseStore, key: str) -> dict[str, Any]:
    return store.collection.find_one({"_id": key}) or {}


def parked(store: LeaseStore, key: str) -> list[str]:
    return [e["t"] for e in doc_of(store, key).get("q") or []]


def superseded(store: LeaseStore, key: str) -> list[tuple[str, str]]:
    return [(s["t"], s["by"]) for s in doc_of(store, key).get("sup") or []]


def test_the_signature_is_of_the_set() -> None:
    assert set_signature([X, Y]) == set_signature([Y, X, X])
    assert set_signature([X, Y]) != set_signature([X, Z])


def test_a_newer_send_of_the_set_supersedes_the_older_on_every_key(store: LeaseStore) -> None:
    bx, by_ = store.acquire(X, 30), store.acquire(Y, 30)
    assert bx is not None and by_ is not None
    old, new = run(10, [X, Y]), run(20, [X, Y])
    for key in (X, Y):
        assert admit(store, key, old)[1]["lo"] == "parked"
    for key in (X, Y):
        lease, doc = admit(store, key, new)
        assert lease is None and doc["lo"] == "parked"
        assert parked(store, key) == ["r20"]
        assert superseded(store, key) == [("r10", "r20")]
    sup = doc_of(store, X)["sup"][0]
    assert sup["ks"] == [X, Y] and sup["g"] == old["g"]
    # An older send delivered late is superseded at its first key, by the newest parked.
    lease, doc = admit(store, X, run(5, [X, Y]))
    assert lease is None and doc["lo"] == "superseded" and doc["lo_by"] == "r20"
    # A copy of the superseded run's message too.
    assert admit(store, Y, old)[1]["lo"] == "superseded"


def test_runs_of_another_set_sharing_a_key_keep_their_place_in_send_order(store: LeaseStore) -> None:
    blocker = store.acquire(Y, 30)
    assert blocker is not None
    a1, b1, a2, b2 = run(10, [X, Y]), run(15, [Y, Z]), run(20, [X, Y]), run(25, [Y, Z])
    for e in (a1, b1, a2):
        assert admit(store, Y, e)[1]["lo"] == "parked"
    assert parked(store, Y) == ["r15", "r20"]  # a1 superseded by a2; b1 keeps its place, in send order
    assert superseded(store, Y) == [("r10", "r20")]
    # A single-key Queue run on the shared key is no run of the set either.
    _, doc = store.admit(Y, {"id": "q/0", "t": "q", "s": 17, "m": b"m"}, ttl=30)
    assert doc["lo"] == "parked"
    assert admit(store, Y, b2)[1]["lo"] == "parked"
    assert parked(store, Y) == ["q", "r20", "r25"]
    assert superseded(store, Y) == [("r10", "r20"), ("r15", "r25")]


def test_an_older_runs_reservation_is_taken_back_and_handed_on(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    blocker = store.acquire(Y, 30)
    assert blocker is not None
    old, new = run(10, [X, Y]), run(20, [X, Y])
    lease, doc = admit(store, X, old)
    assert lease is not None
    assert admit(store, Y, old)[1]["lo"] == "parked"
    assert store.reserve(lease, old)
    assert doc_of(store, X)["ho"]["t"] == "r10"
    fence = doc_of(store, X)["fence"]

    _, doc = admit(store, X, new)
    assert doc["lo"] == "parked"
    d = doc_of(store, X)
    # Taken back from r10 and, in the same command, reserved for the oldest run parked there: r20.
    assert d["ho"]["t"] == "r20" and d["owner"] == new["tk"] and d["fence"] > fence
    assert parked(store, X) == [] and superseded(store, X) == [("r10", "r20")]
    assert handoffs.tasks == ["r20"]  # published by the admit (the publisher checks it is ready)
    assert not store.reserved_for_all(new)
    assert admit(store, Y, new)[1]["lo"] == "parked"
    assert parked(store, Y) == ["r20"] and superseded(store, Y) == [("r10", "r20")]

    # The older run's claim (its handoff message was on its way) says superseded, by whom.
    lease, doc = admit(store, X, old, claim=old["tk"])
    assert lease is None and doc["lo"] == "superseded" and doc["lo_by"] == "r20"

    blocker.release()
    assert store.reserved_for_all(new)
    lx, doc = admit(store, X, new, claim=new["tk"])
    assert lx is not None and doc["lo"] == "claimed"
    ly, doc = admit(store, Y, new, claim=new["tk"])
    assert ly is not None and doc["lo"] == "claimed"
    # The newest send of the set that got each key is remembered, per set.
    assert [(r["g"], r["s"], r["t"]) for r in doc_of(store, X)["lg"]] == [(new["g"], 20, "r20")]
    lx.release()
    ly.release()
    # Past its run, an older send of the set delivered late is superseded; a send of another set that
    # shares the key is not.
    assert admit(store, Y, run(15, [X, Y]))[1]["lo"] == "superseded"
    lease, doc = admit(store, Y, run(12, [Y, Z]))
    assert lease is not None and doc["lo"] == "acquired"
    lease.release()
    d = doc_of(store, Y)
    # Nothing parked or reserved is left; only the superseded run's result, for the sweeper to write.
    assert not d.get("q") and d.get("ho") is None and d.get("owner") is None
    assert superseded(store, Y) == [("r10", "r20")]


def test_a_run_that_holds_the_key_is_not_superseded(store: LeaseStore) -> None:
    """Supersession is decided at admission: a run of the set that got every key runs; the newer send
    parks behind it, and runs after it."""
    handoffs = Handoffs(store)
    old, new = run(10, [X, Y]), run(20, [X, Y])
    lx, _ = admit(store, X, old)
    ly, _ = admit(store, Y, old)
    assert lx is not None and ly is not None
    for key in (X, Y):
        assert admit(store, key, new)[1]["lo"] == "parked"
    assert superseded(store, X) == [] and superseded(store, Y) == []
    lx.release()
    ly.release()
    assert sorted(handoffs.tasks) == ["r20", "r20"]
    assert store.reserved_for_all(new)


def test_single_key_replace_is_unchanged_beside_a_set(store: LeaseStore) -> None:
    """A single-key Replace run's document keeps its shape: no ``g``, no ``lg``; its ``last``."""
    lease, _ = store.admit(Z, {"id": "one/0", "t": "one", "s": 5, "m": b"m"}, ttl=30, replace=True)
    assert lease is not None
    lease.release()
    d = doc_of(store, Z)
    assert d["last"] == {"s": 5, "t": "one"} and "lg" not in d


def test_a_later_attempt_of_a_task_never_supersedes_its_own_stale_copy(store: LeaseStore) -> None:
    """A body's ``self.retry()`` parks attempt 1 beside a stale copy of attempt 0 of the same task (same send
    stamp, parked just before): attempt 1 takes its place, the copy's entry leaves the key, and nothing is
    recorded as superseded (the lock-set checker on RabbitMQ: the task ended ``superseded`` by its own id,
    its retry never ran). An older send of another task is still superseded."""
    bx, by_ = store.acquire(X, 30), store.acquire(Y, 30)
    assert bx is not None and by_ is not None
    other = run(5, [X, Y])
    copy = run(10, [X, Y], task_id="t")
    retried = {**copy, "id": "t/1", "r": "1"}
    for key in (X, Y):
        assert admit(store, key, other)[1]["lo"] == "parked"
        assert admit(store, key, copy)[1]["lo"] == "parked"
        lease, doc = admit(store, key, retried)
        assert lease is None and doc["lo"] == "parked"
        assert [e["id"] for e in doc_of(store, key)["q"]] == ["t/1"]
        assert superseded(store, key) == [("r5", "t")]  # by the copy; none of "t" by "t"


def test_one_key_replace_never_supersedes_a_stale_copy_of_its_own_task(store: LeaseStore) -> None:
    """The same on one key (``Replace`` without ``keys=``)."""
    holder = store.acquire(X, 30)
    assert holder is not None
    copy = {"id": "t/0", "t": "t", "n": "upload", "r": "0", "s": 10, "m": b"msg"}
    retried = {**copy, "id": "t/1", "r": "1"}
    assert store.admit(X, copy, ttl=30, replace=True)[1]["lo"] == "parked"
    lease, doc = store.admit(X, retried, ttl=30, replace=True)
    assert lease is None and doc["lo"] == "parked"
    assert [e["id"] for e in doc_of(store, X)["q"]] == ["t/1"]
    assert superseded(store, X) == []
