"""A run's delivery that finds the run over with no result stored yet, after a lost admit reply or not.

The admit is sent again with the same token. Meanwhile the lost send may have parked the run, the key
may have been handed to it, and its handoff message may have claimed the key, run the body and released
it: the second send then finds the run over while its result is on its way. Seen in CI
(``test_rate_workers``, a key with slots, run caf85af6): the first delivery ended the task ``already-ran``
7 ms before the handoff run stored its real result, and the caller got ``already-ran`` (Celery's backend
keeps the first result stored). Such a delivery is now looked at again later, as a marked copy: dropped
once a result is stored, ``already-ran`` when none ever will be (the run's worker died before storing it).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore
from pymongo.errors import AutoReconnect

from celery_mongolock import LeaseStore, Queue, Replace, Superseded, singleton_task
from celery_mongolock.config import get_store
from celery_mongolock.core.documents.sets import gate_of
from celery_mongolock.core.store_acquire import Acquisition
from celery_mongolock.exceptions import StoreUnavailable
from celery_mongolock.integration.duplicates import DUPLICATE_HEADER, LOOKED_AGAIN_HEADER
from celery_mongolock.integration.handoff import HANDOFF_HEADER
from celery_mongolock.integration.queued_run import QueuedRun

KEY = "upload:1"


def admit_one(task: Any, key: str) -> Any:
    """A queued run of one key reaching admission in a worker: its lease, or its outcome (or it raises)."""
    got = QueuedRun(task, [key], task._options(), one=True).take()
    return got[0] if isinstance(got, list) else got


def admit_set(task: Any, keys: list[str]) -> Any:
    """The same for a run of several keys: a ``LeaseSet`` of them all."""
    from celery_mongolock.core.lease_set import LeaseSet

    got = QueuedRun(task, keys, task._options(), one=False).take()
    return LeaseSet(got) if isinstance(got, list) else got


def _delivered(task: Any, run: str, headers: dict[str, Any], keys: list[str]) -> Any:
    """A delivery of the run ``run`` of a task of two keys (arguments ``(1, 1)``) reaching admission in a
    worker: its ``LeaseSet``, or its outcome (or it raises)."""
    task.push_request(
        id=run, args=(1, 1), kwargs={}, headers={"mongolock_sent": 100, **headers}, delivery_info={},
        hostname="w1", retries=0, is_eager=False, called_directly=False,
    )  # fmt: skip
    try:
        return admit_set(task, keys)
    finally:
        task.pop_request()


@pytest.fixture
def app(mongo_url: str, db_name: str) -> Iterator[Celery]:
    app = Celery("lost_admit_reply", broker="memory://", backend="cache+memory://")
    app.conf.update(mongolock_url=mongo_url, mongolock_database=db_name, mongolock_lease_seconds=5.0)
    yield app
    get_store(app).close()


def _lose_a_reply(monkeypatch: pytest.MonkeyPatch, key: str, meanwhile: Callable[[Any], None]) -> list[str]:
    """The first admit of ``key`` is applied, then ``meanwhile(reply)`` runs, then its reply is lost."""
    send_once = Acquisition._send_once
    sends: list[str] = []

    def reply_lost_once(self: Acquisition, attempt: Any, remaining: float) -> Any:
        doc = send_once(self, attempt, remaining)
        if "lost" in sends or not attempt.admitting or attempt.key != key:
            sends.append(f"answered {attempt.key}")
            return doc
        sends.append("lost")
        meanwhile(doc)
        raise AutoReconnect("the reply was lost")

    monkeypatch.setattr(Acquisition, "_send_once", reply_lost_once)
    return sends


def _admit(task: Any, run: str, headers: dict[str, Any], redelivered: bool = False) -> Any:
    """One delivery of ``task`` reaching admission in a worker."""
    task.push_request(
        id=run, args=(KEY,), kwargs={}, headers={"mongolock_sent": 100, **headers},
        delivery_info={"redelivered": redelivered}, hostname="w1", retries=0, is_eager=False,
        called_directly=False,
    )  # fmt: skip
    try:
        return admit_one(task, KEY)
    finally:
        task.pop_request()


def _upload(app: Celery, limit: int | None = None) -> Any:
    @singleton_task(
        key="{key}", app=app, name=f"lost_reply.upload{limit}", bind=True, on_contention=Queue(), limit=limit,
        shared=False,
    )  # fmt: skip
    def upload(self: Any, key: str) -> str:
        return key

    return upload


def _marked_copies(published: list[dict[str, Any]], run: str, header: str = LOOKED_AGAIN_HEADER) -> list[Any]:
    """The headers of the copies of ``run`` published marked with ``header``."""
    return [h for h in published if h.get("id") == run and h.get(header)]


def _second_look(task: Any, run: str, marked: dict[str, Any], args: tuple[Any, ...] = (KEY,)) -> Any:
    """The marked copy of a run found over without a result, delivered to a worker: the task is called as
    Celery's trace calls it (its result, or ``Ignore``)."""
    look = marked[LOOKED_AGAIN_HEADER]
    assert {"k": look["k"], "r": 0}.items() <= look.items(), marked
    assert marked.get("eta") is not None and marked.get("expires") is None, marked
    task.push_request(
        id=run, args=args, kwargs={}, headers={LOOKED_AGAIN_HEADER: look}, delivery_info={},
        hostname="w1", retries=0, is_eager=False, called_directly=False,
    )  # fmt: skip
    try:
        return task(*args)
    finally:
        task.pop_request()


@pytest.mark.parametrize("limit", [None, 2])
def test_a_first_delivery_whose_lost_send_parked_it_leaves_the_result_to_its_handoff_run(
    app: Celery, monkeypatch: pytest.MonkeyPatch, published: list[dict[str, Any]], limit: int | None
) -> None:
    upload = _upload(app, limit)
    store: LeaseStore = get_store(app)
    holders = [store.acquire(KEY, ttl=30, limit=limit) for _ in range(limit or 1)]
    assert all(holders)
    run = f"run-{uuid.uuid4().hex}"

    def handed_and_ran(reply: Any) -> None:
        # Before the reply reaches this worker: the lost send parked the run; a holder ends and the key is
        # handed to it; its handoff message claims the key, runs the body and releases the key.
        assert reply is not None and reply["lo"] == "parked", reply
        assert holders[0] is not None
        holders[0].release()
        handoffs = [h for h in published if h.get("id") == run and HANDOFF_HEADER in h]
        assert len(handoffs) == 1, published
        lease = _admit(upload, run, handoffs[0])
        assert lease.key == KEY
        lease.release()

    sends = _lose_a_reply(monkeypatch, KEY, handed_and_ran)
    with pytest.raises(Ignore):
        _admit(upload, run, {})
    # The lost send, the handoff run's own claim and release, then the same admit sent again.
    assert sends[0] == "lost" and sends[-1] == "answered upload:1", sends
    copies = _marked_copies(published, run)
    assert len(copies) == 1, published
    # The handoff run's worker stores its result; the copy, looked at later, leaves it alone.
    app.backend.mark_as_done(run, "its own result")
    with pytest.raises(Ignore):
        _second_look(upload, run, copies[0])
    assert app.backend.get_task_meta(run, cache=False)["result"] == "its own result"
    for lease in holders[1:]:
        assert lease is not None
        lease.release()


def test_a_first_delivery_whose_handoff_run_is_running_looks_again_without_a_warning(
    app: Celery,
    monkeypatch: pytest.MonkeyPatch,
    published: list[dict[str, Any]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    upload = _upload(app)
    store: LeaseStore = get_store(app)
    holder = store.acquire(KEY, ttl=30)
    assert holder is not None
    run = f"run-{uuid.uuid4().hex}"
    running: list[Any] = []

    def handed_and_running(reply: Any) -> None:
        assert reply is not None and reply["lo"] == "parked", reply
        holder.release()
        handoffs = [h for h in published if h.get("id") == run and HANDOFF_HEADER in h]
        running.append(_admit(upload, run, handoffs[0]))  # its body runs

    _lose_a_reply(monkeypatch, KEY, handed_and_running)
    with caplog.at_level("INFO", logger="celery_mongolock"), pytest.raises(Ignore):
        _admit(upload, run, {})
    assert len(_marked_copies(published, run, DUPLICATE_HEADER)) == 1, published
    ours = [
        r for r in caplog.records if r.name.startswith("celery_mongolock") and "another delivery" in r.msg
    ]
    assert [r.levelname for r in ours] == ["INFO"], caplog.records
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "duplicate" in r.getMessage()]
    running[0].release()


def test_a_second_delivery_of_a_run_that_ran_still_ends_already_ran_after_a_lost_reply(
    app: Celery, monkeypatch: pytest.MonkeyPatch, published: list[dict[str, Any]]
) -> None:
    """A message delivered twice without the broker's redelivered flag (a publish retried, a transport
    with no such flag): its run ran and its worker died before storing the result. The second delivery's
    admit loses its reply: it is looked at again as a copy, which ends the task ``already-ran``."""
    upload = _upload(app)
    run = f"run-{uuid.uuid4().hex}"
    lease = _admit(upload, run, {})
    lease.release()  # the body ended; its worker dies before Celery stores the result
    _lose_a_reply(monkeypatch, KEY, lambda reply: None)
    with pytest.raises(Ignore):
        _admit(upload, run, {})
    copies = _marked_copies(published, run)
    assert len(copies) == 1, published
    assert _second_look(upload, run, copies[0])["mongolock"] == "already-ran"


@pytest.mark.parametrize("result_stored", [True, False])
@pytest.mark.parametrize("lost_reply", [True, False])
def test_a_copy_that_finds_its_run_over_without_a_result_looks_again_before_already_ran(
    app: Celery,
    monkeypatch: pytest.MonkeyPatch,
    published: list[dict[str, Any]],
    lost_reply: bool,
    result_stored: bool,
) -> None:
    """A copy of a run (here redelivered by the broker) that comes between the run's release and its
    worker storing the result (the lock-set checker, Redis seed 21: a second handoff message of a run
    ended it ``already-ran`` 12 ms before the run's own result). The copy looks again one lease later:
    dropped when the result is stored by then, else the task ends ``already-ran``."""
    upload = _upload(app)
    run = f"run-{uuid.uuid4().hex}"
    lease = _admit(upload, run, {})
    lease.release()  # the body ended; the result is not stored yet
    if lost_reply:
        _lose_a_reply(monkeypatch, KEY, lambda reply: None)
    with pytest.raises(Ignore):
        _admit(upload, run, {}, redelivered=True)
    copies = _marked_copies(published, run)
    assert len(copies) == 1, published
    if result_stored:  # the run's worker stored its result meanwhile: the copy leaves it alone
        app.backend.mark_as_done(run, "its own result")
        with pytest.raises(Ignore):
            _second_look(upload, run, copies[0])
        assert app.backend.get_task_meta(run, cache=False)["result"] == "its own result"
    else:  # the run's worker died before storing it
        # The second look does not ask the key, which may have forgotten the run by then (it keeps its
        # last runs only): here its document is gone, and still the body does not run.
        assert get_store(app).collection.delete_one({"_id": KEY}).deleted_count == 1
        ended = _second_look(upload, run, copies[0])
        assert isinstance(ended, dict) and ended["mongolock"] == "already-ran", ended
    assert len(_marked_copies(published, run)) == 1  # looked at again once, not over and over


def test_the_same_for_a_run_that_needs_several_keys(
    app: Celery, monkeypatch: pytest.MonkeyPatch, published: list[dict[str, Any]]
) -> None:
    @singleton_task(
        keys=("a:{a}", "b:{b}"), app=app, name="lost_reply.pair", bind=True, on_contention=Queue(),
        shared=False,
    )  # fmt: skip
    def pair(self: Any, a: int, b: int) -> str:
        return "ran"

    store: LeaseStore = get_store(app)
    keys = ["a:1", "b:1"]
    # (a:1 held: the run parks on a:1, where the reply is lost; a run of several keys takes its keys one
    # at a time, so it holds nothing else then, and its handoff takes b:1 when it comes)
    holders = [store.acquire("a:1", ttl=30)]
    run = f"run-{uuid.uuid4().hex}"

    def take(headers: dict[str, Any]) -> Any:
        return _delivered(pair, run, headers, keys)

    def handed_and_ran(reply: Any) -> None:
        assert reply is not None and reply["lo"] == "parked", reply
        for lease in holders:  # the holder ends: the run is handed a:1, and published
            assert lease is not None
            lease.release()
        handoffs = [h for h in published if h.get("id") == run and HANDOFF_HEADER in h]
        assert len(handoffs) == 1, published
        taken = take(handoffs[0])
        assert sorted(taken.keys) == keys
        taken.release()

    sends = _lose_a_reply(monkeypatch, "a:1", handed_and_ran)
    with pytest.raises(Ignore):
        take({})
    assert "lost" in sends and sends[-1] == "answered a:1", sends
    copies = _marked_copies(published, run)
    assert len(copies) == 1, published
    assert copies[0][LOOKED_AGAIN_HEADER]["k"] == "a:1"
    app.backend.mark_as_done(run, "its own result")
    with pytest.raises(Ignore):
        _second_look(pair, run, copies[0], (1, 1))
    assert app.backend.get_task_meta(run, cache=False)["result"] == "its own result"


@pytest.mark.parametrize("fail_superseded", [False, True])
@pytest.mark.parametrize("several", [False, True], ids=["one-key", "keys"])
def test_a_run_that_stopped_for_a_newer_send_ends_superseded_when_its_result_was_never_stored(
    app: Celery, published: list[dict[str, Any]], several: bool, fail_superseded: bool
) -> None:
    """``Replace(cancel_running=True)``: the body stopped for a newer send and released its keys; its
    worker died before storing the result. Its copy finds the run over and looks again later; that look
    (which never reads the keys: here they are gone) ends the task as the run would have: superseded by
    the newer send (with all the run's keys), or ``Superseded`` raised with ``fail_superseded=True``."""
    policy = Replace(cancel_running=True, fail_superseded=fail_superseded)
    name = f"lost_reply.cx{several}{fail_superseded}"

    def pair(self: Any, a: int, b: int) -> str:
        return "ran"

    def one(self: Any, key: str) -> str:
        return "ran"

    args: tuple[Any, ...]
    if several:
        task = singleton_task(
            keys=("a:{a}", "b:{b}"), app=app, name=name, bind=True, on_contention=policy, shared=False
        )(pair)
        keys, args = ["a:1", "b:1"], (1, 1)
    else:
        task = singleton_task(key="{key}", app=app, name=name, bind=True, on_contention=policy, shared=False)(
            one
        )
        keys, args = [KEY], (KEY,)
    run = f"run-{uuid.uuid4().hex}"

    def deliver(redelivered: bool) -> Any:
        task.push_request(
            id=run, args=args, kwargs={}, headers={"mongolock_sent": 100}, hostname="w1", retries=0,
            delivery_info={"redelivered": redelivered}, is_eager=False, called_directly=False,
        )  # fmt: skip
        try:
            if several:
                return admit_set(task, keys)
            return admit_one(task, KEY)
        finally:
            task.pop_request()

    lease = deliver(False)
    # The newer send tells the run on one key (its last here): the lease watch marks that lease, and
    # ``supersede_together`` marks the others from a thread of its own, maybe after the body stopped.
    assert (list(lease)[-1] if several else lease).mark_superseded("the-newer-send")
    lease.end_superseded()  # the body raised Superseded out (``run_body``)
    lease.release()  # and its worker died before Celery stored the result
    with pytest.raises(Ignore):
        deliver(True)  # the broker delivers it again
    [marked] = _marked_copies(published, run)
    for key in keys:
        assert get_store(app).collection.delete_one({"_id": key}).deleted_count == 1
    if fail_superseded:
        with pytest.raises(Superseded) as raised:
            _second_look(task, run, marked, args)
        assert raised.value.key == keys[0] and raised.value.by == "the-newer-send"
        return
    ended = _second_look(task, run, marked, args)
    expected = {"mongolock": "superseded", "key": keys[0], "by": "the-newer-send"}
    assert ended == ({**expected, "keys": keys} if several else expected)


def test_a_second_look_is_dropped_while_a_later_attempt_of_the_task_is_parked(
    app: Celery, published: list[dict[str, Any]]
) -> None:
    """Attempt 1 ran, released its key and retried (``RETRY``); a second handoff message of it found it
    over with no result and published its second look. Attempt 2 then parked on the key, writing ``QUEUED``
    over the ``RETRY``. The second look must leave the task to attempt 2 (before: it ended the task
    ``already-ran``, and attempt 2 was then dropped as settled: its work lost; the lock-set checker)."""
    upload = _upload(app)
    store: LeaseStore = get_store(app)
    holder = store.acquire(KEY, ttl=30)
    assert holder is not None
    run = f"run-{uuid.uuid4().hex}"
    upload.push_request(
        id=run, args=(KEY,), kwargs={}, headers={"mongolock_sent": 100}, delivery_info={}, hostname="w1",
        retries=2, is_eager=False, called_directly=False,
    )  # fmt: skip
    try:
        with pytest.raises(Ignore):  # attempt 2 parks (state QUEUED)
            admit_one(upload, KEY)
    finally:
        upload.pop_request()
    assert app.backend.get_task_meta(run, cache=False)["status"] == "QUEUED"
    look = {"k": KEY, "r": 1}
    upload.push_request(
        id=run, args=(KEY,), kwargs={}, headers={LOOKED_AGAIN_HEADER: look}, delivery_info={}, hostname="w1",
        retries=1, is_eager=False, called_directly=False,
    )  # fmt: skip
    try:
        with pytest.raises(Ignore):  # dropped: attempt 2 carries the task on
            upload(KEY)
    finally:
        upload.pop_request()
    assert app.backend.get_task_meta(run, cache=False)["status"] == "QUEUED"
    holder.release()


def test_a_second_look_that_cannot_ask_mongodb_looks_again_later_instead_of_being_dropped(
    app: Celery, monkeypatch: pytest.MonkeyPatch, published: list[dict[str, Any]]
) -> None:
    """The second look of attempt 1 (its body ran, released its key and retried: ``RETRY``) must ask the
    key whether a later attempt carries the task on. When MongoDB does not answer it cannot tell: it
    publishes itself again for later, and the task keeps its state (before: it was dropped, and a task
    whose last attempt's worker died stayed ``STARTED`` for ever; the lock-set checker, Redis seed 1 in
    CI). Once MongoDB answers and no later attempt is known, it ends the task ``already-ran``."""
    upload = _upload(app)
    store: LeaseStore = get_store(app)
    run = f"run-{uuid.uuid4().hex}"
    app.backend.store_result(run, {"exc_type": "Retry", "exc_message": "retry"}, "RETRY")
    look = {"k": KEY, "r": 1}

    def second_look() -> Any:
        upload.push_request(
            id=run, args=(KEY,), kwargs={}, headers={LOOKED_AGAIN_HEADER: look}, delivery_info={},
            hostname="w1", retries=1, is_eager=False, called_directly=False,
        )  # fmt: skip
        try:
            return upload(KEY)
        finally:
            upload.pop_request()

    def unreachable(*_: Any, **__: Any) -> bool:
        raise StoreUnavailable("MongoDB did not answer (a test says so)")

    monkeypatch.setattr(store, "later_attempt", unreachable)
    with pytest.raises(Ignore):
        second_look()
    again = _marked_copies(published, run)
    assert len(again) == 1 and again[0][LOOKED_AGAIN_HEADER] == look, published
    assert app.backend.get_task_meta(run, cache=False)["status"] == "RETRY"
    monkeypatch.undo()
    ended = second_look()
    assert isinstance(ended, dict) and ended["mongolock"] == "already-ran", ended


@pytest.mark.parametrize("limit", [None, 2], ids=["single", "slots"])
@pytest.mark.parametrize("policy", ["queue", "replace"])
def test_a_redelivered_handoff_of_a_set_whose_run_ran_is_never_admitted_again(
    app: Celery, published: list[dict[str, Any]], policy: str, limit: int | None
) -> None:
    """A run of two keys waited on its second key, was handed it, ran and released both keys; its worker
    died before storing the result, and its handoff message comes again (``acks_late``). That delivery
    finds the run over: it looks again later and is never admitted again (nothing taken, parked or handed),
    and a result stored meanwhile is kept. (The loop stop 57 fixed, a redelivered handoff that went round
    from key to key, needed more than this: this test passes without that fix; the lock-set checker's
    RabbitMQ run found it.)"""

    @singleton_task(
        keys=("a:{a}", "b:{b}"), app=app, name=f"lost_reply.ran_{policy}{limit}", bind=True, shared=False,
        on_contention=Queue() if policy == "queue" else Replace(), limit=limit,
    )  # fmt: skip
    def pair(self: Any, a: int, b: int) -> str:
        return "ran"

    store: LeaseStore = get_store(app)
    keys = ["a:1", "b:1"]
    holders = [store.acquire("b:1", ttl=30, limit=limit) for _ in range(limit or 1)]
    assert all(holders)
    run = f"run-{uuid.uuid4().hex}"

    def take(headers: dict[str, Any]) -> Any:
        return _delivered(pair, run, headers, keys)

    with pytest.raises(Ignore):  # (it takes a:1 and waits on b:1)
        take({})
    for holder in holders:
        assert holder is not None
        holder.release()
    [published_handoff] = [h for h in published if h.get("id") == run and HANDOFF_HEADER in h]
    # (its custom headers, as a worker's request has them: Celery's own are attributes there)
    handoff = {name: value for name, value in published_handoff.items() if name.startswith("mongolock")}
    taken = take(handoff)
    assert sorted(taken.keys) == keys
    taken.release()  # (its body ran; its worker dies before storing the result)
    before = len(published)
    with pytest.raises(Ignore):
        take(handoff)  # the handoff message, delivered again
    for key in keys:  # (not taken again, nor parked, nor handed)
        info = store.inspect(key)
        assert info is None or not (info.held or info.parked or info.handoff), info
    [copy] = _marked_copies(published[before:], run)
    assert copy[LOOKED_AGAIN_HEADER]["k"] in [gate_of(keys), *keys]
    app.backend.mark_as_done(run, "its own result")
    with pytest.raises(Ignore):
        _second_look(pair, run, copy, (1, 1))
    assert app.backend.get_task_meta(run, cache=False)["result"] == "its own result"
