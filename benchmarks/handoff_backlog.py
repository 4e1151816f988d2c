"""Benchmark of a handoff behind the broker's backlog: how long a released ``Queue`` key idles while plain
tasks are queued ahead of its handed-over run (issue 28, items 3 and 6: at most 300 ms with 5,000).

Run it from the repository root (after ``make venv``)::

    .venv/bin/python benchmarks/handoff_backlog.py            # both brokers, 3 rounds: about 15 minutes
    .venv/bin/python benchmarks/handoff_backlog.py --quick    # about 3 minutes
    .venv/bin/python benchmarks/handoff_backlog.py --brokers redis --backlogs 0,1000,5000

One real ``celery worker`` (prefork, concurrency 2, Celery's default prefetch multiplier 4: 8 messages
reserved at most) on each broker (Redis, and RabbitMQ when ``rabbitmq-server`` is installed), with the
lease store on the embedded server. Each round, on one key under ``Queue()``: a holder runs; a second
run of the key is sent and parked; a plain task takes the other worker slot; N plain tasks (the backlog,
each sleeping ``--plain-seconds``) are queued on the same queue; then the holder and the plain task end
together. The **idle time** is the handed run's body start minus the holder's release (the library's
``lease_released`` signal, after the release command published the handoff), both from
``time.monotonic()`` in the worker's processes: one clock. Beside it, **plain tasks started first**: how
many of the backlog started before the handed run (an order, not a time).

Each backlog is run with handoff lanes off (``mongolock_handoff_lane = False``: the handed run's message
goes to the end of its queue, as before lanes) and on (the default), in interleaved rounds.

Writes JSON (``benchmarks/results/handoff_backlog.json``) with a ``targets`` list.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from contention import Events, machine_info, wait_for  # noqa: E402 - after the path above

DEFAULT_OUT = HERE / "results" / "handoff_backlog.json"
TARGET_IDLE = 0.300  # s, the handoff idle time with 5,000 messages queued ahead (issue 28, item 6)
CONCURRENCY = 2
PREFETCH_MULTIPLIER = 4  # Celery's default


class Node:
    """One ``celery -A handoff_backlog_app worker`` (prefork), in its own process group."""

    def __init__(self, env: dict[str, str], work_dir: Path, name: str) -> None:
        self.env = env
        self.name = f"{name}@localhost"
        self.log_path = work_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> Node:
        marker = Path(self.env["HB_READY_DIR"]) / f"{self.name}.ready"
        marker.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "celery", "-A", "handoff_backlog_app", "worker", "--pool=prefork"]
        cmd += [f"--concurrency={CONCURRENCY}", f"--prefetch-multiplier={PREFETCH_MULTIPLIER}"]
        cmd += ["-n", self.name, "--loglevel=WARNING", "--without-gossip", "--without-mingle"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=HERE, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_for(lambda: self._ready(marker), timeout, f"worker {self.name} to be ready")
        return self

    def _ready(self, marker: Path) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"worker {self.name} exited:\n{self.log_path.read_text()[-4000:]}")
        return marker.exists()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 15)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait(10)


def one_round(app: Any, events: Events, work_dir: Path, backlog: int, seconds: float) -> dict[str, Any]:
    """One handoff behind ``backlog`` plain tasks; returns its figures."""
    run = uuid.uuid4().hex[:12]
    gate = work_dir / f"gate-{run}"

    def first(ev: str, role: str | None = None) -> dict[str, Any] | None:
        for e in events.of(run):
            if e["ev"] == ev and (role is None or e.get("role") == role):
                return e
        return None

    app.keyed.delay(run, "holder", str(gate))
    wait_for(lambda: first("start", "holder"), 60, "the holder to start")
    app.keyed.delay(run, "handed", str(gate))
    wait_for(lambda: first("parked"), 60, "the second run to park")
    for _ in range(CONCURRENCY - 1):
        app.blocker.delay(run, str(gate))
    wait_for(lambda: first("start", "blocker"), 60, "the other slot to be taken")
    sent = time.monotonic()
    with app.app.producer_or_acquire() as producer:
        for i in range(backlog):
            app.plain.apply_async((run, i, seconds), producer=producer)
    send_seconds = time.monotonic() - sent
    gate.touch()
    limit = 120 + backlog * seconds * 5
    handed = wait_for(lambda: first("start", "handed"), limit, "the handed run to start")

    def plain_starts() -> list[dict[str, Any]]:
        return [e for e in events.of(run) if e["ev"] == "start" and e.get("role") == "plain"]

    wait_for(lambda: len(plain_starts()) >= backlog, limit, "the backlog to drain")
    released = first("released")
    assert released is not None
    starts = plain_starts()
    return {
        "backlog": backlog,
        "idle": round(handed["t"] - released["t"], 4),
        "plain_started_first": sum(1 for e in starts if e["t"] < handed["t"]),
        "drain_seconds": round(max((e["t"] for e in starts), default=released["t"]) - released["t"], 3),
        "send_seconds": round(send_seconds, 3),
    }


@contextlib.contextmanager
def broker(kind: str) -> Iterator[str]:
    from celery_mongolock.testing import RabbitMQServer, RedisServer

    server: Any = RedisServer() if kind == "redis" else RabbitMQServer()
    with server:
        yield str(server.url)


def run_broker(kind: str, args: argparse.Namespace, mongo_url: str, work_dir: Path) -> dict[str, Any]:
    rounds: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with broker(kind) as url:
        for lane in ("off", "on"):
            base = work_dir / f"{kind}-{lane}"
            events_dir, ready_dir = base / "events", base / "ready"
            events_dir.mkdir(parents=True)
            ready_dir.mkdir()
            env = {
                **os.environ,
                "HB_BROKER": url,
                "HB_MONGODB_URL": mongo_url,
                "HB_DB": f"hb_{kind}_{lane}_{uuid.uuid4().hex[:6]}",
                "HB_READY_DIR": str(ready_dir),
                "HB_EVENTS_DIR": str(events_dir),
                "HB_LANE": "1" if lane == "on" else "0",
                "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]),
            }
            os.environ.update({k: env[k] for k in ("HB_BROKER", "HB_MONGODB_URL", "HB_DB")})
            import handoff_backlog_app as app

            app.app.conf.update(broker_url=url, mongolock_url=mongo_url, mongolock_database=env["HB_DB"])
            node = Node(env, base, f"hb-{kind}-{lane}").start()
            try:
                events = Events(events_dir)
                for _ in range(args.rounds):
                    for size in args.backlogs:
                        figures = one_round(app, events, base, size, args.plain_seconds)
                        print(f"  {kind} lanes {lane}: {figures}", flush=True)
                        rounds[lane].append(figures)
            finally:
                node.stop()
            # Forget the broker connections (not closed: kombu would hand a closed pool out again): the
            # next broker is another server.
            app.app._pool = None
            app.app.amqp._producer_pool = None
    return {lane: summarize(rs, args.backlogs) for lane, rs in rounds.items()} | {"rounds": rounds}


def summarize(rounds: list[dict[str, Any]], sizes: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size in sizes:
        mine = [r for r in rounds if r["backlog"] == size]
        if mine:
            out[str(size)] = {
                "idle_median": round(statistics.median(r["idle"] for r in mine), 4),
                "idle_max": round(max(r["idle"] for r in mine), 4),
                "plain_started_first_max": max(r["plain_started_first"] for r in mine),
                "n": len(mine),
            }
    return out


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for kind, figures in result["brokers"].items():
        largest = str(max(result["backlogs"]))
        measured = figures["on"].get(largest, {}).get("idle_max")
        if measured is None:
            continue
        out.append(
            {
                "name": f"handoff idle with {largest} messages queued ahead, {kind} (max of the rounds)",
                "measured": f"{measured * 1000:.0f} ms",
                "target": f"at most {TARGET_IDLE * 1000:.0f} ms",
                "met": measured <= TARGET_IDLE,
                "by": f"{measured / TARGET_IDLE:.2f} of the target",
            }
        )
    return out


def summary_lines(result: dict[str, Any]) -> list[str]:
    lines = [
        f"handoff idle (release to the handed run's start), prefetch window {result['prefetch_window']}:"
    ]
    for kind, figures in result["brokers"].items():
        for size in result["backlogs"]:
            off, on = figures["off"].get(str(size), {}), figures["on"].get(str(size), {})
            lines.append(
                f"  {kind:8} backlog {size:>5}: lanes off {off.get('idle_median', 0) * 1000:8.0f} ms "
                f"({off.get('plain_started_first_max')} plain first), lanes on "
                f"{on.get('idle_median', 0) * 1000:6.0f} ms ({on.get('plain_started_first_max')} plain first)"
            )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="backlogs 0 and 1,000, one round")
    parser.add_argument("--brokers", default=None, help="redis,rabbitmq (default: those installed)")
    parser.add_argument("--backlogs", default=None, help="plain tasks queued ahead (default 0,1000,5000)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per backlog (default 3; quick 1)")
    parser.add_argument("--plain-seconds", type=float, default=0.002, help="each plain task's sleep")
    parser.add_argument("--mongo-url", default=None, help="a MongoDB (default: the embedded server)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    args.backlogs = [
        int(x) for x in (args.backlogs or ("0,1000" if args.quick else "0,1000,5000")).split(",")
    ]
    args.rounds = args.rounds or (1 if args.quick else 3)
    if args.brokers is None:
        from celery_mongolock.testing import rabbitmq_server_binary

        args.brokers = "redis,rabbitmq" if rabbitmq_server_binary() else "redis"
    args.brokers = [b for b in args.brokers.split(",") if b]
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "benchmark": "handoff_backlog",
        "machine": machine_info(),
        "backlogs": args.backlogs,
        "rounds": args.rounds,
        "plain_seconds": args.plain_seconds,
        "concurrency": CONCURRENCY,
        "prefetch_window": CONCURRENCY * PREFETCH_MULTIPLIER,
        "brokers": {},
    }
    with tempfile.TemporaryDirectory(prefix="hb-") as tmp, contextlib.ExitStack() as stack:
        mongo_url = args.mongo_url
        if not mongo_url:
            from celery_mongolock.embedded import EmbeddedMongo

            mongo_url = stack.enter_context(EmbeddedMongo()).url
        for kind in args.brokers:
            result["brokers"][kind] = run_broker(kind, args, mongo_url, Path(tmp))
    result["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    result["targets"] = targets(result)
    result["summary"] = summary_lines(result)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(result["summary"]))
    for t in result["targets"]:
        print(f"  {'met' if t['met'] else 'MISSED':>6}  {t['name']}: {t['measured']} (wanted {t['target']})")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
