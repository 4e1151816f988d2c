"""Rate-limited tasks of the integration app (``RateLimit``, ``Throttle``), imported by its workers
(``app.conf.imports``). Each body records its start on the **server's** clock (``$$NOW``), so that a test
judges the rate on the clock the windows are kept on."""

from __future__ import annotations

import os
from typing import Any

from celery_mongolock import Queue, RateLimit, Replace, Skip, Throttle, Wait, singleton_task

from .integration_app import app, db

#: The rate of the tests: 2 starts per 2 s.
N, PERIOD = 2, 2.0
#: The window of the tasks that drop runs over the rate: long enough that a burst always meets it full.
SKIP_PERIOD = 60.0


def _started(tag: str, key: str, *keys: str) -> str:
    """Record this body's start (``at``, server clock) and what the library's windows of ``key`` and
    ``keys`` held when it began (``grants``: each window's starts, as recorded in the command that granted
    them). A test judges the rate on the grants: a body's own record comes a reply, a signal and a round
    trip after its grant, later by a varying amount on a busy machine."""
    from celery import current_task

    from celery_mongolock.config import get_store
    from celery_mongolock.core.store_rate import rate_windows

    # Whether the rate parked this run before it started (its copies carry the count of its waits).
    parked = bool(((current_task.request.headers or {}) if current_task else {}).get("mongolock_rate_parks"))
    windows = rate_windows(get_store(app)).plain_collection
    grants = [{"k": k, "s": (windows.find_one({"_id": k}) or {}).get("s", [])} for k in sorted({key, *keys})]
    db()["rate_starts"].update_one(
        {"_id": tag},
        [{"$set": {"at": "$$NOW", "key": key, "pid": os.getpid(), "parked": parked, "grants": grants}}],
        upsert=True,
    )
    return tag


# Wait(): a run that finds the key held for a moment (another run's short body, or a copy checking its
# turn) waits for it rather than going round the broker; the rate decides the order.
@singleton_task(
    key="rated:{name}", rate=RateLimit(N, PERIOD), on_contention=Wait(), app=app, name="rate.limited"
)
def limited(name: str, tag: str) -> str:
    return _started(tag, f"rated:{name}")


@singleton_task(
    key="rated:{name}",
    rate=RateLimit(N, SKIP_PERIOD, then=Skip()),
    on_contention=Wait(),
    app=app,
    name="rate.skipping",
)
def skipping(name: str, tag: str) -> str:
    return _started(tag, f"rated:{name}")


@singleton_task(
    key="throttled:{name}", rate=Throttle(PERIOD), on_contention=Wait(), app=app, name="rate.throttled"
)
def throttled(name: str, tag: str) -> str:
    return _started(tag, f"throttled:{name}")


@singleton_task(
    key="throttled:{name}",
    rate=Throttle(SKIP_PERIOD, then=Skip()),
    on_contention=Wait(),
    app=app,
    name="rate.throttled_skip",
)
def throttled_skip(name: str, tag: str) -> str:
    return _started(tag, f"throttled:{name}")


#: The period of ``latest_throttled``: long enough that no parked run's turn comes while a test sends.
THROTTLE_PERIOD = 6.0


@singleton_task(
    key="rated:{name}", rate=Throttle(THROTTLE_PERIOD), on_contention=Replace(), app=app, name="rate.latest_t"
)
def latest_throttled(name: str, tag: str) -> str:
    """``Replace()`` with ``Throttle``: a search-index rebuild that must not run more than once a period."""
    return _started(tag, f"rated:{name}")


@singleton_task(
    keys=("tenant:{tenant}", "group:{group}"),
    rate=RateLimit(N, PERIOD),
    on_contention=Wait(),
    app=app,
    name="rate.pair",
)
def pair(tenant: str, group: str, tag: str) -> str:
    return _started(tag, f"tenant:{tenant}", f"group:{group}")


@singleton_task(
    key="slots:{name}", limit=2, rate=RateLimit(N, PERIOD), on_contention=Wait(), app=app, name="rate.slots"
)
def slots(name: str, tag: str) -> str:
    return _started(tag, f"slots:{name}")


# Queue()/Replace() with a rate: a run waits its turn on the key (parked, handed the key in send order),
# then its turn in the key's window.
@singleton_task(
    key="rated:{name}", rate=RateLimit(N, PERIOD), on_contention=Queue(), app=app, name="rate.queued"
)
def queued(name: str, tag: str, gate: bool = False) -> str:
    _started(tag, f"rated:{name}")
    _hold(tag, gate)
    return tag


@singleton_task(
    key="rated:{name}", rate=RateLimit(N, PERIOD), on_contention=Replace(), app=app, name="rate.latest"
)
def latest(name: str, tag: str, gate: bool = False) -> str:
    _started(tag, f"rated:{name}")
    _hold(tag, gate)
    return tag


@singleton_task(
    keys=("tenant:{tenant}", "group:{group}"),
    rate=RateLimit(N, PERIOD),
    on_contention=Queue(),
    app=app,
    name="rate.pair_queued",
)
def pair_queued(tenant: str, group: str, tag: str) -> str:
    return _started(tag, f"tenant:{tenant}", f"group:{group}")


@singleton_task(
    key="slots:{name}",
    limit=2,
    rate=RateLimit(N, PERIOD),
    on_contention=Queue(),
    app=app,
    name="rate.slots_queued",
)
def slots_queued(name: str, tag: str) -> str:
    return _started(tag, f"slots:{name}")


def _hold(tag: str, gate: bool) -> None:
    """With ``gate``: keep the key until the test opens the gate (a document ``gates/<tag>``), so that the
    runs sent meanwhile park on the key first."""
    import time

    deadline = time.monotonic() + 120
    while gate and db()["gates"].find_one({"_id": tag}) is None and time.monotonic() < deadline:
        time.sleep(0.01)


def starts(tags: list[str]) -> dict[str, Any]:
    """tag -> its recorded start (server clock)."""
    return {doc["_id"]: doc for doc in db()["rate_starts"].find({"_id": {"$in": tags}})}
