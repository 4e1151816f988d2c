#!/usr/bin/env python
"""Soak the lease lock: the lock-set checker of tests/lockcheck.py, run for longer with faults repeated.

    .venv/bin/python scripts/soak.py --duration 300 --seed 7 --json soak.json

Bare LeaseStore clients and real Celery prefork workers do fenced read-modify-writes on protected
documents under their leases while holders are paused (SIGSTOP), worker children and whole nodes are
SIGKILLed, wall clocks jump (libfaketime: a bare client's, and a Celery node's with a queue of its own),
the MongoDB server is crashed and restarted on its data, and fail points drop connections, fail or hold
commands. Afterwards the history checker looks for lost or doubled updates, overlapping holds and fences
going backwards. Prints the figures; exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs and histories here")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    faults = tuple(f for f in args.faults.split(",") if f)
    unknown = set(faults) - set(lockcheck.ALL_FAULTS)
    if unknown:
        parser.error(f"unknown faults: {', '.join(sorted(unknown))}")
    cfg = lockcheck.Config(
        duration=args.duration,
        seed=args.seed,
        clients=args.clients,
        nodes=args.nodes,
        keys=args.keys,
        lease_seconds=args.lease,
        faults=faults,
        repeat_faults=True,
        fault_interval=args.fault_interval,
        workdir=args.workdir,
        skewed_node=args.skewed_node,
    )
    report = lockcheck.run(cfg)
    print(lockcheck.format_report(report), file=sys.stderr)
    text = json.dumps(report, indent=2, default=str)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
