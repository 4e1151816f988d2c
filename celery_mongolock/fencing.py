"""The public import path of :mod:`celery_mongolock.core.fencing`.

Everything that module exports, for users' imports and settings that name this path.
"""

from celery_mongolock.core.fencing import *  # noqa: F403
from celery_mongolock.core.fencing import __all__  # noqa: F401  (re-exported)
