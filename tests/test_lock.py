"""The pinned sets (requirements/lock.txt, requirements/oldest.txt) pin every requirement the project
declares: a dependency added to pyproject.toml without `make lock` would be installed unpinned by
`make test`, and a new release of it could turn a landing red."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def _pinned(path: Path) -> set[str]:
    names: set[str] = set()
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)==", line)
        if match:
            names.add(canonicalize_name(match.group(1)))
    return names


def _declared(extras: list[str]) -> set[str]:
    if sys.version_info < (3, 11):
        pytest.skip("reads pyproject.toml with tomllib (Python 3.11+)")
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    own = canonicalize_name(project["name"])
    optional = project["optional-dependencies"]
    names: set[str] = set()
    todo = list(extras)
    seen: set[str] = set()
    requirements = [Requirement(r) for r in project["dependencies"]]
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        requirements += [Requirement(r) for r in optional[extra]]
    for req in requirements:
        if canonicalize_name(req.name) == own:
            todo_extras = [e for e in req.extras if e not in seen]
            names |= _declared(todo_extras) if todo_extras else set()
            continue
        names.add(canonicalize_name(req.name))
    return names


def test_the_lock_pins_every_requirement_of_the_dev_extra() -> None:
    missing = sorted(_declared(["dev"]) - _pinned(ROOT / "requirements" / "lock.txt"))
    assert not missing, f"not in requirements/lock.txt (run `make lock`): {missing}"


def test_the_oldest_set_pins_every_requirement_of_the_test_extra() -> None:
    missing = sorted(_declared(["test"]) - _pinned(ROOT / "requirements" / "oldest.txt"))
    assert not missing, f"not in requirements/oldest.txt (run `make lock`): {missing}"
