"""Deep queues of ``Queue`` runs of several keys (``keys=``): such a run takes its keys one at a time, in
key order, and waits on at most one of them, the first it has not got, holding reservations on the keys
before it only (ordered resource acquisition: no cycle of waits can form). Its place on a key is where it
arrived there, so it is spilled beyond the key's window like a run of one key: no cap of the lease
document on how many runs of several keys wait on a key.

With real ``celery worker`` processes (prefork) on each broker in turn (Redis, then RabbitMQ), whose
workers keep 2 parked runs in a key's lease document (``integration_app``): every run beyond them is
spilled; and in the lease store (no Celery) for the rules a handoff follows."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

from celery_mongolock import LeaseStore
from celery_mongolock.integration import handoff as _queue

from . import integration_app as it
from .servers import RedisServer, wait_for
from .test_admission_store import entry
from .test_integration import Cluster, running_cluster
from .test_queue import parked

WINDOW = 2


@pytest.fixture(scope="module")
def cluster(
    broker_url: str, redis_server: RedisServer, mongo_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    with running_cluster("sk", broker_url, redis_server.url, mongo_url, tmp_path_factory) as c:
        yield c


def tag() -> str:
    return uuid.uuid4().hex[:10]


def spilled_count(cluster: Cluster, key: str) -> int:
    return int(cluster.store.spill.collection.count_documents({"k": key, "x": {"$ne": True}}))


def reserved_for(cluster: Cluster, key: str) -> str | None:
    doc = cluster.store.collection.find_one({"_id": key}) or {}
    return (doc.get("ho") or {}).get("t")


def _parked_as(cluster: Cluster, key: str, task_ids: list[str]) -> bool:
    return parked(cluster, key) == task_ids


def spilled_behind(
    cluster: Cluster, task: Any, shared: str, pairs: list[tuple[str, str]]
) -> tuple[Any, list[str], list[Any]]:
    """Runs of ``task`` for each pair of arguments (naming ``resource:<shared>`` and another key), sent one
    at a time while ``resource:<shared>`` is held, each once the one before waits there (send order is
    arrival order); all but ``WINDOW`` of them spilled. (the blocker's lease, the tags, the results)"""
    key = f"resource:{shared}"
    blocker = cluster.store.acquire(key, 600)
    assert blocker is not None
    tags: list[str] = []
    results: list[Any] = []
    for x, y in pairs:
        tags.append(tag())
        results.append(task.delay(x, y, tags[-1], 0.1))
        sent = [r.id for r in results]
        wait_for(partial(_parked_as, cluster, key, sent), timeout=60, message=f"{tags[-1]} to wait there")
    assert spilled_count(cluster, key) == len(tags) - WINDOW
    return blocker, tags, results


def _starts(cluster: Cluster, tags: list[str]) -> list[str]:
    runs = [r for r in cluster.runs(kind="start") if r["tag"] in tags]
    return [r["tag"] for r in sorted(runs, key=lambda r: r["t"])]


def _no_overlap(cluster: Cluster, tags: list[str]) -> None:
    holds: dict[str, list[tuple[float, float, str]]] = {}
    for t in tags:
        [start] = cluster.runs(t, "start")  # (each body ran once)
        [end] = cluster.runs(t, "end")
        assert sorted(start["fences"]) == start["keys"], "the body ran holding every key"
        for key in start["keys"]:
            holds.setdefault(str(key), []).append((start["mono"], end["mono"], t))
    for key, spans in holds.items():
        for (_, e1, t1), (s2, _, t2) in itertools.pairwise(sorted(spans)):
            assert e1 <= s2, f"{t1} and {t2} held {key} at once"


@pytest.mark.slow
def test_runs_of_several_keys_queue_deep_on_their_first_key_and_run_in_send_order(cluster: Cluster) -> None:
    """Runs of the same keys (a, b), b held: the first takes a, waits on b with a reserved for it; every
    later one waits on a, beyond the window spilled. Each runs once, one at a time, in send order."""
    suffix = tag()
    a, b = f"a{suffix}", f"b{suffix}"
    key_a, key_b = f"resource:{a}", f"resource:{b}"
    blocker = cluster.store.acquire(key_b, 600)
    assert blocker is not None
    tags = [tag() for _ in range(8)]
    results = [it.merge_queued.delay(a, b, tags[0], 0.1)]
    wait_for(  # (a run parks on b, then turns a, which it took, into a reservation)
        lambda: results[0].id in parked(cluster, key_b) and reserved_for(cluster, key_a) == results[0].id,
        timeout=60,
        message="the first to wait on b, a reserved for it",
    )
    for t in tags[1:]:  # each sent once the one before waits (so that send order is arrival order)
        results.append(it.merge_queued.delay(a, b, t, 0.1))
        sent = [r.id for r in results[1:]]
        wait_for(partial(_parked_as, cluster, key_a, sent), timeout=60, message=f"{t} to wait on a")
    # They wait on a only (parked on one key at a time), beyond the window spilled.
    assert parked(cluster, key_b) == [results[0].id]
    assert spilled_count(cluster, key_a) == len(tags) - 1 - WINDOW
    blocker.release()
    keys = sorted([key_a, key_b])
    assert [r.get(timeout=120) for r in results] == [keys] * len(tags)
    assert _starts(cluster, tags) == tags
    _no_overlap(cluster, tags)
    for key in keys:
        info = cluster.store.inspect(key)
        assert info is None or not (info.held or info.parked or info.handoff), info


@pytest.mark.slow
def test_runs_of_several_keys_queue_deep_on_a_later_key_each_holding_only_its_first(cluster: Cluster) -> None:
    """The multi-tenant shape: runs (x_i, b) with a different first key each, b held. Each takes its own
    x_i (reserved for it) and waits on b, beyond the window spilled; each x_i stays free for nobody else
    only while its run waits. They run once each, in the order they reached b."""
    suffix = tag()
    b = f"b{suffix}"  # (sorts after every "a...": b is each run's second key)
    key_b = f"resource:{b}"
    firsts = [f"a{i}{suffix}" for i in range(8)]
    blocker, tags, results = spilled_behind(cluster, it.merge_queued, b, [(x, b) for x in firsts])
    for x, r in zip(firsts, results, strict=True):  # (each parks on b, then reserves its first key)
        wait_for(
            partial(lambda k, tid: reserved_for(cluster, k) == tid, f"resource:{x}", r.id),
            timeout=60,
            message=f"resource:{x} reserved for its run",
        )
    # A run of one key sent now on a reserved first key waits behind the run it is reserved for.
    single = tag()
    r_single = it.queued.delay(firsts[0], single, 0.05)
    wait_for(
        lambda: parked(cluster, f"resource:{firsts[0]}") == [r_single.id],
        timeout=60,
        message="the run of one key to wait",
    )
    blocker.release()
    for x, r in zip(firsts, results, strict=True):
        assert r.get(timeout=120) == sorted([f"resource:{x}", key_b])
    assert r_single.get(timeout=60) == single
    assert _starts(cluster, tags) == tags
    _no_overlap(cluster, tags)
    [single_start] = cluster.runs(single, "start")
    assert single_start["mono"] >= cluster.runs(tags[0], "end")[0]["mono"]


@pytest.mark.slow
def test_crossing_runs_of_several_keys_all_run_once_and_never_overlap(cluster: Cluster) -> None:
    """A burst over pairs and triples of four keys, sent at once in every order, beside runs of one key:
    whatever the order they reach their keys, none waits for ever (no cycle), none runs twice, and no
    two hold a key at once."""
    a, b, c, d = (f"{n}{tag()}" for n in "abcd")
    sets = [(a, b), (b, a), (c, d), (d, b), (a, c), (c, b), (b, d), (d, a), (a, b), (c, a)]
    tags = [tag() for _ in sets]
    results = [it.merge_queued.delay(x, y, t, 0.05) for (x, y), t in zip(sets, tags, strict=True)]
    singles = [tag() for _ in range(4)]
    r_singles = [it.queued.delay(k, t, 0.05) for k, t in zip((a, b, c, d), singles, strict=True)]
    for (x, y), r in zip(sets, results, strict=True):
        assert r.get(timeout=180) == sorted([f"resource:{x}", f"resource:{y}"])
    assert [r.get(timeout=60) for r in r_singles] == singles
    _no_overlap(cluster, tags)
    for k in (a, b, c, d):
        info = cluster.store.inspect(f"resource:{k}")
        assert info is None or not (info.held or info.parked or info.handoff), info


# -- in the lease store ---------------------------------------------------------------------------------
A, B = "stepwise:a", "stepwise:b"


@pytest.fixture
def deep(make_store: Any) -> LeaseStore:
    return make_store(lease_seconds=30, parked_window=WINDOW)  # type: ignore[no-any-return]


def several(stamp: int, *, group: str | None = None) -> dict[str, Any]:
    e = {**entry(stamp), "ks": [A, B], "tk": f"tk-{stamp}"}
    if group is not None:
        e["g"] = group
    return e


def test_a_queue_run_of_several_keys_is_spilled_and_a_replace_run_of_a_set_is_not(deep: LeaseStore) -> None:
    holder = deep.acquire(A, 60)
    assert holder is not None
    outcomes = [deep.admit(A, several(stamp))[1]["lo"] for stamp in range(1, 5)]
    assert outcomes == ["parked"] * 4
    assert deep.spill.collection.count_documents({"k": A}) == 4 - WINDOW
    outcome = deep.admit(A, several(9, group="ks:set"), replace=True, group="ks:set")[1]["lo"]
    assert outcome == "parked"
    assert deep.spill.collection.count_documents({"k": A}) == 4 - WINDOW  # (in the document)


def test_where_a_run_of_several_keys_is_and_when_its_handoff_is_published(deep: LeaseStore) -> None:
    """``keys_places`` and ``moves_on``: published when every key is reserved for it, or when the first it
    has not got is one it is on nowhere (its message takes it, or parks it there); not while it waits on
    that key (parked, or spilled) holding nothing after it, nor while a worker of it holds a key."""
    run = several(5)
    assert deep.keys_places(run) == [(A, "absent"), (B, "absent")]
    assert _queue.moves_on(deep, run)
    lease_a, _ = deep.admit(A, run)
    assert lease_a is not None
    assert [p for _, p in deep.keys_places(run)] == ["held", "absent"]
    assert not _queue.moves_on(deep, run)  # (its worker is taking its keys)
    expires = deep.collection.find_one({"_id": A}, {"expires_at": 1})["expires_at"]  # type: ignore[index]
    deep.collection.update_one({"_id": A}, [{"$set": {"expires_at": {"$subtract": ["$$NOW", 1000]}}}])
    assert [p for _, p in deep.keys_places(run)] == ["absent", "absent"]  # (its worker died meanwhile)
    deep.collection.update_one({"_id": A}, {"$set": {"expires_at": expires}})
    holder_b = deep.acquire(B, 60)
    assert holder_b is not None
    assert deep.admit(B, run)[1]["lo"] == "parked"
    assert deep.reserve(lease_a, run)
    assert [p for _, p in deep.keys_places(run)] == ["reserved", "parked"]
    assert not _queue.moves_on(deep, run)
    holder_b.release()  # b is handed to it
    assert [p for _, p in deep.keys_places(run)] == ["reserved", "reserved"]
    assert _queue.moves_on(deep, run)
    # Another run (a2, b2), spilled on b2 behind runs of one key: it waits there (the spill says so).
    a2, b2 = A + "2", B + "2"
    other = {**entry(6), "ks": [a2, b2], "tk": "tk-6"}
    holder_b2 = deep.acquire(b2, 60)
    assert holder_b2 is not None
    for stamp in (1, 2, 3):
        assert deep.admit(b2, entry(stamp))[1]["lo"] == "parked"
    lease_a2, _ = deep.admit(a2, other)
    assert lease_a2 is not None
    assert deep.admit(b2, other)[1]["lo"] == "parked"
    assert deep.reserve(lease_a2, other)
    assert deep.spill.waits(b2, str(other["t"]))
    assert [p for _, p in deep.keys_places(other)] == ["reserved", "absent"]
    assert not _queue.moves_on(deep, other)


def test_a_run_read_ready_by_two_parties_at_once_is_published_by_one(deep: LeaseStore) -> None:
    """Its last keys reserved a few milliseconds apart (a release and the run's own attempt, or two
    releases): both parties read every key reserved for it, and only the first to mark it publishes its
    message. A reservation made again after a lapse has a new time: the run is published again. A party
    that leaves it unpublished (this worker lacks its task) takes its mark off: the adopter publishes."""
    run = several(8)
    holder_b = deep.acquire(B, 60)
    assert holder_b is not None
    lease_a, _ = deep.admit(A, run)
    assert lease_a is not None
    assert deep.admit(B, run)[1]["lo"] == "parked"
    assert deep.reserve(lease_a, run)
    holder_b.release()  # b is handed to it
    first = deep.places_of(run)
    assert first.ready and None not in first.handed_ms
    assert [_queue.moves_on(deep, run), _queue.moves_on(deep, run)] == [True, False]
    # b's reservation lapses unclaimed; a sweep hands it to the run again: a new completion.
    deep.collection.update_one({"_id": B}, [{"$set": {"expires_at": {"$subtract": ["$$NOW", 1000]}}}])
    deep.sweep(B)
    again = deep.places_of(run)
    assert again.ready and again.handed_ms[1] != first.handed_ms[1], again
    assert [_queue.moves_on(deep, run), _queue.moves_on(deep, run)] == [True, False]
    deep.unpublish(run)  # (``handoff.leave``)
    assert _queue.moves_on(deep, run)
    marks = (deep.collection.find_one({"_id": A}) or {}).get("hp")
    assert marks and {m["i"] for m in marks} == {run["id"]}


def test_a_run_moved_on_by_two_parties_at_once_is_published_by_one(deep: LeaseStore) -> None:
    """A run with a key reserved for it and the first key it has not got one it is on nowhere (its message
    takes that key): two parties that read it so at once (two of its keys handed a few milliseconds
    apart) publish it once (a measurement with real workers saw 11 such copies in 12 minutes, each kept
    aside and dropped). A reservation made again has a new time: published again. With no key reserved
    when read (its reservation dropped meanwhile), no mark: every such read publishes, as before."""
    run = several(10)
    holder_b = deep.acquire(B, 60)
    assert holder_b is not None
    assert deep.admit(B, run)[1]["lo"] == "parked"
    holder_b.release()  # b is handed to it; a it has not got
    first = deep.places_of(run)
    assert first.places == [(A, "absent"), (B, "reserved")] and first.handed_ms[1] is not None
    assert [_queue.moves_on(deep, run), _queue.moves_on(deep, run)] == [True, False]
    deep.collection.update_one({"_id": B}, [{"$set": {"expires_at": {"$subtract": ["$$NOW", 1000]}}}])
    deep.sweep(B)
    again = deep.places_of(run)
    assert again.places == first.places and again.handed_ms[1] != first.handed_ms[1], again
    assert [_queue.moves_on(deep, run), _queue.moves_on(deep, run)] == [True, False]
    lone = several(11)
    assert [_queue.moves_on(deep, lone), _queue.moves_on(deep, lone)] == [True, True]


def test_a_run_of_slots_read_ready_by_two_parties_at_once_is_published_by_one(make_store: Any) -> None:
    """The same on keys with a limit: the reservations are slots, and their times make the mark."""
    store = make_store(lease_seconds=30)
    run = several(9)
    slot_b, other_b = store.acquire(B, 60, limit=2), store.acquire(B, 60, limit=2)
    assert slot_b is not None and other_b is not None
    lease_a, _ = store.admit(A, run, ttl=30, limit=2)
    assert lease_a is not None and lease_a.slot is not None
    assert store.admit(B, run, ttl=30, limit=2)[1]["lo"] == "parked"
    assert store.reserve(lease_a, run)
    slot_b.release()
    read = store.places_of(run)
    assert read.ready and None not in read.handed_ms, read
    assert [_queue.moves_on(store, run), _queue.moves_on(store, run)] == [True, False]
