"""``unique_send``: the dedupe key (pure), its options and their errors, and sends on the embedded server
through a real (in-memory) broker: an equal pending send returns the pending run and publishes nothing,
one command per send with it on and none with it off, ``StoreUnavailable`` or ``"best_effort"`` when
MongoDB does not answer, and what is never deduplicated (re-sends, callbacks). The real-worker suite is
``tests/test_unique_send_workers.py``."""

from __future__ import annotations

import datetime as _dt
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.signals import after_task_publish
from pymongo import MongoClient

from celery_mongolock import (
    ArgumentsNotComparable,
    ConfigurationError,
    LeaseStore,
    StoreUnavailable,
    singleton_task,
)
from celery_mongolock.core.documents.sends import (
    DEFAULT_UNIQUE_SEND_SECONDS,
    canonical_arguments,
    check_unique_send,
    claim_update,
    send_digest,
)
from celery_mongolock.core.store_sends import sends_of
from celery_mongolock.integration.config import read_settings
from celery_mongolock.integration.unique_send import UNIQUE_SEND_HEADER, bound_ms

from .conftest import CommandCounter

# -- the dedupe key: pure ----------------------------------------------------------------------------


def test_equal_sends_have_one_digest_and_any_difference_another() -> None:
    base = send_digest("t.upload", ["group:7"], {"group_id": 7, "files": {"a": 1, "b": [1, 2]}})
    assert base == send_digest("t.upload", ["group:7"], {"files": {"b": (1, 2), "a": 1}, "group_id": 7})
    assert len(base) == 64
    others = [
        send_digest("t.other", ["group:7"], {"group_id": 7, "files": {"a": 1, "b": [1, 2]}}),
        send_digest("t.upload", ["group:8"], {"group_id": 7, "files": {"a": 1, "b": [1, 2]}}),
        send_digest("t.upload", ["group:7"], {"group_id": 7, "files": {"a": 1, "b": [2, 1]}}),
        send_digest("t.upload", ["group:7"], {"group_id": "7", "files": {"a": 1, "b": [1, 2]}}),
    ]
    assert len({base, *others}) == 5
    assert send_digest("t", ["b", "a"], {}) == send_digest("t", ["a", "b"], {})  # keys as a set


def test_arguments_that_are_not_json_data_are_refused_naming_the_argument() -> None:
    assert canonical_arguments("t", {"x": 1.5, "y": None, "z": [True]}) == '{"x":1.5,"y":null,"z":[true]}'
    for arguments, named in (
        ({"when": _dt.datetime(2026, 1, 1)}, "argument 'when' is a datetime"),
        ({"ids": {1, 2}}, "argument 'ids' is a set"),
        ({"m": {1: "a"}}, "argument 'm' has a dict key 1"),
        ({"v": [b"x"]}, "argument 'v'[0] is a bytes"),
        ({"f": float("nan")}, "argument 'f' is nan"),
    ):
        with pytest.raises(ArgumentsNotComparable) as caught:
            canonical_arguments("t.upload", arguments)
        assert named in str(caught.value) and "task 't.upload' has unique_send" in str(caught.value)
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(ArgumentsNotComparable, match="nested too deeply"):
        canonical_arguments("t", {"loop": loop})


def test_the_claim_writes_this_send_only_when_no_live_record_names_another() -> None:
    [stage] = claim_update("id-1", "t", ["k2", "k1"], 5000)
    fields = stage["$set"]
    assert set(fields) == {"t", "n", "k", "s", "x"}
    assert fields["t"]["$cond"][1:] == ["id-1", "$t"]
    assert fields["k"]["$cond"][1] == {"$literal": ["k1", "k2"]}
    assert fields["x"]["$cond"][1] == {"$add": ["$$NOW", 5000]}


def test_the_bound_adds_the_countdown_and_stops_at_expires() -> None:
    now = _dt.datetime(2026, 1, 1, tzinfo=_dt.timezone.utc)
    assert bound_ms({}, 60, now) == 60_000
    assert bound_ms({"countdown": 30}, 60, now) == 90_000
    assert bound_ms({"eta": now + _dt.timedelta(seconds=10)}, 60, now) == 70_000
    assert bound_ms({"eta": (now + _dt.timedelta(seconds=10)).isoformat()}, 60, now) == 70_000
    assert bound_ms({"countdown": 30, "expires": 45}, 60, now) == 45_000
    assert bound_ms({"expires": now + _dt.timedelta(seconds=5)}, 60, now) == 5_000
    assert bound_ms({"expires": now - _dt.timedelta(seconds=5)}, 60, now) == 1  # expired: claims ~nothing


# -- options and their errors ------------------------------------------------------------------------


def _body(group_id: int) -> None: ...


def test_unique_send_values_and_their_errors() -> None:
    assert check_unique_send(True, "x") is True
    assert check_unique_send("best_effort", "x") == "best_effort"
    assert check_unique_send(None, "x") is False
    with pytest.raises(ConfigurationError, match=r"unique_send must be True, False or 'best_effort'"):
        singleton_task(unique_send="yes")(_body)
    with pytest.raises(ConfigurationError, match=r"unique_send_seconds must be above 0"):
        singleton_task(unique_send=True, unique_send_seconds=0)(_body)
    with pytest.raises(ConfigurationError, match=r"unique_send_seconds must be a number of seconds"):
        singleton_task(unique_send=True, unique_send_seconds="1h")(_body)  # type: ignore[call-overload]
    with pytest.raises(ConfigurationError, match=r"\['t'\]\['unique_send'\] must be True"):
        read_settings({"mongolock_task_policies": {"t": {"unique_send": 1}}})
    with pytest.raises(ConfigurationError, match=r"\['t'\]\['unique_send_seconds'\] must be above 0"):
        read_settings({"mongolock_task_policies": {"t": {"unique_send_seconds": -1}}})
    settings = read_settings({"mongolock_task_policies": {"t": {"unique_send": "best_effort"}}})
    options = settings.for_task("t")
    assert options.unique_send == "best_effort"
    assert options.unique_send_seconds == DEFAULT_UNIQUE_SEND_SECONDS
    assert settings.for_task("u", unique_send=True, unique_send_seconds=5).unique_send_seconds == 5.0
    assert not settings.for_task("u").unique_send


def test_a_misspelt_option_is_refused_with_the_right_name() -> None:
    with pytest.raises(ConfigurationError, match="did you mean unique_send="):
        singleton_task(unique_sends=True)(_body)


# -- sends on the embedded server, through an in-memory broker ---------------------------------------


class Sent:
    """The messages the broker took (``after_task_publish``)."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.headers: list[dict[str, Any]] = []

    def __call__(self, sender: Any = None, headers: Any = None, **_: Any) -> None:
        self.ids.append(str((headers or {}).get("id")))
        self.headers.append(dict(headers or {}))


@pytest.fixture
def sent() -> Iterator[Sent]:
    s = Sent()
    after_task_publish.connect(s, weak=False)
    yield s
    after_task_publish.disconnect(s)


@pytest.fixture
def app(mongo_url: str, db_name: str, counter: CommandCounter) -> Iterator[Celery]:
    a = Celery(f"unique_{uuid.uuid4().hex[:6]}", set_as_current=False)
    a.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        mongolock_url=mongo_url,
        mongolock_database=db_name,
        mongolock_task_policies={"t.policy": {"unique_send": True}},
    )
    client: MongoClient[dict[str, Any]] = MongoClient(mongo_url, event_listeners=[counter], tz_aware=True)
    a._mongolock_store = LeaseStore(client, database=db_name)
    yield a
    a._mongolock_store.close()
    client.drop_database(db_name)
    client.close()


def _tasks(app: Celery) -> tuple[Any, Any, Any]:
    @singleton_task(key="group:{group_id}", app=app, name="t.unique", unique_send=True)
    def unique(group_id: int, upload: str = "a.csv") -> str:
        return upload

    @singleton_task(key="group:{group_id}", app=app, name="t.plain")
    def plain(group_id: int, upload: str = "a.csv") -> str:
        return upload

    @singleton_task(key="group:{group_id}", app=app, name="t.policy")
    def by_policy(group_id: int, upload: str = "a.csv") -> str:
        return upload

    return unique, plain, by_policy


def test_an_equal_pending_send_returns_the_pending_run_and_publishes_nothing(
    app: Celery, sent: Sent, counter: CommandCounter
) -> None:
    unique, _, _ = _tasks(app)
    first = unique.delay(7, "a.csv")
    counter.clear()
    again = unique.apply_async((7,), {"upload": "a.csv"})  # the same call, bound: f(7) == f(group_id=7)
    assert counter.names() == ["findAndModify"]  # one round trip per send
    assert again.id == first.id
    assert sent.ids == [first.id]
    assert sent.headers[0][UNIQUE_SEND_HEADER]
    other = unique.delay(7, "b.csv")  # other arguments: a send of its own
    assert other.id != first.id and sent.ids == [first.id, other.id]
    [a, b] = sends_of(app._mongolock_store).pending("group:7")
    assert (a.task_id, b.task_id) == (first.id, other.id)
    # Its body starts (in a worker): from then on an equal send is a new send.
    assert sends_of(app._mongolock_store).forget(first.id)
    assert unique.delay(7, "a.csv").id not in (first.id, other.id)


def test_with_replace_a_send_equal_to_an_overtaken_run_is_the_newest_and_is_published(
    app: Celery, sent: Sent
) -> None:
    """``Replace`` with ``unique_send``: sends (a), (b), (a) of one key while none has started. The third
    is equal to the first, but the second, newer than the first, supersedes it: absorbed by the first, the
    file sent last would be lost (a user's trial: the key ended with b). It is published, and the record
    names it; a fourth equal send is absorbed by it. Under ``Queue`` every send runs: absorbed as before."""

    @singleton_task(
        key="group:{group_id}", app=app, name="t.latest", unique_send=True, on_contention="replace"
    )
    def latest(group_id: int, upload: str) -> str:
        return upload

    @singleton_task(key="group:{group_id}", app=app, name="t.queued", unique_send=True, on_contention="queue")
    def queued(group_id: int, upload: str) -> str:
        return upload

    first, second, third = (latest.delay(7, name) for name in ("a.csv", "b.csv", "a.csv"))
    assert third.id not in (first.id, second.id)
    assert sent.ids == [first.id, second.id, third.id]
    assert latest.delay(7, "a.csv").id == third.id  # the record names the newest now
    assert [p.task_id for p in sends_of(app._mongolock_store).pending("group:7")] == [second.id, third.id]
    q1, q2, q3 = (queued.delay(8, name) for name in ("a.csv", "b.csv", "a.csv"))
    assert q3.id == q1.id and q2.id != q1.id


def test_with_replace_a_send_equal_to_a_run_overtaken_by_a_started_send_is_published(
    app: Celery, sent: Sent
) -> None:
    """The same when the newer send (b) has already started its body (so its record is gone) while the
    first (a) has not reached a worker (a backlog, a countdown): the key's newest send that got it (``last``)
    was sent after (a), which its admission will supersede, so a second (a) is published (before: it was
    absorbed by the first and the key ended with b)."""

    @singleton_task(
        key="group:{group_id}", app=app, name="t.latest2", unique_send=True, on_contention="replace"
    )
    def latest(group_id: int, upload: str) -> str:
        return upload

    store = app._mongolock_store
    records = sends_of(store)
    first, second = latest.delay(9, "a.csv"), latest.delay(9, "b.csv")
    stamp_a, stamp_b = ((records.collection.find_one({"t": r.id}) or {})["p"] for r in (first, second))
    assert stamp_a < stamp_b
    # What (b)'s start leaves: its record forgotten, and the key's newest send that got it is (b).
    assert records.forget(second.id)
    store.collection.update_one(
        {"_id": "group:9"}, {"$set": {"last": {"s": stamp_b, "t": second.id}}}, upsert=True
    )
    again = latest.delay(9, "a.csv")
    assert again.id != first.id and sent.ids[-1] == again.id
    assert latest.delay(9, "a.csv").id == again.id  # the record names it now
    # Not overtaken (the key's newest start is older than the pending send): absorbed as before.
    store.collection.update_one({"_id": "group:9"}, {"$set": {"last": {"s": stamp_a - 1, "t": "x"}}})
    assert latest.delay(9, "a.csv").id == again.id


def test_with_replace_on_a_set_of_keys_a_started_newer_send_of_the_set_is_seen_too(
    app: Celery, sent: Sent
) -> None:
    """The same with ``keys=`` (a set of keys): the set's newest send that got its keys is its record in
    each key's ``lg``; a newer start of another set sharing a key does not count (it does not supersede)."""
    from celery_mongolock.core.documents.sets import set_signature

    @singleton_task(
        keys=("tenant:{t}", "group:{g}"),
        app=app,
        name="t.set_latest",
        unique_send=True,
        on_contention="replace",
    )
    def upload(t: int, g: int, name: str) -> str:
        return name

    store = app._mongolock_store
    records = sends_of(store)
    keys = ["group:5", "tenant:1"]
    first, second = upload.delay(1, 5, "a.csv"), upload.delay(1, 5, "b.csv")
    stamp_b = (records.collection.find_one({"t": second.id}) or {})["p"]
    assert records.forget(second.id)
    other_set = {"g": set_signature(["group:5", "tenant:2"]), "s": stamp_b, "t": "x"}
    store.collection.update_one({"_id": "group:5"}, {"$set": {"lg": [other_set]}}, upsert=True)
    assert upload.delay(1, 5, "a.csv").id == first.id  # another set's start: absorbed as before
    mine = {"g": set_signature(keys), "s": stamp_b, "t": second.id}
    store.collection.update_one({"_id": "group:5"}, {"$set": {"lg": [other_set, mine]}})
    again = upload.delay(1, 5, "a.csv")
    assert again.id != first.id and sent.ids[-1] == again.id


def test_off_by_default_a_send_costs_no_command(app: Celery, sent: Sent, counter: CommandCounter) -> None:
    _, plain, by_policy = _tasks(app)
    counter.clear()
    ids = [plain.delay(7).id, plain.delay(7).id]
    assert counter.names() == []  # nothing sent to MongoDB
    assert sent.ids == ids and ids[0] != ids[1]
    assert by_policy.delay(7).id == by_policy.delay(7).id  # on through mongolock_task_policies


def test_mongodb_unreachable_refuses_the_send_or_publishes_it_with_best_effort(
    db_name: str, sent: Sent, caplog: pytest.LogCaptureFixture
) -> None:
    a = Celery(f"unique_{uuid.uuid4().hex[:6]}", set_as_current=False)
    a.conf.update(
        broker_url="memory://",
        mongolock_url="mongodb://127.0.0.1:9/?serverSelectionTimeoutMS=300",
        mongolock_database=db_name,
        mongolock_operation_timeout=0.5,
        mongolock_task_policies={"t.best": {"unique_send": "best_effort"}},
    )

    @singleton_task(key="group:{group_id}", app=a, name="t.strict", unique_send=True)
    def strict(group_id: int) -> None: ...

    @singleton_task(key="group:{group_id}", app=a, name="t.best")
    def best(group_id: int) -> None: ...

    try:
        with pytest.raises(StoreUnavailable) as caught:
            strict.delay(7)
        assert "has unique_send: the send was not published" in str(caught.value)
        assert sent.ids == []
        with caplog.at_level("WARNING", logger="celery_mongolock.send"):
            published = best.delay(7)
        assert sent.ids == [published.id]
        assert "published without deduplication (unique_send='best_effort')" in caplog.text
        assert UNIQUE_SEND_HEADER not in sent.headers[0]
    finally:
        if "_mongolock_store" in a.__dict__:
            a._mongolock_store.close()


def test_resends_and_sends_with_callbacks_are_never_deduplicated(app: Celery, sent: Sent) -> None:
    unique, plain, _ = _tasks(app)
    first = unique.delay(7)
    # A re-send of a recorded run (retry(), a contention retry, a handoff) carries its header.
    resend = unique.apply_async((7,), task_id=first.id, headers={UNIQUE_SEND_HEADER: "x"})
    assert resend.id == first.id and sent.ids == [first.id, first.id]
    linked = unique.apply_async((7,), link=plain.si(1))  # returning the pending run would drop its callback
    assert linked.id != first.id and sent.ids[-1] == linked.id


def test_arguments_that_cannot_be_compared_are_refused_at_send(app: Celery, sent: Sent) -> None:
    unique, _, _ = _tasks(app)
    with pytest.raises(ArgumentsNotComparable, match="argument 'upload' is a set"):
        unique.delay(7, {"a.csv"})
    assert sent.ids == []


def test_a_send_whose_publish_fails_leaves_no_record(app: Celery, sent: Sent) -> None:
    unique, _, _ = _tasks(app)
    with pytest.raises(Exception, match="no such"):
        unique.apply_async((7,), serializer="no such")
    assert sent.ids == []
    assert sends_of(app._mongolock_store).pending("group:7") == []
    assert unique.delay(7).id == sent.ids[0]


def test_a_setting_turns_a_declared_unique_send_off(app: Celery, sent: Sent, counter: CommandCounter) -> None:
    unique, _, _ = _tasks(app)
    app.conf.mongolock_task_policies = {"t.unique": {"unique_send": False}}
    app.__dict__.pop("_mongolock_settings", None)
    counter.clear()
    assert unique.delay(7).id != unique.delay(7).id
    assert counter.names() == [] and len(sent.ids) == 2


_THREADED_FIRST_SENDS = """
import sys, threading, time
from celery import Celery
from celery_mongolock import SingletonTask, singleton_task

app = Celery("threaded_first_sends", broker="memory://", set_as_current=False)
app.conf.update(mongolock_url=sys.argv[1], mongolock_database=sys.argv[2])

binding = threading.Event()
bind = SingletonTask.bind.__func__

def slow_bind(cls, app):  # the first thread registers the task, then binds it slowly
    if cls.name == "threaded.report":
        binding.set()
        time.sleep(1.0)
    return bind(cls, app)

SingletonTask.bind = classmethod(slow_bind)

@singleton_task(app=app, key="report:{n}", unique_send=True, name="threaded.report")
def report(n: int) -> None: ...

errors = []
def send(n):
    try:
        if n:
            binding.wait(10)  # the others send meanwhile: Celery hands them the registered task
        report.delay(n)
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")

threads = [threading.Thread(target=send, args=(n,)) for n in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print(errors)
"""


def test_first_sends_from_several_threads_wait_for_the_app_to_be_ready(mongo_url: str, db_name: str) -> None:
    """A fresh process whose first sends come from several threads at once (a threaded web server's first
    requests): one thread finalizes the app, the others send while it binds the tasks. Before: some got
    ``AttributeError: 'NoneType' object has no attribute 'top'`` (a task not yet bound)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _THREADED_FIRST_SENDS, mongo_url, db_name],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
