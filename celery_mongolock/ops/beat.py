"""A highly available ``celery beat``: one leader sends, standbys wait; every tick is sent once.

Run as many beats as you like with ``celery -A proj beat -S celery_mongolock.beat:Scheduler`` (or the
``beat_scheduler`` setting). Three mechanisms, each enough on its own for most failures, together for all:

1. **Leader lease.** Beats compete for one lease (``mongolock_beat_key``). Only the holder sends. Its
   heartbeat thread renews the lease on its own, so a slow schedule pass cannot lose it. A leader whose
   lease is lost (MongoDB unreachable for a whole lease, or force-released) stops sending and goes back
   to standby; it never exits or crash-loops. A standby blocks on a change stream of the lease document
   and takes over the moment a leader exits gracefully, or when a killed leader's lease expires
   (``mongolock_beat_lease_seconds``: the failover window).
2. **Tick claims.** Ticks are *nominal* times computed on the MongoDB server's clock (estimated from
   ``hello.localTime`` and carried on the monotonic clock, so a jump of a beat node's clock changes
   nothing). Interval schedules are aligned to the epoch, so every beat agrees on them; crontab ticks
   are the crontab's own times. Before sending a tick, a beat claims it in ``mongolock_beat_collection``
   with one atomic update that succeeds only if no beat sent that entry's tick or a later one. Even two
   beats that both believe they lead (for a moment, around a failover) send each tick once.
3. **Worker-side dedupe.** Every message carries its entry and nominal tick (header ``mongolock_tick``).
   A singleton task refuses a tick at or before the last tick that took its key, and keeps its lease
   until the tick's window ends (a minimum hold), not only until the body ends.

Ticks due while there was no leader (the failover window) are coalesced: the new leader sends the
latest missed tick of each entry once, at takeover. Earlier missed ticks are logged, not replayed.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import math
import os
import socket
import uuid
from typing import Any

from celery import beat as celery_beat
from celery.schedules import crontab
from celery.schedules import schedule as interval_schedule
from pymongo import ReturnDocument

from celery_mongolock.core.clock import ServerTime
from celery_mongolock.core.keys import normalize_key
from celery_mongolock.core.store import Lease, LeaseStore, validate_lease_timing
from celery_mongolock.core.urls import validate_mongo_url
from celery_mongolock.exceptions import ConfigurationError, MongoLockError
from celery_mongolock.integration.config import BEAT_DEFAULTS, get_settings
from celery_mongolock.integration.headers import BEAT_HEADER

__all__ = ["BEAT_HEADER", "BeatSettings", "Scheduler", "next_tick", "read_beat_settings"]

log = logging.getLogger("celery_mongolock.beat")


def _utc(value: Any) -> _dt.datetime | None:
    """A date read from MongoDB (naive UTC unless the client is tz-aware), as an aware datetime."""
    if not isinstance(value, _dt.datetime):
        return None
    return value if value.tzinfo is not None else value.replace(tzinfo=_dt.timezone.utc)


class BeatSettings:
    """The validated ``mongolock_beat_*`` settings."""

    def __init__(self, key: str, lease_seconds: float, heartbeat_seconds: float, collection: str) -> None:
        self.key = key
        self.lease_seconds = lease_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.collection = collection


def _get(conf: Any, name: str) -> Any:
    for candidate in (name, name.upper()):
        value = conf.get(candidate)
        if value is not None:
            return value
    return BEAT_DEFAULTS[name]


def read_beat_settings(conf: Any) -> BeatSettings:
    key = _get(conf, "mongolock_beat_key")
    if not isinstance(key, str) or not key.strip():
        raise ConfigurationError(f"mongolock_beat_key must be a non-empty string, got {key!r}")
    try:
        lease, beat = validate_lease_timing(
            _get(conf, "mongolock_beat_lease_seconds"), _get(conf, "mongolock_beat_heartbeat_seconds")
        )
    except ConfigurationError as exc:
        raise ConfigurationError(f"mongolock_beat_{exc}") from None
    collection = _get(conf, "mongolock_beat_collection")
    if not isinstance(collection, str) or not collection or "$" in collection:
        raise ConfigurationError(f"mongolock_beat_collection must be a collection name, got {collection!r}")
    return BeatSettings(key, lease, beat, collection)


def _epoch_ms(when: _dt.datetime) -> int:
    return round(when.timestamp() * 1000)


def _from_ms(ms: int) -> _dt.datetime:
    return _dt.datetime.fromtimestamp(ms / 1000, tz=_dt.timezone.utc)


def _is_interval(sched: Any) -> bool:
    return (
        isinstance(sched, interval_schedule)
        and not isinstance(sched, crontab)
        and type(sched).__name__ == "schedule"
    )


def next_tick(sched: Any, after: _dt.datetime, now: _dt.datetime) -> _dt.datetime:
    """The first nominal tick strictly after ``after``.

    Intervals are aligned to the Unix epoch (every beat computes the same ticks). Other schedules
    (crontab, solar) answer through their own ``remaining_estimate``, evaluated at ``now``.
    """
    if _is_interval(sched):
        period = sched.run_every.total_seconds()
        if period <= 0:
            raise ConfigurationError(f"schedule {sched!r} has a non-positive period")
        k = math.floor(after.timestamp() / period + 1e-9) + 1
        return _dt.datetime.fromtimestamp(k * period, tz=_dt.timezone.utc)
    delta = sched.remaining_estimate(after)
    candidate = now + delta
    if candidate.tzinfo is None:
        candidate = candidate.replace(tzinfo=_dt.timezone.utc)
    if candidate <= after:  # some schedules answer "due now" for a past last_run_at: step one period on
        candidate = after + _dt.timedelta(seconds=1)
    result: _dt.datetime = candidate.astimezone(_dt.timezone.utc)
    return result


class Scheduler(celery_beat.Scheduler):  # type: ignore[misc]
    """Leader-elected, once-per-tick beat scheduler on MongoDB leases (see the module docstring)."""

    #: How long a standby blocks waiting for the leader's lease to change before re-checking.
    standby_wait = 5.0

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        self._ml_app = app
        settings = get_settings(app)  # validates mongolock_* (fails start-up with a clear message)
        self._beat = read_beat_settings(app.conf)
        validate_mongo_url(settings.url, setting="mongolock_url")
        self._store = LeaseStore(
            settings.url,
            database=settings.database,
            collection=settings.collection,
            lease_seconds=self._beat.lease_seconds,
            heartbeat_seconds=self._beat.heartbeat_seconds,
            operation_timeout=settings.operation_timeout,
        )
        self._ticks_name = self._beat.collection
        self._server_time = ServerTime(lambda: self._store.client.admin.command("hello"))
        self._leader: Lease | None = None
        self._next: dict[str, _dt.datetime] = {}
        self._ident = f"{socket.gethostname()}:{os.getpid()}"
        self._last_seen_leader: str | None = None
        self.sent: list[tuple[str, int]] = []
        super().__init__(app, *args, **kwargs)

    # -- time --------------------------------------------------------------------------------------------
    def _now(self) -> _dt.datetime:
        return self._server_time.now()

    def setup_schedule(self) -> None:
        super().setup_schedule()
        for entry in self.schedule.values():
            # Crontab and solar schedules ask schedule.now() for the time: make it the server's.
            sched = entry.schedule
            if hasattr(sched, "nowfun"):
                sched.nowfun = self._now_in_app_tz

    def _now_in_app_tz(self) -> _dt.datetime:
        return self._now().astimezone(self.app.timezone)

    # -- leadership ----------------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        lease = self._leader
        return lease is not None and not lease.lost

    def _demote(self, why: str) -> None:
        lease, self._leader = self._leader, None
        self._next.clear()
        log.warning("beat %s: no longer the leader (%s); back to standby", self._ident, why)
        if lease is not None:
            with contextlib.suppress(MongoLockError):
                lease.release()

    def _ensure_leader(self) -> bool:
        lease = self._leader
        if lease is not None:
            if lease.lost:
                self._demote(lease.lost_reason or "lease lost")
            else:
                return True
        info = {"role": "celery beat", "beat": self._ident}
        before = self._leader_document()
        lease, doc = self._store.try_acquire(self._beat.key, None, info=info, heartbeat=True)
        if lease is None:
            holder = (doc or {}).get("holder") or {}
            who = str(holder.get("beat") or holder)
            if who != self._last_seen_leader:
                log.info("beat %s: standby; the leader is %s", self._ident, who)
                self._last_seen_leader = who
            return False
        log.warning(
            "beat %s: became the leader (fence %s); %s", self._ident, lease.fence, self._change(before)
        )
        self._leader = lease
        self._last_seen_leader = self._ident
        self._next.clear()
        return True

    def _leader_document(self) -> dict[str, Any] | None:
        """The leader lease as it is just before this beat tries to take it: who led, and how that
        ended (released, force-released, or still held until it expires), for the leader-change log.
        One read per attempt; a standby attempts when the lease changes or every ``standby_wait``."""
        try:
            with self._store.operation("read the leader lease"):
                doc: dict[str, Any] | None = self._store.collection.find_one(
                    {"_id": normalize_key(self._beat.key)},
                    {
                        "holder": 1,
                        "owner": 1,
                        "expires_at": 1,
                        "renewed_at": 1,
                        "forced_release": 1,
                        "released_for": 1,
                    },
                )
        except MongoLockError:
            return None  # the acquire that follows reports the fault
        return doc

    def _change(self, before: dict[str, Any] | None) -> str:
        """Who led before this beat, and why the leadership changed, in words."""
        if before is None:
            return "first leader (no leader lease before)"
        holder = before.get("holder") or {}
        who = str(holder.get("beat") or holder.get("host") or "unknown")
        if who == self._ident:
            who = f"{who} (this beat, before it lost the lease)"
        if before.get("owner") is None:
            if before.get("forced_release"):
                why = "its lease was force-released by an operator"
            elif before.get("released_for"):
                why = f"its lease was released for it ({before['released_for']})"
            else:
                why = "it released the lease (stopped gracefully)"
            return f"previous leader {who}: {why}"
        expires_at = _utc(before.get("expires_at"))
        renewed_at = _utc(before.get("renewed_at"))
        now = self._now()  # after the acquire, which the server granted: so the lease had ended by then
        # A second of slack for the estimate of the server's clock: a lease that was still held when read
        # and that the server let us take after its deadline has expired, not been released.
        if expires_at is not None and expires_at <= now + _dt.timedelta(seconds=1):
            silent = f", last renewed {(now - renewed_at).total_seconds():.1f}s ago" if renewed_at else ""
            return (
                f"previous leader {who}: its lease expired "
                f"{max(0.0, (now - expires_at).total_seconds()):.1f}s ago"
                f"{silent} (it died, hung or lost MongoDB)"
            )
        return f"previous leader {who}: it released the lease just now"

    # -- the loop ------------------------------------------------------------------------------------
    def tick(self, *args: Any, **kwargs: Any) -> float:
        try:
            if not self._ensure_leader():
                # Block until the leader's lease changes (release, expiry), then try again at once.
                self._store.wait_free(self._beat.key, min(self.standby_wait, self.max_interval))
                return 0.0
            return self._lead()
        except Exception as exc:  # never crash-loop: log, stay up, try again shortly
            level = logging.WARNING if isinstance(exc, MongoLockError) else logging.ERROR
            log.log(
                level,
                "beat %s: tick failed (%s: %s); retrying",
                self._ident,
                type(exc).__name__,
                exc,
                exc_info=not isinstance(exc, MongoLockError),
            )
            if self._leader is not None and self._leader.lost:
                self._demote("lease lost while MongoDB was unavailable")
            return min(float(self.max_interval), 1.0)

    def _lead(self) -> float:
        now = self._now()
        wake = now + _dt.timedelta(seconds=self.max_interval)
        for entry in list(self.schedule.values()):
            nxt = self._next.get(entry.name)
            if nxt is None:
                nxt = self._first_due(entry, now)
            if nxt <= now:
                # Send the latest tick that is due (coalescing any missed ones).
                tick = nxt
                following = next_tick(entry.schedule, tick, now)
                skipped = 0
                while following <= now and skipped < 10_000:
                    tick, following = following, next_tick(entry.schedule, following, now)
                    skipped += 1
                if skipped:
                    log.warning(
                        "beat %s: %d missed tick(s) of %s coalesced into one",
                        self._ident,
                        skipped,
                        entry.name,
                    )
                if not self.is_leader:
                    self._demote("lease lost before sending")
                    return 0.0
                self._send(entry, tick, (following - tick).total_seconds())
                nxt = following
            self._next[entry.name] = nxt
            wake = min(wake, nxt)
        return max(0.0, min((wake - self._now()).total_seconds(), float(self.max_interval)))

    def _first_due(self, entry: Any, now: _dt.datetime) -> _dt.datetime:
        """On becoming leader: the tick after the last one any beat sent (catch-up), or the next one."""
        with self._store.operation(f"read the tick state of {entry.name!r}"):
            state = self._store.client[self._store.database_name][self._ticks_name].find_one(
                {"_id": entry.name}
            )
        if state and state.get("last_tick") is not None:
            return next_tick(entry.schedule, _from_ms(int(state["last_tick"])), now)
        return next_tick(entry.schedule, now, now)

    def _claim(self, entry: Any, tick_ms: int) -> bool:
        """Atomically record that this beat sends ``entry``'s tick; False if any beat sent it (or later)."""
        coll = self._store.client[self._store.database_name].get_collection(
            self._ticks_name, write_concern=self._store.write_concern
        )
        token = uuid.uuid4().hex
        newer = {"$lt": [{"$ifNull": ["$last_tick", -1]}, tick_ms]}
        pipeline: list[dict[str, Any]] = [
            {"$set": {"__new": newer}},
            {
                "$set": {
                    "last_tick": {"$cond": ["$__new", tick_ms, "$last_tick"]},
                    "claim": {"$cond": ["$__new", token, "$claim"]},
                    "sent_by": {"$cond": ["$__new", self._ident, "$sent_by"]},
                    "sent_at": {"$cond": ["$__new", "$$NOW", "$sent_at"]},
                    "task": entry.task,
                }
            },
            {"$unset": "__new"},
        ]
        with self._store.operation(f"claim tick {tick_ms} of {entry.name!r}"):
            doc = coll.find_one_and_update(
                {"_id": entry.name}, pipeline, upsert=True, return_document=ReturnDocument.AFTER
            )
            if doc is None:  # embedded server quirk under contention: read it back
                doc = coll.find_one({"_id": entry.name})
        return bool(doc and doc.get("claim") == token)

    def _send(self, entry: Any, tick: _dt.datetime, window: float) -> None:
        tick_ms = _epoch_ms(tick)
        if not self._claim(entry, tick_ms):
            log.info(
                "beat %s: tick %s of %s was already sent by another beat",
                self._ident,
                tick.isoformat(),
                entry.name,
            )
            return
        options = dict(entry.options or {})
        headers = dict(options.pop("headers", None) or {})
        headers["celery_beat_task"] = True
        headers[BEAT_HEADER] = {"entry": entry.name, "tick": tick_ms, "window": window}
        args = celery_beat._evaluate_entry_args(entry.args)
        kwargs = celery_beat._evaluate_entry_kwargs(entry.kwargs)
        task = self.app.tasks.get(entry.task)
        log.info(
            "beat %s: sending %s (%s) for tick %s", self._ident, entry.name, entry.task, tick.isoformat()
        )
        if task is not None:
            task.apply_async(args, kwargs, headers=headers, **options)
        else:
            self.app.send_task(entry.task, args, kwargs, headers=headers, **options)
        entry.last_run_at = tick
        entry.total_run_count += 1
        self.sent.append((entry.name, tick_ms))

    # -- shutdown ------------------------------------------------------------------------------------
    def close(self) -> None:
        lease, self._leader = self._leader, None
        if lease is not None:
            try:
                lease.release()
                log.warning("beat %s: stopped; leadership released for a standby to take over", self._ident)
            except MongoLockError as exc:
                log.warning("beat %s: could not release leadership (it will expire): %s", self._ident, exc)
        try:
            super().close()
        finally:
            self._store.close()

    @property
    def info(self) -> str:
        role = "leader" if self.is_leader else "standby"
        lease = f"lease {self._beat.lease_seconds:g}s on {self._beat.key!r}"
        return f"    . mongolock: {role} ({self._ident}), {lease}"
