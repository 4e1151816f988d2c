"""Benchmark of the embedded server's CPU time for the lease watchers' change streams: server CPU per
write while ``--watchers`` streams wait, as SecantusDB ships and as ``EmbeddedMongo`` starts it
(``server_patches.AWAIT``).

Run it from the repository root (after ``make venv``; Linux: the server's CPU is read from ``/proc``)::

    .venv/bin/python benchmarks/embedded_watch.py                  # about a minute
    .venv/bin/python benchmarks/embedded_watch.py --watchers 0,8 --writes 300

Every worker process that holds a lease keeps one change stream open on the lease collection
(``core.lease_watch``: ``updateLookup`` and the loss filter of ``documents.changes``). SecantusDB 0.7
answered each such stream's waiting ``getMore`` after every write to any collection, after a read of the
oplog under the lock every command needs, most often with an empty batch, and the driver asked again at
once. ``AWAIT`` reads the oplog for a stream only after an entry of its collection (or of a command) was
written, and answers when an event passes or the wait is over, as mongod does. This starts the server
both ways (``tuned``: as ``EmbeddedMongo`` does; ``as-shipped``: without ``AWAIT``), opens ``--watchers``
streams as the lease watcher opens them, and then times ``--writes`` iterations of what a worker writes:
a lease renewal (which no stream passes) and an insert into another collection (the history). The
measure: the server process's CPU milliseconds per iteration.

Output: JSON (``benchmarks/results/embedded_watch.json`` by default) with a Markdown ``summary``.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from typing import Any

from embedded_common import RESULTS, as_shipped, embedded, server_patches, variants_table, write_results
from pymongo import MongoClient

from celery_mongolock.core.documents.changes import loss_events_pipeline

TARGET = "server CPU per write with the most watchers at least 1.2x lower than as-shipped (tuned)"
KEYS = 50


def _server_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _watch(url: str, pid: int, opened: threading.Barrier, stop: threading.Event) -> None:
    client: Any = MongoClient(url)
    try:
        pipeline = loss_events_pipeline("bench-host", pid)
        with client["bench_watch"]["leases"].watch(
            pipeline, full_document="updateLookup", max_await_time_ms=1000
        ) as stream:
            opened.wait()
            while not stop.is_set():
                stream.try_next()
    finally:
        client.close()


def measure(server_cls: type[embedded.EmbeddedMongo], watchers: int, writes: int) -> float:
    """Server CPU ms per iteration (a renewal and a history insert) with ``watchers`` streams open."""
    with server_cls() as server:
        assert server.pid is not None
        client: Any = MongoClient(server.url)
        db = client["bench_watch"]
        db["leases"].insert_many([{"_id": f"k{i}", "owner": "o", "fence": 1, "hs": []} for i in range(KEYS)])
        opened, stop = threading.Barrier(watchers + 1), threading.Event()
        threads = [
            threading.Thread(target=_watch, args=(server.url, 10_000 + i, opened, stop), daemon=True)
            for i in range(watchers)
        ]
        for thread in threads:
            thread.start()
        opened.wait(60)
        time.sleep(1.0)  # (each stream's first getMore sent: a measure, not a synchronisation)
        before = _server_cpu(server.pid)
        for n in range(writes):
            db["leases"].update_one({"_id": f"k{n % KEYS}"}, {"$set": {"expires": n}})
            db["history"].insert_one({"k": f"k{n % KEYS}", "n": n})
        spent = _server_cpu(server.pid) - before
        stop.set()
        for thread in threads:
            thread.join(10)
        client.close()
    return round(spent * 1000 / writes, 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--watchers", default="0,2,8", help="open streams, comma-separated")
    parser.add_argument("--writes", type=int, default=600, help="iterations timed at each count")
    parser.add_argument("--quick", action="store_true", help="the tuned variant only")
    parser.add_argument("--out", default=str(RESULTS / "embedded_watch.json"))
    args = parser.parse_args(argv)
    counts = [int(s) for s in args.watchers.split(",") if s.strip()]
    variants = {"tuned": {str(w): measure(embedded.EmbeddedMongo, w, args.writes) for w in counts}}
    if not args.quick:
        shipped = as_shipped(server_patches.AWAIT)
        variants["as-shipped"] = {str(w): measure(shipped, w, args.writes) for w in counts}
    top = str(counts[-1])
    met = "as-shipped" in variants and variants["tuned"][top] * 1.2 <= variants["as-shipped"][top]
    data = {
        "watchers": counts,
        "writes": args.writes,
        "server_cpu_ms_per_write": variants,
        "summary": variants_table("watchers", [(str(w), str(w)) for w in counts], variants),
    }
    write_results("embedded_watch", args.out, data, TARGET, met)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
