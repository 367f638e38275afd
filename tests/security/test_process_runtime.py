"""Attacks from inside a process-runtime session (issue 31, item 2), each run as a non-administrator
by a real agent with real bubblewrap: each test fails if its attack succeeds.

The session types into its own terminal, as a user would; what it prints is read back. A marker
file beside the agent's scratch root stands for the console's data directory (FGPU_DATA_DIR: the
SQLite database, other sessions' homes) and an agent.toml with a secret stands for the agent's."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess

import pytest

from agent.runtimes import ProcessRuntime
from agent.sandbox import SandboxError
from tests.test_agent_runtime import Harness, run_agent, start_spec, typed_spec

SECRET = "fgpu-h1-secret-7c1e"


def non_admin_spec(**options) -> dict:
    return {**start_spec(**options), "owner_is_staff": False}


async def shell(h: Harness, session_id: str, channel: str, command: str, tag: str) -> str:
    """Type `command` into the session's shell, then read until `tag`'s answer line."""
    await h.type(session_id, f"{command}; echo {tag}-$((40 + 2))\r")
    return await h.read_until(channel, f"{tag}-42")


@pytest.fixture
def bait(tmp_path):
    """A console data directory's secrets beside the agent's scratch root: an agent.toml with a
    node key and a database file."""
    (tmp_path / "agent.toml").write_text(f'[manager]\nnode-key = "{SECRET}"\n')
    (tmp_path / "db.sqlite3").write_text(SECRET)
    return tmp_path


def test_a_session_is_not_root_has_no_capabilities_and_is_not_the_agents_user(bait):
    async def scenario(h: Harness):
        session_id = await h.start_session(non_admin_spec())
        channel = await h.watch_terminal(session_id)
        output = await shell(h, session_id, channel, 'echo "uid=$(id -u)"; grep CapEff /proc/self/status', "who")
        uid = int(re.search(r"uid=(\d+)", output)[1])
        assert uid != 0, "the session runs as root"
        assert uid != os.geteuid(), "the session runs as the agent's user"
        assert re.search(r"CapEff:\s+0000000000000000", output), output

    run_agent(bait, scenario)


def test_a_session_cannot_read_the_agents_config_the_consoles_data_or_the_docker_socket(bait):
    async def scenario(h: Harness):
        session_id = await h.start_session(non_admin_spec())
        channel = await h.watch_terminal(session_id)
        paths = [bait / "agent.toml", bait / "db.sqlite3", "/var/run/docker.sock", "/run/docker.sock"]
        command = "; ".join(f'cat {p} 2>/dev/null; test -e {p} && echo "pre""sent:{p}"' for p in paths)
        output = await shell(h, session_id, channel, command, "files")
        assert SECRET not in output, "the session read a secret of the node"
        assert "present:" not in output, output

    run_agent(bait, scenario)


def test_a_session_cannot_see_another_sessions_home(bait):
    async def scenario(h: Harness):
        first = await h.start_session(non_admin_spec())
        second = await h.start_session(non_admin_spec())
        (bait / "scratch" / first / "notes.txt").write_text(SECRET)
        channel = await h.watch_terminal(second)
        scratch = bait / "scratch"
        command = f'cat {scratch / first / "notes.txt"}; echo "homes=$(ls {scratch} | wc -l)"'
        output = await shell(h, second, channel, command, "other")
        assert SECRET not in output, "a session read another session's home"
        assert re.search(r"homes=1\b", output), f"a session sees other sessions' homes: {output}"

    run_agent(bait, scenario)


def test_a_session_sees_only_its_own_processes(bait):
    async def scenario(h: Harness):
        session_id = await h.start_session(non_admin_spec())
        channel = await h.watch_terminal(session_id)
        output = await shell(h, session_id, channel, 'echo "count=$(ls /proc | grep -c "^[0-9]")"', "procs")
        count = int(re.search(r"count=(\d+)", output)[1])
        assert count <= 6, f"the session sees {count} processes: the node's, not only its own"
        agent_pid = os.getpid()
        command = f'echo "vars=$(cat /proc/{agent_pid}/environ 2>/dev/null | tr "\\0" "\\n" | grep -c =)"'
        output = await shell(h, session_id, channel, command, "env")
        assert re.search(r"vars=0\b", output), f"the session read the agent's environment: {output}"

    run_agent(bait, scenario)


def test_a_session_cannot_connect_to_redis_or_a_port_of_the_node(bait):
    async def scenario(h: Harness):
        session_id = await h.start_session(non_admin_spec())
        channel = await h.watch_terminal(session_id)
        for port in (6379, 5432):
            command = f'(exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo "rea""ched-{port}"'
            output = await shell(h, session_id, channel, command, f"tcp{port}")
            assert f"reached-{port}" not in output, f"the session connected to 127.0.0.1:{port}"
        output = await shell(h, session_id, channel, 'echo "routes=$(cat /proc/net/route | wc -l)"', "net")
        assert re.search(r"routes=1\b", output), f"the session has a route out: {output}"  # the header line only

    run_agent(bait, scenario)


def test_the_virtual_nvidia_smi_still_prints_the_granted_slice_inside_the_sandbox(bait):
    async def scenario(h: Harness):
        session_id = await h.start_session(non_admin_spec())
        channel = await h.watch_terminal(session_id)
        await h.type(session_id, "nvidia-smi\r")
        output = await h.read_until(channel, "SMs")
        assert re.search(r"\b0MiB /\s+2048MiB\b", output), output
        assert "20 of 80 SMs" in output

    run_agent(bait, scenario)


def test_exec_beside_a_session_runs_inside_its_sandbox(bait):
    async def scenario(h: Harness):
        session_id = await h.start_session(non_admin_spec())
        handle = h.agent.sessions[session_id].process
        assert handle.sandbox is not None

        script = "id -u; readlink /proc/self/ns/pid; grep CapEff /proc/self/status; pwd; cat $0"

        def run() -> str:
            process = handle.exec_popen(
                ["/bin/sh", "-c", script, str(bait / "agent.toml")],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            return process.communicate(timeout=30)[0].decode()

        output = await asyncio.to_thread(run)
        lines = output.splitlines()
        assert len(lines) >= 4, output
        assert lines[0] not in ("0", str(os.geteuid())), f"exec ran as {lines[0]}"
        assert lines[1] == os.readlink(f"/proc/{handle.init_pid}/ns/pid"), "exec ran outside the session's PID namespace"
        assert re.search(r"CapEff:\s+0000000000000000", output), output
        assert lines[3] == str(bait / "scratch" / session_id)
        assert SECRET not in output, "exec read the agent's config"

    run_agent(bait, scenario)


def test_an_exec_cannot_climb_from_its_working_directory_into_the_nodes_file_system(bait):
    """An exec starts in the session's home. Were that directory the node's (nsenter --wd opens it
    before entering the sandbox), `..` would climb the node's tree past the sandbox's root:
    from a home under a folder all may search (0755 here, as many data directories are) to the
    agent's config beside it. It must find only what the sandbox shows."""
    bait.chmod(0o755)
    (bait / "scratch").mkdir(mode=0o755, exist_ok=True)
    (bait / "scratch").chmod(0o755)

    async def scenario(h: Harness):
        session_id = await h.start_session(non_admin_spec())
        handle = h.agent.sessions[session_id].process
        assert handle.sandbox is not None

        def run() -> str:
            process = handle.exec_popen(["/bin/sh", "-c", "ls -a ../..; cat ../../agent.toml"],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            return process.communicate(timeout=30)[0].decode()

        output = await asyncio.to_thread(run)
        assert SECRET not in output, f"exec climbed out of its sandbox: {output}"
        assert "db.sqlite3" not in output, f"exec listed the node's folder: {output}"

    run_agent(bait, scenario)


def test_an_exec_the_moment_a_session_started_finds_its_sandbox_set_up_not_the_node(bait):
    """bwrap names its sandbox's init before the init has mapped its user and moved into its new
    root: an exec that entered it then would run with the node's file system. The runtime's spawn
    returns only once the sandbox is set up; an exec started at that moment, five times over,
    runs as the session's user and reads nothing of the node."""
    runtime = ProcessRuntime(node=f"test-node-race-{os.getpid()}")
    runtime.clean_up_at_start(bait / "scratch")
    try:
        for attempt in range(5):
            work_dir = bait / "scratch" / f"race-{attempt}"
            work_dir.mkdir(parents=True)
            spec = typed_spec(owner_is_staff=False, session_id=f"race-{attempt}")
            handle = runtime.spawn(spec=spec, argv=["sleep", "30"], env={"PATH": "/usr/bin:/bin"}, work_dir=work_dir)
            try:
                assert handle.sandbox is not None, runtime.unconfined_why
                process = handle.exec_popen(["/bin/sh", "-c", f"id -u; cat {bait / 'agent.toml'}"],
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                output = process.communicate(timeout=30)[0].decode()
                assert SECRET not in output, f"an exec at the session's start read the agent's config: {output}"
                assert output.splitlines()[0] == str(handle.sandbox.uid), f"the exec did not run as the session: {output}"
            finally:
                handle.kill_all()
                handle.wait()
                handle.remove()
                handle.close_stream()
    finally:
        runtime.release_now()


def test_without_a_sandbox_a_non_administrators_session_is_refused_and_an_administrators_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap to be found: as on a node without bubblewrap
    runtime = ProcessRuntime(node="h1-refuse", cgroup_root="none")
    assert runtime.confine() is None
    assert "bwrap" in runtime.unconfined_why
    work_dir = tmp_path / "home"
    work_dir.mkdir()
    with pytest.raises(SandboxError, match="only administrators' sessions"):
        runtime.spawn(spec=typed_spec(owner_is_staff=False), argv=["/bin/true"], env={"PATH": "/usr/bin:/bin"}, work_dir=work_dir)
    handle = runtime.spawn(
        spec=typed_spec(owner_is_staff=True), argv=["/bin/true"], env={"PATH": "/usr/bin:/bin"}, work_dir=work_dir
    )
    assert handle.wait() == 0
    handle.remove()


def test_an_agent_that_requires_bubblewrap_refuses_to_start_without_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    runtime = ProcessRuntime(node="h1-required", cgroup_root="none", sandbox="bubblewrap")
    with pytest.raises(SandboxError, match="bwrap"):
        runtime.clean_up_at_start(tmp_path)
