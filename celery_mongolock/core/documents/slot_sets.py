"""``Replace`` with ``keys=`` on a key with a limit (``limit={"tenant:{tenant}": 3}``): supersession per
set of rendered keys (``sets``) where the key keeps N holds (``slots``, ``slot_queue``), as pure
expressions for ``slot_queue.slot_admit_pipeline`` (no I/O).

The rule is the one of ``sets``, with the key's one ``ho`` replaced by its holds handed or reserved to a
parked run and not yet claimed (``hs[].ho``). On such a key, the admit of run R (set ``g``, send stamp
``s``):

1. **superseded** when the key knows a newer send of ``g``: a record in ``lg`` (the newest send per set
   that got a slot of the key), a parked entry, or a slot handed or reserved to a run of ``g`` with a
   larger stamp;
2. else, when R parks, the older runs of ``g`` leave the key for ``sup``: their parked entries, and every
   slot handed or reserved to one of them (not yet claimed), which is freed and handed, in the same
   command, to the oldest runs parked on the key (R among them);
3. a slot R *holds* (took in an attempt that must wait for another key) becomes R's reservation only
   while the key knows no newer send of ``g`` (``no_newer_send``): else R gives the slot back unrun, and
   its admit of the key answers ``superseded``. So a newer send that parked while R held the slot is
   never left waiting behind a reservation of a superseded run.

Runs of other sets, single-key runs and ``Queue`` runs that share the key keep their place in send order
and their slots.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery_mongolock.core.documents import queue as adm
from celery_mongolock.core.documents import sets
from celery_mongolock.core.documents.entries import burst_since, past_ceiling

__all__ = [
    "HANDED_ENTRIES",
    "burst_stage",
    "newer_by",
    "no_newer_send",
    "parked_queue",
    "superseded_cases",
    "take_back_stage",
]

Document = dict[str, Any]

_HS: Document = {"$ifNull": ["$hs", []]}
_Q: Document = {"$ifNull": ["$q", []]}


def _handed(e: str) -> Document:
    """Hold ``e`` is a slot handed or reserved to a parked run, not yet claimed."""
    return {"$ne": [{"$ifNull": [f"{e}.ho", None]}, None]}


#: The entries of the runs the key's slots are handed or reserved to (not yet claimed).
HANDED_ENTRIES: Document = {
    "$map": {
        "input": {"$filter": {"input": _HS, "as": "h", "cond": _handed("$$h")}},
        "as": "h",
        "in": "$$h.ho",
    }
}


def superseded_cases(group: str, stamp: int, *, task_id: str, burst: object = None) -> list[Document]:
    """The admit's ``$switch`` branch: a newer send of this run's set (not the run ``task_id`` itself;
    of ``burst``, when given: ``sets.in_burst``) is known on the key."""
    return sets.superseded_cases(group, stamp, task_id=task_id, handed=HANDED_ENTRIES, burst=burst)


def newer_by(group: str, stamp: int, *, task_id: str, burst: object = None) -> Document:
    """The task id of the newest send of ``group`` newer than ``stamp`` known on the key (``lo_by``)."""
    return sets.newer_by(group, stamp, task_id=task_id, handed=HANDED_ENTRIES, burst=burst)


def no_newer_send(group: str, stamp: int, *, task_id: str, burst: object = None) -> Document:
    """A query filter: the key knows no send of ``group`` newer than ``stamp`` (rule 3: a slot is
    reserved for a run of ``group`` only then)."""
    return {"$expr": {"$not": superseded_cases(group, stamp, task_id=task_id, burst=burst)[0]["case"]}}


def _older_of_set(
    group: str, stamp: int, ident: str, burst: object = None, max_wait_ms: int | None = None
) -> Document:
    """Hold ``$$h`` is handed or reserved to a run of ``group`` (of ``burst``) sent before this run.
    With ``max_wait_ms``, a run that does not know its burst yet (its first key: ``burst`` evaluates to
    null) leaves a slot handed by its burst's ceiling alone to the run it was handed to: that run was to
    run, and this run begins a burst of its own (the seal: ``sets.in_burst``)."""
    ho = "$$h.ho"
    before = adm.entry_before(ho, stamp, ident)
    same = {"$eq": [{"$ifNull": [adm.field_of("g", ho), None]}, {"$literal": group}]}
    older = {"$and": [_handed("$$h"), same, before, sets.in_burst(ho, burst)]}
    if max_wait_ms and burst is not None:
        sealed = {"$and": [{"$eq": [burst, None]}, past_ceiling(ho, int(max_wait_ms))]}
        older["$and"].append({"$not": [sealed]})
    return older


def _older_parked(group: str, stamp: int, ident: str, burst: object = None) -> Document:
    """Parked entry ``$$p`` is a run of ``group`` (of ``burst``) sent before this run."""
    return {
        "$and": [
            {"$eq": [{"$ifNull": [adm.field_of("g", "$$p"), None]}, {"$literal": group}]},
            adm.entry_before("$$p", stamp, ident),
            sets.in_burst("$$p", burst),
        ]
    }


def burst_stage(entry: Mapping[str, Any], group: str, burst: object, max_wait_ms: int) -> Document:
    """``Replace(debounce=..., max_wait=...)``, before ``take_back_stage``: when the burst this run
    continues began waiting (``__fw``: the earliest first wait of the older runs of its set it takes
    back, parked or handed a slot, else its own burst, else now; ``entries.burst_since``) and its burst's
    identity (``__bid``: the one it knows, else theirs, else now; ``sets.burst_identity``)."""
    ident, stamp = str(entry["id"]), int(entry["s"])
    cond_p = _older_parked(group, stamp, ident, burst)
    cond_h = _older_of_set(group, stamp, ident, burst, max_wait_ms)
    older = {
        "$concatArrays": [
            {"$filter": {"input": _Q, "as": "p", "cond": cond_p}},
            {
                "$map": {
                    "input": {"$filter": {"input": _HS, "as": "h", "cond": cond_h}},
                    "as": "h",
                    "in": "$$h.ho",
                }
            },
        ]
    }
    fields: Document = {"__fw": burst_since(older, burst)}
    if burst is not None:
        fields["__bid"] = {"$ifNull": [burst, sets.burst_identity(older)]}
    return {"$set": fields}


def parked_queue(
    entry: Mapping[str, Any],
    timeout_ms: int | None,
    group: str,
    burst: object = None,
    *,
    debounce_ms: int | None = None,
    max_wait_ms: int | None = None,
) -> Document:
    """The queue when the run ``entry`` of ``group`` parks: its entry in its place (rank, then send order;
    the older runs of its set, of its burst when given, are gone already: ``take_back_stage``; the other
    entries of its set, of another burst or sent at the same stamp, keep their place). With
    ``debounce_ms``, the entry is not due before it has passed (``nb``), nor later than its burst's first
    wait (``__fw``, ``burst_stage``) plus ``max_wait_ms``; with a burst, the entry keeps it (``bu``:
    ``__bid``)."""
    ident, stamp = str(entry["id"]), int(entry["s"])
    ahead = adm.entry_ahead("$$e", stamp, ident, adm.rank_of_entry(entry))
    since = "$__fw" if debounce_ms and max_wait_ms else None
    parked = adm.entry_expr(entry, timeout_ms, debounce_ms, max_wait_ms=max_wait_ms, since=since)
    if debounce_ms and max_wait_ms and burst is not None:
        parked["bu"] = "$__bid"
    # Only the older runs leave (``take_back_stage``, by send stamp, then entry id): a parked run of its
    # set sent at the same stamp with a later id is neither older nor newer, and keeps its place (dropping
    # every run of the set here lost it, with no ``sup`` record: found by the model test, seed 13).
    return {
        "$concatArrays": [
            {"$filter": {"input": _Q, "as": "e", "cond": ahead}},
            [parked],
            {"$filter": {"input": _Q, "as": "e", "cond": {"$not": [ahead]}}},
        ]
    }


def take_back_stage(
    entry: Mapping[str, Any], group: str, when: object, burst: object = None, max_wait_ms: int | None = None
) -> Document:
    """When ``when`` (the run parks, takes, claims or is due a slot: it is the newest send of its set the
    key knows), the older runs of ``group`` leave the key for ``sup``: their parked entries, and the slots
    handed or reserved to them and not yet claimed (freed: the command's last stages hand them on). A run
    of ``group`` that holds a slot (claimed or acquired) keeps it: only a run that has not started is
    superseded."""
    ident, stamp, by = str(entry["id"]), int(entry["s"]), str(entry["t"])
    older_hold = _older_of_set(group, stamp, ident, burst, max_wait_ms)
    older_parked = _older_parked(group, stamp, ident, burst)
    records = {
        "$concatArrays": [
            {
                "$map": {
                    "input": {"$filter": {"input": _Q, "as": "p", "cond": older_parked}},
                    "as": "p",
                    "in": sets.sup_record("$$p", by),
                }
            },
            {
                "$map": {
                    "input": {"$filter": {"input": _HS, "as": "h", "cond": older_hold}},
                    "as": "h",
                    "in": sets.sup_record("$$h.ho", by, reserved=True),
                }
            },
        ]
    }
    return {
        "$set": {
            "sup": sets.sup_appended(when, records),
            "q": {
                "$cond": [when, {"$filter": {"input": _Q, "as": "p", "cond": {"$not": [older_parked]}}}, "$q"]
            },
            "hs": {
                "$cond": [when, {"$filter": {"input": _HS, "as": "h", "cond": {"$not": [older_hold]}}}, "$hs"]
            },
        }
    }
