"""Our own log lines for parked, handed-over and superseded runs say what happens next, and Celery's
"ignored" line of a parked run says it was parked, not dropped (issue 27). A real prefork worker of the
quick start's project, Redis and a MongoDB-compatible server."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from celery_mongolock import LeaseStore

from .test_quickstart import ProjectWorker, project_env, servers, write_tasks

__all__ = ["servers"]  # the quick start's servers fixture, used here


def send(project: Path, csv_path: str) -> str:
    """``upload_members.delay(42, csv_path)`` from the project; the task id."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            f'from tasks import upload_members; print(upload_members.delay(42, "{csv_path}").id)',
        ],
        cwd=project,
        env=project_env(),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return out.stdout.strip()


@pytest.mark.slow
def test_parked_handed_and_superseded_runs_say_what_happens(servers: tuple[str, str], tmp_path: Path) -> None:
    mongo_url, broker_url = servers
    write_tasks(tmp_path, mongo_url, broker_url)
    for name in ("a.csv", "b.csv", "c.csv"):
        (tmp_path / name).write_text("ann@example.com\n")
    worker = ProjectWorker(tmp_path, "--concurrency=2", "--without-gossip", "--without-mingle")
    store = LeaseStore(mongo_url)
    try:
        worker.wait_log(lambda text: "celery_mongolock: leases in" in text, "the worker to start")
        lease = store.acquire("email-group:42", ttl=60, info={"task_name": "held-by-the-test"})
        assert lease is not None
        first = send(tmp_path, "a.csv")
        worker.wait_log(lambda text: f"[{first}]: lease 'email-group:42' is held by" in text, "the park")
        log = worker.log()
        (parked,) = [line for line in log.splitlines() if f"[{first}]: lease" in line]
        assert (
            "policy replace: parked at position 1 (state QUEUED, no worker slot held): it starts when the "
            "key is handed to it, unless a newer send replaces it first" in parked
        ), parked
        # Celery's line for the delivery: parked, not "ignored".
        worker.wait_log(lambda text: f"Task tasks.upload_members[{first}] parked" in text, "Celery's line")
        assert (
            f"Task tasks.upload_members[{first}] parked at position 1 on 'email-group:42', not dropped: it "
            "starts when handed the key" in worker.log()
        )
        assert not re.search(r"\] ignored\b", worker.log()), worker.log()

        # A newer send replaces the parked one, which ends without running, and says so.
        second = send(tmp_path, "b.csv")
        worker.wait_log(
            lambda text: (
                f"[{first}], parked on 'email-group:42', superseded by a newer send ({second})" in text
            ),
            "the parked run to be superseded",
        )
        # The key is handed to the newer run when the test releases it: the handoff says what comes next.
        lease.release()
        worker.wait_log(
            lambda text: (
                f"handed 'email-group:42' to tasks.upload_members[{second}], parked until now" in text
            ),
            "the handoff",
            timeout=90,
        )
        worker.wait_log(lambda text: f"[{second}] acquired 'email-group:42'" in text, "the handed run")
        assert not re.search(r"\] ignored\b", worker.log()), worker.log()
    finally:
        worker.stop()
        store.close()
