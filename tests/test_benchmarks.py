"""Smoke test of the benchmarks, so that they cannot rot: a tiny throughput run, and the report built from it.

Real parts as everywhere: a ``celery worker`` (prefork), Redis, the embedded MongoDB-compatible server.
The figures are not checked (timing claims belong in the benchmarks), only that every part runs and the
command counts are what the design says.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"

pytestmark = pytest.mark.slow


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def throughput(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "throughput.json"
    cmd = [
        sys.executable,
        str(BENCHMARKS / "throughput.py"),
        "--quick",
        "--tasks=12",
        "--hot-tasks=6",
        "--rounds=1",
        "--count-tasks=6",
        "--count-hot-tasks=4",
        "--slow-seconds=1.5",
        "--eager-calls=6",
        f"--out={out}",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def test_throughput_runs_every_variant_or_says_why_not(throughput: dict[str, Any]) -> None:
    variants = throughput["variants"]
    for name in ("plain", "bare", "ours", "ours_hot_wait", "ours_hot_skip"):
        assert variants[name]["runs_per_second_median"] > 0, name
        assert variants[name]["runs_per_batch_median"] == variants[name]["sent_per_batch"], name
    for name in ("singleton", "once", "singleton_hot", "once_hot"):
        assert name in variants or name in throughput["not_run"], name
    for peer in ("celery-singleton", "celery-once"):
        if importlib.util.find_spec(peer.replace("-", "_")) is None:
            assert not throughput["peers"][peer]["available"]
    # Ours spends no Redis command (the library has no Redis client). What can differ from the plain
    # variant is kombu's own bookkeeping of unacknowledged messages (MULTI, ZREM, HDEL, EXEC of an ack or a
    # restore), which a busy machine changes from one batch to the next.
    kombu_bookkeeping = {"multi", "exec", "zrem", "hdel", "zadd", "hset"}
    assert set(variants["ours"]["redis_extra_commands_per_run"]) <= kombu_bookkeeping


def test_a_singleton_task_sends_two_mongodb_commands_plus_heartbeats(throughput: dict[str, Any]) -> None:
    commands = throughput["mongodb_commands"]
    per_task = dict(commands["distinct"]["per_task"])
    # The lease history's records are written in batches (one insert per heartbeat tick of a process,
    # whatever the number of leases that ended in it): whether one lands inside the counted window
    # depends on the tick, so they are counted apart: at most one per task (one record per ended lease).
    history = per_task.pop("insert", 0.0)
    assert per_task == {"findAndModify": 1.0, "findAndModify:release": 1.0}
    assert commands["distinct"]["acquire_release_per_task"] == 2
    # The lease watch's commands (one stream per worker process) are counted apart, none on a task's path.
    assert all(k.startswith("watch:") for k in commands["distinct"]["watch_per_task"])
    assert history <= 1.0
    slow = commands["slow"]  # held 1.5 s with a renewal every second: one renewal each
    assert slow["acquire_release_per_task"] == 2
    assert slow["renewals_per_task"] == 1


def test_the_report_is_built_from_the_results(throughput: dict[str, Any], tmp_path: Path) -> None:
    run = load_script("run")
    args = run.parse_args(["--quick", "--only", "throughput", "--results", str(tmp_path)])
    statuses = [{"benchmark": "throughput", "status": "ok", "seconds": 1.0}]
    text, targets = run.report({"throughput": throughput}, statuses, args, 60.0, (0.0, 0.0, 0.0))
    assert "## Targets (issue 7; the `Queue` ones: issue 16)" in text
    assert "Throughput through a real worker" in text
    names = [t["name"] for t in targets]
    assert any(n.startswith("throughput:") for n in names)
    assert any(n.startswith("MongoDB commands per singleton task") for n in names)


@pytest.fixture(scope="module")
def recovery(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "recovery.json"
    cmd = [
        sys.executable,
        str(BENCHMARKS / "recovery.py"),
        "--quick",
        "--reps=1",
        "--wake-reps=2",
        "--notice-reps=2",
    ]
    cmd += ["--lease-seconds=2", "--no-peers", f"--out={out}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def test_recovery_measures_every_fault(recovery: dict[str, Any]) -> None:
    for kind in ("child-kill", "node-kill", "graceful", "released", "released-polling"):
        assert recovery["ours"][kind]["n"] == 1, kind
    # A node killed outright: nobody released its key, so the next run waited for the lease (2 s) to end.
    assert recovery["ours"]["node-kill"]["max_s"] > 1.0
    assert {w: recovery["store_wake"][w]["n"] for w in ("change_stream", "polling")} == {
        "change_stream": 2,
        "polling": 2,
    }
    assert [t["name"].split(":")[0] for t in recovery["targets"]].count("recovery") == 3
    # How soon a holder notices a loss (issue 29 item 3): each kind twice with the lease watch and without,
    # the watching holder on one change stream for all its leases.
    notice = recovery["store_notice"]
    for mode in ("change_stream", "heartbeat"):
        assert {k: notice[mode][k]["n"] for k in ("forced", "deleted", "taken-over")} == dict.fromkeys(
            ("forced", "deleted", "taken-over"), 2
        ), mode
    assert notice["streams_opened"] == 1
    assert any(t["name"].startswith("Loss noticed by the holder, change stream") for t in recovery["targets"])


@pytest.fixture(scope="module")
def store_bench(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "store.json"
    cmd = [sys.executable, str(BENCHMARKS / "store.py"), "--quick", "--iterations=20", "--rounds=2"]
    cmd += ["--renew-sizes=1,10", "--collection-sizes=300", f"--out={out}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def test_store_benchmark_measures_collection_size(store_bench: dict[str, Any]) -> None:
    size = store_bench["collection_size"]["sizes"]["300"]
    assert size["documents"] >= 300
    assert {"new_big", "new_empty", "existing_big", "existing_empty"} <= set(size["stats"])


def test_the_report_has_every_benchmark(
    throughput: dict[str, Any], recovery: dict[str, Any], store_bench: dict[str, Any], tmp_path: Path
) -> None:
    run = load_script("run")
    args = run.parse_args(["--quick", "--results", str(tmp_path)])
    results = {"throughput": throughput, "store": store_bench, "recovery": recovery}
    statuses = [{"benchmark": name, "status": "ok", "seconds": 1.0} for name in results]
    text, targets = run.report(results, statuses, args, 60.0, (0.0, 0.0, 0.0))
    assert "## Recovery (`recovery.json`)" in text
    assert "| whole worker node killed (SIGKILL) |" in text
    assert "| lease documents |" in text
    names = [t["name"] for t in targets]
    assert any(n.startswith("recovery: worker child killed") for n in names)
    assert any(n.startswith("acquire + release of a new key") for n in names)


def test_history_benchmark_counts_no_command_on_the_tasks_path(tmp_path: Path) -> None:
    out = tmp_path / "history.json"
    cmd = [
        sys.executable,
        str(BENCHMARKS / "history.py"),
        "--quick",
        "--iterations=40",
        "--rounds=2",
        "--flush-reps=2",
        f"--out={out}",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    data = json.loads(out.read_text())
    on, off = data["variants"]["history_on"], data["variants"]["history_off"]
    for variant in (on, off):
        assert variant["task_thread_commands_per_run"] == {"findAndModify": 2.0}  # acquire, release
    assert on["history_records"] == on["runs"] + 20  # every run, and the warm-up's 20
    assert set(on["background_commands"]) == {"insert"} and off["background_commands"] == {}
    assert off["history_collection_exists"] is False
    assert data["summary"] and data["latency_ratio_on_off_median"] > 0


@pytest.fixture(scope="module")
def contention(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "contention.json"
    cmd = [sys.executable, str(BENCHMARKS / "contention.py"), "--quick", "--nodes=1", "--concurrency=2"]
    cmd += ["--runs=3", "--seconds=0.1", "--rounds=1", "--parked-sizes=5,20,6000", "--parked-samples=1"]
    cmd += [f"--out={out}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def test_contention_measures_every_policy(contention: dict[str, Any]) -> None:
    policies = contention["policies"]
    assert set(policies) == {"queue", "wait", "retry"}
    for name, p in policies.items():
        assert p["rounds"] == 1, name
        assert p["handoff_idle"]["n"] == 2, name  # 3 runs of one key: 2 handoffs
        assert {"median", "p95", "max"} <= set(p["handoff_idle"]), name
        assert p["makespan_over_work_median"] > 0, name
        assert {"release", "to_next_execution", "to_body"} == set(p["handoff_parts_median_ms"]), name
        assert p["slots_waiting_max"] >= p["slots_waiting_p95_max"] >= 0, name
        assert p["overlapping_bodies"] == 0, name  # a singleton: one body at a time, whatever the policy
        assert p["mongodb_commands_per_contended_run_median"] is not None, name
    # A parked run sends findAndModify only (park, claim, release; the embedded server sometimes needs a
    # find to read back a findAndModify's document): no change stream, unlike Wait. The history's
    # ``insert`` is the heartbeat thread's, written in the background on its own schedule: whether it
    # lands before the counts are read depends on the machine's load, so it may or may not be counted.
    queue_kinds = {k.split(":", 1)[1] for k in policies["queue"]["mongodb_commands_by_kind_per_run"]}
    assert "findAndModify" in queue_kinds and queue_kinds <= {"findAndModify", "find", "insert"}
    assert "child:aggregate" in policies["wait"]["mongodb_commands_by_kind_per_run"]
    [batch] = [b for b in contention["batches"] if b["policy"] == "queue"]
    assert sorted(batch["start_order"]) == [0, 1, 2]


def test_contention_measures_many_parked_runs(contention: dict[str, Any]) -> None:
    sizes = contention["parked_store"]["sizes"]
    assert set(sizes) == {"5", "20", "6000"}
    for s in sizes.values():
        assert s["park"]["n"] == s["handoff"]["n"] == 1
    # Up to the window (32), every parked run is in the lease document; beyond it, they are spilled.
    for small in ("5", "20"):
        assert sizes[small]["document_bytes"] > sizes[small]["parked"] * sizes[small]["message_bytes"]
    assert sizes["6000"]["document_bytes"] < 100 * sizes["6000"]["message_bytes"]
    assert set(contention["parked_store"]["ratios"]) == {"park_6000_over_5", "handoff_6000_over_5"}
    assert contention["parked_store"]["commands"].get("findAndModify", 0) >= 6
    # A depth over the old per-key cap (5,000) is measured, not refused.
    assert not contention["parked_store"]["refused"]
    deep = [t for t in contention["targets"] if "6,000 runs parked" in t["name"]]
    assert len(deep) == 2 and all(t["measured"] != "refused" for t in deep)


def test_the_report_has_the_contention_benchmark(contention: dict[str, Any], tmp_path: Path) -> None:
    run = load_script("run")
    args = run.parse_args(["--quick", "--only", "contention", "--results", str(tmp_path)])
    statuses = [{"benchmark": "contention", "status": "ok", "seconds": 1.0}]
    text, targets = run.report({"contention": contention}, statuses, args, 60.0, (0.0, 0.0, 0.0))
    assert "## Contended runs on one hot key: Queue, Wait, Retry (`contention.json`)" in text
    assert "| Queue() |" in text and "| Wait(timeout=600) |" in text
    names = [t["name"] for t in targets]
    for prefix in (
        "Queue: handoff idle",
        "Queue: makespan",
        "Queue: worker slots",
        "Queue: MongoDB commands",
    ):
        assert any(n.startswith(prefix) for n in names), prefix
    assert sum("runs parked" in n for n in names) == 2  # park and handoff ratios (no depth refused)
    assert all(t["met"] in (True, False) for t in targets)
    assert "Deeper queues refused" not in text


def test_limits_benchmark_counts_commands_per_run(tmp_path: Path) -> None:
    out = tmp_path / "limits.json"
    cmd = [sys.executable, str(BENCHMARKS / "limits.py"), "--quick", "--store-iterations=6", "--rounds=1"]
    cmd += ["--store-keys=2", "--heartbeat-sizes=2", "--heartbeat-documents=50", "--heartbeat-calls=2"]
    cmd += ["--tasks=4", f"--out={out}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    data = json.loads(out.read_text())
    store = data["store"]["variants"]
    expected = {"single", "limit1_holds1", "limit1_full", "limit3_holds1", "limit3_holds2", "limit3_holds3"}
    expected |= {"limit3_full", "limit10_holds1", "limit10_holds5", "limit10_holds10", "limit10_full"}
    assert set(store) == expected
    for name, v in store.items():
        assert v["iterations"] == 6 and v["latency"]["median_us"] > 0, name
        assert isinstance(v["releases_not_ours"], list), name
        # One round trip to acquire (taken or refused), one to release: both findAndModify (a release
        # may hand the key, or the freed slot, to a parked run, and its reply says to whom).
        if v["refused"]:
            assert v["commands_per_iteration"] == {"findAndModify": 1.0}, name
        else:
            assert v["commands_per_iteration"] == {"findAndModify": 2.0}, name
    heartbeat = data["store"]["heartbeat"]
    assert heartbeat["single_2"]["commands_per_call"] == [{"update": 1}]
    assert heartbeat["slots_2"]["commands_per_call"] == [{"update": 1}]
    assert heartbeat["single_2"]["lost"] == heartbeat["slots_2"]["lost"] == 0
    assert heartbeat["slots_1_among_50"]["other_documents"] == 50
    assert heartbeat["slots_1_among_50"]["commands_per_call"] == [{"update": 1}]
    workers = data["workers"]["variants"]
    assert set(workers) == {"plain", "single", "limit3", "limit10", "keys2", "keys4"}
    assert workers["plain"]["task_thread_commands_per_run"] == {}
    assert workers["single"]["task_thread_commands_per_run"] == {"findAndModify": 2.0}
    for name in ("limit3", "limit10"):
        assert workers[name]["task_thread_commands_per_run"] == {"findAndModify": 2.0}, name
    # k acquires, one renewal confirming them all before the body starts, k releases
    assert workers["keys2"]["task_thread_commands_per_run"] == {"findAndModify": 4.0, "update": 1.0}
    assert workers["keys4"]["task_thread_commands_per_run"] == {"findAndModify": 8.0, "update": 1.0}
    for v in workers.values():
        assert v["runs"] == 4 and v["latency"]["n"] == 4
    run = load_script("run")
    args = run.parse_args(["--quick", "--only", "limits", "--results", str(tmp_path)])
    statuses = [{"benchmark": "limits", "status": "ok", "seconds": 1.0}]
    text, targets = run.report({"limits": data}, statuses, args, 60.0, (0.0, 0.0, 0.0))
    assert "## `limit=N` and several keys against a single key (`limits.json`)" in text
    assert "| `limit=10`, full: acquire refused |" in text and "| `keys=` 4 keys |" in text
    assert targets == []


def test_the_report_has_the_cancel_running_benchmark(tmp_path: Path) -> None:
    """The cancel_running figures (the committed quick run's) make its targets and its section."""
    run = load_script("run")
    bench = load_script("cancel_running")
    measured = json.loads((BENCHMARKS / "results" / "cancel_running.json").read_text())
    assert measured["targets"] == bench.targets(measured)
    args = run.parse_args(["--quick", "--only", "cancel_running", "--results", str(tmp_path)])
    statuses = [{"benchmark": "cancel_running", "status": "ok", "seconds": 1.0}]
    text, targets = run.report({"cancel_running": measured}, statuses, args, 60.0, (0.0, 0.0, 0.0))
    assert "a newer send stops the holder (`cancel_running.json`)" in text
    names = [t["name"] for t in targets]
    assert any(n.startswith("cancel_running: newest run starts") for n in names)
    assert any(n.startswith("cancel_running: a cooperative holder notices") for n in names)


def test_unique_send_benchmark_counts_one_round_trip_on_and_none_off(tmp_path: Path) -> None:
    out = tmp_path / "unique_send.json"
    cmd = [sys.executable, str(BENCHMARKS / "unique_send.py"), "--sends=5", "--rounds=2", f"--out={out}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    data = json.loads(out.read_text())
    off, new, equal = (data["variants"][v] for v in ("off", "on_new", "on_equal"))
    assert off["commands_per_send"] == {} and off["published_per_send"] == 1.0
    assert new["commands_per_send"] == {"findAndModify": 1.0} and new["published_per_send"] == 1.0
    assert equal["commands_per_send"] == {"findAndModify": 1.0} and equal["published_per_send"] == 0.0
    assert data["summary"]


def test_handoff_backlog_measures_a_handoff_behind_the_backlog(tmp_path: Path) -> None:
    out = tmp_path / "handoff_backlog.json"
    cmd = [sys.executable, str(BENCHMARKS / "handoff_backlog.py"), "--brokers=redis", "--backlogs=0,100"]
    cmd += ["--rounds=1", f"--out={out}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    data: dict[str, Any] = json.loads(out.read_text())
    redis = data["brokers"]["redis"]
    # Lanes off: the handed run starts after the whole backlog; on: before most of it (an order).
    assert redis["off"]["100"]["plain_started_first_max"] == 100
    assert redis["on"]["100"]["plain_started_first_max"] < 50
    assert redis["off"]["0"]["plain_started_first_max"] == redis["on"]["0"]["plain_started_first_max"] == 0
    run = load_script("run")
    args = run.parse_args(["--quick", "--only", "handoff_backlog", "--results", str(tmp_path)])
    statuses = [{"benchmark": "handoff_backlog", "status": "ok", "seconds": 1.0}]
    text, targets = run.report({"handoff_backlog": data}, statuses, args, 60.0, (0.0, 0.0, 0.0))
    assert "## A handoff behind the broker's backlog (`handoff_backlog.json`)" in text
    assert [t["name"] for t in targets] == [
        "handoff idle with 100 messages queued ahead, redis (max of the rounds)"
    ]


def test_parked_depth_measures_park_and_handoff_at_each_depth(tmp_path: Path) -> None:
    """A short run (the committed full run has the 100,000 figures and their target)."""
    out = tmp_path / "parked_depth.json"
    cmd = [sys.executable, str(BENCHMARKS / "parked_depth.py"), "--sizes=100,1000", "--samples=3"]
    done = subprocess.run(
        [*cmd, f"--out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=400, check=False
    )
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    data: dict[str, Any] = json.loads(out.read_text())
    assert sorted(data["sizes"], key=int) == ["100", "1000"]
    assert data["sizes"]["1000"]["park"]["n"] == 3 and data["sizes"]["1000"]["handoff"]["n"] == 3
    assert [t["name"] for t in data["targets"]] == [
        "park with 1,000 runs parked on one key over 100 (medians)",
        "handoff with 1,000 runs parked on one key over 100 (medians)",
    ]


def test_debounce_benchmark_reports_its_three_measures(tmp_path: Path) -> None:
    """A short run (the figures themselves, and their targets, are the committed full run's)."""
    out = tmp_path / "debounce.json"
    cmd = [sys.executable, str(BENCHMARKS / "debounce.py"), "--duration=3", "--burst=3", "--debounce=0.5"]
    cmd += ["--max-wait=1", "--every=0.2", f"--out={out}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    data = json.loads(out.read_text())
    assert data["burst"]["sends"] == 3 and data["burst"]["bodies"] >= 1
    assert len(data["burst"]["plain_task_start_after_send_s"]) == data["parameters"]["concurrency"]
    for case in ("one_key", "set_of_keys"):
        assert data[case]["sends"] >= 1 and data[case]["starts_by_the_end"] >= 1
    assert len(data["summary"]) == 3
