"""``Replace(debounce=...)`` with ``keys=``, with real ``celery worker`` processes (prefork) on each broker:
a burst of sends of one set of keys runs once, with the newest send's arguments, the others end
superseded; a run of another set that shares a key is no competitor and runs too. And
``Replace(debounce=d, max_wait=m)``, on one key and on a set of keys: a key (a set) that keeps receiving
sends still runs (by ``m``, while sends come more often than ``d``), again and again."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from . import integration_app as it
from .servers import RedisServer, wait_for
from .test_integration import Cluster, running_cluster
from .test_replace_keys import no_overlap, settled, started, superseded_in_history, tag

pytestmark = pytest.mark.slow

LEASE = 3.0


@pytest.fixture(scope="module")
def cluster(
    broker_url: str, redis_server: RedisServer, mongo_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """Two worker nodes on each broker in turn (Redis, then RabbitMQ), results in Redis."""
    with running_cluster(
        "rkd", broker_url, redis_server.url, mongo_url, tmp_path_factory, concurrency=2
    ) as c:
        yield c


def test_a_burst_of_one_key_set_runs_once_with_the_newest_arguments(cluster: Cluster) -> None:
    a, b = tag(), tag()
    keys = sorted([f"resource:{a}", f"resource:{b}"])
    tags = [tag() for _ in range(5)]
    # Both argument orders: one set of keys.
    results = [it.merge_debounced.delay(*((a, b) if i % 2 else (b, a)), t, 0.1) for i, t in enumerate(tags)]
    assert results[-1].get(timeout=90) == keys
    for i, r in enumerate(results[:-1]):
        value = r.get(timeout=90)
        assert value["mongolock"] == "superseded", value
        assert value["key"] == keys[0] and value["keys"] == keys
        assert value["by"] in [x.id for x in results[i + 1 :]], "superseded only by a newer send"
        assert r.state == "SUCCESS"
    assert started(cluster, tags) == [tags[-1]]  # exactly one body: the newest send's
    ids = {r.id for r in results[:-1]}
    wait_for(
        lambda: set(superseded_in_history(cluster, keys)) >= ids,
        timeout=60,
        message="a history record of every superseded run",
    )
    settled(cluster, keys)


def test_a_run_of_an_overlapping_set_is_no_competitor(cluster: Cluster) -> None:
    a, b, c = tag(), tag(), tag()
    old, other, new = tag(), tag(), tag()
    r_old = it.merge_debounced.delay(a, b, old, 0.1)
    r_other = it.merge_debounced.delay(b, c, other, 0.1)  # the set {b, c}: shares b
    r_new = it.merge_debounced.delay(b, a, new, 0.1)
    assert r_new.get(timeout=90) == sorted([f"resource:{a}", f"resource:{b}"])
    assert r_other.get(timeout=90) == sorted([f"resource:{b}", f"resource:{c}"])
    value = r_old.get(timeout=90)
    assert value["mongolock"] == "superseded" and value["by"] == r_new.id
    assert sorted(started(cluster, [old, other, new])) == sorted([other, new])
    no_overlap(cluster, [other, new])
    settled(cluster, [f"resource:{k}" for k in (a, b, c)])


def _keep_sending(
    send: Callable[[str], Any], cluster: Cluster, runs: int = 1, limit: float = 60.0
) -> tuple[list[str], list[Any]]:
    """Send every 0.25 s until bodies of ``runs`` of the sends have started (pacing the sends, not waiting
    for anything): with ``debounce=1`` and no ``max_wait``, none would start while the sends go on (unless
    the machine stalled them for a second: then this passes without ``max_wait`` too, never fails). At
    most ``limit`` seconds: a key that never runs while the sends go on fails the test."""
    tags: list[str] = []
    results: list[Any] = []
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        t = tag()
        tags.append(t)
        results.append(send(t))
        if len(started(cluster, tags)) >= runs:
            break
        time.sleep(0.25)
    return tags, results


def test_a_key_that_keeps_receiving_sends_still_runs_by_max_wait(cluster: Cluster) -> None:
    a = tag()
    keys = [f"resource:{a}"]
    tags, results = _keep_sending(lambda t: it.debounced_capped.delay(a, t, 0.1), cluster)
    ran_while_sending = started(cluster, tags)
    assert ran_while_sending, "no run started while the sends went on: max_wait did not cap the debounce"
    # The newest send at the end runs too; every other send ran or was superseded by a newer one.
    for i, r in enumerate(results):
        value = r.get(timeout=90)
        if isinstance(value, dict):
            assert value["mongolock"] == "superseded", value
            assert value["by"] in [x.id for x in results[i + 1 :]], "superseded only by a newer send"
    assert results[-1].get(timeout=90) == tags[-1]
    ran = started(cluster, tags)
    assert ran == sorted(ran, key=tags.index), "runs start in send order"
    no_overlap(cluster, ran)
    settled(cluster, keys)


def _runs_again_and_again(cluster: Cluster, send: Callable[[str], Any], keys: list[str]) -> None:
    """Send every 0.25 s until three bodies started (three ceilings): every send runs or ends superseded
    by a newer one, the newest at the end runs, runs start in send order and never overlap."""
    tags, results = _keep_sending(send, cluster, runs=3, limit=120.0)
    ran_while_sending = started(cluster, tags)
    assert len(ran_while_sending) >= 3, (
        f"{len(ran_while_sending)} run(s) started in {len(tags)} sends every 0.25 s: max_wait did not cap "
        "the set's debounce"
    )
    for i, r in enumerate(results):
        value = r.get(timeout=90)
        if isinstance(value, dict):
            assert value["mongolock"] == "superseded", value
            assert value["by"] in [x.id for x in results[i + 1 :]], "superseded only by a newer send"
        else:
            assert value == keys
    ran = started(cluster, tags)
    assert tags[-1] in ran, "the newest send at the end runs"
    assert ran == sorted(ran, key=tags.index), "runs start in send order"
    no_overlap(cluster, ran)
    settled(cluster, keys)


def test_a_set_of_keys_that_keeps_receiving_sends_still_runs_by_max_wait(cluster: Cluster) -> None:
    """The set's runs start again and again while the sends go on (three ceilings, in both argument
    orders); before the burst was sealed by its ceiling, the keys could go round from run to run of the
    set for as long as the sends came (see CHANGELOG.md: 2 of 16 bursts had no run in 60 s)."""
    a, b = tag(), tag()
    order = iter(range(10_000))

    def send(t: str) -> Any:
        return it.merge_capped.delay(*((a, b) if next(order) % 2 else (b, a)), t, 0.1)

    _runs_again_and_again(cluster, send, sorted([f"resource:{a}", f"resource:{b}"]))


@pytest.mark.parametrize("task", ["tenant_upload_capped", "tenant_upload_all_limited"])
def test_a_set_with_limits_still_runs_by_max_wait(cluster: Cluster, task: str) -> None:
    """The same with ``limit={"acct:{tenant}": 2}`` on the key that sorts first (its burst is learned and
    sealed on the single-lease key), and with a limit of 2 on every key of the set (its runs get each key
    one at a time, in send order, as a single lease)."""
    tenant, group = tag(), tag()
    upload = getattr(it, task)
    _runs_again_and_again(
        cluster,
        lambda t: upload.delay(tenant, group, t, 0.1),
        sorted([f"acct:{tenant}", f"group:{group}"]),
    )


def test_a_burst_of_a_set_whose_keys_all_have_limits_runs_once(cluster: Cluster) -> None:
    """A set whose keys all have slots waits its debounce as a set of single leases does: of a burst of
    sends, only the newest runs, though both keys have free slots (before, the first send was handed
    its slots at once, and the burst ran more than once). A debounce of 3 s: the five sends, sent at once,
    reach the workers within it."""
    tenant, group = tag(), tag()
    keys = sorted([f"acct:{tenant}", f"group:{group}"])
    tags = [tag() for _ in range(5)]
    results = [it.tenant_upload_debounced.delay(tenant, group, t, 0.1) for t in tags]
    assert results[-1].get(timeout=90) == keys
    for i, r in enumerate(results[:-1]):
        value = r.get(timeout=90)
        assert value["mongolock"] == "superseded", value
        assert value["by"] in [x.id for x in results[i + 1 :]], "superseded only by a newer send"
    assert started(cluster, tags) == [tags[-1]]  # exactly one body: the newest send's
    settled(cluster, keys)


def test_a_set_whose_body_retries_runs_its_retry(cluster: Cluster) -> None:
    """A debounced run of a set of keys whose body retries (Celery's own ``self.retry()``): the retry
    parks on the set's gate for its debounce and is handed the gate, not its later key, which it then
    takes as any run. Before, it took the ``RETRY`` its first attempt stored for its own result, was
    dropped as a stale handoff, and the task stayed ``RETRY`` for good (the lock-set checker on RabbitMQ,
    seed 1)."""
    a, b, t = tag(), tag(), tag()
    result = it.merge_debounced_retry.delay(a, b, t)
    assert result.get(timeout=90) == sorted([f"resource:{a}", f"resource:{b}"])
    assert len(cluster.runs(t, "own-retry")) == 1 and started(cluster, [t]) == [t]
    settled(cluster, [f"resource:{a}", f"resource:{b}"])
