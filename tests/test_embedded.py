"""The embedded MongoDB-compatible server: start, answer, stop cleanly, never left running."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient
from pymongo.errors import PyMongoError

from celery_mongolock import LeaseStore
from celery_mongolock.embedded import EmbeddedMongo, EmbeddedMongoError

ROOT = Path(__file__).resolve().parents[1]


def _answers(url: str) -> bool:
    c: MongoClient[dict[str, object]] = MongoClient(url, serverSelectionTimeoutMS=300)
    try:
        c.admin.command("ping")
        return True
    except PyMongoError:
        return False
    finally:
        c.close()


def test_start_answer_stop() -> None:
    with EmbeddedMongo() as server:
        assert server.running and server.url.startswith("mongodb://127.0.0.1:")
        assert _answers(server.url)
        pid = server.pid
        assert pid is not None
        client: MongoClient[dict[str, object]] = MongoClient(server.url)
        try:
            assert client.admin.command("hello").get("setName")  # presents a one-node replica set
        finally:
            client.close()  # presents a one-node replica set
    assert not server.running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not _answers(server.url)


def test_file_backed_storage_survives_restart(tmp_path: Path) -> None:
    server = EmbeddedMongo(storage_path=tmp_path / "data").start()
    try:
        store = LeaseStore(server.url, operation_timeout=5)
        lease = store.acquire("k", ttl=60)
        assert lease is not None
        store.close()
        server.restart()
        store = LeaseStore(server.url, operation_timeout=5)
        info = store.inspect("k")
        assert info is not None and info.owner == lease.owner and info.fence == lease.fence
        store.close()
    finally:
        server.stop()


def test_a_server_that_cannot_start_reports_why() -> None:
    with EmbeddedMongo() as first:
        clash = EmbeddedMongo(port=first.port, startup_timeout=20)
        with pytest.raises(EmbeddedMongoError, match="already in use"):
            clash.start()
        assert not clash.running


@contextlib.contextmanager
def _module_server() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``python -m celery_mongolock.embedded`` started, with the URL it printed (it answers ping)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery_mongolock.embedded"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("mongodb://127.0.0.1:")
        assert _answers(url)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        if proc.stdout is not None:
            proc.stdout.close()


def test_module_prints_url_and_stops_on_sigint() -> None:
    with _module_server() as (proc, url):
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert not _answers(url)


def test_module_stops_its_server_on_sigterm() -> None:
    with _module_server() as (proc, url):
        proc.terminate()
        assert proc.wait(30) == 0
        assert not _answers(url)


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's (prctl)")
def test_a_killed_module_leaves_no_server_behind() -> None:
    """``python -m celery_mongolock.embedded`` SIGKILLed (no handler runs): its server goes too, and the
    port is free to start it again (a user's trial: the server went on serving, and a restart failed with
    'port ... already in use')."""
    from celery_mongolock.testing import wait_for

    with _module_server() as (proc, url):
        proc.kill()
        proc.wait(30)
        wait_for(lambda: not _answers(url), timeout=60, message="the server to go with its command")


#: ``tgkill`` (a signal to one thread of another process), by machine; Linux only.
_TGKILL = {"x86_64": 234, "aarch64": 131}


def test_a_stop_signal_taken_by_another_thread_still_stops_the_server() -> None:
    # The kernel may hand a process's SIGTERM to any of its threads. SecantusDB's main thread, where its
    # handler runs, waited with no timeout and was never woken: the server never exited (2 of 150 stops
    # under load, SIGKILLed after 30 s). Here the signal goes to another thread on purpose.
    import ctypes
    import platform

    number = _TGKILL.get(platform.machine())
    if not sys.platform.startswith("linux") or number is None:
        pytest.skip("sends a signal to one thread with Linux's tgkill")
    server = EmbeddedMongo().start()
    proc = server._proc
    assert proc is not None
    try:
        # Its oldest other thread first (its storage's and accept threads live as long as it does; a
        # connection's thread may be gone by now: then the next one).
        others = sorted(int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid)
        libc = ctypes.CDLL(None, use_errno=True)
        sent = next((t for t in others if libc.syscall(number, proc.pid, t, signal.SIGTERM) == 0), None)
        assert sent is not None, f"no thread besides the main one took the signal: {others}"
        # It stops by itself: nothing else is sent (a hang fails here, at pytest's own timeout at most).
        assert proc.wait(timeout=60) == 0
    finally:
        server.stop(timeout=5)


def test_stop_with_no_client_connected_exits_cleanly() -> None:
    # SecantusDB's stop joins its accept thread, which closing the listening socket does not wake;
    # stop() connects to wake it (measured: 2.07 s -> 0.08 s per stop). Here: the server exits by
    # itself (code 0, not SIGKILLed after the timeout).
    server = EmbeddedMongo().start()
    proc = server._proc
    assert proc is not None
    server.stop(timeout=30)
    assert proc.returncode == 0
    assert not _answers(server.url)


def test_the_servers_retryable_write_records_are_pruned_in_bulk(monkeypatch: pytest.MonkeyPatch) -> None:
    """``embedded._TUNE``, run in the server's process: the records of retryable writes are kept as
    SecantusDB keeps them (its cap and lifetime), but pruned in bulk instead of by a scan and a sort on
    every write (the before and after are in ``benchmarks/embedded_retryable.py``)."""
    from secantus import transactions

    from celery_mongolock.ops import embedded

    monkeypatch.setattr(  # restored after the test: the patch is for the server's process, not ours
        transactions.TransactionRegistry,
        "_prune_retryable_locked",
        transactions.TransactionRegistry._prune_retryable_locked,
    )
    exec(embedded._TUNE, {})
    cap = transactions._RETRYABLE_RECORD_MAX
    life = transactions._RETRYABLE_RECORD_LIFETIME_SECONDS
    now = [1000.0]
    registry = transactions.TransactionRegistry(time_func=lambda: now[0])
    reply = {"ok": 1.0, "n": 1}
    for i in range(cap + 1):
        registry.record_retryable(b"session", i, b"write", reply)
    kept = registry._retryable
    assert cap - cap // 10 <= len(kept) <= cap
    assert (b"session", cap) in kept and (b"session", 0) not in kept  # the newest kept, the oldest dropped
    # Past their lifetime (looked at no more than once a second): gone at the next record.
    now[0] += life + 2
    registry.record_retryable(b"session", cap + 1, b"write", reply)
    assert list(registry._retryable) == [(b"session", cap + 1)]


def test_a_change_stream_start_time_is_found_by_bisection_with_the_same_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``embedded._SEEK``, run in the server's process: where a stream opened at an operation time starts
    is found in a few point reads, not by decoding the whole oplog under the server's lock (4 s per
    opening with 46,801 entries, every other command waiting), with the same answer as SecantusDB's scan
    for every time: before the first entry, at each entry, between two, after the last."""
    from bson import Timestamp
    from secantus import storage

    from celery_mongolock.ops import embedded

    scan = storage.Storage._find_seq_for_ts_scan
    # restored after the test: the patch is for the server's process, not ours
    monkeypatch.setattr(storage.Storage, "_find_seq_for_ts_scan", scan)
    exec(embedded._SEEK, {})
    seek = storage.Storage._find_seq_for_ts_scan
    assert seek is not scan
    db = storage.Storage(":memory:")
    try:
        for i in range(300):  # one oplog entry each, several within one second (the same ``time``)
            db.insert("d", "c", [{"_id": i}])
        session = db._conn.open_session()
        rows, _high = db._merge_oplog_on_session(session, 0, 2**63 - 1)
        session.close()
        times = [entry["ts"] for _seq, entry in rows]
        assert len(times) >= 300
        probes = [Timestamp(0, 0), Timestamp(2**31 - 1, 0)]
        probes += list(times[::7]) + [Timestamp(t.time, t.inc + 1) for t in times[::11]]
        probes += [Timestamp(t.time, 0) for t in times[::13]]
        for at in probes:
            assert seek(db, at) == scan(db, at), at
    finally:
        db.close()


def test_a_stream_opened_at_an_operation_time_starts_with_the_next_write() -> None:
    """Over the wire, on the embedded server (its process patched by ``_SEEK``): a change stream opened
    at the operation time of a write sees every write after it, and nothing before."""
    with EmbeddedMongo() as server:
        client: MongoClient[dict[str, object]] = MongoClient(server.url)
        try:
            coll = client["seek"]["c"]
            session_times = []
            for i in range(200):
                with client.start_session() as s:
                    coll.insert_one({"_id": i}, session=s)
                    session_times.append(s.operation_time)
            at = session_times[120]
            seen: list[object] = []
            deadline = time.monotonic() + 60  # (an empty batch is no end: the events are in the oplog)
            with coll.watch(start_at_operation_time=at, max_await_time_ms=200) as stream:
                while len(seen) < 80 and time.monotonic() < deadline:
                    event: Any = stream.try_next()
                    if event is not None:
                        seen.append(event["documentKey"]["_id"])
            assert seen == list(range(120, 200))
        finally:
            client.close()


def test_a_database_s_profiling_level_is_read_once_and_forgotten_when_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``embedded._PROFILE``, run in the server's process: the level SecantusDB reads after every command
    is kept per database, and ``set_profile`` (the ``profile`` command) is seen at once."""
    from secantus import storage

    from celery_mongolock.ops import embedded

    for name in ("get_profile", "set_profile"):  # restored after the test (the server's process only)
        monkeypatch.setattr(storage.Storage, name, getattr(storage.Storage, name))
    exec(embedded._PROFILE, {})
    db = storage.Storage(":memory:")
    try:
        assert db.get_profile("a")["level"] == 0
        db.set_profile("a", level=2, slowms=5)
        assert db.get_profile("a") == {"level": 2, "slowms": 5, "sampleRate": 1.0}
        assert db.get_profile("b")["level"] == 0
        db.get_profile("a")["level"] = 0  # a copy: what the caller changes is not kept
        assert db.get_profile("a")["level"] == 2
        db.set_profile("a", level=0)
        assert db.get_profile("a")["level"] == 0
    finally:
        db.close()


def test_the_profile_command_still_turns_profiling_on_and_off() -> None:
    """Over the wire, on the embedded server (its process patched by ``_PROFILE``)."""
    with EmbeddedMongo() as server:
        client: MongoClient[dict[str, object]] = MongoClient(server.url)
        try:
            db = client["prof"]
            assert db.command("profile", -1)["was"] == 0
            db.command("profile", 2)
            db["c"].insert_one({"_id": 1})
            assert db.command("profile", -1)["was"] == 2
            db.command("profile", 0)
            assert db.command("profile", -1)["was"] == 0
        finally:
            client.close()
