"""``celery mongolock why KEY``'s rate lines: a rate-limited key's window (``RateLimit``, ``Throttle``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from celery_mongolock.core.store_rate import rate_windows
from celery_mongolock.exceptions import MongoLockError

if TYPE_CHECKING:
    from celery_mongolock.core.documents.rate import RateWindow
    from celery_mongolock.core.store import LeaseStore

__all__ = ["rate_lines", "rate_verdict", "read_window"]

log = logging.getLogger("celery_mongolock.cli")


def read_window(store: LeaseStore, key: str) -> RateWindow | None:
    """The key's start window, if a rate-limited task ever started on it (None: no rate here, or the
    window could not be read: ``why`` then shows the lease alone, as before rates existed)."""
    try:
        return rate_windows(store).look(key)
    except MongoLockError as exc:
        log.warning("the rate window of %r could not be read: %s", key, exc)
        return None


def rate_lines(window: RateWindow | None) -> list[str]:
    """``rate        3/5 in the last 60 s, next start in 1.4 s`` and the runs it parked, oldest send first
    (empty without a window)."""
    if window is None or not window.n:
        return []
    period = window.period_ms / 1000
    used = window.in_window(window.period_ms)
    next_in = window.next_start_in()
    lines = [f"{'rate'.ljust(11)} {used}/{window.n} in the last {period:g} s, next start in {next_in:.1f} s"]
    if window.waiters:
        lines.append(f"{'':12}{len(window.waiters)} run(s) parked by the rate, oldest send first:")
        for n, waiter in enumerate(window.waiters, 1):
            lines.append(f"{'':12}{n:>2}  {waiter.run}")
    return lines


def rate_verdict(window: RateWindow | None) -> str | None:
    """What the rate says of a free key's next start, for the verdict line of ``why`` (None: the rate
    does not hold it back): ``its rate holds the next start for 596.2 s (2 run(s) wait for it)``."""
    if window is None or not window.n:
        return None
    next_in = window.next_start_in()
    if next_in <= 0:
        return None
    waiting = f" ({len(window.waiters)} run(s) wait for it)" if window.waiters else ""
    return f"its rate holds the next start for {next_in:.1f} s{waiting}"
