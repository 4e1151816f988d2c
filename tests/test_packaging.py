"""The distributions as a user gets them: built, checked, installed into a fresh virtualenv and run.

The wheel is installed (with the ``embedded`` extra and Celery's ``redis`` extra) into a new virtualenv,
and the README's quick start runs from a directory outside the repository: the embedded server started
with ``python -m celery_mongolock.embedded`` from that virtualenv, a real ``redis-server`` as broker and
result backend, and a real prefork ``celery worker``. Two overlapping uploads for one group never overlap,
and both return their result.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import celery_mongolock

from .servers import RedisServer, wait_for

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m build``: an sdist and a wheel of the working tree, in a directory of their own."""
    out = tmp_path_factory.mktemp("dist")
    run = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
        cwd=out,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out


def test_build_makes_an_sdist_and_a_wheel_that_twine_accepts(dist: Path) -> None:
    version = celery_mongolock.__version__
    wheels = sorted(dist.glob("*.whl"))
    sdists = sorted(dist.glob("*.tar.gz"))
    assert [w.name for w in wheels] == [f"celery_mongolock-{version}-py3-none-any.whl"]
    assert [s.name for s in sdists] == [f"celery_mongolock-{version}.tar.gz"]
    check = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, wheels + sdists)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count("PASSED") == 2

    # The version is written once (celery_mongolock/__about__.py) and reaches the metadata from there.
    with zipfile.ZipFile(wheels[0]) as whl:
        names = whl.namelist()
        metadata = whl.read(f"celery_mongolock-{version}.dist-info/METADATA").decode()
        entry_points = whl.read(f"celery_mongolock-{version}.dist-info/entry_points.txt").decode()
    assert f"\nVersion: {version}\n" in metadata
    assert "celery_mongolock/py.typed" in names
    assert not any(n.startswith(("tests/", "benchmarks/", "example_project/")) for n in names)
    assert "mongolock = celery_mongolock.cli:mongolock" in entry_points
    # Runtime dependencies are celery, kombu and pymongo only; everything else sits behind an extra.
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert sorted(r.split()[1].split(">")[0] for r in requires if "extra ==" not in r) == [
        "celery",
        "kombu",
        "pymongo",
    ]
    with tarfile.open(sdists[0]) as sdist:
        members = sdist.getnames()
    prefix = f"celery_mongolock-{version}/"
    for path in ("pyproject.toml", "README.md", "CHANGELOG.md", "LICENSE", "celery_mongolock/__about__.py"):
        assert prefix + path in members


QUICK_START = """\
# tasks.py: the README's quick start, with a file standing in for the email group.
import os
import re
import time
from pathlib import Path

import celery_mongolock
from celery import Celery
from celery_mongolock import singleton_task, current_lease
from celery_mongolock.signals import lease_contended

WORK = Path(os.environ["QS_WORK"])

app = Celery("proj", broker=os.environ["QS_BROKER"], backend=os.environ["QS_BROKER"])
app.conf.mongolock_url = os.environ["QS_MONGODB"]      # where the leases live


@lease_contended.connect
def _contended(sender=None, key=None, **_):
    (WORK / f"contended-{key}").touch()


@singleton_task(key="email-group:{group_id}", app=app)
def upload_members(group_id: int, csv_path: str) -> dict:
    inside = WORK / f"inside-{group_id}"
    try:
        fd = os.open(inside, os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        (WORK / "overlap").write_text(csv_path)
        raise
    started = time.time()
    (WORK / f"started-{csv_path}").touch()
    # The first upload goes on until the second one has found the group held.
    deadline = time.monotonic() + 60
    while not (WORK / f"contended-email-group:{group_id}").exists() and time.monotonic() < deadline:
        current_lease().raise_if_lost()                 # stop promptly if the lease was lost
        time.sleep(0.02)
    (WORK / f"group-{group_id}").write_text(csv_path)
    os.close(fd)
    inside.unlink()
    return {"csv": csv_path, "start": started, "end": time.time(), "module": celery_mongolock.__file__,
            "fence": current_lease().fence}
"""

CLIENT = """\
import json
import os
import re
import sys
import time
from pathlib import Path

import celery_mongolock
from tasks import upload_members

WORK = Path(os.environ["QS_WORK"])
first = upload_members.delay(42, "a.csv")
deadline = time.monotonic() + 90
while not (WORK / "started-a.csv").exists():
    if time.monotonic() > deadline:
        sys.exit("the first upload never started")
    time.sleep(0.02)
second = upload_members.delay(group_id=42, csv_path="b.csv")
results = [first.get(timeout=90), second.get(timeout=90)]
print(json.dumps({"results": results, "client_module": celery_mongolock.__file__}))
"""

WORKER_OPTIONS = [
    "--pool=prefork",
    "--concurrency=2",
    "--loglevel=INFO",
    "--without-gossip",
    "--without-mingle",
    "--without-heartbeat",
]


def _clean_env(venv: Path, **extra: str) -> dict[str, str]:
    """The environment of a user's shell with ``venv`` activated: nothing of this repository in it."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP"}
    }
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    env["PYTHONNOUSERSITE"] = "1"
    env.update(extra)
    return env


@contextlib.contextmanager
def _process(cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
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


def test_wheel_in_a_fresh_virtualenv_runs_the_quick_start(dist: Path, tmp_path: Path) -> None:
    wheel = next(dist.glob("*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", f"{wheel}[embedded]", "celery[redis]"],
        cwd=tmp_path,
        env=_clean_env(venv),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    project = tmp_path / "project"
    work = tmp_path / "work"
    project.mkdir()
    work.mkdir()
    (project / "tasks.py").write_text(QUICK_START)
    (project / "client.py").write_text(CLIENT)

    with contextlib.ExitStack() as stack:
        embedded_log = tmp_path / "embedded.log"
        stack.enter_context(
            _process(
                [str(python), "-m", "celery_mongolock.embedded"], project, _clean_env(venv), embedded_log
            )
        )
        mongo_url = wait_for(
            lambda: next(
                (ln for ln in embedded_log.read_text().splitlines() if ln.startswith("mongodb://")), ""
            ),
            timeout=60,
            message="the embedded server to print its URL",
        )
        redis = stack.enter_context(RedisServer())
        env = _clean_env(venv, QS_WORK=str(work), QS_BROKER=redis.url, QS_MONGODB=mongo_url)
        worker_log = tmp_path / "worker.log"
        worker = stack.enter_context(
            _process(
                [str(venv / "bin" / "celery"), "-A", "tasks", "worker", *WORKER_OPTIONS],
                project,
                env,
                worker_log,
            )
        )
        client = subprocess.run(
            [str(python), "client.py"],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert client.returncode == 0, (
            client.stdout + client.stderr + "\n--- worker log:\n" + worker_log.read_text()[-5000:]
        )
        assert worker.poll() is None, worker_log.read_text()[-5000:]

    out = json.loads(client.stdout.splitlines()[-1])
    first, second = out["results"]
    # The library came from the fresh virtualenv, in the client and in the worker's pool child.
    for module in (out["client_module"], first["module"], second["module"]):
        assert Path(module).resolve().is_relative_to(venv.resolve()), module
    assert not (work / "overlap").exists()
    assert (work / "contended-email-group:42").exists()  # the second upload did find the group held
    assert (first["csv"], second["csv"]) == ("a.csv", "b.csv")
    assert first["end"] <= second["start"]
    assert second["fence"] > first["fence"]
    assert (work / "group-42").read_text() == "b.csv"


def test_changelog_is_ready_for_a_release() -> None:
    """Keep a Changelog: `## [Unreleased]` first, then `## [X.Y.Z] - YYYY-MM-DD`; each has a link."""
    text = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## (.*)$", text, flags=re.MULTILINE)
    assert headings[0] == "[Unreleased]"
    versions = []
    for heading in headings[1:]:
        match = re.fullmatch(r"\[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}", heading)
        assert match, f"release heading {heading!r} is not '[X.Y.Z] - YYYY-MM-DD'"
        versions.append(match.group(1))
    links = dict(re.findall(r"^\[([^\]]+)\]: (\S+)$", text, flags=re.MULTILINE))
    for name in ["Unreleased", *versions]:
        assert name in links, f"no link reference for [{name}] at the bottom of CHANGELOG.md"
    sections = re.findall(r"^### (.*)$", text, flags=re.MULTILINE)
    assert set(sections) <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
    # The package's version is the next release (a .devN) or the newest released one.
    version = celery_mongolock.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", version)
    if versions and ".dev" not in version:
        assert version == versions[0]


def test_the_version_matrix_starts_at_the_declared_floors() -> None:
    """noxfile.py's oldest combination is pyproject.toml's floors, and `make test` runs it."""
    pytest.importorskip("nox")
    import tomllib

    spec = importlib.util.spec_from_file_location("noxfile", ROOT / "noxfile.py")
    assert spec is not None and spec.loader is not None
    noxfile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(noxfile)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {}
    for dep in deps:
        name, floor = dep.split(">=")
        floors[name] = floor
    celery, pymongo = noxfile.OLDEST
    assert floors == {"celery": celery, "kombu": noxfile.CELERY_KOMBU[celery], "pymongo": pymongo}
    assert min(noxfile.CELERY_KOMBU, key=lambda v: tuple(map(int, v.split(".")))) == celery
    assert "$(PY) -m nox --tags oldest" in (ROOT / "Makefile").read_text()
