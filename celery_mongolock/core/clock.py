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

import datetime as _dt
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["MAX_DRIFT", "Clock", "FakeClock", "ServerTime", "SystemClock"]

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


class ServerTime:
    """An estimate of the MongoDB server's wall clock, for code that must *schedule* by time (beat).

    Sampled from ``hello.localTime`` (corrected by half the round trip) and carried forward on the
    monotonic clock, so a jump of the local wall clock changes nothing; re-sampled every
    ``refresh_seconds``. ``uncertainty`` is half the sampling round trip plus the server's 1 ms
    resolution plus drift since the sample.
    """

    def __init__(
        self, hello: Callable[[], Any], clock: Clock | None = None, refresh_seconds: float = 60.0
    ) -> None:
        self._hello = hello
        self._clock: Clock = clock or SystemClock()
        self.refresh_seconds = refresh_seconds
        self._base: _dt.datetime | None = None
        self._base_mono = 0.0
        self._half_rtt = 0.0
        self._lock = threading.Lock()

    def sample(self) -> None:
        """Ask the server for its time now."""
        sent = self._clock.monotonic()
        reply = self._hello()
        received = self._clock.monotonic()
        local = reply["localTime"]
        if local.tzinfo is None:
            local = local.replace(tzinfo=_dt.timezone.utc)
        with self._lock:
            self._half_rtt = (received - sent) / 2
            self._base = local + _dt.timedelta(seconds=self._half_rtt)
            self._base_mono = received

    def now(self) -> _dt.datetime:
        """The server's current time (UTC, aware), re-sampling when the estimate is old."""
        mono = self._clock.monotonic()
        if self._base is None or mono - self._base_mono >= self.refresh_seconds:
            try:
                self.sample()
            except Exception:
                if self._base is None:
                    raise
            mono = self._clock.monotonic()
        with self._lock:
            assert self._base is not None
            return self._base + _dt.timedelta(seconds=mono - self._base_mono)

    @property
    def uncertainty(self) -> float:
        with self._lock:
            return self._half_rtt + 0.001 + MAX_DRIFT * max(0.0, self._clock.monotonic() - self._base_mono)
