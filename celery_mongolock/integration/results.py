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

from celery_mongolock.core.documents.entries import MAX_PARKED
from celery_mongolock.core.documents.sets import is_gate, user_keys
from celery_mongolock.core.store_rate import rate_windows
from celery_mongolock.exceptions import QueueTimeout, StoreUnavailable, Superseded
from celery_mongolock.integration import signals
from celery_mongolock.integration.superseded import SupersededResult

if TYPE_CHECKING:
    from celery_mongolock.core.store import LeaseStore

__all__ = [
    "QUEUED",
    "EndingPublisher",
    "fails_superseded",
    "full_reason",
    "has_backend",
    "marked_queued",
    "skipped_result",
    "state_of",
    "superseded_ending",
    "superseded_outcome_words",
    "superseded_result",
    "timeout_ending",
    "write_superseded",
    "write_timed_out",
]

log = logging.getLogger("celery_mongolock.queue")


# -- results the sweeper (or the admitting run) writes -----------------------------------------------------
def has_backend(app: Celery) -> bool:
    """Whether the app stores results (a superseded or timed-out run's result has somewhere to go)."""
    from celery.backends.base import DisabledBackend

    return not isinstance(app.backend, DisabledBackend)


def superseded_result(key: str, by: str, keys: Sequence[str] | None = None) -> SupersededResult:
    """The result of a run replaced by a newer send (``Replace``); with ``keys=``, ``key`` is its first
    key and ``keys`` all of them (the same result whichever key it was superseded on; a set's gate is not
    named: ``sets.user_keys``)."""
    keys = user_keys(keys or [])
    if keys:
        return {"mongolock": "superseded", "key": keys[0], "keys": list(keys), "by": by}
    return {"mongolock": "superseded", "key": key, "by": by}


def skipped_result(key: str, reason: str) -> dict[str, Any]:
    """The result of a run parked past its ``Queue(timeout=...)`` whose ``then`` is not Fail."""
    return {"mongolock": "skipped", "key": key, "reason": reason, "holder": {}, "expires_at": None}


def superseded_ending(key: str, by: str, keys: list[str] | None = None) -> dict[str, Any]:
    """The ``endings`` header of a run superseded by ``by`` on ``key`` (``keys``: all of its keys; a set's
    gate is not named)."""
    keys = user_keys(keys or [])
    key = keys[0] if keys and is_gate(key) else key
    return {"how": "superseded", "k": key, "by": by, "ks": keys or None}


def timeout_ending(key: str, reason: str, *, fail: bool) -> dict[str, Any]:
    """The ``endings`` header of a run parked past its deadline on ``key`` (``fail``: ``then`` is Fail)."""
    return {"how": "timeout", "k": key, "reason": reason, "fail": bool(fail)}


#: ``publish(key, entry, ending)``: end the run ``entry`` through Celery from its own message, True if it
#: did (the run has callbacks or is in a chain or a chord: ``endings``), False to have its result written.
EndingPublisher = Callable[[str, Mapping[str, Any], Mapping[str, Any]], bool]


def fails_superseded(app: Celery, name: object) -> bool:
    """Task ``name`` ends its superseded runs ``FAILURE`` (``Replace(fail_superseded=True)``)."""
    task = app.tasks.get(name) if isinstance(name, str) else None
    options = getattr(task, "mongolock_options", None)
    if not callable(options):
        return False
    try:
        return bool(getattr(options().on_contention, "fail_superseded", False))
    except Exception:  # a task whose options do not read: the default
        return False


def rate_limited(app: Celery, name: object) -> bool:
    """Task ``name`` has a rate (``rate=RateLimit(...)`` or ``Throttle(...)``): its runs may wait in a key's
    window (``core.store_rate``)."""
    task = app.tasks.get(name) if isinstance(name, str) else None
    options = getattr(task, "mongolock_options", None)
    if not callable(options):
        return False
    try:
        return options().rate is not None
    except Exception:  # a task whose options do not read: none
        return False


def _leave_the_window(app: Celery, store: LeaseStore, key: str, entry: Mapping[str, Any]) -> None:
    """A superseded run of a rate-limited task leaves ``key``'s window now (it may wait there: rate-parked
    before it parked on the key), so that the runs sent after it do not wait for its turn until its place
    goes stale (``period`` + 15 s). One command, only for such runs; best effort."""
    if not rate_limited(app, entry.get("n")) or not entry.get("id"):
        return
    try:
        rate_windows(store).leave(key, str(entry["id"]))
    except StoreUnavailable as exc:
        log.warning("%s: leaving the rate window of %r failed: %s", entry.get("t"), key, exc)


def leave_later_keys(store: LeaseStore, key: str, entry: Mapping[str, Any]) -> None:
    """A run of a set superseded on ``key`` (its set's gate) after it got that key (``rv``: its reservation
    was taken back, or it was handed the key before): it may wait on, or hold a reservation of, its later
    keys, which it can never claim now. It leaves them (its place there would be handed to it for nothing,
    and a reservation would keep the key from every run until it lapsed: a lease time). Done by whichever
    process ends it (the run that superseded it, or the sweeper when that run did not), best effort: a
    place left behind heals when it is handed (the run's claim of the gate answers ``superseded``)."""
    if not (entry.get("rv") and entry.get("ks") and entry.get("id")):
        return
    try:
        for later in [str(k) for k in entry["ks"] if k != key]:
            store.unpark(later, str(entry["id"]))
            store.spill.drop(later, [str(entry.get("t"))])
    except StoreUnavailable as exc:
        log.warning("%s: leaving its later keys after %r failed: %s", entry.get("t"), key, exc)


def full_reason(
    key: str, parked: int, max_length: int | None, entry: Mapping[str, Any], *, in_document: int | None = None
) -> str:
    """Why a run found the queue of ``key`` full: ``max_length`` runs ``parked`` (spilled ones included),
    the most runs a key's lease document keeps (``in_document`` of them, ``MAX_PARKED``: runs that are not
    spilled, those of several keys), or the document could not take the run's message
    (``entries.PARK_BUDGET``)."""
    if max_length is not None and parked >= max_length:
        return f"the queue of {key!r} is full ({parked} runs parked, its max_length)"
    in_document = parked if in_document is None else in_document
    if in_document >= MAX_PARKED:
        return (
            f"the queue of {key!r} is full: {in_document} runs parked in its lease document, the most it "
            f"keeps ({MAX_PARKED}) for runs that are not spilled beyond it, such as runs of several keys "
            "(keys=...)"
        )
    message = entry.get("m")
    size = len(message) if isinstance(message, (bytes, str)) else 0
    return (
        f"the queue of {key!r} is full: its {parked} parked runs and this run's message "
        f"({size / 2**20:.2f} MiB) would pass the 16 MiB MongoDB document they share; pass large data by "
        "reference, not as arguments"
    )


def superseded_outcome_words(policy: object) -> str:
    """How a superseded run ends, for its log line: ``FAILURE`` with ``Superseded`` when its policy asks
    (``Replace(fail_superseded=True)``), else ``SUCCESS`` with the superseded result."""
    if getattr(policy, "fail_superseded", False):
        return "FAILURE with Superseded (Replace(fail_superseded=True))"
    return "SUCCESS with a 'superseded' result"


#: The state a parked run writes for itself (``task.QUEUED``).
QUEUED = "QUEUED"


def state_of(app: Celery, task_id: str) -> str | None:
    """A run's state in the result backend (None if it cannot be read)."""
    try:
        return str(app.backend.get_task_meta(task_id).get("status"))
    except Exception:
        return None


#: How long a worker that does not have a run's task leaves that run's ending (superseded, timed out while
#: parked) to a worker that has it, which ends it through Celery from its checked message (its callbacks,
#: chain and chord: ``endings``). Past this, any worker writes its result, without them, and says so.
UNKNOWN_TASK_WAIT_S = 300.0


def _left_to_a_worker_with_the_task(
    app: Celery, key: str, entries: list[Mapping[str, Any]], since: str, publish: EndingPublisher | None
) -> list[Mapping[str, Any]]:
    """The entries this worker leaves for now: it lacks their task (a worker of another queue, a deploy
    under way), so it could not end them through Celery, and they ended less than ``UNKNOWN_TASK_WAIT_S``
    ago (``since``: the entry's field of that time)."""
    if publish is None:
        return []
    now = _dt.datetime.now(_dt.timezone.utc)
    left = []
    for entry in entries:
        name = entry.get("n")
        if not isinstance(name, str) or name in app.tasks:
            continue
        at = entry.get(since)
        if isinstance(at, _dt.datetime):
            at = at if at.tzinfo is not None else at.replace(tzinfo=_dt.timezone.utc)
        if isinstance(at, _dt.datetime) and (now - at).total_seconds() <= UNKNOWN_TASK_WAIT_S:
            left.append(entry)
            continue
        log.warning(
            "%s[%s] on %r: no worker that has its task ended it within %g s; its result is written by a "
            "worker that does not have %s, without its callbacks, chain or chord",
            name,
            entry.get("t"),
            key,
            UNKNOWN_TASK_WAIT_S,
            name,
        )
    return left


def named_key(key: str, keys: object) -> str:
    """The key a result, an error or an ending names for a run that ended on ``key``: ``key``, or for a
    ``Replace`` set's gate the first of the run's own keys (``keys``: its entry's ``ks``)."""
    if not is_gate(key):
        return key
    named = user_keys(keys if isinstance(keys, list) else [])
    return named[0] if named else key


def record_ending(
    store: LeaseStore, key: str, how: str, entry: Mapping[str, Any], *, fence: int | None, **when: Any
) -> None:
    """The history record of a run that ended ``how`` (``superseded``, ``timeout``) while it waited on
    ``key``; on a set's gate, in the history of each of the task's own keys too (``why KEY`` on one of
    them tells of it), without a fence there."""
    store.record_run_ending(key, how, entry, fence=fence, **when)
    if is_gate(key):
        for other in user_keys(entry.get("ks") or []):
            store.record_run_ending(other, how, entry, fence=None, **when)


def record_superseded(
    store: LeaseStore, key: str, entry: Mapping[str, Any], *, fence: int | None, by: str | None, **when: Any
) -> None:
    """``record_ending`` of a run superseded by ``by``."""
    record_ending(store, key, "superseded", entry, fence=fence, by=by, **when)


def write_superseded(
    app: Celery,
    store: LeaseStore,
    key: str,
    entries: list[Mapping[str, Any]],
    *,
    ready: Callable[[str], bool] | None = None,
    fence: int | None = None,
    publish: EndingPublisher | None = None,
) -> list[Mapping[str, Any]]:
    """Write SUCCESS ``superseded`` for runs that a newer send replaced, then forget them; return the
    entries left for later. Each gets a history record (queued: written at the heartbeat's next tick);
    ``fence``: the key's fence.

    A parked run writes its own state ``QUEUED`` after its park, so a result written before that could be
    overwritten by it (the backend's read and write are not one step): with ``ready``, only the runs it
    accepts are written now (the others stay in ``sup``: the run itself, after writing ``QUEUED``, or the
    sweeper writes them). So do runs of a task this worker does not have, for ``UNKNOWN_TASK_WAIT_S``: a
    worker that has it ends them through Celery (their callbacks, chain and chord)."""
    done = []
    left = [e for e in entries if ready is not None and not ready(str(e["t"]))]
    left += _left_to_a_worker_with_the_task(app, key, [e for e in entries if e not in left], "at", publish)
    for entry in _claimed(store, key, "sup", [e for e in entries if e not in left]):
        by, keys = str(entry.get("by")), user_keys(entry.get("ks") or []) or None
        if publish is not None and publish(key, entry, superseded_ending(key, by, keys)):
            pass  # ended by a worker from its message: its callbacks, chain and chord go on
        elif has_backend(app) and fails_superseded(app, entry.get("n")):
            app.backend.mark_as_failure(
                entry["t"], Superseded(keys[0] if keys else key, None, by, held=False)
            )
        elif has_backend(app):
            app.backend.store_result(entry["t"], superseded_result(key, by, keys), "SUCCESS")
        signals.run_superseded.send(sender=None, app=app, key=key, task_id=entry["t"], by=entry.get("by"))
        _leave_the_window(app, store, key, entry)
        leave_later_keys(store, key, entry)
        record_superseded(
            store,
            key,
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


def _claimed(
    store: LeaseStore, key: str, field: str, entries: list[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """The entries this process claimed (``LeaseStore.claim_results``): the run that superseded them and
    the sweepers of every node may find them at once, and a run with callbacks must be ended once. None
    when MongoDB does not answer (the sweeper writes them later)."""
    if not entries:
        return []
    try:
        got = store.claim_results(key, field, [str(e["t"]) for e in entries])
    except StoreUnavailable as exc:
        log.warning(
            "could not claim the results of %d run(s) of %r (the sweeper writes them): %s",
            len(entries),
            key,
            exc,
        )
        return []
    return [e for e in entries if str(e["t"]) in got]


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
    publish: EndingPublisher | None = None,
) -> None:
    """Write the results of runs that stayed parked past their deadline (``then``), then forget them;
    each gets a history record (``timeout``; ``fence``: the key's). ``publish``: as for
    ``write_superseded``."""
    done = []
    left = _left_to_a_worker_with_the_task(app, key, entries, "dl", publish)
    for entry in _claimed(store, key, "dead", [e for e in entries if e not in left]):
        here = _ends_here(store, key, entry) if entry.get("ks") else True
        if here is None:
            continue  # (claimed: looked at again once the claim lapses)
        if not here:
            done.append(entry["t"])  # ended from another of its keys
            continue
        at = entry.get("at")
        reason = _timeout_reason(at, entry.get("dl"))
        fail = entry.get("th") == "fail"
        named = named_key(key, entry.get("ks"))  # (a set's gate: its first key)
        if publish is not None and publish(key, entry, timeout_ending(named, reason, fail=fail)):
            pass  # ended by a worker from its message: its callbacks, chain and chord go on
        elif not has_backend(app):
            pass
        elif fail:
            app.backend.mark_as_failure(entry["t"], QueueTimeout(named, reason))
        else:
            app.backend.store_result(entry["t"], skipped_result(named, reason), "SUCCESS")
        record_ending(store, key, "timeout", entry, fence=fence, ended_at=entry.get("dl"), parked_at=at)
        log.info("%s on %r: %s", entry["t"], key, reason)
        done.append(entry["t"])
    if done:
        store.forget_results(key, "dead", done)


def _timeout_reason(at: object, deadline: object) -> str:
    """Why a parked run timed out, with its policy's ``timeout`` (its deadline less its parking time:
    ``Queue``'s or ``Replace``'s, the entry does not say which policy parked it)."""
    if not isinstance(at, _dt.datetime):
        return "parked past its policy's timeout"
    if not isinstance(deadline, _dt.datetime):
        return f"parked since {at.isoformat()}, past its policy's timeout"
    seconds = (deadline - at).total_seconds()
    return f"parked since {at.isoformat()}, past its policy's timeout={seconds:g}"


def _ends_here(store: LeaseStore, key: str, entry: Mapping[str, Any]) -> bool | None:
    """Whether the run of several keys ``entry``, timed out on ``key`` and claimed there, is ended from
    here (True), was ended from another of its keys (False: forget it here), or is left for now (None: the
    claim lapses and a later pass looks again), when MongoDB did not answer or another writer ends it.

    It never runs now: first its places and reservations on its other keys go (as a revoked run's do), so
    those keys go to the next run at once instead of idling until the reservation lapses. It is parked
    with one deadline on each key it did not get, so it may have timed out on another key too: exactly one
    writer ends it. Its entry in each other key's ``dead`` is claimed as well: got, it is forgotten there
    (ended from here); held by the writer of that key, the writer of the first of the two keys ends it,
    and the other keeps its entry (if that writer dies before its ending, its claim lapses and a later
    pass ends the run from either key; had the entry been forgotten here, the run would then be taken for
    ended on this key, and never ended: the lock-set checker's seed 60); gone and remembered there as over,
    that key's writer ended it already."""
    task_id = str(entry["t"])
    others = sorted({str(k) for k in entry.get("ks") or []} - {key})
    try:
        for other in others:
            store.sweep(other, revoked=[task_id])
        for other in others:
            claim = store.claim_one(other, "dead", task_id, run_id=str(entry.get("id")))
            if claim == "got":
                store.forget_results(other, "dead", [task_id])
            elif claim == "ended":
                return False  # (ended there already: its writer forgot it after ending it)
            elif claim == "held" and other < key:
                return None  # (its writer ends it; kept here until that is known: ``ended``)
    except StoreUnavailable as exc:
        log.warning("could not end %s on %r's other keys %s now (later): %s", task_id, key, others, exc)
        return None
    return True
