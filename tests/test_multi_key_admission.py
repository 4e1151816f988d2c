"""Several keys per run under Queue (``keys=``), in the lease store on the embedded server: a run keeps
its place on each key with reservations (handoffs to itself made without a release), is ready once every
key is reserved for it, claims them all with one token, and an expired reservation goes back in send
order, so that an older run parked later is not deadlocked by a younger one's reservation."""

from __future__ import annotations

import datetime as _dt
from typing import Any

from celery_mongolock import Lease, LeaseStore

from .test_admission_store import Handoffs

X, Y = "group:x", "group:y"


def multi(stamp: int, task_id: str | None = None) -> dict[str, Any]:
    tid = task_id or f"merge-{stamp}"
    return {
        "id": f"{tid}/0",
        "t": tid,
        "n": "merge",
        "r": "0",
        "s": stamp,
        "m": b"msg",
        "ks": [X, Y],
        "tk": f"tk-{tid}",
    }


def doc_of(store: LeaseStore, key: str) -> dict[str, Any]:
    return store.collection.find_one({"_id": key}) or {}


def parked(store: LeaseStore, key: str) -> list[str]:
    return [e["t"] for e in doc_of(store, key).get("q") or []]


def wait_on_y(store: LeaseStore, entry: dict[str, Any]) -> None:
    """The run's attempt: x is free (taken, then reserved), y is held (parked)."""
    lease, doc = store.admit(X, entry, ttl=30)
    assert lease is not None, doc.get("lo")
    _, doc = store.admit(Y, entry, ttl=30)
    assert doc["lo"] == "parked"
    assert store.reserve(lease, entry)
    assert lease.released  # handed over: the run no longer renews or releases it


def claim_both(store: LeaseStore, entry: dict[str, Any]) -> tuple[Lease, Lease]:
    """The run ``entry``, handed x and y, claims both with its token."""
    lx, doc = store.admit(X, entry, ttl=30, claim=entry["tk"])
    assert lx is not None and doc["lo"] == "claimed"
    ly, doc = store.admit(Y, entry, ttl=30, claim=entry["tk"])
    assert ly is not None and doc["lo"] == "claimed"
    return lx, ly


def test_a_run_reserves_the_keys_it_got_and_is_ready_when_the_last_is_handed_to_it(store: LeaseStore) -> None:
    handoffs = Handoffs(store)
    blocker = store.acquire(Y, 30)
    assert blocker is not None
    e = multi(10)
    wait_on_y(store, e)
    d = doc_of(store, X)
    assert d["owner"] == e["tk"] and d["ho"]["id"] == e["id"] and d["ho"]["ks"] == [X, Y]
    assert not store.reserved_for_all(e)
    # Nobody takes the reserved key: a plain acquire is refused, a newcomer parks behind.
    assert store.acquire(X, 30) is None
    _, doc = store.admit(X, {"id": "late/0", "t": "late", "s": 5, "m": b"m"}, ttl=30)
    assert doc["lo"] == "parked"

    blocker.release()
    assert handoffs.tasks == ["merge-10"]  # y handed to it (the publisher checks it is ready)
    assert store.reserved_for_all(e)
    fence_x, fence_y = doc_of(store, X)["fence"], doc_of(store, Y)["fence"]
    lx, ly = claim_both(store, e)
    assert lx.fence == fence_x and ly.fence == fence_y
    assert ly.fence > blocker.fence
    lx.release()
    assert handoffs.tasks == ["merge-10", "late"]  # x goes on to the run that waited behind
    ly.release()


def test_an_older_run_parked_later_gets_the_key_when_the_younger_reservation_expires(
    store: LeaseStore,
) -> None:
    handoffs = Handoffs(store)
    blocker = store.acquire(Y, 30)
    assert blocker is not None
    younger, older = multi(20), multi(10)
    wait_on_y(store, younger)  # reserves x, parks on y
    # The older run's message arrives late: x is reserved for the younger one, so it parks there; on y
    # it parks ahead of the younger one (send order).
    _, doc = store.admit(X, older, ttl=30)
    assert doc["lo"] == "parked"
    _, doc = store.admit(Y, older, ttl=30)
    assert doc["lo"] == "parked"
    assert parked(store, Y) == ["merge-10", "merge-20"]
    blocker.release()
    assert handoffs.tasks == ["merge-10"]
    # Each has one key reserved and waits for the other: neither is ready.
    assert not store.reserved_for_all(older) and not store.reserved_for_all(younger)
    # The younger one's reservation of x expires (a lease); the sweeper hands x again in send order.
    store.collection.update_one({"_id": X}, {"$set": {"expires_at": _dt.datetime(2000, 1, 1)}})
    store.sweep(X)
    assert handoffs.tasks == ["merge-10", "merge-10"]
    assert store.reserved_for_all(older)
    assert parked(store, X) == ["merge-20"]  # the younger one keeps its place, next in line


def test_a_key_given_back_is_not_remembered_as_a_finished_run(store: LeaseStore) -> None:
    e = multi(1)
    lease, _ = store.admit(X, e, ttl=30)
    assert isinstance(lease, Lease)
    assert store.give_back(lease)
    assert not store.give_back(lease)
    lease, doc = store.admit(X, e, ttl=30)
    assert lease is not None and doc["lo"] == "acquired"  # not "done": the run has not run
    lease.release()
    _, doc = store.admit(X, e, ttl=30)
    assert doc["lo"] == "done"


def test_a_lost_lease_is_not_reserved(store: LeaseStore) -> None:
    e = multi(1)
    lease, _ = store.admit(X, e, ttl=30)
    assert lease is not None
    assert store.force_release(X)
    assert not store.reserve(lease, e)


def test_why_says_a_key_is_reserved_for_a_run_that_waits_for_its_other_keys(store: LeaseStore) -> None:
    Handoffs(store)
    blocker = store.acquire(Y, 30)
    assert blocker is not None
    wait_on_y(store, multi(10))
    story = store.why(X)
    assert story is not None and story.state == "handed"
    assert story.verdict.startswith("reserved ") and "merge[merge-10]" in story.verdict
    assert f"which takes its other keys ({Y}) one at a time in key order" in story.verdict
    story_y = store.why(Y)
    assert story_y is not None and "1 run parked; next: merge[merge-10]" in story_y.verdict
    blocker.release()
    story_y = store.why(Y)
    assert story_y is not None and story_y.verdict.startswith("reserved ")


def test_a_run_missing_from_one_of_its_keys_is_told_apart(store: LeaseStore) -> None:
    # Its worker died after it parked on y and before it took x: nothing holds x for it.
    blocker = store.acquire(Y, 30)
    assert blocker is not None
    e = multi(10)
    store.admit(Y, e, ttl=30)
    assert store.keys_state(e) == "missing"
    lease, _ = store.admit(X, e, ttl=30)
    assert lease is not None and store.reserve(lease, e)
    assert store.keys_state(e) == "waiting"
    blocker.release()
    assert store.keys_state(e) == "ready"


def test_mixed_single_and_slot_holders_never_hold_one_key_at_once(store: LeaseStore) -> None:
    single = {"id": "b2/0", "t": "b2", "n": "b", "r": "0", "s": 20, "m": b"m"}
    holder = store.acquire(X, 30)
    assert holder is not None
    assert store.admit(X, single, ttl=30)[1]["lo"] == "parked"
    holder.release()  # handed to b2, whose message is late: its handoff expires unclaimed
    tk = doc_of(store, X)["ho"]["tk"]
    store.collection.update_one({"_id": X}, {"$set": {"expires_at": _dt.datetime(2000, 1, 1)}})
    slot, doc = store.admit(X, {**single, "id": "a1/0", "t": "a1", "s": 30}, ttl=30, limit=2)
    assert slot is None  # the pending single handoff still counts
    claimed, doc = store.admit(X, single, ttl=30, claim=tk)
    assert claimed is not None and doc["lo"] == "claimed"
    claimed.release()
    # The other way round: a slot handed and not claimed keeps a single lease out, even expired.
    taken = [
        store.admit(Y, {**single, "id": f"s{i}/0", "t": f"s{i}", "s": i}, ttl=30, limit=2)[0] for i in (1, 2)
    ]
    slots = [lease for lease in taken if lease is not None]
    assert len(slots) == 2
    store.admit(Y, {**single, "id": "s3/0", "t": "s3", "s": 3}, ttl=30, limit=2)
    slots[0].release()
    store.collection.update_one(
        {"_id": Y}, {"$set": {"hs.$[h].x": _dt.datetime(2000, 1, 1)}}, array_filters=[{"h.h.task_id": "s3"}]
    )
    assert store.acquire(Y, 30) is None


def test_a_background_release_of_an_unanswered_acquire_does_not_mark_the_run_over(store: LeaseStore) -> None:
    for limit, key in ((None, X), (3, Y)):
        e = {"id": "run/0", "t": "run", "n": "t", "r": "0", "s": 1, "m": b"m"}
        lease, _ = store.admit(key, e, ttl=30, limit=limit)  # an attempt that landed after its caller gave up
        assert lease is not None
        store.heartbeat.discard(lease)
        assert store.release_tokens([lease.owner], unconfirmed=[lease.owner]) == 1
        again, doc = store.admit(key, e, ttl=30, limit=limit)
        assert again is not None and doc["lo"] == "acquired", doc.get("lo")  # not "done"
        again.release()


def attempt(retries: int, stamp: int = 5) -> dict[str, Any]:
    """Attempt ``retries`` of the several-keys run ``merge`` (its body's ``self.retry()`` starts the next
    one: same task id and send stamp, its own run id and handoff token)."""
    e = multi(stamp, "merge")
    e.update(id=f"merge/{retries}", r=str(retries), tk=f"tk-merge-{retries}")
    return e


def test_a_stale_copy_of_an_attempt_whose_body_retried_is_never_admitted_again(store: LeaseStore) -> None:
    """The lock-set checker's seed 23: attempt 0 of a several-keys run was handed both keys and claimed
    them; a MongoDB pause cut its body (its leases lost, so it is not remembered as over) and the body
    retried (attempt 1, which parked). A stale copy of attempt 0's handoff message then failed its
    claim, the task had no final result (attempt 1 had written QUEUED), and the copy was admitted as a
    new run: parked beside attempt 1, handed the keys, its body ran again. A copy of an attempt is now
    refused while a later attempt of its task is parked, handed, holding or ended on the key
    (``retried``), with or without its claim; a run's own attempts are unaffected."""
    first, retry = attempt(0), attempt(1)
    lx, _ = store.admit(X, first, ttl=30)
    ly, _ = store.admit(Y, first, ttl=30)
    assert lx is not None and ly is not None
    assert store.force_release(X) and store.force_release(Y)  # its leases lost: the body was cut
    blocker = store.acquire(Y, 30)
    assert blocker is not None
    wait_on_y(store, retry)  # attempt 1: x reserved for it, parked on y
    for key in (X, Y):
        for claim in (first["tk"], None):
            lease, doc = store.admit(key, first, ttl=30, claim=claim)
            assert lease is None and doc["lo"] == "retried", (key, claim, doc["lo"])
    assert parked(store, Y) == ["merge"] and doc_of(store, X)["ho"]["id"] == "merge/1"

    blocker.release()  # y handed to attempt 1, which claims both and runs
    lx, _ = store.admit(X, retry, ttl=30, claim=retry["tk"])
    ly, _ = store.admit(Y, retry, ttl=30, claim=retry["tk"])
    assert lx is not None and ly is not None
    lease, doc = store.admit(X, first, ttl=30)  # while it holds the key
    assert lease is None and doc["lo"] == "retried"
    lx.release()
    ly.release()
    for key in (X, Y):  # and once it is over (seen)
        lease, doc = store.admit(key, first, ttl=30, claim=first["tk"])
        assert lease is None and doc["lo"] == "retried"
    # A later attempt is never refused for an earlier one: attempt 2 takes the free keys.
    lease, doc = store.admit(X, attempt(2), ttl=30)
    assert lease is not None and doc["lo"] == "acquired"
    lease.release()


def _expire(store: LeaseStore, key: str) -> None:
    """The key's lease (a reservation) lapsed a second ago, on the server's clock."""
    store.collection.update_one({"_id": key}, [{"$set": {"expires_at": {"$subtract": ["$$NOW", 1000]}}}])


def _needs_sweep(store: LeaseStore, key: str) -> bool:
    (one,) = [w for w in store.waiting() if w.key == key]
    return one.needs_sweep


def test_a_lone_reservation_is_handed_again_once_then_left_until_a_run_parks_behind_it(
    store: LeaseStore,
) -> None:
    """A run reserved x and waits for y. Its reservation of x lapses: the sweeper hands it again once (the
    publisher then looks for a run missing from its keys); after that, while no other run waits on x, the
    sweeper leaves it alone (before: one write per lapse, for every such key: thousands of commands a lease
    with thousands of runs that each reserved a key of their own). A run parking on x puts it back in send
    order (its admit does: next test); and the run still claims its lapsed reservation."""
    handoffs = Handoffs(store)
    blocker = store.acquire(Y, 30)
    assert blocker is not None
    e = multi(20)
    wait_on_y(store, e)
    _expire(store, X)
    assert _needs_sweep(store, X)  # the first lapse: handed again
    store.sweep(X)
    assert handoffs.tasks == ["merge-20"] and doc_of(store, X)["ho"]["hn"] == 2
    _expire(store, X)
    assert not _needs_sweep(store, X)  # lone, handed again once already: left alone
    # It stays its run's: the blocker's release hands y, and the run claims both.
    blocker.release()
    assert store.reserved_for_all(e)
    lx, ly = claim_both(store, e)
    lx.release()
    ly.release()


def test_a_lapsed_lone_reservation_goes_back_in_send_order_once_an_older_run_parks_there(
    store: LeaseStore,
) -> None:
    handoffs = Handoffs(store)
    blocker = store.acquire(Y, 30)
    assert blocker is not None
    younger, older = multi(20), multi(10)
    wait_on_y(store, younger)
    _expire(store, X)
    store.sweep(X)  # the first lapse
    _expire(store, X)
    assert not _needs_sweep(store, X)
    # The older run's message arrives late: its admit on x puts the lapsed reservation back in send order
    # and reserves x for it at once (no sweep needed); on y it parks ahead (send order).
    assert store.admit(X, older, ttl=30)[1]["lo"] == "parked"
    assert doc_of(store, X)["ho"]["t"] == "merge-10" and parked(store, X) == ["merge-20"]
    assert store.admit(Y, older, ttl=30)[1]["lo"] == "parked"
    blocker.release()
    assert store.reserved_for_all(older)
    assert handoffs.tasks[-1] == "merge-10"


def test_a_lone_reservation_past_its_queue_timeout_or_long_lapsed_is_swept() -> None:
    import datetime as dt

    from celery_mongolock.core.waiting import LONE_RESERVATION_RECHECK_MS, needs_sweep

    now = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    lapsed = now - dt.timedelta(seconds=1)
    ho = {"t": "m", "id": "m/0", "ks": [X, Y], "hn": 2, "by": "sweep:1"}
    lone = {"__now": now, "owner": "tk-m", "expires_at": lapsed, "ho": ho}
    assert not needs_sweep(lone)
    assert needs_sweep({**lone, "ho": {**ho, "hn": 1}})  # its first lapse
    assert needs_sweep({**lone, "ho": {**ho, "dl": lapsed}})  # past its Queue(timeout=...)
    assert needs_sweep({**lone, "q": [{"t": "other"}]})  # a run waits behind it
    assert needs_sweep({**lone, "sp": [{"r": 0, "h": 0, "t": 1}]})
    assert needs_sweep({**lone, "ho": {k: v for k, v in ho.items() if k != "ks"}})  # a run of one key
    long_ago = now - dt.timedelta(milliseconds=LONE_RESERVATION_RECHECK_MS + 1)
    assert needs_sweep({**lone, "expires_at": long_ago})  # looked at again now and then
    slot = {"__now": now, "lim": 2, "hs": [{"o": "tk-m", "x": lapsed, "ho": ho}]}
    assert not needs_sweep(slot)
    assert needs_sweep({**slot, "hs": [{"o": "tk-m", "x": lapsed, "ho": {**ho, "hn": 1}}]})
