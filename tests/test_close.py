"""``LeaseStore.close()`` and ``release_held()`` return promptly whatever the server does (issue 24).

A worker shutting down during an outage must not hang: before the fix, ``close()`` waited a whole
``operation_timeout`` for the release of a held lease and again a ``serverSelectionTimeoutMS`` inside
pymongo's ``MongoClient.close()`` (its ``endSessions``), 10-20 s with the defaults. A lease that could not
be released stays held on the server until it expires there (fail closed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_mongolock import LeaseStore
from celery_mongolock.exceptions import ConfigurationError

# The stores below would wait this long per MongoDB call: a close() that returns well before it did
# not wait on the server. Generous on a busy machine (the close itself is bounded by about 1 s).
OPERATION_TIMEOUT = 30.0
PROMPT = 10.0


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The server's process group frozen with SIGSTOP (connections stay open, nothing answers)."""
    os.killpg(pid, signal.SIGSTOP)
    try:
        wait_all_stopped(pid)
        yield
    finally:
        os.killpg(pid, signal.SIGCONT)


def _group_threads(pgid: int) -> list[Path]:
    """The ``stat`` files of every thread of every process in the process group ``pgid``."""
    found: list[Path] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                found.extend(task / "stat" for task in (proc / "task").iterdir())
        except (OSError, IndexError, ValueError):
            continue  # (a process that ended meanwhile)
    return found


def wait_all_stopped(pgid: int, limit: float = 60.0) -> None:
    """Wait until every thread of the group is stopped. ``kill(SIGSTOP)`` returns before that: the
    kernel wakes one thread to start the group stop, and on a busy machine another thread of a
    multi-threaded server could still answer a request meanwhile (a CI run's release was answered)."""
    deadline = time.monotonic() + limit
    while True:
        states = []
        for stat in _group_threads(pgid):
            with contextlib.suppress(OSError):
                states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        if states and all(state in "Tt" for state in states):
            return
        assert time.monotonic() < deadline, f"process group {pgid} not stopped after {limit} s: {states}"
        time.sleep(0.01)


@contextlib.contextmanager
def frozen(server: Any) -> Iterator[None]:
    """``stopped`` for an embedded server, which is killed afterwards: thawed, it took its whole stop
    timeout (15 s) to exit on SIGTERM, with the requests it had been sent while frozen in flight."""
    assert server.pid is not None
    try:
        with stopped(server.pid):
            yield
    finally:
        server.kill()


def held_store(url: str, db_name: str) -> tuple[LeaseStore, Any]:
    store = LeaseStore(url, database=db_name, lease_seconds=60, operation_timeout=OPERATION_TIMEOUT)
    lease = store.acquire("close:held", ttl=60, heartbeat=True)  # renewed by the heartbeat, as hold() does
    assert lease is not None and lease.held
    return store, lease


def timed_close(store: LeaseStore) -> float:
    started = time.monotonic()
    store.close()
    return time.monotonic() - started


def test_close_returns_promptly_when_the_server_was_killed(
    own_server: Any, db_name: str, tmp_path: Path
) -> None:
    server = own_server(storage_path=tmp_path / "data")
    store, lease = held_store(server.url, db_name)
    thread = store.heartbeat.thread
    server.kill()
    assert timed_close(store) < PROMPT
    assert lease.released  # not renewed any more
    # The heartbeat thread close() did not wait for opened no client of its own meanwhile (nobody would
    # close it).
    assert thread is not None
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert store.connection.client_cache is None

    # Fail closed: the lease could not be given back, so it is still held on the server (until it
    # expires there); nobody takes it early.
    server.start()
    with LeaseStore(server.url, database=db_name, operation_timeout=OPERATION_TIMEOUT) as other:
        assert other.acquire("close:held", ttl=5) is None
        info = other.inspect("close:held")
        assert info is not None and info.held and info.owner == lease.owner


def test_close_returns_promptly_when_the_server_is_stopped(own_server: Any, db_name: str) -> None:
    server = own_server()
    store, lease = held_store(server.url, db_name)
    with frozen(server):
        assert timed_close(store) < PROMPT
    assert lease.released


def test_close_of_an_idle_store_returns_promptly_when_the_server_is_stopped(
    own_server: Any, db_name: str
) -> None:
    """No lease held, but the client has sessions to end: MongoClient.close() sends endSessions."""
    server = own_server()
    store = LeaseStore(server.url, database=db_name, operation_timeout=OPERATION_TIMEOUT)
    assert store.acquire("close:once", ttl=5) is not None
    with frozen(server):
        assert timed_close(store) < PROMPT


def test_release_held_gives_up_within_its_timeout(own_server: Any, db_name: str) -> None:
    """The worker-shutdown path (``release_all_held``) releases through ``release_held``."""
    server = own_server()
    store, lease = held_store(server.url, db_name)
    second = store.acquire("close:second", ttl=60, heartbeat=True)
    assert second is not None
    try:
        with frozen(server):
            started = time.monotonic()
            assert store.release_held(timeout=1.0) == 0
            assert time.monotonic() - started < PROMPT
        assert lease.released and second.released
        assert store.held_leases() == []
    finally:
        thread = store.heartbeat.thread
        store.close()
    # The heartbeat thread, busy with the background releases when close() stopped it, opened no client
    # of its own afterwards (nobody would close it).
    assert thread is not None
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert store.connection.client_cache is None


def test_close_with_a_live_server_releases(own_server: Any, db_name: str) -> None:
    server = own_server()
    store, lease = held_store(server.url, db_name)
    store.close()
    with LeaseStore(server.url, database=db_name) as other:
        again = other.acquire("close:held", ttl=5)
        assert again is not None and again.fence > lease.fence
        again.release()


@pytest.mark.parametrize("bad", [0, -1, "1", float("nan"), True])
def test_close_timeout_is_checked(store: LeaseStore, bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="timeout"):
        store.close(timeout=bad)
