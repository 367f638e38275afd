"""What finding a session's processes costs the agent (issue 14, item 3): the process runtime's
`alive`, `signal_all` and `kill_all`, and kill → the last process gone, with the session's own
cgroup v2 against the /proc scan (the fallback), while N other idle processes run on the node.

    python -m benchmarks.process_tracking [--extra 0 100 2000] [--repeat 200] [--sessions 20] [--out PATH]

Per N (`--extra`: idle `sleep` processes this benchmark starts, and kills at the end) and per
way of tracking (agent.toml's `cgroup-root`: "auto", which must find a writable cgroup2
hierarchy, and "none"): one session of the real `ProcessRuntime` whose program starts three
processes (a background job, a nohup'd one and a setsid daemon); `alive()` and
`signal_all(0)` (signal 0: the lookup without the signal) timed `--repeat` times each; then
`--sessions` sessions started one after another, each `kill_all()` timed, and the time from it
until none of its processes is left (the cgroup: woken by cgroup.events, as the agent's
`_wait_gone`; the scan: `alive` polled every 5 ms, then less often, as before). Medians in
microseconds (kill → gone: p50 in milliseconds). The idle processes are older than the
sessions, so the scan reads only their stat file (not their environment): its best case.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
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

from agent.runtimes import CGROUP_AUTO, CGROUP_NONE, ProcessRuntime  # noqa: E402
from protocol.messages import SessionId, StartSpec  # noqa: E402

PROGRAM = "sleep 1000 & nohup sleep 1000 >/dev/null 2>&1 & setsid sleep 1000 & echo ready; wait"
MODES = {"cgroup": CGROUP_AUTO, "scan": CGROUP_NONE}


def start_idle(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(["sleep", "3600"], stdin=subprocess.DEVNULL) for _ in range(count)]


def stop_idle(idle: list[subprocess.Popen]) -> None:
    for process in idle:
        process.kill()
    for process in idle:
        process.wait()


def spawn(runtime: ProcessRuntime, scratch: Path):
    """A session with 4 processes (its shell and 3 it started), once all run."""
    session_id = str(uuid.uuid4())
    work = scratch / session_id
    work.mkdir(parents=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "FGPU_SESSION_ID": session_id,
        "FGPU_ALLOCATION": f"{work}/.fgpu/allocation.json",
    }
    spec = StartSpec(session_id=SessionId(session_id), name="bench", owner="bench", command=PROGRAM, cpu=1, mem=0, devices=())
    handle = runtime.spawn(spec=spec, argv=["/bin/sh", "-c", PROGRAM], env=env, work_dir=work)
    deadline = time.monotonic() + 10
    while len(handle.pids()) < 4:  # the setsid one is found by its environment (scan) or cgroup
        if time.monotonic() > deadline:
            raise SystemExit(f"the session's processes did not start: {handle.pids()}")
        time.sleep(0.001)
    return handle


def timed(fn, repeat: int) -> float:
    """Median microseconds of `fn()`."""
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1e6)
    return statistics.median(samples)


def wait_gone(handle) -> None:
    """Until none of the session's processes is left: as the agent's `_wait_gone`."""
    watch = handle.watch()
    if watch is None:
        pause = 0.005
        while handle.alive():
            time.sleep(pause)
            pause = min(pause * 2, 0.1)
        return
    try:
        while watch.populated():
            watch.wait(5.0)
    finally:
        watch.close()


def end(handle) -> None:
    handle.kill_all()
    handle.process.kill()
    handle.wait()
    wait_gone(handle)
    handle.remove()
    handle.close_stream()


def measure(mode: str, *, repeat: int, sessions: int) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="fgpu-bench-tracking-"))
    runtime = ProcessRuntime(node=f"bench-tracking-{os.getpid()}", cgroup_root=MODES[mode])
    try:
        runtime.clean_up_at_start(scratch)
        if (runtime.cgroups is not None) != (mode == "cgroup"):
            raise SystemExit(f"{mode}: the runtime did not take that mode (is cgroup v2 writable here?)")
        handle = spawn(runtime, scratch)
        try:
            alive = timed(handle.alive, repeat)
            signal_all = timed(lambda: handle.signal_all(0), repeat)
        finally:
            end(handle)
        kill, gone = [], []
        for _ in range(sessions):
            handle = spawn(runtime, scratch)
            time.sleep(0.05)  # a session runs a while: the kernel notifies cgroup.events at most every 10 ms
            handle.process.kill()  # as in _wait_exit: the leader first, reaped, then the rest
            handle.wait()
            started = time.perf_counter()
            left = handle.kill_all()
            killed = time.perf_counter()
            wait_gone(handle)
            gone.append((time.perf_counter() - started) * 1000)
            kill.append((killed - started) * 1e6)
            assert left >= 1, left  # the background job may end on the leader's hangup; the setsid one does not
            handle.remove()
            handle.close_stream()
        return {
            "alive_us": alive,
            "signal_all_us": signal_all,
            "kill_all_us": statistics.median(kill),
            "kill_to_gone_ms": statistics.median(gone),
        }
    finally:
        if runtime.cgroups is not None:
            runtime.cgroups.clean_up()  # what an interrupted run left
        runtime.close()
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extra", type=int, nargs="*", default=[0, 100, 2000])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    lines = [
        f"{'extra procs':>11} {'mode':<7} {'alive µs':>9} {'signal_all µs':>14} {'kill_all µs':>12} {'kill→gone ms':>13}",
    ]
    print(lines[0], flush=True)
    for extra in args.extra:
        idle = start_idle(extra)
        try:
            results = {mode: measure(mode, repeat=args.repeat, sessions=args.sessions) for mode in MODES}
        finally:
            stop_idle(idle)
        for mode, r in results.items():
            line = (
                f"{extra:>11} {mode:<7} {r['alive_us']:>9.0f} {r['signal_all_us']:>14.0f} {r['kill_all_us']:>12.0f} "
                f"{r['kill_to_gone_ms']:>13.2f}"
            )
            lines.append(line)
            print(line, flush=True)
        scan, cgroup = results["scan"], results["cgroup"]
        ratio = (
            f"{'':>11} scan/cgroup: alive {scan['alive_us'] / cgroup['alive_us']:.0f}×, signal_all "
            f"{scan['signal_all_us'] / cgroup['signal_all_us']:.0f}×, kill_all {scan['kill_all_us'] / cgroup['kill_all_us']:.0f}×"
        )
        lines.append(ratio)
        print(ratio, flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
