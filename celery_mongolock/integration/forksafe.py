"""Locks a forked process must not inherit held: kombu's ``cached_property`` locks and Celery's signal locks.

The library runs threads in a worker's main process (the sweeper, the child watch, the heartbeat and
lease watch) that publish handoffs and send signals through the app, while billiard forks new pool
children from that process's main thread whenever one exits (``maxtasksperchild``, a body's
``cancel_running`` termination, a crash). A fork copies every lock as it is at that instant, and only
the forking thread: a lock another thread held is held forever in the child.

* kombu's ``cached_property.__get__`` takes its descriptor's lock on **every** read, cached or not (one
  ``RLock`` per property, shared by all instances: ``Celery.amqp`` is one). A child forked while the
  sweeper read ``app.amqp`` hung on its first handoff publish, in ``lanes.route_of`` (seen once in CI,
  test_cancel_running: its run never ended; reproduced by widening the window, with the child's stack).
* Celery's ``Signal`` takes its lock when its receivers are not cached yet.

After a fork, in the child, every such lock of the modules loaded (Celery's, kombu's, billiard's and
ours), and our own module-level locks (the send stamp's, the events' ...), is replaced by a new one
(``os.register_at_fork``). Only the forking thread exists in the child, and it was forking, not inside
one of these locks: a held lock can only be a vanished thread's, and nothing it guarded is half-done
from the child's point of view (a property value is set once, in one statement; a receivers cache is
rebuilt on a miss). Not covered: the apps' own signals (``app.on_after_fork`` ...), which the library's
threads never send.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from typing import Any

__all__ = ["forget_inherited_import_locks", "renew_inherited_locks"]

#: The modules whose classes and signals are looked at (by name prefix).
_PREFIXES = ("celery", "kombu", "billiard", "celery_mongolock")


def _is_signal(value: object) -> bool:
    from celery.utils.dispatch.signal import Signal

    # (``type()``, not ``isinstance``: a Celery ``Proxy`` such as ``current_app`` answers ``__class__`` by
    # evaluating what it stands for, which a child must not do here)
    return issubclass(type(value), Signal)


def _renew_properties(cls: type) -> int:
    renewed = 0
    for attr in list(vars(cls).values()):
        is_property = issubclass(type(attr), functools.cached_property)
        lock = getattr(attr, "lock", None) if is_property else None
        if lock is not None:
            attr.lock = type(lock)()  # (RLock: kombu's and Python 3.11's own)
            renewed += 1
    return renewed


def _renew_signal(signal: Any) -> int:
    signal.lock = threading.Lock()
    return 1


_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))


def _renew_module(name: str, module: Any) -> int:
    renewed = 0
    for attr, value in list(vars(module).items()):
        if issubclass(type(value), type) and value.__module__ == name:
            renewed += _renew_properties(value)
        elif _is_signal(value):
            renewed += _renew_signal(value)
        elif name.startswith("celery_mongolock") and type(value) in _LOCK_TYPES:
            setattr(module, attr, type(value)())  # our own module-level locks (the send stamp's, ...)
            renewed += 1
    return renewed


def renew_inherited_locks() -> int:
    """Replace the locks above in this process (the child of a fork): how many were replaced."""
    renewed = 0
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(_PREFIXES):
            continue
        with contextlib.suppress(Exception):  # (one odd module never stops the others' renewal)
            renewed += _renew_module(name, module)
    return renewed


def forget_inherited_import_locks() -> int:
    """Forget the per-module import locks that a thread of the parent held at the fork: the next import of
    that module takes a new one. CPython renews its global import lock in a forked child, not these
    (``importlib._bootstrap._module_locks``). kombu imports ``librabbitmq`` each time it makes a broker
    connection (``supports_librabbitmq``: not installed, so never cached), so a thread of the worker's
    main process making one (a handoff's publish) holds that module's lock now and then; a child forked
    then hung in its own first connection (seen in CI). How many were forgotten."""
    import _thread
    import importlib._bootstrap as bootstrap

    locks = getattr(bootstrap, "_module_locks", None)
    if not isinstance(locks, dict):
        return 0
    me = _thread.get_ident()
    forgotten = 0
    for name, ref in list(locks.items()):
        lock = ref() if callable(ref) else None
        owner = getattr(lock, "owner", None)
        if lock is not None and owner and owner != me:  # held by a thread the child does not have
            locks.pop(name, None)
            forgotten += 1
    return forgotten


def _after_fork_in_child() -> None:
    with contextlib.suppress(Exception):  # never let a child fail to start for this
        forget_inherited_import_locks()
    with contextlib.suppress(Exception):
        renew_inherited_locks()


os.register_at_fork(after_in_child=_after_fork_in_child)
