"""A model-based test of ``Queue`` and ``Replace`` runs of several keys, which take their keys one at a
time in key order (issue 28: deep queues for runs of several keys; ``integration.key_set``).

A hypothesis ``RuleBasedStateMachine`` drives the real admission of a worker (``QueuedRun.take``, in
this process, on the embedded server) with runs of two or three of four keys, whose messages it holds
itself as a broker would: it sends runs, delivers any waiting message in any order (a handoff, a fresh
send, or a copy of one delivered again), ends running bodies (their releases hand the keys on and
publish the next runs' messages, which join the waiting ones), and lets reservations lapse as a sweeper
finds them (the key handed again). A key's window holds 2 parked runs, so the others are spilled.

After every step: no key is held by two running bodies; no body runs twice; and a run that waits on a
key never holds a reservation on a key after it unless a message of it is on its way (its worker then
gives the later key back): the order that makes a cycle of waits impossible. At the end of each example
the machine drains (delivers every message, ends every body, and lets reservations lapse while nothing
else moves): every run must then have run exactly once, within a bound of rounds, or it waited for ever.

The same machine with ``Replace()`` runs of sets of keys (``test_replace_runs_of_sets_match_their_model``):
a run ends either with its body or superseded, never both; the newest send of each set runs; and no run
of a set runs after a newer send of its set ran.

``MONGOLOCK_MODEL_EXAMPLES`` (default 12) sets the number of examples.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime as _dt
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore, Retry
from celery.signals import before_task_publish
from hypothesis import HealthCheck, settings
from hypothesis import event as _event
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_mongolock import LeaseStore, Queue, Replace, singleton_task
from celery_mongolock.admission.contention import Outcome
from celery_mongolock.config import get_store
from celery_mongolock.core.documents.sets import gate_of, is_gate
from celery_mongolock.core.lease import Lease
from celery_mongolock.core.waiting import Swept
from celery_mongolock.integration import handoff as _queue
from celery_mongolock.integration.queued_run import QueuedRun
from celery_mongolock.integration.results import write_timed_out
from celery_mongolock.integration.supersede import is_superseded_meta
from celery_mongolock.testing import wait_for

EXAMPLES = int(os.environ.get("MONGOLOCK_MODEL_EXAMPLES", "12"))
LETTERS = ("a", "b", "c", "d")
#: Drain rounds before a run that has not run is judged stuck (a round ends the running bodies, or delivers
#: messages until a body starts, or lets every reservation lapse when nothing else moves).
DRAIN_ROUNDS = 1000
#: Deliveries in one drain round before the messages are judged to keep coming for ever.
DRAIN_DELIVERIES = 300


def event(what: str) -> None:
    """A hypothesis event (counted in ``--hypothesis-show-statistics``); none outside a hypothesis test."""
    with contextlib.suppress(InvalidArgument):
        _event(what)


@dataclasses.dataclass
class Run:
    task_id: str
    args: tuple[str, str, str]
    keys: list[str]
    bodies: int = 0
    done: bool = False
    #: Ended superseded (``Replace``): by its own admit, or written by the run that superseded it.
    superseded: bool = False
    #: When its body started (the machine's count of body starts), if it did.
    started: int | None = None
    #: ``Replace``: the keys it admits, its set's gate first (``sets.gate_of``).
    gated: bool = False

    @property
    def admitted(self) -> list[str]:
        return [gate_of(self.keys), *self.keys] if self.gated else list(self.keys)

    @property
    def entry(self) -> dict[str, Any]:
        ident = f"{self.task_id}/0"
        keys = self.admitted
        return {"id": ident, "t": self.task_id, "ks": keys, "tk": _queue.keys_token(ident, keys)}


@dataclasses.dataclass(frozen=True)
class Message:
    task_id: str
    headers: dict[str, Any]
    redelivered: bool = False


@pytest.fixture
def app(mongo_url: str, db_name: str) -> Iterator[Celery]:
    app = Celery("stepwise_model", broker="memory://", backend="cache+memory://")
    app.conf.update(
        mongolock_url=mongo_url,
        mongolock_database=db_name,
        mongolock_lease_seconds=600.0,
        mongolock_parked_window=2,
    )
    yield app
    get_store(app).close()


def test_runs_of_several_keys_match_their_model(app: Celery) -> None:
    run_state_machine_as_test(
        _machine(app),
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


@pytest.mark.parametrize("limit", [None, 2], ids=["single", "slots"])
def test_replace_runs_of_sets_match_their_model(app: Celery, limit: int | None) -> None:
    """(``slots``: every key has 2 slots, the first key of each set included: two runs of a set may be past
    it at once. A key is never used both ways here: that is a known issue, ``docs/known-issues.md``.)"""
    run_state_machine_as_test(
        _machine(app, Replace(), limit=limit),
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


def test_a_run_that_lost_an_earlier_key_gives_back_a_later_one(app: Celery) -> None:
    """The directed case of the model: Y (a, b) takes a and waits on b, in b's window; X (a, b), sent
    before Y but delivered after it, waits on a behind Y's reservation. Y's reservation of a lapses and a
    goes to X (older), which takes it and waits on b, spilled behind Y (b's window is full). When b is
    handed to Y, Y waits on a again: it gives b back (to X, which then runs) instead of holding b while it
    waits for a, which X holds (a cycle of waits that only a lapse would break). (b's window holds 2: a
    third run, sent last, fills it.)"""
    machine = _machine(app)()
    try:
        holder = machine.sent(["b", "c"])
        machine.deliver_run(holder)
        assert holder in machine.running
        older, younger, last = machine.sent(["a", "b"]), machine.sent(["a", "b"]), machine.sent(["b", "d"])
        machine.deliver_run(younger)  # takes a, waits on b
        machine.deliver_run(last)  # waits on b: b's window (2) is full
        machine.deliver_run(older)  # waits on a, behind younger's reservation
        assert machine.places(younger) == ["reserved", "parked"]
        assert machine.places(older) == ["parked", "absent"]
        machine.lapse("a")  # handed again in send order: to older
        machine.deliver_run(older)  # claims a, waits on b: spilled behind younger and last
        assert machine.places(older) == ["reserved", "absent"]
        assert machine.places(younger) == ["parked", "parked"]
        machine._finish(holder)  # b goes to younger, which waits on a: its message is published
        assert machine.places(younger) == ["parked", "reserved"]
        machine.deliver_run(younger)  # it gives b back: b goes to older, whose message is published
        assert machine.places(younger) == ["parked", "absent"]
        machine.waits_hold_only_earlier_keys()
        machine.deliver_run(older)
        assert older in machine.running
        machine._drain()
    finally:
        machine.teardown()


def test_a_late_handoff_message_of_a_run_that_ended_leaves_its_keys(app: Celery) -> None:
    """R (a, b) took a and waits on b; b is handed to it, and its message is on its way. Meanwhile R ends
    (its result stored: timed out there, say) and leaves b. When the message comes, R's claim finds b not
    handed to it any more: it gives a back and leaves its keys, and is dropped, instead of taking b as a
    new run (which would keep a reserved for an ended run, lapse after lapse, and run its body later)."""
    machine = _machine(app)()
    try:
        holder = machine.sent(["b", "c"])
        machine.deliver_run(holder)
        run = machine.sent(["a", "b"])
        machine.deliver_run(run)
        assert machine.places(run) == ["reserved", "parked"]
        machine._finish(holder)  # b is handed to it: its message is published
        assert machine.places(run) == ["reserved", "reserved"]
        app.backend.store_result(run, {"mongolock": "skipped"}, "SUCCESS")  # it ended meanwhile
        machine.store.sweep(machine.key("b"), revoked={run})  # and left b
        machine.deliver_run(run)
        assert machine.places(run) == ["absent", "absent"]
        assert machine.runs[run].bodies == 0 and not machine.pending
        machine.runs[run].done = True  # (ended without its body)
        after = machine.sent(["a", "b"])
        machine.deliver_run(after)  # a is free for the next run
        assert after in machine.running
        machine._drain()
    finally:
        machine.teardown()


@pytest.mark.parametrize("every_key", [False, True], ids=["first-key", "every-key"])
def test_an_older_run_of_a_set_past_a_first_key_with_slots_never_runs_after_a_newer_one(
    app: Celery, monkeypatch: pytest.MonkeyPatch, every_key: bool
) -> None:
    """``Replace`` with a limit on the first key of the set (2 slots on ``k:a``). The older run takes its
    set's gate and a slot of ``k:a`` and, before it admits ``k:b``, the newer send is delivered. With one
    key of the set single (``first-key``) its gate is single too: the newer send waits there, and runs
    after the older one. With every key of the set slotted (``every-key``) the gate has 2 slots: the newer
    takes the other slot of each key, runs and ends; the older then finds ``k:b`` free, and must end
    superseded, not run the older arguments after the newer ones (``KeySetAdmits.newer_past_gate``)."""
    machine = _machine(app, Replace(), limit=2 if every_key else {"k:{x}": 2})()
    try:
        older, newer = machine.sent(["a", "b"]), machine.sent(["a", "b"])
        admit = machine.store.admit
        passed: list[str] = []

        def slow_older(key: str, entry: Any, *args: Any, **kwargs: Any) -> Any:
            if entry.get("t") == older and key == machine.key("b") and not passed:
                passed.append(key)  # the newer run is delivered here
                machine.deliver_run(newer)
                assert (newer in machine.running) is every_key
                if every_key:
                    machine._finish(newer)
            return admit(key, entry, *args, **kwargs)

        monkeypatch.setattr(machine.store, "admit", slow_older)
        machine.deliver_run(older)
        monkeypatch.undo()
        assert passed
        if every_key:
            assert machine.runs[newer].bodies == 1
            assert machine.runs[older].bodies == 0 and machine.runs[older].superseded
        else:
            assert older in machine.running and machine.runs[newer].bodies == 0
        machine.newer_sends_of_a_set_run_after_older_ones()
        machine._drain()
        assert machine.runs[newer].bodies == 1
    finally:
        machine.teardown()


def test_a_delayed_copy_refused_its_first_key_by_a_newer_send_ends_superseded(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Replace(debounce=...)`` with ``keys=``: the older run's delayed copy takes its set's gate (due) and
    ``k:a`` and, while it admits ``k:b`` (held), a newer send of its set parks on the gate, which the copy
    holds (nothing to take back there). The copy's reservation of the gate is then refused: it must end
    superseded, with its result written (nobody else writes it: the newer send superseded no entry of it), not
    be dropped as a copy whose result was written (it stayed ``QUEUED`` for ever: seen in a real-worker
    test)."""
    # (a debounce long enough that the newer send cannot come due while the steps below run on a loaded
    # machine: it is delivered once due, below)
    machine = _machine(app, Replace(debounce=3.0))()
    try:
        blocker = machine.store.acquire(machine.key("b"), 600)
        assert blocker is not None
        older, newer = machine.sent(["a", "b"]), machine.sent(["a", "b"])
        machine.deliver_run(older)  # parks on k:a (debounced); its delayed copy is published
        [copy] = [m for m in machine.pending if m.task_id == older and m.headers.get(_queue.DEBOUNCE_HEADER)]
        machine.pending.remove(copy)
        wait_for(lambda: machine.due(older), timeout=30, message="the older run due on its set's gate")
        admit = machine.store.admit
        passed: list[str] = []

        def newer_meanwhile(key: str, entry: Any, *args: Any, **kwargs: Any) -> Any:
            if entry.get("t") == older and key == machine.key("b") and not passed:
                passed.append(key)  # the newer send parks on k:a while the copy holds it
                machine.deliver_run(newer)
            return admit(key, entry, *args, **kwargs)

        monkeypatch.setattr(machine.store, "admit", newer_meanwhile)
        machine._deliver(copy)
        monkeypatch.undo()
        assert passed
        # (its take() returned the superseded outcome, which its worker stores as its result)
        assert machine.runs[older].superseded and machine.runs[older].bodies == 0
        [newer_copy] = [
            m for m in machine.pending if m.task_id == newer and m.headers.get(_queue.DEBOUNCE_HEADER)
        ]
        machine.pending.remove(newer_copy)  # (delivered once due, as the broker's countdown does)
        blocker.release()
        wait_for(lambda: machine.due(newer), timeout=30, message="the newer send due on its set's gate")
        machine._deliver(newer_copy)
        machine._drain()
        assert machine.runs[newer].bodies == 1
    finally:
        machine.teardown()


def test_a_run_of_a_set_timed_out_on_its_gate_names_its_first_key(app: Celery) -> None:
    """``Replace(timeout=...)`` with ``keys=``: a run parked on its set's gate (held) past its timeout ends
    ``skipped`` by the sweep, and its result, its ending and the history of its own keys name its first
    key, never the gate (``results.named_key``, ``record_ending``)."""
    machine = _machine(app, Replace(timeout=0.5))()
    try:
        run_id = machine.sent(["a", "b"])
        run = machine.runs[run_id]
        gate = run.admitted[0]
        blocker, _ = machine.store.try_acquire(gate, 600)  # (the older run of the set, holding its gate)
        assert blocker is not None
        machine.deliver_run(run_id)
        assert run_id in [e.get("t") for e in (machine.store.collection.find_one({"_id": gate}) or {})["q"]]

        def timed_out() -> Any:
            return [r for r in (machine.store.sweep(gate) or Swept(None)).timed_out if r.get("t") == run_id]

        runs = wait_for(timed_out, timeout=30, message="the run timed out on its set's gate")
        write_timed_out(app, machine.store, gate, list(runs), fence=None)
        result = app.backend.get_task_meta(run_id)["result"]
        assert result["mongolock"] == "skipped" and result["key"] == run.keys[0], result
        machine.store.flush_history(timeout=5.0)
        run.done = True
        blocker.release()
        for key in (gate, *run.keys):  # (``celery mongolock history KEY``)
            assert run_id in {e.task_id for e in machine.store.history(key) if e.how == "timeout"}, key
    finally:  # (no drain: the newest send of this set timed out, as it must)
        before_task_publish.disconnect(machine._published)


def _machine(
    app: Celery, policy: Queue | None = None, limit: int | dict[str, int] | None = None
) -> type[StepwiseMachine]:
    name = "stepwise_model.merge" if policy is None else f"stepwise_model.merge_{type(policy).__name__}"
    name += f"_limit{len(limit) if isinstance(limit, dict) else limit}" if limit else ""

    @singleton_task(
        keys=("k:{x}", "k:{y}", "k:{z}"), app=app, name=name, bind=True,
        on_contention=policy or Queue(), shared=False, limit=limit,
    )  # fmt: skip
    def merge(self: Any, x: str, y: str, z: str) -> str:
        return "ran"

    class Machine(StepwiseMachine):
        pass

    Machine.task, Machine.store, Machine.replace = merge, get_store(app), isinstance(policy, Replace)
    return Machine


class StepwiseMachine(RuleBasedStateMachine):
    task: Any
    store: LeaseStore
    replace: bool = False

    def __init__(self) -> None:
        super().__init__()
        self.prefix = uuid.uuid4().hex[:8]
        self.runs: dict[str, Run] = {}
        self.starts = 0
        self.pending: list[Message] = []
        self.running: dict[str, list[Lease]] = {}
        before_task_publish.connect(self._published, weak=False)

    # -- the broker ---------------------------------------------------------------------------------
    def _published(self, headers: dict[str, Any] | None = None, **_: Any) -> None:
        headers = dict(headers or {})
        task_id = str(headers.get("id"))
        if task_id in self.runs:
            self.pending.append(Message(task_id, headers))

    def _deliver(self, message: Message) -> None:
        run = self.runs[message.task_id]
        task = self.task
        task.push_request(
            id=run.task_id, args=run.args, kwargs={}, headers=dict(message.headers),
            delivery_info={"redelivered": message.redelivered}, hostname="w1", retries=0, is_eager=False,
            called_directly=False,
        )  # fmt: skip
        try:
            limits = task.mongolock_limits_for(*run.args)
            got = QueuedRun(task, list(run.keys), task._options(), limits=limits, one=False).take()
        except Ignore:
            return
        except Retry:
            self.pending.append(message)  # (a contention retry: the same message again later)
            return
        finally:
            task.pop_request()
        if not isinstance(got, list):
            if isinstance(got, Outcome) and isinstance(got.value, dict) and got.value.get("mongolock"):
                assert self.replace and got.value["mongolock"] == "superseded", got.value
                assert run.bodies == 0, f"{run.task_id} ended superseded after its body ran"
                run.superseded = run.done = True
            return  # (a copy ended with an outcome of its own: never a body)
        assert not run.done, f"{run.task_id} ran again after it finished"
        assert not self._superseded(run), f"{run.task_id} ran after it was superseded"
        held = collections.Counter(lease.key for leases in self.running.values() for lease in leases)
        limits = self.task.mongolock_limits_for(*run.args)
        for key in run.keys:  # (a key with N slots: at most N bodies at once)
            assert held[key] < (limits.get(key) or 1), f"{run.task_id} started holding a key that is full"
        assert sorted(lease.key for lease in got if not is_gate(lease.key)) == run.keys
        # (a Replace set holds its gate with its keys, and one run of the set holds it at most, unless
        # every key of the set has slots)
        assert [lease.key for lease in got if is_gate(lease.key)] == run.admitted[
            : len(run.admitted) - len(run.keys)
        ]
        run.bodies += 1
        assert run.bodies == 1, f"{run.task_id} ran twice"
        self.starts += 1
        run.started = self.starts
        event("a run of several keys started")
        self.running[run.task_id] = got

    def _superseded(self, run: Run) -> bool:
        """Ended superseded: by its own admit, or its result written by the run that superseded it."""
        if not run.superseded and self.replace:
            meta = self.task.app.backend.get_task_meta(run.task_id)
            if is_superseded_meta(meta):
                assert run.bodies == 0, f"{run.task_id} ran, then its result was written superseded"
                run.superseded = run.done = True
        return run.superseded

    def _ended(self, run: Run) -> bool:
        return run.done or self._superseded(run)

    def _finish(self, task_id: str) -> None:
        for lease in self.running.pop(task_id):
            lease.release()
        self.runs[task_id].done = True
        # (its worker stores its result, as Celery's trace does: a copy of the run, or its second look,
        # then finds it and is dropped; without it they would look again for ever)
        self.task.app.backend.mark_as_done(task_id, "ran")

    def _lapse(self, key: str) -> None:
        """A reservation (or any handoff) of ``key`` not claimed lapses; the sweeper hands the key again."""
        doc = self.store.collection.find_one({"_id": key}, {"ho": 1})
        if not doc or not doc.get("ho"):
            return
        self.store.collection.update_one(
            {"_id": key, "ho.id": doc["ho"]["id"]}, [{"$set": {"expires_at": {"$subtract": ["$$NOW", 1000]}}}]
        )
        self.store.sweep(key)
        event("a reservation lapsed and was handed again")

    def key(self, letter: str) -> str:
        return f"k:{self.prefix}{letter}"

    def sent(self, letters: list[str]) -> str:
        """A new run of the keys ``letters``, its message waiting; its task id."""
        args = tuple(f"{self.prefix}{x}" for x in (letters + letters[-1:])[:3])
        keys = self.task.mongolock_keys_for(*args)
        task_id = uuid.uuid4().hex
        gated = self.replace and len(set(keys)) > 1
        self.runs[task_id] = Run(task_id, args, keys, gated=gated)  # type: ignore[arg-type]
        self.pending.append(Message(task_id, {_queue.SENT_HEADER: _queue.send_stamp(), "id": task_id}))
        return task_id

    def deliver_run(self, task_id: str) -> None:
        """Deliver the message of ``task_id`` that waits longest."""
        message = next(m for m in self.pending if m.task_id == task_id)
        self.pending.remove(message)
        self._deliver(message)

    def due(self, task_id: str) -> bool:
        """The run's parked entry on its set's gate is due (its not-before time passed, server clock)."""
        doc = self.store.collection.find_one(
            {
                "_id": self.runs[task_id].admitted[0],
                "q": {"$elemMatch": {"t": task_id, "nb": {"$lte": _dt.datetime.now(_dt.timezone.utc)}}},
            }
        )
        return doc is not None

    def places(self, task_id: str) -> list[str]:
        return [place for _, place in self.store.keys_places(self.runs[task_id].entry)]

    # -- rules --------------------------------------------------------------------------------------
    @rule(letters=st.lists(st.sampled_from(LETTERS), min_size=2, max_size=3, unique=True))
    def send(self, letters: list[str]) -> None:
        self.sent(letters)

    @precondition(lambda self: self.pending)
    @rule(pick=st.integers(0, 1000), copy=st.booleans())
    def deliver(self, pick: int, copy: bool) -> None:
        message = self.pending[pick % len(self.pending)]
        if copy:  # delivered again later too (a redelivery, a duplicate): the original stays waiting
            message = dataclasses.replace(message, redelivered=True)
        else:
            self.pending.remove(message)
        self._deliver(message)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 1000))
    def finish(self, pick: int) -> None:
        self._finish(sorted(self.running)[pick % len(self.running)])

    @rule(letter=st.sampled_from(LETTERS))
    def lapse(self, letter: str) -> None:
        self._lapse(self.key(letter))

    @precondition(lambda self: self.replace and self.runs)
    @rule(pick=st.integers(0, 1000))
    def lapse_gate(self, pick: int) -> None:
        """A reservation of a set's gate lapses (``Replace``)."""
        gates = self._gates()
        if gates:
            self._lapse(gates[pick % len(gates)])

    def _gates(self) -> list[str]:
        return sorted({run.admitted[0] for run in self.runs.values() if run.gated})

    # -- invariants ---------------------------------------------------------------------------------
    @invariant()
    def waits_hold_only_earlier_keys(self) -> None:
        """A run that waits on a key holds no reservation after it, unless a message of it is on its way."""
        on_the_way = {m.task_id for m in self.pending}
        for run in self.runs.values():
            if self._ended(run) or run.task_id in self.running or run.task_id in on_the_way:
                continue
            places = [place for _, place in self.store.keys_places(run.entry)]
            first = next((i for i, p in enumerate(places) if p != "reserved"), None)
            if first is None:
                continue
            assert "reserved" not in places[first + 1 :], (
                f"{run.task_id} waits on {run.admitted[first]}, holds a later key, nothing on its way: "
                f"{places}"
            )

    @invariant()
    def newer_sends_of_a_set_run_after_older_ones(self) -> None:
        """``Replace``: a run of a set starts only before every newer send of its set that started. (Not
        ``Queue``: a newer send delivered first may run first.)"""
        if not self.replace:
            return
        later_start: dict[tuple[str, ...], int] = {}
        for run in reversed(list(self.runs.values())):  # (newest send first)
            of_set = tuple(run.keys)
            newer = later_start.get(of_set)
            if run.started is not None:
                assert newer is None or run.started < newer, (
                    f"{run.task_id} ran after a newer send of its set"
                )
                later_start[of_set] = min(run.started, newer if newer is not None else run.started)

    def newest_of_each_set_ran(self) -> None:
        """``Replace``, once drained: the newest send of every set ran its body."""
        newest: dict[tuple[str, ...], Run] = {}
        for run in self.runs.values():  # (in send order: the last of a set is its newest)
            newest[tuple(run.keys)] = run
        for of_set, run in newest.items():
            assert run.bodies == 1, (
                f"{run.task_id}, the newest send of {of_set}, never ran: {self._describe()}"
            )

    def teardown(self) -> None:
        try:
            self._drain()
        finally:
            before_task_publish.disconnect(self._published)

    def _drain(self) -> None:
        for _ in range(DRAIN_ROUNDS):
            if all(self._ended(run) for run in self.runs.values()):
                break
            if self.running:
                for task_id in sorted(self.running):
                    self._finish(task_id)
            elif self.pending:
                for _ in range(DRAIN_DELIVERIES):
                    if not self.pending or self.running:
                        break  # (a copy of a running run comes back later, after it ended: next round)
                    self._deliver(self.pending.pop(0))
                else:
                    waiting = [
                        (m.task_id[:8], sorted(k for k in m.headers if k.startswith("mongolock")))
                        for m in self.pending[-6:]
                    ]
                    raise AssertionError(
                        f"messages kept coming (a loop of publishes): {self._describe()} last: {waiting}"
                    )
            else:  # nothing moves: the sweeper hands every reservation not claimed again
                for letter in LETTERS:
                    self._lapse(self.key(letter))
                for gate in self._gates():
                    self._lapse(gate)
        if not all(self._ended(run) for run in self.runs.values()):
            raise AssertionError(f"runs never ran (waited for ever): {self._describe()}")
        if self.replace:
            self.newest_of_each_set_ran()

    def _describe(self) -> str:
        """The runs not done: their keys, where they are on each, and their messages waiting."""
        lines = []
        for run in self.runs.values():
            if self._ended(run):
                continue
            places = self.store.keys_places(run.entry)
            waiting = [
                (m.headers.get(_queue.HANDOFF_HEADER) or {}).get("k", "fresh")
                for m in self.pending
                if m.task_id == run.task_id
            ]
            lines.append(
                f"{run.task_id[:8]} {places} running={run.task_id in self.running} msgs={waiting[-5:]}"
            )
        return "\n".join(lines)
