"""Sessions outlive their agent in the process runtime (issue 33, item 7): a first agent (a child
process of the test, run as `python -c FIRST_AGENT`) starts a sandboxed session held by its holder
(agent.holder) and is killed with SIGKILL; the session writes on while no agent runs; a new agent
on the same node and scratch root adopts it: the same leader pid, running, named in its
registration, and its terminal shows what was written before and during the agent's absence."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from agent.runtimes import HOLDERS_DIR, ProcessRuntime
from tests.stack import wait_until, wait_until_async
from tests.test_agent_runtime import Harness, run_agent

# The first agent: its runtime spawns one held session whose command says "before", waits for a
# file the test makes once this agent is dead, then says "during" and sleeps. It prints the
# session's record as JSON once "before" came through the holder, then waits to be killed.
FIRST_AGENT = """
import json, os, select, sys, time, uuid
from pathlib import Path
from agent.runtimes import ProcessRuntime
node, scratch = sys.argv[1], Path(sys.argv[2])
runtime = ProcessRuntime(node=node, hold=True)
runtime.clean_up_at_start(scratch)
session_id = str(uuid.uuid4())
work_dir = scratch / session_id
work_dir.mkdir(parents=True)
command = 'echo before-$((40 + 2)); while [ ! -e go ]; do sleep 0.05; done; echo during-$((40 + 2)); exec sleep 600'
env = {"PATH": "/usr/bin:/bin", "FGPU_SESSION_ID": session_id, "FGPU_ALLOCATION": str(work_dir / "allocation.json")}
handle = runtime.spawn(spec={"session_id": session_id, "owner_is_staff": False}, argv=["/bin/sh", "-c", command],
                       env=env, work_dir=work_dir)
seen, deadline = b"", time.monotonic() + 20
while b"before-42" not in seen and time.monotonic() < deadline:
    select.select([handle.fd], [], [], 1)
    try:
        seen += handle.read(4096)
    except BlockingIOError:
        pass
print(json.dumps({"session_id": session_id, "pid": handle.pid, "command_pid": handle.command_pid,
                  "seen": seen.decode(errors="replace")}), flush=True)
time.sleep(3600)
"""


def start_first_agent(node: str, scratch: Path) -> tuple[subprocess.Popen, dict]:
    first = subprocess.Popen(
        [sys.executable, "-c", FIRST_AGENT, node, str(scratch)], stdout=subprocess.PIPE, cwd=Path(__file__).parent.parent
    )
    assert first.stdout is not None
    line = first.stdout.readline()
    assert line, f"the first agent ended without starting its session (exit status {first.poll()})"
    return first, json.loads(line)


def test_a_held_session_keeps_its_pid_and_terminal_when_its_agent_is_killed_and_a_new_one_adopts_it(tmp_path):
    node = f"held-{uuid.uuid4().hex[:8]}"
    scratch = tmp_path / "scratch"
    first, started = start_first_agent(node, scratch)
    session_id, pid = started["session_id"], started["pid"]
    assert "before-42" in started["seen"]
    try:
        first.send_signal(signal.SIGKILL)
        first.wait()
        (scratch / session_id / "go").touch()  # the session writes while no agent runs
        command_pid = started["command_pid"]
        assert Path(f"/proc/{command_pid}").exists(), "the session ended with its agent"

        async def scenario(h: Harness):
            running = h.agent.sessions.get(session_id)
            assert running is not None, "the new agent did not adopt the session"
            assert running.process.pid == pid and running.process.command_pid == command_pid
            registered = await h.manager.wait_for(lambda: h.manager.registered, what="the registration")
            assert session_id in registered[0][2], "the registration does not name the adopted session"
            await wait_until_async(lambda: b"during-42" in running.scrollback, timeout=20, interval=0.02,
                                   what="the output written while no agent ran")
            assert b"before-42" in running.scrollback, "the scrollback before the restart was lost"
            await h.type(session_id, "")  # the terminal takes input again (nothing to see: it sleeps)

        run_agent(tmp_path, scenario, node=node, runtime_options={"hold": True})
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert not Path(f"/proc/{command_pid}").exists() or "Z" in Path(f"/proc/{command_pid}/stat").read_text().split()[2]
    assert not list((scratch / HOLDERS_DIR).glob("*.json")), "the ended session's holder left its record"


def test_a_held_session_that_ended_while_no_agent_ran_is_found_ended_with_its_exit_status(tmp_path):
    node = f"held-{uuid.uuid4().hex[:8]}"
    scratch = tmp_path / "scratch"
    first, started = start_first_agent(node, scratch)
    session_id = started["session_id"]
    try:
        first.send_signal(signal.SIGKILL)
        first.wait()
        runtime = ProcessRuntime(node=node, hold=True)
        # the session ends while no agent runs: its sleep is killed
        os.kill(started["command_pid"], signal.SIGKILL)
        wait_until(lambda: (scratch / HOLDERS_DIR / f"{session_id}.exit").exists(), timeout=20, what="the holder's exit record")
        adopted, _ = runtime.clean_up_at_start(scratch)
        assert [h.session_id for h in adopted] == [session_id]
        handle = adopted[0]
        assert handle.poll() is not None and handle.exit_fd() is None
        handle.kill_all()
        handle.close_stream()
        handle.remove()
        runtime.close()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
