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

#: Run in the server's process before it starts (never in ours). SecantusDB 0.7 keeps the replies of the
#: last 10,000 retryable writes, and prunes them on every retryable write and lookup: a scan of all of
#: them, and once there are 10,000, a sort of all of them to drop the oldest one. pymongo makes every
#: write retryable, so a busy server spent a quarter of its time there (the lock-set checker's server,
#: measured with py-spy), every write slower than the last, until the 10,000th, then each one paying for
#: a sort. Here the scan for records past their lifetime runs at most once a second, and past the cap the
#: oldest tenth is dropped at once (in insertion order, which is their age): the same records are kept,
#: give or take a second and a tenth of the cap. Left as it is when SecantusDB's internals are not the
#: ones this was written for.
_TUNE = """
try:
    import itertools
    from secantus import transactions as _t

    _cap, _life = int(_t._RETRYABLE_RECORD_MAX), float(_t._RETRYABLE_RECORD_LIFETIME_SECONDS)

    def _prune(self):
        now = self._time()
        if now >= getattr(self, "_mongolock_next_sweep", 0.0):
            self._mongolock_next_sweep = now + 1.0
            for k in [k for k, v in self._retryable.items() if v[1] < now - _life]:
                self._retryable.pop(k, None)
        excess = len(self._retryable) - _cap
        if excess > 0:
            for k in list(itertools.islice(iter(self._retryable), excess + _cap // 10)):
                self._retryable.pop(k, None)

    if callable(getattr(_t.TransactionRegistry, "_prune_retryable_locked", None)):
        _t.TransactionRegistry._prune_retryable_locked = _prune
except Exception:
    pass
"""
#: SecantusDB's main thread waits for its stop in ``Event.wait()`` with no timeout, and its SIGTERM handler
#: (which stops the server) runs only in that thread. A process signal the kernel delivers to another of
#: its threads does not wake that wait, so the handler never ran and the server never exited: ``stop`` then
#: SIGKILLed it after its timeout (2 of 150 stops under load; a fault handler's stacks showed the main
#: thread still in ``wait``). Waiting in slices of 0.2 s lets the handler run within one slice.
_WAKE = """
try:
    from secantus import server as _s

    _wait_forever = _s.SecantusDBServer.wait

    def _wait(self):
        stop = getattr(self, "_stop_event", None)
        if stop is None:
            return _wait_forever(self)
        while not stop.wait(0.2):
            pass

    _s.SecantusDBServer.wait = _wait
except Exception:
    pass
"""
#: SecantusDB 0.7 finds where a change stream opened with ``startAtOperationTime`` begins by reading and
#: decoding its whole oplog, from the oldest entry, while it holds the lock every other command needs. Its
#: oplog keeps up to 100,000 entries for an hour, so a busy server's stream openings got slower with every
#: write: 4 s each with 46,801 entries (the lock-set checker's server in CI), during which no command
#: was answered and 2-second leases lapsed everywhere (the lease watcher opens such a stream for each new
#: batch of leases). Entries are in send order of their time and sequence number together, so here the
#: first entry at or after the time is found by bisection over the sequence numbers, a few point reads
#: (the same answer; the whole scan again if an entry has no time). Left as it is when SecantusDB's
#: internals are not the ones this was written for.
_SEEK = """
try:
    from bson import Timestamp as _Ts
    from secantus import storage as _st

    _scan_all = _st.Storage._find_seq_for_ts_scan

    def _seek(self, ts):
        with self._lock:
            if self._closed:
                return 0
            session = self._conn.open_session()
            try:
                found, lo, hi = self._next_seq, 0, self._next_seq
                while lo < hi:
                    mid = (lo + hi) // 2
                    rows, _high = self._merge_oplog_on_session(session, mid, 1)
                    if not rows or rows[0][0] >= hi:
                        hi = mid  # no entry in [mid, hi)
                        continue
                    seq, entry = rows[0]
                    at = entry.get("ts")
                    if not isinstance(at, _Ts):
                        found = None
                        break
                    if at.time > ts.time or (at.time == ts.time and at.inc >= ts.inc):
                        found, hi = seq, mid  # this one qualifies: the first is here or before mid
                    else:
                        lo = seq + 1  # it and every entry before it are older
            finally:
                try:
                    session.close()
                except Exception:
                    pass
        return _scan_all(self, ts) if found is None else found

    if callable(getattr(_st.Storage, "_merge_oplog_on_session", None)) and callable(_scan_all):
        _st.Storage._find_seq_for_ts_scan = _seek
except Exception:
    pass
"""
#: SecantusDB 0.7 reads a database's profiling level from its storage, under the same lock, after every
#: command it answers (6 to 8% of the lock-set checker's server, measured with py-spy). Only
#: ``set_profile`` writes it, so here it is read once per database and kept until ``set_profile`` runs.
_PROFILE = """
try:
    from secantus import storage as _sp

    _get_profile, _set_profile = _sp.Storage.get_profile, _sp.Storage.set_profile

    def _cached_profile(self, db):
        kept = self.__dict__.setdefault("_mongolock_profiles", {})
        if db not in kept:
            kept[db] = _get_profile(self, db)
        return dict(kept[db])

    def _set_and_forget(self, db, **settings):
        self.__dict__.setdefault("_mongolock_profiles", {}).pop(db, None)
        try:
            return _set_profile(self, db, **settings)
        finally:
            self.__dict__["_mongolock_profiles"].pop(db, None)

    if "_PROFILE_TABLE" in vars(_sp) and callable(_get_profile) and callable(_set_profile):
        _sp.Storage.get_profile, _sp.Storage.set_profile = _cached_profile, _set_and_forget
except Exception:
    pass
"""
_LAUNCH = (
    _TUNE
    + _SEEK
    + _PROFILE
    + _WAKE
    + "import sys; from secantus.cli import main; sys.argv[0] = 'secantusd-py'; sys.exit(main())"
)
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
        cmd = [_python_with_secantus(), "-c", _LAUNCH, "--host", self.host, "--port", str(self.port)]
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
    parser.add_argument("--storage-path", default=None, help="data directory (default: in memory)")
    parser.add_argument("--auth", action="store_true", help="require authentication")
    parser.add_argument("--enable-test-commands", action="store_true", help="allow configureFailPoint")
    args = parser.parse_args(argv)
    server = EmbeddedMongo(
        port=args.port,
        storage_path=args.storage_path,
        auth=args.auth,
        enable_test_commands=args.enable_test_commands,
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
