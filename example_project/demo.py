"""The demo (``make demo``): overlapping email-group uploads (``Replace``) and ledger postings
(``Queue``) on two workers, two beats, one failover.

With no arguments it runs on embedded defaults: the embedded MongoDB-compatible server and a bundled
redis-server binary, both started here (nothing to install). ``--broker rabbitmq`` (``make demo
BROKER=rabbitmq``) runs it on a RabbitMQ node started here instead (an installed ``rabbitmq-server``; results
in the bundled Redis). ``--mongo-url`` and ``--broker-url`` run it against real services instead.

It starts two worker nodes (prefork, concurrency 2) and two ``celery beat`` with the leader-elected
scheduler. It sends bursts of uploads per email group (``Replace``: the upload sent last wins, the ones it
replaced end "superseded") and bursts of postings per ledger account (``Queue``: every posting runs, in
the order sent), kills the beat leader half way (SIGKILL) and shows a live table (holder, parked runs and
pending handoff per key, worker slots busy). Then it checks its invariants, printing each with PASS or
FAIL, and writes a timeline (HTML). It exits non-zero on a FAIL. Every process it started is stopped,
also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import csv
import html
import itertools
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


class Proc:
    """A child process in its own process group, logging to a file."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            cwd=HERE,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.alive:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 20) -> None:
        if self.alive:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


def stop_all(procs: list[Proc]) -> None:
    for p in procs:
        p.stop()


def start_workers_and_beats(procs: list[Proc], env: dict[str, str], run_dir: Path, db: Any) -> None:
    celery = [sys.executable, "-m", "celery", "-A", "emailgroups"]
    for n in (1, 2):
        worker = [
            *celery,
            "worker",
            "-n",
            f"worker{n}@demo",
            "--pool=prefork",
            "--concurrency=2",
            "--loglevel=INFO",
            "--without-gossip",
            "--without-mingle",
        ]
        procs.append(Proc(f"worker{n}", worker, env, run_dir))
    print("starting 2 workers ...", flush=True)
    wait_until(lambda: all((run_dir / f"worker{n}@demo.ready").exists() for n in (1, 2)), 90, "the workers")
    for n in (1, 2):
        beat = [*celery, "beat", "--loglevel=INFO", "-s", str(run_dir / f"beat{n}.schedule")]
        procs.append(Proc(f"beat{n}", beat, env, run_dir))
    print("starting 2 beats (leader-elected) ...", flush=True)
    wait_until(lambda: beat_leader_pid(db), 60, "a beat leader")


def wait_until(condition: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.1)


@contextmanager
def services(args: argparse.Namespace) -> Iterator[tuple[str, str, str]]:
    """(MongoDB URL, broker URL, result backend URL): given, or servers started here."""
    from celery_mongolock.embedded import EmbeddedMongo
    from celery_mongolock.testing import RabbitMQServer, RedisServer, rabbitmq_server_binary

    with ExitStack() as stack:
        mongo_url = args.mongo_url
        if not mongo_url:
            print("starting the embedded MongoDB-compatible server ...", flush=True)
            mongo_url = stack.enter_context(EmbeddedMongo()).url
        broker_url = args.broker_url
        backend_url = broker_url
        if not broker_url and args.broker == "rabbitmq":
            if rabbitmq_server_binary() is None:
                raise SystemExit(
                    "--broker rabbitmq: RabbitMQ is not installed (apt-get install rabbitmq-server)"
                )
            print(
                "starting a RabbitMQ node as the broker, a bundled redis-server for results ...", flush=True
            )
            broker_url = stack.enter_context(RabbitMQServer()).url
            backend_url = stack.enter_context(RedisServer()).url
        elif not broker_url:
            print("starting a bundled redis-server as the broker ...", flush=True)
            broker_url = backend_url = stack.enter_context(RedisServer()).url
        elif broker_url.startswith(("amqp", "pyamqp")):
            backend_url = os.environ.get("MONGOLOCK_DEMO_RESULT_BACKEND", "")
            if not backend_url:
                raise SystemExit("a RabbitMQ --broker-url needs MONGOLOCK_DEMO_RESULT_BACKEND (redis://...)")
        yield mongo_url, broker_url, backend_url


def beat_leader_pid(db: Any) -> int | None:
    doc = db["leases"].find_one({"_id": "celery-beat:leader"})
    if not doc or not doc.get("owner"):
        return None
    pid = (doc.get("holder") or {}).get("pid")
    return int(pid) if pid else None


# -- what the demo sends ---------------------------------------------------------------------------------
@dataclass
class Planned:
    """A send to make ``offset`` seconds into the demo: an upload (``Replace``) or a posting (``Queue``)."""

    offset: float
    kind: str  # "upload" | "posting"
    owner: Any  # the group id (int) or the account (str)
    label: str  # the upload id (its file is <label>.csv) or the posting id
    key: str
    path: str = ""
    amount: int = 0


@dataclass
class Send:
    """A send the demo made: its own order (``seq``) and time, and the run's result."""

    seq: int
    t: float
    plan: Planned
    result: Any
    task_id: str

    @property
    def label(self) -> str:
        return self.plan.label

    @property
    def key(self) -> str:
        return self.plan.key


def make_uploads(groups: int, per_group: int, folder: Path, rng: random.Random) -> list[Planned]:
    """Per group, a burst of uploads sent about 0.25 s apart (the groups' bursts 1 s apart): the first
    runs (0.6-1.2 s), the next one parks, and each newer send replaces the parked one."""
    plans = []
    for g in range(1, groups + 1):
        base = 1.0 * (g - 1)
        for u in range(1, per_group + 1):
            upload_id = f"g{g}-u{u}"
            path = folder / f"{upload_id}.csv"
            with open(path, "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(["email"])
                for i in range(rng.randint(30, 60)):
                    writer.writerow([f"{upload_id}-{i}@example.com"])
            offset = base + (u - 1) * 0.25 + rng.random() * 0.05
            plans.append(Planned(offset, "upload", g, upload_id, f"email-group:{g}", path=str(path)))
    return plans


def make_postings(accounts: int, per_account: int, rng: random.Random) -> list[Planned]:
    """Per account, a burst of postings sent 0.2 s apart: a deposit, then deposits and withdrawals that
    never overdraw the account when applied in the order sent (a withdrawal applied before the deposit it
    relies on would be refused)."""
    plans = []
    for a in range(1, accounts + 1):
        account = f"acct-{a}"
        balance = 0
        for p in range(1, per_account + 1):
            if p == 1 or balance < 20 or rng.random() < 0.4:
                amount = rng.randint(20, 90)
            else:
                amount = -rng.randint(max(1, balance // 2), balance)
            balance += amount
            offset = 0.2 + 0.5 * (a - 1) + (p - 1) * 0.2
            plans.append(
                Planned(offset, "posting", account, f"a{a}-p{p}", f"ledger:{account}", amount=amount)
            )
    return plans


# -- live view -------------------------------------------------------------------------------------------
@dataclass
class Sample:
    """One look at the cluster: runs parked (from the lease documents) and tasks active in worker slots
    (``inspect().active()``), and the parked runs found active although parked for over a second."""

    t: float
    parked: int
    active: int
    parked_and_active: list[str] = field(default_factory=list)
    took: float = 0.0


def _epoch(value: Any) -> float:
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).timestamp()
    return float(value or 0)


def lease_docs(db: Any) -> dict[str, dict[str, Any]]:
    """The lease documents of the demo's keys (email groups and ledger accounts)."""
    return {
        d["_id"]: d for d in db["leases"].find({}) if str(d["_id"]).startswith(("email-group:", "ledger:"))
    }


def parked_since(db: Any) -> dict[str, float]:
    """Task id -> when it was parked (epoch seconds), for every run parked on a demo key."""
    return {e["t"]: _epoch(e.get("at")) for d in lease_docs(db).values() for e in d.get("q") or []}


def take_sample(db: Any, app: Any, nodes: int | None) -> Sample:
    before = parked_since(db)
    t = time.time()
    replies = app.control.inspect(timeout=1.0, limit=nodes).active() or {}
    active = {task["id"] for tasks in replies.values() for task in tasks or []}
    after = parked_since(db)
    # Parked before the look and still parked after it, for over a second: its delivery should be long
    # over (acknowledged), so it must not be in a worker slot.
    held = sorted(tid for tid in active if tid in before and tid in after and before[tid] < t - 1.0)
    return Sample(t, len(after), len(active), held, time.time() - t)


def render_live(
    db: Any,
    *,
    sends: list[Send],
    planned: int,
    keys: list[str],
    sample: Sample | None,
    slots: int,
    started: float,
) -> str:
    docs = lease_docs(db)
    label: dict[Any, str] = {s.task_id: s.label for s in sends}
    ended = Counter(r["key"] for r in db["runs"].find({"kind": "end"}, {"key": 1}))
    sent = Counter(s.key for s in sends)
    superseded = Counter(s.key for s in sends if _superseded_result(s) is not None)
    lines = [
        f"  t={time.monotonic() - started:5.1f}s",
        f"  {'key':<16} {'held by':<20} {'parked (oldest first)':<34} {'handoff to':<10} {'ran':>4}"
        f" {'superseded':>10} {'sent':>5}",
    ]
    for key in keys:
        doc = docs.get(key) or {}
        holder = "-"
        ho = doc.get("ho")
        handoff = label.get(ho.get("t"), "?") if isinstance(ho, dict) and ho.get("t") else "-"
        if handoff != "-":
            holder = "(handed over)"  # the run it was handed to has not claimed it yet
        elif doc.get("owner"):
            h = doc.get("holder") or {}
            holder = f"{label.get(h.get('task_id'), '?')} on {str(h.get('worker', '?')).split('@')[0]}"
        q = doc.get("q") or []
        parked = f"{len(q)}" + (": " + " ".join(label.get(e.get("t"), "?") for e in q) if q else "")
        lines.append(
            f"  {key:<16} {holder:<20} {parked:<34} {handoff:<10} {ended[key]:>4} {superseded[key]:>10}"
            f" {sent[key]:>5}"
        )
    digests = db["runs"].count_documents({"kind": "digest"})
    finished = sum(1 for s in sends if s.result.ready())
    slots_text = f"{sample.active}/{slots}" if sample else "?"
    parked_total = sample.parked if sample else 0
    lines.append(
        f"  worker slots busy {slots_text}   runs parked {parked_total}   sent {len(sends)}/{planned}"
        f"   finished {finished}/{planned}   digests {digests}   beat leader pid {beat_leader_pid(db)}"
    )
    return "\n".join(lines)


def _superseded_result(send: Send) -> dict[str, Any] | None:
    if not send.result.ready() or send.result.failed():
        return None
    value = send.result.result
    if isinstance(value, dict) and value.get("mongolock") == "superseded":
        return value
    return None


# -- what happened to each send (from the event log the workers wrote) -----------------------------------
@dataclass
class Story:
    """One send's life: sent, parked, handed the key, ran (start-end), or superseded."""

    send: Send
    #: When its first delivery began on a worker (``task_prerun``, before the library saw the run).
    arrived: float | None = None
    #: The run that held the key when this run first found it held (its task id), if it ever did.
    found_held_by: str | None = None
    parked: float | None = None
    start: float | None = None
    end: float | None = None
    starts: int = 0
    fence: int | None = None
    stamp: int | None = None
    superseded: float | None = None
    by: str | None = None
    handed: float | None = None
    delivery_ends: list[tuple[float, str]] = field(default_factory=list)


def stories(events: list[dict[str, Any]], sends: list[Send]) -> dict[str, Story]:
    out = {s.task_id: Story(s) for s in sends}
    for e in sorted(events, key=lambda e: e["t"]):
        story = out.get(e.get("task_id", ""))
        if story is None:
            continue
        kind = e["kind"]
        if kind == "delivery-begin" and story.arrived is None:
            story.arrived = e["t"]
        elif kind == "contended" and story.found_held_by is None:
            story.found_held_by = e.get("holder_task")
        elif kind == "parked" and story.parked is None:
            story.parked = e["t"]
        elif kind == "start":
            story.starts += 1
            if story.start is None:
                story.start, story.fence, story.stamp = e["t"], e.get("fence"), e.get("stamp")
        elif kind == "end" and story.end is None:
            story.end = e["t"]
        elif kind == "handed" and story.handed is None:
            story.handed = e["t"]
        elif kind == "superseded" and story.superseded is None:
            story.superseded, story.by = e["t"], e.get("by")
        elif kind == "delivery-end":
            story.delivery_ends.append((e["t"], str(e.get("state"))))
    for story in out.values():  # the result says so even if the signal's log entry is missing
        value = _superseded_result(story.send)
        if value is not None and story.by is None:
            story.by = value.get("by")
    return out


# -- the invariants --------------------------------------------------------------------------------------
def _in_start_order(key_sends: list[Send], told: dict[str, Story]) -> list[Send]:
    """A key's sends that ran, in the order they were handed the key."""
    by_label = {s.label: s for s in key_sends}
    return [by_label[label] for label in _start_order(key_sends, told)]


def _start_order(key_sends: list[Send], told: dict[str, Story]) -> list[str]:
    """The labels of a key's runs in the order they were handed the key (their fences)."""
    return [
        label
        for _, label in sorted(
            (told[s.task_id].fence or 0, s.label) for s in key_sends if told[s.task_id].start
        )
    ]


def _late_arrivals(key_sends: list[Send], told: dict[str, Story]) -> tuple[list[str], list[str]]:
    """The runs that started before a run sent earlier: excused when the earlier one reached MongoDB only
    after the later one was granted the key (the library cannot wait for a message still in the broker, or
    on a worker that has not asked MongoDB yet), else a fault. Returns (excused, faults).

    The earlier run came late when its delivery began after the grant, or when the first holder it found
    on the key was the later run or one granted after it: its admission reached MongoDB after the grant.
    A run that found an older holder, parked, and was then passed by a newer send is a fault."""
    fences = {s.task_id: told[s.task_id].fence for s in key_sends}
    excused: list[str] = []
    faults: list[str] = []
    for i, earlier in enumerate(key_sends):
        first = told[earlier.task_id]
        for later in key_sends[i + 1 :]:
            second = told[later.task_id]
            if first.fence is None or second.fence is None or second.fence > first.fence:
                continue
            granted = second.fence / 1e6  # a fence is the grant's server time in microseconds (and a count)
            arrived = first.arrived  # before the library saw it (a lower bound: None counts as a fault)
            found = fences.get(first.found_held_by or "")
            pair = f"{later.label} (sent after {earlier.label}) ran first"
            if arrived is not None and arrived > granted:
                excused.append(
                    f"{pair}: {earlier.label} reached a worker {arrived - granted:.2f}s after that"
                )
            elif found is not None and found >= second.fence:
                holder = next(s.label for s in key_sends if s.task_id == first.found_held_by)
                excused.append(
                    f"{pair}: {earlier.label} reached a worker first but asked MongoDB only once "
                    f"{holder} held the key"
                )
            else:
                faults.append(pair)
    return excused, faults


def _ledger_replay(in_order: list[Send]) -> tuple[list[str], int]:
    """What the ledger must hold when the postings apply in this order: the refused ones and the balance."""
    balance, refused = 0, []
    for s in in_order:
        if balance + s.plan.amount < 0:
            refused.append(s.label)
        else:
            balance += s.plan.amount
    return refused, balance


def _queue_problems(db: Any, key_sends: list[Send], told: dict[str, Story]) -> list[str]:
    """A Queue key's runs against the send order (late arrivals excused) and its ledger against the order
    the runs started in."""
    problems = []
    order = _start_order(key_sends, told)
    by_time = [s.label for s in sorted(key_sends, key=lambda s: told[s.task_id].start or 0)]
    _, faults = _late_arrivals(key_sends, told)
    if faults or by_time != order or len(order) != len(key_sends):
        problems.append(f"started {order}, sent {[s.label for s in key_sends]}: {'; '.join(faults)}")
    stamps = [told[s.task_id].stamp for s in key_sends]
    if None in stamps or stamps != sorted(stamps):  # type: ignore[type-var]
        problems.append(f"send stamps (header mongolock_sent) not increasing in send order: {stamps}")
    ledger = db["ledgers"].find_one({"_id": key_sends[0].plan.owner}) or {}
    entries = ledger.get("entries") or []
    applied = [e["posting"] for e in entries]
    refused = [e["posting"] for e in entries if e.get("refused")]
    expected_refused, total = _ledger_replay(_in_start_order(key_sends, told))
    if applied != order:
        problems.append(f"ledger {applied}, started {order}")
    if refused != expected_refused:
        problems.append(f"refused {refused}, expected {expected_refused} (applied in the order started)")
    if ledger.get("balance") != total:
        problems.append(f"balance {ledger.get('balance')}, expected {total}")
    return problems


@dataclass
class Check:
    name: str
    ok: bool
    details: list[str]
    bad_keys: set[str] = field(default_factory=set)


def check_invariants(
    db: Any,
    *,
    sends: list[Send],
    told: dict[str, Story],
    samples: list[Sample],
    slots: int,
    upload_dir: Path,
    runs: list[dict[str, Any]],
) -> list[Check]:
    checks: list[Check] = []
    by_id = {s.task_id: s for s in sends}
    per_key: dict[str, list[Send]] = defaultdict(list)
    for s in sorted(sends, key=lambda s: s.seq):
        per_key[s.key].append(s)

    # 1. Every send ended: ran once, or (Replace) superseded; nothing failed, nothing lost.
    bad = []
    for s in sends:
        story = told[s.task_id]
        if s.result.failed():
            bad.append(f"{s.label} failed: {s.result.result!r}")
        elif story.starts > 1:
            bad.append(f"{s.label} ran {story.starts} times")
        elif story.starts == 0 and not (s.plan.kind == "upload" and story.by):
            bad.append(f"{s.label} neither ran nor was superseded")
    ran = sum(1 for s in sends if told[s.task_id].starts)
    checks.append(
        Check(
            "every send ended: ran exactly once, or was superseded (Replace); none failed or lost",
            not bad,
            bad or [f"{ran} ran, {len(sends) - ran} superseded, of {len(sends)} sent"],
        )
    )

    # 2. No two runs of one key overlapped.
    starts = {r["task_id"]: r for r in runs if r["kind"] == "start"}
    ends = {r["task_id"]: r for r in runs if r["kind"] == "end"}
    overlaps = []
    for key, key_sends in per_key.items():
        spans = sorted(
            (starts[s.task_id]["mono"], ends[s.task_id]["mono"], s.label)
            for s in key_sends
            if s.task_id in starts and s.task_id in ends
        )
        overlaps += [f"{key}: {a[2]} and {b[2]}" for a, b in itertools.pairwise(spans) if b[0] < a[1]]
    checks.append(
        Check("no two runs of one key overlapped", not overlaps, overlaps or [f"{len(per_key)} keys"])
    )

    # 3. Replace: every group ends with the members of the file SENT last.
    bad, good = [], []
    bad_keys = set()
    for key, key_sends in per_key.items():
        if key_sends[0].plan.kind != "upload":
            continue
        group = key_sends[0].plan.owner
        last = key_sends[-1]  # the highest send order of the group
        doc = db["groups"].find_one({"_id": group}) or {}
        current = {"group": group, "fence": doc.get("fence")}  # (emailgroups.tasks.current_members)
        members = sorted(d["email"] for d in db["members"].find(current))
        with open(upload_dir / f"{last.label}.csv", newline="") as f:
            expected = sorted(row["email"] for row in csv.DictReader(f))
        if members == expected and doc.get("upload") == last.label:
            good.append(
                f"group {group}: {last.label} (sent last of {len(key_sends)}), {len(members)} members"
            )
        else:
            holds = sorted({d.get("upload") for d in db["members"].find(current)})
            bad.append(f"group {group}: sent last {last.label}, holds members of {holds}")
            bad_keys.add(key)
    checks.append(
        Check(
            "Replace: every group ends with the members of the file sent last", not bad, bad or good, bad_keys
        )
    )

    # 4. Replace: a run is superseded only by a newer send, and runs of a group start in send order.
    bad = []
    for key, key_sends in per_key.items():
        if key_sends[0].plan.kind != "upload":
            continue
        for s in key_sends:
            by = told[s.task_id].by
            if by and (by not in by_id or by_id[by].seq <= s.seq):
                newer = by_id[by].label if by in by_id else by
                bad.append(f"{s.label} superseded by {newer}, which was not sent after it")
        ran_sends = sorted(
            (told[s.task_id].fence or 0, s.seq, s.label) for s in key_sends if told[s.task_id].start
        )
        if [r[1] for r in ran_sends] != sorted(r[1] for r in ran_sends):
            bad.append(f"{key}: ran {[r[2] for r in ran_sends]}, not in the order sent")
    n_sup = sum(1 for s in sends if s.plan.kind == "upload" and told[s.task_id].by)
    checks.append(
        Check(
            "Replace: a run is superseded only by a newer send; the runs of a group start in send order",
            not bad,
            bad or [f"{n_sup} uploads superseded, each by a newer send"],
        )
    )

    # 5. Queue: runs of a key start in the order they were sent; the ledger shows the send order.
    bad, good = [], []
    bad_keys = set()
    for key, key_sends in per_key.items():
        if key_sends[0].plan.kind != "posting":
            continue
        problems = _queue_problems(db, key_sends, told)
        if problems:
            bad.append(f"{key}: " + "; ".join(problems))
            bad_keys.add(key)
        else:
            order = _start_order(key_sends, told)
            late = "" if order == [s.label for s in key_sends] else " (a late arrival ran after a newer send)"
            total = _ledger_replay(_in_start_order(key_sends, told))[1]
            good.append(f"{key}: {' '.join(order)} = send order{late}; balance {total}")
    checks.append(
        Check("Queue: runs of a key start in the order they were sent", not bad, bad or good, bad_keys)
    )

    # 6. No worker slot is held by parked runs.
    bad = []
    held_ms = []
    parked = [st for st in told.values() if st.parked is not None]
    for st in parked:
        assert st.parked is not None
        after = [(t, state) for t, state in st.delivery_ends if t >= st.parked - 0.005]
        if not after:
            bad.append(f"{st.send.label}: the delivery that parked it never ended")
            continue
        t, state = after[0]
        held_ms.append((t - st.parked) * 1000)
        if state != "IGNORED":
            bad.append(f"{st.send.label}: the delivery that parked it ended {state}, not IGNORED")
        if st.start is not None and st.start < st.parked:
            bad.append(f"{st.send.label}: its body started before it was parked")
    for sample in samples:
        for tid in sample.parked_and_active:
            label = by_id[tid].label if tid in by_id else tid
            bad.append(f"{label} was in a worker slot at t={sample.t:.2f} while parked for over 1 s")
    peak = max(samples, key=lambda s: s.parked, default=None)
    summary = [
        f"{len(parked)} runs parked; each parking delivery ended (IGNORED, message acknowledged) "
        f"{max(held_ms, default=0):.0f} ms after parking at most",
        f"{len(samples)} samples of the tasks in worker slots: none was a parked run",
    ]
    if peak is not None:
        summary.append(
            f"peak: {peak.parked} runs parked at once while {peak.active} of {slots} slots were busy"
        )
    checks.append(Check("no worker slot is held by parked runs", not bad, bad or summary))
    return checks


# -- the timeline ----------------------------------------------------------------------------------------
COLORS = {
    "send": "#222222",
    "broker": "#f7e6b5",
    "parked": "#f0b429",
    "run_upload": "#3b6fb6",
    "run_posting": "#2e8b57",
    "superseded": "#9a9a9a",
    "final": "#e3f3e3",
    "fail": "#d62728",
}
BROKER_TEXT = "in the broker: not yet admitted, or handed the key and waiting for a free worker slot"
PARKED_TEXT = "parked in the lease document (message acknowledged, no worker slot)"


def _text(x: float, y: float, text: str, **attrs: Any) -> str:
    extra = " ".join(f'{k.replace("_", "-")}="{v}"' for k, v in attrs.items())
    return f'<text x="{x:.1f}" y="{y:.1f}" {extra}>{html.escape(text)}</text>'


def _bar(x0: float, x1: float, y: float, h: float, fill: str, tip: str, extra: str = "") -> str:  # noqa: PLR0917
    return (
        f'<rect x="{x0:.1f}" y="{y:.1f}" width="{max(1.5, x1 - x0):.1f}" height="{h}" fill="{fill}"{extra}>'
        f"<title>{html.escape(tip)}</title></rect>"
    )


def timeline_html(
    path: Path,
    *,
    sends: list[Send],
    told: dict[str, Story],
    runs: list[dict[str, Any]],
    failovers: list[float],
    checks: list[Check],
    policies: dict[str, str],
    finals: dict[str, Any],
) -> None:
    """One self-contained HTML page (inline SVG, no scripts, nothing fetched): per key, one lane per
    send in send order, on a common time axis: when it was sent, how long it waited in the broker and
    parked, when it ran or that it was superseded (and by which send), and which file each group ends
    with."""
    if not sends:
        path.write_text("<p>nothing was sent</p>")
        return
    t0 = min(s.t for s in sends)
    moments = [s.t for s in sends]
    for st in told.values():
        moments += [t for t in (st.end, st.superseded, st.start) if t is not None]
    digests_all = [r["t"] for r in runs if r["kind"] == "digest"]
    t1 = max(moments + [t for t in digests_all + failovers if t > t0]) + 0.3
    digests = [t for t in digests_all if t0 <= t <= t1]
    per_key: dict[str, list[Send]] = defaultdict(list)
    for s in sorted(sends, key=lambda s: s.seq):
        per_key[s.key].append(s)
    keys = sorted(per_key, key=lambda k: (not k.startswith("email-group:"), k))
    bad_keys = set().union(*(c.bad_keys for c in checks))

    width, left, right = 1360, 230, 270  # lane labels on the left, outcomes on the right
    plot = width - left - right
    lane, head, axis_h = 20, 26, 34

    def x(t: float) -> float:
        return float(left + (t - t0) / (t1 - t0) * plot)

    ordinal = {1: "1st", 2: "2nd", 3: "3rd"}
    bg: list[str] = []  # backgrounds, under the grid
    fg: list[str] = []  # everything else, over it
    y = axis_h + 8
    for key in keys:
        key_sends = per_key[key]
        is_upload = key_sends[0].plan.kind == "upload"
        policy = policies["upload" if is_upload else "posting"]
        last = key_sends[-1]
        bg.append(f'<rect x="0" y="{y}" width="{width}" height="{head}" fill="#e8ecf2"/>')
        fg.append(_text(6, y + 17, key, font_weight="bold", font_size="13"))
        fg.append(_text(left + 6, y + 17, policy, fill="#444"))
        final = finals.get(key)  # the file the group holds, or the ledger's entries, at the end
        entries = {e["posting"]: e for e in (final or []) if isinstance(e, dict)}
        if is_upload:
            good = key not in bad_keys and final == last.label
            verdict = (
                f"group ends with {last.label}, the file sent last ✓"
                if good
                else f"group ends with {final}, NOT {last.label}, the file sent last ✗"
            )
        else:
            applied = [e.get("posting") for e in final or []]
            good = key not in bad_keys and applied == _start_order(key_sends, told)
            order = (
                "send order" if applied == [s.label for s in key_sends] else "start order (a late arrival)"
            )
            balance = (final or [{}])[-1].get("balance") if final else None
            verdict = f"ledger {'in' if good else 'NOT in'} {order}, balance {balance} {'✓' if good else '✗'}"
        fg.append(
            _text(
                width - 6,
                y + 17,
                verdict,
                text_anchor="end",
                font_weight="bold",
                fill="#2a6a2a" if good else COLORS["fail"],
            )
        )
        y += head
        for i, s in enumerate(key_sends, 1):
            st = told[s.task_id]
            mid = y + lane / 2
            if is_upload and s.label == final:
                bg.append(f'<rect x="0" y="{y}" width="{width}" height="{lane}" fill="{COLORS["final"]}"/>')
            elif i % 2 == 0:
                bg.append(f'<rect x="0" y="{y}" width="{width}" height="{lane}" fill="#f7f7f7"/>')
            amount = f" {s.plan.amount:+d}" if not is_upload else ""
            fg.append(_text(18, mid + 4, f"{s.label}{amount}", font_family="monospace"))
            fg.append(
                _text(left - 8, mid + 4, f"sent {ordinal.get(i, f'{i}th')}", text_anchor="end", fill="#555")
            )
            xs = x(s.t)
            end_of_wait = st.start if st.start is not None else st.superseded
            # Waiting: in the broker until admitted (parked or run), parked until handed the key, then in
            # the broker again until a worker slot takes the handed run.
            admitted = st.parked if st.parked is not None else end_of_wait
            if admitted is not None:
                fg.append(
                    _bar(
                        xs,
                        x(admitted),
                        y + 5,
                        lane - 10,
                        COLORS["broker"],
                        f"{s.label}: {BROKER_TEXT}, {admitted - s.t:.2f}s",
                    )
                )
            if st.parked is not None and end_of_wait is not None:
                parked_until = st.handed if st.handed is not None else end_of_wait
                if st.start is not None:
                    fg.append(
                        _bar(
                            x(st.parked),
                            x(parked_until),
                            y + 5,
                            lane - 10,
                            COLORS["parked"],
                            f"{s.label}: parked {parked_until - st.parked:.2f}s",
                        )
                    )
                    if parked_until < st.start:
                        fg.append(
                            _bar(
                                x(parked_until),
                                x(st.start),
                                y + 5,
                                lane - 10,
                                COLORS["broker"],
                                f"{s.label}: handed the key, waiting for a worker slot",
                            )
                        )
                else:
                    fg.append(
                        _bar(
                            x(st.parked),
                            x(end_of_wait),
                            y + 5,
                            lane - 10,
                            "url(#hatch)",
                            f"{s.label}: parked, then superseded",
                            f' stroke="{COLORS["superseded"]}"',
                        )
                    )
            if st.start is not None and st.end is not None:
                color = COLORS["run_upload"] if is_upload else COLORS["run_posting"]
                tip = f"{s.label} ran {st.start - t0:.2f}s to {st.end - t0:.2f}s (fence {st.fence})"
                fg.append(_bar(x(st.start), x(st.end), y + 2, lane - 4, color, tip, ' rx="2"'))
                outcome = f"ran {st.end - st.start:.2f}s"
                if is_upload and s.label == final:
                    outcome += "  ★ the group's members"
                elif s.label in entries:
                    entry = entries[s.label]
                    position = list(entries).index(s.label) + 1
                    outcome = f"applied {ordinal.get(position, f'{position}th')}"
                    if entry.get("refused"):
                        outcome += ": REFUSED (overdraft)"
                    outcome += f" → balance {entry.get('balance')}"
            elif st.by is not None:
                xe = x(st.superseded if st.superseded is not None else s.t)
                fg.append(
                    f'<path d="M{xe - 5:.1f},{y + 5} l10,10 m0,-10 l-10,10" stroke="#333" stroke-width="2"/>'
                )
                newer = next((o.label for o in key_sends if o.task_id == st.by), str(st.by))
                outcome = f"✕ superseded by {newer} (never ran)"
            else:
                outcome = "never ran"
            fg.append(
                f'<path d="M{xs - 5:.1f},{y + 1} h10 l-5,8 z" fill="{COLORS["send"]}">'
                f"<title>{html.escape(f'{s.label} sent at {s.t - t0:.2f}s')}</title></path>"
            )
            fg.append(_text(width - right + 10, mid + 4, outcome, fill="#222"))
            y += lane
        y += 6
    # The beat's digest ticks.
    bg.append(f'<rect x="0" y="{y}" width="{width}" height="{head}" fill="#e8ecf2"/>')
    fg.append(_text(6, y + 17, "digest (beat)", font_weight="bold", font_size="13"))
    fg.append(_text(100, y + 17, "Skip: one run per tick", fill="#444"))
    for t in digests:
        fg.append(f'<rect x="{x(t) - 1:.1f}" y="{y + 5}" width="3" height="{head - 10}" fill="#333"/>')
    twice = any(c.name.startswith("every digest") and not c.ok for c in checks)
    fg.append(
        _text(
            width - 6,
            y + 17,
            "a tick ran twice ✗" if twice else "no tick ran twice ✓ (the gap: the beat failover)",
            text_anchor="end",
            fill=COLORS["fail"] if twice else "#222",
        )
    )
    y += head + 4
    height = y + axis_h + 18
    # Time axis (top and bottom) with a grid.
    grid: list[str] = []
    span = t1 - t0
    step = next(s for s in (0.25, 0.5, 1, 2, 5, 10, 30, 60) if span / s <= 24)
    n = 0
    while n * step <= span:
        xt = x(t0 + n * step)
        grid.append(f'<line x1="{xt:.1f}" y1="{axis_h}" x2="{xt:.1f}" y2="{y}" stroke="#d0d0d0"/>')
        label = f"{n * step:g} s"
        grid.append(_text(xt, axis_h - 8, label, text_anchor="middle", fill="#333"))
        grid.append(_text(xt, y + 18, label, text_anchor="middle", fill="#333"))
        n += 1
    grid.append(f'<line x1="{left}" y1="{axis_h}" x2="{left + plot}" y2="{axis_h}" stroke="#333"/>')
    grid.append(f'<line x1="{left}" y1="{y}" x2="{left + plot}" y2="{y}" stroke="#333"/>')
    grid.append(_text(6, axis_h - 8, "seconds since the first send →", fill="#333"))
    for t in failovers:
        if t0 <= t <= t1:
            fg.append(
                f'<line x1="{x(t):.1f}" y1="{axis_h}" x2="{x(t):.1f}" y2="{y + 24}" stroke="{COLORS["fail"]}"'
                ' stroke-dasharray="5,4" stroke-width="1.5"/>'
            )
            fg.append(_text(x(t), y + 36, "beat leader killed", fill=COLORS["fail"], text_anchor="middle"))
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="12">'
        '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="6" height="6" fill="#e4e4e4"/>'
        '<line x1="0" y1="0" x2="0" y2="6" stroke="#9a9a9a" stroke-width="2"/></pattern></defs>'
        + "".join(bg)
        + "".join(grid)
        + "".join(fg)
        + "</svg>"
    )
    legend = (
        '<div class="legend">'
        '<span><svg width="12" height="10"><path d="M1,0 h10 l-5,8 z" fill="#222"/></svg> sent</span>'
        f'<span><i style="background:{COLORS["broker"]}"></i> {BROKER_TEXT}</span>'
        f'<span><i style="background:{COLORS["parked"]}"></i> {PARKED_TEXT}</span>'
        f'<span><i style="background:{COLORS["run_upload"]}"></i> upload ran</span>'
        f'<span><i style="background:{COLORS["run_posting"]}"></i> posting ran</span>'
        '<span>✕ superseded by a newer send, never ran (<i class="hatch"></i>parked until then)</span>'
        f'<span><i style="background:{COLORS["final"]};border:1px solid #9c9"></i> the file the group '
        "ends with</span>"
        f'<span><i style="background:none;border-left:2px dashed {COLORS["fail"]}"></i> beat leader '
        "killed (SIGKILL)</span></div>"
    )
    verdicts = "".join(
        f'<li class="{"pass" if c.ok else "fail"}"><b>{"PASS" if c.ok else "FAIL"}</b> '
        f"{html.escape(c.name)}<br><small>{html.escape('; '.join(c.details))}</small></li>"
        for c in checks
    )
    path.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>celery_mongolock demo timeline</title>"
        "<style>body{font-family:sans-serif;margin:16px;color:#222}h2{margin:0 0 4px}"
        "p{margin:4px 0 8px;max-width:1340px;font-size:14px}"
        ".legend{display:flex;flex-wrap:wrap;gap:6px 18px;margin:6px 0 10px;font-size:13px;max-width:1360px}"
        ".legend i{display:inline-block;width:22px;height:10px;vertical-align:middle;margin-right:4px}"
        ".legend i.hatch{background:repeating-linear-gradient(45deg,#e4e4e4 0 3px,#9a9a9a 3px 5px)}"
        "ul{padding-left:18px;margin:6px 0 12px;font-size:13px}li{margin:3px 0}"
        ".pass b{color:#2a6a2a}.fail b{color:#d62728}small{color:#555}</style></head><body>"
        "<h2>celery_mongolock demo: every send, per key, in send order</h2>"
        "<p>Each key has one lane per send, top to bottom in the order sent, on one time axis. Email groups "
        "use <code>Replace</code>: while an upload runs, a newer send replaces the parked one, so the group "
        "ends with the file sent last. Ledger accounts use <code>Queue</code>: every posting runs, one at a "
        "time, in the order sent. Hover a bar for its exact times.</p>"
        + legend
        + svg
        + f"<h3>Invariants</h3><ul>{verdicts}</ul></body></html>"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mongo-url", default=os.environ.get("MONGOLOCK_DEMO_MONGODB_URL"))
    parser.add_argument("--broker-url", default=os.environ.get("MONGOLOCK_DEMO_BROKER_URL"))
    parser.add_argument(
        "--broker",
        choices=("redis", "rabbitmq"),
        default=os.environ.get("MONGOLOCK_DEMO_BROKER") or "redis",
        help="the broker to start when --broker-url is not given (default redis, bundled)",
    )
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--uploads-per-group", type=int, default=4)
    parser.add_argument("--accounts", type=int, default=2)
    parser.add_argument("--postings-per-account", type=int, default=6)
    parser.add_argument("--timeline", default="demo-timeline.html", help="where to write the timeline (HTML)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--external",
        action="store_true",
        help="workers and beats run elsewhere (docker compose): start none, kill none",
    )
    parser.add_argument(
        "--upload-policy",
        default="",
        help="run the uploads with this policy instead of Replace (e.g. retry: watch the invariants fail)",
    )
    parser.add_argument(
        "--ledger-policy",
        default="",
        help="run the postings with this policy instead of Queue (e.g. retry: watch the invariants fail)",
    )
    parser.add_argument("--database", default=None, help="MongoDB database of the example app")
    parser.add_argument(
        "--upload-dir", default=None, help="where to write the CSV files (shared with workers)"
    )
    args = parser.parse_args()

    from pymongo import MongoClient

    def _sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _sigterm)
    rng = random.Random(args.seed)
    run_dir = Path(tempfile.mkdtemp(prefix="mongolock-demo-"))
    procs: list[Proc] = []
    database = args.database or f"emailgroups_demo_{os.getpid()}"
    upload_dir = Path(args.upload_dir) if args.upload_dir else run_dir
    upload_dir.mkdir(parents=True, exist_ok=True)
    ok = True
    try:
        with services(args) as (mongo_url, broker_url, backend_url), ExitStack() as cleanup:
            # Registered first, run last within this block: workers and beats stop before the servers.
            cleanup.callback(stop_all, procs)
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
                "EMAILGROUPS_MONGO_URL": mongo_url,
                "EMAILGROUPS_BROKER_URL": broker_url,
                "EMAILGROUPS_RESULT_BACKEND": backend_url,
                "EMAILGROUPS_DATABASE": database,
                "EMAILGROUPS_READY_DIR": str(run_dir),
                "EMAILGROUPS_LEASE_SECONDS": "10",
                "EMAILGROUPS_BEAT_LEASE_SECONDS": "3",
                "EMAILGROUPS_DIGEST_EVERY": "1",
                "EMAILGROUPS_UPLOAD_POLICY": args.upload_policy,
                "EMAILGROUPS_LEDGER_POLICY": args.ledger_policy,
            }
            os.environ.update({k: env[k] for k in env if k.startswith("EMAILGROUPS_")})
            sys.path.insert(0, str(HERE))
            from emailgroups import app, tasks

            client: MongoClient[dict[str, Any]] = MongoClient(mongo_url)
            db = client[database]
            for name in ("runs", "members", "groups", "ledgers"):  # a clean slate for the invariants
                db[name].drop()
            if args.external:
                print("waiting for the workers and beats ...", flush=True)
                wait_until(lambda: app.control.ping(timeout=1.0), 120, "a worker to answer")
                wait_until(lambda: beat_leader_pid(db), 120, "a beat leader")
            else:
                start_workers_and_beats(procs, env, run_dir, db)
            stats = app.control.inspect(timeout=2.0).stats() or {}
            nodes = None if args.external else len(stats) or None
            slots = sum(int((s.get("pool") or {}).get("max-concurrency") or 0) for s in stats.values())

            plans = make_uploads(args.groups, args.uploads_per_group, upload_dir, rng)
            plans += make_postings(args.accounts, args.postings_per_account, rng)
            plans.sort(key=lambda p: p.offset)
            keys = sorted({p.key for p in plans}, key=lambda k: (not k.startswith("email-group:"), k))
            print(
                f"sending {sum(p.kind == 'upload' for p in plans)} uploads to {args.groups} email groups "
                f"({args.upload_policy or 'Replace'}) and {sum(p.kind == 'posting' for p in plans)} postings "
                f"to {args.accounts} ledger accounts ({args.ledger_policy or 'Queue'}), in bursts, "
                f"on {slots} worker slots ...\n",
                flush=True,
            )

            sends: list[Send] = []
            samples: list[Sample] = []
            started = time.monotonic()
            failovers: list[float] = []
            live = sys.stdout.isatty()
            last_print = last_sample = 0.0
            killed = False
            while True:
                now = time.monotonic()
                while len(sends) < len(plans) and plans[len(sends)].offset <= now - started:
                    plan = plans[len(sends)]
                    t_sent = time.time()
                    if plan.kind == "upload":
                        result = tasks.upload_members.delay(plan.owner, plan.label, plan.path)
                    else:
                        result = tasks.post_to_ledger.delay(plan.owner, plan.label, plan.amount)
                    send = Send(len(sends) + 1, t_sent, plan, result, result.id)
                    sends.append(send)
                    db["runs"].insert_one(
                        {
                            "kind": "send",
                            "t": t_sent,
                            "key": plan.key,
                            "label": plan.label,
                            "task_id": result.id,
                            "seq": send.seq,
                        }
                    )
                sending = len(sends) < len(plans)
                if now - last_sample > 0.5:
                    samples.append(take_sample(db, app, nodes))
                    last_sample = time.monotonic()
                done = not sending and all(s.result.ready() for s in sends)
                if not killed and not args.external and time.monotonic() - started > 3:
                    pid = beat_leader_pid(db)
                    beat = next((p for p in procs if p.name.startswith("beat") and p.proc.pid == pid), None)
                    if beat is not None:
                        print(
                            f"\n>>> killing the beat leader ({beat.name}, pid {pid}) with SIGKILL\n",
                            flush=True,
                        )
                        beat.kill()
                        failovers.append(time.time())
                        killed = True
                # Done when every run finished and beat ticked again after the failover.
                after = failovers[0] + 5 if failovers else 0.0
                if (
                    done
                    and (killed or args.external)
                    and db["runs"].count_documents({"kind": "digest", "t": {"$gt": after}})
                ):
                    break
                if time.monotonic() - started > 240:
                    print("the demo took too long; giving up", flush=True)
                    ok = False
                    break
                if time.monotonic() - last_print > (0.5 if live else 1.0):
                    text = render_live(
                        db,
                        sends=sends,
                        planned=len(plans),
                        keys=keys,
                        sample=samples[-1] if samples else None,
                        slots=slots,
                        started=started,
                    )
                    if live:
                        sys.stdout.write("\x1b[2J\x1b[H" + text + "\n")
                    else:
                        print(text + "\n", flush=True)
                    last_print = time.monotonic()
                time.sleep(0.02 if sending else 0.1)
            last = samples[-1] if samples else None
            print(
                render_live(
                    db, sends=sends, planned=len(plans), keys=keys, sample=last, slots=slots, started=started
                )
                + "\n",
                flush=True,
            )

            # -- summary and invariants --------------------------------------------------------------
            runs = list(db["runs"].find({}))
            told = stories(runs, sends)
            checks = check_invariants(
                db, sends=sends, told=told, samples=samples, slots=slots, upload_dir=upload_dir, runs=runs
            )
            ticks = Counter(r["tick"] for r in runs if r["kind"] == "digest")
            twice = [t for t, c in ticks.items() if c > 1]
            checks.append(
                Check(
                    "every digest tick ran once (two beats, leader killed)",
                    not twice,
                    [f"ticks that ran twice: {sorted(twice)}"]
                    if twice
                    else [f"{len(ticks)} ticks, none twice"],
                )
            )
            overlaps = sum(len(c.details) for c in checks if c.name.startswith("no two runs") and not c.ok)
            retries = sum(1 for r in runs if r["kind"] == "contended" and r["policy"] == "retry")
            skips = sum(
                1 for r in runs if r["kind"] == "contended" and r["policy"] in ("skip", "tick-already-ran")
            )
            leader_changes = sum(
                p.log().count("became the leader") for p in procs if p.name.startswith("beat")
            )
            timeline = Path(args.timeline).resolve()
            # What the groups and ledgers hold at the end (the timeline shows it per key).
            finals: dict[str, Any] = {}
            fences = {g["_id"]: g.get("fence") for g in db["groups"].find({}, {"fence": 1})}
            for doc in db["members"].find({}, {"group": 1, "upload": 1, "fence": 1}):
                if doc.get("fence") != fences.get(doc["group"]):
                    continue  # (a paused holder's late members: not the group's)
                key = f"email-group:{doc['group']}"
                seen = finals.setdefault(key, doc["upload"])
                if seen != doc["upload"]:
                    finals[key] = "a mix of files"
            for doc in db["ledgers"].find({}):
                finals[f"ledger:{doc['_id']}"] = doc.get("entries") or []
            timeline_html(
                timeline,
                sends=sends,
                told=told,
                runs=runs,
                failovers=failovers,
                checks=checks,
                finals=finals,
                policies={
                    "upload": f"{args.upload_policy} (instead of Replace)"
                    if args.upload_policy
                    else "Replace: latest send wins",
                    "posting": f"{args.ledger_policy} (instead of Queue)"
                    if args.ledger_policy
                    else "Queue: every run, in send order",
                },
            )
            ran = sum(1 for st in told.values() if st.starts)
            print("summary")
            print(f"  runs                  {ran} ran, {len(sends) - ran} superseded, of {len(sends)} sent")
            print(f"  runs parked           {sum(1 for st in told.values() if st.parked is not None)}")
            print(f"  contention retries    {retries}")
            print(f"  skips                 {skips}")
            print(f"  overlaps              {overlaps}")
            print(f"  digest ticks          {len(ticks)} (ran twice: {len(twice)})")
            print(f"  beat failovers        {max(0, leader_changes - 1)} (leader killed {len(failovers)}x)")
            took = max((sm.took for sm in samples), default=0.0)
            print(
                f"  slot samples          {len(samples)} (inspect active, the slowest {took * 1000:.0f} ms)"
            )
            print(f"  timeline              {timeline}")
            print("\ninvariants")
            for c in checks:
                print(f"  {'PASS' if c.ok else 'FAIL'}  {c.name}")
                for line in c.details:
                    print(f"          {line}")
            ok = ok and all(c.ok for c in checks) and len(sends) == len(plans)
            if not args.database:
                client.drop_database(database)
            client.close()
            app.close()
    except KeyboardInterrupt:
        print("\ninterrupted; stopped everything", flush=True)
        ok = False
    finally:
        for p in procs:  # already stopped unless start-up failed half way
            p.stop()
    print("\nall invariants held" if ok else "\nAN INVARIANT BROKE (or the demo was interrupted)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
