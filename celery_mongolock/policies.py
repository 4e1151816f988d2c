"""The public import path of :mod:`celery_mongolock.admission.policies`.

Everything that module exports, for users' imports and settings that name this path.
"""

from celery_mongolock.admission.policies import *  # noqa: F403
from celery_mongolock.admission.policies import __all__  # noqa: F401  (re-exported)
