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
LOCK = ROOT / "requirements" / "lock.txt"


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m build``: an sdist and a wheel of the working tree, in a directory of their own."""
    out = tmp_path_factory.mktemp("dist")
    run = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
        cwd=out,
        env={**os.environ, "PIP_CONSTRAINT": str(LOCK)},  # the build backend pinned, as in `make test`
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
    # Its exit status says both passed (--strict: warnings too), not the wording of its report.
    assert check.returncode == 0, check.stdout + check.stderr

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


def readme_block(section: str, language: str, index: int = 0) -> str:
    """The ``index``-th fenced ``language`` block of the README section titled ``section``."""
    body = (ROOT / "README.md").read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return str(re.findall(rf"```{language}\n(.*?)```", body, flags=re.DOTALL)[index])


# Appended to the README's tasks.py: a result backend (the quick start has none, and the test wants the
# results), and a record of every lease event with the file the library was imported from.
OBSERVE = """

import json as _json
import os as _os
import time as _time

import celery_mongolock as _cm
from celery_mongolock.signals import lease_acquired, lease_contended, lease_released

app.conf.result_backend = _os.environ["QS_BACKEND"]


def _note(kind, sender, key, **fields):
    line = {"kind": kind, "key": key, "task_id": sender.request.id, "t": _time.time(), "module": _cm.__file__}
    with open(_os.environ["QS_EVENTS"], "a") as f:
        f.write(_json.dumps({**line, **fields}) + "\\n")


@lease_acquired.connect
def _acquired(sender=None, key=None, lease=None, **_):
    _note("acquired", sender, key, fence=lease.fence)


@lease_contended.connect
def _contended(sender=None, key=None, policy=None, **_):
    _note("contended", sender, key, policy=policy)


@lease_released.connect
def _released(sender=None, key=None, lease=None, **_):
    _note("released", sender, key, fence=lease.fence)
"""

# The README's two calls, the first one's file a named pipe: it holds group 42 until the second one has
# found the group held, then gets its rows.
CLIENT = """\
import json
import os
import sys
import time

import celery_mongolock
from tasks import upload_members


def events(kind, task_id):
    try:
        with open(os.environ["QS_EVENTS"]) as f:
            lines = [json.loads(line) for line in f]
    except FileNotFoundError:
        return []
    return [e for e in lines if e["kind"] == kind and e["task_id"] == task_id]


def wait(kind, task_id):
    deadline = time.monotonic() + 90
    while not events(kind, task_id):
        if time.monotonic() > deadline:
            sys.exit(f"no {kind} event for {task_id}")
        time.sleep(0.02)


first = upload_members.delay(42, "a.fifo")
wait("acquired", first.id)
second = upload_members.delay(42, "b.csv")
wait("contended", second.id)
with open("a.fifo", "w") as f:
    f.write("ann@example.com\\nbob@example.com\\n")
results = [first.get(timeout=90), second.get(timeout=90)]
ids = [first.id, second.id]
print(json.dumps({"results": results, "ids": ids, "client_module": celery_mongolock.__file__}))
"""


def _clean_env(venv: Path, **extra: str) -> dict[str, str]:
    """The environment of a user's shell with ``venv`` activated: nothing of this repository in it."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP"}
        and not k.startswith(("MONGOLOCK_", "CELERY_"))
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
        # The pinned set of `make test` (requirements/lock.txt): the wheel's own requirements are what is
        # tested here, and a release of a dependency since the last `make lock` must not change the run.
        [str(python), "-m", "pip", "install", "--quiet", "-c", str(LOCK), f"{wheel}[embedded,redis]"],
        cwd=tmp_path,
        env=_clean_env(venv),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    project = tmp_path / "project"
    project.mkdir()
    os.mkfifo(project / "a.fifo")
    (project / "b.csv").write_text("cy@example.com\n")
    events = tmp_path / "events.jsonl"
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
        code = readme_block("Quick start", "python")
        assert 'broker="redis://localhost:6379/0"' in code and '"mongodb://localhost:27017"' in code
        code = code.replace("redis://localhost:6379/0", redis.url).replace(
            "mongodb://localhost:27017", mongo_url
        )
        code = code.replace("redis://localhost:6379/1", redis.url.rsplit("/", 1)[0] + "/1")
        (project / "tasks.py").write_text(code + OBSERVE)
        (project / "client.py").write_text(CLIENT)
        env = _clean_env(venv, QS_EVENTS=str(events), QS_BACKEND=redis.url)
        worker_log = tmp_path / "worker.log"
        # The README's command (`celery -A tasks worker --loglevel=INFO`): the prefork pool, two children.
        worker = stack.enter_context(
            _process(
                [str(venv / "bin" / "celery"), "-A", "tasks", "worker", "--loglevel=INFO", "--concurrency=2"],
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
        if client.returncode != 0:  # let a run blocked on the pipe end before the worker is stopped
            with contextlib.suppress(OSError):
                os.close(os.open(project / "a.fifo", os.O_WRONLY | os.O_NONBLOCK))
        assert client.returncode == 0, (
            client.stdout + client.stderr + "\n--- worker log:\n" + worker_log.read_text()[-5000:]
        )
        assert worker.poll() is None, worker_log.read_text()[-5000:]

    out = json.loads(client.stdout.splitlines()[-1])
    first_id, second_id = out["ids"]
    assert out["results"] == [2, 1]
    log = [json.loads(line) for line in events.read_text().splitlines()]
    # The library came from the fresh virtualenv, in the client and in the worker's pool children.
    for module in [out["client_module"], *(e["module"] for e in log)]:
        assert Path(module).resolve().is_relative_to(venv.resolve()), module
    # The second call found the group held (and was retried); the holds never overlapped.
    assert any(e["kind"] == "contended" and e["task_id"] == second_id for e in log)
    holds = [(e["kind"], e["task_id"]) for e in log if e["kind"] in ("acquired", "released")]
    assert holds == [
        ("acquired", first_id),
        ("released", first_id),
        ("acquired", second_id),
        ("released", second_id),
    ]
    fences = [e["fence"] for e in log if e["kind"] == "acquired"]
    assert fences == sorted(fences) and fences[0] < fences[1]
    assert all(e["key"] == "email-group:42" for e in log)


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
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

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
