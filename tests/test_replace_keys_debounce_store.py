"""``Replace(debounce=...)`` with ``keys=`` in the lease store, on the embedded server (no Celery): every
run of a set parks on each of its keys with a not-before time (``nb``), even on a free key; a newer send
of the set supersedes the older runs of the set on every key (as without debounce); a run's delayed copy
(``due=True``) takes a key once its entry is due at the head of that key's queue and the key is free, and
is told ``superseded`` when a newer send of its set came; a run of another set that shares a key keeps
its place in send order."""

from __future__ import annotations

import time
from typing import Any

from celery_mongolock import LeaseStore

from .servers import server_past, wait_for
from .test_replace_keys_store import doc_of, parked, run, superseded

X, Y, Z = "rkd:x", "rkd:y", "rkd:z"
DEBOUNCE = 2.0


def admit(
    store: LeaseStore, key: str, e: dict[str, Any], *, due: bool = False, claim: str | None = None
) -> tuple[Any, dict[str, Any]]:
    info = {"task_id": e["t"], "delivery": e["r"], "keys": e["ks"]}
    return store.admit(
        key, e, ttl=30, claim=claim, replace=True, group=e["g"], debounce=DEBOUNCE, due=due, info=info
    )


def due_admit(store: LeaseStore, key: str, e: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The delayed copy's admit, again until the entry is due on the server's clock (``dup`` before)."""
    deadline = time.monotonic() + 30
    while True:
        lease, doc = admit(store, key, e, due=True)
        if doc["lo"] != "dup" or time.monotonic() > deadline:
            return lease, doc
        time.sleep(0.05)


def test_every_run_parks_even_on_free_keys_and_the_newest_of_the_set_takes_them_once_due(
    store: LeaseStore,
) -> None:
    runs = [run(10 + i, [X, Y]) for i in range(5)]
    for r in runs:
        for key in (X, Y):
            lease, doc = admit(store, key, r)
            assert lease is None and doc["lo"] == "parked"
    for key in (X, Y):
        assert parked(store, key) == ["r14"]
        assert [t for t, _ in superseded(store, key)] == ["r10", "r11", "r12", "r13"]
        assert doc_of(store, key).get("owner") is None  # free, not handed: the newest is not due yet
    # The older runs' delayed copies: superseded, by a newer send of the set.
    for r in runs[:-1]:
        _, doc = admit(store, X, r, due=True)
        assert doc["lo"] == "superseded" and doc["lo_by"] in {x["t"] for x in runs}
    # The newest's delayed copy takes both keys once due.
    held = [due_admit(store, key, runs[-1]) for key in (X, Y)]
    assert [doc["lo"] for _, doc in held] == ["due", "due"]
    for lease, _ in held:
        assert lease is not None
        lease.release()


def test_a_delayed_copy_before_its_entry_is_due_waits(store: LeaseStore) -> None:
    r = run(10, [X, Y])
    for key in (X, Y):
        assert admit(store, key, r)[1]["lo"] == "parked"
    store.collection.update_many({"_id": {"$in": [X, Y]}}, {"$set": {"q.0.nb": 2**62}})  # not due for ages
    lease, doc = admit(store, X, r, due=True)
    assert lease is None and doc["lo"] == "dup"
    assert parked(store, X) == ["r10"]


def test_a_run_of_another_set_sharing_a_key_keeps_its_place(store: LeaseStore) -> None:
    a1, b1, a2 = run(10, [X, Y]), run(15, [Y, Z]), run(20, [X, Y])
    for r in (a1, b1, a2):
        for key in r["ks"]:
            assert admit(store, key, r)[1]["lo"] == "parked"
    assert parked(store, Y) == ["r15", "r20"]  # the other set's run first, in send order
    assert superseded(store, Y) == [("r10", "r20")]
    # The other set's delayed copy takes its keys (it is at the head of Y); a2 then waits behind it on Y.
    lb = [due_admit(store, key, b1) for key in (Y, Z)]
    assert [doc["lo"] for _, doc in lb] == ["due", "due"]
    lx, doc = due_admit(store, X, a2)
    assert lx is not None and doc["lo"] == "due"
    _, doc = admit(store, Y, a2, due=True)
    assert doc["lo"] == "dup"  # Y is held by the other set's run: a2 stays parked there
    assert store.reserve(lx, a2)  # what ``_reserve_all`` does with X
    # a2 parked on Y after X: its entry there is due a little later (more on a busy machine). A release
    # hands the key only to a due head, so wait for it on the server's clock.
    (nb,) = [e["nb"] for e in doc_of(store, Y)["q"] if e["t"] == "r20"]
    wait_for(lambda: server_past(store, nb), timeout=30, message="a2's entry on Y is due")
    for lease, _ in lb:
        lease.release()  # Y is handed to a2, due: reserved on both, it claims them
    assert store.reserved_for_all(a2)
    held = [admit(store, key, a2, claim=a2["tk"])[0] for key in (X, Y)]
    assert all(lease is not None for lease in held)
    for lease in held:
        assert lease is not None
        lease.release()
