"""Benchmark of the embedded server's time for the library's own commands: park, handoff and the
sweeper's list on a key with runs parked, as SecantusDB ships and as ``EmbeddedMongo`` starts it
(``server_patches.COPY``, ``PLAN``, ``ZONE``).

Run it from the repository root (after ``make venv``)::

    .venv/bin/python benchmarks/embedded_copy.py                  # about a minute
    .venv/bin/python benchmarks/embedded_copy.py --samples 10 --quick

SecantusDB 0.7's ``$set``/``$addFields``, exclusion ``$project`` and ``$unset`` stages deep-copy each
whole document before changing a few of its fields, once per stage. The library's park, release and
claim are update pipelines of several such stages over a lease document that carries the key's window of
parked runs (their messages included), and the sweeper's list is an aggregation of two such stages over
every key with parked runs. A conditional write (``{"_id": key, "$or": [...]}``) scanned the whole
collection, and every pipeline was walked in Python for date operators before it ran.
``celery_mongolock.ops.embedded`` starts the server with stages that copy a document's top level and the
containers on the paths they change only (``COPY``), such filters planned on their plain fields
(``PLAN``) and the walk done only for a stage whose BSON names a date operator (``ZONE``). This starts
the server both ways (``tuned``: as ``EmbeddedMongo`` does; ``as-shipped``: without those three) and runs
``contention.parked_store`` (the lease store alone, as ``parked_depth.py``) at ``--sizes`` parked runs:
the medians of park, handoff (release and claim) and the sweeper's list, beside ``--other-keys`` idle
lease documents.

Output: JSON (``benchmarks/results/embedded_copy.json`` by default) with a Markdown ``summary``.
"""

from __future__ import annotations

import argparse
from typing import Any

import contention
from embedded_common import RESULTS, as_shipped, embedded, server_patches, write_results
from pymongo import MongoClient

TARGET = "park and handoff at the largest size at least 1.2x as fast as as-shipped (tuned)"
MEASURES = ("park", "handoff", "sweeper_waiting_keys")
#: The launch patches this measures (``as-shipped``: without them).
PATCHES = (server_patches.COPY, server_patches.PLAN, server_patches.ZONE)


def measure(
    server_cls: type[embedded.EmbeddedMongo], sizes: list[int], samples: int, other_keys: int
) -> dict[str, Any]:
    """Median ms of each of ``MEASURES`` at each size, beside ``other_keys`` idle lease documents."""
    with server_cls() as server:
        client: Any = MongoClient(server.url)
        others = [
            {"_id": f"idle:{i}", "fence": i, "ends": [{"o": f"{i}-{n}", "how": "released"} for n in range(8)]}
            for i in range(other_keys)
        ]
        if others:
            client["bench_copy"]["parked"].insert_many(others)
        client.close()
        out = contention.parked_store(server.url, "bench_copy", sizes, samples, seed=1)
    return {
        str(size): {m: round(out["sizes"][str(size)][m]["median"] * 1000, 2) for m in MEASURES}
        for size in sizes
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,100,1000", help="runs parked on the key, comma-separated")
    parser.add_argument("--samples", type=int, default=20, help="parks and handoffs timed at each size")
    parser.add_argument("--other-keys", type=int, default=200, help="idle lease documents beside (200)")
    parser.add_argument("--quick", action="store_true", help="the tuned variant only")
    parser.add_argument("--out", default=str(RESULTS / "embedded_copy.json"))
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    variants = {"tuned": measure(embedded.EmbeddedMongo, sizes, args.samples, args.other_keys)}
    if not args.quick:
        variants["as-shipped"] = measure(as_shipped(*PATCHES), sizes, args.samples, args.other_keys)
    top = str(sizes[-1])
    shipped = variants.get("as-shipped")
    met = shipped is not None and all(
        variants["tuned"][top][m] * 1.2 <= shipped[top][m] for m in ("park", "handoff")
    )
    lines = ["| parked | measure | " + " | ".join(variants) + " |", "|---|---|" + "---|" * len(variants)]
    for size in sizes:
        for m in MEASURES:
            row = " | ".join(f"{variants[v][str(size)][m]:.1f} ms" for v in variants)
            lines.append(f"| {size:,} | {m.replace('_', ' ')} | {row} |")
    data = {
        "sizes": sizes,
        "samples": args.samples,
        "other_keys": args.other_keys,
        "median_ms": variants,
        "summary": "\n".join(lines),
    }
    write_results("embedded_copy", args.out, data, TARGET, met)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
