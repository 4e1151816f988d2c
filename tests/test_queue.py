"""Queue and Replace with real ``celery worker`` processes (prefork), a real Redis broker and the
MongoDB-compatible server: runs of one key start in the order they were sent, parked runs hold no worker
slot, each run keeps its task id (``AsyncResult.get()`` returns its result), copies never run twice, and
the key is handed over after a child or a whole node dies."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
from celery import chain
from celery.result import AsyncResult

from celery_mongolock import QueueTimeout
from celery_mongolock.integration.handoff import HANDOFF_HEADER, SENT_HEADER

from . import integration_app as it
from .servers import RedisServer, wait_for
from .test_integration import Cluster, running_cluster

pytestmark = pytest.mark.slow

LEASE = 3.0


@pytest.fixture(scope="module")
def cluster(
    broker_url: str, redis_server: RedisServer, mongo_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """Worker nodes on each broker in turn (Redis, then RabbitMQ), results in Redis."""
    with running_cluster("q", broker_url, redis_server.url, mongo_url, tmp_path_factory) as c:
        yield c


def tag() -> str:
    return uuid.uuid4().hex[:10]


def starts(cluster: Cluster, tags: list[str]) -> list[str]:
    """The tags in the order their runs started."""
    runs = [r for r in cluster.runs(kind="start") if r["tag"] in tags]
    return [r["tag"] for r in sorted(runs, key=lambda r: r["t"])]


def parked(cluster: Cluster, key: str) -> list[str]:
    """The runs parked on ``key``, next first: those in its lease document, then those spilled beyond its
    window (the workers keep 2 there: ``integration_app``), in their lane's order."""
    doc = cluster.store.collection.find_one({"_id": key}) or {}
    spilled = cluster.store.spill.collection.find({"k": key, "x": {"$ne": True}}, {"e.t": 1})
    return [e["t"] for e in doc.get("q") or []] + [
        d["e"]["t"] for d in sorted(spilled, key=lambda d: d["_id"])
    ]


def _parked_as(cluster: Cluster, key: str, task_ids: list[str]) -> bool:
    return parked(cluster, key) == task_ids


def test_runs_start_in_the_order_they_were_sent_and_return_their_own_results(cluster: Cluster) -> None:
    resource = tag()
    first = tag()
    # (the first run holds the key while the others are sent, one by one, and parked behind it)
    r0 = it.queued.delay(resource, first, 8.0)
    wait_for(lambda: cluster.runs(first, "start"), timeout=60, message="the first run to start")
    tags = [tag() for _ in range(5)]
    results = []
    # Each sent once the one before is parked: the workers keep 2 parked runs in the key's lease document
    # and spill the rest, which go in the order they parked (docs/reference/policies.md, depth); sent
    # this way, that is send order, whichever worker receives each first.
    for t in tags:
        results.append(it.queued.delay(resource, t, 0.2))
        sent = [r.id for r in results]
        wait_for(
            partial(_parked_as, cluster, f"resource:{resource}", sent), timeout=60, message=f"{t} parked"
        )
    # Parked runs say so, with their key and position.
    state = AsyncResult(results[0].id, app=it.app)
    assert state.state == "QUEUED"
    assert state.info["key"] == f"resource:{resource}" and state.info["since"]
    assert r0.get(timeout=90) == first
    assert [r.get(timeout=90) for r in results] == tags
    assert starts(cluster, [first, *tags]) == [first, *tags]
    fences = [cluster.runs(t, "start")[0]["fence"] for t in [first, *tags]]
    assert fences == sorted(fences) and len(set(fences)) == len(fences)


def test_parked_runs_hold_no_worker_slot(cluster: Cluster) -> None:
    # 2 nodes x 2 children = 4 slots. One run holds the key; 6 more of its key are parked; runs of other
    # keys still get slots while the holder runs.
    resource = tag()
    holder = tag()
    r0 = it.queued.delay(resource, holder, 4.0)
    wait_for(lambda: cluster.runs(holder, "start"), timeout=60, message="the holder to start")
    waiting = [it.queued.delay(resource, tag(), 0.05) for _ in range(6)]
    wait_for(lambda: len(parked(cluster, f"resource:{resource}")) == 6, timeout=60, message="6 parked")
    others = [tag() for _ in range(3)]
    results = [it.queued.delay(tag(), t, 0.05) for t in others]
    for r in results:
        r.get(timeout=60)
    assert not cluster.runs(holder, "end"), "other keys' runs had to wait for the holder: slots were held"
    r0.get(timeout=60)
    for r in waiting:
        r.get(timeout=60)


def test_a_stale_handoff_copy_of_an_attempt_whose_body_retried_never_runs_again(cluster: Cluster) -> None:
    """The lock-set checker's seed 23, with real workers: attempt 0 of a several-keys run is handed both
    keys and its body runs; its leases are lost meanwhile (a MongoDB pause cut it; here an operator's
    release), so it is not remembered as over, and the body retries. Attempt 1 parks. A stale copy of
    attempt 0's handoff message (redelivered by the broker, or a handoff re-published meanwhile) then
    fails its claim while the task has no final result (attempt 1 wrote QUEUED): it was admitted as a new
    run, parked beside attempt 1 and ahead of it (same send stamp), and ran attempt 0's body again. It is
    dropped now: the body runs once per attempt."""
    t = tag()
    src, dst = f"a{t}", f"b{t}"  # (x sorts first: a run of several keys takes x, then waits on y)
    x, y = f"resource:{src}", f"resource:{dst}"
    store = cluster.store
    task_id = str(uuid.uuid4())

    def doc(key: str) -> dict[str, Any]:
        return store.collection.find_one({"_id": key}) or {}

    def reserved_for(key: str, attempt: int) -> dict[str, Any]:
        """The key's pending handoff (here: a reservation) when it is for ``attempt``, else {}."""
        ho = doc(key).get("ho") or {}
        return ho if ho.get("id") == f"{task_id}/{attempt}" else {}

    def attempts() -> list[int]:
        runs = cluster.db["runs"].find({"kind": "start", "tag": t}).sort("mono", 1)
        return [r["retries"] for r in runs]

    def deliveries() -> int:
        return cluster.db["runs"].count_documents({"kind": "postrun", "task_id": task_id})

    blocker = store.acquire(y, 60)
    assert blocker is not None
    result = it.merge_retried.apply_async((src, dst, t), task_id=task_id)
    handed = wait_for(lambda: reserved_for(x, 0), timeout=60, message="x reserved for attempt 0")
    # The handoff message the library publishes for it, as a stale copy will carry it.
    copy = {
        HANDOFF_HEADER: {"k": x, "tk": handed["tk"], "id": handed["id"], "ks": handed["ks"]},
        SENT_HEADER: handed["s"],
    }
    blocker.release()  # y handed to attempt 0: it claims both keys, and its body runs
    wait_for(lambda: attempts() == [0], timeout=60, message="attempt 0's body to start")
    assert store.force_release(x) and store.force_release(y)  # its leases lost: the body is cut
    blocker = store.acquire(y, 60)
    assert blocker is not None
    cluster.db["runs"].insert_one({"kind": "go", "tag": t})  # the cut body retries
    wait_for(
        lambda: (
            reserved_for(x, 1)
            and parked(cluster, y) == [task_id]
            and deliveries() == 3
            and AsyncResult(task_id, app=it.app).state == "QUEUED"
        ),
        timeout=60,
        message="attempt 1 to wait (x reserved for it, parked on y), its state QUEUED",
    )
    it.merge_retried.apply_async((src, dst, t), task_id=task_id, headers=copy)  # the stale copy
    wait_for(lambda: deliveries() == 4, timeout=60, message="the stale copy to be delivered")
    blocker.release()
    assert result.get(timeout=60) == 1

    def settled(key: str) -> bool:
        d = doc(key)
        return not d.get("wq") and d.get("owner") is None

    wait_for(lambda: settled(x) and settled(y), timeout=60, message="nothing left waiting on the keys")
    assert attempts() == [0, 1]


def test_a_copy_of_a_parked_message_never_runs_twice(cluster: Cluster) -> None:
    resource = tag()
    holder, dup = tag(), tag()
    r0 = it.queued.delay(resource, holder, 1.5)
    wait_for(lambda: cluster.runs(holder, "start"), timeout=60, message="the holder to start")
    task_id = str(uuid.uuid4())
    it.queued.apply_async((resource, dup, 0.1), task_id=task_id)
    wait_for(lambda: parked(cluster, f"resource:{resource}") == [task_id], timeout=60, message="parked")
    # The same message again (a broker redelivery): same task id, same headers.
    it.queued.apply_async((resource, dup, 0.1), task_id=task_id)
    r0.get(timeout=60)
    assert AsyncResult(task_id, app=it.app).get(timeout=60) == dup
    # Any copy still in flight is dropped; the body ran once.
    wait_for(
        lambda: not cluster.store.collection.find_one({"_id": f"resource:{resource}", "wq": True}),
        timeout=60,
        message="nothing left waiting on the key",
    )
    assert len(cluster.runs(dup, "start")) == 1


def test_a_retry_task_on_a_queued_key_does_not_barge_in(cluster: Cluster) -> None:
    resource = tag()
    holder = tag()
    # (long enough for the three runs below to park one after another before it ends, as the runs of
    # the order test do: on a busy machine each park may take a second or more)
    r0 = it.queued.delay(resource, holder, 8.0)
    wait_for(lambda: cluster.runs(holder, "start"), timeout=60, message="the holder to start")
    queued = [tag() for _ in range(3)]
    rq = []
    for t in queued:  # (each once the one before is parked: beyond the window of 2, park order is theirs)
        rq.append(it.queued.delay(resource, t, 0.3))
        sent = [r.id for r in rq]
        wait_for(
            partial(_parked_as, cluster, f"resource:{resource}", sent), timeout=60, message=f"{t} parked"
        )
    barger = tag()
    rb = it.guarded.delay(resource, barger, 0.1)
    r0.get(timeout=60)
    for r in rq:
        r.get(timeout=60)
    rb.get(timeout=90)
    order = starts(cluster, [holder, *queued, barger])
    assert order == [holder, *queued, barger]


def test_replace_runs_only_the_newest_send(cluster: Cluster) -> None:
    resource = tag()
    holder = tag()
    r0 = it.latest.delay(resource, holder, 1.5)
    wait_for(lambda: cluster.runs(holder, "start"), timeout=60, message="the holder to start")
    tags = [tag() for _ in range(4)]
    results = [it.latest.delay(resource, t, 0.1) for t in tags]
    r0.get(timeout=60)
    assert results[-1].get(timeout=60) == tags[-1]
    for i, r in enumerate(results[:-1]):
        value = r.get(timeout=60)
        # Superseded by the send that replaced it: always a newer one.
        later = [x.id for x in results[i + 1 :]]
        assert value["mongolock"] == "superseded" and value["key"] == f"resource:{resource}"
        assert value["by"] in later
    assert [t for t in tags if cluster.runs(t, "start")] == [tags[-1]]


def test_a_debounced_burst_runs_once_after_its_last_send(cluster: Cluster) -> None:
    resource = tag()
    tags = [tag() for _ in range(5)]
    results = []
    for t in tags:
        results.append(it.debounced.delay(resource, t))
        wait_for(
            lambda: cluster.store.collection.find_one({"_id": f"resource:{resource}", "q.t": results[-1].id}),
            timeout=60,
            message="the send to be parked",
        )
    last_parked = time.time()
    assert results[-1].get(timeout=60) == tags[-1]
    for r in results[:-1]:
        assert r.get(timeout=60)["mongolock"] == "superseded"
    runs = [r for t in tags for r in cluster.runs(t, "start")]
    assert [r["tag"] for r in runs] == [tags[-1]]
    # It waited for the debounce after the last send reached a worker (server and test share a clock).
    assert runs[0]["t"] >= last_parked + 0.9


def test_a_run_parked_past_its_timeout_fails_with_queue_timeout(cluster: Cluster) -> None:
    resource = tag()
    holder, late = tag(), tag()
    r0 = it.queued_briefly.delay(resource, holder, 3.0)
    wait_for(lambda: cluster.runs(holder, "start"), timeout=60, message="the holder to start")
    r1 = it.queued_briefly.delay(resource, late, 0.1)
    with pytest.raises(QueueTimeout, match="past its policy's timeout="):
        r1.get(timeout=60)
    r0.get(timeout=60)
    assert not cluster.runs(late, "start")


def test_chains_and_a_body_s_own_retry_go_through_the_queue(cluster: Cluster) -> None:
    resource = tag()
    holder, a, b, c = tag(), tag(), tag(), tag()
    r0 = it.queued.delay(resource, holder, 1.5)
    wait_for(lambda: cluster.runs(holder, "start"), timeout=60, message="the holder to start")
    # A chain whose every step is a queued run of the same key, parked behind the holder.
    workflow = chain(
        it.queued.si(resource, a, 0.1), it.queued.si(resource, b, 0.1), it.queued_retry.si(resource, c, 0.1)
    ).apply_async()
    r0.get(timeout=60)
    assert workflow.get(timeout=90) == c
    assert starts(cluster, [holder, a, b, c]) == [holder, a, b, c]
    assert len(cluster.runs(c, "own-retry")) == 1 and len(cluster.runs(c, "start")) == 1


def test_a_revoked_parked_run_is_dropped_and_the_next_one_runs(cluster: Cluster) -> None:
    resource = tag()
    holder, revoked, nxt = tag(), tag(), tag()
    # (the holder runs until its gate opens, after the sweeper's drop: a 2 s body ended first on a busy
    # machine, ci75, and the key went to the revoked run, which gave it on, before the test looked)
    r0 = it.gated.delay(resource, holder)
    wait_for(lambda: cluster.runs(holder, "start"), timeout=60, message="the holder to start")
    r1 = it.queued.delay(resource, revoked, 0.1)
    r2 = it.queued.delay(resource, nxt, 0.1)
    key = f"resource:{resource}"
    wait_for(lambda: parked(cluster, key) == [r1.id, r2.id], timeout=60, message="both parked")
    it.app.control.revoke(r1.id)
    wait_for(
        lambda: parked(cluster, key) == [r2.id], timeout=60, message="the sweeper to drop the revoked run"
    )
    wait_for(lambda: r1.state == "REVOKED", timeout=60, message="the revoked run's state")
    cluster.db["gates"].insert_one({"_id": holder})
    r0.get(timeout=60)
    assert r2.get(timeout=60) == nxt
    assert not cluster.runs(revoked, "start")


def test_a_killed_child_hands_the_key_to_the_next_parked_run(cluster: Cluster) -> None:
    resource = tag()
    holder, nxt = tag(), tag()
    it.queued.delay(resource, holder, 30.0)
    wait_for(lambda: cluster.runs(holder, "start"), timeout=60, message="the holder to start")
    r1 = it.queued.delay(resource, nxt, 0.1)
    wait_for(lambda: parked(cluster, f"resource:{resource}") == [r1.id], timeout=60, message="parked")
    os.kill(cluster.runs(holder, "start")[0]["pid"], signal.SIGKILL)
    assert r1.get(timeout=60) == nxt


def test_a_dead_node_s_key_goes_to_the_parked_run_after_expiry(cluster: Cluster) -> None:
    resource = tag()
    holder, nxt = tag(), tag()
    # 20 s: long past the kill below. On RabbitMQ the dead node's message comes back at once and, sent
    # first, runs again before the parked run (send order), so the parked run waits out that body too.
    it.queued.delay(resource, holder, 20.0)
    wait_for(lambda: cluster.runs(holder, "start"), timeout=60, message="the holder to start")
    holder_pid = cluster.runs(holder, "start")[0]["pid"]
    r1 = it.queued.delay(resource, nxt, 0.1)
    wait_for(lambda: parked(cluster, f"resource:{resource}") == [r1.id], timeout=60, message="parked")
    # Kill the whole node that runs the holder (its parent too: nobody releases the lease); the other
    # node's sweeper hands the key over once the lease has expired.
    node = next(w for w in cluster.workers if holder_pid in w.child_pids())
    sent = time.monotonic()
    node.kill()
    try:
        assert r1.get(timeout=120) == nxt
        print(f"parked run done {time.monotonic() - sent:.1f}s after its holder's node died (lease {LEASE}s)")
    finally:
        node.stop()  # already dead: closes its log
        cluster.workers.remove(node)
        cluster.worker(name=f"q3-{tag()}@localhost")


def test_runs_that_end_while_parked_are_in_the_history_and_why(cluster: Cluster) -> None:
    """Superseded and timed-out runs never hold the key; the workers that end them record them in the
    history (written by their heartbeat threads, off the tasks' path)."""
    resource = tag()
    key = f"resource:{resource}"
    holder = tag()
    # The holder runs until its gate opens, after the newer sends are all in: a fixed length (1.5 s, ci16)
    # could end before they reached a worker on a loaded machine, and the superseded runs differ then.
    r0 = it.latest.delay(resource, holder, gate=True)
    wait_for(lambda: cluster.runs(holder, "start"), timeout=60, message="the holder to start")
    results = [it.latest.delay(resource, tag(), 0.1) for _ in range(3)]
    superseded = {r.id for r in results[:-1]}

    def runs_ended(how: str) -> dict[str, Any]:
        return {str(e.task_id): e for e in cluster.store.history(key, limit=50) if e.how == how}

    wait_for(lambda: set(runs_ended("superseded")) == superseded, timeout=60, message="superseded records")
    cluster.db["gates"].insert_one({"_id": holder})
    r0.get(timeout=60)
    for r in results:
        r.get(timeout=60)
    for r in results[:-1]:
        ending = runs_ended("superseded")[r.id]
        assert ending.parked and ending.task_name == "integration_app.latest"
        assert ending.by in [x.id for x in results] and ending.by != r.id
        # (how long it was parked: unknown for a run superseded on arrival, sent before a run it met)
        assert ending.waited_ms is None or ending.waited_ms >= 0
    # The runs that held the key are there too, after the superseded ones they outlived.
    held = [e.task_id for e in cluster.store.history(key, limit=50) if e.how == "released"]
    assert held == [results[-1].id, r0.id]
    story = cluster.store.why(key)
    assert story is not None and {e.task_id for e in story.endings if e.how == "superseded"} == superseded

    # A run parked past its Queue(timeout=...).
    resource = tag()
    key = f"resource:{resource}"
    slow, late = tag(), tag()
    r1 = it.queued_briefly.delay(resource, slow, 3.0)
    wait_for(lambda: cluster.runs(slow, "start"), timeout=60, message="the holder to start")
    r2 = it.queued_briefly.delay(resource, late, 0.1)
    with pytest.raises(QueueTimeout):
        r2.get(timeout=60)
    r1.get(timeout=60)
    wait_for(lambda: runs_ended("timeout"), timeout=60, message="the timeout record")
    [timed_out] = runs_ended("timeout").values()
    assert timed_out.task_id == r2.id and timed_out.parked
    assert timed_out.waited_ms is not None and timed_out.waited_ms >= 900  # parked for its 1 s timeout


def test_a_run_revoked_while_parked_is_in_the_history(cluster: Cluster) -> None:
    resource = tag()
    key = f"resource:{resource}"
    holder, revoked = tag(), tag()
    r0 = it.queued.delay(resource, holder, 2.0)
    wait_for(lambda: cluster.runs(holder, "start"), timeout=60, message="the holder to start")
    r1 = it.queued.delay(resource, revoked, 0.1)
    wait_for(lambda: parked(cluster, key) == [r1.id], timeout=60, message="parked")
    it.app.control.revoke(r1.id)
    r0.get(timeout=60)

    def revoked_runs() -> list[Any]:
        return [e for e in cluster.store.history(key, limit=50) if e.how == "revoked"]

    wait_for(revoked_runs, timeout=60, message="the revoked run's record")
    [ending] = revoked_runs()
    # (dropped by the sweeper while parked, or its handoff message discarded by the worker's revoke)
    assert ending.task_id == r1.id and ending.parked
    assert not cluster.runs(revoked, "start")
