"""``celery -A app mongolock ...``: its commands on real data. Most run in this process (``run``: click's
runner, an app of the test's settings); ``real_run`` runs one as a user does, a subprocess through Celery's
umbrella command (the table and JSON list, unreachable MongoDB, passwords, no app given)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
from pymongo import MongoClient, monitoring

from celery_mongolock import ConfigurationError, LeaseStore
from celery_mongolock.core.store_spill import DEFAULT_WINDOW

from .servers import wait_for
from .workers import ROOT


def run(mongo_url: str, db: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``celery -A tests.integration_app mongolock *args`` against ``db``, in this process: click's runner,
    the command given an app of the same settings. When ``env`` sets the app's environment (a broker, a
    timeout), a subprocess through Celery's umbrella command (``real_run``). A subprocess
    costs a Python start, Celery's import and a MongoDB connection, about 2 CPU seconds: 64 of them were
    115 CPU-s of the suite."""
    if env:
        return real_run(mongo_url, db, *args, **env)
    from celery import Celery
    from click.testing import CliRunner

    from celery_mongolock.ops.cli import mongolock

    app = Celery("cli_test", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        mongolock_url=mongo_url,
        mongolock_database=db,
        mongolock_parked_window=2,  # (as tests.integration_app)
    )
    try:
        result = CliRunner().invoke(mongolock, list(args), obj=SimpleNamespace(app=app))
    finally:
        store = getattr(app, "_mongolock_store", None)
        if store is not None:
            store.close()
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


def real_run(mongo_url: str, db: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.integration_app", "mongolock", *args],
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "MONGOLOCK_IT_MONGODB_URL": mongo_url,
            "MONGOLOCK_IT_DB": db,
            **env,
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def leases(mongo_url: str, db_name: str) -> Any:
    store = LeaseStore(mongo_url, database=db_name)
    # (600 s: no heartbeat renews them, and a test's CLI processes take minutes on a busy machine)
    a = store.acquire("email-group:1", ttl=600, info={"task_name": "upload", "task_id": "t-1"})
    b = store.acquire("email-group:2", ttl=600)
    c = store.acquire("tenant:9", ttl=60)
    assert a and b and c
    c.release()
    yield store
    store.client.drop_database(db_name)
    store.close()


def test_list_table_and_json(mongo_url: str, db_name: str, leases: LeaseStore) -> None:
    out = real_run(mongo_url, db_name, "list")  # (the real command, as a user runs it)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["KEY", "HOLDER", "FENCE", "EXPIRES", "IN", "PARKED"]
    assert any(line.startswith("email-group:1") and "upload[t-1]" in line for line in lines)
    assert not any(line.startswith("tenant:9") for line in lines)  # released
    data = json.loads(real_run(mongo_url, db_name, "list", "--json", "--prefix", "email-group:").stdout)
    assert [d["key"] for d in data] == ["email-group:1", "email-group:2"]
    assert data[0]["holder"]["task_id"] == "t-1" and data[0]["fence"] > 0 and 0 < data[0]["expires_in"] <= 600
    everything = json.loads(run(mongo_url, db_name, "list", "--json", "--all").stdout)
    assert "tenant:9" in [d["key"] for d in everything]


def test_list_and_inspect_show_the_parked_runs(mongo_url: str, db_name: str, leases: LeaseStore) -> None:
    for stamp, task_id in ((2, "second"), (1, "first")):
        entry = {"id": f"{task_id}/0.0", "t": task_id, "n": "upload", "r": "0.0", "s": stamp, "m": b""}
        _, doc = leases.admit("email-group:1", entry, timeout=600)
        assert doc["lo"] == "parked"
    lines = run(mongo_url, db_name, "list").stdout.splitlines()
    assert any(line.startswith("email-group:1") and line.endswith(" 2") for line in lines), lines
    out = run(mongo_url, db_name, "inspect", "email-group:1")
    assert out.returncode == 0, out.stderr
    parked = [line.split() for line in out.stdout.splitlines() if line.startswith("  ")]
    assert [p[:2] for p in parked] == [["1.", "upload[first]"], ["2.", "upload[second]"]]
    assert all("deadline" in line for line in out.stdout.splitlines() if line.startswith("  "))
    data = json.loads(run(mongo_url, db_name, "inspect", "email-group:1", "--json").stdout)
    assert [p["task_id"] for p in data["parked"]] == ["first", "second"]
    assert data["parked"][0]["parked_for"] >= 0 and data["handoff"] is None


def test_list_and_inspect_show_the_slots_of_a_limited_key(
    mongo_url: str, db_name: str, leases: LeaseStore
) -> None:
    """Issue 27: as clear as a single key: no raw dict, no "?", no "-" for what a slot has, a list row
    that fits the table's 120 columns."""
    task_ids = [f"{n}f3c1e2a-9b7d-4c6e-8a5f-0123456789ab" for n in range(2)]
    for task_id in task_ids:
        info = {"task_name": "proj.tasks.sync_tenant", "task_id": task_id, "worker": "celery@web-3"}
        assert leases.acquire("tenant:5", ttl=600, limit=3, info=info)
    lines = run(mongo_url, db_name, "list").stdout.splitlines()
    (row,) = [line for line in lines if line.startswith("tenant:5")]
    assert "2/3 slots: proj.tasks.sync_tenant x2" in row and row.split()[-2].endswith("s"), row
    assert max(len(line) for line in lines) <= 120, lines
    out = run(mongo_url, db_name, "inspect", "tenant:5").stdout
    assert "state        2 of 3 slots held" in out and "limit        3" in out, out
    for n, task_id in enumerate(task_ids):
        assert f"slot {n}: proj.tasks.sync_tenant[{task_id}] on celery@web-3 (" in out, out
    assert "{'" not in out and "owner" not in out, out
    why = run(mongo_url, db_name, "why", "tenant:5").stdout
    assert "slots       2 of 3 held" in why and "?" not in why, why
    assert f"slot 1: proj.tasks.sync_tenant[{task_ids[1]}] on celery@web-3 pid " in why, why
    data = json.loads(run(mongo_url, db_name, "inspect", "tenant:5", "--json").stdout)
    assert data["limit"] == 3 and [s["slot"] for s in data["slots"]] == [0, 1]


def test_inspect_and_why_name_the_keys_of_a_several_keys_run(
    mongo_url: str, db_name: str, leases: LeaseStore
) -> None:
    keys = ["email-group:7", "email-group:8"]
    info = {"task_name": "proj.merge.merge_groups", "task_id": "m-1", "worker": "celery@web-2", "keys": keys}
    held = [leases.acquire(key, ttl=600, info=info) for key in keys]
    assert all(held)
    out = run(mongo_url, db_name, "inspect", "email-group:8").stdout
    assert (
        "holder       proj.merge.merge_groups[m-1] on celery@web-2 (" in out
        and "with keys email-group:7, email-group:8" in out
    ), out
    assert "{'" not in out, out
    why = run(mongo_url, db_name, "why", "email-group:7").stdout
    assert "with keys email-group:7, email-group:8" in why and "?" not in why, why


def test_inspect(mongo_url: str, db_name: str, leases: LeaseStore) -> None:
    out = run(mongo_url, db_name, "inspect", "email-group:1")
    assert out.returncode == 0, out.stderr
    assert "held" in out.stdout and "t-1" in out.stdout
    data = json.loads(run(mongo_url, db_name, "inspect", "email-group:1", "--json").stdout)
    assert data["key"] == "email-group:1" and data["held"] is True
    missing = run(mongo_url, db_name, "inspect", "nope")
    assert missing.returncode != 0 and "no lease 'nope'" in missing.stderr


def test_inspect_names_a_free_keys_holder_its_last_holder(
    mongo_url: str, db_name: str, leases: LeaseStore
) -> None:
    """A released key: ``holder -`` and ``last_holder ...``, as ``why`` says ``holder none`` and ``last
    holder`` (before: its last holder shown as its ``holder``)."""
    leases.acquire("email-group:3", ttl=60, info={"task_name": "upload", "task_id": "t-3"}).release()  # type: ignore[union-attr]
    out = run(mongo_url, db_name, "inspect", "email-group:3")
    assert out.returncode == 0, out.stderr
    rows = dict(line.split(None, 1) for line in out.stdout.splitlines() if " " in line.strip())
    assert rows["state"] == "free" and rows["holder"] == "-", out.stdout
    assert rows["last_holder"].startswith("upload[t-3] on "), out.stdout
    held = run(mongo_url, db_name, "inspect", "email-group:1").stdout
    assert re.search(r"^holder +upload\[t-1\] on ", held, re.M) and "last_holder" not in held, held


def test_release_needs_force(mongo_url: str, db_name: str, leases: LeaseStore) -> None:
    refused = run(mongo_url, db_name, "release", "email-group:1")
    assert refused.returncode != 0 and "--force" in refused.stderr
    info = leases.inspect("email-group:1")
    assert info is not None and info.held
    done = run(mongo_url, db_name, "release", "email-group:1", "--force")
    assert done.returncode == 0 and "released 'email-group:1'" in done.stdout
    info = leases.inspect("email-group:1")
    assert info is not None and not info.held
    again = run(mongo_url, db_name, "release", "email-group:1", "--force")
    assert again.returncode == 0
    # One message, once, on stdout (the store's own log record is not printed as well).
    assert again.stdout == "'email-group:1' is free: nobody holds it; nothing to release\n"
    assert again.stderr == ""


def test_release_says_who_holds_a_held_key_and_that_a_free_key_is_free(
    mongo_url: str, db_name: str, leases: LeaseStore
) -> None:
    refused = run(mongo_url, db_name, "release", "email-group:2")
    assert refused.returncode == 2
    assert "'email-group:2' is held by" in refused.stderr and "repeat with --force" in refused.stderr
    free = run(mongo_url, db_name, "release", "no-such-key")
    assert free.returncode == 0 and free.stderr == ""
    assert free.stdout == "'no-such-key' is free: nobody holds it; nothing to release\n"
    forced = run(mongo_url, db_name, "release", "no-such-key", "--force")
    assert forced.returncode == 0 and forced.stderr == "" and forced.stdout == free.stdout


def test_a_key_handed_to_a_parked_run_shows_it_not_yet_claimed(
    mongo_url: str, db_name: str, leases: LeaseStore
) -> None:
    """A release hands the key to the run parked on it; until a worker claims it there is no host and no
    pid to show (a new-user trial saw ``list`` and ``watch`` show the task alone, as if held)."""
    holder = leases.acquire("email-group:5", ttl=600)
    assert holder is not None
    entry = {"id": "next/0.0", "t": "next", "n": "upload", "r": "0.0", "s": 1, "m": b""}
    assert leases.admit("email-group:5", entry, timeout=600)[1]["lo"] == "parked"
    assert holder.release()
    lines = run(mongo_url, db_name, "list").stdout.splitlines()
    line = next(x for x in lines if x.startswith("email-group:5"))
    assert "upload[next] (handed, not yet claimed)" in line
    watched = run(mongo_url, db_name, "watch", "--count", "1", "--interval", "0.1").stdout
    assert "(handed, not yet claimed)" in watched


def test_watch_refreshes(mongo_url: str, db_name: str, leases: LeaseStore) -> None:
    out = run(mongo_url, db_name, "watch", "--count", "2", "--interval", "0.1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("held on") == 2 and "email-group:2" in out.stdout


def test_passwords_never_printed(db_name: str) -> None:
    url = "mongodb://alice:s3cretPW@127.0.0.1:1/?serverSelectionTimeoutMS=300"
    out = run(url, db_name, "list", MONGOLOCK_IT_OP_TIMEOUT="0.5")
    assert out.returncode != 0
    assert "s3cretPW" not in out.stdout + out.stderr
    assert "MongoDB did not answer" in out.stderr
    watch = run(url, db_name, "watch", "--count", "1", MONGOLOCK_IT_OP_TIMEOUT="0.5")
    assert "s3cretPW" not in watch.stdout + watch.stderr


def test_history_and_why_on_real_data(mongo_url: str, db_name: str) -> None:
    store = LeaseStore(mongo_url, database=db_name, lease_seconds=600)  # (held across CLI processes)
    try:
        first = store.acquire(
            "email-group:7", info={"task_name": "upload", "task_id": "t-1", "worker": "w1@h1"}
        )
        assert first is not None and first.release()
        second = store.acquire(
            "email-group:7", info={"task_name": "upload", "task_id": "t-2", "worker": "w1@h1"}
        )
        assert second is not None
        assert store.flush_history()

        out = run(mongo_url, db_name, "why", "email-group:7")
        assert out.returncode == 0, out.stderr
        verdict, blank, *details = out.stdout.splitlines()
        assert verdict.startswith("email-group:7: held by w1@h1 pid ")
        assert "(task upload[t-2]) since " in verdict and "on the server's clock" in verdict and blank == ""
        assert any(
            line.startswith("last ends") and "released" in line and "upload[t-1]" in line for line in details
        )
        data = json.loads(run(mongo_url, db_name, "why", "email-group:7", "--json").stdout)
        assert data["state"] == "held" and data["fence"] == second.fence and 0 < data["expires_in"] <= 600

        forced = run(mongo_url, db_name, "release", "email-group:7", "--force")
        assert forced.returncode == 0, forced.stderr
        out = run(mongo_url, db_name, "history", "email-group:7")
        assert out.returncode == 0, out.stderr
        header, newest, oldest = out.stdout.splitlines()
        assert header.split()[:4] == ["FENCE", "HOW", "TASK", "WHERE"]
        assert newest.split()[:3] == [str(second.fence), "forced", "upload[t-2]"]
        assert oldest.split()[:3] == [str(first.fence), "released", "upload[t-1]"]
        records = json.loads(
            run(mongo_url, db_name, "history", "email-group:7", "--json", "--limit", "1").stdout
        )
        assert [(r["fence"], r["how"], r["task_id"]) for r in records] == [(second.fence, "forced", "t-2")]
        # The CLI process wrote the forced ending into the history collection itself before exiting.
        assert store.history_collection.count_documents({"k": "email-group:7", "how": "forced"}) == 1
        out = run(mongo_url, db_name, "why", "email-group:7")
        assert out.stdout.startswith("email-group:7: free (force-released ")

        # An earlier run of the key that ended with its release: the key remembers it (``seen``), so its
        # document is kept 2 hours, not removed by the TTL monitor once the next lease expires (on a busy
        # machine that came before the CLI process had started, and ``why`` found no document).
        earlier = store.acquire(
            "tenant:3", ttl=30, info={"task_name": "sync", "task_id": "t-0", "run": "t-0.0"}
        )
        assert earlier is not None and earlier.release()
        expired = store.acquire("tenant:3", ttl=1, info={"task_name": "sync", "task_id": "t-3"})
        assert expired is not None

        def past_expiry() -> bool:
            info = store.inspect("tenant:3")
            return info is not None and info.expires_in is not None and info.expires_in < 0

        wait_for(past_expiry, timeout=10, message="the lease to expire on the server")
        out = run(mongo_url, db_name, "why", "tenant:3")
        assert out.returncode == 0 and " not yet taken over: " in out.stdout.splitlines()[0]

        missing = run(mongo_url, db_name, "why", "nope")
        assert missing.returncode == 1 and "no lease 'nope'" in missing.stderr and missing.stdout == ""
        assert run(mongo_url, db_name, "why", "nope", "--json").stdout == "null\n"
        empty = run(mongo_url, db_name, "history", "nope")
        assert empty.returncode == 0 and empty.stdout == "no endings recorded for 'nope'\n"
        bad = run(mongo_url, db_name, "history", "email-group:7", "--limit", "0")
        assert bad.returncode == 2
        # A key that is no key is bad input, as a bad option is (a trial, stop 65: it exited 1).
        for command, key, says in (
            ("why", "", "must not be empty"), ("queue", "  ", "must not be only whitespace"),
            ("inspect", "", "must not be empty"), ("history", " ", "must not be only whitespace"),
        ):  # fmt: skip
            refused = run(mongo_url, db_name, command, key)
            assert refused.returncode == 2 and f"lease key {says}" in refused.stderr, (command, refused)
    finally:
        store.client.drop_database(db_name)
        store.close()


def test_why_shows_the_pending_unique_sends_of_a_key(mongo_url: str, db_name: str) -> None:
    from celery_mongolock.core.documents.sends import send_digest
    from celery_mongolock.core.store_sends import sends_of

    store = LeaseStore(mongo_url, database=db_name, lease_seconds=600)
    try:
        records = sends_of(store)
        digest = send_digest("proj.upload", ["email-group:7"], {"group_id": 7})
        assert records.claim(digest, "t-9", "proj.upload", ["email-group:7"], 3_600_000) == "t-9"
        out = run(mongo_url, db_name, "why", "email-group:7")  # no lease yet: the send waits in the broker
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("email-group:7: free; not taken yet, with sends pending")
        [row] = [line for line in out.stdout.splitlines() if "proj.upload[t-9]" in line]
        assert " sent " in row and "window ends in 3" in row and "at the latest" in row  # (of 3600 s)
        assert "sends       1 unique send(s) pending (an equal send gets the run instead):" in out.stdout
        data = json.loads(run(mongo_url, db_name, "why", "email-group:7", "--json").stdout)
        assert [s["task_id"] for s in data["unique_sends"]] == ["t-9"]
        lease = store.acquire("email-group:7", info={"task_name": "proj.other", "task_id": "t-1"})
        assert lease is not None
        out = run(mongo_url, db_name, "why", "email-group:7")
        assert out.stdout.startswith("email-group:7: held by ") and "proj.upload[t-9]" in out.stdout
        assert records.forget("t-9")
        out = run(mongo_url, db_name, "why", "email-group:7")
        assert "sends       no unique send pending" in out.stdout
    finally:
        store.client.drop_database(db_name)
        store.close()


def _park(store: LeaseStore, key: str, *runs: str) -> None:
    for stamp, task_id in enumerate(runs, 1):
        entry = {"id": f"{task_id}/0.0", "t": task_id, "n": "upload", "r": "0.0", "s": stamp, "m": b""}
        assert store.admit(key, entry, timeout=600)[1]["lo"] == "parked"


def test_queue_lists_a_key_s_parked_runs_page_by_page(
    mongo_url: str, db_name: str, leases: LeaseStore
) -> None:
    _park(leases, "email-group:1", *[f"run-{i}" for i in range(5)])
    out = run(mongo_url, db_name, "queue", "email-group:1", "--per-page", "2", "--page", "2")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "email-group:1: 5 run(s) parked, page 2 of 3"
    assert [line.split()[:2] for line in lines[1:]] == [["3.", "upload[run-2]"], ["4.", "upload[run-3]"]]
    data = json.loads(run(mongo_url, db_name, "queue", "email-group:1", "--json", "--per-page", "2").stdout)
    assert data["parked"] == 5 and [r["task_id"] for r in data["runs"]] == ["run-0", "run-1"]
    assert data["pages"] == 3
    # Bad input in our words: a page below 1, or past the last (a new-user trial: --page 99999 exited 0).
    bad = run(mongo_url, db_name, "queue", "email-group:1", "--page", "0")
    assert bad.returncode == 2 and "--page" in bad.stderr
    for page, more in (("99999", []), ("4", ["--per-page", "2", "--json"]), (str(10**19), [])):
        past = run(mongo_url, db_name, "queue", "email-group:1", "--page", page, *more)
        assert past.returncode == 2 and not past.stdout, past
        assert f"no page {page} of the runs parked on 'email-group:1'" in past.stderr, past.stderr
    huge = run(mongo_url, db_name, "queue", "email-group:1", "--per-page", str(3 * 10**9))
    assert huge.returncode == 2 and "--per-page" in huge.stderr and "at most 1000000" in huge.stderr
    # A key without a lease document: an empty queue, not an error (as inspect/why --json print null).
    empty = run(mongo_url, db_name, "queue", "nope:1")
    assert empty.returncode == 0 and empty.stdout.startswith("nope:1: 0 run(s) parked"), empty
    empty_json = json.loads(run(mongo_url, db_name, "queue", "nope:1", "--json").stdout)
    assert empty_json == {"key": "nope:1", "parked": 0, "page": 1, "pages": 1, "runs": []}
    empty_past = run(mongo_url, db_name, "queue", "nope:1", "--page", "2")  # an empty queue has page 1 only
    assert (
        empty_past.returncode == 2
        and "no page 2 of the runs parked on 'nope:1': 0 run(s)" in empty_past.stderr
    )
    purged = run(mongo_url, db_name, "purge", "nope:1", "--yes")
    assert purged.returncode == 0 and "nothing to purge" in purged.stdout
    no_lease = run(mongo_url, db_name, "drop", "nope:1", "t-1", "--yes")
    assert no_lease.returncode == 2 and "no lease 'nope:1'" in no_lease.stderr  # (as an id not parked)


def test_drop_and_purge_ask_first_then_revoke_the_runs(
    mongo_url: str, db_name: str, leases: LeaseStore, redis_server: Any
) -> None:
    from celery import Celery

    key = "email-group:1"
    _park(leases, key, "keep", "gone", "also-gone")
    env = {"MONGOLOCK_IT_BROKER": redis_server.url, "MONGOLOCK_IT_BACKEND": redis_server.url}
    # Without --yes and with "n" (or no answer at all: no terminal), nothing is dropped.
    asked = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.integration_app", "mongolock", "drop", key, "gone"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "MONGOLOCK_IT_MONGODB_URL": mongo_url,
                       "MONGOLOCK_IT_DB": db_name, **env},
        input="n\n", capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert asked.returncode == 1 and "drop 1 run(s) parked on 'email-group:1'?" in asked.stdout
    assert "nothing dropped" in asked.stderr
    unknown = run(mongo_url, db_name, "drop", key, "nobody", "--yes", **env)
    assert unknown.returncode == 2 and "not parked on 'email-group:1': nobody" in unknown.stderr
    # An unknown id is refused before the question; no answer at all (the end of the input) drops nothing.
    unknown = run(mongo_url, db_name, "drop", key, "nobody", **env)  # (stdin: none, run() gives no input)
    assert unknown.returncode == 2 and "not parked on 'email-group:1': nobody" in unknown.stderr
    assert "drop 1 run(s)" not in unknown.stdout
    unanswered = run(mongo_url, db_name, "drop", key, "gone", **env)
    assert (
        unanswered.returncode == 1
        and "nothing dropped: no answer (pass --yes in scripts)" in unanswered.stderr
    )
    assert "Aborted" not in unanswered.stderr + unanswered.stdout
    out = run(mongo_url, db_name, "drop", key, "gone", "--yes", **env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "dropped upload[gone] from 'email-group:1': REVOKED"
    info = leases.inspect(key)
    assert info is not None and [r["task_id"] for r in info.parked] == ["keep", "also-gone"]
    results = Celery(backend=redis_server.url)
    assert results.AsyncResult("gone").state == "REVOKED"
    endings = [e for e in leases.history(key, limit=20) if e.task_id == "gone"]
    assert [e.how for e in endings] == ["revoked"]
    out = run(mongo_url, db_name, "purge", key, "--yes", **env)
    assert out.returncode == 0 and out.stdout.count("REVOKED") == 2
    info = leases.inspect(key)
    assert info is not None and info.parked == [] and info.held  # the holder runs on
    assert "no run parked" in run(mongo_url, db_name, "purge", key, "--yes", **env).stdout


def test_a_deep_queue_is_shown_by_its_depth_and_a_page_without_reading_it_all(
    mongo_url: str, db_name: str, leases: LeaseStore
) -> None:
    """``inspect``, ``why``, ``list``/``watch`` and ``queue --page`` read a deep queue's depth and one page of
    it: the server cuts the rest out (the reply carries the page, or the key's window of parked runs and
    the page's spilled runs), whatever the depth."""
    key, depth = "ledger:9", 120
    assert leases.acquire(key, 600) is not None  # (held: every run parks)
    _park(leases, key, *[f"run-{i}" for i in range(depth)])
    replies: list[dict[str, Any]] = []
    spilled: list[int] = []

    class Replies(monitoring.CommandListener):
        """The documents of every aggregate's reply: what the server sent back."""

        def started(self, event: monitoring.CommandStartedEvent) -> None:
            pass

        def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
            if event.command_name == "aggregate":
                replies.extend(event.reply["cursor"]["firstBatch"])
            if event.command_name == "find":  # (the runs spilled beyond the window: read by ``_id``)
                spilled.append(len(event.reply["cursor"]["firstBatch"]))

        def failed(self, event: monitoring.CommandFailedEvent) -> None:
            pass

    client: MongoClient[dict[str, Any]] = MongoClient(mongo_url, event_listeners=[Replies()], tz_aware=True)
    store = LeaseStore(client, database=db_name)
    try:
        page = store.inspect(key, parked_from=40, parked_limit=10)
        assert page is not None and page.parked_total == depth
        assert [(r["position"], r["task_id"]) for r in page.parked] == [
            (41 + i, f"run-{40 + i}") for i in range(10)
        ]
        # The lease document keeps a window of 32 runs, read whole; the rest are spilled, and only the
        # page's are read (documents.spill).
        assert len(replies[-1]["q"]) == DEFAULT_WINDOW and spilled[-1] == 10
        head = store.why(key, parked_limit=5)
        assert head is not None and head.parked_total == depth and len(head.parked) == 5
        assert len(replies[-1]["q"]) == 5
        assert f"{depth} runs parked; next: upload[run-0]" in head.verdict
        listed = [i for i in store.list("ledger:", parked_limit=1) if i.key == key]
        assert listed[0].parked_total == depth and len(replies[-1]["q"]) == 1
        full = store.inspect(key)
        # (no limit: all of them, as before)
        assert full is not None and len(full.parked) == full.parked_total == depth
    finally:
        store.close()
        client.close()
    out = run(mongo_url, db_name, "queue", key, "--per-page", "10", "--page", "12")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"{key}: {depth} run(s) parked, page 12 of 12"
    assert [line.split()[:2] for line in lines[1:3]] == [
        ["111.", "upload[run-110]"],
        ["112.", "upload[run-111]"],
    ]
    shown = run(mongo_url, db_name, "inspect", key).stdout
    assert re.search(rf"^parked\s+{depth}$", shown, re.MULTILINE), shown
    assert f"... and {depth - 50} more: celery mongolock queue {key}" in shown
    why = run(mongo_url, db_name, "why", key).stdout
    assert f"{depth}, in queue order (the first 20 shown):" in why
    # Bad input in our words.
    with pytest.raises(ConfigurationError, match="parked_limit must be a positive int"):
        leases.inspect(key, parked_limit=0)
    with pytest.raises(ConfigurationError, match="parked_from must be an int >= 0"):
        leases.inspect(key, parked_from=-1, parked_limit=5)


def test_inspect_and_why_say_a_handed_key_is_not_yet_claimed(
    mongo_url: str, db_name: str, leases: LeaseStore
) -> None:
    """A key handed to a parked run whose worker has not claimed it yet: no "on ?" for its holder."""
    holder = leases.acquire("ledger:3", ttl=600)
    assert holder is not None
    entry = {"id": "next/0", "t": "next", "n": "proj.post", "r": "0", "s": 1, "m": b""}
    assert leases.admit("ledger:3", entry, timeout=600)[1]["lo"] == "parked"
    holder.release()  # handed to "next"
    out = run(mongo_url, db_name, "inspect", "ledger:3").stdout
    assert "proj.post[next], handed the key, not yet claimed by a worker" in out and " on ?" not in out, out
    why = run(mongo_url, db_name, "why", "ledger:3").stdout
    assert "proj.post[next] on no worker yet (handed the key, not yet claimed)" in why, why
    assert " on ?" not in why, why


def test_why_shows_the_runs_spilled_beyond_a_short_window(
    mongo_url: str, db_name: str, make_store: Any
) -> None:
    """``why`` shows the first runs in queue order (up to its 20), the spilled ones after the window's
    (before: only the window's, "the first 2 shown" of 7, with the window set to 2)."""
    store = make_store(parked_window=2)
    assert store.acquire("ledger:4", 600) is not None
    _park(store, "ledger:4", *[f"run-{i}" for i in range(7)])
    story = store.why("ledger:4", parked_limit=20)
    assert story is not None and story.parked_total == 7
    assert [r.task_id for r in story.parked] == [f"run-{i}" for i in range(7)]
    out = run(mongo_url, db_name, "why", "ledger:4").stdout
    assert "parked      7, in queue order:" in out and "shown" not in out, out


def test_without_an_app_an_unreachable_mongodb_is_told_in_a_line_with_a_hint(tmp_path: Any) -> None:
    """``celery mongolock list`` with no ``-A`` (the default URL, where nothing listens here): one line in
    our words, without the driver's topology dump, saying the default URL was tried."""
    import socket

    with socket.socket() as probe:
        if probe.connect_ex(("localhost", 27017)) == 0:
            pytest.skip("something listens on localhost:27017, the default URL this test needs unanswered")
    out = subprocess.run(
        [sys.executable, "-m", "celery", "mongolock", "list"],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if not k.startswith("CELERY")},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 1, out
    assert "MongoDB did not answer while trying to list leases" in out.stderr, out.stderr
    assert "no app was given, so the default mongolock_url was tried" in out.stderr, out.stderr
    assert "Topology Description" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_why_shows_spilled_runs_of_a_higher_priority_before_the_window_s_of_a_lower_one(
    make_store: Any,
) -> None:
    """Queue order is by priority first: a run of priority rank 0 spilled beyond its window goes before the
    window's runs of rank 3, and ``why`` shows it there even when the window alone fills its page."""
    store = make_store(parked_window=2)
    assert store.acquire("ledger:5", 600) is not None
    for stamp, (task_id, rank) in enumerate([("low-1", 3), ("low-2", 3), ("a", 0), ("b", 0), ("c", 0)], 1):
        entry = {"id": f"{task_id}/0", "t": task_id, "n": "post", "r": "0", "s": stamp, "m": b"", "pr": rank}
        assert store.admit("ledger:5", entry, timeout=600)[1]["lo"] == "parked"
    story = store.why("ledger:5", parked_limit=3)
    assert story is not None and story.parked_total == 5
    assert [r.task_id for r in story.parked] == ["a", "b", "c"]  # ("c" is spilled, rank 0)


def test_a_deep_queue_is_dropped_in_rounds_each_said_as_it_is_done(leases: LeaseStore) -> None:
    """``purge`` of a deep queue (a new-user trial, stop 65: one command over 10,000 task ids ran past the
    operation timeout and dropped nothing): ``drop_runs`` takes the runs out ``batch`` at a time, each
    round's lines yielded once its runs are out, spilled runs and the key's window alike."""
    from celery import Celery

    from celery_mongolock.ops import cli_queue

    key, depth = "ledger:deep-purge", 120
    assert leases.acquire(key, 600) is not None
    _park(leases, key, *[f"run-{i}" for i in range(depth)])
    info = leases.inspect(key)
    assert info is not None and len(info.parked) == depth
    ids = [str(r["task_id"]) for r in info.parked]
    app = Celery("purge", broker="memory://", set_as_current=False)
    # The spilled runs first (the window stays full: no refill passes their numbers), then the rest.
    spilled = [len(lines) for lines in cli_queue.drop_runs(app, leases, info, ids[DEFAULT_WINDOW:], batch=50)]
    assert spilled == [50, 38]
    # A page counts them out too (``queue --page``: it said 2,288 after a trial's purge of 10,000).
    page = leases.inspect(key, parked_from=0, parked_limit=5)
    assert page is not None and page.parked_total == DEFAULT_WINDOW and len(page.parked) == 5
    info = leases.inspect(key)
    assert info is not None and info.parked_total == DEFAULT_WINDOW
    rounds = [len(lines) for lines in cli_queue.drop_runs(app, leases, info, ids[:DEFAULT_WINDOW], batch=50)]
    assert rounds == [DEFAULT_WINDOW]
    after = leases.inspect(key)
    assert after is not None and after.parked_total == 0 and after.parked == [] and after.held
    page = leases.inspect(key, parked_from=0, parked_limit=5)
    assert page is not None and page.parked_total == 0 and page.parked == []
    spilled = leases.spill.collection.count_documents({"k": key, "x": {"$ne": True}})
    assert spilled == 0  # (each spilled run a tombstone: the refills skip it)
    revoked = {e.task_id for e in leases.history(key, limit=depth + 10) if e.how == "revoked"}
    assert revoked == set(ids)
