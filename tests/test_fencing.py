"""Fenced writes: a holder paused past its lease (SIGSTOP) cannot overwrite its successor's work."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from pymongo import MongoClient
from pymongo.errors import DuplicateKeyError

from celery_mongolock import ConfigurationError, LeaseStore
from celery_mongolock.fencing import FencedOut, fenced_update_one

from .servers import wait_for
from .test_clock_skew import Agent


@pytest.fixture
def coll(client: MongoClient[dict[str, Any]], db_name: str) -> Iterator[Any]:
    yield client[db_name]["protected"]
    client.drop_database(db_name)


def test_newer_fences_write_older_ones_are_refused(coll: Any) -> None:
    coll.insert_one({"_id": "g", "members": []})
    assert fenced_update_one(coll, {"_id": "g"}, {"$set": {"members": ["a"]}}, 10).matched_count == 1
    assert (
        fenced_update_one(coll, {"_id": "g"}, {"$push": {"members": "b"}}, 10).matched_count == 1
    )  # same fence
    assert fenced_update_one(coll, {"_id": "g"}, {"$set": {"members": ["c"]}}, 11).matched_count == 1
    with pytest.raises(FencedOut) as exc:
        fenced_update_one(coll, {"_id": "g"}, {"$set": {"members": ["stale"]}}, 10)
    assert exc.value.newer == 11 and exc.value.fence == 10
    assert coll.find_one({"_id": "g"}) == {"_id": "g", "members": ["c"], "fence": 11}


def test_upsert_and_pipeline_updates(coll: Any) -> None:
    fenced_update_one(coll, {"_id": "new"}, {"$set": {"x": 1}}, 5, upsert=True)
    fenced_update_one(coll, {"_id": "new"}, [{"$set": {"x": {"$add": ["$x", 1]}}}], 6)
    assert coll.find_one({"_id": "new"}) == {"_id": "new", "x": 2, "fence": 6}
    with pytest.raises(FencedOut):
        fenced_update_one(coll, {"_id": "new"}, {"$set": {"x": 0}}, 4, upsert=True)
    assert coll.count_documents({}) == 1
    assert fenced_update_one(coll, {"_id": "absent"}, {"$set": {"x": 1}}, 9).matched_count == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lease_or_fence": True}, "bool"),
        ({"lease_or_fence": "7"}, "Lease or an int"),
        ({"fence_field": "$f"}, "plain field"),
        ({"upsert": True, "filter": {"name": "x"}}, "_id"),
        ({"update": {"x": 1}}, "operators"),
    ],
)
def test_bad_arguments(coll: Any, kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"filter": {"_id": 1}, "update": {"$set": {"x": 1}}, "lease_or_fence": 1, **kwargs}
    with pytest.raises(ConfigurationError, match=match):
        fenced_update_one(coll, args.pop("filter"), args.pop("update"), args.pop("lease_or_fence"), **args)


def test_a_holder_paused_past_its_lease_is_fenced_out(mongo_url: str, db_name: str) -> None:
    paused = Agent(mongo_url, db_name)
    store = LeaseStore(mongo_url, database=db_name)
    try:
        assert paused.ask("acquire k 1 0")["ok"]  # a 1 s lease
        assert paused.ask("fenced k")["ok"]
        os.kill(paused.proc.pid, signal.SIGSTOP)  # paused (GC, swap, SIGSTOP) past its lease
        successor = wait_for(lambda: store.acquire("k", ttl=30), timeout=10, message="takeover")
        assert successor is not None
        fenced_update_one(store.client[db_name]["protected"], {"_id": "k"}, {"$inc": {"n": 1}}, successor)
        os.kill(paused.proc.pid, signal.SIGCONT)
        late = paused.ask("fenced k")  # it wakes up and writes as if it still held the lease
        assert not late["ok"] and "newer holder" in late["error"]
        doc = store.client[db_name]["protected"].find_one({"_id": "k"})
        assert doc is not None and doc["n"] == 2 and doc["fence"] == successor.fence
    finally:
        paused.close()
        store.client.drop_database(db_name)
        store.close()


def test_upsert_onto_a_document_that_does_not_match_the_rest_of_the_filter(coll: Any) -> None:
    """As ``update_one(upsert=True)``: the insert collides with the existing ``_id`` (not a fence issue)."""
    coll.insert_one({"_id": "g", "state": "done", "fence": 5})
    with pytest.raises(DuplicateKeyError):
        fenced_update_one(coll, {"_id": "g", "state": "new"}, {"$set": {"x": 1}}, 7, upsert=True)
    assert coll.find_one({"_id": "g"}) == {"_id": "g", "state": "done", "fence": 5}
