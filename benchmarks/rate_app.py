"""The Celery app that ``benchmarks/rate.py`` runs in a real ``celery worker`` (prefork).

Configured from the environment by the benchmark: ``BENCH_BROKER``, ``BENCH_MONGODB_URL``, ``BENCH_DB``,
``BENCH_READY_DIR`` (the worker's ready marker), ``BENCH_RATE_N`` and ``BENCH_RATE_PERIOD`` (the rate).
Every run records its start on the server's clock (``$$NOW``) in the ``starts`` collection.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import worker_ready
from pymongo import MongoClient

from celery_mongolock import RateLimit, Wait, singleton_task

app = Celery("rate_app")
app.conf.update(
    broker_url=os.environ.get("BENCH_BROKER", "memory://"),
    result_backend=None,
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    worker_send_task_events=False,
    worker_prefetch_multiplier=1,
    task_acks_late=True,
    mongolock_url=os.environ.get("BENCH_MONGODB_URL", "mongodb://127.0.0.1:27017"),
    mongolock_database=os.environ.get("BENCH_DB", "mongolock_bench"),
)
RATE = RateLimit(int(os.environ.get("BENCH_RATE_N", "10")), float(os.environ.get("BENCH_RATE_PERIOD", "5")))
_clients: dict[int, MongoClient[dict[str, Any]]] = {}


def _db() -> Any:
    pid = os.getpid()
    if pid not in _clients:
        _clients[pid] = MongoClient(app.conf.mongolock_url)
    return _clients[pid][app.conf.mongolock_database]


@worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    Path(os.environ["BENCH_READY_DIR"], f"{sender.hostname}.ready").write_text(str(os.getpid()))


@singleton_task(key="api:{tenant}", rate=RATE, on_contention=Wait(), app=app, name="rate_app.rated")
def rated(tenant: str, i: int) -> None:
    _db()["starts"].update_one(
        {"_id": f"{tenant}/{i}"}, [{"$set": {"at": "$$NOW", "t": tenant}}], upsert=True
    )
