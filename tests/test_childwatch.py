"""The worker parent's child watch: a dead child's leases are released as soon as the child is gone.

Real processes and the real server: the child takes a 60 s lease and is killed; only the watch can free
the key within the test's deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_mongolock import LeaseStore
from celery_mongolock.integration.childwatch import ChildWatch
from celery_mongolock.testing import configure

from .servers import wait_for

pytestmark = pytest.mark.skipif(not ChildWatch.available(), reason="needs os.pidfd_open (Linux 5.3+)")

HOLDER = textwrap.dedent(
    """
    import sys, time
    from celery_mongolock import LeaseStore
    url, db, key, task_id = sys.argv[1:5]
    store = LeaseStore(url, database=db)
    lease = store.acquire(key, ttl=60, info={"task_id": task_id})
    assert lease is not None
    print("held", flush=True)
    if sys.argv[5] == "hold":
        time.sleep(120)
    """
)


@pytest.fixture
def app(mongo_url: str, db_name: str) -> Iterator[Celery]:
    app = Celery("childwatch", set_as_current=False)
    configure(app, mongo_url, db_name)
    yield app
    configure(app, mongo_url, db_name)  # closes the store the watch made


@pytest.fixture
def watch() -> Iterator[dict[str, Any]]:
    """A ChildWatch whose "active requests" are whatever the test puts in ``running`` (pid -> list)."""
    running: dict[int, list[tuple[Any, str, str]]] = {}
    released: list[int] = []
    from celery_mongolock.integration import childwatch as _childwatch

    def release(pid: int, requests: Any) -> None:
        _childwatch._release(pid, requests)
        released.append(pid)

    w = ChildWatch(requests_for=lambda pid: running.get(pid, []), release=release)
    yield {"watch": w, "running": running, "released": released}
    w.close()


def held(store: LeaseStore, key: str) -> bool:
    info = store.inspect(key)
    assert info is not None, f"no lease document for {key!r}"
    return info.held


def start_holder(mongo_url: str, db_name: str, key: str, task_id: str, mode: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, mongo_url, db_name, key, task_id, mode],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    with proc.stdout:
        assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_killed_child_s_lease_is_released_at_once(
    app: Celery, watch: dict[str, Any], store: LeaseStore, mongo_url: str, db_name: str
) -> None:
    proc = start_holder(mongo_url, db_name, "email-group:42", "task-1", "hold")
    watch["running"][proc.pid] = [(app, "upload", "task-1")]
    assert watch["watch"].watch(proc.pid)
    info = store.inspect("email-group:42")
    assert info is not None and info.held
    os.kill(proc.pid, signal.SIGKILL)
    # The lease is 60 s long: only the watch can free it within the deadline.
    wait_for(lambda: not held(store, "email-group:42"), timeout=15, message="the key to be freed")
    # The watch records the release once its commands returned (the key is free a moment before).
    wait_for(lambda: watch["released"] == [proc.pid], timeout=15, message="the watch to record it")
    assert watch["watch"].watched == []
    # The watch neither reaped the child nor stopped: the parent (here: us) still reaps it.
    assert proc.wait(10) == -signal.SIGKILL


def test_only_the_dead_child_s_tasks_are_released(
    app: Celery, watch: dict[str, Any], store: LeaseStore, mongo_url: str, db_name: str
) -> None:
    dead = start_holder(mongo_url, db_name, "tenant:1", "task-a", "hold")
    alive = start_holder(mongo_url, db_name, "tenant:2", "task-b", "hold")
    try:
        # The dead child's entry names only its own task; a lease of another task on the same pid (a
        # reused pid) would not match task_id AND pid.
        watch["running"][dead.pid] = [(app, "job", "task-a"), (app, "job", "task-b")]
        watch["running"][alive.pid] = [(app, "job", "task-b")]
        assert watch["watch"].watch(dead.pid) and watch["watch"].watch(alive.pid)
        dead.kill()
        wait_for(lambda: watch["released"], timeout=15, message="the watch to see the death")
        assert not held(store, "tenant:1")
        assert held(store, "tenant:2")
        assert watch["watch"].watched == [alive.pid]
    finally:
        alive.kill()
        alive.wait(10)
        dead.wait(10)
    wait_for(lambda: not held(store, "tenant:2"), timeout=15, message="the second death to be seen")


def test_a_child_that_exits_normally_releases_nothing_and_the_watch_goes_on(
    app: Celery, watch: dict[str, Any], store: LeaseStore, mongo_url: str, db_name: str
) -> None:
    first = start_holder(mongo_url, db_name, "k:1", "task-1", "exit")  # exits, lease left held
    assert first.wait(10) == 0
    # Already reaped: nothing to watch (Celery's own WorkerLostError path covers that case).
    assert watch["watch"].watch(first.pid) is False
    second = start_holder(mongo_url, db_name, "k:2", "task-2", "exit")
    assert watch["watch"].watch(second.pid)  # not yet reaped: watched, seen at once as exited
    wait_for(lambda: watch["released"], timeout=15, message="the exit to be seen")
    assert held(store, "k:2")  # no active request named it
    second.wait(10)
    third = start_holder(mongo_url, db_name, "k:3", "task-3", "hold")
    watch["running"][third.pid] = [(app, "job", "task-3")]
    assert watch["watch"].watch(third.pid)
    third.terminate()
    wait_for(lambda: not held(store, "k:3"), timeout=15, message="the key to be freed")
    third.wait(10)


def test_watching_ourselves_or_nonsense_is_refused(watch: dict[str, Any]) -> None:
    assert watch["watch"].watch(os.getpid()) is False
    assert watch["watch"].watch(0) is False
    assert watch["watch"].watch(-1) is False
