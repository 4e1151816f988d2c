"""Settings: ``mongolock_*`` in ``app.conf`` (Django: ``CELERY_MONGOLOCK_*``), read lazily, validated.

=============================  ===============================  =============================================
setting                        default                          meaning
=============================  ===============================  =============================================
``mongolock_url``              ``mongodb://localhost:27017``    where the leases live
``mongolock_database``         ``celery_mongolock``             database of the lease collection
``mongolock_collection``       ``leases``                       the lease collection
``mongolock_lease_seconds``    ``30``                           how long a lease outlives a dead holder
``mongolock_heartbeat_seconds`` lease / 3                       renewal interval (at most lease / 2)
``mongolock_on_contention``    ``"retry"``                      policy when the key is held
``mongolock_operation_timeout`` ``10``                          deadline of one MongoDB operation
``mongolock_task_policies``    ``{}``                           per task name: any of ``on_contention``,
                                                                ``lease_seconds``, ``heartbeat_seconds``,
                                                                ``min_hold_seconds``, ``limit``, ``keys``,
                                                                ``rate``, ``unique_send``, ...
``mongolock_history_days``     ``7``                            days the lease history is kept (0: none)
``mongolock_signing_key``      ``None``                         secret that signs parked runs' messages
``mongolock_watch_leases``     ``True``                         a change stream per process notices a
                                                                lost lease at once (False: at the tick)
``mongolock_handoff_lane``     ``True``                         a handed-over run's message goes to its
                                                                queue's handoff lane, ahead of the backlog
``mongolock_parked_window``    ``32``                           ``Queue`` runs of one priority a key's lease
                                                                document keeps; the rest wait in
                                                                ``<collection>.parked``
=============================  ===============================  =============================================

Precedence for a task: ``mongolock_task_policies[task name]`` beats the decorator's arguments, which
beat the global settings.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from celery_mongolock.admission.limits import KeyLimit, check_key_limits
from celery_mongolock.admission.policies import (
    Policy,
    PolicySpec,
    Retry,
    check_keys,
    check_limit,
    parse_policy,
)
from celery_mongolock.admission.rate import RateLimit, check_rate, parse_rate
from celery_mongolock.core.documents.sends import (
    DEFAULT_UNIQUE_SEND_SECONDS,
    check_unique_send,
    check_unique_send_seconds,
)
from celery_mongolock.core.store import LeaseStore, validate_lease_timing, validate_names
from celery_mongolock.core.store_spill import DEFAULT_WINDOW, validate_window
from celery_mongolock.core.urls import validate_mongo_url
from celery_mongolock.core.validation import DEFAULT_HISTORY_DAYS, validate_history_days, validate_seconds
from celery_mongolock.exceptions import ConfigurationError

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "BEAT_DEFAULTS",
    "DEFAULTS",
    "KNOWN_SETTINGS",
    "Settings",
    "TaskOptions",
    "censor_url_in_celery_reports",
    "check_setting_names",
    "get_settings",
    "get_store",
    "read_settings",
]

DEFAULTS: dict[str, Any] = {
    "mongolock_url": "mongodb://localhost:27017",
    "mongolock_database": "celery_mongolock",
    "mongolock_collection": "leases",
    "mongolock_lease_seconds": 30.0,
    "mongolock_heartbeat_seconds": None,
    "mongolock_on_contention": "retry",
    "mongolock_operation_timeout": 10.0,
    "mongolock_task_policies": {},
    "mongolock_history_days": DEFAULT_HISTORY_DAYS,
    "mongolock_signing_key": None,
    "mongolock_watch_leases": True,
    "mongolock_handoff_lane": True,
    "mongolock_parked_window": DEFAULT_WINDOW,
}
#: The beat scheduler's settings (read by ``beat.read_beat_settings``; here so that every known
#: ``mongolock_*`` name is in one module).
BEAT_DEFAULTS: dict[str, Any] = {
    "mongolock_beat_key": "celery-beat:leader",
    "mongolock_beat_lease_seconds": 10.0,
    "mongolock_beat_heartbeat_seconds": None,
    "mongolock_beat_collection": "beat_ticks",
}
#: Every setting the library reads; any other ``mongolock_*`` name in ``app.conf`` is refused.
KNOWN_SETTINGS: tuple[str, ...] = (*DEFAULTS, *BEAT_DEFAULTS)
TASK_OPTION_NAMES = (
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


@dataclasses.dataclass(frozen=True)
class TaskOptions:
    """The lease options in force for one task."""

    on_contention: Policy
    lease_seconds: float
    heartbeat_seconds: float
    min_hold_seconds: float = 0.0
    #: ``limit=N``: up to N runs of one key at once (None: one, a single lease).
    limit: int | None = None
    #: ``keys=(spec, ...)``: several keys held together (None: the task's one key).
    keys: tuple[Any, ...] | None = None
    #: With ``keys=``: the limit of each spec, in the order of ``keys`` (None: every key a single lease).
    key_limits: tuple[int | None, ...] | None = None
    #: ``rate=RateLimit(n, period)`` or ``Throttle(period)``: starts per key over time (None: no rate).
    rate: RateLimit | None = None
    #: ``unique_send``: False, True or ``"best_effort"`` (``integration.unique_send``).
    unique_send: bool | str = False
    #: ``unique_send_seconds``: how long after its run is due a send's record deduplicates at most.
    unique_send_seconds: float = DEFAULT_UNIQUE_SEND_SECONDS


@dataclasses.dataclass(frozen=True)
class Settings:
    url: str
    database: str
    collection: str
    lease_seconds: float
    heartbeat_seconds: float | None
    on_contention: Policy
    operation_timeout: float
    task_policies: Mapping[str, Mapping[str, Any]]
    history_days: float = DEFAULT_HISTORY_DAYS
    #: ``mongolock_signing_key``: the HMAC secret of parked runs' stored messages (None: unsigned).
    signing_key: bytes | None = dataclasses.field(default=None, repr=False)
    #: ``mongolock_watch_leases``: watch the leases held with a change stream (loss noticed at once).
    watch_leases: bool = True
    #: ``mongolock_handoff_lane``: publish a handed-over run to its queue's handoff lane (``lanes``).
    handoff_lane: bool = True
    #: ``mongolock_parked_window``: the ``Queue`` runs of one priority a key's lease document keeps parked
    #: (``LeaseStore(parked_window=...)``).
    parked_window: int = DEFAULT_WINDOW

    def for_task(
        self,
        name: str,
        *,
        on_contention: PolicySpec | None = None,
        lease_seconds: float | None = None,
        heartbeat_seconds: float | None = None,
        min_hold_seconds: float | None = None,
        limit: int | Mapping[Any, int] | None = None,
        keys: Sequence[Any] | None = None,
        rate: RateLimit | Mapping[str, Any] | None = None,
        unique_send: bool | str | None = None,
        unique_send_seconds: float | None = None,
        declared: bool = True,
    ) -> TaskOptions:
        """Options for task ``name``: per-task settings > decorator arguments > global settings.
        ``keys`` from the settings replace the decorator's ``key=`` or ``keys=``. ``declared=False``: the
        settings are checked alone, before the task's decorator is known (a ``limit`` of each key spec
        is then checked against the decorator's ``keys=`` when the task is declared)."""
        override = self.task_policies.get(name, {})
        where = f"mongolock_task_policies[{name!r}]"
        policy_spec = override.get("on_contention", on_contention)
        policy = (
            self.on_contention
            if policy_spec is None
            else parse_policy(policy_spec, f"{where}['on_contention']")
        )
        if "lease_seconds" in override:
            lease = override["lease_seconds"]
        elif lease_seconds is not None:
            lease = lease_seconds
        else:
            lease = self.lease_seconds
        if "heartbeat_seconds" in override:
            beat = override["heartbeat_seconds"]
        elif heartbeat_seconds is not None:
            beat = heartbeat_seconds
        elif "lease_seconds" in override or lease_seconds is not None:
            beat = None  # a task-specific lease length gets its own default heartbeat
        else:
            beat = self.heartbeat_seconds
        try:
            lease_s, beat_s = validate_lease_timing(lease, beat)
        except ConfigurationError as exc:
            raise ConfigurationError(f"task {name!r}: {exc}") from None
        hold = override.get("min_hold_seconds", min_hold_seconds) or 0.0
        hold_s = validate_seconds(
            f"{where}['min_hold_seconds']" if "min_hold_seconds" in override else "min_hold_seconds",
            hold,
            low=0.0,
            high=30 * 24 * 3600.0,
        )
        limit_spec = override.get("limit", limit)
        try:
            n = check_limit(limit_spec, policy, hold_s)
        except ConfigurationError as exc:
            source = f"{where}['limit']" if "limit" in override else f"task {name!r}"
            raise ConfigurationError(f"{source}: {exc}") from None
        multi, per_key = _keys_and_limits(
            name, override, override.get("keys", keys), limit_spec, policy, declared=declared
        )
        starts = _rate_for(name, override, rate, policy)
        unique = override.get("unique_send", unique_send)
        unique_s = override.get("unique_send_seconds", unique_send_seconds)
        return TaskOptions(
            unique_send=check_unique_send(unique, _source(name, "unique_send", override)),
            unique_send_seconds=check_unique_send_seconds(
                unique_s, _source(name, "unique_send_seconds", override)
            ),
            on_contention=policy,
            lease_seconds=lease_s,
            heartbeat_seconds=beat_s,
            min_hold_seconds=hold_s,
            limit=n,
            keys=multi,
            key_limits=per_key,
            rate=starts,
        )


def _keys_and_limits(
    name: str,
    override: Mapping[str, Any],
    keys_spec: Any,
    limit_spec: Any,
    policy: Policy,
    *,
    declared: bool,
) -> tuple[tuple[Any, ...] | None, tuple[KeyLimit, ...] | None]:
    """The task's ``keys=`` and the limit of each (``check_keys``, ``check_key_limits``); an error names
    the setting it came from, else the task. ``declared=False``: the decorator's ``keys=`` are unknown, so
    a limit per key spec is checked alone (against them when the task is declared)."""
    where = f"mongolock_task_policies[{name!r}]"
    if keys_spec is None and not declared and isinstance(limit_spec, Mapping):
        keys_spec = tuple(limit_spec)
    try:  # the keys alone, then with their limits: an error names the option that holds the mistake
        check_keys(keys_spec, None, policy, None)
    except ConfigurationError as exc:
        source = f"{where}['keys']" if "keys" in override else f"task {name!r}"
        raise ConfigurationError(f"{source}: {exc}") from None
    try:
        multi = check_keys(keys_spec, None, policy, limit_spec)
        per_key = check_key_limits(limit_spec, multi, policy)
    except ConfigurationError as exc:
        source = f"{where}['limit']" if "limit" in override else f"task {name!r}"
        raise ConfigurationError(f"{source}: {exc}") from None
    return multi, per_key


def _rate_for(
    name: str, override: Mapping[str, Any], rate: RateLimit | Mapping[str, Any] | None, policy: Policy
) -> RateLimit | None:
    """The task's rate (``mongolock_task_policies``' ``"rate"`` beats the decorator's), checked with its
    policy (``admission.rate.check_rate``)."""
    source = f"mongolock_task_policies[{name!r}]['rate']" if "rate" in override else f"task {name!r} rate"
    try:
        starts = parse_rate(override.get("rate", rate), source)
        check_rate(starts, policy)
    except ConfigurationError as exc:
        if str(exc).startswith(source):
            raise
        raise ConfigurationError(f"{source}: {exc}") from None
    return starts


def _source(name: str, option: str, override: Mapping[str, Any]) -> str:
    """Where an option of task ``name`` comes from, for an error: its setting, else the task."""
    if option in override:
        return f"mongolock_task_policies[{name!r}][{option!r}]"
    return f"task {name!r}: {option}"


def _conf_get(conf: Any, name: str) -> Any:
    for candidate in (name, name.upper()):
        try:
            value = conf.get(candidate)
        except Exception:  # pragma: no cover - exotic conf objects
            value = None
        if value is not None:
            return value
    return DEFAULTS[name]


def _conf_keys(conf: Any) -> tuple[list[str], str]:
    """The setting names in ``conf`` (an ``app.conf`` or a plain mapping) and its namespace prefix
    (``"CELERY_"`` after ``config_from_object(..., namespace="CELERY")``, else empty)."""
    try:
        keys = [k for k in conf if isinstance(k, str)]  # loads a lazy app.conf first
    except Exception:  # pragma: no cover - exotic conf objects
        return [], ""
    prefix = getattr(conf, "prefix", None)
    return keys, prefix if isinstance(prefix, str) else ""


def _unknown(key: str, meant: str, prefix: str, upper: bool) -> ConfigurationError:
    """The error for a ``mongolock_*`` name the library does not read: the closest known name spelt as
    the user spells settings (namespace, case), else the list of known names."""
    close = difflib.get_close_matches(meant, KNOWN_SETTINGS, n=1, cutoff=0.75)
    if close:
        name = close[0].upper() if upper else close[0]
        return ConfigurationError(f"unknown setting {key!r}; did you mean {prefix + name!r}?")
    return ConfigurationError(f"unknown setting {key!r}; the settings are {', '.join(KNOWN_SETTINGS)}")


def check_setting_names(conf: Any) -> None:
    """Refuse a ``mongolock_*`` setting the library does not read (``ConfigurationError`` naming it and
    the closest known name): a misspelt setting would otherwise be silently ignored. Any case; with or
    without the app's namespace (Django: ``CELERY_MONGOLOCK_*``); ``CELERY_MONGOLOCK_*`` in an app that
    has no ``CELERY`` namespace is refused too, as it is not read either."""
    keys, prefix = _conf_keys(conf)
    for key in keys:
        namespaced = bool(prefix) and key.upper().startswith(prefix.upper())
        bare = key[len(prefix) :] if namespaced else key
        spelt = key[: len(prefix)] if namespaced else ""
        lower = bare.lower()
        compact = lower.replace("_", "").replace("-", "")
        if compact.startswith("celerymongolock"):
            # Django style, but this app strips no CELERY_ namespace: the library never reads it.
            meant = lower[len("celery_") :] if lower.startswith("celery_") else lower
            if meant in KNOWN_SETTINGS:
                raise ConfigurationError(
                    f"setting {key!r} is not read: this app has no 'CELERY' namespace; name it {meant!r} "
                    "(or load the settings with app.config_from_object(..., namespace='CELERY'))"
                )
            raise _unknown(key, meant, "", bare.isupper())
        if not compact.startswith("mongolock"):
            continue
        if lower not in KNOWN_SETTINGS:
            raise _unknown(key, lower, spelt, bare.isupper())
        if bare not in (lower, lower.upper()):
            raise ConfigurationError(
                f"setting {key!r} is not read: write it {lower!r} (or {lower.upper()!r})"
            )


def _checked_task_options(where: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """One task's ``mongolock_task_policies`` options, each checked as far as it can be without the task."""
    checked = dict(options)
    if "on_contention" in checked:
        checked["on_contention"] = parse_policy(checked["on_contention"], f"{where}['on_contention']")
    if "keys" in checked:
        # The shape now; against the task's policy, limit and signature once the task is known (a
        # worker's start-up: ``task.check_task_policies``).
        try:
            checked["keys"] = check_keys(checked["keys"])
        except ConfigurationError as exc:
            raise ConfigurationError(f"{where}['keys']: {exc}") from None
    if "unique_send" in checked:
        checked["unique_send"] = check_unique_send(checked["unique_send"], f"{where}['unique_send']")
    if "unique_send_seconds" in checked:
        checked["unique_send_seconds"] = check_unique_send_seconds(
            checked["unique_send_seconds"], f"{where}['unique_send_seconds']"
        )
    return checked


def read_settings(conf: Any) -> Settings:
    """Read and validate every ``mongolock_*`` setting; ``ConfigurationError`` names the bad one, or a
    ``mongolock_*`` name the library does not read (a typo)."""
    check_setting_names(conf)
    url = validate_mongo_url(_conf_get(conf, "mongolock_url"), setting="mongolock_url")
    names = {}
    for setting in ("mongolock_database", "mongolock_collection"):
        value = _conf_get(conf, setting)
        if not isinstance(value, str) or not value.strip() or "$" in value or "\x00" in value:
            raise ConfigurationError(f"{setting} must be a non-empty name without '$', got {value!r}")
        names[setting] = value
    if any(c in names["mongolock_database"] for c in '/\\. "'):
        raise ConfigurationError(
            f"mongolock_database {names['mongolock_database']!r} must not contain / \\ . or spaces"
        )
    validate_names(names["mongolock_database"], names["mongolock_collection"], prefix="mongolock_")
    try:
        lease, beat = validate_lease_timing(
            _conf_get(conf, "mongolock_lease_seconds"), _conf_get(conf, "mongolock_heartbeat_seconds")
        )
    except ConfigurationError as exc:
        raise ConfigurationError(f"mongolock_{exc}") from None
    explicit_beat = _conf_get(conf, "mongolock_heartbeat_seconds")
    policy = parse_policy(_conf_get(conf, "mongolock_on_contention"), "mongolock_on_contention")
    timeout = validate_seconds(
        "mongolock_operation_timeout", _conf_get(conf, "mongolock_operation_timeout"), low=0.1, high=3600.0
    )
    raw_policies = _conf_get(conf, "mongolock_task_policies")
    if not isinstance(raw_policies, Mapping):
        raise ConfigurationError(
            "mongolock_task_policies must be a dict of task name -> options, "
            f"got {type(raw_policies).__name__}"
        )
    task_policies: dict[str, dict[str, Any]] = {}
    for task_name, given in raw_policies.items():
        where = f"mongolock_task_policies[{task_name!r}]"
        if not isinstance(task_name, str) or not task_name:
            raise ConfigurationError(f"mongolock_task_policies keys must be task names, got {task_name!r}")
        options = {"on_contention": given} if isinstance(given, (str, Policy)) else given  # {"t": "skip"}
        if not isinstance(options, Mapping):
            raise ConfigurationError(f"{where} must be a dict of options, got {type(options).__name__}")
        unknown = sorted(set(options) - set(TASK_OPTION_NAMES), key=str)
        if unknown:
            hints = [
                difflib.get_close_matches(str(name), TASK_OPTION_NAMES, n=1, cutoff=0.75) for name in unknown
            ]
            close = [f"{h[0]!r} for {n!r}" for n, h in zip(unknown, hints, strict=True) if h]
            suggestion = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigurationError(
                f"{where} has unknown option(s) {unknown}{suggestion}; known: {list(TASK_OPTION_NAMES)}"
            )
        task_policies[task_name] = _checked_task_options(where, options)
    history_days = validate_history_days(_conf_get(conf, "mongolock_history_days"), "mongolock_history_days")
    settings = Settings(
        url=url,
        database=names["mongolock_database"],
        collection=names["mongolock_collection"],
        lease_seconds=lease,
        heartbeat_seconds=None if explicit_beat is None else beat,
        on_contention=policy,
        operation_timeout=timeout,
        task_policies=task_policies,
        history_days=history_days,
        signing_key=_signing_key(_conf_get(conf, "mongolock_signing_key")),
        watch_leases=_flag(conf, "mongolock_watch_leases"),
        handoff_lane=_flag(conf, "mongolock_handoff_lane"),
        parked_window=validate_window(_conf_get(conf, "mongolock_parked_window"), "mongolock_parked_window"),
    )
    for task_name in task_policies:  # lease/heartbeat combinations are checked now, not at first run
        settings.for_task(task_name, declared=False)
    return settings


def _flag(conf: Any, setting: str) -> bool:
    value = _conf_get(conf, setting)
    if not isinstance(value, bool):
        raise ConfigurationError(f"{setting} must be True or False, got {value!r}")
    return value


#: The shortest ``mongolock_signing_key``: an HMAC-SHA256 key of fewer bytes is easy to guess.
MIN_SIGNING_KEY_BYTES = 16


def _signing_key(value: Any) -> bytes | None:
    """``mongolock_signing_key`` as bytes (None: not set); never echoed in an error."""
    if value is None:
        return None
    if isinstance(value, str):
        value = value.encode()
    if not isinstance(value, bytes):
        raise ConfigurationError(
            f"mongolock_signing_key must be a str or bytes secret, got {type(value).__name__}"
        )
    if len(value) < MIN_SIGNING_KEY_BYTES:
        raise ConfigurationError(
            f"mongolock_signing_key must be at least {MIN_SIGNING_KEY_BYTES} bytes long, got {len(value)} "
            "(e.g. secrets.token_hex(32))"
        )
    return value


_lock = threading.RLock()  # get_store calls get_settings while holding it


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()  # another thread of the parent may have held it at the moment of fork


os.register_at_fork(after_in_child=_after_fork_in_child)


def get_settings(app: Celery) -> Settings:
    """The app's validated settings (read once per app; ``app.conf`` changes before first use count)."""
    cached: Settings | None = getattr(app, "_mongolock_settings", None)
    if cached is None:
        with _lock:
            cached = getattr(app, "_mongolock_settings", None)
            if cached is None:
                cached = read_settings(app.conf)
                app._mongolock_settings = cached
    return cached


#: ``hook(app, store)`` for every store ``get_store`` creates (the Celery glue above adds its own, e.g. the
#: handoff publisher of queued tasks).
STORE_HOOKS: list[Callable[[Celery, LeaseStore], None]] = []


def get_store(app: Celery) -> LeaseStore:
    """The app's lease store. Created lazily; its MongoClient is per process (fork-safe)."""
    store: LeaseStore | None = getattr(app, "_mongolock_store", None)
    if store is None:
        with _lock:
            store = getattr(app, "_mongolock_store", None)
            if store is None:
                settings = get_settings(app)
                store = LeaseStore(
                    settings.url,
                    database=settings.database,
                    collection=settings.collection,
                    lease_seconds=settings.lease_seconds,
                    heartbeat_seconds=settings.heartbeat_seconds,
                    operation_timeout=settings.operation_timeout,
                    history_days=settings.history_days,
                    watch_leases=settings.watch_leases,
                    parked_window=settings.parked_window,
                )
                from celery_mongolock.integration import signals

                store.add_lost_callback(signals.send_lost)
                for hook in STORE_HOOKS:
                    hook(app, store)
                app._mongolock_store = store
                app._mongolock_store_pid = os.getpid()
    return store


def censor_url_in_celery_reports() -> None:
    """Have Celery mask ``mongolock_url`` where it prints settings (``celery report``, ``inspect conf``).

    Celery masks only settings whose names look secret (``...PASS...``, ``...KEY...``); the lease store's
    URL may carry a password.
    """
    import re

    from celery.app import utils

    hidden = utils.HIDDEN_SETTINGS
    if not hidden.search("mongolock_url"):
        utils.HIDDEN_SETTINGS = re.compile(f"{hidden.pattern}|MONGOLOCK_URL", hidden.flags | re.IGNORECASE)


def default_retry() -> Retry:
    return Retry()
