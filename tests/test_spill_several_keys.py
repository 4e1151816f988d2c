"""Deep queues and runs of a ``Replace`` set of keys, in the lease store on the embedded server (no Celery):
such a run (``ks`` and its set's signature ``g``) waits on every key of its set at once and is never
spilled, so it may park in the window while older runs of one key of its rank are still spilled (their
refill not done yet: a worker stopped before it, or it is under way). It is then held back
(``lanes.held_back``): the key, or a free slot, goes to those older runs first (the lock-set checker's
Redis seed 48: a run of several keys sent later got a slot of a ``limit=3`` key before a run spilled
before it). It is never starved: once a refill passed its send stamp, or the lane is empty, it is handed
its turn; and a key or slot never idles for it while a run behind it may go. (A ``Queue`` run of several
keys takes them one at a time and is spilled like a run of one key: ``test_stepwise_keys``.)"""

from __future__ import annotations

from typing import Any

import pytest

from celery_mongolock import LeaseStore

from .test_admission_store import KEY, Handoffs, entry
from .test_spill_store import WINDOW, lanes, spilled, window

LIMIT = 2
OTHER = "other:1"


@pytest.fixture
def deep(make_store: Any) -> LeaseStore:
    return make_store(lease_seconds=30, parked_window=WINDOW)  # type: ignore[no-any-return]


def several(stamp: int, task_id: str | None = None) -> dict[str, Any]:
    """A ``Replace`` run of the set of two keys (``KEY`` and ``OTHER``), as its admit on ``KEY`` gives it."""
    tid = task_id or f"merge-{stamp}"
    return {
        "id": f"{tid}/0",
        "t": tid,
        "n": "merge",
        "r": "0",
        "s": stamp,
        "m": b"msg",
        "ks": [KEY, OTHER],
        "g": "ks:merge-set",
    }


class _NoRefills:
    """Within it, no refill happens (the workers that would refill stopped first)."""

    def __init__(self, store: LeaseStore) -> None:
        self.store = store
        self.after_reply = store.handoffs.after_reply

    def __enter__(self) -> None:
        self.store.spill.refill_if_low = lambda key, doc: None  # type: ignore[method-assign]
        self.store.handoffs.after_reply = None

    def __exit__(self, *exc: object) -> None:
        del self.store.spill.refill_if_low
        self.store.handoffs.after_reply = self.after_reply


def _gone(store: LeaseStore, *task_ids: str) -> None:
    """The window's runs ``task_ids`` were handed the key and ran, and no refill followed."""
    store.collection.update_one({"_id": KEY}, {"$pull": {"q": {"t": {"$in": list(task_ids)}}}})


def _older_run_spilled_then_several_keys_parked(store: LeaseStore, limit: int | None = None) -> None:
    """task-10 and task-11 fill the window, task-12 is spilled; then merge-20 (several keys, sent after
    task-12) parks in the window; task-10 and task-11 leave without a refill: the window holds merge-20
    alone, the lane task-12 (older)."""
    with _NoRefills(store):
        for stamp in (10, 11, 12):
            assert store.admit(KEY, entry(stamp), limit=limit)[1]["lo"] == "parked"
        assert store.admit(KEY, several(20), limit=limit)[1]["lo"] == "parked"
        _gone(store, "task-10", "task-11")
    assert window(store) == ["merge-20"] and spilled(store) == ["task-12"]


def _claim(store: LeaseStore, ho: dict[str, Any], limit: int | None = None) -> Any:
    e = several(int(ho["s"]), ho["t"]) if ho.get("ks") else entry(int(ho["s"]), ho["t"])
    lease, doc = store.admit(KEY, {**e, "tk": ho["tk"]}, claim=ho["tk"], limit=limit)
    assert lease is not None and doc["lo"] == "claimed", doc.get("lo")
    return lease


def _run_in_turn(store: LeaseStore, handoffs: Handoffs, limit: int | None = None) -> list[str]:
    """Let each handed run claim the key (or its slot) and release it, in the order they were handed."""
    order: list[str] = []
    while len(order) < len(handoffs.seen):
        _, ho = handoffs.seen[len(order)]
        order.append(ho["t"])
        assert _claim(store, ho, limit).release()
    return order


# -- the inversion --------------------------------------------------------------------------------------
def test_a_key_goes_to_an_older_spilled_run_before_a_later_run_of_several_keys(deep: LeaseStore) -> None:
    """A key held as one lease: its release finds the run of several keys alone in the window and the
    older run still spilled. It hands the key to nobody; its refill brings the spilled run and hands it
    the key; the run of several keys goes next."""
    handoffs = Handoffs(deep)
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    _older_run_spilled_then_several_keys_parked(deep)
    assert holder.release()
    assert handoffs.tasks[:1] == ["task-12"]
    assert _run_in_turn(deep, handoffs) == ["task-12", "merge-20"]
    assert spilled(deep) == [] and window(deep) == []


def test_a_slot_goes_to_an_older_spilled_run_before_a_later_run_of_several_keys(deep: LeaseStore) -> None:
    """As above on a ``limit=N`` key: the freed slot goes to the spilled run (its refill's), not to the run
    of several keys the window holds; the next freed slot to that one."""
    handoffs = Handoffs(deep)
    holders: list[Any] = [deep.acquire(KEY, 30, limit=LIMIT) for _ in range(LIMIT)]
    assert all(holders)
    _older_run_spilled_then_several_keys_parked(deep, LIMIT)
    assert holders[0].release()
    assert handoffs.tasks == ["task-12"]
    assert holders[1].release()
    assert handoffs.tasks == ["task-12", "merge-20"]
    assert _run_in_turn(deep, handoffs, LIMIT) == ["task-12", "merge-20"]


def test_runs_of_several_keys_past_the_window_do_not_keep_the_refill_out(deep: LeaseStore) -> None:
    """The window holds runs of several keys only, as many as the window (they are not counted in it: a
    refill still brings the older spilled run, else all would wait for it for good)."""
    handoffs = Handoffs(deep)
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    _older_run_spilled_then_several_keys_parked(deep)
    with _NoRefills(deep):
        assert deep.admit(KEY, several(21))[1]["lo"] == "parked"
    assert window(deep) == ["merge-20", "merge-21"] and spilled(deep) == ["task-12"]
    assert holder.release()
    assert _run_in_turn(deep, handoffs) == ["task-12", "merge-20", "merge-21"]


def test_the_sweeper_hands_a_key_left_vacant_to_the_older_spilled_run_first(deep: LeaseStore) -> None:
    """The release's worker stopped before its refill: the key is vacant, its window holds the run of
    several keys alone. The sweeper brings the older spilled run and hands it the key."""
    handoffs = Handoffs(deep)
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    _older_run_spilled_then_several_keys_parked(deep)
    with _NoRefills(deep):
        assert holder.release()
    assert handoffs.tasks == [] and window(deep) == ["merge-20"]  # held back, and nothing refilled
    deep.sweep(KEY)
    assert handoffs.tasks == ["task-12"]
    assert _run_in_turn(deep, handoffs) == ["task-12", "merge-20"]


# -- the admit's take-it-now --------------------------------------------------------------------------
def _vacant_with_an_older_run_spilled(store: LeaseStore, limit: int | None = None) -> None:
    """The key is free (its holder released it, and the refill after did not happen), its window empty,
    its lane holding task-12."""
    holders = [store.acquire(KEY, 30, limit=limit) for _ in range(limit or 1)]
    assert all(holders)
    with _NoRefills(store):
        for stamp in (10, 11, 12):
            assert store.admit(KEY, entry(stamp), limit=limit)[1]["lo"] == "parked"
        _gone(store, "task-10", "task-11")
        for holder in holders:
            assert holder is not None and holder.release()
    assert window(store) == [] and spilled(store) == ["task-12"]


@pytest.mark.parametrize("limit", [None, LIMIT])
def test_a_run_of_several_keys_takes_no_free_key_while_an_older_run_is_spilled(
    deep: LeaseStore, limit: int | None
) -> None:
    """A run of several keys admitted on a free key (or one with free slots) while an older run of its
    rank is spilled parks; the refill its reply leads to brings the spilled run and hands it the key (a
    slot), and the run of several keys goes after it (at once, on a ``limit=N`` key: another slot is
    free)."""
    handoffs = Handoffs(deep)
    _vacant_with_an_older_run_spilled(deep, limit)
    lease, doc = deep.admit(KEY, several(20), limit=limit)
    assert lease is None and doc["lo"] == "parked"
    assert handoffs.tasks[:1] == ["task-12"]
    assert _run_in_turn(deep, handoffs, limit) == ["task-12", "merge-20"]


@pytest.mark.parametrize("limit", [None, LIMIT])
def test_a_run_of_several_keys_sent_before_what_the_lane_passed_takes_a_free_key(
    deep: LeaseStore, limit: int | None
) -> None:
    """A refill moved task-12 out of the lane (``pm``), and the lane holds a number again (a run spilled
    since, not stored yet). A run of several keys sent before task-12 (delivered late) takes the free key at
    its admit, as before; one sent after it parks, and is handed the key once the refill found the lane
    empty."""
    handoffs = Handoffs(deep)
    _vacant_with_an_older_run_spilled(deep, limit)
    assert deep.spill.refill(KEY, 0) is not None  # task-12 moved, and handed the key
    assert [lane.get("pm") for lane in lanes(deep)] == [12]
    assert _run_in_turn(deep, handoffs, limit) == ["task-12"]
    deep.collection.update_one({"_id": KEY}, {"$inc": {"sp.0.t": 1}})  # its worker did not store it yet
    with _NoRefills(deep):  # (the lane keeps its number)
        lease, doc = deep.admit(KEY, several(5), limit=limit)
        assert lease is not None and doc["lo"] == "acquired"
        assert lease.release()
    lease, doc = deep.admit(KEY, several(20), limit=limit)
    assert lease is None and doc["lo"] == "parked"
    assert handoffs.tasks == ["task-12", "merge-20"]  # (the refill found a hole, and handed it the key)


# -- never starved ----------------------------------------------------------------------------------------
def test_a_run_of_several_keys_alone_in_the_window_is_handed_once_a_refill_passes_it(
    deep: LeaseStore,
) -> None:
    """The lane holds only runs sent after the run of several keys, and no refill moved any yet (no
    ``pm``): held back while its release finds it alone, it is handed by the refill that follows, which
    moves a newer run past it."""
    handoffs = Handoffs(deep)
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    with _NoRefills(deep):
        for stamp in (10, 11):
            assert deep.admit(KEY, entry(stamp))[1]["lo"] == "parked"
        assert deep.admit(KEY, several(15))[1]["lo"] == "parked"
        assert deep.admit(KEY, entry(20))[1]["lo"] == "parked"
        _gone(deep, "task-10", "task-11")
    assert window(deep) == ["merge-15"] and spilled(deep) == ["task-20"]
    assert holder.release()
    assert handoffs.tasks == ["merge-15"]
    assert _run_in_turn(deep, handoffs) == ["merge-15", "task-20"]


def test_a_run_of_several_keys_goes_before_newer_runs_of_one_key_in_the_window(deep: LeaseStore) -> None:
    """A run of one key sent after it parked in the window (its lane was empty then): every run spilled
    since is newer, so the run of several keys is not held back and goes first, not the newer run."""
    handoffs = Handoffs(deep)
    holder = deep.acquire(KEY, 30)
    assert holder is not None
    with _NoRefills(deep):
        assert deep.admit(KEY, several(15))[1]["lo"] == "parked"
        assert deep.admit(KEY, entry(16))[1]["lo"] == "parked"
        assert deep.admit(KEY, entry(20))[1]["lo"] == "parked"
    assert window(deep) == ["merge-15", "task-16"] and spilled(deep) == ["task-20"]
    assert holder.release()
    assert _run_in_turn(deep, handoffs) == ["merge-15", "task-16", "task-20"]


@pytest.mark.parametrize("limit", [None, LIMIT])
def test_a_run_of_several_keys_is_not_starved_by_runs_spilling_behind_it(
    deep: LeaseStore, limit: int | None
) -> None:
    """Runs of one key keep coming (and spilling) while the run of several keys waits behind older spilled
    runs: it goes right after those sent before it, never after those sent later."""
    handoffs = Handoffs(deep)
    holders = [deep.acquire(KEY, 30, limit=limit) for _ in range(limit or 1)]
    assert all(holders)
    with _NoRefills(deep):
        for stamp in (10, 11, 12, 13):
            assert deep.admit(KEY, entry(stamp), limit=limit)[1]["lo"] == "parked"
        assert deep.admit(KEY, several(15), limit=limit)[1]["lo"] == "parked"
        _gone(deep, "task-10", "task-11")
    assert spilled(deep) == ["task-12", "task-13"]
    stamp = 30
    order: list[str] = []
    for holder in holders:
        assert holder is not None and holder.release()
    while len(order) < len(handoffs.seen):
        _, ho = handoffs.seen[len(order)]
        order.append(ho["t"])
        lease = _claim(deep, ho, limit)
        if stamp < 40:  # a newer run comes while each one runs
            assert deep.admit(KEY, entry(stamp), limit=limit)[1]["lo"] == "parked"
            stamp += 1
        assert lease.release()
    assert order == ["task-12", "task-13", "merge-15", *[f"task-{s}" for s in range(30, 40)]]
    assert spilled(deep) == [] and window(deep) == []
