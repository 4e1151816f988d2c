"""What a singleton task does when its key is already held: small policy objects.

Each policy says what a run does when its key is held (``on_contended``) and when MongoDB does not
answer (``on_unavailable``), through ``Contention``: the few things a run can do (skip, fail, be published
again later, wait for the key), which the Celery glue implements. A new kind of policy is a new class
here; the glue does not change. Any of them can be given as an object (``Retry(countdown=5)``), a
shorthand string (``"retry"``, ``"skip"``, ``"wait"``, ``"fail"``) or, in settings, a dict
(``{"policy": "wait", "timeout": 10}``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import random
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, Protocol

from celery_mongolock.admission.limits import check_key_limits
from celery_mongolock.core.validation import validate_limit
from celery_mongolock.exceptions import ConfigurationError

__all__ = [
    "TRY_AGAIN",
    "Contention",
    "Fail",
    "Policy",
    "PolicySpec",
    "Queue",
    "Replace",
    "Retry",
    "Skip",
    "Wait",
    "check_cancel_running",
    "check_keys",
    "check_limit",
    "parse_policy",
]


class TryAgain:
    """Returned by ``Policy.on_contended``: try to take the key again now."""

    def __repr__(self) -> str:
        return "TRY_AGAIN"


TRY_AGAIN = TryAgain()


class Contention(Protocol):
    """A run that found its key held, or its lease store unreachable: what a policy can make it do.

    The Celery glue implements it (``task``); the body has not run and does not run unless the policy
    returns ``TRY_AGAIN`` and the key is then taken.
    """

    @property
    def key(self) -> str: ...

    def skip(self, reason: str) -> object:
        """End the run successfully without its body; returns the run's result (which says why)."""
        ...

    def fail(self, exc: Exception | None = None) -> NoReturn:
        """Fail the run with ``exc``, by default ``LockContended`` naming the holder."""
        ...

    def retry(self, policy: Retry, exc: Exception | None = None) -> NoReturn:
        """Publish the run again after ``policy``'s backoff, not counted in the task's own retries (a run
        that cannot be published again, such as a direct call, fails with ``exc`` instead)."""
        ...

    def wait_free(self, timeout: float) -> bool:
        """Block until the key looks free (True), or until ``timeout`` seconds have passed since this run
        first waited (False)."""
        ...


class Policy:
    """Base class of the contention policies."""

    name = "policy"
    #: A queued policy (``Queue``, ``Replace``) admits runs through the lease document: a contended run
    #: is parked there (its message acknowledged) and handed the key in send order, instead of coming back
    #: through the broker.
    queued = False

    def on_contended(self, run: Contention) -> object:
        """The key is held: end the run (return its result, or raise) or return ``TRY_AGAIN``."""
        raise NotImplementedError(f"{type(self).__name__} does not say what a contended run does")

    def on_unavailable(self, run: Contention, exc: Exception) -> NoReturn:
        """The lease store did not answer, so the body must not run: by default, run again later."""
        run.retry(Retry(), exc)


#: Upper bound of every policy duration (30 days, as for leases): larger values overflow Celery's ETAs.
MAX_SECONDS = 30 * 24 * 3600.0


def _number(
    owner: str,
    field: str,
    value: object,
    *,
    low: float = 0.0,
    high: float = MAX_SECONDS,
    allow_none: bool = False,
) -> None:
    if value is None and allow_none:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        raise ConfigurationError(
            f"{owner}({field}=...) must be a number from {low:g} to {high:g}, got {value!r}"
        )


@dataclasses.dataclass(frozen=True)
class Retry(Policy):
    """Run again later, backing off exponentially with jitter; the task's own retry budget is untouched."""

    countdown: float = 1.0
    backoff: float = 2.0
    max_countdown: float = 60.0
    jitter: bool = True
    #: Contention retries before giving up with ``LockContended`` (None: keep retrying; leases always
    #: end, so the run eventually gets its turn).
    max_retries: int | None = None
    name = "retry"

    def __post_init__(self) -> None:
        _number("Retry", "countdown", self.countdown)
        _number("Retry", "backoff", self.backoff, low=1.0, high=1000.0)
        _number("Retry", "max_countdown", self.max_countdown)
        if not isinstance(self.jitter, bool):
            raise ConfigurationError(f"Retry(jitter=...) must be True or False, got {self.jitter!r}")
        if self.max_retries is not None and (
            isinstance(self.max_retries, bool)
            or not isinstance(self.max_retries, int)
            or self.max_retries < 0
        ):
            raise ConfigurationError(
                f"Retry(max_retries=...) must be None or an int >= 0, got {self.max_retries!r}"
            )

    def delay(self, attempt: int, rng: Callable[[], float] = random.random) -> float:
        """Seconds to wait before contention retry number ``attempt`` (0-based): equal jitter, capped."""
        base = min(self.max_countdown, self.countdown * self.backoff ** min(attempt, 64))
        if not self.jitter:
            return base
        return base / 2 + rng() * base / 2

    def exhausted(self, attempt: int) -> bool:
        """True when retry number ``attempt`` (0-based) is beyond ``max_retries``."""
        return self.max_retries is not None and attempt >= self.max_retries

    def on_contended(self, run: Contention) -> NoReturn:
        run.retry(self)

    def on_unavailable(self, run: Contention, exc: Exception) -> NoReturn:
        run.retry(self, exc)


@dataclasses.dataclass(frozen=True)
class Skip(Policy):
    """Drop this run: it ends successfully with a result saying which key was held, and by whom."""

    name = "skip"

    def on_contended(self, run: Contention) -> object:
        return run.skip("the key was held by another run")


@dataclasses.dataclass(frozen=True)
class Wait(Policy):
    """Block until the key is free (woken at once by its release), at most ``timeout`` s, then ``then``."""

    timeout: float = 30.0
    then: Policy = dataclasses.field(default_factory=Retry)
    name = "wait"

    def __post_init__(self) -> None:
        _number("Wait", "timeout", self.timeout)
        _named_then(self, "Wait")
        if isinstance(self.then, Wait) or not isinstance(self.then, Policy) or self.then.queued:
            raise ConfigurationError(f"Wait(then=...) must be Retry(), Skip() or Fail(), got {self.then!r}")

    def on_contended(self, run: Contention) -> object:
        if run.wait_free(self.timeout):
            return TRY_AGAIN
        return self.then.on_contended(run)

    def on_unavailable(self, run: Contention, exc: Exception) -> NoReturn:
        run.retry(self.then if isinstance(self.then, Retry) else Retry(), exc)


@dataclasses.dataclass(frozen=True)
class Fail(Policy):
    """Fail this run with ``LockContended`` (logged without a traceback)."""

    name = "fail"

    def on_contended(self, run: Contention) -> NoReturn:
        run.fail()

    def on_unavailable(self, run: Contention, exc: Exception) -> NoReturn:
        run.fail(exc)


def _named_then(policy: Policy, owner: str) -> None:
    """A ``then=`` given by name or settings dict (``"skip"``, ``{"policy": "retry", "countdown": 5}``,
    as in settings) becomes its policy object."""
    then = getattr(policy, "then", None)
    if isinstance(then, (str, Mapping)):
        object.__setattr__(policy, "then", parse_policy(then, f"{owner}(then=...)"))


def _then(owner: str, then: object) -> None:
    if not isinstance(then, (Skip, Fail)):
        raise ConfigurationError(
            f"{owner}(then=...) must be Skip() or Fail(), got {then!r}: a parked run's message is "
            "acknowledged, so it cannot be retried or wait"
        )


@dataclasses.dataclass(frozen=True)
class Queue(Policy):
    """Park the run until the key is free, then run it: runs of one key start in the order they were
    **sent**, one at a time, and a parked run holds no worker slot.

    A contended run is recorded in the key's lease document (with its message), its broker message is
    acknowledged, and its state becomes ``QUEUED``. When the key is released, the same MongoDB command
    hands it to the oldest parked run, whose message is published again with its task id (so
    ``AsyncResult.get()`` returns its real result); no newcomer can take the key in between.
    ``timeout``: seconds a run may stay parked; ``max_length``: the most runs parked per key. Past either,
    ``then`` (``Skip()``, the default, or ``Fail()``) ends the run.
    """

    timeout: float | None = None
    max_length: int | None = None
    then: Policy = dataclasses.field(default_factory=Skip)
    name = "queue"
    queued = True

    def __post_init__(self) -> None:
        _number(type(self).__name__, "timeout", self.timeout, allow_none=True)
        if self.max_length is not None and (
            isinstance(self.max_length, bool) or not isinstance(self.max_length, int) or self.max_length < 1
        ):
            raise ConfigurationError(
                f"{type(self).__name__}(max_length=...) must be None or an int >= 1, got {self.max_length!r}"
            )
        _named_then(self, type(self).__name__)
        _then(type(self).__name__, self.then)

    def on_contended(self, run: Contention) -> object:
        # Only a run that cannot be parked gets here (a direct call or task.apply(): no message to
        # acknowledge and publish again): it waits for the key like Wait (up to ``timeout``, or Wait's
        # 30 s), then ``then``.
        if run.wait_free(self.timeout if self.timeout is not None else Wait.timeout):
            return TRY_AGAIN
        return self.then.on_contended(run)


class _DefaultGrace(float):
    """``Replace``'s default ``grace`` (10 s): a value of its own, so that a ``grace=`` the user gave
    can be told from the default (it means something only with ``cancel_running=True``)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_default_grace, ())


def _default_grace() -> float:
    return DEFAULT_GRACE


DEFAULT_GRACE: float = _DefaultGrace(10.0)


@dataclasses.dataclass(frozen=True)
class Replace(Queue):
    """Latest wins: at most one run is parked per key, and a newer **send** replaces it. The replaced
    run ends ``SUCCESS`` with ``{"mongolock": "superseded", "key": ..., "by": <task id>}``; a run sent
    before one that already got the key is superseded too. "Newer" is by send stamp, never by delivery
    order. ``debounce`` (seconds): every run waits that long after it reached a worker and starts only if
    no newer run of its key came meanwhile (trailing-edge debounce: a burst runs once, after its last
    send). ``max_wait`` (seconds, with ``debounce``): a key that keeps receiving sends still runs at least
    that long after its burst began waiting, with the newest send's arguments (the debounce's ceiling).
    ``timeout`` and ``then`` as for ``Queue``.

    ``cancel_running=True``: a newer send also supersedes the run that **holds** the key. The holder is
    told at once (``current_lease().superseded``; ``current_lease().raise_if_superseded()`` raises
    ``Superseded``, which ends the run ``SUCCESS`` with the superseded result), its fenced writes are
    refused from then on, and if its body still runs ``grace`` seconds later its prefork child is
    terminated and the key goes to the newest run. ``grace=None``: cooperative only, never terminated
    (the only mode on pools that cannot terminate a body: threads, solo, eventlet, gevent).

    A superseded run finishes for Celery's canvas like any run: its ``link`` callbacks are called with
    the superseded result, its chain goes on and its chord completes. ``fail_superseded=True``: it ends
    ``FAILURE`` with ``Superseded`` instead (its ``link_error`` callbacks are called, a chord containing
    it fails, a chain after it stops)."""

    debounce: float = 0.0
    max_wait: float | None = None
    cancel_running: bool = False
    grace: float | None = dataclasses.field(default_factory=lambda: DEFAULT_GRACE)
    fail_superseded: bool = False
    name = "replace"

    def __post_init__(self) -> None:
        _number("Replace", "timeout", self.timeout, allow_none=True)
        _number("Replace", "debounce", self.debounce, high=24 * 3600.0)
        _number("Replace", "max_wait", self.max_wait, high=24 * 3600.0, allow_none=True)
        if self.max_wait is not None and not self.debounce:
            raise ConfigurationError(
                f"Replace(max_wait={self.max_wait!r}) needs debounce=: max_wait is the ceiling of a "
                "debounce (how long a burst of sends may keep its run waiting)"
            )
        if self.max_wait is not None and self.max_wait < self.debounce:
            raise ConfigurationError(
                f"Replace(max_wait={self.max_wait!r}) must be at least debounce={self.debounce!r}: a run "
                "waits its debounce at least, and max_wait caps how long a burst keeps it waiting"
            )
        if self.max_length is not None:
            raise ConfigurationError("Replace() parks at most one run per key; it takes no max_length")
        _named_then(self, "Replace")
        _then("Replace", self.then)
        if not isinstance(self.cancel_running, bool):
            raise ConfigurationError(
                f"Replace(cancel_running=...) must be True or False, got {self.cancel_running!r}"
            )
        _number("Replace", "grace", self.grace, high=24 * 3600.0, allow_none=True)
        if self.grace is not DEFAULT_GRACE and not self.cancel_running:
            raise ConfigurationError(
                f"Replace(grace={self.grace!r}) needs cancel_running=True: grace is how long a running "
                "holder that a newer send superseded may go on before it is terminated"
            )
        if not isinstance(self.fail_superseded, bool):
            raise ConfigurationError(
                f"Replace(fail_superseded=...) must be True or False, got {self.fail_superseded!r}"
            )
        if self.cancel_running and self.debounce:
            raise ConfigurationError(
                f"Replace(cancel_running=True, debounce={self.debounce!r}) is not supported: a debounced "
                "send is not known to be the newest until its debounce has passed, so it cannot cancel the "
                "running holder when it arrives; use one or the other"
            )

    @property
    def terminates(self) -> bool:
        """A superseded holder still running after ``grace`` seconds is terminated."""
        return self.cancel_running and self.grace is not None


PolicySpec = Policy | str | Mapping[str, Any]

_BY_NAME: dict[str, type[Policy]] = {
    "retry": Retry,
    "skip": Skip,
    "wait": Wait,
    "fail": Fail,
    "queue": Queue,
    "replace": Replace,
}


def _did_you_mean(name: object) -> str:
    """`` (did you mean 'replace'?)`` for a misspelt policy name; empty if no name is close."""
    close = difflib.get_close_matches(str(name).strip().lower(), list(_BY_NAME), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_policy(value: object, setting: str = "on_contention") -> Policy:
    """A policy from an object, a shorthand string or a settings dict; ``ConfigurationError`` if invalid."""
    if isinstance(value, Policy):
        return value
    if isinstance(value, str):
        cls = _BY_NAME.get(value.strip().lower())
        if cls is None:
            raise ConfigurationError(
                f"{setting} must be one of 'retry', 'skip', 'wait', 'fail', 'queue', 'replace' or a policy "
                f"object, got {value!r}{_did_you_mean(value)}"
            )
        return cls()
    if isinstance(value, Mapping):
        options = dict(value)
        kind = options.pop("policy", None)
        cls = _BY_NAME.get(kind.strip().lower()) if isinstance(kind, str) else None
        if cls is None:
            hint = _did_you_mean(kind) if kind is not None else ""
            raise ConfigurationError(
                f"{setting} as a dict needs 'policy': one of 'retry', 'skip', 'wait', 'fail', 'queue', "
                f"'replace'; got {kind!r}{hint}"
            )
        if cls is not Replace:
            _refuse_replace_only(setting, cls, options)
        if "then" in options:
            options["then"] = parse_policy(options["then"], f"{setting}['then']")
        try:
            return cls(**options)
        except TypeError as exc:
            fields = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
            raise ConfigurationError(f"{setting}: {exc}; {cls.__name__} takes {fields}") from None
        except ConfigurationError as exc:  # a bad value: say which setting holds it
            raise ConfigurationError(f"{setting}: {exc}") from None
    raise ConfigurationError(
        f"{setting} must be a policy (Retry(), Skip(), Wait(), Fail(), Queue(), Replace()), a name or a "
        f"dict, got {type(value).__name__}"
    )


def _refuse_replace_only(setting: str, cls: type[Policy], options: Mapping[str, Any]) -> None:
    """``cancel_running``, ``grace`` and ``fail_superseded`` belong to ``Replace``: say so, not
    "unexpected keyword"."""
    for name in ("cancel_running", "grace", "fail_superseded"):
        if name in options:
            raise ConfigurationError(
                f"{setting}: {name!r} is an option of 'replace' only (how a newer send supersedes a run), "
                f"not of {cls.name!r}"
            )


def check_cancel_running(policy: object, *, limit: int | None = None, spec: str | None = None) -> None:
    """``Replace(cancel_running=True)`` supersedes the one run that holds a key: refuse it, in our words,
    on a key with N holders (``limit=N``, N > 1; ``spec``: that key's spec of ``keys=``). With one key or
    several (``keys=``: a newer send of the same set supersedes the running holder of that set), every
    key being a single lease, it is accepted."""
    if not (isinstance(policy, Replace) and policy.cancel_running):
        return
    if limit is not None and limit > 1:
        which = f"limit={limit}" if spec is None else f"limit {limit} for the key {spec!r} of keys="
        raise ConfigurationError(
            f"Replace(cancel_running=True) with {which} is not possible: with N holders of one key there "
            "is no one running holder for a newer send to supersede; use limit=1 (or no limit)"
        )


def check_limit(limit: object, policy: object = None, min_hold: object = None) -> int | None:
    """``limit=N``: an int from 1 to 1000; with N > 1, every policy (a ``Queue``/``Replace`` run parks
    until any of the N slots is free) and a minimum hold (``min_hold``: each slot stays taken at least
    that long after a run takes it). Returns N (None for a single lease)."""
    if isinstance(limit, Mapping):
        # A limit per key spec of keys=: checked against the specs by ``limits.check_key_limits``.
        return None
    n = validate_limit(limit)
    if n is not None and policy is not None and not isinstance(policy, Policy):
        policy = parse_policy(policy)
    check_cancel_running(policy, limit=n)
    return n


def _check_one_of_keys(index: int, spec: object) -> None:
    """One entry of ``keys=``: a template or argument name, a list of argument names, or a callable.
    None is refused here: as ``key=None`` it means the task's name, which a key set does not take."""
    if callable(spec) or (isinstance(spec, str) and spec):
        return
    if isinstance(spec, (list, tuple)) and spec and all(isinstance(s, str) and s for s in spec):
        return
    raise ConfigurationError(
        f"keys=[{index}] is {spec!r}: each entry of keys= names one key, as a template "
        "('tenant:{tenant}'), an argument name, a list of argument names or a callable"
        + (" (None, the task's name as its key, is for key= only)" if spec is None else "")
    )


def check_keys(
    keys: object, key: object = None, policy: object = None, limit: object = None
) -> tuple[Any, ...] | None:
    """``keys=(spec, ...)``: a non-empty list or tuple of key specs, not with ``key=``; ``limit`` as
    ``limits.check_key_limits`` takes it. Returns them as a tuple
    (None when not given)."""
    if keys is None:
        check_key_limits(limit, None)  # a limit per key spec needs keys=
        return None
    if isinstance(keys, (str, bytes)) or not isinstance(keys, (list, tuple)) or not keys:
        raise ConfigurationError(
            f"keys= must be a non-empty list or tuple of key specs (templates, argument names or callables), "
            f"got {keys!r}"
        )
    if key is not None:
        raise ConfigurationError("give key= or keys=, not both")
    for index, spec in enumerate(keys):
        _check_one_of_keys(index, spec)
    if policy is not None and not isinstance(policy, Policy):
        policy = parse_policy(policy)
    per_key = check_key_limits(limit, keys, policy)
    for spec, n in zip(keys, per_key or (), strict=False):
        check_cancel_running(policy, limit=n, spec=spec if isinstance(spec, str) else repr(spec))
    return tuple(keys)
