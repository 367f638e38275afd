"""What a session's runtime costs: start → RUNNING and stop → TERMINATED on one agent, for the
`process` runtime and the `docker` runtime, in one run.

    python benchmarks/launch_latency.py [--sessions 50] [--runtimes process docker] [--pause 0] [--image fgpu-session:test]
                                        [--json]

A real Agent (agent.core) on its own event loop, with a manager that records its
reports (the manager's side, the same for both runtimes, is measured by scheduler_db.py and the
API benchmarks); the start spec is a 0.5 fGPU interactive session on a mock GPU. Per runtime:
`--sessions` sessions started one after another (each timed from the start message to its
RUNNING report; `--pause` seconds between a RUNNING and the next start, as launches come apart), then
stopped one after another (from the stop to the TERMINATED report).
Prints p50 / p95 / max in milliseconds and docker's overhead over process (ratios of p50s, where
both ran). Needs Docker Engine and the image (tests/images/build.sh) for the docker half.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

GiB = 1 << 30


class Reports:
    """The manager's side: records when each report arrives (called from the agent's threads)."""

    def __init__(self, loop):
        self.loop = loop
        self.seen: dict[tuple[str, str], float] = {}
        self.changed = asyncio.Event()

    def _note(self, session_id, status):
        self.seen[(session_id, status)] = time.perf_counter()
        self.loop.call_soon_threadsafe(self.changed.set)

    def register(self, *args):
        pass

    def heartbeat(self, *args):
        pass

    def log(self, *args):
        pass

    def mig_report(self, *args):
        pass

    def report(self, session_id, status, reason, exit_code):
        self._note(session_id, status)

    async def wait(self, session_id, status, timeout=60.0):
        async with asyncio.timeout(timeout):
            while (session_id, status) not in self.seen:
                self.changed.clear()
                await self.changed.wait()
        return self.seen[(session_id, status)]


def spec() -> dict:
    return {
        "session_id": str(uuid.uuid4()),
        "name": "bench",
        "owner": "bench",
        "command": "",
        "cpu": 1,
        "mem": GiB,
        "slot_name": "cuda",
        "slot_subtype": "shares",
        "devices": [
            {
                "device_id": "GPU-00000000-0000-0000-0000-000000000000",
                "index": 0,
                "model_name": "CUDA GPU",
                "memory_total": 8 * GiB,
                "subproc_count": 80,
                "memory_limit": 2 * GiB,
                "procs": "20",
                "shares": "0.5",
                "is_mig_device": False,
                "mig_profile": "",
            }
        ],
    }


async def measure(runtime, sessions: int, pause: float = 0.0) -> dict:
    from channels.layers import InMemoryChannelLayer

    from agent.core import Agent
    from protocol.messages import StartSpec

    reports = Reports(asyncio.get_running_loop())
    with tempfile.TemporaryDirectory() as scratch:
        agent = Agent(
            node=f"bench-{uuid.uuid4().hex[:6]}",
            inventory={"devices": [], "plugins": [], "attributes": {}},
            channel_layer=InMemoryChannelLayer(),
            manager=reports,
            scratch_root=Path(scratch),
            mock=True,
            heartbeat_s=60,
            runtime=runtime,
        )
        await agent.start()
        starts, stops, ids = [], [], []
        try:
            for _ in range(sessions):
                s = spec()
                began = time.perf_counter()
                await asyncio.to_thread(agent.submit_start, StartSpec.decode(s))  # as agent.tasks decodes it
                starts.append((await reports.wait(s["session_id"], "RUNNING")) - began)
                ids.append(s["session_id"])
                await asyncio.sleep(pause)
            for session_id in ids:
                began = time.perf_counter()
                await asyncio.to_thread(agent.submit_stop, session_id)
                stops.append((await reports.wait(session_id, "TERMINATED")) - began)
        finally:
            await agent.shutdown()
    return {"start_ms": summary(starts), "stop_ms": summary(stops)}


def summary(values: list[float]) -> dict:
    ms = sorted(v * 1000 for v in values)
    return {
        "p50": round(statistics.median(ms), 1),
        "p95": round(ms[max(0, int(len(ms) * 0.95) - 1)], 1),
        "max": round(ms[-1], 1),
        "n": len(ms),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--runtimes", nargs="+", choices=("process", "docker"), default=["process", "docker"])
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between a RUNNING and the next start")
    parser.add_argument("--image", default="fgpu-session:test")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import django

    django.setup()
    from agent.docker_runtime import DockerRuntime
    from agent.runtimes import ProcessRuntime

    results = {}
    if "process" in args.runtimes:
        results["process"] = asyncio.run(measure(ProcessRuntime(), args.sessions, args.pause))
    if "docker" in args.runtimes:
        docker = DockerRuntime(node="bench", default_image=args.image, network="none")
        results["docker"] = asyncio.run(measure(docker, args.sessions, args.pause))
    if len(results) == 2:
        results["docker_over_process"] = {
            kind: round(results["docker"][kind]["p50"] / results["process"][kind]["p50"], 1) for kind in ("start_ms", "stop_ms")
        }
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(
        f"{'runtime':<8} {'start p50':>10} {'p95':>8} {'max':>8}   {'stop p50':>9} {'p95':>8} {'max':>8}   (ms, "
        f"{args.sessions} sessions)"
    )
    for name in args.runtimes:
        r = results[name]
        print(
            f"{name:<8} {r['start_ms']['p50']:>10} {r['start_ms']['p95']:>8} {r['start_ms']['max']:>8}   "
            f"{r['stop_ms']['p50']:>9} {r['stop_ms']['p95']:>8} {r['stop_ms']['max']:>8}"
        )
    if "docker_over_process" in results:
        ratio = results["docker_over_process"]
        print(f"docker / process (p50): start {ratio['start_ms']}×, stop {ratio['stop_ms']}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
