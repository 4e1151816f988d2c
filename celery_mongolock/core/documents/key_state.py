"""What a key's document says about it, as aggregation expressions (no I/O): who holds it, whether
something waits on it, and how long it is kept (``gc_stage``, the last stage of every write).

Every pipeline builder of the lease documents reads these; nothing here knows a parked entry's fields
(``entries``) or how a key is handed over (``handoff``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery_mongolock.core.documents.lanes import spilled_total

__all__ = [
    "KIND_ONE",
    "KIND_SLOTS",
    "NO_SLOT_HELD",
    "SEEN_KEEP_MS",
    "SERVES_SLOTS_PROJECTION",
    "SINGLE_HELD",
    "SINGLE_IN_USE",
    "SLOTS_IN_USE",
    "VACANT",
    "WAITS",
    "gc_stage",
    "own_lease",
    "own_live_lease",
    "parked_as",
    "parked_kind",
    "parked_kind_of",
    "serves_slots",
    "single_run_filter",
    "slot_run_filter",
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
            # (a kind outlives no run: the next run parked says its own, a run put back in ``q`` too)
            "qk": {"$cond": [_RUNS_PARKED, "$qk", "$$REMOVE"]},
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


#: The kind of the runs parked on a key (``qk``), written by the admit that parks or spills one: runs of
#: ``limit=N`` slots, or of a single lease. A run of the other kind does not park while they wait (its
#: admit answers ``mixed``), so the runs parked on a key are all of one kind, and every handoff (a
#: release's, a slot fill's, the sweeper's) serves that kind only. A key with nothing parked forgets
#: nothing: its ``qk`` is simply not read. (A document written before ``qk`` has none: its parked runs
#: are judged as before, by ``hs`` and ``lim``.)
KIND_SLOTS = "slots"
KIND_ONE = "one"


def parked_kind(kind: str, flag: object) -> Document:
    """``qk`` after an admit: ``kind`` when ``flag`` (the run parked or spilled), else as it was."""
    return {"$cond": [flag, kind, "$qk"]}


#: Runs are parked on the key: in ``q``, or spilled beyond the window.
_RUNS_PARKED: Document = {"$or": [{"$gt": [{"$size": _Q}, 0]}, {"$gt": [spilled_total(), 0]}]}


def parked_as(kind: str) -> Document:
    """Runs of ``kind`` wait on the key: parked in ``q`` or spilled beyond the window, and ``qk`` says
    that they are of ``kind``."""
    return {"$and": [{"$eq": [{"$ifNull": ["$qk", None]}, kind]}, _RUNS_PARKED]}


def parked_kind_of(doc: Mapping[str, Any]) -> str | None:
    """``parked_as`` read from a document (``q``, ``sp`` and ``qk`` read): the kind of the runs waiting on
    the key, or None when none waits or the document has no ``qk`` (written before it)."""
    lanes = [lane for lane in doc.get("sp") or [] if isinstance(lane, Mapping)]
    if not (doc.get("q") or any(lane.get("t") != lane.get("h") for lane in lanes)):
        return None
    kind = doc.get("qk")
    return kind if kind in (KIND_ONE, KIND_SLOTS) else None


#: What ``serves_slots`` reads of a document.
SERVES_SLOTS_PROJECTION: Document = dict.fromkeys(
    ("lim", "hs.s", "hs.ho.tk", "qk", "q.id", "sp", "owner", "ho.tk"), 1
)


def serves_slots(doc: Mapping[str, Any]) -> bool:
    """Whether the sweeper serves the key as ``limit=N`` slots (a slot fill) rather than as a single lease:
    so when its parked runs are runs of slots (``qk``); with none of a known kind parked, when a slot is
    handed (not a single lease), else when it has slots (``hs``, ``lim``). Reads ``q``, ``sp``, ``qk``,
    ``owner``, ``ho`` and ``hs[].ho``."""
    kind = parked_kind_of(doc)
    if kind is not None:
        return kind == KIND_SLOTS
    # (a handoff pending says its kind: a single lease's lapsed on a key that has had a limit is handed
    # again by the single pass, which the slot pass would leave alone for good)
    if isinstance(doc.get("ho"), Mapping) and doc.get("owner") is not None:
        return False
    if any(isinstance(hold, Mapping) and isinstance(hold.get("ho"), Mapping) for hold in doc.get("hs") or []):
        return True
    return "hs" in doc or "lim" in doc


#: A single-lease admit (a run whose key has no limit) finds the key in use as ``limit=N`` slots (a slot
#: held, kept for its minimum hold, or handed; or runs of slots parked): its run must not park there,
#: where a slot's release or fill would hand it a slot, which it cannot claim as a single lease.
SLOTS_IN_USE: Document = {"$or": [{"$not": [NO_SLOT_HELD]}, parked_as(KIND_SLOTS)]}

#: A ``limit=N`` admit finds the key in use as a single lease (held, or handed as one; or runs of a
#: single lease parked, behind a holder that died, say): its run must not park there, where the release
#: would hand it the key as a single lease, which it cannot claim as a slot.
SINGLE_IN_USE: Document = {"$or": [SINGLE_HELD, parked_as(KIND_ONE)]}


def slot_run_filter(entry_id: str) -> list[Document]:
    """``unpark``'s filter for a run of slots: handed a slot, or parked on a key whose parked runs are runs
    of slots (``qk``; a document from before ``qk``: one with slot holds)."""
    return [
        {"hs.ho.id": entry_id},
        {"q.id": entry_id, "qk": KIND_SLOTS},
        {"q.id": entry_id, "qk": {"$exists": False}, "hs.0": {"$exists": True}},
    ]


def single_run_filter(entry_id: str) -> list[Document]:
    """``unpark``'s filter for a run of a single lease: handed the key, or parked where
    ``slot_run_filter`` says the runs are not runs of slots."""
    return [
        {"ho.id": entry_id},
        {"q.id": entry_id, "qk": KIND_ONE},
        {"q.id": entry_id, "qk": {"$exists": False}, "hs.0": {"$exists": False}},
    ]
