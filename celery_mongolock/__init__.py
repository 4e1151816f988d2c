"""celery_mongolock: singleton Celery tasks per key, guarded by MongoDB leases.

``@singleton_task(key=...)`` declares a Celery task that runs at most once at a time per key. The lease
engine underneath (``LeaseStore``, ``Lease``) works without Celery.
"""

from __future__ import annotations

from celery_mongolock.__about__ import __version__
from celery_mongolock.admission.policies import Fail, Queue, Replace, Retry, Skip, Wait
from celery_mongolock.admission.rate import RateLimit, Throttle
from celery_mongolock.core.document_lock import DocumentLease, DocumentLock, DocumentWrite
from celery_mongolock.core.fencing import FencedOut, fenced_update_one
from celery_mongolock.core.lease_set import LeaseSet
from celery_mongolock.core.reentry import ReentrantHold
from celery_mongolock.core.store import Lease, LeaseInfo, LeaseStore
from celery_mongolock.exceptions import (
    ArgumentsNotComparable,
    ConfigurationError,
    DocumentLockLost,
    DocumentMissing,
    DocumentWriteUnknown,
    InvalidKey,
    LeaseLost,
    LockContended,
    MessageTooLarge,
    MongoLockError,
    QueueTimeout,
    StoreUnavailable,
    Superseded,
    UntrustedMessage,
)
from celery_mongolock.integration.superseded import SupersededResult, is_superseded
from celery_mongolock.integration.task import SingletonTask, current_lease, singleton_task
from celery_mongolock.ops import events as _events  # noqa: F401  (lease events as Celery events under -E)

__all__ = [
    "ArgumentsNotComparable",
    "ConfigurationError",
    "DocumentLease",
    "DocumentLock",
    "DocumentLockLost",
    "DocumentMissing",
    "DocumentWrite",
    "DocumentWriteUnknown",
    "Fail",
    "FencedOut",
    "InvalidKey",
    "Lease",
    "LeaseInfo",
    "LeaseLost",
    "LeaseSet",
    "LeaseStore",
    "LockContended",
    "MessageTooLarge",
    "MongoLockError",
    "Queue",
    "QueueTimeout",
    "RateLimit",
    "ReentrantHold",
    "Replace",
    "Retry",
    "SingletonTask",
    "Skip",
    "StoreUnavailable",
    "Superseded",
    "SupersededResult",
    "Throttle",
    "UntrustedMessage",
    "Wait",
    "__version__",
    "current_lease",
    "fenced_update_one",
    "is_superseded",
    "singleton_task",
]
