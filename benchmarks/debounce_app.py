"""The Celery app that ``benchmarks/debounce.py`` runs in a real ``celery worker`` (prefork).

Configured from the environment by the benchmark: ``BENCH_BROKER``, ``BENCH_MONGODB_URL``, ``BENCH_DB``,
``BENCH_READY_DIR`` (the worker's ready marker), ``BENCH_DEBOUNCE`` and ``BENCH_MAX_WAIT`` (the policy).
Every body records its start (``time.time()``, the machine's clock, as the benchmark's sends do) in the
``starts`` collection.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import worker_ready
from pymongo import MongoClient

from celery_mongolock import Replace, singleton_task

app = Celery("debounce_app")
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
DEBOUNCE = float(os.environ.get("BENCH_DEBOUNCE", "1"))
MAX_WAIT = float(os.environ.get("BENCH_MAX_WAIT", "3"))
_clients: dict[int, MongoClient[dict[str, Any]]] = {}


def _db() -> Any:
    pid = os.getpid()
    if pid not in _clients:
        _clients[pid] = MongoClient(app.conf.mongolock_url)
    return _clients[pid][app.conf.mongolock_database]


def _started(kind: str, i: int) -> None:
    _db()["starts"].insert_one({"kind": kind, "i": i, "at": time.time()})


@worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    Path(os.environ["BENCH_READY_DIR"], f"{sender.hostname}.ready").write_text(str(os.getpid()))


@singleton_task(
    key="doc:{doc}", on_contention=Replace(debounce=DEBOUNCE), app=app, name="debounce_app.debounced"
)
def debounced(doc: str, kind: str, i: int) -> None:
    _started(kind, i)


@singleton_task(
    key="doc:{doc}",
    on_contention=Replace(debounce=DEBOUNCE, max_wait=MAX_WAIT),
    app=app,
    name="debounce_app.capped",
)
def capped(doc: str, kind: str, i: int) -> None:
    _started(kind, i)


@singleton_task(
    keys=("doc:{a}", "doc:{b}"),
    on_contention=Replace(debounce=DEBOUNCE, max_wait=MAX_WAIT),
    app=app,
    name="debounce_app.capped_pair",
)
def capped_pair(a: str, b: str, kind: str, i: int) -> None:
    _started(kind, i)


@app.task(name="debounce_app.plain")
def plain(kind: str, i: int) -> None:
    _started(kind, i)
