"""Broker settings checked at worker start: on RabbitMQ, a warning in our words for each setting with which
a singleton run can be lost (acks_late off, no reject-on-worker-lost, no publisher confirms, transient
messages, queues that are not durable); none with the recommended settings, none on Redis. Then a real
worker on a real RabbitMQ node, started with and without publisher confirms."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu import entity

from celery_mongolock import singleton_task
from celery_mongolock.integration.task import _check_broker_settings

from .servers import RabbitMQServer
from .workers import Worker, worker_env

RECOMMENDED: dict[str, Any] = {
    "task_acks_late": True,
    "task_reject_on_worker_lost": True,
    "broker_transport_options": {"confirm_publish": True},
}


def app_with(broker: str, *, upload_rejects: bool = True, sync_late: bool = False, **conf: Any) -> Celery:
    """An app with two singleton tasks: ``<app>.upload`` (the app's settings; ``upload_rejects=False``: no
    reject-on-worker-lost of its own) and ``<app>.sync`` (``acks_late=sync_late`` of its own)."""
    app = Celery(f"brokers_{uuid.uuid4().hex[:6]}", broker=broker, set_as_current=False)
    app.conf.update(mongolock_url="mongodb://127.0.0.1:1", **conf)
    extra: dict[str, Any] = {} if upload_rejects else {"reject_on_worker_lost": False}

    @singleton_task(app=app, name=f"{app.main}.upload", key="group:{group_id}", **extra)
    def upload(group_id: int) -> None:
        pass

    @singleton_task(app=app, name=f"{app.main}.sync", key="tenant:{tenant}", acks_late=sync_late)
    def sync(tenant: str) -> None:
        pass

    return app


def warnings_for(app: Celery, caplog: pytest.LogCaptureFixture) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="celery_mongolock.acquire"):
        problems = _check_broker_settings(app)
    logged = [r.getMessage() for r in caplog.records if "on RabbitMQ" in r.getMessage()]
    assert len(logged) == len(problems)
    return problems


def test_each_setting_that_can_lose_a_run_on_rabbitmq_is_named(caplog: pytest.LogCaptureFixture) -> None:
    app = app_with(
        "amqp://guest:guest@127.0.0.1:1//",
        upload_rejects=False,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_default_delivery_mode="transient",
        task_queues=[entity.Queue("fragile", durable=False)],  # type: ignore[no-untyped-call]
    )
    problems = warnings_for(app, caplog)
    late = next(p for p in problems if p.startswith("task_acks_late is off for"))
    assert f"{app.main}.sync" in late and f"{app.main}.upload" not in late
    rejects = next(p for p in problems if p.startswith("task_reject_on_worker_lost is off for"))
    assert f"{app.main}.upload" in rejects and f"{app.main}.sync" not in rejects  # sync: not acks_late
    text = "\n".join(problems)
    assert "no confirm_publish=True" in text
    assert "task_default_delivery_mode is transient" in text
    assert "queue(s) fragile not durable" in text
    assert len(problems) == 5


def test_the_recommended_settings_get_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    app = app_with("pyamqp://guest:guest@127.0.0.1:1//", sync_late=True, **RECOMMENDED)
    # Celery's app.task is shared by default: other tests' apps' tasks are registered here too.
    problems = [p for p in warnings_for(app, caplog) if "is off for" not in p or app.main in p]
    assert problems == []


def test_redis_gets_no_rabbitmq_warning(caplog: pytest.LogCaptureFixture) -> None:
    app = app_with("redis://127.0.0.1:1/0", task_default_delivery_mode="transient")
    assert warnings_for(app, caplog) == []


@pytest.mark.slow
def test_a_real_worker_on_rabbitmq_warns_only_without_confirms(
    rabbitmq_server: RabbitMQServer, mongo_url: str, tmp_path: Path
) -> None:
    """The integration app's workers on RabbitMQ (acks_late, reject_on_worker_lost, confirms): no warning;
    the same without publisher confirms: the warning, and the worker runs all the same."""
    db = f"mongolock_brokers_{uuid.uuid4().hex[:8]}"
    for confirms, expect_warning in (("1", False), ("0", True)):
        env = worker_env(
            rabbitmq_server.url,
            mongo_url,
            db,
            tmp_path,
            MONGOLOCK_IT_CONFIRM=confirms,
            MONGOLOCK_IT_BACKEND="cache+memory://",
        )
        w = Worker(
            env, tmp_path, name=f"b{confirms}{uuid.uuid4().hex[:4]}@localhost", extra_args=["-Q", "bq"]
        )
        try:
            w.start()  # ready: its start-up checks have run
            assert "celery_mongolock: leases in" in w.log()
            assert ("no confirm_publish=True" in w.log()) is expect_warning, w.log()
            assert "task_acks_late is off" not in w.log()
        finally:
            w.stop()
