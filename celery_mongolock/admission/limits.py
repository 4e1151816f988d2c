"""Per-key limits of a run that needs several keys: ``keys=(...)`` with ``limit=``.

The multi-tenant upload::

    @singleton_task(keys=("tenant:{tenant}", "group:{group}"), limit={"tenant:{tenant}": 3})
    def upload(tenant, group, rows): ...

runs at most 3 uploads of one tenant at once, and at most one of one group: a key spec without an entry
in the dict has limit 1 (a single lease). ``limit=N`` (an int) with ``keys=`` gives every key N slots.
Each key is then taken like a ``limit=N`` key of its own (``LeaseStore.try_acquire(key, limit=n)``), all
of them within one attempt or none, so the policy sees one contended run whatever the shape.

Pure values and checks, no I/O and no Celery.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from celery_mongolock.core.validation import validate_limit
from celery_mongolock.exceptions import ConfigurationError

__all__ = ["KeyLimit", "check_key_limits", "limits_by_key"]

#: One key spec's limit: None for a single lease, N (2 to 1000) for N slots.
KeyLimit = int | None


def _spec_name(spec: Any) -> str:
    return spec if isinstance(spec, str) else getattr(spec, "__qualname__", repr(spec))


def _unknown_specs(limit: Mapping[Any, Any], keys: Sequence[Any]) -> list[str]:
    """The dict's key specs that are not among ``keys``, each with a suggestion when one is close."""
    named = [k for k in keys if isinstance(k, str)]
    problems = []
    for spec in limit:
        if any(spec is k or (isinstance(spec, str) and spec == k) for k in keys):
            continue
        close = difflib.get_close_matches(spec, named, n=1) if isinstance(spec, str) else []
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        problems.append(f"{_spec_name(spec) if callable(spec) else spec!r}{hint}")
    return problems


def check_key_limits(
    limit: object, keys: Sequence[Any] | None, policy: Any = None
) -> tuple[KeyLimit, ...] | None:
    """The limit of each spec of ``keys=`` (in the order given), or None when every key is a single
    lease (or the task has one ``key=``: its ``limit=N`` is checked by ``check_limit``).

    ``limit`` is None, an int (every key), or a dict from key specs of ``keys=`` to ints. Refused, with
    what is wrong: a dict without ``keys=``, a dict naming a spec that is not in ``keys=``, a value
    that is not an int from 1 to 1000. Every policy takes it: with ``Queue`` or ``Replace`` a run parks
    on a key with slots and reserves a slot as it reserves a single lease (``core.documents.slot_reserve``),
    and with ``Replace`` a newer send of its set of keys supersedes it there too
    (``core.documents.slot_sets``). ``policy`` is accepted for the callers' sake and not read."""
    if keys is None:
        if isinstance(limit, Mapping):
            raise ConfigurationError(
                "limit={...} gives the limit of each key spec of keys=(...); a task with one key= takes "
                f"limit=N (an int), got {dict(limit)!r}"
            )
        return None
    if limit is None:
        return None
    if isinstance(limit, Mapping):
        unknown = _unknown_specs(limit, keys)
        if unknown:
            raise ConfigurationError(
                f"limit= names key specs that are not in keys={tuple(_spec_name(k) for k in keys)!r}: "
                + ", ".join(unknown)
            )
        per: list[KeyLimit] = []
        for spec in keys:
            given = next((v for k, v in limit.items() if k is spec or k == spec), None)
            try:
                per.append(validate_limit(given))
            except ConfigurationError:
                raise ConfigurationError(
                    f"limit[{_spec_name(spec)!r}] must be an int from 1 to 1000, got {given!r}"
                ) from None
    else:
        n = validate_limit(limit)
        per = [n for _ in keys]
    if all(n is None for n in per):
        return None
    return tuple(per)


def limits_by_key(rendered: Sequence[tuple[str, KeyLimit]]) -> dict[str, KeyLimit]:
    """Rendered key -> its limit, for the (key, limit) of each spec. Two specs that render the same key
    hold it once, with the smaller limit (a single lease when either has none)."""
    out: dict[str, KeyLimit] = {}
    for key, n in rendered:
        if key in out:
            seen = out[key]
            out[key] = None if seen is None or n is None else min(seen, n)
        else:
            out[key] = n
    return out
