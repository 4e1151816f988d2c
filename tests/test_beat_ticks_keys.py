"""Beat ticks of a task with ``keys=(...)``, with real ``celery worker`` processes (prefork) on each broker.

Our beat claims each tick of each schedule entry once before it sends it (``ops.beat``). A task of one
``key=`` also records the tick on its key (a second send of a tick finds it run); a task of ``keys=`` does
not, since two entries whose key sets overlap (``merge(a, b)`` and ``merge(b, c)``) would then refuse each
other's ticks: the keys' records are per key, not per entry. Found by review of the one admission path,
which at first recorded the tick on every key of a set."""

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


def _tick(entry: str, tick: int, window: float = 600.0) -> dict[str, Any]:
    """The header our beat scheduler stamps on a tick's message."""
    return {BEAT_HEADER: {"tick": tick, "window": window, "entry": entry}}


@pytest.mark.parametrize("task", [it.merge, it.merge_queued], ids=["retry", "queue"])
def test_ticks_of_two_entries_whose_key_sets_overlap_both_run(cluster: Cluster, task: Any) -> None:
    a, b, c = tag(), tag(), tag()
    first, second = tag(), tag()
    tick = int(time.time() * 1000)
    r1 = task.apply_async((a, b, first, 0.1), headers=_tick("merge-a-b", tick))
    assert r1.get(timeout=60) == sorted([f"resource:{a}", f"resource:{b}"])
    # The other entry's run of the same tick shares resource:b: it runs too.
    r2 = task.apply_async((b, c, second, 0.1), headers=_tick("merge-b-c", tick))
    assert r2.get(timeout=60) == sorted([f"resource:{b}", f"resource:{c}"])
    assert len(cluster.runs(first, "start")) == 1
    assert len(cluster.runs(second, "start")) == 1
