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
