"""Typed results of the lease engine's commands (private): what the Celery layer acts on.

The engine's commands answer with a lease document (the reply of one ``findAndModify``); these are pure
functions from that reply to a typed result, so that nothing above the lease core reads a document's
fields (``lo``, ``holder``, ``hs``, ``q``...). One place knows the document's shape: here and
``_documents``/``_admission``, which write it.

* ``Admission``: a run of a ``Queue``/``Replace`` task admitted (``LeaseStore.admit``): its ``outcome``
  (``AdmitOutcome``) and what the outcome needs: the lease when it took the key, who holds the key, the
  run that superseded it, its place in the queue, the runs it superseded.
* ``Contended``: an acquire that did not get the key (``LeaseStore.try_acquire`` answered no lease): who
  holds it and until when, whether a beat tick already ran, and the hold of this very run when a
  ``limit=N`` key has one.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
from collections.abc import Mapping, Sequence
from typing import Any

from celery_mongolock.core.documents.copies import ran, retries_of
from celery_mongolock.core.lease import Lease
from celery_mongolock.core.lease_info import aware
from celery_mongolock.exceptions import slots_held_message

__all__ = [
    "LATER_ATTEMPT_PROJECTION",
    "RUN_ENDED_PROJECTION",
    "Admission",
    "AdmitOutcome",
    "Contended",
    "ended_superseded_by",
    "later_attempt_known",
    "plain_admit_reply",
    "run_ended",
    "untrusted_admit_reply",
]


class AdmitOutcome(str, enum.Enum):
    """What an admit decided for the run (the values are those of the reply's ``lo``)."""

    #: The run holds the key now (taken free, claimed after a handoff, or its debounced copy was due).
    ACQUIRED = "acquired"
    #: Parked in the key's queue: the key will be handed to it.
    PARKED = "parked"
    #: A copy of a run that is parked on the key or was handed it: drop the copy.
    WAITING = "dup"
    #: A copy of a run that ran and released the key: never run it again.
    ALREADY_RAN = "done"
    #: A handoff message of a run no longer parked or handed (timed out, revoked, handed again).
    STALE = "stale"
    #: A copy of the run that holds the key now.
    RUNNING = "running"
    #: A copy of an attempt whose body retried (``self.retry()``): a later attempt of the task is parked,
    #: handed, running or ended on the key, and carries the task on. Drop the copy.
    RETRIED = "retried"
    #: ``Replace``: a newer send of the key exists; the run ends superseded (``Admission.by``).
    SUPERSEDED = "superseded"
    #: The queue is at its ``max_length``: the policy's ``then`` decides.
    FULL = "full"
    #: The key is in use as the other kind of key (``limit=N`` slots for a run that takes it as a single
    #: lease, or the reverse): the run is not parked there, and comes back later (a contention retry).
    MIXED = "mixed"

    @classmethod
    def of(cls, value: Any) -> AdmitOutcome:
        """The outcome of a reply's ``lo`` (``claimed`` and ``due`` are ways of ``ACQUIRED``, ``spilled``
        of ``PARKED``: the store stores such a run before it answers, ``store_spill``)."""
        if value in ("claimed", "due"):
            return cls.ACQUIRED
        if value == "spilled":
            return cls.PARKED
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"the lease engine answered an unknown admit outcome {value!r}") from None


def untrusted_admit_reply(
    doc: Mapping[str, Any] | None, token: str, run_id: str | None, *, read_back: bool
) -> str | None:
    """Why an admit's reply cannot be taken as its own command's answer (None: it can).

    A reply read back (``read_back``: the server applied the command and returned no document, as the
    embedded server does under contention) carries the outcome of the last admit of the key (``lo``,
    ``lo_by``, written with that admit's token ``lt``): another run's admit may have come in between,
    and its answer (``superseded`` by the newest send, ``parked``, ``acquired``) is not this run's. And a
    run is never superseded by itself: an answer naming ``run_id`` as the newer send is no answer for it
    (the admit pipelines never decide it: ``sets``). Either way the command is sent again with the same
    token, as after an ambiguous outcome."""
    if doc is None:
        return None
    if read_back and doc.get("lt") != token:
        return "the reply was lost and the key's document holds another admit's outcome"
    if doc.get("lo") == "superseded" and run_id is not None and doc.get("lo_by") == run_id:
        return f"the reply names the run itself ({run_id}) as the newer send that supersedes it"
    return None


def plain_admit_reply(doc: dict[str, Any], token: str, ambiguous: bool) -> None:
    """A queued run's admit reply, made plain: its outcome (``lo``) as this very admit caused it."""
    doc["_admit_token"] = token  # a handoff this admit made is marked with admit_marker(token)
    doc["_resent"] = ambiguous  # (``Admission.resent``)
    outcome = doc.get("lo")
    if outcome == "dup" and ambiguous:
        doc["lo"] = "parked"  # an earlier attempt of this very admit parked the run
    mine = doc.get("owner") == token or any(
        h.get("o") == token for h in doc.get("hs") or [] if isinstance(h, dict)
    )
    if mine and outcome not in ("acquired", "claimed", "due"):
        doc["lo"] = "acquired"


def _holder(doc: Mapping[str, Any]) -> dict[str, Any]:
    return dict(doc.get("holder") or {})


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclasses.dataclass(frozen=True)
class Admission:
    """The answer of one admit."""

    outcome: AdmitOutcome
    #: The lease when the run holds the key (``ACQUIRED``), else None.
    lease: Lease | None = None
    #: Who holds the key (task name, id, worker...), as the key's document says.
    holder: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: When the holder's lease expires on the server's clock, unless renewed.
    expires_at: _dt.datetime | None = None
    #: The key's fence after the command.
    fence: int | None = None
    #: ``SUPERSEDED``: the task id of the newer send.
    by: str | None = None
    #: Task ids of the key's parked runs in its lease document, next first (runs spilled beyond its
    #: window are counted in ``queued``, not listed).
    parked: tuple[str, ...] = ()
    #: How many runs are parked on the key, spilled ones included.
    queued: int = 0
    #: A spilled run's place in the key's queue (1: next), as its admit computed it.
    spilled_position: int = 0
    #: Runs superseded by a newer send whose results are still to be written (the parked entries).
    superseded: tuple[Mapping[str, Any], ...] = ()
    #: ``Replace(debounce=...)``: per parked task id, seconds from its parking to its not-before time.
    not_before: Mapping[str, float] = dataclasses.field(default_factory=dict)
    #: ``Replace(debounce=..., max_wait=...)``: per run id (``entry["id"]``) parked or handed here, its
    #: burst (ms: ``bu``, else when its burst began waiting, ``fw``; ``sets.burst_of``).
    bursts: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: The admit was sent again after a send whose outcome is unknown (its reply lost): the answer may
    #: describe what that earlier send did (it may have parked the run, which was then handed the key and
    #: runs or ran under its handoff message).
    resent: bool = False
    #: The runs (``entry["id"]``) the key, or a slot of it, is handed or reserved to and not yet claimed.
    handed: tuple[str, ...] = ()

    @classmethod
    def of(cls, lease: Lease | None, doc: Mapping[str, Any] | None) -> Admission:
        """The typed answer of ``LeaseStore.admit``'s ``(lease, reply)``."""
        doc = doc or {}
        outcome = AdmitOutcome.ACQUIRED if lease is not None else AdmitOutcome.of(doc.get("lo"))
        return cls(
            outcome=outcome,
            lease=lease,
            holder=_holder(doc),
            expires_at=aware(doc.get("expires_at")),
            fence=_int(doc.get("fence")),
            by=None if doc.get("lo_by") is None else str(doc.get("lo_by")),
            parked=tuple(str(e.get("t")) for e in doc.get("q") or [] if isinstance(e, Mapping)),
            # (less the tombstones counted under its lanes, when the admit counted them: ``_gone``)
            queued=max(0, len(doc.get("q") or []) + _spilled(doc) - (_int(doc.get("_gone")) or 0)),
            spilled_position=_int(doc.get("_position")) or 0,
            superseded=tuple(s for s in doc.get("sup") or [] if isinstance(s, Mapping)),
            not_before=_not_before(doc.get("q") or []),
            bursts=_bursts([*(doc.get("q") or []), doc.get("ho"), *_handed_entries(doc)]),
            resent=bool(doc.get("_resent")),
            handed=tuple(
                str(e.get("id")) for e in (doc.get("ho"), *_handed_entries(doc)) if isinstance(e, Mapping)
            ),
        )

    def handed_to(self, run_id: str) -> bool:
        """Whether the key (or a slot of it) is handed or reserved to the run ``run_id``, not yet claimed."""
        return run_id in self.handed

    def position(self, task_id: str | None) -> int:
        """The run's place in the key's queue (1: next), 0 when it is not parked there."""
        if task_id in self.parked:
            return self.parked.index(task_id) + 1
        return self.spilled_position

    def due_in(self, task_id: str | None) -> float | None:
        """Seconds from the run's parking until it may start (``Replace(debounce=...)``), or None."""
        return self.not_before.get(str(task_id))

    def burst_of(self, run_id: str) -> int | None:
        """The burst of the run ``run_id`` (its entry's ``id``) on this key, None when it is not parked or
        handed here or has none (``bursts``)."""
        return self.bursts.get(run_id)

    def superseded_by(self, task_id: str | None) -> list[Mapping[str, Any]]:
        """The runs this admit's run superseded (their results are its to write)."""
        return [s for s in self.superseded if s.get("by") == task_id]


def _spilled(doc: Mapping[str, Any]) -> int:
    """How many numbers the key's lanes of spilled runs hold (``documents.spill``)."""
    lanes = [lane for lane in doc.get("sp") or [] if isinstance(lane, Mapping)]
    return sum(max(0, (_int(lane.get("t")) or 0) - (_int(lane.get("h")) or 0)) for lane in lanes)


def _not_before(q: Sequence[Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for e in q:
        if (
            isinstance(e, Mapping)
            and isinstance(e.get("nb"), _dt.datetime)
            and isinstance(e.get("at"), _dt.datetime)
        ):
            out[str(e.get("t"))] = max(0.0, (e["nb"] - e["at"]).total_seconds())
    return out


def _handed_entries(doc: Mapping[str, Any]) -> list[Any]:
    """The entries a key with a limit handed or reserved its slots to (``hs[].ho``)."""
    return [h.get("ho") for h in doc.get("hs") or [] if isinstance(h, Mapping)]


def _bursts(entries: Sequence[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in entries:
        if not isinstance(e, Mapping):
            continue
        bu, fw = e.get("bu"), e.get("fw")
        if isinstance(bu, int):
            out[str(e.get("id"))] = bu
        elif isinstance(fw, _dt.datetime):
            out[str(e.get("id"))] = _ms(fw)
    return out


def _ms(value: _dt.datetime) -> int:
    """A stored date (naive: UTC) as milliseconds since the epoch, as ``$toLong`` gives it."""
    aware_value = value if value.tzinfo is not None else value.replace(tzinfo=_dt.timezone.utc)
    return (aware_value - _EPOCH) // _dt.timedelta(milliseconds=1)


_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)


#: The fields of a lease document that ``run_ended`` reads.
RUN_ENDED_PROJECTION = {
    "owner": 1,
    "holder": 1,
    "released_for": 1,
    "forced_release": 1,
    "hs.h": 1,
    "ends": 1,
    "seen": 1,
}


def run_ended(
    doc: Mapping[str, Any] | None, run_ids: Sequence[str], *, task_id: str, delivery: Any, parked: bool
) -> bool:
    """Whether the lease document ``doc`` says that a run of ``run_ids`` (``_admission.run_id``: this
    task id and attempt) ended and released the key itself: remembered as over (``seen``), or, on a
    ``limit=N`` key, its own hold ended by a release, or the key's last holder, released normally (not
    forced, not released for a dead process). ``parked``: a parked copy, which matches a holder recorded
    before deliveries were (an older version) on its task id."""
    if doc is None:
        return False
    if ran(doc.get("seen") or [], run_ids):
        return True
    if "hs" in doc:
        return any(
            e.get("t") == task_id
            and e.get("run") == delivery
            and e.get("how") == "released"
            and not e.get("u")
            for e in doc.get("ends") or []
        )
    holder = doc.get("holder") or {}
    same_delivery = holder.get("delivery", delivery if parked else None) == delivery
    return bool(
        holder.get("task_id") == task_id
        and same_delivery
        and doc.get("owner") is None
        and doc.get("released_for") is None
        and not doc.get("forced_release")
    )


def ended_superseded_by(doc: Mapping[str, Any] | None, task_id: str, retries: int) -> str | None:
    """The newer send that attempt ``retries`` of ``task_id`` stopped for before it released the key
    (``Replace(cancel_running=True)``: its ending's ``for``, ``release_pipeline``), from ``doc``'s last
    endings (``RUN_ENDED_PROJECTION``); None when it did not, or the key no longer remembers it. (A queued
    run's delivery is its attempt, ``"0"``; another run's has its contention retries, ``"0.1"``.)"""
    for ending in reversed((doc or {}).get("ends") or []):
        if not isinstance(ending, Mapping) or ending.get("t") != task_id or ending.get("how") != "released":
            continue
        if str(ending.get("run", "")).split(".")[0] == str(int(retries)):
            by = ending.get("for")
            return by if isinstance(by, str) and by else None
    return None


#: The fields of a lease document that ``later_attempt_known`` reads.
LATER_ATTEMPT_PROJECTION = {
    "owner": 1,
    "holder": 1,
    "ho.t": 1,
    "ho.r": 1,
    "hs.h": 1,
    "hs.ho": 1,
    "q.t": 1,
    "q.r": 1,
    "seen": 1,
}


def later_attempt_known(doc: Mapping[str, Any] | None, task_id: str, retries: int) -> bool:
    """Whether the lease document ``doc`` knows an attempt of ``task_id`` later than ``retries`` (a body
    of it called ``self.retry()``): parked, handed, holding the key or a slot, or ended (``seen``). The
    Python twin of ``queue.later_attempt``, which an admit judges in its own command."""
    if doc is None:
        return False

    def later(task: Any, delivery: Any) -> bool:
        attempt = retries_of(delivery)
        return task == task_id and attempt is not None and attempt > retries

    holder = doc.get("holder") or {}
    handed = doc.get("ho") or {}
    prefix = f"{task_id}/"
    return (
        (doc.get("owner") is not None and later(holder.get("task_id"), holder.get("delivery")))
        or later(handed.get("t"), handed.get("r"))
        or any(later(e.get("t"), e.get("r")) for e in doc.get("q") or [] if isinstance(e, Mapping))
        or any(
            later((h.get("h") or {}).get("task_id"), (h.get("h") or {}).get("delivery"))
            or later((h.get("ho") or {}).get("t"), (h.get("ho") or {}).get("r"))
            for h in doc.get("hs") or []
            if isinstance(h, Mapping)
        )
        or any(
            later(task_id, str(r)[len(prefix) :]) for r in doc.get("seen") or [] if str(r).startswith(prefix)
        )
    )


@dataclasses.dataclass(frozen=True)
class Contended:
    """An acquire that did not get the key."""

    #: Who holds the key (for a ``limit=N`` key: its newest holder, or this run's own hold, see ``of``).
    holder: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: When that lease expires on the server's clock, unless renewed.
    expires_at: _dt.datetime | None = None
    #: The last beat tick a run of this key was sent for (beat-sent runs run once per tick).
    last_tick: int | None = None
    #: The runs the key remembers as over (``seen``), when the reply says (a single lease's acquire
    #: answers with the whole document); None when it does not (a ``limit=N`` key's reply).
    seen: tuple[str, ...] | None = None
    #: For a ``limit=N`` key whose slots are all held: each slot's holder, and the key's limit.
    holders: tuple[Mapping[str, Any], ...] = ()
    limit: int | None = None

    def message(self, key: str) -> str | None:
        """``LockContended``'s message when every slot of a ``limit=N`` key is held (naming each holder);
        None for a single lease (its holder is named as usual)."""
        if not self.holders or self.holder:
            return None
        return slots_held_message(key, self.holders, self.limit, self.expires_at)

    @classmethod
    def of(
        cls,
        doc: Mapping[str, Any] | None,
        *,
        task_id: str | None = None,
        delivery: Any = None,
        whole: bool = False,
    ) -> Contended:
        """The typed answer of an acquire that got no lease. With ``task_id``/``delivery``: on a
        ``limit=N`` key, a slot held by this very run (a copy of its message) is reported as the holder,
        so that the copy is recognised as one. ``whole``: the reply is the whole document (a single
        lease's acquire), so a missing ``seen`` means none."""
        doc = doc or {}
        seen = doc.get("seen") if "seen" in doc or whole else None
        holder = _holder(doc)
        for hold in doc.get("hs") or []:
            held_by = (hold.get("h") or {}) if isinstance(hold, Mapping) else {}
            if task_id and held_by.get("task_id") == task_id and held_by.get("delivery") == delivery:
                holder = dict(held_by)
                break
        holds = [h for h in doc.get("hs") or [] if isinstance(h, Mapping)]
        expires_at = aware(doc.get("expires_at"))
        if holds and not doc.get("holder"):
            expiries = [x for x in (aware(h.get("x")) for h in holds) if x is not None]
            expires_at = min(expiries) if expiries else expires_at
        return cls(
            holder=holder,
            expires_at=expires_at,
            last_tick=_int(doc.get("last_tick")),
            seen=None if seen is None and not whole else tuple(str(s) for s in seen or ()),
            holders=tuple(dict(h.get("h") or {}) if isinstance(h.get("h"), Mapping) else {} for h in holds),
            limit=_int(doc.get("lim")),
        )

    def attempt_ran(self, run_ids: Sequence[str]) -> bool | None:
        """Whether one of ``run_ids`` is remembered as over on the key; None when the reply did not say."""
        return None if self.seen is None else ran(self.seen, run_ids)

    def held_by_run(self, task_id: str | None) -> bool:
        """Whether the key is held by a run of this very task id (a copy of its message is here)."""
        return bool(task_id) and self.holder.get("task_id") == task_id

    def tick_ran(self, tick: int | None) -> bool:
        """Whether beat tick ``tick`` of the key already ran (or is running)."""
        return tick is not None and (self.last_tick if self.last_tick is not None else -1) >= tick
