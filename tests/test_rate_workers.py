"""``RateLimit`` and ``Throttle`` on real prefork workers, on both brokers: a burst runs whole, never more
than n starts in any window (judged on the start times each body recorded on the server's clock), runs
parked by the rate start in send order, and ``then=Skip()`` drops the rest visibly. With ``keys=`` and
with ``limit=``."""

from __future__ import annotations

import datetime
import functools
import itertools
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from celery_mongolock.core.documents.rate import starts_in_any_window
from celery_mongolock.core.store_rate import rate_windows

from . import integration_app as it
from . import rate_tasks as rt
from .servers import RedisServer, wait_for
from .test_integration import Cluster, running_cluster

pytestmark = pytest.mark.slow

LEASE = 3.0


@pytest.fixture(scope="module")
def cluster(
    broker_url: str, redis_server: RedisServer, mongo_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    with running_cluster("r", broker_url, redis_server.url, mongo_url, tmp_path_factory, concurrency=2) as c:
        yield c


def tag() -> str:
    return uuid.uuid4().hex[:10]


def start_times(cluster: Cluster, tags: list[str]) -> list[float]:
    """Each tag's start (server clock, seconds), in the order of ``tags``; each ran exactly once."""
    found = {d["_id"]: d["at"].timestamp() for d in cluster.db["rate_starts"].find({"_id": {"$in": tags}})}
    assert set(found) == set(tags), f"not run: {set(tags) - set(found)}"
    return [found[t] for t in tags]


def grant_times(cluster: Cluster, tags: list[str], key: str) -> list[float]:
    """The starts the library granted on ``key``'s window (server clock, seconds, in order), as the bodies of
    ``tags`` saw them when they began (``rate_tasks._started``). The rate holds on these: a body's own
    record comes a reply, a signal and a round trip after its grant, later by a varying amount on a busy
    machine (ci: a first body 0.4 s late). A start counts when it is in the window of every key its run
    names: a start taken on one key and given back there (another key's window was full) is no start.
    A grant that left its window before any body read it (a body more than a period late) is not judged."""
    runs_keys = {
        frozenset(g["k"] for g in doc["grants"])
        for doc in cluster.db["rate_starts"].find({"_id": {"$in": tags}})
    }
    seen: dict[str, dict[str, float]] = {}
    # Every body's view counts (a run of another group saw the tenant's window too).
    for doc in cluster.db["rate_starts"].find({"grants.k": {"$in": sorted(set().union(*runs_keys))}}):
        for window in doc["grants"]:
            for start in window["s"]:
                seen.setdefault(window["k"], {})[start["id"]] = _aware(start["t"]).timestamp()
    assert runs_keys and all(key in ks for ks in runs_keys), f"{key} is not a key of every run: {runs_keys}"

    def in_every_window_of_its_run(sid: str) -> bool:
        return any(all(sid in seen.get(k, {}) for k in ks - {key}) for ks in runs_keys)

    real = [t for sid, t in seen.get(key, {}).items() if in_every_window_of_its_run(sid)]
    assert real, f"no start seen on {key}"
    return sorted(real)


def _aware(value: datetime.datetime) -> datetime.datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=datetime.timezone.utc)


def assert_rate(times: list[float], n: int, period: float) -> None:
    # Whole milliseconds, as the server's dates; windows are half-open.
    most = starts_in_any_window([round(t * 1000) for t in times], period * 1000)
    assert most <= n, f"{most} starts in one window of {period} s (at most {n}): {times}"


def assert_window_by_window_send_order(cluster: Cluster, tags: list[str], period: float) -> None:
    """``tags`` in send order: of the runs the rate parked, a later send never takes an earlier one's
    place: an earlier-sent run starts at most one period after a later-sent one (in the same window, the
    order their copies reached a worker). Runs that found the window open at their first delivery start
    in the order they reached their key, and are not judged."""
    docs = {d["_id"]: d for d in cluster.db["rate_starts"].find({"_id": {"$in": tags}})}
    parked = [(i, docs[t]["at"].timestamp()) for i, t in enumerate(tags) if docs[t].get("parked")]
    assert parked, "no run was parked by the rate"
    for (i, at_i), (j, at_j) in itertools.combinations(parked, 2):
        assert at_i <= at_j + period, f"send {j} started {at_i - at_j:.3f} s before send {i}: {parked}"


def fill_then_burst(cluster: Cluster, task: Any, args: tuple[Any, ...], burst: int) -> list[str]:
    """Start n runs (the window is then full), then send ``burst`` more at once: all of those meet a full
    window and are parked by the rate. Returns every tag in send order."""
    first = [tag() for _ in range(rt.N)]
    for t in first:
        assert task.delay(*args, t).get(timeout=120) == t
    rest = [tag() for _ in range(burst)]
    results = [task.delay(*args, t) for t in rest]
    assert [r.get(timeout=240) for r in results] == rest
    return first + rest


def test_a_burst_runs_whole_within_the_rate_in_send_order(cluster: Cluster) -> None:
    name = tag()
    tags = fill_then_burst(cluster, rt.limited, (name,), 6)
    start_times(cluster, tags)
    grants = grant_times(cluster, tags, f"rated:{name}")
    assert_rate(grants, rt.N, rt.PERIOD)
    assert_window_by_window_send_order(cluster, tags, rt.PERIOD)
    # It took the windows it needed: 8 starts at 2 per 2 s span at least 3 periods.
    assert grants[-1] - grants[0] >= 3 * rt.PERIOD - 0.001
    window = rate_windows(cluster.store).look(f"rated:{name}")
    assert window is not None and window.waiters == ()


def test_parked_runs_hold_no_worker_slot(cluster: Cluster) -> None:
    """While runs wait for their turn, the workers are free: a plain task runs at once meanwhile."""
    name = tag()
    first = [tag() for _ in range(rt.N)]
    for t in first:
        rt.limited.delay(name, t).get(timeout=120)
    parked = [rt.limited.delay(name, tag()) for _ in range(6)]
    wait_for(lambda: all(r.state == "QUEUED" for r in parked[-2:]), timeout=60, message="runs parked")
    begun = time.monotonic()
    assert it.plain.delay("free").get(timeout=60) == "free"
    assert time.monotonic() - begun < rt.PERIOD * 2, "a plain task waited for the parked runs"
    for r in parked:
        r.get(timeout=240)


def test_then_skip_drops_runs_over_the_rate_visibly(cluster: Cluster) -> None:
    name = tag()
    tags = [tag() for _ in range(5)]
    results = [rt.skipping.delay(name, t).get(timeout=120) for t in tags]
    ran = [r for r in results if isinstance(r, str)]
    skipped = [r for r in results if isinstance(r, dict)]
    assert ran == tags[: rt.N]
    assert len(skipped) == 3
    for result in skipped:
        assert result["mongolock"] == "skipped"
        assert result["key"] == f"rated:{name}"
        assert result["rate"] == f"RateLimit({rt.N} per {rt.SKIP_PERIOD:g} s)"
        assert "over the rate" in result["reason"]


def test_throttle_one_start_per_period_in_send_order(cluster: Cluster) -> None:
    name = tag()
    first = tag()
    assert rt.throttled.delay(name, first).get(timeout=120) == first
    rest = [tag() for _ in range(3)]
    results = [rt.throttled.delay(name, t) for t in rest]
    assert [r.get(timeout=240) for r in results] == rest
    start_times(cluster, [first, *rest])
    assert_rate(grant_times(cluster, [first, *rest], f"throttled:{name}"), 1, rt.PERIOD)
    assert_window_by_window_send_order(cluster, [first, *rest], rt.PERIOD)


def test_throttle_skip_runs_once_per_period(cluster: Cluster) -> None:
    name = tag()
    results = [rt.throttled_skip.delay(name, tag()).get(timeout=120) for _ in range(3)]
    assert isinstance(results[0], str)
    assert [r["rate"] for r in results[1:]] == [f"Throttle(1 per {rt.SKIP_PERIOD:g} s)"] * 2


def test_several_keys_each_key_has_its_window(cluster: Cluster) -> None:
    """``keys=("tenant:{tenant}", "group:{group}")``: a run starts only when both windows allow it. Two
    groups of one tenant share the tenant's window; each group's own window is never exceeded either."""
    tenant = tag()
    groups = [tag(), tag()]
    sends = [(groups[i % 2], tag()) for i in range(6)]
    results = [rt.pair.delay(tenant, g, t) for g, t in sends]
    assert [r.get(timeout=240) for r in results] == [t for _, t in sends]
    assert_rate(grant_times(cluster, [t for _, t in sends], f"tenant:{tenant}"), rt.N, rt.PERIOD)
    for group in groups:
        in_group = [t for g, t in sends if g == group]
        assert_rate(grant_times(cluster, in_group, f"group:{group}"), rt.N, rt.PERIOD)


def test_limit_bounds_concurrency_and_the_rate_bounds_starts(cluster: Cluster) -> None:
    name = tag()
    tags = fill_then_burst(cluster, rt.slots, (name,), 4)
    start_times(cluster, tags)
    assert_rate(grant_times(cluster, tags, f"slots:{name}"), rt.N, rt.PERIOD)
    assert_window_by_window_send_order(cluster, tags, rt.PERIOD)


# -- Queue() and Replace() with a rate: the key's queue first, then the window ----------------------------


def _held_then_burst(cluster: Cluster, task: Any, name: str, burst: int) -> tuple[str, list[Any]]:
    """A first run holds ``rated:<name>`` behind a gate; ``burst`` runs are sent and wait on the key (parked
    in its queue: the lease document shows them all); then the gate opens. The first's tag, and the
    burst's results in send order."""
    key = f"rated:{name}"
    first = tag()
    r0 = task.delay(name, first, True)
    wait_for(
        lambda: cluster.db["rate_starts"].find_one({"_id": first}) is not None,
        timeout=120,
        message="the first run to hold the key",
    )
    results = [task.delay(name, tag()) for _ in range(burst)]

    def all_parked() -> bool:
        info = cluster.store.inspect(key)
        return info is not None and info.parked_total == burst

    wait_for(all_parked, timeout=120, message=f"{burst} runs parked on {key}")
    cluster.db["gates"].insert_one({"_id": first})
    assert r0.get(timeout=120) == first
    return first, results


def test_queue_with_a_rate_waits_on_the_key_then_in_the_window_and_runs_everything(cluster: Cluster) -> None:
    name = tag()
    first, results = _held_then_burst(cluster, rt.queued, name, 5)
    tags = [first] + [r.get(timeout=240) for r in results]
    start_times(cluster, tags)
    grants = grant_times(cluster, tags, f"rated:{name}")
    assert_rate(grants, rt.N, rt.PERIOD)
    # Handed the key in send order, then parked by the rate (the window was full): still in send order.
    assert_window_by_window_send_order(cluster, tags, rt.PERIOD)
    assert grants[-1] - grants[0] >= 2 * rt.PERIOD - 0.001  # 6 starts at 2 per 2 s
    window = rate_windows(cluster.store).look(f"rated:{name}")
    assert window is not None and window.waiters == ()
    info = cluster.store.inspect(f"rated:{name}")
    assert info is None or not info.parked


def test_replace_with_a_rate_runs_the_newest_within_the_rate(cluster: Cluster) -> None:
    """While the key is held, four sends come one after the other: each supersedes the one parked before
    it. Released, the key goes to the newest, which then takes its start in the window."""
    name = tag()
    key = f"rated:{name}"
    first = tag()
    r0 = rt.latest.delay(name, first, True)
    wait_for(
        lambda: cluster.db["rate_starts"].find_one({"_id": first}) is not None,
        timeout=120,
        message="the first run to hold the key",
    )
    sends = [rt.latest.delay(name, tag()) for _ in range(4)]

    def newest_parked() -> bool:
        info = cluster.store.inspect(key)
        return info is not None and [p["task_id"] for p in info.parked] == [sends[-1].id]

    wait_for(newest_parked, timeout=120, message="the newest send parked alone")
    cluster.db["gates"].insert_one({"_id": first})
    assert r0.get(timeout=120) == first
    got = [r.get(timeout=240) for r in sends]
    assert [g.get("mongolock") if isinstance(g, dict) else "ran" for g in got] == ["superseded"] * 3 + ["ran"]
    start_times(cluster, [first, got[-1]])
    assert_rate(grant_times(cluster, [first, got[-1]], key), rt.N, rt.PERIOD)


def test_several_keys_and_slots_queue_with_a_rate(cluster: Cluster) -> None:
    tenant, groups = tag(), [tag(), tag()]
    sends = [(groups[i % 2], tag()) for i in range(6)]
    results = [rt.pair_queued.delay(tenant, g, t) for g, t in sends]
    assert [r.get(timeout=240) for r in results] == [t for _, t in sends]
    start_times(cluster, [t for _, t in sends])
    assert_rate(grant_times(cluster, [t for _, t in sends], f"tenant:{tenant}"), rt.N, rt.PERIOD)
    for group in groups:
        in_group = [t for g, t in sends if g == group]
        assert_rate(grant_times(cluster, in_group, f"group:{group}"), rt.N, rt.PERIOD)
    name = tag()
    slotted = [tag() for _ in range(6)]
    results = [rt.slots_queued.delay(name, t) for t in slotted]
    assert [r.get(timeout=240) for r in results] == slotted
    start_times(cluster, slotted)
    assert_rate(grant_times(cluster, slotted, f"slots:{name}"), rt.N, rt.PERIOD)


def test_a_revoked_run_parked_by_the_rate_leaves_the_window_at_once(cluster: Cluster) -> None:
    """A run parked by the rate whose copy is discarded by a revoke leaves its key's waiting runs then, not
    when its entry goes stale a period and 15 s later (a new user's trial, stop 55: the runs sent after
    it took their key and gave it back unrun meanwhile, and then started out of send order)."""
    name = tag()
    key = f"rated:{name}"
    for t in [tag() for _ in range(rt.N)]:  # the window is full
        assert rt.limited.delay(name, t).get(timeout=120) == t
    tags = [tag() for _ in range(4)]
    results = [rt.limited.delay(name, t) for t in tags]
    ids = {r.id for r in results}

    def waiting() -> set[str]:
        window = rate_windows(cluster.store).look(key)
        return set() if window is None else {w.run.split("/")[0] for w in window.waiters}

    wait_for(lambda: waiting() == ids, timeout=120, message="the burst parked by the rate")
    revoked = results[1:3]
    for r in revoked:
        it.app.control.revoke(r.id)
    wait_for(lambda: all(r.state == "REVOKED" for r in revoked), timeout=120, message="the revokes")
    # Gone from the window with the revoke (stale only 2 s + 15 s after its turn).
    wait_for(lambda: not waiting() & {r.id for r in revoked}, timeout=8, message="the revoked runs to leave")
    kept = [results[0], results[3]]
    assert [r.get(timeout=120) for r in kept] == [tags[0], tags[3]]
    start_times(cluster, [tags[0], tags[3]])
    assert_window_by_window_send_order(cluster, [tags[0], tags[3]], rt.PERIOD)


def test_a_newer_replace_send_takes_the_turn_of_the_one_it_supersedes(cluster: Cluster) -> None:
    """``Replace()`` with ``Throttle``: sends that come while the window is full, each after the one before
    it was parked by the rate. Each newer send takes the older one's turn at once (it supersedes it when it
    comes back), so the newest starts at the first turn, not one period later per superseded send (a new
    user's trial, stop 55: 3 sends 0.7 s apart under ``Throttle(3)`` started the newest 6.06 s after the
    first, 8 sends 19.75 s after)."""
    name = tag()
    key = f"rated:{name}"
    first = tag()
    assert rt.latest_throttled.delay(name, first).get(timeout=120) == first  # the window is full
    sends: list[Any] = []

    def waiting() -> list[str]:
        window = rate_windows(cluster.store).look(key)
        return [] if window is None else [w.run.split("/")[0] for w in window.waiters]

    def parked(run: str) -> list[str] | None:
        now = waiting()
        return now if run in now else None

    for _ in range(3):
        sends.append(rt.latest_throttled.delay(name, tag()))
        newest = sends[-1].id
        # (each parked by the rate before the next is sent; a period is 6 s: no turn comes meanwhile)
        seen = wait_for(functools.partial(parked, newest), timeout=120, message="the newest send parked")
        assert seen == [newest], f"older sends kept their turns: {seen}"
    got = [r.get(timeout=120) for r in sends]
    assert [g.get("mongolock") if isinstance(g, dict) else "ran" for g in got] == ["superseded"] * 2 + ["ran"]
    grants = grant_times(cluster, [first, got[-1]], key)
    assert len(grants) == 2 and grants[1] - grants[0] < 2 * rt.THROTTLE_PERIOD  # the first turn
