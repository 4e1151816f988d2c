"""Fenced writes: make a write to a protected MongoDB document conditional on the lease's fence.

A lease cannot stop a holder that was paused past its lease (GC pause, SIGSTOP, swap) from writing
when it wakes up, after someone else has taken the key. The fencing token can: every acquisition of a
key gets a larger ``lease.fence``; stamp it on the documents you write, and refuse writes that carry a
smaller one. ``fenced_update_one`` does both in one atomic update::

    lease = current_lease()
    fenced_update_one(db.groups, {"_id": group_id}, {"$set": {"state": "uploading"}}, lease)
    # -> raises FencedOut if a newer holder (larger fence) has already written the group

Writes with the same fence are accepted (one holder may write many times). A holder that a newer send
superseded (``Replace(cancel_running=True)``, ``lease.superseded``) is refused at once, before the newer
run has written anything: passed the lease (not its fence as an int), the write is checked against it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pymongo.collection import Collection
from pymongo.errors import DuplicateKeyError
from pymongo.results import UpdateResult

from celery_mongolock.exceptions import ConfigurationError, LeaseLost

__all__ = ["FencedOut", "fenced_update_one"]


class FencedOut(LeaseLost):
    """A write was refused because a newer lease holder (with a larger fence) has written already, or
    because a newer send superseded this holder (``superseded_by``: ``Replace(cancel_running=True)``)."""

    def __init__(
        self, key: str, fence: int | None = None, newer: int | None = None, superseded_by: str | None = None
    ) -> None:
        self.newer = newer
        self.superseded_by = superseded_by
        if superseded_by is not None:
            reason = f"a newer send ({superseded_by}) superseded this holder; this write was refused"
        else:
            reason = f"a newer holder (fence {newer}) has written; this write was refused"
        super().__init__(key, fence, reason)
        # The constructor's arguments, so that Celery's result backends (which rebuild an exception as
        # cls(*args)) and pickle give back the same error, superseded_by included.
        self.args = (key, fence, newer, superseded_by)


def _fence_of(lease_or_fence: Any) -> tuple[int, str]:
    if isinstance(lease_or_fence, bool):
        raise ConfigurationError("fence must be a Lease or an int, got bool")
    if isinstance(lease_or_fence, int):
        return lease_or_fence, "fence"
    fence = getattr(lease_or_fence, "fence", None)
    if not isinstance(fence, int):
        raise ConfigurationError(f"fence must be a Lease or an int, got {type(lease_or_fence).__name__}")
    return fence, str(getattr(lease_or_fence, "key", "fence"))


def fenced_update_one(
    collection: Collection[Any],
    filter: Mapping[str, Any],
    update: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    lease_or_fence: Any,
    *,
    fence_field: str = "fence",
    upsert: bool = False,
) -> UpdateResult:
    """``update_one`` that applies only if the document's ``fence_field`` is not larger than our fence,
    and stamps our fence on it. Raises ``FencedOut`` when a newer holder has written the document.

    With ``upsert=True`` the filter must name the document by ``_id`` (so a refused write cannot insert a
    second copy). Returns the ``UpdateResult`` (``matched_count`` 0 only if no such document exists).
    """
    fence, key = _fence_of(lease_or_fence)
    if getattr(lease_or_fence, "superseded", False) is True:
        # Replace(cancel_running=True): the newest run takes the key next, with a larger fence; from the
        # moment this holder is told, its writes are refused here, before the newer run has written.
        raise FencedOut(key, fence, superseded_by=str(getattr(lease_or_fence, "superseded_by", None)))
    if not fence_field or fence_field.startswith("$") or "." in fence_field:
        raise ConfigurationError(f"fence_field must be a plain field name, got {fence_field!r}")
    if upsert and "_id" not in filter:
        raise ConfigurationError("fenced_update_one(upsert=True) needs a filter on _id")
    guarded = {
        "$and": [dict(filter), {"$or": [{fence_field: {"$lte": fence}}, {fence_field: {"$exists": False}}]}]
    }
    if isinstance(update, Mapping):
        if any(not k.startswith("$") for k in update):
            raise ConfigurationError(
                "fenced_update_one needs an update with operators ($set, ...), not a document"
            )
        stamped: Any = {**update, "$set": {**dict(update.get("$set", {})), fence_field: fence}}
    else:
        stamped = [*update, {"$set": {fence_field: fence}}]
    collision: DuplicateKeyError | None = None
    try:
        result = collection.update_one(guarded, stamped, upsert=upsert)
    except DuplicateKeyError as exc:
        result = None  # the upsert's insert hit the existing document: it has a newer fence
        collision = exc
    if result is not None and (result.matched_count or result.upserted_id is not None):
        return result
    existing = collection.find_one(dict(filter), {fence_field: 1})
    if existing is None:
        if collision is not None:
            # The document exists but does not match the rest of the filter: as update_one(upsert=True).
            raise collision
        assert result is not None
        return result
    raise FencedOut(key, fence, existing.get(fence_field))
