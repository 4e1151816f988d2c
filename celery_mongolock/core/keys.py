"""Lease keys: validation and normalisation.

A lease key is the ``_id`` of one lease document. Keys are text; the key a caller passes is the key
stored, unless it is longer than ``MAX_KEY_BYTES`` (UTF-8), in which case it is shortened to a readable
prefix plus a SHA-256 of the whole key, so that every distinct key still maps to a distinct lease.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import string
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from celery_mongolock.exceptions import ConfigurationError, InvalidKey

__all__ = ["MAX_KEY_BYTES", "KeyRenderer", "KeySpec", "encode_value", "normalize_key"]

#: Keys longer than this (in UTF-8 bytes) are stored as ``<prefix>~sha256:<hex>``.
MAX_KEY_BYTES = 200
_PREFIX_CHARS = 120
#: Keys the library names itself (``documents.sets.gate_of``); no task's key may start with it.
RESERVED_PREFIX = "mongolock-set:"


def a_type(value: object) -> str:
    """``value``'s type name with its article, for messages: "an object", "a set", "a UUID"."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeio' else 'a'} {name}"


def normalize_key(key: object) -> str:
    """Return the lease key stored for ``key``; raise ``InvalidKey`` naming the problem."""
    if not isinstance(key, str):
        raise InvalidKey(f"lease key must be a str, got {type(key).__name__}: {key!r:.80}")
    if not key:
        raise InvalidKey("lease key must not be empty")
    if not key.strip():
        raise InvalidKey(f"lease key must not be only whitespace: {key!r}")
    if "\x00" in key:
        raise InvalidKey(f"lease key must not contain NUL characters: {key!r:.80}")
    try:
        encoded = key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidKey(f"lease key is not valid Unicode text ({exc.reason}): {key!r:.80}") from None
    if len(encoded) <= MAX_KEY_BYTES:
        return key
    digest = hashlib.sha256(encoded).hexdigest()
    return f"{key[:_PREFIX_CHARS]}~sha256:{digest}"


#: Why a key in the gates' names (``RESERVED_PREFIX``) is refused, for every place that refuses one.
RESERVED_WHY = "which celery_mongolock keeps for the gates of Replace tasks' key sets; name it otherwise"


def user_key(key: object) -> str:
    """``normalize_key`` for a key a caller names to the store (``LeaseStore.acquire``, ``hold``): also
    refused (``InvalidKey``) when it is one of the library's own, a set's gate."""
    if isinstance(key, str) and key.startswith(RESERVED_PREFIX):
        raise InvalidKey(f"lease key {key!r:.80} starts with {RESERVED_PREFIX!r}, {RESERVED_WHY}")
    return normalize_key(key)


# -- key specs: how a task's arguments name its lease key ----------------------------------------------

KeySpec = None | str | Sequence[str] | Callable[..., Any]

_TEMPLATE_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def encode_value(value: object, *, argument: str = "value") -> str:
    """The canonical text of an argument value used in a key.

    str as is; int (and bool) in decimal; UUID and ObjectId as their usual string; dict and list as
    compact JSON with sorted keys (so ``{"a": 1, "b": 2}`` and ``{"b": 2, "a": 1}`` give one key).
    Anything else (floats, bytes, arbitrary objects) is refused: it has no single obvious text, and a
    key that silently differs between two calls would not exclude anything.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        try:
            return str(value)
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
            raise InvalidKey(
                f"argument {argument!r} is an int too large to encode into a lease key"
            ) from None
    if isinstance(value, uuid.UUID):
        return str(value)
    if type(value).__name__ == "ObjectId" and type(value).__module__.startswith("bson"):
        return str(value)
    if value is None:
        return "null"
    if isinstance(value, (dict, list, tuple)):
        try:
            return json.dumps(
                _jsonable(value, argument), sort_keys=True, separators=(",", ":"), ensure_ascii=False
            )
        except InvalidKey:
            raise
        except (TypeError, ValueError) as exc:
            raise InvalidKey(f"argument {argument!r} cannot be encoded into a lease key: {exc}") from None
        except RecursionError:
            raise InvalidKey(
                f"argument {argument!r} is nested too deeply (or contains itself) to encode into a lease key"
            ) from None
    raise InvalidKey(
        f"argument {argument!r} is {a_type(value)} ({value!r:.60}); lease keys accept str, int, "
        "UUID, "
        "ObjectId, dict and list values: pass one of those, or give key= a callable that returns a string"
    )


def _jsonable(value: object, argument: str) -> object:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidKey(f"argument {argument!r} has a dict key {k!r} that is not a str")
            out[k] = _jsonable(v, argument)
        return out
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, argument) for v in value]
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    return encode_value(value, argument=argument)


class KeyRenderer:
    """Turns a task's call arguments into its lease key, per the task's key spec.

    * ``None``: the task's name (one run at a time, whatever the arguments);
    * an argument name, or a list of them: ``"<task name>:<value>[:<value>...]"``;
    * a template such as ``"email-group:{group_id}"``: the rendered text is the key as is, so two tasks
      using the same template guard the same resource;
    * a brace-free string that is not an identifier (``"nightly-report"``), or any string for a task
      without arguments: that fixed key (a bare name on a task with arguments must be one of them, so
      that a misspelt argument name is an error, not a silently global lock);
    * a callable: called with the task's arguments *bound* to the task's signature, defaults applied,
      by name (positional-only and ``*args`` parameters positionally, ``**kwargs`` spread out), returns
      the key. So ``lambda group_id, **_: ...`` works for ``f(42, "a.csv")`` and ``f(group_id=42)``
      alike; a callable that could not take the task's arguments is refused at declaration.

    Arguments are bound to the function's signature with defaults applied, so ``f(1)`` and
    ``f(group_id=1)`` give one key. Every mistake that can be found when the task is declared is
    reported then (``ConfigurationError``).
    """

    def __init__(
        self, spec: KeySpec, func: Callable[..., Any], task_name: str, *, skip_first: bool = False
    ) -> None:
        self.spec = spec
        self.task_name = task_name
        self.func = func
        try:
            self.signature: inspect.Signature | None = inspect.signature(func)
        except (TypeError, ValueError):
            self.signature = None
        if skip_first and self.signature is not None:  # bind=True: the first parameter is the task
            self.signature = self.signature.replace(parameters=list(self.signature.parameters.values())[1:])
        params = self.signature.parameters if self.signature is not None else {}
        self._names: tuple[str, ...] = ()
        self._template: str | None = None
        self._fixed: str | None = None
        self._callable: Callable[..., Any] | None = None
        self._callable_signature: inspect.Signature | None = None
        where = f"task {task_name!r}"
        if spec is None:
            self._fixed = task_name
        elif isinstance(spec, str):
            if not spec:
                raise ConfigurationError(f"{where}: key must not be empty (use key=None for the task's name)")
            if "{" in spec or "}" in spec:
                fields = self._template_fields(spec, where)
                missing = [f for f in fields if f not in params and not self._has_var_kwargs(params)]
                if missing:
                    raise ConfigurationError(
                        f"{where}: key template {spec!r} names {', '.join(map(repr, missing))}, which "
                        f"{'is' if len(missing) == 1 else 'are'} not an argument of {self._describe(params)}"
                    )
                self._template = spec
            elif spec.isidentifier() and not params:
                self._fixed = spec  # nothing it could name: a task without arguments has one fixed key
            elif spec.isidentifier():
                if spec not in params and not self._has_var_kwargs(params):
                    raise ConfigurationError(
                        f"{where}: key {spec!r} is not an argument of {self._describe(params)}; for a fixed "
                        f"key use a string that is not a bare name, such as {spec + ':lock'!r}"
                    )
                self._names = (spec,)
            else:
                normalize_key(spec)
                self._fixed = spec
        elif callable(spec):
            self._callable = spec
            self._check_callable(spec, params, where)
        elif isinstance(spec, (list, tuple)):
            if not spec:
                raise ConfigurationError(f"{where}: key lists must name at least one argument")
            for name in spec:
                if not isinstance(name, str) or not name.isidentifier():
                    raise ConfigurationError(
                        f"{where}: key list entries must be argument names, got {name!r}"
                    )
                if name not in params and not self._has_var_kwargs(params):
                    raise ConfigurationError(
                        f"{where}: key names {name!r}, which is not an argument of {self._describe(params)}"
                    )
            self._names = tuple(spec)
        else:
            raise ConfigurationError(
                f"{where}: key must be None, an argument name, a list of names, a template string or a "
                f"callable, got {type(spec).__name__}"
            )
        self._refuse_reserved(where)

    def _refuse_reserved(self, where: str) -> None:
        """Refuse, now, a fixed key (or a template's fixed start) in the library's own names: a set's
        gate (a key rendered there is refused when it is rendered too)."""
        start = self._fixed if self._fixed is not None else self._template
        if start is not None and start.split("{", 1)[0].startswith(RESERVED_PREFIX):
            raise ConfigurationError(
                f"{where}: the key {start!r:.80} starts with {RESERVED_PREFIX!r}, {RESERVED_WHY}"
            )

    def _check_callable(
        self, spec: Callable[..., Any], params: Mapping[str, inspect.Parameter], where: str
    ) -> None:
        """Refuse, now, a key callable that could not take the task's arguments as they are passed."""
        try:
            self._callable_signature = inspect.signature(spec)
        except (TypeError, ValueError):  # a builtin without a signature: nothing to check
            return
        if self.signature is None:
            return
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for param in params.values():
            if param.kind is inspect.Parameter.POSITIONAL_ONLY:
                args.append(None)
            elif param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
                kwargs[param.name] = None
        # A task taking *args or **kwargs may pass more than its named parameters: only refuse what the
        # callable could never take.
        variadic = any(
            p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
            for p in params.values()
        )
        try:
            if variadic:
                self._callable_signature.bind_partial(*args, **kwargs)
            else:
                self._callable_signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise ConfigurationError(
                f"{where}: the key callable {self._callable_text()} cannot take the arguments of "
                f"{self._describe(params)} ({exc}); it is called with the task's arguments by name, "
                "so name the ones it uses and take the rest with **kwargs, e.g. "
                "key=lambda group_id, **_: ..."
            ) from None

    def _callable_text(self) -> str:
        name = getattr(self._callable, "__name__", type(self._callable).__name__)
        signature = "" if self._callable_signature is None else str(self._callable_signature)
        return f"{name}{signature}"

    def _callable_arguments(
        self, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> tuple[list[Any], dict[str, Any]]:
        """The call's arguments bound to the task's signature, as the key callable receives them."""
        if self.signature is None:
            return list(args), dict(kwargs)
        bound = self._bind_call(self.signature, args, kwargs)
        bound.apply_defaults()
        positional: list[Any] = []
        named: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            kind = self.signature.parameters[name].kind
            if kind is inspect.Parameter.POSITIONAL_ONLY:
                positional.append(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                positional.extend(value)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            else:
                named[name] = value
        return positional, named

    @staticmethod
    def _has_var_kwargs(params: Mapping[str, inspect.Parameter]) -> bool:
        return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def _describe(self, params: Mapping[str, inspect.Parameter]) -> str:
        return f"{getattr(self.func, '__name__', 'the task')}({', '.join(params)})"

    @staticmethod
    def _template_fields(template: str, where: str) -> list[str]:
        fields = []
        try:
            parsed = list(string.Formatter().parse(template))
        except ValueError as exc:
            raise ConfigurationError(
                f"{where}: key template {template!r} is malformed: a '{{' or '}}' without its pair (write "
                f"'{{{{' or '}}}}' for a brace in the key) ({exc})"
            ) from None
        for _literal, field, spec, conversion in parsed:
            if field is None:
                continue
            if not _TEMPLATE_FIELD.match(field):
                raise ConfigurationError(
                    f"{where}: key template {template!r} field {{{field}}} must be a plain argument name "
                    "(no attribute access, indexing or positional fields)"
                )
            if spec or conversion:
                raise ConfigurationError(
                    f"{where}: key template {template!r} field {{{field}}} must not carry a format spec or "
                    "conversion; values are encoded canonically"
                )
            fields.append(field)
        return fields

    def _bind_call(
        self, signature: inspect.Signature, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> inspect.BoundArguments:
        """``signature.bind``; a call that does not fit is a ``TypeError`` in our words, naming the argument
        (Python's own wording of it follows only as detail)."""
        try:
            return signature.bind(*args, **kwargs)
        except TypeError as exc:
            params = signature.parameters
            unexpected = [name for name in kwargs if name not in params]
            required = [
                name
                for name, p in params.items()
                if p.default is inspect.Parameter.empty
                and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            ]
            given = set(kwargs) | set(list(params)[: len(args)])
            missing = [name for name in required if name not in given]
            positional = [
                p
                for p in params.values()
                if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            ]
            var_positional = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values())
            if len(args) > len(positional) and not var_positional:
                why = f"it takes at most {len(positional)} positional argument(s), got {len(args)}"
            elif unexpected and not self._has_var_kwargs(params):
                why = f"it has no argument {unexpected[0]!r}"
            elif missing:
                why = f"argument {missing[0]!r} is not given"
            else:
                why = "they do not fit its signature"
            raise TypeError(
                f"task {self.task_name!r}: cannot call {self._describe(params)} with these arguments: "
                f"{why} ({exc})"
            ) from None

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The call's arguments by name, with defaults applied (TypeError if they do not fit)."""
        if self.signature is None:
            return dict(kwargs)
        bound = self._bind_call(self.signature, args, kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for name, param in self.signature.parameters.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(arguments.pop(name, {}))
        return arguments

    def render(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The lease key for one call (``InvalidKey`` if an argument cannot be encoded, or if the key is
        one of the library's own: a set's gate)."""
        key = self._render(args, kwargs)
        if key.startswith(RESERVED_PREFIX):
            raise InvalidKey(
                f"task {self.task_name!r}: the key {key!r:.80} starts with {RESERVED_PREFIX!r}, "
                + RESERVED_WHY
            )
        return key

    def _render(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        if self._fixed is not None:
            return normalize_key(self._fixed)
        if self._callable is not None:
            call_args, call_kwargs = self._callable_arguments(args, kwargs)
            if self._callable_signature is not None:
                try:  # only a task taking **kwargs can get here with arguments the callable refuses
                    self._callable_signature.bind(*call_args, **call_kwargs)
                except TypeError as exc:
                    raise InvalidKey(
                        f"task {self.task_name!r}: the key callable {self._callable_text()} cannot take "
                        f"this call's arguments ({exc})"
                    ) from None
            try:
                value = self._callable(*call_args, **call_kwargs)
            except Exception as exc:
                # Its own exception, unchanged (an autoretry_for or a caller may rely on its type), but
                # a traceback in a worker's log says it came from the key, before the body ran.
                if hasattr(exc, "add_note"):  # Python 3.11+
                    exc.add_note(
                        f"raised by the key callable {self._callable_text()} of task {self.task_name!r}: "
                        "the lease was not taken and the body did not run"
                    )
                raise
            if value is None:  # a forgotten return would otherwise give every call the one key "null"
                raise InvalidKey(f"task {self.task_name!r}: the key callable returned None, not a key")
            if not isinstance(value, str):
                value = encode_value(value, argument="key()")
            return normalize_key(value)
        arguments = self.bind(args, kwargs)
        if self._template is not None:
            values = {}
            for field in self._template_fields(self._template, self.task_name):
                if field not in arguments:
                    raise InvalidKey(f"key template {self._template!r} needs argument {field!r}, not given")
                values[field] = encode_value(arguments[field], argument=field)
            return normalize_key(self._template.format(**values))
        parts = [self.task_name]
        for name in self._names:
            if name not in arguments:
                raise InvalidKey(f"key needs argument {name!r}, not given")
            parts.append(encode_value(arguments[name], argument=name))
        return normalize_key(":".join(parts))
