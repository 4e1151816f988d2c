"""``LeaseInfo``: a lease document as ``inspect`` and ``list`` report it (a value, no I/O), and ``aware``,
the reading of a date MongoDB returns."""

from __future__ import annotations

import dataclasses
import datetime as _dt
from typing import Any

__all__ = ["LeaseInfo", "aware"]


def aware(value: Any) -> _dt.datetime | None:
    """A datetime read from MongoDB as a timezone-aware UTC datetime (None if it is not a datetime)."""
    if not isinstance(value, _dt.datetime):
        return None
    return value if value.tzinfo is not None else value.replace(tzinfo=_dt.timezone.utc)


@dataclasses.dataclass(frozen=True)
class LeaseInfo:
    """A snapshot of one lease document, as ``inspect`` and ``list`` report it."""

    key: str
    held: bool
    owner: str | None
    fence: int
    expires_at: _dt.datetime | None
    #: Seconds until ``expires_at`` on the server's clock at the time of the read (negative: expired).
    expires_in: float | None
    holder: dict[str, Any]
    acquired_at: _dt.datetime | None
    renewed_at: _dt.datetime | None
    released_at: _dt.datetime | None
    #: Runs parked on the key (``Queue``, ``Replace``), next first: ``position``, ``task_id``,
    #: ``task_name``, ``stamp`` (send stamp, us), ``parked_for`` (s, server clock), ``deadline``, ``keys``
    #: (all of a several-keys run's keys; None for a run of one key), ``rank`` (its message priority as
    #: its broker orders it, lower first: the priority on Redis, minus it elsewhere; 0 without one).
    parked: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: How many runs are parked on the key (``parked`` may hold only a page of them: ``LeaseStore.inspect``
    #: with ``parked_limit``).
    parked_total: int = 0
    #: A handoff not yet taken up: ``task_id``, ``task_name``, ``handed_for`` (s), ``attempt``.
    handoff: dict[str, Any] | None = None
    #: ``limit=N`` keys: the live holds, by slot (``slot``, ``fence``, ``holder``, ``expires_in``), and N.
    slots: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    limit: int | None = None
    #: Runs that wait to take the key as the other kind (a single lease while it is used as ``limit=N``
    #: slots, or the reverse): not parked, they come back as contention retries, each noted in the
    #: document when kept aside (``documents.kind_waits``); those noted lately, the longest waiting first:
    #: ``task_id``, ``task_name``, ``wants`` (``single`` or ``slots``), ``waiting_for`` (s since its first
    #: wait), ``back_ago`` (s since it was last kept aside).
    other_kind: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def full(self) -> bool:
        """Held, and (for a ``limit=N`` key) every slot taken: a new run cannot take it now."""
        if not self.held:
            return False
        return not self.slots or self.limit is None or len(self.slots) >= self.limit

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name in ("expires_at", "acquired_at", "renewed_at", "released_at"):
            if data[name] is not None:
                data[name] = data[name].isoformat()
        for entry in data["parked"]:
            if isinstance(entry.get("deadline"), _dt.datetime):
                entry["deadline"] = entry["deadline"].isoformat()
        return data
