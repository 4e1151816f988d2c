"""Declaring a singleton task: every spelling is checked when the task is declared (issue 14, 1-3).

Pure logic, no server: callable keys get the bound arguments; ``@app.task(base=SingletonTask, ...)`` is
checked at class creation (``app.finalize()`` for a lazily declared task) as ``@singleton_task`` is;
misspelt and planned options are refused with a suggestion; Celery's own options pass through.
"""

from __future__ import annotations

import sys
import uuid
from typing import Any

import pytest
from celery import Celery

from celery_mongolock import ConfigurationError, InvalidKey, SingletonTask, Skip, singleton_task
from celery_mongolock.integration.options import _celery_names


def tenant_of(group_id: int) -> int:
    return group_id % 10


def upload_members(group_id: int, csv_path: str, batch: int = 100) -> None:
    """The README's task."""


def new_app() -> Celery:
    return Celery(f"decl{uuid.uuid4().hex[:6]}", set_as_current=False)


def declare(key: Any, **options: Any) -> Any:
    # shared=False: a shared task is created in every app finalized later in this process.
    options.setdefault("shared", False)
    return singleton_task(key=key, app=new_app(), name="proj.upload_members", **options)(upload_members)


# -- 1. callable keys get the bound arguments --------------------------------------------------------------


def test_the_readme_callable_key_works_for_positional_and_keyword_calls() -> None:
    task = declare(lambda group_id, **_: f"tenant:{tenant_of(group_id)}")
    assert task.mongolock_key_for(42, "a.csv") == "tenant:2"
    assert task.mongolock_key_for(group_id=42, csv_path="a.csv") == "tenant:2"
    assert task.mongolock_key_for(42, csv_path="a.csv", batch=5) == "tenant:2"


def test_a_callable_key_gets_defaults_applied() -> None:
    task = declare(lambda group_id, csv_path, batch: f"{group_id}:{csv_path}:{batch}")
    assert task.mongolock_key_for(1, "a.csv") == task.mongolock_key_for(group_id=1, csv_path="a.csv")
    assert task.mongolock_key_for(1, "a.csv") == "1:a.csv:100"


def test_bound_tasks_key_callables_do_not_get_the_task() -> None:
    def body(self: Any, group_id: int, csv_path: str = "x") -> None: ...

    task = singleton_task(
        key=lambda group_id, **_: f"g:{group_id}", app=new_app(), name="proj.bound", bind=True, shared=False
    )(body)
    assert task.mongolock_key_for(7, "y") == task.mongolock_key_for(group_id=7) == "g:7"


def test_positional_only_and_var_arguments_are_passed_as_the_task_takes_them() -> None:
    def body(a: int, /, *rest: int, **extra: int) -> None: ...

    task = singleton_task(
        key=lambda a, /, *rest, **extra: f"{a}:{rest}:{sorted(extra)}",
        app=new_app(),
        name="proj.varargs",
        shared=False,
    )(body)
    assert task.mongolock_key_for(1, 2, 3, z=4) == "1:(2, 3):['z']"


@pytest.mark.parametrize(
    "key",
    [lambda x, y, z: "k", lambda: "k", lambda group_id: "k", lambda *, tenant: "k"],
    ids=["unrelated", "no-parameters", "too-few", "keyword-only-unknown"],
)
def test_a_callable_that_cannot_take_the_arguments_is_refused_at_declaration(key: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"cannot take the arguments of upload_members\("):
        declare(key)


def test_a_task_taking_kwargs_refuses_at_call_time_with_a_key_error() -> None:
    def body(**fields: Any) -> None: ...

    task = singleton_task(
        key=lambda group_id, **_: f"g:{group_id}", app=new_app(), name="proj.kw", shared=False
    )(body)
    assert task.mongolock_key_for(group_id=3) == "g:3"
    with pytest.raises(InvalidKey, match="cannot take this call's arguments"):
        task.mongolock_key_for(other=3)


def test_an_error_inside_a_key_callable_keeps_its_type_and_says_where_it_came_from() -> None:
    def tenant_lookup(group_id: int, **_: Any) -> str:
        raise LookupError(f"no tenant for group {group_id}")

    task = declare(tenant_lookup)
    with pytest.raises(LookupError, match="no tenant for group 42") as info:
        task.mongolock_key_for(42, "a.csv")
    if sys.version_info >= (3, 11):
        notes = getattr(info.value, "__notes__", [])
        assert any("raised by the key callable tenant_lookup(" in n and "did not run" in n for n in notes)


# -- 2. @app.task(base=SingletonTask, mongolock_...) is checked like @singleton_task ------------------------


def declare_with_app_task(**attrs: Any) -> Celery:
    app = new_app()
    # shared=False: a shared task that cannot be created would break every app finalized later here.
    app.task(base=SingletonTask, name="proj.g", shared=False, **attrs)(upload_members)
    return app


@pytest.mark.parametrize(
    ("attrs", "match"),
    [
        ({"mongolock_key": "email-group:{gid}"}, "'gid', which is not an argument of upload_members"),
        ({"mongolock_key": "gid"}, "'gid' is not an argument"),
        ({"mongolock_key": lambda x, y, z: "k"}, "cannot take the arguments"),
        ({"mongolock_on_contention": "skipp"}, "mongolock_on_contention must be one of"),
        ({"mongolock_lease_seconds": 1, "mongolock_heartbeat_seconds": 5}, "at most half"),
        ({"mongolock_min_hold_seconds": -1}, "min_hold_seconds"),
    ],
    ids=["template", "name", "callable", "policy", "timing", "min-hold"],
)
def test_app_task_spelling_is_checked_at_finalize(attrs: dict[str, Any], match: str) -> None:
    app = declare_with_app_task(**attrs)
    with pytest.raises(ConfigurationError, match=match):
        app.finalize()


def test_app_task_spelling_on_a_finalized_app_is_checked_at_once() -> None:
    app = new_app()
    app.finalize()
    with pytest.raises(ConfigurationError, match="'gid'"):
        app.task(base=SingletonTask, name="proj.g", mongolock_key="g:{gid}", shared=False)(upload_members)


def test_a_good_app_task_declaration_works() -> None:
    app = declare_with_app_task(
        mongolock_key=lambda group_id, **_: f"tenant:{tenant_of(group_id)}", mongolock_on_contention="skip"
    )
    app.finalize()
    task = app.tasks["proj.g"]
    assert task.mongolock_key_for(42, "a.csv") == "tenant:2"


def test_a_class_based_singleton_task_is_checked_when_the_class_is_created() -> None:
    with pytest.raises(ConfigurationError, match="'gid'"):

        class Bad(SingletonTask):  # pragma: no cover - never created
            mongolock_key = "g:{gid}"

            def run(self, group_id: int) -> None: ...

    class Good(SingletonTask):
        mongolock_key = "g:{group_id}"
        mongolock_on_contention = Skip()

        def run(self, group_id: int) -> None: ...

    assert Good.mongolock_key == "g:{group_id}"


# -- 3. misspelt, unknown and planned options --------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"lease_second": 60}, "unknown option lease_second=; did you mean lease_seconds=?"),
        ({"on_contension": "skip"}, "unknown option on_contension=; did you mean on_contention=?"),
        ({"heartbeat_second": 5}, "did you mean heartbeat_seconds=?"),
        ({"min_hold_second": 5}, "did you mean min_hold_seconds=?"),
        ({"keyy": "g"}, "did you mean key=?"),
        ({"mongolock_key": "g"}, "without the mongolock_ prefix, got mongolock_key=; did you mean key=?"),
        (
            {"mongolock_keys": ("a",)},
            "without the mongolock_ prefix, got mongolock_keys=; did you mean keys=?",
        ),
    ],
)
def test_singleton_task_refuses_misspelt_and_planned_options(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match.replace("?", r"\?").replace("(", r"\(")):
        declare("g:{group_id}", **options)


def test_no_option_is_planned_any_more() -> None:
    from celery_mongolock.integration.options import FUTURE_OPTIONS

    assert FUTURE_OPTIONS == {}  # limit= and keys= exist now


@pytest.mark.parametrize(
    ("attrs", "match"),
    [
        ({"mongolock_lease_second": 60}, "unknown option mongolock_lease_second; did you mean mongolock_lease_seconds?"),  # noqa: E501
        ({"mongolock_on_contension": "skip"}, "did you mean mongolock_on_contention?"),
        ({"mongolock_whatever": 1}, "unknown option mongolock_whatever; known: mongolock_key"),
        ({"key": "g:{group_id}"}, "key is not read on a SingletonTask; did you mean mongolock_key?"),
        ({"on_contention": "skip"}, "did you mean mongolock_on_contention?"),
        ({"lease_second": 3}, "did you mean mongolock_lease_seconds?"),
    ],
)  # fmt: skip
def test_singleton_task_subclasses_refuse_unknown_options(attrs: dict[str, Any], match: str) -> None:
    app = declare_with_app_task(mongolock_key="g:{group_id}", **attrs)
    with pytest.raises(ConfigurationError, match=match.replace("?", r"\?")):
        app.finalize()


def test_a_subclass_may_have_attributes_of_its_own_even_named_like_planned_options() -> None:
    # Unprefixed ``limit`` and ``keys`` belong to the task (ours are mongolock_limit, mongolock_keys).
    app = declare_with_app_task(mongolock_key="g:{group_id}", limit=100, keys=("a",), page_size=5)
    app.finalize()
    assert app.tasks["proj.g"].limit == 100


def test_celerys_own_options_and_custom_attributes_pass_through() -> None:
    options = {
        "acks_late": True,
        "max_retries": 3,
        "rate_limit": "10/m",
        "ignore_result": True,
        "soft_time_limit": 60,
        "time_limit": 90,
        "autoretry_for": (ValueError,),
        "retry_backoff": True,
        "serializer": "json",
        "reject_on_worker_lost": True,
        "my_custom_attribute": "kept",
    }
    task = declare("g:{group_id}", **options)
    assert task.acks_late is True and task.max_retries == 3 and task.my_custom_attribute == "kept"
    app = declare_with_app_task(mongolock_key="g:{group_id}", **options)
    app.finalize()
    assert app.tasks["proj.g"].rate_limit == "10/m"


def test_the_celery_names_come_from_the_installed_celery() -> None:
    from celery import Task

    names = _celery_names()
    assert {"acks_late", "max_retries", "rate_limit", "autoretry_for", "bind", "base", "shared"} <= names
    assert {n for n in dir(Task) if not n.startswith("_")} <= names
    # None of ours is a Celery option, so none of them is passed through unchecked.
    assert not {"key", "on_contention", "lease_seconds", "heartbeat_seconds", "limit", "keys"} & names


# -- 6. inside a running task: self.lease is never None there, and says why elsewhere -----------------------


def test_self_lease_inside_and_outside_a_singleton_run(mongo_url: str, db_name: str) -> None:
    from celery_mongolock import current_lease
    from celery_mongolock.testing import configure

    app = new_app()
    configure(app, mongo_url, database=db_name)
    seen: list[Any] = []

    @singleton_task(key="email-group:{group_id}", app=app, bind=True, name="proj.upload", shared=False)
    def upload(self: Any, group_id: int) -> int:
        self.lease.raise_if_lost()
        seen.append((self.lease.key, self.lease is current_lease()))
        return int(self.lease.fence)

    try:
        assert upload(42) > 0  # a direct call takes the lease
        assert upload.apply(args=(43,)).get() > 0  # so does apply()
        assert seen == [("email-group:42", True), ("email-group:43", True)]
        assert current_lease() is None  # outside any singleton task
        with pytest.raises(RuntimeError, match=r"self\.lease is set only while the task's body runs"):
            upload.lease  # noqa: B018
        with pytest.raises(RuntimeError, match=r"task\.run\(\.\.\.\)\) takes no lease"):
            upload.run(44)
    finally:
        app._mongolock_store.client.drop_database(db_name)
        app._mongolock_store.close()
