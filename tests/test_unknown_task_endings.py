"""A superseded or timed-out parked run of a task this worker does not have is left, for a while, to a
worker that has it: only such a worker can end it through Celery from its checked message (its callbacks,
chain and chord). Past ``UNKNOWN_TASK_WAIT_S`` any worker writes its result, without them, and says so.
The real store; the sweeper's calls (``write_superseded`` / ``write_timed_out``) as it makes them."""

from __future__ import annotations

import datetime as _dt
from typing import Any

import celery
import pytest

from celery_mongolock.config import get_store
from celery_mongolock.integration import results

KEY = "group:1"


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def _publish(calls: list[Any]) -> Any:
    def publish(key: str, entry: Any, ending: Any) -> bool:
        calls.append(entry["t"])
        return False  # as publish_ending answers for a message it could not check: write the result

    return publish


@pytest.mark.parametrize(("field", "since"), [("sup", "at"), ("dead", "dl")])
def test_a_worker_without_the_task_leaves_the_ending_then_writes_it_late(
    worker_app: celery.Celery, field: str, since: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = get_store(worker_app)
    fresh = {"t": "t-fresh", "n": "proj.elsewhere", "by": "t-newer", since: _now()}
    late = {"t": "t-late", "n": "proj.elsewhere", "by": "t-newer", since: _now() - _dt.timedelta(seconds=400)}
    store.collection.insert_one({"_id": KEY, field: [fresh, late]})
    calls: list[Any] = []
    write = results.write_superseded if field == "sup" else results.write_timed_out
    left = write(worker_app, store, KEY, [fresh, late], publish=_publish(calls))
    # The fresh one is left (still in the key's list, nothing written); the late one is ended here.
    assert calls == ["t-late"]
    assert [e["t"] for e in (store.collection.find_one({"_id": KEY}) or {}).get(field) or []] == ["t-fresh"]
    if field == "sup":
        assert [e["t"] for e in left or []] == ["t-fresh"]
    assert worker_app.AsyncResult("t-fresh").state == "PENDING"
    assert worker_app.AsyncResult("t-late").state == "SUCCESS"
    assert any("no worker that has its task ended it" in r.getMessage() for r in caplog.records)


def test_a_worker_that_has_the_task_ends_it_at_once(worker_app: celery.Celery) -> None:
    @worker_app.task(name="proj.here")
    def here() -> None: ...

    store = get_store(worker_app)
    entry = {"t": "t-here", "n": "proj.here", "by": "t-newer", "at": _now()}
    store.collection.insert_one({"_id": KEY, "sup": [entry]})
    calls: list[Any] = []
    assert results.write_superseded(worker_app, store, KEY, [entry], publish=_publish(calls)) == []
    assert calls == ["t-here"]
    assert worker_app.AsyncResult("t-here").state == "SUCCESS"
