"""The Celery app the lock-set checker (tests/lockcheck.py) runs in real ``celery worker`` processes.

Configured from the environment: LOCKCHECK_BROKER, LOCKCHECK_MONGODB_URL, LOCKCHECK_DB, LOCKCHECK_LEASE
(lease seconds), LOCKCHECK_READY_DIR (worker_ready marker files), LOCKCHECK_HIST_DIR (history files).

Each task does one read-modify-write of a protected document under its lease (``lockcheck.run_hold``),
with an operation id chosen by the submitter, so that a redelivered or retried run of the same task is
recognised and never applies its update twice.

The queued tasks (``rmw_queue``: ``Queue()``, ``rmw_replace``: ``Replace()``) also leave what the order
checks need: every admission's outcome with the fence in the lease document at that moment (``admit``,
recorded around ``LeaseStore.admit``), every handoff with the fence it gave (``handoff``, around
``Handoffs.publish``, the store's part that publishes handoffs), and the library's ``run_parked``,
``run_handed_off`` and ``run_superseded`` signals. These wrappers only record; they call the library's own
methods unchanged.

The ``limit=N`` tasks (``rmw_limit``: ``Retry``, ``rmw_limit_skip``: ``Skip``, ``rmw_limit_queued``:
``Queue()``; N = ``lockcheck.LIMIT``) write their slot's part of the key's protected document
(``lockcheck.run_slot_hold``); a slot handed to a parked run is recorded as a ``handoff`` with its slot
and fence. ``rmw_limit_held`` is ``rmw_limit_queued`` with ``min_hold_seconds=lockcheck.MIN_HOLD``: its
acquisitions carry the hold (``mh``), and ``lockcheck.check_min_holds`` checks that a slot it released
cleanly is not taken again before the hold ended. The several-keys tasks (``rmw_multi``: ``Retry``,
``rmw_multi_skip``: ``Skip``, ``rmw_multi_queued``: ``Queue()``, ``rmw_multi_replace``: ``Replace()``
(``rmw_multi_replace_debounced``: ``Replace(debounce=...)``; ``rmw_multi_replace_capped``: with
``max_wait``), on
``m`` keys of its own; ``keys=("{a}", "{b}")``) write each key's protected document with that key's lease
and fence (``lockcheck.run_multi_hold``). The several-keys task with a limit per key
(``rmw_multi_limit``: ``Retry``; ``keys=("{a}", "{b}")``, ``limit={"{a}": N}``) takes ``a`` (an ``l`` key)
as one of its N slots and ``b`` (a ``k`` key) as the single lease, and writes ``a``'s document in its
slot's part and ``b``'s as a plain key's (``rmw_multi_limit_queued``: the same under ``Queue()``,
``rmw_multi_limit_replace``: under ``Replace()``, latest wins per pair). The reentrant task
(``rmw_reentrant``, the same keys and limit) writes ``a`` through an in-process call of
``rmw_reentrant_inner`` (``limit=N``, ``Fail``) and ``b`` inside ``store.hold(b)``: both reentrant holds
of its run's leases (``lockcheck.run_reentered``). The rate-limited task
(``rmw_rate``: ``rate=RateLimit(...)``, ``Retry``) records every attempt at a start (``rtake``, around
``RateWindows.take``, with the windows ``RateWindow.of`` made of its commands' replies). Every contention
of a singleton run (``lease_contended``) is recorded as ``tcont`` (task id, key, policy): the controller
waits for it to drive contention by construction.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
import traceback
from pathlib import Path
from typing import Any

from celery import Celery, Task
from celery.signals import before_task_publish, task_postrun, task_prerun, task_received, worker_ready
from pymongo.errors import PyMongoError

from celery_mongolock import (
    Fail,
    LeaseLost,
    LeaseStore,
    LockContended,
    Queue,
    RateLimit,
    Replace,
    Retry,
    Skip,
    current_lease,
    is_superseded,
    singleton_task,
)
from celery_mongolock import signals as mongolock_signals
from celery_mongolock.config import get_store
from celery_mongolock.core.documents.rate import RateWindow
from celery_mongolock.core.documents.sets import gate_of, set_signature, user_keys
from celery_mongolock.core.store_handoffs import Handoffs
from celery_mongolock.core.store_rate import RateWindows
from celery_mongolock.integration.handoff import HANDOFF_HEADER, REPUBLISH_RETRY_POLICY
from celery_mongolock.lease import LeaseSet
from celery_mongolock.task import DUPLICATE_HEADER

from . import lockcheck
from . import lockcheck_mixed as mixed

app = Celery("lockcheck_app")
app.conf.update(
    broker_url=os.environ.get("LOCKCHECK_BROKER", "memory://"),
    result_backend=os.environ.get("LOCKCHECK_BACKEND")
    or os.environ.get("LOCKCHECK_BROKER", "cache+memory://"),
    broker_connection_retry_on_startup=True,
    # Unacknowledged messages of a node killed outright come back after this many seconds (kombu sweeps
    # every interval * throttle seconds: 100 by default). kombu judges visibility by the *sweeper's* wall
    # clock against the wall-clock time of delivery, so the skewed node (its clock jumps forward by
    # minutes) gets a visibility timeout it never reaches (LOCKCHECK_VISIBILITY_TIMEOUT): sweeping with
    # the short one, it handed out again every message the other nodes (and itself) were running, and a
    # copy dropped as a duplicate while the first run still held the lease was lost for good when that
    # first run's node was then killed (tasks left pending: see lockcheck.SKEWED_VISIBILITY_TIMEOUT).
    broker_transport_options={
        "visibility_timeout": int(
            os.environ.get("LOCKCHECK_VISIBILITY_TIMEOUT", str(lockcheck.VISIBILITY_TIMEOUT))
        ),
        "unacked_restore_interval": int(os.environ.get("LOCKCHECK_RESTORE_INTERVAL", "2")),
        "unacked_restore_throttle": 1,
        # A sweep holds a Redis mutex (5 minutes by default): a node SIGKILLed in mid-sweep would stop
        # every other node's sweeps for longer than the checker waits for the last tasks.
        "unacked_mutex_expire": 10,
        # RabbitMQ (the Redis transport ignores it): every publish waits for the broker's confirm, so that a
        # retry or handoff re-published just before a broker crash is not lost unseen.
        "confirm_publish": True,
    },
    # A result stored while the broker (also the result backend here) restarts is retried, not lost; with
    # the default, a run that did its work ends FAILURE (ConnectionError) when its result cannot be stored.
    result_backend_always_retry=True,
    result_backend_max_retries=60,
    # A link callback or a chain's next step is published by Celery's trace after the body returns, with
    # this policy (about 0.6 s of retries by default); given up, the run ends FAILURE (OperationalError)
    # although its body ran. Ridden over a broker restart like the library's own publishes (ci9: a linked
    # Replace run that ended during a Redis restart).
    task_publish_retry_policy=dict(REPUBLISH_RETRY_POLICY),
    worker_hijack_root_logger=False,
    worker_prefetch_multiplier=1,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    mongolock_url=os.environ.get("LOCKCHECK_MONGODB_URL", "mongodb://127.0.0.1:27017"),
    mongolock_database=os.environ.get("LOCKCHECK_DB", "lockcheck"),
    mongolock_lease_seconds=float(os.environ.get("LOCKCHECK_LEASE", "2")),
    mongolock_operation_timeout=5.0,
    # 2 parked Queue runs of a priority per lease document, the rest spilled (``documents.spill``): the
    # checker's queues go through the spill and its refills under every fault.
    mongolock_parked_window=lockcheck.PARKED_WINDOW,
)

_rng = random.Random()


@worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    ready_dir = os.environ.get("LOCKCHECK_READY_DIR")
    if ready_dir:
        name = getattr(sender, "hostname", "worker")
        Path(ready_dir, f"{name}.ready").write_text(str(os.getpid()))


def _history() -> lockcheck.HistoryWriter | None:
    hist_dir = os.environ.get("LOCKCHECK_HIST_DIR")
    return lockcheck.HistoryWriter.for_process(hist_dir) if hist_dir else None


# Where each task's messages went, for telling a message the broker lost from one the library lost:
# kombu's Redis transport pops a message (BRPOP) before it records it as unacknowledged, so a node
# SIGKILLed in between loses the message with no trace (celery/celery#7950). A message that some node
# received was recorded by then (``task_received`` is sent after kombu's ``qos.append``).
@task_received.connect
def _received(request: Any = None, **_: Any) -> None:
    hist = _history()
    if hist is not None and request is not None:
        # Which delivery this is (``ran-after-release`` names the deliveries received after a death):
        # the broker's redelivery flag, a parked duplicate, a handoff (through its queue's handoff lane or
        # not), and the run's own retries.
        headers = getattr(request, "request_dict", None) or {}
        hist.event(
            "recv", task_id=request.id, node=request.hostname, t=time.monotonic(),
            redelivered=bool((request.delivery_info or {}).get("redelivered")),
            dup=bool(headers.get(DUPLICATE_HEADER)), handoff=bool(headers.get(HANDOFF_HEADER)),
            lane=isinstance(headers.get(HANDOFF_HEADER), dict) and bool(headers[HANDOFF_HEADER].get("rt")),
            retries=headers.get("retries"),
        )  # fmt: skip


@before_task_publish.connect
def _publishing(headers: Any = None, **_: Any) -> None:
    hist = _history()  # worker processes only (retries, parked duplicates): the submitter keeps its own
    if hist is not None and headers and headers.get("id"):
        hist.event("pub", task_id=headers["id"], t=time.monotonic())


@task_postrun.connect
def _ended(task_id: Any = None, state: Any = None, retval: Any = None, **_: Any) -> None:
    """How each run ended in the worker (SUCCESS, RETRY, REJECTED, FAILURE, IGNORED): with the broker's
    file (tests/brokerlog.py) this says what became of an unfinished task's last message."""
    hist = _history()
    if hist is not None and task_id:
        hist.event("ended", task_id=task_id, state=str(state), retval=repr(retval)[:200], t=time.monotonic())


# -- what the queued tasks' checks need (lockcheck.check_queued) ------------------------------------------
_library_admit = LeaseStore.admit
_library_handed = Handoffs.publish


def _admit(self: LeaseStore, key: str, entry: Any, **kwargs: Any) -> Any:
    """``LeaseStore.admit``, recording its outcome and the key's fence in the command's reply: a run
    parked with fence f was in the queue before every grant of a larger fence (one document, one order)."""
    t0 = time.monotonic()
    lease, doc = _library_admit(self, key, entry, **kwargs)
    hist = _history()
    if hist is not None:
        # Recording must never break the run (a lease taken here and never handed back would be renewed
        # for good): a bug of the recording is an ``unexpected`` event, which fails the run's report.
        try:
            _record_admit(hist, key, entry, lease, doc, kwargs=kwargs, t0=t0)
        except Exception:
            hist.event("unexpected", who="admit-recorder", error=traceback.format_exc()[-2000:])
    _reservation_window(self, key, entry, doc, hist)
    return lease, doc


def _reservation_window(self: LeaseStore, key: str, entry: Any, doc: Any, hist: Any) -> None:
    """The directed reservation window (``lockcheck.Run._reservation_window``): a several-keys ``Replace``
    run that holds the window's first key and has just parked on its second (held by the controller's
    gate) waits here, between its admits and the reservation of the key it holds, until a newer send of
    its set has parked on that key (the controller sends it meanwhile): the window in which the newer send
    finds a held lease, not a reservation, to take back. Only the run that consumes the controller's marker
    (``lockcheck.WINDOW_MARKERS``) waits, and only while it still holds the key (its lease may lapse on a
    loaded machine); it writes on the marker whether it saw the newer send parked. Waits on the lease
    document, with a deadline."""
    first = lockcheck.window_first_key(key)
    # (on its second key a run of a set waits as a Queue run, its entry without its set's signature; runs
    # of the set supersede each other on its gate, ``sets.gate_of``)
    named = user_keys(entry.get("ks") or [])
    group = entry.get("g") or (set_signature(named) if named else None)
    if first is None or doc.get("lo") != "parked" or not group:
        return
    gate = gate_of(named)
    if not holds(self, first, entry):
        return
    markers = self.collection.database[lockcheck.WINDOW_MARKERS]
    if markers.find_one_and_update({"_id": first, "run": entry.get("t")}, {"$unset": {"run": ""}}) is None:
        return  # not the run this attempt's window was armed for (or it came here before)

    def newer_parked() -> bool:
        d = self.collection.find_one({"_id": gate}, {"q.g": 1, "q.s": 1}) or {}
        return any(e.get("g") == group and int(e.get("s") or 0) > int(entry["s"]) for e in d.get("q") or [])

    deadline = time.monotonic() + lockcheck.WINDOW_WAIT_S
    while not (seen := newer_parked()) and holds(self, first, entry) and time.monotonic() < deadline:
        time.sleep(0.05)
    with contextlib.suppress(PyMongoError):  # (a fault here must not break the run's admit)
        markers.update_one({"_id": first}, {"$set": {"seen": seen, "task_id": entry.get("t")}})
    if hist is not None:
        hist.event("window", key=first, task_id=entry.get("t"), seen=seen, t=time.monotonic())


def holds(store: LeaseStore, key: str, entry: Any) -> bool:
    """The run of ``entry`` holds ``key`` (its lease, as the lease document says)."""
    held = store.collection.find_one({"_id": key}, {"owner": 1, "holder.task_id": 1}) or {}
    return bool(held.get("owner")) and (held.get("holder") or {}).get("task_id") == entry.get("t")


def _record_admit(
    hist: lockcheck.HistoryWriter, key: str, entry: Any, lease: Any, doc: Any, *, kwargs: Any, t0: float
) -> None:
    # A ``limit=N`` key's reply: ``fence`` is the key's latest (every grant raises it); the run's own
    # grant is its lease's fence and slot, and the slots handed to parked runs are holds with ``ho``.
    slotted = kwargs.get("limit") is not None
    extra: dict[str, Any] = {}
    if slotted:
        extra["handed_slots"] = [
            [h["ho"].get("t"), h.get("f"), h.get("s"), h["ho"].get("hn")]
            for h in doc.get("hs") or []
            if isinstance(h, dict) and isinstance(h.get("ho"), dict)
        ]
    fence = doc.get("fence") if not slotted or lease is None else lease.fence
    if slotted and lease is not None:
        extra["slot"] = lease.slot
    hist.event(
        "admit", key=key, task_id=entry.get("t"), run=entry.get("id"), stamp=entry.get("s"),
        outcome=doc.get("lo"), fence=fence, by=doc.get("lo_by"),
        # (parked beyond its key's window: ``documents.spill``; the reply carries the number it took)
        spilled=bool(doc.get("ls")) and doc.get("lo") == "parked",
        claim=kwargs.get("claim") is not None, handed=(doc.get("ho") or {}).get("t"),
        t0=t0, t=time.monotonic(), **extra,
    )  # fmt: skip


def _handed(self: Handoffs, key: str, doc: Any, by: str, *, refill: bool = True) -> Any:
    """``Handoffs.publish`` (the command whose reply is ``doc`` handed ``key``), recording the handoff
    and the fence it gave before the run is published. A ``limit=N`` key hands slots: each is a hold in
    ``hs`` with the run's entry in its ``ho`` and its own fence and slot."""
    hist = _history()
    if hist is not None:
        try:  # never break the handoff (see ``_admit``)
            _record_handed(hist, key, doc, by)
        except Exception:
            hist.event("unexpected", who="handoff-recorder", error=traceback.format_exc()[-2000:])
    return _library_handed(self, key, doc, by, refill=refill)


def _record_handed(hist: lockcheck.HistoryWriter, key: str, doc: Any, by: str) -> None:
    found = [(ho, (doc or {}).get("fence"), None) for ho in [(doc or {}).get("ho")]]
    found += [
        (h.get("ho"), h.get("f"), h.get("s")) for h in (doc or {}).get("hs") or [] if isinstance(h, dict)
    ]
    for ho, fence, slot in found:
        if isinstance(ho, dict) and ho.get("by") == by and by:
            hist.event(
                "handoff", key=key, task_id=ho.get("t"), run=ho.get("id"), stamp=ho.get("s"),
                fence=fence, attempt=ho.get("hn"), t=time.monotonic(), by=by,
                **({} if slot is None else {"slot": slot}),
            )  # fmt: skip
    # The slots this reply shows handed by another command, not yet claimed: a handoff nobody published
    # (a bare client's release, a lost lease's background release, a command whose reply was lost) is a
    # grant all the same, recorded by nobody else (``lockcheck.grants``).
    others = [
        [h["ho"].get("t"), h.get("f"), h.get("s"), h["ho"].get("hn")]
        for h in (doc or {}).get("hs") or []
        if isinstance(h, dict) and isinstance(h.get("ho"), dict) and not (by and h["ho"].get("by") == by)
    ]
    if others:
        hist.event("handed-seen", key=key, handed_slots=others, t=time.monotonic())


_library_unpark = LeaseStore.unpark


def _unpark(self: LeaseStore, key: str, entry_id: str) -> bool:
    """``LeaseStore.unpark``, recorded when the run was there (``left``: its place on the key ends then;
    ``lockcheck.check_queue`` judges it there from its next park, if any)."""
    was = _library_unpark(self, key, entry_id)
    hist = _history()
    if was and hist is not None:
        task_id = str(entry_id).split("/")[0]
        hist.event("left", task_id=task_id, run=entry_id, keys=[key], t=time.monotonic())
    return was


LeaseStore.admit = _admit  # type: ignore[method-assign]
Handoffs.publish = _handed  # type: ignore[method-assign]
LeaseStore.unpark = _unpark  # type: ignore[method-assign,assignment]


# -- what the rate's checks need (lockcheck.check_rate) ----------------------------------------------------
_library_take = RateWindows.take
_library_window_of = RateWindow.of.__func__  # type: ignore[attr-defined]
#: The windows the current ``RateWindows.take`` of this process saw (its commands' replies, in order). A
#: prefork child runs one task at a time, so one list per process will do.
_windows_seen: list[RateWindow] = []


def _window_of(cls: type[RateWindow], key: str, doc: Any) -> RateWindow:
    """``RateWindow.of``, keeping the window a command's reply showed (its starts with their ids and
    times on the server's clock, its parked runs, the command's ``$$NOW``)."""
    window: RateWindow = _library_window_of(cls, key, doc)
    _windows_seen.append(window)
    return window


def _take(
    self: RateWindows,
    keys: Any,
    *,
    run: str,
    stamp: int,
    n: int,
    period_ms: int,
    park: bool,
    rank: int = 0,
    replaces: str | None = None,
) -> Any:
    """``RateWindows.take``, recording its answer and the windows its commands' replies showed
    (``rtake``): a start granted at a time of the server's clock, or a run parked with its place."""
    from celery import current_task

    del _windows_seen[:]
    request = getattr(current_task, "request", None)
    who = f"task:{getattr(request, 'hostname', None)}:{os.getpid()}"
    fields = {
        "who": who,
        "task_id": run.split("/", maxsplit=1)[0],
        "run": run,
        "stamp": stamp,
        "rank": rank,
        "keys": list(keys),
    }
    t0 = time.monotonic()
    try:
        took = _library_take(
            self,
            keys,
            run=run,
            stamp=stamp,
            n=n,
            period_ms=period_ms,
            park=park,
            rank=rank,
            replaces=replaces,
        )
    except Exception as exc:
        hist = _history()
        if hist is not None:
            hist.event(
                "rtake", **fields, n=n, p=period_ms, t0=t0, t=time.monotonic(), error=type(exc).__name__
            )
        raise
    hist = _history()
    if hist is not None:
        try:  # never break the run (see ``_admit``)
            lockcheck.record_rate_take(
                hist, took, list(_windows_seen), n=n, period_ms=period_ms, t0=t0, **fields
            )
        except Exception:
            hist.event("unexpected", who="rate-recorder", error=traceback.format_exc()[-2000:])
    return took


RateWindow.of = classmethod(_window_of)  # type: ignore[assignment,method-assign]
RateWindows.take = _take  # type: ignore[method-assign]


@mongolock_signals.lease_contended.connect
def _contended(sender: Any = None, key: Any = None, policy: Any = None, **_: Any) -> None:
    """A run found ``key`` held (full) and its policy decides (``policy``): sent before it does."""
    hist = _history()
    if hist is not None:
        request = getattr(sender, "request", None)
        hist.event(
            "tcont", key=key, task_id=getattr(request, "id", None), task=getattr(sender, "name", None),
            policy=policy, t=time.monotonic(),
        )  # fmt: skip


@mongolock_signals.run_parked.connect
def _parked(key: Any = None, task_id: Any = None, position: Any = None, stamp: Any = None, **_: Any) -> None:
    hist = _history()
    if hist is not None:
        hist.event("parked", key=key, task_id=task_id, position=position, stamp=stamp, t=time.monotonic())


@mongolock_signals.run_handed_off.connect
def _handed_off(key: Any = None, task_id: Any = None, attempt: Any = None, **_: Any) -> None:
    hist = _history()
    if hist is not None:
        hist.event("handed", key=key, task_id=task_id, attempt=attempt, t=time.monotonic())


@mongolock_signals.run_superseded.connect
def _superseded(key: Any = None, task_id: Any = None, by: Any = None, **_: Any) -> None:
    hist = _history()
    if hist is not None:
        hist.event("superseded", key=key, task_id=task_id, by=by, t=time.monotonic())


def _stamp(request: Any) -> Any:
    """The run's send stamp, as the library reads it (header ``mongolock_sent``)."""
    stamp = (getattr(request, "headers", None) or {}).get("mongolock_sent")
    return stamp if stamp is not None else getattr(request, "mongolock_sent", None)


def _linger(lease: Any, path: str | None) -> None:
    """Keep the key (the heartbeat renews it) until the controller creates ``path``: a Celery child that
    holds a lease for the fault about to begin (``lockcheck.Run._lingering``). A lost lease ends it."""
    give_up = time.monotonic() + lockcheck.LINGER_GUARD_S
    while (
        path
        and not os.path.exists(path)
        and not lease.lost
        and not lease.superseded  # (Replace(cancel_running=True): a newer send took over)
        and time.monotonic() < give_up
    ):
        time.sleep(0.05)


def _die_after_release(task: Any, hist: lockcheck.HistoryWriter, key: str, released: bool) -> None:
    """``die``: the run's body has ended and released its key; its worker dies before Celery stores the
    result (the child SIGKILLs itself). Its parent requeues the message (``task_reject_on_worker_lost``),
    marked redelivered: that copy must end the task ``already-ran`` and never run the body again (when the
    release matched: ``released``; a run whose lease had expired is not known to have run, and its copy
    runs). Only a message's first delivery dies (a copy that ran the body would be a second run)."""
    request = task.request
    if (request.delivery_info or {}).get("redelivered") or (request.headers or {}).get(DUPLICATE_HEADER):
        return
    hist.event("die", task_id=request.id, key=key, released=released, t=time.monotonic())
    os.kill(os.getpid(), signal.SIGKILL)


def _stop_if_superseded(lease: Any, done: bool) -> None:
    """A body told of a newer send (``Replace(cancel_running=True)``) that did not do its work stops for
    it (it raises ``Superseded`` below): said before its release, which this body sends itself, as the
    library says it for a body that raises it out (``run_body``)."""
    if not done and lease.superseded:
        lease.end_superseded()


def _body(
    task: Any, key: str, op: str, reckless: bool, linger: str | None = None, *, die: bool = False
) -> dict[str, Any]:
    lease = current_lease()
    assert lease is not None
    hist = _history() or lockcheck.HistoryWriter.for_process(".")
    who = f"task:{task.request.hostname}:{os.getpid()}"
    docs = lockcheck.docs_collection(app.conf.mongolock_url, app.conf.mongolock_database)
    headers = task.request.headers or {}
    lockcheck.record_receipt(
        hist, lease, who, task.request.id, attempt=task.request.retries,
        redelivered=bool((task.request.delivery_info or {}).get("redelivered")),
        dup=bool(headers.get(DUPLICATE_HEADER)), handoff=bool(headers.get(HANDOFF_HEADER)),
    )  # fmt: skip
    if isinstance(lease, LeaseSet):  # keys=(...): every key's lease, then each key's document
        lockcheck.record_set_acquired(hist, lease, who, task.request.id)
        _linger(lease, linger)
        outcomes = lockcheck.run_multi_hold(
            lease, docs, hist, op, _rng, reckless=reckless, who=who, task_id=task.request.id
        )
        _stop_if_superseded(lease, len(outcomes) == len(lease) and set(outcomes) == {"ack"})
        for one in reversed(list(lease)):
            lockcheck.release_and_record(one, hist, who)
        outcome = "ack" if len(outcomes) == len(lease) and set(outcomes) == {"ack"} else "cut"
    else:
        lockcheck.record_task_acquired(
            hist, lease, who, task.request.id, stamp=_stamp(task.request),
            min_hold=getattr(task, "mongolock_min_hold_seconds", None),
        )  # fmt: skip
        _linger(lease, linger)
        hold = lockcheck.run_hold if lease.slot is None else lockcheck.run_slot_hold
        if lockcheck.key_policy(key) == "mixed":  # (a key used both ways: both kinds' fences)
            hold = mixed.run_mixed_hold
        outcomes = hold(lease, docs, hist, [op], _rng, reckless=reckless, who=who, task_id=task.request.id)
        _stop_if_superseded(lease, outcomes[:1] == ["ack"])
        released = lockcheck.release_and_record(lease, hist, who)
        outcome = outcomes[0] if outcomes else "claim-failed"
        if die and outcome == "ack":
            _die_after_release(task, hist, key, released)
    if outcome != "ack" and lease.superseded:
        # Replace(cancel_running=True): a newer send superseded this holder (its writes were refused from
        # then on): the run ends superseded, not retried.
        lease.raise_if_superseded()
    if outcome != "ack":
        # Fenced out, lease lost, or MongoDB unreachable: do the work again under a new lease.
        if os.environ.get("LOCKCHECK_CELERY_RETRY"):
            # Experiment knob: Celery's own Task.retry (gives up publishing after about 0.6 s and then
            # rejects the message without requeue), to reproduce the loss SingletonTask.retry fixes.
            raise Task.retry(task, countdown=0.2 + _rng.random() * 0.3)
        raise task.retry(countdown=0.2 + _rng.random() * 0.3)
    return {"op": op, "outcome": outcome}


@singleton_task(
    key="{key}",
    app=app,
    name="lockcheck.rmw",
    bind=True,
    on_contention=Retry(countdown=0.2, backoff=1.5, max_countdown=1.0),
    max_retries=200,
)
def rmw(
    self: Any, key: str, op: str, reckless: bool = False, linger: str | None = None, *, die: bool = False
) -> dict[str, Any]:
    """Read-modify-write of protected[key] under the lease; busy key: retry later. With ``linger`` (a
    path), the run holds its key until that file exists before it writes; ``die``: see
    ``_die_after_release`` (the single-key tasks but ``Replace`` and ``limit=N`` ``Skip`` take it)."""
    return _body(self, key, op, reckless, linger, die=die)


@singleton_task(
    key="{key}",
    app=app,
    name=lockcheck.UNIQUE_TASK,
    bind=True,
    on_contention=Retry(countdown=0.2, backoff=1.5, max_countdown=1.0),
    max_retries=200,
    unique_send=True,
    unique_send_seconds=lockcheck.UNIQUE_SEND_SECONDS,
)
def rmw_unique(self: Any, key: str, op: str, reckless: bool = False) -> dict[str, Any]:
    """``rmw`` with ``unique_send``: the controller sends it several times with equal arguments
    (``lockcheck.Run._submit_unique``); a send while an equal one is pending gets that run."""
    return _body(self, key, op, reckless)


@singleton_task(
    key="{key}",
    app=app,
    name=lockcheck.RATE_TASK,
    bind=True,
    rate=RateLimit(lockcheck.RATE_N, lockcheck.RATE_PERIOD),
    on_contention=Retry(countdown=0.2, backoff=1.5, max_countdown=1.0),
    max_retries=200,
)
def rmw_rate(self: Any, key: str, op: str, reckless: bool = False) -> dict[str, Any]:
    """``rmw`` with ``rate=RateLimit(RATE_N, RATE_PERIOD)`` on ``t`` keys of its own: a run over the rate
    gives its key back and is parked (its message published again for its turn, no worker slot held);
    a run that finds the key held retries. Its takes of a start are recorded (``_take``)."""
    return _body(self, key, op, reckless)


@singleton_task(
    key="{key}", app=app, name=lockcheck.RATE_QUEUE_TASK, bind=True, max_retries=200,
    rate=RateLimit(lockcheck.RATE_N, lockcheck.RATE_PERIOD), on_contention=Queue(),
)  # fmt: skip
def rmw_rate_queued(self: Any, key: str, op: str, reckless: bool = False) -> dict[str, Any]:
    """``rmw_rate`` under ``Queue()``: a run that finds its key held parks on it and is handed it in send
    order; then it takes its start, or (over the rate) gives the key back and waits its turn in the
    window."""
    return _body(self, key, op, reckless)


@task_prerun.connect
def _unique_delivery(sender: Any = None, task_id: Any = None, **_: Any) -> None:
    """Each delivery of a ``unique_send`` run, before its admission (and so before the library forgets
    its pending send, when its body is about to start): ``lockcheck.check_unique`` bounds when the
    delivery that ran the body began."""
    hist = _history()
    if hist is not None and getattr(sender, "name", None) == lockcheck.UNIQUE_TASK:
        who = f"task:{sender.request.hostname}:{os.getpid()}"
        hist.event("upre", task_id=task_id, who=who, t=time.monotonic())


@singleton_task(
    key="{key}", app=app, name="lockcheck.rmw_skip", bind=True, on_contention=Skip(), max_retries=200
)
def rmw_skip(self: Any, key: str, op: str, reckless: bool = False, die: bool = False) -> dict[str, Any]:
    """The same, but a run that finds the key held is skipped (its result says so)."""
    return _body(self, key, op, reckless, die=die)


@singleton_task(
    key="{key}", app=app, name="lockcheck.rmw_queue", bind=True, on_contention=Queue(), max_retries=200
)
def rmw_queue(self: Any, key: str, op: str, reckless: bool = False, die: bool = False) -> dict[str, Any]:
    """The same, but a run that finds the key held is parked and handed the key in send order."""
    return _body(self, key, op, reckless, die=die)


@app.task(name="lockcheck.linked")
def linked(value: Any, parent: str) -> None:
    """The ``link`` callback of some ``rmw_replace`` runs (``lockcheck.LINK_SHARE``): records that it was
    called for ``parent``, and whether with a superseded result (``lockcheck.check_links``)."""
    hist = _history()
    if hist is not None:
        hist.event("linked", task_id=parent, superseded=is_superseded(value), t=time.monotonic())


@singleton_task(
    key="{key}", app=app, name="lockcheck.rmw_replace", bind=True, on_contention=Replace(), max_retries=200
)
def rmw_replace(self: Any, key: str, op: str, reckless: bool = False) -> dict[str, Any]:
    """The same, but latest wins: a newer send replaces the parked run (which ends superseded)."""
    return _body(self, key, op, reckless)


@singleton_task(
    key="{key}", app=app, name=lockcheck.REPLACE_CANCEL_TASK, bind=True, max_retries=200,
    on_contention=Replace(cancel_running=True, grace=lockcheck.CANCEL_GRACE),
)  # fmt: skip
def rmw_replace_cancel(
    self: Any, key: str, op: str, reckless: bool = False, linger: str | None = None, *, deaf: bool = False
) -> dict[str, Any]:
    """``rmw_replace`` with ``cancel_running=True``: a newer send supersedes the running holder too, which
    is told (``superseded-notice``), has its fenced writes refused and ends superseded. ``deaf``: the body
    never looks and never writes (it holds the key until its child is terminated after the grace, or
    ``lockcheck.LINGER_GUARD_S``); ``linger``: as for ``rmw`` (a superseded holder stops lingering)."""
    lease = current_lease()
    assert lease is not None
    hist = _history() or lockcheck.HistoryWriter.for_process(".")
    tid = self.request.id

    def told(held: Any, by: str) -> None:
        hist.event(
            "superseded-notice",
            key=key,
            task_id=tid,
            hold=held.owner,
            fence=held.fence,
            by=by,
            t=held.superseded_at,  # (when the lease was marked: the body may act on it before this runs)
        )

    lease.on_superseded(told)
    if not deaf:
        return _body(self, key, op, reckless, linger)
    who = f"task:{self.request.hostname}:{os.getpid()}"
    lockcheck.record_task_acquired(hist, lease, who, tid, stamp=_stamp(self.request))
    give_up = time.monotonic() + lockcheck.LINGER_GUARD_S
    while time.monotonic() < give_up and not lease.lost:
        time.sleep(0.05)  # deaf: never looks at lease.superseded
    lockcheck.release_and_record(lease, hist, who)
    raise self.retry(countdown=0.2)  # never terminated: run again (the checker reports the burst)


@singleton_task(
    key="{key}",
    app=app,
    name="lockcheck.rmw_limit",
    bind=True,
    limit=lockcheck.LIMIT,
    on_contention=Retry(countdown=0.2, backoff=1.5, max_countdown=1.0),
    max_retries=200,
)
def rmw_limit(self: Any, key: str, op: str, reckless: bool = False, die: bool = False) -> dict[str, Any]:
    """Up to ``LIMIT`` at once per key, each writing its slot's part of the document; full: retry later."""
    return _body(self, key, op, reckless, die=die)


@singleton_task(
    key="{key}", app=app, name="lockcheck.rmw_limit_skip", bind=True, limit=lockcheck.LIMIT,
    on_contention=Skip(), max_retries=200,
)  # fmt: skip
def rmw_limit_skip(self: Any, key: str, op: str, reckless: bool = False) -> dict[str, Any]:
    """The same, but a run that finds every slot held is skipped."""
    return _body(self, key, op, reckless)


@singleton_task(
    key="{key}", app=app, name="lockcheck.rmw_limit_queued", bind=True, limit=lockcheck.LIMIT,
    on_contention=Queue(), max_retries=200,
)  # fmt: skip
def rmw_limit_queued(
    self: Any, key: str, op: str, reckless: bool = False, die: bool = False
) -> dict[str, Any]:
    """The same, but a run that finds every slot held is parked and handed a slot in send order."""
    return _body(self, key, op, reckless, die=die)


@singleton_task(
    key="{key}", app=app, name=mixed.SINGLE_TASK, bind=True, on_contention=Queue(), max_retries=200
)
def rmw_mixed_single(self: Any, key: str, op: str, reckless: bool = False) -> dict[str, Any]:
    """A key used both ways (``lockcheck_mixed``): this run takes it as a single lease, parks behind its
    kind, and is kept aside (a contention retry) while the key is in use as slots."""
    return _body(self, key, op, reckless)


@singleton_task(
    key="{key}", app=app, name=mixed.SLOTS_TASK, bind=True, limit=lockcheck.LIMIT, on_contention=Queue(),
    max_retries=200,
)  # fmt: skip
def rmw_mixed_slots(self: Any, key: str, op: str, reckless: bool = False) -> dict[str, Any]:
    """The same key taken as one of ``LIMIT`` slots: kept aside while it is in use as a single lease."""
    return _body(self, key, op, reckless)


@singleton_task(
    key="{key}", app=app, name=lockcheck.MIN_HOLD_TASK, bind=True, limit=lockcheck.LIMIT,
    min_hold_seconds=lockcheck.MIN_HOLD, on_contention=Queue(), max_retries=200,
)  # fmt: skip
def rmw_limit_held(self: Any, key: str, op: str, reckless: bool = False) -> dict[str, Any]:
    """``rmw_limit_queued`` with a minimum hold: a slot released before it ends stays taken until then,
    and a run parked on the key is handed it when the hold ends (by a sweep, or the next admit)."""
    return _body(self, key, op, reckless)


@singleton_task(
    keys=("{a}", "{b}"),
    app=app,
    name="lockcheck.rmw_multi",
    bind=True,
    on_contention=Retry(countdown=0.2, backoff=1.5, max_countdown=1.0),
    max_retries=200,
)
def rmw_multi(self: Any, a: str, b: str, op: str, reckless: bool = False) -> dict[str, Any]:
    """Holds both keys (named in either order by the submitter) and writes each key's document."""
    return _body(self, f"{a}+{b}", op, reckless)


@singleton_task(
    keys=("{a}", "{b}"), app=app, name="lockcheck.rmw_multi_skip", bind=True, on_contention=Skip(),
    max_retries=200,
)  # fmt: skip
def rmw_multi_skip(self: Any, a: str, b: str, op: str, reckless: bool = False) -> dict[str, Any]:
    """The same, but a run that finds either key held is skipped."""
    return _body(self, f"{a}+{b}", op, reckless)


@singleton_task(
    keys=("{a}", "{b}"), app=app, name="lockcheck.rmw_multi_queued", bind=True, on_contention=Queue(),
    max_retries=200,
)  # fmt: skip
def rmw_multi_queued(self: Any, a: str, b: str, op: str, reckless: bool = False) -> dict[str, Any]:
    """The same, but a run that finds either key held parks on it and keeps its place on each key
    (the keys it got become reservations for it); it runs once both are reserved for it."""
    return _body(self, f"{a}+{b}", op, reckless)


@singleton_task(
    keys=("{a}", "{b}"), app=app, name=lockcheck.MULTI_TIMED_TASK, bind=True, max_retries=200,
    on_contention=Queue(timeout=lockcheck.TIMED_WAIT_S, then=Skip()),
)  # fmt: skip
def rmw_multi_timed(self: Any, a: str, b: str, op: str, reckless: bool = False) -> dict[str, Any]:
    """``rmw_multi_queued`` that waits at most ``TIMED_WAIT_S`` parked: past it, it ends skipped and its
    places and reservations go."""
    return _body(self, f"{a}+{b}", op, reckless)


@singleton_task(
    keys=("{a}", "{b}"), app=app, name=lockcheck.MULTI_REPLACE_TASK, bind=True, on_contention=Replace(),
    max_retries=200,
)  # fmt: skip
def rmw_multi_replace(self: Any, a: str, b: str, op: str, reckless: bool = False) -> dict[str, Any]:
    """The same, but latest wins per set of keys: a newer send of the same pair (in either order)
    supersedes the older runs of that pair on both keys; runs of other pairs sharing a key keep their
    place in send order."""
    return _body(self, f"{a}+{b}", op, reckless)


@singleton_task(
    keys=("{a}", "{b}"), app=app, name=lockcheck.MULTI_REPLACE_CANCEL_TASK, bind=True, max_retries=200,
    on_contention=Replace(cancel_running=True, grace=lockcheck.CANCEL_GRACE),
)  # fmt: skip
def rmw_multi_replace_cancel(
    self: Any, a: str, b: str, op: str, reckless: bool = False, *, linger: str | None = None
) -> dict[str, Any]:
    """``rmw_multi_replace`` with ``cancel_running=True``: a newer send of the same pair supersedes the run
    holding it too; each of its leases records its notice (``superseded-notice``: every lease of the set is
    superseded from the first notice on), its fenced writes are refused from then, and it ends superseded.
    ``linger``: it holds both keys first, until told (or the path appears)."""
    held = current_lease()
    assert held is not None
    hist = _history() or lockcheck.HistoryWriter.for_process(".")
    tid = self.request.id

    def told(lease: Any, by: str) -> None:
        hist.event(
            "superseded-notice", key=lease.key, task_id=tid, hold=lease.owner, fence=lease.fence, by=by,
            t=lease.superseded_at,
        )  # fmt: skip

    for lease in held:  # type: ignore[attr-defined]
        lease.on_superseded(told)
    return _body(self, f"{a}+{b}", op, reckless, linger)


@singleton_task(
    keys=("{a}", "{b}"), app=app, name=lockcheck.MULTI_REPLACE_DEBOUNCED_TASK, bind=True,
    on_contention=Replace(debounce=lockcheck.MULTI_REPLACE_DEBOUNCE), max_retries=200,
)  # fmt: skip
def rmw_multi_replace_debounced(self: Any, a: str, b: str, op: str, reckless: bool = False) -> dict[str, Any]:
    """The same, debounced per set of keys: every run waits ``MULTI_REPLACE_DEBOUNCE`` seconds (parked on
    both keys, no worker slot held) and runs only if no newer send of its set came meanwhile."""
    return _body(self, f"{a}+{b}", op, reckless)


@singleton_task(
    keys=("{a}", "{b}"), app=app, name=lockcheck.MULTI_REPLACE_CAPPED_TASK, bind=True, max_retries=200,
    on_contention=Replace(
        debounce=lockcheck.MULTI_REPLACE_DEBOUNCE, max_wait=lockcheck.MULTI_REPLACE_MAX_WAIT
    ),
)  # fmt: skip
def rmw_multi_replace_capped(self: Any, a: str, b: str, op: str, reckless: bool = False) -> dict[str, Any]:
    """The same with a ceiling (``max_wait``): a set that keeps receiving sends still runs."""
    return _body(self, f"{a}+{b}", op, reckless)


@singleton_task(
    keys=("{a}", "{b}"),
    limit={"{a}": lockcheck.LIMIT},
    app=app,
    name=lockcheck.MULTI_LIMIT_TASK,
    bind=True,
    on_contention=Retry(countdown=0.2, backoff=1.5, max_countdown=1.0),
    max_retries=200,
)
def rmw_multi_limit(self: Any, a: str, b: str, op: str, reckless: bool = False) -> dict[str, Any]:
    """Holds a slot of ``a`` (a ``limit=N`` key: ``l<i>``) and the single lease of ``b`` (a plain key:
    ``k<i>``), and writes each key's document with that key's lease and fence (``a``: its slot's part)."""
    return _body(self, f"{a}+{b}", op, reckless)


@singleton_task(
    keys=("{a}", "{b}"),
    limit={"{a}": lockcheck.LIMIT},
    app=app,
    name=lockcheck.REENTRANT_TASK,
    bind=True,
    on_contention=Retry(countdown=0.2, backoff=1.5, max_countdown=1.0),
    max_retries=200,
)
def rmw_reentrant(self: Any, a: str, b: str, op: str, reckless: bool = False) -> dict[str, Any]:
    """Holds a slot of ``a`` (an ``l`` key) and the lease of ``b`` (a ``k`` key), and writes each through a
    reentrant hold of them: ``a`` in an in-process call of ``rmw_reentrant_inner``, ``b`` inside
    ``store.hold(b)`` (``lockcheck.run_reentered``). A run whose ask is not reentered (its lease was lost
    first) or refused writes nothing more and is retried."""
    lease = current_lease()
    assert isinstance(lease, LeaseSet)
    hist = _history() or lockcheck.HistoryWriter.for_process(".")
    who = f"task:{self.request.hostname}:{os.getpid()}"
    tid = self.request.id
    lockcheck.record_set_acquired(hist, lease, who, tid)
    lockcheck.record_body(lease, hist, who, tid)
    outcomes: list[str] = []
    try:
        outcomes.append(rmw_reentrant_inner(a, op, reckless, tid, who))
        if outcomes[-1] == "ack":
            store = get_store(app)
            with store.hold(b, wait=0) as inner:
                outcomes.append(_reentered(inner, "hold", op=op, reckless=reckless, task_id=tid, who=who))
    except (LockContended, LeaseLost) as exc:  # the run's lease lost before or while it asked again
        hist.event("reenter-refused", task_id=tid, who=who, t=time.monotonic(), error=type(exc).__name__)
        outcomes.append("refused")
    for one in reversed(list(lease)):
        lockcheck.release_and_record(one, hist, who)
    if outcomes != ["ack", "ack"]:
        raise self.retry(countdown=0.2 + _rng.random() * 0.3)
    return {"op": op, "outcome": "ack"}


@singleton_task(
    key="{key}",
    limit=lockcheck.LIMIT,
    app=app,
    name=lockcheck.REENTRANT_INNER_TASK,
    on_contention=Fail(),
)
def rmw_reentrant_inner(key: str, op: str, reckless: bool, task_id: str, who: str) -> str:
    """Called in-process by ``rmw_reentrant`` for its ``l`` key: runs with its run's own slot, reentered
    (``Fail``: without reentrance it would find the key held by its own run, or full, and fail)."""
    lease = current_lease()
    assert lease is not None
    return _reentered(lease, "call", op=op, reckless=reckless, task_id=task_id, who=who)


def _reentered(lease: Any, via: str, *, op: str, reckless: bool, task_id: str, who: str) -> str:
    hist = _history() or lockcheck.HistoryWriter.for_process(".")
    docs = lockcheck.docs_collection(app.conf.mongolock_url, app.conf.mongolock_database)
    return lockcheck.run_reentered(
        lease, via, store=get_store(app), docs=docs, hist=hist, op=op, rng=_rng, reckless=reckless, who=who,
        task_id=task_id,
    )  # fmt: skip


@singleton_task(
    keys=("{a}", "{b}"),
    limit={"{a}": lockcheck.LIMIT},
    app=app,
    name=lockcheck.MULTI_LIMIT_QUEUE_TASK,
    bind=True,
    on_contention=Queue(),
    max_retries=200,
)
def rmw_multi_limit_queued(self: Any, a: str, b: str, op: str, reckless: bool = False) -> dict[str, Any]:
    """``rmw_multi_limit`` under Queue: parked on each key it did not get (a slot of ``a``, the lease of
    ``b``), keeping the ones it got as reservations (a slot of ``a`` reserved counts against its limit)."""
    return _body(self, f"{a}+{b}", op, reckless)


@singleton_task(
    keys=("{a}", "{b}"), limit={"{a}": lockcheck.LIMIT, "{b}": lockcheck.LIMIT}, app=app, bind=True,
    name=lockcheck.MULTI_LIMITS_CAPPED_TASK, max_retries=200,
    on_contention=Replace(
        debounce=lockcheck.MULTI_REPLACE_DEBOUNCE, max_wait=lockcheck.MULTI_REPLACE_MAX_WAIT
    ),
)  # fmt: skip
def rmw_multi_limits_capped(self: Any, a: str, b: str, op: str, reckless: bool = False) -> dict[str, Any]:
    """The same with a ceiling: a pair that keeps receiving sends still runs, the ceiling's run handed
    its slots before a newer burst's run of its set."""
    return _body(self, f"{a}+{b}", op, reckless)


@singleton_task(
    keys=("{a}", "{b}"), limit={"{a}": lockcheck.LIMIT, "{b}": lockcheck.LIMIT}, app=app, bind=True,
    name=lockcheck.MULTI_LIMITS_DEBOUNCED_TASK, max_retries=200,
    on_contention=Replace(debounce=lockcheck.MULTI_REPLACE_DEBOUNCE),
)  # fmt: skip
def rmw_multi_limits_debounced(self: Any, a: str, b: str, op: str, reckless: bool = False) -> dict[str, Any]:
    """A slot of each of two ``l`` keys, latest wins per pair, debounced: its entries are not due (no free
    slot handed) before their debounce."""
    return _body(self, f"{a}+{b}", op, reckless)


@singleton_task(
    keys=("{a}", "{b}"),
    limit={"{a}": lockcheck.LIMIT},
    app=app,
    name=lockcheck.MULTI_LIMIT_REPLACE_TASK,
    bind=True,
    on_contention=Replace(),
    max_retries=200,
)
def rmw_multi_limit_replace(self: Any, a: str, b: str, op: str, reckless: bool = False) -> dict[str, Any]:
    """``rmw_multi_limit`` under Replace: latest wins per set of keys, a slot of ``a`` and the lease of
    ``b``; a newer send of the same pair supersedes the older runs of that pair on both keys (parked for
    a slot, or keeping a slot or the lease as a reservation); runs of other pairs keep their place."""
    return _body(self, f"{a}+{b}", op, reckless)
