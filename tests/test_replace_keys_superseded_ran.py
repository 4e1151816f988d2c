"""Which paths can answer ``superseded`` to a several-keys ``Replace`` run whose body ran or runs (the
lock-set checker's one ``superseded-ran`` on ``lockcheck:m0.e0``/``lockcheck:m2.e0``)? Directed tests in the
lease store, on the embedded server (no Celery); each admit below is what ``QueuedRun`` sends,
key by key in sorted order.

1. A copy (same task id and delivery) of a run that holds its keys: on every key it still holds, the
   admit answers ``running`` (a duplicate, parked); on a key whose lease it lost while a newer send of its
   set got or parked on it, ``superseded``. What the copy then does (``unpark`` of its entry id on every
   key) gives back no key the running original holds: not a safety problem. But the copy stores SUCCESS
   ``superseded`` for the task id: a wrong final state for a body that ran or runs. The duplicate guard
   (``seen``) is per key: a copy that comes after the body ended is judged ``superseded`` on the key
   whose lease the body lost (no ``seen`` there) before it reaches the key that remembers the run.
2. The original run itself: an older run that got some keys and is superseded on another never holds all
   of them (its claim or admit on that key says ``superseded``; what it claimed goes back).
3. A newer send that parks supersedes only the older run's parked entry or unclaimed reservation/handoff
   (``sup``), never a run that holds the key (it claimed or acquired it).
"""

from __future__ import annotations

from typing import Any

from celery_mongolock import LeaseStore

from .test_replace_keys_store import doc_of, run, superseded

M0, M2 = "sr:m0", "sr:m2"


def admit_run(
    store: LeaseStore, key: str, e: dict[str, Any], claim: str | None = None
) -> tuple[Any, dict[str, Any]]:
    """``admit`` with the holder fields a worker's admit carries (task id, delivery: what ``seen`` and
    the ``running`` branch read)."""
    info = {"task_id": e["t"], "delivery": e["r"], "keys": e["ks"]}
    return store.admit(key, e, ttl=30, claim=claim, replace=True, group=e["g"], info=info)


def lose(store: LeaseStore, key: str) -> None:
    """The holder's lease on ``key`` runs out (a paused server, a stopped worker)."""
    store.collection.update_one({"_id": key}, [{"$set": {"expires_at": "$$NOW"}}])


def test_a_copy_of_a_running_run_is_a_duplicate_on_every_key_it_holds(store: LeaseStore) -> None:
    old, new = run(10, [M0, M2]), run(20, [M0, M2])
    l0, _ = admit_run(store, M0, old)
    l2, _ = admit_run(store, M2, old)
    assert l0 is not None and l2 is not None  # its body runs
    for key in (M0, M2):
        assert admit_run(store, key, new)[1]["lo"] == "parked"
    # A redelivered copy of the running run: running on its first key (parked as a duplicate, dropped
    # once the run's release remembers it as over).
    assert admit_run(store, M0, old)[1]["lo"] == "running"
    l0.release()
    l2.release()


def test_a_copy_of_a_running_run_that_lost_a_lease_is_told_superseded(store: LeaseStore) -> None:
    """Path 1, while the body runs: the copy answers superseded on the key lost, takes nothing from the
    original (its other lease stays), and would write ``superseded`` for a task whose body runs."""
    old, new = run(10, [M0, M2]), run(20, [M0, M2])
    l0, _ = admit_run(store, M0, old)
    l2, _ = admit_run(store, M2, old)
    assert l0 is not None and l2 is not None  # the original's body runs with both
    lose(store, M0)
    lease, doc = admit_run(store, M0, new)  # the newer send takes the key lost ...
    assert lease is not None and doc["lo"] == "acquired"
    assert admit_run(store, M2, new)[1]["lo"] == "parked"  # ... and waits for the other
    assert store.reserve(lease, new)

    owner2 = doc_of(store, M2)["owner"]
    _, doc = admit_run(store, M0, old)  # the copy, at its first key
    assert doc["lo"] == "superseded" and doc["lo_by"] == "r20"
    # What ``_admit_each`` then does: leave every key (only this entry id's parked entry or reservation).
    for key in (M0, M2):
        store.unpark(key, old["id"])
    d2 = doc_of(store, M2)
    assert d2["owner"] == owner2 == l2.owner  # the original still holds M2: no key taken from it
    assert [e["t"] for e in d2.get("q") or []] == ["r20"]  # the newer send still parked there
    l2.release()


def test_a_copy_after_the_body_ended_is_told_superseded_not_already_ran(store: LeaseStore) -> None:
    """Path 1, after the body ended: ``seen`` remembers the run only on the key it still held at its
    release; on the first key (lost mid-body, taken by the newer send) the copy is answered
    ``superseded``, so ``admit_all`` stores SUCCESS ``superseded`` over the body's own result (a copy
    that reached M2 first would have been answered ``done``: ``already-ran``)."""
    old, new = run(10, [M0, M2]), run(20, [M0, M2])
    l0, _ = admit_run(store, M0, old)
    l2, _ = admit_run(store, M2, old)
    assert l0 is not None and l2 is not None
    lose(store, M0)
    lease, _ = admit_run(store, M0, new)
    assert lease is not None
    assert admit_run(store, M2, new)[1]["lo"] == "parked"
    assert store.reserve(lease, new)
    assert not l0.release()  # the body ends: M0 was no longer its own ...
    assert l2.release()  # ... M2 was, and remembers the run as over
    assert old["id"] in (doc_of(store, M2).get("seen") or [])
    assert old["id"] not in (doc_of(store, M0).get("seen") or [])
    # The copy: its first key answers superseded before the key that remembers it is asked.
    _, doc = admit_run(store, M0, old)
    assert doc["lo"] == "superseded"
    # (M2 would have said the run is over.)
    assert admit_run(store, M2, old)[1]["lo"] == "done"


def test_an_older_run_superseded_on_one_key_never_holds_all(store: LeaseStore) -> None:
    """Path 2: the older run claimed M0 of its handoff; the newer send took back its handoff of M2
    first: the claim of M2 says superseded, and M0 goes back (``_claim_all``), so the body cannot start."""
    old, new = run(10, [M0, M2]), run(20, [M0, M2])
    b0, b2 = store.acquire(M0, 30), store.acquire(M2, 30)
    assert b0 is not None and b2 is not None
    for key in (M0, M2):
        assert admit_run(store, key, old)[1]["lo"] == "parked"
    b0.release()
    b2.release()
    assert store.reserved_for_all(old)  # handed both: its handoff message is on its way
    l0, doc = admit_run(store, M0, old, claim=old["tk"])
    assert l0 is not None and doc["lo"] == "claimed"
    # The newer send: M0 is held (the older run claimed it): parked, nothing to take back there.
    assert admit_run(store, M0, new)[1]["lo"] == "parked"
    assert superseded(store, M0) == []
    # M2 is still handed (unclaimed) to the older run: taken back, the older run recorded superseded.
    assert admit_run(store, M2, new)[1]["lo"] == "parked"
    assert superseded(store, M2) == [("r10", "r20")]
    lease, doc = admit_run(store, M2, old, claim=old["tk"])
    assert lease is None and doc["lo"] == "superseded"
    assert store.give_back(l0)  # what ``_claim_all`` does with the keys claimed so far


def test_a_newer_send_never_supersedes_a_run_that_holds_its_keys(store: LeaseStore) -> None:
    """Path 3: a run that claimed every key is no longer in ``q`` or ``ho``: a newer send parks behind it
    and records nothing for it to write (``self.superseded`` stays empty)."""
    old, new = run(10, [M0, M2]), run(20, [M0, M2])
    b0, b2 = store.acquire(M0, 30), store.acquire(M2, 30)
    assert b0 is not None and b2 is not None
    for key in (M0, M2):
        assert admit_run(store, key, old)[1]["lo"] == "parked"
    b0.release()
    b2.release()
    held = [admit_run(store, key, old, claim=old["tk"])[0] for key in (M0, M2)]
    assert all(lease is not None for lease in held)
    for key in (M0, M2):
        _, doc = admit_run(store, key, new)
        assert doc["lo"] == "parked"
        assert superseded(store, key) == []
        assert not (doc.get("sup") or [])
    for lease in held:
        lease.release()


def test_a_reservation_made_after_the_newer_send_parked_is_taken_back(store: LeaseStore) -> None:
    """The older run acquired M0 and parked on M2 (held); the newer send parks on M2 (the older run is
    recorded superseded there) and on M0 (held by the older run's lease: nothing to take back); then the
    older run's ``_reserve_all`` would turn its M0 lease into a reservation. It is refused (the key knows
    the newer send of the set): M0 is given back unrun and handed to the newer send in the same command,
    and the older run's admit of M0 answers superseded. (Before the fix the reservation was kept, handed
    again to the superseded run at each expiry, and the newest send waited on M0 for good.)"""
    old, new = run(10, [M0, M2]), run(20, [M0, M2])
    blocker = store.acquire(M2, 30)
    assert blocker is not None

    l0, _ = admit_run(store, M0, old)
    assert l0 is not None
    assert admit_run(store, M2, old)[1]["lo"] == "parked"
    assert admit_run(store, M2, new)[1]["lo"] == "parked"
    assert superseded(store, M2) == [("r10", "r20")]
    assert admit_run(store, M0, new)[1]["lo"] == "parked"
    assert superseded(store, M0) == []  # held by the older run: nothing to take back there
    assert not store.reserve(l0, old)  # refused: the key goes on, unrun
    d0 = doc_of(store, M0)
    assert (d0.get("ho") or {}).get("t") == "r20" and d0["owner"] == new["tk"]
    assert old["id"] not in (d0.get("seen") or [])  # given back, not remembered as a run that ended
    _, doc = admit_run(store, M0, old)  # what ``_reserve_all`` does next
    assert doc["lo"] == "superseded" and doc["lo_by"] == "r20"
    blocker.release()  # M2 goes to the newer send too: it is reserved on both, and claims them
    assert store.reserved_for_all(new)
    held = [admit_run(store, key, new, claim=new["tk"])[0] for key in (M0, M2)]
    assert all(lease is not None for lease in held)
    for lease in held:
        assert lease is not None
        lease.release()


def test_a_reservation_of_an_older_run_is_kept_when_no_newer_send_came(store: LeaseStore) -> None:
    """The same start without the newer send: the older run's reservation of M0 is made as before."""
    old = run(10, [M0, M2])
    blocker = store.acquire(M2, 30)
    assert blocker is not None
    l0, _ = admit_run(store, M0, old)
    assert l0 is not None
    assert admit_run(store, M2, old)[1]["lo"] == "parked"
    assert store.reserve(l0, old)
    assert (doc_of(store, M0).get("ho") or {}).get("t") == "r10"
    blocker.release()
    assert store.reserved_for_all(old)
