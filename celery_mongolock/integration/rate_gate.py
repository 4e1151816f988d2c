"""The rate of a run that holds its key(s): start now, wait for its turn, or be dropped.

A run of a task with ``rate=RateLimit(n, period)`` (or ``Throttle(period)``) takes its key(s) as always,
then one start in each key's window (``core.store_rate``: one ``findAndModify`` per key, on the server's
clock, recorded with the grant). Over the rate:

* ``then=None`` (the default): the run gives its key(s) back and is **parked**: recorded among the key's
  waiting runs (which keeps send order), its message published again with a countdown to its turn and
  the delivery acknowledged (``Ignore``), so no worker slot is held while it waits and nothing is
  dropped. Its state is ``QUEUED`` meanwhile. The copy is a contention retry of the run (same task id),
  so the guards against a second run of one delivery cover it. A direct call (``task(...)``,
  ``apply()``) has no message: it gives its key(s) back too (the runs the rate parked before it need
  them to start), sleeps until its turn in the caller's thread, and takes them again, waiting for them
  (``retake``: not through its contention policy), with its place in the window kept.
* ``then=Skip()``: the run gives its key(s) back and ends ``SUCCESS`` with a skipped result naming the
  rate (``"mongolock": "skipped"``, ``"rate": "RateLimit(2 per 2 s)"``).
"""

from __future__ import annotations

import datetime as _dt
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from celery import signals as celery_signals
from celery.exceptions import Ignore

from celery_mongolock.admission.contention import Outcome, skipped_result
from celery_mongolock.admission.policies import Replace
from celery_mongolock.core.documents.sets import set_signature
from celery_mongolock.core.store_rate import RateTake, rate_windows
from celery_mongolock.exceptions import StoreUnavailable
from celery_mongolock.integration import handoff as _queue
from celery_mongolock.integration import priority, results, signals
from celery_mongolock.integration.config import get_store
from celery_mongolock.integration.runs import (
    CONTENDED_SINCE_HEADER,
    CONTENTION_HEADER,
    GuardedRun,
    give_back_quietly,
    ignored_as,
    republish,
    set_state,
    unavailable,
)

if TYPE_CHECKING:
    from celery_mongolock.admission.rate import RateLimit
    from celery_mongolock.core.lease import Lease
    from celery_mongolock.core.store import LeaseStore
    from celery_mongolock.integration.config import TaskOptions

__all__ = ["RATE_HEADER", "leave_rate", "pass_rate", "rate_parks_of", "rate_skipped_result"]

log = logging.getLogger("celery_mongolock.acquire")

T = TypeVar("T")

#: How many times a run was parked by its rate (its copies carry it; also counted as contention retries).
RATE_HEADER = "mongolock_rate_parks"


def rate_parks_of(request: Any) -> int:
    """How many of a run's contention retries were waits for its rate (not for a held key)."""
    return _parks_in(getattr(request, "headers", None) or {})


def _parks_in(headers: Any) -> int:
    value = headers.get(RATE_HEADER) if isinstance(headers, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def rate_skipped_result(key: str, rate: RateLimit, took: RateTake) -> dict[str, Any]:
    """The result of a run dropped by ``then=Skip()``: which key, which rate, and when the next start is."""
    result = skipped_result(key, {}, None, _over(rate, took))
    result["rate"] = rate.describe()
    return result


def _over(rate: RateLimit, took: RateTake) -> str:
    return (
        f"over the rate {rate.describe()} of {took.key!r}: {took.in_window} starts in the last "
        f"{rate.period:g} s, {took.position} run(s) waiting before this one; its turn in "
        f"{took.wait_seconds:.1f} s"
    )


def pass_rate(
    task: GuardedRun,
    keys: Sequence[str],
    taken: T,
    leases: Sequence[Lease],
    options: TaskOptions,
    *,
    direct: bool,
    retake: Callable[[], tuple[T, list[Lease]] | Outcome],
    untick: int | None = None,
    queued: bool = False,
) -> T | Outcome:
    """What the run starts its body with (``taken``, or what a direct call took again) once a start is
    recorded in every key's window; an outcome (``then=Skip()``) when it is dropped; raises ``Ignore`` when
    it is parked until its turn. ``retake``: for a direct call that waited for its turn without its keys,
    takes them again (what it then holds and its leases, or the outcome that ended it). ``queued``: a run
    admitted as a queued run (``plain_run.parks``), which a newer send supersedes when it comes back."""
    rate = options.rate
    if rate is None:
        return taken
    request = task.request
    store = get_store(task.app)
    stamp, _src = _queue.stamp_of(request)
    # (a direct call has no task id: one of its own, or every waiting call would be ``None/0``)
    run = f"{request.id or 'call-' + uuid.uuid4().hex}/{int(getattr(request, 'retries', 0) or 0)}"
    # The window serves its runs in the order the key's queue hands them over (priority, then send).
    rank = int(priority.rank_field(task.app, request, options.on_contention).get(priority.PRIORITY_FIELD, 0))
    in_process = direct or bool(request.is_eager or request.called_directly)
    ordered = sorted(keys)
    while True:
        try:
            took = rate_windows(store).take(
                ordered,
                run=run,
                stamp=stamp,
                n=rate.n,
                period_ms=rate.period_ms,
                park=rate.parks,
                rank=rank,
                replaces=_replace_group(task, ordered, options) if queued and not in_process else None,
            )
        except StoreUnavailable as exc:
            # (A beat tick's run gives its tick back: its contention retry runs the tick.)
            give_back_quietly(store, list(leases), untick=untick)
            if in_process:
                _leave_quietly(store, ordered, run)
            unavailable(task, ordered[0], exc, options.on_contention, direct)
        if took.started:
            return taken
        key = str(took.key)
        signals.lease_contended.send(sender=task, key=key, holder={}, policy=rate.name)
        if not rate.parks:
            give_back_quietly(store, list(leases))
            log.info("%s[%s]: %s; skipped", task.name, request.id, _over(rate, took))
            return Outcome(rate_skipped_result(key, rate, took))
        # A beat tick's run that waits for its turn gives its tick back too: at its turn it takes it again.
        give_back_quietly(store, list(leases), untick=untick)
        if not in_process:
            _park(task, key, rate, took, stamp)
        # A direct call waits for its turn in this thread without its key(s), then takes them again.
        try:
            time.sleep(_countdown(rate, took))
            again = retake()
        except BaseException:
            _leave_quietly(store, ordered, run)
            raise
        if isinstance(again, Outcome):
            _leave_quietly(store, ordered, run)
            return again
        taken, leases = again


def _replace_group(task: GuardedRun, keys: Sequence[str], options: TaskOptions) -> str | None:
    """A ``Replace`` run's group in its keys' rate windows: its task and set of keys (a newer send of the
    same task and keys supersedes the older ones); None for other policies. Only for a run admitted as a
    queued run by a worker: a direct call or a beat tick of one key is never superseded, so it neither
    takes an older run's turn nor gives its own."""
    if not isinstance(options.on_contention, Replace):
        return None
    return f"{task.name}:{set_signature(list(keys))}"


def _leave_quietly(store: LeaseStore, keys: Sequence[str], run: str) -> None:
    """A direct call that waited for its turn and will not start: out of its keys' windows, so that the
    runs after it do not wait for it (best effort: an entry left behind goes stale on its own)."""
    windows = rate_windows(store)
    try:
        for key in keys:
            windows.leave(key, run)
    except StoreUnavailable as exc:
        log.warning("leaving the rate windows of %s failed: %s", list(keys), exc)


def leave_rate(task: GuardedRun, keys: Sequence[str], options: TaskOptions) -> None:
    """A run that the rate parked and that ends without its body at its next admission (``Replace``: a
    newer send superseded it meanwhile) leaves its keys' waiting runs now, so that the runs sent after it
    do not wait for its turn (one command per key, only for such runs). Best effort: an entry left behind
    goes stale on its own."""
    if options.rate is None or not rate_parks_of(task.request):
        return
    request = task.request
    run = f"{request.id}/{int(getattr(request, 'retries', 0) or 0)}"
    windows = rate_windows(get_store(task.app))
    try:
        for key in sorted(keys):
            windows.leave(key, run)
    except StoreUnavailable as exc:
        log.warning("%s[%s]: leaving the rate windows of %s failed: %s", task.name, request.id, keys, exc)


def _on_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    """A copy the rate parked, discarded because its run was revoked (when the copy falls due: a revoke
    without ``terminate`` only marks its id): its keys' windows forget it then, so the runs sent after it
    do not wait for its turn. (Before, it stayed among the waiting runs until
    it went stale, a period and 15 s later; the runs behind it took their keys and gave them back unrun
    meanwhile, and then started out of send order: a new user's trial, stop 55.)"""
    # (the custom headers: in ``headers``, or attributes of the request context, by message protocol)
    parks = _parks_in(getattr(request, "headers", None)) or _parks_in(getattr(request, "__dict__", None))
    keys_for = getattr(sender, "mongolock_keys_for", None)
    if not parks or keys_for is None:
        return
    try:
        keys = keys_for(*(getattr(request, "args", None) or ()), **(getattr(request, "kwargs", None) or {}))
        run = f"{getattr(request, 'id', None)}/{int(getattr(request, 'retries', 0) or 0)}"
        windows = rate_windows(get_store(sender.app))
        for key in sorted(keys):
            windows.leave(key, run)
    except Exception as exc:  # (best effort: an entry left behind goes stale on its own)
        task_id = getattr(request, "id", None)
        log.warning("%s[%s]: could not leave its rate windows after a revoke: %s", sender.name, task_id, exc)


celery_signals.task_revoked.connect(_on_revoked, weak=False, dispatch_uid="celery_mongolock.rate-revoked")


def _countdown(rate: RateLimit, took: RateTake) -> float:
    """Seconds until a parked run looks again: its turn (plus a little, so it arrives after the window
    opened on the server's clock), and never less than a short recheck when runs before it are late."""
    recheck = min(1.0, max(0.05, rate.period / 10))
    return max(took.wait_seconds + 0.01, recheck if took.position else 0.01)


def _park(task: GuardedRun, key: str, rate: RateLimit, took: RateTake, stamp: int) -> None:
    """Publish the run again for its turn (same task id, its send stamp kept), and end this delivery."""
    request = task.request
    countdown = _countdown(rate, took)
    # (A run handed its key by a Queue/Replace handoff: its copy is a new delivery, not that handoff)
    headers = _queue.transient_headers_dropped(request.headers)
    headers[CONTENTION_HEADER] = int(headers.get(CONTENTION_HEADER) or 0) + 1
    headers[RATE_HEADER] = rate_parks_of(request) + 1
    headers.setdefault(CONTENDED_SINCE_HEADER, int(time.time() * 1000))
    headers[_queue.SENT_HEADER] = stamp
    if not headers.get(RATE_HEADER + "_since"):
        headers[RATE_HEADER + "_since"] = _dt.datetime.now(_dt.timezone.utc).isoformat()
    set_state(
        task,
        results.QUEUED,
        {
            "key": key,
            "since": headers[RATE_HEADER + "_since"],
            "position": took.position,
            "rate": rate.describe(),
        },
        unless_ready=True,
    )
    republish(task, task.signature_from_request(request, countdown=countdown, headers=headers), "rate wait")
    log.info(
        "%s[%s]: %s; parked (state QUEUED, no worker slot held), looks again in %.2f s",
        task.name,
        request.id,
        _over(rate, took),
        countdown,
    )
    ignored_as(request.id, f"parked by the rate of {key!r}, not dropped: it starts at its turn")
    raise Ignore()
