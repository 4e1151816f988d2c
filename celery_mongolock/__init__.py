"""celery_mongolock: singleton Celery tasks per key, guarded by MongoDB leases.

The lease engine (``LeaseStore``, ``Lease``) works without Celery; the Celery integration builds on it.
"""

from __future__ import annotations

from .exceptions import (
    ConfigurationError,
    InvalidKey,
    LeaseLost,
    LockContended,
    MongoLockError,
    StoreUnavailable,
)
from .store import Lease, LeaseInfo, LeaseStore

__version__ = "0.1.0.dev0"

__all__ = [
    "ConfigurationError",
    "InvalidKey",
    "Lease",
    "LeaseInfo",
    "LeaseLost",
    "LeaseStore",
    "LockContended",
    "MongoLockError",
    "StoreUnavailable",
    "__version__",
]
