"""The example's tasks."""

from __future__ import annotations

import csv
import time
from typing import Any

from celery_mongolock import current_lease, singleton_task
from celery_mongolock.fencing import fenced_update_one

from .celery import app
from .storage import db, log_run

BATCH = 5


@singleton_task(key="email-group:{group_id}", app=app, bind=True)
def upload_members(self: Any, group_id: int, upload_id: str, csv_path: str) -> int:
    """Replace email group ``group_id``'s members with the addresses in ``csv_path``.

    Clear the group, then add the members in batches. Two uploads for one group never overlap (the
    lease), and a holder that lost its lease while paused cannot write over a newer upload (the fence).
    """
    lease = current_lease()
    assert lease is not None
    log_run(
        "start", key=lease.key, group=group_id, upload=upload_id, fence=lease.fence, task_id=self.request.id
    )
    groups, members = db()["groups"], db()["members"]
    # Fenced write: claim the group for this run's fence. A holder that was paused past its lease and
    # wakes up after a newer upload began gets FencedOut here instead of clearing the newer members.
    fenced_update_one(
        groups, {"_id": group_id}, {"$set": {"upload": upload_id, "state": "uploading"}}, lease, upsert=True
    )
    members.delete_many({"group": group_id})
    with open(csv_path, newline="") as f:
        emails = [row["email"] for row in csv.DictReader(f)]
    for i in range(0, len(emails), BATCH):
        lease.raise_if_lost()  # stop promptly if the lease was lost
        members.insert_many(
            [{"group": group_id, "email": e, "upload": upload_id} for e in emails[i : i + BATCH]]
        )
        time.sleep(0.05)  # a slow downstream system, so that uploads visibly overlap in time
    groups.update_one(
        {"_id": group_id, "fence": lease.fence}, {"$set": {"state": "done", "size": len(emails)}}
    )
    log_run(
        "end", key=lease.key, group=group_id, upload=upload_id, fence=lease.fence, task_id=self.request.id
    )
    return len(emails)


@singleton_task(key="digest", app=app, bind=True)
def send_digest(self: Any) -> int:
    """Beat-scheduled: summarise group sizes (runs once per tick, even with several beats)."""
    from celery_mongolock.beat import BEAT_HEADER

    lease = current_lease()
    assert lease is not None
    tick = ((self.request.headers or {}).get(BEAT_HEADER) or {}).get("tick")
    log_run("digest", key=lease.key, tick=tick, fence=lease.fence, task_id=self.request.id)
    return int(db()["members"].count_documents({}))
