"""Prometheus metrics per task name, correct under the prefork pool.

Install with ``pip install 'celery-mongolock[prometheus]'``.

Turn them on in the module that defines the Celery app, before the worker forks its pool::

    from celery_mongolock import metrics

    metrics.enable(port=9808)     # the worker's main process serves /metrics on this port

=============================================  =========  ===================================================
metric                                         type       meaning (label ``task``: the task's name)
=============================================  =========  ===================================================
``celery_mongolock_leases_acquired_total``     counter    leases taken (runs whose body started)
``celery_mongolock_leases_held``               gauge      leases held right now, summed over live processes
``celery_mongolock_contended_total``           counter    runs that found their key held, label ``policy``
``celery_mongolock_skipped_total``             counter    runs that ended without running their body (Skip)
``celery_mongolock_lost_total``                counter    leases lost while their body ran
``celery_mongolock_acquire_seconds``           histogram  from the run's start to its lease decision (taken or
                                                          held by another): the cost of the lease per run
``celery_mongolock_wait_seconds``              histogram  time a run spent waiting for its key (Wait policy)
=============================================  =========  ===================================================

Pool children record into prometheus_client's multiprocess directory and the worker's main process
serves the sum. ``PROMETHEUS_MULTIPROC_DIR`` names the directory; if it is not set, :func:`enable` makes a
fresh temporary one (which it can only do before ``prometheus_client`` is first imported). A directory you
set yourself should be emptied before the worker starts, as prometheus_client's documentation says.
Serve the metrics yourself instead with ``port=None`` and :func:`registry`.
"""

from __future__ import annotations

import glob
import logging
import os
import sys
import tempfile
import threading
import time
from typing import Any

from celery.signals import task_postrun, task_prerun, worker_process_shutdown, worker_ready

from celery_mongolock.exceptions import ConfigurationError
from celery_mongolock.integration import signals

__all__ = ["enable", "registry"]

log = logging.getLogger("celery_mongolock.metrics")

_MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_ACQUIRE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class _Metrics:
    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.acquired = Counter(
            "celery_mongolock_leases_acquired", "Leases taken (runs whose body started).", ["task"]
        )
        self.held = Gauge(
            "celery_mongolock_leases_held",
            "Leases held right now.",
            ["task"],
            multiprocess_mode="livesum",
        )
        self.contended = Counter(
            "celery_mongolock_contended", "Runs that found their key held, by policy.", ["task", "policy"]
        )
        self.skipped = Counter(
            "celery_mongolock_skipped", "Runs that ended without running their body (Skip).", ["task"]
        )
        self.lost = Counter("celery_mongolock_lost", "Leases lost while their body ran.", ["task"])
        self.parked = Counter(
            "celery_mongolock_parked",
            "Runs parked until their key is handed to them (Queue, Replace).",
            ["task"],
        )
        self.handed_off = Counter(
            "celery_mongolock_handed_off", "Keys handed to a parked run (by this process).", []
        )
        self.superseded = Counter(
            "celery_mongolock_superseded", "Runs replaced by a newer send (Replace).", []
        )
        self.acquire_seconds = Histogram(
            "celery_mongolock_acquire_seconds",
            "From the run's start to its lease decision (taken, or held by another).",
            ["task"],
            buckets=_ACQUIRE_BUCKETS,
        )
        self.wait_seconds = Histogram(
            "celery_mongolock_wait_seconds",
            "Time a run spent waiting for its key (Wait policy).",
            ["task"],
            buckets=_WAIT_BUCKETS,
        )
        # Per process: task id -> monotonic time of the run's start / of its first wait.
        self.started: dict[str, float] = {}
        self.waiting: dict[str, float] = {}
        # owner token -> task name of the leases this process holds (lost comes from the heartbeat thread).
        self.holding: dict[str, str] = {}
        self.lock = threading.Lock()


_metrics: _Metrics | None = None
_port: tuple[int, str] | None = None
_served = False
_enable_lock = threading.Lock()


def _multiprocess_dir() -> str:
    """The multiprocess directory, made (and exported to the pool children) if none was given."""
    path = os.environ.get(_MULTIPROC_ENV)
    if path:
        os.makedirs(path, exist_ok=True)
        return path
    if "prometheus_client" in sys.modules:
        raise ConfigurationError(
            f"celery_mongolock.metrics.enable(): prometheus_client was imported before {_MULTIPROC_ENV} "
            "was set, so the pool children's metrics would be lost; set it in the worker's environment, "
            "or call enable() before anything imports prometheus_client"
        )
    path = tempfile.mkdtemp(prefix="celery-mongolock-metrics-")
    os.environ[_MULTIPROC_ENV] = path
    return path


def enable(port: int | None = None, addr: str = "127.0.0.1") -> None:
    """Record the lease metrics in this process and the worker's pool children.

    ``port``: the worker's main process serves them on ``http://addr:port/metrics`` once it is ready
    (never the pool children, nor a process that only sends tasks); an int from 1 to 65535, refused
    here otherwise. Safe to call more than once.
    """
    global _metrics, _port
    _check_port(port)
    with _enable_lock:
        if _metrics is None:
            try:
                _multiprocess_dir()
                _metrics = _Metrics()
            except ImportError:
                raise ConfigurationError(
                    "celery_mongolock.metrics needs prometheus_client: "
                    "pip install 'celery-mongolock[prometheus]'"
                ) from None
            task_prerun.connect(_on_prerun, weak=False, dispatch_uid="celery_mongolock.metrics.prerun")
            task_postrun.connect(_on_postrun, weak=False, dispatch_uid="celery_mongolock.metrics.postrun")
            signals.lease_acquired.connect(
                _on_acquired, weak=False, dispatch_uid="celery_mongolock.metrics.acquired"
            )
            signals.lease_released.connect(
                _on_released, weak=False, dispatch_uid="celery_mongolock.metrics.released"
            )
            signals.lease_contended.connect(
                _on_contended, weak=False, dispatch_uid="celery_mongolock.metrics.contended"
            )
            signals.lease_lost.connect(_on_lost, weak=False, dispatch_uid="celery_mongolock.metrics.lost")
            signals.run_parked.connect(_on_parked, weak=False, dispatch_uid="celery_mongolock.metrics.parked")
            signals.run_handed_off.connect(
                _on_handed, weak=False, dispatch_uid="celery_mongolock.metrics.handed"
            )
            signals.run_superseded.connect(
                _on_superseded, weak=False, dispatch_uid="celery_mongolock.metrics.superseded"
            )
            worker_process_shutdown.connect(
                _on_process_shutdown, weak=False, dispatch_uid="celery_mongolock.metrics.shutdown"
            )
            worker_ready.connect(_on_worker_ready, weak=False, dispatch_uid="celery_mongolock.metrics.serve")
        if port is not None:
            _port = (port, addr)


def _check_port(port: object) -> None:
    """A port to serve on: an int from 1 to 65535 (0 would be a port the OS picks, which no scraper knows).

    Refused here, in the caller's process: a bad one would only fail in the worker's ``worker_ready``
    handler, logged and otherwise unseen."""
    if port is None:
        return
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigurationError(
            f"celery_mongolock.metrics.enable(port=...) must be an int from 1 to 65535 (or None to serve "
            f"the metrics yourself), got {port!r}"
        )


def registry() -> Any:
    """A ``CollectorRegistry`` with every process's metrics (prometheus_client's multiprocess collector)."""
    from prometheus_client import CollectorRegistry

    if _metrics is None:
        raise ConfigurationError("call celery_mongolock.metrics.enable() first")
    reg = CollectorRegistry()
    reg.register(_Collector(os.environ[_MULTIPROC_ENV]))
    return reg


class _Collector:
    """prometheus_client's multiprocess collector, minus the files a process is creating right now.

    A pool child that records a metric of a new kind creates its file empty and sizes it a moment later;
    read in between, prometheus_client's reader fails on it and the whole scrape answers 500 (seen in
    tests/test_observability.py). An empty file holds no samples yet: it is left for the next scrape.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def collect(self) -> Any:
        from prometheus_client.multiprocess import MultiProcessCollector

        for attempt in range(3):
            files = []
            for name in glob.glob(os.path.join(self.path, "*.db")):
                try:
                    if os.path.getsize(name) > 0:
                        files.append(name)
                except OSError:  # removed meanwhile (a pool child's exit: mark_process_dead)
                    pass
            try:
                return MultiProcessCollector.merge(files, accumulate=True)  # type: ignore[no-untyped-call]
            except FileNotFoundError:
                if attempt == 2:
                    raise
        return []


def _on_worker_ready(**_: Any) -> None:
    global _served
    if _port is None or _served:
        return
    from prometheus_client import start_http_server

    port, addr = _port
    start_http_server(port, addr=addr, registry=registry())
    _served = True
    log.info("celery_mongolock: metrics on http://%s:%s/metrics", addr, port)


def _is_singleton(task: Any) -> bool:
    from celery_mongolock.integration.task import SingletonTask

    return isinstance(task, SingletonTask)


def _on_prerun(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    if _metrics is not None and task_id and _is_singleton(sender):
        _metrics.started[task_id] = time.monotonic()


def _decided(m: _Metrics, task: Any) -> None:
    """The first lease decision of this run: observe the time it took since the run started."""
    started = m.started.pop(task.request.id or "", None)
    if started is not None:
        m.acquire_seconds.labels(task.name).observe(time.monotonic() - started)


def _on_acquired(sender: Any = None, key: str = "", lease: Any = None, **_: Any) -> None:
    m = _metrics
    if m is None or sender is None or lease is None:
        return
    _decided(m, sender)
    waited = m.waiting.pop(sender.request.id or "", None)
    if waited is not None:
        m.wait_seconds.labels(sender.name).observe(time.monotonic() - waited)
    m.acquired.labels(sender.name).inc()
    with m.lock:
        m.holding[lease.owner] = sender.name
    m.held.labels(sender.name).inc()


def _drop_holding(m: _Metrics, lease: Any, *, lost: bool) -> None:
    """The run no longer holds ``lease``: its gauge goes down, and a loss is counted, each exactly once.

    Both the release (the task's thread, after the body) and the loss notice (a thread of its own, started
    after ``lease.lost`` turns true) come here; whichever comes first drops the holding. A body that saw
    ``lease.lost`` may end, and be released, before the loss notice runs: the release then counts the loss
    itself (``lost``), so the count is in before the run's result is stored."""
    with m.lock:
        name = m.holding.pop(lease.owner, None)
    if name is not None:
        m.held.labels(name).dec()
        if lost:
            m.lost.labels(name).inc()


def _on_released(sender: Any = None, lease: Any = None, **_: Any) -> None:
    if _metrics is not None and lease is not None:
        _drop_holding(_metrics, lease, lost=bool(getattr(lease, "lost", False)))


def _on_lost(sender: Any = None, lease: Any = None, **_: Any) -> None:
    if _metrics is not None and lease is not None:
        _drop_holding(_metrics, lease, lost=True)


def _on_parked(sender: Any = None, **_: Any) -> None:
    if _metrics is not None and sender is not None:
        _metrics.parked.labels(sender.name).inc()


def _on_handed(**_: Any) -> None:
    if _metrics is not None:
        _metrics.handed_off.inc()


def _on_superseded(**_: Any) -> None:
    if _metrics is not None:
        _metrics.superseded.inc()


def _on_contended(sender: Any = None, policy: str = "", **_: Any) -> None:
    m = _metrics
    if m is None or sender is None:
        return
    _decided(m, sender)
    m.contended.labels(sender.name, policy).inc()
    if policy == "wait":
        m.waiting.setdefault(sender.request.id or "", time.monotonic())


def _on_postrun(sender: Any = None, task_id: str | None = None, retval: Any = None, **_: Any) -> None:
    m = _metrics
    if m is None or sender is None or not task_id:
        return
    m.started.pop(task_id, None)
    waited = m.waiting.pop(task_id, None)
    if not _is_singleton(sender):
        return
    if waited is not None:  # waited, then gave up (its `then` policy: retry, skip or fail)
        m.wait_seconds.labels(sender.name).observe(time.monotonic() - waited)
    if isinstance(retval, dict) and retval.get("mongolock") == "skipped":
        m.skipped.labels(sender.name).inc()


def _on_process_shutdown(**_: Any) -> None:
    # A pool child going away: its "held" gauge must no longer count (its leases are released).
    from prometheus_client import multiprocess

    path = os.environ.get(_MULTIPROC_ENV)
    if path:
        multiprocess.mark_process_dead(os.getpid(), path)  # type: ignore[no-untyped-call]
