"""Loss noticed at once (issue 29 item 3): one change stream per process watches the leases it holds.

Every test that claims the stream noticed a loss runs its holder with a heartbeat interval far longer than
the test's deadline (``SLOW_BEAT``) and checks that the heartbeat never ticked: only the stream could have
told. Real parts throughout: the embedded server (a replica set with change streams; ``--standalone`` for
one without), the real ``celery mongolock release --force`` in a subprocess, fail points for a stream
that breaks.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import threading
from typing import Any

import pytest
from celery import Celery
from pymongo import MongoClient

from celery_mongolock import LeaseStore
from celery_mongolock.config import get_store
from celery_mongolock.core.documents.changes import Verdict, holds, loss_events_pipeline
from celery_mongolock.integration import signals
from celery_mongolock.integration.config import read_settings
from celery_mongolock.lease import Lease
from celery_mongolock.ops.testing import configure

from .conftest import CommandCounter
from .servers import wait_for
from .test_cli import real_run as run_cli

#: Lease and renewal interval of the holders below: no renewal tick within any test's deadline.
LEASE, SLOW_BEAT = 900.0, 400.0
DEADLINE = 60.0  # seconds: how long a test waits for a notice (far less than SLOW_BEAT)


def held(store: LeaseStore, key: str, **kwargs: Any) -> Lease:
    lease = store.acquire(key, ttl=LEASE, heartbeat=True, heartbeat_seconds=SLOW_BEAT, **kwargs)
    assert lease is not None
    return lease


def watching(store: LeaseStore) -> None:
    watch = store.heartbeat.watch
    assert watch is not None
    wait_for(lambda: watch.watching, timeout=DEADLINE, message="the lease watch to open its stream")


def noticed_by_the_stream(store: LeaseStore, lease: Lease) -> str:
    """Wait for ``lease`` to be lost, and check that the heartbeat had no part in it."""
    assert lease.wait_lost(DEADLINE), f"{lease!r} was not noticed lost"
    assert store.heartbeat.ticks == 0, "the heartbeat ticked: the notice may be its own"
    reason = lease.lost_reason
    assert reason is not None and "change stream" in reason, reason
    return reason


# -- what the stream lets through, and what a document says of a lease -----------------------------------


def test_verdicts_compare_token_and_fence() -> None:
    single = {"owner": "me", "fence": 10}
    assert holds(single, "me", 10, None) == Verdict.HELD
    assert holds({"owner": "other", "fence": 11}, "me", 10, None) == Verdict.GONE  # taken over
    assert holds({"owner": None, "fence": 10, "forced_release": True}, "me", 10, None) == Verdict.GONE
    assert (
        holds({"owner": "before-us", "fence": 9}, "me", 10, None) == Verdict.STALE
    )  # read before we took it
    assert holds(None, "me", 10, None) == Verdict.GONE  # read after we took it: deleted
    slotted = {"owner": None, "fence": 12, "hs": [{"o": "me", "f": 10}, {"o": "other", "f": 12}]}
    assert holds(slotted, "me", 10, 0) == Verdict.HELD  # a newer hold of another slot is not ours to mind
    assert holds({"fence": 12, "hs": [{"o": "other", "f": 12}]}, "me", 10, 0) == Verdict.GONE
    assert holds({"fence": 9, "hs": []}, "me", 10, 0) == Verdict.STALE


def test_the_stream_passes_what_can_end_a_lease_and_no_renewal(make_store: Any) -> None:
    """The server-side filter, against the store's own commands: acquisitions, renewals and our own
    release (filtered out), a force release, slot holds (passed: the watcher decides by token), a
    deletion; and the release of a lease stored with another holder (filtered out). The stream is read
    after each step (up to a sentinel deletion), as the watcher reads it: ``updateLookup`` shows the
    document as it is when the event is read."""
    store = make_store(watch_leases=False)
    store.ensure_indexes()
    ours = (socket.gethostname(), os.getpid())  # the holder fields of this process's leases
    pipeline = loss_events_pipeline(*ours)
    seen: list[tuple[str, str]] = []
    with store.collection.watch(pipeline, full_document="updateLookup", max_await_time_ms=200) as stream:

        def step(n: int) -> None:  # a deletion always passes: read up to it
            store.collection.insert_one({"_id": f"sentinel{n}"})
            store.collection.delete_one({"_id": f"sentinel{n}"})
            wait_for(lambda: _drain(stream, seen) and ("delete", f"sentinel{n}") in seen, timeout=DEADLINE)

        theirs = store.acquire("theirs", ttl=30, info={"host": "elsewhere"})  # another process's, as stored
        assert theirs is not None and theirs.release()
        step(1)
        lease = store.acquire("k", ttl=30)
        assert lease is not None and (lease.holder["host"], lease.holder["pid"]) == ours
        lease.renew()
        lease.renew()
        assert lease.release()  # our own release: not passed
        step(2)
        lease = store.acquire("k", ttl=30)
        step(3)
        assert lease is not None and make_store(watch_leases=False).force_release("k")  # passed
        step(4)
        one, two = store.acquire("s", ttl=30, limit=2), store.acquire("s", ttl=30, limit=2)
        assert one is not None and two is not None
        step(5)
        assert store.renew_many([one, two]) == []  # renewals of holds: not passed
        step(6)
        assert one.release()  # passed: the document keeps a hold of ours
        step(7)
        assert two.release()  # not passed: our own release, and no hold of ours left
        store.collection.delete_one({"_id": "k"})
        step(8)
    seen = [(kind, key) for kind, key in seen if not key.startswith("sentinel")]
    # The acquisitions (an insert, then an update whose ends hold only our own release), the renewals and
    # our own release: not passed. The force release and the deletion: passed.
    assert [kind for kind, key in seen if key == "k"] == ["update", "delete"], seen
    # The slotted key: its first hold is an insert; the second hold and the release of the first change
    # ``hs`` of a document that keeps a hold of ours; the last release leaves none.
    assert [kind for kind, key in seen if key == "s"] == ["update", "update"], seen
    assert not any(key == "theirs" for _, key in seen), seen  # another holder's release: not ours to see


def _drain(stream: Any, seen: list[tuple[str, str]]) -> bool:
    while (event := stream.try_next()) is not None:
        seen.append((event["operationType"], event["documentKey"]["_id"]))
    return True


# -- the losses noticed at once ---------------------------------------------------------------------------


def test_a_force_release_from_the_cli_is_noticed_at_once_with_lease_lost(
    mongo_url: str, db_name: str
) -> None:
    """The real ``celery mongolock release --force`` in another process; the holder is an app's store
    (the one a worker uses), so the ``lease_lost`` signal is the one a worker sends."""
    app = Celery("lease_watch_cli", set_as_current=False)
    configure(app, mongo_url, db_name, mongolock_lease_seconds=LEASE, mongolock_heartbeat_seconds=SLOW_BEAT)
    got: list[dict[str, Any]] = []
    sent = threading.Event()

    def receiver(sender: Any, **kwargs: Any) -> None:
        got.append(kwargs)
        sent.set()

    signals.lease_lost.connect(receiver, weak=False)
    store = get_store(app)
    try:
        lease = held(store, "email-group:7", info={"task_name": "upload", "task_id": "t-7"})
        watching(store)
        out = run_cli(mongo_url, db_name, "release", "email-group:7", "--force")
        assert out.returncode == 0, out.stderr
        assert "released by force" in noticed_by_the_stream(store, lease)
        assert sent.wait(DEADLINE), "lease_lost was not sent"
        assert got[0]["key"] == "email-group:7" and got[0]["lease"] is lease
        assert "change stream" in got[0]["reason"]
        with pytest.raises(Exception, match="change stream"):
            lease.raise_if_lost()
    finally:
        signals.lease_lost.disconnect(receiver)
        store.client.drop_database(db_name)
        store.close()


def test_a_deletion_by_hand_is_noticed_at_once(
    make_store: Any, client: MongoClient[dict[str, Any]], db_name: str
) -> None:
    store = make_store()
    lease = held(store, "k")
    other = held(store, "k2")
    watching(store)
    client[db_name]["leases"].delete_one({"_id": "k"})
    assert "deleted" in noticed_by_the_stream(store, lease)
    assert other.held  # the other lease of the process is untouched


def test_a_takeover_after_expiry_is_noticed_at_once(
    make_store: Any, client: MongoClient[dict[str, Any]], db_name: str
) -> None:
    """The holder's lease expires on the server (its expiry moved into the past by hand: a real expiry
    needs a holder that stops renewing, and this one must keep its heartbeat to be watched), and another
    store takes the key with the real acquire."""
    store, taker = make_store(), make_store(watch_leases=False)
    lease = held(store, "k")
    watching(store)
    past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    client[db_name]["leases"].update_one({"_id": "k"}, {"$set": {"expires_at": past}})
    new = taker.acquire("k", ttl=30)
    assert new is not None and new.fence > lease.fence
    assert f"taken by another holder (fence {new.fence})" in noticed_by_the_stream(store, lease)
    new.release()


def test_one_stream_per_process_however_many_leases(
    client: MongoClient[dict[str, Any]], db_name: str, counter: CommandCounter, make_store: Any
) -> None:
    """60 leases (single ones and ``limit=N`` slots), taken and released in waves, renewed: one stream
    opened, one loss seen (the one forced), no renewal mistaken for a loss."""
    store = LeaseStore(client, database=db_name, lease_seconds=LEASE)
    try:
        leases = [held(store, f"k{i}") for i in range(40)]
        leases += [held(store, f"slots{i % 5}", limit=4) for i in range(20)]  # 4 slots of 5 keys
        watching(store)
        for lease in leases[:10]:
            assert lease.release()
        leases = leases[10:] + [held(store, f"again{i}") for i in range(10)]
        store.renew_many(leases)  # renewals of every lease and slot: updates of the watched documents
        operator = make_store(watch_leases=False)
        assert operator.force_release("k20")
        [forced] = [lease for lease in leases if lease.key == "k20"]
        noticed_by_the_stream(store, forced)
        store.renew_many(leases)
        watch = store.heartbeat.watch
        assert watch is not None
        # Other holders' leases come and go: none of it reaches this process's stream. A deletion passes
        # whoever held the document: deleting a document of no lease says the stream has read that far.
        # (Not one of the churned documents: an update of one read after its deletion has no document to
        # look at, and passes too; ci63.)
        keys: list[Any] = []
        on_event = watch.on_event

        def recorded(event: Any) -> None:
            keys.append((event.get("documentKey") or {}).get("_id"))
            on_event(event)

        watch.on_event = recorded  # type: ignore[method-assign]
        operator.collection.insert_one({"_id": "sentinel"})
        for i in range(30):
            other = operator.acquire(f"theirs{i % 3}", ttl=30, info={"host": "elsewhere"})
            assert other is not None and other.release()
        operator.collection.delete_one({"_id": "sentinel"})
        wait_for(lambda: "sentinel" in keys, timeout=DEADLINE, message="the sentinel deletion")
        assert not [key for key in keys if str(key).startswith("theirs")], keys
        streams = [
            c for name, c in counter.watch_commands if name == "aggregate" and "$changeStream" in str(c)
        ]
        assert len(streams) == 1 and watch.streams_opened == 1, streams
        assert not [c for name, c in counter.commands if name == "aggregate" and "$changeStream" in str(c)]
        assert [lease.key for lease in leases if lease.lost] == ["k20"] and watch.losses == 1
    finally:
        store.close()


def test_a_slot_taken_away_is_noticed_and_the_other_slots_stay_held(
    make_store: Any, client: MongoClient[dict[str, Any]], db_name: str
) -> None:
    store = make_store()
    a, b = held(store, "s", limit=3), held(store, "s", limit=3)
    watching(store)
    client[db_name]["leases"].update_one({"_id": "s"}, {"$pull": {"hs": {"o": a.owner}}})
    noticed_by_the_stream(store, a)
    store.renew_many([b])  # a renewal of the same document afterwards: not a loss
    assert b.held and not b.lost


# -- without change streams, and when the stream fails ----------------------------------------------------


def test_turned_off_the_heartbeat_notices_as_before(make_store: Any) -> None:
    store = make_store(watch_leases=False)
    lease = store.acquire("k", ttl=3, heartbeat=True, heartbeat_seconds=0.2)
    assert lease is not None and store.heartbeat.watch is None
    assert make_store(watch_leases=False).force_release("k")
    assert lease.wait_lost(DEADLINE)
    assert "renewal matched nothing" in (lease.lost_reason or "")
    settings = read_settings({"mongolock_watch_leases": False})
    assert settings.watch_leases is False


def test_a_server_without_change_streams_falls_back_to_the_heartbeat(own_server: Any) -> None:
    """A standalone server (the embedded one started with ``--standalone``) refuses ``$changeStream``:
    the watcher says so once and stops; the heartbeat notices the loss at its tick."""
    server = own_server(extra_args=["--standalone"])
    store = LeaseStore(server.url, lease_seconds=3)
    operator = LeaseStore(server.url, watch_leases=False)
    try:
        lease = store.acquire("k", heartbeat=True, heartbeat_seconds=0.2)
        assert lease is not None
        watch = store.heartbeat.watch
        assert watch is not None
        wait_for(lambda: watch.available is False, timeout=DEADLINE, message="the watcher to give up")
        assert watch.streams_opened == 0 and not watch.watching
        assert operator.force_release("k")
        assert lease.wait_lost(DEADLINE)
        assert "renewal matched nothing" in (lease.lost_reason or "")
        second = store.acquire("k2", heartbeat=True, heartbeat_seconds=0.2)
        assert second is not None and watch.thread is not None and not watch.thread.is_alive()
    finally:
        store.close()
        operator.close()


def _fail_point(url: str, mode: Any, **data: Any) -> None:
    c: MongoClient[dict[str, Any]] = MongoClient(url)
    try:
        c.admin.command("configureFailPoint", "failCommand", mode=mode, data=data)
    finally:
        c.close()


def test_a_broken_stream_is_reopened_and_what_happened_meanwhile_is_noticed(own_server: Any) -> None:
    """The stream's commands fail (a fail point on ``aggregate`` and ``getMore``); a force release happens
    while it is down; once the server answers again the stream is reopened and the loss is noticed (by the
    resumed stream, or by the renewal the watcher asks the heartbeat for at once: not at the next tick)."""
    server = own_server(enable_test_commands=True)
    store = LeaseStore(server.url, lease_seconds=LEASE)
    operator = LeaseStore(server.url, watch_leases=False)
    try:
        lease = held(store, "k")
        keep = held(store, "k2")
        watching(store)
        watch = store.heartbeat.watch
        assert watch is not None
        _fail_point(server.url, "alwaysOn", failCommands=["aggregate", "getMore"], errorCode=2)
        wait_for(lambda: watch.failures >= 1, timeout=DEADLINE, message="the stream to fail")
        assert operator.force_release("k")
        assert not lease.lost  # nobody can have told it yet
        before = keep.deadline  # (the heartbeat's own tick is SLOW_BEAT away: no renewal but the one asked)
        _fail_point(server.url, "off")
        assert lease.wait_lost(DEADLINE), "the loss during the outage was never noticed"
        wait_for(
            lambda: watch.watching and watch.streams_opened >= 2, timeout=DEADLINE, message="a new stream"
        )
        # The renewal the reopened stream asked for renewed the other lease; waited for, so that it cannot
        # be what notices the next loss (CI of stop 49: on a busy machine it came after the force release).
        wait_for(lambda: keep.deadline > before, timeout=DEADLINE, message="the renewal asked for at once")
        assert keep.held
        assert operator.force_release("k2")  # and the new stream sees the next loss by itself
        assert keep.wait_lost(DEADLINE) and "change stream" in (keep.lost_reason or "")
    finally:
        store.close()
        operator.close()
