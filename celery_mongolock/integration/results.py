"""The results of runs that end without running their body: superseded by a newer send (``Replace``) or
parked past their deadline (``Queue(timeout=...)``), written by the sweeper or by the run that admitted
past them, each with a history record.
"""

from __future__ import annotations

import datetime as _dt
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from celery import Celery

from celery_mongolock.exceptions import QueueTimeout
from celery_mongolock.integration import signals

if TYPE_CHECKING:
    from celery_mongolock.core.store import LeaseStore

__all__ = [
    "QUEUED",
    "has_backend",
    "marked_queued",
    "state_of",
    "superseded_result",
    "write_superseded",
    "write_timed_out",
]

log = logging.getLogger("celery_mongolock.queue")


# -- results the sweeper (or the admitting run) writes -----------------------------------------------------
def has_backend(app: Celery) -> bool:
    """Whether the app stores results (a superseded or timed-out run's result has somewhere to go)."""
    from celery.backends.base import DisabledBackend

    return not isinstance(app.backend, DisabledBackend)


def superseded_result(key: str, by: str, keys: Sequence[str] | None = None) -> dict[str, Any]:
    """The result of a run replaced by a newer send (``Replace``); with ``keys=``, ``key`` is its first
    key and ``keys`` all of them (the same result whichever key it was superseded on)."""
    if keys:
        return {"mongolock": "superseded", "key": keys[0], "keys": list(keys), "by": by}
    return {"mongolock": "superseded", "key": key, "by": by}


#: The state a parked run writes for itself (``task.QUEUED``).
QUEUED = "QUEUED"


def state_of(app: Celery, task_id: str) -> str | None:
    """A run's state in the result backend (None if it cannot be read)."""
    try:
        return str(app.backend.get_task_meta(task_id).get("status"))
    except Exception:
        return None


def write_superseded(
    app: Celery,
    store: LeaseStore,
    key: str,
    entries: list[Mapping[str, Any]],
    *,
    ready: Callable[[str], bool] | None = None,
    fence: int | None = None,
) -> list[Mapping[str, Any]]:
    """Write SUCCESS ``superseded`` for runs that a newer send replaced, then forget them; return the
    entries left for later. Each gets a history record (queued: written at the heartbeat's next tick);
    ``fence``: the key's fence.

    A parked run writes its own state ``QUEUED`` after its park, so a result written before that could be
    overwritten by it (the backend's read and write are not one step): with ``ready``, only the runs it
    accepts are written now (the others stay in ``sup``: the run itself, after writing ``QUEUED``, or the
    sweeper writes them)."""
    done = []
    left = []
    for entry in entries:
        if ready is not None and not ready(str(entry["t"])):
            left.append(entry)
            continue
        if has_backend(app):
            result = superseded_result(key, str(entry.get("by")), entry.get("ks") or None)
            app.backend.store_result(entry["t"], result, "SUCCESS")
        signals.run_superseded.send(sender=None, app=app, key=key, task_id=entry["t"], by=entry.get("by"))
        store.record_run_ending(
            key,
            "superseded",
            entry,
            fence=fence,
            ended_at=entry.get("at"),
            parked_at=entry.get("pa"),
            by=_str(entry.get("by")),
        )
        log.info(
            "%s[%s], parked on %r, superseded by a newer send (%s): it ends SUCCESS with a 'superseded' "
            "result, without running its body",
            entry.get("n"),
            entry["t"],
            key,
            entry.get("by"),
        )
        done.append(entry["t"])
    if done:
        store.forget_results(key, "sup", done)
    return left


def marked_queued(app: Celery) -> Callable[[str], bool]:
    """``ready`` for ``write_superseded``: the run has written its state ``QUEUED`` already."""
    return lambda task_id: state_of(app, task_id) == QUEUED


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


def write_timed_out(
    app: Celery,
    store: LeaseStore,
    key: str,
    entries: list[Mapping[str, Any]],
    *,
    fence: int | None = None,
) -> None:
    """Write the results of runs that stayed parked past their deadline (``then``), then forget them;
    each gets a history record (``timeout``; ``fence``: the key's)."""
    done = []
    for entry in entries:
        at = entry.get("at")
        reason = "parked past its Queue(timeout=...)"
        if isinstance(at, _dt.datetime):
            reason = f"parked since {at.isoformat()}, past its Queue(timeout=...)"
        if not has_backend(app):
            pass
        elif entry.get("th") == "fail":
            app.backend.mark_as_failure(entry["t"], QueueTimeout(key, reason))
        else:
            app.backend.store_result(
                entry["t"],
                {"mongolock": "skipped", "key": key, "reason": reason, "holder": {}, "expires_at": None},
                "SUCCESS",
            )
        store.record_run_ending(key, "timeout", entry, fence=fence, ended_at=entry.get("dl"), parked_at=at)
        log.info("%s on %r: %s", entry["t"], key, reason)
        done.append(entry["t"])
    if done:
        store.forget_results(key, "dead", done)
