"""``keys=(...)``: a run that holds several keys at once, with real ``celery worker`` processes (prefork),
a real Redis broker and the MongoDB-compatible server, and the declaration checks (no server)."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.result import AsyncResult

from celery_mongolock import ConfigurationError, LeaseSet, Replace, singleton_task

from . import integration_app as it
from .servers import RedisServer
from .test_integration import Cluster

LEASE = 3.0


def _app() -> Celery:
    return Celery(f"k{uuid.uuid4().hex[:6]}", set_as_current=False)


def test_the_keys_of_a_call_are_sorted_without_repeats() -> None:
    @singleton_task(app=_app(), keys=("group:{dst}", "group:{src}"))
    def merge(src: int, dst: int) -> None: ...

    assert merge.mongolock_keys_for(2, 1) == ["group:1", "group:2"]
    assert merge.mongolock_keys_for(3, 3) == ["group:3"]


def test_keys_with_a_debounced_replace_are_accepted() -> None:
    """``Replace(debounce=...)`` with ``keys=``: the debounce per set of keys (it was refused before)."""

    @singleton_task(app=_app(), keys=("group:{src}", "group:{dst}"), on_contention=Replace(debounce=2))
    def merge(src: int, dst: int) -> None: ...

    assert merge.mongolock_keys_for(1, 2) == ["group:1", "group:2"]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"keys": "group:{src}"}, "keys= must be a non-empty list or tuple"),
        ({"keys": ()}, "keys= must be a non-empty list or tuple"),
        ({"keys": ("group:{src}",), "key": "g"}, "give key= or keys=, not both"),
        ({"keys": ("group:{src}",), "limit": {"group:{sr}": 3}}, "did you mean 'group:{src}'"),
        ({"keys": ("group:{source}",)}, "'source'"),
    ],
)
def test_bad_keys_are_refused_at_declaration(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):

        @singleton_task(app=_app(), **options)
        def merge(src: int, dst: int) -> None: ...


# -- keys from mongolock_task_policies ------------------------------------------------------------------
def test_keys_from_the_settings_replace_the_decorator_s_key(mongo_url: str) -> None:
    from celery_mongolock import current_lease
    from celery_mongolock.config import get_store
    from celery_mongolock.integration.task import _check_task_policies

    app = _app()
    database = f"keys_setting_{uuid.uuid4().hex[:8]}"
    app.conf.update(
        mongolock_url=mongo_url,
        mongolock_database=database,
        mongolock_task_policies={"proj.merge_s": {"keys": ["group:{src}", "group:{dst}"]}},
    )
    seen: list[Any] = []

    @singleton_task(app=app, key="group:{src}", name="proj.merge_s", on_contention="skip")
    def merge(src: int, dst: int) -> str:
        seen.append(current_lease())
        return "merged"

    @singleton_task(app=app, keys=("a:{x}",), name="proj.declared_s")
    def declared(x: int) -> None: ...

    app.finalize()
    assert _check_task_policies(app) == []
    # Rendered against the task's signature, like the decorator's keys=: by name or position, sorted.
    assert merge.mongolock_keys_for(2, dst=1) == ["group:1", "group:2"]
    assert declared.mongolock_keys_for(5) == ["a:5"]  # no setting: the decorator's keys
    # A real run (the embedded server): the body holds both keys, and a key held elsewhere skips it.
    assert merge(7, 8) == "merged"
    [lease_set] = seen
    assert isinstance(lease_set, LeaseSet) and sorted(lease_set.fences) == ["group:7", "group:8"]
    store = get_store(app)
    held = store.acquire("group:8", 30)
    assert held is not None
    result = merge(7, 8)
    assert result["mongolock"] == "skipped" and len(seen) == 1
    given_back = store.inspect("group:7")  # taken first (sorted order), given back when group:8 was held
    assert given_back is not None and not given_back.held
    held.release()
    store.client.drop_database(database)


@pytest.mark.parametrize(
    ("policy", "decorator", "match"),
    [
        ({"keys": "group:{src}"}, {}, r"\['keys'\]: keys= must be a non-empty list or tuple"),
        ({"keys": []}, {}, r"\['keys'\]: keys= must be a non-empty list or tuple"),
        ({"keys": ["group:{source}"]}, {}, "'source'"),
    ],
)
def test_bad_keys_in_the_settings_are_refused_at_start_up(
    policy: dict[str, Any], decorator: dict[str, Any], match: str
) -> None:
    from celery_mongolock.config import get_settings
    from celery_mongolock.integration.task import _check_task_policies

    app = _app()
    name = f"proj.merge_{uuid.uuid4().hex[:8]}"
    app.conf.mongolock_task_policies = {name: policy}

    def start_up() -> None:
        get_settings(app)  # the settings alone: shape, and with the setting's own policy and limit

        @singleton_task(app=app, key="group:{src}", name=name, **decorator)
        def merge(src: int, dst: int) -> None: ...

        app.finalize()
        _check_task_policies(app)  # a worker's start-up: against the task's own policy and signature

    with pytest.raises(ConfigurationError, match=match):
        start_up()


@pytest.mark.parametrize(
    ("policy", "decorator"),
    [
        ({"keys": ["group:{src}", "tenant:{dst}"], "limit": 3, "on_contention": "replace"}, {}),
        (
            {"keys": ["group:{src}", "tenant:{dst}"], "limit": {"tenant:{dst}": 3}},
            {"on_contention": "replace"},
        ),
    ],
)
def test_a_limit_with_replace_and_keys_in_the_settings_is_accepted_at_start_up(
    policy: dict[str, Any], decorator: dict[str, Any]
) -> None:
    from celery_mongolock.config import get_settings
    from celery_mongolock.integration.task import _check_task_policies

    app = _app()
    name = f"proj.merge_{uuid.uuid4().hex[:8]}"
    app.conf.mongolock_task_policies = {name: policy}
    get_settings(app)

    @singleton_task(app=app, key="group:{src}", name=name, **decorator)
    def merge(src: int, dst: int) -> None: ...

    app.finalize()
    _check_task_policies(app)


@pytest.fixture(scope="module")
def cluster(
    redis_server: RedisServer, mongo_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    db_name = f"mongolock_keys_{uuid.uuid4().hex[:8]}"
    c = Cluster(redis_server.url, mongo_url, db_name, tmp_path_factory.mktemp("kworkers"))
    it.app.conf.update(
        broker_url=redis_server.url,
        result_backend=redis_server.url,
        mongolock_url=mongo_url,
        mongolock_database=db_name,
        mongolock_lease_seconds=LEASE,
    )
    for attr in ("_mongolock_settings", "_mongolock_store"):
        it.app.__dict__.pop(attr, None)
    c.worker(name="k1@localhost", concurrency=3)
    c.worker(name="k2@localhost", concurrency=3)
    try:
        yield c
    finally:
        c.close()


@pytest.mark.slow
def test_overlapping_multi_key_runs_never_overlap_on_a_key_and_never_deadlock(cluster: Cluster) -> None:
    a, b, c = (uuid.uuid4().hex[:8] for _ in range(3))
    # Runs naming overlapping keys in different orders, and single-key runs on the same keys.
    sends = [(a, b), (b, a), (b, c), (c, a), (a, b), (c, b)]
    tags = [uuid.uuid4().hex[:10] for _ in sends]
    results = [it.merge.delay(src, dst, t, 0.2) for (src, dst), t in zip(sends, tags, strict=True)]
    single_tags = [uuid.uuid4().hex[:10] for _ in range(3)]
    singles = [it.guarded.delay(r, t, 0.2) for r, t in zip((a, b, c), single_tags, strict=True)]
    for r, (src, dst) in zip(results, sends, strict=True):
        assert r.get(timeout=120) == sorted([f"resource:{src}", f"resource:{dst}"])
    for r in singles:
        r.get(timeout=120)
    holds: dict[str, list[tuple[float, float]]] = {}
    for t in tags:
        [start] = cluster.runs(t, "start")
        [end] = cluster.runs(t, "end")
        assert sorted(start["fences"]) == start["keys"], "the body ran holding every key"
        for key in start["keys"]:
            holds.setdefault(key, []).append((start["mono"], end["mono"]))
    for t in single_tags:
        [start] = cluster.runs(t, "start")
        [end] = cluster.runs(t, "end")
        holds.setdefault(str(start["key"]), []).append((start["mono"], end["mono"]))
    for key, spans in holds.items():
        for (_, e1), (s2, _) in itertools.pairwise(sorted(spans)):
            assert e1 <= s2, f"two runs held {key} at once"


def test_a_lease_set_is_a_lease() -> None:
    assert issubclass(LeaseSet, object) and LeaseSet.__mro__[1].__name__ == "Lease"


def test_a_limit_per_key_in_the_settings_applies_to_the_decorator_s_keys() -> None:
    """The documented setting ``{"proj.upload": {"limit": {"tenant:{tenant}": 5}}}`` for a task whose
    ``keys=`` are in its decorator (before: refused at start-up as if the task had one ``key=``)."""
    from celery_mongolock.config import get_settings
    from celery_mongolock.integration.task import _check_task_policies

    app = _app()
    name = f"proj.upload_{uuid.uuid4().hex[:8]}"
    app.conf.mongolock_task_policies = {name: {"limit": {"tenant:{tenant}": 5}}}
    get_settings(app)  # the settings alone, before the task is declared

    @singleton_task(app=app, keys=("tenant:{tenant}", "group:{group}"), name=name, on_contention="queue")
    def upload(tenant: int, group: int) -> None: ...

    app.finalize()
    assert _check_task_policies(app) == []
    options = upload._options()
    limits = dict(zip(options.keys or (), options.key_limits or (), strict=True))
    assert limits == {"tenant:{tenant}": 5, "group:{group}": None}


@pytest.mark.parametrize(
    ("limit", "match"),
    [
        ({"tenant:{tenat}": 5}, r"\['limit'\]: limit= names key specs that are not in keys="),
        ({"tenant:{tenant}": 0}, r"\['limit'\]: .*from 1 to 1000"),
    ],
)
def test_a_bad_limit_per_key_in_the_settings_names_the_setting(limit: dict[str, int], match: str) -> None:
    from celery_mongolock.config import get_settings
    from celery_mongolock.integration.task import _check_task_policies

    app = _app()
    name = f"proj.upload_{uuid.uuid4().hex[:8]}"
    app.conf.mongolock_task_policies = {name: {"limit": limit}}

    def start_up() -> None:
        get_settings(app)

        @singleton_task(app=app, keys=("tenant:{tenant}", "group:{group}"), name=name, on_contention="queue")
        def upload(tenant: int, group: int) -> None: ...

        app.finalize()
        _check_task_policies(app)

    with pytest.raises(ConfigurationError, match=match):
        start_up()


@pytest.mark.slow
def test_a_run_holds_none_of_its_keys_while_it_waits_for_one(cluster: Cluster) -> None:
    from .servers import wait_for

    suffix = uuid.uuid4().hex[:8]
    a, b = f"a{suffix}", f"b{suffix}"  # a sorts first: each attempt takes a, then finds b held
    blocker = cluster.store.acquire(f"resource:{b}", 60)
    assert blocker is not None
    tag = uuid.uuid4().hex[:10]
    result = it.merge.delay(a, b, tag, 0.1)
    wait_for(
        lambda: len(list(cluster.db["runs"].find({"kind": "contended", "key": f"resource:{b}"}))) >= 3,
        timeout=60,
        message="three attempts of the merge to find b held",
    )
    held_a = cluster.store.inspect(f"resource:{a}")
    blocker.release()
    assert result.get(timeout=60) == sorted([f"resource:{a}", f"resource:{b}"])
    ends = (cluster.store.collection.find_one({"_id": f"resource:{a}"}) or {}).get("ends") or []
    attempts = [e for e in ends if e.get("t") == result.id][:-1]  # every attempt before the run itself
    assert len(attempts) >= 2
    for attempt in attempts:  # a was given back within the attempt that found b held
        assert (attempt["e"] - attempt["a"]).total_seconds() < 1.0, attempt
    assert held_a is None or not held_a.held or held_a.holder.get("task_id") == result.id


def _spans(cluster: Cluster, tags: list[str]) -> dict[str, list[tuple[float, float, str]]]:
    """Per key, the (start, end, tag) of every body that held it."""
    holds: dict[str, list[tuple[float, float, str]]] = {}
    for t in tags:
        [start] = cluster.runs(t, "start")
        [end] = cluster.runs(t, "end")
        for key in start.get("keys") or [start["key"]]:
            holds.setdefault(str(key), []).append((start["mono"], end["mono"], t))
    return holds


def _no_overlap(holds: dict[str, list[tuple[float, float, str]]]) -> None:
    for key, spans in holds.items():
        for (_, e1, t1), (s2, _, t2) in itertools.pairwise(sorted(spans)):
            assert e1 <= s2, f"{t1} and {t2} held {key} at once"


@pytest.mark.slow
def test_queued_multi_key_runs_in_both_orders_all_run_never_overlap_and_never_deadlock(
    cluster: Cluster,
) -> None:
    a, b, c = (uuid.uuid4().hex[:8] for _ in range(3))
    sends = [(a, b), (b, a), (b, c), (c, a), (a, b), (c, b), (a, c)]
    tags = [uuid.uuid4().hex[:10] for _ in sends]
    results = [it.merge_queued.delay(src, dst, t, 0.2) for (src, dst), t in zip(sends, tags, strict=True)]
    single_tags = [uuid.uuid4().hex[:10] for _ in range(3)]
    singles = [it.queued.delay(r, t, 0.2) for r, t in zip((a, b, c), single_tags, strict=True)]
    for r, (src, dst) in zip(results, sends, strict=True):
        assert r.get(timeout=120) == sorted([f"resource:{src}", f"resource:{dst}"])
    assert [r.get(timeout=120) for r in singles] == single_tags
    for t in tags:
        [start] = cluster.runs(t, "start")
        assert sorted(start["fences"]) == start["keys"], "the body ran holding every key"
    _no_overlap(_spans(cluster, tags + single_tags))
    for r in (a, b, c):
        info = cluster.store.inspect(f"resource:{r}")
        assert info is None or not (info.held or info.parked or info.handoff), info


@pytest.mark.slow
def test_a_queued_multi_key_run_keeps_its_place_on_each_key(cluster: Cluster) -> None:
    from .servers import wait_for

    suffix = uuid.uuid4().hex[:8]
    a, b = f"a{suffix}", f"b{suffix}"
    first = uuid.uuid4().hex[:10]
    r_first = it.queued.delay(b, first, 2.0)  # holds b for a while
    wait_for(lambda: cluster.runs(first, "start"), timeout=60, message="the run on b to start")
    merge_tag = uuid.uuid4().hex[:10]
    r_merge = it.merge_queued.delay(a, b, merge_tag, 0.3)

    def waiting() -> bool:
        doc_a = cluster.store.collection.find_one({"_id": f"resource:{a}"}) or {}
        doc_b = cluster.store.collection.find_one({"_id": f"resource:{b}"}) or {}
        return (doc_a.get("ho") or {}).get("t") == r_merge.id and r_merge.id in [
            e["t"] for e in doc_b.get("q") or []
        ]

    wait_for(waiting, timeout=60, message="the merge to reserve a and park on b")
    # Runs sent later, on either key, wait behind it: a is reserved for it, b has it first in line.
    later = [uuid.uuid4().hex[:10] for _ in range(4)]
    r_later = [it.queued.delay(k, t, 0.1) for k, t in zip((a, b, a, b), later, strict=True)]
    assert r_first.get(timeout=60) == first
    assert r_merge.get(timeout=60) == sorted([f"resource:{a}", f"resource:{b}"])
    assert [r.get(timeout=60) for r in r_later] == later
    [merge_start] = cluster.runs(merge_tag, "start")
    [merge_end] = cluster.runs(merge_tag, "end")
    for t in later:
        [start] = cluster.runs(t, "start")
        assert start["mono"] >= merge_end["mono"], f"{t} ran before the merge sent before it"
    assert not cluster.runs(merge_tag, "start")[1:]
    assert merge_start["mono"] >= cluster.runs(first, "end")[0]["mono"]


@pytest.mark.slow
def test_a_queued_multi_key_run_past_its_timeout_fails_and_frees_its_reservations(cluster: Cluster) -> None:
    from celery_mongolock import QueueTimeout

    suffix = uuid.uuid4().hex[:8]
    a, b = f"a{suffix}", f"b{suffix}"
    blocker = cluster.store.acquire(f"resource:{b}", 60)
    assert blocker is not None
    result = it.merge_queued_briefly.delay(a, b, uuid.uuid4().hex[:10], 0.1)
    with pytest.raises(QueueTimeout):
        result.get(timeout=60)
    # Its reservation of a ends with it (at most a lease later): a run on a goes through.
    after = uuid.uuid4().hex[:10]
    assert it.queued.delay(a, after, 0.05).get(timeout=60) == after
    blocker.release()
    doc_b = cluster.store.collection.find_one({"_id": f"resource:{b}"}) or {}
    assert result.id not in [e["t"] for e in doc_b.get("q") or []]


@pytest.mark.slow
def test_a_queued_multi_key_run_whose_worker_died_between_its_admits_still_runs(cluster: Cluster) -> None:
    """Its entry is parked on one key only (its worker died before it took the other, and its message
    did not come back): once its reservation there expires unclaimed, the worker that hands it again
    publishes its message as a new delivery, which completes its places and runs it."""
    from kombu.serialization import dumps

    from celery_mongolock.integration import handoff as _queue

    suffix = uuid.uuid4().hex[:8]
    a, b = f"a{suffix}", f"b{suffix}"
    keys = sorted([f"resource:{a}", f"resource:{b}"])
    blocker = cluster.store.acquire(f"resource:{b}", 60)
    assert blocker is not None
    tag = uuid.uuid4().hex[:10]
    task_id = uuid.uuid4().hex
    stamp = _queue.send_stamp()
    sig = it.merge_queued.s(a, b, tag, 0.1).set(task_id=task_id, headers={_queue.SENT_HEADER: stamp})
    content_type, encoding, body = dumps(dict(sig), serializer="json")  # type: ignore[no-untyped-call]
    run = f"{task_id}/0"
    entry = {
        "id": run,
        "t": task_id,
        "n": it.merge_queued.name,
        "r": "0",
        "s": stamp,
        "src": "test",
        "th": "skip",
        "ks": keys,
        "tk": _queue.keys_token(run, keys),
        "m": body if isinstance(body, bytes) else body.encode(encoding),
        "ct": content_type,
        "ce": encoding,
    }
    _, doc = cluster.store.admit(f"resource:{b}", entry, ttl=LEASE)
    assert doc["lo"] == "parked"
    blocker.release()  # b is handed to it: a reservation, while it is missing from a
    assert AsyncResult(task_id, app=it.app).get(timeout=90) == keys
    [start] = cluster.runs(tag, "start")
    assert sorted(start["fences"]) == keys


def test_replace_with_keys_is_accepted_from_the_decorator_and_the_settings() -> None:
    from celery_mongolock.config import get_settings
    from celery_mongolock.integration.task import _check_task_policies

    @singleton_task(app=_app(), keys=("group:{src}", "group:{dst}"), on_contention="replace")
    def merge(src: int, dst: int) -> None: ...

    assert merge.mongolock_keys_for(2, 1) == ["group:1", "group:2"]
    app = _app()
    name = f"proj.merge_{uuid.uuid4().hex[:8]}"
    app.conf.mongolock_task_policies = {
        name: {"keys": ["group:{src}", "group:{dst}"], "on_contention": {"policy": "replace", "timeout": 60}}
    }
    get_settings(app)

    @singleton_task(app=app, key="group:{src}", name=name)
    def merge2(src: int, dst: int) -> None: ...

    app.finalize()
    _check_task_policies(app)
    assert merge2.mongolock_keys_for(3, 1) == ["group:1", "group:3"]


@pytest.mark.slow
def test_a_contention_retry_of_a_multi_key_attempt_that_ran_in_another_line_never_runs_again(
    cluster: Cluster,
) -> None:
    """Issue 32: a message the broker delivered again after its several-keys run had published a
    contention retry starts a second line of retries for one attempt. Once a run of either line has run
    its body and released the keys, the other line's retries (and copies) are copies of that run: the
    acquire refuses the key in the same command, and the task ends ``already-ran``, never a second body.
    An attempt that only took a key and gave it back (it found the other held) is not remembered as over:
    its contention retry runs."""
    from celery_mongolock.integration import task as task_mod

    suffix = uuid.uuid4().hex[:8]
    a, b = f"a{suffix}", f"b{suffix}"
    keys = [f"resource:{a}", f"resource:{b}"]
    ran_id, copy_id, unrun_id = (str(uuid.uuid4()) for _ in range(3))

    def info(task_id: str) -> dict[str, Any]:
        return {"task_id": task_id, "task_name": it.merge.name, "delivery": "0.0", "keys": keys}

    for task_id in (ran_id, copy_id):  # attempt 0 ran its body in the other line and released both keys
        leases = [cluster.store.acquire(k, 30, info=info(task_id)) for k in keys]
        assert all(lease is not None and lease.release() for lease in leases)
    # unrun_id's attempt took a, found b held and gave a back: it never ran.
    taken = cluster.store.acquire(keys[0], 30, info=info(unrun_id))
    assert taken is not None and cluster.store.give_back(taken)
    tags = {tid: uuid.uuid4().hex[:10] for tid in (ran_id, copy_id, unrun_id)}
    retry = {task_mod.CONTENTION_HEADER: 1}
    results = {
        ran_id: it.merge.apply_async((a, b, tags[ran_id], 0.05), task_id=ran_id, headers=retry),
        # a parked copy of the other line's run (the redelivered line, looked at again)
        copy_id: it.merge.apply_async(
            (a, b, tags[copy_id], 0.05), task_id=copy_id, headers={task_mod.DUPLICATE_HEADER: 1}
        ),
        unrun_id: it.merge.apply_async((a, b, tags[unrun_id], 0.05), task_id=unrun_id, headers=retry),
    }
    for task_id in (ran_id, copy_id):
        result = results[task_id].get(timeout=60)
        assert isinstance(result, dict), f"the body ran a second time: {result!r}"
        assert result["mongolock"] == "already-ran" and result["key"] == keys[0]
        assert cluster.runs(tags[task_id]) == []
    assert results[unrun_id].get(timeout=60) == keys
    assert len(cluster.runs(tags[unrun_id], "start")) == 1
