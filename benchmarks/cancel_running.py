"""Benchmark of ``Replace(cancel_running=True, grace=...)``: how soon a newer send stops the running holder.

Run it from the repository root::

    .venv/bin/python benchmarks/cancel_running.py            # full run (about 2 minutes)
    .venv/bin/python benchmarks/cancel_running.py --quick    # about 1 minute

Two real ``celery worker`` nodes (prefork, concurrency 1; ``recovery_app``) share a Redis broker and the
lease store: node 1 runs the holder of a key, node 2 the newer send of the same key. Per round:

* **terminated**: the holder (``rec.cancel_deaf``) never looks; the newer send has its child terminated
  after ``grace`` seconds. Measured: from the newer send to the newest run's body starting (target: within
  grace + 1 s, every round);
* **cooperative**: the holder (``rec.cancel_polite``) polls ``raise_if_superseded()`` every 10 ms.
  Measured: from the newer send to the holder noticing (target: under 1 s, every round), and to the
  newest run's start.

Times are ``time.monotonic()`` in every process (one clock on the machine). Writes JSON
(``benchmarks/results/cancel_running.json``) with a ``targets`` list that ``run.py`` puts in the report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = HERE / "results" / "cancel_running.json"
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from recovery import URL_ENV, Events, Node, machine_info, server_info, servers, stats  # noqa: E402

TARGET_SLACK = 1.0  # the newest run starts within grace + this of its send
TARGET_NOTICE = 1.0  # a cooperative holder notices within this of the newer send


def one_round(app: Any, events: Events, kind: str, grace: float) -> dict[str, float]:
    run = uuid.uuid4().hex[:12]
    key = f"cx-{kind}-{run}"
    task = app.cancel_deaf if kind == "terminated" else app.cancel_polite
    task.apply_async((run, key, "A", 120.0), queue="rec.cx.holder")
    events.wait("start", run, "A", 60)
    sent = time.monotonic()
    task.apply_async((run, key, "B", 0.0), queue="rec.cx.newer")
    started = events.wait("start", run, "B", grace + 120)["t"] - sent
    out = {"newest_started_s": started}
    if kind == "cooperative":
        out["noticed_s"] = events.wait("noticed", run, "A", 60)["t"] - sent
    return out


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    grace = result["parameters"]["grace_s"]
    worst_start = result["terminated"]["newest_started"].get("max_s")
    worst_notice = result["cooperative"]["noticed"].get("max_s")
    out = []
    for name, wanted, measured, limit in (
        ("cancel_running: newest run starts after its send (max)", f"grace + {TARGET_SLACK:g} s",
         worst_start, grace + TARGET_SLACK),
        ("cancel_running: a cooperative holder notices the newer send (max)", f"{TARGET_NOTICE:g} s",
         worst_notice, TARGET_NOTICE),
    ):  # fmt: skip
        if measured is None:
            out.append({"name": name, "target": wanted, "measured": "n/a", "met": None, "by": "not measured"})
            continue
        out.append(
            {
                "name": name,
                "target": wanted,
                "measured": round(measured, 3),
                "met": measured <= limit,
                "by": f"{measured - limit:+.2f} s against the limit",
            }
        )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    machine = machine_info()
    work_dir = Path(tempfile.mkdtemp(prefix="mongolock-bench-cx-"))
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
            "REC_LEASE_SECONDS": "5",
            "REC_CANCEL_GRACE": f"{args.grace:g}",
        }
        os.environ.update({k: env[k] for k in env if k.startswith("REC_") and k != "REC_EVENTS_DIR"})
        import recovery_app as app_module

        server = {"kind": srv["mongo_kind"], **server_info(srv["mongo_url"])}
        nodes = [Node(name, f"rec.cx.{name}", env, work_dir).start() for name in ("holder", "newer")]
        events = Events(events_dir)
        figures: dict[str, list[dict[str, float]]] = {"terminated": [], "cooperative": []}
        try:
            for rep in range(args.reps):
                for kind, rounds in figures.items():
                    r = one_round(app_module, events, kind, args.grace)
                    rounds.append(r)
                    print(
                        f"  {kind} #{rep + 1}: {json.dumps({k: round(v, 3) for k, v in r.items()})}",
                        flush=True,
                    )
        finally:
            for node in nodes:
                node.stop()
    result: dict[str, Any] = {
        "benchmark": "cancel_running",
        "machine": machine,
        "server": server,
        "parameters": {"grace_s": args.grace, "reps": args.reps, "quick": args.quick},
        "terminated": {"newest_started": stats([r["newest_started_s"] for r in figures["terminated"]])},
        "cooperative": {
            "noticed": stats([r["noticed_s"] for r in figures["cooperative"]]),
            "newest_started": stats([r["newest_started_s"] for r in figures["cooperative"]]),
        },
        "seconds": round(time.perf_counter() - started, 1),
    }
    result["targets"] = targets(result)
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--mongo-url", default=os.environ.get(URL_ENV) or None, help="MongoDB to use")
    parser.add_argument("--reps", type=int, default=None, help="rounds of each kind (8; 3 quick)")
    parser.add_argument("--grace", type=float, default=2.0, help="the holder's grace, seconds (2)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args = parser.parse_args(argv)
    if args.reps is None:
        args.reps = 3 if args.quick else 8
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for t in result["targets"]:
        print(f"{t['name']}: {t['measured']} (target {t['target']}): {'met' if t['met'] else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
