"""Singleton tasks in real ``celery worker`` processes (prefork, concurrency 2), a real Redis broker and
the MongoDB-compatible server. Runs record their start and end in MongoDB; the tests check those records.
"""

from __future__ import annotations

import functools
import itertools
import json
import socket
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import chain
from celery.exceptions import SoftTimeLimitExceeded
from celery.result import AsyncResult
from pymongo import MongoClient

from celery_mongolock import LeaseStore, LockContended
from celery_mongolock.integration import task as task_mod

from . import integration_app as it
from .conftest import CommandCounter
from .servers import RedisServer, wait_for
from .workers import Worker, pointed_at, purge_after_kill, worker_env

pytestmark = pytest.mark.slow

LEASE = 3.0  # seconds: short, so that expiry is seen within a test


class Cluster:
    def __init__(
        self, broker: str, mongo_url: str, db_name: str, ready_dir: Path, *, backend: str | None = None
    ) -> None:
        self.broker = broker
        self.backend = backend or broker
        self.mongo_url = mongo_url
        self.db_name = db_name
        self.ready_dir = ready_dir
        self.client: MongoClient[dict[str, Any]] = MongoClient(mongo_url)
        self.db = self.client[db_name]
        self.store = LeaseStore(mongo_url, database=db_name, lease_seconds=30)
        self.workers: list[Worker] = []

    def env(self, **extra: Any) -> dict[str, str]:
        extra.setdefault("MONGOLOCK_IT_BACKEND", self.backend)
        return worker_env(self.broker, self.mongo_url, self.db_name, self.ready_dir, lease=LEASE, **extra)

    def worker(self, **kwargs: Any) -> Worker:
        env = kwargs.pop("env", None) or self.env()
        w = Worker(env, self.ready_dir, **kwargs).start()
        self.workers.append(w)
        return w

    def runs(self, tag: str | None = None, kind: str | None = None) -> list[dict[str, Any]]:
        query: dict[str, Any] = {}
        if tag is not None:
            query["tag"] = tag
        if kind is not None:
            query["kind"] = kind
        return list(self.db["runs"].find(query).sort("mono", 1))

    def close(self) -> None:
        # SIGKILL every node, parent and children, rather than a warm shutdown: that would wait for the
        # long bodies some tests leave running (a redelivered 30 s holder: 30 s of teardown) and put the
        # messages the nodes had reserved back on the shared queue, for the next module's workers to run.
        # Nothing here is checked: the database goes with the nodes (warm shutdown has its own test).
        for w in self.workers:
            w.kill()
            w.stop()  # already dead: closes its log
        purge_after_kill(self.broker)  # RabbitMQ gives the dead nodes' messages back at once
        self.store.close()
        self.client.drop_database(self.db_name)
        self.client.close()


@contextmanager
def running_cluster(
    name: str,
    broker_url: str,
    backend: str,
    mongo_url: str,
    tmp_path_factory: pytest.TempPathFactory,
    *,
    nodes: int = 2,
    concurrency: int | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[Cluster]:
    """A module's worker nodes (``name1@localhost``, ...) on ``broker_url``, results in ``backend``, in a
    database of their own; the test process's app pointed at them for the block. The fixtures of the
    real-worker files are this, with their own name, node count and concurrency."""
    db_name = f"mongolock_{name}_{uuid.uuid4().hex[:8]}"
    c = Cluster(broker_url, mongo_url, db_name, tmp_path_factory.mktemp(f"{name}workers"), backend=backend)
    settings = {"mongolock_url": mongo_url, "mongolock_database": db_name, "mongolock_lease_seconds": LEASE}
    with pointed_at(it.app, broker_url, backend, **settings):
        try:
            options: dict[str, Any] = {} if concurrency is None else {"concurrency": concurrency}
            for n in range(1, nodes + 1):
                c.worker(name=f"{name}{n}@localhost", env=env and c.env(**env), **options)
            yield c
        finally:
            c.close()


@pytest.fixture(scope="module")
def cluster(
    broker_url: str, redis_server: RedisServer, mongo_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """Two worker nodes on each broker in turn (``broker_url``: Redis, then RabbitMQ), results in Redis."""
    with running_cluster("w", broker_url, redis_server.url, mongo_url, tmp_path_factory) as c:
        yield c


def tag() -> str:
    return uuid.uuid4().hex[:10]


def logged(workers: list[Worker], *words: str) -> bool:
    """Whether one line of a worker's log holds all of ``words`` (our own words and a task id): one event
    of that task. Never two lines that hold one each: a worker's log keeps the words of earlier tests, and
    the task id is in its "received" line long before the task does anything (issue 32)."""
    return any(all(word in line for word in words) for w in workers for line in w.log().splitlines())


def intervals(cluster: Cluster, tags: list[str]) -> list[tuple[float, float, int]]:
    out = []
    for t in tags:
        start = cluster.runs(t, "start")
        end = cluster.runs(t, "end")
        assert len(start) == 1 and len(end) == 1, f"{t}: {start} {end}"
        out.append((start[0]["mono"], end[0]["mono"], start[0]["fence"]))
    return sorted(out)


# -- mutual exclusion ----------------------------------------------------------------------------------


def test_runs_for_one_key_never_overlap(cluster: Cluster) -> None:
    resource = tag()
    tags = [tag() for _ in range(6)]
    results = [it.guarded.delay(resource, t, 0.3) for t in tags]
    assert [r.get(timeout=90) for r in results] == tags
    spans = intervals(cluster, tags)
    for (_, e1, f1), (s2, _, f2) in itertools.pairwise(spans):
        assert e1 <= s2, "two runs for one key overlapped"
        assert f1 < f2, "fences must increase in run order"


def test_different_keys_run_in_parallel(cluster: Cluster) -> None:
    tags = [tag() for _ in range(4)]
    results = [it.guarded.delay(tag(), t, 1.5) for t in tags]
    for r in results:
        r.get(timeout=60)
    spans = intervals(cluster, tags)
    overlapping = sum(1 for (_, e1, _), (s2, _, _) in itertools.pairwise(spans) if s2 < e1)
    assert overlapping >= 1, "runs for different keys should not wait for each other"


def test_email_group_uploads_end_with_exactly_the_second_files_members(cluster: Cluster) -> None:
    group = int(time.time() * 1000) % 1_000_000
    first = [f"a{i}@example.com" for i in range(30)]
    second = [f"b{i}@example.com" for i in range(12)]
    up1, up2 = tag(), tag()
    r1 = it.upload_members.delay(group, up1, first)
    wait_for(lambda: cluster.runs(up1, "start"), timeout=30, message="the first upload to start")
    r2 = it.upload_members.delay(group, up2, second)
    assert r1.get(timeout=60) == 30
    assert r2.get(timeout=60) == 12
    members = sorted(d["email"] for d in cluster.db["group_members"].find({"group": group}))
    assert members == sorted(second)
    assert cluster.runs(up1, "end")[0]["mono"] <= cluster.runs(up2, "start")[0]["mono"]


# -- policies ------------------------------------------------------------------------------------------


def test_skip_ends_observably_naming_key_and_holder(cluster: Cluster) -> None:
    resource, t = tag(), tag()
    with cluster.store.hold(f"resource:{resource}", info={"task_name": "someone", "task_id": "holder-1"}):
        result = it.skipper.delay(resource, t).get(timeout=30)
    assert result["mongolock"] == "skipped"
    assert result["key"] == f"resource:{resource}"
    assert result["holder"]["task_id"] == "holder-1"
    assert cluster.runs(t) == []  # the body never ran


def test_per_task_settings_beat_the_decorator(cluster: Cluster) -> None:
    resource, t = tag(), tag()
    with cluster.store.hold(f"resource:{resource}"):
        result = it.per_task_skip.delay(resource, t).get(timeout=30)
    assert result["mongolock"] == "skipped"


def test_fail_raises_lock_contended_without_a_traceback(cluster: Cluster) -> None:
    resource, t = tag(), tag()
    with cluster.store.hold(f"resource:{resource}", info={"task_id": "holder-2"}):
        res = it.failer.delay(resource, t)
        with pytest.raises(LockContended) as exc:
            res.get(timeout=30)
    assert res.state == "FAILURE"
    assert exc.value.key == f"resource:{resource}"
    assert exc.value.holder.get("task_id") == "holder-2"
    assert cluster.runs(t) == []
    # Celery logs an error the task declares in ``throws`` as expected, without a traceback; the worker's last
    # line about this run (however Celery words it) is not followed by one.
    assert LockContended in it.failer.throws
    logs = "".join(w.log() for w in cluster.workers)
    line = [line for line in logs.splitlines() if res.id in line][-1]
    assert "Traceback" not in logs.split(line, 1)[1][:300]


def test_wait_wakes_promptly_when_the_holder_releases(cluster: Cluster) -> None:
    resource, t = tag(), tag()
    lease = cluster.store.acquire(f"resource:{resource}", ttl=30)
    assert lease is not None
    res = it.waiter.delay(resource, t, 0.1)
    wait_for(
        lambda: cluster.db["runs"].find_one({"kind": "contended", "key": f"resource:{resource}"}),
        timeout=30,
        message="the waiter to find the key held",
    )
    released_at = time.monotonic()
    lease.release()
    assert res.get(timeout=30) == t
    started = cluster.runs(t, "start")[0]["mono"]
    assert started - released_at < 2.0, "the waiter should start right after the release, not at expiry"


def test_retry_does_not_use_the_tasks_own_retry_budget(cluster: Cluster) -> None:
    resource, t = tag(), tag()
    key = f"resource:{resource}"
    with cluster.store.hold(key):
        res = it.retrier.delay(resource, t, 0.1, True)  # max_retries=1, and it retries once itself
        wait_for(lambda: res.state == "RETRY", timeout=30, message="a contention retry")
        wait_for(
            lambda: cluster.db["runs"].count_documents({"kind": "contended", "key": key}) >= 3,
            timeout=60,
            message="several contention retries while the key is held",
        )
    assert res.get(timeout=60) == t
    own = cluster.runs(t, "own-retry")
    assert len(own) == 1 and own[0]["contention"] >= 1
    assert cluster.runs(t, "retries")[0]["retries"] == 1


# -- every path a message can take -----------------------------------------------------------------------


def test_send_task_chains_and_eta_are_guarded(cluster: Cluster) -> None:
    resource = tag()
    t1, t2, t3 = tag(), tag(), tag()
    with cluster.store.hold(f"resource:{resource}"):
        by_name = it.app.send_task("integration_app.skipper", args=(resource, t1))
        chained = chain(it.plain.si("x"), it.skipper.si(resource, t2)).apply_async()
        eta = it.skipper.apply_async((resource, t3), countdown=1)
        assert by_name.get(timeout=30)["mongolock"] == "skipped"
        assert chained.get(timeout=30)["mongolock"] == "skipped"
        assert eta.get(timeout=30)["mongolock"] == "skipped"
    assert cluster.runs(t1) == cluster.runs(t2) == cluster.runs(t3) == []


def test_redelivered_message_does_not_run_twice_or_touch_the_first_result(cluster: Cluster) -> None:
    resource, t = tag(), tag()
    task_id = str(uuid.uuid4())
    # The first delivery's run holds the lease (we play it); the same message arrives again.
    with cluster.store.hold(f"resource:{resource}", info={"task_id": task_id, "task_name": it.guarded.name}):
        it.guarded.apply_async((resource, t), task_id=task_id)
        wait_for(
            lambda: logged(cluster.workers, "duplicate delivery", task_id),
            timeout=30,
            message="the duplicate to be parked",
        )
        assert AsyncResult(task_id, app=it.app).state == "PENDING"  # nothing overwritten
        with warnings.catch_warnings():  # redis-py deprecates the setex Celery's backend calls
            warnings.simplefilter("ignore", DeprecationWarning)
            it.app.backend.store_result(task_id, "the first run's result", "SUCCESS")  # the first run ends
    # The first run released the key itself: the parked copy, looked at again, is dropped.
    dropped = "parked duplicate of a run that has ended"
    wait_for(
        lambda: logged(cluster.workers, dropped, task_id),
        timeout=30,
        message="the parked copy to be dropped",
    )
    assert cluster.runs(t) == []
    assert AsyncResult(task_id, app=it.app).get(timeout=10) == "the first run's result"


def test_a_copy_of_a_run_that_ended_without_a_result_ends_the_task(cluster: Cluster) -> None:
    resource, t = tag(), tag()
    task_id = str(uuid.uuid4())
    # The first run ran and released the key, and its worker died before it stored the result.
    with cluster.store.hold(f"resource:{resource}", info={"task_id": task_id, "task_name": it.guarded.name}):
        it.guarded.apply_async((resource, t), task_id=task_id)
        wait_for(
            lambda: logged(cluster.workers, "duplicate delivery", task_id),
            timeout=30,
            message="the duplicate to be parked",
        )
        # That line is written once the marked copy is published and this delivery is over: from here the
        # task is only that copy, which is checked whenever it is looked at, before or after the release.
    result = AsyncResult(task_id, app=it.app).get(timeout=60)
    assert result["mongolock"] == "already-ran" and result["key"] == f"resource:{resource}"
    assert cluster.runs(t) == []  # the body never ran twice


def dropped_unrun(cluster: Cluster, task_id: str, keys: list[str]) -> None:
    """Wait until a worker has dropped ``task_id``'s delivery without its body (its own log line), then
    check that it gave its keys back: each is free, and remembers no run of the task as over."""
    wait_for(
        lambda: logged(cluster.workers, "not run on", task_id),
        timeout=60,
        message=f"the delivery of {task_id} to be dropped unrun",
    )
    for key in keys:
        doc = cluster.db["leases"].find_one({"_id": key}) or {}
        assert doc.get("owner") is None, f"{key} is still taken"
        assert not any(str(s).startswith(f"{task_id}/") for s in doc.get("seen") or []), doc.get("seen")


@pytest.mark.parametrize("several", [False, True], ids=["one-key", "keys"])
def test_a_later_attempt_of_a_task_that_ended_never_runs_its_body(cluster: Cluster, several: bool) -> None:
    """Two lines of one task: a body lost its lease, a copy of its message ran the body and ended the task,
    and then the first body's ``self.retry()`` published attempt 1 (the lock-set checker on RabbitMQ ran
    it: the body ran twice). Attempt 1 takes its keys, finds the task ended in the result backend, gives
    them back and is dropped; the stored result stands."""
    a, b, t = tag(), tag(), tag()
    task_id = str(uuid.uuid4())
    with warnings.catch_warnings():  # redis-py deprecates the setex Celery's backend calls
        warnings.simplefilter("ignore", DeprecationWarning)
        it.app.backend.store_result(task_id, "the copy's result", "SUCCESS")
    if several:
        it.merge.apply_async((a, b, t), task_id=task_id, retries=1)
    else:
        it.guarded.apply_async((a, t), task_id=task_id, retries=1)
    dropped_unrun(cluster, task_id, [f"resource:{a}", f"resource:{b}"] if several else [f"resource:{a}"])
    assert cluster.runs(t) == []
    assert AsyncResult(task_id, app=it.app).get(timeout=10) == "the copy's result"


def test_a_copy_of_an_attempt_whose_body_retried_never_runs_its_body(cluster: Cluster) -> None:
    """The other order: the first body lost its lease and retried (its ``RETRY`` stored, attempt 1 on its
    way); then a parked copy of attempt 0 finds the key free (a lost lease's run is not remembered as over)
    and takes it. It finds the body's own ``RETRY`` in the result backend and is dropped unrun: attempt 1
    carries the task on."""
    resource, t = tag(), tag()
    task_id = str(uuid.uuid4())
    with warnings.catch_warnings():  # redis-py deprecates the setex Celery's backend calls
        warnings.simplefilter("ignore", DeprecationWarning)
        it.app.backend.mark_as_retry(task_id, ValueError("the body retried"))
    it.guarded.apply_async((resource, t), task_id=task_id, headers={task_mod.DUPLICATE_HEADER: 1})
    dropped_unrun(cluster, task_id, [f"resource:{resource}"])
    assert cluster.runs(t) == []
    assert AsyncResult(task_id, app=it.app).state == "RETRY"


def test_a_copy_of_a_run_that_ended_inside_its_minimum_hold_never_runs(cluster: Cluster) -> None:
    """A run that ends inside its minimum hold (``min_hold_seconds``) is over, although its key stays
    taken until the hold ends and is then free without another release. Its copy, looked at while the
    key is still taken or once it is free, ends the task "already-ran": the key remembers the runs that
    ended (issue 32: the copy used to take the key once the hold had passed, and ran the body again)."""
    resource, t = tag(), tag()
    task_id = str(uuid.uuid4())
    key = f"resource:{resource}"
    # The first run (we play it, delivery "0.0" as a first delivery's) ends at once, inside a long hold.
    info = {"task_id": task_id, "task_name": it.guarded.name, "delivery": "0.0"}
    first = cluster.store.acquire(key, ttl=60, min_hold=30, info=info)
    assert first is not None
    assert first.release()
    doc = cluster.db["leases"].find_one({"_id": key}) or {}
    assert doc.get("owner") is not None, "the release inside the minimum hold keeps the key taken"
    # The same message arrives: it finds the key held by its own run and is parked as a duplicate; the
    # parked copy is looked at a lease length later, long before the hold ends.
    it.guarded.apply_async((resource, t), task_id=task_id)
    result = AsyncResult(task_id, app=it.app).get(timeout=60)
    assert isinstance(result, dict), f"the body ran again: {result!r}"
    assert result["mongolock"] == "already-ran" and result["key"] == key
    assert cluster.runs(t) == []


def test_a_contention_retry_of_a_parked_copy_is_still_a_copy(cluster: Cluster) -> None:
    """A parked copy that MongoDB did not answer goes on as a contention retry (its delivery "0.1"). If
    the first run ("0.0") then ends, that retry is still a copy of it, and never runs the body (issue 32:
    it was matched on its own delivery only, and ran)."""
    resource, t = tag(), tag()
    task_id = str(uuid.uuid4())
    key = f"resource:{resource}"
    info = {"task_id": task_id, "task_name": it.guarded.name, "delivery": "0.0"}
    first = cluster.store.acquire(key, ttl=60, info=info)
    assert first is not None
    assert first.release()
    # The message the library publishes for the contention retry of a parked copy (task._contention_retry
    # of a request that carries the parked-duplicate header).
    headers = {task_mod.DUPLICATE_HEADER: 1, task_mod.CONTENTION_HEADER: 1}
    it.guarded.apply_async((resource, t), task_id=task_id, headers=headers)
    result = AsyncResult(task_id, app=it.app).get(timeout=60)
    assert isinstance(result, dict), f"the body ran again: {result!r}"
    assert result["mongolock"] == "already-ran" and result["key"] == key
    assert cluster.runs(t) == []


def test_a_contention_retry_of_an_attempt_that_ran_never_runs_the_body(cluster: Cluster) -> None:
    """A message the broker delivered again (its run's acknowledgement lost with the connection: a broker
    restart) while the first delivery had found the key held and published its contention retry: two
    lines of contention retries of one attempt ("0.1", "0.2" ...), neither marked as a copy (the
    redelivery is a flag of the delivery, not a header the retry carries). Once one of them ran and
    released the key, a retry of the other is a copy of that run: it ends the task already-ran (or is
    dropped) and never runs the body (it ran it: the lock-set checker's ran-after-release, RabbitMQ)."""
    resource, t = tag(), tag()
    task_id = str(uuid.uuid4())
    key = f"resource:{resource}"
    # One line's run ("0.1": a contention retry of the first delivery) ran and released the key.
    info = {"task_id": task_id, "task_name": it.retrier.name, "delivery": "0.1"}
    first = cluster.store.acquire(key, ttl=60, info=info)
    assert first is not None
    assert first.release()
    # The other line's contention retry, as the library publishes it for a contended run.
    headers = {task_mod.CONTENTION_HEADER: 2}
    it.retrier.apply_async((resource, t), task_id=task_id, headers=headers)
    result = AsyncResult(task_id, app=it.app).get(timeout=60)
    assert isinstance(result, dict), f"the body ran again: {result!r}"
    assert result["mongolock"] == "already-ran" and result["key"] == key
    assert cluster.runs(t) == []


def test_a_contention_retry_of_an_attempt_that_ran_is_not_retried_while_the_key_is_held(
    cluster: Cluster,
) -> None:
    """The same, with the key held by another run when that retry arrives: it is a copy of a run that
    ended, not a run waiting for the key (it waited, and ran the body once the key was free)."""
    resource, t = tag(), tag()
    task_id = str(uuid.uuid4())
    key = f"resource:{resource}"
    info = {"task_id": task_id, "task_name": it.retrier.name, "delivery": "0.1"}
    first = cluster.store.acquire(key, ttl=60, info=info)
    assert first is not None
    assert first.release()
    with cluster.store.hold(key):
        headers = {task_mod.CONTENTION_HEADER: 2}
        it.retrier.apply_async((resource, t), task_id=task_id, headers=headers)
        result = AsyncResult(task_id, app=it.app).get(timeout=60)
    assert isinstance(result, dict), f"the body ran again: {result!r}"
    assert result["mongolock"] == "already-ran" and result["key"] == key
    assert cluster.runs(t) == []


def test_a_parked_duplicate_runs_when_the_first_run_died(cluster: Cluster) -> None:
    """Acknowledging a duplicate delivery also acknowledges the first one; if the first run then dies,
    the parked copy is what brings the task back."""
    resource, t = tag(), tag()
    task_id = str(uuid.uuid4())
    key = f"resource:{resource}"
    first = cluster.store.acquire(key, ttl=60, info={"task_id": task_id, "task_name": it.guarded.name})
    assert first is not None
    res = it.guarded.apply_async((resource, t), task_id=task_id)
    wait_for(
        lambda: logged(cluster.workers, "duplicate delivery", task_id),
        timeout=30,
        message="the duplicate to be parked",
    )
    assert cluster.runs(t) == []
    # The first run's worker dies; its parent (here: us) releases the dead holder's lease.
    assert cluster.store.release_held_by(task_id=task_id) == 1
    assert res.get(timeout=60) == t
    assert len(cluster.runs(t, "start")) == 1
    first.release()


def _deliver_again(queue: str, task_ids: set[str]) -> None:
    """Take the messages off ``queue`` without acknowledging them and drop the connection: the broker puts
    them back marked ``redelivered`` (kombu's Redis transport in the message, RabbitMQ in the delivery), as
    it does for a worker that died before it acknowledged (or, on Redis, after the visibility timeout)."""
    with it.app.connection_for_read() as conn:
        channel = conn.default_channel
        taken: set[str] = set()
        while taken != task_ids:
            message = channel.basic_get(queue, no_ack=False)
            assert message is not None, f"{task_ids - taken} not in {queue}"
            taken.add(message.headers["id"])
    if not str(it.app.conf.broker_url).startswith("redis"):
        # RabbitMQ: look at them once more the same way (they go back again when this connection closes).
        with it.app.connection_for_read() as conn:
            channel = conn.default_channel
            flags: dict[str, bool] = {}

            def all_back() -> bool:
                message = channel.basic_get(queue, no_ack=False)
                if message is not None:
                    flags[message.headers["id"]] = bool(message.delivery_info.get("redelivered"))
                return set(flags) == task_ids

            wait_for(all_back, timeout=10, message=f"{task_ids} back in {queue}")
        assert all(flags.values()), f"RabbitMQ did not mark them redelivered: {flags}"
        return
    raw = redis.Redis.from_url(str(it.app.conf.broker_url))
    try:
        queued = [json.loads(m) for m in raw.lrange(queue, 0, -1)]
    finally:
        raw.close()
    assert {m["headers"]["id"] for m in queued} == task_ids
    assert all(m["headers"].get("redelivered") for m in queued), "kombu did not mark them redelivered"


def test_a_redelivered_message_whose_run_ended_does_not_run_again(cluster: Cluster) -> None:
    """A worker that dies after a run ended but before it acknowledged the message (the Celery 5.7.0
    worker does, when the Redis broker goes away) gets the message redelivered: the lease document
    knows that this very delivery ran and released the key, so it is not run a second time. A
    redelivered message that never ran still runs."""
    queue = f"redeliver{tag()}"
    done_resource, done_tag, done_id = tag(), tag(), str(uuid.uuid4())
    assert it.guarded.apply_async((done_resource, done_tag), task_id=done_id).get(timeout=30) == done_tag
    fresh_resource, fresh_tag, fresh_id = tag(), tag(), str(uuid.uuid4())
    it.guarded.apply_async((done_resource, done_tag), task_id=done_id, queue=queue)
    it.guarded.apply_async((fresh_resource, fresh_tag), task_id=fresh_id, queue=queue)
    _deliver_again(queue, {done_id, fresh_id})
    w = cluster.worker(name=f"r{tag()}@localhost", extra_args=["-Q", queue])
    assert AsyncResult(fresh_id, app=it.app).get(timeout=30) == fresh_tag
    wait_for(
        lambda: logged([w], "redelivery of a run that has ended", done_id),
        timeout=30,
        message="the redelivered copy of the finished run to be dropped",
    )
    assert len(cluster.runs(done_tag, "start")) == 1, "the finished run ran again"
    assert len(cluster.runs(fresh_tag, "start")) == 1
    w.stop()


def test_a_redelivered_copy_of_a_retry_that_ran_ends_the_task_already_ran(cluster: Cluster) -> None:
    """The lock-set checker's seed 86: attempt 0 of a ``limit=3`` ``Retry`` task called ``self.retry()``
    (the task's state RETRY); attempt 1 took a slot, ran its body and released the slot, and its child was
    killed before the result was stored; the broker delivered attempt 1's message again. That copy ends
    the task ``already-ran`` (it was dropped as if attempt 1's own retry were on its way, and the task stayed
    RETRY). A copy of an attempt whose retry is known on the key (holding a slot) is still dropped."""
    queue = f"redeliver{tag()}"
    tenant, t = tag(), tag()
    key = f"tenant:{tenant}"
    ended_id, carried_id = str(uuid.uuid4()), str(uuid.uuid4())
    for task_id in (ended_id, carried_id):
        with warnings.catch_warnings():  # redis-py deprecates the setex Celery's backend calls
            warnings.simplefilter("ignore", DeprecationWarning)
            it.app.backend.mark_as_retry(task_id, None)  # attempt 0's body retried
        info = {"task_id": task_id, "task_name": it.per_tenant.name, "delivery": "1.0"}
        first = cluster.store.acquire(key, 30, info=info, limit=3)  # attempt 1 ran and released its slot
        assert first is not None and first.release()
        it.per_tenant.apply_async((tenant, t), task_id=task_id, queue=queue, retries=1)
    # carried_id's attempt 1 retried too: its attempt 2 holds a slot now.
    later = cluster.store.acquire(
        key, 30, info={"task_id": carried_id, "task_name": it.per_tenant.name, "delivery": "2.0"}, limit=3
    )
    assert later is not None
    _deliver_again(queue, {ended_id, carried_id})
    w = cluster.worker(name=f"r{tag()}@localhost", extra_args=["-Q", queue])
    ended = AsyncResult(ended_id, app=it.app)
    wait_for(
        lambda: (
            logged([w], "redelivery of a run that has ended", carried_id)
            and (ended.ready() or logged([w], "redelivery of a run that has ended", ended_id))
        ),
        timeout=30,
        message="both copies to be judged",
    )
    assert ended.state == "SUCCESS", f"the copy was dropped and the task left {ended.state}"
    assert ended.result["mongolock"] == "already-ran" and ended.result["key"] == key
    assert AsyncResult(carried_id, app=it.app).state == "RETRY"  # its attempt 2 stores the result
    assert cluster.runs(t) == []  # no body ran again
    later.release()
    w.stop()


# -- exit paths ----------------------------------------------------------------------------------------


def test_a_task_running_for_several_lease_lengths_keeps_its_lease(cluster: Cluster) -> None:
    resource, t = tag(), tag()
    res = it.guarded.delay(resource, t, LEASE * 3)
    wait_for(lambda: cluster.runs(t, "start"), timeout=30, message="the long task to start")
    while not res.ready():
        taken = cluster.store.acquire(f"resource:{resource}")
        if taken is not None:
            # Free only once the body has ended (it records its end, then releases, then its result is
            # stored): the loop can land between the release and the result.
            assert cluster.runs(t, "end"), f"the key was free while the task ran: {cluster.runs(t)}"
            taken.release()
            break
        time.sleep(0.2)
    assert res.get(timeout=30) == t
    assert cluster.runs(t, "noticed-lost") == []
    assert cluster.db["runs"].count_documents({"kind": "lost", "key": f"resource:{resource}"}) == 0


def test_soft_time_limit_releases(cluster: Cluster) -> None:
    resource, t = tag(), tag()
    res = it.guarded.apply_async((resource, t, 10), soft_time_limit=1)
    with pytest.raises(SoftTimeLimitExceeded):  # the type, not its text
        res.get(timeout=30)
    info = cluster.store.inspect(f"resource:{resource}")
    assert info is not None and not info.held and info.released_at is not None


def test_a_killed_child_frees_its_key_long_before_expiry(cluster: Cluster) -> None:
    long_lease = cluster.env(MONGOLOCK_IT_LEASE=60)
    w = cluster.worker(name=f"k{tag()}@localhost", env=long_lease, extra_args=["-Q", "killq"])
    resource, t = tag(), tag()
    it.guarded.apply_async((resource, t, 30), queue="killq")
    start = wait_for(lambda: cluster.runs(t, "start"), timeout=30, message="the task to start")[0]
    killed_at = time.monotonic()
    import os
    import signal

    os.kill(start["pid"], signal.SIGKILL)
    # The parent releases the dead child's lease; the requeued message (acks_late) runs again at once
    # instead of waiting out the 60 s lease.
    starts = wait_for(lambda: cluster.runs(t, "start")[1:], timeout=30, message="the requeued run to start")
    assert starts[0]["mono"] - killed_at < 30  # the lease is 60 s
    assert starts[0]["pid"] != start["pid"]
    assert "released 1 lease(s)" in w.log()
    w.kill()


def _terminate(pid: int) -> None:
    """SIGTERM to a pool child, again every 15 s while it lives, until it has exited: a signal taken while
    a finalizer runs is swallowed (its SystemExit is "ignored in __del__": ci67, under a load average of
    15, a child ran on 120 s)."""
    import os
    import signal

    sent = [time.monotonic()]
    os.kill(pid, signal.SIGTERM)

    def exited() -> bool:
        try:
            if time.monotonic() - sent[-1] > 15:
                sent.append(time.monotonic())
                os.kill(pid, signal.SIGTERM)
            else:
                os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(exited, timeout=120, message="the pool child to exit on SIGTERM")


def _cut_short_by_sigterm_runs_again(cluster: Cluster, queue: str, headers: dict[str, Any] | None) -> str:
    """Start a gated run on ``queue``, SIGTERM its pool child while its body runs, and wait until the
    message, delivered again, runs the body again in another child; its worker's log."""

    w = cluster.worker(name=f"{queue}{tag()}@localhost", extra_args=["-Q", queue])
    resource, t = tag(), tag()
    res = it.gated.apply_async((resource, t), queue=queue, headers=headers)
    start = wait_for(lambda: cluster.runs(t, "start"), timeout=30, message="the task to start")[0]
    _terminate(start["pid"])
    again = wait_for(
        lambda: cluster.runs(t, "start")[1:], timeout=60, message="the cut-short run to run again"
    )
    assert again[0]["pid"] != start["pid"]
    cluster.db["gates"].insert_one({"_id": t})
    assert res.get(timeout=60) == t
    log = w.log()
    w.kill()
    return log


def test_a_body_cut_short_by_sigterm_runs_again(cluster: Cluster) -> None:
    """A pool child told to stop (SIGTERM: a cold shutdown, or a SIGTERM sent to the worker's whole process
    group, as systemd and ``pkill -f`` do) unwinds its body with ``SystemExit``: the run did not end, so its
    key is given back unmarked and its message, delivered again, runs it again (not ``already-ran``)."""
    assert "its body was cut short (SystemExit" in _cut_short_by_sigterm_runs_again(cluster, "coldq", None)


def test_a_beat_tick_cut_short_by_sigterm_runs_its_tick_again(cluster: Cluster) -> None:
    """The same for a run of a beat tick: its key is given back with its tick, so its message, delivered
    again, runs the tick (before: the copy was taken for a run that had ended, ``already-ran``, since the
    key still named it as its last holder, and the tick's work was lost)."""
    from celery_mongolock.integration.headers import BEAT_HEADER

    tick = {"tick": int(time.time() * 1000), "window": 600}
    _cut_short_by_sigterm_runs_again(cluster, "coldtickq", {BEAT_HEADER: tick})


def test_a_run_cut_short_before_its_body_started_runs_again(cluster: Cluster) -> None:
    """A pool child told to stop (SIGTERM) after its run took the key and before its body started (here:
    in a ``lease_acquired`` receiver) exits with the key still held; the process's exit gives it back unrun
    (before: released as a run that ended, so the message, delivered again, ended ``already-ran`` and the
    body never ran; found by the lock-set checker's ``sigterm-node`` fault on RabbitMQ)."""

    w = cluster.worker(name=f"pb{tag()}@localhost", extra_args=["-Q", "prebodyq"])
    resource, t = tag(), tag()
    res = it.held_before_body.apply_async((resource, t), queue="prebodyq")
    waiting = wait_for(lambda: cluster.runs(t, "before-body"), timeout=60, message="the run to take its key")[
        0
    ]
    _terminate(waiting["pid"])
    assert res.get(timeout=90) == t  # (before: {"mongolock": "already-ran", ...})
    start = cluster.runs(t, "start")
    assert len(start) == 1 and start[0]["pid"] != waiting["pid"]
    info = cluster.store.inspect(f"resource:{resource}")
    assert info is not None and not info.held
    w.kill()


def test_a_debounced_copy_whose_node_died_holding_the_key_runs_again(
    cluster: Cluster, broker_kind: str
) -> None:
    """``Replace(debounce=...)``: the run's delayed copy takes the key (due) and starts its body, then its
    whole node is killed. The broker delivers the copy again (RabbitMQ: at once) while the dead run's lease
    still lives: the copy is kept as any duplicate (looked at again after a lease), not dropped as the copy
    of a run that runs under another message (before: dropped, the run ``QUEUED`` forever; found by the
    lock-set checker on RabbitMQ). On Redis the copy comes back only after the visibility timeout (an hour
    by default), when the lease has long expired: nothing of this to see within a test."""
    if broker_kind != "rabbitmq":
        pytest.skip("on Redis a killed node's message comes back after the visibility timeout (1 h)")
    first = cluster.worker(name=f"dk1{tag()}@localhost", extra_args=["-Q", "dkq"])
    resource, t = tag(), tag()
    res = it.debounced.apply_async((resource, t, 15.0), queue="dkq")
    start = wait_for(lambda: cluster.runs(t, "start"), timeout=60, message="the copy's body to start")[0]
    second = cluster.worker(name=f"dk2{tag()}@localhost", extra_args=["-Q", "dkq"])
    first.kill()  # the whole node, while its child runs the body holding the key
    again = wait_for(
        lambda: cluster.runs(t, "start")[1:], timeout=120, message="the run to start again on the other node"
    )
    assert again[0]["pid"] != start["pid"]
    assert res.get(timeout=60) == t
    second.kill()


def test_a_run_too_large_to_park_fails_in_our_words_naming_the_task(cluster: Cluster) -> None:
    """A Queue run whose message alone would pass what a lease document takes (20 MiB: MongoDB's
    documents hold 16) ends FAILURE with ``MessageTooLarge`` naming the task, the key and the size, logged
    as an expected error (issue 28 item 8: before, the driver's raw ``findAndModify command document too
    large``)."""
    from celery_mongolock import MessageTooLarge

    w = cluster.worker(name=f"big{tag()}@localhost", extra_args=["-Q", "bigq"])
    resource = tag()
    res = it.queued.apply_async((resource, "x" * (20 * 2**20)), queue="bigq")
    with pytest.raises(MessageTooLarge) as refused:
        res.get(timeout=90)
    assert res.state == "FAILURE"
    words = str(refused.value)
    assert words.startswith("a run of task 'integration_app.queued': its message is 20.0 MiB, over ")
    assert f"a run of 'resource:{resource}'" in words and "by reference" in words
    wait_for(lambda: "raised expected: MessageTooLarge" in w.log(), timeout=30, message="its log line")
    assert "raised unexpected: MessageTooLarge" not in w.log()
    w.kill()


def test_hard_time_limit_frees_the_key(cluster: Cluster) -> None:
    long_lease = cluster.env(MONGOLOCK_IT_LEASE=60)
    w = cluster.worker(name=f"h{tag()}@localhost", env=long_lease, extra_args=["-Q", "hardq"])
    resource, t = tag(), tag()
    res = it.guarded.apply_async((resource, t, 30), queue="hardq", time_limit=2)
    wait_for(lambda: cluster.runs(t, "start"), timeout=30, message="the task to start")
    wait_for(
        lambda: cluster.db["leases"].find_one({"_id": f"resource:{resource}", "owner": None}),
        timeout=20,
        message="the lease to be released after the hard time limit",
    )
    assert res.state in ("FAILURE", "PENDING", "STARTED", "RETRY") or res.failed()
    w.kill()


def test_revoke_with_terminate_frees_the_key(cluster: Cluster) -> None:
    resource, t = tag(), tag()
    res = it.guarded.apply_async((resource, t, 30))
    wait_for(lambda: cluster.runs(t, "start"), timeout=30, message="the task to start")
    it.app.control.revoke(res.id, terminate=True)
    wait_for(
        lambda: cluster.db["leases"].find_one({"_id": f"resource:{resource}", "owner": None}),
        timeout=20,
        message="the lease to be released after revoke+terminate",
    )


def test_a_killed_node_frees_the_key_at_expiry(cluster: Cluster) -> None:
    w = cluster.worker(name=f"n{tag()}@localhost", extra_args=["-Q", "nodeq"])
    resource, t = tag(), tag()
    it.guarded.apply_async((resource, t, 60), queue="nodeq")
    wait_for(lambda: cluster.runs(t, "start"), timeout=30, message="the task to start")
    w.kill()  # the whole node: parent and children; nobody can release
    killed_at = time.monotonic()
    t2 = tag()
    assert it.guarded.delay(resource, t2, 0.1).get(timeout=60) == t2
    started = cluster.runs(t2, "start")[0]["mono"]
    assert started - killed_at < LEASE + 10
    doc = cluster.db["leases"].find_one({"_id": f"resource:{resource}"})
    assert doc is not None and doc["holder"]["pid"] != cluster.runs(t, "start")[0]["pid"]


# -- faults --------------------------------------------------------------------------------------------


def test_mongodb_down_during_acquisition_does_not_run_the_body(
    cluster: Cluster, own_server: Any, tmp_path: Path
) -> None:
    server = own_server(storage_path=tmp_path / "data")
    # Each attempt while MongoDB is down waits out the operation timeout (10 s by default): 2 s here.
    env = cluster.env(MONGOLOCK_IT_MONGODB_URL=server.url, MONGOLOCK_IT_OP_TIMEOUT="2")
    w = cluster.worker(name=f"m{tag()}@localhost", env=env, extra_args=["-Q", "mongoq"])
    resource, t = tag(), tag()
    server.stop()
    down_at = time.time()
    res = it.guarded.apply_async((resource, t, 0.1), queue="mongoq")
    wait_for(lambda: res.state == "RETRY", timeout=60, message="the run to be retried while MongoDB is down")
    assert "body not run" in w.log()
    restarting_at = time.time()
    server.start()  # same port, same data
    assert res.get(timeout=120) == t  # nothing was lost: the run happened once MongoDB was back
    check: MongoClient[dict[str, Any]] = MongoClient(server.url)
    runs = list(check[cluster.db_name]["runs"].find({"tag": t, "kind": "start"}))
    check.close()
    assert len(runs) == 1, "the body ran exactly once"
    assert runs[0]["t"] >= restarting_at > down_at, "the body ran while MongoDB was down"
    w.stop()


# -- cost ----------------------------------------------------------------------------------------------


def test_a_singleton_task_costs_two_commands(mongo_url: str, db_name: str) -> None:
    counter = CommandCounter()
    client: MongoClient[dict[str, Any]] = MongoClient(mongo_url, event_listeners=[counter])
    app = it.app
    saved = {k: app.__dict__.get(k) for k in ("_mongolock_settings", "_mongolock_store")}
    saved_conf = {k: app.conf.get(k) for k in ("mongolock_url", "mongolock_database")}
    app.conf.update(mongolock_url=mongo_url, mongolock_database=db_name)
    try:
        app.__dict__.pop("_mongolock_settings", None)
        app._mongolock_store = LeaseStore(client, database=db_name)
        app._mongolock_store.ensure_indexes()
        it.plain.apply(("warm",))
        counter.clear()
        assert app.tasks["integration_app.skipper"].apply(("cost", "c1", 0.0)).get() == "c1"
        assert counter.names() == ["findAndModify", "findAndModify"]
    finally:
        app._mongolock_store.close()
        app.conf.update(saved_conf)
        for k, v in saved.items():
            if v is None:
                app.__dict__.pop(k, None)
            else:
                setattr(app, k, v)
        client.drop_database(db_name)
        client.close()


# -- loss, start-up validation, shutdown ------------------------------------------------------------------


def lost_record(cluster: Cluster, key: str) -> dict[str, Any]:
    """What the app's ``lease_lost`` receiver recorded for ``key``. The lease's ``lost`` flag turns true
    before the receivers run, so a body that polls it may record that it noticed first: the receiver's
    record is waited for, not read once."""
    found = wait_for(
        lambda: cluster.db["runs"].find_one({"kind": "lost", "key": key}),
        timeout=60,
        message=f"the lease_lost record of {key}",
    )
    assert found is not None
    return found


def test_a_running_task_learns_its_lease_was_lost(cluster: Cluster) -> None:
    resource, t = tag(), tag()
    it.guarded.delay(resource, t, 30)
    wait_for(lambda: cluster.runs(t, "start"), timeout=30, message="the task to start")
    assert cluster.store.force_release(f"resource:{resource}")
    # The worker's lease watch (a change stream) sees the force release, or else the heartbeat's next renewal
    # matches nothing: lease_lost fires and current_lease().lost turns true.
    noticed = wait_for(
        lambda: cluster.runs(t, "noticed-lost"), timeout=LEASE * 3, message="the body to notice"
    )
    assert noticed
    assert "released by force" in lost_record(cluster, f"resource:{resource}")["reason"]


def test_a_force_release_from_the_cli_is_noticed_by_the_running_task_at_once(cluster: Cluster) -> None:
    """Issue 29 item 3, in a real prefork worker: the body of a run learns of an operator's force release
    (the real ``celery mongolock release --force``, another process) from its process's lease watch. Its
    renewal interval is 300 s: within this test's deadline, only the change stream can have told it."""
    from .test_cli import real_run as run_cli

    env = cluster.env(MONGOLOCK_IT_LEASE=900, MONGOLOCK_IT_HEARTBEAT=300)
    w = cluster.worker(name=f"n{tag()}@localhost", env=env, extra_args=["-Q", "nq"])
    resource, t = tag(), tag()
    key = f"resource:{resource}"
    it.guarded.apply_async((resource, t, 120), queue="nq")
    wait_for(lambda: cluster.runs(t, "start"), timeout=30, message="the task to start")
    out = run_cli(cluster.mongo_url, cluster.db_name, "release", key, "--force")
    assert out.returncode == 0, out.stderr
    wait_for(lambda: cluster.runs(t, "noticed-lost"), timeout=60, message="the body to notice")
    assert "a change stream saw it released by force" in lost_record(cluster, key)["reason"]
    assert cluster.runs(t, "end") == []  # the body stopped: it did not run on without its lease
    w.kill()


def test_worker_refuses_to_start_with_an_invalid_setting(cluster: Cluster) -> None:
    env = cluster.env(MONGOLOCK_IT_LEASE="-3")
    w = Worker(env, cluster.ready_dir, name=f"bad{tag()}@localhost")
    with pytest.raises(AssertionError, match="exited with"):
        w.start(timeout=60)
    assert "mongolock_lease_seconds" in w.log()
    w.stop()


def test_worker_says_at_start_where_the_leases_are_and_warns_if_mongodb_is_down(cluster: Cluster) -> None:
    # A healthy worker names the store (w1 was started by the fixture).
    w1 = cluster.workers[0]
    wait_for(
        lambda: "celery_mongolock: leases in" in w1.log_path.read_text(errors="replace"),
        timeout=30,
        message="the start-up line",
    )
    # A worker whose MongoDB does not answer still starts, and says so at once, without the password.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once the socket is closed
    env = cluster.env(
        MONGOLOCK_IT_MONGODB_URL=f"mongodb://admin:s3cr%40t@127.0.0.1:{port}/?serverSelectionTimeoutMS=500",
        MONGOLOCK_IT_OP_TIMEOUT="1",
    )
    w = cluster.worker(name=f"down{tag()}@localhost", env=env, extra_args=["-Q", "downq"])
    wait_for(lambda: "does not answer" in w.log(), timeout=30, message="the start-up warning")
    line = next(x for x in w.log().splitlines() if "does not answer" in x)
    assert f"127.0.0.1:{port}" in line and "s3cr" not in w.log()
    assert w.stop(timeout=60) == 0


def test_warm_shutdown_lets_the_task_finish_and_release(cluster: Cluster) -> None:
    w = cluster.worker(name=f"s{tag()}@localhost", extra_args=["-Q", "shutq"])
    resource, t = tag(), tag()
    it.guarded.apply_async((resource, t, 1.0), queue="shutq")
    wait_for(lambda: cluster.runs(t, "start"), timeout=30, message="the task to start")
    assert w.stop(timeout=60) == 0
    assert cluster.runs(t, "end")
    info = cluster.store.inspect(f"resource:{resource}")
    assert info is not None and not info.held


# -- the lease history (issue 17, part 3) -----------------------------------------------------------------


def _history_of(cluster: Cluster, key: str, task_id: str) -> Any:
    """The history entry of ``task_id``'s run on ``key`` once its worker's heartbeat wrote it."""
    wait_for(
        lambda: cluster.store.history_collection.count_documents({"k": key, "t": task_id}),
        timeout=30,
        message=f"the history of {task_id} to be written by its worker",
    )
    [entry] = [e for e in cluster.store.history(key) if e.task_id == task_id]
    return entry


def test_history_of_runs_that_waited_through_real_workers(cluster: Cluster) -> None:
    resource = tag()
    key = f"resource:{resource}"
    for task, policy in ((it.waiter, "wait"), (it.retrier, "retry")):
        lease = cluster.store.acquire(key, ttl=30)
        assert lease is not None
        res = task.delay(resource, tag(), 0.1)
        query = {"kind": "contended", "key": key, "policy": policy}

        def first_contention(q: dict[str, Any] = query) -> dict[str, Any] | None:
            found: dict[str, Any] | None = cluster.db["runs"].find_one(q)
            return found

        contended = wait_for(first_contention, timeout=30, message=f"the {policy} run to find the key held")
        assert contended is not None
        released_at = time.time()
        lease.release()
        res.get(timeout=60)
        entry = _history_of(cluster, key, res.id)
        assert entry.how == "released" and entry.task_name == task.name
        assert entry.worker in ("w1@localhost", "w2@localhost") and entry.pid and entry.host
        # It waited at least from its first contention to the release (same machine's clock, less 50 ms
        # for the server's clock reading).
        assert entry.waited_ms is not None, entry
        assert entry.waited_ms >= (released_at - contended["t"]) * 1000 - 50, (policy, entry)
        assert entry.held_seconds is not None and entry.held_seconds >= 0.1
    # A run that got its key at once waited 0.
    res = it.guarded.delay(resource, tag(), 0.1)
    res.get(timeout=60)
    assert _history_of(cluster, key, res.id).waited_ms == 0


def test_history_says_holder_died_for_a_killed_child(cluster: Cluster) -> None:
    import os
    import signal

    # A 60 s lease, so that only the parent's release can end it within the test; the parent writes the
    # history at its heartbeat's next tick (by default lease / 3 = 20 s later): every second here.
    env = cluster.env(MONGOLOCK_IT_LEASE=60, MONGOLOCK_IT_HEARTBEAT=1)
    w = cluster.worker(name=f"h{tag()}@localhost", env=env, extra_args=["-Q", "hq"])
    resource, t = tag(), tag()
    key = f"resource:{resource}"
    res = it.guarded.apply_async((resource, t, 30), queue="hq")
    start = wait_for(lambda: cluster.runs(t, "start"), timeout=30, message="the task to start")[0]
    os.kill(start["pid"], signal.SIGKILL)
    # The worker's parent releases the dead child's lease and writes its ending into the history.
    wait_for(
        lambda: cluster.store.history_collection.count_documents({"k": key, "how": "holder-died"}),
        timeout=30,
        message="the parent to record the dead child's lease",
    )
    [died] = [e for e in cluster.store.history(key) if e.fence == start["fence"]]
    assert (died.how, died.task_id, died.pid) == ("holder-died", res.id, start["pid"])
    w.kill()


# -- reentrant runs ------------------------------------------------------------------------------------


def _free(cluster: Cluster, key: str) -> bool:
    info = cluster.store.inspect(key)
    return info is None or not info.held


def test_a_body_that_holds_its_own_key_reenters_its_lease(cluster: Cluster) -> None:
    """The body's ``store.hold`` of its own key is its own lease (the same fence, no second slot), at once:
    the task's policy is Fail, so waiting for itself would have failed the run."""
    resource, t = tag(), tag()
    assert it.self_holder.delay(resource, t).get(timeout=90) == t
    [seen] = cluster.runs(t, "reentered")
    assert seen["inner_fence"] == seen["outer_fence"] == seen["fence"]
    assert (seen["depth"], seen["holds"]) == (1, 2)
    [after] = cluster.runs(t, "after-inner")
    assert after["held"] and after["holds"] == 1  # the run's lease outlives the inner hold
    wait_for(lambda: _free(cluster, f"resource:{resource}"), timeout=30, message="the key freed")
    # limit=2: the reentrant hold is the run's own slot; no second slot taken.
    tenant, t = tag(), tag()
    assert it.slot_self_holder.delay(tenant, t).get(timeout=90) == t
    [seen] = cluster.runs(t, "reentered")
    assert seen["inner_slot"] == seen["outer_slot"] is not None
    assert seen["inner_fence"] == seen["outer_fence"] and seen["slots_taken"] == 1


def test_a_keys_task_calls_singleton_functions_for_overlapping_keys_in_process(cluster: Cluster) -> None:
    """A run holding ``a`` and ``b`` calls ``one_of_them(a)`` and ``pair_of_them(b, c)`` in-process: each
    reenters the keys the run holds (the same fences) and takes only ``c``; the run still holds its own
    keys afterwards, and every key is free once it ends."""
    a, b, c, t = tag(), tag(), tag(), tag()
    out = it.pair_caller.delay(a, b, c, t).get(timeout=90)
    outer = out["outer"]
    assert out["one"] == outer[f"resource:{a}"]
    assert out["pair"][f"resource:{b}"] == outer[f"resource:{b}"]
    assert out["pair"][f"resource:{c}"] > 0 and f"resource:{c}" not in outer
    assert out["held"]
    for key in (a, b, c):
        wait_for(functools.partial(_free, cluster, f"resource:{key}"), timeout=30, message=f"{key} freed")
