"""The import-layering contracts (``[tool.importlinter]`` in pyproject.toml, run by ``make lint``) cover
every module of the package, so a new module gets a place in the layers instead of escaping them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "celery_mongolock"
#: The four layers, bottom first: each a subpackage (docs/discussions/architecture.md).
LAYERS = ["core", "admission", "integration", "ops"]


def _contracts() -> list[dict[str, object]]:
    if sys.version_info < (3, 11):
        pytest.skip("reads pyproject.toml with tomllib (Python 3.11+)")
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contracts: list[dict[str, object]] = config["contracts"]
    return contracts


def _listed(contract: dict[str, object]) -> set[str]:
    raw = contract["layers"]
    assert isinstance(raw, list)
    return {name.strip() for layer in raw for name in str(layer).split("|")}


def _children(package: Path) -> set[str]:
    modules = {p.stem for p in package.glob("*.py") if not p.stem.startswith("__")}
    return modules | {p.parent.name for p in package.glob("*/__init__.py")}


def test_every_module_has_a_layer() -> None:
    """Every package with modules of its own has a layers contract naming each of its children."""
    by_container = {
        str(c["containers"][0]): c  # type: ignore[index]
        for c in _contracts()
        if c["type"] == "layers"
    }
    packages = [PACKAGE, *(p.parent for p in PACKAGE.rglob("*/__init__.py"))]
    for package in packages:
        name = ".".join(package.relative_to(ROOT).parts)
        assert name in by_container, f"add a layers contract for {name} in pyproject.toml"
        children = _children(package) - ({"__about__"} if package == PACKAGE else set())
        listed = _listed(by_container[name])
        missing = sorted(children - listed)
        assert not missing, f"add these modules of {name} to its layers contract in pyproject.toml: {missing}"
        assert not sorted(listed - children), f"the layers contract of {name} names modules that do not exist"


def test_the_layers_are_the_subpackages_in_order() -> None:
    (top,) = [c for c in _contracts() if c["type"] == "layers" and c["containers"] == ["celery_mongolock"]]
    raw = top["layers"]
    assert isinstance(raw, list)
    order = [str(layer).strip() for layer in raw]
    assert order[order.index("ops") :] == ["ops", *reversed(LAYERS[:-1]), "exceptions"]


def test_the_core_and_the_engine_are_free_of_celery() -> None:
    (forbidden,) = [c for c in _contracts() if c["type"] == "forbidden"]
    sources = forbidden["source_modules"]
    assert isinstance(sources, list)
    assert {s.removeprefix("celery_mongolock.") for s in sources} == {"core", "admission", "exceptions"}
