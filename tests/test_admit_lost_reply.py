"""An admit whose reply document is lost, on the embedded server (no Celery): the outcome a run is told
is its own command's, never the one another run's admit left in the key's document.

The embedded server sometimes answers a ``findAndModify`` that it applied with no document (under
contention; DESIGN.md's deviations). The acquire then reads the key's document back. A lease is judged on
the owner token in it, but an admit's outcome (``lo``, ``lo_by``) is whatever the *last* admit of the key
wrote: between this run's command and the read, another run's admit may have run. The burst of
``tests/test_replace_keys_limit.py`` hit it (docs/known-issues.md until fixed): the newest send parked,
an older send's admit then answered ``superseded`` by the newest, and the newest read that answer back
as its own: it ended superseded by itself, and an older send ran in its place.

Each test below loses the reply of one admit (``LostReply``: the command is applied, the reply replaced
by None) and runs another run's admit in that window, as the workers of the real test did."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from celery_mongolock import LeaseStore
from celery_mongolock.core.documents.sets import set_signature

T, G = "lost:tenant", "lost:group"  # T has N slots, G is a single lease
K = "lost:key"  # a single-key Replace
N = 2


class LostReply:
    """The lease collection as ``store``'s admits see it: the first ``findAndModify`` of ``key`` is
    applied, then ``between`` runs (another run's command), and no document is returned."""

    def __init__(self, store: LeaseStore, key: str, between: Callable[[], object]) -> None:
        self.real = store.connection.ready_collection()
        self.key = key
        self.between = between
        self.lost = 0

    def find_one_and_update(self, query: dict[str, Any], update: Any, **kwargs: Any) -> Any:
        doc = self.real.find_one_and_update(query, update, **kwargs)
        if self.lost == 0 and query.get("_id") == self.key:
            self.lost += 1
            self.between()
            return None
        return doc

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def lose_next_reply(
    monkeypatch: pytest.MonkeyPatch, store: LeaseStore, key: str, between: Callable[[], object]
) -> LostReply:
    lost = LostReply(store, key, between)
    monkeypatch.setattr(store.connection, "ready_collection", lambda: lost)
    return lost


def run(stamp: int, keys: list[str] | None = None) -> dict[str, Any]:
    tid = f"r{stamp}"
    e: dict[str, Any] = {"id": f"{tid}/0", "t": tid, "n": "upload", "r": "0", "s": stamp, "m": b"msg"}
    if keys:
        e.update(ks=sorted(keys), g=set_signature(keys), tk=f"tk-{tid}")
    return e


def admit(store: LeaseStore, key: str, e: dict[str, Any], **options: Any) -> tuple[Any, dict[str, Any]]:
    info = {"task_id": e["t"], "delivery": e["r"]}
    if e.get("g"):
        options.update(group=e["g"], limit=N if key == T else None)
        info["keys"] = e["ks"]
    return store.admit(key, e, ttl=30, replace=True, info=info, **options)


def doc_of(store: LeaseStore, key: str) -> dict[str, Any]:
    return store.collection.find_one({"_id": key}) or {}


def parked(store: LeaseStore, key: str) -> list[str]:
    return [e["t"] for e in doc_of(store, key).get("q") or []]


def test_the_newest_send_of_a_key_set_is_not_told_an_older_sends_superseded(
    store: LeaseStore, make_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bug of the burst: the newest send parks on the group (held), an older send's admit answers
    ``superseded`` by it in the window, and the newest must still be told ``parked``, not superseded by
    itself."""
    other = make_store()
    blocker = other.acquire(G, 30)
    assert blocker is not None
    keys = [T, G]
    old, new = run(10, keys), run(40, keys)
    lost = lose_next_reply(monkeypatch, store, G, lambda: admit(other, G, old))
    lease, doc = admit(store, G, new)
    assert lost.lost == 1
    assert lease is None and doc["lo"] == "parked", (doc.get("lo"), doc.get("lo_by"))
    assert doc.get("lo_by") != new["t"], "a run superseded by itself"
    assert parked(store, G) == ["r40"]
    # The older send was told it was superseded by the newest, on its own reply.
    _, again = admit(other, G, old)
    assert again["lo"] == "superseded" and again["lo_by"] == "r40"


def test_a_run_parked_for_a_slot_is_not_told_an_older_sends_superseded(
    store: LeaseStore, make_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same on the key with slots (the tenant full): the newest parks for a slot."""
    other = make_store()
    holders = [other.acquire(T, 30, limit=N) for _ in range(N)]
    assert all(holders)
    keys = [T, G]
    old, new = run(10, keys), run(40, keys)
    lose_next_reply(monkeypatch, store, T, lambda: admit(other, T, old))
    lease, doc = admit(store, T, new)
    assert lease is None and doc["lo"] == "parked", (doc.get("lo"), doc.get("lo_by"))
    assert parked(store, T) == ["r40"]


@pytest.mark.parametrize("debounce", [None, 5.0], ids=["replace", "debounce"])
def test_a_single_key_replace_run_is_not_told_an_older_sends_superseded(
    store: LeaseStore, make_store: Any, monkeypatch: pytest.MonkeyPatch, debounce: float | None
) -> None:
    """One key, ``Replace()`` and ``Replace(debounce=...)``: the same window."""
    other = make_store()
    blocker = other.acquire(K, 30)
    assert blocker is not None
    old, new = run(10), run(40)
    lose_next_reply(monkeypatch, store, K, lambda: admit(other, K, old, debounce=debounce))
    lease, doc = admit(store, K, new, debounce=debounce)
    assert lease is None and doc["lo"] == "parked", (doc.get("lo"), doc.get("lo_by"))
    assert parked(store, K) == ["r40"]


def test_a_superseded_run_is_not_told_another_runs_parked(
    store: LeaseStore, make_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other way round: an older send's admit is superseded, and in the window a run of another key
    set parks on the key. Told ``parked``, the older send would wait for a key it is parked nowhere on."""
    other = make_store()
    blocker = other.acquire(G, 30)
    assert blocker is not None
    keys = [T, G]
    old, new, stranger = run(10, keys), run(40, keys), run(50, [G, "lost:other"])
    assert admit(other, G, new)[1]["lo"] == "parked"
    lose_next_reply(monkeypatch, store, G, lambda: admit(other, G, stranger))
    lease, doc = admit(store, G, old)
    assert lease is None, doc.get("lo")
    assert (doc["lo"], doc["lo_by"]) == ("superseded", "r40")
    assert parked(store, G) == ["r40", "r50"]


def test_a_resent_admit_counts_its_lease_from_its_first_send(
    store: LeaseStore, make_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot admit whose reply is lost is sent again with the same token; the second command answers
    ``mine`` (the first one took the slot) without renewing it. The lease's local deadline is counted from
    the first send, not the second: counted from the second, it outlived the server's expiry by the time in
    between (the lock-set checker on RabbitMQ, seed 5: an acquisition seemed to begin after a later fence's
    had ended)."""
    import time

    from celery_mongolock.core.lease import local_ttl

    other = make_store()
    keys = [T, G]
    old, new = run(10, keys), run(40, keys)

    def late_other_admit() -> None:
        time.sleep(0.6)  # the resend comes this much later
        admit(other, T, old)

    lose_next_reply(monkeypatch, store, T, late_other_admit)
    t0 = time.monotonic()
    lease, doc = admit(store, T, new)
    assert lease is not None and doc["lo"] == "acquired", (doc.get("lo"), doc.get("lo_by"))
    assert lease.deadline - local_ttl(lease.ttl) < t0 + 0.3
