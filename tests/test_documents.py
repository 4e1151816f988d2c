"""The lease document shapes (``celery_mongolock.core.documents``): pure functions, tested without a server.

The update pipelines are run here by a small evaluator of the few aggregation operators they use, on
plain dicts, so each rule of the lease contract the shapes carry (who may take a key, what a release
keeps, how the fence moves) is checked on its own. ``test_store_contract.py`` runs the same shapes on a
real server.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

import pytest

from celery_mongolock import ConfigurationError
from celery_mongolock.core.documents import base as documents
from celery_mongolock.lease import LeaseInfo

UTC = _dt.timezone.utc
NOW = _dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
NOW_MS = int(NOW.timestamp() * 1000)
Doc = dict[str, Any]


# -- a minimal evaluator of the operators the pipelines use ------------------------------------------------
def _ms(value: Any) -> Any:
    return int(value.timestamp() * 1000) if isinstance(value, _dt.datetime) else value


def _cmp_key(value: Any) -> tuple[int, Any]:
    # BSON order for what the pipelines compare: null before numbers.
    return (0, 0) if value is None else (1, value)


def _path(value: Any, path: str) -> Any:
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


#: ``$$REMOVE``: a field set to it is left out.
REMOVE = object()


def evaluate(expr: Any, doc: Doc, now: _dt.datetime, variables: Doc | None = None) -> Any:
    variables = variables or {}
    if isinstance(expr, str):
        if expr == "$$NOW":
            return now
        if expr == "$$REMOVE":
            return REMOVE
        if expr.startswith("$$"):
            name, _, rest = expr[2:].partition(".")
            return _path(variables.get(name), rest) if rest else variables.get(name)
        if expr.startswith("$"):
            return _path(doc, expr[1:])
        return expr
    if isinstance(expr, list):
        return [evaluate(e, doc, now, variables) for e in expr]
    if not isinstance(expr, dict):
        return expr
    if len(expr) != 1 or not next(iter(expr)).startswith("$"):
        # An object expression: a field whose value is missing (None here) is left out, as on the server.
        values = {k: evaluate(v, doc, now, variables) for k, v in expr.items()}
        return {k: v for k, v in values.items() if v is not None and v is not REMOVE}
    ((op, arg),) = expr.items()
    if op == "$literal":
        return arg
    if op == "$let":
        bound = {name: evaluate(e, doc, now, variables) for name, e in arg["vars"].items()}
        return evaluate(arg["in"], doc, now, {**variables, **bound})
    if op in ("$filter", "$map"):
        items = evaluate(arg["input"], doc, now, variables) or []
        name = arg.get("as", "this")
        body = arg["cond"] if op == "$filter" else arg["in"]
        results = [(item, evaluate(body, doc, now, {**variables, name: item})) for item in items]
        return [item for item, keep in results if keep] if op == "$filter" else [r for _, r in results]
    if op == "$cond":
        cond, then, otherwise = arg
        return evaluate(then if evaluate(cond, doc, now, variables) else otherwise, doc, now, variables)
    if op == "$switch":
        for branch in arg["branches"]:
            if evaluate(branch["case"], doc, now, variables):
                return evaluate(branch["then"], doc, now, variables)
        return evaluate(arg["default"], doc, now, variables)
    if op == "$getField":
        source = evaluate(arg["input"], doc, now, variables)
        return source.get(arg["field"]) if isinstance(source, dict) else None
    args = (
        evaluate(arg, doc, now, variables) if isinstance(arg, list) else [evaluate(arg, doc, now, variables)]
    )
    if op == "$arrayElemAt":
        items, index = args
        if items is None:
            return None
        return items[index] if -len(items) <= index < len(items) else None
    if op == "$concatArrays":
        if any(part is None for part in args):
            return None
        return [item for part in args for item in part]
    if op == "$slice" and args[0] is None:
        return None
    if op == "$slice":
        if len(args) == 3:
            items, start, count = args
            return items[start : start + count]
        items, count = args
        return items[count:] if count < 0 else items[:count]
    if op == "$size":
        return len(args[0] or [])
    if op == "$in":
        return args[0] in args[1]
    if op == "$not":
        return not args[0]
    if op == "$gte":
        return _cmp_key(args[0]) >= _cmp_key(args[1])
    if op == "$mergeObjects":
        merged: Doc = {}
        for part in args:
            merged.update(part or {})
        return merged
    if op == "$concat":
        return "".join(args)
    if op == "$toString":
        return str(args[0])
    if op == "$ne":
        return args[0] != args[1]
    if op in ("$add", "$subtract", "$toLong", "$toDate", "$multiply") and any(a is None for a in args):
        return None
    if op == "$toLong":
        return _ms(args[0])
    if op == "$toDate":
        return _dt.datetime.fromtimestamp(args[0] / 1000, tz=UTC)
    if op == "$add":
        dates = [a for a in args if isinstance(a, _dt.datetime)]
        total = sum(_ms(a) for a in args)
        return _dt.datetime.fromtimestamp(total / 1000, tz=UTC) if dates else total
    if op == "$subtract":
        return _ms(args[0]) - _ms(args[1])
    if op == "$multiply":
        return args[0] * args[1]
    if op == "$sum":  # (of an array: its numbers; nulls and others are ignored, as on the server)
        items = args[0] if len(args) == 1 and isinstance(args[0], list) else args
        return sum(a for a in items if isinstance(a, (int, float)) and not isinstance(a, bool))
    if op == "$max":
        items = args[0] if len(args) == 1 and isinstance(args[0], list) else args
        present = [a for a in items if a is not None]  # as on the server: nulls are ignored
        return max(present) if present else None
    if op == "$ifNull":
        return args[1] if args[0] is None else args[0]
    if op == "$cond":
        return args[1] if args[0] else args[2]
    if op == "$or":
        return any(args)
    if op == "$and":
        return all(args)
    if op == "$eq":
        return args[0] == args[1]
    if op in ("$lt", "$lte", "$gt"):
        a, b = _cmp_key(args[0]), _cmp_key(args[1])
        return {"$lt": a < b, "$lte": a <= b, "$gt": a > b}[op]
    raise AssertionError(f"operator {op} not modelled")


def run_pipeline(pipeline: list[Doc], doc: Doc, now: _dt.datetime = NOW) -> Doc:
    out = dict(doc)
    for stage in pipeline:
        ((kind, body),) = stage.items()
        if kind == "$set":
            values = {field: evaluate(e, out, now) for field, e in body.items()}
            out.update(values)
            for field in [f for f, v in values.items() if v is REMOVE]:
                out.pop(field)
        elif kind == "$unset":
            for field in [body] if isinstance(body, str) else body:
                out.pop(field, None)
        else:
            raise AssertionError(f"stage {kind} not modelled")
    return out


def matches(filter_: Doc, doc: Doc, now: _dt.datetime = NOW) -> bool:
    for field, cond in filter_.items():
        if field == "$expr":
            if not evaluate(cond, doc, now):
                return False
            continue
        value: Any = doc
        for part in field.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(cond, dict) and "$in" in cond:
            if value not in cond["$in"]:
                return False
        elif isinstance(cond, dict) and "$ne" in cond:
            if value == cond["$ne"]:
                return False
        elif value != cond:
            return False
    return True


def acquire(doc: Doc, token: str, *, now: _dt.datetime = NOW, ttl_ms: int = 30_000, **kw: Any) -> Doc:
    holder = documents.holder_info("host-a", 123, {"task_id": token})
    return run_pipeline(documents.acquire_pipeline(token, ttl_ms, holder, **kw), doc, now)


def later(seconds: float) -> _dt.datetime:
    return NOW + _dt.timedelta(seconds=seconds)


# -- acquire -----------------------------------------------------------------------------------------------
def test_acquire_of_a_new_key_writes_the_whole_lease_document() -> None:
    doc = acquire({"_id": "k"}, "t1")
    assert doc["owner"] == "t1"
    assert doc["ttl_ms"] == 30_000
    assert doc["expires_at"] == later(30)
    assert doc["acquired_at"] == doc["renewed_at"] == NOW
    assert doc["fence"] == NOW_MS * 1000  # a fresh document starts its fence from the server's clock
    assert doc["holder"] == {"host": "host-a", "pid": 123, "task_id": "t1"}
    assert doc["released_at"] is None and doc["released_for"] is None and doc["forced_release"] is False
    assert "__free" not in doc  # the helper field never reaches the stored document
    assert documents.acquire_filter("k") == {"_id": "k"}


def test_a_live_lease_of_another_owner_is_left_exactly_as_it_was() -> None:
    held = acquire({"_id": "k"}, "t1")
    assert acquire(held, "t2", now=later(29.999)) == held


def test_an_expired_lease_is_taken_over_with_a_larger_fence() -> None:
    held = acquire({"_id": "k"}, "t1")
    taken = acquire(held, "t2", now=later(30))  # expires_at <= $$NOW: expired, on the server's clock
    assert taken["owner"] == "t2"
    assert taken["fence"] > held["fence"]


def test_a_retry_with_the_same_token_takes_over_its_own_acquisition() -> None:
    held = acquire({"_id": "k"}, "t1")
    again = acquire(held, "t1", now=later(1))
    assert again["owner"] == "t1"
    assert again["expires_at"] == later(31)


def test_the_fence_grows_by_one_when_the_server_clock_has_not_moved_past_it() -> None:
    doc = {"_id": "k", "owner": None, "fence": NOW_MS * 1000 + 500, "expires_at": NOW}
    assert acquire(doc, "t")["fence"] == NOW_MS * 1000 + 501


def test_the_holder_is_stored_literally() -> None:
    holder = documents.holder_info("h", 1, {"note": "$owner"})
    doc = run_pipeline(documents.acquire_pipeline("t", 1000, holder), {"_id": "k"})
    assert doc["holder"]["note"] == "$owner"  # not read as a field path


def test_a_tick_at_or_before_the_last_one_is_refused_even_when_free() -> None:
    first = acquire({"_id": "k"}, "t1", tick=100)
    assert first["last_tick"] == 100
    released = run_pipeline(documents.release_pipeline(), first, later(1))
    assert acquire(released, "t2", now=later(2), tick=100) == released
    assert acquire(released, "t2", now=later(2), tick=99) == released
    assert acquire(released, "t2", now=later(2), tick=101)["owner"] == "t2"


def test_min_hold_and_hold_until() -> None:
    doc = acquire({"_id": "k"}, "t", min_hold_ms=5000)
    assert doc["hold_until"] == later(5)
    doc = acquire({"_id": "k"}, "t", min_hold_ms=5000, hold_until_ms=NOW_MS + 60_000)
    assert doc["hold_until"] == later(60)
    doc = acquire({"_id": "k"}, "t", min_hold_ms=5000, hold_until_ms=NOW_MS + 1000)
    assert doc["hold_until"] == later(5)  # the later of the two


# -- renew -------------------------------------------------------------------------------------------------
def test_renew_extends_by_the_leases_own_length_on_the_server_clock() -> None:
    doc = acquire({"_id": "k"}, "t", ttl_ms=10_000)
    assert matches(documents.renew_filter("k", "t"), doc, later(9))
    renewed = run_pipeline(documents.renew_pipeline(), doc, later(9))
    assert renewed["expires_at"] == later(19)
    assert renewed["renewed_at"] == later(9)
    assert renewed["fence"] == doc["fence"] and renewed["acquired_at"] == doc["acquired_at"]


def test_renew_matches_neither_another_owner_nor_an_expired_lease() -> None:
    doc = acquire({"_id": "k"}, "t", ttl_ms=10_000)
    assert not matches(documents.renew_filter("k", "other"), doc, later(1))
    assert not matches(documents.renew_filter("k", "t"), doc, later(10))  # a late renewal revives nothing
    assert matches(documents.renew_tokens_filter(["x", "t"]), doc, later(1))
    assert not matches(documents.renew_tokens_filter(["t"]), doc, later(10))
    assert documents.renew_tokens_filter({"a": 1, "b": 2})["owner"] == {"$in": ["a", "b"]}


# -- release -----------------------------------------------------------------------------------------------
def test_release_clears_the_owner_and_keeps_the_fence() -> None:
    doc = acquire({"_id": "k"}, "t")
    assert matches(documents.release_filter("k", "t"), doc)
    assert not matches(documents.release_filter("k", "other"), doc)
    assert matches(documents.release_tokens_filter(["t"]), doc)
    released = run_pipeline(documents.release_pipeline(), doc, later(1))
    assert released["owner"] is None
    assert released["released_at"] == later(1)
    assert released["fence"] == doc["fence"]
    assert released["expires_at"] == doc["expires_at"]
    assert "__hold" not in released
    assert acquire(released, "t2", now=later(2))["fence"] > doc["fence"]


def test_release_before_the_minimum_hold_keeps_the_key_until_then() -> None:
    doc = acquire({"_id": "k"}, "t", min_hold_ms=5000)
    early = run_pipeline(documents.release_pipeline(), doc, later(1))
    assert early["owner"] == "t"
    assert early["expires_at"] == later(5)
    assert acquire(early, "t2", now=later(4)) == early
    assert acquire(early, "t2", now=later(5))["owner"] == "t2"
    late = run_pipeline(documents.release_pipeline(), doc, later(6))
    assert late["owner"] is None


def test_supervisor_and_operator_releases() -> None:
    doc = acquire({"_id": "k"}, "t")
    assert matches(documents.held_by_filter({"task_id": "t", "pid": 123}), doc)
    assert not matches(documents.held_by_filter({"task_id": "t", "pid": 124}), doc)
    dead = run_pipeline(documents.release_dead_holder_pipeline(), doc, later(1))
    assert dead["owner"] is None and dead["released_for"] == "holder died"
    assert not matches(documents.held_by_filter({"task_id": "t"}), dead)
    with pytest.raises(ConfigurationError, match="at least one holder field"):
        documents.held_by_filter({})
    assert matches(documents.force_release_filter("k"), doc)
    forced = run_pipeline(documents.force_release_pipeline(), doc, later(1))
    assert forced["owner"] is None and forced["forced_release"] is True
    assert forced["fence"] == doc["fence"]
    assert not matches(documents.force_release_filter("k"), forced)


# -- holder info -------------------------------------------------------------------------------------------
def test_holder_info() -> None:
    assert documents.holder_info("h", 7, None) == {"host": "h", "pid": 7}
    assert documents.holder_info("h", 7, {"task_id": "x"}) == {"host": "h", "pid": 7, "task_id": "x"}


@pytest.mark.parametrize(
    ("info", "message"),
    [
        (["task"], "must be a dict"),
        ({"": 1}, "plain non-empty string"),
        ({"$set": 1}, "plain non-empty string"),
        ({"a.b": 1}, "plain non-empty string"),
        ({1: 1}, "plain non-empty string"),
        ({"x": object()}, "cannot be stored"),
        ({"x": "y" * documents.MAX_INFO_BYTES}, "bytes encoded"),
    ],
)
def test_bad_holder_info_is_refused(info: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        documents.holder_info("h", 1, info)


# -- reading -----------------------------------------------------------------------------------------------
def test_read_pipeline_and_lease_info() -> None:
    pipeline = documents.read_pipeline({"_id": "k"})
    assert pipeline[0] == {"$match": {"_id": "k"}}
    assert pipeline[1] == {"$sort": {"_id": 1}}
    doc = acquire({"_id": "k"}, "t")
    read = {**doc, **{f: evaluate(e, doc, later(10)) for f, e in pipeline[2]["$addFields"].items()}}
    info = documents.lease_info(read)
    assert isinstance(info, LeaseInfo)
    assert info.held and info.owner == "t" and info.expires_in == 20.0
    assert info.fence == doc["fence"] and info.holder["task_id"] == "t"
    naive = {**read, "expires_at": doc["expires_at"].replace(tzinfo=None)}
    assert documents.lease_info(naive).expires_at == doc["expires_at"]  # read as UTC
    expired = {**read, "__expires_in_ms": 0}
    assert not documents.lease_info(expired).held
    released = {**read, "owner": None}
    assert not documents.lease_info(released).held


def test_prefix_filter() -> None:
    assert documents.prefix_filter(None) == {}
    assert documents.prefix_filter("a.b*") == {"_id": {"$regex": r"^a\.b\*"}}
    with pytest.raises(ConfigurationError, match="prefix must be a str"):
        documents.prefix_filter(3)  # type: ignore[arg-type]


# -- endings (the ``ends`` array) --------------------------------------------------------------------------
def _held(token: str = "t1", **kw: Any) -> Doc:
    holder = documents.holder_info(
        "host-a", 123, {"task_id": token, "task_name": "app.upload", "worker": "w1@h", "delivery": "0.0"}
    )
    return run_pipeline(documents.acquire_pipeline(token, 30_000, holder, **kw), {"_id": "k"})


def _end(doc: Doc, how: str, at: _dt.datetime) -> Doc:
    pipeline = {
        "released": documents.release_pipeline(),
        "holder-died": documents.release_dead_holder_pipeline(),
        "forced": documents.force_release_pipeline(),
    }[how]
    return run_pipeline(pipeline, doc, at)


@pytest.mark.parametrize("how", ["released", "holder-died", "forced"])
def test_each_ending_command_appends_one_ending_in_the_same_update(how: str) -> None:
    doc = _held(waited_ms=1500)
    ended = _end(doc, how, later(2))
    assert ended["ends"] == [
        {
            "f": doc["fence"],
            "t": "t1",
            "n": "app.upload",
            "run": "0.0",
            "host": "host-a",
            "pid": 123,
            "worker": "w1@h",
            "a": NOW,
            "e": later(2),
            "w": 1500,
            "how": how,
        }
    ]
    # A second ending command for the same acquisition (a late duplicate) records nothing more.
    assert _end(ended, "forced", later(3))["ends"] == ended["ends"]


def test_a_takeover_of_an_expired_lease_records_it_as_expired() -> None:
    doc = _held()
    taken = acquire(doc, "t2", now=later(40))
    (ending,) = taken["ends"]
    assert ending["how"] == "expired" and ending["f"] == doc["fence"] and ending["t"] == "t1"
    assert ending["e"] == later(30)  # when it expired, on the server's clock
    assert ending["seen"] == later(40) == taken["acquired_at"]
    assert "w" not in ending  # the expired run's wait was not known
    assert documents.ended_by_takeover(taken) == ending


@pytest.mark.parametrize(
    ("before", "token", "at", "ended"),
    [
        ("fresh", "t2", 0, False),  # a new key: nothing ended
        ("held", "t2", 10, False),  # contention: nothing changes
        ("held", "t1", 10, False),  # our own retried acquire takes over our own acquisition
        ("released", "t2", 10, False),  # already ended by its release: no second ending
        ("held", "t2", 30, True),  # expired: ended now
        ("min-hold released", "t2", 60, False),  # released early, then ran out its minimum hold
    ],
)
def test_which_acquires_record_an_ending(before: str, token: str, at: float, ended: bool) -> None:
    doc = {
        "fresh": {"_id": "k"},
        "held": _held(),
        "released": _end(_held(), "released", later(1)),
        "min-hold released": _end(_held(min_hold_ms=50_000), "released", later(1)),
    }[before]
    count = len(doc.get("ends") or [])
    after = acquire(doc, token, now=later(at))
    assert len(after.get("ends") or []) == count + int(ended)
    assert (documents.ended_by_takeover(after) is not None) == ended


def test_ends_keeps_the_last_eight() -> None:
    doc = _held()
    fences = []
    for i in range(12):
        fences.append(doc["fence"])
        doc = _end(doc, "released", later(i + 0.5))
        doc = acquire(doc, f"t{i + 2}", now=later(i + 1))
    assert [e["f"] for e in doc["ends"]] == fences[-documents.ENDS_KEPT :]


def test_waited() -> None:
    assert _held()["waited_ms"] is None  # unknown
    assert _held(waited_ms=0)["waited_ms"] == 0
    assert _held(waited_since_ms=NOW_MS - 2500)["waited_ms"] == 2500  # to the server's now
    assert _held(waited_since_ms=NOW_MS + 999)["waited_ms"] == 0  # a fast caller's clock: never below 0
    held = _held(waited_ms=7)
    assert acquire(held, "t2", now=later(1), waited_ms=99)["waited_ms"] == 7  # contention: unchanged


def test_history_records_and_reads() -> None:
    ending = _end(_held(), "released", later(2))["ends"][0]
    record = documents.history_record("k", ending)
    assert record["_id"] == documents.history_id("k", ending["f"], "s")
    assert record["k"] == "k" and record["v"] == "s" and record["how"] == "released"
    assert documents.history_id("k", 5, "h") == "k\x00" + "5".zfill(20) + "\x00h"
    assert documents.history_id("k", 5, "h") != documents.history_id("k", 5, "s")
    assert documents.read_pipeline({})[-1] == {"$project": {"ends": 0, "seen": 0, "q.m": 0, "ho.m": 0}}
    assert documents.story_pipeline("k")[0] == {"$match": {"_id": "k"}}
    assert documents.ACQUIRE_PROJECTION == {"ends": {"$slice": -1}}
    assert documents.ended_by_takeover(None) is None
    assert documents.ended_by_takeover({"ends": [ending], "acquired_at": NOW}) is None


# -- the admit of a queued run: one engine for both key shapes ---------------------------------------------
def _judged(pipeline: list[Doc]) -> list[str]:
    """The outcomes an admit's judge can reach, in the order it tries them."""
    for stage in pipeline:
        outcome = stage.get("$set", {}).get("__o")
        if outcome is not None:
            return [branch["then"] for branch in outcome["$switch"]["branches"]]
    raise AssertionError("no judge stage")


@pytest.mark.parametrize("claim", [None, "tok-claim"])
@pytest.mark.parametrize("replace", [False, True])
@pytest.mark.parametrize("group", [None, "set-signature"])
@pytest.mark.parametrize("debounce_ms", [None, 500])
@pytest.mark.parametrize("due", [False, True])
def test_both_key_shapes_judge_a_run_in_one_order(
    claim: str | None, replace: bool, group: str | None, debounce_ms: int | None, due: bool
) -> None:
    """A run on a key held as one lease and on a key of N slots meets the same cases in the same order
    (``admit_stages.judge``); only the name of a retry's own hold differs (``mine`` on a slot, reported
    as ``acquired``)."""
    from celery_mongolock.core.documents.queue import admit_pipeline
    from celery_mongolock.core.documents.slot_admit import slot_admit_pipeline

    entry = {"id": "t1/0", "t": "t1", "n": "task", "r": "0", "s": 1234567, "tk": "tok-h", "ttl": 30000}
    policy: dict[str, Any] = {
        "entry": entry,
        "timeout_ms": 60000,
        "claim": claim,
        "max_length": 3,
        "replace": replace,
        "debounce_ms": debounce_ms,
        "due": due,
        "group": group if replace else None,
    }
    fields = documents.acquire_fields("tok", 30000, {"host": "h", "pid": 1})
    one = _judged(admit_pipeline(fields, token="tok", **policy))
    slots = _judged(slot_admit_pipeline("tok", 30000, {"host": "h", "pid": 1}, 3, **policy))
    assert slots[0] == "mine" and one[0] == "acquired"
    assert one[1:] == slots[1:]
    # (the key's document cannot take its message; parked, and handed to the oldest; the count's cap)
    assert one[-3:] == ["full", "parked", "full"]
    assert (one[-4] == "acquired") == (not debounce_ms)  # a debounced run always parks first


def test_every_layer_keeps_as_many_endings_as_the_lease_document() -> None:
    """``ends`` keeps ``base.ENDS_KEPT`` endings; the layers below base that write or read it back (a
    handoff's takeover, a slot's ending, an admit's reply) keep their own copy of the number: the same."""
    from celery_mongolock.core.documents import handoff, queue, slots

    assert handoff.ENDS_KEPT == slots._ENDS_KEPT == documents.ENDS_KEPT
    assert queue.SLOT_ADMIT_PROJECTION["ends"] == {"$slice": -documents.ENDS_KEPT}
