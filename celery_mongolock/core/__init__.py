"""The lease core: lease documents as pure functions, the store's commands, heartbeat, clock, fencing.

No Celery, kombu or billiard here (an import-linter contract in ``make lint``). Everything above it
reads typed results (``core.outcomes``, ``core.lease``), never a lease document's fields.
"""
