"""``unique_send`` records on the embedded server: one ``findAndModify`` claims a send, an equal send
gets the pending run, a record past its bound (server time) claims nothing, forget by task id, and two
producers at once: exactly one claims."""

from __future__ import annotations

import threading
import time

from celery_mongolock import LeaseStore
from celery_mongolock.core.documents.sends import send_digest
from celery_mongolock.core.store_sends import sends_of

from .conftest import CommandCounter

DIGEST = send_digest("t.upload", ["group:7"], {"group_id": 7})


def test_one_command_claims_and_an_equal_send_gets_the_pending_run(
    store: LeaseStore, counter: CommandCounter
) -> None:
    records = sends_of(store)
    assert records.claim(DIGEST, "a", "t.upload", ["group:7"], 60_000) == "a"  # (indexes made first)
    counter.clear()
    assert records.claim(DIGEST, "b", "t.upload", ["group:7"], 60_000) == "a"
    assert counter.names() == ["findAndModify"]  # one round trip per send
    [pending] = records.pending("group:7")
    assert pending.task_id == "a" and pending.task_name == "t.upload" and pending.keys == ("group:7",)
    assert pending.sent_at is not None and pending.until is not None and pending.until > pending.sent_at
    assert records.forget("a") and not records.forget("a")
    assert records.pending("group:7") == []
    assert records.claim(DIGEST, "c", "t.upload", ["group:7"], 60_000) == "c"  # after the start: new


def test_a_record_past_its_bound_claims_nothing(store: LeaseStore) -> None:
    records = sends_of(store)
    assert records.claim(DIGEST, "lost", "t.upload", ["group:7"], 300) == "lost"
    deadline = time.monotonic() + 30
    while records.claim(DIGEST, "next", "t.upload", ["group:7"], 60_000) != "next":
        assert time.monotonic() < deadline, "a record past its bound still claimed sends"
    [pending] = records.pending("group:7")
    assert pending.task_id == "next"


def test_two_producers_at_once_exactly_one_claims(make_store: object) -> None:
    stores: list[LeaseStore] = [make_store() for _ in range(6)]  # type: ignore[operator]
    for s in stores:
        sends_of(s).claim("warm-up", s.collection_name, "t", [], 1)  # connect, make the indexes
    start = threading.Barrier(len(stores))
    replies: dict[str, str] = {}

    def send(i: int) -> None:
        start.wait()
        replies[f"p{i}"] = sends_of(stores[i]).claim(DIGEST, f"p{i}", "t.upload", ["group:7"], 60_000)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = {tid for tid, got in replies.items() if got == tid}
    assert len(winners) == 1
    assert set(replies.values()) == winners
