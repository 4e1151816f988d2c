"""``celery -A proj mongolock ...``: look at leases and release them.

Registered as a Celery sub-command through the ``celery.commands`` entry point group::

    celery -A proj mongolock list [--prefix P] [--all] [--json]
    celery -A proj mongolock inspect KEY [--json]
    celery -A proj mongolock release KEY [--force]
    celery -A proj mongolock watch [--prefix P] [--interval S] [--count N]

The store is the app's (``mongolock_*`` settings). Connection passwords are never printed.

Exit status: 0 done (for ``release``: the key is free now, released by us or free already); 1 an error
(MongoDB unreachable, no such lease for ``inspect``); 2 a usage error, including ``release`` of a held
key without ``--force``.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import sys
import time
from typing import Any

import click

from ._urls import redact
from .config import get_store
from .exceptions import MongoLockError
from .store import LeaseInfo, LeaseStore

__all__ = ["mongolock"]


def _store(ctx: click.Context) -> LeaseStore:
    app = getattr(ctx.obj, "app", None)
    if app is None:  # pragma: no cover - only when run outside the celery umbrella command
        raise click.UsageError("run as: celery -A your.app mongolock ...")
    try:
        return get_store(app)
    except MongoLockError as exc:
        raise click.ClickException(redact(str(exc))) from None


def _holder(info: LeaseInfo) -> str:
    h = info.holder
    where = ":".join(str(h[k]) for k in ("host", "pid") if h.get(k) is not None)
    task = h.get("task_name") or h.get("role") or ""
    if h.get("task_id"):
        task += f"[{h['task_id']}]"
    return f"{where} {task}".strip() or "-"


def _expires(info: LeaseInfo) -> str:
    if info.expires_in is None:
        return "-"
    if not info.held:
        return "free"
    return f"{info.expires_in:.1f}s"


def _parked(info: LeaseInfo) -> str:
    if not info.parked and not info.handoff:
        return "-"
    text = str(len(info.parked))
    if info.handoff:
        text += " (+1 handed)"
    return text


def _table(infos: list[LeaseInfo]) -> str:
    rows = [("KEY", "HOLDER", "FENCE", "EXPIRES IN", "PARKED")]
    rows += [(i.key, _holder(i), str(i.fence), _expires(i), _parked(i)) for i in infos]
    widths = [max(len(r[c]) for r in rows) for c in range(5)]
    lines = ["  ".join(cell.ljust(widths[c]) for c, cell in enumerate(r)).rstrip() for r in rows]
    return "\n".join(lines)


def _json(value: Any) -> str:
    def default(obj: Any) -> Any:
        if isinstance(obj, _dt.datetime):
            return obj.isoformat()
        return str(obj)

    return json.dumps(value, default=default, indent=2, sort_keys=True)


def _run(action: Any) -> Any:
    try:
        return action()
    except MongoLockError as exc:
        raise click.ClickException(redact(str(exc))) from None


@click.group(name="mongolock")
@click.pass_context
def mongolock(ctx: click.Context) -> None:
    """Inspect and manage celery_mongolock leases."""
    # Each command says what happened on stdout; without this, the library's own log records (such as
    # the store's "force-released ..." warning) would be printed on stderr too, by logging's last resort.
    logging.getLogger("celery_mongolock").addHandler(logging.NullHandler())


@mongolock.command(name="list")
@click.option("--prefix", default=None, help="only keys starting with this text")
@click.option("--all", "include_free", is_flag=True, help="include released and expired leases")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.pass_context
def list_leases(ctx: click.Context, prefix: str | None, include_free: bool, as_json: bool) -> None:
    """List held leases (and keys with runs parked): key, holder, fence, expires in, parked runs."""
    store = _store(ctx)
    infos = _run(lambda: store.list(prefix, include_free=include_free))
    if as_json:
        click.echo(_json([i.as_dict() for i in infos]))
    elif infos:
        click.echo(_table(infos))
    else:
        click.echo("no leases held" + (f" with prefix {prefix!r}" if prefix else ""))


@mongolock.command(name="inspect")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.pass_context
def inspect_lease(ctx: click.Context, key: str, as_json: bool) -> None:
    """Show one lease in full, with the runs parked on it (next first)."""
    store = _store(ctx)
    info = _run(lambda: store.inspect(key))
    if info is None:
        if as_json:
            click.echo("null")
            return
        raise click.ClickException(f"no lease {key!r}")
    if as_json:
        click.echo(_json(info.as_dict()))
        return
    data = info.as_dict()
    data["state"] = "held" if info.held else "free"
    data["expires_in"] = _expires(info)
    width = max(len(k) for k in data)
    for name in (
        "key",
        "state",
        "holder",
        "fence",
        "owner",
        "expires_in",
        "expires_at",
        "acquired_at",
        "renewed_at",
        "released_at",
    ):
        value = data.get(name)
        click.echo(f"{name.ljust(width)}  {value if value is not None else '-'}")
    if info.handoff:
        h = info.handoff
        click.echo(
            f"{'handoff'.ljust(width)}  {h['task_name']}[{h['task_id']}] handed {h['handed_for']}s ago, "
            f"not yet taken up (attempt {h['attempt']})"
        )
    click.echo(f"{'parked'.ljust(width)}  {len(info.parked) or '-'}")
    for e in info.parked:
        deadline = f", deadline {e['deadline'].isoformat()}" if e.get("deadline") else ""
        click.echo(
            f"  {e['position']:>3}. {e['task_name']}[{e['task_id']}] parked {e['parked_for']}s{deadline}"
        )


@mongolock.command(name="release")
@click.argument("key")
@click.option("--force", is_flag=True, help="required to release a held lease: whoever holds it")
@click.pass_context
def release_lease(ctx: click.Context, key: str, force: bool) -> None:
    """Release KEY whoever holds it (the holder finds out at its next renewal).

    Exit status 0 when the key is free afterwards (released, or nobody held it); 2 when it is held and
    --force was not given.
    """
    store = _store(ctx)
    overlap = "releasing someone else's lease can let two runs overlap"
    try:
        info = store.inspect(key)
    except MongoLockError as exc:
        if force:
            raise click.ClickException(redact(str(exc))) from None
        why = redact(str(exc)).split(" (configured timeouts")[0].split(": ServerSelection")[0][:200]
        raise click.UsageError(
            f"could not tell whether {key!r} is held ({why}); {overlap}: repeat with --force if you are sure"
        ) from None
    if info is None or not info.held:
        click.echo(f"{key!r} is free: nobody holds it; nothing to release")
        return
    if not force:
        raise click.UsageError(
            f"{key!r} is held by {_holder(info)} (expires in {_expires(info)}); {overlap}: repeat with "
            "--force if you are sure"
        )
    released = _run(lambda: store.force_release(key))
    if released:
        click.echo(f"released {key!r} (was held by {_holder(info)})")
    else:  # it ended or expired between the two commands
        click.echo(f"{key!r} is free: nobody holds it; nothing to release")


@mongolock.command(name="watch")
@click.option("--prefix", default=None, help="only keys starting with this text")
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(min=0.1))
@click.option(
    "--count", default=0, type=click.IntRange(min=0), help="stop after N refreshes (0: until Ctrl-C)"
)
@click.pass_context
def watch_leases(ctx: click.Context, prefix: str | None, interval: float, count: int) -> None:
    """Show held leases live, refreshed every INTERVAL seconds, until Ctrl-C."""
    store = _store(ctx)
    tty = sys.stdout.isatty()
    shown = 0
    try:
        while True:
            infos = _run(lambda: store.list(prefix))
            stamp = _dt.datetime.now().strftime("%H:%M:%S")
            body = _table(infos) if infos else "no leases held"
            if tty:
                click.clear()
            click.echo(f"{stamp}  {len(infos)} held on {store.url or 'the configured MongoDB'}\n{body}\n")
            shown += 1
            if count and shown >= count:
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        return
