"""``limit=N`` with ``Queue``/``Replace``: parked runs handed one of N slots, as pure pipeline builders.

A key with a limit keeps its holds in ``hs`` (see ``_slots``) and its parked runs in ``q`` (see
``_admission``): one document, so that a release hands the freed slot to the oldest parked run in the
same command. A slot handed to a parked run is a hold like any other, with the run's handoff token as its
owner and the entry in ``ho`` until the run claims it::

    hs: [{o: token, f, s, x, t, a, h, w, ho: entry + {hat, hn, by} | null}, ...]

A handed hold counts against the limit from the moment it is handed, expires on the server's clock as
any hold, and is handed again (same token, attempt ``hn`` + 1) when nobody claimed it by then. Every
command that writes such a key ends the same way: expired holds leave (the handed ones go back to the
front of the queue), parked runs past their deadline move to ``dead``, and every free slot goes to the
oldest due parked run, with fences that strictly increase over all of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from celery_mongolock.core.documents import queue as adm
from celery_mongolock.core.documents import sets, slot_sets
from celery_mongolock.core.documents import slots as _slots
from celery_mongolock.core.documents.slot_reserve import requeue_in_send_order

__all__ = [
    "HANDED",
    "SLOT_HANDOFF_PROJECTION",
    "fill_stages",
    "slot_admit_pipeline",
    "slot_force_release_handoff_pipeline",
    "slot_release_dead_handoff_pipeline",
    "slot_release_handoff_pipeline",
    "slot_sweep_pipeline",
    "slot_unpark_pipeline",
]

Document = dict[str, Any]

#: What a command that may hand slots over returns: the holds (with their handoffs), the fence, the
#: supersessions and the limit.
SLOT_HANDOFF_PROJECTION: Document = {"hs": 1, "fence": 1, "sup": 1, "lim": 1}
_NOW_MS: Document = {"$toLong": "$$NOW"}
_HS: Document = {"$ifNull": ["$hs", []]}
_Q: Document = {"$ifNull": ["$q", []]}


def _has_ho(e: str) -> Document:
    return {"$ne": [{"$ifNull": [f"{e}.ho", None]}, None]}


#: True when a slot of the key is handed to a parked run that has not claimed it yet.
HANDED: Document = {"$gt": [{"$size": {"$filter": {"input": _HS, "as": "e", "cond": _has_ho("$$e")}}}, 0]}


def live_entries(e: str) -> Document:
    return {"$gt": [{"$toLong": f"{e}.x"}, _NOW_MS]}


def _fence_base() -> Document:
    return {"$max": [{"$add": [{"$ifNull": ["$fence", 0]}, 1]}, {"$multiply": [_NOW_MS, 1000]}]}


def _handed_back(gone: str, *, several: bool) -> Document:
    """The entries of the handed holds among ``gone``: of runs that need several keys (``ks``), or not."""
    multi = {"$isArray": "$$e.ho.ks"}
    cond = {"$and": [_has_ho("$$e"), multi if several else {"$not": [multi]}]}
    return {
        "$map": {"input": {"$filter": {"input": gone, "as": "e", "cond": cond}}, "as": "e", "in": "$$e.ho"}
    }


def normalize_stages(keep_owner: str | None = None) -> list[Document]:
    """Expired holds leave ``hs``: a handed one's entry goes back to the front of ``q`` (it keeps its
    token and attempt count), or, for a run that needs several keys (a reservation, ``slot_reserve``),
    to its place in send order; any other is appended to ``ends`` as ``expired``; parked runs past their
    deadline move to ``dead``. ``keep_owner``: a hold kept even if expired (the handoff being claimed)."""
    keep: Document = live_entries("$$e")
    if keep_owner is not None:
        keep = {"$or": [keep, {"$eq": ["$$e.o", {"$literal": keep_owner}]}]}
    gone = {"$filter": {"input": _HS, "as": "e", "cond": {"$not": [keep]}}}
    return [
        {"$set": {"__gone": gone, "hs": {"$filter": {"input": _HS, "as": "e", "cond": keep}}}},
        {
            "$set": {
                "q": requeue_in_send_order(
                    {"$concatArrays": [_handed_back("$__gone", several=False), _Q]},
                    _handed_back("$__gone", several=True),
                ),
                # (a hold released inside its minimum hold got its ending at its release)
                "__died": {
                    "$filter": {
                        "input": "$__gone",
                        "as": "e",
                        "cond": {"$not": [{"$or": [_has_ho("$$e"), _slots.released("$$e")]}]},
                    }
                },
            }
        },
        {
            "$set": {
                "ends": {
                    "$cond": [
                        {"$gt": [{"$size": "$__died"}, 0]},
                        _slots._append_endings("$__died", "expired"),
                        "$ends",
                    ]
                },
                "dead": {"$concatArrays": [{"$ifNull": ["$dead", []]}, adm.dead_entries(_Q)]},
                "q": adm.live_entries(_Q),
            }
        },
        {"$unset": ["__gone", "__died"]},
    ]


def fill_stages(by: str) -> list[Document]:
    """Hand every free slot (of ``lim``) to the oldest due parked runs, one hold each, in send order.
    ``by`` marks the handoffs this command made (its author publishes them). Expects ``hs`` and ``q``
    as ``normalize_stages`` leaves them."""
    used = {"$map": {"input": _HS, "as": "e", "in": "$$e.s"}}
    free = {
        "$filter": {
            "input": {"$range": [0, {"$toInt": {"$ifNull": ["$lim", 1]}}]},
            "as": "s",
            "cond": {"$not": [{"$in": ["$$s", used]}]},
        }
    }
    single_held = adm.SINGLE_HELD
    hold = {
        "$let": {
            "vars": {"h": {"$arrayElemAt": ["$__hd", "$$i"]}, "s": {"$arrayElemAt": ["$__fs", "$$i"]}},
            "in": {
                "o": "$$h.tk",
                "f": {"$add": ["$__base", "$$i"]},
                "s": "$$s",
                "x": {"$add": ["$$NOW", "$$h.ttl"]},
                "t": "$$h.ttl",
                "a": "$$NOW",
                "h": {"task_id": "$$h.t", "task_name": "$$h.n", "delivery": "$$h.r", "handed": True},
                "w": {"$max": [0, {"$subtract": [_NOW_MS, {"$toLong": "$$h.at"}]}]},
                "ho": {
                    "$mergeObjects": [
                        "$$h",
                        {
                            "hat": "$$NOW",
                            "hn": {"$add": [{"$ifNull": ["$$h.hn", 0]}, 1]},
                            "by": {"$literal": by},
                        },
                    ]
                },
            },
        }
    }
    return [
        {
            "$set": {
                "__fs": {"$cond": [single_held, [], free]},
                "__dq": {"$filter": {"input": _Q, "as": "e", "cond": adm.entry_due("$$e")}},
            }
        },
        {"$set": {"__k": {"$min": [{"$size": "$__fs"}, {"$size": "$__dq"}]}, "__base": _fence_base()}},
        {"$set": {"__hd": {"$cond": [{"$gt": ["$__k", 0]}, {"$slice": ["$__dq", "$__k"]}, []]}}},
        {
            "$set": {
                "hs": {
                    "$concatArrays": [
                        _HS,
                        {"$map": {"input": {"$range": [0, "$__k"]}, "as": "i", "in": hold}},
                    ]
                },
                "q": {
                    "$filter": {
                        "input": _Q,
                        "as": "e",
                        "cond": {
                            "$not": [
                                {"$in": ["$$e.id", {"$map": {"input": "$__hd", "as": "d", "in": "$$d.id"}}]}
                            ]
                        },
                    }
                },
                "fence": {"$cond": [{"$gt": ["$__k", 0]}, {"$add": ["$__base", "$__k", -1]}, "$fence"]},
            }
        },
        {"$unset": ["__fs", "__dq", "__k", "__base", "__hd"]},
        {"$set": {"sx": _slots._latest_expiry("$hs")}},
    ]


def _seen_of(gone: object) -> Document:
    """``seen`` with the runs of the released holds ``gone`` appended (the duplicate guard)."""
    ids = {
        "$map": {
            "input": {
                "$filter": {
                    "input": gone,
                    "as": "e",
                    "cond": {"$ne": [{"$ifNull": ["$$e.h.task_id", None]}, None]},
                }
            },
            "as": "e",
            "in": {
                "$concat": [
                    {"$toString": "$$e.h.task_id"},
                    "/",
                    {"$toString": {"$ifNull": ["$$e.h.delivery", ""]}},
                ]
            },
        }
    }
    return {"$slice": [{"$concatArrays": [{"$ifNull": ["$seen", []]}, ids]}, -adm.SEEN_KEPT]}


def _then_hand(drop: list[Document], by: str) -> list[Document]:
    """``drop`` (a ``_slots`` pipeline ending with the gc stage), then the freed slots handed."""
    assert drop[-1] == adm.gc_stage(), "a _slots pipeline ends with the gc stage"
    return [*drop[:-1], *normalize_stages(), *fill_stages(by), adm.gc_stage()]


def slot_release_handoff_pipeline(
    tokens: Iterable[str], by: str = "", *, seen: bool = True
) -> list[Document]:
    """Release the holds of ``tokens``; the freed slots go to the oldest parked runs (``by``). ``seen``:
    their runs are remembered as over (not for holds whose run never got them)."""
    toks = list(tokens)
    ours = {"$and": [{"$in": ["$$e.o", {"$literal": toks}]}, {"$not": [_slots.released("$$e")]}]}
    mine = {"$filter": {"input": _HS, "as": "e", "cond": ours}}
    remember = [{"$set": {"seen": _seen_of(mine)}}] if seen else []
    # (a hold whose run never ran, ``seen=False``, keeps no minimum hold: it held nothing for anyone)
    return [*remember, *_then_hand(_slots.slot_release_pipeline(toks, keep_min_hold=seen), by)]


def slot_release_dead_handoff_pipeline(holder: Mapping[str, Any], by: str = "") -> list[Document]:
    """Release the holds of a holder that died; the freed slots go to the oldest parked runs."""
    return _then_hand(_slots.slot_release_dead_pipeline(holder), by)


def slot_force_release_handoff_pipeline(by: str = "") -> list[Document]:
    """An operator's release of every hold of the key (a slot handed to a parked run and not yet claimed
    stays handed); the freed slots go to the oldest parked runs."""
    return _then_hand(_slots.slot_force_release_pipeline(), by)


def slot_admit_pipeline(
    token: str,
    ttl_ms: int,
    holder: Mapping[str, Any],
    limit: int,
    *,
    entry: Mapping[str, Any],
    timeout_ms: int | None,
    claim: str | None,
    max_length: int | None,
    replace: bool = False,
    debounce_ms: int | None = None,
    due: bool = False,
    max_wait_ms: int | None = None,
    waited_ms: int | None = None,
    min_hold_ms: int = 0,
    group: str | None = None,
) -> list[Document]:
    """The admit of a queued run on a ``limit=N`` key (one command): take a free slot when no older run
    is parked, claim the slot handed to this run, or park the run; then hand every free slot to the
    oldest parked runs. The outcomes are those of ``_admission.admit_pipeline`` (in ``lo``).
    ``min_hold_ms``: the slot taken or claimed stays taken at least that long (``slots`` module doc).
    ``group`` (with ``replace``): the signature of the run's set of keys (``Replace`` with ``keys=`` and a
    limit): supersession among the runs of that set only (``slot_sets``)."""
    by_set = replace and group is not None
    ident = str(entry["id"])
    stamp = int(entry["s"])
    n = int(limit)
    single_held = adm.SINGLE_HELD
    room = {"$and": [{"$lt": [{"$size": _HS}, _slots.effective_limit(_HS, n)]}, {"$not": [single_held]}]}
    ids = {"$map": {"input": _Q, "as": "e", "in": "$$e.id"}}
    handed = {"$filter": {"input": _HS, "as": "e", "cond": _has_ho("$$e")}}
    handed_ids = {"$map": {"input": handed, "as": "e", "in": "$$e.ho.id"}}
    dead_ids = {"$map": {"input": {"$ifNull": ["$dead", []]}, "as": "d", "in": "$$d.id"}}
    head = {"$arrayElemAt": [_Q, 0]}
    first = {"$or": [{"$eq": [{"$size": _Q}, 0]}, {"$not": [adm.entry_before(head, stamp, ident)]}]}
    owners = {"$map": {"input": _HS, "as": "e", "in": "$$e.o"}}
    running = {
        "$gt": [
            {
                "$size": {
                    "$filter": {
                        "input": _HS,
                        "as": "e",
                        "cond": {
                            "$and": [
                                {"$not": [_has_ho("$$e")]},
                                {"$not": [_slots.released("$$e")]},  # (over: kept for its min hold)
                                {"$eq": ["$$e.h.task_id", {"$literal": entry["t"]}]},
                                {"$eq": ["$$e.h.delivery", {"$literal": entry.get("r")}]},
                            ]
                        },
                    }
                }
            },
            0,
        ]
    }
    branches: list[Document] = [{"case": {"$in": [{"$literal": token}, owners]}, "then": "mine"}]
    if claim is not None:
        claimable = {
            "$gt": [
                {
                    "$size": {
                        "$filter": {
                            "input": handed,
                            "as": "e",
                            "cond": {
                                "$and": [
                                    {"$eq": ["$$e.o", {"$literal": claim}]},
                                    {"$eq": ["$$e.ho.tk", {"$literal": claim}]},
                                ]
                            },
                        }
                    }
                },
                0,
            ]
        }
        # (never while the key is held or handed as a single lease: a key mixed with single leases)
        branches.append({"case": {"$and": [claimable, {"$not": [single_held]}]}, "then": "claimed"})
    if due:
        due_now = [room, {"$eq": [adm.field_of("id", head), {"$literal": ident}]}, adm.entry_due(head)]
        branches.append({"case": {"$and": due_now}, "then": "due"})
    branches += [
        {
            "case": {
                "$or": [
                    {"$in": [{"$literal": ident}, ids]},
                    {"$in": [{"$literal": ident}, handed_ids]},
                    {"$in": [{"$literal": ident}, dead_ids]},
                ]
            },
            "then": "dup",
        },
    ]
    retries = adm.retries_of(entry.get("r"))
    if retries is not None:
        # A copy of an attempt whose body retried (a later attempt is known here): never run again.
        branches.append({"case": adm.later_attempt(str(entry["t"]), retries), "then": "retried"})
    branches += [
        {"case": {"$in": [{"$literal": ident}, {"$ifNull": ["$seen", []]}]}, "then": "done"},
        {"case": running, "then": "running"},
    ]
    if by_set:
        assert group is not None
        # (before ``stale``: a claim of a run whose reservation a newer send of its set took back)
        branches += slot_sets.superseded_cases(group, stamp)
    if claim is not None:
        branches.append({"case": {"$literal": True}, "then": "stale"})
    if replace and not by_set:
        last_s = {"$ifNull": ["$last.s", -1]}
        parked_s = {"$max": {"$map": {"input": _Q, "as": "e", "in": "$$e.s"}}}
        handed_s = {"$max": {"$map": {"input": handed, "as": "e", "in": "$$e.ho.s"}}}
        branches += [
            {"case": {"$gt": [last_s, stamp]}, "then": "superseded"},
            {"case": {"$gt": [{"$ifNull": [parked_s, -1]}, stamp]}, "then": "superseded"},
            {"case": {"$gt": [{"$ifNull": [handed_s, -1]}, stamp]}, "then": "superseded"},
        ]
    if not debounce_ms:
        branches.append({"case": {"$and": [room, first]}, "then": "acquired"})
    branches.append({"case": room, "then": "parked"})  # and handed a slot at once, below
    cap = adm.MAX_PARKED if max_length is None else min(int(max_length), adm.MAX_PARKED)
    branches.append({"case": {"$gte": [{"$size": _Q}, cap]}, "then": "full"})

    parked_q, superseded_new = adm.park_exprs(
        entry, timeout_ms, debounce_ms, replace=replace, max_wait_ms=max_wait_ms
    )
    take_back: list[Document] = []
    if by_set:
        assert group is not None
        # The newest send of its set the key knows (parked, taking, claiming or due a slot): the older
        # runs of its set leave the key, their reserved or handed slots freed (``slot_sets``).
        newest = {"$in": ["$__o", ["parked", "acquired", "claimed", "due"]]}
        take_back = [slot_sets.take_back_stage(entry, group, newest)]
        parked_q, superseded_new = slot_sets.parked_queue(entry, timeout_ms, group), []
    used = {"$map": {"input": _HS, "as": "e", "in": "$$e.s"}}
    new_hold = {
        "o": {"$literal": token},
        "f": "$__base",
        "s": {"$min": {"$setDifference": [{"$range": [0, n]}, used]}},
        "x": {"$add": ["$$NOW", int(ttl_ms)]},
        "t": int(ttl_ms),
        "a": "$$NOW",
        "h": {"$literal": dict(holder)},
        "w": None if waited_ms is None else int(waited_ms),
        **_slots.min_hold_fields(min_hold_ms),
    }
    claimed_hold = {
        "$mergeObjects": [
            "$$e",
            {
                "o": {"$literal": token},
                "x": {"$add": ["$$NOW", int(ttl_ms)]},
                "t": int(ttl_ms),
                "h": {"$literal": dict(holder)},
                "w": {
                    "$max": [0, {"$subtract": [_NOW_MS, {"$toLong": {"$ifNull": ["$$e.ho.at", "$$NOW"]}}]}]
                },
                "ho": None,
                **_slots.min_hold_fields(min_hold_ms),  # from the claim: when the run takes the slot
            },
        ]
    }
    fields: Document = {
        "hs": {
            "$switch": {
                "branches": [
                    {"case": "$__new", "then": {"$concatArrays": [_HS, [new_hold]]}},
                    {
                        "case": {"$eq": ["$__o", "claimed"]},
                        "then": {
                            "$map": {
                                "input": _HS,
                                "as": "e",
                                "in": {
                                    "$cond": [
                                        {"$eq": ["$$e.o", {"$literal": claim}]},
                                        claimed_hold,
                                        "$$e",
                                    ]
                                },
                            }
                        },
                    },
                ],
                "default": "$hs",
            }
        },
        "fence": {"$cond": ["$__new", "$__base", "$fence"]},
        "lim": {
            "$cond": [
                {"$or": ["$__new", {"$eq": [{"$ifNull": ["$lim", None]}, None]}]},
                _slots.effective_limit(_HS, n),
                "$lim",
            ]
        },
        "q": {
            "$switch": {
                "branches": [
                    {"case": {"$eq": ["$__o", "parked"]}, "then": parked_q},
                    {
                        "case": {"$eq": ["$__o", "due"]},
                        "then": {"$filter": {"input": _Q, "as": "e", "cond": {"$ne": ["$$e.id", ident]}}},
                    },
                ],
                "default": "$q",
            }
        },
        "sup": {
            "$cond": [
                {"$eq": ["$__o", "parked"]},
                {"$concatArrays": [{"$ifNull": ["$sup", []]}, superseded_new]},
                "$sup",
            ]
        },
        "lo": {"$cond": [{"$eq": ["$__o", "mine"]}, "acquired", "$__o"]},
    }
    if by_set:
        assert group is not None
        fields["lo_by"] = {"$cond": [{"$eq": ["$__o", "superseded"]}, slot_sets.newer_by(group, stamp), None]}
        fields["lg"] = sets.lg_update(
            group, stamp, str(entry["t"]), {"$in": ["$__o", ["acquired", "claimed", "due"]]}
        )
    elif replace:
        newer_by = {
            "$cond": [
                {"$gt": [{"$ifNull": ["$last.s", -1]}, stamp]},
                "$last.t",
                {
                    "$cond": [
                        {
                            "$gt": [
                                {
                                    "$ifNull": [
                                        {"$max": {"$map": {"input": handed, "as": "e", "in": "$$e.ho.s"}}},
                                        -1,
                                    ]
                                },
                                stamp,
                            ]
                        },
                        {"$arrayElemAt": [{"$map": {"input": handed, "as": "e", "in": "$$e.ho.t"}}, -1]},
                        {"$arrayElemAt": [{"$map": {"input": _Q, "as": "e", "in": "$$e.t"}}, -1]},
                    ]
                },
            ]
        }
        fields["lo_by"] = {"$cond": [{"$eq": ["$__o", "superseded"]}, newer_by, None]}
        fields["last"] = {
            "$cond": [
                {
                    "$and": [
                        {"$in": ["$__o", ["acquired", "claimed", "due"]]},
                        {"$gt": [stamp, {"$ifNull": ["$last.s", -1]}]},
                    ]
                },
                {"s": stamp, "t": {"$literal": entry["t"]}},
                "$last",
            ]
        }
    return [
        *normalize_stages(keep_owner=claim),
        {"$set": {"__o": {"$switch": {"branches": branches, "default": "parked"}}, "__base": _fence_base()}},
        {"$set": {"__new": {"$in": ["$__o", ["acquired", "due"]]}}},
        *take_back,
        {"$set": fields},
        {"$unset": ["__o", "__new", "__base"]},
        *fill_stages(adm.admit_marker(token)),
        adm.gc_stage(),
    ]


def slot_unpark_pipeline(entry_id: str, by: str) -> list[Document]:
    """Remove the run ``entry_id`` from a ``limit=N`` key: its parked entry, and the slot handed to it
    and not yet claimed (a hold whose owner is its handoff token); the freed slots go to the oldest
    parked runs (``by``), as a release hands them."""
    ident = {"$literal": entry_id}
    handed_to_it = {
        "$and": [{"$eq": [{"$ifNull": ["$$e.ho.id", None]}, ident]}, {"$eq": ["$$e.o", "$$e.ho.tk"]}]
    }
    return [
        {
            "$set": {
                "q": {"$filter": {"input": _Q, "as": "e", "cond": {"$ne": ["$$e.id", ident]}}},
                "hs": {"$filter": {"input": _HS, "as": "e", "cond": {"$not": [handed_to_it]}}},
            }
        },
        *normalize_stages(),
        *fill_stages(by),
        adm.gc_stage(),
    ]


def slot_sweep_pipeline(by: str, revoked: list[str]) -> list[Document]:
    """The sweeper's command for a ``limit=N`` key: expired holds leave (handed ones go back to the
    queue), revoked runs leave the queue (a slot handed to one is freed), runs past their deadline move
    to ``dead``, free slots go to the oldest parked runs, and handoffs nobody published are adopted."""
    rv = {"$literal": revoked}
    revoked_hold = {"$and": [_has_ho("$$e"), {"$in": ["$$e.ho.t", rv]}]}
    adopt = {
        "$map": {
            "input": _HS,
            "as": "e",
            "in": {
                "$cond": [
                    {"$and": [_has_ho("$$e"), {"$eq": [{"$ifNull": ["$$e.ho.by", ""]}, ""]}]},
                    {
                        "$mergeObjects": [
                            "$$e",
                            {"ho": {"$mergeObjects": ["$$e.ho", {"by": {"$literal": by}}]}},
                        ]
                    },
                    "$$e",
                ]
            },
        }
    }
    return [
        *normalize_stages(),
        {
            "$set": {
                "q": {"$filter": {"input": _Q, "as": "e", "cond": {"$not": [{"$in": ["$$e.t", rv]}]}}},
                "hs": {"$filter": {"input": _HS, "as": "e", "cond": {"$not": [revoked_hold]}}},
            }
        },
        *fill_stages(by),
        {"$set": {"hs": adopt}},
        adm.gc_stage(),
    ]
