"""The lock-set checker's watch for a worker node that stops consuming without exiting (issue 26).

Twice in bounded runs on RabbitMQ, right after a broker restart, the one-process clock-skewed node kept
a finished task as active and then consumed nothing, with hundreds of messages ready in its queue, and
never exited: the supervisor (``Run.supervise``) replaces nodes that exit, so the run hung until stopped.

A node makes progress when one of its processes (the parent, which records each message it receives,
or a child, which records every admission, acquisition, write and release) appends to its history file.
A node is **stalled** when it is alive, its queue had messages ready at every look for longer than the
run's own allowance (``Run._stall_allowance``: the longest a healthy run goes without progress, from the
visibility timeout, the lease length and the slowest node start-up measured in the same run), and none
of its processes wrote anything in that time. A healthy node with messages ready takes one within its
prefetch, so the run's progress decides, not a constant. The checker records each stall as a finding in
the report (``node_stalls``), with the node's own thread dump, and replaces the node.

It cannot see a stalled node that shares its queue with a healthy one while that one keeps the queue
empty; the one node of its own queue here is the skewed node, where both stalls were seen.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

Doc = dict[str, Any]


@dataclasses.dataclass
class _Seen:
    """What the watch saw of one node process group (a replaced node starts afresh)."""

    since: float  # the last progress, or the last look at a queue with nothing ready
    mtime: float  # the newest history write of the node's processes (file time, compared for change)
    ready: int | None = None


def newest_write(hist_dir: Path, pids: Iterable[int]) -> float:
    """The newest modification time of the history files of ``pids`` (0.0 when none wrote yet)."""
    newest = 0.0
    for pid in pids:
        try:
            newest = max(newest, os.stat(hist_dir / f"hist-{pid}.jsonl").st_mtime)
        except OSError:
            continue
    return newest


class StallWatch:
    """Tells which nodes consumed nothing for longer than ``allowance()`` while their queue had messages
    ready. ``observe`` is called once a round per node; it returns a finding (a dict) for a stalled node,
    once per node process."""

    def __init__(
        self, hist_dir: Path, allowance: Callable[[], float], clock: Callable[[], float] = time.monotonic
    ):
        self.hist_dir = hist_dir
        self.allowance = allowance
        self.clock = clock
        self._seen: dict[int, _Seen] = {}

    def observe(self, name: str, pids: list[int], queue: str, ready: int | None) -> Doc | None:
        """``pids``: the node's parent first, then its children; ``ready``: the messages ready in its queue
        now (None: the broker did not answer)."""
        if not pids:
            return None
        now = self.clock()
        mtime = newest_write(self.hist_dir, pids)
        seen = self._seen.get(pids[0])
        if seen is None:
            self._seen[pids[0]] = _Seen(since=now, mtime=mtime, ready=ready)
            return None
        if mtime != seen.mtime or not ready:
            # Progress, or nothing to consume (ready 0), or the broker did not answer: nothing to judge.
            seen.since, seen.mtime = now, mtime
        seen.ready = ready
        quiet = now - seen.since
        allowance = self.allowance()
        if quiet <= allowance:
            return None
        del self._seen[pids[0]]
        return {
            "node": name, "pid": pids[0], "children": pids[1:], "queue": queue, "ready": ready,
            "quiet_s": round(quiet, 1), "allowance_s": round(allowance, 1),
        }  # fmt: skip

    def forget(self, pid: int) -> None:
        self._seen.pop(pid, None)


def process_states(pids: Iterable[int]) -> dict[int, str]:
    """Each process's state and kernel wait channel (``S pipe_read``...), from /proc: what a stalled
    node's processes were doing."""
    out: dict[int, str] = {}
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
        except OSError:
            continue
        out[pid] = f"{stat[0]} {wchan}"
    return out


def broker_ready(url: str, queue: str) -> int:
    """The messages ready (not delivered) in ``queue`` now: on RabbitMQ a passive declare (it takes no
    message; raises if the queue does not exist), on Redis the list's length."""
    if url.startswith("redis"):
        import redis

        client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        try:
            return int(client.llen(queue))
        finally:
            client.close()
    from kombu.connection import Connection

    connection: Any = Connection  # untyped
    with connection(url, connect_timeout=5) as conn:
        channel = conn.channel()
        try:
            return int(channel.queue_declare(queue=queue, passive=True).message_count)
        finally:
            channel.close()
