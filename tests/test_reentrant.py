"""Reentrant holds in the lease store, on the embedded server: the same owner (this store, and this thread
or the running singleton run) asking again for a key it holds gets the same lease at once, counted, with
no command; another thread, another store or another run never shares it."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from celery_mongolock import (
    ConfigurationError,
    LeaseLost,
    LeaseStore,
    LockContended,
    ReentrantHold,
    Superseded,
)
from celery_mongolock.core.lease_set import LeaseSet
from celery_mongolock.core.reentry import current_owner, run_scope

from .conftest import CommandCounter
from .servers import wait_for


def _in_thread(fn: Any) -> Any:
    """Run ``fn`` in another thread; return what it returned or raised."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert not t.is_alive() and out
    return out[0]


def _lease_commands(counter: CommandCounter) -> list[str]:
    """Commands that take or end a lease (the heartbeat's renewals are ``update``s of their own)."""
    return [name for name, cmd in counter.commands if name == "findAndModify"]


def test_the_same_thread_reenters_at_once_with_the_same_fence_and_no_command(
    store: LeaseStore, counter: CommandCounter
) -> None:
    with store.hold("k") as outer:
        counter.clear()
        started = time.monotonic()
        with store.hold("k", wait=3) as inner:
            assert isinstance(inner, ReentrantHold) and inner.outer is outer
            assert (inner.fence, inner.owner, inner.key, inner.depth) == (outer.fence, outer.owner, "k", 1)
            assert store.hold_count("k") == 2
            with store.hold("k") as deeper:
                assert isinstance(deeper, ReentrantHold) and deeper.fence == outer.fence
                assert store.hold_count("k") == 3
            assert store.hold_count("k") == 2 and inner.held
        assert time.monotonic() - started < 3  # never waited for itself
        assert _lease_commands(counter) == []  # decided locally
        # The inner holds ended; the key stays held by the outer lease.
        info = store.inspect("k")
        assert info is not None and info.held and info.owner == outer.owner and info.fence == outer.fence
        assert outer.held and store.hold_count("k") == 1
    info = store.inspect("k")
    assert info is not None and not info.held  # the outermost hold ended: released
    assert store.hold_count("k") == 0


def test_acquire_reenters_only_when_asked(store: LeaseStore) -> None:
    with store.hold("k") as outer:
        assert store.acquire("k") is None  # acquire's default: one try like anyone else's
        inner = store.acquire("k", reentrant=True)
        assert isinstance(inner, ReentrantHold) and inner.fence == outer.fence
        assert inner.release() and not inner.release()
        assert outer.held
    first = store.acquire("j", reentrant=True)
    assert first is not None and not isinstance(first, ReentrantHold)
    again = store.acquire("j", reentrant=True)
    assert isinstance(again, ReentrantHold) and again.outer is first
    assert again.release() and first.release()
    assert store.acquire("j", reentrant=True) is not None  # released: a fresh acquisition


def test_another_thread_and_another_store_never_share(store: LeaseStore, make_store: Any) -> None:
    other = make_store()
    with store.hold("k") as outer:
        # Another thread, through the same store: contention like anyone else's.
        got = _in_thread(lambda: store.hold("k", wait=0).__enter__())
        assert isinstance(got, LockContended) and got.key == "k"
        assert _in_thread(lambda: store.acquire("k", reentrant=True)) is None
        # Another store, in this very thread: contention too.
        with pytest.raises(LockContended), other.hold("k", wait=0):
            pass
        assert other.acquire("k", reentrant=True) is None
        # Another run in this thread (a singleton run started here): its own owner.
        with run_scope("someone"):
            assert current_owner().startswith("run:someone:")
            with pytest.raises(LockContended), store.hold("k", wait=0):
                pass
        assert outer.held and store.hold_count("k") == 1


def test_a_run_is_one_owner_and_a_nested_scope_stays_that_run(store: LeaseStore) -> None:
    with run_scope("outer") as run, store.hold("k") as outer:
        with run_scope("called-in-process") as nested:
            assert nested == run  # a singleton function called in-process is the same run
            with store.hold("k") as inner:
                assert isinstance(inner, ReentrantHold) and inner.fence == outer.fence
        # Another thread is not the run, even while it runs.
        assert _in_thread(lambda: store.acquire("k", reentrant=True)) is None


def test_a_superseded_outer_lease_makes_the_inner_hold_superseded(store: LeaseStore) -> None:
    """``Replace(cancel_running=True)``: a newer send supersedes the run's lease; a singleton function the
    run calls in-process holds it reentrantly, and its ``current_lease().raise_if_superseded()`` raises
    ``Superseded`` (it raised ``AttributeError``: the hold had no supersession of its own)."""
    told: list[str] = []
    with store.hold("k") as outer, store.hold("k") as inner:
        assert isinstance(inner, ReentrantHold)
        assert not inner.superseded and inner.superseded_by is None
        inner.raise_if_superseded()  # not superseded: nothing
        inner.on_superseded(lambda _lease, by: told.append(by))
        assert outer.mark_superseded("newer")
        assert inner.superseded and inner.superseded_by == "newer" and inner.superseded_at is not None
        assert inner.wait_superseded(0)
        with pytest.raises(Superseded) as raised:
            inner.raise_if_superseded()
        assert raised.value.by == "newer" and raised.value.key == "k"
        inner.end_superseded()
        assert outer.ended_superseded_by == inner.ended_superseded_by == "newer"
    wait_for(lambda: told == ["newer"], timeout=10, message="the callback to be called")


def test_a_lost_outer_lease_makes_the_inner_hold_lost(store: LeaseStore, make_store: Any) -> None:
    operator = make_store()
    outer_hold, inner_hold = store.hold("k"), store.hold("k")
    outer = outer_hold.__enter__()
    inner = inner_hold.__enter__()
    assert operator.force_release("k")
    with pytest.raises(LeaseLost):
        inner.renew()  # the outer lease's renewal: it matches nothing now
    assert inner.lost and outer.lost
    assert inner.lost_reason == outer.lost_reason
    with pytest.raises(LeaseLost):
        inner.raise_if_lost()
    # Each block that ends normally after the loss says so on exit, the inner one first.
    with pytest.raises(LeaseLost):
        inner_hold.__exit__(None, None, None)
    with pytest.raises(LeaseLost):
        outer_hold.__exit__(None, None, None)
    # Once lost, the owner holds nothing: its next hold is an acquisition like anyone else's.
    with store.hold("k") as fresh:
        assert not isinstance(fresh, ReentrantHold) and fresh.fence > outer.fence


def test_limit_n_a_reentrant_hold_takes_no_second_slot(store: LeaseStore, make_store: Any) -> None:
    with store.hold("tenant:1", limit=3) as outer:
        assert outer.slot is not None
        with store.hold("tenant:1", limit=3) as inner:
            assert isinstance(inner, ReentrantHold)
            assert (inner.slot, inner.fence) == (outer.slot, outer.fence)
            info = store.inspect("tenant:1")
            assert info is not None and len(info.slots) == 1  # one slot, however deep
            # The other slots stay free for others.
            with make_store().hold("tenant:1", limit=3) as theirs:
                assert theirs.slot != outer.slot
        # reentrant=False: an acquisition like anyone else's, here a second slot.
        with store.hold("tenant:1", limit=3, reentrant=False) as second:
            assert not isinstance(second, ReentrantHold) and second.slot != outer.slot
            info = store.inspect("tenant:1")
            assert info is not None and len(info.slots) == 2
    info = store.inspect("tenant:1")
    assert info is not None and not info.slots


def test_reentrant_false_fails_fast_instead_of_waiting_for_itself(store: LeaseStore) -> None:
    with store.hold("k") as outer:
        started = time.monotonic()
        with (
            pytest.raises(LockContended, match="same owner") as refused,
            store.hold("k", wait=30, reentrant=False),
        ):
            pass
        assert time.monotonic() - started < 15  # one command, not the 30 s wait
        assert refused.value.key == "k"
        assert outer.held
    # A hold taken with reentrant=False is not shared, and a nested ask fails fast.
    with store.hold("k", reentrant=False):
        with pytest.raises(LockContended, match="same owner"), store.hold("k", wait=30):
            pass
        assert store.acquire("k", reentrant=True) is None


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"ttl": 60}, "ttl=60"),
        ({"heartbeat_seconds": 0.5}, "heartbeat_seconds=0.5"),
        ({"limit": 3}, "limit=3"),
    ],
)
def test_a_nested_hold_asking_for_another_lease_is_refused(
    store: LeaseStore, kwargs: dict[str, Any], names: str
) -> None:
    with store.hold("k", ttl=30, heartbeat_seconds=5) as outer:
        with pytest.raises(ConfigurationError, match="reentrant hold") as refused, store.hold("k", **kwargs):
            pass
        assert names in str(refused.value) and "outer hold" in str(refused.value)
        assert outer.held and store.hold_count("k") == 1
        with store.hold("k", ttl=30, heartbeat_seconds=5) as same:  # the same lease asked: fine
            assert isinstance(same, ReentrantHold)


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_another_process_never_shares(mongo_url: str, db_name: str) -> None:
    """A forked child of the holder has the parent's holds in memory, not its leases: its asks contend."""
    import os

    s = LeaseStore(mongo_url, database=db_name)
    try:
        with s.hold("k") as outer:
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - child
                try:
                    shared = s.acquire("k", reentrant=True) is not None or s.hold_count("k") != 0
                    os.write(write, b"0" if shared else b"1")
                finally:
                    os._exit(0)
            os.close(write)
            os.waitpid(pid, 0)
            assert os.read(read, 1) == b"1"
            os.close(read)
            assert outer.held and s.hold_count("k") == 1
    finally:
        s.close()


def test_a_set_of_leases_can_include_a_reentrant_hold(store: LeaseStore) -> None:
    # A keys= task called in-process by a run that holds one of its keys joins a reentrant hold of that
    # key with the leases it takes (``integration.reentrant.joined``): the set is built from both.
    with store.hold("a") as outer, store.hold("a") as inner, store.hold("b") as other:
        assert isinstance(inner, ReentrantHold)
        both = LeaseSet([inner, other])
        assert both.fence == max(outer.fence, other.fence)
        assert both.sent_mono == min(outer.sent_mono, other.sent_mono) <= both.acquired_mono
