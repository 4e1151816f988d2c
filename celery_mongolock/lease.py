"""The public import path of the lease value objects (:mod:`celery_mongolock.core.lease`,
:mod:`celery_mongolock.core.lease_set`), for users' imports and settings that name this path."""

from celery_mongolock.core.lease import (
    Lease,
    LeaseBackend,
    LeaseInfo,
    LostCallback,
    SupersededCallback,
    local_ttl,
)
from celery_mongolock.core.lease_set import LeaseSet

__all__ = [
    "Lease",
    "LeaseBackend",
    "LeaseInfo",
    "LeaseSet",
    "LostCallback",
    "SupersededCallback",
    "local_ttl",
]
