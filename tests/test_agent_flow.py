"""The agent under load (issue 12): many sessions on one agent without a thread each, terminal
input and output through bounded buffers with backpressure, and every process of a session
ending with it, also after an agent restart. A real Agent with real PTY processes; the manager
is a recording stand-in (tests/test_agent_runtime.py)."""
from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import threading
import time

from agent.core import WORK_THREADS
from agent.lifecycle import sweep_scratch
from agent.manager_link import MANAGER_THREADS
from agent.terminal_pipe import FRAME_CHARS, FlowLimits
from agent import runtimes
from tests.conftest import wait_until_async
from protocol.messages import StartSpec
from tests.test_agent_runtime import Harness, host_pid, process_tracking, run_agent, start_spec  # noqa: F401 (both ways of tracking)

SESSIONS = 30  # the old agent stopped at its 7th session on a 2-core machine


def test_one_agent_runs_many_sessions_at_once_without_a_thread_each_and_keeps_its_heartbeat(tmp_path):
    async def scenario(h: Harness):
        specs = [start_spec() for _ in range(SESSIONS)]
        await asyncio.gather(*(asyncio.to_thread(h.agent.submit_start, StartSpec.decode(spec)) for spec in specs))
        for spec in specs:
            await h.manager.wait_for_report(spec["session_id"], "RUNNING")
        assert len(h.agent.sessions) == SESSIONS
        # Bounded pools, not one thread per session: the agent's threads do not follow the sessions.
        mine = [t.name for t in threading.enumerate() if t.name.startswith(f"agent-{h.agent.node}-")]
        assert len(mine) <= WORK_THREADS + MANAGER_THREADS + 1 < SESSIONS, mine
        beats = len(h.manager.heartbeats)
        await h.manager.wait_for(lambda: len(h.manager.heartbeats) >= beats + 3, what="heartbeats while they run")
        state = h.manager.states[-1]
        assert state is not None and state.statuses == {spec["session_id"]: "RUNNING" for spec in specs}
        await asyncio.gather(*(h.agent._stop(spec["session_id"], reason="terminated") for spec in specs))
        for spec in specs:
            await h.manager.wait_for_report(spec["session_id"], "TERMINATED")
        assert h.agent.sessions == {}
        ended = h.agent.state().ended
        assert {e.session_id: e.status for e in ended} == {spec["session_id"]: "TERMINATED" for spec in specs}

    run_agent(tmp_path, scenario, heartbeat_s=0.2)


def test_a_paste_into_a_program_that_does_not_read_neither_spins_the_agent_nor_stops_its_heartbeat(tmp_path):
    paste = 64 * 1024  # the terminal consumer's largest input frame

    async def scenario(h: Harness):
        # Raw mode: every byte typed reaches the program; it reads nothing for 2 s, then all of it.
        spec = start_spec(command=f"stty raw -echo; echo ready; sleep 2; head -c {paste} | wc -c")
        channel = await h.watch_terminal(spec["session_id"])
        session_id = await h.start_session(spec)
        await h.read_until(channel, "ready")  # stty has run; the program is in its sleep
        cpu_before, beats = time.process_time(), len(h.manager.heartbeats)
        await h.type(session_id, "x" * paste)
        await h.manager.wait_for(lambda: len(h.manager.heartbeats) >= beats + 10, what="heartbeats meanwhile")
        output = await h.read_until(channel, str(paste))  # every byte reached the program
        assert time.process_time() - cpu_before < 1.5, "the agent spun while the PTY was full"
        return output

    run_agent(tmp_path, scenario, heartbeat_s=0.05)


def test_input_past_the_buffer_is_refused_and_the_terminal_says_so(tmp_path):

    async def scenario(h: Harness):
        # Raw mode: a canonical-mode tty discards what passes its 4 KiB line buffer by itself, so
        # the writes would never block; raw, the kernel holds what the program does not read
        # (n_tty and pty buffers, ~68 KiB) and then refuses more, which fills the agent's buffer.
        spec = start_spec(command="stty raw -echo; echo ready; sleep 30")  # never reads its terminal
        channel = await h.watch_terminal(spec["session_id"])
        session_id = await h.start_session(spec)
        await h.read_until(channel, "ready")
        for _ in range(40):
            await h.type(session_id, "y" * 4096)
        output = await h.read_until(channel, "input dropped")
        assert "bytes of input dropped: the program has not read the last" in output
        assert len(h.agent.sessions[session_id].pipe.inbox) <= 8 * 1024

    run_agent(tmp_path, scenario, flow=FlowLimits(input_buffer_bytes=8 * 1024))


def test_a_slow_terminal_reader_gets_every_byte_in_order_in_standalone_mode(tmp_path):
    """Standalone's layer waits for a slow consumer (common.layers); the agent stops reading
    the PTY meanwhile, so nothing is dropped however fast the program writes."""
    from common.layers import FlowControlledInMemoryChannelLayer

    lines = 200_000
    expected = "".join(f"{i}\r\n" for i in range(1, lines + 1))  # the PTY turns \n into \r\n

    async def scenario(h: Harness):
        spec = start_spec(command=f"sleep 0.5; seq 1 {lines}")
        channel = await h.watch_terminal(spec["session_id"])
        await h.start_session(spec)
        received, frames = [], 0
        async with asyncio.timeout(120):
            while True:
                message = await h.layer.receive(channel)
                if message["type"] == "terminal.exit":
                    break
                received.append(message["data"])
                frames += 1
                if frames % 4 == 0:
                    await asyncio.sleep(0.01)  # noqa: TID251 (the behaviour under test: a reader slower than the program)
        text = "".join(received)
        assert hashlib.sha256(text.encode()).hexdigest() == hashlib.sha256(expected.encode()).hexdigest(), (
            f"{len(text)} characters arrived of {len(expected)}")
        assert max(len(part) for part in received) <= FRAME_CHARS

    run_agent(tmp_path, scenario, layer_class=FlowControlledInMemoryChannelLayer)


def test_streaming_output_goes_in_frames_of_many_pty_reads_in_standalone_mode(tmp_path):
    """Standalone's group send takes no time (common.layers), so the output pump coalesces by
    STREAM_CHARS/STREAM_GAP_S as for direct streams: a PTY read is at most 4 KiB, and a frame per
    read would cost every hop (uvicorn, the browser) several times the work per byte."""
    from common.layers import FlowControlledInMemoryChannelLayer

    size = 600_000  # base64 makes ~810 kB: within the output cap's burst (a reader that attached has none)

    async def scenario(h: Harness):
        spec = start_spec(command=f"sleep 0.5; head -c {size} /dev/zero | base64; echo END-$((6*7))")
        channel = await h.watch_terminal(spec["session_id"])
        await h.start_session(spec)
        frames = []
        async with asyncio.timeout(60):
            while not frames or "END-42" not in frames[-1]:
                message = await h.layer.receive(channel)
                assert message["type"] == "terminal.output", message
                frames.append(message["data"])
        return frames

    frames = run_agent(tmp_path, scenario, layer_class=FlowControlledInMemoryChannelLayer)
    streamed = sum(len(frame) for frame in frames)
    assert streamed > size, "the output did not arrive"
    assert streamed / len(frames) > 3 * 4096, f"{len(frames)} frames for {streamed} characters"


def test_a_daemon_that_escaped_with_setsid_ends_with_its_session(tmp_path):
    async def scenario(h: Harness):
        spec = start_spec()
        pid_file = h.agent.scratch_root / spec["session_id"] / "daemon.pid"  # in its home: a sandbox shows it no other
        spec["command"] = f"setsid sh -c 'echo $$ > {pid_file}; exec sleep 300' & sleep 30"
        session_id = await h.start_session(spec)
        await wait_until_async(lambda: pid_file.exists() and pid_file.read_text().strip(), timeout=20, interval=0.05,
                               what="the daemon's pid")
        daemon = host_pid(h.agent.sessions[session_id].process, int(pid_file.read_text()))  # the sandbox's own pid
        assert os.getsid(daemon) != h.agent.sessions[session_id].process.pid  # it left the session
        await h.agent._stop(session_id, reason="terminated")
        await h.manager.wait_for_report(session_id, "TERMINATED")
        return daemon

    daemon = run_agent(tmp_path, scenario)
    assert not _alive(daemon), "the setsid daemon outlived its session"


def test_an_agent_that_starts_again_kills_what_its_sessions_left_and_spares_other_agents(tmp_path):
    mine, theirs = tmp_path / "scratch", tmp_path / "other-agent"
    env = {**os.environ, "FGPU_SESSION_ID": "x"}
    left = subprocess.Popen(["sleep", "300"], env={**env, "FGPU_ALLOCATION": f"{mine}/abc/.fgpu/allocation.json"},
                            start_new_session=True)
    other = subprocess.Popen(["sleep", "300"], env={**env, "FGPU_ALLOCATION": f"{theirs}/abc/.fgpu/allocation.json"},
                             start_new_session=True)
    try:
        assert runtimes.kill_orphans(mine) == 1
        assert left.wait(timeout=10) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for process in (left, other):
            process.kill()
            process.wait()


def test_the_scratch_sweep_removes_only_old_directories_of_sessions_not_running(tmp_path):
    root = tmp_path / "scratch"
    for name in ("old-ended", "old-running", "new-ended"):
        (root / name / ".fgpu").mkdir(parents=True)
    hour_ago = time.time() - 3600
    for name in ("old-ended", "old-running"):
        os.utime(root / name, (hour_ago, hour_ago))
    assert sweep_scratch(root, keep={"old-running"}, older_than_s=600) == 1
    assert sorted(p.name for p in root.iterdir()) == ["new-ended", "old-running"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

