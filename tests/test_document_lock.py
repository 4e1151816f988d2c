"""``DocumentLock``: a lock kept as fields of the document it protects, on a real server (issue 29 item 2).

Contention between two holders, a holder's death (a subprocess killed with SIGKILL: the lock is taken
only after its expiry on the server's clock), the heartbeat keeping a lock past its ttl (in one batch per
collection), release clearing the lock's fields and nothing else, writes refused once the lock is lost,
and every bad input.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
from bson import ObjectId
from bson.binary import UuidRepresentation
from bson.codec_options import CodecOptions
from pymongo import MongoClient, monitoring

from celery_mongolock import (
    ConfigurationError,
    DocumentLock,
    DocumentLockLost,
    DocumentMissing,
    DocumentWrite,
    DocumentWriteUnknown,
    LeaseStore,
    LockContended,
    StoreUnavailable,
)
from celery_mongolock.core.document_lock import (
    LockedDocument,
    force_release_document,
    inspect_document,
)

from .servers import wait_for

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def coll(store: LeaseStore, client: MongoClient[dict[str, Any]], db_name: str) -> Any:
    return client[db_name]["invoices"]


def _lock_of(coll: Any, _id: Any) -> dict[str, Any]:
    doc = coll.find_one({"_id": _id})
    assert doc is not None
    return dict(doc.get("mongolock") or {})


def test_hold_write_release_leaves_the_users_fields_intact(store: LeaseStore, coll: Any) -> None:
    coll.insert_one({"_id": "inv-1", "state": "open", "total": 10})
    with DocumentLock(coll, "inv-1", store=store, ttl=5, info={"role": "billing"}) as locked:
        lock = _lock_of(coll, "inv-1")
        assert lock["owner"] == locked.owner and lock["fence"] == locked.fence
        assert lock["holder"]["role"] == "billing" and lock["holder"]["pid"] == os.getpid()
        result = locked.update_one({"$set": {"state": "paid"}, "$inc": {"total": 5}})
        assert result == DocumentWrite(modified=True, fence=locked.fence)
        assert locked.update_one([{"$set": {"seen": True}}]).modified
    doc = coll.find_one({"_id": "inv-1"})
    assert doc is not None
    assert {k: v for k, v in doc.items() if k != "mongolock"} == {
        "_id": "inv-1",
        "state": "paid",
        "total": 15,
        "seen": True,
    }
    lock = doc["mongolock"]
    assert lock["owner"] is None and lock["expires_at"] is None and lock["holder"] is None
    assert lock["fence"] == locked.fence  # kept: the next holder's is larger
    assert locked.released and not locked.lost
    with pytest.raises(DocumentLockLost, match="released"):
        locked.update_one({"$set": {"state": "late"}})


@pytest.mark.parametrize(
    "_id",
    [ObjectId(), 42, uuid.uuid4(), {"tenant": 1, "n": 2}, _dt.datetime(2026, 1, 1, tzinfo=_dt.timezone.utc)],
)
def test_any_bson_id_and_fences_increase_per_document(
    store: LeaseStore, client: Any, db_name: str, _id: Any
) -> None:
    coll = client[db_name].get_collection(
        "records", codec_options=CodecOptions(tz_aware=True, uuid_representation=UuidRepresentation.STANDARD)
    )
    coll.insert_one({"_id": _id, "x": 1})
    fences = []
    for _ in range(3):
        with DocumentLock(coll, {"_id": _id, "x": 1}, store=store, ttl=2) as locked:
            locked.update_one({"$inc": {"x": 1}})
            fences.append(locked.fence)
    assert fences == sorted(set(fences))
    coll.delete_one({"_id": _id})  # made again: its fences still go up (the server's clock)
    coll.insert_one({"_id": _id, "x": 0})
    with DocumentLock(coll, {"_id": _id}, store=store, ttl=2) as locked:
        assert locked.fence > fences[-1]


def test_contention_between_two_holders(store: LeaseStore, make_store: Any, coll: Any, db_name: str) -> None:
    coll.insert_one({"_id": "acct-7", "balance": 0})
    other = make_store()
    theirs = other.client[db_name]["invoices"]
    with DocumentLock(coll, "acct-7", store=store, ttl=5, info={"role": "first"}) as first:
        with pytest.raises(LockContended) as exc, DocumentLock(theirs, "acct-7", store=other, ttl=5):
            pass
        assert exc.value.holder["role"] == "first"
        assert "invoices['acct-7']" in str(exc.value)
        first.update_one({"$inc": {"balance": 1}})
    # Waiting: the second holder gets it when the first releases.
    second = DocumentLock(theirs, "acct-7", store=other, ttl=5, wait=30)
    with DocumentLock(coll, "acct-7", store=store, ttl=5) as held:
        fence = held.fence
    with second as locked:
        assert locked.fence > fence
        locked.update_one({"$inc": {"balance": 1}})
    assert coll.find_one({"_id": "acct-7"})["balance"] == 2


def test_heartbeat_keeps_it_past_its_ttl_in_one_update_per_collection(
    store: LeaseStore, coll: Any, counter: Any
) -> None:
    coll.insert_many([{"_id": i} for i in range(3)])
    locks = [DocumentLock(coll, i, store=store, ttl=3.0, heartbeat_seconds=0.3) for i in range(3)]
    held = [lock.__enter__() for lock in locks]
    try:
        first = held[0].expires_at
        assert first is not None

        def renewed_past_ttl() -> bool:
            info = inspect_document(store, held[0].document)
            assert info is not None and info.renewed_at is not None
            return info.renewed_at > first

        counter.clear()
        wait_for(renewed_past_ttl, timeout=30, message="a renewal after the first expiry")
        # One update_many renews all three documents of the collection (never one command per lock).
        updates = [c for name, c in counter.commands if name == "update" and c.get("update") == "invoices"]
        assert updates and all(len(c["updates"]) == 1 and c["updates"][0]["multi"] for c in updates)
        for lease in held:
            assert not lease.lost
            assert lease.update_one({"$set": {"alive": True}}).modified
    finally:
        for lock in reversed(locks):
            lock.__exit__(None, None, None)
    assert coll.count_documents({"alive": True}) == 3


def test_writes_after_loss_are_refused_and_the_block_fails(store: LeaseStore, coll: Any) -> None:
    coll.insert_one({"_id": "inv-2", "state": "open"})
    lock = DocumentLock(coll, "inv-2", store=store, ttl=5)
    locked = lock.__enter__()
    assert force_release_document(store, locked.document)
    with pytest.raises(DocumentLockLost) as exc:
        locked.update_one({"$set": {"state": "stale"}})
    assert exc.value.fence == locked.fence and locked.lost
    with pytest.raises(DocumentLockLost, match="no longer"):  # the block ended normally: not protected
        lock.__exit__(None, None, None)
    assert coll.find_one({"_id": "inv-2"})["state"] == "open"
    info = inspect_document(store, LockedDocument("invoices", "inv-2", "mongolock"))
    assert info is not None and not info.held and info.forced_release


def test_a_late_write_after_a_takeover_is_refused(
    store: LeaseStore, make_store: Any, coll: Any, db_name: str
) -> None:
    """A holder whose lock expired and was taken (a pause past the lease) cannot write any more."""
    coll.insert_one({"_id": "inv-3", "v": 0})
    lock = DocumentLock(coll, "inv-3", store=store, ttl=1.0)
    paused = lock.try_acquire()[0]
    assert paused is not None
    store.forget(paused)  # no heartbeat: as if the process were paused
    other = make_store()
    with DocumentLock(other.client[db_name]["invoices"], "inv-3", store=other, ttl=5, wait=30) as newer:
        newer.update_one({"$set": {"v": 2}})
        paused._deadline = float("inf")  # the paused holder still believes it holds the lock
        with pytest.raises(DocumentLockLost):
            paused.update_one({"$set": {"v": 1}})
    assert coll.find_one({"_id": "inv-3"})["v"] == 2


HOLDER = textwrap.dedent(
    """
    import sys, time
    from pymongo import MongoClient
    from celery_mongolock import DocumentLock, LeaseStore
    url, db = sys.argv[1], sys.argv[2]
    store = LeaseStore(url, database=db)
    coll = store.client[db]["invoices"]
    lock = DocumentLock(coll, "inv-9", store=store, ttl=1.5)
    locked = lock.__enter__()
    print(locked.fence, flush=True)
    sys.stdin.read()
    """
)


def test_a_killed_holders_lock_is_taken_after_its_expiry_on_the_server(
    store: LeaseStore, coll: Any, mongo_url: str, db_name: str
) -> None:
    coll.insert_one({"_id": "inv-9", "v": 0})
    with subprocess.Popen(
        [sys.executable, "-c", HOLDER, mongo_url, db_name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    ) as proc:
        try:
            assert proc.stdout is not None
            dead_fence = int(proc.stdout.readline())
            before = inspect_document(store, LockedDocument("invoices", "inv-9", "mongolock"))
            assert before is not None and before.held and before.fence == dead_fence
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            # The dead holder's last renewal set its expiry; nobody may take the lock before it.
            last = _lock_of(coll, "inv-9")["expires_at"]
            with DocumentLock(coll, "inv-9", store=store, ttl=5, wait=60) as locked:
                assert locked.fence > dead_fence
                assert locked.acquired_at is not None and locked.acquired_at >= last
                locked.update_one({"$set": {"v": 1}})
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


# -- bad input -----------------------------------------------------------------------------------------------
def test_a_missing_document(store: LeaseStore, coll: Any) -> None:
    with pytest.raises(DocumentMissing, match=r"no document .*invoices\['nope'\]"):
        DocumentLock(coll, "nope", store=store).acquire()
    assert coll.count_documents({}) == 0  # nothing was created


def test_a_document_without_an_id(store: LeaseStore, coll: Any) -> None:
    with pytest.raises(ConfigurationError, match="has no _id"):
        DocumentLock(coll, {"state": "open"}, store=store)
    with pytest.raises(ConfigurationError, match="got None"):
        DocumentLock(coll, None, store=store)


def test_a_collection_on_another_database(store: LeaseStore, client: Any) -> None:
    with pytest.raises(ConfigurationError, match="in database 'elsewhere', but the store's database"):
        DocumentLock(client["elsewhere"]["invoices"], 1, store=store)


def test_a_collection_on_another_deployment(store: LeaseStore, db_name: str) -> None:
    elsewhere: MongoClient[dict[str, Any]] = MongoClient("mongodb://192.0.2.1:27999", connect=False)
    try:
        with pytest.raises(ConfigurationError, match="another MongoDB deployment"):
            DocumentLock(elsewhere[db_name]["invoices"], 1, store=store)
    finally:
        elsewhere.close()


def test_a_field_name_collision(store: LeaseStore, coll: Any) -> None:
    coll.insert_one({"_id": "inv-4", "mongolock": "the user's own value"})
    with pytest.raises(ConfigurationError, match="has a field 'mongolock' of its own"):
        DocumentLock(coll, "inv-4", store=store).acquire()
    assert coll.find_one({"_id": "inv-4"})["mongolock"] == "the user's own value"  # untouched
    with DocumentLock(coll, "inv-4", store=store, field="lock") as locked:  # another field works
        locked.update_one({"$set": {"ok": 1}})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"field": "a.b"}, "plain top-level field"),
        ({"field": "_id"}, "plain top-level field"),
        ({"field": "$x"}, "plain top-level field"),
        ({"ttl": 0}, "ttl must be between"),
        ({"ttl": 1, "heartbeat_seconds": 1}, "heartbeat_seconds"),
        ({"wait": -1}, "wait"),
    ],
)
def test_bad_arguments(store: LeaseStore, coll: Any, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        DocumentLock(coll, 1, store=store, **kwargs)


def test_not_a_collection(store: LeaseStore) -> None:
    with pytest.raises(ConfigurationError, match="needs a pymongo Collection, got str"):
        DocumentLock("invoices", 1, store=store)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("update", "match"),
    [
        ({"state": "paid"}, "with operators"),
        ({"$set": {"mongolock.owner": "me"}}, "may not write the lock's own field"),
        ({"$unset": {"mongolock": ""}}, "may not write the lock's own field"),
        ({"$rename": {"state": "mongolock"}}, "may not write the lock's own field"),
        ([{"$set": {"mongolock": None}}], "may not write the lock's own field"),
        ([{"$unset": "mongolock"}], "may not write the lock's own field"),
        ([{"$replaceWith": {"a": 1}}], "pipelines of \\$set"),
        ([], "non-empty pipeline"),
    ],
)
def test_updates_that_would_touch_the_lock_are_refused(
    store: LeaseStore, coll: Any, update: Any, match: str
) -> None:
    coll.insert_one({"_id": "inv-5", "state": "open"})
    with DocumentLock(coll, "inv-5", store=store, ttl=5) as locked:
        with pytest.raises(ConfigurationError, match=match):
            locked.update_one(update)
        assert not locked.lost and _lock_of(coll, "inv-5")["owner"] == locked.owner


# -- the CLI (its commands, in this process: test_cli.run) ---------------------------------------------------
def test_cli_inspects_and_force_releases_a_document_lock(
    make_store: Any, mongo_url: str, db_name: str
) -> None:
    from .test_cli import run

    store = make_store()
    coll = store.client[db_name]["invoices"]
    oid = ObjectId()
    coll.insert_many([{"_id": oid, "state": "open"}, {"_id": "never-locked"}])
    where = ["--collection", f"{db_name}.invoices", "--id-json", f'{{"$oid": "{oid}"}}']
    lock = DocumentLock(coll, oid, store=store, ttl=30, info={"role": "billing"})
    locked = lock.__enter__()

    out = run(mongo_url, db_name, "inspect", *where)
    assert out.returncode == 0, out.stderr
    rows = dict(line.split(None, 1) for line in out.stdout.splitlines())
    assert rows["document"] == f"{db_name}.invoices[ObjectId('{oid}')]"
    assert rows["state"] == "held" and rows["fence"] == str(locked.fence) and rows["owner"] == locked.owner
    assert "role=billing" in rows["holder"] and 0 < float(rows["expires_in"].rstrip("s")) <= 30
    data = json.loads(run(mongo_url, db_name, "inspect", *where, "--json").stdout)
    assert data["held"] and data["holder"]["role"] == "billing" and data["fence"] == locked.fence

    never = run(mongo_url, db_name, "inspect", "--collection", "invoices", "--id", "never-locked")
    assert never.returncode == 0 and "never locked" in never.stdout
    missing = run(mongo_url, db_name, "inspect", "--collection", "invoices", "--id", "nope")
    assert missing.returncode == 1 and "no document" in missing.stderr

    refused = run(mongo_url, db_name, "release", *where)
    assert refused.returncode == 2 and "repeat with --force" in refused.stderr
    assert locked.update_one({"$set": {"state": "still mine"}}).modified  # not released

    out = run(mongo_url, db_name, "release", *where, "--force")
    assert out.returncode == 0 and "released the lock of" in out.stdout, out.stderr
    with pytest.raises(DocumentLockLost):
        locked.update_one({"$set": {"state": "stale"}})
    doc = coll.find_one({"_id": oid})
    assert doc["state"] == "still mine" and doc["mongolock"]["owner"] is None
    again = run(mongo_url, db_name, "release", *where, "--force")
    assert again.returncode == 0 and "is free" in again.stdout
    after = json.loads(run(mongo_url, db_name, "inspect", *where, "--json").stdout)
    assert not after["held"] and after["forced_release"]
    with pytest.raises(DocumentLockLost):
        lock.__exit__(None, None, None)


def test_an_uncontended_block_with_one_write_is_three_commands(
    store: LeaseStore, coll: Any, counter: Any
) -> None:
    coll.insert_one({"_id": "c", "n": 0})
    counter.clear()
    with DocumentLock(coll, "c", store=store, ttl=5) as locked:
        locked.update_one({"$inc": {"n": 1}})
    assert counter.names() == ["findAndModify", "update", "update"]  # take, write, release


def test_the_how_to_runs_as_written(mongo_url: str, client: Any) -> None:
    """docs/how-to/document-lock.md's program, run as a user would (it uses the database ``shop``)."""
    from .test_docs import blocks

    [block] = [
        b for b in blocks(ROOT / "docs" / "how-to" / "document-lock.md") if b.body.startswith("# billing.py")
    ]
    client.drop_database("shop")
    try:
        out = subprocess.run(
            [sys.executable, "-c", block.body],
            env={**os.environ, "MONGO_URL": mongo_url},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines() == ["paid", "already paid", "{'state': 'paid', 'paid': 120}"]
    finally:
        client.drop_database("shop")


# -- the holder's write is sent once: "not applied" is never said of an applied write -----------------------


class _Updates(monitoring.CommandListener):
    """The ``update`` commands a client sends to one collection, as sent."""

    def __init__(self, collection: str) -> None:
        self.collection = collection
        self.sent: list[dict[str, Any]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name == "update" and event.command.get("update") == self.collection:
            self.sent.append(dict(event.command))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def _field(coll: Any, _id: Any, name: str) -> Any:
    doc = coll.find_one({"_id": _id})
    assert doc is not None
    return doc[name]


def _arm(url: str, **data: Any) -> None:
    c: MongoClient[dict[str, Any]] = MongoClient(url)
    try:
        c.admin.command("configureFailPoint", "failCommand", mode={"times": 1}, data=data)
    finally:
        c.close()


def test_a_write_whose_answer_is_lost_is_unknown_and_never_sent_twice(own_server: Any) -> None:
    """The seed-2 ``fenced-but-applied``: a retryable write whose first attempt landed, retried by pymongo
    with the same ``txnNumber`` and judged again by the embedded server (its record of the first attempt
    is written after the write, so a retry that arrives meanwhile runs again) after the lock's expiry:
    "no match", said of an applied write. Here the first attempt lands and its answer says it may not
    have (a write-concern error labelled retryable, which pymongo retries): the write is sent once, and
    its outcome is ``DocumentWriteUnknown``, never ``DocumentLockLost``."""
    server = own_server(enable_test_commands=True)
    updates = _Updates("invoices")
    client: MongoClient[dict[str, Any]] = MongoClient(server.url, tz_aware=True, event_listeners=[updates])
    store = LeaseStore(client, database="doclock", lease_seconds=60)
    coll = client["doclock"]["invoices"]
    try:
        coll.insert_one({"_id": "inv", "paid": 0})
        lock = DocumentLock(coll, "inv", store=store, ttl=120, heartbeat_seconds=60)  # no renewal meanwhile
        locked = lock.__enter__()
        # 1. Applied, and its answer says its write concern failed (pymongo would retry it).
        _arm(
            server.url,
            failCommands=["update"],
            writeConcernError={"code": 91, "errmsg": "injected"},
            errorLabels=["RetryableWriteError"],
        )
        updates.sent.clear()
        with pytest.raises(DocumentWriteUnknown, match="may or may not") as exc:
            locked.update_one({"$inc": {"paid": 1}})
        assert isinstance(exc.value, StoreUnavailable) and exc.value.fence == locked.fence
        assert len(updates.sent) == 1 and "txnNumber" not in updates.sent[0]
        assert _field(coll, "inv", "paid") == 1 and not locked.lost
        # 2. The connection dropped with the command in flight: unknown, sent once.
        _arm(server.url, failCommands=["update"], closeConnection=True)
        updates.sent.clear()
        with pytest.raises(DocumentWriteUnknown, match="no answer"):
            locked.update_one({"$inc": {"paid": 1}})
        assert len(updates.sent) == 1 and _field(coll, "inv", "paid") in (1, 2)
        paid = _field(coll, "inv", "paid")
        # 3. Answered: applied once.
        updates.sent.clear()
        assert locked.update_one({"$inc": {"paid": 1}}).modified
        assert len(updates.sent) == 1 and _field(coll, "inv", "paid") == paid + 1
        # 4. A refusal is one command judged once: definite, nothing written.
        assert force_release_document(store, locked.document)
        updates.sent.clear()
        with pytest.raises(DocumentLockLost):
            locked.update_one({"$inc": {"paid": 1}})
        assert len(updates.sent) == 1 and _field(coll, "inv", "paid") == paid + 1
        with pytest.raises(DocumentLockLost):  # the block's end: it was not protected to the end
            lock.__exit__(None, None, None)
    finally:
        store.close()
        client.close()


def test_a_retryable_write_is_retried_by_pymongo_with_the_same_txn_number(own_server: Any) -> None:
    """The fact the fix rests on: a plain ``update_one`` (a retryable write) whose answer says "retry" is
    sent again by pymongo with the same ``lsid`` and ``txnNumber``, so its reply may be a second
    judgement; ``locked.update_one`` sends its command once, without a ``txnNumber``."""
    server = own_server(enable_test_commands=True)
    updates = _Updates("plain")
    client: MongoClient[dict[str, Any]] = MongoClient(server.url, event_listeners=[updates])
    try:
        coll = client["doclock"]["plain"]
        coll.insert_one({"_id": 1, "n": 0})
        _arm(
            server.url,
            failCommands=["update"],
            writeConcernError={"code": 91, "errmsg": "injected"},
            errorLabels=["RetryableWriteError"],
        )
        assert coll.update_one({"_id": 1}, {"$inc": {"n": 1}}).matched_count == 1
        first, second = updates.sent
        assert (first["lsid"], first["txnNumber"]) == (second["lsid"], second["txnNumber"])
        assert _field(coll, 1, "n") == 1  # the embedded server replayed the first answer
    finally:
        client.close()
