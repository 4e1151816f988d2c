"""The lock-set checker's keys used both ways (``x`` keys): one rendered key that some runs take as a
single lease and others as one of ``LIMIT`` slots (``limit=N``), as two tasks of an app may (a per-tenant
limit beside a one-at-a-time job on the same tenant key). The library keeps the kinds apart: while the
key is held (or runs are parked on it) as one kind, a run of the other kind does not take it and does
not park behind them (its admit answers ``mixed``: a contention retry, back within 5 s), and a plain
``acquire`` of the other kind finds it held.

The protected document of an ``x`` key is written by both kinds, each with its fence::

    {_id: key, counter: int, fence: int, sm: int, sc: {slot: int}, sf: {slot: fence}, log: [entry, ...]}

* a single lease's hold claims the document and writes ``counter = p + 1`` (``p``: the ``counter`` it
  read), filtered on ``fence <= f`` (no newer single hold wrote) and ``sm <= f`` (no newer slot hold
  wrote), stamping ``fence``; its entries have no ``s``;
* a slot's hold writes its slot's part as a ``limit=N`` key's hold does (``sc.<s> = p + 1``, ``$inc
  counter``), filtered on ``sf.<s> <= f`` and ``fence <= f`` (no newer single hold wrote), stamping
  ``sf.<s>`` and ``sm = max(sm, f)``.

Fences grow per key across both kinds (one counter), so a stale holder of either kind, paused past its
lease, is refused once a newer hold of either kind wrote. ``check_mixed_log`` then reads the log as
one history: each slot's entries and the single holds' entries are single-holder histories; a single
hold's entries are not interleaved with any other hold's (a hold that wrote before another's entry
and writes again after it, across kinds, held the key with it); a single hold's ``p`` counts every write
applied before it (a slot write between its read and its write would be lost); ``counter`` and each
``sc.<s>`` count the applied writes. ``check_mixed_holds`` does the same from the clients' view: no clean
single hold overlaps any other clean hold, and at most ``LIMIT`` clean slot holds at once.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import random
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from pymongo.collection import Collection
from pymongo.errors import DuplicateKeyError, PyMongoError

from .lockcheck_retry import write_retrying

Doc = dict[str, Any]

#: The key kind (``lockcheck.key_for``) and the two tasks that take such keys, both ``Queue()``.
KIND = "x"
SINGLE_TASK = "lockcheck.rmw_mixed_single"
SLOTS_TASK = "lockcheck.rmw_mixed_slots"
TASKS = (SINGLE_TASK, SLOTS_TASK)
#: A random burst on one ``x`` key: this many runs, each of either kind.
BURST = (2, 5)


class _Fenced(Exception):
    """A write refused: a newer hold (of either kind) has written the document."""


def _not_after(field: str, fence: int) -> Doc:
    return {"$or": [{field: {"$lte": fence}}, {field: {"$exists": False}}]}


def _guarded(fence: int, slot: int | None) -> Doc:
    if slot is None:
        return {"$and": [_not_after("fence", fence), _not_after("sm", fence)]}
    return {"$and": [_not_after(f"sf.{slot}", fence), _not_after("fence", fence)]}


def _stamped(update: Doc, fence: int, slot: int | None) -> Doc:
    if slot is None:
        return {**update, "$set": {**update.get("$set", {}), "fence": fence}}
    return {**update, "$set": {**update.get("$set", {}), f"sf.{slot}": fence}, "$max": {"sm": fence}}


def _update(docs: Collection[Doc], key: str, fence: int, slot: int | None, *, flt: Doc, update: Doc) -> bool:
    """``update`` on ``protected[key]`` if no newer hold of either kind has written (and ``flt`` matches),
    stamping our fence. True if applied, False if ``flt`` no longer matches (the op is there already);
    raises ``_Fenced`` if a newer hold wrote, ``PyMongoError`` if the document is missing."""
    filt = {"$and": [{"_id": key}, flt, _guarded(fence, slot)]}
    if docs.update_one(filt, _stamped(update, fence, slot)).matched_count:
        return True
    if flt and docs.find_one({"$and": [{"_id": key}, flt]}, {"_id": 1}) is None:
        return False  # (a retry of a write whose reply was lost: applied already)
    if docs.find_one({"_id": key}, {"_id": 1}) is None:
        raise PyMongoError("the protected document is missing")
    raise _Fenced()


def run_mixed_hold(
    lease: Any,
    docs: Collection[Doc],
    hist: Any,
    ops: Sequence[str],
    rng: random.Random,
    *,
    reckless: bool,
    who: str,
    task_id: str | None = None,
    work: tuple[float, float] = (0.05, 0.4),
) -> list[str]:
    """``lockcheck.run_hold`` (a single lease) or ``run_slot_hold`` (a slot) for a hold of an ``x`` key:
    claim, then one read-modify-write per op, each fenced against newer holds of both kinds. Returns the
    outcome of each op attempted."""
    key, hold, fence = lease.key, lease.owner, lease.fence
    slot = None if lease.slot is None else int(lease.slot)
    where = {} if slot is None else {"slot": slot}
    try:
        with contextlib.suppress(DuplicateKeyError):  # two first claims at once: the other inserted it
            docs.update_one({"_id": key}, {"$setOnInsert": {"counter": 0, "log": []}}, upsert=True)
        claim = {"k": "c", "h": hold, "f": fence, **({} if slot is None else {"s": slot})}
        _update(docs, key, fence, slot, flt={}, update={"$push": {"log": claim}})
    except _Fenced:
        hist.event("claim", key=key, hold=hold, fence=fence, outcome="fenced", who=who, **where)
        return []
    except PyMongoError as exc:
        hist.event(
            "claim", key=key, hold=hold, fence=fence, outcome="error", error=type(exc).__name__, who=who,
            **where,
        )  # fmt: skip
        return []
    hist.event("claim", key=key, hold=hold, fence=fence, outcome="ok", who=who, **where)
    outcomes: list[str] = []
    for op in ops:
        counter = "counter" if slot is None else f"sc.{slot}"
        try:
            doc = docs.find_one({"_id": key}, {"counter": 1, "sc": 1})
        except PyMongoError as exc:
            hist.event("read", key=key, hold=hold, op=op, outcome="error", error=type(exc).__name__)
            outcomes.append("error")
            break
        read = (doc or {}).get("counter", 0) if slot is None else ((doc or {}).get("sc") or {}).get(str(slot))
        p = int(read or 0)
        end = time.monotonic() + rng.uniform(*work)  # the work; SIGSTOP and clock jumps land here
        while time.monotonic() < end:
            time.sleep(min(0.02, max(0.0, end - time.monotonic())))
        base = {"key": key, "hold": hold, "fence": fence, "op": op, "p": p, "who": who, "task_id": task_id}
        if not reckless and lease.lost:
            hist.event("write", **base, **where, outcome="lost-detected", t=time.monotonic())
            outcomes.append("lost-detected")
            break
        entry = {"k": "w", "o": op, "h": hold, "f": fence, "p": p, **({} if slot is None else {"s": slot})}
        update: Doc = {"$set": {counter: p + 1}, "$push": {"log": entry}}
        if slot is not None:
            update["$inc"] = {"counter": 1}
        outcome, retried = write_retrying(
            functools.partial(_update, docs, key, fence, slot, flt={"log.o": {"$ne": op}}, update=update),
            _Fenced,
            docs,
            key,
            op,
        )
        hist.event(
            "write", **base, **where, outcome=outcome, retried=retried, reckless=reckless, t=time.monotonic()
        )
        outcomes.append("ack" if outcome.startswith("ack") else outcome)
        if not outcome.startswith("ack"):
            break
    return outcomes


def check_mixed_log(key: str, doc: Doc, applied: dict[str, list[tuple[str, str]]]) -> list[tuple[str, str]]:
    """The protected document of an ``x`` key (module docstring): ``(kind, detail)`` of each violation.
    Applied ops go into ``applied``."""
    found: list[tuple[str, str]] = []
    fence_of: dict[int, str] = {}
    kind_of: dict[str, int | None] = {}
    lanes: dict[int | None, Doc] = defaultdict(
        lambda: {"writes": 0, "fence": None, "hold": None, "closed": set()}
    )
    closed: set[str] = set()
    last_lane: int | str | None = "none"
    lane_holds: set[str] = set()  # the holds with entries since the lane (single, or slots) last changed
    total = 0
    for i, entry in enumerate(doc.get("log") or []):
        fence, h, slot = int(entry["f"]), str(entry["h"]), entry.get("s")
        slot = None if slot is None else int(slot)
        where = f"{key} log[{i}] {'single' if slot is None else f'slot {slot}'}"
        if fence_of.setdefault(fence, h) != h:
            found.append(
                ("fence-reused", f"{where}: holds {fence_of[fence][:8]} and {h[:8]} share fence {fence}")
            )
        if kind_of.setdefault(h, slot) != slot:
            found.append(("slot-changed", f"{where}: hold {h[:8]} wrote as {kind_of[h]} and as {slot}"))
        if h in closed:
            found.append(
                ("kinds-overlap", f"{where}: hold {h[:8]} writes again after another kind's hold wrote")
            )
        # A single hold's entry ends every other hold that wrote before it; a slot's entry ends the single
        # holds that wrote before it (slot holds share the key with each other).
        lane = "single" if slot is None else "slots"
        if slot is None:
            closed |= lane_holds - {h}
            lane_holds = {h}
        else:
            if last_lane == "single":
                closed |= lane_holds
                lane_holds = set()
            lane_holds.add(h)
        last_lane = lane
        st = lanes[slot]
        if st["fence"] is not None and fence < st["fence"]:
            found.append(("fence-backwards", f"{where}: fence {fence} after fence {st['fence']}"))
        if h != st["hold"]:
            if h in st["closed"]:
                found.append(("overlap", f"{where}: hold {h[:8]} writes again after hold {st['hold']}"))
            if st["hold"] is not None:
                st["closed"].add(st["hold"])
            st["hold"] = h
        elif fence != st["fence"]:
            found.append(("fence-changed", f"{where}: hold {h[:8]} wrote with two fences"))
        st["fence"] = fence
        if entry.get("k") != "w":
            continue
        op = str(entry["o"])
        applied[op].append((key, h))
        expected = total if slot is None else st["writes"]
        if int(entry["p"]) != expected:
            found.append(
                (
                    "lost-update",
                    f"{where}: op {op} (hold {h[:8]}, fence {fence}) read {entry['p']} but {expected} writes "
                    f"{'of the key' if slot is None else 'of the slot'} were applied before it",
                )
            )
        st["writes"] += 1
        total += 1
    if int(doc.get("counter", 0)) != total:
        found.append(("lost-update", f"{key}: counter is {doc.get('counter')} after {total} applied writes"))
    for slot, st in sorted(((s, v) for s, v in lanes.items() if s is not None), key=lambda kv: kv[0]):
        have = int((doc.get("sc") or {}).get(str(slot), 0))
        if have != st["writes"]:
            found.append(
                ("lost-update", f"{key}: slot {slot} counter is {have} after {st['writes']} applied")
            )
    return found


def check_mixed_holds(
    key: str, spans: Sequence[tuple[float, float, Doc]], limit: int
) -> list[tuple[str, str]]:
    """The clients' view of an ``x`` key: ``spans`` are its clean holds (reply seen, release sent, the
    acquisition), by start. No single hold overlaps another hold, and at most ``limit`` slot holds at
    once."""
    found: list[tuple[str, str]] = []
    singles = [s for s in spans if s[2].get("slot") is None]
    for s1, e1, a1 in singles:
        for s2, e2, a2 in spans:
            if a2 is a1 or not (s2 < e1 and s1 < e2):
                continue
            other = "single" if a2.get("slot") is None else f"slot {a2.get('slot')}"
            found.append(
                (
                    "kinds-overlap",
                    f"{key}: {a1.get('who')} (single, fence {a1['fence']}) held it {s1:.3f}-{e1:.3f} and "
                    f"{a2.get('who')} ({other}, fence {a2['fence']}) {s2:.3f}-{e2:.3f}, both released",
                )
            )
    slots = sorted(s for s in spans if s[2].get("slot") is not None)
    points = sorted(
        [(s, 1, i) for i, (s, _e, _a) in enumerate(slots)]
        + [(e, 0, i) for i, (_s, e, _a) in enumerate(slots)]
    )
    live: set[int] = set()
    for _t, starts, i in points:
        if starts:
            live.add(i)
            if len(live) > limit:
                found.append(("over-limit", f"{key} (limit {limit}): {len(live)} clean slot holds at once"))
                break
        else:
            live.discard(i)
    for (_s1, e1, a1), (s2, _e2, a2) in itertools.pairwise(
        sorted(slots, key=lambda s: (s[2].get("slot"), s[0]))
    ):
        if a1.get("slot") == a2.get("slot") and s2 < e1:
            found.append(
                ("slot-overlap", f"{key} slot {a1.get('slot')}: fences {a1['fence']} and {a2['fence']}")
            )
    return found


def mixed_figures(events: Sequence[Doc], tasks: dict[str, Doc]) -> Doc:
    """What the ``x`` keys saw: runs of each kind, clean holds of each kind, admits answered ``mixed``
    (a run kept aside because the key was in use as the other kind)."""
    runs = Counter(str(t.get("task")) for t in tasks.values() if t.get("task") in TASKS)
    holds = {"single": 0, "slot": 0}
    mixed_answers: set[str] = set()
    for e in events:
        key = str(e.get("key") or "")
        if f":{KIND}" not in key:
            continue
        if e.get("ev") == "acq":
            holds["single" if e.get("slot") is None else "slot"] += 1
        elif e.get("ev") == "admit" and e.get("outcome") == "mixed" and e.get("task_id"):
            mixed_answers.add(str(e["task_id"]))
    return {
        "runs": {"single": runs.get(SINGLE_TASK, 0), "slots": runs.get(SLOTS_TASK, 0)},
        "holds": holds,
        "runs_kept_aside_as_the_other_kind": len(mixed_answers),
    }
