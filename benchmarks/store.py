"""Benchmark of the lease store: latency against bare pymongo, commands per operation, batched renewal.

Run it from the repository root (after ``make venv``)::

    .venv/bin/python benchmarks/store.py                 # embedded server, full run (a few minutes)
    .venv/bin/python benchmarks/store.py --quick         # about a minute, smaller figures
    .venv/bin/python benchmarks/store.py --mongo-url mongodb://host:27017/

It starts the embedded MongoDB-compatible server unless ``--mongo-url`` (or the environment variable
``MONGOLOCK_TEST_MONGODB_URL``) names a server, works in a fresh database that it drops at the end, and
writes its figures as JSON (``benchmarks/results/store.json`` by default). See ``benchmarks/README.md``
for what each figure means.

Only the standard library, pymongo and celery_mongolock are used.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import logging
import os
import platform
import random
import socket
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pymongo
from pymongo import MongoClient, ReturnDocument
from pymongo.collection import Collection
from pymongo.monitoring import (
    CommandFailedEvent,
    CommandListener,
    CommandStartedEvent,
    CommandSucceededEvent,
)

import celery_mongolock
from celery_mongolock.store import Lease, LeaseStore

Document = dict[str, Any]

URL_ENV = "MONGOLOCK_TEST_MONGODB_URL"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "store.json"
# A lease length far beyond the benchmark's duration: nothing expires while we measure.
LONG_TTL = 3600.0
# With --renew-setup auto, more leases than this are inserted in bulk rather than acquired one by one.
AUTO_INSERT_ABOVE = 1000


# -- command counting -------------------------------------------------------------------------------------
class CommandCounter(CommandListener):
    """Counts the commands the client sends, by command name (thread-safe; monitoring is not counted)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: Counter[str] = Counter()
        self._failed: Counter[str] = Counter()

    def started(self, event: CommandStartedEvent) -> None:
        with self._lock:
            self._started[event.command_name] += 1

    def succeeded(self, event: CommandSucceededEvent) -> None:
        pass

    def failed(self, event: CommandFailedEvent) -> None:
        with self._lock:
            self._failed[event.command_name] += 1

    def reset(self) -> None:
        with self._lock:
            self._started.clear()
            self._failed.clear()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self._started.items()))

    def failures(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self._failed.items()))

    @contextlib.contextmanager
    def counting(self) -> Iterator[dict[str, int]]:
        """Count the commands sent inside the block; the yielded dict is filled in on exit."""
        result: dict[str, int] = {}
        self.reset()
        try:
            yield result
        finally:
            result.update(self.snapshot())


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    logger = logging.getLogger("celery_mongolock")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def per_op(counts: dict[str, int], ops: int) -> dict[str, float]:
    """Commands per operation, rounded (an exact 1 means one command each time)."""
    return {name: round(n / ops, 3) for name, n in counts.items()}


# -- statistics -------------------------------------------------------------------------------------------
def summarize(samples_ns: list[int]) -> dict[str, float]:
    """Median, p90, p99, min, max and mean in microseconds."""
    us = sorted(s / 1000.0 for s in samples_ns)
    if len(us) >= 2:
        q = statistics.quantiles(us, n=100, method="inclusive")
        p90, p99 = q[89], q[98]
    else:
        p90 = p99 = us[0]
    return {
        "n": len(us),
        "median_us": round(statistics.median(us), 1),
        "p90_us": round(p90, 1),
        "p99_us": round(p99, 1),
        "min_us": round(us[0], 1),
        "max_us": round(us[-1], 1),
        "mean_us": round(statistics.fmean(us), 1),
    }


def ratios(ours: dict[str, float], other: dict[str, float]) -> dict[str, float]:
    return {k: round(ours[k] / other[k], 3) for k in ("median_us", "p90_us", "p99_us") if other[k] > 0}


# -- the variants measured --------------------------------------------------------------------------------
class Bench:
    def __init__(self, client: MongoClient[Document], store: LeaseStore, counter: CommandCounter) -> None:
        self.client = client
        self.store = store
        self.counter = counter
        # The very collection object the store uses: same database, write concern and read preference.
        self.coll: Collection[Document] = store.collection
        self.ttl_ms = int(store.lease_seconds * 1000)
        self.holder: Document = {"host": socket.gethostname(), "pid": os.getpid()}
        self._seq = 0

    def _key(self, prefix: str) -> str:
        self._seq += 1
        return f"{prefix}:{self._seq}"

    # Each variant runs ``n`` iterations and returns one latency per iteration, in nanoseconds.
    def ours(self, n: int, hot_key: str | None) -> list[int]:
        store = self.store
        out: list[int] = []
        clock = time.perf_counter_ns
        for _ in range(n):
            key = hot_key or self._key("ours")
            t0 = clock()
            lease = store.acquire(key)
            assert lease is not None, f"store.acquire({key!r}) returned None"
            released = lease.release()
            out.append(clock() - t0)
            assert released, f"release of {key!r} found it no longer ours"
        return out

    def bare(self, n: int, hot_key: str | None) -> list[int]:
        coll = self.coll
        ttl_ms = self.ttl_ms
        holder = self.holder
        acquire_pipeline = LeaseStore._acquire_pipeline
        out: list[int] = []
        clock = time.perf_counter_ns
        for _ in range(n):
            key = hot_key or self._key("bare")
            t0 = clock()
            token = uuid.uuid4().hex
            doc = coll.find_one_and_update(
                {"_id": key},
                acquire_pipeline(token, ttl_ms, holder),
                upsert=True,
                return_document=ReturnDocument.AFTER,
            )
            released = coll.update_one(
                {"_id": key, "owner": token}, [{"$set": {"owner": None, "released_at": "$$NOW"}}]
            )
            out.append(clock() - t0)
            assert doc is not None, f"bare acquire of {key!r} returned no document"
            assert doc.get("owner") == token, f"bare acquire of {key!r} failed: {doc}"
            assert released.matched_count == 1, f"bare release of {key!r} matched nothing"
        return out

    def ping(self, n: int) -> list[int]:
        admin = self.client.admin
        out: list[int] = []
        clock = time.perf_counter_ns
        for _ in range(n):
            t0 = clock()
            admin.command("ping")
            out.append(clock() - t0)
        return out


def measure_latency(bench: Bench, iterations: int, rounds: int, seed: int) -> dict[str, Any]:
    """Every variant runs ``iterations`` times in total, split over ``rounds`` interleaved rounds."""
    variants: dict[str, Callable[[int], list[int]]] = {
        "ours_distinct": lambda n: bench.ours(n, None),
        "bare_distinct": lambda n: bench.bare(n, None),
        "ours_hot": lambda n: bench.ours(n, "bench-hot-ours"),
        "bare_hot": lambda n: bench.bare(n, "bench-hot-bare"),
        "ping": bench.ping,
    }
    rng = random.Random(seed)
    samples: dict[str, list[int]] = {name: [] for name in variants}
    commands: dict[str, Counter[str]] = {name: Counter() for name in variants}
    per_round: dict[str, list[float]] = {name: [] for name in variants}
    docs_per_round: list[int] = []
    cpu: dict[str, float] = dict.fromkeys(variants, 0.0)
    batch = max(1, iterations // rounds)
    for r in range(rounds):
        order = list(variants)
        rng.shuffle(order)  # no variant always runs first (or right after the server's busiest one)
        for name in order:
            gc.collect()
            with bench.counter.counting() as counts:
                cpu0 = time.process_time()
                got = variants[name](batch)
                cpu[name] += time.process_time() - cpu0
            samples[name] += got
            commands[name].update(counts)
            per_round[name].append(round(statistics.median(got) / 1000.0, 1))
        docs_per_round.append(bench.coll.estimated_document_count())
        print(
            f"  round {r + 1}/{rounds}: "
            + ", ".join(f"{k} {v[-1]:.0f}us" for k, v in per_round.items())
            + f"; {docs_per_round[-1]} documents",
            flush=True,
        )
    stats = {name: summarize(s) for name, s in samples.items()}
    result: dict[str, Any] = {
        "iterations_per_variant": batch * rounds,
        "rounds": rounds,
        "stats": stats,
        "median_per_round_us": per_round,
        "documents_after_round": docs_per_round,
        # CPU time of this process (the client) per iteration: what the client spends, server excluded.
        "client_cpu_us_per_iteration": {
            name: round(t * 1e6 / (batch * rounds), 1) for name, t in cpu.items()
        },
        "commands_per_iteration": {
            name: per_op(dict(sorted(c.items())), batch * rounds) for name, c in commands.items()
        },
        "ratios": {
            "distinct_ours_over_bare": ratios(stats["ours_distinct"], stats["bare_distinct"]),
            "hot_ours_over_bare": ratios(stats["ours_hot"], stats["bare_hot"]),
            "distinct_ours_over_ping": ratios(stats["ours_distinct"], stats["ping"]),
            "hot_ours_over_ping": ratios(stats["ours_hot"], stats["ping"]),
            "bare_distinct_over_ping": ratios(stats["bare_distinct"], stats["ping"]),
        },
    }
    return result


# -- commands per operation -------------------------------------------------------------------------------
def count_commands(bench: Bench, reps: int) -> dict[str, Any]:
    """Commands per acquire / renew / release (after warm-up), averaged over ``reps`` repetitions."""
    store, counter = bench.store, bench.counter
    totals: dict[str, Counter[str]] = {
        name: Counter()
        for name in (
            "acquire",
            "renew",
            "release",
            "acquire_hot",
            "release_hot",
            "acquire_contended",
            "renew_many_1",
        )
    }
    first: dict[str, dict[str, int]] = {}

    def record(name: str, counts: dict[str, int]) -> None:
        totals[name].update(counts)
        first.setdefault(name, counts)

    hot = "bench-count-hot"
    for _ in range(reps):
        # A new key: acquire (insert by upsert), renew, renew_many of one, release.
        with counter.counting() as c:
            lease = store.acquire(bench._key("count"))
        assert lease is not None
        record("acquire", c)
        with counter.counting() as c:
            lease.renew()
        record("renew", c)
        with counter.counting() as c:
            lost = store.renew_many([lease])
        assert not lost
        record("renew_many_1", c)
        with counter.counting() as c:
            lease.release()
        record("release", c)
        # An existing, free key (the common case for a recurring task key).
        with counter.counting() as c:
            lease = store.acquire(hot)
        assert lease is not None
        record("acquire_hot", c)
        # The same key while it is held: contention is reported as None, still in one round trip.
        with counter.counting() as c:
            other = store.acquire(hot)
        assert other is None
        record("acquire_contended", c)
        with counter.counting() as c:
            lease.release()
        record("release_hot", c)

    # Documented second query: renew_many with one lease no longer ours (update + find to learn which).
    leases = [store.acquire(bench._key("count-lost"), ttl=LONG_TTL) for _ in range(3)]
    held = [lease for lease in leases if lease is not None]
    assert len(held) == 3
    with quiet_logs():  # the forced release and the lost lease are logged as warnings: expected here
        store.force_release(held[1].key)
        with counter.counting() as c:
            lost = store.renew_many(held)
    assert [lease.key for lease in lost] == [held[1].key], lost
    for lease in held:
        lease.release()

    return {
        "repetitions": reps,
        "per_operation": {name: per_op(dict(sorted(t.items())), reps) for name, t in totals.items()},
        "first_repetition": first,
        "renew_many_with_one_lost": c,
    }


# -- batched renewal --------------------------------------------------------------------------------------
def insert_leases(store: LeaseStore, prefix: str, size: int) -> list[Lease]:
    """``size`` held leases made fast: their documents inserted in bulk, shaped as ``acquire`` writes them.

    Only the setup differs from acquiring them one by one (which takes minutes for 10,000 leases on the
    embedded server); ``renew_many`` matches them on their owner tokens and extends them from ``ttl_ms``
    exactly as it would acquired ones.
    """
    now = _dt.datetime.now(_dt.timezone.utc)
    ttl_ms = int(LONG_TTL * 1000)
    holder: Document = {"host": socket.gethostname(), "pid": os.getpid()}
    fence0 = int(now.timestamp() * 1000) * 1000
    sent = store.clock.monotonic()
    docs: list[Document] = []
    leases: list[Lease] = []
    for i in range(size):
        key, token = f"{prefix}:{i}", uuid.uuid4().hex
        expires = now + _dt.timedelta(milliseconds=ttl_ms)
        docs.append(
            {
                "_id": key,
                "owner": token,
                "ttl_ms": ttl_ms,
                "holder": holder,
                "fence": fence0 + i,
                "expires_at": expires,
                "acquired_at": now,
                "renewed_at": now,
                "hold_until": now,
                "released_at": None,
                "forced_release": False,
                "released_for": None,
            }
        )
        leases.append(
            Lease(
                store,
                key,
                token,
                fence=fence0 + i,
                ttl=LONG_TTL,
                heartbeat_seconds=LONG_TTL / 3,
                expires_at=expires,
                sent_at=sent,
                holder=holder,
            )
        )
    for start in range(0, size, 1000):
        store.collection.insert_many(docs[start : start + 1000], ordered=False)
    return leases


def measure_renew_many(
    store: LeaseStore,
    counter: CommandCounter,
    sizes: list[int],
    *,
    reps: int,
    budget: float,
    timeout: float,
    setup: str,
) -> dict[str, Any]:
    """Hold ``size`` leases and time ``store.renew_many`` on all of them, for each size.

    ``setup``: how the leases are taken: ``acquire`` (one ``store.acquire`` each), ``insert`` (see
    ``insert_leases``) or ``auto`` (acquire up to ``AUTO_INSERT_ABOVE`` leases, insert above).

    Up to ``reps`` calls per size; fewer once the calls of that size took ``budget`` seconds in total (at
    least one call is always made). ``timeout`` is passed to ``renew_many`` so that a slow server is
    measured rather than cut off at the store's ``operation_timeout``.
    """
    results: dict[str, Any] = {}
    for size in sizes:
        t0 = time.perf_counter()
        method = (
            "acquire" if setup == "acquire" or (setup == "auto" and size <= AUTO_INSERT_ABOVE) else "insert"
        )
        if method == "acquire":
            leases: list[Lease] = []
            for i in range(size):
                lease = store.acquire(f"bench-renew-{size}:{i}", ttl=LONG_TTL)
                assert lease is not None
                leases.append(lease)
        else:
            leases = insert_leases(store, f"bench-renew-{size}", size)
        setup_s = time.perf_counter() - t0
        samples: list[int] = []
        commands: list[dict[str, int]] = []
        lost_total = 0
        spent = 0.0
        while len(samples) < reps and (not samples or spent < budget):
            gc.collect()
            with counter.counting() as c:
                t1 = time.perf_counter_ns()
                lost = store.renew_many(leases, timeout=timeout)
                samples.append(time.perf_counter_ns() - t1)
            spent += samples[-1] / 1e9
            lost_total += len(lost)
            commands.append(c)
        stats = summarize(samples)
        distinct = sorted({json.dumps(c, sort_keys=True) for c in commands})
        results[str(size)] = {
            "leases": size,
            "setup": method,
            "setup_seconds": round(setup_s, 2),
            "setup_us_per_lease": round(setup_s * 1e6 / size, 1),
            "calls": len(samples),
            "median_us": stats["median_us"],
            "min_us": stats["min_us"],
            "max_us": stats["max_us"],
            "median_us_per_lease": round(stats["median_us"] / size, 3),
            "commands_per_call": [json.loads(d) for d in distinct],
            "commands_per_call_total": sorted({sum(c.values()) for c in commands}),
            "lost": lost_total,
            "exceeds_operation_timeout": stats["median_us"] / 1e6 > store.operation_timeout,
        }
        print(
            f"  renew_many({size}): median {stats['median_us']:.0f}us over {len(samples)} call(s) "
            f"({stats['median_us'] / size:.2f}us/lease), "
            f"commands/call {results[str(size)]['commands_per_call']}, setup {setup_s:.1f}s",
            flush=True,
        )
        # No release: the database is dropped at the end (releasing 10,000 leases one by one takes long).
        del leases
    return results


# -- environment ------------------------------------------------------------------------------------------
# -- collection size ---------------------------------------------------------------------------------------
def fill_leases(store: LeaseStore, start: int, stop: int) -> None:
    """Lease documents ``fill:start`` .. ``fill:stop-1`` as a busy deployment leaves them: nine in ten
    released, one in ten held by someone else; all expire in an hour, so the TTL index keeps them."""
    now = _dt.datetime.now(_dt.timezone.utc)
    ttl_ms = int(LONG_TTL * 1000)
    holder: Document = {"host": "elsewhere", "pid": 1}
    for first in range(start, stop, 1000):
        docs: list[Document] = []
        for i in range(first, min(stop, first + 1000)):
            held = i % 10 == 0
            docs.append(
                {
                    "_id": f"fill:{i}",
                    "owner": uuid.uuid4().hex if held else None,
                    "ttl_ms": ttl_ms,
                    "holder": holder,
                    "fence": i,
                    # A released lease keeps its last expiry (the TTL index deletes it once that passes).
                    "expires_at": now + _dt.timedelta(milliseconds=ttl_ms),
                    "acquired_at": now,
                    "renewed_at": now,
                    "hold_until": now,
                    "released_at": None if held else now,
                    "forced_release": False,
                    "released_for": None,
                }
            )
        store.collection.insert_many(docs, ordered=False)


def measure_collection_size(
    client: MongoClient[Document],
    database: str,
    sizes: list[int],
    *,
    iterations: int,
    rounds: int,
    seed: int,
    existing_budget: float,
) -> dict[str, Any]:
    """Acquire + release latency in a collection of ``size`` lease documents against an empty one.

    Both collections are on the same server and measured in interleaved rounds, so that the server's own
    drift (the embedded server's writes get slower with every write it has taken) hits both alike. Two
    kinds of key: a new one (the acquire inserts its document) and an existing, released one (the
    acquire updates it: the usual case of a key that ran before). The existing-key figures get a time
    budget per size, and the same ``findAndModify`` is also sent bare (a plain ``$set`` by ``_id``),
    beside an ``update`` and a ``find`` by ``_id``, to tell the server's cost from the library's.
    """
    big = LeaseStore(client, database=database, collection="leases_big", lease_seconds=LONG_TTL)
    empty = LeaseStore(client, database=database, collection="leases_empty", lease_seconds=LONG_TTL)
    for st in (big, empty):
        st.ensure_indexes()
    rng = random.Random(seed)
    seq = iter(range(10**9))
    reuse: dict[str, list[str]] = {"big": [], "empty": []}
    clock = time.perf_counter_ns

    def one(store: LeaseStore, name: str, existing: bool) -> int:
        # An existing key was released before: its document is there, free.
        key = reuse[name].pop() if existing else f"probe:{next(seq)}"
        t0 = clock()
        lease = store.acquire(key)
        assert lease is not None, f"acquire of {key!r} in {name} returned None"
        released = lease.release()
        took = clock() - t0
        assert released
        reuse[name].insert(0, key)
        return took

    def bare_ops(coll: Collection[Document], key: str, reps: int = 3) -> dict[str, float]:
        ops: dict[str, Callable[[], Any]] = {
            "find_one": lambda: coll.find_one({"_id": key}),
            "update_one": lambda: coll.update_one({"_id": key}, {"$set": {"probe": 1}}),
            "find_one_and_update": lambda: coll.find_one_and_update({"_id": key}, {"$set": {"probe": 1}}),
        }
        out = {}
        for name, op in ops.items():
            times = []
            for _ in range(reps):
                t0 = clock()
                op()
                times.append(clock() - t0)
            out[name] = round(statistics.median(times) / 1000.0, 1)
        return out

    result: dict[str, Any] = {"sizes": {}, "existing_budget_seconds": existing_budget}
    filled = 0
    batch = max(1, iterations // rounds)
    per_existing_s: float | None = None
    prev_size = 0
    for size in sizes:
        t0 = time.perf_counter()
        fill_leases(big, filled, size)
        filled = max(filled, size)
        fill_s = time.perf_counter() - t0
        new: dict[str, list[int]] = {"new_big": [], "new_empty": []}
        for _ in range(rounds):
            order = [("new_big", big, "big"), ("new_empty", empty, "empty")]
            rng.shuffle(order)
            for label, store, name in order:
                new[label] += [one(store, name, False) for _ in range(batch)]
        stats = {label: summarize(xs) for label, xs in new.items()}
        entry: dict[str, Any] = {
            "documents": big.collection.estimated_document_count(),
            "fill_seconds": round(fill_s, 1),
            "iterations_per_variant": batch * rounds,
            "stats": stats,
            "ratios": {"new_key_big_over_empty": ratios(stats["new_big"], stats["new_empty"])},
            "bare_us_on_existing_document": {
                "big": bare_ops(big.collection, "fill:1"),
                "empty": bare_ops(empty.collection, reuse["empty"][0]),
            },
        }
        # Existing keys: skipped when the last size predicts a single acquire near the operation timeout.
        predicted = None if per_existing_s is None else per_existing_s * size / max(1, prev_size)
        if predicted is not None and predicted > big.operation_timeout / 4:
            entry["existing_skipped"] = (
                f"one acquire of an existing key would take about {predicted:.1f}s here "
                f"({per_existing_s:.2f}s at {prev_size:,} documents)"
            )
        else:
            existing: dict[str, list[int]] = {"existing_big": [], "existing_empty": []}
            give_up = time.perf_counter() + existing_budget
            while len(existing["existing_big"]) < batch * rounds and (
                time.perf_counter() < give_up or len(existing["existing_big"]) < 3
            ):
                existing["existing_big"].append(one(big, "big", True))
                existing["existing_empty"].append(one(empty, "empty", True))
            for label, xs in existing.items():
                stats[label] = summarize(xs)
            entry["ratios"]["existing_key_big_over_empty"] = ratios(
                stats["existing_big"], stats["existing_empty"]
            )
            per_existing_s = stats["existing_big"]["median_us"] / 1e6
            prev_size = size
        entry["empty_collection_documents"] = empty.collection.estimated_document_count()
        result["sizes"][str(size)] = entry
        bare = entry["bare_us_on_existing_document"]
        print(
            f"  {entry['documents']:,} documents (filled in {fill_s:.0f}s): new key "
            f"{stats['new_big']['median_us']:.0f} vs {stats['new_empty']['median_us']:.0f}us empty; existing "
            + (
                f"key {stats['existing_big']['median_us']:.0f} vs "
                f"{stats['existing_empty']['median_us']:.0f}us"
                if "existing_big" in stats
                else f"key skipped ({entry['existing_skipped']})"
            )
            + f"; bare on an existing document, big / empty: {bare['big']} / {bare['empty']}",
            flush=True,
        )
    return result


def host_of(url: str) -> str:
    """The host list of a MongoDB URL, without credentials, path or options (no DNS lookup)."""
    rest = url.split("://", 1)[-1]
    hosts = rest.split("/", 1)[0].split("?", 1)[0]
    return hosts.rsplit("@", 1)[-1]


def server_info(client: MongoClient[Document]) -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        build = client.admin.command("buildInfo")
        info["version"] = build.get("version")
        if build.get("gitVersion"):
            info["git_version"] = build.get("gitVersion")
    except pymongo.errors.PyMongoError as exc:
        info["version"] = None
        info["buildInfo_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    try:
        hello = client.admin.command("hello")
        info["replica_set"] = hello.get("setName")
        info["max_wire_version"] = hello.get("maxWireVersion")
    except pymongo.errors.PyMongoError:
        pass
    return info


def machine_info() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "cpu_count": os.cpu_count(),
        "pymongo": pymongo.version,
        "celery_mongolock": celery_mongolock.__version__,
    }


@contextlib.contextmanager
def mongo_url(given: str | None) -> Iterator[tuple[str, str]]:
    """Yield (url, kind): the given URL, or an embedded server started for the run."""
    if given:
        yield given, "url"
        return
    from celery_mongolock.embedded import EmbeddedMongo

    with EmbeddedMongo() as server:
        yield server.url, "embedded"


# -- main -------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument(
        "--mongo-url",
        default=os.environ.get(URL_ENV) or None,
        help=f"MongoDB server to use (default: ${URL_ENV}, else an embedded server started for the run)",
    )
    parser.add_argument(
        "--iterations",
        type=int,
        default=None,
        help="latency iterations per variant, split over the rounds (default 1000; 300 with --quick)",
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds (default 20; 10 with --quick)"
    )
    parser.add_argument(
        "--renew-sizes",
        default=None,
        help="comma-separated numbers of leases held for renew_many (default 1,100,10000; 1,100,1000 quick)",
    )
    parser.add_argument(
        "--renew-budget",
        type=float,
        default=60.0,
        help="stop timing renew_many of one size after this many seconds (at least one call; default 60)",
    )
    parser.add_argument(
        "--renew-setup",
        choices=("auto", "acquire", "insert"),
        default="auto",
        help=f"how the renew_many leases are taken: acquire each, insert in bulk, or auto (acquire up to "
        f"{AUTO_INSERT_ABOVE}, insert above; the default)",
    )
    parser.add_argument(
        "--renew-timeout",
        type=float,
        default=900.0,
        help="timeout passed to renew_many, so a slow server is measured, not cut off (default 900 s)",
    )
    parser.add_argument(
        "--collection-sizes",
        default=None,
        help="comma-separated lease document counts to measure acquire against an empty collection "
        "(default 100000,1000000; 10000,100000 quick; 0 to skip)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    parser.add_argument("--quick", action="store_true", help="fewer iterations, at most 1,000 leases")
    parser.add_argument("--seed", type=int, default=12345, help="seed of the round order shuffle")
    args = parser.parse_args(argv)
    if args.iterations is None:
        args.iterations = 300 if args.quick else 1000
    if args.rounds is None:
        args.rounds = 10 if args.quick else 20
    if args.renew_sizes is None:
        sizes = [1, 100, 1000] if args.quick else [1, 100, 10_000]
    else:
        sizes = [int(s) for s in args.renew_sizes.split(",") if s.strip()]
    if args.quick:
        sizes = [min(s, 1000) for s in sizes]
    if args.iterations < args.rounds or args.rounds < 1 or any(s < 1 for s in sizes):
        parser.error("need --rounds >= 1, --iterations >= --rounds and positive --renew-sizes")
    args.renew_sizes = sizes
    if args.collection_sizes is None:
        args.collection_sizes = [10_000, 100_000] if args.quick else [100_000, 1_000_000]
    else:
        args.collection_sizes = sorted(int(x) for x in args.collection_sizes.split(",") if int(x) > 0)
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    counter = CommandCounter()
    database = f"mongolock_bench_{time.strftime('%Y%m%d_%H%M%S')}_{uuid.uuid4().hex[:6]}"
    renew_reps = 5 if args.quick else 9
    count_reps = 10 if args.quick else 50
    with mongo_url(args.mongo_url) as (url, kind):
        client: MongoClient[Document] = MongoClient(
            url,
            event_listeners=[counter],
            appname="celery_mongolock-bench",
            tz_aware=True,
            serverSelectionTimeoutMS=10_000,
        )
        try:
            server = {
                "kind": kind,
                **({"host": host_of(url)} if kind == "url" else {}),
                **server_info(client),
            }
            print(f"server: {server}, database {database}")
            store = LeaseStore(client, database=database, collection="leases")
            bench = Bench(client, store, counter)
            try:
                # Warm-up: the first acquire of a process creates the indexes; connections get opened.
                with counter.counting() as warmup_commands:
                    lease = store.acquire("bench-warmup")
                    assert lease is not None
                    lease.release()
                for _ in range(20):
                    bench.ours(1, None)
                    bench.bare(1, None)
                    bench.ping(1)
                print(f"warm-up (first acquire + release): {warmup_commands}")

                print("commands per operation ...")
                commands = count_commands(bench, count_reps)
                for name, c in commands["per_operation"].items():
                    print(f"  {name}: {c}")
                print(f"  renew_many with one of 3 lost: {commands['renew_many_with_one_lost']}")

                print(f"latency, {args.iterations} iterations per variant in {args.rounds} rounds ...")
                latency = measure_latency(bench, args.iterations, args.rounds, args.seed)

                print(f"renew_many with {args.renew_sizes} leases held ...")
                # The held leases go in a collection of their own, so that the renewal figures do not
                # depend on how many documents the latency measurement left behind.
                renew_store = LeaseStore(client, database=database, collection="leases_renew")
                renew_store.ensure_indexes()
                renew = measure_renew_many(
                    renew_store,
                    counter,
                    args.renew_sizes,
                    reps=renew_reps,
                    budget=args.renew_budget,
                    timeout=args.renew_timeout,
                    setup=args.renew_setup,
                )
                collection_size: dict[str, Any] = {}
                if args.collection_sizes:
                    print(f"acquire + release with {args.collection_sizes} lease documents vs none ...")
                    with contextlib.ExitStack() as stack:
                        cs_client = client
                        if kind == "embedded":
                            # A server of its own: the embedded server's writes get slower with every
                            # write it has taken, and the fill is a million of them.
                            from celery_mongolock.embedded import EmbeddedMongo

                            fresh = stack.enter_context(EmbeddedMongo())
                            cs_client = stack.enter_context(MongoClient(fresh.url, tz_aware=True))
                        collection_size = measure_collection_size(
                            cs_client,
                            database,
                            args.collection_sizes,
                            iterations=100 if args.quick else 300,
                            rounds=5 if args.quick else 10,
                            seed=args.seed,
                            existing_budget=10.0 if args.quick else 30.0,
                        )
                        collection_size["server"] = (
                            "a fresh embedded server of its own" if kind == "embedded" else "the same server"
                        )
                failures = counter.failures()
            finally:
                with contextlib.suppress(pymongo.errors.PyMongoError):
                    client.drop_database(database)
        finally:
            client.close()

    return {
        "benchmark": "store",
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "server": server,
        "parameters": {
            "quick": args.quick,
            "iterations_per_variant": latency["iterations_per_variant"],
            "rounds": args.rounds,
            "seed": args.seed,
            "renew_sizes": args.renew_sizes,
            "renew_many_max_calls_per_size": renew_reps,
            "renew_many_budget_seconds": args.renew_budget,
            "renew_many_timeout_seconds": args.renew_timeout,
            "renew_many_setup": args.renew_setup,
            "collection_sizes": args.collection_sizes,
            "operation_timeout": store.operation_timeout,
            "command_count_repetitions": count_reps,
            "lease_seconds": store.lease_seconds,
            "write_concern": store.write_concern.document,
            "database": database,
        },
        "warmup_commands": warmup_commands,
        "commands": commands,
        "latency": latency,
        "renew_many": renew,
        "collection_size": collection_size,
        "failed_commands": failures,
        "duration_seconds": round(time.perf_counter() - started, 1),
    }


def print_summary(result: dict[str, Any]) -> None:
    lat = result["latency"]
    stats = lat["stats"]
    print()
    print(
        f"== store benchmark ({result['server'].get('kind')} server {result['server'].get('version')}, "
        f"{lat['iterations_per_variant']} iterations per variant in {lat['rounds']} rounds, "
        f"{result['duration_seconds']}s)"
    )
    print(f"{'latency (us)':<34}{'median':>10}{'p90':>10}{'p99':>10}{'client CPU':>12}")
    labels = {
        "ours_distinct": "acquire+release, distinct keys",
        "bare_distinct": "bare pymongo, distinct keys",
        "ours_hot": "acquire+release, one hot key",
        "bare_hot": "bare pymongo, one hot key",
        "ping": "ping",
    }
    cpu = lat["client_cpu_us_per_iteration"]
    for name, label in labels.items():
        s = stats[name]
        print(
            f"  {label:<32}{s['median_us']:>10.0f}{s['p90_us']:>10.0f}{s['p99_us']:>10.0f}{cpu[name]:>12.0f}"
        )
    r = lat["ratios"]
    for name, label in (
        ("distinct_ours_over_bare", "ours / bare, distinct keys"),
        ("hot_ours_over_bare", "ours / bare, hot key"),
        ("distinct_ours_over_ping", "ours / ping, distinct keys"),
        ("hot_ours_over_ping", "ours / ping, hot key"),
    ):
        x = r[name]
        print(f"  {label:<32}{x['median_us']:>10.2f}{x['p90_us']:>10.2f}{x['p99_us']:>10.2f}")
    print("commands per operation (after warm-up):")
    for name, c in result["commands"]["per_operation"].items():
        print(f"  {name:<20}{c}")
    print("renew_many:")
    for size, rm in result["renew_many"].items():
        print(
            f"  {size:>6} leases: median {rm['median_us']:>11.0f}us "
            f"({rm['median_us_per_lease']:.2f}us/lease, {rm['calls']} calls), "
            f"commands/call {rm['commands_per_call']}, lost {rm['lost']}"
            + (" - slower than operation_timeout" if rm["exceeds_operation_timeout"] else "")
        )
    for size, cs in (result.get("collection_size") or {}).get("sizes", {}).items():
        r = cs["ratios"]
        existing = r.get("existing_key_big_over_empty")
        print(
            f"  {int(size):>9,} documents: acquire+release / empty collection: new key "
            f"{r['new_key_big_over_empty']['median_us']:.2f}, existing key "
            + (f"{existing['median_us']:.2f}" if existing else "skipped")
        )
    if result["failed_commands"]:
        print(f"failed commands: {result['failed_commands']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
    print_summary(result)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
