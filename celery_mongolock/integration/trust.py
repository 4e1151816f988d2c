"""What a handoff checks before it publishes a parked run's stored message again (private).

A parked ``Queue``/``Replace`` run keeps its Celery message in MongoDB, and a handoff publishes that
message to the workers. Write access to the lease collection must not mean running any task: so a stored
message is published only when

1. it is signed with the app's ``mongolock_signing_key``, when one is set (an HMAC-SHA256 over the stored
   bytes, checked before anything is deserialized);
2. it names a singleton task of this app (the entry's ``n``), and its content type is the one that task's
   own serializer writes (a run is stored with its task's serializer, so any other content type is not
   ours: a ``pickle`` entry for a ``json`` task is refused even in an app that accepts pickle from its
   broker) and one the app accepts (``accept_content``);
3. once deserialized with exactly that content type, it is that task's message for the entry's task id,
   and the keys its stored arguments render to are the key (or, for ``keys=``, the key set) it was parked
   under.

Anything else raises ``RefusedEntry`` with the reason; the queue module drops the entry, records it and
moves on. An entry of a task this worker does not have raises ``UnknownTask``: it is left for a worker
that has the task, which checks it as above.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from typing import Any

from celery import Celery
from kombu.serialization import dumps, loads, prepare_accept_content

from celery_mongolock.core.documents.sets import gate_of, is_gate, user_keys
from celery_mongolock.core.keys import normalize_key

__all__ = ["RefusedEntry", "UnknownTask", "check_entry", "sign_entry"]

#: The entry field that holds the message's HMAC (hex), when the app has a signing key.
SIGNATURE_FIELD = "sg"


class RefusedEntry(Exception):
    """A parked entry whose stored message a handoff will not publish; the message says why."""


class UnknownTask(RefusedEntry):
    """A parked entry that names a task this worker does not have. Not a reason to refuse it: a worker
    of another queue, or of the next deploy, may have it (``handoff`` leaves it to such a worker)."""


def _signed_bytes(entry: Mapping[str, Any]) -> bytes:
    """The bytes an entry's HMAC covers: its run, task and stored message, each length-prefixed."""
    parts = [entry.get(field) for field in ("id", "t", "n", "ct", "ce", "m")]
    out = bytearray(b"mongolock-entry-v1")
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        out += len(data).to_bytes(8, "big") + data
    return bytes(out)


def sign_entry(secret: bytes, entry: Mapping[str, Any]) -> str:
    """The HMAC of a parked entry's message (stored in its ``sg`` field)."""
    return hmac.new(secret, _signed_bytes(entry), hashlib.sha256).hexdigest()


def check_entry(app: Celery, key: str, entry: Mapping[str, Any], secret: bytes | None) -> Any:
    """The signature to publish for the parked ``entry`` that ``key`` was handed to, or ``RefusedEntry``."""
    if secret is not None:
        given = entry.get(SIGNATURE_FIELD)
        if not isinstance(given, str) or not hmac.compare_digest(given, sign_entry(secret, entry)):
            what = "has no signature" if given is None else "has a signature that does not match"
            raise RefusedEntry(f"its stored message {what} (mongolock_signing_key is set)")
    name = entry.get("n")
    task = app.tasks.get(name) if isinstance(name, str) else None
    if task is None and isinstance(name, str) and name:
        raise UnknownTask(f"it names {name!r}, a task this worker does not have")
    if task is None or not callable(getattr(task, "mongolock_keys_for", None)):
        raise RefusedEntry(f"it names {name!r}, which is not a singleton task of this app")
    content_type = _content_type_of(task)
    stored = entry.get("ct")
    if stored != content_type:
        raise RefusedEntry(f"its message is {stored!r}, not {content_type!r} as task {name!r} writes")
    if content_type not in prepare_accept_content(app.conf.accept_content or ()):  # type: ignore[no-untyped-call]
        raise RefusedEntry(f"its content type {content_type!r} is not in the app's accept_content")
    try:
        fields = loads(entry.get("m"), content_type, entry.get("ce"), accept={content_type})  # type: ignore[no-untyped-call]
    except Exception as exc:
        why = type(exc).__name__
        raise RefusedEntry(f"its message does not decode as {content_type!r} ({why})") from None
    if not isinstance(fields, dict) or fields.get("task") != name:
        raise RefusedEntry(f"its message is not a message of task {name!r}")
    given_options = fields.get("options")
    options: dict[str, Any] = given_options if isinstance(given_options, dict) else {}
    if options.get("task_id") != entry.get("t"):
        raise RefusedEntry(f"its message is for task id {options.get('task_id')!r}, not {entry.get('t')!r}")
    _check_keys(task, key, entry, fields)
    return app.signature(fields)


def _content_type_of(task: Any) -> str:
    content_type, _encoding, _body = dumps({}, serializer=task.serializer or "json")  # type: ignore[no-untyped-call]
    return str(content_type)


def _check_keys(task: Any, key: str, entry: Mapping[str, Any], fields: Mapping[str, Any]) -> None:
    args = fields.get("args") or ()
    kwargs = fields.get("kwargs") or {}
    if not isinstance(args, (list, tuple)) or not isinstance(kwargs, dict):
        raise RefusedEntry("its message's arguments are not a list and a dict")
    try:
        rendered = [normalize_key(k) for k in task.mongolock_keys_for(*args, **kwargs)]
    except Exception as exc:
        raise RefusedEntry(f"its arguments do not render the task's keys ({type(exc).__name__})") from None
    admitted = [normalize_key(str(k)) for k in entry.get("ks") or [key]]
    parked_under = user_keys(admitted)  # (a Replace set's gate: from its keys, ``sets.gate_of``)
    gates = [k for k in admitted if is_gate(k)]
    if gates and (len(rendered) < 2 or gates != [gate_of(rendered)]):
        raise RefusedEntry(f"its arguments render the key(s) {rendered}, not those of the gate {gates[0]!r}")
    if normalize_key(key) not in admitted or sorted(rendered) != sorted(parked_under):
        raise RefusedEntry(f"its arguments render the key(s) {rendered}, not {sorted(parked_under)}")
