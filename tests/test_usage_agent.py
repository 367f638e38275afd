"""Usage samples on the node (agent.usage), for real: a session's program declares a growing GPU
memory use that the mock device reports while another session's stays flat, its CPU and memory
come from its process tree, terminal input is noticed, batches reach the manager (a recording
fake: the manager lives outside the agent's process) and wait while it is unreachable. On real
GPUs the figures come from NVML (the fake pynvml: NVML is outside the process)."""
from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace

import pytest

from agent.usage import BACKLOG_SAMPLES, UsageSample, UsageSampler, read_declaration
from protocol.messages import SessionId, SessionUsage
from tests.conftest import GiB, wait_until_async
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml, FakeProcess
from tests.test_agent_runtime import TIMEOUT, run_agent, start_spec

MiB = 1 << 20


class UsageManager:
    """Records the batches `usage` receives; `fail` makes it refuse them (the broker is down)."""

    def __init__(self):
        self.batches: list[tuple[str, dict]] = []
        self.fail = False

    def usage(self, batch):
        if self.fail:
            raise ConnectionError("broker unreachable")
        sent = batch.encode()  # the task's keyword arguments, as CeleryManager sends them
        self.batches.append((sent["node"], sent["batch"]))


def test_the_declaration_file_gives_memory_and_utilisation_per_device_and_unknown_when_malformed(tmp_path):
    assert read_declaration(tmp_path, 2) == [(0, 0), (0, 0)]  # nothing declared: 0 MiB, 0 %
    (tmp_path / ".fgpu-usage").write_text(json.dumps({"memory": "1536M", "util": 40}))
    assert read_declaration(tmp_path, 2) == [(1536 * MiB, 40), (1536 * MiB, 40)]
    (tmp_path / ".fgpu-usage").write_text(json.dumps({"devices": [{"memory": 1024}, {"memory": "1G", "util": 5}]}))
    assert read_declaration(tmp_path, 2) == [(1024, 0), (GiB, 5)]
    for bad in ("{", json.dumps({"memory": "lots"}), json.dumps({"util": 101}), json.dumps({"memory": -1}), "[1]"):
        (tmp_path / ".fgpu-usage").write_text(bad)
        assert read_declaration(tmp_path, 1) is None, bad


GROW = ("for m in 256 512 768 1024 1280 1536 1792 2048; do printf '{\"memory\": \"%sM\", \"util\": 60}' $m "
        "> .fgpu-usage.tmp && mv .fgpu-usage.tmp .fgpu-usage; sleep 0.3; done; sleep 30")


def test_a_session_that_allocates_in_a_loop_grows_on_the_mock_device_while_another_stays_flat(tmp_path):
    async def scenario(h):
        growing = await h.start_session(start_spec(command=GROW))
        flat = await h.start_session(start_spec(command="sleep 30"))
        sampler = h.agent.usage
        seen, devices = [], []

        async def four_sizes_seen():
            sampler._last_t.clear()  # sample again within the same second
            taken = await asyncio.to_thread(sampler.sample)
            seen.extend(taken.sessions)
            devices[:] = taken.devices
            return len({s.gpu_memory for s in seen if s.session_id == growing}) >= 4

        await wait_until_async(four_sizes_seen, timeout=TIMEOUT, interval=0.35, what="four sizes of the growing session")
        return growing, flat, seen, devices

    growing, flat, seen, devices = run_agent(tmp_path, scenario)

    mine = [s.gpu_memory for s in seen if s.session_id == growing]
    assert mine == sorted(mine) and mine[-1] > mine[0] >= 0 and max(mine) <= 2048 * MiB
    assert {s.gpu_memory for s in seen if s.session_id == flat} == {0}
    assert {s.gpu_util for s in seen if s.session_id == growing} <= {0, 60}
    assert all(s.mem > 0 for s in seen)  # its shell and sleep are resident
    assert devices[0].memory_used == mine[-1] and devices[0].memory_total == 8 * GiB
    assert devices[0].util == 60


def test_terminal_input_is_noticed_and_batches_reach_the_manager_or_wait_for_it(tmp_path):
    manager = UsageManager()

    async def scenario(h):
        session = await h.start_session(start_spec())
        sampler = h.agent.usage
        h.agent.manager.usage = manager.usage  # the recording fake learns the usage call
        await h.type(session, "true\r")
        await wait_until_async(lambda: session in sampler._last_input, timeout=TIMEOUT, interval=0.05,
                               what="the input noticed")
        sampler.pending.append(await asyncio.to_thread(sampler.sample))
        manager.fail = True
        kept = await sampler.flush()
        manager.fail = False
        sent = await sampler.flush()
        return session, kept, sent, len(sampler.pending)

    session, kept, sent, left = run_agent(tmp_path, scenario)

    assert (kept, sent, left) == (False, True, 0)
    (node, batch), = manager.batches
    row, = batch["sessions"]
    assert row["session_id"] == session and row["last_input"] is not None
    assert row["span"] == 5 and row["cpu"] is None  # the first sample: no CPU time to compare with yet
    assert batch["devices"][0]["memory_used"] == 0


def test_a_sample_carries_the_sessions_storage_its_limit_and_its_data_folders_at_the_last_measure(tmp_path):
    from agent.limits import SessionLimits
    from agent.runtimes import CGROUP_AUTO

    limits = SessionLimits(session_storage=64 * MiB, user_data_storage=32 * MiB, project_data_storage=48 * MiB)
    writes = ("head -c 2097152 /dev/zero > home.bin && head -c 3145728 /dev/zero > data/mine.bin && "
              "head -c 1048576 /dev/zero > projects/vision/shared.bin && echo WRITTEN && sleep 300")

    async def scenario(h):
        h.agent.storage.configure(limits)
        spec = {**start_spec(command=writes), "owner_id": 7, "projects": [{"id": "p-77", "name": "vision"}]}
        channel = await h.watch_terminal(spec["session_id"])
        await h.start_session(spec)
        before = (await asyncio.to_thread(h.agent.usage.sample)).sessions  # not measured yet
        await h.read_until(channel, "WRITTEN")
        assert await h.agent.storage.check_now() == []
        h.agent.usage._last_t.clear()  # sample again within the same second
        after = (await asyncio.to_thread(h.agent.usage.sample)).sessions
        return before, after

    before, after = run_agent(tmp_path, scenario, cgroup_root=CGROUP_AUTO, data_root=tmp_path / "data")

    assert (before[0].storage, before[0].storage_limit, before[0].folders) == (None, None, ())
    row, = after
    assert 2 * MiB <= row.storage < 3 * MiB and row.storage_limit == 64 * MiB  # its home, not ~/data
    data, vision = row.folders
    assert data.folder == "~/data" and 3 * MiB <= data.used < 4 * MiB and data.limit == 32 * MiB
    assert vision.folder == "~/projects/vision" and MiB <= vision.used < 2 * MiB and vision.limit == 48 * MiB


def test_the_backlog_keeps_the_newest_samples_while_the_manager_is_unreachable():
    agent = SimpleNamespace(sessions={}, inventory={"devices": []}, mock=True, manager=UsageManager(), node="n")
    sampler = UsageSampler(agent)
    for i in range(BACKLOG_SAMPLES + 5):
        sampler.pending.append(UsageSample(sessions=(SessionUsage(SessionId("s1"), t=i),)))

    assert len(sampler.pending) == BACKLOG_SAMPLES and sampler.pending[0].sessions[0].t == 5


def test_on_real_gpus_nvml_gives_each_session_the_memory_of_its_own_processes(tmp_path):
    uuid_a, uuid_b = "GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000"
    mine, other = os.getpid(), 4_000_000  # a pid of the session, and one of nobody's
    fake = FakeNvml([FakeGpu(uuid=uuid_a, utilization=70, processes=[FakeProcess(pid=mine, used_memory=3 * GiB),
                                                                     FakeProcess(pid=other, used_memory=GiB)]),
                     FakeGpu(uuid=uuid_b, utilization=10)])
    inventory = {"devices": [{"device_id": uuid_a, "memory_size": 80 * GiB}, {"device_id": uuid_b, "memory_size": 80 * GiB}]}
    running = SimpleNamespace(process=SimpleNamespace(pid=None, session_id="s1"), work_dir=tmp_path,
                              env={"CUDA_VISIBLE_DEVICES": uuid_a})
    agent = SimpleNamespace(sessions={"s1": running}, inventory=inventory, mock=False, manager=None, node="n")
    sampler = UsageSampler(agent, nvml=fake)

    gpu, devices = sampler._nvml_gpu({"s1": running}, {"s1": {mine}}, 1000)

    assert gpu == {"s1": (3 * GiB, 70)}  # alone among the sessions on the GPU: its utilisation is the GPU's
    assert [(d.device, d.util) for d in devices] == [(uuid_a, 70), (uuid_b, 10)]
    assert devices[0].memory_used >= 4 * GiB  # the device counts every process, the session only its own


@pytest.mark.parametrize("text, problem", [("interval = 0", "usage.interval"), ("flush = true", "usage.flush")])
def test_agent_toml_refuses_a_bad_usage_interval_naming_the_key(tmp_path, text, problem):
    from agent.config import AgentConfigError, load_agent_config

    path = tmp_path / "agent.toml"
    path.write_text(f'[agent]\nid = "n1"\nallowed-compute-plugins = ["ai.backend.accelerator.cuda"]\n[usage]\n{text}\n')
    with pytest.raises(AgentConfigError, match=problem):
        load_agent_config(path)
    path.write_text('[agent]\nid = "n1"\nallowed-compute-plugins = ["ai.backend.accelerator.cuda"]\n'
                    '[usage]\ninterval = 2\nflush = 10\n')
    config = load_agent_config(path)
    assert (config.usage_interval_s, config.usage_flush_s) == (2, 10)
