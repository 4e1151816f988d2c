"""A run of several keys parked past its deadline on more than one of its keys (one deadline on each key
it did not get) is ended exactly once: the writer of the key it timed out on claims its entry on the other
keys too (``results._ends_here``). The real store; the sweeper's call (``write_timed_out``) as it makes it.
Before, each key's writer ended it (two endings published: its callbacks called twice)."""

from __future__ import annotations

import datetime as _dt
from typing import Any

import celery
import pytest

from celery_mongolock.config import get_store
from celery_mongolock.core.store import LeaseStore
from celery_mongolock.integration import results

A, B = "group:a", "group:b"


def _dead(keys: list[str]) -> dict[str, Any]:
    now = _dt.datetime.now(_dt.timezone.utc)
    return {"t": "t-run", "id": "t-run/0", "n": "proj.pair", "at": now, "dl": now, "th": "skip", "ks": keys}


def _setup(app: celery.Celery) -> tuple[LeaseStore, dict[str, Any], list[str]]:
    @app.task(name="proj.pair")
    def pair() -> None: ...

    store = get_store(app)
    entry = _dead([A, B])
    for key in (A, B):
        store.collection.insert_one({"_id": key, "dead": [entry], "q": [], "wq": True})
    return store, entry, []


def _publish(calls: list[str], key_of: list[str]) -> Any:
    def publish(key: str, entry: Any, ending: Any) -> bool:
        calls.append(entry["t"])
        key_of.append(key)
        return False  # (its result is written directly: countable)

    return publish


def _dead_ids(store: LeaseStore, key: str) -> list[str]:
    return [e["t"] for e in (store.collection.find_one({"_id": key}) or {}).get("dead") or []]


@pytest.mark.parametrize("first", [A, B])
def test_a_run_timed_out_on_two_keys_is_ended_once(worker_app: celery.Celery, first: str) -> None:
    store, entry, calls = _setup(worker_app)
    keys: list[str] = []
    second = B if first == A else A
    results.write_timed_out(worker_app, store, first, [entry], publish=_publish(calls, keys))
    results.write_timed_out(worker_app, store, second, [entry], publish=_publish(calls, keys))
    assert calls == ["t-run"] and keys == [first]
    assert _dead_ids(store, A) == _dead_ids(store, B) == []
    assert worker_app.AsyncResult("t-run").state == "SUCCESS"


@pytest.mark.parametrize(("mine", "theirs", "ends_here"), [(B, A, False), (A, B, True)])
def test_when_another_writer_holds_the_other_key_the_first_key_s_writer_ends_it(
    worker_app: celery.Celery, mine: str, theirs: str, ends_here: bool
) -> None:
    store, entry, calls = _setup(worker_app)
    assert store.claim_one(theirs, "dead", "t-run") == "got"  # another writer, between its claim and write
    keys: list[str] = []
    results.write_timed_out(worker_app, store, mine, [entry], publish=_publish(calls, keys))
    assert calls == (["t-run"] if ends_here else [])
    # Forgotten here when ended here; else kept until the other writer's ending is known here.
    assert _dead_ids(store, mine) == ([] if ends_here else ["t-run"])
    assert _dead_ids(store, theirs) == ["t-run"]  # the other writer's to forget
    assert store.claim_one(theirs, "dead", "t-run") == "held"


def test_a_run_whose_first_key_s_writer_died_before_ending_it_is_ended_from_either_key(
    worker_app: celery.Celery,
) -> None:
    """The writer of the first key claimed the run there and died before its ending (its node crashed).
    The second key's writer, which left the run to it, kept its entry: once the claim lapses, a later pass
    ends the run once (before: the second key's writer had forgotten it, the later pass on the first key
    took it for ended there, and its result was never written: it stayed ``QUEUED``; lock-set checker,
    Redis seed 60)."""
    store, entry, calls = _setup(worker_app)
    assert store.claim_one(A, "dead", "t-run") == "got"  # the first key's writer, then it dies
    keys: list[str] = []
    results.write_timed_out(worker_app, store, B, [entry], publish=_publish(calls, keys))
    assert calls == []  # left to the first key's writer
    lapsed = _dt.datetime(2000, 1, 1, tzinfo=_dt.timezone.utc)
    for key in (A, B):  # both claims lapse (30 s on the server's clock)
        store.collection.update_one({"_id": key}, {"$set": {"dead.0.cl.at": lapsed}})
    results.write_timed_out(worker_app, store, A, [entry], publish=_publish(calls, keys))
    results.write_timed_out(worker_app, store, B, [entry], publish=_publish(calls, keys))
    assert calls == ["t-run"] and keys == [A]
    assert _dead_ids(store, A) == _dead_ids(store, B) == []
    assert worker_app.AsyncResult("t-run").state == "SUCCESS"


def test_a_run_another_writer_ended_and_forgot_is_not_ended_again(worker_app: celery.Celery) -> None:
    """The other key's writer ended it and forgot its entry (remembered there as over, ``seen``) before this
    writer looked: not ended again (a review of the first form: ``absent`` was taken for "never there")."""
    store, entry, calls = _setup(worker_app)
    assert store.claim_one(A, "dead", "t-run") == "got"
    store.forget_results(A, "dead", ["t-run"])  # (the other writer, after its ending)
    assert store.claim_one(A, "dead", "t-run", run_id="t-run/0") == "ended"
    keys: list[str] = []
    results.write_timed_out(worker_app, store, B, [entry], publish=_publish(calls, keys))
    assert calls == [] and _dead_ids(store, B) == []
