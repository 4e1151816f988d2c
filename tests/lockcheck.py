"""A lock-set checker: many clients do read-modify-write under leases while faults are injected, and a
history checker proves afterwards that the lease + fence protocol kept the protected data safe.

The workload
============
Keys ``lockcheck:k<i>.e<epoch>`` (a few keys; the epoch advances every ``epoch_seconds`` so that the
per-key server-side log stays small). For each key, a protected document ``protected[key]``::

    {_id: key, counter: int, fence: int, log: [entry, ...]}

A holder of the lease for ``key`` (a bare ``LeaseStore`` client process or a singleton Celery task in a
real prefork worker) does, with ``celery_mongolock.fencing.fenced_update_one`` for every write:

1. *claim*: push ``{k: "c", h: hold, f: fence}`` (this stamps our fence on the document, so a stale
   holder's later write is refused from here on);
2. for each operation: read ``counter`` (p), work a little (this is where pauses land), then unless
   the client is "reckless" check ``lease.lost``, and write ``counter = p + 1`` and push
   ``{k: "w", o: op, h: hold, f: fence, p: p}``, filtered on ``log.o != op`` so a retry of an ambiguous
   write (connection dropped, reply lost) is recognised and never applied twice.

Keys ``l<i>`` are ``limit=N`` keys (N = ``LIMIT`` = 3): up to N holds at once (Celery ``Retry``/``Skip``
runs sent in bursts of 2 to N + 1, ``Queue`` runs in bursts of N to N + 2 that park and are handed
slots, and the bare clients with ``acquire(limit=N)``), each in a slot
(``lease.slot``) with its own fence. They share one protected document per key, so each hold guards only
its own slot's part of it (``run_slot_hold``)::

    {_id: key, counter: int, sc: {slot: int}, sf: {slot: fence}, log: [entry, ...]}

the claim pushes ``{k: "c", h, f, s}`` and stamps ``sf.<s>``; each op reads ``sc.<s>`` (p), works, then
writes ``sc.<s> = p + 1``, ``$inc counter`` and pushes ``{k: "w", o, h, f, s, p}``, filtered on ``sf.<s>
<= f`` (a stale holder of the slot is fenced out by the slot's next holder) and ``log.o != op`` (so an
op is applied once per key even when its retry gets another slot). Within a slot the log is then a
single-holder history, checked as a plain key's log is.

Keys ``d<i>`` are document-lock keys: the bare clients (and the controller, around every fault and in a
directed takeover) lock the protected document itself with a ``DocumentLock`` (its fields inside the
document) and do the same claim and read-modify-writes through ``locked.update_one``, whose filter is
the lock itself, made idempotent by a pipeline that leaves a document holding ``op`` unchanged
(``run_document_hold``). Their events are a plain key's (the lock's token as the hold, its fence), and
their documents' logs are checked as a plain key's.

Several-keys runs (``keys=("{a}", "{b}")``: ``Retry`` and ``Skip``, and ``Queue`` in bursts of 2 or 3 on
one pair, each naming it in either order) take two of the plain ``k`` keys, beside single-key runs and
bare clients on the same keys. The body records its
start (``mbody``: the keys of its ``LeaseSet`` with each hold token and fence) and an acquisition per
key, then does the plain claim + read-modify-write on each key's document with that key's lease and
fence (op ``<op>@<key>``), and releases each key (``run_multi_hold``). A run cut short on one key
(fenced out, loss detected) is retried; its retry recognises the ops already applied.

Several-keys runs with a limit per key (``MULTI_LIMIT_TASK``: ``keys=("{a}", "{b}")``, ``limit={"{a}":
N}``, ``Retry``; bursts of 2 to N + 1 on one ``l`` key, each with a ``k`` key drawn at random) take a slot
of the ``l`` key and the single lease of the ``k`` key, both or neither; the body writes the ``l`` key's
document in its slot's part (``run_slot_hold``) and the ``k`` key's as a plain key's. Their holds go
through the checks of each kind of key below with every other hold of the key: a slot counts against
the ``l`` key's N with the ``limit=N`` runs' and bare clients' slots, the ``k`` key is one holder's.

Reentrant runs (``REENTRANT_TASK``: ``keys=("{a}", "{b}")``, ``limit={"{a}": N}``, ``Retry``; an ``l`` key
and a ``k`` key, as the per-key-limit runs, sent instead of one of them now and then, and in a directed
burst) write nothing with the leases their run took: the body calls a singleton function in-process for
the ``l`` key (``REENTRANT_INNER_TASK``, ``limit=N``, ``Fail``: without reentrance it would find the slots
held by its own run and fail), which writes that key's document in its slot's part with the lease it runs
with, and then holds its own ``k`` key again through the app's store (``store.hold(b, wait=0)``) and
writes that key's document inside. Each records ``reenter`` (which way, whether it was a reentrant hold,
its hold token, fence and slot, and the run's other live slots of the key). Their writes go through the
several-keys checks (the body's own hold token and fence on each key, every key written by a done run)
and ``check_reentrant``: a reentrant hold is the body's own lease (hold token and fence), and takes no
second slot. A run whose reentrance is refused (its outer lease was lost first) writes nothing and is
retried.

Rate-limited runs (``RATE_TASK``: ``rate=RateLimit(RATE_N, RATE_PERIOD)``, ``Retry``) do the plain claim +
read-modify-write on ``t`` keys of their own, sent in bursts of 1 to n + 2; a run over the rate is parked
(its message published again for its turn). Every attempt at a start records ``rtake``: granted or parked,
and each window its commands' replies showed (starts with their ids and server-clock times, parked runs
with their send stamps and when their entries go stale). The controller's ``RateGate`` parks n runs
of its own ahead of all others (never granted), so runs sent to its key stay parked: a directed burst, and
two runs through every fault.

Every process appends its view to a JSON-lines history file (acquisitions with monotonic send/reply
times, every write's outcome: ack / fenced / lost-detected / ambiguous / error, releases). Reckless
clients write even after their lease is lost: only the fence stands between them and the data.

The faults
==========
``sigstop-client`` / ``sigstop-task``: a holder (bare client / Celery child) is paused with SIGSTOP
until its lease has expired and a successor has claimed the document, then resumed. ``kill-child``:
SIGKILL of a Celery prefork child holding a lease. ``kill-node``: SIGKILL of a whole worker node (parent
and children), and a new node started. ``sigterm-child``: SIGTERM of a child holding a lease (its body
is cut short with ``SystemExit``). ``sigterm-node``: SIGTERM of a whole node's process group, as systemd
stops a service (the parent's warm shutdown, every child's body cut short); a new node is started.
``clock-jump``: the wall clock of a bare client jumps by
minutes or hours, forward and back, and that of a Celery node with a queue of its own by minutes, forward
only (libfaketime with a timestamp file; ``Config.skewed_node``). ``server-restart``: the MongoDB server
(file-backed, ``--sync-on-commit``) is crashed with SIGKILL or stopped, and started again on the same
port and data. ``server-pause``: the MongoDB server is stopped with SIGSTOP for longer than a lease,
then resumed: every lease expires while no holder can renew. ``broker-restart``: the Redis broker
(``appendfsync always``) is crashed with SIGKILL or stopped, and started again on the same port and data,
with tasks running and messages in flight. ``fail-close`` / ``fail-error`` / ``fail-block``:
``failCommand`` fail points that drop connections, return errors, or hold commands past the clients' timeouts.

The checks (``check``)
======================
On the final documents (server-side order) and the histories: no acknowledged update lost, none applied
twice, no read-modify-write based on a stale read (``p`` of the i-th accepted write is i), fences
non-decreasing along each log and constant within a hold, holds never interleaved in a log, a fence
never reused by two holds; across acquisitions, one that ended before another began has a smaller
fence; holds whose release matched their owner token never overlap in real time (CLOCK_MONOTONIC is
system-wide); a write reported fenced out or skipped is not in the log; every submitted Celery task
ended in SUCCESS with a result (done, or skipped by policy), unless the histories prove that the broker
lost its message: kombu's Redis transport pops a message before recording it as unacknowledged, and a
node SIGKILLed in between loses it (no node received it, no queue holds it, a node was killed after it
was published). Those are counted (``tasks.lost_by_broker``), not hidden.

Queue and Replace runs (``check_queued``; keys ``q<i>`` and ``r<i>``, one policy per key): none lost,
none run again after it finished, no grant to a newer Queue run (an inversion) or a plain acquire
(barging) while an older run was parked, superseded only by a newer send, no older Replace run after a
newer one. Grants are ordered by fence; a run parked in a reply with fence f was parked before every
grant with a larger one (docs/discussions/test-bed.md, "Queue and Replace runs"). The same, per key, for
``Queue`` runs on ``limit=N`` keys (a slot handed to a parked run is a grant with that slot's fence;
fences increase over all slots, so no slot may go to anyone but an older parked run while one waits)
and for several-keys ``Queue`` runs on each of their keys (a reservation is a handoff); those end
``SUCCESS`` with their op applied once per key, never skipped, and a several-keys body never starts
again after a body of its task wrote every key and released them cleanly.

``limit=N`` keys (``check_slot_log``, ``check_limit_holds``): at no instant more than N holds whose
release matched their owner token (clean holds: CLOCK_MONOTONIC from the reply seen to the release sent,
inside the real hold) overlap (``over-limit``); two clean holds of one slot never overlap
(``slot-overlap``); per slot, the log is a single-holder history (fences non-decreasing, holds not
interleaved, the i-th write of the slot read ``p == i``: ``lost-update`` otherwise); a fence belongs to
one hold over all slots (``fence-reused``), and the acquisitions' fences increase in real-time order
across slots (the plain sweep); ``counter`` and each ``sc.<s>`` equal the writes applied; no op applied
twice, no acknowledged op missing.

Several-keys runs (``check_multi``): every body started holding a lease on every key of its task
(``multi-missing-key``), none of them past its deadline when the last was taken
(``multi-started-without-all``); its clean holds overlapped in time, so it held them all at once
(``multi-not-all-held``); its writes to each key's document carry that key's hold and fence
(``multi-wrong-fence``); a run that ended done has each key's op applied, by one of its own bodies
(``multi-partial``). Each key's holds (several-keys and single-key alike) go through the plain checks
above, so a several-keys body and a single-key run holding one key at once is an ``overlap``, and a
deadlock leaves tasks unfinished.

Rate-limited runs (``check_rate``; ``t`` keys): at most n starts of a key in any ``[a, a + period)`` on
the server's clock (``rate-exceeded``; the starts of every reply together), no start taken past a run sent
before it that waits on the key with no room left for it (``rate-order``), no body without a start granted
to its delivery (``rate-bypassed``), none skipped (``rate-dropped``).

Run it from ``tests/test_lockcheck.py`` (bounded) or ``scripts/soak.py`` (long).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar, TextIO

from pymongo import MongoClient, ReturnDocument, WriteConcern
from pymongo.collection import Collection
from pymongo.errors import DuplicateKeyError, PyMongoError

from celery_mongolock import (
    DocumentLease,
    DocumentLock,
    DocumentLockLost,
    DocumentWriteUnknown,
    LeaseStore,
    singleton_task,
)
from celery_mongolock.core.documents import rate as rate_docs
from celery_mongolock.core.documents.rate import RateWindow
from celery_mongolock.core.documents.sets import gate_of
from celery_mongolock.core.reentry import ReentrantHold
from celery_mongolock.core.store import Lease
from celery_mongolock.core.store_rate import STALE_AFTER_TURN_MS, RateTake, rate_windows
from celery_mongolock.exceptions import MongoLockError, StoreUnavailable
from celery_mongolock.fencing import FencedOut, fenced_update_one
from celery_mongolock.integration.handoff import SENT_HEADER, send_stamp
from celery_mongolock.task import REPUBLISH_RETRY_POLICY

from . import brokerlog, nodewatch
from . import lockcheck_mixed as mixed
from .lockcheck_retry import write_retrying
from .nodewatch import broker_ready

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "lockcheck:"
VISIBILITY_TIMEOUT = 15
SKEWED_QUEUE = "lockcheck.skewed"
#: The skewed node's visibility timeout: longer than any run (ten years), so that it never sweeps. kombu's
#: Redis transport restores an unacknowledged message once ``sweeper's time() - visibility_timeout`` has
#: passed the ``time()`` of its delivery (possibly another node's). With the skewed node's clock minutes
#: ahead, its every sweep handed out again all the messages in flight on every node. Those copies are
#: dropped as duplicates while their first run holds the key (``celery_mongolock``) and acknowledged;
#: when the first run's node was killed next, the task was gone and stayed pending. The other nodes
#: (true clocks) still restore a killed node's messages; the skewed node itself is never killed.
SKEWED_VISIBILITY_TIMEOUT = 10 * 365 * 86400
#: How often the nodes' kombu sweeps look for unacknowledged messages to restore (lockcheck_app).
RESTORE_INTERVAL = 2
#: How often the supervisor looks for a stalled node (tests/nodewatch.py): a sampling interval of the
#: look, not a wait for anything (the verdict is measured progress against ``Run._stall_allowance``).
STALL_LOOK_S = 2.0
#: Guards against a hang, never a pass/fail deadline: waits end on their conditions (a node ready or
#: exited; a task finished; a message restored) and on measured progress. These only stop a run that
#: makes no progress at all for this long.
START_GUARD_S = 600.0
DRAIN_GUARD_S = 1800.0
#: Attempts at a fault that finds no victim (each waits for one) before the run says it was skipped.
FAULT_TRIES = 30
#: The clock mark written into the broker's append-only file (see tests/brokerlog.py).
CLOCK_MARK_INTERVAL = 0.1
FAKETIME_LIBS = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
)

#: The queued tasks of tests/lockcheck_app.py, and their policies: ``Queue`` runs on single keys
#: (``q`` keys), on ``limit=N`` keys (``l`` keys) and on two keys at once (``k`` keys); ``Replace`` runs.
QUEUE_TASK = "lockcheck.rmw_queue"
REPLACE_TASK = "lockcheck.rmw_replace"
LIMIT_QUEUE_TASK = "lockcheck.rmw_limit_queued"
MULTI_QUEUE_TASK = "lockcheck.rmw_multi_queued"
#: ``Queue`` runs on ``limit=N`` keys with a minimum hold (``min_hold_seconds=MIN_HOLD``): a slot released
#: before its hold ends stays taken until then; a parked run is handed it when the hold ends.
MIN_HOLD_TASK = "lockcheck.rmw_limit_held"
MIN_HOLD = 1.0
#: ``Queue`` runs that need several keys with a limit on one (``keys=("{a}", "{b}")``, ``limit={"{a}": N}``):
#: parked on the ``l`` key like a ``limit=N`` run, a slot they got while they wait for the ``k`` key kept
#: as a reservation (and the ``k`` key too, as ``MULTI_QUEUE_TASK`` runs keep theirs).
MULTI_LIMIT_QUEUE_TASK = "lockcheck.rmw_multi_limit_queued"
#: ``Replace(cancel_running=True, grace=CANCEL_GRACE)`` runs, on the ``r`` keys beside ``Replace()`` runs
#: (half the ``r`` bursts): a newer send supersedes the running holder too, which stops (its fenced writes
#: refused) or is terminated after the grace. ``check_cancel`` and ``cancel_figures``.
REPLACE_CANCEL_TASK = "lockcheck.rmw_replace_cancel"
CANCEL_GRACE = 0.5
REPLACE_TASKS = (REPLACE_TASK, REPLACE_CANCEL_TASK)
#: The share of ``REPLACE_TASK`` runs sent with a ``link`` callback (``lockcheck.linked``): a superseded
#: parked one is ended by a worker from its stored message (``integration.endings``), and its callback must
#: be called all the same, under every fault (``check_links``).
LINK_SHARE = 0.5
#: How long the drain waits for a callback with no new one called meanwhile (``Run._wait_for_links``).
LINK_QUIET_S = 60.0
#: The share of the workload's ``Queue`` runs (``PRIORITY_TASKS``) sent with a Celery ``priority`` (one of
#: ``PRIORITIES``): they are handed their keys ahead of runs of a lower priority parked earlier
#: (``integration.priority``), which the send-order check judges by (rank, stamp) (``queue_order``).
PRIORITY_SHARE = 0.3
PRIORITIES = (0, 3, 6, 9)
QUEUED_TASKS = {
    QUEUE_TASK: "queue",
    REPLACE_TASK: "replace",
    REPLACE_CANCEL_TASK: "replace",
    LIMIT_QUEUE_TASK: "queue",
    MULTI_QUEUE_TASK: "queue",
    MIN_HOLD_TASK: "queue",
    MULTI_LIMIT_QUEUE_TASK: "queue",
}
#: The ``Queue`` tasks whose random sends may carry a priority (``PRIORITY_SHARE``).
PRIORITY_TASKS = frozenset(QUEUED_TASKS) - {REPLACE_TASK, REPLACE_CANCEL_TASK}
#: Per kind of key (``key_policy``), the Queue task whose runs on it are checked for send order.
ORDERED_BY_KEY = {
    "queue": (QUEUE_TASK,),
    "limit": (LIMIT_QUEUE_TASK, MIN_HOLD_TASK, MULTI_LIMIT_QUEUE_TASK),
    "plain": (MULTI_QUEUE_TASK, MULTI_LIMIT_QUEUE_TASK),
}
#: Runs that are not judged for send order themselves but keep their place in it on the keys they share
#: with the tasks above: a several-keys ``Replace`` run parked on an ``l`` or ``k`` key is ahead of the
#: ``Queue`` runs sent after it (``MULTI_LIMIT_REPLACE_TASK``; defined below).
SEND_ORDER_PEERS = (
    "lockcheck.rmw_multi_limit_replace",
    "lockcheck.rmw_multi_limits_debounced",
    "lockcheck.rmw_multi_timed",
)
#: ``Queue(timeout=TIMED_WAIT_S, then=Skip())`` runs of two ``k`` keys, a share (``TIMED_SHARE``) of the
#: ``MULTI_QUEUE_TASK`` bursts: one parked past its deadline ends skipped, and its places and reservations
#: on its keys go at once (``results._ends_here``). A send-order peer of the bursts' other runs; judged by
#: ``check_timed_out``.
MULTI_TIMED_TASK = "lockcheck.rmw_multi_timed"
TIMED_WAIT_S = 3.0
TIMED_SHARE = 0.3
#: The ``limit=N`` tasks (keys ``l<i>``, N = ``LIMIT``) and the several-keys tasks (two ``k`` keys each).
LIMIT = 3
LIMIT_TASKS = ("lockcheck.rmw_limit", "lockcheck.rmw_limit_skip", LIMIT_QUEUE_TASK, MIN_HOLD_TASK)
#: The several-keys task with a limit per key (``keys=("{a}", "{b}")``, ``limit={"{a}": LIMIT}``, ``Retry``):
#: a slot of an ``l`` key and the single lease of a ``k`` key, both or neither. A several-keys task.
MULTI_LIMIT_TASK = "lockcheck.rmw_multi_limit"
#: The reentrant task (``keys=("{a}", "{b}")``, ``limit={"{a}": LIMIT}``, ``Retry``): its body writes each
#: key through a reentrant hold of its run's lease (an in-process call of ``REENTRANT_INNER_TASK`` for the
#: ``l`` key, ``store.hold`` of the ``k`` key). A several-keys task.
REENTRANT_TASK = "lockcheck.rmw_reentrant"
REENTRANT_INNER_TASK = "lockcheck.rmw_reentrant_inner"
#: The several-keys ``Replace`` task (``keys=("{a}", "{b}")``, ``Replace()``), on ``m`` keys of its own
#: (its runs park on them, and runs of other tasks would be judged against them): the newest send of a set
#: of keys wins; runs of other sets that share a key keep their place. A several-keys task.
MULTI_REPLACE_TASK = "lockcheck.rmw_multi_replace"
#: The same, debounced (``Replace(debounce=MULTI_REPLACE_DEBOUNCE)``): every run parks on the first key of
#: its set, and its delayed copy takes it once due (then the second, as a ``Queue`` run), unless a newer
#: send of its set came. Its runs and the undebounced
#: task's are judged together per set of keys (a set's signature is its keys: either task's newer send
#: supersedes the other's older runs of that set).
MULTI_REPLACE_DEBOUNCED_TASK = "lockcheck.rmw_multi_replace_debounced"
MULTI_REPLACE_DEBOUNCE = 0.3
#: The same with a ceiling (``Replace(debounce=MULTI_REPLACE_DEBOUNCE, max_wait=MULTI_REPLACE_MAX_WAIT)``):
#: a set that keeps receiving sends still runs; the burst its ceiling sealed is not superseded
#: (``sets.in_burst``, on the first key of the set). Judged with the other several-keys ``Replace`` runs,
#: and its directed burst (``Run._capped_directed``) sends until a body of it started.
MULTI_REPLACE_CAPPED_TASK = "lockcheck.rmw_multi_replace_capped"
MULTI_REPLACE_MAX_WAIT = 1.0
#: The directed capped burst: a send every ``CAPPED_EVERY`` seconds (less than the debounce: without the
#: ceiling none would run while they go on) until a body of one started, for at most ``CAPPED_LIMIT_S``.
CAPPED_EVERY, CAPPED_LIMIT_S = 0.1, 90.0
#: The same with ``Replace(cancel_running=True, grace=CANCEL_GRACE)``: a newer send of the set also
#: supersedes the run that holds it (told on the first key the newer send reaches, every lease of its set
#: superseded from then on: ``check_cancel``, ``multi_cancel_figures``).
MULTI_REPLACE_CANCEL_TASK = "lockcheck.rmw_multi_replace_cancel"
MULTI_REPLACE_TASKS = (
    MULTI_REPLACE_TASK,
    MULTI_REPLACE_DEBOUNCED_TASK,
    MULTI_REPLACE_CANCEL_TASK,
    MULTI_REPLACE_CAPPED_TASK,
)
#: The several-keys ``Replace`` task with a limit per key (``keys=("{a}", "{b}")``, ``limit={"{a}": LIMIT}``,
#: ``Replace()``): a slot of an ``l`` key and the lease of a ``k`` key; the newest send of a pair wins, on
#: the slotted key too (a run parked for a slot, or keeping one reserved, is superseded there). Judged as
#: ``MULTI_REPLACE_TASK`` runs are (``check_multi_replace``). A several-keys task.
MULTI_LIMIT_REPLACE_TASK = "lockcheck.rmw_multi_limit_replace"
#: The same with a limit on both keys, debounced (``keys=("{a}", "{b}")``, ``limit={"{a}": LIMIT, "{b}":
#: LIMIT}``, ``Replace(debounce=MULTI_REPLACE_DEBOUNCE)``): a slot of two ``l`` keys, its entries not due
#: before their debounce (a free slot is not handed before). Half of the random bursts of
#: ``MULTI_LIMIT_REPLACE_TASK`` (on ``slotted`` and ``LIMITS_DEBOUNCED_KEY``), judged with its runs
#: (``check_multi_replace``). With ``max_wait``: ``MULTI_LIMITS_CAPPED_TASK``.
MULTI_LIMITS_DEBOUNCED_TASK = "lockcheck.rmw_multi_limits_debounced"
#: The same with a ceiling (``Replace(debounce=MULTI_REPLACE_DEBOUNCE, max_wait=MULTI_REPLACE_MAX_WAIT)``),
#: in the directed phase: a capped burst on two ``l`` keys of its own (``Run._capped_directed``), a send
#: every ``CAPPED_EVERY`` s until a body started. On such keys the ceiling's run (sealed) is handed its
#: slots before a newer burst's run of its set (``sets.behind_its_set``: the checker's ``replace-order``
#: found it, docs/known-issues.md).
MULTI_LIMITS_CAPPED_TASK = "lockcheck.rmw_multi_limits_capped"
MULTI_LIMIT_REPLACE_TASKS = (MULTI_LIMIT_REPLACE_TASK, MULTI_LIMITS_DEBOUNCED_TASK, MULTI_LIMITS_CAPPED_TASK)
#: The ``l`` key (of its own index) that the random bursts of ``MULTI_LIMITS_DEBOUNCED_TASK`` pair with an
#: ``l`` key of the workload's.
LIMITS_DEBOUNCED_KEY = 60
MULTI_TASKS = (
    "lockcheck.rmw_multi",
    "lockcheck.rmw_multi_skip",
    MULTI_QUEUE_TASK,
    MULTI_LIMIT_TASK,
    MULTI_REPLACE_TASK,
    MULTI_REPLACE_DEBOUNCED_TASK,
    MULTI_REPLACE_CANCEL_TASK,
    MULTI_REPLACE_CAPPED_TASK,
    REENTRANT_TASK,
    MULTI_LIMIT_QUEUE_TASK,
    MULTI_LIMIT_REPLACE_TASK,
    MULTI_LIMITS_DEBOUNCED_TASK,
    MULTI_TIMED_TASK,
    MULTI_LIMITS_CAPPED_TASK,
)
#: The tasks whose runs may be sent with ``die`` (tests/lockcheck_app.py ``_die_after_release``): the body
#: ends and releases its key, then its child SIGKILLs itself before Celery stores the result, and the
#: requeued copy must end the task ``already-ran`` without running the body again (issue 32).
DIE_TASKS = ("lockcheck.rmw", "lockcheck.rmw_skip", QUEUE_TASK, LIMIT_TASKS[0], LIMIT_QUEUE_TASK)
#: The directed phase (``Run.directed``, before the faults): bursts of queued runs on keys of their own
#: (index ``DIRECTED_KEY`` of each kind), parked behind holds of the controller's (a "gate": the key, or
#: all N slots of a ``limit=N`` key) that let go only once the lease document shows every run of the
#: burst parked. So the runs park, are handed the key and run to the end by construction, not by timing.
DIRECTED_KEY = 90
#: The directed burst on a key used both ways (``Run._mixed_directed``): runs of slots and of a single lease.
MIXED_DIRECTED = (mixed.SLOTS_TASK, mixed.SINGLE_TASK, mixed.SLOTS_TASK, mixed.SINGLE_TASK)
QUEUE_BURST = 7
#: The parked ``Queue`` runs of a priority the workers' lease documents keep (``mongolock_parked_window``,
#: ``lockcheck_app``): the rest are spilled (``documents.spill``), the directed burst's included.
PARKED_WINDOW = 2
REPLACE_BURST = 6
LIMIT_BURST = LIMIT + 3
MULTI_BURST = 6
#: The directed burst of ``MULTI_LIMIT_TASK`` runs (``Run._multi_limit_burst``): one ``l`` key and one ``k``
#: key of their own, contended on each by construction.
MULTI_LIMIT_BURST = LIMIT + 1
#: The directed burst of ``REENTRANT_TASK`` runs (``Run._reentrant_burst``): one ``l`` key and one ``k`` key
#: of their own; every run ends done, and a done run wrote both keys through reentrant holds.
REENTRANT_BURST = LIMIT + 1
#: The directed burst of ``MULTI_REPLACE_TASK`` runs (``Run._multi_replace_directed``): one set of two
#: ``m`` keys, sent one at a time behind a gate on the first, then a run of an overlapping set.
MULTI_REPLACE_BURST = 4
#: The directed reservation window (``Run._reservation_window``): an older run of a set (``m`` keys of index
#: ``WINDOW_KEY`` and ``WINDOW_KEY + 1``) holds the first key and parks on the second (a gate's); the app
#: makes it wait there (``lockcheck_app._reservation_window``, at most ``WINDOW_WAIT_S``) until a newer send
#: of its set has parked on the first key, before it turns that key into its reservation.
WINDOW_KEY = DIRECTED_KEY + 3
WINDOW_WAIT_S = 120.0
#: The window is missed when the older run's lease of the first key lapsed before the newer send came (its
#: admit answered late on a loaded machine, ci26): the newer send then takes that key instead of parking on
#: it. The step is sent again on keys of its own (index ``WINDOW_AGAIN_KEY + 2 * attempt`` and the next),
#: at most ``WINDOW_ATTEMPTS - 1`` times, and judged on its latest attempt.
WINDOW_AGAIN_KEY = DIRECTED_KEY + 40
WINDOW_ATTEMPTS = 3
#: The controller arms the window of an attempt for its older run (a document ``{_id: first key, run: task
#: id}`` here); that run consumes it and pauses in the window, and writes ``seen`` (the newer send parked)
#: when it goes on.
WINDOW_MARKERS = "lockcheck_window"
#: The directed burst of ``MULTI_REPLACE_DEBOUNCED_TASK`` runs (``Run._debounced_directed``): one set of two
#: ``m`` keys (index ``DIRECTED_KEY + 5`` and ``+ 6``), sent one at a time behind a gate on the first.
DEBOUNCED_BURST = 4
#: The directed burst of ``MULTI_LIMIT_REPLACE_TASK`` runs (``Run._multi_limit_replace_directed``): on one
#: pair (an ``l`` key, a ``k`` key) of its own, sent one at a time behind a gate that holds all N slots:
#: each run parks for a slot (keeping the ``k`` key, the first of its set, reserved), and each newer send
#: takes that reservation back and supersedes the older one parked for the slot.
MULTI_LIMIT_REPLACE_BURST = 3
#: The directed burst of ``MIN_HOLD_TASK`` runs, on an ``l`` key of its own (index ``DIRECTED_KEY`` + 2):
#: the gate's N slots go to the first N; the others are handed a slot only once one of those runs' minimum
#: holds has ended, so at least ``MIN_HOLD_BURST - LIMIT`` acquisitions follow a clean minimum hold.
MIN_HOLD_BURST = LIMIT + 3
#: The directed burst of ``MULTI_LIMIT_QUEUE_TASK`` runs, on an ``l`` key and a ``k`` key of their own (index
#: ``DIRECTED_KEY`` + 3), behind a gate holding the ``l`` key's N slots: every run parks on the ``l`` key
#: (the first reserves the ``k`` key, the others park on it); the gate's slots go to the N oldest, of which
#: all but the first wait for the ``k`` key with the slot reserved for them.
MULTI_LIMIT_QUEUE_BURST = LIMIT + 2
#: Each fault begins with a ``Queue`` run parked behind a gate on a key of its own (index
#: ``FAULT_GATE_KEYS`` + n), released when the fault is over.
FAULT_GATE_KEYS = 100
#: ``unique_send``: the task (``lockcheck_app.rmw_unique``, ``Retry``, on plain keys), the equal sends of
#: its directed burst and of each fault's gated pair, and its bound: longer than any run, so that a pending
#: send's record ends when its body starts (or never, if the run is lost), never at the bound here.
UNIQUE_TASK = "lockcheck.rmw_unique"
UNIQUE_BURST = 5
UNIQUE_GATE_SENDS = 2
UNIQUE_SEND_SECONDS = 3600.0
#: ``rate=RateLimit(RATE_N, RATE_PERIOD)``: the task (``lockcheck_app.rmw_rate``, ``Retry`` while its key is
#: held), on ``t`` keys of its own; the runs of its directed burst and of each fault's gate, parked behind
#: the controller's hold on the key's rate (``RateGate``); how often that gate refreshes its places.
RATE_TASK = "lockcheck.rmw_rate"
#: The same rate with ``Queue()``: a run that finds its key held parks on it and is handed it in send order,
#: then takes its start (over the rate: it gives the key back and waits its turn in the window). Half the
#: random bursts on ``t`` keys; judged by the same rate checks.
RATE_QUEUE_TASK = "lockcheck.rmw_rate_queued"
RATE_TASKS = (RATE_TASK, RATE_QUEUE_TASK)
RATE_N = 2
RATE_PERIOD = 2.0
RATE_BURST = RATE_N + 3
RATE_GATE_SENDS = 2
RATE_GATE_INTERVAL = RATE_PERIOD / 8
#: The fault phase ends only once the bare clients' and the tasks' writes acknowledged exceed this.
MIN_ACKNOWLEDGED = 50
#: Who the controller's gate holds are, in the histories.
GATE = "gate"
#: The controller's document locks (``d`` keys): the one each fault begins with, held through the fault
#: (index ``FAULT_GATE_KEYS`` + n) and written once after it; and the directed takeover's two holders
#: (index ``DIRECTED_KEY``): one whose renewals stop, and its successor once the lock expired on the server.
DOC_GATE = "doc-gate"
DOC_PAUSED = "doc-paused"
DOC_SUCCESSOR = "doc-successor"
#: The submitter sends nothing more while this many messages wait in the broker's queues: on a machine
#: too loaded to keep up, the random workload shrinks instead of piling up (unthrottled, a backlog of
#: 3,000 messages under load average 40 turned one bounded seed into a run of more than 20 minutes).
#: Every message the controller sends (a directed burst's, a fault's gated run) waits behind it: 40 made
#: each such wait 10 to 15 s; the workers' four children are kept as busy by 12 (Redis seed 1 on a quiet
#: machine: the directed phase 105 s instead of 140 to 154 s, the whole run 286 s instead of 312 to 347 s).
MAX_BACKLOG = 12
#: A random task goes to the skewed node's queue (a quarter of them) only while fewer than this many wait
#: there: that node has one child against the others' four, and with a quarter of the workload its queue
#: filled up to the whole ``MAX_BACKLOG``, so every fault's gated run (sent there, ``Run._fault_gate``)
#: waited behind 30 and more messages, minutes per fault (a bounded seed of 25 minutes instead of 7).
SKEWED_MAX_BACKLOG = 3
#: A ``sigstop-task`` or ``kill-child`` fault begins with a Celery run holding a key of its own (index
#: ``LINGER_KEYS`` + n) until the fault is over (``Run._lingering``): a victim, whatever the random
#: workload holds at that moment. The run gives up waiting after this long (a guard).
LINGER_KEYS = 200
LINGER_GUARD_S = 300.0
#: A node told to stop (``sigterm-node``) that has not exited after this long is SIGKILLed, as systemd
#: does after ``TimeoutStopSec`` (its default is 90 s): a guard, a warm shutdown of cut-short bodies
#: takes seconds.
SIGTERM_STOP_S = 90.0

ALL_FAULTS = (
    "sigstop-client",
    "sigstop-task",
    "kill-child",
    "kill-node",
    "sigterm-child",
    "sigterm-node",
    "clock-jump",
    "server-restart",
    "server-pause",
    "broker-restart",
    "fail-close",
    "fail-error",
    "fail-block",
)

Doc = dict[str, Any]


def faketime_lib() -> str | None:
    """libfaketime's preload library, if installed."""
    found = os.environ.get("LOCKCHECK_FAKETIME_LIB")
    if found and os.path.exists(found):
        return found
    for path in FAKETIME_LIBS:
        if os.path.exists(path):
            return path
    return None


def faketime_env(timestamp_file: Path) -> dict[str, str]:
    """Environment that shifts a process's wall clock by the offset in ``timestamp_file`` (re-read on
    every call, so writing the file makes the clock jump), leaving CLOCK_MONOTONIC alone."""
    lib = faketime_lib()
    assert lib is not None
    site = faketime_site(timestamp_file.parent)
    return {
        "PYTHONPATH": f"{site}{os.pathsep}{ROOT}",
        "LD_PRELOAD": lib,
        "FAKETIME_TIMESTAMP_FILE": str(timestamp_file),
        "FAKETIME_NO_CACHE": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


# libfaketime 0.9.10 with FAKETIME_DONT_FAKE_MONOTONIC=1 makes clock_nanosleep(CLOCK_MONOTONIC,
# TIMER_ABSTIME) fail with EINVAL, and Python's time.sleep uses exactly that: every sleep in the process
# (pymongo's monitor threads, Celery, our own backoff) would raise OSError. Processes under faketime get
# this sitecustomize, which sleeps with select() instead (unaffected). The wall clock stays shifted.
_SLEEP_FIX = """
import select, time

def _sleep(seconds, _select=select.select):
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    _select([], [], [], seconds)

time.sleep = _sleep
"""


def faketime_site(directory: Path) -> Path:
    """A directory with the sitecustomize above, to put first on PYTHONPATH under faketime."""
    site = directory / "faketime-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_SLEEP_FIX)
    return site


def write_offset(path: Path, offset: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(offset + "\n")
    os.replace(tmp, path)


# -- histories -----------------------------------------------------------------------------------------


class HistoryWriter:
    """Appends events (one JSON object a line, flushed at once) to this process's history file."""

    _by_pid: ClassVar[dict[int, HistoryWriter]] = {}

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: TextIO = open(path, "a", buffering=1)  # noqa: SIM115 - kept for the process's life
        self._lock = threading.Lock()

    @classmethod
    def for_process(cls, directory: str | Path) -> HistoryWriter:
        pid = os.getpid()
        writer = cls._by_pid.get(pid)
        if writer is None:
            writer = cls._by_pid[pid] = cls(Path(directory) / f"hist-{pid}.jsonl")
        return writer

    def event(self, ev: str, **fields: Any) -> None:
        line = json.dumps({"ev": ev, "pid": os.getpid(), **fields}, default=str)
        with self._lock:
            self._file.write(line + "\n")  # line-buffered: in the kernel even if we are SIGKILLed next

    def close(self) -> None:
        self._file.close()


def read_histories(directory: Path) -> list[Doc]:
    events: list[Doc] = []
    for path in sorted(directory.glob("hist-*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):  # a line cut short by SIGKILL
                events.append(json.loads(line))
    return events


# -- the protected read-modify-write ---------------------------------------------------------------------

_docs_clients: dict[tuple[int, str], MongoClient[Doc]] = {}


def docs_collection(url: str, db: str) -> Collection[Doc]:
    """The protected documents, through a client of this process's own (fork-safe).

    Its socket timeout (1 s) is shorter than the ``blockConnection`` fault, so held writes become
    ambiguous for the writer, as a lost reply would.
    """
    pid_key = (os.getpid(), url)
    client = _docs_clients.get(pid_key)
    if client is None:
        client = _docs_clients[pid_key] = MongoClient(
            url,
            appname="lockcheck",
            serverSelectionTimeoutMS=3000,
            socketTimeoutMS=1000,
            connectTimeoutMS=1000,
        )
    return client[db].get_collection("protected", write_concern=WriteConcern(w="majority", j=True))


def _write(docs: Collection[Doc], lease: Lease, op: str, p: int) -> tuple[str, bool]:
    """The fenced, idempotent write of ``counter = p + 1``. Returns (outcome, resolved after a retry)."""
    key = lease.key
    entry = {"k": "w", "o": op, "h": lease.owner, "f": lease.fence, "p": p}

    def write() -> bool:
        result = fenced_update_one(
            docs,
            {"_id": key, "log.o": {"$ne": op}},
            {"$set": {"counter": p + 1}, "$push": {"log": entry}},
            lease,
        )
        # matched 0: the filter excludes documents holding ``op`` already: an earlier attempt of this
        # operation (ours, or a previous run of the same Celery task) was applied.
        return result.matched_count == 1

    return write_retrying(write, FencedOut, docs, key, op)


def run_hold(
    lease: Lease,
    docs: Collection[Doc],
    hist: HistoryWriter,
    ops: Sequence[str],
    rng: random.Random,
    *,
    reckless: bool,
    who: str,
    task_id: str | None = None,
    work: tuple[float, float] = (0.05, 0.4),
) -> list[str]:
    """Under ``lease``: claim the protected document, then one read-modify-write per op. Returns the
    outcome of each op attempted (fewer than ``ops`` if the hold ended early)."""
    key, hold, fence = lease.key, lease.owner, lease.fence
    t0 = time.monotonic()  # (``t0``: sent at; check_cancel compares it with a supersession notice)
    try:
        fenced_update_one(
            docs,
            {"_id": key},
            {"$push": {"log": {"k": "c", "h": hold, "f": fence}}, "$setOnInsert": {"counter": 0}},
            lease,
            upsert=True,
        )
    except FencedOut:
        hist.event("claim", key=key, hold=hold, fence=fence, outcome="fenced", who=who, t0=t0)
        return []
    except PyMongoError as exc:
        hist.event(
            "claim", key=key, hold=hold, fence=fence, outcome="error", error=type(exc).__name__, who=who
        )
        return []
    hist.event("claim", key=key, hold=hold, fence=fence, outcome="ok", who=who, t0=t0)
    outcomes: list[str] = []
    for op in ops:
        try:
            doc = docs.find_one({"_id": key}, {"counter": 1})
        except PyMongoError as exc:
            hist.event("read", key=key, hold=hold, op=op, outcome="error", error=type(exc).__name__)
            outcomes.append("error")
            break
        p = int((doc or {}).get("counter", 0))
        end = time.monotonic() + rng.uniform(*work)  # the work; SIGSTOP and clock jumps land here
        while time.monotonic() < end:
            time.sleep(min(0.02, max(0.0, end - time.monotonic())))
        base = {"key": key, "hold": hold, "fence": fence, "op": op, "p": p, "who": who, "task_id": task_id}
        if not reckless and lease.lost:
            hist.event("write", **base, outcome="lost-detected", t=time.monotonic())
            outcomes.append("lost-detected")
            break
        t0 = time.monotonic()
        outcome, retried = _write(docs, lease, op, p)
        hist.event(
            "write", **base, outcome=outcome, retried=retried, reckless=reckless, t0=t0, t=time.monotonic()
        )
        outcomes.append("ack" if outcome.startswith("ack") else outcome)
        if outcome not in {"ack", "ack-earlier"}:
            break
    return outcomes


# -- d keys: the lock inside the protected document itself (``DocumentLock``) -----------------------------


def document_lock(store: LeaseStore, key: str, who: str, ttl: float | None = None) -> DocumentLock:
    """The ``DocumentLock`` of ``key``'s protected document (through the store's client)."""
    coll = store.client[store.database_name]["protected"]
    return DocumentLock(coll, key, store=store, ttl=ttl, info={"who": who})


def ensure_document(docs: Collection[Doc], key: str) -> bool:
    """A document lock lives in its document: make the protected document exist (no lock, no write)."""
    try:
        docs.update_one({"_id": key}, {"$setOnInsert": {"counter": 0, "log": []}}, upsert=True)
    except DuplicateKeyError:
        return True
    except PyMongoError:
        return False
    return True


def _document_write(locked: DocumentLease, op: str, p: int) -> tuple[str, bool]:
    """``_write`` through ``locked.update_one``: one command whose filter is the lock itself, idempotent
    (a pipeline that leaves a document already holding ``op`` unchanged: an ambiguous attempt retried)."""
    entry = {"k": "w", "o": op, "h": locked.owner, "f": locked.fence, "p": p}
    # (``$map``, not ``"$log.o"``: the embedded server resolves a path through an array of documents to
    # nothing, so ``done`` was always false there and a retry of an applied write appended it again: ci.)
    done = {"$in": [op, {"$map": {"input": {"$ifNull": ["$log", []]}, "as": "e", "in": "$$e.o"}}]}
    update = [
        {
            "$set": {
                "counter": {"$cond": [done, "$counter", p + 1]},
                "log": {"$cond": [done, "$log", {"$concatArrays": [{"$ifNull": ["$log", []]}, [entry]]}]},
            }
        }
    ]
    give_up = time.monotonic() + 8.0
    retried = unknown = False
    while True:
        try:
            result = locked.update_one(update)
            return ("ack" if result.modified else "ack-earlier"), retried
        except DocumentLockLost:
            # A refusal after an attempt whose outcome is unknown (``DocumentWriteUnknown``) says nothing
            # of that attempt: it may be in the document, so the write's outcome is unknown, not fenced.
            return ("ambiguous" if unknown else "fenced"), retried
        except DocumentWriteUnknown:
            retried = unknown = True
            if time.monotonic() > give_up:
                return "ambiguous", retried
            time.sleep(0.1 + random.random() * 0.2)
        except (StoreUnavailable, PyMongoError):
            retried = True
            if time.monotonic() > give_up:
                return "ambiguous", retried
            time.sleep(0.1 + random.random() * 0.2)


def run_document_hold(
    locked: DocumentLease,
    docs: Collection[Doc],
    hist: HistoryWriter,
    ops: Sequence[str],
    rng: random.Random,
    *,
    reckless: bool,
    who: str,
    work: tuple[float, float] = (0.05, 0.4),
    claim: bool = True,
) -> list[str]:
    """``run_hold`` for a document lock: claim (a log entry written through the lock), then one
    read-modify-write per op, each write one ``locked.update_one``."""
    if claim and not _document_claim(locked, hist, who):
        return []
    return _document_ops(locked, docs, hist, ops, rng, reckless=reckless, who=who, work=work)


def _document_claim(locked: DocumentLease, hist: HistoryWriter, who: str) -> bool:
    key, hold, fence = str(locked.document.id), locked.owner, locked.fence
    try:
        locked.update_one({"$push": {"log": {"k": "c", "h": hold, "f": fence}}})
    except DocumentLockLost:
        hist.event("claim", key=key, hold=hold, fence=fence, outcome="fenced", who=who)
        return False
    except (StoreUnavailable, PyMongoError) as exc:
        hist.event(
            "claim", key=key, hold=hold, fence=fence, outcome="error", error=type(exc).__name__, who=who
        )
        return False
    hist.event("claim", key=key, hold=hold, fence=fence, outcome="ok", who=who)
    return True


def _document_ops(
    locked: DocumentLease,
    docs: Collection[Doc],
    hist: HistoryWriter,
    ops: Sequence[str],
    rng: random.Random,
    *,
    reckless: bool,
    who: str,
    work: tuple[float, float],
) -> list[str]:
    key, hold, fence = str(locked.document.id), locked.owner, locked.fence
    outcomes: list[str] = []
    for op in ops:
        try:
            doc = docs.find_one({"_id": key}, {"counter": 1})
        except PyMongoError as exc:
            hist.event("read", key=key, hold=hold, op=op, outcome="error", error=type(exc).__name__)
            outcomes.append("error")
            break
        p = int((doc or {}).get("counter", 0))
        end = time.monotonic() + rng.uniform(*work)
        while time.monotonic() < end:
            time.sleep(min(0.02, max(0.0, end - time.monotonic())))
        base = {"key": key, "hold": hold, "fence": fence, "op": op, "p": p, "who": who, "document": True}
        if not reckless and locked.lost:
            hist.event("write", **base, outcome="lost-detected", t=time.monotonic())
            outcomes.append("lost-detected")
            break
        outcome, retried = _document_write(locked, op, p)
        hist.event("write", **base, outcome=outcome, retried=retried, reckless=reckless, t=time.monotonic())
        outcomes.append("ack" if outcome.startswith("ack") else outcome)
        if outcome not in {"ack", "ack-earlier"}:
            break
    return outcomes


def take_document(
    store: LeaseStore,
    docs: Collection[Doc],
    hist: HistoryWriter,
    key: str,
    who: str,
    *,
    ttl: float | None = None,
) -> DocumentLease | None:
    """One attempt at ``key``'s document lock, recorded as a bare client's acquisition (``acq`` with the
    lock's token and fence: the checks of the plain keys apply as they are); None when it is held."""
    if not ensure_document(docs, key):
        hist.event("err", who=who, key=key, what="ensure-document")
        return None
    t0 = time.monotonic()
    try:
        locked, _ = document_lock(store, key, who, ttl).try_acquire()
    except MongoLockError as exc:
        hist.event("err", who=who, key=key, what="acquire", error=type(exc).__name__)
        return None
    if locked is None:
        hist.event("contended", who=who, key=key)
        return None
    hist.event(
        "acq", key=key, hold=locked.owner, fence=locked.fence, t0=t0, t1=time.monotonic(), who=who,
        document=True, wall=time.time(),
    )  # fmt: skip
    return locked


# -- limit=N keys: N holds at once, one protected document per key with a fence and a counter per slot ----


class _SlotFenced(Exception):
    """A slot write refused: a newer hold of the same slot (larger fence) has written the document."""


def _slot_fenced(fence: int, slot: int) -> Doc:
    field = f"sf.{slot}"
    return {"$or": [{field: {"$lte": fence}}, {field: {"$exists": False}}]}


def _slot_update(docs: Collection[Doc], key: str, fence: int, slot: int, *, flt: Doc, update: Doc) -> bool:
    """``update`` on ``protected[key]`` if the slot's fence there is not larger than ours (and ``flt``
    matches), stamping our fence on the slot. True if applied, False if ``flt`` did not match (e.g. the op
    is there already); raises ``_SlotFenced`` if a newer hold of the slot has written."""
    stamped = {**update, "$set": {**update.get("$set", {}), f"sf.{slot}": fence}}
    result = docs.update_one({"$and": [{"_id": key}, flt, _slot_fenced(fence, slot)]}, stamped)
    if result.matched_count:
        return True
    if flt and docs.find_one({"$and": [{"_id": key}, flt]}, {"_id": 1}) is None:
        # ``flt`` no longer matches: the op is applied already (a retry of a write whose reply was
        # lost), whether or not a newer hold of the slot has written since (soak seed 2: judged fenced).
        return False
    doc = docs.find_one({"_id": key}, {"sf": 1})
    newer = int(((doc or {}).get("sf") or {}).get(str(slot), 0))
    if newer > fence:
        raise _SlotFenced(newer)
    return False


def run_slot_hold(
    lease: Lease,
    docs: Collection[Doc],
    hist: HistoryWriter,
    ops: Sequence[str],
    rng: random.Random,
    *,
    reckless: bool,
    who: str,
    task_id: str | None = None,
    work: tuple[float, float] = (0.05, 0.4),
) -> list[str]:
    """``run_hold`` for a hold of one of the N slots of a ``limit=N`` key. Up to N holders write the key's
    one protected document at once, so each guards only its own part, with its own fence::

        {_id: key, counter: int, sc: {slot: int}, sf: {slot: fence}, log: [entry, ...]}

    claim: push ``{k: "c", h, f, s}`` and stamp ``sf.<s>``; each op: read ``sc.<s>`` (p), work, then
    ``$set sc.<s> = p + 1``, ``$inc counter``, push ``{k: "w", o, h, f, s, p}``, filtered on ``sf.<s>
    <= f`` (a stale holder of the same slot is fenced out) and ``log.o != op`` (idempotent across slots:
    a retried task that gets another slot still applies its op once). So within a slot the history is a
    single-holder history (checked like a plain key's log), and ``counter`` counts every applied write."""
    key, hold, fence, slot = lease.key, lease.owner, lease.fence, int(lease.slot or 0)
    try:
        with contextlib.suppress(DuplicateKeyError):  # two first claims at once: the other inserted it
            docs.update_one({"_id": key}, {"$setOnInsert": {"counter": 0, "log": []}}, upsert=True)
        ok = _slot_update(
            docs,
            key,
            fence,
            slot,
            flt={},
            update={"$push": {"log": {"k": "c", "h": hold, "f": fence, "s": slot}}},
        )
        if not ok:
            raise PyMongoError("the protected document is missing")
    except _SlotFenced:
        hist.event("claim", key=key, hold=hold, fence=fence, slot=slot, outcome="fenced", who=who)
        return []
    except PyMongoError as exc:
        hist.event(
            "claim", key=key, hold=hold, fence=fence, slot=slot, outcome="error", error=type(exc).__name__,
            who=who,
        )  # fmt: skip
        return []
    hist.event("claim", key=key, hold=hold, fence=fence, slot=slot, outcome="ok", who=who)
    outcomes: list[str] = []
    for op in ops:
        try:
            doc = docs.find_one({"_id": key}, {"sc": 1})
        except PyMongoError as exc:
            hist.event("read", key=key, hold=hold, op=op, outcome="error", error=type(exc).__name__)
            outcomes.append("error")
            break
        p = int(((doc or {}).get("sc") or {}).get(str(slot), 0))
        end = time.monotonic() + rng.uniform(*work)
        while time.monotonic() < end:
            time.sleep(min(0.02, max(0.0, end - time.monotonic())))
        base = {
            "key": key, "hold": hold, "fence": fence, "slot": slot, "op": op, "p": p, "who": who,
            "task_id": task_id,
        }  # fmt: skip
        if not reckless and lease.lost:
            hist.event("write", **base, outcome="lost-detected", t=time.monotonic())
            outcomes.append("lost-detected")
            break
        entry = {"k": "w", "o": op, "h": hold, "f": fence, "s": slot, "p": p}
        update = {"$set": {f"sc.{slot}": p + 1}, "$inc": {"counter": 1}, "$push": {"log": entry}}
        outcome, retried = write_retrying(
            functools.partial(
                _slot_update, docs, key, fence, slot, flt={"log.o": {"$ne": op}}, update=update
            ),
            _SlotFenced,
            docs,
            key,
            op,
        )
        hist.event("write", **base, outcome=outcome, retried=retried, reckless=reckless, t=time.monotonic())
        outcomes.append("ack" if outcome.startswith("ack") else outcome)
        if not outcome.startswith("ack"):
            break
    return outcomes


# -- keys=(a, b): a body that needs several keys writes each key's protected document with its fence ------


def run_multi_hold(
    leases: Any,
    docs: Collection[Doc],
    hist: HistoryWriter,
    op: str,
    rng: random.Random,
    *,
    reckless: bool,
    who: str,
    task_id: str | None = None,
) -> list[str]:
    """Under a ``LeaseSet``: for each of its keys, in the order the task names them, the plain claim +
    read-modify-write of that key's protected document (``run_hold``) with that key's own lease and
    fence, op ``<op>@<key>`` (idempotent per key: a retry skips what an earlier run applied); a key held
    as a slot (a limit per key: ``lease.slot``) writes its slot's part (``run_slot_hold``). Stops at the
    first key whose write is refused or fails (the task is retried). The body's start is recorded first
    (``mbody``: keys, holds, fences and slots, and whether each lease was still within its deadline)."""
    record_body(leases, hist, who, task_id)
    outcomes: list[str] = []
    for key in leases.keys:
        hold = run_hold if leases[key].slot is None else run_slot_hold
        got = hold(
            leases[key], docs, hist, [multi_op(op, key)], rng, reckless=reckless, who=who, task_id=task_id,
            work=(0.05, 0.3),
        )  # fmt: skip
        outcome = got[0] if got else "claim-failed"
        outcomes.append(outcome)
        if outcome != "ack":
            break
    return outcomes


def record_body(leases: Any, hist: HistoryWriter, who: str, task_id: str | None) -> None:
    """A several-keys body's start (``mbody``): its keys, each one's hold token, fence and slot, and
    whether each lease was still within its deadline."""
    now = time.monotonic()
    hist.event(
        "mbody", task_id=task_id, who=who, t=now, keys=list(leases.keys),
        holds={k: leases[k].owner for k in leases.keys}, fences={k: leases[k].fence for k in leases.keys},
        expired=[k for k in leases.keys if leases[k].deadline <= now or leases[k].lost],
        acquired={k: leases[k].acquired_mono for k in leases.keys},
        deadlines={k: leases[k].deadline for k in leases.keys},
        lost={k: leases[k].lost_reason for k in leases.keys if leases[k].lost_reason},
        slots={k: leases[k].slot for k in leases.keys if leases[k].slot is not None},
    )  # fmt: skip


def run_reentered(
    inner: Lease,
    via: str,
    *,
    store: LeaseStore,
    docs: Collection[Doc],
    hist: HistoryWriter,
    op: str,
    rng: random.Random,
    reckless: bool,
    who: str,
    task_id: str | None,
) -> str:
    """A reentrant run's write to one of its keys under ``inner``, the lease it got asking again for the
    key (``via``: ``call``, an in-process singleton function; ``hold``, ``store.hold``): records
    ``reenter`` (and, for a slot, the run's other live slots of the key, read from the lease document),
    then, if ``inner`` is a reentrant hold, the claim + read-modify-write of ``<op>@<key>``. Its outcome;
    ``not-reentered`` when the ask got a lease of its own (the run's lease was lost first): nothing is
    written then, and the run is retried."""
    reentered = isinstance(inner, ReentrantHold)
    others: list[Doc] = []
    if inner.slot is not None:
        with contextlib.suppress(MongoLockError):
            info = store.inspect(inner.key)
            others = [
                {"slot": s.get("slot"), "fence": s.get("fence")}
                for s in (info.slots if info else [])
                if (s.get("holder") or {}).get("task_id") == task_id and s.get("fence") != inner.fence
            ]
    hist.event(
        "reenter", task_id=task_id, who=who, t=time.monotonic(), key=inner.key, via=via, reentered=reentered,
        hold=inner.owner, fence=inner.fence, slot=inner.slot, depth=getattr(inner, "depth", None),
        other_slots=others,
    )  # fmt: skip
    if not reentered:
        return "not-reentered"
    hold = run_hold if inner.slot is None else run_slot_hold
    got = hold(
        inner, docs, hist, [multi_op(op, inner.key)], rng, reckless=reckless, who=who, task_id=task_id,
        work=(0.05, 0.3),
    )  # fmt: skip
    return got[0] if got else "claim-failed"


def multi_op(op: str, key: str) -> str:
    """The op id of a several-keys task's write to one of its keys."""
    return f"{op}@{key}"


def record_task_acquired(
    hist: HistoryWriter,
    lease: Lease,
    who: str,
    task_id: str | None,
    stamp: int | None = None,
    *,
    sent_after: float | None = None,
    min_hold: float | None = None,
) -> None:
    t1 = time.monotonic()
    # When the acquire was sent (``sent_mono``: a renewal between the grant and this record does not move
    # it, as it moves the deadline); or, for the second key of a set, no later than the first key's reply
    # (``sent_after``: taken in turn).
    t0 = min(t1, lease.sent_mono)
    if sent_after is not None:
        t0 = min(t0, sent_after)
    extra: Doc = {}
    if lease.slot is not None:
        extra["slot"] = lease.slot
    if min_hold:
        extra["mh"] = float(min_hold)  # the slot stays taken at least this long after ``t0``
    if lease.acquired_mono >= lease.deadline:  # answered after its own deadline: lost from the start
        extra["late_reply"] = True
    hist.event(
        "acq", key=lease.key, hold=lease.owner, fence=lease.fence, t0=t0, t1=t1, who=who, task_id=task_id,
        stamp=stamp, **extra,
    )  # fmt: skip


def record_set_acquired(hist: HistoryWriter, leases: Any, who: str, task_id: str | None) -> None:
    """``record_task_acquired`` for each lease of a ``LeaseSet`` (taken one after the other, in order of
    their replies: each was sent no later than the previous one's reply came)."""
    previous: float | None = None
    for lease in sorted(leases, key=lambda lease: lease.acquired_mono):
        record_task_acquired(hist, lease, who, task_id, sent_after=previous)
        previous = lease.acquired_mono


def rate_window_record(window: RateWindow) -> Doc:
    """A rate window as a reply showed it: its key, the command's clock (``now``, epoch ms on the server),
    its starts (``[t, start id]``, oldest first) and parked runs (``[run, send stamp, stale at]``)."""
    return {
        "key": window.key,
        "now": window.now_ms,
        "starts": [[t, i] for t, i in zip(window.starts_ms, window.start_ids, strict=True)],
        "waiters": [[w.run, w.stamp, w.stale_at_ms] for w in window.waiters],
    }


def record_rate_take(
    hist: HistoryWriter, took: RateTake, windows: Sequence[RateWindow], *, n: int, period_ms: int, t0: float,
    **fields: Any,
) -> None:  # fmt: skip
    """One attempt of a run to take a start (``rtake``): granted (``start_id``, found with its time among
    the starts of each key's window) or parked on key ``on`` with its place; every window its commands'
    replies showed. ``fields``: who, task id, run id, send stamp, keys."""
    hist.event(
        "rtake", **fields, n=n, p=period_ms, started=took.started, start_id=took.start_id, on=took.key,
        position=took.position, wait=round(took.wait_seconds, 3), t0=t0, t=time.monotonic(),
        windows=[rate_window_record(w) for w in windows],
    )  # fmt: skip


def release_and_record(lease: Lease, hist: HistoryWriter, who: str) -> bool:
    """Release ``lease`` and record it; whether the release matched (the run ended holding its key)."""
    t = time.monotonic()  # sent at; a release that matched proves the hold lasted until at least here
    try:
        released = lease.release()
        error = None
    except MongoLockError as exc:
        released, error = False, type(exc).__name__
    hist.event("rel", key=lease.key, hold=lease.owner, released=released, t=t, error=error, who=who)
    return released


def handed_in(doc: Any) -> list[list[Any]]:
    """Every run a release's reply shows handed the key and not yet claimed, as ``[task id, fence, slot,
    handing]``: the key's own handoff (``ho``, its fence the key's; slot None) and each slot's (``hs``)."""
    out: list[list[Any]] = []
    ho = (doc or {}).get("ho")
    if isinstance(ho, dict):
        out.append([ho.get("t"), (doc or {}).get("fence"), None, ho.get("hn")])
    for h in (doc or {}).get("hs") or []:
        if isinstance(h, dict) and isinstance(h.get("ho"), dict):
            out.append([h["ho"].get("t"), h.get("f"), h.get("s"), h["ho"].get("hn")])
    return out


def record_releases_handoffs(store: LeaseStore, hist: HistoryWriter) -> None:
    """Record (``handed-seen``) the runs each release of ``store`` hands the key to. A store with no
    handoff callback (the controller's gates, the bare clients) leaves its handoffs unmarked, for a
    worker's sweep to adopt and publish: until then nobody else records them, and a handoff that then
    expires unclaimed is handed again with a new fence, so the run's first grant would be missing from
    the histories (a false ``inversion`` of a newer run handed a slot after it)."""
    publish = store.handoffs.publish

    def recorded(key: str, doc: Any, by: str, *, refill: bool = True) -> Any:
        handed = handed_in(doc)
        if handed:
            hist.event("handed-seen", key=key, handed_slots=handed, t=time.monotonic())
        return publish(key, doc, by, refill=refill)

    store.handoffs.publish = recorded  # type: ignore[method-assign]


# -- a bare LeaseStore client (a process of its own) ----------------------------------------------------


def key_for(i: int, epoch: int, kind: str = "k") -> str:
    """Key ``i`` of an epoch: ``k`` keys take plain runs (``Retry``, ``Skip``) and the several-keys runs
    (two ``k`` keys each), ``q`` keys ``Queue`` runs, ``r`` keys ``Replace`` runs, ``l`` keys ``limit=N``
    runs; a several-keys run with a limit per key (``MULTI_LIMIT_TASK``) takes a slot of an ``l`` key and
    a ``k`` key as a single lease (a key is a limited or a single one, never both); ``t`` keys take the
    rate-limited runs (``RATE_TASK``). The bare clients take all of them but the ``t`` keys (plain
    acquires beside parked runs, ``limit=N`` acquires on ``l`` keys)."""
    return f"{PREFIX}{kind}{i}.e{epoch}"


def window_pair(attempt: int) -> tuple[int, int]:
    """The key indexes (``m`` keys) of the reservation window's attempt ``attempt`` (0: the first)."""
    first = WINDOW_KEY if attempt == 0 else WINDOW_AGAIN_KEY + 2 * attempt
    return first, first + 1


def window_first_key(key: str) -> str | None:
    """The reservation window's first key when ``key`` is the second of an attempt's pair, else None."""
    for attempt in range(WINDOW_ATTEMPTS):
        first, second = window_pair(attempt)
        prefix = f"{PREFIX}m{second}.e"
        if key.startswith(prefix):
            return f"{PREFIX}m{first}.e{key[len(prefix) :]}"
    return None


def key_policy(key: str) -> str:
    """Which runs a key takes: ``plain``, ``queue``, ``replace``, ``limit``, ``document`` (``d`` keys:
    the protected document's own ``DocumentLock``, taken by the bare clients and the controller),
    ``multi_replace``, ``rate`` (``t`` keys: ``RATE_TASK`` runs only) or ``mixed`` (``x`` keys:
    ``lockcheck_mixed``)."""
    kind = key[len(PREFIX) : len(PREFIX) + 1] if key.startswith(PREFIX) else "k"
    kinds = {"q": "queue", "r": "replace", "l": "limit", "d": "document", "m": "multi_replace", "t": "rate"}
    kinds[mixed.KIND] = "mixed"  # (``x`` keys: used both as a single lease and as slots, lockcheck_mixed)
    return kinds.get(kind, "plain")


def any_key(rng: random.Random, cfg: Doc, epoch: int) -> str:
    """A bare client's next key: mostly a plain one, sometimes a queued one (where runs park)."""
    kinds = [("k", cfg["keys"])] * 3 + [("q", cfg.get("queue_keys", 0)), ("r", cfg.get("replace_keys", 0))]
    kinds += [("l", cfg.get("limit_keys", 0)), ("d", cfg.get("doc_keys", 0))]
    kinds += [("m", cfg.get("multi_replace_keys", 0)), (mixed.KIND, cfg.get("mixed_keys", 0))]
    kind, n = rng.choice([k for k in kinds if k[1] > 0])
    return key_for(rng.randrange(n), epoch, kind)


def current_epoch(start: float, epoch_seconds: float) -> int:
    return int(max(0.0, time.monotonic() - start) // epoch_seconds)


def client_main(cfg: Doc) -> None:
    """A bare ``LeaseStore`` user: takes leases on random keys and does read-modify-writes under them."""
    name = cfg["name"]
    rng = random.Random(cfg["seed"])
    hist = HistoryWriter.for_process(cfg["hist_dir"])
    store = LeaseStore(cfg["url"], database=cfg["db"], lease_seconds=cfg["ttl"], operation_timeout=3.0)
    record_releases_handoffs(store, hist)
    docs = docs_collection(cfg["url"], cfg["db"])
    stop_file = Path(cfg["stop_file"])
    parent = os.getppid()
    seq = 0
    hist.event("start", who=name, wall=time.time())
    while not stop_file.exists() and os.getppid() == parent:
        key = any_key(rng, cfg, current_epoch(cfg["start"], cfg["epoch_seconds"]))
        if key_policy(key) == "document":
            seq = _document_round(store, docs, hist, key, name, rng=rng, cfg=cfg, seq=seq)
            continue
        limit = LIMIT if key_policy(key) == "limit" else None
        if key_policy(key) == "mixed":  # (either kind, at random)
            limit = LIMIT if rng.random() < 0.5 else None
        t0 = time.monotonic()
        try:
            lease = store.acquire(key, heartbeat=True, info={"who": name}, limit=limit)
        except MongoLockError as exc:
            hist.event("err", who=name, key=key, what="acquire", error=type(exc).__name__)
            time.sleep(rng.uniform(0.1, 0.4))
            continue
        t1 = time.monotonic()
        if lease is None:
            hist.event("contended", who=name, key=key)
            time.sleep(rng.uniform(0.02, 0.15))
            continue
        hist.event(
            "acq", key=key, hold=lease.owner, fence=lease.fence, t0=t0, t1=t1, who=name, wall=time.time(),
            **({} if lease.slot is None else {"slot": lease.slot}),
        )  # fmt: skip
        ops = []
        for _ in range(rng.randint(1, 3)):
            seq += 1
            ops.append(f"{name}-{seq}")
        hold = run_hold if lease.slot is None else run_slot_hold
        if key_policy(key) == "mixed":
            hold = mixed.run_mixed_hold
        try:
            hold(lease, docs, hist, ops, rng, reckless=rng.random() < cfg["reckless"], who=name)
        except Exception:  # a bug in the workload or the library: recorded, and the run goes on
            hist.event("unexpected", who=name, error=traceback.format_exc()[-2000:])
        release_and_record(lease, hist, name)
        time.sleep(rng.uniform(0.0, 0.1))
    hist.event("stop", who=name)
    with contextlib.suppress(Exception):
        store.close()


def _document_round(
    store: LeaseStore,
    docs: Collection[Doc],
    hist: HistoryWriter,
    key: str,
    name: str,
    *,
    rng: random.Random,
    cfg: Doc,
    seq: int,
) -> int:
    """A bare client's turn on a ``d`` key: its document lock, a claim and 1 to 3 read-modify-writes
    through ``locked.update_one``, the release; returns the client's op sequence number."""
    locked = take_document(store, docs, hist, key, name)
    if locked is None:
        time.sleep(rng.uniform(0.02, 0.15))
        return seq
    ops = []
    for _ in range(rng.randint(1, 3)):
        seq += 1
        ops.append(f"{name}-{seq}")
    try:
        run_document_hold(locked, docs, hist, ops, rng, reckless=rng.random() < cfg["reckless"], who=name)
    except Exception:
        hist.event("unexpected", who=name, error=traceback.format_exc()[-2000:])
    release_document(locked, hist, name)
    time.sleep(rng.uniform(0.0, 0.1))
    return seq


def release_document(locked: DocumentLease, hist: HistoryWriter, who: str) -> bool:
    """``release_and_record`` for a document lock (its history key is the document's ``_id``)."""
    t = time.monotonic()
    try:
        released = locked.release()
        error = None
    except MongoLockError as exc:
        released, error = False, type(exc).__name__
    key = str(locked.document.id)
    hist.event("rel", key=key, hold=locked.owner, released=released, t=t, error=error, who=who)
    return released


# -- the history checker ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Violation:
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


@dataclasses.dataclass
class History:
    """What a run produced: the processes' events, the final protected documents (by key) and the
    final state of every submitted Celery task (``{task_id: {"state", "result", "op"}}``)."""

    events: list[Doc]
    docs: dict[str, Doc]
    tasks: dict[str, Doc] = dataclasses.field(default_factory=dict)
    #: Every send of the ``unique_send`` task (``Run._submit_unique``): key, op, task id or ``refused``,
    #: when it began and returned (``t0``, ``t1``: the controller's monotonic clock, the workers' too).
    sends: list[Doc] = dataclasses.field(default_factory=list)


def _died(history: History, *, released: bool = True) -> dict[str, float]:
    """Task id -> when its run died after its body had released the key (``die`` events, the first). With
    ``released=False``: the runs whose release matched nothing (the lease had expired, or its release got
    no answer): the key does not know that they ran, and their copy runs again (at least once)."""
    out: dict[str, float] = {}
    for ev in history.events:
        if ev.get("ev") == "die" and ev.get("task_id") and bool(ev.get("released", True)) == released:
            out.setdefault(str(ev["task_id"]), float(ev["t"]))
    return out


def _already_ran(task: Doc) -> bool:
    result = task.get("result")
    return (
        task.get("state") == "SUCCESS"
        and isinstance(result, dict)
        and result.get("mongolock") == "already-ran"
    )


def check_died(history: History) -> list[Violation]:
    """Runs that died after their body released the key, before the result was stored (``die``): no body of
    the task starts after that (its copies are copies of a run that ran), and a task that ended did so
    ``already-ran`` (the body's own result was never stored, so any other one came from a second body).
    One that never ended is ``task-unfinished`` (step 4)."""
    found: list[Violation] = []
    died = _died(history)
    for ev in history.events:
        task_id = str(ev.get("task_id"))
        if ev.get("ev") == "acq" and task_id in died and float(ev["t1"]) > died[task_id]:
            found.append(
                Violation(
                    "ran-after-release",
                    f"task {task_id}: a body took {ev.get('key')} (fence {ev.get('fence')}) after its run "
                    "had released the key and died before its result was stored"
                    + _deliveries(history, task_id),
                )
            )
    for task_id in sorted(died):
        task = history.tasks.get(task_id) or {}
        if task.get("state") == "SUCCESS" and not _already_ran(task):
            found.append(
                Violation(
                    "ran-after-release",
                    f"task {task_id} ended {task.get('result')!r}, not already-ran: its run died before its "
                    "result was stored, so that result is a second body's" + _deliveries(history, task_id),
                )
            )
    return found


def _deliveries(history: History, task_id: str) -> str:
    """The deliveries of ``task_id`` and its body starts, in time order, for a violation's detail: which
    message ran (a first delivery, a broker's redelivery, a parked duplicate, a handoff)."""
    seen: list[tuple[float, str]] = []
    for ev in history.events:
        if ev.get("task_id") != task_id:
            continue
        if ev.get("ev") == "recv":
            kinds = [k for k in ("redelivered", "dup", "handoff") if ev.get(k)] or ["first"]
            seen.append((float(ev["t"]), f"recv {ev.get('node')} {'+'.join(kinds)} r{ev.get('retries')}"))
        elif ev.get("ev") in ("acq", "die", "rel"):
            at = ev.get("t1") if ev.get("t1") is not None else ev.get("t", 0.0)
            seen.append((float(at or 0.0), f"{ev['ev']} {ev.get('who', '')}".strip()))
    seen.sort()
    return " [" + "; ".join(f"{t:.2f} {what}" for t, what in seen[:20]) + "]" if seen else ""


def record_receipt(
    hist: HistoryWriter,
    leases: Any,
    who: str,
    task_id: str | None,
    *,
    attempt: Any,
    redelivered: bool,
    dup: bool,
    handoff: bool,
) -> None:
    """A Celery body's start (``body``): which delivery of which attempt runs it (the run's ``retries``, the
    broker's redelivery flag, a parked duplicate, a handoff) and the hold token of each of its keys, so that
    a second body of a task is told apart: the same attempt run again, or a later attempt."""
    holds = {one.key: one.owner for one in leases} if hasattr(leases, "keys") else {leases.key: leases.owner}
    hist.event(
        "body", task_id=task_id, who=who, t=time.monotonic(), attempt=attempt, redelivered=redelivered,
        dup=dup, handoff=handoff, holds=holds,
    )  # fmt: skip


def _receipt_kind(receipt: Doc) -> str:
    """``first`` (a message's first delivery), or how the copy came: ``redelivered``, ``dup``, ``handoff``."""
    return "+".join(k for k in ("redelivered", "dup", "handoff") if receipt.get(k)) or "first"


def _receipt_text(receipt: Doc) -> str:
    return f"attempt r{receipt.get('attempt')} {_receipt_kind(receipt)} delivery ({receipt.get('who')})"


def receipts_by_hold(history: History) -> dict[str, Doc]:
    """Each body receipt (``body``) by the hold token of each of its keys."""
    return {
        str(hold): ev
        for ev in history.events
        if ev.get("ev") == "body"
        for hold in (ev.get("holds") or {}).values()
    }


def twice_kind(first: Doc | None, again: Doc | None) -> tuple[str, str]:
    """A body that started after a body of the same task finished: ``first-after-redelivered`` (a message's
    first delivery whose body starts only after its own redelivered copy's body finished),
    ``same-attempt-twice`` (one attempt's body ran twice), or ``run-twice`` (a later attempt, or receipts
    missing); with words naming both deliveries."""
    if first is None or again is None:
        return "run-twice", "(no receipt of which delivery ran: attempts unknown)"
    what = f"(finished: {_receipt_text(first)}; again: {_receipt_text(again)})"
    if first.get("attempt") != again.get("attempt"):
        return "run-twice", f"a later attempt {what}"
    if _receipt_kind(again) == "first" and _receipt_kind(first) != "first":
        return (
            "first-after-redelivered",
            f"the first delivery started after its redelivered copy finished {what}",
        )
    return "same-attempt-twice", f"the same attempt ran twice {what}"


def body_finished(receipt: Doc, releases: dict[str, Doc], wrote: set[str]) -> float | None:
    """When the body of ``receipt`` finished (wrote its op through every key's hold and released each
    cleanly: the latest release), or None."""
    holds = [str(h) for h in (receipt.get("holds") or {}).values()]
    if not holds or not all(h in wrote and releases.get(h, {}).get("released") for h in holds):
        return None
    return max(float(releases[h]["t"]) for h in holds)


def _twice_of_holds(history: History, first: Any, again: Any) -> tuple[str, str]:
    """``twice_kind`` for two bodies named by their holds (``{key: hold token}``): the receipts of each."""
    by_hold = receipts_by_hold(history)

    def receipt(holds: Any) -> Doc | None:
        return next((by_hold[str(h)] for h in (holds or {}).values() if str(h) in by_hold), None)

    return twice_kind(receipt(first), receipt(again))


def check_receipts(history: History) -> list[Violation]:
    """Per task, from the body receipts: no body starts after a body of the same attempt finished (its op
    written through every key, every key released cleanly), whichever delivery it came from. A first
    delivery that starts only after its own redelivered copy finished is ``first-after-redelivered``;
    another second body of one attempt is ``same-attempt-twice``. ``Queue`` runs are judged by their
    ``run-twice`` checks (``check_queued``, ``multi_run_twice``), which name the same kinds."""
    releases = {str(ev["hold"]): ev for ev in history.events if ev.get("ev") == "rel"}
    wrote = {
        str(ev["hold"])
        for ev in history.events
        if ev.get("ev") == "write" and str(ev.get("outcome", "")).startswith("ack")
    }
    queued = {tid for tid, t in history.tasks.items() if t.get("task") in QUEUED_TASKS}
    bodies: dict[str, list[Doc]] = defaultdict(list)
    for ev in history.events:
        if ev.get("ev") == "body" and ev.get("task_id") and ev["task_id"] not in queued:
            bodies[str(ev["task_id"])].append(ev)
    found: list[Violation] = []
    for task_id, runs in sorted(bodies.items()):
        done = sorted(
            (end, i) for i, b in enumerate(runs) if (end := body_finished(b, releases, wrote)) is not None
        )
        for end, i in done[:1]:
            for again in runs:
                if (
                    again is runs[i]
                    or float(again["t"]) <= end
                    or again.get("attempt") != runs[i].get("attempt")
                ):
                    continue
                kind, words = twice_kind(runs[i], again)
                found.append(
                    Violation(
                        kind,
                        f"{task_id} on {list(again.get('holds') or {})}: a body started "
                        f"{float(again['t']) - end:.1f}s after a body of the task finished: {words}"
                        + _deliveries(history, task_id),
                    )
                )
    return found


def died_figures(history: History) -> Doc:
    """How many runs died after their body released the key (``die``), how many of their tasks ended
    ``already-ran``, and how many were fault-gated runs (one per fault)."""
    died = _died(history)
    tasks = [history.tasks.get(t) or {} for t in died]
    return {
        "died_after_release": len(died),
        "died_ended_already_ran": sum(1 for t in tasks if _already_ran(t)),
        "died_fault_gated": sum(1 for t in tasks if str(t.get("op", "")).startswith("fault-gate-")),
        "died_with_the_lease_lost": len(_died(history, released=False)),
    }


def check(history: History) -> list[Violation]:
    """Every violation of the lock's guarantees found in ``history`` (empty: none)."""
    found: list[Violation] = []
    applied: dict[str, list[tuple[str, str]]] = defaultdict(list)  # op -> [(key, hold)]

    # 1. The server-side order: each protected document's log.
    for key, doc in sorted(history.docs.items()):
        if key_policy(key) == "limit":
            found += check_slot_log(key, doc, applied)
            continue
        if key_policy(key) == "mixed":
            found += [Violation(kind, detail) for kind, detail in mixed.check_mixed_log(key, doc, applied)]
            continue
        log = doc.get("log") or []
        writes = 0
        prev_fence: int | None = None
        hold: str | None = None
        hold_fence: int | None = None
        closed: set[str] = set()
        for i, entry in enumerate(log):
            fence, h = int(entry["f"]), str(entry["h"])
            if prev_fence is not None and fence < prev_fence:
                found.append(
                    Violation("fence-backwards", f"{key} log[{i}]: fence {fence} after fence {prev_fence}")
                )
            if h != hold:
                if h in closed:
                    found.append(
                        Violation("overlap", f"{key} log[{i}]: hold {h[:8]} writes again after hold {hold}")
                    )
                if hold is not None:
                    closed.add(hold)
                if hold_fence is not None and fence == hold_fence:
                    found.append(
                        Violation(
                            "fence-reused", f"{key} log[{i}]: holds {hold} and {h[:8]} share fence {fence}"
                        )
                    )
                hold, hold_fence = h, fence
            elif fence != hold_fence:
                found.append(
                    Violation("fence-changed", f"{key} log[{i}]: hold {h[:8]} wrote with two fences")
                )
            prev_fence = fence
            if entry.get("k") == "w":
                op = str(entry["o"])
                applied[op].append((key, h))
                if int(entry["p"]) != writes:
                    found.append(
                        Violation(
                            "lost-update",
                            f"{key} log[{i}]: op {op} (hold {h[:8]}, fence {fence}) "
                            f"read counter {entry['p']} "
                            f"but {writes} writes were applied before it: it overwrote "
                            f"{writes - int(entry['p'])} acknowledged update(s)",
                        )
                    )
                writes += 1
        if int(doc.get("counter", 0)) != writes:
            found.append(
                Violation(
                    "lost-update", f"{key}: counter is {doc.get('counter')} after {writes} applied writes"
                )
            )
    for op, where in sorted(applied.items()):
        if len(where) > 1:
            found.append(Violation("applied-twice", f"op {op} applied {len(where)} times: {where}"))

    # 2. The clients' view against the server's.
    for ev in history.events:
        if ev.get("ev") != "write":
            continue
        op, outcome = str(ev["op"]), ev["outcome"]
        if outcome in ("ack", "ack-earlier") and op not in applied:
            found.append(
                Violation(
                    "lost-update", f"op {op} on {ev['key']} was acknowledged ({outcome}) but is not applied"
                )
            )
        if outcome in ("fenced", "lost-detected") and (ev["key"], ev["hold"]) in applied.get(op, []):
            found.append(
                Violation(
                    "fenced-but-applied",
                    f"op {op} was reported {outcome} but hold {ev['hold'][:8]} applied it",
                )
            )

    # 3. Acquisitions: fences strictly increase per key in real-time order; holds never overlap.
    acqs: dict[str, list[Doc]] = defaultdict(list)
    for ev in history.events:
        if ev.get("ev") == "acq":
            acqs[str(ev["key"])].append(ev)
    releases = {str(ev["hold"]): ev for ev in history.events if ev.get("ev") == "rel"}
    admitted = admitted_grant_starts(history.events)
    for key, items in sorted(acqs.items()):
        by_fence: dict[int, str] = {}
        for ev in items:
            other = by_fence.setdefault(int(ev["fence"]), str(ev["hold"]))
            if other != ev["hold"]:
                found.append(
                    Violation(
                        "fence-reused",
                        f"{key}: fence {ev['fence']} given to holds {other[:8]} and {ev['hold'][:8]}",
                    )
                )
        # Sweep: for each acquisition b, every acquisition a answered before b was sent has a smaller fence.
        # On a limit=N key, a slot handed to a parked run got its fence when it was handed, not when the
        # run claimed it, and other slots may be taken in between: such a claim "began" no later than
        # the run's first admission on the key (it was parked before it was handed anything).
        # An acquisition by a Celery run's admit began when that admit was sent (its ``acq`` record is
        # written later, by the run: ci17, a skewed node's run recorded it 0.65 s after its admit's reply,
        # after a bare client's acquisition with a larger fence had ended).
        slotted = key_policy(key) in ("limit", "mixed")
        began = handed_grant_starts(history.events, key) if slotted else {}
        began.update((grant, min(t0, began.get(grant, t0))) for grant, t0 in admitted.get(key, {}).items())
        start_of: dict[int, float] = {
            id(e): min(float(e["t0"]), began.get((str(e.get("task_id")), int(e["fence"])), float("inf")))
            for e in items
        }
        ended = sorted(items, key=lambda e: float(e["t1"]))
        best: Doc | None = None
        j = 0
        for b in sorted(items, key=lambda e: start_of[id(e)]):
            while j < len(ended) and float(ended[j]["t1"]) < start_of[id(b)]:
                if best is None or int(ended[j]["fence"]) > int(best["fence"]):
                    best = ended[j]
                j += 1
            if best is not None and int(best["fence"]) >= int(b["fence"]):
                found.append(
                    Violation(
                        "fence-backwards",
                        f"{key}: acquisition by {b.get('who')} (fence {b['fence']}) began after one by "
                        f"{best.get('who')} with fence {best['fence']} had ended",
                    )
                )
        if key_policy(key) == "limit":
            found += check_limit_holds(key, items, releases)
            continue
        if key_policy(key) == "mixed":
            spans = clean_spans(items, releases)
            found += [Violation(k, d) for k, d in mixed.check_mixed_holds(key, spans, LIMIT)]
            continue
        # A release that matched its owner token proves nobody else acquired in between.
        spans = sorted(
            (float(a["t1"]), float(releases[str(a["hold"])]["t"]), a)
            for a in items
            if str(a["hold"]) in releases and releases[str(a["hold"])].get("released")
        )
        for (_s1, e1, a1), (s2, _e2, a2) in itertools.pairwise(spans):
            if s2 < e1:
                found.append(
                    Violation(
                        "overlap",
                        f"{key}: {a1.get('who')} (fence {a1['fence']}) held it until {e1:.3f} and "
                        f"{a2.get('who')} (fence {a2['fence']}) from {s2:.3f}, both released cleanly",
                    )
                )

    # 4. Every submitted task ended: done (its op applied) or skipped by policy; or its message was lost
    # by the broker, proven from the histories (``Run._lost_by_broker``) and counted in the figures.
    # A copy dropped as one of a run that had finished (it released the key normally): if the task has no
    # result, that run's worker died between its release and storing its result.
    dropped_done = {
        str(ev["task_id"]) for ev in history.events if ev.get("ev") == "admit" and ev.get("outcome") == "done"
    }
    for task_id, task in sorted(history.tasks.items()):
        state, result = task.get("state"), task.get("result")
        if task.get("lost_by_broker"):
            continue
        if state != "SUCCESS" or not isinstance(result, dict):
            if task_id in dropped_done:
                # The body ran and released the key, its worker died before the result was stored, and
                # the redelivered message was dropped as a copy of a finished run (admission "done")
                # without ending the task: it must end it ("already-ran").
                found.append(
                    Violation(
                        "result-never-stored",
                        f"task {task_id} (op {task.get('op')}) ended {state}: its run released the key and "
                        "its worker died before storing the result; the redelivery was dropped as done",
                    )
                )
                continue
            found.append(
                Violation(
                    "task-unfinished", f"task {task_id} (op {task.get('op')}) ended {state}: {result!r}"
                )
            )
        elif result.get("mongolock") == "skipped" and task.get("task") not in QUEUED_TASKS:
            continue
        elif result.get("mongolock") == "already-ran" and task.get("op") in applied:
            # The body ran and released the key; its worker died before the result was stored, and the
            # redelivered copy ended the task saying so (the body never runs twice).
            continue
        elif result.get("mongolock") and task.get("task") in QUEUED_TASKS:
            continue  # skipped or superseded: judged by check_queued
        elif task.get("task") in MULTI_TASKS:
            continue  # its writes (one per key): judged by check_multi
        elif result.get("op") != task.get("op") or result.get("op") not in applied:
            found.append(
                Violation("lost-update", f"task {task_id} says op {result.get('op')} done, not applied")
            )

    # 4b. A run whose body released its key and whose worker died before the result was stored (``die``,
    # DIE_TASKS): its requeued copy ends the task already-ran, and no body of the task starts again.
    found += check_died(history)
    # 4c. No body of one attempt runs again after it finished, whichever delivery it came from.
    found += check_receipts(history)
    # 5. Queue and Replace runs.
    found += check_queued(history, applied)
    # 6. Several keys per run.
    found += check_multi(history, applied)
    # 7. Reentrant holds.
    found += check_reentrant(history)
    found += check_unique(history)
    found += check_multi_replace(history, applied=applied)
    # 7b. rate=RateLimit(n, period).
    found += check_rate(history)
    # 8. Replace(cancel_running=True): superseded holders.
    found += check_cancel(history)
    # 9. The link callbacks of Replace runs, superseded ones included (``endings``).
    found += check_links(history)
    found += check_multi_replace(history, MULTI_LIMIT_REPLACE_TASK, applied)
    return found


def check_links(history: History) -> list[Violation]:
    """The ``REPLACE_TASK`` runs sent with a ``link`` callback (``LINK_SHARE``):

    * ``link-not-called``: a run that ended ``SUCCESS`` (its body ran, or it was superseded: parked, then
      ended by a worker from its stored message) whose callback never ran;
    * ``link-wrong-result``: the callback was told the run was superseded when its result says it ran,
      or the other way round.

    A callback whose message the broker is proven to have lost (``link_lost_by_broker``: popped and never
    recorded as unacknowledged, a fault cutting the consumer off then) is counted, not judged. A callback
    called twice is a figure (``link_figures``), not a violation: a redelivered ending message
    racing its first copy may call it again (docs/reference/policies.md)."""
    found: list[Violation] = []
    calls: dict[str, list[Doc]] = defaultdict(list)
    for e in history.events:
        if e.get("ev") == "linked":
            calls[str(e.get("task_id"))].append(e)
    for tid, task in history.tasks.items():
        if not task.get("link") or task.get("state") != "SUCCESS":
            continue
        result = task.get("result")
        superseded = isinstance(result, dict) and result.get("mongolock") == "superseded"
        if not calls.get(tid) and task.get("link_lost_by_broker"):
            continue  # its callback's message lost by the broker, proven (``Run._links_lost_by_broker``)
        if not calls.get(tid):
            how = "superseded" if superseded else "ran"
            found.append(
                Violation("link-not-called", f"Replace run {tid} ({how}) ended SUCCESS; its link never ran")
            )
        elif any(bool(c.get("superseded")) != superseded for c in calls[tid]):
            found.append(
                Violation("link-wrong-result", f"Replace run {tid}: its link got another result: {result}")
            )
    return found


def link_figures(history: History) -> Doc:
    """How many linked runs ended, superseded or not, and callbacks called more than once."""
    linked = [t for t in history.tasks.values() if t.get("link") and t.get("state") == "SUCCESS"]
    calls: Counter[str] = Counter(str(e.get("task_id")) for e in history.events if e.get("ev") == "linked")
    return {
        "linked_runs": len(linked),
        "linked_superseded": sum(
            1
            for t in linked
            if isinstance(t.get("result"), dict) and t["result"].get("mongolock") == "superseded"
        ),
        "links_called_twice": sum(1 for n in calls.values() if n > 1),
        "links_lost_by_broker": sum(1 for t in linked if t.get("link_lost_by_broker")),
    }


def _unique_bodies(history: History, ids: set[str]) -> dict[str, Doc]:
    """The first acquisition (``acq``) of each task id in ``ids``: where and when its body began."""
    body: dict[str, Doc] = {}
    for e in history.events:
        if e.get("ev") == "acq" and e.get("task_id") in ids:
            first = body.get(str(e["task_id"]))
            if first is None or float(e["t1"]) < float(first["t1"]):
                body[str(e["task_id"])] = e
    return body


def check_unique(history: History) -> list[Violation]:
    """``unique_send`` (``UNIQUE_TASK``): never two bodies of one unique send in its window; no send
    answered with a run that never ran.

    - ``unique-twice``: two task ids answered equal sends (one key, one op) and both ran a body, though the
      later one's first send began after the earlier one's first send returned (its record was there) and
      returned before the delivery that ran the earlier one's body began (its ``upre``, in the process that
      took the lease: the library forgets a pending send only when its body is about to start, after
      that). The later send found the earlier run pending and still got a run of its own.
    - ``unique-unrun``: a send got a task id that ended SUCCESS without a body.

    A send refused because MongoDB did not answer (``refused``) got no run: its producer was told."""
    found: list[Violation] = []
    sends = sorted((s for s in history.sends if s.get("id")), key=lambda s: float(s["t0"]))
    ids = {str(s["id"]) for s in sends}
    body = _unique_bodies(history, ids)
    began: dict[tuple[str, str], list[float]] = defaultdict(list)
    for e in history.events:
        if e.get("ev") == "upre" and e.get("task_id") in ids:
            began[(str(e["task_id"]), str(e.get("who")))].append(float(e["t"]))
    groups: dict[tuple[str, str], dict[str, Doc]] = defaultdict(dict)
    for send in sends:
        groups[(str(send["key"]), str(send["op"]))].setdefault(str(send["id"]), send)
    for (key, op), first in sorted(groups.items()):
        started: dict[str, float] = {}
        for tid in first:
            acq = body.get(tid)
            before = [t for t in began[(tid, str((acq or {}).get("who")))] if acq and t <= float(acq["t1"])]
            if before:
                started[tid] = max(before)
        for a, start in started.items():
            for b in started:
                if b != a and first[a]["t1"] <= first[b]["t0"] and first[b]["t1"] < start:
                    found.append(
                        Violation(
                            "unique-twice",
                            f"{key} op {op}: run {b} was sent (returned at {first[b]['t1']:.3f}) while "
                            f"run {a} was pending (sent by {first[a]['t1']:.3f}, its body's delivery began "
                            f"at {start:.3f}), and both ran a body",
                        )
                    )
    for tid in sorted(ids):
        if (history.tasks.get(tid) or {}).get("state") == "SUCCESS" and tid not in body:
            found.append(
                Violation("unique-unrun", f"run {tid} answered a unique send and ended without a body")
            )
    return found


def unique_figures(history: History, faults: Sequence[Doc] = (), directed: Doc | None = None) -> Doc:
    """What the ``unique_send`` workload did: sends, refused ones, runs, sends that got a pending run,
    runs with a body; the directed burst; the faults that began while a unique run was pending."""
    got = sorted((s for s in history.sends if s.get("id")), key=lambda s: float(s["t0"]))
    seen: set[str] = set()
    answered_by_pending = 0
    for send in got:
        answered_by_pending += str(send["id"]) in seen
        seen.add(str(send["id"]))
    body = _unique_bodies(history, seen)
    directed = directed or {}
    runs = [str(t) for t in directed.get("runs") or []]
    hit = Counter(
        str(f["kind"])
        for f in faults
        if (f.get("unique") or {}).get("contended") and len(f["unique"].get("runs") or []) == 1
    )
    return {
        "sends": len(history.sends),
        "refused": sum(1 for s in history.sends if s.get("refused")),
        "runs": len(seen),
        "sends_that_got_a_pending_run": answered_by_pending,
        "runs_with_a_body": len(body),
        "done": sum(1 for t in seen if (history.tasks.get(t) or {}).get("state") == "SUCCESS"),
        "directed": {
            "sends": directed.get("sends", 0),
            "runs": len(runs),
            "contended": bool(directed.get("contended")),
            "ran_a_body": bool(runs) and all(t in body for t in runs),
        },
        "faults_with_a_pending_unique_run": dict(sorted(hit.items())),
    }


# -- rate=RateLimit(n, period) (t keys, RATE_TASK) ---------------------------------------------------------


def rate_takes(history: History) -> list[Doc]:
    """Every attempt at a start in a rate window (``rtake``: the workers' and the controller's gates')."""
    return [e for e in history.events if e.get("ev") == "rtake"]


def rate_grants(take: Doc) -> dict[str, int]:
    """Key -> when this attempt's own start was recorded there (epoch ms, the server's clock); empty when
    it was not granted (or its replies did not show it)."""
    if not take.get("started"):
        return {}
    return {
        str(w["key"]): int(t)
        for w in take.get("windows") or []
        for t, i in w.get("starts") or []
        if i == take.get("start_id")
    }


def rate_park(take: Doc) -> tuple[str, int, int] | None:
    """(key, the command's clock, when its entry goes stale) of an attempt that parked its run (its reply
    shows the run among the key's parked runs), else None."""
    if take.get("started") or take.get("error"):
        return None
    for w in take.get("windows") or []:
        if w.get("key") == take.get("on"):
            for run, _stamp, stale_at in w.get("waiters") or []:
                if run == take.get("run"):
                    return str(w["key"]), int(w["now"]), int(stale_at)
    return None


def rate_starts(takes: Iterable[Doc]) -> dict[str, set[tuple[int, str]]]:
    """Per key, every start any reply showed in its window (time on the server's clock, start id): a start
    whose own attempt left no record (its process killed right after the reply) is seen in the next."""
    starts: dict[str, set[tuple[int, str]]] = defaultdict(set)
    for take in takes:
        for w in take.get("windows") or []:
            for t, i in w.get("starts") or []:
                starts[str(w["key"])].add((int(t), str(i)))
    return starts


def most_in_a_window(times: Iterable[int], period_ms: int) -> list[int]:
    """The most starts in one half-open interval ``[a, a + period)`` (the starts themselves)."""
    ordered = sorted(times)
    best: list[int] = []
    first = 0
    for last, t in enumerate(ordered):
        while ordered[first] <= t - period_ms:
            first += 1
        if last - first + 1 > len(best):
            best = ordered[first : last + 1]
    return best


def check_rate(history: History) -> list[Violation]:
    """``rate=RateLimit(n, period)`` (``RATE_TASK`` runs on ``t`` keys, with the controller's gates), from
    the ``rtake`` records (each attempt at a start, with the windows its replies showed: starts recorded
    by the command that granted them, on the server's clock, so no slack is needed) and body receipts:

    - ``rate-exceeded``: more than n starts of one key in some ``[a, a + period)``;
    - ``rate-order``: a run took a start while runs sent before it were parked on the key (their place
      kept: docs/how-to/rate-limits.md) and the window, with its start, left no room for all of them;
    - ``rate-bypassed``: a body of the task ran with no start granted to its delivery;
    - ``rate-dropped``: a run ended skipped (the rate parks runs over it; ``Retry`` never skips).

    Lost runs and runs run twice are the plain checks' (``task-unfinished``, ``check_receipts``: a parked
    run's copies keep its attempt)."""
    takes = rate_takes(history)
    found = _rate_exceeded(takes) + _rate_order(history, takes) + _rate_bypassed(history, takes)
    for task_id, task in sorted(history.tasks.items()):
        result = task.get("result")
        if (
            task.get("task") in RATE_TASKS
            and isinstance(result, dict)
            and result.get("mongolock") == "skipped"
        ):
            found.append(
                Violation("rate-dropped", f"run {task_id} on {task.get('key')} ended skipped: {result}")
            )
    return found


def _rate_of(takes: Iterable[Doc]) -> dict[str, tuple[int, int]]:
    """Key -> (n, period ms) its takes asked for."""
    return {str(k): (int(t["n"]), int(t["p"])) for t in takes for k in t.get("keys") or []}


def _rate_exceeded(takes: list[Doc]) -> list[Violation]:
    found: list[Violation] = []
    rates = _rate_of(takes)
    for key, starts in sorted(rate_starts(takes).items()):
        n, period = rates[key]
        most = most_in_a_window((t for t, _ in starts), period)
        if len(most) > n:
            found.append(
                Violation(
                    "rate-exceeded",
                    f"{key}: {len(most)} starts within {period} ms on the server's clock (at most {n}): "
                    f"at +{[t - most[0] for t in most]} ms from {most[0]}",
                )
            )
    return found


def _rate_ambiguous(history: History, takes: list[Doc]) -> set[str]:
    """Runs whose place is not known from their records: an attempt without an answer (its command may
    have been applied), or a delivery cut short (a broker's redelivery: its attempt may have been granted
    a start, and its entry left the parked runs, with no record)."""
    out = {str(t.get("run")) for t in takes if t.get("error")}
    cut = {str(e["task_id"]) for e in history.events if e.get("ev") == "recv" and e.get("redelivered")}
    return out | {str(t.get("run")) for t in takes if str(t.get("task_id")) in cut}


def _rate_timelines(
    takes: list[Doc], leaves: Iterable[Doc] = ()
) -> dict[str, dict[str, list[tuple[int, int | None]]]]:
    """Key -> run -> its grants and leaves (time, None) and parks (the command's clock, stale at), in time
    order (at one time, a park first)."""
    lines: dict[str, dict[str, list[tuple[int, int | None]]]] = defaultdict(lambda: defaultdict(list))
    for take in takes:
        for key, at in rate_grants(take).items():
            lines[key][str(take["run"])].append((at, None))
        park = rate_park(take)
        if park is not None:
            lines[park[0]][str(take["run"])].append((park[1], park[2]))
    for leave in leaves:  # a gate's place taken out (``RateGate.stop``), no later than ``at``
        lines[str(leave["key"])][str(leave["run"])].append((int(leave["at"]), None))
    for runs in lines.values():
        for events in runs.values():
            events.sort(key=lambda e: (e[0], e[1] is None))
    return lines


def _waiting_at(events: list[tuple[int, int | None]], at: int) -> bool:
    """Whether a run was parked at ``at`` (server ms): its last record before it is a park not yet stale."""
    before = [e for e in events if e[0] < at]
    return bool(before) and before[-1][1] is not None and int(before[-1][1]) > at


def _rate_order(history: History, takes: list[Doc]) -> list[Violation]:
    found: list[Violation] = []
    leaves = [e for e in history.events if e.get("ev") == "rleave"]
    rates, starts, lines = _rate_of(takes), rate_starts(takes), _rate_timelines(takes, leaves)
    ambiguous = _rate_ambiguous(history, takes)
    known = {str(t.get("start_id")) for t in takes if t.get("started")}
    # (The window serves its runs in the key's order: priority, then send; ``rank`` as the take recorded it.)
    stamps = {
        str(t["run"]): (int(t.get("rank") or 0), int(t.get("stamp") or 0), str(t["run"]))
        for t in takes
        if t.get("run")
    }
    for take in takes:
        for key, at in rate_grants(take).items():
            n, period = rates[key]
            me = stamps[str(take["run"])]
            waiting = sorted(
                run
                for run, events in lines[key].items()
                if stamps.get(run, me) < me and run not in ambiguous and _waiting_at(events, at)
            )
            inside = [(t, i) for t, i in starts[key] if at - period < t < at]
            # A start no record names may be a waiting run's own (its process killed after the reply).
            unnamed = sum(1 for _t, i in inside if i not in known)
            # (More starts than n without them is ``rate-exceeded``, judged on its own.)
            if len(inside) + 1 <= n < len(inside) + 1 + len(waiting) - min(unnamed, len(waiting)):
                found.append(
                    Violation(
                        "rate-order",
                        f"{key}: run {take['run']} took a start at {at} with {len(inside)} other start(s) in "
                        f"the window and {len(waiting)} run(s) sent before it parked there, at most {n} in "
                        f"all: {waiting}",
                    )
                )
    return found


def _rate_bypassed(history: History, takes: list[Doc]) -> list[Violation]:
    """Each body of ``RATE_TASK`` follows a start granted to its delivery (same task, same process, since
    that process's previous body of the task)."""
    rated = {tid for tid, t in history.tasks.items() if t.get("task") in RATE_TASKS}
    steps: dict[tuple[str, str], list[tuple[float, str]]] = defaultdict(list)
    for take in takes:
        if take.get("started") and str(take.get("task_id")) in rated:
            steps[(str(take["task_id"]), str(take.get("who")))].append((float(take["t"]), "grant"))
    for e in history.events:
        if e.get("ev") == "body" and str(e.get("task_id")) in rated:
            steps[(str(e["task_id"]), str(e.get("who")))].append((float(e["t"]), "body"))
    found: list[Violation] = []
    for (task_id, who), seen in sorted(steps.items()):
        granted = False
        for t, what in sorted(seen):
            if what == "grant":
                granted = True
            elif granted:
                granted = False
            else:
                found.append(
                    Violation(
                        "rate-bypassed", f"run {task_id}: a body began at {t:.3f} in {who} with no start"
                    )
                )
    return found


def rate_figures(history: History, faults: Sequence[Doc] = (), directed: Doc | None = None) -> Doc:
    """What the rate workload did: its runs (done, parked by the rate, parked and later done), the
    attempts at a start (granted, parked, unanswered), the starts recorded and the most in one window, the
    controller's gates' starts, the directed burst, and the faults that began with gated runs parked."""
    tasks = {tid: t for tid, t in history.tasks.items() if t.get("task") in RATE_TASKS}
    takes = rate_takes(history)
    parked = {str(t["task_id"]) for t in takes if rate_park(t) is not None and t.get("task_id") in tasks}
    done = {
        tid
        for tid, t in tasks.items()
        if t.get("state") == "SUCCESS"
        and isinstance(t.get("result"), dict)
        and t["result"].get("op") == t["op"]
    }
    rates = _rate_of(takes)
    most = {
        key: len(most_in_a_window((t for t, _ in s), rates[key][1])) for key, s in rate_starts(takes).items()
    }
    gated = [str(tid) for f in faults for tid in (f.get("rate") or {}).get("runs") or []]
    directed = directed or {}
    runs = [str(t) for t in directed.get("runs") or []]
    queued = {tid for tid, t in tasks.items() if t.get("task") == RATE_QUEUE_TASK}
    on_key = {
        str(e["task_id"])
        for e in history.events
        if e.get("ev") == "admit" and e.get("outcome") == "parked" and e.get("task_id") in queued
    }
    return {
        "submitted": len(tasks),
        "done": len(done),
        "parked": len(parked),
        "parked_then_done": len(parked & done),
        # Queue() with the rate: runs parked on the key first, and of those, parked by the rate after
        "queue_submitted": len(queued),
        "queue_done": len(queued & done),
        "queue_parked_on_the_key": len(on_key),
        "queue_parked_on_the_key_then_by_the_rate": len(on_key & parked),
        "grants": sum(1 for t in takes if t.get("started") and t.get("task_id") in tasks),
        "parks": sum(1 for t in takes if rate_park(t) is not None and t.get("task_id") in tasks),
        "unanswered": sum(1 for t in takes if t.get("error")),
        "bodies": sum(1 for e in history.events if e.get("ev") == "body" and e.get("task_id") in tasks),
        "starts": sum(len(s) for s in rate_starts(takes).values()),
        "most_starts_in_a_window": max(most.values(), default=0),
        "gate_places_kept": sum(1 for t in takes if t.get("hold") and rate_park(t) is not None),
        "directed": {
            "sends": len(runs),
            "parked_before_the_gate_let_go": bool(directed.get("parked")),
            "parked_then_done": len(set(runs) & parked & done),
        },
        "gated": len(gated),
        "gated_parked_then_done": len(set(gated) & parked & done),
        "gated_lost_by_broker": sum(1 for t in gated if (tasks.get(t) or {}).get("lost_by_broker")),
        "faults_with_a_rate_parked_run": dict(
            sorted(Counter(str(f["kind"]) for f in faults if (f.get("rate") or {}).get("parked")).items())
        ),
    }


def check_reentrant(history: History) -> list[Violation]:
    """The reentrant runs' asks (``reenter`` events of ``REENTRANT_TASK`` bodies).

    * ``reentrant-not-the-outer-lease``: a reentrant hold whose hold token or fence is not the one the
      run's body holds the key with (``mbody`` of the same task with that hold token), or a reentrant hold
      of a key the body does not hold.
    * ``reentrant-second-slot``: while a reentrant hold of a slot was held, the lease document showed
      another live slot of the same run with a larger fence than the run's own (a slot taken twice; a
      slot of an earlier attempt of the run, left to expire, has a smaller fence).
    """
    found: list[Violation] = []
    bodies: dict[tuple[str, str, str], Doc] = {}  # (task id, key, hold) -> body
    for started in history.events:
        if started.get("ev") == "mbody":
            for k, h in (started.get("holds") or {}).items():
                bodies[str(started.get("task_id")), str(k), str(h)] = started
    for ev in history.events:
        if ev.get("ev") != "reenter" or not ev.get("reentered"):
            continue
        tid, key, hold = str(ev.get("task_id")), str(ev.get("key")), str(ev.get("hold"))
        body = bodies.get((tid, key, hold))
        if body is None or int((body.get("fences") or {}).get(key, -1)) != int(ev["fence"]):
            found.append(
                Violation(
                    "reentrant-not-the-outer-lease",
                    f"task {tid}: a reentrant hold of {key} ({ev.get('via')}) has hold {hold} fence "
                    f"{ev['fence']}; its body holds it with "
                    + (f"fence {(body.get('fences') or {}).get(key)}" if body else "no such hold"),
                )
            )
        newer = [s for s in ev.get("other_slots") or [] if int(s.get("fence") or 0) > int(ev["fence"])]
        if newer:
            found.append(
                Violation(
                    "reentrant-second-slot",
                    f"task {tid}: while its reentrant hold of {key} (slot {ev.get('slot')}, fence "
                    f"{ev['fence']}) was held, the run held slots {newer} too",
                )
            )
    return found


def reentrant_figures(history: History, faults: Sequence[Doc] = ()) -> Doc:
    """What the reentrant runs (``REENTRANT_TASK``) did (figures, not verdicts)."""
    ev = history.events
    tids = {tid for tid, t in history.tasks.items() if t.get("task") == REENTRANT_TASK}
    asks = [e for e in ev if e.get("ev") == "reenter" and e.get("task_id") in tids]
    reentered: dict[str, set[str]] = defaultdict(set)  # task id -> the ways it reentered
    for e in asks:
        if e.get("reentered"):
            reentered[str(e["task_id"])].add(str(e.get("via")))
    done = {
        tid
        for tid in tids
        if history.tasks[tid].get("state") == "SUCCESS"
        and isinstance(history.tasks[tid].get("result"), dict)
        and not history.tasks[tid]["result"].get("mongolock")
    }
    bodies = [e for e in ev if e.get("ev") == "mbody" and e.get("task_id") in tids]
    holds = {str(h) for b in bodies for h in (b.get("holds") or {}).values()}
    return {
        "submitted": len(tids),
        "done": len(done),
        "bodies": len(bodies),
        "reentered": dict(sorted(Counter(str(e.get("via")) for e in asks if e.get("reentered")).items())),
        "reentered_slots": sum(1 for e in asks if e.get("reentered") and e.get("slot") is not None),
        "not_reentered": sum(1 for e in asks if not e.get("reentered")),
        "done_runs_that_reentered_both_ways": sum(1 for t in done if reentered[t] >= {"call", "hold"}),
        "faults_hitting_bodies": dict(
            sorted(Counter(str(f["kind"]) for f in faults if set(f.get("holds") or []) & holds).items())
        ),
    }


def handed_grant_starts(events: Iterable[Doc], key: str) -> dict[tuple[str, int], float]:
    """For each claim of a handoff on ``key`` (an admission with outcome ``claimed``: task id and fence),
    the earliest time its grant can have been made: the send time of the run's first admission on the
    key (a run is handed a slot only after its admission parked it)."""
    events = [e for e in events if str(e.get("key")) == key]
    admits = [e for e in events if e.get("ev") == "admit"]
    first: dict[str, float] = {}
    for e in admits:
        if e.get("t0") is not None:
            tid = str(e.get("task_id"))
            first[tid] = min(first.get(tid, float(e["t0"])), float(e["t0"]))
    # The command that handed the slot was answered before its ``handoff`` record (or a ``handed-seen``
    # of another process's reply): the grant was made no later. (ci of stop 65: the run's parking admit
    # was never recorded, its claim's own admit stood in, and a client's later acquisition with a
    # larger fence looked older.)
    handed: dict[tuple[str, int], float] = {}
    for e in events:
        seen = [(e.get("task_id"), e.get("fence"))] if e.get("ev") == "handoff" else []
        if e.get("ev") == "handed-seen":
            seen = [(h[0], h[1]) for h in e.get("handed_slots") or [] if len(h) >= 2]
        for run, fence in seen:
            if fence is not None and e.get("t") is not None:
                grant = (str(run), int(fence))
                handed[grant] = min(handed.get(grant, float(e["t"])), float(e["t"]))
    out: dict[tuple[str, int], float] = {}
    for e in admits:
        if e.get("outcome") == "claimed" and e.get("fence") is not None:
            grant = (str(e.get("task_id")), int(e["fence"]))
            out[grant] = min(first.get(grant[0], float("-inf")), handed.get(grant, float("inf")))
    return out


def admitted_grant_starts(events: Iterable[Doc]) -> dict[str, dict[tuple[str, int], float]]:
    """Per key, for each acquisition made by a Celery run's admit (outcome ``acquired`` or ``due``: task id
    and fence), when that admit was sent: the command that gave the fence."""
    found: dict[str, dict[tuple[str, int], float]] = defaultdict(dict)
    for e in events:
        if (
            e.get("ev") == "admit"
            and e.get("outcome") in ("acquired", "due")
            and e.get("fence") is not None
            and e.get("t0") is not None
        ):
            found[str(e.get("key"))][(str(e.get("task_id")), int(e["fence"]))] = float(e["t0"])
    return found


def check_slot_log(key: str, doc: Doc, applied: dict[str, list[tuple[str, str]]]) -> list[Violation]:
    """The protected document of a ``limit=N`` key (``run_slot_hold``): each slot's entries are a
    single-holder history (fences non-decreasing, holds not interleaved, one fence and one slot per hold,
    the i-th write of the slot read ``p == i``); a fence belongs to one hold; ``counter`` and each
    ``sc.<slot>`` count the applied writes. Applied ops go into ``applied``."""
    found: list[Violation] = []
    log = doc.get("log") or []
    fence_of: dict[int, str] = {}
    slot_of: dict[str, int] = {}
    per_slot: dict[int, Doc] = defaultdict(
        lambda: {"writes": 0, "fence": None, "hold": None, "closed": set()}
    )
    total = 0
    for i, entry in enumerate(log):
        fence, h, slot = int(entry["f"]), str(entry["h"]), int(entry.get("s", -1))
        where = f"{key} log[{i}] slot {slot}"
        other = fence_of.setdefault(fence, h)
        if other != h:
            found.append(
                Violation("fence-reused", f"{where}: holds {other[:8]} and {h[:8]} share fence {fence}")
            )
        if slot_of.setdefault(h, slot) != slot:
            found.append(
                Violation("slot-changed", f"{where}: hold {h[:8]} wrote in slots {slot_of[h]} and {slot}")
            )
        st = per_slot[slot]
        if st["fence"] is not None and fence < st["fence"]:
            found.append(Violation("fence-backwards", f"{where}: fence {fence} after fence {st['fence']}"))
        if h != st["hold"]:
            if h in st["closed"]:
                found.append(
                    Violation("overlap", f"{where}: hold {h[:8]} writes again after hold {st['hold']}")
                )
            if st["hold"] is not None:
                st["closed"].add(st["hold"])
            st["hold"] = h
        elif fence != st["fence"]:
            found.append(Violation("fence-changed", f"{where}: hold {h[:8]} wrote with two fences"))
        st["fence"] = fence
        if entry.get("k") == "w":
            op = str(entry["o"])
            applied[op].append((key, h))
            if int(entry["p"]) != st["writes"]:
                found.append(
                    Violation(
                        "lost-update",
                        f"{where}: op {op} (hold {h[:8]}, fence {fence}) read the slot's counter "
                        f"{entry['p']} but {st['writes']} writes of the slot were applied before it "
                        "(two holders of one slot)",
                    )
                )
            st["writes"] += 1
            total += 1
    if int(doc.get("counter", 0)) != total:
        found.append(
            Violation("lost-update", f"{key}: counter is {doc.get('counter')} after {total} applied writes")
        )
    for slot, st in sorted(per_slot.items()):
        have = int((doc.get("sc") or {}).get(str(slot), 0))
        if have != st["writes"]:
            found.append(
                Violation(
                    "lost-update", f"{key}: slot {slot} counter is {have} after {st['writes']} applied writes"
                )
            )
    return found


def clean_spans(items: Iterable[Doc], releases: dict[str, Doc]) -> list[tuple[float, float, Doc]]:
    """The holds among acquisitions ``items`` whose release matched their owner token, as (reply seen,
    release sent, acquisition): inside the hold's real interval on CLOCK_MONOTONIC (system-wide)."""
    return sorted(
        (float(a["t1"]), float(releases[str(a["hold"])]["t"]), a)
        for a in items
        if str(a["hold"]) in releases and releases[str(a["hold"])].get("released")
    )


def max_overlap(spans: Sequence[tuple[float, float, Doc]]) -> tuple[int, list[Doc]]:
    """The most spans that overlap at one instant, and those spans (the first time it is reached)."""
    best: tuple[int, list[Doc]] = (0, [])
    points = sorted(
        [(s, 1, i) for i, (s, _e, _a) in enumerate(spans)]
        + [(e, 0, i) for i, (_s, e, _a) in enumerate(spans)]
    )
    live: set[int] = set()
    for _t, starts, i in points:  # at equal times, ends (0) before starts (1): touching is not overlapping
        if starts:
            live.add(i)
            if len(live) > best[0]:
                best = (len(live), [spans[j][2] for j in sorted(live)])
        else:
            live.discard(i)
    return best


def check_limit_holds(
    key: str, items: list[Doc], releases: dict[str, Doc], limit: int = LIMIT
) -> list[Violation]:
    """A ``limit=N`` key: at no instant more than N clean holds (release matched the owner token), and
    two clean holds of one slot never overlap (a slot is one hold at a time)."""
    found: list[Violation] = []
    spans = clean_spans(items, releases)
    most, which = max_overlap(spans)
    if most > limit:
        found.append(
            Violation(
                "over-limit",
                f"{key} (limit {limit}): {most} clean holds at once: "
                + ", ".join(f"{a.get('who')} slot {a.get('slot')} fence {a['fence']}" for a in which),
            )
        )
    by_slot: dict[Any, list[tuple[float, float, Doc]]] = defaultdict(list)
    for span in spans:
        by_slot[span[2].get("slot")].append(span)
    for slot, slot_spans in sorted(by_slot.items(), key=lambda kv: str(kv[0])):
        for (_s1, e1, a1), (s2, _e2, a2) in itertools.pairwise(slot_spans):
            if s2 < e1:
                found.append(
                    Violation(
                        "slot-overlap",
                        f"{key} slot {slot}: {a1.get('who')} (fence {a1['fence']}) held it until {e1:.3f} "
                        f"and {a2.get('who')} (fence {a2['fence']}) from {s2:.3f}, both released cleanly",
                    )
                )
    return found + check_min_holds(key, items, releases)


def min_hold_pairs(items: list[Doc], releases: dict[str, Doc]) -> list[tuple[Doc, Doc]]:
    """On one ``limit=N`` key: each hold taken with a minimum hold (``mh``) and released cleanly by its run,
    with the next acquisition of its slot (the smallest larger fence there), if any."""
    by_slot: dict[Any, list[Doc]] = defaultdict(list)
    for a in items:
        by_slot[a.get("slot")].append(a)
    pairs = []
    for slot_items in by_slot.values():
        ordered = sorted(slot_items, key=lambda a: int(a["fence"]))
        for a, b in itertools.pairwise(ordered):
            rel = releases.get(str(a["hold"]))
            if a.get("mh") and rel is not None and rel.get("released"):
                pairs.append((a, b))
    return pairs


def check_min_holds(key: str, items: list[Doc], releases: dict[str, Doc]) -> list[Violation]:
    """``min_hold_seconds`` on a ``limit=N`` key: a slot whose run released it cleanly is taken again no
    sooner than its minimum hold after that run's acquire was sent (``t0``; the server set the hold's end
    at or after it), whoever takes it next. A slot freed otherwise (its holder died, or its hold expired)
    is not bound by the hold, as for a single lease."""
    found = []
    for a, b in min_hold_pairs(items, releases):
        earliest = float(a["t0"]) + float(a["mh"])
        if float(b["t1"]) < earliest - 0.005:
            found.append(
                Violation(
                    "min-hold-cut",
                    f"{key} slot {a.get('slot')}: {a.get('who')} (fence {a['fence']}) took it with a minimum "
                    f"hold of {a['mh']} s from {float(a['t0']):.3f} and released it cleanly, but "
                    f"{b.get('who')} (fence {b['fence']}) had it by {float(b['t1']):.3f}",
                )
            )
    return found


def check_multi(history: History, applied: dict[str, list[tuple[str, str]]]) -> list[Violation]:
    """The several-keys runs (submitted tasks named in ``MULTI_TASKS``, each with its ``keys``).

    Evidence: each body start (``mbody``: the keys of its ``LeaseSet``, the hold token and fence of each),
    an ``acq`` and a ``rel`` per key (so the plain checks above judge each key's holds together with the
    single-key runs and bare clients on the same key), and each key's protected-document log.

    * ``multi-missing-key``: a body started without a lease on every key of its task (or with one more).
    * ``multi-not-all-held``: the body's holds whose releases matched their tokens did not all overlap in
      time (it did not hold them all at once).
    * ``multi-wrong-fence``: a write of the body to key k's document does not carry the body's hold and
      fence for k (e.g. another key's fence).
    * ``multi-partial``: a task that ended done (not skipped) has a key whose op is not applied, or
      applied by no body of that task (every key written, or the run was retried until it was).
    * ``multi-started-without-all``: the run's set of leases was complete (the last key's acquire
      answered, ``acquired_mono``) only after a key taken earlier, live when its own reply came, had
      passed its deadline (``deadline`` as the body saw it, after any renewal): the run held that key
      while it waited for the others
      longer than the lease, by the library's own rule must assume it gone (the server may have given
      it to someone else meanwhile), yet its body started. Both times are the worker's own
      CLOCK_MONOTONIC readings kept by the library's ``Lease``, nothing the checker measures around
      them. Found in the soak (server paused between a run's two acquires): a library bug, reported.
    """
    found: list[Violation] = []
    tasks = {tid: t for tid, t in history.tasks.items() if t.get("task") in MULTI_TASKS}
    bodies = [ev for ev in history.events if ev.get("ev") == "mbody"]
    releases = {(str(ev["key"]), str(ev["hold"])): ev for ev in history.events if ev.get("ev") == "rel"}
    acqs = {(str(ev["key"]), str(ev["hold"])): ev for ev in history.events if ev.get("ev") == "acq"}
    holds_of: dict[str, set[tuple[str, str]]] = defaultdict(set)  # task id -> {(key, hold)}
    body_of: dict[tuple[str, str], Doc] = {}  # (key, hold) -> body
    body_holds: dict[str, str] = {}  # hold -> the key it is a body's hold of
    for body in bodies:
        tid = str(body.get("task_id"))
        want = tasks.get(tid, {}).get("keys")
        holds, fences = body.get("holds") or {}, body.get("fences") or {}
        keys = list(body.get("keys") or [])
        missing = [k for k in (want or keys) if not holds.get(k) or fences.get(k) is None]
        if (want is not None and sorted(set(want)) != sorted(keys)) or missing:
            found.append(
                Violation(
                    "multi-missing-key",
                    f"task {tid}: body started holding {keys} (fences {fences}), its keys are {want}",
                )
            )
        acquired, deadlines = body.get("acquired") or {}, body.get("deadlines") or {}
        if acquired and deadlines:
            complete = max(float(v) for v in acquired.values())
            # Keys whose lease was live when taken and lapsed while the run went on taking the others.
            # (A key whose own acquire was answered after its deadline is the single-lease case, counted
            # in the figures, not here: the server may have run that acquire late, after a pause, so its
            # lease there can be younger than the worker assumes.)
            gone = {
                k: float(d)
                for k, d in deadlines.items()
                if float(acquired.get(k, complete)) < float(d) < complete
            }
            if gone:
                found.append(
                    Violation(
                        "multi-started-without-all",
                        f"task {tid}: its last key was taken at {complete:.3f} but the lease on "
                        + ", ".join(
                            f"{k} (taken at {float(acquired[k]):.3f}, fence {fences.get(k)}) had passed its "
                            f"deadline at {d:.3f}"
                            for k, d in sorted(gone.items())
                        )
                        + f"; the body started at {float(body['t']):.3f} (lost: {body.get('lost') or {}})",
                    )
                )
        for k, h in holds.items():
            holds_of[tid].add((k, str(h)))
            body_of[k, str(h)] = body
            body_holds[str(h)] = k
        clean = [
            (float(acqs[k, str(h)]["t1"]), float(releases[k, str(h)]["t"]), k)
            for k, h in holds.items()
            if (k, str(h)) in acqs and releases.get((k, str(h)), {}).get("released")
        ]
        if len(clean) > 1 and max(s for s, _e, _k in clean) >= min(e for _s, e, _k in clean):
            found.append(
                Violation(
                    "multi-not-all-held",
                    f"task {tid}: its clean holds did not overlap: "
                    + ", ".join(f"{k} {s:.3f}..{e:.3f}" for s, e, k in sorted(clean)),
                )
            )
    for key, doc in sorted(history.docs.items()):
        for i, entry in enumerate(doc.get("log") or []):
            h = str(entry.get("h"))
            k = body_holds.get(h)
            if k is None:
                continue
            body = body_of[k, h]
            if k != key or int(entry["f"]) != int(body["fences"][k]):
                found.append(
                    Violation(
                        "multi-wrong-fence",
                        f"{key} log[{i}]: task {body.get('task_id')}'s hold for {k} (fence "
                        f"{body['fences'][k]}) wrote here with fence {entry['f']}",
                    )
                )
    # A body run twice for one task (two lines of contention retries of one attempt; Queue runs are
    # judged in check_queued).
    found += multi_run_twice(history, {tid for tid, t in tasks.items() if t.get("task") not in QUEUED_TASKS})
    for tid, task in sorted(tasks.items()):
        result = task.get("result")
        if task.get("state") != "SUCCESS" or not isinstance(result, dict):
            continue  # unfinished (task-unfinished above)
        if result.get("mongolock") and result.get("mongolock") != "already-ran":
            continue  # skipped by policy (nothing written); already-ran: its body wrote every key
        for k in task.get("keys") or []:
            op = multi_op(str(task["op"]), k)
            where = applied.get(op, [])
            if not where:
                found.append(
                    Violation("multi-partial", f"task {tid} ended done but its op on {k} is not applied")
                )
            elif any((wk, h) not in holds_of[tid] for wk, h in where):
                found.append(
                    Violation(
                        "multi-partial",
                        f"task {tid}: its op on {k} was applied by {where}, not by its own body",
                    )
                )
    return found


def _set_of(task: Doc) -> tuple[str, ...]:
    """The set of keys a several-keys task names (sorted, without repeats)."""
    return tuple(sorted({str(k) for k in task.get("keys") or []}))


def _family(task_name: str) -> tuple[str, ...]:
    """The tasks judged together with ``task_name``'s runs: the several-keys ``Replace`` tasks on ``m``
    keys, or those with limits (``MULTI_LIMIT_REPLACE_TASKS``)."""
    if task_name == MULTI_REPLACE_TASK:
        return MULTI_REPLACE_TASKS
    return MULTI_LIMIT_REPLACE_TASKS if task_name == MULTI_LIMIT_REPLACE_TASK else (task_name,)


def check_multi_replace(
    history: History,
    task_name: str = MULTI_REPLACE_TASK,
    applied: Mapping[str, list[tuple[str, str]]] | None = None,
) -> list[Violation]:
    """The several-keys ``Replace`` runs (``MULTI_REPLACE_TASK``, on ``m`` keys; or ``task_name``:
    ``MULTI_LIMIT_REPLACE_TASK``, a slot of an ``l`` key and a ``k`` key), judged per set of keys.

    * ``superseded-ran``: a run that ended superseded has a body start (``mbody``) at or after the first
      record of its supersession (``superseded``; with none, any body start): a superseded run never
      starts. (A body of an earlier attempt that then retried itself, its lease lost mid-body, may have
      run before: the retry is admitted again, and a newer send of its set supersedes it.)
    * ``superseded-by-older``: a superseded run does not name a newer send (larger stamp) of the same set
      of keys.
    * ``newest-not-run``: the newest send of a set ended SUCCESS without a body start (the newest send of
      a set runs; one that ended superseded is ``superseded-by-older``).
    * ``replace-order``: on one of its keys, a run got the key (a grant: acquired, handed, reserved,
      claimed) after a newer send of its set had got it.
    * ``queued-run-skipped``: it ended with another word of ours (skipped, timed out), or ``already-ran``
      with an op of its own not applied (``applied``: its body wrote every key and released them, and its
      worker died before the result was stored: the redelivered copy says so, as ``check_queued`` allows).

    No two holders of a key: its holds go through the plain per-key checks with every other hold of the
    key (the bare clients take ``m`` keys too)."""
    found: list[Violation] = []
    names = _family(task_name)
    tasks = {tid: t for tid, t in history.tasks.items() if t.get("task") in names}
    if not tasks:
        return found
    started = {str(e.get("task_id")) for e in history.events if e.get("ev") == "mbody"}
    body_starts: dict[str, list[float]] = defaultdict(list)
    # Each body start's keys already past their deadline or lost (a run stalled between the renewal that
    # confirmed its leases and its body: a copy may be told superseded meanwhile), for the report.
    body_expired: dict[tuple[str, float], list[str]] = {}
    for e in history.events:
        if e.get("ev") == "mbody":
            body_starts[str(e.get("task_id"))].append(float(e.get("t") or 0.0))
            body_expired[(str(e.get("task_id")), float(e.get("t") or 0.0))] = list(e.get("expired") or [])
    # When each run was first told (or recorded as) superseded: a body of an earlier attempt (which then
    # retried itself: its lease lost mid-body) may have started before; none may start after.
    superseded_at: dict[str, float] = {}
    for e in history.events:
        if e.get("ev") == "superseded" and e.get("task_id"):
            tid, t = str(e["task_id"]), float(e.get("t") or 0.0)
            superseded_at[tid] = min(superseded_at.get(tid, t), t)
    sets: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for tid, task in sorted(tasks.items()):
        sets[_set_of(task)].append(tid)
        result = task.get("result")
        if task.get("state") != "SUCCESS" or not isinstance(result, dict):
            continue  # task-unfinished (or lost by the broker), above
        word = result.get("mongolock")
        if word == "superseded":
            since = superseded_at.get(tid, float("-inf"))
            late = [t for t in body_starts.get(tid, []) if t >= since]
            if late:
                found.append(
                    Violation(
                        "superseded-ran",
                        f"{tid} on {_set_of(task)} ended {result}; a body started at {late[0]:.2f}, after it "
                        f"was superseded ({since:.2f}), its leases past their deadline or lost at its start: "
                        f"{body_expired.get((tid, late[0])) or 'none'}",
                    )
                )
            by = tasks.get(str(result.get("by")))
            if by is None or _set_of(by) != _set_of(task) or int(by["stamp"]) <= int(task["stamp"]):
                found.append(
                    Violation(
                        "superseded-by-older",
                        f"several-keys Replace run {tid} (stamp {task.get('stamp')}) on {_set_of(task)} "
                        f"superseded by {result.get('by')} "
                        + (f"(stamp {by.get('stamp')}, keys {_set_of(by)})" if by else "(no send of ours)"),
                    )
                )
        elif word == "already-ran" and applied is not None and all(op in applied for op in task_ops(task)):
            continue  # its body wrote every key; its worker died before the result was stored
        elif word:
            found.append(Violation("queued-run-skipped", f"several-keys Replace run {tid} ended {result}"))
    for keys, ids in sorted(sets.items()):
        newest = max(ids, key=lambda x: (int(tasks[x]["stamp"]), x))
        task = tasks[newest]
        result = task.get("result")
        ran = task.get("state") == "SUCCESS" and isinstance(result, dict) and not result.get("mongolock")
        if ran and newest not in started:
            found.append(
                Violation("newest-not-run", f"{newest}, the newest send of {keys}, ended with no body")
            )
    by_key = grants(history.events)
    for key, items in sorted(by_key.items()):
        if task_name == MULTI_REPLACE_TASK and key_policy(key) != "multi_replace":
            continue
        first: dict[str, int] = {}
        for g in items:
            if g.task_id in tasks:
                first[str(g.task_id)] = min(first.get(str(g.task_id), g.fence), g.fence)
        for keys, ids in sets.items():
            if key not in keys:
                continue
            newer_first: int | None = None  # the smallest first grant among the set's runs sent later
            for tid in sorted(ids, key=lambda x: (int(tasks[x]["stamp"]), x), reverse=True):
                late = [
                    g.fence
                    for g in items
                    if g.task_id == tid and newer_first is not None and g.fence > newer_first
                ]
                if late:
                    found.append(
                        Violation(
                            "replace-order",
                            f"{key}: {tid} (stamp {tasks[tid]['stamp']}, keys {keys}) got the key (fence "
                            f"{late[0]}) after a newer send of its set had (fence {newer_first})",
                        )
                    )
                if tid in first:
                    newer_first = min(first[tid], newer_first if newer_first is not None else first[tid])
    return found


def multi_replace_figures(
    history: History,
    faults: Sequence[Doc] = (),
    task_name: str = MULTI_REPLACE_TASK,
    directed_op: str = "directed-multi-replace-",
) -> Doc:
    """What the several-keys ``Replace`` runs (of ``task_name``) did (figures, not verdicts): sets of
    keys, runs done and superseded, the newest send of each set done, runs of a set that shares a key
    with another set (overlapping) done, the directed burst's (ops starting with ``directed_op``), and
    the faults that hit or began during their bodies."""
    ev = history.events
    names = _family(task_name)
    tasks = {tid: t for tid, t in history.tasks.items() if t.get("task") in names}
    bodies = [e for e in ev if e.get("ev") == "mbody" and e.get("task_id") in tasks]
    ran = {str(b["task_id"]) for b in bodies}

    def word(t: Doc) -> Any:
        result = t.get("result")
        return result.get("mongolock") if isinstance(result, dict) else "unfinished"

    superseded = {tid for tid, t in tasks.items() if t.get("state") == "SUCCESS" and word(t) == "superseded"}
    done = {tid for tid, t in tasks.items() if t.get("state") == "SUCCESS" and not word(t)}
    sets: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for tid, t in tasks.items():
        sets[_set_of(t)].append(tid)
    newest = {max(ids, key=lambda x: (int(tasks[x]["stamp"]), x)) for ids in sets.values()}
    sets_of_key: dict[str, set[tuple[str, ...]]] = defaultdict(set)
    for keys in sets:
        for k in keys:
            sets_of_key[k].add(keys)
    overlapping = {
        tid for keys, ids in sets.items() if any(len(sets_of_key[k]) > 1 for k in keys) for tid in ids
    }

    def with_op(prefix: str) -> set[str]:
        return {tid for tid, t in tasks.items() if str(t.get("op", "")).startswith(prefix)}

    directed = with_op(directed_op)
    window = _last_attempt(tasks, "directed-window-")
    debounced_directed = with_op("directed-debounced-")
    debounced = {
        tid
        for tid, t in tasks.items()
        if t.get("task") in (MULTI_REPLACE_DEBOUNCED_TASK, MULTI_LIMITS_DEBOUNCED_TASK)
    }
    capped = {
        tid
        for tid, t in tasks.items()
        if t.get("task") in (MULTI_REPLACE_CAPPED_TASK, MULTI_LIMITS_CAPPED_TASK)
    }
    ends = hold_ends(ev)
    body_spans = [
        (float(b["t"]), max(ends.get(str(h), float(b["t"]) + 5.0) for h in (b.get("holds") or {}).values()))
        for b in bodies
        if b.get("holds")
    ]
    holds = {str(h) for b in bodies for h in (b.get("holds") or {}).values()}
    return {
        "submitted": len(tasks),
        "sets": len(sets),
        "sets_with_a_superseded_run": sum(1 for ids in sets.values() if set(ids) & superseded),
        "done": len(done),
        "superseded": len(superseded),
        "bodies": len(bodies),
        "newest_of_a_set_done_with_a_body": len(newest & done & ran),
        "overlapping_runs": len(overlapping),
        "overlapping_runs_done": len(overlapping & done),
        "directed_superseded": len(directed & superseded),
        "directed_done_with_a_body": len(directed & done & ran),
        "debounced_submitted": len(debounced),
        "debounced_superseded": len(debounced & superseded),
        "debounced_done_with_a_body": len(debounced & done & ran),
        "capped_submitted": len(capped),
        "capped_superseded": len(capped & superseded),
        "capped_done_with_a_body": len(capped & done & ran),
        "window_paused_until_the_newer_send_parked": sum(
            1 for e in ev if e.get("ev") == "window" and e.get("seen") and e.get("task_id") in window
        ),
        "window_superseded": len(window & superseded),
        "window_done_with_a_body": len(window & done & ran),
        "debounced_directed_superseded": len(debounced_directed & superseded),
        "debounced_directed_done_with_a_body": len(debounced_directed & done & ran),
        "faults_during_bodies": faults_during(faults, body_spans),
        "faults_hitting_bodies": dict(
            sorted(Counter(str(f["kind"]) for f in faults if set(f.get("holds") or []) & holds).items())
        ),
    }


def multi_run_twice(history: History, task_ids: set[str]) -> list[Violation]:
    """``run-twice`` for the several-keys runs of ``task_ids``: a body of the task started after one of
    its bodies finished (wrote its op on every key and released every key cleanly). Whatever the policy:
    a ``Queue`` run (``check_queued``), and a ``Retry`` run whose message was delivered again after it
    had published a contention retry (two lines of retries for one attempt, ``check_multi``)."""
    found: list[Violation] = []
    releases = {str(ev["hold"]): ev for ev in history.events if ev.get("ev") == "rel"}
    wrote = {
        str(ev["hold"])
        for ev in history.events
        if ev.get("ev") == "write" and str(ev.get("outcome", "")).startswith("ack")
    }
    bodies: dict[str, list[Doc]] = defaultdict(list)
    for ev in history.events:
        if ev.get("ev") == "mbody" and ev.get("task_id") in task_ids:
            bodies[str(ev["task_id"])].append(ev)
    for task_id, runs in sorted(bodies.items()):
        # A body finished when it wrote its op on every key and released every key cleanly.
        finished = [
            (max(float(releases[h]["t"]) for h in holds), i)
            for i, holds in enumerate([str(h) for h in (b.get("holds") or {}).values()] for b in runs)
            if holds and all(h in wrote and releases.get(h, {}).get("released") for h in holds)
        ]
        if not finished:
            continue
        done_at, first = min(finished)
        again = [b for i, b in enumerate(runs) if i != first and float(b["t"]) > done_at]
        if again:
            kind, words = _twice_of_holds(history, runs[first].get("holds"), again[0].get("holds"))
            found.append(
                Violation(
                    kind,
                    f"{task_id} on {again[0].get('keys')}: a body finished (ops written on every key, keys "
                    f"released cleanly) and a body started again {len(again)} time(s) (fences "
                    f"{again[0].get('fences')}, {again[0].get('who')}, "
                    f"{float(again[0]['t']) - done_at:.1f}s after the releases): {words}"
                    + _deliveries(history, task_id),
                )
            )
    return found


@dataclasses.dataclass(frozen=True)
class Grant:
    """The key given to someone, as the histories show it: a fence, and who got it (a task id, or a bare
    client's name). One grant may be seen several times (a handoff, its claim, the body's acquisition)."""

    key: str
    fence: int
    task_id: str | None
    who: str


def grants(events: Iterable[Doc]) -> dict[str, list[Grant]]:
    """Every grant of every key seen in the histories, by key, in fence order (the server's order)."""
    seen: set[tuple[str, int, str | None, str]] = set()
    events = list(events)
    for ev in events:
        kind = ev.get("ev")
        granted = kind in ("acq", "handoff") or (
            kind == "admit" and ev.get("outcome") in ("acquired", "claimed")
        )
        if not granted:
            continue
        task_id = ev.get("task_id")
        if ev.get("fence") is None:
            continue
        who = str(task_id) if task_id else str(ev.get("who"))
        seen.add((str(ev["key"]), int(ev["fence"]), str(task_id) if task_id else None, who))
    for ev in events:
        # An admission's reply that shows a handoff not yet claimed: the key was handed to that run with
        # the reply's fence (a pending handoff keeps the fence until it is claimed or handed again). This
        # covers handoffs made by a process that records none (a bare client's release).
        if ev.get("ev") == "admit" and ev.get("handed") and ev.get("fence") is not None:
            handed = str(ev["handed"])
            seen.add((str(ev["key"]), int(ev["fence"]), handed, handed))
        # A ``limit=N`` key's reply (an admission's, or a published handoff's: ``handed-seen``): each slot
        # handed to a parked run and not yet claimed, with its fence. This covers handoffs nobody published
        # (a bare client's release, a lost lease's background release).
        for handed_slot in ev.get("handed_slots") or [] if ev.get("ev") in ("admit", "handed-seen") else []:
            task_id, fence = handed_slot[0], handed_slot[1]
            if task_id and fence is not None:
                seen.add((str(ev["key"]), int(fence), str(task_id), str(task_id)))
    out: dict[str, list[Grant]] = defaultdict(list)
    for key, fence, task_id, who in sorted(seen, key=lambda g: (g[0], g[1], g[3])):
        out[key].append(Grant(key, fence, task_id, who))
    return out


def task_keys(task: Doc) -> list[str]:
    """The keys a submitted task runs on (its ``keys``, or its one ``key``)."""
    return [str(k) for k in task.get("keys") or [task.get("key")]]


def task_ops(task: Doc) -> list[str]:
    """The op ids a submitted task applies when done: one per key for a several-keys run."""
    keys = task.get("keys")
    return [multi_op(str(task["op"]), str(k)) for k in keys] if keys else [str(task.get("op"))]


def check_queued(history: History, applied: dict[str, list[tuple[str, str]]]) -> list[Violation]:
    """The guarantees of ``Queue`` and ``Replace`` runs (submitted tasks named in ``QUEUED_TASKS``, each
    with its ``key`` and send ``stamp``).

    Evidence (tests/lockcheck_app.py): ``admit`` events (every admission's outcome and the fence of the
    key in the same command's reply), ``handoff`` events (every handoff and the fence it gave), ``acq``
    events (every body start and its fence). Fences order the grants of a key (the server's order: every
    grant raises the fence); a run parked in a reply with fence f was in the queue before any grant with
    a larger fence.

    * **Not lost, not twice.** A Queue run ends SUCCESS with its op applied (never skipped or
      superseded: no timeout, no max_length); a Replace run ends so, or SUCCESS superseded. (Unfinished
      runs are ``task-unfinished`` above, unless the broker provably lost their message.) No body starts
      again after a run of the same task finished: wrote its op and released the key cleanly
      (``run-twice``); the op is applied at most once (``applied-twice`` above).
    * **Send order (Queue).** For a Queue run A first parked with fence P(A) and first granted the key
      with fence G(A) (infinite if never): no grant with P(A) < fence < G(A) goes to anybody but an
      older Queue run (smaller stamp), or be a handoff handed again (it expired unclaimed) to a run first
      handed the key before A was parked (its turn goes on). A newer Queue run is an ``inversion``; a
      bare client or a plain run is ``barged``. A run still in a broker or prefetch buffer when a newer
      one took the key was not parked then (its P is larger), so running late is not an inversion.
    * **Replace.** A superseded run names a newer send of its key (``superseded-by-older``
      otherwise), and never gets the key after a newer Replace run got it (``replace-order``).
    * **Queue on ``limit=N`` keys and on several keys** (``LIMIT_QUEUE_TASK``, ``MULTI_QUEUE_TASK``): the
      same rules per (run, key), from the run's arrival on the key (a run of several keys takes its keys
      one at a time: it parks on a key once it has the ones before; a run that left a key, ``left``,
      is not judged there). A slot handed to a parked run is a grant with that slot's fence
      (``handoff`` with ``slot``; ``handed_slots`` in an admission's reply or, ``handed-seen``, in a
      published handoff's reply: a handoff nobody published, e.g. a bare client's release or a lost
      lease's background release, shows there until claimed or handed again); the key's fence rises with
      every grant over all slots, and the library admits a run only with a slot free and nobody older
      parked, so any slot given past a parked run is barging or an inversion. A several-keys run is
      ``run-twice`` when a body starts after one of its bodies wrote every key and released them all
      cleanly; ``already-ran`` needs its op applied on every key.
    """
    found: list[Violation] = []
    queued = {tid: t for tid, t in history.tasks.items() if t.get("task") in QUEUED_TASKS}
    if not queued:
        return found
    by_key = grants(history.events)
    first_grant: dict[tuple[str, str], int] = {}  # (task id, key) -> its first grant's fence
    all_grants: dict[str, list[int]] = defaultdict(list)
    for key, items in by_key.items():
        for g in items:
            if g.task_id is not None:
                first_grant[g.task_id, key] = min(first_grant.get((g.task_id, key), g.fence), g.fence)
                all_grants[g.task_id].append(g.fence)
    # Handoffs handed again (``hn`` > 1: the first expired unclaimed): the same turn, not a new one.
    rehands = {
        (str(ev["key"]), int(ev["fence"]), str(ev.get("task_id")))
        for ev in history.events
        if ev.get("ev") == "handoff" and int(ev.get("attempt") or 1) > 1 and ev.get("fence") is not None
    }
    rehands |= {
        (str(ev["key"]), int(hs[1]), str(hs[0]))
        for ev in history.events
        if ev.get("ev") in ("admit", "handed-seen")
        for hs in ev.get("handed_slots") or []
        if len(hs) > 3 and int(hs[3] or 1) > 1 and hs[1] is not None
    }
    # A run of several keys that waits on a key leaves the keys after it (a place left there by an earlier
    # attempt, or a reservation that lapsed and went on: ``key_set.leave_after``): its turn there ends, and
    # it is judged there from its next park, if any (``left``: when it last left each key).
    left: dict[tuple[str, str], float] = {}
    for ev in history.events:
        if ev.get("ev") == "left":
            for k in ev.get("keys") or []:
                at = (str(ev.get("task_id")), str(k))
                left[at] = max(left.get(at, 0.0), float(ev.get("t", 0.0)))
    first_park: dict[tuple[str, str], int] = {}  # (task id, key) -> the fence in its first park's reply
    park_events: dict[tuple[str, str], Doc] = {}  # (task id, key) -> its first park's admit event
    for ev in history.events:
        if ev.get("ev") == "admit" and ev.get("outcome") == "parked" and ev.get("fence") is not None:
            at = (str(ev["task_id"]), str(ev["key"]))
            if at in left and float(ev.get("t0") or ev.get("t") or 0.0) <= left[at]:
                continue  # parked there before it left the key
            first_park[at] = min(first_park.get(at, int(ev["fence"])), int(ev["fence"]))
            if at not in park_events or float(ev.get("t", 0.0)) < float(park_events[at].get("t", 0.0)):
                park_events[at] = ev

    def spilled_behind(task_id: str, other_id: str, key: str) -> bool:
        """The run ``task_id`` was spilled beyond the key's window, and ``other_id`` was parked there
        before it (or at about the same time: their admits overlapped): beyond the window, runs go in the
        order they parked, after the runs parked before them (``documents.spill``), whatever their stamps.
        Not when the other run's admit was sent after this one's answer came (it parked behind it)."""
        mine, other = park_events.get((task_id, key)), park_events.get((other_id, key))
        if mine is None or other is None or not mine.get("spilled"):
            return False
        return not float(other.get("t0", 0.0)) > float(mine.get("t", 0.0))

    # Not lost, not twice.
    for task_id, task in sorted(queued.items()):
        result = task.get("result")
        policy = QUEUED_TASKS[str(task["task"])]
        if task.get("state") != "SUCCESS" or not isinstance(result, dict):
            continue  # task-unfinished (or lost by the broker), above
        if result.get("mongolock") == "superseded":
            by = queued.get(str(result.get("by")))
            if policy != "replace":
                found.append(Violation("superseded-under-queue", f"Queue run {task_id} ended {result}"))
            elif (
                by is None
                or by.get("key") != task.get("key")
                or by.get("task") not in REPLACE_TASKS
                or int(by["stamp"]) <= int(task["stamp"])
            ):
                found.append(
                    Violation(
                        "superseded-by-older",
                        f"Replace run {task_id} (stamp {task.get('stamp')}) on {task.get('key')} superseded "
                        f"by {result.get('by')} "
                        + (f"(stamp {by.get('stamp')}, key {by.get('key')})" if by else "(no send of ours)"),
                    )
                )
        elif result.get("mongolock") == "already-ran" and all(op in applied for op in task_ops(task)):
            continue  # its run applied the op(s); its worker died before the result was stored
        elif result.get("mongolock") == "already-ran":
            missing = [op for op in task_ops(task) if op not in applied]
            found.append(
                Violation(
                    "queued-run-skipped",
                    f"{policy} run {task_id} ended already-ran but its op is not applied ({missing}): "
                    f"{result}",
                )
            )
        elif result.get("mongolock"):
            found.append(Violation("queued-run-skipped", f"{policy} run {task_id} ended {result}"))
    acqs: dict[str, list[Doc]] = defaultdict(list)
    for ev in history.events:
        # A several-keys run is judged by its bodies below (a body cut short on one key is retried).
        if ev.get("ev") == "acq" and ev.get("task_id") in queued and not queued[ev["task_id"]].get("keys"):
            acqs[str(ev["task_id"])].append(ev)
    releases = {str(ev["hold"]): ev for ev in history.events if ev.get("ev") == "rel"}
    wrote = {
        str(ev["hold"])
        for ev in history.events
        if ev.get("ev") == "write" and str(ev.get("outcome", "")).startswith("ack")
    }
    found += multi_run_twice(history, set(queued))
    for task_id, runs in sorted(acqs.items()):
        finished = [
            float(releases[str(a["hold"])]["t"])
            for a in runs
            if str(a["hold"]) in wrote and releases.get(str(a["hold"]), {}).get("released")
        ]
        if not finished:
            continue
        done_at = min(finished)
        again = [a for a in runs if float(a["t0"]) > done_at]
        if again:
            done_hold = next(
                str(a["hold"])
                for a in runs
                if float(releases.get(str(a["hold"]), {}).get("t", -1)) == done_at
            )
            kind, words = _twice_of_holds(history, {"k": done_hold}, {"k": again[0]["hold"]})
            found.append(
                Violation(
                    kind,
                    f"{task_id} on {runs[0]['key']}: a run finished (op written, key released cleanly) and "
                    f"its body started again {len(again)} time(s) (fence {again[0]['fence']}, "
                    f"{again[0].get('who')}, {float(again[0]['t0']) - done_at:.1f}s after the release; "
                    f"{words}; "
                    "causes seen before: the key's document, with its guard against copies, deleted by the "
                    "TTL index meanwhile; a stale handoff copy re-running an attempt whose body had run and "
                    "retried, its RETRY state hidden by a copy's contention retry; look at the admits)",
                )
            )

    # Send order: per key, for the Queue task that runs on that kind of key (a single key, a limit=N
    # key's slots, or one key of a several-keys run).
    for key, items in sorted(by_key.items()):
        policy = key_policy(key)
        ordered = ORDERED_BY_KEY.get(policy)
        if ordered is not None:
            for task_id, task in sorted(queued.items()):
                if (
                    task.get("task") not in ordered
                    or key not in task_keys(task)
                    or (task_id, key) not in first_park
                ):
                    continue
                parked, granted = first_park[task_id, key], first_grant.get((task_id, key))
                for g in items:
                    if g.fence <= parked or (granted is not None and g.fence >= granted):
                        continue
                    first = first_grant.get((str(g.task_id), key), g.fence)
                    if (key, g.fence, str(g.task_id)) in rehands and first <= parked:
                        continue  # a handoff made before A was parked, handed again: the same turn
                    other = queued.get(g.task_id or "")
                    peer = history.tasks.get(g.task_id or "") or {}
                    if other is None and peer.get("task") in SEND_ORDER_PEERS:
                        other = peer  # a several-keys Replace run of another set: it keeps its place
                    if other is not None and (other.get("task") in ordered or other is peer):
                        if queue_order(other) < queue_order(task):
                            continue  # a run ahead of it goes first: older, or of a higher priority
                        if spilled_behind(task_id, str(g.task_id), key):
                            continue  # it parked beyond the window, behind the other one
                        kind = "inversion"
                    else:
                        kind = "barged"
                    found.append(
                        Violation(
                            kind,
                            f"{key}: {task_id} (stamp {task['stamp']}{_rank_text(task)}) was "
                            f"parked (fence {parked}) and "
                            f"not yet given the key ({granted if granted is not None else 'never'}) "
                            f"when {g.who} got it (fence {g.fence}"
                            + (f", stamp {other['stamp']}{_rank_text(other)})" if other is not None else ")"),
                        )
                    )
        elif policy == "replace":
            replace_runs = sorted(
                (int(t["stamp"]), tid)
                for tid, t in queued.items()
                if t.get("key") == key and t.get("task") in REPLACE_TASKS
            )
            newer_first: int | None = None  # the smallest first grant among runs sent later
            for stamp, tid in reversed(replace_runs):
                late = [f for f in all_grants.get(tid, []) if newer_first is not None and f > newer_first]
                if late:
                    found.append(
                        Violation(
                            "replace-order",
                            f"{key}: {tid} (stamp {stamp}) got the key (fence {late[0]}) after a newer send "
                            f"had (fence {newer_first})",
                        )
                    )
                if (tid, key) in first_grant:
                    newer_first = min(first_grant[tid, key], newer_first or first_grant[tid, key])
    return found


def _rank_text(task: Doc) -> str:
    return f", rank {task['rank']}" if task.get("rank") else ""


def queue_order(task: Doc) -> tuple[int, int]:
    """A submitted run's place in its keys' queues: its rank (its priority as its broker orders it,
    ``integration.priority``), then its send stamp."""
    return int(task.get("rank") or 0), int(task["stamp"])


def check_cancel(history: History) -> list[Violation]:
    """``REPLACE_CANCEL_TASK`` and ``MULTI_REPLACE_CANCEL_TASK`` runs (``Replace(cancel_running=True)``), from
    the holders' own notices
    (``superseded-notice``: the hold token, when its body was told) and their claims and writes (``t0``:
    when each was sent):

    * ``write-after-supersession``: a claim or write of a superseded holder sent after it was told, and
      accepted (``fenced_update_one`` with the lease must refuse it);
    * ``superseded-holder-by-older``: a holder told superseded by a run that is not a newer send of its key
      (``MULTI_REPLACE_CANCEL_TASK``: of its set of keys).
    (No two bodies at once, and the newest send of a key running, are the checks of every key and of
    ``check_queued``: a newest send is never superseded, so it ends done.)"""
    found: list[Violation] = []
    tasks = history.tasks
    told: dict[str, Doc] = {}
    for ev in history.events:
        if ev.get("ev") == "superseded-notice":
            told.setdefault(str(ev["hold"]), ev)
    for _hold, notice in sorted(told.items()):
        holder, by = tasks.get(str(notice.get("task_id"))) or {}, tasks.get(str(notice.get("by"))) or {}
        # (a several-keys holder: by a newer send of its own set of keys, told on one of them)
        same = _set_of(by) == _set_of(holder) if holder.get("keys") else by.get("key") == notice.get("key")
        if not same or int(by.get("stamp") or -1) <= int(holder.get("stamp") or 0):
            found.append(
                Violation(
                    "superseded-holder-by-older",
                    f"{notice.get('key')}: holder {notice.get('task_id')} (stamp {holder.get('stamp')}) told "
                    f"superseded by {notice.get('by')} (stamp {by.get('stamp')}, key {by.get('key')})",
                )
            )
    for ev in history.events:
        found_notice = told.get(str(ev.get("hold"))) if ev.get("ev") in ("claim", "write") else None
        if found_notice is None:
            continue
        notice = found_notice
        if ev.get("t0") is None or float(ev["t0"]) <= float(notice["t"]):
            continue
        if str(ev.get("outcome")) in ("ok", "ack", "ack-earlier"):
            found.append(
                Violation(
                    "write-after-supersession",
                    f"{ev.get('key')}: holder {notice.get('task_id')} (fence {ev.get('fence')}) had its "
                    f"{ev['ev']} accepted {float(ev['t0']) - float(notice['t']):.3f}s after it was told "
                    f"superseded by {notice.get('by')}",
                )
            )
    return found


def _attempts(tasks: Mapping[str, Doc], prefix: str) -> dict[str, tuple[str, int]]:
    """Task id -> (its directed op without ``@attempt``, the attempt), for the ops starting with ``prefix``
    (a directed step sent again has its ops suffixed ``@1``, ``@2``)."""
    found: dict[str, tuple[str, int]] = {}
    for tid, t in tasks.items():
        op = str(t.get("op", ""))
        if op.startswith(prefix):
            base, _, attempt = op.partition("@")
            found[tid] = (base, int(attempt or 0))
    return found


def _last_attempt(tasks: Mapping[str, Doc], prefix: str) -> set[str]:
    """The task ids of the last attempt of a directed step whose ops start with ``prefix``: all of them
    from one attempt, never the ops of two."""
    attempts = _attempts(tasks, prefix)
    last = max((n for _base, n in attempts.values()), default=0)
    return {tid for tid, (_base, n) in attempts.items() if n == last}


def _latest_attempts(tasks: Mapping[str, Doc], prefix: str) -> dict[str, str]:
    """Directed op (without its ``@attempt``) -> the task id of its latest attempt, for the ops starting with
    ``prefix`` (``Run._cancel_directed_again`` sends a step again)."""
    found: dict[str, tuple[int, str]] = {}
    for tid, (base, n) in _attempts(tasks, prefix).items():
        if base not in found or n > found[base][0]:
            found[base] = (n, tid)
    return {base: tid for base, (_n, tid) in found.items()}


def _claimed_by(store: Any, keys: tuple[str, ...], task_id: str) -> Callable[[], bool]:
    """A condition: the run ``task_id`` holds every key of ``keys`` and has claimed them (a key handed to a
    run and not yet claimed shows its holder too, with its handoff)."""

    def holds() -> bool:
        try:
            infos = [store.inspect(k) for k in keys]
        except MongoLockError:
            return False
        return all(
            i is not None and i.held and i.handoff is None and i.holder.get("task_id") == task_id
            for i in infos
        )

    return holds


def cancel_figures(history: History) -> Doc:
    """What the ``REPLACE_CANCEL_TASK`` runs did (figures, not verdicts); ``directed_*``: the directed
    burst (``Run._cancel_directed``: a deaf holder terminated after its grace, a lingering holder told and
    its claim refused, the newest send run)."""
    tasks = {tid: t for tid, t in history.tasks.items() if t.get("task") == REPLACE_CANCEL_TASK}
    ev = history.events
    told = {str(e["hold"]): e for e in ev if e.get("ev") == "superseded-notice" and e.get("task_id") in tasks}
    released = {str(e["hold"]) for e in ev if e.get("ev") == "rel"}
    refused = {
        str(e["hold"])
        for e in ev
        if e.get("ev") in ("claim", "write")
        and str(e.get("hold")) in told
        and e.get("outcome") == "fenced"
        and float(e.get("t0") or 0) > float(told[str(e["hold"])]["t"])
    }
    terminated = {h for h in told if h not in released}
    directed = {tid: t for tid, t in tasks.items() if str(t.get("op", "")).startswith("directed-cancel-")}
    by_op = _latest_attempts(directed, "directed-cancel-")

    def result(op: str) -> Doc:
        r = (directed.get(by_op.get(op, "")) or {}).get("result")
        return r if isinstance(r, dict) else {}

    def holds_of(op: str) -> set[str]:
        tid = by_op.get(op)
        return {str(e["hold"]) for e in ev if e.get("ev") == "acq" and e.get("task_id") == tid and tid}

    return {
        "submitted": len(tasks),
        "holders_told": len(told),
        "holders_terminated": len(terminated),
        "holders_refused_after_notice": len(refused),
        "superseded": sum(
            1 for t in tasks.values() if (t.get("result") or {}).get("mongolock") == "superseded"
        ),
        "directed_terminated": int(
            result("directed-cancel-0").get("mongolock") == "superseded"
            and bool(holds_of("directed-cancel-0") & terminated)
        ),
        "directed_refused_after_notice": int(
            result("directed-cancel-1").get("mongolock") == "superseded"
            and bool(holds_of("directed-cancel-1") & refused)
        ),
        "directed_newest_ran": int(result("directed-cancel-2").get("outcome") == "ack"),
    }


def multi_cancel_figures(history: History) -> Doc:
    """What the ``MULTI_REPLACE_CANCEL_TASK`` runs did (figures, not verdicts): holders of a set told by a
    newer send of it (``told``: runs; ``leases_told``: their leases, every one of the set's), and the
    directed pair (``Run._multi_cancel_directed``: the lingering holder of a pair told and ended
    superseded, the newest send run)."""
    tasks = {tid: t for tid, t in history.tasks.items() if t.get("task") == MULTI_REPLACE_CANCEL_TASK}
    notices = [e for e in history.events if e.get("ev") == "superseded-notice" and e.get("task_id") in tasks]
    by_op = _latest_attempts(tasks, "directed-mcancel-")

    def result(op: str) -> Doc:
        r = (tasks.get(by_op.get(op, "")) or {}).get("result")
        return r if isinstance(r, dict) else {}

    told = {str(e["task_id"]) for e in notices}
    first_id = by_op.get("directed-mcancel-0")
    return {
        "submitted": len(tasks),
        "directed_sent": len(by_op),
        "told": len(told),
        "leases_told": len(notices),
        "superseded": sum(
            1 for t in tasks.values() if (t.get("result") or {}).get("mongolock") == "superseded"
        ),
        "directed_told": int(
            first_id in told and result("directed-mcancel-0").get("mongolock") == "superseded"
        ),
        "directed_newest_ran": int(result("directed-mcancel-1").get("outcome") == "ack"),
    }


def queued_faults(faults: list[Doc]) -> dict[str, int]:
    """Per fault kind, how many of its injections found queued runs parked (or handed the key and not
    yet claimed) when they began, or hit the holder of a queued key."""
    out: Counter[str] = Counter()
    for fault in faults:
        hit = any(key_policy(str(k)) in ("queue", "replace") for k in fault.get("keys") or [])
        if hit or int(fault.get("parked_before") or 0) > 0:
            out[str(fault["kind"])] += 1
    return dict(sorted(out.items()))


def queued_figures(history: History, faults: Sequence[Doc] = ()) -> Doc:
    """What the Queue and Replace runs did (figures, not verdicts); the Queue runs on ``limit=N`` keys and
    on two keys at once under ``limit_queued`` and ``multi_queued``."""
    tasks = {tid: t for tid, t in history.tasks.items() if t.get("task") in (QUEUE_TASK, REPLACE_TASK)}
    ev = history.events
    admits = Counter(str(e.get("outcome")) for e in ev if e.get("ev") == "admit")
    parked = {str(e["task_id"]) for e in ev if e.get("ev") == "admit" and e.get("outcome") == "parked"}
    spilled = {str(e["task_id"]) for e in ev if e.get("ev") == "admit" and e.get("spilled")}
    first_grant: dict[str, int] = {}
    for items in grants(ev).values():
        for g in items:
            if g.task_id in tasks:
                first_grant[g.task_id] = min(first_grant.get(g.task_id, g.fence), g.fence)
    # Queue runs of one key that started out of their queue's order (rank, then send order): each such
    # pair, by a run that was parked only after the other one got the key ("late": still in a broker or
    # prefetch buffer). And the pairs in which a newer send of a higher priority got the key first.
    late = overtakes = 0
    by_key: dict[str, list[tuple[tuple[int, int], str]]] = defaultdict(list)
    for tid, t in tasks.items():
        if t.get("task") == QUEUE_TASK and tid in first_grant:
            by_key[str(t["key"])].append((queue_order(t), tid))
    for runs in by_key.values():
        runs.sort()
        for (oa, a), (ob, b) in itertools.combinations(runs, 2):
            if oa[0] == ob[0] and first_grant[a] > first_grant[b]:
                late += 1
            elif oa[0] < ob[0] and oa[1] > ob[1] and first_grant[a] < first_grant[b]:
                overtakes += 1
    superseded = [
        t
        for t in tasks.values()
        if isinstance(t.get("result"), dict) and t["result"].get("mongolock") == "superseded"
    ]
    applied_ops = {
        str(e["op"]) for e in ev if e.get("ev") == "write" and str(e.get("outcome", "")).startswith("ack")
    }
    return {
        "queue_submitted": sum(1 for t in tasks.values() if t.get("task") == QUEUE_TASK),
        "replace_submitted": sum(1 for t in tasks.values() if t.get("task") == REPLACE_TASK),
        "admissions": dict(sorted(admits.items())),
        "parked": len(parked & set(tasks)),
        # Parked beyond their key's window (``documents.spill``; the workers keep 2 runs in it).
        "spilled": len(spilled & set(tasks)),
        "handoffs": sum(1 for e in ev if e.get("ev") == "handoff"),
        # Handoff messages received through their queue's handoff lane (``lanes``).
        "lane_handoffs": sum(1 for e in ev if e.get("ev") == "recv" and e.get("lane")),
        "superseded": len(superseded),
        "superseded_after_a_cut_run": sum(1 for t in superseded if t.get("op") in applied_ops),
        "late_pairs": late,
        "sent_with_priority": sum(1 for t in history.tasks.values() if t.get("priority") is not None),
        "priority_overtakes": overtakes,
        "limit_queued": queued_kind_figures(history, LIMIT_QUEUE_TASK, faults),
        "limit_held": queued_kind_figures(history, MIN_HOLD_TASK, faults),
        "multi_limit_queued": queued_kind_figures(history, MULTI_LIMIT_QUEUE_TASK, faults),
        "multi_queued": queued_kind_figures(history, MULTI_QUEUE_TASK, faults),
        "multi_timed": queued_kind_figures(history, MULTI_TIMED_TASK, faults),
    }


def queued_kind_figures(history: History, name: str, faults: Sequence[Doc] = ()) -> Doc:
    """What the Queue runs of task ``name`` did: submitted, parked (on some key), handed a key or slot
    (``handed``: runs; ``handoffs``: handoff events, re-handings included), ended done, and the faults
    that began while one of them was between its first admission and its end."""
    ev = history.events
    tids = {tid for tid, t in history.tasks.items() if t.get("task") == name}
    parked = {str(e["task_id"]) for e in ev if e.get("ev") == "admit" and e.get("outcome") == "parked"}
    spilled = {str(e["task_id"]) for e in ev if e.get("ev") == "admit" and e.get("spilled")}
    handoffs = [e for e in ev if e.get("ev") == "handoff" and e.get("task_id") in tids]
    handed = {str(e["task_id"]) for e in handoffs}
    handed |= {
        str(hs[0])
        for e in ev
        if e.get("ev") in ("admit", "handed-seen")
        for hs in e.get("handed_slots") or []
        if hs[0] in tids
    }
    began: dict[str, float] = {}
    ended: dict[str, float] = {}
    for e in ev:
        tid = str(e.get("task_id"))
        if tid not in tids or e.get("t") is None:
            continue
        if e.get("ev") == "admit":
            t0 = float(e.get("t0") or e["t"])
            began[tid] = min(began.get(tid, t0), t0)
        elif e.get("ev") == "ended":
            ended[tid] = max(ended.get(tid, 0.0), float(e["t"]))
    spans = [(t0, ended.get(tid, t0)) for tid, t0 in began.items()]
    done = sum(
        1
        for tid in tids
        if history.tasks[tid].get("state") == "SUCCESS"
        and isinstance(history.tasks[tid].get("result"), dict)
        and not history.tasks[tid]["result"].get("mongolock")
    )
    return {
        "submitted": len(tids),
        "parked": len(parked & tids),
        "spilled": len(spilled & tids),
        "handed": len(handed),
        "handoffs": len(handoffs),
        "rehandoffs": sum(1 for e in handoffs if int(e.get("attempt") or 1) > 1),
        "done": done,
        # (Queue(timeout=...): parked past its deadline, it ended skipped without its body)
        "timed_out": sum(
            1
            for tid in tids
            if (history.tasks[tid].get("result") or {}).get("mongolock") == "skipped"
            if isinstance(history.tasks[tid].get("result"), dict)
        ),
        "faults_while_waiting_or_running": faults_during(faults, spans),
    }


def hold_ends(events: Iterable[Doc]) -> dict[str, float]:
    """When each hold was last seen (its release sent, or its last write): a killed holder has no release."""
    out: dict[str, float] = {}
    for e in events:
        if e.get("ev") in ("rel", "write") and e.get("hold") and e.get("t") is not None:
            out[str(e["hold"])] = max(out.get(str(e["hold"]), 0.0), float(e["t"]))
    return out


def faults_during(faults: Iterable[Doc], spans: Sequence[tuple[float, float]]) -> dict[str, int]:
    """Per fault kind, how many of its injections began while one of ``spans`` (start, end) was running."""
    out: Counter[str] = Counter()
    for fault in faults:
        t = float(fault["t"])
        if any(s <= t <= e for s, e in spans):
            out[str(fault["kind"])] += 1
    return dict(sorted(out.items()))


def limit_figures(history: History, faults: list[Doc]) -> Doc:
    """What the ``limit=N`` holds and the several-keys runs did (figures, not verdicts)."""
    ev = history.events
    releases = {str(e["hold"]): e for e in ev if e.get("ev") == "rel"}
    limit_acqs: dict[str, list[Doc]] = defaultdict(list)
    for e in ev:
        if e.get("ev") == "acq" and key_policy(str(e["key"])) == "limit":
            limit_acqs[str(e["key"])].append(e)
    most = {key: max_overlap(clean_spans(items, releases))[0] for key, items in sorted(limit_acqs.items())}
    bodies = [e for e in ev if e.get("ev") == "mbody"]
    body_holds = {str(h) for b in bodies for h in (b.get("holds") or {}).values()}
    tasks = history.tasks
    multi_tasks = [t for t in tasks.values() if t.get("task") in MULTI_TASKS]
    limit_tasks = [t for t in tasks.values() if t.get("task") in LIMIT_TASKS]
    complete = 0
    ops_by_hold: dict[str, set[str]] = defaultdict(set)
    for e in ev:
        if e.get("ev") == "write" and str(e.get("outcome", "")).startswith("ack"):
            ops_by_hold[str(e["hold"])].add(str(e["op"]))
    for b in bodies:
        if all(ops_by_hold.get(str(h)) for h in (b.get("holds") or {}).values()):
            complete += 1
    orders = {tuple(t.get("keys") or ()) for t in multi_tasks}
    ends = hold_ends(ev)
    limit_spans = [
        (float(a["t1"]), ends.get(str(a["hold"]), float(a["t1"]) + 5.0))
        for v in limit_acqs.values()
        for a in v
    ]
    body_spans = [
        (
            float(b["t"]),
            max(
                (ends.get(str(h), float(b["t"]) + 5.0) for h in (b.get("holds") or {}).values()),
                default=float(b["t"]),
            ),
        )
        for b in bodies
    ]
    return {
        "limit": LIMIT,
        "limit_holds": sum(len(v) for v in limit_acqs.values()),
        "limit_clean_holds": sum(len(clean_spans(v, releases)) for v in limit_acqs.values()),
        "limit_task_runs": sum(
            1
            for e in ev
            if e.get("ev") == "acq"
            and "slot" in e
            and tasks.get(str(e.get("task_id")), {}).get("task") in LIMIT_TASKS
        ),
        "limit_submitted": len(limit_tasks),
        "min_hold": min_hold_figures(history, limit_acqs, releases),
        "max_clean_holds_at_once": most,
        "slots_used": sorted({int(e["slot"]) for v in limit_acqs.values() for e in v if "slot" in e}),
        "multi_submitted": len(multi_tasks),
        "multi_key_pairs_both_orders": sum(1 for o in orders if tuple(reversed(o)) in orders) // 2,
        "multi_bodies": len(bodies),
        "multi_bodies_all_written": complete,
        "multi_bodies_started_past_a_deadline": sum(1 for b in bodies if b.get("expired")),
        "task_acquires_answered_past_their_deadline": sum(
            1 for e in ev if e.get("ev") == "acq" and e.get("late_reply")
        ),
        "multi_skipped": sum(
            1 for t in multi_tasks if isinstance(t.get("result"), dict) and t["result"].get("mongolock")
        ),
        "faults_during_limit_holds": faults_during(faults, limit_spans),
        "faults_during_multi_bodies": faults_during(faults, body_spans),
        "faults_hitting_limit_keys": dict(
            sorted(
                Counter(
                    str(f["kind"])
                    for f in faults
                    if any(key_policy(str(k)) == "limit" for k in f.get("keys") or [])
                ).items()
            )
        ),
        "faults_hitting_multi_bodies": dict(
            sorted(Counter(str(f["kind"]) for f in faults if set(f.get("holds") or []) & body_holds).items())
        ),
        "multi_limit": multi_limit_figures(history, faults),
    }


def min_hold_figures(history: History, limit_acqs: dict[str, list[Doc]], releases: dict[str, Doc]) -> Doc:
    """What the ``MIN_HOLD_TASK`` runs did: their holds, those released cleanly, the slots taken again
    after such a hold (each checked by ``check_min_holds``), how long after the hold's start, and the
    slots handed by a worker's sweeper (a hold that ended with nothing released then)."""
    tids = {tid for tid, t in history.tasks.items() if t.get("task") == MIN_HOLD_TASK}
    holds = [a for v in limit_acqs.values() for a in v if a.get("mh")]
    pairs = [p for v in limit_acqs.values() for p in min_hold_pairs(v, releases)]
    swept = [
        e
        for e in history.events
        if e.get("ev") == "handoff"
        and e.get("task_id") in tids
        and str(e.get("by") or "").startswith("sweep:")
    ]
    return {
        "submitted": len(tids),
        "holds": len(holds),
        "clean_holds": sum(1 for a in holds if (releases.get(str(a["hold"])) or {}).get("released")),
        "slots_taken_again_after_a_clean_hold": len(pairs),
        "gap_after_hold_start_s": _stats(float(b["t1"]) - float(a["t0"]) for a, b in pairs),
        "handed_by_a_sweep": len(swept),
    }


def multi_limit_figures(history: History, faults: Sequence[Doc] = ()) -> Doc:
    """What the several-keys runs with a limit per key (``MULTI_LIMIT_TASK``) did (figures, not verdicts):
    bodies that held a slot of an ``l`` key and the single lease of a ``k`` key, runs that found each kind
    of key held or full (``tcont``), and the most clean holds of an ``l`` key at one instant while one of
    these runs held a slot there (its slot counted with the others')."""
    ev = history.events
    tids = {tid for tid, t in history.tasks.items() if t.get("task") == MULTI_LIMIT_TASK}
    bodies = [e for e in ev if e.get("ev") == "mbody" and e.get("task_id") in tids]
    both = [
        b
        for b in bodies
        if any(key_policy(k) == "limit" and s is not None for k, s in (b.get("slots") or {}).items())
        and any(key_policy(k) == "plain" and k not in (b.get("slots") or {}) for k in b.get("keys") or [])
    ]
    contended: dict[str, set[str]] = {"limit": set(), "plain": set()}
    contentions = 0
    for e in ev:
        if e.get("ev") == "tcont" and e.get("task_id") in tids:
            contentions += 1
            contended.setdefault(key_policy(str(e.get("key"))), set()).add(str(e["task_id"]))
    releases = {str(e["hold"]): e for e in ev if e.get("ev") == "rel"}
    acqs: dict[str, list[Doc]] = defaultdict(list)
    for e in ev:
        if e.get("ev") == "acq" and key_policy(str(e["key"])) == "limit":
            acqs[str(e["key"])].append(e)
    most = 0
    for items in acqs.values():
        spans = clean_spans(items, releases)
        for s0, e0, a in spans:
            if a.get("task_id") not in tids:
                continue
            inside = [(max(s, s0), min(e, e0), b) for s, e, b in spans if s < e0 and e > s0]
            most = max(most, max_overlap(inside)[0])
    ends = hold_ends(ev)
    body_spans = [
        (float(b["t"]), max(ends.get(str(h), float(b["t"]) + 5.0) for h in (b.get("holds") or {}).values()))
        for b in bodies
        if b.get("holds")
    ]
    holds = {str(h) for b in bodies for h in (b.get("holds") or {}).values()}
    done = [
        t
        for tid, t in history.tasks.items()
        if tid in tids and t.get("state") == "SUCCESS" and isinstance(t.get("result"), dict)
    ]
    return {
        "submitted": len(tids),
        "done": sum(1 for t in done if not t["result"].get("mongolock")),
        "bodies": len(bodies),
        "bodies_with_a_slot_and_a_single_lease": len(both),
        "slot_holds": sum(1 for e in ev if e.get("ev") == "acq" and e.get("task_id") in tids and "slot" in e),
        "contentions": contentions,
        "contended_runs": {kind: len(v) for kind, v in sorted(contended.items())},
        "most_clean_holds_at_once_with_a_slot_of_theirs": most,
        "faults_during_bodies": faults_during(faults, body_spans),
        "faults_hitting_bodies": dict(
            sorted(Counter(str(f["kind"]) for f in faults if set(f.get("holds") or []) & holds).items())
        ),
    }


# -- figures ---------------------------------------------------------------------------------------------


def document_figures(history: History) -> Doc:
    """The document locks (``d`` keys): holds, their writes by outcome, the holds taken over (the previous
    hold of the document did not end with a clean release), the controller's holds through the faults
    and the directed takeover (``Run._document_takeover``)."""
    ev = [
        e for e in history.events
        if e.get("ev") in ("acq", "write", "rel") and key_policy(str(e.get("key", ""))) == "document"
    ]  # fmt: skip
    acqs = sorted((e for e in ev if e["ev"] == "acq"), key=lambda e: float(e["t1"]))
    releases = {str(e["hold"]): e for e in ev if e["ev"] == "rel"}
    writes = [e for e in ev if e["ev"] == "write"]
    taken_over = 0
    last: dict[str, Doc] = {}
    for a in acqs:
        before = last.get(str(a["key"]))
        if before is not None and not (releases.get(str(before["hold"])) or {}).get("released"):
            taken_over += 1
        last[str(a["key"])] = a

    def by(who: str) -> list[Doc]:
        return [e for e in writes if e.get("who") == who]

    fences = {str(a.get("who")): int(a["fence"]) for a in acqs if a.get("who") in (DOC_PAUSED, DOC_SUCCESSOR)}
    return {
        "holds": len(acqs),
        "client_holds": sum(1 for a in acqs if str(a.get("who", "")).startswith("client")),
        "released_cleanly": sum(1 for e in releases.values() if e.get("released")),
        "taken_over": taken_over,
        "writes": dict(sorted(Counter(str(e["outcome"]) for e in writes).items())),
        "client_writes_acknowledged": sum(
            1
            for e in writes
            if str(e.get("who", "")).startswith("client") and str(e["outcome"]).startswith("ack")
        ),
        "gate_holds": sum(1 for a in acqs if a.get("who") == DOC_GATE),
        "gate_writes": dict(sorted(Counter(str(e["outcome"]) for e in by(DOC_GATE)).items())),
        "takeover": {
            "successor_fence_larger": fences.get(DOC_SUCCESSOR, 0) > fences.get(DOC_PAUSED, 2**63),
            "successor_acknowledged": any(str(e["outcome"]).startswith("ack") for e in by(DOC_SUCCESSOR)),
            "late_write_refused": any(e["outcome"] == "fenced" for e in by(DOC_PAUSED)),
        },
    }


def _stats(values: Iterable[float]) -> Doc:
    vals = sorted(values)
    if not vals:
        return {"n": 0}
    return {
        "n": len(vals),
        "median_s": round(statistics.median(vals), 3),
        "max_s": round(vals[-1], 3),
    }


def recovery_times(faults: list[Doc], events: list[Doc]) -> dict[str, Doc]:
    """Per fault kind: seconds from the fault until the key it hit (or, for server-wide faults, any
    key) was next acquired by another holder."""
    acqs = sorted((float(e["t1"]), str(e["key"]), str(e["hold"])) for e in events if e.get("ev") == "acq")
    out: dict[str, list[float]] = defaultdict(list)
    for fault in faults:
        t, keys, victims = float(fault["t"]), fault.get("keys"), set(fault.get("holds") or [])
        if fault["kind"] == "clock-jump":
            continue
        if keys is not None and not keys:
            continue  # it hit no holder (e.g. a node that held nothing): nothing to recover
        if keys:
            waits = []
            for key in keys:
                nxt = next((t1 for t1, k, h in acqs if t1 > t and k == key and h not in victims), None)
                if nxt is not None:
                    waits.append(nxt - t)
            if waits:
                out[fault["kind"]].append(max(waits))
        else:
            nxt = next((t1 for t1, _k, h in acqs if t1 > t and h not in victims), None)
            if nxt is not None:
                out[fault["kind"]].append(nxt - t)
    return {kind: _stats(v) for kind, v in sorted(out.items())}


def lost_by_broker(
    task_id: str,
    where: str | None,
    log: brokerlog.BrokerLog | None,
    faults: list[Doc],
    *,
    start: float,
    unrestored: Iterable[str] = (),
) -> str | None:
    """Why the broker, not the library, lost an unfinished task's message, when the broker's own record
    proves it; None otherwise (and the task stays a violation).

    kombu's Redis transport takes a message off its queue (BRPOP) before it records it as unacknowledged
    (one pipeline after the pop: ``kombu.transport.redis.QoS.append``). A consumer that dies in between
    (its node SIGKILLed) or whose recording fails because the broker itself went down (crash or stop)
    loses the message: celery/celery#7950, at most once. Proven only when all of this holds:

    - the message is in no queue and not unacknowledged now (``where == "nowhere"``);
    - the broker's append-only file, replayed (``tests/brokerlog.py``), shows the task's last message
      copy popped and never recorded as unacknowledged, nor pushed again, afterwards;
    - a fault that cuts a consumer off (``kill-node``, ``broker-restart``) happened no later than the clock
      mark after that pop plus the longest pop-to-record time that the file shows for the messages that
      were recorded in this run (measured, not assumed: the latency), and not before the clock mark before
      the pop; for a kill, not before it less the time the node took to be reaped plus that latency (the
      broker serves a killed consumer's pending pop until it handles its closed connection).

    Or, a second way the same transport loses a message: a restore (a worker's ``reject(requeue=True)``
    or its shutdown) that fails with an error other than a connection error (a channel closed under it by
    a broker restart) is logged at CRITICAL, "Could not restore message", and its transaction still removes
    the message from the unacknowledged set without pushing it back (``kombu.transport.redis``,
    ``Channel._do_restore_message``). Proven only when the task's id is in such a line of a node's log
    (``unrestored``) and the file shows its last copy's last step is that removal, with no push after.
    """
    if where != "nowhere" or log is None:
        return None
    removed = log.last_copy_removed(task_id)
    if removed is not None and task_id in unrestored:
        return (
            f"message {removed} removed from the unacknowledged set by a restore that failed: kombu's Redis "
            "transport logged 'Could not restore message' for it (a node's log) and never pushed it back "
            f"(broker append-only file, {log.commands} commands)"
        )
    popped = log.last_pop_unrecorded(task_id)
    if popped is None:
        return None
    tag, after, before = popped
    latency = max(log.max_pop_to_record_s, CLOCK_MARK_INTERVAL)
    window_end = before + latency
    cuts = [
        {**f, "kind": "kill-node", "t": f["killed_t"]} if f.get("killed_t") is not None else f
        for f in faults
        if f["kind"] in ("kill-node", "broker-restart") or f.get("killed_t") is not None
    ]

    def cut_until(f: Doc) -> float:
        # A killed node's pending BRPOP is still served by the broker until the broker handles its closed
        # connection: after the node is reaped (``dead_t``), by at most the broker's latency, bounded by the
        # longest pop-to-record time this run measured (ci of stop 63: the pop 64 ms after the kill's time).
        if f["kind"] != "kill-node":
            return float(f["t"])
        dead = f.get("dead_t")
        return float(f["t"] if dead is None else dead) + latency

    cuts = [f for f in cuts if float(f["t"]) <= window_end and cut_until(f) >= after]
    if not cuts:
        return None
    cut = cuts[0]
    who = f"node {cut.get('node')} SIGKILLed" if cut["kind"] == "kill-node" else f"broker {cut.get('how')}"
    return (
        f"message {tag} popped off its queue between {after - start:.2f}s and {before - start:.2f}s and "
        f"never recorded as unacknowledged (broker append-only file, {log.commands} commands); {who} at "
        f"{float(cut['t']) - start:.2f}s, within the longest pop-to-record time measured in this run "
        f"({log.max_pop_to_record_s:.2f}s)"
    )


_UNRESTORED = re.compile(r"Could not restore message: .*?'id': '([0-9a-f-]{36})'")


def unrestored_task_ids(workdir: Path) -> set[str]:
    """The task ids of the messages kombu's Redis transport logged it could not restore ("Could not
    restore message", CRITICAL) in the worker nodes' logs of ``workdir``."""
    found: set[str] = set()
    for path in workdir.glob("*@*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if "Could not restore message" in line:
                found.update(_UNRESTORED.findall(line))
    return found


def lost_for_good(waiting: Iterable[str], where: Mapping[str, str], proven: set[str]) -> bool:
    """Every task in ``waiting`` has no message in the broker and is parked nowhere, and the broker's own
    record proves its message lost (``proven``: ``lost_by_broker``): none of them can run any more."""
    ids = list(waiting)
    return bool(ids) and all(where.get(t) == "nowhere" and t in proven for t in ids)


def broker_steps(log: brokerlog.BrokerLog, task_id: str, start: float) -> list[str]:
    """A task's message copies as the broker's file tells them (for the report of an unfinished task)."""
    out = []
    for tag in log.by_task.get(task_id, []):
        steps = " ".join(
            f"{kind}@{after - start:.2f}" if after != float("-inf") else kind
            for kind, after, _ in log.steps.get(tag, [])
        )
        out.append(f"{tag[:8]}: {steps}")
    return out


def figures(history: History, faults: list[Doc], violations: list[Violation], extra: Doc) -> Doc:
    ev = history.events
    writes = Counter(e["outcome"] for e in ev if e.get("ev") == "write")
    kinds = Counter(e["ev"] for e in ev)
    tasks = history.tasks
    ended_by_policy = Counter(
        str(t["result"]["mongolock"])
        for t in tasks.values()
        if isinstance(t.get("result"), dict) and t["result"].get("mongolock")
    )
    skipped = sum(ended_by_policy.values())
    return {
        **extra,
        "acquisitions": kinds["acq"],
        "contended": kinds["contended"],
        "operations": {
            "attempted": sum(writes.values()),
            "acknowledged": writes["ack"] + writes["ack-earlier"],
            "acknowledged_after_ambiguous_retry": sum(
                1
                for e in ev
                if e.get("ev") == "write" and e["outcome"].startswith("ack") and e.get("retried")
            ),
            "fenced_out": writes["fenced"],
            "fenced_out_reckless": sum(
                1 for e in ev if e.get("ev") == "write" and e["outcome"] == "fenced" and e.get("reckless")
            ),
            "lease_loss_detected": writes["lost-detected"],
            "ambiguous": writes["ambiguous"],
            "claims_fenced": sum(1 for e in ev if e.get("ev") == "claim" and e["outcome"] == "fenced"),
            "store_errors": kinds["err"]
            + sum(1 for e in ev if e.get("ev") in ("claim", "read") and e["outcome"] == "error"),
            "unexpected_exceptions": kinds["unexpected"],
        },
        "tasks": {
            "submitted": len(tasks),
            "done": sum(1 for t in tasks.values() if t.get("state") == "SUCCESS") - skipped,
            "skipped": ended_by_policy["skipped"],
            "superseded": ended_by_policy["superseded"],
            "runs": sum(1 for e in ev if e.get("ev") == "acq" and e.get("task_id")),
            "unfinished": sum(1 for t in tasks.values() if t.get("state") != "SUCCESS"),
            "lost_by_broker": sum(1 for t in tasks.values() if t.get("lost_by_broker")),
            "skewed_node_submitted": sum(1 for t in tasks.values() if t.get("queue") == SKEWED_QUEUE),
            "skewed_node_ended": sum(
                1 for t in tasks.values() if t.get("queue") == SKEWED_QUEUE and t.get("state") == "SUCCESS"
            ),
            **died_figures(history),
        },
        "queued": {
            **queued_figures(history, faults),
            "faults_hitting_queued_runs": queued_faults(faults),
            **link_figures(history),
        },
        "limit_multi": limit_figures(history, faults),
        "document": document_figures(history),
        "reentrant": reentrant_figures(history, faults),
        "multi_replace": {
            **multi_replace_figures(history, faults),
            "capped_directed": {k: v for k, v in (extra.get("capped_directed") or {}).items() if k != "runs"},
        },
        "cancel": cancel_figures(history),
        "multi_cancel": multi_cancel_figures(history),
        "unique": unique_figures(history, faults, extra.get("unique_directed")),
        "rate": rate_figures(history, faults, extra.get("rate_directed")),
        "multi_limit_replace": {
            **multi_replace_figures(
                history, faults, MULTI_LIMIT_REPLACE_TASK, "directed-multi-limit-replace-"
            ),
            "capped_directed": {
                k: v for k, v in (extra.get("limits_capped_directed") or {}).items() if k != "runs"
            },
        },
        "mixed": {
            **mixed.mixed_figures(ev, tasks),
            "directed": extra.get("mixed_directed") or {},
            "faults_with_a_run_kept_aside": dict(
                sorted(Counter(f["kind"] for f in faults if (f.get("mixed") or {}).get("kept_aside")).items())
            ),
            "faults_hitting_mixed_keys": dict(
                sorted(
                    Counter(
                        f["kind"]
                        for f in faults
                        if any(key_policy(str(k)) == "mixed" for k in f.get("keys") or [])
                    ).items()
                )
            ),
        },
        "faults": dict(sorted(Counter(f["kind"] for f in faults).items())),
        "recovery": recovery_times(faults, ev),
        "violations": len(violations),
        "violation_list": [str(v) for v in violations[:50]],
    }


def _multi_replace_line(title: str, fig: Doc, directed: str, directed_fig: Doc) -> str:
    """The report's line for a several-keys ``Replace`` section (``multi_replace_figures``) and what its
    directed burst showed (``directed``, formatted with ``directed_fig``)."""
    line = (
        "  {title}: tasks {submitted} in {sets} sets of keys ({sets_with_a_superseded_run} with a run "
        "superseded), done {done}, superseded {superseded}, bodies {bodies}, newest send of a set done with "
        "a body {newest_of_a_set_done_with_a_body}, runs of a set sharing a key with another "
        "{overlapping_runs} (done {overlapping_runs_done}); directed: superseded {directed_superseded}, "
        "done with a body {directed_done_with_a_body}; faults hitting a body {faults_hitting_bodies}, that "
        "began while a body ran {faults_during_bodies} "
    ).format(title=title, **fig)
    if fig.get("capped_submitted") or fig.get("capped_directed"):
        line += (
            "(with max_wait: tasks {capped_submitted}, superseded {capped_superseded}, done with a body "
            "{capped_done_with_a_body}; directed capped burst {capped_directed}) "
        ).format_map(defaultdict(lambda: None, fig))
    return line + directed.format_map(defaultdict(lambda: None, directed_fig))


def unmet_coverage(report: Doc) -> list[str]:
    """What a bounded run (``Config`` defaults, every fault) claims to have exercised and did not; empty:
    all of it. Each claim holds by how the run is driven, not by timing or load:

    - every fault kind landed: the first pass retries a fault that finds no victim until it lands;
    - more than ``MIN_ACKNOWLEDGED`` writes acknowledged: the fault phase lasts until then;
    - the directed phase (``Run.directed``, before the faults): a gate of the controller's holds each
      directed key (all N slots of the ``limit=N`` key) until the lease document shows the whole burst
      waiting there, then lets go, and every run of the bursts ends: ``Queue`` runs parked (all but
      ``PARKED_WINDOW`` of them spilled beyond the key's window) and handed the key one after another
      (each release hands it to the next: ``QUEUE_BURST - 1`` handoffs at least, their first messages
      published to the queue's handoff lane; the last one sent, of the highest priority, first:
      ``QUEUE_BURST - 1`` pairs in which a newer send of a higher priority got the key first),
      ``Replace`` runs superseded, ``Queue`` runs of the ``limit=N`` key parked and handed slots,
      several-keys ``Queue`` runs parked on a key and handed both; the gate held all N slots at once;
      once the ``limit=N`` burst waits, a run of several keys sent after it reaches that key behind its
      spilled runs and is spilled too (``Run._held_back_send``): it may get a slot only after them, which
      the send-order check judges;
    - the per-key-limit burst (``Run._multi_limit_stages``): a gate holds its ``k`` key until every run of
      the burst has found it held (the workers' ``tcont`` events), then its ``l`` key's N slots until
      every run has found them full, then N - 1 slots until every run has ended: each run held a slot and
      the ``k`` key (a body with both), and did so beside N - 1 holds of the gate (N clean holds at once);
    - the reentrant burst (``Run._reentrant_burst``): every run ends (the directed phase waits for it),
      and a run ends done only once its body wrote its ``l`` key's slot through an in-process call and its
      ``k`` key through ``store.hold``, each a reentrant hold (without one it writes nothing and is
      retried): so ``REENTRANT_BURST`` done runs reentered both ways, a slot among them;
    - the several-keys ``Replace`` burst (``Run._multi_replace_directed``): its runs are sent one at a time
      while a gate holds their second key, each once the first key is reserved for the one before, so
      every newer send takes its set's reservation back from the older run (``MULTI_REPLACE_BURST - 1``
      times, seen in the lease document), and all but the newest end superseded; a run of an
      overlapping set parks behind the newest one's reservation, and both run once the gate lets go;
    - the several-keys ``Replace`` burst with a limit per key (``Run._multi_limit_replace_directed``): on
      a pair (an ``l`` key, a ``k`` key) of its own, its runs sent one at a time behind a gate on all N
      slots, each once the lease documents show the one before waiting as planned: each run parks for a
      slot (the ``k`` key reserved for it), so every newer send supersedes its set's run parked there;
      all but the newest end superseded and the newest runs once the gate lets go;
    - every fault began with a ``Queue`` run parked behind a gate on a key of its own (confirmed in its
      lease document), handed the key when the fault was over;
    - every fault began with a document lock (``DocumentLock``, a ``d`` key of its own) held by the
      controller, written through the lock once the fault was over (``Run._document_gate``);
    - the directed document-lock takeover (``Run._document_takeover``): a holder whose renewals stop is
      followed by a successor with a larger fence once the lock expired on the server, the successor's
      write is acknowledged and the stopped holder's late write, sent as if it still held the lock, is
      refused by the document;
    - the node whose wall clock jumps (when libfaketime is installed) took every fault's gated run (a
      ``Queue`` run parked, then handed the key), and the plan jumps its clock twice.
    """
    out: list[str] = []

    def claim(ok: bool, what: str, figures: Any) -> None:
        if not ok:
            out.append(f"{what}: {figures}")

    faults, skipped = report["faults"], report["faults_skipped"]
    for kind in ALL_FAULTS:
        if kind in skipped:
            claim(kind == "clock-jump" and "faketime" in skipped[kind], f"fault {kind} skipped", skipped)
        else:
            claim(faults.get(kind, 0) >= 1, f"fault {kind} injected", faults)
    ops, tasks, queued, lm = report["operations"], report["tasks"], report["queued"], report["limit_multi"]
    claim(ops["acknowledged"] > MIN_ACKNOWLEDGED, f"more than {MIN_ACKNOWLEDGED} writes acknowledged", ops)
    claim(queued["queue_submitted"] >= QUEUE_BURST, "the Queue burst sent", queued)
    claim(queued["parked"] >= QUEUE_BURST, "the Queue burst parked", queued)
    # (the burst waits on one key at once, and the workers' lease documents keep PARKED_WINDOW parked runs
    # of a priority: all but that many of its QUEUE_BURST - 1 runs without a priority are spilled)
    spills = QUEUE_BURST - 1 - PARKED_WINDOW
    claim(queued["spilled"] >= spills, "the Queue burst spilled beyond the window", queued)
    claim(queued["handoffs"] >= QUEUE_BURST - 1, "the Queue burst handed the key on", queued)
    claim(
        queued["lane_handoffs"] >= 1, "a handed run's message came through its queue's handoff lane", queued
    )
    claim(
        queued["priority_overtakes"] >= QUEUE_BURST - 1,
        "the Queue burst's last send, of the highest priority, handed the key before the older runs",
        queued,
    )
    claim(queued["replace_submitted"] >= REPLACE_BURST, "the Replace burst sent", queued)
    claim(queued["superseded"] >= REPLACE_BURST - 1, "the Replace burst superseded", queued)
    claim(
        tasks["done"]
        >= QUEUE_BURST + LIMIT_BURST + MULTI_BURST + MIN_HOLD_BURST + MULTI_LIMIT_QUEUE_BURST + 1,
        "the directed bursts ended done",
        tasks,
    )
    for kind, burst in (("limit_queued", LIMIT_BURST), ("multi_queued", MULTI_BURST)):
        qk = queued[kind]
        claim(qk["submitted"] >= burst and qk["parked"] >= burst, f"the {kind} burst parked", qk)
        claim(qk["handed"] >= 1, f"the {kind} burst handed", qk)
    # (the gate holds every slot of the limit burst's key: all but PARKED_WINDOW of its runs are spilled)
    lq = queued["limit_queued"]
    spilled_limit = lq["spilled"] >= LIMIT_BURST - PARKED_WINDOW
    claim(spilled_limit, "the limit_queued burst spilled beyond the window", lq)
    hb = report.get("held_back_directed") or {}
    claim(
        hb.get("spilled_older_runs", 0) >= LIMIT_BURST - PARKED_WINDOW and bool(hb.get("spilled_behind")),
        "a run of several keys spilled behind the limit burst's spilled runs (one key at a time)",
        hb,
    )
    claim(max(lm["max_clean_holds_at_once"].values(), default=0) == LIMIT, f"{LIMIT} clean holds at once", lm)
    claim(lm["limit_task_runs"] >= LIMIT_BURST, "the limit burst ran as tasks", lm)
    mh = lm["min_hold"]
    claim(mh["submitted"] >= MIN_HOLD_BURST, "the min-hold burst sent", mh)
    claim(
        mh["slots_taken_again_after_a_clean_hold"] >= MIN_HOLD_BURST - LIMIT,
        "slots taken again after a clean minimum hold",
        mh,
    )
    claim(queued["limit_held"]["parked"] >= MIN_HOLD_BURST, "the min-hold burst parked", queued["limit_held"])
    mlq = queued["multi_limit_queued"]
    claim(mlq["parked"] >= MULTI_LIMIT_QUEUE_BURST, "the several-keys Queue burst with a limit parked", mlq)
    claim(mlq["handed"] >= 1, "the several-keys Queue burst with a limit handed", mlq)
    claim(lm["multi_bodies"] >= MULTI_BURST, "the several-keys burst ran its bodies", lm)
    mlf = lm["multi_limit"]
    claim(
        mlf["bodies_with_a_slot_and_a_single_lease"] >= MULTI_LIMIT_BURST,
        "a per-key-limit run held a slot of an l key together with a k key",
        mlf,
    )
    for kind in ("plain", "limit"):
        claim(
            mlf["contended_runs"].get(kind, 0) >= MULTI_LIMIT_BURST,
            f"the per-key-limit burst contended on its {'k key' if kind == 'plain' else 'l key'}",
            mlf,
        )
    claim(
        mlf["most_clean_holds_at_once_with_a_slot_of_theirs"] == LIMIT,
        f"a per-key-limit run's slot among {LIMIT} clean holds at once",
        mlf,
    )
    re = report["reentrant"]
    claim(
        re["done_runs_that_reentered_both_ways"] >= REENTRANT_BURST,
        "reentrant runs wrote a slot through an in-process call and a key through store.hold",
        re,
    )
    claim(re["reentered_slots"] >= REENTRANT_BURST, "a reentrant hold of a slot", re)
    mr, mrd = report.get("multi_replace") or {}, report.get("multi_replace_directed") or {}
    if mrd:
        directed = {**mr, **mrd}
        claim(
            mr.get("directed_superseded", 0) == MULTI_REPLACE_BURST - 1
            and mr.get("directed_done_with_a_body", 0) == 2,
            "the several-keys Replace burst: all but its newest send superseded, the newest and the "
            "overlapping set's run ran",
            directed,
        )
        claim(
            mrd.get("taken_back", 0) == MULTI_REPLACE_BURST - 1,
            "each newer send of the several-keys Replace burst took its set's reservation back",
            directed,
        )
        claim(
            bool(mrd.get("other_parked_behind")),
            "a run of an overlapping set parked behind the set's reservation",
            directed,
        )
    for section, which in ((mr, ""), (report.get("multi_limit_replace") or {}, ", a limit on each key")):
        capped = section.get("capped_directed") or {}
        if capped.get("sends"):
            claim(
                bool(capped.get("ran_while_sending")),
                f"the capped several-keys Replace burst (max_wait{which}) ran a body while its sends went on",
                {**capped, **{k: v for k, v in section.items() if k.startswith("capped")}},
            )
    cx = report.get("cancel")
    if cx is not None and cx.get("submitted"):
        claim(
            cx["directed_terminated"] == 1,
            "a cancel_running holder that never looks terminated after its grace",
            cx,
        )
        claim(
            cx["directed_refused_after_notice"] == 1,
            "a cancel_running holder told, its claim refused, ended superseded",
            cx,
        )
        claim(cx["directed_newest_ran"] == 1, "the newest send of the cancel_running burst ran", cx)
    mc = report.get("multi_cancel")
    if mc is not None and mc.get("directed_sent"):
        claim(
            mc["directed_told"] == 1,
            "a several-keys cancel_running holder told by a newer send of its set, ended superseded",
            mc,
        )
        claim(
            mc["directed_newest_ran"] == 1, "the newest send of the several-keys cancel_running pair ran", mc
        )
    mrw = report.get("multi_replace_window") or {}
    if mrw:
        window = {**mrw, **{k: v for k, v in mr.items() if k.startswith("window_")}}
        claim(
            bool(mrw.get("handed_on"))
            and mr.get("window_paused_until_the_newer_send_parked", 0) >= 1
            and mr.get("window_superseded", 0) == 1
            and mr.get("window_done_with_a_body", 0) == 1,
            "the reservation window: an older run held a key when a newer send of its set parked on it; "
            "the key went on to the newer send, which ran, and the older run ended superseded",
            window,
        )
    if mrd:
        claim(
            mr.get("debounced_directed_superseded", 0) == DEBOUNCED_BURST - 1
            and mr.get("debounced_directed_done_with_a_body", 0) == 1,
            "the debounced several-keys Replace burst: all but its newest send superseded, the newest ran",
            {k: v for k, v in mr.items() if k.startswith("debounced")},
        )
    mlr, mlrd = report.get("multi_limit_replace") or {}, report.get("multi_limit_replace_directed") or {}
    if mlrd:
        directed = {**mlr, **mlrd}
        claim(
            mlr.get("directed_superseded", 0) == MULTI_LIMIT_REPLACE_BURST - 1
            and mlr.get("directed_done_with_a_body", 0) == 1,
            "the several-keys Replace bursts with a limit: all but each burst's newest send superseded, "
            "the newest ran",
            directed,
        )
        claim(
            mlrd.get("parked_for_a_slot_superseded", 0) == MULTI_LIMIT_REPLACE_BURST - 1,
            "each newer send superseded its set's run parked for a slot",
            directed,
        )
    claim(queued["faults_hitting_queued_runs"] == faults, "every fault with a queued run parked", queued)
    u = report["unique"]
    ud = u["directed"]
    claim(
        ud["sends"] == UNIQUE_BURST and ud["runs"] == 1 and ud["contended"] and ud["ran_a_body"],
        "the unique-send burst: equal sends behind a gate got one run, which found its key held and ran",
        u,
    )
    claim(
        u["faults_with_a_pending_unique_run"] == faults,
        "every fault with a unique send's run pending (its equal sends answered with it)",
        u,
    )
    claim(
        u["sends_that_got_a_pending_run"]
        >= UNIQUE_BURST - 1 + (UNIQUE_GATE_SENDS - 1) * sum(faults.values()),
        "sends answered with a pending run",
        u,
    )
    rt = report.get("rate")
    if rt is not None and report.get("rate_keys"):
        rd = rt["directed"]
        claim(
            rd["sends"] == RATE_BURST
            and rd["parked_before_the_gate_let_go"]
            and rd["parked_then_done"] == RATE_BURST,
            "the rate burst: runs parked by the rate behind the controller's starts, then done",
            rt,
        )
        claim(
            rt["faults_with_a_rate_parked_run"] == faults,
            "every fault with runs parked by the rate (behind the controller's parked runs)",
            rt,
        )
        claim(
            rt["gated"] == RATE_GATE_SENDS * sum(faults.values())
            and rt["gated_parked_then_done"] + rt["gated_lost_by_broker"] == rt["gated"],
            "every fault's rate-parked runs later ran (or the broker's own log proves it lost them)",
            rt,
        )
    claim(tasks.get("died_after_release", 0) >= 1, "a run died after its body released the key", tasks)
    doc = report.get("document")
    if doc is not None and report.get("doc_keys"):
        claim(doc["gate_holds"] >= sum(faults.values()), "every fault with a document lock held", doc)
        claim(
            all(doc["takeover"].values()),
            "a document lock taken over, the stopped holder's write refused",
            doc,
        )
    mx = report.get("mixed_directed")
    if mx:
        slots, single = MIXED_DIRECTED.count(mixed.SLOTS_TASK), MIXED_DIRECTED.count(mixed.SINGLE_TASK)
        claim(
            mx.get("slot_runs_kept_aside") == slots and mx.get("single_runs_parked") == single,
            "the mixed burst: every run of slots kept aside (the key in use as a single lease), every run "
            "of a single lease parked, before the gate let go",
            mx,
        )
        kept = (report.get("mixed") or {}).get("faults_with_a_run_kept_aside") or {}
        claim(
            sum(kept.values()) >= sum(faults.values()),
            "every fault began with a run kept aside as the other kind",
            kept,
        )
    if "clock-jump" not in skipped:
        claim(faults.get("clock-jump", 0) >= 2, "the clock jumped twice", faults)
        gated = sum(faults.values())
        claim(tasks["skewed_node_submitted"] >= gated, "the skewed node's gated runs", tasks)
    return out


# -- the run: servers, clients, workers, faults ----------------------------------------------------------


def _declare_unique_task(app: Any) -> None:
    """The controller's own declaration of ``UNIQUE_TASK`` (the same key, arguments and options as the
    workers' ``lockcheck_app.rmw_unique``), so that its sends go through ``unique_send``."""

    @singleton_task(
        key="{key}", app=app, name=UNIQUE_TASK, bind=True, unique_send=True,
        unique_send_seconds=UNIQUE_SEND_SECONDS,
    )  # fmt: skip
    def rmw_unique(self: Any, key: str, op: str, reckless: bool = False) -> None:
        raise AssertionError("runs in the workers (lockcheck_app.rmw_unique)")


@dataclasses.dataclass
class Config:
    duration: float = 60.0
    seed: int = 0
    clients: int = 3
    nodes: int = 2
    concurrency: int = 2
    keys: int = 3
    #: Keys whose runs are ``Queue`` runs, and keys whose runs are ``Replace`` runs (each key takes one
    #: policy: a ``Replace`` admission keeps one parked run, so it would supersede ``Queue`` runs parked
    #: on the same key). The bare clients take these keys too.
    queue_keys: int = 2
    replace_keys: int = 1
    #: Share of the submitter's sends that are a burst of ``Queue`` runs, and of ``Replace`` runs, on one
    #: key (1 to ``burst`` runs sent back to back: they contend, park, get handed the key, supersede).
    queue_share: float = 0.3
    replace_share: float = 0.2
    burst: int = 3
    #: Keys whose runs are ``limit=N`` runs (N = ``LIMIT``), and the share of sends that are a burst of 2
    #: to N + 1 of them on one key (so that all N slots fill and one more contends); the share of sends
    #: that are a several-keys run on two of the plain keys (in either order, beside single-key runs).
    limit_keys: int = 1
    limit_share: float = 0.12
    #: Keys whose protected document the bare clients lock with a ``DocumentLock`` (``d`` keys).
    doc_keys: int = 2
    multi_share: float = 0.2
    #: Of those, the share that are a burst of ``Queue`` runs instead: N to N + 2 ``limit=N`` runs on one
    #: key (some park and are handed slots), or 2 to 3 several-keys runs on one pair named in either order.
    limit_queue_share: float = 0.5
    multi_queue_share: float = 0.4
    #: Of the several-keys sends, the share that are a burst of 2 to N + 1 runs with a limit per key
    #: (``MULTI_LIMIT_TASK``) on one ``l`` key, each with a ``k`` key drawn at random: they contend on the
    #: slots (with the ``limit=N`` runs and bare clients there) and on the ``k`` keys.
    multi_limit_share: float = 0.3
    #: Of those, the share sent as a reentrant run (``REENTRANT_TASK``) instead (drawn from a generator of
    #: its own, so that a seed's other sends are the ones it made before reentrant runs existed).
    reentrant_share: float = 0.3
    #: Of those bursts, the share sent as several-keys ``Replace`` runs with a limit per key instead
    #: (``MULTI_LIMIT_REPLACE_TASK``; a generator of its own, as for reentrant runs).
    multi_limit_replace_share: float = 0.3
    #: ``m`` keys, whose runs are several-keys ``Replace`` runs (``MULTI_REPLACE_TASK``), and the share of
    #: the several-keys sends that are a burst of 2 to 4 of them on one pair of ``m`` keys (named in either
    #: order), half of the time with a run of an overlapping pair among them. The bare clients take these
    #: keys too.
    multi_replace_keys: int = 3
    multi_replace_share: float = 0.3
    #: Share of the plain single-key sends that are 2 to 4 equal sends of the ``unique_send`` task instead
    #: (drawn from a generator of its own, so that a seed's other sends are unchanged).
    unique_share: float = 0.15
    #: ``t`` keys, whose runs are ``RATE_TASK`` runs (``rate=RateLimit(RATE_N, RATE_PERIOD)``), and the share
    #: of the plain single-key sends that are a burst of 1 to ``RATE_N + 2`` of them on one ``t`` key
    #: instead (more than n at once half of the time; a generator of its own, as for unique sends).
    #: Off (0) in ``make test``'s bounded run, for its time (a seed with it took 287-380 s instead of about
    #: 210). Its first run (stopped, at load average 17-22) reported one ``rate-exceeded``, since explained
    #: and fixed (the window's clock never goes back: CHANGELOG); bounded seeds 1-2 with it on that code:
    #: 143 rate-limited runs under every fault, at most 2 starts in any window of 2 s, no rate violation.
    #: ``soak.py --bounded --rate-keys 2``.
    rate_keys: int = 0
    rate_share: float = 0.3
    #: ``x`` keys, each used both as a single lease and as ``limit=N`` slots (``lockcheck_mixed``), and the
    #: share of the plain single-key sends that are a burst of runs of both kinds on one of them instead
    #: (``Queue``: a run of the kind the key is not in use as is kept aside, back within 5 s; a generator
    #: of its own). The bare clients take these keys too, as either kind.
    mixed_keys: int = 1
    mixed_share: float = 0.4
    epoch_seconds: float = 40.0
    lease_seconds: float = 2.0
    task_rate: float = 1.5
    reckless: float = 0.5
    #: Share of the single-key runs of ``DIE_TASKS`` sent with ``die`` (drawn from a generator of their
    #: own: the rest of a seed's workload is unchanged); every fault's gated ``Queue`` run dies too.
    die_share: float = 0.1
    faults: tuple[str, ...] = ALL_FAULTS
    #: Also run a Celery node (own queue, a quarter of the tasks) under libfaketime whose wall clock jumps
    #: forward (when libfaketime is installed). It must not sweep unacknowledged messages back into the
    #: queues (see SKEWED_VISIBILITY_TIMEOUT).
    skewed_node: bool = True
    #: The first pass injects every fault once; then (soak) random faults until the end.
    repeat_faults: bool = False
    #: Seconds between faults (None: the duration divided evenly among the first pass).
    fault_interval: float | None = None
    warmup: float = 4.0
    drain_timeout: float = 120.0
    workdir: Path | None = None
    #: The broker: "redis" (also the result backend), or "rabbitmq" (durable queues, persistent messages,
    #: publisher confirms, acks_late; results in a Redis of their own, which no fault touches). On RabbitMQ
    #: no loss is excused: the broker has no log to prove one with, and it is not expected to lose any.
    broker: str = "redis"
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True)


class Node:
    """One ``celery -A tests.lockcheck_app worker`` node (prefork), in its own process group."""

    def __init__(
        self, name: str, env: dict[str, str], ready_dir: Path, concurrency: int, queue: str | None
    ) -> None:
        self.name = name
        self.env = env
        self.ready_dir = ready_dir
        self.concurrency = concurrency
        self.queue = queue
        self.log_path = ready_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_s = 0.0
        self._told_to_stop = False

    def start(self, timeout: float = START_GUARD_S) -> Node:
        """Start the node and wait until it is ready or has exited (then raise with its log). Slow is not
        dead: on a loaded machine start-up takes as long as it takes; ``timeout`` only guards against a
        hang and is far beyond any start-up seen (the measured times are in ``Run.start_times``)."""
        marker = self.ready_dir / f"{self.name}.ready"
        t0 = time.monotonic()
        marker.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "celery", "-A", "tests.lockcheck_app", "worker", "--pool=prefork"]
        cmd += [f"--concurrency={self.concurrency}", "-n", self.name, "--loglevel=WARNING"]
        cmd += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
        if self.queue:
            cmd += ["-Q", self.queue]
        self._told_to_stop = False
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        _wait(lambda: self._ready(marker), timeout, f"worker {self.name} to be ready")
        self.start_s = time.monotonic() - t0
        return self

    def _ready(self, marker: Path) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"worker {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
        return marker.exists()

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def child_pids(self) -> list[int]:
        if not self.alive:
            return []
        assert self.proc is not None
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True, check=False)
        return [int(p) for p in out.stdout.split()]

    def kill(self) -> None:
        if self.alive:
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def begin_stop(self) -> None:
        """Tell the node to stop (a warm shutdown), without waiting: several nodes stop side by side."""
        if self.proc is not None and self.proc.poll() is None and not self._told_to_stop:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGCONT)  # nobody stays paused
            self.proc.send_signal(signal.SIGTERM)
            self._told_to_stop = True

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.begin_stop()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        # Children orphaned by a killed parent would keep the process group alive.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def holder_kind(info: Any) -> str:
    """What a held lease (``LeaseInfo`` or ``SlotHold``) is, for picking fault victims: ``queued``,
    ``limit``, ``multi`` (a several-keys run's) or ``plain``."""
    policy = key_policy(info.key)
    if policy in ("queue", "replace"):
        return "queued"
    if policy == "limit":
        return "limit"
    multi = info.holder.get("keys") or info.holder.get("task_name") in MULTI_TASKS
    return "multi" if multi else "plain"


@dataclasses.dataclass(frozen=True)
class SlotHold:
    """One live hold of a ``limit=N`` key, as a fault victim (the fields of ``LeaseInfo`` the faults use)."""

    key: str
    owner: str
    fence: int
    slot: int
    holder: dict[str, Any]
    expires_in: float | None


#: The controller's waits that took longer than ``SLOW_WAIT_S`` (what, seconds, met), for the report: where
#: a bounded run's time goes when it is long (a guard's wait is a condition, not a delay, and its length
#: depends on what the workers were busy with then).
SLOW_WAIT_S = 10.0
slow_waits: list[tuple[str, float, bool]] = []


def _wait(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    t0 = time.monotonic()
    deadline = t0 + timeout
    while True:
        value = predicate()
        if value:
            if time.monotonic() - t0 > SLOW_WAIT_S:
                slow_waits.append((what, round(time.monotonic() - t0, 1), True))
            return value
        if time.monotonic() > deadline:
            slow_waits.append((what, round(time.monotonic() - t0, 1), False))
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


class RateGate:
    """The controller's hold on a ``t`` key's rate: ``RATE_N`` runs of its own parked on the key, sent before
    all others (send stamp 0, runs ``gate-<n>/<i>``), so that every ``RATE_TASK`` run sent to the key has n
    runs ahead of it (``core.documents.rate``: a run takes a start only if the window's starts plus the runs
    parked before it are fewer than n) and stays parked, by construction, until ``stop``, whatever the
    window holds. The gate's runs ask with n = 0 (they are never granted a start: they only keep their
    places) and refresh their places every ``RATE_GATE_INTERVAL`` (a place goes stale one period plus 15 s
    after its last refresh). Its attempts are recorded as the workers' are (``rtake``, who ``GATE``, the
    key's rate as ``n``)."""

    def __init__(self, store: LeaseStore, hist: HistoryWriter, key: str, name: str) -> None:
        self.store, self.hist, self.key = store, hist, key
        self.runs = [f"{name}/{i}" for i in range(RATE_N)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"lockcheck-rate-gate-{key}", daemon=True)
        #: The server's clock at the gate's last look at its window (epoch ms).
        self.last_seen_ms = 0

    def start(self) -> RateGate:
        """Park the gate's runs (waits only for faults to pass: a guard, not a delay); keep them there."""
        for run in self.runs:
            _wait(functools.partial(self._parked, run), START_GUARD_S, f"the rate gate on {self.key}", 0.05)
        self._thread.start()
        return self

    def take(self, run: str) -> bool | None:
        """One command of a gate run: the library's own update (``take_update``) with n = 0, so never
        granted: False (parked, its place kept or refreshed), None (no answer)."""
        period_ms = round(RATE_PERIOD * 1000)
        start_id = uuid.uuid4().hex
        fields: Doc = {"who": GATE, "task_id": None, "run": run, "stamp": 0, "keys": [self.key], "hold": True}
        update = rate_docs.take_update(
            start_id=start_id, run=run, stamp=0, n=0, period_ms=period_ms, park=True,
            stale_ms=period_ms + STALE_AFTER_TURN_MS,
        )  # fmt: skip
        t0 = time.monotonic()
        try:
            doc = rate_windows(self.store).collection.find_one_and_update(
                {"_id": self.key}, update, upsert=True, return_document=ReturnDocument.AFTER
            )
            if doc is None:  # (the embedded server may answer None to an applied upsert: read it back)
                doc = rate_windows(self.store).collection.find_one({"_id": self.key})
        except (MongoLockError, PyMongoError) as exc:
            self.hist.event(
                "rtake", **fields, n=RATE_N, p=period_ms, t0=t0, t=time.monotonic(), error=repr(exc)
            )
            return None
        window = RateWindow.of(self.key, doc)
        self.last_seen_ms = max(self.last_seen_ms, window.now_ms)
        took = RateTake(started=False, start_id=start_id, key=self.key, position=window.position(run))
        record_rate_take(self.hist, took, [window], n=RATE_N, period_ms=period_ms, t0=t0, **fields)
        return False

    def _parked(self, run: str) -> bool:
        return self.take(run) is False

    def _loop(self) -> None:
        while not self._stop.wait(RATE_GATE_INTERVAL):
            for run in self.runs:
                self.take(run)

    def stop(self) -> None:
        """Stop refreshing and take the gate's runs out of the parked ones (the runs behind go on as the
        window allows); a leave that gets no answer is sent again (a guard bounds it; unrefreshed, a place
        goes stale)."""
        self._stop.set()
        self._thread.join(timeout=30.0)
        for run in self.runs:

            def leave(run: str = run) -> bool:
                try:
                    rate_windows(self.store).leave(self.key, run)
                except (MongoLockError, PyMongoError):
                    return False
                return True

            with contextlib.suppress(TimeoutError):
                _wait(leave, 60.0, f"the rate gate on {self.key} to leave", interval=0.2)
            # Its place is gone from some moment after its last look (server's clock): from then on it is
            # not judged as waiting (a grant in between is not judged against it).
            self.hist.event("rleave", key=self.key, run=run, at=self.last_seen_ms, t=time.monotonic())


#: A fault's gates (``Run._fault_gates``): the gated Queue run's, the unique sends', the rate's (None
#: without rate keys), the document lock (None without document keys) and the run kept aside as the other
#: kind (None without ``x`` keys).
FaultGates = tuple[
    "tuple[list[Lease], Doc] | None",
    "tuple[list[Lease], Doc]",
    "tuple[RateGate, Doc] | None",
    "DocumentLease | None",
    "tuple[list[Lease], Doc] | None",
]


class Run:
    """One checker run: set up, inject faults while the workload runs, drain, check."""

    def __init__(self, cfg: Config) -> None:
        from celery import Celery

        from celery_mongolock.embedded import EmbeddedMongo
        from celery_mongolock.testing import RabbitMQServer, RedisServer

        if cfg.broker not in ("redis", "rabbitmq"):
            raise ValueError(f"broker must be 'redis' or 'rabbitmq', got {cfg.broker!r}")
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.die_rng = random.Random(cfg.seed * 7919 + 32)
        self.reentrant_rng = random.Random(cfg.seed * 7919 + 29)
        self.timed_rng = random.Random(cfg.seed * 7919 + 31)
        self.unique_rng = random.Random(cfg.seed * 7919 + 30)
        #: Every send of the ``unique_send`` task: key, op, the task id it got (or ``refused``), when.
        self.unique_sends: list[Doc] = []
        self._unique_gates = 0
        self.rate_rng = random.Random(cfg.seed * 7919 + 33)
        self.link_rng = random.Random(cfg.seed * 7919 + 34)
        self.priority_rng = random.Random(cfg.seed * 7919 + 35)
        self.mixed_rng = random.Random(cfg.seed * 7919 + 36)
        #: What the directed burst on a key used both ways showed (``_mixed_directed``).
        self.mixed_directed: Doc = {}
        self._admits_read: dict[Path, int] = {}
        self._mixed_answers: dict[str, set[str]] = defaultdict(set)
        self._rate_gates = 0
        self._rate_info: Doc | None = None
        #: What the directed rate burst showed (``_rate_directed``).
        self.rate_directed: Doc = {}
        #: The runs parked by the rate so far, by key (``_rate_parked_runs``); where each file was left.
        self._rate_parked: dict[str, set[str]] = defaultdict(set)
        self._rate_read: dict[Path, int] = {}
        #: The random workload's rate bursts: how many runs each sent at once.
        self.rate_bursts: Counter[int] = Counter()
        #: ... and for the several-keys Replace runs with a limit per key (``_multi_limit_replace_sends``).
        self.replace_rng = random.Random(cfg.seed * 7919 + 31)
        self._own_dir = cfg.workdir is None
        self.dir = Path(cfg.workdir or tempfile.mkdtemp(prefix="lockcheck-"))
        self.hist_dir = self.dir / "hist"
        self.hist_dir.mkdir(parents=True, exist_ok=True)
        self.stop_file = self.dir / "stop"
        self.stop_file.unlink(missing_ok=True)
        self.db = f"lockcheck_{uuid.uuid4().hex[:8]}"
        self.log = cfg.log
        self.faketime = faketime_lib() is not None and shutil.which("faketime") is not None
        self.skipped_faults: dict[str, str] = {}
        if not self.faketime:
            self.skipped_faults["clock-jump"] = "libfaketime is not installed (apt-get install faketime)"
        self.server = EmbeddedMongo(
            storage_path=self.dir / "mongo-data",
            enable_test_commands=True,
            extra_args=["--sync-on-commit"],  # a crash must not lose journaled (j: true) writes
            log_path=self.dir / "mongo.log",
        )
        self.redis = RedisServer(persistent=True)
        self.rabbit = RabbitMQServer() if cfg.broker == "rabbitmq" else None
        # Sends the tasks. Without a result backend: with Redis's, every AsyncResult subscribes to its
        # task's channel and unsubscribes in __del__, which raises (unraisable) on a connection that a
        # broker restart broke. Results are read through ``self.results``.
        self.capp = Celery("lockcheck_controller")
        self.results = Celery("lockcheck_results")
        self.clients: list[subprocess.Popen[bytes]] = []
        self.client_names: dict[int, str] = {}
        self.nodes: list[Node] = []
        self.skewed_node: Node | None = None
        self._skewed_backlog = 0  # messages waiting in SKEWED_QUEUE at the submitter's last look
        self.node_seq = 0
        self.faults: list[Doc] = []
        self.submitted: dict[str, Doc] = {}
        self.start_mono = 0.0
        self._stop = threading.Event()
        self._clock_offsets = {"client": 0, "node": 0}
        self._parked_before = 0
        self._gate_info: Doc | None = None
        self._unique_info: Doc | None = None
        self.unique_directed: Doc = {}
        self.capped_directed: Doc = {}
        self.limits_capped_directed: Doc = {}
        self._gates = 0
        self._doc_gates = 0
        self._mixed_gates = 0
        self._mixed_info: Doc | None = None
        self._lingers = 0
        self._gate_hist: HistoryWriter | None = None
        #: The ``tcont`` events read so far (``_contended_runs``): task ids by key; where each file was left.
        self._tcont: dict[str, set[str]] = defaultdict(set)
        self._tcont_read: dict[Path, int] = {}
        #: What the several-keys Replace burst of the directed phase showed (``_multi_replace_directed``).
        self.multi_replace_directed: Doc = {}
        #: What the directed reservation window showed (``_reservation_window``).
        self.multi_replace_window: Doc = {}
        #: ... and its bursts with a limit per key (``_multi_limit_replace_directed``).
        self.multi_limit_replace_directed: Doc = {}
        #: The run of several keys held back behind the limit burst's spilled runs (``_held_back_send``).
        self.held_back_directed: Doc = {}
        #: The other keys of a directed burst of runs of several keys, by its gated key (``_burst``).
        self.burst_keys: dict[str, list[str]] = {}
        self.directed_s = 0.0
        self.directed_steps: dict[str, float] = {}
        # The lingering holders of the directed cancel_running steps (``_cancel_directed_again``).
        self.cancel_lingering: str | None = None
        self.cancel_deaf: str | None = None
        self.multi_cancel_lingering: str | None = None
        self.store: LeaseStore | None = None
        #: Nodes are started, killed and replaced under this lock (fault thread and supervisor).
        self._nodes_lock = threading.RLock()
        self._supervisor_stop = threading.Event()
        #: Worker nodes that exited on their own and were replaced, as systemd would (not faults).
        self.node_exits: list[Doc] = []
        #: Worker nodes that consumed nothing while their queue had messages ready, killed and replaced.
        self.node_stalls: list[Doc] = []
        self.stall_watch = nodewatch.StallWatch(self.hist_dir, self._stall_allowance)
        self._stall_look = 0.0
        #: Measured start-up times of every node started (seconds): the drain's patience scales with them.
        self.start_times: list[float] = []
        self._marks_stop = threading.Event()
        self._marks: threading.Thread | None = None
        self.drain_s = 0.0

    # -- set-up ------------------------------------------------------------------------------------------
    def setup(self) -> None:
        self.server.start()
        self.redis.start()
        if self.rabbit is not None:
            self.rabbit.start()
        self._marks = threading.Thread(target=self._clock_marks, name="lockcheck-clock-marks", daemon=True)
        self._marks.start()
        self.capp.conf.update(
            broker_url=self.broker_url,
            broker_transport_options=self._confirms(),
            mongolock_url=self.server.url,
            mongolock_database=self.db,
            mongolock_operation_timeout=5.0,
        )
        _declare_unique_task(self.capp)
        self.results.conf.update(
            broker_url=self.broker_url,
            broker_transport_options=self._confirms(),
            result_backend=self.redis.url,
        )
        self.store = LeaseStore(self.server.url, database=self.db, lease_seconds=30, operation_timeout=3.0)
        record_releases_handoffs(self.store, self._gate_history())
        self.store.ensure_indexes()
        self.start_mono = time.monotonic()
        for i in range(self.cfg.clients):
            self._start_client(i, skewed=(i == 0 and self.faketime))
        for _ in range(self.cfg.nodes):
            self._start_node()
        if self.faketime and self.cfg.skewed_node:
            ts = self.dir / "clock-node.offset"
            write_offset(ts, "+0")
            env = {
                **self._node_env(),
                **faketime_env(ts),
                "LOCKCHECK_VISIBILITY_TIMEOUT": str(SKEWED_VISIBILITY_TIMEOUT),
            }
            self.skewed_node = Node("skewed@lockcheck", env, self.dir, 1, SKEWED_QUEUE).start()
            self.start_times.append(self.skewed_node.start_s)

    @property
    def broker_url(self) -> str:
        """The broker's URL: RabbitMQ's, or Redis's (then also the result backend)."""
        return self.rabbit.url if self.rabbit is not None else self.redis.url

    def _confirms(self) -> dict[str, Any]:
        """On RabbitMQ, publisher confirms: a send returns once the broker has the message (else it raises
        and is retried); without them a message sent just before a broker crash can vanish unseen."""
        return {"confirm_publish": True} if self.rabbit is not None else {}

    def supervise(self) -> None:
        """Replace a worker node that exited without being told to, as ``systemd`` (``Restart=always``) or
        Kubernetes would, and record it. Celery 5.7.0 workers exit with "Unrecoverable error" when the
        Redis broker goes away (``broker-restart``); the lock must stay safe across that too."""
        while not self._supervisor_stop.wait(0.5):
            with self._nodes_lock:
                for node in [*self.nodes, *([self.skewed_node] if self.skewed_node else [])]:
                    if node.proc is None or node.proc.poll() is None:
                        continue
                    t = time.monotonic()
                    try:
                        lines = node.log_path.read_text(errors="replace").splitlines()
                    except OSError:
                        lines = []
                    last = [line for line in lines if "CRITICAL" in line]
                    exit_info = {
                        "node": node.name, "t": t, "at_s": round(t - self.start_mono, 2),
                        "returncode": node.proc.returncode, "last_error": last[-1][-300:] if last else None,
                    }  # fmt: skip
                    self.node_exits.append(exit_info)
                    self.log(f"[{exit_info['at_s']:7.2f}s] node {node.name} exited on its own: {exit_info}")
                    node.stop()
                    self._replace_node(node)
                self._watch_stalls()

    def _replace_node(self, node: Node) -> None:
        """Start a node in place of ``node`` (stopped): the skewed node on its own queue, else a new one."""
        try:
            if node is self.skewed_node:
                self.skewed_node = Node(node.name, node.env, self.dir, 1, SKEWED_QUEUE).start()
                self.start_times.append(self.skewed_node.start_s)
            else:
                self.nodes.remove(node)
                self._start_node()
        except Exception as exc:  # e.g. the broker is still down: try again next round
            self.log(f"could not replace node {node.name}: {exc!r}")

    def _watch_stalls(self) -> None:
        """Replace a node that consumes nothing while its queue has messages ready, and record it as a
        finding (``node_stalls``; tests/nodewatch.py says how progress is judged)."""
        now = time.monotonic()
        if now - self._stall_look < STALL_LOOK_S:
            return
        self._stall_look = now
        ready = self._ready_counts()
        for node in [*self.nodes, *([self.skewed_node] if self.skewed_node else [])]:
            if not node.alive or node.proc is None:
                continue
            queue = node.queue or "celery"
            finding = self.stall_watch.observe(
                node.name, [node.proc.pid, *node.child_pids()], queue, ready.get(queue)
            )
            if finding is not None:
                self._stalled(node, finding)

    def _ready_counts(self) -> dict[str, int | None]:
        """The messages ready (not delivered) in each worker queue now (None: the broker did not answer)."""
        counts: dict[str, int | None] = dict.fromkeys(("celery", SKEWED_QUEUE))
        for queue in counts:
            with contextlib.suppress(Exception):
                counts[queue] = broker_ready(self.broker_url, queue)
        return counts

    def _stalled(self, node: Node, finding: Doc) -> None:
        """Record a stalled node (its processes' states and its own thread dump: Celery logs every thread's
        stack on SIGUSR1), kill it (its unacknowledged messages go back to the queue) and replace it."""
        assert node.proc is not None
        t = time.monotonic()
        finding.update(t=t, at_s=round(t - self.start_mono, 2), states=nodewatch.process_states(
            [node.proc.pid, *finding["children"]]))  # fmt: skip
        size = node.log_path.stat().st_size if node.log_path.exists() else 0
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.proc.pid, signal.SIGUSR1)
        with contextlib.suppress(TimeoutError):  # the dump is evidence, not a condition of the kill
            _wait(lambda: "MainThread" in node.log_tail() and node.log_path.stat().st_size > size, 10, "dump")
        with contextlib.suppress(OSError), open(node.log_path, errors="replace") as log:
            log.seek(size)
            finding["dump"] = log.read()[-6000:]
        self.node_stalls.append(finding)
        brief = {k: v for k, v in finding.items() if k != "dump"}
        self.log(f"[{finding['at_s']:7.2f}s] node {node.name} stalled: {brief}")
        with self._nodes_lock:
            current = node is self.skewed_node or node in self.nodes  # (not replaced meanwhile)
            node.kill()
            node.stop()
            self.stall_watch.forget(finding["pid"])
            if current:
                self._replace_node(node)

    def _start_client(self, i: int, *, skewed: bool) -> None:
        name = f"client{i}" + ("-skewed" if skewed else "")
        cfg = {
            "name": name, "seed": self.cfg.seed * 1000 + i, "url": self.server.url, "db": self.db,
            "ttl": self.cfg.lease_seconds, "keys": self.cfg.keys, "epoch_seconds": self.cfg.epoch_seconds,
            "start": self.start_mono, "stop_file": str(self.stop_file), "hist_dir": str(self.hist_dir),
            "reckless": self.cfg.reckless, "queue_keys": self.cfg.queue_keys,
            "replace_keys": self.cfg.replace_keys, "limit_keys": self.cfg.limit_keys,
            "doc_keys": self.cfg.doc_keys, "mixed_keys": self.cfg.mixed_keys,
        }  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if skewed:
            ts = self.dir / "clock-client.offset"
            write_offset(ts, "+0")
            env.update(faketime_env(ts))
        with open(self.dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.lockcheck", "client", json.dumps(cfg)],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        self.clients.append(proc)
        self.client_names[proc.pid] = name

    def _node_env(self) -> dict[str, str]:
        return {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "LOCKCHECK_BROKER": self.broker_url,
            "LOCKCHECK_BACKEND": self.redis.url,
            "LOCKCHECK_MONGODB_URL": self.server.url,
            "LOCKCHECK_DB": self.db,
            "LOCKCHECK_LEASE": str(self.cfg.lease_seconds),
            "LOCKCHECK_READY_DIR": str(self.dir),
            "LOCKCHECK_HIST_DIR": str(self.hist_dir),
        }

    def _start_node(self) -> Node:
        self.node_seq += 1
        node = Node(f"n{self.node_seq}@lockcheck", self._node_env(), self.dir, self.cfg.concurrency, None)
        self.nodes.append(node)
        node.start()
        self.start_times.append(node.start_s)
        return node

    # -- the workload ------------------------------------------------------------------------------------
    def _submitter(self) -> None:
        n = 0
        interval = 1.0 / self.cfg.task_rate
        while not self._stop.wait(interval * (0.5 + self.rng.random())):
            while self._backlog() > MAX_BACKLOG and not self._stop.wait(0.2):
                pass  # the workers catch up first (see MAX_BACKLOG)
            epoch = current_epoch(self.start_mono, self.cfg.epoch_seconds)
            pick = self.rng.random()
            if pick < self.cfg.queue_share and self.cfg.queue_keys:
                key = key_for(self.rng.randrange(self.cfg.queue_keys), epoch, "q")
                names = [QUEUE_TASK] * self.rng.randint(1, self.cfg.burst)
            elif pick < self.cfg.queue_share + self.cfg.replace_share and self.cfg.replace_keys:
                key = key_for(self.rng.randrange(self.cfg.replace_keys), epoch, "r")
                # (half the bursts with cancel_running: a newer send also stops the running holder)
                name = REPLACE_CANCEL_TASK if self.rng.random() < 0.5 else REPLACE_TASK
                names = [name] * self.rng.randint(1, self.cfg.burst)
            elif pick < self.cfg.queue_share + self.cfg.replace_share + self.cfg.limit_share and (
                self.cfg.limit_keys
            ):
                key = key_for(self.rng.randrange(self.cfg.limit_keys), epoch, "l")
                if self.rng.random() < self.cfg.limit_queue_share:
                    # A burst of Queue runs: N take the slots, the rest park and are handed slots.
                    # (half of them with a minimum hold: a slot released early stays taken until then)
                    name = MIN_HOLD_TASK if self.rng.random() < 0.5 else LIMIT_QUEUE_TASK
                    names = [name] * self.rng.randint(LIMIT, LIMIT + 2)
                else:
                    names = [
                        LIMIT_TASKS[1] if self.rng.random() < 0.2 else LIMIT_TASKS[0]
                        for _ in range(self.rng.randint(2, LIMIT + 1))
                    ]
            elif (
                pick
                < self.cfg.queue_share + self.cfg.replace_share + self.cfg.limit_share + self.cfg.multi_share
                and self.cfg.keys > 1
            ):
                a, b = self.rng.sample(range(self.cfg.keys), 2)  # both orders over the run
                if self.cfg.multi_replace_keys > 2 and self.rng.random() < self.cfg.multi_replace_share:
                    n = self._multi_replace_sends(n, epoch)
                    continue
                if self.cfg.limit_keys and self.rng.random() < self.cfg.multi_limit_share:
                    # A slot of one l key and a k key each: more runs than slots, some on one k key.
                    slotted = key_for(self.rng.randrange(self.cfg.limit_keys), epoch, "l")
                    if self.replace_rng.random() < self.cfg.multi_limit_replace_share:
                        n = self._multi_limit_replace_sends(n, epoch, slotted)
                        continue
                    # (half the bursts under Queue: parked on each key, the slot or key got kept reserved)
                    name = MULTI_LIMIT_QUEUE_TASK if self.rng.random() < 0.5 else MULTI_LIMIT_TASK
                    for _ in range(self.rng.randint(2, LIMIT + 1)):
                        n += 1
                        single = key_for(self.rng.randrange(self.cfg.keys), epoch)
                        reentrant = self.reentrant_rng.random() < self.cfg.reentrant_share
                        task = REENTRANT_TASK if reentrant and name == MULTI_LIMIT_TASK else name
                        self._submit(task, "", f"task-{n}", keys=(slotted, single))
                    continue
                if self.rng.random() < self.cfg.multi_queue_share:
                    # A burst of Queue runs on one pair, each naming it in either order: they park on
                    # each other's keys and keep their places.
                    for _ in range(self.rng.randint(2, 3)):
                        n += 1
                        pair = (a, b) if self.rng.random() < 0.5 else (b, a)
                        keys = (key_for(pair[0], epoch), key_for(pair[1], epoch))
                        # (its own draws: a seed's other runs stay as they were)
                        name = MULTI_TIMED_TASK if self.timed_rng.random() < TIMED_SHARE else MULTI_QUEUE_TASK
                        self._submit(name, "", f"task-{n}", keys=keys)
                    continue
                n += 1
                name = MULTI_TASKS[1] if self.rng.random() < 0.2 else MULTI_TASKS[0]
                self._submit(name, "", f"task-{n}", keys=(key_for(a, epoch), key_for(b, epoch)))
                continue
            else:
                key = key_for(self.rng.randrange(self.cfg.keys), epoch)
                names = ["lockcheck.rmw_skip" if self.rng.random() < 0.2 else "lockcheck.rmw"]
                if self.unique_rng.random() < self.cfg.unique_share:
                    n += 1
                    self._submit_unique(key, f"task-{n}", self.unique_rng.randint(2, 4))
                    continue
                if self.cfg.mixed_keys and self.mixed_rng.random() < self.cfg.mixed_share:
                    # A burst on an x key, runs of both kinds: one kind takes it, the other is kept aside.
                    used = key_for(self.mixed_rng.randrange(self.cfg.mixed_keys), epoch, mixed.KIND)
                    for _ in range(self.mixed_rng.randint(*mixed.BURST)):
                        n += 1
                        self._submit(self.mixed_rng.choice(mixed.TASKS), used, f"task-{n}")
                    continue
                if self.cfg.rate_keys and self.rate_rng.random() < self.cfg.rate_share:
                    # A burst of rate-limited runs on a t key: more than n at once half of the time.
                    rated = key_for(self.rate_rng.randrange(self.cfg.rate_keys), epoch, "t")
                    size = self.rate_rng.randint(1, RATE_N + 2)
                    self.rate_bursts[size] += 1
                    # (half the bursts under Queue(): parked on the key first, then in the window)
                    name = RATE_QUEUE_TASK if self.rate_rng.random() < 0.5 else RATE_TASK
                    for _ in range(size):
                        n += 1
                        self._submit(name, rated, f"task-{n}")
                    continue
            for name in names:
                n += 1
                die = name in DIE_TASKS and self.die_rng.random() < self.cfg.die_share
                link = name == REPLACE_TASK and self.link_rng.random() < LINK_SHARE
                self._submit(name, key, f"task-{n}", die=die, link=link)

    def _backlog(self) -> int:
        """Messages waiting in the broker's queues; 0 when it does not answer (a broker restart: the
        submitter's own sends wait for it anyway)."""
        counts = dict.fromkeys(["celery", *([SKEWED_QUEUE] if self.skewed_node is not None else [])], 0)
        for queue in counts:
            # One connection per queue: a queue that does not exist (Redis: an empty list) is an error,
            # and on AMQP an error closes the channel.
            with contextlib.suppress(Exception), self.capp.connection_for_write() as conn:
                declared = conn.default_channel.queue_declare(queue=queue, passive=True)
                counts[queue] = int(declared.message_count)
        self._skewed_backlog = counts.get(SKEWED_QUEUE, 0)
        return sum(counts.values())

    def _submit(
        self,
        name: str,
        key: str,
        op: str,
        keys: tuple[str, ...] | None = None,
        *,
        queue: str | None = None,
        linger: str | None = None,
        die: bool = False,
        deaf: bool = False,
        link: bool = False,
        priority: int | None = None,
        task_id: str | None = None,
    ) -> str | None:
        """Send one task (to ``queue``, else to the skewed node's queue a quarter of the time while it has
        fewer than ``SKEWED_MAX_BACKLOG`` waiting; ``linger``: see ``_lingering``; ``die``: see
        ``DIE_TASKS``; ``priority``: Celery's, else one drawn for a random send of ``PRIORITY_TASKS``); its
        id, or None if it could not be sent."""
        random_send = queue is None  # (a directed send names its queue)
        if queue is None:
            skewed = self.rng.random() < 0.25 and self._skewed_backlog < SKEWED_MAX_BACKLOG
            queue = SKEWED_QUEUE if self.skewed_node is not None and skewed else "celery"
        reckless = self.rng.random() < self.cfg.reckless
        # The send stamp the library orders queued runs by (its before_task_publish receiver would add
        # the same header; taken here so that the checker knows it).
        stamp = send_stamp()
        t_sent = time.monotonic()  # before the message exists: every receipt of it comes later
        kwargs: Doc = {"reckless": reckless, **({"linger": linger} if linger else {})}
        if die:
            kwargs["die"] = True
        if deaf:
            kwargs["deaf"] = True
        options: Doc = {}
        rank = 0
        if (
            random_send
            and priority is None
            and name in PRIORITY_TASKS
            and self.priority_rng.random() < PRIORITY_SHARE
        ):
            priority = self.priority_rng.choice(PRIORITIES)
        if priority is not None:
            options["priority"] = priority
            # Its place on its keys, as the library ranks it: Redis serves a lower number first.
            rank = priority if self.cfg.broker == "redis" else -priority
        if task_id is not None:
            options["task_id"] = task_id
        if link:  # (its callback names it: its task id is chosen here)
            options["task_id"] = options.get("task_id") or str(uuid.uuid4())
            options["link"] = self.capp.signature("lockcheck.linked", args=(options["task_id"],))
        try:
            result = self.capp.send_task(
                name, args=(*(keys or (key,)), op), kwargs=kwargs, queue=queue,
                headers={SENT_HEADER: stamp},
                retry=True, retry_policy=REPUBLISH_RETRY_POLICY,  # rides over a broker restart
                **options,
            )  # fmt: skip
        except Exception as exc:  # never let the submitter die silently
            self.log(f"submit failed: {exc!r}")
            return None
        at_s = round(time.monotonic() - self.start_mono, 2)
        self.submitted[result.id] = {
            "op": op, "task": name, "queue": queue, "at_s": at_s, "t": t_sent, "key": key, "stamp": stamp,
            **({"keys": list(keys)} if keys else {}), **({"die": True} if die else {}),
            **({"link": True} if link else {}),
            **({"priority": options["priority"], "rank": rank} if "priority" in options else {}),
        }  # fmt: skip
        return str(result.id)

    def _submit_unique(self, key: str, op: str, count: int) -> list[str]:
        """``count`` equal sends of the ``unique_send`` task through its ``apply_async`` (to the plain
        queue: the skewed node's clock is not comparable); the task ids they got. A send MongoDB could not
        check is refused (``StoreUnavailable``): recorded, not retried (the producer knows)."""
        task = self.capp.tasks[UNIQUE_TASK]
        reckless = self.unique_rng.random() < self.cfg.reckless
        ids = []
        for _ in range(count):
            t0 = time.monotonic()
            try:
                result = task.apply_async(
                    (key, op), {"reckless": reckless}, queue="celery",
                    retry=True, retry_policy=REPUBLISH_RETRY_POLICY,
                )  # fmt: skip
            except StoreUnavailable as exc:
                self.unique_sends.append(
                    {"key": key, "op": op, "t0": t0, "t1": time.monotonic(), "refused": 1}
                )
                self.log(f"unique send refused: {exc}")
                continue
            except Exception as exc:  # never let the submitter die silently
                self.log(f"unique send failed: {exc!r}")
                continue
            t1, task_id = time.monotonic(), str(result.id)
            self.unique_sends.append({"key": key, "op": op, "id": task_id, "t0": t0, "t1": t1})
            if task_id not in self.submitted:
                self.submitted[task_id] = {
                    "op": op, "task": UNIQUE_TASK, "queue": "celery", "at_s": round(t0 - self.start_mono, 2),
                    "t": t0, "key": key, "stamp": send_stamp(),
                }  # fmt: skip
            ids.append(task_id)
        return ids

    def _unique_pending(self, n: int, sends: int) -> tuple[list[Lease], Doc]:
        """A gate on a plain key of its own (``FAULT_GATE_KEYS + n`` past the directed keys) and ``sends``
        equal unique sends behind it: they get one run, which the controller waits to see contend (so it is
        pending, in contention retries, until the gate lets go)."""
        key = key_for(n, current_epoch(self.start_mono, self.cfg.epoch_seconds))
        gate = self._gate_take(key)
        ids = self._submit_unique(key, f"unique-{n}", sends)
        info: Doc = {"key": key, "sends": sends, "runs": sorted(set(ids)), "contended": False}
        if ids:
            with contextlib.suppress(TimeoutError):
                info["contended"] = bool(
                    _wait(lambda: set(ids) <= self._contended_runs(key), START_GUARD_S, f"{key} held", 0.1)
                )
        return gate, info

    # -- contention by construction: the controller's gates ----------------------------------------------
    def _gate_take(self, key: str, slots: int = 1) -> list[Lease]:
        """The controller takes ``key`` (``slots`` slots of a ``limit=N`` key) as a bare client does:
        acquire (heartbeat on), record, claim the protected document; no writes. The key is one of its
        own (nobody else takes it), so it is free; waits only for faults to pass (a guard, not a delay)."""
        assert self.store is not None
        store = self.store
        hist = self._gate_history()
        docs = docs_collection(self.server.url, self.db)
        limit = LIMIT if key_policy(key) == "limit" else None
        leases: list[Lease] = []
        for _ in range(slots):

            def take() -> tuple[Lease, float, float] | None:
                t0 = time.monotonic()
                try:
                    lease = store.acquire(key, ttl=30.0, heartbeat=True, info={"who": GATE}, limit=limit)
                except MongoLockError:
                    return None
                return (lease, t0, time.monotonic()) if lease is not None else None

            lease, t0, t1 = _wait(take, START_GUARD_S, f"the gate on {key}", interval=0.1)
            hist.event(
                "acq", key=key, hold=lease.owner, fence=lease.fence, t0=t0, t1=t1, who=GATE,
                **({} if lease.slot is None else {"slot": lease.slot}),
            )  # fmt: skip
            hold = run_hold if lease.slot is None else run_slot_hold
            hold(lease, docs, hist, [], self.rng, reckless=False, who=GATE)
            leases.append(lease)
        return leases

    def _gate_history(self) -> HistoryWriter:
        """The gates' history file, in this run's directory (``HistoryWriter.for_process`` keeps one file
        per process: ``scripts/soak.py --seeds`` runs several seeds in one process)."""
        if self._gate_hist is None:
            self._gate_hist = HistoryWriter(self.hist_dir / f"hist-{os.getpid()}-{GATE}.jsonl")
        return self._gate_hist

    def _gate_release(self, leases: Sequence[Lease]) -> None:
        """Let go of a gate (handing the key or the slots to the oldest parked runs, in the same command);
        a release that gets no answer (a fault) is sent again until one comes (a guard bounds it)."""
        hist = self._gate_history()
        for lease in leases:
            released, t, error = _wait(
                functools.partial(self._release_once, lease, time.monotonic() + 60.0),
                START_GUARD_S, f"the release of {lease.key}", interval=0.2,
            )  # fmt: skip
            hist.event("rel", key=lease.key, hold=lease.owner, released=released, t=t, error=error, who=GATE)

    @staticmethod
    def _release_once(lease: Lease, give_up: float) -> tuple[bool, float, str | None] | None:
        """One release of ``lease``: (matched, sent at, error); None to try again (no answer yet)."""
        t = time.monotonic()
        try:
            return lease.release(), t, None
        except MongoLockError as exc:
            return None if time.monotonic() < give_up else (False, t, type(exc).__name__)

    def _waiting_on(self, key: str) -> set[str]:
        """The task ids parked on ``key`` (``q``), superseded and not yet ended there (``sup``), or handed it
        and not yet claimed (``ho``, a slot's ``ho``)."""
        assert self.store is not None
        try:
            doc = self.store.collection.find_one(
                {"_id": key}, {"q.t": 1, "sup.t": 1, "ho.t": 1, "hs.ho.t": 1}
            )
        except PyMongoError:
            return set()
        doc = doc or {}
        ids = {str(e.get("t")) for e in [*(doc.get("q") or []), *(doc.get("sup") or [])]}
        ids |= {str(ho.get("t")) for ho in [doc.get("ho"), *[h.get("ho") for h in doc.get("hs") or []]] if ho}
        return ids | {str(e.get("t")) for e in self._spilled(key)}

    def _spilled(self, key: str | None = None) -> list[dict[str, Any]]:
        """The entries of runs spilled beyond their key's window (``documents.spill``): of ``key``, or of
        every key."""
        assert self.store is not None
        match: dict[str, Any] = {"x": {"$ne": True}}
        if key is not None:
            match["k"] = key
        with contextlib.suppress(PyMongoError):
            return [{**d["e"], "k": d["k"]} for d in self.store.spill.collection.find(match, {"e.m": 0})]
        return []

    def _ended(self, task_ids: Iterable[str]) -> set[str]:
        """Those of ``task_ids`` whose result is stored (SUCCESS or FAILURE)."""
        out = set()
        for task_id in task_ids:
            with contextlib.suppress(Exception):
                if self.results.backend.get_task_meta(task_id)["status"] in ("SUCCESS", "FAILURE"):
                    out.add(task_id)
        return out

    def _burst(self, kind: str, n: int) -> tuple[str, list[Lease], list[str]]:
        """A gate on the directed key of ``kind`` and ``n`` runs sent behind it; (a key, gate, task ids)."""
        epoch = current_epoch(self.start_mono, self.cfg.epoch_seconds)
        if kind == "multi-limit-queued":
            slotted, single = key_for(DIRECTED_KEY + 3, epoch, "l"), key_for(DIRECTED_KEY + 3, epoch)
            gate = self._gate_take(slotted, slots=LIMIT)
            ids = [
                self._submit(MULTI_LIMIT_QUEUE_TASK, "", f"directed-mlq-{i}", keys=(slotted, single))
                for i in range(n)
            ]
            self.burst_keys[slotted] = [single]
            return slotted, gate, [t for t in ids if t]
        if kind == "multi":
            a, b = key_for(DIRECTED_KEY, epoch), key_for(DIRECTED_KEY + 1, epoch)
            gate = self._gate_take(a)
            ids = [
                self._submit(MULTI_QUEUE_TASK, "", f"directed-multi-{i}", keys=(a, b) if i % 2 else (b, a))
                for i in range(n)
            ]
            self.burst_keys[a] = [b]
            return a, gate, [t for t in ids if t]
        letter, name = {
            "queue": ("q", QUEUE_TASK),
            "replace": ("r", REPLACE_TASK),
            "limit-held": ("l", MIN_HOLD_TASK),
        }.get(kind, ("l", LIMIT_QUEUE_TASK))
        key = key_for(DIRECTED_KEY + (2 if kind == "limit-held" else 0), epoch, letter)
        gate = self._gate_take(key, slots=LIMIT if letter == "l" else 1)
        # The Queue burst: its last run is sent with the highest priority, the others with the lowest (as
        # the broker means them), so it is handed the key first once the gate lets go.
        low, high = (9, 0) if self.cfg.broker == "redis" else (0, 9)
        ids = [
            self._submit(
                name,
                key,
                f"directed-{kind}-{i}",
                queue="celery",
                priority=(high if i == n - 1 else low) if kind == "queue" else None,
            )
            for i in range(n)
        ]
        sent = [t for t in ids if t]
        if kind == "limit" and self.cfg.keys > 1:
            sent += self._held_back_send(key, sent)
        return key, gate, sent

    def _held_back_send(self, key: str, ids: list[str]) -> list[str]:
        """Once every run of the limit burst waits on its ``l`` key (the gate holds all N slots: all but
        ``PARKED_WINDOW`` of them spilled beyond the window), one run of ``MULTI_LIMIT_QUEUE_TASK`` on that
        key and a ``k`` key of its own: a run of several keys takes its keys one at a time and reaches the
        ``l`` key behind the burst's spilled runs, so it is spilled too, and gets a slot after them (the
        send-order check judges it with them). (Before the runs of several keys took their keys one at a
        time, it parked in the window and was held back: ``integration.lanes.held_back``.) By
        construction, not timing: it is sent only after the burst waits, and its place is read while the
        gate holds. Returns its task id (none if it could not be sent)."""
        epoch = current_epoch(self.start_mono, self.cfg.epoch_seconds)
        single = key_for(DIRECTED_KEY + 8, epoch)
        try:
            _wait(
                lambda: set(ids) <= self._waiting_on(key), START_GUARD_S, f"the burst on {key} to wait", 0.2
            )
        except TimeoutError as exc:
            self.log(f"directed phase: {exc}")
            return []
        # (to the burst's queue with no priority, as the burst's runs: a random send may draw a priority,
        # whose runs have a lane of their own and park in the window: CI, both brokers, stop 56)
        tid = self._submit(
            MULTI_LIMIT_QUEUE_TASK, "", "directed-held-back", keys=(key, single), queue="celery"
        )
        if tid is None:
            return []
        try:
            _wait(lambda: tid in self._waiting_on(key), START_GUARD_S, f"{tid} to wait on {key}", 0.2)
        except TimeoutError as exc:
            self.log(f"directed phase: {exc}")
            return [tid]
        spilled = [e for e in self._spilled(key) if e.get("t") in ids]
        behind = tid in {str(e.get("t")) for e in self._spilled(key)}
        self.held_back_directed = {"run": tid, "spilled_older_runs": len(spilled), "spilled_behind": behind}
        return [tid]

    def directed(self) -> None:
        """Before the faults: every kind of queued run parks, is handed its key (slot, both keys), and runs
        to the end. A gate holds each directed key until the lease document shows the whole burst waiting
        there (``Replace``: parked or superseded), then lets go; then every run of the bursts must end."""
        t0 = time.monotonic()
        plan = []
        if self.cfg.queue_keys:
            plan.append(("queue", QUEUE_BURST))
        if self.cfg.replace_keys:
            plan.append(("replace", REPLACE_BURST))
        if self.cfg.limit_keys:
            plan.append(("limit", LIMIT_BURST))
            plan.append(("limit-held", MIN_HOLD_BURST))
            if self.cfg.keys > 1:
                plan.append(("multi-limit-queued", MULTI_LIMIT_QUEUE_BURST))
        if self.cfg.keys > 1:
            plan.append(("multi", MULTI_BURST))
        if self.cfg.doc_keys:
            self._document_takeover()
        step = self._directed_step
        bursts = step("gated bursts sent", lambda: [self._burst(kind, n) for kind, n in plan])
        # Equal unique sends behind a gate: one run, seen contending (pending) before the gate lets go.
        unique_gate, self.unique_directed = step(
            "unique", self._unique_pending, DIRECTED_KEY + 5, UNIQUE_BURST
        )
        staged = step("multi-limit burst", self._multi_limit_burst) if self.cfg.limit_keys else None
        reentrant = step("reentrant", self._reentrant_burst) if self.cfg.limit_keys else []
        t_bursts = time.monotonic()
        for key, gate, ids in bursts:

            def waiting(key: str = key, ids: list[str] = ids) -> bool:
                # A Replace run superseded by a newer send may have ended already: it waited there too. A
                # run of several keys waits on one of them at a time: the first it has not got (the others
                # of its burst wait behind the one that reserved it).
                on = set().union(*(self._waiting_on(k) for k in [key, *self.burst_keys.get(key, [])]))
                return set(ids) <= on | self._ended(ids)

            try:
                _wait(waiting, START_GUARD_S, f"the burst on {key} to wait behind the gate", interval=0.2)
            except TimeoutError as exc:
                self.log(f"directed phase: {exc}")
            self._gate_release(gate)
        self._gate_release(unique_gate)
        self.directed_steps["gated bursts waited"] = round(time.monotonic() - t_bursts, 1)
        if self.cfg.rate_keys:
            bursts.append(("", [], step("rate", self._rate_directed)))
        if staged is not None:
            step("multi-limit stages", self._multi_limit_stages, *staged)
            bursts.append(("", [], staged[3]))
        bursts.append(("", [], reentrant))
        bursts.append(("", [], self.unique_directed["runs"]))
        if self.cfg.multi_replace_keys > 2:
            bursts.append(("", [], step("multi-replace", self._multi_replace_directed)))
            bursts.append(("", [], step("reservation window", self._reservation_window)))
            bursts.append(("", [], step("debounced", self._debounced_directed)))
            bursts.append(("", [], step("capped", self._capped_directed)))
        if self.cfg.replace_keys:
            bursts.append(("", [], step("cancel", self._cancel_directed)))
        if self.cfg.multi_replace_keys > 2:
            bursts.append(("", [], step("multi-cancel", self._multi_cancel_directed)))
        if self.cfg.mixed_keys:
            bursts.append(("", [], step("mixed", self._mixed_directed)))
        if self.cfg.limit_keys and self.cfg.keys > 1:
            bursts.append(("", [], step("multi-limit-replace", self._multi_limit_replace_directed)))
            bursts.append(("", [], step("capped limits", self._capped_directed, MULTI_LIMITS_CAPPED_TASK)))
        everyone = [t for _k, _g, ids in bursts for t in ids]
        t_end = time.monotonic()
        try:
            _wait(
                lambda: len(self._ended(everyone)) == len(everyone), START_GUARD_S, "the bursts to end", 0.5
            )
        except TimeoutError as exc:
            self.log(f"directed phase: {exc} ({len(everyone) - len(self._ended(everyone))} unfinished)")
        self.directed_steps["the bursts to end"] = round(time.monotonic() - t_end, 1)
        step("cancel again", self._cancel_directed_again)
        self.directed_s = round(time.monotonic() - t0, 1)
        self.log(
            f"directed phase: {len(everyone)} runs waited behind gates and ended in {self.directed_s}s "
            f"(by step: {', '.join(f'{k} {v}s' for k, v in self.directed_steps.items())})"
        )

    def _directed_step(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, its time kept in ``directed_steps`` (the report's, by step: where the directed
        phase's time goes)."""
        t0 = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.directed_steps[name] = round(time.monotonic() - t0, 1)

    def _document_takeover(self) -> None:
        """A document lock whose holder stops renewing (a process paused past its lock) is taken by the
        next holder once it expired on the server's clock, and the stopped holder's late write, sent as
        if it still held the lock, is refused by the document itself: by construction, not by timing."""
        assert self.store is not None
        store, hist = self.store, self._gate_history()
        docs = docs_collection(self.server.url, self.db)
        key = key_for(DIRECTED_KEY, current_epoch(self.start_mono, self.cfg.epoch_seconds), "d")
        paused = _wait(
            lambda: take_document(store, docs, hist, key, DOC_PAUSED, ttl=self.cfg.lease_seconds),
            START_GUARD_S, f"the document lock of {key}", interval=0.1,
        )  # fmt: skip
        run_document_hold(paused, docs, hist, [], self.rng, reckless=False, who=DOC_PAUSED)
        store.forget(paused)  # its renewals stop
        successor = _wait(
            lambda: take_document(store, docs, hist, key, DOC_SUCCESSOR),
            START_GUARD_S, f"the takeover of {key}", interval=0.1,
        )  # fmt: skip
        run_document_hold(
            successor, docs, hist, [f"{DOC_SUCCESSOR}-1"], self.rng, reckless=False, who=DOC_SUCCESSOR
        )
        # Woken up, the paused holder believes its lock is still good (its clock had not moved, say):
        paused.renewed(time.monotonic() + 3600.0)
        ops = [f"{DOC_PAUSED}-late"]
        run_document_hold(
            paused, docs, hist, ops, self.rng, reckless=True, who=DOC_PAUSED, work=(0, 0), claim=False
        )
        release_document(paused, hist, DOC_PAUSED)
        release_document(successor, hist, DOC_SUCCESSOR)

    def _cancel_directed(self, index: int = DIRECTED_KEY + 1, again: str = "") -> list[str]:
        """``REPLACE_CANCEL_TASK`` on an ``r`` key of its own (index ``DIRECTED_KEY`` + 1), one send at a
        time, each once the previous one holds the key (the lease document's holder): a deaf holder (never
        looks) is superseded by a lingering one and terminated after its grace; the lingering holder is
        told by the newest send, stops lingering, has its claim refused and ends superseded; the newest runs.
        By construction: every send waits for its predecessor to hold the key."""
        assert self.store is not None
        store = self.store
        key = key_for(index, current_epoch(self.start_mono, self.cfg.epoch_seconds), "r")
        never = str(self.dir / "cancel-never")  # the lingering holder stops because it is told, not this
        ids: list[str] = []
        for i in range(3):
            op = f"directed-cancel-{i}{again}"
            tid = self._submit(
                REPLACE_CANCEL_TASK, key, op, queue="celery", deaf=i == 0, linger=never if i == 1 else None
            )
            if tid is None:
                return ids
            ids.append(tid)
            if i == 0:
                self.cancel_deaf = tid
            if i == 1:
                self.cancel_lingering = tid
            if i == 2:
                break

            try:
                _wait(
                    _claimed_by(store, (key,), tid),
                    START_GUARD_S,
                    f"directed-cancel-{i} to hold {key}",
                    interval=0.1,
                )
            except TimeoutError as exc:
                self.log(f"directed phase: {exc}")
        return ids

    def _multi_cancel_directed(self, index: int = DIRECTED_KEY + 7, again: str = "") -> list[str]:
        """``MULTI_REPLACE_CANCEL_TASK`` on a pair of ``m`` keys of its own (``DIRECTED_KEY`` + 7 and + 8):
        a first send lingers holding both; once it holds them, a newer send of the pair (named in the other
        order: the same set) tells it; it stops lingering, ends superseded, and the newer send runs. By
        construction: the second send waits for the first to hold both keys."""
        assert self.store is not None
        store = self.store
        epoch = current_epoch(self.start_mono, self.cfg.epoch_seconds)
        a, b = key_for(index, epoch, "m"), key_for(index + 1, epoch, "m")
        never = str(self.dir / "mcancel-never")  # the holder stops because it is told, not this
        first = self._submit(
            MULTI_REPLACE_CANCEL_TASK,
            "",
            f"directed-mcancel-0{again}",
            keys=(a, b),
            queue="celery",
            linger=never,
        )
        if first is None:
            return []
        self.multi_cancel_lingering = first

        try:
            _wait(
                _claimed_by(store, (a, b), first),
                START_GUARD_S,
                f"directed-mcancel-0 to hold {a} and {b}",
                interval=0.1,
            )
        except TimeoutError as exc:
            self.log(f"directed phase: {exc}")
        second = self._submit(
            MULTI_REPLACE_CANCEL_TASK, "", f"directed-mcancel-1{again}", keys=(b, a), queue="celery"
        )
        return [first] + ([second] if second else [])

    def _cancel_directed_again(self) -> None:
        """The directed ``cancel_running`` steps whose lingering holder was not told while it held its key(s)
        (its lease lost first: its claim answered after most of its lease on a loaded machine, seen in CI) are
        sent again, on keys of their own, at most twice: their coverage claims then hold by construction."""
        for attempt in (1, 2):
            again: list[str] = []
            if (
                self.cfg.replace_keys
                and self.cancel_lingering
                and not (
                    self._told(self.cancel_lingering, True)
                    and self.cancel_deaf
                    and self._terminated(self.cancel_deaf)
                )
            ):
                self.log(
                    "directed phase: the cancel_running holders were not told, or the deaf one not "
                    f"terminated; again ({attempt})"
                )
                again += self._cancel_directed(DIRECTED_KEY + 10 + attempt, f"@{attempt}")
            lingering = self.multi_cancel_lingering
            if self.cfg.multi_replace_keys > 2 and lingering and not self._told(lingering, False):
                self.log(
                    f"directed phase: the several-keys cancel_running holder was not told; again ({attempt})"
                )
                again += self._multi_cancel_directed(DIRECTED_KEY + 20 + 2 * attempt, f"@{attempt}")
            if not again:
                return
            with contextlib.suppress(TimeoutError):
                _wait(
                    functools.partial(self._all_ended, list(again)), START_GUARD_S, "the bursts to end", 0.5
                )

    def _all_ended(self, task_ids: list[str]) -> bool:
        return len(self._ended(task_ids)) == len(task_ids)

    def _terminated(self, task_id: str) -> bool:
        """The deaf run ``task_id`` was told superseded while it held its key, never released that hold (its
        child terminated after the grace) and ended superseded. Not so when its lease was lost before the
        newer send (a fault: it released and ran again, then was superseded while parked)."""
        with contextlib.suppress(Exception):
            if (self.results.backend.get_task_meta(task_id).get("result") or {}).get(
                "mongolock"
            ) != "superseded":
                return False
        events = read_histories(self.hist_dir)
        told = {
            str(e.get("hold"))
            for e in events
            if e.get("ev") == "superseded-notice" and e.get("task_id") == task_id
        }
        released = {str(e.get("hold")) for e in events if e.get("ev") == "rel"}
        return bool(told - released)

    def _told(self, task_id: str, refused: bool) -> bool:
        """The run ``task_id`` was told superseded while it held its key (a ``superseded-notice`` of its hold)
        and ended superseded; with ``refused``, a claim or write of that hold sent after the notice was
        refused."""
        with contextlib.suppress(Exception):
            if (self.results.backend.get_task_meta(task_id).get("result") or {}).get(
                "mongolock"
            ) != "superseded":
                return False
        events = read_histories(self.hist_dir)
        notices = [e for e in events if e.get("ev") == "superseded-notice" and e.get("task_id") == task_id]
        if not notices or not refused:
            return bool(notices)
        return any(
            e.get("ev") in ("claim", "write")
            and e.get("hold") == n.get("hold")
            and e.get("outcome") == "fenced"
            and float(e.get("t0") or 0) > float(n.get("t") or 0)
            for n in notices
            for e in events
        )

    def _reentrant_burst(self) -> list[str]:
        """``REENTRANT_BURST`` runs of ``REENTRANT_TASK`` on an ``l`` key and a ``k`` key of their own (no
        gate: each run reenters its own leases, whoever else waits); their task ids."""
        epoch = current_epoch(self.start_mono, self.cfg.epoch_seconds)
        slotted, single = key_for(DIRECTED_KEY + 4, epoch, "l"), key_for(DIRECTED_KEY + 4, epoch)
        ids = [
            self._submit(REENTRANT_TASK, "", f"directed-reentrant-{i}", keys=(slotted, single))
            for i in range(REENTRANT_BURST)
        ]
        return [t for t in ids if t]

    def _multi_replace_sends(self, n: int, epoch: int) -> int:
        """A burst of 2 to 4 runs of one of ``MULTI_REPLACE_TASKS`` on one pair of ``m`` keys, each naming it
        in either order, half of the time with a run of an overlapping pair (one key shared) among them."""
        i, j, k = self.rng.sample(range(self.cfg.multi_replace_keys), 3)
        a, b, c = (key_for(x, epoch, "m") for x in (i, j, k))
        task = self.rng.choice(MULTI_REPLACE_TASKS)  # half of the bursts debounced
        sends = [(a, b) if self.rng.random() < 0.5 else (b, a) for _ in range(self.rng.randint(2, 4))]
        if self.rng.random() < 0.5:
            sends.insert(self.rng.randrange(len(sends) + 1), (b, c))
        for keys in sends:
            n += 1
            self._submit(task, "", f"task-{n}", keys=keys)
        return n

    def _multi_limit_replace_sends(self, n: int, epoch: int, slotted: str) -> int:
        """A burst of 2 to 4 ``MULTI_LIMIT_REPLACE_TASK`` runs on one pair (``slotted``, a ``k`` key), half
        of the time with a run of another pair sharing the ``l`` key among them (another set: it keeps its
        place and its slot)."""
        single, other = self.replace_rng.sample(range(self.cfg.keys), 2)
        if self.replace_rng.random() < 0.5:
            # Half of the bursts with a limit on both keys, debounced (each naming the pair in either order).
            pair = (slotted, key_for(LIMITS_DEBOUNCED_KEY, epoch, "l"))
            for _ in range(self.replace_rng.randint(2, 4)):
                n += 1
                keys = pair if self.replace_rng.random() < 0.5 else pair[::-1]
                self._submit(MULTI_LIMITS_DEBOUNCED_TASK, "", f"task-{n}", keys=keys)
            return n
        sends = [(slotted, key_for(single, epoch))] * self.replace_rng.randint(2, 4)
        if self.replace_rng.random() < 0.5:
            sends.insert(self.replace_rng.randrange(len(sends) + 1), (slotted, key_for(other, epoch)))
        for keys in sends:
            n += 1
            self._submit(MULTI_LIMIT_REPLACE_TASK, "", f"task-{n}", keys=keys)
        return n

    def _reserved_for(self, key: str) -> str | None:
        """The task id ``key`` is handed or reserved to and not yet claimed (``ho``), if any."""
        assert self.store is not None
        with contextlib.suppress(PyMongoError):
            doc = self.store.collection.find_one({"_id": key}, {"ho.t": 1, "owner": 1, "ho.tk": 1}) or {}
            ho = doc.get("ho") or {}
            if ho and doc.get("owner") == ho.get("tk"):
                return str(ho.get("t"))
        return None

    def _multi_replace_directed(self) -> list[str]:
        """``MULTI_REPLACE_BURST`` runs of ``MULTI_REPLACE_TASK`` on one set of two ``m`` keys (d0, d1: d0
        sorts first), naming it in both orders, sent one at a time while a gate holds d1: each takes d0,
        the first key of its set, waits on d1 and keeps d0 reserved; the controller sends the next one only
        once d0 is reserved for the last one sent, so each newer send finds its set's older run reserved on
        d0 and takes that reservation back (``taken_back``: seen in the lease document). Then a run of the
        overlapping set (d0, d2) parks on d0 behind the newest run's reservation, and the gate lets d1 go:
        by construction the older runs of the set end superseded, the newest runs, then the other set's.
        Returns the task ids."""
        epoch = current_epoch(self.start_mono, self.cfg.epoch_seconds)
        d0, d1, d2 = sorted(key_for(DIRECTED_KEY + i, epoch, "m") for i in range(3))
        gate = self._gate_take(d1)
        ids: list[str] = []
        taken_back = 0
        for i in range(MULTI_REPLACE_BURST):
            keys = (d0, d1) if i % 2 else (d1, d0)
            tid = self._submit(
                MULTI_REPLACE_TASK, "", f"directed-multi-replace-{i}", keys=keys, queue="celery"
            )
            if tid is None:
                continue
            older = ids[-1] if ids else None
            ids.append(tid)
            try:
                _wait(
                    lambda tid=tid: self._reserved_for(d0) == tid,  # type: ignore[misc]
                    START_GUARD_S, f"{d0} to be reserved for the newest send", 0.1,
                )  # fmt: skip
            except TimeoutError as exc:
                self.log(f"directed phase: {exc}")
                continue
            if older is None:
                continue
            with contextlib.suppress(TimeoutError):  # (the newer run writes its result after it reserved)
                _wait(
                    lambda older=older: older in self._waiting_on(gate_of([d0, d1])) | self._ended([older]),  # type: ignore[misc]
                    60.0, f"{older} in sup on its set's gate or ended", 0.1,
                )  # fmt: skip
                taken_back += 1  # in sup there (its result not yet written), or ended superseded
        other = self._submit(
            MULTI_REPLACE_TASK, "", "directed-multi-replace-other", keys=(d2, d0), queue="celery"
        )
        parked_behind = False
        if other is not None:
            with contextlib.suppress(TimeoutError):
                parked_behind = bool(
                    _wait(lambda: other in self._waiting_on(d0), START_GUARD_S, f"a run parked on {d0}", 0.1)
                )
        self._gate_release(gate)
        self.multi_replace_directed = {
            "burst": ids,
            "taken_back": taken_back,
            "other": other,
            "other_parked_behind": parked_behind,
        }
        return ids + ([other] if other else [])

    def _holds(self, key: str, task_id: str) -> bool:
        """``key`` is held by a run of ``task_id`` (its lease, not a reservation or handoff)."""
        assert self.store is not None
        with contextlib.suppress(PyMongoError):
            doc = self.store.collection.find_one({"_id": key}, {"owner": 1, "holder.task_id": 1, "ho.tk": 1})
            doc = doc or {}
            ho = doc.get("ho") or {}
            return (
                bool(doc.get("owner"))
                and doc.get("owner") != ho.get("tk")
                and ((doc.get("holder") or {}).get("task_id") == task_id)
            )
        return False

    def _is_parked_on(self, key: str, task_id: str) -> bool:
        return task_id in self._waiting_on(key)

    def _reservation_window(self) -> list[str]:
        """An older run of a set holds one of its keys (w0, free) while it parks on the other (w1, a gate's),
        and a newer send of the set parks on w0 *before* the older run turns its lease of w0 into a
        reservation (the app holds the older run in that window until it sees the newer send parked on w0:
        ``lockcheck_app._reservation_window``). The older run's reservation is refused, w0 is given back to
        the newer send (``handed_on``: seen reserved for it in the lease document) and the older run ends
        superseded; the gate lets w1 go and the newer send runs. A missed window (the older run's lease of
        w0 lapsed before the newer send came) is sent again on keys of its own (``WINDOW_ATTEMPTS``).
        Returns the task ids of every attempt."""
        ids: list[str] = []
        for attempt in range(WINDOW_ATTEMPTS):
            suffix = f"@{attempt}" if attempt else ""
            seen, attempt_ids = self._window_attempt(attempt, suffix)
            ids += attempt_ids
            if seen is not False:  # the window happened (or the step could not tell): judged as it is
                break
            self.log(
                "directed phase: the reservation window was missed (the older run's lease lapsed); "
                f"again ({attempt + 1})"
            )
        self.multi_replace_window["attempts"] = attempt + 1
        return ids

    def _window_attempt(self, attempt: int, suffix: str) -> tuple[bool | None, list[str]]:
        """One attempt of ``_reservation_window``: whether the older run saw the newer send parked in its
        window (None: not known), and the task ids."""
        assert self.store is not None
        epoch = current_epoch(self.start_mono, self.cfg.epoch_seconds)
        i0, i1 = window_pair(attempt)
        w0, w1 = key_for(i0, epoch, "m"), key_for(i1, epoch, "m")
        markers = self.store.collection.database[WINDOW_MARKERS]
        old_id = str(uuid.uuid4())  # the window is armed for this run only
        with contextlib.suppress(PyMongoError):
            markers.replace_one({"_id": w0}, {"_id": w0, "run": old_id}, upsert=True)
        gate = self._gate_take(w1)
        ids: list[str] = []
        handed_on = False
        old = self._submit(
            MULTI_REPLACE_TASK,
            "",
            f"directed-window-old{suffix}",
            keys=(w0, w1),
            queue="celery",
            task_id=old_id,
        )
        new: str | None = None

        def marker() -> Doc:
            with contextlib.suppress(PyMongoError):
                return markers.find_one({"_id": w0}) or {}
            return {}

        if old is not None:
            ids.append(old)
            try:
                _wait(
                    lambda: self._holds(w0, old) and old in self._waiting_on(w1),
                    START_GUARD_S,
                    f"the older run to hold {w0} and park on {w1}",
                    0.1,
                )
                new = self._submit(
                    MULTI_REPLACE_TASK, "", f"directed-window-new{suffix}", keys=(w1, w0), queue="celery"
                )
                if new is not None:
                    ids.append(new)

                    def outcome() -> str | None:
                        # The older run writes ``seen`` when it leaves the window; the newer send may take
                        # w0 (and reserve it for itself) in a missed window too.
                        seen = marker().get("seen")
                        if seen is False:
                            return "missed"
                        # (given back by the older run: its set's gate, handed to the newer send)
                        handed = new in (self._reserved_for(w0), self._reserved_for(gate_of([w0, w1])))
                        return "handed on" if seen and handed else None

                    handed_on = (
                        _wait(outcome, WINDOW_WAIT_S + 60.0, f"{w0} to be handed on to the newer send", 0.1)
                        == "handed on"
                    )
            except TimeoutError as exc:
                self.log(f"directed phase: {exc}")
        self._gate_release(gate)
        self.multi_replace_window = {"old": old, "new": new, "handed_on": handed_on}
        return marker().get("seen"), ids

    def _debounced_directed(self) -> list[str]:
        """``DEBOUNCED_BURST`` runs of ``MULTI_REPLACE_DEBOUNCED_TASK`` on one set of two ``m`` keys (e0, e1),
        naming it in both orders, sent one at a time while a gate holds e0: each parks on both keys (a
        debounced run parks even on a free key), and the controller sends the next only once the last one
        sent is parked on e0, so each newer send supersedes the one before on both keys. The newest's
        delayed copy finds e0 held: it waits parked there (e1 taken or reserved for it) until the gate lets
        go and e0 is handed to it. By construction all but the newest end superseded, and the newest runs.
        Returns the task ids."""
        epoch = current_epoch(self.start_mono, self.cfg.epoch_seconds)
        e0, e1 = key_for(DIRECTED_KEY + 5, epoch, "m"), key_for(DIRECTED_KEY + 6, epoch, "m")
        gate = self._gate_take(e0)
        ids: list[str] = []
        for i in range(DEBOUNCED_BURST):
            keys = (e0, e1) if i % 2 else (e1, e0)
            tid = self._submit(
                MULTI_REPLACE_DEBOUNCED_TASK, "", f"directed-debounced-{i}", keys=keys, queue="celery"
            )
            if tid is None:
                continue
            ids.append(tid)
            try:
                _wait(
                    functools.partial(self._is_parked_on, gate_of([e0, e1]), tid),
                    START_GUARD_S,
                    "a run parked on its set's gate",
                    0.1,
                )
            except TimeoutError as exc:
                self.log(f"directed phase: {exc}")
        self._gate_release(gate)
        return ids

    def _capped_directed(self, task: str = MULTI_REPLACE_CAPPED_TASK) -> list[str]:
        """Runs of ``task`` on one set of two keys of its own (``m`` keys; ``l`` keys for
        ``MULTI_LIMITS_CAPPED_TASK``), naming it in both orders, a send every ``CAPPED_EVERY`` s (more often
        than the debounce: without its ceiling none would run while they go on) until a body of one of
        them started, for at most ``CAPPED_LIMIT_S`` (``capped_directed``, ``limits_capped_directed``:
        sends, and whether a body started while they went on). By construction the burst goes on until a
        run started; a set whose keys went round from run to run (no run while the sends came) fails its
        coverage claim. Returns the task ids."""
        epoch = current_epoch(self.start_mono, self.cfg.epoch_seconds)
        kind = "l" if task == MULTI_LIMITS_CAPPED_TASK else "m"
        e0, e1 = key_for(DIRECTED_KEY + 30, epoch, kind), key_for(DIRECTED_KEY + 31, epoch, kind)
        ids: list[str] = []
        deadline = time.monotonic() + CAPPED_LIMIT_S
        started = False
        next_look = 0.0
        while time.monotonic() < deadline:
            keys = (e0, e1) if len(ids) % 2 else (e1, e0)
            tid = self._submit(task, "", f"directed-capped-{kind}-{len(ids)}", keys=keys)
            if tid is not None:
                ids.append(tid)
            if time.monotonic() >= next_look:  # (the histories read about once a second)
                next_look = time.monotonic() + 1.0
                bodies = {e.get("task_id") for e in read_histories(self.hist_dir) if e.get("ev") == "body"}
                if bodies & set(ids):
                    started = True
                    break
            time.sleep(CAPPED_EVERY)
        figures = {"sends": len(ids), "ran_while_sending": started, "runs": ids}
        if task == MULTI_LIMITS_CAPPED_TASK:
            self.limits_capped_directed = figures
        else:
            self.capped_directed = figures
        self.log(
            f"directed phase: capped burst on {kind} keys: {len(ids)} sends, "
            f"a body started while sending: {started}"
        )
        return ids

    def _slots_handed_to(self, key: str) -> set[str]:
        """The task ids the slots of ``key`` are reserved or handed to and not yet claimed (``hs.ho``)."""
        assert self.store is not None
        with contextlib.suppress(PyMongoError):
            doc = self.store.collection.find_one({"_id": key}, {"hs.ho.t": 1, "hs.o": 1, "hs.ho.tk": 1}) or {}
            return {
                str(h["ho"].get("t"))
                for h in doc.get("hs") or []
                if h.get("ho") and h.get("o") == h["ho"].get("tk")
            }
        return set()

    def _parked_on(self, key: str) -> set[str]:
        """The task ids parked on ``key`` (``q``)."""
        assert self.store is not None
        with contextlib.suppress(PyMongoError):
            doc = self.store.collection.find_one({"_id": key}, {"q.t": 1}) or {}
            return {str(e.get("t")) for e in doc.get("q") or []}
        return set()

    def _multi_limit_replace_directed(self) -> list[str]:
        """A burst of ``MULTI_LIMIT_REPLACE_BURST`` runs of ``MULTI_LIMIT_REPLACE_TASK`` on a pair (an ``l``
        key, a ``k`` key) of its own, sent one at a time behind a gate that holds all N slots of the ``l``
        key; the next run is sent only once the lease documents show the last one waiting as planned, so
        each newer send finds its set's older run there, by construction: each run takes the ``k`` key (the
        first of its set: ``k`` sorts before ``l``), parks for a slot and keeps the ``k`` key reserved; a
        newer send takes that reservation back, supersedes the older run and leaves its place on the ``l``
        key (``parked_for_a_slot_superseded``: the older run gone from the ``l`` key's queue). Then the gate
        lets go: the newest runs. (A run waits on one key at a time, so a run parked on the ``k`` key holds
        no slot: the burst that had each run reserve the last slot while parked there is gone with the
        layout in which a run parked on every key at once.) Returns the task ids."""
        epoch = current_epoch(self.start_mono, self.cfg.epoch_seconds)
        s2, k2 = key_for(DIRECTED_KEY + 7, epoch, "l"), key_for(DIRECTED_KEY + 7, epoch)
        gate2 = self._gate_take(s2, slots=LIMIT)
        ids2, parked_superseded = self._limit_replace_sends(
            "parked", s2, k2, lambda tid: tid in self._parked_on(s2) and self._reserved_for(k2) == tid
        )
        self._gate_release(gate2)
        self.multi_limit_replace_directed = {
            "parked_burst": ids2,
            "parked_for_a_slot_superseded": parked_superseded,
        }
        return ids2

    def _limit_replace_sends(
        self, what: str, slotted: str, single: str, waits: Callable[[str], bool]
    ) -> tuple[list[str], int]:
        """``MULTI_LIMIT_REPLACE_BURST`` sends of the pair, one at a time, each once ``waits(tid)`` says
        the one before waits as planned; (task ids, how many older runs were gone from the ``l`` key, in
        ``sup`` there or ended, once the newer one waited)."""
        ids: list[str] = []
        gone = 0
        for i in range(MULTI_LIMIT_REPLACE_BURST):
            op = f"directed-multi-limit-replace-{what}-{i}"
            tid = self._submit(MULTI_LIMIT_REPLACE_TASK, "", op, keys=(slotted, single), queue="celery")
            if tid is None:
                continue
            older = ids[-1] if ids else None
            ids.append(tid)
            try:
                _wait(
                    functools.partial(waits, tid), START_GUARD_S, f"{tid} to wait on {slotted} ({what})", 0.1
                )
            except TimeoutError as exc:
                self.log(f"directed phase: {exc}")
                continue
            if older is None:
                continue

            def gone_from(older: str = older) -> bool:
                on_slotted = self._slots_handed_to(slotted) | self._parked_on(slotted)
                return older not in on_slotted and older in self._waiting_on(slotted) | self._ended([older])

            with contextlib.suppress(TimeoutError):  # (the newer run leaves its place after it reserved)
                _wait(gone_from, 60.0, f"{older} gone from {slotted}", 0.1)
                gone += 1  # in sup there (its result not yet written), or ended superseded
        return ids, gone

    def _multi_limit_burst(self) -> tuple[str, str, list[Lease], list[str]]:
        """``MULTI_LIMIT_BURST`` runs of ``MULTI_LIMIT_TASK`` on a ``l`` key and a ``k`` key of their own,
        sent behind a gate holding the ``k`` key and all N slots of the ``l`` key (the ``k`` key's one
        lease first, then the slots); (the ``l`` key, the ``k`` key, the gate, task ids). See
        ``_multi_limit_stages``."""
        epoch = current_epoch(self.start_mono, self.cfg.epoch_seconds)
        slotted, single = key_for(DIRECTED_KEY + 1, epoch, "l"), key_for(DIRECTED_KEY + 2, epoch)
        gate = self._gate_take(single) + self._gate_take(slotted, slots=LIMIT)
        ids = [
            self._submit(MULTI_LIMIT_TASK, "", f"directed-multi-limit-{i}", keys=(slotted, single))
            for i in range(MULTI_LIMIT_BURST)
        ]
        return slotted, single, gate, [t for t in ids if t]

    def _multi_limit_stages(self, slotted: str, single: str, gate: list[Lease], ids: list[str]) -> None:
        """The runs take their keys in sorted order (``k`` before ``l``), so, by construction: while the
        gate holds the ``k`` key, each run finds it held (``tcont`` in the workers' histories, recorded
        before the policy decides); the gate lets it go, and each run takes it and finds the ``l`` key's
        slots full; the gate lets one slot go, and each run in turn holds the last slot and the ``k`` key
        while the gate holds the other N - 1 slots (N clean holds at once, one a several-keys run's); the
        gate lets the rest go once every run has ended."""
        single_gate, slot_gates = gate[:1], gate[1:]
        for key, release in ((single, single_gate), (slotted, slot_gates[:1])):

            def contended(key: str = key) -> bool:
                return set(ids) <= self._contended_runs(key)

            try:
                _wait(contended, START_GUARD_S, f"the per-key-limit burst to find {key} held", interval=0.2)
            except TimeoutError as exc:
                self.log(f"directed phase: {exc}")
            self._gate_release(release)
        try:
            _wait(lambda: set(ids) <= self._ended(ids), START_GUARD_S, "the per-key-limit burst to end", 0.2)
        except TimeoutError as exc:
            self.log(f"directed phase: {exc}")
        self._gate_release(slot_gates[1:])

    def _new_events(self, ev: str, offsets: dict[Path, int]) -> list[Doc]:
        """The events ``ev`` of the histories written since the last call with ``offsets`` (whole lines)."""
        out: list[Doc] = []
        needle = f'"{ev}"'.encode()
        for path in sorted(self.hist_dir.glob("hist-*.jsonl")):
            offset = offsets.get(path, 0)
            with contextlib.suppress(OSError), open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
                complete = chunk[: chunk.rfind(b"\n") + 1]
                offsets[path] = offset + len(complete)
                for line in complete.splitlines():
                    if needle in line:
                        with contextlib.suppress(ValueError):
                            e = json.loads(line)
                            if e.get("ev") == ev:
                                out.append(e)
        return out

    def _mixed_directed(self) -> list[str]:
        """A key used both ways (``lockcheck_mixed``): a gate holds an ``x`` key of its own as a single
        lease, and ``MIXED_DIRECTED`` runs of both kinds are sent to it. By construction: a run of slots
        finds the key in use as a single lease, so its admit answers ``mixed`` (it is kept aside, not parked)
        and a run of a single lease parks; once the workers' admits show every run of slots kept aside and
        the lease document every run of a single lease waiting, the gate lets go: the key goes to the runs
        of a single lease one after another, then to the runs of slots. Returns the task ids."""
        epoch = current_epoch(self.start_mono, self.cfg.epoch_seconds)
        key = key_for(DIRECTED_KEY, epoch, mixed.KIND)
        gate = self._gate_take(key)
        sent = [
            (name, self._submit(name, key, f"directed-mixed-{i}", queue="celery"))
            for i, name in enumerate(MIXED_DIRECTED)
        ]
        slots = {t for name, t in sent if t and name == mixed.SLOTS_TASK}
        single = {t for name, t in sent if t and name == mixed.SINGLE_TASK}

        def waiting() -> bool:
            return slots <= self._kept_aside(key) and single <= self._waiting_on(key)

        try:
            _wait(waiting, START_GUARD_S, f"the mixed burst on {key} to wait behind the gate", interval=0.2)
        except TimeoutError as exc:
            self.log(f"directed phase: {exc}")
        self.mixed_directed = {
            "key": key,
            "slot_runs": len(slots),
            "single_runs": len(single),
            "slot_runs_kept_aside": len(slots & self._kept_aside(key)),
            "single_runs_parked": len(single & self._waiting_on(key)),
        }
        self._gate_release(gate)
        return [t for _name, t in sent if t]

    def _kept_aside(self, key: str) -> set[str]:
        """The task ids whose admit on ``key`` answered ``mixed`` so far (the workers' ``admit`` events, read
        on from where the last call stopped)."""
        for e in self._new_events("admit", self._admits_read):
            if e.get("outcome") == "mixed" and e.get("task_id"):
                self._mixed_answers[str(e.get("key"))].add(str(e["task_id"]))
        return set(self._mixed_answers.get(key, set()))

    def _contended_runs(self, key: str) -> set[str]:
        """The task ids that found ``key`` held or full so far (``tcont`` events of the workers' histories,
        read on from where the last call stopped)."""
        for e in self._new_events("tcont", self._tcont_read):
            if e.get("task_id"):
                self._tcont[str(e.get("key"))].add(str(e["task_id"]))
        return set(self._tcont.get(key, set()))

    def _rate_parked_runs(self, key: str) -> set[str]:
        """The task ids parked by the rate on ``key`` so far (``rtake`` records whose reply shows the run
        among the key's parked runs), read on from where the last call stopped."""
        for e in self._new_events("rtake", self._rate_read):
            park = rate_park(e)
            if park is not None and e.get("task_id"):
                self._rate_parked[park[0]].add(str(e["task_id"]))
        return set(self._rate_parked.get(key, set()))

    def _rate_pending(self, n: int, sends: int) -> tuple[RateGate, Doc]:
        """A rate gate (``RateGate``) on a ``t`` key of its own (index ``n``) and ``sends`` runs of
        ``RATE_TASK`` sent to the key, waited for until the workers' records show each one parked by the
        rate: they stay parked (no worker slot held) until the gate stops, then start as the window allows."""
        assert self.store is not None
        key = key_for(n, current_epoch(self.start_mono, self.cfg.epoch_seconds), "t")
        gate = RateGate(self.store, self._gate_history(), key, f"{GATE}-{n}").start()
        ids = [t for i in range(sends) if (t := self._submit(RATE_TASK, key, f"rate-{n}-{i}")) is not None]
        info: Doc = {"key": key, "runs": ids, "parked": False}
        if len(ids) == sends:
            with contextlib.suppress(TimeoutError):
                info["parked"] = bool(
                    _wait(
                        lambda: set(ids) <= self._rate_parked_runs(key), START_GUARD_S,
                        f"runs parked by the rate on {key}", 0.1,
                    )
                )  # fmt: skip
        return gate, info

    def _rate_directed(self) -> list[str]:
        """The directed rate burst: ``RATE_BURST`` runs parked behind a rate gate, which then stops: they
        start window by window (the directed phase waits for them to end)."""
        gate, self.rate_directed = self._rate_pending(DIRECTED_KEY, RATE_BURST)
        gate.stop()
        return list(self.rate_directed["runs"])

    def _fault_gate(self) -> tuple[list[Lease], Doc] | None:
        """A ``Queue`` run parked behind a gate on a key of its own, for the fault about to begin."""
        if not self.cfg.queue_keys:
            return None
        self._gates += 1
        key = key_for(
            FAULT_GATE_KEYS + self._gates, current_epoch(self.start_mono, self.cfg.epoch_seconds), "q"
        )
        gate = self._gate_take(key)
        queue = SKEWED_QUEUE if self.skewed_node is not None else "celery"
        # It dies once its body has released the key (``DIE_TASKS``): its copy comes back right after the
        # fault, while the system recovers from it.
        task_id = self._submit(QUEUE_TASK, key, f"fault-gate-{self._gates}", queue=queue, die=True)
        info: Doc = {"key": key, "task_id": task_id, "parked": False}
        if task_id is not None:
            info["parked"] = self._gate_parked(key, task_id, queue)
        return gate, info

    def _gate_parked(self, key: str, task_id: str, queue: str) -> bool:
        """Wait until the gate's run is parked on ``key``. The skewed node, the one consumer of its queue,
        can stop running tasks while its parent still receives messages (a redelivered copy counts as
        progress for the stall watch, and a message it reserved is not ``ready``): when a stall allowance
        passes with the run not parked and no child of that node recorded anything, the node is recorded
        as stalled (``node_stalls``, with its processes' states and thread dump) and replaced, and the
        wait goes on. A node whose children work is slow, not stalled: it is waited for."""
        deadline = time.monotonic() + START_GUARD_S
        while True:
            since = time.time()  # (history files' modification times are wall-clock)
            node = self.skewed_node if queue == SKEWED_QUEUE else None
            seen = set(node.child_pids()) if node is not None else set()
            window = min(self._stall_allowance(), max(0.0, deadline - time.monotonic()))
            try:
                return bool(
                    _wait(lambda: task_id in self._waiting_on(key), window, f"a run parked on {key}", 0.1)
                )
            except TimeoutError:
                if time.monotonic() >= deadline:
                    return False
            # The same node all through the window (not one replaced meanwhile: it has had no time), judged
            # by every child seen in it (a child replaced in the window wrote to a file of its own).
            if node is None or node is not self.skewed_node or not node.alive or node.proc is None:
                continue
            children = node.child_pids()
            if nodewatch.newest_write(self.hist_dir, seen | set(children)) >= since:
                continue  # its children work: slow, not stalled
            finding: Doc = {
                "node": node.name, "pid": node.proc.pid, "children": children, "queue": queue,
                "ready": None, "quiet_s": round(window, 1), "allowance_s": round(self._stall_allowance(), 1),
                "why": f"the fault gate's run {task_id} was not parked on {key}, and no child ran anything",
            }  # fmt: skip
            self.stall_watch.forget(node.proc.pid)
            self._stalled(node, finding)

    # -- faults ------------------------------------------------------------------------------------------
    def _held(self) -> list[Any]:
        """The held leases under ``PREFIX``; a ``limit=N`` key gives one entry per live hold (``SlotHold``,
        with its owner token read from the lease document)."""
        assert self.store is not None
        try:
            infos = self.store.list(prefix=PREFIX)
        except MongoLockError:
            return []
        out: list[Any] = []
        for info in infos:
            if not info.slots:
                out.append(info)
                continue
            try:
                raw = self.store.collection.find_one({"_id": info.key}, {"hs": 1}) or {}
            except PyMongoError:
                continue
            tokens = {int(h.get("f", 0)): str(h.get("o")) for h in raw.get("hs") or []}
            for hold in info.slots:
                fence = int(hold.get("fence") or 0)
                if fence in tokens:
                    out.append(
                        SlotHold(
                            info.key, tokens[fence], fence, int(hold.get("slot") or 0),
                            dict(hold.get("holder") or {}), hold.get("expires_in"),
                        )
                    )  # fmt: skip
        return out

    def _find_victim(self, pids: Callable[[], set[int]], timeout: float = 8.0) -> Any:
        # Which holder to hit, drawn once: a queued key's (its fault lands on a run that others are
        # parked behind, or on a bare client holding such a key), a slot of a limit=N key, a several-keys
        # run (its holder names its keys), or any. That kind is looked for during the first half of the
        # wait, then any holder will do.
        weights = {"queued": 3, "limit": 2, "multi": 3, "any": 2}
        if pids == self._client_pids:  # the bare clients take no several-keys leases
            del weights["multi"]
        want = self.rng.choices(list(weights), weights=list(weights.values()))[0]
        prefer_until = time.monotonic() + timeout / 2

        def find() -> Any:
            candidates = [
                i for i in self._held() if i.holder.get("pid") in pids() and (i.expires_in or 0) > 0.5
            ]
            if want != "any" and time.monotonic() < prefer_until:
                candidates = [i for i in candidates if holder_kind(i) == want]
            return self.rng.choice(candidates) if candidates else None

        try:
            return _wait(find, timeout, "a holder to hit", interval=0.1)
        except TimeoutError:
            return None

    def _parked_now(self) -> int:
        """How many runs are parked or handed the key and not yet claimed, in every lease document."""
        assert self.store is not None
        try:
            docs = self.store.waiting_keys()
        except MongoLockError:
            return -1
        # A limit=N key's slot handed to a parked run is a hold with the run's entry in ``ho``.
        handed_slots = sum(1 for d in docs for h in d.get("hs") or [] if isinstance(h, dict) and h.get("ho"))
        spilled = len(self._spilled())
        return sum(len(d.get("q") or []) + (1 if d.get("ho") else 0) for d in docs) + handed_slots + spilled

    def _record(self, kind: str, t: float, **fields: Any) -> None:
        fault = {"kind": kind, "t": t, "at_s": round(t - self.start_mono, 2), **fields}
        fault["parked_before"] = self._parked_before
        if self._gate_info is not None:
            fault["gate"] = self._gate_info
        if self._unique_info is not None:
            fault["unique"] = self._unique_info
        if self._rate_info is not None:
            fault["rate"] = self._rate_info
        if self._mixed_info is not None:
            fault["mixed"] = self._mixed_info
        self.faults.append(fault)
        self.log(f"[{fault['at_s']:7.2f}s] fault {kind} {json.dumps(fields, default=str)}")

    def _client_pids(self) -> set[int]:
        return {p.pid for p in self.clients if p.poll() is None}

    def _task_child_pids(self) -> set[int]:
        return {pid for node in self.nodes for pid in node.child_pids()}

    def _sigstop(self, kind: str, pids: Callable[[], set[int]]) -> bool:
        assert self.store is not None
        victim = self._find_victim(pids)
        if victim is None:
            return False
        pid = int(victim.holder["pid"])
        t = time.monotonic()
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            return False
        try:
            self._record(kind, t, keys=[victim.key], holds=[victim.owner], fence=victim.fence, pid=pid)

            # Paused until its lease has expired, another holder has taken the key and has claimed the
            # protected document (so that a late write from the paused one meets a newer fence).
            def taken() -> Any:
                with contextlib.suppress(MongoLockError):
                    info = self.store.inspect(victim.key) if self.store else None
                    if info is not None and isinstance(victim, SlotHold):
                        # A limit=N key: a newer hold of the victim's slot (whose writes fence it out); or,
                        # once its hold was dropped for a newer one in another slot, nothing to wait for.
                        same = [
                            h
                            for h in info.slots
                            if h.get("slot") == victim.slot and h["fence"] > victim.fence
                        ]
                        if same:
                            return SlotHold(victim.key, "", int(same[0]["fence"]), victim.slot, {}, None)
                        if info.fence > victim.fence and all(h["fence"] != victim.fence for h in info.slots):
                            return SlotHold(victim.key, "", 0, victim.slot, {}, None)
                    elif info is not None and info.owner not in (None, victim.owner):
                        return info
                return None

            successor = None
            with contextlib.suppress(TimeoutError):
                successor = _wait(taken, self.cfg.lease_seconds * 4 + 4, "a successor", interval=0.05)
            if successor is not None:
                docs = docs_collection(self.server.url, self.db)

                def claimed() -> bool:
                    with contextlib.suppress(PyMongoError):
                        d = docs.find_one({"_id": victim.key}, {"fence": 1, "sf": 1})
                        if isinstance(victim, SlotHold):  # the fence of the victim's slot in the document
                            return bool(
                                d and int((d.get("sf") or {}).get(str(victim.slot), 0)) >= successor.fence
                            )
                        return bool(d and int(d.get("fence", 0)) >= successor.fence)
                    return False

                with contextlib.suppress(TimeoutError):
                    _wait(claimed, 3.0, "the successor's claim")
            else:
                with contextlib.suppress(TimeoutError):
                    _wait(lambda: time.monotonic() > t + self.cfg.lease_seconds * 1.5, 10, "lease expiry")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        return True

    def _kill_child(self, kind: str = "kill-child") -> bool:
        """``kill-child``: SIGKILL of a child holding a lease. ``sigterm-child``: SIGTERM, as a cold
        shutdown or a SIGTERM to the node's process group sends it: billiard's child unwinds its body
        with ``SystemExit``, its keys are given back unmarked, and its message runs again."""
        victim = self._find_victim(self._task_child_pids)
        if victim is None:
            return False
        pid = int(victim.holder["pid"])
        t = time.monotonic()
        try:
            os.kill(pid, signal.SIGKILL if kind == "kill-child" else signal.SIGTERM)
        except ProcessLookupError:
            return False
        self._record(kind, t, keys=[victim.key], holds=[victim.owner], pid=pid)
        return True

    def _busy_node(self) -> tuple[Node, list[Any]] | None:
        """A live node to stop, preferably one whose child holds a lease (waited for a little), with the
        leases its children hold."""
        live = [n for n in self.nodes if n.alive]
        if not live:
            return None
        with contextlib.suppress(TimeoutError):
            _wait(lambda: {i.holder.get("worker") for i in self._held()} & {n.name for n in live}, 8, "", 0.1)
        busy = {i.holder.get("worker") for i in self._held()}
        node = next((n for n in live if n.name in busy), None) or self.rng.choice(live)
        return node, [i for i in self._held() if i.holder.get("worker") == node.name]

    def _record_node(self, kind: str, t: float, node: Node, held: list[Any]) -> None:
        """A fault on a whole node, with the keys and holds its children had."""
        self._record(kind, t, node=node.name, keys=[i.key for i in held], holds=[i.owner for i in held])

    def _kill_node(self) -> bool:
        found = self._busy_node()
        if found is None:
            return False
        node, held = found
        with self._nodes_lock:
            if node not in self.nodes or not node.alive:
                return False  # it exited on its own meanwhile; the supervisor replaced it
            t = time.monotonic()
            node.kill()
            self._record_node("kill-node", t, node, held)
            self.faults[-1]["dead_t"] = time.monotonic()  # (reaped: its sockets are closed)
            self.nodes.remove(node)
            node.stop()
            self._start_node()
        return True

    def _sigterm_node(self) -> bool:
        """SIGTERM to a node's whole process group, as systemd stops a service (``KillMode=control-group``)
        and ``pkill -f`` does: its parent begins a warm shutdown while each child cuts its body short. The
        node is replaced at once (a deploy starts the new one beside the old); one that has not exited
        after ``SIGTERM_STOP_S`` is SIGKILLed, as systemd does (``_wait_stopped``)."""
        found = self._busy_node()
        if found is None:
            return False
        node, held = found
        with self._nodes_lock:
            if node not in self.nodes or not node.alive:
                return False
            assert node.proc is not None
            t = time.monotonic()
            try:
                os.killpg(node.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                return False
            self._record_node("sigterm-node", t, node, held)
            fault = self.faults[-1]
            self.nodes.remove(node)
            try:
                self._start_node()
            except BaseException:
                self._wait_stopped(node, fault)  # (the old node goes whatever the start did)
                raise
        self._wait_stopped(node, fault)  # (outside the lock: the supervisor goes on meanwhile)
        return True

    def _wait_stopped(self, node: Node, fault: Doc) -> None:
        """Wait for a node told to stop to exit; SIGKILL it after ``SIGTERM_STOP_S`` (its fault then says
        when, ``killed_t``: a kill cuts its consumers off as ``kill-node`` does)."""
        assert node.proc is not None
        try:
            node.proc.wait(SIGTERM_STOP_S)
        except subprocess.TimeoutExpired:
            fault["stuck"] = self._stuck_evidence(node)
            fault["killed_t"] = time.monotonic()
            node.kill()
            fault["dead_t"] = time.monotonic()
            self.log(f"fault sigterm-node: {node.name} had not exited after {SIGTERM_STOP_S:g} s; killed")
        node.stop()  # (its children, if its parent left any behind)

    def _stuck_evidence(self, node: Node) -> Doc:
        """What a node that does not exit was doing: its processes' states and its threads' stacks
        (Celery logs them on SIGUSR1), as ``_stalled`` records for a stalled node."""
        assert node.proc is not None
        pids = [node.proc.pid, *node.child_pids()]
        evidence: Doc = {"states": nodewatch.process_states(pids)}
        size = node.log_path.stat().st_size if node.log_path.exists() else 0
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.proc.pid, signal.SIGUSR1)
        with contextlib.suppress(TimeoutError):  # (evidence, not a condition of the kill)
            _wait(lambda: "MainThread" in node.log_tail() and node.log_path.stat().st_size > size, 10, "dump")
        with contextlib.suppress(OSError), open(node.log_path, errors="replace") as log:
            log.seek(size)
            evidence["dump"] = log.read()[-6000:]
        return evidence

    def _clock_jump(self) -> bool:
        if not self.faketime:
            return False
        # The bare client jumps both ways; the Celery node only forward: Celery's own ETA/countdown
        # scheduling (not the lock) trusts the wall clock, and a backward jump would only stall retries.
        client = ["+10m", "-10m", "+0", "+3h", "-1h", "+0"][self._clock_offsets["client"] % 6]
        self._clock_offsets["client"] += 1
        self._clock_offsets["node"] += 1
        node = f"+{2 * self._clock_offsets['node']}m"
        t = time.monotonic()
        write_offset(self.dir / "clock-client.offset", client)
        if self.skewed_node is not None:
            write_offset(self.dir / "clock-node.offset", node)
        if self.skewed_node is not None:
            self._record("clock-jump", t, client_offset=client, node_offset=node)
        else:
            self._record("clock-jump", t, client_offset=client)
        return True

    def _server_restart(self) -> bool:
        crash = sum(1 for f in self.faults if f["kind"] == "server-restart") % 2 == 0
        t = time.monotonic()
        if crash:
            self.server.kill()
        else:
            self.server.stop()
        self.server.start()
        self._record(
            "server-restart", t, how="SIGKILL" if crash else "SIGTERM", down_s=round(time.monotonic() - t, 2)
        )
        return True

    def _server_pause(self) -> bool:
        pid = self.server.pid
        if pid is None:
            return False
        held = self._held()
        pause = self.cfg.lease_seconds * 1.75
        t = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            self._stop.wait(pause)
        finally:
            os.kill(pid, signal.SIGCONT)
        self._record(
            "server-pause", t, keys=[i.key for i in held], holds=[i.owner for i in held], paused_s=pause
        )
        return True

    def _broker_restart(self) -> bool:
        crash = sum(1 for f in self.faults if f["kind"] == "broker-restart") % 2 == 0
        t = time.monotonic()
        if self.rabbit is not None:
            if crash:
                self.rabbit.kill()
            else:
                self.rabbit.terminate()
            self._stop.wait(1.0)
            self.rabbit.start()
            self._record(
                "broker-restart",
                t,
                how="SIGKILL" if crash else "SIGTERM",
                down_s=round(time.monotonic() - t, 2),
            )
            return True
        if crash:
            self.redis.kill()
        else:
            assert self.redis.proc is not None
            self.redis.proc.terminate()
            self.redis.proc.wait(10)
            self.redis.proc = None
        self._stop.wait(1.0)
        self.redis.start()
        self._record(
            "broker-restart", t, how="SIGKILL" if crash else "SIGTERM", down_s=round(time.monotonic() - t, 2)
        )
        return True

    def _fail_point(self, kind: str) -> bool:
        data: Doc = {"failCommands": ["findAndModify", "update", "find"]}
        n = sum(1 for f in self.faults if f["kind"] == kind)
        if kind == "fail-close":
            data["closeConnection"] = True
        elif kind == "fail-error":
            data["errorCode"] = [91, 50, 6, 11600][n % 4]  # ShutdownInProgress, MaxTimeMSExpired, ...
        else:
            data.update(blockConnection=True, blockTimeMS=1500)
        admin: MongoClient[Doc] = MongoClient(self.server.url, serverSelectionTimeoutMS=5000)
        try:
            t = time.monotonic()
            admin.admin.command("configureFailPoint", "failCommand", mode={"times": 8}, data=data)
            self._record(kind, t, data={k: v for k, v in data.items() if k != "failCommands"})
            self._stop.wait(3.0)
            admin.admin.command("configureFailPoint", "failCommand", mode="off")
        except PyMongoError as exc:
            self.log(f"fail point {kind} not armed: {exc!r}")
            return False
        finally:
            admin.close()
        return True

    def inject(self, kind: str) -> bool:
        """Set up the fault's gates (``_fault_gates``), inject the fault, then let the gates go."""
        gates = self._fault_gates()
        gated, (_, self._unique_info), rated, _, kept_aside = gates
        self._gate_info = gated[1] if gated else None
        self._mixed_info = kept_aside[1] if kept_aside else None
        self._rate_info = rated[1] if rated else None
        parked = self._parked_now()
        self._parked_before = max(parked, 1) if gated and gated[1]["parked"] else parked
        try:
            return self._inject(kind)
        finally:
            self._unique_info = self._rate_info = self._gate_info = self._mixed_info = None
            self._end_fault_gates(gates)

    def _fault_gates(self) -> FaultGates:
        """Every fault lands while a queued run waits: a run parked behind a gate on a key of its own,
        confirmed in its lease document before the fault begins, handed the key when the fault is over;
        while a unique send's run is pending (its equal sends got it), run when it is over; while runs
        parked by the rate wait for a window the controller keeps full (``RateGate``); and while a document
        lock is held (``DocumentLease``), written once when the fault is over; and while a run of slots is
        kept aside on a key held as a single lease (``_mixed_gate``), which takes a slot when it is over.

        They are set up side by side, each on keys of its own: each waits for the workers to take its
        runs from behind the random workload's backlog (10 to 20 s apiece on a loaded machine), and one
        after the other they made a fault take 25 s instead of the ``duration``'s share of 5 s."""
        self._gate_history()  # (made once, before the threads share it)
        self._unique_gates += 1
        self._rate_gates += 1
        n_unique, n_rate = FAULT_GATE_KEYS + self._unique_gates, FAULT_GATE_KEYS + self._rate_gates
        with ThreadPoolExecutor(5, thread_name_prefix="lockcheck-gate") as pool:
            futures = (
                pool.submit(self._fault_gate),
                pool.submit(self._unique_pending, n_unique, UNIQUE_GATE_SENDS),
                pool.submit(self._rate_pending, n_rate, RATE_GATE_SENDS) if self.cfg.rate_keys else None,
                pool.submit(self._document_gate),
                pool.submit(self._mixed_gate),
            )
        errors = [exc for f in futures if f is not None and (exc := f.exception()) is not None]
        got = tuple(None if f is None or f.exception() is not None else f.result() for f in futures)
        if errors:  # (a guard ran out: the gates that were set up are let go before the run fails with it)
            try:
                self._end_fault_gates(got)  # type: ignore[arg-type]
            finally:
                raise errors[0]
        return got  # type: ignore[return-value]

    def _end_fault_gates(self, gates: FaultGates) -> None:
        """Let each gate go, each whatever became of the others; then the first failure, if any."""
        gated, unique, rated, document, kept_aside = gates
        ends: list[Callable[[], object]] = []
        if kept_aside is not None:
            ends.append(functools.partial(self._gate_release, kept_aside[0]))
        if unique is not None:
            ends.append(functools.partial(self._gate_release, unique[0]))
        if rated is not None:
            ends.append(rated[0].stop)
        if gated:
            ends.append(functools.partial(self._gate_release, gated[0]))
        if document is not None:
            ends.append(functools.partial(self._document_gate_end, document))
        failed: list[BaseException] = []
        for end in ends:
            try:
                end()
            except Exception as exc:
                self.log(f"fault gate: letting a gate go failed: {exc!r}")
                failed.append(exc)
        if failed:
            raise failed[0]

    def _mixed_gate(self) -> tuple[list[Lease], Doc] | None:
        """A gate that holds an ``x`` key of its own as a single lease, and a run of slots sent to it, for
        the fault about to begin: the run is kept aside (its admit answers ``mixed``: the workers' admit
        records show it) before the fault begins, and takes a slot when it comes back after the gate let
        go (``lockcheck_mixed``)."""
        if not self.cfg.mixed_keys:
            return None
        self._mixed_gates += 1
        n = self._mixed_gates
        key = key_for(FAULT_GATE_KEYS + n, current_epoch(self.start_mono, self.cfg.epoch_seconds), mixed.KIND)
        gate = self._gate_take(key)
        task_id = self._submit(mixed.SLOTS_TASK, key, f"fault-mixed-{n}", queue="celery")
        info: Doc = {"key": key, "task_id": task_id, "kept_aside": False}
        if task_id is not None:
            what = f"a run of slots kept aside on {key}"
            with contextlib.suppress(TimeoutError):
                kept = _wait(lambda: task_id in self._kept_aside(key), START_GUARD_S, what, 0.1)
                info["kept_aside"] = bool(kept)
        return gate, info

    def _document_gate(self) -> DocumentLease | None:
        """A document lock of the controller's on a ``d`` key of its own, claimed, for the fault about
        to begin (heartbeat on, a 30 s lock: a fault that outlasts it is seen by its write)."""
        if not self.cfg.doc_keys:
            return None
        assert self.store is not None
        store, hist = self.store, self._gate_history()
        docs = docs_collection(self.server.url, self.db)
        self._doc_gates += 1
        key = key_for(
            FAULT_GATE_KEYS + self._doc_gates, current_epoch(self.start_mono, self.cfg.epoch_seconds), "d"
        )
        locked: DocumentLease = _wait(
            lambda: take_document(store, docs, hist, key, DOC_GATE, ttl=30.0),
            START_GUARD_S, f"the document gate on {key}", interval=0.1,
        )  # fmt: skip
        run_document_hold(locked, docs, hist, [], self.rng, reckless=False, who=DOC_GATE)
        return locked

    def _document_gate_end(self, locked: DocumentLease) -> None:
        """After the fault: one read-modify-write through the lock (acknowledged, or refused if the fault
        cost the lock), then its release."""
        docs = docs_collection(self.server.url, self.db)
        hist = self._gate_history()
        ops = [f"{DOC_GATE}-{self._doc_gates}"]
        run_document_hold(
            locked, docs, hist, ops, self.rng, reckless=False, who=DOC_GATE, work=(0, 0), claim=False
        )
        release_document(locked, hist, DOC_GATE)

    def _lingering(self) -> Path:
        """A Celery run (``rmw``) that holds a key of its own until the returned path exists (the caller
        creates it when its fault is over), waited for until a worker child holds the key: so a fault on a
        Celery child holding a lease finds one, whatever else holds leases then."""
        self._lingers += 1
        path = self.dir / f"linger-{self._lingers}"
        key = key_for(LINGER_KEYS + self._lingers, current_epoch(self.start_mono, self.cfg.epoch_seconds))
        self._submit("lockcheck.rmw", key, f"linger-{self._lingers}", queue="celery", linger=str(path))

        def held() -> bool:
            children = self._task_child_pids()
            return any(i.key == key and i.holder.get("pid") in children for i in self._held())

        try:
            _wait(held, START_GUARD_S, f"a Celery run holding {key}", interval=0.1)
        except TimeoutError as exc:
            self.log(f"fault: {exc}")
        return path

    def _inject(self, kind: str) -> bool:
        if kind == "sigstop-client":
            return self._sigstop(kind, self._client_pids)
        if kind in ("sigstop-task", "kill-child", "sigterm-child"):
            lingering = self._lingering()
            try:
                return (
                    self._sigstop(kind, self._task_child_pids)
                    if kind == "sigstop-task"
                    else self._kill_child(kind)
                )
            finally:
                lingering.write_text("go")
        if kind == "kill-node":
            return self._kill_node()
        if kind == "sigterm-node":
            return self._sigterm_node()
        if kind == "clock-jump":
            return self._clock_jump()
        if kind == "server-restart":
            return self._server_restart()
        if kind == "server-pause":
            return self._server_pause()
        if kind == "broker-restart":
            return self._broker_restart()
        if kind in ("fail-close", "fail-error", "fail-block"):
            return self._fail_point(kind)
        raise ValueError(f"unknown fault {kind!r}")

    def _fault_plan(self) -> list[str]:
        plan = [k for k in self.cfg.faults if k not in self.skipped_faults]
        self.rng.shuffle(plan)
        if "clock-jump" in plan:
            plan.append("clock-jump")  # the bare client's clock goes forward, then back
        return plan

    def faults_loop(self) -> None:
        """After the warm-up, the directed phase (``directed``); then every fault once, spread over the
        duration (retried later when no victim was found); then, for a soak, random faults every
        ``fault_interval`` seconds until the end. The phase ends once the workload's acknowledged writes
        exceed ``MIN_ACKNOWLEDGED`` (on a loaded machine that can take longer than the duration)."""
        cfg = self.cfg
        pending = self._fault_plan()
        gap = cfg.fault_interval or cfg.duration / (len(pending) + 1)
        self._stop.wait(cfg.warmup)
        self.directed()
        end = time.monotonic() + cfg.duration
        self._stop.wait(gap / 2)
        tries: Counter[str] = Counter()
        while pending:
            kind = pending.pop(0)
            slot = time.monotonic() + gap * (0.7 + 0.6 * self.rng.random())
            if not self.inject(kind):
                tries[kind] += 1
                # Every fault must land once: on a loaded machine a holder to hit can take a while to
                # appear, so the first pass goes on (past the duration if need be) until it has one.
                if tries[kind] < FAULT_TRIES:
                    self.log(f"fault {kind}: no victim found now; retrying later")
                    pending.append(kind)
                else:
                    self.skipped_faults[kind] = "no victim found in time"
            self._stop.wait(max(0.0, slot - time.monotonic()))
        kinds = [k for k in self.cfg.faults if k not in self.skipped_faults]
        while cfg.repeat_faults and kinds and time.monotonic() < end - gap / 2:
            slot = time.monotonic() + gap * (0.7 + 0.6 * self.rng.random())
            self.inject(self.rng.choice(kinds))
            self._stop.wait(max(0.0, min(slot, end) - time.monotonic()))
        self._stop.wait(max(0.0, end - time.monotonic()))
        try:
            _wait(lambda: self._acknowledged() > MIN_ACKNOWLEDGED, START_GUARD_S, "acknowledged writes", 0.5)
        except TimeoutError as exc:
            self.log(f"fault phase: {exc}")

    def _acknowledged(self) -> int:
        """The writes acknowledged so far, in the histories."""
        return sum(
            1
            for e in read_histories(self.hist_dir)
            if e.get("ev") == "write" and str(e.get("outcome", "")).startswith("ack")
        )

    # -- drain and check ---------------------------------------------------------------------------------
    def drain(self) -> dict[str, Doc]:
        self.stop_file.write_text("stop")
        for proc in self.clients:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
        for proc in self.clients:
            try:
                proc.wait(START_GUARD_S)  # a client ends its current hold first: slow is not stuck
            except subprocess.TimeoutExpired:
                self.log(f"client {self.client_names.get(proc.pid)} did not stop; killing it")
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        backend = self.results.backend
        states: dict[str, Doc] = {}
        waiting = dict(self.submitted)
        t_begin = last_progress = time.monotonic()
        proven_at = 0.0
        seen: dict[str, str] = {}
        while waiting:
            now = time.monotonic()
            for task_id, info in list(waiting.items()):
                try:
                    meta = backend.get_task_meta(task_id)
                    state = meta["status"]
                    if state in ("SUCCESS", "FAILURE", "REVOKED"):
                        states[task_id] = {**info, "state": state, "result": _plain(meta["result"])}
                        del waiting[task_id]
                        last_progress = now
                except Exception as exc:
                    self.log(f"result of {task_id}: {exc!r}")
            if not waiting:
                break
            where = _merge_places(self._broker_view(waiting), self._parked_view(waiting))
            if where != seen:  # a message moved (delivered, retried, restored): progress
                seen, last_progress = where, now
            # Waiting ends on conditions and measured progress, not on a constant. A message in a queue
            # will be consumed; an unacknowledged one will run (a live node holds it) or come back by
            # kombu's restore (a dead node held it: after the visibility timeout by the *delivering*
            # node's clock, minutes late for the node whose clock runs ahead). So the drain gives up
            # only on messages that are nowhere, and only once nothing finished and no message moved
            # for longer than a healthy run takes between two such events.
            quiet = now - last_progress
            # A run parked in a lease document moves when its key is released or its holder's lease
            # expires (the sweeper hands it over); parked with nothing moving for that long is stuck.
            nowhere = all(place == "nowhere" or place.startswith("parked") for place in where.values())
            if nowhere and quiet > self._stall_allowance():
                self.log(f"drain: no progress for {quiet:.0f}s; {len(waiting)} task(s) unfinished, nowhere")
                break
            # Messages the broker's own record proves lost (``lost_by_broker``: a node's log says kombu
            # could not restore it, or it was popped off its queue and never recorded as unacknowledged),
            # and that are nowhere since: they cannot come back, so the drain does not wait out the
            # allowance for them (about a minute of most Redis runs).
            if nowhere and quiet > 2 * self.cfg.lease_seconds + 5 and now - proven_at > 10:
                proven_at = now
                if lost_for_good(waiting, where, self._proven_lost(waiting, where)):
                    self.log(f"drain: {len(waiting)} unfinished, their messages lost by the broker")
                    break
            if now - t_begin > DRAIN_GUARD_S:
                self.log(f"drain: still {len(waiting)} unfinished after {DRAIN_GUARD_S:.0f}s; giving up")
                break
            time.sleep(0.5)
        self.drain_s = round(time.monotonic() - t_begin, 1)
        where = _merge_places(self._find_messages(waiting), self._parked_view(waiting)) if waiting else {}
        broker_log = self._broker_log() if waiting else None
        worker_events: dict[str, list[Doc]] = defaultdict(list)
        for e in read_histories(self.hist_dir) if waiting else []:
            if (
                e.get("ev") in ("recv", "pub", "ended", "admit", "parked", "handoff", "handed", "acq")
                and e.get("task_id") in waiting
            ):
                worker_events[e["task_id"]].append(e)
        unrestored = unrestored_task_ids(self.dir) if waiting else set()
        for task_id, info in waiting.items():
            try:
                state = backend.get_task_meta(task_id)["status"]
            except Exception as exc:
                state = f"unknown: {exc!r}"
            states[task_id] = {**info, "state": state, "result": None, "message": where.get(task_id)}
            place = where.get(task_id)
            lost = lost_by_broker(
                task_id, place, broker_log, self.faults, start=self.start_mono, unrestored=unrestored
            )
            if lost:
                states[task_id]["lost_by_broker"] = lost
            elif broker_log is not None:
                states[task_id]["broker_steps"] = broker_steps(broker_log, task_id, self.start_mono)
            states[task_id]["worker_events"] = [
                f"{e['ev']}@{_when(e) - self.start_mono:.2f}"
                + (f" {e.get('node')}" if e.get("node") else "")
                + (f" {e.get('state')}" if e.get("state") else "")
                + (f" {e.get('outcome')}" if e.get("outcome") else "")
                + (f" fence {e.get('fence')}" if e.get("fence") else "")
                for e in sorted(worker_events.get(task_id, []), key=_when)
            ]
            self.log(f"unfinished: {task_id} {states[task_id]}")
        self._wait_for_links(states)
        return states

    def _wait_for_links(self, states: dict[str, Doc]) -> None:
        """Wait for the callbacks of the linked runs that succeeded (``LINK_SHARE``): Celery sends one when
        its run ends, and a worker runs it soon after. Ends when all were called, or when none was for
        ``LINK_QUIET_S`` (``check_links`` then names the missing ones)."""
        due = {tid for tid, t in states.items() if t.get("link") and t.get("state") == "SUCCESS"}
        last, called = time.monotonic(), 0
        while due:
            seen = {e.get("task_id") for e in read_histories(self.hist_dir) if e.get("ev") == "linked"}
            if not due - seen:
                return
            if len(due & seen) > called:
                last, called = time.monotonic(), len(due & seen)
            if time.monotonic() - last > LINK_QUIET_S:
                self.log(f"drain: {len(due - seen)} callback(s) not called after {LINK_QUIET_S:.0f}s quiet")
                return
            time.sleep(0.5)

    def _stall_allowance(self) -> float:
        """The longest a healthy run goes with no task finishing and no message moving: a dead node's
        message comes back after the visibility timeout and a sweep, a replaced node takes its measured
        start-up time (twice the slowest seen in this run: the machine's load decides it), a contention
        retry backs off at most a second, a parked duplicate waits a lease length."""
        slowest_start = max([n.start_s for n in self.nodes] + self.start_times + [1.0])
        return VISIBILITY_TIMEOUT + 2 * RESTORE_INTERVAL + 2 * slowest_start + 4 * self.cfg.lease_seconds + 10

    def _parked_view(self, task_ids: Iterable[str]) -> dict[str, str]:
        """Unfinished runs parked in a lease document (``parked <key> #<position> ...``) or handed the key
        and not yet claimed (``parked <key> handoff ...``), with the key's owner and fence, so that a
        handoff or a claim counts as progress."""
        ids = set(task_ids)
        found: dict[str, str] = {}
        if self.store is None or not ids:
            return found
        try:
            docs = self.store.waiting_keys()
        except MongoLockError:
            return found
        for doc in docs:
            state = f"owner {str(doc.get('owner'))[:8]} fence {doc.get('fence')}"
            for i, entry in enumerate(doc.get("q") or []):
                if entry.get("t") in ids:
                    found[str(entry["t"])] = f"parked {doc['_id']} #{i + 1} {state}"
            lanes = ", ".join(
                f"rank {lane.get('r')}: {lane.get('h')}..{lane.get('t')}" for lane in doc.get("sp") or []
            )
            for entry in self._spilled(str(doc["_id"])):
                if entry.get("t") in ids:
                    found[str(entry["t"])] = f"spilled {doc['_id']} ({lanes}) {state}"
            ho = doc.get("ho") or {}
            if ho.get("t") in ids:
                found[str(ho["t"])] = f"parked {doc['_id']} handoff {ho.get('hn')} {state}"
            for hold in doc.get("hs") or []:  # a limit=N key's slot handed to a parked run
                sho = (hold.get("ho") or {}) if isinstance(hold, dict) else {}
                if sho.get("t") in ids:
                    found[str(sho["t"])] = (
                        f"parked {doc['_id']} handoff {sho.get('hn')} slot {hold.get('s')} "
                        f"fence {hold.get('f')}"
                    )
        return found

    def _broker_view(self, task_ids: Iterable[str]) -> dict[str, str]:
        """Where each unfinished task's message is: a queue, ``unacked``, ``nowhere``, or ``unknown``
        (the broker did not answer; on RabbitMQ, which cannot be looked into without taking messages)."""
        import redis

        ids = list(task_ids)
        if self.rabbit is not None:
            return dict.fromkeys(ids, "unknown")
        where = dict.fromkeys(ids, "nowhere")
        try:
            client = redis.Redis.from_url(self.redis.url, socket_timeout=5)
            try:
                places: dict[str, Any] = {q: client.lrange(q, 0, -1) for q in ("celery", SKEWED_QUEUE)}
                unacked: dict[bytes, bytes] = client.hgetall("unacked")  # type: ignore[assignment]
            finally:
                client.close()
        except Exception:
            return dict.fromkeys(ids, "unknown")
        for place, messages in places.items():
            for raw in messages:
                text = raw.decode(errors="replace")
                for task_id in ids:
                    if task_id in text:
                        where[task_id] = place
        for raw in unacked.values():
            text = raw.decode(errors="replace")
            for task_id in ids:
                if task_id in text:
                    where[task_id] = "unacked"
        return where

    def _links_lost_by_broker(self, tasks: dict[str, Doc]) -> None:
        """A linked run that ended ``SUCCESS`` and whose callback never ran, when the broker's record proves
        that it lost the callback's message (``lost_by_broker``: popped, never recorded as unacknowledged,
        a fault that cut the consumer off right then; seen in ci15, a broker SIGKILL 0.1 s after the pop):
        marked ``link_lost_by_broker``, which ``check_links`` counts instead of judging."""
        called = {str(e.get("task_id")) for e in read_histories(self.hist_dir) if e.get("ev") == "linked"}
        missing = {
            tid
            for tid, t in tasks.items()
            if t.get("link") and t.get("state") == "SUCCESS" and tid not in called
        }
        log = self._broker_log() if missing else None
        if log is None:
            return
        try:
            links = brokerlog.children_of(
                Path(self.redis.dir) / "appendonly.aof", missing, "lockcheck.linked"
            )
        except OSError:
            return
        for tid, link_id in links.items():
            lost = lost_by_broker(link_id, "nowhere", log, self.faults, start=self.start_mono)
            if lost:
                tasks[tid]["link_lost_by_broker"] = lost

    def _proven_lost(self, waiting: Iterable[str], where: Mapping[str, str]) -> set[str]:
        """The tasks of ``waiting`` that are nowhere and whose message the broker's record proves lost."""
        nowhere = [t for t in waiting if where.get(t) == "nowhere"]
        if not nowhere:
            return set()
        unrestored = unrestored_task_ids(self.dir)
        log = self._broker_log()
        return {
            t
            for t in nowhere
            if lost_by_broker(t, "nowhere", log, self.faults, start=self.start_mono, unrestored=unrestored)
        }

    def _broker_log(self) -> brokerlog.BrokerLog | None:
        if self.rabbit is not None:
            return None  # no log of RabbitMQ's to prove a loss with: none is excused
        try:
            return brokerlog.replay(Path(self.redis.dir) / "appendonly.aof")
        except OSError as exc:
            self.log(f"could not read the broker's append-only file: {exc!r}")
            return None

    def _clock_marks(self) -> None:
        """Write the monotonic time into the broker every CLOCK_MARK_INTERVAL seconds, so that each command
        in its append-only file lies between two known times (see tests/brokerlog.py)."""
        import redis

        client = redis.Redis.from_url(self.redis.url, socket_timeout=1, socket_connect_timeout=1)
        try:
            while not self._marks_stop.wait(CLOCK_MARK_INTERVAL):
                with contextlib.suppress(redis.RedisError, OSError):
                    client.set(brokerlog.CLOCK_KEY, repr(time.monotonic()))
        finally:
            client.close()

    def _find_messages(self, task_ids: Iterable[str]) -> dict[str, str]:
        """Where the broker holds each task's message: a queue, the unacknowledged set, or nowhere (lost)."""
        import redis

        found = dict.fromkeys(task_ids, "nowhere")
        if self.rabbit is not None:
            return {}  # RabbitMQ cannot be looked into without taking the messages
        try:
            client = redis.Redis.from_url(self.redis.url)
            places = {q: client.lrange(q, 0, -1) for q in ("celery", SKEWED_QUEUE)}
            places["unacked"] = list(client.hvals("unacked"))
        except Exception as exc:
            self.log(f"could not look into the broker: {exc!r}")
            return {}
        for place, messages in places.items():
            for raw in messages:
                text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
                for task_id in found:
                    if task_id in text:
                        found[task_id] = place
        return found

    def run(self) -> Doc:
        t_start = time.monotonic()
        slow_waits.clear()
        submitter = threading.Thread(target=self._submitter, name="lockcheck-submitter", daemon=True)
        supervisor = threading.Thread(target=self.supervise, name="lockcheck-supervisor", daemon=True)
        try:
            self.setup()
            setup_s = time.monotonic() - t_start
            self.log(f"set up in {setup_s:.1f}s: server {self.server.url}, {len(self.clients)} clients, "
                     f"{len(self.nodes)} nodes{' + 1 skewed node' if self.skewed_node else ''}")  # fmt: skip
            submitter.start()
            supervisor.start()
            self.faults_loop()
            self._stop.set()
            submitter.join(10)
            self.log("draining: clients stop, submitted tasks finish")
            # Where the time after the fault phase goes (``after_s``), stage by stage.
            after: dict[str, float] = {}
            mark = time.monotonic()

            def stage(name: str) -> None:
                nonlocal mark
                now = time.monotonic()
                after[name] = round(now - mark, 1)
                mark = now

            tasks = self.drain()
            stage("drain")
            self._links_lost_by_broker(tasks)
            stage("links")
            self._supervisor_stop.set()
            supervisor.join(130)
            stage("supervisor")
            nodes = [*self.nodes, *([self.skewed_node] if self.skewed_node else [])]
            for node in nodes:
                node.begin_stop()
            for node in nodes:
                node.stop()
            stage("nodes_stop")
            docs = self._final_docs()
            # Kept with the histories, so that a run can be checked again (``check``) from its workdir.
            (self.dir / "tasks.json").write_text(json.dumps(tasks, indent=1, default=str))
            (self.dir / "unique_sends.json").write_text(json.dumps(self.unique_sends, indent=1))
            history = History(read_histories(self.hist_dir), docs, tasks, self.unique_sends)
            stage("read")
            violations = check(history)
            stage("check")
            self.log(f"after the fault phase: {after}")
            extra = {
                "seed": self.cfg.seed,
                "broker": self.cfg.broker,
                "duration_s": round(time.monotonic() - t_start, 1),
                "fault_phase_s": round(self.cfg.duration + self.cfg.warmup, 1),
                "directed_s": self.directed_s,
                "directed_steps_s": self.directed_steps,
                "setup_s": round(setup_s, 1),
                "clients": self.cfg.clients,
                "worker_nodes": self.cfg.nodes + (1 if self.skewed_node else 0),
                "keys": len(docs),
                "doc_keys": self.cfg.doc_keys,
                "lease_seconds": self.cfg.lease_seconds,
                "faults_skipped": self.skipped_faults,
                "node_exits": self.node_exits,
                "node_stalls": self.node_stalls,
                "drain_s": self.drain_s,
                "after_s": after,
                "node_start_s": _stats(self.start_times),
                "multi_replace_directed": self.multi_replace_directed,
                "unique_directed": self.unique_directed,
                "capped_directed": self.capped_directed,
                "limits_capped_directed": self.limits_capped_directed,
                "rate_directed": self.rate_directed,
                "rate_bursts": dict(sorted(self.rate_bursts.items())),
                "rate_keys": self.cfg.rate_keys,
                "multi_replace_window": self.multi_replace_window,
                "multi_limit_replace_directed": self.multi_limit_replace_directed,
                "held_back_directed": self.held_back_directed,
                "mixed_directed": self.mixed_directed,
                "slow_waits": list(slow_waits),
            }
            report = figures(history, self.faults, violations, extra)
            report["fault_log"] = self.faults
            (self.dir / "report.json").write_text(json.dumps(report, indent=2, default=str))
            report["workdir"] = str(self.dir)
            return report
        finally:
            self._stop.set()
            self._supervisor_stop.set()
            self.close()

    def _final_docs(self) -> dict[str, Doc]:
        docs = docs_collection(self.server.url, self.db)
        found = _wait(lambda: list(docs.find({"_id": {"$regex": "^" + PREFIX}})), 30, "the final documents")
        return {str(d["_id"]): d for d in found}

    def close(self) -> None:
        self._marks_stop.set()
        if self._gate_hist is not None:
            self._gate_hist.close()
        self.stop_file.write_text("stop")
        for proc in self.clients:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        for node in [*self.nodes, *([self.skewed_node] if self.skewed_node else [])]:
            with contextlib.suppress(Exception):
                node.stop(timeout=10)
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.close()
        self.server.stop()
        # Keep the broker's own record with the histories (tests/brokerlog.py replays it).
        with contextlib.suppress(OSError):
            shutil.copyfile(Path(self.redis.dir) / "appendonly.aof", self.dir / "broker-appendonly.aof")
        self.redis.stop()
        if self.rabbit is not None:
            with contextlib.suppress(OSError):
                shutil.copyfile(self.rabbit.log_path, self.dir / "rabbitmq.log")
            self.rabbit.stop()


def _when(event: Doc) -> float:
    """When a history event happened (an acquisition: when its reply came)."""
    return float(event.get("t") or event.get("t1") or 0.0)


def _merge_places(broker: dict[str, str], parked: dict[str, str]) -> dict[str, str]:
    """Where each unfinished task is: a message in the broker first, else parked in a lease document."""
    out = dict(broker)
    for task_id, place in parked.items():
        if out.get(task_id) in (None, "nowhere", "unknown"):
            out[task_id] = place
    return out


def _plain(value: Any) -> Any:
    """A task result as JSON-able data (exceptions as their repr)."""
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def run(cfg: Config) -> Doc:
    """Run the checker once; returns the figures (``violations`` must be 0)."""
    return Run(cfg).run()


_NO_DOCUMENTS: Doc = {
    "holds": 0, "client_holds": 0, "released_cleanly": 0, "taken_over": 0, "writes": {}, "gate_holds": 0,
    "gate_writes": {}, "takeover": {},
}  # fmt: skip


_NO_UNIQUE: Doc = {
    "sends": 0, "refused": 0, "runs": 0, "sends_that_got_a_pending_run": 0, "runs_with_a_body": 0, "done": 0,
    "directed": {}, "faults_with_a_pending_unique_run": {},
}  # fmt: skip


_NO_RATE: Doc = {
    "submitted": 0, "done": 0, "parked": 0, "parked_then_done": 0, "grants": 0, "parks": 0, "unanswered": 0,
    "bodies": 0, "starts": 0, "most_starts_in_a_window": 0, "gate_places_kept": 0, "directed": {}, "gated": 0,
    "gated_parked_then_done": 0, "gated_lost_by_broker": 0, "faults_with_a_rate_parked_run": {},
}  # fmt: skip


def format_report(report: Doc) -> str:
    ops, tasks = report["operations"], report["tasks"]
    lines = [
        f"lock-set checker: seed {report['seed']}, {report['duration_s']}s "
        f"({report['fault_phase_s']}s under faults), {report['clients']} bare clients, "
        f"{report['worker_nodes']} worker nodes, {report['keys']} keys, lease {report['lease_seconds']}s",
        f"  acquisitions {report['acquisitions']}, contended {report['contended']}",
        f"  operations attempted {ops['attempted']}, acknowledged {ops['acknowledged']} "
        f"({ops['acknowledged_after_ambiguous_retry']} after an ambiguous retry), "
        f"fenced out {ops['fenced_out']} ({ops['fenced_out_reckless']} reckless), "
        f"loss detected {ops['lease_loss_detected']}, "
        f"ambiguous {ops['ambiguous']}, claims fenced {ops['claims_fenced']}, "
        f"store errors {ops['store_errors']}",
        "  document locks: holds {holds} ({client_holds} by bare clients, {released_cleanly} released "
        "cleanly, {taken_over} taken over), writes {writes}, held through faults {gate_holds} (their writes "
        "{gate_writes}), directed takeover {takeover}".format(**report.get("document") or _NO_DOCUMENTS),
        f"  tasks submitted {tasks['submitted']}, done {tasks['done']}, skipped {tasks['skipped']}, "
        f"superseded {tasks['superseded']}, "
        f"runs {tasks['runs']}, unfinished {tasks['unfinished']} "
        f"(lost by the broker {tasks['lost_by_broker']}) "
        f"(skewed node: submitted {tasks['skewed_node_submitted']}, ended {tasks['skewed_node_ended']})",
        f"  died after their body released the key {tasks.get('died_after_release', 0)} (ended already-ran "
        f"{tasks.get('died_ended_already_ran', 0)}, fault-gated {tasks.get('died_fault_gated', 0)}); "
        f"died with their lease lost first {tasks.get('died_with_the_lease_lost', 0)}",
        "  queued runs: Queue {queue_submitted}, Replace {replace_submitted}; parked {parked} (spilled "
        "beyond the window {spilled}), "
        "handoffs {handoffs} ({lane_handoffs} received through a lane), superseded {superseded} "
        "({superseded_after_a_cut_run} after a run cut "
        "short), pairs run out of send order by a late arrival {late_pairs}; runs sent with a priority "
        "{sent_with_priority} (pairs in which a newer send of a higher priority got the key first "
        "{priority_overtakes}); admissions {admissions}; "
        "Replace runs with a link callback that ended {linked_runs} ({linked_superseded} superseded; "
        "callbacks called twice {links_called_twice})".format_map(defaultdict(int, report["queued"])),
        "  faults that found queued runs parked or hit a queued key's holder: "
        + ", ".join(f"{k} {v}" for k, v in report["queued"]["faults_hitting_queued_runs"].items()),
        "  limit={limit} keys: holds {limit_holds} ({limit_clean_holds} released cleanly, {limit_task_runs} "
        "by the limit=N tasks; tasks {limit_submitted}), most clean holds at once per key "
        "{max_clean_holds_at_once}, "
        "slots used {slots_used}; several-keys tasks {multi_submitted} (key pairs named in both orders "
        "{multi_key_pairs_both_orders}, skipped {multi_skipped}), bodies {multi_bodies} (all keys written "
        "{multi_bodies_all_written}, started with a lease past its deadline "
        "{multi_bodies_started_past_a_deadline}; Celery acquires answered after their own deadline "
        "{task_acquires_answered_past_their_deadline}); faults hitting a limit key's holder "
        "{faults_hitting_limit_keys}, a several-keys body's {faults_hitting_multi_bodies}; faults that began "
        "while limit holds ran {faults_during_limit_holds}, while several-keys bodies ran "
        "{faults_during_multi_bodies}".format(**report["limit_multi"]),
        "  several keys with a limit per key: tasks {submitted}, done {done}, bodies {bodies} (a slot and a "
        "single lease {bodies_with_a_slot_and_a_single_lease}), slot holds {slot_holds}, contentions "
        "{contentions} (runs that found each kind of key held or full {contended_runs}), most clean holds "
        "of an l key at once with a slot of theirs {most_clean_holds_at_once_with_a_slot_of_theirs}; faults "
        "hitting a body {faults_hitting_bodies}, that began while a body ran {faults_during_bodies}".format(
            **report["limit_multi"]["multi_limit"]
        ),
        "  reentrant runs: tasks {submitted}, done {done}, bodies {bodies}; reentrant holds {reentered} "
        "(of a slot {reentered_slots}), asks that got a lease of their own {not_reentered}, done runs that "
        "reentered both ways {done_runs_that_reentered_both_ways}; faults hitting a body "
        "{faults_hitting_bodies}".format(**report["reentrant"]),
        _multi_replace_line(
            "several keys under Replace",
            report.get("multi_replace") or {},
            "(directed burst: reservations taken back by a newer send {taken_back}, the overlapping run "
            "parked behind them {other_parked_behind})",
            report.get("multi_replace_directed") or {},
        ),
        _multi_replace_line(
            "several keys with a limit per key under Replace",
            report.get("multi_limit_replace") or {},
            "(directed burst: runs parked for a slot superseded by a newer send "
            "{parked_for_a_slot_superseded})",
            report.get("multi_limit_replace_directed") or {},
        ),
        "  unique sends: {sends} (refused: MongoDB did not answer {refused}), runs {runs}, sends answered "
        "with a pending run {sends_that_got_a_pending_run}, runs with a body {runs_with_a_body}, "
        "done {done}; directed burst {directed}; faults while a unique run was pending "
        "{faults_with_a_pending_unique_run}".format(**(report.get("unique") or _NO_UNIQUE)),
        f"  rate=RateLimit({RATE_N}, {RATE_PERIOD:g}): runs {{submitted}}, done {{done}}, parked by the rate "
        "{parked} (then done {parked_then_done}); attempts at a start: granted {grants}, parked {parks}, "
        "unanswered {unanswered}; bodies {bodies}; starts recorded {starts} (most in one window "
        "{most_starts_in_a_window}); the controller's gates' places kept {gate_places_kept}; directed burst "
        "{directed}; "
        "gated runs {gated} (parked then done {gated_parked_then_done}, lost by the broker "
        "{gated_lost_by_broker}); "
        "faults while runs were parked by the rate {faults_with_a_rate_parked_run}; random bursts by size "
        "{bursts}".format(**(report.get("rate") or _NO_RATE), bursts=report.get("rate_bursts") or {}),
        *(
            f"  Queue runs with {what}: submitted {f['submitted']}, parked {f['parked']}, handed "
            f"{f['handed']} (handoff records {f['handoffs']}, handed again {f['rehandoffs']}), done "
            f"{f['done']}, timed out {f.get('timed_out', 0)}; faults while one waited or ran "
            f"{f['faults_while_waiting_or_running']}"
            for what, f in (
                ("limit=N", report["queued"]["limit_queued"]),
                ("several keys", report["queued"]["multi_queued"]),
                (f"several keys and timeout={TIMED_WAIT_S:g}", report["queued"].get("multi_timed") or {}),
            )
            if f
        ),
        "  faults " + ", ".join(f"{k} {v}" for k, v in report["faults"].items()),
    ]
    if report.get("faults_skipped"):
        lines.append(
            "  faults skipped: " + "; ".join(f"{k}: {v}" for k, v in report["faults_skipped"].items())
        )
    lines.append(
        "  recovery (fault -> key next acquired) "
        + ", ".join(
            f"{k} median {v['median_s']}s max {v['max_s']}s (n={v['n']})"
            for k, v in report["recovery"].items()
            if v["n"]
        )
    )
    if report.get("node_exits"):
        lines.append(
            f"  worker nodes that exited on their own and were replaced: {len(report['node_exits'])} "
            f"(last error: {report['node_exits'][-1].get('last_error')})"
        )
    for stall in report.get("node_stalls") or []:
        lines.append(
            f"  FINDING: worker node {stall['node']} stalled at {stall['at_s']}s: nothing consumed for "
            f"{stall['quiet_s']}s (allowance {stall['allowance_s']}s) with "
            + (f"{stall['ready']} message(s) ready" if stall.get("ready") is not None else "work waiting")
            + f" in {stall['queue']}; killed and replaced (processes: {stall.get('states')})"
            + (f" ({stall['why']})" if stall.get("why") else "")
        )
    if "drain_s" in report:
        lines.append(
            f"  drain {report['drain_s']}s; node start-up median {report['node_start_s'].get('median_s')}s "
            f"max {report['node_start_s'].get('max_s')}s"
        )
    if report.get("slow_waits"):
        waits = report["slow_waits"]
        total = round(sum(w[1] for w in waits), 1)
        lines.append(
            f"  the controller's waits over {SLOW_WAIT_S:g}s: {len(waits)}, {total}s in all: "
            + "; ".join(f"{what} {s}s{'' if met else ' (timed out)'}" for what, s, met in waits)
        )
    mx = report.get("mixed") or {}
    if mx:
        lines.append(
            f"  keys used both ways: runs {mx.get('runs')}, holds {mx.get('holds')}, runs kept aside as the "
            f"other kind {mx.get('runs_kept_aside_as_the_other_kind')}; directed {mx.get('directed')}; "
            f"faults hitting such a key {mx.get('faults_hitting_mixed_keys')}, that began with a run kept "
            f"aside {mx.get('faults_with_a_run_kept_aside')}"
        )
    lines.append(f"  violations {report['violations']}")
    lines += [f"    {v}" for v in report["violation_list"]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "client":
        client_main(json.loads(args[1]))
        return 0
    raise SystemExit(
        "usage: python -m tests.lockcheck client CONFIG_JSON (use scripts/soak.py to run the checker)"
    )


if __name__ == "__main__":
    sys.exit(main())
