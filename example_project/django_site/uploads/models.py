from __future__ import annotations

from django.db import models


class Member(models.Model):
    """One address in an email group."""

    group_id = models.IntegerField(db_index=True)
    email = models.EmailField()
    fence = models.BigIntegerField(help_text="fencing token of the import that wrote the row")

    class Meta:
        unique_together = [("group_id", "email")]
