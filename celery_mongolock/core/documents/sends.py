"""The unique-send record (``unique_send=True``): its key and the one update that claims it; no I/O.

One record per send that is pending (sent, its run's body not started yet), in ``<collection>.sends``::

    {
      _id: "3f9c...",          # send_digest: sha256 of the task's name, its rendered keys, its arguments
      t:   "d1b0...",          # the task id of the pending run: a send equal to it gets this run instead
      n:   "app.upload",       # the task's name
      k:   ["email-group:7"],  # the rendered key(s), for ``celery mongolock why KEY``
      s:   ISODate(...),       # when the send claimed the record (server time)
      p:   1796012528720123,   # the send's stamp (``mongolock_sent``), the order Replace judges sends by
      x:   ISODate(...),       # the bound of the window (server time); past it the record claims nothing
    }

A send claims the record with one ``findAndModify`` (``claim_update``, upsert on ``_id``): if there is no
record, or its bound has passed on the server's clock, the send's own task id is written and it publishes
its message; otherwise the record is left as it is and the reply names the pending run. Two producers
sending the same thing at once race on one ``_id``: exactly one writes its task id. A record is removed
(by task id) when its run's body starts or when the run ends without one (skipped, failed, revoked,
superseded); a record whose message was lost claims nothing past ``x`` (the TTL index on ``x`` deletes it
about a minute later).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from celery_mongolock.core.documents.base import Document
from celery_mongolock.core.documents.sets import gate_of, set_signature
from celery_mongolock.core.keys import a_type, normalize_key
from celery_mongolock.core.lease_info import aware
from celery_mongolock.exceptions import ArgumentsNotComparable, ConfigurationError

__all__ = [
    "DEFAULT_UNIQUE_SEND_SECONDS",
    "PendingSend",
    "canonical_arguments",
    "check_unique_send",
    "check_unique_send_seconds",
    "claim_update",
    "send_digest",
]

_NOW_MS: Document = {"$toLong": "$$NOW"}

#: ``unique_send_seconds``' default: a send's record deduplicates at most an hour after its run is due.
DEFAULT_UNIQUE_SEND_SECONDS = 3600.0
#: Its largest value (a week): a record whose message was lost must not turn sends away for longer.
MAX_UNIQUE_SEND_SECONDS = 7 * 24 * 3600.0


def check_unique_send(value: object, where: str = "unique_send") -> bool | str:
    """``unique_send``: False, True or ``"best_effort"``; ``ConfigurationError`` otherwise."""
    if value is None or value is False:
        return False
    if value is True or value == "best_effort":
        return value
    raise ConfigurationError(
        f"{where} must be True, False or 'best_effort' (publish undeduplicated when MongoDB "
        f"does not answer), got {value!r}"
    )


def check_unique_send_seconds(value: object, where: str = "unique_send_seconds") -> float:
    """``unique_send_seconds``: how long after its run is due a send's record deduplicates at most."""
    if value is None:
        return DEFAULT_UNIQUE_SEND_SECONDS
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigurationError(f"{where} must be a number of seconds, got {value!r}")
    if not 0 < value <= MAX_UNIQUE_SEND_SECONDS:
        raise ConfigurationError(
            f"{where} must be above 0 and at most {MAX_UNIQUE_SEND_SECONDS:g} (a week), "
            f"got {value!r}: it bounds how long a send whose message was lost turns equal sends away"
        )
    return float(value)


def _comparable(value: Any, where: str) -> Any:
    """``value`` as plain JSON data; ``ArgumentsNotComparable`` names the first part that is not."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ArgumentsNotComparable(f"{where} is {value!r}, which JSON cannot carry")
        return value
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ArgumentsNotComparable(f"{where} has a dict key {k!r} that is not a str")
            out[k] = _comparable(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [_comparable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ArgumentsNotComparable(
        f"{where} is {a_type(value)} ({value!r:.60}), not JSON data (str, int, float, bool, None, "
        "list, dict with str keys)"
    )


def canonical_arguments(task_name: str, arguments: Mapping[str, Any]) -> str:
    """A call's arguments (bound to the task's signature, by name) as compact JSON with sorted keys:
    two sends compare equal exactly when these texts are equal. ``ArgumentsNotComparable`` when an
    argument is not JSON data, naming it."""
    try:
        plain = {name: _comparable(value, f"argument {name!r}") for name, value in arguments.items()}
        return json.dumps(plain, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except ArgumentsNotComparable as exc:
        raise ArgumentsNotComparable(
            f"task {task_name!r} has unique_send, which compares a send's arguments as JSON: {exc}; pass "
            "JSON data (an id instead of an object), or turn unique_send off for this task"
        ) from None
    except RecursionError:
        raise ArgumentsNotComparable(
            f"task {task_name!r} has unique_send, which compares a send's arguments as JSON: an argument "
            "is nested too deeply (or contains itself)"
        ) from None


def send_digest(task_name: str, keys: Sequence[str], arguments: Mapping[str, Any]) -> str:
    """The record's ``_id``: sha256 (hex) of the task's name, its rendered keys (sorted) and its
    arguments (``canonical_arguments``)."""
    text = json.dumps(
        [task_name, sorted(keys), canonical_arguments(task_name, arguments)], separators=(",", ":")
    )
    return hashlib.sha256(text.encode()).hexdigest()


def claim_update(
    task_id: str, task_name: str, keys: Sequence[str], bound_ms: int, stamp: int | None = None
) -> list[Document]:
    """The pipeline a send upserts on ``{_id: digest}``: a record that is missing or past its bound
    ``x`` (server time) becomes this send's (``t = task_id``, ``x = now + bound_ms``, ``p``: its send
    stamp); a live one is left as it is. The send published nothing before this: if the reply's ``t`` is
    its own id, it publishes."""
    free = {"$lte": [{"$ifNull": [{"$toLong": "$x"}, 0]}, _NOW_MS]}

    def mine(value: object, field: str) -> Document:
        return {"$cond": [free, value, f"${field}"]}

    fields: Document = {
        "t": mine(task_id, "t"),
        "n": mine(task_name, "n"),
        "k": mine({"$literal": sorted(keys)}, "k"),
        "s": mine("$$NOW", "s"),
        "x": mine({"$add": ["$$NOW", int(bound_ms)]}, "x"),
    }
    if stamp is not None:
        fields["p"] = mine({"$literal": int(stamp)}, "p")
    return [{"$set": fields}]


def started_after(keys: Sequence[str], stamp: int) -> Document:
    """The lease documents of ``keys`` whose newest send that got the key was sent after ``stamp``: a run
    sent at ``stamp`` and not started yet is superseded at its admission. For one key, ``Replace``'s
    ``last``; for a set of keys (``keys=``), the set's record in ``lg``."""
    ids = sorted({normalize_key(k) for k in keys})
    if len(ids) > 1:  # (a set's sends get its gate, and only there: ``sets.gate_of``)
        ids.append(gate_of(list(keys)))
    newer = {"$gt": int(stamp)}
    # (``g`` as a run of the set records it: from its rendered keys, as given here)
    return {
        "_id": {"$in": ids},
        "$or": [{"last.s": newer}, {"lg": {"$elemMatch": {"g": set_signature(list(keys)), "s": newer}}}],
    }


@dataclasses.dataclass(frozen=True)
class PendingSend:
    """A send whose run has not started its body: what ``why KEY`` shows."""

    task_id: str
    task_name: str
    keys: tuple[str, ...]
    sent_at: _dt.datetime | None
    #: Past this (server time) the record no longer deduplicates, started or not.
    until: _dt.datetime | None

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> PendingSend:
        return cls(
            task_id=str(doc.get("t")),
            task_name=str(doc.get("n")),
            keys=tuple(str(k) for k in doc.get("k") or ()),
            sent_at=aware(doc.get("s")),
            until=aware(doc.get("x")),
        )
