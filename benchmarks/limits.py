"""Benchmark of ``limit=N`` and ``keys=(...)``: commands and latency per run, against a single key.

Run it from the repository root (after ``make venv``)::

    .venv/bin/python benchmarks/limits.py              # embedded server (about 6 minutes)
    .venv/bin/python benchmarks/limits.py --quick      # under a minute
    .venv/bin/python benchmarks/limits.py --mongo-url mongodb://host:27017/

Two parts (issue 17, item 5):

* **Store** (``LeaseStore`` alone, one client with a pymongo ``CommandListener``): acquire + release of a
  single lease, and of a slot of a ``limit=N`` key (N = 1, 3, 10) on which 0, about N/2 - 1 or N - 1 other
  holds are already taken (the run's hold is the first, about the middle or the last one), plus the
  refused acquire of a full key; interleaved rounds, shuffled (seeded). Then one heartbeat tick
  (``renew_many``) of a process holding 1 to 100 single leases or slot leases.
* **Workers** (a prefork ``celery worker`` of ``limits_app.py``, a Redis broker): batches of tasks on
  distinct tenants (uncontended) with ``key=``, ``limit=3``, ``limit=10``, ``keys=`` of 2 and 4 keys, and a
  plain task; inside the pool processes, the time from ``task_prerun`` to ``task_postrun`` per run and the
  MongoDB commands sent on the task's thread per run.

Output: JSON (``benchmarks/results/limits.json`` by default) with a Markdown ``summary`` that ``run.py``
puts in its report. See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pymongo import MongoClient
from pymongo.monitoring import CommandFailedEvent, CommandListener, CommandStartedEvent, CommandSucceededEvent

from celery_mongolock import Lease, LeaseStore

Document = dict[str, Any]
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
URL_ENV = "MONGOLOCK_TEST_MONGODB_URL"
DEFAULT_OUT = HERE / "results" / "limits.json"
IGNORED = frozenset({"hello", "isMaster", "ismaster", "endSessions", "ping", "buildInfo", "saslStart"})
LIMITS = (1, 3, 10)
WORKER_VARIANTS = ("plain", "single", "limit3", "limit10", "keys2", "keys4")
WORKER_LABELS = {
    "plain": "plain task (no lease)",
    "single": '`key="one:{t}"` (single lease)',
    "limit3": "`limit=3`",
    "limit10": "`limit=10`",
    "keys2": "`keys=` 2 keys",
    "keys4": "`keys=` 4 keys",
}


class Commands(CommandListener):
    """Counts the commands started, by name (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def started(self, event: CommandStartedEvent) -> None:
        if event.command_name in IGNORED:
            return
        with self._lock:
            self.counts[event.command_name] += 1

    def succeeded(self, event: CommandSucceededEvent) -> None:
        pass

    def failed(self, event: CommandFailedEvent) -> None:
        pass

    def take(self) -> Counter[str]:
        with self._lock:
            out, self.counts = self.counts, Counter()
        return out


def summarize(samples_us: list[float]) -> dict[str, float]:
    us = sorted(samples_us)
    q = statistics.quantiles(us, n=100, method="inclusive") if len(us) >= 2 else [us[0]] * 99
    return {
        "n": len(us),
        "median_us": round(statistics.median(us), 1),
        "p90_us": round(q[89], 1),
        "p99_us": round(q[98], 1),
        "mean_us": round(statistics.fmean(us), 1),
    }


def per(counts: Counter[str], n: int) -> dict[str, float]:
    return {name: round(c / n, 3) for name, c in sorted(counts.items()) if c}


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


@contextlib.contextmanager
def mongo_url(given: str | None) -> Iterator[tuple[str, str, Any]]:
    if given:
        yield given, "url", None
        return
    from celery_mongolock.embedded import EmbeddedMongo

    with EmbeddedMongo() as server:
        yield server.url, "embedded", server


# -- part 1: the lease store ---------------------------------------------------------------------------------
def others_levels(limit: int) -> list[int]:
    """Other holds already on the key when the run takes its slot: the run's hold is the 1st, the
    ceil(N/2)-th and the N-th (so 0, ceil(N/2) - 1 and N - 1 others), each once."""
    return sorted({0, math.ceil(limit / 2) - 1, limit - 1})


class StoreVariant:
    """One way of taking a key: its keys (prepared with ``others`` holds of someone else) and its op."""

    def __init__(self, name: str, limit: int | None, others: int, full: bool, keys: list[str]) -> None:
        self.name, self.limit, self.others, self.full, self.keys = name, limit, others, full, keys
        self.i = 0
        self.not_released: list[dict[str, Any]] = []

    def prepare(self, other: LeaseStore) -> None:
        for key in self.keys:
            for _ in range(self.others):
                lease = other.acquire(key, 3600, limit=self.limit)
                assert lease is not None, (self.name, key)

    def one(self, store: LeaseStore) -> tuple[int, int]:
        """One acquire + release (a refused acquire alone when the key is full): its two parts' times, ns."""
        key = self.keys[self.i % len(self.keys)]
        self.i += 1
        clock = time.perf_counter_ns
        t0 = clock()
        lease = store.acquire(key, limit=self.limit)
        t1 = clock()
        if self.full:
            assert lease is None, (self.name, key)
            return t1 - t0, 0
        assert lease is not None, (self.name, key)
        released = lease.release()
        t2 = clock()
        if not released:  # not expected: kept as evidence (the key's document as it is now)
            doc = store.collection.find_one({"_id": key}) or {}
            self.not_released.append(
                {
                    "key": key,
                    "token": lease.owner,
                    "slot": lease.slot,
                    "fence": lease.fence,
                    "acquire_ms": round((t1 - t0) / 1e6, 1),
                    "release_ms": round((t2 - t1) / 1e6, 1),
                    "owner_now": doc.get("owner"),
                    "holds_now": [
                        {k: str(v) for k, v in h.items() if k in ("o", "s", "f", "x", "a")}
                        for h in doc.get("hs") or []
                    ],
                    "ends_now": [
                        {k: str(v) for k, v in e.items() if k in ("f", "how", "slot", "e")}
                        for e in doc.get("ends") or []
                    ],
                }
            )
        return t1 - t0, t2 - t1


def store_variants(keys_per_variant: int) -> list[StoreVariant]:
    out = [StoreVariant("single", None, 0, False, [f"single:{i}" for i in range(keys_per_variant)])]
    for n in LIMITS:
        for others in others_levels(n):
            name = f"limit{n}_holds{others + 1}"
            out.append(StoreVariant(name, n, others, False, [f"{name}:{i}" for i in range(keys_per_variant)]))
        name = f"limit{n}_full"
        out.append(StoreVariant(name, n, n, True, [f"{name}:{i}" for i in range(keys_per_variant)]))
    return out


def measure_store(args: argparse.Namespace, url: str, database: str) -> dict[str, Any]:
    rng = random.Random(args.seed)
    counter = Commands()
    client: MongoClient[Document] = MongoClient(url, event_listeners=[counter], tz_aware=True)
    other_client: MongoClient[Document] = MongoClient(url, tz_aware=True)
    # history_days=0: the history's cost is history.py's; here only the lease document's commands count.
    store = LeaseStore(client, database=database, collection="leases", history_days=0, lease_seconds=30)
    other = LeaseStore(other_client, database=database, collection="leases", history_days=0)
    try:
        store.ensure_indexes()
        variants = store_variants(args.store_keys)
        for v in variants:
            v.prepare(other)
        for v in variants:  # warm-up: the documents exist, the connections are open
            for _ in range(max(2, args.store_keys)):
                v.one(store)
        counter.take()
        samples: dict[str, list[float]] = {v.name: [] for v in variants}
        parts: dict[str, tuple[list[float], list[float]]] = {v.name: ([], []) for v in variants}
        commands: dict[str, Counter[str]] = {v.name: Counter() for v in variants}
        per_round = max(1, args.store_iterations // args.rounds)
        clock = time.perf_counter_ns
        for _ in range(args.rounds):
            order = list(variants)
            rng.shuffle(order)
            for v in order:
                counter.take()
                for _ in range(per_round):
                    t0 = clock()
                    acquire_ns, release_ns = v.one(store)
                    samples[v.name].append((clock() - t0) / 1000.0)
                    parts[v.name][0].append(acquire_ns / 1000.0)
                    parts[v.name][1].append(release_ns / 1000.0)
                commands[v.name] += counter.take()
        results: dict[str, Any] = {}
        base = summarize(samples["single"])
        for v in variants:
            stats = summarize(samples[v.name])
            n = len(samples[v.name])
            results[v.name] = {
                "limit": v.limit or 1,
                "other_holds": v.others,
                "refused": v.full,
                "operation": "acquire (refused: the key is full)" if v.full else "acquire + release",
                "iterations": n,
                "latency": stats,
                "acquire_median_us": round(statistics.median(parts[v.name][0]), 1),
                "release_median_us": None if v.full else round(statistics.median(parts[v.name][1]), 1),
                "commands_per_iteration": per(commands[v.name], n),
                "releases_not_ours": v.not_released,
                "median_over_single": ratio(stats["median_us"], base["median_us"]),
                "p90_over_single": ratio(stats["p90_us"], base["p90_us"]),
            }
        heartbeat = measure_heartbeat(args, client, counter, database)
    finally:
        store.close()
        other.close()
        client.close()
        other_client.close()
    last_over_first = {
        str(n): ratio(
            results[f"limit{n}_holds{n}"]["latency"]["median_us"],
            results[f"limit{n}_holds1"]["latency"]["median_us"],
        )
        for n in LIMITS
        if n > 1
    }
    return {
        "iterations_per_variant": per_round * args.rounds,
        "last_over_first_slot": last_over_first,
        "rounds": args.rounds,
        "keys_per_variant": args.store_keys,
        "variants": results,
        "heartbeat": heartbeat,
    }


def fill(collection: Any, documents: int) -> None:
    """``documents`` lease documents of other keys, as a busy deployment leaves them: released, half of
    them single-lease documents and half slot documents (an empty ``hs``), expiring in an hour."""
    import datetime as _dt

    later = _dt.datetime.now(_dt.timezone.utc) + _dt.timedelta(hours=1)
    batch: list[Document] = []
    for i in range(documents):
        doc: Document = {"_id": f"filler:{i}", "owner": None, "fence": i + 1, "expires_at": later}
        doc.update({"gc_at": later, "released_at": later})
        if i % 2:
            doc.update({"hs": [], "lim": 3})
        batch.append(doc)
        if len(batch) == 5000:
            collection.insert_many(batch, ordered=False)
            batch = []
    if batch:
        collection.insert_many(batch, ordered=False)


def measure_heartbeat(
    args: argparse.Namespace, client: MongoClient[Document], counter: Commands, database: str
) -> dict[str, Any]:
    """One ``renew_many`` call (a heartbeat tick) for ``size`` single leases or slot leases (``limit=3``,
    each key also holding 2 holds of another process), in a collection of their own; then one lease of
    each kind among ``--heartbeat-documents`` other lease documents."""
    out: dict[str, Any] = {}
    cases = [(size, 0) for size in args.heartbeat_sizes]
    if args.heartbeat_documents:
        cases.append((1, args.heartbeat_documents))
    for size, documents in cases:
        suffix = f"_among_{documents}" if documents else ""
        for kind in ("single", "slots"):
            coll = f"leases_renew_{kind}_{size}{suffix}"
            store = LeaseStore(client, database=database, collection=coll, history_days=0)
            other = LeaseStore(client, database=database, collection=coll, history_days=0)
            try:
                if documents:
                    store.ensure_indexes()
                    fill(store.collection, documents)
                leases: list[Lease] = []
                for i in range(size):
                    key = f"renew:{i}"
                    if kind == "slots":
                        for _ in range(2):
                            assert other.acquire(key, 3600, limit=3) is not None
                    lease = store.acquire(key, 3600, limit=3 if kind == "slots" else None)
                    assert lease is not None
                    leases.append(lease)
                store.renew_many(leases, timeout=300)  # warm-up
                samples: list[float] = []
                calls: list[dict[str, int]] = []
                lost = 0
                for _ in range(args.heartbeat_calls):
                    counter.take()
                    t0 = time.perf_counter_ns()
                    lost += len(store.renew_many(leases, timeout=300))
                    samples.append((time.perf_counter_ns() - t0) / 1000.0)
                    calls.append(dict(sorted(counter.take().items())))
                distinct = [dict(c) for c in {tuple(c.items()) for c in calls}]
                stats = summarize(samples)
                out[f"{kind}_{size}{suffix}"] = {
                    "kind": kind,
                    "leases": size,
                    "other_documents": documents,
                    "latency": stats,
                    "median_us_per_lease": round(stats["median_us"] / size, 1),
                    "commands_per_call": sorted(distinct, key=lambda c: sorted(c.items())),
                    "lost": lost,
                }
            finally:
                client[database][coll].drop()
        s, t = out[f"single_{size}{suffix}"], out[f"slots_{size}{suffix}"]
        t["median_over_single"] = ratio(t["latency"]["median_us"], s["latency"]["median_us"])
    return out


# -- part 2: through real workers ----------------------------------------------------------------------------
class Worker:
    """One ``celery -A limits_app worker`` (prefork; or another app of this folder), in its own process
    group."""

    def __init__(
        self, env: dict[str, str], work_dir: Path, concurrency: int, app: str = "limits_app"
    ) -> None:
        self.env, self.work_dir, self.concurrency, self.app = env, work_dir, concurrency, app
        self.name = f"{app.split('_', 1)[0]}@localhost"
        self.log_path = work_dir / "worker.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> Worker:
        marker = Path(self.env["BENCH_READY_DIR"]) / f"{self.name}.ready"
        cmd = [sys.executable, "-m", "celery", "-A", self.app, "worker", "--pool=prefork"]
        cmd += [f"--concurrency={self.concurrency}", "-n", self.name, "--loglevel=WARNING"]
        cmd += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=HERE,
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
        return self

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@contextlib.contextmanager
def worker_on_redis(
    app_name: str, url: str, database: str, concurrency: int, settings: dict[str, str]
) -> Iterator[tuple[Any, Worker, MongoClient[dict[str, Any]]]]:
    """A Redis server of its own (``celery_mongolock.testing``), one prefork worker of the app module
    ``app_name`` of this folder (``settings``: its ``BENCH_*`` environment) and a client of the
    benchmark's database: ``(app module, worker, client)``, all stopped and closed on the way out."""
    import importlib

    from celery_mongolock.testing import RedisServer

    with tempfile.TemporaryDirectory(prefix=f"bench-{app_name}-") as tmp, RedisServer() as broker:
        work_dir = Path(tmp)
        ready_dir = work_dir / "ready"
        ready_dir.mkdir()
        env = {
            **os.environ,
            "BENCH_BROKER": broker.url,
            "BENCH_MONGODB_URL": url,
            "BENCH_DB": database,
            "BENCH_READY_DIR": str(ready_dir),
            **settings,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        }
        # (the app module reads its settings from the environment when it is imported)
        os.environ.update({k: env[k] for k in ("BENCH_BROKER", *settings)})
        module = importlib.import_module(app_name)
        module.app.conf.broker_url = broker.url
        worker = Worker(env, work_dir, concurrency, app=app_name).start()
        client: MongoClient[dict[str, Any]] = MongoClient(url)
        try:
            yield module, worker, client
        finally:
            worker.stop()
            client.close()
            module.app.close()


def read_state(directory: Path) -> list[dict[str, Any]]:
    out = []
    for path in directory.glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            out.append(json.loads(path.read_text()))
    return out


def batch_figures(directory: Path, batch: str) -> tuple[int, list[float], Counter[str], Counter[str]]:
    done, durations, task, other = 0, [], Counter[str](), Counter[str]()
    for s in read_state(directory):
        done += s["done"].get(batch, 0)
        durations += s["durations_us"].get(batch, [])
        task.update(s["task_commands"].get(batch, {}))
        other.update(s["other_commands"].get(batch, {}))
    return done, durations, task, other


def run_batch(
    app_module: Any, variant: str, n: int, count_dir: Path, *, worker: Worker, leases: Any
) -> dict[str, Any]:
    task = getattr(app_module, variant)
    batch = f"{variant}-{uuid.uuid4().hex[:10]}"
    # An empty lease collection for every batch (no lease is held between batches): on the embedded
    # server a findAndModify on an existing document, such as a single lease's release, scans the
    # collection, so the figures would otherwise grow with the documents earlier batches left.
    leases.delete_many({})
    t0 = time.perf_counter()
    for i in range(n):
        task.apply_async((batch, f"{batch}-{i}"))
    deadline = time.monotonic() + max(120.0, n * 0.5)
    while True:
        done, durations, task_cmds, other_cmds = batch_figures(count_dir, batch)
        if done >= n:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"batch {batch}: {done} of {n} runs done\n{worker.log_tail()}")
        time.sleep(0.005)
    wall = time.perf_counter() - t0
    return {
        "batch": batch,
        "runs": done,
        "wall_seconds": round(wall, 4),
        "runs_per_second": round(done / wall, 1),
        "durations_us": durations,
        "task_commands": task_cmds,
        "other_commands": other_cmds,
    }


def measure_workers(args: argparse.Namespace, url: str, database: str) -> dict[str, Any]:
    from celery_mongolock.testing import RedisServer

    rng = random.Random(args.seed + 1)
    sys.path.insert(0, str(HERE))
    with tempfile.TemporaryDirectory(prefix="bench-limits-") as tmp, RedisServer() as broker:
        work_dir = Path(tmp)
        count_dir, ready_dir = work_dir / "counts", work_dir / "ready"
        count_dir.mkdir()
        ready_dir.mkdir()
        env = {
            **os.environ,
            "BENCH_BROKER": broker.url,
            "BENCH_MONGODB_URL": url,
            "BENCH_DB": database,
            "BENCH_LEASE_SECONDS": str(args.lease_seconds),
            "BENCH_READY_DIR": str(ready_dir),
            "BENCH_COUNT_DIR": str(count_dir),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        }
        os.environ["BENCH_BROKER"] = broker.url
        import limits_app

        limits_app.app.conf.broker_url = broker.url
        worker = Worker(env, work_dir, args.concurrency).start()
        client: MongoClient[Document] = MongoClient(url)
        leases = client[database]["leases"]
        try:
            for v in WORKER_VARIANTS:  # warm-up: every pool process makes its client and indexes
                run_batch(limits_app, v, 4 * args.concurrency, count_dir, worker=worker, leases=leases)
            batches: dict[str, list[dict[str, Any]]] = {v: [] for v in WORKER_VARIANTS}
            for _ in range(args.rounds):
                order = list(WORKER_VARIANTS)
                rng.shuffle(order)
                for v in order:
                    batches[v].append(
                        run_batch(limits_app, v, args.tasks, count_dir, worker=worker, leases=leases)
                    )
        finally:
            worker.stop()
            client.close()
            limits_app.app.close()
    variants: dict[str, Any] = {}
    for v, bs in batches.items():
        runs = sum(b["runs"] for b in bs)
        task_cmds: Counter[str] = sum((b["task_commands"] for b in bs), Counter())
        other_cmds: Counter[str] = sum((b["other_commands"] for b in bs), Counter())
        durations = [d for b in bs for d in b["durations_us"]]
        variants[v] = {
            "label": WORKER_LABELS[v],
            "runs": runs,
            "latency": summarize(durations),
            "task_thread_commands_per_run": per(task_cmds, runs),
            "task_thread_commands_per_run_total": round(sum(task_cmds.values()) / runs, 3),
            "other_thread_commands_per_run": per(other_cmds, runs),
            "runs_per_second_median": round(statistics.median(b["runs_per_second"] for b in bs), 1),
            "runs_per_second_per_round": [b["runs_per_second"] for b in bs],
        }
    plain, single = variants["plain"]["latency"]["median_us"], variants["single"]["latency"]["median_us"]
    lock_single = single - plain
    for v, d in variants.items():
        med = d["latency"]["median_us"]
        d["lease_us_median"] = round(med - plain, 1)  # over the plain task's prerun -> postrun
        if v == "plain":
            continue
        d["median_over_single"] = ratio(med, single)
        d["p90_over_single"] = ratio(d["latency"]["p90_us"], variants["single"]["latency"]["p90_us"])
        d["lease_us_over_single"] = ratio(med - plain, lock_single)
        d["commands_over_single"] = ratio(
            d["task_thread_commands_per_run_total"], variants["single"]["task_thread_commands_per_run_total"]
        )
        d["runs_per_second_over_single"] = ratio(
            d["runs_per_second_median"], variants["single"]["runs_per_second_median"]
        )
    return {
        "concurrency": args.concurrency,
        "tasks_per_batch": args.tasks,
        "rounds": args.rounds,
        "lease_seconds": args.lease_seconds,
        "variants": variants,
    }


# -- the report --------------------------------------------------------------------------------------------
def fmt_cmds(c: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in c.items()) or "none"


def summary_lines(store: dict[str, Any] | None, workers: dict[str, Any] | None) -> list[str]:
    lines: list[str] = []
    if store:
        sv = store["variants"]
        lines += [
            f"**Lease store** ({store['iterations_per_variant']} iterations per variant in "
            f"{store['rounds']} interleaved rounds; other holds are another client's, taken beforehand):",
            "",
            "| variant | other holds | commands per iteration | median µs | p90 µs | median / single | "
            "acquire / release median µs |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
        ]
        for name, v in sv.items():
            label = (
                "single lease"
                if name == "single"
                else f"`limit={v['limit']}`" + (", full: acquire refused" if v["refused"] else "")
            )
            lines.append(
                f"| {label} | {v['other_holds']} | {fmt_cmds(v['commands_per_iteration'])} | "
                f"{v['latency']['median_us']:,.0f} | {v['latency']['p90_us']:,.0f} | "
                f"{v['median_over_single']:.2f} | {v['acquire_median_us']:,.0f} / "
                + ("-" if v["release_median_us"] is None else f"{v['release_median_us']:,.0f}")
                + " |"
            )
        hb = store["heartbeat"]
        lines += [
            "",
            "| heartbeat tick (`renew_many`) | leases | other lease documents | commands per call | "
            "median µs | "
            "per lease µs | slots / single |",
            "| --- | ---: | ---: | --- | ---: | ---: | ---: |",
        ]
        for h in sorted(hb.values(), key=lambda h: (h["other_documents"], h["leases"], h["kind"])):
            calls = " or ".join(fmt_cmds(c) for c in h["commands_per_call"])
            lines.append(
                f"| {'slot leases (`limit=3`)' if h['kind'] == 'slots' else 'single leases'} | "
                f"{h['leases']:,} | {h['other_documents']:,} | {calls} | {h['latency']['median_us']:,.0f} | "
                f"{h['median_us_per_lease']:,.1f} | "
                + (f"{h['median_over_single']:.2f}" if h.get("median_over_single") else "")
                + " |"
            )
        grow = ", ".join(f"`limit={n}` {g:.2f}" for n, g in store["last_over_first_slot"].items())
        lines += [
            "",
            "* store: every variant sends one command to acquire (taken or refused) and one to release; "
            f"the last slot of a key over its first (median): {grow}; the heartbeat tick sends one "
            "`update` for slot leases as for single leases",
        ]
        odd = {name: len(v["releases_not_ours"]) for name, v in sv.items() if v["releases_not_ours"]}
        if odd:
            lines.append(
                "* **unexpected**: a release of a lease just taken found it no longer ours (details in "
                "`store.variants.*.releases_not_ours`): "
                + ", ".join(f"{name} {n} of {sv[name]['iterations']}" for name, n in odd.items())
            )
    if workers:
        wv = workers["variants"]
        lines += [
            "",
            f"**Through a worker** (prefork, concurrency {workers['concurrency']}, distinct tenants: no "
            f"contention; {workers['tasks_per_batch']} tasks per batch, {workers['rounds']} interleaved "
            f"rounds). Latency: `task_prerun` to `task_postrun` in the pool process (acquire, empty body, "
            f"release); commands: those sent on the task's thread, per run:",
            "",
            "| task | commands per run | median µs | p90 µs | lease µs (over plain) | median / single | "
            "lease / single | runs/s |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, v in wv.items():
            lines.append(
                f"| {v['label']} | {fmt_cmds(v['task_thread_commands_per_run'])} | "
                f"{v['latency']['median_us']:,.0f} | {v['latency']['p90_us']:,.0f} | "
                f"{v['lease_us_median']:,.0f} | "
                + (
                    f"{v['median_over_single']:.2f} | {v['lease_us_over_single']:.2f} | "
                    if name != "plain"
                    else " | | "
                )
                + f"{v['runs_per_second_median']:,.0f} |"
            )
        lines += [
            "",
            "* workers: commands per run, single key "
            f"{wv['single']['task_thread_commands_per_run_total']:g}; limit=3 / 10: "
            f"{wv['limit3']['task_thread_commands_per_run_total']:g} / "
            f"{wv['limit10']['task_thread_commands_per_run_total']:g}; 2 / 4 keys: "
            f"{wv['keys2']['task_thread_commands_per_run_total']:g} / "
            f"{wv['keys4']['task_thread_commands_per_run_total']:g} "
            f"(x{wv['keys2']['commands_over_single']:g} / x{wv['keys4']['commands_over_single']:g})",
            "* workers: lease time per run (over the plain task) / a single key's: "
            + ", ".join(
                f"{label} {wv[name]['lease_us_over_single']:.2f}"
                for name, label in (
                    ("limit3", "limit=3"),
                    ("limit10", "limit=10"),
                    ("keys2", "2 keys"),
                    ("keys4", "4 keys"),
                )
            ),
        ]
    return lines


def run(args: argparse.Namespace) -> dict[str, Any]:
    logging.getLogger("celery_mongolock").setLevel(logging.ERROR)
    started = time.perf_counter()
    database = f"mongolock_bench_limits_{uuid.uuid4().hex[:8]}"
    store: dict[str, Any] | None = None
    workers: dict[str, Any] | None = None
    with mongo_url(args.mongo_url) as (url, kind, embedded):
        try:
            if "store" in args.parts:
                print("store ...", flush=True)
                store = measure_store(args, url, database)
            if "workers" in args.parts:
                if embedded is not None:
                    embedded.restart()  # its writes slow down with every write taken: start afresh
                print("workers ...", flush=True)
                workers = measure_workers(args, url, database + "_w")
        finally:
            with contextlib.suppress(Exception), MongoClient(url) as c:
                c.drop_database(database)
                c.drop_database(database + "_w")
    return {
        "benchmark": "limits",
        "server": {"kind": kind},
        "quick": args.quick,
        "parameters": {
            k: getattr(args, k)
            for k in (
                "store_iterations",
                "rounds",
                "store_keys",
                "heartbeat_sizes",
                "heartbeat_documents",
                "heartbeat_calls",
                "tasks",
                "concurrency",
                "lease_seconds",
                "seed",
                "parts",
            )
        },
        "store": store,
        "workers": workers,
        "summary": summary_lines(store, workers),
        "machine": {"cpu_count": os.cpu_count(), "python": sys.version.split()[0]},
        "duration_seconds": round(time.perf_counter() - started, 1),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--mongo-url", default=os.environ.get(URL_ENV) or None, help="MongoDB to use")
    parser.add_argument(
        "--store-iterations", type=int, default=None, help="store: iterations per variant (600; 150 quick)"
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds, both parts (10; 3 quick)"
    )
    parser.add_argument(
        "--store-keys", type=int, default=5, help="store: keys each variant cycles through (5)"
    )
    parser.add_argument(
        "--heartbeat-sizes", default=None, help="store: leases per heartbeat tick (1,10,100; 1,10 quick)"
    )
    parser.add_argument(
        "--heartbeat-documents",
        type=int,
        default=None,
        help="store: other lease documents beside one lease per kind (20000; 2000 quick; 0 skips)",
    )
    parser.add_argument(
        "--heartbeat-calls", type=int, default=None, help="timed ticks per size (20; 5 quick)"
    )
    parser.add_argument("--tasks", type=int, default=None, help="workers: tasks per batch (40; 16 quick)")
    parser.add_argument("--concurrency", type=int, default=2, help="workers: pool processes (2)")
    parser.add_argument(
        "--lease-seconds", type=float, default=30.0, help="workers' lease (30: no tick in a run)"
    )
    parser.add_argument("--parts", default="store,workers", help="store, workers or both (default)")
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    args.store_iterations = args.store_iterations or (150 if args.quick else 600)
    args.rounds = args.rounds or (3 if args.quick else 10)
    sizes = args.heartbeat_sizes or ("1,10" if args.quick else "1,10,100")
    args.heartbeat_sizes = [int(s) for s in sizes.split(",") if s.strip()]
    if args.heartbeat_documents is None:
        args.heartbeat_documents = 2000 if args.quick else 20000
    args.heartbeat_calls = args.heartbeat_calls or (5 if args.quick else 20)
    args.tasks = args.tasks or (16 if args.quick else 40)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if set(args.parts) - {"store", "workers"}:
        parser.error(f"unknown parts {args.parts}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(result["summary"]))
    print(f"\nwrote {args.out} in {result['duration_seconds']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
