"""A beat tick runs once whatever the shape of its task's key set, with real ``celery worker`` processes
(prefork) on each broker: a tick sent twice (two beats at a failover both sent it, see
``ops.beat.Scheduler``) runs its body once, and the second send ends ``skipped`` saying the tick already
ran. Before runs of several keys were admitted by the one plain path (``integration.plain_run``), a task
with ``keys=(...)`` recorded no tick on its keys: the second send of a tick ran the body again."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from celery_mongolock.integration.headers import BEAT_HEADER

from . import integration_app as it
from .servers import RedisServer
from .test_integration import Cluster, running_cluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(
    broker_url: str, redis_server: RedisServer, mongo_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """Worker nodes on each broker in turn (Redis, then RabbitMQ), results in Redis."""
    with running_cluster("bt", broker_url, redis_server.url, mongo_url, tmp_path_factory) as c:
        yield c


def tag() -> str:
    return uuid.uuid4().hex[:10]


def _tick(window: float = 30.0) -> dict[str, Any]:
    """The header our beat scheduler stamps on a tick's message."""
    return {BEAT_HEADER: {"tick": int(time.time() * 1000), "window": window, "entry": "e"}}


@pytest.mark.parametrize("task", [it.merge, it.merge_queued], ids=["retry", "queue"])
def test_a_tick_of_a_several_keys_task_sent_twice_runs_once(cluster: Cluster, task: Any) -> None:
    src, dst = tag(), tag()
    first, second = tag(), tag()
    headers = _tick()
    r1 = task.apply_async((src, dst, first, 0.1), headers=headers)
    r1.get(timeout=60)
    # The second beat's send of the same tick, after the first run ended: refused on its keys.
    r2 = task.apply_async((src, dst, second, 0.1), headers=headers)
    result = r2.get(timeout=60)
    assert isinstance(result, dict) and result.get("mongolock") == "skipped", result
    assert "already ran" in str(result.get("reason")), result
    assert cluster.runs(second, "start") == []
    assert len(cluster.runs(first, "start")) == 1


def test_a_tick_of_a_several_keys_task_holds_its_keys_to_the_end_of_its_window(cluster: Cluster) -> None:
    """Like a tick of one key: its keys stay held (a minimum hold) until shortly before the next tick,
    so that a run of another task on one of them does not slip in between two sends of the tick."""
    src, dst, t = tag(), tag(), tag()
    headers = _tick(window=600.0)
    it.merge.apply_async((src, dst, t, 0.1), headers=headers).get(timeout=60)
    for key in (f"resource:{src}", f"resource:{dst}"):
        info = cluster.store.inspect(key)
        assert info is not None and info.held, f"{key} was freed before its tick's window ended"


def test_the_next_tick_of_a_several_keys_task_runs(cluster: Cluster) -> None:
    src, dst, a, b = tag(), tag(), tag(), tag()
    first = _tick(window=1.0)
    it.merge.apply_async((src, dst, a, 0.1), headers=first).get(timeout=60)
    nxt = {BEAT_HEADER: {**first[BEAT_HEADER], "tick": first[BEAT_HEADER]["tick"] + 1000}}
    result = it.merge.apply_async((src, dst, b, 0.1), headers=nxt).get(timeout=60)
    assert not (isinstance(result, dict) and result.get("mongolock")), result
    assert len(cluster.runs(b, "start")) == 1
