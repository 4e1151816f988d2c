"""Declaration-time checks of a singleton task's options, whichever way it is declared.

``@singleton_task(key=..., on_contention=..., ...)`` and ``@app.task(base=SingletonTask,
mongolock_key=..., ...)`` (or a ``SingletonTask`` subclass) get the same checks, when the task class is
created (for a lazily declared task: at ``app.finalize()``, which the worker does when it starts):
the key spec against the task's signature, the policy, the timings, and the option *names*, so that a
misspelt option (``lease_second=60``, ``mongolock_on_contension``) is refused with a suggestion instead
of silently becoming a plain task attribute that nothing reads.

A worker or beat that cannot start because of such a mistake (or a bad ``mongolock_*`` setting)
prints the message on one line instead of a long traceback (``install_start_up_error_hook``).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import sys
import threading
import types
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from typing import Any

from celery_mongolock.admission.policies import (
    Policy,
    PolicySpec,
    Replace,
    check_keys,
    check_limit,
    parse_policy,
)
from celery_mongolock.admission.rate import RateLimit, check_rate, checked_rate, parse_rate
from celery_mongolock.core.documents.sends import check_unique_send, check_unique_send_seconds
from celery_mongolock.core.keys import KeyRenderer, KeySpec
from celery_mongolock.core.validation import DEFAULT_LEASE_SECONDS, validate_lease_timing, validate_seconds
from celery_mongolock.exceptions import ConfigurationError, Superseded

__all__ = [
    "DECORATOR_OPTIONS",
    "FUTURE_OPTIONS",
    "TASK_ATTRIBUTES",
    "check_declaration",
    "check_decorated",
    "check_decorator_options",
    "check_task_class",
    "install_start_up_error_hook",
]

#: ``singleton_task``'s own keyword arguments.
DECORATOR_OPTIONS = (
    "key",
    "on_contention",
    "lease_seconds",
    "heartbeat_seconds",
    "min_hold_seconds",
    "limit",
    "keys",
    "rate",
    "unique_send",
    "unique_send_seconds",
)
#: The class attributes of ``SingletonTask`` that carry them (``mongolock_`` + the option's name).
TASK_ATTRIBUTES = tuple(f"mongolock_{name}" for name in DECORATOR_OPTIONS)
#: Planned options, refused until they exist (so that nobody relies on them doing something today).
FUTURE_OPTIONS: dict[str, str] = {}

# Names Celery itself reads from a task declaration: the Task class's attributes and the keyword
# arguments that app.task / shared_task / add_autoretry_behaviour consume.
_CELERY_DECLARATION_NAMES = frozenset(
    (
        "autoretry_for",
        "base",
        "bind",
        "dont_autoretry_for",
        "filter",
        "lazy",
        "name",
        "pydantic",
        "pydantic_context",
        "pydantic_dump_kwargs",
        "pydantic_strict",
        "retry_backoff",
        "retry_backoff_max",
        "retry_jitter",
        "retry_kwargs",
        "shared",
    )
)


@functools.lru_cache(maxsize=1)
def _celery_names() -> frozenset[str]:
    from celery import Task

    return _CELERY_DECLARATION_NAMES | {n for n in dir(Task) if not n.startswith("_")}


def _close(name: str, candidates: Iterable[str]) -> list[str]:
    return difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.75)


def _future(where: str, given: str, option: str) -> ConfigurationError:
    return ConfigurationError(
        f"{where}: {given} is not supported yet: {FUTURE_OPTIONS[option]} is planned, not implemented; "
        "remove it"
    )


def check_decorator_options(where: str, task_options: Mapping[str, Any]) -> None:
    """Refuse ``singleton_task`` keyword arguments that look like ours but are not.

    Celery's own task options (and any other name, as Celery allows custom task attributes) pass
    through; a planned option, a ``mongolock_*`` name, or a name close to one of ours is refused.
    """
    celery_names = _celery_names()
    for name in task_options:
        if name in FUTURE_OPTIONS:
            raise _future(where, f"{name}=", name)
        if name.startswith("mongolock_"):
            plain = name[len("mongolock_") :]
            if plain in FUTURE_OPTIONS:
                raise _future(where, f"{name}=", plain)
            hint = _close(plain, DECORATOR_OPTIONS)
            suggestion = f"; did you mean {hint[0]}=?" if hint else f"; known: {', '.join(DECORATOR_OPTIONS)}"
            raise ConfigurationError(
                f"{where}: singleton_task takes the options without the mongolock_ prefix, got {name}="
                f"{suggestion}"
            )
        if name in celery_names:
            continue
        hint = _close(name, (*DECORATOR_OPTIONS, *FUTURE_OPTIONS))
        if hint:
            raise ConfigurationError(
                f"{where}: unknown option {name}=; did you mean {hint[0]}=? (Celery's own task options "
                "are passed through; this one is neither ours nor Celery's)"
            )


def check_declaration(
    *,
    key: KeySpec,
    on_contention: PolicySpec | None,
    lease_seconds: float | None,
    heartbeat_seconds: float | None,
    min_hold_seconds: float | None,
    limit: int | Mapping[Any, int] | None,
    keys: Sequence[KeySpec] | None,
    rate: RateLimit | Mapping[str, Any] | None,
    unique_send_seconds: float | None,
    task_options: MutableMapping[str, Any],
) -> tuple[Policy | None, Sequence[KeySpec] | None, RateLimit | None]:
    """``singleton_task``'s arguments checked when it is called (``ConfigurationError`` for a mistake):
    ``(policy, keys, rate)`` as the task keeps them. A queued policy sets ``acks_late`` in
    ``task_options`` unless given."""
    policy = None if on_contention is None else parse_policy(on_contention, "on_contention")
    check_limit(limit, policy, min_hold_seconds)
    checked_keys = check_keys(keys, key, policy, limit)
    checked = checked_rate(rate, policy)
    check_unique_send_seconds(unique_send_seconds)
    if policy is not None and policy.queued:
        # A parked run's message is acknowledged once it is parked; before that, only acks_late keeps
        # a run whose worker dies from being lost.
        task_options.setdefault("acks_late", True)
    if min_hold_seconds is not None:
        validate_seconds("min_hold_seconds", min_hold_seconds, low=0.0, high=30 * 24 * 3600.0)
    if lease_seconds is not None or heartbeat_seconds is not None:
        validate_lease_timing(
            lease_seconds if lease_seconds is not None else DEFAULT_LEASE_SECONDS, heartbeat_seconds
        )
    return policy, checked_keys, checked


def check_decorated(
    func: Callable[..., Any],
    task_options: MutableMapping[str, Any],
    *,
    key: KeySpec,
    keys: Sequence[KeySpec] | None,
    policy: Policy | None,
) -> None:
    """The function ``singleton_task`` decorates, checked with the task's options: a callable, option
    names Celery or we read, each key spec against its signature (now, not at the first run). A
    ``Replace`` task's autoretry never retries ``Superseded`` (added to ``dont_autoretry_for``)."""
    if not callable(func):
        raise ConfigurationError(f"singleton_task decorates a function, got {func!r}")
    name = task_options.get("name") or f"{func.__module__}.{func.__qualname__}"
    check_decorator_options(f"task {name!r}", task_options)  # limit=3, lease_second=60, ...
    if task_options.get("autoretry_for") and isinstance(policy, Replace):
        # A superseded body's Superseded ends its run; Celery's autoretry must not retry it instead.
        given = tuple(task_options.get("dont_autoretry_for", ()))
        task_options["dont_autoretry_for"] = (*given, Superseded)
    for spec in keys or [key]:
        KeyRenderer(spec, func, name, skip_first=bool(task_options.get("bind")))


def _task_function(cls: type) -> tuple[Callable[..., Any], bool] | None:
    """The task's body as declared in ``cls`` and whether its first parameter is the task (``self``)."""
    run = cls.__dict__.get("run")
    if run is None:
        return None
    if isinstance(run, staticmethod):
        return run.__func__, False
    if isinstance(run, classmethod):  # pragma: no cover - unusual
        return run.__func__, True
    if isinstance(run, types.FunctionType):
        return run, True  # bind=True, or a class-based task's method
    return None


def check_task_class(cls: type) -> None:
    """Check a ``SingletonTask`` subclass when it is created; ``ConfigurationError`` names the mistake."""
    name = cls.__dict__.get("name") or f"{cls.__module__}.{cls.__qualname__}"
    where = f"task {name!r}"
    celery_names = _celery_names()
    for attr in cls.__dict__:
        if attr.startswith("mongolock_"):
            if attr in TASK_ATTRIBUTES or attr == "mongolock_key_for" or attr.startswith("mongolock__"):
                continue
            plain = attr[len("mongolock_") :]
            if plain in FUTURE_OPTIONS:
                raise _future(where, attr, plain)
            hint = _close(plain, DECORATOR_OPTIONS)  # (the names without the prefix they all share)
            suggestion = (
                f"did you mean mongolock_{hint[0]}?" if hint else f"known: {', '.join(TASK_ATTRIBUTES)}"
            )
            raise ConfigurationError(f"{where}: unknown option {attr}; {suggestion}")
        if (
            attr.startswith("_")
            or attr in celery_names
            or attr in FUTURE_OPTIONS
            or attr in ("limit", "keys", "rate")
        ):
            continue
        # Unprefixed: only our own options' names (and near misses) are refused; any other attribute
        # (``limit``, ``keys``, ``rate`` included: a task class may have its own) is the task's business.
        if attr in DECORATOR_OPTIONS and attr not in ("limit", "keys", "rate"):
            raise ConfigurationError(
                f"{where}: {attr} is not read on a SingletonTask; did you mean mongolock_{attr}? "
                "(or declare it with @singleton_task(..., " + attr + "=...))"
            )
        hint = _close(attr, [o for o in DECORATOR_OPTIONS if o not in ("limit", "keys", "rate")])
        if hint and not callable(cls.__dict__[attr]):
            raise ConfigurationError(
                f"{where}: unknown option {attr}; did you mean mongolock_{hint[0]}? (SingletonTask "
                "reads mongolock_* attributes)"
            )
    policy = getattr(cls, "mongolock_on_contention", None)
    if policy is not None and not isinstance(policy, Policy):
        parse_policy(policy, f"{where}: mongolock_on_contention")
    lease = getattr(cls, "mongolock_lease_seconds", None)
    beat = getattr(cls, "mongolock_heartbeat_seconds", None)
    hold = getattr(cls, "mongolock_min_hold_seconds", None)
    limit = getattr(cls, "mongolock_limit", None)
    from celery_mongolock.core.store import DEFAULT_LEASE_SECONDS, validate_lease_timing
    from celery_mongolock.core.validation import validate_seconds

    try:
        if lease is not None or beat is not None:
            validate_lease_timing(lease if lease is not None else DEFAULT_LEASE_SECONDS, beat)
        if hold is not None:
            validate_seconds("min_hold_seconds", hold, low=0.0, high=30 * 24 * 3600.0)
        check_limit(limit, policy, hold)
        multi = check_keys(getattr(cls, "mongolock_keys", None), None, policy, limit)
        check_rate(parse_rate(getattr(cls, "mongolock_rate", None), "mongolock_rate"), policy)
        check_unique_send(getattr(cls, "mongolock_unique_send", None))
        check_unique_send_seconds(getattr(cls, "mongolock_unique_send_seconds", None))
    except ConfigurationError as exc:
        raise ConfigurationError(f"{where}: {exc}") from None
    body = _task_function(cls)
    if body is not None:
        func, skip_first = body
        spec = inspect.getattr_static(cls, "mongolock_key", None)
        if isinstance(spec, (staticmethod, classmethod)):
            spec = spec.__func__
        for one in multi or [spec]:
            KeyRenderer(one, func, name, skip_first=skip_first)


# -- start-up errors: one line, not a traceback ---------------------------------------------------------

_hook_lock = threading.Lock()
_hook_installed = False


def _start_up_error_hook(previous: Callable[..., Any]) -> Callable[..., Any]:
    def hook(exc_type: type[BaseException], exc: BaseException, tb: types.TracebackType | None) -> None:
        if isinstance(exc, ConfigurationError):
            sys.stderr.write(f"celery_mongolock: cannot start: {exc}\n")
            sys.stderr.flush()
            return
        previous(exc_type, exc, tb)

    return hook


def install_start_up_error_hook(**_: Any) -> None:
    """In a process that starts a worker or beat: show a ``ConfigurationError`` that ends it as one
    line on stderr (the process still exits with status 1), not as a 50-line traceback through Celery's
    start-up code. Connected to Celery's ``import_modules`` signal, which worker and beat send before
    they create the tasks and read the settings; other exceptions are shown as before."""
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return
        _hook_installed = True
        sys.excepthook = _start_up_error_hook(sys.excepthook)
