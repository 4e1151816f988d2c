"""The embedded server with a gate in its record of retryable writes (``tests/test_document_lock_retry``).

Run as ``python tests/gate_server.py --host H --port P`` with ``GATE`` in the environment: once the file
``$GATE.arm`` exists, the next retryable write's record (SecantusDB writes it after running the write)
waits until the file ``$GATE`` exists (at most 30 s). A retry of that write that arrives meanwhile finds
no record and is run again, as it can under load without the gate.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from secantus import transactions
from secantus.cli import main

_record = transactions.TransactionRegistry.record_retryable


def _gated(self: Any, *args: Any, **kwargs: Any) -> None:
    gate = os.environ["GATE"]
    if os.path.exists(gate + ".arm"):
        os.unlink(gate + ".arm")
        give_up = time.monotonic() + 30
        while not os.path.exists(gate) and time.monotonic() < give_up:
            time.sleep(0.01)
    _record(self, *args, **kwargs)


if __name__ == "__main__":
    transactions.TransactionRegistry.record_retryable = _gated
    sys.argv[0] = "secantusd-py"
    sys.exit(main())
