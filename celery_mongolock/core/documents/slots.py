"""``limit=N``: up to N holds of one key at once, as pure pipeline builders (no I/O).

A key with a limit keeps its holds in the lease document's ``hs`` array, one entry per hold, so that
taking a slot is one atomic command that sees every other hold, and the fence is one counter for the
key: it strictly increases over every hold of every slot. ``owner`` stays null on such a key (and a
single lease cannot be taken while any slot is held, nor a slot while a single lease is)::

    hs:  [{o: token, f: fence, s: slot (0..N-1), x: expires at, t: ttl ms, a: acquired at,
           h: holder {host, pid, task_name, task_id, worker, delivery, ...},
           m: held until (min_hold_seconds; absent without one), rl: true (released, kept until m)}, ...]
    lim: N                # the limit of the last hold taken
    fence: ...            # the key's fence: the largest given to any hold
    sx: ...               # the latest ``x`` any hold of the key has had (``expires_at`` stays the
                          # single lease's own): the TTL index's ``gc_at`` follows it

Expiry is judged per hold on the server's clock; a hold past its ``x`` is dropped by the next command
that takes a slot of the key, or by a worker's sweeper (``keys_with_expired_holds_filter``).

A minimum hold (``min_hold_seconds``) works per slot as it does for a single lease: a hold taken with one
carries ``m`` (its acquisition plus the minimum, server clock), and a release before ``m`` keeps the slot
taken until then (the hold stays in ``hs`` as released: ``rl``, ``x = m``, never renewed again, its ending
recorded at the release). At ``m`` it expires like any hold: the next command on the key, or the sweeper,
drops it and hands the slot to the oldest parked run. So ``limit=3, min_hold_seconds=60`` starts at most
3 runs of a key in any 60 s. A hold given back by a run that never ran (``seen=False``) keeps no minimum.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from celery_mongolock.core.documents.copies import ran_any
from celery_mongolock.core.documents.key_state import SINGLE_HELD, gc_stage
from celery_mongolock.core.documents.lanes import spilled_total

__all__ = [
    "any_expired",
    "append_endings",
    "effective_limit",
    "keys_with_expired_holds_filter",
    "latest_expiry",
    "live_tokens_pipeline",
    "min_hold_fields",
    "released",
    "renew_tokens_filter",
    "renew_tokens_pipeline",
    "slot_acquire_pipeline",
    "slot_held_by_filter",
    "slot_release_dead_pipeline",
    "slot_release_filter",
    "slot_release_pipeline",
    "slot_tokens_filter",
]

Document = dict[str, Any]

_NOW_MS: Document = {"$toLong": "$$NOW"}
_HS: Document = {"$ifNull": ["$hs", []]}
_ENDS_KEPT = 8


def _live_cond(var: str) -> Document:
    return {"$gt": [{"$toLong": f"{var}.x"}, _NOW_MS]}


def released(var: str) -> Document:
    """The hold ``var`` was released inside its minimum hold, and is kept until ``m`` (then ``x``)."""
    return {"$eq": [{"$ifNull": [f"{var}.rl", False]}, True]}


def _renewable(var: str) -> Document:
    """The hold ``var`` is live and not released (a released hold is never renewed: it ends at ``m``)."""
    return {"$and": [_live_cond(var), {"$not": [released(var)]}]}


def min_hold_fields(min_hold_ms: int) -> Document:
    """The fields of a new hold for a minimum hold: ``m``, the server's now plus the minimum."""
    return {"m": {"$add": ["$$NOW", int(min_hold_ms)]}} if min_hold_ms > 0 else {}


def latest_expiry(hs: object) -> Document:
    """``sx`` of a slotted key: the latest expiry of its holds and of the key's earlier ones (the ``sx``
    before), so that it never goes back. Like a single lease's ``expires_at`` after its release, it keeps
    a key whose holds were all released or dropped collectable by the TTL index once that time is past
    (null there: never deleted). Compared as numbers: the embedded server's ``$max`` over dates ignored
    a date just computed from ``$$NOW`` (an ``sx`` before a live hold's expiry)."""
    held = {"$max": {"$map": {"input": hs, "as": "e", "in": {"$toLong": "$$e.x"}}}}
    return {"$toDate": {"$max": [{"$toLong": "$sx"}, held]}}


def any_expired(hs: object = _HS) -> Document:
    """A hold of ``hs`` has expired on the server's clock (handed ones included)."""
    return {"$anyElementTrue": [{"$map": {"input": hs, "as": "e", "in": {"$not": [_live_cond("$$e")]}}}]}


def keys_with_expired_holds_filter() -> Document:
    """``limit=N`` keys that nothing waits on (no ``wq``: the sweeper's other list) with a hold past its
    expiry on the server's clock: its holder died or stopped renewing, and no command has touched the
    key since. ``hs.o`` is indexed (sparse): the candidates are the keys with holds at all."""
    return {"hs.o": {"$exists": True}, "wq": {"$exists": False}, "$expr": any_expired()}


def _handed(var: str) -> Document:
    """The hold ``var`` is a slot handed to a parked run, not yet claimed (``_slot_admission``)."""
    return {"$ne": [{"$ifNull": [f"{var}.ho", None]}, None]}


def effective_limit(holds: object, limit: int) -> Document:
    """The limit a new hold is judged by: ``limit``, or the key's own (``lim``) if smaller while other
    holds exist. Two tasks that guard one key with different limits then never exceed the smaller one
    (and ``lim`` only grows again once the key is empty)."""
    n = int(limit)
    return {"$cond": [{"$gt": [{"$size": holds}, 0]}, {"$min": [n, {"$ifNull": ["$lim", n]}]}, n]}


def _gc() -> Document:
    return gc_stage()


def _ending(entry: str, how: str, unrun: bool = False) -> Document:
    """The ending of the hold ``entry`` (a ``$$`` variable), in the shape of ``_documents.ending_expr``;
    ``unrun``: a hold given back by a run that did not end (``u``: not a run that ended, for
    ``outcomes.run_ended``)."""
    return {
        **({"u": {"$literal": True}} if unrun else {}),
        "f": f"{entry}.f",
        "t": f"{entry}.h.task_id",
        "n": {"$ifNull": [f"{entry}.h.task_name", f"{entry}.h.role"]},
        "run": f"{entry}.h.delivery",
        "host": f"{entry}.h.host",
        "pid": f"{entry}.h.pid",
        "worker": f"{entry}.h.worker",
        "a": f"{entry}.a",
        "e": "$$NOW",
        "w": f"{entry}.w",
        "how": {"$literal": how},
        "slot": f"{entry}.s",
    }


def append_endings(ended: object, how: str, *, unrun: bool = False) -> Document:
    """``ends`` with the endings of the holds in ``ended`` appended (the last few kept)."""
    new = {"$map": {"input": ended, "as": "g", "in": _ending("$$g", how, unrun)}}
    return {"$slice": [{"$concatArrays": [{"$ifNull": ["$ends", []]}, new]}, -_ENDS_KEPT]}


def slot_acquire_pipeline(
    token: str,
    ttl_ms: int,
    holder: Mapping[str, Any],
    limit: int,
    *,
    waited_ms: int | None = None,
    tick: int | None = None,
    ended_runs: Sequence[str] = (),
    min_hold_ms: int = 0,
) -> list[Document]:
    """Take a slot of the key for ``token`` if fewer than ``limit`` holds are live, nobody holds it as a
    single lease and no run is parked on it; ``token``'s own hold (a retry of an acquire whose reply was
    lost) counts as taken. The new hold gets the lowest free slot number and the key's next fence.
    ``tick``: once per tick (a beat-sent run): refused for a tick at or before the last that took a slot.
    ``ended_runs``: a copy's run ids; refused when one of them is remembered as over (``ran_any``).
    ``min_hold_ms``: a release before then keeps the slot taken until then (``m``, module doc)."""
    return [
        _look_stage(token, holder),
        _take_stage(limit, tick=tick, ended_runs=ended_runs),
        _write_stage(token, ttl_ms, holder, limit, waited_ms=waited_ms, tick=tick, min_hold_ms=min_hold_ms),
        {"$set": {"sx": latest_expiry("$hs")}},
        {"$unset": ["__mine", "__live", "__expired", "__fence", "__take", "__dup"]},
        _gc(),
    ]


def _look_stage(token: str, holder: Mapping[str, Any]) -> Document:
    """The slot acquire's look: ``__mine`` (our own live hold: an acquire's retry), ``__dup`` (a hold of
    the same run), the holds kept (``__live``) and expired (``__expired``), and the next fence."""
    live_tokens = {
        "$map": {
            "input": {"$filter": {"input": _HS, "as": "e", "cond": _live_cond("$$e")}},
            "as": "e",
            "in": "$$e.o",
        }
    }
    same_run_hold = {
        "$and": [
            _renewable("$$e"),  # (a released hold's run is over: ``ended_runs``)
            {"$ne": ["$$e.o", {"$literal": token}]},
            {"$eq": ["$$e.h.task_id", {"$literal": holder.get("task_id")}]},
            {"$eq": ["$$e.h.delivery", {"$literal": holder.get("delivery")}]},
        ]
    }
    same_run = {"$gt": [{"$size": {"$filter": {"input": _HS, "as": "e", "cond": same_run_hold}}}, 0]}
    # A slot handed to a parked run stays taken until the sweeper hands it again, even past its expiry
    # (dropping it would lose the run: its message lives in the handoff).
    kept = {"$or": [_live_cond("$$e"), _handed("$$e")]}
    fence = {"$max": [{"$add": [{"$ifNull": ["$fence", 0]}, 1]}, {"$multiply": [_NOW_MS, 1000]}]}
    return {
        "$set": {
            "__mine": {"$in": [{"$literal": token}, live_tokens]},
            "__dup": same_run if holder.get("task_id") is not None else False,
            "__live": {"$filter": {"input": _HS, "as": "e", "cond": kept}},
            "__expired": {"$filter": {"input": _HS, "as": "e", "cond": {"$not": [kept]}}},
            "__fence": fence,
        }
    }


def _take_stage(limit: int, *, tick: int | None, ended_runs: Sequence[str]) -> Document:
    """``__take``: a slot is free for this acquire, nobody holds the key as a single lease, no run is
    parked on it, and the run is neither a copy of one holding a slot nor of one over."""
    nobody_parked = {
        "$and": [
            {"$eq": [{"$size": {"$ifNull": ["$q", []]}}, 0]},
            {"$eq": [{"$ifNull": ["$ho", None]}, None]},
            {"$eq": [spilled_total(), 0]},  # runs spilled beyond the window (``spill``) wait too
        ]
    }
    return {
        "$set": {
            "__take": {
                "$and": [
                    {"$not": ["$__mine"]},
                    {"$not": ["$__dup"]},  # a copy of a run that holds a slot now takes none
                    {"$lt": [{"$size": "$__live"}, effective_limit("$__live", limit)]},
                    {"$not": [SINGLE_HELD]},
                    nobody_parked,
                    True if tick is None else {"$lt": [{"$ifNull": ["$last_tick", -1]}, int(tick)]},
                    {"$not": [ran_any(ended_runs)]} if ended_runs else True,
                ]
            }
        }
    }


def _write_stage(
    token: str,
    ttl_ms: int,
    holder: Mapping[str, Any],
    limit: int,
    *,
    waited_ms: int | None,
    tick: int | None,
    min_hold_ms: int,
) -> Document:
    """The holds kept, with the new hold (the lowest free slot, the next fence) when ``__take``; the
    endings of the expired holds recorded."""
    used = {"$map": {"input": "$__live", "as": "e", "in": "$$e.s"}}
    hold = {
        "o": {"$literal": token},
        "f": "$__fence",
        "s": {"$min": {"$setDifference": [{"$range": [0, int(limit)]}, used]}},
        "x": {"$add": ["$$NOW", int(ttl_ms)]},
        "t": int(ttl_ms),
        "a": "$$NOW",
        "h": {"$literal": dict(holder)},
        "w": None if waited_ms is None else int(waited_ms),
        **min_hold_fields(min_hold_ms),
    }
    # A released hold that reached its ``m`` leaves without a second ending (it got one at its release).
    died = {"$filter": {"input": "$__expired", "as": "e", "cond": {"$not": [released("$$e")]}}}
    return {
        "$set": {
            "hs": {"$cond": ["$__take", {"$concatArrays": ["$__live", [hold]]}, "$__live"]},
            "fence": {"$cond": ["$__take", "$__fence", "$fence"]},
            "lim": {"$cond": ["$__take", effective_limit("$__live", limit), "$lim"]},
            **({} if tick is None else {"last_tick": {"$cond": ["$__take", int(tick), "$last_tick"]}}),
            "ends": {
                "$cond": [
                    {"$gt": [{"$size": died}, 0]},
                    append_endings(died, "expired"),
                    "$ends",
                ]
            },
        }
    }


def slot_tokens_filter(tokens: Iterable[str]) -> Document:
    """The keys holding a slot for any of ``tokens``."""
    return {"hs.o": {"$in": list(tokens)}}


def slot_release_filter(tokens: Iterable[str]) -> Document:
    """The keys holding a slot for any of ``tokens`` that is not released yet (a hold released inside its
    minimum hold stays, ``rl``, and is not released twice)."""
    return {"hs": {"$elemMatch": {"o": {"$in": list(tokens)}, "rl": {"$ne": True}}}}


def _single_live(toks: Document) -> Document:
    """A single lease (no ``limit``) of one of ``toks`` that has not expired on the server's clock."""
    return {
        "$and": [
            {"$in": [{"$ifNull": ["$owner", None]}, toks]},
            {"$gt": [{"$toLong": "$expires_at"}, _NOW_MS]},
        ]
    }


def _my_live_holds(toks: Document) -> Document:
    return {
        "$filter": {
            "input": _HS,
            "as": "e",
            "cond": {"$and": [{"$in": ["$$e.o", toks]}, _renewable("$$e")]},
        }
    }


def renew_tokens_filter(tokens: Iterable[str], *, single: bool = True, slots: bool = True) -> Document:
    """The heartbeat's one update a tick, both document shapes: the single leases of ``tokens``
    (``single``) and the keys holding a slot of ``tokens`` (``slots``). Plain index lookups (``owner``,
    ``hs.o``): liveness on the server's clock is judged by ``renew_tokens_pipeline``, which renews only
    live leases and leaves a document with none of them unchanged. So when no key holds two of
    ``tokens``, the update's *modified* count equals the number of live leases, and a smaller count says
    some were lost (see ``live_tokens_pipeline``)."""
    toks = list(tokens)
    branches = ([{"owner": {"$in": toks}}] if single else []) + ([{"hs.o": {"$in": toks}}] if slots else [])
    if len(branches) == 1:
        return branches[0]
    return {"$or": branches}


def renew_tokens_pipeline(tokens: Iterable[str], *, single: bool = True) -> list[Document]:
    """Extend every live lease of ``tokens`` by its own ttl from now (server clock), whatever the
    document's shape: a single lease's ``expires_at`` (unless ``single=False``: only slots are renewed),
    or the holds of ``tokens`` in ``hs``. An expired lease or hold is not revived, and a document with no
    live lease of ``tokens`` is left as it was (every field this sets is derived from the document
    itself), so that the update's modified count counts the documents where a lease was renewed."""
    toks = {"$literal": list(tokens)}
    renewed = {
        "$map": {
            "input": _HS,
            "as": "e",
            "in": {
                "$cond": [
                    {"$and": [{"$in": ["$$e.o", toks]}, _renewable("$$e")]},
                    {"$mergeObjects": ["$$e", {"x": {"$add": ["$$NOW", "$$e.t"]}}]},
                    "$$e",
                ]
            },
        }
    }
    slotted = {"$isArray": "$hs"}
    renew: Document = {"hs": {"$cond": [slotted, renewed, "$$REMOVE"]}}
    stages: list[Document] = []
    if single:
        stages.append({"$set": {"__s": _single_live(toks)}})
        renew["expires_at"] = {"$cond": ["$__s", {"$add": ["$$NOW", "$ttl_ms"]}, "$expires_at"]}
        renew["renewed_at"] = {"$cond": ["$__s", "$$NOW", "$renewed_at"]}
    stages += [
        {"$set": renew},
        {"$set": {"sx": {"$cond": [slotted, latest_expiry("$hs"), "$$REMOVE"]}}},
    ]
    if single:
        stages.append({"$unset": ["__s"]})
    return [*stages, _gc()]


def live_tokens_pipeline(tokens: Iterable[str]) -> list[Document]:
    """For an aggregate, when the renewal's matched count says some lease was lost: which of ``tokens``
    still hold a live lease, single or slot (one document per key: ``live``)."""
    toks = list(tokens)
    lit = {"$literal": toks}
    return [
        {"$match": {"$or": [{"owner": {"$in": toks}}, {"hs.o": {"$in": toks}}]}},
        {
            "$project": {
                "live": {
                    "$concatArrays": [
                        {"$cond": [_single_live(lit), ["$owner"], []]},
                        {"$map": {"input": _my_live_holds(lit), "as": "e", "in": "$$e.o"}},
                    ]
                }
            }
        },
    ]


def _untick(tick: int | None) -> list[Document]:
    """The stage that takes beat tick ``tick`` back from the key when it is the key's last (none without)."""
    if tick is None:
        return []
    last = {"$cond": [{"$eq": ["$last_tick", int(tick)]}, int(tick) - 1, "$last_tick"]}
    return [{"$set": {"last_tick": last}}]


def _drop(cond_on_e: Document, how: str, *, unrun: bool = False, untick: int | None = None) -> list[Document]:
    gone = {"$filter": {"input": _HS, "as": "e", "cond": cond_on_e}}
    kept = {"$filter": {"input": _HS, "as": "e", "cond": {"$not": [cond_on_e]}}}
    return [
        {"$set": {"__gone": gone, "hs": kept}},
        {
            "$set": {
                "ends": append_endings("$__gone", how, unrun=unrun),
                "sx": latest_expiry("$hs"),
            }
        },
        {"$unset": ["__gone"]},
        *_untick(untick),
        _gc(),
    ]


def slot_release_pipeline(
    tokens: Iterable[str], *, keep_min_hold: bool = True, unrun: bool = False, untick: int | None = None
) -> list[Document]:
    """Release the holds of ``tokens``: the slot is free at once, unless its minimum hold (``m``) has
    not passed: then the hold stays, released (``rl``), until ``m`` (``keep_min_hold=False``: a hold
    given back by a run that never ran keeps no minimum). Either way the ending is recorded now, once:
    a hold already released is left as it is. ``unrun``/``untick``: as ``release_pipeline`` says (a hold
    given back by its run: its ending is marked ``u``; its tick, if the key's last, goes back below it)."""
    toks = {"$literal": list(tokens)}
    ours = {"$and": [{"$in": ["$$e.o", toks]}, {"$not": [released("$$e")]}]}
    if not keep_min_hold:
        return _drop(ours, "released", unrun=unrun, untick=untick)
    holding = {"$gt": [{"$toLong": {"$ifNull": ["$$e.m", 0]}}, _NOW_MS]}
    kept = {
        "$map": {
            "input": _HS,
            "as": "e",
            "in": {
                "$cond": [
                    {"$and": [ours, holding]},
                    {"$mergeObjects": ["$$e", {"x": "$$e.m", "rl": True}]},
                    "$$e",
                ]
            },
        }
    }
    gone = {"$and": [ours, {"$not": [holding]}]}
    return [
        {"$set": {"__rel": {"$filter": {"input": _HS, "as": "e", "cond": ours}}}},
        {"$set": {"ends": append_endings("$__rel", "released"), "hs": kept}},
        {"$set": {"hs": {"$filter": {"input": _HS, "as": "e", "cond": {"$not": [gone]}}}}},
        {"$set": {"sx": latest_expiry("$hs")}},
        {"$unset": ["__rel"]},
        _gc(),
    ]


def slot_held_by_filter(holder: Mapping[str, Any]) -> Document:
    """Keys with a hold whose holder matches every field of ``holder``."""
    return {"hs": {"$elemMatch": {f"h.{k}": v for k, v in holder.items()}}}


def slot_release_dead_pipeline(holder: Mapping[str, Any]) -> list[Document]:
    """Release the holds of a holder that died (the worker's parent, for a killed child)."""
    cond = {"$and": [{"$eq": [f"$$e.h.{k}", {"$literal": v}]} for k, v in holder.items()]}
    # (a hold its run released inside its minimum hold is over already, and stays until its ``m``)
    return _drop({"$and": [cond, {"$not": [released("$$e")]}]}, "holder-died")


def slot_force_release_pipeline() -> list[Document]:
    """An operator's release of every hold of the key (a slot handed to a parked run stays handed)."""
    return _drop({"$not": [_handed("$$e")]}, "forced")
