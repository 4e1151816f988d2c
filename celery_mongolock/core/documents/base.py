"""The lease document and every filter and update pipeline that touches it: pure functions, no I/O.
The document as read (``reading``) and the history's records (``records``) live apart; their names are
re-exported here for the callers that use them through this module.

``LeaseStore`` sends what these build; nothing else writes the lease collection. Keeping the shapes here
lets them be read in one place and tested without a server (``tests/test_documents.py``).

The lease document
==================
::

    {
      _id:           "email-group:42",      # the lease key (see keys.normalize_key)
      owner:         "5f0c...e1" | null,    # token of the current acquisition; null once released
      fence:         1795383245193000,      # fencing token: strictly increasing per key, see below
      ttl_ms:        30000,                 # the lease length the holder asked for
      expires_at:    ISODate(...),          # server time; TTL index (expireAfterSeconds=0) cleans up
      acquired_at:   ISODate(...),          # server time of this acquisition
      renewed_at:    ISODate(...),          # server time of the last renewal
      hold_until:    ISODate(...),          # a release before this keeps the key taken until then
      released_at:   ISODate(...) | null,   # server time of the release, when released
      forced_release: bool,                 # released by an operator (force_release)
      released_for:  "holder died" | "given back unrun" | null,  # released for a dead holder, or unrun
      last_tick:     int,                   # once-per-tick acquisitions: the last tick that took the key
      holder:        {host, pid, ...info}   # who holds it: host, pid, and e.g. task_name, task_id
      waited_ms:     int | null,            # how long this run waited for the key (null: unknown)
      ends:          [ending, ...]          # the last 8 endings of this key's leases, oldest first
    }

An ending (``ending_expr``) is written by the same command that ends a lease: a release, a supervisor's
release for a dead holder, a force-release, or the acquire that takes over an expired lease. Only one
ending is written per fence (a second ending command for the same acquisition leaves ``ends`` alone)::

    {f: fence, t: task_id, n: task_name (or role), run: delivery, host, pid, worker,
     a: acquired_at, e: ended_at (server time; for "expired" the old expires_at), w: waited ms,
     how: "released" | "holder-died" | "forced" | "expired", seen: takeover time ("expired" only),
     for: the newer send the holder's body stopped for ("released" only, ``Replace(cancel_running=True)``)}

Expiry is always judged on the server's clock (``$$NOW``) inside the write that depends on it. Dates are
compared through ``$toLong``: equivalent on MongoDB, and it sidesteps a date-comparison bug of the
embedded test server.

Fencing tokens
==============
``fence = max(previous fence + 1, server time in ms * 1000)``. The first term makes it strictly increase
while the document exists; the second makes it strictly increase after the document was deleted (by the
TTL index, which only removes leases whose ``expires_at`` is past, or by hand): a fresh document starts
from the server's clock, which has moved on since the deleted lease was taken. The one assumption is the
one every lease makes: the server's clock does not step backwards.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import bson

from celery_mongolock.core.documents.copies import ran_any, seen_append
from celery_mongolock.core.documents.handoff import release_handoff_stages
from celery_mongolock.core.documents.key_state import NO_SLOT_HELD, gc_stage, own_lease, own_live_lease
from celery_mongolock.core.documents.lanes import spilled_total
from celery_mongolock.core.documents.reading import lease_info, prefix_filter, read_pipeline, story_pipeline
from celery_mongolock.core.documents.records import (
    HOLDER_VIEW,
    RUN_VIEW,
    SERVER_VIEW,
    history_id,
    history_record,
    run_history_id,
    run_record,
    slots_expired_by,
)
from celery_mongolock.exceptions import ConfigurationError

__all__ = [
    "ACQUIRE_PROJECTION",
    "ENDS_KEPT",
    "HOLDER_VIEW",
    "MAX_INFO_BYTES",
    "NOT_EXPIRED",
    "RUN_VIEW",
    "SERVER_VIEW",
    "TAKEOVER_ENDINGS",
    "Document",
    "acquire_fields",
    "acquire_filter",
    "acquire_pipeline",
    "ended_by_takeover",
    "ending_expr",
    "force_release_filter",
    "force_release_pipeline",
    "held_by_filter",
    "history_id",
    "history_record",
    "holder_info",
    "lease_info",
    "prefix_filter",
    "read_pipeline",
    "release_dead_holder_pipeline",
    "release_filter",
    "release_pipeline",
    "release_tokens_filter",
    "renew_filter",
    "renew_pipeline",
    "renew_tokens_filter",
    "run_history_id",
    "run_record",
    "slots_expired_by",
    "story_pipeline",
]

Document = dict[str, Any]

#: Info values stored with the holder are for humans: keep them small.
MAX_INFO_BYTES = 4096

_NOW_MS: Document = {"$toLong": "$$NOW"}

#: How many endings a lease document keeps in ``ends``.
ENDS_KEPT = 8

#: The endings a command writes for a lease it found lapsed (its holder stopped renewing, or the run it
#: was handed to never claimed it) while handing the key on: nobody else records them
#: (``Records.record_endings``).
TAKEOVER_ENDINGS = ("expired", "handoff-expired")

#: The fence of the last ending recorded (missing when there is none).
_LAST_ENDED_FENCE: Document = {
    "$let": {"vars": {"last": {"$arrayElemAt": [{"$ifNull": ["$ends", []]}, -1]}}, "in": "$$last.f"}
}
#: True while the current acquisition (``fence``) has no ending recorded yet.
NOT_ENDED: Document = {"$ne": [_LAST_ENDED_FENCE, "$fence"]}


def ending_expr(how: str, ended_at: object = "$$NOW", **extra: object) -> Document:
    """The ending of the lease as the document holds it *before* the update (``$fence``, ``$holder``...).

    Fields that are missing in the document (no task id outside Celery, ``waited_ms`` unknown) are left
    out of the ending by the server.
    """
    ending: Document = {
        "f": "$fence",
        "t": "$holder.task_id",
        "n": {"$ifNull": ["$holder.task_name", "$holder.role"]},
        "run": "$holder.delivery",
        "host": "$holder.host",
        "pid": "$holder.pid",
        "worker": "$holder.worker",
        "a": "$acquired_at",
        "e": ended_at,
        "w": "$waited_ms",
        "how": {"$literal": how},
    }
    ending.update(extra)
    return ending


def _append_ending(when: object, ending: Document) -> Document:
    """``ends`` with ``ending`` appended (the last ``ENDS_KEPT`` kept) when ``when`` is true and this
    acquisition has no ending yet; else ``ends`` as it was."""
    appended = {"$slice": [{"$concatArrays": [{"$ifNull": ["$ends", []]}, [ending]]}, -ENDS_KEPT]}
    return {"$cond": [{"$and": [when, NOT_ENDED]}, appended, "$ends"]}


#: A renewal only extends a lease that has not expired on the server: a renewal that arrives late (its
#: reply lost, or queued on the server) must not revive a lease its holder has already given up.
NOT_EXPIRED: Document = {"$expr": {"$gt": [{"$toLong": "$expires_at"}, _NOW_MS]}}


def holder_info(host: str, pid: int, info: Mapping[str, Any] | None) -> Document:
    """The ``holder`` sub-document: ``host``, ``pid`` and the caller's ``info`` (checked: plain keys,
    storable, at most ``MAX_INFO_BYTES`` encoded)."""
    holder: Document = {"host": host, "pid": pid}
    if info is not None and not isinstance(info, Mapping):
        raise ConfigurationError(f"holder info must be a dict, got {type(info).__name__}")
    if info:
        for k, v in info.items():
            if not isinstance(k, str) or not k or k.startswith("$") or "." in k:
                raise ConfigurationError(f"holder info key {k!r} must be a plain non-empty string")
            holder[k] = v
        try:
            size = len(bson.encode(holder))
        except Exception as exc:
            raise ConfigurationError(f"holder info cannot be stored in MongoDB: {exc}") from None
        if size > MAX_INFO_BYTES:
            raise ConfigurationError(f"holder info is {size} bytes encoded; the limit is {MAX_INFO_BYTES}")
    return holder


# -- acquire ---------------------------------------------------------------------------------------------
def acquire_filter(key: str) -> Document:
    """The acquire matches the key alone (with ``upsert``): whether it is free is decided by the pipeline."""
    return {"_id": key}


def acquire_fields(
    token: str,
    ttl_ms: int,
    holder: Document,
    *,
    tick: int | None = None,
    min_hold_ms: int = 0,
    hold_until_ms: int | None = None,
    waited_ms: int | None = None,
    waited_since_ms: int | None = None,
) -> Document:
    """The ``$set`` fields of an acquire, each ``{"$cond": ["$__free", new, old]}``: an earlier stage
    decides ``__free`` (``acquire_pipeline``, or the admit of a queued run in ``_admission``)."""
    hold_until: Document = {"$add": ["$$NOW", min_hold_ms]}
    if hold_until_ms is not None:
        # Compared as numbers: the embedded test server compares dates wrongly (see module doc).
        hold_until = {"$toDate": {"$max": [{"$add": [_NOW_MS, min_hold_ms]}, hold_until_ms]}}

    def when_free(new: object, field: str) -> Document:
        return {"$cond": ["$__free", new, f"${field}"]}

    # Our own lease (``_own_lease``): the same acquisition, with its fence and its start.
    ours = own_lease(token)

    waited: object = {"$literal": None}
    if waited_since_ms is not None:
        waited = {"$max": [0, {"$subtract": [_NOW_MS, waited_since_ms]}]}
    elif waited_ms is not None:
        waited = max(0, int(waited_ms))
    # An expired lease taken over: its holder is set and is not us (our own half-finished acquisition).
    taken_over = {
        "$and": [
            "$__free",
            {"$ne": [{"$ifNull": ["$owner", None]}, None]},
            {"$ne": ["$owner", {"$literal": token}]},
        ]
    }
    fields: Document = {
        "owner": when_free({"$literal": token}, "owner"),
        "ttl_ms": when_free(ttl_ms, "ttl_ms"),
        "holder": when_free({"$literal": holder}, "holder"),
        "fence": when_free(
            {
                "$cond": [
                    ours,
                    "$fence",
                    {"$max": [{"$add": [{"$ifNull": ["$fence", 0]}, 1]}, {"$multiply": [_NOW_MS, 1000]}]},
                ]
            },
            "fence",
        ),
        "expires_at": when_free({"$add": ["$$NOW", ttl_ms]}, "expires_at"),
        "acquired_at": when_free({"$cond": [ours, "$acquired_at", "$$NOW"]}, "acquired_at"),
        "renewed_at": when_free("$$NOW", "renewed_at"),
        "hold_until": when_free(hold_until, "hold_until"),
        "released_at": when_free({"$literal": None}, "released_at"),
        "forced_release": when_free({"$literal": False}, "forced_release"),
        "released_for": when_free({"$literal": None}, "released_for"),
        "waited_ms": when_free(waited, "waited_ms"),
        "ends": _append_ending(taken_over, ending_expr("expired", "$expires_at", seen="$$NOW")),
    }
    if tick is not None:
        fields["last_tick"] = when_free(tick, "last_tick")
    return fields


def acquire_pipeline(
    token: str,
    ttl_ms: int,
    holder: Document,
    *,
    tick: int | None = None,
    min_hold_ms: int = 0,
    hold_until_ms: int | None = None,
    waited_ms: int | None = None,
    waited_since_ms: int | None = None,
    ended_runs: Sequence[str] = (),
) -> list[Document]:
    """The acquire update: on the server, ``free = owner is null OR expired OR owner == token``; only when
    free, take the key for ``token`` (new fence, ``expires_at = $$NOW + ttl_ms``); else change nothing.

    ``owner == token`` lets a retry of an acquire whose reply was lost take over its own half-finished
    acquisition, with the fence it got then (``_own_lease``); if that lease has expired
    meanwhile and runs are parked on the key, the retry gives it up instead (owner cleared, its ending
    recorded): the key goes to the oldest of them. ``tick``: refuse a tick at or before the last tick
    that took the key, even when free.
    ``min_hold_ms``/``hold_until_ms`` (epoch ms): a release before then keeps the key taken until then.
    ``waited_ms``: how long the run waited for the key, when the caller knows; ``waited_since_ms`` (epoch
    ms, the caller's clock): when the run first found the key held, the wait is counted from then to the
    server's ``$$NOW`` (never below 0). Neither: ``waited_ms`` is null (unknown).

    A key with parked runs or a pending handoff (``_admission``) is not free for this acquire: the key
    goes to the parked runs first, in send order, and nobody barges in.

    Taking over a lease that expired with its holder still set records that lease's ending ("expired",
    ended at its ``expires_at``, ``seen`` at ``$$NOW``) in ``ends``, in this same update.

    ``ended_runs``: the run ids of a copy (a redelivered or parked message, ``task.py``); the key is not
    free for it when one of them is remembered as over (``_ran_any``).
    """
    fields = acquire_fields(
        token,
        ttl_ms,
        holder,
        tick=tick,
        min_hold_ms=min_hold_ms,
        hold_until_ms=hold_until_ms,
        waited_ms=waited_ms,
        waited_since_ms=waited_since_ms,
    )
    ours = own_lease(token)
    given_up = {"$and": [{"$not": ["$__free"]}, ours]}
    give_up = {
        "$set": {
            "owner": {"$cond": [given_up, None, "$owner"]},
            "ends": _append_ending(given_up, ending_expr("expired", "$expires_at", seen="$$NOW")),
        }
    }
    return [
        {"$set": {"__free": _free_for(token, tick=tick, ended_runs=ended_runs)}},
        {"$set": fields},
        give_up,
        {"$unset": "__free"},
        gc_stage(),
    ]


def _free_for(token: str, *, tick: int | None, ended_runs: Sequence[str]) -> Document:
    """The key is free for the acquire of ``token`` (``acquire_pipeline``)."""
    vacant: Document = {
        "$or": [
            {"$eq": [{"$ifNull": ["$owner", None]}, None]},
            {"$lte": [{"$toLong": "$expires_at"}, _NOW_MS]},
        ]
    }
    no_slot_held = NO_SLOT_HELD
    nobody_waits: Document = {
        "$and": [
            {"$eq": [{"$size": {"$ifNull": ["$q", []]}}, 0]},
            {"$eq": [{"$ifNull": ["$ho", None]}, None]},
            {"$eq": [spilled_total(), 0]},  # runs spilled beyond the window (``spill``) wait too
            no_slot_held,  # a key taken with limit=N (``_slots``) is not free for a single lease
        ]
    }
    vacant = {"$and": [vacant, nobody_waits]}
    if tick is not None:
        # Once per tick: a run for a tick at or before the last one run is refused even when free.
        vacant = {"$and": [vacant, {"$lt": [{"$ifNull": ["$last_tick", -1]}, tick]}]}
    if ended_runs:
        # A copy of a run that ended: never a new run, whenever the release landed (issue 32).
        vacant = {"$and": [vacant, {"$not": [ran_any(ended_runs)]}]}
    # Our own lease, taken by an earlier attempt whose reply was lost: ours while it lives; once expired,
    # only if nobody waits for the key (else ``acquire_pipeline`` gives it up: it goes to the oldest
    # parked run).
    ours = own_lease(token)
    return {"$or": [own_live_lease(token), {"$and": [ours, nobody_waits]}, vacant]}


#: What the acquire's reply carries: the document with only its newest ending (the one a takeover of an
#: expired lease has just written), so that the reply does not grow with the history.
ACQUIRE_PROJECTION: Document = {"ends": {"$slice": -1}}


def ended_by_takeover(doc: Mapping[str, Any] | None) -> Document | None:
    """The ending an acquire just wrote for the expired lease it took over, from the acquire's reply
    (``ACQUIRE_PROJECTION``): the newest ending is "expired" and was seen at this acquisition's time."""
    if not doc:
        return None
    ends = doc.get("ends") or []
    last = ends[-1] if ends else None
    if (
        isinstance(last, dict)
        and last.get("how") == "expired"
        and last.get("seen") is not None
        and last.get("seen") == doc.get("acquired_at")
    ):
        return dict(last)
    return None


# -- renew -----------------------------------------------------------------------------------------------
def renew_filter(key: str, token: str) -> Document:
    """One lease, still ours and not expired on the server."""
    return {"_id": key, "owner": token, **NOT_EXPIRED}


def renew_tokens_filter(tokens: Iterable[str]) -> Document:
    """Every lease of ``tokens`` still ours and not expired (the heartbeat's one update per tick)."""
    return {"owner": {"$in": list(tokens)}, **NOT_EXPIRED}


def renew_pipeline() -> list[Document]:
    """Extend by the lease's own ``ttl_ms`` from now, on the server's clock."""
    return [
        {"$set": {"expires_at": {"$add": ["$$NOW", "$ttl_ms"]}, "renewed_at": "$$NOW"}},
        gc_stage(),
    ]


# -- release ---------------------------------------------------------------------------------------------
def release_filter(key: str, token: str) -> Document:
    """Nobody can release a lease they do not hold: matched on ``{_id, owner}``."""
    return {"_id": key, "owner": token}


def release_tokens_filter(tokens: Iterable[str]) -> Document:
    """The leases of ``tokens`` (the heartbeat's background releases, one update for all)."""
    return {"owner": {"$in": list(tokens)}}


#: ``released_for`` of a key given back by a run that did not run (or was cut short): its holder is not
#: the last run that ended there.
GIVEN_BACK = "given back unrun"


def release_pipeline(
    by: str = "",
    *,
    seen: bool = True,
    superseded_by: str | None = None,
    unrun: bool = False,
    untick: int | None = None,
) -> list[Document]:
    """Clear the owner and keep the document (and so the fence); a lease whose ``hold_until`` has not
    passed stays taken (owner kept) and simply expires then.

    With runs parked on the key, the same command hands it to the oldest (``_admission``), marked with
    ``by`` (the releaser's token: it publishes the handoff; empty: the sweeper does). ``seen=False`` (a
    key given back by a run that never ran) keeps no minimum hold either: it held the key for nobody.
    ``superseded_by``: the holder's body stopped for this newer send (``Replace(cancel_running=True)``);
    its ending says so (``for``). ``unrun``: a key given back by its run (``LeaseStore.give_back``: an
    attempt that did not run its body, or a body cut short), marked ``released_for: GIVEN_BACK`` so that
    its holder is not taken for a run that ended (``outcomes.run_ended``); not a lease released unseen in
    the background (lost, or its acquire unanswered: its run may have run). ``untick``: the beat tick of a
    run given back unrun: if the key's ``last_tick`` is that tick, it goes back below it, so that the
    run's message, delivered again, runs the tick instead of finding it already run."""
    ending = ending_expr("released", **({"for": {"$literal": superseded_by}} if superseded_by else {}))
    untick_field: Document = (
        {}
        if untick is None
        else {"last_tick": {"$cond": [{"$eq": ["$last_tick", int(untick)]}, int(untick) - 1, "$last_tick"]}}
    )
    holding = {"$gt": [{"$toLong": {"$ifNull": ["$hold_until", 0]}}, _NOW_MS]} if seen else False
    return [
        {"$set": {"__hold": holding}},
        {
            "$set": {
                "owner": {"$cond": ["$__hold", "$owner", None]},
                "expires_at": {"$cond": ["$__hold", "$hold_until", "$expires_at"]},
                "released_at": "$$NOW",
                "ends": _append_ending(True, ending),
                # the run is over, even if the key stays taken (``seen=False``: a key given back by a
                # run that has not run yet, see ``LeaseStore.give_back``)
                "seen": seen_append(seen),
                # a key given back unrun: its holder did not end a run (``outcomes.run_ended``)
                **({"released_for": GIVEN_BACK} if unrun else {}),
                **untick_field,
            }
        },
        *release_handoff_stages(by, keep_when="$__hold"),
        {"$unset": "__hold"},
        gc_stage(),
    ]


def held_by_filter(holder: Mapping[str, Any]) -> Document:
    """Held leases whose holder info matches every field of ``holder``."""
    if not holder:
        raise ConfigurationError("release_held_by needs at least one holder field to match")
    match: Document = {f"holder.{k}": v for k, v in holder.items()}
    match["owner"] = {"$ne": None}
    return match


def release_dead_holder_pipeline(by: str = "") -> list[Document]:
    """Release for a holder that died (a supervisor's release): marked ``released_for``; handed to the
    oldest parked run, if any (see ``release_pipeline``)."""
    return [
        {
            "$set": {
                "owner": None,
                "released_at": "$$NOW",
                "released_for": "holder died",
                "ends": _append_ending(True, ending_expr("holder-died")),
            }
        },
        *release_handoff_stages(by),
        gc_stage(),
    ]


def force_release_filter(key: str) -> Document:
    """``key`` if anyone holds it."""
    return {"_id": key, "owner": {"$ne": None}}


def force_release_pipeline(by: str = "") -> list[Document]:
    """An operator's release, whoever holds the key; marked ``forced_release``. The fence is kept; the
    key is handed to the oldest parked run, if any (see ``release_pipeline``)."""
    return [
        {
            "$set": {
                "owner": None,
                "released_at": "$$NOW",
                "forced_release": True,
                "ends": _append_ending(True, ending_expr("forced")),
            }
        },
        *release_handoff_stages(by),
        gc_stage(),
    ]
