"""``Replace`` with ``keys=``: supersession decided per **set of rendered keys**, as pure expressions for
``queue.admit_pipeline`` (no I/O).

A run of a ``Replace`` task that needs several keys carries its key set's signature in its parked entry
(``g``: ``set_signature`` of its sorted rendered keys). On a key, only runs of the same set supersede each
other; runs of other sets (and single-key runs, and ``Queue`` runs) keep their place in send order, as
under ``Queue``. Fields added to the lease document::

    lg:  [{g, s, t}, ...]   # per key set: the newest send of that set that got this key (the last
                            # LG_KEPT sets that did, newest update last; kept as long as ``last``)

and to a parked entry, its reservation or handoff (``ho``) and its record in ``sup``: ``g``. The run that
holds the key has its set and send stamp in its holder info (``holder.set``, ``holder.sent``): with
``Replace(cancel_running=True)``, a newer send of the set marks that holder superseded (``cx``,
``holder_older_of_set``), never a holder of another set.

On each key, the admit of run R (set ``g``, send stamp ``s``):

1. **superseded** when the key knows a newer send of ``g``: a record in ``lg``, a parked entry, or a
   pending handoff or reservation (``ho``) of ``g`` with a larger stamp, never one of R itself
   (``other_run``);
2. else, when R parks, the older runs of ``g`` on the key leave it for ``sup`` (their results are written
   with ``superseded``): their parked entries, and a reservation or handoff of the key made to one of
   them and not yet claimed, which is taken back (the key is then handed to the oldest run parked on it,
   in the same command). A run of a set takes its keys one at a time, in key order, and is a ``Replace``
   run (with ``g``) on its set's gate only, which every run of the set admits first
   (``key_set.KeySetAdmits.entry_on``): an older run loses its place there, and the newer one leaves its
   places on the later keys (``rv``); one that learns it (its own admit or claim answers ``superseded``)
   gives back what it holds and leaves the others. (Entries parked on every key of their set, by an
   earlier version, meet these rules on each key.)
3. A key R *holds* (took in an attempt that must wait for another key) is no reservation: a newer send
   that parks on it finds nothing to take back there. So R's reservation of it (``reserve``) is made only
   while the key knows no newer send of ``g`` (``no_newer_send``); else R gives the key back unrun (it
   goes to the oldest run parked on it, the newer send or another set's run), and R's admit of it
   answers ``superseded``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from celery_mongolock.core.keys import RESERVED_PREFIX

__all__ = [
    "GATE_PREFIX",
    "LG_KEPT",
    "as_on_key",
    "behind_its_set",
    "burst_identity",
    "burst_of",
    "carry_burst",
    "entries_of",
    "gate_of",
    "holder_older_of_set",
    "in_burst",
    "is_gate",
    "lg_update",
    "message_fields",
    "newer_by",
    "newest_of",
    "newest_that_got_it",
    "no_newer_send",
    "older_handoff",
    "other_run",
    "park_queue",
    "queue_left_by",
    "run_burst",
    "set_signature",
    "sup_record",
    "superseded_cases",
    "user_keys",
]

Document = dict[str, Any]

_Q: Document = {"$ifNull": ["$q", []]}
_LG: Document = {"$ifNull": ["$lg", []]}
#: How many key sets a key remembers the newest send of (``lg``): a key shared by more sets forgets the
#: set updated longest ago (a late copy of an older send of that set is then admitted as ``Queue`` would).
LG_KEPT = 64


def set_signature(keys: Sequence[str]) -> str:
    """The signature of a set of rendered keys (order and repeats do not matter): ``g`` in entries."""
    joined = "\x00".join(sorted(set(keys)))
    return "ks:" + hashlib.sha256(joined.encode()).hexdigest()[:24]


#: The key of a set's gate starts with this (no task's key may: ``keys.KeyRenderer``).
GATE_PREFIX = RESERVED_PREFIX


def gate_of(keys: Sequence[str]) -> str:
    """The key of the gate of a ``Replace`` task's set of two keys or more: a lease document of its own,
    which every run of the set admits first and holds with the set's keys (``key_set.KeySetAdmits``).
    Runs of the set supersede each other there, and nowhere else: on the set's own keys they wait as
    ``Queue`` runs do, so a key shared by any number of sets stores none of them in its lease document."""
    return GATE_PREFIX + set_signature(keys)[len("ks:") :]


def is_gate(key: object) -> bool:
    """Whether ``key`` is a set's gate (``gate_of``), not a key a task named."""
    return isinstance(key, str) and key.startswith(GATE_PREFIX)


def as_on_key(key: str, entry: Mapping[str, Any]) -> dict[str, Any]:
    """The run ``entry`` as it is parked or reserved on ``key``. On a set's gate without its rank
    (``pr``, ``entries.entry_ahead``): the runs of a set are there in send order alone, whatever their
    priority. A newer send supersedes the older ones there anyway, so a rank would only ever order the run
    a burst's ceiling sealed against the newer sends behind it: when its reservation lapsed, a newer send
    of a higher priority was handed the gate first (and ran first; the ceiling's run, left parked, was
    superseded, or ran after it with older arguments)."""
    if not is_gate(key):
        return dict(entry)
    return {k: v for k, v in entry.items() if k != "pr"}


def user_keys(keys: Sequence[object]) -> list[str]:
    """``keys`` without a set's gate: the keys a task named, for results, states and displays."""
    return [str(key) for key in keys if not is_gate(key)]


def _field(name: str, doc: object) -> Document:
    return {"$getField": {"field": name, "input": doc}}


def _same_set(e: object, group: str) -> Document:
    return {"$eq": [{"$ifNull": [_field("g", e), None]}, {"$literal": group}]}


def _newer(e: object, stamp: int) -> Document:
    return {"$gt": [{"$ifNull": [_field("s", e), -1]}, stamp]}


def other_run(e: object, task_id: str) -> Document:
    """Entry ``e`` (an expression) is not of the run ``task_id``: a run is never newer than itself,
    whatever stamp a copy of it carries (a run superseded by itself would end without running, and no
    newer send would run). Both admits' newer sends use it (``admit_stages.newer_sends``)."""
    return {"$ne": [{"$ifNull": [_field("t", e), None]}, {"$literal": task_id}]}


def _before(e: object, stamp: int, ident: str) -> Document:
    s_, id_ = _field("s", e), _field("id", e)
    return {
        "$or": [
            {"$lt": [s_, stamp]},
            {"$and": [{"$eq": [s_, stamp]}, {"$lt": [id_, {"$literal": ident}]}]},
        ]
    }


def burst_of(e: object) -> Document:
    """The burst of entry ``e`` (``Replace(debounce=..., max_wait=...)``): the first wait its run learned
    on its set's gate (``bu``, ms), else when its burst began waiting on this key (``fw``)."""
    fw = {"$toLong": {"$ifNull": [_field("fw", e), None]}}
    return {"$ifNull": [_field("bu", e), fw]}


def burst_identity(older: object) -> Document:
    """The burst of a run that supersedes the entries ``older`` (an array expression) and does not know
    its own yet: the earliest of theirs (``burst_of``, else when they were parked), else now (ms)."""
    began = {"$map": {"input": older, "as": "e", "in": {"$ifNull": [burst_of("$$e"), {"$toLong": "$$e.at"}]}}}
    earlier = {"$cond": [{"$lt": ["$$this", "$$value"]}, "$$this", "$$value"]}
    return {"$reduce": {"input": began, "initialValue": {"$toLong": "$$NOW"}, "in": earlier}}


def in_burst(e: object, burst: object) -> Document | bool:
    """Entry ``e`` belongs to the burst ``burst`` (an expression, ms; always when it is None, or
    evaluates to null). A burst cut short by its ceiling (its run handed a key by ``max_wait``) is sealed:
    newer sends begin a burst of their own, and on every key only runs of one burst supersede each
    other, so the run the ceiling chose is not superseded on a key it reaches after a newer send."""
    if burst is None:
        return True
    return {"$or": [{"$eq": [burst, None]}, {"$eq": [burst_of(e), burst]}]}


def run_burst(ident: str, known: int | None) -> Document:
    """The burst of the run ``ident`` on this key (``Replace(debounce=..., max_wait=...)`` with
    ``keys=``): its own entry's here (parked, or handed the key), else ``known``, the one it learned on
    its set's gate (``bu``; ``key_set``), else null (it has none yet: its first park)."""
    lit = {"$literal": ident}
    own_q = {"$arrayElemAt": [{"$filter": {"input": _Q, "as": "e", "cond": {"$eq": ["$$e.id", lit]}}}, 0]}
    own_ho = {"$cond": [{"$eq": [{"$ifNull": ["$ho.id", None]}, lit]}, "$ho", None]}
    # (on a key with slots: the slot handed or reserved to it)
    handed = {"$map": {"input": {"$ifNull": ["$hs", []]}, "as": "h", "in": {"$ifNull": ["$$h.ho", {}]}}}
    own_hs = {
        "$arrayElemAt": [{"$filter": {"input": handed, "as": "e", "cond": {"$eq": ["$$e.id", lit]}}}, 0]
    }
    fallback = None if known is None else {"$literal": int(known)}
    mine = {"$ifNull": [burst_of(own_ho), {"$ifNull": [burst_of(own_hs), fallback]}]}
    return {"$ifNull": [burst_of(own_q), mine]}


def _has_ho() -> Document:
    return {"$ne": [{"$ifNull": ["$ho", None]}, None]}


def _newer_sends(
    group: str, stamp: int, task_id: str, handed: object = None, burst: object = None
) -> Document:
    """``[{s, t}, ...]``: the sends of ``group`` newer than ``stamp`` the key knows (``lg``, ``q``,
    ``ho``), other than the run ``task_id`` itself. ``handed``: an array expression of the entries the key
    is handed or reserved to and not yet claimed, for a key with a limit (``slot_sets``); None: the key's
    one ``ho``. ``burst``: of the parked runs, only those of that burst (``in_burst``); a newer send that
    got the key (``lg``), or is handed or reserved it, counts whatever its burst."""
    of_set = {"$and": [_same_set("$$e", group), _newer("$$e", stamp), other_run("$$e", task_id)]}
    of_burst = {"$and": [of_set, in_burst("$$e", burst)]}

    def pick(source: object, cond: object = of_burst) -> Document:
        return {
            "$map": {
                "input": {"$filter": {"input": source, "as": "e", "cond": cond}},
                "as": "e",
                "in": {"s": "$$e.s", "t": "$$e.t"},
            }
        }

    # A newer send handed (or reserved) the key counts whatever its burst, as one that got it (``lg``):
    # it is about to run, and an older run of its set that came back (its lease lapsed, the key handed
    # on) must not be handed the key after it (the lock-set checker's ``replace-order``, CI: an older
    # send re-admitted the gate between a newer send's handoff and its claim, and parked again there).
    newer_ho = [_has_ho(), _same_set("$ho", group), _newer("$ho", stamp), other_run("$ho", task_id)]
    ho = {"$cond": [{"$and": newer_ho}, [{"s": "$ho.s", "t": "$ho.t"}], []]}
    return {"$concatArrays": [pick(_LG, of_set), pick(_Q), ho if handed is None else pick(handed, of_set)]}


def newest_of(sends: object) -> Document:
    """The task id of the newest of ``sends`` (an array expression of ``{s, t}``), null when empty."""
    newest = {
        "$reduce": {
            "input": sends,
            "initialValue": {"s": -1, "t": None},
            "in": {"$cond": [{"$gt": ["$$this.s", "$$value.s"]}, "$$this", "$$value"]},
        }
    }
    return _field("t", newest)


def superseded_cases(
    group: str, stamp: int, *, task_id: str, handed: object = None, burst: object = None
) -> list[Document]:
    """The ``$switch`` branch of the admit: a newer send of this run's set is known here (``handed``,
    ``burst``: as ``_newer_sends`` takes them)."""
    newer = _newer_sends(group, stamp, task_id, handed, burst)
    return [{"case": {"$gt": [{"$size": newer}, 0]}, "then": "superseded"}]


def no_newer_send(group: str, stamp: int, *, task_id: str, burst: object = None) -> Document:
    """A query filter: the key knows no send of ``group`` newer than ``stamp``. A run's reservation of a
    key it took (``LeaseStore.reserve``) is made only then: a newer send of its set that parked on the key
    while the run held it found nothing to take back (a held lease is not a reservation), so a
    reservation made after it would be handed again to the superseded run at each expiry, never to the
    newer send."""
    return {"$expr": {"$eq": [{"$size": _newer_sends(group, stamp, task_id, burst=burst)}, 0]}}


def newer_by(
    group: str, stamp: int, *, task_id: str, handed: object = None, burst: object = None
) -> Document:
    """The task id of the newest send of ``group`` newer than ``stamp`` (for ``lo_by``): never
    ``task_id``'s own."""
    return newest_of(_newer_sends(group, stamp, task_id, handed, burst))


def holder_older_of_set(group: str, stamp: int, *, task_id: str) -> Document:
    """The key's holder is an older run of ``group`` (not a run of the task ``task_id``): the holder a
    newer send of the set supersedes with ``Replace(cancel_running=True)``. A run of a set holds its keys
    with its set's signature and send stamp in its holder info (``set``, ``sent``)."""
    return {
        "$and": [
            {"$eq": [{"$ifNull": ["$holder.set", None]}, {"$literal": group}]},
            {"$lt": [{"$ifNull": ["$holder.sent", stamp]}, stamp]},
            {"$ne": [{"$ifNull": ["$holder.task_id", None]}, {"$literal": task_id}]},
        ]
    }


def older_handoff(group: str, stamp: int, ident: str, burst: object = None) -> Document:
    """The key is reserved or handed (not yet claimed) to an older run of ``group`` (of ``burst``, when
    given): taken back when this run parks."""
    return {
        "$and": [_has_ho(), _same_set("$ho", group), _before("$ho", stamp, ident), in_burst("$ho", burst)]
    }


def sup_appended(when: object, records: object) -> Document:
    """``sup`` with ``records`` appended when ``when``, but never a record of the superseding run's own task
    (``t`` equal to ``by``): an older attempt of the same task (a stale copy parked before the body's
    ``self.retry()`` came) is no older send of the set, and a task superseded by itself would end without
    its body ever running again (the lock-set checker on RabbitMQ: a several-keys ``Replace`` task ended
    ``superseded`` by its own id when its retry parked beside its stale copy). Such an entry just leaves the
    key: the newer attempt carries the task on."""
    others = {"$filter": {"input": records, "as": "r", "cond": {"$ne": ["$$r.t", "$$r.by"]}}}
    return {"$cond": [when, {"$concatArrays": [{"$ifNull": ["$sup", []]}, others]}, "$sup"]}


def message_fields(e: str) -> Document:
    """The fields of the entry ``e`` that let its run be published again (``id``, its stored message and
    its signature), carried into its record in ``sup`` or ``dead``: a run with callbacks, or in a chain
    or a chord, is ended by a worker from its own message (``integration.endings``)."""
    return {"id": f"{e}.id", "m": f"{e}.m", "ct": f"{e}.ct", "ce": f"{e}.ce", "sg": f"{e}.sg"}


def sup_record(e: str, by: str, *, reserved: bool = False) -> Document:
    """The record in ``sup`` of the run whose entry is the expression ``e``, superseded by ``by``;
    ``reserved``: its reservation or handoff of the key was taken back. ``rv`` says it had the key
    reserved (taken back, or a lapsed reservation put back among the parked runs): it may wait on a later
    key of its set, which the superseding run leaves for it (``key_set.KeySetAdmits.write_superseded``)."""
    return _sup_record(e, by, reserved=reserved)


def _sup_record(e: str, by: str, *, reserved: bool = False) -> Document:
    # (a parked entry that was handed the key before, ``hn``, had it reserved, and may wait further on:
    # its reservation lapsed and was put back among the parked runs, ``handoff.requeue_handoff``)
    was_handed = {"$ne": [{"$ifNull": [f"{e}.hn", None]}, None]}
    return {
        "rv": {"$literal": True} if reserved else was_handed,
        "t": f"{e}.t",
        "by": {"$literal": by},
        "at": "$$NOW",
        "n": f"{e}.n",
        "r": f"{e}.r",
        "pa": f"{e}.at",
        "ks": f"{e}.ks",
        "g": f"{e}.g",
        **message_fields(e),
    }


def _of_set(e: str, group: str, burst: object) -> Document:
    return {"$and": [_same_set(e, group), in_burst(e, burst)]}


def entries_of(group: str, burst: object = None) -> Document:
    """The entries of ``group`` (of ``burst``, when given) parked on the key: the older runs of its set a
    newer send supersedes."""
    return {"$filter": {"input": _Q, "as": "e", "cond": _of_set("$$e", group, burst)}}


def park_queue(
    entry_expr: Document,
    group: str,
    ahead: Document,
    *,
    by: str,
    take_back: object,
    burst: object = None,
) -> tuple[Document, Document]:
    """``(q, superseded)`` when a run of ``group`` parks: the queue with its entry in its place (``ahead``:
    entry ``$$e`` is ahead of it, ``entries.entry_ahead``) and without the older runs of its set; and
    those runs (plus the run whose reservation or handoff ``take_back`` says is taken back), in the shape
    of ``sup``."""
    others = {"$filter": {"input": _Q, "as": "e", "cond": {"$not": [_of_set("$$e", group, burst)]}}}
    in_order = {
        "$concatArrays": [
            {"$filter": {"input": others, "as": "e", "cond": ahead}},
            [entry_expr],
            {"$filter": {"input": others, "as": "e", "cond": {"$not": [ahead]}}},
        ]
    }
    older = entries_of(group, burst)
    superseded = {
        "$concatArrays": [
            {"$map": {"input": older, "as": "p", "in": _sup_record("$$p", by)}},
            {"$cond": [take_back, [_sup_record("$ho", by, reserved=True)], []]},
        ]
    }
    return in_order, superseded


def behind_its_set(e: object, runs: object) -> Document:
    """Entry ``e`` (an expression) of a burst (``Replace(debounce=..., max_wait=...)`` with ``keys=``: it
    has ``fw`` or ``bu``) has an older run of its set among ``runs`` (an array expression of ``{g, s}``:
    the key's runs of sets, parked, handed or reserved a slot, or holding one: ``slot_queue.SET_RUNS``). On
    a key with slots such an entry is not handed a slot before that run is through: the runs of one set
    of a burst get the key's slots one at a time, in send order, as they get a single lease. (Else the
    ceiling's run, sealed, handed or holding a slot it has not yet made its own on every key, and a newer
    burst's run handed another: the older one's turn could come again after the newer one's.) Other
    entries: never (and ``runs`` not scanned)."""
    g = {"$ifNull": [_field("g", e), None]}
    of_a_burst = {"$ne": [{"$ifNull": [_field("fw", e), {"$ifNull": [_field("bu", e), None]}]}, None]}
    older = {"$and": [{"$eq": ["$$o.g", g]}, {"$lt": ["$$o.s", _field("s", e)]}]}
    # ($and stops at its first false: ``runs`` is scanned for entries of a burst only)
    return {
        "$and": [
            {"$ne": [g, None]},
            of_a_burst,
            {"$gt": [{"$size": {"$filter": {"input": runs, "as": "o", "cond": older}}}, 0]},
        ]
    }


def carry_burst(q: object, left: object) -> Document:
    """``Replace(debounce=..., max_wait=...)``: the queue ``q`` once the run ``left`` (its parked entry,
    reservation or handoff, an expression; null for none) leaves the key unrun: the newer runs of its set
    parked here continue its burst, so each keeps the earlier of the two first waits (``fw``) and is due
    no later than that plus its ``max_wait`` (``mw``). A newer send parked behind a run handed the key by
    its burst's ceiling began a burst of its own (that run was to run); when that run leaves after all
    (a newer send of its set was handed another key), the burst it carried must not be lost, or the set
    never reaches its ceiling on every key at once."""
    # (A reservation has no ``fw``: its run's burst, ``bu``, is when it began waiting.)
    left_fw = {"$ifNull": [{"$toLong": {"$ifNull": [_field("fw", left), None]}}, _field("bu", left)]}
    left_s = {"$ifNull": [_field("s", left), None]}
    left_g = {"$ifNull": [_field("g", left), None]}
    fw = {"$min": [{"$toLong": "$$e.fw"}, left_fw]}
    carried = {
        "$mergeObjects": [
            "$$e",
            {
                "fw": {"$toDate": fw},
                "nb": {"$toDate": {"$min": [{"$toLong": "$$e.nb"}, {"$add": [fw, "$$e.mw"]}]}},
            },
        ]
    }
    applies = {
        "$and": [
            {"$ne": [left_fw, None]},
            {"$ne": [left_g, None]},
            {"$eq": [{"$ifNull": ["$$e.g", None]}, left_g]},
            {"$gt": [{"$ifNull": ["$$e.s", -1]}, left_s]},
            {"$ne": [{"$ifNull": ["$$e.fw", None]}, None]},
            {"$ne": [{"$ifNull": ["$$e.mw", None]}, None]},
        ]
    }
    return {"$map": {"input": q, "as": "e", "in": {"$cond": [applies, carried, "$$e"]}}}


def queue_left_by(entry_id: str, handed_to_it: object) -> Document:
    """The queue once the run ``entry_id`` leaves the key unrun (``LeaseStore.unpark``): without its
    parked entry, and with its burst carried on (``carry_burst``) from its handoff or reservation (when
    ``handed_to_it``) or its parked entry."""
    ident = {"$literal": entry_id}
    q = {"$ifNull": ["$q", []]}
    its_entry = {"$filter": {"input": q, "as": "e", "cond": {"$eq": ["$$e.id", ident]}}}
    left = {"$cond": [handed_to_it, "$ho", {"$arrayElemAt": [its_entry, 0]}]}
    rest = {"$filter": {"input": q, "as": "e", "cond": {"$ne": ["$$e.id", ident]}}}
    return carry_burst(rest, left)


def newest_that_got_it(lg: object, group: str, stamp: int, task_id: str) -> str | None:
    """Of a key's ``lg`` records (a stored list), the task id of the newest send of ``group`` newer than
    ``stamp`` that got the key, never ``task_id``'s own; None when there is none."""
    records = [
        r
        for r in (lg if isinstance(lg, list) else [])
        if isinstance(r, dict)
        and r.get("g") == group
        and r.get("t") != task_id
        and isinstance(r.get("s"), int)
    ]
    newer = [r for r in records if int(r["s"]) > stamp]
    return str(max(newer, key=lambda r: int(r["s"]))["t"]) if newer else None


def lg_update(group: str, stamp: int, task_id: str, free: object) -> Document:
    """``lg`` after an admit: when this run got the key (``free``) and is the newest of its set that did,
    its record replaces its set's (the last ``LG_KEPT`` sets kept)."""
    mine = {"$filter": {"input": _LG, "as": "e", "cond": _same_set("$$e", group)}}
    known = {"$ifNull": [{"$max": {"$map": {"input": mine, "as": "e", "in": "$$e.s"}}}, -1]}
    rest = {"$filter": {"input": _LG, "as": "e", "cond": {"$not": [_same_set("$$e", group)]}}}
    record = {"g": {"$literal": group}, "s": stamp, "t": {"$literal": task_id}}
    updated = {"$slice": [{"$concatArrays": [rest, [record]]}, -LG_KEPT]}
    return {"$cond": [{"$and": [free, {"$gt": [stamp, known]}]}, updated, "$lg"]}
