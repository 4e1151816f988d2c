"""Priority inside a key's queue (``Queue``): a run sent with Celery's ``priority`` is handed the key before
runs parked earlier with a lower priority, send order within one priority. The order is the broker's own:
Redis delivers a lower number first (a message without one counts as 0), RabbitMQ a higher one
(``integration.priority``). The unit tests need no server; the store's on the embedded server; the last
with real ``celery worker`` processes on each broker."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from celery_mongolock import LeaseStore, Queue, Replace
from celery_mongolock.integration import priority
from celery_mongolock.ops import cli_queue

from . import integration_app as it
from .servers import RedisServer, wait_for
from .test_admission_store import Handoffs, entry, parked
from .test_integration import Cluster, running_cluster

KEY = "ledger:7"


# -- the rank (no server) --------------------------------------------------------------------------------
def _request(value: object) -> Any:
    return SimpleNamespace(delivery_info={"priority": value})


@pytest.mark.parametrize(
    ("broker", "value", "expected"),
    [
        ("redis://127.0.0.1:1/0", 9, 9),
        ("redis://127.0.0.1:1/0", 0, 0),
        ("redis://127.0.0.1:1/0", None, 0),
        ("amqp://guest@127.0.0.1:1//", 9, -9),
        ("amqp://guest@127.0.0.1:1//", None, 0),
        ("amqp://guest@127.0.0.1:1//", 300, -255),
        ("amqp://guest@127.0.0.1:1//", -4, 0),
        ("amqp://guest@127.0.0.1:1//", "high", 0),
        ("amqp://guest@127.0.0.1:1//", True, 0),
        ("memory://", 3, -3),
    ],
)
def test_a_runs_rank_is_its_priority_as_its_broker_orders_it(
    broker: str, value: object, expected: int
) -> None:
    app = Celery("rank", broker=broker, set_as_current=False)
    assert priority.rank(app, _request(value)) == expected


def test_the_rank_follows_the_apps_broker_when_it_changes() -> None:
    app = Celery("rank", broker="redis://127.0.0.1:1/0", set_as_current=False)
    assert priority.rank(app, _request(2)) == 2
    app.conf.broker_url = "amqp://guest@127.0.0.1:1//"
    assert priority.rank(app, _request(2)) == -2


def test_only_queue_runs_carry_a_rank() -> None:
    app = Celery("rank", broker="amqp://guest@127.0.0.1:1//", set_as_current=False)
    assert priority.rank_field(app, _request(5), Queue()) == {"pr": -5}
    assert priority.rank_field(app, _request(0), Queue()) == {}
    # Replace: the newest send wins, whatever its priority.
    assert priority.rank_field(app, _request(5), Replace()) == {}


# -- the store (embedded server) ---------------------------------------------------------------------------
def test_runs_park_by_rank_then_send_order_and_the_key_goes_to_the_first(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    holder = store.acquire(KEY, 30)
    assert holder is not None
    for stamp, rank in ((10, 0), (20, -5), (30, -5), (5, 3)):
        lease, doc = store.admit(KEY, entry(stamp, pr=rank) if rank else entry(stamp))
        assert lease is None and doc["lo"] == "parked"
    assert parked(store, KEY) == ["task-20", "task-30", "task-10", "task-5"]
    # What an operator sees (``celery mongolock queue KEY``): the runs in the order they will get the key.
    info = store.inspect(KEY)
    assert info is not None
    assert [(run["task_id"], run["rank"]) for run in info.parked] == [
        ("task-20", -5),
        ("task-30", -5),
        ("task-10", 0),
        ("task-5", 3),
    ]
    lines = cli_queue.queue_lines(info, 1, 10)
    assert "task-20" in lines[1] and "priority 5" in lines[1] and "priority" not in lines[3]
    assert holder.release()
    assert handoffs.tasks == ["task-20"]
    # A later send of a better rank parks ahead of the rest, never ahead of the handoff already made.
    _, doc = store.admit(KEY, entry(40, pr=-9))
    assert doc["lo"] == "parked"
    assert parked(store, KEY) == ["task-40", "task-30", "task-10", "task-5"]
    claimed, doc = store.admit(KEY, entry(20, pr=-5), claim=handoffs.seen[0][1]["tk"])
    assert claimed is not None and doc["lo"] == "claimed"
    claimed.release()
    assert handoffs.tasks == ["task-20", "task-40"]


def test_a_run_of_a_better_rank_does_not_take_a_free_key_from_the_runs_ahead_of_it(store: LeaseStore) -> None:
    """The engine's "first in line": a run takes a free key only if no live parked run is ahead of it."""
    handoffs = Handoffs(store)
    holder = store.acquire(KEY, 30)
    assert holder is not None
    store.admit(KEY, entry(10, pr=-1))
    assert holder.release()
    assert handoffs.tasks == ["task-10"]
    # The key is handed (not claimed yet): a run of a better rank still parks.
    _, doc = store.admit(KEY, entry(20, pr=-9))
    assert doc["lo"] == "parked"


def test_slots_of_a_limit_are_handed_by_rank(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    holders = [store.acquire(KEY, 30, limit=2) for _ in range(2)]
    assert all(holders)
    for stamp, rank in ((10, 0), (20, -2), (30, -1)):
        _, doc = store.admit(KEY, entry(stamp, pr=rank) if rank else entry(stamp), limit=2)
        assert doc["lo"] == "parked"
    for lease in holders:
        assert lease is not None and lease.release()
    assert handoffs.tasks == ["task-20", "task-30"]


# -- real workers, both brokers ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(
    broker_url: str, redis_server: RedisServer, mongo_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """Worker nodes on each broker in turn (Redis, then RabbitMQ), results in Redis."""
    with running_cluster("prio", broker_url, redis_server.url, mongo_url, tmp_path_factory) as c:
        yield c


def _tag() -> str:
    return uuid.uuid4().hex[:10]


@pytest.mark.slow
def test_a_run_sent_with_a_higher_priority_is_handed_the_key_first(cluster: Cluster, broker_url: str) -> None:
    """While a run holds the key, two runs are sent with a low priority and then two with a high one; once
    the holder ends, the high ones run first, each pair in send order. High and low as the broker means
    them: on Redis 0 is the highest (and a run without a priority counts as 0), on RabbitMQ 9."""
    high, low = (0, 9) if broker_url.startswith("redis") else (9, 0)
    resource, holder = _tag(), _tag()
    key = f"resource:{resource}"
    it.gated.delay(resource, holder)
    wait_for(lambda: cluster.runs(holder, "start"), timeout=60, message="the holder to start")
    lows, highs = [_tag(), _tag()], [_tag(), _tag()]
    results = [it.queued.apply_async((resource, t, 0.05), priority=low) for t in lows]
    wait_for(lambda: len(_parked(cluster, key)) == 2, timeout=60, message="the low runs to park")
    results += [it.queued.apply_async((resource, t, 0.05), priority=high) for t in highs]
    wait_for(lambda: len(_parked(cluster, key)) == 4, timeout=60, message="the high runs to park")
    tag_of = {r.id: t for r, t in zip(results, [*lows, *highs], strict=True)}
    assert [tag_of.get(e["t"]) for e in _parked(cluster, key)] == [*highs, *lows]
    cluster.db["gates"].insert_one({"_id": holder})
    assert [r.get(timeout=120) for r in results] == [*lows, *highs]
    started = sorted(
        (r for r in cluster.runs(kind="start") if r["tag"] in lows + highs), key=lambda r: r["t"]
    )
    assert [r["tag"] for r in started] == [*highs, *lows]


def _parked(cluster: Cluster, key: str) -> list[dict[str, Any]]:
    doc = cluster.store.collection.find_one({"_id": key}) or {}
    return list(doc.get("q") or [])


def test_a_run_does_not_pass_an_older_one_parked_behind_a_handoff_gone_back_to_the_front(
    store: LeaseStore,
) -> None:
    """The lock-set checker's seed 1 (this stop, Redis), on a ``limit=N`` key: a slot handed to a parked
    run R expired unclaimed, and R went back to the front of the queue (its turn goes on), ahead of an
    older run A parked meanwhile. A run B, sent after A and before R, then took the free slot: the admit
    compared B with the head (R) only. It parks behind A now."""
    handoffs = Handoffs(store)
    h1, h2 = store.acquire(KEY, 30, limit=2), store.acquire(KEY, 30, limit=2)
    assert h1 is not None and h2 is not None
    _, doc = store.admit(KEY, entry(50, "R"), limit=2, ttl=0.5)
    assert doc["lo"] == "parked"
    assert h1.release()
    assert handoffs.tasks == ["R"]  # a slot handed to R, which never claims it
    _, doc = store.admit(KEY, entry(10, "A"), limit=2)
    assert doc["lo"] == "parked"

    def handoff_expired() -> bool:
        # (in milliseconds: the embedded server compares dates inside expressions wrongly)
        past = {"$lt": [{"$toLong": "$$h.x"}, {"$toLong": "$$NOW"}]}
        late = {"$and": [{"$ne": [{"$ifNull": ["$$h.ho", None]}, None]}, past]}
        expr = {"$anyElementTrue": [{"$map": {"input": {"$ifNull": ["$hs", []]}, "as": "h", "in": late}}]}
        return store.collection.count_documents({"_id": KEY, "$expr": expr}) == 1

    wait_for(handoff_expired, timeout=30, message="R's handoff to expire on the server's clock")
    lease, doc = store.admit(KEY, entry(20, "B"), limit=2)
    assert lease is None and doc["lo"] == "parked", doc["lo"]
    # The free slot went to the first in send order, A, in the same command; B waits behind R.
    assert handoffs.tasks == ["R", "A"]
    assert parked(store, KEY) == ["B", "R"]
