"""The broker going away for a moment (a Redis restart) while a singleton run is published again.

A contention retry and a parked duplicate are new messages: if publishing one fails, the run ends in
FAILURE although nothing was wrong with it. Celery's default publish policy gives up after about 0.6 s;
ours rides over an outage of up to about a minute. End to end, the lock-set checker's ``broker-restart``
fault (tests/test_lockcheck.py) restarts the broker under real workers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import redis
from celery import Celery
from kombu.exceptions import OperationalError

from celery_mongolock import singleton_task
from celery_mongolock.task import REPUBLISH_RETRY_POLICY

from .servers import RedisServer

pytestmark = pytest.mark.slow


@pytest.fixture
def down_broker() -> Iterator[RedisServer]:
    """A persistent Redis with a port of its own, not started yet."""
    server = RedisServer(persistent=True)
    try:
        yield server
    finally:
        server.stop()


def test_a_contention_retry_is_published_across_a_broker_restart(down_broker: RedisServer) -> None:
    app = Celery("republish", set_as_current=False)
    app.conf.update(broker_url=down_broker.url, broker_connection_timeout=1)

    @singleton_task(key="resource:{resource}", app=app, name="republish.guarded")
    def guarded(resource: str) -> str:  # pragma: no cover - never run here
        return resource

    signature = guarded.signature(("r1",), countdown=0.5, headers={"mongolock_contention_retries": 1})

    # Celery's default policy: the broker is down, the publish fails within a second.
    with pytest.raises(OperationalError):
        signature.apply_async()

    # Ours: the broker comes back while the publish is being retried, and the message gets through.
    starter = threading.Timer(2.0, down_broker.start)
    starter.start()
    try:
        guarded._republish(signature, "contention retry")
    finally:
        starter.join()
    client = redis.Redis.from_url(down_broker.url)
    try:
        assert client.llen("celery") == 1, "the retry was not published"
    finally:
        client.close()
    app.close()


def test_the_republish_policy_outlasts_a_restart() -> None:
    """Pure arithmetic: kombu sleeps interval_start, then + interval_step each time, up to interval_max."""
    p = REPUBLISH_RETRY_POLICY
    waits, wait = [], p["interval_start"]
    for _ in range(int(p["max_retries"])):
        waits.append(min(wait, p["interval_max"]))
        wait += p["interval_step"]
    assert 45 <= sum(waits) <= 90, sum(waits)
