"""Telling a superseded run apart: ``is_superseded(result)`` and the result's type, ``SupersededResult``.

A run that a newer send superseded (``Replace``) ends ``SUCCESS`` with a ``SupersededResult`` (or, with
``Replace(fail_superseded=True)``, ``FAILURE`` with ``Superseded``). Its callbacks receive that result, and
a chain's next task gets it as its first argument, so code downstream of a ``Replace`` task checks it::

    @app.task
    def notify(result):
        if is_superseded(result):
            return  # a newer upload of the group will notify
        ...
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypedDict

from celery_mongolock.exceptions import Superseded

__all__ = ["SupersededResult", "is_superseded"]


class _SupersededFields(TypedDict):
    #: Always ``"superseded"``.
    mongolock: Literal["superseded"]
    #: The key it was superseded on (with ``keys=``: its first key).
    key: str
    #: The task id of the newer run that superseded it.
    by: str


class SupersededResult(_SupersededFields, total=False):
    """The result of a run superseded by a newer send (``Replace``)."""

    #: With ``keys=``: all of its keys.
    keys: list[str]


def is_superseded(result: Any) -> bool:
    """Whether ``result`` is a superseded run's: a ``SupersededResult`` (a task's return value, as a
    callback or the next task of a chain receives it), a ``Superseded`` error, or a Celery ``AsyncResult``
    whose run ended superseded (``False`` while it has not ended)."""
    if isinstance(result, Superseded):
        return True
    if isinstance(result, Mapping):
        return result.get("mongolock") == "superseded"
    state = getattr(result, "state", None)
    if isinstance(state, str) and hasattr(result, "ready"):  # an AsyncResult: one read of its state
        if state not in ("SUCCESS", "FAILURE"):
            return False
        value = result.result
        return isinstance(value, Superseded) or (
            isinstance(value, Mapping) and value.get("mongolock") == "superseded"
        )
    return False
