"""The manual tells the truth (issue 27).

* Every fenced Python block of README.md and docs/ compiles, its imports resolve, and it is checked one
  of these ways (``how_is_it_checked``): run by a test (the quick start, the testing how-to, the
  email-group upload: real workers, Redis and a MongoDB-compatible server); imported as a project with
  its tasks declared (the how-tos whose modules are headed ``# proj/<module>.py``); compared with the
  tested Django site; read as settings by the library; or marked as a fragment with
  ``<!-- fragment -->`` on the line before its fence (it continues the page's code or elides a body with
  ``...``; a fragment that declares a task is still run with an app of its own, so the declaration
  checks pass on it).
* Every ``celery ... mongolock COMMAND --option`` that a page names exists (compared with the CLI itself).
* Every row of docs/bad-input.md names a case of tests/test_bad_input.py, and its message column is the
  message that case gets today (``python -m tests.test_docs --write-bad-input`` rewrites the column).
* Pages do not claim "not supported yet" for what is built (each such claim is tried here).
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
FRAGMENT = "<!-- fragment -->"

_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)


class Block:
    def __init__(self, page: Path, line: int, lang: str, body: str, fragment: bool) -> None:
        self.page, self.line, self.lang, self.body, self.fragment = page, line, lang, body, fragment

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> Iterator[Block]:
    text = page.read_text()
    for m in _FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        indent = len(m.group("indent"))
        body = "\n".join(line[indent:] for line in m.group("body").splitlines())
        yield Block(page, text.count("\n", 0, m.start()) + 1, m.group("lang"), body, before == FRAGMENT)


PYTHON_BLOCKS = [b for page in PAGES for b in blocks(page) if b.lang in ("python", "py")]


def test_the_pages_have_python_blocks() -> None:
    assert len(PYTHON_BLOCKS) >= 35


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.where for b in PYTHON_BLOCKS])
def test_every_python_block_compiles(block: Block) -> None:
    try:
        ast.parse(block.body)
    except SyntaxError as exc:
        pytest.fail(f"{block.where}: a Python block that does not parse ({exc}):\n{block.body}")


def _module_names(body: str) -> list[str]:
    """The absolute imports of a block (its ``from .x import`` are the project's own modules)."""
    names = []
    for node in ast.walk(ast.parse(body)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [f"{node.module}:{a.name}" for a in node.names]
    return names


# Modules of a user's project that pages import (the how-tos name them; they are shown on their page).
PROJECT_MODULES = ("proj", "tasks", "emailgroups", "myproject", "mysite", "example_project", "conftest")


def test_every_import_of_a_complete_block_resolves() -> None:
    """A block that is not marked as a fragment imports only what exists: names of the library, of
    Celery and of the standard library (a misspelt or removed public name fails here)."""
    wanted: dict[str, set[str]] = {}
    for block in PYTHON_BLOCKS:
        if block.fragment:
            continue
        for name in _module_names(block.body):
            if name.split(":")[0].split(".")[0] in PROJECT_MODULES:
                continue
            wanted.setdefault(name, set()).add(block.where)
    script = (
        "import importlib, sys\n"
        "bad = []\n"
        "for name in sys.argv[1:]:\n"
        "    module, _, attr = name.partition(':')\n"
        "    try:\n"
        "        m = importlib.import_module(module)\n"
        "        if attr and attr != '*' and not hasattr(m, attr):\n"
        "            importlib.import_module(f'{module}.{attr}')\n"
        "    except Exception as exc:\n"
        "        bad.append(f'{name}: {type(exc).__name__}: {exc}')\n"
        "print('\\n'.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, *sorted(wanted)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    bad = [line for line in out.stdout.splitlines() if line]
    assert not bad, "\n".join(f"{b} (in {', '.join(sorted(wanted[b.split(': ')[0]]))})" for b in bad)


# -- the command line named by the pages ---------------------------------------------------------------


def _cli_tree() -> dict[str, set[str]]:
    """``celery mongolock``'s commands and each one's options, read from the click group itself."""
    import click

    from celery_mongolock.cli import mongolock

    assert isinstance(mongolock, click.Group)
    tree: dict[str, set[str]] = {}
    for name, command in mongolock.commands.items():
        options = {
            opt for p in command.params if isinstance(p, click.Option) for opt in p.opts + p.secondary_opts
        }
        tree[name] = options | {"--help"}
    return tree


_CLI_USE = re.compile(r"\bcelery\b(?:\s+-A\s+\S+)?\s+mongolock\s+(?P<rest>[^`\n|]*)")


def cli_uses() -> list[tuple[str, str, list[str]]]:
    """Every ``celery [-A app] mongolock COMMAND ...`` a page names: (where, command, options)."""
    found = []
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for m in _CLI_USE.finditer(line):
                words = m.group("rest").split()
                if not words or not re.fullmatch(r"[a-z][a-z-]*", words[0]):
                    continue
                options = [w.split("=")[0] for w in words[1:] if w.startswith("--")]
                found.append((f"{page.relative_to(ROOT)}:{number}", words[0], options))
    return found


def test_every_cli_command_and_option_a_page_names_exists() -> None:
    tree = _cli_tree()
    uses = cli_uses()
    assert len(uses) > 10
    wrong = [
        f"{where}: celery mongolock {command} {' '.join(options)}"
        for where, command, options in uses
        if command not in tree or not set(options) <= tree[command]
    ]
    assert not wrong, "commands or options that the CLI does not have:\n" + "\n".join(wrong)


def test_the_cli_reference_documents_every_command_and_option() -> None:
    reference = (ROOT / "docs" / "reference" / "cli.md").read_text()
    missing = [
        f"{command} {option}"
        for command, options in _cli_tree().items()
        for option in [f"`{command}", *sorted(o for o in options if o.startswith("--") and o != "--help")]
        if option not in reference
    ]
    assert not missing, f"docs/reference/cli.md does not name: {missing}"


# -- docs/bad-input.md against tests/test_bad_input.py --------------------------------------------------

BAD_INPUT = ROOT / "docs" / "bad-input.md"
_ROW = re.compile(r"^\|.*\| `(?P<test>test_\w+)\[(?P<id>[\w-]+)\]` \|$")


def normalize(message: str) -> str:
    """A message as the table shows it: task names as proj.upload, long runs of x shortened, addresses
    elided (a row may also end early with "…")."""
    message = re.sub(r"bad_input\.[at][0-9a-f]{8}", "proj.upload", message)
    message = re.sub(r"x{20,}", lambda m: f"xxx…({len(m.group())} x)", message)
    message = re.sub(r" at 0x[0-9a-f]+>", " at 0x…>", message)
    # Brackets escaped: "['t']['limit']" would be a Markdown reference link (mkdocs --strict refuses it).
    message = re.sub(r"([\[\]])", r"\\\1", message)
    return message.replace("|", "\\|").replace("\n", " ")


def _same(documented: str, actual: str) -> bool:
    # pymongo's own text (shown after ours as "(pymongo: ...)") changes between releases and orders sets
    # by hash: only our words are compared.
    documented, actual = (m.split(" (pymongo: ")[0] for m in (documented, actual))
    if documented.endswith("…"):
        return actual.startswith(documented[:-1])
    return documented == actual


def _bad_input_calls() -> dict[str, Callable[[], Any]]:
    """Each case of tests/test_bad_input.py with a message in the table, as a call that raises it (the
    command-line cases run a process each and are checked by their own test)."""
    from celery_mongolock import LeaseStore
    from celery_mongolock.config import read_settings

    from . import test_bad_input as cases

    store = LeaseStore("mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=300", operation_timeout=0.5)
    calls: dict[str, Callable[[], Any]] = {}
    for family, params in cases.FAMILIES.items():
        for p in params:
            test_id = f"{family}[{p.id}]"
            if family == "test_bad_command_line_arguments":
                continue
            if family == "test_bad_urls":
                calls[test_id] = functools.partial(read_settings, {"mongolock_url": p.values[0]})
            elif family in ("test_bad_lease_keys", "test_bad_acquire_arguments"):
                calls[test_id] = functools.partial(p.values[0], store)
            else:
                calls[test_id] = p.values[0]
    return calls


def _message(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as exc:
        return normalize(str(exc))
    return "(accepted: no error)"


def _rows() -> dict[str, tuple[int, list[str]]]:
    rows = {}
    for number, line in enumerate(BAD_INPUT.read_text().splitlines()):
        m = _ROW.match(line)
        if m:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows[f"{m.group('test')}[{m.group('id')}]"] = (number, cells)
    return rows


def test_every_row_of_the_bad_input_table_is_a_case_that_exists() -> None:
    from . import test_bad_input as cases

    ids = {f"{family}[{p.id}]" for family, params in cases.FAMILIES.items() for p in params}
    stale = sorted(
        test_id for test_id in _rows() if test_id.split("[")[0] in cases.FAMILIES and test_id not in ids
    )
    assert not stale, f"rows of docs/bad-input.md whose case no longer exists (it is accepted now?): {stale}"


def test_every_message_in_the_bad_input_table_is_the_message_given() -> None:
    rows = _rows()
    wrong = []
    for test_id, call in _bad_input_calls().items():
        if test_id not in rows:
            continue  # test_bad_input.py checks that every case has a row
        documented = rows[test_id][1][3]
        actual = _message(call)
        if not _same(documented, actual):
            wrong.append(f"{test_id}\n  documented: {documented}\n  given:      {actual}")
    assert not wrong, (
        "docs/bad-input.md shows messages the library no longer gives (python -m tests.test_docs "
        "--write-bad-input rewrites them):\n" + "\n".join(wrong)
    )


def write_bad_input_messages() -> None:
    """Rewrite the message column of every row whose message changed."""
    lines = BAD_INPUT.read_text().splitlines(keepends=True)
    rows = _rows()
    for test_id, call in _bad_input_calls().items():
        if test_id not in rows:
            continue
        number, cells = rows[test_id]
        actual = _message(call)
        if not _same(cells[3], actual):
            cells[3] = actual
            lines[number] = "| " + " | ".join(cells) + " |\n"
    BAD_INPUT.write_text("".join(lines))


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-bad-input"]:
        write_bad_input_messages()
    else:
        sys.exit("usage: python -m tests.test_docs --write-bad-input")


# -- "not supported yet" claims, tried ------------------------------------------------------------------


def _declare(**options: Any) -> Any:
    from celery import Celery

    from celery_mongolock import singleton_task

    app = Celery("docs_claims", set_as_current=False)

    def sync(src: int, dst: int) -> None: ...

    import uuid

    return singleton_task(app=app, name=f"docs.claims.{uuid.uuid4().hex[:8]}", **options)(sync)


def _task_policy(**options: Any) -> Any:
    from celery_mongolock.config import read_settings

    return read_settings({"mongolock_task_policies": {"proj.sync": options}})


KEYS = ("g:{src}", "g:{dst}")
# (page, the words of the claim): a call that the claim says is refused.
REFUSED: dict[tuple[str, str], Callable[[], Any]] = {}
REFUSED[("docs/reference/policies.md", "`cancel_running` with `limit=N`, or with a")] = lambda: _declare(
    keys=KEYS, limit={"g:{src}": 3}, on_contention={"policy": "replace", "cancel_running": True}
)
# What pages say works (issue 27: pages said these were refused).
ACCEPTED: dict[tuple[str, str], Callable[[], Any]] = {
    ("docs/how-to/several-keys.md", "With `max_wait`, a set that keeps receiving sends still runs"): lambda: (
        _declare(keys=KEYS, on_contention={"policy": "replace", "debounce": 2, "max_wait": 10})
    ),
    ("docs/how-to/several-keys.md", "`Replace()` takes a limit per key too"): lambda: _declare(
        keys=KEYS, limit={"g:{src}": 3}, on_contention="replace"
    ),
    (
        "docs/how-to/several-keys.md",
        "`limit=N` (an int) gives every key N slots and works the same way",
    ): lambda: _declare(keys=KEYS, limit=2, on_contention="replace"),
    ("docs/how-to/per-tenant-limit.md", "Every policy takes it. With `Replace`"): lambda: [
        _declare(keys=("t:{src}", "g:{dst}"), limit={"t:{src}": 3}, on_contention=p)
        for p in ("retry", "skip", "wait", "fail", "queue", "replace")
    ],
    ("docs/reference/policies.md", "A limit per key with `Replace` and `keys=` works"): lambda: _declare(
        keys=KEYS, limit=2, on_contention="replace"
    ),
    ("docs/reference/settings.md", "(with a limit per key too)"): lambda: _task_policy(
        keys=KEYS, limit=3, on_contention="replace"
    ),
    ("docs/how-to/several-keys.md", "and with `Queue`: on a key with slots the run parks"): lambda: _declare(
        keys=KEYS, limit={"g:{src}": 3}, on_contention="queue"
    ),
    ("docs/how-to/per-tenant-limit.md", "With `Queue` (and `Replace`), a run takes its keys one"): lambda: (
        _task_policy(keys=KEYS, limit=3, on_contention="queue")
    ),
    ("docs/how-to/per-tenant-limit.md", "`min_hold_seconds` works per slot"): lambda: _declare(
        key="t:{src}", limit=3, min_hold_seconds=60, on_contention="queue"
    ),
    ("docs/how-to/per-tenant-limit.md", "With every policy: `Retry`, `Skip`, `Wait` and `Fail`"): lambda: [
        _declare(key="t:{src}", limit=3, min_hold_seconds=5, on_contention=p)
        for p in ("retry", "skip", "wait", "fail", "queue", "replace")
    ],
    ("docs/how-to/per-tenant-limit.md", "`min_hold_seconds` applies to every key of such a run"): lambda: [
        _declare(keys=KEYS, limit={"g:{src}": 3}, min_hold_seconds=5, on_contention=p)
        for p in ("retry", "skip", "wait", "fail")
    ],
    ("docs/how-to/per-tenant-limit.md", "min_hold_seconds"): lambda: _task_policy(
        limit=3, min_hold_seconds=60, on_contention="replace"
    ),
    ("docs/how-to/per-tenant-limit.md", "A limit per key, with several keys"): lambda: _declare(
        keys=("t:{src}", "g:{dst}"), limit={"t:{src}": 3}, on_contention="retry"
    ),
    ("docs/reference/settings.md", "a dict from key specs to limits"): lambda: _task_policy(
        keys=("t:{src}", "g:{dst}"), limit={"t:{src}": 3}
    ),
    ("docs/how-to/per-tenant-limit.md", "`Queue()` is the one to use"): lambda: _declare(
        key="t:{src}", limit=3, on_contention="queue"
    ),
    ("docs/reference/policies.md", "With `keys=(...)`, `Queue` takes the keys one at a time"): lambda: (
        _declare(keys=KEYS, on_contention="queue")
    ),
    ("docs/how-to/several-keys.md", "`Replace(debounce=5)` with `keys=(...)` is the trailing-edge"): lambda: (
        _declare(keys=KEYS, on_contention={"policy": "replace", "debounce": 5})
    ),
    ("docs/reference/policies.md", "With `max_wait=m` too (`m >= d`)"): lambda: _declare(
        key="g:{src}", on_contention={"policy": "replace", "debounce": 2, "max_wait": 10}
    ),
    ("docs/reference/policies.md", "`Replace(debounce=d)` with `keys=` debounces per set"): lambda: (
        _task_policy(keys=KEYS, on_contention={"policy": "replace", "debounce": 2})
    ),
    ("docs/reference/settings.md", "with `Queue`, a run parks until it can have every key"): lambda: (
        _task_policy(keys=KEYS, on_contention="queue")
    ),
    ("docs/reference/policies.md", "`Replace` with `keys=` takes the keys one at a time"): lambda: _declare(
        keys=KEYS, on_contention="replace"
    ),
    ("docs/how-to/several-keys.md", "`Replace()` with `keys=(...)` is latest-wins"): lambda: _declare(
        keys=KEYS, on_contention="replace"
    ),
    ("docs/reference/settings.md", "with `Replace` too"): lambda: _task_policy(
        keys=KEYS, on_contention="replace"
    ),
}


@pytest.mark.parametrize(("where", "call"), list(REFUSED.items()), ids=[f"{p}:{w[:30]}" for p, w in REFUSED])
def test_what_a_page_says_is_refused_is_refused(where: tuple[str, str], call: Callable[[], Any]) -> None:
    from celery_mongolock import ConfigurationError

    page, words = where
    assert words in (ROOT / page).read_text(), f"{page} no longer says {words!r}: update this test"
    with pytest.raises(ConfigurationError, match="is not possible"):  # (no pair is "not supported yet")
        call()


@pytest.mark.parametrize(
    ("where", "call"), list(ACCEPTED.items()), ids=[f"{p}:{w[:30]}" for p, w in ACCEPTED]
)
def test_what_a_page_says_works_is_accepted(where: tuple[str, str], call: Callable[[], Any]) -> None:
    page, words = where
    assert words in (ROOT / page).read_text(), f"{page} no longer says {words!r}: update this test"
    call()


_CLAIM = re.compile(r"not supported yet|refused with a limit|not (yet )?(built|implemented)", re.I)


def test_every_not_supported_claim_of_the_manual_is_tried() -> None:
    """A "not supported yet" in a how-to or a reference page (or the README) is in REFUSED, so it is
    tried; the design notes and the bad-input table are checked by their own tests."""
    tried = {page for page, _ in REFUSED}
    pages = [
        ROOT / "README.md",
        *(ROOT / "docs" / "how-to").glob("*.md"),
        *(ROOT / "docs" / "reference").glob("*.md"),
    ]
    untried = [
        f"{page.relative_to(ROOT)}:{n}: {line.strip()}"
        for page in pages
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if _CLAIM.search(line) and str(page.relative_to(ROOT)) not in tried
    ]
    assert not untried, "claims nobody tries (add them to REFUSED):\n" + "\n".join(untried)


def _section(text: str, title: str) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_site_and_the_readme_give_one_quick_start() -> None:
    """docs/index.md's quick start is the README's (run by tests/test_quickstart.py), links aside."""
    readme = _section((ROOT / "README.md").read_text(), "Quick start").replace("](docs/", "](")
    site = _section((ROOT / "docs" / "index.md").read_text(), "Quick start")
    assert site == readme, "docs/index.md's quick start differs from the README's: copy the README's"


# -- the how-tos' projects, run as written --------------------------------------------------------------

_PATH_LINE = re.compile(r"# (?P<path>[\w./-]+\.py)$")


def project_files(page: Path) -> dict[str, str]:
    """The page's complete modules: every block that is not a fragment and whose first line names its file
    (``# proj/tasks.py``), by that path."""
    files = {}
    for block in blocks(page):
        first = block.body.split("\n", 1)[0]
        m = _PATH_LINE.fullmatch(first)
        if block.lang == "python" and not block.fragment and m:
            files[m.group("path")] = block.body
    return files


def shell_lines(page: Path, section: str) -> list[str]:
    body = _section(page.read_text(), section)
    (block,) = [b for b in blocks(page) if b.lang == "sh" and b.body in body]
    return [line for line in block.body.splitlines() if line.strip()]


def _project_env() -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("MONGOLOCK_", "CELERY_"))}
    env.pop("PYTHONPATH", None)  # a new project: its own directory and the installed library only
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


class HowToProject:
    """A how-to's project written to ``root`` as printed (only the server addresses changed: the broker,
    the result backend and MongoDB are the test's), with a real prefork worker started by the page's own
    command."""

    def __init__(self, root: Path, files: dict[str, str], redis_url: str, mongo_url: str) -> None:
        self.root, self.mongo_url = root, mongo_url
        redis_base = redis_url.rsplit("/", 1)[0]
        for path, printed in files.items():
            code = printed.replace("redis://localhost:6379/0", f"{redis_base}/13")
            code = code.replace("redis://localhost:6379/1", f"{redis_base}/14")
            code = code.replace("mongodb://localhost:27017", mongo_url)
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(code)
        (root / "proj" / "__init__.py").write_text("")  # "an empty proj/__init__.py"
        self.log_path = root / "worker.log"
        self.worker: subprocess.Popen[bytes] | None = None

    def start_worker(self, command: str) -> None:
        from .servers import wait_for

        with open(self.log_path, "wb") as log:
            self.worker = subprocess.Popen(
                [*command.split(), "--without-gossip", "--without-mingle"],
                cwd=self.root,
                env=_project_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        worker = self.worker

        def ready() -> bool:
            assert worker.poll() is None, self.log()
            return "celery_mongolock: leases in" in self.log()

        wait_for(ready, timeout=60, message="the worker to start")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def run(self, command: str) -> str:
        """A command of the page, as printed (in bash); its output."""
        out = subprocess.run(
            ["bash", "-c", command],
            cwd=self.root,
            env=_project_env(),
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert out.returncode == 0, out.stdout + out.stderr + self.log()
        return out.stdout

    def stop(self) -> None:
        import os
        import signal

        if self.worker is not None and self.worker.poll() is None:
            self.worker.send_signal(signal.SIGTERM)
            try:
                self.worker.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.worker.pid, signal.SIGKILL)
                self.worker.wait(10)


@pytest.fixture
def how_to(redis_server: Any, tmp_path: Path) -> Iterator[Callable[[dict[str, str]], HowToProject]]:
    from celery_mongolock.embedded import EmbeddedMongo

    projects: list[HowToProject] = []
    with EmbeddedMongo() as mongo:

        def make(files: dict[str, str]) -> HowToProject:
            projects.append(HowToProject(tmp_path, files, redis_server.url, mongo.url))
            return projects[-1]

        try:
            yield make
        finally:
            for project in projects:
                project.stop()


@pytest.mark.slow
def test_the_email_group_upload_how_to_runs_as_written(
    how_to: Callable[[dict[str, str]], HowToProject],
) -> None:
    """docs/how-to/email-group-upload.md: its modules written to a new project as printed, its commands
    run as printed, a real prefork worker."""
    from pymongo import MongoClient

    page = ROOT / EMAIL_GROUP_PAGE
    files = project_files(page)
    assert sorted(files) == ["proj/celery.py", "proj/storage.py", "proj/tasks.py", "send.py"]
    create, start_worker, send = shell_lines(page, "3. Send uploads as usual")
    assert start_worker == "celery -A proj worker --loglevel=INFO" and send == "python send.py"
    project = how_to(files)
    project.run(create)
    project.start_worker(start_worker + " --concurrency=2")
    lines = project.run(send).splitlines()
    assert lines[1] == "second: 1", lines
    assert lines[0] == "first: 2" or lines[0].startswith("first: {'mongolock': 'superseded'"), lines
    client: MongoClient[dict[str, Any]] = MongoClient(project.mongo_url)
    try:
        members = sorted(d["email"] for d in client["proj"]["members"].find({"group": 42}))
        group = client["proj"]["groups"].find_one({"_id": 42})
    finally:
        client.close()
    assert members == ["cy@example.com"]
    assert group is not None and group["upload"] == "u-1002" and group["state"] == "done"
    assert "Traceback" not in project.log()


@pytest.mark.slow
def test_the_per_tenant_limit_how_to_runs_as_written(
    how_to: Callable[[dict[str, str]], HowToProject],
) -> None:
    """docs/how-to/per-tenant-limit.md on the email-group upload's proj/celery.py: its "Try it" commands,
    a real prefork worker of 4 slots, at most 3 runs of tenant 42 at once."""
    base = {p: c for p, c in project_files(ROOT / EMAIL_GROUP_PAGE).items() if p.startswith("proj/")}
    page = ROOT / "docs" / "how-to" / "per-tenant-limit.md"
    files = {**base, **project_files(page)}
    start_worker, send = shell_lines(page, "Try it")
    project = how_to(files)
    project.start_worker(start_worker)
    out = project.run(send)
    (line,) = [line for line in out.splitlines() if line.startswith("slots used:")]
    slots = ast.literal_eval(line.split(":", 1)[1].strip())
    assert slots and set(slots) <= {0, 1, 2}, out
    assert project.log().count("syncing tenant 42 since 2026-11-01 in slot") == 6, project.log()
    assert "Traceback" not in project.log()


@pytest.mark.slow
def test_the_several_keys_how_to_runs_as_written(how_to: Callable[[dict[str, str]], HowToProject]) -> None:
    """docs/how-to/several-keys.md on the email-group upload's proj/celery.py and proj/storage.py: its
    "Try it" commands, a real prefork worker; the merge holds both keys and moves the members."""
    base = {p: c for p, c in project_files(ROOT / EMAIL_GROUP_PAGE).items() if p.startswith("proj/")}
    page = ROOT / "docs" / "how-to" / "several-keys.md"
    start_worker, send = shell_lines(page, "Try it")
    project = how_to({**base, **project_files(page)})
    project.start_worker(start_worker)
    out = project.run(send).splitlines()
    assert out == [
        "keys: ['email-group:7', 'email-group:8']",
        "moved: 1",
        "group 8: ['ann@example.com', 'bob@example.com']",
    ], out
    assert "acquired ['email-group:7', 'email-group:8']" in project.log(), project.log()
    assert "Traceback" not in project.log()


# -- every block is run, loaded or marked a fragment ----------------------------------------------------

EMAIL_GROUP_PAGE = "docs/how-to/email-group-upload.md"
# Pages whose modules (blocks headed "# proj/<module>.py") are imported as a project, on top of the email
# group upload's proj/celery.py and proj/storage.py (the page's own files win): declaring the tasks runs
# every declaration-time check. The email-group upload's project is also run (above).
PROJECT_PAGES = {
    EMAIL_GROUP_PAGE: ["proj.tasks.upload_members"],
    "docs/how-to/beat.md": ["proj.tasks.send_digest"],
    "docs/how-to/per-tenant-limit.md": ["proj.tasks.sync_tenant"],
    "docs/how-to/several-keys.md": ["proj.merge.merge_groups"],
    "docs/how-to/rate-limits.md": ["proj.tasks.call_partner_api", "proj.tasks.rebuild_search_index"],
    "docs/how-to/dedupe-sends.md": ["proj.tasks.rebuild_index", "proj.reports.daily_report"],
}
DJANGO_SITE_PAGE = "docs/how-to/django.md"
# Blocks run by tests elsewhere: (page, first line of the block) -> the test that runs it.
RUN_ELSEWHERE = {
    ("README.md", "# tasks.py"): "tests/test_quickstart.py::test_the_quick_start_runs_as_written",
    ("docs/index.md", "# tasks.py"): "test_the_site_and_the_readme_give_one_quick_start (the README's)",
    ("docs/how-to/testing.md", "import pytest"): "tests/test_quickstart.py::test_the_testing_example_runs...",
    ("docs/how-to/testing.md", "def test_a_second_upload_is_skipped(mongo_url):"): "the same test",
    ("docs/how-to/testing.md", "def test_uploads_of_one_group_share_a_key():"): "the same test",
    (
        "docs/how-to/document-lock.md",
        "# billing.py",
    ): "tests/test_document_lock.py::test_the_how_to_runs_as_written",
}


def _rel(block: Block) -> str:
    return str(block.page.relative_to(ROOT))


def _first_line(block: Block) -> str:
    return block.body.split("\n", 1)[0]


def _is_settings(block: Block) -> bool:
    return bool(re.fullmatch(r"# [\w/]+/settings\.py.*", _first_line(block)))


def how_is_it_checked(block: Block) -> str | None:
    if block.fragment:
        return "fragment"
    if (_rel(block), _first_line(block)) in RUN_ELSEWHERE:
        return "run"
    if _rel(block) in PROJECT_PAGES and _PATH_LINE.fullmatch(_first_line(block)):
        return "project"
    if _rel(block) == DJANGO_SITE_PAGE and _PATH_LINE.fullmatch(_first_line(block).split(" (")[0]):
        return "django-site"
    if _is_settings(block) or (_rel(block) == "docs/reference/settings.md" and "mongolock_" in block.body):
        return "settings"
    return None


def test_every_python_block_is_run_loaded_or_marked_a_fragment() -> None:
    """Issue 27: a block a reader copies either runs in CI (or is loaded: imported, declared, its settings
    read) or says it is a fragment (``<!-- fragment -->`` on the line before it)."""
    unchecked = [block.where for block in PYTHON_BLOCKS if how_is_it_checked(block) is None]
    assert not unchecked, f"blocks neither run nor marked <!-- fragment -->: {unchecked}"


def test_the_how_to_projects_import_and_declare_their_tasks(tmp_path: Path) -> None:
    base = project_files(ROOT / EMAIL_GROUP_PAGE)
    for page, tasks in PROJECT_PAGES.items():
        files = {**{p: c for p, c in base.items() if p.startswith("proj/")}, **project_files(ROOT / page)}
        project = tmp_path / Path(page).stem
        for path, code in files.items():
            (project / path).parent.mkdir(parents=True, exist_ok=True)
            (project / path).write_text(code)
        (project / "proj" / "__init__.py").write_text("")
        modules = sorted({name.rsplit(".", 1)[0] for name in tasks})
        script = (
            f"import {', '.join(modules)}\n"
            "from proj.celery import app\n"
            "app.finalize()\n"
            "print(sorted(name for name in app.tasks if name.startswith('proj.')))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", script],
            cwd=project,
            env=_project_env(),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == 0, f"{page}: {out.stderr}"
        assert set(tasks) <= set(ast.literal_eval(out.stdout.strip())), f"{page}: {out.stdout}"


def _without_environment(code: str) -> str:
    """The example site reads its addresses from the environment; the page shows their defaults."""
    return re.sub(r'os\.environ\.get\("\w+", ("[^"]*")\)', r"\1", code)


def _code_lines(code: str) -> list[str]:
    lines = []
    for line in code.splitlines():
        bare = re.sub(r"\s+#.*$", "", line).strip() if not line.lstrip().startswith("#") else ""
        if bare:
            lines.append(re.sub(r"\s+", " ", bare))
    return lines


def test_the_django_how_to_shows_the_tested_site() -> None:
    """docs/how-to/django.md walks through example_project/django_site (run by tests/test_django.py with a
    real worker): every line of code it shows is in that file."""
    site = ROOT / "example_project" / "django_site"
    shown = [b for b in blocks(ROOT / DJANGO_SITE_PAGE) if how_is_it_checked(b) == "django-site"]
    assert len(shown) >= 4
    for block in shown:
        path = _first_line(block)[2:].split(" (")[0]
        actual = set(_code_lines(_without_environment((site / path).read_text())))
        missing = [line for line in _code_lines(block.body) if line not in actual]
        assert not missing, f"{block.where}: lines not in {site.name}/{path}: {missing}"


SETTINGS_CHECK = """
import sys, types
from celery import Celery
from celery_mongolock.config import read_settings
module = types.ModuleType("docs_settings")
exec(sys.stdin.read(), module.__dict__)
app = Celery("docs", set_as_current=False)
django_style = any(k.startswith("CELERY_") for k in vars(module))
app.config_from_object(module, namespace="CELERY" if django_style else None)
read_settings(app.conf)
"""


def test_the_settings_a_page_shows_are_valid_settings() -> None:
    """Every settings module a page shows (``# proj/settings.py``), and the reference's example, is read
    by the library as it would be at a worker's start: no typo, no unknown option, no bad value."""
    settings_blocks = [b for b in PYTHON_BLOCKS if how_is_it_checked(b) == "settings" or _is_settings(b)]
    assert len(settings_blocks) >= 3
    for block in settings_blocks:
        out = subprocess.run(
            [sys.executable, "-c", SETTINGS_CHECK],
            input=block.body,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == 0, f"{block.where}: {out.stderr.strip().splitlines()[-1:]}"


DECLARE_FRAGMENTS = """
import json, sys
from celery import Celery
import celery_mongolock
blocks = json.load(sys.stdin)
# A fragment continues its page: the library's public names are imported, an app is made.
public = {name: getattr(celery_mongolock, name) for name in celery_mongolock.__all__}
failed = []
for i, (where, body) in enumerate(blocks):
    app = Celery(f"docs{i}", set_as_current=False, broker="memory://")
    try:
        exec(compile(body, where, "exec"), {**public, "__name__": f"docs.block{i}", "app": app})
        app.finalize()
    except Exception as exc:
        failed.append(f"{where}: {type(exc).__name__}: {exc}")
print(json.dumps(failed))
"""


def test_fragments_that_declare_tasks_declare_them() -> None:
    """A fragment that declares a singleton task is run with an ``app`` of its own: the declaration-time
    checks (key templates against the signature, policy, limit and keys) pass on what the page shows."""
    import json

    chosen = [
        (b.where, b.body)
        for b in PYTHON_BLOCKS
        if b.fragment
        and "singleton_task" in b.body
        and "from ." not in b.body
        and not b.page.is_relative_to(ROOT / "docs" / "design")
    ]
    assert len(chosen) >= 3
    out = subprocess.run(
        [sys.executable, "-c", DECLARE_FRAGMENTS],
        input=json.dumps(chosen),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(out.stdout) == []


# -- every mongolock_* name a page uses exists ----------------------------------------------------------

# Misspellings the pages show on purpose (what a typo gets), environment variables of examples.
SHOWN_AS_TYPOS = {"mongolock_lease_second", "mongolock_on_contension", "celery_mongolock_lease_second"}
ENVIRONMENT = {"mongolock_test_mongodb_url", "mongolock_password"}


def _known_mongolock_names() -> set[str]:
    from celery_mongolock import SingletonTask
    from celery_mongolock.config import KNOWN_SETTINGS
    from celery_mongolock.integration import duplicates, task
    from celery_mongolock.integration import handoff as _queue
    from celery_mongolock.integration import headers as _headers

    names = {n.lower() for n in KNOWN_SETTINGS}
    names |= {n for n in dir(SingletonTask) if n.startswith("mongolock_")}
    for module in (_headers, _queue, duplicates, task):
        names |= {str(v) for k, v in vars(module).items() if k.endswith("_HEADER") and isinstance(v, str)}
    return names | {"mongolock_beat_"}  # "mongolock_beat_*", the beat's settings


def test_every_mongolock_name_a_page_uses_exists() -> None:
    """A setting, task attribute, method or message header named ``mongolock_*`` on a page (README, how-to,
    reference, discussions; not the design record, which also names what was not built) is one the library
    has, in any case and with Django's ``CELERY_`` namespace."""
    known = _known_mongolock_names() | SHOWN_AS_TYPOS | ENVIRONMENT
    pages = [p for p in PAGES if not p.is_relative_to(ROOT / "docs" / "design")]
    unknown = sorted(
        {
            f"{page.relative_to(ROOT)}: {word}"
            for page in pages
            for word in re.findall(r"\b(?:CELERY_)?(?:MONGOLOCK|mongolock)_[A-Za-z_]+", page.read_text())
            if word.lower().removeprefix("celery_") not in known and word.lower() not in known
        }
    )
    assert not unknown, f"names the library does not have: {unknown}"


def _logger_names() -> set[str]:
    names = set()
    for path in (ROOT / "celery_mongolock").rglob("*.py"):
        names |= set(re.findall(r'getLogger\("(celery_mongolock[\w.]*)"\)', path.read_text()))
    return names


def test_every_celery_mongolock_name_a_page_uses_exists() -> None:
    """``celery_mongolock.x.y`` on a page (not the design record) is a module or attribute of the library,
    one of its loggers, or the default lease collection ``celery_mongolock.leases``."""
    import importlib

    pages = [p for p in PAGES if not p.is_relative_to(ROOT / "docs" / "design")]
    names = {
        name
        for page in pages
        for name in re.findall(r"\bcelery_mongolock(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?", page.read_text())
    }
    assert len(names) > 20
    known = _logger_names() | {"celery_mongolock.leases"}

    def resolves(name: str) -> bool:
        parts = name.replace(":", ".").split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj: Any = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attr in parts[cut:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
        return False

    missing = sorted(name for name in names if name not in known and not resolves(name))
    assert not missing, f"names the library does not have: {missing}"


# -- the start-up errors the pages show are the library's -------------------------------------------------


def _key_template_error() -> Any:
    from celery import Celery

    from celery_mongolock import singleton_task

    def g(group_id: int) -> None: ...

    return singleton_task(key="email-group:{gid}", name="tasks.g", app=Celery("tasks", set_as_current=False))(
        g
    )


def _django_settings(**settings: Any) -> Any:
    from celery import Celery

    from celery_mongolock.config import read_settings

    app = Celery("docs_django", set_as_current=False)
    app.config_from_object(type("Settings", (), settings), namespace="CELERY")
    return read_settings(app.conf)


def _settings(**settings: Any) -> Any:
    from celery_mongolock.config import read_settings

    return read_settings(settings)


# What each shown message is given for.
START_ERRORS: dict[str, Callable[[], Any]] = {
    "mongolock_lease_seconds must be between 0.5 and 2.592e+06 seconds, got -1": lambda: _settings(
        mongolock_lease_seconds=-1
    ),
    (
        "unknown setting 'CELERY_MONGOLOCK_LEASE_SECOND'; did you mean 'CELERY_MONGOLOCK_LEASE_SECONDS'?"
    ): lambda: _django_settings(CELERY_MONGOLOCK_LEASE_SECOND=60),
    "task 'tasks.g': key template 'email-group:{gid}' names 'gid', which is not an argument of g(group_id)": (
        _key_template_error
    ),
    "mongolock_task_policies['groups.tasks.upload_members'] has unknown option(s) ['lease_secs'] (did you "
    "mean 'lease_seconds' for 'lease_secs'?); known: ['on_contention', 'lease_seconds', 'heartbeat_seconds', "
    "'min_hold_seconds', 'limit', 'keys', 'rate', 'unique_send', 'unique_send_seconds']": lambda: _settings(
        mongolock_task_policies={"groups.tasks.upload_members": {"lease_secs": 60}}
    ),
}


def test_the_start_up_errors_a_page_shows_are_the_ones_given() -> None:
    from celery_mongolock import ConfigurationError

    shown = {
        line.split("celery_mongolock: cannot start: ", 1)[1].strip()
        for page in PAGES
        if not page.is_relative_to(ROOT / "docs" / "design")
        for line in page.read_text().splitlines()
        if "celery_mongolock: cannot start: " in line
    }
    assert shown, "no page shows a start-up error"
    assert not shown - set(START_ERRORS), f"add these to START_ERRORS: {sorted(shown - set(START_ERRORS))}"
    for message in shown:
        with pytest.raises(ConfigurationError) as info:
            START_ERRORS[message]()
        assert str(info.value) == message
