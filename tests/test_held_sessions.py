"""Sessions outlive their agent in the process runtime (issue 33, item 7): a first agent (a real
Agent in a child process of the test, `python -c FIRST_AGENT`) starts a sandboxed session held by
its holder (agent.holder) and is killed with SIGKILL; the session writes on while no agent runs; a new agent
on the same node and scratch root adopts it: the same leader pid, running, named in its
registration, and its terminal shows what was written before and during the agent's absence."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from agent.runtimes import CGROUP_AUTO, CGROUP_NONE, HOLDERS_DIR, ProcessRuntime
from agent.sandbox import SandboxError
from tests.stack import wait_until, wait_until_async
from agent.mounts import Folders
from tests.test_agent_runtime import Harness, run_agent, start_spec, typed_spec

# The first agent: a real Agent (agent.core) in a process of its own, with a manager that records
# its reports and Channels' in-memory layer. It starts one session whose command says "before",
# waits for a file the test makes once this agent is dead, then says "during" and sleeps; it prints
# the session's pids as JSON once "before" is in the session's scrollback, then waits to be killed.
FIRST_AGENT = """
import asyncio, json, sys
from pathlib import Path
from channels.layers import InMemoryChannelLayer
from agent.core import Agent
from agent.runtimes import ProcessRuntime
from protocol.messages import StartSpec

class Manager:
    def __init__(self):
        self.reports = []
    def register(self, *args, **kwargs): pass
    def heartbeat(self, *args, **kwargs): pass
    def log(self, *args, **kwargs): pass
    def mig_report(self, *args, **kwargs): pass
    def report(self, session_id, status, reason, exit_code):
        self.reports.append(status)

async def main(node, scratch, spec, cgroup_root, network):
    manager = Manager()
    inventory = {"devices": [], "plugins": ["ai.backend.accelerator.mock"], "attributes": {}, "cpu_count": 8,
                 "memory_size": 2 ** 35}
    agent = Agent(node=node, inventory=inventory, channel_layer=InMemoryChannelLayer(), manager=manager,
                  scratch_root=scratch, mock=True, heartbeat_s=60,
                  runtime=ProcessRuntime(node=node, cgroup_root=cgroup_root, network=network))
    await agent.start()
    await asyncio.to_thread(agent.submit_start, StartSpec.decode(spec))
    async with asyncio.timeout(20):
        while "RUNNING" not in manager.reports or b"before-42" not in agent.sessions[spec["session_id"]].pipe.scrollback:
            await asyncio.sleep(0.02)
    process = agent.sessions[spec["session_id"]].process
    print(json.dumps({"pid": process.pid, "command_pid": process.command_pid}), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4], sys.argv[5]))
"""
COMMAND = "echo before-$((40 + 2)); while [ ! -e go ]; do sleep 0.05; done; echo during-$((40 + 2)); exec sleep 600"


def start_first_agent(
    node: str, scratch: Path, cgroup_root: str = CGROUP_AUTO, network: str = "none", command: str = COMMAND
) -> tuple[subprocess.Popen, dict]:
    """The first agent, started with one session (non-administrator's, sandboxed: COMMAND) running,
    its processes tracked by `cgroup_root`'s way, its network `network`; its record: the session id, its leader's and its
    command's host pids."""
    spec = {**start_spec(command=command), "owner_is_staff": False, "devices": []}
    first = subprocess.Popen(
        [sys.executable, "-c", FIRST_AGENT, node, str(scratch), json.dumps(spec), cgroup_root, network],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parent.parent,
    )
    assert first.stdout is not None
    line = first.stdout.readline()
    assert line, f"the first agent ended without starting its session (exit status {first.poll()})"
    return first, {**json.loads(line), "session_id": spec["session_id"]}


@pytest.mark.parametrize("cgroup_root", [CGROUP_AUTO, CGROUP_NONE], ids=["cgroup", "scan"])
def test_a_held_session_keeps_its_pid_and_terminal_when_its_agent_is_killed_and_a_new_one_adopts_it(tmp_path, cgroup_root):
    node = f"held-{uuid.uuid4().hex[:8]}"
    scratch = tmp_path / "scratch"
    first, started = start_first_agent(node, scratch, cgroup_root)
    session_id, pid = started["session_id"], started["pid"]
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
            await wait_until_async(lambda: b"during-42" in running.pipe.scrollback, timeout=20, interval=0.02,
                                   what="the output written while no agent ran")
            assert b"before-42" in running.pipe.scrollback, "the scrollback before the restart was lost"
            await h.type(session_id, "")  # the terminal takes input again (nothing to see: it sleeps)

        run_agent(tmp_path, scenario, node=node, cgroup_root=cgroup_root, runtime_options={"hold": True})
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


def test_an_adopted_outbound_session_keeps_its_network_and_its_rules(tmp_path):
    """slirp4netns ends with the session's holder, not with its agent: once adopted, the session
    still reaches a registry over HTTPS, and still not the node (slirp's gateway, a listener of
    the test's on the node's loopback)."""
    node = f"held-{uuid.uuid4().hex[:8]}"
    scratch = tmp_path / "scratch"
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    command = (
        "echo before-$((40 + 2)); while [ ! -e go ]; do sleep 0.05; done; "
        "timeout 10 bash -c 'exec 3<>/dev/tcp/deb.debian.org/443' && echo registry-$((40 + 2)); "
        f"timeout 3 bash -c 'exec 3<>/dev/tcp/10.0.2.2/{port}' || echo refused-$((40 + 2)); exec sleep 600"
    )
    first, started = start_first_agent(node, scratch, network="outbound", command=command)
    session_id = started["session_id"]
    try:
        first.send_signal(signal.SIGKILL)
        first.wait()

        async def scenario(h: Harness):
            running = h.agent.sessions.get(session_id)
            assert running is not None, "the new agent did not adopt the session"
            (scratch / session_id / "go").touch()
            await wait_until_async(
                lambda: b"refused-42" in running.pipe.scrollback, timeout=30, interval=0.05, what="the session's tries"
            )
            assert b"registry-42" in running.pipe.scrollback, f"the adopted session lost its network: {running.pipe.scrollback!r}"

        run_agent(tmp_path, scenario, node=node, runtime_options={"hold": True, "network": "outbound"})
    finally:
        listener.close()
        if first.poll() is None:
            first.kill()
            first.wait()


def test_a_held_session_whose_sandbox_cannot_be_set_up_fails_with_the_reason_and_leaves_no_holder(tmp_path):
    runtime = ProcessRuntime(node=f"held-{uuid.uuid4().hex[:8]}", cgroup_root=CGROUP_NONE, hold=True)
    runtime.clean_up_at_start(tmp_path / "scratch")
    work_dir = tmp_path / "scratch" / str(uuid.uuid4())
    work_dir.mkdir(parents=True)
    spec = typed_spec(session_id=work_dir.name, owner_is_staff=False, devices=[])
    with pytest.raises(SandboxError, match="no-such-folder"):
        runtime.spawn(spec=spec, folders=Folders(data_dir=tmp_path / "no-such-folder"), argv=["/bin/sleep", "30"],
                      env={"PATH": "/usr/bin:/bin"}, work_dir=work_dir)
    assert not list((tmp_path / "scratch" / HOLDERS_DIR).iterdir()), "the failed start left its holder's files"
    holders = [p for p in os.listdir("/proc") if p.isdigit() and work_dir.name.encode() in _cmdline(p)]
    assert not holders, "the failed start left its holder running"


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
