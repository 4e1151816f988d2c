"""Settings for the example app (a Celery config module; Django users would put CELERY_* in settings.py).

Everything comes from the environment so the demo can point it at embedded or real services.
"""

from __future__ import annotations

import os

from celery_mongolock import Retry, Skip

MONGO_URL = os.environ.get("EMAILGROUPS_MONGO_URL", "mongodb://localhost:27017")
DATABASE = os.environ.get("EMAILGROUPS_DATABASE", "emailgroups")

broker_url = os.environ.get("EMAILGROUPS_BROKER_URL", "redis://localhost:6379/0")
result_backend = os.environ.get("EMAILGROUPS_RESULT_BACKEND") or broker_url
if broker_url.startswith(("amqp", "pyamqp")):
    # RabbitMQ: publisher confirms, so that a retry or handoff published just before the broker goes down
    # is not lost unseen (Celery's queues are durable and its messages persistent by default).
    broker_transport_options = {"confirm_publish": True}
broker_connection_retry_on_startup = True
task_acks_late = True  # a killed worker's upload is redelivered, and its lease is released at once
task_reject_on_worker_lost = True
worker_prefetch_multiplier = 1
worker_hijack_root_logger = False

# -- celery_mongolock -------------------------------------------------------------------------------------
mongolock_url = MONGO_URL
mongolock_database = DATABASE
mongolock_lease_seconds = float(os.environ.get("EMAILGROUPS_LEASE_SECONDS", "10"))
mongolock_on_contention = Retry(countdown=0.5, backoff=1.5, max_countdown=5)
mongolock_task_policies: dict[str, dict[str, object]] = {
    # The digest is sent every tick: if the previous one is still running, skip rather than queue up.
    "emailgroups.tasks.send_digest": {"on_contention": Skip()},
}
# The uploads use Replace and the postings Queue (in tasks.py). The demo can run them with another policy
# (`demo.py --upload-policy retry`) to show which invariants that breaks.
for _task, _variable in (
    ("emailgroups.tasks.upload_members", "EMAILGROUPS_UPLOAD_POLICY"),
    ("emailgroups.tasks.post_to_ledger", "EMAILGROUPS_LEDGER_POLICY"),
):
    if os.environ.get(_variable):
        mongolock_task_policies[_task] = {"on_contention": os.environ[_variable]}

# -- beat: run two or more `celery beat -S celery_mongolock.beat:Scheduler` ----------------------------------
beat_scheduler = "celery_mongolock.beat:Scheduler"
beat_max_loop_interval = 1
mongolock_beat_lease_seconds = float(os.environ.get("EMAILGROUPS_BEAT_LEASE_SECONDS", "4"))
beat_schedule = {
    "digest": {
        "task": "emailgroups.tasks.send_digest",
        "schedule": float(os.environ.get("EMAILGROUPS_DIGEST_EVERY", "2")),
    },
}
