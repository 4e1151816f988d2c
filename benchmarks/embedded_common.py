"""What the embedded server's benchmarks share (``embedded_*.py``): the server as SecantusDB ships it,
without one of the patches ``EmbeddedMongo`` runs in its process, and the results file."""

from __future__ import annotations

import json
import platform
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from celery_mongolock.ops import embedded, server_patches  # noqa: E402 - after the path

__all__ = ["RESULTS", "ROOT", "as_shipped", "embedded", "server_patches", "variants_table", "write_results"]

RESULTS = ROOT / "benchmarks" / "results"


def as_shipped(*patches: str) -> type[embedded.EmbeddedMongo]:
    """``EmbeddedMongo`` whose server runs without ``patches`` (some of ``embedded``'s launch patches)."""
    if not patches or any(patch not in server_patches.LAUNCH for patch in patches):
        raise ValueError("not one of the embedded server's launch patches")
    launch = server_patches.LAUNCH
    for patch in patches:
        launch = launch.replace(patch, "")

    class AsShipped(embedded.EmbeddedMongo):
        def command(self) -> list[str]:
            cmd = super().command()
            cmd[cmd.index("-c") + 1] = launch
            return cmd

    return AsShipped


def write_results(name: str, out: str, data: dict[str, Any], target: str, met: bool) -> None:
    """Write ``data`` (with a Markdown ``summary``) as the JSON results of benchmark ``name`` to ``out``,
    with the machine, SecantusDB's version and whether ``target`` was met; print the summary."""
    data = {
        "benchmark": name,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "secantusdb": version("secantusdb"),
        **data,
        "target": target,
        "target_met": met,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(data, indent=2) + "\n")
    print(data["summary"])
    print(f"target ({target}): {'met' if met else 'MISSED'}")


def variants_table(label: str, rows: list[tuple[str, Any]], variants: dict[str, Any]) -> str:
    """A Markdown table of milliseconds: one row per ``(row label, key)``, one column per variant
    (``variants[name][key]``)."""
    lines = [f"| {label} | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
    for shown, key in rows:
        lines.append(f"| {shown} | " + " | ".join(f"{variants[v][key]:.1f} ms" for v in variants) + " |")
    return "\n".join(lines)
