"""The code ``EmbeddedMongo`` runs in the embedded server's process before it starts (never in ours):
patches of SecantusDB's internals, each measured (py-spy, ``benchmarks/embedded_*.py``), each tested
against SecantusDB's own answer (``tests/test_embedded.py``), and each left out when SecantusDB's
internals are not the ones it was written for. ``LAUNCH`` is the whole ``python -c`` program."""

from __future__ import annotations

__all__ = ["AWAIT", "COPY", "LAUNCH", "LOOKUP", "PARSE", "PLAN", "PROFILE", "SEEK", "TUNE", "WAKE", "ZONE"]

#: Run in the server's process before it starts (never in ours). SecantusDB 0.7 keeps the replies of the
#: last 10,000 retryable writes, and prunes them on every retryable write and lookup: a scan of all of
#: them, and once there are 10,000, a sort of all of them to drop the oldest one. pymongo makes every
#: write retryable, so a busy server spent a quarter of its time there (the lock-set checker's server,
#: measured with py-spy), every write slower than the last, until the 10,000th, then each one paying for
#: a sort. Here the scan for records past their lifetime runs at most once a second, and past the cap the
#: oldest tenth is dropped at once (in insertion order, which is their age): the same records are kept,
#: give or take a second and a tenth of the cap. Left as it is when SecantusDB's internals are not the
#: ones this was written for.
TUNE = """
try:
    import itertools
    from secantus import transactions as _t

    _cap, _life = int(_t._RETRYABLE_RECORD_MAX), float(_t._RETRYABLE_RECORD_LIFETIME_SECONDS)

    def _prune(self):
        now = self._time()
        if now >= getattr(self, "_mongolock_next_sweep", 0.0):
            self._mongolock_next_sweep = now + 1.0
            for k in [k for k, v in self._retryable.items() if v[1] < now - _life]:
                self._retryable.pop(k, None)
        excess = len(self._retryable) - _cap
        if excess > 0:
            for k in list(itertools.islice(iter(self._retryable), excess + _cap // 10)):
                self._retryable.pop(k, None)

    if callable(getattr(_t.TransactionRegistry, "_prune_retryable_locked", None)):
        _t.TransactionRegistry._prune_retryable_locked = _prune
except Exception:
    pass
"""
#: SecantusDB's main thread waits for its stop in ``Event.wait()`` with no timeout, and its SIGTERM handler
#: (which stops the server) runs only in that thread. A process signal the kernel delivers to another of
#: its threads does not wake that wait, so the handler never ran and the server never exited: ``stop`` then
#: SIGKILLed it after its timeout (2 of 150 stops under load; a fault handler's stacks showed the main
#: thread still in ``wait``). Waiting in slices of 0.2 s lets the handler run within one slice.
WAKE = """
try:
    from secantus import server as _s

    _wait_forever = _s.SecantusDBServer.wait

    def _wait(self):
        stop = getattr(self, "_stop_event", None)
        if stop is None:
            return _wait_forever(self)
        while not stop.wait(0.2):
            pass

    _s.SecantusDBServer.wait = _wait
except Exception:
    pass
"""
#: SecantusDB 0.7 finds where a change stream opened with ``startAtOperationTime`` begins by reading and
#: decoding its whole oplog, from the oldest entry, while it holds the lock every other command needs. Its
#: oplog keeps up to 100,000 entries for an hour, so a busy server's stream openings got slower with every
#: write: 4 s each with 46,801 entries (the lock-set checker's server in CI), during which no command
#: was answered and 2-second leases lapsed everywhere (the lease watcher opens such a stream for each new
#: batch of leases). Entries are in send order of their time and sequence number together, so here the
#: first entry at or after the time is found by bisection over the sequence numbers, a few point reads
#: (the same answer; the whole scan again if an entry has no time). Left as it is when SecantusDB's
#: internals are not the ones this was written for.
SEEK = """
try:
    from bson import Timestamp as _Ts
    from secantus import storage as _st

    _scan_all = _st.Storage._find_seq_for_ts_scan

    def _seek(self, ts):
        with self._lock:
            if self._closed:
                return 0
            session = self._conn.open_session()
            try:
                found, lo, hi = self._next_seq, 0, self._next_seq
                while lo < hi:
                    mid = (lo + hi) // 2
                    rows, _high = self._merge_oplog_on_session(session, mid, 1)
                    if not rows or rows[0][0] >= hi:
                        hi = mid  # no entry in [mid, hi)
                        continue
                    seq, entry = rows[0]
                    at = entry.get("ts")
                    if not isinstance(at, _Ts):
                        found = None
                        break
                    if at.time > ts.time or (at.time == ts.time and at.inc >= ts.inc):
                        found, hi = seq, mid  # this one qualifies: the first is here or before mid
                    else:
                        lo = seq + 1  # it and every entry before it are older
            finally:
                try:
                    session.close()
                except Exception:
                    pass
        return _scan_all(self, ts) if found is None else found

    if callable(getattr(_st.Storage, "_merge_oplog_on_session", None)) and callable(_scan_all):
        _st.Storage._find_seq_for_ts_scan = _seek
except Exception:
    pass
"""
#: SecantusDB 0.7 reads a database's profiling level from its storage, under the same lock, after every
#: command it answers (6 to 8% of the lock-set checker's server, measured with py-spy). Only
#: ``set_profile`` writes it, so here it is read once per database and kept until ``set_profile`` runs.
PROFILE = """
try:
    from secantus import storage as _sp

    _get_profile, _set_profile = _sp.Storage.get_profile, _sp.Storage.set_profile

    def _cached_profile(self, db):
        kept = self.__dict__.setdefault("_mongolock_profiles", {})
        if db not in kept:
            kept[db] = _get_profile(self, db)
        return dict(kept[db])

    def _set_and_forget(self, db, **settings):
        self.__dict__.setdefault("_mongolock_profiles", {}).pop(db, None)
        try:
            return _set_profile(self, db, **settings)
        finally:
            self.__dict__["_mongolock_profiles"].pop(db, None)

    if "_PROFILE_TABLE" in vars(_sp) and callable(_get_profile) and callable(_set_profile):
        _sp.Storage.get_profile, _sp.Storage.set_profile = _cached_profile, _set_and_forget
except Exception:
    pass
"""
#: Run in the server's process. SecantusDB's ``$set``/``$addFields``, exclusion ``$project`` and ``$unset``
#: stages deep-copy each whole document before they change a few of its fields. The library's admission
#: and release commands are update pipelines of several such stages over a lease document, and the
#: sweeper's list is an aggregation of two over every key with parked runs, so each copied the documents,
#: their parked runs and their history, once per stage: about a third of the server's time in
#: ``copy.deepcopy`` (py-spy, holding the GIL, on the lock-set checker's server and a CI worker's). Here a
#: stage copies a document's top level, and the containers on the paths it changes (a dotted path's), and
#: shares the rest: its output is the same, and no document it was given is changed. (A value a stage
#: computes from a field may be that field's very object, as before.) Only where SecantusDB itself lets
#: stages share subtrees (no ``$fill`` or ``$densify`` in the pipeline), and left as it is when its
#: internals are not the ones this was written for.
COPY = """
try:
    from collections.abc import Mapping as _Mapping
    from secantus import aggregate as _ag

    def _fresh(value, segments):
        # A copy of ``value`` whose containers along ``segments`` are new, the rest shared: every container
        # ``set_path``/``unset_path`` can write to on that path (by key, by index, or element by element).
        if not segments or not isinstance(value, (dict, list)):
            return value
        head, rest = segments[0], segments[1:]
        if isinstance(value, dict):
            out = dict(value)
            if head in out:
                out[head] = _fresh(out[head], rest)
            return out
        index = int(head) if head.isdigit() else -1
        return [
            _fresh(_fresh(v, rest), segments) if i == index else _fresh(v, segments)
            for i, v in enumerate(value)
        ]

    def _fresh_top(result, path):
        top, _, below = path.partition(".")
        if below and top in result:
            result[top] = _fresh(result[top], below.split("."))

    def _add_fields_one(doc, spec, vars):
        result = dict(doc)
        for path, expr in spec.items():
            value = _ag.evaluate_or_missing(expr, doc, vars)
            _fresh_top(result, path)
            if value is _ag.MISSING:
                _ag.unset_path(result, path)
            else:
                _ag.set_path(result, path, value)
        return result

    def _without(doc, paths):
        result = dict(doc)
        for path in paths:
            _fresh_top(result, path)
            _ag.unset_path(result, path)
        return result

    def _excludes_only(spec):
        return bool(spec) and all(v is False or (not isinstance(v, bool) and v == 0) for v in spec.values())

    def _gated(shipped, fast):
        # Only where SecantusDB itself lets stages share subtrees: no stage of the pipeline writes through
        # the documents it is given ($fill, $densify: ``PipelineContext.shared_unwind_ok``).
        def stage(spec, docs, ctx, **kwargs):
            if getattr(ctx, "shared_unwind_ok", None) is True:
                out = fast(spec, docs, ctx)
                if out is not None:
                    return out
            return shipped(spec, docs, ctx, **kwargs)

        return stage

    def _set_fast(spec, docs, ctx):
        if isinstance(spec, _Mapping):
            return [_add_fields_one(d, spec, ctx.vars) for d in docs]
        return None

    def _project_fast(spec, docs, ctx):
        if isinstance(spec, _Mapping) and _excludes_only(spec):
            return [_without(d, spec) for d in docs]
        return None

    def _unset_fast(spec, docs, ctx):
        _shipped["$unset"](spec, [], ctx)  # its checks of the spec, and their errors
        paths = [spec] if isinstance(spec, str) else list(spec)
        return [_without(d, paths) for d in docs]

    _stages = getattr(_ag, "_STAGES", None)
    _shipped = {n: _stages.get(n) for n in ("$addFields", "$set", "$project", "$unset")} if _stages else {}
    if (
        all(callable(f) for f in _shipped.values()) and len(_shipped) == 4
        and all(callable(getattr(_ag, n, None)) for n in ("evaluate_or_missing", "set_path", "unset_path"))
        and hasattr(_ag, "MISSING")
        and "shared_unwind_ok" in getattr(_ag.PipelineContext, "__dataclass_fields__", {})
    ):
        for _name, _fast in (
            ("$addFields", _set_fast), ("$set", _set_fast),
            ("$project", _project_fast), ("$unset", _unset_fast),
        ):
            _stages[_name] = _gated(_shipped[_name], _fast)
except Exception:
    pass
"""
#: Run in the server's process. SecantusDB plans a query on an index only when its filter has no top-level
#: operator: ``{"_id": key, "$or": [...]}`` and ``{"_id": key, "$expr": ...}``, the shape of the library's
#: conditional writes (a release by its owner, a slot's claim, a spilled run's refill), read and decoded
#: every lease document to find one (the lock-set checker's server: 600 such scans, 15 ms each). Here a
#: filter whose top-level operators are all conjunctions (``$and``, ``$or``, ``$nor``, ``$expr``,
#: ``$comment``, ``$jsonSchema``) is planned on its plain fields, as MongoDB does; every caller then
#: matches the whole filter against each candidate, so the answer is the same. Left as it is when
#: SecantusDB's internals are not the ones this was written for.
PLAN = """
try:
    from secantus import storage as _sp

    _plan_as_shipped = _sp.Storage._try_index_id_keys
    _ANDED = frozenset({"$and", "$or", "$nor", "$expr", "$comment", "$jsonSchema"})

    def _try_index_id_keys(self, db, coll, filter, *, collation=None):
        if filter and isinstance(filter, dict):
            ops = [f for f in filter if isinstance(f, str) and f.startswith("$")]
            if ops and len(ops) < len(filter) and all(op in _ANDED for op in ops):
                plain = {f: v for f, v in filter.items() if f not in ops}
                return _plan_as_shipped(self, db, coll, plain, collation=collation)
        return _plan_as_shipped(self, db, coll, filter, collation=collation)

    if callable(_plan_as_shipped) and callable(getattr(_sp.Storage, "_scan_docs_natural", None)):
        _sp.Storage._try_index_id_keys = _try_index_id_keys
except Exception:
    pass
"""
#: Run in the server's process. Before every pipeline update and aggregation SecantusDB walks each stage's
#: expressions for a date operator with a literal time zone, in Python, node by node (a tenth of its time
#: under the lock-set checker: the library's admission pipelines are large). Here the stage is first
#: encoded to BSON (in C) and walked only when an operator's name is in its bytes: an answer of "no
#: problem" without the walk, the same answer with it. Left as it is when SecantusDB's internals are not
#: the ones this was written for.
ZONE = """
try:
    import bson as _bson
    from secantus import aggregate as _ag

    _zone_as_shipped = _ag._literal_timezone_problem
    _zone_names = tuple(n.encode() + b"\\x00" for n in (*_ag._TIMEZONE_OPERATORS, "$dateFromString"))

    def _literal_timezone_problem(spec):
        if isinstance(spec, (dict, list)):
            try:
                blob = _bson.encode({"s": spec})
            except Exception:
                blob = None
            if blob is not None and not any(name in blob for name in _zone_names):
                return None
        return _zone_as_shipped(spec)

    if callable(_zone_as_shipped) and isinstance(getattr(_ag, "_TIMEZONE_OPERATORS", None), frozenset):
        _ag._literal_timezone_problem = _literal_timezone_problem
except Exception:
    pass
"""
#: Run in the server's process. A change stream's ``getMore`` in SecantusDB 0.7 waits for a write to *any*
#: collection, then reads the oplog under the lock every command needs and answers at once, with an empty
#: batch when that write was on another collection or did not pass the stream's ``$match``; the driver asks
#: again at once. Every write therefore cost each open stream a read of the oplog and a whole command (the
#: lease watchers: one per worker process), most of them with nothing in them. mongod waits out
#: ``maxAwaitTimeMS`` until an event passes. Here, for a stream on one collection with a positive
#: ``maxTimeMS`` (the driver sends the stream's ``max_await_time_ms``), the oplog is read when an entry of
#: that collection (or of a command: a drop, a transaction) has been written since the last read, and the
#: batch is answered when an event passes or the wait is over. Every other ``getMore`` is as shipped. Left
#: as it is when SecantusDB's internals are not the ones this was written for.
AWAIT = """
try:
    import threading as _aw_threading
    import time as _aw_time
    from secantus import commands as _aw
    from secantus import storage as _aw_st

    _get_more_as_shipped = _aw._HANDLERS["getMore"]
    _emit_as_shipped = _aw_st.Storage._emit_oplog
    _mint_as_shipped = _aw_st.Storage._mint_oplog_seq_and_ts
    _aw_names = _aw_threading.local()
    _aw_lock = _aw_threading.Lock()
    #: The highest sequence number minted for an entry of each namespace; "$cmd": of any command
    #: namespace; "*": of entries whose namespace is not known here (they concern every stream).
    _aw_minted = {}

    def _emit_oplog(self, entries, pre_images=None):
        _aw_names.ns = [e.get("ns") if isinstance(e, dict) else None for e in entries]
        try:
            return _emit_as_shipped(self, entries, pre_images)
        finally:
            _aw_names.ns = None

    def _mint_oplog_seq_and_ts(self, n):
        start, stamps = _mint_as_shipped(self, n)
        try:  # (never in the way of the write: its range must leave the in-flight window)
            names = getattr(_aw_names, "ns", None)
            if names is None or len(names) != n:
                names = [None] * n
            with _aw_lock:
                for i, ns in enumerate(names):
                    name = "*" if not isinstance(ns, str) else "$cmd" if "$cmd" in ns else ns
                    if _aw_minted.get(name, 0) < start + i:
                        _aw_minted[name] = start + i
        except Exception:
            pass
        return start, stamps

    def _written_for(ns):
        return max(_aw_minted.get(ns, 0), _aw_minted.get("$cmd", 0), _aw_minted.get("*", 0))

    def _stream_of(doc, ctx):
        try:
            entry = ctx.cursors.get(int(doc["getMore"]))
        except Exception:
            return None
        ns = getattr(entry, "namespace", None)
        if not getattr(entry, "change_stream", False) or not isinstance(ns, str):
            return None
        if "$" in ns or "." not in ns or not isinstance(getattr(entry, "position_seq", None), int):
            return None
        return entry

    def _open_and_empty(reply):
        cursor = reply.get("cursor") if isinstance(reply, dict) else None
        return reply.get("ok") == 1 and isinstance(cursor, dict) and cursor.get("nextBatch") == [] and bool(
            cursor.get("id")
        )

    def _get_more(doc, ctx):
        budget = doc.get("maxTimeMS")
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
            return _get_more_as_shipped(doc, ctx)
        entry = _stream_of(doc, ctx)
        if entry is None:
            return _get_more_as_shipped(doc, ctx)
        storage, ns = ctx.storage, entry.namespace
        deadline = _aw_time.monotonic() + budget / 1000.0
        poll = {**doc, "maxTimeMS": 0}  # one read of the oplog, no wait (mongod: a poll)
        while True:
            seen_written, seen_visible = _written_for(ns), storage.oplog_visible_tail_seq_nolock()
            before = entry.position_seq
            reply = _get_more_as_shipped(poll, ctx)
            if not _open_and_empty(reply) or entry.invalidated or entry.dropped:
                return reply
            left = deadline - _aw_time.monotonic()
            if left <= 0:
                return reply
            if before < entry.position_seq < seen_visible:
                continue  # the read stopped at its row limit: more was written than it took

            def woken():
                written = _written_for(ns)
                visible = storage.oplog_visible_tail_seq_nolock()
                return (
                    written > seen_written
                    or (written > entry.position_seq and visible > seen_visible)
                    or entry.invalidated
                    or entry.dropped
                    or storage._shutting_down
                )

            with storage._oplog_cv:
                woke = storage._oplog_cv.wait_for(woken, timeout=left)
            if not woke:
                if storage.oplog_visible_tail_seq_nolock() > entry.position_seq:
                    reply = _get_more_as_shipped(poll, ctx)  # (as shipped: a read after the wait)
                return reply
            if storage._shutting_down:
                return reply  # the server stops: answered now, as shipped (no loop till the deadline)
            if entry.invalidated and not entry.dropped:
                # killCursors woke it and may have taken the cursor out of the registry already: the
                # answer is from the cursor in hand (ok, id 0), as shipped (a poll would answer 43).
                return {**reply, "cursor": {**reply["cursor"], "id": _aw.bson.Int64(0)}}

    if callable(_get_more_as_shipped) and callable(getattr(_aw, "_drain_change_stream_producer", None)):
        if callable(_emit_as_shipped) and callable(_mint_as_shipped):
            _aw_st.Storage._emit_oplog = _emit_oplog
            _aw_st.Storage._mint_oplog_seq_and_ts = _mint_oplog_seq_and_ts
            _aw._HANDLERS["getMore"] = _get_more
except Exception:
    pass
"""
#: Run in the server's process. Before every pipeline update (and aggregation) SecantusDB checks each stage
#: of the pipeline for parse-time problems, in Python: it walks every expression, and folds the constant
#: ones to find an error in them. The library's admission pipelines are large, and most of their stages are
#: the same from one command to the next (the values that change sit in a few): a third of the server's
#: time under the test suite went to these checks (py-spy). Here each stage's answer is kept, by the
#: stage's BSON with the command's variables and the names bound: a stage seen before gets the answer it
#: got then (the check reads nothing else), and a pipeline's answer is its first stage's problem, as
#: shipped. Stages over 64 KiB (a parked run's message) are checked each time, and the kept answers are
#: dropped at 32 MiB. Left as it is when SecantusDB's internals are not the ones this was written for.
PARSE = """
try:
    import bson as _pp_bson
    from secantus import aggregate as _pp_ag
    from secantus import commands as _pp_cmd

    _pp_as_shipped = _pp_ag.expression_problem_in_pipeline
    _pp_kept = {}
    _pp_size = [0]

    def _pp_problem(stage, bound, fold_vars):
        try:
            blob = _pp_bson.encode({"s": stage, "v": dict(fold_vars or {})})
        except Exception:
            blob = None
        if blob is None or len(blob) > 65536:
            return _pp_as_shipped([stage], bound, fold_vars)
        key = (blob, frozenset(bound))
        try:
            return _pp_kept[key]
        except KeyError:
            pass
        found = _pp_as_shipped([stage], bound, fold_vars)
        if _pp_size[0] > 32 * 2**20:
            _pp_kept.clear()
            _pp_size[0] = 0
        _pp_kept[key] = found
        _pp_size[0] += len(blob)
        return found

    def expression_problem_in_pipeline(pipeline, bound, fold_vars=None):
        if not isinstance(pipeline, list):
            return _pp_as_shipped(pipeline, bound, fold_vars)
        for stage in pipeline:
            found = _pp_problem(stage, bound, fold_vars)
            if found:
                return found
        return None

    if callable(_pp_as_shipped) and _pp_cmd.expression_problem_in_pipeline is _pp_as_shipped:
        _pp_ag.expression_problem_in_pipeline = expression_problem_in_pipeline
        _pp_cmd.expression_problem_in_pipeline = expression_problem_in_pipeline
except Exception:
    pass
"""
#: Run in the server's process. For a change stream opened with ``fullDocument: "updateLookup"``, SecantusDB
#: reads the changed document of every update before the stream's own stages see the event, so each update
#: of the lease collection cost one read per open stream (a process's lease watch), the heartbeat's renewals
#: included, which the watch's first ``$match`` drops (``documents.changes.loss_events_pipeline``). MongoDB
#: applies such a ``$match`` to the oplog before the lookup (its change-stream rewrites). Here the stream's
#: leading ``$match`` stages that name no ``fullDocument`` field (nor ``$$NOW``, which the first pipeline
#: run fixes) are tried on the event without its document first; an update they drop is dropped before
#: the read. Every other event, and every event they keep, is made as shipped and goes through the whole
#: pipeline as shipped. The server's CPU for 3,030 updates of leases with one watch open: 8.8 s -> 7.7 s;
#: with nine: 38.9 s -> 36.6 s (most of a stream's cost is its reads of the oplog). Left as it is when
#: SecantusDB's internals are not the ones this was written for.
LOOKUP = """
try:
    import threading as _lk_threading
    from secantus import aggregate as _lk_ag
    from secantus import changestreams as _lk_cs
    from secantus import commands as _lk_cmd

    _lk_drain_as_shipped = _lk_cmd._drain_change_stream_producer
    _lk_project_as_shipped = _lk_cs.project
    _lk_plain = _lk_cs.FULL_DOC_DEFAULT
    _lk_here = _lk_threading.local()

    def _lk_leading_match(producer):
        # (the stages after ``$changeStream`` and their context, from the stream's producer)
        try:
            cells = dict(zip(producer.__code__.co_freevars, producer.__closure__ or ()))
            stages, ctx = cells["pipeline_after_cs"].cell_contents, cells["pipeline_ctx"].cell_contents
        except Exception:
            return None
        lead = []
        for stage in stages if isinstance(stages, list) else ():
            said = repr(stage)
            if not (isinstance(stage, dict) and list(stage) == ["$match"]) or "fullDocument" in said:
                break
            if "$$NOW" in said:
                break
            lead.append(stage)
        return (lead, ctx) if lead else None

    def _lk_drain(entry):
        producer = getattr(entry, "producer", None)
        lead = None
        if producer is not None:
            lead = getattr(producer, "_mongolock_lead", False)
            if lead is False:
                lead = _lk_leading_match(producer)
                producer._mongolock_lead = lead
        _lk_here.lead = lead
        try:
            return _lk_drain_as_shipped(entry)
        finally:
            _lk_here.lead = None

    def _lk_project(seq, oplog_entry, **kwargs):
        lead = getattr(_lk_here, "lead", None)
        if (
            lead is not None
            and kwargs.get("full_document_mode", _lk_plain) != _lk_plain
            and isinstance(oplog_entry, dict)
            and oplog_entry.get("op") == "u"
        ):
            try:
                event, invalidates = _lk_project_as_shipped(
                    seq, oplog_entry, **{**kwargs, "full_document_mode": _lk_plain}
                )
                kept = event is None or invalidates or _lk_ag.apply_pipeline([event], lead[0], lead[1])
                if not kept:
                    return None, False
            except Exception:
                pass
        return _lk_project_as_shipped(seq, oplog_entry, **kwargs)

    if (
        callable(_lk_drain_as_shipped)
        and callable(_lk_project_as_shipped)
        and callable(getattr(_lk_ag, "apply_pipeline", None))
        and "pipeline_after_cs" in _lk_cmd._aggregate_change_stream.__code__.co_cellvars
        and "pipeline_ctx" in _lk_cmd._aggregate_change_stream.__code__.co_cellvars
    ):
        _lk_cmd._drain_change_stream_producer = _lk_drain
        _lk_cs.project = _lk_project
except Exception:
    pass
"""
LAUNCH = (
    TUNE
    + COPY
    + PLAN
    + ZONE
    + SEEK
    + PROFILE
    + WAKE
    + AWAIT
    + PARSE
    + LOOKUP
    + "import sys; from secantus.cli import main; sys.argv[0] = 'secantusd-py'; sys.exit(main())"
)
