"""The guarded body: a run admitted on its key(s) runs its body with ``current_lease()`` set, and gives
its lease(s) back on every exit.

``SingletonTask`` renders the key(s) and the options in force and hands each run to ``guarded``: a task
of one ``key=`` and a task of ``keys=(...)`` alike (``current_lease()`` is a ``Lease`` for the first, a
``LeaseSet`` for the second). The run is admitted over its key set by ``admit.take_keys``; its task is
taken as the narrow protocol ``runs.GuardedRun``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from celery.exceptions import Ignore

from celery_mongolock.admission.contention import Outcome
from celery_mongolock.admission.policies import Fail, Wait
from celery_mongolock.core.documents.sets import is_gate
from celery_mongolock.core.lease_set import LeaseSet
from celery_mongolock.core.store import Lease, LeaseStore
from celery_mongolock.exceptions import StoreUnavailable
from celery_mongolock.integration import signals
from celery_mongolock.integration.admit import take_keys
from celery_mongolock.integration.beatcheck import recorded_tick
from celery_mongolock.integration.config import TaskOptions, get_store
from celery_mongolock.integration.duplicates import stale_line
from celery_mongolock.integration.plain_run import parks
from celery_mongolock.integration.rate_gate import pass_rate
from celery_mongolock.integration.reentrant import end_holds, joined, note_taken, reentered
from celery_mongolock.integration.runs import GuardedRun, give_back_quietly, ignored_as, unavailable
from celery_mongolock.integration.supersede import run_body

__all__ = ["current_lease", "guarded"]

log_acquire = logging.getLogger("celery_mongolock.acquire")
log_release = logging.getLogger("celery_mongolock.release")

_current: contextvars.ContextVar[Lease | None] = contextvars.ContextVar(
    "celery_mongolock_lease", default=None
)

#: The body of a run: the task's ``run`` with the call's arguments.
Body = Callable[[], Any]


def current_lease() -> Lease | None:
    """The lease held by the singleton task running in this context (None outside one).

    ``current_lease().fence`` is the fencing token to pass to the resource the task writes to;
    ``current_lease().lost`` turns true if the lease is lost while the body runs (taken over after the
    heartbeat could not renew it, or force-released); ``current_lease().raise_if_lost()`` raises
    ``LeaseLost`` then. A task with ``keys=(...)`` gets a ``LeaseSet`` (a ``Lease`` of all its keys):
    ``current_lease()["email-group:7"]`` is that key's lease, with its own fence.
    """
    return _current.get()


def guarded(
    task: GuardedRun,
    keys: list[str],
    limits: Mapping[str, int | None],
    options: TaskOptions,
    body: Body,
    *,
    direct: bool,
    one: bool,
) -> Any:
    """A run admitted by its policy over its keys (sorted), then its body holding all of them. ``one``: a
    task of one ``key=`` (``current_lease()`` is that key's ``Lease``; for ``keys=(...)``, a ``LeaseSet``)."""
    store = get_store(task.app)
    inner = reentered(store, limits)  # the keys this run holds already (a call in-process)
    rest = [key for key in keys if key not in inner]
    if not rest:  # the run holds them all already: its own leases, reentered (no command)
        return _run_reentered(task, inner[keys[0]] if one else joined(inner, None), body)
    try:
        fresh = _take_the_rest(task, store, rest, limits, options, direct=direct, one=one)
    except BaseException:
        end_holds(inner)
        raise
    if not isinstance(fresh, list):
        end_holds(inner)
        return fresh  # the policy's outcome's value (e.g. Skip's result); the body did not run
    untick = _recorded_tick(task, one)
    if one and fresh[0].remaining <= 0:  # (not ``lease.lost``: that would queue a release marking it over)
        # Its acquire was answered after the lease's whole time had passed (MongoDB paused or slow): the
        # key may be someone else's by now. Fail closed: give it back, and try again later. (A store that
        # does not answer: it expires on its own. A beat tick's run gives its tick back: its retry runs the
        # tick.) A set of keys was confirmed by one renewal instead (``plain_run``, ``key_set``).
        give_back_quietly(store, fresh, untick=untick)
        key = fresh[0].key
        why = StoreUnavailable(f"the acquire of {key!r} was answered after its lease had run out")
        unavailable(task, key, why, options.on_contention, direct)
    taken: Lease = fresh[0] if one else LeaseSet(fresh)
    note_taken(store, taken, limits)
    held = taken if one else joined(inner, LeaseSet(fresh))
    request = task.request
    if one:
        log_acquire.info("%s[%s] acquired %r (fence %s)", task.name, request.id, taken.key, taken.fence)
    else:
        fences = LeaseSet(fresh).fences
        log_acquire.info("%s[%s] acquired %s (fences %s)", task.name, request.id, rest, fences)
    for lease in fresh:
        if not is_gate(lease.key):  # (a Replace set's gate is the library's own: no signal, no metric)
            signals.lease_acquired.send(sender=task, key=lease.key, lease=lease)
    # (Replace(cancel_running=True): told of a newer send, ended superseded or terminated: supersede)
    return _run_holding(
        task, store, held=held, taken=taken, fresh=fresh, options=options, body=body, untick=untick
    )


def _recorded_tick(task: GuardedRun, one: bool) -> int | None:
    """The beat tick this run recorded on its key, given back with the key when the run does not run
    (``recorded_tick``: none for a task of ``keys=(...)``, whose give-back must not erase the tick another
    task recorded on one of its keys)."""
    return recorded_tick(task.request, one)[0]


def _run_holding(
    task: GuardedRun,
    store: LeaseStore,
    *,
    held: Any,
    taken: Any,
    fresh: list[Lease],
    options: TaskOptions,
    body: Body,
    untick: int | None,
) -> Any:
    """The body, with ``held`` (the run's lease or leases, its reentered ones included) as the current
    lease: run by the policy's rules (``run_body``, with the leases this run ``taken``), then ``held``
    released (a store that does not answer: retried in the background) and ``lease_released`` sent for
    each lease this run took (``fresh``)."""
    token = _current.set(held)
    cut_short: BaseException | None = None
    try:
        return run_body(task, store, taken, options.on_contention, body)
    except BaseException as exc:
        if not isinstance(exc, Exception):  # SystemExit, KeyboardInterrupt: the process is going away
            cut_short = exc
        raise
    finally:
        if cut_short is None:  # (the body ended: at the process's exit its keys go as a run's that ended)
            for lease in fresh:
                lease.body_ended = True
        _current.reset(token)
        if cut_short is not None:
            _give_back_cut_short(task, store, fresh, cut_short, untick)
        try:
            held.release()
        except StoreUnavailable as exc:
            log_release.warning("%s[%s]: %s (retrying in the background)", task.name, task.request.id, exc)
        for lease in fresh:
            if not is_gate(lease.key):
                signals.lease_released.send(sender=task, key=lease.key, lease=lease)


def _give_back_cut_short(
    task: GuardedRun, store: LeaseStore, fresh: list[Lease], exc: BaseException, untick: int | None
) -> None:
    """A body cut short by its process going away (a pool child's ``SystemExit`` at a warm or cold
    shutdown's SIGTERM or SIGQUIT, or a ``KeyboardInterrupt``) did not end: its keys are given back, not
    released as a run that ended, so that its message, delivered again (``acks_late``), runs it again
    instead of being taken for a copy of a run that is over ("already-ran": the work lost). As a run
    whose worker was killed (``childwatch``)."""
    log_release.warning(
        "%s[%s]: its body was cut short (%s: %s); its key(s) %s are given back, not marked as run, so its "
        "message, if delivered again, is not taken for a run that ended",
        task.name,
        task.request.id,
        type(exc).__name__,
        exc,
        [lease.key for lease in fresh],
    )
    # A beat tick's run gives its tick back too: its copy runs the tick (once: the copy takes it again).
    give_back_quietly(store, fresh, untick=untick)


def _take_the_rest(
    task: GuardedRun,
    store: LeaseStore,
    rest: list[str],
    limits: Mapping[str, int | None],
    options: TaskOptions,
    *,
    direct: bool,
    one: bool,
) -> list[Lease] | Any:
    """The keys a run does not hold yet, all taken (their leases, in key order) and its start recorded in
    its rate's windows, or the policy's outcome's value (the body does not run)."""
    some = {key: limits[key] for key in rest}
    taken = take_keys(task, rest, options, direct=direct, limits=some, one=one)
    if isinstance(taken, Outcome):
        return taken.value
    _drop_a_stale_line(task, store, taken, rest[0])  # (before the rate: no start spent on it)

    def retake() -> tuple[list[Lease], list[Lease]] | Outcome:
        again = take_keys(task, rest, waiting_for_keys(options), direct=direct, limits=some, one=one)
        return again if isinstance(again, Outcome) else (again, again)

    untick = _recorded_tick(task, one)
    queued = parks(task, options.on_contention, direct, one=one)
    passed = pass_rate(
        task, rest, taken, taken, options, direct=direct, retake=retake, untick=untick, queued=queued
    )
    return passed.value if isinstance(passed, Outcome) else passed


def waiting_for_keys(options: TaskOptions) -> TaskOptions:
    """``options`` for a direct call that takes its keys again after waiting for its rate's turn: it waits
    for them (``Wait``, woken by their release) for up to its rate's period and ``Wait``'s default, then
    fails with ``LockContended``; never its own contention policy (a ``Retry`` or ``Skip`` call would be
    refused or dropped after it had been given its turn)."""
    period = options.rate.period if options.rate is not None else 0.0
    return dataclasses.replace(options, on_contention=Wait(timeout=period + Wait.timeout, then=Fail()))


def _drop_a_stale_line(task: GuardedRun, store: LeaseStore, leases: list[Lease], key: str) -> None:
    """Its keys taken, a copy or a later attempt whose task another line has settled (``stale_line``)
    gives them back unrun and is dropped: the body never runs twice for one task."""
    why = stale_line(task, store, key)
    if why is None:
        return
    give_back_quietly(store, leases)
    request = task.request
    log_acquire.warning("%s[%s]: not run on %r: %s; dropped", task.name, request.id, key, why)
    ignored_as(request.id, f"was not run: {why}; this delivery is dropped")
    raise Ignore()


def _run_reentered(task: GuardedRun, held: Lease, body: Body) -> Any:
    """Run the body with reentrant holds of leases the running run holds (no command sent)."""
    log_acquire.info("%s[%s] reentered %s (fence %s)", task.name, task.request.id, held.key, held.fence)
    token = _current.set(held)
    try:
        return body()
    finally:
        _current.reset(token)
        held.release()
