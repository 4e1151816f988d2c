"""The change stream a holder's process watches its leases with (``core.lease_watch``): pure functions.

One stream per process watches the lease collection, with a server-side ``$match`` that does not depend on
which leases the process holds (so it never changes, and never has to be reopened, per lease). An event
passes when both hold:

1. **It can end a lease**: a deletion or a replacement of a lease document, an update that changes
   ``owner`` (a release, a force release, a takeover, a handoff) or ``fence`` (an acquisition), or anything
   under ``hs`` (the holds of a ``limit=N`` key), or the end of the stream itself (the collection dropped
   or renamed, the database dropped, invalidate). A ``cx`` change supersedes a holder
   (``Replace(cancel_running=True)``). A renewal sets only ``expires_at``, ``renewed_at`` and
   ``gc_at`` (a ``limit=N`` hold's renewal: its ``hs.<i>.x`` and ``sx``): no renewal of any worker's
   leases passes.
2. **It can concern this process** (its holder's ``host`` and ``pid``, the fields ``documents.base``
   writes into every lease and every ending): the document as it is now (``updateLookup``) has an ending
   of ours among its last ``ENDS_KEPT`` that is not our own release (every command that ends a lease
   appends one, with the holder it ended: ``forced``, ``expired`` for a takeover after expiry,
   ``holder-died``), or a ``limit=N`` hold of ours; or it is gone (a deletion, an update of a document
   deleted since). Neither this process's own releases nor other processes' acquisitions and releases
   reach it.

Whether an event ends one of our leases is then decided from that document compared with the lease's
owner token and fence (``holds``), never from the event alone: the image may be older than our acquisition
(an event from just before it), and our own renewal of a ``limit=N`` hold rewrites ``hs`` too.

What the filter can miss is left to the heartbeat, which renews as before: a lease ended and followed by
more than ``ENDS_KEPT`` endings before the server looked the document up, or a hold removed by hand from a
document that keeps no other hold or ending of ours.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["STREAM_END_TYPES", "Verdict", "holds", "loss_events_pipeline", "loss_reason", "superseded_by"]

Document = dict[str, Any]

#: Events after which the stream is closed (``invalidate``) or watches nothing of ours any more.
STREAM_END_TYPES = frozenset({"drop", "rename", "dropDatabase", "invalidate"})

#: The fields whose change can end a single lease (``owner``) or mark a new acquisition (``fence``), or
#: supersede its holder (``cx``: ``Replace(cancel_running=True)``, ``queue.cancel_mark``).
_ENDING_FIELDS = ("owner", "fence", "cx")


def loss_events_pipeline(host: str | None = None, pid: int | None = None) -> list[Document]:
    """The ``$match`` of the watcher's stream (module docstring); ``host`` and ``pid``: the holder fields
    of this process's leases (None: every change that can end a lease, whoever held it)."""
    updated_names = {
        "$map": {
            "input": {"$objectToArray": {"$ifNull": ["$updateDescription.updatedFields", {}]}},
            "in": "$$this.k",
        }
    }
    # A change under ``hs`` other than a hold's expiry (``hs.<i>.x``: a renewal of a limit=N hold).
    holds_changed = {
        "$and": [
            {"$eq": [{"$substrCP": ["$$k", 0, 2]}, "hs"]},
            {"$not": [{"$regexMatch": {"input": "$$k", "regex": r"^hs\.[0-9]+\.x$"}}]},
        ]
    }
    touches_holds = {"$anyElementTrue": [{"$map": {"input": updated_names, "as": "k", "in": holds_changed}}]}
    can_end: Document = {
        "$or": [
            {"operationType": {"$in": ["delete", "replace", *sorted(STREAM_END_TYPES)]}},
            *({f"updateDescription.updatedFields.{name}": {"$exists": True}} for name in _ENDING_FIELDS),
            {"updateDescription.removedFields": {"$in": ["owner", "fence", "hs"]}},
            {"operationType": "update", "$expr": touches_holds},
        ]
    }
    if host is None or pid is None:
        return [{"$match": can_end}]
    ours: Document = {
        "$or": [
            {"operationType": {"$nin": ["update", "replace"]}},
            {"fullDocument": None},
            {"fullDocument.ends": {"$elemMatch": {"host": host, "pid": pid, "how": {"$ne": "released"}}}},
            {"fullDocument.hs": {"$elemMatch": {"h.host": host, "h.pid": pid}}},
            # a holder of ours superseded by a newer send (the mark names its token; ``superseded_by``)
            {
                "fullDocument.cx": {"$ne": None},
                "fullDocument.holder.host": host,
                "fullDocument.holder.pid": pid,
            },
        ]
    }
    # (two stages: the first names no ``fullDocument`` field, so a server applies it before it reads the
    # changed document, as MongoDB's change-stream rewrites do and ``server_patches.LOOKUP`` does)
    return [{"$match": can_end}, {"$match": ours}]


class Verdict:
    """What a lease document says of one held lease (``holds``)."""

    HELD = "held"  # the document still has our token: a renewal, a park on our key, nothing of ours
    GONE = "gone"  # our token is gone from a document at least as new as our acquisition: lost
    STALE = "stale"  # the image is older than our acquisition (a smaller fence): it says nothing of ours


def holds(doc: Mapping[str, Any] | None, owner: str, fence: int, slot: int | None) -> str:
    """``Verdict`` of the lease (``owner`` token, ``fence``, ``slot`` for ``limit=N``) in ``doc`` (None:
    no document, read after the lease was taken: it was deleted).

    A fence is never reused (``documents.base``: it strictly increases per key, across deletions), so a
    document whose fence is smaller than ours was read before our acquisition and proves nothing."""
    if doc is None:
        return Verdict.GONE
    if slot is None:
        if doc.get("owner") == owner:
            return Verdict.HELD
    elif any(isinstance(h, Mapping) and h.get("o") == owner for h in doc.get("hs") or ()):
        return Verdict.HELD
    doc_fence = doc.get("fence")
    if isinstance(doc_fence, int) and doc_fence < fence:
        return Verdict.STALE
    return Verdict.GONE


def superseded_by(doc: Mapping[str, Any] | None, owner: str) -> str | None:
    """The task id of the newer send that superseded the holder ``owner`` (``queue.cancel_mark``), when
    ``doc`` says so; None otherwise (no mark, or a mark for another holder)."""
    mark = (doc or {}).get("cx")
    if not isinstance(mark, Mapping) or mark.get("o") != owner:
        return None
    return str(mark.get("t"))


def loss_reason(doc: Mapping[str, Any] | None, fence: int) -> str:
    """Why a lease whose verdict is ``GONE`` in ``doc`` is lost, in the words of ``Lease.lost_reason``."""
    if doc is None:
        return "a change stream saw its lease document deleted"
    doc_fence = doc.get("fence")
    if isinstance(doc_fence, int) and doc_fence > fence:
        return f"a change stream saw it taken by another holder (fence {doc_fence})"
    if doc.get("forced_release"):
        return "a change stream saw it released by force"
    return "a change stream saw it released or taken over"
