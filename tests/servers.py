"""Real servers for the tests: MongoDB (env URL, Docker, or embedded), Redis and RabbitMQ."""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import socket
from collections.abc import Iterator
from typing import Any

from celery_mongolock.embedded import EmbeddedMongo
from celery_mongolock.testing import (
    RabbitMQServer,
    RedisServer,
    rabbitmq_server_binary,
    redis_server_binary,
    wait_for,
)

__all__ = [
    "NO_RABBITMQ",
    "RabbitMQServer",
    "RedisServer",
    "docker_available",
    "mongo_server",
    "rabbitmq_server_binary",
    "redis_server_binary",
    "server_past",
    "wait_for",
]

# Why the RabbitMQ tests skip here, or "" when a server is installed (.ci/run installs one).
NO_RABBITMQ = (
    ""
    if rabbitmq_server_binary()
    else "RabbitMQ is not installed (apt-get install rabbitmq-server; .ci/run installs it)"
)


def server_past(store: Any, when: _dt.datetime) -> bool:
    """Whether the MongoDB server's clock (``hello``'s ``localTime``) is past ``when`` (naive: UTC)."""
    now = store.collection.database.command("hello")["localTime"]
    return bool(now.replace(tzinfo=None) > when.replace(tzinfo=None))


def docker_available() -> tuple[bool, str]:
    """Whether a Docker engine answers ``/_ping`` (checked with a plain socket), and why not."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if not host.startswith("unix://"):
        return True, ""  # a remote engine: let testcontainers find out
    path = host[len("unix://") :]
    if not os.path.exists(path):
        return False, f"no Docker engine: {path} does not exist"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(3)
            s.connect(path)
            s.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
            answer = s.recv(64)
    except OSError as exc:
        return False, f"no Docker engine answers on {path} ({exc})"
    if b" 200 " not in answer:
        return False, f"the Docker engine on {path} did not answer /_ping with 200"
    return True, ""


@contextlib.contextmanager
def mongo_server() -> Iterator[tuple[str, str]]:
    """Yield (url, kind): MONGOLOCK_TEST_MONGODB_URL, else Docker MongoDB, else the embedded server."""
    url = os.environ.get("MONGOLOCK_TEST_MONGODB_URL")
    if url:
        yield url, "external"
        return
    ok, _why = docker_available()
    if ok and os.environ.get("MONGOLOCK_TEST_NO_DOCKER") != "1":
        from testcontainers.mongodb import MongoDbContainer

        with MongoDbContainer("mongo:7") as container:
            yield container.get_connection_url(), "docker"
        return
    with EmbeddedMongo() as server:
        yield server.url, "embedded"
