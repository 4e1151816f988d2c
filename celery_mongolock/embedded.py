"""The public import path of :mod:`celery_mongolock.ops.embedded`.

Everything that module exports, for users' imports and settings that name this path.
"""

from celery_mongolock.ops.embedded import *  # noqa: F403
from celery_mongolock.ops.embedded import __all__  # noqa: F401  (re-exported)

if __name__ == "__main__":
    import sys

    from celery_mongolock.ops.embedded import main

    sys.exit(main())
