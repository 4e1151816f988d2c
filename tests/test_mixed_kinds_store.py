"""The admit of a run whose key is in use as the other kind of key (``limit=N`` slots for a run that takes
it as a single lease, or the reverse) answers ``mixed`` and parks nothing: a release would hand the run
what it cannot claim (``tests/test_mixed_kinds.py`` has the loop that made with real workers). In use
means held, handed, or with runs of the other kind parked (``qk``): behind a holder that died, or runs of
slots debounced while no slot is held (the two cases the known issue listed until stop 62)."""

from __future__ import annotations

import datetime as _dt
from typing import Any

import pytest

from celery_mongolock import LeaseStore
from celery_mongolock.core.outcomes import Admission, AdmitOutcome
from celery_mongolock.ops import cli_queue
from celery_mongolock.testing import wait_for

KEY = "kinds:a"


def entry(task_id: str, stamp: int) -> dict[str, Any]:
    return {"id": f"{task_id}/0", "t": task_id, "n": "merge", "r": "0", "s": stamp, "m": b"m"}


def parked(store: LeaseStore) -> list[str]:
    doc = store.collection.find_one({"_id": KEY}) or {}
    return [e["t"] for e in doc.get("q") or []]


def test_a_run_of_a_single_lease_does_not_park_behind_slots(store: LeaseStore) -> None:
    published: list[str] = []
    store.add_handoff_callback(lambda key, e, doc: published.append(str(e.get("t"))))
    slot = store.acquire(KEY, 30, limit=3)
    assert slot is not None
    lease, doc = store.admit(KEY, entry("single", 10), ttl=30)
    assert lease is None and Admission.of(lease, doc).outcome is AdmitOutcome.MIXED
    assert parked(store) == []
    # A run of slots parks as before (all three held).
    others = [store.acquire(KEY, 30, limit=3) for _ in range(2)]
    assert all(others)
    _, doc = store.admit(KEY, entry("slots", 11), ttl=30, limit=3)
    assert doc["lo"] == "parked" and parked(store) == ["slots"]
    slot.release()  # hands its slot to the run of slots, never to the single lease's run
    assert published == ["slots"]
    for hold in others:
        assert hold is not None and hold.release()
    _, doc = store.admit(KEY, entry("single", 10), ttl=30)  # the slot handed to "slots" is in use
    assert doc["lo"] == "mixed"
    claimed, doc = store.admit(KEY, entry("slots", 11), ttl=30, limit=3, claim=_token(store, "slots"))
    assert claimed is not None and claimed.release()
    taken, doc = store.admit(KEY, entry("single", 10), ttl=30)  # free of slots now: taken
    assert taken is not None and doc["lo"] == "acquired"
    taken.release()


def test_a_run_of_slots_does_not_park_behind_a_single_lease(store: LeaseStore) -> None:
    holder = store.acquire(KEY, 30)
    assert holder is not None
    lease, doc = store.admit(KEY, entry("slots", 10), ttl=30, limit=3)
    assert lease is None and doc["lo"] == "mixed" and parked(store) == []
    _, doc = store.admit(KEY, entry("single", 11), ttl=30)
    assert doc["lo"] == "parked"
    holder.release()  # handed to the single lease's run: still in use as one
    assert store.admit(KEY, entry("slots", 10), ttl=30, limit=3)[1]["lo"] == "mixed"


def _token(store: LeaseStore, task_id: str) -> str:
    doc = store.collection.find_one({"_id": KEY}) or {}
    handed = [h["ho"] for h in doc.get("hs") or [] if h.get("ho") and h["ho"]["t"] == task_id]
    assert handed, doc
    return str(handed[0]["tk"])


def _expired(store: LeaseStore) -> bool:
    """The key's lease has expired on the server's clock."""
    doc = store.collection.find_one({"_id": KEY}, {"expires_at": 1}) or {}
    now = store.collection.database.command("hello")["localTime"]
    return bool(doc.get("expires_at") and doc["expires_at"].replace(tzinfo=None) < now.replace(tzinfo=None))


def _handed(published: list[tuple[str, str]], task_id: str) -> str:
    tokens = [tk for t, tk in published if t == task_id]
    assert tokens, published
    return tokens[-1]


def test_a_run_of_slots_does_not_park_behind_runs_of_a_single_lease_whose_holder_died(
    store: LeaseStore,
) -> None:
    published: list[tuple[str, str]] = []
    store.add_handoff_callback(lambda key, e, doc: published.append((str(e.get("t")), str(e.get("tk")))))
    assert store.acquire(KEY, 0.5) is not None  # never renewed: its holder "died"
    for task_id, stamp in (("one-1", 10), ("one-2", 11)):
        assert store.admit(KEY, entry(task_id, stamp), ttl=30)[1]["lo"] == "parked"
    wait_for(lambda: _expired(store), timeout=30, message="the dead holder's lease to expire")
    # Before: the run of slots parked behind them, and its admit handed a slot to each of the three
    # (their claims answered ``stale``: the runs of a single lease never ran while slots were handed).
    lease, doc = store.admit(KEY, entry("slots", 12), ttl=30, limit=3)
    assert lease is None and doc["lo"] == "mixed"
    assert parked(store) == ["one-1", "one-2"] and published == []
    # The sweeper serves the key as a single lease (its runs parked are), though it has had a limit.
    found = [w for w in store.waiting() if w.key == KEY]
    assert found and found[0].slotted is False
    assert store.sweep(KEY) is not None and [t for t, _ in published] == ["one-1"]
    for task_id, stamp in (("one-1", 10), ("one-2", 11)):
        claimed, doc = store.admit(KEY, entry(task_id, stamp), ttl=30, claim=_handed(published, task_id))
        assert claimed is not None and doc["lo"] == "claimed", doc["lo"]
        assert store.admit(KEY, entry("slots", 12), ttl=30, limit=3)[1]["lo"] == "mixed"
        assert claimed.release()
    taken, doc = store.admit(KEY, entry("slots", 12), ttl=30, limit=3)  # nothing of the other kind left
    assert taken is not None and doc["lo"] == "acquired"
    assert taken.release()


def test_a_run_of_a_single_lease_does_not_park_behind_runs_of_slots_waiting_for_their_debounce(
    store: LeaseStore,
) -> None:
    published: list[tuple[str, str]] = []
    store.add_handoff_callback(lambda key, e, doc: published.append((str(e.get("t")), str(e.get("tk")))))
    _, doc = store.admit(KEY, entry("slots", 10), ttl=30, limit=3, replace=True, debounce=0.3)
    assert doc["lo"] == "parked"  # no slot held: it waits for its debounce
    # Before: the run of a single lease parked behind it (no slot in use), and the sweeper's slot fill
    # then handed it a slot.
    lease, doc = store.admit(KEY, entry("one", 11), ttl=30)
    assert lease is None and doc["lo"] == "mixed" and parked(store) == ["slots"]

    def handed_on_sweep() -> bool:
        store.sweep(KEY)
        return bool(published)

    wait_for(handed_on_sweep, timeout=30, message="the debounced run of slots to be handed a slot")
    assert [t for t, _ in published] == ["slots"]
    token = _handed(published, "slots")
    claimed, doc = store.admit(
        KEY, entry("slots", 10), ttl=30, limit=3, replace=True, debounce=0.3, claim=token
    )
    assert claimed is not None and doc["lo"] == "claimed", doc["lo"]
    assert store.admit(KEY, entry("one", 11), ttl=30)[1]["lo"] == "mixed"  # a slot is held
    assert claimed.release()
    taken, doc = store.admit(KEY, entry("one", 11), ttl=30)
    assert taken is not None and doc["lo"] == "acquired"
    assert taken.release()


# -- what the kind of the parked runs does not outlive (a review of stop 62) --------------------------------
T, G = "kinds:t", "kinds:g"
LONG_AGO = _dt.datetime(2000, 1, 1)  # (a lease or hold made to have expired: the server's clock is past it)


def one(task_id: str, stamp: int) -> dict[str, Any]:
    return {"id": f"{task_id}/0", "t": task_id, "n": "merge", "r": "0", "s": stamp, "m": b"m"}


def handed_on(store: LeaseStore) -> list[str]:
    seen: list[str] = []
    store.add_handoff_callback(lambda key, ho, doc: seen.append(str(ho["t"])) if key == T else None)
    return seen


def test_a_lapsed_reservation_of_slots_is_handed_a_slot_whatever_kind_ran_before(store: LeaseStore) -> None:
    """``qk`` is dropped with the last parked run, and a lapsed slot reservation back in ``q`` says
    ``slots``: a kind written long ago does not turn the sweeper into handing it a single lease (which
    its claim, with a limit, cannot take)."""
    seen = handed_on(store)
    holder = store.acquire(T, 30)  # T first as a single lease, a run parked: qk "one"
    assert holder is not None
    assert store.admit(T, one("one-1", 1), ttl=30)[1]["lo"] == "parked"
    assert holder.release()
    lease, doc = store.admit(
        T, one("one-1", 1), ttl=30, claim=(store.collection.find_one({"_id": T}) or {})["ho"]["tk"]
    )
    assert lease is not None and doc["lo"] == "claimed" and lease.release()
    assert "qk" not in (store.collection.find_one({"_id": T}) or {})  # nothing parked: no kind
    # A run of slots of T and G: G held, so it parks there; its slot of T becomes a reservation.
    blocker = store.acquire(G, 30)
    assert blocker is not None
    run = {**one("upload-10", 10), "n": "upload", "ks": [G, T], "tk": "tk-upload-10"}
    assert store.admit(G, run, ttl=30)[1]["lo"] == "parked"
    slot, doc = store.admit(T, run, ttl=30, limit=2)
    assert slot is not None and doc["lo"] == "acquired" and store.reserve(slot, run)
    # The reservation lapses (its run waits on G longer than a lease): the sweeps hand it a slot again.
    store.collection.update_one(
        {"_id": T}, {"$set": {"hs.$[h].x": LONG_AGO}}, array_filters=[{"h.o": run["tk"]}]
    )
    store.sweep(T)
    store.sweep(T)
    after = store.collection.find_one({"_id": T}) or {}
    assert after.get("ho") is None and [h["ho"]["t"] for h in after["hs"] if h.get("ho")] == ["upload-10"]
    _, doc = store.admit(T, run, ttl=30, limit=2, claim=run["tk"])
    assert doc["lo"] == "claimed"
    assert seen.count("upload-10") >= 1


@pytest.mark.parametrize("limit_from", ["a-run-of-slots-refused", "an-earlier-slot"])
def test_a_lapsed_handoff_of_a_single_lease_on_a_key_that_has_had_a_limit_is_handed_again(
    store: LeaseStore, limit_from: str
) -> None:
    """A key keeps ``lim`` once it has had one (``hs`` too): a single lease's handoff that lapsed (its
    run's message lost) is still handed again, by the single pass (the slot pass left it for good, and
    every run of slots was refused ``mixed`` meanwhile)."""
    seen = handed_on(store)
    if limit_from == "an-earlier-slot":
        slot = store.acquire(T, 30, limit=3)
        assert slot is not None and slot.release()
    holder = store.acquire(T, 30)
    assert holder is not None
    assert store.admit(T, one("one-1", 1), ttl=30)[1]["lo"] == "parked"
    if limit_from == "a-run-of-slots-refused":
        assert store.admit(T, one("slots", 2), ttl=30, limit=3)[1]["lo"] == "mixed"  # (it writes lim)
    store.collection.update_one({"_id": T}, {"$set": {"expires_at": LONG_AGO}})  # the holder died
    store.sweep(T)
    assert seen == ["one-1"]
    store.collection.update_one({"_id": T}, {"$set": {"expires_at": LONG_AGO}})  # its handoff lapses
    found = [w for w in store.waiting() if w.key == T]
    assert found and found[0].slotted is False and found[0].needs_sweep
    store.sweep(T)
    assert seen == ["one-1", "one-1"]


def test_a_replace_run_of_slots_waiting_on_a_single_lease_is_not_superseded_by_runs_of_that_kind(
    store: LeaseStore,
) -> None:
    """A new user's trial (stop 62): ``Replace(debounce=...)`` with a limit, on a key held as a single
    lease by a ``Queue`` task, a run of which parked after the Replace sends: every Replace send came back
    to find that run parked, a newer send of the key, and ended superseded by it; the Replace task never
    ran. The runs of the other kind are not sends it waits among: it waits (``mixed``) until the key is
    free of them, and then the newest of its own sends wins."""
    seen = handed_on(store)

    def deb(task_id: str, stamp: int) -> tuple[Any, dict[str, Any]]:
        return store.admit(T, one(task_id, stamp), ttl=30, limit=3, replace=True, debounce=0.2)

    holder, doc = store.admit(T, one("single-1", 1), ttl=30)
    assert holder is not None and doc["lo"] == "acquired"
    assert deb("deb-1", 2)[1]["lo"] == "mixed" and deb("deb-2", 3)[1]["lo"] == "mixed"
    assert store.admit(T, one("single-2", 4), ttl=30)[1]["lo"] == "parked"
    # They come back (a contention retry each) while the run of a single lease waits: still mixed.
    assert deb("deb-1", 2)[1]["lo"] == "mixed" and deb("deb-2", 3)[1]["lo"] == "mixed"
    assert holder.release() and seen == ["single-2"]
    handed = (store.collection.find_one({"_id": T}) or {})["ho"]["tk"]
    second, doc = store.admit(T, one("single-2", 4), ttl=30, claim=handed)
    assert second is not None and doc["lo"] == "claimed" and second.release()
    # Free of the other kind: the older send parks, the newer supersedes it and is the one that runs.
    assert deb("deb-1", 2)[1]["lo"] == "parked"
    _, doc = deb("deb-2", 3)
    assert doc["lo"] == "parked"
    assert [s["t"] for s in (store.collection.find_one({"_id": T}) or {}).get("sup") or []] == ["deb-1"]

    def handed_on_sweep() -> bool:
        store.sweep(T)
        return "deb-2" in seen

    wait_for(handed_on_sweep, timeout=30, message="the newest Replace send to be handed a slot")


def test_a_run_that_finds_the_other_kind_comes_back_within_five_seconds() -> None:
    """Nobody hands such a run the key: it looks again soon, not after ``Retry()``'s minute."""
    from celery_mongolock.integration.queued_run import MIXED_RETRY

    delays = [MIXED_RETRY.delay(attempt) for attempt in range(200)]
    assert max(delays) <= 5.0 and min(delays) > 0 and not MIXED_RETRY.exhausted(10_000)


def test_a_run_kept_aside_as_the_other_kind_is_noted_for_why_once_and_the_newest_kept(
    store: LeaseStore,
) -> None:
    """``LeaseStore.note_kind_wait`` (``documents.kind_waits``): one record per run in the key's document
    (a run noted again keeps one, with its first wait), the newest 16 kept; nothing is written for a key
    with no document; ``why`` shows them."""
    store.note_kind_wait("kinds:none", "t0", "app.sync", "slots", None)
    assert store.collection.find_one({"_id": "kinds:none"}) is None
    holder = store.acquire("kinds:noted", 600)
    assert holder is not None
    store.note_kind_wait("kinds:noted", "t1", "app.sync", "slots", 1_000)
    store.note_kind_wait("kinds:noted", "t1", "app.sync", "slots", 1_000)
    story = store.why("kinds:noted")
    assert story is not None and [(w.task_id, w.wants) for w in story.other_kind] == [("t1", "slots")]
    assert story.other_kind[0].since is not None and story.other_kind[0].since.timestamp() == 1.0
    # `inspect`, `list` and `celery mongolock queue` show it too: not parked, not counted in the queue.
    info = store.inspect("kinds:noted")
    assert info is not None and info.parked_total == 0
    [wait] = info.other_kind
    assert (wait["task_id"], wait["wants"]) == ("t1", "slots") and wait["waiting_for"] > 1e6
    assert 0 <= wait["back_ago"] < 60 and info.as_dict()["other_kind"] == [wait]
    lines = cli_queue.queue_lines(info, 1, 50)
    assert lines[0] == "kinds:noted: 0 run(s) parked" and "1 run(s) not parked" in lines[1]
    assert lines[2].split()[:6] == ["app.sync[t1]", "waits", "to", "take", "it", "as"], lines
    for n in range(2, 20):
        store.note_kind_wait("kinds:noted", f"t{n}", "app.sync", "slots", None)
    doc = store.collection.find_one({"_id": "kinds:noted"}) or {}
    assert [w["t"] for w in doc["kw"]] == [f"t{n}" for n in range(4, 20)]
    story = store.why("kinds:noted")
    assert story is not None and len(story.other_kind) == 16 and story.state == "held"
