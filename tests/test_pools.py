"""The threads and solo pools: several tasks in one process share its heartbeat and must not overlap."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator

import pytest

from . import integration_app as it
from .servers import RedisServer
from .test_integration import Cluster, intervals, tag

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool_cluster(
    redis_server: RedisServer, mongo_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    db_name = f"mongolock_pool_{uuid.uuid4().hex[:8]}"
    # The same broker URL as the other modules (the app's producer pool, once made, keeps its URL);
    # a queue of its own per worker keeps the messages apart.
    broker = redis_server.url
    c = Cluster(broker, mongo_url, db_name, tmp_path_factory.mktemp("pools"))
    it.app.conf.update(
        broker_url=broker,
        result_backend=broker,
        mongolock_url=mongo_url,
        mongolock_database=db_name,
        mongolock_lease_seconds=3.0,
    )
    for attr in ("_mongolock_settings", "_mongolock_store"):
        it.app.__dict__.pop(attr, None)
    try:
        yield c
    finally:
        c.close()


@pytest.mark.parametrize("pool", ["threads", "solo"])
def test_one_key_never_overlaps_and_current_lease_is_per_task(pool_cluster: Cluster, pool: str) -> None:
    concurrency = 4 if pool == "threads" else 1
    queue = f"pool-{pool}-{uuid.uuid4().hex[:6]}"
    worker = pool_cluster.worker(
        name=f"{pool}{uuid.uuid4().hex[:4]}@localhost",
        concurrency=concurrency,
        extra_args=[f"--pool={pool}", "-Q", queue],
    )
    try:
        resource = tag()
        same = [tag() for _ in range(4)]
        results = [it.guarded.apply_async((resource, t, 0.3), queue=queue) for t in same]
        # Different keys at once: with threads they run side by side in one process.
        other = [tag() for _ in range(3)]
        results += [it.guarded.apply_async((tag(), t, 0.3), queue=queue) for t in other]
        assert [r.get(timeout=120) for r in results] == same + other

        spans = intervals(pool_cluster, same)
        for (_, e1, f1), (s2, _, f2) in itertools.pairwise(spans):
            assert e1 <= s2, f"{pool}: two runs for one key overlapped"
            assert f1 < f2, f"{pool}: fences must increase in run order"
        # Each run saw its own lease (current_lease() is per task, not per process).
        for t in same + other:
            (start,) = pool_cluster.runs(t, "start")
            (end,) = pool_cluster.runs(t, "end")
            assert start["key"] == end["key"] and start["fence"] == end["fence"]
        keys = {pool_cluster.runs(t, "start")[0]["key"] for t in other}
        assert len(keys) == len(other)
        # Both pools run every task in the worker's own process (no prefork child): that is how we know
        # the worker runs with --pool={pool}, not from Celery's start-up banner, which is worded its way.
        pids = {pool_cluster.runs(t, "start")[0]["pid"] for t in same + other}
        assert worker.proc is not None
        assert pids == {worker.proc.pid}, f"{pool}: the tasks ran in {pids}, not in the worker's process"
        # Nothing is left held.
        key = f"resource:{resource}"
        assert [i.key for i in pool_cluster.store.list(prefix=key, include_free=True)] == [key]
        assert pool_cluster.store.list(prefix=key) == []
    finally:
        worker.stop()
        pool_cluster.workers.remove(worker)
