"""`make demo` as a user runs it: the example project's demo, on embedded defaults, ends green."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_runs_and_ends_with_its_summary_and_timeline(tmp_path: Path) -> None:
    timeline = tmp_path / "timeline.html"
    out = subprocess.run(
        [sys.executable, "example_project/demo.py", "--timeline", str(timeline), "--groups", "3"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "summary" in out.stdout and "overlaps              0" in out.stdout
    assert "all invariants held" in out.stdout
    assert "beat failovers        1" in out.stdout
    page = timeline.read_text()
    assert "<svg" in page and "email-group:1" in page and "beat leader killed" in page
    # Nothing left running: no worker or beat of this demo survives it.
    ps = subprocess.run(["pgrep", "-f", "celery -A emailgroups"], capture_output=True, text=True, check=False)
    assert ps.stdout.strip() == ""


def test_store_demo_runs() -> None:
    out = subprocess.run(
        [sys.executable, "example_project/store_demo.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "all invariants held" in out.stdout
