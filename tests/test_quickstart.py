"""The README's quick start, run as a new user runs it (issue 14): its code written to a new project's
``tasks.py`` exactly as printed (only the two server addresses changed), its shell commands run as
printed, a real prefork worker against a real Redis and MongoDB-compatible server. Also: a worker
refuses to start, with one line and no traceback, on a bad declaration or a bad setting.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest

from celery_mongolock import LeaseStore
from celery_mongolock.embedded import EmbeddedMongo

from .servers import RedisServer, wait_for
from .workers import ROOT

README = (ROOT / "README.md").read_text()
# The README links to the testing how-to for "testing your own tasks"; its first example is run here.
TESTING_HOW_TO = (ROOT / "docs" / "how-to" / "testing.md").read_text()


def readme_block(section: str, language: str, index: int = 0, text: str = README) -> str:
    """The ``index``-th fenced ``language`` block of the section titled ``section`` of the README (or of
    ``text``, another Markdown page)."""
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(rf"```{language}\n(.*?)```", body, flags=re.DOTALL)
    return str(blocks[index])


QUICK_START = readme_block("Quick start", "python")
COMMANDS = readme_block("Quick start", "sh")


def project_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MONGOLOCK_IT_", "CELERY_"))}
    env.pop("PYTHONPATH", None)  # a new project: only its own directory and the installed library
    # The README's commands say `python` and `celery`: this virtualenv's.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def write_tasks(project: Path, mongo_url: str, broker_url: str, extra: str = "") -> None:
    code = QUICK_START
    assert 'broker="redis://localhost:6379/0"' in code and '"mongodb://localhost:27017"' in code
    code = code.replace("redis://localhost:6379/0", broker_url)
    code = code.replace("redis://localhost:6379/1", broker_url.rsplit("/", 1)[0] + "/1")
    code = code.replace("mongodb://localhost:27017", mongo_url)
    (project / "tasks.py").write_text(code + extra)


class ProjectWorker:
    def __init__(self, project: Path, *args: str) -> None:
        self.log_path = project / "worker.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tasks", "worker", "--loglevel=INFO", *args],
            cwd=project,
            env=project_env(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, predicate: Any, message: str, timeout: float = 60) -> None:
        def check() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited with {self.proc.returncode}:\n{self.log()}")
            return bool(predicate(self.log()))

        wait_for(check, timeout=timeout, message=message)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def servers(redis_server: RedisServer) -> Iterator[tuple[str, str]]:
    # A MongoDB-compatible server of its own: the quick start uses the default database and keys.
    with EmbeddedMongo() as mongo:
        yield mongo.url, redis_server.url.rsplit("/", 1)[0] + "/7"


# A second task in the same project: the callable key of the keys table (docs/reference/keys.md), called
# positionally.
CALLABLE_KEY_TASK = """

def tenant_of(group_id: int) -> int:
    return group_id % 10


@singleton_task(key=lambda group_id, **_: f"tenant:{tenant_of(group_id)}", app=app)
def upload_for_tenant(group_id: int, csv_path: str) -> str:
    return f"uploaded {csv_path} for group {group_id}"
"""


# Sends a task from the project and prints its result (read from the result backend).
GET_RESULT = "from tasks import *; print({call}.get(timeout=60))"


@pytest.mark.slow
def test_the_quick_start_runs_as_written(servers: tuple[str, str], tmp_path: Path) -> None:
    mongo_url, broker_url = servers
    write_tasks(tmp_path, mongo_url, broker_url, CALLABLE_KEY_TASK)
    create_csvs, start_worker, send = (line for line in COMMANDS.splitlines() if line.strip())
    assert start_worker.startswith("celery -A tasks worker --loglevel=INFO")
    subprocess.run(["bash", "-c", create_csvs], cwd=tmp_path, check=True)
    worker = ProjectWorker(tmp_path, "--concurrency=2", "--without-gossip", "--without-mingle")
    store = LeaseStore(mongo_url)
    try:
        # Our start-up line (Celery's own "ready" banner is worded its way, and may change).
        worker.wait_log(lambda text: "celery_mongolock: leases in" in text, "the worker to start")

        # 1. The commands as printed: the uploads never overlap, and the group ends with the file sent
        # last (b.csv, one member); a.csv ran first, or was superseded if it reached a worker second.
        subprocess.run(["bash", "-c", send], cwd=tmp_path, env=project_env(), check=True, timeout=60)
        worker.wait_log(lambda text: "group 42 now has 1 members" in text, "the last upload to finish")
        log = worker.log()
        if "group 42 now has 2 members" in log:
            assert log.index("group 42 now has 2 members") < log.index("group 42 now has 1 members")
        else:
            worker.wait_log(lambda text: "superseded" in text, "the earlier send to be superseded")
        assert "Traceback" not in log and "ERROR" not in log

        # 2. An upload that finds the key held: one INFO line, with key, holder and policy; it is parked
        # and handed the key when it is released.
        lease = store.acquire("email-group:42", ttl=60, info={"task_name": "held-by-the-test"})
        assert lease is not None
        # The parked upload's result, from the result backend (not from Celery's log lines).
        sender = subprocess.Popen(
            [sys.executable, "-c", GET_RESULT.format(call='upload_members.delay(42, "b.csv")')],
            cwd=tmp_path,
            env=project_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            worker.wait_log(
                lambda text: any(
                    "held-by-the-test" in line and "policy replace: parked at position 1" in line
                    for line in text.splitlines()
                ),
                "the upload to park behind the test's lease",
            )
            lease.release()
            out, _ = sender.communicate(timeout=90)
        finally:
            if sender.poll() is None:
                sender.kill()
                sender.wait()
        assert sender.returncode == 0 and out.strip() == "1", out  # b.csv has one member
        contended = [line for line in worker.log().splitlines() if "held-by-the-test" in line]
        assert contended, worker.log()
        # Every line about the contention is that single line, naming the key, the holder and the policy.
        assert len(contended) == 1 and "lease 'email-group:42' is held by" in contended[0]
        assert "policy replace: parked at position 1" in contended[0]

        # 3. The callable key of the Keys table, called with positional arguments, in the worker.
        done = subprocess.run(
            [sys.executable, "-c", GET_RESULT.format(call='upload_for_tenant.delay(42, "a.csv")')],
            cwd=tmp_path,
            env=project_env(),
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        assert done.returncode == 0 and done.stdout.strip() == "uploaded a.csv for group 42", done
        assert "acquired 'tenant:2'" in worker.log() and "TypeError" not in worker.log()
    finally:
        worker.stop()
        store.close()


BAD_DECLARATION = """
from celery_mongolock import SingletonTask


@app.task(base=SingletonTask, mongolock_key="email-group:{gid}")
def g(group_id: int) -> None: ...
"""
BAD_POLICY = """
from celery_mongolock import SingletonTask


@app.task(base=SingletonTask, mongolock_key="email-group:{group_id}", mongolock_on_contention="skipp")
def g(group_id: int) -> None: ...
"""
BAD_SETTING = """
app.conf.mongolock_lease_seconds = -1
"""
# Found trying it as a user (stop 50): a bad template in a task's settings entry, found by the worker's own
# check of its tasks, ended in Celery's "Unrecoverable error" and its traceback.
BAD_TASK_SETTING = """
from celery_mongolock import SingletonTask

app.conf.mongolock_task_policies = {"tasks.g": {"keys": ["email-group:{group_id}", "tenant:{tenant}"]}}


@app.task(base=SingletonTask, mongolock_key="email-group:{group_id}", mongolock_on_contention="queue")
def g(group_id: int) -> None: ...
"""
# Issue 27: a misspelt setting in a Django-style namespace started a worker with the default lease.
MISSPELT_SETTING = """


class DjangoSettings:
    CELERY_MONGOLOCK_LEASE_SECOND = 60


app.config_from_object(DjangoSettings, namespace="CELERY")
"""


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            BAD_DECLARATION,
            "task 'tasks.g': key template 'email-group:{gid}' names 'gid', which is not an argument of "
            "g(group_id)",
        ),
        (BAD_POLICY, "task 'tasks.g': mongolock_on_contention must be one of"),
        (BAD_SETTING, "mongolock_lease_seconds must be between 0.5 and 2.592e+06 seconds, got -1"),
        (
            MISSPELT_SETTING,
            "unknown setting 'CELERY_MONGOLOCK_LEASE_SECOND'; did you mean 'CELERY_MONGOLOCK_LEASE_SECONDS'?",
        ),
        (BAD_TASK_SETTING, "task 'tasks.g': key template 'tenant:{tenant}' names 'tenant'"),
    ],
    ids=["template", "policy", "setting", "misspelt-setting", "task-setting-template"],
)
def test_a_worker_refuses_to_start_with_one_line(extra: str, message: str, tmp_path: Path) -> None:
    # No server is needed: the worker stops before it connects to anything.
    write_tasks(tmp_path, "mongodb://127.0.0.1:1", "redis://127.0.0.1:1/0", extra)
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tasks", "worker", "--loglevel=INFO"],
        cwd=tmp_path,
        env=project_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = out.stdout + out.stderr
    assert out.returncode == 1, output
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.startswith("celery_mongolock:")]
    assert lines == [f"celery_mongolock: cannot start: {message}"] or (
        len(lines) == 1 and lines[0].startswith(f"celery_mongolock: cannot start: {message}")
    ), output
    assert " ready." not in output


def test_the_testing_example_runs_as_written_against_the_quick_start(tmp_path: Path) -> None:
    """The testing how-to's first example (docs/how-to/testing.md, "testing your own tasks" in the README's
    documentation links), as a test file of the quick start's project, run by pytest there (a new
    project: no configuration of ours)."""
    write_tasks(tmp_path, "mongodb://127.0.0.1:1", "redis://127.0.0.1:1/0")  # apply() needs no broker
    # The page's eager examples and its key check, one test file (the later blocks use the first's names).
    example = "\n\n".join(
        [
            readme_block("Eager tests: one process, no broker", "python", 0, text=TESTING_HOW_TO),
            readme_block("Eager tests: one process, no broker", "python", 1, text=TESTING_HOW_TO),
            readme_block("Check the keys", "python", 0, text=TESTING_HOW_TO),
        ]
    )
    (tmp_path / "test_tasks.py").write_text(example)
    report = tmp_path / "r.xml"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            "test_tasks.py",
        ],
        cwd=tmp_path,
        env=project_env(),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # Three tests ran and passed: pytest's JUnit report, not the wording of its summary line.
    suite = ElementTree.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {name: suite.get(name) for name in ("tests", "failures", "errors", "skipped")}
    assert counts == {"tests": "3", "failures": "0", "errors": "0", "skipped": "0"}, out.stdout


def test_a_beat_refuses_to_start_with_one_line(tmp_path: Path) -> None:
    write_tasks(tmp_path, "mongodb://127.0.0.1:1", "redis://127.0.0.1:1/0", BAD_SETTING)
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tasks", "beat", "-S", "celery_mongolock.beat:Scheduler"],
        cwd=tmp_path,
        env=project_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = out.stdout + out.stderr
    assert out.returncode == 1 and "Traceback" not in output, output
    assert [line for line in output.splitlines() if line.startswith("celery_mongolock:")] == [
        "celery_mongolock: cannot start: mongolock_lease_seconds must be between 0.5 and 2.592e+06 seconds, "
        "got -1"
    ], output
