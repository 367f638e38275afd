"""Launch and terminate as a user sees them, end to end: POST /api/v1/sessions/ → RUNNING and
DELETE → TERMINATED, in standalone mode (`manage.py standalone`, SQLite, eager Celery, the
embedded agent) and on the distributed stack (uvicorn, Celery manager and beat, one agent, Redis,
PostgreSQL: tests/stack.py), in one run.

    python benchmarks/launch.py [--sessions 30] [--out benchmarks/results/launch.txt]

Each mode: `--sessions` interactive 0.25 fGPU sessions, one after another, each launched through
the REST API (token auth, keep-alive connection), timed until the database says RUNNING, then
deleted and timed until it says TERMINATED. The status is read straight from the database every
millisecond (not through the API, so the watching costs the server nothing). Prints p50 / p95 /
max in milliseconds; issue 14's targets: launch p50 < 100 ms, terminate p50 < 30 ms.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.agent_scale import DATABASE_URL, percentile, setup_django  # noqa: E402
from tests.stack import free_port, wait_until  # noqa: E402

SHAPE = {"cuda.shares": "0.25"}
PASSWORD = "bench-admin-pass-123"
STATUS_SQL = "SELECT status FROM compute_sessions_computesession WHERE id = {}"


class Api:
    """One keep-alive connection to the console, token-authenticated."""

    def __init__(self, port: int, token: str = ""):
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.token = token

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Token {self.token}"
        self.connection.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
        response = self.connection.getresponse()
        raw = response.read()
        return response.status, json.loads(raw) if raw else {}


def watch(read_status, session_id: str, wanted: tuple[str, ...], timeout: float = 30.0) -> str:
    """Poll the session's status every millisecond until it is one of `wanted`."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        status = read_status(session_id)
        if status in wanted:
            return status
        time.sleep(0.001)
    raise SystemExit(f"session {session_id} not {wanted} after {timeout} s (last: {status})")


def run(api: Api, read_status, sessions: int) -> dict:
    launch, answer, terminate, delete_answer = [], [], [], []
    for i in range(sessions + 2):  # the first two warm the caches and are not counted
        started = time.perf_counter()
        status, body = api.call("POST", "/api/v1/sessions/", {"name": f"bench-{i}", "resources": SHAPE})
        if status != 201:
            raise SystemExit(f"launch answered {status}: {body}")
        answered = time.perf_counter()
        if watch(read_status, body["id"], ("RUNNING", "ERROR")) != "RUNNING":
            raise SystemExit(f"session {body['id']} failed: {api.call('GET', '/api/v1/sessions/' + body['id'] + '/')}")
        running = time.perf_counter()
        status, _ = api.call("DELETE", f"/api/v1/sessions/{body['id']}/")
        if status not in (200, 202, 204):
            raise SystemExit(f"delete answered {status}")
        deleted = time.perf_counter()
        watch(read_status, body["id"], ("TERMINATED", "ERROR"))
        ended = time.perf_counter()
        if i >= 2:
            launch.append((running - started) * 1000)
            answer.append((answered - started) * 1000)
            terminate.append((ended - running) * 1000)
            delete_answer.append((deleted - running) * 1000)
    return {"launch": launch, "POST answer": answer, "terminate": terminate, "DELETE answer": delete_answer}


def standalone(sessions: int, work: Path) -> dict:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")}
    env.update(FGPU_DATA_DIR=str(work / "data"), FGPU_ADMIN_PASSWORD=PASSWORD, PORT=str(port), PYTHONUNBUFFERED="1")
    env.setdefault("FGPU_RUNTIME", "process")  # standalone picks docker where Docker Engine runs: the process runtime, as before
    log = open(work / "standalone.log", "w")
    server = subprocess.Popen(
        [sys.executable, "manage.py", "standalone"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_until(
            lambda: "is serving on" in (work / "standalone.log").read_text(),
            timeout=90,
            interval=0.2,
            what="the standalone console",
        )
        status, token = Api(port).call("POST", "/api/v1/auth/token/", {"username": "admin", "password": PASSWORD})
        assert status == 200, token
        database = sqlite3.connect(work / "data" / "fgpu.sqlite3", timeout=5)

        def read_status(session_id: str) -> str | None:
            row = database.execute(STATUS_SQL.format("?"), [session_id.replace("-", "")]).fetchone()
            return row[0] if row else None

        return run(Api(port, token["token"]), read_status, sessions)
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def distributed(sessions: int, work: Path) -> dict:
    import psycopg

    from benchmarks.agent_scale import fresh_user
    from tests.stack import Stack, StackNode, mock_inventory

    token = fresh_user()
    node = StackNode("bench-node", mock_inventory(gpus=1), devices=1)
    stack = Stack(nodes=[node], work_dir=work / "distributed").start(timeout=180)
    try:
        database = psycopg.connect(DATABASE_URL, autocommit=True)

        def read_status(session_id: str) -> str | None:
            row = database.execute(STATUS_SQL.format("%s"), [session_id]).fetchone()
            return row[0] if row else None

        return run(Api(stack.port, token), read_status, sessions)
    finally:
        stack.close()


def summary(name: str, figures: dict) -> str:
    parts = []
    for what in ("launch", "POST answer", "terminate", "DELETE answer"):
        values = figures[what]
        parts.append(f"{what} p50 {statistics.median(values):7.1f}  p95 {percentile(values, 0.95):7.1f}  max {max(values):7.1f}")
    return f"{name:<12} " + "   ".join(parts) + f"   (ms, {len(figures['launch'])} sessions)"


def main() -> None:
    # The consoles and agents it starts stop their sessions when they stop: a held process-runtime session
    # outlives its console by default, for the next start to adopt, and each run left its holders running.
    os.environ.setdefault("FGPU_STOP_SESSIONS_ON_EXIT", "true")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=30)
    parser.add_argument("--modes", nargs="*", default=["standalone", "distributed"])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "launch.txt"))
    parser.add_argument("--keep", metavar="DIR", help="keep the processes' logs in DIR (default: a removed temporary directory)")
    args = parser.parse_args()
    setup_django()
    lines = [f"# benchmarks/launch.py --sessions {args.sessions}  ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores)"]
    with tempfile.TemporaryDirectory(prefix=f"fgpu-launch-{uuid.uuid4().hex[:6]}-") as tmp:
        tmp = args.keep or tmp
        for mode in args.modes:
            work = Path(tmp) / mode
            work.mkdir(parents=True)
            figures = {"standalone": standalone, "distributed": distributed}[mode](args.sessions, work)
            lines.append(summary(mode, figures))
            print(lines[-1], flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
