"""A ``Replace`` task's set of two keys or more admits its set's gate first (``sets.gate_of``): a lease
document of the library's own, held with the set's keys. Its name, the keys a task may not use, what a
``LeaseSet`` shows of it, what a handoff checks of it, and the newer-send lookup of a pending send (no
worker here; the behaviour with real workers: tests/test_stepwise_replace.py, tests/test_replace_keys.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from celery import Celery
from kombu.serialization import dumps

from celery_mongolock import (
    ConfigurationError,
    InvalidKey,
    LeaseLost,
    LeaseSet,
    LeaseStore,
    Queue,
    Replace,
    Superseded,
    singleton_task,
)
from celery_mongolock.core.documents.sends import started_after
from celery_mongolock.core.documents.sets import GATE_PREFIX, gate_of, is_gate, set_signature, user_keys
from celery_mongolock.integration.trust import RefusedEntry, check_entry

from .servers import server_past, wait_for


def _app() -> Celery:
    return Celery(f"g{uuid.uuid4().hex[:6]}", set_as_current=False)


def test_a_set_has_one_gate_whatever_the_order_of_its_keys() -> None:
    gate = gate_of(["group:7", "tenant:1"])
    assert gate == gate_of(["tenant:1", "group:7", "tenant:1"])
    assert gate.startswith(GATE_PREFIX) and is_gate(gate)
    assert gate != gate_of(["group:8", "tenant:1"])
    assert gate[len(GATE_PREFIX) :] == set_signature(["group:7", "tenant:1"])[len("ks:") :]
    assert user_keys([gate, "group:7", "tenant:1"]) == ["group:7", "tenant:1"]
    assert not is_gate("group:7") and not is_gate(None)


@pytest.mark.parametrize(
    "options",
    [
        {"key": "{x}"},
        {"keys": ("a:{x}", "{x}")},
        {"key": lambda x: f"mongolock-set:{x}"},
    ],
    ids=["template", "keys", "callable"],
)
def test_a_task_key_that_names_a_gate_is_refused(options: dict[str, Any]) -> None:
    @singleton_task(app=_app(), on_contention=Replace(), **options)
    def job(x: str) -> None: ...

    with pytest.raises(InvalidKey, match=r"starts with 'mongolock-set:'.*gates of Replace"):
        job.mongolock_keys_for("mongolock-set:1")


@pytest.mark.parametrize(
    "options",
    [{"key": "mongolock-set:{x}"}, {"keys": ("a:{x}", "mongolock-set:{x}")}, {"key": "mongolock-set:all"}],
    ids=["template", "keys", "fixed"],
)
def test_a_task_key_in_the_gates_names_is_refused_when_the_task_is_declared(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match=r"starts with 'mongolock-set:'.*gates of Replace"):

        @singleton_task(app=_app(), on_contention=Replace(), **options)
        def job(x: str) -> None: ...


def test_a_lease_set_names_the_task_s_keys_not_its_gate(store: LeaseStore) -> None:
    keys = sorted([f"a:{uuid.uuid4().hex}", f"b:{uuid.uuid4().hex}"])
    gate = gate_of(keys)
    leases = [store.try_acquire(key, 30)[0] for key in [gate, *keys]]  # (a gate: not by ``acquire``)
    assert all(lease is not None for lease in leases)
    held = LeaseSet([lease for lease in leases if lease is not None])
    try:
        assert held.keys == keys
        assert set(held.fences) == set(keys)
        assert held.key == "+".join(keys)
        assert held.fence == max(held[key].fence for key in keys)
        assert held[gate].key == gate  # (reachable by its name, renewed and released with the others)
        assert len(held) == 2 and [lease.key for lease in held] == keys  # (its keys; ``leases`` has the gate)
        assert list(held.leases) == [gate, *keys]
        assert GATE_PREFIX not in repr(held) and all(key in repr(held) for key in keys)
        assert store.collection.find_one({"_id": gate}, {"owner": 1})["owner"] == held[gate].owner  # type: ignore[index]
        story = store.why(gate)
        assert story is not None and story.verdict.startswith("the gate of a Replace task's set of keys")
        assert "held by" in story.verdict
    finally:
        held.release()
    assert all(lease.released for lease in held)


def test_a_lease_set_that_lost_or_was_superseded_on_its_gate_names_its_first_key(store: LeaseStore) -> None:
    """``current_lease().raise_if_superseded()`` / ``raise_if_lost()`` of a set whose gate was marked (a
    newer send marks the holder of the gate first): the error names the task's first key, with its fence,
    never the gate (it becomes the task's ``Superseded`` failure under ``fail_superseded=True``)."""
    keys = sorted([f"upload:{uuid.uuid4().hex}", f"user:{uuid.uuid4().hex}"])
    gate = gate_of(keys)
    taken = [store.try_acquire(key, 30)[0] for key in [gate, *keys]]
    held = LeaseSet([lease for lease in taken if lease is not None])
    try:
        assert held[gate].mark_superseded("newer-send")
        with pytest.raises(Superseded) as superseded:
            held.raise_if_superseded()
        assert superseded.value.key == keys[0] and superseded.value.fence == held[keys[0]].fence
        assert held[gate].mark_lost("a test says so", release=False)
        with pytest.raises(LeaseLost) as lost:
            held.raise_if_lost()
        assert lost.value.key == keys[0] and "its set's gate" in str(lost.value)
        assert held.lost_reason is not None and held.lost_reason.startswith(repr(keys[0]))
    finally:
        held.release()


def _merge_app() -> Celery:
    app = _app()

    @singleton_task(
        keys=("g:{src}", "g:{dst}"), app=app, name="gate.merge", on_contention=Replace(), shared=False
    )
    def merge(src: str, dst: str) -> None: ...

    @singleton_task(
        keys=("g:{src}", "g:{dst}"), app=app, name="gate.queued", on_contention=Queue(), shared=False
    )
    def queued(src: str, dst: str) -> None: ...

    return app


def _entry(app: Celery, name: str, *args: Any, ks: list[str]) -> dict[str, Any]:
    signature = app.signature(name, args=args, task_id="t-1")
    content_type, encoding, body = dumps(dict(signature), serializer="json")  # type: ignore[no-untyped-call]
    return {
        "id": "t-1/0",
        "t": "t-1",
        "n": name,
        "m": body.encode(encoding) if isinstance(body, str) else body,
        "ct": content_type,
        "ce": encoding,
        "ks": ks,
    }


def test_a_handoff_checks_the_gate_its_entry_was_parked_under() -> None:
    app = _merge_app()
    keys = ["g:a", "g:b"]
    entry = _entry(app, "gate.merge", "a", "b", ks=[gate_of(keys), *keys])
    for key in [gate_of(keys), *keys]:  # (handed on its gate or on any of its keys)
        assert check_entry(app, key, entry, None).task == "gate.merge"
    other = _entry(app, "gate.merge", "a", "b", ks=[gate_of(["g:a", "g:c"]), *keys])
    with pytest.raises(RefusedEntry, match="not those of the gate"):
        check_entry(app, keys[0], other, None)
    # (a run parked by the version before the gates: its keys alone)
    assert check_entry(app, "g:a", _entry(app, "gate.merge", "a", "b", ks=keys), None).task == "gate.merge"


def test_a_pending_send_of_a_set_is_overtaken_by_a_newer_send_that_got_its_gate() -> None:
    query = started_after(["g:b", "g:a"], 5)
    assert sorted(query["_id"]["$in"]) == sorted(["g:a", "g:b", gate_of(["g:a", "g:b"])])
    assert started_after(["g:a"], 5)["_id"]["$in"] == ["g:a"]  # (one key: no gate)


def _set_run(stamp: int, keys: list[str], tid: str) -> dict[str, Any]:
    """A run's entry on its set's gate, as ``QueuedRun`` makes it (its set's signature ``g``)."""
    return {
        "id": f"{tid}/0", "t": tid, "n": "merge", "r": "0", "s": stamp, "m": b"msg",
        "ks": sorted(keys), "g": set_signature(keys), "tk": f"tk-{tid}",
    }  # fmt: skip


def test_an_older_send_back_on_its_gate_while_a_newer_send_is_handed_it_is_superseded(
    store: LeaseStore,
) -> None:
    """The lock-set checker's ``replace-order`` (RabbitMQ, seed 1, CI of stop 49): a capped burst
    (``Replace(debounce, max_wait)``) on a set whose keys all have slots, so its gate has slots too. The
    older send A, handed a slot by its burst's ceiling (which seals that burst: the newer send B began
    one of its own), lost it when its lease lapsed, and the sweeper handed it to B. A's next admit came
    before B claimed it: nothing that *got* the gate was newer, B's handoff was of another burst, and A
    parked again, to be handed a slot, and its keys, after B. A newer send handed the gate counts as one
    that got it, whatever its burst: A is superseded by B, and B claims its slot."""
    keys = sorted([f"a:{uuid.uuid4().hex}", f"b:{uuid.uuid4().hex}"])
    gate = gate_of(keys)
    older, newer = _set_run(1, keys, "older"), _set_run(2, keys, "newer")

    def admit(
        entry: dict[str, Any], ttl: float, due: bool = False, claim: str | None = None
    ) -> tuple[Any, Any]:
        info = {"task_id": entry["t"], "delivery": entry["r"], "keys": entry["ks"]}
        return store.admit(
            gate, entry, ttl=ttl, claim=claim, replace=True, group=entry["g"], info=info,
            debounce=5.0, max_wait=0.3, limit=2, due=due,
        )  # fmt: skip

    def due_admit(entry: dict[str, Any], ttl: float) -> tuple[Any, Any]:
        deadline = time.monotonic() + 30
        while True:  # its delayed copy, again until its ceiling passed on the server's clock
            lease, doc = admit(entry, ttl, due=True)
            if doc["lo"] != "dup" or time.monotonic() > deadline:
                return lease, doc
            time.sleep(0.05)

    _, doc = admit(older, ttl=1.0)
    assert doc["lo"] == "parked"
    older["bu"] = next(e["bu"] for e in doc["q"] if e["t"] == "older")  # its burst (``KeySetAdmits.admit``)
    held, doc = due_admit(older, ttl=1.0)
    assert held is not None and doc["lo"] == "due"  # by its ceiling: that burst is sealed
    _, doc = admit(newer, ttl=30)
    assert doc["lo"] == "parked"  # not superseding the run its ceiling chose
    assert held.expires_at is not None
    # The newer send's own ceiling passed too (0.3 s after it parked; on a busy machine its park may come
    # later than the older send's lapse), so that the sweeper hands it a slot.
    due_at = next(e["nb"] for e in doc["q"] if e["t"] == "newer")
    wait_for(
        lambda: server_past(store, held.expires_at) and server_past(store, due_at),
        timeout=30,
        message="the older send's slot to lapse and the newer send to be due",
    )
    swept = store.sweep(gate)
    assert swept is not None and swept.on_key == {"newer"}  # handed a slot, not yet claimed
    lease, doc = due_admit(older, ttl=30)  # the older send's next attempt, before the newer one claims
    assert lease is None and doc["lo"] == "superseded" and doc["lo_by"] == "newer"
    lease, doc = admit(newer, ttl=30, claim=newer["tk"])
    assert lease is not None and doc["lo"] == "claimed", doc


def test_a_parked_run_of_a_set_shows_the_task_s_keys_not_its_gate(store: LeaseStore) -> None:
    """What ``inspect``, ``why`` and ``celery mongolock queue`` show of a parked run of a set: its keys,
    never its gate (its entry's ``ks`` holds the gate first)."""
    keys = sorted([f"a:{uuid.uuid4().hex}", f"b:{uuid.uuid4().hex}"])
    holder = store.acquire(keys[0], 30)
    assert holder is not None
    try:
        run = {"id": "t-9/0", "t": "t-9", "n": "gate.merge", "s": 9, "ks": [gate_of(keys), *keys]}
        lease, doc = store.admit(keys[0], run, ttl=30)
        assert lease is None and doc["lo"] == "parked", doc.get("lo")
        info = store.inspect(keys[0])
        assert info is not None and [p["keys"] for p in info.parked] == [keys]
        story = store.why(keys[0])
        assert story is not None and [p.keys for p in story.parked] == [tuple(keys)]
    finally:
        holder.release()
