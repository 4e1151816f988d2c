"""The lock-set checker's bounded run on RabbitMQ (tests/lockcheck.py, ``Config(broker="rabbitmq")``): every
fault, the broker crashed and stopped on its data included, with durable queues, persistent messages,
publisher confirms and ``acks_late``. No violation, and no task unfinished: on RabbitMQ no loss is excused.

Its own file, so that ``make test``'s two processes can run it beside the Redis run. Many seeds:
``scripts/soak.py --bounded --seeds 10 --broker rabbitmq``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from . import lockcheck
from .lockcheck import Config
from .servers import NO_RABBITMQ

pytestmark = [pytest.mark.lockcheck, pytest.mark.skipif(bool(NO_RABBITMQ), reason=NO_RABBITMQ)]


@pytest.mark.timeout(lockcheck.DRAIN_GUARD_S + 2 * lockcheck.START_GUARD_S)
def test_bounded_run_on_rabbitmq_loses_nothing(tmp_path: Path) -> None:
    seed = int(os.environ.get("LOCKCHECK_SEED", "1"))
    report = lockcheck.run(Config(duration=70.0, seed=seed, workdir=tmp_path, broker="rabbitmq"))
    print(lockcheck.format_report(report))
    assert report["broker"] == "rabbitmq"
    assert report["violations"] == 0, lockcheck.format_report(report)
    ops, tasks = report["operations"], report["tasks"]
    assert ops["unexpected_exceptions"] == 0, lockcheck.format_report(report)
    assert tasks["unfinished"] == 0 and tasks["lost_by_broker"] == 0, lockcheck.format_report(report)
    assert report["faults"].get("broker-restart", 0) >= 1, report["faults"]
    unmet = lockcheck.unmet_coverage(report)
    assert unmet == [], unmet
