"""Queued admission in Celery: send stamps, parking a run, publishing handoffs, and the sweeper.

The lease store does the atomic part (``_admission``: park, hand over, claim, all in the lease document).
This module is the Celery side of it:

* **Send stamp.** A ``before_task_publish`` receiver gives every message a ``mongolock_sent`` header
  (microseconds since the epoch, strictly increasing per producer process), unless it has one: a
  handoff, a contention retry or a parked duplicate keeps the stamp of the original send. Runs of a key
  are parked and handed over in stamp order. Messages sent by code that does not load the library have no
  stamp; the worker stamps them when they reach admission (their order is then arrival order).
* **Parking.** The run's message (its signature, serialized with the task's serializer) goes into the
  entry, so that the run can be published again, with its task id, when the key is handed to it.
* **Handoff publisher.** Every store of an app publishes the handoffs its own commands make
  (``LeaseStore.add_handoff_callback``), with a ``mongolock_handoff`` header that lets that run claim.
* **Results.** Runs that end without running (superseded, timed out while parked) get their results
  from ``results``.
* **Sweeper.** A thread in each worker's main process looks at the keys with parked runs every
  ``min(lease / 2, 15 s)``: it hands over keys whose holder died without a parent to release them, re-hands
  handoffs nobody took up, drops revoked runs, and writes the results of runs that timed out while parked
  or were superseded.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import logging
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from celery import Celery
from celery import signals as celery_signals
from kombu.serialization import dumps

from celery_mongolock.exceptions import UntrustedMessage
from celery_mongolock.integration import config, lanes, signals
from celery_mongolock.integration.results import (
    QUEUED,
    has_backend,
    state_of,
)
from celery_mongolock.integration.trust import (
    SIGNATURE_FIELD,
    RefusedEntry,
    UnknownTask,
    check_entry,
    sign_entry,
)

if TYPE_CHECKING:
    from celery_mongolock.core.store import LeaseStore

__all__ = [
    "DEBOUNCE_HEADER",
    "ENDED_HEADER",
    "HANDOFF_HEADER",
    "REPUBLISH_RETRY_POLICY",
    "SENT_HEADER",
    "install_publisher",
    "message_of",
    "publish_patiently",
    "publish_through_lane",
    "refuse",
    "send_stamp",
    "transient_headers_dropped",
]

log = logging.getLogger("celery_mongolock.queue")

#: The send stamp: microseconds since the epoch, strictly increasing per producer process.
SENT_HEADER = "mongolock_sent"
#: On a run's message published again by a handoff: ``{"k": key, "tk": token}`` to claim the key with.
HANDOFF_HEADER = "mongolock_handoff"
#: On a ``Replace(debounce=...)`` run's own delayed copy: it takes the key once its entry is due.
DEBOUNCE_HEADER = "mongolock_debounce"
#: On a run's message published again to end it without its body (``endings``): ``{"how": "superseded" |
#: "timeout", "k": key, ...}``.
ENDED_HEADER = "mongolock_ended"
#: The message headers a handoff must not carry over from the parked run's message.
_TRANSIENT_HEADERS = (HANDOFF_HEADER, DEBOUNCE_HEADER, ENDED_HEADER)

#: How a run is published again (a contention retry, a parked duplicate, a body's retry): kombu retries
#: the publish for about a minute, so that a broker restart does not fail the run (Celery's default policy
#: gives up after 0.6 s). The run holds no lease meanwhile, and a worker cut off from its broker has
#: nothing else to do.
REPUBLISH_RETRY_POLICY: dict[str, float] = {
    "max_retries": 30,
    "interval_start": 0.2,
    "interval_step": 0.5,
    "interval_max": 2.0,
}


@contextlib.contextmanager
def patient_producer(app: Celery) -> Iterator[Any]:
    """A producer of ``app`` whose broker connection is open, opened with ``REPUBLISH_RETRY_POLICY`` (about a
    minute) if it was not: kombu retries a publish on a connection that breaks, but a connection that
    cannot be opened (py-amqp: RabbitMQ down while this process had no connection to it) fails after
    ``broker_connection_timeout``, outside that retry."""
    p = REPUBLISH_RETRY_POLICY
    with app.producer_or_acquire() as producer:
        producer.connection.ensure_connection(
            max_retries=int(p["max_retries"]),
            interval_start=p["interval_start"],
            interval_step=p["interval_step"],
            interval_max=p["interval_max"],
        )
        yield producer


def publish_patiently(app: Celery, signature: Any, **options: Any) -> Any:
    """``signature.apply_async`` retried for about a minute while the broker is away, the connection
    included (``patient_producer``). A publish on the pool's connection that fails outside kombu's own
    retry (a broker restart can leave a pooled channel without its connection, and kombu's Redis transport
    then raises ``AttributeError`` before the message is put: seen in the lock-set checker, a contention
    retry lost with it) is made once more on a connection of its own, opened as patiently. Only that error:
    another one may come after the broker took the message, and the message must not be sent twice."""
    try:
        with patient_producer(app) as producer:
            return signature.apply_async(
                producer=producer, retry=True, retry_policy=REPUBLISH_RETRY_POLICY, **options
            )
    except AttributeError as exc:  # (raised before the message is put: published once, not twice)
        log.warning("publishing %s failed on a pooled connection (%r); again on a new one", signature, exc)
    p = REPUBLISH_RETRY_POLICY
    with app.connection_for_write() as connection:
        connection.ensure_connection(
            max_retries=int(p["max_retries"]),
            interval_start=p["interval_start"],
            interval_step=p["interval_step"],
            interval_max=p["interval_max"],
        )
        return signature.apply_async(
            producer=app.amqp.Producer(connection),
            retry=True,
            retry_policy=REPUBLISH_RETRY_POLICY,
            **options,
        )


# -- send stamps -----------------------------------------------------------------------------------------
_stamp_lock = threading.Lock()
_last_stamp = 0


def send_stamp() -> int:
    """A new send stamp: the wall clock in microseconds, strictly above the last one of this process."""
    global _last_stamp
    with _stamp_lock:
        stamp = max(_last_stamp + 1, time.time_ns() // 1000)
        _last_stamp = stamp
        return stamp


def _stamp_message(headers: dict[str, Any] | None = None, **_: Any) -> None:
    if headers is not None and SENT_HEADER not in headers:
        headers[SENT_HEADER] = send_stamp()


celery_signals.before_task_publish.connect(_stamp_message, weak=False, dispatch_uid="celery_mongolock.stamp")


def stamp_of(request: Any) -> tuple[int, str]:
    """A run's send stamp and where it came from (``"sent"``, or ``"worker"`` when the message had none)."""
    headers = getattr(request, "headers", None) or {}
    stamp = headers.get(SENT_HEADER)
    if stamp is None:
        stamp = getattr(request, SENT_HEADER, None)
    if isinstance(stamp, int) and not isinstance(stamp, bool):
        return stamp, "sent"
    return send_stamp(), "worker"


def header(request: Any, name: str) -> Any:
    """A custom message header of ``request`` (Celery keeps them in ``request.headers`` or as attributes)."""
    headers = getattr(request, "headers", None) or {}
    value = headers.get(name)
    return value if value is not None else getattr(request, name, None)


def keys_token(run: str, keys: list[str]) -> str:
    """The handoff token of a run that needs several keys: one for all its keys, the same on every
    admit of the run (its copies included)."""
    return hashlib.sha256(f"mongolock-keys:{run}:{','.join(keys)}".encode()).hexdigest()[:32]


def handoff_of_keys(request: Any, keys: list[str], run: str) -> str | None:
    """The token a handed run that needs several keys claims them all with (see ``handoff_of``)."""
    headers = getattr(request, "headers", None) or {}
    handoff = headers.get(HANDOFF_HEADER) or getattr(request, HANDOFF_HEADER, None)
    if (
        isinstance(handoff, Mapping)
        and list(handoff.get("ks") or []) == list(keys)
        and isinstance(handoff.get("tk"), str)
        and handoff.get("id", run) == run
    ):
        return str(handoff["tk"])
    return None


def _burst_ms(entry: Mapping[str, Any]) -> int | None:
    """The burst of a handed ``Replace(debounce=..., max_wait=...)`` run of a set (``sets.burst_of``): the
    one it carries (``bu``, ms), else when its burst began waiting (``fw``); None when it has none."""
    burst, began = entry.get("bu"), entry.get("fw")
    if isinstance(burst, int) and not isinstance(burst, bool):
        return burst
    if isinstance(began, _dt.datetime):
        aware = began if began.tzinfo is not None else began.replace(tzinfo=_dt.timezone.utc)
        return int(aware.timestamp() * 1000)
    return None


def handoff_burst(request: Any) -> int | None:
    """The burst a handoff message of a ``Replace`` run of a set carries (``bu``): the run keeps it in
    the entry it claims and reserves with, so that the burst a ceiling sealed stays sealed when the run
    claims its set's gate and waits on a later one (its reservation would otherwise carry no
    burst, and the next send of its set would take it back)."""
    headers = getattr(request, "headers", None) or {}
    handoff = headers.get(HANDOFF_HEADER) or getattr(request, HANDOFF_HEADER, None)
    burst = handoff.get("bu") if isinstance(handoff, Mapping) else None
    return burst if isinstance(burst, int) and not isinstance(burst, bool) else None


def handoff_of(request: Any, key: str, run: str) -> str | None:
    """The token a handed run claims ``key`` with (None for a message that was not this run's handoff:
    a body's own ``Task.retry()`` of a handed run copies its headers, but is another run)."""
    headers = getattr(request, "headers", None) or {}
    handoff = headers.get(HANDOFF_HEADER) or getattr(request, HANDOFF_HEADER, None)
    if (
        isinstance(handoff, Mapping)
        and handoff.get("k") == key
        and isinstance(handoff.get("tk"), str)
        and handoff.get("id", run) == run
    ):
        return str(handoff["tk"])
    return None


def transient_headers_dropped(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of a run's message headers without those of one delivery (a handoff's, a debounced copy's,
    an ending's): what a message published again for the run starts from."""
    kept = dict(headers or {})
    for name in _TRANSIENT_HEADERS:
        kept.pop(name, None)
    return kept


# -- the message of a parked run -------------------------------------------------------------------------
def message_of(task: Any, request: Any, stamp: int, run: str) -> dict[str, Any]:
    """The fields of a parked entry that let the run ``run`` be published again: its signature
    (arguments, routing, links, task id), serialized with the task's serializer; signed (``sg``) when the
    app has a ``mongolock_signing_key`` (the handoff checks it: ``_trust``)."""
    headers = dict(getattr(request, "headers", None) or {})
    for name in _TRANSIENT_HEADERS:
        headers.pop(name, None)
    headers[SENT_HEADER] = stamp
    signature = task.signature_from_request(request, headers=headers)
    content_type, encoding, body = dumps(  # type: ignore[no-untyped-call]
        dict(signature), serializer=task.serializer or "json"
    )
    fields = {
        "m": body if isinstance(body, bytes) else body.encode(encoding),
        "ct": content_type,
        "ce": encoding,
    }
    secret = config.get_settings(task.app).signing_key
    if secret is not None:
        fields[SIGNATURE_FIELD] = sign_entry(secret, {"id": run, "t": request.id, "n": task.name, **fields})
    return fields


def _trusted(app: Celery, key: str, entry: Mapping[str, Any], store: LeaseStore | None) -> Any:
    """The signature to publish for ``entry``, or None when its stored message is refused (then the run
    is dropped from its key(s), recorded and logged: ``refuse``) or left for a worker that has its task
    (``leave``)."""
    try:
        return check_entry(app, key, entry, config.get_settings(app).signing_key)
    except UnknownTask as exc:  # (never refused for that: a worker that has the task checks it)
        leave(store or config.get_store(app), key, entry, str(exc))
        return None
    except RefusedEntry as exc:
        refuse(app, store or config.get_store(app), key, entry, str(exc))
        return None


def leave(store: LeaseStore, key: str, entry: Mapping[str, Any], reason: str) -> None:
    """Leave the handoff of ``key`` to the run ``entry``, whose task this worker does not have, for a
    worker that has it: unpublished by this worker (its mark cleared), so the next sweep of a worker that
    has the task adopts and publishes it (a worker per queue, or a deploy under way). Workers without the
    task pass such a handoff by (``sweeper``) until it lapses unclaimed; then any sweeper hands the key
    again, and a worker without the task leaves it again, with a WARNING that says how to drop the run if
    no worker has its task any more (it is never refused for that: a busy worker that has the task may
    simply not have taken it up yet)."""
    left = store.unmark_handoff(key, entry)
    if stepwise(entry):  # (the run of several keys that adopts it publishes it: ``moves_on``)
        store.unpublish(entry)
    handed = int(entry.get("hn") or 1)
    # Handed again after a lapse: no worker took it up within a lease. Say so, and what to do if no
    # worker has that task any more (the run is never refused for it: its key waits).
    log.log(
        logging.INFO if handed < 2 else logging.WARNING,
        "%r handed to %s[%s]: %s; left for a worker that has it (handoff %s)%s%s",
        key,
        entry.get("n"),
        entry.get("t"),
        reason,
        handed,
        "" if left else " (the key is no longer handed to it)",
        ""
        if handed < 2
        else f"; if no worker has that task any more: celery mongolock drop {key} {entry.get('t')}",
    )


def publish_handoff(app: Celery, key: str, entry: Mapping[str, Any], store: LeaseStore | None = None) -> bool:
    """Publish the run ``entry`` that ``key`` was handed to, with the token it claims the key with; False
    when its stored message was refused (``_trust``), and the key went on to the next run."""
    signature = _trusted(app, key, entry, store)
    if signature is None:
        return False
    headers = dict(signature.options.get("headers") or {})
    headers[HANDOFF_HEADER] = {"k": key, "tk": entry["tk"], "id": entry.get("id")}
    if entry.get("ks"):
        headers[HANDOFF_HEADER]["ks"] = list(entry["ks"])
        burst = _burst_ms(entry) if entry.get("g") else None
        if burst is not None:  # (the run's burst, for its reservation of its set's gate)
            headers[HANDOFF_HEADER]["bu"] = burst
    # The signature carries the run's task id, routing, links and retries; only the headers change, and
    # the handoff goes to the run's queue's lane (``lanes``): it does not wait behind the backlog. When
    # handed again, every other attempt goes to the queue itself (a lane nobody consumes).
    publish_through_lane(app, signature, headers, HANDOFF_HEADER, lane=int(entry.get("hn") or 1) % 2 == 1)
    signals.run_handed_off.send(
        sender=None,
        app=app,
        key=key,
        task_id=entry["t"],
        attempt=int(entry.get("hn") or 1),
        waited=entry.get("at"),
    )
    log.info(
        "handed %r to %s[%s], parked until now (attempt %s): its message is published again and it starts "
        "on the next free worker slot",
        key,
        entry.get("n"),
        entry["t"],
        entry.get("hn"),
    )
    return True


def publish_through_lane(
    app: Celery, signature: Any, headers: dict[str, Any], header: str, *, lane: bool
) -> None:
    """Publish ``signature`` with ``headers`` (``header``: the one that carries its own routing) to its
    queue's handoff lane (``lanes``), or to its queue when ``lane`` is False, the app has no lane for it,
    or the broker refused the lane."""
    found = lanes.lane_of(app, signature.options, getattr(signature, "task", None)) if lane else None
    if found is None or not lanes.publish_to_lane(
        signature, headers, header, found, lambda **options: publish_patiently(app, signature, **options)
    ):
        publish_patiently(app, signature, headers=headers)


def stepwise(entry: Mapping[str, Any]) -> bool:
    """A run of several keys: it takes them one at a time, in key order (``key_set.KeySetAdmits.stepwise``,
    ``Queue`` and ``Replace`` alike; an entry parked on every key of its set by an earlier version is
    moved on the same way: its message leaves the keys after the one it waits on)."""
    return bool(entry.get("ks"))


def moves_on(store: LeaseStore, entry: Mapping[str, Any]) -> bool:
    """Whether the stepwise run ``entry``, just handed a key, is published now (one read of its keys,
    and of the spill when it is not found on the first key it has not got):

    * every key reserved for it: it runs (its message claims them all);
    * the first key not reserved for it is absent (not parked there, not spilled there): its message
      takes that key or parks it there, and the ones after, in order (``KeySetAdmits.claim_all``);
    * it waits on that key (parked, or spilled) but holds a reservation on a later key (a place left
      by an earlier attempt, or a reservation that lapsed and went on): its message leaves the later
      keys, so that it never holds a later key while it waits for an earlier one;
    * else (it waits on that key and holds nothing after it; a worker of it is taking the key now; it
      timed out there, and whoever ends it leaves its other keys) nothing is published.

    Two parties may read it so at once (two of its keys reserved a few milliseconds apart): only the one
    whose mark is written first publishes (``LeaseStore.publish_once``: the mark is when each reservation
    they saw was made; with none reserved when read, a reservation dropped meanwhile, no mark: one that
    said none would stand for any later read), so its message is published once."""
    read = store.places_of(entry)
    if read.ready:
        return store.publish_once(entry, read)
    places = read.places
    for index, (key, place) in enumerate(places):
        if place == "reserved":
            continue
        if place in ("held", "dead"):
            return False
        if place == "absent" and not store.spill.waits(key, str(entry.get("t"))):
            return store.publish_once(entry, read)
        if any(later == "reserved" for _, later in places[index + 1 :]):
            return store.publish_once(entry, read)
        return False
    return True


_installed: weakref.WeakSet[LeaseStore] = weakref.WeakSet()


def install_publisher(app: Celery, store: LeaseStore) -> None:
    """Have ``store`` publish the handoffs its commands make, through ``app``."""
    if store in _installed:
        return
    app_ref = weakref.ref(app)

    def publish(key: str, entry: dict[str, Any], doc: dict[str, Any]) -> None:
        owner = app_ref()
        if owner is None:
            return
        if stepwise(entry) and not moves_on(store, entry):
            log.debug("%r reserved for %s, which waits for its next key", key, entry.get("t"))
            return
        publish_handoff(owner, key, entry, store)

    store.add_handoff_callback(publish)
    _installed.add(store)


config.STORE_HOOKS.append(install_publisher)


# -- refused entries --------------------------------------------------------------------------------------
_dropping = threading.local()


def refuse(app: Celery, store: LeaseStore, key: str, entry: Mapping[str, Any], reason: str) -> None:
    """Drop a parked run whose stored message a handoff refused: from every key it waits on (the key goes
    on to the next run), with a history record (``refused``), an error in the log naming the key and the
    stored task name, and, for a run of ours that waits (state ``QUEUED``), a failure result that says
    why (``UntrustedMessage``). Never published, never run."""
    task_id = str(entry.get("t"))
    log.error(
        "refused the stored message of parked run %s[%s] on %r: %s; dropped from the queue",
        entry.get("n"),
        task_id,
        key,
        reason,
    )
    store.record_run_ending(key, "refused", entry, fence=None, parked_at=entry.get("at"))
    if has_backend(app) and state_of(app, task_id) == QUEUED:
        app.backend.mark_as_failure(task_id, UntrustedMessage(key, reason))
    keys = [str(k) for k in entry.get("ks") or [key]]
    # Dropping it hands the key to the next run, whose publication may be refused too: the outermost
    # refusal of this thread drops them one after the other (no recursion as deep as the queue).
    pending: list[tuple[list[str], str]] | None = getattr(_dropping, "pending", None)
    if pending is not None:
        pending.append((keys, task_id))
        return
    _dropping.pending = pending = [(keys, task_id)]
    try:
        while pending:
            drop_keys, drop_id = pending.pop(0)
            for drop_key in drop_keys:
                store.sweep(drop_key, revoked={drop_id})
    finally:
        _dropping.pending = None


def _on_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    """A handoff message discarded because its run was revoked: hand the key to the next run now (for a
    run of several keys, every key of it: the keys reserved for it too)."""
    handoff = None
    for source in (getattr(request, "headers", None) or {}, getattr(request, "__dict__", {})):
        if isinstance(source, Mapping) and isinstance(source.get(HANDOFF_HEADER), Mapping):
            handoff = source[HANDOFF_HEADER]
            break
    app = getattr(sender, "app", None)
    if handoff is None or app is None:
        return
    try:
        store = config.get_store(app)
        install_publisher(app, store)
        task_id = str(getattr(request, "id", ""))
        after = store.sweep(str(handoff.get("k")), revoked={task_id})
        for other in handoff.get("ks") or []:  # a run of several keys: its reservations on the others
            if str(other) != str(handoff.get("k")):
                store.sweep(str(other), revoked={task_id})
        run = {"t": task_id, "n": getattr(sender, "name", None), "id": handoff.get("id")}
        store.record_run_ending(
            str(handoff.get("k")), "revoked", run, fence=None if after is None else after.fence
        )
    except Exception as exc:
        log.warning("could not hand over %r after a revoke (the sweeper will): %s", handoff.get("k"), exc)


celery_signals.task_revoked.connect(_on_revoked, weak=False, dispatch_uid="celery_mongolock.revoked")


def _restore_route(sender: Any = None, task: Any = None, **_: Any) -> None:
    """Before a body (or the ending of one, ``endings``) delivered through a lane: its own routing and
    priority back (``lanes.restore_route``)."""
    for header in (HANDOFF_HEADER, ENDED_HEADER):
        lanes.restore_route(task or sender, header)


celery_signals.task_prerun.connect(_restore_route, weak=False, dispatch_uid="celery_mongolock.lane-route")
