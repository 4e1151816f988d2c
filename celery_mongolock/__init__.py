"""celery_mongolock: singleton Celery tasks per key, guarded by MongoDB leases.

``@singleton_task(key=...)`` declares a Celery task that runs at most once at a time per key. The lease
engine underneath (``LeaseStore``, ``Lease``) works without Celery.
"""

from __future__ import annotations

from . import events as _events  # noqa: F401  (lease events as Celery events under -E)
from .__about__ import __version__
from .exceptions import (
    ConfigurationError,
    InvalidKey,
    LeaseLost,
    LockContended,
    MongoLockError,
    QueueTimeout,
    StoreUnavailable,
    UntrustedMessage,
)
from .fencing import FencedOut, fenced_update_one
from .lease import LeaseSet
from .policies import Fail, Queue, Replace, Retry, Skip, Wait
from .store import Lease, LeaseInfo, LeaseStore
from .task import SingletonTask, current_lease, singleton_task

__all__ = [
    "ConfigurationError",
    "Fail",
    "FencedOut",
    "InvalidKey",
    "Lease",
    "LeaseInfo",
    "LeaseLost",
    "LeaseSet",
    "LeaseStore",
    "LockContended",
    "MongoLockError",
    "Queue",
    "QueueTimeout",
    "Replace",
    "Retry",
    "SingletonTask",
    "Skip",
    "StoreUnavailable",
    "UntrustedMessage",
    "Wait",
    "__version__",
    "current_lease",
    "fenced_update_one",
    "singleton_task",
]
