"""Every public exception of the library survives Celery's result backend: a run that fails with one is
stored as (type, module, args) with the json serializer and rebuilt as ``cls(*args)``, or pickled with the
pickle serializer. The caller gets the same type, message and attributes the worker raised. No server."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_mongolock import (
    ArgumentsNotComparable,
    ConfigurationError,
    DocumentLockLost,
    DocumentMissing,
    DocumentWriteUnknown,
    FencedOut,
    InvalidKey,
    LeaseLost,
    LockContended,
    MongoLockError,
    QueueTimeout,
    StoreUnavailable,
    Superseded,
    UntrustedMessage,
)
from celery_mongolock.exceptions import MessageTooLarge

EXPIRES = dt.datetime(2030, 1, 2, 3, 4, 5, 600000, tzinfo=dt.timezone.utc)
HOLDER = {"host": "web-3", "pid": 4121, "task_name": "proj.tasks.upload", "task_id": "8c1f0e2a"}

#: Each exception as the library (or a task body calling it) raises it.
RAISED: dict[str, Callable[[], BaseException]] = {
    "MongoLockError": lambda: MongoLockError("something went wrong"),
    "ConfigurationError": lambda: ConfigurationError("grace= needs cancel_running=True"),
    "InvalidKey": lambda: InvalidKey("the key 'report:' renders an empty value for 'day'"),
    "StoreUnavailable": lambda: StoreUnavailable("MongoDB refused to find (mongolock.leases): timed out"),
    "ArgumentsNotComparable": lambda: ArgumentsNotComparable("argument 'when' is not JSON data"),
    "DocumentMissing": lambda: DocumentMissing("DocumentLock: no document {'_id': 42}"),
    "DocumentWriteUnknown": lambda: DocumentWriteUnknown("groups:42", 17, "no answer: AutoReconnect"),
    "LockContended": lambda: LockContended("email-group:42", HOLDER, EXPIRES),
    "LockContended-no-holder": lambda: LockContended("email-group:42"),
    "LockContended-message": lambda: LockContended("k", HOLDER, EXPIRES, message="held by this same owner"),
    "QueueTimeout": lambda: QueueTimeout("email-group:42", "parked longer than its timeout (600s)"),
    "LeaseLost": lambda: LeaseLost("email-group:42", 1795384319987000, "taken over"),
    "LeaseLost-defaults": lambda: LeaseLost("email-group:42"),
    "DocumentLockLost": lambda: DocumentLockLost("groups:42", 17, "released by force"),
    "FencedOut-newer": lambda: FencedOut("email-group:42", 17, 18),
    "FencedOut-superseded": lambda: FencedOut("email-group:42", 17, superseded_by="abc-123"),
    "MessageTooLarge": lambda: MessageTooLarge("email-group:42", 20 * 2**20, 15 * 2**20),
    "MessageTooLarge-task": lambda: MessageTooLarge("email-group:42", 20 * 2**20, 15 * 2**20, "app.upload"),
    "Superseded": lambda: Superseded("email-group:42", 17, "abc-123"),
    "Superseded-not-held": lambda: Superseded("email-group:42", None, "abc-123", held=False),
    "UntrustedMessage": lambda: UntrustedMessage("email-group:42", "its arguments render another key"),
}


def backend_of(serializer: str) -> Any:
    app = Celery(
        f"roundtrip_{serializer}", broker="memory://", backend="cache+memory://", set_as_current=False
    )
    app.conf.result_serializer = serializer
    app.conf.accept_content = app.conf.result_accept_content = ["json", "pickle"]
    return app.backend


def public(exc: BaseException) -> dict[str, Any]:
    return {name: value for name, value in vars(exc).items() if not name.startswith("_")}


@pytest.mark.parametrize("serializer", ["json", "pickle"])
@pytest.mark.parametrize("name", sorted(RAISED))
def test_the_caller_gets_the_exception_the_worker_raised(name: str, serializer: str) -> None:
    raised = RAISED[name]()
    backend = backend_of(serializer)
    # As stored (encoded, then decoded by the caller's backend) and rebuilt.
    stored = backend.decode(backend.encode(backend.prepare_exception(raised, serializer)))
    rebuilt = backend.exception_to_python(stored)
    assert type(rebuilt) is type(raised)
    assert str(rebuilt) == str(raised)
    assert public(rebuilt) == public(raised)
    assert rebuilt.args == raised.args
