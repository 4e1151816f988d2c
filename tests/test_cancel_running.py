"""``Replace(cancel_running=True, grace=...)`` with real ``celery worker`` processes (prefork) on each broker
(Redis, then RabbitMQ) and the MongoDB-compatible server: a newer send tells the running holder at once; a
cooperative body ends superseded and the newest run then holds the key; a body that ignores it is
terminated after its grace and the newest run starts; the old holder's fenced writes are refused from
its notice on; every superseded run is in the key's history with the run that superseded it.

The grace comes from ``mongolock_task_policies`` (``MONGOLOCK_IT_CANCEL_GRACE``): settable in settings."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from . import integration_app as it
from .servers import RedisServer, wait_for
from .test_integration import Cluster
from .workers import Worker, pointed_at

pytestmark = pytest.mark.slow

LEASE = 3.0
GRACE = 1.5
#: How long the old holder's body would run if nobody stopped it (the tests never wait for it).
LONG = 120.0


@pytest.fixture(scope="module")
def cluster(
    broker_url: str, redis_server: RedisServer, mongo_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    db_name = f"mongolock_cx_{uuid.uuid4().hex[:8]}"
    c = Cluster(
        broker_url, mongo_url, db_name, tmp_path_factory.mktemp("cxworkers"), backend=redis_server.url
    )
    with pointed_at(
        it.app,
        broker_url,
        redis_server.url,
        mongolock_url=mongo_url,
        mongolock_database=db_name,
        mongolock_lease_seconds=LEASE,
    ):
        env = c.env(MONGOLOCK_IT_CANCEL_GRACE=GRACE)
        c.worker(name=f"cx1{uuid.uuid4().hex[:4]}@localhost", env=env)
        c.worker(name=f"cx2{uuid.uuid4().hex[:4]}@localhost", env=env)
        try:
            yield c
        finally:
            c.close()


def tag() -> str:
    return uuid.uuid4().hex[:10]


def one(cluster: Cluster, kind: str, tag_: str) -> dict[str, Any]:
    [found] = cluster.runs(tag_, kind)
    return found


def reached_at(cluster: Cluster, task_id: str) -> float:
    """When the newer run reached a worker (``task_prerun`` there, before its admission)."""
    doc = cluster.db["runs"].find_one({"kind": "reached", "task_id": task_id}) or {}
    return float(doc["t"])


def superseded_in_history(cluster: Cluster, key: str, task_id: str, by: str) -> None:
    def found() -> bool:
        return any(
            e.how == "superseded" and e.task_id == task_id and e.by == by and not e.parked
            for e in cluster.store.history(key, limit=50)
        )

    wait_for(found, timeout=60, message=f"the superseded record of {task_id} in the history")
    story = cluster.store.why(key)
    assert story is not None
    assert any(e.how == "superseded" and e.task_id == task_id and e.by == by for e in story.endings)


def test_a_cooperative_body_ends_superseded_at_once_and_the_newest_run_holds_the_key(
    cluster: Cluster,
) -> None:
    resource = tag()
    key = f"resource:{resource}"
    old, new = tag(), tag()
    r0 = it.cancel_polite.delay(resource, old, LONG)
    wait_for(lambda: cluster.runs(old, "start"), timeout=60, message="the holder to start")
    r1 = it.cancel_polite.delay(resource, new, 0.3)

    assert r0.get(timeout=60) == {"mongolock": "superseded", "key": key, "by": r1.id}
    assert r0.state == "SUCCESS"
    assert r1.get(timeout=60) == new
    noticed = one(cluster, "noticed", old)
    assert noticed["by"] == r1.id
    delay = noticed["t"] - reached_at(cluster, r1.id)
    print(f"\nthe holder noticed {delay * 1000:.0f} ms after the newer run reached a worker")
    # (The figure, well under a second, is the benchmark's; here only a bound a loaded machine keeps: the
    # shared 2-core machine at load average 60 measured 0.2 to 0.9 s.)
    assert delay < 5.0, f"the holder noticed {delay:.2f}s after the newer run reached a worker"
    assert not cluster.runs(old, "end")  # it stopped: never ran to its end
    # The newest run then started, holding the key with a larger fence.
    start = one(cluster, "start", new)
    assert start["t"] >= noticed["t"] and start["key"] == key
    assert start["fence"] > one(cluster, "start", old)["fence"]
    superseded_in_history(cluster, key, r0.id, r1.id)


def test_a_body_that_ignores_it_is_terminated_after_grace_and_the_newest_run_starts(cluster: Cluster) -> None:
    resource = tag()
    key = f"resource:{resource}"
    old, new = tag(), tag()
    r0 = it.cancel_deaf.delay(resource, old, LONG)
    wait_for(lambda: cluster.runs(old, "start"), timeout=60, message="the holder to start")
    child = one(cluster, "start", old)["pid"]
    sent = time.time()
    r1 = it.cancel_deaf.delay(resource, new, 0.2)

    assert r1.get(timeout=60) == new
    started = one(cluster, "start", new)["t"] - sent
    told = one(cluster, "told", old)
    print(f"\nnewest run started {started:.2f}s after its send (grace {GRACE}s)")
    # Told at once, then terminated after its grace: never ran to its end, its pool child gone.
    assert told["by"] == r1.id and told["t"] - sent < GRACE
    assert started >= GRACE * 0.9  # (not before the grace: it was ended by it)
    assert started < GRACE + 10.0  # the figure, grace + 1 s, is the benchmark's (benchmarks/)
    assert not cluster.runs(old, "end")
    wait_for(lambda: not _alive(child), timeout=60, message="the old holder's child to be gone")
    # Its run ends SUCCESS with the superseded result (written before the child went), not a failure,
    # and its message is not run again.
    assert r0.get(timeout=60) == {"mongolock": "superseded", "key": key, "by": r1.id}
    assert r0.state == "SUCCESS"
    superseded_in_history(cluster, key, r0.id, r1.id)
    assert len(cluster.runs(old, "start")) == 1


def test_the_old_holders_fenced_writes_are_refused_from_its_notice_on(cluster: Cluster) -> None:
    resource = tag()
    report = int(uuid.uuid4().int % 1_000_000_000)
    old, new = tag(), tag()
    r0 = it.cancel_polite.delay(resource, old, LONG, report)
    wait_for(
        lambda: (cluster.db["reports"].find_one({"_id": report}) or {}).get("by") == old,
        timeout=60,
        message="the holder to write its report",
    )
    r1 = it.cancel_polite.delay(resource, new, 0.3, report)
    assert r0.get(timeout=60)["mongolock"] == "superseded"
    assert r1.get(timeout=60) == new
    refused = cluster.runs(old, "refused")
    assert refused and all(r["by"] == r1.id for r in refused)
    noticed = one(cluster, "noticed", old)
    # Every write it tried once told was refused, and the report is the newest run's.
    assert [r for r in refused if r["t"] <= noticed["t"]], "no write after the notice was refused"
    doc = cluster.db["reports"].find_one({"_id": report}) or {}
    assert doc["by"] == new and doc["fence"] == one(cluster, "start", new)["fence"]
    assert not cluster.runs(new, "refused")


# -- keys=: a newer send of the same set supersedes the run holding the set ------------------------------


def test_a_newer_send_of_the_set_tells_the_running_holder_and_its_writes_are_refused(
    cluster: Cluster,
) -> None:
    resource, group = tag(), tag()
    keys = sorted([f"resource:{resource}", f"group:{group}"])  # (a set's result names its keys in order)
    report = int(uuid.uuid4().int % 1_000_000_000)
    old, other, new = tag(), tag(), tag()
    r0 = it.cancel_polite_keys.delay(resource, group, old, LONG, report)
    wait_for(
        lambda: (cluster.db["reports"].find_one({"_id": report}) or {}).get("by") == old,
        timeout=60,
        message="the holder to write its report",
    )
    # A run of another set sharing the resource key parks behind it and tells it nothing.
    r_other = it.cancel_polite_keys.delay(resource, tag(), other, 0.2)
    r1 = it.cancel_polite_keys.delay(resource, group, new, 0.3, report)
    assert r0.get(timeout=60) == {"mongolock": "superseded", "key": keys[0], "keys": keys, "by": r1.id}
    assert r0.state == "SUCCESS"
    assert r1.get(timeout=60) == new
    assert r_other.get(timeout=60) == other
    noticed = one(cluster, "noticed", old)
    assert noticed["by"] == r1.id
    assert not cluster.runs(old, "end")
    # Its writes with the group key's lease were refused from the notice on, though the newer send
    # reached the resource key first; the report is the newest run's.
    refused = cluster.runs(old, "refused")
    assert refused and all(r["by"] == r1.id for r in refused)
    doc = cluster.db["reports"].find_one({"_id": report}) or {}
    assert doc["by"] == new
    start = one(cluster, "start", new)
    assert start["t"] >= noticed["t"]
    for key in keys:
        superseded_in_history(cluster, key, r0.id, r1.id)


def test_a_set_holder_that_ignores_it_is_terminated_after_grace_and_the_newest_run_starts(
    cluster: Cluster,
) -> None:
    resource, group = tag(), tag()
    keys = sorted([f"resource:{resource}", f"group:{group}"])  # (a set's result names its keys in order)
    old, new = tag(), tag()
    r0 = it.cancel_deaf_keys.delay(resource, group, old, LONG)
    wait_for(lambda: cluster.runs(old, "start"), timeout=60, message="the holder to start")
    child = one(cluster, "start", old)["pid"]
    sent = time.time()
    r1 = it.cancel_deaf_keys.delay(resource, group, new, 0.2)

    assert r1.get(timeout=60) == new
    started = one(cluster, "start", new)["t"] - sent
    told = one(cluster, "told", old)
    print(f"\nnewest run of the set started {started:.2f}s after its send (grace {GRACE}s)")
    assert told["by"] == r1.id and told["t"] - sent < GRACE
    assert started >= GRACE * 0.9
    assert not cluster.runs(old, "end")
    wait_for(lambda: not _alive(child), timeout=60, message="the old holder's child to be gone")
    assert r0.get(timeout=60) == {"mongolock": "superseded", "key": keys[0], "keys": keys, "by": r1.id}
    for key in keys:
        superseded_in_history(cluster, key, r0.id, r1.id)
    assert len(cluster.runs(old, "start")) == 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_pool_that_cannot_terminate_a_body_is_refused_and_grace_none_is_cooperative(
    cluster: Cluster, broker_kind: str
) -> None:
    """``--pool=threads`` with a task whose grace is finite: the worker does not start, and says why in our
    words; with ``grace=None`` (the app's default without the setting) it starts, and a body that polls is
    told and ends superseded there too."""
    if broker_kind != "redis":
        pytest.skip("the pool check does not depend on the broker: run once, on Redis")
    queue = f"cx-threads-{uuid.uuid4().hex[:6]}"
    args = ["--pool=threads", "-Q", queue]
    refusing = Worker(
        cluster.env(MONGOLOCK_IT_CANCEL_GRACE=GRACE),
        cluster.ready_dir,
        name=f"cxt{uuid.uuid4().hex[:4]}@localhost",
        extra_args=args,
    )
    try:
        with pytest.raises(AssertionError) as refused:
            refusing.start()
    finally:
        refusing.stop()  # (exited: closes its log)
    said = str(refused.value)
    assert "exited with" in said and "Replace(cancel_running=True, grace=...)" in said
    assert "'integration_app.cancel_deaf'" in said and "grace=None" in said

    worker = cluster.worker(name=f"cxt{uuid.uuid4().hex[:4]}@localhost", concurrency=2, extra_args=args)
    resource = tag()
    old, new = tag(), tag()
    r0 = it.cancel_polite.apply_async((resource, old, LONG), queue=queue)
    wait_for(lambda: cluster.runs(old, "start"), timeout=60, message="the holder to start")
    r1 = it.cancel_polite.apply_async((resource, new, 0.2), queue=queue)
    assert r0.get(timeout=60)["by"] == r1.id
    assert r1.get(timeout=60) == new
    assert worker.proc is not None and one(cluster, "start", old)["pid"] == worker.proc.pid  # no child
    worker.stop()
    cluster.workers.remove(worker)


def test_a_terminated_holder_s_chain_goes_on_with_the_superseded_result(cluster: Cluster) -> None:
    from celery import chain

    resource, old, new, label = tag(), tag(), tag(), tag()
    workflow = chain(it.cancel_deaf.si(resource, old, LONG), it.noted.s(label)).apply_async()
    wait_for(lambda: cluster.runs(old, "start"), timeout=60, message="the holder to start")
    r1 = it.cancel_deaf.delay(resource, new, 0.2)
    assert r1.get(timeout=60) == new
    # Terminated after its grace, its chain went on: the next task got the superseded result, once.
    outcome = workflow.get(timeout=90)
    assert outcome["value"] == {"mongolock": "superseded", "key": f"resource:{resource}", "by": r1.id}
    assert not cluster.runs(old, "end")
    assert [n["superseded"] for n in cluster.runs(label, "noted")] == [True]


@pytest.mark.parametrize("stopped", [True, False], ids=["stopped", "finished"])
def test_a_copy_of_a_run_whose_worker_died_before_its_result_ends_it_as_its_body_ended(
    cluster: Cluster, stopped: bool
) -> None:
    """The lock-set checker, RabbitMQ seed 34: a body stopped for a newer send and released its key, and
    its worker died before the result was stored. A redelivered copy found the run over and ended the
    task ``already-ran``, which says its body did its work: it had not. The release now records the newer
    send the body stopped for, and the copy ends the task superseded by it, as the run would have. A body
    told of a newer send that still finished its work (``stopped=False``) ends ``already-ran``, as before.
    The first run is played here (acquire, notice, release); the copy is a real delivery."""
    from celery.result import AsyncResult

    from celery_mongolock.integration.duplicates import DUPLICATE_HEADER

    resource, t = tag(), tag()
    task_id, key = str(uuid.uuid4()), f"resource:{resource}"
    info = {"task_id": task_id, "task_name": it.cancel_polite.name, "delivery": "0"}  # (a queued run's)
    first = cluster.store.acquire(key, ttl=60, info=info)
    assert first is not None
    assert first.mark_superseded("the-newer-send")
    if stopped:
        first.end_superseded()
    assert first.release()
    it.cancel_polite.apply_async((resource, t), task_id=task_id, headers={DUPLICATE_HEADER: 1})
    result = AsyncResult(task_id, app=it.app).get(timeout=90)
    if stopped:
        assert result == {"mongolock": "superseded", "key": key, "by": "the-newer-send"}
    else:
        assert isinstance(result, dict) and result["mongolock"] == "already-ran" and result["key"] == key
    assert cluster.runs(t) == []  # the body never ran again
