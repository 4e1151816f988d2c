"""Benchmark of ``unique_send``: MongoDB round trips and latency per send, with it off and on.

Run it from the repository root (after ``make venv``)::

    .venv/bin/python benchmarks/unique_send.py              # embedded server (about half a minute)
    .venv/bin/python benchmarks/unique_send.py --quick
    .venv/bin/python benchmarks/unique_send.py --mongo-url mongodb://host:27017/

One Celery app (an in-memory broker: the publish costs the same in every variant, and no broker's own
latency hides the difference), with a pymongo ``CommandListener`` on the lease store's client, sends
``apply_async`` of three tasks of one signature, in interleaved rounds:

* ``off``: ``@singleton_task`` without ``unique_send`` (the default), distinct arguments;
* ``on_new``: ``unique_send=True``, distinct arguments (each send is new: it claims a record, publishes);
* ``on_equal``: ``unique_send=True``, the same arguments as a pending send (answered with that run,
  nothing published).

Output: commands per send by name, messages published per send, and the median and p95 latency of one
send per variant. JSON (``benchmarks/results/unique_send.json`` by default) with a Markdown ``summary``
that ``run.py`` puts in its report.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import after_task_publish
from history import mongo_url  # the same choice of server as history.py (benchmarks/ is on the path)
from pymongo import MongoClient
from pymongo.monitoring import CommandFailedEvent, CommandListener, CommandStartedEvent, CommandSucceededEvent

from celery_mongolock import LeaseStore, singleton_task

Document = dict[str, Any]
URL_ENV = "MONGOLOCK_TEST_MONGODB_URL"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "unique_send.json"
IGNORED = frozenset({"hello", "isMaster", "ismaster", "endSessions", "ping", "buildInfo", "saslStart"})
VARIANTS = ("off", "on_new", "on_equal")


class Counting(CommandListener):
    def __init__(self) -> None:
        self.commands: Counter[str] = Counter()

    def started(self, event: CommandStartedEvent) -> None:
        if event.command_name not in IGNORED:
            self.commands[event.command_name] += 1

    def succeeded(self, event: CommandSucceededEvent) -> None:
        pass

    def failed(self, event: CommandFailedEvent) -> None:
        pass


def _app(url: str, database: str, counter: Counting) -> tuple[Celery, dict[str, Any], MongoClient[Document]]:
    app = Celery("bench_unique_send", set_as_current=False)
    app.conf.update(broker_url="memory://", mongolock_url=url, mongolock_database=database)
    client: MongoClient[Document] = MongoClient(url, event_listeners=[counter], tz_aware=True)
    app._mongolock_store = LeaseStore(client, database=database)

    def body(group_id: int, upload: str) -> None: ...

    tasks = {
        "off": singleton_task(key="group:{group_id}", app=app, name="bench.off")(body),
        "on_new": singleton_task(key="group:{group_id}", app=app, name="bench.on", unique_send=True)(body),
    }
    tasks["on_equal"] = tasks["on_new"]
    return app, tasks, client


def run(args: argparse.Namespace) -> dict[str, Any]:
    logging.getLogger("celery_mongolock").setLevel(logging.ERROR)
    database = f"bench_unique_{uuid.uuid4().hex[:8]}"
    published = Counter[str]()
    current = {"variant": ""}

    def on_publish(**_: Any) -> None:
        published[current["variant"]] += 1

    after_task_publish.connect(on_publish, weak=False)
    with mongo_url(args.mongo_url) as (url, kind):
        counter = Counting()
        app, tasks, client = _app(url, database, counter)
        try:
            tasks["on_new"].delay(0, "warm-up")  # connections, the sends collection's indexes
            tasks["on_equal"].delay(-1, "pending")  # the pending send the equal sends are answered with
            tasks["off"].delay(0, "warm-up")
            counts: dict[str, Counter[str]] = {v: Counter() for v in VARIANTS}
            samples: dict[str, list[int]] = {v: [] for v in VARIANTS}
            published.clear()
            sends = 0
            for r in range(args.rounds):
                for variant in VARIANTS if r % 2 == 0 else reversed(VARIANTS):
                    current["variant"] = variant
                    task = tasks[variant]
                    for i in range(args.sends):
                        call = (-1, "pending") if variant == "on_equal" else (r * args.sends + i, variant)
                        counter.commands.clear()
                        t0 = time.perf_counter_ns()
                        task.delay(*call)
                        samples[variant].append(time.perf_counter_ns() - t0)
                        counts[variant].update(counter.commands)
                sends += args.sends
        finally:
            after_task_publish.disconnect(on_publish)
            app._mongolock_store.close()
            client.drop_database(database)
            client.close()
    variants: dict[str, Any] = {}
    for variant in VARIANTS:
        us = sorted(s / 1000.0 for s in samples[variant])
        variants[variant] = {
            "sends": sends,
            "commands_per_send": {k: round(n / sends, 4) for k, n in sorted(counts[variant].items())},
            "round_trips_per_send": round(sum(counts[variant].values()) / sends, 4),
            "published_per_send": round(published[variant] / sends, 4),
            "median_us": round(statistics.median(us), 1),
            "p95_us": round(us[int(len(us) * 0.95) - 1], 1),
        }
    off, new, equal = (variants[v] for v in VARIANTS)
    summary = [
        f"MongoDB round trips per send: off {off['round_trips_per_send']:g}, on (a new send) "
        f"{new['round_trips_per_send']:g}, on (an equal pending send) {equal['round_trips_per_send']:g}",
        f"messages published per send: off {off['published_per_send']:g}, on (new) "
        f"{new['published_per_send']:g}, on (equal) {equal['published_per_send']:g}",
        f"latency of one send, median (p95): off {off['median_us']:g} us ({off['p95_us']:g}), on (new) "
        f"{new['median_us']:g} us ({new['p95_us']:g}), on (equal) {equal['median_us']:g} us "
        f"({equal['p95_us']:g}); {sends} sends per variant in {args.rounds} interleaved rounds, on {kind}",
    ]
    return {
        "server": kind,
        "rounds": args.rounds,
        "sends_per_round": args.sends,
        "variants": variants,
        "summary": summary,
        "machine": {"cpu_count": os.cpu_count(), "python": sys.version.split()[0]},
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--mongo-url", default=os.environ.get(URL_ENV) or None, help="MongoDB to use")
    parser.add_argument("--sends", type=int, default=None, help="sends per variant and round (100; 30 quick)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (10; 4 quick)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    args.sends = args.sends or (30 if args.quick else 100)
    args.rounds = args.rounds or (4 if args.quick else 10)
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
