"""The testing how-to's recipe (docs/how-to/testing.md, "testing your own tasks") works as written."""

from __future__ import annotations

from typing import Any

from celery import Celery

from celery_mongolock import LockContended, singleton_task
from celery_mongolock.testing import configure, holding


def test_readme_recipe(mongo_url: str, db_name: str) -> None:
    app = Celery("recipe", set_as_current=False)

    @singleton_task(key="email-group:{group_id}", app=app)
    def upload_members(group_id: int, path: str) -> str:
        return f"uploaded {path}"

    configure(app, mongo_url, database=db_name, mongolock_on_contention="fail")
    try:
        with holding(app, "email-group:42"):
            result: Any = upload_members.apply(args=(42, "a.csv"))
        assert result.failed()
        assert isinstance(result.result, LockContended)
        assert upload_members.apply(args=(42, "a.csv")).get() == "uploaded a.csv"
    finally:
        app._mongolock_store.client.drop_database(db_name)
        configure(app, mongo_url)


def test_configure_undoes_what_an_earlier_configure_set(mongo_url: str, db_name: str) -> None:
    """Each test starts from the app's own configuration (a new user's trial, stop 55: a policy one test
    gave ``configure`` stayed in force in the next test, which gave none)."""
    app = Celery("cfg", set_as_current=False)
    app.conf.mongolock_lease_seconds = 7
    app.conf.mongolock_task_policies = {"own.task": {"on_contention": "skip"}}
    configure(app, mongo_url, database=db_name, mongolock_task_policies={"t": {"on_contention": "fail"}})
    assert app.conf.mongolock_task_policies == {"t": {"on_contention": "fail"}}
    configure(app, mongo_url, database=db_name, mongolock_history_days=3)
    assert app.conf.mongolock_task_policies == {"own.task": {"on_contention": "skip"}}  # the app's own
    assert app.conf.mongolock_history_days == 3 and app.conf.mongolock_lease_seconds == 7
    configure(app, mongo_url, database=db_name)
    assert app.conf.get("mongolock_history_days") is None  # set by a configure only: gone
