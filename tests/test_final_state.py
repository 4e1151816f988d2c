"""Whether a copy of a run finds its task's result already settled (``runs.has_final_state``), on Celery's
in-memory result backend (no server): a body's ``RETRY`` is final for a copy only when it is that copy's
own attempt's, or a later attempt carries the task on (the lock-set checker's seed 86)."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.app.task import Context

from celery_mongolock import LockContended
from celery_mongolock.core.outcomes import later_attempt_known
from celery_mongolock.integration.runs import has_final_state


def _run(app: Celery, task_id: str, retries: int) -> Any:
    """The public attributes of a task that ``has_final_state`` reads (``runs.GuardedRun``)."""
    request = SimpleNamespace(id=task_id, retries=retries, ignore_result=False)
    return SimpleNamespace(app=app, backend=app.backend, ignore_result=False, request=request)


@pytest.fixture
def app() -> Celery:
    return Celery(f"fs{uuid.uuid4().hex[:6]}", backend="cache+memory://", set_as_current=False)


def test_a_body_retry_is_final_for_a_copy_of_attempt_0_only(app: Celery) -> None:
    task_id = str(uuid.uuid4())
    app.backend.mark_as_retry(task_id, None)  # some attempt's body called self.retry()
    assert has_final_state(_run(app, task_id, 0), carried_on=lambda: False)  # attempt 0's own retry
    # A copy of attempt 1: that RETRY may be attempt 0's, whose retry is this very run.
    assert not has_final_state(_run(app, task_id, 1), carried_on=lambda: False)
    assert has_final_state(_run(app, task_id, 1), carried_on=lambda: True)  # attempt 2 is on the key
    assert has_final_state(_run(app, task_id, 1))  # callers that do not ask: as before


def test_with_result_extended_the_attempt_that_retried_decides(app: Celery) -> None:
    app.conf.result_extended = True
    task_id = str(uuid.uuid4())
    app.backend.mark_as_retry(task_id, None, request=Context(id=task_id, retries=0, delivery_info={}))
    assert not has_final_state(_run(app, task_id, 1), carried_on=lambda: True)  # attempt 0 wrote it
    app.backend.mark_as_retry(task_id, None, request=Context(id=task_id, retries=1, delivery_info={}))
    assert has_final_state(_run(app, task_id, 1), carried_on=lambda: False)  # attempt 1's own retry


def test_a_contention_retry_or_no_state_is_never_final(app: Celery) -> None:
    task_id = str(uuid.uuid4())
    assert not has_final_state(_run(app, task_id, 0), carried_on=lambda: True)  # PENDING
    app.backend.mark_as_retry(task_id, LockContended("k", {}, None))
    assert not has_final_state(_run(app, task_id, 0), carried_on=lambda: True)
    app.backend.mark_as_done(task_id, "result")
    assert has_final_state(_run(app, task_id, 3), carried_on=lambda: False)


def test_a_later_attempt_is_known_wherever_the_key_keeps_it() -> None:
    """``later_attempt_known`` (the document read for a copy of attempt 1 of task T)."""
    assert not later_attempt_known(None, "T", 1)
    assert not later_attempt_known({"seen": ["T/1.0", "T/0.2", "U/5.0"]}, "T", 1)
    assert later_attempt_known({"seen": ["T/2.0"]}, "T", 1)
    assert later_attempt_known({"owner": "o", "holder": {"task_id": "T", "delivery": "2.1"}}, "T", 1)
    assert not later_attempt_known({"owner": None, "holder": {"task_id": "T", "delivery": "2.1"}}, "T", 1)
    assert later_attempt_known({"hs": [{"h": {"task_id": "T", "delivery": "3.0"}}]}, "T", 1)
    assert later_attempt_known({"hs": [{"h": {}, "ho": {"t": "T", "r": "2"}}]}, "T", 1)
    assert later_attempt_known({"q": [{"t": "T", "r": "2"}]}, "T", 1)
    assert later_attempt_known({"ho": {"t": "T", "r": "2"}}, "T", 1)
    assert not later_attempt_known({"q": [{"t": "T", "r": "1"}], "ho": {"t": "U", "r": "9"}}, "T", 1)
