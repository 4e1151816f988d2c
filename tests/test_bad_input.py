# ruff: noqa: E501  (the case tables keep one case per line, as in docs/bad-input.md)
"""Bad input, tried the way a hostile or careless user would, family by family.

Every case asserts the exact exception type and that the message names the offending thing and why.
docs/bad-input.md is the table of these cases (each row names its test id; a test below checks that
every case is in it).
"""

from __future__ import annotations

import datetime as dt
import decimal
import logging
import math
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, Task
from celery.concurrency.thread import TaskPool as ThreadPool
from pymongo import MongoClient

from celery_mongolock import (
    ArgumentsNotComparable,
    ConfigurationError,
    DocumentLock,
    Fail,
    InvalidKey,
    Lease,
    LeaseStore,
    LockContended,
    Queue,
    RateLimit,
    Replace,
    Retry,
    SingletonTask,
    Skip,
    StoreUnavailable,
    Throttle,
    Wait,
    singleton_task,
)
from celery_mongolock.config import read_settings
from celery_mongolock.core.documents.locked import guarded_update
from celery_mongolock.integration.supersede import check_pool
from celery_mongolock.integration.task import _check_task_policies
from celery_mongolock.keys import normalize_key
from celery_mongolock.policies import parse_policy
from celery_mongolock.testing import wait_for

from .workers import ROOT

NAN, INF = math.nan, math.inf
SECRET = "s3cret"  # the password in the URL cases: never in a message

APP = Celery("bad_input", set_as_current=False)


def upload(group_id: int, path: str = "members.csv") -> None:
    """The task body the key specs are declared on."""


def declare(key: Any = None, **options: Any) -> Any:
    return singleton_task(key=key, app=APP, name=f"bad_input.t{uuid.uuid4().hex[:8]}", **options)(upload)


TEMPLATE_TASK = declare("email-group:{group_id}")


def app_task(**attrs: Any) -> None:
    """``@app.task(base=SingletonTask, mongolock_...=...)`` on a new app, checked at ``app.finalize()``."""
    app = Celery("bad_input_app_task", set_as_current=False)
    # shared=False: a shared task that cannot be created would break every app finalized later.
    app.task(base=SingletonTask, name=f"bad_input.a{uuid.uuid4().hex[:8]}", shared=False, **attrs)(upload)
    app.finalize()


def keyed_by(func: Callable[..., Any]) -> Any:
    return declare(func)


def recursive_list() -> list[Any]:
    value: list[Any] = []
    value.append(value)
    return value


def deep_list(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def case(call: Callable[..., Any], error: type[BaseException], names: str, why: str, id: str) -> Any:
    """One row: ``call`` must raise exactly ``error`` whose message contains ``names`` and ``why``."""
    return pytest.param(call, error, names, why, id=id)


def check(call: Callable[[], Any], error: type[BaseException], names: str, why: str) -> BaseException:
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert names in message, message
    assert why in message, message
    assert SECRET not in f"{message} {info.value!r}"
    return info.value


@pytest.fixture(scope="module")
def unreachable() -> Iterator[LeaseStore]:
    """A store whose server does not exist: bad arguments must be refused before any network call."""
    store = LeaseStore("mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=300", operation_timeout=0.5)
    yield store
    store.close()


ARGS = ("call", "error", "names", "why")

# -- 1. lease keys (LeaseStore.acquire, hold, inspect, force_release, wait_free) --------------------------

KEY_CASES = [
    case(lambda s: s.acquire(""), InvalidKey, "lease key", "must not be empty", "empty"),
    case(lambda s: s.acquire(None), InvalidKey, "lease key", "must be a str, got NoneType", "none"),
    case(lambda s: s.acquire(42), InvalidKey, "lease key", "must be a str, got int: 42", "int"),
    case(lambda s: s.acquire(b"k"), InvalidKey, "lease key", "must be a str, got bytes: b'k'", "bytes"),
    case(lambda s: s.acquire(NAN), InvalidKey, "lease key", "must be a str, got float: nan", "nan"),
    case(lambda s: s.acquire(["k"]), InvalidKey, "lease key", "must be a str, got list", "list"),
    case(lambda s: s.acquire("   "), InvalidKey, "lease key", "only whitespace: '   '", "blank"),
    case(lambda s: s.acquire("\n\t"), InvalidKey, "lease key", "only whitespace", "newline-tab"),
    case(lambda s: s.acquire("a\x00b"), InvalidKey, "lease key", "NUL characters: 'a\\x00b'", "nul"),
    case(lambda s: s.acquire("k\ud800"), InvalidKey, "lease key", "not valid Unicode", "lone-surrogate"),
    case(lambda s: s.inspect(""), InvalidKey, "lease key", "must not be empty", "inspect-empty"),
    case(lambda s: s.force_release(None), InvalidKey, "lease key", "got NoneType", "force-release-none"),
    case(lambda s: s.hold("a\x00b").__enter__(), InvalidKey, "lease key", "NUL", "hold-nul"),
    case(
        lambda s: s.acquire("mongolock-set:abc"),
        InvalidKey,
        "lease key 'mongolock-set:abc'",
        "keeps for the gates of Replace",
        "acquire-gate-name",
    ),
    case(
        lambda s: s.hold("mongolock-set:abc").__enter__(),
        InvalidKey,
        "lease key 'mongolock-set:abc'",
        "keeps for the gates of Replace",
        "hold-gate-name",
    ),
    case(lambda s: s.wait_free("", 1), InvalidKey, "lease key", "must not be empty", "wait-free-empty"),
]


@pytest.mark.parametrize(ARGS, KEY_CASES)
def test_bad_lease_keys(unreachable: LeaseStore, call: Any, error: Any, names: str, why: str) -> None:
    check(lambda: call(unreachable), error, names, why)


# -- 2. key specs, refused when the task is declared -------------------------------------------------------

SPEC_CASES = [
    case(lambda: declare("email-group:{gid}"), ConfigurationError, "'gid'", "not an argument of upload(group_id, path)", "template-missing-arg"),
    case(lambda: declare("g:{group_id.__class__}"), ConfigurationError, "{group_id.__class__}", "plain argument name", "template-attribute"),
    case(lambda: declare("{x.__class__}"), ConfigurationError, "{x.__class__}", "plain argument name", "template-attribute-unknown"),
    case(lambda: declare("g:{group_id[0]}"), ConfigurationError, "{group_id[0]}", "no attribute access, indexing", "template-index"),
    case(lambda: declare("g:{0}"), ConfigurationError, "{0}", "positional fields", "template-positional"),
    case(lambda: declare("mongolock-set:{group_id}"), ConfigurationError, "'mongolock-set:{group_id}'", "keeps for the gates of Replace", "template-reserved-prefix"),
    case(lambda: declare("mongolock-set:all"), ConfigurationError, "'mongolock-set:all'", "keeps for the gates of Replace", "fixed-reserved-prefix"),
    case(lambda: declare("g:{}"), ConfigurationError, "{}", "plain argument name", "template-empty-field"),
    case(lambda: declare("g:{ group_id }"), ConfigurationError, "{ group_id }", "plain argument name", "template-spaces"),
    case(lambda: declare("g:{group_id!r}"), ConfigurationError, "{group_id}", "format spec or conversion", "template-conversion"),
    case(lambda: declare("g:{group_id:>10}"), ConfigurationError, "{group_id}", "format spec or conversion", "template-format-spec"),
    case(lambda: declare("g:{group_id"), ConfigurationError, "'g:{group_id'", "is malformed", "template-unclosed"),
    case(lambda: declare("g:}"), ConfigurationError, "'g:}'", "is malformed: a '{' or '}' without its pair", "template-stray-brace"),
    case(lambda: declare("group_idd"), ConfigurationError, "'group_idd'", "is not an argument of upload", "misspelt-name"),
    case(lambda: declare(["group_id", "nope"]), ConfigurationError, "'nope'", "not an argument", "list-unknown-name"),
    case(lambda: declare([]), ConfigurationError, "key lists", "at least one", "list-empty"),
    case(lambda: declare(["group_id", 5]), ConfigurationError, "got 5", "must be argument names", "list-non-name"),
    case(lambda: declare(""), ConfigurationError, "key", "must not be empty", "empty-string"),
    case(lambda: declare("lock\x00x"), InvalidKey, "'lock\\x00x'", "NUL", "fixed-nul"),
    case(lambda: declare("   "), InvalidKey, "'   '", "only whitespace", "fixed-blank"),
    case(lambda: declare(3.5), ConfigurationError, "got float", "key must be None, an argument name", "float"),
    case(lambda: declare(b"k"), ConfigurationError, "got bytes", "key must be None", "bytes"),
    case(lambda: declare({"a": 1}), ConfigurationError, "got dict", "key must be None", "dict"),
    case(lambda: declare(on_contention="sometimes"), ConfigurationError, "on_contention", "got 'sometimes'", "on-contention-name"),
    case(lambda: declare(lease_seconds=0), ConfigurationError, "lease_seconds", "between 0.5 and", "lease-zero"),
    case(lambda: declare(heartbeat_seconds=20), ConfigurationError, "heartbeat_seconds (20)", "at most half", "heartbeat-over-half"),
    case(lambda: declare(min_hold_seconds=-1), ConfigurationError, "min_hold_seconds", "between 0 and", "min-hold-negative"),
    case(lambda: singleton_task(app=APP, base=Task)(upload), ConfigurationError, "base=", "SingletonTask or a subclass", "base-not-singleton"),
    case(lambda: singleton_task(app=APP)(42), ConfigurationError, "got 42", "decorates a function", "not-a-function"),  # type: ignore[type-var]
    case(lambda: declare(lease_second=60), ConfigurationError, "lease_second=", "did you mean lease_seconds=?", "misspelt-option"),
    case(lambda: declare(on_contension="skip"), ConfigurationError, "on_contension=", "did you mean on_contention=?", "misspelt-policy-option"),
    case(lambda: declare(mongolock_key="g"), ConfigurationError, "mongolock_key=", "without the mongolock_ prefix", "prefixed-option"),
    case(lambda: declare(limit=0), ConfigurationError, "limit", "an int from 1 to 1000, got 0", "limit-zero"),
    case(lambda: declare(limit=2.5), ConfigurationError, "limit", "got 2.5", "limit-float"),
    case(lambda: declare("g:{group_id}", keys=("g:{group_id}", "p:{path}")), ConfigurationError, "key= or keys=", "not both", "key-and-keys"),
    case(lambda: declare("g:{group_id}", limit={"g:{group_id}": 3}), ConfigurationError, "limit={...}", "a task with one key= takes limit=N", "limit-dict-with-key"),
    case(lambda: declare(keys=("g:{group_id}", "p:{path}"), limit={"g:{grup_id}": 3}), ConfigurationError, "'g:{grup_id}'", "did you mean 'g:{group_id}'", "limit-dict-unknown-spec"),
    case(lambda: declare(keys=("g:{group_id}", "p:{path}"), limit={"p:{path}": 0}), ConfigurationError, "limit['p:{path}']", "an int from 1 to 1000, got 0", "limit-dict-bad-value"),
    case(lambda: declare(keys=("g:{group_id}", "p:{path}"), limit={"g:{group_id}": 3}, on_contention=Replace(cancel_running=True)), ConfigurationError, "Replace(cancel_running=True) with limit 3 for the key 'g:{group_id}'", "no one running holder", "keys-limit-with-cancel-running"),
    case(lambda: declare(keys=("g:{group_id}", None)), ConfigurationError, "keys=[1] is None", "is for key= only", "keys-none-entry"),
    case(lambda: declare(keys=("g:{group_id}", 7)), ConfigurationError, "keys=[1] is 7", "names one key", "keys-int-entry"),
    case(lambda: declare("g:{group_id}", limit=3, on_contention=Replace(cancel_running=True)), ConfigurationError, "Replace(cancel_running=True) with limit=3", "no one running holder", "limit-with-cancel-running"),
    case(lambda: declare("g:{group_id}", on_contention=Replace(cancel_running=True), rate=Throttle(10, then=Skip())), ConfigurationError, "Replace(cancel_running=True) with rate=Throttle(1 per 10 s)", "neither would finish", "cancel-running-with-a-dropping-rate"),
    case(lambda: app_task(mongolock_key="email-group:{gid}"), ConfigurationError, "'gid'", "not an argument of upload(group_id, path)", "app-task-template-missing-arg"),
    case(lambda: app_task(mongolock_on_contention="skipp"), ConfigurationError, "mongolock_on_contention", "got 'skipp'", "app-task-misspelt-policy"),
    case(lambda: app_task(mongolock_lease_second=60), ConfigurationError, "mongolock_lease_second", "did you mean mongolock_lease_seconds?", "app-task-misspelt-option"),
    case(lambda: declare(unique_send="always"), ConfigurationError, "unique_send", "must be True, False or 'best_effort'", "unique-send-bad-value"),
    case(lambda: declare(unique_send=True, unique_send_seconds=0), ConfigurationError, "unique_send_seconds", "must be above 0", "unique-send-seconds-zero"),
    case(lambda: declare(unique_send=True, unique_send_seconds="1h"), ConfigurationError, "unique_send_seconds", "must be a number of seconds", "unique-send-seconds-str"),
]  # fmt: skip


@pytest.mark.parametrize(ARGS, SPEC_CASES)
def test_bad_key_specs_are_refused_at_declaration(call: Any, error: Any, names: str, why: str) -> None:
    check(call, error, names, why)


# -- 3. task arguments that do not encode into a key --------------------------------------------------------

ARGUMENT_CASES = [
    case(lambda: TEMPLATE_TASK.mongolock_key_for(object()), InvalidKey, "'group_id'", "is an object", "object"),
    case(lambda: TEMPLATE_TASK.mongolock_key_for({1, 2}), InvalidKey, "'group_id'", "is a set", "set"),
    case(lambda: TEMPLATE_TASK.mongolock_key_for(frozenset()), InvalidKey, "'group_id'", "is a frozenset", "frozenset"),
    case(lambda: TEMPLATE_TASK.mongolock_key_for(1.5), InvalidKey, "'group_id'", "is a float (1.5)", "float"),
    case(lambda: TEMPLATE_TASK.mongolock_key_for(NAN), InvalidKey, "'group_id'", "is a float (nan)", "nan"),
    case(lambda: TEMPLATE_TASK.mongolock_key_for(INF), InvalidKey, "'group_id'", "is a float (inf)", "inf"),
    case(lambda: TEMPLATE_TASK.mongolock_key_for(b"42"), InvalidKey, "'group_id'", "is a bytes", "bytes"),
    case(lambda: TEMPLATE_TASK.mongolock_key_for(bytearray(b"4")), InvalidKey, "'group_id'", "is a bytearray", "bytearray"),
    case(lambda: TEMPLATE_TASK.mongolock_key_for(decimal.Decimal("4.2")), InvalidKey, "'group_id'", "is a Decimal", "decimal"),
    case(lambda: TEMPLATE_TASK.mongolock_key_for(dt.datetime(2026, 1, 1)), InvalidKey, "'group_id'", "is a datetime", "datetime"),
    case(lambda: TEMPLATE_TASK.mongolock_key_for({"a": 1.5}), InvalidKey, "'group_id'", "is a float (1.5)", "dict-with-float"),
    case(lambda: TEMPLATE_TASK.mongolock_key_for({"a": {"b": [1, {2: 3}]}}), InvalidKey, "'group_id'", "dict key 2 that is not a str", "dict-int-key"),
    case(lambda: TEMPLATE_TASK.mongolock_key_for([1, {3}]), InvalidKey, "'group_id'", "is a set", "list-with-set"),
    case(lambda: TEMPLATE_TASK.mongolock_key_for(recursive_list()), InvalidKey, "'group_id'", "contains itself", "recursive-list"),
    case(lambda: TEMPLATE_TASK.mongolock_key_for(deep_list(5000)), InvalidKey, "'group_id'", "nested too deeply", "deep-list"),
    case(lambda: TEMPLATE_TASK.mongolock_key_for(10**5000), InvalidKey, "'group_id'", "int too large", "huge-int"),
    case(lambda: TEMPLATE_TASK.mongolock_key_for([10**5000]), InvalidKey, "'group_id'", "cannot be encoded", "huge-int-in-list"),
    case(lambda: TEMPLATE_TASK.mongolock_key_for("a\x00b"), InvalidKey, "'email-group:a\\x00b'", "NUL", "nul-in-str"),
    case(lambda: TEMPLATE_TASK.mongolock_key_for("\ud800"), InvalidKey, "'email-group:\\ud800'", "not valid Unicode", "lone-surrogate"),
    case(lambda: declare("{group_id}").mongolock_key_for("mongolock-set:1"), InvalidKey, "'mongolock-set:1'", "keeps for the gates of Replace", "reserved-prefix"),
    case(TEMPLATE_TASK.mongolock_key_for, TypeError, "cannot call upload(group_id, path) with these arguments", "argument 'group_id' is not given", "missing-argument"),
    case(lambda: TEMPLATE_TASK.mongolock_key_for(1, zzz=2), TypeError, "cannot call upload(group_id, path) with these arguments", "it has no argument 'zzz'", "unexpected-kwarg"),
]  # fmt: skip


@pytest.mark.parametrize(ARGS, ARGUMENT_CASES)
def test_arguments_that_do_not_encode_into_a_key(call: Any, error: Any, names: str, why: str) -> None:
    check(call, error, names, why)


def test_a_run_whose_arguments_do_not_encode_fails_before_its_body() -> None:
    ran: list[object] = []

    def body(group_id: object) -> None:
        ran.append(group_id)

    task = singleton_task(key="g:{group_id}", app=APP, name="bad_input.body")(body)
    result = task.apply(args=(object(),))
    assert result.failed() and isinstance(result.result, InvalidKey) and "'group_id'" in str(result.result)
    assert ran == []


# -- 4. key callables -----------------------------------------------------------------------------------------


def tenant_lookup_fails(group_id: int, **_: Any) -> str:
    raise LookupError(f"no tenant for group {group_id}")


CALLABLE_CASES = [
    case(lambda: keyed_by(lambda group_id, **_: None).mongolock_key_for(1), InvalidKey, "key callable", "returned None", "returns-none"),
    case(lambda: keyed_by(lambda group_id, **_: b"k").mongolock_key_for(1), InvalidKey, "'key()'", "is a bytes", "returns-bytes"),
    case(lambda: keyed_by(lambda group_id, **_: 1.5).mongolock_key_for(1), InvalidKey, "'key()'", "is a float", "returns-float"),
    case(lambda: keyed_by(lambda group_id, **_: object()).mongolock_key_for(1), InvalidKey, "'key()'", "is an object", "returns-object"),
    case(lambda: keyed_by(lambda group_id, **_: "").mongolock_key_for(1), InvalidKey, "lease key", "must not be empty", "returns-empty"),
    case(lambda: keyed_by(lambda group_id, **_: "a\x00").mongolock_key_for(1), InvalidKey, "lease key", "NUL", "returns-nul"),
    case(lambda: keyed_by(tenant_lookup_fails).mongolock_key_for(7), LookupError, "group 7", "no tenant", "raises"),
    case(lambda: keyed_by(lambda: "k"), ConfigurationError, "<lambda>()", "cannot take the arguments of upload(group_id, path)", "wrong-signature"),
    case(lambda: keyed_by(lambda x, y, z: "k"), ConfigurationError, "<lambda>(x, y, z)", "cannot take the arguments of upload(group_id, path)", "unrelated-signature"),
    case(lambda: keyed_by(lambda group_id: "k"), ConfigurationError, "<lambda>(group_id)", "cannot take the arguments of upload(group_id, path)", "too-few-parameters"),
]  # fmt: skip


@pytest.mark.parametrize(ARGS, CALLABLE_CASES)
def test_bad_key_callables(call: Any, error: Any, names: str, why: str) -> None:
    check(call, error, names, why)


# -- 5. MongoDB URLs (LeaseStore(url) and the mongolock_url setting) ------------------------------------------

URL_CASES = [
    pytest.param(42, "got int", id="not-a-string"),
    pytest.param(b"mongodb://h", "got bytes", id="bytes"),
    pytest.param("", "is empty", id="empty"),
    pytest.param("   ", "is empty", id="blank"),
    pytest.param("localhost:27017", "must start with mongodb:// or mongodb+srv://", id="no-scheme"),
    pytest.param("redis://localhost:6379/0", "mongodb+srv:// (this looks like a Celery broker's URL", id="redis-scheme"),
    pytest.param("amqp://guest:guest@localhost:5672//", "mongodb+srv:// (this looks like a Celery broker's URL", id="amqp-scheme"),
    pytest.param("MONGODB://h", "must start with mongodb:// or mongodb+srv://", id="upper-case-scheme"),
    pytest.param(" mongodb://h", "leading or trailing whitespace", id="leading-space"),
    pytest.param(f"mongodb://u:{SECRET}@h:27017\n", "leading or trailing whitespace", id="trailing-newline"),
    pytest.param("mongodb://", "it names no host", id="no-host"),
    pytest.param("mongodb://h:99999", "port '99999' of host 'h:99999' is not a number from 1 to 65535", id="port-range"),
    pytest.param("mongodb://h:port", "port 'port' of host 'h:port' is not a number from 1 to 65535", id="port-text"),
    pytest.param("mongodb://h1,h2,", "has an empty host", id="trailing-comma"),
    pytest.param("mongodb://h/bad$db", "the database name 'bad$db' after the hosts holds '$'", id="bad-database-in-url"),
    pytest.param("mongodb://h/?retryWrits=true", "unknown option 'retryWrits' (did you mean 'retryWrites'?)", id="unknown-option"),
    pytest.param("mongodb://h/?tls=maybe", "option 'tls' has a bad value 'maybe'", id="bad-option-value"),
    pytest.param("mongodb://h/?w=-5", "option 'w' has a bad value '-5'", id="bad-write-concern"),
    pytest.param("mongodb://h/?serverSelectionTimeoutMS=-1", "option 'serverSelectionTimeoutMS' has a bad value '-1'", id="negative-timeout"),
    pytest.param("mongodb://h/?authMechanism=NOPE", "option 'authMechanism' has a bad value 'NOPE'", id="unknown-auth-mechanism"),
    pytest.param(f"mongodb://u:{SECRET}@h/?authSource=", "option 'authSource' is empty", id="empty-auth-source"),
    pytest.param(f"mongodb://u:{SECRET}@x@h", "user name or password holds a character that must be escaped", id="unescaped-at-in-password"),
    pytest.param(f"mongodb://u:{SECRET}%zz@h", "user name or password holds a character that must be escaped", id="bad-percent-escape"),
    pytest.param(f"mongodb://:{SECRET}@h", "the user name before ':' is empty", id="empty-username"),
    pytest.param("mongodb://a,b/?directConnection=true", "directConnection=true connects to one server: it cannot go with several hosts", id="direct-multi"),
    pytest.param("mongodb+srv://cluster.example.net:27017", "a mongodb+srv:// URL names no port", id="srv-port"),
    pytest.param("mongodb+srv://a.example.net,b.example.net", "a mongodb+srv:// URL names exactly one host name, got 2", id="srv-two-hosts"),
    pytest.param(f"mongodb+srv://u:{SECRET}@c.example.net/?retryWrits=1", "unknown option 'retryWrits' (did you mean 'retryWrites'?)", id="srv-unknown-option"),
    pytest.param("mongodb+srv://c.example.net/?directConnection=true", "it cannot go with a mongodb+srv:// URL", id="srv-direct"),
    pytest.param("mongodb://h/?tls=true&tlsCAFile=/nonexistent/ca.pem", "option 'tlsCAFile' names a file that cannot be read: '/nonexistent/ca.pem'", id="missing-ca-file"),
    pytest.param("mongodb://h/?w=1&w=majority", "option 'w' is given twice", id="duplicate-option"),
    pytest.param("mongodb://h/?tls", "option 'tls' is not of the form name=value", id="option-without-value"),
    pytest.param("mongodb://h/?tls=true;w=1&j=true", "mix '&' and ';'", id="mixed-separators"),
    pytest.param("mongodb://h/?tlsInsecure=true&tlsAllowInvalidCertificates=true", "its options do not go together", id="conflicting-options"),
    pytest.param("mongodb://h/?srvMaxHosts=2", "its options do not go together", id="srv-option-without-srv"),
    pytest.param(f"mongodb://u:pa?{SECRET}@h", "an unescaped '?', '/' or ':' in a password?", id="unescaped-question-mark-in-password"),
    pytest.param(f"mongodb://u:{SECRET}@h/?tlsCertificateKeyFilePassword=x&tls=maybe", "option 'tls' has a bad value", id="bad-value-beside-a-secret-option"),
]  # fmt: skip


@pytest.mark.parametrize(("url", "why"), URL_CASES)
def test_bad_urls(url: Any, why: str) -> None:
    """Refused when the store is made or the settings are read, before any connection; never echoing a
    password."""
    check(lambda: read_settings({"mongolock_url": url}), ConfigurationError, "mongolock_url", why)
    names = "MongoDB URL" if isinstance(url, str) else "LeaseStore needs a MongoDB URL"
    check(lambda: LeaseStore(url), ConfigurationError, names, why)


# -- 6. settings (app.conf / Django CELERY_MONGOLOCK_*) ----------------------------------------------------------


def setting(name: str, value: Any, why: str, id: str, *, names: str | None = None, **more: Any) -> Any:
    conf = {name: value, **more}
    return case(lambda: read_settings(conf), ConfigurationError, names or name, why, id)


SETTING_CASES = [
    setting("mongolock_lease_seconds", 0, "between 0.5 and", "lease-zero"),
    setting("mongolock_lease_seconds", -1, "between 0.5 and", "lease-negative"),
    setting("mongolock_lease_seconds", "30", "must be a number of seconds, got str", "lease-str"),
    setting("mongolock_lease_seconds", NAN, "got nan", "lease-nan"),
    setting("mongolock_lease_seconds", INF, "got inf", "lease-inf"),
    setting("mongolock_lease_seconds", True, "got bool", "lease-bool"),
    setting("mongolock_lease_seconds", 0.4, "between 0.5 and", "lease-too-short"),
    setting("mongolock_lease_seconds", 1e12, "between 0.5 and 2.592e+06", "lease-too-long"),
    setting("mongolock_heartbeat_seconds", 0, "between 0.05 and", "heartbeat-zero"),
    setting("mongolock_heartbeat_seconds", "10", "got str", "heartbeat-str"),
    setting("mongolock_heartbeat_seconds", NAN, "got nan", "heartbeat-nan"),
    setting("mongolock_heartbeat_seconds", 30, "at most half of lease_seconds (30)", "heartbeat-equals-lease", mongolock_lease_seconds=30),
    setting("mongolock_heartbeat_seconds", 16, "at most half of lease_seconds (30)", "heartbeat-over-half"),
    setting("mongolock_on_contention", "sometimes", "one of 'retry', 'skip', 'wait', 'fail'", "policy-unknown-name"),
    setting("mongolock_on_contention", "", "got ''", "policy-empty"),
    setting("mongolock_on_contention", 5, "got int", "policy-int"),
    setting("mongolock_on_contention", ["retry"], "got list", "policy-list"),
    setting("mongolock_on_contention", {"timeout": 1}, "needs 'policy'", "policy-dict-without-name"),
    setting("mongolock_on_contention", {"policy": "retry", "countdwn": 1}, "'countdwn'", "policy-dict-unknown-option"),
    setting("mongolock_on_contention", {"policy": "wait", "timeout": -1}, "Wait(timeout=...)", "policy-dict-bad-value"),
    setting("mongolock_on_contention", {"policy": "wait", "then": "wait"}, "Wait(then=...)", "policy-dict-wait-then-wait"),
    setting("mongolock_on_contention", {"policy": "wait", "then": {"policy": "nope"}}, "got 'nope'", "policy-dict-bad-then", names="mongolock_on_contention['then']"),
    setting("mongolock_operation_timeout", 0, "between 0.1 and 3600", "timeout-zero"),
    setting("mongolock_operation_timeout", NAN, "got nan", "timeout-nan"),
    setting("mongolock_operation_timeout", "10", "got str", "timeout-str"),
    setting("mongolock_database", "", "non-empty name", "database-empty"),
    setting("mongolock_database", " ", "non-empty name", "database-blank"),
    setting("mongolock_database", "a.b", "must not contain", "database-dot"),
    setting("mongolock_database", "a b", "must not contain", "database-space"),
    setting("mongolock_database", "$x", "without '$'", "database-dollar"),
    setting("mongolock_database", "a\x00b", "got 'a\\x00b'", "database-nul"),
    setting("mongolock_database", 5, "got 5", "database-int"),
    setting("mongolock_database", "x" * 64, "longer than MongoDB's 63 bytes", "database-too-long"),
    setting("mongolock_database", "local", "'local' is not replicated", "database-local"),
    setting("mongolock_database", "config", "reserved for sharding", "database-config"),
    setting("mongolock_collection", "", "non-empty name", "collection-empty"),
    setting("mongolock_collection", "$x", "without '$'", "collection-dollar"),
    setting("mongolock_collection", ".x", "must not start or end with '.'", "collection-leading-dot"),
    setting("mongolock_collection", "a..b", "contain '..'", "collection-double-dot"),
    setting("mongolock_collection", "system.leases", "'system.' names are reserved", "collection-system"),
    setting("mongolock_collection", "x" * 300, "too long", "collection-too-long"),
    setting("mongolock_task_policies", ["t"], "must be a dict of task name", "task-policies-list"),
    setting("mongolock_task_policies", "skip", "got str", "task-policies-str"),
    setting("mongolock_task_policies", {"": "skip"}, "must be task names, got ''", "task-policies-empty-name"),
    setting("mongolock_task_policies", {5: "skip"}, "must be task names, got 5", "task-policies-int-name"),
    setting("mongolock_task_policies", {"t": 5}, "must be a dict of options, got int", "task-policies-int-options", names="mongolock_task_policies['t']"),
    setting("mongolock_task_policies", {"t": None}, "got NoneType", "task-policies-none-options", names="mongolock_task_policies['t']"),
    setting("mongolock_task_policies", {"t": {"bogus": 1}}, "unknown option(s) ['bogus']", "task-policies-unknown-option", names="mongolock_task_policies['t']"),
    setting("mongolock_task_policies", {"t": {"lease_second": 60}}, "(did you mean 'lease_seconds' for 'lease_second'?)", "task-policies-misspelt-option", names="mongolock_task_policies['t']"),
    setting("mongolock_task_policies", {"t": {"limit": 0}}, "an int from 1 to 1000, got 0", "task-policies-bad-limit", names="mongolock_task_policies['t']['limit']"),
    setting("mongolock_task_policies", {"t": {"keys": "g:{src}"}}, "keys= must be a non-empty list or tuple", "task-policies-bad-keys", names="mongolock_task_policies['t']['keys']"),
    setting("mongolock_task_policies", {"t": {"on_contention": "nope"}}, "got 'nope'", "task-policies-bad-policy", names="mongolock_task_policies['t']['on_contention']"),
    setting("mongolock_task_policies", {"t": {"lease_seconds": -1}}, "lease_seconds must be between", "task-policies-bad-lease", names="task 't'"),
    setting("mongolock_task_policies", {"t": {"heartbeat_seconds": 100}}, "at most half", "task-policies-heartbeat-over-half", names="task 't'"),
    setting("mongolock_task_policies", {"t": {"min_hold_seconds": -1}}, "between 0 and", "task-policies-bad-min-hold", names="mongolock_task_policies['t']['min_hold_seconds']"),
    setting("mongolock_task_policies", {"t": {"unique_send": "always"}}, "must be True, False or 'best_effort'", "task-policies-bad-unique-send", names="mongolock_task_policies['t']['unique_send']"),
    setting("mongolock_task_policies", {"t": {"unique_send_seconds": -1}}, "must be above 0", "task-policies-bad-unique-send-seconds", names="mongolock_task_policies['t']['unique_send_seconds']"),
    setting("mongolock_watch_leases", "no", "must be True or False, got 'no'", "watch-leases-str"),
    setting("mongolock_watch_leases", 0, "must be True or False, got 0", "watch-leases-int"),
    setting("mongolock_handoff_lane", "yes", "must be True or False, got 'yes'", "handoff-lane-str"),
]  # fmt: skip


@pytest.mark.parametrize(ARGS, SETTING_CASES)
def test_bad_settings(call: Any, error: Any, names: str, why: str) -> None:
    check(call, error, names, why)


def test_unknown_task_names_in_task_policies_are_reported_when_the_worker_starts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = Celery("bad_input_policies", set_as_current=False)
    app.conf.mongolock_task_policies = {"proj.tasks.uplaod": "skip", "proj.tasks.upload": "skip"}
    singleton_task(app=app, name="proj.tasks.upload")(upload)
    with caplog.at_level(logging.WARNING, logger="celery_mongolock.acquire"):
        assert _check_task_policies(app) == ["proj.tasks.uplaod"]
    assert (
        "mongolock_task_policies names task(s) this worker does not have: 'proj.tasks.uplaod'" in caplog.text
    )


# -- 7. contention policies ------------------------------------------------------------------------------------

POLICY_CASES = [
    case(lambda: Retry(countdown=-1), ConfigurationError, "Retry(countdown=...)", "from 0 to", "retry-negative-countdown"),
    case(lambda: Retry(countdown=NAN), ConfigurationError, "Retry(countdown=...)", "got nan", "retry-nan-countdown"),
    case(lambda: Retry(countdown="1"), ConfigurationError, "Retry(countdown=...)", "got '1'", "retry-str-countdown"),  # type: ignore[arg-type]
    case(lambda: Retry(countdown=True), ConfigurationError, "Retry(countdown=...)", "got True", "retry-bool-countdown"),
    case(lambda: Retry(backoff=0.5), ConfigurationError, "Retry(backoff=...)", "from 1 to 1000", "retry-shrinking-backoff"),
    case(lambda: Retry(backoff=1e308), ConfigurationError, "Retry(backoff=...)", "from 1 to 1000", "retry-huge-backoff"),
    case(lambda: Retry(max_countdown=INF), ConfigurationError, "Retry(max_countdown=...)", "got inf", "retry-inf-max-countdown"),
    case(lambda: Retry(max_countdown=1e300), ConfigurationError, "Retry(max_countdown=...)", "from 0 to 2.592e+06", "retry-huge-max-countdown"),
    case(lambda: Retry(max_retries=-1), ConfigurationError, "Retry(max_retries=...)", "None or an int >= 0", "retry-negative-max-retries"),
    case(lambda: Retry(max_retries=1.5), ConfigurationError, "Retry(max_retries=...)", "got 1.5", "retry-float-max-retries"),  # type: ignore[arg-type]
    case(lambda: Retry(max_retries="3"), ConfigurationError, "Retry(max_retries=...)", "got '3'", "retry-str-max-retries"),  # type: ignore[arg-type]
    case(lambda: Retry(jitter="no"), ConfigurationError, "Retry(jitter=...)", "True or False, got 'no'", "retry-str-jitter"),  # type: ignore[arg-type]
    case(lambda: Wait(timeout=-1), ConfigurationError, "Wait(timeout=...)", "from 0 to", "wait-negative-timeout"),
    case(lambda: Wait(timeout=INF), ConfigurationError, "Wait(timeout=...)", "got inf", "wait-inf-timeout"),
    case(lambda: Wait(timeout=NAN), ConfigurationError, "Wait(timeout=...)", "got nan", "wait-nan-timeout"),
    case(lambda: Wait(timeout="10"), ConfigurationError, "Wait(timeout=...)", "got '10'", "wait-str-timeout"),  # type: ignore[arg-type]
    case(lambda: Wait(then=Wait()), ConfigurationError, "Wait(then=...)", "Retry(), Skip() or Fail()", "wait-then-wait"),
    case(lambda: Wait(then="later"), ConfigurationError, "Wait(then=...)", "got 'later'", "wait-then-str"),  # type: ignore[arg-type]
    case(lambda: Wait(then=None), ConfigurationError, "Wait(then=...)", "got None", "wait-then-none"),  # type: ignore[arg-type]
    case(lambda: Wait(then=Queue()), ConfigurationError, "Wait(then=...)", "got Queue(", "wait-then-queue"),
    case(lambda: Queue(timeout=-1), ConfigurationError, "Queue(timeout=...)", "from 0 to", "queue-negative-timeout"),
    case(lambda: Queue(max_length=0), ConfigurationError, "Queue(max_length=...)", "None or an int >= 1, got 0", "queue-zero-max-length"),
    case(lambda: Queue(max_length=2.5), ConfigurationError, "Queue(max_length=...)", "got 2.5", "queue-float-max-length"),  # type: ignore[arg-type]
    case(lambda: Queue(then=Retry()), ConfigurationError, "Queue(then=...)", "Skip() or Fail()", "queue-then-retry"),
    case(lambda: Queue(then=Wait()), ConfigurationError, "Queue(then=...)", "Skip() or Fail()", "queue-then-wait"),
    case(lambda: Replace(max_length=3), ConfigurationError, "Replace()", "at most one run per key", "replace-max-length"),
    case(lambda: Replace(timeout=NAN), ConfigurationError, "Replace(timeout=...)", "got nan", "replace-nan-timeout"),
    case(lambda: Replace(cancel_running=True, grace=-1), ConfigurationError, "Replace(grace=...)", "from 0 to", "replace-negative-grace"),
    case(lambda: Replace(grace=5), ConfigurationError, "Replace(grace=5)", "needs cancel_running=True", "replace-grace-without-cancel-running"),
    case(lambda: Replace(cancel_running="yes"), ConfigurationError, "Replace(cancel_running=...)", "True or False, got 'yes'", "replace-cancel-running-not-bool"),  # type: ignore[arg-type]
    case(lambda: Replace(cancel_running=True, debounce=5), ConfigurationError, "Replace(cancel_running=True, debounce=5)", "cannot cancel the running holder", "replace-cancel-running-with-debounce"),
    case(lambda: parse_policy({"policy": "queue", "cancel_running": True}, "on_contention"), ConfigurationError, "'cancel_running'", "an option of 'replace' only", "policy-dict-cancel-running-on-queue"),
    case(lambda: Replace(fail_superseded="yes"), ConfigurationError, "Replace(fail_superseded=...)", "True or False, got 'yes'", "replace-fail-superseded-not-bool"),  # type: ignore[arg-type]
    case(lambda: parse_policy({"policy": "queue", "fail_superseded": True}, "on_contention"), ConfigurationError, "'fail_superseded'", "an option of 'replace' only", "policy-dict-fail-superseded-on-queue"),
    case(lambda: check_pool(ThreadPool, [("proj.upload", Replace(cancel_running=True))]), ConfigurationError, "'proj.upload'", "the 'thread' pool runs bodies in the worker's own process", "cancel-running-on-threads-pool"),
    case(lambda: Replace(max_wait=10), ConfigurationError, "Replace(max_wait=10)", "needs debounce=", "replace-max-wait-without-debounce"),
    case(lambda: Replace(debounce=5, max_wait=2), ConfigurationError, "Replace(max_wait=2)", "at least debounce=5", "replace-max-wait-below-debounce"),
    case(lambda: Replace(debounce=5, max_wait=-1), ConfigurationError, "Replace(max_wait=...)", "got -1", "replace-negative-max-wait"),
    case(lambda: parse_policy({"policy": "queue", "then": "retry"}, "on_contention"), ConfigurationError, "on_contention", "Skip() or Fail()", "policy-dict-queue-then-retry"),
    case(lambda: parse_policy({"policy": "queue", "timout": 5}, "on_contention"), ConfigurationError, "on_contention", "timeout", "policy-dict-queue-misspelt"),
    case(lambda: parse_policy(Retry, "on_contention"), ConfigurationError, "on_contention", "got type", "policy-class-not-instance"),
    case(lambda: parse_policy("retry()", "on_contention"), ConfigurationError, "on_contention", "got 'retry()'", "policy-call-syntax"),
]  # fmt: skip


@pytest.mark.parametrize(ARGS, POLICY_CASES)
def test_bad_policies(call: Any, error: Any, names: str, why: str) -> None:
    check(call, error, names, why)


# -- 7b. rates of starts (RateLimit, Throttle, rate=) -------------------------------------------------------

RATE_CASES = [
    case(lambda: RateLimit(0, 60), ConfigurationError, "RateLimit(n=...)", "an int from 1 to 1000, got 0", "rate-zero-n"),
    case(lambda: RateLimit(2.5, 60), ConfigurationError, "RateLimit(n=...)", "got 2.5", "rate-float-n"),  # type: ignore[arg-type]
    case(lambda: RateLimit(5, 0), ConfigurationError, "RateLimit(period=...)", "above 0", "rate-zero-period"),
    case(lambda: RateLimit(5, -1), ConfigurationError, "RateLimit(period=...)", "got -1", "rate-negative-period"),
    case(lambda: RateLimit(5, INF), ConfigurationError, "RateLimit(period=...)", "got inf", "rate-inf-period"),
    case(lambda: Throttle(0), ConfigurationError, "Throttle(period=...)", "above 0", "throttle-zero-period"),
    case(lambda: RateLimit(5, 60, then=Fail()), ConfigurationError, "RateLimit(then=...)", "None (park the run", "rate-then-fail"),
    case(lambda: singleton_task(app=APP, rate={"n": 5, "period": 60, "burst": 2})(upload), ConfigurationError, "rate: unknown key(s) ['burst']", "a rate takes 'n' and 'period'", "rate-dict-unknown-key"),
    case(lambda: singleton_task(app=APP, rate="5/min")(upload), ConfigurationError, "rate must be", "got str", "rate-str"),  # type: ignore[call-overload]
    setting("mongolock_task_policies", {"t": {"rate": {"n": 0, "period": 60}}}, "an int from 1 to 1000, got 0", "task-policies-bad-rate", names="mongolock_task_policies['t']['rate']"),
]  # fmt: skip


@pytest.mark.parametrize(ARGS, RATE_CASES)
def test_bad_rates(call: Any, error: Any, names: str, why: str) -> None:
    check(call, error, names, why)


# -- 8. LeaseStore(...) arguments --------------------------------------------------------------------------------

URL = "mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=300"


def store(**kwargs: Any) -> Callable[[], Any]:
    return lambda: LeaseStore(kwargs.pop("url", URL), **kwargs)


STORE_CASES = [
    case(lambda: LeaseStore(None), ConfigurationError, "LeaseStore", "got NoneType", "url-none"),  # type: ignore[arg-type]
    case(lambda: LeaseStore(b"mongodb://h"), ConfigurationError, "LeaseStore", "got bytes", "url-bytes"),  # type: ignore[arg-type]
    case(store(database=""), ConfigurationError, "database name ''", "not a valid MongoDB database name", "database-empty"),
    case(store(database="a.b"), ConfigurationError, "database name 'a.b'", "must not contain", "database-dot"),
    case(store(database="x" * 64), ConfigurationError, "database name", "63 bytes", "database-too-long"),
    case(store(database="local"), ConfigurationError, "database 'local'", "not replicated", "database-local"),
    case(store(database=None), ConfigurationError, "database name None", "not a valid", "database-none"),
    case(store(collection="$x"), ConfigurationError, "collection name '$x'", "not a valid MongoDB collection name", "collection-dollar"),
    case(store(collection=" leases"), ConfigurationError, "collection name ' leases'", "not a valid", "collection-padded"),
    case(store(collection="x."), ConfigurationError, "collection name 'x.'", "start or end with '.'", "collection-trailing-dot"),
    case(store(collection="system.js"), ConfigurationError, "collection name 'system.js'", "reserved", "collection-system"),
    case(store(lease_seconds=0), ConfigurationError, "lease_seconds", "between 0.5 and", "lease-zero"),
    case(store(lease_seconds=-1), ConfigurationError, "lease_seconds", "between 0.5 and", "lease-negative"),
    case(store(lease_seconds=NAN), ConfigurationError, "lease_seconds", "got nan", "lease-nan"),
    case(store(lease_seconds=INF), ConfigurationError, "lease_seconds", "got inf", "lease-inf"),
    case(store(lease_seconds="30"), ConfigurationError, "lease_seconds", "got str", "lease-str"),
    case(store(lease_seconds=10, heartbeat_seconds=6), ConfigurationError, "heartbeat_seconds (6)", "at most half of lease_seconds (10)", "heartbeat-over-half"),
    case(store(heartbeat_seconds=0), ConfigurationError, "heartbeat_seconds", "between 0.05 and", "heartbeat-zero"),
    case(store(operation_timeout=0), ConfigurationError, "operation_timeout", "between 0.1 and 3600", "timeout-zero"),
    case(store(operation_timeout=INF), ConfigurationError, "operation_timeout", "got inf", "timeout-inf"),
    case(store(write_concern="majority"), ConfigurationError, "write_concern", "pymongo WriteConcern, got str", "write-concern-str"),
    case(store(read_preference="primary"), ConfigurationError, "read_preference", "got str", "read-preference-str"),
    case(store(client_options=["tls"]), ConfigurationError, "client_options", "got list", "client-options-list"),
    case(store(client_options={"tls": "maybe"}), ConfigurationError, "client_options", "option 'tls' has a bad value 'maybe'", "client-option-bad-value"),
    case(store(client_options={"bogus": 1}), ConfigurationError, "client_options", "unknown option 'bogus'", "client-option-unknown"),
    case(store(client_options={"retryWrits": True}), ConfigurationError, "client_options", "unknown option 'retryWrits' (did you mean 'retryWrites'?)", "client-option-misspelt"),
    case(store(watch_leases="yes"), ConfigurationError, "watch_leases", "must be True or False, got 'yes'", "watch-leases-str"),
]  # fmt: skip


@pytest.mark.parametrize(ARGS, STORE_CASES)
def test_bad_store_arguments(call: Any, error: Any, names: str, why: str) -> None:
    check(call, error, names, why)


# -- 9. acquire / hold / list / wait_free / release_held_by arguments --------------------------------------------


def hold(s: LeaseStore, **kwargs: Any) -> None:
    with s.hold("k", **kwargs):
        pass


def nested(s: LeaseStore, **kwargs: Any) -> None:
    """A hold of "k" inside one this thread holds already (ttl 30 s, heartbeat 5 s, a single lease): the
    outer lease is noted as held without a server (reentry is decided before any command)."""
    outer = Lease(
        s,
        "k",
        "outer",
        fence=1,
        ttl=30.0,
        heartbeat_seconds=5.0,
        expires_at=None,
        sent_at=s.clock.monotonic(),
        holder={},
    )
    s.holds.add(outer, None)
    try:
        hold(s, **kwargs)
    finally:
        s.holds.forget(outer)


ACQUIRE_CASES = [
    case(lambda s: s.acquire("k", ttl=0), ConfigurationError, "ttl must be", "between 0.5 and", "ttl-zero"),
    case(lambda s: s.acquire("k", ttl=-1), ConfigurationError, "ttl must be", "between 0.5 and", "ttl-negative"),
    case(lambda s: s.acquire("k", ttl=NAN), ConfigurationError, "ttl must be", "got nan", "ttl-nan"),
    case(lambda s: s.acquire("k", ttl=INF), ConfigurationError, "ttl must be", "got inf", "ttl-inf"),
    case(lambda s: s.acquire("k", ttl="30"), ConfigurationError, "ttl must be", "got str", "ttl-str"),
    case(lambda s: s.acquire("k", ttl=True), ConfigurationError, "ttl must be", "got bool", "ttl-bool"),
    case(lambda s: s.acquire("k", ttl=1e9), ConfigurationError, "ttl must be", "between 0.5 and 2.592e+06", "ttl-huge"),
    case(lambda s: s.acquire("k", ttl=1, heartbeat_seconds=5), ConfigurationError, "heartbeat_seconds (5)", "at most half of ttl (1)", "heartbeat-over-half"),
    case(lambda s: s.acquire("k", heartbeat_seconds=NAN), ConfigurationError, "heartbeat_seconds", "got nan", "heartbeat-nan"),
    case(lambda s: s.acquire("k", info=["a"]), ConfigurationError, "holder info", "must be a dict, got list", "info-not-a-dict"),
    case(lambda s: s.acquire("k", info={"$where": 1}), ConfigurationError, "holder info key '$where'", "plain non-empty string", "info-dollar-key"),
    case(lambda s: s.acquire("k", info={"a.b": 1}), ConfigurationError, "holder info key 'a.b'", "plain non-empty string", "info-dotted-key"),
    case(lambda s: s.acquire("k", info={"": 1}), ConfigurationError, "holder info key ''", "plain non-empty string", "info-empty-key"),
    case(lambda s: s.acquire("k", info={1: 1}), ConfigurationError, "holder info key 1", "plain non-empty string", "info-int-key"),
    case(lambda s: s.acquire("k", info={"blob": "x" * 10_000}), ConfigurationError, "holder info", "the limit is 4096", "info-oversized"),
    case(lambda s: s.acquire("k", info={"obj": object()}), ConfigurationError, "holder info", "cannot be stored in MongoDB", "info-unencodable"),
    case(lambda s: s.acquire("k", min_hold=-1), ConfigurationError, "min_hold", "between 0 and", "min-hold-negative"),
    case(lambda s: s.acquire("k", tick="1"), ConfigurationError, "tick", "must be an int, got str", "tick-str"),
    case(lambda s: s.acquire("k", tick=True), ConfigurationError, "tick", "got bool", "tick-bool"),
    case(lambda s: s.acquire("k", hold_until_ms="x"), ConfigurationError, "hold_until_ms", "got str", "hold-until-str"),
    case(lambda s: s.acquire("k", hold_until_ms=1.5), ConfigurationError, "hold_until_ms", "got float", "hold-until-float"),
    case(lambda s: hold(s, wait=-1), ConfigurationError, "wait", "between 0 and", "hold-wait-negative"),
    case(lambda s: hold(s, wait=NAN), ConfigurationError, "wait", "got nan", "hold-wait-nan"),
    case(lambda s: hold(s, wait=INF), ConfigurationError, "wait", "got inf", "hold-wait-inf"),
    case(lambda s: hold(s, wait=None), ConfigurationError, "wait", "got NoneType", "hold-wait-none"),
    case(lambda s: hold(s, reentrant="yes"), ConfigurationError, "reentrant", "True or False, got str", "hold-reentrant-str"),
    case(lambda s: s.acquire("k", reentrant=1), ConfigurationError, "reentrant", "True or False, got int", "acquire-reentrant-int"),
    case(lambda s: s.acquire("k", reentrant=True, tick=5), ConfigurationError, "reentrant=True", "never reentered", "acquire-reentrant-tick"),
    case(lambda s: s.acquire("k", reentrant=True, min_hold=1), ConfigurationError, "reentrant=True", "never reentered", "acquire-reentrant-min-hold"),
    case(lambda s: nested(s, ttl=60), ConfigurationError, "ttl=60", "outer hold has ttl=30", "reentrant-other-ttl"),
    case(lambda s: nested(s, heartbeat_seconds=1), ConfigurationError, "heartbeat_seconds=1", "outer hold has heartbeat_seconds=5", "reentrant-other-heartbeat"),
    case(lambda s: nested(s, limit=3), ConfigurationError, "limit=3", "outer hold is a single lease", "reentrant-other-limit"),
    case(lambda s: nested(s, ttl="abc"), ConfigurationError, "ttl must be", "got str", "reentrant-ttl-str"),
    case(lambda s: nested(s, ttl="30"), ConfigurationError, "ttl must be", "got str", "reentrant-ttl-str-number"),
    case(lambda s: hold(s, poll_interval=-1), ConfigurationError, "poll_interval", "between 0.001 and", "hold-poll-negative"),
    case(lambda s: hold(s, poll_interval=NAN), ConfigurationError, "poll_interval", "got nan", "hold-poll-nan"),
    case(lambda s: nested(s, max_poll_interval="x"), ConfigurationError, "max_poll_interval", "got str", "reentrant-max-poll-str"),
    case(lambda s: s.list(5), ConfigurationError, "prefix", "must be a str, got int", "list-prefix-int"),
    case(lambda s: s.wait_free("k", "1"), ConfigurationError, "timeout", "got '1'", "wait-free-str-timeout"),
    case(lambda s: s.wait_free("k", NAN), ConfigurationError, "timeout", "got nan", "wait-free-nan-timeout"),
    case(lambda s: s.release_held_by(), ConfigurationError, "release_held_by", "at least one holder field", "release-held-by-nothing"),
]  # fmt: skip


@pytest.mark.parametrize(ARGS, ACQUIRE_CASES)
def test_bad_acquire_arguments(unreachable: LeaseStore, call: Any, error: Any, names: str, why: str) -> None:
    check(lambda: call(unreachable), error, names, why)


# -- 9b. DocumentLock (a lock inside the document it protects) ------------------------------------------------
# A client that never connects (no I/O, nothing to close): every case is refused before a command is sent.
DOC_CLIENT: MongoClient[dict[str, Any]] = MongoClient("mongodb://127.0.0.1:1", connect=False)
DOC_STORE = LeaseStore(DOC_CLIENT, database="shop")
INVOICES = DOC_CLIENT["shop"]["invoices"]


def doc_lock(target: Any = 1, collection: Any = INVOICES, **kwargs: Any) -> Any:
    return DocumentLock(collection, target, store=DOC_STORE, **kwargs)


def other_deployment() -> Any:
    return doc_lock(collection=MongoClient("mongodb://192.0.2.1:27999", connect=False)["shop"]["invoices"])


DOCUMENT_LOCK_CASES = [
    case(lambda: doc_lock({"state": "open"}), ConfigurationError, "the document given has no _id", "insert it first", "document-without-id"),
    case(lambda: doc_lock(None), ConfigurationError, "DocumentLock needs the document's _id", "got None", "id-none"),
    case(lambda: doc_lock(object()), ConfigurationError, "the _id <object object", "cannot be sent to MongoDB", "id-unencodable"),
    case(lambda: doc_lock(collection=DOC_CLIENT["elsewhere"]["invoices"]), ConfigurationError, "elsewhere.invoices is in database 'elsewhere'", "a document lock lives in its store's database", "another-database"),
    case(other_deployment, ConfigurationError, "the collection shop.invoices", "is on another MongoDB deployment than the store", "another-deployment"),
    case(lambda: doc_lock(collection="invoices"), ConfigurationError, "DocumentLock", "needs a pymongo Collection, got str", "not-a-collection"),
    case(lambda: doc_lock(field="lock.owner"), ConfigurationError, "the document lock's field", "plain top-level field name other than _id, got 'lock.owner'", "field-dotted"),
    case(lambda: doc_lock(field="_id"), ConfigurationError, "the document lock's field", "other than _id, got '_id'", "field-id"),
    case(lambda: doc_lock(ttl=0), ConfigurationError, "ttl must be", "between 0.5 and", "ttl-zero"),
    case(lambda: doc_lock(wait=-1), ConfigurationError, "wait", "between 0 and", "wait-negative"),
    case(lambda: DocumentLock(INVOICES, 1, store=None), ConfigurationError, "DocumentLock(store=...)", "got NoneType", "store-none"),  # type: ignore[arg-type]
    case(lambda: guarded_update("mongolock", {"state": "paid"}), ConfigurationError, "DocumentLock.update_one", "with operators ($set, $inc, ...), not a document", "update-a-document"),
    case(lambda: guarded_update("mongolock", {"$set": {"mongolock.owner": "me"}}), ConfigurationError, "the lock's own field 'mongolock'", "may not write", "update-the-lock-field"),
    case(lambda: guarded_update("mongolock", {"$rename": {"state": "mongolock"}}), ConfigurationError, "the lock's own field 'mongolock' ($rename)", "may not write", "update-rename-onto-the-lock"),
    case(lambda: guarded_update("mongolock", [{"$replaceWith": {"a": 1}}]), ConfigurationError, "pipelines of $set, $addFields and $unset stages only", "others could drop the lock's field", "update-replace-pipeline"),
]  # fmt: skip


@pytest.mark.parametrize(ARGS, DOCUMENT_LOCK_CASES)
def test_bad_document_lock_arguments(call: Any, error: Any, names: str, why: str) -> None:
    check(call, error, names, why)


# -- 9c. helpers: metrics.enable, testing.wait_for -----------------------------------------------------------
# Refused before anything is set up (no multiprocess directory, no signal handler connected).


def enable_metrics(port: Any) -> None:
    from celery_mongolock import metrics

    metrics.enable(port=port)


HELPER_CASES = [
    case(lambda: enable_metrics(70000), ConfigurationError, "metrics.enable(port=...)", "an int from 1 to 65535", "metrics-port-too-high"),
    case(lambda: enable_metrics(0), ConfigurationError, "metrics.enable(port=...)", "got 0", "metrics-port-zero"),
    case(lambda: enable_metrics(-1), ConfigurationError, "metrics.enable(port=...)", "got -1", "metrics-port-negative"),
    case(lambda: enable_metrics("x"), ConfigurationError, "metrics.enable(port=...)", "got 'x'", "metrics-port-str"),
    case(lambda: enable_metrics(True), ConfigurationError, "metrics.enable(port=...)", "got True", "metrics-port-bool"),
    case(lambda: wait_for(bool, timeout=-1), ConfigurationError, "wait_for(timeout=...)", "0 or more, got -1", "wait-for-negative-timeout"),
    case(lambda: wait_for(bool, timeout="x"), ConfigurationError, "wait_for(timeout=...)", "a finite number of seconds", "wait-for-str-timeout"),  # type: ignore[arg-type]
    case(lambda: wait_for(bool, timeout=NAN), ConfigurationError, "wait_for(timeout=...)", "got nan", "wait-for-nan-timeout"),
    case(lambda: wait_for(bool, interval=0), ConfigurationError, "wait_for(interval=...)", "above 0, got 0", "wait-for-zero-interval"),
]  # fmt: skip


@pytest.mark.parametrize(ARGS, HELPER_CASES)
def test_bad_helper_arguments(call: Any, error: Any, names: str, why: str) -> None:
    check(call, error, names, why)


# -- 10. the command line ----------------------------------------------------------------------------------------

CLI_CASES = [
    pytest.param(["release", "email-group:42"], "--force", "repeat with --force", id="release-without-force"),
    pytest.param(["release", "--force"], "KEY", "mongolock release needs KEY, the lease key", id="release-without-key"),
    pytest.param(["inspect"], "KEY", "mongolock inspect needs KEY, the lease key", id="inspect-without-key"),
    pytest.param(["release", "", "--force"], "lease key", "must not be empty", id="release-empty-key"),
    pytest.param(["inspect", "   "], "lease key", "only whitespace", id="inspect-blank-key"),
    pytest.param(["watch", "--interval", "0"], "--interval", "must be a number of at least 0.1 seconds, got '0'", id="watch-interval-zero"),
    pytest.param(["list", "--bogus"], "'--bogus'", "mongolock list has no option", id="unknown-option"),
    pytest.param(["list", "--prefx", "x"], "'--prefx'", "(did you mean '--prefix'?)", id="misspelt-option"),
    pytest.param(["unlock", "k"], "'unlock'", "mongolock has no command", id="unknown-command"),
    pytest.param(["inspect", "a", "b"], "'b'", "mongolock inspect takes no more arguments", id="extra-argument"),
    pytest.param(["inspect", "k", "--collection", "invoices", "--id", "1"], "KEY or --collection/--id", "not both", id="key-and-document"),
    pytest.param(["release", "--collection", "invoices"], "--collection and one of --id, --id-json", "a document lock needs", id="document-without-id"),
    pytest.param(["inspect", "--collection", "invoices", "--id", "1", "--id-json", "1"], "one of --id, --id-json", "a document lock needs", id="document-two-ids"),
    pytest.param(["inspect", "--collection", "other.invoices", "--id", "1"], "--collection 'other.invoices'", "lives in the store's database", id="document-other-database"),
    pytest.param(["inspect", "--collection", "invoices", "--id-json", "{oops"], "--id-json '{oops'", "is not MongoDB Extended JSON", id="document-bad-id-json"),
    pytest.param(["inspect", "--collection", "invoices", "--id", "1", "--field", "a.b"], "the document lock's field", "plain top-level field name", id="document-bad-field"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "names", "why"), CLI_CASES)
def test_bad_command_line_arguments(argv: list[str], names: str, why: str) -> None:
    """``celery -A app mongolock ...`` exits non-zero with a one-line error, no traceback; nothing is
    released."""
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.integration_app", "mongolock", *argv],
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "MONGOLOCK_IT_MONGODB_URL": f"mongodb://ops:{SECRET}@127.0.0.1:1/?serverSelectionTimeoutMS=300",
            "MONGOLOCK_IT_OP_TIMEOUT": "0.5",
        },
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert out.returncode != 0
    assert names in out.stderr and why in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and SECRET not in out.stdout + out.stderr


# -- 11. hostile but valid: accepted, stored as documented ----------------------------------------------------


@pytest.mark.parametrize(
    ("key", "stored"),
    [
        pytest.param("$where", "$where", id="dollar-key"),
        pytest.param("a.b.c", "a.b.c", id="dotted-key"),
        pytest.param("{json: 1}", "{json: 1}", id="braces-key"),
        pytest.param("../../etc/passwd", "../../etc/passwd", id="path-key"),
        pytest.param("grüße:ключ:键:🔒", "grüße:ключ:键:🔒", id="unicode-key"),
        pytest.param("x" * 200, "x" * 200, id="key-at-limit"),
        pytest.param("tenant:" + "x" * 16_000_000, None, id="huge-key-hashed"),
    ],
)
def test_hostile_but_valid_keys_are_stored_as_documented(
    store: LeaseStore, key: str, stored: str | None
) -> None:
    lease = store.acquire(key)
    assert lease is not None
    expected = stored if stored is not None else normalize_key(key)
    assert lease.key == expected and len(expected.encode()) <= 200
    if stored is None:
        assert re.fullmatch(r"tenant:x{113}~sha256:[0-9a-f]{64}", expected)
    info = store.inspect(key)
    assert info is not None and info.key == expected and info.held
    with pytest.raises(LockContended), store.hold(key, wait=0):
        pass
    assert lease.release()


@pytest.mark.parametrize(
    ("value", "key"),
    [
        pytest.param(None, "email-group:null", id="none-argument"),
        pytest.param("", "email-group:", id="empty-argument"),
        pytest.param((1, "a"), 'email-group:[1,"a"]', id="tuple-argument"),
        pytest.param({"b": 1, "a": [True]}, 'email-group:{"a":[true],"b":1}', id="dict-argument"),
        pytest.param(
            uuid.UUID(int=1), "email-group:00000000-0000-0000-0000-000000000001", id="uuid-argument"
        ),
        pytest.param(-(10**40), f"email-group:-{10**40}", id="big-int-argument"),
    ],
)
def test_odd_but_encodable_arguments(value: Any, key: str) -> None:
    assert TEMPLATE_TASK.mongolock_key_for(value) == key


# -- the table --------------------------------------------------------------------------------------------


# -- sends of a unique_send task ----------------------------------------------------------------------------

UNIQUE_APP = Celery("bad_input_unique", set_as_current=False)
UNIQUE_APP.conf.update(
    broker_url="memory://",
    mongolock_url="mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=300",
    mongolock_operation_timeout=0.5,
)
UNIQUE_TASK = singleton_task(
    key="email-group:{group_id}", app=UNIQUE_APP, name="bad_input.unique", unique_send=True
)(upload)

UNIQUE_SEND_CASES = [
    case(lambda: UNIQUE_TASK.delay(7, {"a.csv"}), ArgumentsNotComparable, "argument 'path'", "is a set", "set-argument"),
    case(lambda: UNIQUE_TASK.delay(7, dt.datetime(2026, 1, 1)), ArgumentsNotComparable, "argument 'path'", "is a datetime", "datetime-argument"),
    case(lambda: UNIQUE_TASK.delay(7, {"rows": [NAN]}), ArgumentsNotComparable, "argument 'path'['rows'][0]", "is nan", "nan-argument"),
    case(lambda: UNIQUE_TASK.delay(7), StoreUnavailable, "has unique_send: the send was not published", "unique_send='best_effort'", "mongodb-unreachable"),
]  # fmt: skip


@pytest.mark.parametrize(ARGS, UNIQUE_SEND_CASES)
def test_bad_unique_sends(call: Any, error: Any, names: str, why: str) -> None:
    check(call, error, names, why)


FAMILIES: dict[str, list[Any]] = {
    "test_bad_lease_keys": KEY_CASES,
    "test_bad_key_specs_are_refused_at_declaration": SPEC_CASES,
    "test_arguments_that_do_not_encode_into_a_key": ARGUMENT_CASES,
    "test_bad_key_callables": CALLABLE_CASES,
    "test_bad_urls": URL_CASES,
    "test_bad_settings": SETTING_CASES,
    "test_bad_policies": POLICY_CASES,
    "test_bad_rates": RATE_CASES,
    "test_bad_store_arguments": STORE_CASES,
    "test_bad_acquire_arguments": ACQUIRE_CASES,
    "test_bad_document_lock_arguments": DOCUMENT_LOCK_CASES,
    "test_bad_helper_arguments": HELPER_CASES,
    "test_bad_command_line_arguments": CLI_CASES,
    "test_bad_unique_sends": UNIQUE_SEND_CASES,
}


def test_every_case_has_a_row_in_the_docs_table() -> None:
    table = (Path(__file__).resolve().parents[1] / "docs" / "bad-input.md").read_text()
    missing = [f"{name}[{p.id}]" for name, cases in FAMILIES.items() for p in cases]
    missing = [test_id for test_id in missing if f"`{test_id}`" not in table]
    assert not missing, f"cases without a row in docs/bad-input.md: {missing}"


def test_a_key_callable_gets_the_task_arguments_not_the_task() -> None:
    """A function given as key= is a class attribute of the task: it must not be bound to the task."""
    assert keyed_by(lambda group_id, **_: f"tenant:{group_id}").mongolock_key_for(7) == "tenant:7"
    assert keyed_by(lambda **kwargs: repr(sorted(kwargs.items()))).mongolock_key_for(7) == (
        "[('group_id', 7), ('path', 'members.csv')]"
    )


def test_a_full_queue_says_which_limit_it_reached() -> None:
    """The reason a run that found its key's queue full ends with names the limit it reached: the user's
    ``max_length``, the most runs a lease document keeps for runs that are not spilled (runs of several
    keys), or the 16 MiB document (before: the count's cap was told as the 16 MiB document, whose advice,
    smaller arguments, does not help)."""
    from celery_mongolock.core.documents.entries import MAX_PARKED
    from celery_mongolock.integration.results import full_reason

    entry = {"m": b"x" * 2**20}
    assert "its max_length" in full_reason("k", 10, 10, entry)
    by_count = full_reason("k", MAX_PARKED + 700, None, entry, in_document=MAX_PARKED)
    assert f"{MAX_PARKED} runs parked in its lease document" in by_count and "keys=" in by_count
    assert "16 MiB" not in by_count
    by_size = full_reason("k", 40 + 700, None, entry, in_document=40)
    assert "16 MiB" in by_size and "1.00 MiB" in by_size and "reference" in by_size
    assert "max_length" in full_reason("k", 6000, 6000, entry, in_document=MAX_PARKED)


def test_a_bad_limit_in_a_settings_entry_with_keys_names_the_limit() -> None:
    """Both ``keys`` and ``limit`` in one ``mongolock_task_policies`` entry: a mistake in the limit is
    reported under ``['limit']``, not under ``['keys']``."""
    app = Celery("bad_input_keys_limit", set_as_current=False)
    name = f"bad_input.k{uuid.uuid4().hex[:8]}"
    app.conf.mongolock_task_policies = {
        name: {"keys": ["g:{group_id}", "p:{path}"], "limit": {"g:{grup_id}": 2}}
    }
    singleton_task(app=app, name=name, key="g:{group_id}")(upload)
    app.finalize()
    with pytest.raises(ConfigurationError) as caught:
        _check_task_policies(app)
    assert f"mongolock_task_policies[{name!r}]['limit']" in str(caught.value)
    assert "'g:{grup_id}'" in str(caught.value)


def test_a_policy_name_is_read_alike_as_a_string_and_in_a_dict() -> None:
    """Surrounding blanks and case: the same in both forms (a name read from an environment variable)."""
    assert parse_policy(" Replace ") == parse_policy({"policy": " Replace "}) == Replace()


def test_an_error_answered_by_mongodb_is_not_called_no_answer(store: Any) -> None:
    """A store error says whether MongoDB answered with an error (a command it refused: here InternalError,
    as the embedded server answers a document it cannot write) or did not answer at all."""
    from pymongo.errors import NetworkTimeout, OperationFailure

    answered = store.connection.unavailable("acquire lease 'k'", OperationFailure("boom", code=1))
    assert str(answered).startswith("MongoDB answered with an error while trying to acquire lease 'k' (")
    assert "OperationFailure (code 1): boom" in str(answered)
    silent = store.connection.unavailable("acquire lease 'k'", NetworkTimeout("timed out"))
    assert str(silent).startswith("MongoDB did not answer while trying to acquire lease 'k' (")
