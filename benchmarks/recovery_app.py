"""The Celery app that ``benchmarks/recovery.py`` runs in real ``celery worker`` nodes (prefork).

Configured from the environment by the benchmark (not meant to be used on its own):

* ``REC_BROKER``: the Redis broker (also where celery-singleton and celery-once keep their locks);
* ``REC_MONGODB_URL``, ``REC_DB``, ``REC_LEASE_SECONDS``: the lease store of ``rec.ours``;
* ``REC_READY_DIR``: where the worker drops a marker file when it is ready;
* ``REC_EVENTS_DIR``: where every process appends its events, one JSON object a line;
* ``REC_POLLING=1``: this node's lease store behaves as on a server without change streams (a waiting
  task polls), to compare the two ways a ``Wait`` learns of a release.

Every task takes ``(run, key, role, seconds)``: its body records ``start``, sleeps ``seconds`` and records
``end``. Times are ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process on the machine).
The peers run with their default lock expiry, as a user who installs them gets them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import worker_ready

from celery_mongolock import Replace, Wait, current_lease, singleton_task
from celery_mongolock.signals import lease_contended, lease_released

app = Celery("recovery_app")
app.conf.update(
    broker_url=os.environ.get("REC_BROKER", "memory://"),
    result_backend=None,
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    worker_send_task_events=False,
    worker_prefetch_multiplier=1,
    mongolock_url=os.environ.get("REC_MONGODB_URL", "mongodb://127.0.0.1:27017"),
    mongolock_database=os.environ.get("REC_DB", "mongolock_bench_recovery"),
    mongolock_lease_seconds=float(os.environ.get("REC_LEASE_SECONDS", "5")),
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": os.environ.get("REC_BROKER", "redis://127.0.0.1:6379/0")},
    },
)

PEER_ERRORS: dict[str, str] = {}
_fd: dict[int, int] = {}


def emit(ev: str, **fields: Any) -> None:
    """Append one event to this process's file (a single ``write``: whole lines even if killed)."""
    directory = os.environ.get("REC_EVENTS_DIR")
    if not directory:
        return
    pid = os.getpid()
    fd = _fd.get(pid)
    if fd is None:
        fd = os.open(Path(directory, f"{pid}.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        _fd[pid] = fd
    line = json.dumps({"ev": ev, "t": time.monotonic(), "pid": pid, **fields}) + "\n"
    os.write(fd, line.encode())


if os.environ.get("REC_POLLING") == "1":
    from pymongo.errors import OperationFailure

    from celery_mongolock.store import LeaseStore

    class _NoChangeStreams:
        """The lease collection, except that ``watch`` fails as on a server without change streams."""

        def __init__(self, collection: Any) -> None:
            self._collection = collection

        def watch(self, *args: Any, **kwargs: Any) -> Any:
            raise OperationFailure("change streams are off on this node (benchmark: polling)")

        def __getattr__(self, name: str) -> Any:
            return getattr(self._collection, name)

    _collection = LeaseStore.collection

    def _polling_collection(self: LeaseStore) -> Any:
        assert _collection.fget is not None
        return _NoChangeStreams(_collection.fget(self))

    LeaseStore.collection = property(_polling_collection)  # type: ignore[assignment,method-assign]


@worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    ready_dir = os.environ.get("REC_READY_DIR")
    if ready_dir:
        info = {"pid": os.getpid(), "peer_errors": PEER_ERRORS}
        Path(ready_dir, f"{getattr(sender, 'hostname', 'worker')}.ready").write_text(json.dumps(info))


def _args(task: Any) -> tuple[Any, ...]:
    return tuple(getattr(task.request, "args", None) or ())


@lease_contended.connect
def _contended(sender: Any = None, key: str = "", policy: str = "", **_: Any) -> None:
    args = _args(sender)
    if len(args) >= 3:
        emit("contended", run=args[0], key=key, role=args[2], policy=policy)


@lease_released.connect
def _released(sender: Any = None, key: str = "", **_: Any) -> None:
    args = _args(sender)
    if len(args) >= 3:
        emit("released", run=args[0], key=key, role=args[2])


def _body(impl: str, run: str, key: str, role: str, seconds: float) -> None:
    emit("start", impl=impl, run=run, key=key, role=role)
    time.sleep(seconds)
    emit("end", impl=impl, run=run, key=key, role=role)


@singleton_task(key="rec:{key}", app=app, name="rec.ours", on_contention=Wait(timeout=600))
def ours(run: str, key: str, role: str, seconds: float) -> None:
    """``@singleton_task`` with the Wait policy: a second run waits for the key, then runs."""
    _body("ours", run, key, role, seconds)


#: ``benchmarks/cancel_running.py``: the grace of ``rec.cancel_deaf`` (``REC_CANCEL_GRACE``, seconds).
CANCEL_GRACE = float(os.environ.get("REC_CANCEL_GRACE", "2.0"))


@singleton_task(
    key="rec:{key}",
    app=app,
    name="rec.cancel_deaf",
    on_contention=Replace(cancel_running=True, grace=CANCEL_GRACE),
)
def cancel_deaf(run: str, key: str, role: str, seconds: float) -> None:
    """``Replace(cancel_running=True, grace=...)`` whose body never looks: a newer send has its child
    terminated after the grace, then runs."""
    _body("cancel", run, key, role, seconds)


@singleton_task(
    key="rec:{key}", app=app, name="rec.cancel_polite", on_contention=Replace(cancel_running=True, grace=None)
)
def cancel_polite(run: str, key: str, role: str, seconds: float) -> None:
    """The same, cooperative: polls ``raise_if_superseded()`` every 10 ms and records when it noticed."""
    lease = current_lease()
    assert lease is not None
    emit("start", impl="cancel", run=run, key=key, role=role)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if lease.superseded:
            emit("noticed", run=run, key=key, role=role)
            lease.raise_if_superseded()
        time.sleep(0.01)
    emit("end", impl="cancel", run=run, key=key, role=role)


try:
    from celery_singleton import Singleton

    @app.task(base=Singleton, name="rec.singleton", unique_on=["key"])
    def peer_singleton(run: str, key: str, role: str, seconds: float) -> None:
        """celery-singleton, default settings: the lock is taken at send and never expires by itself."""
        _body("singleton", run, key, role, seconds)

except Exception as exc:  # pragma: no cover - reported by the benchmark
    PEER_ERRORS["celery-singleton"] = f"{type(exc).__name__}: {exc}"

try:
    from celery_once import QueueOnce

    @app.task(base=QueueOnce, name="rec.once", once={"graceful": False, "keys": ["key"]})
    def peer_once(run: str, key: str, role: str, seconds: float) -> None:
        """celery-once, default settings: the lock is taken at send and expires after an hour."""
        _body("once", run, key, role, seconds)

except Exception as exc:  # pragma: no cover - reported by the benchmark
    PEER_ERRORS["celery-once"] = f"{type(exc).__name__}: {exc}"
