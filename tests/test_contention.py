"""What each contention policy makes a run do (``Policy.on_contended``/``on_unavailable``): pure logic.

A recording stand-in for the run (``policies.Contention``) shows each policy's decision without Celery;
``test_integration.py`` shows the same policies with real workers.
"""

from __future__ import annotations

from typing import Any, NoReturn

import pytest

from celery_mongolock import Fail, LockContended, Retry, Skip, StoreUnavailable, Wait
from celery_mongolock.policies import TRY_AGAIN, Contention, Policy


class Published(Exception):
    """Raised by the stand-in where the glue would publish the run again."""

    def __init__(self, policy: Retry, exc: Exception | None) -> None:
        super().__init__(policy, exc)
        self.policy = policy
        self.exc = exc


class Run:
    """A run that records what the policy made it do; ``free_after`` waits until the key looks free."""

    def __init__(self, free_after: int | None = None) -> None:
        self.key = "k"
        self.free_after = free_after
        self.waits: list[float] = []

    def skip(self, reason: str) -> object:
        return ("skipped", reason)

    def fail(self, exc: Exception | None = None) -> NoReturn:
        raise exc if exc is not None else LockContended(self.key, {}, None)

    def retry(self, policy: Retry, exc: Exception | None = None) -> NoReturn:
        raise Published(policy, exc)

    def wait_free(self, timeout: float) -> bool:
        self.waits.append(timeout)
        return self.free_after is not None and len(self.waits) >= self.free_after


def _run(free_after: int | None = None) -> Run:
    run = Run(free_after)
    _: Contention = run  # the stand-in has the shape the policies rely on
    return run


def test_retry_publishes_the_run_again_with_its_own_backoff() -> None:
    policy = Retry(countdown=5)
    with pytest.raises(Published) as caught:
        policy.on_contended(_run())
    assert caught.value.policy is policy and caught.value.exc is None


def test_skip_ends_the_run_with_a_result() -> None:
    assert Skip().on_contended(_run()) == ("skipped", "the key was held by another run")


def test_fail_fails_the_run() -> None:
    with pytest.raises(LockContended):
        Fail().on_contended(_run())


def test_wait_tries_again_once_the_key_looks_free() -> None:
    run = _run(free_after=1)
    assert Wait(timeout=7).on_contended(run) is TRY_AGAIN
    assert run.waits == [7]


@pytest.mark.parametrize(
    ("then", "expected"),
    [(Skip(), ("skipped", "the key was held by another run")), (Fail(), LockContended), (Retry(), Published)],
)
def test_wait_that_times_out_does_what_then_says(then: Policy, expected: Any) -> None:
    run = _run(free_after=None)
    if isinstance(expected, type):
        with pytest.raises(expected):
            Wait(timeout=1, then=then).on_contended(run)
    else:
        assert Wait(timeout=1, then=then).on_contended(run) == expected
    assert run.waits == [1]


def test_an_unreachable_store_never_runs_the_body() -> None:
    exc = StoreUnavailable("MongoDB did not answer")
    own = Retry(countdown=9)
    cases: list[tuple[Policy, Retry | None]] = [
        (own, own),  # Retry: its own backoff
        (Skip(), Retry()),  # Skip: not skipped (the key may be free), published again later
        (Wait(then=own), own),
        (Wait(then=Skip()), Retry()),
        (Wait(then=Fail()), Retry()),
    ]
    for policy, published_with in cases:
        with pytest.raises(Published) as caught:
            policy.on_unavailable(_run(), exc)
        assert caught.value.policy == published_with, policy
        assert caught.value.exc is exc
    with pytest.raises(StoreUnavailable):
        Fail().on_unavailable(_run(), exc)  # Fail: fails at once, with the store's error


def test_a_policy_kind_must_say_what_a_contended_run_does() -> None:
    class Half(Policy):
        name = "half"

    with pytest.raises(NotImplementedError, match="Half"):
        Half().on_contended(_run())
    with pytest.raises(Published):  # the default for an unreachable store: run again later
        Half().on_unavailable(_run(), StoreUnavailable("x"))
