"""Benchmark of a key's queue at depth: park and handoff on one key with 100 to 100,000 runs parked on it
(issue 28, items 1 and 6: "park and handoff at 100,000 within 1.5x of 100").

Run it from the repository root (after ``make venv``)::

    .venv/bin/python benchmarks/parked_depth.py                       # about 3 minutes
    .venv/bin/python benchmarks/parked_depth.py --sizes 100,10000 --samples 5
    .venv/bin/python benchmarks/parked_depth.py --limit 2     # a limit=2 key (parked_depth_limit.json)
    .venv/bin/python benchmarks/parked_depth.py --several     # runs of two keys (parked_depth_keys.json)

The lease store alone on the embedded server (or ``--mongo-url``), as ``contention.py``'s store part
(``contention.parked_store``): each size's queue is filled as parking leaves it (the key's window of
runs in its lease document, the rest spilled to ``<collection>.parked``), then ``--samples`` parks and
handoffs (a release that hands the key over, and the handed run's claim) are timed; a handoff's
refill of the window (every half window) is among them. Medians, p95 and max per size; the MongoDB
commands sent; the lease document's size.

Writes JSON (``benchmarks/results/parked_depth.json``) with a ``targets`` list.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import contention  # noqa: E402

DEFAULT_OUT = HERE / "results" / "parked_depth.json"
#: Park and handoff at the deepest size, at most this many times their cost at the shallowest (issue 28).
TARGET_RATIO = 1.5


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    sizes = result["sizes"]
    lo, hi = min(sizes, key=int), max(sizes, key=int)
    out = []
    for what in ("park", "handoff"):
        ratio = sizes[hi][what]["median"] / sizes[lo][what]["median"]
        out.append(
            {
                "name": f"{what} with {int(hi):,} runs parked on one key over {int(lo):,} (medians)",
                "measured": f"{ratio:.2f}x ({sizes[hi][what]['median'] * 1000:.1f} ms over "
                f"{sizes[lo][what]['median'] * 1000:.1f} ms)",
                "target": f"at most {TARGET_RATIO}x",
                "met": ratio <= TARGET_RATIO,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mongo-url", default=None, help="MongoDB to use (default: an embedded server)")
    parser.add_argument("--sizes", default="100,1000,10000,100000", help="runs parked on the key")
    parser.add_argument("--samples", type=int, default=20, help="parks and handoffs timed per size")
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--limit", type=int, default=None, help="a limit=N key, all its slots held")
    parser.add_argument(
        "--several", action="store_true", help="Queue runs of two keys (keys=) waiting on the key"
    )
    parser.add_argument("--out", type=Path, default=None, help=f"JSON output (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if args.out is None:
        name = "parked_depth.json" if args.limit is None else "parked_depth_limit.json"
        args.out = (
            DEFAULT_OUT.with_name("parked_depth_keys.json") if args.several else DEFAULT_OUT.with_name(name)
        )
    sizes = sorted({int(s) for s in args.sizes.split(",") if int(s) > 0})
    if len(sizes) < 2 or args.samples < 1:
        parser.error("--sizes needs two sizes at least, --samples at least 1")
    server = None
    url = args.mongo_url
    if url is None:
        from celery_mongolock.embedded import EmbeddedMongo

        server = EmbeddedMongo().start()
        url = server.url
    try:
        result = contention.parked_store(
            url, "bench_parked_depth", sizes, args.samples, args.seed, limit=args.limit, several=args.several
        )
    finally:
        if server is not None:
            server.stop()
    result["samples"] = args.samples
    result["limit"] = args.limit
    result["several_keys"] = args.several
    result["targets"] = targets(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    for t in result["targets"]:
        print(f"{t['name']}: {t['measured']} (target {t['target']}: {'met' if t['met'] else 'MISSED'})")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
