"""The test servers themselves: Redis answers; Docker-only paths skip cleanly here."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from .servers import NO_RABBITMQ, RabbitMQServer, RedisServer, docker_available


def test_redis_server_answers(redis_server: RedisServer) -> None:
    import redis

    client = redis.Redis.from_url(redis_server.url)
    try:
        assert client.ping()
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        client.close()


def test_redis_server_stops_cleanly() -> None:
    server = RedisServer().start()
    port = server.port
    server.stop()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        pass


def test_mongodb_in_docker() -> None:
    ok, why = docker_available()
    if not ok:
        pytest.skip(f"Docker-based test: {why}")
    from testcontainers.mongodb import MongoDbContainer

    from celery_mongolock import LeaseStore

    with MongoDbContainer("mongo:7") as container:
        store = LeaseStore(container.get_connection_url())
        lease = store.acquire("docker")
        assert lease is not None and lease.release()
        store.close()


@pytest.mark.skipif(bool(NO_RABBITMQ), reason=NO_RABBITMQ)
def test_rabbitmq_keeps_confirmed_messages_through_a_crash() -> None:
    """The RabbitMQ node: a durable queue's persistent message, confirmed by the broker, survives a SIGKILL
    and a restart on the same data (what the broker-fault runs rely on); a stopped node no longer listens."""
    from kombu import connection, entity

    Connection: Any = connection.Connection  # untyped
    Exchange: Any = entity.Exchange
    Queue: Any = entity.Queue

    server = RabbitMQServer().start()
    try:
        queue = Queue("survivor", Exchange("survivor"), "survivor", durable=True)
        with Connection(server.url, transport_options={"confirm_publish": True}) as conn:
            conn.Producer().publish(
                {"n": 1}, exchange=queue.exchange, routing_key="survivor", declare=[queue], delivery_mode=2
            )
        server.kill()
        server.start()
        with Connection(server.url) as conn:
            message = queue(conn.default_channel).get(no_ack=True)
            assert message is not None and message.payload == {"n": 1}
    finally:
        port = server.port
        server.stop()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        pass
