"""The Celery app that ``benchmarks/throughput.py`` runs in a real ``celery worker`` (prefork).

Configured from the environment by the benchmark (not meant to be used on its own):

* ``BENCH_BROKER``: the Redis broker (also where celery-singleton and celery-once keep their locks);
* ``BENCH_DONE_REDIS``: a second Redis where every finished run is counted (see ``_count_done``);
* ``BENCH_MONGODB_URL``, ``BENCH_DB``: the lease store of the ``@singleton_task`` variants;
* ``BENCH_READY_DIR``: where the worker drops a marker file when it is ready;
* ``BENCH_COUNT_DIR``: when set, every process counts the MongoDB commands it sends (pymongo command
  monitoring) and writes its counts to ``<dir>/<pid>.json`` after each task.

Every task takes ``(run, i)``: ``run`` names the batch (the finished runs are counted per batch), ``i``
is the lock key. The bodies do nothing: the benchmark measures what the lock costs around them.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import task_postrun, worker_ready

from celery_mongolock import Skip, Wait, singleton_task

app = Celery("throughput_app")
app.conf.update(
    broker_url=os.environ.get("BENCH_BROKER", "memory://"),
    # No result backend: none of the variants needs one to work (completion is counted in
    # BENCH_DONE_REDIS), and a backend would add the same two writes per task to every variant.
    result_backend=None,
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    worker_send_task_events=False,
    mongolock_url=os.environ.get("BENCH_MONGODB_URL", "mongodb://127.0.0.1:27017"),
    mongolock_database=os.environ.get("BENCH_DB", "mongolock_bench"),
    mongolock_lease_seconds=float(os.environ.get("BENCH_LEASE_SECONDS", "30")),
    # celery-once's settings: locks in the broker's Redis, as its README configures them.
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {
            "url": os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/0"),
            "default_timeout": 600,
        },
    },
    # celery-singleton takes its Redis from the result backend, else the broker (here: the broker).
    singleton_lock_expiry=600,
)

PEER_ERRORS: dict[str, str] = {}
_HOST = socket.gethostname()


# -- counting finished runs ------------------------------------------------------------------------------
_done_client: dict[int, Any] = {}


def _done_redis() -> Any:
    """This process's client of the counting Redis (created after fork)."""
    pid = os.getpid()
    client = _done_client.get(pid)
    if client is None:
        import redis

        client = redis.Redis.from_url(os.environ.get("BENCH_DONE_REDIS", "redis://127.0.0.1:6379/1"))
        _done_client[pid] = client
    return client


@task_postrun.connect
def _count_done(
    sender: Any = None, args: Any = None, retval: Any = None, state: str | None = None, **_: Any
) -> None:
    """Count one finished run of batch ``args[0]`` (postrun comes after the peers' unlock hooks too).

    A run that was only re-published (the Retry policy) ends in state RETRY and is not counted; its
    later run is.
    """
    if not args or state == "RETRY":
        return
    if _counter is not None:
        _counter.dump()  # before the run is counted, so the benchmark reads complete counts
    done = _done_redis()
    if isinstance(retval, dict) and retval.get("mongolock") == "skipped":
        done.hincrby("bench:skipped", str(args[0]), 1)
    done.hincrby("bench:done", str(args[0]), 1)


# -- MongoDB command counting (BENCH_COUNT_DIR) -----------------------------------------------------------
class _MongoCommands:
    """Counts this process's MongoDB commands by kind (pymongo command monitoring)."""

    def __init__(self, directory: str) -> None:
        from pymongo import monitoring

        self.directory = Path(directory)
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        outer = self

        class Listener(monitoring.CommandListener):
            def started(self, event: monitoring.CommandStartedEvent) -> None:
                with outer.lock:
                    outer.counts[_kind(event.command_name, event.command)] += 1

            def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
                pass

            def failed(self, event: monitoring.CommandFailedEvent) -> None:
                with outer.lock:
                    outer.counts["failed:" + event.command_name] += 1

        monitoring.register(Listener())

    def dump(self) -> None:
        with self.lock:
            data = dict(self.counts)
        path = self.directory / f"{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)


#: The lease watch's thread (one change stream per process): its commands are counted apart (``watch:``).
WATCH_THREAD = "celery_mongolock-lease-watch"


def _kind(name: str, command: Any) -> str:
    """``findAndModify`` = acquire, or release (its filter names the owner); ``update`` split into
    release and renew (heartbeat) by its pipeline; the lease watch's commands as ``watch:<name>``."""
    if threading.current_thread().name == WATCH_THREAD:
        return f"watch:{name}"
    if name == "findAndModify" and "owner" in (command.get("query") or {}):
        return "findAndModify:release"  # a release matches its owner token; an acquire, the key alone
    if name == "update":
        text = repr(command.get("updates"))
        if "released_at" in text:
            return "update:release"
        if "renewed_at" in text:
            return "update:renew"
    return name


_counter = _MongoCommands(os.environ["BENCH_COUNT_DIR"]) if os.environ.get("BENCH_COUNT_DIR") else None


@worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    ready_dir = os.environ.get("BENCH_READY_DIR")
    if ready_dir:
        info = {"pid": os.getpid(), "peer_errors": PEER_ERRORS}
        Path(ready_dir, f"{getattr(sender, 'hostname', 'worker')}.ready").write_text(json.dumps(info))


# -- the tasks ---------------------------------------------------------------------------------------------
@app.task(name="bench.plain")
def plain(run: str, i: str) -> None:
    """The baseline: a plain Celery task."""


_bare: dict[int, Any] = {}


def _bare_collection() -> Any:
    """The lease collection, as the store opens it (same write concern), on a client of this process."""
    pid = os.getpid()
    if pid not in _bare:
        from pymongo import MongoClient, WriteConcern

        client: Any = MongoClient(app.conf.mongolock_url, tz_aware=True)
        _bare[pid] = client[app.conf.mongolock_database].get_collection(
            "leases", write_concern=WriteConcern(w="majority", j=True)
        )
    return _bare[pid]


@app.task(name="bench.bare")
def bare(run: str, i: str) -> None:
    """The limit: a plain task whose body sends the two commands of a lease (acquire, release) itself."""
    from pymongo import ReturnDocument

    from celery_mongolock.store import LeaseStore

    coll = _bare_collection()
    key, token = f"bare:{i}", uuid.uuid4().hex
    holder = {"host": _HOST, "pid": os.getpid(), "task_id": bare.request.id}
    doc = coll.find_one_and_update(
        {"_id": key},
        LeaseStore._acquire_pipeline(token, 30_000, holder),
        upsert=True,
        return_document=ReturnDocument.AFTER,
    )
    if doc is None or doc.get("owner") != token:
        raise RuntimeError(f"bare acquire of {key!r} did not take it: {doc}")
    coll.update_one({"_id": key, "owner": token}, LeaseStore._release_pipeline())


@singleton_task(key="bench:{i}", app=app, name="bench.ours")
def ours(run: str, i: str) -> None:
    """``@singleton_task`` with the default policy (distinct keys never contend)."""


@singleton_task(key="bench:{i}", app=app, name="bench.ours_wait", on_contention=Wait(timeout=300))
def ours_wait(run: str, i: str) -> None:
    """One hot key: runs wait for the key (woken by the release) and so run one after another."""


@singleton_task(key="bench:{i}", app=app, name="bench.ours_skip", on_contention=Skip())
def ours_skip(run: str, i: str) -> None:
    """One hot key, duplicates dropped (as the peers do at send time), here in the worker."""


@singleton_task(key="bench:{i}", app=app, name="bench.ours_slow")
def ours_slow(run: str, i: str, seconds: float = 0.0) -> None:
    """Holds its lease ``seconds``, so that heartbeat renewals show in the command counts."""
    time.sleep(seconds)


try:
    from celery_singleton import Singleton

    @app.task(base=Singleton, name="bench.singleton", unique_on=["i"], lock_expiry=600)
    def peer_singleton(run: str, i: str) -> None:
        """celery-singleton: the lock is taken in ``apply_async`` (at send), released after the run."""

except Exception as exc:  # pragma: no cover - reported by the benchmark
    PEER_ERRORS["celery-singleton"] = f"{type(exc).__name__}: {exc}"

try:
    from celery_once import QueueOnce

    @app.task(base=QueueOnce, name="bench.once", once={"graceful": True, "keys": ["i"]})
    def peer_once(run: str, i: str) -> None:
        """celery-once: the lock is taken in ``apply_async`` (at send), released after the run."""

except Exception as exc:  # pragma: no cover - reported by the benchmark
    PEER_ERRORS["celery-once"] = f"{type(exc).__name__}: {exc}"
