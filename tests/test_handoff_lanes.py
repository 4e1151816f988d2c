"""Handoff lanes with real ``celery worker`` processes (prefork) on Redis and RabbitMQ: a run handed a
``Queue`` key starts before the plain tasks queued ahead of it have drained (its message goes to its
queue's lane, which the workers read first), and without lanes it starts after them. Judged by order:
how many plain tasks of the backlog started after the handed run, never by a time."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from kombu import entity

from celery_mongolock.integration import lanes

from . import integration_app as it
from .servers import RedisServer, wait_for
from .test_integration import Cluster
from .workers import pointed_at

pytestmark = pytest.mark.slow

BACKLOG = 200
Queue: Any = entity.Queue  # untyped
Exchange: Any = entity.Exchange


@pytest.fixture(scope="module")
def cluster(
    broker_url: str, redis_server: RedisServer, mongo_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    db_name = f"mongolock_lane_{uuid.uuid4().hex[:8]}"
    c = Cluster(broker_url, mongo_url, db_name, tmp_path_factory.mktemp("lanes"), backend=redis_server.url)
    settings = {"mongolock_url": mongo_url, "mongolock_database": db_name}
    with pointed_at(it.app, broker_url, redis_server.url, **settings):
        try:
            yield c
        finally:
            c.close()


def handoff_behind_backlog(cluster: Cluster, priority: int | None = None) -> tuple[int, int, str]:
    """A holder of a key runs (one worker slot), a second run of the key parks (sent with ``priority``),
    a blocker takes the worker's other slot, ``BACKLOG`` plain tasks are queued (none can start: both
    slots are taken), then the holder ends. Returns how many plain tasks started before and after the
    handed run, and the handed run's tag."""
    resource, holder, handed, blocker = (uuid.uuid4().hex[:10] for _ in range(4))
    it.gated.delay(resource, holder)
    wait_for(lambda: cluster.runs(holder, "start"), timeout=60, message="the holder to start")
    if priority is None:
        it.queued.delay(resource, handed, 0.0)
    else:
        it.queued_own_priority.apply_async((resource, handed), priority=priority)
    key = f"resource:{resource}"
    wait_for(
        lambda: (cluster.store.collection.find_one({"_id": key}) or {}).get("q"),
        timeout=60,
        message="the second run to park",
    )
    it.gated.delay(uuid.uuid4().hex[:10], blocker)
    wait_for(lambda: cluster.runs(blocker, "start"), timeout=60, message="the blocker to start")
    batch = uuid.uuid4().hex[:8]
    with it.app.producer_or_acquire() as producer:
        for i in range(BACKLOG):
            it.plain_recorded.apply_async((f"{batch}-{i}", 0.02), producer=producer)
    cluster.db["gates"].insert_one({"_id": holder})
    start = wait_for(lambda: cluster.runs(handed, "start"), timeout=120, message="the handed run to start")[0]
    cluster.db["gates"].insert_one({"_id": blocker})

    def plain() -> list[dict[str, Any]]:
        return [r for r in cluster.runs(kind="plain") if r["tag"].startswith(batch)]

    wait_for(lambda: len(plain()) >= BACKLOG, timeout=120, message="the backlog to drain")
    before = sum(1 for r in plain() if r["mono"] < start["mono"])
    return before, BACKLOG - before, handed


def test_a_handed_run_starts_before_the_backlog_drains(cluster: Cluster) -> None:
    worker = cluster.worker(concurrency=2)
    try:
        before, after, _ = handoff_behind_backlog(cluster)
    finally:
        worker.stop()
    # The plain tasks the worker had reserved (prefetch 1 x 2 slots) start first; most of the backlog
    # waits behind the handed run.
    assert after >= BACKLOG // 2, (before, after)


def test_a_handed_run_sent_with_the_lowest_priority_starts_before_the_backlog_drains(
    cluster: Cluster,
) -> None:
    """Redis pops priority 0 of every queue before 9 of any: a lane message that kept the run's 9 waited
    for the whole backlog (the plain tasks have none: 0). The run's own priority is back in its request."""
    worker = cluster.worker(concurrency=2)
    try:
        before, after, handed = handoff_behind_backlog(cluster, priority=9)
    finally:
        worker.stop()
    assert after >= BACKLOG // 2, (before, after)
    [start] = cluster.runs(handed, "start")
    assert start["priority"] == 9, start


def test_without_lanes_the_handed_run_waits_for_the_backlog(cluster: Cluster) -> None:
    worker = cluster.worker(concurrency=2, env=cluster.env(MONGOLOCK_IT_HANDOFF_LANE="0"))
    try:
        before, after, _ = handoff_behind_backlog(cluster)
    finally:
        worker.stop()
    assert after == 0, (before, after)


def test_a_handed_run_that_retries_itself_runs_once_more(cluster: Cluster) -> None:
    """A run delivered through a lane whose body calls ``self.retry()``: the retry is published with the
    run's own routing (put back before its body) and runs."""
    worker = cluster.worker(concurrency=2)
    try:
        resource, holder, handed = (uuid.uuid4().hex[:10] for _ in range(3))
        it.gated.delay(resource, holder)
        wait_for(lambda: cluster.runs(holder, "start"), timeout=60, message="the holder to start")
        result = it.queued_retry.delay(resource, handed, 0.0)
        key = f"resource:{resource}"
        wait_for(
            lambda: (cluster.store.collection.find_one({"_id": key}) or {}).get("q"),
            timeout=60,
            message="the run to park",
        )
        cluster.db["gates"].insert_one({"_id": holder})
        assert result.get(timeout=120) == handed
        assert [r["kind"] for r in cluster.runs(handed)] == ["own-retry", "start", "end"]
    finally:
        worker.stop()


# -- pure logic: which lane, and the run's own routing back ------------------------------------------------
def test_the_lane_of_a_queue_is_declared_alike() -> None:
    base = Queue("jobs", Exchange("jobs", "direct"), "jobs", queue_arguments={"x-queue-type": "quorum"})
    lane = lanes.lane_for(base)
    assert lane.name == "jobs" + lanes.LANE_SUFFIX
    assert lane.routing_key == lane.name
    assert lane.exchange.name == lane.name
    assert lane.queue_arguments == {"x-queue-type": "quorum"}


def test_a_run_that_came_through_a_lane_is_routed_to_its_own_queue() -> None:
    from celery import Celery

    app = Celery("lanes", broker="memory://", set_as_current=False)
    app.conf.task_queues = [Queue("jobs", Exchange("work", "direct"), "jobs.key")]
    assert lanes.route_of(app, {"exchange": "work", "routing_key": "jobs.key"}).name == "jobs"
    assert lanes.route_of(app, {"queue": "jobs" + lanes.LANE_SUFFIX}).name == "jobs"
    assert lanes.route_of(app, {"exchange": "elsewhere", "routing_key": "x"}) is None
    lane = lanes.lane_of(app, {"exchange": "work", "routing_key": "jobs.key"})
    assert lane is not None
    assert lane[1] == {"exchange": "work", "routing_key": "jobs.key"}

    lane_route = "jobs" + lanes.LANE_SUFFIX
    request = SimpleNamespace(
        headers={"h": {"k": "key", "rt": {"exchange": "work", "routing_key": "jobs.key"}}},
        delivery_info={"exchange": lane_route, "routing_key": lane_route, "priority": 0},
    )
    lanes.restore_route(SimpleNamespace(request=request), "h")
    assert request.delivery_info == {"exchange": "work", "routing_key": "jobs.key", "priority": 0}
    # A run that did not come through a lane keeps its delivery as it is.
    plain = SimpleNamespace(headers={}, delivery_info={"exchange": "work", "routing_key": "other"})
    lanes.restore_route(SimpleNamespace(request=plain), "h")
    assert plain.delivery_info == {"exchange": "work", "routing_key": "other"}


def test_on_redis_a_run_with_a_priority_keeps_it_in_its_route_and_goes_to_the_lane_with_0() -> None:
    from celery import Celery

    for broker, kept in (("redis://localhost:1/0", True), ("amqp://guest@localhost:1//", False)):
        app = Celery("lanes", broker=broker, set_as_current=False)
        app.conf.task_queues = [Queue("jobs", Exchange("work", "direct"), "jobs.key")]
        app.conf.task_routes = {"lanes.routed": {"queue": "jobs", "priority": 6}}
        app.conf.task_default_priority = None

        route = {"exchange": "work", "routing_key": "jobs.key"}
        for options, task, own in (
            ({"queue": "jobs", "priority": 9}, None, 9),
            ({"queue": "jobs"}, "lanes.routed", 6),  # its route's priority, as Celery fills it in
            ({"queue": "jobs", "priority": 0}, "lanes.routed", None),  # already the first popped: unchanged
            ({"queue": "jobs"}, None, None),
        ):
            lane = lanes.lane_of(app, options, task)
            assert lane is not None
            expected = {**route, "pr": own} if own is not None and kept else route
            assert lane[1] == expected, (broker, options, task)
            published: dict[str, Any] = {}
            signature = SimpleNamespace(options=dict(options))
            headers: dict[str, Any] = {"h": {}}
            assert lanes.publish_to_lane(signature, headers, "h", lane, published.update)
            assert published.get("priority") == (lanes.URGENT_PRIORITY if "pr" in expected else None)
            assert published["queue"].name == "jobs" + lanes.LANE_SUFFIX

    # Before its body, its own priority is back (a retry or a park again carries it: its rank on its key).
    lane_route = "jobs" + lanes.LANE_SUFFIX
    request = SimpleNamespace(
        headers={"h": {"k": "key", "rt": {**route, "pr": 9}}},
        delivery_info={"exchange": lane_route, "routing_key": lane_route, "priority": 0},
    )
    lanes.restore_route(SimpleNamespace(request=request), "h")
    assert request.delivery_info == {**route, "priority": 9}
