"""Pure logic: policies, settings, key specs. No server."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from bson import ObjectId
from celery import Celery

from celery_mongolock import (
    ConfigurationError,
    Fail,
    InvalidKey,
    LockContended,
    Queue,
    Replace,
    Retry,
    Skip,
    Wait,
    singleton_task,
)
from celery_mongolock.config import read_settings
from celery_mongolock.keys import KeyRenderer, encode_value
from celery_mongolock.policies import TRY_AGAIN, parse_policy

# -- policies ------------------------------------------------------------------------------------------


def test_retry_backs_off_exponentially_up_to_the_cap_without_jitter() -> None:
    p = Retry(countdown=1, backoff=2, max_countdown=10, jitter=False)
    assert [p.delay(n) for n in range(6)] == [1, 2, 4, 8, 10, 10]


def test_retry_jitter_stays_within_half_and_full_delay() -> None:
    p = Retry(countdown=4, backoff=1, max_countdown=60)
    assert p.delay(0, rng=lambda: 0.0) == 2.0
    assert p.delay(0, rng=lambda: 1.0) == 4.0
    assert p.delay(0, rng=lambda: 0.5) == 3.0


def test_retry_huge_attempt_numbers_do_not_overflow() -> None:
    assert Retry(jitter=False, max_countdown=30).delay(10_000) == 30


def test_retry_max_retries() -> None:
    p = Retry(max_retries=2)
    assert not p.exhausted(0) and not p.exhausted(1) and p.exhausted(2)
    assert not Retry().exhausted(10**6)


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: Retry(countdown=-1), "countdown"),
        (lambda: Retry(backoff=0.5), "backoff"),
        (lambda: Retry(max_retries=-1), "max_retries"),
        (lambda: Retry(max_retries=1.5), "max_retries"),  # type: ignore[arg-type]
        (lambda: Retry(countdown=float("nan")), "countdown"),
        (lambda: Wait(timeout=-1), "timeout"),
        (lambda: Wait(then=Wait()), "then"),
        (lambda: Wait(then="queue"), "then"),  # type: ignore[arg-type]
        (lambda: Wait(then="later"), "Wait\\(then=...\\) must be one of"),  # type: ignore[arg-type]
        (lambda: Queue(then="retry"), "Queue\\(then=...\\) must be Skip\\(\\) or Fail\\(\\)"),  # type: ignore[arg-type]
    ],
)
def test_bad_policy_arguments(factory: Any, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        factory()


def test_then_by_name_or_dict_as_in_settings() -> None:
    """``then=`` takes a policy's name or settings dict in code as it does in settings (``Throttle`` did
    already; before, ``Wait(then="retry")`` was refused)."""
    assert Wait(then="retry") == Wait(then=Retry())  # type: ignore[arg-type]
    assert Wait(then=" Skip ") == Wait(then=Skip())  # type: ignore[arg-type]
    assert Wait(then={"policy": "retry", "countdown": 5}) == Wait(then=Retry(countdown=5))  # type: ignore[arg-type]
    assert Queue(then="fail") == Queue(then=Fail())  # type: ignore[arg-type]
    assert Replace(then="skip") == Replace()  # type: ignore[arg-type]


def test_parse_policy_shorthands_and_dicts() -> None:
    assert parse_policy("retry") == Retry()
    assert parse_policy(" SKIP ") == Skip()
    assert parse_policy("wait") == Wait()
    assert parse_policy("fail") == Fail()
    assert parse_policy({"policy": "retry", "countdown": 5}) == Retry(countdown=5)
    assert parse_policy({"policy": "wait", "timeout": 3, "then": "skip"}) == Wait(timeout=3, then=Skip())
    p = Retry(countdown=2)
    assert parse_policy(p) is p
    assert parse_policy("queue") == Queue()
    assert parse_policy("Replace") == Replace()
    assert parse_policy({"policy": "queue", "timeout": 600, "max_length": 10, "then": "fail"}) == Queue(
        timeout=600, max_length=10, then=Fail()
    )
    assert parse_policy({"policy": "replace", "timeout": 5}) == Replace(timeout=5)


def test_queued_tasks_default_to_acks_late() -> None:
    app = Celery(f"q{uuid.uuid4().hex[:6]}", set_as_current=False)

    @singleton_task(app=app, key="k", on_contention=Queue())
    def queued() -> None: ...

    @singleton_task(app=app, key="k", on_contention="replace", acks_late=False)
    def told_otherwise() -> None: ...

    @singleton_task(app=app, key="k", on_contention=Skip())
    def skipped() -> None: ...

    assert queued.acks_late is True
    assert told_otherwise.acks_late is False
    assert skipped.acks_late is app.conf.task_acks_late


def test_a_direct_call_of_a_queued_task_waits_for_the_key_then_its_then() -> None:
    from tests.test_contention import Run

    assert Queue(timeout=1).on_contended(Run(free_after=1)) is TRY_AGAIN
    assert Queue(timeout=1).on_contended(Run()) == ("skipped", "the key was held by another run")
    with pytest.raises(LockContended):
        Replace(timeout=1, then=Fail()).on_contended(Run())


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("later", "must be one of"),
        ({"countdown": 5}, "needs 'policy'"),
        ({"policy": "retry", "countdwn": 5}, "countdwn"),
        (42, "got int"),
    ],
)
def test_parse_policy_errors_name_the_setting(value: Any, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match) as info:
        parse_policy(value, "mongolock_on_contention")
    assert "mongolock_on_contention" in str(info.value)


# -- settings -----------------------------------------------------------------------------------------


def test_defaults() -> None:
    s = read_settings({})
    assert s.url == "mongodb://localhost:27017"
    assert (s.database, s.collection, s.lease_seconds) == ("celery_mongolock", "leases", 30.0)
    assert s.on_contention == Retry()
    opts = s.for_task("t")
    assert opts.lease_seconds == 30 and opts.heartbeat_seconds == 10


def test_precedence_per_task_settings_beat_decorator_beat_global() -> None:
    s = read_settings(
        {
            "mongolock_on_contention": "fail",
            "mongolock_lease_seconds": 20,
            "mongolock_task_policies": {"a": {"on_contention": "skip", "lease_seconds": 60}, "b": "wait"},
        }
    )
    assert s.for_task("x").on_contention == Fail()
    assert s.for_task("x", on_contention=Retry()).on_contention == Retry()
    a = s.for_task("a", on_contention=Retry(), lease_seconds=5)
    assert a.on_contention == Skip() and a.lease_seconds == 60 and a.heartbeat_seconds == 20
    assert s.for_task("b").on_contention == Wait()
    assert s.for_task("x", lease_seconds=9).heartbeat_seconds == 3


def test_django_style_upper_case_settings() -> None:
    app = Celery("django_style", set_as_current=False)

    class Settings:
        CELERY_MONGOLOCK_URL = "mongodb://db.example:27017"
        CELERY_MONGOLOCK_LEASE_SECONDS = 12

    app.config_from_object(Settings, namespace="CELERY")
    s = read_settings(app.conf)
    assert s.url == "mongodb://db.example:27017" and s.lease_seconds == 12


@pytest.mark.parametrize(
    ("conf", "setting"),
    [
        ({"mongolock_url": "localhost"}, "mongolock_url"),
        ({"mongolock_url": "mongodb://u:pw@h:notaport"}, "mongolock_url"),
        ({"mongolock_database": ""}, "mongolock_database"),
        ({"mongolock_database": "a.b"}, "mongolock_database"),
        ({"mongolock_collection": "$x"}, "mongolock_collection"),
        ({"mongolock_lease_seconds": -5}, "mongolock_lease_seconds"),
        ({"mongolock_lease_seconds": "30"}, "mongolock_lease_seconds"),
        ({"mongolock_lease_seconds": 10, "mongolock_heartbeat_seconds": 9}, "heartbeat_seconds"),
        ({"mongolock_on_contention": "sometimes"}, "mongolock_on_contention"),
        ({"mongolock_operation_timeout": 0}, "mongolock_operation_timeout"),
        ({"mongolock_task_policies": ["a"]}, "mongolock_task_policies"),
        ({"mongolock_task_policies": {"t": {"bogus": 1}}}, "mongolock_task_policies['t']"),
        ({"mongolock_task_policies": {"t": {"on_contention": "nope"}}}, "mongolock_task_policies['t']"),
        ({"mongolock_task_policies": {"t": {"lease_seconds": 2, "heartbeat_seconds": 5}}}, "task 't'"),
    ],
)
def test_invalid_settings_name_the_setting(conf: dict[str, Any], setting: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        read_settings(conf)
    assert setting in str(info.value)
    assert "pw@" not in str(info.value)


def _django_conf(**settings: Any) -> Any:
    """``app.conf`` of an app configured as Django projects do (``namespace="CELERY"``)."""
    app = Celery("django_typos", set_as_current=False)
    app.config_from_object(type("Settings", (), settings), namespace="CELERY")
    return app.conf


def _plain_conf(**settings: Any) -> Any:
    app = Celery("plain_typos", set_as_current=False)
    app.conf.update(settings)
    return app.conf


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        (
            _django_conf(CELERY_MONGOLOCK_LEASE_SECOND=60),
            "unknown setting 'CELERY_MONGOLOCK_LEASE_SECOND'; did you mean 'CELERY_MONGOLOCK_LEASE_SECONDS'?",
        ),
        (
            _django_conf(CELERY_MONGOLOCK_ON_CONTENTON="skip"),
            "unknown setting 'CELERY_MONGOLOCK_ON_CONTENTON'; did you mean 'CELERY_MONGOLOCK_ON_CONTENTION'?",
        ),
        (
            _plain_conf(mongolock_lease_second=60),
            "unknown setting 'mongolock_lease_second'; did you mean 'mongolock_lease_seconds'?",
        ),
        (
            _plain_conf(MONGOLOCK_BEAT_LEASE_SECOND=5),
            "unknown setting 'MONGOLOCK_BEAT_LEASE_SECOND'; did you mean 'MONGOLOCK_BEAT_LEASE_SECONDS'?",
        ),
        ({"mongolock_qwfpgjy": 1}, "unknown setting 'mongolock_qwfpgjy'; the settings are mongolock_url, "),
        (
            _plain_conf(CELERY_MONGOLOCK_LEASE_SECONDS=60),
            "setting 'CELERY_MONGOLOCK_LEASE_SECONDS' is not read: this app has no 'CELERY' namespace; "
            "name it 'mongolock_lease_seconds'",
        ),
        (
            _plain_conf(Mongolock_Lease_Seconds=60),
            "setting 'Mongolock_Lease_Seconds' is not read: write it 'mongolock_lease_seconds'",
        ),
    ],
    ids=["django-lease", "django-policy", "plain", "beat", "no-close-name", "no-namespace", "mixed-case"],
)
def test_a_misspelt_setting_is_refused_with_the_closest_name(conf: Any, message: str) -> None:
    """Issue 27: a ``mongolock_*`` name the library does not read is refused, not silently ignored (the
    worker and beat read the settings at start, so they refuse to start)."""
    with pytest.raises(ConfigurationError) as info:
        read_settings(conf)
    assert str(info.value).startswith(message)


def test_known_settings_in_any_spelling_the_library_reads_are_accepted() -> None:
    s = read_settings(
        _django_conf(
            CELERY_MONGOLOCK_LEASE_SECONDS=60,
            CELERY_MONGOLOCK_ON_CONTENTION="skip",
            CELERY_MONGOLOCK_BEAT_KEY="beat:one",
            DEBUG=True,  # Django's own settings are not ours to judge
        )
    )
    assert s.lease_seconds == 60 and s.on_contention == Skip()
    plain = read_settings(_plain_conf(MONGOLOCK_LEASE_SECONDS=12, mongolock_history_days=0))
    assert plain.lease_seconds == 12 and plain.history_days == 0


@pytest.mark.parametrize(
    ("value", "hint"),
    [("replac", "'replace'"), ("skipp", "'skip'"), ("Qeue", "'queue'"), ({"policy": "retyr"}, "'retry'")],
)
def test_a_misspelt_policy_name_gets_a_did_you_mean(value: Any, hint: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_policy(value, "mongolock_on_contention")
    assert str(info.value).endswith(f"(did you mean {hint}?)")


# -- key specs ------------------------------------------------------------------------------------------


def upload(group_id: int, path: str = "members.csv", *, dry_run: bool = False) -> None: ...


def test_template_key_binds_args_kwargs_and_defaults_alike() -> None:
    r = KeyRenderer("email-group:{group_id}", upload, "app.upload")
    assert r.render((42,), {}) == r.render((), {"group_id": 42}) == "email-group:42"
    assert KeyRenderer("g:{group_id}:{path}", upload, "t").render((1,), {}) == "g:1:members.csv"


def test_argument_name_keys_are_prefixed_with_the_task_name() -> None:
    assert KeyRenderer("group_id", upload, "app.upload").render((7,), {}) == "app.upload:7"
    assert (
        KeyRenderer(["group_id", "path"], upload, "app.upload").render((7, "a.csv"), {})
        == "app.upload:7:a.csv"
    )


def test_a_bare_name_is_a_fixed_key_for_a_task_without_arguments() -> None:
    def digest() -> None: ...

    assert KeyRenderer("digest", digest, "app.digest").render((), {}) == "digest"


def test_none_and_fixed_keys() -> None:
    assert KeyRenderer(None, upload, "app.upload").render((1,), {}) == "app.upload"
    assert KeyRenderer("nightly-report", upload, "app.upload").render((1,), {}) == "nightly-report"


def test_callable_keys_get_the_task_arguments() -> None:
    r = KeyRenderer(lambda group_id, **_: f"tenant:{group_id % 10}", upload, "t")
    assert r.render((42,), {"path": "x"}) == "tenant:2"
    assert KeyRenderer(lambda *a, **k: 5, upload, "t").render((1,), {}) == "5"


def test_canonical_encoding() -> None:
    u = uuid.UUID("12345678-1234-5678-1234-567812345678")
    oid = ObjectId("5f0c8e5e8e4b3a2b1c0d0e0f")
    assert encode_value(u) == "12345678-1234-5678-1234-567812345678"
    assert encode_value(oid) == "5f0c8e5e8e4b3a2b1c0d0e0f"
    assert (
        encode_value({"b": 2, "a": [1, "x"]})
        == encode_value({"a": [1, "x"], "b": 2})
        == '{"a":[1,"x"],"b":2}'
    )
    assert encode_value([]) == "[]"
    assert encode_value(True) == "true"
    assert encode_value(None) == "null"
    assert encode_value({"id": u}) == '{"id":"12345678-1234-5678-1234-567812345678"}'


@pytest.mark.parametrize("value", [1.5, b"bytes", object(), {1: "x"}, {"a": 1.5}])
def test_values_without_a_canonical_text_are_refused(value: Any) -> None:
    with pytest.raises(InvalidKey, match="group_id"):
        KeyRenderer("g:{group_id}", upload, "t").render((value,), {})


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("email-group:{gid}", "'gid', which is not an argument of upload"),
        ("group_idd", "'group_idd' is not an argument"),
        (["group_id", "nope"], "'nope'"),
        ([], "at least one"),
        ("", "must not be empty"),
        ("g:{group_id.attr}", "plain argument name"),
        ("g:{0}", "plain argument name"),
        ("g:{group_id!r}", "conversion"),
        ("g:{group_id:>5}", "format spec"),
        ("g:{group_id", "malformed"),
        (42, "got int"),
    ],
)
def test_key_spec_mistakes_fail_at_declaration(spec: Any, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        KeyRenderer(spec, upload, "t")


def test_decorator_reports_mistakes_at_decoration_time() -> None:
    app = Celery("decl", set_as_current=False)
    with pytest.raises(ConfigurationError, match="not an argument"):

        @singleton_task(key="email-group:{gid}", app=app)
        def bad(group_id: int) -> None: ...

    with pytest.raises(ConfigurationError, match="on_contention"):

        @singleton_task(on_contention="sometimes", app=app)
        def bad2() -> None: ...

    with pytest.raises(ConfigurationError, match="heartbeat_seconds"):

        @singleton_task(lease_seconds=10, heartbeat_seconds=8, app=app)
        def bad3() -> None: ...


def test_bound_tasks_key_on_the_arguments_after_self() -> None:
    app = Celery("bound", set_as_current=False)

    @singleton_task(key="g:{group_id}", app=app, bind=True)
    def task(self: Any, group_id: int) -> None: ...

    assert task.mongolock_key_for(5) == "g:5"
    assert task.mongolock_key_for(group_id=5) == "g:5"


def test_limit_from_the_decorator_a_class_attribute_or_the_settings() -> None:
    from celery_mongolock import SingletonTask
    from celery_mongolock.config import get_settings

    app = Celery(f"l{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.mongolock_task_policies = {"proj.by_setting": {"limit": 5}}

    @singleton_task(app=app, key="tenant:{tenant}", limit=3, name="proj.by_decorator")
    def by_decorator(tenant: str) -> None: ...

    @app.task(base=SingletonTask, mongolock_key="tenant:{tenant}", mongolock_limit=4, name="proj.by_class")
    def by_class(tenant: str) -> None: ...

    @singleton_task(app=app, key="tenant:{tenant}", limit=3, name="proj.by_setting")
    def by_setting(tenant: str) -> None: ...

    app.finalize()
    settings = get_settings(app)
    assert app.tasks["proj.by_decorator"]._options().limit == 3
    assert app.tasks["proj.by_class"]._options().limit == 4
    assert app.tasks["proj.by_setting"]._options().limit == 5  # per-task settings beat the decorator
    assert settings.for_task("other", limit=1).limit is None  # limit=1: a single lease
