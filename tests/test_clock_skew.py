"""Lease expiry does not depend on worker wall clocks: processes ten minutes fast or slow (libfaketime)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .servers import wait_for

pytestmark = [
    pytest.mark.faketime,
    pytest.mark.skipif(
        shutil.which("faketime") is None, reason="libfaketime is not installed (apt-get install faketime)"
    ),
]

ROOT = Path(__file__).resolve().parents[1]


class Agent:
    """A tests/agent.py process, optionally with its wall clock shifted by libfaketime."""

    def __init__(self, url: str, db: str, offset: str | None = None) -> None:
        cmd = [sys.executable, "-m", "tests.agent", url, db]
        if offset is not None:
            cmd = ["faketime", "-f", offset, *cmd]
        # (its stderr, shown if it exits before it is ready; closed with the agent)
        self.errors = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errors,
            text=True,
            cwd=ROOT,
            # Shift only the wall clock, as on a machine whose clock is wrong: CLOCK_MONOTONIC keeps
            # counting real time (libfaketime would otherwise shift it too, and the kernel's timed waits
            # on that clock would then sleep for ten minutes or not at all).
            env={**os.environ, "PYTHONPATH": str(ROOT), "FAKETIME_DONT_FAKE_MONOTONIC": "1"},
        )
        try:
            ready = self._read()
        except BaseException:
            self._close()  # (its pipes, not left to the garbage collector in a later test)
            raise
        self.wall: float = ready["wall"]

    def _close(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        self.proc.wait(10)
        self.errors.close()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(5)
            self.errors.seek(0)
            said = self.errors.read().decode(errors="replace")[-2000:]
            raise AssertionError(f"agent exited with {code}: {said}")
        result: dict[str, Any] = json.loads(line)
        return result

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.errors.close()


@pytest.fixture
def agents(mongo_url: str, db_name: str) -> Iterator[Any]:
    made: list[Agent] = []

    def spawn(offset: str | None = None) -> Agent:
        agent = Agent(mongo_url, db_name, offset)
        made.append(agent)
        return agent

    yield spawn
    for agent in made:
        agent.close()


def test_faketime_really_shifts_the_wall_clock(agents: Any) -> None:
    fast, slow = agents("+10m"), agents("-10m")
    now = time.time()
    assert fast.ask("wall")["wall"] - now > 590
    assert now - slow.ask("wall")["wall"] > 590


@pytest.mark.parametrize("offset", ["+10m", "-10m"])
def test_a_skewed_process_cannot_take_a_live_lease(agents: Any, offset: str) -> None:
    holder = agents()
    assert holder.ask("acquire k 2 1")["ok"]  # 2 s lease, heartbeat every 0.4 s
    skewed = agents(offset)
    # For three lease lengths the skewed process keeps trying and never gets it.
    end = time.monotonic() + 6
    tries = 0
    while time.monotonic() < end:
        assert not skewed.ask("acquire k 2 0")["ok"]
        tries += 1
    assert tries > 5
    assert not holder.ask("state k")["lost"]


@pytest.mark.parametrize("offset", ["+10m", "-10m"])
def test_a_skewed_holder_keeps_its_lease_with_the_heartbeat(agents: Any, offset: str) -> None:
    skewed = agents(offset)
    assert skewed.ask("acquire k 2 1")["ok"]
    other = agents()
    end = time.monotonic() + 6
    while time.monotonic() < end:
        assert not other.ask("acquire k 2 0")["ok"]
    assert not skewed.ask("state k")["lost"]
    assert skewed.ask("release k")["ok"]
    assert other.ask("acquire k 2 0")["ok"]


@pytest.mark.parametrize("offset", ["+10m", "-10m"])
def test_a_skewed_holder_cannot_keep_a_dead_lease(agents: Any, offset: str) -> None:
    skewed = agents(offset)
    first = skewed.ask("acquire k 1 0")  # 1 s lease, no heartbeat: it dies
    assert first["ok"]
    other = agents()
    taken = wait_for(lambda: other.ask("acquire k 30 0")["ok"], timeout=10, message="takeover after expiry")
    assert taken
    assert skewed.ask("state k")["lost"]
    renew = skewed.ask("renew k")
    assert not renew["ok"]
    assert not skewed.ask("acquire k 1 0")["ok"]
