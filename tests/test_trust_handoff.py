"""A parked run's stored message is not trusted as is: with a real ``celery worker`` (prefork), Redis and
the MongoDB-compatible server, parked entries rewritten in the lease collection (a message of another
task, arguments that render another key, a pickle payload) are refused at handoff: never published, never
run, never unpickled, dropped from the queue with a failure result and a history record, and the next
parked run gets the key. Both without and with ``mongolock_signing_key`` (then the rewritten entries fail
their signature, and the untouched one, signed by the worker that parked it, passes it)."""

from __future__ import annotations

import functools
import pathlib
import pickle
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery.result import AsyncResult
from kombu.serialization import dumps

from . import integration_app as it
from .servers import RedisServer, wait_for
from .test_integration import Cluster

pytestmark = pytest.mark.slow


SIGNING_KEY = "trust-handoff-test-signing-key"


@pytest.fixture(scope="module", params=["unsigned", "signed"])
def cluster(
    request: pytest.FixtureRequest,
    redis_server: RedisServer,
    mongo_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cluster]:
    db_name = f"mongolock_trust_{uuid.uuid4().hex[:8]}"
    c = Cluster(redis_server.url, mongo_url, db_name, tmp_path_factory.mktemp("trustworkers"))
    signing = SIGNING_KEY if request.param == "signed" else None
    it.app.conf.update(
        broker_url=redis_server.url,
        result_backend=redis_server.url,
        mongolock_url=mongo_url,
        mongolock_database=db_name,
        mongolock_signing_key=signing,
    )
    for attr in ("_mongolock_settings", "_mongolock_store"):
        it.app.__dict__.pop(attr, None)
    # (The test rewrites parked entries in the lease document: a window that holds all of them, none
    # spilled; a spilled run's entry is checked the same way once it is back in the document.)
    window = {"MONGOLOCK_IT_PARKED_WINDOW": "32"}
    env = c.env(MONGOLOCK_IT_SIGNING_KEY=signing, **window) if signing else c.env(**window)
    c.worker(name=f"trust-{request.param}@localhost", env=env)
    try:
        yield c
    finally:
        c.close()
        it.app.conf.mongolock_signing_key = None
        it.app.__dict__.pop("_mongolock_settings", None)


def tag() -> str:
    return uuid.uuid4().hex[:10]


class _Touch:
    """Unpickling this creates a file: the proof that a worker unpickled bytes from the database."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (pathlib.Path.touch, (self.path,))


def _failed(result: AsyncResult) -> bool:
    return bool(result.state == "FAILURE")


def message(name: str, task_id: str, *args: Any) -> dict[str, Any]:
    body = dict(it.app.signature(name, args=args, task_id=task_id))
    content_type, encoding, data = dumps(body, serializer="json")  # type: ignore[no-untyped-call]
    return {"m": data.encode(encoding) if isinstance(data, str) else data, "ct": content_type, "ce": encoding}


def test_rewritten_parked_entries_are_refused_and_the_queue_moves_on(
    cluster: Cluster, tmp_path: pathlib.Path
) -> None:
    resource, other = tag(), tag()
    key = f"resource:{resource}"
    # The test holds the key itself (a bare lease), so the runs stay parked for as long as it takes to
    # rewrite them, on a machine of any speed.
    held = cluster.store.acquire(key, ttl=120)
    assert held is not None
    tags = [tag() for _ in range(4)]
    results = [it.queued.delay(resource, t, 0.05) for t in tags]
    ids = [r.id for r in results]
    collection = cluster.store.collection
    wait_for(
        lambda: [e["t"] for e in (collection.find_one({"_id": key}) or {}).get("q") or []] == ids,
        timeout=60,
        message="the 4 runs to be parked in send order",
    )
    parked = (collection.find_one({"_id": key}) or {}).get("q") or []
    signed = bool(it.app.conf.mongolock_signing_key)
    assert all(("sg" in entry) is signed for entry in parked), "the worker signs parked runs iff it has a key"
    marker = tmp_path / "unpickled"
    rewrites = {
        # a message of a task that is not a singleton task (same task id: it would overwrite its result)
        0: {"n": "integration_app.plain", **message("integration_app.plain", ids[0], "x")},
        # a message of the same task whose arguments render another key
        1: message("integration_app.queued", ids[1], other, tags[1], 0.05),
        # a pickle payload, for a task that writes JSON
        2: {"m": pickle.dumps(_Touch(marker)), "ct": "application/x-python-serialize", "ce": "binary"},
    }
    for index, fields in rewrites.items():
        update = {f"q.{index}.{name}": value for name, value in fields.items()}
        done = collection.update_one({"_id": key, f"q.{index}.t": ids[index]}, {"$set": update})
        assert done.modified_count == 1
    assert held.release()  # hands the key to the oldest parked run (a worker's sweeper publishes it)

    assert results[3].get(timeout=90) == tags[3]  # the last one, untouched, ran
    for r in results[:3]:
        state = AsyncResult(r.id, app=it.app)
        wait_for(functools.partial(_failed, state), timeout=60, message="the refused run's failure")
        failure = AsyncResult(r.id, app=it.app).result
        assert type(failure).__name__ == "UntrustedMessage", failure
        assert f"the parked run's stored message on {key!r} was refused at handoff" in str(failure)
    assert not cluster.runs(tags[1], "start") and not cluster.runs(tags[0], "start")
    assert not cluster.db["runs"].find_one({"key": f"resource:{other}"})
    assert not marker.exists(), "a worker unpickled a message from the database"
    assert not (collection.find_one({"_id": key}) or {}).get("q")

    def refused() -> list[str]:
        return sorted(str(e.task_id) for e in cluster.store.history(key) if e.how == "refused")

    wait_for(
        lambda: refused() == sorted(ids[:3]),
        timeout=60,
        message="a history record of each refused run",
    )
