"""The example's tasks."""

from __future__ import annotations

import csv
import time
from typing import Any

from celery_mongolock import Queue, Replace, current_lease, singleton_task
from celery_mongolock.fencing import fenced_update_one

from .celery import app
from .storage import db, log_run

BATCH = 5


def sent_stamp(request: Any) -> int | None:
    """The send stamp the library put on the message (header ``mongolock_sent``, microseconds)."""
    stamp = (request.headers or {}).get("mongolock_sent") or getattr(request, "mongolock_sent", None)
    return int(stamp) if stamp is not None else None


# Replace (latest wins): an upload replaces the group's members, so of several uploads waiting for one
# group only the one SENT last needs to run. While one runs, at most one more is parked (no worker slot
# held); a newer send replaces it, and the replaced upload ends SUCCESS {"mongolock": "superseded", ...}.
@singleton_task(key="email-group:{group_id}", app=app, bind=True, on_contention=Replace())
def upload_members(self: Any, group_id: int, upload_id: str, csv_path: str) -> int:
    """Replace email group ``group_id``'s members with the addresses in ``csv_path``.

    Clear the group, then add the members in batches. Two uploads for one group never overlap (the
    lease). A holder that lost its lease while paused cannot write over a newer upload (the fence): its
    claim of the group is refused (``FencedOut``), and every member it adds carries its fence, which is
    not the group's any more, so readers (``current_members``) never see them.
    """
    lease = current_lease()
    assert lease is not None
    log_run(
        "start",
        key=lease.key,
        group=group_id,
        upload=upload_id,
        fence=lease.fence,
        task_id=self.request.id,
        stamp=sent_stamp(self.request),
    )
    groups, members = db()["groups"], db()["members"]
    # Fenced write: claim the group for this run's fence. A holder that was paused past its lease and
    # wakes up after a newer upload began gets FencedOut here instead of clearing the newer members.
    fenced_update_one(
        groups, {"_id": group_id}, {"$set": {"upload": upload_id, "state": "uploading"}}, lease, upsert=True
    )
    members.delete_many({"group": group_id, "fence": {"$ne": lease.fence}})  # older uploads' members
    with open(csv_path, newline="") as f:
        emails = [row["email"] for row in csv.DictReader(f)]
    for i in range(0, len(emails), BATCH):
        lease.raise_if_lost()  # stop promptly if the lease was lost
        batch = emails[i : i + BATCH]
        # Each member carries this run's fence: only the group's current fence's members count.
        members.insert_many(
            [{"group": group_id, "email": e, "upload": upload_id, "fence": lease.fence} for e in batch]
        )
        time.sleep(0.1)  # a slow downstream system, so that uploads visibly overlap in time
    fenced_update_one(groups, {"_id": group_id}, {"$set": {"state": "done", "size": len(emails)}}, lease)
    log_run(
        "end", key=lease.key, group=group_id, upload=upload_id, fence=lease.fence, task_id=self.request.id
    )
    return len(emails)


# Queue (every run, in send order): postings to one account must all apply, in the order they were sent,
# since each one's outcome depends on the balance the ones before it left (a withdrawal larger than the
# balance is refused). Waiting postings are parked in the lease document (no worker slot held) and the
# key is handed to the oldest one when the running posting ends.
@singleton_task(key="ledger:{account}", app=app, bind=True, on_contention=Queue())
def post_to_ledger(self: Any, account: str, posting_id: str, amount: int) -> int:
    """Append a posting to ``account``'s ledger and return the new balance (refused if it would go
    below zero)."""
    lease = current_lease()
    assert lease is not None
    log_run(
        "start",
        key=lease.key,
        account=account,
        posting=posting_id,
        fence=lease.fence,
        task_id=self.request.id,
        stamp=sent_stamp(self.request),
    )
    ledgers = db()["ledgers"]
    doc = ledgers.find_one({"_id": account}) or {}
    balance = int(doc.get("balance", 0))
    refused = balance + amount < 0
    if not refused:
        balance += amount
    time.sleep(0.4)  # a slow downstream system (the bank), so that postings visibly queue up
    entry = {"posting": posting_id, "amount": amount, "balance": balance, "refused": refused}
    fenced_update_one(
        ledgers,
        {"_id": account},
        {"$push": {"entries": entry}, "$set": {"balance": balance}},
        lease,
        upsert=True,
    )
    log_run(
        "end", key=lease.key, account=account, posting=posting_id, fence=lease.fence, task_id=self.request.id
    )
    return balance


def current_members(group_id: int) -> list[dict[str, Any]]:
    """The group's members: those written under the group's current fence (a paused holder that woke up
    after a newer upload claimed the group may still add members under its own, older fence)."""
    group = db()["groups"].find_one({"_id": group_id}) or {}
    return list(db()["members"].find({"group": group_id, "fence": group.get("fence")}))


@singleton_task(key="digest", app=app, bind=True)
def send_digest(self: Any) -> int:
    """Beat-scheduled: summarise group sizes (runs once per tick, even with several beats)."""
    from celery_mongolock.beat import BEAT_HEADER

    lease = current_lease()
    assert lease is not None
    tick = ((self.request.headers or {}).get(BEAT_HEADER) or {}).get("tick")
    log_run("digest", key=lease.key, tick=tick, fence=lease.fence, task_id=self.request.id)
    return int(db()["members"].count_documents({}))
