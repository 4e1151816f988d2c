"""A model-based test of deep queues (``documents.spill``): a hypothesis ``RuleBasedStateMachine`` drives one
key with a window of 2 parked runs per priority through the store's real operations on the embedded
server, against a reference model that is only a list of parked runs; then a ``limit=2`` key the same way
(two runs hold it at once, each release hands one slot, a refill hands every free slot).

Rules: a new run is sent (a priority of 0 or 1) and admitted; the holder releases and the run handed the
key claims it; a copy of a parked run's message is admitted again; a worker stops between its admit and
its insert (the run's number is a hole; its message, never acknowledged, comes back later as a new send);
a refill's delete fails (the runs it moved stay in the spill under passed numbers); the sweeper passes.
Runs are sent in stamp order, so the model's order is simply (rank, stamp).

Checked after every step: the key is handed only to the run the model says is next (the lowest rank,
then the oldest); a copy is told ``dup``; the parked runs (window and spill) are exactly the model's;
nothing runs twice. At the end of each example the queue is drained, each run exactly once, in order.

``MONGOLOCK_SPILL_EXAMPLES`` (default 10) sets the number of examples.
"""

from __future__ import annotations

import datetime as _dt
import os
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from pymongo import MongoClient, WriteConcern
from pymongo.collection import Collection
from pymongo.errors import AutoReconnect

from celery_mongolock import Lease, LeaseStore, StoreUnavailable

EXAMPLES = int(os.environ.get("MONGOLOCK_SPILL_EXAMPLES", "10"))
KEY = "deep:1"
WINDOW = 2
CLIENT: list[MongoClient[dict[str, Any]]] = []


class Stopped(Exception):
    """The worker stopped between its admit and its insert."""


class SpillMachine(RuleBasedStateMachine):
    #: The key's ``limit=N`` (None: a key held as one lease).
    LIMIT: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.db_name = f"mongolock_spill_{uuid.uuid4().hex[:12]}"
        self.store = LeaseStore(
            CLIENT[0],
            database=self.db_name,
            lease_seconds=600,
            history_days=0,
            write_concern=WriteConcern(w=1),
            parked_window=WINDOW,
        )
        self.handed: list[dict[str, Any]] = []
        self.store.add_handoff_callback(lambda key, ho, doc: self.handed.append(dict(ho)))
        self.stamp = 0
        self.parked: list[tuple[int, int, str]] = []  # the model: (rank, stamp, task id)
        self.holders: list[Lease] = []
        self.ran: list[str] = []
        self.sent = 0
        #: A run handed the key that has not claimed it (its worker is slow): ``(ho, model entry)``.
        self.unclaimed: tuple[dict[str, Any], tuple[int, int, str]] | None = None
        #: The last release's refill never came (``release_without_its_refill``): a free key (or slot) may
        #: wait for the next refill or the sweeper.
        self.refill_missed = False
        #: Numbers whose run was never stored (``stop_before_insert``): counted until a refill passes them.
        self.holes = 0

    # -- helpers ---------------------------------------------------------------------------------------
    def _entry(self, tid: str, stamp: int, rank: int) -> dict[str, Any]:
        e = {"id": f"{tid}/0", "t": tid, "n": "deep", "r": "0", "s": stamp, "m": b"m" * 64}
        return {**e, "pr": rank} if rank else e

    def _new(self, rank: int) -> tuple[str, int]:
        self.stamp += 1
        self.sent += 1
        return f"run-{self.sent}", self.stamp

    def _admit(self, tid: str, stamp: int, rank: int) -> str:
        lease, doc = self.store.admit(KEY, self._entry(tid, stamp, rank), ttl=600, limit=self.LIMIT)
        if lease is not None:
            assert len(self.holders) < (self.LIMIT or 1), f"{tid} took the key past {self.holders}"
            assert not self.parked, f"{tid} took the key past {self.parked}"
            self.holders.append(lease)
            self.ran.append(tid)
            return "acquired"
        outcome = str(doc.get("lo"))
        if outcome == "parked":
            self.parked.append((rank, stamp, tid))
        return outcome

    def _claim_handed(self, leave: bool = False) -> None:
        """The run the last command handed the key to claims it (the model says which it must be: the run
        handed the key before and not claimed, else the first by rank and send order). ``leave``: it does
        not claim it yet (``unclaimed``)."""
        while self.handed:
            ho = self.handed.pop(0)
            expected = self.unclaimed[1] if self.unclaimed is not None else min(self.parked)
            assert ho["t"] == expected[2], (
                f"handed {ho['t']}, the model's next is {expected} of {self.parked}"
            )
            if self.unclaimed is None:
                self.parked.remove(expected)
            if leave:
                self.unclaimed = (ho, expected)
                return
            self.unclaimed = None
            entry = {**self._entry(ho["t"], int(ho["s"]), int(ho.get("pr") or 0)), "tk": ho["tk"]}
            lease, doc = self.store.admit(KEY, entry, ttl=600, claim=ho["tk"], limit=self.LIMIT)
            assert lease is not None and doc["lo"] == "claimed", doc.get("lo")
            assert ho["t"] not in self.ran, f"{ho['t']} ran twice"
            self.ran.append(ho["t"])
            self.holders.append(lease)
            assert len(self.holders) <= (self.LIMIT or 1), f"more holders than the limit: {self.holders}"

    # -- rules -----------------------------------------------------------------------------------------
    @precondition(lambda self: self.sent < 40)
    @rule(rank=st.sampled_from([0, 0, 0, 1]))
    def send(self, rank: int) -> None:
        self.refill_missed = False
        tid, stamp = self._new(rank)
        assert self._admit(tid, stamp, rank) in ("acquired", "parked")
        self._claim_handed()

    @precondition(lambda self: bool(self.holders))
    @rule()
    def release(self) -> None:
        self.refill_missed = False
        lease = self.holders.pop(0)
        assert lease.release()
        self._claim_handed()

    @precondition(lambda self: bool(self.parked))
    @rule(data=st.data())
    def copy(self, data: st.DataObject) -> None:
        rank, stamp, tid = data.draw(st.sampled_from(self.parked), label="copy of")
        lease, doc = self.store.admit(KEY, self._entry(tid, stamp, rank), ttl=600, limit=self.LIMIT)
        assert lease is None and doc["lo"] == "dup", doc.get("lo")

    @precondition(lambda self: self.sent < 40)
    @rule(rank=st.sampled_from([0, 0, 1]), cap=st.integers(min_value=1, max_value=8))
    def send_capped(self, rank: int, cap: int) -> None:
        """A ``Queue(max_length=cap)`` send: ``full`` exactly when ``cap`` runs wait (runs that left before
        their turn not counted; a hole may be, until a refill passes it)."""
        self.refill_missed = False
        tid, stamp = self._new(rank)
        waiting = len(self.parked)
        pending = 0 if self.unclaimed is None else 1  # (a run handed the key may count until it claims it)
        entry = self._entry(tid, stamp, rank)
        lease, doc = self.store.admit(KEY, entry, ttl=600, limit=self.LIMIT, max_length=cap)
        outcome = "acquired" if lease is not None else str(doc.get("lo"))
        if outcome == "full":
            assert waiting + pending + self.holes >= cap, (
                f"full at {waiting} waiting (cap {cap}): {self.parked}"
            )
        elif outcome == "parked":
            assert waiting < cap, f"parked as the {waiting + 1}th (cap {cap}): {self.parked}"
            self.parked.append((rank, stamp, tid))
        else:
            assert outcome == "acquired", outcome
            assert lease is not None and not self.parked, f"{tid} took the key past {self.parked}"
            self.holders.append(lease)
            self.ran.append(tid)
        self._claim_handed()

    @precondition(lambda self: bool(self.parked))
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        """A parked run leaves before its turn (revoked, dropped, superseded): out of the window or the
        spill, where it is."""
        rank, stamp, tid = data.draw(st.sampled_from(self.parked), label="leaves")
        self.store.unpark(KEY, f"{tid}/0")
        self.store.spill.drop(KEY, [tid])
        self.parked.remove((rank, stamp, tid))
        self._claim_handed()

    @precondition(lambda self: len(self.holders) == (self.LIMIT or 1) and self.sent < 40)
    @rule(rank=st.sampled_from([0, 1]))
    def stop_before_insert(self, rank: int) -> None:
        """A worker stops after its admit: a hole, if the run was spilled; its message comes back, a new
        send as far as order goes (``send``)."""
        self.refill_missed = False
        real = self.store.spill.store_entry

        def stopped(*args: Any, **kwargs: Any) -> str:
            raise Stopped()

        self.store.spill.store_entry = stopped  # type: ignore[method-assign]
        tid, stamp = self._new(rank)
        try:
            outcome = self._admit(tid, stamp, rank)  # (parked in the window: no insert to stop)
        except Stopped:
            outcome = "stopped"
        finally:
            self.store.spill.store_entry = real  # type: ignore[method-assign]
        assert outcome in ("parked", "stopped")
        if outcome == "stopped":
            self.holes += 1
            again, stamp = self._new(rank)  # (the same message, delivered again later: a new place)
            assert self._admit(again, stamp, rank) == "parked"

    @precondition(lambda self: bool(self.holders))
    @rule()
    def release_with_a_failing_delete(self) -> None:
        real = Collection.delete_many

        def failing(coll: Collection[Any], *args: Any, **kwargs: Any) -> Any:
            if coll.name.endswith(".parked"):
                raise AutoReconnect("connection reset")
            return real(coll, *args, **kwargs)

        Collection.delete_many = failing  # type: ignore[method-assign,assignment]
        try:
            self.release()
        finally:
            Collection.delete_many = real  # type: ignore[method-assign]

    @precondition(lambda self: bool(self.holders))
    @rule()
    def release_without_its_refill(self) -> None:
        """The releasing worker stops after its release, before the refill the release leads to: the key
        waits for its spilled runs of a higher priority (a later refill or the sweeper brings them), never
        going to a lower-priority run of the window first, nor staying free with runs parked for ever."""
        real = self.store.spill.refill
        self.store.spill.refill = lambda *args, **kwargs: None  # type: ignore[method-assign]
        try:
            self.release()
        finally:
            self.store.spill.refill = real  # type: ignore[method-assign]
        self.refill_missed = True

    @precondition(lambda self: self.LIMIT is None and bool(self.holders) and self.unclaimed is None)
    @rule()
    def release_to_a_slow_run(self) -> None:
        """The run the release hands the key to does not claim it yet (its message waits in the broker)."""
        self.refill_missed = False
        lease = self.holders.pop(0)
        assert lease.release()
        self._claim_handed(leave=True)

    @precondition(lambda self: self.unclaimed is not None)
    @rule()
    def handoff_lapses(self) -> None:
        """The handoff not claimed in time lapses (on the server's clock); the sweeper hands the key again:
        to the same run (a run handed the key keeps it), which claims it now."""
        self.refill_missed = False
        past = _dt.datetime(2000, 1, 1, tzinfo=_dt.timezone.utc)
        self.store.collection.update_one({"_id": KEY}, {"$set": {"expires_at": past}})
        self.store.sweep(KEY)
        assert self.handed, f"the lapsed handoff of {self.unclaimed} was not handed again"
        self._claim_handed()

    @rule()
    def sweep(self) -> None:
        self.refill_missed = False
        self.store.sweep(KEY, slots=self.LIMIT is not None)
        self._claim_handed()

    # -- after every step ------------------------------------------------------------------------------
    @invariant()
    def check_parked(self) -> None:
        doc = self.store.collection.find_one({"_id": KEY}) or {}
        window = {str(e["t"]) for e in doc.get("q") or []}
        lanes = {lane["r"]: lane for lane in doc.get("sp") or []}
        waiting = set()
        for d in self.store.spill.collection.find({"k": KEY, "x": {"$ne": True}}):
            lane = lanes.get(d["r"])
            if lane is not None and lane["e"] == d["ep"] and lane["h"] <= d["n"] < lane["t"]:
                waiting.add(str(d["e"]["t"]))
        handed = [(doc.get("ho") or {}).get("t")] + [
            (h.get("ho") or {}).get("t") for h in doc.get("hs") or []
        ]
        assert window.isdisjoint(waiting), f"in the window and spilled: {window & waiting}"
        assert window | waiting == {tid for _, _, tid in self.parked}, (window, waiting, self.parked)
        pending = {self.unclaimed[1][2]} if self.unclaimed is not None else set()
        free = len(self.holders) + len(pending) < (self.LIMIT or 1)
        assert not (free and self.parked) or self.refill_missed, (
            f"the key has room ({self.holders}) while runs wait: {self.parked}"
        )
        assert all(t is None or t in self.ran or t in pending for t in handed), handed
        info = self.store.inspect(KEY)
        counted = 0 if info is None else info.parked_total
        # (the count leaves out runs that left; a run handed the key may keep its place until it claims it,
        # and a hole counts until a refill passes it)
        most = len(self.parked) + len(pending) + self.holes
        assert len(self.parked) <= counted <= most, (counted, self.parked, pending, self.holes)

    def teardown(self) -> None:
        try:
            for _ in range(200):  # drain: each holder releases, the run handed the key claims it
                if self.unclaimed is not None:
                    self.handoff_lapses()
                elif self.holders:
                    self.release()
                elif self.parked:
                    self.sweep()  # (a refill that could not run: the sweeper's)
                    if not self.holders:
                        break
                else:
                    break
            assert not self.parked, f"never ran: {self.parked}"
            assert len(self.ran) == len(set(self.ran))
        finally:
            self.store.close()
            CLIENT[0].drop_database(self.db_name)


class SlotSpillMachine(SpillMachine):
    """The same on a ``limit=2`` key: two runs hold it at once, a release hands one slot."""

    LIMIT = 2


@pytest.mark.timeout(600 + 30 * EXAMPLES)
@pytest.mark.parametrize("machine", [SpillMachine, SlotSpillMachine], ids=["one-lease", "limit-2"])
def test_a_deep_queue_matches_its_model(mongo_url: str, machine: type[SpillMachine]) -> None:
    CLIENT[:] = [MongoClient(mongo_url, tz_aware=True)]
    try:
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=EXAMPLES,
                stateful_step_count=40,
                deadline=None,
                database=None,
                derandomize=os.environ.get("MONGOLOCK_SPILL_SEED") is None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                print_blob=False,
            ),
        )
    finally:
        CLIENT.pop().close()


def test_a_stopped_worker_s_admit_raises_for_its_message_to_come_back(make_store: Any) -> None:
    """(What ``stop_before_insert`` stands for: an insert that cannot be made fails the admit, and the
    message is not acknowledged.)"""
    store = make_store(lease_seconds=30, parked_window=1)
    holder = store.acquire(KEY, 30)
    assert holder is not None
    store.admit(KEY, {"id": "a/0", "t": "a", "n": "deep", "r": "0", "s": 1, "m": b"m"})
    real = Collection.insert_one

    def down(coll: Collection[Any], *args: Any, **kwargs: Any) -> Any:
        if coll.name.endswith(".parked"):
            raise AutoReconnect("down")
        return real(coll, *args, **kwargs)

    Collection.insert_one = down  # type: ignore[method-assign,assignment]
    store.operation_timeout = 0.5
    try:
        with pytest.raises(StoreUnavailable):
            store.admit(KEY, {"id": "b/0", "t": "b", "n": "deep", "r": "0", "s": 2, "m": b"m"})
    finally:
        Collection.insert_one = real  # type: ignore[method-assign]
    holder.release()
