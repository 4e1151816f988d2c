"""The example Django site (example_project/django_site) with a real prefork ``celery -A mysite worker``.

Its settings.py configures Celery through Django (``namespace="CELERY"``) and celery_mongolock through
``CELERY_MONGOLOCK_*``: a database and collection of its own, ``retry`` by default, and ``skip`` for the
import task in ``CELERY_MONGOLOCK_TASK_POLICIES``. The test checks that each of those took effect.

The first import reads its CSV from a named pipe, so it holds its group's lease exactly until the test
writes the file: no timing in the test.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from pymongo import MongoClient

from .servers import RedisServer, wait_for

pytest.importorskip("django")

SITE = Path(__file__).resolve().parents[1] / "example_project" / "django_site"
TASK = "uploads.tasks.import_members"


@pytest.fixture
def site_env(mongo_url: str, db_name: str, tmp_path: Path) -> Iterator[dict[str, str]]:
    with RedisServer() as redis:
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "mysite.settings",
            "SITE_BROKER_URL": redis.url,
            "SITE_MONGODB_URL": mongo_url,
            "SITE_MONGOLOCK_DATABASE": db_name,
            "SITE_SQLITE_PATH": str(tmp_path / "site.sqlite3"),
        }
        env.pop("PYTHONPATH", None)
        migrate = subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput"],
            cwd=SITE,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert migrate.returncode == 0, migrate.stdout + migrate.stderr
        yield env
        # AsyncResults caught in reference cycles unsubscribe from Redis when collected: now, while it runs.
        gc.collect()
    with MongoClient[dict[str, Any]](mongo_url) as client:
        client.drop_database(db_name)


@contextlib.contextmanager
def worker(env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    cmd = [sys.executable, "-m", "celery", "-A", "mysite", "worker", "--pool=prefork", "--concurrency=2"]
    cmd += ["--loglevel=INFO", "--without-gossip", "--without-mingle", "--without-heartbeat"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, cwd=SITE, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)


def _unblock(fifo: Path) -> None:
    """Give a reader still blocked on ``fifo`` an end of file (if any reader is there)."""
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_django_settings_configure_leases_and_per_task_policy(
    site_env: dict[str, str], mongo_url: str, db_name: str, tmp_path: Path
) -> None:
    client = Celery("caller", broker=site_env["SITE_BROKER_URL"], backend=site_env["SITE_BROKER_URL"])
    mongo: MongoClient[dict[str, Any]] = MongoClient(mongo_url, tz_aware=True)
    leases = mongo[db_name]["task_leases"]  # CELERY_MONGOLOCK_DATABASE / CELERY_MONGOLOCK_COLLECTION
    fifo = tmp_path / "group7.csv"
    os.mkfifo(fifo)
    second_csv = tmp_path / "group7-second.csv"
    second_csv.write_text("email\nlate@example.com\n")
    log = tmp_path / "worker.log"
    try:
        with worker(site_env, log) as proc:
            first = client.send_task(TASK, args=[7, str(fifo)])
            # The first import holds the group's lease while it waits for its file.
            doc = wait_for(
                lambda: leases.find_one({"_id": "email-group:7"}),
                timeout=90,
                message=f"the first import's lease in {db_name}.task_leases\n{log.read_text()[-4000:]}",
            )
            assert doc is not None and doc["owner"]
            assert doc["ttl_ms"] == 15_000  # "lease_seconds": 15 in CELERY_MONGOLOCK_TASK_POLICIES
            assert doc["holder"]["task_name"] == TASK
            second = client.send_task(TASK, kwargs={"group_id": 7, "csv_path": str(second_csv)})
            skipped = second.get(timeout=60)
            # CELERY_MONGOLOCK_TASK_POLICIES made it skip (the global CELERY_MONGOLOCK_ON_CONTENTION retries).
            assert isinstance(skipped, dict), skipped
            assert skipped["mongolock"] == "skipped"
            assert skipped["key"] == "email-group:7"
            assert skipped["holder"]["task_id"] == first.id
            assert second.state == "SUCCESS"
            with open(fifo, "w") as f:  # now the first import gets its file and finishes
                f.write("email\nb@example.com\na@example.com\nb@example.com\n")
            assert first.get(timeout=60) == 2
            assert proc.poll() is None, log.read_text()[-4000:]
        # Nothing went to the default database and collection.
        assert "leases" not in mongo[db_name].list_collection_names()
        assert mongo["celery_mongolock"]["leases"].find_one({"_id": "email-group:7"}) is None
    finally:
        _unblock(fifo)
        mongo.close()
        client.close()

    # The ORM write happened in the worker's pool child, under the lease: the first file's members only,
    # stamped with the fencing token of the lease in the settings' collection.
    with contextlib.closing(sqlite3.connect(site_env["SITE_SQLITE_PATH"])) as db:
        rows = db.execute("SELECT group_id, email, fence FROM uploads_member ORDER BY email").fetchall()
    assert rows == [(7, "a@example.com", doc["fence"]), (7, "b@example.com", doc["fence"])]
