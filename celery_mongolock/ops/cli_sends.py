"""``celery mongolock why KEY``: the pending unique sends of the key (``unique_send=True``), one line each:
the run an equal send gets instead of a new one, when it was sent, and when its window ends at the latest
(server time, UTC)."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Sequence
from typing import Any

from celery_mongolock.core.documents.sends import PendingSend
from celery_mongolock.core.history import clock

__all__ = ["pending_send_lines", "pending_sends_json"]


def pending_send_lines(pending: Sequence[PendingSend], now: _dt.datetime) -> list[str]:
    """The ``sends`` rows of ``why``: none, or one line per pending send, oldest first."""
    if not pending:
        return [f"{'sends'.ljust(11)} no unique send pending"]
    lines = [
        f"{'sends'.ljust(11)} {len(pending)} unique send(s) pending (an equal send gets the run instead):"
    ]
    for send in pending:
        if send.until is None:
            window = "?"
        else:
            left = (send.until - now).total_seconds()
            window = (
                f"ends in {left:.1f} s at the latest" if left >= 0 else f"ended {-left:.1f} s ago (bound)"
            )
        lines.append(f"{'':12}{send.task_name}[{send.task_id}]  sent {clock(send.sent_at)}  window {window}")
    return lines


def pending_sends_json(pending: Sequence[PendingSend]) -> list[dict[str, Any]]:
    """The pending unique sends as ``why --json`` shows them."""
    return [
        {
            "task_id": send.task_id,
            "task_name": send.task_name,
            "keys": list(send.keys),
            "sent_at": send.sent_at.isoformat() if send.sent_at else None,
            "until": send.until.isoformat() if send.until else None,
        }
        for send in pending
    ]
