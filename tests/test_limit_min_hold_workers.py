"""``limit=N`` with ``min_hold_seconds`` on real prefork workers (both brokers): at most N starts of a
key in any window of the minimum hold, with ``Retry``, with ``Queue`` (parked runs handed the slots as
the holds end, in send order, with nothing released at that moment) and with several keys and a limit
per key. Judged on the server's clock: each run records when its leases were taken."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

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
    # 2 nodes x 2 children: more worker slots than the limit.
    with running_cluster("w", broker_url, redis_server.url, mongo_url, tmp_path_factory, concurrency=2) as c:
        yield c


def tag() -> str:
    return uuid.uuid4().hex[:10]


def taken_at(cluster: Cluster, tags: list[str], key: str) -> list[float]:
    """When each run of ``tags`` took ``key`` (server clock, seconds), in order; each ran once."""
    out = []
    for t in tags:
        (held,) = cluster.runs(t, "held")
        out.append(held["acquired"][key.replace(".", "_")].timestamp())
    return sorted(out)


def assert_at_most_n_per_window(times: list[float], n: int) -> None:
    """At most ``n`` of ``times`` in any window of ``it.WINDOW`` seconds (a hold stays taken that long)."""
    for i in range(len(times) - n):
        gap = times[i + n] - times[i]
        assert gap >= it.WINDOW - 0.002, f"{n + 1} starts within {gap:.3f} s (window {it.WINDOW} s): {times}"


def test_retry_at_most_n_starts_of_a_key_per_window(cluster: Cluster) -> None:
    tenant = tag()
    tags = [tag() for _ in range(5)]
    results = [it.per_tenant_window.delay(tenant, t) for t in tags]
    assert [r.get(timeout=180) for r in results] == tags
    times = taken_at(cluster, tags, f"tenant:{tenant}")
    assert_at_most_n_per_window(times, 2)
    assert times[1] - times[0] < it.WINDOW, "two slots: the first two runs started side by side"


def test_queue_parked_runs_are_handed_slots_as_the_holds_end_in_send_order(cluster: Cluster) -> None:
    tenant = tag()
    key = f"tenant:{tenant}"
    # This test holds both slots while the runs park (so that every run parks, whatever the broker's
    # delivery order), then releases them: the first two parked runs are handed them at once; the
    # next two only when those runs' minimum holds end, with nothing released then (the sweeper).
    held = [cluster.store.acquire(key, 60, limit=2) for _ in range(2)]
    assert all(lease is not None for lease in held)
    tags = [tag() for _ in range(4)]
    results: list[Any] = []
    for t in tags:  # (each once the one before is parked: beyond the window of 2, park order is theirs)
        results.append(it.per_tenant_window_queued.delay(tenant, t))
        wait_for(lambda: len(parked(cluster, key)) == len(results), timeout=60, message=f"{t} parked")
    order = parked(cluster, key)  # the order they are handed the slots in (in the document, send order)
    for lease in held:
        assert lease is not None and lease.release()
    by_id = {r.id: t for r, t in zip(results, tags, strict=True)}
    assert [r.get(timeout=180) for r in results] == tags
    times = [cluster.runs(by_id[i], "held")[0]["acquired"][key].timestamp() for i in order]
    assert times == sorted(times), "parked runs took their slots out of send order"
    assert_at_most_n_per_window(times, 2)
    assert times[2] - times[0] >= it.WINDOW - 0.002
    info = cluster.store.inspect(key)
    assert info is None or not (info.parked or info.handoff)


def test_several_keys_with_a_limit_per_key_hold_every_key_for_the_window(cluster: Cluster) -> None:
    tenant = tag()
    groups = [tag() for _ in range(2)]
    sends = [(groups[i % 2], tag()) for i in range(5)]
    results = [it.tenant_upload_window.delay(tenant, g, t) for g, t in sends]
    assert [r.get(timeout=180) for r in results] == [t for _, t in sends]
    assert_at_most_n_per_window(taken_at(cluster, [t for _, t in sends], f"tenant:{tenant}"), 2)
    for group in groups:
        mine = [t for g, t in sends if g == group]
        assert_at_most_n_per_window(taken_at(cluster, mine, f"group:{group}"), 1)


def test_queue_with_a_limit_per_key_on_several_keys_parks_reserves_and_runs_in_send_order(
    cluster: Cluster,
) -> None:
    """``keys=("tenant:{tenant}", "group:{group}"), limit={"tenant:{tenant}": 2}, Queue()``: a run takes
    its keys one at a time in key order (``group:`` first): it waits on a held group key holding nothing,
    or reserves its group key and waits on the full tenant key. Each runs once it has both: at most 2 of
    the tenant at once, one of a group at once, the runs of a group in send order, and the tenant's slots
    in the order the runs reached the tenant."""
    tenant, groups = tag(), [tag() for _ in range(3)]
    tkey = f"tenant:{tenant}"
    gate = [cluster.store.acquire(tkey, 60, limit=2) for _ in range(2)]
    gate.append(cluster.store.acquire(f"group:{groups[0]}", 60))
    assert all(lease is not None for lease in gate)
    sends = [(groups[0], tag()), (groups[1], tag()), (groups[0], tag()), (groups[2], tag())]
    results: list[Any] = []

    def waiting(key: str, n: int) -> bool:
        return len(parked(cluster, key)) == n

    # Each sent once the one before waits where it must: the send order is known.
    where = [(f"group:{groups[0]}", 1), (tkey, 1), (f"group:{groups[0]}", 2), (tkey, 2)]
    for (group, t), (key, n) in zip(sends, where, strict=True):
        results.append(it.tenant_upload_queued.delay(tenant, group, t))
        wait_for(partial(waiting, key, n), timeout=60, message=f"{t} to wait on {key}")

    def reserved(group: str) -> list[str]:
        doc = cluster.store.collection.find_one({"_id": f"group:{group}"}) or {}
        return [str((doc.get("ho") or {}).get("t"))]

    wait_for(  # (a run parks on the tenant, then turns the group key it took into a reservation)
        lambda: reserved(groups[1]) == [results[1].id] and reserved(groups[2]) == [results[3].id],
        timeout=60,
        message="the free group keys reserved for their runs",
    )
    assert parked(cluster, f"group:{groups[0]}") == [results[0].id, results[2].id]
    assert parked(cluster, tkey) == [results[1].id, results[3].id]  # (the runs of group 0 are not there)
    for lease in gate:  # (the tenant's slots first: handed to the runs waiting there)
        assert lease is not None and lease.release()
    assert [r.get(timeout=180) for r in results] == [t for _, t in sends]
    spans = {}
    for group, t in sends:
        (start,), (end,) = cluster.runs(t, "held"), cluster.runs(t, "held-end")
        spans[t] = (start["mono"], end["mono"], group, start)
    events = sorted([(s, 1) for s, _, _, _ in spans.values()] + [(e, -1) for _, e, _, _ in spans.values()])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    assert peak <= 2, f"{peak} runs of one tenant at once, limit 2"
    g0 = [spans[t] for g, t in sends if g == groups[0]]
    assert g0[0][1] <= g0[1][0], "two runs of one group overlapped"
    order = [t for _, t in sorted(sends, key=lambda s: spans[s[1]][3]["acquired"][tkey].timestamp())]
    tags = [t for _, t in sends]
    assert set(order[:2]) == {tags[1], tags[3]}, "the runs waiting on the tenant did not get its slots first"
    assert order[2:] == [tags[0], tags[2]], "the runs of group 0 did not reach the tenant in send order"
    for key in [tkey] + [f"group:{g}" for g in groups]:
        info = cluster.store.inspect(key)
        assert info is None or not (info.held or info.parked or info.handoff), key
