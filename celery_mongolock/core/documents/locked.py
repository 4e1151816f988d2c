"""A lock kept inside the document it protects (``DocumentLock``): every filter and pipeline, as pure
functions, no I/O.

The lock is one sub-document of the user's document, under one field (``mongolock`` unless the lock is
given another ``field=``), so that a collision with the user's own fields is one test::

    {
      _id: ObjectId(...),                   # the user's document, any _id type
      ...the user's own fields...,
      mongolock: {
        lock:        "celery_mongolock.DocumentLock",  # whose field this is (a collision test)
        owner:       "5f0c...e1" | null,    # token of the current acquisition; null once released
        fence:       1795383245193000,      # fencing token: strictly increasing per document
        ttl_ms:      30000,                 # the lock length the holder asked for
        expires_at:  ISODate(...) | null,   # server time; null once released
        acquired_at: ISODate(...),          # server time of this acquisition
        renewed_at:  ISODate(...),          # server time of the last renewal
        released_at: ISODate(...) | null,   # server time of the release
        forced_release: bool,               # released by an operator (the CLI)
        holder:      {host, pid, ...info} | null
      }
    }

A release clears ``owner``, ``expires_at`` and ``holder`` and keeps ``fence``: the next acquisition's
fence is larger (``max(fence + 1, server time in ms * 1000)``, as a lease's, ``documents.base``). The
second term keeps fences increasing when the document (or its lock field) was removed and made again.

Expiry is judged on the server's clock (``$$NOW``) inside each write, compared through ``$toLong`` (see
``documents.base``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from pymongo.errors import WriteError

from celery_mongolock.exceptions import ConfigurationError

__all__ = [
    "DEFAULT_FIELD",
    "MARKER",
    "acquire_pipeline",
    "force_release_pipeline",
    "guarded_update",
    "held_filter",
    "read_pipeline",
    "release_pipeline",
    "renew_pipeline",
    "state_of",
    "update_command",
    "update_reply",
    "validate_field",
]

Document = dict[str, Any]

DEFAULT_FIELD = "mongolock"
MARKER = "celery_mongolock.DocumentLock"

_NOW_MS: Document = {"$toLong": "$$NOW"}

#: Update operators whose values are field names (checked like the keys of the others).
_RENAME = "$rename"
#: Pipeline stages that may appear in ``update_one``'s pipeline: each names the fields it writes.
_FIELD_STAGES = ("$set", "$addFields", "$unset")


def validate_field(field: object) -> str:
    """The lock's field name: a plain top-level name (no ``$``, no ``.``, not ``_id``)."""
    if not isinstance(field, str) or not field or field.startswith("$") or "." in field or field == "_id":
        raise ConfigurationError(
            f"the document lock's field must be a plain top-level field name other than _id, got {field!r}"
        )
    return field


def _f(field: str, name: str) -> str:
    return f"${field}.{name}"


def _is_ours(field: str) -> Document:
    """The field holds one of our locks (an object with our marker)."""
    return {"$eq": [_f(field, "lock"), MARKER]}


def _live(field: str) -> Document:
    """Our lock is held and has not expired on the server's clock."""
    return {
        "$and": [
            {"$ne": [{"$ifNull": [_f(field, "owner"), None]}, None]},
            {"$gt": [{"$toLong": {"$ifNull": [_f(field, "expires_at"), 0]}}, _NOW_MS]},
        ]
    }


# -- acquire ---------------------------------------------------------------------------------------------
def acquire_pipeline(field: str, token: str, ttl_ms: int, holder: Mapping[str, Any]) -> list[Document]:
    """Take the lock when the field is missing, or ours and free or expired (one ``findAndModify`` on
    ``{_id}``, no upsert: a missing document matches nothing). A field that is not ours, or a live lock,
    is left as it was: the reply (``state_of``) tells which."""
    state = {
        "$switch": {
            "branches": [
                {"case": {"$eq": [{"$type": f"${field}"}, "missing"]}, "then": "free"},
                {"case": {"$not": [_is_ours(field)]}, "then": "collision"},
                {"case": _live(field), "then": "held"},
            ],
            "default": "free",
        }
    }
    new = {
        "lock": {"$literal": MARKER},
        "owner": {"$literal": token},
        "fence": {
            "$max": [
                {"$add": [{"$ifNull": [_f(field, "fence"), 0]}, 1]},
                {"$multiply": [_NOW_MS, 1000]},
            ]
        },
        "ttl_ms": {"$literal": ttl_ms},
        "expires_at": {"$add": ["$$NOW", ttl_ms]},
        "acquired_at": "$$NOW",
        "renewed_at": "$$NOW",
        "released_at": None,
        "forced_release": False,
        "holder": {"$literal": dict(holder)},
    }
    return [
        {"$set": {"__mongolock_state": state}},
        {"$set": {field: {"$cond": [{"$eq": ["$__mongolock_state", "free"]}, new, f"${field}"]}}},
        {"$unset": "__mongolock_state"},
    ]


def state_of(field: str, doc: Mapping[str, Any] | None, token: str) -> str:
    """What an acquire's reply (the document after, projected on ``field``) says: ``missing`` (no such
    document), ``collision`` (the field is the user's own), ``taken`` (by us) or ``held`` (by another)."""
    if doc is None:
        return "missing"
    lock = doc.get(field)
    if not isinstance(lock, Mapping) or lock.get("lock") != MARKER:
        return "collision"
    return "taken" if lock.get("owner") == token else "held"


# -- renew, release, read --------------------------------------------------------------------------------
def held_filter(field: str, ids: Sequence[Any], tokens: Sequence[str], fence: int | None = None) -> Document:
    """The documents of ``ids`` whose lock one of ``tokens`` holds (with ``fence``, when given), not
    expired on the server's clock."""
    match: Document = {
        "_id": ids[0] if len(ids) == 1 else {"$in": list(ids)},
        f"{field}.lock": MARKER,
        f"{field}.owner": tokens[0] if len(tokens) == 1 else {"$in": list(tokens)},
        "$expr": {"$gt": [{"$toLong": {"$ifNull": [_f(field, "expires_at"), 0]}}, _NOW_MS]},
    }
    if fence is not None:
        match[f"{field}.fence"] = fence
    return match


def renew_pipeline(field: str) -> list[Document]:
    """Extend by the lock's own ``ttl_ms`` from now, on the server's clock."""
    return [
        {
            "$set": {
                f"{field}.expires_at": {"$add": ["$$NOW", _f(field, "ttl_ms")]},
                f"{field}.renewed_at": "$$NOW",
            }
        }
    ]


def release_pipeline(field: str, *, forced: bool = False) -> list[Document]:
    """Clear the holder's fields; the fence stays, so that the next acquisition's is larger."""
    return [
        {
            "$set": {
                f"{field}.owner": None,
                f"{field}.expires_at": None,
                f"{field}.holder": None,
                f"{field}.released_at": "$$NOW",
                f"{field}.forced_release": forced,
            }
        }
    ]


def force_release_pipeline(field: str) -> list[Document]:
    """An operator's release (the CLI's ``release --force``): whoever holds it."""
    return release_pipeline(field, forced=True)


def read_pipeline(field: str, _id: Any) -> list[Document]:
    """The lock of one document, with the seconds until its expiry on the server's clock (``expires_in``)
    and whether the document exists with the field at all."""
    return [
        {"$match": {"_id": _id}},
        {
            "$project": {
                "_id": 0,
                "lock": f"${field}",
                "now": "$$NOW",
                "expires_in_ms": {
                    "$cond": [
                        {"$eq": [{"$type": _f(field, "expires_at")}, "date"]},
                        {"$subtract": [{"$toLong": _f(field, "expires_at")}, _NOW_MS]},
                        None,
                    ]
                },
            }
        },
    ]


# -- the holder's writes ---------------------------------------------------------------------------------
def _touches(field: str, name: object) -> bool:
    return isinstance(name, str) and (name == field or name.startswith(f"{field}."))


def guarded_update(
    field: str, update: Mapping[str, Any] | Sequence[Mapping[str, Any]]
) -> Mapping[str, Any] | list[Document]:
    """``update`` as given, checked: an update with operators (``$set``, ...) or a pipeline of ``$set``,
    ``$addFields`` and ``$unset`` stages, that writes no field of the lock (``field`` and below)."""
    if isinstance(update, Mapping):
        if not update or any(not isinstance(k, str) or not k.startswith("$") for k in update):
            raise ConfigurationError(
                "DocumentLock.update_one needs an update with operators ($set, $inc, ...), not a document"
            )
        for op, fields in update.items():
            if not isinstance(fields, Mapping):
                raise ConfigurationError(f"DocumentLock.update_one: {op} needs a document of fields")
            names = [*fields, *fields.values()] if op == _RENAME else list(fields)
            if any(_touches(field, name) for name in names):
                raise ConfigurationError(
                    f"DocumentLock.update_one may not write the lock's own field {field!r} ({op})"
                )
        return update
    if isinstance(update, (str, bytes)) or not isinstance(update, Sequence) or not update:
        raise ConfigurationError(
            "DocumentLock.update_one needs an update with operators or a non-empty pipeline, "
            f"got {type(update).__name__}"
        )
    stages: list[Document] = []
    for stage in update:
        if not isinstance(stage, Mapping) or len(stage) != 1 or next(iter(stage)) not in _FIELD_STAGES:
            raise ConfigurationError(
                "DocumentLock.update_one takes pipelines of $set, $addFields and $unset stages only "
                f"(others could drop the lock's field), got {stage!r}"
            )
        op, body = next(iter(stage.items()))
        names = [body] if isinstance(body, str) else list(body)
        if any(_touches(field, name) for name in names):
            raise ConfigurationError(f"DocumentLock.update_one may not write the lock's own field {field!r}")
        stages.append(dict(stage))
    return stages


def update_command(
    collection: str, match: Mapping[str, Any], update: Mapping[str, Any] | Sequence[Any], concern: Document
) -> Document:
    """The holder's write as a plain ``update`` command: sent without a ``txnNumber`` (through
    ``Database.command``, which pymongo does not retry), so that it is run at most once."""
    command: Document = {
        "update": collection,
        "updates": [{"q": dict(match), "u": update, "multi": False, "upsert": False}],
        "ordered": True,
    }
    if concern:
        command["writeConcern"] = dict(concern)
    return command


@dataclasses.dataclass(frozen=True)
class UpdateReply:
    """What an ``update`` command's reply says of its one statement."""

    matched: bool
    modified: bool
    write_concern_failed: bool
    #: The statement's write error (the update itself failed on the document; nothing was written).
    error: WriteError | None


def update_reply(reply: Mapping[str, Any]) -> UpdateReply:
    """Read an ``update`` command's reply (``n``, ``nModified``, ``writeErrors``, ``writeConcernError``)."""
    errors = reply.get("writeErrors") or []
    error = None
    if errors:
        first = dict(errors[0])
        error = WriteError(str(first.get("errmsg", "write error")), first.get("code"), first)
    return UpdateReply(
        matched=int(reply.get("n", 0)) >= 1,
        modified=int(reply.get("nModified", 0)) >= 1,
        write_concern_failed=bool(reply.get("writeConcernError")),
        error=error,
    )
