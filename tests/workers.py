"""Real ``celery worker`` processes (prefork) for the integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from .integration_app import broker_transport_options
from .servers import wait_for

ROOT = Path(__file__).resolve().parents[1]

#: Worker nodes started and not stopped, for ``dump_stacks``.
LIVE: weakref.WeakSet[Worker] = weakref.WeakSet()


class Worker:
    """One ``celery -A tests.integration_app worker`` node; started in its own process group."""

    def __init__(
        self,
        env: dict[str, str],
        ready_dir: Path,
        *,
        concurrency: int = 2,
        name: str | None = None,
        extra_args: list[str] | None = None,
        log_dir: Path | None = None,
    ) -> None:
        self.name = name or f"w{uuid.uuid4().hex[:6]}@localhost"
        self.env = env
        self.ready_dir = ready_dir
        self.concurrency = concurrency
        self.extra_args = extra_args or []
        self.log_path = (log_dir or ready_dir) / f"{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> Worker:
        marker = self.ready_dir / f"{self.name}.ready"
        marker.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.integration_app",
            "worker",
            "--pool=prefork",
            f"--concurrency={self.concurrency}",
            "-n",
            self.name,
            "--loglevel=INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            *self.extra_args,
        ]
        self._log = open(self.log_path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        LIVE.add(self)

        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"worker {self.name} exited with {self.proc.returncode}:\n{self.log()}")
            return marker.exists()

        wait_for(ready, timeout=timeout, message=f"worker {self.name} to be ready")
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def child_pids(self) -> list[int]:
        assert self.proc is not None
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True, check=False)
        return [int(p) for p in out.stdout.split()]

    def dump_stacks(self, timeout: float = 10.0) -> str:
        """Every thread's stack of this node's processes (parent and pool children), written by
        faulthandler to its log on SIGUSR2 (``integration_app``): what a failed test shows of a hung
        worker. Waits for one dump per process, ``timeout`` at most (a process may be gone)."""
        if self.proc is None or self.proc.poll() is not None:
            return ""
        pids = [p for p in [self.proc.pid, *self.child_pids()] if _running(p)]  # (no zombie dumps)
        start = self.log_path.stat().st_size
        deadline = time.monotonic() + timeout
        # One process at a time (their dumps would interleave in the shared log), each awaited.
        done = 0
        for pid in pids:
            try:
                os.kill(pid, signal.SIGUSR2)
            except ProcessLookupError:
                continue  # (gone meanwhile: no dump to wait for)
            done += 1
            while time.monotonic() < deadline and self._dumped(start).count(b"Current thread") < done:
                time.sleep(0.05)  # (a diagnostic after a failure: polls for the dump, bounded by timeout)
        dumped = self._dumped(start)
        return f"{self.name} (pids {pids}):\n" + dumped.decode(errors="replace")

    def _dumped(self, start: int) -> bytes:
        with open(self.log_path, "rb") as f:
            f.seek(start)
            return f.read()

    def stop(self, timeout: float = 30) -> int | None:
        """Warm shutdown (SIGTERM): running tasks finish, then the worker exits."""
        LIVE.discard(self)
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        code = self.proc.returncode
        self._log.close()
        return code

    def kill(self) -> None:
        """SIGKILL the whole node (parent and children), as a machine crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _running(pid: int) -> bool:
    """``pid`` is a live process, not a zombie waiting to be reaped (which would never dump)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def dump_stacks() -> str:
    """The stacks of every live worker node's processes (``Worker.dump_stacks``)."""
    return "\n".join(w.dump_stacks() for w in list(LIVE))


def worker_env(
    broker: str, mongo_url: str, db: str, ready_dir: Path, lease: float = 3.0, **extra: Any
) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MONGOLOCK_IT_BROKER": broker,
        "MONGOLOCK_IT_MONGODB_URL": mongo_url,
        "MONGOLOCK_IT_DB": db,
        "MONGOLOCK_IT_LEASE": str(lease),
        "MONGOLOCK_IT_READY_DIR": str(ready_dir),
    }
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _drop_connections(app: Any) -> None:
    """Forget ``app``'s broker connections (its producer pool), so that the next publish uses its broker URL
    as configured now: a pool made earlier keeps the broker it was made for. (Not closed: kombu keeps one pool
    per broker for the whole process, and would hand the closed one out again.)"""
    app._pool = None
    app.amqp._producer_pool = None
    for attr in ("_mongolock_settings", "_mongolock_store"):
        app.__dict__.pop(attr, None)


@contextmanager
def pointed_at(app: Any, broker: str, backend: str, **settings: Any) -> Iterator[None]:
    """Point the test process's ``app`` at ``broker`` (Redis or RabbitMQ, with what it needs so that nothing
    published is lost) and ``backend`` for a block; then back to what it had, its connections dropped."""
    keys = ("broker_url", "result_backend", "broker_transport_options", *settings)
    before = {key: app.conf.get(key) for key in keys}
    app.conf.update(
        broker_url=broker,
        result_backend=backend,
        broker_transport_options=broker_transport_options(broker),
        **settings,
    )
    _drop_connections(app)
    try:
        yield
    finally:
        app.conf.update(before)
        _drop_connections(app)


def purge_after_kill(broker: str, queue: str = "celery", timeout: float = 30) -> None:
    """On RabbitMQ, the messages of a SIGKILLed node go back to their queue at once (on Redis only after the
    visibility timeout): once ``queue`` (and its handoff lane) has no consumer left, empty it, so that the
    next module's workers on the same broker do not run this module's leftovers."""
    if not broker.startswith(("amqp", "pyamqp")):
        return
    from kombu.connection import Connection

    from celery_mongolock.integration.lanes import lane_name

    connection: Any = Connection  # untyped
    for name in (queue, lane_name(queue)):
        with connection(broker) as conn:  # a channel each: a passive declare of no queue closes it
            channel = conn.default_channel

            def no_consumer(name: str = name, channel: Any = channel) -> bool:
                try:
                    return int(channel.queue_declare(queue=name, passive=True).consumer_count) == 0
                except Exception:  # no such queue: nothing to purge
                    return True

            wait_for(no_consumer, timeout=timeout, message=f"{name} to have no consumer")
            with suppress(Exception):  # no such queue
                channel.queue_purge(name)
