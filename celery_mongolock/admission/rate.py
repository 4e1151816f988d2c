"""Rates of starts per key: ``RateLimit(n, period)`` and ``Throttle(period)`` (values, no I/O).

A rate is about *starts over time*, so it is not a contention policy (what a run does when its key is
*held*): it is its own task option, ``@singleton_task(key=..., rate=RateLimit(5, 60))``, next to
``on_contention=`` and ``limit=``. A run takes its key(s) first, as always, then a start in each key's
window (``core.documents.rate``); over the rate it gives its key(s) back and is parked until its turn
(``then=None``, the default: nothing dropped, starts in send order) or dropped (``then=Skip()``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from celery_mongolock.admission.policies import Policy, Skip, parse_policy
from celery_mongolock.exceptions import ConfigurationError

__all__ = [
    "MAX_RATE_N",
    "MAX_RATE_PERIOD",
    "RateLimit",
    "RateSpec",
    "Throttle",
    "check_rate",
    "checked_rate",
    "parse_rate",
]

#: The most starts per window a key may allow (the window's starts live in one document).
MAX_RATE_N = 1000
#: The longest window (one day; a window's starts are kept that long).
MAX_RATE_PERIOD = 24 * 3600.0


def _period(owner: str, period: object) -> float:
    if (
        isinstance(period, bool)
        or not isinstance(period, (int, float))
        or not math.isfinite(period)
        or not 0 < period <= MAX_RATE_PERIOD
    ):
        raise ConfigurationError(
            f"{owner}(period=...) must be a number of seconds above 0 and at most {MAX_RATE_PERIOD:g}, "
            f"got {period!r}"
        )
    return float(period)


def _then(owner: str, then: object) -> Policy | None:
    """``then=``: None or Skip, given as settings give it too (``"skip"``, ``{"policy": "skip"}``)."""
    if isinstance(then, (str, Mapping)):
        then = parse_policy(then, f"{owner}(then=...)")
    if then is not None and not isinstance(then, Skip):
        raise ConfigurationError(
            f"{owner}(then=...) must be None (park the run until the window allows it) or Skip() (drop "
            f"it), got {then!r}"
        )
    return then


#: What ``then=`` takes: a policy object, or its name or settings dict (``"skip"``).
ThenSpec = Policy | str | Mapping[str, Any] | None


@dataclasses.dataclass(frozen=True, init=False)
class RateLimit:
    """At most ``n`` starts per key in any rolling window of ``period`` seconds (the server's clock);
    runs over the rate are parked and start in send order (``then=Skip()``, or ``"skip"`` as in
    settings: dropped instead)."""

    n: int
    period: float
    then: Policy | None = None
    name = "rate"

    def __init__(self, n: int, period: float, then: ThenSpec = None) -> None:
        owner = type(self).__name__
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_RATE_N:
            raise ConfigurationError(f"{owner}(n=...) must be an int from 1 to {MAX_RATE_N}, got {n!r}")
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "period", _period(owner, period))
        object.__setattr__(self, "then", _then(owner, then))

    @property
    def period_ms(self) -> int:
        return max(1, round(self.period * 1000))

    @property
    def parks(self) -> bool:
        """True when a run over the rate waits for its turn (False: ``then=Skip()`` drops it)."""
        return self.then is None

    def describe(self) -> str:
        """``"RateLimit(2 per 2 s)"``, as results and ``why`` name it."""
        return f"RateLimit({self.n} per {self.period:g} s)"


@dataclasses.dataclass(frozen=True, init=False)
class Throttle(RateLimit):
    """At most one start per key per ``period`` seconds: ``RateLimit(1, period)``; the rest are parked
    to the next window (``then=Skip()``: dropped)."""

    name = "throttle"

    def __init__(self, period: float, then: ThenSpec = None) -> None:
        super().__init__(1, period, then)

    def describe(self) -> str:
        return f"Throttle(1 per {self.period:g} s)"


RateSpec = RateLimit | Mapping[str, Any]


def parse_rate(value: object, setting: str = "rate") -> RateLimit | None:
    """A rate from ``RateLimit(...)``/``Throttle(...)``, a settings dict (``{"n": 5, "period": 60}``,
    ``{"throttle": 10}``, ``"then": "skip"``) or None; ``ConfigurationError`` naming ``setting`` if bad."""
    if value is None or isinstance(value, RateLimit):
        return value
    if not isinstance(value, Mapping):
        raise ConfigurationError(
            f"{setting} must be RateLimit(n, period), Throttle(period), a dict such as "
            f"{{'n': 5, 'period': 60}} or {{'throttle': 10}}, or None; got {type(value).__name__}"
        )
    options = dict(value)
    then = options.pop("then", None)
    if then is not None:
        then = parse_policy(then, f"{setting}['then']")
    try:
        unknown = sorted(set(options) - {"n", "period", "throttle"}, key=str)
        if unknown:
            raise ConfigurationError(
                f"unknown key(s) {unknown}; a rate takes 'n' and 'period', or 'throttle', and 'then'"
            )
        if "throttle" in options:
            if len(options) > 1:
                raise ConfigurationError(
                    "give 'throttle' (one start per period) or 'n' and 'period', not both"
                )
            return Throttle(options["throttle"], then)
        if "n" not in options or "period" not in options:
            raise ConfigurationError(f"needs 'n' and 'period' (or 'throttle'); got {sorted(value, key=str)}")
        return RateLimit(options["n"], options["period"], then)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{setting}: {exc}") from None


def check_rate(rate: RateLimit | None, policy: object) -> None:
    """A rate with the task's contention policy: every policy takes one. With ``Queue``/``Replace`` a run
    waits its turn on the key first (parked in the key's queue, handed the key in send order), then its
    turn in the key's window (``integration.rate_gate``: over the rate, it gives the key back, which goes
    on to the next parked run, and waits among the window's waiting runs, which keep send order too).
    One pair is refused: ``Replace(cancel_running=True)`` with a rate that drops a run over it
    (``then=Skip()``/``Fail()``): a newer send would stop the running holder, then be dropped by the rate
    itself, and nothing of either would run."""
    if rate is None or rate.parks or getattr(policy, "cancel_running", False) is not True:
        return
    raise ConfigurationError(
        f"Replace(cancel_running=True) with rate={rate.describe()}, which drops a run over the rate "
        f"(then={type(rate.then).__name__}()), is refused: a newer send would stop the running run and "
        "then be dropped by the rate, so neither would finish. Let the rate park runs over it (leave "
        "then= out), or drop cancel_running"
    )


def checked_rate(value: object, policy: object, setting: str = "rate") -> RateLimit | None:
    """``parse_rate`` then ``check_rate``: the rate a declaration gives, refused with a clear error if bad."""
    rate = parse_rate(value, setting)
    check_rate(rate, policy)
    return rate
