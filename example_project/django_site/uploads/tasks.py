"""The import task: replaces a group's members with a CSV file's, never two imports of a group at once."""

from __future__ import annotations

import csv

from django.db import transaction

from celery_mongolock import current_lease, singleton_task

from .models import Member


@singleton_task(key="email-group:{group_id}")
def import_members(group_id: int, csv_path: str) -> int:
    """Replace group ``group_id``'s members with the ``email`` column of ``csv_path``; return the count."""
    lease = current_lease()
    assert lease is not None
    with open(csv_path, newline="") as f:
        emails = sorted({row["email"].strip() for row in csv.DictReader(f)})
    lease.raise_if_lost()  # reading took long enough for the lease to be lost? Then write nothing.
    with transaction.atomic():
        Member.objects.filter(group_id=group_id).delete()
        Member.objects.bulk_create(Member(group_id=group_id, email=e, fence=lease.fence) for e in emails)
    return len(emails)
