"""The everyday API paths under load (issue 14): the session list and the node list against
`GET /api/v1/me/`, from outside, as wrk measures a server.

    DATABASE_URL=postgres://… python benchmarks/api.py [--clients 8] [--seconds 10] [--nodes 1000]
        [--sessions 120] [--out benchmarks/results/api.txt]

Creates a throw-away database (`bench_api_<name>` beside DATABASE_URL's, dropped afterwards)
and fills it as a real cluster would be filled (tests/seed.py): `--nodes` nodes of 8 mock GPUs
registered by `node_inventory_apply` (as their agents would) and a dynamic-MIG node of 4 H100s,
then `--sessions` sessions of one user in every request style (fGPU, memory + cores, fraction,
MIG profile, isolation "any", CPU only), placed by the scheduler, a tenth ended and a tenth
waiting. Starts one web process (uvicorn, the command tests/stack.py runs) on it and measures,
one after another:

1. `GET /api/v1/sessions/` (the default page: 100 rows) and `GET /api/v1/me/`, each for
   `--seconds` by `--clients` clients in a closed loop (each a thread with its own keep-alive
   HTTP/1.1 connection, sending its next request when the answer has arrived): requests per
   second, p50 and p99 latency; and the ratio of the two throughputs (issue 14's target: ≥ 0.8).
2. `GET /api/v1/nodes/` (the default page: 100 nodes, 800 GPUs, of `--nodes`) by one client,
   then by `--clients`: p50 and p99 latency (target: p50 < 200 ms), and all of them at once
   (`?limit=1000`) by one client.
3. The database queries each of these answers with (in this process, Django's test client on
   the same database) for a page of 1 row and of 100 (`?limit=`): equal when the count does
   not grow with the page; for the sessions also asked again, when the page comes from the
   shapes the process kept (sessions.api.shapes).

Needs PostgreSQL only: the web process and this one run without Redis (no GET here uses it).
Figures go to stdout and to --out.
"""

from __future__ import annotations

import argparse
import http.client
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
from benchmarks.agent_scale import percentile  # noqa: E402 (after the path; no Django at import)

SESSIONS = "/api/v1/sessions/"
ME = "/api/v1/me/"
NODES = "/api/v1/nodes/"
RATIO_TARGET = 0.8
NODES_P50_TARGET_MS = 200


class Client(threading.Thread):
    """One closed-loop client: over one keep-alive connection, one untimed GET of `path` (a
    warm-up), then at `ready` (a barrier every client and the timer wait at) GETs of it until
    `stop` is set, recording each answer's latency in seconds; an answer other than 200 counts
    as an error."""

    def __init__(self, port: int, path: str, token: str, ready: threading.Barrier, stop: threading.Event):
        super().__init__(daemon=True)
        self.port, self.path, self.ready, self.stop = port, path, ready, stop
        self.headers = {"Authorization": f"Token {token}", "Accept": "application/json"}
        self.latencies: list[float] = []
        self.errors = 0

    def run(self) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            self._get(connection)
            self.ready.wait()
            while not self.stop.is_set():
                status, elapsed = self._get(connection)
                if status != 200:
                    self.errors += 1
                elif not self.stop.is_set():  # an answer after the end of the run is not counted
                    self.latencies.append(elapsed)
        finally:
            connection.close()

    def _get(self, connection: http.client.HTTPConnection) -> tuple[int, float]:
        began = time.perf_counter()
        connection.request("GET", self.path, headers=self.headers)
        response = connection.getresponse()
        response.read()
        elapsed = time.perf_counter() - began
        if response.will_close:
            connection.close()  # reopened by the next request
        return response.status, elapsed


def load(port: int, path: str, token: str, *, clients: int, seconds: float) -> dict:
    """`clients` Clients on `path` for `seconds`: {"clients", "requests", "rps", "p50_ms",
    "p99_ms", "errors"}."""
    ready, stop = threading.Barrier(clients + 1), threading.Event()
    running = [Client(port, path, token, ready, stop) for _ in range(clients)]
    for client in running:
        client.start()
    ready.wait()
    began = time.perf_counter()
    stop.wait(seconds)
    stop.set()
    elapsed = time.perf_counter() - began
    for client in running:
        client.join()
    latencies = [v for c in running for v in c.latencies]
    return {
        "clients": clients,
        "requests": len(latencies),
        "rps": len(latencies) / elapsed,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * percentile(latencies, 0.99),
        "errors": sum(c.errors for c in running),
    }


def query_counts(token: str, path: str) -> dict:
    """{rows: queries} for pages of 1 and 100 rows of `path` (Django's test client, this process)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from rest_framework.test import APIClient

    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    counts = {}
    for rows in (1, 100):
        for repeat in range(2):  # the second: a page of kept session shapes (sessions.api.shapes)
            with CaptureQueriesContext(connection) as queries:
                response = api.get(path, {"limit": rows})
            assert response.status_code == 200, response.content[:300]
            counts[rows, repeat] = len(queries)
    return counts


def seed(*, nodes: int, sessions: int) -> str:
    """The cluster and the user's sessions (module docstring); returns the user's API token."""
    from django.contrib.auth import get_user_model
    from django.db import transaction
    from accounts.services import login_token_issue

    from tests.seed import gpu_cluster, sessions_in_every_style

    with transaction.atomic():
        gpu_cluster(nodes=nodes, gpus=8, mig_gpus=4)
    user = get_user_model().objects.create_user("bench")
    sessions_in_every_style(owner=user, count=sessions)
    return login_token_issue(user=user)


def serve(work: Path):
    """The web process on the benchmark's database; returns (process, port) once it answers."""
    from tests.stack import Proc, database_url_default, free_port, wait_until, web_answers, web_command

    port = free_port()
    env = {**os.environ, "DATABASE_URL": database_url_default(), "FGPU_DATA_DIR": str(work / "data"), "FGPU_LOG_LEVEL": "WARNING"}
    env.pop("REDIS_URL", None)
    web = Proc("web", web_command(port), env=env, log_dir=work)
    try:  # its first answer took over a minute on the shared 2-core machine at load 20 (1,000 nodes)
        wait_until(lambda: web_answers(f"http://127.0.0.1:{port}"), timeout=300, what="the web process to answer")
    except BaseException:
        web.stop()  # never left running on the database the caller is about to drop
        raise
    return web, port


def run(args) -> list[str]:
    token = seed(nodes=args.nodes, sessions=args.sessions)
    lines = [
        f"{args.nodes:,} nodes × 8 GPUs (+ a 4-GPU MIG node), {args.sessions} sessions of one user; "
        f"one uvicorn process; {os.cpu_count()} CPU(s), load generator on the same machine",
        "",
    ]
    with tempfile.TemporaryDirectory() as scratch:
        web, port = serve(Path(scratch))
        try:
            sessions = load(port, SESSIONS, token, clients=args.clients, seconds=args.seconds)
            me = load(port, ME, token, clients=args.clients, seconds=args.seconds)
            nodes_one = load(port, NODES, token, clients=1, seconds=args.seconds)
            nodes_many = load(port, NODES, token, clients=args.clients, seconds=args.seconds)
            nodes_all = load(port, NODES + "?limit=1000", token, clients=1, seconds=args.seconds)
        finally:
            web.stop()
    ratio = sessions["rps"] / me["rps"]
    lines.append(f"{'GET':<38} {'clients':>7} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6}")
    page, every = f"{min(args.nodes + 1, 100)} nodes", f"{min(args.nodes + 1, 1000):,} nodes"
    for name, r in (
        (f"{SESSIONS} (100 rows)", sessions),
        (ME, me),
        (f"{NODES} ({page})", nodes_one),
        (f"{NODES} ({page})", nodes_many),
        (f"{NODES}?limit=1000 ({every})", nodes_all),
    ):
        lines.append(f"{name:<38} {r['clients']:>7} {r['rps']:>8.1f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['errors']:>6}")
    lines += [
        "",
        f"sessions / me throughput: {ratio:.2f} (target ≥ {RATIO_TARGET}: {'met' if ratio >= RATIO_TARGET else 'MISSED'})",
        f"nodes p50, one client: {nodes_one['p50_ms']:.1f} ms (target < {NODES_P50_TARGET_MS} ms: "
        f"{'met' if nodes_one['p50_ms'] < NODES_P50_TARGET_MS else 'MISSED'})",
        "",
        "queries per request, for a page of 1 row / of 100 rows:",
    ]
    for path in (SESSIONS, NODES, "/api/v1/devices/"):
        counts = query_counts(token, path)
        lines.append(f"  {path:<22} {counts[1, 0]:>3} / {counts[100, 0]:>3}")
        if path == SESSIONS:
            lines.append(f"  {'  again (shapes kept)':<22} {counts[1, 1]:>3} / {counts[100, 1]:>3}")
    counts = query_counts(token, ME)
    lines.append(f"  {ME:<22} {counts[1, 0]:>3} (not paged)")
    lines.append("  (fewer for 1 row where that row has no node or fGPU amount to read: none is added per row)")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--sessions", type=int, default=120)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "api.txt")
    args = parser.parse_args()
    os.environ.pop("REDIS_URL", None)  # in-memory channel layer, cache and (eager) Celery: no Redis needed
    os.environ.setdefault("FGPU_LOG_LEVEL", "WARNING")  # not a line per scheduler pass while seeding
    os.environ.setdefault("FGPU_SECRET_KEY", secrets.token_urlsafe(48))  # the web process refuses to start without one
    import django

    django.setup()
    from django.db import connection

    from benchmarks.database import throwaway_database
    from benchmarks.output import figures_write

    if connection.vendor != "postgresql":
        sys.exit("benchmarks/api.py needs PostgreSQL: set DATABASE_URL=postgres://…")
    began = time.perf_counter()
    with throwaway_database("bench_api"):
        lines = run(args)
    command = (
        f"python benchmarks/api.py --clients {args.clients} --seconds {args.seconds:g} --nodes {args.nodes} "
        f"--sessions {args.sessions}"
    )
    figures_write(lines, began=began, command=command, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
