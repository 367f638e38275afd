"""A process-runtime session gets only its granted GPUs' device nodes (issue 31, item 2), as the
docker runtime's container gets only its granted devices from the NVIDIA container toolkit: the
control nodes and /dev/nvidia<minor> of each granted GPU (a MIG device: its parent's, and
/dev/nvidia-caps), never another user's GPU.

This machine has no GPU: a fake /dev (plain files named as the driver's nodes) and a fake
/proc/driver/nvidia tree stand for a node's, and the fake NVML (tests.fakes.fake_pynvml) for the
driver's library. The last test runs a real bubblewrap sandbox through the runtime and lists,
from inside, what it got."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pynvml
import pytest

from agent.runtimes import ProcessRuntime
from agent.sandbox import GPU_CONTROL_NODES, GpuGrant, Sandbox, gpu_devices, spec_gpus
from protocol.messages import MigBlock, StartSpec
from tests.fakes.fake_pynvml import GiB, FakeGpu, FakeMigDevice, FakeNvml
from tests.test_agent_runtime import start_spec

UUIDS = [f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(4)]
MIG_UUID = "MIG-11111111-2222-3333-4444-555555555555"
MINORS = [3, 2, 1, 0]  # NVML's minor numbers, not the enumeration order: the lookup must ask


@pytest.fixture
def node():
    """A node's /dev and /proc/driver/nvidia with four GPUs (minors 0-3) and MIG caps, in a
    directory every user may search (a sandbox's user binds from it)."""
    root = Path(tempfile.mkdtemp(prefix="fgpu-gpu-dev-", dir="/tmp"))
    root.chmod(0o755)
    dev = root / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    for name in (*GPU_CONTROL_NODES, *(f"nvidia{minor}" for minor in range(4)), "nvidia-caps/nvidia-cap1"):
        (dev / name).write_text("")
    dev.chmod(0o755)
    for uuid, minor in zip(UUIDS, MINORS):
        info = root / "proc" / "gpus" / f"0000:0{minor}:00.0" / "information"
        info.parent.mkdir(parents=True)
        info.write_text(f"Model: \t\t NVIDIA A100\nGPU UUID: \t {uuid}\nBus Type: \t PCIe\nDevice Minor: \t {minor}\n")
    yield root
    shutil.rmtree(root)


def fake_nvml() -> FakeNvml:
    gpus = [FakeGpu(uuid=uuid, minor_number=minor) for uuid, minor in zip(UUIDS, MINORS)]
    gpus[3].mig_mode = pynvml.NVML_DEVICE_MIG_ENABLE
    gpus[3].mig_devices = [FakeMigDevice(uuid=MIG_UUID, memory_total=10 * GiB, sm_count=14, gpu_slices=1)]
    return FakeNvml(gpus)


def grant_spec(*device_ids: str, mig: bool = False) -> StartSpec:
    spec = start_spec()
    template = spec["devices"][0]
    spec["devices"] = [{**template, "device_id": d, "index": i, "is_mig_device": mig} for i, d in enumerate(device_ids)]
    return StartSpec.decode(spec)


def control(root: Path) -> list[str]:
    return [str(root / "dev" / name) for name in GPU_CONTROL_NODES]


def dev_binds(argv: list[str]) -> list[str]:
    """The sources of bwrap's --dev-bind options in `argv` (each bound at its own path)."""
    found = []
    for i, arg in enumerate(argv):
        if arg == "--dev-bind":
            assert argv[i + 1] == argv[i + 2], argv[i : i + 3]
            found.append(argv[i + 1])
    return found


def test_the_bwrap_command_binds_the_control_nodes_and_the_granted_gpus_node_only(node, tmp_path):
    nvml = fake_nvml()
    devices = gpu_devices(spec_gpus(grant_spec(UUIDS[1])), dev=str(node / "dev"), drivers=str(node / "proc"), nvml=nvml)
    sandbox = Sandbox(bwrap="bwrap", setpriv="setpriv", unshare="unshare", nsenter="nsenter", uid=os.getuid(),
                      gid=os.getgid(), drop=False, share_net=False, read_only=())  # fmt: skip
    argv = sandbox.command(["/bin/true"], home=tmp_path, data=[], status_fd=3, devices=devices)
    assert dev_binds(argv) == [*control(node), str(node / "dev" / "nvidia2")]  # GPU 1's minor, by NVML
    assert (nvml.init_count, nvml.shutdown_count) == (1, 1)  # one NVML session a spawn, closed


def test_two_granted_gpus_get_their_two_nodes(node):
    devices = gpu_devices(spec_gpus(grant_spec(UUIDS[0], UUIDS[2])), dev=str(node / "dev"), drivers=str(node / "proc"),
                          nvml=fake_nvml())  # fmt: skip
    assert devices == [*control(node), str(node / "dev" / "nvidia3"), str(node / "dev" / "nvidia1")]


def test_without_nvml_the_drivers_proc_files_give_the_minor(node):
    nvml = fake_nvml()
    nvml.fail("nvmlInit", pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    devices = gpu_devices([GpuGrant(UUIDS[0])], dev=str(node / "dev"), drivers=str(node / "proc"), nvml=nvml)
    assert devices == [*control(node), str(node / "dev" / "nvidia3")]


def test_a_gpu_nvml_does_not_know_is_looked_up_in_the_drivers_files(node):
    nvml = FakeNvml([FakeGpu(uuid=UUIDS[0], minor_number=3)])  # GPU 2 unknown to NVML (NOT_FOUND)
    devices = gpu_devices([GpuGrant(UUIDS[2])], dev=str(node / "dev"), drivers=str(node / "proc"), nvml=nvml)
    assert devices == [*control(node), str(node / "dev" / "nvidia1")]


def test_a_mig_device_gets_its_parent_gpus_node_and_the_mig_caps(node):
    spec = dataclasses.replace(grant_spec(MIG_UUID, mig=True), mig=MigBlock.decode({"gpu": UUIDS[3], "profile": "1g.10gb", "start": 0}))
    assert spec_gpus(spec) == (GpuGrant(MIG_UUID, mig=True, parent=UUIDS[3]),)
    nvml = fake_nvml()
    devices = gpu_devices(spec_gpus(grant_spec(MIG_UUID, mig=True)), dev=str(node / "dev"), drivers=str(node / "proc"),
                          nvml=nvml)  # fmt: skip
    assert devices == [*control(node), str(node / "dev" / "nvidia0"), str(node / "dev" / "nvidia-caps")]
    nvml.fail("nvmlInit", pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)  # without NVML: the spec's MIG block names the parent
    assert gpu_devices(spec_gpus(spec), dev=str(node / "dev"), drivers=str(node / "proc"), nvml=nvml) == devices


def test_a_grant_whose_node_is_not_found_is_logged_and_left_out_never_all_nodes(node, caplog):
    unknown = "GPU-99999999-aaaa-bbbb-cccc-dddddddddddd"
    (node / "dev" / "nvidia2").unlink()  # GPU 1's node gone
    with caplog.at_level(logging.WARNING, logger="agent.sandbox"):
        devices = gpu_devices([GpuGrant(unknown), GpuGrant(UUIDS[1]), GpuGrant(UUIDS[0])], dev=str(node / "dev"),
                              drivers=str(node / "proc"), nvml=fake_nvml())  # fmt: skip
    assert devices == [*control(node), str(node / "dev" / "nvidia3")]
    assert unknown in caplog.text and "nvidia2 does not exist" in caplog.text, caplog.text


def test_no_nodes_and_no_nvml_call_without_a_driver_or_without_grants(node):
    nvml = fake_nvml()
    assert gpu_devices([], dev=str(node / "dev"), drivers=str(node / "proc"), nvml=nvml) == []
    (node / "dev" / "nvidiactl").unlink()  # no NVIDIA driver: a mock node's
    assert gpu_devices([GpuGrant(UUIDS[0])], dev=str(node / "dev"), drivers=str(node / "proc"), nvml=nvml) == []
    assert nvml.init_count == 0


def test_a_sandboxed_session_sees_only_its_granted_gpus_node(node, tmp_path):
    """A real spawn through the runtime, as a non-administrator: the session lists the fake /dev
    from inside its sandbox and finds the control nodes and GPU 1's node, not GPUs 0, 2, 3 nor the
    MIG caps."""
    runtime = ProcessRuntime(node=f"test-node-gpus-{os.getpid()}")
    runtime.dev, runtime.nvidia_proc, runtime.nvml = str(node / "dev"), str(node / "proc"), fake_nvml()
    runtime.clean_up_at_start(tmp_path / "scratch")
    try:
        work_dir = tmp_path / "scratch" / "gpus"
        work_dir.mkdir(parents=True)
        spec = dataclasses.replace(grant_spec(UUIDS[1]), owner_is_staff=False)
        argv = ["/bin/sh", "-c", f"ls -A {node / 'dev'} > seen.txt 2>&1"]
        handle = runtime.spawn(spec=spec, argv=argv, env={"PATH": "/usr/bin:/bin"}, work_dir=work_dir)
        try:
            assert handle.sandbox is not None, runtime.unconfined_why
            assert handle.wait() == 0, (work_dir / "seen.txt").read_text()
        finally:
            handle.remove()
            handle.close_stream()
        assert sorted((work_dir / "seen.txt").read_text().split()) == sorted([*GPU_CONTROL_NODES, "nvidia2"])
    finally:
        runtime.release_now()
