from __future__ import annotations

import contextlib
import gc
import os
import threading
import uuid
from collections.abc import Generator, Iterator
from typing import Any

import celery
import pluggy
import pytest
from celery.result import AsyncResult
from celery.signals import before_task_publish
from pymongo import MongoClient, monitoring
from pymongo.errors import OperationFailure

from celery_mongolock import LeaseStore
from celery_mongolock.embedded import EmbeddedMongo

from .servers import NO_RABBITMQ, RabbitMQServer, RedisServer, mongo_server

if celery.VERSION < (5, 7):
    # Celery before 5.7 (the version matrix, noxfile.py): the garbage collector can run
    # AsyncResult.__del__ in the middle of a Redis result-backend subscribe in this (the calling) process;
    # its unsubscribe then waits forever on the same connection (seen: the oldest session hung in
    # send_task). Celery 5.7's Redis backend defers that unsubscribe. The test process forgets results
    # instead; worker processes, where the library runs, are not touched.
    AsyncResult.__del__ = lambda self: None


# `make test` runs the suite in four processes (pytest-xdist, ``-n 4 --dist loadfile``: each file's tests in
# one process, which has servers of its own). Files are handed out in collection order, so the longest go
# first: a long file started last would leave the others idle at the end. The figures (seconds in a CI
# run, for the order only) are from its JUnit report (ci70, stop 61); a file not named here goes after.
LONGEST_FIRST = {
    "test_lockcheck.py": 740,  # the bounded runs on Redis, then RabbitMQ (one process: never side by side)
    "test_integration.py": 550,  # Redis and RabbitMQ
    "test_cli.py": 335,
    "test_benchmarks.py": 325,
    "test_replace_keys_debounce.py": 190,
    "test_queue.py": 185,
    "test_rate_workers.py": 160,
    "test_stepwise_replace.py": 150,
    "test_demo.py": 145,  # Redis and RabbitMQ
    "test_stepwise_model.py": 135,
    "test_unique_send_workers.py": 105,
    "test_handoff_lanes.py": 100,
    "test_security.py": 80,
    "test_packaging.py": 65,
    "test_document_lock.py": 60,
    "test_cancel_running.py": 60,
    "test_canvas_endings.py": 60,
    "test_spill_slots.py": 55,
    "test_quickstart.py": 55,
    "test_spill_model.py": 50,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist only: the files in ``LONGEST_FIRST`` first, longest first (a stable sort: the
    tests of a file keep their order)."""
    if config.getoption("dist", "no") == "no" and not hasattr(config, "workerinput"):
        return
    items.sort(key=lambda item: -LONGEST_FIRST.get(item.path.name, 0))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pluggy.Result[pytest.TestReport], None]:
    """A test that failed while real worker nodes were running shows their processes' stacks (every
    thread of the parent and of each pool child): a hung child is seen where it hangs, in CI's output."""
    outcome = yield
    report = outcome.get_result()
    if call.when == "call" and report.failed:
        from .workers import dump_stacks

        try:
            stacks = dump_stacks()
        except Exception as exc:  # a diagnostic: never let it break the run
            stacks = f"(the workers' stacks could not be dumped: {exc!r})"
        if stacks:
            report.sections.append(("worker stacks", stacks))


@pytest.fixture(autouse=True)
def _shared_tasks_stay_in_their_test() -> Iterator[None]:
    """A shared task a test declares (``@singleton_task`` without ``app=``, ``shared_task``) is offered to
    every app finalized later in the same process (Celery's ``_on_app_finalizers``), and two tests that
    each declare one under the same name (``tests.test_keys.merge``, or a how-to's ``proj.tasks.x``)
    then make every later app's finalize raise ``DuplicateTaskNameWarning`` (Celery 5.7; an error here):
    which tests fail depended on how xdist spread the files. Each test's shared tasks end with it."""
    from celery import _state

    before = set(_state._on_app_finalizers)
    yield
    _state._on_app_finalizers.intersection_update(before)


@pytest.fixture(scope="session")
def mongo() -> Iterator[tuple[str, str]]:
    """(url, kind) of the MongoDB server the tests use."""
    with mongo_server() as found:
        yield found


@pytest.fixture(scope="session")
def mongo_url(mongo: tuple[str, str]) -> str:
    return mongo[0]


@pytest.fixture
def db_name() -> str:
    """A database of its own for each test."""
    return f"mongolock_test_{uuid.uuid4().hex[:12]}"


class CommandCounter(monitoring.CommandListener):
    """Records the commands a client sends (pymongo command monitoring), minus connection chatter."""

    IGNORED = frozenset(
        {"hello", "isMaster", "ismaster", "endSessions", "ping", "buildInfo", "saslStart", "saslContinue"}
    )

    #: The lease watch's thread (one change stream per process, ``core.lease_watch``): its commands are
    #: kept apart in ``watch_commands`` (pymongo calls listeners in the thread that sends the command).
    WATCH_THREAD = "celery_mongolock-lease-watch"

    def __init__(self) -> None:
        self.commands: list[tuple[str, dict[str, Any]]] = []
        self.watch_commands: list[tuple[str, dict[str, Any]]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name not in self.IGNORED:
            watch = threading.current_thread().name == self.WATCH_THREAD
            into = self.watch_commands if watch else self.commands
            into.append((event.command_name, dict(event.command)))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass

    def names(self) -> list[str]:
        return [name for name, _ in self.commands]

    def clear(self) -> None:
        self.commands.clear()


@pytest.fixture
def counter() -> CommandCounter:
    return CommandCounter()


@pytest.fixture
def client(mongo_url: str, counter: CommandCounter) -> Iterator[MongoClient[dict[str, Any]]]:
    c: MongoClient[dict[str, Any]] = MongoClient(mongo_url, event_listeners=[counter], tz_aware=True)
    yield c
    c.close()


@pytest.fixture
def store(client: MongoClient[dict[str, Any]], db_name: str) -> Iterator[LeaseStore]:
    """A store on the shared server, in a database of its own, with a monitored client."""
    s = LeaseStore(client, database=db_name, lease_seconds=5)
    yield s
    s.close()
    # The database is this test's own (a unique name): left behind, it is in nobody's way. (CI of stop 49:
    # the embedded server answered "internal server error" to dropping one that had held documents near
    # 16 MiB, on a busy machine, after the test had passed.)
    with contextlib.suppress(OperationFailure):
        client.drop_database(db_name)


@pytest.fixture
def make_store(mongo_url: str, db_name: str) -> Iterator[Any]:
    """Factory for more stores (other "processes' views") on the same database, each with its own client."""
    made: list[LeaseStore] = []

    def factory(**kwargs: Any) -> LeaseStore:
        s = LeaseStore(kwargs.pop("url", mongo_url), database=db_name, **kwargs)
        made.append(s)
        return s

    yield factory
    for s in made:
        s.close()


@pytest.fixture
def published() -> Iterator[list[dict[str, Any]]]:
    """The headers of every task message published during the test."""
    seen: list[dict[str, Any]] = []

    def record(headers: dict[str, Any] | None = None, **_: Any) -> None:
        seen.append(dict(headers or {}))

    before_task_publish.connect(record, weak=False)
    yield seen
    before_task_publish.disconnect(record)


@pytest.fixture
def worker_app(mongo_url: str, db_name: str) -> Iterator[celery.Celery]:
    """A worker's app (no tasks) on this test's database, as its sweeper sees the store: in-memory broker
    and result backend."""
    from celery_mongolock.config import get_store

    app = celery.Celery(f"worker_{uuid.uuid4().hex[:6]}", broker="memory://", backend="cache+memory://")
    app.conf.update(mongolock_url=mongo_url, mongolock_database=db_name)
    yield app
    get_store(app).close()


@pytest.fixture
def own_server(tmp_path: Any) -> Iterator[Any]:
    """Factory for an embedded server of the test's own (to stop, kill, restart or arm fail points)."""
    servers: list[EmbeddedMongo] = []

    def factory(**kwargs: Any) -> EmbeddedMongo:
        server = EmbeddedMongo(**kwargs).start()
        servers.append(server)
        return server

    yield factory
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server
        # AsyncResults left in reference cycles unsubscribe from the result backend when collected: collect
        # them while Redis still runs (with Celery 5.3 a late collection failed the session: unraisable
        # ConnectionError and redis-py DeprecationWarning from AsyncResult.__del__).
        _collect_leftovers()


def _collect_leftovers() -> None:
    """Collect the test process's leftover broker clients at the end of the session, while the servers
    still run (AsyncResults left in reference cycles unsubscribe from the result backend when collected).

    An unclosed socket found here is no longer silenced: it fails the session (``filterwarnings = error``),
    and ``python -X tracemalloc=20 -m pytest ...`` says where it was opened. It was silenced after 19 of 50
    loaded soak sessions of the duplicate-delivery tests ended with one, in the change that also made
    ``LeaseStore.close()`` close its client whatever a last release or flush raised (which client leaked was
    not established). Without the silencing, a full loaded session of tests/test_integration.py and
    tests/test_duplicate_guard.py (load average 30 to 50, issue 32) ended without one."""
    gc.collect()


@pytest.fixture(scope="session")
def rabbitmq_server() -> Iterator[RabbitMQServer]:
    """A RabbitMQ node for the session (started on first use; skips when RabbitMQ is not installed)."""
    if NO_RABBITMQ:
        pytest.skip(NO_RABBITMQ)
    with RabbitMQServer() as server:
        yield server
        _collect_leftovers()


# The brokers the suites that run on both are run on: MONGOLOCK_TEST_BROKERS=redis for Redis only (the
# version matrix's oldest session in `make test`, noxfile.py, to keep CI short).
BROKERS = [b for b in os.environ.get("MONGOLOCK_TEST_BROKERS", "redis,rabbitmq").split(",") if b]
if not BROKERS or set(BROKERS) - {"redis", "rabbitmq"}:
    raise pytest.UsageError(
        f"MONGOLOCK_TEST_BROKERS: a comma-separated list of redis and rabbitmq, got {BROKERS}"
    )


@pytest.fixture(scope="session", params=BROKERS)
def broker_kind(request: pytest.FixtureRequest) -> str:
    """Each broker in turn, for the suites that run on both (a test that needs one names its server)."""
    return str(request.param)


@pytest.fixture(scope="session")
def broker_url(broker_kind: str, request: pytest.FixtureRequest) -> str:
    """The URL of the broker ``broker_kind`` names, started for the session."""
    server = request.getfixturevalue(f"{broker_kind}_server")
    return str(server.url)
