"""Start and stop the embedded MongoDB-compatible server (SecantusDB) for development, demos and tests.

SecantusDB (PyPI ``secantusdb``, GPL-2.0) is a MongoDB-compatible server on WiredTiger that presents a
one-node replica set. It runs as a *separate process*; the library never imports it. Install it with
``pip install 'celery-mongolock[embedded]'``.

From Python::

    with EmbeddedMongo() as server:
        store = LeaseStore(server.url)

From a shell: ``python -m celery_mongolock.embedded`` prints the URL and runs until Ctrl-C.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

__all__ = ["EmbeddedMongo", "EmbeddedMongoError", "find_free_port", "main"]

from celery_mongolock.ops.server_patches import LAUNCH

_RUNNING: weakref.WeakSet[EmbeddedMongo] = weakref.WeakSet()


class EmbeddedMongoError(RuntimeError):
    """The embedded server is not installed, did not start, or died."""


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As servers do: a port in TIME_WAIT after our own restart is free; one with a listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _python_with_secantus() -> str:
    """The interpreter that can run SecantusDB: ours if it has it installed."""
    import importlib.util

    if importlib.util.find_spec("secantus") is not None:
        return sys.executable
    raise EmbeddedMongoError(
        "the embedded MongoDB-compatible server is not installed: pip install 'celery-mongolock[embedded]'"
    )


class EmbeddedMongo:
    """One SecantusDB server process on a free loopback port.

    ``storage_path=None`` keeps data in memory (a temporary directory removed on stop); pass a directory
    to keep data across restarts (``restart()`` reuses the same port and directory). ``extra_args`` are
    passed to the server (``--tls-cert-file ...``); ``url_options`` are added to ``url``
    (``{"tls": "true", "tlsCAFile": ca}``).
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        storage_path: str | os.PathLike[str] | None = None,
        auth: bool = False,
        enable_test_commands: bool = False,
        extra_args: Sequence[str] = (),
        url_options: Mapping[str, str] | None = None,
        startup_timeout: float = 60.0,
        log_path: str | os.PathLike[str] | None = None,
        die_with_parent: bool = False,
    ) -> None:
        self.host = host
        self.port = port or find_free_port(host)
        self.storage_path = None if storage_path is None else Path(storage_path)
        self.auth = auth
        self.enable_test_commands = enable_test_commands
        self.extra_args = list(extra_args)
        self.url_options = dict(url_options or {})
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else None
        #: Linux: the server gets SIGTERM when the thread that started it dies, even by SIGKILL (the
        #: ``python -m celery_mongolock.embedded`` command: a killed command leaves no server behind).
        self.die_with_parent = die_with_parent
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._tmp_log: str | None = None

    @property
    def url(self) -> str:
        """The URL to connect with, including ``url_options`` (e.g. ``tls``/``tlsCAFile`` for a server
        started with TLS through ``extra_args``); the readiness check connects with it too."""
        query = "".join(f"&{name}={quote(str(value), safe='/')}" for name, value in self.url_options.items())
        return f"mongodb://{self.host}:{self.port}/?directConnection=true{query}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        storage = ":memory:" if self.storage_path is None else str(self.storage_path)
        cmd = [_python_with_secantus(), "-c", LAUNCH, "--host", self.host, "--port", str(self.port)]
        cmd += ["--storage-path", storage, "--log-level", "WARNING"]
        if self.auth:
            cmd.append("--auth")
        if self.enable_test_commands:
            cmd.append("--enable-test-commands")
        return cmd + self.extra_args

    def start(self) -> EmbeddedMongo:
        """Start the server and wait until it answers ``ping`` (raises ``EmbeddedMongoError`` if not)."""
        if self.running:
            return self
        if not _port_is_free(self.host, self.port):
            raise EmbeddedMongoError(f"port {self.port} on {self.host} is already in use")
        if self.storage_path is not None:
            self.storage_path.mkdir(parents=True, exist_ok=True)
        if self.log_path is not None:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the process's life
        else:
            fd, self._tmp_log = tempfile.mkstemp(prefix="secantusd-", suffix=".log")
            self._log = os.fdopen(fd, "wb")
        self._proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C in a terminal goes to us; we stop the server ourselves
            preexec_fn=_die_with_parent if self.die_with_parent and sys.platform == "linux" else None,  # noqa: PLW1509
        )
        _RUNNING.add(self)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _log_tail(self) -> str:
        path = self.log_path or self._tmp_log
        if not path:
            return ""
        try:
            return Path(path).read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def _wait_ready(self) -> None:
        from pymongo import MongoClient
        from pymongo.errors import PyMongoError

        deadline = time.monotonic() + self.startup_timeout
        delay = 0.05
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise EmbeddedMongoError(
                    f"embedded MongoDB server exited with code {self._proc.returncode} while starting:\n"
                    f"{self._log_tail()}"
                )
            client: MongoClient[dict[str, Any]] = MongoClient(
                self.url, serverSelectionTimeoutMS=500, connectTimeoutMS=500
            )
            try:
                client.admin.command("ping")
                if self._proc.poll() is None:  # it is our process that answered, not someone else's
                    return
            except PyMongoError:
                pass
            finally:
                client.close()
            if time.monotonic() > deadline:
                raise EmbeddedMongoError(
                    f"embedded MongoDB server did not answer on {self.url} "
                    f"within {self.startup_timeout:g}s:\n"
                    f"{self._log_tail()}"
                )
            time.sleep(delay)
            delay = min(0.5, delay * 1.5)

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout``); safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                self._wait_stopped(proc, timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._tmp_log:
            with contextlib.suppress(OSError):
                os.unlink(self._tmp_log)
            self._tmp_log = None
        _RUNNING.discard(self)

    def _wait_stopped(self, proc: subprocess.Popen[bytes], timeout: float) -> None:
        """Wait for the server to exit after SIGTERM, waking its accept thread meanwhile.

        SecantusDB's stop closes its listening socket and joins its accept thread for up to 2 s, but on
        Linux closing a socket does not wake a thread blocked in ``accept()`` on it, so with no client
        connecting every stop took that whole 2 s. A connection (closed at once) wakes it: the thread
        sees the stop flag and exits. Until the process is gone we connect every 20 ms; a connection
        that arrives before the signal is handled is served and closed like any other.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                proc.wait(0.02)
                return
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    raise
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), timeout=0.2):
                pass

    def kill(self) -> None:
        """SIGKILL the server, as a crash would (for fault tests)."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(10)
        self.stop()

    def restart(self) -> EmbeddedMongo:
        """Stop and start again on the same port (and storage directory, if any)."""
        self.stop()
        return self.start()

    def __enter__(self) -> EmbeddedMongo:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<EmbeddedMongo {self.url} {'running' if self.running else 'stopped'}>"


@atexit.register
def _stop_all() -> None:  # never leave a server running behind us
    for server in list(_RUNNING):
        with contextlib.suppress(Exception):
            server.stop(timeout=5)


def _die_with_parent() -> None:
    """In the server's process before it runs: SIGTERM when the thread that started it ends
    (``prctl(PR_SET_PDEATHSIG)``, Linux)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m celery_mongolock.embedded",
        description="Run the embedded MongoDB-compatible server on a loopback port until Ctrl-C.",
    )
    parser.add_argument("--port", type=int, default=None, help="port (default: a free one)")
    parser.add_argument(
        "--storage-path",
        default=None,
        help="data directory (default: in memory, where everything stays in the cache: parked runs with "
        "messages of megabytes fill it; a directory lets the server write them out)",
    )
    parser.add_argument(
        "--cache-size", default=None, help="the storage engine's cache, e.g. 2G (default: the server's, 1G)"
    )
    parser.add_argument("--auth", action="store_true", help="require authentication")
    parser.add_argument("--enable-test-commands", action="store_true", help="allow configureFailPoint")
    args = parser.parse_args(argv)
    server = EmbeddedMongo(
        port=args.port,
        storage_path=args.storage_path,
        auth=args.auth,
        enable_test_commands=args.enable_test_commands,
        extra_args=[] if args.cache_size is None else ["--cache-size", str(args.cache_size)],
        die_with_parent=True,  # (a SIGKILLed command must not leave its server serving the port)
    )
    stop = False

    def _on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        if not stop:
            stop = True
            raise KeyboardInterrupt  # end the wait below now, not at its next poll

    signal.signal(signal.SIGTERM, _on_signal)
    try:
        server.start()
        print(server.url, flush=True)
        while not stop and server.running:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
