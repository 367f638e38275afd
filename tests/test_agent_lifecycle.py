"""agent.lifecycle alone: a session's spawn stage by stage with the real process runtime (every
stage but the last, which starts the process: tests/test_agent_runtime.py runs it whole), and the
stop's signalling against a recording stand-in of a session's processes, on an event loop, with
no agent, manager or channel layer."""

from __future__ import annotations

import asyncio
import json
import signal

from agent import lifecycle
from agent.runtimes import CGROUP_NONE, ProcessRuntime
from protocol.messages import StartSpec
from tests.test_agent_runtime import start_spec


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
    spec = lifecycle.runtime_spec(start, folders)
    env = lifecycle.stage_environment(here, start, spec, work)
    argv = lifecycle.stage_command(here, start)

    assert work.path == tmp_path / "scratch" / start.session_id and work.bin_dir.is_dir()
    assert [d["uuid"] for d in document["devices"]] == [start.devices[0].hardware_id]
    assert (work.bin_dir / "nvidia-smi").exists()
    assert folders == lifecycle.Folders(None, {}) and spec["data_dir"] == "" and spec["project_dirs"] == {}
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
    assert folders.data_dir is not None and folders.data_dir.is_dir()
    assert lifecycle.runtime_spec(start, folders)["data_dir"] == str(folders.data_dir)


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
