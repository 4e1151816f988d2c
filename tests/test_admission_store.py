"""Per-key admission in the lease store, on the embedded server: parking in send order, the handoff
inside the release, the claim, duplicates, barging, deadlines, the sweeper and Replace."""

from __future__ import annotations

import datetime as _dt
import threading
import uuid
from typing import Any

import pytest
from pymongo import MongoClient

from celery_mongolock import LeaseStore, MessageTooLarge

from .conftest import CommandCounter
from .servers import wait_for

KEY = "email-group:42"


def entry(stamp: int, task_id: str | None = None, **extra: Any) -> dict[str, Any]:
    tid = task_id or f"task-{stamp}"
    return {"id": f"{tid}/0.0", "t": tid, "n": "upload", "r": "0.0", "s": stamp, "m": b"msg", **extra}


class Handoffs:
    def __init__(self, store: LeaseStore) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []
        store.add_handoff_callback(self)

    def __call__(self, key: str, ho: dict[str, Any], doc: dict[str, Any]) -> None:
        self.seen.append((key, ho))

    @property
    def tasks(self) -> list[str]:
        return [ho["t"] for _, ho in self.seen]


def parked(store: LeaseStore, key: str = KEY) -> list[str]:
    doc = store.collection.find_one({"_id": key}) or {}
    return [e["t"] for e in doc.get("q") or []]


def test_runs_park_in_send_order_and_each_release_hands_the_key_to_the_oldest(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    holder = store.acquire(KEY, 30)
    assert holder is not None
    for stamp in (30, 10, 20):
        lease, doc = store.admit(KEY, entry(stamp))
        assert lease is None and doc["lo"] == "parked"
    assert parked(store) == ["task-10", "task-20", "task-30"]

    assert holder.release()
    assert handoffs.tasks == ["task-10"]
    ho = handoffs.seen[0][1]
    assert ho["m"] == b"msg" and ho["hn"] == 1
    doc = store.collection.find_one({"_id": KEY}) or {}
    assert doc["owner"] == ho["tk"] and doc["fence"] > holder.fence
    assert parked(store) == ["task-20", "task-30"]

    # Nobody barges in while the handoff is pending, and a plain acquire cannot take it either.
    assert store.acquire(KEY, 30) is None
    lease, doc = store.admit(KEY, entry(5, "newcomer"))
    assert doc["lo"] == "parked"

    # The handed run claims: it keeps the handoff's fence.
    claimed, doc = store.admit(KEY, entry(10), claim=ho["tk"])
    assert claimed is not None and doc["lo"] == "claimed"
    assert claimed.fence == (store.collection.find_one({"_id": KEY}) or {})["fence"]
    assert (store.collection.find_one({"_id": KEY}) or {}).get("ho") is None
    # A second copy of the handoff message does not run twice.
    _, doc = store.admit(KEY, entry(10), claim=ho["tk"])
    assert doc["lo"] == "running"
    claimed.release()
    assert handoffs.tasks == ["task-10", "newcomer"]


def test_copies_of_parked_and_finished_runs_are_recognised(store: LeaseStore) -> None:
    Handoffs(store)
    holder = store.acquire(KEY, 30)
    assert holder is not None
    store.admit(KEY, entry(1))
    _, doc = store.admit(KEY, entry(1))
    assert doc["lo"] == "dup"
    holder.release()
    ho = (store.collection.find_one({"_id": KEY}) or {})["ho"]
    _, doc = store.admit(KEY, entry(1))  # the original message delivered again while handed
    assert doc["lo"] == "dup"
    lease, _ = store.admit(KEY, entry(1), claim=ho["tk"])
    assert lease is not None
    lease.release()
    _, doc = store.admit(KEY, entry(1))  # and again after it ran
    assert doc["lo"] == "done"


def test_a_free_key_goes_to_the_oldest_send_first(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    # Parked runs on a key whose holder is gone (crafted: a holder that expired).
    holder = store.acquire(KEY, 30)
    assert holder is not None
    store.admit(KEY, entry(20))
    store.collection.update_one({"_id": KEY}, [{"$set": {"expires_at": "$$NOW"}}])
    # An older send arriving now takes the key at once; a newer one parks and hands it to the oldest.
    lease, doc = store.admit(KEY, entry(10))
    assert lease is not None and doc["lo"] == "acquired"
    lease.release()
    assert handoffs.tasks == ["task-20"]


def test_a_newer_send_on_a_free_key_with_runs_parked_parks_and_hands_over(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    holder = store.acquire(KEY, 30)
    assert holder is not None
    store.admit(KEY, entry(20))
    store.collection.update_one({"_id": KEY}, {"$set": {"owner": None}})  # released by an old version
    lease, doc = store.admit(KEY, entry(30))
    assert lease is None and doc["lo"] == "parked"
    assert handoffs.tasks == ["task-20"]
    assert parked(store) == ["task-30"]


def test_max_length_is_exact(store: LeaseStore) -> None:
    holder = store.acquire(KEY, 30)
    assert holder is not None
    outcomes = [store.admit(KEY, entry(i), max_length=3)[1]["lo"] for i in range(5)]
    assert outcomes == ["parked", "parked", "parked", "full", "full"]


def test_a_key_whose_document_cannot_take_another_message_is_full_not_unavailable(
    store: LeaseStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Replace runs of a set of keys (``keys=``, ``g``) parked on a key share the key's document (16 MiB; 1
    # MiB here, as the embedded server breaks under load with documents near 16 MiB): messages of a 16th of
    # it fill it after about 15; the next run is told "full" (its policy's then decides), never "MongoDB did
    # not answer". (Queue runs, of one key or several, are spilled instead: tests/test_spill_store.py,
    # test_spill_slots.py, test_stepwise_keys.py.)
    from celery_mongolock.core.documents import entries, spill

    budget = 2**20
    monkeypatch.setattr(entries, "PARK_BUDGET", budget)
    monkeypatch.setattr(spill, "PARK_BUDGET", budget)
    holders = [store.admit(KEY, entry(1000 + i), limit=2)[0] for i in range(2)]
    assert all(holders)
    big = b"x" * (budget // 16)
    outcomes = [
        store.admit(KEY, entry(i, m=big, ks=[KEY, "b:1"], g="ks:set"), limit=2)[1]["lo"] for i in range(18)
    ]
    assert outcomes[:14] == ["parked"] * 14 and outcomes[-1] == "full"
    assert set(outcomes) == {"parked", "full"} and outcomes.index("full") == outcomes.count("parked")
    assert len(parked(store)) == outcomes.count("parked")
    # A small run still parks behind them; the document is intact.
    assert store.admit(KEY, entry(100), limit=2)[1]["lo"] == "parked"


def test_a_message_too_large_to_park_anywhere_is_refused_in_our_words(store: LeaseStore) -> None:
    holder = store.acquire(KEY, 60)
    assert holder is not None
    with pytest.raises(MessageTooLarge, match=r"20\.0 MiB, over the 15\.2 MiB a run of 'email-group:42'"):
        store.admit(KEY, entry(1, m=b"x" * 20 * 2**20))
    assert parked(store) == []


def test_a_run_past_its_deadline_is_never_handed_the_key(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    holder = store.acquire(KEY, 30)
    assert holder is not None
    store.admit(KEY, entry(1), timeout=0.0)
    store.admit(KEY, entry(2))
    holder.release()
    assert handoffs.tasks == ["task-2"]
    doc = store.collection.find_one({"_id": KEY}) or {}
    assert [d["t"] for d in doc["dead"]] == ["task-1"]
    assert doc["gc_at"] is None and doc["wq"] is True
    store.forget_results(KEY, "dead", ["task-1"])
    assert (store.collection.find_one({"_id": KEY}) or {})["dead"] == []


def test_the_sweeper_hands_over_an_expired_key_and_drops_revoked_runs(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    holder = store.acquire(KEY, 30)
    assert holder is not None
    store.admit(KEY, entry(1))
    store.admit(KEY, entry(2))
    store.admit(KEY, entry(3))
    assert [d["_id"] for d in store.waiting_keys()] == [KEY]
    # Held: the sweep drops the revoked run only.
    store.sweep(KEY, revoked={"task-2"})
    assert parked(store) == ["task-1", "task-3"] and handoffs.tasks == []
    # The holder's node died: the lease expires, the sweep hands the key over.
    store.collection.update_one({"_id": KEY}, [{"$set": {"expires_at": "$$NOW"}}])
    store.sweep(KEY)
    assert handoffs.tasks == ["task-1"]
    # A handoff never taken up is handed again when it expires.
    store.collection.update_one({"_id": KEY}, [{"$set": {"expires_at": "$$NOW"}}])
    store.sweep(KEY)
    assert handoffs.tasks == ["task-1", "task-1"]
    assert (store.collection.find_one({"_id": KEY}) or {})["ho"]["hn"] == 2
    # The handed run was revoked: the key goes to the next.
    store.sweep(KEY, revoked={"task-1"})
    assert handoffs.tasks == ["task-1", "task-1", "task-3"]


def test_a_background_release_hands_over_and_the_sweeper_publishes(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    holder = store.acquire(KEY, 30)
    assert holder is not None
    store.admit(KEY, entry(1))
    assert store.release_tokens([holder.owner]) == 1
    assert handoffs.tasks == []  # handed, but nobody here published it
    store.sweep(KEY)
    assert handoffs.tasks == ["task-1"]
    store.sweep(KEY)
    assert handoffs.tasks == ["task-1"]  # adopted once only


def test_a_handoff_made_by_a_store_that_publishes_none_is_adopted_by_the_next_sweep(
    store: LeaseStore, make_store: Any
) -> None:
    # A plain LeaseStore user (no Celery, no handoff publisher) releases a key with a run parked: the
    # worker's sweeper publishes that handoff at its next pass, not once it has expired unclaimed.
    bare = make_store()
    handoffs = Handoffs(store)
    holder = bare.acquire(KEY, 30)
    assert holder is not None
    store.admit(KEY, entry(1))
    assert holder.release()
    store.sweep(KEY)
    assert handoffs.tasks == ["task-1"]
    holder = bare.acquire("other", 30, info={"task_id": "dying", "pid": 4242})
    assert holder is not None
    store.admit("other", entry(2))
    assert bare.release_held_by(task_id="dying") == 1 and bare.force_release("nothing") is False
    store.sweep("other")
    assert handoffs.tasks == ["task-1", "task-2"]


def test_dead_holder_and_force_release_hand_over(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    holder = store.acquire(KEY, 30, info={"task_id": "dying", "pid": 4242})
    assert holder is not None
    store.admit(KEY, entry(1))
    store.admit(KEY, entry(2))
    assert store.release_held_by(task_id="dying", pid=4242) == 1
    assert handoffs.tasks == ["task-1"]
    claimed, _ = store.admit(KEY, entry(1), claim=handoffs.seen[0][1]["tk"])
    assert claimed is not None
    assert store.force_release(KEY)
    assert handoffs.tasks == ["task-1", "task-2"]


def test_replace_keeps_only_the_newest_send(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    holder = store.acquire(KEY, 30)
    assert holder is not None
    assert store.admit(KEY, entry(10), replace=True)[1]["lo"] == "parked"
    _, doc = store.admit(KEY, entry(30), replace=True)
    assert doc["lo"] == "parked"
    assert [(s["t"], s["by"]) for s in doc["sup"]] == [("task-10", "task-30")]
    _, doc = store.admit(KEY, entry(20), replace=True)  # sent before the parked one: superseded
    assert doc["lo"] == "superseded" and doc["lo_by"] == "task-30"
    assert parked(store) == ["task-30"]
    holder.release()
    assert handoffs.tasks == ["task-30"]
    ho = handoffs.seen[0][1]
    lease, _ = store.admit(KEY, entry(30), replace=True, claim=ho["tk"])
    assert lease is not None
    lease.release()
    # A late older send, after the newest ran: superseded by it.
    _, doc = store.admit(KEY, entry(25), replace=True)
    assert doc["lo"] == "superseded" and doc["lo_by"] == "task-30"


def ttl_monitor(store: LeaseStore, at: _dt.datetime) -> int:
    """What MongoDB's TTL monitor does when it runs at ``at``: delete every lease document whose ``gc_at``
    (the TTL index's field, ``expireAfterSeconds=0``) has passed."""
    return store.collection.delete_many({"gc_at": {"$lte": at}}).deleted_count


@pytest.mark.parametrize("ending", ["expired", "holder-died", "forced", "given-back"])
def test_a_late_older_replace_send_is_superseded_though_the_newest_run_never_released(
    store: LeaseStore, ending: str
) -> None:
    """Seed 20 of the lock-set checker: the newest send took the key, and its lease ended other than by
    its own release (its node died, its child was killed, an operator released it, or it was given back
    before its body ran), so the key remembered no finished run (``seen``). The TTL index deleted the
    idle document a minute later, with its record of the newest send (``last``), and an older send
    delivered 164 s late by an overloaded worker took the key. The record of the newest send is kept as
    long as the duplicate guard's (``SEEN_KEEP_MS`` after the key's last lease); past that the key is
    forgotten, and a send delivered so late runs (docs/reference/policies.md)."""
    from celery_mongolock.core.documents.queue import SEEN_KEEP_MS

    newest, _ = store.admit(KEY, entry(20, "newest"), replace=True)
    assert newest is not None
    if ending == "holder-died":
        assert store.release_held_by(task_id="newest") == 1
    elif ending == "forced":
        assert store.force_release(KEY)
    elif ending == "given-back":
        assert store.give_back(newest)
    doc = store.collection.find_one({"_id": KEY}) or {}
    assert doc["last"] == {"s": 20, "t": "newest"} and not doc.get("seen")
    late = doc["expires_at"] + _dt.timedelta(seconds=164)
    ttl_monitor(store, late)
    lease, doc = store.admit(KEY, entry(10, "older"), replace=True)
    assert lease is None and doc["lo"] == "superseded" and doc["lo_by"] == "newest"
    # At the bound: the TTL monitor deletes the key SEEN_KEEP_MS after its last lease, not before.
    doc = store.collection.find_one({"_id": KEY}) or {}
    bound = doc["expires_at"] + _dt.timedelta(milliseconds=SEEN_KEEP_MS)
    assert ttl_monitor(store, bound - _dt.timedelta(seconds=1)) == 0
    assert ttl_monitor(store, bound) == 1
    lease, doc = store.admit(KEY, entry(10, "older"), replace=True)
    assert lease is not None  # forgotten: a send delivered later than that runs
    lease.release()


def test_a_document_with_parked_runs_is_never_left_to_the_ttl_index(store: LeaseStore) -> None:
    holder = store.acquire(KEY, 30)
    assert holder is not None
    doc = store.collection.find_one({"_id": KEY}) or {}
    assert doc["gc_at"] == doc["expires_at"] and "wq" not in doc
    store.admit(KEY, entry(1))
    doc = store.collection.find_one({"_id": KEY}) or {}
    assert doc["gc_at"] is None and doc["wq"] is True
    store.renew_lease(holder)
    assert (store.collection.find_one({"_id": KEY}) or {})["gc_at"] is None


def test_admit_refuses_an_entry_without_its_identity(store: LeaseStore) -> None:
    from celery_mongolock import ConfigurationError

    with pytest.raises(ConfigurationError, match="needs 's'"):
        store.admit(KEY, {"id": "x", "t": "x"})


def test_many_concurrent_admits_park_each_run_once(make_store: Any) -> None:
    import threading

    stores = [make_store(lease_seconds=30) for _ in range(4)]
    holder = stores[0].acquire(KEY)
    assert holder is not None
    errors: list[BaseException] = []

    def admit_some(s: LeaseStore, base: int) -> None:
        try:
            for i in range(10):
                s.admit(KEY, entry(base + i, f"t{base + i}-{uuid.uuid4().hex[:4]}"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=admit_some, args=(s, n * 100)) for n, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stamps = [e["s"] for e in (stores[0].collection.find_one({"_id": KEY}) or {})["q"]]
    # (beyond the document's window, the runs are spilled, in the order they parked: test_spill_store)
    spilled = [d["e"]["s"] for d in stores[0].spill.collection.find({"k": KEY})]
    assert len(stamps) + len(spilled) == 40 and stamps == sorted(stamps)
    assert len(set(stamps + spilled)) == 40


def test_a_debounced_run_parks_even_on_a_free_key_and_takes_it_once_due(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    lease, doc = store.admit(KEY, entry(1), replace=True, debounce=30)
    assert lease is None and doc["lo"] == "parked" and handoffs.tasks == []
    assert parked(store) == ["task-1"]
    # Its delayed copy, too early: stays parked.
    lease, doc = store.admit(KEY, entry(1), replace=True, debounce=30, due=True)
    assert lease is None and doc["lo"] == "dup"
    # Due (crafted): the copy takes the key, and leaves the queue.
    past = {"$map": {"input": "$q", "as": "e", "in": {"$mergeObjects": ["$$e", {"nb": "$$NOW"}]}}}
    store.collection.update_one({"_id": KEY}, [{"$set": {"q": past}}])
    lease, doc = store.admit(KEY, entry(1), replace=True, debounce=30, due=True)
    assert lease is not None and doc["lo"] == "due"
    assert parked(store) == []


def test_the_sweeper_leaves_a_key_alone_while_its_queue_just_waits_for_a_live_holder() -> None:
    import datetime as dt

    from celery_mongolock.core.waiting import needs_sweep

    now = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    later, earlier = now + dt.timedelta(seconds=10), now - dt.timedelta(seconds=1)
    waiting = {"__now": now, "owner": "t", "expires_at": later, "q": [{"t": "a", "dl": None}]}
    assert not needs_sweep(waiting)
    assert needs_sweep({**waiting, "expires_at": earlier})  # the holder expired
    assert needs_sweep({**waiting, "owner": None})  # released by an old version, or debounced
    assert needs_sweep({**waiting, "q": [{"t": "a", "dl": earlier}]})  # a run past its deadline
    assert needs_sweep({**waiting, "ho": {"t": "a", "by": ""}})  # a handoff nobody published
    assert not needs_sweep({**waiting, "ho": {"t": "a", "by": "x"}})
    assert needs_sweep({**waiting, "dead": [{"t": "b"}]}) and needs_sweep({**waiting, "sup": [{"t": "c"}]})


def test_the_sweeper_leaves_a_free_key_alone_while_its_parked_runs_wait_for_their_debounce() -> None:
    """A key (or a slot) left free for debounced runs not yet due: a sweep would hand it to nobody, so the
    sweeper does not write it at every pass; once one is due, or runs are spilled, it does."""
    import datetime as dt

    from celery_mongolock.core.waiting import needs_sweep

    now = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    later, earlier = now + dt.timedelta(seconds=10), now - dt.timedelta(seconds=1)
    not_due = [{"t": "a", "nb": later}, {"t": "b", "nb": later}]
    for free in ({"owner": None}, {"hs": [], "lim": 2}):
        waiting = {"__now": now, **free, "q": not_due}
        assert not needs_sweep(waiting), free
        assert needs_sweep({**waiting, "q": [*not_due, {"t": "c", "nb": earlier}]}), free  # one is due
        assert needs_sweep({**waiting, "q": [*not_due, {"t": "c"}]}), free  # one has no debounce
        assert needs_sweep({**waiting, "sp": [{"r": 0, "h": 0, "t": 1}]}), free  # spilled: a refill
        assert needs_sweep({**waiting, "q": [{"t": "a", "nb": later, "dl": earlier}]}), free  # timed out
        assert needs_sweep({**waiting, "dead": [{"t": "b"}]}), free


def test_a_handoff_message_whose_run_is_no_longer_waiting_is_stale(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    holder = store.acquire(KEY, 30)
    assert holder is not None
    store.admit(KEY, entry(1), timeout=0.0)  # past its deadline at once
    store.admit(KEY, entry(2))
    holder.release()  # task-1 goes to dead, task-2 is handed the key
    assert handoffs.tasks == ["task-2"]
    # task-1's handoff message from an earlier handoff (or a revoked run's): its claim fails, and it is
    # neither parked nor run.
    lease, doc = store.admit(KEY, entry(1), claim="an-old-token")
    assert lease is None and doc["lo"] == "dup"  # timed out: its result is being written
    store.forget_results(KEY, "dead", ["task-1"])
    lease, doc = store.admit(KEY, entry(1), claim="an-old-token")
    assert lease is None and doc["lo"] == "done"  # its result is written: remembered as over (seen)
    lease, doc = store.admit(KEY, entry(1))  # nor a late copy of its first message (issue 32)
    assert lease is None and doc["lo"] == "done"
    lease, doc = store.admit(KEY, entry(3), claim="an-old-token")
    assert lease is None and doc["lo"] == "stale"  # a run it never knew: the glue asks the result backend
    assert parked(store) == []


def test_a_claim_ends_no_lease_and_the_handed_run_s_release_is_recorded(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    holder = store.acquire(KEY, 30)
    assert holder is not None
    store.admit(KEY, entry(1))
    holder.release()
    claimed, _ = store.admit(KEY, entry(1), claim=handoffs.seen[0][1]["tk"])
    assert claimed is not None
    claimed.release()
    ends = (store.collection.find_one({"_id": KEY}) or {})["ends"]
    assert [(e["how"], e["f"]) for e in ends] == [("released", holder.fence), ("released", claimed.fence)]


def test_a_run_released_while_its_key_is_held_on_is_remembered(store: LeaseStore) -> None:
    lease, _ = store.admit(KEY, entry(1), min_hold=30)
    assert lease is not None
    store.admit(KEY, entry(2))
    lease.release()  # the key stays taken (min hold), but the run is over
    _, doc = store.admit(KEY, entry(1))
    assert doc["lo"] == "done"


def test_waiting_for_a_free_key_with_runs_parked_does_not_spin(
    store: LeaseStore, counter: CommandCounter
) -> None:
    holder = store.acquire(KEY, 30)
    assert holder is not None
    store.admit(KEY, entry(1), replace=True, debounce=60)  # parked, not due for a minute
    holder.release()  # free, but not for a plain acquirer
    counter.clear()
    assert store.wait_free(KEY, 1.0, max_poll_interval=0.5) is False
    assert len(counter.names()) < 20, counter.names()


def test_the_sweeper_pages_through_every_waiting_key(store: LeaseStore) -> None:
    for n in range(3):
        holder = store.acquire(f"k{n}", 30)
        assert holder is not None
        store.admit(f"k{n}", entry(n))
    first = store.waiting_keys(limit=2)
    rest = store.waiting_keys(limit=2, after=first[-1]["_id"])
    assert [d["_id"] for d in first + rest] == ["k0", "k1", "k2"]


def test_a_key_that_remembers_finished_runs_outlives_a_broker_redelivery(store: LeaseStore) -> None:
    from celery_mongolock.core.documents.queue import SEEN_KEEP_MS

    lease, _ = store.admit(KEY, entry(1))
    assert lease is not None
    lease.release()
    doc = store.collection.find_one({"_id": KEY}) or {}
    assert doc["seen"] == ["task-1/0.0"]
    kept = (doc["gc_at"] - doc["expires_at"]).total_seconds() * 1000
    assert kept == SEEN_KEEP_MS  # the TTL index deletes it only after a redelivery would have come
    plain = store.acquire("plain-key", 30)
    assert plain is not None
    plain.release()
    other = store.collection.find_one({"_id": "plain-key"}) or {}
    assert other["gc_at"] == other["expires_at"]


def _lost_replies(server_url: str, app_name: str, *, block_ms: int) -> None:
    """The next two ``findAndModify`` commands of the client named ``app_name`` are held ``block_ms`` by the
    server, then applied, and answered with a write concern error: applied, but the client cannot know
    it (as when the server is killed before it replies), so it tries again with the same owner token."""
    client: MongoClient[dict[str, Any]] = MongoClient(server_url)
    try:
        client.admin.command(
            "configureFailPoint",
            "failCommand",
            mode={"times": 2},
            data={
                "failCommands": ["findAndModify"],
                "appName": app_name,
                "blockConnection": True,
                "blockTimeMS": block_ms,
                "writeConcernError": {"code": 64, "errmsg": "waiting for replication timed out"},
            },
        )
    finally:
        client.close()


def _owner(store: LeaseStore) -> Any:
    return (store.collection.find_one({"_id": KEY}) or {}).get("owner")


def test_an_acquire_retried_after_its_reply_was_lost_keeps_its_fence_ahead_of_a_run_parked_meanwhile(
    own_server: Any,
) -> None:
    """A bare acquire's first attempt takes the key, its reply is lost, and a Queue run parks behind that
    holder before the retry lands. The retry is the same acquisition: it keeps the fence it got, so no
    grant after the park carries a larger fence than the park's (the lock-set checker's ``barged``,
    RabbitMQ seed 4, after a MongoDB restart: the retry took a new fence above the parked run's)."""
    server = own_server(enable_test_commands=True)
    bare = LeaseStore(server.url, lease_seconds=30, operation_timeout=60, client_options={"appname": "bare"})
    worker = LeaseStore(server.url, lease_seconds=30)
    got: dict[str, Any] = {}
    try:
        bare.ensure_indexes()
        worker.ensure_indexes()
        _lost_replies(server.url, "bare", block_ms=3000)
        acquiring = threading.Thread(target=lambda: got.update(lease=bare.acquire(KEY)))
        acquiring.start()
        # The first attempt has landed (the key is held by a token the client does not know it has yet);
        # the retry is held by the server for 3 s more.
        wait_for(lambda: _owner(worker), timeout=30, message="the first attempt to land")
        lease, doc = worker.admit(KEY, entry(10))
        assert lease is None and doc["lo"] == "parked"
        parked_at = int(doc["fence"])
        acquiring.join(timeout=60)
        assert not acquiring.is_alive()
        held = got["lease"]
        assert held is not None  # it took the key before the run parked: still its holder
        assert held.fence == parked_at, (held.fence, parked_at)
        final = worker.collection.find_one({"_id": KEY}) or {}
        assert final["owner"] == held.owner and int(final["fence"]) == parked_at
        assert parked(worker) == ["task-10"]
        assert held.release()
        assert (worker.collection.find_one({"_id": KEY}) or {})["ho"]["t"] == "task-10"
    finally:
        bare.close()
        worker.close()


def test_an_acquire_retried_after_its_own_lease_expired_leaves_the_key_to_the_parked_run(
    own_server: Any,
) -> None:
    """The same, but the lease the first attempt took runs out before the retry lands, with a run parked
    behind it. The retry does not take the key again (that would pass the parked run): it gives the lease
    up, recording its ending, the client gets no lease, and the sweep hands the key to the run."""
    server = own_server(enable_test_commands=True)
    bare = LeaseStore(server.url, lease_seconds=1, operation_timeout=60, client_options={"appname": "bare"})
    worker = LeaseStore(server.url, lease_seconds=30)
    got: dict[str, Any] = {}
    try:
        bare.ensure_indexes()
        worker.ensure_indexes()
        _lost_replies(server.url, "bare", block_ms=3000)
        acquiring = threading.Thread(target=lambda: got.update(lease=bare.acquire(KEY)))
        acquiring.start()
        token = wait_for(lambda: _owner(worker), timeout=30, message="the first attempt to land")
        lease, doc = worker.admit(KEY, entry(10))
        assert lease is None and doc["lo"] == "parked"
        acquiring.join(timeout=60)
        assert not acquiring.is_alive()
        assert got["lease"] is None
        after = worker.collection.find_one({"_id": KEY}) or {}
        assert after["owner"] is None and after["ends"][-1]["how"] == "expired"
        assert int(after["fence"]) == int(doc["fence"])
        assert worker.acquire(KEY) is None  # nobody else barges in either
        assert worker.sweep(KEY) is not None
        swept = worker.collection.find_one({"_id": KEY}) or {}
        assert swept["ho"]["t"] == "task-10" and swept["owner"] != token
    finally:
        bare.close()
        worker.close()


def test_an_admit_retried_after_its_reply_was_lost_keeps_its_fence_ahead_of_a_run_parked_meanwhile(
    own_server: Any,
) -> None:
    """The same for a queued run's own admit: its first attempt took the free key, a newer run parked
    behind it, and the retry finds the key held by its own token: ``acquired``, with the fence it got
    (a new fence would have made it a grant after the newer run had parked: the checker's inversion)."""
    server = own_server(enable_test_commands=True)
    first = LeaseStore(
        server.url, lease_seconds=30, operation_timeout=60, client_options={"appname": "first"}
    )
    other = LeaseStore(server.url, lease_seconds=30)
    got: dict[str, Any] = {}
    try:
        first.ensure_indexes()
        other.ensure_indexes()
        _lost_replies(server.url, "first", block_ms=3000)
        admitting = threading.Thread(target=lambda: got.update(admitted=first.admit(KEY, entry(10))))
        admitting.start()
        wait_for(lambda: _owner(other), timeout=30, message="the first attempt to land")
        lease, doc = other.admit(KEY, entry(20))
        assert lease is None and doc["lo"] == "parked"
        admitting.join(timeout=60)
        assert not admitting.is_alive()
        held, reply = got["admitted"]
        assert held is not None and reply["lo"] == "acquired"
        assert held.fence == int(doc["fence"]), (held.fence, doc["fence"])
        assert parked(other) == ["task-20"]
    finally:
        first.close()
        other.close()


def test_results_are_claimed_by_one_writer_at_a_time(store: LeaseStore) -> None:
    # The run that superseded a parked run and the sweepers of every node may all find it in ``sup``: only
    # one of them claims it (a run with callbacks must be ended once); a claim whose writer died is taken
    # over after its hold.
    holder = store.acquire(KEY, 60)
    assert holder is not None
    for stamp in (1, 2, 3):
        assert store.admit(KEY, entry(stamp), replace=True)[1]["lo"] == "parked"
    doc = store.collection.find_one({"_id": KEY}) or {}
    assert sorted(e["t"] for e in doc["sup"]) == ["task-1", "task-2"]
    assert store.claim_results(KEY, "sup", ["task-1", "task-2"]) == {"task-1", "task-2"}
    assert store.claim_results(KEY, "sup", ["task-1", "task-2"]) == set()  # held by the first claim
    assert store.claim_results(KEY, "sup", ["task-1"], hold=0.0) == {"task-1"}  # a dead writer's, taken over
    assert (
        store.claim_results(KEY, "sup", ["nobody"]) == set() and store.claim_results(KEY, "sup", []) == set()
    )
    store.forget_results(KEY, "sup", ["task-1", "task-2"])
    assert (store.collection.find_one({"_id": KEY}) or {}).get("sup") in (None, [])
