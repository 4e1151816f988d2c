"""Admission of one run over its key set, whatever its shape (one key, ``limit=N`` slots, several keys
with a limit per key): a queued run (``Queue``, ``Replace``) in a worker goes to ``queued_run.QueuedRun``,
which may park it; every other run (``Retry``, ``Skip``, ``Wait``, ``Fail``, a direct call, a beat tick of
a task of one key) to ``plain_run.PlainRun``. Both return the leases of every key of the set, in sorted
order, or the policy's outcome; the policies never see the shape."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from celery_mongolock.integration.plain_run import PlainRun, parks
from celery_mongolock.integration.queued_run import QueuedRun

if TYPE_CHECKING:
    from celery_mongolock.admission.contention import Outcome
    from celery_mongolock.core.store import Lease
    from celery_mongolock.integration.config import TaskOptions
    from celery_mongolock.integration.runs import GuardedRun

__all__ = ["take_keys"]


def take_keys(
    task: GuardedRun,
    keys: list[str],
    options: TaskOptions,
    *,
    direct: bool,
    limits: Mapping[str, int | None] | None = None,
    one: bool,
) -> list[Lease] | Outcome:
    """The leases of every key of ``keys`` (sorted, without repeats) for this run of ``task``, or its
    policy's outcome (or raises: ``Ignore`` for a run parked or a copy dropped, the policy's error, a
    contention retry). ``limits``: each key's limit (None: a single lease); ``options.limit`` for a key
    not in it. ``one``: a task of one ``key=``; else a task of ``keys=(...)``, whose run is a set of keys
    whatever their number (a set that renders to one key, or of which the run holds all but one already,
    keeps its set's signature, its handoff token and its results naming its keys)."""
    if parks(task, options.on_contention, direct, one=one):
        return QueuedRun(task, keys, options, limits=limits, one=one).take()
    return PlainRun(task, keys, options, direct=direct, limits=limits, one=one).take()
