"""A pool child forked while another thread of the worker's main process held a kombu ``cached_property``
lock (the sweeper reading ``app.amqp`` to publish a handoff) or a Celery signal's lock must not hang on
it: ``integration.forksafe`` gives the child new locks. Each case holds the lock in a thread, forks, and
has the child take it; without the fork hook the child waits forever (seen once in CI: a cancel_running
holder's child hung on its handoff publish, in ``lanes.route_of``, and its run never ended)."""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery import Celery

from celery_mongolock.integration import forksafe, signals

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

#: How long a child may take to get the lock (it takes microseconds; only a hang reaches this).
HANG = 30.0


@contextmanager
def held(lock: Any) -> Iterator[None]:
    """``lock`` held by another thread until the block ends."""
    taken, done = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            done.wait()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert taken.wait(HANG)
    try:
        yield
    finally:
        done.set()
        thread.join()


def child_exits(work: Callable[[], object]) -> int | None:
    """Fork; the child runs ``work`` and exits 0. Returns its exit code, or None if it had not exited
    within ``HANG`` seconds (then it is killed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (fork with threads: that is the case here)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            work()
        finally:
            os._exit(0)
    deadline = time.monotonic() + HANG
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)  # (polls the child's exit; the deadline only bounds a hang)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def test_a_child_forked_while_a_thread_read_app_amqp_reads_it_too() -> None:
    app = Celery("forksafe", set_as_current=False)
    app.amqp  # noqa: B018  (cached: kombu's property still takes its lock on every read)
    prop = type(app).__dict__["amqp"]
    with held(prop.lock):
        code = child_exits(lambda: app.amqp)
    assert code == 0, "the child hung on app.amqp's lock, held by a thread of its parent at the fork"


def test_a_child_forked_while_a_thread_was_importing_imports_it_too(tmp_path: Any) -> None:
    """A thread of the parent inside an import holds that module's import lock at the fork (kombu imports
    ``librabbitmq`` on every connection it makes: not installed, never cached). The child's own import of
    it must not wait for that thread (ci18: a pool child hung in its first broker connection)."""
    release = tmp_path / "release"
    (tmp_path / "forksafe_slow_import.py").write_text(
        f"import pathlib, time\nwhile not pathlib.Path({str(release)!r}).exists():\n    time.sleep(0.01)\n"
    )
    importing = threading.Thread(target=__import__, args=("forksafe_slow_import",), daemon=True)
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        importing.start()
        import importlib._bootstrap as bootstrap

        deadline = time.monotonic() + HANG
        locks: dict[str, Any] = getattr(bootstrap, "_module_locks", {})
        while "forksafe_slow_import" not in locks and time.monotonic() < deadline:
            time.sleep(0.01)  # (until the thread is inside the import)
        code = child_exits(lambda: __import__("forksafe_slow_import"))
    finally:
        release.write_text("")
        importing.join(HANG)
        sys.path.remove(str(tmp_path))
        sys.modules.pop("forksafe_slow_import", None)
    assert code == 0, "the child hung on a module's import lock, held by a thread of its parent at the fork"


def test_a_child_forked_while_a_thread_held_a_signals_lock_sends_it() -> None:
    with held(signals.run_handed_off.lock):
        code = child_exits(lambda: signals.run_handed_off.send(sender=None, key="k"))
    assert code == 0, "the child hung on a signal's lock, held by a thread of its parent at the fork"


def test_the_hook_renews_the_locks_it_finds() -> None:
    assert forksafe.renew_inherited_locks() > 0
