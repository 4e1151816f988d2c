"""``LeaseSet``: the leases of a run that holds several keys at once, as one ``Lease``.

A view over the leases it is made of (no MongoDB call of its own): each is renewed, released and
watched as it would be alone; the set answers ``lost``, ``fence``, ``raise_if_lost()`` for all of them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from celery_mongolock.core.keys import RESERVED_PREFIX
from celery_mongolock.core.lease import Lease, LostCallback, SupersededCallback
from celery_mongolock.exceptions import LeaseLost, StoreUnavailable, Superseded

__all__ = ["LeaseSet"]


class LeaseSet(Lease):
    """The leases of a run that holds several keys at once (``keys=(...)``), in key order; a ``Lease``
    itself, so code written for one lease (``raise_if_lost()``, ``lost``, ``fence``) works unchanged.

    ``lease_set["email-group:7"]`` is one key's ``Lease`` (its ``fence`` is the one to write with to what
    that key guards); ``lost`` is true when any of them is lost, and ``raise_if_lost()`` raises for the
    first lost one. ``fence`` is the largest of the fences, ``key`` the keys joined by ``+``.

    A ``Replace`` task's set of two keys or more also holds its set's gate (a lease of the library's own,
    ``mongolock-set:...``): renewed, released and watched with the others (its loss counts in ``lost``),
    it is not among ``keys``, ``fences``, ``len()`` and iteration, which are of the task's own keys
    (``leases``, a dict by key, has it too).
    """

    def __init__(self, leases: Sequence[Lease]) -> None:  # a view over other leases: no Lease.__init__
        if not leases:
            raise ValueError("a LeaseSet needs at least one lease")
        self.leases: dict[str, Lease] = {lease.key: lease for lease in leases}
        named = [lease for lease in leases if not lease.key.startswith(RESERVED_PREFIX)] or list(leases)
        first = leases[0]
        self.store = first.store
        self.key = "+".join(lease.key for lease in named)
        self.owner = first.owner
        self.fence = max(lease.fence for lease in named)
        self.ttl = min(lease.ttl for lease in leases)
        self.heartbeat_seconds = first.heartbeat_seconds
        self.expires_at = min((lease.expires_at for lease in leases if lease.expires_at), default=None)
        self.holder = dict(first.holder)
        self.acquired_at = first.acquired_at
        self.waited_ms = first.waited_ms
        self.acquired_mono = first.acquired_mono
        self.sent_mono = min(lease.sent_mono for lease in leases)
        self.slot = None
        self.pid = first.pid

    @property
    def keys(self) -> list[str]:
        return [key for key in self.leases if not key.startswith(RESERVED_PREFIX)] or list(self.leases)

    @property
    def fences(self) -> dict[str, int]:
        return {key: self.leases[key].fence for key in self.keys}

    def __getitem__(self, key: str) -> Lease:
        return self.leases[key]

    def __iter__(self) -> Iterator[Lease]:
        """The leases of the task's own keys (``keys``); ``leases`` has its set's gate too."""
        return iter([self.leases[key] for key in self.keys])

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def deadline(self) -> float:
        return min(lease.deadline for lease in self.leases.values())

    @property
    def remaining(self) -> float:
        return min(lease.remaining for lease in self.leases.values())

    @property
    def lost(self) -> bool:
        return any(lease.lost for lease in self.leases.values())

    @property
    def lost_reason(self) -> str | None:
        for lease in self._named_first():
            if lease.lost:
                return f"{self._named(lease)!r}: {lease.lost_reason}"
        return None

    def _named_first(self) -> list[Lease]:
        """The leases of the task's own keys, then its set's gate (if any)."""
        named = [self.leases[key] for key in self.keys]
        return named + [lease for lease in self.leases.values() if lease not in named]

    def _named(self, lease: Lease) -> str:
        """The key to name for ``lease``: its own, or for a set's gate the set's first key."""
        return lease.key if lease.key in self.keys else self.keys[0]

    @property
    def held(self) -> bool:
        return all(lease.held for lease in self.leases.values())

    @property
    def released(self) -> bool:
        return all(lease.released for lease in self.leases.values())

    def raise_if_lost(self) -> None:
        """Raise ``LeaseLost`` if any of the leases is lost (or released); it names one of the task's keys
        (the first, for its set's gate)."""
        for lease in self._named_first():
            try:
                lease.raise_if_lost()
            except LeaseLost as exc:
                if lease.key in self.keys:
                    raise
                raise LeaseLost(
                    self.keys[0], self.leases[self.keys[0]].fence, f"its set's gate: {exc.reason}"
                ) from None

    def wait_lost(self, timeout: float | None = None) -> bool:
        """Block until any of the leases is lost (True) or ``timeout`` passes (False)."""
        event = threading.Event()
        for lease in self.leases.values():
            lease.on_lost(lambda *_: event.set())
        return event.wait(timeout)

    def on_lost(self, callback: LostCallback) -> None:
        """Call ``callback(lease, reason)`` when any of the leases is lost (with that lease)."""
        for lease in self.leases.values():
            lease.on_lost(callback)

    @property
    def superseded(self) -> bool:
        return any(lease.superseded for lease in self.leases.values())

    @property
    def superseded_by(self) -> str | None:
        return next((lease.superseded_by for lease in self.leases.values() if lease.superseded), None)

    @property
    def superseded_at(self) -> float | None:
        return min(
            (lease.superseded_at for lease in self.leases.values() if lease.superseded_at), default=None
        )

    def raise_if_superseded(self) -> None:
        """Raise ``Superseded`` if a newer send of the set superseded this run (on any of its keys, or its
        set's gate: it names the set's first key then)."""
        for lease in self._named_first():
            if lease.superseded:
                named = self.leases[self._named(lease)]
                raise Superseded(named.key, named.fence, lease.superseded_by)

    def wait_superseded(self, timeout: float | None = None) -> bool:
        """Block until a newer send supersedes this run on any of its keys (True) or ``timeout`` passes."""
        event = threading.Event()
        self.on_superseded(lambda *_: event.set())
        return event.wait(timeout)

    def on_superseded(self, callback: SupersededCallback) -> None:
        """Call ``callback(lease, by)`` once, when a newer send supersedes this run on any of its keys
        (with that key's lease)."""
        once = threading.Lock()
        called: list[bool] = []

        def first(lease: Lease, by: str) -> None:
            with once:
                if called:
                    return
                called.append(True)
            callback(lease, by)

        for lease in self.leases.values():
            lease.on_superseded(first)

    def supersede_together(self) -> None:
        """A newer send of the set marks the holder on one key first (it visits them in turn): from then on
        every lease of the set is superseded, so that a fenced write with any of them is refused."""

        def mark_all(_: Lease, by: str) -> None:  # (each lease's own callbacks, from this thread)
            for lease in self.leases.values():
                lease.mark_superseded(by)

        for lease in self.leases.values():
            lease.supersede_with(self.leases.values())
        self.on_superseded(mark_all)

    def mark_superseded(self, by: str) -> bool:
        marked = [lease.mark_superseded(by) for lease in self.leases.values()]  # all of them
        return any(marked)

    def end_superseded(self) -> None:
        by = self.superseded_by
        for lease in self.leases.values():
            if by is not None:  # (``supersede_together`` marks the others from a thread: maybe not yet)
                lease.mark_superseded(by)
            lease.end_superseded()

    def renew(self) -> None:
        for lease in self.leases.values():
            lease.renew()

    def mark_lost(self, reason: str, *, release: bool = True) -> bool:
        marked = [lease.mark_lost(reason, release=release) for lease in self.leases.values()]  # all of them
        return any(marked)

    def release(self) -> bool:
        """Release every lease (each is tried, whatever happens to the others); True if all were ours."""
        results = []
        error: StoreUnavailable | None = None
        for lease in reversed(list(self.leases.values())):
            try:
                results.append(lease.release())
            except StoreUnavailable as exc:  # queued for the background; go on with the others
                error = exc
        if error is not None:
            raise error
        return all(results)

    def __enter__(self) -> LeaseSet:
        return self

    def __repr__(self) -> str:
        return f"<LeaseSet {', '.join(repr(lease) for lease in self)}>"
