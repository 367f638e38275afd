"""One mock agent holding hundreds of sessions, and a flooding session next to launches (issue 12).

Runs the real distributed stack (tests/stack.py: uvicorn, a Celery manager, beat, one agent, a
private redis-server) against its own PostgreSQL database and measures, through the REST API as
a user would:

1. **scale**, for each N of --sessions (default 100 and 500): N interactive sessions of
   0.25 fGPU launched by 20 concurrent clients on one agent (a node of ceil(N / 8) + 1 mock
   GPUs, so the GPUs never run out): seconds until every one is RUNNING, the gaps between the
   node's heartbeats as the manager records them (interval FGPU_HEARTBEAT_INTERVAL = 2 s: the
   delay is gap − 2 s) from the first launch until HOLD_S after the last one ran, whether the
   node stayed ALIVE at every sample, the agent process's RSS and thread count (max, and idle
   before the launches), and seconds until all are ended after they are deleted at once.
2. **flood**: the latency of --launches sequential launches (POST → RUNNING seen in the
   database, each deleted before the next), first on a quiet agent, then next to two flooding
   sessions on the same agent: a batch session running `yes` (its output goes to the log path)
   and an interactive one running `yes` with a terminal websocket attached and read as fast as
   it comes (the terminal path). Prints the medians and their ratio (issue 12: ≤ 1.5) and how
   much the flood moved (terminal characters received, log characters stored).

Usage (PostgreSQL and Redis as for the tests; the database is created and migrated if missing,
and emptied before each part):

    .venv/bin/python benchmarks/agent_scale.py                  # 100 and 500 sessions, the flood
    .venv/bin/python benchmarks/agent_scale.py --sessions 100 --launches 10 --skip-flood

Figures go to stdout and to --out (default benchmarks/results/agent_scale.txt).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.stack import wait_until as wait_for  # noqa: E402 (after the path; no Django at import)

DATABASE_URL = os.environ.get("FGPU_BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/fgpu_bench_agent")
CLIENTS = 20
SHAPE = {"cuda.shares": "0.25", "cpu": 1, "mem": "64M"}  # 8 per 8 GiB / 80-SM mock GPU (2 fGPU)
HOLD_S = 10  # heartbeats keep being sampled this long once every session runs
RUNNING_TIMEOUT_S = 900
FINAL = ("TERMINATED", "ERROR", "CANCELLED")


def setup_django(database_url: str = DATABASE_URL) -> None:
    """Point Django at the benchmark's own database (created when missing) and migrate it."""
    import psycopg

    name = database_url.rsplit("/", 1)[1]
    with psycopg.connect(database_url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')
    os.environ["DATABASE_URL"] = database_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    os.environ.pop("FGPU_CELERY_EAGER", None)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def fresh_user() -> str:
    """Empty the database and create the benchmark's user; returns its API token."""
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from accounts.services import login_token_issue

    call_command("flush", interactive=False, verbosity=0)
    user = get_user_model().objects.create_user(f"bench-{uuid.uuid4().hex[:6]}")
    return login_token_issue(user=user)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def proc_status(pid: int) -> tuple[int, int]:
    """(RSS in bytes, threads) of process `pid`, from /proc/<pid>/status; (0, 0) once it is gone."""
    rss = threads = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("Threads:"):
                    threads = int(line.split()[1])
    except OSError:
        pass
    return rss, threads


class Sampler(threading.Thread):
    """Every 0.25 s: the node's status and last heartbeat (as the manager recorded it) and the
    agent's RSS and threads."""

    def __init__(self, node_name: str, agent_pid: int):
        super().__init__(daemon=True)
        self.node_name, self.agent_pid = node_name, agent_pid
        self.stop = threading.Event()
        self.heartbeats: list[float] = []  # distinct last_heartbeat values, epoch seconds
        self.statuses: set[str] = set()
        self.samples = 0
        self.rss_max = self.threads_max = 0

    def run(self) -> None:
        from django.db import connection

        from accelerators.models import Node

        try:
            while not self.stop.is_set():
                row = Node.objects.filter(name=self.node_name).values("status", "last_heartbeat").first()
                if row is not None:
                    self.statuses.add(row["status"])
                    beat = row["last_heartbeat"].timestamp() if row["last_heartbeat"] else None
                    if beat is not None and (not self.heartbeats or beat != self.heartbeats[-1]):
                        self.heartbeats.append(beat)
                rss, threads = proc_status(self.agent_pid)
                self.rss_max, self.threads_max = max(self.rss_max, rss), max(self.threads_max, threads)
                self.samples += 1
                self.stop.wait(0.25)
        finally:
            connection.close()

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.heartbeats, self.heartbeats[1:])]


def statuses(ids: list[str]) -> dict[str, int]:
    from django.db import connection

    from sessions.models import ComputeSession

    counts: dict[str, int] = {}
    for status in ComputeSession.objects.filter(pk__in=ids).values_list("status", flat=True):
        counts[status] = counts.get(status, 0) + 1
    connection.close()
    return counts


def launch_all(client, count: int, prefix: str) -> list[str]:
    """Launch `count` interactive sessions from CLIENTS concurrent clients; their ids."""

    def one(i: int) -> str:
        status, body = client.launch(f"{prefix}-{i}", {"resources": SHAPE})
        if status != 201:
            raise SystemExit(f"launch {i} answered {status}: {body}")
        return body["id"]

    with ThreadPoolExecutor(CLIENTS) as pool:
        return list(pool.map(one, range(count)))


def delete_all(client, ids: list[str]) -> None:
    with ThreadPoolExecutor(CLIENTS) as pool:
        for status, body in pool.map(client.delete, ids):
            if status not in (200, 202, 204):
                raise SystemExit(f"a delete answered {status}: {body}")


def scale(sessions: int, work: Path) -> dict:
    from tests.stack import ApiClient as Client, Stack, StackNode, mock_inventory

    gpus = math.ceil(sessions / 8) + 1
    token = fresh_user()
    node = StackNode("scale-node", mock_inventory(gpus=gpus), cpu_count=sessions + 64, memory=f"{sessions + 64}G", devices=gpus)
    stack = Stack(nodes=[node], work_dir=work / f"scale-{sessions}").start(timeout=180)
    try:
        agent = stack.agents[node.name]
        time.sleep(2 * stack.heartbeat_interval)  # let the idle agent settle before its RSS is taken
        idle_rss, idle_threads = proc_status(agent.pid)
        sampler = Sampler(node.name, agent.pid)
        sampler.start()
        client = Client(stack.base, token)
        started = time.monotonic()
        ids = launch_all(client, sessions, f"scale{sessions}")
        answered_s = time.monotonic() - started
        wait_for(
            lambda: statuses(ids).get("RUNNING", 0) == sessions,
            timeout=RUNNING_TIMEOUT_S,
            what=f"{sessions} sessions RUNNING (last: {statuses(ids)})",
            interval=0.5,
        )
        running_s = time.monotonic() - started
        time.sleep(HOLD_S)  # steady state: N sessions held, heartbeats still sampled
        started = time.monotonic()
        delete_all(client, ids)
        wait_for(
            lambda: sum(statuses(ids).get(s, 0) for s in FINAL) == sessions,
            timeout=RUNNING_TIMEOUT_S,
            what="every session ended",
            interval=0.5,
        )
        drain_s = time.monotonic() - started
        sampler.stop.set()
        sampler.join()
        gaps = sampler.gaps()
        return {
            "sessions": sessions,
            "gpus": gpus,
            "launches_answered_s": round(answered_s, 1),
            "all_running_s": round(running_s, 1),
            "drained_s": round(drain_s, 1),
            "heartbeat_gap_p50_s": round(percentile(gaps, 0.5), 2),
            "heartbeat_gap_max_s": round(max(gaps, default=float("nan")), 2),
            "heartbeat_interval_s": stack.heartbeat_interval,
            "node_always_alive": sampler.statuses == {"ALIVE"},
            "samples": sampler.samples,
            "agent_rss_idle_mib": round(idle_rss / 2**20, 1),
            "agent_rss_max_mib": round(sampler.rss_max / 2**20, 1),
            "agent_threads_idle": idle_threads,
            "agent_threads_max": sampler.threads_max,
        }
    finally:
        stack.close()


class TerminalReader(threading.Thread):
    """Opens a session's terminal websocket, starts `yes` in it and reads every frame as it comes."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.chars = 0
        self.frames = 0
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            asyncio.run(self._read())
        except BaseException as exc:  # reported by the caller
            self.error = exc

    async def _read(self) -> None:
        import websockets

        async with websockets.connect(self.url, max_size=2**22) as ws:
            await ws.send(json.dumps({"type": "resize", "cols": 120, "rows": 40}))
            await ws.send(json.dumps({"type": "input", "data": "yes flooding-the-terminal-of-this-session\r"}))
            while not self.stop.is_set():
                try:
                    frame = json.loads(await asyncio.wait_for(ws.recv(), 1.0))
                except asyncio.TimeoutError:
                    continue
                self.frames += 1
                self.chars += len(frame.get("data", ""))


def launch_latencies(client, count: int, prefix: str) -> list[float]:
    """`count` sequential launches: seconds from POST to RUNNING in the database; each is
    deleted (and seen ended) before the next."""
    latencies = []
    for i in range(count):
        started = time.monotonic()
        status, body = client.launch(f"{prefix}-{i}", {"resources": SHAPE})
        if status != 201:
            raise SystemExit(f"launch answered {status}: {body}")
        sid = body["id"]
        wait_for(lambda sid=sid: statuses([sid]).get("RUNNING"), timeout=60, what=f"{prefix}-{i} RUNNING", interval=0.02)
        latencies.append(time.monotonic() - started)
        client.delete(sid)
        wait_for(
            lambda sid=sid: any(statuses([sid]).get(s) for s in FINAL), timeout=60, what=f"{prefix}-{i} ended", interval=0.05
        )
    return latencies


def flood(launches: int, work: Path) -> dict:
    from sessions.models import ComputeSession
    from tests.stack import ApiClient as Client, Stack, StackNode, mock_inventory

    token = fresh_user()
    node = StackNode("flood-node", mock_inventory(gpus=4), cpu_count=64, memory="64G", devices=4)
    stack = Stack(nodes=[node], work_dir=work / "flood").start(timeout=180)
    reader = None
    try:
        client = Client(stack.base, token)
        quiet = launch_latencies(client, launches, "quiet")
        status, batch = client.launch("flood-batch", {"resources": SHAPE, "command": "yes flooding-the-log"})
        assert status == 201, batch
        status, interactive = client.launch("flood-terminal", {"resources": SHAPE})
        assert status == 201, interactive
        wait_for(
            lambda: statuses([batch["id"], interactive["id"]]).get("RUNNING") == 2,
            timeout=60,
            what="the flooding sessions RUNNING",
            interval=0.2,
        )
        status, ticket = client.call("POST", f"/api/v1/sessions/{interactive['id']}/terminal-ticket/")
        assert status == 200, ticket
        reader = TerminalReader(f"ws://127.0.0.1:{stack.port}{ticket['url']}")
        reader.start()
        wait_for(lambda: reader.chars > 100_000 or reader.error, timeout=30, what="the terminal flood to start", interval=0.2)
        if reader.error:
            raise reader.error
        chars_before = reader.chars
        logs_before = log_chars(batch["id"])
        started = time.monotonic()
        flooded = launch_latencies(client, launches, "flooded")
        elapsed = time.monotonic() - started
        terminal_rate = (reader.chars - chars_before) / elapsed
        log_rate = (log_chars(batch["id"]) - logs_before) / elapsed
        still_running = ComputeSession.objects.filter(pk__in=[batch["id"], interactive["id"]], status="RUNNING").count()
        return {
            "launches": launches,
            "quiet_p50_s": round(statistics.median(quiet), 3),
            "quiet_max_s": round(max(quiet), 3),
            "flooded_p50_s": round(statistics.median(flooded), 3),
            "flooded_max_s": round(max(flooded), 3),
            "ratio_p50": round(statistics.median(flooded) / statistics.median(quiet), 2),
            "terminal_chars_per_s": int(terminal_rate),
            "log_chars_stored_per_s": int(log_rate),
            "flooding_sessions_still_running": still_running,
        }
    finally:
        if reader is not None:
            reader.stop.set()
            reader.join(timeout=5)
        stack.close()


def log_chars(session_id: str) -> int:
    """Characters of the session's output the manager has received so far (SessionLog.length)."""
    from django.db import connection

    from sessions.models import SessionLog

    length = SessionLog.objects.filter(session_id=session_id).values_list("length", flat=True).first() or 0
    connection.close()
    return length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, nargs="*", default=[100, 500], help="scale runs (none: --sessions)")
    parser.add_argument("--launches", type=int, default=20, help="sequential launches per flood phase")
    parser.add_argument("--skip-flood", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "agent_scale.txt"))
    args = parser.parse_args()
    setup_django()
    lines = [f"# benchmarks/agent_scale.py {' '.join(sys.argv[1:])}  ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores)"]
    with tempfile.TemporaryDirectory(prefix="fgpu-agent-scale-") as tmp:
        for n in args.sessions:
            figures = scale(n, Path(tmp))
            lines.append("scale: " + json.dumps(figures))
            print(lines[-1], flush=True)
        if not args.skip_flood:
            figures = flood(args.launches, Path(tmp))
            lines.append("flood: " + json.dumps(figures))
            print(lines[-1], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
