"""Pure logic of runs that end without their body (no server): ``is_superseded``, the ending headers, and
which runs need Celery's trace (``endings.in_canvas``). The behaviour with real workers is in
tests/test_canvas_endings.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from celery_mongolock import QueueTimeout, Superseded, SupersededResult, is_superseded
from celery_mongolock.integration import endings, results
from celery_mongolock.integration.handoff import ENDED_HEADER


class FakeResult:
    """An AsyncResult's two attributes ``is_superseded`` reads."""

    def __init__(self, state: str, result: Any) -> None:
        self.state, self.result = state, result

    def ready(self) -> bool:
        return self.state in ("SUCCESS", "FAILURE", "REVOKED")


def test_is_superseded_tells_the_superseded_result_apart() -> None:
    value: SupersededResult = results.superseded_result("g:1", "t2")
    assert is_superseded(value)
    assert is_superseded(results.superseded_result("a", "t2", ["a", "b"]))
    assert is_superseded(Superseded("g:1", 3, "t2"))
    assert is_superseded(FakeResult("SUCCESS", value))
    assert is_superseded(FakeResult("FAILURE", Superseded("g:1", None, "t2")))
    assert not is_superseded(FakeResult("PENDING", None)) and not is_superseded(FakeResult("QUEUED", {}))
    assert not is_superseded(FakeResult("SUCCESS", "done")) and not is_superseded("superseded")
    assert not is_superseded(FakeResult("FAILURE", QueueTimeout("g:1", "parked past its timeout")))
    assert not is_superseded(results.skipped_result("g:1", "parked past its timeout")) and not is_superseded(
        None
    )


@pytest.mark.parametrize(
    ("options", "needed"),
    [
        ({}, False),
        ({"link": None, "link_error": [], "chain": None, "chord": None, "group_id": "g"}, False),
        ({"link": [{"task": "t"}]}, True),
        ({"link_error": [{"task": "t"}]}, True),
        ({"chain": [{"task": "t"}]}, True),
        ({"chord": {"task": "t"}}, True),
    ],
)
def test_a_run_needs_celery_s_trace_only_with_callbacks_a_chain_or_a_chord(
    options: dict[str, Any], needed: bool
) -> None:
    assert endings.in_canvas(options) is needed


def test_the_ending_header_is_read_from_the_request() -> None:
    ending = results.superseded_ending("g:1", "t2", ["g:1", "p:2"])
    assert ending == {"how": "superseded", "k": "g:1", "by": "t2", "ks": ["g:1", "p:2"]}
    assert endings.ending_of(SimpleNamespace(headers={ENDED_HEADER: ending})) == ending
    timeout = results.timeout_ending("g:1", "parked past its timeout", fail=True)
    assert endings.ending_of(SimpleNamespace(headers=None, mongolock_ended=timeout)) == timeout
    assert endings.ending_of(SimpleNamespace(headers={})) is None
    assert endings.ending_of(SimpleNamespace(headers={ENDED_HEADER: {"how": "other"}})) is None
