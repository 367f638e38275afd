"""The agent runtime, for real: PTY sessions, the terminal relay over a channel layer, and its
reports to the manager.

The manager lives outside the agent's process in production (Celery tasks on queue
`manager`), so a recording fake is the boundary here; the channel layer is Channels' own
in-memory layer. Every wait is on a condition with an asyncio deadline, never a sleep.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import uuid

import pytest
from channels.layers import InMemoryChannelLayer

from sessions.lifecycle import events
from common.exec_store import exec_store_default
from agent.core import Agent, agent_for
from agent.runtimes import CGROUP_AUTO, CGROUP_NONE, ProcessRuntime
from protocol.messages import AgentState, StartSpec
from tests.conftest import GiB, mock_gpu

TIMEOUT = 20.0
DEVICE = mock_gpu(0)


class RecordingManager:
    """Records the agent's register / heartbeat / report calls (made from worker threads) and
    wakes waiters on the agent's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.registered: list[tuple[str, dict, list[str]]] = []
        self.heartbeats: list[tuple[str, list[str]]] = []
        self.states: list[AgentState | None] = []  # what each heartbeat said the agent runs
        self.images: list[dict | None] = []  # what each registration and heartbeat said the node holds
        self.service_ports: list[dict | None] = []  # what each registration said of their service-ports labels
        self.reports: list[tuple[str, str, str, int | None]] = []
        self.logs: list[tuple[str, int, int, str, bool]] = []
        self.mig_reports: list[tuple[str, dict]] = []
        self._changed = asyncio.Event()

    def _record(self, bucket: list, item) -> None:
        bucket.append(item)
        self.loop.call_soon_threadsafe(self._changed.set)

    def register(self, node, inventory, running, images=None, image_service_ports=None):
        self.images.append(images)
        self.service_ports.append(image_service_ports)
        self._record(self.registered, (node, inventory, list(running)))

    def heartbeat(self, node, running, mig_digest=None, state=None, images=None, image_service_ports=None):
        self.states.append(state)
        self.images.append(images)
        self._record(self.heartbeats, (node, list(running)))

    def report(self, session_id, status, reason, exit_code):
        self._record(self.reports, (session_id, status, reason, exit_code))

    def log(self, session_id, seq, offset, text, final):
        self._record(self.logs, (session_id, seq, offset, text, final))

    def mig_report(self, node, report):
        self._record(self.mig_reports, (node, report.encode()))  # as CeleryManager sends it

    def reports_for(self, session_id: str) -> list[tuple[str, str, int | None]]:
        return [(status, reason, code) for sid, status, reason, code in self.reports if sid == session_id]

    async def wait_for(self, predicate, *, what: str, timeout: float = TIMEOUT):
        try:
            async with asyncio.timeout(timeout):
                while True:
                    self._changed.clear()
                    found = predicate()
                    if found:
                        return found
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}; reports: {self.reports}") from None

    async def wait_for_report(self, session_id: str, status: str):
        def found():
            return next((r for r in self.reports_for(session_id) if r[0] == status), None)

        return await self.wait_for(found, what=f"{status} report of {session_id}")


def start_spec(*, command: str = "", shares: str = "0.5", memory_limit: int = 2 * GiB, procs: str = "20") -> dict:
    """A start spec in the shape of `sessions.scheduling.scheduler.session_start_spec`."""
    return {
        "session_id": str(uuid.uuid4()),
        "name": "notebook",
        "owner": "alice",
        "command": command,
        "cpu": 1,
        "mem": GiB,
        "slot_name": "cuda",
        "slot_subtype": "shares",
        "devices": [{
            "device_id": DEVICE.device_id,
            "index": DEVICE.index,
            "model_name": DEVICE.model_name,
            "memory_total": DEVICE.memory_size,
            "subproc_count": DEVICE.subproc_count,
            "memory_limit": memory_limit,
            "procs": procs,
            "shares": shares,
            "is_mig_device": False,
            "mig_profile": "",
        }],
    }


def typed_spec(**changes) -> StartSpec:
    """`start_spec()` with `changes` (wire keys), as the agent decodes it (protocol.messages.StartSpec):
    what the runtimes and the lifecycle's stages take."""
    return StartSpec.decode({**start_spec(), **changes})


class Harness:
    def __init__(self, agent: Agent, manager: RecordingManager, layer: InMemoryChannelLayer) -> None:
        self.agent, self.manager, self.layer = agent, manager, layer

    async def start_session(self, spec: dict) -> str:
        """Submit the start the way the Celery task does (from another thread); wait for RUNNING."""
        await asyncio.to_thread(self.agent.submit_start, StartSpec.decode(spec))
        await self.manager.wait_for_report(spec["session_id"], "RUNNING")
        return spec["session_id"]

    async def watch_terminal(self, session_id: str) -> str:
        """A channel of our own in the session's terminal group (as a terminal consumer joins it)."""
        channel = await self.layer.new_channel("test.")
        await self.layer.group_add(events.terminal_group(self.agent.node, session_id), channel)
        return channel

    async def to_pty(self, session_id: str, message: dict) -> None:
        await self.layer.group_send(events.pty_group(self.agent.node, session_id), {**message, "session_id": session_id})

    async def type(self, session_id: str, text: str) -> None:
        await self.to_pty(session_id, {"type": "pty.input", "data": text})

    async def read_until(self, channel: str, expect: str, *, timeout: float = TIMEOUT) -> str:
        """Collect terminal.output frames from `channel` until `expect` shows up."""
        output = ""
        try:
            async with asyncio.timeout(timeout):
                while expect not in output:
                    message = await self.layer.receive(channel)
                    assert message["type"] in ("terminal.output", "terminal.exit"), message
                    output += message.get("data", "")
        except TimeoutError:
            raise AssertionError(f"{expect!r} not in the terminal output:\n{output}") from None
        return output

    async def receive_type(self, channel: str, kind: str, *, timeout: float = TIMEOUT) -> dict:
        """The next message of type `kind` on `channel` (skipping others)."""
        async with asyncio.timeout(timeout):
            while True:
                message = await self.layer.receive(channel)
                if message["type"] == kind:
                    return message


# How the process runtime tracks a session's processes (agent.toml's [container] cgroup-root):
# its own cgroup v2, or the /proc scan. The tests of this module and of those that import
# `process_tracking` run in both; `run_agent` reads the mode the fixture chose.
TRACKING = {"cgroup": CGROUP_AUTO, "scan": CGROUP_NONE}
_tracking = {"mode": "cgroup"}


@pytest.fixture(params=sorted(TRACKING), autouse=True)
def process_tracking(request) -> str:
    """Each test once with each way of tracking processes ("cgroup": a test fails where this
    machine has no writable cgroup v2)."""
    _tracking["mode"] = request.param
    yield request.param
    _tracking["mode"] = "cgroup"


def run_agent(
    tmp_path,
    scenario,
    *,
    heartbeat_s: float = 60.0,
    layer_class=InMemoryChannelLayer,
    node: str | None = None,
    cgroup_root: str | None = None,
    manager_class=None,
    runtime_options: dict | None = None,
    **agent_options,
):
    """Start a real Agent on a fresh asyncio loop, run `await scenario(harness)`, shut it down.
    `cgroup_root`: the process runtime's (None: the mode of `process_tracking`, checked: in
    "cgroup" mode the agent must have cgroups); `manager_class`: a RecordingManager subclass;
    `runtime_options`: more keyword arguments of ProcessRuntime (e.g. network="outbound");
    `agent_options`: more keyword arguments of Agent (e.g. terminal_direct=True)."""
    node = node or f"test-node-{uuid.uuid4().hex[:8]}"
    mode = _tracking["mode"]
    runtime = ProcessRuntime(
        node=node, cgroup_root=TRACKING[mode] if cgroup_root is None else cgroup_root, **(runtime_options or {})
    )

    async def main():
        layer = layer_class()
        manager = (manager_class or RecordingManager)(asyncio.get_running_loop())
        inventory = {"devices": [DEVICE.as_dict()], "plugins": ["ai.backend.accelerator.mock"], "attributes": {},
                     "cpu_count": 8, "memory_size": 32 * GiB}
        agent = Agent(node=node, inventory=inventory, channel_layer=layer, manager=manager,
                      scratch_root=tmp_path / "scratch", mock=True, heartbeat_s=heartbeat_s,
                      exec_store=exec_store_default(), runtime=runtime, **agent_options)
        await agent.start()
        if cgroup_root is None and mode == "cgroup":
            assert runtime.cgroups is not None, "this machine has no writable cgroup v2 hierarchy (see the log)"
        try:
            return await scenario(Harness(agent, manager, layer))
        finally:
            await agent.shutdown()

    return asyncio.run(main())


def agent_for_absent(node: str) -> bool:
    try:
        agent_for(node)
    except LookupError:
        return True
    return False


def host_pid(process, pid: int) -> int:
    """The node's pid of the session's process `pid` as the session sees it: the same outside a
    sandbox; in one, the process of the sandbox's PID namespace whose innermost pid (NSpid) it is."""
    if process.sandbox is None:
        return pid
    namespace = os.readlink(f"/proc/{process.init_pid}/ns/pid")
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.readlink(f"/proc/{entry.name}/ns/pid") != namespace:
                    continue
                status = open(f"/proc/{entry.name}/status").read()
            except OSError:
                continue
            nspid = next(line for line in status.splitlines() if line.startswith("NSpid:")).split()
            if int(nspid[-1]) == pid:
                return int(entry.name)
    raise AssertionError(f"no process {pid} in the session's sandbox")


def process_group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` lives (a zombie does not count: a sandboxed session's
    bwrap exits before it reaps the sandbox's init, which the node's pid 1 reaps, or, where pid 1
    reaps nothing, as on the CI machine, never does)."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = open(f"/proc/{entry.name}/stat").read()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2 :].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


# --- tests ----------------------------------------------------------------------------------------

def test_the_agent_registers_its_inventory_and_is_found_by_node_name(tmp_path):
    async def scenario(h: Harness):
        await h.manager.wait_for(lambda: h.manager.registered, what="register")
        [(node, inventory, running)] = h.manager.registered
        assert node == h.agent.node
        assert inventory["devices"][0]["device_id"] == DEVICE.device_id
        assert running == []
        assert agent_for(h.agent.node) is h.agent
        return h.agent.node

    node = run_agent(tmp_path, scenario)

    with pytest.raises(LookupError):
        agent_for(node)  # gone after shutdown


def test_heartbeats_list_the_sessions_the_agent_runs(tmp_path):
    async def scenario(h: Harness):
        session_id = await h.start_session(start_spec())
        await h.manager.wait_for(lambda: any(session_id in running for _, running in h.manager.heartbeats),
                                 what="a heartbeat naming the session")

    run_agent(tmp_path, scenario, heartbeat_s=0.05)


def test_an_interactive_session_reports_preparing_then_running_and_runs_nvidia_smi_in_its_terminal(tmp_path):
    async def scenario(h: Harness):
        spec = start_spec()
        session_id = spec["session_id"]
        await asyncio.to_thread(h.agent.submit_start, StartSpec.decode(spec))
        await h.manager.wait_for_report(session_id, "RUNNING")
        assert [status for status, _, _ in h.manager.reports_for(session_id)] == ["PREPARING", "RUNNING"]

        channel = await h.watch_terminal(session_id)
        await h.type(session_id, "nvidia-smi\r")
        output = await h.read_until(channel, "SMs")
        assert re.search(r"\b0MiB /\s+2048MiB\b", output), output  # the slice's memory as the total
        assert "20 of 80 SMs" in output

        work_dir = tmp_path / "scratch" / session_id
        document = json.loads((work_dir / ".fgpu" / "allocation.json").read_text())
        assert document["devices"][0]["memory_limit"] == 2 * GiB
        assert (work_dir / ".fgpu" / "bin" / "nvidia-smi").exists()

    run_agent(tmp_path, scenario)


def test_attaching_replays_the_scrollback_to_the_reply_channel(tmp_path):
    async def scenario(h: Harness):
        session_id = await h.start_session(start_spec())
        channel = await h.watch_terminal(session_id)
        await h.type(session_id, "echo scroll-$((40 + 2))\r")
        await h.read_until(channel, "scroll-42")

        reply = await h.layer.new_channel("reply.")
        await h.to_pty(session_id, {"type": "pty.attach", "reply_channel": reply})
        message = await h.receive_type(reply, "terminal.output")
        assert "scroll-42" in message["data"]
        assert "echo scroll-$((40 + 2))" in message["data"]

    run_agent(tmp_path, scenario)


def test_the_session_environment_carries_its_memory_and_compute_limits(tmp_path):
    async def scenario(h: Harness):
        session_id = await h.start_session(start_spec())
        channel = await h.watch_terminal(session_id)
        await h.type(session_id, 'echo "limit=$CUDA_DEVICE_MEMORY_LIMIT_0 sm=$CUDA_DEVICE_SM_LIMIT id=$FGPU_SESSION_ID"\r')
        output = await h.read_until(channel, f"id={session_id}")
        assert "limit=2048m sm=25 " in output
        await h.type(session_id, 'echo "visible=$CUDA_VISIBLE_DEVICES"\r')
        assert f"visible={DEVICE.device_id}" in await h.read_until(channel, f"visible={DEVICE.device_id}")

    run_agent(tmp_path, scenario)


def test_a_resize_reaches_the_sessions_terminal(tmp_path):
    async def scenario(h: Harness):
        session_id = await h.start_session(start_spec())
        channel = await h.watch_terminal(session_id)
        await h.to_pty(session_id, {"type": "pty.resize", "cols": 123, "rows": 45})
        await h.type(session_id, "stty size\r")
        await h.read_until(channel, "45 123")

    run_agent(tmp_path, scenario)


def test_stopping_a_session_kills_its_process_group_sends_exit_and_reports_terminated(tmp_path):
    async def scenario(h: Harness):
        session_id = await h.start_session(start_spec())
        pgid = h.agent.sessions[session_id].process.pid
        channel = await h.watch_terminal(session_id)
        await h.type(session_id, "sleep 1000 &\r")  # a child in the same process group
        await h.type(session_id, "echo started-$((1 + 1))\r")
        await h.read_until(channel, "started-2")
        assert process_group_alive(pgid)

        await asyncio.to_thread(h.agent.submit_stop, session_id)  # as the Celery task does

        exit_message = await h.receive_type(channel, "terminal.exit")
        assert isinstance(exit_message["code"], int)
        _, reason, code = await h.manager.wait_for_report(session_id, "TERMINATED")
        assert reason == "terminated"
        assert code == exit_message["code"]
        assert not process_group_alive(pgid)
        assert session_id not in h.agent.sessions
        assert [s for s, _, _ in h.manager.reports_for(session_id)] == ["PREPARING", "RUNNING", "TERMINATED"]

    run_agent(tmp_path, scenario)


def test_the_managers_stop_over_the_channel_layer_and_its_task_after_it_stop_the_session_once(tmp_path):
    """`pty.stop` (sent beside the SESSION_STOP task) stops the session; the task arriving
    second finds it ended and reports the same end again, which the manager's compare-and-set
    ignores (protocol)."""
    async def scenario(h: Harness):
        session_id = await h.start_session(start_spec())
        pgid = h.agent.sessions[session_id].process.pid

        await h.to_pty(session_id, {"type": "pty.stop"})
        _, reason, _ = await h.manager.wait_for_report(session_id, "TERMINATED")
        assert reason == "terminated" and not process_group_alive(pgid)

        await asyncio.to_thread(h.agent.submit_stop, session_id)  # the task, later
        await h.manager.wait_for(lambda: len(h.manager.reports_for(session_id)) == 4, what="the end reported again")
        assert [s for s, _, _ in h.manager.reports_for(session_id)] == ["PREPARING", "RUNNING", "TERMINATED", "TERMINATED"]

    run_agent(tmp_path, scenario)


def test_a_batch_command_reports_terminated_with_its_exit_code(tmp_path):
    async def scenario(h: Harness):
        spec = start_spec(command="exit 3")
        await asyncio.to_thread(h.agent.submit_start, StartSpec.decode(spec))
        _, reason, code = await h.manager.wait_for_report(spec["session_id"], "TERMINATED")
        assert code == 3
        assert reason == "the process exited with code 3"
        assert spec["session_id"] not in h.agent.sessions

    run_agent(tmp_path, scenario)


def test_a_batch_commands_output_reaches_the_terminal_group(tmp_path):
    async def scenario(h: Harness):
        spec = start_spec(command="nvidia-smi --query-gpu=memory.total --format=csv,noheader")
        channel = await h.watch_terminal(spec["session_id"])  # joined before the start
        await asyncio.to_thread(h.agent.submit_start, StartSpec.decode(spec))
        output = await h.read_until(channel, "MiB")
        assert "2048 MiB" in output
        _, _, code = await h.manager.wait_for_report(spec["session_id"], "TERMINATED")
        assert code == 0

    run_agent(tmp_path, scenario)


def test_a_session_flooding_its_output_is_held_to_the_output_rate(tmp_path):
    """2 MiB of output at OUTPUT_RATE_BYTES (512 KiB/s) after a burst of OUTPUT_BURST_BYTES (1 MiB)
    take at least 2 s when no terminal reads it (the channel below joined the group without
    attaching): the PTY is left unread meanwhile and the program waits (a lower bound, so a slow
    machine cannot make it fail); the output still arrives, to its end."""
    from agent.terminal_pipe import OUTPUT_BURST_BYTES, OUTPUT_RATE_BYTES

    size = 2 * 1024 * 1024
    async def scenario(h: Harness):
        spec = start_spec(command=f"head -c {size} /dev/zero | tr '\\0' a; echo; echo done-$((40+2))")
        channel = await h.watch_terminal(spec["session_id"])
        await asyncio.to_thread(h.agent.submit_start, StartSpec.decode(spec))
        await h.manager.wait_for_report(spec["session_id"], "RUNNING")
        started = asyncio.get_running_loop().time()
        output = await h.read_until(channel, "done-42")
        elapsed = asyncio.get_running_loop().time() - started
        _, _, code = await h.manager.wait_for_report(spec["session_id"], "TERMINATED")
        return elapsed, output, code

    elapsed, output, code = run_agent(tmp_path, scenario)
    assert code == 0 and output.rstrip().endswith("done-42")
    assert elapsed >= (size - OUTPUT_BURST_BYTES) / OUTPUT_RATE_BYTES * 0.95, elapsed


def test_stopping_an_unknown_session_reports_terminated_saying_no_process_was_running(tmp_path):
    async def scenario(h: Harness):
        session_id = str(uuid.uuid4())
        await asyncio.to_thread(h.agent.submit_stop, session_id)
        _, reason, code = await h.manager.wait_for_report(session_id, "TERMINATED")
        assert reason == "terminated (no process was running)"
        assert code is None

    run_agent(tmp_path, scenario)


def test_a_redelivered_start_message_does_not_start_a_second_process(tmp_path):
    async def scenario(h: Harness):
        spec = start_spec()
        session_id = await h.start_session(spec)
        pid = h.agent.sessions[session_id].process.pid

        await asyncio.to_thread(h.agent.submit_start, StartSpec.decode(spec))
        await h.manager.wait_for(lambda: h.agent.sessions.get(session_id), what="the session")  # still there

        channel = await h.watch_terminal(session_id)
        process = h.agent.sessions[session_id].process
        if process.sandbox is not None:  # its shell is pid 2 of its own PID namespace: that namespace is the first start's
            await h.type(session_id, "echo pid=$(readlink /proc/$$/ns/pid)\r")
            expected = os.readlink(f"/proc/{process.init_pid}/ns/pid")
        else:
            await h.type(session_id, "echo pid=$$\r")
            expected = str(pid)
        assert f"pid={expected}" in await h.read_until(channel, f"pid={expected}")
        # One process; the second start only says again where it is (the manager may have missed it).
        # That report is sent from a worker thread: wait for it rather than race it.
        statuses = await h.manager.wait_for(
            lambda: len(h.manager.reports_for(session_id)) >= 3 and [s for s, _, _ in h.manager.reports_for(session_id)],
            what="the second RUNNING report")
        assert statuses == ["PREPARING", "RUNNING", "RUNNING"]
        assert h.agent.sessions[session_id].process.pid == pid

    run_agent(tmp_path, scenario)


def test_input_for_another_session_does_not_reach_this_one(tmp_path):
    async def scenario(h: Harness):
        first = await h.start_session(start_spec())
        second = await h.start_session(start_spec())
        first_out, second_out = await h.watch_terminal(first), await h.watch_terminal(second)

        await h.type(second, "echo only-$((6 * 7))\r")
        await h.read_until(second_out, "only-42")
        await h.type(first, "echo first-$((1 + 2))\r")
        output = await h.read_until(first_out, "first-3")
        assert "only" not in output

    run_agent(tmp_path, scenario)


def test_shutting_the_agent_down_ends_every_session_it_runs(tmp_path):
    state = {}

    async def scenario(h: Harness):
        session_id = await h.start_session(start_spec())
        state["pgid"] = h.agent.sessions[session_id].process.pid
        state["node"] = h.agent.node

    run_agent(tmp_path, scenario)

    assert not process_group_alive(state["pgid"])
    assert agent_for_absent(state["node"])


STUBBORN = "trap '' HUP TERM; echo trapped-$((20 + 1)); sleep 1000"  # ignores the polite signals


def test_a_process_that_ignores_sighup_and_sigterm_is_killed_after_the_grace_period(tmp_path):
    async def scenario(h: Harness):
        spec = start_spec(command=STUBBORN)
        channel = await h.watch_terminal(spec["session_id"])
        await asyncio.to_thread(h.agent.submit_start, StartSpec.decode(spec))
        await h.read_until(channel, "trapped-21")
        pgid = h.agent.sessions[spec["session_id"]].process.pid

        await asyncio.to_thread(h.agent.submit_stop, spec["session_id"])

        _, reason, code = await h.manager.wait_for_report(spec["session_id"], "TERMINATED")
        assert reason == "terminated"
        assert code == 128 + 9  # SIGKILL
        assert not process_group_alive(pgid)

    run_agent(tmp_path, scenario)


# Takes the first SIGHUP without ending (as an interactive bash may while it starts up), ignores
# SIGTERM; the next SIGHUP finds the default action.
MISSES_THE_FIRST_SIGHUP = "trap 'trap - HUP' HUP; trap '' TERM; echo armed-$((20 + 2)); while :; do sleep 0.05; done"


def test_a_leader_that_takes_the_first_sighup_without_ending_ends_on_the_next_one_within_the_grace(tmp_path):
    """`_stop` sends SIGHUP again within KILL_GRACE_S (RESIGNAL_S, doubling): the session ends
    by SIGHUP (129), not by the SIGKILL after the grace (137)."""

    async def scenario(h: Harness):
        spec = start_spec(command=MISSES_THE_FIRST_SIGHUP)
        channel = await h.watch_terminal(spec["session_id"])
        await asyncio.to_thread(h.agent.submit_start, StartSpec.decode(spec))
        await h.read_until(channel, "armed-22")

        await asyncio.to_thread(h.agent.submit_stop, spec["session_id"])

        _, reason, code = await h.manager.wait_for_report(spec["session_id"], "TERMINATED")
        assert reason == "terminated"
        assert code == 128 + signal.SIGHUP

    run_agent(tmp_path, scenario)


def test_when_shutdown_returns_every_session_is_gone_and_reported_terminated(tmp_path):
    """`manage.py agent` stops the loop as soon as `Agent.shutdown()` returns, so by then the
    processes must be gone and their TERMINATED reports made ("Kill every session (reported
    TERMINATED)"), not left to tasks that a stopped loop never runs."""

    async def scenario(h: Harness):
        spec = start_spec(command=STUBBORN)
        session_id = spec["session_id"]
        channel = await h.watch_terminal(session_id)
        await asyncio.to_thread(h.agent.submit_start, StartSpec.decode(spec))
        await h.read_until(channel, "trapped-21")
        pgid = h.agent.sessions[session_id].process.pid

        await h.agent.shutdown()

        assert [s for s, _, _ in h.manager.reports_for(session_id)] == ["PREPARING", "RUNNING", "TERMINATED"]
        assert h.manager.reports_for(session_id)[-1][1] == "the agent shut down"
        assert not process_group_alive(pgid)

    run_agent(tmp_path, scenario)


def pid_alive(pid: int) -> bool:
    """True while `pid` runs. A zombie (killed, waiting for its new parent to reap it) is dead:
    it holds no memory, GPU or otherwise."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def test_stopping_a_session_also_ends_a_background_job_started_with_nohup(tmp_path):
    """An interactive shell gives each background job a process group of its own, and `nohup`
    makes it ignore SIGHUP: stopping the session must still end it, or it keeps using the
    GPU slice after its allocation was released."""
    leftovers = []

    async def scenario(h: Harness):
        session_id = await h.start_session(start_spec())
        channel = await h.watch_terminal(session_id)
        await h.type(session_id, "nohup sleep 1000 >/dev/null 2>&1 &\r")
        await h.type(session_id, "echo bg:$!:$((6 * 7))\r")
        output = await h.read_until(channel, ":42")
        background = host_pid(h.agent.sessions[session_id].process, int(re.search(r"bg:(\d+):42", output)[1]))
        leftovers.append(background)
        assert pid_alive(background)

        await asyncio.to_thread(h.agent.submit_stop, session_id)
        await h.manager.wait_for_report(session_id, "TERMINATED")

        assert not pid_alive(background), "the session's background job outlived the session"

    try:
        run_agent(tmp_path, scenario)
    finally:
        for pid in leftovers:  # the test's own child: never leave it running
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def test_session_members_reads_the_session_id_and_can_leave_zombies_out(tmp_path):
    for pid, state, session in ((101, "S", 77), (102, "Z", 77), (103, "R", 78)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (a (b) c) {state} 1 {pid} {session} 0 -1 4194560\n")
    (tmp_path / "self").mkdir()
    from agent.runtimes import session_members

    assert sorted(session_members(77, proc=str(tmp_path))) == [101, 102]
    assert session_members(77, proc=str(tmp_path), live_only=True) == [101]


def test_session_processes_reads_the_environment_only_of_processes_newer_than_the_leader(tmp_path):
    """A process that left the session (setsid) is found by the FGPU_SESSION_ID in its
    environment; with `since` (the leader's start), a process that started before the leader is
    not read at all: none of the session's can be older than it."""
    from agent.runtimes import session_processes

    def process(pid: int, *, started: int, environ: bytes, session: int = 5) -> None:
        (tmp_path / str(pid)).mkdir()
        rest = " ".join(["0"] * 15) + f" {started} 0"  # tty_nr … itrealvalue, then starttime (field 22)
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (sh) S 1 {pid} {session} {rest}\n")
        (tmp_path / str(pid) / "environ").write_bytes(environ)

    process(201, started=1000, environ=b"FGPU_SESSION_ID=s1\0", session=201)  # the leader
    process(202, started=1500, environ=b"HOME=/\0FGPU_SESSION_ID=s1\0")  # a daemon that called setsid
    process(203, started=900, environ=b"FGPU_SESSION_ID=s1\0")  # older than the leader: never its
    process(204, started=1600, environ=b"FGPU_SESSION_ID=s2\0")  # another session's

    assert sorted(session_processes("s1", 201, proc=str(tmp_path))) == [201, 202, 203]
    assert sorted(session_processes("s1", 201, proc=str(tmp_path), since=1000)) == [201, 202]
