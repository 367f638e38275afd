"""Attacks on a node's resources from inside a process-runtime session (issue 31, items 2, 6 and 9):
each test runs the attack as a session's program through a real agent and fails if it succeeds.

- allocate past the session's memory (asked, or the default where none is asked): the kernel's
  OOM killer ends it, and the agent says why;
- a fork bomb (bounded: 10,000 forks of `sleep 30`): held at the session's pids and, with a
  second session doing the same, at the node's cap on all sessions together, while the host
  starts a process at once.

Real agents, real processes, real cgroups (this machine and CI's: cgroup v1 controllers beside a
controller-less cgroup2)."""
from __future__ import annotations

import asyncio
import re
import subprocess
import time
from functools import partial

import pytest

from agent import runtimes
from agent.limits import SessionLimits
from agent.runtimes import CGROUP_AUTO
from tests.test_agent_runtime import Harness, run_agent, start_spec
from tests.test_session_limits import FORK_BOMB
from protocol.messages import StartSpec

MiB = 1 << 20
GREEDY = "python3 -c \"b = b'x' * (256 << 20); print('SURVIVED')\""


@pytest.fixture
def small_limits(monkeypatch):
    """The agent's [limits] as an operator would set them small: 64 MiB by default, 64 pids a
    session, 100 for all sessions together."""
    monkeypatch.setattr(runtimes, "SessionLimits", partial(SessionLimits, default_memory=64 * MiB, session_pids=64,
                                                           node_pids=100))


async def ended(h: Harness, spec: dict) -> tuple[str, str]:
    """Start `spec`, return (its terminal output, the reason of its TERMINATED report)."""
    channel = await h.watch_terminal(spec["session_id"])
    await asyncio.to_thread(h.agent.submit_start, StartSpec.decode(spec))
    _, reason, _ = await h.manager.wait_for_report(spec["session_id"], "TERMINATED")
    output = ""
    while True:
        try:
            message = await asyncio.wait_for(h.layer.receive(channel), timeout=0.5)
        except TimeoutError:
            return output, reason
        output += message.get("data", "")


@pytest.mark.parametrize("asked", [64 * MiB, 0], ids=["asked-64MiB", "default-64MiB"])
def test_a_session_cannot_allocate_past_its_memory(tmp_path, small_limits, asked):
    async def scenario(h: Harness):
        spec = {**start_spec(command=GREEDY), "mem": asked}
        output, reason = await ended(h, spec)
        assert "SURVIVED" not in output, "the session held 256 MiB past its 64 MiB"
        assert "out of memory at its 64 MiB limit" in reason, reason

    run_agent(tmp_path, scenario, cgroup_root=CGROUP_AUTO)


def test_a_fork_bomb_in_two_sessions_stays_under_their_pids_and_the_node_s_and_the_host_responds(tmp_path, small_limits):
    command = " ".join([FORK_BOMB[0], FORK_BOMB[1], "'" + FORK_BOMB[2] + "'"])

    async def scenario(h: Harness):
        specs = [start_spec(command=command), start_spec(command=command)]
        channels = [await h.watch_terminal(spec["session_id"]) for spec in specs]
        for spec in specs:
            await h.start_session(spec)
        outputs = [await h.read_until(channel, "\n", timeout=120) for channel in channels]
        started = time.monotonic()
        await asyncio.to_thread(subprocess.run, ["true"], check=True, timeout=10)
        assert time.monotonic() - started < 2.0, "the host did not start a process in 2 s"
        forked = [int(output.split()[0]) for output in outputs]
        assert all(n <= 63 for n in forked), f"a session forked past its 64 pids: {forked}"
        assert sum(forked) + 2 <= 100, f"the sessions together passed the node's 100 pids: {forked}"
        for spec in specs:
            await asyncio.to_thread(h.agent.submit_stop, spec["session_id"])
            await h.manager.wait_for_report(spec["session_id"], "TERMINATED")

    run_agent(tmp_path, scenario, cgroup_root=CGROUP_AUTO)


# --- the docker runtime: the same attacks from inside a container ----------------------------------

from tests.test_docker_runtime import TEST_IMAGE, run_docker  # noqa: E402

DOCKER_LIMITS = SessionLimits(default_memory=64 * MiB, session_pids=64, node_pids=100, session_storage=8 * MiB)


@pytest.fixture(scope="module")
def docker_engine():
    """Docker Engine on this machine and its session image (tests/images/build.sh). Missing on CI is
    a failure, never a skip (.ci/run starts it and builds the image)."""
    import docker

    try:
        client = docker.from_env()
        client.ping()
        client.images.get(TEST_IMAGE)
    except Exception as exc:
        pytest.fail(f"Docker Engine or image {TEST_IMAGE} is missing ({exc}); .ci/run provides both")
    return client


def test_a_container_that_asks_no_memory_cannot_allocate_past_the_default(tmp_path, docker_engine):
    async def scenario(h: Harness):
        spec = {**start_spec(command=GREEDY), "mem": 0}
        output, reason = await ended(h, spec)
        assert "SURVIVED" not in output, "the container held 256 MiB past the 64 MiB default"
        assert "out of memory at its 64 MiB limit" in reason, reason

    run_docker(tmp_path, docker_engine, TEST_IMAGE, scenario, limits=DOCKER_LIMITS)


def test_a_fork_bomb_in_two_containers_stays_under_their_pids_and_the_node_s(tmp_path, docker_engine):
    command = " ".join([FORK_BOMB[0], FORK_BOMB[1], "'" + FORK_BOMB[2] + "'"])

    async def scenario(h: Harness):
        assert h.agent.runtime.cgroup_parent, "the containers have no parent cgroup of the agent's"
        specs = [start_spec(command=command), start_spec(command=command)]
        channels = [await h.watch_terminal(spec["session_id"]) for spec in specs]
        for spec in specs:
            await h.start_session(spec)
        outputs = [await h.read_until(channel, "\n", timeout=120) for channel in channels]
        started = time.monotonic()
        await asyncio.to_thread(subprocess.run, ["true"], check=True, timeout=10)
        assert time.monotonic() - started < 2.0, "the host did not start a process in 2 s"
        forked = [int(output.split()[0]) for output in outputs]
        assert all(n <= 63 for n in forked), f"a container forked past its 64 pids: {forked}"
        # Each container also holds its init (docker-init) and perl: the node's 100 is everything.
        assert sum(forked) + 4 <= 100, f"the containers together passed the node's 100 pids: {forked}"
        for spec in specs:
            await asyncio.to_thread(h.agent.submit_stop, spec["session_id"])
            await h.manager.wait_for_report(spec["session_id"], "TERMINATED")

    run_docker(tmp_path, docker_engine, TEST_IMAGE, scenario, limits=DOCKER_LIMITS)


def test_a_container_that_fills_its_writable_layer_is_stopped(tmp_path, docker_engine):
    async def scenario(h: Harness):
        h.agent.storage.configure(DOCKER_LIMITS)
        spec = start_spec(command="head -c 20971520 /dev/zero > /tmp/big && echo WRITTEN && sleep 300")
        channel = await h.watch_terminal(spec["session_id"])
        await h.start_session(spec)
        await h.read_until(channel, "WRITTEN")
        [(session_id, reason)] = await h.agent.storage.check_now()
        assert session_id == spec["session_id"]
        assert re.fullmatch(r"used 20(\.\d)? MiB of its 8 MiB storage limit \(home and container layer\)", reason), reason
        _, reported, _ = await h.manager.wait_for_report(spec["session_id"], "TERMINATED")
        assert reported == reason

    run_docker(tmp_path, docker_engine, TEST_IMAGE, scenario, limits=DOCKER_LIMITS)
