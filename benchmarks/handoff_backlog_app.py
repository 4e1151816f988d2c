"""The Celery app that ``benchmarks/handoff_backlog.py`` runs in a real ``celery worker`` (prefork).

Configured from the environment by the benchmark (not meant to be used on its own): ``HB_BROKER``,
``HB_MONGODB_URL``, ``HB_DB``, ``HB_READY_DIR`` (a marker file when the worker is ready),
``HB_EVENTS_DIR`` (every process appends its events there, one JSON object a line, times from
``time.monotonic()``: one clock for every process on the machine), ``HB_LANE`` (``0``: handoff lanes
off, the handed run's message goes to the end of its queue as before them).

Tasks: ``keyed(run, role, gate)`` (``Queue()`` on the key ``hb:<run>``: the holder waits until the file
``gate`` exists, the parked run just records its start), ``blocker(run, gate)`` (a plain task that holds
a worker slot until ``gate`` exists) and ``plain(run, i, seconds)`` (the backlog: a plain task that
records its start and sleeps ``seconds``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import worker_ready

from celery_mongolock import Queue, singleton_task
from celery_mongolock.signals import lease_released, run_parked

app = Celery("handoff_backlog_app")
app.conf.update(
    broker_url=os.environ.get("HB_BROKER", "memory://"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    worker_send_task_events=False,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    broker_transport_options={"confirm_publish": True},
    mongolock_url=os.environ.get("HB_MONGODB_URL", "mongodb://127.0.0.1:27017"),
    mongolock_database=os.environ.get("HB_DB", "mongolock_bench_handoff_backlog"),
    mongolock_handoff_lane=os.environ.get("HB_LANE", "1") != "0",
)

_fd: dict[int, int] = {}


def emit(ev: str, **fields: Any) -> None:
    """Append one event to this process's file (a single ``write``: whole lines)."""
    directory = os.environ.get("HB_EVENTS_DIR")
    if not directory:
        return
    pid = os.getpid()
    fd = _fd.get(pid)
    if fd is None:
        fd = os.open(Path(directory, f"{pid}.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        _fd[pid] = fd
    os.write(fd, (json.dumps({"ev": ev, "t": time.monotonic(), **fields}) + "\n").encode())


@worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    ready_dir = os.environ.get("HB_READY_DIR")
    if ready_dir:
        Path(ready_dir, f"{getattr(sender, 'hostname', 'worker')}.ready").write_text("{}")


def _wait_for_gate(gate: str) -> None:
    while not os.path.exists(gate):
        time.sleep(0.001)


@lease_released.connect
def _released(sender: Any = None, key: str = "", **_: Any) -> None:
    """After the release command returned, having published the handoff it made."""
    emit("released", run=key.removeprefix("hb:"))


@run_parked.connect
def _parked(sender: Any = None, key: str = "", **_: Any) -> None:
    emit("parked", run=key.removeprefix("hb:"))


@singleton_task(key="hb:{run}", app=app, name="hb.keyed", on_contention=Queue())
def keyed(run: str, role: str, gate: str) -> None:
    emit("start", run=run, role=role)
    if role == "holder":
        _wait_for_gate(gate)


@app.task(name="hb.blocker")
def blocker(run: str, gate: str) -> None:
    emit("start", run=run, role="blocker")
    _wait_for_gate(gate)


@app.task(name="hb.plain")
def plain(run: str, i: int, seconds: float) -> None:
    emit("start", run=run, role="plain", i=i)
    time.sleep(seconds)
