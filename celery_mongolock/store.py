"""The public import path of :mod:`celery_mongolock.core.store`.

Everything that module exports, for users' imports and settings that name this path.
"""

from celery_mongolock.core.store import *  # noqa: F403
from celery_mongolock.core.store import __all__  # noqa: F401  (re-exported)
