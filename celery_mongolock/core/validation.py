"""Checks of the numbers and names a lease store is given: ``ConfigurationError`` saying which and why."""

from __future__ import annotations

import math

from celery_mongolock.exceptions import ConfigurationError

__all__ = [
    "DEFAULT_HISTORY_DAYS",
    "DEFAULT_LEASE_SECONDS",
    "MAX_HISTORY_DAYS",
    "MAX_LEASE_SECONDS",
    "MIN_LEASE_SECONDS",
    "validate_history_days",
    "validate_lease_timing",
    "validate_names",
    "validate_seconds",
]

DEFAULT_LEASE_SECONDS = 30.0
MIN_LEASE_SECONDS = 0.5
MAX_LEASE_SECONDS = 30 * 24 * 3600.0

#: Databases that would break the guarantees: ``local`` is not replicated (an acknowledged lease could be
#: lost in a failover), ``config`` belongs to sharded clusters.
_RESERVED_DATABASES = ("local", "config")


def validate_seconds(name: str, value: object, *, low: float, high: float) -> float:
    """``value`` as a float number of seconds from ``low`` to ``high``; ``ConfigurationError`` naming
    ``name`` if it is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(f"{name} must be a number of seconds, got {type(value).__name__}: {value!r}")
    seconds = float(value)
    if math.isnan(seconds) or not (low <= seconds <= high):
        raise ConfigurationError(f"{name} must be between {low:g} and {high:g} seconds, got {value!r}")
    return seconds


#: The longest history MongoDB's TTL index can keep (``expireAfterSeconds`` is a 32-bit int), in days.
MAX_HISTORY_DAYS = 24_855
DEFAULT_HISTORY_DAYS = 7


def validate_history_days(value: object, name: str = "history_days") -> float:
    """Days a lease history record is kept (0: no history collection); ``ConfigurationError`` naming
    ``name`` if ``value`` is not a number of days from 0 to ``MAX_HISTORY_DAYS``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(
            f"{name} must be a number of days (0 turns the history off), "
            f"got {type(value).__name__}: {value!r}"
        )
    days = float(value)
    if math.isnan(days) or not (0 <= days <= MAX_HISTORY_DAYS):
        raise ConfigurationError(
            f"{name} must be between 0 (no history) and {MAX_HISTORY_DAYS} days, got {value!r}"
        )
    if 0 < days * 86400 < 1:
        raise ConfigurationError(f"{name} must be 0 (no history) or at least one second, got {value!r}")
    return days


def validate_names(database: object, collection: object, *, prefix: str = "") -> tuple[str, str]:
    """Check a lease database and collection name as MongoDB and pymongo will; ``ConfigurationError`` if not.

    ``prefix`` is put before ``database``/``collection`` in messages (``"mongolock_"`` for the settings).
    """
    for name, value in (("database", database), ("collection", collection)):
        if (
            not isinstance(value, str)
            or not value
            or any(c in value for c in "$\x00")
            or value != value.strip()
        ):
            raise ConfigurationError(f"{prefix}{name} name {value!r} is not a valid MongoDB {name} name")
    assert isinstance(database, str)
    assert isinstance(collection, str)
    if any(c in database for c in '/\\. "'):
        raise ConfigurationError(
            f"{prefix}database name {database!r} must not contain / \\ . space or quotes"
        )
    if len(database.encode("utf-8")) > 63:
        raise ConfigurationError(f"{prefix}database name {database!r} is longer than MongoDB's 63 bytes")
    if database in _RESERVED_DATABASES:
        raise ConfigurationError(
            f"{prefix}database {database!r} cannot hold leases: 'local' is not replicated and 'config' is "
            "reserved for sharding"
        )
    if collection.startswith(".") or collection.endswith(".") or ".." in collection:
        raise ConfigurationError(
            f"{prefix}collection name {collection!r} must not start or end with '.' or contain '..'"
        )
    if collection.startswith("system."):
        raise ConfigurationError(f"{prefix}collection name {collection!r}: 'system.' names are reserved")
    if len(f"{database}.{collection}".encode()) > 255:
        raise ConfigurationError(f"{prefix}collection name {collection!r} is too long for MongoDB")
    return database, collection


def validate_lease_timing(
    lease_seconds: object, heartbeat_seconds: object | None, *, name: str = "lease_seconds"
) -> tuple[float, float]:
    """Check a lease length and heartbeat interval that must work together; return them as floats.

    The heartbeat must fit at least twice into the lease, so that one lost renewal is survived.
    ``name``: the lease length's name in the caller's API (``ttl`` for ``acquire`` and ``DocumentLock``).
    """
    ttl = validate_seconds(name, lease_seconds, low=MIN_LEASE_SECONDS, high=MAX_LEASE_SECONDS)
    if heartbeat_seconds is None:
        return ttl, ttl / 3.0
    beat = validate_seconds("heartbeat_seconds", heartbeat_seconds, low=0.05, high=MAX_LEASE_SECONDS)
    if beat > ttl / 2.0:
        raise ConfigurationError(
            f"heartbeat_seconds ({beat:g}) must be at most half of {name} ({ttl:g}) so that a "
            f"missed renewal does not lose the lease; use {ttl / 3.0:g} or less"
        )
    return ttl, beat


#: The largest ``limit=N``: every hold of a key lives in its one lease document.
MAX_LIMIT = 1000


def validate_limit(limit: object) -> int | None:
    """``limit=N``: None or 1 mean a single lease (returned as None); 2 to ``MAX_LIMIT`` are slots."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ConfigurationError(f"limit must be an int from 1 to {MAX_LIMIT}, got {limit!r}")
    return None if limit == 1 else limit
