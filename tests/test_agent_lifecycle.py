"""agent.lifecycle: a session's spawn stage by stage with the real process runtime (the typed start
spec, protocol.messages.StartSpec, through every stage, the process's included), the stop's
signalling against a recording stand-in of a session's processes, and SessionLifecycle's start,
stop, end, sync and preemption notice driven directly on a real Agent's loop (its process
runtime, an in-memory channel layer and a recording manager: tests/test_agent_runtime.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import threading
import uuid

from channels.layers import InMemoryChannelLayer

import protocol
from agent import lifecycle
from agent.core import Agent
from agent.runtimes import CGROUP_NONE, ProcessRuntime
from common.exec_store import exec_store_default
from protocol.messages import StartSpec
from tests.conftest import GiB
from tests.stack import wait_until_async
from tests.test_agent_runtime import DEVICE, TIMEOUT, Harness, RecordingManager, start_spec, typed_spec


def node(tmp_path, *, data_root=None) -> lifecycle.Node:
    runtime = ProcessRuntime(node="lifecycle-node", cgroup_root=CGROUP_NONE)
    return lifecycle.Node(
        name="lifecycle-node",
        scratch_root=tmp_path / "scratch",
        data_root=data_root,
        runtime=runtime,
        mig=None,
        mock=True,
        mps=False,
        attributes={},
    )


def test_the_stages_before_the_process_make_its_directory_document_tools_environment_and_command(tmp_path):
    here = node(tmp_path)
    start = StartSpec.decode(start_spec(command="nvidia-smi"))

    assert lifecycle.stage_mig(here, start) is start  # no MIG block: nothing to carry out
    work = lifecycle.stage_work_dir(here, start)
    document = json.loads(lifecycle.stage_allocation(here, start, work).read_text())
    lifecycle.stage_tools(here, work)
    folders = lifecycle.stage_folders(here, start, work)
    env = lifecycle.stage_environment(here, start, work)
    argv = lifecycle.stage_command(here, start)

    assert work.path == tmp_path / "scratch" / start.session_id and work.bin_dir.is_dir()
    assert [d["uuid"] for d in document["devices"]] == [start.devices[0].hardware_id]
    assert document["session_id"] == start.session_id and document["mem"] == start.mem
    assert (work.bin_dir / "nvidia-smi").exists()
    assert folders == lifecycle.Folders() and folders.all() == []
    assert env["FGPU_SESSION_ID"] == start.session_id and env["PS1"].startswith("alice@notebook:")
    assert env["CUDA_VISIBLE_DEVICES"]
    assert argv[1:] == ["-c", "nvidia-smi"]


def test_an_interactive_session_gets_bash_without_its_profile_and_another_shell_plain(tmp_path):
    here = node(tmp_path)
    bash = StartSpec.decode({**start_spec(), "shell": "/bin/bash"})
    sh = StartSpec.decode({**start_spec(), "shell": "/bin/sh"})
    assert lifecycle.stage_command(here, bash) == ["/bin/bash", "--noprofile", "--norc", "-i"]
    assert lifecycle.stage_command(here, sh) == ["/bin/sh", "-i"]


def test_the_owners_folder_is_made_and_named_for_the_runtime(tmp_path):
    here = node(tmp_path, data_root=tmp_path / "data")
    start = StartSpec.decode({**start_spec(), "owner_id": 7})
    work = lifecycle.stage_work_dir(here, start)
    folders = lifecycle.stage_folders(here, start, work)
    assert folders.data_dir == tmp_path / "data" / "users" / "7" and folders.data_dir.is_dir()
    assert (work.path / "data").resolve() == folders.data_dir  # the process runtime: linked at ~/data


class Processes:
    """A session's processes as the stop sees them: records the signals; the leader exits at the
    `exit_on`-th SIGHUP (never: None)."""

    def __init__(self, exited: asyncio.Event, exit_on: int | None) -> None:
        self.exited, self.exit_on, self.calls, self.hups = exited, exit_on, [], 0

    def signal_all(self, *signals) -> None:
        self.calls.append(signals)
        self.hups += signal.SIGHUP in signals
        if self.exit_on is not None and self.hups >= self.exit_on:
            self.exited.set()

    def kill_all(self) -> int:
        self.calls.append("kill")
        return 1


def stop(exit_on, **timing):
    async def main():
        exited = asyncio.Event()
        processes = Processes(exited, exit_on)

        async def on_process(fn, *args):
            return fn(*args)

        await lifecycle.signal_until_exit(processes, exited, on_process, **timing)
        return processes.calls

    return asyncio.run(main())


def test_a_stop_sends_hup_and_term_then_hup_again_until_the_leader_exits():
    calls = stop(3, grace_s=10.0, resignal_s=0.001)
    assert calls == [(signal.SIGHUP, signal.SIGTERM), (signal.SIGHUP,), (signal.SIGHUP,)]


def test_a_leader_that_ignores_every_signal_is_killed_after_the_grace():
    calls = stop(None, grace_s=0.05, resignal_s=0.01)
    assert calls[0] == (signal.SIGHUP, signal.SIGTERM) and calls[-1] == "kill" and calls.count("kill") == 1


def test_waiting_for_the_sessions_processes_to_be_gone_polls_until_none_is_left_or_the_deadline():
    async def main():
        answers = iter([True, True, False])
        asked = []

        async def alive() -> bool:
            asked.append(1)
            return next(answers)

        loop = asyncio.get_running_loop()
        await lifecycle.wait_gone(object(), deadline=loop.time() + 10, alive=alive)
        gone_after = len(asked)

        async def forever() -> bool:
            return True

        started = loop.time()
        await lifecycle.wait_gone(object(), deadline=started + 0.05, alive=forever)
        return gone_after, loop.time() - started

    asked, waited = asyncio.run(main())
    assert asked == 3 and 0.05 <= waited < 5


def test_a_wait_status_reads_as_shells_report_it():
    assert lifecycle.exit_code_of(0) == 0 and lifecycle.exit_code_of(3) == 3
    assert lifecycle.exit_code_of(-signal.SIGKILL) == 137


# --- stages with the runtime's process, and the MIG stage --------------------------------------


def test_the_process_stage_starts_the_command_in_its_home_with_the_environment_and_the_folders_made(tmp_path):
    here = node(tmp_path, data_root=tmp_path / "data")
    wire = start_spec(command='echo "$FGPU_SESSION_ID $CUDA_VISIBLE_DEVICES" > seen; ls data projects shared >> seen')
    start = StartSpec.decode({**wire, "owner_id": 7, "projects": [{"id": "11", "name": "vision"}],
                              "shared": [{"name": "ann", "kind": "user", "id": "8", "read_only": True}]})
    work = lifecycle.stage_work_dir(here, start)
    lifecycle.stage_allocation(here, start, work)
    folders = lifecycle.stage_folders(here, start, work)
    env = lifecycle.stage_environment(here, start, work)
    handle = lifecycle.stage_process(here, start, folders, lifecycle.stage_command(here, start), env, work, progress=print)
    try:
        assert lifecycle.exit_code_of(handle.wait()) == 0
    finally:
        handle.kill_all()
        handle.remove()
    seen = (work.path / "seen").read_text().split()
    assert seen[:2] == [start.session_id, start.devices[0].hardware_id]
    assert folders.project_dirs == {"vision": tmp_path / "data" / "projects" / "11"}
    assert folders.shared_dirs == {"ann": (tmp_path / "data" / "users" / "8", True)}
    assert "vision" in seen and "ann" in seen  # ~/projects/vision and ~/shared/ann are there for the session


def test_the_mig_stage_puts_the_instance_it_made_first_in_place_of_its_gpu(tmp_path):
    from agent.mig import MigManager, MockMigBackend

    here = dataclasses.replace(node(tmp_path), mig=MigManager(MockMigBackend()))
    gpu = start_spec()["devices"][0]["device_id"]
    start = StartSpec.decode({**start_spec(), "mig": {"gpu": gpu, "model_name": "A100-40GB", "profile": "1g.5gb",
                                                       "start": 0, "memory_size": 40 * GiB, "subproc_count": 108}})
    made = lifecycle.stage_mig(here, start)
    (device,) = made.devices
    assert device.is_mig_device and device.mig_profile == "1g.5gb" and device.hardware_id.startswith("MIG-")
    assert device.memory_limit == device.memory_total and made.mig == start.mig and made.session_id == start.session_id
    env = lifecycle.stage_environment(here, made, lifecycle.stage_work_dir(here, made))
    assert env["CUDA_VISIBLE_DEVICES"] == device.hardware_id  # the session sees the MIG device, never the whole GPU


# --- SessionLifecycle: start, stop, end and sync with a real agent's process runtime ----------------


class GatedRuntime(ProcessRuntime):
    """The process runtime, whose spawn waits until the test opens `gate` (`entered` says it got there)."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.entered, self.gate = threading.Event(), threading.Event()

    def spawn(self, **kwargs):
        self.entered.set()
        assert self.gate.wait(TIMEOUT), "the test never let the spawn go on"
        return super().spawn(**kwargs)


def run_lifecycle(tmp_path, scenario, *, runtime: ProcessRuntime | None = None):
    """`await scenario(harness)` with a real Agent (process runtime, /proc scan: no cgroup of its
    own) whose SessionLifecycle the scenario drives itself, on the agent's loop."""
    node_name = f"lifecycle-{uuid.uuid4().hex[:8]}"
    runtime = runtime or ProcessRuntime(node=node_name, cgroup_root=CGROUP_NONE)

    async def main():
        layer = InMemoryChannelLayer()
        manager = RecordingManager(asyncio.get_running_loop())
        inventory = {"devices": [DEVICE.as_dict()], "plugins": [], "attributes": {}, "cpu_count": 8, "memory_size": 32 * GiB}
        agent = Agent(node=node_name, inventory=inventory, channel_layer=layer, manager=manager,
                      scratch_root=tmp_path / "scratch", mock=True, heartbeat_s=60.0, exec_store=exec_store_default(),
                      runtime=runtime)
        await agent.start()
        try:
            return await scenario(Harness(agent, manager, layer))
        finally:
            await agent.shutdown()

    return asyncio.run(main())


def statuses(h: Harness, session_id: str) -> list[str]:
    return [status for status, _, _ in h.manager.reports_for(session_id)]


def test_a_start_reports_preparing_then_running_a_resent_one_running_again_and_a_start_after_the_end_only_the_end(
        tmp_path):
    async def scenario(h: Harness):
        start = typed_spec()  # an interactive shell
        await h.agent.lifecycle.start(start)
        assert statuses(h, start.session_id) == ["PREPARING", "RUNNING"]
        running = h.agent.sessions[start.session_id]
        assert running.work_dir == h.agent.scratch_root / start.session_id and running.env["FGPU_SESSION_ID"]

        await h.agent.lifecycle.start(start)  # re-sent: the manager may have missed RUNNING
        assert statuses(h, start.session_id) == ["PREPARING", "RUNNING", "RUNNING"]
        assert h.agent.sessions[start.session_id] is running, "a re-sent start started the session again"

        await h.agent.lifecycle.stop(start.session_id, reason="terminated")  # returns once TERMINATED is reported
        assert statuses(h, start.session_id)[-1] == "TERMINATED"
        assert h.manager.reports_for(start.session_id)[-1][1] == "terminated"
        assert start.session_id not in h.agent.sessions and not await asyncio.to_thread(running.process.alive)

        await h.agent.lifecycle.start(start)  # a start re-sent after the end: never run twice
        assert statuses(h, start.session_id) == ["PREPARING", "RUNNING", "RUNNING", "TERMINATED", "TERMINATED"]
        assert start.session_id not in h.agent.sessions

    run_lifecycle(tmp_path, scenario)


def test_a_session_that_exits_is_reported_terminated_with_its_code_and_its_last_output_in_the_final_log_batch(tmp_path):
    async def scenario(h: Harness):
        start = typed_spec(command="echo bye-$((40 + 2)); exit 3")
        await h.agent.lifecycle.start(start)
        status, reason, code = (await h.manager.wait_for_report(start.session_id, "TERMINATED"))
        assert (reason, code) == ("the process exited with code 3", 3)

        def final():
            return [text for sid, _, _, text, last in h.manager.logs if sid == start.session_id and last]

        await h.manager.wait_for(final, what="the final log batch")
        assert "bye-42" in "".join(text for sid, _, _, text, _ in h.manager.logs if sid == start.session_id)
        assert start.session_id not in h.agent.sessions and start.session_id in h.agent.link.ended

    run_lifecycle(tmp_path, scenario)


def test_a_stop_that_overtakes_the_start_ends_the_session_once_its_process_exists_and_it_never_reports_running(
        tmp_path):
    runtime = GatedRuntime(node=f"gated-{uuid.uuid4().hex[:8]}", cgroup_root=CGROUP_NONE)

    async def scenario(h: Harness):
        start = typed_spec(command="sleep 60")
        starting = asyncio.create_task(h.agent.lifecycle.start(start))
        assert await asyncio.to_thread(runtime.entered.wait, TIMEOUT), "the spawn never began"
        assert h.agent.state().statuses == {start.session_id: "PREPARING"}
        await h.agent.lifecycle.stop(start.session_id, reason="terminated")  # noted: the start ends it
        runtime.gate.set()
        await asyncio.wait_for(starting, TIMEOUT)
        assert statuses(h, start.session_id) == ["PREPARING", "TERMINATED"]
        assert h.manager.reports_for(start.session_id)[-1][1] == "terminated while starting"
        assert h.agent.state().statuses == {} and start.session_id not in h.agent._cancelled

    run_lifecycle(tmp_path, scenario, runtime=runtime)


def test_a_start_that_fails_in_a_stage_reports_error_with_the_reason_and_leaves_nothing_behind(tmp_path):
    async def scenario(h: Harness):
        gpu = start_spec()["devices"][0]["device_id"]
        start = typed_spec(mig={"gpu": gpu, "model_name": "A100-40GB", "profile": "9g.999gb", "start": 0})
        await h.agent.lifecycle.start(start)
        [(first, _, _), (status, reason, code)] = h.manager.reports_for(start.session_id)
        assert (first, status, code) == ("PREPARING", "ERROR", None)
        assert reason.startswith("the agent could not start the session: ") and "9g.999gb" in reason
        assert h.agent.state().statuses == {} and not (h.agent.scratch_root / start.session_id).exists()
        group = protocol.pty_group(h.agent.node, start.session_id)
        assert h.agent.channel not in h.layer.groups.get(group, {}), "the failed start left its terminal group joined"

        await h.agent.lifecycle.start(start)  # re-sent: the end is said again, nothing is tried again
        assert statuses(h, start.session_id) == ["PREPARING", "ERROR", "ERROR"]

    run_lifecycle(tmp_path, scenario)


def test_a_starting_session_joins_its_terminal_group_while_it_is_prepared(tmp_path):
    """RUNNING waits for no join of the terminal group after the spawn (issue 35.3: a Redis round
    trip on the distributed stack): the agent is in the group while the spawn still runs."""
    runtime = GatedRuntime(node=f"gated-{uuid.uuid4().hex[:8]}", cgroup_root=CGROUP_NONE)

    async def scenario(h: Harness):
        start = typed_spec(command="sleep 60")
        starting = asyncio.create_task(h.agent.lifecycle.start(start))
        assert await asyncio.to_thread(runtime.entered.wait, TIMEOUT), "the spawn never began"
        group = protocol.pty_group(h.agent.node, start.session_id)
        await wait_until_async(lambda: h.agent.channel in h.layer.groups.get(group, {}), what="the join while it spawns")
        runtime.gate.set()
        await asyncio.wait_for(starting, TIMEOUT)
        assert statuses(h, start.session_id) == ["PREPARING", "RUNNING"]
        await h.agent.lifecycle.stop(start.session_id, reason="terminated")
        assert h.agent.channel not in h.layer.groups.get(group, {}), "the ended session left its terminal group joined"

    run_lifecycle(tmp_path, scenario, runtime=runtime)


def test_a_stop_of_a_session_never_here_says_so_and_says_so_again_when_sent_again(tmp_path):
    async def scenario(h: Harness):
        await h.agent.lifecycle.stop("never-here", reason="terminated")
        await h.agent.lifecycle.stop("never-here", reason="terminated")
        return h.manager.reports_for("never-here")

    expected = ("TERMINATED", "terminated (no process was running)", None)
    assert run_lifecycle(tmp_path, scenario) == [expected, expected]


def test_a_sync_stops_the_sessions_the_manager_no_longer_knows_and_leaves_the_others_running(tmp_path):
    async def scenario(h: Harness):
        kept, dropped = typed_spec(command="sleep 60"), typed_spec(command="sleep 60")
        await asyncio.gather(h.agent.lifecycle.start(kept), h.agent.lifecycle.start(dropped))
        await h.agent.lifecycle.sync({kept.session_id})
        assert h.manager.reports_for(dropped.session_id)[-1][:2] == ("TERMINATED", "the manager no longer knows this session")
        assert list(h.agent.sessions) == [kept.session_id] and statuses(h, kept.session_id) == ["PREPARING", "RUNNING"]
        assert await asyncio.to_thread(h.agent.sessions[kept.session_id].process.alive)

    run_lifecycle(tmp_path, scenario)


def test_a_preemption_notice_is_written_to_the_output_then_signalled_once_per_notice(tmp_path):
    from protocol.channel import PtyPreempt

    async def scenario(h: Harness):
        start = typed_spec(command="trap 'echo got-usr1; exit 7' USR1; echo ready; while :; do sleep 0.05; done")
        await h.agent.lifecycle.start(start)
        running = h.agent.sessions[start.session_id]
        await wait_until_async(lambda: b"ready" in running.pipe.scrollback, timeout=TIMEOUT, interval=0.01, what="ready")
        notice = PtyPreempt(session_id=start.session_id, signal="SIGUSR1", text="preempted by a higher priority",
                            notice="2026-01-01T00:00:00Z")
        h.agent.lifecycle.preempt_notice(running, notice)
        h.agent.lifecycle.preempt_notice(running, notice)  # re-sent every pass while it stands: acted on once
        _, reason, code = await h.manager.wait_for_report(start.session_id, "TERMINATED")
        assert code == 7

        def logged() -> str:  # the session's log (what its terminals were sent too), once its last batch came
            batches = [(text, last) for sid, _, _, text, last in h.manager.logs if sid == start.session_id]
            return "".join(text for text, _ in batches) if any(last for _, last in batches) else ""

        output = await h.manager.wait_for(logged, what="the session's whole log")
        assert output.count("[fgpu: preempted by a higher priority]") == 1
        assert output.index("[fgpu: preempted") < output.index("got-usr1")

    run_lifecycle(tmp_path, scenario)
