"""A producer process for ``tests/test_unique_send_workers.py``: connects, says ``ready``, waits for a
``go`` line on stdin, then sends ``integration_app.unique`` N times with the same arguments and prints the
task ids it got back (JSON), one line.

    python -m tests.unique_send_producer N RESOURCE TAG

The broker, backend and MongoDB come from the environment (``tests/workers.py:worker_env``).
"""

from __future__ import annotations

import json
import sys

from celery_mongolock.integration.config import get_store

from . import integration_app as it


def main() -> None:
    n, resource, tag = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    with it.app.connection_for_write() as connection:
        connection.ensure_connection()
    get_store(it.app).has_writable_server()
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    ids = [it.unique.delay(resource, tag, 0.3).id for _ in range(n)]
    print(json.dumps(ids), flush=True)


if __name__ == "__main__":
    main()
