"""Benchmark of the embedded server's write latency as its record of retryable writes fills up.

Run it from the repository root (after ``make venv``)::

    .venv/bin/python benchmarks/embedded_retryable.py             # about two minutes
    .venv/bin/python benchmarks/embedded_retryable.py --writes 4000 --quick

SecantusDB 0.7 keeps the replies of its last 10,000 retryable writes (pymongo makes every write
retryable) and prunes them on each one: a scan of all of them, and once there are 10,000, a sort of all of
them. ``EmbeddedMongo`` starts the server with that pruning done in bulk (``server_patches.TUNE``). This
starts the server both ways (``tuned``: as ``EmbeddedMongo`` does; ``as-shipped``: SecantusDB's own
pruning) and times ``--writes`` single-document updates, one client, one at a time, reporting the median
latency of each block of 1,000 writes: flat when tuned, rising with the record count as shipped.

Output: JSON (``benchmarks/results/embedded_retryable.json`` by default) with a Markdown ``summary``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from embedded_common import RESULTS, as_shipped, embedded, server_patches, write_results
from pymongo import MongoClient

TARGET = "the median write of the last block within 2x of the first block's (tuned)"


def measure(server_cls: type[embedded.EmbeddedMongo], writes: int, block: int) -> list[float]:
    """Median latency (ms) of each block of ``block`` updates."""
    with server_cls() as server:
        client: Any = MongoClient(server.url)
        coll = client["bench"]["w"]
        coll.insert_one({"_id": 1, "n": 0})
        medians: list[float] = []
        times: list[float] = []
        for i in range(writes):
            t0 = time.perf_counter()
            coll.update_one({"_id": 1}, {"$inc": {"n": 1}})
            times.append((time.perf_counter() - t0) * 1000)
            if (i + 1) % block == 0:
                medians.append(round(statistics.median(times), 3))
                times = []
        client.close()
    return medians


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writes", type=int, default=14_000, help="updates per variant (default 14,000)")
    parser.add_argument("--block", type=int, default=1_000)
    parser.add_argument("--quick", action="store_true", help="the tuned variant only")
    parser.add_argument("--out", default=str(RESULTS / "embedded_retryable.json"))
    args = parser.parse_args(argv)
    variants: dict[str, list[float]] = {"tuned": measure(embedded.EmbeddedMongo, args.writes, args.block)}
    if not args.quick:
        variants["as-shipped"] = measure(as_shipped(server_patches.TUNE), args.writes, args.block)
    tuned = variants["tuned"]
    met = bool(tuned) and tuned[-1] <= 2 * tuned[0]
    lines = ["| block of writes | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
    for b in range(len(tuned)):
        row = [f"{variants[v][b]:.2f} ms" if b < len(variants[v]) else "" for v in variants]
        lines.append(f"| {b * args.block + 1}-{(b + 1) * args.block} | " + " | ".join(row) + " |")
    data = {
        "writes": args.writes,
        "block": args.block,
        "median_ms_per_block": variants,
        "summary": "\n".join(lines),
    }
    write_results("embedded_retryable", args.out, data, TARGET, met)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
