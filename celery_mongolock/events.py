"""The public import path of :mod:`celery_mongolock.ops.events`.

Everything that module exports, for users' imports and settings that name this path.
"""

from celery_mongolock.ops.events import *  # noqa: F403
from celery_mongolock.ops.events import __all__  # noqa: F401  (re-exported)
