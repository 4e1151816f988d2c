"""The reason a parked run that timed out ends with names its policy's timeout (a new user's trial, stop
55: the reason said ``timeout=...`` literally)."""

from __future__ import annotations

import datetime as _dt

from celery_mongolock.integration.results import _timeout_reason


def test_the_reason_names_the_timeout_from_the_entry_s_deadline() -> None:
    at = _dt.datetime(2026, 11, 30, 12, 0, 0, tzinfo=_dt.timezone.utc)
    reason = _timeout_reason(at, at + _dt.timedelta(seconds=1.5))
    assert reason == "parked since 2026-11-30T12:00:00+00:00, past its policy's timeout=1.5"
    assert _timeout_reason(at, None) == "parked since 2026-11-30T12:00:00+00:00, past its policy's timeout"
    assert _timeout_reason(None, None) == "parked past its policy's timeout"
