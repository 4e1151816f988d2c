"""``handoff.publish_patiently`` (contention retries, republished runs) on a real Redis broker: a pooled
channel that a broker restart left without its connection (kombu's Redis transport then raises
``AttributeError`` outside its own retry; the lock-set checker lost a contention retry to it) does not
lose the message: it is published again on a connection of its own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_mongolock.integration.handoff import publish_patiently

from .servers import RedisServer

QUEUE = "patient-publish"


@pytest.fixture
def app(redis_server: RedisServer) -> Iterator[Celery]:
    app = Celery("patient", broker=redis_server.url, set_as_current=False)
    app.conf.broker_connection_retry_on_startup = True
    # A queue of its own: the session's Redis is shared with other tests of this process (ci of stop 65:
    # a message of another test in ``celery`` counted 2 where 1 was published here).
    app.conf.task_default_queue = QUEUE

    @app.task(name="patient.noop")
    def noop(i: int) -> None:  # pragma: no cover - never run: the test reads the broker's queue
        """Published only."""

    yield app
    app.close()


def queued(redis_server: RedisServer) -> int:
    return int(redis.Redis.from_url(redis_server.url).llen(QUEUE))


def test_a_pooled_channel_left_without_its_connection_does_not_lose_the_message(
    app: Celery, redis_server: RedisServer
) -> None:
    task: Any = app.tasks["patient.noop"]
    publish_patiently(app, task.s(1))
    assert queued(redis_server) == 1
    with app.producer_or_acquire() as producer:  # what a broker restart left in this process's pool
        producer.channel.connection = None
    publish_patiently(app, task.s(2))
    assert queued(redis_server) == 2
