"""What starting a session's leader costs the agent (issue 14, item 3: launches): `popen_leader`
readying the leader in /bin/sh (LEADER_SCRIPT: join the session's cgroup, take the terminal,
exec) against its fallback, a preexec_fn that does the same in the forked child, with the agent
holding more or less memory.

    python -m benchmarks.leader_spawn [--rss 0 120 340] [--repeat 200] [--out PATH]

For each resident size (`--rss`, MiB: a touched bytearray this process holds, as an agent at
~120 MiB or a standalone console at ~340 MiB does), `--repeat` leaders of `/bin/true` on a new
PTY in a new cgroup of their own (the real `open_session_cgroups`, "auto"), the two ways
alternating: how long `popen_leader` blocks its caller (the agent's worker thread), and until
the command has exited (it ran in its cgroup, with the terminal). Python's subprocess forks the
whole process for a preexec_fn and uses vfork/posix_spawn without one, so the fallback's cost
grows with the process's page tables. Medians and p95 in milliseconds, and the ratio of the
medians. Needs a writable cgroup2 hierarchy (root).
"""

from __future__ import annotations

import argparse
import os
import pty
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agent import runtimes  # noqa: E402
from agent.runtimes import CGROUP_AUTO, open_session_cgroups, popen_leader  # noqa: E402
from benchmarks.agent_scale import percentile, proc_status  # noqa: E402

WAYS = ("script", "preexec_fn")


@contextmanager
def way(name: str):
    """`popen_leader` as it runs in an agent that ignores none of the reset signals ("script"),
    or as in one that does ("preexec_fn": its fallback)."""
    if name == "script":
        yield
    else:
        with mock.patch.object(runtimes, "_ignored", return_value=True):
            yield


def one(cgroups, name: str, index: int) -> tuple[float, float]:
    """(ms until popen_leader returned, ms until the command exited) for one leader."""
    cgroup = cgroups.create(f"bench-{name}-{index}")
    master, slave = pty.openpty()
    try:
        with way(name):
            started = time.perf_counter()
            process = popen_leader(
                ["/bin/true"], cgroup=cgroup, tty=os.ttyname(slave), stdin=slave, stdout=slave, stderr=slave,
                cwd="/", env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            )  # fmt: skip
            returned = time.perf_counter()
        code = process.wait()
        exited = time.perf_counter()
        if code != 0:
            raise SystemExit(f"the {name} leader ended with {code}")
        return (returned - started) * 1000, (exited - started) * 1000
    finally:
        os.close(slave)
        os.close(master)
        cgroup.remove()


def measure(cgroups, rss_mib: int, repeat: int) -> list[str]:
    ballast = bytearray(rss_mib * 1024 * 1024)
    for offset in range(0, len(ballast), 4096):  # touched, so the pages are resident and mapped
        ballast[offset] = 1
    figures: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in WAYS}
    for index in range(repeat):
        for name in WAYS if index % 2 == 0 else reversed(WAYS):
            blocked, exited = one(cgroups, name, index)
            figures[name][0].append(blocked)
            figures[name][1].append(exited)
    del ballast
    lines = []
    for name in WAYS:
        blocked, exited = figures[name]
        lines.append(
            f"rss +{rss_mib:>4} MiB  {name:<10}  popen_leader returns p50 {statistics.median(blocked):6.2f} "
            f"p95 {percentile(blocked, 0.95):6.2f}   command exited p50 {statistics.median(exited):6.2f} "
            f"p95 {percentile(exited, 0.95):6.2f}   (ms, {repeat} leaders)"
        )
    for what, column in (("popen_leader returns", 0), ("command exited", 1)):
        script, fallback = (statistics.median(figures[name][column]) for name in WAYS)
        lines.append(f"rss +{rss_mib:>4} MiB  script / preexec_fn, {what}: {script / fallback:.3f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rss", type=int, nargs="*", default=[0, 120, 340], help="MiB this process holds besides itself")
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "leader_spawn.txt"))
    args = parser.parse_args()
    cgroups, why = open_session_cgroups(CGROUP_AUTO, name=f"fgpu-bench-leader-{os.getpid()}")
    if cgroups is None:
        raise SystemExit(f"no cgroup for the leaders: {why}")
    try:
        lines = [f"# python -m benchmarks.leader_spawn --rss {' '.join(map(str, args.rss))} --repeat {args.repeat}"]
        rss_mib_now = proc_status(os.getpid())[0] / 2**20
        lines.append(f"# {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, this process at {rss_mib_now:.0f} MiB")
        for rss_mib in args.rss:
            lines += measure(cgroups, rss_mib, args.repeat)
    finally:
        cgroups.close()
    text = "\n".join(lines) + "\n"
    print(text, end="")
    with open(args.out, "a") as f:
        f.write(text)


if __name__ == "__main__":
    main()
