"""Benchmark of recovery: how soon a key runs again after its holder dies, stops, or releases it.

Run it from the repository root (after ``make bench`` installed the peers, or ``make venv`` without them)::

    .venv/bin/python benchmarks/recovery.py            # full run (about 5 minutes)
    .venv/bin/python benchmarks/recovery.py --quick    # about 2 minutes

Three real ``celery worker`` nodes (prefork, concurrency 1) share a Redis broker and the lease store:
node 1 runs the holder of a key, node 2 a second run of the same key that waits for it (``Wait``
policy), node 3 the same but without change streams (it polls, as on a server that has none). For each
fault the time is taken from the fault until the waiting run's body starts:

* **child killed**: SIGKILL to the pool process running the holder (its worker stays up);
* **node killed**: SIGKILL to the whole holder node (its lease must expire: ``mongolock_lease_seconds``);
* **graceful shutdown**: SIGTERM to the holder node (warm shutdown: the running holder finishes, then
  releases); measured from the end of the holder's body;
* **released**: the holder's body ends normally; measured from its end, for a waiter woken by a change
  stream (node 2) and for one that polls (node 3); the same in one process on the lease store alone
  (``LeaseStore.hold(wait=...)``, threads), without the broker in the way.

celery-singleton and celery-once, with the settings a user gets by default, go through the same faults:
they take their lock when a task is *sent*, so there is no waiting run; the benchmark sends a second run
every 50 ms (more eagerly than any user would) and times until one is accepted and starts. A lock that
is still held after ``--peer-cap`` seconds is reported as such, with the expiry that will free it.

Writes JSON (``benchmarks/results/recovery.json``), including a ``targets`` list that ``run.py`` puts in
the report. Uses the embedded server unless ``--mongo-url`` names a MongoDB (it must have change streams,
i.e. be a replica set, for the change-stream figures).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib.metadata
import json
import math
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = HERE / "results" / "recovery.json"
URL_ENV = "MONGOLOCK_TEST_MONGODB_URL"
PEERS = {"celery-singleton": "singleton", "celery-once": "once"}
PEER_EXPIRY = {
    "celery-singleton": "never (lock_expiry defaults to None: the key stays locked until cleared by hand)",
    "celery-once": "after 3600 s (default_timeout)",
}
# Targets (set from the lease contract before measuring, see benchmarks/README.md).
TARGET_PROMPT = 1.0  # child killed, graceful shutdown: the key is released, not left to expire
TARGET_NODE_SLACK = 1.0  # node killed: within the lease length plus this
TARGET_WAKE = 0.1  # a waiter woken by a change stream starts within this of the release (median)
TARGET_POLL = 1.1  # a polling waiter: within its largest poll interval (1 s by default) + 0.1 s to look
TARGET_NOTICE = 0.1  # a holder learns of a force release, deletion or takeover (median, lease watch)


# -- processes -----------------------------------------------------------------------------------------
class Node:
    """One ``celery -A recovery_app worker`` (prefork, concurrency 1) on one queue, in its own group."""

    def __init__(self, name: str, queue: str, env: dict[str, str], work_dir: Path) -> None:
        self.name = f"{name}@localhost"
        self.queue = queue
        self.env = env
        self.work_dir = work_dir
        self.log_path = work_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}

    def start(self, timeout: float = 120.0) -> Node:
        marker = Path(self.env["REC_READY_DIR"]) / f"{self.name}.ready"
        marker.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "celery", "-A", "recovery_app", "worker", "--pool=prefork"]
        cmd += ["--concurrency=1", "-n", self.name, "-Q", self.queue, "--loglevel=WARNING"]
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
        self.info = json.loads(marker.read_text() or "{}")
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

    def kill(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # a pool process left behind


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
    """The events the worker processes append (``recovery_app.emit``), read incrementally."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._offsets: dict[Path, int] = {}
        self.events: list[dict[str, Any]] = []

    def poll(self) -> None:
        for path in self.directory.glob("*.jsonl"):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offsets[path] = offset + end
            for line in data[:end].splitlines():
                self.events.append(json.loads(line))

    def find(self, ev: str, run: str, role: str) -> dict[str, Any] | None:
        self.poll()
        for e in self.events:
            if e["ev"] == ev and e.get("run") == run and e.get("role") == role:
                return e
        return None

    def wait(self, ev: str, run: str, role: str, timeout: float) -> dict[str, Any]:
        found: dict[str, Any] = wait_for(lambda: self.find(ev, run, role), timeout, f"{ev} of {role} ({run})")
        return found


# -- the measurements ----------------------------------------------------------------------------------
class Bench:
    def __init__(
        self, args: argparse.Namespace, app_module: Any, env: dict[str, str], work_dir: Path
    ) -> None:
        self.args = args
        self.app = app_module
        self.env = env
        self.events = Events(Path(env["REC_EVENTS_DIR"]))
        self.holder = Node("holder", "rec.holder", env, work_dir).start()
        self.waiter = Node("waiter", "rec.waiter", env, work_dir).start()
        self.poller = Node("poller", "rec.poller", {**env, "REC_POLLING": "1"}, work_dir).start()
        self.lease_seconds = float(env["REC_LEASE_SECONDS"])

    def close(self) -> None:
        for node in (self.holder, self.waiter, self.poller):
            node.stop()

    def fault(self, kind: str, started: dict[str, Any]) -> float:
        """Inject ``kind`` into the holder node; the time (monotonic) the recovery is measured from."""
        if kind == "child-kill":
            t0 = time.monotonic()
            os.kill(started["pid"], signal.SIGKILL)
            return t0
        if kind == "node-kill":
            t0 = time.monotonic()
            self.holder.kill()
            return t0
        if kind == "graceful":
            assert self.holder.proc is not None
            self.holder.proc.send_signal(signal.SIGTERM)  # warm shutdown: the holder finishes first
            return float("nan")  # measured from the holder's end
        if kind == "released":
            return float("nan")
        raise ValueError(kind)

    def after(self, kind: str) -> None:
        """A holder node that was killed or shut down is replaced by a new one."""
        if kind in ("node-kill", "graceful"):
            self.holder.stop()
            self.holder = Node("holder", "rec.holder", self.env, self.holder.work_dir).start()

    @staticmethod
    def hold_seconds(kind: str) -> float:
        # Killed holders would run for a minute. A graceful or normal end comes after a body long enough
        # for the second run to be waiting (and the SIGTERM sent) before it ends.
        return 60.0 if kind in ("child-kill", "node-kill") else 2.0

    def ours(self, kind: str, waiter_queue: str) -> dict[str, Any]:
        run = uuid.uuid4().hex[:12]
        key = f"{kind}-{run}"
        task = self.app.ours
        task.apply_async((run, key, "A", self.hold_seconds(kind)), queue="rec.holder")
        a = self.events.wait("start", run, "A", 60)
        task.apply_async((run, key, "B", 0.0), queue=waiter_queue)
        self.events.wait("contended", run, "B", 60)
        signalled = time.monotonic()
        t0 = self.fault(kind, a)
        b = self.events.wait("start", run, "B", self.lease_seconds + 120)
        if kind in ("graceful", "released"):
            end = self.events.wait("end", run, "A", 10)
            if kind == "graceful" and end["t"] < signalled:
                raise RuntimeError("the holder ended before the SIGTERM: not a graceful shutdown")
            t0 = end["t"]
        self.after(kind)
        return {"seconds": b["t"] - t0, "key": key}

    def peer(self, name: str, kind: str, cap: float) -> dict[str, Any]:
        """The same fault under a peer: time until a new send of the key is accepted and starts."""
        task = getattr(self.app, f"peer_{PEERS[name]}")
        run = uuid.uuid4().hex[:12]
        key = f"{kind}-{run}"
        first = task.apply_async((run, key, "A", self.hold_seconds(kind)), queue="rec.holder")
        a = self.events.wait("start", run, "A", 60)
        t0 = self.fault(kind, a)
        if kind == "graceful":
            t0 = self.events.wait("end", run, "A", 30)["t"]
        accepted_at = None
        sends = 0
        give_up = time.monotonic() + cap
        while time.monotonic() < give_up:
            sends += 1
            try:
                result = task.apply_async((run, key, "B", 0.0), queue="rec.waiter")
            except Exception as exc:  # celery-once: AlreadyQueued while its lock is held
                if type(exc).__name__ != "AlreadyQueued":
                    raise
            else:
                if result.id != first.id:  # celery-singleton hands back the holder's result instead
                    accepted_at = time.monotonic()
                    break
            time.sleep(0.05)
        self.after(kind)
        if accepted_at is None:
            return {"seconds": None, "sends": sends, "still_locked_after": cap, "key": key}
        b = self.events.wait("start", run, "B", 60)
        return {"seconds": b["t"] - t0, "accepted_after": accepted_at - t0, "sends": sends, "key": key}


def store_wake(url: str, database: str, reps: int, seed: int) -> dict[str, Any]:
    """``LeaseStore.hold(wait=...)`` in one process: from the holder's release to the waiter holding."""
    from pymongo.errors import OperationFailure

    from celery_mongolock.store import LeaseStore

    class NoChangeStreams:
        def __init__(self, collection: Any) -> None:
            self._collection = collection

        def watch(self, *args: Any, **kwargs: Any) -> Any:
            raise OperationFailure("change streams are off (benchmark: polling)")

        def __getattr__(self, name: str) -> Any:
            return getattr(self._collection, name)

    class PollingStore(LeaseStore):
        @property
        def collection(self) -> Any:
            return NoChangeStreams(super().collection)

    holder = LeaseStore(url, database=database, collection="wake", lease_seconds=30)
    stores = {
        "change_stream": LeaseStore(url, database=database, collection="wake", lease_seconds=30),
        "polling": PollingStore(url, database=database, collection="wake", lease_seconds=30),
    }
    rng = random.Random(seed)
    samples: dict[str, list[float]] = {name: [] for name in stores}
    try:
        for mode in ("change_stream", "polling"):  # warm-up: connections, the change stream's first use
            key = f"wake-warmup-{mode}"
            lease = holder.acquire(key)
            assert lease is not None
            lease.release()
            with stores[mode].hold(key, wait=5):
                pass
        for _ in range(reps):
            order = list(stores)
            rng.shuffle(order)
            for mode in order:
                key = f"wake-{mode}-{uuid.uuid4().hex[:8]}"
                lease = holder.acquire(key)
                assert lease is not None
                got: list[float] = []

                def waiter(store: LeaseStore = stores[mode], key: str = key, got: list[float] = got) -> None:
                    with store.hold(key, wait=30):
                        got.append(time.monotonic())

                thread = threading.Thread(target=waiter)
                thread.start()
                # Release at a random moment of the waiter's wait, so a poller's phase is sampled fairly.
                time.sleep(rng.uniform(0.2, 1.5))
                t0 = time.monotonic()
                assert lease.release()
                thread.join(60)
                assert got, f"the {mode} waiter did not get {key}"
                samples[mode].append(got[0] - t0)
    finally:
        for s in (holder, *stores.values()):
            s.close()
    return {mode: stats(xs) for mode, xs in samples.items()}


NOTICE_KINDS = ("forced", "deleted", "taken-over")


def store_notice(url: str, database: str, reps: int, seed: int, heartbeat: float) -> dict[str, Any]:
    """How soon a holder learns that its lease is gone (issue 29 item 3), on the lease store alone: from
    sending the command that ends it (a force release, a deletion by hand, a takeover after expiry: its
    expiry moved into the past by hand, then the real acquire of another store), to ``lease.lost``
    (``wait_lost`` waking), with the lease watch (one change stream per process) and without it (the
    heartbeat's renewal every ``heartbeat`` s finds it; each loss at a random moment of that interval).
    Both holders hold ``HELD_BESIDE`` other leases all along: one stream serves them all."""
    from celery_mongolock.store import LeaseStore

    lease_s = heartbeat * 3
    holders = {
        "change_stream": LeaseStore(url, database=database, collection="notice", lease_seconds=lease_s),
        "heartbeat": LeaseStore(
            url, database=database, collection="notice", lease_seconds=lease_s, watch_leases=False
        ),
    }
    operator = LeaseStore(url, database=database, collection="notice", watch_leases=False)
    rng = random.Random(seed)
    samples: dict[str, dict[str, list[float]]] = {m: {k: [] for k in NOTICE_KINDS} for m in holders}
    after_reply: dict[str, list[float]] = {m: [] for m in holders}
    load_before = os.getloadavg()
    beside: list[Any] = []
    try:
        for mode, store in holders.items():
            beside += [store.acquire(f"beside-{mode}-{i}", heartbeat=True) for i in range(HELD_BESIDE)]
        for _ in range(reps):
            order = [(mode, kind) for mode in holders for kind in NOTICE_KINDS]
            rng.shuffle(order)
            for mode, kind in order:
                from_send, from_reply = _one_notice(holders[mode], operator, kind, rng.uniform(0, heartbeat))
                samples[mode][kind].append(from_send)
                after_reply[mode].append(from_reply)
        watch = holders["change_stream"].heartbeat.watch
        streams = {"streams_opened": watch.streams_opened, "leases_held_beside": HELD_BESIDE} if watch else {}
        assert all(lease is not None and lease.held for lease in beside), "a lease held beside was lost"
    finally:
        for s in (*holders.values(), operator):
            s.close()
    out: dict[str, Any] = {"heartbeat_seconds": heartbeat, "lease_seconds": lease_s, **streams}
    out["loadavg_before_after"] = [round(x, 2) for x in (*load_before, *os.getloadavg())]
    for mode, by_kind in samples.items():
        every = [x for xs in by_kind.values() for x in xs]
        out[mode] = {"all": stats(every), **{kind: stats(xs) for kind, xs in by_kind.items()}}
        out[mode]["all_from_reply"] = stats(after_reply[mode])
    return out


#: Leases each holder keeps all along besides the ones it loses (the stream serves all of them).
HELD_BESIDE = 20


def _one_notice(store: Any, operator: Any, kind: str, after: float) -> tuple[float, float]:
    key = f"notice-{kind}-{uuid.uuid4().hex[:8]}"
    lease = store.acquire(key, heartbeat=True)
    assert lease is not None
    noticed: list[float] = []

    def wait() -> None:
        if lease.wait_lost(120):
            noticed.append(time.monotonic())

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(after)  # a random moment of the heartbeat's interval
    if kind == "taken-over":  # the lease expires on the server; the acquire that takes it ends it
        past = _dt.datetime.now(_dt.timezone.utc) - _dt.timedelta(minutes=5)
        operator.collection.update_one({"_id": key}, {"$set": {"expires_at": past}})
    sent = time.monotonic()  # the command that ends the lease is sent (the holder may know before it returns)
    if kind == "forced":
        assert operator.force_release(key)
    elif kind == "deleted":
        assert operator.collection.delete_one({"_id": key}).deleted_count == 1
    else:
        assert operator.acquire(key, ttl=30) is not None
    replied = time.monotonic()
    waiter.join(120)
    assert noticed, f"{key}: the loss was never noticed"
    # 0: noticed before the command was sent (the heartbeat found the expired lease before the takeover)
    # or before its reply reached the operator.
    return max(0.0, noticed[0] - sent), max(0.0, noticed[0] - replied)


def stats(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0}
    ordered = sorted(xs)
    return {
        "n": len(xs),
        "median_s": round(statistics.median(xs), 4),
        "p95_s": round(ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)], 4),
        "min_s": round(min(xs), 4),
        "max_s": round(max(xs), 4),
        "samples_s": [round(x, 4) for x in xs],
    }


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
        **{peer: version_of(peer) for peer in PEERS},
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
            "mongo_url": url,
            "mongo_kind": kind,
            "database": f"mongolock_bench_rec_{time.strftime('%Y%m%d_%H%M%S')}_{uuid.uuid4().hex[:6]}",
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
    parser.add_argument("--reps", type=int, default=None, help="repetitions of each fault (5; 2 quick)")
    parser.add_argument("--wake-reps", type=int, default=None, help="store-level wake-ups (20; 8 quick)")
    parser.add_argument(
        "--lease-seconds", type=float, default=5.0, help="the workers' mongolock_lease_seconds (default 5)"
    )
    parser.add_argument(
        "--peer-cap", type=float, default=None, help="seconds to wait for a peer's lock (30; 10 quick)"
    )
    parser.add_argument("--no-peers", action="store_true", help="leave celery-singleton and celery-once out")
    parser.add_argument(
        "--notice-reps", type=int, default=None, help="losses per kind and mode (20; 8 quick)"
    )
    parser.add_argument(
        "--notice-heartbeat",
        type=float,
        default=1.0,
        help="the holders' renewal interval for the losses (1 s)",
    )
    parser.add_argument(
        "--only-notice",
        action="store_true",
        help="measure only how soon a holder notices a loss (no workers)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, shorter peer cap")
    parser.add_argument("--seed", type=int, default=12345, help="seed of the release moments")
    args = parser.parse_args(argv)
    if args.reps is None:
        args.reps = 2 if args.quick else 5
    if args.wake_reps is None:
        args.wake_reps = 8 if args.quick else 20
    if args.notice_reps is None:
        args.notice_reps = 8 if args.quick else 20
    if args.peer_cap is None:
        args.peer_cap = 10.0 if args.quick else 30.0
    return args


FAULTS = {
    "child-kill": "worker child killed (SIGKILL)",
    "node-kill": "whole worker node killed (SIGKILL)",
    "graceful": "graceful shutdown (SIGTERM), from the holder's end",
    "released": "holder ends normally, waiter woken by a change stream",
}


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    ours = result["ours"]
    lease = result["parameters"]["lease_seconds"]

    def add(name: str, wanted: str, measured: float | None, limit: float, what: str) -> None:
        if measured is None:
            out.append({"name": name, "target": wanted, "measured": "n/a", "met": None, "by": "not measured"})
            return
        out.append(
            {
                "name": name,
                "target": wanted,
                "measured": round(measured, 3),
                "met": measured <= limit,
                "by": f"{measured - limit:+.2f} s against the limit ({what})",
            }
        )

    def worst(name: str) -> float | None:
        s = ours.get(name) or {}
        return s.get("max_s")

    add("recovery: worker child killed (max)", f"<= {TARGET_PROMPT:g} s", worst("child-kill"),
        TARGET_PROMPT, "released by the worker, not left to expire")  # fmt: skip
    add("recovery: whole node killed (max)", f"<= lease {lease:g} s + {TARGET_NODE_SLACK:g} s",
        worst("node-kill"), lease + TARGET_NODE_SLACK, "the lease must expire")  # fmt: skip
    add("recovery: graceful shutdown (max, from the holder's end)", f"<= {TARGET_PROMPT:g} s",
        worst("graceful"), TARGET_PROMPT, "released at the end of the run")  # fmt: skip
    wake = result.get("store_wake") or {}
    add("Wait starts after a release, change stream (median, lease store)", f"<= {TARGET_WAKE:g} s",
        (wake.get("change_stream") or {}).get("median_s"), TARGET_WAKE, "woken by the change")  # fmt: skip
    add("Wait starts after a release, polling (max, lease store)", f"<= {TARGET_POLL:g} s",
        (wake.get("polling") or {}).get("max_s"), TARGET_POLL, "largest poll interval + a look")  # fmt: skip
    return out + targets_notice(result)


def targets_notice(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets of the loss-notice figures (issue 29 item 3)."""
    notice = result.get("store_notice") or {}
    if not notice:
        return []
    beat = notice["heartbeat_seconds"]
    out = []
    for name, wanted, measured, limit, what in (
        ("Loss noticed by the holder, change stream (median, lease store)", f"<= {TARGET_NOTICE:g} s",
         notice["change_stream"]["all"].get("median_s"), TARGET_NOTICE,
         f"the lease watch; heartbeat only: {notice['heartbeat']['all'].get('median_s')} s with a {beat:g} s "
         "renewal interval"),
    ):  # fmt: skip
        out.append(
            {
                "name": name,
                "target": wanted,
                "measured": "n/a" if measured is None else round(measured, 3),
                "met": None if measured is None else measured <= limit,
                "by": "not measured"
                if measured is None
                else f"{measured - limit:+.2f} s against the limit ({what})",
            }
        )
    return out


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The Markdown section ``run.py`` puts in the report."""
    if result.get("only_notice"):
        return notice_lines(result["store_notice"])
    p = result["parameters"]
    lines = [
        "Three prefork nodes (concurrency 1), Redis broker, "
        f"`mongolock_lease_seconds={p['lease_seconds']:g}` "
        f"(heartbeat every {p['lease_seconds'] / 3:.2g} s); {p['reps']} repetitions per fault, time from "
        "the fault until the next run of the key starts (seconds, median / max). Peers: a new send every "
        f"50 ms until one is accepted, given up after {p['peer_cap']:g} s.",
        "",
        "| fault | @singleton_task (Wait) | " + " | ".join(result.get("peers_run") or []) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in result.get("peers_run") or []) + " |",
    ]
    for kind, label in FAULTS.items():
        s = result["ours"].get(kind) or {}
        row = f"| {label} | {fmt_stats(s)} |"
        for peer in result.get("peers_run") or []:
            r = (result["peers"].get(peer) or {}).get(kind)
            row += f" {fmt_peer(peer, r)} |"
        lines.append(row)
    poll = result["ours"].get("released-polling") or {}
    lines.append(
        f"| holder ends normally, waiter polling (no change streams) | {fmt_stats(poll)} |"
        + " |" * len(result.get("peers_run") or [])
    )
    notice = result.get("store_notice") or {}
    if notice:
        lines += ["", *notice_lines(notice)]
    wake = result.get("store_wake") or {}
    if wake:
        lines += [
            "",
            "`LeaseStore.hold(wait=...)` in one process, from `release()` to the waiter holding the key "
            f"({wake['change_stream']['n']} releases each, at random moments of the wait): change stream "
            f"{fmt_stats(wake['change_stream'])} s, polling {fmt_stats(wake['polling'])} s.",
        ]
    return lines


def notice_lines(notice: dict[str, Any]) -> list[str]:
    """The table of how soon a holder notices a loss, with and without the lease watch."""
    beat = notice["heartbeat_seconds"]
    lines = [
        f"How soon a holder notices that its lease is gone (lease store, renewal every {beat:g} s, "
        f"{notice['change_stream']['all']['n'] // len(NOTICE_KINDS)} losses per kind and mode, each at a "
        "random moment of the renewal interval; from sending the command that ended it to `lease.lost`; "
        "seconds, "
        f"median / p95 / max). The watching holder kept {notice.get('leases_held_beside', 0)} other leases "
        f"all along and opened {notice.get('streams_opened', 'n/a')} change stream(s).",
        "",
        "| loss | change stream | heartbeat only |",
        "| --- | ---: | ---: |",
    ]
    for kind in ("all", *NOTICE_KINDS, "all_from_reply"):
        cs, hb = notice["change_stream"][kind], notice["heartbeat"][kind]
        label = "all, from the command's reply" if kind == "all_from_reply" else kind
        lines.append(f"| {label} | {fmt_p95(cs)} | {fmt_p95(hb)} |")
    load = notice.get("loadavg_before_after")
    if load:
        lines += ["", f"Load average (1/5/15 min) before and after: {load[:3]}, {load[3:]}."]
    return lines


def fmt_p95(s: dict[str, Any]) -> str:
    if not s.get("n"):
        return "n/a"
    return f"{s['median_s']:.3f} / {s['p95_s']:.3f} / {s['max_s']:.3f}"


def fmt_stats(s: dict[str, Any]) -> str:
    if not s.get("n"):
        return "n/a"
    return f"{s['median_s']:.3f} / {s['max_s']:.3f}"


def fmt_peer(peer: str, r: dict[str, Any] | None) -> str:
    if not r:
        return "n/a"
    if r.get("error"):
        return f"error: {r['error']}"
    if r.get("still_locked"):
        return f"still locked after {r['still_locked_after']:g} s; frees {PEER_EXPIRY[peer].split(' (')[0]}"
    return fmt_stats(r)


def run_notice_only(args: argparse.Namespace) -> dict[str, Any]:
    """``--only-notice``: the loss-notice figures alone (an embedded server, no workers, no broker)."""
    started = time.perf_counter()
    with servers(args.mongo_url) as srv:
        server = {"kind": srv["mongo_kind"], **server_info(srv["mongo_url"])}
        print(f"server: {server}; {args.notice_reps} losses per kind and mode ...", flush=True)
        notice = store_notice(
            srv["mongo_url"], srv["database"], args.notice_reps, args.seed, args.notice_heartbeat
        )
    result: dict[str, Any] = {
        "benchmark": "recovery",
        "only_notice": True,
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "server": server,
        "parameters": {
            "notice_reps": args.notice_reps,
            "notice_heartbeat": args.notice_heartbeat,
            "seed": args.seed,
        },
        "store_notice": notice,
        "duration_seconds": round(time.perf_counter() - started, 1),
    }
    result["targets"] = targets_notice(result)
    result["summary"] = summary_lines(result)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.only_notice:
        return run_notice_only(args)
    started = time.perf_counter()
    machine = machine_info()
    work_dir = Path(tempfile.mkdtemp(prefix="mongolock-bench-rec-"))
    events_dir = work_dir / "events"
    events_dir.mkdir()
    with servers(args.mongo_url) as srv:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "REC_BROKER": srv["broker_url"],
            "REC_MONGODB_URL": srv["mongo_url"],
            "REC_DB": srv["database"],
            "REC_READY_DIR": str(work_dir),
            "REC_EVENTS_DIR": str(events_dir),
            "REC_LEASE_SECONDS": f"{args.lease_seconds:g}",
        }
        env.pop("REC_POLLING", None)
        os.environ.update({k: env[k] for k in env if k.startswith("REC_") and k != "REC_EVENTS_DIR"})
        if str(HERE) not in sys.path:
            sys.path.insert(0, str(HERE))
        import recovery_app as app_module

        server = {"kind": srv["mongo_kind"], **server_info(srv["mongo_url"])}
        print(f"server: {server}; workers starting ...", flush=True)
        bench = Bench(args, app_module, env, work_dir)
        try:
            peer_errors = {**app_module.PEER_ERRORS, **(bench.holder.info.get("peer_errors") or {})}
            peers_run = [] if args.no_peers else [p for p in PEERS if p not in peer_errors]
            ours: dict[str, list[float]] = {k: [] for k in [*FAULTS, "released-polling"]}
            for rep in range(args.reps):
                for kind in FAULTS:
                    r = bench.ours(kind, "rec.waiter")
                    ours[kind].append(r["seconds"])
                    print(f"  ours {kind} #{rep + 1}: {r['seconds']:.3f}s", flush=True)
                r = bench.ours("released", "rec.poller")
                ours["released-polling"].append(r["seconds"])
                print(f"  ours released (polling) #{rep + 1}: {r['seconds']:.3f}s", flush=True)
            peers: dict[str, dict[str, Any]] = {}
            for peer in peers_run:
                peers[peer] = {}
                for kind in ("child-kill", "node-kill", "graceful"):
                    samples: list[float] = []
                    rec: dict[str, Any] = {}
                    for _ in range(args.reps):
                        try:
                            r = bench.peer(peer, kind, args.peer_cap)
                        except Exception as exc:
                            rec = {"error": f"{type(exc).__name__}: {exc}"}
                            break
                        if r["seconds"] is None:  # still locked: repeating would only wait again
                            rec = {"still_locked": True, "still_locked_after": args.peer_cap,
                                   "expiry": PEER_EXPIRY[peer], "sends": r["sends"]}  # fmt: skip
                            break
                        samples.append(r["seconds"])
                    peers[peer][kind] = rec or stats(samples)
                    print(f"  {peer} {kind}: {peers[peer][kind]}", flush=True)
            print(f"store-level wake-up, {args.wake_reps} releases per mode ...", flush=True)
            wake = store_wake(srv["mongo_url"], srv["database"], args.wake_reps, args.seed)
            print(f"loss noticed by the holder, {args.notice_reps} losses per kind and mode ...", flush=True)
            notice = store_notice(
                srv["mongo_url"], srv["database"], args.notice_reps, args.seed, args.notice_heartbeat
            )
        finally:
            bench.close()
    result: dict[str, Any] = {
        "benchmark": "recovery",
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "server": server,
        "parameters": {
            "quick": args.quick,
            "reps": args.reps,
            "wake_reps": args.wake_reps,
            "lease_seconds": args.lease_seconds,
            "peer_cap": args.peer_cap,
            "seed": args.seed,
            "notice_reps": args.notice_reps,
            "notice_heartbeat": args.notice_heartbeat,
        },
        "ours": {k: stats(v) for k, v in ours.items()},
        "peers_run": peers_run,
        "peer_errors": peer_errors,
        "peers": peers,
        "peer_expiry": PEER_EXPIRY,
        "store_wake": wake,
        "store_notice": notice,
        "duration_seconds": round(time.perf_counter() - started, 1),
    }
    result["targets"] = targets(result)
    result["summary"] = summary_lines(result)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(result["summary"]))
    for t in result["targets"]:
        print(f"  {t['name']}: {t['measured']} (wanted {t['target']}; {t['by']})")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
