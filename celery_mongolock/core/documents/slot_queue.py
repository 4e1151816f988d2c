"""``limit=N`` with ``Queue``/``Replace``: parked runs handed one of N slots, as pure pipeline builders
(the admit of such a run is ``slot_admit``; these are the stages it shares, and the releases, the
unpark and the sweep that hand freed slots over).

A key with a limit keeps its holds in ``hs`` (see ``_slots``) and its parked runs in ``q`` (see
``_admission``): one document, so that a release hands the freed slot to the oldest parked run in the
same command. A slot handed to a parked run is a hold like any other, with the run's handoff token as its
owner and the entry in ``ho`` until the run claims it::

    hs: [{o: token, f, s, x, t, a, h, w, ho: entry + {hat, hn, by} | null}, ...]

A handed hold counts against the limit from the moment it is handed, expires on the server's clock as
any hold, and is handed again (same token, attempt ``hn`` + 1) when nobody claimed it by then. Every
command that writes such a key ends the same way: expired holds leave (the handed ones go back to the
front of the queue), parked runs past their deadline move to ``dead``, and every free slot goes to the
oldest due parked run, with fences that strictly increase over all of them; not to a run of a rank whose
lower ranks have runs spilled beyond the window (``lanes.spilled_before``: a refill brings those first),
unless their lane is marked blocked (``bk``: the document cannot take its next run yet), nor to a run of
several keys while older runs of its rank may be spilled (``lanes.held_back``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from celery_mongolock.core.documents import sets, spill
from celery_mongolock.core.documents import slots as _slots
from celery_mongolock.core.documents.copies import SEEN_KEPT
from celery_mongolock.core.documents.entries import dead_entries, entry_due, live_entries
from celery_mongolock.core.documents.key_state import KIND_ONE, KIND_SLOTS, SINGLE_HELD, gc_stage, parked_as
from celery_mongolock.core.documents.lanes import SPILL_PROJECTION, held_back, spill_bars, spilled_before
from celery_mongolock.core.documents.slot_reserve import requeue_in_send_order

__all__ = [
    "HANDED",
    "SLOT_HANDOFF_PROJECTION",
    "fence_base",
    "fill_stages",
    "has_handoff",
    "normalize_stages",
    "slot_fill_pipeline",
    "slot_force_release_handoff_pipeline",
    "slot_refill_pipeline",
    "slot_release_dead_handoff_pipeline",
    "slot_release_handoff_pipeline",
    "slot_sweep_pipeline",
    "slot_unpark_pipeline",
]

Document = dict[str, Any]

#: What a command that may hand slots over returns: the holds (with their handoffs), the fence, the
#: supersessions and the limit.
SLOT_HANDOFF_PROJECTION: Document = {"hs": 1, "fence": 1, "sup": 1, "lim": 1, **SPILL_PROJECTION}
_NOW_MS: Document = {"$toLong": "$$NOW"}
_HS: Document = {"$ifNull": ["$hs", []]}
_Q: Document = {"$ifNull": ["$q", []]}


def has_handoff(e: str) -> Document:
    return {"$ne": [{"$ifNull": [f"{e}.ho", None]}, None]}


#: True when a slot of the key is handed to a parked run that has not claimed it yet.
HANDED: Document = {"$gt": [{"$size": {"$filter": {"input": _HS, "as": "e", "cond": has_handoff("$$e")}}}, 0]}


#: The runs of sets (``Replace`` with ``keys=``) a key has, as ``{g, s}`` (set, send stamp): parked (``q``),
#: handed or reserved a slot and not yet claimed (``hs[].ho``), or holding one (a slot taken or claimed,
#: not released: its holder's ``set`` and ``sent``). ``sets.behind_its_set`` looks for an older run of an
#: entry's set among them.
SET_RUNS: Document = {
    "$concatArrays": [
        {
            "$map": {
                "input": {
                    "$filter": {"input": _Q, "as": "e", "cond": {"$ne": [{"$ifNull": ["$$e.g", None]}, None]}}
                },
                "as": "e",
                "in": {"g": "$$e.g", "s": "$$e.s"},
            }
        },
        {
            "$map": {
                "input": {
                    "$filter": {
                        "input": _HS,
                        "as": "h",
                        "cond": {
                            "$and": [has_handoff("$$h"), {"$ne": [{"$ifNull": ["$$h.ho.g", None]}, None]}]
                        },
                    }
                },
                "as": "h",
                "in": {"g": "$$h.ho.g", "s": "$$h.ho.s"},
            }
        },
        {
            "$map": {
                "input": {
                    "$filter": {
                        "input": _HS,
                        "as": "h",
                        "cond": {
                            "$and": [
                                {"$not": [has_handoff("$$h")]},
                                {"$not": [_slots.released("$$h")]},
                                {"$ne": [{"$ifNull": ["$$h.h.set", None]}, None]},
                            ]
                        },
                    }
                },
                "as": "h",
                "in": {"g": "$$h.h.set", "s": "$$h.h.sent"},
            }
        },
    ]
}


def live_hold(e: str) -> Document:
    """Hold ``e`` has not expired."""
    return {"$gt": [{"$toLong": f"{e}.x"}, _NOW_MS]}


def fence_base() -> Document:
    """The fence of the first hold a command gives: above the key's last and above the clock's."""
    return {"$max": [{"$add": [{"$ifNull": ["$fence", 0]}, 1]}, {"$multiply": [_NOW_MS, 1000]}]}


def _handed_back(gone: str, *, several: bool) -> Document:
    """The entries of the handed holds among ``gone``: of runs that need several keys (``ks``), or not."""
    multi = {"$isArray": "$$e.ho.ks"}
    cond = {"$and": [has_handoff("$$e"), multi if several else {"$not": [multi]}]}
    return {
        "$map": {"input": {"$filter": {"input": gone, "as": "e", "cond": cond}}, "as": "e", "in": "$$e.ho"}
    }


#: Per hold gone (``__gone``): whether it was handed to a parked run (its run goes back to ``q``).
_HANDED_GONE: Document = {"$map": {"input": "$__gone", "as": "e", "in": has_handoff("$$e")}}


def normalize_stages(keep_owner: str | None = None) -> list[Document]:
    """Expired holds leave ``hs``: a handed one's entry goes back to the front of ``q`` (it keeps its
    token and attempt count), or, for a run that needs several keys (a reservation, ``slot_reserve``),
    to its place in send order; any other is appended to ``ends`` as ``expired``; parked runs past their
    deadline move to ``dead``. ``keep_owner``: a hold kept even if expired (the handoff being claimed)."""
    keep: Document = live_hold("$$e")
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
                        "cond": {"$not": [{"$or": [has_handoff("$$e"), _slots.released("$$e")]}]},
                    }
                },
            }
        },
        {
            "$set": {
                "ends": {
                    "$cond": [
                        {"$gt": [{"$size": "$__died"}, 0]},
                        _slots.append_endings("$__died", "expired"),
                        "$ends",
                    ]
                },
                "dead": {"$concatArrays": [{"$ifNull": ["$dead", []]}, dead_entries(_Q)]},
                "q": live_entries(_Q),
            }
        },
        # (a handed slot that lapsed puts its run back in ``q``: a run of slots, whatever ``qk`` said)
        {"$set": {"qk": {"$cond": [{"$anyElementTrue": [_HANDED_GONE]}, KIND_SLOTS, "$qk"]}}},
        {"$unset": ["__gone", "__died"]},
    ]


def _may_be_handed(entry: str) -> Document:
    """The parked run ``entry`` may be handed a free slot: it is due, not behind an older run of its set
    (``sets.behind_its_set``), no run of a lower rank is spilled beyond the window (those go first:
    a refill brings them and hands them the slots), and, a run of several keys, not held back for older
    runs of its rank spilled (``lanes.held_back``: the slot goes to the next run meanwhile)."""
    return {
        "$and": [
            entry_due(entry),
            {"$not": [sets.behind_its_set(entry, "$__sr")]},
            {"$eq": [spilled_before({"$ifNull": [f"{entry}.pr", 0]}), 0]},
            {"$not": [held_back(entry, "$__sb")]},
        ]
    }


def fill_stages(by: str) -> list[Document]:
    """Hand every free slot (of ``lim``) to the oldest due parked runs, one hold each, in send order (a run
    waits while runs of a lower rank are spilled: ``_may_be_handed``). ``by`` marks the handoffs this command
    made (its author publishes them). Expects ``hs`` and ``q`` as ``normalize_stages`` leaves them."""
    used = {"$map": {"input": _HS, "as": "e", "in": "$$e.s"}}
    free = {
        "$filter": {
            "input": {"$range": [0, {"$toInt": {"$ifNull": ["$lim", 1]}}]},
            "as": "s",
            "cond": {"$not": [{"$in": ["$$s", used]}]},
        }
    }
    # (no slot while the key is a single lease, or runs of one wait on it: ``key_state.parked_as``)
    single_held = {"$or": [SINGLE_HELD, parked_as(KIND_ONE)]}
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
        # (once per command: ``__dq`` scans them per entry of a burst, and of several keys)
        {"$set": {"__sr": SET_RUNS, "__sb": spill_bars(_Q)}},
        {
            "$set": {
                "__fs": {"$cond": [single_held, [], free]},
                "__dq": {"$filter": {"input": _Q, "as": "e", "cond": _may_be_handed("$$e")}},
            }
        },
        {"$set": {"__k": {"$min": [{"$size": "$__fs"}, {"$size": "$__dq"}]}, "__base": fence_base()}},
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
        {"$unset": ["__fs", "__dq", "__k", "__base", "__hd", "__sr", "__sb"]},
        {"$set": {"sx": _slots.latest_expiry("$hs")}},
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
    return {"$slice": [{"$concatArrays": [{"$ifNull": ["$seen", []]}, ids]}, -SEEN_KEPT]}


def _then_hand(drop: list[Document], by: str) -> list[Document]:
    """``drop`` (a ``_slots`` pipeline ending with the gc stage), then the freed slots handed."""
    assert drop[-1] == gc_stage(), "a _slots pipeline ends with the gc stage"
    return [*drop[:-1], *normalize_stages(), *fill_stages(by), gc_stage()]


def slot_fill_pipeline(by: str) -> list[Document]:
    """Hand the free slots of a ``limit=N`` key to the oldest parked runs (``by`` marks the handoffs)."""
    return [*normalize_stages(), *fill_stages(by), gc_stage()]


def slot_refill_pipeline(
    rank: int, new_head: int, entries: Sequence[Mapping[str, Any]], by: str
) -> list[Document]:
    """The refill of lane ``rank`` of a ``limit=N`` key (``spill.refill_stages``); then its free slots go
    to the oldest parked runs (``by`` marks those handoffs for their publisher)."""
    return [*spill.refill_stages(rank, new_head, entries), *slot_fill_pipeline(by)]


def slot_release_handoff_pipeline(
    tokens: Iterable[str], by: str = "", *, seen: bool = True, unrun: bool = False, untick: int | None = None
) -> list[Document]:
    """Release the holds of ``tokens``; the freed slots go to the oldest parked runs (``by``). ``seen``:
    their runs are remembered as over (not for holds whose run never got them). ``unrun``/``untick``: holds
    given back by their run (``slots.slot_release_pipeline``)."""
    toks = list(tokens)
    ours = {"$and": [{"$in": ["$$e.o", {"$literal": toks}]}, {"$not": [_slots.released("$$e")]}]}
    mine = {"$filter": {"input": _HS, "as": "e", "cond": ours}}
    remember = [{"$set": {"seen": _seen_of(mine)}}] if seen else []
    # (a hold whose run never ran, ``seen=False``, keeps no minimum hold: it held nothing for anyone)
    released = _slots.slot_release_pipeline(toks, keep_min_hold=seen, unrun=unrun, untick=untick)
    return [*remember, *_then_hand(released, by)]


def slot_release_dead_handoff_pipeline(holder: Mapping[str, Any], by: str = "") -> list[Document]:
    """Release the holds of a holder that died; the freed slots go to the oldest parked runs."""
    return _then_hand(_slots.slot_release_dead_pipeline(holder), by)


def slot_force_release_handoff_pipeline(by: str = "") -> list[Document]:
    """An operator's release of every hold of the key (a slot handed to a parked run and not yet claimed
    stays handed); the freed slots go to the oldest parked runs."""
    return _then_hand(_slots.slot_force_release_pipeline(), by)


def slot_unpark_pipeline(entry_id: str, by: str) -> list[Document]:
    """Remove the run ``entry_id`` from a ``limit=N`` key: its parked entry, and the slot handed to it
    and not yet claimed (a hold whose owner is its handoff token); the freed slots go to the oldest
    parked runs (``by``), as a release hands them."""
    ident = {"$literal": entry_id}
    handed_to_it = {
        "$and": [{"$eq": [{"$ifNull": ["$$e.ho.id", None]}, ident]}, {"$eq": ["$$e.o", "$$e.ho.tk"]}]
    }
    # What it leaves: the slot handed or reserved to it (its entry there), else its parked entry.
    # (``Replace(debounce=..., max_wait=...)`` with ``keys=``: the newer runs of its set parked here
    # continue its burst, ``sets.carry_burst``.)
    its_ho = {
        "$map": {
            "input": {"$filter": {"input": _HS, "as": "e", "cond": handed_to_it}},
            "as": "e",
            "in": "$$e.ho",
        }
    }
    its_entry = {"$filter": {"input": _Q, "as": "e", "cond": {"$eq": ["$$e.id", ident]}}}
    left = {"$arrayElemAt": [{"$concatArrays": [its_ho, its_entry]}, 0]}
    return [
        {
            "$set": {
                "q": sets.carry_burst(
                    {"$filter": {"input": _Q, "as": "e", "cond": {"$ne": ["$$e.id", ident]}}}, left
                ),
                "hs": {"$filter": {"input": _HS, "as": "e", "cond": {"$not": [handed_to_it]}}},
            }
        },
        *normalize_stages(),
        *fill_stages(by),
        gc_stage(),
    ]


def slot_sweep_pipeline(by: str, revoked: list[str]) -> list[Document]:
    """The sweeper's command for a ``limit=N`` key: expired holds leave (handed ones go back to the
    queue), revoked runs leave the queue (a slot handed to one is freed), runs past their deadline move
    to ``dead``, free slots go to the oldest parked runs, and handoffs nobody published are adopted."""
    rv = {"$literal": revoked}
    revoked_hold = {"$and": [has_handoff("$$e"), {"$in": ["$$e.ho.t", rv]}]}
    adopt = {
        "$map": {
            "input": _HS,
            "as": "e",
            "in": {
                "$cond": [
                    {"$and": [has_handoff("$$e"), {"$eq": [{"$ifNull": ["$$e.ho.by", ""]}, ""]}]},
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
        gc_stage(),
    ]
