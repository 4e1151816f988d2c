"""The duplicate guard at its bounds: what decides that a copy of a message (parked duplicate, broker
redelivery) is of a run that already ran, through the store's commands on the embedded server.

A key remembers its last ``SEEN_KEPT`` runs that ended with a release (``seen``), and its document is
kept ``SEEN_KEEP_MS`` after its last lease; past either bound a copy is a new run, as any ``acks_late``
task's (docs/discussions/failure-semantics.md, "What the duplicate guard remembers")."""

from __future__ import annotations

import datetime as _dt
import uuid
from typing import Any

import pytest

from celery_mongolock import LeaseStore
from celery_mongolock.core.documents.queue import SEEN_KEEP_MS, SEEN_KEPT, run_id
from celery_mongolock.core.outcomes import Contended

KEY = "resource:guard"


def info(task_id: str) -> dict[str, Any]:
    return {"task_id": task_id, "task_name": "guarded", "delivery": "0.0"}


def ended_run(store: LeaseStore, task_id: str, limit: int | None = None) -> None:
    """A first delivery of ``task_id`` that took the key, ran and released it."""
    lease = store.acquire(KEY, 30, info=info(task_id), limit=limit)
    assert lease is not None
    assert lease.release()


def copy_takes_the_key(store: LeaseStore, task_id: str, limit: int | None = None) -> bool:
    """Whether a copy of ``task_id``'s first delivery takes the key (its acquire, as ``task.py`` sends it)."""
    lease, _ = store.try_acquire(
        KEY, 30, info=info(task_id), limit=limit, ended_runs=[run_id(task_id, "0.0")]
    )
    if lease is None:
        return False
    store.give_back(lease)  # (not a run that ran: not remembered)
    return True


@pytest.mark.parametrize("limit", [None, 3], ids=["single", "limit3"])
def test_a_copy_of_a_run_that_ended_is_refused_the_free_key(store: LeaseStore, limit: int | None) -> None:
    """The acquire itself refuses the key to the copy: a release that lands between the copy's look at the
    key and its acquire cannot let it run again (issue 32). Anyone else takes the free key."""
    ended_run(store, "first", limit)
    assert not copy_takes_the_key(store, "first", limit)
    assert copy_takes_the_key(store, "another", limit)  # a copy of a run the key never saw is a new run
    other = store.acquire(KEY, 30, info=info("fresh"), limit=limit)  # a first delivery: not checked
    assert other is not None
    other.release()


@pytest.mark.parametrize("limit", [None, 3], ids=["single", "limit3"])
def test_the_guard_remembers_the_last_128_runs_that_ended(store: LeaseStore, limit: int | None) -> None:
    """At the bound: a copy of a run followed by SEEN_KEPT - 1 other runs is refused; after one more, the
    key has forgotten it and the copy runs (``limit=N`` keys remembered only their last 8 endings)."""
    assert SEEN_KEPT == 128
    ended_run(store, "first", limit)
    for n in range(SEEN_KEPT - 1):
        ended_run(store, f"other-{n}", limit)
    assert not copy_takes_the_key(store, "first", limit)
    queued = {"id": run_id("first", "0.0"), "t": "first", "s": 1, "m": b"m"}
    lease, doc = store.admit(KEY, queued, ttl=30, limit=limit)  # a Queue run's copy: the same memory
    assert lease is None and doc["lo"] == "done"
    ended_run(store, "one-more", limit)
    assert copy_takes_the_key(store, "first", limit)
    lease, _ = store.admit(KEY, queued, ttl=30, limit=limit)  # and past it, a new run
    assert lease is not None
    lease.release()


def ttl_monitor(store: LeaseStore, at: _dt.datetime) -> int:
    """What MongoDB's TTL monitor does when it runs at ``at``: delete every lease document whose ``gc_at``
    (the TTL index's field, ``expireAfterSeconds=0``) has passed."""
    return store.collection.delete_many({"gc_at": {"$lte": at}}).deleted_count


def last_expiry(doc: dict[str, Any]) -> _dt.datetime:
    """The key's last lease's expiry: the single lease's, or the latest a slot hold has had (``sx``)."""
    times: list[_dt.datetime] = [t for t in (doc.get("expires_at"), doc.get("sx")) if t is not None]
    return max(times)


def end_later_lease(store: LeaseStore, ending: str, limit: int | None) -> None:
    """Another run takes the key after the remembered one, and its lease ends by ``ending``."""
    lease = store.acquire(KEY, 30, info=info("later"), limit=limit)
    assert lease is not None
    if ending == "released":
        assert lease.release()
    elif ending == "holder-died":
        assert store.release_held_by(task_id="later") == 1
    elif ending == "forced":
        assert store.force_release(KEY)
    elif ending == "given-back":
        assert store.give_back(lease)
    # "expired": left held; the TTL monitor below runs long after its expiry


@pytest.mark.parametrize("limit", [None, 3], ids=["single", "limit3"])
@pytest.mark.parametrize("ending", ["released", "expired", "holder-died", "forced", "given-back"])
def test_a_key_that_remembers_runs_is_kept_two_hours_after_its_last_lease(
    store: LeaseStore, ending: str, limit: int | None
) -> None:
    """At the other bound: the TTL index deletes the document SEEN_KEEP_MS after its last lease's expiry,
    longer than Redis's default visibility timeout (1 hour), however that lease ended. Not a second
    before: a copy is still refused. Past it (deleted, as the TTL monitor does) a copy is a new run."""
    assert SEEN_KEEP_MS == 2 * 3600 * 1000
    ended_run(store, "first", limit)
    end_later_lease(store, ending, limit)
    doc = store.collection.find_one({"_id": KEY}) or {}
    assert run_id("first", "0.0") in doc["seen"]
    bound = last_expiry(doc) + _dt.timedelta(milliseconds=SEEN_KEEP_MS)
    assert doc["gc_at"] == bound
    assert ttl_monitor(store, bound - _dt.timedelta(seconds=1)) == 0
    ids = [run_id("first", "0.")]
    lease, reply = store.try_acquire(KEY, 30, info=info("first"), limit=limit, ended_runs=ids)
    assert lease is None and Contended.of(reply, whole=True).attempt_ran(ids) is True  # refused as a copy
    doc = store.collection.find_one({"_id": KEY}) or {}  # the refused copy's acquire kept the bound
    assert doc["gc_at"] == bound
    assert ttl_monitor(store, bound) == 1
    assert copy_takes_the_key(store, "first", limit)


def test_a_run_given_back_before_its_body_ran_is_not_remembered(store: LeaseStore) -> None:
    """Only a run that ended with its own release is remembered: a key given back before the body ran
    (an acquire answered too late), a dead holder's key released by its worker's parent, or a forced
    release leave the copy free to run (it is the run's only chance)."""
    lease = store.acquire(KEY, 30, info=info("late"))
    assert lease is not None
    store.give_back(lease)
    assert copy_takes_the_key(store, "late")
    lease = store.acquire(KEY, 30, info=info("killed"))
    assert lease is not None
    assert store.release_held_by(task_id="killed") == 1
    assert copy_takes_the_key(store, "killed")
    lease = store.acquire(KEY, 30, info=info("forced"))
    assert lease is not None
    assert store.force_release(KEY)
    assert copy_takes_the_key(store, "forced")


def test_a_copy_matches_every_contention_retry_of_its_attempt_not_a_later_attempt(store: LeaseStore) -> None:
    """A copy is matched on its attempt (task id and own retries), whatever its contention retries
    (``"<task id>/<retries>."``, as ``task.py`` sends it): a parked copy that went on as a contention
    retry is still a copy of the run that ended. A later attempt (the body's own ``self.retry()``) is not."""
    ended_run(store, "first")  # delivery "0.0"
    lease, _ = store.try_acquire(KEY, 30, info=info("first"), ended_runs=[run_id("first", "0.")])
    assert lease is None
    lease, _ = store.try_acquire(KEY, 30, info=info("first"), ended_runs=[run_id("first", "1.")])
    assert lease is not None
    store.give_back(lease)
    lease, _ = store.try_acquire(KEY, 30, info=info("first"), ended_runs=[run_id("first", "")])
    assert lease is not None  # a whole id is matched whole (an older holder's "<task id>/")
    store.give_back(lease)


def handoff_token(store: LeaseStore) -> str:
    """The claim token of the key's pending handoff (a single key's ``ho``, or a slot's)."""
    doc = store.collection.find_one({"_id": KEY}) or {}
    handed = [doc["ho"]] if doc.get("ho") else [h["ho"] for h in doc.get("hs", []) if h.get("ho")]
    assert len(handed) == 1, doc
    return str(handed[0]["tk"])


@pytest.mark.parametrize("limit", [None, 1], ids=["single", "limit1"])
def test_a_handoff_message_past_the_memory_is_stale_never_a_new_run(
    store: LeaseStore, limit: int | None
) -> None:
    """A handed run's claim: a copy of its handoff message after the run ended is "done" while the key
    remembers the run, and "stale" past the bound (its claim token is long gone): never claimed or parked;
    the worker then asks the result backend (a task with its result is dropped)."""
    run = {"id": run_id("queued", "0"), "t": "queued", "n": "guarded", "r": "0", "s": 1, "m": b"m"}
    holder = store.acquire(KEY, 30, info=info("holder"), limit=limit)
    assert holder is not None
    store.admit(KEY, run, ttl=30, limit=limit)  # parked behind the holder
    assert holder.release()  # hands the key to the parked run
    token = handoff_token(store)
    lease, _ = store.admit(KEY, run, ttl=30, limit=limit, claim=token)
    assert lease is not None
    assert lease.release()
    lease, doc = store.admit(KEY, run, ttl=30, limit=limit, claim=token)
    assert lease is None and doc["lo"] == "done"
    for n in range(SEEN_KEPT - 1):  # the run, then SEEN_KEPT - 1 others: still remembered
        ended_run(store, f"other-{n}", limit)
    lease, doc = store.admit(KEY, run, ttl=30, limit=limit, claim=token)
    assert lease is None and doc["lo"] == "done"
    ended_run(store, "one-more", limit)  # past the bound
    lease, doc = store.admit(KEY, run, ttl=30, limit=limit, claim=token)
    assert lease is None and doc["lo"] == "stale"


def test_a_run_that_timed_out_parked_is_remembered_once_its_result_is_written(store: LeaseStore) -> None:
    """Results written by the sweeper: a ``Queue`` run parked past its ``timeout`` waits in ``dead`` (a copy
    of it is "dup"), and once its result is written it is remembered as a run that ended (``seen``), on the
    same bounds: a late copy is dropped ("done") until SEEN_KEPT - 1 other runs have ended after it, and
    admitted as a new run after one more; the key is kept SEEN_KEEP_MS after its last lease."""
    late = {"id": run_id("late", "0.0"), "t": "late", "n": "guarded", "r": "0.0", "s": 1, "m": b"m"}
    for n in range(SEEN_KEPT):  # a key whose memory is full
        ended_run(store, f"before-{n}")
    holder = store.acquire(KEY, 30, info=info("holder"))
    assert holder is not None
    store.admit(KEY, late, timeout=0.0)  # parked, its deadline past at once
    assert holder.release()  # nobody to hand the key to: the late run goes to dead
    lease, doc = store.admit(KEY, late)
    assert lease is None and doc["lo"] == "dup"  # its result is being written
    store.forget_results(KEY, "dead", ["late"])  # what the sweeper does once it wrote the result
    doc = store.collection.find_one({"_id": KEY}) or {}
    assert doc["seen"][-1] == run_id("late", "0.0") and len(doc["seen"]) == SEEN_KEPT and doc["dead"] == []
    assert doc["gc_at"] == doc["expires_at"] + _dt.timedelta(milliseconds=SEEN_KEEP_MS)
    for n in range(SEEN_KEPT - 1):
        ended_run(store, f"other-{n}")
    lease, doc = store.admit(KEY, late)
    assert lease is None and doc["lo"] == "done"
    ended_run(store, "one-more")  # past the bound
    lease, doc = store.admit(KEY, late)
    assert lease is not None  # a new run, as any acks_late task's late copy
    lease.release()


@pytest.mark.parametrize("limit", [None, 3], ids=["single", "limit3"])
def test_a_refused_guarded_acquire_says_why_in_its_own_reply(store: LeaseStore, limit: int | None) -> None:
    """A contention retry or copy refused by the guard is told so by its acquire's reply, with no read
    added (several keys judge every key this way): a ``limit=N`` key's reply carries ``seen`` when the
    acquire is guarded, and stays without it otherwise (the reply of every plain acquire stays small)."""
    ended_run(store, "first", limit)
    ids = [run_id("first", "0.")]
    lease, doc = store.try_acquire(KEY, 30, info=info("first"), limit=limit, ended_runs=ids)
    assert lease is None and Contended.of(doc, whole=True).attempt_ran(ids) is True
    lease, doc = store.try_acquire(
        KEY, 30, info=info("second"), limit=limit, ended_runs=[run_id("second", "0.")]
    )
    assert lease is not None and Contended.of(doc, whole=True).attempt_ran([run_id("second", "0.")]) is False
    store.give_back(lease)
    if limit is not None:
        lease, doc = store.try_acquire(KEY, 30, info=info("third"), limit=limit)
        assert lease is not None and "seen" not in (doc or {})
        store.give_back(lease)


@pytest.mark.parametrize(
    ("headers", "checked"),
    [
        ({"mongolock_handoff": {"k": "k", "tk": "t"}}, True),
        ({"mongolock_debounce": 1}, True),
        ({"mongolock_parked_duplicate": 1}, True),
        ({}, False),
    ],
    ids=["handoff", "delayed-copy", "parked-copy", "first-delivery"],
)
def test_a_message_published_again_does_not_start_a_body_of_a_task_that_has_ended(
    headers: dict[str, Any], checked: bool
) -> None:
    """Its keys taken, a run whose message is a handoff, a ``Replace(debounce=...)`` delayed copy or a
    copy looks at the task's stored state first (``duplicates.stale_line``): a run superseded meanwhile
    (its result written by the newer send, its record gone from the key) is dropped, its body never
    started (the lock-set checker, Redis seed 1: ``superseded-ran``, a debounced run of a set whose
    delayed copy was handed the gate after it was superseded). A first delivery is not looked at."""
    import celery

    from celery_mongolock import Replace, singleton_task
    from celery_mongolock.integration.duplicates import stale_line

    app = celery.Celery("stale_line", broker="memory://", backend="cache+memory://", set_as_current=False)

    @singleton_task(
        keys=("a:{x}", "b:{x}"), app=app, name="stale_line.job", bind=True, shared=False,
        on_contention=Replace(debounce=1.0),
    )  # fmt: skip
    def job(self: Any, x: str) -> None:  # pragma: no cover - never run here
        pass

    task_id = f"t-{uuid.uuid4().hex}"  # (the in-memory backend is one per process)
    job.push_request(
        id=task_id, args=("1",), kwargs={}, called_directly=False, is_eager=False, retries=0,
        delivery_info={"routing_key": "celery", "exchange": ""}, headers=headers,
    )  # fmt: skip
    try:
        assert stale_line(job, None, "a:1") is None  # no stored state yet: it runs
        app.backend.store_result(task_id, {"mongolock": "superseded", "by": "t-2"}, "SUCCESS")
        why = stale_line(job, None, "a:1")
        assert (why is not None) == checked
        if checked:
            assert why is not None and "has ended already (SUCCESS)" in why
    finally:
        job.pop_request()
