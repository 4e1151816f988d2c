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

    # The run that found the key held (the demo tells by its holder whether a run sent earlier reached
    # MongoDB only after a newer one had the key).
    task_id = getattr(getattr(sender, "request", None), "id", None)
    log_run("contended", key=key, policy=policy, holder_task=(holder or {}).get("task_id"), task_id=task_id)


# -- what the demo's invariants and timeline are built from (a log of events in the example's database) -----
def _parked(sender: object = None, key: str = "", task_id: str = "", position: int = 0, **_: object) -> None:
    from .storage import log_run

    log_run("parked", key=key, task_id=task_id, position=position)


def _superseded(
    sender: object = None, key: str = "", task_id: str = "", by: object = None, **_: object
) -> None:
    from .storage import log_run

    log_run("superseded", key=key, task_id=task_id, by=by)


def _handed_off(sender: object = None, key: str = "", task_id: str = "", **_: object) -> None:
    from .storage import log_run

    log_run("handed", key=key, task_id=task_id)


def _delivery_began(sender: object = None, task_id: str = "", **_: object) -> None:
    """Every delivery of the example's queued tasks begins here, before the library sees the run: the
    demo tells a late arrival (a message that reached a worker after a newer one had the key) by it."""
    if getattr(sender, "name", "") in QUEUED_TASKS:
        from .storage import log_run

        log_run("delivery-begin", task_id=task_id)


def _delivery_ended(sender: object = None, task_id: str = "", state: str = "", **_: object) -> None:
    """Every delivery of the example's queued tasks ends here (a parked run ends at once: state IGNORED):
    the demo measures how long a parked run kept its worker slot after parking."""
    if getattr(sender, "name", "") in QUEUED_TASKS:
        from .storage import log_run

        log_run("delivery-end", task_id=task_id, state=state)


QUEUED_TASKS = ("emailgroups.tasks.upload_members", "emailgroups.tasks.post_to_ledger")

from celery.signals import task_postrun, task_prerun, worker_ready  # noqa: E402

from celery_mongolock.signals import (  # noqa: E402
    lease_contended,
    run_handed_off,
    run_parked,
    run_superseded,
)

worker_ready.connect(_ready_marker, weak=False)
lease_contended.connect(_contended, weak=False)
run_parked.connect(_parked, weak=False)
run_superseded.connect(_superseded, weak=False)
run_handed_off.connect(_handed_off, weak=False)
task_prerun.connect(_delivery_began, weak=False)
task_postrun.connect(_delivery_ended, weak=False)
