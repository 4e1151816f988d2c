"""The handoff, as pure pipeline builders (no I/O): a key released or found vacant goes to the oldest
parked run in the same command (``handoff_stages``), a pending handoff not claimed in time is handed
again (``requeue_handoff``), a several-keys run reserves a key (``reserve_pipeline``), and the sweeper's
command for one key (``sweep_pipeline``). The fields they write are listed in ``queue``'s module doc.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery_mongolock.core.documents.entries import (
    ahead_of,
    dead_entries,
    entry_due,
    entry_expr,
    live_entries,
)
from celery_mongolock.core.documents.key_state import KIND_SLOTS, NO_SLOT_HELD, gc_stage, parked_as
from celery_mongolock.core.documents.lanes import held_back, spill_bars, spilled_before

__all__ = [
    "ENDS_KEPT",
    "HANDOFF_PROJECTION",
    "admit_marker",
    "handoff_stages",
    "release_handoff_stages",
    "requeue_handoff",
    "reserve_pipeline",
    "sweep_pipeline",
    "unmark_slot_pipeline",
]

Document = dict[str, Any]

_NOW_MS: Document = {"$toLong": "$$NOW"}
_Q: Document = {"$ifNull": ["$q", []]}
#: What a release's reply carries: enough to publish a handoff it made.
#: (And the lanes of spilled runs with the window's ranks, ``lanes.SPILL_PROJECTION``: whether to refill.)
HANDOFF_PROJECTION: Document = {
    "ho": 1,
    "owner": 1,
    "fence": 1,
    "sup": 1,
    "sp": 1,
    "q.pr": 1,
    "q.ks": 1,
    "q.g": 1,
}


def admit_marker(token: str) -> str:
    """How an admit marks the handoffs it makes (``ho.by``), so that its author publishes them: derived
    from the run's token but never equal to it, since the token becomes the owner of the hold the admit
    takes, and that hold's release (marked with the owner's token) must not take pending handoffs made
    by the admit for its own and publish them a second time."""
    return f"admit:{token}"


#: How many endings a lease document keeps in ``ends`` (``_documents.ENDS_KEPT``).
ENDS_KEPT = 8


def _expired_ending(when: object) -> Document:
    """``ends`` with the ending of the lease found expired (its holder stopped renewing, or the run it was
    handed to never claimed it: ``handoff-expired``) appended when ``when`` and it has none yet; in the
    shape of ``_documents.ending_expr`` (ended at its ``expires_at``, ``seen`` now)."""
    handed = {"$and": [{"$ne": [{"$ifNull": ["$ho", None]}, None]}, {"$eq": ["$owner", "$ho.tk"]}]}
    ending = {
        "f": "$fence",
        "t": "$holder.task_id",
        "n": {"$ifNull": ["$holder.task_name", "$holder.role"]},
        "run": "$holder.delivery",
        "host": "$holder.host",
        "pid": "$holder.pid",
        "worker": "$holder.worker",
        "a": "$acquired_at",
        "e": "$expires_at",
        "w": "$waited_ms",
        "how": {"$cond": [handed, "handoff-expired", "expired"]},
        "seen": "$$NOW",
    }
    last_fence = {
        "$let": {"vars": {"last": {"$arrayElemAt": [{"$ifNull": ["$ends", []]}, -1]}}, "in": "$$last.f"}
    }
    expired = {
        "$and": [
            when,
            {"$ne": [{"$ifNull": ["$owner", None]}, None]},
            {"$lte": [{"$toLong": "$expires_at"}, _NOW_MS]},
            {"$ne": [last_fence, "$fence"]},
        ]
    }
    appended = {"$slice": [{"$concatArrays": [{"$ifNull": ["$ends", []]}, [ending]]}, -ENDS_KEPT]}
    return {"$cond": [expired, appended, "$ends"]}


def handoff_stages(
    hand: object, queue: object, by: str, base: list[Document] | None = None
) -> list[Document]:
    """Stages that, when ``hand`` is true, give the key to the oldest live entry of ``queue`` (an
    expression evaluated against the document as it is before these stages).

    Entries of ``queue`` past their deadline move to ``dead`` (results written by the sweeper); the rest
    stay parked in ``q``. With no live entry left, the key stays as the earlier stages left it. ``by``
    marks the handoff, so that the command's author can tell from the reply that the handoff is its to
    publish. ``base`` are stages to run before these (they may set ``__``-fields read here).
    """
    return [
        *(base or []),
        _take_queue_stage(hand, queue),
        _drop_dead_stage(),
        {"$set": {"__sb": spill_bars({"$ifNull": ["$__live", []]})}},
        _head_stage(),
        _hand_to_head_stage(by),
        {"$unset": ["__hq", "__live", "__head", "__sb"]},
    ]


def _take_queue_stage(hand: object, queue: object) -> Document:
    """``__hq``: the queue to hand from (when ``hand``); the ending of a lease that expired, recorded."""
    # (never to runs of ``limit=N`` slots parked on the key: they are handed slots, ``key_state.parked_as``)
    to_runs_of_one = {"$and": [hand, {"$not": [parked_as(KIND_SLOTS)]}]}
    return {
        "$set": {
            "__hq": {"$cond": [to_runs_of_one, queue, None]},
            # A key handed over because its lease expired: that lease's ending, in this same command.
            "ends": _expired_ending(hand),
        }
    }


def _drop_dead_stage() -> Document:
    """``__live``: the entries of ``__hq`` within their deadline; the others move to ``dead``."""
    return {
        "$set": {
            "__live": {"$cond": ["$__hq", live_entries("$__hq"), None]},
            "dead": {
                "$cond": [
                    "$__hq",
                    {"$concatArrays": [{"$ifNull": ["$dead", []]}, dead_entries("$__hq")]},
                    "$dead",
                ]
            },
        }
    }


def _head_stage() -> Document:
    """``__head``: the oldest live entry when it is due (``Replace(debounce=...)``) and no run of a lower
    rank is spilled beyond the window (``lanes.spilled_before``: those go first, and the refill that
    brings them hands the key to the oldest), else null. A run of several keys held back for older runs
    of its rank spilled (``lanes.held_back``, ``__sb``) is passed over: the oldest entry after it is the
    head (the key never idles for it; the refill that brings those runs hands them the key first).

    A run handed the key before whose handoff went unclaimed is back at the front of the queue
    (``requeue_handoff``), whatever its rank: it is handed again, spilled runs or not (a run handed the
    key keeps it; held back there, it would hold back the runs of a lower rank in the window behind it,
    whose lane has no room to refill). A reservation of a run that needs several keys goes back in its
    place instead, and waits like any parked run."""
    handable = {
        "$filter": {
            "input": {"$ifNull": ["$__live", []]},
            "as": "c",
            "cond": {"$not": [held_back("$$c", "$__sb")]},
        }
    }
    head = {"$arrayElemAt": [handable, 0]}
    again = {
        "$and": [{"$gt": [{"$ifNull": ["$$h.hn", 0]}, 0]}, {"$eq": [{"$ifNull": ["$$h.ks", None]}, None]}]
    }
    may_go = {
        "$and": [
            {"$ne": [{"$ifNull": ["$$h", None]}, None]},
            entry_due("$$h"),
            {"$or": [again, {"$eq": [spilled_before({"$ifNull": ["$$h.pr", 0]}), 0]}]},
        ]
    }
    return {"$set": {"__head": {"$let": {"vars": {"h": head}, "in": {"$cond": [may_go, "$$h", None]}}}}}


def _hand_to_head_stage(by: str) -> Document:
    """The key handed to ``__head`` (its token the owner, a new fence, ``ho`` marked ``by``); without a
    head, the queue as ``_drop_dead_stage`` left it and the rest unchanged."""

    def when_head(new: object, old: object) -> Document:
        return {"$cond": [{"$ne": ["$__head", None]}, new, old]}

    fence = {"$max": [{"$add": [{"$ifNull": ["$fence", 0]}, 1]}, {"$multiply": [_NOW_MS, 1000]}]}
    handed = {
        "$mergeObjects": [
            "$__head",
            {
                "hat": "$$NOW",
                "hn": {"$add": [{"$ifNull": ["$__head.hn", 0]}, 1]},
                "by": {"$literal": by},
            },
        ]
    }
    return {
        "$set": {
            "q": {
                "$cond": [
                    {"$ne": ["$__head", None]},
                    {"$filter": {"input": "$__live", "as": "e", "cond": {"$ne": ["$$e.id", "$__head.id"]}}},
                    {"$cond": ["$__hq", "$__live", "$q"]},
                ]
            },
            "owner": when_head("$__head.tk", "$owner"),
            "ho": when_head(handed, {"$cond": ["$__hq", None, "$ho"]}),
            "fence": when_head(fence, "$fence"),
            "ttl_ms": when_head("$__head.ttl", "$ttl_ms"),
            "expires_at": when_head({"$add": ["$$NOW", "$__head.ttl"]}, "$expires_at"),
            "acquired_at": when_head("$$NOW", "$acquired_at"),
            "renewed_at": when_head("$$NOW", "$renewed_at"),
            "hold_until": when_head("$$NOW", "$hold_until"),
            "released_for": when_head(None, "$released_for"),
            "forced_release": when_head(False, "$forced_release"),
            "waited_ms": when_head(
                {"$max": [0, {"$subtract": [_NOW_MS, {"$toLong": "$__head.at"}]}]}, "$waited_ms"
            ),
            "holder": when_head(
                {
                    "task_id": "$__head.t",
                    "task_name": "$__head.n",
                    "delivery": "$__head.r",
                    "handed": True,
                },
                "$holder",
            ),
        }
    }


def release_handoff_stages(by: str, *, keep_when: object = False) -> list[Document]:
    """After a release (owner cleared) or for a key found vacant: hand it to the oldest parked run,
    re-handing an unclaimed handoff first. ``keep_when``: an expression under which nothing is handed
    (e.g. a release that keeps the key until ``hold_until``)."""
    vacant = {
        "$and": [
            {
                "$or": [
                    {"$eq": [{"$ifNull": ["$owner", None]}, None]},
                    {"$lte": [{"$toLong": "$expires_at"}, _NOW_MS]},
                ]
            },
            NO_SLOT_HELD,
        ]
    }
    has_ho = {"$ne": [{"$ifNull": ["$ho", None]}, None]}
    queue = requeue_handoff()
    hand = {
        "$and": [
            {"$not": [keep_when]},
            vacant,
            {"$or": [has_ho, {"$gt": [{"$size": _Q}, 0]}]},
        ]
    }
    return handoff_stages(hand, queue, by)


def _unhanded(ho: str) -> str:
    """A pending handoff back as a parked entry: it keeps its attempt count ``hn``; ``hat`` and ``by``
    are set again when it is handed."""
    return ho


def requeue_handoff() -> Document:
    """The parked runs with the pending handoff put back among them, to be handed again: first (a run
    that was handed the key keeps it), except a reservation of a run that needs several keys
    (``ks``), which goes back in its place (rank, then send order), so that an older run that needs the
    same key is handed it first (the way a reservation held while its run waits for other keys cannot
    deadlock: see ``reserve_pipeline``)."""
    has_ho = {"$ne": [{"$ifNull": ["$ho", None]}, None]}
    multi = {"$isArray": "$ho.ks"}
    in_order = {
        "$concatArrays": [
            {"$filter": {"input": _Q, "as": "e", "cond": ahead_of("$$e", "$ho")}},
            [_unhanded("$ho")],
            {"$filter": {"input": _Q, "as": "e", "cond": {"$not": [ahead_of("$$e", "$ho")]}}},
        ]
    }
    front = {"$concatArrays": [[_unhanded("$ho")], _Q]}
    return {"$cond": [has_ho, {"$cond": [multi, in_order, front]}, _Q]}


def reserve_pipeline(entry: Mapping[str, Any], timeout_ms: int | None, by: str) -> list[Document]:
    """A run that needs several keys (``keys=``) took this one in an attempt that found another held: the
    key becomes a *reservation* for the run's parked entry (a handoff not yet claimed, ``ho``, owner the
    entry's token ``tk``), in the same command, so the run keeps its place without running. The run takes
    its keys one at a time, in key order (``key_set``): it is published whenever a key handed to it lets
    it move on (``handoff.moves_on``), and claims what is reserved for it.

    A reservation expires as any handoff (after the entry's lease time) and is handed again in send
    order (``requeue_handoff``): an older run that needs this key and was parked later (a late message)
    gets it first. So two runs that reserve overlapping keys in different orders cannot wait on each
    other for longer than a lease."""
    e = entry_expr(entry, timeout_ms)
    ho = {"$mergeObjects": [e, {"hat": "$$NOW", "hn": 1, "by": {"$literal": by}}]}
    return [
        {
            "$set": {
                "owner": {"$literal": entry["tk"]},
                "ho": ho,
                "ttl_ms": int(entry["ttl"]),
                "expires_at": {"$add": ["$$NOW", int(entry["ttl"])]},
                "renewed_at": "$$NOW",
                "hold_until": "$$NOW",
                "holder": {
                    "task_id": {"$literal": entry["t"]},
                    "task_name": {"$literal": entry.get("n")},
                    "delivery": {"$literal": entry.get("r")},
                    "handed": True,
                },
            }
        },
        gc_stage(),
    ]


def sweep_pipeline(by: str, revoked: list[str]) -> list[Document]:
    """The sweeper's command for one key (see ``LeaseStore.sweep``).

    1. Parked runs whose task ids are in ``revoked`` leave ``q``; a pending handoff to one of them is
       dropped and the key freed (the run was revoked while its handoff message waited).
    2. Parked runs past their deadline move to ``dead``.
    3. A key found free or expired with runs parked (or with an unclaimed handoff) goes to the oldest.
    4. A handoff nobody marked as published (``by`` empty: a background release handed it) is adopted.
    """
    rv = {"$literal": revoked}
    ho_revoked = {"$and": [{"$ne": [{"$ifNull": ["$ho", None]}, None]}, {"$in": ["$ho.t", rv]}]}
    stages: list[Document] = [
        {
            "$set": {
                "__rv": ho_revoked,
                "q": {"$filter": {"input": _Q, "as": "e", "cond": {"$not": [{"$in": ["$$e.t", rv]}]}}},
            }
        },
        {
            "$set": {
                "owner": {"$cond": [{"$and": ["$__rv", {"$eq": ["$owner", "$ho.tk"]}]}, None, "$owner"]},
                "ho": {"$cond": ["$__rv", None, "$ho"]},
                "dead": {"$concatArrays": [{"$ifNull": ["$dead", []]}, dead_entries(_Q)]},
                "q": live_entries(_Q),
            }
        },
        {"$unset": ["__rv"]},
        *release_handoff_stages(by),
        {
            "$set": {
                "ho": {
                    "$cond": [
                        {
                            "$and": [
                                {"$ne": [{"$ifNull": ["$ho", None]}, None]},
                                {"$eq": [{"$ifNull": ["$ho.by", ""]}, ""]},
                            ]
                        },
                        {"$mergeObjects": ["$ho", {"by": {"$literal": by}}]},
                        "$ho",
                    ]
                }
            }
        },
        gc_stage(),
    ]
    return stages


def unmark_slot_pipeline(run_id: str, token: str) -> list[Document]:
    """Clear the publisher's mark (``by``) of the handoff of a slot of a ``limit=N`` key to the run
    ``run_id`` with token ``token`` (sent with a filter that finds such a slot; the key's own handoff:
    ``{"$set": {"ho.by": ""}}``). The handoff then counts as published by nobody, and the next sweep of a
    worker adopts and publishes it: a worker that does not have the run's task leaves it so."""
    mine = {
        "$and": [
            {"$eq": [{"$ifNull": ["$$h.ho.id", None]}, {"$literal": run_id}]},
            {"$eq": [{"$ifNull": ["$$h.ho.tk", None]}, {"$literal": token}]},
        ]
    }
    unmarked = {"$mergeObjects": ["$$h", {"ho": {"$mergeObjects": ["$$h.ho", {"by": ""}]}}]}
    return [{"$set": {"hs": {"$map": {"input": "$hs", "as": "h", "in": {"$cond": [mine, unmarked, "$$h"]}}}}}]
