"""The CLI's parameter types, refused in our words (``celery mongolock``, ``ops.cli``)."""

from __future__ import annotations

import math
from typing import Any

import click

__all__ = ["Number"]


class Number(click.ParamType):  # type: ignore[type-arg]  # generic in click 8.3+ only
    """A number of at least ``low`` (and at most ``high``), refused in our words (click's ranges word it
    their own way)."""

    def __init__(
        self, kind: type[int] | type[float], low: float, unit: str = "", high: float | None = None
    ) -> None:
        self.kind, self.low, self.unit, self.high = kind, low, unit, high
        self.name = kind.__name__

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number: float | None
        try:
            number = self.kind(value) if not isinstance(value, bool) else None
        except (TypeError, ValueError):
            number = None
        high = math.inf if self.high is None else self.high
        if number is None or not math.isfinite(number) or not self.low <= number <= high:
            what = "an int" if self.kind is int else "a number"
            unit = f" {self.unit}" if self.unit else ""
            most = "" if self.high is None else f" and at most {self.high:.15g}"
            self.fail(f"must be {what} of at least {self.low:g}{most}{unit}, got {value!r}", param, ctx)
        return number
