"""The lock-set checker's watch for a worker node that stops consuming without exiting (tests/nodewatch.py,
issue 26): its verdicts on made-up observations, and a real node whose consumer is stopped while its queue
has messages ready, on both brokers."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from . import lockcheck, nodewatch
from .nodewatch import StallWatch, broker_ready

pytestmark = pytest.mark.lockcheck


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _watch(tmp_path: Path, allowance: float = 10.0) -> tuple[StallWatch, Clock]:
    clock = Clock()
    return StallWatch(tmp_path, lambda: allowance, clock=clock), clock


def _touch(tmp_path: Path, pid: int, mtime: float) -> None:
    path = tmp_path / f"hist-{pid}.jsonl"
    path.write_text("{}\n")
    os.utime(path, (mtime, mtime))


def test_a_node_quiet_with_messages_ready_past_the_allowance_is_stalled(tmp_path: Path) -> None:
    watch, clock = _watch(tmp_path)
    _touch(tmp_path, 7, 1000.0)
    assert watch.observe("n1", [7, 8], "q", ready=5) is None
    clock.now += 10.0
    assert watch.observe("n1", [7, 8], "q", ready=5) is None  # not past the allowance yet
    clock.now += 0.5
    finding = watch.observe("n1", [7, 8], "q", ready=6)
    assert finding is not None
    assert finding["node"] == "n1" and finding["pid"] == 7 and finding["children"] == [8]
    assert finding["ready"] == 6 and finding["quiet_s"] == 10.5 and finding["allowance_s"] == 10.0
    # Reported once: the next look at the same process starts afresh.
    assert watch.observe("n1", [7, 8], "q", ready=6) is None


def test_a_history_write_of_any_of_the_nodes_processes_is_progress(tmp_path: Path) -> None:
    watch, clock = _watch(tmp_path)
    _touch(tmp_path, 8, 1000.0)
    watch.observe("n1", [7, 8], "q", ready=5)
    for step in range(5):
        clock.now += 6.0
        _touch(tmp_path, 8 if step % 2 else 7, 1001.0 + step)  # the parent's receipt or a child's write
        assert watch.observe("n1", [7, 8], "q", ready=5) is None


def test_no_message_ready_or_no_answer_from_the_broker_is_no_stall(tmp_path: Path) -> None:
    watch, clock = _watch(tmp_path)
    watch.observe("n1", [7], "q", ready=0)
    for ready in (0, None, 3, 0, 3, None):
        clock.now += 8.0  # never two looks with messages ready more than the allowance apart
        assert watch.observe("n1", [7], "q", ready=ready) is None


def test_a_replaced_node_starts_afresh(tmp_path: Path) -> None:
    watch, clock = _watch(tmp_path)
    watch.observe("n1", [7], "q", ready=4)
    clock.now += 9.0
    assert watch.observe("n1", [9], "q", ready=4) is None  # a new process group: first look
    clock.now += 9.0
    assert watch.observe("n1", [9], "q", ready=4) is None
    clock.now += 2.0
    assert watch.observe("n1", [9], "q", ready=4) is not None


def _node_env(tmp_path: Path, broker: str, mongo_url: str, backend: str) -> dict[str, str]:
    return {
        **os.environ, "PYTHONPATH": str(lockcheck.ROOT), "LOCKCHECK_BROKER": broker,
        "LOCKCHECK_BACKEND": backend, "LOCKCHECK_MONGODB_URL": mongo_url,
        "LOCKCHECK_DB": "nodewatch", "LOCKCHECK_LEASE": "2",
        "LOCKCHECK_READY_DIR": str(tmp_path), "LOCKCHECK_HIST_DIR": str(tmp_path / "hist"),
    }  # fmt: skip


@pytest.mark.timeout(2 * lockcheck.START_GUARD_S)
def test_a_real_node_whose_consumer_stops_is_found_stalled_and_a_running_one_is_not(
    tmp_path: Path, broker_url: str, mongo_url: str, redis_server: Any
) -> None:
    """A real prefork node consumes its queue (its receipts are progress); then its parent, the consumer,
    is stopped (SIGSTOP: alive, consuming nothing) while messages wait in its queue: the watch reports it
    once the node has been quiet for the allowance with messages ready at every look."""
    (tmp_path / "hist").mkdir()
    queue = f"nodewatch.{os.getpid()}.{int(time.monotonic() * 1000)}"
    env = _node_env(tmp_path, broker_url, mongo_url, redis_server.url)
    node = lockcheck.Node("watched@nodewatch", env, tmp_path, 1, queue)
    sender = Celery("nodewatch_sender")
    sender.conf.update(broker_url=broker_url, broker_transport_options={"confirm_publish": True})
    allowance = 3.0
    watch = StallWatch(tmp_path / "hist", lambda: allowance)

    def send(n: int, tag: str) -> None:
        for i in range(n):  # a plain Retry run each, on a key of its own
            key = f"{lockcheck.PREFIX}nodewatch-{tag}-{i}"
            sender.send_task("lockcheck.rmw", args=[key, f"{tag}-{i}", False], queue=queue)

    def look() -> dict[str, Any] | None:
        assert node.proc is not None
        ready = broker_ready(broker_url, queue)
        return watch.observe(node.name, [node.proc.pid, *node.child_pids()], queue, ready)

    def receipts() -> int:
        return sum(1 for e in lockcheck.read_histories(tmp_path / "hist") if e.get("ev") == "recv")

    try:
        node.start()
        # Running: it takes what is sent; every look until it has received all of them finds no stall.
        send(4, "live")
        deadline = time.monotonic() + lockcheck.START_GUARD_S
        while receipts() < 4:
            assert look() is None, "a node that is consuming was reported stalled"
            assert time.monotonic() < deadline, node.log_tail()
            time.sleep(0.2)
        assert node.proc is not None
        os.kill(node.proc.pid, signal.SIGSTOP)
        send(3, "stuck")
        t_stop = time.monotonic()
        finding = None
        while finding is None:
            finding = look()
            assert time.monotonic() - t_stop < lockcheck.START_GUARD_S, "the stalled node was never reported"
            time.sleep(0.2)
        assert finding["node"] == "watched@nodewatch" and finding["queue"] == queue
        assert finding["ready"] >= 1 and finding["quiet_s"] >= allowance
        states = nodewatch.process_states([finding["pid"]])
        assert states[finding["pid"]].startswith("T"), states  # stopped: what the watch saw
    finally:
        if node.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.proc.pid, signal.SIGCONT)
        node.stop()
        print(node.log_tail()[-2000:], file=sys.stderr)
