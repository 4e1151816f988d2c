"""The site's Celery app: every ``CELERY_*`` Django setting configures it, ``CELERY_MONGOLOCK_*`` too.

Run a worker from this directory: ``celery -A mysite worker``.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mysite.settings")

app = Celery("mysite")
# CELERY_BROKER_URL -> broker_url, CELERY_MONGOLOCK_URL -> mongolock_url, and so on.
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()  # uploads/tasks.py
