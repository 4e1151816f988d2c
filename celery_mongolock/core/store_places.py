"""Where a run of several keys stands on each of its keys (one read), and the mark that lets exactly one
party publish its message when it is ready or moves on.

A run of several keys takes its keys one at a time (``key_set.KeySetAdmits.stepwise``); whoever reserves
a key for it reads where it stands on all of them (``read_places``) and publishes its handoff message when
every one is reserved, or when it moves on (``handoff.moves_on``). When two of its keys are reserved a few
milliseconds apart (two releases at once, or a release and the run's own attempt), both parties read the
same. Before publishing, each writes a mark into the document of the run's first key reserved for it
(``mark_published``): the reservations it saw, by the server times they were made (``hat``). One update
per mark, conditional on the mark being absent: exactly one party writes it and publishes. A reservation
that lapses and is made again has a new time, so the run is published again then (its first message may
be lost with a dead worker).

A part of ``LeaseStore`` (``store_queue.QueueUpkeep.keys_places``, ``LeaseStore.publish_once``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery_mongolock.core.documents.base import Document
from celery_mongolock.core.keys import normalize_key

if TYPE_CHECKING:
    from celery_mongolock.core.store_connection import Connection

__all__ = ["MARKS_KEPT", "KeyPlaces", "mark_published", "read_places", "unmark_published"]

#: How many publish marks a key's document keeps (``hp``): the newest, one per run whose reservations
#: were all made (a key with slots may see several such runs at once).
MARKS_KEPT = 8


@dataclass(frozen=True)
class KeyPlaces:
    """Where a run of several keys is on each of its keys, in key order: ``(key, place)`` with place
    ``reserved``, ``parked``, ``held``, ``dead`` or ``absent`` (``read_places``), and for each reserved
    key the server time (ms) its reservation was made."""

    places: list[tuple[str, str]]
    handed_ms: list[int | None]

    @property
    def ready(self) -> bool:
        """Every key reserved for the run: its message is published (once: ``mark_published``)."""
        return bool(self.places) and all(place == "reserved" for _, place in self.places)

    def mark(self) -> str:
        """The mark of this completion of the run's reservations: when each was made."""
        return ",".join("-" if ms is None else str(ms) for ms in self.handed_ms)

    @property
    def mark_key(self) -> str | None:
        """The key whose document takes the mark: the first reserved for the run (its document exists;
        every party that read the same places picks the same one), None when none is."""
        pairs = zip(self.places, self.handed_ms, strict=True)
        return next((key for (key, _), ms in pairs if ms is not None), None)


def read_places(connection: Connection, entry: Mapping[str, Any]) -> KeyPlaces:
    """Where the multi-key run ``entry`` is on each of its keys (``ks``, in order), from one read:
    ``reserved`` (the key or a slot handed or reserved to it, not yet claimed), ``parked`` (in the
    key's window), ``held`` (the key or a slot held by a worker of the run and not expired: an
    attempt under way, or its body; an expired one is ``absent``: its worker died), ``dead`` (timed
    out there, its result not yet written) or ``absent`` (none of these: not there, or spilled beyond
    the window: ``Spill.waits``), with each key as stored. (Dates are compared as ``$toLong``: the
    embedded server compares a stored date with ``$$NOW`` wrongly in ``$gt``.)"""
    keys = [normalize_key(k) for k in entry.get("ks") or []]
    if not keys:
        return KeyPlaces([], [])
    pipeline: list[Document] = [{"$match": {"_id": {"$in": keys}}}, {"$project": _place_fields(entry)}]
    with connection.operation(f"read the keys of {entry.get('t')}"):
        docs = {d["_id"]: d for d in connection.collection.aggregate(pipeline)}
    places = [(key, str(docs.get(key, {}).get("place", "absent"))) for key in keys]
    handed = [docs.get(key, {}).get("hat") for key in keys]
    return KeyPlaces(places, [int(ms) if isinstance(ms, int) else None for ms in handed])


def _place_fields(entry: Mapping[str, Any]) -> Document:
    """``place`` (``read_places``) and ``hat`` (when the key was reserved for the run, ms; or null)."""
    ident, token = {"$literal": entry.get("id")}, {"$literal": entry.get("tk")}
    task_id = {"$literal": entry.get("t")}
    slots = {"$ifNull": ["$hs", []]}

    def any_slot(cond: Document) -> Document:
        return {"$anyElementTrue": [{"$map": {"input": slots, "as": "h", "in": cond}}]}

    handed_one = {"$and": [{"$eq": ["$ho.id", ident]}, {"$eq": ["$owner", token]}]}
    # a slot of a limit=N key reserved for it (``slot_reserve``)
    handed_slot: Document = {"$and": [{"$eq": ["$$h.ho.id", ident]}, {"$eq": ["$$h.o", token]}]}
    reserved = {"$or": [handed_one, any_slot(handed_slot)]}
    no_handoff = {"$eq": [{"$ifNull": ["$ho", None]}, None]}
    held = {
        "$or": [
            {
                "$and": [
                    {"$ne": [{"$ifNull": ["$owner", None]}, None]},
                    no_handoff,
                    {"$eq": ["$holder.task_id", task_id]},
                    {"$gt": [{"$toLong": "$expires_at"}, {"$toLong": "$$NOW"}]},
                ]
            },
            any_slot(
                {
                    "$and": [
                        {"$eq": [{"$ifNull": ["$$h.ho", None]}, None]},
                        {"$eq": ["$$h.h.task_id", task_id]},
                        {"$gt": [{"$toLong": "$$h.x"}, {"$toLong": "$$NOW"}]},
                    ]
                }
            ),
        ]
    }

    def listed(field: str) -> Document:
        return {"$in": [ident, {"$map": {"input": {"$ifNull": [field, []]}, "as": "e", "in": "$$e.id"}}]}

    place = {
        "$switch": {
            "branches": [
                {"case": reserved, "then": "reserved"},
                {"case": listed("$q"), "then": "parked"},
                {"case": held, "then": "held"},
                {"case": listed("$dead"), "then": "dead"},
            ],
            "default": "absent",
        }
    }
    slot_handed_at = {
        "$arrayElemAt": [
            {
                "$map": {
                    "input": {"$filter": {"input": slots, "as": "h", "cond": handed_slot}},
                    "as": "h",
                    "in": "$$h.ho.hat",
                }
            },
            0,
        ]
    }
    handed_at = {"$toLong": {"$cond": [handed_one, "$ho.hat", slot_handed_at]}}
    return {"place": place, "hat": {"$cond": [reserved, handed_at, None]}}


def mark_published(connection: Connection, entry: Mapping[str, Any], places: KeyPlaces) -> bool:
    """Write the mark of ``places`` (some or all of the run ``entry``'s keys reserved for it) into the
    document of the first key reserved for it (``hp``: ``{i: run, m: mark}``, the newest ``MARKS_KEPT``),
    unless it is there: True for the one party that wrote it, which publishes the run's message; False
    for any other (it was published, or is being). With no key reserved: True, no mark."""
    key = places.mark_key
    if key is None:
        return True
    mark = {"i": str(entry.get("id")), "m": places.mark()}
    with connection.operation(f"mark the handoff of {entry.get('t')} published"):
        done = connection.collection.update_one(
            {"_id": key, "hp": {"$not": {"$elemMatch": mark}}},
            {"$push": {"hp": {"$each": [mark], "$slice": -MARKS_KEPT}}},
        )
    return bool(done.modified_count)


def unmark_published(connection: Connection, entry: Mapping[str, Any]) -> None:
    """Take the marks of the run ``entry`` off its keys (``mark_published``): its message was not
    published after all (left for a worker that has its task), and whoever adopts its handoff publishes
    it."""
    keys = [normalize_key(k) for k in entry.get("ks") or []]
    if keys:
        with connection.operation(f"unmark the handoff of {entry.get('t')}"):
            connection.collection.update_many(
                {"_id": {"$in": keys}, "hp.i": str(entry.get("id"))},
                {"$pull": {"hp": {"i": str(entry.get("id"))}}},
            )
