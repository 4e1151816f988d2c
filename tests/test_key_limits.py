"""Per-key limits with several keys (``keys=(...)`` with ``limit=``): the declaration's checks and the
arithmetic, pure logic without a server. The behaviour with real workers is in tests/test_limit.py."""

from __future__ import annotations

import pytest

from celery_mongolock import ConfigurationError, Fail, Queue, Replace, Retry, Skip, Wait, singleton_task
from celery_mongolock.admission.limits import check_key_limits, limits_by_key
from celery_mongolock.admission.policies import check_keys, check_limit

KEYS = ("tenant:{tenant}", "group:{group}")


def test_a_key_without_an_entry_is_a_single_lease() -> None:
    assert check_key_limits({"tenant:{tenant}": 3}, KEYS, Retry()) == (3, None)
    assert check_key_limits({"group:{group}": 2, "tenant:{tenant}": 5}, KEYS, Wait()) == (5, 2)


def test_an_int_limit_gives_every_key_that_many_slots() -> None:
    assert check_key_limits(4, KEYS, Skip()) == (4, 4)


def test_no_limit_or_limit_1_everywhere_is_the_plain_several_keys_run() -> None:
    assert check_key_limits(None, KEYS, Retry()) is None
    assert check_key_limits(1, KEYS, Retry()) is None
    assert check_key_limits({"tenant:{tenant}": 1}, KEYS, Retry()) is None
    # ... which every policy takes, Queue included.
    assert check_key_limits({"tenant:{tenant}": 1}, KEYS, Queue()) is None


@pytest.mark.parametrize(
    ("limit", "words"),
    [
        ({"tenant:{tenat}": 3}, ["'tenant:{tenat}'", "did you mean 'tenant:{tenant}'", "not in keys="]),
        ({"account:{id}": 3}, ["'account:{id}'", "not in keys="]),
        ({"tenant:{tenant}": 0}, ["limit['tenant:{tenant}']", "from 1 to 1000", "0"]),
        ({"tenant:{tenant}": "3"}, ["limit['tenant:{tenant}']", "'3'"]),
        ({"tenant:{tenant}": 5000}, ["limit['tenant:{tenant}']", "5000"]),
        (2.5, ["limit must be an int", "2.5"]),
    ],
)
def test_a_bad_limit_names_what_is_wrong(limit: object, words: list[str]) -> None:
    with pytest.raises(ConfigurationError) as info:
        check_key_limits(limit, KEYS, Retry())
    for word in words:
        assert word in str(info.value)


def test_a_limit_per_key_needs_keys() -> None:
    with pytest.raises(
        ConfigurationError, match=r"limit=\{\.\.\.\} gives the limit of each key spec of keys="
    ):
        check_keys(None, "tenant:{tenant}", Retry(), {"tenant:{tenant}": 3})


@pytest.mark.parametrize("policy", [Retry(), Wait(timeout=5), Skip(), Fail(), Queue(), Replace()])
def test_every_policy_accepts_slots_on_several_keys(policy: object) -> None:
    assert check_keys(KEYS, None, policy, {"tenant:{tenant}": 3}) == KEYS


@pytest.mark.parametrize("policy", [Retry(), Wait(timeout=5), Skip(), Fail()])
def test_a_limit_per_key_takes_a_minimum_hold(policy: object) -> None:
    assert check_limit({"tenant:{tenant}": 3}, policy, 5.0) is None
    assert check_keys(KEYS, None, policy, {"tenant:{tenant}": 3}) == KEYS


def test_two_specs_rendering_one_key_hold_it_with_the_smaller_limit() -> None:
    assert limits_by_key([("a", 3), ("b", None), ("a", 2)]) == {"a": 2, "b": None}
    assert limits_by_key([("a", 3), ("a", None)]) == {"a": None}


def test_the_decorator_checks_a_limit_per_key() -> None:
    with pytest.raises(ConfigurationError) as info:

        @singleton_task(keys=KEYS, limit={"grup:{group}": 2}, on_contention=Retry())
        def upload(tenant: int, group: int) -> None: ...

    assert "did you mean 'group:{group}'" in str(info.value)
