"""A lease-holding process driven line by line over stdin/stdout, for tests that need other processes
(e.g. one whose wall clock is wrong, run under libfaketime).

Commands (one per line, JSON answers):
    acquire KEY TTL HEARTBEAT(0|1)   -> {"ok": bool, "fence": int | null}
    state KEY                        -> {"lost": bool, "remaining": float}
    renew KEY                        -> {"ok": bool, "error": str | null}
    release KEY                      -> {"ok": bool}
    fenced KEY                       -> {"ok": bool, "error": str | null}  (fenced $inc on protected[KEY])
    wall                             -> {"wall": float}   (this process's time.time())
    quit
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from pymongo.errors import PyMongoError

from celery_mongolock import LeaseLost, LeaseStore, StoreUnavailable


def _store(url: str, db: str) -> LeaseStore:
    """The agent's store; on a loaded machine the server may not answer its first commands at once: it
    tries again for up to a minute (then the error ends the agent, and the test shows it)."""
    give_up = time.monotonic() + 60.0
    while True:
        try:
            return LeaseStore(url, database=db, lease_seconds=30)
        except (StoreUnavailable, PyMongoError):
            if time.monotonic() > give_up:
                raise
            time.sleep(0.5)


def main() -> None:
    url, db = sys.argv[1], sys.argv[2]
    store = _store(url, db)
    leases: dict[str, Any] = {}
    print(json.dumps({"ready": True, "wall": time.time()}), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        answer: dict[str, Any]
        if cmd == "acquire":
            key, ttl, hb = args[0], float(args[1]), args[2] == "1"
            lease = store.acquire(key, ttl=ttl, heartbeat=hb, heartbeat_seconds=ttl / 5 if hb else None)
            if lease is not None:
                leases[key] = lease
            answer = {"ok": lease is not None, "fence": lease.fence if lease else None}
        elif cmd == "state":
            lease = leases[args[0]]
            answer = {"lost": lease.lost, "remaining": lease.remaining}
        elif cmd == "renew":
            try:
                leases[args[0]].renew()
                answer = {"ok": True, "error": None}
            except LeaseLost as exc:
                answer = {"ok": False, "error": str(exc)}
        elif cmd == "release":
            answer = {"ok": leases.pop(args[0]).release()}
        elif cmd == "fenced":
            from celery_mongolock.fencing import FencedOut, fenced_update_one

            lease = leases[args[0]]
            try:
                fenced_update_one(
                    store.client[db]["protected"], {"_id": args[0]}, {"$inc": {"n": 1}}, lease, upsert=True
                )
                answer = {"ok": True, "error": None}
            except FencedOut as exc:
                answer = {"ok": False, "error": str(exc)}
        elif cmd == "wall":
            answer = {"wall": time.time()}
        elif cmd == "quit":
            break
        else:
            answer = {"error": f"unknown command {cmd}"}
        print(json.dumps(answer), flush=True)
    store.close()


if __name__ == "__main__":
    main()
