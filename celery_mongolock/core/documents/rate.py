"""A key's start window (``RateLimit``, ``Throttle``): the rate document and its arithmetic, pure (no I/O).

Each rate-limited key has one document of its own in the ``<collection>.rates`` collection (``_id`` is
the lease key), apart from its lease document: the rate is about *starts over time* and outlives any one
lease (a lease document is deleted by the TTL index when free; the window must not be)::

    s:    [{t: date, id: start id}, ...]     # the starts inside the window, oldest first
    w:    [{id: run, st: send stamp, x: date}, ...]   # runs parked by the rate (until x: stale after)
    seen: date                               # the window's clock at the last command (never goes back)
    n, p: int                                # the rate of the last run that took a start (``why`` shows it)
    exp:  date                               # the TTL index's field: nothing in it matters after it

**The window's clock** is the server's, never going back: a command's time is the later of its ``$$NOW``
and the window's ``seen`` (``_WINDOW_NOW_MS``). A server binds ``$$NOW`` when a command begins, before it
takes the document: a command held up in between (a busy server, a paused thread) can write after one
that began later, and judged with its own earlier ``$$NOW`` it would count the starts a later command
had already pruned as gone and take a start at a time before the last one (issue 30: three starts of a
``RateLimit(2, 2)`` key in 1.97 s, reproduced on the embedded server with one command held up 0.4 s).

**Taking a start** is one ``findAndModify`` (``take_update``), judged on the window's clock: the starts
at or before ``NOW - period`` leave the window, stale parked runs leave ``w``, and the run gets the start
if the window's starts plus the parked runs sent before it are fewer than ``n`` (send order: a window's
free starts go to the earliest-sent runs waiting, and a later send never takes the place of an earlier
one). Then its start is appended in the same command, so two workers can never both take the n+1-th
start. A run
that does not get it is recorded in ``w`` (unless it is to be dropped) and told, by ``next_start_ms`` on
the reply, when its turn comes.

The window is half-open: a start at ``t`` counts against ``[t, t + period)``; at most ``n`` starts fall
in any interval of ``period`` seconds.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "RateWindow",
    "Waiter",
    "give_back_update",
    "next_start_ms",
    "starts_in_any_window",
    "take_update",
]

Document = dict[str, Any]

_NOW_MS: Document = {"$toLong": "$$NOW"}
#: The window's clock for a command (epoch ms): ``$$NOW``, or the window's ``seen`` if that is later (the
#: clock of a command that wrote first although it began later). Compared as milliseconds: the embedded
#: server's ``$max`` of dates is wrong.
_WINDOW_NOW_MS: Document = {"$max": [_NOW_MS, {"$toLong": {"$ifNull": ["$seen", "$$NOW"]}}]}
_CLOCK = "$__now"  # the field the first stage sets to ``_WINDOW_NOW_MS``


def _ms(value: Any) -> int:
    """A BSON date (aware or naive UTC datetime) as epoch milliseconds."""
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=_dt.timezone.utc)
        return int(value.timestamp() * 1000)
    return int(value)


def take_update(
    *,
    start_id: str,
    run: str,
    stamp: int,
    n: int,
    period_ms: int,
    park: bool,
    stale_ms: int,
    rank: int = 0,
    replaces: str | None = None,
) -> list[Document]:
    """The update pipeline of one attempt to start (upsert on ``{_id: key}``, reply AFTER).

    ``start_id`` names this attempt's start (given back with ``give_back_update``); ``run`` and ``stamp``
    place the run among the parked ones (by ``(stamp, run)``); ``park``: record the run in ``w`` when it
    does not get the start (False for ``then=Skip()``); ``stale_ms``: how long a parked entry counts after
    this command if its run does not come back (its worker died, its message was lost); ``rank``: its
    message priority as the key's queue orders it (``pr``, lower first: ``entries.entry_ahead``), so that
    the window serves its runs in the order the key hands them over (priority, then send order).
    ``replaces`` (a ``Replace`` run: its task and set of keys): the runs of that group sent before it and
    waiting in the window leave it now, since this newer send supersedes them when they come back; their
    turns are its to take (before, each kept its turn until it came back to be superseded, and the newest
    waited one period more per superseded send)."""
    r_e = {"$ifNull": ["$$e.pr", 0]}
    sent_before = {
        "$or": [
            {"$lt": ["$$e.st", stamp]},
            {"$and": [{"$eq": ["$$e.st", stamp]}, {"$lt": ["$$e.id", run]}]},
        ]
    }
    earlier = {"$or": [{"$lt": [r_e, rank]}, {"$and": [{"$eq": [r_e, rank]}, sent_before]}]}
    fresh_starts = {
        "$filter": {
            "input": {"$ifNull": ["$s", []]},
            "as": "e",
            "cond": {"$gt": [{"$toLong": "$$e.t"}, {"$subtract": [_CLOCK, period_ms]}]},
        }
    }
    live_waiters = _waiters_kept(run, stamp, replaces)
    # Room for this run *and* for every run parked before it: those keep their place in this window
    # whether or not their copies are back yet (a late copy costs its own start, not the key's rate).
    ahead = {"$size": {"$filter": {"input": "$w", "as": "e", "cond": earlier}}}
    ok = {"$lt": [{"$add": [{"$size": "$s"}, ahead]}, n]}
    now = {"$toDate": _CLOCK}
    me: Document = {"id": run, "st": stamp, "x": {"$toDate": {"$add": [_CLOCK, stale_ms]}}}
    if rank:
        me["pr"] = {"$literal": int(rank)}
    if replaces is not None:
        me["g"] = {"$literal": replaces}
    waiters: Any = {"$concatArrays": ["$w", [me]]} if park else "$w"
    expires_ms = {"$add": [_CLOCK, period_ms + stale_ms]}
    # The TTL index's field only ever moves later. Compared as milliseconds: the embedded server's ``$max``
    # of a stored date and ``$$NOW + x`` returns its first argument, which kept ``exp`` at the window's
    # first start and let the TTL monitor delete a window in use (its starts forgotten: n more at once).
    exp = {"$toDate": {"$max": [{"$toLong": {"$ifNull": ["$exp", "$$NOW"]}}, expires_ms]}}
    return [
        {"$set": {"__now": _WINDOW_NOW_MS}},
        {"$set": {"s": fresh_starts, "w": live_waiters}},
        {"$set": {"__ok": ok}},
        {
            "$set": {
                "s": {"$cond": ["$__ok", {"$concatArrays": ["$s", [{"t": now, "id": start_id}]]}, "$s"]},
                "w": {"$cond": ["$__ok", "$w", waiters]},
                "seen": now,
                "n": n,
                "p": period_ms,
                "exp": exp,
            }
        },
        {"$unset": ["__ok", "__now"]},
    ]


def _waiters_kept(run: str, stamp: int, replaces: str | None) -> Document:
    """The window's parked runs a take keeps: those not stale, other than ``run`` itself, and (a
    ``Replace`` run, ``replaces``) not the runs of its group it supersedes: strictly older, and never
    another attempt of its very task, as supersession judges them."""
    keep: list[Document] = [{"$gt": [{"$toLong": "$$e.x"}, _CLOCK]}, {"$ne": ["$$e.id", run]}]
    if replaces is not None:
        task_of = {"$arrayElemAt": [{"$split": ["$$e.id", "/"]}, 0]}
        superseded = {
            "$and": [
                {"$eq": [{"$ifNull": ["$$e.g", None]}, {"$literal": replaces}]},
                {"$lt": ["$$e.st", stamp]},
                {"$ne": [task_of, {"$literal": run.split("/", 1)[0]}]},
            ]
        }
        keep.append({"$not": [superseded]})
    return {"$filter": {"input": {"$ifNull": ["$w", []]}, "as": "e", "cond": {"$and": keep}}}


def give_back_update(start_id: str) -> Document:
    """The update that gives back a start whose body never ran (another key of the run said wait)."""
    return {"$pull": {"s": {"id": start_id}}}


@dataclasses.dataclass(frozen=True)
class Waiter:
    """A run parked by the rate: its id, send stamp and when its entry goes stale (epoch ms)."""

    run: str
    stamp: int
    stale_at_ms: int
    #: Its message priority as the key's queue orders it (lower first; 0: none).
    rank: int = 0


@dataclasses.dataclass(frozen=True)
class RateWindow:
    """A key's window as the last command left it: the starts (epoch ms, server clock), the parked runs
    (oldest send first), and the server's clock at that command."""

    key: str
    starts_ms: tuple[int, ...]
    start_ids: tuple[str, ...]
    waiters: tuple[Waiter, ...]
    now_ms: int
    #: The rate of the last run that took a start here (0 when unknown).
    n: int = 0
    period_ms: int = 0

    @classmethod
    def of(cls, key: str, doc: Mapping[str, Any] | None) -> RateWindow:
        """The typed view of a rate document (None: a key that never started a rate-limited run)."""
        if not doc:
            return cls(key, (), (), (), 0)
        starts = sorted(((_ms(e["t"]), str(e.get("id", ""))) for e in doc.get("s") or ()), key=lambda p: p[0])
        waiters = sorted(
            (
                Waiter(str(e["id"]), int(e["st"]), _ms(e["x"]), int(e.get("pr") or 0))
                for e in doc.get("w") or ()
            ),
            key=lambda w: (w.rank, w.stamp, w.run),
        )
        now = _ms(doc["seen"]) if doc.get("seen") is not None else 0
        return cls(
            key,
            tuple(t for t, _ in starts),
            tuple(i for _, i in starts),
            tuple(waiters),
            now,
            int(doc.get("n") or 0),
            int(doc.get("p") or 0),
        )

    def granted(self, start_id: str) -> bool:
        """Whether the command that left this window gave ``start_id`` its start."""
        return start_id in self.start_ids

    def position(self, run: str) -> int:
        """How many parked runs come before ``run`` (of a higher priority, or sent earlier); all of them when
        it is not parked."""
        for i, waiter in enumerate(self.waiters):
            if waiter.run == run:
                return i
        return len(self.waiters)

    def next_start_in(self) -> float:
        """Seconds until the next run parked here (or a new one) may start, on the server's clock."""
        if not self.n or not self.period_ms:
            return 0.0
        return max(
            0.0, (next_start_ms(self.starts_ms, self.n, self.period_ms, self.now_ms) - self.now_ms) / 1000
        )

    def in_window(self, period_ms: int, at_ms: int | None = None) -> int:
        """How many starts fall in ``(at - period, at]`` (``at``: the last command's clock)."""
        at = self.now_ms if at_ms is None else at_ms
        return sum(1 for t in self.starts_ms if at - period_ms < t <= at)


def next_start_ms(starts_ms: Sequence[int], n: int, period_ms: int, now_ms: int, position: int = 0) -> int:
    """When the run with ``position`` runs parked before it may start (epoch ms), if each of those starts
    as early as the window allows: the earliest time at which the window holds fewer than ``n`` starts,
    ``position + 1`` times over. ``starts_ms``: the starts so far (any order, older ones ignored)."""
    times = sorted(t for t in starts_ms if t > now_ms - period_ms)
    when = now_ms
    for _ in range(position + 1):
        oldest_that_counts = len(times) - n
        when = now_ms if oldest_that_counts < 0 else max(now_ms, times[oldest_that_counts] + period_ms)
        times.append(when)
    return when


def starts_in_any_window(starts_ms: Sequence[float], period_ms: float) -> int:
    """The most starts that fall in one half-open interval ``[a, a + period)``: what a rate of ``n`` per
    ``period`` keeps at or below ``n`` (the checkers judge recorded start times with it)."""
    times = sorted(starts_ms)
    most, first = 0, 0
    for last, t in enumerate(times):
        while times[first] <= t - period_ms:
            first += 1
        most = max(most, last - first + 1)
    return most
