"""The agent's side of a preemption notice (issue 32.2), on a real Agent with each runtime: a
`pty.preempt` command (protocol.channel.PtyPreempt) puts its line into the session's log (what
`fgpu logs` reads) before the program's own reaction, and delivers the signal to the session's
program — the process runtime to its command's process group (in each way of tracking processes),
the docker runtime to its container — once per notice, however often the manager re-sends it."""
from __future__ import annotations

import pytest

from protocol.channel import PtyPreempt
from tests.test_agent_runtime import Harness, process_tracking, run_agent, start_spec  # noqa: F401 (a fixture)
from tests.test_docker_runtime import docker_client, run_docker, test_image  # noqa: F401 (fixtures)

# Says which signal it got, and goes on working (as a job that checkpoints on the notice would).
REPORTER = (
    "python3 -u -c 'import signal, time\n"
    "def got(n, f): print(\"got \" + signal.Signals(n).name, flush=True)\n"
    "signal.signal(signal.SIGUSR1, got)\n"
    "print(\"training started\", flush=True)\n"
    "while True: time.sleep(0.1)'"
)


def logged(h: Harness, session_id: str) -> str:
    return "".join(text for sid, _seq, _offset, text, _final in h.manager.logs if sid == session_id)


async def notice_scenario(h: Harness) -> tuple[str, bool]:
    session_id = await h.start_session(start_spec(command=REPORTER))
    await h.manager.wait_for(lambda: "training started" in logged(h, session_id), what="the job to start")
    notice = PtyPreempt(session_id=session_id, signal="SIGUSR1", text="preemption notice at 01:00:00 UTC, SIGUSR1 sent",
                        notice="2026-11-28T01:05:00+00:00").to_dict()
    for _ in range(3):  # every pass re-sends it
        await h.to_pty(session_id, notice)
    await h.manager.wait_for(lambda: "got SIGUSR1" in logged(h, session_id), what="the signal in the log")
    await h.to_pty(session_id, {**notice, "notice": "2026-11-28T02:05:00+00:00"})  # a later notice: heard again
    await h.manager.wait_for(lambda: logged(h, session_id).count("got SIGUSR1") == 2, what="the second notice's signal")
    assert h.agent.sessions[session_id] is not None  # it runs on through its grace
    running = h.agent.sessions[session_id].process
    return logged(h, session_id), getattr(running, "sandbox", None) is not None


def check(log: str, _sandboxed: bool = False) -> None:
    first = log.index("[fgpu: preemption notice at 01:00:00 UTC, SIGUSR1 sent]")
    assert first < log.index("got SIGUSR1")  # the notice line first, then what the program printed
    assert log.count("[fgpu: preemption notice") == 2 and log.count("got SIGUSR1") == 2  # once per notice


@pytest.mark.parametrize("sandbox", ["auto", "none"])  # in its bubblewrap sandbox (this machine has it), and without one
def test_the_process_runtime_logs_the_notice_and_signals_the_command_once_per_notice(tmp_path, sandbox):
    log, sandboxed = run_agent(tmp_path, notice_scenario, runtime_options={"sandbox": sandbox})
    assert sandboxed == (sandbox == "auto")
    check(log)


@pytest.mark.docker
def test_the_docker_runtime_logs_the_notice_and_signals_the_container_once_per_notice(tmp_path, docker_client, test_image):
    check(*run_docker(tmp_path, docker_client, test_image, notice_scenario))
