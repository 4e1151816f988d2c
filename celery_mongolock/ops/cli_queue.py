"""``celery mongolock queue KEY``, ``drop KEY TASK_ID...`` and ``purge KEY``: a key's parked runs, page by
page, and dropping some or all of them (an operator's revoke, through this library).

A dropped run leaves the key's queue (and every key of a several-keys run) in one sweep command per key:
if the key was handed to it, the key goes on to the next run. Its result becomes ``REVOKED`` with a reason
naming the key, its history records ``revoked``, and Celery is told to revoke its task id (workers discard
any copy of its message still in flight). Nothing is dropped without a line saying so.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from celery import Celery

from celery_mongolock.core.lease import LeaseInfo
from celery_mongolock.core.store import LeaseStore
from celery_mongolock.core.store_spill import DROP_BATCH
from celery_mongolock.integration.handoff import install_publisher
from celery_mongolock.integration.results import has_backend

__all__ = ["drop_runs", "not_parked", "other_kind_lines", "page_of", "pages", "queue_lines"]


def page_of(info: LeaseInfo, page: int, per_page: int) -> list[dict[str, Any]]:
    """The parked runs of page ``page`` (1: the next ones to run) of ``info``, read with
    ``inspect(key, parked_from=(page - 1) * per_page, parked_limit=per_page)`` (only that page is read)
    or with all its parked runs."""
    start = (page - 1) * per_page
    runs = info.parked
    offset = int(runs[0]["position"]) - 1 if runs else 0  # the position of the first run read
    return list(runs[start - offset : start - offset + per_page]) if start >= offset else []


def pages(total: int, per_page: int) -> int:
    """How many pages ``total`` parked runs fill (1 for none: an empty page 1)."""
    return max(1, -(-total // per_page))


def queue_lines(info: LeaseInfo, page: int, per_page: int) -> list[str]:
    """``queue KEY``: how many runs wait, then one line per run of the page (one that exists: the
    command refuses a page past the last), next first."""
    total = info.parked_total
    pages_in_all = pages(total, per_page)
    rows = page_of(info, page, per_page)
    head = f"{info.key}: {total} run(s) parked" + (
        f", page {page} of {pages_in_all}" if total > per_page else ""
    )
    if info.handoff:
        head += f"; handed to {info.handoff.get('task_name')}[{info.handoff.get('task_id')}]"
    lines = [head]
    for run in rows:
        waited = run.get("parked_for")
        keys = f"  keys {', '.join(run['keys'])}" if run.get("keys") else ""
        # (the rank is the priority, negated on brokers that serve a higher one first)
        sent_with = f"  priority {abs(run['rank'])}" if run.get("rank") else ""
        lines.append(
            f"  {run['position']:>4}. {run.get('task_name')}[{run.get('task_id')}]  parked "
            f"{'?' if waited is None else f'{waited:.1f} s'} ago{sent_with}{keys}"
        )
    return lines + other_kind_lines(info)


def other_kind_lines(info: LeaseInfo) -> list[str]:
    """The runs waiting to take the key as the other kind (``LeaseInfo.other_kind``): not parked, so not
    in the queue's order nor counted in it; each comes back within a few seconds until the key is free
    of the kind it is held as."""
    if not info.other_kind:
        return []
    lines = [
        f"  and {len(info.other_kind)} run(s) not parked: each waits to take the key as the other kind, "
        "back within 5 s each time until the key is free of the kind it is used as"
    ]
    for wait in info.other_kind:
        wants = {"single": "a single lease", "slots": "a slot"}.get(str(wait.get("wants")), "?")
        waited, back = float(wait.get("waiting_for") or 0), float(wait.get("back_ago") or 0)
        lines.append(
            f"        {wait.get('task_name')}[{wait.get('task_id')}]  waits to take it as {wants} for "
            f"{waited:.1f} s, last back {back:.1f} s ago"
        )
    return lines


def not_parked(info: LeaseInfo, task_ids: Sequence[str]) -> str:
    """Why ``task_ids`` cannot be dropped from ``info.key`` (the ids not parked there), or ``""``."""
    parked = {str(run.get("task_id")) for run in info.parked}
    missing = [tid for tid in task_ids if tid not in parked]
    if not missing:
        return ""
    return (
        f"not parked on {info.key!r}: {', '.join(missing)} (see: celery mongolock queue {info.key}); "
        "nothing dropped"
    )


def drop_runs(
    app: Celery, store: LeaseStore, info: LeaseInfo, task_ids: Sequence[str], *, batch: int = DROP_BATCH
) -> Iterator[list[str]]:
    """Drop the parked runs ``task_ids`` from ``info.key`` (and the other keys of a several-keys run):
    their results ``REVOKED``, their history ``revoked``, their task ids revoked in Celery. ``batch`` runs
    at a time (the spill's own batch, ``store_spill.DROP_BATCH``: a few commands a round, whatever the
    queue's depth), each round's lines (one per run) yielded once its runs are out: when MongoDB stops
    answering, the lines already yielded say what was dropped. ``ValueError`` naming the ids that are not
    parked on the key (before anything is dropped)."""
    parked = {str(run.get("task_id")): run for run in info.parked}
    missing = not_parked(info, task_ids)
    if missing:
        raise ValueError(missing)
    install_publisher(app, store)  # (a key handed to a dropped run goes on to the next one, published)
    for start in range(0, len(task_ids), batch):
        yield _drop_batch(app, store, info.key, {tid: parked[tid] for tid in task_ids[start : start + batch]})


def _drop_batch(app: Celery, store: LeaseStore, key: str, runs: dict[str, dict[str, Any]]) -> list[str]:
    """One round of ``drop_runs``: the runs ``runs`` (task id: its ``parked`` view) out of ``key``."""
    ids = list(runs)
    keys = {key}
    for run in runs.values():
        keys.update(run.get("keys") or ())
    store.spill.drop(key, ids)  # (those spilled beyond the window: ``documents.spill``)
    for each in sorted(keys):
        after = store.sweep(each, revoked=set(ids))
        fence = None if after is None else after.fence
        for tid, run in runs.items():
            store.record_run_ending(each, "revoked", {"t": tid, "n": run.get("task_name")}, fence=fence)
    reason = f"dropped from the queue of {key!r} by celery mongolock"
    if has_backend(app):
        for tid in ids:
            app.backend.mark_as_revoked(tid, reason)
    told = _revoke(app, ids)
    store.flush_history(timeout=5.0)
    return [f"dropped {run.get('task_name')}[{tid}] from {key!r}: REVOKED{told}" for tid, run in runs.items()]


def _revoke(app: Celery, task_ids: Sequence[str]) -> str:
    """Tell the workers to revoke ``task_ids`` (one broadcast): empty, or why it could not be told."""
    try:
        with app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=2)
            app.control.revoke(list(task_ids), connection=connection)
    except Exception as exc:  # the broker is away: the runs are out of the queue all the same
        return (
            f" (the workers were not told to revoke it: {type(exc).__name__}; a copy in flight may still run)"
        )
    return ""
