"""Benchmark of ``Replace(debounce=d)`` and its ceiling ``max_wait=m``, with a real prefork worker.

Run it from the repository root (after ``make venv``)::

    .venv/bin/python benchmarks/debounce.py            # 40 s of sends per case (about 3 minutes)
    .venv/bin/python benchmarks/debounce.py --quick    # 15 s per case
    .venv/bin/python benchmarks/debounce.py --mongo-url mongodb://host:27017/

A prefork ``celery worker`` of ``debounce_app.py`` (Redis broker, the embedded MongoDB-compatible server by
default, ``--concurrency`` processes) runs the tasks; each body records its start. Three measures:

1. **A burst runs once** (issue 30 item 6): ``--burst`` sends of one key at once under
   ``Replace(debounce=d)``: how many bodies ran (target: 1, the newest send's), and when, after the last
   send. While the burst waits out its debounce, plain tasks sent one per process are timed from send to
   start: a debouncing run holds no worker slot, so they start at once (target: well under ``d``).
2. **A key that keeps receiving sends still runs by its ceiling** (issue 30 item 4): a send every
   ``--every`` s (less than ``d``: without the ceiling no run would start while they come) for
   ``--duration`` s under ``Replace(debounce=d, max_wait=m)``: the starts while the sends went on, and the
   longest time without a start (from the first send; target: at most ``m`` + 1 s).
3. The same for **a set of two keys** (``keys=``, named in both orders).

Output: JSON (``benchmarks/results/debounce.json`` by default) with a Markdown ``summary`` that ``run.py``
puts in its report.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pymongo import MongoClient

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from limits import mongo_url, worker_on_redis  # noqa: E402  (this folder's shared parts)

URL_ENV = "MONGOLOCK_TEST_MONGODB_URL"
DEFAULT_OUT = HERE / "results" / "debounce.json"
#: How far past the ceiling a start may come and still meet the target (a delayed copy's countdown, the
#: broker's delivery, one admit per key).
SLACK_S = 1.0


def _wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.1)


def burst_once(app: Any, starts: Any, args: argparse.Namespace) -> dict[str, Any]:
    doc, kind = uuid.uuid4().hex[:8], "burst"
    for i in range(args.burst):
        app.debounced.delay(doc, kind, i)
    last_send = time.time()
    plain_sent = []
    for j in range(args.concurrency):  # while the burst waits out its debounce
        plain_sent.append(time.time())
        app.plain.delay("plain", j)
    _wait_for(lambda: starts.count_documents({"kind": "plain"}) >= args.concurrency, 60, "the plain tasks")
    _wait_for(lambda: starts.count_documents({"kind": kind}) >= 1, 60 + args.debounce, "the burst's run")
    time.sleep(args.debounce + 2 * SLACK_S)  # (any second run of the burst would have started by now)
    runs = list(starts.find({"kind": kind}))
    plain_starts = sorted(d["at"] for d in starts.find({"kind": "plain"}))
    return {
        "sends": args.burst,
        "bodies": len(runs),
        "ran_the_newest": [d["i"] for d in runs] == [args.burst - 1],
        "start_after_last_send_s": round(min(d["at"] for d in runs) - last_send, 3),
        "plain_task_start_after_send_s": [
            round(at - sent, 3) for at, sent in zip(plain_starts, plain_sent, strict=False)
        ],
    }


def keep_sending(
    send: Callable[[int], None], starts: Any, kind: str, args: argparse.Namespace
) -> dict[str, Any]:
    first = time.time()
    i = 0
    while time.time() - first < args.duration:
        send(i)
        i += 1
        time.sleep(args.every)
    last = time.time()
    time.sleep(args.debounce + 2 * SLACK_S)  # the newest send's own run
    times = sorted(d["at"] for d in starts.find({"kind": kind}))
    during = [t for t in times if t <= last]
    marks = [first, *during, last]
    gaps = [b - a for a, b in itertools.pairwise(marks)]
    return {
        "sends": i,
        "send_every_s": args.every,
        "starts_while_sending": len(during),
        "first_start_after_first_send_s": round(during[0] - first, 3) if during else None,
        "longest_without_a_start_s": round(max(gaps), 3),
        "starts_by_the_end": len(times),
    }


def measure(args: argparse.Namespace, url: str, database: str) -> dict[str, Any]:
    settings = {"BENCH_DEBOUNCE": str(args.debounce), "BENCH_MAX_WAIT": str(args.max_wait)}
    with worker_on_redis("debounce_app", url, database, args.concurrency, settings) as (app, worker, client):
        starts = client[database]["starts"]
        try:
            burst = burst_once(app, starts, args)
            doc = uuid.uuid4().hex[:8]
            one = keep_sending(lambda i: app.capped.delay(doc, "one", i), starts, "one", args)
            a, b = uuid.uuid4().hex[:8], uuid.uuid4().hex[:8]

            def pair(i: int) -> None:
                app.capped_pair.delay(*((a, b) if i % 2 else (b, a)), "pair", i)

            two = keep_sending(pair, starts, "pair", args)
        except Exception as exc:
            raise RuntimeError(f"{exc}\n{worker.log_tail()}") from exc
    return {"burst": burst, "one_key": one, "set_of_keys": two}


def summary_lines(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    b, target = result["burst"], args.max_wait + SLACK_S
    plain = b["plain_task_start_after_send_s"]
    lines = [
        f"`Replace(debounce={args.debounce:g})`, a burst of {b['sends']} sends of one key at once: "
        f"**{b['bodies']} body** ran "
        f"({'the newest send' if b['ran_the_newest'] else 'not only the newest'}), "
        f"{b['start_after_last_send_s']:.2f} s after the last send (target: 1 body: "
        f"{'met' if b['bodies'] == 1 and b['ran_the_newest'] else 'missed'}); while it waited, "
        f"{len(plain)} plain tasks (one per worker process) started {min(plain):.3f} to {max(plain):.3f} s "
        f"after their send: the debouncing runs held no worker slot "
        f"({'met' if max(plain) < args.debounce else 'missed'}).",
    ]
    for title, r in (("one key", result["one_key"]), ("a set of two keys", result["set_of_keys"])):
        met = r["starts_while_sending"] >= 1 and r["longest_without_a_start_s"] <= target
        lines.append(
            f"`Replace(debounce={args.debounce:g}, max_wait={args.max_wait:g})`, {title}, a send every "
            f"{r['send_every_s']:g} s for {args.duration:g} s ({r['sends']} sends): "
            f"**{r['starts_while_sending']} starts** while they went on (the first "
            f"{r['first_start_after_first_send_s']} s after the first send), the longest time without a "
            f"start **{r['longest_without_a_start_s']:.2f} s** "
            f"(target: at most max_wait + {SLACK_S:g} s = {target:g} s: {'met' if met else 'missed'})."
        )
    return lines


def run(args: argparse.Namespace) -> dict[str, Any]:
    logging.getLogger("celery_mongolock").setLevel(logging.ERROR)
    started = time.perf_counter()
    database = f"mongolock_bench_debounce_{uuid.uuid4().hex[:8]}"
    with mongo_url(args.mongo_url) as (url, kind, _embedded):
        try:
            figures = measure(args, url, database)
        finally:
            with MongoClient(url) as c:
                c.drop_database(database)
    keys = ("debounce", "max_wait", "every", "duration", "burst", "concurrency")
    return {
        "benchmark": "debounce",
        "server": {"kind": kind},
        "quick": args.quick,
        "parameters": {k: getattr(args, k) for k in keys},
        **figures,
        "summary": summary_lines(figures, args),
        "machine": {
            "cpu_count": os.cpu_count(),
            "python": sys.version.split()[0],
            "load_average_1m_at_end": round(os.getloadavg()[0], 1),
        },
        "duration_seconds": round(time.perf_counter() - started, 1),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--mongo-url", default=os.environ.get(URL_ENV) or None, help="MongoDB to use")
    parser.add_argument("--debounce", type=float, default=1.0, help="seconds (1)")
    parser.add_argument("--max-wait", type=float, default=3.0, help="the ceiling, seconds (3)")
    parser.add_argument("--every", type=float, default=0.25, help="seconds between sends (0.25)")
    parser.add_argument("--duration", type=float, default=None, help="seconds of sends (40; 15 quick)")
    parser.add_argument("--burst", type=int, default=20, help="sends of the burst (20)")
    parser.add_argument("--concurrency", type=int, default=2, help="pool processes (2)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    args.duration = args.duration or (15.0 if args.quick else 40.0)
    if args.every >= args.debounce:
        parser.error("--every must be less than --debounce: sends that come less often end each burst")
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
