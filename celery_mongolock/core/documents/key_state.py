"""What a key's document says about it, as aggregation expressions (no I/O): who holds it, whether
something waits on it, and how long it is kept (``gc_stage``, the last stage of every write).

Every pipeline builder of the lease documents reads these; nothing here knows a parked entry's fields
(``entries``) or how a key is handed over (``handoff``).
"""

from __future__ import annotations

from typing import Any

from celery_mongolock.core.documents.lanes import spilled_total

__all__ = [
    "NO_SLOT_HELD",
    "SEEN_KEEP_MS",
    "SINGLE_HELD",
    "SINGLE_IN_USE",
    "SLOTS_IN_USE",
    "VACANT",
    "WAITS",
    "gc_stage",
    "own_lease",
    "own_live_lease",
]

Document = dict[str, Any]

_NOW_MS: Document = {"$toLong": "$$NOW"}
_Q: Document = {"$ifNull": ["$q", []]}
#: How long after its last lease a key that remembers finished queued runs (``seen``) or the newest
#: ``Replace`` send that got it (``last``) is kept: longer than a Redis broker's default visibility
#: timeout (1 h), after which an unacknowledged message is delivered again. Within it, a late copy is
#: recognised and an older ``Replace`` send delivered late is superseded; past it, the key is forgotten.
SEEN_KEEP_MS = 2 * 3600 * 1000


#: True when something waits on the key: parked runs (in the document or spilled), a pending handoff,
#: results not yet written.
WAITS: Document = {
    "$or": [
        {"$gt": [{"$size": _Q}, 0]},
        {"$ne": [{"$ifNull": ["$ho", None]}, None]},
        {"$gt": [{"$size": {"$ifNull": ["$dead", []]}}, 0]},
        {"$gt": [{"$size": {"$ifNull": ["$sup", []]}}, 0]},
        # runs spilled out of the document (``spill``): a lane with numbers not yet refilled
        {"$gt": [spilled_total(), 0]},
        # limit=N: a slot handed to a parked run that has not claimed it
        {
            "$gt": [
                {
                    "$size": {
                        "$filter": {
                            "input": {"$ifNull": ["$hs", []]},
                            "as": "e",
                            "cond": {"$ne": [{"$ifNull": ["$$e.ho", None]}, None]},
                        }
                    }
                },
                0,
            ]
        },
    ]
}


def own_lease(token: str) -> Document:
    """The key is held by ``token``: an earlier attempt of this very acquire (or admit) landed and its
    reply was lost (a dropped connection, a server killed before replying). Taking it again is the same
    acquisition, not a new one: it keeps its fence, so a run parked meanwhile, behind it, has a fence
    no smaller than the holder's."""
    return {"$eq": [{"$ifNull": ["$owner", None]}, {"$literal": token}]}


def own_live_lease(token: str) -> Document:
    """``own_lease`` and not expired: ours again whoever waits. One that expired meanwhile is free like
    any expired lease, and goes to the runs parked on the key first (no barging), as an expired
    ``limit=N`` slot of ours does (``_slots``)."""
    return {"$and": [own_lease(token), {"$gt": [{"$toLong": "$expires_at"}, _NOW_MS]}]}


def gc_stage() -> Document:
    """The last stage of every pipeline that writes a lease document: ``wq`` and ``gc_at``.

    The TTL index is on ``gc_at``: a document is deleted only when nothing waits on it, so parked runs
    (whose messages were acknowledged) are never deleted with it.
    """
    # What a late message is judged on: the runs that ended (``seen``), and the newest Replace send that
    # got the key (``last``: an older send delivered late is superseded, never run over it; seed 20 of
    # the lock-set checker, where a key whose runs had all ended without a normal release was deleted
    # 60 s after its last lease and an older send, delivered 164 s late, took it).
    remembers = {
        "$or": [
            {"$gt": [{"$size": {"$ifNull": ["$seen", []]}}, 0]},
            {"$ne": [{"$ifNull": ["$last", None]}, None]},
            {"$gt": [{"$size": {"$ifNull": ["$lg", []]}}, 0]},
        ]
    }
    # The later of the single lease's expiry and the latest slot hold's (``limit=N``: ``sx``). Compared as
    # milliseconds: the embedded server's ``$max`` of a date stored and a date computed from ``$$NOW`` in
    # this pipeline returns its first argument, whichever is later.
    latest_ms = {"$max": [{"$toLong": "$expires_at"}, {"$toLong": "$sx"}]}
    latest = {"$ifNull": [{"$toDate": latest_ms}, "$expires_at"]}
    return {
        "$set": {
            "wq": {"$cond": [WAITS, True, "$$REMOVE"]},
            "gc_at": {
                "$cond": [
                    WAITS,
                    None,
                    # A key that remembers finished queued runs or a Replace send keeps that memory (the
                    # duplicate guard, Replace's order) longer than a broker may take to deliver a
                    # message again.
                    {"$cond": [remembers, {"$add": [latest, SEEN_KEEP_MS]}, latest]},
                ]
            },
        }
    }


#: No ``limit=N`` hold of the key is live or handed to a parked run (a queued run never takes or claims
#: a key while slots are held).
NO_SLOT_HELD: Document = {
    "$eq": [
        {
            "$size": {
                "$filter": {
                    "input": {"$ifNull": ["$hs", []]},
                    "as": "e",
                    "cond": {
                        "$or": [
                            {"$gt": [{"$toLong": "$$e.x"}, _NOW_MS]},
                            {"$ne": [{"$ifNull": ["$$e.ho", None]}, None]},
                        ]
                    },
                }
            }
        },
        0,
    ]
}


#: The key is free for a single lease: not held (or expired) and no ``limit=N`` hold live or handed.
VACANT: Document = {
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


#: The key is held as a single lease, or handed to a parked run that has not claimed it yet (even past
#: its expiry: the sweeper hands it again): no ``limit=N`` slot may be taken or claimed meanwhile.
SINGLE_HELD: Document = {
    "$and": [
        {"$ne": [{"$ifNull": ["$owner", None]}, None]},
        {
            "$or": [
                {"$gt": [{"$toLong": "$expires_at"}, _NOW_MS]},
                {"$ne": [{"$ifNull": ["$ho", None]}, None]},
            ]
        },
    ]
}


#: A single-lease admit (a run whose key has no limit) finds the key in use as ``limit=N`` slots (a slot
#: held, kept for its minimum hold, or handed): its run must not park there, where a slot's release
#: would hand it a slot, which it cannot claim as a single lease.
SLOTS_IN_USE: Document = {"$not": [NO_SLOT_HELD]}

#: A ``limit=N`` admit finds the key in use as a single lease (held, or handed as one): its run must not
#: park there, where the release would hand it the key as a single lease, which it cannot claim as a slot.
SINGLE_IN_USE: Document = SINGLE_HELD
