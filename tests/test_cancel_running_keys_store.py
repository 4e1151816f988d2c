"""``Replace(cancel_running=True)`` with ``keys=`` in the lease store, on the embedded server (no Celery):
a newer send of the same set of keys that parks behind the run holding them marks that holder superseded
on each key it reaches; a holder of another set sharing a key is never marked; the set's leases are told
(by the lease watch) and are superseded together from the first notice, so a fenced write with any of
them is refused; released, the keys go to the newest run of the set."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from pymongo import MongoClient
from pymongo.collection import Collection

from celery_mongolock import FencedOut, LeaseStore, Superseded, fenced_update_one
from celery_mongolock.core.lease_set import LeaseSet

from .servers import wait_for
from .test_admission_store import Handoffs
from .test_replace_keys_store import X, Y, Z, doc_of, run

#: Holders that must learn from the lease watch alone: no heartbeat tick within a test.
LEASE, SLOW_BEAT = 900.0, 400.0
DEADLINE = 60.0


def admit(store: LeaseStore, key: str, e: dict[str, Any], **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    return store.admit(
        key,
        e,
        ttl=LEASE,
        replace=True,
        group=e["g"],
        cancel=True,
        heartbeat=True,
        heartbeat_seconds=SLOW_BEAT,
        **kwargs,
    )


def holds(store: LeaseStore, e: dict[str, Any]) -> LeaseSet:
    leases = []
    for key in e["ks"]:
        lease, doc = admit(store, key, e)
        assert lease is not None and doc["lo"] == "acquired", doc
        assert lease.notice_supersession
        leases.append(lease)
    return LeaseSet(leases)


def test_a_newer_send_of_the_set_marks_the_holder_on_each_key_and_the_set_is_told(store: LeaseStore) -> None:
    Handoffs(store)
    old, new = run(10, [X, Y]), run(20, [X, Y])
    holder = holds(store, old)
    holder.supersede_together()
    watch = store.heartbeat.watch
    assert watch is not None
    wait_for(lambda: watch.watching, timeout=DEADLINE, message="the lease watch to open its stream")
    told: list[tuple[str, str]] = []
    holder.on_superseded(lambda lease, by: told.append((lease.key, by)))

    _, doc = admit(store, X, new)  # the newer send reaches the first key
    assert doc["lo"] == "parked"
    mark = doc_of(store, X)["cx"]
    assert mark["o"] == holder[X].owner and mark["t"] == "r20" and mark["f"] == holder[X].fence
    assert holder.wait_superseded(DEADLINE)
    # Told on X, every lease of the set is superseded: a write guarded by Y is refused too.
    wait_for(lambda: holder[Y].superseded, timeout=DEADLINE, message="the set's other lease to be marked")
    assert store.heartbeat.ticks == 0, "the heartbeat ticked: the notice may be its own"
    assert holder.superseded_by == "r20" and holder.superseded_at is not None
    wait_for(lambda: told, timeout=DEADLINE, message="the set's superseded callback")
    assert [by for _, by in told] == ["r20"]  # once for the set (with one of its leases)
    with pytest.raises(Superseded) as raised:
        holder.raise_if_superseded()
    assert raised.value.key in (X, Y) and raised.value.by == "r20"

    _, doc = admit(store, Y, new)  # and the second: marked there too, still one notice
    assert doc["lo"] == "parked" and doc_of(store, Y)["cx"]["t"] == "r20"
    assert len(told) == 1


def test_a_holder_of_another_set_or_an_older_send_is_not_marked(store: LeaseStore) -> None:
    Handoffs(store)
    holder = holds(store, run(20, [X, Y]))
    # Another set sharing X: parks in send order, tells no one.
    assert admit(store, X, run(30, [X, Z]))[1]["lo"] == "parked"
    # A send of the set older than the holder's (a late delivery): superseded, tells no one.
    assert admit(store, X, run(10, [X, Y]))[1]["lo"] == "superseded"
    assert "cx" not in doc_of(store, X) or doc_of(store, X)["cx"] is None
    assert not holder.wait_superseded(0.5)  # (a bounded look for a notice that must not come)


def test_without_cancel_running_the_holder_of_the_set_is_not_marked(store: LeaseStore) -> None:
    Handoffs(store)
    holder = holds(store, run(10, [X, Y]))
    _, doc = store.admit(X, run(20, [X, Y]), ttl=LEASE, replace=True, group=run(20, [X, Y])["g"])
    assert doc["lo"] == "parked"
    assert doc_of(store, X).get("cx") is None
    assert not holder.superseded


@pytest.fixture
def reports(mongo_url: str) -> Iterator[Collection[dict[str, Any]]]:
    """A collection the holder writes to with its fences, holding one report ``r`` (written by nobody)."""
    client: MongoClient[dict[str, Any]] = MongoClient(mongo_url)
    try:
        target = client["cx_keys_test"]["reports"]
        target.delete_many({})
        target.insert_one({"_id": "r"})
        yield target
    finally:
        client.close()


def test_the_superseded_sets_writes_are_refused_and_the_keys_go_to_the_newest_run(
    store: LeaseStore, reports: Collection[dict[str, Any]]
) -> None:
    handoffs = Handoffs(store)
    old, new = run(10, [X, Y]), run(20, [X, Y])
    holder = holds(store, old)
    holder.supersede_together()
    fenced_update_one(reports, {"_id": "r"}, {"$set": {"by": "old"}}, holder[Y])
    for key in (X, Y):
        assert admit(store, key, new)[1]["lo"] == "parked"
    wait_for(lambda: holder[Y].superseded, timeout=DEADLINE, message="the set to be told")
    for lease in holder:
        with pytest.raises(FencedOut):
            fenced_update_one(reports, {"_id": "r"}, {"$set": {"by": "old-late"}}, lease)
    assert (reports.find_one({"_id": "r"}) or {})["by"] == "old"
    holder.release()
    assert sorted(handoffs.tasks) == ["r20", "r20"]
    assert store.reserved_for_all(new)


def test_the_moment_one_lease_of_the_set_is_marked_a_write_with_any_other_is_refused(
    store: LeaseStore, reports: Collection[dict[str, Any]]
) -> None:
    """The holder learns of the newer send on one key (its set's gate, with a ``Replace`` set): from that
    moment ``held.superseded`` is true and a fenced write with any lease of the set is refused, not only
    once the other leases are marked from a thread (ci42: the holder saw the notice on the gate, wrote
    once more with its group key's lease, and that write went through)."""
    holder = holds(store, run(10, [X, Y]))
    callbacks_held = threading.Event()  # (X's callbacks, the marking of the others among them, wait)

    def hold_callbacks(*_: Any) -> None:
        callbacks_held.wait(DEADLINE)

    holder[X].on_superseded(hold_callbacks)
    holder.supersede_together()
    try:
        assert holder[X].mark_superseded("r20")  # (as the lease watch does, on the first key it is told)
        assert holder.superseded and holder[Y].superseded and holder[Y].superseded_by == "r20"
        assert holder[Y].wait_superseded(0) and holder[Y].superseded_at is not None  # (marked, not only seen)
        with pytest.raises(FencedOut) as refused:  # (no wait: the same thread, right after the mark)
            fenced_update_one(reports, {"_id": "r"}, {"$set": {"by": "old-late"}}, holder[Y])
        assert refused.value.superseded_by == "r20"
        with pytest.raises(Superseded):
            holder[Y].raise_if_superseded()
        assert (reports.find_one({"_id": "r"}) or {}).get("by") is None
    finally:
        callbacks_held.set()
        holder.release()


def test_a_one_key_send_never_marks_the_holder_of_a_set(store: LeaseStore) -> None:
    """A one-key ``Replace(cancel_running=True)`` run sharing a key with a running set's run waits its
    turn: the set's holder is a run of another kind, not an older send of its own."""
    Handoffs(store)
    holder = holds(store, run(10, [X, Y]))
    one_key = {"id": "single/0", "t": "single", "n": "other", "r": "0", "s": 20, "m": b"msg", "tk": "tk-s"}
    _, doc = store.admit(X, one_key, ttl=LEASE, replace=True, cancel=True)
    assert doc["lo"] == "parked"
    assert doc_of(store, X).get("cx") is None
    assert not holder.wait_superseded(0.5)  # (a bounded look for a notice that must not come)
