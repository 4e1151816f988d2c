"""The demo (``make demo``): overlapping email-group uploads on two workers, two beats, one failover.

With no arguments it runs on embedded defaults: the embedded MongoDB-compatible server and a bundled
redis-server binary, both started here (nothing to install). ``--mongo-url`` and ``--broker-url`` run it
against real services instead.

It starts two worker nodes (prefork, concurrency 2) and two ``celery beat`` with the leader-elected
scheduler, fires overlapping uploads for several groups, kills the beat leader half way (SIGKILL), shows
live progress, then prints a summary and writes a timeline (HTML). It exits non-zero if an invariant
broke: two runs for one group overlapped, a group does not hold exactly the members of its last
upload, or a digest tick ran twice. Every process it started is stopped, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import csv
import html
import itertools
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


class Proc:
    """A child process in its own process group, logging to a file."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            cwd=HERE,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.alive:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 20) -> None:
        if self.alive:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


def stop_all(procs: list[Proc]) -> None:
    for p in procs:
        p.stop()


def start_workers_and_beats(procs: list[Proc], env: dict[str, str], run_dir: Path, db: Any) -> None:
    celery = [sys.executable, "-m", "celery", "-A", "emailgroups"]
    for n in (1, 2):
        worker = [
            *celery,
            "worker",
            "-n",
            f"worker{n}@demo",
            "--pool=prefork",
            "--concurrency=2",
            "--loglevel=INFO",
            "--without-gossip",
            "--without-mingle",
        ]
        procs.append(Proc(f"worker{n}", worker, env, run_dir))
    print("starting 2 workers ...", flush=True)
    wait_until(lambda: all((run_dir / f"worker{n}@demo.ready").exists() for n in (1, 2)), 90, "the workers")
    for n in (1, 2):
        beat = [*celery, "beat", "--loglevel=INFO", "-s", str(run_dir / f"beat{n}.schedule")]
        procs.append(Proc(f"beat{n}", beat, env, run_dir))
    print("starting 2 beats (leader-elected) ...", flush=True)
    wait_until(lambda: beat_leader_pid(db), 60, "a beat leader")


def wait_until(condition: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.1)


@contextmanager
def services(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    from celery_mongolock.embedded import EmbeddedMongo
    from celery_mongolock.testing import RedisServer

    with ExitStack() as stack:
        mongo_url = args.mongo_url
        if not mongo_url:
            print("starting the embedded MongoDB-compatible server ...", flush=True)
            mongo_url = stack.enter_context(EmbeddedMongo()).url
        broker_url = args.broker_url
        if not broker_url:
            print("starting a bundled redis-server as the broker ...", flush=True)
            broker_url = stack.enter_context(RedisServer()).url
        yield mongo_url, broker_url


def make_uploads(
    groups: int, per_group: int, folder: Path, rng: random.Random
) -> list[tuple[int, str, Path]]:
    uploads = []
    for g in range(1, groups + 1):
        for u in range(1, per_group + 1):
            upload_id = f"g{g}-u{u}"
            path = folder / f"{upload_id}.csv"
            with open(path, "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(["email"])
                for i in range(rng.randint(15, 40)):
                    writer.writerow([f"{upload_id}-{i}@example.com"])
            uploads.append((g, upload_id, path))
    return uploads


def beat_leader_pid(db: Any) -> int | None:
    doc = db["leases"].find_one({"_id": "celery-beat:leader"})
    if not doc or not doc.get("owner"):
        return None
    pid = (doc.get("holder") or {}).get("pid")
    return int(pid) if pid else None


def render_live(db: Any, results: dict[str, Any], groups: int, started: float) -> str:
    held = {d["_id"]: d for d in db["leases"].find({"owner": {"$ne": None}})}
    runs = list(db["runs"].find({"kind": {"$in": ["end", "contended"]}}, {"kind": 1, "group": 1, "key": 1}))
    done = Counter(r["group"] for r in runs if r["kind"] == "end")
    retries = Counter(r.get("key") for r in runs if r["kind"] == "contended")
    by_task = {r.id: upload for upload, r in results.items()}
    pending = Counter(int(u[1:].split("-")[0]) for u, r in results.items() if not r.ready())
    lines = [
        f"  t={time.monotonic() - started:5.1f}s",
        f"  {'key':<16} {'held by':<22} {'waiting':>7} {'done':>5} {'retries':>8}",
    ]
    for g in range(1, groups + 1):
        key = f"email-group:{g}"
        lease = held.get(key)
        holder = "-"
        if lease:
            h = lease.get("holder") or {}
            holder = f"{by_task.get(h.get('task_id'), '?')} on {h.get('worker', '?').split('@')[0]}"
        waiting = max(0, pending[g] - (1 if lease else 0))
        lines.append(f"  {key:<16} {holder:<22} {waiting:>7} {done[g]:>5} {retries.get(key, 0):>8}")
    digests = db["runs"].count_documents({"kind": "digest"})
    leader = beat_leader_pid(db)
    finished = sum(1 for r in results.values() if r.ready())
    lines.append(
        f"  uploads finished {finished}/{len(results)}   digests {digests}   beat leader pid {leader}"
    )
    return "\n".join(lines)


def timeline_html(db: Any, path: Path, failovers: list[float]) -> None:
    runs = list(db["runs"].find({}).sort("t", 1))
    if not runs:
        path.write_text("<p>no runs</p>")
        return
    t0 = min(r["t"] for r in runs)
    t1 = max(r["t"] for r in runs) + 0.5
    spans: dict[str, list[tuple[float, float, str, int]]] = defaultdict(list)
    starts: dict[tuple[str, str], dict[str, Any]] = {}
    for r in runs:
        if r["kind"] == "start":
            starts[(r["key"], r["upload"])] = r
        elif r["kind"] == "end" and (r["key"], r["upload"]) in starts:
            s = starts[(r["key"], r["upload"])]
            spans[r["key"]].append((s["t"], r["t"], r["upload"], r["fence"]))
    digests = [r["t"] for r in runs if r["kind"] == "digest"]
    keys = sorted(spans)
    width, row, left = 1000, 34, 140
    scale = (width - left - 20) / (t1 - t0)
    height = row * (len(keys) + 2) + 40
    colors = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948"]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="12">'
    ]
    for i, key in enumerate(keys):
        y = 20 + i * row
        parts.append(f'<text x="4" y="{y + 18}">{html.escape(key)}</text>')
        for a, b, upload, fence in spans[key]:
            u = int(upload.rsplit("u", 1)[-1])
            x = left + (a - t0) * scale
            w = max(2.0, (b - a) * scale)
            title = html.escape(f"{upload} fence {fence}: {a - t0:.2f}s to {b - t0:.2f}s")
            parts.append(
                f'<rect x="{x:.1f}" y="{y + 4}" width="{w:.1f}" height="{row - 10}" '
                f'fill="{colors[(u - 1) % len(colors)]}"><title>{title}</title></rect>'
            )
            parts.append(f'<text x="{x + 3:.1f}" y="{y + 19}" fill="white">{html.escape(upload)}</text>')
    y = 20 + len(keys) * row
    parts.append(f'<text x="4" y="{y + 18}">digest (beat)</text>')
    for t in digests:
        x = left + (t - t0) * scale
        parts.append(f'<rect x="{x:.1f}" y="{y + 6}" width="3" height="{row - 14}" fill="#333"/>')
    for t in failovers:
        x = left + (t - t0) * scale
        parts.append(
            f'<line x1="{x:.1f}" y1="10" x2="{x:.1f}" y2="{height - 20}" stroke="red" stroke-dasharray="4"/>'
        )
        parts.append(f'<text x="{x + 4:.1f}" y="{height - 8}" fill="red">beat leader killed</text>')
    parts.append("</svg>")
    path.write_text(
        "<!doctype html><meta charset='utf-8'><title>celery_mongolock demo timeline</title>"
        "<h2>Runs per key (one bar per upload run; colour = upload number)</h2>" + "".join(parts)
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mongo-url", default=os.environ.get("MONGOLOCK_DEMO_MONGODB_URL"))
    parser.add_argument("--broker-url", default=os.environ.get("MONGOLOCK_DEMO_BROKER_URL"))
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--uploads-per-group", type=int, default=3)
    parser.add_argument("--timeline", default="demo-timeline.html", help="where to write the timeline (HTML)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--external",
        action="store_true",
        help="workers and beats run elsewhere (docker compose): start none, kill none",
    )
    parser.add_argument("--database", default=None, help="MongoDB database of the example app")
    parser.add_argument(
        "--upload-dir", default=None, help="where to write the CSV files (shared with workers)"
    )
    args = parser.parse_args()

    from pymongo import MongoClient

    def _sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _sigterm)
    rng = random.Random(args.seed)
    run_dir = Path(tempfile.mkdtemp(prefix="mongolock-demo-"))
    procs: list[Proc] = []
    database = args.database or f"emailgroups_demo_{os.getpid()}"
    upload_dir = Path(args.upload_dir) if args.upload_dir else run_dir
    upload_dir.mkdir(parents=True, exist_ok=True)
    ok = True
    try:
        with services(args) as (mongo_url, broker_url), ExitStack() as cleanup:
            # Registered first, run last within this block: workers and beats stop before the servers.
            cleanup.callback(stop_all, procs)
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
                "EMAILGROUPS_MONGO_URL": mongo_url,
                "EMAILGROUPS_BROKER_URL": broker_url,
                "EMAILGROUPS_DATABASE": database,
                "EMAILGROUPS_READY_DIR": str(run_dir),
                "EMAILGROUPS_LEASE_SECONDS": "10",
                "EMAILGROUPS_BEAT_LEASE_SECONDS": "3",
                "EMAILGROUPS_DIGEST_EVERY": "1",
            }
            os.environ.update({k: env[k] for k in env if k.startswith("EMAILGROUPS_")})
            sys.path.insert(0, str(HERE))
            from emailgroups import app, tasks

            client: MongoClient[dict[str, Any]] = MongoClient(mongo_url)
            db = client[database]
            for name in ("runs", "members", "groups"):  # a clean slate for the invariants
                db[name].drop()
            if args.external:
                print("waiting for the workers and beats ...", flush=True)
                wait_until(lambda: app.control.ping(timeout=1.0), 120, "a worker to answer")
                wait_until(lambda: beat_leader_pid(db), 120, "a beat leader")
            else:
                start_workers_and_beats(procs, env, run_dir, db)

            uploads = make_uploads(args.groups, args.uploads_per_group, upload_dir, rng)
            rng.shuffle(uploads)
            print(f"firing {len(uploads)} overlapping uploads for {args.groups} groups ...\n", flush=True)
            results = {}
            for group, upload_id, path in uploads:
                results[upload_id] = tasks.upload_members.delay(group, upload_id, str(path))
                time.sleep(rng.random() * 0.05)

            started = time.monotonic()
            failovers: list[float] = []
            live = sys.stdout.isatty()
            last_print = 0.0
            killed = False
            while True:
                done = all(r.ready() for r in results.values())
                if not killed and not args.external and time.monotonic() - started > 3:
                    pid = beat_leader_pid(db)
                    beat = next((p for p in procs if p.name.startswith("beat") and p.proc.pid == pid), None)
                    if beat is not None:
                        print(
                            f"\n>>> killing the beat leader ({beat.name}, pid {pid}) with SIGKILL\n",
                            flush=True,
                        )
                        beat.kill()
                        failovers.append(time.time())
                        killed = True
                # Done when every upload finished and beat ticked again after the failover.
                after = failovers[0] + 5 if failovers else 0.0
                if (
                    done
                    and (killed or args.external)
                    and db["runs"].count_documents({"kind": "digest", "t": {"$gt": after}})
                ):
                    break
                if time.monotonic() - started > 240:
                    print("the demo took too long; giving up", flush=True)
                    ok = False
                    break
                if time.monotonic() - last_print > (0.5 if live else 2.0):
                    text = render_live(db, results, args.groups, started)
                    if live:
                        sys.stdout.write("\x1b[2J\x1b[H" + text + "\n")
                    else:
                        print(text + "\n", flush=True)
                    last_print = time.monotonic()
                time.sleep(0.1)
            print(render_live(db, results, args.groups, started) + "\n", flush=True)

            # -- summary and invariants --------------------------------------------------------------
            runs = list(db["runs"].find({}))
            ends = {r["upload"]: r for r in runs if r["kind"] == "end"}
            starts = {r["upload"]: r for r in runs if r["kind"] == "start"}
            failed = [u for u, r in results.items() if r.failed()]
            overlaps = 0
            by_group: dict[int, list[tuple[float, float, int, str]]] = defaultdict(list)
            for upload_id, s in starts.items():
                if upload_id in ends:
                    by_group[s["group"]].append((s["mono"], ends[upload_id]["mono"], s["fence"], upload_id))
            bad_groups = []
            for g, spans in by_group.items():
                spans.sort()
                overlaps += sum(1 for a, b in itertools.pairwise(spans) if b[0] < a[1])
                last = max(spans, key=lambda s: s[2])[3]
                members = sorted(d["email"] for d in db["members"].find({"group": g}))
                with open(upload_dir / f"{last}.csv", newline="") as f:
                    expected = sorted(row["email"] for row in csv.DictReader(f))
                if members != expected:
                    bad_groups.append(g)
            ticks = Counter(r["tick"] for r in runs if r["kind"] == "digest")
            twice = [t for t, c in ticks.items() if c > 1]
            retries = sum(1 for r in runs if r["kind"] == "contended" and r["policy"] == "retry")
            skips = sum(
                1 for r in runs if r["kind"] == "contended" and r["policy"] in ("skip", "tick-already-ran")
            )
            leader_changes = sum(
                p.log().count("became the leader") for p in procs if p.name.startswith("beat")
            )
            timeline = Path(args.timeline).resolve()
            timeline_html(db, timeline, failovers)
            print("summary")
            print(f"  upload runs           {len(ends)} of {len(results)} ({len(failed)} failed)")
            print(f"  contention retries    {retries}")
            print(f"  skips                 {skips}")
            print(f"  overlaps              {overlaps}")
            print(f"  digest ticks          {len(ticks)} (ran twice: {len(twice)})")
            print(f"  beat failovers        {max(0, leader_changes - 1)} (leader killed {len(failovers)}x)")
            print(f"  groups wrong          {bad_groups or 'none'}")
            print(f"  timeline              {timeline}")
            ok = (
                ok
                and not failed
                and overlaps == 0
                and not bad_groups
                and not twice
                and len(ends) == len(results)
            )
            if not args.database:
                client.drop_database(database)
            client.close()
            app.close()
    except KeyboardInterrupt:
        print("\ninterrupted; stopped everything", flush=True)
        ok = False
    finally:
        for p in procs:  # already stopped unless start-up failed half way
            p.stop()
    print("\nall invariants held" if ok else "\nAN INVARIANT BROKE (or the demo was interrupted)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
