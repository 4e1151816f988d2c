"""Settings of the example Django site (only what a Celery worker needs; no views).

Service addresses come from the environment so the same site runs against the embedded server in the
tests and a real MongoDB and Redis in a deployment.
"""

from __future__ import annotations

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "insecure-example-key-change-me")
DEBUG = False
ALLOWED_HOSTS: list[str] = []
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "uploads",
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("SITE_SQLITE_PATH", str(BASE_DIR / "db.sqlite3")),
    }
}

# -- Celery (the CELERY_ namespace: see mysite/celery.py) -------------------------------------------------
CELERY_BROKER_URL = os.environ.get("SITE_BROKER_URL", "redis://localhost:6379/0")
CELERY_RESULT_BACKEND = CELERY_BROKER_URL
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1

# -- celery_mongolock ------------------------------------------------------------------------------------
CELERY_MONGOLOCK_URL = os.environ.get("SITE_MONGODB_URL", "mongodb://localhost:27017")
CELERY_MONGOLOCK_DATABASE = os.environ.get("SITE_MONGOLOCK_DATABASE", "mysite")
CELERY_MONGOLOCK_COLLECTION = "task_leases"
CELERY_MONGOLOCK_LEASE_SECONDS = 20
CELERY_MONGOLOCK_ON_CONTENTION = "retry"  # the default for every singleton task...
CELERY_MONGOLOCK_TASK_POLICIES = {
    # ...but an import started while another one runs for the same group is dropped, not queued:
    # the newer file will be imported by the next scheduled sync anyway.
    "uploads.tasks.import_members": {"on_contention": "skip", "lease_seconds": 15},
}
