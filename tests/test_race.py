"""Many real processes contend for a few keys and do read-modify-write under their leases.

Each process repeatedly acquires one of a few keys, and while it holds the lease reads a counter
document, writes it back incremented and appends its fence, then releases. The checker asserts:

* no lost update: each counter equals the number of holds of its key;
* no overlapping holds: the hold intervals of one key (CLOCK_MONOTONIC is system-wide) never overlap;
* fences increase in hold order, and the fences applied to each counter are strictly increasing.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pymongo import MongoClient

WORKER = textwrap.dedent(
    """
    import json, random, sys, time
    from pymongo import MongoClient
    from celery_mongolock import LeaseStore

    url, db, keys, n, out = sys.argv[1], sys.argv[2], sys.argv[3].split(","), int(sys.argv[4]), sys.argv[5]
    store = LeaseStore(url, database=db, lease_seconds=20)
    data = MongoClient(url)[db]["protected"]
    holds = []
    contended = 0
    rng = random.Random()
    while len(holds) < n:
        key = rng.choice(keys)
        lease = store.acquire(key)
        if lease is None:
            contended += 1
            time.sleep(rng.random() * 0.002)
            continue
        start = time.monotonic()
        doc = data.find_one({"_id": key}) or {"value": 0}
        data.update_one({"_id": key}, {"$set": {"value": doc["value"] + 1}, "$push": {"fences": lease.fence}},
                        upsert=True)
        end = time.monotonic()
        assert lease.release(), "lost a lease we held"
        holds.append([key, lease.fence, start, end])
    with open(out, "w") as f:
        json.dump({"holds": holds, "contended": contended}, f)
    store.close()
    """
)


@pytest.mark.slow
def test_processes_never_overlap_and_lose_no_update(mongo_url: str, db_name: str, tmp_path: Path) -> None:
    processes, per_process, keys = 8, 40, ["k0", "k1", "k2"]
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = []
    for i in range(processes):
        out = tmp_path / f"out{i}.json"
        procs.append(
            (
                subprocess.Popen(
                    [
                        sys.executable,
                        str(script),
                        mongo_url,
                        db_name,
                        ",".join(keys),
                        str(per_process),
                        str(out),
                    ],
                    env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
                ),
                out,
            )
        )
    holds = []
    contended = 0
    for proc, out in procs:
        assert proc.wait(timeout=240) == 0
        result = json.loads(out.read_text())
        holds += result["holds"]
        contended += result["contended"]
    client: MongoClient[dict[str, object]] = MongoClient(mongo_url)
    try:
        counters = {d["_id"]: d for d in client[db_name]["protected"].find()}
    finally:
        client.drop_database(db_name)
        client.close()

    assert len(holds) == processes * per_process
    assert contended > 0, "the test did not produce contention"
    for key in keys:
        mine = sorted((h for h in holds if h[0] == key), key=lambda h: h[2])
        # no lost update
        assert counters[key]["value"] == len(mine)
        # no overlap, and fences increase in hold order
        for earlier, later in itertools.pairwise(mine):
            assert earlier[3] <= later[2], f"overlapping holds of {key}: {earlier} {later}"
            assert earlier[1] < later[1], f"fence went backwards on {key}: {earlier} {later}"
        applied: list[int] = list(counters[key]["fences"])  # type: ignore[call-overload]
        assert all(a < b for a, b in itertools.pairwise(applied))
        assert applied == [h[1] for h in mine]
