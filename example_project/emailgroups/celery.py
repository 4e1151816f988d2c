from __future__ import annotations

from celery import Celery

app = Celery("emailgroups", include=["emailgroups.tasks"])
app.config_from_object("emailgroups.settings")


def _ready_marker(sender: object = None, **_: object) -> None:
    """Touch a file when the worker is ready (the demo waits for it instead of sleeping)."""
    import os
    from pathlib import Path

    ready_dir = os.environ.get("EMAILGROUPS_READY_DIR")
    if ready_dir:
        Path(ready_dir, f"{getattr(sender, 'hostname', 'worker')}.ready").touch()


def _contended(
    sender: object = None,
    key: str = "",
    holder: dict[str, object] | None = None,
    policy: str = "",
    **_: object,
) -> None:
    from .storage import log_run

    log_run("contended", key=key, policy=policy, holder_task=(holder or {}).get("task_id"))


from celery.signals import worker_ready  # noqa: E402

from celery_mongolock.signals import lease_contended  # noqa: E402

worker_ready.connect(_ready_marker, weak=False)
lease_contended.connect(_contended, weak=False)
