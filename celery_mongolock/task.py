"""The public import path of :mod:`celery_mongolock.integration.task`.

Everything that module exports, for users' imports and settings that name this path.
"""

from celery_mongolock.integration.task import *  # noqa: F403
from celery_mongolock.integration.task import __all__  # noqa: F401  (re-exported)
