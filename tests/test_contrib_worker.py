"""Singleton tasks in Celery's own in-process test worker (``celery.contrib.testing.worker.start_worker``,
what ``celery.contrib.pytest``'s ``celery_worker`` fixture starts), solo and threads pools, on the embedded
MongoDB-compatible server and the in-memory broker: what a user's own test suite runs
(docs/how-to/testing.md). Such a worker has no prefork children: it cannot show a killed child's lease
released by its parent, or a handoff between worker processes."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_mongolock import Queue, Skip, singleton_task
from celery_mongolock.config import get_store
from celery_mongolock.testing import configure, holding, wait_for


@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_singleton_tasks_in_celerys_in_process_test_worker(pool: str, mongo_url: str, db_name: str) -> None:
    app = Celery(f"contrib_{pool}_{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(broker_url="memory://", result_backend="cache+memory://", task_acks_late=True)
    configure(app, mongo_url, database=db_name)
    order: list[int] = []
    started = threading.Event()

    @singleton_task(app=app, name=f"{app.main}.upload", key="group:{group_id}", on_contention=Skip())
    def upload(group_id: int) -> str:
        return f"uploaded {group_id}"

    @singleton_task(app=app, name=f"{app.main}.post", key="ledger:{account}", on_contention=Queue())
    def post(account: str, n: int) -> int:
        started.set()
        order.append(n)
        return n

    concurrency = 1 if pool == "solo" else 3
    with start_worker(app, pool=pool, concurrency=concurrency, perform_ping_check=False, loglevel="WARNING"):
        assert upload.delay(1).get(timeout=30) == "uploaded 1"
        # Skip: the key is held (by the test, as another run would): the run ends saying why.
        with holding(app, "group:1"):
            skipped: Any = upload.delay(1).get(timeout=30)
        assert skipped["mongolock"] == "skipped" and skipped["key"] == "group:1"
        # Queue: three runs park while the key is held; released, they run in the order they were sent.
        with holding(app, "ledger:a"):
            results = [post.delay("a", n) for n in range(3)]
            store = get_store(app)

            def all_parked() -> bool:
                info = store.inspect("ledger:a")
                return info is not None and len(info.parked) == 3

            wait_for(all_parked, timeout=30, message="the three runs to park")
            assert not started.is_set()  # no body ran while the key was held
        assert [r.get(timeout=30) for r in results] == [0, 1, 2]
        assert order == [0, 1, 2]
