"""A run revoked after it was handed the key, before its message was taken up: the sweeper drops the
handoff (the key goes on) and the run's state becomes ``REVOKED``, as for a run revoked while parked (a
new-user trial saw it stay ``QUEUED`` until a worker consumed its message). On the embedded server."""

from __future__ import annotations

import pytest
from celery import Celery
from celery.worker import state

from celery_mongolock.config import get_store
from celery_mongolock.integration.results import QUEUED
from celery_mongolock.integration.sweeper import Sweeper

KEY = "resource:revoked-handoff"


@pytest.fixture
def app(worker_app: Celery) -> Celery:
    return worker_app


def test_a_run_revoked_while_handed_the_key_ends_revoked(app: Celery) -> None:
    store = get_store(app)
    held = store.acquire(KEY, 60)
    assert held is not None
    entry = {"id": "handed-1/0", "t": "handed-1", "n": "proj.upload", "r": "0", "s": 10, "m": b"m", "ttl": 30}
    assert store.admit(KEY, entry, ttl=30)[1]["lo"] == "parked"
    app.backend.store_result("handed-1", None, QUEUED)  # what the parked run wrote
    assert held.release()  # handed to it; its message is on its way
    assert (store.collection.find_one({"_id": KEY}) or {})["ho"]["t"] == "handed-1"
    state.revoked.add("handed-1")  # the worker received the revoke
    try:
        Sweeper(app, interval=1.0).sweep_once()
    finally:
        state.revoked.discard("handed-1")
    assert app.backend.get_task_meta("handed-1")["status"] == "REVOKED"
    doc = store.collection.find_one({"_id": KEY}) or {}
    assert not doc.get("ho") and doc.get("owner") is None  # the handoff dropped, the key free


def test_a_revoked_run_that_claimed_the_key_meanwhile_is_not_marked_revoked(app: Celery) -> None:
    """The sweeper read the key as handed to the run; the run claimed it (its worker had not seen the
    revoke yet) before the sweep: the sweep drops nothing, and the run, which runs, is not marked
    ``REVOKED`` (the review of stop 51: marking every revoked handed run raced with its claim)."""
    store = get_store(app)
    held = store.acquire(KEY, 60)
    assert held is not None
    entry = {"id": "claims-1/0", "t": "claims-1", "n": "proj.upload", "r": "0", "s": 10, "m": b"m", "ttl": 30}
    assert store.admit(KEY, entry, ttl=30)[1]["lo"] == "parked"
    behind = {**entry, "id": "behind-1/0", "t": "behind-1", "s": 11}  # (the key stays one to sweep)
    assert store.admit(KEY, behind, ttl=30)[1]["lo"] == "parked"
    app.backend.store_result("claims-1", None, QUEUED)
    assert held.release()
    token = (store.collection.find_one({"_id": KEY}) or {})["ho"]["tk"]
    (read,) = [w for w in store.waiting() if w.key == KEY]  # the sweeper's read: handed to it
    lease, doc = store.admit(KEY, entry, ttl=30, claim=token)  # its worker claims the key meanwhile
    assert lease is not None and doc["lo"] == "claimed"
    Sweeper(app, interval=1.0)._sweep(store, read, ["claims-1"])
    assert app.backend.get_task_meta("claims-1")["status"] == QUEUED
    lease.release()


def test_a_revoked_run_of_several_keys_leaves_every_key_when_its_handoff_is_discarded(app: Celery) -> None:
    """A run of several keys reserved a and was handed b; revoked, its handoff message is discarded by
    the worker (``task_revoked``): a goes on at once too, not at the sweeper's next pass (a new user's
    trial, stop 56: the run behind it on a waited 5 to 13 s)."""
    from types import SimpleNamespace

    from celery_mongolock.integration import handoff

    store = get_store(app)
    a, b = "resource:revoked-a", "resource:revoked-b"
    held = store.acquire(b, 60)
    assert held is not None
    ks = [a, b]
    entry = {"id": "multi-1/0", "t": "multi-1", "n": "proj.merge", "r": "0", "s": 10, "m": b"m", "ks": ks}
    entry["tk"] = handoff.keys_token("multi-1/0", ks)
    lease, _ = store.admit(a, entry, ttl=30)
    assert lease is not None
    assert store.admit(b, entry, ttl=30)[1]["lo"] == "parked"
    assert store.reserve(lease, entry)
    behind = {**entry, "id": "behind-2/0", "t": "behind-2", "s": 11, "tk": "tk-behind"}
    assert store.admit(a, behind, ttl=30)[1]["lo"] == "parked"  # (waits on a behind the reservation)
    assert held.release()  # b is handed to it: its message is on its way
    header = {"k": b, "tk": entry["tk"], "id": entry["id"], "ks": ks}
    request = SimpleNamespace(id="multi-1", headers={handoff.HANDOFF_HEADER: header})
    handoff._on_revoked(sender=SimpleNamespace(app=app, name="proj.merge"), request=request)
    doc_a = store.collection.find_one({"_id": a}) or {}
    assert (doc_a.get("ho") or {}).get("t") == "behind-2"  # a went on to the run behind it, at once
    doc_b = store.collection.find_one({"_id": b}) or {}
    assert not doc_b.get("ho") and doc_b.get("owner") is None
