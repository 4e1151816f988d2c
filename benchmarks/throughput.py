"""Benchmark of the per-task cost: throughput through a real prefork worker and a real Redis broker.

Run it from the repository root (after ``make venv``; the peers come with ``pip install -e '.[bench]'``)::

    .venv/bin/python benchmarks/throughput.py             # about 2-3 minutes
    .venv/bin/python benchmarks/throughput.py --quick     # under a minute
    .venv/bin/python benchmarks/throughput.py --mongo-url mongodb://host:27017/

It starts a bundled ``redis-server`` as the broker, a second one where finished runs are counted, the
embedded MongoDB-compatible server (unless ``--mongo-url`` or ``MONGOLOCK_TEST_MONGODB_URL`` names one)
and one ``celery worker`` (prefork) running ``benchmarks/throughput_app.py``. The variants (a plain task,
``@singleton_task`` with distinct keys and with one hot key, celery-singleton and celery-once) run side by
side in interleaved rounds. Then a second worker counts the MongoDB commands each singleton task sends
(pymongo command monitoring inside the worker). See ``benchmarks/README.md`` for what each figure means.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = HERE / "results" / "throughput.json"
URL_ENV = "MONGOLOCK_TEST_MONGODB_URL"
TARGET_RATIO = 0.85  # issue 7: ours at least 85% of the plain task's throughput
TARGET_COMMANDS = 2  # issue 7: two MongoDB commands per singleton task, plus heartbeats
CLK_TCK = os.sysconf("SC_CLK_TCK")
POLL_SECONDS = 0.005  # how often the end of a batch is checked (its error bound on the wall time)


@dataclass(frozen=True)
class Variant:
    name: str
    task: str  # attribute of throughput_app
    hot: bool  # one key for the whole batch, else a new key per task
    peer: str | None  # the PyPI distribution it needs, None for ours and the baselines
    label: str
    mongo: bool = False  # sends MongoDB commands


MONGO_WARMUP_TASKS = 8  # untimed tasks after a restart of the embedded server (reconnects, indexes)


VARIANTS = [
    Variant("plain", "plain", False, None, "plain task (baseline)"),
    Variant("bare", "bare", False, None, "plain task sending a lease's 2 commands itself (the limit)", True),
    Variant("ours", "ours", False, None, "@singleton_task, distinct keys", True),
    Variant("singleton", "peer_singleton", False, "celery-singleton", "celery-singleton, distinct keys"),
    Variant("once", "peer_once", False, "celery-once", "celery-once, distinct keys"),
    Variant("ours_hot_wait", "ours_wait", True, None, "@singleton_task, one hot key, Wait policy", True),
    Variant("ours_hot_skip", "ours_skip", True, None, "@singleton_task, one hot key, Skip policy", True),
    Variant("singleton_hot", "peer_singleton", True, "celery-singleton", "celery-singleton, one hot key"),
    Variant("once_hot", "peer_once", True, "celery-once", "celery-once, one hot key"),
]
PEERS = {"celery-singleton": ("celery_singleton", "0.3.1"), "celery-once": ("celery_once", "3.0.1")}


# -- processes ---------------------------------------------------------------------------------------------
def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of a process (all its threads), from /proc; 0 when it is gone."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Worker:
    """One ``celery -A throughput_app worker`` (prefork), in its own process group."""

    def __init__(self, env: dict[str, str], work_dir: Path, concurrency: int, name: str) -> None:
        self.env = env
        self.work_dir = work_dir
        self.concurrency = concurrency
        self.name = f"{name}@localhost"
        self.log_path = work_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}

    def start(self, timeout: float = 120.0) -> Worker:
        marker = Path(self.env["BENCH_READY_DIR"]) / f"{self.name}.ready"
        marker.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "throughput_app",
            "worker",
            "--pool=prefork",
            f"--concurrency={self.concurrency}",
            "-n",
            self.name,
            "--loglevel=WARNING",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not marker.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"worker not ready after {timeout:g}s:\n{self.log_tail()}")
            time.sleep(0.05)
        self.info = json.loads(marker.read_text() or "{}")
        return self

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def children(self) -> list[int]:
        assert self.proc is not None
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                return [int(p) for p in f.read().split()]
        except OSError:
            return []

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # warm shutdown
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


# -- one benchmark run ------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace, app_module: Any, worker: Worker, servers: dict[str, Any]):
        import redis

        self.args = args
        self.app = app_module
        self.worker = worker
        self.broker = redis.Redis.from_url(servers["broker_url"])
        self.done = redis.Redis.from_url(servers["done_url"])
        self.pids: dict[str, int | None] = {
            "driver": os.getpid(),
            "broker_redis": servers["broker_pid"],
            "done_redis": servers["done_pid"],
        }
        self.embedded = servers["embedded"]
        from pymongo import MongoClient

        self.mongo: Any = MongoClient(servers["mongo_url"])
        self.leases = self.mongo[servers["database"]]["leases"]

    def fresh_server(self) -> None:
        """Restart the embedded server, empty, and create the lease indexes again.

        Its writes get slower with every write it has taken (about 0.4 ms fresh, 3 ms after 12,000,
        whatever the write concern, the collection or the oplog size; reads and ``ping`` do not), which
        would make each MongoDB batch pay for the ones before it. The workers' clients reconnect by
        themselves (retryable writes); an untimed warm-up batch follows every restart.
        """
        from pymongo.errors import PyMongoError

        if self.embedded is None:
            return
        self.embedded.restart()
        deadline = time.monotonic() + 60
        while True:
            try:
                self.leases.create_index([("expires_at", 1)], name="expires_at_ttl", expireAfterSeconds=0)
                self.leases.create_index([("owner", 1)], name="owner")
                return
            except PyMongoError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def cpu_snapshot(self) -> dict[str, float]:
        assert self.worker.proc is not None
        snap = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        snap["mongodb_server"] = cpu_seconds(self.embedded.pid if self.embedded else None)
        snap["worker_parent"] = cpu_seconds(self.worker.proc.pid)
        snap["worker_children"] = sum(cpu_seconds(p) for p in self.worker.children())
        return snap

    def commandstats(self) -> Counter[str]:
        stats = self.broker.info("commandstats")
        return Counter(
            {
                name.removeprefix("cmdstat_"): int(v["calls"])
                for name, v in stats.items()
                if isinstance(v, dict)
            }
        )

    def wait_done(self, run: str, expected: int, timeout: float) -> float:
        """Poll the finished-runs counter until it reaches ``expected``; the time it did."""
        deadline = time.monotonic() + timeout
        while True:
            now = time.perf_counter()
            if int(self.done.hget("bench:done", run) or 0) >= expected:
                return now
            if time.monotonic() > deadline:
                got = int(self.done.hget("bench:done", run) or 0)
                raise RuntimeError(
                    f"batch {run}: {got} of {expected} runs finished after {timeout:g}s\n"
                    f"{self.worker.log_tail()}"
                )
            time.sleep(POLL_SECONDS)

    def batch(self, variant: Variant, n: int, *, fresh: bool = False, **extra: Any) -> dict[str, Any]:
        """Send ``n`` tasks as fast as possible; return when all have finished (locks released too).

        ``fresh``: a variant that uses MongoDB gets a freshly restarted embedded server (and an untimed
        warm-up batch on it) first.
        """
        if fresh and variant.mongo and self.embedded is not None:
            self.fresh_server()
            self.batch(variant, MONGO_WARMUP_TASKS, **extra)
        task = getattr(self.app, variant.task)
        run = f"{variant.name}-{uuid.uuid4().hex[:10]}"
        # A fresh collection for every batch: the distinct-key figures then do not depend on how many
        # documents earlier batches left (the embedded server's findAndModify on an existing document
        # costs in proportion to the collection's size; see README). No lease is held between batches.
        self.leases.delete_many({})
        keys = ["hot"] * n if variant.hot else [f"{run}-{i}" for i in range(n)]
        ids = [uuid.uuid4().hex for _ in range(n)]
        cmd0, cpu0 = self.commandstats(), self.cpu_snapshot()
        t0 = time.perf_counter()
        enqueued = 0
        for key, task_id in zip(keys, ids, strict=True):
            # The peers return another result (celery-singleton: the holder's; celery-once, graceful:
            # an empty one) when they drop a duplicate at send time.
            enqueued += task.apply_async((run, key), task_id=task_id, **extra).id == task_id
        t_sent = time.perf_counter()
        t_done = self.wait_done(run, enqueued, timeout=max(120.0, n * 0.5))
        cpu1, cmd1 = self.cpu_snapshot(), self.commandstats()
        cmd1.subtract(cmd0)
        commands = {k: v for k, v in sorted(cmd1.items()) if v and k != "info"}
        wall = t_done - t0
        skipped = int(self.done.hget("bench:skipped", run) or 0)
        return {
            "sent": n,
            "enqueued": enqueued,
            "skipped_in_worker": skipped,
            "wall_seconds": round(wall, 4),
            "send_seconds": round(t_sent - t0, 4),
            "runs_per_second": round(enqueued / wall, 1),
            "sends_per_second": round(n / wall, 1),
            "redis_commands": commands,
            "cpu_seconds": {k: round(cpu1[k] - cpu0[k], 3) for k in cpu1},
        }


def median(xs: list[float]) -> float:
    return round(statistics.median(xs), 3) if xs else float("nan")


def summarize(
    variants: list[Variant], batches: dict[str, list[dict[str, Any]]], plain: str = "plain"
) -> dict[str, Any]:
    """Medians over the rounds; ratios paired round by round (drift touches both sides alike)."""
    out: dict[str, Any] = {}
    plain_runs = sum(b["enqueued"] for b in batches[plain])
    plain_cmds: Counter[str] = Counter()
    for b in batches[plain]:
        plain_cmds.update(b["redis_commands"])
    plain_per_run = {k: v / plain_runs for k, v in plain_cmds.items()}
    for v in variants:
        bs = batches.get(v.name) or []
        if not bs:
            continue
        runs = sum(b["enqueued"] for b in bs)
        sent = sum(b["sent"] for b in bs)
        total: Counter[str] = Counter()
        cpu: Counter[str] = Counter()
        for b in bs:
            total.update(b["redis_commands"])
            cpu.update(b["cpu_seconds"])
        extra = {
            k: total.get(k, 0) - plain_per_run.get(k, 0.0) * runs for k in set(total) | set(plain_per_run)
        }
        entry: dict[str, Any] = {
            "label": v.label,
            "hot_key": v.hot,
            "rounds": len(bs),
            "runs_per_second_median": median([b["runs_per_second"] for b in bs]),
            "runs_per_second_per_round": [b["runs_per_second"] for b in bs],
            "sends_per_second_median": median([b["sends_per_second"] for b in bs]),
            "wall_seconds_median": median([b["wall_seconds"] for b in bs]),
            "send_seconds_median": median([b["send_seconds"] for b in bs]),
            "sent_per_batch": bs[0]["sent"],
            "runs_per_batch_median": median([b["enqueued"] for b in bs]),
            "skipped_in_worker_per_batch_median": median([b["skipped_in_worker"] for b in bs]),
            "redis_commands_per_run": {k: round(n / runs, 2) for k, n in sorted(total.items())},
            "redis_extra_commands_per_run": {
                k: round(x / runs, 2) for k, x in sorted(extra.items()) if abs(x / runs) >= 0.05
            },
            "redis_extra_commands_per_run_total": round(sum(extra.values()) / runs, 2),
            "redis_extra_commands_per_send_total": round(sum(extra.values()) / sent, 2),
            "cpu_ms_per_run": {k: round(s * 1000 / runs, 3) for k, s in sorted(cpu.items())},
        }
        if v.name != plain:
            paired = [
                b["runs_per_second"] / p["runs_per_second"]
                for b, p in zip(bs, batches[plain], strict=True)
                if p["runs_per_second"] > 0
            ]
            entry["ratio_to_plain_median"] = median(paired)
            entry["ratio_to_plain_per_round"] = [round(x, 3) for x in paired]
        out[v.name] = entry
    if "ours" in out and "bare" in out:
        paired = [
            b["runs_per_second"] / p["runs_per_second"]
            for b, p in zip(batches["ours"], batches["bare"], strict=True)
        ]
        out["ours"]["ratio_to_bare_median"] = median(paired)
    return out


# -- MongoDB commands per task, counted inside a worker ----------------------------------------------------
def read_counts(directory: Path) -> Counter[str]:
    total: Counter[str] = Counter()
    for path in directory.glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            total.update(json.loads(path.read_text()))
    return total


def count_mongodb_commands(
    args: argparse.Namespace, app_module: Any, env: dict[str, str], work_dir: Path, servers: dict[str, Any]
) -> dict[str, Any]:
    """Start a worker whose processes count their MongoDB commands; run singleton tasks through it."""
    count_dir = work_dir / "counts"
    count_dir.mkdir()
    lease = args.slow_lease
    worker = Worker(
        {**env, "BENCH_COUNT_DIR": str(count_dir), "BENCH_LEASE_SECONDS": str(lease)},
        work_dir,
        args.concurrency,
        "count",
    ).start()
    try:
        bench = Bench(args, app_module, worker, servers)
        out: dict[str, Any] = {"lease_seconds": lease, "heartbeat_seconds": round(lease / 3, 3)}
        ours = next(v for v in VARIANTS if v.name == "ours")
        bench.batch(ours, 4 * args.concurrency)  # warm-up: every child creates the indexes once
        phases: list[tuple[str, Variant, int, dict[str, Any]]] = [
            ("distinct", ours, args.count_tasks, {}),
            ("hot_wait", next(v for v in VARIANTS if v.name == "ours_hot_wait"), args.count_hot_tasks, {}),
        ]
        if args.slow_tasks > 0:
            slow = Variant("ours_slow", "ours_slow", False, None, "@singleton_task holding its lease")
            phases.append(("slow", slow, args.slow_tasks, {"kwargs": {"seconds": args.slow_seconds}}))
        for name, variant, n, extra in phases:
            before = read_counts(count_dir)
            result = bench.batch(variant, n, **extra)
            after = read_counts(count_dir)
            after.subtract(before)
            runs = result["enqueued"]
            # The lease watch's commands (a getMore the server holds up to 1 s, per process) are not the
            # task's: counted apart, per task all the same.
            watch = {k: c for k, c in after.items() if k.startswith("watch:")}
            for k in watch:
                del after[k]
            per_task = {k: round(c / runs, 3) for k, c in sorted(after.items()) if c}
            lock_commands = sum(
                c
                for k, c in after.items()
                if k in ("findAndModify", "findAndModify:release", "update:release")
            )
            out[name] = {
                "tasks": runs,
                "per_task": per_task,
                "total_per_task": round(sum(after.values()) / runs, 3),
                "acquire_release_per_task": round(lock_commands / runs, 3),
                "renewals_per_task": round(after.get("update:renew", 0) / runs, 3),
                "watch_per_task": {k: round(c / runs, 3) for k, c in sorted(watch.items()) if c},
                "wall_seconds": result["wall_seconds"],
            }
            if name == "slow":
                out[name]["task_seconds"] = args.slow_seconds
            print(f"  {name}: {out[name]['per_task']} per task", flush=True)
        bench.mongo.close()
        return out
    finally:
        worker.stop()


# -- in-process: the client-side cost of one task ----------------------------------------------------------
def eager_costs(app_module: Any, calls: int, rounds: int, seed: int) -> dict[str, Any]:
    """``task.apply()`` in this process: wall and CPU time per call of plain, bare and ours.

    The CPU time is this process's alone (the MongoDB server is another process), so ours minus bare is
    what the library's own Python code costs per task, on top of the two commands.
    """
    names = {"plain": app_module.plain, "bare": app_module.bare, "ours": app_module.ours}
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, float] = dict.fromkeys(names, 0.0)
    rng = random.Random(seed)
    per = max(1, calls // rounds)
    for task in names.values():  # warm-up: connections, indexes
        for _ in range(5):
            task.apply(("eager", uuid.uuid4().hex))
    for _ in range(rounds):
        order = list(names)
        rng.shuffle(order)
        for name in order:
            task = names[name]
            c0 = time.process_time()
            for _ in range(per):
                t0 = time.perf_counter()
                task.apply(("eager", uuid.uuid4().hex)).get()
                wall[name].append(time.perf_counter() - t0)
            cpu[name] += time.process_time() - c0
    out = {
        name: {
            "calls": len(wall[name]),
            "wall_us_median": round(statistics.median(wall[name]) * 1e6, 1),
            "cpu_us_per_call": round(cpu[name] * 1e6 / len(wall[name]), 1),
        }
        for name in names
    }
    return out


def server_costs(mongo_url: str, database: str, pid: int | None, n: int) -> dict[str, Any]:
    """Wall time, and the server's CPU time when it runs here, of single commands sent directly.

    What one command costs the MongoDB server itself, whatever sends it: the floor under a singleton
    task's two commands.
    """
    from pymongo import MongoClient, ReturnDocument, WriteConcern

    from celery_mongolock.store import LeaseStore

    client: Any = MongoClient(mongo_url)
    coll = client[database].get_collection("costs", write_concern=WriteConcern(w="majority", j=True))
    holder = {"host": "bench", "pid": os.getpid()}
    commands: dict[str, Any] = {
        "ping": lambda key: client.admin.command("ping"),
        "insert_one": lambda key: coll.insert_one({"_id": key}),
        "acquire (findAndModify, pipeline upsert)": lambda key: coll.find_one_and_update(
            {"_id": key},
            LeaseStore._acquire_pipeline(uuid.uuid4().hex, 30_000, holder),
            upsert=True,
            return_document=ReturnDocument.AFTER,
        ),
        "findAndModify, plain $set upsert": lambda key: coll.find_one_and_update(
            {"_id": key}, {"$set": {"owner": "x"}}, upsert=True, return_document=ReturnDocument.AFTER
        ),
        "release (update, pipeline)": lambda key: coll.update_one(
            {"_id": key, "owner": "nobody"}, LeaseStore._release_pipeline()
        ),
    }
    out: dict[str, Any] = {}
    try:
        for name, send in commands.items():
            coll.delete_many({})
            for _ in range(5):
                send(uuid.uuid4().hex)
            wall: list[float] = []
            cpu0 = cpu_seconds(pid)
            for _ in range(n):
                key = uuid.uuid4().hex
                t0 = time.perf_counter()
                send(key)
                wall.append(time.perf_counter() - t0)
            cpu = cpu_seconds(pid) - cpu0
            out[name] = {
                "wall_us_median": round(statistics.median(wall) * 1e6, 1),
                "server_cpu_us": round(cpu * 1e6 / n, 1) if pid is not None else None,
            }
        client.drop_database(database)
    finally:
        client.close()
    return out


# -- environment -------------------------------------------------------------------------------------------
def version_of(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        **{
            d: version_of(d)
            for d in ("celery", "kombu", "billiard", "redis", "pymongo", "celery-mongolock", "secantusdb")
        },
        **{peer: version_of(peer) for peer in PEERS},
    }


def peer_status(app_errors: dict[str, str], worker_errors: dict[str, str]) -> dict[str, dict[str, Any]]:
    status: dict[str, dict[str, Any]] = {}
    for dist, (module, tested) in PEERS.items():
        version = version_of(dist)
        if version is None or importlib.util.find_spec(module) is None:
            status[dist] = {"available": False, "why": f"not installed (pip install {dist}=={tested})"}
        elif dist in app_errors or dist in worker_errors:
            status[dist] = {"available": False, "why": app_errors.get(dist) or worker_errors[dist]}
        else:
            status[dist] = {"available": True, "version": version}
    return status


@contextlib.contextmanager
def servers(mongo_url: str | None) -> Iterator[dict[str, Any]]:
    from celery_mongolock.testing import RedisServer

    with RedisServer() as broker, RedisServer() as done, contextlib.ExitStack() as stack:
        if mongo_url:
            url, embedded, kind = mongo_url, None, "url"
        else:
            from celery_mongolock.embedded import EmbeddedMongo

            server = stack.enter_context(EmbeddedMongo())
            url, embedded, kind = server.url, server, "embedded"
        assert broker.proc is not None
        assert done.proc is not None
        yield {
            "broker_url": broker.url,
            "broker_pid": broker.proc.pid,
            "done_url": done.url,
            "done_pid": done.proc.pid,
            "mongo_url": url,
            "embedded": embedded,
            "mongo_kind": kind,
            "database": f"mongolock_bench_tp_{time.strftime('%Y%m%d_%H%M%S')}_{uuid.uuid4().hex[:6]}",
        }


# -- main --------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--mongo-url", default=os.environ.get(URL_ENV) or None, help="MongoDB to use")
    parser.add_argument("--tasks", type=int, default=None, help="tasks per batch (1000; 300 quick)")
    parser.add_argument("--hot-tasks", type=int, default=None, help="tasks per hot-key batch (200; 60 quick)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (5; 3 quick)")
    parser.add_argument("--concurrency", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument(
        "--variants", default=None, help="comma-separated subset of: " + ",".join(v.name for v in VARIANTS)
    )
    parser.add_argument(
        "--count-tasks", type=int, default=None, help="tasks whose MongoDB commands are counted (200; 60)"
    )
    parser.add_argument("--count-hot-tasks", type=int, default=None, help="hot-key tasks counted (50; 20)")
    parser.add_argument("--slow-tasks", type=int, default=None, help="tasks holding their lease (0 = none)")
    parser.add_argument("--slow-seconds", type=float, default=2.5, help="how long a slow task holds it")
    parser.add_argument("--slow-lease", type=float, default=3.0, help="lease seconds in the counting worker")
    parser.add_argument(
        "--eager-calls", type=int, default=None, help="in-process calls per variant (600; 200)"
    )
    parser.add_argument("--no-count", action="store_true", help="skip counting the MongoDB commands")
    parser.add_argument(
        "--no-restart",
        dest="restart",
        action="store_false",
        help="keep one embedded server for the whole run (default: a fresh one for every MongoDB batch)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    parser.add_argument("--quick", action="store_true", help="smaller batches, fewer rounds")
    parser.add_argument("--seed", type=int, default=12345, help="seed of the round order shuffle")
    args = parser.parse_args(argv)
    q = args.quick
    defaults = {
        "tasks": 300 if q else 1000,
        "hot_tasks": 60 if q else 200,
        "rounds": 3 if q else 5,
        "count_tasks": 60 if q else 200,
        "count_hot_tasks": 20 if q else 50,
        "slow_tasks": args.concurrency,
        "eager_calls": 200 if q else 600,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    names = {v.name for v in VARIANTS}
    chosen = [s.strip() for s in args.variants.split(",")] if args.variants else [v.name for v in VARIANTS]
    unknown = set(chosen) - names
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {sorted(names)}")
    if "plain" not in chosen:
        chosen.insert(0, "plain")  # every ratio is to the plain task
    args.variants = chosen
    if min(args.tasks, args.hot_tasks, args.rounds, args.concurrency) < 1:
        parser.error("--tasks, --hot-tasks, --rounds and --concurrency must be at least 1")
    if args.slow_lease / 3 >= args.slow_seconds and args.slow_tasks:
        parser.error("--slow-seconds must exceed a heartbeat interval (--slow-lease / 3)")
    return args


def targets(summary: dict[str, Any], commands: dict[str, Any] | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if "ours" in summary:
        ratio = summary["ours"]["ratio_to_plain_median"]
        out.append(
            {
                "name": "throughput: @singleton_task (distinct keys) / plain task",
                "target": f">= {TARGET_RATIO}",
                "measured": ratio,
                "met": ratio >= TARGET_RATIO,
                "by": f"{(ratio - TARGET_RATIO) * 100:+.1f} points",
            }
        )
    if commands and "distinct" in commands:
        n = commands["distinct"]["total_per_task"]
        out.append(
            {
                "name": "MongoDB commands per singleton task (no heartbeat due)",
                "target": f"{TARGET_COMMANDS}",
                "measured": n,
                "met": n <= TARGET_COMMANDS,
                "by": f"{n - TARGET_COMMANDS:+.3f}",
            }
        )
        if "slow" in commands:
            slow = commands["slow"]
            ticks = slow["task_seconds"] / commands["heartbeat_seconds"]
            out.append(
                {
                    "name": f"MongoDB commands per task held {slow['task_seconds']:g}s "
                    f"(heartbeat every {commands['heartbeat_seconds']:g}s)",
                    "target": f"2 + renewals (<= {int(ticks)} ticks)",
                    "measured": slow["total_per_task"],
                    "met": slow["acquire_release_per_task"] <= TARGET_COMMANDS
                    and slow["renewals_per_task"] <= int(ticks),
                    "by": f"{slow['acquire_release_per_task']:g} + {slow['renewals_per_task']:g} renewals",
                }
            )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    machine = machine_info()
    work_dir = Path(tempfile.mkdtemp(prefix="mongolock-bench-tp-"))
    with servers(args.mongo_url) as srv:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "BENCH_BROKER": srv["broker_url"],
            "BENCH_DONE_REDIS": srv["done_url"],
            "BENCH_MONGODB_URL": srv["mongo_url"],
            "BENCH_DB": srv["database"],
            "BENCH_READY_DIR": str(work_dir),
        }
        env.pop("BENCH_COUNT_DIR", None)
        # This process sends the tasks with the same app, configured by the same variables.
        os.environ.update({k: env[k] for k in env if k.startswith("BENCH_")})
        if str(HERE) not in sys.path:
            sys.path.insert(0, str(HERE))
        import throughput_app as app_module

        worker = Worker(env, work_dir, args.concurrency, "bench").start()
        peers = peer_status(app_module.PEER_ERRORS, worker.info.get("peer_errors") or {})
        chosen = [
            v for v in VARIANTS if v.name in args.variants and (v.peer is None or peers[v.peer]["available"])
        ]
        not_run = {
            v.name: peers[v.peer]["why"]
            for v in VARIANTS
            if v.name in args.variants and v.peer and not peers[v.peer]["available"]
        }
        batches: dict[str, list[dict[str, Any]]] = {v.name: [] for v in chosen}
        failures: dict[str, str] = {}
        print(
            f"throughput: worker --concurrency={args.concurrency}, {args.tasks} tasks per batch "
            f"({args.hot_tasks} hot), {args.rounds} rounds; peers: {peers}",
            flush=True,
        )
        try:
            bench = Bench(args, app_module, worker, srv)

            def one(v: Variant, fresh: bool) -> dict[str, Any] | None:
                try:
                    return bench.batch(v, args.hot_tasks if v.hot else args.tasks, fresh=fresh)
                except Exception as exc:  # a peer that breaks is reported, not fatal
                    if v.peer is None:
                        raise
                    failures[v.name] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    print(f"  {v.name} failed: {failures[v.name]}", flush=True)
                    return None

            for v in chosen:  # warm-up: connections, indexes, code paths of every variant
                if one(v, False) is None:
                    not_run[v.name] = failures[v.name]
            chosen = [v for v in chosen if v.name not in not_run]
            rng = random.Random(args.seed)
            for r in range(args.rounds):
                order = list(chosen)
                rng.shuffle(order)
                line = []
                for v in order:
                    result = one(v, args.restart)
                    if result is not None:
                        batches[v.name].append(result)
                        line.append(f"{v.name} {result['runs_per_second']:.0f}/s")
                print(f"  round {r + 1}/{args.rounds}: " + ", ".join(line), flush=True)
            summary = summarize(chosen, batches)
        finally:
            worker.stop()
        commands = None
        if not args.no_count and "ours" in args.variants:
            print("MongoDB commands per task, counted in the worker ...", flush=True)
            commands = count_mongodb_commands(args, app_module, env, work_dir, srv)
        print("in-process cost per task (task.apply()) ...", flush=True)
        if args.restart:
            bench.fresh_server()
        eager = eager_costs(app_module, args.eager_calls, 5 if not args.quick else 3, args.seed)
        print("what single commands cost the MongoDB server ...", flush=True)
        if args.restart:
            bench.fresh_server()
        embedded = srv["embedded"]
        costs = server_costs(
            srv["mongo_url"], srv["database"] + "_costs", embedded.pid if embedded else None, args.eager_calls
        )
        from celery_mongolock.config import get_store

        get_store(app_module.app).close()
        with contextlib.suppress(Exception):
            bench.mongo.drop_database(srv["database"])
            bench.mongo.close()
        server = {"kind": srv["mongo_kind"]}
    shutil.rmtree(work_dir, ignore_errors=True)  # worker logs: kept only when the run failed
    return {
        "benchmark": "throughput",
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "server": server,
        "parameters": {
            "quick": args.quick,
            "concurrency": args.concurrency,
            "pool": "prefork",
            "tasks_per_batch": args.tasks,
            "hot_tasks_per_batch": args.hot_tasks,
            "rounds": args.rounds,
            "seed": args.seed,
            "result_backend": None,
            "fresh_server_per_mongodb_batch": bool(args.restart and server["kind"] == "embedded"),
            "worker_prefetch_multiplier": 4,
            "lease_seconds": 30,
            "write_concern": {"w": "majority", "j": True},
        },
        "peers": peers,
        "not_run": not_run,
        "peer_failures": failures,
        "variants": summary,
        "batches": batches,
        "mongodb_commands": commands,
        "in_process": eager,
        "server_cost_per_command": costs,
        "targets": targets(summary, commands),
        "duration_seconds": round(time.perf_counter() - started, 1),
    }


def print_summary(result: dict[str, Any]) -> None:
    print()
    p = result["parameters"]
    print(
        f"== throughput ({result['server']['kind']} MongoDB, prefork x{p['concurrency']}, "
        f"{p['tasks_per_batch']} tasks/batch, {p['hot_tasks_per_batch']} hot, {p['rounds']} rounds, "
        f"{result['duration_seconds']}s)"
    )
    print(f"  {'variant':<16}{'runs/s':>9}{'x plain':>9}{'Redis +/run':>13}  CPU ms/run (mongo, children)")
    for name, v in result["variants"].items():
        cpu = v["cpu_ms_per_run"]
        print(
            f"  {name:<16}{v['runs_per_second_median']:>9.0f}{v.get('ratio_to_plain_median', 1.0):>9.2f}"
            f"{v['redis_extra_commands_per_run_total']:>13.2f}  "
            f"{cpu.get('mongodb_server', 0):.2f}, {cpu.get('worker_children', 0):.2f}"
            + (
                f"  ({v['runs_per_batch_median']:.0f} of {v['sent_per_batch']} sends ran)"
                if v["hot_key"]
                else ""
            )
        )
    for name, why in result["not_run"].items():
        print(f"  {name:<16} not run: {why}")
    if result["mongodb_commands"]:
        print("MongoDB commands per task (in the worker):")
        for phase in ("distinct", "hot_wait", "slow"):
            if phase in result["mongodb_commands"]:
                print(f"  {phase:<10}{result['mongodb_commands'][phase]['per_task']}")
    print("in-process (task.apply()) per call:")
    for name, e in result["in_process"].items():
        print(f"  {name:<8} wall {e['wall_us_median']:>8.0f}us  client CPU {e['cpu_us_per_call']:>8.0f}us")
    print("single commands (majority, journaled writes): wall / MongoDB server CPU:")
    for name, c in result["server_cost_per_command"].items():
        print(f"  {name:<42} {c['wall_us_median']:>8.0f}us / {c['server_cpu_us']}us")
    for t in result["targets"]:
        print(
            f"target {t['name']}: {t['measured']} ({t['target']}): "
            f"{'met' if t['met'] else 'MISSED'} {t['by']}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_summary(result)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
