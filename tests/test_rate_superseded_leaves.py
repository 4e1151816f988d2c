"""A superseded run of a rate-limited ``Replace`` task leaves the key's rate window at once, on the
embedded server (no worker): its results are written by whoever finds it superseded (the newer send's
process, or the sweeper: ``results.write_superseded``), which now takes its place in the window out too.
Before, it kept that place until it went stale (``period`` + 15 s), and the newer runs waited behind it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_mongolock import LeaseStore, RateLimit, Replace, singleton_task
from celery_mongolock.core.store_rate import rate_windows
from celery_mongolock.integration.results import write_superseded

from .test_admission_store import entry

KEY = "rated:7"


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("rated", broker="memory://", set_as_current=False)

    @singleton_task(key="rated:{n}", app=app, name="upload", rate=RateLimit(1, 60), on_contention=Replace())
    def upload(n: int) -> None:  # pragma: no cover - never run: its options are read
        """The task the parked entries name (``n``)."""

    yield app
    app.close()


def waiting(store: LeaseStore) -> list[str]:
    window = rate_windows(store).collection.find_one({"_id": KEY}) or {}
    return [str(w["id"]) for w in window.get("w") or []]


def sup_of(store: LeaseStore) -> list[dict[str, Any]]:
    return list((store.collection.find_one({"_id": KEY}) or {}).get("sup") or [])


def test_a_superseded_run_leaves_the_rate_window(app: Celery, store: LeaseStore) -> None:
    older, newer = entry(1), entry(2)
    windows = rate_windows(store)
    assert windows.take([KEY], run="first/0", stamp=0, n=1, period_ms=60_000, park=True).started
    assert not windows.take([KEY], run=older["id"], stamp=1, n=1, period_ms=60_000, park=True).started
    assert waiting(store) == [older["id"]]  # the older run waits in the window (rate-parked)
    holder = store.acquire(KEY, 30)
    assert holder is not None
    store.admit(KEY, older, replace=True)  # its turn came: it parks on the key behind the holder ...
    store.admit(KEY, newer, replace=True)  # ... and a newer send supersedes it there
    [record] = sup_of(store)
    assert record["t"] == older["t"]
    write_superseded(app, store, KEY, [record])
    assert waiting(store) == []
