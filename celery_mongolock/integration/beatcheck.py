"""Runs sent by a beat, and beats that do not run our scheduler.

Our scheduler (``celery_mongolock.beat:Scheduler``) stamps each tick on the message (``BEAT_HEADER``), so
that a tick runs once however many beats send it (``beat_tick``). A beat that runs another scheduler sends
every tick itself: the worker says so once per process (``warn_if_sent_by_another_beat``), and the beat
says so at its start (``check_beat_scheduler``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from celery_mongolock.integration.headers import BEAT_HEADER

__all__ = [
    "CELERY_BEAT_HEADER",
    "OUR_SCHEDULER",
    "beat_tick",
    "check_beat_scheduler",
    "is_our_scheduler",
    "names_our_scheduler",
    "recorded_tick",
    "warn_if_sent_by_another_beat",
]

log_acquire = logging.getLogger("celery_mongolock.acquire")

OUR_SCHEDULER = "celery_mongolock.beat:Scheduler"  # the path users write (the public shim's)
#: Every spelling of our scheduler's path: the public one and the class's own module, ":" or ".".
_OUR_SCHEDULER_PATHS = frozenset(
    f"{module}{sep}Scheduler"
    for module in ("celery_mongolock.beat", "celery_mongolock.ops.beat")
    for sep in ":."
)
#: Celery's own beat stamps this header on everything it sends (Celery 5.5 and later).
CELERY_BEAT_HEADER = "celery_beat_task"
_warned_beat_in_pid: int | None = None


def beat_tick(request: Any) -> tuple[int | None, int | None]:
    """The nominal tick (epoch ms) and the end of its window, from the header our beat scheduler adds."""
    stamp = (request.headers or {}).get(BEAT_HEADER) if request is not None else None
    if not isinstance(stamp, dict):
        return None, None
    try:
        tick = int(stamp["tick"])
        window_ms = int(float(stamp.get("window") or 0) * 1000)
    except (KeyError, TypeError, ValueError):
        return None, None
    guard_ms = min(1000, window_ms // 10)  # free the key a little before the next tick is due
    return tick, tick + max(0, window_ms - guard_ms)


def recorded_tick(request: Any, one: bool) -> tuple[int | None, int | None]:
    """The beat tick a run records on its key, and the end of its window: a tick of a task of one key
    (``beat_tick``); ``(None, None)`` for a task of ``keys=(...)``, whose keys record no tick (two
    schedule entries whose key sets overlap would refuse each other's ticks; such a task relies on our
    beat's claim of each tick, ``ops.beat``)."""
    return beat_tick(request) if one else (None, None)


def is_our_scheduler(scheduler: Any) -> bool:
    cls = scheduler if isinstance(scheduler, type) else type(scheduler)
    return any(f"{c.__module__}:{c.__qualname__}" in _OUR_SCHEDULER_PATHS for c in cls.__mro__)


def names_our_scheduler(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip() in _OUR_SCHEDULER_PATHS
    return isinstance(value, type) and is_our_scheduler(value)


def _scheduler_name(scheduler: Any) -> str:
    return f"{type(scheduler).__module__}:{type(scheduler).__qualname__}"


def warn_if_sent_by_another_beat(task_name: str, request: Any) -> None:
    """A run that Celery's beat sent without our tick header: the beat does not run our scheduler, so
    several beats each send every tick and a tick is not refused a second run. Said once per process."""
    global _warned_beat_in_pid
    headers = getattr(request, "headers", None) or {}
    if not headers.get(CELERY_BEAT_HEADER) or _warned_beat_in_pid == os.getpid():
        return
    _warned_beat_in_pid = os.getpid()
    log_acquire.warning(
        "celery_mongolock: %s[%s] was sent by a celery beat that does not run %s (no tick header): "
        "with two such beats every tick is sent twice, and a second run of one tick is not refused. Set "
        "beat_scheduler = %r where the app is created (a setting made in a tasks module comes too late "
        "for `celery beat`), or start every beat with -S %s. (Said once per worker process.)",
        task_name,
        getattr(request, "id", None),
        OUR_SCHEDULER,
        OUR_SCHEDULER,
        OUR_SCHEDULER,
    )


def check_beat_scheduler(sender: Any, is_singleton: Callable[[Any], bool]) -> None:
    """At ``celery beat``'s start (``beat_init``): warn when it does not run our scheduler although
    ``beat_scheduler`` names it now (set after the beat chose its scheduler: in a tasks module), and say
    at INFO which singleton tasks of its schedule (``is_singleton``) get no once-per-tick guarantee from it
    otherwise."""
    scheduler = getattr(sender, "scheduler", None)
    app = getattr(sender, "app", None)
    if scheduler is None or app is None or is_our_scheduler(scheduler):
        return
    running = _scheduler_name(scheduler)
    if names_our_scheduler(app.conf.get("beat_scheduler")):
        log_acquire.warning(
            "celery_mongolock: this beat runs %s, not %s, although beat_scheduler names it: the setting was "
            "made after `celery beat` chose its scheduler (in a module imported later, such as a tasks "
            "module). Every beat started like this sends every tick itself (with two, each tick is sent "
            "twice). Set beat_scheduler where the app is created, or start the beat with -S %s.",
            running,
            OUR_SCHEDULER,
            OUR_SCHEDULER,
        )
        return
    schedule = getattr(scheduler, "schedule", None) or {}
    singletons = sorted(
        {
            entry.task
            for entry in schedule.values()
            if is_singleton(app.tasks.get(getattr(entry, "task", None)))
        }
    )
    if singletons:
        log_acquire.info(
            "celery_mongolock: this beat runs %s, not %s: the singleton task(s) %s of its schedule are sent "
            "by every beat started like this (run one, or use -S %s for several)",
            running,
            OUR_SCHEDULER,
            ", ".join(singletons),
            OUR_SCHEDULER,
        )
