"""The admit of a run whose key is in use as the other kind of key (``limit=N`` slots for a run that takes
it as a single lease, or the reverse) answers ``mixed`` and parks nothing: a release would hand the run
what it cannot claim (``tests/test_mixed_kinds.py`` has the loop that made with real workers)."""

from __future__ import annotations

from typing import Any

from celery_mongolock import LeaseStore
from celery_mongolock.core.outcomes import Admission, AdmitOutcome

KEY = "kinds:a"


def entry(task_id: str, stamp: int) -> dict[str, Any]:
    return {"id": f"{task_id}/0", "t": task_id, "n": "merge", "r": "0", "s": stamp, "m": b"m"}


def parked(store: LeaseStore) -> list[str]:
    doc = store.collection.find_one({"_id": KEY}) or {}
    return [e["t"] for e in doc.get("q") or []]


def test_a_run_of_a_single_lease_does_not_park_behind_slots(store: LeaseStore) -> None:
    published: list[str] = []
    store.add_handoff_callback(lambda key, e, doc: published.append(str(e.get("t"))))
    slot = store.acquire(KEY, 30, limit=3)
    assert slot is not None
    lease, doc = store.admit(KEY, entry("single", 10), ttl=30)
    assert lease is None and Admission.of(lease, doc).outcome is AdmitOutcome.MIXED
    assert parked(store) == []
    # A run of slots parks as before (all three held).
    others = [store.acquire(KEY, 30, limit=3) for _ in range(2)]
    assert all(others)
    _, doc = store.admit(KEY, entry("slots", 11), ttl=30, limit=3)
    assert doc["lo"] == "parked" and parked(store) == ["slots"]
    slot.release()  # hands its slot to the run of slots, never to the single lease's run
    assert published == ["slots"]
    for hold in others:
        assert hold is not None and hold.release()
    _, doc = store.admit(KEY, entry("single", 10), ttl=30)  # the slot handed to "slots" is in use
    assert doc["lo"] == "mixed"
    claimed, doc = store.admit(KEY, entry("slots", 11), ttl=30, limit=3, claim=_token(store, "slots"))
    assert claimed is not None and claimed.release()
    taken, doc = store.admit(KEY, entry("single", 10), ttl=30)  # free of slots now: taken
    assert taken is not None and doc["lo"] == "acquired"
    taken.release()


def test_a_run_of_slots_does_not_park_behind_a_single_lease(store: LeaseStore) -> None:
    holder = store.acquire(KEY, 30)
    assert holder is not None
    lease, doc = store.admit(KEY, entry("slots", 10), ttl=30, limit=3)
    assert lease is None and doc["lo"] == "mixed" and parked(store) == []
    _, doc = store.admit(KEY, entry("single", 11), ttl=30)
    assert doc["lo"] == "parked"
    holder.release()  # handed to the single lease's run: still in use as one
    assert store.admit(KEY, entry("slots", 10), ttl=30, limit=3)[1]["lo"] == "mixed"


def _token(store: LeaseStore, task_id: str) -> str:
    doc = store.collection.find_one({"_id": KEY}) or {}
    handed = [h["ho"] for h in doc.get("hs") or [] if h.get("ho") and h["ho"]["t"] == task_id]
    assert handed, doc
    return str(handed[0]["tk"])
