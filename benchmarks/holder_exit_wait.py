"""How long a held session's `wait` takes once its leader exited: the holder's exit record
(agent.runtimes.HeldSession.wait, which every terminate of a process-runtime session waits for).

    python benchmarks/holder_exit_wait.py [--sessions 30]

The process runtime (held, sandboxed where bubblewrap runs, /proc scan: no cgroups), one session
of `sleep 0.1` at a time: the leader's exit waited for first (its pidfd), then `wait` timed.
Prints the load average and p50 / mean / max in milliseconds. Issue 35.3: the record was looked
for every 5 ms, which a terminate paid in full where the holder wrote it at once.
"""

from __future__ import annotations

import argparse
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=30)
    args = parser.parse_args()
    from agent.runtimes import CGROUP_NONE, ProcessRuntime, _wait_exit
    from protocol.messages import StartSpec

    from benchmarks.launch_latency import spec

    runtime = ProcessRuntime(node="exit-wait", cgroup_root=CGROUP_NONE, hold=True)
    with tempfile.TemporaryDirectory(prefix="fgpu-exit-wait-") as tmp:
        scratch = Path(tmp) / "scratch"
        runtime.clean_up_at_start(scratch)
        waits = []
        try:
            for _ in range(args.sessions):
                work_dir = scratch / str(uuid.uuid4())
                work_dir.mkdir(parents=True)
                start = StartSpec.decode({**spec(), "session_id": work_dir.name})
                handle = runtime.spawn(
                    spec=start, argv=["/bin/sh", "-c", "sleep 0.1"], env={"PATH": "/usr/bin:/bin"}, work_dir=work_dir
                )
                _wait_exit(handle.pid, 10.0)
                began = time.perf_counter()
                handle.wait()
                waits.append((time.perf_counter() - began) * 1000)
                handle.kill_all()
                handle.close_stream()
                handle.remove()
        finally:
            runtime.close()
    load = os.getloadavg()[0]
    print(
        f"load {load:.1f}: wait once the leader exited p50 {statistics.median(waits):.2f} ms, mean {statistics.mean(waits):.2f}, "
        f"max {max(waits):.2f} ({len(waits)} sessions)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
