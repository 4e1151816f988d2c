"""Copies of a run: a message delivered again while (or after) its first run held the key.

A duplicate delivery of a run that still holds its key is parked (published again, marked with
``DUPLICATE_HEADER``, looked at after one lease); a copy of a run that ended and released its key is
dropped, or ends the task saying the body already ran when its result was never stored. The body never
runs twice for one delivery.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from celery.exceptions import Ignore

from celery_mongolock.admission.contention import Outcome
from celery_mongolock.admission.policies import Replace
from celery_mongolock.core.documents import copies
from celery_mongolock.core.documents.sets import is_gate, user_keys
from celery_mongolock.exceptions import StoreUnavailable, Superseded
from celery_mongolock.integration.config import get_store
from celery_mongolock.integration.handoff import DEBOUNCE_HEADER, HANDOFF_HEADER
from celery_mongolock.integration.results import has_backend, superseded_result
from celery_mongolock.integration.runs import (
    CONTENTION_HEADER,
    GuardedRun,
    delivery,
    has_final_state,
    ignored_as,
    log_acquire,
    republish,
    settled_by_another_line,
)

if TYPE_CHECKING:
    from celery_mongolock.integration.config import TaskOptions

__all__ = [
    "DUPLICATE_HEADER",
    "LOOKED_AGAIN_HEADER",
    "already_ran",
    "copy_of_a_retried_attempt",
    "copy_of_an_ended_run",
    "copy_run_ids",
    "copy_with_a_result",
    "end_second_look",
    "ended_without_a_result",
    "first_run_done",
    "guard_run_ids",
    "later_attempt_known",
    "park_duplicate",
    "second_look_of",
    "stale_line",
    "this_attempt_over",
]

#: Set on the copy of a message delivered again while its first run still held the key (see
#: ``park_duplicate``).
DUPLICATE_HEADER = "mongolock_parked_duplicate"

#: Set (``{"k": key, "r": the task's retries}``) on the marked copy that looks once more at a run that was
#: over with no result stored (``ended_without_a_result``, ``end_second_look``).
LOOKED_AGAIN_HEADER = "mongolock_looked_again"


def keep_a_debounced_copy_delivered_again(task: GuardedRun, key: str, options: TaskOptions) -> None:
    """A debounced copy (``Replace(debounce=...)``) whose admit finds its run running: when this very
    copy took the key (``due``) in a delivery whose worker then died, and the broker delivered it again,
    the run holding the key may be dead, so the copy is kept as any duplicate is (``park_duplicate``,
    then ``Ignore``), not dropped (the lock-set checker on RabbitMQ: a node killed just after such a copy
    took its first key lost the run, ``QUEUED`` forever). A first delivery returns (it is dropped)."""
    if copy_run_ids(task.request):
        park_duplicate(task, key, options, False)
        raise Ignore()


def park_duplicate(
    task: GuardedRun,
    key: str,
    options: TaskOptions,
    direct: bool,
    *,
    resent: bool = False,
    handoff_copy: bool = False,
) -> None:
    """Keep a copy of a duplicate delivery until the first run's fate is known.

    Acknowledging the duplicate also acknowledges the first delivery (they share one broker message:
    kombu's Redis transport keeps one unacknowledged entry per message), so if the first run's worker
    then died nothing would bring the task back. The copy is published again, marked, to be looked
    at after one lease length: dropped if the first run has released the key, run if the first run
    died (its lease released for it or expired), parked again if it is still running.

    ``resent``: a first delivery whose admit was sent again after a lost reply (``Admission.resent``):
    the run holding the key is most likely its own handoff (the lost send parked it), not a duplicate.
    ``handoff_copy``: another copy of the handoff message of a run of several keys whose first copy
    runs, most often of our own making (a debounced run's delayed copy beside the handoff that a release
    published; docs/known-issues.md), so logged at INFO.
    """
    request = task.request
    if direct or request.is_eager or request.called_directly:
        return
    countdown = max(1.0, min(options.lease_seconds, 300.0))
    headers = dict(request.headers or {})
    headers[DUPLICATE_HEADER] = int(headers.get(DUPLICATE_HEADER) or 0) + 1
    republish(
        task, task.signature_from_request(request, countdown=countdown, headers=headers), "parked duplicate"
    )
    if handoff_copy:
        log_acquire.info(
            "%s[%s]: another copy of its handoff message (its debounced copy beside its handoff, a "
            "handoff published twice, or a message delivered again) while the first runs with %r; kept "
            "aside, looked at again in %gs",
            task.name,
            task.request.id,
            key,
            countdown,
        )
    elif resent:
        log_acquire.info(
            "%s[%s]: the run holds %r under another delivery of it (this delivery's admit was sent again "
            "after a lost reply, which may have parked it); looked at again in %gs",
            task.name,
            task.request.id,
            key,
            countdown,
        )
    else:
        log_acquire.warning(
            "%s[%s]: duplicate delivery while the first run holds %r; parked, looked at again in %gs",
            task.name,
            task.request.id,
            key,
            countdown,
        )


def copy_of_a_retried_attempt(task: GuardedRun, key: str, entry: dict[str, Any]) -> NoReturn:
    """A copy of an attempt whose body called ``self.retry()`` (a stale handoff message, a redelivery):
    a later attempt of the task is parked, handed, running or over on ``key`` and carries the task on
    (its result is that attempt's to store). Never run, parked, or ended here."""
    request = task.request
    log_acquire.info(
        "%s[%s]: copy of attempt %s on %r, whose body retried: a later attempt of the task is parked, "
        "running or over; dropped",
        task.name,
        request.id,
        entry["r"],
        key,
    )
    ignored_as(
        request.id,
        f"is a copy of attempt {entry['r']} on {key!r}, whose body retried: this copy is dropped",
    )
    raise Ignore()


#: The least time a run's worker is given to store the result after its release (``ended_without_a_result``):
#: it also publishes the run's callbacks and the next task of its chain first (Celery's trace).
LOOK_AGAIN_AT_LEAST_S = 5.0


def ended_without_a_result(
    task: GuardedRun, key: str, options: TaskOptions, keys: list[str] | None = None
) -> Outcome:
    """The run is over on ``key`` (its body ran and released the key) and the task has no result stored.

    The result may still be on its way: the run's worker stores it a few milliseconds after the release,
    and a copy of the run can look in between (a second handoff message of it, a redelivery, a delivery
    whose lost admit reply had parked the run). Answering ``already-ran`` then races that result, and the
    first result stored is the one Celery keeps (CI: a run's real result lost to its copy's ``already-ran``
    7 ms earlier; the lock-set checker, Redis seed 21: a cancelled run's ``superseded`` lost so, 12 ms).
    So this delivery is published again, marked with ``LOOKED_AGAIN_HEADER`` (the key and the attempt),
    due after one lease length (at least ``LOOK_AGAIN_AT_LEAST_S``), and ends (``Ignore``). The marked
    copy looks at the result only, never at the keys (``end_second_look``). Not a worker's run: at once.

    A run whose body stopped for a newer send (``Replace(cancel_running=True)``) says so in its ending
    (``LeaseStore.ended_superseded``, read now, while the key remembers it): the marked copy carries that
    newer send (``by``) and ends the task superseded, as the run would have (``keys``: all of a
    several-keys run's keys, for its result)."""
    request = task.request
    policy = options.on_contention
    by = _superseded_ending(task, key) if isinstance(policy, Replace) and policy.cancel_running else None
    if request.is_eager or request.called_directly:
        return Outcome(_answer(task, key, by, keys, options))
    countdown = max(LOOK_AGAIN_AT_LEAST_S, min(options.lease_seconds, 300.0))
    headers = dict(request.headers or {})
    look: dict[str, Any] = {"k": key, "r": int(getattr(request, "retries", 0) or 0)}
    if keys:  # (its result names its keys, and the first of them for its set's gate)
        look["ks"] = list(keys)
    if by is not None:
        look["by"] = by
    headers[LOOKED_AGAIN_HEADER] = look
    # (No expiry: the copy never runs the body, and an expired one would end the task REVOKED.)
    signature = task.signature_from_request(request, countdown=countdown, headers=headers, expires=None)
    republish(task, signature, "second look at a run that is over")
    log_acquire.info(
        "%s[%s]: the run is over on %r and no result is stored yet (its worker may be storing it now); "
        "looked at again in %gs",
        task.name,
        request.id,
        key,
        countdown,
    )
    ignored_as(request.id, f"is over on {key!r}, its result not stored yet: looked at again later")
    raise Ignore()


def second_look_of(request: Any) -> Mapping[str, Any] | None:
    """The key and attempt of a marked copy published by ``ended_without_a_result`` for this very attempt
    (``LOOKED_AGAIN_HEADER``), or None (a header a later attempt inherited through its retry is not its)."""
    headers = getattr(request, "headers", None) or {}
    look = headers.get(LOOKED_AGAIN_HEADER) or getattr(request, LOOKED_AGAIN_HEADER, None)
    if (
        isinstance(look, Mapping)
        and isinstance(look.get("k"), str)
        and look.get("r") == int(getattr(request, "retries", 0) or 0)
    ):
        return look
    return None


def end_second_look(task: GuardedRun, look: Mapping[str, Any], options: TaskOptions) -> dict[str, Any]:
    """The marked copy of ``ended_without_a_result``: the run was over then, so the keys are not looked at
    again (a key remembers only its last runs). Dropped when the task has its result by now (or a later
    attempt carries it on); else the task's result: ``already-ran`` (the run's worker died before storing
    it)."""
    request, key = task.request, str(look["k"])
    store = get_store(task.app)

    # A later attempt known on the key carries the task on, whatever the stored state says: its retry may
    # have parked and written ``QUEUED`` over the ``RETRY`` (the lock-set checker, Redis seed 1 in CI: the
    # task ended ``already-ran`` while its next attempt was parked, and that attempt's work was lost).
    def carried_on() -> bool:
        try:
            return bool(store.later_attempt(key, request.id, int(getattr(request, "retries", 0) or 0)))
        except StoreUnavailable as exc:
            # Not dropped (nobody else would end the task): this marked copy looks again later.
            countdown = max(LOOK_AGAIN_AT_LEAST_S, min(options.lease_seconds, 300.0))
            headers = {**dict(request.headers or {}), LOOKED_AGAIN_HEADER: dict(look)}
            signature = task.signature_from_request(
                request, countdown=countdown, headers=headers, expires=None
            )
            republish(task, signature, "second look at a run that is over")
            log_acquire.warning(
                "%s[%s]: cannot tell whether a later attempt carries the task on %r (%s); looked at "
                "again in %gs",
                task.name,
                request.id,
                key,
                exc,
                countdown,
            )
            raise Ignore() from exc

    if has_final_state(task, carried_on=carried_on) or carried_on():
        log_acquire.info("%s[%s]: the run over on %r has its result now; dropped", task.name, request.id, key)
        raise Ignore()
    by, keys = look.get("by"), look.get("ks")
    return _answer(
        task,
        key,
        by if isinstance(by, str) and by else None,
        user_keys(keys) or None if isinstance(keys, list) else None,
        options,
    )


def _superseded_ending(task: GuardedRun, key: str) -> str | None:
    """The newer send this run's body stopped for before it released ``key`` (its ending says so), or
    None: it did not, or MongoDB does not answer (the task then ends ``already-ran``, as before)."""
    request = task.request
    try:
        return get_store(task.app).ended_superseded(key, request.id, int(getattr(request, "retries", 0) or 0))
    except StoreUnavailable as exc:
        log_acquire.warning(
            "%s[%s]: cannot tell whether the run over on %r stopped for a newer send (%s)",
            task.name,
            request.id,
            key,
            exc,
        )
        return None


def _answer(
    task: GuardedRun, key: str, by: str | None, keys: list[str] | None, options: TaskOptions
) -> dict[str, Any]:
    """The result of a run over with no result stored: ``superseded`` when its body stopped for the newer
    send ``by`` (``Superseded`` raised with ``Replace(fail_superseded=True)``), else ``already-ran``."""
    if by is None:
        return already_ran(keys[0] if keys and is_gate(key) else key, task.request.id)
    policy = options.on_contention
    if isinstance(policy, Replace) and policy.fail_superseded:
        raise Superseded(keys[0] if keys else key, None, by)
    return dict(superseded_result(key, by, keys))


def copy_of_an_ended_run(
    task: GuardedRun, store: Any, key: str, options: TaskOptions, keys: list[str] | None = None
) -> Outcome:
    """A copy of a run that ended and released ``key`` itself: end the task saying so when its result
    was never stored (the run's worker died in between: ``ended_without_a_result``), else drop the copy.
    Never runs the body.

    A body's ``RETRY`` left by an earlier attempt is no result of this run: it counts only when a later
    attempt than this copy's is known on ``key`` (``has_final_state``; one more read, only then)."""
    request = task.request
    if not has_final_state(task, carried_on=lambda: later_attempt_known(task, store, key)):
        return ended_without_a_result(task, key, options, keys)
    log_acquire.info(
        "%s[%s]: %s of a run that has ended and released %r; dropped",
        task.name,
        request.id,
        "parked duplicate"
        if (request.headers or {}).get(DUPLICATE_HEADER)
        else "redelivery"
        if (request.delivery_info or {}).get("redelivered")
        else "contention retry",
        key,
    )
    raise Ignore()


def stale_line(task: GuardedRun, store: Any, key: str) -> str | None:
    """Why this run, its keys taken, must not start its body: the task's stored state shows that another
    line of it (a copy of its attempt, or a later attempt) has settled it (``settled_by_another_line``);
    None when it may run. A backend read, only for copies, handoffs, delayed copies and later attempts.

    A handoff or a ``Replace(debounce=...)`` delayed copy is the run's message published again: the run
    may have ended meanwhile, superseded by a newer send (its result written, its record gone from the
    key) while that message was on its way (the lock-set checker, Redis seed 1: a debounced run of a set
    superseded on its gate, whose delayed copy was then handed the gate and ran its body 1.9 s later)."""
    headers = getattr(task.request, "headers", None) or {}
    published_again = any(headers.get(name) for name in (HANDOFF_HEADER, DEBOUNCE_HEADER))
    copy = bool(copy_run_ids(task.request)) or published_again
    return settled_by_another_line(task, copy, lambda: later_attempt_known(task, store, key))


def later_attempt_known(task: GuardedRun, store: Any, key: str) -> bool:
    """Whether ``key`` knows an attempt of this task later than this message's (its body retried). When
    MongoDB does not answer, True: the copy is dropped, as it was before this look existed."""
    request = task.request
    try:
        return bool(store.later_attempt(key, request.id, int(getattr(request, "retries", 0) or 0)))
    except StoreUnavailable as exc:
        log_acquire.warning(
            "%s[%s]: cannot tell whether a later attempt carries the task on %r (%s); the copy is dropped",
            task.name,
            request.id,
            key,
            exc,
        )
        return True


def this_attempt_over(task: GuardedRun, store: Any, keys: list[str]) -> bool:
    """Whether the task's stored state says this attempt has nothing left to do: a final state, or a body's
    ``RETRY`` written by this attempt (a later attempt is known on one of ``keys``), not by an earlier one
    whose retry this attempt is. (Without ``result_extended`` a ``RETRY`` does not say which attempt wrote
    it: the retried attempt of a ``Replace(debounce)`` set, handed its gate by the sweeper, found its
    later key not handed to it, took the ``RETRY`` its first attempt wrote for its own, and was dropped:
    the task stayed ``RETRY`` for good, the lock-set checker on RabbitMQ, seed 1.)"""
    return has_final_state(task, carried_on=lambda: any(later_attempt_known(task, store, k) for k in keys))


def first_run_done(task: GuardedRun, store: Any, key: str) -> bool:
    """For a parked duplicate, or a message the broker delivered again (a worker died before it
    acknowledged, a visibility timeout): did a run of this very delivery (same task id, same retry
    and contention-retry count) end and release the key itself? Then running it again would be a
    second run of one submission. One read, only for such messages. The key remembers the last
    ``SEEN_KEPT`` runs that ended so (``seen``), whoever took it since, for 2 hours after its last
    lease (``SEEN_KEEP_MS``); the holder fields cover a holder recorded without its delivery."""
    request = task.request
    ended_runs = copy_run_ids(request)
    if not ended_runs:
        return False
    return bool(
        store.run_ended(
            key,
            ended_runs,
            task_id=request.id,
            delivery=delivery(request),
            parked=bool((request.headers or {}).get(DUPLICATE_HEADER)),
        )
    )


def already_ran(key: str, task_id: str) -> dict[str, Any]:
    """The result of a copy of a run whose body ran and ended, but whose result was never stored."""
    return {
        "mongolock": "already-ran",
        "key": key,
        "reason": f"the body of {task_id} ran and released {key!r}; its worker died before it stored "
        "the result, which is lost (the body is never run twice)",
    }


def copy_run_ids(request: Any) -> list[str]:
    """What a copy of a message (parked duplicate, or delivered again by the broker) is matched on in
    ``seen`` (``copies.ran``); empty for any other message (a first delivery is never checked).

    Any run of the same attempt (task id and own retries), whatever its contention retries: a parked
    copy that MongoDB did not answer goes on as a contention retry (``<retries>.1``), and is still a copy
    of the run ``<retries>.0`` that holds the key. A parked copy also matches a holder recorded without its
    delivery (an older version, ``hold()``)."""
    parked = bool((getattr(request, "headers", None) or {}).get(DUPLICATE_HEADER))
    redelivered = bool((getattr(request, "delivery_info", None) or {}).get("redelivered"))
    task_id = getattr(request, "id", None)
    if not (parked or redelivered) or not task_id:
        return []
    ids = [copies.run_id(task_id, f"{int(getattr(request, 'retries', 0) or 0)}.")]
    return [*ids, copies.run_id(task_id, "")] if parked else ids


def guard_run_ids(request: Any) -> list[str]:
    """What the acquire of ``request`` is refused on when remembered as over (``ran_any``): a copy's run
    ids (``copy_run_ids``), and a contention retry's attempt (task id and own retries).

    A contention retry continues an attempt that had not run, but it may not be the only line of it: a
    message the broker delivered again after its run had published its contention retry (the run's
    acknowledgement lost with the connection, a broker restart) goes on as a second line, with no mark of
    the redelivery (a delivery flag, not a header the retry carries). Once a run of either line ended
    and released the key, the other line's retries are copies of that run, never a second run."""
    ids = copy_run_ids(request)
    if ids:
        return ids
    headers = getattr(request, "headers", None) or {}
    task_id = getattr(request, "id", None)
    if task_id and int(headers.get(CONTENTION_HEADER) or 0) > 0:
        return [copies.run_id(task_id, f"{int(getattr(request, 'retries', 0) or 0)}.")]
    return []


def copy_with_a_result(task: GuardedRun, copy: bool) -> bool:
    """This message is a ``copy`` (redelivered, a parked duplicate, a handoff) and its task's stored state
    is final (or its body's own retry): the run has a result of its own, which a ``superseded`` answer to
    the copy must not overwrite (a run whose lease was lost mid-body is not remembered as over, ``seen``,
    on the key a newer send took). False without a stored result to ask (nothing to overwrite then)."""
    if not copy or task.ignore_result or task.request.ignore_result:
        return False
    return has_backend(task.app) and has_final_state(task, carried_on=lambda: False)
