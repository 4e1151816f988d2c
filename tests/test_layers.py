"""The import-layering contracts (``[tool.importlinter]`` in pyproject.toml, run by ``make lint``) cover
every module of the package, so a new module gets a place in the layers instead of escaping them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "celery_mongolock"


def _contracts() -> list[dict[str, object]]:
    if sys.version_info < (3, 11):
        pytest.skip("reads pyproject.toml with tomllib (Python 3.11+)")
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contracts: list[dict[str, object]] = config["contracts"]
    return contracts


def test_every_module_has_a_layer() -> None:
    (layers,) = [c for c in _contracts() if c["type"] == "layers"]
    raw = layers["layers"]
    assert isinstance(raw, list)
    listed = {name.strip() for layer in raw for name in str(layer).split("|")}
    modules = {p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("__")}
    missing = sorted(modules - listed)
    assert not missing, f"add these modules to the layers contract in pyproject.toml: {missing}"
    assert not sorted(listed - modules), "the layers contract names modules that do not exist"


def test_the_core_is_the_bottom_of_the_layers() -> None:
    """Every module below the Celery glue is in the no-Celery contract, and only those."""
    contracts = _contracts()
    (layers,) = [c for c in contracts if c["type"] == "layers"]
    (forbidden,) = [c for c in contracts if c["type"] == "forbidden"]
    raw = layers["layers"]
    sources = forbidden["source_modules"]
    assert isinstance(raw, list) and isinstance(sources, list)
    names = [str(layer) for layer in raw]
    core = {name.strip() for layer in names[names.index("store") :] for name in layer.split("|")}
    assert {s.removeprefix("celery_mongolock.") for s in sources} == core
