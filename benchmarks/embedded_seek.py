"""Benchmark of opening a change stream at an operation time on the embedded server, by oplog size.

Run it from the repository root (after ``make venv``)::

    .venv/bin/python benchmarks/embedded_seek.py                  # about a minute
    .venv/bin/python benchmarks/embedded_seek.py --sizes 1000,5000 --quick

SecantusDB 0.7 finds where a stream opened with ``startAtOperationTime`` begins by decoding its whole
oplog (up to 100,000 entries, an hour) under the lock every other command needs; the lease watcher opens
such a stream for each new batch of leases. ``EmbeddedMongo`` starts the server with that search done by
bisection (``server_patches.SEEK``). This starts the server both ways (``tuned``: as ``EmbeddedMongo``
does; ``as-shipped``: without ``SEEK``), writes documents until the oplog holds each of ``--sizes``
entries, and times the opening of a stream at the time of the last write (the median of ``--opens``).

Output: JSON (``benchmarks/results/embedded_seek.json`` by default) with a Markdown ``summary``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from embedded_common import RESULTS, as_shipped, embedded, server_patches, variants_table, write_results
from pymongo import MongoClient

TARGET = "opening a stream at the largest size within 5x of the smallest (tuned)"


def measure(server_cls: type[embedded.EmbeddedMongo], sizes: list[int], opens: int) -> list[float]:
    """Median time (ms) to open a stream at the last write's operation time, at each oplog size."""
    medians: list[float] = []
    with server_cls() as server:
        client: Any = MongoClient(server.url)
        coll = client["bench"]["w"]
        written = 0
        for size in sizes:
            while written < size:
                batch = min(1_000, size - written)
                coll.insert_many([{"_id": written + i} for i in range(batch)])
                written += batch
            with client.start_session() as session:
                coll.update_one({"_id": 0}, {"$set": {"at": written}}, session=session)
                at = session.operation_time
            times: list[float] = []
            for _ in range(opens):
                t0 = time.perf_counter()
                with coll.watch(start_at_operation_time=at, max_await_time_ms=1) as stream:
                    stream.try_next()
                times.append((time.perf_counter() - t0) * 1000)
            medians.append(round(statistics.median(times), 2))
        client.close()
    return medians


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,40000", help="oplog sizes, comma-separated")
    parser.add_argument("--opens", type=int, default=5, help="stream openings timed at each size")
    parser.add_argument("--quick", action="store_true", help="the tuned variant only")
    parser.add_argument("--out", default=str(RESULTS / "embedded_seek.json"))
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    variants: dict[str, list[float]] = {"tuned": measure(embedded.EmbeddedMongo, sizes, args.opens)}
    if not args.quick:
        variants["as-shipped"] = measure(as_shipped(server_patches.SEEK), sizes, args.opens)
    tuned = variants["tuned"]
    met = bool(tuned) and tuned[-1] <= 5 * max(tuned[0], 1.0)
    data = {
        "sizes": sizes,
        "opens": args.opens,
        "median_ms_per_size": variants,
        "summary": variants_table(
            "oplog entries", [(f"{size:,}", i) for i, size in enumerate(sizes)], variants
        ),
    }
    write_results("embedded_seek", args.out, data, TARGET, met)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
