"""``unique_send`` on real prefork workers, on both brokers: many equal sends from several producer
processes at once run one body and every producer's ``AsyncResult`` gets its result; once the run's body
has started an equal send is a new send; a send whose message is lost turns equal sends away only until
its bound; a revoked pending run does not turn them away at all."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

from celery_mongolock.core.store_sends import sends_of

from . import integration_app as it
from . import test_integration
from .servers import wait_for
from .test_integration import Cluster
from .workers import ROOT

pytestmark = pytest.mark.slow

#: The integration suite's fixture: two worker nodes (concurrency 2) on each broker in turn.
cluster = test_integration.cluster


def tag() -> str:
    return uuid.uuid4().hex[:10]


def producers(cluster: Cluster, n: int, sends: int, resource: str, t: str) -> list[list[str]]:
    """``n`` producer processes, each sending ``sends`` equal sends once all are connected."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.unique_send_producer", str(sends), resource, t],
            env=cluster.env(),
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        out = []
        for p in procs:
            stdout, _ = p.communicate(timeout=120)
            assert p.returncode == 0
            out.append(json.loads(stdout.strip().splitlines()[-1]))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_equal_sends_from_several_producers_at_once_run_one_body(cluster: Cluster) -> None:
    resource, t, holder = tag(), tag(), tag()
    # A run holds the key meanwhile, so that the equal sends stay pending (contention retries) whatever
    # the machine's speed; its body ends when its lease is force-released.
    it.guarded.delay(resource, holder, 120)
    wait_for(lambda: cluster.runs(holder, "start"), timeout=60, message="the holder to start")
    sent = producers(cluster, 4, 10, resource, t)
    ids = {task_id for got in sent for task_id in got}
    assert len(ids) == 1, f"every equal send got the one pending run: {ids}"
    [run] = ids
    assert cluster.runs(t, "start") == []
    assert cluster.store.force_release(f"resource:{resource}")
    for got in sent:  # every producer's AsyncResult gets the run's result
        assert it.app.AsyncResult(got[0]).get(timeout=120) == t
    assert len(cluster.runs(t, "start")) == 1, "one body ran"
    assert sends_of(cluster.store).pending(f"resource:{resource}") == []
    assert it.unique.delay(resource, t, 0.3).id != run  # after its start: a new send


def test_once_the_body_started_an_equal_send_is_a_new_send(cluster: Cluster) -> None:
    resource, t = tag(), tag()
    first = it.unique.delay(resource, t, 2.0)
    wait_for(lambda: cluster.runs(t, "start"), timeout=60, message="the first run to start")
    second = it.unique.delay(resource, t, 2.0)
    assert second.id != first.id
    assert it.unique.delay(resource, t, 2.0).id == second.id  # and that one is pending now
    assert first.get(timeout=60) == t and second.get(timeout=120) == t
    assert len(cluster.runs(t, "start")) == 2


def test_a_lost_message_turns_equal_sends_away_only_until_its_bound(cluster: Cluster) -> None:
    resource, t = tag(), tag()
    policies = dict(it.app.conf.mongolock_task_policies)
    it.app.conf.mongolock_task_policies = {
        **policies,
        "integration_app.unique": {"unique_send": True, "unique_send_seconds": 2},
    }
    it.app.__dict__.pop("_mongolock_settings", None)
    try:
        # A queue no worker reads: for the producers, a message that was lost.
        lost = it.unique.apply_async((resource, t, 0.1), queue=f"nowhere-{t}")
        [pending] = sends_of(cluster.store).pending(f"resource:{resource}")
        assert pending.task_id == lost.id and pending.until is not None and pending.sent_at is not None
        assert 1.9 <= (pending.until - pending.sent_at).total_seconds() <= 2.1
        assert it.unique.delay(resource, t, 0.1).id == lost.id
        # Past the bound (the server's clock), an equal send is published and runs.
        again = wait_for(
            lambda: (r := it.unique.delay(resource, t, 0.1)).id != lost.id and r,
            timeout=30,
            message="an equal send to be accepted past the bound",
        )
        assert again.get(timeout=60) == t
    finally:
        it.app.conf.mongolock_task_policies = policies
        it.app.__dict__.pop("_mongolock_settings", None)


def test_a_revoked_pending_run_does_not_turn_equal_sends_away(cluster: Cluster) -> None:
    resource, t = tag(), tag()
    pending = it.unique.apply_async((resource, t, 0.1), countdown=10)
    assert it.unique.delay(resource, t, 0.1).id == pending.id  # the countdown is in the window
    pending.revoke()
    wait_for(
        lambda: not sends_of(cluster.store).pending(f"resource:{resource}"),
        timeout=60,
        message="the revoked run's record to be forgotten",
    )
    fresh = it.unique.delay(resource, t, 0.1)
    assert fresh.id != pending.id and fresh.get(timeout=60) == t


def test_a_parked_run_is_pending_until_its_body_starts(cluster: Cluster) -> None:
    resource, t, holder = tag(), tag(), tag()
    it.guarded.delay(resource, holder, 15)
    wait_for(lambda: cluster.runs(holder, "start"), timeout=60, message="the holder to start")
    parked = it.unique_queued.delay(resource, t, 0.5)
    wait_for(lambda: parked.state == "QUEUED", timeout=60, message="the run to park")
    assert it.unique_queued.delay(resource, t, 0.5).id == parked.id  # parked: not started
    wait_for(lambda: cluster.runs(t, "start"), timeout=120, message="the parked run to start")
    again = it.unique_queued.delay(resource, t, 0.5)
    assert again.id != parked.id
    assert parked.get(timeout=60) == t and again.get(timeout=60) == t
    assert len(cluster.runs(t, "start")) == 2
