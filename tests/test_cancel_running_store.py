"""``Replace(cancel_running=True)`` in the lease store, on the embedded server: a newer send that parks
behind a running holder marks it superseded in the same admit; the holder's process is told by its lease
watch (no heartbeat tick) or, on a server without change streams, at its heartbeat's tick; its fenced
writes are refused from then on, and the newest run takes the key with a larger fence when it is
released. Pure policy checks need no server."""

from __future__ import annotations

import time
from typing import Any

import pytest
from pymongo import MongoClient
from pymongo.errors import AutoReconnect

from celery_mongolock import (
    ConfigurationError,
    FencedOut,
    LeaseStore,
    Queue,
    Replace,
    StoreUnavailable,
    Superseded,
    fenced_update_one,
)
from celery_mongolock.admission.policies import check_keys, check_limit, parse_policy

from .servers import wait_for
from .test_admission_store import Handoffs, entry

KEY = "report:7"
#: Lease and renewal interval of holders that must learn from the stream alone: no tick within a test.
LEASE, SLOW_BEAT = 900.0, 400.0
DEADLINE = 60.0


def held(store: LeaseStore, stamp: int, **kwargs: Any) -> Any:
    lease, doc = store.admit(
        KEY,
        entry(stamp),
        ttl=kwargs.pop("ttl", LEASE),
        replace=True,
        cancel=True,
        heartbeat=True,
        heartbeat_seconds=kwargs.pop("heartbeat_seconds", SLOW_BEAT),
    )
    assert lease is not None and doc["lo"] == "acquired", doc
    assert lease.notice_supersession
    return lease


# -- the policy ----------------------------------------------------------------------------------------


def test_the_policy_takes_cancel_running_and_grace() -> None:
    policy = Replace(cancel_running=True, grace=2.5)
    assert policy.terminates and policy.grace == 2.5
    assert not Replace(cancel_running=True, grace=None).terminates  # cooperative only
    assert not Replace().cancel_running
    parsed = parse_policy({"policy": "replace", "cancel_running": True, "grace": 1}, "settings")
    assert parsed == Replace(cancel_running=True, grace=1)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: Replace(cancel_running=True, grace=-1), "Replace(grace=...) must be a number"),
        (
            lambda: Replace(cancel_running="yes"),  # type: ignore[arg-type]
            "Replace(cancel_running=...) must be True or False",
        ),
        (lambda: Replace(cancel_running=True, debounce=1.0), "cancel_running=True, debounce=1.0) is not"),
        (
            lambda: parse_policy({"policy": "queue", "cancel_running": True}, "on_contention"),
            "'cancel_running' is an option of 'replace' only",
        ),
        (lambda: parse_policy({"policy": "skip", "grace": 3}, "x"), "'grace' is an option of 'replace' only"),
        (lambda: check_limit(3, Replace(cancel_running=True)), "with limit=3 is not possible"),
        (
            lambda: check_keys(("a", "b"), None, Replace(cancel_running=True), {"b": 3}),
            "with limit 3 for the key 'b' of keys= is not possible",
        ),
        (
            lambda: check_keys(("a", "b"), None, Replace(cancel_running=True), 2),
            "with limit 2 for the key 'a' of keys= is not possible",
        ),
    ],
)
def test_bad_input_is_refused_in_our_words(make: Any, words: str) -> None:
    with pytest.raises(ConfigurationError, match=words.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_limit_one_and_plain_replace_stay_accepted() -> None:
    assert check_limit(1, Replace(cancel_running=True)) is None
    # keys=: every key a single lease (no limit, or a limit of 1 each)
    assert check_keys(("a", "b"), None, Replace(cancel_running=True)) == ("a", "b")
    assert check_keys(("a", "b"), None, Replace(cancel_running=True), {"a": 1}) == ("a", "b")
    assert check_limit(3, Replace()) == 3
    assert isinstance(parse_policy("queue"), Queue)


# -- the mark and the notice ---------------------------------------------------------------------------


def test_a_newer_send_marks_the_running_holder_and_the_stream_tells_it_at_once(store: LeaseStore) -> None:
    holder = held(store, 10)
    watch = store.heartbeat.watch
    assert watch is not None
    wait_for(lambda: watch.watching, timeout=DEADLINE, message="the lease watch to open its stream")
    assert not holder.superseded
    holder.raise_if_superseded()  # nothing yet

    told: list[str] = []
    holder.on_superseded(lambda lease, by: told.append(by))
    sent = time.monotonic()
    lease, doc = store.admit(KEY, entry(20), replace=True, cancel=True)
    assert lease is None and doc["lo"] == "parked"
    mark = (store.collection.find_one({"_id": KEY}) or {})["cx"]
    assert mark["o"] == holder.owner and mark["t"] == "task-20" and mark["f"] == holder.fence

    assert holder.wait_superseded(DEADLINE)
    noticed = time.monotonic() - sent
    assert store.heartbeat.ticks == 0, "the heartbeat ticked: the notice may be its own"
    assert holder.superseded and holder.superseded_by == "task-20" and not holder.lost
    assert holder.superseded_at is not None and sent <= holder.superseded_at <= time.monotonic()
    wait_for(lambda: told == ["task-20"], timeout=DEADLINE, message="the superseded callback")
    with pytest.raises(Superseded) as raised:
        holder.raise_if_superseded()
    assert raised.value.key == KEY and raised.value.by == "task-20" and "superseded" in str(raised.value)
    print(f"notice {noticed * 1000:.0f} ms after the newer send parked")


def test_a_second_newer_send_supersedes_the_parked_one_and_leaves_the_mark(store: LeaseStore) -> None:
    Handoffs(store)
    holder = held(store, 10)
    store.admit(KEY, entry(20), replace=True, cancel=True)
    _, doc = store.admit(KEY, entry(30), replace=True, cancel=True)
    assert doc["lo"] == "parked"
    stored = store.collection.find_one({"_id": KEY}) or {}
    assert [e["t"] for e in stored["q"]] == ["task-30"]
    assert [s["t"] for s in stored["sup"]] == ["task-20"]
    assert stored["cx"]["t"] == "task-20" and stored["cx"]["o"] == holder.owner


def test_an_older_send_does_not_supersede_the_holder(store: LeaseStore) -> None:
    holder = held(store, 20)
    _, doc = store.admit(KEY, entry(10), replace=True, cancel=True)
    assert doc["lo"] == "superseded"
    assert (store.collection.find_one({"_id": KEY}) or {}).get("cx") is None
    assert not holder.superseded


def test_without_cancel_running_the_holder_is_not_told(store: LeaseStore) -> None:
    lease, _ = store.admit(KEY, entry(10), replace=True, ttl=LEASE)
    assert lease is not None and not lease.notice_supersession
    store.admit(KEY, entry(20), replace=True)
    assert (store.collection.find_one({"_id": KEY}) or {}).get("cx") is None
    assert not lease.wait_superseded(0.5)


def test_without_change_streams_the_heartbeat_tells_the_holder(own_server: Any) -> None:
    server = own_server(extra_args=["--standalone"])
    store = LeaseStore(server.url, lease_seconds=3)
    try:
        lease, _ = store.admit(
            KEY, entry(10), replace=True, cancel=True, heartbeat=True, heartbeat_seconds=0.2
        )
        assert lease is not None
        store.admit(KEY, entry(20), replace=True, cancel=True)
        assert lease.wait_superseded(DEADLINE)
        watch = store.heartbeat.watch
        assert watch is not None and watch.available is False and watch.supersessions == 0
        assert lease.superseded_by == "task-20" and store.heartbeat.ticks >= 1
    finally:
        store.close()


# -- fenced writes ---------------------------------------------------------------------------------------


def test_the_superseded_holders_fenced_writes_are_refused_and_the_newest_run_writes(
    store: LeaseStore, client: MongoClient[dict[str, Any]], db_name: str
) -> None:
    handoffs = Handoffs(store)
    reports = client[db_name]["reports"]
    reports.insert_one({"_id": 7, "rows": 0})
    holder = held(store, 10)
    fenced_update_one(reports, {"_id": 7}, {"$set": {"rows": 1}}, holder)  # before: accepted

    store.admit(KEY, entry(20), replace=True, cancel=True)
    assert holder.wait_superseded(DEADLINE)
    with pytest.raises(FencedOut) as refused:
        fenced_update_one(reports, {"_id": 7}, {"$set": {"rows": 2}}, holder)
    assert refused.value.superseded_by == "task-20" and "superseded" in str(refused.value)
    assert (reports.find_one({"_id": 7}) or {})["rows"] == 1  # nothing written

    holder.release()  # the old run stops: its release hands the key to the newest send
    assert handoffs.tasks == ["task-20"]
    ho = handoffs.seen[0][1]
    newest, doc = store.admit(KEY, entry(20), claim=ho["tk"], replace=True, cancel=True)
    assert newest is not None and doc["lo"] == "claimed" and newest.fence > holder.fence
    fenced_update_one(reports, {"_id": 7}, {"$set": {"rows": 3}}, newest)
    # Even its bare fence (an int, not the lease) cannot write once the newer run has.
    with pytest.raises(FencedOut):
        fenced_update_one(reports, {"_id": 7}, {"$set": {"rows": 4}}, holder.fence)
    assert (reports.find_one({"_id": 7}) or {})["rows"] == 3
    assert not newest.superseded  # the old mark names the old token only
    newest.release()


def test_a_run_handed_the_key_before_a_newer_send_parked_claims_it_superseded(store: LeaseStore) -> None:
    """The key is handed to B (the holder's release); C is sent before B claims: C parks behind the pending
    handoff. B's claim marks B superseded by C in the same command, and B learns it with its claim."""
    handoffs = Handoffs(store)
    holder = held(store, 10)
    store.admit(KEY, entry(20), replace=True, cancel=True)
    assert holder.wait_superseded(DEADLINE)
    holder.release()
    [(_, ho)] = handoffs.seen
    _, doc = store.admit(KEY, entry(30), replace=True, cancel=True)
    assert doc["lo"] == "parked" and (store.collection.find_one({"_id": KEY}) or {})["ho"]["t"] == "task-20"
    claimed, doc = store.admit(KEY, entry(20), claim=ho["tk"], replace=True, cancel=True, ttl=LEASE)
    assert claimed is not None and doc["lo"] == "claimed"
    assert claimed.superseded and claimed.superseded_by == "task-30"
    claimed.release()
    assert handoffs.tasks == ["task-20", "task-30"]


def test_a_superseded_running_holder_is_in_the_history_beside_its_lease(store: LeaseStore) -> None:
    holder = held(store, 10)
    store.admit(KEY, entry(20), replace=True, cancel=True)
    assert holder.wait_superseded(DEADLINE)
    store.record_run_ending(KEY, "superseded", entry(10), fence=holder.fence, by="task-20", running=True)
    holder.release()
    assert store.flush_history(timeout=30)
    endings = store.history(KEY)
    [superseded] = [e for e in endings if e.how == "superseded"]
    assert superseded.task_id == "task-10" and superseded.by == "task-20" and not superseded.parked
    assert [e.how for e in endings if e.fence == holder.fence] == ["released", "superseded"]  # newest first


class _Unanswered:
    """The lease collection, whose next ``find_one_and_update`` (a release) gets no answer."""

    def __init__(self, collection: Any) -> None:
        self._collection = collection
        self.refused = 0

    def find_one_and_update(self, *args: Any, **kwargs: Any) -> Any:
        if not self.refused:
            self.refused += 1
            raise AutoReconnect("no answer (test)")
        return self._collection.find_one_and_update(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._collection, name)


def test_a_release_left_to_the_background_still_says_which_send_the_body_stopped_for(
    store: LeaseStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The body stopped for a newer send and MongoDB did not answer its release: the heartbeat's release
    records that send in the key's ending (``for``), as the release would have (before: it did not, and
    a copy of the run whose worker then died ended ``already-ran``)."""
    lease = held(store, 10)
    assert lease.mark_superseded("the-newer-send")
    lease.end_superseded()
    unanswered = _Unanswered(store.connection.collection)
    monkeypatch.setattr(type(store.connection), "collection", property(lambda _self: unanswered))
    with pytest.raises(StoreUnavailable):
        lease.release()
    assert unanswered.refused == 1
    wait_for(
        lambda: store.ended_superseded(KEY, "task-10", 0) == "the-newer-send",
        timeout=DEADLINE,
        message="the background release to record the newer send",
    )
