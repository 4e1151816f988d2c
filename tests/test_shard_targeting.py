"""Shard-ready (issue 28 item 7): every command of a park, a handoff and a claim names one key by ``_id``
equality, so that with the lease collection sharded on ``{_id: "hashed"}`` mongos sends each to one
shard (docs/scaling.md). The test bed has no sharded cluster: the commands are recorded with pymongo's
command monitoring and their filters checked ("on paper"), and the embedded server's ``explain`` shows
the equality on ``_id`` that mongos routes by, for the commands it explains (findAndModify, aggregate;
its explain of ``update`` parses no query, so those are checked on paper only).

The few scatters are by design and documented there: the heartbeat's renewal (one command per process
per interval, not per run) and the sweeper's scan of the keys with work pending."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pymongo import MongoClient

from celery_mongolock import LeaseStore

from .conftest import CommandCounter
from .test_admission_store import Handoffs, entry

X, Y = "merge:x", "merge:y"
#: Commands on the lease collection that carry a filter, and where it is.
_FILTERED = ("findAndModify", "update", "delete", "aggregate", "find", "count")


def _filters(name: str, command: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    if name == "findAndModify":
        return [command.get("query") or {}]
    if name == "update":
        return [u.get("q") or {} for u in command.get("updates") or []]
    if name == "delete":
        return [d.get("q") or {} for d in command.get("deletes") or []]
    if name == "aggregate":
        first = (command.get("pipeline") or [{}])[0]
        return [first.get("$match") or {}]
    return [command.get("filter") or command.get("query") or {}]


def _lease_commands(counter: CommandCounter, store: LeaseStore) -> list[tuple[str, dict[str, Any]]]:
    collection = store.collection.name
    return [(n, c) for n, c in counter.commands if n in _FILTERED and c.get(n) == collection]


def _untargeted(commands: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The commands whose filter does not name one key by equality on ``_id``."""
    bad = []
    for name, command in commands:
        for f in _filters(name, command):
            if not isinstance(f.get("_id"), str):
                bad.append(f"{name} {dict(f)}")
    return bad


def _explained_keys(client: MongoClient[dict[str, Any]], db: str, name: str, command: dict[str, Any]) -> Any:
    """The ``_id`` equality the server parsed from ``command`` (its explain), or None."""
    # (without the session, retry and write concern fields: explain takes the command alone)
    dropped = ("lsid", "txnNumber", "writeConcern", "readConcern")
    body = {k: v for k, v in command.items() if not k.startswith("$") and k not in dropped}
    plan = client[db].command({"explain": body, "verbosity": "queryPlanner"})
    planner = plan.get("queryPlanner") or (plan.get("stages") or [{}])[0].get("$cursor", {}).get(
        "queryPlanner"
    )
    parsed = (planner or {}).get("parsedQuery") or {}
    # (one field: ``{_id: {$eq: k}}``; several: ``{$and: [{_id: {$eq: k}}, ...]}``)
    for clause in [parsed, *(parsed.get("$and") or [])]:
        if "_id" in clause:
            return clause["_id"]
    return None


def test_park_handoff_and_claim_each_target_one_key(
    store: LeaseStore, counter: CommandCounter, client: MongoClient[dict[str, Any]]
) -> None:
    handoffs = Handoffs(store)
    # One lease: a holder, three runs parked, the handoff at release, the claim, the next handoff.
    holder = store.acquire("one:1", 30)
    assert holder is not None
    for stamp in (1, 2, 3):
        assert store.admit("one:1", entry(stamp))[1]["lo"] == "parked"
    assert holder.release()
    claimed, doc = store.admit("one:1", entry(1), claim=handoffs.seen[-1][1]["tk"])
    assert claimed is not None and doc["lo"] == "claimed"
    assert claimed.release()
    # N slots: the same on a key with limit=2.
    slots = [store.acquire("slots:1", 30, limit=2) for _ in range(2)]
    for stamp in (1, 2):
        assert store.admit("slots:1", entry(stamp), limit=2)[1]["lo"] == "parked"
    for lease in slots:
        assert lease is not None and lease.release()
    for key, ho in handoffs.seen[-2:]:
        lease, doc = store.admit(key, entry(int(ho["s"])), claim=ho["tk"], limit=2)
        assert lease is not None and doc["lo"] == "claimed"
        assert lease.release()
    # Several keys: one command per key, each a key of its own.
    blocker = store.acquire(Y, 30)
    assert blocker is not None
    e = {**entry(10, "merge-10"), "ks": [X, Y], "tk": "tk-merge-10"}
    lease, doc = store.admit(X, e, ttl=30)
    assert lease is not None
    assert store.admit(Y, e, ttl=30)[1]["lo"] == "parked"
    assert store.reserve(lease, e)
    assert blocker.release()
    for key in (X, Y):
        got, doc = store.admit(key, e, ttl=30, claim=e["tk"])
        assert got is not None and doc["lo"] == "claimed", (key, doc.get("lo"))
        assert got.release()

    commands = _lease_commands(counter, store)
    kinds = {name for name, _ in commands}
    # (the cycle's commands: every admit, reservation, claim and release is one findAndModify by key)
    assert "findAndModify" in kinds and len(commands) >= 20, (kinds, len(commands))
    assert _untargeted(commands) == []
    # Where the embedded server explains a command, it parsed the key as an equality on _id: what mongos
    # routes by. (A read of several keys at once, ``{_id: {$in: [...]}}``, goes to their shards only.)
    explained = [
        (name, command)
        for name, command in commands
        if name in ("findAndModify", "aggregate") and isinstance(_filters(name, command)[0].get("_id"), str)
    ]
    assert explained
    for name, command in explained:
        key = _filters(name, command)[0]["_id"]
        assert _explained_keys(client, store.collection.database.name, name, command) == {"$eq": key}


def test_a_deep_queue_s_spill_commands_each_name_their_key(
    client: MongoClient[dict[str, Any]], counter: CommandCounter, db_name: str
) -> None:
    """The runs spilled beyond a key's window (``documents.spill``): every command on
    ``<collection>.parked`` (the run's insert, the refill's read, its tombstones, its delete, a copy's
    lookup) names its key by equality on ``k``, the shard key documented for that collection
    (``{k: 1}``); the lease collection's commands still name theirs on ``_id``."""
    store = LeaseStore(client, database=db_name, lease_seconds=30, parked_window=2)
    try:
        handoffs = Handoffs(store)
        holder = store.acquire("deep:1", 30)
        assert holder is not None
        for stamp in range(1, 8):
            assert store.admit("deep:1", entry(stamp))[1]["lo"] == "parked"
        assert store.admit("deep:1", entry(7))[1]["lo"] == "dup"  # a copy of a spilled run
        lease = holder
        for _ in range(7):
            assert lease.release()
            ho = handoffs.seen[-1][1]
            got, doc = store.admit("deep:1", {**entry(int(ho["s"]), ho["t"]), "tk": ho["tk"]}, claim=ho["tk"])
            assert got is not None and doc["lo"] == "claimed"
            lease = got
        assert lease.release()
        spill = store.spill.collection.name
        on_spill = [(n, c) for n, c in counter.commands if c.get(n) == spill and n in (*_FILTERED, "insert")]
        assert {n for n, _ in on_spill} >= {"insert", "find", "delete"}, {n for n, _ in on_spill}
        named: list[str] = []
        for name, command in on_spill:
            docs = command.get("documents") if name == "insert" else _filters(name, command)
            named += [str(d.get("k")) for d in docs or []]
        assert set(named) == {"deep:1"}, named
        assert _untargeted(_lease_commands(counter, store)) == []
    finally:
        store.close()
