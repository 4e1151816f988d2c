"""The import paths users rely on (README, example project, settings such as ``beat_scheduler``) keep
working whatever the modules inside look like."""

from __future__ import annotations

import importlib

import pytest

import celery_mongolock

PATHS = [
    "celery_mongolock.beat:Scheduler",
    "celery_mongolock.beat:BEAT_HEADER",
    "celery_mongolock.signals:lease_acquired",
    "celery_mongolock.signals:lease_contended",
    "celery_mongolock.signals:lease_released",
    "celery_mongolock.signals:lease_lost",
    "celery_mongolock.testing:configure",
    "celery_mongolock.testing:holding",
    "celery_mongolock.testing:RedisServer",
    "celery_mongolock.fencing:fenced_update_one",
    "celery_mongolock.fencing:FencedOut",
    "celery_mongolock.store:LeaseStore",
    "celery_mongolock.store:Lease",
    "celery_mongolock.store:LeaseInfo",
    "celery_mongolock.store:DEFAULT_LEASE_SECONDS",
    "celery_mongolock.task:SingletonTask",
    "celery_mongolock.task:SingletonRequest",
    "celery_mongolock.task:singleton_task",
    "celery_mongolock.task:current_lease",
    "celery_mongolock.task:REPUBLISH_RETRY_POLICY",
    "celery_mongolock.config:read_settings",
    "celery_mongolock.config:get_store",
    "celery_mongolock.policies:parse_policy",
    "celery_mongolock.cli:mongolock",
    "celery_mongolock:DocumentLock",
    "celery_mongolock:DocumentLockLost",
    "celery_mongolock:DocumentMissing",
]


@pytest.mark.parametrize("path", PATHS)
def test_public_path_imports(path: str) -> None:
    module, name = path.split(":")
    assert getattr(importlib.import_module(module), name) is not None


def test_everything_in_all_is_there() -> None:
    for name in celery_mongolock.__all__:
        assert getattr(celery_mongolock, name) is not None, name


def test_the_task_request_path_resolves_to_the_singleton_request() -> None:
    from celery.utils.imports import symbol_by_name

    from celery_mongolock.task import SingletonRequest, SingletonTask

    assert symbol_by_name(SingletonTask.Request) is SingletonRequest
    from celery.beat import Scheduler as CeleryScheduler

    from celery_mongolock.ops.beat import Scheduler

    public = symbol_by_name("celery_mongolock.beat:Scheduler")
    assert public is Scheduler and issubclass(public, CeleryScheduler)
