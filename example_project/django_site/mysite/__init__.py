"""A minimal Django site whose Celery tasks are guarded by celery_mongolock leases.

Loading the Celery app here makes ``@singleton_task`` (shared_task style) bind to it when Django starts.
"""

from __future__ import annotations

from .celery import app as celery_app

__all__ = ["celery_app"]
