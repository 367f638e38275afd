"""The agent's side of session logs and server-side exec: output shipped to the manager in
sequence-numbered batches (the last one marked final, sent as TERMINATED is reported), and
`pty.exec` messages answered with the command's status and output, run in the session's
environment. A real Agent on Channels' in-memory layer; the manager is a recording fake."""
from __future__ import annotations

import asyncio

from tests.conftest import wait_until_async
from tests.test_agent_runtime import TIMEOUT, process_tracking, run_agent, start_spec  # noqa: F401 (both ways of tracking)


async def ended_and_shipped(h, session_id: str) -> None:
    """Until the agent reported the session TERMINATED and shipped its log's final batch (the
    two go to the manager side by side)."""
    await h.manager.wait_for_report(session_id, "TERMINATED")
    await h.manager.wait_for(lambda: any(e[0] == session_id and e[4] for e in h.manager.logs), what="the final batch")


def shipped_text(logs, session_id) -> str:
    batches = sorted((seq, offset, text) for sid, seq, offset, text, _ in logs if sid == session_id)
    return "".join(text for _, _, text in batches)


async def exec_in(h, session_id: str, argv, timeout: float = 10) -> dict:
    reply = await h.layer.new_channel("test-exec.")
    await h.to_pty(session_id, {"type": "pty.exec", "argv": argv, "timeout": timeout, "reply_channel": reply})
    async with asyncio.timeout(TIMEOUT):
        return await h.layer.receive(reply)


def test_a_batch_sessions_output_is_shipped_in_numbered_batches_ending_with_a_final_one_as_it_ends(tmp_path):
    async def scenario(h):
        spec = start_spec(command="for i in 1 2 3; do echo line-$i; done")
        await h.start_session(spec)
        await ended_and_shipped(h, spec["session_id"])
        return spec["session_id"], list(h.manager.logs), list(h.manager.reports)

    session_id, logs, reports = run_agent(tmp_path, scenario)

    mine = [entry for entry in logs if entry[0] == session_id]
    assert [seq for _, seq, _, _, _ in mine] == list(range(len(mine)))
    offsets = [offset for _, _, offset, _, _ in mine]
    assert offsets == [sum(len(t) for _, _, _, t, _ in mine[:i]) for i in range(len(mine))]
    assert [final for *_, final in mine] == [False] * (len(mine) - 1) + [True]
    assert "line-1\r\nline-2\r\nline-3\r\n" in shipped_text(logs, session_id)


def test_an_interactive_sessions_output_is_shipped_while_it_runs(tmp_path):
    async def scenario(h):
        session_id = await h.start_session(start_spec())
        await h.type(session_id, "echo shipped-$((6*7))\r")
        await h.manager.wait_for(lambda: "shipped-42" in shipped_text(h.manager.logs, session_id),
                                 what="the echo in the shipped log")
        return [entry for entry in h.manager.logs if entry[0] == session_id]

    mine = run_agent(tmp_path, scenario)

    assert not any(final for *_, final in mine)


def test_exec_runs_a_command_in_the_sessions_environment_and_working_directory(tmp_path):
    async def scenario(h):
        session_id = await h.start_session(start_spec(command="sleep 30"))
        smi = await exec_in(h, session_id, ["nvidia-smi"])
        env = await exec_in(h, session_id, "echo $FGPU_SESSION_ID $CUDA_DEVICE_SM_LIMIT; pwd; echo oops >&2; exit 3")
        return session_id, smi, env

    session_id, smi, env = run_agent(tmp_path, scenario)

    assert smi["exit_code"] == 0 and "2048MiB" in smi["stdout"], smi
    assert env["exit_code"] == 3
    assert env["stdout"].splitlines() == [f"{session_id} 25", str(tmp_path / "scratch" / session_id)]
    assert env["stderr"] == "oops\n"
    assert env["timed_out"] is False and env["truncated"] is False


def test_exec_kills_a_command_that_runs_past_its_timeout_and_says_so(tmp_path):
    async def scenario(h):
        session_id = await h.start_session(start_spec())
        return await exec_in(h, session_id, "echo started; sleep 30", timeout=0.5)

    result = run_agent(tmp_path, scenario)

    assert result["timed_out"] is True
    assert result["stdout"] == "started\n"
    assert result["exit_code"] == 128 + 9


def test_exec_of_a_missing_program_answers_127_like_a_shell(tmp_path):
    async def scenario(h):
        session_id = await h.start_session(start_spec())
        return await exec_in(h, session_id, ["no-such-program-here"])

    result = run_agent(tmp_path, scenario)

    assert result["exit_code"] == 127
    assert "no-such-program-here" in result["stderr"]


def test_a_batch_the_manager_did_not_take_is_sent_again_with_the_same_number(tmp_path, monkeypatch):
    from tests.test_agent_runtime import RecordingManager

    refusals = {"left": 2}
    record = RecordingManager.log

    def flaky_log(self, *args):
        if refusals["left"]:
            refusals["left"] -= 1
            raise ConnectionError("broker down")
        record(self, *args)

    monkeypatch.setattr(RecordingManager, "log", flaky_log)

    async def scenario(h):
        spec = start_spec(command="echo first; sleep 1.5; echo second")
        await h.start_session(spec)
        await ended_and_shipped(h, spec["session_id"])
        return spec["session_id"], list(h.manager.logs)

    session_id, logs = run_agent(tmp_path, scenario)

    mine = [entry for entry in logs if entry[0] == session_id]
    assert [seq for _, seq, _, _, _ in mine] == list(range(len(mine)))  # none lost, none twice
    assert shipped_text(logs, session_id) == "first\r\nsecond\r\n"
    assert refusals["left"] == 0


def test_unshipped_output_beyond_the_backlog_cap_is_dropped_oldest_first_and_offsets_move_on():
    from agent.log_shipper import LogLimits, SessionLog

    log = SessionLog(limits=LogLimits(backlog_chars=10, chunk_chars=4))
    log.pending, log.pending_chars, log.offset = ["abcdef", "ghijklmnop"], 16, 100

    batches = [log.next_batch(final=True) for _ in range(3)]

    assert batches == [(0, 106, "ghij", False), (1, 110, "klmn", False), (2, 114, "op", True)]


def test_a_command_still_running_when_its_session_stops_is_killed_with_it(tmp_path):
    async def scenario(h):
        session_id = await h.start_session(start_spec())
        reply = await h.layer.new_channel("test-exec.")
        await h.to_pty(session_id, {"type": "pty.exec", "argv": "sleep 60", "timeout": 120, "reply_channel": reply})
        await wait_until_async(lambda: h.agent.sessions[session_id].execs, timeout=TIMEOUT, interval=0.02,
                               what="the command running")
        await asyncio.to_thread(h.agent.submit_stop, session_id)
        async with asyncio.timeout(TIMEOUT):
            result = await h.layer.receive(reply)
        await h.manager.wait_for_report(session_id, "TERMINATED")
        return result

    result = run_agent(tmp_path, scenario)

    assert result["exit_code"] == 128 + 9 and result["timed_out"] is False


def test_a_long_running_session_keeps_taking_commands_after_the_layers_group_expiry(tmp_path):
    """The agent re-joins each session's pty group with every heartbeat; here the layer forgets
    memberships after 1 s and heartbeats come every 0.2 s (the wait wakes on each heartbeat)."""
    import uuid

    from channels.layers import InMemoryChannelLayer

    from agent.core import Agent
    from tests.test_agent_runtime import DEVICE, GiB, Harness, RecordingManager

    async def main():
        layer = InMemoryChannelLayer(group_expiry=1)
        manager = RecordingManager(asyncio.get_running_loop())
        inventory = {"devices": [DEVICE.as_dict()], "plugins": [], "attributes": {}, "cpu_count": 8,
                     "memory_size": 32 * GiB}
        agent = Agent(node=f"test-node-{uuid.uuid4().hex[:8]}", inventory=inventory, channel_layer=layer,
                      manager=manager, scratch_root=tmp_path / "scratch", mock=True, heartbeat_s=0.2)
        await agent.start()
        try:
            h = Harness(agent, manager, layer)
            session_id = await h.start_session(start_spec())
            joined = asyncio.get_running_loop().time()
            # The layer compares whole seconds: a membership is gone 2 s after joining at the latest.
            await manager.wait_for(lambda: asyncio.get_running_loop().time() - joined > 2.5 and manager.heartbeats,
                                   what="heartbeats past the expiry")
            return await exec_in(h, session_id, "echo still-here")
        finally:
            await agent.shutdown()

    result = asyncio.run(main())

    assert result["stdout"] == "still-here\n"
