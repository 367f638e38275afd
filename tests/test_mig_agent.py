"""The agent's MIG manager against the fake NVML (placements, remaining capacity, IN_USE while a
process is attached, permissions, MIG mode) and against the mock node's in-memory layout."""
from __future__ import annotations

import dataclasses

import pynvml
import pytest

from accelerators.allocation import mig
from accelerators.plugins import cuda, cuda_mig
from agent import mig as runtime_mig
from protocol.environment import session_environment
from protocol.messages import HardwareId, MigBlock, MigPlacement, StartSpec
from protocol.mig_messages import MigGpu, MigReconcile
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml, FakeProcess

GiB = 1 << 30
H100 = "GPU-11111111-2222-3333-4444-555555555555"


def h100(**kwargs) -> FakeGpu:
    options = dict(uuid=H100, name="NVIDIA H100 80GB HBM3", memory_total=80 * GiB, sm_count=132,
                   architecture=pynvml.NVML_DEVICE_ARCH_HOPPER, compute_capability=(9, 0),
                   mig_mode=pynvml.NVML_DEVICE_MIG_ENABLE, mig_model="H100-80GB")
    options.update(kwargs)
    return FakeGpu(**options)


def block(profile: str, start: int, **extra) -> dict:
    return {"gpu": H100, "model_name": "NVIDIA H100 80GB HBM3", "memory_size": 80 * GiB, "subproc_count": 132,
            "profile": profile, "start": start, **extra}


def mig_block(profile: str, start: int, **extra) -> MigBlock:
    """`block` as a start spec's MIG block, decoded as the agent decodes it."""
    return MigBlock.decode(block(profile, start, **extra))


def layout(expected: dict[str, list[dict]]) -> dict[HardwareId, tuple[MigPlacement, ...]]:
    """{GPU: [{"profile", "start"}]} as a MigReconcile carries it (protocol.mig_messages.Layout)."""
    return {HardwareId(gpu): tuple(MigPlacement.decode(item) for item in items) for gpu, items in expected.items()}


def reconcile_message(gpus: list[dict], expected: dict[str, list[dict]], **how) -> MigReconcile:
    """The `fgpu.agent.mig_reconcile` message of `gpus` (blocks) and `expected`, as the agent decodes it."""
    return MigReconcile.decode({"node": "mig-node", "gpus": gpus, "expected": expected, **how})


def manager_for(fake: FakeNvml) -> runtime_mig.MigManager:
    return runtime_mig.MigManager(runtime_mig.NvmlMigBackend(fake))


def test_the_catalog_read_from_nvml_matches_the_built_in_table():
    fake = FakeNvml([h100()])
    fake.nvmlInit()
    catalog = cuda_mig.catalog_from_nvml(fake, fake.nvmlDeviceGetHandleByIndex(0), model="H100", memory_total=80 * GiB)
    built_in = mig.CATALOGS["H100-80GB"]
    assert [(p.name, p.starts, p.size, p.max_instances, p.memory, p.profile_id) for p in catalog.profiles] == \
           [(p.name, p.starts, p.size, p.max_instances, p.memory, p.profile_id) for p in built_in.profiles]


def test_a_created_instance_has_its_placement_and_a_mig_device_uuid_nvml_reports():
    fake = FakeNvml([h100()])
    instance = manager_for(fake).prepare(mig_block("1g.20gb", 6))
    assert instance.uuid.startswith("MIG-") and instance.start == 6 and instance.memory == 20096 << 20
    gpu = fake.gpus[0]
    assert [(gi.profile.name, gi.start) for gi in gpu.gpu_instances] == [("1g.20gb", 6)]
    inventory = cuda.load(nvml=fake)
    mig_devices = [d for d in inventory.devices if d.is_mig_device]
    assert [(d.device_id, d.mig_profile, d.parent_device_id) for d in mig_devices] == [(instance.uuid, "1g.20gb", H100)]


def test_remaining_capacity_counts_what_still_fits():
    fake = FakeNvml([h100()])
    manager_for(fake).prepare(mig_block("3g.40gb", 4))
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, mig.CATALOGS["H100-80GB"].profile("1g.10gb").profile_id) == 4
    assert fake.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, mig.CATALOGS["H100-80GB"].profile("4g.40gb").profile_id) == 1
    assert fake.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, mig.CATALOGS["H100-80GB"].profile("7g.80gb").profile_id) == 0


def test_an_existing_instance_of_the_profile_is_reused_not_created_again():
    fake = FakeNvml([h100()])
    manager = manager_for(fake)
    first = manager.prepare(mig_block("1g.20gb", 6))
    again = manager.prepare(mig_block("1g.20gb", 6, reuse=True))
    assert again.uuid == first.uuid and len(fake.gpus[0].gpu_instances) == 1


def test_idle_instances_named_in_the_plan_are_destroyed_compute_instance_first():
    fake = FakeNvml([h100()])
    manager = manager_for(fake)
    manager.prepare(mig_block("7g.80gb", 0))
    made = manager.prepare(mig_block("1g.10gb", 0, destroy=[{"profile": "7g.80gb", "start": 0}]))
    assert [(gi.profile.name, gi.start) for gi in fake.gpus[0].gpu_instances] == [("1g.10gb", 0)]
    assert [m.uuid for m in fake.gpus[0].mig_devices if m] == [made.uuid]
    assert [step for step, *_ in manager.timings] == ["create", "destroy", "create"]


def test_destroying_an_instance_with_a_process_attached_fails_in_use_and_leaves_it():
    fake = FakeNvml([h100()])
    manager = manager_for(fake)
    made = manager.prepare(mig_block("7g.80gb", 0))
    device = next(m for m in fake.gpus[0].mig_devices if m)
    device.processes.append(FakeProcess(pid=4242, used_memory=GiB))
    with pytest.raises(runtime_mig.MigError, match="in use: a process is still attached"):
        manager.prepare(mig_block("1g.10gb", 0, destroy=[{"profile": "7g.80gb", "start": 0}]))
    assert [i.uuid for i in manager.backend.instances(H100)] == [made.uuid]


def test_a_placement_nvml_has_no_room_for_fails_with_insufficient_resources_in_words():
    fake = FakeNvml([h100()])
    manager = manager_for(fake)
    manager.prepare(mig_block("4g.40gb", 0))
    with pytest.raises(runtime_mig.MigError, match="insufficient resources"):
        manager.prepare(mig_block("2g.20gb", 2))
    assert len(fake.gpus[0].gpu_instances) == 1


def test_without_root_the_reason_says_so_and_nothing_is_created():
    fake = FakeNvml([h100()], root=False)
    with pytest.raises(runtime_mig.MigError, match="must run as root"):
        manager_for(fake).prepare(mig_block("1g.10gb", 0))
    assert fake.gpus[0].gpu_instances == []


def test_mig_mode_off_or_waiting_for_a_reset_is_said_in_words():
    fake = FakeNvml([h100(mig_mode=pynvml.NVML_DEVICE_MIG_DISABLE)])
    with pytest.raises(runtime_mig.MigError, match="MIG mode is off"):
        manager_for(fake).prepare(mig_block("1g.10gb", 0))
    fake = FakeNvml([h100(mig_mode=pynvml.NVML_DEVICE_MIG_DISABLE, mig_reset_required=True)])
    fake.nvmlInit()
    fake.nvmlDeviceSetMigMode(fake.nvmlDeviceGetHandleByIndex(0), pynvml.NVML_DEVICE_MIG_ENABLE)
    with pytest.raises(runtime_mig.MigError, match="must be reset"):
        manager_for(fake).prepare(mig_block("1g.10gb", 0))


def test_a_failed_compute_instance_destroys_its_gpu_instance_so_no_slice_leaks():
    fake = FakeNvml([h100()])
    fake.fail("nvmlGpuInstanceCreateComputeInstance", pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    with pytest.raises(runtime_mig.MigError, match="insufficient resources"):
        manager_for(fake).prepare(mig_block("2g.20gb", 0))
    assert fake.gpus[0].gpu_instances == []


def test_reconcile_reports_unknown_instances_and_recreates_the_expected_ones():
    fake = FakeNvml([h100()])
    manager = manager_for(fake)
    stray = manager.prepare(mig_block("1g.10gb", 3))
    report = manager.reconcile(
        [MigGpu.decode(block("", 0))], layout({H100: [{"profile": "3g.40gb", "start": 4}, {"profile": "1g.20gb", "start": 0}]})
    ).encode()
    assert report["unknown"] == [{"gpu": H100, "profile": "1g.10gb", "start": 3, "uuid": stray.uuid}]
    assert [(r["profile"], r["start"]) for r in report["recreated"]] == [("1g.20gb", 0), ("3g.40gb", 4)]
    assert report["errors"] == []
    assert sorted((gi.profile.name, gi.start) for gi in fake.gpus[0].gpu_instances) == \
           [("1g.10gb", 3), ("1g.20gb", 0), ("3g.40gb", 4)]


def test_reconcile_reports_an_expected_instance_that_cannot_be_recreated():
    fake = FakeNvml([h100()])
    manager = manager_for(fake)
    manager.prepare(mig_block("4g.40gb", 0))
    report = manager.reconcile([MigGpu.decode(block("", 0))], layout({H100: [{"profile": "3g.40gb", "start": 0}]})).encode()
    assert report["errors"][0]["profile"] == "3g.40gb" and "insufficient resources" in report["errors"][0]["reason"]


def test_a_mock_node_runs_the_whole_flow_in_memory_and_the_session_sees_the_mig_uuid():
    manager = runtime_mig.MigManager(runtime_mig.MockMigBackend())
    spec = StartSpec.decode({"session_id": "s1", "name": "demo", "owner": "alice", "devices": [],
                             "mig": {**block("1g.20gb", 6), "model_name": "H100-80GB"}})
    prepared = runtime_mig.prepare_spec(manager, spec)
    (device,) = prepared.devices
    assert device.hardware_id.startswith("MIG-") and device.memory_limit == 20096 << 20
    assert device.mig_profile == "1g.20gb" and device.subproc_count == 26 and device.is_mig_device
    env = session_environment(prepared, allocation_path="/x", bin_dir="/b", work_dir="/w", base_path="/usr/bin")
    assert env["CUDA_VISIBLE_DEVICES"] == device.hardware_id == env["NVIDIA_VISIBLE_DEVICES"]
    again = runtime_mig.prepare_spec(manager, spec)
    assert again.devices[0].hardware_id == device.hardware_id
    plain = dataclasses.replace(spec, mig=None)
    assert runtime_mig.prepare_spec(manager, plain) is plain  # without a MIG block: the same spec, untouched


def test_a_mock_instance_with_a_process_attached_cannot_be_destroyed():
    backend = runtime_mig.MockMigBackend()
    manager = runtime_mig.MigManager(backend)
    made = manager.prepare(mig_block("7g.80gb", 0, model_name="H100-80GB"))
    backend.attached.add(made.uuid)
    with pytest.raises(runtime_mig.MigError, match="in use"):
        manager.prepare(mig_block("1g.10gb", 0, model_name="H100-80GB", destroy=[{"profile": "7g.80gb", "start": 0}]))
    assert [i.uuid for i in backend.instances(H100)] == [made.uuid]


def test_the_real_gpu_script_runs_through_the_agent_code_against_the_fake(capsys):
    from tests.gpu import mig_real

    fake = FakeNvml([h100()])
    assert mig_real.main(["--profiles", "1g.20gb,7g.80gb", "--repeat", "2"], nvml=fake, euid=0) == 0
    out = capsys.readouterr().out
    assert "1g.20gb@6 round 2: MIG-" in out and "7g.80gb@0 round 1" in out and "create median" in out
    assert fake.gpus[0].gpu_instances == []  # everything it made is gone again
    assert mig_real.main([], nvml=FakeNvml([h100()]), euid=1000) == 2  # not root: refuses


def test_the_first_prepare_after_a_restart_reapplies_the_managers_layout_and_reports_strangers():
    fake = FakeNvml([h100()])
    stranger = manager_for(fake).prepare(mig_block("1g.10gb", 3))  # made by someone else, before the restart
    manager = manager_for(fake)  # a restarted agent: knows nothing yet
    layout = [{"profile": "3g.40gb", "start": 4}, {"profile": "1g.20gb", "start": 0}, {"profile": "1g.10gb", "start": 2}]
    made = manager.prepare(mig_block("1g.20gb", 0, layout=layout, destroy=[{"profile": "1g.10gb", "start": 2}]))
    assert sorted((gi.profile.name, gi.start) for gi in fake.gpus[0].gpu_instances) == \
           [("1g.10gb", 3), ("1g.20gb", 0), ("3g.40gb", 4)]
    [report] = [r.encode() for r in manager.reports]
    assert report["unknown"] == [{"gpu": H100, "profile": "1g.10gb", "start": 3, "uuid": stranger.uuid}]
    assert [(r["profile"], r["start"]) for r in report["recreated"]] == [("3g.40gb", 4)]
    assert made.start == 0 and [step for step, *_ in manager.timings] == ["create", "create"]
    manager.prepare(mig_block("3g.40gb", 4, layout=layout))
    assert len(manager.reports) == 1  # once per GPU


def test_an_nvml_refusal_ends_the_launch_in_error_with_the_reason_and_leaves_no_instance(tmp_path):
    import asyncio

    from tests.test_agent_runtime import run_agent, start_spec

    fake = FakeNvml([h100()], root=False)

    async def scenario(h):
        h.agent.mig = manager_for(fake)
        spec = {**start_spec(command="true"), "mig": block("1g.20gb", 6)}
        await asyncio.to_thread(h.agent.submit_start, StartSpec.decode(spec))
        status, reason, _ = await h.manager.wait_for_report(spec["session_id"], "ERROR")
        return reason

    reason = run_agent(tmp_path, scenario)
    assert "could not create a 1g.20gb MIG instance at memory slice 6" in reason
    assert "must run as root" in reason
    assert fake.gpus[0].gpu_instances == []


def test_the_cuda_plugin_reports_each_mig_capable_gpus_catalog_from_nvml():
    inventory = cuda.load(nvml=FakeNvml([h100(), FakeGpu(uuid="GPU-plain", numa_node=0)]))
    h100_info, plain = (d for d in inventory.devices if not d.is_mig_device)
    catalog = mig.catalog_from_dict(h100_info.mig_catalog)
    assert [p.name for p in catalog.profiles] == [p.name for p in mig.CATALOGS["H100-80GB"].profiles]
    assert catalog.profile("1g.20gb").starts == (0, 2, 4, 6) and catalog.source == "NVML on the node"
    assert plain.mig_catalog == {}
