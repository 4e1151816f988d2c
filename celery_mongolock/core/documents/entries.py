"""A parked run's entry in a key's queue (``q``), as aggregation expressions (no I/O): its fields read
from the document, its order in the queue (``entry_ahead``: its rank, then its send stamp, then its id),
its deadline and not-before time, and the entry a
run parks as (``entry_expr``, ``park_exprs``). The entry's fields are listed in ``queue``'s module doc.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery_mongolock.core.documents.sets import message_fields

__all__ = [
    "MAX_PARKED",
    "PARK_BUDGET",
    "ahead_of",
    "burst_since",
    "dead_entries",
    "entry_ahead",
    "entry_before",
    "entry_bytes",
    "entry_due",
    "entry_expr",
    "field_of",
    "in_place",
    "live_entries",
    "none_ahead",
    "park_exprs",
    "past_ceiling",
    "rank_of_entry",
    "would_pass_budget",
]

Document = dict[str, Any]

_NOW_MS: Document = {"$toLong": "$$NOW"}
_Q: Document = {"$ifNull": ["$q", []]}
#: The most runs parked on one key (``Queue(max_length=...)`` may say fewer): a parked run's entry carries
#: its message, and all of a key's entries share one document.
MAX_PARKED = 5000
#: The most a key's lease document may hold once a run parks on it: MongoDB's 16 MiB document limit, less
#: room for the holder, the handoff and the records kept beside the queue (``dead``, ``sup``, ``seen``).
PARK_BUDGET = 16 * 2**20 - 512 * 2**10


def entry_bytes(entry: Mapping[str, Any]) -> int:
    """About how many bytes ``entry`` adds to a lease document when it parks: its stored message, plus a
    bound for its other fields."""
    message = entry.get("m")
    return (len(message) if isinstance(message, (bytes, str)) else 0) + 2048


def would_pass_budget(entry: Mapping[str, Any]) -> Document:
    """The document (``$$ROOT``) with ``entry`` parked would pass ``PARK_BUDGET``: the queue is full."""
    return {"$gt": [{"$add": [{"$bsonSize": "$$ROOT"}, entry_bytes(entry)]}, PARK_BUDGET]}


def field_of(field: str, doc: object) -> Document:
    return {"$getField": {"field": field, "input": doc}}


def _entry_expired(e: object) -> Document:
    dl = {"$ifNull": [field_of("dl", e), None]}
    return {"$and": [{"$ne": [dl, None]}, {"$lte": [{"$toLong": dl}, _NOW_MS]}]}


def entry_before(e: object, stamp: int, ident: str) -> Document:
    """Entry ``e`` sorts before a run with send stamp ``stamp`` and id ``ident`` ((s, id) order)."""
    s_, id_ = field_of("s", e), field_of("id", e)
    return {
        "$or": [
            {"$lt": [s_, stamp]},
            {"$and": [{"$eq": [s_, stamp]}, {"$lt": [id_, {"$literal": ident}]}]},
        ]
    }


def _rank(e: object) -> Document:
    return {"$ifNull": [field_of("pr", e), 0]}


def entry_ahead(e: object, stamp: int, ident: str, rank: int = 0) -> Document:
    """Entry ``e`` is ahead, in a key's queue, of a run with rank ``rank``, send stamp ``stamp`` and id
    ``ident``: a lower rank (``pr``, 0 when absent: the run's message priority as its broker orders it,
    ``integration.priority``) first, then send order (``entry_before``). The one order every queue of
    the engine keeps (one lease, N slots, several keys): the same for a run on each of its keys, so runs
    that need several keys still reserve them in one total order (``handoff.reserve_pipeline``).
    Supersession (``Replace``) goes by send order alone."""
    r_e = _rank(e)
    return {
        "$or": [
            {"$lt": [r_e, int(rank)]},
            {"$and": [{"$eq": [r_e, int(rank)]}, entry_before(e, stamp, ident)]},
        ]
    }


def none_ahead(q: object, stamp: int, ident: str, rank: int = 0) -> Document:
    """No entry of ``q`` (an array expression) is ahead of the run (``entry_ahead``): it is first in line.
    Every entry, not only the head: a handoff that expired unclaimed goes back to the front of a key's
    slots queue (its turn goes on), out of order, and a run sent between it and the entry behind it
    would pass that entry if only the head were compared (the lock-set checker: a newer run took a free
    slot while an older one waited behind such a handoff)."""
    ahead = {"$map": {"input": q, "as": "e", "in": entry_ahead("$$e", stamp, ident, rank)}}
    return {"$not": [{"$anyElementTrue": [ahead]}]}


def ahead_of(e: object, other: object) -> Document:
    """Entry ``e`` is ahead of entry ``other`` in a key's queue (``entry_ahead``), both expressions."""
    r_e, r_o = _rank(e), _rank(other)
    s_e, s_o = field_of("s", e), field_of("s", other)
    id_e, id_o = field_of("id", e), field_of("id", other)
    return {
        "$or": [
            {"$lt": [r_e, r_o]},
            {
                "$and": [
                    {"$eq": [r_e, r_o]},
                    {
                        "$or": [
                            {"$lt": [s_e, s_o]},
                            {"$and": [{"$eq": [s_e, s_o]}, {"$lt": [id_e, id_o]}]},
                        ]
                    },
                ]
            },
        ]
    }


def rank_of_entry(entry: Mapping[str, Any]) -> int:
    """A run's rank as its entry carries it (0 when absent)."""
    return int(entry.get("pr") or 0)


def dead_entries(q: object) -> Document:
    """Entries of ``q`` past their deadline (for ``dead``), with what ends a run from its message."""
    return {
        "$map": {
            "input": {"$filter": {"input": q, "as": "e", "cond": _entry_expired("$$e")}},
            "as": "e",
            "in": {
                "id": "$$e.id",
                "t": "$$e.t",
                "n": "$$e.n",
                "s": "$$e.s",
                "at": "$$e.at",
                "dl": "$$e.dl",
                "th": "$$e.th",
                # (a run of several keys: its keys, which its stored message's check and ending need)
                "ks": "$$e.ks",
                **message_fields("$$e"),
            },
        }
    }


def entry_due(e: object) -> Document:
    """Entry ``e`` may start now: it has no not-before time (``Replace(debounce=...)``) or it has passed."""
    nb = {"$ifNull": [field_of("nb", e), None]}
    return {"$or": [{"$eq": [nb, None]}, {"$lte": [{"$toLong": nb}, _NOW_MS]}]}


def live_entries(q: object) -> Document:
    return {"$filter": {"input": q, "as": "e", "cond": {"$not": [_entry_expired("$$e")]}}}


def burst_since(older: object, burst: object = None) -> Document:
    """When the burst of sends began waiting that a run superseding the parked entries ``older`` (an array
    expression) continues: the earliest of their ``fw`` (first wait; ``at`` for an entry without one)
    and now (``burst``, an expression, ms, instead of now when not null: the burst the run knows)."""
    # (Compared as milliseconds: the embedded server compares dates in ``$reduce`` wrongly.)
    began = {"$map": {"input": older, "as": "e", "in": first_wait_ms("$$e", {"$toLong": "$$e.at"})}}
    earlier = {"$cond": [{"$lt": ["$$this", "$$value"]}, "$$this", "$$value"]}
    initial: object = _NOW_MS if burst is None else {"$toLong": {"$ifNull": [burst, _NOW_MS]}}
    return {"$toDate": {"$reduce": {"input": began, "initialValue": initial, "in": earlier}}}


def first_wait_ms(e: object, default: object) -> Document:
    """When the burst of entry ``e`` began waiting, in ms: its ``fw``; else the burst its run learned on
    its set's gate (``bu``: a reservation, made from the run's entry without its ``fw``,
    ``handoff.reserve_pipeline``); else ``default``."""
    fw = {"$toLong": {"$ifNull": [field_of("fw", e), None]}}
    return {"$ifNull": [fw, {"$ifNull": [field_of("bu", e), default]}]}


def past_ceiling(e: object, max_wait_ms: int) -> Document:
    """Entry ``e`` (a handoff or reservation) began waiting ``max_wait_ms`` ago or more (``fw``, ``bu``)."""
    return {"$lte": [{"$add": [first_wait_ms(e, _NOW_MS), int(max_wait_ms)]}, _NOW_MS]}


def entry_expr(
    entry: Mapping[str, Any],
    timeout_ms: int | None,
    debounce_ms: int | None = None,
    *,
    max_wait_ms: int | None = None,
    since: object = None,
) -> Document:
    """A parked entry as an aggregation expression: literal fields; ``at`` (parked at), ``dl`` (deadline)
    and ``nb`` (not before: ``Replace(debounce=...)``) on the server's clock. With ``max_wait_ms`` (and
    ``since``, the ``burst_since`` of the runs it supersedes): ``fw``, when its burst began waiting, and
    ``nb`` no later than ``fw`` + ``max_wait_ms`` (``Replace(debounce=..., max_wait=...)``)."""
    expr: Document = {k: {"$literal": v} for k, v in entry.items() if k not in ("at", "dl", "nb", "fw", "mw")}
    expr["at"] = "$$NOW"
    expr["dl"] = None if timeout_ms is None else {"$add": ["$$NOW", int(timeout_ms)]}
    if debounce_ms:
        nb: object = {"$add": ["$$NOW", int(debounce_ms)]}
        if max_wait_ms and since is not None:
            # (In milliseconds: the embedded server compares computed dates wrongly.)
            ceiling = {"$add": [{"$toLong": since}, int(max_wait_ms)]}
            debounced = {"$add": [_NOW_MS, int(debounce_ms)]}
            expr["fw"] = since
            # (the ceiling's length: a burst carried on to this entry later, ``sets.carry_burst``)
            expr["mw"] = int(max_wait_ms)
            nb = {"$toDate": {"$cond": [{"$lt": [ceiling, debounced]}, ceiling, debounced]}}
        expr["nb"] = nb
    return expr


def park_exprs(
    entry: Mapping[str, Any],
    timeout_ms: int | None,
    debounce_ms: int | None,
    *,
    replace: bool,
    max_wait_ms: int | None = None,
) -> tuple[object, object]:
    """``(q, superseded)`` when the run ``entry`` parks: the queue with its entry in its place
    (``entry_ahead``), and the
    runs it supersedes (``Replace``: at most one parked run, a newer send replaces it, and carries on the
    time its burst began waiting: ``max_wait_ms``)."""
    ident, stamp = str(entry["id"]), int(entry["s"])
    since = burst_since(_Q) if replace and max_wait_ms else None
    e = entry_expr(entry, timeout_ms, debounce_ms, max_wait_ms=max_wait_ms, since=since)
    if replace:
        superseded: object = {
            "$map": {
                "input": _Q,
                "as": "p",
                "in": {
                    "t": "$$p.t",
                    "by": {"$literal": entry["t"]},
                    "at": "$$NOW",
                    # for the history: the run, and when it was parked
                    "n": "$$p.n",
                    "r": "$$p.r",
                    "pa": "$$p.at",
                    **message_fields("$$p"),
                },
            }
        }
        return [e], superseded
    return in_place(e, stamp, ident, rank_of_entry(entry)), []


def in_place(e: object, stamp: int, ident: str, rank: int) -> Document:
    """``q`` with the entry expression ``e`` (send stamp ``stamp``, id ``ident``, rank ``rank``) in its
    place: after the entries ahead of it (``entry_ahead``), before the others."""
    ahead = entry_ahead("$$e", stamp, ident, rank)
    return {
        "$concatArrays": [
            {"$filter": {"input": _Q, "as": "e", "cond": ahead}},
            [e],
            {"$filter": {"input": _Q, "as": "e", "cond": {"$not": [ahead]}}},
        ]
    }
