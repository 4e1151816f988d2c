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
