"""The public import path of :mod:`celery_mongolock.ops.testing`.

Everything that module exports, for users' imports and settings that name this path.
"""

from celery_mongolock.ops.testing import *  # noqa: F403
from celery_mongolock.ops.testing import __all__  # noqa: F401  (re-exported)
