"""The Celery app that ``benchmarks/contention.py`` runs in real ``celery worker`` nodes (prefork).

Configured from the environment by the benchmark (not meant to be used on its own):

* ``CON_BROKER``: the Redis broker; ``CON_BACKEND``: the result backend (the same Redis, another
  database: a parked run's ``QUEUED`` state is written there, as a user's app would have it);
* ``CON_MONGODB_URL``, ``CON_DB``: the lease store;
* ``CON_READY_DIR``: where the worker drops a marker file when it is ready;
* ``CON_EVENTS_DIR``: where every process appends its events, one JSON object a line;
* ``CON_COUNT_DIR``: where every process writes the MongoDB commands it sent so far (pymongo command
  monitoring), ``<pid>.json``: after each task in a pool process, and every 0.1 s from a thread (the
  worker's main process sends commands too: its sweeper).

The three tasks differ only in their contention policy: ``Queue()``, ``Wait(timeout=600)`` and
``Retry()`` (the default). Each takes ``(run, key, i, seconds)``: its body records ``start``, sleeps
``seconds`` (the work) and records ``end``. Every execution records ``pre`` and ``post`` (Celery's
``task_prerun`` / ``task_postrun``: the time it held a worker slot), and a run that found its key held
records ``contended``; ``acquired`` and ``released`` come from the library's signals (the lease
taken; the release command returned, after publishing the handoff it made). Times are
``time.monotonic()`` (one clock for every process on the machine).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import task_postrun, task_prerun, worker_process_init, worker_ready

from celery_mongolock import Queue, Retry, Wait, singleton_task
from celery_mongolock.signals import lease_acquired, lease_contended, lease_released

app = Celery("contention_app")
app.conf.update(
    broker_url=os.environ.get("CON_BROKER", "memory://"),
    result_backend=os.environ.get("CON_BACKEND", "cache+memory://"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    worker_send_task_events=False,
    # One message reserved per pool process: a long run does not sit on messages others could take.
    worker_prefetch_multiplier=1,
    mongolock_url=os.environ.get("CON_MONGODB_URL", "mongodb://127.0.0.1:27017"),
    mongolock_database=os.environ.get("CON_DB", "mongolock_bench_contention"),
)

_fd: dict[int, int] = {}


def emit(ev: str, **fields: Any) -> None:
    """Append one event to this process's file (a single ``write``: whole lines)."""
    directory = os.environ.get("CON_EVENTS_DIR")
    if not directory:
        return
    pid = os.getpid()
    fd = _fd.get(pid)
    if fd is None:
        fd = os.open(Path(directory, f"{pid}.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        _fd[pid] = fd
    line = json.dumps({"ev": ev, "t": time.monotonic(), "pid": pid, **fields}) + "\n"
    os.write(fd, line.encode())


# -- MongoDB command counting ------------------------------------------------------------------------------
class _MongoCommands:
    """Counts this process's MongoDB commands by name (pymongo command monitoring)."""

    def __init__(self, directory: str) -> None:
        from pymongo import monitoring

        self.directory = Path(directory)
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.role = "main"
        self.dumped: dict[str, int] = {}
        outer = self

        class Listener(monitoring.CommandListener):
            def started(self, event: monitoring.CommandStartedEvent) -> None:
                # The lease watch's commands (one change stream per process) are counted apart.
                watch = threading.current_thread().name == "celery_mongolock-lease-watch"
                with outer.lock:
                    outer.counts[("watch:" if watch else "") + event.command_name] += 1

            def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
                pass

            def failed(self, event: monitoring.CommandFailedEvent) -> None:
                with outer.lock:
                    outer.counts["failed:" + event.command_name] += 1

        monitoring.register(Listener())

    def dump(self) -> None:
        with self.lock:
            data = dict(self.counts)
        if data == self.dumped:
            return
        path = self.directory / f"{os.getpid()}.json"
        tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps({"role": self.role, "counts": data}))
        os.replace(tmp, path)
        self.dumped = data

    def start_thread(self) -> None:
        def loop() -> None:
            while True:
                time.sleep(0.1)
                self.dump()

        threading.Thread(target=loop, name="bench-command-counts", daemon=True).start()


_counter = _MongoCommands(os.environ["CON_COUNT_DIR"]) if os.environ.get("CON_COUNT_DIR") else None


@worker_process_init.connect
def _child_init(**_: Any) -> None:
    if _counter is not None:
        _counter.lock = threading.Lock()  # a fresh lock: another thread may have held it at the fork
        _counter.counts.clear()  # what the parent counted before the fork is the parent's
        _counter.dumped = {}
        _counter.role = "child"
        _counter.start_thread()


@worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    if _counter is not None:
        _counter.start_thread()
    ready_dir = os.environ.get("CON_READY_DIR")
    if ready_dir:
        info = {"pid": os.getpid()}
        Path(ready_dir, f"{getattr(sender, 'hostname', 'worker')}.ready").write_text(json.dumps(info))


# -- events ------------------------------------------------------------------------------------------------
def _run_of(args: Any) -> tuple[str, int] | None:
    if isinstance(args, (list, tuple)) and len(args) >= 3:
        return str(args[0]), int(args[2])
    return None


@task_prerun.connect
def _pre(task_id: str | None = None, args: Any = None, **_: Any) -> None:
    run = _run_of(args)
    if run is not None:
        emit("pre", run=run[0], i=run[1], id=task_id)


@task_postrun.connect
def _post(task_id: str | None = None, args: Any = None, state: str | None = None, **_: Any) -> None:
    run = _run_of(args)
    if run is None:
        return
    if _counter is not None:
        _counter.dump()  # before the event, so the benchmark reads complete counts after the last one
    emit("post", run=run[0], i=run[1], id=task_id, state=state)


@lease_contended.connect
def _contended(sender: Any = None, key: str = "", policy: str = "", **_: Any) -> None:
    run = _run_of(getattr(getattr(sender, "request", None), "args", None))
    if run is not None:
        emit("contended", run=run[0], i=run[1], id=sender.request.id, policy=policy)


@lease_acquired.connect
def _acquired(sender: Any = None, **_: Any) -> None:
    run = _run_of(getattr(getattr(sender, "request", None), "args", None))
    if run is not None:
        emit("acquired", run=run[0], i=run[1])


@lease_released.connect
def _released(sender: Any = None, **_: Any) -> None:
    """After the release command returned (and, under Queue, the handoff it made was published)."""
    run = _run_of(getattr(getattr(sender, "request", None), "args", None))
    if run is not None:
        emit("released", run=run[0], i=run[1])


def _body(policy: str, run: str, key: str, i: int, seconds: float) -> None:
    emit("start", run=run, i=i, policy=policy)
    time.sleep(seconds)
    emit("end", run=run, i=i, policy=policy)


# -- the tasks: one per policy, the same body ------------------------------------------------------------
@singleton_task(key="hot:{key}", app=app, name="contention.queue", on_contention=Queue())
def queued(run: str, key: str, i: int, seconds: float) -> None:
    """``Queue()``: a contended run is parked in the lease document and handed the key in send order."""
    _body("queue", run, key, i, seconds)


@singleton_task(key="hot:{key}", app=app, name="contention.wait", on_contention=Wait(timeout=600))
def waiting(run: str, key: str, i: int, seconds: float) -> None:
    """``Wait()``: a contended run blocks in its worker slot until a release wakes it."""
    _body("wait", run, key, i, seconds)


@singleton_task(key="hot:{key}", app=app, name="contention.retry", on_contention=Retry())
def retrying(run: str, key: str, i: int, seconds: float) -> None:
    """``Retry()`` (the default policy): a contended run is published again after a backoff."""
    _body("retry", run, key, i, seconds)


TASKS = {"queue": queued, "wait": waiting, "retry": retrying}
