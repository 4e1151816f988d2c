"""A singleton run that did not get its key: what the contention policies act through.

``ContendedRun`` implements ``policies.Contention`` for a Celery run: skip it (a result that says why),
fail it, publish it again later (``SingletonTask.mongolock_retry_later``), or wait for the key. The policy
decides which (``Policy.on_contended``, ``Policy.on_unavailable``); the task only hands the run over, so a
new kind of policy needs no change here or in ``task``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from celery_mongolock.exceptions import LockContended

if TYPE_CHECKING:
    from celery_mongolock.admission.policies import Retry
    from celery_mongolock.core.store import LeaseStore

__all__ = ["ContendedRun", "Outcome", "SingletonRun", "skipped_result"]

log = logging.getLogger("celery_mongolock.acquire")


class Outcome:
    """What a run that did not take its lease returns instead of running the body."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def skipped_result(key: str, holder: dict[str, Any], expires_at: Any, reason: str) -> dict[str, Any]:
    """The result of a run dropped by the Skip policy: says which key, which holder, and why."""
    return {
        "mongolock": "skipped",
        "key": key,
        "holder": holder,
        "expires_at": expires_at.isoformat() if hasattr(expires_at, "isoformat") else expires_at,
        "reason": reason,
    }


class SingletonRun(Protocol):
    """What a contended run needs of its task (``task.SingletonTask``): its name, its request, and a way
    to be published again later. A protocol, so that this module does not import the task class."""

    @property
    def name(self) -> str: ...

    @property
    def request(self) -> Any: ...

    def mongolock_retry_later(self, policy: Retry, exc: Exception) -> NoReturn: ...


class ContendedRun:
    """One run of a singleton task whose key is held (``held_by``) or whose store did not answer."""

    def __init__(self, task: SingletonRun, store: LeaseStore, key: str, *, direct: bool) -> None:
        self.task = task
        self.store = store
        self.key = key
        #: Called directly (``task(...)``), not by a worker: nothing can be published again.
        self.direct = direct
        self.holder: dict[str, Any] = {}
        self.expires_at: Any = None
        #: ``LockContended``'s message when it names more than ``holder`` (a full ``limit=N`` key).
        self.message: str | None = None
        #: A full ``limit=N`` key: each slot's holder (``holder`` is then empty).
        self.holders: tuple[dict[str, Any], ...] = ()
        self._wait_until: float | None = None

    def held_by(
        self,
        holder: dict[str, Any],
        expires_at: Any,
        message: str | None = None,
        holders: Sequence[Mapping[str, Any]] = (),
    ) -> ContendedRun:
        """Who holds the key as of the last attempt, and until when (``message`` and ``holders``: every
        slot's holder, for a full ``limit=N`` key)."""
        self.holder = holder
        self.expires_at = expires_at
        self.message = message
        self.holders = tuple(dict(h) for h in holders)
        return self

    def _error(self) -> LockContended:
        return LockContended(self.key, self.holder, self.expires_at, message=self.message)

    def _who(self) -> tuple[str, Any]:
        return self.task.name, self.task.request.id

    def _held(self) -> str:
        """``lease 'k' is held by <holder> (expires at ...)``: the key and the holder, in one phrase."""
        return str(self._error())

    def skip(self, reason: str) -> Outcome:
        log.info("%s[%s]: %s; policy skip: skipped", *self._who(), self._held())
        result = skipped_result(self.key, self.holder, self.expires_at, reason)
        if self.message and not self.holder and self.holders:  # a full limit=N key: who holds each slot
            result["holders"] = [dict(h) for h in self.holders]
            result["reason"] = f"{reason}: {self.message}"
        return Outcome(result)

    def fail(self, exc: Exception | None = None) -> NoReturn:
        raise exc if exc is not None else self._error()

    def retry(self, policy: Retry, exc: Exception | None = None) -> NoReturn:
        if exc is None:
            exc = self._error()
        request = self.task.request
        if self.direct or request.is_eager or request.called_directly:
            raise exc
        self.task.mongolock_retry_later(policy, exc)

    def wait_free(self, timeout: float) -> bool:
        now = self.store.clock.monotonic()
        if self._wait_until is None:
            self._wait_until = now + timeout
            log.info("%s[%s]: %s; policy wait: waiting up to %gs", *self._who(), self._held(), timeout)
        remaining = self._wait_until - now
        if remaining > 0 and self.store.wait_free(self.key, remaining):
            return True
        log.info("%s[%s]: wait for %r timed out", *self._who(), self.key)
        return False
