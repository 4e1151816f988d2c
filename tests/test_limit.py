"""``limit=N`` with real ``celery worker`` processes (prefork), a real Redis broker and the MongoDB-compatible
server: never more than N runs of one key at once, slots and fences recorded by each run, a killed
child's slot freed at once by its worker's parent."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery.result import AsyncResult

from . import integration_app as it
from .servers import RedisServer, wait_for
from .test_integration import Cluster, running_cluster
from .test_queue import parked

pytestmark = pytest.mark.slow

LEASE = 3.0


@pytest.fixture(scope="module")
def cluster(
    broker_url: str, redis_server: RedisServer, mongo_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """Worker nodes on each broker in turn (Redis, then RabbitMQ), results in Redis."""
    # 2 nodes x 3 children = 6 slots: more than the limit, so the limit is what holds runs back.
    with running_cluster("l", broker_url, redis_server.url, mongo_url, tmp_path_factory, concurrency=3) as c:
        yield c


def stop(cluster: Cluster, runs: list[AsyncResult], key: str) -> None:
    """End a test's long runs now (their redelivered copies too), so that the next tests find free
    worker slots: revoked with SIGKILL, their slots freed by the workers' parents."""
    it.app.control.revoke([r.id for r in runs], terminate=True, signal="SIGKILL")
    wait_for(
        lambda: not (cluster.store.inspect(key) or pytest.fail("gone")).slots,
        timeout=60,
        message="the long runs to end",
    )


def tag() -> str:
    return uuid.uuid4().hex[:10]


def test_never_more_than_n_runs_of_a_tenant_at_once(cluster: Cluster) -> None:
    tenant = tag()
    tags = [tag() for _ in range(9)]
    results = [it.per_tenant.delay(tenant, t, 0.6) for t in tags]
    assert [r.get(timeout=120) for r in results] == tags
    events = []
    for t in tags:
        start, end = cluster.runs(t, "start"), cluster.runs(t, "end")
        assert len(start) == 1 and len(end) == 1, t
        events += [(start[0]["mono"], 1, start[0]), (end[0]["mono"], -1, end[0])]
    running = peak = 0
    for _, step, _ in sorted(events, key=lambda e: (e[0], e[1])):
        running += step
        peak = max(peak, running)
    assert peak <= 3, f"{peak} runs of one tenant at once, limit 3"
    assert peak >= 2, "runs of one tenant never ran side by side"
    starts = sorted((e[2] for e in events if e[1] == 1), key=lambda r: r["mono"])
    assert {r["slot"] for r in starts} <= {0, 1, 2}
    fences = [r["fence"] for r in sorted(starts, key=lambda r: r["fence"])]
    assert len(set(fences)) == len(fences), "every hold of the key has a fence of its own"
    # Another tenant is not held back by this one.
    assert it.per_tenant.delay(tag(), tag(), 0.05).get(timeout=60)


def test_a_killed_child_frees_its_slot_at_once(cluster: Cluster) -> None:
    tenant = tag()
    holders = [tag() for _ in range(3)]
    long_runs = [it.per_tenant.delay(tenant, t, 30.0) for t in holders]
    wait_for(lambda: all(cluster.runs(t, "start") for t in holders), timeout=60, message="3 holders")
    key = f"tenant:{tenant}"
    info = cluster.store.inspect(key)
    assert info is not None and info.full and len(info.slots) == 3
    victim = cluster.runs(holders[0], "start")[0]
    os.kill(victim["pid"], signal.SIGKILL)
    # The worker's parent releases the dead child's slot at once (well before the 3 s lease would end
    # if nobody renewed it... the other holders keep theirs).
    wait_for(
        lambda: len((cluster.store.inspect(key) or pytest.fail("gone")).slots) == 2,
        timeout=30,
        message="the dead child's slot to be freed",
    )
    doc = cluster.store.collection.find_one({"_id": key}) or {}
    assert any(e["how"] == "holder-died" and e.get("slot") == victim["slot"] for e in doc.get("ends") or [])
    # The freed slot is taken again: by a new run, or by the dead child's run, redelivered (acks_late).
    # Whichever wins, the other waits for a 30 s holder: wait for either, not for the late run's result.
    late = tag()
    it.per_tenant.delay(tenant, late, 0.05)
    wait_for(
        lambda: cluster.runs(late, "end") or len(cluster.runs(holders[0], "start")) == 2,
        timeout=60,
        message="the freed slot to be taken again",
    )
    stop(cluster, long_runs, key)


def peak_of(cluster: Cluster, tags: list[str]) -> int:
    """The most runs of ``tags`` whose bodies overlapped in time."""
    events = []
    for t in tags:
        for start in cluster.runs(t, "start"):
            events.append((start["mono"], 1))
        for end in cluster.runs(t, "end"):
            events.append((end["mono"], -1))
    running = peak = 0
    for _, step in sorted(events):
        running += step
        peak = max(peak, running)
    return peak


def test_queue_with_a_limit_parks_runs_until_any_slot_frees_in_send_order(cluster: Cluster) -> None:
    tenant = tag()
    key = f"tenant:{tenant}"
    # The 3 slots are held by this test (not by runs of a fixed length: on a loaded machine those could
    # end before the 6 runs below are delivered), until all 6 are parked.
    gate = [cluster.store.acquire(key, 60, limit=3) for _ in range(3)]
    assert all(lease is not None for lease in gate)
    waiting = [tag() for _ in range(6)]
    results: list[Any] = []
    for t in waiting:  # (each once the one before is parked: beyond the window of 2, park order is theirs)
        results.append(it.per_tenant_queued.delay(tenant, t, 0.3))
        wait_for(lambda: len(parked(cluster, key)) == len(results), timeout=120, message=f"{t} parked")
    # Parked runs hold no worker slot: another tenant's run goes through while all six wait.
    other = tag()
    assert it.per_tenant_queued.delay(tag(), other, 0.05).get(timeout=60) == other
    order = parked(cluster, key)  # the order they are handed the slots in (in the document, send order)
    for lease in gate:
        assert lease is not None and lease.release()
    assert [r.get(timeout=120) for r in results] == waiting
    assert peak_of(cluster, waiting) <= 3
    # Each freed slot went to the oldest parked run: the handoffs' fences follow the send order.
    by_id = {r.id: t for r, t in zip(results, waiting, strict=True)}
    fences = [cluster.runs(by_id[i], "start")[0]["fence"] for i in order]
    assert fences == sorted(fences) and len(set(fences)) == len(fences)
    assert max(lease.fence for lease in gate if lease is not None) < fences[0]
    info = cluster.store.inspect(key)
    assert info is None or not (info.held or info.parked or info.handoff)


def test_a_killed_child_s_slot_goes_to_the_oldest_parked_run(cluster: Cluster) -> None:
    tenant = tag()
    key = f"tenant:{tenant}"
    holders = [tag() for _ in range(3)]
    long_runs = [it.per_tenant_queued.delay(tenant, t, 30.0) for t in holders]
    wait_for(lambda: all(cluster.runs(t, "start") for t in holders), timeout=60, message="3 holders")
    late = tag()
    result = it.per_tenant_queued.delay(tenant, late, 0.05)
    wait_for(lambda: parked(cluster, key) == [result.id], timeout=60, message="the run to park")
    victim = cluster.runs(holders[0], "start")[0]
    os.kill(victim["pid"], signal.SIGKILL)
    assert result.get(timeout=60) == late
    assert cluster.runs(late, "start")[0]["slot"] == victim["slot"]
    doc = cluster.store.collection.find_one({"_id": key}) or {}
    assert any(e["how"] == "holder-died" and e.get("slot") == victim["slot"] for e in doc.get("ends") or [])
    stop(cluster, long_runs, key)


def test_replace_with_a_limit_runs_only_the_newest_of_the_runs_that_waited(cluster: Cluster) -> None:
    tenant = tag()
    key = f"tenant:{tenant}"
    holders = [tag() for _ in range(2)]
    held = []
    for t in holders:  # one after the other: a send older than one already running would be superseded
        held.append(it.per_tenant_latest.delay(tenant, t, 5.0))

        def started(t: str = t) -> bool:
            return bool(cluster.runs(t, "start"))

        wait_for(started, timeout=60, message="a holder to start")
    burst = [tag() for _ in range(4)]
    results = []
    for t in burst:
        result = it.per_tenant_latest.delay(tenant, t, 0.1)
        results.append(result)

        def landed(r: AsyncResult = result) -> bool:
            return r.id in parked(cluster, key) or r.ready()

        wait_for(landed, timeout=60, message="the run to park")
    assert [r.get(timeout=90) for r in held] == holders
    outcomes = [r.get(timeout=90) for r in results]
    assert outcomes[-1] == burst[-1]
    for i, outcome in enumerate(outcomes[:-1]):
        assert outcome == {"mongolock": "superseded", "key": key, "by": results[i + 1].id}
        assert not cluster.runs(burst[i], "start")


def overlap_peak(spans: list[tuple[float, float]]) -> int:
    """The most of these (start, end) spans that overlapped at one moment."""
    running = peak = 0
    for _, step in sorted(
        [(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda e: (e[0], e[1])
    ):
        running += step
        peak = max(peak, running)
    return peak


def test_per_key_limits_with_several_keys(cluster: Cluster) -> None:
    """``keys=("tenant:{tenant}", "group:{group}"), limit={"tenant:{tenant}": 3}``: at most 3 uploads of
    one tenant at once (slots of ``tenant:T``), at most one of one group (a single lease each)."""
    tenant = tag()
    groups = [tag() for _ in range(4)]
    # Three uploads to the first group, one to each of the others: 6 uploads of one tenant.
    sends = [(groups[0], tag()) for _ in range(3)] + [(g, tag()) for g in groups[1:]]
    results = [it.tenant_upload.delay(tenant, g, t, 0.6) for g, t in sends]
    for result in results:
        result.get(timeout=180)
    spans: dict[str, list[tuple[float, float]]] = {}
    for group, t in sends:
        start, end = cluster.runs(t, "start"), cluster.runs(t, "end")
        assert len(start) == 1 and len(end) == 1, t
        assert start[0]["keys"] == sorted([f"tenant:{tenant}", f"group:{group}"])
        (slots,) = cluster.runs(t, "slots")
        assert slots["slots"][f"group:{group}"] is None, "a key without a limit entry is a single lease"
        assert slots["slots"][f"tenant:{tenant}"] in (0, 1, 2)
        spans.setdefault(group, []).append((start[0]["mono"], end[0]["mono"]))
    everything = [span for group_spans in spans.values() for span in group_spans]
    assert overlap_peak(everything) <= 3, "more than 3 uploads of one tenant at once, limit 3"
    for group, group_spans in spans.items():
        assert overlap_peak(group_spans) == 1, f"uploads of group {group} overlapped"
    info = cluster.store.inspect(f"tenant:{tenant}")
    assert info is not None and not info.slots, "every slot of the tenant is free again"
