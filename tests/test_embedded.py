"""The embedded MongoDB-compatible server: start, answer, stop cleanly, never left running."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient, monitoring
from pymongo.errors import PyMongoError

from celery_mongolock import LeaseStore
from celery_mongolock.embedded import EmbeddedMongo, EmbeddedMongoError
from celery_mongolock.testing import wait_for

ROOT = Path(__file__).resolve().parents[1]


def _answers(url: str) -> bool:
    c: MongoClient[dict[str, object]] = MongoClient(url, serverSelectionTimeoutMS=300)
    try:
        c.admin.command("ping")
        return True
    except PyMongoError:
        return False
    finally:
        c.close()


def test_start_answer_stop() -> None:
    with EmbeddedMongo() as server:
        assert server.running and server.url.startswith("mongodb://127.0.0.1:")
        assert _answers(server.url)
        pid = server.pid
        assert pid is not None
        client: MongoClient[dict[str, object]] = MongoClient(server.url)
        try:
            assert client.admin.command("hello").get("setName")  # presents a one-node replica set
        finally:
            client.close()  # presents a one-node replica set
    assert not server.running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not _answers(server.url)


def test_file_backed_storage_survives_restart(tmp_path: Path) -> None:
    server = EmbeddedMongo(storage_path=tmp_path / "data").start()
    try:
        store = LeaseStore(server.url, operation_timeout=5)
        lease = store.acquire("k", ttl=60)
        assert lease is not None
        store.close()
        server.restart()
        store = LeaseStore(server.url, operation_timeout=5)
        info = store.inspect("k")
        assert info is not None and info.owner == lease.owner and info.fence == lease.fence
        store.close()
    finally:
        server.stop()


def test_a_server_that_cannot_start_reports_why() -> None:
    with EmbeddedMongo() as first:
        clash = EmbeddedMongo(port=first.port, startup_timeout=20)
        with pytest.raises(EmbeddedMongoError, match="already in use"):
            clash.start()
        assert not clash.running


@contextlib.contextmanager
def _module_server(*args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``python -m celery_mongolock.embedded`` started, with the URL it printed (it answers ping)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery_mongolock.embedded", *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("mongodb://127.0.0.1:")
        assert _answers(url)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        if proc.stdout is not None:
            proc.stdout.close()


def test_module_passes_its_cache_size_to_the_server() -> None:
    """``--cache-size`` (a trial's in-memory server filled its 1G cache with runs of 1 MB messages): the
    server process it starts is given it."""
    with _module_server("--cache-size", "2G") as (proc, _url):
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        commands = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in children]
        assert any(b"--cache-size" in c and c[c.index(b"--cache-size") + 1] == b"2G" for c in commands)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0


def test_module_prints_url_and_stops_on_sigint() -> None:
    with _module_server() as (proc, url):
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert not _answers(url)


def test_module_stops_its_server_on_sigterm() -> None:
    with _module_server() as (proc, url):
        proc.terminate()
        assert proc.wait(30) == 0
        assert not _answers(url)


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's (prctl)")
def test_a_killed_module_leaves_no_server_behind() -> None:
    """``python -m celery_mongolock.embedded`` SIGKILLed (no handler runs): its server goes too, and the
    port is free to start it again (a user's trial: the server went on serving, and a restart failed with
    'port ... already in use')."""
    with _module_server() as (proc, url):
        proc.kill()
        proc.wait(30)
        wait_for(lambda: not _answers(url), timeout=60, message="the server to go with its command")


#: ``tgkill`` (a signal to one thread of another process), by machine; Linux only.
_TGKILL = {"x86_64": 234, "aarch64": 131}


def test_a_stop_signal_taken_by_another_thread_still_stops_the_server() -> None:
    # The kernel may hand a process's SIGTERM to any of its threads. SecantusDB's main thread, where its
    # handler runs, waited with no timeout and was never woken: the server never exited (2 of 150 stops
    # under load, SIGKILLed after 30 s). Here the signal goes to another thread on purpose.
    import ctypes
    import platform

    number = _TGKILL.get(platform.machine())
    if not sys.platform.startswith("linux") or number is None:
        pytest.skip("sends a signal to one thread with Linux's tgkill")
    server = EmbeddedMongo().start()
    proc = server._proc
    assert proc is not None
    try:
        # Its oldest other thread first (its storage's and accept threads live as long as it does; a
        # connection's thread may be gone by now: then the next one).
        others = sorted(int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid)
        libc = ctypes.CDLL(None, use_errno=True)
        sent = next((t for t in others if libc.syscall(number, proc.pid, t, signal.SIGTERM) == 0), None)
        assert sent is not None, f"no thread besides the main one took the signal: {others}"
        # It stops by itself: nothing else is sent (a hang fails here, at pytest's own timeout at most).
        assert proc.wait(timeout=60) == 0
    finally:
        server.stop(timeout=5)


def test_stop_with_no_client_connected_exits_cleanly() -> None:
    # SecantusDB's stop joins its accept thread, which closing the listening socket does not wake;
    # stop() connects to wake it (measured: 2.07 s -> 0.08 s per stop). Here: the server exits by
    # itself (code 0, not SIGKILLed after the timeout).
    server = EmbeddedMongo().start()
    proc = server._proc
    assert proc is not None
    server.stop(timeout=30)
    assert proc.returncode == 0
    assert not _answers(server.url)


def test_the_servers_retryable_write_records_are_pruned_in_bulk(monkeypatch: pytest.MonkeyPatch) -> None:
    """``server_patches.TUNE``, run in the server's process: the records of retryable writes are kept as
    SecantusDB keeps them (its cap and lifetime), but pruned in bulk instead of by a scan and a sort on
    every write (the before and after are in ``benchmarks/embedded_retryable.py``)."""
    from secantus import transactions

    from celery_mongolock.ops import server_patches

    monkeypatch.setattr(  # restored after the test: the patch is for the server's process, not ours
        transactions.TransactionRegistry,
        "_prune_retryable_locked",
        transactions.TransactionRegistry._prune_retryable_locked,
    )
    exec(server_patches.TUNE, {})
    cap = transactions._RETRYABLE_RECORD_MAX
    life = transactions._RETRYABLE_RECORD_LIFETIME_SECONDS
    now = [1000.0]
    registry = transactions.TransactionRegistry(time_func=lambda: now[0])
    reply = {"ok": 1.0, "n": 1}
    for i in range(cap + 1):
        registry.record_retryable(b"session", i, b"write", reply)
    kept = registry._retryable
    assert cap - cap // 10 <= len(kept) <= cap
    assert (b"session", cap) in kept and (b"session", 0) not in kept  # the newest kept, the oldest dropped
    # Past their lifetime (looked at no more than once a second): gone at the next record.
    now[0] += life + 2
    registry.record_retryable(b"session", cap + 1, b"write", reply)
    assert list(registry._retryable) == [(b"session", cap + 1)]


def test_a_change_stream_start_time_is_found_by_bisection_with_the_same_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``server_patches.SEEK``, run in the server's process: where a stream opened at an operation time starts
    is found in a few point reads, not by decoding the whole oplog under the server's lock (4 s per
    opening with 46,801 entries, every other command waiting), with the same answer as SecantusDB's scan
    for every time: before the first entry, at each entry, between two, after the last."""
    from bson import Timestamp
    from secantus import storage

    from celery_mongolock.ops import server_patches

    scan = storage.Storage._find_seq_for_ts_scan
    # restored after the test: the patch is for the server's process, not ours
    monkeypatch.setattr(storage.Storage, "_find_seq_for_ts_scan", scan)
    exec(server_patches.SEEK, {})
    seek = storage.Storage._find_seq_for_ts_scan
    assert seek is not scan
    db = storage.Storage(":memory:")
    try:
        for i in range(300):  # one oplog entry each, several within one second (the same ``time``)
            db.insert("d", "c", [{"_id": i}])
        session = db._conn.open_session()
        rows, _high = db._merge_oplog_on_session(session, 0, 2**63 - 1)
        session.close()
        times = [entry["ts"] for _seq, entry in rows]
        assert len(times) >= 300
        probes = [Timestamp(0, 0), Timestamp(2**31 - 1, 0)]
        probes += list(times[::7]) + [Timestamp(t.time, t.inc + 1) for t in times[::11]]
        probes += [Timestamp(t.time, 0) for t in times[::13]]
        for at in probes:
            assert seek(db, at) == scan(db, at), at
    finally:
        db.close()


def test_a_stream_opened_at_an_operation_time_starts_with_the_next_write() -> None:
    """Over the wire, on the embedded server (its process patched by ``SEEK``): a change stream opened
    at the operation time of a write sees every write after it, and nothing before."""
    with EmbeddedMongo() as server:
        client: MongoClient[dict[str, object]] = MongoClient(server.url)
        try:
            coll = client["seek"]["c"]
            session_times = []
            for i in range(200):
                with client.start_session() as s:
                    coll.insert_one({"_id": i}, session=s)
                    session_times.append(s.operation_time)
            at = session_times[120]
            seen: list[object] = []
            deadline = time.monotonic() + 60  # (an empty batch is no end: the events are in the oplog)
            with coll.watch(start_at_operation_time=at, max_await_time_ms=200) as stream:
                while len(seen) < 80 and time.monotonic() < deadline:
                    event: Any = stream.try_next()
                    if event is not None:
                        seen.append(event["documentKey"]["_id"])
            assert seen == list(range(120, 200))
        finally:
            client.close()


def test_a_database_s_profiling_level_is_read_once_and_forgotten_when_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``server_patches.PROFILE``, run in the server's process: the level SecantusDB reads after every command
    is kept per database, and ``set_profile`` (the ``profile`` command) is seen at once."""
    from secantus import storage

    from celery_mongolock.ops import server_patches

    for name in ("get_profile", "set_profile"):  # restored after the test (the server's process only)
        monkeypatch.setattr(storage.Storage, name, getattr(storage.Storage, name))
    exec(server_patches.PROFILE, {})
    db = storage.Storage(":memory:")
    try:
        assert db.get_profile("a")["level"] == 0
        db.set_profile("a", level=2, slowms=5)
        assert db.get_profile("a") == {"level": 2, "slowms": 5, "sampleRate": 1.0}
        assert db.get_profile("b")["level"] == 0
        db.get_profile("a")["level"] = 0  # a copy: what the caller changes is not kept
        assert db.get_profile("a")["level"] == 2
        db.set_profile("a", level=0)
        assert db.get_profile("a")["level"] == 0
    finally:
        db.close()


def test_the_profile_command_still_turns_profiling_on_and_off() -> None:
    """Over the wire, on the embedded server (its process patched by ``PROFILE``)."""
    with EmbeddedMongo() as server:
        client: MongoClient[dict[str, object]] = MongoClient(server.url)
        try:
            db = client["prof"]
            assert db.command("profile", -1)["was"] == 0
            db.command("profile", 2)
            db["c"].insert_one({"_id": 1})
            assert db.command("profile", -1)["was"] == 2
            db.command("profile", 0)
            assert db.command("profile", -1)["was"] == 0
        finally:
            client.close()


# -- COPY: stages that copy the top level only -------------------------------------------------------------

_NAMES = ("a", "b", "q", "ho")


def _values(depth: int = 0) -> Any:
    from hypothesis import strategies as st

    scalars = st.one_of(st.integers(-3, 3), st.text("xy", max_size=2), st.none(), st.booleans())
    if depth >= 2:
        return scalars
    inner = _values(depth + 1)
    return st.one_of(
        scalars,
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(_NAMES), inner, max_size=3),
    )


def _paths() -> Any:
    from hypothesis import strategies as st

    segment = st.one_of(st.sampled_from(_NAMES), st.sampled_from(("0", "1")))
    return st.builds(
        lambda top, below: ".".join([top, *below]), st.sampled_from(_NAMES), st.lists(segment, max_size=3)
    )


def _stages() -> Any:
    from hypothesis import strategies as st

    expressions = st.one_of(
        _values(1).map(lambda v: {"$literal": v}),
        _paths().map(lambda p: "$" + p),
        st.just("$$REMOVE"),
        st.tuples(st.sampled_from(_NAMES), st.sampled_from(_NAMES)).map(
            lambda ab: {"$concatArrays": [{"$ifNull": ["$" + ab[0], []]}, [{"$ifNull": ["$" + ab[1], 0]}]]}
        ),
    )
    add = st.dictionaries(_paths(), expressions, min_size=1, max_size=3)
    return st.one_of(
        add.map(lambda spec: {"$set": spec}),
        add.map(lambda spec: {"$addFields": spec}),
        st.lists(_paths(), min_size=1, max_size=3, unique=True).map(
            lambda ps: {"$project": dict.fromkeys(ps, 0)}
        ),
        st.lists(_paths(), min_size=1, max_size=3, unique=True).map(lambda ps: {"$unset": ps}),
        _paths().map(lambda p: {"$unset": p}),
        st.just({"$project": {"_id": 0}}),
    )


def test_stages_that_copy_the_top_level_only_give_the_same_documents_and_leave_their_input_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``server_patches.COPY``, run in the server's process: ``$set``/``$addFields``, exclusion
    ``$project`` and ``$unset`` give what SecantusDB's own stages give, over nested documents and arrays,
    dotted paths, and values taken from other fields; and the documents a pipeline was given are not
    changed."""
    import copy

    from hypothesis import given, settings
    from hypothesis import strategies as st
    from secantus import aggregate

    from celery_mongolock.ops import server_patches

    shipped = dict(aggregate._STAGES)
    patched = dict(shipped)
    monkeypatch.setattr(aggregate, "_STAGES", patched)
    exec(server_patches.COPY, {})
    assert all(patched[n] is not shipped[n] for n in ("$set", "$addFields", "$project", "$unset"))

    def run(stages: dict[str, Any], docs: list[dict[str, Any]], pipeline: list[dict[str, Any]]) -> Any:
        monkeypatch.setattr(aggregate, "_STAGES", stages)
        try:
            return ("ok", aggregate.apply_pipeline(docs, pipeline, aggregate.PipelineContext()))
        except Exception as exc:  # the same refusal, whichever stages ran
            return ("error", type(exc).__name__)

    docs_st = st.lists(
        st.dictionaries(st.sampled_from(_NAMES), _values(), max_size=4).map(lambda d: {"_id": 1, **d}),
        min_size=1,
        max_size=3,
    )

    @settings(max_examples=400, deadline=None, database=None)
    @given(docs=docs_st, pipeline=st.lists(_stages(), min_size=1, max_size=4))
    def same(docs: list[dict[str, Any]], pipeline: list[dict[str, Any]]) -> None:
        expected = run(shipped, copy.deepcopy(docs), pipeline)
        given_docs = copy.deepcopy(docs)
        got = run(patched, given_docs, pipeline)
        assert got == expected
        assert given_docs == docs  # the input left alone

    same()
    # The stages that ran were the patched ones: a field no stage touched is the input's own object.
    for stage in ({"$set": {"a": 2}}, {"$project": {"a": 0}}, {"$unset": "a"}):
        doc = {"_id": 1, "a": 1, "keep": {"x": [1]}}
        _kind, [out] = run(patched, [doc], [stage])
        assert out["keep"] is doc["keep"], stage
        assert run(shipped, [doc], [stage])[1][0]["keep"] is not doc["keep"]


def test_a_filter_with_top_level_operators_is_planned_on_its_plain_fields_with_the_same_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``server_patches.PLAN``, run in the server's process: ``{"_id": k, "$or": [...]}`` and the like are
    answered from the ``_id`` (or another) index instead of a scan of the collection, with the same
    documents as SecantusDB's own plan."""
    from secantus import storage

    from celery_mongolock.ops import server_patches

    db = storage.Storage(":memory:")
    scans: list[str] = []
    scan = storage.Storage._scan_docs_natural

    def counted(self: Any, database: str, coll: str) -> Any:
        scans.append(coll)
        return scan(self, database, coll)

    monkeypatch.setattr(storage.Storage, "_scan_docs_natural", counted)
    monkeypatch.setattr(storage.Storage, "_try_index_id_keys", storage.Storage._try_index_id_keys)
    try:
        db.insert("d", "c", [{"_id": f"k{i}", "n": i, "q": [{"id": f"r{i}"}], "o": i % 3} for i in range(50)])
        filters: list[dict[str, Any]] = [
            {"_id": "k7", "$or": [{"q.id": "r7"}, {"o": 9}]},
            {"_id": "k7", "$or": [{"q.id": "nope"}]},
            {"_id": "k8", "$expr": {"$eq": ["$n", 8]}},
            {"_id": "k8", "$expr": {"$eq": ["$n", 9]}},
            {"_id": {"$in": ["k1", "k2", "k3"]}, "$and": [{"o": {"$gte": 1}}], "$comment": "x"},
            {"_id": "k9", "n": 9, "$nor": [{"o": 1}]},
            {"$or": [{"_id": "k1"}, {"_id": "k2"}]},  # no plain field: planned as shipped
        ]
        shipped = [db.find_matching("d", "c", dict(f)) for f in filters]
        shipped_scans = len(scans)
        exec(server_patches.PLAN, {})
        scans.clear()
        patched = [db.find_matching("d", "c", dict(f)) for f in filters]
        assert patched == shipped
        assert [len(found) for found in patched] == [1, 0, 1, 0, 2, 1, 2]
        assert shipped_scans == len(filters) and scans == ["c"]  # only the filter without a plain field
    finally:
        db.close()


def test_the_time_zone_check_of_a_stage_gives_secantus_answer_and_walks_only_a_stage_that_names_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``server_patches.ZONE``, run in the server's process: the same answer as SecantusDB's own walk for
    stages with and without date operators, good and bad zones; the walk runs only for the former."""
    from secantus import aggregate

    from celery_mongolock.ops import server_patches

    shipped = aggregate._literal_timezone_problem
    monkeypatch.setattr(aggregate, "_literal_timezone_problem", shipped)
    specs: list[Any] = [
        {"a": {"$add": [1, "$b"]}, "q": {"$concatArrays": ["$q", [{"s": 1}]]}},
        {"h": {"$hour": {"date": "$d", "timezone": "Not/AZone"}}},
        {"h": {"$hour": {"date": "$d", "timezone": "Europe/Paris"}}},
        [{"x": {"$cond": [True, {"$dateToString": {"date": "$d", "timezone": "Bad/Zone"}}, 1]}}],
        {"s": "$hour", "t": {"$literal": "$dateFromString"}},  # the names as values: walked, no problem
        {"d": {"$dateFromString": {"dateString": "$s", "format": "%Q"}}},
        7,
    ]
    expected = [shipped(spec) for spec in specs]
    assert expected[1] is not None and expected[3] is not None and expected[5] is not None
    namespace: dict[str, Any] = {}
    exec(server_patches.ZONE, namespace)
    patched = aggregate._literal_timezone_problem
    assert patched is not shipped
    walked: list[Any] = []

    def counted(spec: Any) -> Any:
        walked.append(spec)
        return shipped(spec)

    namespace["_zone_as_shipped"] = counted
    assert [patched(spec) for spec in specs] == expected
    # The first names no date operator: neither it nor any part of it was walked.
    first = [specs[0], specs[0]["a"], specs[0]["q"]]
    assert walked and not [w for w in walked if any(w is part for part in first)]


class _GetMores(monitoring.CommandListener):
    """Counts the ``getMore`` commands a client sends; calls ``on_first`` when the first one starts."""

    def __init__(self, on_first: Any) -> None:
        self.count = 0
        self._on_first = on_first

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name == "getMore":
            self.count += 1
            if self.count == 1:
                self._on_first()

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def test_a_stream_s_get_more_answers_only_with_an_event_that_passes_or_at_the_end_of_its_wait() -> None:
    """Over the wire (``AWAIT``): while one ``getMore`` of a stream waits, writes to another collection and
    writes its ``$match`` drops do not answer it; the first event that passes does, in that same
    ``getMore``. As shipped, each of those writes answered the waiting ``getMore`` with an empty batch."""
    with EmbeddedMongo() as server:
        writer: MongoClient[dict[str, Any]] = MongoClient(server.url)
        done = threading.Event()

        def write() -> None:
            try:
                for i in range(20):
                    writer["await"]["other"].insert_one({"_id": i})
                    writer["await"]["watched"].insert_one({"_id": i, "kind": "dropped"})
                writer["await"]["watched"].insert_one({"_id": "last", "kind": "passes"})
            finally:
                done.set()

        thread = threading.Thread(target=write, daemon=True)
        listener = _GetMores(thread.start)
        reader: MongoClient[dict[str, Any]] = MongoClient(server.url, event_listeners=[listener])
        try:
            pipeline = [{"$match": {"fullDocument.kind": "passes"}}]
            # The wait is long (60 s): the writes all come inside the first getMore's wait.
            with reader["await"]["watched"].watch(pipeline, max_await_time_ms=60_000) as stream:
                event: Any = stream.next()
            assert event["documentKey"]["_id"] == "last"
            assert done.wait(60)
            assert listener.count == 1, listener.count
        finally:
            reader.close()
            writer.close()


def test_a_stream_s_get_more_reads_all_that_was_written_before_it_waits() -> None:
    """Over the wire (``AWAIT``): a stream opened before 700 writes its ``$match`` drops (more than one
    read of the oplog takes) and one that passes gets that one in its first ``getMore``: the ``getMore``
    reads on while the oplog holds more than it read, and waits only once it has read everything."""
    with EmbeddedMongo() as server:
        client: MongoClient[dict[str, Any]] = MongoClient(server.url)
        listener = _GetMores(lambda: None)
        reader: MongoClient[dict[str, Any]] = MongoClient(server.url, event_listeners=[listener])
        try:
            coll = client["await"]["watched"]
            with client.start_session() as session:
                coll.insert_one({"_id": "first", "kind": "before"}, session=session)
                since = session.operation_time
            coll.insert_many([{"_id": i, "kind": "dropped"} for i in range(700)])
            coll.insert_one({"_id": "last", "kind": "passes"})
            pipeline = [{"$match": {"fullDocument.kind": "passes"}}]
            watched = reader["await"]["watched"]
            with watched.watch(pipeline, start_at_operation_time=since, max_await_time_ms=5_000) as stream:
                event: Any = stream.next()
            assert event["documentKey"]["_id"] == "last"
            assert listener.count <= 1, listener.count
        finally:
            reader.close()
            client.close()


def _waiting_get_more(
    server: EmbeddedMongo, max_time_ms: int
) -> tuple[Any, threading.Thread, dict[str, Any]]:
    """A change stream opened by hand and its ``getMore`` sent from a thread (its answer in the dict, under
    "reply" or "error"); returns once the ``getMore`` is on its way."""
    started = threading.Event()
    listener = _GetMores(started.set)
    client: MongoClient[dict[str, Any]] = MongoClient(server.url, event_listeners=[listener])
    db = client["await"]
    opened = db.command("aggregate", "watched", pipeline=[{"$changeStream": {}}], cursor={})
    cursor_id = opened["cursor"]["id"]
    answer: dict[str, Any] = {"id": cursor_id}

    def get_more() -> None:
        try:
            answer["reply"] = db.command("getMore", cursor_id, collection="watched", maxTimeMS=max_time_ms)
        except PyMongoError as exc:
            answer["error"] = exc

    thread = threading.Thread(target=get_more, daemon=True)
    thread.start()
    assert started.wait(30)
    # Sent is not yet received: the server lists the getMore among its operations once it handles it.
    wait_for(
        lambda: any(op.get("op") == "getMore" for op in client.admin.command("currentOp").get("inprog", [])),
        timeout=60,
        message="the server to be handling the getMore",
    )
    return client, thread, answer


def test_a_stream_killed_while_its_get_more_waits_answers_it_as_closed() -> None:
    """Over the wire (``AWAIT``): ``killCursors`` while the stream's ``getMore`` waits answers that
    ``getMore`` ``ok`` with the cursor closed (id 0), as SecantusDB and mongod do, not "cursor not found"
    (which a driver takes for a reason to resume the stream: the lease watcher's stop opened a new one).

    The kill can still come between the server taking the getMore and its first read of the stream (a busy
    machine: ci74, with CPU taken by the suite beside it), and then "not found" is the right answer: so
    up to three streams, each of which must end either way, and one must be answered closed."""
    answers: list[dict[str, Any]] = []
    with EmbeddedMongo() as server:
        for _ in range(3):
            client, thread, answer = _waiting_get_more(server, 60_000)
            try:
                killed = client["await"].command("killCursors", "watched", cursors=[answer["id"]])
                assert killed["cursorsKilled"] == [answer["id"]]
                thread.join(60)
                assert not thread.is_alive(), "the getMore was not answered after its cursor was killed"
            finally:
                client.close()
            answers.append(answer)
            if "error" not in answer:
                break
        assert "error" not in answers[-1], answers
        assert answers[-1]["reply"]["ok"] == 1 and answers[-1]["reply"]["cursor"]["id"] == 0


def test_the_parse_check_of_a_pipeline_gives_secantus_answer_and_checks_a_stage_seen_before_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``server_patches.PARSE``, run in the server's process: the same answer as SecantusDB's own check for
    pipelines with and without problems (a fold error, an unknown operator, an undefined variable, one
    bound by the command's ``let``), and a stage seen before (with the same variables) is not checked
    again."""
    from secantus import aggregate, commands

    from celery_mongolock.ops import server_patches

    shipped = aggregate.expression_problem_in_pipeline
    monkeypatch.setattr(aggregate, "expression_problem_in_pipeline", shipped)
    monkeypatch.setattr(commands, "expression_problem_in_pipeline", shipped)
    ok = {"$set": {"a": {"$add": [1, "$b"]}, "q": {"$concatArrays": ["$q", [{"s": 1}]]}}}
    cases: list[tuple[Any, frozenset[str], Any]] = [
        ([ok, {"$unset": "c"}], frozenset(), None),
        ([ok, {"$set": {"a": {"$divide": [1, 0]}}}], frozenset(), None),
        ([{"$set": {"a": {"$noSuchOperator": 1}}}, ok], frozenset(), None),
        ([ok, {"$set": {"a": "$$nowhere"}}], frozenset(), None),
        ([ok, {"$set": {"a": "$$x"}}], frozenset({"x"}), {"x": 2}),
        ([ok, {"$set": {"a": {"$divide": [1, "$$x"]}}}], frozenset({"x"}), {"x": 0}),
        ([ok, {"$set": {"a": {"$divide": [1, "$$x"]}}}], frozenset({"x"}), {"x": 2}),
        ([{"$project": {"a": 0}}, {"$match": {"$expr": {"$eq": ["$a", 1]}}}], frozenset(), None),
        ("not a pipeline", frozenset(), None),
    ]
    expected = [shipped(p, bound, let) for p, bound, let in cases]
    assert expected[0] is None and expected[4] is None and expected[6] is None
    assert all(expected[i] is not None for i in (1, 2, 3, 5)), expected
    namespace: dict[str, Any] = {}
    exec(server_patches.PARSE, namespace)
    patched = aggregate.expression_problem_in_pipeline
    assert patched is not shipped and commands.expression_problem_in_pipeline is patched
    checked: list[Any] = []

    def counted(pipeline: Any, bound: frozenset[str], fold_vars: Any = None) -> Any:
        checked.append(pipeline)
        return shipped(pipeline, bound, fold_vars)

    namespace["_pp_as_shipped"] = counted
    assert [patched(p, bound, let) for p, bound, let in cases] == expected
    first = len(checked)
    assert [patched(p, bound, let) for p, bound, let in cases] == expected  # from the kept answers
    assert checked[first:] == ["not a pipeline"]  # (not a list: as shipped, each time)
    # The stage common to seven pipelines was checked once for each of its three sets of variables.
    assert sum(1 for p, _, _ in cases if isinstance(p, list) and ok in p) == 7
    assert checked[:first].count([ok]) == 3


def _stream_events(url: str, pipeline: list[Any], writes: Any) -> list[dict[str, Any]]:
    """The events a stream with ``pipeline`` (``updateLookup``) gets for ``writes(collection)``, read up to
    a sentinel deletion (which every pipeline here passes)."""
    client: MongoClient[dict[str, Any]] = MongoClient(url)
    try:
        coll = client["lookup"]["leases"]
        coll.delete_many({})
        got: list[dict[str, Any]] = []
        with coll.watch(pipeline, full_document="updateLookup", max_await_time_ms=200) as stream:
            writes(coll)
            coll.insert_one({"_id": "sentinel"})
            coll.delete_one({"_id": "sentinel"})
            while not got or got[-1]["operationType"] != "delete":
                event = stream.try_next()
                if event is not None:
                    got.append(
                        {k: v for k, v in event.items() if k not in ("_id", "clusterTime", "wallTime")}
                    )
        return got
    finally:
        client.close()


def test_an_update_the_stream_s_first_match_drops_is_not_looked_up(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``server_patches.LOOKUP``, on a SecantusDB server in this process: a stream whose first ``$match``
    names no ``fullDocument`` field (as the lease watch's) gets the same events as shipped, and the updates
    that ``$match`` drops (a lease's renewals) are no longer looked up: one read, not 31."""
    from secantus import changestreams, commands
    from secantus.server import SecantusDBServer

    from celery_mongolock.ops import server_patches

    lookups: list[Any] = []
    shipped_lookup = changestreams._do_lookup

    def counted(storage: Any, db: str, coll: str, doc_id: Any) -> Any:
        lookups.append(doc_id)
        return shipped_lookup(storage, db, coll, doc_id)

    monkeypatch.setattr(changestreams, "_do_lookup", counted)
    monkeypatch.setattr(changestreams, "project", changestreams.project)
    monkeypatch.setattr(commands, "_drain_change_stream_producer", commands._drain_change_stream_producer)
    pipeline = [
        {
            "$match": {
                "$or": [{"operationType": "delete"}, {"updateDescription.updatedFields.end": {"$exists": 1}}]
            }
        },
        {"$match": {"$or": [{"operationType": "delete"}, {"fullDocument.who": "me"}]}},
    ]

    def writes(coll: Any) -> None:
        coll.insert_many([{"_id": "k", "n": 0, "who": "me"}, {"_id": "j", "who": "them"}])
        for _ in range(30):
            coll.update_one({"_id": "k"}, {"$inc": {"n": 1}})  # renewals: the first $match drops them
        coll.update_one({"_id": "k"}, {"$set": {"end": 1}})  # passes both
        coll.update_one({"_id": "j"}, {"$set": {"end": 2}})  # passes the first, not the second

    server = SecantusDBServer(port=0, storage_path=str(tmp_path / "data"))
    server.start()
    try:
        host, port = server.address[:2]
        url = f"mongodb://{host}:{port}/?directConnection=true"
        shipped = _stream_events(url, pipeline, writes)
        shipped_reads = len(lookups)
        shipped_project = changestreams.project
        exec(server_patches.LOOKUP, {})
        assert changestreams.project is not shipped_project  # (SecantusDB's internals are the ones expected)
        lookups.clear()
        patched = _stream_events(url, pipeline, writes)
    finally:
        server.stop()
    assert [e["operationType"] for e in shipped] == ["update", "delete"], shipped
    assert shipped[0]["fullDocument"]["who"] == "me" and shipped[0]["fullDocument"]["n"] == 30
    assert patched == shipped
    assert shipped_reads == 32 and len(lookups) == 2  # (the last update passes the first $match, is read)
