"""Dedupe at send (``@singleton_task(..., unique_send=True)``): a send equal to a pending one returns
that run's ``AsyncResult`` and publishes nothing.

Equal: the same task, the same rendered key(s), the same arguments (bound to the task's signature, as
JSON). Pending: sent, its body not started yet (waiting in the broker, for its ``countdown``/``eta``, in
contention retries, or parked by ``Queue``/``Replace``). The window of a send ends when the first of
these happens: its body starts (``lease_acquired``); its run ends without running it (skipped, failed,
revoked, expired, superseded); or its bound passes on MongoDB's clock: ``unique_send_seconds`` (default
an hour) after the send, plus its ``countdown``/``eta``, and never later than its ``expires``. So a run
whose message is lost blocks equal sends for at most that long.

A send is checked and recorded with one ``findAndModify`` (``core.store_sends``): two producers sending
the same thing at once publish exactly one message. MongoDB unreachable at send: ``StoreUnavailable``
and nothing published; with ``unique_send="best_effort"`` the send is published undeduplicated (logged).

Never deduplicated (published as they are): a re-send of a run (its ``retry()``, a contention retry, a
parked run's handoff: they carry our headers or the running run's id; a beat tick, which has its own
once-per-tick), a send with callbacks
(``link``, ``link_error``, a chain or chord after it: returning another run would drop them), and sends
under ``task_always_eager``.
"""

from __future__ import annotations

import datetime as _dt
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from celery import signals as celery_signals
from celery import states
from celery.utils import uuid

from celery_mongolock.admission.policies import Replace
from celery_mongolock.core.documents.sends import send_digest
from celery_mongolock.core.store_sends import SendRecords, sends_of
from celery_mongolock.exceptions import StoreUnavailable
from celery_mongolock.integration import signals
from celery_mongolock.integration.config import TaskOptions, get_settings, get_store
from celery_mongolock.integration.handoff import SENT_HEADER, header, send_stamp

if TYPE_CHECKING:
    from celery import Celery, Task

__all__ = ["UNIQUE_SEND_HEADER", "bound_ms", "send_unique", "wants_unique_send"]

log = logging.getLogger("celery_mongolock.send")

#: The message header of a send recorded by ``unique_send``: the record's ``_id``.
UNIQUE_SEND_HEADER = "mongolock_unique_send"
_CALLBACK_OPTIONS = ("link", "link_error", "chain", "chord")


def _seconds_until(when: Any, now: _dt.datetime) -> float | None:
    """Seconds from ``now`` to ``when`` (a datetime, an ISO string, or seconds from now)."""
    if when is None:
        return None
    if isinstance(when, (int, float)):
        return float(when)
    if isinstance(when, str):
        try:
            when = _dt.datetime.fromisoformat(when.replace("Z", "+00:00"))
        except ValueError:
            return None  # not ours to judge: Celery refuses it when it publishes
    if isinstance(when, _dt.datetime):
        if when.tzinfo is None:
            when = when.replace(tzinfo=_dt.timezone.utc)
        return float((when - now).total_seconds())
    return None


def bound_ms(options: Mapping[str, Any], seconds: float, now: _dt.datetime | None = None) -> int:
    """How long (ms, on the server's clock from the claim) a send's record deduplicates at most:
    ``seconds`` after the run is due (its ``countdown``/``eta`` included), and never past its ``expires``
    (a run that has expired never starts)."""
    now = now or _dt.datetime.now(_dt.timezone.utc)
    delay = _seconds_until(options.get("countdown"), now)
    if delay is None:
        delay = _seconds_until(options.get("eta"), now)
    bound = max(0.0, delay or 0.0) + seconds
    expires = _seconds_until(options.get("expires"), now)
    if expires is not None:
        bound = min(bound, expires)
    return max(1, int(bound * 1000))


def wants_unique_send(app: Celery, name: str, declared: bool | str | None) -> bool:
    """Whether task ``name`` has ``unique_send`` (its ``mongolock_task_policies`` entry, else its
    declaration), read without parsing its other options: the cost of a send with it off."""
    override = get_settings(app).task_policies.get(name) or {}
    return bool(override.get("unique_send", declared))


def _resend(task: Task, options: Mapping[str, Any]) -> str | None:
    """Why this send is not deduplicated (None: it is a new send to check)."""
    if any(str(name).startswith("mongolock_") for name in options.get("headers") or {}):
        # Every message carries our send stamp, and a re-send copies its run's headers: a retry, a
        # contention retry, a handoff, a parked duplicate. (And a beat tick: beat has its ticks.)
        return "a re-send of a run"
    request = task.request
    if options.get("task_id") and options.get("task_id") == getattr(request, "id", None):
        return "a re-send of the running run"
    if any(options.get(name) for name in _CALLBACK_OPTIONS):
        return "a send with callbacks"
    if task.app.conf.task_always_eager:
        return "an eager call"
    return None


def send_unique(
    task: Task,
    in_force: TaskOptions,
    call: tuple[Any, Any, Sequence[str], Mapping[str, Any]],
    options: dict[str, Any],
    publish: Callable[..., Any],
) -> Any:
    """``apply_async`` of a ``unique_send`` task (``in_force``: its options). ``call``: the args and
    kwargs as given, the rendered keys and the arguments by name; ``publish(args, kwargs, **options)``
    is Celery's ``apply_async``."""
    args, kwargs, keys, arguments = call
    why = _resend(task, options)
    if why is not None:
        log.debug("%s: %s, not deduplicated", task.name, why)
        return publish(args, kwargs, **options)
    digest = send_digest(task.name, keys, arguments)
    task_id = str(options.get("task_id") or uuid())
    # The send's stamp, taken now so that the record keeps it (the order Replace judges sends by). (A send
    # that carries one already is a re-publish, never deduplicated: ``_resend``.)
    stamp = send_stamp()
    headers = {**(options.get("headers") or {}), SENT_HEADER: stamp}
    options = {**options, "headers": headers}
    mode, seconds = in_force.unique_send, in_force.unique_send_seconds
    records = sends_of(get_store(task.app))
    try:
        pending = records.claim(digest, task_id, task.name, keys, bound_ms(options, seconds), stamp=stamp)
    except StoreUnavailable as exc:
        if mode == "best_effort":
            log.warning(
                "%s: MongoDB could not say whether an equal send is pending, so this send is published "
                "without deduplication (unique_send='best_effort'): %s",
                task.name,
                exc,
            )
            return publish(args, kwargs, **options)
        raise StoreUnavailable(
            f"task {task.name!r} has unique_send: the send was not published, because MongoDB could not "
            f"say whether an equal send is pending ({exc}); send it again later, or declare "
            "unique_send='best_effort' to publish it undeduplicated then"
        ) from None
    if pending != task_id and _overtaken(
        task, in_force, records, (digest, pending, task_id), keys, options=options, stamp=stamp
    ):
        pending = task_id  # (the record is this send's now)
    if pending != task_id:
        log.info(
            "%s: an equal send is pending (%s): this send returns it, nothing published", task.name, pending
        )
        return task.AsyncResult(pending)
    headers = {**headers, UNIQUE_SEND_HEADER: digest}
    try:
        return publish(args, kwargs, **{**options, "task_id": task_id, "headers": headers})
    except BaseException:
        # Not published: the record must not turn equal sends away until its bound.
        _forget(task.app, task_id, "its publish failed")
        raise


def _overtaken(
    task: Task,
    in_force: TaskOptions,
    records: SendRecords,
    ids: tuple[str, str, str],
    keys: Sequence[str],
    *,
    options: Mapping[str, Any],
    stamp: int | None = None,
) -> bool:
    """``Replace``: the pending run an equal send would return was overtaken by a newer send of its keys
    (with other arguments), which supersedes it; this send is newer still, so it is published as the
    record's pending run (taken over) instead of being absorbed by a run that will not run (a user's
    trial: sends (3), (2), (3) ended with 2). True if this send took the record over."""
    digest, pending, task_id = ids
    if not isinstance(in_force.on_contention, Replace):
        return False
    bound = bound_ms(options, in_force.unique_send_seconds)
    if not records.overtaken(digest, pending, keys) or not records.take_over(
        digest, pending, task_id, bound, stamp
    ):
        return False
    log.info(
        "%s: an equal send is pending (%s), but a newer send of its keys supersedes it: this send is "
        "published",
        task.name,
        pending,
    )
    return True


def _forget(app: Celery, task_id: str, why: str) -> bool:
    try:
        forgotten = sends_of(get_store(app)).forget(task_id)
    except StoreUnavailable as exc:
        log.warning(
            "%s: the pending send could not be forgotten (%s): %s; it ends at its bound", task_id, why, exc
        )
        return False
    if forgotten:
        log.debug("%s: no longer a pending send: %s", task_id, why)
    return True


# -- the end of the window, in the worker ----------------------------------------------------------------
_FORGOTTEN = "mongolock_unique_send_forgotten"


def _unique(request: Any) -> bool:
    return bool(request is not None and header(request, UNIQUE_SEND_HEADER)) and not getattr(
        request, _FORGOTTEN, False
    )


def _body_starts(sender: Any = None, **_: Any) -> None:
    """``lease_acquired``: the body of the run is about to start; equal sends are new sends from now."""
    request: Any = getattr(sender, "request", None)
    if _unique(request) and request.id and _forget(sender.app, str(request.id), "its body starts"):
        setattr(request, _FORGOTTEN, True)


def _run_ends(sender: Any = None, task_id: Any = None, state: Any = None, **_: Any) -> None:
    """``task_postrun``: a run that ended for good without its body (skipped, failed) is not pending;
    one that will come back (a contention retry, parked) still is."""
    request = getattr(sender, "request", None)
    if task_id and state in states.READY_STATES and _unique(request):
        _forget(sender.app, str(task_id), f"its run ended {state}")


def _revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    """``task_revoked`` (the worker's main process): revoked or expired before its body started."""
    if sender is not None and _unique(request) and getattr(request, "id", None):
        _forget(sender.app, str(request.id), "it was revoked")


def _superseded(sender: Any = None, app: Any = None, task_id: Any = None, **_: Any) -> None:
    """``run_superseded``: a parked run that a newer send replaced never starts."""
    if app is not None and task_id and _has_unique_tasks(app):
        _forget(app, str(task_id), "a newer send superseded it")


def _has_unique_tasks(app: Celery) -> bool:
    settings = get_settings(app)
    if any(options.get("unique_send") for options in settings.task_policies.values()):
        return True
    return any(getattr(t, "mongolock_unique_send", None) for t in list(app.tasks.values()))


signals.lease_acquired.connect(_body_starts, weak=False, dispatch_uid="celery_mongolock.unique_send.start")
signals.run_superseded.connect(_superseded, weak=False, dispatch_uid="celery_mongolock.unique_send.sup")
celery_signals.task_postrun.connect(_run_ends, weak=False, dispatch_uid="celery_mongolock.unique_send.end")
celery_signals.task_revoked.connect(_revoked, weak=False, dispatch_uid="celery_mongolock.unique_send.revoked")
