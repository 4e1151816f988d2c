"""The lease contract (DESIGN.md, points 1-10), one section per point, against a real server."""

from __future__ import annotations

import datetime as dt
import itertools
import threading
import time
from typing import Any

import pytest
from pymongo import MongoClient
from pymongo.errors import OperationFailure
from pymongo.write_concern import WriteConcern

from celery_mongolock import ConfigurationError, LeaseLost, LeaseStore, LockContended, StoreUnavailable
from celery_mongolock.clock import MAX_DRIFT, SystemClock
from celery_mongolock.heartbeat import give_up_margin

from .conftest import CommandCounter
from .servers import wait_for

# -- 1. acquire is one atomic round trip; contention is an outcome -------------------------------------


def test_acquire_is_one_command_and_contention_returns_none(
    store: LeaseStore, counter: CommandCounter
) -> None:
    store.ensure_indexes()
    counter.clear()
    lease = store.acquire("email-group:42")
    assert lease is not None
    assert counter.names() == ["findAndModify"]
    counter.clear()
    assert store.acquire("email-group:42") is None
    assert counter.names() == ["findAndModify"]
    assert lease.held


def test_concurrent_acquires_of_a_fresh_key_have_one_winner(make_store: Any) -> None:
    stores = [make_store(lease_seconds=10) for _ in range(8)]
    for s in stores:
        s.ensure_indexes()
    for round_ in range(5):
        key = f"fresh:{round_}"
        barrier = threading.Barrier(len(stores))
        won: list[Any] = []

        def go(
            s: LeaseStore, key: str = key, barrier: threading.Barrier = barrier, won: list[Any] = won
        ) -> None:
            barrier.wait()
            lease = s.acquire(key)
            if lease is not None:
                won.append(lease)

        threads = [threading.Thread(target=go, args=(s,)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1, f"round {round_}: {len(won)} winners"


# -- 2. owner tokens ------------------------------------------------------------------------------------


def test_each_acquisition_has_a_fresh_owner_and_only_the_owner_can_renew_or_release(
    store: LeaseStore,
) -> None:
    first = store.acquire("k")
    assert first is not None
    assert first.release() is True
    second = store.acquire("k")
    assert second is not None
    assert second.owner != first.owner
    # The stale Lease object of the first acquisition can neither renew nor release the second one.
    with pytest.raises(LeaseLost):
        first.renew()
    assert first.release() is False
    info = store.inspect("k")
    assert info is not None and info.held and info.owner == second.owner


def test_stale_holder_cannot_release_a_taken_over_lease(make_store: Any) -> None:
    a, b = make_store(lease_seconds=0.5), make_store(lease_seconds=5)
    old = a.acquire("k")
    assert old is not None
    new = wait_for(lambda: b.acquire("k"), timeout=10, message="expiry of the first lease")
    assert old.release() is False  # its token no longer matches
    info = b.inspect("k")
    assert info is not None and info.held and info.owner == new.owner


def test_force_release_is_explicit_and_the_holder_learns_of_it(store: LeaseStore, make_store: Any) -> None:
    lost: list[str] = []
    lease = store.acquire("k", ttl=3, heartbeat=True, heartbeat_seconds=0.1)
    assert lease is not None
    lease.on_lost(lambda _lease, reason: lost.append(reason))
    operator = make_store()
    assert operator.force_release("k") is True
    assert operator.force_release("k") is False  # already free
    # The lost flag is set before the callbacks run (they run on a thread of their own): wait for both.
    wait_for(lambda: lease.lost and lost, timeout=5, message="the holder to notice the forced release")
    assert "released by force" in lost[0]
    with pytest.raises(LeaseLost):
        lease.raise_if_lost()


# -- 3. expiry is tested inside the acquire, not left to the TTL monitor -------------------------------


def test_expired_lease_is_taken_over_while_its_document_still_exists(make_store: Any) -> None:
    dead = make_store(lease_seconds=1)
    other = make_store(lease_seconds=5)
    lease = dead.acquire("k")
    assert lease is not None
    assert other.acquire("k") is None
    taken = wait_for(lambda: other.acquire("k"), timeout=10, message="takeover after expiry")
    assert taken.fence > lease.fence
    # The TTL monitor (every ~60 s) played no part: the old document was updated in place.
    assert other.collection.count_documents({"_id": "k"}) == 1


def test_ttl_index_exists_and_cleans_expired_documents_only(store: LeaseStore) -> None:
    store.ensure_indexes()
    store.ensure_indexes()  # idempotent
    indexes = {ix["name"]: ix for ix in store.collection.list_indexes()}
    assert indexes["gc_at_ttl"]["expireAfterSeconds"] == 0
    assert dict(indexes["gc_at_ttl"]["key"]) == {"gc_at": 1}
    assert "owner" in indexes
    assert "expires_at_ttl" not in indexes


def test_the_slot_heartbeat_is_served_by_an_index(store: LeaseStore) -> None:
    # limit=N: the heartbeat finds a process's slots by hs.o (its update every tick, its aggregate on loss);
    # without an index that is a collection scan at every tick of every process holding a slot.
    lease = store.acquire("tenant:a", limit=3)
    assert lease is not None
    indexes = {ix["name"]: ix for ix in store.collection.list_indexes()}
    assert dict(indexes["hs_o"]["key"]) == {"hs.o": 1}
    assert indexes["hs_o"]["sparse"] is True
    plan = store.collection.find({"hs.o": {"$in": [lease.owner]}}).explain()
    assert "IXSCAN" in repr(plan["queryPlanner"]["winningPlan"])
    assert store.renew_many([lease]) == []
    assert lease.release()


def test_the_ttl_index_of_earlier_versions_is_dropped(store: LeaseStore) -> None:
    # A TTL index on expires_at could delete a lease document with parked runs in it.
    store.collection.create_index("expires_at", name="expires_at_ttl", expireAfterSeconds=0)
    store.ensure_indexes()
    assert "expires_at_ttl" not in {ix["name"] for ix in store.collection.list_indexes()}


def test_ensure_indexes_from_many_processes_at_once(make_store: Any) -> None:
    stores = [make_store() for _ in range(6)]
    barrier = threading.Barrier(len(stores))
    errors: list[BaseException] = []

    def go(s: LeaseStore) -> None:
        barrier.wait()
        try:
            s.ensure_indexes()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_conflicting_index_is_a_clear_configuration_error(store: LeaseStore) -> None:
    store.collection.create_index("gc_at", name="gc_at_ttl", expireAfterSeconds=3600)
    with pytest.raises(ConfigurationError, match="conflicts with 'gc_at_ttl'"):
        store.ensure_indexes()


# -- 4. server time (see also test_clock_skew.py, which runs processes under libfaketime) --------------


def test_expiry_is_computed_by_the_server(store: LeaseStore, client: MongoClient[dict[str, Any]]) -> None:
    lease = store.acquire("k", ttl=60)
    assert lease is not None
    server_now = client.admin.command("hello")["localTime"]
    assert lease.expires_at is not None
    delta = (lease.expires_at - server_now.replace(tzinfo=dt.timezone.utc)).total_seconds()
    assert 55 < delta <= 61
    # The holder's own deadline is on the monotonic clock, never later than the server's expiry.
    assert lease.remaining <= 60 * (1 - MAX_DRIFT)


def test_acquire_and_renew_send_no_client_time(store: LeaseStore, counter: CommandCounter) -> None:
    """Nothing in what we send carries the worker's clock: expiry cannot depend on it."""
    store.ensure_indexes()
    counter.clear()
    lease = store.acquire("k", ttl=30)
    assert lease is not None
    lease.renew()
    lease.release()

    def has_datetime(value: Any) -> bool:
        if isinstance(value, dt.datetime):
            return True
        if isinstance(value, dict):
            return any(has_datetime(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return any(has_datetime(v) for v in value)
        return False

    assert len(counter.commands) == 3
    for name, command in counter.commands:
        assert not has_datetime(command), f"{name} carries a client-side datetime"


# -- 5. fencing ----------------------------------------------------------------------------------------


def test_fence_strictly_increases_across_release_expiry_takeover_and_deletion(
    store: LeaseStore, make_store: Any
) -> None:
    fences: list[int] = []

    def take(s: LeaseStore, ttl: float | None = None) -> Any:
        lease = wait_for(lambda: s.acquire("k", ttl=ttl), timeout=10, message="the key")
        assert lease is not None
        fences.append(lease.fence)
        return lease

    take(store).release()  # release
    take(store).release()
    take(store, ttl=0.5)  # expiry ...
    take(make_store())  # ... and takeover by another store
    store.force_release("k")  # forced release keeps the fence
    lease = take(store)
    lease.release()
    store.collection.delete_one({"_id": "k"})  # deleted by hand right after a release
    take(store).release()
    # deleted as the TTL monitor would delete it: only once expires_at has passed. The server's own TTL
    # monitor (every 60 s) may get there first: the document gone either way is what the step needs (CI of
    # stop 54: it was gone before this delete matched it, and the wait never ended).
    take(store, ttl=0.5)
    wait_for(
        lambda: (
            store.collection.delete_many(
                {"_id": "k", "$expr": {"$lt": [{"$toLong": "$expires_at"}, {"$toLong": "$$NOW"}]}}
            ).deleted_count
            or store.collection.find_one({"_id": "k"}) is None
        ),
        timeout=10,
        message="the lease to expire",
    )
    take(store)
    assert all(b > a for a, b in itertools.pairwise(fences)), fences


def test_fence_of_a_fresh_key_is_positive_and_int(store: LeaseStore) -> None:
    lease = store.acquire("fresh")
    assert lease is not None
    assert isinstance(lease.fence, int) and lease.fence > 0


# -- 6. the holder learns of loss ----------------------------------------------------------------------


def test_takeover_after_expiry_marks_the_old_lease_lost(make_store: Any) -> None:
    holder = make_store(lease_seconds=1)
    lease = holder.acquire("k")  # no heartbeat: it will expire
    assert lease is not None
    other = make_store()
    wait_for(lambda: other.acquire("k"), timeout=10, message="takeover")
    assert lease.lost  # its deadline passed
    with pytest.raises(LeaseLost):
        lease.renew()


def test_renewals_failing_until_the_deadline_mark_the_lease_lost_before_server_expiry(
    own_server: Any,
) -> None:
    server = own_server()
    s = LeaseStore(server.url, lease_seconds=3, operation_timeout=1)
    try:
        lost: list[str] = []
        lease = s.acquire("k", heartbeat=True, heartbeat_seconds=0.2)
        assert lease is not None
        lease.on_lost(lambda _l, reason: lost.append(reason))
        server.kill()  # MongoDB gone: renewals fail
        wait_for(lambda: lost, timeout=10, message="the heartbeat to give up")
        # It gave up before the deadline the server would apply, by the documented margin.
        assert lease.lost
        assert "failed" in lost[0]
    finally:
        server.start()  # back, so that close() does not wait for the renewal in flight to time out
        s.close()


def test_heartbeat_keeps_a_lease_alive_for_several_lease_lengths(make_store: Any) -> None:
    holder = make_store(lease_seconds=1)
    other = make_store()
    with holder.hold("k", heartbeat_seconds=0.2) as lease:
        start = lease.fence
        deadline_checks = 0
        # Keep checking that nobody can take it for 3 lease lengths.
        import time

        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            assert other.acquire("k") is None
            assert not lease.lost
            deadline_checks += 1
            time.sleep(0.2)
        assert deadline_checks > 5
        assert lease.fence == start
    assert other.acquire("k") is not None  # released on exit


# -- 7. write concern and read preference ---------------------------------------------------------------


def test_writes_are_majority_and_journaled_by_default(store: LeaseStore, counter: CommandCounter) -> None:
    assert store.write_concern.document == {"w": "majority", "j": True}
    store.ensure_indexes()
    counter.clear()
    lease = store.acquire("k")
    assert lease is not None
    lease.renew()
    lease.release()
    for name, command in counter.commands:
        assert command.get("writeConcern") == {"w": "majority", "j": True}, name


def test_write_concern_is_configurable(client: MongoClient[dict[str, Any]], db_name: str) -> None:
    s = LeaseStore(client, database=db_name, write_concern=WriteConcern(w=1))
    assert s.collection.write_concern.document == {"w": 1}


# -- 8. ambiguous outcomes -----------------------------------------------------------------------------


def _fail_point(server_url: str, **data: Any) -> None:
    c: MongoClient[dict[str, Any]] = MongoClient(server_url)
    try:
        c.admin.command("configureFailPoint", "failCommand", mode={"times": 1}, data=data)
    finally:
        c.close()


def test_acquire_retries_after_a_dropped_connection(own_server: Any) -> None:
    server = own_server(enable_test_commands=True)
    s = LeaseStore(server.url, lease_seconds=30)
    try:
        s.ensure_indexes()
        _fail_point(server.url, failCommands=["findAndModify"], closeConnection=True)
        lease = s.acquire("k")
        assert lease is not None
        info = s.inspect("k")
        assert info is not None and info.owner == lease.owner
    finally:
        s.close()


def test_acquire_whose_reply_never_comes_does_not_block_the_key_until_expiry(own_server: Any) -> None:
    server = own_server(enable_test_commands=True)
    s = LeaseStore(server.url, lease_seconds=60, operation_timeout=0.5)
    other = LeaseStore(server.url, lease_seconds=60)
    try:
        s.ensure_indexes()
        # The server holds the command for 1.5 s and then applies it: the client has long given up.
        _fail_point(server.url, failCommands=["findAndModify"], blockConnection=True, blockTimeMS=1500)
        with pytest.raises(StoreUnavailable):
            s.acquire("k")
        # The late write lands and takes the key for a lease nobody uses; the background release frees
        # it within seconds, not after the 60 s lease.
        wait_for(lambda: other.acquire("k"), timeout=15, message="the orphaned acquisition to be released")
    finally:
        s.close()
        other.close()


# -- 9. heartbeat: one round trip per tick, whatever the number of leases -----------------------------


def test_one_renewal_command_for_many_leases(store: LeaseStore, counter: CommandCounter) -> None:
    leases = [store.acquire(f"k{i}", ttl=30) for i in range(50)]
    assert all(leases)
    counter.clear()
    lost = store.renew_many([lease for lease in leases if lease is not None])
    assert lost == []
    assert counter.names() == ["update"]


def test_heartbeat_tick_renews_all_in_one_command_and_finds_the_lost_one(
    client: MongoClient[dict[str, Any]], db_name: str, counter: CommandCounter, make_store: Any
) -> None:
    # Without the lease watch: it would see the force release first, and the tick would find nothing lost.
    store = LeaseStore(client, database=db_name, lease_seconds=5, watch_leases=False)
    leases = [store.acquire(f"k{i}", ttl=30, heartbeat=True, heartbeat_seconds=10) for i in range(20)]
    assert all(leases)
    make_store().force_release("k7")
    counter.clear()
    assert store.heartbeat.tick()
    # One update for all; one read (an aggregate: single leases and slots alike) to learn which lease did
    # not match; one insert of the lease history (the holder's own view of the lease it lost), off every
    # task's path.
    assert counter.names() == ["update", "aggregate", "insert"]
    lost = [lease for lease in leases if lease is not None and lease.lost]
    assert [lease.key for lease in lost] == ["k7"]
    counter.clear()
    assert store.heartbeat.tick()
    assert counter.names() == ["update"]
    store.close()


def test_give_up_margin_is_before_the_deadline() -> None:
    class L:
        ttl = 30.0
        heartbeat_seconds = 10.0

    assert give_up_margin(L()) == 2.0  # type: ignore[arg-type]
    L.ttl, L.heartbeat_seconds = 1.0, 0.3
    assert give_up_margin(L()) == pytest.approx(0.1)  # type: ignore[arg-type]


# -- 10. bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lease_seconds": 0}, "lease_seconds must be between"),
        ({"lease_seconds": -1}, "lease_seconds must be between"),
        ({"lease_seconds": float("nan")}, "lease_seconds must be between"),
        ({"lease_seconds": "30"}, "lease_seconds must be a number"),
        ({"lease_seconds": True}, "lease_seconds must be a number"),
        ({"lease_seconds": 10, "heartbeat_seconds": 6}, "at most half of lease_seconds"),
        ({"lease_seconds": 10, "heartbeat_seconds": 0}, "heartbeat_seconds must be between"),
        ({"database": ""}, "database name"),
        ({"database": "a.b"}, "database name"),
        ({"collection": "$x"}, "collection name"),
        ({"operation_timeout": 0}, "operation_timeout"),
    ],
)
def test_bad_store_settings(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        LeaseStore("mongodb://127.0.0.1:1", **kwargs)


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("", "empty"),
        ("http://example.com", "not a valid MongoDB URL|must start with"),
        ("mongodb://", "not a valid MongoDB URL"),
        ("mongodb://user:s3cret@host:99999", "not a valid MongoDB URL"),
    ],
)
def test_bad_urls_are_rejected_without_leaking_passwords(url: str, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match) as info:
        LeaseStore(url)
    assert "s3cret" not in str(info.value)


def test_not_a_url_or_client() -> None:
    with pytest.raises(ConfigurationError, match=r"MongoDB URL or a pymongo\.MongoClient"):
        LeaseStore(42)  # type: ignore[arg-type]


def test_bad_acquire_arguments(store: LeaseStore) -> None:
    from celery_mongolock import InvalidKey

    with pytest.raises(InvalidKey, match="must not be empty"):
        store.acquire("")
    with pytest.raises(InvalidKey, match="must be a str"):
        store.acquire(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="ttl must be between"):
        store.acquire("k", ttl=0)
    with pytest.raises(ConfigurationError, match="heartbeat_seconds"):
        store.acquire("k", ttl=1, heartbeat_seconds=5)
    with pytest.raises(ConfigurationError, match="holder info key"):
        store.acquire("k", info={"$where": 1})
    with pytest.raises(ConfigurationError, match=r"holder info is [0-9]+ bytes"):
        store.acquire("k", info={"blob": "x" * 10_000})
    with pytest.raises(ConfigurationError, match="holder info cannot be stored"):
        store.acquire("k", info={"obj": object()})


def test_long_keys_are_hashed_readably_and_stay_distinct(store: LeaseStore) -> None:
    a = store.acquire("tenant:" + "a" * 500)
    b = store.acquire("tenant:" + "a" * 499 + "b")
    assert a is not None and b is not None
    assert a.key != b.key
    assert a.key.startswith("tenant:aaa") and "~sha256:" in a.key
    assert len(a.key.encode()) <= 200


def test_unicode_and_hostile_keys_round_trip(store: LeaseStore) -> None:
    for key in ["grüße:ключ:键", "a.b.c", "$dollar", "{json: 1}", "../../etc/passwd", "x" * 200]:
        lease = store.acquire(key)
        assert lease is not None, key
        info = store.inspect(key)
        assert info is not None and info.key == key and info.held
        assert lease.release()


# -- hold() --------------------------------------------------------------------------------------------


def test_hold_waits_then_raises_lock_contended_naming_the_holder(store: LeaseStore, make_store: Any) -> None:
    other = make_store()
    blocker = other.acquire("k", ttl=30, info={"task_name": "upload", "task_id": "abc"})
    assert blocker is not None
    with pytest.raises(LockContended) as exc, store.hold("k", wait=0.3):
        pass
    assert exc.value.key == "k"
    assert exc.value.holder["task_id"] == "abc"
    assert "task_name=upload" in str(exc.value)


def test_hold_gets_the_key_when_the_holder_releases(store: LeaseStore, make_store: Any) -> None:
    other = make_store()
    blocker = other.acquire("k", ttl=30)
    assert blocker is not None
    timer = threading.Timer(0.3, blocker.release)
    timer.start()
    with store.hold("k", wait=10) as lease:
        assert lease.held
    timer.join()
    info = store.inspect("k")
    assert info is not None and not info.held


class _NoChangeStreams:
    """A lease collection whose ``watch`` fails, as on a server without change streams."""

    def __init__(self, collection: Any) -> None:
        self._collection = collection

    def watch(self, *args: Any, **kwargs: Any) -> Any:
        raise OperationFailure("no change streams here")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._collection, name)


class _PollingStore(LeaseStore):
    @property
    def collection(self) -> Any:
        return _NoChangeStreams(super().collection)


class _RecordingClock(SystemClock):
    def __init__(self) -> None:
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        super().sleep(seconds)


def test_polling_waiter_never_sleeps_past_max_poll_interval(
    store: LeaseStore, mongo_url: str, db_name: str
) -> None:
    """Without change streams a waiter polls with jittered backoff; the jitter must not stretch a nap past
    ``max_poll_interval`` (it did, by up to half of it: a release went unseen for 1.5 s instead of 1)."""
    blocker = store.acquire("k", ttl=60)
    assert blocker is not None
    clock = _RecordingClock()
    poller = _PollingStore(mongo_url, database=db_name, clock=clock)
    try:
        began = time.monotonic()
        assert poller.wait_free("k", 2.0, poll_interval=0.05, max_poll_interval=0.2) is False
        assert time.monotonic() - began >= 2.0  # (it waited its whole timeout)
        assert clock.sleeps, "the waiter never polled"
        assert max(clock.sleeps) <= 0.2, clock.sleeps
        # It kept looking: more than one nap. (How many fit in 2 s depends on how long each look takes: 7
        # on a busy machine, ci85; the naps' cap is what this test is about.)
        assert len(clock.sleeps) >= 2, clock.sleeps
        timer = threading.Timer(0.3, blocker.release)
        timer.start()
        assert poller.wait_free("k", 10.0, poll_interval=0.05, max_poll_interval=0.2) is True
        timer.join()
    finally:
        poller.close()


def test_hold_releases_on_exception(store: LeaseStore) -> None:
    with pytest.raises(RuntimeError), store.hold("k"):
        raise RuntimeError("boom")
    info = store.inspect("k")
    assert info is not None and not info.held and info.released_at is not None


# -- inspect / list ------------------------------------------------------------------------------------


def test_inspect_and_list(store: LeaseStore) -> None:
    assert store.inspect("nothing") is None
    a = store.acquire("email-group:1", info={"task_name": "upload", "task_id": "t1"})
    b = store.acquire("email-group:2")
    c = store.acquire("tenant:1")
    assert a and b and c
    b.release()
    info = store.inspect("email-group:1")
    assert info is not None
    assert info.held and info.holder["task_id"] == "t1" and info.holder["pid"] > 0
    assert info.expires_in is not None and 0 < info.expires_in <= 5
    assert [i.key for i in store.list()] == ["email-group:1", "tenant:1"]
    assert [i.key for i in store.list(prefix="email-group:")] == ["email-group:1"]
    assert [i.key for i in store.list(prefix="email-group:", include_free=True)] == [
        "email-group:1",
        "email-group:2",
    ]
    assert [i.key for i in store.list(prefix="email-group.*")] == []  # prefix is literal, not a regex
    assert info.as_dict()["key"] == "email-group:1"


# -- faults ---------------------------------------------------------------------------------------------


def test_mongodb_down_fails_closed_with_a_clear_error(own_server: Any) -> None:
    server = own_server()
    url = server.url
    server.stop()
    s = LeaseStore(url, operation_timeout=1)
    try:
        with pytest.raises(StoreUnavailable, match="MongoDB did not answer while trying to"):
            s.acquire("k")
    finally:
        s.close()


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_store_given_a_url_makes_a_new_client_after_fork(mongo_url: str, db_name: str) -> None:
    import os

    s = LeaseStore(mongo_url, database=db_name)
    parent_client = s.client
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            ok = s.client is not parent_client and s.acquire("forked") is not None
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    os.close(read)
    assert s.client is parent_client
    s.close()


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_a_child_forked_while_another_thread_holds_the_locks_does_not_deadlock(
    mongo_url: str, db_name: str
) -> None:
    """The pool forks children at any time; a parent thread may be inside the store at that moment."""
    import os
    import signal
    import threading

    from celery_mongolock.integration import config

    s = LeaseStore(mongo_url, database=db_name)
    assert s.acquire("warm") is not None
    inside, leave = threading.Event(), threading.Event()

    def busy() -> None:
        with s.connection.state_lock, config._lock:
            inside.set()
            leave.wait(30)

    t = threading.Thread(target=busy)
    t.start()
    assert inside.wait(10)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            # as if the store had been made before an earlier fork: check_pid takes its lock
            s.connection.pid = -1
            with config._lock:
                ok = s.acquire("forked") is not None
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    leave.set()
    t.join()
    os.close(write)
    try:
        answered = wait_for(lambda: os.waitpid(pid, os.WNOHANG)[0] == pid, timeout=30, message="the child")
    finally:
        if not locals().get("answered"):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    os.close(read)
    s.close()


# -- minimum hold and once-per-tick ---------------------------------------------------------------------


def test_min_hold_keeps_the_key_after_an_early_release(store: LeaseStore, make_store: Any) -> None:
    other = make_store()
    lease = store.acquire("k", min_hold=1.0)
    assert lease is not None
    assert lease.release() is True
    info = store.inspect("k")
    assert info is not None and info.held and info.expires_in is not None and info.expires_in <= 1.0
    assert other.acquire("k") is None
    taken = wait_for(lambda: other.acquire("k"), timeout=10, message="the hold to end")
    assert taken.fence > lease.fence
    # Without a minimum hold a release frees the key at once.
    assert taken.release() and other.acquire("k") is not None


def test_a_release_after_the_min_hold_frees_at_once(store: LeaseStore) -> None:
    lease = store.acquire("k", min_hold=0.5)
    assert lease is not None
    import time

    time.sleep(0.6)  # outlive the hold: the duration itself is what is tested, not a synchronisation
    lease.release()
    info = store.inspect("k")
    assert info is not None and not info.held


def test_once_per_tick(store: LeaseStore, make_store: Any) -> None:
    other = make_store()
    first = store.acquire("job", tick=1000)
    assert first is not None
    assert other.acquire("job", tick=1000) is None  # held
    first.release()
    assert other.acquire("job", tick=1000) is None  # free, but that tick already ran
    assert other.acquire("job", tick=999) is None  # an older tick never runs after a newer one
    nxt = other.acquire("job", tick=1001)
    assert nxt is not None and nxt.fence > first.fence
    nxt.release()
    assert other.acquire("job") is not None  # a run without a tick is not affected


def test_a_tick_given_back_unrun_can_run_again_once(store: LeaseStore, make_store: Any) -> None:
    """A tick's run cut short gives its key back with ``untick``: the tick is no longer the key's last, so
    the run's message, delivered again, runs it (once); a give-back of another tick changes nothing."""
    other = make_store()
    first = store.acquire("job", tick=1000, info={"task_id": "t1", "delivery": "0.0"})
    assert first is not None
    assert store.give_back(first, untick=1000)
    # Its holder did not end a run there: a copy of its message is not taken for one that ended.
    assert not store.run_ended("job", ["t1/0.0"], task_id="t1", delivery="0.0", parked=False)
    again = other.acquire("job", tick=1000)
    assert again is not None  # the tick runs (before: refused as already run)
    again.release()
    assert other.acquire("job", tick=1000) is None  # once it ended, the tick has run
    late = store.acquire("job", tick=1001)
    assert late is not None
    assert store.give_back(late, untick=999)  # not the key's last tick: kept
    assert other.acquire("job", tick=1001) is None
    third = store.acquire("job", tick=1002)
    assert third is not None and store.give_back(third)
    assert other.acquire("job", tick=1002) is None  # given back without untick: the tick stays run


def test_a_slot_given_back_unrun_is_not_taken_for_a_run_that_ended(store: LeaseStore) -> None:
    """A ``limit=N`` hold given back (a run cut short, an attempt that did not get all its keys) is not the
    ending of a run: a copy of its message runs (before: its ending ``released`` made the copy
    ``already-ran``). A hold released after its run is still that run's ending."""
    info = {"task_id": "t1", "delivery": "0.0"}
    from celery_mongolock.core.outcomes import run_ended

    def ended() -> bool:
        # The whole document as MongoDB projects ``hs.h`` (the embedded server drops a field path through
        # an array of documents: docs/known-issues.md), and the store's own read.
        doc = store.collection.find_one({"_id": "slots"})
        judged = run_ended(doc, ["t1/0.0"], task_id="t1", delivery="0.0", parked=False)
        assert store.run_ended("slots", ["t1/0.0"], task_id="t1", delivery="0.0", parked=False) in (
            judged,
            False,
        )
        return judged

    assert store.acquire("slots", limit=2, info={"task_id": "other", "delivery": "0.0"})  # stays held
    given = store.acquire("slots", limit=2, info=info)
    assert given is not None and store.give_back(given)
    assert not ended()
    again = store.acquire("slots", limit=2, info=info)
    assert again is not None and again.release()
    assert ended()


def test_a_lease_released_unseen_in_the_background_still_names_its_run(store: LeaseStore) -> None:
    """A lease released in the background without being remembered as over (lost, or its acquire
    unanswered: ``unconfirmed``) is not a give-back: its run may have run, so a copy of its message is still
    taken for the run that ended (the holder fallback), on a single lease and on a slot. (A review found
    the give-back's marker on these too: a copy could then run a body that had run.)"""
    info = {"task_id": "t1", "delivery": "0.0"}
    single = store.acquire("bg", info=info)
    assert single is not None
    store.forget(single)
    assert store.release_tokens([single.owner], unconfirmed=[single.owner]) == 1
    assert store.run_ended("bg", ["t1/0.0"], task_id="t1", delivery="0.0", parked=False)
    from celery_mongolock.core.outcomes import run_ended

    assert store.acquire("bg-slots", limit=2, info={"task_id": "other", "delivery": "0.0"})
    slot = store.acquire("bg-slots", limit=2, info=info)
    assert slot is not None
    store.forget(slot)
    assert store.release_tokens([slot.owner], unconfirmed=[slot.owner]) == 1
    doc = store.collection.find_one({"_id": "bg-slots"})
    assert run_ended(doc, ["t1/0.0"], task_id="t1", delivery="0.0", parked=False)


def test_a_slot_s_tick_given_back_unrun_can_run_again(store: LeaseStore) -> None:
    """``limit=N`` with beat ticks: a slot given back with its tick takes the tick back, as a single lease
    does."""
    first = store.acquire("tick-slots", limit=2, tick=1000)
    assert first is not None and store.give_back(first, untick=1000)
    again = store.acquire("tick-slots", limit=2, tick=1000)
    assert again is not None and again.release()
    assert store.acquire("tick-slots", limit=2, tick=1000) is None  # once run, the tick has run


BUSY_SECONDS = 60.0


def test_at_exit_a_run_s_lease_still_held_is_given_back_unrun_with_its_tick(
    store: LeaseStore, make_store: Any
) -> None:
    """``release_held(unrun=True)``, a worker process's exit: a task run's lease still held belongs to a run
    that did not end (a SIGTERM between the key's take and the body's start), so it is given back unrun,
    with its beat tick, on a single lease and on a slot; a lease of no run is released as usual. Without
    ``unrun`` (``close()``) the run's lease is released as a run that ended. (Time enough to release them
    all, ``BUSY_SECONDS``: with the default, a worker's shutdown, one release was left to expire on a busy
    machine, ci75.)"""
    tick_info = {"task_id": "t1", "delivery": "0.0", "beat_tick": 1000}
    assert store.acquire("exit-job", tick=1000, heartbeat=True, info=tick_info) is not None
    assert store.acquire("exit-plain", heartbeat=True) is not None
    assert store.acquire("exit-slots", limit=2, heartbeat=True, info={"task_id": "t2", "delivery": "0.0"})
    assert store.release_held(BUSY_SECONDS, unrun=True) == 3
    assert not store.run_ended("exit-job", ["t1/0.0"], task_id="t1", delivery="0.0", parked=False)
    from celery_mongolock.core.outcomes import run_ended

    doc = store.collection.find_one({"_id": "exit-slots"})
    assert not run_ended(doc, ["t2/0.0"], task_id="t2", delivery="0.0", parked=False)
    other = make_store()
    again = other.acquire("exit-job", tick=1000)
    assert again is not None  # the tick runs again
    again.release()
    plain = store.inspect("exit-plain")
    assert plain is not None and not plain.held
    assert store.acquire("exit-ran", heartbeat=True, info={"task_id": "t3", "delivery": "0.0"})
    assert store.release_held(BUSY_SECONDS) == 1
    assert store.run_ended("exit-ran", ["t3/0.0"], task_id="t3", delivery="0.0", parked=False)
    # A run whose body ended (a SIGTERM after it, before its release: review), and a hold that names a task
    # but was not taken by the task layer (no delivery: a user's hold in a body), are released.
    ended = store.acquire("exit-ended", heartbeat=True, info={"task_id": "t4", "delivery": "0.0"})
    assert ended is not None
    ended.body_ended = True
    assert store.acquire("exit-users", heartbeat=True, info={"task_id": "t5"})
    assert store.release_held(BUSY_SECONDS, unrun=True) == 2
    assert store.run_ended("exit-ended", ["t4/0.0"], task_id="t4", delivery="0.0", parked=False)
    users = store.collection.find_one({"_id": "exit-users"})
    assert users is not None and users["owner"] is None and users.get("released_for") is None


def test_tick_and_hold_arguments_are_checked(store: LeaseStore) -> None:
    with pytest.raises(ConfigurationError, match="tick must be an int"):
        store.acquire("k", tick="5")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="min_hold"):
        store.acquire("k", min_hold=-1)


# -- regressions found in review ------------------------------------------------------------------------


def test_heartbeat_gives_up_before_the_deadline_with_default_timeouts(own_server: Any) -> None:
    import time

    server = own_server()
    s = LeaseStore(server.url, lease_seconds=3)  # default operation_timeout (10 s) and heartbeat (1 s)
    try:
        lost_at: list[float] = []
        lease = s.acquire("k", heartbeat=True)
        assert lease is not None
        lease.on_lost(lambda _l, _r: lost_at.append(time.monotonic()))
        server.kill()
        wait_for(lambda: lost_at, timeout=10, message="the heartbeat to give up")
        assert lost_at[0] < lease.deadline, "gave up after the deadline"
    finally:
        # Back, so that close() does not wait out the 10 s timeout of the renewal in flight (and the
        # heartbeat thread's 5 s join): 15 s of closing a store whose server is gone.
        server.start()
        s.close()


def test_every_operation_on_a_dead_server_raises_store_unavailable(own_server: Any) -> None:
    server = own_server()
    s = LeaseStore(server.url, lease_seconds=30, operation_timeout=0.5)
    lease = s.acquire("k")
    assert lease is not None
    server.kill()
    try:
        for action in (
            lambda: s.inspect("k"),
            s.list,
            lambda: s.force_release("k"),
            lambda: s.release_held_by(task_id="x"),
            lambda: s.acquire("other"),
            lease.renew,
        ):
            with pytest.raises(StoreUnavailable):
                action()
    finally:
        s.close()


def test_an_expired_lease_cannot_be_renewed_even_if_nobody_took_it(make_store: Any) -> None:
    s = make_store(lease_seconds=0.5)
    lease = s.acquire("k")
    assert lease is not None
    wait_for(lambda: not s.inspect("k").held, timeout=10, message="expiry")
    lease._deadline += 60  # pretend the holder's clock has not noticed: the server must still refuse
    with pytest.raises(LeaseLost):
        lease.renew()


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_a_forked_child_cannot_release_the_parents_lease(mongo_url: str, db_name: str) -> None:
    import os

    s = LeaseStore(mongo_url, database=db_name)
    lease = s.acquire("k", ttl=30)
    assert lease is not None
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            lease.release()
            with lease:
                pass
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    info = s.inspect("k")
    assert info is not None and info.held and info.owner == lease.owner
    assert lease.release()
    s.client.drop_database(db_name)
    s.close()


def test_hold_raises_lease_lost_when_the_block_outlived_its_lease(store: LeaseStore, make_store: Any) -> None:
    operator = make_store()

    def block() -> None:
        with store.hold("k", ttl=3, heartbeat_seconds=0.1) as lease:
            operator.force_release("k")
            wait_for(lambda: lease.lost, timeout=5, message="loss")

    with pytest.raises(LeaseLost):
        block()


def test_released_lease_is_no_protection(store: LeaseStore) -> None:
    lease = store.acquire("k")
    assert lease is not None
    lease.release()
    with pytest.raises(LeaseLost, match="released"):
        lease.raise_if_lost()


def test_a_slow_lost_callback_does_not_delay_other_renewals(store: LeaseStore, make_store: Any) -> None:
    import threading

    gate = threading.Event()
    a = store.acquire("a", ttl=2, heartbeat=True, heartbeat_seconds=0.1)
    b = store.acquire("b", ttl=2, heartbeat=True, heartbeat_seconds=0.1)
    assert a is not None and b is not None

    def slow(_lease: Any, _reason: str) -> None:
        gate.wait(10)  # blocks for a long time

    a.on_lost(slow)
    make_store().force_release("a")
    wait_for(lambda: a.lost, timeout=5, message="a lost")
    other = make_store()
    import time

    end = time.monotonic() + 4  # two lease lengths: b must stay renewed meanwhile
    while time.monotonic() < end:
        assert other.acquire("b") is None
        time.sleep(0.2)  # pacing of the probe, not a synchronisation
    gate.set()
    assert not b.lost


def test_a_lease_taken_after_a_release_gets_its_own_first_renewal(store: LeaseStore) -> None:
    """A tick planned for a lease since released must not renew the next lease early, for nothing."""
    first = store.acquire("hb-a", ttl=3, heartbeat=True, heartbeat_seconds=1)
    assert first is not None
    first.release()  # its tick, one second away, stays planned
    second = store.acquire("hb-b", ttl=30, heartbeat=True, heartbeat_seconds=10)
    assert second is not None
    planned = store.heartbeat._next_tick
    assert planned is not None and planned - store.clock.monotonic() > 8
    second.release()
