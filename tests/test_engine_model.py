"""A model-based test of the admission engine (issue 25, item 5).

A hypothesis ``RuleBasedStateMachine`` drives the engine's real operations (``LeaseStore`` on the embedded
server: plain acquires, queued runs' admits that take, park or are refused (``max_length``), releases that
hand the key over (also from the heartbeat thread, whose handoffs the sweeper adopts), claims, copies of
messages, revokes through the sweeper and ``unpark``, Replace supersession and debounce, deadlines,
sweeps, an operator's release, a dead child's release by its parent, a holder's crash and a handed run
that never claims, renewals, late releases, and leases that really lapse on a short TTL; ``limit=N``
keys beside single ones, one of them with a minimum hold: a slot released inside it stays taken until
``crash`` ends the hold) against a small pure-Python reference model of every key (``KeyModel``: the
holds in order, the parked runs in order, the newest send that ran, the superseded, timed-out and
finished runs).

The mixed key (``MIXED``): one document used both ways, by ``Queue`` runs and plain acquirers that take
it as a single lease and by others that take it as ``limit=2`` slots, each kind a model of its own
(``mixed-one``, ``mixed-slots``) paired with the other's (``KeyModel.pair``: the fence, the runs over and
the results not yet written are the document's, once). A run's admit while the key is in use as the other
kind (held, handed, or runs of that kind parked) answers ``mixed`` and parks nothing; the run comes back
(``come_back``, and at the end of the example once the keys are drained) until the key is free of the
other kind. A plain acquire of the other kind fails. Runs of one kind only are parked at a time (``qk``
says which), handoffs go to that kind only, and the sweeper serves the key as that kind. The document
keeps the holds of the other kind that expired (a single lease's commands leave expired slots in ``hs``;
the slots' leave an expired owner), and the model with it (``slots_crash``: every slot's holder dies at
once, so a single lease is taken beside them). A second mixed key has ``Replace`` runs of ``limit=3``
slots beside ``Queue`` runs of a single lease (a newer send is judged after ``mixed``: the runs of the
other kind are not sends a run waits among). It found the bugs of ``tests/test_mixed_kinds_found.py``.
Left out: debounce, minimum holds, sets and priorities' spills on the mixed keys.

Each step's outcome is predicted by the model and compared with what the store returned, and after every
step the key's document (read with the server's time) must match the model exactly. Besides, after every
step: never more live holds than the limit on any key; never a single lease and slots held or handed at
once, nor runs of both kinds parked (``qk`` is compared on every key); every handoff goes to the oldest
parked run that was not handed before; nothing parked is lost or started twice; a superseded run never
starts; every fence is larger than every fence of the key before it. At the end of each example every key
is drained (holds released, handoffs claimed) and every run must have run exactly once, unless it was
superseded, revoked, refused or timed out.

Expiry: a crash is modelled as the holder's lease running out on the server's clock (its ``expires_at``,
or its slot's ``x``, set in the past: what the server sees when the holder stopped renewing), and
``lapse`` takes a lease of 0.5 s and waits (bounded) until the server reports it expired; a parked run's
deadline and a debounce end the same way (their times set in the past). Every other lease is long
(10 min), and the TTL index is dropped (MongoDB's monitor would delete idle documents at times of its
own), so the model decides every outcome.

``MONGOLOCK_MODEL_EXAMPLES`` (default 12) sets the number of examples; ``scripts/soak.py --model`` runs
many more, from a seed of its own. ``MONGOLOCK_MODEL_MIXED=1`` puts the mixed key in every example.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as _dt
import os
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import event as _event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)
from pymongo import MongoClient, WriteConcern

from celery_mongolock import Lease, LeaseLost, LeaseStore
from celery_mongolock.core.documents.queue import gc_stage
from celery_mongolock.testing import wait_for

#: Examples per run (the test's bound in ``make test``; ``scripts/soak.py --model`` raises it).
EXAMPLES = int(os.environ.get("MONGOLOCK_MODEL_EXAMPLES", "12"))
#: ``MONGOLOCK_MODEL_SEED``: explore from this seed (with pytest's ``--hypothesis-seed``, as
#: ``scripts/soak.py --model`` runs it) instead of the fixed, reproducible examples of ``make test``.
SEED = os.environ.get("MONGOLOCK_MODEL_SEED")
#: Steps per example.
STEPS = int(os.environ.get("MONGOLOCK_MODEL_STEPS", "40"))
#: Hypothesis phases (``MONGOLOCK_MODEL_SHRINK=0``: report the first failure as found, unshrunk).
PHASES = [Phase.explicit, Phase.reuse, Phase.generate] + (
    [Phase.shrink] if os.environ.get("MONGOLOCK_MODEL_SHRINK", "1") != "0" else []
)
#: Runs sent per example at most (the queues stay short enough to drain quickly at the end).
MAX_RUNS = int(os.environ.get("MONGOLOCK_MODEL_RUNS", "16"))
#: Seconds of every lease that is not meant to lapse: no example comes near it.
LONG = 600.0
#: The shortest lease the store accepts (``lapse``).
SHORT = 0.5
PAST = _dt.datetime(2000, 1, 1, tzinfo=_dt.timezone.utc)

#: The keys of an example: name -> (limit, replace, debounce). Each key is used by one kind of task only,
#: except the mixed key's two (``MIXED``).
KEYS: dict[str, tuple[int, bool, bool]] = {
    "queue-1": (1, False, False),
    "queue-2": (2, False, False),
    "replace-1": (1, True, False),
    "replace-3": (3, True, False),
    "debounce-1": (1, True, True),
    "debounce-2": (2, True, True),
    "held-2": (2, False, False),
    "set-2": (2, True, False),
    "mixed-one": (1, False, False),
    "mixed-slots": (2, False, False),
    "mixed-r-one": (1, False, False),
    "mixed-r-slots": (3, True, False),
}
#: The mixed keys: one document taken by runs and plain acquirers of two kinds, as a single lease (its
#: model ``mixed-one``: ``Queue`` runs) and as ``limit=2`` slots (``mixed-slots``: ``Queue`` runs); or as
#: ``limit=3`` slots by ``Replace`` runs (``mixed-r-slots``, beside ``Queue`` runs of a single lease,
#: ``mixed-r-one``).
#: Each kind's model is a key of the example of its own (its runs, its holds, its parked runs: never both
#: kinds parked at once), paired with the other's (``KeyModel.pair``): document -> (the single lease's
#: model, the slots' model).
MIXED: dict[str, tuple[str, str]] = {
    "mixed": ("mixed-one", "mixed-slots"),
    "mixed-r": ("mixed-r-one", "mixed-r-slots"),
}
#: What an example's keys are drawn from: the keys, the mixed key as one.
KEY_CHOICES = sorted(
    {name for name in KEYS if not any(name in kinds for kinds in MIXED.values())} | set(MIXED)
)
#: ``MONGOLOCK_MODEL_MIXED=1``: every example has the mixed key (a soak of the mixed kinds).
ALWAYS_MIXED = os.environ.get("MONGOLOCK_MODEL_MIXED") == "1"
#: Keys whose runs are several-keys ``Replace`` runs with a limit on this key (``keys=`` with a limit per
#: key): each run carries its set of keys (``g``, one of two sets, by its stamp's parity; ``ks``), a newer
#: send supersedes only the older runs of its own set (``core.documents.slot_sets``).
SET_KEYS = {"set-2"}
#: Keys whose runs are ``Replace(cancel_running=True)`` runs: a send that parks behind the key's running
#: holder marks it superseded (``cx``), and a run that claims the key with a newer send parked is marked by
#: its claim (``core.documents.queue.cancel_mark``). The model says which holder and by whom.
CANCEL_KEYS = {"replace-1"}
#: Keys whose runs and plain acquirers take their slots with a minimum hold (``min_hold_seconds``) of
#: ``LONG``: a slot released before it stays taken until the rule ``crash`` ends the hold.
MIN_HOLD_KEYS = {"held-2"}
#: ``Replace(debounce=...)``: seconds (the model ends a debounce by moving its time into the past).
DEBOUNCE = 3600.0


#: What the examples did (``MONGOLOCK_MODEL_STATS=1`` prints it): a check that the rules reach the states
#: that matter (handoffs, claims, supersessions, takeovers).
STATS: collections.Counter[str] = collections.Counter()


def event(what: str) -> None:
    STATS[what] += 1
    _event(what)


# -- the reference model -------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class Run:
    """One run (one delivery of one task message) of a queued task on one key."""

    key: str
    tid: str
    s: int  # send stamp
    tk: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)  # its handoff token
    # parked, handed, running, done, ended (its lease expired or was released for it), superseded,
    # revoked, refused (full), timedout (parked past its deadline)
    state: str = "new"
    starts: int = 0
    superseded_by: str | None = None
    handed_before: bool = False
    hands: int = 0  # times it was handed the key (the handoff's attempt ``hn`` counts them)
    past_deadline: bool = False  # parked past its Queue(timeout=...): it must never be handed the key
    due: bool = True  # Replace(debounce=...): False until its debounce is over (then it may start)
    g: str | None = None  # its set of keys (``SET_KEYS``)
    pr: int = 0  # its rank (its message priority as the broker orders it): lower first in the key's queue

    @property
    def rid(self) -> str:
        return f"{self.tid}/0"

    def order(self) -> tuple[int, int, str]:
        """Its place in a key's queue: rank, then send order."""
        return (self.pr, self.s, self.rid)

    def sent(self) -> tuple[int, str]:
        """Send order (supersession by a newer send of its set)."""
        return (self.s, self.rid)

    def entry(self) -> dict[str, Any]:
        e = {"id": self.rid, "t": self.tid, "n": "model", "r": "0", "s": self.s, "tk": self.tk, "m": b"m"}
        if self.pr:
            e["pr"] = self.pr
        if self.g is not None:  # a several-keys run: its set's signature and its keys
            e.update(g=self.g, ks=[self.key, f"other:{self.g}"])
        return e


@dataclasses.dataclass(eq=False)
class Hold:
    """A hold of a key: a lease (a run's, or a plain acquirer's) or a handoff not yet claimed."""

    token: str
    run: Run | None
    handed: bool
    fence: int = 0
    lease: Lease | None = dataclasses.field(default=None, repr=False)
    expired: bool = False
    lost: bool = False  # its Lease saw a renewal fail: it releases nothing any more
    released: bool = False  # released inside its minimum hold: kept (not renewed) until the hold ends
    published: bool = True  # (a handoff) its run's message is out: else the sweeper publishes it
    # Its process is gone (``lapse``): its Lease object is never touched again (past its local deadline a
    # Lease marks itself lost when looked at and releases its token in the background, at a time of its
    # own).
    dead: bool = False

    def describe(self) -> str:
        who = self.run.tid if self.run else "plain"
        what = "handoff" if self.handed else "lease"
        state = ", released" if self.released else ""
        return f"{what}({who}, f={self.fence}{', expired' if self.expired else ''}{state})"


def before(a: Run, b: Run) -> bool:
    """``a`` is ahead of ``b`` in a key's queue."""
    return a.order() < b.order()


def sent_before(a: Run, b: Run) -> bool:
    return a.sent() < b.sent()


def in_order(q: list[Run], run: Run) -> list[Run]:
    """The engine's insertion of a parked run: those that sort before it, it, the rest (each in place)."""
    return [r for r in q if before(r, run)] + [run] + [r for r in q if not before(r, run)]


class KeyModel:
    """What the engine should hold for one key."""

    def __init__(self, name: str, limit: int, replace: bool, debounce: bool) -> None:
        self.name, self.limit, self.replace, self.debounce = name, limit, replace, debounce
        self.min_hold = name in MIN_HOLD_KEYS
        self.holds: list[Hold] = []  # in the document's order (``hs``); a single key has at most one
        self.q: list[Run] = []
        self.last_s = -1  # Replace: the newest send that got the key
        self.last_t = ""
        self.sup: list[tuple[str, str]] = []  # Replace: (superseded, by), results not yet written
        self.cx: tuple[str, str] | None = None  # Replace(cancel_running=True): (holder's token, by)
        self.seen: list[str] = []  # runs that ended with a normal release
        self.dead: list[Run] = []  # runs parked past their deadline, results not yet written
        self._fence = [0]  # (a list: the two kinds of a mixed key share it)
        self.sets = name in SET_KEYS
        self.lg: dict[str, tuple[int, str]] = {}  # (sets) per set: the newest send that got the key
        self.key = name  # the document's ``_id`` (a mixed key: both kinds' models name the one document)
        self.other: KeyModel | None = None  # (a mixed key) the model of its other kind

    @property
    def max_fence(self) -> int:
        return self._fence[0]

    @max_fence.setter
    def max_fence(self, fence: int) -> None:
        self._fence[0] = fence

    def pair(self, slots: KeyModel, key: str) -> None:
        """A mixed key (``MIXED``): this single lease's model and ``slots``' name one document, ``key``;
        they share what the document keeps once for both (the fence, the runs over, the results not yet
        written)."""
        self.key = slots.key = key
        slots._fence, slots.seen, slots.dead, slots.sup = self._fence, self.seen, self.dead, self.sup
        self.other, slots.other = slots, self

    @property
    def single(self) -> bool:
        return self.limit == 1

    # the state as the engine's pipelines see it
    def held_or_handed(self) -> bool:
        """A hold of this kind is live or handed (a single key: ``SINGLE_HELD``; slots: not
        ``NO_SLOT_HELD``)."""
        return any(not h.expired or h.handed for h in self.holds)

    def in_use(self) -> bool:
        """(A mixed key) in use as this kind: held or handed, or runs of this kind parked
        (``key_state.SINGLE_IN_USE``, ``SLOTS_IN_USE``)."""
        return self.held_or_handed() or bool(self.q)

    def other_in_use(self) -> bool:
        """(A mixed key) in use as the other kind: a run of this kind is refused ``mixed``, parks nothing,
        and is handed nothing."""
        return self.other is not None and self.other.in_use()

    def vacant(self) -> bool:
        """(Single key) nobody holds it: no owner, or the owner's lease or handoff has expired (a mixed key:
        and no slot is live or handed, ``key_state.VACANT``)."""
        mine = not self.holds or self.holds[0].expired
        return mine and not (self.other is not None and self.other.held_or_handed())

    def handoff(self) -> Hold | None:
        return next((h for h in self.holds if h.handed), None)

    def waits(self) -> bool:
        """Something waits on the key (``wq``): parked runs, a handoff, superseded runs' results."""
        return bool(self.q) or any(h.handed for h in self.holds) or bool(self.sup) or bool(self.dead)

    def live(self) -> list[Hold]:
        return [h for h in self.holds if not h.expired]

    # transitions shared by several operations
    def drop(self, hold: Hold, how: str) -> None:
        self.holds.remove(hold)
        if hold.run is not None and not hold.handed and hold.run.state == "running":
            hold.run.state = how

    def hand_single(self) -> list[Hold]:
        """After a release, or for a key found vacant: the oldest parked run (a pending handoff first) is
        handed the key."""
        ho = self.handoff()
        if not (self.vacant() and (ho is not None or self.q)):
            return []
        queue = ([ho.run] if ho is not None and ho.run is not None else []) + self.q
        live = self.time_out(queue)
        if not live or not live[0].due:  # nobody to hand the key to (yet: a debounce not over)
            assert ho is None
            self.q = live
            return []
        for h in list(self.holds):
            self.drop(h, "ended")
        head, self.q = live[0], live[1:]
        return [self._hand(head)]

    def time_out(self, queue: list[Run]) -> list[Run]:
        """Runs of ``queue`` past their deadline move to ``dead``; the others are returned."""
        for r in queue:
            if r.past_deadline:
                r.state = "timedout"
                self.dead.append(r)
        return [r for r in queue if not r.past_deadline]

    def _hand(self, run: Run) -> Hold:
        hold = Hold(run.tk, run, handed=True)
        self.holds.append(hold)
        run.state = "handed"
        run.hands += 1
        return hold

    def normalize(self, keep: Hold | None = None) -> None:
        """(Slots) expired holds leave; a handed one's run goes back to the front of the queue; parked runs
        past their deadline leave the queue (a mixed key: the runs of a single lease parked too, the
        document's one queue)."""
        if self.other is not None:
            self.other.q = self.time_out(self.other.q)
        gone = [h for h in self.holds if h.expired and h is not keep]
        for h in gone:
            self.drop(h, "ended")
        returned = [h.run for h in gone if h.handed and h.run is not None]
        for r in returned:
            r.state = "parked"
        q = [r for r in returned if r.g is None] + self.q
        for r in returned:  # a several-keys run's reservation goes back in send order
            if r.g is not None:
                q = in_order(q, r)
        self.q = self.time_out(q)

    def fill(self) -> list[Hold]:
        """(Slots) every free slot goes to the oldest due parked run, in queue order (a mixed key: none
        while it is in use as a single lease)."""
        if self.other_in_use():
            return []
        due = [r for r in self.q if r.due]
        handed = due[: max(0, min(self.limit - len(self.holds), len(due)))]
        self.q = [r for r in self.q if r not in handed]
        return [self._hand(r) for r in handed]

    def newer_of_set(self, run: Run) -> list[tuple[int, str]]:
        """(sets) The sends of ``run``'s set newer than it the key knows: ``lg``, parked, handed."""
        lg = [self.lg[run.g]] if run.g in self.lg else []
        handed = [
            (h.run.s, h.run.tid) for h in self.holds if h.handed and h.run is not None and h.run.g == run.g
        ]
        parked = [(r.s, r.tid) for r in self.q if r.g == run.g]
        return [(s, t) for s, t in lg + parked + handed if s > run.s]

    def take_back(self, run: Run) -> None:
        """(sets) ``run`` parks, takes, claims or is due a slot: the older runs of its set leave the key
        (parked, or handed a slot not yet claimed: the slot is freed)."""
        if not self.sets:
            return
        parked = [r for r in self.q if r.g == run.g and sent_before(r, run)]
        holds = [
            h
            for h in self.holds
            if h.handed and h.run is not None and h.run.g == run.g and sent_before(h.run, run)
        ]
        for old in parked + [h.run for h in holds if h.run is not None]:
            old.state, old.superseded_by = "superseded", run.tid
            self.sup.append((old.tid, run.tid))
        self.q = [r for r in self.q if r not in parked]
        self.holds = [h for h in self.holds if h not in holds]
        if parked:
            event("sets: parked runs of the set superseded")
        if holds:
            event("sets: slots handed to older runs of the set taken back")

    def superseded(self, run: Run) -> bool:
        if self.sets:
            return bool(self.newer_of_set(run))
        if not self.replace:
            return False
        handed_s = [h.run.s for h in self.holds if h.handed and h.run is not None]
        return self.last_s > run.s or any(r.s > run.s for r in self.q) or any(s > run.s for s in handed_s)

    def copy_outcome(self, run: Run) -> str | None:
        """The outcome for a copy of a run the key knows (dup, done, running), else None."""
        handed_runs = [h.run for h in self.holds if h.handed]
        if run in self.q or run in handed_runs or run in self.dead:
            return "dup"
        if run.rid in self.seen:
            return "done"
        running = [h.run for h in self.holds if not h.handed and (self.single or not h.expired)]
        if self.single and self.vacant():
            running = []
        if run in running:
            return "running"
        return None

    def took(self, run: Run) -> None:
        if self.sets:
            if run.g is not None and run.s > self.lg.get(run.g, (-1, ""))[0]:
                self.lg[run.g] = (run.s, run.tid)
            return
        if self.replace and run.s > self.last_s:
            self.last_s, self.last_t = run.s, run.tid

    def park(self, run: Run) -> None:
        run.state = "parked"
        if self.replace and not self.sets:
            for old in self.q:
                old.state, old.superseded_by = "superseded", run.tid
                self.sup.append((old.tid, run.tid))
            self.q = [run]
        else:
            self.q = in_order(self.q, run)


# -- the machine -------------------------------------------------------------------------------------
class Published:
    """The handoffs the store published (``add_handoff_callback``): run, fence, attempt."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int, int]] = []

    def __call__(self, key: str, ho: dict[str, Any], doc: dict[str, Any]) -> None:
        fence = doc.get("fence")
        for h in doc.get("hs") or []:
            if h.get("o") == ho.get("tk"):
                fence = h.get("f")
        self.seen.append((key, str(ho["t"]), int(fence or 0), int(ho.get("hn") or 0)))

    def take(self) -> list[tuple[str, str, int, int]]:
        out, self.seen = self.seen, []
        return out


#: The client of every example (set by the test; not a class attribute: hypothesis looks through those
#: for rules, and a MongoClient answers any attribute name with a database).
CLIENT: list[MongoClient[dict[str, Any]]] = []


class EngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.client = CLIENT[0]
        self.db_name = f"mongolock_model_{uuid.uuid4().hex[:12]}"
        # (Acknowledged writes without waiting for the journal: the engine's commands are what is tested
        # here, and a journal flush per command would cost most of the run.)
        self.store = LeaseStore(
            self.client,
            database=self.db_name,
            lease_seconds=LONG,
            history_days=0,
            write_concern=WriteConcern(w=1),
        )
        self.published = Published()
        self.store.add_handoff_callback(self.published)
        self.keys = {name: KeyModel(name, *spec) for name, spec in KEYS.items()}
        for key, (one, slots) in MIXED.items():
            self.keys[one].pair(self.keys[slots], key)
        self.runs: list[Run] = []
        self.lapses = 0
        self.leases: list[tuple[KeyModel, Hold]] = []  # every lease taken, until released
        self.clean = False  # set after each step's checks passed: the drain at teardown runs only then

    # -- helpers -------------------------------------------------------------------------------------
    def _limit(self, km: KeyModel) -> int | None:
        return None if km.single else km.limit

    @staticmethod
    def _hold_s(km: KeyModel) -> float:
        return LONG if km.min_hold else 0.0

    @staticmethod
    def _released(km: KeyModel, hold: Hold) -> None:
        """``hold``'s run released it: it leaves, or, inside its minimum hold, stays (released) until the
        hold ends (a release of an expired hold keeps it too: the hold ends later than the lease)."""
        if km.min_hold:
            hold.released, hold.expired = True, False
        else:
            km.holds.remove(hold)

    def _new_fence(self, km: KeyModel, fence: int, what: str) -> None:
        assert fence > km.max_fence, f"{km.name}: {what} got fence {fence}, not above {km.max_fence}"
        km.max_fence = fence

    def _handoffs(self, km: KeyModel, expected: list[Hold]) -> None:
        """The handoffs the command published are the model's, in order, each with a larger fence."""
        got = self.published.take()
        # (A pending handoff is never published again by a later command of another author: an admit
        # marks its handoffs apart from its own token, test_a_pending_slot_handoff_is_published_once.)
        for _, _, _, attempt in got:
            event(f"handoff ({'first' if attempt == 1 else 'again'}, {'single' if km.single else 'slots'})")
        assert [(k, t) for k, t, _, _ in got] == [(km.key, h.run.tid if h.run else "") for h in expected], (
            f"{km.name}: handed {[t for _, t, _, _ in got]}, the model expected "
            f"{[h.run.tid if h.run else '' for h in expected]}"
        )
        for (_, tid, fence, attempt), hold in zip(got, expected, strict=True):
            assert hold.run is not None
            assert attempt == hold.run.hands, (
                f"{tid}: handoff attempt {attempt}, handed {hold.run.hands} times"
            )
            if not hold.published:  # made by a background release, adopted by the sweeper now
                assert fence == hold.fence
                hold.published = True
            else:
                self._in_send_order(km, hold.run, attempt)
                self._new_fence(km, fence, f"the handoff to {tid}")
                hold.fence = fence
            hold.run.handed_before = True

    @staticmethod
    def _in_send_order(km: KeyModel, run: Run, attempt: int) -> None:
        """Send order: a first handoff goes to a run older than every run still parked that was never
        handed (a run handed before keeps its place at the front)."""
        if attempt == 1 and not run.handed_before:
            fresh = [r for r in km.q if not r.handed_before and not r.past_deadline]
            assert all(before(run, r) for r in fresh), f"{run.tid} handed before older parked runs"

    def _took(self, km: KeyModel, hold: Hold, lease: Lease | None, claimed: bool = False) -> None:
        assert lease is not None, f"{km.name}: the model expected {hold.describe()} to be taken"
        hold.lease, hold.token = lease, lease.owner
        self.leases.append((km, hold))
        if claimed:
            assert lease.fence == hold.fence, "a claim keeps the fence of its handoff"
        else:
            self._new_fence(km, lease.fence, "an acquisition")
            hold.fence = lease.fence
        run = hold.run
        if run is not None:
            assert run.superseded_by is None, f"{run.tid}, superseded by {run.superseded_by}, started"
            run.starts += 1
            assert run.starts == 1, f"{run.tid} started twice"
            run.state = "running"

    def _doc(self, km: KeyModel) -> dict[str, Any] | None:
        docs = list(
            self.store.collection.aggregate([{"$match": {"_id": km.key}}, {"$addFields": {"__now": "$$NOW"}}])
        )
        return docs[0] if docs else None

    def _check(self, km: KeyModel, view: bool = False) -> None:
        """The key's document matches the model, and the invariants hold; ``view``: ``inspect`` (the
        operators' view) too (a round trip more: at sweeps and at the end of each example)."""
        if km.other is not None:
            self._check_mixed(km, view)
            return
        doc = self._doc(km)
        if doc is None:
            # Never written (the TTL index is dropped: nothing deletes a document here).
            assert not km.holds and not km.waits() and not km.seen and not km.max_fence, f"{km.name}: gone"
            return
        now = doc["__now"]
        # Never more live holds than the limit, and never a single lease and slots at once.
        live_slots = [h for h in doc.get("hs") or [] if h["x"] > now]
        single_live = (
            doc.get("owner") is not None and doc.get("expires_at") is not None and doc["expires_at"] > now
        )
        assert len(live_slots) + int(single_live) <= km.limit, f"{km.name}: more holds than {km.limit}"
        assert not (doc.get("owner") is not None and doc.get("hs")), f"{km.name}: a single lease beside slots"
        parked = [e["t"] for e in doc.get("q") or []]
        assert parked == [r.tid for r in km.q], (
            f"{km.name}: parked {parked}, the model {[r.tid for r in km.q]}"
        )
        assert doc.get("qk") == (("one" if km.single else "slots") if km.q else None), (
            f"{km.name}: the kind of the runs parked is {doc.get('qk')}, the model {[r.tid for r in km.q]}"
        )
        if view:
            info = self.store.inspect(km.name)
            assert info is not None
            assert info.held == bool(km.live())
            assert len(info.slots) == (0 if km.single else len(km.live())) <= km.limit
            assert [p["task_id"] for p in info.parked] == parked
            first = km.handoff()
            assert (info.handoff or {}).get("task_id") == (first.run.tid if first and first.run else None)
        # The holds, in order, exactly as the model has them.
        if km.single:
            store_holds = []
            if doc.get("owner") is not None:
                ho = doc.get("ho") or {}
                handed = ho.get("tk") == doc["owner"]
                store_holds.append(
                    (
                        doc["owner"],
                        ho.get("t") if handed else None,
                        doc["expires_at"] <= now,
                        doc.get("fence"),
                    )
                )
            assert doc.get("ho") is None or doc.get("owner") == doc["ho"].get("tk"), (
                "a handoff without its owner"
            )
        else:
            store_holds = [
                (h["o"], (h.get("ho") or {}).get("t"), h["x"] <= now, h.get("f")) for h in doc.get("hs") or []
            ]
        model_holds = [
            (h.token, h.run.tid if h.handed and h.run else None, h.expired, h.fence) for h in km.holds
        ]
        assert store_holds == model_holds, (
            f"{km.name}: the store holds {store_holds}, the model {model_holds}"
        )
        assert [(s["t"], s["by"]) for s in doc.get("sup") or []] == km.sup
        if km.name in CANCEL_KEYS:
            mark = doc.get("cx")
            assert ((mark["o"], mark["t"]) if mark else None) == km.cx, (
                f"{km.name}: the holder marked superseded {mark}, the model {km.cx}"
            )
        assert list(doc.get("seen") or []) == km.seen
        assert [d["t"] for d in doc.get("dead") or []] == [r.tid for r in km.dead]
        assert int(doc.get("fence") or 0) == km.max_fence, "a fence was given that nobody saw"
        assert len(km.live()) <= km.limit

    def _check_mixed(self, km: KeyModel, view: bool) -> None:
        """``_check`` of the mixed key: its document against both kinds' models (the single lease's fields
        against ``mixed-one``, ``hs`` against ``mixed-slots``), and never both kinds in use at once."""
        assert km.other is not None
        one, slots = (km, km.other) if km.single else (km.other, km)
        doc = self._doc(km)
        if doc is None:
            assert not (one.holds or slots.holds or one.waits() or slots.waits()), f"{km.key}: gone"
            assert not km.seen and not km.max_fence, f"{km.key}: gone"
            return
        now = doc["__now"]
        hs = doc.get("hs") or []
        # Never a single lease and slots at once: not held (or handed) as both kinds, nor runs of both
        # kinds parked; never more live slots than the limit.
        slot_held = [h for h in hs if h["x"] > now or h.get("ho") is not None]
        single_held = doc.get("owner") is not None and (doc["expires_at"] > now or doc.get("ho") is not None)
        assert not (single_held and slot_held), f"{km.key}: a single lease beside slots"
        assert len([h for h in hs if h["x"] > now]) <= slots.limit, f"{km.key}: more slots than {slots.limit}"
        assert not (one.q and slots.q), f"{km.key}: the model parked runs of both kinds"
        assert not (one.held_or_handed() and slots.held_or_handed()), f"{km.key}: the model holds both kinds"
        parked = [e["t"] for e in doc.get("q") or []]
        model_q = one.q + slots.q
        assert parked == [r.tid for r in model_q], (
            f"{km.key}: parked {parked}, the model {[r.tid for r in model_q]}"
        )
        kind = "one" if one.q else "slots" if slots.q else None
        assert doc.get("qk") == kind, f"{km.key}: the kind of the runs parked is {doc.get('qk')}, not {kind}"
        if view:
            info = self.store.inspect(km.key)
            assert info is not None
            assert info.held == bool(one.live() or slots.live())
            assert len(info.slots) == len(slots.live()) <= slots.limit
            assert [p["task_id"] for p in info.parked] == parked
            first = one.handoff() or slots.handoff()
            assert (info.handoff or {}).get("task_id") == (first.run.tid if first and first.run else None)
        # The single lease (its fence is the key's when it was taken: the slots taken since have larger
        # ones, checked as they were given), and the slots, in order, exactly as the models have them.
        store_one = []
        if doc.get("owner") is not None:
            ho = doc.get("ho") or {}
            handed = ho.get("tk") == doc["owner"]
            store_one.append((doc["owner"], ho.get("t") if handed else None, doc["expires_at"] <= now))
        assert doc.get("ho") is None or doc.get("owner") == doc["ho"].get("tk"), "a handoff without its owner"
        model_one = [(h.token, h.run.tid if h.handed and h.run else None, h.expired) for h in one.holds]
        assert store_one == model_one, f"{km.key}: the single lease is {store_one}, the model {model_one}"
        store_slots = [(h["o"], (h.get("ho") or {}).get("t"), h["x"] <= now, h.get("f")) for h in hs]
        model_slots = [
            (h.token, h.run.tid if h.handed and h.run else None, h.expired, h.fence) for h in slots.holds
        ]
        assert store_slots == model_slots, f"{km.key}: the slots are {store_slots}, the model {model_slots}"
        assert [(s["t"], s["by"]) for s in doc.get("sup") or []] == km.sup
        assert list(doc.get("seen") or []) == km.seen
        assert [d["t"] for d in doc.get("dead") or []] == [r.tid for r in km.dead]
        assert int(doc.get("fence") or 0) == km.max_fence, "a fence was given that nobody saw"

    @staticmethod
    def _mixed_events(km: KeyModel) -> None:
        """(The mixed key) the states of both kinds in one document the examples reach."""
        assert km.other is not None
        one, slots = (km, km.other) if km.single else (km.other, km)
        if one.held_or_handed() and slots.holds:
            event("mixed: a single lease beside expired slot holds")
        if slots.held_or_handed() and one.holds:
            event("mixed: slots beside an expired single lease")
        if one.q and slots.holds:
            event("mixed: runs of a single lease parked beside slot holds")
        if one.handoff() is not None and slots.holds:
            event("mixed: a single lease handed beside slot holds")

    def _check_runs(self) -> None:
        for run in self.runs:
            assert run.starts <= 1, f"{run.tid} started {run.starts} times"
            if run.superseded_by is not None:
                assert run.starts == 0, f"the superseded {run.tid} started"
            km = self.keys[run.key]
            parked = run in km.q
            handed = any(h.run is run and h.handed for h in km.holds)
            assert (run.state == "parked") == parked and (run.state == "handed") == handed, (
                f"{run.tid} is {run.state} in the model's bookkeeping"
            )
        for km in self.keys.values():
            assert len({id(r) for r in km.q}) == len(km.q), "a run parked twice"

    def _step_done(self, *kms: KeyModel) -> None:
        for km in kms:
            self._check(km)
            if km.other is not None:
                self._mixed_events(km)
        self._check_runs()
        assert self.published.take() == [], "a handoff the model did not expect"
        self.clean = True

    def _expire(self, km: KeyModel, hold: Hold) -> None:
        """End ``hold`` on the server's clock, as if its holder (or the handed run) stopped renewing."""
        # The document as the engine would have left it had the time passed: the derived fields (a
        # slotted key's latest expiry ``sx``, the TTL index's ``gc_at``) follow.
        if km.single:
            match = {"_id": km.key, "owner": hold.token}
            update = [{"$set": {"expires_at": PAST}}, gc_stage()]
        else:
            past = {"$cond": [{"$eq": ["$$h.o", hold.token]}, PAST, "$$h.x"]}
            hs = {"$map": {"input": "$hs", "as": "h", "in": {"$mergeObjects": ["$$h", {"x": past}]}}}
            latest = {"$max": {"$map": {"input": "$hs", "as": "h", "in": "$$h.x"}}}
            match = {"_id": km.key, "hs.o": hold.token}
            update = [{"$set": {"hs": hs}}, {"$set": {"sx": latest}}, gc_stage()]
        result = self.store.collection.update_one(match, update)
        assert result.matched_count == 1
        hold.expired = True

    # -- operations (each predicts with the model, runs the real operation, compares) ----------------
    def do_send(self, km: KeyModel, run: Run, cap: int | None = None) -> None:
        """A run of the key's queued task arrives: it takes the key, parks, or is superseded (or refused:
        ``cap``, the task's ``max_length``)."""
        self.clean = False
        cancel = km.name in CANCEL_KEYS
        # (cancel_running: the running holder before this send, a lease that is neither handed nor expired)
        running = km.holds[0] if km.single and km.holds and not km.holds[0].expired else None
        running = running if running is not None and not running.handed else None
        if km.single:
            expected, hold, handed = self._predict_send_single(km, run, cap)
        else:
            expected, hold, handed = self._predict_send_slots(km, run, cap)
        if cancel and expected == "parked" and running is not None and (km.cx or ("",))[0] != running.token:
            km.cx = (running.token, run.tid)
            event("send: marks the running holder superseded")
        lease, doc = self.store.admit(
            km.key,
            run.entry(),
            ttl=LONG,
            limit=self._limit(km),
            replace=km.replace,
            max_length=cap,
            timeout=LONG,  # a deadline far away, moved into the past by ``deadline_passes``
            debounce=DEBOUNCE if km.debounce else None,
            min_hold=self._hold_s(km),
            group=run.g,
            cancel=cancel,
        )
        assert doc.get("lo") == expected, (
            f"{km.name}: {run.tid} was {doc.get('lo')}, the model says {expected}"
        )
        event(f"send: {expected}")
        if km.other is not None:
            event(f"send ({km.name}): {expected}")
        if expected == "acquired":
            assert hold is not None
            self._took(km, hold, lease)
        else:
            assert lease is None
        if expected == "superseded":
            assert run.superseded_by is not None and doc.get("lo_by") == run.superseded_by
        self._handoffs(km, handed)
        self._step_done(km)

    def _predict_send_single(
        self, km: KeyModel, run: Run, cap: int | None
    ) -> tuple[str, Hold | None, list[Hold]]:
        copy = km.copy_outcome(run)
        if copy is not None:
            return copy, None, []
        if km.other_in_use():  # (judged before a newer send: ``admit_stages.judge``)
            run.state = "mixed"
            return "mixed", None, []
        if km.superseded(run):
            run.state = "superseded"
            run.superseded_by = self._newer_than(km, run)
            return "superseded", None, []
        live = [r for r in km.q if not r.past_deadline]
        free = km.vacant() and km.handoff() is None
        if free and not km.debounce and not any(before(r, run) for r in live):
            for h in list(km.holds):
                km.drop(h, "ended")
            hold = Hold("", run, handed=False)
            km.holds.append(hold)
            km.took(run)
            return "acquired", hold, []
        if not km.vacant() and cap is not None and len(km.q) >= cap:
            run.state = "refused"
            return "full", None, []
        km.park(run)
        return "parked", None, km.hand_single()

    def _predict_send_slots(
        self, km: KeyModel, run: Run, cap: int | None
    ) -> tuple[str, Hold | None, list[Hold]]:
        km.normalize()
        copy = km.copy_outcome(run)
        outcome: str
        hold = None
        if copy is not None:
            outcome = copy
        elif km.other_in_use():  # (judged before a newer send: ``admit_stages.judge``; no sets here)
            run.state = "mixed"
            outcome = "mixed"
        elif km.superseded(run):
            run.state = "superseded"
            run.superseded_by = self._newer_than(km, run)
            outcome = "superseded"
        elif len(km.holds) < km.limit and not km.debounce and not any(before(r, run) for r in km.q):
            km.take_back(run)
            hold = Hold("", run, handed=False)
            km.holds.append(hold)
            km.took(run)
            outcome = "acquired"
        elif len(km.holds) >= km.limit and cap is not None and len(km.q) >= cap:
            run.state = "refused"
            outcome = "full"
        else:
            km.take_back(run)
            km.park(run)
            outcome = "parked"
        return outcome, hold, km.fill()

    def _newer_than(self, km: KeyModel, run: Run) -> str:
        """Who supersedes ``run`` (the engine's ``lo_by``, ``admit_stages.replace_fields``): the newest of
        the newer sends the key knows, the first of equals in the order: the last send that got the key
        (``last``), the parked runs, the handed ones (sets: of its own set, ``lg``, parked, handed)."""
        handed = [h.run for h in km.holds if h.handed and h.run is not None]
        if km.sets:
            newer = km.newer_of_set(run)
        else:
            known = [(km.last_s, km.last_t)] + [(r.s, r.tid) for r in km.q + handed]
            newer = [(s_, t) for s_, t in known if s_ > run.s and t != run.tid]
        best: tuple[int, str] = (-1, "")
        for s_, t in newer:
            if s_ > best[0]:
                best = (s_, t)
        by = best[1]
        sent_later = {r.tid for r in self.runs if r.key == km.name and r.s > run.s}
        assert by in sent_later, (
            f"{km.name}: {run.tid} (sent at {run.s}) would be superseded by {by}, not newer"
        )
        return by

    @staticmethod
    def _plain_free(km: KeyModel) -> bool:
        """A plain acquire would take the key: nobody holds it (slots: fewer than N live or handed
        holds) and no run is parked or handed it."""
        parked = bool(km.q) or (km.other is not None and bool(km.other.q))
        if km.single:
            return km.vacant() and km.handoff() is None and not parked
        taken = len([h for h in km.holds if not h.expired or h.handed])
        return taken < km.limit and not parked and not (km.other is not None and km.other.held_or_handed())

    def do_acquire(self, km: KeyModel) -> None:
        """A plain acquire (a task with Retry/Skip, or code outside Celery)."""
        self.clean = False
        hold = Hold("", None, handed=False)
        free = self._plain_free(km)
        if km.single:
            if free:
                for h in list(km.holds):
                    km.drop(h, "ended")
        else:
            for h in [h for h in km.holds if h.expired and not h.handed]:
                km.drop(h, "ended")
        lease = self.store.acquire(km.key, LONG, limit=self._limit(km), min_hold=self._hold_s(km))
        if km.other is not None:
            event(f"acquire ({km.name}): {'taken' if free else 'refused'}")
        if free:
            km.holds.append(hold)
            self._took(km, hold, lease)
        else:
            assert lease is None, f"{km.name}: a plain acquire took the key the model says is not free"
        self._step_done(km)

    def do_release(self, km: KeyModel, hold: Hold) -> None:
        """The holder releases (also a holder whose lease expired meanwhile: a paused one)."""
        self.clean = False
        assert hold.lease is not None
        handed: list[Hold] = []
        if hold.lost or hold not in km.holds or hold.released:
            expected = False
        else:
            expected = True
            self._released(km, hold)
            if hold.run is not None:
                km.seen.append(hold.run.rid)
                hold.run.state = "done"
            if km.single:
                handed = km.hand_single()
            else:
                km.normalize()
                handed = km.fill()
        released = hold.lease.release()
        assert released == expected, f"{km.name}: release of {hold.describe()} gave {released}"
        event(f"release: {released}{' (expired)' if hold.expired else ''}")
        hold.lease = None
        self._handoffs(km, handed)
        self._step_done(km)

    def do_claim(self, km: KeyModel, run: Run) -> None:
        """The handed run's message comes back: it claims the key (or finds it is a stale copy)."""
        self.clean = False
        mine = next((h for h in km.holds if h.handed and h.token == run.tk), None)
        if not km.single:
            km.normalize(keep=mine)
        handed: list[Hold] = []
        if mine is not None:
            expected = "claimed"
            mine.handed, mine.expired = False, False
            km.take_back(run)
        else:
            expected = km.copy_outcome(run) or ("superseded" if km.sets and km.superseded(run) else "stale")
        if not km.single:
            handed = km.fill()
        lease, doc = self.store.admit(
            km.key,
            run.entry(),
            ttl=LONG,
            claim=run.tk,
            limit=self._limit(km),
            replace=km.replace,
            min_hold=self._hold_s(km),
            group=run.g,
            cancel=km.name in CANCEL_KEYS,
        )
        assert doc.get("lo") == expected, f"{km.name}: claim of {run.tid} was {doc.get('lo')}, not {expected}"
        event(f"claim: {expected}")
        if mine is not None:
            km.took(run)
            self._took(km, mine, lease, claimed=True)
            if km.name in CANCEL_KEYS and km.q and km.q[-1].s > run.s:
                # Claimed with a newer send parked (it parked after the handoff): it starts superseded.
                km.cx = (mine.token, km.q[-1].tid)
                event("claim: starts superseded")
        else:
            assert lease is None
        self._handoffs(km, handed)
        self._step_done(km)

    def do_renew(self, km: KeyModel, hold: Hold) -> None:
        self.clean = False
        assert hold.lease is not None
        ok = hold in km.holds and not hold.expired and not hold.lost and not hold.released
        try:
            hold.lease.renew()
            renewed = True
        except LeaseLost:
            renewed = False
            hold.lost = True
        assert renewed == ok, f"{km.name}: renewal of {hold.describe()} gave {renewed}"
        self._step_done(km)

    def do_heartbeat(self, held: list[tuple[KeyModel, Hold]]) -> None:
        """The heartbeat's tick: one ``renew_many`` for leases of single and ``limit=N`` keys together
        (two slots of one key among them, expired and taken-over ones too); it returns the lost ones."""
        self.clean = False
        live = [(km, h) for km, h in held if not h.lost]
        expected = [h for km, h in live if h not in km.holds or h.expired or h.released]
        leases = [h.lease for _, h in held if h.lease is not None]
        lost = self.store.renew_many(leases)
        assert [lease.owner for lease in lost] == [h.token for h in expected], (
            f"the heartbeat found {[lease.owner[:6] for lease in lost]} lost, the model "
            f"{[h.describe() for h in expected]}"
        )
        event(f"heartbeat: {len(leases)} leases, {len(lost)} lost")
        for h in expected:
            h.lost = True
        self._step_done(*{km.name: km for km, _ in held}.values())

    def _serving(self, km: KeyModel) -> KeyModel:
        """(A mixed key) the kind the sweeper serves the key as (``key_state.serves_slots``): the kind of
        its parked runs; else of its pending handoff; else slots once the document has had a slot or a
        ``limit=N`` admit (``hs``, ``lim``: read from it; nothing of either kind waits then)."""
        if km.other is None:
            return km
        one, slots = (km, km.other) if km.single else (km.other, km)
        assert not (one.q and slots.q), f"{km.key}: runs of both kinds parked"
        if one.q or slots.q:
            return one if one.q else slots
        if one.handoff() is not None or slots.handoff() is not None:
            return one if one.handoff() is not None else slots
        doc = self.store.collection.find_one({"_id": km.key}, {"hs": 1, "lim": 1}) or {}
        return slots if "hs" in doc or "lim" in doc else one

    def do_sweep(self, km: KeyModel, revoked: set[str]) -> None:
        """The sweeper's pass over the key, with ``revoked`` task ids (Celery's revoke of parked runs)."""
        self.clean = False
        km = self._serving(km)
        if km.other is not None:
            event(f"sweep: mixed key served as {'a single lease' if km.single else 'slots'}")
        handed: list[Hold] = []
        if km.waits():
            if not km.single:
                km.normalize()
            for r in [r for r in km.q if r.tid in revoked]:
                km.q.remove(r)
                r.state = "revoked"
            for h in [h for h in km.holds if h.handed and h.run is not None and h.run.tid in revoked]:
                km.holds.remove(h)
                assert h.run is not None
                h.run.state = "revoked"
            if km.single:
                km.q = km.time_out(km.q)
            handed = km.hand_single() if km.single else km.fill()
            # and the handoffs nobody published (a background release made them) are adopted
            handed = [h for h in km.holds if h in handed or (h.handed and not h.published)]
        self.store.sweep(km.key, revoked=revoked)
        self._handoffs(km, handed)
        self._check(km, view=True)
        # The sweeper writes the results of runs that timed out or were superseded, then forgets them
        # (a timed-out run is remembered as over).
        if km.dead:
            self.store.forget_results(km.key, "dead", [r.tid for r in km.dead])
            km.seen += [r.rid for r in km.dead]
            km.dead.clear()
        if km.sup:
            self.store.forget_results(km.key, "sup", [t for t, _ in km.sup])
            km.sup.clear()
        self._step_done(km)

    def do_due(self, km: KeyModel, run: Run) -> None:
        """``Replace(debounce=...)``: the run's own delayed copy comes back; once its debounce is over and
        it heads the queue of a free key, it takes the key (else it is a copy: dropped)."""
        self.clean = False
        hold: Hold | None = None
        handed: list[Hold] = []
        if not km.single:
            km.normalize()
        if km.single:
            takes = km.vacant() and km.handoff() is None and bool(km.q) and km.q[0] is run and run.due
        else:
            takes = len(km.holds) < km.limit and bool(km.q) and km.q[0] is run and run.due
        if takes:
            expected = "due"
            if km.single:
                for h in list(km.holds):
                    km.drop(h, "ended")
            km.q.remove(run)
            hold = Hold("", run, handed=False)
            km.holds.append(hold)
            km.took(run)
        else:
            expected = km.copy_outcome(run) or "?"
        if not km.single:
            handed = km.fill()
        lease, doc = self.store.admit(
            km.key,
            run.entry(),
            ttl=LONG,
            limit=self._limit(km),
            replace=True,
            timeout=LONG,
            debounce=DEBOUNCE,
            due=True,
        )
        assert doc.get("lo") == expected, (
            f"{km.name}: the due copy of {run.tid} was {doc.get('lo')}, not {expected}"
        )
        event(f"due copy: {expected}")
        if hold is not None:
            self._took(km, hold, lease)
        else:
            assert lease is None
        self._handoffs(km, handed)
        self._step_done(km)

    def do_debounce_over(self, km: KeyModel, run: Run) -> None:
        """A parked run's debounce ends (its not-before time passes on the server's clock)."""
        self.clean = False
        result = self.store.collection.update_one(
            {"_id": km.key, "q.id": run.rid}, {"$set": {"q.$.nb": PAST}}
        )
        assert result.matched_count == 1
        run.due = True
        self._step_done(km)

    def do_release_background(self, km: KeyModel, hold: Hold) -> None:
        """The heartbeat thread releases a lease (``release_tokens``: a release that found MongoDB
        unreachable, retried later): the handoff it makes is left for the sweeper to publish."""
        self.clean = False
        handed: list[Hold] = []
        expected = hold in km.holds and not hold.released
        if expected:
            self._released(km, hold)
            if hold.run is not None:
                km.seen.append(hold.run.rid)
                hold.run.state = "done"
            if km.single:
                handed = km.hand_single()
            else:
                km.normalize()
                handed = km.fill()
        released = self.store.release_tokens([hold.token])
        assert released == int(expected), (
            f"{km.name}: background release of {hold.describe()} gave {released}"
        )
        event(f"background release: {released}")
        # Nothing is published; the fences the handoffs got are in the document.
        self._handoffs(km, [])
        doc = self._doc(km) or {}
        for h in handed:
            assert h.run is not None
            h.published = False
            self._in_send_order(km, h.run, h.run.hands)
            fence = doc.get("fence") if km.single else next(x["f"] for x in doc["hs"] if x["o"] == h.token)
            self._new_fence(km, int(fence or 0), f"the background handoff to {h.run.tid}")
            h.fence = int(fence or 0)
        self._step_done(km)

    def do_release_held_by(self, km: KeyModel, run: Run) -> None:
        """A worker's parent releases the lease of its child that died running ``run``
        (``release_held_by``): not remembered as finished; parked runs are handed the key."""
        self.clean = False
        hold = next((h for h in km.holds if h.run is run and not h.handed and not h.released), None)
        handed: list[Hold] = []
        if hold is not None:
            km.drop(hold, "ended")
            hold.dead = True
            if km.single:
                handed = km.hand_single()
            else:
                km.normalize()
                handed = km.fill()
        released = self.store.release_held_by(task_id=run.tid)
        expected = int(hold is not None)
        assert released == expected, f"{km.name}: release_held_by({run.tid}) gave {released}"
        self._handoffs(km, handed)
        self._step_done(km)

    def do_unpark(self, km: KeyModel, run: Run) -> None:
        """``store.unpark``: a parked run (or the run the key, or a slot of it, is handed to) leaves the
        key; what it frees goes to the next parked runs."""
        self.clean = False
        if not km.single:
            self._unpark_slotted(km, run)
            return
        event(f"unpark (single, {run.state})")
        handed: list[Hold] = []
        ho = km.handoff()
        if run in km.q or (ho is not None and ho.run is run):
            if run in km.q:
                km.q.remove(run)
            if ho is not None and ho.run is run:
                km.holds.remove(ho)
            run.state = "revoked"
            handed = km.hand_single()
        self.store.unpark(km.key, run.rid)
        self._handoffs(km, handed)
        self._step_done(km)

    def _unpark_slotted(self, km: KeyModel, run: Run) -> None:
        event(f"unpark (slots, {run.state})")
        handed: list[Hold] = []
        mine = [h for h in km.holds if h.handed and h.run is run]
        if km.holds and (run in km.q or mine):
            # (The store chooses the slots' pipeline by the document's holds: a key without any has
            # no slot to hand, and its due runs were handed by the command that freed the last one.)
            if run in km.q:
                km.q.remove(run)
            for h in mine:
                km.holds.remove(h)
            run.state = "revoked"
            km.normalize()
            handed = km.fill()
        elif run in km.q:
            km.q.remove(run)
            run.state = "revoked"
        self.store.unpark(km.key, run.rid)
        self._handoffs(km, handed)
        self._step_done(km)

    def do_force_release(self, km: KeyModel) -> None:
        """An operator's release of the key, whoever holds it."""
        self.clean = False
        if km.other is not None:
            self._force_release_mixed(km)
            return
        handed: list[Hold] = []
        if km.single:
            expected = bool(km.holds)
            if km.holds and not km.holds[0].handed:
                km.drop(km.holds[0], "ended")
            elif km.holds:
                km.holds[0].expired = True  # owner cleared: the handoff is handed again
            handed = km.hand_single()
        else:
            expected = bool(km.holds)
            if km.holds:
                for h in [h for h in km.holds if not h.handed]:
                    km.drop(h, "ended")
                km.normalize()
                handed = km.fill()
        released = self.store.force_release(km.key)
        assert released == expected, f"{km.name}: force_release gave {released}"
        self._handoffs(km, handed)
        self._step_done(km)

    def _force_release_mixed(self, km: KeyModel) -> None:
        """``force_release`` of the mixed key: the single lease (one command: the key handed to runs of a
        single lease, once no slot is held), then every slot (the next: slots handed to runs of slots)."""
        assert km.other is not None
        one, slots = (km, km.other) if km.single else (km.other, km)
        expected = bool(one.holds or slots.holds)
        handed_one: list[Hold] = []
        handed_slots: list[Hold] = []
        if one.holds:
            if not one.holds[0].handed:
                one.drop(one.holds[0], "ended")
            else:
                one.holds[0].expired = True  # owner cleared: the handoff is handed again
            handed_one = one.hand_single()
        if slots.holds:
            for h in [h for h in slots.holds if not h.handed]:
                slots.drop(h, "ended")
            slots.normalize()
            handed_slots = slots.fill()
        released = self.store.force_release(km.key)
        assert released == expected, f"{km.key}: force_release gave {released}"
        assert not (handed_one and handed_slots), f"{km.key}: handed as both kinds"
        # (published in this order: the slots' command's handoffs, then the single lease's)
        self._handoffs(one if handed_one else slots, handed_slots + handed_one)
        self._step_done(km)

    def do_crash(self, km: KeyModel, hold: Hold) -> None:
        """The holder (or the run a key was handed to) dies: its lease runs out on the server's clock. (A
        hold released inside its minimum hold: the hold ends.)"""
        self.clean = False
        if hold.released:
            event("min hold ends")
        self._expire(km, hold)
        self._step_done(km)

    def do_lapse(self, km: KeyModel) -> None:
        """A plain holder takes a short lease and stops renewing; wait (bounded) until it has expired."""
        self.clean = False
        assert self._plain_free(km)
        hold = Hold("", None, handed=False)
        if km.single:
            for h in list(km.holds):
                km.drop(h, "ended")
        else:
            for h in [h for h in km.holds if h.expired and not h.handed]:
                km.drop(h, "ended")
        km.holds.append(hold)
        self._took(km, hold, self.store.acquire(km.key, SHORT, limit=self._limit(km)))
        mine = {"$filter": {"input": "$hs", "as": "h", "cond": {"$eq": ["$$h.o", hold.token]}}}
        field = "$expires_at" if km.single else {"$max": {"$map": {"input": mine, "as": "h", "in": "$$h.x"}}}
        # (dates compared as numbers: the embedded server compares dates in expressions wrongly)
        lapsed = {"$lte": [{"$toLong": field}, {"$toLong": "$$NOW"}]}

        def expired() -> bool:
            docs = list(
                self.store.collection.aggregate([{"$match": {"_id": km.key}}, {"$project": {"e": lapsed}}])
            )
            return not docs or bool(docs[0]["e"])

        wait_for(expired, timeout=30, message=f"the {SHORT} s lease of {km.name} to expire on the server")
        hold.expired = hold.dead = True
        self.lapses += 1
        self._step_done(km)

    # -- rules ---------------------------------------------------------------------------------------
    @initialize(names=st.lists(st.sampled_from(KEY_CHOICES), min_size=1, max_size=2, unique=True))
    def start(self, names: list[str]) -> None:
        """The keys of this example (one or two: the rules then reach deep states on each; the mixed key
        is its two kinds' models)."""
        if ALWAYS_MIXED and not set(MIXED) & set(names):
            names = [*names[:1], sorted(MIXED)[sum(map(len, names)) % len(MIXED)]]
        self.keys = {name: self.keys[name] for group in names for name in MIXED.get(group, (group,))}
        self.store.ensure_indexes()
        # No TTL index: MongoDB's TTL monitor deleting an idle document (about once a minute) is not the
        # engine's doing, and would make outcomes depend on when it runs.
        self.store.collection.drop_index("gc_at_ttl")
        self.clean = True

    def _key(self, data: st.DataObject, predicate: Any = None) -> KeyModel:
        names = [n for n, km in self.keys.items() if predicate is None or predicate(km)]
        return self.keys[data.draw(st.sampled_from(sorted(names)), label="key")]

    @staticmethod
    def _pick(data: st.DataObject, items: list[Any], describe: Any, label: str) -> Any:
        """One of ``items``, drawn (and reported) by its description, never by its repr (a Lease's repr
        reads its state)."""
        names = [f"{i}: {describe(item)}" for i, item in enumerate(items)]
        return items[names.index(data.draw(st.sampled_from(names), label=label))]

    def _send_new(self, km: KeyModel, stamp: int, cap: int | None = None, pr: int = 0) -> None:
        run = Run(km.name, f"{km.name}-t{len(self.runs)}", stamp, due=not km.debounce)
        if km.sets:
            run.g = f"g{stamp % 2}"
        if pr and not km.replace:  # (a Queue run's priority; a Replace run has none: integration.priority)
            run.pr = pr
            event("a run with a priority sent")
        self.runs.append(run)
        self.do_send(km, run, cap)

    @precondition(lambda self: len(self.runs) < MAX_RUNS)
    @rule(
        data=st.data(),
        stamp=st.integers(0, 30),
        cap=st.one_of(st.none(), st.integers(1, 3)),
        pr=st.sampled_from([0, 0, -1, 1, -2]),
    )
    def send(self, data: st.DataObject, stamp: int, cap: int | None, pr: int) -> None:
        """A run sent (``cap``: its task's ``Queue(max_length=...)``; ``pr``: its rank, lower first)."""
        self._send_new(self._key(data), stamp, cap, pr)

    @precondition(lambda self: len(self.runs) < MAX_RUNS)
    @rule(
        data=st.data(),
        stamps=st.lists(
            st.tuples(st.integers(0, 30), st.sampled_from([0, 0, 1, -1])), min_size=2, max_size=3
        ),
    )
    def send_burst(self, data: st.DataObject, stamps: list[tuple[int, int]]) -> None:
        """Several runs of one key sent close together (their stamps and priorities in any order)."""
        km = self._key(data)
        for stamp, pr in stamps:
            self._send_new(km, stamp, pr=pr)

    @precondition(lambda self: len(self.runs) < MAX_RUNS and bool(SET_KEYS & set(self.keys)))
    @rule(stamps=st.lists(st.integers(0, 30), min_size=3, max_size=5))
    def send_set_burst(self, stamps: list[int]) -> None:
        """Several-keys ``Replace`` runs of two sets sent close together on a key with slots: more runs than
        slots, so some park (and newer sends of a set supersede older ones)."""
        event("sets: a burst sent")
        for stamp in stamps:
            self._send_new(self.keys["set-2"], stamp)

    @rule(data=st.data())
    def acquire(self, data: st.DataObject) -> None:
        self.do_acquire(self._key(data))

    def _leases(self) -> list[tuple[KeyModel, Hold]]:
        """Leases not released yet: held, expired, lost or taken over (a paused holder wakes up)."""
        return [(km, hold) for km, hold in self.leases if hold.lease is not None and not hold.dead]

    @precondition(lambda self: bool(self._leases()))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        km, hold = self._pick(data, self._leases(), lambda kh: f"{kh[0].name} {kh[1].describe()}", "holder")
        self.do_release(km, hold)

    @precondition(lambda self: bool(self._leases()))
    @rule(data=st.data())
    def release_in_background(self, data: st.DataObject) -> None:
        km, hold = self._pick(data, self._leases(), lambda kh: f"{kh[0].name} {kh[1].describe()}", "holder")
        self.do_release_background(km, hold)

    def _running(self) -> list[Run]:
        return [
            r for r in self.runs if r.state == "running" and any(h.run is r for h in self.keys[r.key].holds)
        ]

    @precondition(lambda self: bool(self._running()))
    @rule(data=st.data())
    def child_dies(self, data: st.DataObject) -> None:
        """The worker child running a run is killed; its parent releases what it held."""
        run = self._pick(data, self._running(), lambda r: r.tid, "run")
        self.do_release_held_by(self.keys[run.key], run)

    @precondition(lambda self: bool(self._leases()))
    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        km, hold = self._pick(data, self._leases(), lambda kh: f"{kh[0].name} {kh[1].describe()}", "holder")
        self.do_renew(km, hold)

    @precondition(lambda self: bool(self._leases()))
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        leases = self._leases()
        names = [f"{i}: {km.name} {h.describe()}" for i, (km, h) in enumerate(leases)]
        chosen = data.draw(st.lists(st.sampled_from(names), min_size=1, unique=True), label="leases")
        self.do_heartbeat([leases[names.index(n)] for n in chosen])

    def _handed(self) -> list[Run]:
        """Runs whose handoff message is out: handed now, or handed before and back in the queue."""
        out = []
        for r in self.runs:
            published = any(h.run is r and h.handed and h.published for h in self.keys[r.key].holds)
            if (r.state == "handed" and published) or (r.state == "parked" and r.handed_before):
                out.append(r)
        return out

    @precondition(lambda self: bool(self._handed()))
    @rule(data=st.data())
    def claim(self, data: st.DataObject) -> None:
        run = self._pick(data, self._handed(), lambda r: f"{r.tid} ({r.state})", "handed run")
        self.do_claim(self.keys[run.key], run)

    def _copies(self) -> list[tuple[str, Run]]:
        """Messages whose run must not start again: a copy of a parked, handed or finished run's message,
        or of a run running on a live lease (a run whose holder died may run again: at least once); a
        handoff message again after its run started, finished or was revoked."""
        out = []
        for r in self.runs:
            km = self.keys[r.key]
            live = any(h.run is r and not h.expired and not h.handed for h in km.holds)
            if r.state in ("parked", "handed", "done", "timedout") or (r.state == "running" and live):
                out.append(("message", r))
            if r.handed_before and r.state in ("running", "done", "revoked"):
                out.append(("handoff", r))
        return out

    @precondition(lambda self: bool(self._copies()))
    @rule(data=st.data())
    def redeliver(self, data: st.DataObject) -> None:
        """The broker delivers a message again: a copy never runs beside or after its run."""
        what, run = self._pick(data, self._copies(), lambda c: f"{c[0]} of {c[1].tid} ({c[1].state})", "copy")
        if what == "message":
            self.do_send(self.keys[run.key], run)
        else:
            self.do_claim(self.keys[run.key], run)

    def _mixed(self) -> list[Run]:
        """Runs refused ``mixed``: each comes back (``MIXED_RETRY``) until the key is free of the other
        kind."""
        return [r for r in self.runs if r.state == "mixed"]

    @precondition(lambda self: bool(self._mixed()))
    @rule(data=st.data())
    def come_back(self, data: st.DataObject) -> None:
        run = self._pick(data, self._mixed(), lambda r: r.tid, "run")
        self.do_send(self.keys[run.key], run)

    def _debounced(self) -> list[Run]:
        return [r for km in self.keys.values() if km.debounce for r in km.q]

    @precondition(lambda self: bool(self._debounced()))
    @rule(data=st.data())
    def due_copy(self, data: st.DataObject) -> None:
        run = self._pick(
            data, self._debounced(), lambda r: f"{r.tid} ({'due' if r.due else 'not due'})", "run"
        )
        self.do_due(self.keys[run.key], run)

    @precondition(lambda self: any(not r.due for r in self._debounced()))
    @rule(data=st.data())
    def debounce_over(self, data: st.DataObject) -> None:
        runs = [r for r in self._debounced() if not r.due]
        run = self._pick(data, runs, lambda r: r.tid, "run")
        self.do_debounce_over(self.keys[run.key], run)

    def _waiting(self) -> list[Run]:
        return [r for km in self.keys.values() for r in km.q if not r.past_deadline]

    @precondition(lambda self: bool(self._waiting()))
    @rule(data=st.data())
    def deadline_passes(self, data: st.DataObject) -> None:
        """A parked run's ``Queue(timeout=...)`` runs out (on the server's clock)."""
        run = self._pick(data, self._waiting(), lambda r: r.tid, "run")
        self.clean = False
        km = self.keys[run.key]
        result = self.store.collection.update_one(
            {"_id": km.key, "q.id": run.rid}, {"$set": {"q.$.dl": PAST}}
        )
        assert result.matched_count == 1
        run.past_deadline = True
        event("deadline passed")
        self._step_done(km)

    @precondition(lambda self: any(km.live() for km in self.keys.values()))
    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        """A holder dies (or the run a key was handed to never claims it)."""
        holds = [(km, h) for km in self.keys.values() for h in km.live()]
        km, hold = self._pick(data, holds, lambda kh: f"{kh[0].name} {kh[1].describe()}", "hold")
        self.do_crash(km, hold)

    def _mixed_slots(self) -> list[KeyModel]:
        """The slots' models of the mixed keys with a live slot."""
        return [km for km in self.keys.values() if km.other is not None and not km.single and km.live()]

    @precondition(lambda self: bool(self._mixed_slots()))
    @rule(data=st.data())
    def slots_crash(self, data: st.DataObject) -> None:
        """(The mixed key) every live slot's holder dies at once (one worker held them): the key is then
        free for a single lease while its document keeps their holds, expired."""
        km = self._pick(data, self._mixed_slots(), lambda km: km.name, "key")
        for hold in km.live():
            self.do_crash(km, hold)

    @precondition(lambda self: any(km.waits() or km.holds for km in self.keys.values()))
    @rule(data=st.data(), revoke=st.booleans())
    def sweep(self, data: st.DataObject, revoke: bool) -> None:
        km = self._key(data, lambda km: km.waits() or km.holds)
        revoked: set[str] = set()
        names = {km.name} | ({km.other.name} if km.other is not None else set())
        candidates = [r for r in self.runs if r.key in names and r.state in ("parked", "handed", "running")]
        if revoke and candidates:
            revoked.add(self._pick(data, candidates, lambda r: f"{r.tid} ({r.state})", "revoked").tid)
        self.do_sweep(km, revoked)

    def _unparkable(self) -> list[Run]:
        return [r for r in self.runs if r.state in ("parked", "handed")]

    @precondition(lambda self: bool(self._unparkable()))
    @rule(data=st.data())
    def unpark(self, data: st.DataObject) -> None:
        run = self._pick(data, self._unparkable(), lambda r: f"{r.tid} ({r.state})", "run")
        self.do_unpark(self.keys[run.key], run)

    @precondition(lambda self: any(km.holds for km in self.keys.values()))
    @rule(data=st.data())
    def force_release(self, data: st.DataObject) -> None:
        self.do_force_release(self._key(data, lambda km: km.holds))

    @precondition(lambda self: self.lapses < 1 and any(self._plain_free(km) for km in self.keys.values()))
    @rule(data=st.data(), now=st.integers(0, 3))
    def lapse(self, data: st.DataObject, now: int) -> None:
        """(Rarely: it waits for a real expiry.)"""
        if now == 0:
            keys = [km for km in self.keys.values() if self._plain_free(km)]
            self.do_lapse(self._pick(data, keys, lambda km: km.name, "key"))

    # -- the end of an example -----------------------------------------------------------------------
    def drain(self) -> None:
        """Release every hold and claim every handoff until no run waits; every run then ran once (a run
        refused ``mixed`` comes back once the keys are drained, and is drained in turn)."""
        self._drain_keys()
        for _ in range(MAX_RUNS * 2):
            if not self._mixed():
                break
            run = self._mixed()[0]
            self.do_send(self.keys[run.key], run)
            self._drain_keys()
        for run in self.runs:
            assert run.state in ("done", "ended", "superseded", "revoked", "refused", "timedout"), (
                f"{run.tid} is left {run.state}"
            )
            if run.state in ("done", "ended"):
                assert run.starts == 1, f"{run.tid} ran {run.starts} times"
            else:
                assert run.starts == 0

    def _drain_keys(self) -> None:
        for km in self.keys.values():
            for _ in range(200):
                if not km.holds and not km.q:
                    break
                hold = km.holds[0] if km.holds else None
                if hold is None:
                    for run in [r for r in km.q if not r.due]:
                        self.do_debounce_over(km, run)
                if hold is None or (hold.handed and not hold.published):
                    self.do_sweep(km, set())  # a handoff nobody published, or runs parked on a vacant key
                elif hold.handed and hold.run is not None:
                    self.do_claim(km, hold.run)
                elif hold.lease is not None and not hold.lost and not hold.dead:
                    self.do_release(km, hold)
                else:
                    self.do_force_release(km)
            assert not km.holds and not km.q, f"{km.name}: could not drain"
            self._check(km, view=True)

    def teardown(self) -> None:
        try:
            if self.clean:
                self.drain()
        finally:
            self.store.close()
            self.client.drop_database(self.db_name)


@pytest.mark.timeout(900 + 30 * EXAMPLES)  # a failure is shrunk too (hypothesis gives that 5 minutes)
def test_the_engine_matches_its_model(mongo_url: str) -> None:
    CLIENT[:] = [MongoClient(mongo_url, tz_aware=True)]
    try:
        run_machine()
    finally:
        CLIENT.pop().close()
    if os.environ.get("MONGOLOCK_MODEL_STATS") == "1":
        print("\n".join(f"{n:6d}  {what}" for what, n in sorted(STATS.items())))


def run_machine() -> None:
    run_state_machine_as_test(
        EngineMachine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            derandomize=SEED is None,
            # (no explain phase: its tracer slows every command down many times over)
            phases=PHASES,
            database=None,
            suppress_health_check=[
                HealthCheck.too_slow,
                HealthCheck.filter_too_much,
                HealthCheck.data_too_large,
            ],
            print_blob=False,
        ),
    )


# -- library bugs the model found (reproductions; strict xfails until they are fixed) ----------------------
def _entry(stamp: int, tid: str) -> dict[str, Any]:
    return {"id": f"{tid}/0", "t": tid, "n": "m", "r": "0", "s": stamp, "tk": f"{tid}-tk", "m": b"m"}


def test_a_pending_slot_handoff_is_published_once(store: LeaseStore) -> None:
    published: list[tuple[str, int]] = []
    store.add_handoff_callback(lambda key, ho, doc: published.append((ho["t"], ho["hn"])))
    a = store.admit("k", _entry(1, "a"), ttl=600, limit=2)[0]
    b = store.admit("k", _entry(2, "b"), ttl=600, limit=2)[0]
    assert a is not None and b is not None
    assert store.admit("k", _entry(5, "parked"), ttl=600, limit=2)[1]["lo"] == "parked"
    # Both holders die: their holds run out on the server's clock.
    store.collection.update_one({"_id": "k"}, {"$set": {"hs.$[].x": PAST}})
    # An older send takes a slot, and the same command hands the other free slot to the parked run.
    z, doc = store.admit("k", _entry(0, "z"), ttl=600, limit=2)
    assert z is not None and doc["lo"] == "acquired"
    assert published == [("parked", 1)]
    published.clear()
    assert z.release()
    # Nothing was freed for anyone: the pending handoff to "parked" must not be published again.
    assert published == [], published


def test_unpark_on_a_slotted_key_hands_a_slot(store: LeaseStore) -> None:
    published: list[str] = []
    store.add_handoff_callback(lambda key, ho, doc: published.append(ho["t"]))
    for stamp, tid in ((1, "a"), (2, "b")):
        assert store.admit("k", _entry(stamp, tid), ttl=600, limit=2)[0] is not None
    for stamp, tid in ((3, "p3"), (4, "p4")):
        assert store.admit("k", _entry(stamp, tid), ttl=600, limit=2)[1]["lo"] == "parked"
    store.collection.update_one({"_id": "k"}, {"$set": {"hs.$[].x": PAST}})  # both holders died
    store.unpark("k", "p4/0")
    doc = store.collection.find_one({"_id": "k"}) or {}
    assert doc.get("owner") is None and doc.get("ho") is None, "a single-lease handoff on a limit=N key"
    # p3 (handed now, or at the next admit) can claim its slot.
    store.sweep("k")
    assert published == ["p3"], published
    lease, doc = store.admit("k", _entry(3, "p3"), ttl=600, limit=2, claim="p3-tk")
    assert lease is not None and doc["lo"] == "claimed"
