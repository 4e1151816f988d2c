"""Real ``celery worker`` processes (prefork) for the integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from .servers import wait_for

ROOT = Path(__file__).resolve().parents[1]


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

    def stop(self, timeout: float = 30) -> int | None:
        """Warm shutdown (SIGTERM): running tasks finish, then the worker exits."""
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
