#!/usr/bin/env python
"""Soak the lease lock: the lock-set checker of tests/lockcheck.py, run for longer with faults repeated.

    .venv/bin/python scripts/soak.py --duration 300 --seed 7 --json soak.json
    .venv/bin/python scripts/soak.py --bounded --seeds 10 --workdir /tmp/soak   # make test's run, 10 seeds
    .venv/bin/python scripts/soak.py --bounded --seeds 10 --broker rabbitmq     # the same on RabbitMQ
    .venv/bin/python scripts/soak.py --model --model-examples 2000 --seed 3    # the engine's model test

Bare LeaseStore clients and real Celery prefork workers do fenced read-modify-writes on protected
documents under their leases while holders are paused (SIGSTOP), worker children and whole nodes are
SIGKILLed, wall clocks jump (libfaketime: a bare client's, and a Celery node's with a queue of its own),
the MongoDB server is crashed and restarted on its data, and fail points drop connections, fail or hold
commands. ``limit=3`` runs share a key's slots and several-keys runs hold two keys at once, beside
single-key runs on the same keys. Afterwards the history checker looks for lost or doubled updates,
overlapping holds, more than N clean holds of a ``limit=N`` key at once, a several-keys body without all
of its keys, and fences going backwards. Prints the figures; exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import lockcheck  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/soak.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=300.0, help="seconds under faults (default 300)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the schedule and the clients (default 0)"
    )
    parser.add_argument("--clients", type=int, default=3, help="bare LeaseStore client processes (default 3)")
    parser.add_argument("--nodes", type=int, default=2, help="celery worker nodes, besides the skewed one")
    parser.add_argument("--keys", type=int, default=3, help="keys in use at a time (default 3)")
    parser.add_argument("--lease", type=float, default=2.0, help="lease seconds (default 2)")
    parser.add_argument(
        "--fault-interval", type=float, default=6.0, help="seconds between faults (default 6)"
    )
    parser.add_argument(
        "--faults",
        default=",".join(lockcheck.ALL_FAULTS),
        help="comma-separated faults to inject (default: all): " + ", ".join(lockcheck.ALL_FAULTS),
    )
    parser.add_argument(
        "--skewed-node",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run a Celery node whose wall clock jumps forward, with a queue of its own "
        "(default: on where libfaketime is installed)",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="run N seeds back to back (--seed, --seed+1, ...), one summary line each (default 1)",
    )
    parser.add_argument(
        "--bounded",
        action="store_true",
        help="the bounded run of make test (70 s, every fault once) instead of repeated faults; a seed "
        "passes only if it also exercised everything the test asserts (lockcheck.unmet_coverage)",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep logs and histories here (a subdirectory per seed with --seeds)",
    )
    parser.add_argument(
        "--broker",
        choices=("redis", "rabbitmq"),
        default="redis",
        help="the broker (default redis); rabbitmq needs rabbitmq-server installed, and excuses no loss",
    )
    parser.add_argument(
        "--rate-keys",
        type=int,
        default=0,
        help="keys of the rate-limited task (rate=RateLimit(2, 2)) in the workload (default 0: off)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    parser.add_argument(
        "--model",
        action="store_true",
        help="run the model-based test of the engine (tests/test_engine_model.py) from --seed instead",
    )
    parser.add_argument("--model-examples", type=int, default=1000, help="its examples (default 1000)")
    args = parser.parse_args(argv)
    if args.model:
        return run_model(args.seed, args.model_examples)
    faults = tuple(f for f in args.faults.split(",") if f)
    unknown = set(faults) - set(lockcheck.ALL_FAULTS)
    if unknown:
        parser.error(f"unknown faults: {', '.join(sorted(unknown))}")
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    reports = []
    for seed in range(args.seed, args.seed + args.seeds):
        workdir = args.workdir
        if workdir is not None and args.seeds > 1:
            workdir = workdir / f"seed-{seed}"
        if args.bounded:
            cfg = lockcheck.Config(
                duration=70.0,
                seed=seed,
                workdir=workdir,
                faults=faults,
                broker=args.broker,
                rate_keys=args.rate_keys,
            )
        else:
            cfg = lockcheck.Config(
                duration=args.duration,
                seed=seed,
                clients=args.clients,
                nodes=args.nodes,
                keys=args.keys,
                lease_seconds=args.lease,
                faults=faults,
                repeat_faults=True,
                fault_interval=args.fault_interval,
                workdir=workdir,
                skewed_node=args.skewed_node,
                broker=args.broker,
                rate_keys=args.rate_keys,
            )
        report = lockcheck.run(cfg)
        if args.bounded:  # what make test's run asserts it exercised (tests/test_lockcheck.py)
            report["unmet_coverage"] = lockcheck.unmet_coverage(report)
        print(lockcheck.format_report(report), file=sys.stderr)
        reports.append(report)
        if args.seeds > 1:
            print(summary_line(report), file=sys.stderr, flush=True)
    if args.seeds > 1:
        print("\nper seed:", file=sys.stderr)
        for report in reports:
            print(summary_line(report), file=sys.stderr)
        bad = sum(1 for r in reports if not passed(r))
        print(f"{len(reports) - bad} of {len(reports)} seeds passed", file=sys.stderr)
    text = json.dumps(reports[0] if len(reports) == 1 else reports, indent=2, default=str)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0 if all(passed(r) for r in reports) else 1


def run_model(seed: int, examples: int) -> int:
    """The model-based test of the engine for ``examples`` examples explored from ``seed`` (a failure
    prints its steps; the same seed and count run it again)."""
    env = {
        **os.environ,
        "MONGOLOCK_MODEL_EXAMPLES": str(examples),
        "MONGOLOCK_MODEL_SEED": str(seed),
        "MONGOLOCK_MODEL_STATS": "1",
    }
    test = "tests/test_engine_model.py::test_the_engine_matches_its_model"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-s",
        "-p",
        "no:cacheprovider",
        f"--hypothesis-seed={seed}",
        test,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode


def passed(report: dict[str, Any]) -> bool:
    """No violation, and (bounded runs) everything the run claims to exercise was exercised."""
    return not report["violations"] and not report.get("unmet_coverage")


def summary_line(report: dict[str, Any]) -> str:
    """One line per seed: violations, unfinished tasks, faults, the limit=N and several-keys figures,
    duration."""
    tasks, faults, lm = report["tasks"], report["faults"], report["limit_multi"]
    most = max(lm["max_clean_holds_at_once"].values(), default=0)
    lq, mq = report["queued"]["limit_queued"], report["queued"]["multi_queued"]
    return (
        f"seed {report['seed']} ({report.get('broker', 'redis')}): violations {report['violations']}, "
        f"unmet coverage {report.get('unmet_coverage', 'not checked')}, unfinished {tasks['unfinished']} "
        f"(lost by the broker {tasks['lost_by_broker']}), tasks {tasks['submitted']}, "
        f"faults {sum(faults.values())}, limit holds {lm['limit_holds']} (most clean at once {most} of "
        f"{lm['limit']}), several-keys bodies {lm['multi_bodies']}, Queue limit runs {lq['submitted']} "
        f"(parked {lq['parked']}, handed {lq['handed']}), Queue several-keys runs {mq['submitted']} "
        f"(parked {mq['parked']}, handed {mq['handed']}), nodes that exited "
        f"{len(report.get('node_exits') or [])} or stalled {len(report.get('node_stalls') or [])} "
        f"(replaced), {report['duration_s']} s "
        f"(drain {report.get('drain_s')} s), workdir {report.get('workdir')}"
    )


if __name__ == "__main__":
    sys.exit(main())
