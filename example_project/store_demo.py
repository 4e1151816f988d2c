"""A short demonstration of the lease store (run with ``make demo``).

It starts the embedded MongoDB-compatible server (or uses ``--mongo-url``), then:

1. Four worker processes each upload a "CSV file" into the same email group at once. An upload clears
   the group and adds the members in batches; under the lease the uploads take turns, so the group ends
   with exactly the members of the last upload (without the lease it would hold a mix).
2. A holder is killed with SIGKILL while it holds a key; another process takes the key as soon as the
   lease expires, with a larger fencing token.
3. A stale holder's late write is rejected by the fence.

Exits non-zero if an invariant broke.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pymongo import MongoClient

from celery_mongolock import LeaseStore
from celery_mongolock.embedded import EmbeddedMongo

DB = "celery_mongolock_demo"


def upload(url: str, group: int, upload_id: str, members: list[str], log: Any) -> None:
    """Replace an email group's members with ``members``, as a singleton per group."""
    store = LeaseStore(url, database=DB, lease_seconds=5)
    groups: Any = MongoClient(url)[DB]["group_members"]
    with store.hold(f"email-group:{group}", wait=60, info={"upload": upload_id}) as lease:
        start = time.monotonic()
        groups.delete_many({"group": group})
        for i in range(0, len(members), 5):
            lease.raise_if_lost()
            groups.insert_many(
                [{"group": group, "email": m, "upload": upload_id} for m in members[i : i + 5]]
            )
        log.put((upload_id, lease.fence, start, time.monotonic()))
    store.close()


def hold_forever(url: str, ready: Any) -> None:
    store = LeaseStore(url, database=DB)
    lease = store.acquire("nightly-report", ttl=2)  # no heartbeat: the kill leaves it to expire
    ready.put(lease.fence if lease else None)
    time.sleep(3600)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mongo-url", default=os.environ.get("MONGOLOCK_MONGODB_URL"))
    args = parser.parse_args()
    server = None
    url = args.mongo_url
    if not url:
        print("starting the embedded MongoDB-compatible server ...", flush=True)
        server = EmbeddedMongo().start()
        url = server.url
    ok = True
    ctx = mp.get_context("spawn")
    try:
        client: MongoClient[dict[str, Any]] = MongoClient(url)
        client.drop_database(DB)
        store = LeaseStore(url, database=DB)

        print("\n1. four overlapping uploads into email group 42 (a singleton per group)")
        log = ctx.Queue()
        uploads = {f"upload-{n}": [f"user{n}-{i}@example.com" for i in range(20)] for n in range(1, 5)}
        procs = [ctx.Process(target=upload, args=(url, 42, uid, m, log)) for uid, m in uploads.items()]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        runs = sorted((log.get(timeout=5) for _ in procs), key=lambda r: r[2])
        print(f"   {'upload':<10} {'fence':>18} {'start':>8} {'end':>8}")
        t0 = runs[0][2]
        for uid, fence, start, end in runs:
            print(f"   {uid:<10} {fence:>18} {start - t0:>7.3f}s {end - t0:>7.3f}s")
        overlaps = sum(1 for a, b in itertools.pairwise(runs) if b[2] < a[3])
        last = runs[-1][0]
        members = sorted(d["email"] for d in client[DB]["group_members"].find({"group": 42}))
        exact = members == sorted(uploads[last])
        print(f"   overlaps: {overlaps}; group 42 holds exactly the last upload's members ({last}): {exact}")
        ok &= overlaps == 0 and exact

        print("\n2. a holder is killed (SIGKILL) while it holds 'nightly-report' (2 s lease)")
        ready = ctx.Queue()
        victim = ctx.Process(target=hold_forever, args=(url, ready))
        victim.start()
        old_fence = ready.get(timeout=30)
        killed_at = time.monotonic()
        os.kill(victim.pid or 0, signal.SIGKILL)
        victim.join(10)
        while (lease := store.acquire("nightly-report", ttl=5)) is None:
            time.sleep(0.05)
        took = time.monotonic() - killed_at
        print(f"   taken over {took:.2f}s after the kill; fence {old_fence} -> {lease.fence}")
        ok &= lease.fence > old_fence and took < 5

        print("\n3. fencing: the dead holder's late write is rejected")
        reports = client[DB]["reports"]
        reports.update_one(
            {"_id": "nightly"}, {"$set": {"fence": lease.fence, "by": "new holder"}}, upsert=True
        )
        stale = reports.update_one(
            {"_id": "nightly", "fence": {"$lte": old_fence}}, {"$set": {"by": "stale holder"}}
        )
        print(
            f"   stale write applied: {stale.modified_count == 1}; "
            f"document: {reports.find_one({'_id': 'nightly'})}"
        )
        ok &= stale.modified_count == 0
        lease.release()

        print("\n4. the leases as an operator sees them:")
        for info in store.list(include_free=True):
            state = "held" if info.held else "free"
            print(f"   {info.key:<16} {state:<5} fence={info.fence} holder={info.holder}")
        store.close()
        client.drop_database(DB)
        client.close()
    finally:
        if server is not None:
            server.stop()
    print("\nsummary:", "all invariants held" if ok else "AN INVARIANT BROKE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
