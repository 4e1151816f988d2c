"""Runs that end without their body finish for Celery's canvas like any run, with real ``celery worker``
processes (prefork) on each broker: a parked ``Replace`` run that a newer send supersedes, and a parked
``Queue(timeout=...)`` run past its deadline, call their ``link`` / ``link_error`` callbacks, let their chain
go on and complete their chord (``integration.endings``). Without that, the chain stayed ``PENDING`` and
the chord's body was never called."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import chain, chord
from celery.result import AsyncResult

from celery_mongolock import QueueTimeout, Superseded, is_superseded
from celery_mongolock.core.documents.sets import gate_of

from . import integration_app as it
from .servers import RedisServer, wait_for
from .test_integration import Cluster, running_cluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(
    broker_url: str, redis_server: RedisServer, mongo_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """Worker nodes on each broker in turn (Redis, then RabbitMQ), results in Redis."""
    with running_cluster("cv", broker_url, redis_server.url, mongo_url, tmp_path_factory) as c:
        yield c


def tag() -> str:
    return uuid.uuid4().hex[:10]


def parked_ids(cluster: Cluster, key: str) -> list[str]:
    doc = cluster.store.collection.find_one({"_id": key}) or {}
    return [str(e["t"]) for e in doc.get("q") or []]


def noted(cluster: Cluster, label: str) -> list[dict[str, Any]]:
    return cluster.runs(label, "noted")


def hold_the_key(cluster: Cluster, task: Any, resource: str, seconds: float) -> AsyncResult:
    holder = tag()
    result = task.delay(resource, holder, seconds)
    wait_for(lambda: cluster.runs(holder, "start"), timeout=60, message="the holder to start")
    return result


def test_a_superseded_run_s_chain_goes_on_with_the_superseded_result(cluster: Cluster) -> None:
    resource, a, b, label = tag(), tag(), tag(), tag()
    key = f"resource:{resource}"
    r0 = hold_the_key(cluster, it.latest, resource, 2.0)
    workflow = chain(it.latest.si(resource, a, 0.1), it.noted.s(label)).apply_async()
    first = workflow.parent
    assert first is not None
    wait_for(
        lambda: first.id in parked_ids(cluster, key), timeout=60, message="the chain's first run to park"
    )
    newer = it.latest.delay(resource, b, 0.1)
    # The chain's next task ran, with the superseded result as its argument.
    outcome = workflow.get(timeout=90)
    assert outcome["tag"] == label
    assert outcome["value"]["mongolock"] == "superseded" and outcome["value"]["by"] == newer.id
    assert is_superseded(first) and is_superseded(outcome["value"])
    assert [n["superseded"] for n in noted(cluster, label)] == [True]
    assert newer.get(timeout=60) == b and r0.get(timeout=60)
    assert not cluster.runs(a, "start")  # its body never ran


def test_a_superseded_chord_member_completes_the_chord(cluster: Cluster) -> None:
    resource, a, b, label = tag(), tag(), tag(), tag()
    key = f"resource:{resource}"
    r0 = hold_the_key(cluster, it.latest, resource, 2.0)
    member = it.latest.si(resource, a, 0.1).set(task_id=str(uuid.uuid4()))
    workflow = chord([member, it.plain.si(label)], it.noted.s(label)).apply_async()
    wait_for(lambda: member.id in parked_ids(cluster, key), timeout=60, message="the chord member to park")
    newer = it.latest.delay(resource, b, 0.1)
    outcome = workflow.get(timeout=90)
    values = outcome["value"]
    assert len(values) == 2 and label in values
    (superseded,) = [v for v in values if v != label]
    assert superseded["mongolock"] == "superseded" and superseded["by"] == newer.id
    assert len(noted(cluster, label)) == 1  # the chord's body ran once
    assert newer.get(timeout=60) == b and r0.get(timeout=60)


def test_fail_superseded_calls_link_error(cluster: Cluster) -> None:
    resource, a, b, label, success = tag(), tag(), tag(), tag(), tag()
    key = f"resource:{resource}"
    r0 = hold_the_key(cluster, it.latest_failing, resource, 2.0)
    parked = it.latest_failing.apply_async(
        (resource, a, 0.1), link=it.noted.s(success), link_error=it.noted.s(label)
    )
    wait_for(lambda: parked.id in parked_ids(cluster, key), timeout=60, message="the run to park")
    newer = it.latest_failing.delay(resource, b, 0.1)
    with pytest.raises(Superseded) as raised:
        parked.get(timeout=90)
    assert is_superseded(parked)
    # In the result backend, as raised: a run superseded before it started, not "the run holding" the key.
    assert "before it started: its body never ran" in str(raised.value), raised.value
    assert newer.id in str(raised.value) and "holding" not in str(raised.value)
    # The errback got the failed task's id; the success callback never ran.
    wait_for(lambda: noted(cluster, label), timeout=60, message="the errback to run")
    assert [n["value"] for n in noted(cluster, label)] == [parked.id]
    assert newer.get(timeout=60) == b and r0.get(timeout=60)
    assert not noted(cluster, success)


def test_fail_superseded_without_callbacks_says_the_run_never_started(cluster: Cluster) -> None:
    """A parked run superseded by a newer send, with no callback (its failure written by the newer send's
    worker or the sweeper, not from its own message): the failure says it never started."""
    resource, a, b = tag(), tag(), tag()
    key = f"resource:{resource}"
    r0 = hold_the_key(cluster, it.latest_failing, resource, 2.0)
    parked = it.latest_failing.delay(resource, a, 0.1)
    wait_for(lambda: parked.id in parked_ids(cluster, key), timeout=60, message="the run to park")
    newer = it.latest_failing.delay(resource, b, 0.1)
    with pytest.raises(Superseded) as raised:
        parked.get(timeout=90)
    assert "before it started: its body never ran" in str(raised.value), raised.value
    assert newer.get(timeout=60) == b and r0.get(timeout=60)


def test_a_run_parked_past_its_timeout_calls_link_error(cluster: Cluster) -> None:
    resource, late, label = tag(), tag(), tag()
    r0 = hold_the_key(cluster, it.queued_briefly, resource, 3.0)
    parked = it.queued_briefly.apply_async((resource, late, 0.1), link_error=it.noted.s(label))
    with pytest.raises(QueueTimeout):
        parked.get(timeout=60)
    wait_for(lambda: noted(cluster, label), timeout=60, message="the errback to run")
    assert [n["value"] for n in noted(cluster, label)] == [parked.id]
    assert r0.get(timeout=60) and not cluster.runs(late, "start")
    assert not is_superseded(parked)


def test_a_superseded_run_without_callbacks_gets_its_result_written_directly(cluster: Cluster) -> None:
    # No callback, chain or chord: nothing is published again (the result is written as before).
    resource, a, b = tag(), tag(), tag()
    key = f"resource:{resource}"
    r0 = hold_the_key(cluster, it.latest, resource, 2.0)
    parked = it.latest.delay(resource, a, 0.1)
    wait_for(lambda: parked.id in parked_ids(cluster, key), timeout=60, message="the run to park")
    newer = it.latest.delay(resource, b, 0.1)
    assert parked.get(timeout=60)["by"] == newer.id and is_superseded(parked)
    assert newer.get(timeout=60) == b and r0.get(timeout=60)


def test_a_superseded_several_keys_run_calls_its_callback_once(cluster: Cluster) -> None:
    # Parked on its set's gate (where a run of a set waits while an older one runs), superseded there:
    # ended once.
    a, b, holder, old, new, label = tag(), tag(), tag(), tag(), tag(), tag()
    keys = sorted([f"resource:{a}", f"resource:{b}"])
    r0 = it.merge_latest.delay(a, b, holder, 2.0)
    wait_for(lambda: cluster.runs(holder, "start"), timeout=60, message="the first merge to start")
    parked = it.merge_latest.apply_async((b, a, old, 0.1), link=it.noted.s(label))
    wait_for(
        lambda: parked.id in parked_ids(cluster, gate_of(keys)), timeout=60, message="parked on the gate"
    )
    newer = it.merge_latest.delay(a, b, new, 0.1)
    value = parked.get(timeout=90)
    assert value["mongolock"] == "superseded" and value["by"] == newer.id and value["keys"] == keys
    wait_for(lambda: noted(cluster, label), timeout=60, message="the callback to run")
    assert newer.get(timeout=90) == keys and r0.get(timeout=90) == keys
    [call] = noted(cluster, label)  # once, not once per key
    assert call["superseded"] and call["value"]["keys"] == keys
    assert not cluster.runs(old, "start")


def test_a_several_keys_run_parked_past_its_timeout_calls_link_error_and_frees_its_other_key(
    cluster: Cluster,
) -> None:
    """A run of two keys parked on one (held) and holding a reservation on the other times out: its
    ``link_error`` is called (before: its timed-out record lacked its keys, so its stored message was
    refused and only its result written; the errback never ran and a chain stayed ``PENDING``), and its
    reservation on the other key goes at once, as a revoked run's does (before: that key idled until the
    reservation lapsed, a lease later; both found by a new user). Its worker's lease is 120 s, longer than
    the waits below."""
    a, b, late, label = tag(), tag(), tag(), tag()
    cluster.worker(
        name=f"mt{tag()}@localhost", env=cluster.env(MONGOLOCK_IT_LEASE=120), extra_args=["-Q", "mtq"]
    )
    held = cluster.store.acquire(f"resource:{a}", ttl=120)
    assert held is not None
    try:
        parked = it.merge_queued_briefly.apply_async(
            (a, b, late, 0.1), queue="mtq", link_error=it.noted.s(label)
        )
        with pytest.raises(QueueTimeout):
            parked.get(timeout=90)
        wait_for(lambda: noted(cluster, label), timeout=60, message="the errback to run")
        assert [n["value"] for n in noted(cluster, label)] == [parked.id]

        def other_key_free() -> bool:
            doc = cluster.store.collection.find_one({"_id": f"resource:{b}"}) or {}
            return (doc.get("ho") or {}).get("t") != parked.id and parked.id not in parked_ids(
                cluster, f"resource:{b}"
            )

        wait_for(other_key_free, timeout=90, message="the timed-out run's reservation to go")
        assert not cluster.runs(late, "start")
    finally:
        held.release()
