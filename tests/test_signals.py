"""The worker shutdown hook and the lost-lease signal, against the real server, without a worker.

``signals`` imports nothing of the glue above it: the apps it releases leases for are the ones the task
glue registered (``signals.known_apps``), and the lost signal is hooked to the store by ``config``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_mongolock.config import get_store
from celery_mongolock.integration import signals
from celery_mongolock.testing import configure

from .servers import wait_for


@pytest.fixture
def app(mongo_url: str, db_name: str) -> Iterator[Celery]:
    app = Celery("signals", set_as_current=False)
    configure(app, mongo_url, db_name)
    yield app
    signals.known_apps.discard(app)
    configure(app, mongo_url, db_name)  # closes the store


def test_shutdown_releases_what_a_registered_app_holds(app: Celery) -> None:
    store = get_store(app)
    held = store.acquire("signals:held", ttl=60, heartbeat=True)
    assert held is not None
    signals.release_all_held()  # the app is not registered: none of our business
    assert not held.released
    signals.known_apps.add(app)
    signals.release_all_held()
    assert held.released
    # (a release that MongoDB did not answer in time goes on in the background: wait for the server's view)
    wait_for(
        lambda: not (store.inspect("signals:held") or pytest.fail("no lease document")).held,
        timeout=30,
        message="the server to see the key released",
    )
    assert store.held_leases() == []


def test_a_lost_lease_sends_lease_lost(app: Celery) -> None:
    store = get_store(app)
    got: list[dict[str, Any]] = []
    sent = threading.Event()

    def receiver(sender: Any, **kwargs: Any) -> None:
        got.append(kwargs)
        sent.set()

    signals.lease_lost.connect(receiver, weak=False)
    try:
        lease = store.acquire("signals:lost", ttl=60, heartbeat=True)
        assert lease is not None
        assert store.force_release("signals:lost")
        # The renewal matches nothing: lost (or the lease watch or the heartbeat's own renewal noticed
        # first: then renew_many leaves the lease out, as it is lost already).
        assert store.renew_many([lease]) in ([lease], [])
        assert lease.lost
        assert sent.wait(10), "lease_lost was not sent"
    finally:
        signals.lease_lost.disconnect(receiver)
    assert got[0]["key"] == "signals:lost" and got[0]["lease"] is lease
    assert "released by force" in got[0]["reason"]
