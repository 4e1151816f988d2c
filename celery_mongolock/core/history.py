"""A key's history: how its leases ended (``LeaseEnding``) and why it is not running now (``KeyStory``).

Value objects and pure functions only (no I/O): ``LeaseStore.history`` and ``LeaseStore.why`` read the
documents and build these; ``celery mongolock history`` and ``celery mongolock why`` print them.

Where an ending comes from
==========================
Every command that ends a lease appends its ending to the lease document's ``ends`` (the last 8, see
``_documents``), in the same update: a release (``released``), the worker's parent releasing for a child
that died (``holder-died``), an operator's force-release (``forced``), the acquire that takes over an
expired lease (``expired``), the handoff of a key whose lease expired (``expired``, or
``handoff-expired`` when the run it had been handed to never claimed it), and the acquire of a slot of a
``limit=N`` key that drops expired holds. The process that sent it queues a copy, and its heartbeat thread
inserts the queued copies into ``<collection>.history`` in one ``insert_many`` at its next tick (never on
the task's path). A holder that finds its lease gone records its own view, ``lost``, beside the server's.
``history`` merges the collection with ``ends``, one entry per acquisition (fence): the endings of a
process killed before its tick are still shown from ``ends``.

Runs that never held the key (``Queue``/``Replace``: parked, then ``superseded`` by a newer send, timed out
while parked (``timeout``), or ``revoked`` while parked) get a record of their own (view ``q``), written
from the worker that ends them (the sweeper, or the superseded run itself), in the same batches. Its
``f`` is the key's fence when it ended (so it sorts among the key's leases); ``w`` is how long it was
parked.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
from collections.abc import Mapping, Sequence
from typing import Any

from celery_mongolock.core.documents.base import RUN_VIEW
from celery_mongolock.core.documents.kind_waits import KindWait, waits_in
from celery_mongolock.core.documents.sets import is_gate, user_keys
from celery_mongolock.core.lease_info import aware

__all__ = ["ENDING_KINDS", "RUN_VIEW", "KeyStory", "LeaseEnding", "ParkedRun"]

#: The ways a lease ends, as ``LeaseEnding.how`` says them. ``lost`` is the holder's own view (it found its
#: lease gone); the server's view of the same lease is one of the others. ``handoff-expired``: the key was
#: handed to a parked run that never claimed it. The last four are runs that never held the key
#: (``LeaseEnding.parked``): replaced by a newer send, past their ``Queue(timeout=...)``, revoked, or
#: refused at handoff (their stored message failed the checks of ``_trust``).
ENDING_KINDS = (
    "released",
    "expired",
    "holder-died",
    "forced",
    "lost",
    "handoff-expired",
    "superseded",
    "timeout",
    "revoked",
    "refused",
)


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value)


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


@dataclasses.dataclass(frozen=True)
class LeaseEnding:
    """How one acquisition of a key (one fence) ended.

    ``how``: ``released``, ``expired`` (its holder stopped renewing and another run took the key over;
    ``ended_at`` is the old expiry, ``seen_at`` the takeover), ``holder-died`` (released by the worker's
    parent after the child running it died), ``forced`` (``celery mongolock release --force``),
    ``handoff-expired`` (handed to a parked run that never claimed it), or ``lost`` (only the holder's own
    view is known). ``parked``: a run that never held the key and ended while parked: ``superseded`` (by the
    newer send ``by``), ``timeout`` or ``revoked``; its ``fence`` is the key's when it ended, ``waited_ms``
    how long it was parked. ``holder_saw``/``holder_saw_why``:
    the holder's own view when it found the lease gone (``lost`` and its reason). Times are the server's
    (UTC). ``source``: ``ends`` (the lease document) or ``history`` (the history collection).
    """

    key: str
    fence: int
    how: str
    task_id: str | None = None
    task_name: str | None = None
    delivery: str | None = None
    host: str | None = None
    pid: int | None = None
    worker: str | None = None
    acquired_at: _dt.datetime | None = None
    ended_at: _dt.datetime | None = None
    waited_ms: int | None = None
    seen_at: _dt.datetime | None = None
    holder_saw: str | None = None
    holder_saw_why: str | None = None
    source: str = "ends"
    parked: bool = False
    by: str | None = None

    @classmethod
    def from_record(cls, key: str, record: Mapping[str, Any], source: str = "ends") -> LeaseEnding:
        """From an ending in ``ends`` or a record of the history collection (short field names)."""
        fence = _int(record.get("f"))
        return cls(
            key=key,
            fence=fence if fence is not None else 0,
            how=str(record.get("how") or "?"),
            task_id=_str(record.get("t")),
            task_name=_str(record.get("n")),
            delivery=_str(record.get("run")),
            host=_str(record.get("host")),
            pid=_int(record.get("pid")),
            worker=_str(record.get("worker")),
            acquired_at=aware(record.get("a")),
            ended_at=aware(record.get("e")),
            waited_ms=_int(record.get("w")),
            seen_at=aware(record.get("seen")),
            holder_saw_why=_str(record.get("why")) if record.get("how") == "lost" else None,
            source=source,
            parked=record.get("v") == RUN_VIEW and not record.get("rn"),
            by=_str(record.get("by")),
        )

    @property
    def held_seconds(self) -> float | None:
        """How long the lease was held (acquired to ended), when both are known."""
        if self.acquired_at is None or self.ended_at is None:
            return None
        return max(0.0, (self.ended_at - self.acquired_at).total_seconds())

    @property
    def task(self) -> str:
        """``name[id]`` of the run that held it (what is known of it)."""
        name = self.task_name or "?"
        return f"{name}[{self.task_id}]" if self.task_id else name

    @property
    def where(self) -> str:
        """``worker pid N`` (or ``host pid N``)."""
        who = self.worker or self.host or "?"
        return f"{who} pid {self.pid}" if self.pid is not None else who

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name in ("acquired_at", "ended_at", "seen_at"):
            if data[name] is not None:
                data[name] = data[name].isoformat()
        data["held_seconds"] = self.held_seconds
        return data


def merge_endings(
    key: str,
    ends: Sequence[Mapping[str, Any]],
    stored: Sequence[Mapping[str, Any]],
    limit: int,
    holder_view: str = "h",
) -> list[LeaseEnding]:
    """One ending per fence, newest first: the lease document's ``ends`` beat the collection's copies of
    the same ending (the server's own record); the holder's own view (``v == holder_view``) is attached as
    ``holder_saw``, or stands alone (``how="lost"``) when nothing else is known of that fence."""
    merged: dict[int, LeaseEnding] = {}
    seen_by_holder: dict[int, LeaseEnding] = {}
    runs: dict[str, LeaseEnding] = {}  # runs that ended while parked (or superseded running), by record
    for record in stored:
        ending = LeaseEnding.from_record(key, record, "history")
        if record.get("v") == RUN_VIEW:  # (parked, or a running holder superseded: ``rn``)
            runs.setdefault(str(record.get("_id")), ending)
        elif record.get("v") == holder_view:
            seen_by_holder.setdefault(ending.fence, ending)
        else:
            merged.setdefault(ending.fence, ending)
    for record in ends:
        ending = LeaseEnding.from_record(key, record, "ends")
        merged[ending.fence] = ending
    for fence, own in seen_by_holder.items():
        server = merged.get(fence)
        if server is None:
            merged[fence] = dataclasses.replace(own, holder_saw="lost", holder_saw_why=own.holder_saw_why)
        else:
            merged[fence] = dataclasses.replace(server, holder_saw="lost", holder_saw_why=own.holder_saw_why)

    # A run that ended while parked carries the fence the key had then: it sorts after that lease's
    # acquisition (below its ending, which is at or after it in most cases) and before the next one's. A
    # run ended with no fence known (superseded at its admission, a late send) sorts by its time: after the
    # last lease acquired before it ended (a user's trial: such rows came after newer ones).
    leases = [e for e in merged.values() if e.fence and e.acquired_at is not None]

    def fence_of(e: LeaseEnding) -> int:
        if e.fence or e.ended_at is None:
            return e.fence
        before = [m.fence for m in leases if m.acquired_at is not None and m.acquired_at <= e.ended_at]
        return max(before, default=0)

    def order(e: LeaseEnding) -> tuple[int, int, float]:
        when = e.ended_at.timestamp() if e.ended_at is not None else 0.0
        return (fence_of(e), 0 if e.parked else 1, when)

    return sorted([*merged.values(), *runs.values()], key=order, reverse=True)[:limit]


@dataclasses.dataclass(frozen=True)
class ParkedRun:
    """A run parked on the key (the lease document's ``q``), or the pending handoff (``ho``)."""

    id: str
    task_id: str | None
    task_name: str | None
    #: When it was sent (the sender's clock), from the send stamp.
    sent_at: _dt.datetime | None
    parked_at: _dt.datetime | None
    deadline: _dt.datetime | None
    #: Handoff only: when the key was handed to it, and which attempt this is.
    handed_at: _dt.datetime | None = None
    attempt: int | None = None
    #: A run that needs several keys (``keys=``): all of them.
    keys: tuple[str, ...] = ()

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any]) -> ParkedRun:
        stamp = _int(entry.get("s"))
        sent = None
        if stamp is not None:
            sent = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc) + _dt.timedelta(microseconds=stamp)
        return cls(
            id=str(entry.get("id") or ""),
            task_id=_str(entry.get("t")),
            task_name=_str(entry.get("n")),
            sent_at=sent,
            parked_at=aware(entry.get("at")),
            deadline=aware(entry.get("dl")),
            handed_at=aware(entry.get("hat")),
            attempt=_int(entry.get("hn")),
            # (the task's own keys: a Replace set's gate is not among them)
            keys=tuple(user_keys([str(k) for k in entry.get("ks") or ()])),
        )

    @property
    def task(self) -> str:
        name = self.task_name or "?"
        return f"{name}[{self.task_id}]" if self.task_id else name

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name, value in data.items():
            if isinstance(value, _dt.datetime):
                data[name] = value.isoformat()
        return data


def _ago(seconds: float) -> str:
    """A duration up to the server's time of the read: never below zero (a run parked a few ms after the
    read reads "0.0 s", not "-0.0 s")."""
    return f"{max(0.0, seconds):.1f} s"


def clock(when: _dt.datetime | None) -> str:
    """``HH:MM:SS.s`` (UTC), or ``-``."""
    if when is None:
        return "-"
    when = when.astimezone(_dt.timezone.utc)
    return when.strftime("%H:%M:%S.") + f"{when.microsecond // 100_000}"


@dataclasses.dataclass(frozen=True)
class KeyStory:
    """Why a key is (not) running now: its lease document read in one command, with the server's time.

    ``state``: ``slots`` (a ``limit=N`` key with holds: ``slots``, ``limit``), ``held``,
    ``held-after-release`` (released, but kept taken until its minimum hold ends),
    ``expired`` (its holder stopped renewing; nobody has taken it over yet), or ``free``.
    ``expires_in``: seconds until ``expires_at`` on the server's clock (negative: past, an ``expired``
    key); None when nobody holds the key (``free``, and ``slots``: each hold has its own). ``parked`` and
    ``handoff``: runs waiting for the key, when the queue policy keeps them in the document. ``endings``:
    the last endings (newest first) from the document's ``ends``.
    """

    key: str
    state: str
    server_now: _dt.datetime
    fence: int
    owner: str | None
    holder: dict[str, Any]
    acquired_at: _dt.datetime | None
    renewed_at: _dt.datetime | None
    expires_at: _dt.datetime | None
    expires_in: float | None
    released_at: _dt.datetime | None
    forced_release: bool
    released_for: str | None
    parked: tuple[ParkedRun, ...]
    handoff: ParkedRun | None
    endings: tuple[LeaseEnding, ...]
    #: ``limit=N`` keys: the live holds (``slot``, ``fence``, ``holder``, ``expires_in``) and N.
    slots: tuple[dict[str, Any], ...] = ()
    limit: int | None = None
    #: How many runs are parked (``parked`` holds the first ``LeaseStore.why(parked_limit=...)`` of them).
    parked_total: int = 0
    #: Runs kept aside lately because the key is in use as the other kind (``documents.kind_waits``): not
    #: parked, they come back as contention retries; the longest waiting first.
    other_kind: tuple[KindWait, ...] = ()

    @classmethod
    def from_document(
        cls,
        doc: Mapping[str, Any],
        stored: Sequence[Mapping[str, Any]] = (),
        holder_view: str = "h",
    ) -> KeyStory:
        """From a lease document read with ``_documents.story_pipeline`` (``__now``, ``__expires_in_ms``).
        ``stored``: the key's newest records of the history collection, merged into ``endings`` (runs that
        ended while parked, endings older than ``ends`` keeps); the state is judged on ``ends`` alone."""
        key = str(doc["_id"])
        now = aware(doc.get("__now")) or _dt.datetime.now(_dt.timezone.utc)
        in_ms = doc.get("__expires_in_ms")
        expires_in = None if in_ms is None else float(in_ms) / 1000.0
        owner = _str(doc.get("owner"))
        fence = _int(doc.get("fence")) or 0
        ends = [e for e in doc.get("ends") or [] if isinstance(e, Mapping)]
        endings = tuple(LeaseEnding.from_record(key, e) for e in reversed(ends))
        if owner is None:
            state = "free"
            expires_in = None  # the last holder's expiry, long past: not this free key's
        elif expires_in is None or expires_in <= 0:
            state = "expired"
        elif endings and endings[0].fence == fence:
            state = "held-after-release"
        else:
            state = "held"
        parked = tuple(ParkedRun.from_entry(e) for e in doc.get("q") or [] if isinstance(e, Mapping))
        ho = doc.get("ho")
        if state == "held" and isinstance(ho, Mapping) and doc.get("__handed"):
            state = "handed"  # handed to a parked run (or reserved for a multi-key run), not yet claimed
        slots = []
        for hold in doc.get("hs") or []:
            x = aware(hold.get("x")) if isinstance(hold, Mapping) else None
            if x is not None and x > now:
                h = dict(hold.get("h") or {})
                slots.append(
                    {
                        "slot": hold.get("s"),
                        "fence": hold.get("f"),
                        "holder": h,
                        "expires_in": (x - now).total_seconds(),
                    }
                )
        slots.sort(key=lambda e: int(e["slot"] or 0))
        if slots:
            state = "slots"
        if stored:
            endings = tuple(merge_endings(key, ends, stored, max(len(ends), 8), holder_view))
        return cls(
            key=key,
            state=state,
            server_now=now,
            fence=fence,
            owner=owner,
            holder=dict(doc.get("holder") or {}),
            acquired_at=aware(doc.get("acquired_at")),
            renewed_at=aware(doc.get("renewed_at")),
            expires_at=aware(doc.get("expires_at")),
            expires_in=expires_in,
            released_at=aware(doc.get("released_at")),
            forced_release=bool(doc.get("forced_release")),
            released_for=_str(doc.get("released_for")),
            parked=parked,
            parked_total=int(doc.get("__parked_total", len(parked))),
            handoff=ParkedRun.from_entry(ho) if isinstance(ho, Mapping) else None,
            endings=endings,
            slots=tuple(slots),
            limit=_int(doc.get("lim")) if slots else None,
            other_kind=waits_in(doc, now),
        )

    # -- phrases -------------------------------------------------------------------------------------
    def _since(self, when: _dt.datetime | None) -> float | None:
        return None if when is None else (self.server_now - when).total_seconds()

    @property
    def holder_phrase(self) -> str:
        """``worker@host pid 123 (task name[id])``: who holds (or last held) the key."""
        h = self.holder
        who = str(h.get("worker") or h.get("host") or "?")
        if h.get("pid") is not None:
            who += f" pid {h['pid']}"
        name = h.get("task_name") or h.get("role")
        if name or h.get("task_id"):
            task = str(name or "?") + (f"[{h['task_id']}]" if h.get("task_id") else "")
            who += f" (task {task})"
        return who

    def _other_kind_phrase(self) -> str:
        """The runs that wait to take the key as the other kind (``documents.kind_waits``)."""
        n, first = len(self.other_kind), self.other_kind[0]
        runs = "1 run waits" if n == 1 else f"{n} runs wait"
        kinds = {w.wants for w in self.other_kind}
        as_what = (
            "as a single lease"
            if kinds == {"single"}
            else "as a slot"
            if kinds == {"slots"}
            else "as the other kind"
        )
        waited = self._since(first.since)
        since = f", the first for {_ago(waited)}" if waited is not None else ""
        return f"{runs} to take it {as_what} (not parked: each comes back within 5 s){since}: {first.task}"

    def _parked_phrase(self) -> str:
        n = max(self.parked_total, len(self.parked))
        if not n:
            return ""
        first = self.parked[0]
        runs = "1 run" if n == 1 else f"{n} runs"
        parked_for = self._since(first.parked_at)
        since = f", parked {_ago(parked_for)} ago" if parked_for is not None else ""
        return f"{runs} parked; next: {first.task}{since}"

    @property
    def verdict(self) -> str:
        """One line: why the key is (not) running now (for a ``Replace`` set's gate, said first)."""
        line = self._verdict()
        if self.other_kind:
            line += f"; {self._other_kind_phrase()}"
        if is_gate(self.key):
            return f"the gate of a Replace task's set of keys (its runs supersede each other here): {line}"
        return line

    def _verdict(self) -> str:
        parked = self._parked_phrase()
        if self.state == "slots":
            who = ", ".join(
                f"slot {s['slot']}: {_holder_text(s['holder'])} (expires in {s['expires_in']:.1f} s)"
                for s in self.slots
            )
            n, limit = len(self.slots), self.limit or len(self.slots)
            if n >= limit:
                return f"all {limit} slots held ({who}): the next run waits for one to be free"
            return f"{n} of {limit} slots held ({who}): the next run takes a slot at once"
        if self.state == "handed" and self.handoff is not None:
            handed = self._since(self.handoff.handed_at)
            when = f" {_ago(handed)} ago" if handed is not None else ""
            others = [k for k in user_keys(self.handoff.keys) if k != self.key]
            if others:
                line = (
                    f"reserved{when} for {self.handoff.task}, a run of several keys, which takes its other "
                    f"keys ({', '.join(others)}) one at a time in key order, then runs"
                )
            else:
                line = (
                    f"handed{when} to {self.handoff.task}, not taken up yet "
                    f"(attempt {self.handoff.attempt}); "
                    f"handed again in {self.expires_in or 0.0:.1f} s (server's clock) if it does not claim it"
                )
            return f"{line}; {parked}" if parked else line
        if self.state in ("held", "held-after-release"):
            since = f" since {clock(self.acquired_at)}" if self.acquired_at else ""
            left = f"expires in {self.expires_in:.1f} s on the server's clock"
            if self.state == "held-after-release":
                ended = self.endings[0]
                line = (
                    f"released by {self.holder_phrase} at {clock(ended.ended_at)}, but kept taken until its "
                    f"minimum hold ends: free in {self.expires_in:.1f} s on the server's clock"
                )
            else:
                line = f"held by {self.holder_phrase}{since}, {left}"
            return f"{line}; {parked}" if parked else line
        if self.state == "expired" and self.handoff is not None and len(self.handoff.keys) > 1:
            ago = -(self.expires_in or 0.0)
            later = ", ".join(k for k in user_keys(self.handoff.keys) if k != self.key)
            line = (
                f"reserved for {self.handoff.task}, a run of several keys that waits for a later one "
                f"({later}); the reservation lapsed {ago:.1f} s ago and is left for it (it still claims "
                "it; a run that parks here puts it back in send order)"
            )
            return f"{line}; {parked}" if parked else line
        if self.state == "expired":
            ago = -(self.expires_in or 0.0)
            line = f"expired {ago:.1f} s ago, not yet taken over: {self.holder_phrase} stopped renewing it"
            return f"{line}; {parked}" if parked else line
        if self.handoff is not None:
            handed = self._since(self.handoff.handed_at)
            when = f" {_ago(handed)} ago" if handed is not None else ""
            line = f"free, handed off to {self.handoff.task}{when} and not taken up yet"
            return f"{line}; {parked}" if parked else line
        if parked:
            return f"free, but {parked}"
        last = next((e for e in self.endings if not e.parked), None)  # the last lease, not a parked run
        if last is not None:
            return f"free ({self.ending_phrase(last)}): the next run takes it at once"
        return "free: the next run takes it at once"

    def ending_phrase(self, ending: LeaseEnding) -> str:
        """``released 3.2 s ago by name[id]``: one ending, relative to the server's time of the read."""
        ago = self._since(ending.ended_at)
        when = f" {_ago(ago)} ago" if ago is not None and ago >= 0 else ""
        if ending.how == "released":
            return f"released{when} by {ending.task}"
        if ending.how == "forced":
            return f"force-released{when} from {ending.task}"
        if ending.how == "holder-died":
            return f"released{when} for {ending.task}, whose worker process died"
        if ending.how == "expired":
            return f"expired{when}: {ending.task} stopped renewing"
        if ending.how == "handoff-expired":
            return f"handed to {ending.task}, which never claimed it (expired{when})"
        if ending.how == "superseded":
            by = f" by {ending.by}" if ending.by else ""
            return f"{ending.task} superseded{when}{by} while parked"
        if ending.how == "timeout":
            return f"{ending.task} timed out{when} while parked"
        if ending.how == "revoked":
            return f"{ending.task} revoked{when} while parked"
        if ending.how == "refused":
            return f"{ending.task} refused{when} at handoff: its stored message failed the checks"
        return f"{ending.how}{when}: {ending.task}"

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"verdict": self.verdict}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, _dt.datetime):
                value = value.isoformat()
            elif field.name in ("parked", "endings", "other_kind"):
                value = [v.as_dict() for v in value]
            elif field.name == "handoff" and value is not None:
                value = value.as_dict()
            data[field.name] = value
        return data


def _holder_text(holder: Mapping[str, Any]) -> str:
    task = holder.get("task_name") or holder.get("role") or "?"
    if holder.get("task_id"):
        task = f"{task}[{holder['task_id']}]"
    if holder.get("handed"):
        return f"{task}, handed to it, not taken up yet"
    where = ":".join(str(holder[k]) for k in ("host", "pid") if holder.get(k) is not None)
    return f"{task} on {where}" if where else str(task)
