"""Runs that end without their body, ended through Celery's trace: their callbacks run, their chain goes
on and their chord completes.

A parked run that a newer send supersedes (``Replace``), or that stays parked past its
``Queue(timeout=...)``, has had its message acknowledged long ago: nothing of Celery's is left to call its
``link`` / ``link_error`` callbacks, send the next task of its chain or count it into its chord. Its
result, written straight into the result backend, would leave a chain ``PENDING`` and a chord's callback
never called. So when such a run has callbacks or is in a chain or a chord, the writer (the sweeper, or
the run that superseded it) publishes the run's own stored message again with the ``mongolock_ended``
header (``handoff.publish_ending``); the worker that receives it does not take any key and does not run
the body: ``end_run`` returns the run's result (the superseded result, a timed-out run's skipped result)
or raises its error (``QueueTimeout``; ``Superseded`` with ``Replace(fail_superseded=True)``), and
Celery's trace does the rest, exactly as for a run that returned or raised.

A run with none of these gets its result written directly, as before (no message, no worker needed).

Exactly once: the ending message is published before the run's record is forgotten (a crash in between
publishes it again), and a delivery of it whose run has a final state already is dropped (``Ignore``:
its callbacks were called by the first).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from celery import Celery, states
from celery.exceptions import Ignore

from celery_mongolock.exceptions import QueueTimeout, Superseded
from celery_mongolock.integration import config, results
from celery_mongolock.integration.handoff import ENDED_HEADER, publish_through_lane, transient_headers_dropped
from celery_mongolock.integration.trust import RefusedEntry, check_entry

__all__ = [
    "ENDED_HEADER",
    "end_run",
    "ending_of",
    "ending_publisher",
    "in_canvas",
    "publish_ending",
    "publish_own_ending",
]

log = logging.getLogger("celery_mongolock.queue")

#: The signature options that need Celery's trace when the run ends.
_CANVAS_OPTIONS = ("link", "link_error", "chain", "chord")


def in_canvas(options: Mapping[str, Any]) -> bool:
    """A run with these signature options has callbacks, or is in a chain or a chord."""
    return any(options.get(name) for name in _CANVAS_OPTIONS)


def ending_of(request: Any) -> Mapping[str, Any] | None:
    """The ending a delivered message carries, or None (a run to admit as any other)."""
    headers = getattr(request, "headers", None) or {}
    ending = headers.get(ENDED_HEADER) or getattr(request, ENDED_HEADER, None)
    if isinstance(ending, Mapping) and ending.get("how") in ("superseded", "timeout"):
        return ending
    return None


def end_run(task: Any, ending: Mapping[str, Any], *, fail_superseded: bool) -> Any:
    """In the worker, for a message with an ending: the run's result, or its error raised (Celery's trace
    stores it and calls the run's callbacks). A delivery whose run has a final state already is dropped."""
    request = task.request
    key = str(ending.get("k"))
    state = results.state_of(task.app, request.id)
    # (A holder terminated after its grace wrote its result before it went: its ending comes after.)
    written_first = bool(ending.get("terminated")) and state in (states.SUCCESS, states.FAILURE)
    if state in states.READY_STATES and not written_first:
        log.info(
            "%s[%s]: its ending on %r was delivered again (it is %s); dropped",
            task.name,
            request.id,
            key,
            state,
        )
        raise Ignore()
    if ending.get("how") == "superseded":
        by = str(ending.get("by"))
        if fail_superseded:
            raise Superseded(key, None, by, held=False)
        keys = ending.get("ks")
        return results.superseded_result(key, by, list(keys) if isinstance(keys, list) else None)
    reason = str(ending.get("reason"))
    if ending.get("fail"):
        raise QueueTimeout(key, reason)
    return results.skipped_result(key, reason)


def publish_ending(
    app: Celery, key: str, entry: Mapping[str, Any], ending: Mapping[str, Any], *, here: bool = True
) -> bool:
    """For a run that ends without its body (superseded, timed out while parked) and has callbacks or is
    in a chain or a chord: publish its own message with the ending header (``endings``), so that a
    worker ends it through Celery's trace, which calls its callbacks and completes its chord. False (the
    caller writes its result itself) for a run with none of these, or whose message is not stored or not
    trusted (``trust``). ``here=False``: another key publishes it (True, nothing published)."""
    if not entry.get("m"):
        return False
    try:
        signature = check_entry(app, key, entry, config.get_settings(app).signing_key)
    except RefusedEntry as exc:
        log.warning(
            "%s on %r: its stored message is not used (%s); its result is written", entry.get("t"), key, exc
        )
        return False
    if not in_canvas(signature.options):
        return False
    if not here:
        return True
    headers = transient_headers_dropped(signature.options.get("headers"))
    headers[ENDED_HEADER] = dict(ending)
    publish_through_lane(app, signature, headers, ENDED_HEADER, lane=True)
    log.info(
        "%s[%s] on %r ends %s without its body: its message is published again to end it through Celery, "
        "which calls its callbacks and completes its chain or chord",
        entry.get("n"),
        entry.get("t"),
        key,
        ending.get("how"),
    )
    return True


def ending_publisher(app: Celery) -> Callable[[str, Mapping[str, Any], Mapping[str, Any]], bool]:
    """``publish_ending`` for ``app``, as ``results.write_superseded`` and ``write_timed_out`` take it.
    A superseded run of several keys is in ``sup`` on each of them: only its first key ends it (the others
    leave its result to it). A timed-out one is ended by the key it timed out on, which need not be its
    first (reserved there, it never times out there); its writer elects one key (``results._ends_here``)."""

    def publish(key: str, entry: Mapping[str, Any], ending: Mapping[str, Any]) -> bool:
        keys = entry.get("ks")
        first = not (keys and isinstance(keys, list) and str(keys[0]) != key)
        return publish_ending(app, key, entry, ending, here=first or ending.get("how") != "superseded")

    return publish


def publish_own_ending(task: Any, request: Any, ending: Mapping[str, Any]) -> bool:
    """In a run's own process (a holder that ``Replace(cancel_running=True, grace=...)`` terminates after
    writing its result): publish its message with the ending header if it has callbacks or is in a chain
    or a chord, so that a worker calls them; ``request``: the run's (taken in its body's thread). False
    when there is nothing to call."""
    if not in_canvas(request.as_execution_options()):
        return False
    headers = transient_headers_dropped(getattr(request, "headers", None))
    headers[ENDED_HEADER] = {**ending, "terminated": True}
    publish_through_lane(task.app, task.signature_from_request(request), headers, ENDED_HEADER, lane=True)
    return True
