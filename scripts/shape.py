#!/usr/bin/env python
"""The package's shape, checked: the largest modules and functions, and no module calling another
module's private names.

    .venv/bin/python scripts/shape.py         # the report; exit 1 on a reach into another module's privates
    .venv/bin/python scripts/shape.py --json  # the same as JSON

``make lint`` runs it. The size limits of the house style (a module under ~600 lines, a function under
~80) are printed as signals, not enforced: the redesign issue makes them true step by step. A call of
another module's ``_private`` name *is* enforced (exit 1), except for the allowances below, each with its
reason: private names are a module's own business, and a reach into them is a seam that should be a
public function of that module.

What counts as a reach: ``from .mod import _name``, ``mod._name`` where ``mod`` is a module of the package
imported by name, and ``obj._name`` on an object whose class is defined in another module of the package
(``lease._lock`` in ``store``: we cannot see types statically, so this one is matched by the attribute
names each class defines). Python's and other packages' privates (``os._exit``, pymongo's ``_ServerMode``)
are not ours to judge and are only listed.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "celery_mongolock"
MODULE_LINES = 600
FUNCTION_LINES = 80


@dataclass(frozen=True)
class Reach:
    module: str
    line: int
    what: str


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = ast.parse(path.read_text(), str(path))
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_private_attributes(tree: ast.Module) -> set[str]:
    """Private attribute names a module's classes define (``self._x = ...``, ``def _x``, ``_x: int``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and isinstance(node.ctx, ast.Store)
            and _private(node.attr)
        ):
            names.add(node.attr)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name):
                    names.add(item.name)
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
    return {n for n in names if _private(n)}


def reaches(modules: dict[str, ast.Module]) -> list[Reach]:
    """Calls and imports of another module's private names."""
    owners: dict[str, set[str]] = {}
    for name, tree in modules.items():
        for attr in _own_private_attributes(tree):
            owners.setdefault(attr, set()).add(name)
    found = []
    for name, tree in modules.items():
        package_aliases = _package_module_aliases(name, tree)
        mine = _own_private_attributes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").startswith(PACKAGE.name)
            ):
                for alias in node.names:
                    if _private(alias.name) and not _is_module(name, node, alias.name, modules):
                        found.append(
                            Reach(
                                name, node.lineno, f"from {'.' * node.level}{node.module} import {alias.name}"
                            )
                        )
            if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name):
                base = node.value.id
                if base in ("self", "cls") or _private(base):
                    continue
                if base in package_aliases:
                    found.append(
                        Reach(name, node.lineno, f"{base}.{node.attr} (module {package_aliases[base]})")
                    )
                elif node.attr not in mine and owners.get(node.attr, set()) - {name}:
                    found.append(Reach(name, node.lineno, f"{base}.{node.attr}"))
    return sorted(found, key=lambda r: (r.module, r.line))


def _package_module_aliases(name: str, tree: ast.Module) -> dict[str, str]:
    """Local names bound to modules of the package (``from . import _queue``, ``import x.y as z``)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level and not node.module:
            for alias in node.names:
                aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level:
            for alias in node.names:
                if alias.name[:1].islower():
                    aliases.setdefault(alias.asname or alias.name, f"{node.module}.{alias.name}")
    return aliases


def _is_module(name: str, node: ast.ImportFrom, imported: str, modules: dict[str, ast.Module]) -> bool:
    """``from . import _queue``: importing a private *module* of the package is how its parts are used."""
    parts = name.split(".")
    package = parts[: len(parts) - node.level] if node.level else []
    base = ".".join([*package, *(node.module.split(".") if node.module else [])])
    return f"{base}.{imported}" in modules


def sizes(modules: dict[str, ast.Module]) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    mods = []
    funcs = []
    for name, tree in modules.items():
        path = PACKAGE.parent / (name.replace(".", "/") + ".py")
        if not path.exists():
            path = PACKAGE.parent / name.replace(".", "/") / "__init__.py"
        mods.append((name, len(path.read_text().splitlines())))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
                funcs.append((f"{name}:{node.name}", node.end_lineno - node.lineno + 1))
    return sorted(mods, key=lambda m: -m[1]), sorted(funcs, key=lambda f: -f[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/shape.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--top", type=int, default=8, help="how many of the largest to list (default 8)")
    args = parser.parse_args(argv)
    modules = _modules()
    found = reaches(modules)
    mods, funcs = sizes(modules)
    big_mods = [m for m in mods if m[1] > MODULE_LINES]
    big_funcs = [f for f in funcs if f[1] > FUNCTION_LINES]
    if args.json:
        report = {
            "modules_over_limit": big_mods,
            "functions_over_limit": big_funcs,
            "largest_modules": mods[: args.top],
            "largest_functions": funcs[: args.top],
            "private_reaches": [asdict(r) for r in found],
        }
        print(json.dumps(report, indent=2))
    else:
        print(f"{len(modules)} modules, {sum(m[1] for m in mods)} lines")
        print(
            f"largest modules (signal: {MODULE_LINES} lines): "
            + ", ".join(f"{n} {c}" for n, c in mods[: args.top])
        )
        print(
            f"largest functions (signal: {FUNCTION_LINES} lines): "
            + ", ".join(f"{n} {c}" for n, c in funcs[: args.top])
        )
        print(f"over the signals: {len(big_mods)} modules, {len(big_funcs)} functions")
        for r in found:
            print(f"private reach: {r.module}:{r.line}: {r.what}")
    if found:
        print(f"{len(found)} reach(es) into another module's private names", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
