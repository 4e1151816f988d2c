"""A Celery app for the observability tests (Celery events, Prometheus metrics), run by real workers.

Configured from the environment: MONGOLOCK_OBS_BROKER, MONGOLOCK_OBS_MONGODB_URL, MONGOLOCK_OBS_DB,
MONGOLOCK_OBS_READY_DIR; MONGOLOCK_OBS_METRICS_PORT turns the Prometheus metrics on.
A held run keeps its key until the test opens its gate (a document in the ``gates`` collection), or until
it learns its lease was lost.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import worker_ready
from pymongo import MongoClient

from celery_mongolock import Queue, Replace, Skip, Wait, current_lease, metrics, singleton_task

if os.environ.get("MONGOLOCK_OBS_METRICS_PORT"):
    metrics.enable(port=int(os.environ["MONGOLOCK_OBS_METRICS_PORT"]))

app = Celery("observability_app")
app.conf.update(
    broker_url=os.environ.get("MONGOLOCK_OBS_BROKER", "memory://"),
    result_backend=os.environ.get("MONGOLOCK_OBS_BROKER", "cache+memory://"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    worker_prefetch_multiplier=1,
    mongolock_url=os.environ.get("MONGOLOCK_OBS_MONGODB_URL", "mongodb://127.0.0.1:27017"),
    mongolock_database=os.environ.get("MONGOLOCK_OBS_DB", "mongolock_obs"),
    mongolock_lease_seconds=3.0,
)

_clients: dict[int, MongoClient[dict[str, Any]]] = {}


def gates() -> Any:
    pid = os.getpid()
    if pid not in _clients:
        _clients[pid] = MongoClient(app.conf.mongolock_url)
    return _clients[pid][app.conf.mongolock_database]["gates"]


@worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    ready_dir = os.environ.get("MONGOLOCK_OBS_READY_DIR")
    if ready_dir:
        Path(ready_dir, f"{getattr(sender, 'hostname', 'worker')}.ready").write_text(str(os.getpid()))


def _hold(gate: str) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        lease = current_lease()
        if lease is not None and lease.lost:
            return "lost"
        if gates().find_one({"_id": gate}):
            return "done"
        time.sleep(0.02)
    return "timeout"


@singleton_task(key="res:{resource}", app=app, name="observability_app.hold")
def hold(resource: str, gate: str) -> str:
    return _hold(gate)


@singleton_task(key="res:{resource}", app=app, name="observability_app.skipper", on_contention=Skip())
def skipper(resource: str, gate: str) -> str:
    return _hold(gate)


@singleton_task(
    key="res:{resource}", app=app, name="observability_app.waiter", on_contention=Wait(timeout=30)
)
def waiter(resource: str, gate: str) -> str:
    return _hold(gate)


@singleton_task(key="res:{resource}", app=app, name="observability_app.queued", on_contention=Queue())
def queued(resource: str, gate: str) -> str:
    return _hold(gate)


@singleton_task(key="res:{resource}", app=app, name="observability_app.latest", on_contention=Replace())
def latest(resource: str, gate: str) -> str:
    return _hold(gate)
