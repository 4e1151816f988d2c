"""Benchmark of contended runs on one hot key: ``Queue`` (parked, handed over) beside ``Wait`` and ``Retry``.

Run it from the repository root (after ``make venv``)::

    .venv/bin/python benchmarks/contention.py            # about 5 minutes
    .venv/bin/python benchmarks/contention.py --quick    # about a minute

Real ``celery worker`` nodes (prefork; 2 nodes of concurrency 3 by default, as in issue 16) share a Redis
broker (and result backend) and the lease store. In each batch, N runs of one task are sent at once, all
for one key; each body sleeps the same time (the work). The three policies run the same batch in
interleaved rounds:

* **Queue()**: a contended run is parked in the lease document (its message acknowledged: no slot held)
  and the release hands the key to the oldest parked run, whose message is published again;
* **Wait(timeout=600)**: a contended run blocks in its worker slot until a release wakes it (change
  stream), then tries again;
* **Retry()** (the default policy): a contended run is published again after a backoff (1 s, doubling,
  jittered).

From the events every process records (``contention_app``): the **handoff idle time** (from the end of
one body to the start of the next: the key idle while runs wait), the **makespan** (first body start to
last body end) against the total work (the sum of the bodies), the **worker slots held by waiting runs**
(executions in progress that have not started their body, sampled every 5 ms) and, counted inside every
worker process with a pymongo ``CommandListener``, the **MongoDB commands per contended run**.

Then, on the lease store alone, the cost of one park (``LeaseStore.admit``) and of one handoff (the
release that hands the key over, then the claim of the handed run) with 100, 1,000 and 10,000 runs
already parked on the key, with entries of a realistic size.

Writes JSON (``benchmarks/results/contention.json``) with a ``targets`` list (issue 16) that ``run.py``
puts in the report. Uses the embedded server unless ``--mongo-url`` names a MongoDB.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = HERE / "results" / "contention.json"
URL_ENV = "MONGOLOCK_TEST_MONGODB_URL"
POLICIES = ("queue", "wait", "retry")
LABELS = {"queue": "Queue()", "wait": "Wait(timeout=600)", "retry": "Retry() (the default)"}
# Targets of issue 16 (on the development machine).
TARGET_HANDOFF_MEDIAN = 0.050  # s, from a release to the next run's start
TARGET_HANDOFF_MAX = 0.300
TARGET_MAKESPAN = 1.1  # makespan of N contended runs / their total work
TARGET_SLOTS = 0  # slots held by waiting runs, p95 of the samples (the park itself is a blip)
TARGET_COMMANDS = 4  # MongoDB commands per contended run
TARGET_FLAT = 1.2  # park / handoff time with the most runs parked over the fewest: flat (as store.py)
SAMPLE_SECONDS = 0.005  # the grid on which busy slots are counted


# -- processes -----------------------------------------------------------------------------------------
class Node:
    """One ``celery -A contention_app worker`` (prefork), in its own process group."""

    def __init__(self, name: str, concurrency: int, env: dict[str, str], work_dir: Path) -> None:
        self.name = f"{name}@localhost"
        self.concurrency = concurrency
        self.env = env
        self.log_path = work_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> Node:
        marker = Path(self.env["CON_READY_DIR"]) / f"{self.name}.ready"
        marker.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "celery", "-A", "contention_app", "worker", "--pool=prefork"]
        cmd += [f"--concurrency={self.concurrency}", "-n", self.name, "--loglevel=WARNING"]
        cmd += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
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
        wait_for(lambda: self._ready(marker), timeout, f"worker {self.name} to be ready")
        return self

    def _ready(self, marker: Path) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"worker {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
        return marker.exists()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # warm shutdown
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # a pool process left behind
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(delay)
        delay = min(0.02, delay * 2)


class Events:
    """The events the worker processes append (``contention_app.emit``), read incrementally."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._offsets: dict[Path, int] = {}
        self.by_run: dict[str, list[dict[str, Any]]] = {}

    def poll(self) -> None:
        for path in self.directory.glob("*.jsonl"):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offsets[path] = offset + end
            for line in data[:end].splitlines():
                e = json.loads(line)
                self.by_run.setdefault(str(e.get("run")), []).append(e)

    def of(self, run: str) -> list[dict[str, Any]]:
        self.poll()
        return sorted(self.by_run.get(run, []), key=lambda e: e["t"])


def read_counts(directory: Path) -> dict[str, Counter[str]]:
    """The MongoDB commands every worker process sent so far, summed by role (``child``, ``main``)."""
    out: dict[str, Counter[str]] = {"child": Counter(), "main": Counter()}
    for path in directory.glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            out.setdefault(data["role"], Counter()).update(data["counts"])
    return out


# -- statistics ----------------------------------------------------------------------------------------
def pct(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank), 0 <= q <= 1."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def stats(xs: list[float], digits: int = 4) -> dict[str, Any]:
    if not xs:
        return {"n": 0}
    return {
        "n": len(xs),
        "median": round(statistics.median(xs), digits),
        "p95": round(pct(xs, 0.95), digits),
        "min": round(min(xs), digits),
        "max": round(max(xs), digits),
        "mean": round(statistics.fmean(xs), digits),
    }


# -- one batch through the workers -----------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace, app_module: Any, env: dict[str, str], work_dir: Path):
        self.args = args
        self.app = app_module
        self.events = Events(Path(env["CON_EVENTS_DIR"]))
        self.count_dir = Path(env["CON_COUNT_DIR"])
        self.nodes = [Node(f"con{n + 1}", args.concurrency, env, work_dir) for n in range(args.nodes)]
        for node in self.nodes:
            node.start()

    def close(self) -> None:
        for node in self.nodes:
            node.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {n.name}\n{n.log_tail(2000)}" for n in self.nodes)

    def warm_up(self, policy: str) -> None:
        """Runs on distinct keys, enough to reach every pool process (each creates its client and the
        indexes on first use), then a short contended batch (change streams, parking, handoffs)."""
        task = self.app.TASKS[policy]
        run = f"warmup-{policy}-{uuid.uuid4().hex[:6]}"
        n = 2 * len(self.nodes) * self.args.concurrency
        for i in range(n):
            task.apply_async((run, f"{run}-{i}", i, 0.1))

        def finished() -> bool:
            evs = self.events.of(run)
            return bool(sum(1 for e in evs if e["ev"] == "end") >= n)

        try:
            wait_for(finished, 120, f"the warm-up of {policy}")
        except TimeoutError as exc:
            raise RuntimeError(f"{exc}\n{self.logs()}") from None
        self.batch(policy, 3, 0.05)

    def batch(self, policy: str, n: int, seconds: float) -> dict[str, Any]:
        """Send ``n`` runs of one key at once; return the figures once every run has ended."""
        task = self.app.TASKS[policy]
        run = f"{policy}-{uuid.uuid4().hex[:10]}"
        key = run  # a fresh key per batch: nothing left over from the one before
        # A hot key has run before: its lease document exists. (On a key never seen, a burst of upserts
        # races to create the document, and the embedded server answers the losers without it: each
        # then reads it back with a find, a command a hot key does not pay.)
        from celery_mongolock.config import get_store

        lease = get_store(self.app.app).acquire(f"hot:{key}")
        assert lease is not None
        lease.release()
        before = read_counts(self.count_dir)
        sent: list[float] = []
        for i in range(n):
            sent.append(time.monotonic())
            task.apply_async((run, key, i, seconds))
        timeout = 120.0 + n * seconds * (8 if policy == "retry" else 3)

        def finished() -> list[dict[str, Any]] | None:
            evs = self.events.of(run)
            ends = sum(1 for e in evs if e["ev"] == "end")
            pre = sum(1 for e in evs if e["ev"] == "pre")
            post = sum(1 for e in evs if e["ev"] == "post")
            return evs if ends >= n and pre == post else None

        try:
            evs: list[dict[str, Any]] = wait_for(finished, timeout, f"the {n} runs of {run}")
        except TimeoutError as exc:
            raise RuntimeError(f"{exc}\n{self.logs()}") from None
        time.sleep(0.25)  # the main processes' counts are written every 0.1 s
        after = read_counts(self.count_dir)
        return analyse(policy, n, seconds, sent, evs, before, after)


def analyse(  # noqa: PLR0917 - the figures of one batch, named as the caller has them
    policy: str,
    n: int,
    seconds: float,
    sent: list[float],
    evs: list[dict[str, Any]],
    before: dict[str, Counter[str]],
    after: dict[str, Counter[str]],
) -> dict[str, Any]:
    starts = {e["i"]: e["t"] for e in evs if e["ev"] == "start"}
    ends = {e["i"]: e["t"] for e in evs if e["ev"] == "end"}
    order = sorted(starts, key=lambda i: starts[i])
    bodies = [(starts[i], ends[i]) for i in order]
    gaps = [bodies[k + 1][0] - bodies[k][1] for k in range(len(bodies) - 1)]
    # Where a handoff's idle time goes: the holder's release (its command, and under Queue the publish
    # of the handed run), then until the next run's execution begins (broker, worker, a woken Wait),
    # then until that run holds the key (its acquire or claim) and its body starts.
    released = {e["i"]: e["t"] for e in evs if e["ev"] == "released"}
    last_pre: dict[int, float] = {}
    for e in evs:
        if e["ev"] == "pre":
            last_pre.setdefault(e["i"], 0.0)
            if e["t"] <= starts.get(e["i"], float("inf")):
                last_pre[e["i"]] = e["t"]
    acquired = {e["i"]: e["t"] for e in evs if e["ev"] == "acquired"}
    parts: dict[str, list[float]] = {"release": [], "to_next_execution": [], "to_body": []}
    for k in range(len(order) - 1):
        a, b = order[k], order[k + 1]
        if a in released and b in acquired:
            rel = released[a] - ends[a]
            parts["release"].append(rel)
            # A Wait's next run was already executing (blocked): its part is from the release to its
            # lease, all in "to_body".
            begin = max(last_pre.get(b, released[a]), released[a])
            parts["to_next_execution"].append(begin - released[a])
            parts["to_body"].append(starts[b] - begin)
    overlaps = sum(1 for g in gaps if g < 0)
    work = sum(e - s for s, e in bodies)
    makespan = bodies[-1][1] - bodies[0][0]
    from_send = bodies[-1][1] - sent[0]
    inversions = sum(1 for k in range(len(order) - 1) if order[k + 1] < order[k])
    # The same without the first run to start: it found the key free, before anything was parked (a run
    # sent earlier may not have reached a worker yet); the others waited, and their order is the policy's.
    later = order[1:]
    inversions_after_first = sum(1 for k in range(len(later) - 1) if later[k + 1] < later[k])

    # Worker slots held by waiting runs: an execution (task_prerun .. task_postrun in one pool process)
    # from the moment its run found the key held (``contended``) until its body starts or it ends: a Wait
    # blocking, a Queue run writing its QUEUED state and acknowledging, a Retry republishing. Besides,
    # the slot time each execution spends outside a body at all (the admission, from task_prerun).
    waiting: list[tuple[float, float]] = []
    outside = 0.0
    current: dict[int, dict[str, Any]] = {}
    for e in evs:
        pid = e["pid"]
        if e["ev"] == "pre":
            current[pid] = {"pre": e["t"], "contended": None, "start": None}
        elif pid not in current:
            continue
        elif e["ev"] == "contended" and current[pid]["contended"] is None:
            current[pid]["contended"] = e["t"]
        elif e["ev"] == "start":
            current[pid]["start"] = e["t"]
        elif e["ev"] == "post":
            x = current.pop(pid)
            stop = x["start"] if x["start"] is not None else e["t"]
            outside += max(0.0, stop - x["pre"])
            if x["contended"] is not None:
                waiting.append((x["contended"], max(x["contended"], stop)))
    t0, t1 = min(sent[0], bodies[0][0]), bodies[-1][1]
    samples = []
    t = t0
    while t <= t1:
        samples.append(sum(1 for a, b in waiting if a <= t < b))
        t += SAMPLE_SECONDS
    waiting_slot_seconds = sum(b - a for a, b in waiting)

    contended = {e["id"] for e in evs if e["ev"] == "contended"}
    executions = sum(1 for e in evs if e["ev"] == "pre")
    commands: dict[str, dict[str, int]] = {}
    watch: dict[str, dict[str, int]] = {}  # the lease watch's commands (``watch:``): not the runs' cost
    for role in ("child", "main"):
        diff = Counter(after.get(role, Counter()))
        diff.subtract(before.get(role, Counter()))
        commands[role] = {k: v for k, v in sorted(diff.items()) if v and not k.startswith("watch:")}
        watch[role] = {k: v for k, v in sorted(diff.items()) if v and k.startswith("watch:")}
    total = sum(commands["child"].values()) + sum(commands["main"].values())
    uncontended = n - len(contended)
    # An uncontended run costs what any singleton task costs (acquire + release: 2); the rest is the
    # contended runs' share.
    per_contended = (total - 2 * uncontended) / len(contended) if contended else None
    return {
        "policy": policy,
        "runs": n,
        "body_seconds": seconds,
        "overlapping_bodies": overlaps,
        "start_order": order,
        "send_order_inversions": inversions,
        "send_order_inversions_after_first": inversions_after_first,
        "handoff_idle_s": [round(g, 4) for g in gaps],
        "handoff_idle": stats(gaps),
        "handoff_parts_median_ms": {
            k: round(statistics.median(v) * 1000, 2) if v else None for k, v in parts.items()
        },
        "work_s": round(work, 4),
        "makespan_s": round(makespan, 4),
        "makespan_over_work": round(makespan / work, 4),
        "from_first_send_s": round(from_send, 4),
        "from_first_send_over_work": round(from_send / work, 4),
        "executions": executions,
        "slots_waiting": {
            "mean": round(statistics.fmean(samples), 4) if samples else 0.0,
            "p95": pct(samples, 0.95) if samples else 0,
            "max": max(samples) if samples else 0,
            "slot_seconds": round(waiting_slot_seconds, 4),
            "slot_seconds_per_run": round(waiting_slot_seconds / n, 4),
        },
        "slot_seconds_outside_body_per_run": round(outside / n, 4),
        "contended_runs": len(contended),
        "mongodb_commands": commands,
        "lease_watch_commands": watch,
        "mongodb_commands_total": total,
        "mongodb_commands_per_run": round(total / n, 3),
        "mongodb_commands_per_contended_run": None if per_contended is None else round(per_contended, 3),
    }


def summarize(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """Per policy: the handoff gaps of every round pooled, the other figures as medians of the rounds."""
    out: dict[str, Any] = {}
    for policy in POLICIES:
        bs = [b for b in batches if b["policy"] == policy]
        if not bs:
            continue
        gaps = [g for b in bs for g in b["handoff_idle_s"]]
        kinds: Counter[str] = Counter()
        for b in bs:
            for role in ("child", "main"):
                for k, v in b["mongodb_commands"][role].items():
                    kinds[f"{role}:{k}"] += v
        contended = sum(b["contended_runs"] for b in bs)
        runs = sum(b["runs"] for b in bs)
        per_contended = [
            b["mongodb_commands_per_contended_run"]
            for b in bs
            if b["mongodb_commands_per_contended_run"] is not None
        ]
        out[policy] = {
            "label": LABELS[policy],
            "rounds": len(bs),
            "runs_per_batch": bs[0]["runs"],
            "body_seconds": bs[0]["body_seconds"],
            "handoff_idle": stats(gaps),
            "handoff_parts_median_ms": {
                k: round(statistics.median(xs), 2) if xs else None
                for k in ("release", "to_next_execution", "to_body")
                for xs in [
                    [
                        b["handoff_parts_median_ms"][k]
                        for b in bs
                        if b["handoff_parts_median_ms"][k] is not None
                    ]
                ]
            },
            "makespan_over_work_median": round(statistics.median(b["makespan_over_work"] for b in bs), 4),
            "makespan_over_work_max": max(b["makespan_over_work"] for b in bs),
            "makespan_s_median": round(statistics.median(b["makespan_s"] for b in bs), 3),
            "work_s_median": round(statistics.median(b["work_s"] for b in bs), 3),
            "from_first_send_over_work_median": round(
                statistics.median(b["from_first_send_over_work"] for b in bs), 4
            ),
            "from_first_send_over_work_max": max(b["from_first_send_over_work"] for b in bs),
            "slots_waiting_mean_median": round(statistics.median(b["slots_waiting"]["mean"] for b in bs), 4),
            "slots_waiting_p95_max": max(b["slots_waiting"]["p95"] for b in bs),
            "slots_waiting_max": max(b["slots_waiting"]["max"] for b in bs),
            "slot_seconds_waiting_per_run_median": round(
                statistics.median(b["slots_waiting"]["slot_seconds_per_run"] for b in bs), 4
            ),
            "slot_seconds_outside_body_per_run_median": round(
                statistics.median(b["slot_seconds_outside_body_per_run"] for b in bs), 4
            ),
            "executions_per_run": round(sum(b["executions"] for b in bs) / runs, 3),
            "contended_runs": contended,
            "mongodb_commands_per_contended_run_median": round(statistics.median(per_contended), 3)
            if per_contended
            else None,
            "mongodb_commands_per_contended_run_max": max(per_contended) if per_contended else None,
            "mongodb_commands_by_kind_per_run": {k: round(v / runs, 3) for k, v in sorted(kinds.items())},
            "overlapping_bodies": sum(b["overlapping_bodies"] for b in bs),
            "send_order_inversions": sum(b["send_order_inversions"] for b in bs),
            "send_order_inversions_after_first": sum(b["send_order_inversions_after_first"] for b in bs),
        }
    return out


# -- the store alone: many runs parked on one key ----------------------------------------------------------
def parked_store(
    url: str,
    database: str,
    sizes: list[int],
    samples: int,
    seed: int,
    *,
    limit: int | None = None,
    several: bool = False,
) -> dict[str, Any]:
    """Park and hand over on one key that already has ``size`` runs parked, on ``LeaseStore`` alone.
    ``limit``: a ``limit=N`` key, every slot held (a release hands one slot, the run handed it claims it).
    ``several``: the runs are ``Queue`` runs of two keys (``keys=``) waiting on this one, the second of
    their keys (each entry names both, ``ks``), which take their keys one at a time and are spilled too.

    The queue is filled in one write (entries as ``admit`` makes them); then ``samples`` parks (a newer
    send: appended at the end) and ``samples`` handoffs (the holder's release hands the key to the oldest
    parked run; that run's claim takes it and becomes the next holder) are timed. Every command is one
    ``findAndModify``; the reply sizes come from the command monitor.
    """
    import bson
    from kombu.serialization import dumps
    from pymongo import MongoClient, monitoring

    from celery_mongolock.core.documents.lanes import spill_id
    from celery_mongolock.store import LeaseStore

    replies: list[tuple[str, int]] = []
    names: Counter[str] = Counter()

    class Listener(monitoring.CommandListener):
        def started(self, event: monitoring.CommandStartedEvent) -> None:
            names[event.command_name] += 1

        def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
            if event.command_name == "findAndModify":
                replies.append((event.command_name, len(bson.encode(event.reply))))

        def failed(self, event: monitoring.CommandFailedEvent) -> None:
            names["failed:" + event.command_name] += 1

    # A realistic message: what message_of stores for a run of contention.queue (an upload of a file).
    from celery import Celery

    app = Celery("parked_bench", set_as_current=False)

    def message(i: int, stamp: int) -> dict[str, Any]:
        task_id = str(uuid.uuid4())
        sig = app.signature(
            "contention.queue",
            args=("group-4242", f"uploads/2026/11/23/group-4242/members-{i:05d}.csv", i, 1.2),
            task_id=task_id,
            headers={"mongolock_sent": stamp},
            reply_to=str(uuid.uuid4()),
        )
        content_type, encoding, body = dumps(dict(sig), serializer="json")  # type: ignore[no-untyped-call]
        m = body if isinstance(body, bytes) else body.encode(encoding)
        return {
            "id": f"{task_id}/0.0",
            "t": task_id,
            "n": "contention.queue",
            "r": "0.0",
            "s": stamp,
            "src": "sent",
            "th": "skip",
            "m": m,
            "ct": content_type,
            "ce": encoding,
        }

    client: Any = MongoClient(url, event_listeners=[Listener()])
    store = LeaseStore(client, database=database, collection="parked", lease_seconds=3600)
    rng = random.Random(seed)
    out: dict[str, Any] = {"sizes": {}, "refused": {}}
    try:
        warm = store.acquire("parked-warmup")  # indexes, connections
        assert warm is not None
        warm.release()
        for size in sizes:
            key = f"parked-{size}-{uuid.uuid4().hex[:6]}"
            holders = [store.acquire(key, ttl=3600, limit=limit) for _ in range(limit or 1)]
            assert all(holders)
            stamp = 1_000_000_000
            entries = []
            now = _dt.datetime.now(_dt.timezone.utc)
            for i in range(size):
                stamp += rng.randint(1, 1000)
                e = message(i, stamp)
                e.update(tk=uuid.uuid4().hex, ttl=3_600_000, at=now, dl=None)
                if several:
                    e["ks"] = [f"{key}:first-{i}", key]
                entries.append(e)
            entry_bytes = len(bson.encode(entries[0])) if entries else 0
            # The first ``window`` runs in the lease document, the others spilled (``documents.spill``), as
            # parking them one by one would leave them.
            window = store.spill.window
            t0 = time.perf_counter()
            epoch = 1
            lanes = (
                [{"r": 0, "e": epoch, "h": 0, "t": len(entries) - window}] if len(entries) > window else []
            )
            spilled = [
                {
                    "_id": spill_id(key, 0, epoch, n),
                    "k": key,
                    "rid": e["t"],
                    "r": 0,
                    "ep": epoch,
                    "n": n,
                    "e": e,
                }
                for n, e in enumerate(entries[window:])
            ]
            for start in range(0, len(spilled), 1000):
                store.spill.collection.insert_many(spilled[start : start + 1000], ordered=False)
            fields = {"q": entries[:window], "wq": True, "gc_at": None, **({"sp": lanes} if lanes else {})}
            store.collection.update_one({"_id": key}, {"$set": fields})
            fill = time.perf_counter() - t0
            doc_bytes = len(bson.encode(store.collection.find_one({"_id": key}) or {}))
            # The embedded server slows down with the writes it has taken, whatever they touch: a plain
            # update of another document, timed beside, tells that drift from the queue's own cost.
            probe: list[float] = []
            for _ in range(max(3, samples)):
                t0 = time.perf_counter()
                store.collection.update_one({"_id": "parked-probe"}, {"$inc": {"n": 1}}, upsert=True)
                probe.append(time.perf_counter() - t0)
            park: list[float] = []
            park_reply: list[int] = []
            for _ in range(samples):
                stamp += 1000
                replies.clear()
                t0 = time.perf_counter()
                run = message(size, stamp)
                if several:
                    run.update(ks=[f"{key}:first-{stamp}", key], tk=uuid.uuid4().hex)
                lease, doc = store.admit(key, run, ttl=3600, limit=limit)
                park.append(time.perf_counter() - t0)
                park_reply.append(sum(b for _, b in replies))
                if doc.get("lo") != "parked":
                    raise RuntimeError(f"park at {size}: outcome {doc.get('lo')!r}")
            release: list[float] = []
            claim: list[float] = []
            for _ in range(samples):
                t0 = time.perf_counter()
                assert holders.pop(0).release()
                t1 = time.perf_counter()
                ho = handed_of(store.collection.find_one({"_id": key}, {"ho": 1, "hs": 1}))
                entry = {k: ho[k] for k in ("id", "t", "n", "r", "s", "src", "th", "m", "ct", "ce", "tk")}
                if several:
                    entry["ks"] = ho["ks"]
                t2 = time.perf_counter()
                lease, doc = store.admit(key, entry, ttl=3600, claim=ho["tk"], limit=limit)
                t3 = time.perf_counter()
                if lease is None or doc.get("lo") != "claimed":
                    raise RuntimeError(f"claim at {size}: outcome {doc.get('lo')!r}")
                holders.append(lease)
                release.append(t1 - t0)
                claim.append(t3 - t2)
            # What a worker's sweeper spends on this key every pass (min(lease / 2, 15 s)), while runs are
            # parked: the list of waiting keys (parked entries without their messages), then one sweep.
            sweep_list: list[float] = []
            sweep: list[float] = []
            for _ in range(min(samples, 2)):
                t0 = time.perf_counter()
                waiting = store.waiting_keys()
                t1 = time.perf_counter()
                store.sweep(key, slots=limit is not None)
                sweep.append(time.perf_counter() - t1)
                sweep_list.append(t1 - t0)
                assert [d["_id"] for d in waiting] == [key], [d["_id"] for d in waiting]
            for holder in holders:
                holder.release()
            store.collection.delete_one({"_id": key})  # its parked runs are not the next size's
            store.spill.collection.delete_many({"k": key})
            handoff = [a + b for a, b in zip(release, claim, strict=True)]
            out["sizes"][str(size)] = {
                "parked": size,
                "entry_bytes": entry_bytes,
                "message_bytes": len(entries[0]["m"]) if entries else 0,
                "document_bytes": doc_bytes,
                "fill_seconds": round(fill, 3),
                "park": stats(park),
                "park_reply_bytes": int(statistics.median(park_reply)),
                "release_handing_over": stats(release),
                "claim": stats(claim),
                "handoff": stats(handoff),
                "probe_update": stats(probe),
                "sweeper_waiting_keys": stats(sweep_list),
                "sweeper_sweep": stats(sweep),
            }
            print(
                f"  {size:>6} parked: park {ms(statistics.median(park))} ms, handoff "
                f"{ms(statistics.median(handoff))} ms (release {ms(statistics.median(release))} + claim "
                f"{ms(statistics.median(claim))})",
                flush=True,
            )
        out["commands"] = dict(names)
        s = out["sizes"]
        if s:
            lo, hi = min(s, key=int), max(s, key=int)
            out["ratios"] = {
                f"park_{hi}_over_{lo}": round(s[hi]["park"]["median"] / s[lo]["park"]["median"], 2),
                f"handoff_{hi}_over_{lo}": round(s[hi]["handoff"]["median"] / s[lo]["handoff"]["median"], 2),
            }
        client.drop_database(database)
    finally:
        store.close()
        client.close()
    return out


def handed_of(doc: dict[str, Any] | None) -> dict[str, Any]:
    """The run a release handed the key (``ho``) or a slot of it (``hs[].ho``, the newest handoff) to."""
    doc = doc or {}
    handed = [doc["ho"]] if doc.get("ho") else [h["ho"] for h in doc.get("hs") or [] if h.get("ho")]
    if not handed:
        raise RuntimeError("the release handed nothing over")
    return dict(max(handed, key=lambda ho: ho.get("hat") or 0))


# -- set-up --------------------------------------------------------------------------------------------
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
        **{d: version_of(d) for d in ("celery", "kombu", "billiard", "redis", "pymongo", "secantusdb")},
        "celery_mongolock": version_of("celery-mongolock"),
    }


@contextlib.contextmanager
def servers(mongo_url: str | None) -> Iterator[dict[str, Any]]:
    from celery_mongolock.testing import RedisServer

    with RedisServer() as broker, contextlib.ExitStack() as stack:
        if mongo_url:
            url, kind = mongo_url, "url"
        else:
            from celery_mongolock.embedded import EmbeddedMongo

            url, kind = stack.enter_context(EmbeddedMongo()).url, "embedded"
        yield {
            "broker_url": broker.url,
            "backend_url": broker.url.rsplit("/", 1)[0] + "/1",
            "mongo_url": url,
            "mongo_kind": kind,
            "database": f"mongolock_bench_con_{time.strftime('%Y%m%d_%H%M%S')}_{uuid.uuid4().hex[:6]}",
        }


def server_info(url: str) -> dict[str, Any]:
    from pymongo import MongoClient

    client: Any = MongoClient(url, serverSelectionTimeoutMS=10_000)
    try:
        return {"version": client.server_info().get("version")}
    finally:
        client.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--mongo-url", default=os.environ.get(URL_ENV) or None, help="MongoDB to use")
    parser.add_argument("--nodes", type=int, default=2, help="worker nodes (default 2)")
    parser.add_argument("--concurrency", type=int, default=3, help="pool processes per node (default 3)")
    parser.add_argument("--runs", type=int, default=None, help="runs per batch, one key (12; 8 quick)")
    parser.add_argument(
        "--seconds", type=float, default=None, help="work per run, s (1.2, as in issue 16; 0.5 quick)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (3; 1 quick)")
    parser.add_argument(
        "--policies", default=",".join(POLICIES), help=f"comma-separated subset of {','.join(POLICIES)}"
    )
    parser.add_argument(
        "--parked-sizes", default="100,1000,10000,100000", help="runs parked for the store part (0: skip it)"
    )
    parser.add_argument("--parked-samples", type=int, default=None, help="parks, handoffs per size (5; 1)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    parser.add_argument("--quick", action="store_true", help="smaller batches, one round, fewer samples")
    parser.add_argument("--seed", type=int, default=12345, help="seed of the round order shuffle")
    args = parser.parse_args(argv)
    q = args.quick
    defaults = {
        "runs": 8 if q else 12,
        "seconds": 0.5 if q else 1.2,
        "rounds": 1 if q else 3,
        "parked_samples": 1 if q else 5,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = set(args.policies) - set(POLICIES)
    if unknown:
        parser.error(f"unknown policies {sorted(unknown)}; known: {list(POLICIES)}")
    args.parked_sizes = sorted({int(s) for s in args.parked_sizes.split(",") if int(s) > 0})
    if args.runs < 2 or args.rounds < 1 or args.parked_samples < 1 or args.seconds <= 0:
        parser.error("--runs must be at least 2, --rounds and --parked-samples at least 1, --seconds > 0")
    return args


# -- targets and summary -----------------------------------------------------------------------------------
def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f}"


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    q = (result.get("policies") or {}).get("queue")

    def add(name: str, wanted: str, measured: Any, met: bool | None, by: str) -> None:
        out.append({"name": name, "target": wanted, "measured": measured, "met": met, "by": by})

    if q:
        h = q["handoff_idle"]
        add(
            "Queue: handoff idle on a hot key, release to next start (median), ms",
            f"<= {TARGET_HANDOFF_MEDIAN * 1000:g}",
            round(h["median"] * 1000, 1),
            h["median"] <= TARGET_HANDOFF_MEDIAN,
            f"{(h['median'] - TARGET_HANDOFF_MEDIAN) * 1000:+.1f} ms (p95 {ms(h['p95'])} ms)",
        )
        add(
            "Queue: handoff idle on a hot key (max), ms",
            f"<= {TARGET_HANDOFF_MAX * 1000:g}",
            round(h["max"] * 1000, 1),
            h["max"] <= TARGET_HANDOFF_MAX,
            f"{(h['max'] - TARGET_HANDOFF_MAX) * 1000:+.1f} ms ({h['n']} handoffs)",
        )
        r = q["from_first_send_over_work_median"]
        add(
            f"Queue: makespan of {q['runs_per_batch']} contended runs, first send to last end / their "
            "total work (median)",
            f"<= {TARGET_MAKESPAN:g}",
            r,
            r <= TARGET_MAKESPAN,
            f"{(r - TARGET_MAKESPAN) * 100:+.1f} points (worst round {q['from_first_send_over_work_max']:g}; "
            f"first start to last end: {q['makespan_over_work_median']:g})",
        )
        slots = q["slots_waiting_p95_max"]
        add(
            "Queue: worker slots held by waiting runs (p95 of samples every 5 ms, worst round)",
            f"{TARGET_SLOTS}",
            slots,
            slots <= TARGET_SLOTS,
            f"mean {q['slots_waiting_mean_median']:.3f}, max {q['slots_waiting_max']} at once (parking "
            f"a burst); {ms(q['slot_seconds_waiting_per_run_median'])} ms of slot per run after it found "
            "the key held",
        )
        c = q["mongodb_commands_per_contended_run_median"]
        if c is not None:
            add(
                "Queue: MongoDB commands per contended run (every worker process)",
                f"<= {TARGET_COMMANDS}",
                c,
                c <= TARGET_COMMANDS,
                f"{c - TARGET_COMMANDS:+.2f} (worst round {q['mongodb_commands_per_contended_run_max']:g})",
            )
    parked = result.get("parked_store") or {}
    ratios = parked.get("ratios") or {}
    for name, label in (("park", "park (admit)"), ("handoff", "handoff (release + claim)")):
        k = next((k for k in ratios if k.startswith(name + "_")), None)
        if k is None:
            continue
        sizes = parked["sizes"]
        hi, lo = max(sizes, key=int), min(sizes, key=int)
        add(
            f"Queue: {label} with {int(hi):,} runs parked / with {int(lo):,} (median, lease store)",
            f"flat (< {TARGET_FLAT:g})",
            ratios[k],
            ratios[k] < TARGET_FLAT,
            f"{ms(sizes[hi][name]['median'])} ms vs {ms(sizes[lo][name]['median'])} ms",
        )
    for size, why in sorted((parked.get("refused") or {}).items(), key=lambda kv: int(kv[0])):
        add(
            f"Queue: park and handoff with {int(size):,} runs parked on one key (lease store)",
            "measured, flat",
            "refused",
            False,
            why,
        )
    return out


def order_note(s: dict[str, Any]) -> str:
    text = "yes" if s["send_order_inversions"] == 0 else f"{s['send_order_inversions']} inversions"
    after = s["send_order_inversions_after_first"]
    if s["send_order_inversions"]:
        text += "; after the first run: " + ("none" if after == 0 else str(after))
    if s["overlapping_bodies"]:
        text += f"; **{s['overlapping_bodies']} overlapping bodies**"
    return text


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The Markdown section ``run.py`` puts in the report."""
    p = result["parameters"]
    pol = result.get("policies") or {}
    lines = [
        f"{p['nodes']} prefork nodes of concurrency {p['concurrency']}, Redis broker and result backend; "
        f"{p['runs']} runs of one key sent at once, each body {p['seconds']:g} s of work; "
        f"{p['rounds']} interleaved round{'s' if p['rounds'] != 1 else ''}. *Idle*: from one body's end to "
        "the next body's start (all rounds pooled). *Slots held waiting*: executions whose run found the key "
        "held and that have not started a body, sampled every 5 ms (mean / p95 / max). *Commands*: counted "
        "in every worker process (pymongo command monitoring), an uncontended run's 2 taken off. *In send "
        "order*: adjacent pairs of runs that started in the other order than they were sent, in all and "
        "leaving out the first run to start (it found the key free before anything was parked).",
        "",
        "| policy | idle ms: median / p95 / max | makespan / work (from the first send) | "
        "slots held waiting | executions per run | MongoDB commands per contended run | in send order |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name in POLICIES:
        s = pol.get(name)
        if not s:
            continue
        h = s["handoff_idle"]
        c = s["mongodb_commands_per_contended_run_median"]
        lines.append(
            f"| {s['label']} | {ms(h['median'])} / {ms(h['p95'])} / {ms(h['max'])} | "
            f"{s['makespan_over_work_median']:.3f} ({s['from_first_send_over_work_median']:.3f}) | "
            f"{s['slots_waiting_mean_median']:.2f} / "
            f"{s['slots_waiting_p95_max']} / {s['slots_waiting_max']} | {s['executions_per_run']:.2f} | "
            f"{'n/a' if c is None else format(c, '.2f')} | {order_note(s)} |"
        )
    parts = {n: s["handoff_parts_median_ms"] for n, s in pol.items() if n in ("queue", "wait")}
    if parts:
        lines += [
            "",
            "Where a handoff's idle time goes (medians, ms): the holder's release (its command and, for "
            "Queue, publishing the handed run) / until the next run's execution begins (broker, worker) / "
            "until its body starts (its claim or acquire; a woken Wait's whole wake-up): "
            + "; ".join(
                f"{LABELS[n]} {' / '.join('n/a' if v is None else f'{v:g}' for v in x.values())}"
                for n, x in parts.items()
            )
            + ".",
        ]
    kinds = {n: s["mongodb_commands_by_kind_per_run"] for n, s in pol.items()}
    if kinds:
        lines += [
            "",
            "MongoDB commands per run by kind (`child`: pool processes; `main`: a worker's own process, e.g. "
            "the sweeper):",
            "",
        ]
        for name, k in kinds.items():
            lines.append(f"* {LABELS[name]}: " + ", ".join(f"{n} {v:g}" for n, v in k.items()))
    parked = result.get("parked_store") or {}
    if parked.get("sizes"):
        lines += [
            "",
            "Many runs parked on one key, on the lease store alone (beyond 32, spilled; "
            f"{p['parked_samples']} sample{'s' if p['parked_samples'] != 1 else ''} per size; medians):",
            "",
            "| runs parked | lease document | park (admit) ms | its reply | handoff ms: release + claim | "
            "sweeper pass ms: list + sweep | an unrelated `update`, ms |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for _n, s in sorted(parked["sizes"].items(), key=lambda kv: int(kv[0])):
            lines.append(
                f"| {s['parked']:,} | {s['document_bytes'] / 1e6:,.2f} MB | {ms(s['park']['median'])} | "
                f"{s['park_reply_bytes'] / 1e3:,.0f} kB | {ms(s['handoff']['median'])}: "
                f"{ms(s['release_handing_over']['median'])} + {ms(s['claim']['median'])} | "
                f"{ms(s['sweeper_waiting_keys']['median'])} + {ms(s['sweeper_sweep']['median'])} | "
                f"{ms(s['probe_update']['median'])} |"
            )
    return lines


def explanations(result: dict[str, Any]) -> list[str]:
    """Why the missed targets are missed, from the figures (``run.py`` puts these in the report)."""
    out: list[str] = []
    missed = {t["name"] for t in result.get("targets") or [] if t["met"] is False}
    parked = result.get("parked_store") or {}
    if any("runs parked" in n for n in missed) and parked.get("sizes"):
        sizes = sorted(parked["sizes"].values(), key=lambda s: s["parked"])
        lo, hi = sizes[0], sizes[-1]
        out.append(
            "* **Many runs parked**: a key's lease document keeps a window of 32 parked runs per priority "
            "and spills the rest to `<collection>.parked` (docs/reference/policies.md, depth); a park "
            f"took {ms(lo['park']['median'])} ms with {lo['parked']:,} parked and "
            f"{ms(hi['park']['median'])} ms with {hi['parked']:,}, a handoff {ms(lo['handoff']['median'])} "
            f"and {ms(hi['handoff']['median'])} ms. An unrelated `update` took "
            f"{ms(lo['probe_update']['median'])} ms beside the smallest size and "
            f"{ms(hi['probe_update']['median'])} ms beside the largest: the embedded server's own drift "
            "with the writes it has taken (see `embedded_retryable.json`)."
        )
    if parked.get("refused"):
        sizes_refused = ", ".join(f"{int(n):,}" for n in sorted(parked["refused"], key=int))
        out.append(
            f"* **Deeper queues refused**: {sizes_refused} parked on one key could not be measured: "
            f"{next(iter(parked['refused'].values()))}, the cap that keeps it under MongoDB's 16 MB. "
            "(No depth is refused since runs beyond a key's window are spilled.)"
        )
    q = (result.get("policies") or {}).get("queue") or {}
    if any(n.startswith("Queue: handoff idle") or n.startswith("Queue: makespan") for n in missed) and q:
        parts = q["handoff_parts_median_ms"]
        out.append(
            f"* **Handoff**: the median handoff spends {parts['release']} ms in the holder's release "
            f"(the command and the publish), {parts['to_next_execution']} ms until the handed run's "
            f"execution begins and {parts['to_body']} ms until its body starts (its claim): two "
            "`findAndModify` round trips on the embedded server, which shares the machine's CPUs with "
            f"the broker and {result['parameters']['nodes']} worker nodes. A run of "
            f"{result['parameters']['seconds']:g} s pays it once per run in the makespan."
        )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    machine = machine_info()
    work_dir = Path(tempfile.mkdtemp(prefix="mongolock-bench-con-"))
    for sub in ("events", "counts"):
        (work_dir / sub).mkdir()
    batches: list[dict[str, Any]] = []
    parked: dict[str, Any] = {}
    with servers(args.mongo_url) as srv:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "CON_BROKER": srv["broker_url"],
            "CON_BACKEND": srv["backend_url"],
            "CON_MONGODB_URL": srv["mongo_url"],
            "CON_DB": srv["database"],
            "CON_READY_DIR": str(work_dir),
            "CON_EVENTS_DIR": str(work_dir / "events"),
            "CON_COUNT_DIR": str(work_dir / "counts"),
        }
        # This process sends the tasks with the same app; it records and counts nothing itself.
        os.environ.update({k: env[k] for k in ("CON_BROKER", "CON_BACKEND", "CON_MONGODB_URL", "CON_DB")})
        if str(HERE) not in sys.path:
            sys.path.insert(0, str(HERE))
        import contention_app as app_module

        server = {"kind": srv["mongo_kind"], **server_info(srv["mongo_url"])}
        print(
            f"contention: server {server}; {args.nodes} nodes x {args.concurrency}; {args.runs} runs of "
            f"{args.seconds:g}s per batch, {args.rounds} round(s); policies {args.policies}",
            flush=True,
        )
        bench = Bench(args, app_module, env, work_dir)
        try:
            for policy in args.policies:  # warm-up: connections, indexes, change streams, every code path
                bench.warm_up(policy)
            rng = random.Random(args.seed)
            for r in range(args.rounds):
                order = list(args.policies)
                rng.shuffle(order)
                for policy in order:
                    b = bench.batch(policy, args.runs, args.seconds)
                    b["round"] = r + 1
                    batches.append(b)
                    print(
                        f"  round {r + 1} {policy:<5}: idle median {ms(b['handoff_idle']['median']):>7} ms "
                        f"max {ms(b['handoff_idle']['max']):>7} ms; makespan/work "
                        f"{b['makespan_over_work']:.3f}; slots waiting mean {b['slots_waiting']['mean']:.2f} "
                        f"max {b['slots_waiting']['max']}; MongoDB commands/contended run "
                        f"{b['mongodb_commands_per_contended_run']}",
                        flush=True,
                    )
        finally:
            bench.close()
            with contextlib.suppress(Exception):
                from celery_mongolock.config import get_store

                get_store(app_module.app).close()
        if args.parked_sizes:
            print(f"many runs parked on one key (lease store): {args.parked_sizes} ...", flush=True)
            parked = parked_store(
                srv["mongo_url"], srv["database"] + "_parked", args.parked_sizes, args.parked_samples,
                args.seed,
            )  # fmt: skip
        with contextlib.suppress(Exception):
            from pymongo import MongoClient

            cleanup: Any = MongoClient(srv["mongo_url"], serverSelectionTimeoutMS=5000)
            cleanup.drop_database(srv["database"])
            cleanup.close()
    import shutil

    shutil.rmtree(work_dir, ignore_errors=True)  # worker logs: kept only when the run failed
    result: dict[str, Any] = {
        "benchmark": "contention",
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "server": server,
        "parameters": {
            "quick": args.quick,
            "nodes": args.nodes,
            "concurrency": args.concurrency,
            "pool": "prefork",
            "runs": args.runs,
            "seconds": args.seconds,
            "rounds": args.rounds,
            "policies": args.policies,
            "parked_sizes": args.parked_sizes,
            "parked_samples": args.parked_samples,
            "worker_prefetch_multiplier": 1,
            "seed": args.seed,
        },
        "policies": summarize(batches),
        "batches": batches,
        "parked_store": parked,
        "duration_seconds": round(time.perf_counter() - started, 1),
    }
    result["targets"] = targets(result)
    result["summary"] = summary_lines(result)
    result["explanations"] = explanations(result)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(result["summary"]))
    for t in result["targets"]:
        verdict = "met" if t["met"] else "MISSED"
        print(f"  {verdict:>6}  {t['name']}: {t['measured']} (wanted {t['target']}; {t['by']})")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
