"""Blocking execs held at once against the distributed stack (uvicorn, Celery manager and beat,
one agent, Redis, PostgreSQL: tests/stack.py): how many threads the web process has, and how
long a quick GET takes, while N execs (`POST /api/v1/sessions/<id>/exec/`, `sleep --hold`) wait
for their agent.

    python benchmarks/exec_concurrency.py [--held 20 100] [--hold 20] [--label after] \
        [--out benchmarks/results/exec_concurrency.txt]

For each N: N client threads post the exec at once; after --settle seconds (every request is
in the web process by then) the web process's thread count is read from /proc and five GETs
of the session (one connection each, one after another) are timed; then every exec's answer is
collected (status counts). The agent runs at most 32 blocking execs at a time
(agent.core.EXEC_THREADS), so with N > 32 the later ones wait in the agent as well: all N stay
held in the web process. Environment: FGPU_BENCH_DATABASE_URL (a database of its own, created
and flushed), FGPU_BENCH_REDIS_URL (a Redis database of its own, flushed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.agent_scale import fresh_user, setup_django  # noqa: E402
from tests.stack import Stack, StackNode, mock_inventory, wait_until  # noqa: E402

DATABASE_URL = os.environ.get("FGPU_BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/fgpu_bench_exec")
REDIS_URL = os.environ.get("FGPU_BENCH_REDIS_URL", "redis://127.0.0.1:6379/10")


def call(base: str, token: str, method: str, path: str, body: dict | None = None, timeout: float = 300):
    request = urllib.request.Request(
        base + path,
        method=method,
        data=json.dumps(body).encode() if body else None,
        headers={"Authorization": f"Token {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}
    except OSError as exc:
        return 0, {"error": str(exc)}


def threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def timed_gets(base: str, token: str, path: str, n: int = 5) -> list[tuple[float, int]]:
    """(milliseconds, status) of `n` GETs of `path`, one after another."""
    out = []
    for _ in range(n):
        start = time.perf_counter()
        status, _ = call(base, token, "GET", path, timeout=120)
        out.append(((time.perf_counter() - start) * 1000, status))
    return out


def measure(base: str, token: str, web_pid: int, session_id: str, held: int, hold_s: int, settle_s: float) -> str:
    path = f"/api/v1/sessions/{session_id}/"
    if not held:
        gets = timed_gets(base, token, path)
        return (
            f"held    0: web threads {threads_of(web_pid):4d}; GET ms p50 {statistics.median(g for g, _ in gets):8.1f} "
            f"max {max(g for g, _ in gets):8.1f} statuses {dict(Counter(s for _, s in gets))}"
        )
    with ThreadPoolExecutor(held) as pool:
        execs = [
            pool.submit(
                call,
                base,
                token,
                "POST",
                f"/api/v1/sessions/{session_id}/exec/",
                {"command": ["sleep", str(hold_s)], "timeout": 120},
            )
            for _ in range(held)
        ]
        time.sleep(settle_s)  # a benchmark waiting for its clients' requests to arrive (not a test)
        threads = threads_of(web_pid)
        gets = timed_gets(base, token, path)
        answered_during = sum(f.done() for f in execs)
        statuses = Counter(f.result()[0] for f in execs)
    return (
        f"held {held:4d}: web threads {threads:4d}; GET ms p50 {statistics.median(g for g, _ in gets):8.1f} "
        f"max {max(g for g, _ in gets):8.1f} statuses {dict(Counter(s for _, s in gets))}; "
        f"execs answered before the GETs ended {answered_during}, exec statuses {dict(statuses)}"
    )


@contextlib.contextmanager
def stack_with_a_running_session(token: str, *, database_url: str, redis_url: str):
    """The distributed stack (one mock node) on `database_url` and `redis_url`, with one 0.5 fGPU
    session of `token`'s user RUNNING: yields (stack, the session's API shape)."""
    with tempfile.TemporaryDirectory() as work:
        with Stack(
            nodes=[StackNode("bench-node", mock_inventory(gpus=1))],
            work_dir=Path(work),
            redis_url=redis_url,
            database_url=database_url,
        ) as stack:
            status, created = call(
                stack.base,
                token,
                "POST",
                "/api/v1/sessions/",
                {"name": "held", "resources": {"cuda.shares": "0.5", "cpu": 1, "mem": "1G"}},
            )
            assert status == 201, created
            wait_until(
                lambda: call(stack.base, token, "GET", f"/api/v1/sessions/{created['id']}/")[1].get("status") == "RUNNING",
                timeout=60,
                what="the session RUNNING",
            )
            yield stack, created


def measure_held(held: list[int], measure_one, *, database_url: str, redis_url: str, label: str, out: str) -> None:
    """On a stack with one running session (on `database_url` and `redis_url`),
    `measure_one(stack, token, session_id, n)` (a report line) for 0 and each count of `held`; the
    lines printed, each after `label` where there is one, and appended to the file `out` ("": none)."""
    setup_django(database_url)
    token = fresh_user()
    with stack_with_a_running_session(token, database_url=database_url, redis_url=redis_url) as (stack, created):
        lines = [measure_one(stack, token, created["id"], n) for n in [0, *held]]
    report = "\n".join(f"{label}: {line}" if label else line for line in lines) + "\n"
    print(report, end="")
    if out:
        with open(out, "a") as f:
            f.write(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--held", type=int, nargs="+", default=[20, 100])
    parser.add_argument("--hold", type=int, default=20, help="seconds each exec's command runs")
    parser.add_argument("--settle", type=float, default=4.0, help="seconds between the posts and the measurement")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    measure_held(
        args.held,
        lambda stack, token, session_id, n: measure(
            stack.base, token, stack.procs["web"].pid, session_id, n, args.hold, args.settle
        ),
        database_url=DATABASE_URL,
        redis_url=REDIS_URL,
        label=args.label,
        out=args.out,
    )


if __name__ == "__main__":
    main()
