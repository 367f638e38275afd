"""A process-runtime session's processes tracked by its own cgroup v2 (issue 14, item 3): the
leader joins `<root>/fgpu-agent-<node>-<instance>/session-<id>` before it execs, so a daemon that
double-forks, calls setsid and clears its environment (invisible to the /proc scan) still ends
with its session, before the slice is reported free; the cgroup is removed afterwards, and what
a killed agent's sessions left is killed and removed when the agent starts again, by that agent
only: another console's agent on the host, whose node has the same name, has a parent of its own
(issue 31, item 8). Where the agent cannot create cgroups, the /proc scan does the work and the
agent says why.

Real processes, real cgroups on this machine (CI runs as root on a machine with a writable
cgroup2 hierarchy: a test here fails, never skips, where there is none)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agent import runtimes
from agent.runtimes import CGROUP_AUTO, SessionCgroup, cgroup2_mounts, cgroup2_root
from tests.conftest import ROOT, wait_until_async
from tests.stack import wait_until
from tests.test_agent_runtime import Harness, RecordingManager, host_pid, pid_alive, run_agent, start_spec


def daemon_command(pid_file: Path, *, then: str = "exec sleep 300") -> str:
    """A session program (its shell's `-c`) that starts a daemon the way daemons get away: a
    double fork (the subshell exits, the daemon is reparented), setsid, and a clean environment
    (`env -i`: no FGPU_SESSION_ID, no FGPU_ALLOCATION); the daemon writes its pid (as the session
    sees it: `host_pid` gives the node's) to `pid_file`, which lies in the session's home (the
    only folder of the node a sandboxed session writes), and the program goes on with `then`."""
    return textwrap.dedent(f"""\
        ( setsid env -i /bin/sh -c 'echo $$ > {pid_file}.tmp; mv {pid_file}.tmp {pid_file}; exec sleep 300' & )
        {then}
        """)


def session_home(h: Harness, spec: dict) -> Path:
    """The session's working directory (its home), as the agent makes it: a sandboxed session
    sees it at the same path."""
    return h.agent.scratch_root / spec["session_id"]


async def daemon_pid(pid_file: Path) -> int:
    await wait_until_async(lambda: pid_file.exists(), timeout=20, interval=0.02, what="the daemon's pid")
    return int(pid_file.read_text())


def environ(pid: int) -> bytes:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return f.read()


def cgroup_of(pid: int) -> str:
    """`pid`'s cgroup v2 path (the "0::" line of /proc/<pid>/cgroup)."""
    with open(f"/proc/{pid}/cgroup") as f:
        return next(line[3:] for line in f.read().splitlines() if line.startswith("0::"))


class AliveAtReport(RecordingManager):
    """Also notes, when each TERMINATED report is made, whether the watched pids were alive."""

    watched: list[int] = []

    def report(self, session_id, status, reason, exit_code):
        if status == "TERMINATED":
            self.alive_at_end = [pid for pid in self.watched if pid_alive(pid)]
        super().report(session_id, status, reason, exit_code)


def test_this_machine_has_a_cgroup2_hierarchy_the_agent_can_use():
    root, why = cgroup2_root(CGROUP_AUTO)
    assert root is not None, why
    assert root in cgroup2_mounts()


def test_a_daemon_that_double_forks_calls_setsid_and_clears_its_environment_ends_with_its_session(tmp_path):
    seen = {}

    async def scenario(h: Harness):
        spec = start_spec()
        pid_file = session_home(h, spec) / "daemon.pid"
        spec["command"] = daemon_command(pid_file)
        session_id = await h.start_session(spec)
        running = h.agent.sessions[session_id]
        cgroup = running.process.cgroup
        assert cgroup is not None and cgroup.path.parent == h.agent.runtime.cgroups.parent
        assert cgroup.path.name == f"session-{session_id}"
        daemon = host_pid(running.process, await daemon_pid(pid_file))
        seen["daemon"] = daemon
        # It got away from everything the /proc scan looks at ...
        assert os.getsid(daemon) != running.process.pid
        assert b"FGPU_SESSION_ID" not in environ(daemon)
        assert daemon not in runtimes.session_processes(session_id, running.process.pid, live_only=True)
        # ... but not from its session's cgroup.
        assert cgroup_of(daemon) == cgroup_of(running.process.pid)
        assert daemon in cgroup.pids() and running.process.pid in cgroup.pids()
        h.manager.watched = [daemon]

        await asyncio.to_thread(h.agent.submit_stop, session_id)
        await h.manager.wait_for_report(session_id, "TERMINATED")

        assert h.manager.alive_at_end == [], "the slice was reported free while the daemon still ran"
        assert not pid_alive(daemon)
        # Removed beside the report (agent.lifecycle: none of its processes is left by then).
        await wait_until_async(lambda: not cgroup.path.exists(), timeout=10, interval=0.02, what="the session's cgroup removed")
        seen["parent"] = h.agent.runtime.cgroups.parent

    try:
        run_agent(tmp_path, scenario, cgroup_root=CGROUP_AUTO, manager_class=AliveAtReport)
    finally:
        if "daemon" in seen and pid_alive(seen["daemon"]):
            os.kill(seen["daemon"], signal.SIGKILL)
    assert not seen["parent"].exists(), "the agent's parent cgroup outlived its shutdown"


def test_a_session_whose_program_exits_leaving_a_daemon_ends_only_once_the_daemon_is_gone(tmp_path):
    """The leader exits by itself: the agent kills the rest through the cgroup and reports
    TERMINATED (the leader's exit code) once the cgroup says none is left."""

    async def scenario(h: Harness):
        spec = start_spec()
        pid_file, go = session_home(h, spec) / "daemon.pid", session_home(h, spec) / "go"
        # It exits once the test has the daemon's pid (the test's `go`), leaving the daemon.
        spec["command"] = daemon_command(pid_file, then=f"while [ ! -e {go} ]; do sleep 0.01; done; exit 3")
        h.manager.watched = []
        channel = await h.watch_terminal(spec["session_id"])
        await h.start_session(spec)
        daemon = host_pid(h.agent.sessions[spec["session_id"]].process, await daemon_pid(pid_file))
        h.manager.watched.append(daemon)
        go.touch()
        await h.receive_type(channel, "terminal.exit")
        _, reason, code = await h.manager.wait_for_report(spec["session_id"], "TERMINATED")
        assert code == 3, reason
        assert h.manager.alive_at_end == []
        cgroup = h.agent.runtime.cgroups.parent / f"session-{spec['session_id']}"
        await wait_until_async(lambda: not cgroup.exists(), timeout=10, interval=0.02, what="the session's cgroup removed")

    run_agent(tmp_path, scenario, cgroup_root=CGROUP_AUTO, manager_class=AliveAtReport)


# A runtime in a process of its own, killed with SIGKILL once its session's daemon runs: what a
# crashed agent leaves on the node. argv: node, scratch root, the session's program (its shell's
# -c, writing the daemon's pid into its home), [container] sandbox. It prints the leader's pid,
# the session's cgroup and the node's pids of all the cgroup holds (a sandbox's pids are its own).
# Its session is not held (hold=False: the PTY is the agent's, as before holders); a held one
# outlives its agent and is adopted (tests/test_held_sessions.py).
KILLED_AGENT = """
import json, os, signal, subprocess, sys
from pathlib import Path
from agent.runtimes import ProcessRuntime
from protocol.messages import StartSpec
node, scratch, command, sandbox = sys.argv[1:5]
runtime = ProcessRuntime(node=node, sandbox=sandbox, hold=False)
runtime.clean_up_at_start(Path(scratch))
assert runtime.cgroups is not None, "no cgroups"
work = Path(scratch) / "s-orphan"
work.mkdir(parents=True)
spec = StartSpec(session_id="s-orphan", name="orphan", owner="alice", command=command, cpu=1, mem=0, devices=())
handle = runtime.spawn(spec=spec, argv=["/bin/sh", "-c", command], env=dict(os.environ), work_dir=work)
while not (work / "daemon.pid").exists():
    pass
print(json.dumps({"leader": handle.pid, "cgroup": str(handle.cgroup.path), "pids": handle.cgroup.pids()}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("sandbox", ["none", "auto"], ids=["unconfined", "sandboxed"])
def test_an_agent_that_starts_again_kills_and_removes_the_cgroups_a_killed_run_left(tmp_path, caplog, sandbox):
    """Unconfined (sandbox "none"), the killed agent's session's daemon runs on in its cgroup
    until the next start kills it; in a sandbox, bwrap (--die-with-parent) ends the whole
    sandbox with its agent, and the next start removes the cgroup it left."""
    import json

    node = f"test-node-orphans-{os.getpid()}"
    scratch = tmp_path / "scratch"
    pid_file = scratch / "s-orphan" / "daemon.pid"
    killed = subprocess.run([sys.executable, "-c", KILLED_AGENT, node, str(scratch), daemon_command(pid_file), sandbox],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left = json.loads(killed.stdout)
    cgroup = Path(left["cgroup"])
    try:
        if sandbox == "none":
            # The leader ended with the PTY its agent held; the daemon runs on, in the cgroup.
            daemon = int(pid_file.read_text())
            assert pid_alive(daemon), "the killed agent's session's daemon should still run"
            assert daemon in SessionCgroup(cgroup).pids()
        else:
            wait_until(lambda: not any(pid_alive(pid) for pid in left["pids"]), timeout=20,
                       what="the sandbox's processes to end with its agent")
            assert cgroup.exists()

        async def scenario(h: Harness):
            assert not any(pid_alive(pid) for pid in [*left["pids"], left["leader"]])
            assert not cgroup.exists()
            assert cgroup.parent.exists()  # the new run's own parent

        with caplog.at_level(logging.WARNING, logger="agent.core"):
            run_agent(tmp_path, scenario, node=node, cgroup_root=CGROUP_AUTO)
        if sandbox == "none":
            assert any("removed 1 process(es)" in r.getMessage() for r in caplog.records), caplog.text
        assert not cgroup.parent.exists()
    finally:
        for pid in [*left["pids"], left["leader"]]:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        SessionCgroup(cgroup).remove()
        runtimes.SessionCgroups(cgroup.parent).close()


def test_an_exec_beside_the_session_runs_in_its_cgroup_and_ends_with_it(tmp_path):
    async def scenario(h: Harness):
        session_id = await h.start_session(start_spec(command="sleep 300"))
        running = h.agent.sessions[session_id]
        before = len(running.process.cgroup.pids())  # sandboxed: bwrap, its init and the shell
        process = running.process.exec_popen(["/bin/sh", "-c", "setsid sleep 300 & exec sleep 300"],
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # The exec and its daemon; in a sandbox also nsenter, which forks into its PID namespace.
        started = 3 if running.process.sandbox is not None else 2
        try:
            await wait_until_async(lambda: len(running.process.cgroup.pids()) == before + started, timeout=20, interval=0.02,
                                   what="the exec and its daemon in the session's cgroup")
            members = running.process.cgroup.pids()
            await asyncio.to_thread(h.agent.submit_stop, session_id)
            await h.manager.wait_for_report(session_id, "TERMINATED")
            assert not [pid for pid in members if pid_alive(pid)]
        finally:
            process.kill()
            process.wait()

    run_agent(tmp_path, scenario, cgroup_root=CGROUP_AUTO)


def start_ticks(pid: int) -> str | None:
    """When process `pid` started (/proc/<pid>/stat's field 22), None once it is gone (reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except FileNotFoundError:
        return None


@pytest.mark.parametrize("end", ["exits", "stopped-beside-an-exec"])
def test_a_sandboxed_session_leaves_no_zombie_once_it_ended(tmp_path, end):
    """bwrap exits before its sandbox's init, and an exec's nsenter may end before its child: the
    agent, their subreaper, reaps both, so neither is left a zombie (of a pid 1 that reaps
    nothing, as on the CI machine) nor holds the sandbox's init alive. Both ways a session ends:
    its command exits by itself, or it is stopped while an exec runs beside it."""

    async def scenario(h: Harness):
        command = "exit 3" if end == "exits" else "sleep 300"
        spec = start_spec(command=f"while [ ! -e go ]; do sleep 0.01; done; {command}")
        session_id = await h.start_session(spec)
        running = h.agent.sessions[session_id].process
        assert running.sandbox is not None, h.agent.runtime.unconfined_why
        init = (running.init_pid, start_ticks(running.init_pid))
        exec_process = None
        if end == "exits":
            (session_home(h, spec) / "go").touch()
        else:
            (session_home(h, spec) / "go").touch()
            exec_process = running.exec_popen(["/bin/sh", "-c", "trap '' HUP TERM; sleep 300"],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            await wait_until_async(lambda: len([p for p in running.cgroup.pids() if running._inside(p)]) >= 3,
                                   timeout=20, interval=0.02, what="the exec inside the sandbox")
            await asyncio.to_thread(h.agent.submit_stop, session_id)
        await h.manager.wait_for_report(session_id, "TERMINATED")
        if exec_process is not None:
            exec_process.wait(timeout=20)  # nsenter, the test's own child
        # Reaped as what the session left is removed, beside the report (agent.lifecycle.SessionLifecycle.wait_exit).
        await wait_until_async(lambda: start_ticks(init[0]) != init[1], timeout=10, interval=0.02, what="its init reaped")

    run_agent(tmp_path, scenario, cgroup_root=CGROUP_AUTO)


@pytest.mark.parametrize(("where", "why"), [("tmp", "is not in a cgroup v2 hierarchy"), ("missing", "cannot create")],
                         ids=["not-cgroup2", "not-creatable"])
def test_where_the_agent_cannot_create_cgroups_it_says_why_and_the_proc_scan_ends_sessions(tmp_path, caplog, where, why):
    """agent.toml's cgroup-root names a directory that is not in a cgroup v2 hierarchy, or one
    that is but cannot be created: the agent logs why, once, and falls back to the scan, which
    still ends a daemon that kept its environment."""
    root, reason = cgroup2_root(CGROUP_AUTO)
    assert root is not None, reason
    setting = str(tmp_path) if where == "tmp" else str(root / "no-such-parent" / "x")

    async def scenario(h: Harness):
        assert h.agent.runtime.cgroups is None
        spec = start_spec()
        pid_file = session_home(h, spec) / "daemon.pid"
        spec["command"] = f"setsid sh -c 'echo $$ > {pid_file}; exec sleep 300' & sleep 300"
        session_id = await h.start_session(spec)
        assert h.agent.sessions[session_id].process.cgroup is None
        daemon = host_pid(h.agent.sessions[session_id].process, await daemon_pid(pid_file))
        await h.agent._stop(session_id, reason="terminated")
        await h.manager.wait_for_report(session_id, "TERMINATED")
        return daemon

    with caplog.at_level(logging.WARNING, logger="agent.runtimes"):
        daemon = run_agent(tmp_path, scenario, cgroup_root=setting)
    assert not pid_alive(daemon)
    messages = [r.getMessage() for r in caplog.records if "scanning /proc" in r.getMessage()]
    assert len(messages) == 1 and why in messages[0], caplog.text


def test_cgroup2_mounts_are_read_from_mountinfo(tmp_path):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "30 25 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n"
        "31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw\n"
        "32 30 0:28 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n")
    assert cgroup2_mounts(mountinfo=str(mountinfo)) == [Path("/sys/fs/cgroup/unified")]
    assert cgroup2_root(CGROUP_AUTO, mountinfo=str(mountinfo)) == (Path("/sys/fs/cgroup/unified"), "")
    assert cgroup2_root("/sys/fs/cgroup/unified/agents", mountinfo=str(mountinfo)) == (
        Path("/sys/fs/cgroup/unified/agents"), "")
    assert cgroup2_root("/sys/fs/cgroup/memory", mountinfo=str(mountinfo))[0] is None
    assert cgroup2_root("none", mountinfo=str(mountinfo))[0] is None
    (tmp_path / "v1only").write_text("32 30 0:28 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")
    assert cgroup2_root(CGROUP_AUTO, mountinfo=str(tmp_path / "v1only")) == (
        None, "no cgroup v2 hierarchy is mounted (cgroup v1 only)")
    unified = "29 1 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n31 29 0:30 / /mnt/x rw - cgroup2 cgroup2 rw\n"
    (tmp_path / "unified").write_text(unified)
    assert cgroup2_root(CGROUP_AUTO, mountinfo=str(tmp_path / "unified"))[0] == Path("/sys/fs/cgroup")


# --- the session leader's start (runtimes.popen_leader) -----------------------------------------


def leader_state(pid: int) -> dict:
    """What popen_leader promises of a leader, read from /proc: its process session and
    controlling terminal (stat fields 6 and 7), its cgroup, and which of SIGINT, SIGQUIT and SIGHUP
    it ignores."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    with open(f"/proc/{pid}/status") as f:
        ignored = int(next(line.split()[1] for line in f if line.startswith("SigIgn:")), 16)
    return {
        "session": int(fields[3]),
        "tty_nr": int(fields[4]),
        "cgroup": cgroup_of(pid),
        "ignores": [sig.name for sig in runtimes._RESET_SIGNALS if ignored & (1 << (sig - 1))],
    }


@pytest.fixture
def session_cgroup():
    root, why = cgroup2_root(CGROUP_AUTO)
    assert root is not None, why
    cgroups = runtimes.SessionCgroups(root / f"fgpu-test-leader-{os.getpid()}")
    cgroup = cgroups.create("leader")
    yield cgroup
    cgroup.remove()
    cgroups.close()


@contextlib.contextmanager
def dispositions(ignored: tuple[signal.Signals, ...] = ()):
    """SIGINT, SIGQUIT and SIGHUP caught (SIGINT by Python's own handler) or at their default,
    except those `ignored`; as they were afterwards (something earlier in the suite may leave
    SIGINT ignored)."""
    caught = {signal.SIGINT: signal.default_int_handler, signal.SIGQUIT: signal.SIG_DFL, signal.SIGHUP: signal.SIG_DFL}
    before = {sig: signal.signal(sig, signal.SIG_IGN if sig in ignored else handler) for sig, handler in caught.items()}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def start_leader(cgroup: SessionCgroup) -> tuple[subprocess.Popen, int, str]:
    """`sleep 300` as a session's leader on a new PTY (as the runtime's spawn starts one), the
    PTY's master and its terminal's path; the caller kills it."""
    import pty

    master, slave = pty.openpty()
    tty = os.ttyname(slave)
    try:
        process = runtimes.popen_leader(
            ["sleep", "300"], cgroup=cgroup, tty=tty, stdin=slave, stdout=slave, stderr=slave, cwd="/",
            env={"PATH": os.environ["PATH"]},
        )  # fmt: skip
    finally:
        os.close(slave)
    return process, master, tty


@pytest.mark.parametrize("ignored", [(), (signal.SIGHUP,)], ids=["signals-caught", "started-ignoring-sighup"])
def test_a_leader_has_its_session_terminal_cgroup_and_default_signals_with_or_without_a_preexec_fn(
        session_cgroup, monkeypatch, ignored):
    """Where the agent ignores none of SIGINT, SIGQUIT and SIGHUP the leader is readied by
    LEADER_SCRIPT (no preexec_fn: no fork of the agent); where it ignores one, by a preexec_fn.
    Either way the leader leads its own process session, has its PTY as controlling terminal, is
    in its cgroup before it runs its command and ignores none of them."""
    popens = []
    real_popen = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **kw: popens.append(kw) or real_popen(*a, **kw))
    with dispositions(ignored):
        process, master, tty = start_leader(session_cgroup)
    try:
        assert (popens[0]["preexec_fn"] is not None) == bool(ignored)
        state = {}

        def exec_done():  # the script's shell has become `sleep` (read first: the state is then the command's)
            with open(f"/proc/{process.pid}/comm") as f:
                if f.read().strip() != "sleep":
                    return False
            state.update(leader_state(process.pid))
            return True

        wait_until(exec_done, timeout=10, interval=0.01, what="the leader's exec")
        assert state["session"] == process.pid
        assert state["tty_nr"] == os.stat(tty).st_rdev
        assert state["cgroup"] == "/" + str(session_cgroup.path.relative_to(cgroup2_root(CGROUP_AUTO)[0]))
        assert state["ignores"] == []
        assert session_cgroup.pids() == [process.pid]
    finally:
        process.kill()
        process.wait()
        os.close(master)


def test_an_agent_started_ignoring_sighup_catches_it_instead_so_its_leaders_need_no_preexec_fn():
    """`manage.py agent` and `standalone` call stop_ignoring_session_signals first: a signal the
    process was started ignoring (nohup) is caught by a handler that does nothing, which a leader
    does not inherit."""
    with dispositions(ignored=(signal.SIGHUP,)):
        assert runtimes._ignored(runtimes._RESET_SIGNALS)
        runtimes.stop_ignoring_session_signals()
        assert signal.getsignal(signal.SIGHUP) is runtimes._still_ignored
        assert not runtimes._ignored(runtimes._RESET_SIGNALS)
        signal.raise_signal(signal.SIGHUP)  # caught (its handler runs before the next line), and nothing happens
        assert signal.getsignal(signal.SIGHUP) is runtimes._still_ignored


def test_a_leader_that_cannot_join_its_cgroup_never_runs_its_command(tmp_path):
    """LEADER_SCRIPT ends with 126 and the shell's reason where cgroup.procs cannot be written
    (the cgroup removed meanwhile): the command does not run outside it."""
    marker = tmp_path / "ran"
    with dispositions():
        process = runtimes.popen_leader(
            ["/bin/sh", "-c", f"touch {marker}"], cgroup=SessionCgroup(tmp_path / "gone"), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/", env={"PATH": os.environ["PATH"]},
        )  # fmt: skip
    out, err = process.communicate(timeout=10)
    assert process.returncode == 126, (out, err)
    assert b"cgroup.procs" in err
    assert not marker.exists()


def test_a_cgroup_whose_processes_were_just_killed_is_removed_once_they_have_exited(session_cgroup):
    """What standalone's exit does (kill_all_now: cgroup.kill, then release_now): a killed
    process leaves cgroup.procs once its main thread has exited, while its other threads are
    still exiting (freeing 1.5 GiB); the cgroup stays populated and the kernel refuses the
    rmdir (EBUSY) until they have. `remove` waits for that instead of leaving the cgroup behind
    (a JupyterLab session's was left, at 1 exit of standalone in 3; this test failed 5 of 5
    before)."""
    holder = (
        "import threading, time; held = [bytearray(1 << 27) for _ in range(8)]\n"
        "for _ in range(8): threading.Thread(target=lambda: [bytearray(1 << 26), time.sleep(1000)]).start()\n"
        "time.sleep(0.2); print('held', flush=True); time.sleep(1000)"
    )
    with dispositions():
        process = runtimes.popen_leader(
            [sys.executable, "-c", holder], cgroup=session_cgroup, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, cwd="/", env={"PATH": os.environ["PATH"]},
        )  # fmt: skip
    try:
        assert process.stdout.readline() == b"held\n"
        (session_cgroup.path / "cgroup.kill").write_bytes(b"1")
        wait_until(lambda: not session_cgroup.pids(), timeout=10, interval=0.0005, what="cgroup.procs to be empty")

        assert session_cgroup.remove()
        assert not session_cgroup.path.exists()
    finally:
        process.kill()
        process.wait()


def test_a_session_counts_its_leader_from_its_spawn_before_the_leader_joined_its_cgroup(session_cgroup):
    """LEADER_SCRIPT joins the cgroup a moment after the spawn; meanwhile the session's pids are
    its leader's (else a usage sample then reads an empty session: mem 0, a CI failure), and
    once it joined, the cgroup's."""
    for _ in range(10):
        process, master, _ = start_leader(session_cgroup)
        handle = runtimes.SessionHandle("s", process, master, env={}, work_dir=Path("/"), cgroup=session_cgroup)
        try:
            assert handle.pids() == [process.pid]  # before or after the join: the leader alone
            wait_until(lambda p=process: session_cgroup.pids() == [p.pid], timeout=10, what="the leader in its cgroup")
            assert handle.pids() == [process.pid]
        finally:
            process.kill()
            process.wait()
            os.close(master)
        wait_until(lambda: not session_cgroup.populated(), timeout=10, what="the cgroup empty")


# --- two consoles on one host (issue 31, item 8) -------------------------------------------------

# Another console's agent starting on the same host with the same node name, in a process of its
# own: its runtime's start-up clean-up (what killed every session of a console whose node bore the
# same name, when both agents' parents were `fgpu-agent-<node>`), then its shutdown.
OTHER_CONSOLE = """
import sys
from pathlib import Path
from agent.runtimes import ProcessRuntime
node, scratch = sys.argv[1:3]
runtime = ProcessRuntime(node=node)
handles, killed = runtime.clean_up_at_start(Path(scratch))
assert runtime.cgroups is not None, "no cgroups"
print(runtime.cgroups.parent, killed, flush=True)
runtime.close()
"""


def test_two_agents_with_one_node_name_and_their_own_data_dirs_leave_each_other_s_sessions_alone(tmp_path):
    node = f"demo-node-{os.getpid()}"

    async def scenario(h: Harness):
        session_id = await h.start_session(start_spec(command="sleep 300"))
        running = h.agent.sessions[session_id]
        pids = running.process.cgroup.pids()
        assert pids
        other = subprocess.run([sys.executable, "-c", OTHER_CONSOLE, node, str(tmp_path / "other-console" / "scratch")],
                               cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert other.returncode == 0, other.stderr
        other_parent, killed = other.stdout.split()
        assert Path(other_parent) != h.agent.runtime.cgroups.parent
        assert killed == "0"
        assert all(pid_alive(pid) for pid in pids), "the other console's start killed this console's session"
        assert running.process.cgroup.path.exists()
        assert session_id in h.agent.sessions and running.process.alive()

    run_agent(tmp_path, scenario, node=node, cgroup_root=CGROUP_AUTO)


def test_an_agent_s_parent_cgroup_names_its_node_instance_and_the_test_run_s_tag(tmp_path):
    from tests.conftest import CGROUP_TAG

    a = runtimes.parent_cgroup_name("demo-node", tmp_path / "a", tag="")
    b = runtimes.parent_cgroup_name("demo-node", tmp_path / "b", tag="")
    assert a.startswith("fgpu-agent-demo-node-") and b.startswith("fgpu-agent-demo-node-") and a != b
    assert a == runtimes.parent_cgroup_name("demo-node", tmp_path / "x" / ".." / "a", tag="")  # the resolved path
    assert runtimes.parent_cgroup_name("n", tmp_path, tag="run7").startswith("fgpu-agent-run7-n-")
    assert runtimes.ProcessRuntime(node="n").tag == CGROUP_TAG  # this run's (tests/conftest.py)
    for bad in ("a b", "x/y", "a-b", "é", "t" * 33):
        with pytest.raises(ValueError, match="FGPU_CGROUP_TAG"):
            runtimes.cgroup_tag({"FGPU_CGROUP_TAG": bad})
    assert runtimes.cgroup_tag({}) == ""
