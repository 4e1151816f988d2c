"""Time sources.

Lease expiry is judged by the MongoDB server: every acquire and renew computes ``expires_at`` from the
server's own ``$$NOW`` inside the update, and the "is it free?" test also runs on the server. A worker's
wall clock is never read for lease decisions, so a worker whose clock is ten minutes off (or jumps) can
neither take a live lease nor keep a dead one alive.

What a holder does need locally is a *deadline* after which it must assume its lease is gone. That is
measured on the monotonic clock from the moment the acquire/renew command was *sent*: the server set
``expires_at = server_now + ttl`` at some instant after that, so ``sent + ttl`` (shrunk by a drift
allowance) is never later than the server's own expiry.

The clock is injectable so that timing logic is tested without sleeping.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

__all__ = ["MAX_DRIFT", "Clock", "FakeClock", "SystemClock"]

#: How much faster than the server's clock the local monotonic clock may run (0.1%: far above what
#: NTP-disciplined or even free-running quartz clocks show, which is tens of ppm).
MAX_DRIFT = 1e-3


class Clock(Protocol):
    """A monotonic time source with a matching sleep."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards."""

    def sleep(self, seconds: float) -> None:
        """Block for ``seconds``."""


class SystemClock:
    """The process's real monotonic clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class FakeClock:
    """A clock that moves only when told to (``advance``) or when slept on; for tests."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds
