"""The seed-2 ``fenced-but-applied``, reproduced by construction: a retryable write whose first attempt
landed, retried by pymongo (same ``lsid`` and ``txnNumber``) while the server had not yet recorded the
first attempt, is run again and answers "no match" for an applied write. ``locked.update_one`` sends
its write once, without a ``txnNumber``: its answer is the only judgement."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient, monitoring

from celery_mongolock import DocumentLock, DocumentLockLost, LeaseStore
from celery_mongolock.core.document_lock import force_release_document
from celery_mongolock.core.documents import locked as docs

from . import lockcheck
from .servers import wait_for

HERE = Path(__file__).resolve().parent


class _Updates(monitoring.CommandListener):
    """``update`` commands to one collection; the first answer opens the gate (the retry was answered)."""

    def __init__(self, gate: Path) -> None:
        self.gate = gate
        self.sent: list[dict[str, Any]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name == "update" and event.command.get("update") == "invoices":
            self.sent.append(dict(event.command))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        if event.command_name == "update":
            self.gate.touch()

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


@pytest.fixture
def gated(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gate = tmp_path / "gate"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "gate_server.py"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--storage-path",
            ":memory:",
            "--log-level",
            "WARNING",
        ],
        env={**os.environ, "GATE": str(gate)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"mongodb://127.0.0.1:{port}/?directConnection=true"
    try:
        probe: MongoClient[dict[str, Any]] = MongoClient(url, serverSelectionTimeoutMS=500)
        wait_for(lambda: _pings(probe), timeout=60, message="the gated server to answer")
        probe.close()
        yield url, gate
    finally:
        proc.terminate()
        proc.wait(30)


def _pings(client: MongoClient[dict[str, Any]]) -> bool:
    try:
        client.admin.command("ping")
    except Exception:
        return False
    return True


def _arm(gate: Path) -> None:
    gate.unlink(missing_ok=True)
    Path(f"{gate}.arm").touch()


def test_a_retried_write_judged_again_never_reads_as_lost(gated: tuple[str, Path]) -> None:
    url, gate = gated
    updates = _Updates(gate)
    # A socket timeout shorter than the gate: pymongo's retry reaches the server while the first attempt,
    # applied, waits to be recorded.
    client: MongoClient[dict[str, Any]] = MongoClient(
        url, tz_aware=True, socketTimeoutMS=5000, event_listeners=[updates]
    )
    store = LeaseStore(client, database="doclock", lease_seconds=60)
    coll = client["doclock"]["invoices"]
    setup: MongoClient[dict[str, Any]] = MongoClient(url)
    try:
        setup["doclock"]["invoices"].insert_one({"_id": "inv", "paid": 0})
        with DocumentLock(coll, "inv", store=store, ttl=120, heartbeat_seconds=60) as locked:
            held = docs.held_filter("mongolock", ["inv"], [locked.owner], locked.fence)
            # The fact: the update as a retryable write (what update_one sent before), whose filter no
            # longer matches once applied (a field it changes, as the lock's expiry does in time).
            _arm(gate)
            result = coll.update_one({**held, "paid": 0}, {"$inc": {"paid": 1}})
            first, retry = updates.sent
            assert (first["lsid"], first["txnNumber"]) == (retry["lsid"], retry["txnNumber"])
            assert result.matched_count == 0 and _paid(coll) == 1  # "no match", and yet applied
            # The fix: locked.update_one is not a retryable write; one command, one judgement.
            updates.sent.clear()
            _arm(gate)
            assert locked.update_one([{"$set": {"paid": {"$add": ["$paid", 1]}}}]).modified
            assert len(updates.sent) == 1 and "txnNumber" not in updates.sent[0]
            assert _paid(coll) == 2
            Path(f"{gate}.arm").unlink(missing_ok=True)  # not consumed: the release is not delayed
    finally:
        store.close()
        client.close()
        setup.close()


def _paid(coll: Any) -> int:
    doc = coll.find_one({"_id": "inv"})
    assert doc is not None
    return int(doc["paid"])


class _ReleaseAfterFirstWrite(monitoring.CommandListener):
    """Force-releases the lock once the first write to ``protected`` is answered (before the caller sees
    the answer): the write's retry finds the lock gone."""

    def __init__(self) -> None:
        self.release: Any = None
        self.writes = 0

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        pass

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        if event.command_name == "update" and self.release is not None:
            self.writes += 1
            if self.writes == 1:
                self.release()

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def test_the_checker_records_a_refusal_after_an_unknown_write_as_ambiguous(own_server: Any) -> None:
    """``lockcheck._document_write``: the first attempt lands with an unknown outcome (a write-concern
    error), the lock is then released by force, the idempotent retry is refused: ``ambiguous`` (the
    write is in the document), never ``fenced``."""
    server = own_server(enable_test_commands=True)
    listener = _ReleaseAfterFirstWrite()
    client: MongoClient[dict[str, Any]] = MongoClient(server.url, tz_aware=True, event_listeners=[listener])
    store = LeaseStore(client, database="doclock", lease_seconds=60)
    coll = client["doclock"]["protected"]
    try:
        coll.insert_one({"_id": "d", "counter": 0, "log": []})
        lock = DocumentLock(coll, "d", store=store, ttl=120, heartbeat_seconds=60)
        locked = lock.__enter__()
        listener.release = lambda: force_release_document(store, locked.document)
        admin: MongoClient[dict[str, Any]] = MongoClient(server.url)
        admin.admin.command(
            "configureFailPoint", "failCommand", mode={"times": 1},
            data={"failCommands": ["update"], "writeConcernError": {"code": 91, "errmsg": "injected"}},
        )  # fmt: skip
        admin.close()
        assert lockcheck._document_write(locked, "op-1", 0) == ("ambiguous", True)
        doc = coll.find_one({"_id": "d"})
        assert doc is not None and [e["o"] for e in doc["log"]] == ["op-1"] and doc["counter"] == 1
        listener.release = None
        assert locked.lost
        with pytest.raises(DocumentLockLost):  # the block's end: it did not run protected to the end
            lock.__exit__(None, None, None)
    finally:
        store.close()
        client.close()
