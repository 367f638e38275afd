# ruff: noqa: E501 (MARKS quotes lines of the code it marks as they are)
"""Where a distributed launch and terminate spend their time, hop by hop (issue 35.3).

    python benchmarks/launch_hops.py [--rev HEAD] [--sessions 20] [--keep DIR]

Unpacks `--rev` (git archive) into a temporary directory, adds a timestamp mark at each hop of
launch and terminate in that copy only (the web's view, the launch's insert and commit, the
pass's ask, the manager's pass and its start messages, the agent's start, spawn and reports, the
manager's report tasks, their reads and writes; the DELETE's view and stop, the agent's stop,
the leader's exit, reap, PTY drain, the removal of what the session left, the TERMINATED report
and its apply), runs benchmarks/launch.py --modes distributed in it (the real stack of
tests/stack.py: uvicorn, a Celery manager worker and beat, one agent, a private Redis;
FGPU_BENCH_DATABASE_URL as for that benchmark, which empties it) and prints, over the counted
sessions (the first two warm up):

- each mark's median in ms since the POST was sent (launch) or since RUNNING was seen
  (terminate), with the median CPU its process spent (all threads) since its previous mark;
- the hops: per session, the time between two marks, median, min and max.

A mark is `time.time()` written with the process's pid to one file (FGPU_TRACE) by every
process, so the hops between processes are on one clock. Marks whose place the code no longer
has are left out with a warning (the copy is patched by text). Nothing of the checkout is
changed. The run's own figures (launch p50 and so on) are benchmarks/launch.py's, with the
marks' cost (a file append each, some 20 a session) in them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MARK_MODULE = """
import os, time
_F = os.environ.get("FGPU_TRACE")
def mark(what, sid="", at=None):
    if _F:
        fd = os.open(_F, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        line = f"{(at or time.time()):.6f} {os.getpid()} {what} {sid} {time.process_time():.6f}\\n"
        os.write(fd, line.encode())
        os.close(fd)
"""
IMPORT = "from protocol._hop_marks import mark as _mark\n"


def _before(rel: str, anchor: str, mark: str) -> tuple[str, str, str]:
    """The mark (a line of code, indented as `anchor`'s first line) put before `anchor` in `rel`."""
    indent = anchor[: len(anchor) - len(anchor.lstrip(" "))]
    return rel, anchor, f"{indent}_mark({mark})\n{anchor}"


def _after(rel: str, anchor: str, mark: str, indent: str) -> tuple[str, str, str]:
    """The mark (a line of code indented by `indent`) put after `anchor` (which ends its line) in `rel`."""
    return rel, anchor, f"{anchor}{indent}_mark({mark})\n"


S8, S12 = " " * 8, " " * 12
# (file, text found, text put in its place): each adds one `_mark(...)` call.
MARKS = [
    _before("sessions/api/sessions.py", f"{S8}key = idempotency.idempotency_key_check(", '"web_post_view"'),
    (
        "sessions/api/sessions.py",
        f"{S12}code, body, _ = launch()\n",
        f'{S12}code, body, _s = launch()\n{S12}_mark("web_post_done", _s.pk)\n',
    ),
    _before(
        "sessions/api/sessions.py", f"{S8}session = services.session_terminate(\n", '"web_delete_view", self.kwargs["session_id"]'
    ),
    _after(
        "sessions/admission/launch.py", f"{S8}events.session_notify_rendered(session)\n", '"web_create_inserted", session.pk', S8
    ),
    _before("sessions/admission/launch.py", "    return session\n\n\nDEFAULT_NAME_PREFIX", '"web_create_committed", session.pk'),
    _before(
        "sessions/lifecycle/passes.py",
        "    try:\n        if settings.REDIS_URL and not app.conf.task_always_eager:\n",
        '"pass_ask"',
    ),
    _after("sessions/lifecycle/passes.py", f"{S8}app.signature(SCHEDULE_PENDING_TASK).delay()\n", '"pass_asked"', S8),
    _before(
        "sessions/tasks.py",
        "    if settings.REDIS_URL and not app.conf.task_always_eager:\n        _redis().delete(",
        '"mgr_pass_task"',
    ),
    _after(
        "sessions/tasks.py",
        "    report = node_message_decoded(SessionReport, message)\n    if report is None:\n        return\n",
        '"mgr_report_" + report.status, report.session_id',
        "    ",
    ),
    _after(
        "sessions/tasks.py",
        "    session, authentic = _session_message(protocol.SESSION_REPORT, report.session_id, report.node, message)\n",
        '"mgr_read_" + report.status, report.session_id',
        "    ",
    ),
    _before(
        "sessions/scheduling/scheduler.py",
        f"{S12}{S12}agent_send(protocol.SESSION_START, producer=producer, node=node_name",
        '"mgr_start_send", spec["session_id"]',
    ),
    _before(
        "sessions/lifecycle/services.py",
        '    events.pty_send(link, session_id, {"type": "pty.stop"})\n',
        '"web_stop_send", session_id',
    ),
    _after(
        "sessions/lifecycle/services.py",
        f"{S12}agent_send(protocol.SESSION_STOP, **SessionStop(NodeName(node), SessionId(session_id)).encode())\n",
        '"web_stop_task_sent", session_id',
        S12,
    ),
    _after(
        "sessions/lifecycle/services.py",
        f"{S8}moved = ComputeSession.objects.filter(pk=session.pk, status__in=_REPORT_SOURCES[status]).update(**fields)\n",
        '"mgr_updated_" + status, session.pk',
        S8,
    ),
    _after(
        "sessions/lifecycle/services.py",
        "    released = Allocation.objects.filter(session_id=session.pk, released_at__isnull=True).update(released_at=now)\n",
        '"mgr_released", session.pk',
        "    ",
    ),
    _before("agent/tasks.py", "    _agent(node).submit_start(start)\n", '"agent_start_task", start.session_id'),
    _before("agent/tasks.py", f"{S8}_agent(stop.node).submit_stop(stop.session_id)\n", '"agent_stop_task", stop.session_id'),
    _after(
        "agent/core.py",
        f"{S8}elif isinstance(command, protocol_channel.PtyStop):  # the manager's stop, ahead of its task (protocol)\n",
        '"agent_pty_stop", running.session_id',
        S12,
    ),
    _before(
        "agent/lifecycle.py",
        f"{S8}if session_id in self.agent._starting:\n            return  # a redelivered",
        '"agent_start_loop", spec.session_id',
    ),
    _after(
        "agent/lifecycle.py",
        f"{S12}running = await self.agent._in(self.agent._work, self.agent._spawn, spec)\n",
        '"agent_spawned", session_id',
        S12,
    ),
    _after("agent/lifecycle.py", f"{S8}running.stopping = reason\n", '"agent_stop_begin", session_id', S8),
    _after(
        "agent/lifecycle.py", f"{S8}running.pidfd = -1\n{S8}running.exit_event.set()\n", '"agent_exit_fd", running.session_id', S8
    ),
    _after(
        "agent/lifecycle.py",
        f"{S12}code, left = await self.agent._on_process(running, reap_and_kill, running.process)\n",
        '"agent_reaped", running.session_id',
        S12,
    ),
    _before("agent/lifecycle.py", f"{S12}running.pipe.end_output()\n", '"agent_pty_eof", running.session_id'),
    (
        "agent/lifecycle.py",
        f"{S12}await self.agent._in(self.agent._work, running.process.remove)",
        f'{S12}await self.agent._in(self.agent._work, running.process.remove)\n{S12}_mark("agent_removed", running.session_id)',
    ),
    _before(
        "agent/manager_link.py",
        f"{S8}self._send(protocol.SESSION_REPORT, kwargs=report.encode())\n",
        '"agent_report_" + status, session_id',
    ),
    _after(
        "benchmarks/launch.py",
        f"{S8}answered = time.perf_counter()\n",
        '"bench_post_sent", body["id"], at=time.time() - (answered - started)',
        S8,
    ),
    _after("benchmarks/launch.py", f"{S8}running = time.perf_counter()\n", '"bench_running", body["id"]', S8),
    _after("benchmarks/launch.py", f"{S8}deleted = time.perf_counter()\n", '"bench_delete_answered", body["id"]', S8),
    _after("benchmarks/launch.py", f"{S8}ended = time.perf_counter()\n", '"bench_terminated", body["id"]', S8),
]

# Marks of the terminate (the others are the launch's); marks without a session id are numbered
# by their order in each session's window (#1: the pass a release asked for, #2: the launch's own).
TERMINATE = (
    "web_delete",
    "web_stop",
    "agent_stop",
    "agent_pty_stop",
    "agent_exit",
    "agent_reaped",
    "agent_pty_eof",
    "agent_removed",
    "mgr_released",
    "bench_delete",
    "bench_terminated",
)
HOPS = [
    ("bench_post_sent", "web_post_view#1"),
    ("web_post_view#1", "web_create_inserted"),
    ("web_create_inserted", "web_create_committed"),
    ("web_create_committed", "mgr_pass_task#2"),
    ("mgr_pass_task#2", "mgr_start_send"),
    ("mgr_start_send", "agent_start_task"),
    ("agent_start_task", "agent_start_loop"),
    ("agent_start_loop", "agent_spawned"),
    ("agent_spawned", "agent_report_RUNNING"),
    ("agent_report_RUNNING", "mgr_report_RUNNING"),
    ("mgr_report_RUNNING", "mgr_read_RUNNING"),
    ("mgr_read_RUNNING", "mgr_updated_RUNNING"),
    ("mgr_updated_RUNNING", "bench_running"),
    ("bench_running", "web_delete_view"),
    ("web_delete_view", "web_stop_send"),
    ("web_stop_send", "agent_pty_stop"),
    ("web_stop_send", "agent_stop_task"),
    ("agent_stop_begin", "agent_exit_fd"),
    ("agent_exit_fd", "agent_reaped"),
    ("agent_reaped", "agent_pty_eof"),
    ("agent_pty_eof", "agent_report_TERMINATED"),
    ("agent_pty_eof", "agent_removed"),
    ("agent_report_TERMINATED", "mgr_report_TERMINATED"),
    ("mgr_report_TERMINATED", "mgr_read_TERMINATED"),
    ("mgr_read_TERMINATED", "mgr_released"),
    ("mgr_released", "bench_terminated"),
    ("bench_running", "bench_delete_answered"),
    ("bench_running", "bench_terminated"),
]


def tree_with_marks(rev: str, dest: Path) -> None:
    """`rev` of this checkout unpacked into `dest`, with the marks placed (a warning for each not placed)."""
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    (dest / "protocol" / "_hop_marks.py").write_text(MARK_MODULE)
    for rel, old, new in MARKS:
        path = dest / rel
        text = path.read_text()
        if text.count(old) != 1:
            print(f"warning: {rel}: a mark's place is not there (the code changed): {new.strip()[:60]}", file=sys.stderr)
            continue
        if IMPORT not in text:
            text = text.replace("from __future__ import annotations\n", "from __future__ import annotations\n" + IMPORT, 1)
        path.write_text(text.replace(old, new))


def read_marks(trace: Path) -> tuple[list[str], dict]:
    """(the counted sessions in launch order, {session id: {mark: (time, pid, process CPU)}})."""
    rows = []
    for line in trace.read_text().splitlines():
        when, pid, what, sid, cpu = line.split(" ")
        rows.append((float(when), what, sid, pid, float(cpu)))
    rows.sort()
    windows: dict[str, dict] = {}
    for when, what, sid, _, _ in rows:
        if what == "bench_post_sent":
            windows[sid] = {"post": when, "end": float("inf")}
        elif what == "bench_terminated" and sid in windows:
            windows[sid]["end"] = when
    order = sorted(windows, key=lambda s: windows[s]["post"])[2:]
    marks: dict[str, dict] = defaultdict(dict)
    for when, what, sid, pid, cpu in rows:
        if sid and "," not in sid:
            if sid in windows:
                marks[sid].setdefault(what, (when, pid, cpu))
            continue
        for s in order:  # a mark without a session: the window that holds it
            if windows[s]["post"] <= when <= windows[s]["end"]:
                n = 1 + sum(1 for m in marks[s] if m.startswith(what + "#"))
                marks[s][f"{what}#{n}"] = (when, pid, cpu)
                break
    return order, marks


def figures(order: list[str], marks: dict) -> list[str]:
    since: dict[str, list[float]] = defaultdict(list)
    cpu: dict[str, list[float]] = defaultdict(list)
    terminate = set()
    for s in order:
        seen = marks[s]
        post, running = seen["bench_post_sent"][0], seen["bench_running"][0]
        last_cpu: dict[str, float] = {}
        for what, (when, pid, used) in sorted(seen.items(), key=lambda kv: kv[1][0]):
            if pid in last_cpu:
                cpu[what].append((used - last_cpu[pid]) * 1000)
            last_cpu[pid] = used
            # a numbered mark (no session of its own) after RUNNING was seen: the release's pass
            late = what.startswith(TERMINATE) or "TERMINATED" in what or ("#" in what and when > running)
            since[what].append((when - (running if late else post)) * 1000)
            if late:
                terminate.add(what)
    lines = []
    for title, part in (("launch: ms since the POST was sent", False), ("terminate: ms since RUNNING was seen", True)):
        lines.append(title)
        chosen = [w for w in since if (w in terminate) == part]
        for what in sorted(chosen, key=lambda w: statistics.median(since[w])):
            spent = f"   cpu {statistics.median(cpu[what]):6.1f}" if cpu.get(what) else ""
            lines.append(f"  {what:<28} p50 {statistics.median(since[what]):8.1f}  n={len(since[what]):<3}{spent}")
    lines.append("hops: per session, ms between two marks (p50, min, max)")
    for a, b in HOPS:
        d = [(marks[s][b][0] - marks[s][a][0]) * 1000 for s in order if a in marks[s] and b in marks[s]]
        if d:
            lines.append(f"  {a:>26} -> {b:<26} {statistics.median(d):7.1f} {min(d):7.1f} {max(d):7.1f}  n={len(d)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rev", default="HEAD", help="what to measure: a revision of this checkout (git archive)")
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--keep", metavar="DIR", help="keep the tree, its trace and its processes' logs in DIR")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fgpu-hops-") as tmp:
        work = Path(args.keep or tmp)
        tree, trace = work / "tree", work / "trace.txt"
        tree.mkdir(parents=True)
        tree_with_marks(args.rev, tree)
        env = {**os.environ, "PYTHONPATH": str(tree), "FGPU_TRACE": str(trace)}
        command = [
            sys.executable,
            "benchmarks/launch.py",
            "--sessions",
            str(args.sessions),
            "--modes",
            "distributed",
            "--out",
            str(work / "launch.txt"),
            "--keep",
            str(work / "logs"),
        ]
        subprocess.run(command, cwd=tree, env=env, check=True)
        load = os.getloadavg()
        print(f"# benchmarks/launch_hops.py --rev {args.rev} --sessions {args.sessions}  (load {load[0]:.1f} {load[1]:.1f})")
        print("\n".join(figures(*read_marks(trace))))


if __name__ == "__main__":
    main()
