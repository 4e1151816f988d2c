"""Which command one acquire sends (pure, no I/O): the update pipeline and the reply's projection for a
single lease or a ``limit=N`` slot, plain or a queued run's admit (``acquire_command``). The pipelines
themselves are built in ``documents``; ``store_acquire`` sends them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from celery_mongolock.core.documents import base as documents
from celery_mongolock.core.documents import queue as admission_docs
from celery_mongolock.core.documents import slot_admit
from celery_mongolock.core.documents import slots as slots_docs
from celery_mongolock.core.documents.base import Document

__all__ = ["acquire_command"]


def acquire_command(
    token: str,
    ttl_ms: int,
    holder: Document,
    *,
    limit: int | None,
    admission: Mapping[str, Any] | None,
    hold_ms: int,
    tick: int | None,
    hold_until_ms: int | None,
    waited_ms: int | None,
    waited_since_ms: int | None,
    ended_runs: Sequence[str],
) -> tuple[list[Document], Document | None]:
    """The update pipeline and projection of one acquire: single lease or ``limit=N`` slot, plain or
    a queued run's admission."""
    if limit is not None and admission is not None:
        pipeline = slot_admit.slot_admit_pipeline(
            token, ttl_ms, holder, limit, waited_ms=waited_ms, min_hold_ms=hold_ms, **admission
        )
        return pipeline, admission_docs.SLOT_ADMIT_PROJECTION
    if limit is not None:
        if waited_since_ms is not None and waited_ms is None:
            waited_ms = max(0, int(time.time() * 1000) - waited_since_ms)
        # (A beat tick's hold_until_ms, the end of its window, is for single leases: a slot is held
        # while its run runs, and at least ``hold_ms`` from when it is taken.)
        pipeline = slots_docs.slot_acquire_pipeline(
            token,
            ttl_ms,
            holder,
            limit,
            waited_ms=waited_ms,
            tick=tick,
            ended_runs=ended_runs,
            min_hold_ms=hold_ms,
        )
        # With ``ends`` (at most 8): the endings of holds this acquire found expired go to the history.
        # A guarded acquire's reply also carries ``seen`` (``outcomes.Contended.attempt_ran``): a refused
        # copy or contention retry is judged on it, with no read added.
        return pipeline, ({"q.m": 0} if ended_runs else {"q.m": 0, "seen": 0})
    if admission is None:
        pipeline = documents.acquire_pipeline(
            token,
            ttl_ms,
            holder=holder,
            tick=tick,
            min_hold_ms=hold_ms,
            hold_until_ms=hold_until_ms,
            waited_ms=waited_ms,
            waited_since_ms=waited_since_ms,
            ended_runs=ended_runs,
        )
        return pipeline, documents.ACQUIRE_PROJECTION
    fields = documents.acquire_fields(
        token,
        ttl_ms,
        holder,
        min_hold_ms=hold_ms,
        hold_until_ms=hold_until_ms,
        waited_ms=waited_ms,
        waited_since_ms=waited_since_ms,
    )
    return admission_docs.admit_pipeline(fields, token=token, **admission), admission_docs.ADMIT_PROJECTION
