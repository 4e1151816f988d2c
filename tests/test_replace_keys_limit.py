"""``Replace`` with ``keys=`` and a limit per key, the multi-tenant upload latest-wins
(``keys=("tenant:{tenant}", "group:{group}"), limit={"tenant:{tenant}": 2}, on_contention=Replace()``),
with real ``celery worker`` processes (prefork) on each broker: at most 2 uploads of one tenant at once,
at most one of one group; of a burst of sends for one group, only the newest runs (besides the one running
when it came), the others end superseded by a newer send, whether they waited for the group or for a slot
of the tenant; uploads of other groups are no competitors and all run; nothing is left held, parked,
reserved or to write."""

from __future__ import annotations

import itertools

import pytest

from . import integration_app as it
from .servers import wait_for
from .test_integration import Cluster
from .test_limit import overlap_peak
from .test_replace_keys import cluster, settled, started, tag

# (``cluster``: two worker nodes of 3 children each, more than the limit, on each broker in turn)
__all__ = ["cluster"]

pytestmark = pytest.mark.slow


def keys_of(tenant: str, group: str) -> list[str]:
    return sorted([f"tenant:{tenant}", f"group:{group}"])


def spans(cluster: Cluster, tags: list[str]) -> list[tuple[float, float]]:
    out = []
    for t in tags:
        for start, end in zip(cluster.runs(t, "start"), cluster.runs(t, "end"), strict=True):
            out.append((start["mono"], end["mono"]))
    return out


def no_group_overlap(cluster: Cluster, tags: list[str]) -> None:
    """No two runs of one group at once (the tenant's slots are counted by ``overlap_peak``)."""
    holds: dict[str, list[tuple[float, float, str]]] = {}
    for t in tags:
        for start, end in zip(cluster.runs(t, "start"), cluster.runs(t, "end"), strict=True):
            for key in start["keys"]:
                if key.startswith("group:"):
                    holds.setdefault(key, []).append((start["mono"], end["mono"], t))
    for key, group_spans in holds.items():
        ordered = sorted(group_spans)
        for (_, e1, t1), (s2, _, t2) in itertools.pairwise(ordered):
            assert e1 <= s2, f"{t1} and {t2} held {key} at once"


def check_burst(results: list[object], ran: object, keys: list[str]) -> None:
    """The newest of the burst ran; each older one ended SUCCESS superseded by a newer send."""
    ids = [r.id for r in results]  # type: ignore[attr-defined]
    assert ran == keys
    for i, r in enumerate(results[:-1]):
        value = r.get(timeout=120)  # type: ignore[attr-defined]
        assert value["mongolock"] == "superseded", value
        assert value["keys"] == keys and value["by"] in ids[i + 1 :], "superseded only by a newer send"
        assert r.state == "SUCCESS"  # type: ignore[attr-defined]


def test_a_burst_for_one_group_runs_only_the_newest_while_other_groups_share_the_slots(
    cluster: Cluster,
) -> None:
    """The group is held: the burst's runs take a slot of the tenant each and keep it as a reservation
    while they wait for the group; each newer send takes the older one's reservation back."""
    tenant, group = tag(), tag()
    holder = tag()
    r0 = it.tenant_upload_latest.delay(tenant, group, holder, 1.5)
    wait_for(lambda: cluster.runs(holder, "start"), timeout=60, message="the first upload to start")
    burst = [tag() for _ in range(4)]
    results = [it.tenant_upload_latest.delay(tenant, group, t, 0.1) for t in burst]
    others = [(tag(), tag()) for _ in range(3)]  # uploads of other groups of the tenant: all run
    other_results = [it.tenant_upload_latest.delay(tenant, g, t, 0.6) for g, t in others]
    assert r0.get(timeout=120) == keys_of(tenant, group)
    check_burst(results, results[-1].get(timeout=120), keys_of(tenant, group))
    for (g, _), r in zip(others, other_results, strict=True):
        assert r.get(timeout=120) == keys_of(tenant, g)
    assert started(cluster, [holder, *burst]) == [holder, burst[-1]]
    ran = [holder, burst[-1], *(t for _, t in others)]
    no_group_overlap(cluster, ran)
    assert overlap_peak(spans(cluster, ran)) <= 2, "more than 2 uploads of one tenant at once, limit 2"
    settled(cluster, [f"tenant:{tenant}", *(f"group:{g}" for g in [group, *(g for g, _ in others)])])


def test_runs_parked_for_a_slot_of_a_full_tenant_are_superseded_by_a_newer_send(cluster: Cluster) -> None:
    """The tenant is full (2 long uploads of other groups): the burst's runs park for a slot of the
    tenant; only the newest runs once a slot frees, the older ones end superseded and hold no slot."""
    tenant, group = tag(), tag()
    holders = [(tag(), tag()) for _ in range(2)]
    held = [it.tenant_upload_latest.delay(tenant, g, t, 2.0) for g, t in holders]
    wait_for(
        lambda: all(cluster.runs(t, "start") for _, t in holders),
        timeout=60,
        message="two uploads of the tenant to start (every slot taken)",
    )
    burst = [tag() for _ in range(4)]
    results = [it.tenant_upload_latest.delay(tenant, group, t, 0.1) for t in burst]
    for (g, _), r in zip(holders, held, strict=True):
        assert r.get(timeout=120) == keys_of(tenant, g)
    check_burst(results, results[-1].get(timeout=120), keys_of(tenant, group))
    assert started(cluster, burst) == [burst[-1]]
    ran = [*(t for _, t in holders), burst[-1]]
    no_group_overlap(cluster, ran)
    assert overlap_peak(spans(cluster, ran)) <= 2
    settled(cluster, [f"tenant:{tenant}", f"group:{group}", *(f"group:{g}" for g, _ in holders)])
