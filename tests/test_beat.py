"""The highly available beat: real ``celery beat`` processes with our scheduler, a worker, and faults."""

from __future__ import annotations

import datetime as dt
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.schedules import crontab, schedule
from pymongo import MongoClient

from celery_mongolock import ConfigurationError, LeaseStore
from celery_mongolock.beat import next_tick, read_beat_settings

from .servers import RedisServer, wait_for
from .workers import ROOT, Worker, worker_env

UTC = dt.timezone.utc

# -- pure logic ----------------------------------------------------------------------------------------


def test_interval_ticks_are_aligned_to_the_epoch() -> None:
    every5 = schedule(dt.timedelta(seconds=5))
    now = dt.datetime(2026, 1, 1, 12, 0, 7, 300000, tzinfo=UTC)
    assert next_tick(every5, now, now) == dt.datetime(2026, 1, 1, 12, 0, 10, tzinfo=UTC)
    on_tick = dt.datetime(2026, 1, 1, 12, 0, 10, tzinfo=UTC)
    assert next_tick(every5, on_tick, now) == dt.datetime(2026, 1, 1, 12, 0, 15, tzinfo=UTC)


def test_crontab_ticks() -> None:
    every_minute = crontab(minute="*")
    now = dt.datetime(2026, 1, 1, 12, 0, 7, tzinfo=UTC)
    every_minute.nowfun = lambda: now
    after = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    assert next_tick(every_minute, after, now) == dt.datetime(2026, 1, 1, 12, 1, tzinfo=UTC)


def test_beat_settings_defaults_and_errors() -> None:
    s = read_beat_settings({})
    assert (s.key, s.lease_seconds, s.collection) == ("celery-beat:leader", 10.0, "beat_ticks")
    with pytest.raises(ConfigurationError, match="mongolock_beat_lease_seconds"):
        read_beat_settings({"mongolock_beat_lease_seconds": 0})
    with pytest.raises(ConfigurationError, match="mongolock_beat_key"):
        read_beat_settings({"mongolock_beat_key": ""})


# -- real processes --------------------------------------------------------------------------------------

EVERY = 1.0
BEAT_LEASE = 3.0


class Beat:
    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "tests.integration_app",
                "beat",
                "--loglevel=INFO",
                "-s",
                str(log.with_suffix(".schedule")),
            ],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def is_leader(self) -> bool:
        text = self.log()
        return text.rfind("became the leader") > max(
            text.rfind("no longer the leader"), text.rfind("stopped;")
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def beat_cluster(redis_server: RedisServer, mongo_url: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    db_name = f"mongolock_beat_{uuid.uuid4().hex[:8]}"
    # A Redis database of its own, so that no other test's queued tasks interfere.
    broker = redis_server.url.rsplit("/", 1)[0] + "/5"
    env = worker_env(
        broker,
        mongo_url,
        db_name,
        tmp_path,
        lease=3,
        MONGOLOCK_IT_BEAT_SECONDS=EVERY,
        MONGOLOCK_IT_BEAT_LEASE=BEAT_LEASE,
    )
    worker = Worker(env, tmp_path, name=f"bw{uuid.uuid4().hex[:4]}@localhost", concurrency=2).start()
    client: MongoClient[dict[str, Any]] = MongoClient(mongo_url)
    beats: list[Beat] = []
    state = {"env": env, "db": client[db_name], "beats": beats, "tmp": tmp_path, "worker": worker}
    try:
        yield state
    finally:
        for b in beats:
            b.stop()
        worker.stop()
        client.drop_database(db_name)
        client.close()


@pytest.mark.slow
def test_several_beats_send_each_tick_once_and_fail_over(beat_cluster: dict[str, Any]) -> None:
    env, db, beats, tmp = beat_cluster["env"], beat_cluster["db"], beat_cluster["beats"], beat_cluster["tmp"]
    for i in range(3):
        beats.append(Beat(env, tmp / f"beat{i}.log"))

    def leaders() -> list[Beat]:
        return [b for b in beats if b.proc.poll() is None and b.is_leader()]

    def ticks(kind: str) -> list[int]:
        return sorted(r["tick"] for r in db["runs"].find({"kind": kind}))

    wait_for(lambda: len(ticks("beat")) >= 4, timeout=60, message="a few ticks to run")
    assert len(leaders()) == 1

    # 1. SIGKILL the leader: a standby takes over when its lease expires.
    first = leaders()[0]
    first.kill()
    killed_at_ms = int(time.time() * 1000)
    n = len(ticks("beat"))
    wait_for(lambda: len(ticks("beat")) >= n + 3, timeout=BEAT_LEASE + 30, message="ticks after the failover")
    second = wait_for(leaders, timeout=10, message="a new leader")[0]
    assert second is not first
    # The new leader says who led before and why that changed (the killed beat's lease expired).
    host = socket.gethostname()
    assert f"previous leader {host}:{first.proc.pid}: its lease expired" in second.log(), second.log()

    # 2. Stop the new leader gracefully: the last standby takes over at once.
    second.stop()
    stopped_at_ms = int(time.time() * 1000)
    n = len(ticks("beat"))
    wait_for(lambda: len(ticks("beat")) >= n + 3, timeout=30, message="ticks after the graceful handover")
    third = wait_for(leaders, timeout=10, message="the last beat to lead")[0]
    assert third is not first and third is not second
    # (released while the new leader looked, or before: "just now", or "(stopped gracefully)"; ci23 saw the
    # first on a busy machine. Either way a release, not an expiry.)
    handover = f"previous leader {host}:{second.proc.pid}: it released the lease"
    assert handover in third.log(), third.log()
    assert "became the leader" in first.log()
    # The first beat to lead says so; on a busy machine a lease can change hands before the kill above, so
    # that beat is not always the one killed.
    assert any("first leader (no leader lease before)" in b.log() for b in beats)
    # Stop sending, then wait for the worker to run the last tick each entry was sent for.
    for b in beats:
        b.stop()
    last = {d["_id"]: d["last_tick"] for d in db["beat_ticks"].find()}
    wait_for(
        lambda: last["singleton-job"] in ticks("beat") and last["plain-job"] in ticks("plain-beat"),
        timeout=30,
        message="the worker to run the last ticks sent",
    )

    for kind in ("beat", "plain-beat"):
        seen = ticks(kind)
        counts = Counter(seen)
        assert all(c == 1 for c in counts.values()), f"{kind}: a tick ran twice: {counts.most_common(3)}"
        # No tick missing outside the failover windows (ticks are whole seconds, epoch-aligned).
        period = int(EVERY * 1000)
        expected = set(range(seen[0], seen[-1] + 1, period))
        missing = sorted(expected - set(seen))
        for t in missing:
            after_kill = killed_at_ms - period <= t <= killed_at_ms + (BEAT_LEASE + 2) * 1000
            after_stop = stopped_at_ms - period <= t <= stopped_at_ms + 2000
            assert after_kill or after_stop, f"{kind}: tick {t} missed outside a failover window"
    assert "no longer the leader" not in "".join(b.log() for b in beats if b is not first)
    # With our scheduler, neither the beats nor the worker warn that it is not used (issue 27).
    assert "not celery_mongolock.beat:Scheduler" not in "".join(b.log() for b in beats)
    worker_log = beat_cluster["worker"].log_path.read_text(errors="replace")
    assert "does not run celery_mongolock.beat:Scheduler" not in worker_log


def test_server_time_follows_the_server_and_the_monotonic_clock_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beat schedules on ServerTime: a jump of the local wall clock changes nothing."""
    from celery_mongolock.clock import FakeClock, ServerTime

    server_now = dt.datetime(2026, 1, 1, 12, 0, 0)
    clock = FakeClock()
    calls: list[int] = []

    def hello() -> dict[str, Any]:
        calls.append(1)
        clock.advance(0.002)  # a 2 ms round trip
        return {"localTime": server_now}

    st = ServerTime(hello, clock=clock, refresh_seconds=60)
    first = st.now()
    assert first == dt.datetime(2026, 1, 1, 12, 0, 0, 1000, tzinfo=UTC)  # + half the round trip
    monkeypatch.setattr(time, "time", lambda: 0.0)  # the local wall clock jumps to 1970: ignored
    clock.advance(10)
    assert st.now() == first + dt.timedelta(seconds=10)
    assert len(calls) == 1
    clock.advance(60)
    st.now()
    assert len(calls) == 2  # re-sampled after refresh_seconds
    assert st.uncertainty < 0.01


# -- a beat that does not run our scheduler (issue 27) --------------------------------------------------

TOO_LATE_CELERY = """
from celery import Celery

app = Celery("proj", broker="{broker}", include=["proj.tasks"])
app.conf.mongolock_url = "{mongo}"
app.conf.mongolock_database = "{db}"
"""
# beat_scheduler set beside beat_schedule in the tasks module: `celery beat` chose its scheduler before
# it imported this module, so it runs Celery's own.
TOO_LATE_TASKS = """
from celery_mongolock import singleton_task

from .celery import app

app.conf.beat_scheduler = "celery_mongolock.beat:Scheduler"
app.conf.beat_schedule = {{"digest": {{"task": "proj.tasks.send_digest", "schedule": 1.0}}}}


@singleton_task(key="digest:{db}", app=app)
def send_digest() -> str:
    return "sent"
"""


@pytest.mark.slow
def test_a_beat_that_does_not_run_our_scheduler_is_named_in_a_warning(
    redis_server: RedisServer, mongo_url: str, tmp_path: Path
) -> None:
    """The beat says at start that beat_scheduler came too late; a worker says, once, that it runs
    beat-sent singleton runs without a tick."""
    db = f"beatlate_{uuid.uuid4().hex[:8]}"
    broker = redis_server.url.rsplit("/", 1)[0] + "/6"
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "__init__.py").write_text("")
    (tmp_path / "proj" / "celery.py").write_text(
        TOO_LATE_CELERY.format(broker=broker, mongo=mongo_url, db=db)
    )
    (tmp_path / "proj" / "tasks.py").write_text(TOO_LATE_TASKS.format(db=db))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MONGOLOCK_", "CELERY_"))}
    env.pop("PYTHONPATH", None)
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    for name, args in (
        ("beat", ["beat", "--loglevel=INFO", "-s", str(tmp_path / "schedule")]),
        ("worker", ["worker", "--loglevel=INFO", "--concurrency=1", "--without-gossip", "--without-mingle"]),
    ):
        log_path = tmp_path / f"{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "proj", *args],
                cwd=tmp_path,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        procs.append((proc, log_path))
    (beat, beat_log), (worker, worker_log) = procs

    def logged(path: Path, words: str, proc: subprocess.Popen[bytes]) -> bool:
        assert proc.poll() is None, path.read_text(errors="replace")
        return words in path.read_text(errors="replace")

    try:
        wait_for(
            lambda: logged(beat_log, "although beat_scheduler names it", beat),
            timeout=60,
            message="the beat's warning",
        )
        text = beat_log.read_text(errors="replace")
        assert "this beat runs celery.beat:PersistentScheduler, not celery_mongolock.beat:Scheduler" in text
        assert "start the beat with -S celery_mongolock.beat:Scheduler" in text
        wait_for(
            lambda: logged(worker_log, "was sent by a celery beat that does not run", worker),
            timeout=60,
            message="the worker's warning",
        )
        # Three runs ended: the key's history says so (not Celery's "succeeded in" log lines).
        with LeaseStore(mongo_url, database=db) as store:
            wait_for(
                lambda: len(store.history(f"digest:{db}", 10)) >= 3,
                timeout=60,
                message="three beat-sent runs",
            )
        warnings = [
            line for line in worker_log.read_text(errors="replace").splitlines() if "does not run" in line
        ]
        assert len(warnings) == 1, warnings  # once per worker process
        assert "proj.tasks.send_digest[" in warnings[0] and "(no tick header)" in warnings[0]
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
