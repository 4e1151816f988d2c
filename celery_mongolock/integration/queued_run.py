"""Admission of a queued run (``Queue``, ``Replace``) over its key set of any size: one key (also
``limit=N``) or several (``keys=``, with a limit per key).

The run takes every key, claims every key handed to it, or waits, the keys it got turned into reservations
for it (``key_set.KeySetAdmits``): a run of several keys waits on the first key it has not got (one key
at a time, in key order), and is published again whenever whoever hands it a key finds it can move on
(``handoff.moves_on``); a run of one key, by whoever hands it the key. A ``Replace`` run of a set of two
keys or more admits its set's gate first (``sets.gate_of``: a lease document of its own, held with its
keys, ``admit_keys``), where it carries its set's signature: there a newer send of the same set
supersedes it (``core.documents.sets``); told so, it gives back what it holds and leaves its other keys.
What an answer that does not let the run wait means (a copy of a run that ran, runs or waits; a full
queue; a newer send) is decided here once for every shape.
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from celery import states as celery_states
from celery.exceptions import Ignore

from celery_mongolock.admission.contention import ContendedRun, Outcome
from celery_mongolock.admission.policies import Fail, Queue, Replace, Retry
from celery_mongolock.core.documents.sets import gate_of, set_signature, user_keys
from celery_mongolock.core.outcomes import Admission, AdmitOutcome
from celery_mongolock.exceptions import LockContended, QueueTimeout, StoreUnavailable, Superseded
from celery_mongolock.integration import handoff as _queue
from celery_mongolock.integration import priority, results, signals
from celery_mongolock.integration.config import get_store
from celery_mongolock.integration.duplicates import (
    DUPLICATE_HEADER,
    copy_of_a_retried_attempt,
    copy_with_a_result,
    ended_without_a_result,
    keep_a_debounced_copy_delivered_again,
    park_duplicate,
    this_attempt_over,
)
from celery_mongolock.integration.key_set import KeySetAdmits
from celery_mongolock.integration.rate_gate import leave_rate
from celery_mongolock.integration.runs import (
    GuardedRun,
    contended_since,
    give_back_quietly,
    has_final_state,
    ignored_as,
    log_acquire,
    publish_debounced_copy,
    set_state,
    unavailable,
)

if TYPE_CHECKING:
    from celery_mongolock.core.store import Lease
    from celery_mongolock.integration.config import TaskOptions

__all__ = ["MIXED_RETRY", "QueuedRun"]

#: How a run that found its key in use as the other kind comes back (``QueuedRun._other_kind``): nobody
#: hands it the key, so it looks again, soon (at most 5 s, jittered): with ``Retry()``'s backoff (1 s
#: doubling to 60 s) a new user's trial of mixed transfers saw keys idle 10 s and more after they freed,
#: and a batch take 1.3 to 2 times as long as the same runs one at a time.
MIXED_RETRY = Retry(countdown=0.5, backoff=1.5, max_countdown=5.0)

#: What a copy dropped on a key was a copy of.
_COPY_OF = {
    AdmitOutcome.WAITING: "parked or handed the key",
    AdmitOutcome.ALREADY_RAN: "over",
    AdmitOutcome.STALE: "no longer waiting (timed out, revoked, or handed again)",
}


def _entry(
    task: GuardedRun, keys: list[str], policy: Queue, ident: str, *, stamp: int, src: Any, several: bool
) -> dict[str, Any]:
    """The run's parked entry, the same on each of its keys: who it is, its send stamp, its priority and
    its message; for a set of keys (``several``), the keys it admits (its set's gate first, for a
    ``Replace`` set of two keys or more) and one handoff token for all of them (and, for ``Replace``, its
    set's signature: only runs of the same set supersede each other, ``documents.sets``)."""
    request = task.request
    entry: dict[str, Any] = {
        "id": ident,
        "t": request.id,
        "n": task.name,
        "r": ident.rsplit("/", 1)[1],
        "s": stamp,
        "src": src,
        "th": policy.then.name,
    }
    if several:
        entry.update(ks=keys, tk=_queue.keys_token(ident, keys))
        if isinstance(policy, Replace):
            entry["g"] = set_signature(user_keys(keys))
    entry.update(priority.rank_field(task.app, request, policy))
    entry.update(_queue.message_of(task, request, stamp, ident))
    return entry


def _admitted(
    task: GuardedRun,
    keys: list[str],
    options: TaskOptions,
    limits: Mapping[str, int | None] | None,
    *,
    several: bool,
) -> tuple[list[str], Mapping[str, int | None] | None]:
    """The keys a run admits, in order, and their limits: a ``Replace`` set of two keys or more, its set's
    gate first, with as many slots as the set's keys let run at once (one, unless every key has slots)."""
    gated = several and isinstance(options.on_contention, Replace) and len(keys) > 1
    if not gated or _parked_without_a_gate(task, keys):
        return list(keys), limits  # (a run parked by an earlier version, which had no gate: as then)
    gate = gate_of(keys)
    with_gate = dict(limits or {})
    with_gate[gate] = min(with_gate.get(k, options.limit) or 1 for k in keys)
    return [gate, *keys], with_gate


def _parked_without_a_gate(task: GuardedRun, keys: list[str]) -> bool:
    """A message of a ``Replace`` run of a set parked by an earlier version, whose runs of sets had no gate:
    its handoff (its keys' token over the keys alone) or its delayed copy (without ``gt``)."""
    request = task.request
    if _queue.handoff_of_keys(request, list(keys), f"{request.id}/{_delivery(task)}"):
        return True
    copy = _queue.header(request, _queue.DEBOUNCE_HEADER)
    return bool(copy) and not (isinstance(copy, Mapping) and copy.get("gt"))


def _delivery(task: GuardedRun) -> str:
    """The run's own retry count: a queued run is one run per task id and own retry."""
    return str(int(getattr(task.request, "retries", 0) or 0))


class QueuedRun:
    """One worker's run of a queued task over ``keys`` (sorted, without repeats): ``take()`` returns the
    leases of all of them, or the policy's outcome; or raises ``Ignore`` (parked, or a copy dropped), the
    policy's error, or a contention retry (MongoDB did not answer: retried as the same queued run)."""

    def __init__(
        self,
        task: GuardedRun,
        keys: list[str],
        options: TaskOptions,
        *,
        limits: Mapping[str, int | None] | None = None,
        one: bool,
    ) -> None:
        policy = options.on_contention
        assert isinstance(policy, Queue), policy
        self.task = task
        #: The keys the task named (sorted): its results and states name them.
        self.keys = keys
        #: A run of a task of ``keys=(...)``: a set of keys whatever their number (its entry carries its
        #: keys, one handoff token and, for ``Replace``, its set's signature; its results name its keys).
        self.several = not one
        self.options = options
        self.policy: Queue = policy
        self.request = task.request
        self.store = get_store(task.app)
        #: The keys a result or a state names (``keys``), for a run of several keys.
        self.named_keys: list[str] | None = list(keys) if self.several else None
        #: The keys it admits, in order: a ``Replace`` set of two keys or more admits its set's gate first
        #: (``sets.gate_of``), where runs of the set supersede each other, and holds it with its keys.
        self.admit_keys, limits = _admitted(task, keys, options, limits, several=self.several)
        request = self.request
        self.stamp, src = _queue.stamp_of(request)
        # A queued run is one run per task id and own retry: a contention retry (after MongoDB did not
        # answer) is the same run, and must find its own park if that landed.
        run_delivery = _delivery(task)
        ident = f"{request.id}/{run_delivery}"
        entry = _entry(task, self.admit_keys, policy, ident, stamp=self.stamp, src=src, several=self.several)
        self.entry = entry
        info: dict[str, Any] = {
            "task_name": task.name,
            "task_id": request.id,
            "worker": request.hostname,
            "delivery": run_delivery,
        }
        if self.several:
            info["keys"] = keys
        #: ``Replace(debounce=...)``: this message is a parked run's delayed copy.
        self.debounced_copy = bool(_queue.header(request, _queue.DEBOUNCE_HEADER))
        #: The token of the handoff this message is (None: not a handoff of this run).
        self.claim = (
            _queue.handoff_of_keys(request, self.admit_keys, ident)
            if self.several
            else _queue.handoff_of(request, keys[0], ident)
        )
        if self.several and isinstance(policy, Replace) and policy.max_wait:
            # (its burst, carried by its handoff or its delayed copy: ``handoff.handoff_burst``)
            burst = _queue.handoff_burst(request) if self.claim else None
            copy_of = _queue.header(request, _queue.DEBOUNCE_HEADER) if self.debounced_copy else None
            if burst is None and isinstance(copy_of, Mapping) and isinstance(copy_of.get("bu"), int):
                burst = int(copy_of["bu"])
            if burst is not None:
                entry["bu"] = burst
        fresh = not (
            self.claim
            or self.debounced_copy
            or (request.headers or {}).get(DUPLICATE_HEADER)
            or (request.delivery_info or {}).get("redelivered")
        )
        self.fresh = fresh
        #: A copy of a message (redelivered, a parked duplicate, a handoff): its run may have run already.
        self.copy = not (fresh or self.debounced_copy)
        self.admits = KeySetAdmits(
            task,
            self.store,
            self.admit_keys,
            options,
            policy,
            entry=entry,
            info=info,
            limits=limits or {},
            debounced_copy=self.debounced_copy,
            several=self.several,
            fresh=fresh,
        )

    def take(self) -> list[Lease] | Outcome:
        """Take, claim, or park (``Ignore``); a copy is dropped or kept aside; the policy's outcome for a
        run that cannot wait (a full queue) or that a newer send replaced."""
        task, keys = self.task, self.keys
        _queue.install_publisher(task.app, self.store)
        if self.fresh:
            # QUEUED before the admit, never after it: once parked, the run may be handed its keys and end
            # at any moment, and a state written later would hide its result.
            since = _dt.datetime.now(_dt.timezone.utc).isoformat()
            meta: dict[str, Any] = {"key": keys[0], "since": since}
            if self.several:
                meta["keys"] = keys
            set_state(task, results.QUEUED, meta, unless_ready=True)
        try:
            return self._attempts(self.claim)
        except StoreUnavailable as exc:
            unavailable(task, keys[0], exc, self.policy, direct=False)

    def _attempts(self, claim: str | None) -> list[Lease] | Outcome:
        """Up to five attempts (a key may expire while the others are taken): claim the keys handed to
        this run, else admit it on each."""
        admits = self.admits
        for _attempt in range(5):
            if claim is not None:
                claimed, refused, key = admits.claim_all(claim)
                claim = None  # (from here on: admitted as any run)
                if claimed is not None:
                    if admits.confirmed(claimed):
                        return self._start(claimed)
                    continue
                if refused is not None:
                    outcome = self._claim_refused(key, refused)
                    if outcome is not None:
                        return outcome
                # It claimed its keys and died (its worker killed): admitted as any run, below.
            taken, blocked = admits.admit_each()
            if blocked is not None:
                return self._not_admitted(*blocked)
            if not taken:  # parked or reserved on every key
                self._parked()
            if admits.confirmed(taken):  # every key taken in this attempt
                return self._start(taken)
        raise StoreUnavailable(f"the keys {self.keys} kept expiring while they were taken")

    def _start(self, leases: list[Lease]) -> list[Lease] | Outcome:
        """Every key confirmed: the run starts, unless a newer send of its set got past the first key of
        its set meanwhile (``KeySetAdmits.newer_past_gate``: a first key with slots lets two runs of a set
        past it; the older one, then, must not run after the newer)."""
        newer = self.admits.newer_past_gate(leases)
        if newer is not None:
            return self._superseded(self.admit_keys[0], newer, None)
        return self._started(leases)

    def _started(self, leases: list[Lease]) -> list[Lease]:
        """Its keys taken or claimed: state ``STARTED`` (and the results of the runs it superseded); else,
        when that fails (MongoDB or the result backend), its keys given back unrun."""
        task, keys = self.task, self.keys
        try:
            if self.several:
                self.admits.write_superseded()  # (a slot taken back from an older run of its set)
                set_state(task, celery_states.STARTED, {"keys": keys})
            else:
                set_state(task, celery_states.STARTED, {"key": keys[0], "fence": leases[0].fence})
        except BaseException:
            give_back_quietly(self.store, leases)
            raise
        return leases

    def _claim_refused(self, key: str, refused: Admission) -> Outcome | None:
        """A handoff's claim that did not get ``key``: the run ends or is dropped here, or None: admitted
        as any run (it claimed its keys and died: its worker was killed)."""
        task, request = self.task, self.request
        outcome = refused.outcome
        if not self.several:
            if outcome is AdmitOutcome.STALE and not this_attempt_over(task, self.store, self.admit_keys):
                return None  # a handoff whose claim failed, of a run with no result: it runs again
            return self._not_admitted(key, refused)
        if outcome is AdmitOutcome.RUNNING:  # a copy of the handoff while the first copy runs
            park_duplicate(task, key, self.options, False, handoff_copy=True)
            raise Ignore()
        if outcome is AdmitOutcome.SUPERSEDED:
            self.admits.leave_all()
            holder = dict(refused.holder)
            signals.lease_contended.send(sender=task, key=key, holder=holder, policy=self.policy.name)
            return self._superseded(key, str(refused.by), refused.fence)
        if outcome in (AdmitOutcome.WAITING, AdmitOutcome.PARKED):  # waits on that key: published when ready
            self._parked()
        if outcome is AdmitOutcome.RETRIED:
            copy_of_a_retried_attempt(task, key, self.entry)
        if outcome is AdmitOutcome.ALREADY_RAN:
            # Over on a later key it was not handed (its body ran; its worker died before the result was
            # stored, and this is its redelivered handoff): it ends as such a copy does, never admitted
            # again (it would take its first key, find the later one over, and go round: the lock-set
            # checker on RabbitMQ, a several-keys Replace run with slots).
            return self._not_admitted(key, refused)
        if this_attempt_over(task, self.store, self.admit_keys):
            log_acquire.info("%s[%s]: stale handoff of %s; dropped", task.name, request.id, self.keys)
            raise Ignore()
        return None

    def _not_admitted(self, key: str, admission: Admission) -> Outcome:
        """``key`` did not let the run wait: a copy is dropped (or kept aside, while its first run holds
        the key), a superseded run ends with that result, a full queue skips or fails it."""
        task, request = self.task, self.request
        outcome = admission.outcome
        who = (task.name, request.id)
        # (The admit judged a later attempt in its own command: ``retried``, not ``done``, when known.)
        stored = outcome is AdmitOutcome.ALREADY_RAN and has_final_state(task, carried_on=lambda: False)
        if self.debounced_copy and (outcome is AdmitOutcome.RUNNING or stored):
            if outcome is AdmitOutcome.RUNNING:
                keep_a_debounced_copy_delivered_again(task, key, self.options)
            # Handed its keys (due) before its delayed copy came: it ran or runs under its own message
            # (which reports a result lost with its worker): this copy has nothing to do. (Not when it ran
            # and no result is stored: its own message, redelivered, may have parked on its gate and been
            # taken by this copy's turn, so this copy ends it as below: the lock-set checker, RabbitMQ,
            # stop 62, a child killed after its body released its keys, the task STARTED for good.)
            log_acquire.info("%s[%s]: delayed copy of a run that ran or runs on %r; dropped", *who, key)
            raise Ignore()
        if outcome is AdmitOutcome.ALREADY_RAN and not stored:
            # The run ran and released its key, and no result is stored: its worker may be storing it now,
            # or died first. Look again later, then end the task saying so (never run the body twice).
            return ended_without_a_result(task, key, self.options, self.named_keys)
        if outcome in _COPY_OF:
            what = _COPY_OF[outcome]
            log_acquire.info("%s[%s]: copy of a run that is %s on %r; dropped", *who, what, key)
            ignored_as(request.id, f"is a copy of a run that is {what} on {key!r}: this copy is dropped")
            raise Ignore()
        if outcome is AdmitOutcome.RETRIED:
            copy_of_a_retried_attempt(task, key, self.entry)
        holder = dict(admission.holder)
        if outcome is AdmitOutcome.RUNNING:
            signals.lease_contended.send(sender=task, key=key, holder=holder, policy="duplicate")
            park_duplicate(task, key, self.options, False, resent=admission.resent and not self.copy)
            raise Ignore()
        if outcome is AdmitOutcome.PARKED:  # (a claim of one key that parked it)
            self._parked()
        signals.lease_contended.send(sender=task, key=key, holder=holder, policy=self.policy.name)
        if outcome is AdmitOutcome.SUPERSEDED:
            if self.debounced_copy and this_attempt_over(task, self.store, self.admit_keys):
                # The delayed copy of a run that a newer send replaced: its result is written already
                # (a RETRY an earlier attempt stored is not this attempt's: ``this_attempt_over``).
                # (Not when the copy itself took its set's gate, and the newer send parked there
                # while it held it: its reservation was refused, and nobody else writes its result.)
                raise Ignore()
            if copy_with_a_result(task, self.copy or admission.resent):
                # A copy of a run whose body ran and stored its result (its lease was lost mid-body and a
                # newer send took the key: the key does not remember the run as over). Its result stands.
                log_acquire.info("%s[%s]: a copy of a run that ended, superseded on %r; dropped", *who, key)
                ignored_as(request.id, f"is a copy of a run that ended, superseded on {key!r}: dropped")
                raise Ignore()
            return self._superseded(key, str(admission.by), admission.fence)
        if outcome is AdmitOutcome.MIXED:
            past = self._waited_past_timeout(key)
            if past is None:
                self._other_kind(key, admission)
            return self._ended_by_then(key, admission, past)
        assert outcome is AdmitOutcome.FULL, outcome
        reason = results.full_reason(
            key, admission.queued, self.policy.max_length, self.entry, in_document=len(admission.parked)
        )
        return self._ended_by_then(key, admission, reason)

    def _ended_by_then(self, key: str, admission: Admission, reason: str) -> Outcome:
        """The run cannot wait on ``key`` (a full queue, or past its timeout): its policy's ``then`` ends it,
        ``QueueTimeout`` (``Fail``) or skipped, with ``reason`` (``key``: its set's first key for a gate)."""
        key = results.named_key(key, self.admit_keys)
        if isinstance(self.policy.then, Fail):
            raise QueueTimeout(key, reason)
        contended = ContendedRun(self.task, self.store, key, direct=False)
        return contended.held_by(dict(admission.holder), admission.expires_at).skip(reason)

    def _waited_past_timeout(self, key: str) -> str | None:
        """Why a run that finds ``key`` in use as the other kind has waited past its policy's ``timeout``
        (None: it has not, or has no timeout). Such a run is not parked, so no deadline is kept for it: its
        wait counts from its first contention (the header its contention retries carry)."""
        timeout, since = self.policy.timeout, contended_since(self.request)
        if timeout is None or since is None or time.time() * 1000 - since <= timeout * 1000:
            return None
        at = _dt.datetime.fromtimestamp(since / 1000, _dt.timezone.utc).isoformat()
        return (
            f"waited since {at} for {results.named_key(key, self.admit_keys)!r}, in use as the other kind of "
            f"key, past its policy's timeout={timeout:g}"
        )

    def _other_kind(self, key: str, admission: Admission) -> NoReturn:
        """``key`` is in use as the other kind of key: ``limit=N`` slots while this run takes it as a single
        lease, or the reverse (another task, or this task's other key spec that renders the same key). The
        run does not park behind them (it would be handed what it cannot claim): it comes back later, a
        contention retry (``MIXED_RETRY``: back within 5 s) with its send stamp kept, until the key is free
        of them."""
        task = self.task
        limit = self.admits.limits.get(key, self.options.limit)
        mine = f"with limit={limit}" if limit and limit > 1 else "as a single lease"
        other = "as a single lease" if limit and limit > 1 else "with a limit (slots)"
        exc = LockContended(key, dict(admission.holder), admission.expires_at)
        log_acquire.info(
            "%s[%s]: %r is in use %s, and this run takes it %s: it does not park there, and comes back "
            "when the key is free of them (a contention retry)",
            task.name,
            task.request.id,
            key,
            other,
            mine,
        )
        wants, since = ("slots" if limit and limit > 1 else "single"), contended_since(self.request)
        try:  # (for ``why`` to show; the retry does not depend on it)
            self.store.note_kind_wait(key, str(task.request.id), task.name, wants, since)
        except StoreUnavailable as note_failed:
            log_acquire.debug("%s[%s]: not noted on %r: %s", task.name, task.request.id, key, note_failed)
        ContendedRun(task, self.store, key, direct=False).retry(MIXED_RETRY, exc)

    def _superseded(self, key: str, by: str, fence: int | None) -> Outcome:
        """A newer send (of this run's set of keys) is known on ``key``: the run ends ``SUCCESS`` with a
        ``superseded`` result, without its body (what it held is given back, it is parked nowhere). The runs
        it superseded itself before are ended first (their later keys left): nobody else would until the
        sweeper comes."""
        task, request, keys = self.task, self.request, self.keys
        try:
            self.admits.write_superseded()
        except StoreUnavailable as exc:  # (the sweeper writes them)
            log_acquire.warning(
                "%s[%s]: ending the runs it superseded failed: %s", task.name, request.id, exc
            )
        log_acquire.info(
            "%s[%s]: %r: a newer send (%s)%s supersedes this run: it ends %s, without running its body",
            task.name,
            request.id,
            key,
            by,
            f" of the same keys {keys}" if self.several else "",
            results.superseded_outcome_words(self.policy),
        )
        signals.run_superseded.send(sender=task, key=key, task_id=request.id, by=by)
        results.record_superseded(self.store, key, self.entry, fence=fence, by=by)  # history
        leave_rate(task, keys, self.options)
        if getattr(self.policy, "fail_superseded", False):
            raise Superseded(keys[0], None, by, held=False)
        return Outcome(results.superseded_result(keys[0], by, self.named_keys))

    def _parked(self) -> NoReturn:
        """Parked on its key (with several keys: on the first it has not got, the keys before it reserved
        for it); acknowledging the message ends this delivery. It is published again by whoever hands it
        the key it waits on (here, if that came before its reservations were made: ``moves_on``)."""
        task, keys, entry, store, policy = self.task, self.keys, self.entry, self.store, self.policy
        self.admits.write_superseded()
        if self.admits.stepwise and _queue.moves_on(store, entry):
            # Handed the key it waits on meanwhile (its release came before the keys before it were
            # reserved here): nobody else moves it on.
            _queue.publish_handoff(task.app, self.admit_keys[0], {**entry, "hn": 1}, store)
        debounce = policy.debounce if isinstance(policy, Replace) else 0.0
        if debounce and not self.debounced_copy and not (self.several and self.claim):
            # Come back when the debounce has passed: the copy takes the keys if no newer send came. (Sooner
            # when the burst it continues reaches max_wait first: its not-before time says.) A handoff of
            # a set parked again on a key leaves its delayed copy to its first message.
            due_at = self.admits.due_at
            wait = debounce if due_at is None else min(max(0.0, due_at - time.monotonic()), debounce)
            burst = entry.get("bu")
            publish_debounced_copy(
                task,
                self.stamp,
                wait,
                burst if isinstance(burst, int) else None,
                gated=self.admit_keys != self.keys,
            )
        if self.several:
            self._says_it_waits_for_all()
        key = keys[0]
        admission = self.admits.answers[key]
        holder = dict(admission.holder)
        position = admission.position(self.request.id)
        signals.lease_contended.send(sender=task, key=key, holder=holder, policy=policy.name)
        signals.run_parked.send(sender=task, key=key, task_id=entry["t"], position=position, stamp=self.stamp)
        log_acquire.info(
            "%s[%s]: %s; policy %s: parked at position %d (state QUEUED, no worker slot held): it starts "
            "when the key is handed to it%s",
            task.name,
            entry["t"],
            LockContended(key, holder, admission.expires_at),
            policy.name,
            position,
            ", unless a newer send replaces it first" if isinstance(policy, Replace) else ", in send order",
        )
        ignored_as(
            entry["t"],
            f"parked at position {position} on {key!r}, not dropped: it starts when handed the key",
        )
        raise Ignore()

    def _says_it_waits_for_all(self) -> NoReturn:
        task, keys, entry = self.task, self.keys, self.entry
        first = self.admit_keys[0]
        on = self.admits.waits_on or first
        signals.run_parked.send(sender=task, key=on, task_id=entry["t"], position=0, stamp=self.stamp)
        policy = self.policy
        if on == first and isinstance(policy, Replace) and policy.debounce:
            why = f"debounced: due {policy.debounce:g} s after the last send of its set, no worker slot held"
        elif on == first and first != keys[0]:
            why = "its set's gate: an older run of its set holds it or waits for it; no worker slot held"
        elif on == first:
            why = "the first of its keys; no worker slot held"
        else:
            why = "the first it has not got; no worker slot held, the keys before it reserved for it"
        log_acquire.info(
            "%s[%s]: waits for %r of %s (%s): it takes the others in key order, then starts",
            task.name,
            entry["t"],
            on,
            keys,
            why,
        )
        ignored_as(entry["t"], f"waits for {on!r}, not dropped: it starts once it has all of {keys}")
        raise Ignore()
