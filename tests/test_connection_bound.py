"""A worker's connections to MongoDB stay bounded under a storm (issue 28 item 8): each process has one
client per store, whose pool holds at most ``maxPoolSize`` connections (pymongo's default 100; set it in
``mongolock_url``, e.g. ``?maxPoolSize=20``). A burst of parks from many threads at once waits for a
pooled connection instead of opening more, and every run parks: none is refused, none falls back to
another policy. On the embedded server, with pymongo's connection monitoring."""

from __future__ import annotations

import threading
from typing import Any

from pymongo import monitoring

from celery_mongolock import LeaseStore

from .test_admission_store import entry

POOL = 8
THREADS = 120


class Connections(monitoring.ConnectionPoolListener):
    """How many pooled connections the client opened, and the most open at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open = self.most = self.created = 0

    def connection_created(self, event: monitoring.ConnectionCreatedEvent) -> None:
        with self.lock:
            self.created += 1
            self.open += 1
            self.most = max(self.most, self.open)

    def connection_closed(self, event: monitoring.ConnectionClosedEvent) -> None:
        with self.lock:
            self.open -= 1

    def pool_created(self, event: Any) -> None: ...
    def pool_ready(self, event: Any) -> None: ...
    def pool_cleared(self, event: Any) -> None: ...
    def pool_closed(self, event: Any) -> None: ...
    def connection_ready(self, event: Any) -> None: ...
    def connection_check_out_started(self, event: Any) -> None: ...
    def connection_check_out_failed(self, event: Any) -> None: ...
    def connection_checked_out(self, event: Any) -> None: ...
    def connection_checked_in(self, event: Any) -> None: ...


def test_a_storm_of_parks_from_one_process_stays_within_its_pool(mongo_url: str, db_name: str) -> None:
    connections = Connections()
    sep = "&" if "?" in mongo_url else "?"
    store = LeaseStore(
        f"{mongo_url}{sep}maxPoolSize={POOL}",
        database=db_name,
        operation_timeout=60.0,
        client_options={"event_listeners": [connections]},
    )
    try:
        holder = store.acquire("storm:1", 600)
        assert holder is not None
        outcomes: list[str] = []
        errors: list[BaseException] = []
        start = threading.Barrier(THREADS)

        def park(i: int) -> None:
            try:
                start.wait()
                outcomes.append(str(store.admit("storm:1", entry(i + 1, f"run-{i}"))[1]["lo"]))
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=park, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert outcomes.count("parked") == THREADS
        info = store.inspect("storm:1", parked_limit=1)
        assert info is not None and info.parked_total == THREADS
        assert connections.most <= POOL, connections.most
    finally:
        store.close()
