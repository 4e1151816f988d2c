"""What the sweeper reads of a key with parked runs, and what a sweep of it left: typed views of the lease
document (``LeaseStore.waiting``, ``LeaseStore.sweep``), so that the Celery layer reads no lease document's
fields. Pure: no I/O."""

from __future__ import annotations

import dataclasses
import datetime as _dt
from collections.abc import Collection, Mapping
from typing import Any

from celery_mongolock.core.documents import key_state

__all__ = ["Swept", "WaitingKey", "lone_reservations", "needs_sweep"]

#: A parked run's entry, a handoff, or its record in ``dead`` / ``sup``: handed on as it is to the code that
#: ends the run (its result, its history record, its callbacks), which reads the run's own fields.
Run = Mapping[str, Any]


def _ms(value: Any) -> float | None:
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=_dt.timezone.utc)
        return float(value.timestamp() * 1000)
    return None


def _handoffs(doc: Mapping[str, Any]) -> list[Run]:
    """The key's handoff and its slots' (handed or reserved to a parked run, not yet claimed)."""
    found = [doc.get("ho")] + [h.get("ho") for h in doc.get("hs") or [] if isinstance(h, Mapping)]
    return [ho for ho in found if isinstance(ho, Mapping)]


def _past_deadline(doc: Mapping[str, Any], now: float) -> bool:
    for entry in doc.get("q") or []:
        deadline = _ms(entry.get("dl"))
        if deadline is not None and deadline <= now:
            return True
    return False


def _none_due(doc: Mapping[str, Any], now: float) -> bool:
    """Every run parked on the key waits for its not-before time (``Replace(debounce=...)``) and none is
    spilled beyond the window: a sweep could hand the key (or a slot) to nobody yet. (Its delayed copy
    takes it once due; past that, the sweeper hands it.)"""
    if _spilled(doc):
        return False
    entries = [e for e in doc.get("q") or [] if isinstance(e, Mapping)]
    not_before = [_ms(e.get("nb")) for e in entries]
    return bool(entries) and all(nb is not None and nb > now for nb in not_before)


#: How long past its expiry a lone reservation (``_lone_reservation``) is left as it is before the sweeper
#: hands it again (it then looks again for a run missing from some of its keys).
LONE_RESERVATION_RECHECK_MS = 3_600_000


def _spilled(doc: Mapping[str, Any]) -> bool:
    return any(isinstance(lane, Mapping) and lane.get("t") != lane.get("h") for lane in doc.get("sp") or [])


def _lone_reservation(doc: Mapping[str, Any], ho: object, expired_at: float, now: float) -> bool:
    """An expired reservation ``ho`` of a run that needs several keys, handed again once already (``hn`` >
    1: that first lapse looked for a run missing from some of its keys), on a key where no other run waits
    (nothing parked or spilled), within its ``Queue(timeout=...)``: handing it again would give it to the
    same run, so the sweeper leaves it, for up to ``LONE_RESERVATION_RECHECK_MS`` past its expiry, while
    its run waits parked on another of its keys (``lone_reservations``, judged by the sweeper over every
    key). Its run still claims it (a claim does not look at the expiry); the admit of a run that parks on
    the key puts it back in send order. (Before: every such key was written at every lapse, one command
    per parked run and lease: with thousands of runs of ``keys=("tenant:{t}", "group:{g}")`` the sweeper
    fell minutes behind.)"""
    if not isinstance(ho, Mapping) or not ho.get("ks") or not ho.get("by"):
        return False
    if int(ho.get("hn") or 1) < 2 or doc.get("q") or _spilled(doc):
        return False
    deadline = _ms(ho.get("dl"))
    if deadline is not None and deadline <= now:
        return False  # past its ``Queue(timeout=...)``: the sweep ends it
    return now - expired_at < LONE_RESERVATION_RECHECK_MS


def _names_of_live_handoffs(doc: Mapping[str, Any]) -> frozenset[str]:
    """The task names of the runs the key (or a slot of it) is handed or reserved to, the handoff not
    lapsed on the server's time of the read: each is the business of a worker that has that task."""
    now = _ms(doc.get("__now"))
    if now is None:
        return frozenset()
    found: list[object] = []
    if key_state.serves_slots(doc):
        for hold in doc.get("hs") or []:
            if not isinstance(hold, Mapping) or not isinstance(hold.get("ho"), Mapping):
                continue
            x = _ms(hold.get("x"))
            if x is not None and x > now:
                found.append(hold["ho"].get("n"))
        return frozenset(str(n) for n in found if n)
    ho, expires = doc.get("ho"), _ms(doc.get("expires_at"))
    if isinstance(ho, Mapping) and doc.get("owner") is not None and expires is not None and expires > now:
        found.append(ho.get("n"))
    return frozenset(str(n) for n in found if n)


def needs_sweep(doc: Mapping[str, Any]) -> bool:
    """Whether a key read by ``waiting_keys`` has anything for the sweeper to do, judged on the server's
    time of the read (``__now``): a sweep is a write, so keys whose queue simply waits for a running
    holder are left alone."""
    now = _ms(doc.get("__now"))
    if now is None or doc.get("dead") or doc.get("sup"):
        return True
    if key_state.serves_slots(doc):
        holds = [h for h in doc.get("hs") or [] if isinstance(h, Mapping)]
        for hold in holds:
            x, ho = _ms(hold.get("x")), hold.get("ho")
            if x is None or (x <= now and not _lone_reservation(doc, ho, x, now)):
                return True  # an expired hold (a handed one goes back to the queue)
            if isinstance(ho, Mapping) and not ho.get("by"):
                return True  # a handoff nobody published
        spilled = _spilled(doc)
        free_slot = len(holds) < int(doc.get("lim") or 1)
        if (doc.get("q") or spilled) and free_slot and not _none_due(doc, now):
            return True  # a free slot with runs parked (or spilled beyond the window: a refill failed)
        return _past_deadline(doc, now)
    expires = _ms(doc.get("expires_at"))
    if doc.get("owner") is None and not _none_due(doc, now):
        return True  # free, with runs parked that may take it
    ho = doc.get("ho")
    lapsed = doc.get("owner") is not None and (expires is None or expires <= now)
    if lapsed and (expires is None or not _lone_reservation(doc, ho, expires, now)):
        return True  # expired, with runs parked or a handoff pending
    if isinstance(ho, Mapping) and not ho.get("by"):
        return True  # a handoff nobody published
    return _past_deadline(doc, now)


def lone_reservations(doc: Mapping[str, Any]) -> frozenset[str]:
    """The task ids of the lapsed reservations ``needs_sweep`` leaves alone (``_lone_reservation``): the
    sweeper still sweeps the key unless each such run waits parked on another of its keys (then it is not
    ready, nothing is to be published for it, and it is not missing there), since a sweep's handoff is what
    publishes a run whose keys are all reserved, or finds one missing from some of them."""
    now = _ms(doc.get("__now"))
    if now is None:
        return frozenset()
    found = []
    if key_state.serves_slots(doc):
        for hold in doc.get("hs") or []:
            x = _ms(hold.get("x")) if isinstance(hold, Mapping) else None
            if x is not None and x <= now and _lone_reservation(doc, hold.get("ho"), x, now):
                found.append(str(hold["ho"].get("t")))
    else:
        expires, ho = _ms(doc.get("expires_at")), doc.get("ho")
        lapsed = doc.get("owner") is not None and expires is not None and expires <= now
        if (
            lapsed
            and expires is not None
            and isinstance(ho, Mapping)
            and _lone_reservation(doc, ho, expires, now)
        ):
            found.append(str(ho.get("t")))
    return frozenset(found)


@dataclasses.dataclass(frozen=True)
class WaitingKey:
    """A key with parked runs, a pending handoff or results to write, as the sweeper reads it."""

    key: str
    #: A ``limit=N`` key.
    slotted: bool
    #: Task ids of its parked runs, and of the runs it (or a slot of it) is handed to, not yet claimed.
    parked_ids: frozenset[str]
    handed_ids: frozenset[str]
    #: Something for a sweep to do (``needs_sweep``), judged on the server's time of the read.
    needs_sweep: bool
    #: The server's time of the read.
    read_at: _dt.datetime | None
    #: Its parked runs' entries and its handoffs (``runs_of``).
    runs: tuple[Run, ...] = ()
    #: The ranks of its lanes with runs spilled beyond its window (``documents.spill``).
    spilled_ranks: tuple[int, ...] = ()
    #: Task ids of its lapsed reservations left alone while their runs wait parked elsewhere
    #: (``lone_reservations``).
    lone: frozenset[str] = frozenset()
    #: The task names of the runs it (or a slot of it) is handed to, the handoff not lapsed
    #: (``_names_of_live_handoffs``): a worker that does not have one of them leaves the key to others.
    handed_names: frozenset[str] = frozenset()

    @classmethod
    def of(cls, doc: Mapping[str, Any]) -> WaitingKey:
        parked = [e for e in doc.get("q") or [] if isinstance(e, Mapping)]
        handed = _handoffs(doc)
        read_at = doc.get("__now")
        return cls(
            key=str(doc["_id"]),
            slotted=key_state.serves_slots(doc),
            parked_ids=frozenset(str(e.get("t")) for e in parked),
            handed_ids=frozenset(str(ho.get("t")) for ho in handed),
            needs_sweep=needs_sweep(doc),
            lone=lone_reservations(doc),
            handed_names=_names_of_live_handoffs(doc),
            read_at=read_at if isinstance(read_at, _dt.datetime) else None,
            runs=(*parked, *handed),
            spilled_ranks=tuple(
                int(lane.get("r") or 0)
                for lane in doc.get("sp") or []
                if isinstance(lane, Mapping) and int(lane.get("t") or 0) > int(lane.get("h") or 0)
            ),
        )

    def runs_of(self, task_ids: Collection[str]) -> list[Run]:
        """The parked entries and handoffs of the runs ``task_ids`` (parked entries first)."""
        return [run for run in self.runs if str(run.get("t")) in task_ids]


@dataclasses.dataclass(frozen=True)
class Swept:
    """What one sweep of a key left (``LeaseStore.sweep``)."""

    #: The key's fence after the sweep.
    fence: int | None
    #: Runs that timed out while parked (``Queue(timeout=...)``) and were superseded (``Replace``): their
    #: results are still to be written.
    timed_out: tuple[Run, ...] = ()
    superseded: tuple[Run, ...] = ()
    #: Task ids of the runs that hold the key (or a slot of it) or are handed it, after the sweep: a run
    #: the sweeper was asked to drop is not among them unless it took the key meanwhile.
    on_key: frozenset[str] = frozenset()

    @classmethod
    def of(cls, doc: Mapping[str, Any]) -> Swept:
        fence = doc.get("fence")
        held = doc.get("holder") if doc.get("owner") is not None else None  # (kept after a release)
        holders = [held] + [h.get("h") for h in doc.get("hs") or [] if isinstance(h, Mapping)]
        on_key = {str(h.get("task_id")) for h in holders if isinstance(h, Mapping) and h.get("task_id")}
        on_key |= {str(ho.get("t")) for ho in _handoffs(doc)}
        return cls(
            fence=fence if isinstance(fence, int) else None,
            timed_out=tuple(r for r in doc.get("dead") or [] if isinstance(r, Mapping)),
            superseded=tuple(r for r in doc.get("sup") or [] if isinstance(r, Mapping)),
            on_key=frozenset(on_key),
        )
