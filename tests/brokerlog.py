"""What the Redis broker did with each message, read back from its append-only file.

The lock-set checker runs Redis with ``appendonly yes`` and ``appendfsync always``: every write Redis
acknowledged is in the file, in the order Redis applied it, across crashes and restarts (a restarted
server appends to the same file). A blocking pop is written as the plain pop it became (``BRPOP q`` is
logged as ``RPOP q``), so replaying the list commands says exactly which message each pop took, without
timestamps. The checker adds those: a thread writes ``SET lockcheck:clock <monotonic seconds>`` every
tenth of a second, so every command in the file lies between two clock marks.

This is the proof behind ``lockcheck.lost_by_broker``: kombu's Redis transport takes a message off its
queue (``BRPOP``) *before* it records it as unacknowledged (``ZADD unacked_index`` + ``HSET unacked``,
one pipeline: ``kombu.transport.redis.QoS.append``). A consumer that dies in between (its node
SIGKILLed), or whose next command fails because the broker itself died, loses the message: the file
shows it popped and never recorded. celery/celery#7950 describes the same window.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict, deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CLOCK_KEY = b"lockcheck:clock"
UNACKED = b"unacked"


def parse_aof(data: bytes) -> Iterator[list[bytes]]:
    """The commands in an append-only file (RESP arrays of bulk strings), in order. A torn last command
    (a crash in mid-write) ends the iteration."""
    pos, n = 0, len(data)
    while pos < n:
        if data[pos : pos + 1] != b"*":
            # Redis writes nothing else at top level; stop at anything unexpected (a torn tail).
            return
        end = data.find(b"\r\n", pos)
        if end < 0:
            return
        count = int(data[pos + 1 : end])
        pos = end + 2
        args: list[bytes] = []
        for _ in range(count):
            end = data.find(b"\r\n", pos)
            if end < 0 or data[pos : pos + 1] != b"$":
                return
            size = int(data[pos + 1 : end])
            start = end + 2
            if start + size + 2 > n:
                return
            args.append(data[start : start + size])
            pos = start + size + 2
        yield args


@dataclasses.dataclass
class Copy:
    """One broker message (one delivery tag; a restored message keeps its tag, a retry gets a new one)."""

    tag: str
    task_id: str


@dataclasses.dataclass
class BrokerLog:
    """The replayed file: each message copy's steps, and pop -> record gaps seen for all messages."""

    copies: dict[str, Copy]
    #: Per task id, its copies' tags in the order they were first pushed.
    by_task: dict[str, list[str]]
    #: Ordered steps per tag: ("push" | "pop" | "record" | "remove", after_mark, before_mark).
    steps: dict[str, list[tuple[str, float, float]]]
    #: The longest time between a pop and its unacknowledged record seen in this file (upper bound from
    #: the clock marks), over every message that was recorded.
    max_pop_to_record_s: float
    commands: int

    def last_pop_unrecorded(self, task_id: str) -> tuple[str, float, float] | None:
        """If the task's last message copy was popped and never recorded as unacknowledged nor pushed
        again afterwards: (tag, clock mark before the pop, clock mark after it)."""
        tags = self.by_task.get(task_id) or []
        if not tags:
            return None
        # The newest copy: the one pushed last (a retry is a new copy; a restored one keeps its tag). Its
        # predecessors' acknowledgements can come after its pop in the file (a run publishes its retry,
        # then its message is acknowledged), so "the copy with the latest step" would be the wrong one.
        last_tag = max(tags, key=lambda t: self._last_push.get(t, -1))
        steps = self.steps[last_tag]
        if not steps or steps[-1][0] != "pop":
            return None
        _, after, before = steps[-1]
        return last_tag, after, before

    def last_copy_removed(self, task_id: str) -> str | None:
        """The tag of the task's last message copy when its last step is its removal from the
        unacknowledged set (with no push after it), else None."""
        tags = self.by_task.get(task_id) or []
        if not tags:
            return None
        last_tag = max(tags, key=lambda t: self._last_push.get(t, -1))
        steps = self.steps[last_tag]
        return last_tag if steps and steps[-1][0] == "remove" else None

    def __post_init__(self) -> None:
        self._last_push: dict[str, int] = {}


def _payload_ids(raw: bytes) -> tuple[str | None, str | None]:
    """(delivery tag, task id) of a kombu message as stored in a queue list."""
    try:
        msg = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None, None
    if not isinstance(msg, dict):
        return None, None
    props = msg.get("properties") or {}
    headers = msg.get("headers") or {}
    tag = props.get("delivery_tag")
    task_id = headers.get("id") or props.get("correlation_id")
    return (str(tag) if tag else None), (str(task_id) if task_id else None)


def replay(path: str | Path) -> BrokerLog:
    """Replay an append-only file: lists (push/pop), the ``unacked`` hash, and the clock marks."""
    data = Path(path).read_bytes()
    lists: dict[bytes, deque[bytes]] = defaultdict(deque)
    copies: dict[str, Copy] = {}
    by_task: dict[str, list[str]] = defaultdict(list)
    steps: dict[str, list[tuple[str, float, float]]] = defaultdict(list)
    last_push: dict[str, int] = {}
    # Steps are stamped with the clock mark before them now and the one after them once it is seen.
    pending: list[tuple[str, str, int]] = []  # (tag, kind, index into steps[tag]) awaiting the next mark
    mark = float("-inf")
    count = 0

    def step(tag: str, task_id: str | None, kind: str) -> None:
        if tag not in copies:
            copies[tag] = Copy(tag, task_id or "")
            if task_id:
                by_task[task_id].append(tag)
        steps[tag].append((kind, mark, float("inf")))
        pending.append((tag, kind, len(steps[tag]) - 1))
        if kind == "push":
            last_push[tag] = count

    def pushed(value: bytes) -> None:
        tag, task_id = _payload_ids(value)
        if tag:
            step(tag, task_id, "push")

    for args in parse_aof(data):
        count += 1
        if not args:
            continue
        cmd = args[0].upper()
        if cmd == b"SET" and len(args) >= 3 and args[1] == CLOCK_KEY:
            try:
                new_mark = float(args[2])
            except ValueError:
                continue
            for tag, _kind, index in pending:
                kind, after, _ = steps[tag][index]
                steps[tag][index] = (kind, after, new_mark)
            pending.clear()
            mark = new_mark
        elif cmd in (b"LPUSH", b"RPUSH") and len(args) >= 3:
            q = lists[args[1]]
            for value in args[2:]:
                (q.appendleft if cmd == b"LPUSH" else q.append)(value)
                pushed(value)
        elif cmd in (b"RPOP", b"LPOP") and len(args) >= 2:
            q = lists[args[1]]
            n = int(args[2]) if len(args) >= 3 else 1
            for _ in range(n):
                if not q:
                    break
                value = q.pop() if cmd == b"RPOP" else q.popleft()
                popped_tag, popped_id = _payload_ids(value)
                if popped_tag:
                    step(popped_tag, popped_id, "pop")
        elif cmd == b"DEL":
            for key in args[1:]:
                lists.pop(key, None)
        elif cmd == b"HSET" and len(args) >= 4 and args[1] == UNACKED:
            for i in range(2, len(args) - 1, 2):
                _, recorded_id = _payload_ids(_first_of_triple(args[i + 1]))
                step(args[i].decode(errors="replace"), recorded_id, "record")
        elif cmd == b"HDEL" and len(args) >= 3 and args[1] == UNACKED:
            for field in args[2:]:
                if field.decode(errors="replace") in copies:
                    step(field.decode(errors="replace"), None, "remove")
    gaps = []
    for tag_steps in steps.values():
        last_pop_after: float | None = None
        for kind, after, before in tag_steps:
            if kind == "pop":
                last_pop_after = after
            elif kind == "record" and last_pop_after is not None:
                if before != float("inf") and last_pop_after != float("-inf"):
                    gaps.append(before - last_pop_after)
                last_pop_after = None
    log = BrokerLog(
        copies=copies,
        by_task=dict(by_task),
        steps=dict(steps),
        max_pop_to_record_s=max(gaps, default=0.0),
        commands=count,
    )
    log._last_push = last_push
    return log


def _first_of_triple(value: bytes) -> bytes:
    """kombu stores ``[message, exchange, routing_key]`` as the unacknowledged entry."""
    try:
        triple: Any = json.loads(value)
    except (ValueError, UnicodeDecodeError):
        return b""
    if isinstance(triple, list) and triple:
        return json.dumps(triple[0]).encode()
    return b""


def children_of(path: str | Path, parents: set[str], task_name: str) -> dict[str, str]:
    """Parent task id -> the task id of a ``task_name`` message published by it (a ``link`` callback: its
    ``parent_id`` header), for the ``parents`` given, from the broker's append-only file."""
    found: dict[str, str] = {}
    for command in parse_aof(Path(path).read_bytes()):
        for arg in command[1:]:
            if b"parent_id" not in arg or task_name.encode() not in arg:
                continue
            try:
                headers = json.loads(arg).get("headers") or {}
            except (ValueError, UnicodeDecodeError, AttributeError):
                continue
            parent = headers.get("parent_id")
            if headers.get("task") == task_name and parent in parents and headers.get("id"):
                found[str(parent)] = str(headers["id"])
    return found
