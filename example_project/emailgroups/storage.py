"""MongoDB storage of the example: groups, their members, and a log of task runs (for the demo)."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from pymongo import MongoClient

from . import settings

_clients: dict[int, MongoClient[dict[str, Any]]] = {}


def db() -> Any:
    """This process's database handle (one client per process: MongoClient is not fork-safe)."""
    pid = os.getpid()
    if pid not in _clients:
        _clients[pid] = MongoClient(settings.MONGO_URL)
    return _clients[pid][settings.DATABASE]


def log_run(kind: str, **fields: Any) -> None:
    """Record a run event (start, end, skip...) with its worker, for the demo's live view and timeline."""
    db()["runs"].insert_one(
        {
            "kind": kind,
            "t": time.time(),
            "mono": time.monotonic(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            **fields,
        }
    )
