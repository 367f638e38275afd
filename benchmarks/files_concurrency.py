"""File listings held at once against the distributed stack (uvicorn, Celery manager and beat,
one agent, Redis, PostgreSQL: tests/stack.py) by an agent that does not answer (SIGSTOP): how
many threads the web process has, how many of the requests reached the agent's channel, and how
long a quick GET takes, while N listings (`GET /api/v1/sessions/<id>/files/`) wait for it.

    python -m benchmarks.files_concurrency [--held 20 60] [--settle 4] [--label after] \
        [--out benchmarks/results/files_concurrency.txt]

For each N: the agent is stopped, N client threads ask for the listing at once; after --settle
seconds the web process's thread count is read from /proc, the listings whose op reached the
session's `pty-<id>` group are counted (a listener joined to it, as in
tests/test_files_concurrency.py), and five GETs of the session (one after another) are timed;
then the agent is continued and every listing's status collected. The web waits 30 s for the
agent's answer (sessions.serving.files.REPLY_WAIT_S): keep --settle well below. Environment:
FGPU_BENCH_DATABASE_URL (a database of its own, created and flushed), FGPU_BENCH_REDIS_URL (a
Redis database of its own, flushed).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.exec_concurrency import call, measure_held, threads_of, timed_gets  # noqa: E402
from tests.stack import Stack  # noqa: E402

DATABASE_URL = os.environ.get("FGPU_BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/fgpu_bench_files")
REDIS_URL = os.environ.get("FGPU_BENCH_REDIS_URL", "redis://127.0.0.1:6379/10")


def measure(stack: Stack, token: str, session_id: str, held: int, settle_s: float) -> str:
    from sessions.lifecycle import events
    from tests.test_files_concurrency import Listener

    web, agent = stack.procs["web"].pid, stack.agents["bench-node"].pid
    path = f"/api/v1/sessions/{session_id}/"
    if not held:
        gets = timed_gets(stack.base, token, path)
        return (
            f"held    0: web threads {threads_of(web):4d}; GET ms p50 {statistics.median(g for g, _ in gets):8.1f} "
            f"max {max(g for g, _ in gets):8.1f} statuses {dict(Counter(s for _, s in gets))}"
        )
    listener = Listener(stack.redis_url, events.pty_group("bench-node", session_id), held)
    listener.start()
    assert listener.joined.wait(30)
    os.kill(agent, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(held) as pool:
            lists = [pool.submit(call, stack.base, token, "GET", f"{path}files/?path=", None, 120) for _ in range(held)]
            time.sleep(settle_s)  # a benchmark waiting for its clients' requests to arrive (not a test)
            threads, reached = threads_of(web), listener.seen()
            gets = timed_gets(stack.base, token, path)
            answered_during = sum(f.done() for f in lists)
            os.kill(agent, signal.SIGCONT)
            statuses = Counter(f.result()[0] for f in lists)
    finally:
        os.kill(agent, signal.SIGCONT)
    return (
        f"held {held:4d}: web threads {threads:4d}; reached the agent {reached:4d}; GET ms p50 "
        f"{statistics.median(g for g, _ in gets):8.1f} max {max(g for g, _ in gets):8.1f} statuses "
        f"{dict(Counter(s for _, s in gets))}; listings answered before the GETs ended {answered_during}, "
        f"listing statuses {dict(statuses)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--held", type=int, nargs="+", default=[20, 60])
    parser.add_argument("--settle", type=float, default=4.0, help="seconds between the requests and the measurement")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    measure_held(
        args.held,
        lambda stack, token, session_id, n: measure(stack, token, session_id, n, args.settle),
        database_url=DATABASE_URL,
        redis_url=REDIS_URL,
        label=args.label,
        out=args.out,
    )


if __name__ == "__main__":
    main()
