"""The broker going away for a moment (a Redis or RabbitMQ restart) while a singleton run is published again.

A contention retry and a parked duplicate are new messages: if publishing one fails, the run ends in
FAILURE although nothing was wrong with it. Celery's default publish policy gives up after about 0.6 s;
ours rides over an outage of up to about a minute. End to end, the lock-set checker's ``broker-restart``
fault (tests/test_lockcheck.py) restarts the broker under real workers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import Reject
from celery.exceptions import Retry as CeleryRetry
from kombu.exceptions import OperationalError

from celery_mongolock import singleton_task
from celery_mongolock.integration.runs import republish
from celery_mongolock.task import REPUBLISH_RETRY_POLICY

from .servers import NO_RABBITMQ, RabbitMQServer, RedisServer

pytestmark = pytest.mark.slow


@pytest.fixture(params=["redis", "rabbitmq"])
def down_broker(request: pytest.FixtureRequest) -> Iterator[RedisServer | RabbitMQServer]:
    """A persistent Redis, or a RabbitMQ node, with a port of its own, not started yet."""
    if request.param == "rabbitmq" and NO_RABBITMQ:
        pytest.skip(NO_RABBITMQ)
    server = RedisServer(persistent=True) if request.param == "redis" else RabbitMQServer()
    try:
        yield server
    finally:
        server.stop()


def _options(broker: RedisServer | RabbitMQServer) -> dict[str, Any]:
    """The app's broker settings: on RabbitMQ with publisher confirms, as docs/discussions/brokers.md says."""
    confirms = {"confirm_publish": True} if isinstance(broker, RabbitMQServer) else {}
    return {"broker_url": broker.url, "broker_connection_timeout": 1, "broker_transport_options": confirms}


def test_a_contention_retry_is_published_across_a_broker_restart(
    down_broker: RedisServer | RabbitMQServer,
) -> None:
    app = Celery("republish", set_as_current=False)
    app.conf.update(_options(down_broker))

    @singleton_task(key="resource:{resource}", app=app, name="republish.guarded", shared=False)
    def guarded(resource: str) -> str:  # pragma: no cover - never run here
        return resource

    signature = guarded.signature(("r1",), countdown=0.5, headers={"mongolock_contention_retries": 1})

    # Celery's default policy: the broker is down, the publish fails within a second.
    with pytest.raises(OperationalError):
        signature.apply_async()

    # Ours: the broker comes back while the publish is being retried, and the message gets through.
    _publish_across_restart(down_broker, lambda: republish(guarded, signature, "contention retry"))
    app.close()


def _publish_across_restart(broker: RedisServer | RabbitMQServer, publish: Callable[[], None]) -> None:
    """Publish while the broker is down and comes back 2 s later (the fault, not a wait); the message
    must then be on the queue."""
    starter = threading.Timer(2.0, broker.start)
    starter.start()
    try:
        publish()
    finally:
        starter.join()
    assert _queued(broker) == 1, "the retry was not published"


def _queued(broker: RedisServer | RabbitMQServer) -> int:
    """How many messages the ``celery`` queue holds."""
    if isinstance(broker, RedisServer):
        client = redis.Redis.from_url(broker.url)
        try:
            return int(client.llen("celery"))
        finally:
            client.close()
    from kombu import connection

    conn: Any = connection.Connection(broker.url)  # type: ignore[no-untyped-call]
    with conn:
        return int(conn.default_channel.queue_declare(queue="celery", passive=True).message_count)


def test_the_republish_policy_outlasts_a_restart() -> None:
    """Pure arithmetic: kombu sleeps interval_start, then + interval_step each time, up to interval_max."""
    p = REPUBLISH_RETRY_POLICY
    waits, wait = [], p["interval_start"]
    for _ in range(int(p["max_retries"])):
        waits.append(min(wait, p["interval_max"]))
        wait += p["interval_step"]
    assert 45 <= sum(waits) <= 90, sum(waits)


def test_a_body_retry_is_published_across_a_broker_restart(down_broker: RedisServer | RabbitMQServer) -> None:
    """``self.retry()`` in a singleton body while the broker restarts: Celery's own ``Task.retry`` gives up
    within a second and rejects the message without requeueing it (with ``acks_late`` the task is gone,
    its state PENDING or RETRY: how the lock-set checker lost tasks). A singleton task's retry rides over
    the restart."""
    app = Celery("retry_restart", set_as_current=False)
    app.conf.update(_options(down_broker))

    @app.task(name="retry_restart.plain", bind=True, shared=False)
    def plain(self: Any) -> None:  # pragma: no cover - never run here
        pass

    @singleton_task(key="resource", app=app, name="retry_restart.guarded", bind=True, shared=False)
    def guarded(self: Any) -> None:  # pragma: no cover - never run here
        pass

    def as_worker(task: Any) -> None:
        task.push_request(
            id="t-1", args=(), kwargs={}, called_directly=False, is_eager=False, retries=0,
            delivery_info={"routing_key": "celery", "exchange": ""}, headers={},
        )  # fmt: skip

    # Celery's own Task.retry: the broker is down, the retry is dropped and the message rejected for good.
    as_worker(plain)
    with pytest.raises(Reject) as rejected:
        plain.retry(countdown=1)
    assert rejected.value.requeue is False
    plain.pop_request()

    # A singleton task's: the broker comes back while the publish is retried, and the retry gets through.
    as_worker(guarded)

    def retry() -> None:
        with pytest.raises(CeleryRetry):
            guarded.retry(countdown=1)

    try:
        _publish_across_restart(down_broker, retry)
    finally:
        guarded.pop_request()
    app.close()
