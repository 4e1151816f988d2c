"""The CLI's view of document locks (``DocumentLock``): ``inspect`` and ``release`` with ``--collection``
and ``--id`` (or ``--id-json``) instead of a lease key::

    celery -A proj mongolock inspect --collection shop.invoices --id inv-1 [--json]
    celery -A proj mongolock release --collection invoices --id-json '{"$oid": "..."}' [--force]

``--collection`` names a collection of the store's database (``mongolock_database``), as ``DB.NAME`` or
``NAME``; ``--id`` is a string ``_id``, ``--id-json`` any ``_id`` in MongoDB Extended JSON (``42``,
``{"$oid": "..."}``, ``{"$uuid": "..."}``); ``--field`` the lock's field when it is not ``mongolock``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import click
from bson import json_util

from celery_mongolock.core.document_lock import (
    DocumentLockInfo,
    LockedDocument,
    force_release_document,
    inspect_document,
    validate_field,
)
from celery_mongolock.core.documents.locked import DEFAULT_FIELD
from celery_mongolock.core.store import LeaseStore
from celery_mongolock.core.urls import redact
from celery_mongolock.exceptions import MongoLockError

__all__ = ["document_options", "inspect_document_lock", "release_document_lock", "wants_document"]

F = TypeVar("F", bound=Callable[..., Any])

_OVERLAP = "releasing someone else's lock can let two writers overlap"


def document_options(command: F) -> F:
    """The options that address a document lock instead of a lease key."""
    for option in reversed(
        [
            click.option(
                "--collection", default=None, help="a document lock: DB.COLLECTION of the store's database"
            ),
            click.option("--id", "id_text", default=None, help="the document's _id, a string"),
            click.option("--id-json", default=None, help="the document's _id in MongoDB Extended JSON"),
            click.option(
                "--field", default=DEFAULT_FIELD, show_default=True, help="the document's lock field"
            ),
        ]
    ):
        command = option(command)
    return command


def wants_document(key: str | None, collection: str | None, id_text: str | None, id_json: str | None) -> bool:
    """Whether the command line addresses a document lock; a usage error when it is unclear what it names."""
    name = click.get_current_context().info_name
    if collection is None and id_text is None and id_json is None:
        if key is None:
            raise click.UsageError(
                f"mongolock {name} needs KEY, the lease key, or --collection and --id for a document lock"
            )
        return False
    if key is not None:
        raise click.UsageError(f"mongolock {name}: give KEY or --collection/--id, not both")
    if collection is None or (id_text is None) == (id_json is None):
        raise click.UsageError(
            f"mongolock {name}: a document lock needs --collection and one of --id, --id-json"
        )
    return True


def target(
    store: LeaseStore, collection: str, id_text: str | None, id_json: str | None, field: str
) -> LockedDocument:
    """The document the options name, checked."""
    name = click.get_current_context().info_name
    db = store.database_name
    if collection.startswith(f"{db}."):
        collection = collection[len(db) + 1 :]
    elif "." in collection:
        raise click.UsageError(
            f"mongolock {name}: --collection {collection!r}: a document lock lives in the store's database "
            f"{db!r}; write {db}.{collection} for a collection of that name"
        )
    if not collection:
        raise click.UsageError(f"mongolock {name}: --collection needs a collection name")
    _id: Any = id_text
    if id_json is not None:
        try:
            _id = json_util.loads(id_json)
        except (ValueError, TypeError) as exc:
            raise click.UsageError(
                f"mongolock {name}: --id-json {id_json!r} is not MongoDB Extended JSON ({type(exc).__name__})"
            ) from None
    try:
        return LockedDocument(collection, _id, validate_field(field))
    except MongoLockError as exc:
        raise click.UsageError(f"mongolock {name}: {exc}") from None


def _read(store: LeaseStore, where: LockedDocument) -> DocumentLockInfo | None:
    try:
        return inspect_document(store, where)
    except MongoLockError as exc:
        raise click.ClickException(redact(str(exc))) from None


def _holder(info: DocumentLockInfo) -> str:
    h = info.holder
    where = ":".join(str(h[k]) for k in ("host", "pid") if h.get(k) is not None)
    extra = ", ".join(f"{k}={v}" for k, v in h.items() if k not in ("host", "pid"))
    return f"{where} ({extra})" if extra else where or "?"


def _state(info: DocumentLockInfo) -> str:
    if not info.has_field:
        return "free (never locked: the document has no lock field)"
    if info.held:
        return "held"
    return "free (expired)" if info.owner else "free"


def inspect_document_lock(store: LeaseStore, where: LockedDocument, as_json: bool) -> None:
    """``inspect --collection ... --id ...``: the document's lock in full."""
    info = _read(store, where)
    key = where.key(store.database_name)
    if info is None:
        if as_json:
            click.echo("null")
            return
        raise click.ClickException(f"no document {key}")
    if as_json:
        data = info.as_dict()
        click.echo(
            json.dumps(data, default=lambda o: o.isoformat() if hasattr(o, "isoformat") else str(o), indent=2)
        )
        return
    rows = {
        "document": key,
        "state": _state(info),
        "holder": _holder(info) if info.holder else None,
        "fence": info.fence,
        "owner": info.owner,
        "expires_in": f"{info.expires_in:.1f}s" if info.held and info.expires_in is not None else None,
        "expires_at": info.expires_at.isoformat() if info.expires_at else None,
        "acquired_at": info.acquired_at.isoformat() if info.acquired_at else None,
        "renewed_at": info.renewed_at.isoformat() if info.renewed_at else None,
        "released_at": info.released_at.isoformat() if info.released_at else None,
        "forced_release": "yes" if info.forced_release else None,
    }
    width = max(len(k) for k in rows)
    for name, value in rows.items():
        click.echo(f"{name.ljust(width)}  {value if value is not None else '-'}")


def release_document_lock(store: LeaseStore, where: LockedDocument, force: bool) -> None:
    """``release --collection ... --id ... [--force]``: exit 0 when the lock is free afterwards."""
    key = where.key(store.database_name)
    info = _read(store, where)
    if info is None:
        raise click.ClickException(f"no document {key}")
    if not info.held:
        click.echo(f"{key} is free: nobody holds its lock; nothing to release")
        return
    if not force:
        raise click.UsageError(
            f"{key} is locked by {_holder(info)} (expires in {info.expires_in:.1f}s); {_OVERLAP}: "
            "repeat with --force if you are sure"
        )
    try:
        released = force_release_document(store, where)
    except MongoLockError as exc:
        raise click.ClickException(redact(str(exc))) from None
    if released:
        click.echo(f"released the lock of {key} (was held by {_holder(info)})")
    else:
        click.echo(f"{key} is free: nobody holds its lock; nothing to release")
