"""The test servers themselves: Redis answers; Docker-only paths skip cleanly here."""

from __future__ import annotations

import socket

import pytest

from .servers import RedisServer, docker_available


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
