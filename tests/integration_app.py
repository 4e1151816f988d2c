"""The Celery app that the integration tests run in real ``celery worker`` processes.

Configured from the environment: MONGOLOCK_IT_BROKER (Redis or RabbitMQ), MONGOLOCK_IT_BACKEND (the result
backend; default: the broker's URL), MONGOLOCK_IT_MONGODB_URL, MONGOLOCK_IT_DB,
MONGOLOCK_IT_LEASE (lease seconds), MONGOLOCK_IT_HEARTBEAT (renewal seconds), MONGOLOCK_IT_READY_DIR
(worker_ready marker files).
Every task records what it did in MongoDB (collection ``runs``), so tests check outcomes, not logs.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import task_postrun, task_prerun, worker_ready
from pymongo import MongoClient

from celery_mongolock import (
    Fail,
    LeaseSet,
    Queue,
    Replace,
    Retry,
    Skip,
    Wait,
    current_lease,
    singleton_task,
)
from celery_mongolock.core.fencing import FencedOut, fenced_update_one
from celery_mongolock.signals import lease_acquired, lease_contended, lease_lost


def broker_transport_options(broker_url: str) -> dict[str, Any]:
    """What a broker needs so that nothing published is lost: on RabbitMQ, publisher confirms (a publish
    returns once the broker has the message; Celery's queues are durable and its messages persistent by
    default). Redis has no such option."""
    return {"confirm_publish": True} if broker_url.startswith(("amqp", "pyamqp")) else {}


# A failed test asks every worker process still alive for its threads' stacks (``workers.dump_stacks``):
# registered before Celery redirects stderr, inherited by the pool children it forks.
if sys.__stderr__ is not None:
    faulthandler.register(signal.SIGUSR2, file=sys.__stderr__, all_threads=True)

app = Celery("integration_app")
app.conf.update(
    broker_url=os.environ.get("MONGOLOCK_IT_BROKER", "memory://"),
    # MONGOLOCK_IT_CONFIRM=0: without publisher confirms (the worker-start warning's test).
    broker_transport_options=broker_transport_options(os.environ.get("MONGOLOCK_IT_BROKER", "memory://"))
    if os.environ.get("MONGOLOCK_IT_CONFIRM", "1") == "1"
    else {},
    result_backend=os.environ.get("MONGOLOCK_IT_BACKEND")
    or os.environ.get("MONGOLOCK_IT_BROKER", "cache+memory://"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    worker_prefetch_multiplier=1,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    mongolock_url=os.environ.get("MONGOLOCK_IT_MONGODB_URL", "mongodb://127.0.0.1:27017"),
    mongolock_database=os.environ.get("MONGOLOCK_IT_DB", "mongolock_it"),
    mongolock_lease_seconds=float(os.environ.get("MONGOLOCK_IT_LEASE", "30")),
    mongolock_operation_timeout=float(os.environ.get("MONGOLOCK_IT_OP_TIMEOUT", "10")),
    # MONGOLOCK_IT_HEARTBEAT: the renewal interval (default lease / 3); the parent also writes the history
    # of the leases it released for dead children at its heartbeat's ticks.
    mongolock_heartbeat_seconds=float(os.environ["MONGOLOCK_IT_HEARTBEAT"])
    if os.environ.get("MONGOLOCK_IT_HEARTBEAT")
    else None,
    mongolock_task_policies={
        "integration_app.per_task_skip": {"on_contention": "skip"},
        # MONGOLOCK_IT_CANCEL_GRACE: the grace of the cancel_running tasks, from settings (without it they
        # are cooperative only, grace=None, so that workers of other pools accept this app).
        **{
            name: {
                "on_contention": {
                    "policy": "replace",
                    "cancel_running": True,
                    "grace": float(os.environ["MONGOLOCK_IT_CANCEL_GRACE"]),
                }
            }
            for name in (
                "integration_app.cancel_polite",
                "integration_app.cancel_deaf",
                "integration_app.cancel_polite_keys",
                "integration_app.cancel_deaf_keys",
            )
            if os.environ.get("MONGOLOCK_IT_CANCEL_GRACE")
        },
    },
    # MONGOLOCK_IT_SIGNING_KEY: parked runs' stored messages signed (tests/test_trust_handoff.py).
    mongolock_signing_key=os.environ.get("MONGOLOCK_IT_SIGNING_KEY") or None,
    imports=("tests.rate_tasks",),  # the rate-limited tasks (RateLimit, Throttle)
    # MONGOLOCK_IT_HANDOFF_LANE=0: handoffs published to the end of their queue (tests/test_handoff_lanes.py).
    mongolock_handoff_lane=os.environ.get("MONGOLOCK_IT_HANDOFF_LANE", "1") != "0",
    # A key's lease document keeps 2 parked Queue runs of a priority, the rest are spilled
    # (``documents.spill``): every real-worker test with 3 or more runs parked on a key goes through it.
    mongolock_parked_window=int(os.environ.get("MONGOLOCK_IT_PARKED_WINDOW", "2")),
)

_clients: dict[int, MongoClient[dict[str, Any]]] = {}


def db() -> Any:
    """The test database, on the same server as the leases (one client per process: fork-safe)."""
    pid = os.getpid()
    if pid not in _clients:
        _clients[pid] = MongoClient(app.conf.mongolock_url)
    return _clients[pid][app.conf.mongolock_database]


def record(kind: str, tag: str, **fields: Any) -> None:
    lease = current_lease()
    db()["runs"].insert_one(
        {
            "kind": kind,
            "tag": tag,
            "pid": os.getpid(),
            "t": time.time(),
            "mono": time.monotonic(),
            "key": lease.key if lease else None,
            "fence": lease.fence if lease else None,
            "slot": lease.slot if lease else None,
            **fields,
        }
    )


@worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    ready_dir = os.environ.get("MONGOLOCK_IT_READY_DIR")
    if ready_dir:
        name = getattr(sender, "hostname", "worker")
        Path(ready_dir, f"{name}.ready").write_text(str(os.getpid()))


@lease_lost.connect
def _lost(key: str = "", reason: str = "", lease: Any = None, **_: Any) -> None:
    if getattr(lease, "store", None) is not getattr(app, "_mongolock_store", None):
        # Another test's lease, in a test process that imported this module: its server may be another
        # one, or none (this app's settings then point nowhere and the insert would block the
        # lost-lease callbacks of every other receiver for the driver's 30 s server selection).
        return
    db()["runs"].insert_one(
        {"kind": "lost", "key": key, "reason": reason, "pid": os.getpid(), "t": time.time()}
    )


@lease_contended.connect
def _contended(sender: Any = None, key: str = "", policy: str = "", **_: Any) -> None:
    if getattr(sender, "app", app) is not app:
        return  # another test's app, in a test process that imported this module
    db()["runs"].insert_one(
        {"kind": "contended", "key": key, "policy": policy, "pid": os.getpid(), "t": time.time()}
    )


def _work(tag: str, seconds: float) -> None:
    """The body: record start, work for ``seconds`` (the workload itself), record end."""
    record("start", tag)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        lease = current_lease()
        if lease is not None and lease.lost:
            record("noticed-lost", tag)
            return
    record("end", tag)


@singleton_task(key="resource:{resource}", app=app, name="integration_app.guarded")
def guarded(resource: str, tag: str, seconds: float = 0.3) -> str:
    _work(tag, seconds)
    return tag


@singleton_task(key="resource:{resource}", app=app, name="integration_app.skipper", on_contention=Skip())
def skipper(resource: str, tag: str, seconds: float = 0.3) -> str:
    _work(tag, seconds)
    return tag


@singleton_task(key="resource:{resource}", app=app, name="integration_app.failer", on_contention=Fail())
def failer(resource: str, tag: str, seconds: float = 0.3) -> str:
    _work(tag, seconds)
    return tag


@singleton_task(
    key="resource:{resource}",
    app=app,
    name="integration_app.waiter",
    on_contention=Wait(timeout=20, then=Fail()),
)
def waiter(resource: str, tag: str, seconds: float = 0.3) -> str:
    _work(tag, seconds)
    return tag


@singleton_task(
    key="resource:{resource}",
    app=app,
    name="integration_app.retrier",
    on_contention=Retry(countdown=0.2, backoff=1.5, max_countdown=1.0),
    bind=True,
    max_retries=1,
)
def retrier(self: Any, resource: str, tag: str, seconds: float = 0.3, fail_once: bool = False) -> str:
    if fail_once and self.request.retries == 0:
        record(
            "own-retry",
            tag,
            contention=int((self.request.headers or {}).get("mongolock_contention_retries", 0)),
        )
        raise self.retry(countdown=0.1)
    _work(tag, seconds)
    record("retries", tag, retries=self.request.retries)
    return tag


@singleton_task(
    key="resource:{resource}", app=app, name="integration_app.per_task_skip", on_contention="retry"
)
def per_task_skip(resource: str, tag: str, seconds: float = 0.3) -> str:
    _work(tag, seconds)
    return tag


@singleton_task(key="resource:{resource}", app=app, name="integration_app.unique", unique_send=True)
def unique(resource: str, tag: str, seconds: float = 0.3) -> str:
    """``unique_send``: an equal send while this run has not started returns this run."""
    _work(tag, seconds)
    return tag


@singleton_task(
    key="resource:{resource}",
    app=app,
    name="integration_app.unique_queued",
    unique_send=True,
    on_contention=Queue(),
)
def unique_queued(resource: str, tag: str, seconds: float = 0.3) -> str:
    """``unique_send`` with ``Queue``: a parked run has not started, so an equal send gets it."""
    _work(tag, seconds)
    return tag


@singleton_task(key="email-group:{group_id}", app=app, name="integration_app.upload_members")
def upload_members(group_id: int, upload: str, members: list[str], batch: int = 3) -> int:
    """Replace a group's members: clear it, then add the members in batches (slowly)."""
    record("start", upload)
    coll = db()["group_members"]
    coll.delete_many({"group": group_id})
    for i in range(0, len(members), batch):
        coll.insert_many([{"group": group_id, "email": m, "upload": upload} for m in members[i : i + batch]])
        time.sleep(0.05)
    record("end", upload)
    return len(members)


@singleton_task(key="resource:{resource}", app=app, name="integration_app.queued", on_contention=Queue())
def queued(resource: str, tag: str, seconds: float = 0.3) -> str:
    _work(tag, seconds)
    return tag


@singleton_task(
    key="resource:{resource}",
    app=app,
    name="integration_app.queued_own_priority",
    on_contention=Queue(),
    bind=True,
)
def queued_own_priority(self: Any, resource: str, tag: str) -> str:
    """A queued task that records the priority its request carries (a handoff through a lane puts the
    run's own back: ``lanes.restore_route``)."""
    record("start", tag, priority=(self.request.delivery_info or {}).get("priority"))
    record("end", tag)
    return tag


@singleton_task(
    key="resource:{resource}",
    app=app,
    name="integration_app.queued_briefly",
    on_contention=Queue(timeout=1.0, then=Fail()),
)
def queued_briefly(resource: str, tag: str, seconds: float = 0.3) -> str:
    _work(tag, seconds)
    return tag


@singleton_task(key="resource:{resource}", app=app, name="integration_app.latest", on_contention="replace")
def latest(resource: str, tag: str, seconds: float = 0.3, gate: bool = False) -> str:
    """``gate``: the body runs until the test opens its gate (as ``gated``), not for ``seconds``."""
    if gate:
        return _until_gate(tag)
    _work(tag, seconds)
    return tag


@singleton_task(key="resource:{resource}", app=app, name="integration_app.gated", on_contention=Queue())
def gated(resource: str, tag: str) -> str:
    """A queued task whose body runs until the test opens its gate (a document ``gates/<tag>``)."""
    return _until_gate(tag)


@singleton_task(key="resource:{resource}", app=app, name="integration_app.held_before_body")
def held_before_body(resource: str, tag: str) -> str:
    """A task whose first delivery waits, holding its key, before its body starts (``_before_body``)."""
    record("start", tag)
    return tag


@lease_acquired.connect
def _before_body(sender: Any = None, lease: Any = None, **_: Any) -> None:
    """``held_before_body``'s first delivery, its key taken and its body not started, waits for the test
    to open its gate (``gates/before-<tag>``, at most 120 s): where a SIGTERM to its child lands."""
    if getattr(sender, "name", None) != "integration_app.held_before_body":
        return
    tag = str(sender.request.args[1])
    if db()["runs"].find_one({"kind": "before-body", "tag": tag}) is not None:
        return  # a later delivery goes on
    record("before-body", tag)
    deadline = time.monotonic() + 120
    while db()["gates"].find_one({"_id": f"before-{tag}"}) is None and time.monotonic() < deadline:
        time.sleep(0.01)


def _until_gate(tag: str) -> str:
    """A body that runs until the test opens its gate (a document ``gates/<tag>``; at most 120 s)."""
    record("start", tag)
    deadline = time.monotonic() + 120
    while db()["gates"].find_one({"_id": tag}) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    record("end", tag)
    return tag


@app.task(name="integration_app.plain_recorded")
def plain_recorded(tag: str, seconds: float = 0.02) -> str:
    """A plain task (no lease) that records its start: the broker's backlog of tests/test_handoff_lanes.py."""
    db()["runs"].insert_one({"kind": "plain", "tag": tag, "t": time.time(), "mono": time.monotonic()})
    time.sleep(seconds)
    return tag


@singleton_task(
    key="resource:{resource}", app=app, name="integration_app.queued_retry", on_contention=Queue(), bind=True
)
def queued_retry(self: Any, resource: str, tag: str, seconds: float = 0.1) -> str:
    """A queued task whose body retries once (Celery's own retry, not a contention retry)."""
    if self.request.retries == 0:
        record("own-retry", tag)
        raise self.retry(countdown=0.2)
    _work(tag, seconds)
    return tag


@singleton_task(
    keys=("resource:{src}", "resource:{dst}"),
    app=app,
    name="integration_app.merge_debounced_retry",
    on_contention=Replace(debounce=0.5),
    bind=True,
)
def merge_debounced_retry(self: Any, src: str, dst: str, tag: str) -> list[str]:
    """A debounced set of two keys whose first attempt retries once (Celery's own retry)."""
    if self.request.retries == 0:
        record("own-retry", tag)
        raise self.retry(countdown=0.2)
    return _merge_body(tag, 0.1)


@singleton_task(
    key="resource:{resource}",
    app=app,
    name="integration_app.debounced",
    on_contention=Replace(debounce=1.0),
)
def debounced(resource: str, tag: str, seconds: float = 0.1) -> str:
    _work(tag, seconds)
    return tag


@singleton_task(
    key="tenant:{tenant}",
    app=app,
    name="integration_app.per_tenant",
    limit=3,
    on_contention=Retry(countdown=0.1, backoff=1.5, max_countdown=0.5),
)
def per_tenant(tenant: str, tag: str, seconds: float = 0.5) -> str:
    _work(tag, seconds)
    return tag


@singleton_task(
    key="tenant:{tenant}", app=app, name="integration_app.per_tenant_queued", limit=3, on_contention=Queue()
)
def per_tenant_queued(tenant: str, tag: str, seconds: float = 0.5) -> str:
    _work(tag, seconds)
    return tag


@singleton_task(
    key="tenant:{tenant}", app=app, name="integration_app.per_tenant_latest", limit=2, on_contention=Replace()
)
def per_tenant_latest(tenant: str, tag: str, seconds: float = 0.5) -> str:
    _work(tag, seconds)
    return tag


@singleton_task(
    keys=("resource:{src}", "resource:{dst}"),
    app=app,
    name="integration_app.merge",
    on_contention=Retry(countdown=0.05, backoff=1.5, max_countdown=0.3),
)
def merge(src: str, dst: str, tag: str, seconds: float = 0.2) -> list[str]:
    """Needs both keys: records the keys and fences it holds, then works."""
    return _merge_body(tag, seconds)


@singleton_task(
    keys=("resource:{src}", "resource:{dst}"),
    app=app,
    name="integration_app.merge_queued",
    on_contention=Queue(),
)
def merge_queued(src: str, dst: str, tag: str, seconds: float = 0.2) -> list[str]:
    """``merge`` under Queue: waits for both keys in send order, keeping its place on each."""
    return _merge_body(tag, seconds)


@singleton_task(
    keys=("kind:{src}", "kind:{dst}"),
    limit={"kind:{src}": 3},
    app=app,
    name="integration_app.merge_kinds",
    on_contention=Queue(),
)
def merge_kinds(src: str, dst: str, tag: str, seconds: float = 0.2) -> list[str]:
    """``merge_queued`` whose source key has 3 slots and whose destination key is a single lease: one
    rendered key is slots in one run and a single lease in another (``merge_kinds(a, b)`` and
    ``merge_kinds(b, a)``, or ``merge_kinds(a, a)``, whose two specs hold ``kind:a`` once, as a single
    lease)."""
    return _merge_body(tag, seconds)


@singleton_task(
    keys=("kind:{src}", "kind:{dst}"),
    limit={"kind:{src}": 3},
    app=app,
    name="integration_app.merge_kinds_timed",
    on_contention=Queue(timeout=1.0),
)
def merge_kinds_timed(src: str, dst: str, tag: str, seconds: float = 0.2) -> list[str]:
    """``merge_kinds`` that waits at most 1 s (then skipped), parked or waiting on the other kind."""
    return _merge_body(tag, seconds)


@singleton_task(
    keys=("kind:{src}", "kind:{dst}"),
    limit={"kind:{src}": 3},
    app=app,
    name="integration_app.merge_kinds_timed_fail",
    on_contention=Queue(timeout=1.0, then=Fail()),
)
def merge_kinds_timed_fail(src: str, dst: str, tag: str, seconds: float = 0.2) -> list[str]:
    """``merge_kinds_timed`` that fails (``QueueTimeout``) past its timeout."""
    return _merge_body(tag, seconds)


@singleton_task(
    keys=("resource:{src}", "resource:{dst}"),
    app=app,
    name="integration_app.merge_latest",
    on_contention=Replace(),
)
def merge_latest(src: str, dst: str, tag: str, seconds: float = 0.2) -> list[str]:
    """``merge`` under Replace: the newest send of a set of keys wins."""
    return _merge_body(tag, seconds)


@singleton_task(
    keys=("resource:{src}", "resource:{dst}"),
    app=app,
    name="integration_app.merge_debounced",
    on_contention=Replace(debounce=1.0),
)
def merge_debounced(src: str, dst: str, tag: str, seconds: float = 0.2) -> list[str]:
    """``merge`` under ``Replace(debounce=1.0)``: a burst of sends of one set of keys runs once, the
    newest, a second after the last send reached a worker."""
    return _merge_body(tag, seconds)


@singleton_task(
    keys=("resource:{src}", "resource:{dst}"),
    app=app,
    name="integration_app.merge_capped",
    on_contention=Replace(debounce=1.0, max_wait=3.0),
)
def merge_capped(src: str, dst: str, tag: str, seconds: float = 0.2) -> list[str]:
    """``merge_debounced`` with a ceiling: a set of keys that keeps receiving sends runs by ``max_wait``."""
    return _merge_body(tag, seconds)


@singleton_task(
    key="resource:{resource}",
    app=app,
    name="integration_app.debounced_capped",
    on_contention=Replace(debounce=1.0, max_wait=3.0),
)
def debounced_capped(resource: str, tag: str, seconds: float = 0.1) -> str:
    """A key that keeps receiving sends (more often than the debounce) runs by the ceiling."""
    _work(tag, seconds)
    return tag


@singleton_task(
    keys=("resource:{src}", "resource:{dst}"),
    app=app,
    name="integration_app.merge_queued_briefly",
    on_contention=Queue(timeout=1.0, then=Fail()),
)
def merge_queued_briefly(src: str, dst: str, tag: str, seconds: float = 0.2) -> list[str]:
    return _merge_body(tag, seconds)


@singleton_task(
    keys=("resource:{src}", "resource:{dst}"),
    app=app,
    name="integration_app.merge_retried",
    bind=True,
    on_contention=Queue(),
)
def merge_retried(self: Any, src: str, dst: str, tag: str) -> int:
    """``merge_queued`` whose first attempt's body waits until the test lets it go (a ``go`` record with its
    tag), then calls ``self.retry()`` (in 1 s, as a body that backs off: the task's state is RETRY until
    the second attempt writes QUEUED); the second attempt returns its number. Every body start is
    recorded with its attempt (``retries``)."""
    retries = int(self.request.retries or 0)
    db()["runs"].insert_one(
        {"kind": "start", "tag": tag, "retries": retries, "mono": time.monotonic(), "t": time.time()}
    )
    if retries == 0:
        deadline = time.monotonic() + 60
        while not db()["runs"].find_one({"kind": "go", "tag": tag}) and time.monotonic() < deadline:
            time.sleep(0.02)
        raise self.retry(countdown=1)
    return retries


@task_postrun.connect
def _postrun(sender: Any = None, task_id: Any = None, state: Any = None, **_: Any) -> None:
    """How each delivery of ``merge_retried`` ended in the worker (``IGNORED``: parked or dropped)."""
    if getattr(sender, "name", None) == "integration_app.merge_retried":
        db()["runs"].insert_one(
            {"kind": "postrun", "task_id": task_id, "state": str(state), "mono": time.monotonic()}
        )


def _merge_body(tag: str, seconds: float) -> list[str]:
    lease = current_lease()
    assert lease is not None
    keys = sorted(getattr(lease, "keys", [lease.key]))
    db()["runs"].insert_one(
        {
            "kind": "start",
            "tag": tag,
            "keys": keys,
            "fences": getattr(lease, "fences", {}),
            "mono": time.monotonic(),
            "t": time.time(),
            "pid": os.getpid(),
        }
    )
    deadline = time.monotonic() + seconds
    # A long body (over 10 s) ends when its test opens its gate (``gates/<tag>``), looked at every 0.25 s.
    gated, looked = seconds > 10, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.02)
        lease.raise_if_lost()
        if gated and time.monotonic() - looked > 0.25:
            looked = time.monotonic()
            if db()["gates"].find_one({"_id": tag}) is not None:
                break
    db()["runs"].insert_one(
        {"kind": "end", "tag": tag, "keys": keys, "mono": time.monotonic(), "t": time.time()}
    )
    return keys


@singleton_task(
    keys=("tenant:{tenant}", "group:{group}"),
    limit={"tenant:{tenant}": 3},
    app=app,
    name="integration_app.tenant_upload",
    on_contention=Retry(countdown=0.1, backoff=1.5, max_countdown=0.5),
)
def tenant_upload(tenant: str, group: str, tag: str, seconds: float = 0.5) -> list[str]:
    """The multi-tenant upload: at most 3 uploads of one tenant at once, one of one group."""
    lease = current_lease()
    assert lease is not None
    db()["runs"].insert_one(
        {
            "kind": "slots",
            "tag": tag,
            "slots": {k: held.slot for k, held in getattr(lease, "leases", {lease.key: lease}).items()},
            "fences": getattr(lease, "fences", {}),
        }
    )
    return _merge_body(tag, seconds)


#: The minimum hold of the ``*_window`` tasks: at most ``limit`` starts of a key in any window this long.
WINDOW = 2.0


def _held(tag: str) -> str:
    """A short body that records when each of its leases was taken (server clock) and its slots."""
    lease = current_lease()
    assert lease is not None
    leases = getattr(lease, "leases", {lease.key: lease})
    db()["runs"].insert_one(
        {
            "kind": "held",
            "tag": tag,
            "mono": time.monotonic(),
            "acquired": {k.replace(".", "_"): held.acquired_at for k, held in leases.items()},
            "slots": {k.replace(".", "_"): held.slot for k, held in leases.items()},
        }
    )
    time.sleep(0.05)  # the work (short: the minimum hold, not the body, keeps the slot)
    db()["runs"].insert_one({"kind": "held-end", "tag": tag, "mono": time.monotonic()})
    return tag


@singleton_task(
    key="tenant:{tenant}",
    app=app,
    name="integration_app.per_tenant_window",
    limit=2,
    min_hold_seconds=WINDOW,
    on_contention=Retry(countdown=0.1, backoff=1.5, max_countdown=0.5),
)
def per_tenant_window(tenant: str, tag: str) -> str:
    """At most 2 starts of one tenant in any ``WINDOW`` seconds, contended runs retried."""
    return _held(tag)


@singleton_task(
    key="tenant:{tenant}",
    app=app,
    name="integration_app.per_tenant_window_queued",
    limit=2,
    min_hold_seconds=WINDOW,
    on_contention=Queue(),
)
def per_tenant_window_queued(tenant: str, tag: str) -> str:
    """``per_tenant_window`` under Queue: a parked run is handed a slot when a hold ends."""
    return _held(tag)


@singleton_task(
    keys=("tenant:{tenant}", "group:{group}"),
    limit={"tenant:{tenant}": 2},
    min_hold_seconds=WINDOW,
    app=app,
    name="integration_app.tenant_upload_window",
    on_contention=Retry(countdown=0.1, backoff=1.5, max_countdown=0.5),
)
def tenant_upload_window(tenant: str, group: str, tag: str) -> str:
    """Several keys, a limit on one, and a minimum hold on every key."""
    return _held(tag)


@singleton_task(
    keys=("tenant:{tenant}", "group:{group}"),
    limit={"tenant:{tenant}": 2},
    app=app,
    name="integration_app.tenant_upload_queued",
    on_contention=Queue(),
)
def tenant_upload_queued(tenant: str, group: str, tag: str) -> str:
    """Several keys, 2 slots of the tenant key, under Queue: parked and reserved on each key."""
    return _held(tag)


@task_prerun.connect
def _reached(sender: Any = None, task_id: str = "", **_: Any) -> None:
    """When a run of a cancel_running task reached a worker (before its admission)."""
    if getattr(sender, "name", "").startswith("integration_app.cancel_"):
        db()["runs"].insert_one({"kind": "reached", "task_id": task_id, "t": time.time()})


@singleton_task(
    key="resource:{resource}",
    app=app,
    name="integration_app.cancel_polite",
    on_contention=Replace(cancel_running=True, grace=None),
)
def cancel_polite(resource: str, tag: str, seconds: float = 0.3, report: int | None = None) -> str:
    """``Replace(cancel_running=True)``, cooperative: polls ``raise_if_superseded()`` while it works; with
    ``report``, writes a fenced report document at every step and records the writes refused."""
    lease = current_lease()
    assert lease is not None
    record("start", tag)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        superseded = lease.superseded  # (before the write: once told, the write must be refused)
        if report is not None:
            try:
                fenced_update_one(db()["reports"], {"_id": report}, {"$set": {"by": tag}}, lease, upsert=True)
            except FencedOut as exc:
                record("refused", tag, by=exc.superseded_by, superseded=superseded)
        if superseded:
            record("noticed", tag, by=lease.superseded_by)
            lease.raise_if_superseded()
        time.sleep(0.01)
    record("end", tag)
    return tag


@singleton_task(
    key="resource:{resource}",
    app=app,
    name="integration_app.cancel_deaf",
    on_contention=Replace(cancel_running=True, grace=None),
)
def cancel_deaf(resource: str, tag: str, seconds: float = 0.3) -> str:
    """``Replace(cancel_running=True)`` whose body never looks: it is ended by its grace."""
    lease = current_lease()
    assert lease is not None
    lease.on_superseded(lambda _lease, by: record("told", tag, by=by))
    record("start", tag)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
    record("end", tag)
    return tag


@singleton_task(
    keys=("resource:{resource}", "group:{group}"),
    app=app,
    name="integration_app.cancel_polite_keys",
    on_contention=Replace(cancel_running=True, grace=None),
)
def cancel_polite_keys(
    resource: str, group: str, tag: str, seconds: float = 0.3, report: int | None = None
) -> str:
    """``cancel_polite`` over a set of two keys: a newer send of the same set tells it; its fenced report
    is written with its ``group`` key's lease (the one a newer send reaches second)."""
    held = current_lease()
    assert held is not None
    lease = held[f"group:{group}"]  # type: ignore[index]
    record("start", tag)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        superseded = held.superseded
        if report is not None:
            try:
                fenced_update_one(db()["reports"], {"_id": report}, {"$set": {"by": tag}}, lease, upsert=True)
            except FencedOut as exc:
                record("refused", tag, by=exc.superseded_by, superseded=superseded)
        if superseded:
            record("noticed", tag, by=held.superseded_by)
            held.raise_if_superseded()
        time.sleep(0.01)
    record("end", tag)
    return tag


@singleton_task(
    keys=("resource:{resource}", "group:{group}"),
    app=app,
    name="integration_app.cancel_deaf_keys",
    on_contention=Replace(cancel_running=True, grace=None),
)
def cancel_deaf_keys(resource: str, group: str, tag: str, seconds: float = 0.3) -> str:
    """``cancel_deaf`` over a set of two keys: it never looks, and is ended by its grace."""
    held = current_lease()
    assert held is not None
    held.on_superseded(lambda _lease, by: record("told", tag, by=by))
    record("start", tag)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
    record("end", tag)
    return tag


@singleton_task(
    keys=("acct:{tenant}", "group:{group}"),
    limit={"acct:{tenant}": 2},
    app=app,
    name="integration_app.tenant_upload_capped",
    on_contention=Replace(debounce=1.0, max_wait=3.0),
)
def tenant_upload_capped(tenant: str, group: str, tag: str, seconds: float = 0.1) -> list[str]:
    """``merge_capped`` with a limit on one key of the set, which sorts first (``acct:`` before
    ``group:``): a set that keeps receiving sends still runs by ``max_wait``."""
    return _merge_body(tag, seconds)


@singleton_task(
    keys=("acct:{tenant}", "group:{group}"),
    limit={"acct:{tenant}": 2, "group:{group}": 2},
    app=app,
    name="integration_app.tenant_upload_all_limited",
    on_contention=Replace(debounce=1.0, max_wait=3.0),
)
def tenant_upload_all_limited(tenant: str, group: str, tag: str, seconds: float = 0.1) -> list[str]:
    """``tenant_upload_capped`` with a limit on every key of the set: a set that keeps receiving sends
    still runs by ``max_wait``, its runs one at a time and in send order."""
    return _merge_body(tag, seconds)


@singleton_task(
    keys=("acct:{tenant}", "group:{group}"),
    limit={"acct:{tenant}": 2, "group:{group}": 2},
    app=app,
    name="integration_app.tenant_upload_debounced",
    on_contention=Replace(debounce=3.0),
)
def tenant_upload_debounced(tenant: str, group: str, tag: str, seconds: float = 0.1) -> list[str]:
    """A set whose keys all have limits, with a debounce long enough that a burst sent at once reaches
    the workers within it even on a busy machine."""
    return _merge_body(tag, seconds)


@singleton_task(
    keys=("tenant:{tenant}", "group:{group}"),
    limit={"tenant:{tenant}": 2},
    app=app,
    name="integration_app.tenant_upload_latest",
    on_contention=Replace(),
)
def tenant_upload_latest(tenant: str, group: str, tag: str, seconds: float = 0.3) -> list[str]:
    """The multi-tenant upload, latest-wins: at most 2 uploads of one tenant at once, one of one group,
    and of the sends for one group that waited, the newest runs (the older end superseded)."""
    return _merge_body(tag, seconds)


@app.task(name="integration_app.plain")
def plain(tag: str) -> str:
    return tag


# -- canvas: callbacks, chains and chords of runs that end without their body -----------------------------
@singleton_task(
    key="resource:{resource}",
    app=app,
    name="integration_app.latest_failing",
    on_contention=Replace(fail_superseded=True),
)
def latest_failing(resource: str, tag: str, seconds: float = 0.3) -> str:
    """``latest`` whose superseded runs end FAILURE (``Superseded``): their link_error callbacks run."""
    _work(tag, seconds)
    return tag


@app.task(name="integration_app.noted")
def noted(value: Any, tag: str) -> dict[str, Any]:
    """A callback, an errback (``value``: the failed task's id) or a chord's body: records what it got,
    and whether ``is_superseded`` says it is a superseded run's result."""
    from celery_mongolock import is_superseded

    db()["runs"].insert_one(
        {
            "kind": "noted",
            "tag": tag,
            "value": value,
            "superseded": is_superseded(value),
            "mono": time.monotonic(),
        }
    )
    return {"tag": tag, "value": value}


# -- beat -------------------------------------------------------------------------------------------------


# -- reentrant runs: a body that holds its own key again, a singleton function called in-process ------
# Fail on contention: without reentrance each of these would wait for itself and fail.


@singleton_task(key="resource:{resource}", app=app, name="integration_app.self_holder", on_contention=Fail())
def self_holder(resource: str, tag: str) -> str:
    """Holds its own key again through the app's store, and records both fences and the holds."""
    return _hold_own_key(f"resource:{resource}", tag, None)


@singleton_task(
    key="tenant:{tenant}", app=app, name="integration_app.slot_self_holder", limit=2, on_contention=Fail()
)
def slot_self_holder(tenant: str, tag: str) -> str:
    """``self_holder`` on a ``limit=2`` key: the reentrant hold is the run's own slot."""
    return _hold_own_key(f"tenant:{tenant}", tag, 2)


def _hold_own_key(key: str, tag: str, limit: int | None) -> str:
    from celery_mongolock.config import get_store

    outer = current_lease()
    assert outer is not None
    store = get_store(app)
    with store.hold(key, wait=5, limit=limit) as inner:
        info = store.inspect(key)
        record(
            "reentered",
            tag,
            outer_fence=outer.fence,
            inner_fence=inner.fence,
            outer_slot=outer.slot,
            inner_slot=inner.slot,
            depth=getattr(inner, "depth", None),
            holds=store.hold_count(key),
            slots_taken=len(info.slots) if info else None,
        )
    record("after-inner", tag, held=outer.held, holds=store.hold_count(key))
    return tag


@singleton_task(key="resource:{resource}", app=app, name="integration_app.one_of_them", on_contention=Fail())
def one_of_them(resource: str, tag: str) -> int:
    """Called in-process by ``pair_caller`` for one of its keys: records the lease it runs with."""
    record("inner-one", tag)
    lease = current_lease()
    assert lease is not None
    return lease.fence


@singleton_task(
    keys=("resource:{a}", "resource:{b}"), app=app, name="integration_app.pair_of_them", on_contention=Fail()
)
def pair_of_them(a: str, b: str, tag: str) -> dict[str, int]:
    """Called in-process by ``pair_caller`` for one of its keys and a key of its own."""
    lease = current_lease()
    assert isinstance(lease, LeaseSet)
    record("inner-pair", tag, fences=lease.fences)
    return dict(lease.fences)


@singleton_task(
    keys=("resource:{a}", "resource:{b}"), app=app, name="integration_app.pair_caller", on_contention=Fail()
)
def pair_caller(a: str, b: str, c: str, tag: str) -> dict[str, Any]:
    """A ``keys=`` task that calls other singleton functions in-process for overlapping keys."""
    lease = current_lease()
    assert isinstance(lease, LeaseSet)
    fences = dict(lease.fences)
    one = one_of_them(a, tag)
    pair = pair_of_them(b, c, tag)
    return {"outer": fences, "one": one, "pair": pair, "held": lease.held}


@singleton_task(key="beat-job", app=app, name="integration_app.beat_job", on_contention=Skip())
def beat_job(label: str = "beat") -> str:
    """A beat-scheduled singleton job: records the tick it was sent for."""
    from celery_mongolock.beat import BEAT_HEADER
    from celery_mongolock.task import SingletonTask

    request = beat_job.request
    stamp = (request.headers or {}).get(BEAT_HEADER) or {}
    assert isinstance(beat_job, SingletonTask)
    record("beat", label, tick=stamp.get("tick"), sent_for=stamp.get("entry"))
    return label


@app.task(name="integration_app.plain_tick")
def plain_tick(label: str = "plain") -> str:
    from celery_mongolock.beat import BEAT_HEADER

    stamp = (plain_tick.request.headers or {}).get(BEAT_HEADER) or {}
    record("plain-beat", label, tick=stamp.get("tick"))
    return label


if os.environ.get("MONGOLOCK_IT_BEAT_SECONDS"):
    _every = float(os.environ["MONGOLOCK_IT_BEAT_SECONDS"])
    app.conf.beat_schedule = {
        "singleton-job": {"task": "integration_app.beat_job", "schedule": _every, "args": ("singleton",)},
        "plain-job": {"task": "integration_app.plain_tick", "schedule": _every, "args": ("plain",)},
    }
    app.conf.beat_scheduler = "celery_mongolock.beat:Scheduler"
    app.conf.mongolock_beat_lease_seconds = float(os.environ.get("MONGOLOCK_IT_BEAT_LEASE", "3"))
    app.conf.beat_max_loop_interval = 1
