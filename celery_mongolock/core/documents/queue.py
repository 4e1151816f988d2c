"""Per-key admission: the parked runs of a key and the handoff, as pure pipeline builders (no I/O).

A run of a ``Queue`` or ``Replace`` task that finds its key held is **parked**: one entry in the lease
document's ``q`` array, kept in send order, carrying the run's message. When the key is released (by the
holder, the worker's parent for a dead child, an operator, or found expired), the *same command* hands it
to the oldest parked run: ``owner`` becomes a token reserved for that run (``tk``), the fence goes up, and
the entry moves to ``ho`` (a handoff not yet taken up). Whoever sees the handoff in the command's reply
(the releaser, or the sweeper for a handoff nobody published) publishes the run's message again; the run
then **claims** the key (``owner: tk`` -> its own token). No newcomer can take the key in between: every
acquire refuses a key with parked runs or a pending handoff.

Fields added to the lease document (see ``_documents`` for the rest)::

    q:     [entry, ...]     # parked runs, oldest send first (by (s, id))
    ho:    entry + {hat, hn, by} | null   # a handoff not yet claimed: handed at, attempt, by whom
    seen:  [run id, ...]    # the last SEEN_KEPT runs that ended with a normal release (duplicate guard)
    dead:  [entry, ...]     # parked runs past their deadline, whose result is not yet written
    sup:   [{t, by, at, n, r, pa}, ...] # Replace: runs superseded by a newer send (at; parked at pa),
                            # result not yet written
    last:  {s, t}           # Replace: the newest send that got the key (kept as long as ``seen``)
    cx:    {o, f, t, s, id, at} | null  # Replace(cancel_running=True): the running holder (token o)
                            # superseded by the newer run t (``cancel_mark``)
    wq:    true | absent    # something waits on this key (indexed: the sweeper's work list)
    gc_at: date | null      # the TTL index's field: expires_at when nothing waits, else null

An entry::

    {id: "<task id>/<delivery>", t: task id, n: task name, r: delivery, s: send stamp (int, us),
     src: where the stamp came from, tk: handoff token, ttl: lease ms, at: parked at, dl: deadline | null,
     th: "skip" | "fail", m: the message (Binary, the task's serializer) , ct: content type, ce: encoding}

All time is the server's (``$$NOW``); dates are compared through ``$toLong``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from celery_mongolock.core.documents import sets

__all__ = [
    "ADMIT_OUTCOMES",
    "ADMIT_PROJECTION",
    "HANDOFF_PROJECTION",
    "MAX_PARKED",
    "SEEN_KEPT",
    "WAITS",
    "admit_marker",
    "admit_pipeline",
    "cancel_mark",
    "gc_stage",
    "handoff_stages",
    "later_attempt",
    "ran",
    "ran_any",
    "retries_of",
    "run_id",
]

Document = dict[str, Any]

_NOW_MS: Document = {"$toLong": "$$NOW"}
_Q: Document = {"$ifNull": ["$q", []]}
#: The most runs parked on one key (``Queue(max_length=...)`` may say fewer): a parked run's entry carries
#: its message, and all of a key's entries share one document.
MAX_PARKED = 5000
#: How long after its last lease a key that remembers finished queued runs (``seen``) or the newest
#: ``Replace`` send that got it (``last``) is kept: longer than a Redis broker's default visibility
#: timeout (1 h), after which an unacknowledged message is delivered again. Within it, a late copy is
#: recognised and an older ``Replace`` send delivered late is superseded; past it, the key is forgotten.
SEEN_KEEP_MS = 2 * 3600 * 1000
#: How many normally released runs a key remembers, to drop a late copy of one of their messages.
SEEN_KEPT = 128
_BIG = 1 << 30

#: What an admit's reply carries: not the parked runs' messages, not the histories.
ADMIT_PROJECTION: Document = {"q.m": 0, "seen": 0, "ends": 0, "dead": 0}
#: What a release's reply carries: enough to publish a handoff it made.
HANDOFF_PROJECTION: Document = {"ho": 1, "owner": 1, "fence": 1, "sup": 1}

#: What the admit pipeline can decide (``__o`` in the reply's ``lo``).
ADMIT_OUTCOMES = (
    "acquired",  # the run took the key (it was free and nobody older waits)
    "claimed",  # the run took the key handed to it
    "due",  # Replace(debounce=...): the run's delayed copy took the key for its parked entry
    "dup",  # a copy of a run that is parked or handed: drop it
    "done",  # a copy of a run that already ran and released: drop it
    "running",  # a copy of the run that holds the key now
    "retried",  # a copy of an attempt whose body retried: a later attempt is known on the key; drop it
    "stale",  # a handoff message of a run no longer parked or handed: drop it
    "parked",  # parked (and, when the key was found free with older runs parked, handed to the oldest)
    "full",  # the queue is at max_length: the policy's ``then``
    "superseded",  # Replace: a newer send exists; this run ends superseded
)

#: True when something waits on the key: parked runs, a pending handoff, results not yet written.
WAITS: Document = {
    "$or": [
        {"$gt": [{"$size": _Q}, 0]},
        {"$ne": [{"$ifNull": ["$ho", None]}, None]},
        {"$gt": [{"$size": {"$ifNull": ["$dead", []]}}, 0]},
        {"$gt": [{"$size": {"$ifNull": ["$sup", []]}}, 0]},
        # limit=N: a slot handed to a parked run that has not claimed it
        {
            "$gt": [
                {
                    "$size": {
                        "$filter": {
                            "input": {"$ifNull": ["$hs", []]},
                            "as": "e",
                            "cond": {"$ne": [{"$ifNull": ["$$e.ho", None]}, None]},
                        }
                    }
                },
                0,
            ]
        },
    ]
}


def run_id(task_id: str, delivery: str) -> str:
    """One run of a task id (its own retries and contention retries): what duplicates are matched on."""
    return f"{task_id}/{delivery}"


def admit_marker(token: str) -> str:
    """How an admit marks the handoffs it makes (``ho.by``), so that its author publishes them: derived
    from the run's token but never equal to it, since the token becomes the owner of the hold the admit
    takes, and that hold's release (marked with the owner's token) must not take pending handoffs made
    by the admit for its own and publish them a second time."""
    return f"admit:{token}"


def own_lease(token: str) -> Document:
    """The key is held by ``token``: an earlier attempt of this very acquire (or admit) landed and its
    reply was lost (a dropped connection, a server killed before replying). Taking it again is the same
    acquisition, not a new one: it keeps its fence, so a run parked meanwhile, behind it, has a fence
    no smaller than the holder's."""
    return {"$eq": [{"$ifNull": ["$owner", None]}, {"$literal": token}]}


def own_live_lease(token: str) -> Document:
    """``own_lease`` and not expired: ours again whoever waits. One that expired meanwhile is free like
    any expired lease, and goes to the runs parked on the key first (no barging), as an expired
    ``limit=N`` slot of ours does (``_slots``)."""
    return {"$and": [own_lease(token), {"$gt": [{"$toLong": "$expires_at"}, _NOW_MS]}]}


def gc_stage() -> Document:
    """The last stage of every pipeline that writes a lease document: ``wq`` and ``gc_at``.

    The TTL index is on ``gc_at``: a document is deleted only when nothing waits on it, so parked runs
    (whose messages were acknowledged) are never deleted with it.
    """
    # What a late message is judged on: the runs that ended (``seen``), and the newest Replace send that
    # got the key (``last``: an older send delivered late is superseded, never run over it; seed 20 of
    # the lock-set checker, where a key whose runs had all ended without a normal release was deleted
    # 60 s after its last lease and an older send, delivered 164 s late, took it).
    remembers = {
        "$or": [
            {"$gt": [{"$size": {"$ifNull": ["$seen", []]}}, 0]},
            {"$ne": [{"$ifNull": ["$last", None]}, None]},
            {"$gt": [{"$size": {"$ifNull": ["$lg", []]}}, 0]},
        ]
    }
    # The later of the single lease's expiry and the latest slot hold's (``limit=N``: ``sx``). Compared as
    # milliseconds: the embedded server's ``$max`` of a date stored and a date computed from ``$$NOW`` in
    # this pipeline returns its first argument, whichever is later.
    latest_ms = {"$max": [{"$toLong": "$expires_at"}, {"$toLong": "$sx"}]}
    latest = {"$ifNull": [{"$toDate": latest_ms}, "$expires_at"]}
    return {
        "$set": {
            "wq": {"$cond": [WAITS, True, "$$REMOVE"]},
            "gc_at": {
                "$cond": [
                    WAITS,
                    None,
                    # A key that remembers finished queued runs or a Replace send keeps that memory (the
                    # duplicate guard, Replace's order) longer than a broker may take to deliver a
                    # message again.
                    {"$cond": [remembers, {"$add": [latest, SEEN_KEEP_MS]}, latest]},
                ]
            },
        }
    }


def field_of(field: str, doc: object) -> Document:
    return {"$getField": {"field": field, "input": doc}}


def _entry_expired(e: object) -> Document:
    dl = {"$ifNull": [field_of("dl", e), None]}
    return {"$and": [{"$ne": [dl, None]}, {"$lte": [{"$toLong": dl}, _NOW_MS]}]}


def entry_before(e: object, stamp: int, ident: str) -> Document:
    """Entry ``e`` sorts before a run with send stamp ``stamp`` and id ``ident`` ((s, id) order)."""
    s_, id_ = field_of("s", e), field_of("id", e)
    return {
        "$or": [
            {"$lt": [s_, stamp]},
            {"$and": [{"$eq": [s_, stamp]}, {"$lt": [id_, {"$literal": ident}]}]},
        ]
    }


def dead_entries(q: object) -> Document:
    """Entries of ``q`` past their deadline, without their messages (for ``dead``)."""
    return {
        "$map": {
            "input": {"$filter": {"input": q, "as": "e", "cond": _entry_expired("$$e")}},
            "as": "e",
            "in": {
                "id": "$$e.id",
                "t": "$$e.t",
                "n": "$$e.n",
                "s": "$$e.s",
                "at": "$$e.at",
                "dl": "$$e.dl",
                "th": "$$e.th",
            },
        }
    }


def entry_due(e: object) -> Document:
    """Entry ``e`` may start now: it has no not-before time (``Replace(debounce=...)``) or it has passed."""
    nb = {"$ifNull": [field_of("nb", e), None]}
    return {"$or": [{"$eq": [nb, None]}, {"$lte": [{"$toLong": nb}, _NOW_MS]}]}


#: No ``limit=N`` hold of the key is live or handed to a parked run (a queued run never takes or claims
#: a key while slots are held).
NO_SLOT_HELD: Document = {
    "$eq": [
        {
            "$size": {
                "$filter": {
                    "input": {"$ifNull": ["$hs", []]},
                    "as": "e",
                    "cond": {
                        "$or": [
                            {"$gt": [{"$toLong": "$$e.x"}, _NOW_MS]},
                            {"$ne": [{"$ifNull": ["$$e.ho", None]}, None]},
                        ]
                    },
                }
            }
        },
        0,
    ]
}


#: The key is held as a single lease, or handed to a parked run that has not claimed it yet (even past
#: its expiry: the sweeper hands it again): no ``limit=N`` slot may be taken or claimed meanwhile.
SINGLE_HELD: Document = {
    "$and": [
        {"$ne": [{"$ifNull": ["$owner", None]}, None]},
        {
            "$or": [
                {"$gt": [{"$toLong": "$expires_at"}, _NOW_MS]},
                {"$ne": [{"$ifNull": ["$ho", None]}, None]},
            ]
        },
    ]
}


def live_entries(q: object) -> Document:
    return {"$filter": {"input": q, "as": "e", "cond": {"$not": [_entry_expired("$$e")]}}}


#: How many endings a lease document keeps in ``ends`` (``_documents.ENDS_KEPT``).
_ENDS_KEPT = 8


def _expired_ending(when: object) -> Document:
    """``ends`` with the ending of the lease found expired (its holder stopped renewing, or the run it was
    handed to never claimed it: ``handoff-expired``) appended when ``when`` and it has none yet; in the
    shape of ``_documents.ending_expr`` (ended at its ``expires_at``, ``seen`` now)."""
    handed = {"$and": [{"$ne": [{"$ifNull": ["$ho", None]}, None]}, {"$eq": ["$owner", "$ho.tk"]}]}
    ending = {
        "f": "$fence",
        "t": "$holder.task_id",
        "n": {"$ifNull": ["$holder.task_name", "$holder.role"]},
        "run": "$holder.delivery",
        "host": "$holder.host",
        "pid": "$holder.pid",
        "worker": "$holder.worker",
        "a": "$acquired_at",
        "e": "$expires_at",
        "w": "$waited_ms",
        "how": {"$cond": [handed, "handoff-expired", "expired"]},
        "seen": "$$NOW",
    }
    last_fence = {
        "$let": {"vars": {"last": {"$arrayElemAt": [{"$ifNull": ["$ends", []]}, -1]}}, "in": "$$last.f"}
    }
    expired = {
        "$and": [
            when,
            {"$ne": [{"$ifNull": ["$owner", None]}, None]},
            {"$lte": [{"$toLong": "$expires_at"}, _NOW_MS]},
            {"$ne": [last_fence, "$fence"]},
        ]
    }
    appended = {"$slice": [{"$concatArrays": [{"$ifNull": ["$ends", []]}, [ending]]}, -_ENDS_KEPT]}
    return {"$cond": [expired, appended, "$ends"]}


def handoff_stages(
    hand: object, queue: object, by: str, base: list[Document] | None = None
) -> list[Document]:
    """Stages that, when ``hand`` is true, give the key to the oldest live entry of ``queue`` (an
    expression evaluated against the document as it is before these stages).

    Entries of ``queue`` past their deadline move to ``dead`` (results written by the sweeper); the rest
    stay parked in ``q``. With no live entry left, the key stays as the earlier stages left it. ``by``
    marks the handoff, so that the command's author can tell from the reply that the handoff is its to
    publish. ``base`` are stages to run before these (they may set ``__``-fields read here).
    """
    stages = list(base or [])
    stages.append(
        {
            "$set": {
                "__hq": {"$cond": [hand, queue, None]},
                # A key handed over because its lease expired: that lease's ending, in this same command.
                "ends": _expired_ending(hand),
            }
        }
    )
    stages.append(
        {
            "$set": {
                "__live": {"$cond": ["$__hq", live_entries("$__hq"), None]},
                "dead": {
                    "$cond": [
                        "$__hq",
                        {"$concatArrays": [{"$ifNull": ["$dead", []]}, dead_entries("$__hq")]},
                        "$dead",
                    ]
                },
            }
        }
    )
    head = {"$arrayElemAt": ["$__live", 0]}
    stages.append(
        {
            "$set": {
                "__head": {
                    "$cond": [
                        {"$and": [{"$gt": [{"$size": {"$ifNull": ["$__live", []]}}, 0]}, entry_due(head)]},
                        head,
                        None,
                    ]
                },
            }
        }
    )

    def when_head(new: object, old: object) -> Document:
        return {"$cond": [{"$ne": ["$__head", None]}, new, old]}

    fence = {"$max": [{"$add": [{"$ifNull": ["$fence", 0]}, 1]}, {"$multiply": [_NOW_MS, 1000]}]}
    stages.append(
        {
            "$set": {
                "q": {
                    "$cond": [
                        {"$ne": ["$__head", None]},
                        {"$slice": ["$__live", 1, _BIG]},
                        {"$cond": ["$__hq", "$__live", "$q"]},
                    ]
                },
                "owner": when_head("$__head.tk", "$owner"),
                "ho": when_head(
                    {
                        "$mergeObjects": [
                            "$__head",
                            {
                                "hat": "$$NOW",
                                "hn": {"$add": [{"$ifNull": ["$__head.hn", 0]}, 1]},
                                "by": {"$literal": by},
                            },
                        ]
                    },
                    {"$cond": ["$__hq", None, "$ho"]},
                ),
                "fence": when_head(fence, "$fence"),
                "ttl_ms": when_head("$__head.ttl", "$ttl_ms"),
                "expires_at": when_head({"$add": ["$$NOW", "$__head.ttl"]}, "$expires_at"),
                "acquired_at": when_head("$$NOW", "$acquired_at"),
                "renewed_at": when_head("$$NOW", "$renewed_at"),
                "hold_until": when_head("$$NOW", "$hold_until"),
                "released_for": when_head(None, "$released_for"),
                "forced_release": when_head(False, "$forced_release"),
                "waited_ms": when_head(
                    {"$max": [0, {"$subtract": [_NOW_MS, {"$toLong": "$__head.at"}]}]}, "$waited_ms"
                ),
                "holder": when_head(
                    {
                        "task_id": "$__head.t",
                        "task_name": "$__head.n",
                        "delivery": "$__head.r",
                        "handed": True,
                    },
                    "$holder",
                ),
            }
        }
    )
    stages.append({"$unset": ["__hq", "__live", "__head"]})
    return stages


def release_handoff_stages(by: str, *, keep_when: object = False) -> list[Document]:
    """After a release (owner cleared) or for a key found vacant: hand it to the oldest parked run,
    re-handing an unclaimed handoff first. ``keep_when``: an expression under which nothing is handed
    (e.g. a release that keeps the key until ``hold_until``)."""
    vacant = {
        "$and": [
            {
                "$or": [
                    {"$eq": [{"$ifNull": ["$owner", None]}, None]},
                    {"$lte": [{"$toLong": "$expires_at"}, _NOW_MS]},
                ]
            },
            NO_SLOT_HELD,
        ]
    }
    has_ho = {"$ne": [{"$ifNull": ["$ho", None]}, None]}
    queue = requeue_handoff()
    hand = {
        "$and": [
            {"$not": [keep_when]},
            vacant,
            {"$or": [has_ho, {"$gt": [{"$size": _Q}, 0]}]},
        ]
    }
    return handoff_stages(hand, queue, by)


def _unhanded(ho: str) -> str:
    """A pending handoff back as a parked entry: it keeps its attempt count ``hn``; ``hat`` and ``by``
    are set again when it is handed."""
    return ho


def _before_entry(e: object, other: object) -> Document:
    """Entry ``e`` sorts before entry ``other`` ((s, id) order), both expressions."""
    return {
        "$or": [
            {"$lt": [field_of("s", e), field_of("s", other)]},
            {
                "$and": [
                    {"$eq": [field_of("s", e), field_of("s", other)]},
                    {"$lt": [field_of("id", e), field_of("id", other)]},
                ]
            },
        ]
    }


def requeue_handoff() -> Document:
    """The parked runs with the pending handoff put back among them, to be handed again: first (a run
    that was handed the key keeps it), except a reservation of a run that needs several keys
    (``ks``), which goes back in send order, so that an older run that needs the same key is handed it
    first (the way a reservation held while its run waits for other keys cannot deadlock: see
    ``reserve_pipeline``)."""
    has_ho = {"$ne": [{"$ifNull": ["$ho", None]}, None]}
    multi = {"$isArray": "$ho.ks"}
    in_order = {
        "$concatArrays": [
            {"$filter": {"input": _Q, "as": "e", "cond": _before_entry("$$e", "$ho")}},
            [_unhanded("$ho")],
            {"$filter": {"input": _Q, "as": "e", "cond": {"$not": [_before_entry("$$e", "$ho")]}}},
        ]
    }
    front = {"$concatArrays": [[_unhanded("$ho")], _Q]}
    return {"$cond": [has_ho, {"$cond": [multi, in_order, front]}, _Q]}


def reserve_pipeline(entry: Mapping[str, Any], timeout_ms: int | None, by: str) -> list[Document]:
    """A run that needs several keys (``keys=``) took this one in an attempt that found another held: the
    key becomes a *reservation* for the run's parked entry (a handoff not yet claimed, ``ho``, owner the
    entry's token ``tk``), in the same command, so the run keeps its place without running. The run is
    published once every one of its keys is reserved for it (``ks``), and claims them all.

    A reservation expires as any handoff (after the entry's lease time) and is handed again in send
    order (``requeue_handoff``): an older run that needs this key and was parked later (a late message)
    gets it first. So two runs that reserve overlapping keys in different orders cannot wait on each
    other for longer than a lease."""
    e = entry_expr(entry, timeout_ms)
    ho = {"$mergeObjects": [e, {"hat": "$$NOW", "hn": 1, "by": {"$literal": by}}]}
    return [
        {
            "$set": {
                "owner": {"$literal": entry["tk"]},
                "ho": ho,
                "ttl_ms": int(entry["ttl"]),
                "expires_at": {"$add": ["$$NOW", int(entry["ttl"])]},
                "renewed_at": "$$NOW",
                "hold_until": "$$NOW",
                "holder": {
                    "task_id": {"$literal": entry["t"]},
                    "task_name": {"$literal": entry.get("n")},
                    "delivery": {"$literal": entry.get("r")},
                    "handed": True,
                },
            }
        },
        gc_stage(),
    ]


def seen_append(when: object) -> Document:
    """``seen`` with the current holder's run appended (when ``when``), the last SEEN_KEPT kept."""
    rid = {
        "$concat": [
            {"$toString": {"$ifNull": ["$holder.task_id", ""]}},
            "/",
            {"$toString": {"$ifNull": ["$holder.delivery", ""]}},
        ]
    }
    appended = {"$slice": [{"$concatArrays": [{"$ifNull": ["$seen", []]}, [rid]]}, -SEEN_KEPT]}
    has_task = {"$ne": [{"$ifNull": ["$holder.task_id", None]}, None]}
    return {"$cond": [{"$and": [when, has_task]}, appended, "$seen"]}


def ran_any(run_ids: Sequence[str]) -> Document:
    """True when one of ``run_ids`` is remembered as over (``seen``: it ended with a normal release). The
    acquire of a copy of such a run (a redelivered or parked message) refuses the key with it, in the same
    command: a run whose release lands between the copy's look and its acquire is never run again.

    An id ending with ``.`` is a prefix (``"<task id>/<retries>."``: any contention retry of that attempt,
    see ``ran``); any other is matched whole."""
    seen = {"$ifNull": ["$seen", []]}
    tests: list[Document] = []
    for rid in run_ids:
        if rid.endswith("."):
            starts = {"$eq": [{"$indexOfCP": ["$$r", {"$literal": rid}]}, 0]}
            tests.append({"$anyElementTrue": [{"$map": {"input": seen, "as": "r", "in": starts}}]})
        else:
            tests.append({"$in": [{"$literal": rid}, seen]})
    return {"$or": tests}


def _attempt_of(delivery: object) -> Document:
    """The task's own retries of a delivery (``"2"``, or ``"2.1"`` with contention retries); -1 when it
    has none (a holder recorded without its delivery)."""
    first = {"$arrayElemAt": [{"$split": [{"$toString": {"$ifNull": [delivery, ""]}}, "."]}, 0]}
    return {"$convert": {"input": first, "to": "int", "onError": -1, "onNull": -1}}


def later_attempt(task_id: str, retries: int) -> Document:
    """True when the key knows an attempt of ``task_id`` later than ``retries`` (its body called
    ``self.retry()``, which starts attempt ``retries + 1``): parked, handed, holding the key, or ended
    (``seen``), on a single-lease key or a ``limit=N`` key (its holds and handed slots, ``hs``). A
    message of attempt ``retries`` is then a stale copy: that attempt's body ran, and the later one
    carries the task on (the lock-set checker's seed 23: a stale handoff message of a cut several-keys
    run was admitted as a new run beside its retry, and its body ran again)."""
    tid = {"$literal": task_id}
    prefix = f"{task_id}/"

    def later(task: object, delivery: object) -> Document:
        return {"$and": [{"$eq": [task, tid]}, {"$gt": [_attempt_of(delivery), retries]}]}

    parked = {"$anyElementTrue": [{"$map": {"input": _Q, "as": "e", "in": later("$$e.t", "$$e.r")}}]}
    handed = {"$and": [{"$ne": [{"$ifNull": ["$ho", None]}, None]}, later("$ho.t", "$ho.r")]}
    holding = {
        "$and": [
            {"$ne": [{"$ifNull": ["$owner", None]}, None]},
            later("$holder.task_id", "$holder.delivery"),
        ]
    }
    in_slots = {
        "$anyElementTrue": [
            {
                "$map": {
                    "input": {"$ifNull": ["$hs", []]},
                    "as": "h",
                    "in": {
                        "$or": [
                            later("$$h.h.task_id", "$$h.h.delivery"),
                            later("$$h.ho.t", "$$h.ho.r"),
                        ]
                    },
                }
            }
        ]
    }
    rest = {"$substrCP": ["$$r", len(prefix), _BIG]}
    ended = {
        "$anyElementTrue": [
            {
                "$map": {
                    "input": {"$ifNull": ["$seen", []]},
                    "as": "r",
                    "in": {
                        "$and": [
                            {"$eq": [{"$indexOfCP": ["$$r", {"$literal": prefix}]}, 0]},
                            {"$gt": [_attempt_of(rest), retries]},
                        ]
                    },
                }
            }
        ]
    }
    return {"$or": [parked, handed, holding, in_slots, ended]}


def retries_of(delivery: object) -> int | None:
    """``_attempt_of`` in Python, for an entry's ``r``; None when it has none."""
    try:
        return int(str(delivery).split(".")[0])
    except ValueError:
        return None


def ran(seen: Sequence[str], run_ids: Sequence[str]) -> bool:
    """``ran_any`` in Python, on a document's ``seen``."""
    return any(r == rid or (rid.endswith(".") and r.startswith(rid)) for rid in run_ids for r in seen)


def burst_since(older: object) -> Document:
    """When the burst of sends began waiting that a run superseding the parked entries ``older`` (an array
    expression) continues: the earliest of their ``fw`` (first wait; ``at`` for an entry without one)
    and now."""
    # (Compared as milliseconds: the embedded server compares dates in ``$reduce`` wrongly.)
    began = {"$map": {"input": older, "as": "e", "in": {"$toLong": {"$ifNull": ["$$e.fw", "$$e.at"]}}}}
    earlier = {"$cond": [{"$lt": ["$$this", "$$value"]}, "$$this", "$$value"]}
    return {"$toDate": {"$reduce": {"input": began, "initialValue": _NOW_MS, "in": earlier}}}


def _past_ceiling(e: object, max_wait_ms: int) -> Document:
    """Entry ``e`` (a handoff) began waiting ``max_wait_ms`` ago or more (``fw``)."""
    fw = {"$toLong": {"$ifNull": [field_of("fw", e), "$$NOW"]}}
    return {"$lte": [{"$add": [fw, int(max_wait_ms)]}, _NOW_MS]}


def entry_expr(
    entry: Mapping[str, Any],
    timeout_ms: int | None,
    debounce_ms: int | None = None,
    *,
    max_wait_ms: int | None = None,
    since: object = None,
) -> Document:
    """A parked entry as an aggregation expression: literal fields; ``at`` (parked at), ``dl`` (deadline)
    and ``nb`` (not before: ``Replace(debounce=...)``) on the server's clock. With ``max_wait_ms`` (and
    ``since``, the ``burst_since`` of the runs it supersedes): ``fw``, when its burst began waiting, and
    ``nb`` no later than ``fw`` + ``max_wait_ms`` (``Replace(debounce=..., max_wait=...)``)."""
    expr: Document = {k: {"$literal": v} for k, v in entry.items() if k not in ("at", "dl", "nb", "fw")}
    expr["at"] = "$$NOW"
    expr["dl"] = None if timeout_ms is None else {"$add": ["$$NOW", int(timeout_ms)]}
    if debounce_ms:
        nb: object = {"$add": ["$$NOW", int(debounce_ms)]}
        if max_wait_ms and since is not None:
            # (In milliseconds: the embedded server compares computed dates wrongly.)
            ceiling = {"$add": [{"$toLong": since}, int(max_wait_ms)]}
            debounced = {"$add": [_NOW_MS, int(debounce_ms)]}
            expr["fw"] = since
            nb = {"$toDate": {"$cond": [{"$lt": [ceiling, debounced]}, ceiling, debounced]}}
        expr["nb"] = nb
    return expr


def park_exprs(
    entry: Mapping[str, Any],
    timeout_ms: int | None,
    debounce_ms: int | None,
    *,
    replace: bool,
    max_wait_ms: int | None = None,
) -> tuple[object, object]:
    """``(q, superseded)`` when the run ``entry`` parks: the queue with its entry in send order, and the
    runs it supersedes (``Replace``: at most one parked run, a newer send replaces it, and carries on the
    time its burst began waiting: ``max_wait_ms``)."""
    ident, stamp = str(entry["id"]), int(entry["s"])
    since = burst_since(_Q) if replace and max_wait_ms else None
    e = entry_expr(entry, timeout_ms, debounce_ms, max_wait_ms=max_wait_ms, since=since)
    if replace:
        superseded: object = {
            "$map": {
                "input": _Q,
                "as": "p",
                "in": {
                    "t": "$$p.t",
                    "by": {"$literal": entry["t"]},
                    "at": "$$NOW",
                    # for the history: the run, and when it was parked
                    "n": "$$p.n",
                    "r": "$$p.r",
                    "pa": "$$p.at",
                },
            }
        }
        return [e], superseded
    in_order = {
        "$concatArrays": [
            {"$filter": {"input": _Q, "as": "e", "cond": entry_before("$$e", stamp, ident)}},
            [e],
            {"$filter": {"input": _Q, "as": "e", "cond": {"$not": [entry_before("$$e", stamp, ident)]}}},
        ]
    }
    return in_order, []


def cancel_mark(entry: Mapping[str, Any], token: str) -> Document:
    """``Replace(cancel_running=True)``: the ``cx`` field of an admit that parks ``entry`` behind a
    running holder (the key held, no handoff pending): the holder's token ``o`` and fence ``f``, the
    newer run ``t`` (its send stamp ``s``, its run id ``id``) and when (``at``). The holder's process
    reads it (the lease watch at once, or its heartbeat) and marks its lease superseded. A run that
    **claims** the key handed to it while a newer send is parked (it parked after the handoff was made)
    is marked in its claim, with its own ``token`` and the newest parked run: it starts superseded (the
    claimer reads the mark at once, ``Acquisition.admit``). A mark whose ``o`` is not the owner any more is
    stale and harmless: every reader matches it on the token::

        cx: {o: holder's token, f: holder's fence, t: newer task id, s: its stamp, id: its run id, at}
    """
    running = {
        "$and": [
            "$__park",
            {"$not": ["$__vac"]},
            {"$ne": [{"$ifNull": ["$owner", None]}, None]},
            {"$eq": [{"$ifNull": ["$ho", None]}, None]},
            {"$ne": [{"$ifNull": ["$cx.o", None]}, "$owner"]},  # the first newer send tells it
        ]
    }
    mark = {
        "o": "$owner",
        "f": "$fence",
        "t": {"$literal": entry["t"]},
        "s": {"$literal": int(entry["s"])},
        "id": {"$literal": str(entry["id"])},
        "at": "$$NOW",
    }
    newest = {"$arrayElemAt": [_Q, -1]}
    claimed_behind_a_newer_send = {
        "$and": [
            {"$eq": ["$__o", "claimed"]},
            {"$gt": [{"$ifNull": [field_of("s", newest), -1]}, int(entry["s"])]},
        ]
    }
    claim_mark = {
        "o": {"$literal": token},
        "f": "$fence",
        "t": field_of("t", newest),
        "s": field_of("s", newest),
        "id": field_of("id", newest),
        "at": "$$NOW",
    }
    return {
        "$cond": [
            running,
            mark,
            {"$cond": [claimed_behind_a_newer_send, claim_mark, {"$ifNull": ["$cx", None]}]},
        ]
    }


def admit_pipeline(
    acquire_fields: Document,
    *,
    token: str,
    entry: Mapping[str, Any],
    timeout_ms: int | None,
    claim: str | None,
    max_length: int | None,
    replace: bool = False,
    debounce_ms: int | None = None,
    due: bool = False,
    group: str | None = None,
    cancel: bool = False,
    max_wait_ms: int | None = None,
) -> list[Document]:
    """The admit: one command that acquires the key, claims a handoff, or parks the run.

    ``acquire_fields`` are the ``$set`` fields of today's acquire, each written as
    ``{"$cond": ["$__free", new, old]}``; the admit sets ``__free`` for ``acquired`` and ``claimed``.
    ``entry`` is this run (``id``, ``t``, ``s`` ... without ``at``/``dl``); ``claim`` the handoff token of
    a handed run's message; ``max_length`` the longest queue. ``debounce_ms``: every run parks, to start
    only once no newer send came for that long; ``due``: this is the run's own delayed copy, which takes
    the key if its entry is at the head, due and the key free. ``group`` (with ``replace``): the
    signature of the run's set of keys (``Replace`` with ``keys=``): supersession is decided among the
    runs of that set only (``sets``). ``cancel`` (with ``replace``, one key): a run that parks behind a
    running holder supersedes that holder too (``cx``, ``cancel_mark``). ``max_wait_ms`` (with
    ``debounce_ms``): a run that supersedes others is due no later than that long after the first of them
    began waiting. The outcome is left in ``lo`` (the reply carries it); fields starting with ``__`` are
    removed.
    """
    ident = str(entry["id"])
    stamp = int(entry["s"])
    ids = {"$map": {"input": _Q, "as": "e", "in": "$$e.id"}}
    vacant = {
        "$and": [
            {
                "$or": [
                    {"$eq": [{"$ifNull": ["$owner", None]}, None]},
                    {"$lte": [{"$toLong": "$expires_at"}, _NOW_MS]},
                ]
            },
            NO_SLOT_HELD,
        ]
    }
    has_ho = {"$ne": [{"$ifNull": ["$ho", None]}, None]}
    live = live_entries(_Q)
    live_head = {"$arrayElemAt": [live, 0]}
    first = {"$or": [{"$eq": [{"$size": live}, 0]}, {"$not": [entry_before(live_head, stamp, ident)]}]}
    running = {
        "$and": [
            {"$eq": ["$holder.task_id", {"$literal": entry["t"]}]},
            {"$eq": ["$holder.delivery", {"$literal": entry.get("r")}]},
            {"$ne": [{"$ifNull": ["$owner", None]}, None]},
            {"$not": [vacant]},
        ]
    }
    branches: list[Document] = [
        # A retry of this admit whose first attempt took the key (its reply lost): the same acquisition.
        {"case": own_live_lease(token), "then": "acquired"},
    ]
    if claim is not None:
        branches.append(
            {
                "case": {
                    "$and": [
                        {"$eq": ["$owner", {"$literal": claim}]},
                        {"$eq": ["$ho.tk", {"$literal": claim}]},
                        NO_SLOT_HELD,  # a key mixed with limit=N holds: never two kinds at once
                    ]
                },
                "then": "claimed",
            }
        )
    if due:
        head = {"$arrayElemAt": [_Q, 0]}
        due_now = [
            vacant,
            {"$not": [has_ho]},
            {"$eq": [field_of("id", head), {"$literal": ident}]},
            entry_due(head),
        ]
        branches.append({"case": {"$and": due_now}, "then": "due"})
    branches += [
        {
            "case": {
                "$or": [
                    {"$in": [{"$literal": ident}, ids]},
                    {"$eq": ["$ho.id", {"$literal": ident}]},
                    # timed out while parked: its result is being written (never run it after that)
                    {
                        "$in": [
                            {"$literal": ident},
                            {"$map": {"input": {"$ifNull": ["$dead", []]}, "as": "d", "in": "$$d.id"}},
                        ]
                    },
                ]
            },
            "then": "dup",
        },
    ]
    retries = retries_of(entry.get("r"))
    if retries is not None:
        # A copy of an attempt whose body retried (a later attempt is known here): never run again.
        branches.append({"case": later_attempt(str(entry["t"]), retries), "then": "retried"})
    branches += [
        {"case": {"$in": [{"$literal": ident}, {"$ifNull": ["$seen", []]}]}, "then": "done"},
        {"case": running, "then": "running"},
    ]
    by_set = replace and group is not None
    if by_set:
        assert group is not None
        # (before ``stale``: a claim of a run whose reservation a newer send of its set took back)
        branches += sets.superseded_cases(group, stamp)
    if claim is not None:
        # A handoff message whose claim failed, of a run no longer parked or handed (timed out, revoked,
        # handed again with another token): never a new run.
        branches.append({"case": {"$literal": True}, "then": "stale"})
    if replace and not by_set:
        last_s = {"$ifNull": ["$last.s", -1]}
        parked_s = {"$max": {"$map": {"input": _Q, "as": "e", "in": "$$e.s"}}}
        branches += [
            {"case": {"$gt": [last_s, stamp]}, "then": "superseded"},
            {"case": {"$gt": [{"$ifNull": [parked_s, -1]}, stamp]}, "then": "superseded"},
            {"case": {"$and": [{"$gt": [{"$ifNull": ["$ho.s", -1]}, stamp]}]}, "then": "superseded"},
        ]
    if not debounce_ms:
        branches.append({"case": {"$and": [vacant, {"$not": [has_ho]}, first]}, "then": "acquired"})
    branches.append({"case": vacant, "then": "parked"})  # and handed to the oldest (when due)
    # Every parked run lives in the key's one document (16 MiB): MAX_PARKED bounds it whatever the task
    # says.
    cap = MAX_PARKED if max_length is None else min(int(max_length), MAX_PARKED)
    branches.append({"case": {"$gte": [{"$size": _Q}, cap]}, "then": "full"})
    stages: list[Document] = [
        {"$set": {"__o": {"$switch": {"branches": branches, "default": "parked"}}}},
        {
            "$set": {
                "__free": {"$in": ["$__o", ["acquired", "claimed", "due"]]},
                "__park": {"$eq": ["$__o", "parked"]},
                "__vac": vacant,
                **({} if by_set else {"__tb": {"$literal": False}}),
            }
        },
    ]
    parked_q: object
    superseded_new: object
    if by_set:
        assert group is not None
        # Parked: an older run of its set loses the key's reservation or handoff made to it (unless
        # max_wait: it was handed the key by its burst's ceiling, and runs; this run waits behind it).
        older_ho = sets.older_handoff(group, stamp, ident)
        if max_wait_ms:
            older_ho = {"$and": [older_ho, {"$not": [_past_ceiling("$ho", max_wait_ms)]}]}
        take_back = {"$and": ["$__park", older_ho]}
        stages.append({"$set": {"__tb": take_back}})
        # (A burst goes on through the older runs it supersedes: parked, or the handoff taken back.)
        taken_back = {"$cond": [older_ho, ["$ho"], []]}
        older = {"$concatArrays": [sets.entries_of(group), taken_back]}
        since = burst_since(older) if max_wait_ms else None
        parked_q, superseded_new = sets.park_queue(
            entry_expr(entry, timeout_ms, debounce_ms, max_wait_ms=max_wait_ms, since=since),
            group,
            stamp,
            ident,
            by=str(entry["t"]),
            take_back="$__tb",
        )
    else:
        parked_q, superseded_new = park_exprs(
            entry, timeout_ms, debounce_ms, replace=replace, max_wait_ms=max_wait_ms
        )
    fields = dict(acquire_fields)
    fields.update(
        {
            "q": {
                "$cond": [
                    "$__park",
                    parked_q,
                    {
                        "$cond": [
                            {"$eq": ["$__o", "due"]},
                            {"$filter": {"input": _Q, "as": "e", "cond": {"$ne": ["$$e.id", ident]}}},
                            "$q",
                        ]
                    },
                ]
            },
            "sup": {
                "$cond": [
                    "$__park",
                    {"$concatArrays": [{"$ifNull": ["$sup", []]}, superseded_new]},
                    "$sup",
                ]
            },
            "ho": {"$cond": [{"$or": [{"$eq": ["$__o", "claimed"]}, "$__tb"]}, None, "$ho"]},
            "lo": "$__o",
        }
    )
    if by_set:
        assert group is not None
        taken_back = {"$and": ["$__tb", {"$eq": ["$owner", "$ho.tk"]}]}
        fields["owner"] = {"$cond": [taken_back, None, fields["owner"]]}
        fields["lo_by"] = {"$cond": [{"$eq": ["$__o", "superseded"]}, sets.newer_by(group, stamp), None]}
        fields["lg"] = sets.lg_update(group, stamp, str(entry["t"]), "$__free")
    elif replace:
        # Who superseded this run: the newest of the last send that got the key, a pending handoff and
        # the parked run.
        newer_by = {
            "$cond": [
                {"$gt": [{"$ifNull": ["$last.s", -1]}, stamp]},
                "$last.t",
                {
                    "$cond": [
                        {"$gt": [{"$ifNull": ["$ho.s", -1]}, stamp]},
                        "$ho.t",
                        {"$arrayElemAt": [{"$map": {"input": _Q, "as": "e", "in": "$$e.t"}}, -1]},
                    ]
                },
            ]
        }
        fields["lo_by"] = {"$cond": [{"$eq": ["$__o", "superseded"]}, newer_by, None]}
        if cancel:
            fields["cx"] = cancel_mark(entry, token)
        fields["last"] = {
            "$cond": [
                {"$and": ["$__free", {"$gt": [stamp, {"$ifNull": ["$last.s", -1]}]}]},
                {"s": stamp, "t": {"$literal": entry["t"]}},
                "$last",
            ]
        }
    # Taking a key handed to us ends no one else's lease (the handoff is the same acquisition).
    fields["ends"] = {"$cond": [{"$eq": ["$__o", "claimed"]}, "$ends", fields["ends"]]}
    if claim is not None:
        # The claim keeps the fence the handoff gave; the wait counts from when the run was parked.
        fields["fence"] = {"$cond": [{"$eq": ["$__o", "claimed"]}, "$fence", fields["fence"]]}
        fields["waited_ms"] = {
            "$cond": [
                {"$eq": ["$__o", "claimed"]},
                {"$max": [0, {"$subtract": [_NOW_MS, {"$toLong": {"$ifNull": ["$ho.at", "$$NOW"]}}]}]},
                fields["waited_ms"],
            ]
        }
    stages.append({"$set": fields})
    # Found free with runs parked (or an unclaimed handoff): this run parked, and the key goes to the
    # oldest, in this same command.
    hand_when = {"$and": ["$__park", {"$or": ["$__vac", "$__tb"]}]}
    stages += handoff_stages(hand_when, requeue_handoff(), admit_marker(token))
    stages.append({"$unset": ["__o", "__free", "__park", "__vac", "__tb"]})
    stages.append(gc_stage())
    return stages


def sweep_pipeline(by: str, revoked: list[str]) -> list[Document]:
    """The sweeper's command for one key (see ``LeaseStore.sweep``).

    1. Parked runs whose task ids are in ``revoked`` leave ``q``; a pending handoff to one of them is
       dropped and the key freed (the run was revoked while its handoff message waited).
    2. Parked runs past their deadline move to ``dead``.
    3. A key found free or expired with runs parked (or with an unclaimed handoff) goes to the oldest.
    4. A handoff nobody marked as published (``by`` empty: a background release handed it) is adopted.
    """
    rv = {"$literal": revoked}
    ho_revoked = {"$and": [{"$ne": [{"$ifNull": ["$ho", None]}, None]}, {"$in": ["$ho.t", rv]}]}
    stages: list[Document] = [
        {
            "$set": {
                "__rv": ho_revoked,
                "q": {"$filter": {"input": _Q, "as": "e", "cond": {"$not": [{"$in": ["$$e.t", rv]}]}}},
            }
        },
        {
            "$set": {
                "owner": {"$cond": [{"$and": ["$__rv", {"$eq": ["$owner", "$ho.tk"]}]}, None, "$owner"]},
                "ho": {"$cond": ["$__rv", None, "$ho"]},
                "dead": {"$concatArrays": [{"$ifNull": ["$dead", []]}, dead_entries(_Q)]},
                "q": live_entries(_Q),
            }
        },
        {"$unset": ["__rv"]},
        *release_handoff_stages(by),
        {
            "$set": {
                "ho": {
                    "$cond": [
                        {
                            "$and": [
                                {"$ne": [{"$ifNull": ["$ho", None]}, None]},
                                {"$eq": [{"$ifNull": ["$ho.by", ""]}, ""]},
                            ]
                        },
                        {"$mergeObjects": ["$ho", {"by": {"$literal": by}}]},
                        "$ho",
                    ]
                }
            }
        },
        gc_stage(),
    ]
    return stages
