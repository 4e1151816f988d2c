"""The Celery app that ``benchmarks/limits.py`` runs in a real ``celery worker`` (prefork).

Configured from the environment by the benchmark (not meant to be used on its own):

* ``BENCH_BROKER``: the Redis broker;
* ``BENCH_MONGODB_URL``, ``BENCH_DB``: the lease store;
* ``BENCH_LEASE_SECONDS``: the workers' lease (default 30 s: no heartbeat tick during a short run);
* ``BENCH_READY_DIR``: where the worker drops a marker file when it is ready;
* ``BENCH_COUNT_DIR``: where every process writes ``<pid>.json`` after each task: per batch, the runs
  done, each run's time from ``task_prerun`` to ``task_postrun`` and the MongoDB commands sent on the
  task's thread (the pool process's main thread, where a prefork child runs its tasks), and the commands
  of the other threads (the heartbeat thread: renewals, history inserts).

Every task takes ``(run, t)``: ``run`` names the batch, ``t`` the tenant (the key). The bodies do nothing:
what is measured is what the lease costs around them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import task_postrun, task_prerun, worker_ready
from pymongo import monitoring

from celery_mongolock import singleton_task

app = Celery("limits_app")
app.conf.update(
    broker_url=os.environ.get("BENCH_BROKER", "memory://"),
    result_backend=None,
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    worker_send_task_events=False,
    mongolock_url=os.environ.get("BENCH_MONGODB_URL", "mongodb://127.0.0.1:27017"),
    mongolock_database=os.environ.get("BENCH_DB", "mongolock_bench"),
    mongolock_lease_seconds=float(os.environ.get("BENCH_LEASE_SECONDS", "30")),
)

IGNORED = frozenset({"hello", "isMaster", "ismaster", "endSessions", "ping", "buildInfo", "saslStart"})


class _State:
    """This process's figures, by batch."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self.lock = threading.Lock()
        self.batch = "idle"
        self.started: dict[str, float] = {}
        self.done: Counter[str] = Counter()
        self.durations_us: defaultdict[str, list[float]] = defaultdict(list)
        self.task_commands: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.other_commands: defaultdict[str, Counter[str]] = defaultdict(Counter)

    def command(self, name: str) -> None:
        with self.lock:
            if threading.current_thread() is threading.main_thread():
                self.task_commands[self.batch][name] += 1
            else:
                self.other_commands[self.batch][name] += 1

    def dump(self) -> None:
        with self.lock:
            data = {
                "done": dict(self.done),
                "durations_us": dict(self.durations_us),
                "task_commands": {b: dict(c) for b, c in self.task_commands.items()},
                "other_commands": {b: dict(c) for b, c in self.other_commands.items()},
            }
        path = self.directory / f"{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)


_state = _State(os.environ["BENCH_COUNT_DIR"]) if os.environ.get("BENCH_COUNT_DIR") else None


class _Listener(monitoring.CommandListener):
    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if _state is not None and event.command_name not in IGNORED:
            _state.command(event.command_name)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        if _state is not None:
            _state.command("failed:" + event.command_name)


if _state is not None:
    monitoring.register(_Listener())  # before any client is made


@task_prerun.connect
def _prerun(task_id: str | None = None, args: Any = None, **_: Any) -> None:
    if _state is None or not args:
        return
    with _state.lock:
        _state.batch = str(args[0])
        _state.started[task_id or ""] = time.perf_counter()


@task_postrun.connect
def _postrun(task_id: str | None = None, args: Any = None, state: str | None = None, **_: Any) -> None:
    if _state is None or not args:
        return
    now = time.perf_counter()
    batch = str(args[0])
    with _state.lock:
        started = _state.started.pop(task_id or "", None)
        if started is not None:
            _state.durations_us[batch].append(round((now - started) * 1e6, 1))
        if state != "RETRY":
            _state.done[batch] += 1
        _state.batch = "idle"
    _state.dump()


@worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    ready_dir = os.environ.get("BENCH_READY_DIR")
    if ready_dir:
        Path(ready_dir, f"{getattr(sender, 'hostname', 'worker')}.ready").write_text(
            json.dumps({"pid": os.getpid()})
        )


# -- the tasks: one key, limit=N, several keys ------------------------------------------------------------
@app.task(name="limits.plain")
def plain(run: str, t: str) -> None:
    """The baseline: no lease."""


@singleton_task(key="one:{t}", app=app, name="limits.single")
def single(run: str, t: str) -> None:
    """One key, a single lease (limit 1)."""


@singleton_task(key="lim3:{t}", limit=3, app=app, name="limits.limit3")
def limit3(run: str, t: str) -> None:
    """One key, up to 3 runs at once (a slot in the key's ``hs`` array)."""


@singleton_task(key="lim10:{t}", limit=10, app=app, name="limits.limit10")
def limit10(run: str, t: str) -> None:
    """One key, up to 10 runs at once."""


@singleton_task(keys=("k2a:{t}", "k2b:{t}"), app=app, name="limits.keys2")
def keys2(run: str, t: str) -> None:
    """Two keys held at once."""


@singleton_task(keys=("k4a:{t}", "k4b:{t}", "k4c:{t}", "k4d:{t}"), app=app, name="limits.keys4")
def keys4(run: str, t: str) -> None:
    """Four keys held at once."""
