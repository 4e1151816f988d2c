"""A queued run's place among the runs parked on its key: its message's priority (Celery's ``priority``
option, or the task's or app's default), as its broker orders priorities.

The engine keeps every key's queue in one order: rank first (lower first), then send order
(``core.documents.entries.entry_ahead``). The rank is the priority turned so that the run the broker
itself would deliver first is first on its key too: RabbitMQ (and kombu's other transports) deliver a
higher priority first, Redis a lower one (kombu pops priority 0 first, and a message without a priority
counts as 0). A run without a priority has rank 0: on RabbitMQ behind every run with one, on Redis with
the first. ``Queue`` runs only: a ``Replace`` run's newer send wins whatever the priorities.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

from celery import Celery

from celery_mongolock.admission.policies import Replace

__all__ = ["PRIORITY_FIELD", "lower_first", "rank", "rank_field"]

#: The field of a parked entry that carries its rank (absent for 0).
PRIORITY_FIELD = "pr"
#: Priorities the brokers take (RabbitMQ up to 255; kombu's Redis transport 0 to 9).
_HIGHEST = 255

#: Per app: its broker URL when last looked at, and whether that broker delivers a lower number first.
_lower_first: weakref.WeakKeyDictionary[Celery, tuple[object, bool]] = weakref.WeakKeyDictionary()


def lower_first(app: Celery) -> bool:
    """Whether ``app``'s broker delivers a lower priority number first (Redis): looked up again only when
    the app's broker URL changed."""
    url = app.conf.broker_write_url or app.conf.broker_url
    known = _lower_first.get(app)
    if known is not None and known[0] == url:
        return known[1]
    try:
        driver = str(app.connection_for_write().transport.driver_type)
    except Exception:  # an unknown transport: Celery itself says so when it connects
        driver = ""
    answer = driver == "redis"
    _lower_first[app] = (url, answer)
    return answer


def rank(app: Celery, request: Any) -> int:
    """The rank of the run ``request`` is for: its message priority (0 to 255; none: 0), negated when
    ``app``'s broker delivers a higher priority first."""
    delivery = getattr(request, "delivery_info", None) or {}
    priority = delivery.get("priority") if isinstance(delivery, Mapping) else None
    if priority is None or isinstance(priority, bool):
        return 0
    try:
        value = max(0, min(int(priority), _HIGHEST))
    except (TypeError, ValueError):
        return 0
    return value if lower_first(app) else -value


def rank_field(app: Celery, request: Any, policy: object) -> dict[str, int]:
    """The entry field for the run's rank: ``{"pr": rank}``, or nothing for rank 0 (most runs) and for a
    ``Replace`` run (the newest send wins, whatever its priority: at most one run waits per key, or per
    set of keys)."""
    if isinstance(policy, Replace):
        return {}
    value = rank(app, request)
    return {PRIORITY_FIELD: value} if value else {}
