"""Benchmark of the lease history's cost: commands and latency per acquire + release, history on and off.

Run it from the repository root (after ``make venv``)::

    .venv/bin/python benchmarks/history.py              # embedded server (about a minute)
    .venv/bin/python benchmarks/history.py --quick      # about 20 seconds
    .venv/bin/python benchmarks/history.py --mongo-url mongodb://host:27017/

Two stores on one server, ``history_days=7`` and ``history_days=0``, each with its own client and a
pymongo ``CommandListener``, take and release keys the way a worker process does (``heartbeat=True``:
the heartbeat thread runs and writes the queued history records at its ticks). Rounds of the two variants
are interleaved. Commands are counted per thread: those of the task's thread (the hot path: acquire and
release) and those of the heartbeat thread (the batched ``insert`` of the history), per run. Also timed:
one ``insert_many`` of a batch of records as a tick sends it. Output: JSON (``benchmarks/results/
history.json`` by default) with a Markdown ``summary`` that ``run.py`` puts in its report.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import logging
import os
import random
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pymongo import MongoClient
from pymongo.monitoring import CommandFailedEvent, CommandListener, CommandStartedEvent, CommandSucceededEvent

from celery_mongolock import LeaseStore
from celery_mongolock.core.documents.base import history_record

Document = dict[str, Any]
URL_ENV = "MONGOLOCK_TEST_MONGODB_URL"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "history.json"
IGNORED = frozenset({"hello", "isMaster", "ismaster", "endSessions", "ping", "buildInfo", "saslStart"})


class ThreadCounter(CommandListener):
    """Counts commands by name, apart for the thread that registered as the task's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.task_thread: int | None = None
        self.task: Counter[str] = Counter()
        self.background: Counter[str] = Counter()

    def started(self, event: CommandStartedEvent) -> None:
        if event.command_name in IGNORED:
            return
        if threading.current_thread().name == "celery_mongolock-lease-watch":
            return  # the lease watch's change stream: not the history's cost
        with self._lock:
            side = self.task if threading.get_ident() == self.task_thread else self.background
            side[event.command_name] += 1

    def succeeded(self, event: CommandSucceededEvent) -> None:
        pass

    def failed(self, event: CommandFailedEvent) -> None:
        pass

    def reset(self) -> None:
        with self._lock:
            self.task.clear()
            self.background.clear()


def summarize(samples_ns: list[int]) -> dict[str, float]:
    us = sorted(s / 1000.0 for s in samples_ns)
    q = statistics.quantiles(us, n=100, method="inclusive") if len(us) >= 2 else [us[0]] * 99
    return {
        "n": len(us),
        "median_us": round(statistics.median(us), 1),
        "p90_us": round(q[89], 1),
        "p99_us": round(q[98], 1),
        "mean_us": round(statistics.fmean(us), 1),
    }


def per_run(counts: Counter[str], runs: int) -> dict[str, float]:
    return {name: round(n / runs, 4) for name, n in sorted(counts.items())}


@contextlib.contextmanager
def mongo_url(given: str | None) -> Iterator[tuple[str, str]]:
    if given:
        yield given, "url"
        return
    from celery_mongolock.embedded import EmbeddedMongo

    with EmbeddedMongo() as server:
        yield server.url, "embedded"


def one_round(store: LeaseStore, n: int, keys: list[str]) -> list[int]:
    """``n`` runs, as a worker process does them: acquire with the heartbeat, release."""
    out: list[int] = []
    clock = time.perf_counter_ns
    info = {"task_name": "bench.task", "worker": "bench@host", "delivery": "0.0"}
    for i in range(n):
        key = keys[i % len(keys)]
        t0 = clock()
        lease = store.acquire(key, info={**info, "task_id": uuid.uuid4().hex}, heartbeat=True)
        assert lease is not None, key
        released = lease.release()
        out.append(clock() - t0)
        assert released, key
    return out


def measure_flush(store: LeaseStore, sizes: list[int], reps: int) -> dict[str, Any]:
    """Time one ``write_history`` (one ``insert_many``) of a batch of fresh records, by batch size."""
    out: dict[str, Any] = {}
    fence = 1
    now = _dt.datetime.now(_dt.timezone.utc)
    for size in sizes:
        samples = []
        for _ in range(reps):
            records = []
            for _ in range(size):
                fence += 1
                ending = {"f": fence, "t": uuid.uuid4().hex, "n": "bench.task", "how": "released", "e": now}
                records.append(history_record("flush-bench", ending))
            t0 = time.perf_counter_ns()
            written = store.write_history(records)
            samples.append(time.perf_counter_ns() - t0)
            assert written == size, (written, size)
        out[str(size)] = {
            **summarize(samples),
            "samples_ms": [round(s / 1e6, 2) for s in samples],
            "collection_size_after": store.history_collection.estimated_document_count(),
        }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    database = f"mongolock_bench_history_{uuid.uuid4().hex[:8]}"
    rng = random.Random(args.seed)
    logging.getLogger("celery_mongolock").setLevel(logging.ERROR)
    with mongo_url(args.mongo_url) as (url, kind):
        variants: dict[str, dict[str, Any]] = {}
        stores: dict[str, LeaseStore] = {}
        counters: dict[str, ThreadCounter] = {}
        clients: list[MongoClient[Document]] = []
        for name, days in (("history_on", 7), ("history_off", 0)):
            counter = ThreadCounter()
            counter.task_thread = threading.get_ident()
            client: MongoClient[Document] = MongoClient(url, event_listeners=[counter], tz_aware=True)
            clients.append(client)
            counters[name] = counter
            stores[name] = LeaseStore(
                client,
                database=database,
                collection=f"leases_{name}",
                lease_seconds=args.lease_seconds,
                history_days=days,
            )
            stores[name].ensure_indexes()
            one_round(stores[name], 20, [f"warm:{name}"])  # warm up: connections, first tick
            stores[name].flush_history()
        try:
            samples: dict[str, list[int]] = {name: [] for name in stores}
            for counter in counters.values():
                counter.reset()
            per_round = max(1, args.iterations // args.rounds)
            keys = [f"tenant:{i}" for i in range(args.keys)]
            for _ in range(args.rounds):
                order = list(stores)
                rng.shuffle(order)
                for name in order:
                    samples[name] += one_round(stores[name], per_round, [f"{name}:{k}" for k in keys])
            runs = per_round * args.rounds
            for name, store in stores.items():
                # What is still queued is written as the next tick (or the process's shutdown) would:
                # from another thread than the task's, so that it counts as background.
                flusher = threading.Thread(target=store.flush_history, kwargs={"timeout": 30.0})
                flusher.start()
                flusher.join()
                counter = counters[name]
                variants[name] = {
                    "history_days": store.history_days,
                    "runs": runs,
                    "latency": summarize(samples[name]),
                    "task_thread_commands_per_run": per_run(counter.task, runs),
                    "background_commands_per_run": per_run(counter.background, runs),
                    "background_commands": dict(sorted(counter.background.items())),
                    "history_records": (
                        store.history_collection.count_documents({}) if store.history_days else None
                    ),
                    "history_collection_exists": store.history_collection_name
                    in store.client[database].list_collection_names(),
                    "ticks": store.heartbeat.ticks,
                }
            flush = measure_flush(stores["history_on"], [1, 20, 200], args.flush_reps)
        finally:
            for store in stores.values():
                store.close()
            clients[0].drop_database(database)
            for client in clients:
                client.close()
    on, off = variants["history_on"], variants["history_off"]
    ratio = round(on["latency"]["median_us"] / off["latency"]["median_us"], 3)
    inserts = on["background_commands"].get("insert", 0)
    summary = [
        f"* acquire + release, median: history on {on['latency']['median_us']:.0f} µs, off "
        f"{off['latency']['median_us']:.0f} µs (ratio {ratio}); p90 {on['latency']['p90_us']:.0f} / "
        f"{off['latency']['p90_us']:.0f} µs",
        f"* commands on the task's thread per run: on {on['task_thread_commands_per_run']}, off "
        f"{off['task_thread_commands_per_run']}",
        f"* history inserts by the heartbeat thread: {inserts} for {on['runs']} runs "
        f"({on['runs'] / max(1, inserts):.0f} records a batch); {on['history_records']} records written",
        "* one insert_many of a batch, median: "
        + ", ".join(f"{size} records {s['median_us'] / 1000:.2f} ms" for size, s in flush.items()),
    ]
    return {
        "benchmark": "history",
        "server": {"kind": kind},
        "quick": args.quick,
        "lease_seconds": args.lease_seconds,
        "keys": args.keys,
        "variants": variants,
        "latency_ratio_on_off_median": ratio,
        "flush_insert_many": flush,
        "summary": summary,
        "machine": {"cpu_count": os.cpu_count(), "python": sys.version.split()[0]},
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--mongo-url", default=os.environ.get(URL_ENV) or None, help="MongoDB to use")
    parser.add_argument("--iterations", type=int, default=None, help="runs per variant (2000; 400 quick)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (20; 8 quick)")
    parser.add_argument("--keys", type=int, default=20, help="keys the runs cycle through (20)")
    parser.add_argument(
        "--lease-seconds", type=float, default=6.0, help="lease length (6: a heartbeat tick every 2 s)"
    )
    parser.add_argument("--flush-reps", type=int, default=None, help="timed batches per size (30; 10 quick)")
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    args.iterations = args.iterations or (400 if args.quick else 2000)
    args.rounds = args.rounds or (8 if args.quick else 20)
    args.flush_reps = args.flush_reps or (10 if args.quick else 30)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(result["summary"]))
    print(json.dumps(result["variants"], indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
