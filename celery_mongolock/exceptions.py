"""The exception hierarchy.

Contention is *not* an exception at the store level (``LeaseStore.acquire`` returns ``None``); the
exceptions below are for faults, for misuse, and for the Celery policies that turn contention into an
error on purpose (``Fail``).
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping, Sequence

__all__ = [
    "ArgumentsNotComparable",
    "ConfigurationError",
    "DocumentLockLost",
    "DocumentMissing",
    "DocumentWriteUnknown",
    "InvalidKey",
    "LeaseLost",
    "LockContended",
    "MongoLockError",
    "QueueTimeout",
    "StoreUnavailable",
    "Superseded",
    "UntrustedMessage",
]


class MongoLockError(Exception):
    """Base class of every error raised by celery_mongolock."""


class ConfigurationError(MongoLockError, ValueError):
    """A setting, URL or argument cannot work; the message names which one and why."""


class InvalidKey(MongoLockError, ValueError):
    """A lease key (or a value used to render one) is empty, of the wrong type or cannot be encoded."""


class StoreUnavailable(MongoLockError):
    """MongoDB could not be reached or did not answer in time.

    Raised instead of guessing: a lease whose state is unknown is treated as *not held* (fail closed).
    The message never contains credentials.
    """


class ArgumentsNotComparable(MongoLockError, TypeError):
    """A ``unique_send`` task was sent arguments that are not JSON data, so the send cannot be compared
    with the sends pending (the message names the argument); nothing was published."""


class DocumentWriteUnknown(StoreUnavailable):
    """A ``DocumentLock``'s ``update_one`` got no answer (a network error or timeout) or an answer whose
    write concern failed: the update may or may not be in the document. Sent once, never retried by us or
    the driver, so nothing is applied twice; read the document to learn which, or make the update
    idempotent and send it again (while the lock is held it is applied at most once more)."""

    def __init__(self, key: str, fence: int, why: str) -> None:
        self.key = key
        self.fence = fence
        self.why = why
        self.message = (
            f"document lock {key!r} (fence {fence}): the update may or may not have been applied ({why})"
        )
        # The constructor's arguments, so that result backends (cls(*args)) and pickle rebuild it.
        super().__init__(key, fence, why)

    def __str__(self) -> str:
        return self.message


class LockContended(MongoLockError):
    """The key is held by someone else (raised by ``hold(...)`` after its wait, and by the Fail policy)."""

    def __init__(
        self,
        key: str,
        holder: dict[str, object] | None = None,
        expires_at: _dt.datetime | str | None = None,
        message: str | None = None,
    ) -> None:
        self.key = key
        self.holder = dict(holder or {})
        self.expires_at = expires_at
        if message is None:
            who = _describe_holder(self.holder)
            message = f"lease {key!r} is held by {who}"
            if isinstance(expires_at, _dt.datetime):
                message += f" (expires at {expires_at.isoformat()} server time unless renewed)"
        self.message = message
        # args are the constructor's arguments, so that Celery's result backends (which rebuild an
        # exception as cls(*args)) and pickle give back the same error, key, holder and expiry included
        # (kombu's json carries a datetime as a datetime).
        super().__init__(key, self.holder, expires_at, message)

    def __str__(self) -> str:
        return self.message


class LeaseLost(MongoLockError):
    """The lease was taken over, force-released or expired while its holder believed it held it."""

    def __init__(self, key: str, fence: int | None = None, reason: str = "lost") -> None:
        self.key = key
        self.fence = fence
        self.reason = reason
        self.message = f"lease {key!r} (fence {fence}) is no longer held: {reason}"
        super().__init__(key, fence, reason)

    def __str__(self) -> str:
        return self.message


class MessageTooLarge(MongoLockError, ValueError):
    """A ``Queue``/``Replace`` run's message is too large to be parked: a parked run waits in a MongoDB
    document (16 MiB at most) and is handed the key from its key's lease document, and this one alone
    would not fit. Pass large data by reference (a file name, a document id), not as task arguments."""

    def __init__(self, key: str, size: int, limit: int, task: str | None = None) -> None:
        self.key, self.size, self.limit, self.task = key, size, limit, task
        whose = f"a run of task {task!r}: its" if task else "the run's"
        self.message = (
            f"{whose} message is {size / 2**20:.1f} MiB, over the {limit / 2**20:.1f} MiB a run of "
            f"{key!r} can take into its lease document (a MongoDB document of at most 16 MiB, which also "
            "holds the key's state): it is not admitted; pass large data by reference (a file name, a "
            "document id), not as task arguments"
        )
        super().__init__(*((key, size, limit) if task is None else (key, size, limit, task)))

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"MessageTooLarge({self.message!r})"


class Superseded(MongoLockError):
    """A newer send of the key superseded the running holder (``Replace(cancel_running=True)``): raised by
    ``current_lease().raise_if_superseded()``. Raised out of a singleton task's body, it ends the run as
    superseded (``SUCCESS`` with the superseded result), not as a failure, and the run is not retried.
    With ``Replace(fail_superseded=True)`` it is the failure of a superseded run (``held=False``: one
    superseded before it started)."""

    def __init__(self, key: str, fence: int | None = None, by: str | None = None, held: bool = True) -> None:
        self.key = key
        self.fence = fence
        self.by = by
        self.held = held
        newer = f"a newer send{f' ({by})' if by else ''}"
        if held:
            fenced = "" if fence is None else f" (fence {fence})"
            self.message = (
                f"the run holding {key!r}{fenced} was superseded by {newer}: stop, the newest run takes "
                "the key"
            )
        else:  # (Replace(fail_superseded=True): a run superseded before it started)
            self.message = (
                f"this run of {key!r} was superseded by {newer} before it started: its body never ran"
            )
        super().__init__(key, fence, by, held)

    def __str__(self) -> str:
        return self.message


class DocumentLockLost(LeaseLost):
    """A ``DocumentLock``'s write was refused, or its lock found gone: the lock fields of the document no
    longer name this holder (released by force, expired and taken, or removed)."""


class DocumentMissing(MongoLockError, LookupError):
    """A ``DocumentLock`` was asked for a document that does not exist (a lock lives inside its document:
    nothing is created)."""


def _describe_holder(holder: Mapping[str, object]) -> str:
    if not holder:
        return "another owner"
    parts = [f"{k}={holder[k]}" for k in ("host", "pid", "task_name", "task_id") if holder.get(k) is not None]
    return ", ".join(parts) if parts else "another owner"


def slots_held_message(
    key: str, holders: Sequence[Mapping[str, object]], limit: int | None, soonest: _dt.datetime | None
) -> str:
    """``LockContended``'s message for a ``limit=N`` key whose slots are all held: every holder named."""
    who = "; ".join(_describe_holder(h) for h in holders) or "other owners"
    message = f"lease {key!r}: all {limit or len(holders)} slots are held, by {who}"
    if soonest is not None:
        message += f" (the first expires at {soonest.isoformat()} server time unless renewed)"
    return message


class QueueTimeout(LockContended):
    """A run stayed parked longer than its ``Queue(timeout=...)``, or found the queue full, under
    ``then=Fail()``."""

    def __init__(self, key: str, reason: str) -> None:
        self.reason = reason
        super().__init__(key, {}, None, f"lease {key!r}: {reason}")
        # The constructor's arguments, so that result backends and pickle rebuild the same error.
        self.args = (key, reason)


class UntrustedMessage(MongoLockError):
    """A parked run's stored message failed the handoff's checks (it does not name a singleton task of the
    app, its arguments render another key, its signature does not match, ...): it was not published, and
    the run was dropped from the key's queue. The result of such a run, if it was one of ours."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        self.message = f"the parked run's stored message on {key!r} was refused at handoff: {reason}"
        super().__init__(key, reason)

    def __str__(self) -> str:
        return self.message
