"""The `ai.backend.accelerator.cuda` plugin against a fake NVML (tests/fakes/fake_pynvml.py)."""
from __future__ import annotations

import pynvml
import pytest

from accelerators.plugins.cuda import (
    CudaPluginError,
    cuda_version_text,
    load,
    mig_profile_name,
    pci_sysfs_name,
)
from tests.fakes.fake_pynvml import GiB, MiB, FakeGpu, FakeMigDevice, FakeNvml

H100_A = "GPU-6e1a0a4c-0d2b-4c33-9d7e-0f5c2a9b1a01"
H100_B = "GPU-6e1a0a4c-0d2b-4c33-9d7e-0f5c2a9b1a02"
A100 = "GPU-c59395cd-7a1e-4f0b-8d4e-2f3a1b2c3d4e"
MIG_1G = "MIG-11111111-2222-3333-4444-555555555555"
MIG_3G = "MIG-66666666-7777-8888-9999-000000000000"


def h100(uuid: str, **overrides) -> FakeGpu:
    settings = dict(
        uuid=uuid, name="NVIDIA H100 80GB HBM3", memory_total=81559 * MiB, sm_count=132,
        architecture=pynvml.NVML_DEVICE_ARCH_HOPPER, compute_capability=(9, 0), cuda_cores=16896,
    )
    return FakeGpu(**(settings | overrides))


def test_load_discovers_two_gpus_with_memory_sms_numa_nodes_and_driver_versions():
    fake = FakeNvml(
        [h100(H100_A, numa_node=0, pci_bus_id="00000000:1B:00.0"), h100(H100_B, numa_node=1, pci_bus_id="00000000:9C:00.0")],
        driver_version="550.54.15", cuda_driver_version=12040,
    )

    inventory = load(nvml=fake)

    assert inventory.plugin == "ai.backend.accelerator.cuda"
    assert inventory.slot_name == "cuda"
    assert inventory.attributes == {"driver_version": "550.54.15", "cuda_version": "12.4"}
    assert [d.as_dict() for d in inventory.devices] == [
        {
            "slot_name": "cuda", "device_id": H100_A, "index": 0, "mother_uuid": H100_A,
            "model_name": "NVIDIA H100 80GB HBM3", "numa_node": 0, "subproc_count": 132,
            "memory_size": 81559 * MiB, "is_mig_device": False, "mig_profile": "", "parent_device_id": "",
            "mig_catalog": {},
        },
        {
            "slot_name": "cuda", "device_id": H100_B, "index": 1, "mother_uuid": H100_B,
            "model_name": "NVIDIA H100 80GB HBM3", "numa_node": 1, "subproc_count": 132,
            "memory_size": 81559 * MiB, "is_mig_device": False, "mig_profile": "", "parent_device_id": "",
            "mig_catalog": {},
        },
    ]
    assert inventory.warnings == []


def test_load_always_shuts_nvml_down_again():
    fake = FakeNvml([h100(H100_A)])

    load(nvml=fake)

    assert (fake.init_count, fake.shutdown_count) == (1, 1)
    assert not fake.initialized


def test_numa_node_is_read_from_sysfs_when_nvml_does_not_support_it(tmp_path):
    devices = tmp_path / "bus" / "pci" / "devices"
    (devices / "0000:3b:00.0").mkdir(parents=True)
    (devices / "0000:3b:00.0" / "numa_node").write_text("1\n")
    (devices / "0000:af:00.0").mkdir(parents=True)
    (devices / "0000:af:00.0" / "numa_node").write_text("-1\n")
    fake = FakeNvml([
        h100(H100_A, numa_node=None, pci_bus_id="00000000:3B:00.0"),
        h100(H100_B, numa_node=None, pci_bus_id="00000000:AF:00.0"),
    ])

    inventory = load(nvml=fake, sys_root=tmp_path)

    assert [d.numa_node for d in inventory.devices] == [1, None]


def test_numa_node_is_none_when_neither_nvml_nor_sysfs_knows_it(tmp_path):
    fake = FakeNvml([h100(H100_A, numa_node=None)])

    inventory = load(nvml=fake, sys_root=tmp_path)

    assert inventory.devices[0].numa_node is None


def test_pci_bus_id_from_nvml_becomes_the_kernels_device_name():
    assert pci_sysfs_name("00000000:3B:00.0") == "0000:3b:00.0"
    assert pci_sysfs_name("00010000:01:00.0") == "10000:01:00.0"


@pytest.mark.parametrize(
    ("architecture", "capability", "cores", "sms"),
    [
        (pynvml.NVML_DEVICE_ARCH_HOPPER, (9, 0), 16896, 132),  # H100 SXM
        (pynvml.NVML_DEVICE_ARCH_AMPERE, (8, 0), 6912, 108),  # A100: GA100, 64 cores per SM
        (pynvml.NVML_DEVICE_ARCH_AMPERE, (8, 6), 10752, 84),  # RTX A6000: GA102, 128 cores per SM
        (pynvml.NVML_DEVICE_ARCH_VOLTA, (7, 0), 5120, 80),  # V100
        (pynvml.NVML_DEVICE_ARCH_ADA, (8, 9), 7424, 58),  # L4
    ],
)
def test_sm_count_falls_back_to_cuda_cores_per_sm_when_nvml_refuses_attributes_for_a_full_gpu(
    architecture, capability, cores, sms
):
    fake = FakeNvml([
        FakeGpu(uuid=A100, attributes_supported=False, architecture=architecture,
                compute_capability=capability, cuda_cores=cores, sm_count=999)
    ])

    inventory = load(nvml=fake)

    assert inventory.devices[0].subproc_count == sms
    assert inventory.warnings == []


def test_sm_count_of_an_unknown_architecture_assumes_128_cores_per_sm_and_warns():
    fake = FakeNvml([FakeGpu(uuid=A100, attributes_supported=False, architecture=0xFFFFFFFF, cuda_cores=12800)])

    inventory = load(nvml=fake)

    assert inventory.devices[0].subproc_count == 100
    assert len(inventory.warnings) == 1
    assert "cores-per-SM" in inventory.warnings[0] and A100 in inventory.warnings[0]


def test_mig_devices_follow_their_gpu_with_profile_memory_sms_and_parent():
    gpu = FakeGpu(
        uuid=A100, name="NVIDIA A100-SXM4-80GB", memory_total=81920 * MiB, sm_count=108, numa_node=1,
        mig_mode=pynvml.NVML_DEVICE_MIG_ENABLE,
        mig_devices=[
            FakeMigDevice(uuid=MIG_1G, memory_total=9728 * MiB, sm_count=14, gpu_slices=1, profile="1g.10gb"),
            None,  # an empty MIG index: NVML answers NOT_FOUND there
            FakeMigDevice(uuid=MIG_3G, memory_total=40192 * MiB, sm_count=42, gpu_slices=3, profile="3g.40gb"),
        ],
    )

    inventory = load(nvml=FakeNvml([gpu]))

    parent, first, second = inventory.devices
    assert (parent.device_id, parent.is_mig_device) == (A100, False)
    assert (first.device_id, first.mig_profile, first.memory_size, first.subproc_count) == (MIG_1G, "1g.10gb", 9728 * MiB, 14)
    assert (second.device_id, second.mig_profile, second.memory_size, second.subproc_count) == (MIG_3G, "3g.40gb", 40192 * MiB, 42)
    for mig in (first, second):
        assert mig.is_mig_device
        assert mig.parent_device_id == A100
        assert mig.mother_uuid == A100
        assert mig.numa_node == 1
        assert mig.model_name == "NVIDIA A100-SXM4-80GB"


def test_a_gpu_without_mig_support_is_listed_alone():
    inventory = load(nvml=FakeNvml([FakeGpu(uuid=A100, mig_mode=None)]))

    assert [d.device_id for d in inventory.devices] == [A100]


@pytest.mark.parametrize(
    ("gpu_slices", "compute_slices", "memory_mib", "parent_memory", "expected"),
    [
        (1, 1, 4864, 40960 * MiB, "1g.5gb"),  # A100 40GB
        (7, 7, 40192, 40960 * MiB, "7g.40gb"),
        (1, 1, 9984, 81559 * MiB, "1g.10gb"),  # H100 80GB
        (2, 2, 19968, 81559 * MiB, "2g.20gb"),
        (1, 1, 16384, 143771 * MiB, "1g.18gb"),  # H200 141GB
        (3, 1, 19968, 40960 * MiB, "1c.3g.20gb"),  # a 1-slice compute instance in a 3g GPU instance
    ],
)
def test_mig_profile_names_match_nvidias(gpu_slices, compute_slices, memory_mib, parent_memory, expected):
    name = mig_profile_name(
        gpu_slices=gpu_slices, compute_slices=compute_slices, memory_mib=memory_mib, parent_memory=parent_memory
    )

    assert name == expected


def test_an_nvml_error_names_the_call_and_nvmls_error_and_still_shuts_nvml_down():
    fake = FakeNvml([h100(H100_A), h100(H100_B)])
    fake.fail("nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_GPU_IS_LOST)

    with pytest.raises(CudaPluginError) as raised:
        load(nvml=fake)

    message = str(raised.value)
    assert "nvmlDeviceGetMemoryInfo" in message
    assert "GPU is lost" in message
    assert H100_A in message
    assert raised.value.nvml_code == pynvml.NVML_ERROR_GPU_IS_LOST
    assert fake.shutdown_count == 1


def test_nvml_that_cannot_start_is_reported_without_a_shutdown():
    fake = FakeNvml([h100(H100_A)])
    fake.fail("nvmlInit", pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    with pytest.raises(CudaPluginError, match=r"nvmlInit failed: Driver Not Loaded"):
        load(nvml=fake)

    assert fake.shutdown_count == 0


def test_a_real_error_on_an_optional_field_is_not_swallowed():
    fake = FakeNvml([h100(H100_A)])
    fake.fail("nvmlDeviceGetMigMode", pynvml.NVML_ERROR_NO_PERMISSION)

    with pytest.raises(CudaPluginError, match=r"nvmlDeviceGetMigMode .*Insufficient Permissions"):
        load(nvml=fake)


def test_bytes_from_older_pynvml_releases_are_decoded():
    fake = FakeNvml([h100(H100_A)], legacy_bytes=True)

    inventory = load(nvml=fake)

    assert inventory.devices[0].device_id == H100_A
    assert inventory.devices[0].model_name == "NVIDIA H100 80GB HBM3"
    assert inventory.attributes["driver_version"] == "550.54.15"


@pytest.mark.parametrize(("version", "text"), [(12040, "12.4"), (11080, "11.8"), (12090, "12.9"), (13000, "13.0")])
def test_cuda_driver_version_integer_reads_as_major_dot_minor(version, text):
    assert cuda_version_text(version) == text


def test_memory_sizes_are_bytes():
    inventory = load(nvml=FakeNvml([FakeGpu(uuid=A100, memory_total=40 * GiB)]))

    assert inventory.devices[0].memory_size == 42949672960
