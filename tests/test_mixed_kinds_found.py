"""Engine bugs the model test found on a key used as both kinds (``tests/test_engine_model.py``, the mixed
key), fixed: store-level reproductions, each failing before its fix.

``unpark`` chose its pipeline by the document's holds (``hs.0`` exists: the slots' pipeline), not by the
kind of the run it removes. A key used as a single lease keeps the holds of its earlier slots that expired
(a single lease's admit or acquire does not drop them), so a run of a single lease on such a key was
unparked by the slots' pipeline: its handoff (``ho``) was not among the slots' handoffs, and the key, free
for a single lease, was not handed to the next parked run. Now the filter picks by the run's kind.

A single lease's admit judged a copy ``running`` when the run is the holder and the key is not ``VACANT``;
``VACANT`` includes ``NO_SLOT_HELD``, so the copy of a run whose single lease expired, on a key held as
slots since, was told it is a copy of the run holding the key. Now ``running`` needs the lease live.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from celery_mongolock import LeaseStore

KEY = "kinds:found"
PAST = _dt.datetime(2000, 1, 1, tzinfo=_dt.timezone.utc)


def entry(task_id: str, stamp: int) -> dict[str, Any]:
    return {
        "id": f"{task_id}/0",
        "t": task_id,
        "n": "m",
        "r": "0",
        "s": stamp,
        "tk": f"{task_id}-tk",
        "m": b"m",
    }


def doc(store: LeaseStore) -> dict[str, Any]:
    return store.collection.find_one({"_id": KEY}) or {}


def a_dead_slot_then_a_single_lease(store: LeaseStore) -> Any:
    """A slot taken and its holder dead (its hold expired, kept in ``hs``), then a single lease taken, and
    two runs of a single lease parked behind it."""
    assert store.acquire(KEY, 600, limit=2) is not None
    store.collection.update_one({"_id": KEY}, {"$set": {"hs.$[].x": PAST}})
    holder = store.acquire(KEY, 600)
    assert holder is not None
    for task_id, stamp in (("a", 1), ("b", 2)):
        assert store.admit(KEY, entry(task_id, stamp), ttl=600)[1]["lo"] == "parked"
    assert len(doc(store)["hs"]) == 1 and doc(store)["qk"] == "one"
    return holder


def test_unpark_removes_the_handoff_of_a_single_lease_on_a_key_keeping_a_dead_slot(store: LeaseStore) -> None:
    published: list[str] = []
    store.add_handoff_callback(lambda key, ho, d: published.append(str(ho["t"])))
    holder = a_dead_slot_then_a_single_lease(store)
    assert holder.release() and published == ["a"]
    assert doc(store)["ho"]["t"] == "a" and doc(store)["owner"] == "a-tk"
    # "a" is handed the key; it is unparked (revoked): the handoff goes, the key goes to "b".
    assert store.unpark(KEY, "a/0")  # (before the fix: False, "a" kept the key)
    after = doc(store)
    assert (after.get("ho") or {}).get("t") == "b" and published == ["a", "b"]


def test_unpark_hands_a_free_single_lease_on_a_key_keeping_a_dead_slot(store: LeaseStore) -> None:
    published: list[str] = []
    store.add_handoff_callback(lambda key, ho, d: published.append(str(ho["t"])))
    a_dead_slot_then_a_single_lease(store)
    store.collection.update_one({"_id": KEY}, {"$set": {"expires_at": PAST}})  # the single holder died
    assert store.unpark(KEY, "a/0")
    # As on a key never taken as slots: the free key goes to "b" in the same command.
    after = doc(store)
    assert (after.get("ho") or {}).get("t") == "b" and published == ["b"]  # (before: "b" parked)


def test_a_copy_of_a_run_whose_single_lease_expired_is_not_running_beside_slots(store: LeaseStore) -> None:
    """The redelivered message of a run whose worker died (its single lease expired), while the key is
    held as slots by others: the run holds nothing, so its copy is refused as any run of a single lease is
    (``mixed``: back within 5 s), not taken for a copy of a run that holds the key (``running``: kept aside
    as a duplicate and looked at again after a lease length, each time while the slots are held)."""
    lease, reply = store.admit(KEY, entry("x", 1), ttl=600)
    assert lease is not None and reply["lo"] == "acquired"
    store.collection.update_one({"_id": KEY}, {"$set": {"expires_at": PAST}})  # x's worker died
    slot = store.acquire(KEY, 600, limit=2)
    assert slot is not None  # (the key is free of the single lease: taken as a slot)
    assert store.admit(KEY, entry("y", 2), ttl=600)[1]["lo"] == "mixed"  # any other run of a single lease
    assert store.admit(KEY, entry("x", 1), ttl=600)[1]["lo"] == "mixed"  # (before the fix: "running")
