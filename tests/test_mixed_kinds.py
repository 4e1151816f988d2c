"""A key used as ``limit=N`` slots by one run and as a single lease by another, with real ``celery
worker`` processes (prefork) on each broker, under ``Queue``: each waits for the key to be free of the
other kind, and both run.

Found by a new user's trial (stop 55): ``keys=("ql:{src}", "ql:{dst}"), limit={"ql:{src}": 3}`` with
``merge(a, a)`` then ``merge(a, b)`` (or ``merge(a, b)`` then ``merge(b, a)``). The second run parked behind
the other kind of hold; the release handed it what it could not claim (a slot for a run of a single lease,
a single lease for a run of slots); its claim failed, its next admit handed it the same again, and its
message went round about 27 times a second for good (900 deliveries in 30 s), its state ``QUEUED``, one
worker slot busy. Now the admit answers ``mixed`` and parks nothing: the run comes back later (a contention
retry), until the key is free of the other kind."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from celery_mongolock import LeaseStore, QueueTimeout

from . import integration_app as it
from .servers import RedisServer, wait_for
from .test_integration import Cluster, running_cluster
from .test_replace_keys import settled, tag

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(
    broker_url: str, redis_server: RedisServer, mongo_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """Two worker nodes on each broker in turn (Redis, then RabbitMQ), results in Redis."""
    with running_cluster("mk", broker_url, redis_server.url, mongo_url, tmp_path_factory, concurrency=2) as c:
        yield c


def holds_of(cluster: Cluster, tags: list[str]) -> dict[str, list[tuple[float, float, str]]]:
    """Each key's holds, ``(start, end, tag)``, from the bodies' own records."""
    holds: dict[str, list[tuple[float, float, str]]] = {}
    for t in tags:
        starts, ends = cluster.runs(t, "start"), cluster.runs(t, "end")
        assert len(starts) == 1 and len(ends) == 1, (t, starts, ends)  # each body ran once
        for key in starts[0]["keys"]:
            holds.setdefault(str(key), []).append((starts[0]["mono"], ends[0]["mono"], t))
    return holds


@pytest.mark.parametrize("calls", [["ab", "ba"], ["aa", "ab"], ["ab", "aa", "ba"]], ids="-".join)
def test_runs_that_take_one_key_as_slots_and_as_a_single_lease_all_run(
    cluster: Cluster, calls: list[str]
) -> None:
    names = {"a": tag(), "b": tag()}
    tags = [tag() for _ in calls]
    sent = [
        it.merge_kinds.apply_async((names[c[0]], names[c[1]], t), {"seconds": 1.0})
        for c, t in zip(calls, tags, strict=True)
    ]
    for result in sent:  # (before the fix, the run after the first was QUEUED for good)
        assert result.get(timeout=90) == sorted(
            {f"kind:{names[c]}" for c in "ab" if c in calls[sent.index(result)]}
        )
    # A run that held a key as a single lease overlapped nobody on it.
    single = {t: {f"kind:{names[c[1]]}"} for c, t in zip(calls, tags, strict=True)}
    for key, spans in holds_of(cluster, tags).items():
        for (_, e1, t1), (s2, _, t2) in itertools.combinations(sorted(spans), 2):
            if key in single[t1] or key in single[t2]:
                assert e1 <= s2, f"{t1} and {t2} held {key} at once, one of them as a single lease"
    settled(cluster, [f"kind:{n}" for n in names.values()])


def test_a_run_that_waits_on_the_other_kind_past_its_timeout_ends_by_its_then(cluster: Cluster) -> None:
    """A run waiting on a key in use as the other kind is not parked, but its ``Queue(timeout=...)`` counts
    all the same (from its first contention): past it, ``then`` ends it (skipped, or ``QueueTimeout``),
    unrun. Before, it came back every few seconds for as long as the other kind held the key."""
    a, b, c, d, e = (tag() for _ in range(5))
    holder = tag()
    it.merge_kinds.delay(a, b, holder, 60.0)  # holds kind:b as a single lease until its gate opens
    wait_for(lambda: cluster.runs(holder, "start"), timeout=60, message="the holder's body to start")
    # A run with no timeout waits as long as the key is held as the other kind: `why` shows it, though it
    # is parked nowhere (its worker notes it each time it is kept aside).
    waiting = it.merge_kinds.delay(b, e, tag())
    with LeaseStore(cluster.mongo_url, database=cluster.db_name) as store:

        def shown() -> Any:
            story = store.why(f"kind:{b}")
            return story if story and any(w.task_id == waiting.id for w in story.other_kind) else None

        story = wait_for(shown, timeout=60, message="why to show the run waiting as the other kind")
    wait = next(w for w in story.other_kind if w.task_id == waiting.id)
    assert wait.wants == "slots" and wait.task_name == "integration_app.merge_kinds" and story.parked == ()
    assert "to take it as a slot (not parked: each comes back within 5 s)" in story.verdict, story.verdict
    skipped = it.merge_kinds_timed.delay(b, c, tag())  # takes kind:b as slots: in use as the other kind
    failed = it.merge_kinds_timed_fail.delay(b, d, tag())
    outcome = skipped.get(timeout=90)
    assert outcome["mongolock"] == "skipped", outcome
    assert "in use as the other kind of key, past its policy's timeout=1" in outcome["reason"], outcome
    with pytest.raises(QueueTimeout, match="in use as the other kind of key"):
        failed.get(timeout=90)
    assert cluster.runs(holder, "end") == []  # (the key stayed held all along)
    cluster.db["gates"].insert_one({"_id": holder})
    wait_for(lambda: cluster.runs(holder, "end"), timeout=60, message="the holder's body to end")
    assert waiting.get(timeout=90) is not None  # (it ran once the key was free of the single lease)
    settled(cluster, [f"kind:{k}" for k in (a, b, c, d, e)])
