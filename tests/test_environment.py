"""A session's environment contract and allocation document (protocol/environment.py)."""
from __future__ import annotations

import json

import pytest

from protocol.environment import allocation_document, session_environment, sm_percent
from protocol.messages import StartSpec

GiB = 1 << 30
UUID_0 = "GPU-00000000-0000-0000-0000-000000000000"
UUID_1 = "GPU-00000000-0000-0000-0000-000000000001"
SESSION_ID = "6f1c1b0e-9a43-4c8e-8d2a-1f3e5d7c9b11"

LIMIT_NAMES = ("CUDA_DEVICE_SM_LIMIT", "AMP_VGPU_ENABLE", "GPU_MEM_PER_DEVICE", "GPU_UTIL_PER_DEVICE",
               "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")


def device(uuid: str = UUID_0, *, shares: str = "0.5", memory_limit: int = 2 * GiB, procs: str = "20",
           memory_total: int = 8 * GiB, subproc_count: int = 80, index: int = 0) -> dict:
    """One device of a start spec, as sessions.scheduling.scheduler.session_start_spec writes it."""
    return {
        "device_id": uuid, "index": index, "model_name": "CUDA GPU", "memory_total": memory_total,
        "subproc_count": subproc_count, "memory_limit": memory_limit, "procs": procs, "shares": shares,
        "is_mig_device": False, "mig_profile": "",
    }


def spec(*devices: dict) -> StartSpec:
    """A start spec of `devices` (wire dicts), as the agent decodes it."""
    return StartSpec.decode({
        "session_id": SESSION_ID, "name": "notebook", "owner": "alice", "command": "", "cpu": 1, "mem": GiB,
        "slot_name": "cuda", "slot_subtype": "shares", "devices": list(devices),
    })


def environment(the_spec: StartSpec, *, mps: bool = False) -> dict[str, str]:
    return session_environment(the_spec, allocation_path="/scratch/s1/.fgpu/allocation.json",
                               bin_dir="/opt/fgpu/bin", work_dir="/scratch/s1", base_path="/usr/bin:/bin", mps=mps)


# --- a 0.5 fGPU grant on the demo device (8 GiB, 80 SMs; 1 fGPU = 4 GiB, 40 SMs) -------------

def test_the_granted_device_is_the_only_visible_one_for_cuda_and_the_nvidia_runtime():
    env = environment(spec(device()))
    assert env["CUDA_VISIBLE_DEVICES"] == UUID_0
    assert env["NVIDIA_VISIBLE_DEVICES"] == UUID_0


def test_half_an_fgpu_caps_memory_at_2048_mib_for_hami():
    assert environment(spec(device()))["CUDA_DEVICE_MEMORY_LIMIT_0"] == "2048m"


def test_half_an_fgpu_caps_compute_at_25_percent_of_the_sms():
    env = environment(spec(device()))
    assert env["CUDA_DEVICE_SM_LIMIT"] == "25"
    assert env["GPU_UTIL_PER_DEVICE"] == "25"


def test_egpu_style_limits_give_memory_in_bytes_and_enable_the_vgpu():
    env = environment(spec(device()))
    assert env["GPU_MEM_PER_DEVICE"] == "2147483648"
    assert env["AMP_VGPU_ENABLE"] == "1"


def test_the_session_knows_its_id_and_where_its_allocation_document_is():
    env = environment(spec(device()))
    assert env["FGPU_SESSION_ID"] == SESSION_ID
    assert env["FGPU_ALLOCATION"] == "/scratch/s1/.fgpu/allocation.json"
    assert env["HOME"] == "/scratch/s1"


def test_path_starts_with_the_bin_dir_so_the_virtual_nvidia_smi_wins():
    env = environment(spec(device()))
    assert env["PATH"] == "/opt/fgpu/bin:/usr/bin:/bin"
    assert env["PATH"].split(":")[0] == "/opt/fgpu/bin"


def test_every_value_is_text():
    for mps in (False, True):
        env = environment(spec(device(), device(UUID_1, index=1)), mps=mps)
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())


# --- MPS ------------------------------------------------------------------------------------

def test_mps_limits_are_absent_unless_the_node_runs_mps():
    env = environment(spec(device()))
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env


def test_mps_limits_pin_memory_per_device_index_and_cap_threads():
    env = environment(spec(device()), mps=True)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"


# --- several devices, or none ---------------------------------------------------------------

def test_two_devices_are_numbered_0_and_1_as_the_session_sees_them():
    first = device(UUID_0, shares="1", memory_limit=4 * GiB, procs="40", index=3)
    second = device(UUID_1, shares="0.75", memory_limit=3 * GiB, procs="30", index=5)
    env = environment(spec(first, second), mps=True)
    assert env["CUDA_VISIBLE_DEVICES"] == f"{UUID_0},{UUID_1}"
    assert env["NVIDIA_VISIBLE_DEVICES"] == f"{UUID_0},{UUID_1}"
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "4096m"
    assert env["CUDA_DEVICE_MEMORY_LIMIT_1"] == "3072m"
    assert "CUDA_DEVICE_MEMORY_LIMIT_3" not in env and "CUDA_DEVICE_MEMORY_LIMIT_5" not in env
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M,1=3072M"


def test_with_unequal_grants_the_shared_caps_use_the_smallest_so_no_device_runs_above_its_grant():
    first = device(UUID_0, shares="1", memory_limit=4 * GiB, procs="40")
    second = device(UUID_1, shares="0.75", memory_limit=3 * GiB, procs="30", index=1)
    env = environment(spec(first, second))
    assert env["CUDA_DEVICE_SM_LIMIT"] == "37"  # 30 of 80 SMs = 37.5 %, truncated
    assert env["GPU_MEM_PER_DEVICE"] == str(3 * GiB)


def test_a_session_without_devices_sees_no_gpu_and_gets_no_limits():
    env = environment(spec(), mps=True)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["NVIDIA_VISIBLE_DEVICES"] in ("", "void", "none")
    assert not [name for name in env if name.startswith("CUDA_DEVICE_MEMORY_LIMIT")]
    assert not [name for name in LIMIT_NAMES if name in env]
    assert env["FGPU_ALLOCATION"] == "/scratch/s1/.fgpu/allocation.json"


def test_a_memory_limit_off_the_mib_grid_is_rounded_down_never_above_the_grant():
    env = environment(spec(device(memory_limit=2 * GiB + (1 << 20) - 1)))
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "2048m"


# --- sm_percent -----------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("procs", "subproc_count", "percent"),
    [("20", 80, 25), ("20.00", 80, 25), ("80", 80, 100), ("13.5", 108, 12), ("0.5", 132, 1), ("200", 80, 100),
     ("0", 0, 100)],
)
def test_sm_percent_is_the_granted_share_of_sms_truncated_between_1_and_100(procs, subproc_count, percent):
    assert sm_percent(procs, subproc_count) == percent


# --- the allocation document ----------------------------------------------------------------

def document(the_spec: dict) -> dict:
    return allocation_document(the_spec, node="demo-node", mock=True,
                               attributes={"nvidia_driver": "550.54.15", "cuda_runtime": "12.4"})


def test_the_allocation_document_numbers_devices_0_to_n_minus_1_in_spec_order():
    first = device(UUID_0, index=3)
    second = device(UUID_1, index=5, shares="1", memory_limit=4 * GiB, procs="40")
    doc = document(spec(first, second))
    assert [d["index"] for d in doc["devices"]] == [0, 1]
    assert [d["uuid"] for d in doc["devices"]] == [UUID_0, UUID_1]


def test_the_allocation_document_carries_limits_in_bytes_and_sm_percent():
    doc = document(spec(device()))
    (entry,) = doc["devices"]
    assert entry["memory_limit"] == 2 * GiB
    assert entry["memory_total"] == 8 * GiB
    assert entry["sm_limit_percent"] == 25
    assert entry["shares"] == "0.50"  # shown as the default slot format does
    assert (entry["model_name"], entry["is_mig_device"]) == ("CUDA GPU", False)


def test_the_allocation_document_names_the_session_node_and_versions_and_is_json():
    doc = document(spec(device()))
    assert (doc["session_id"], doc["session_name"], doc["node"], doc["mock"]) == (SESSION_ID, "notebook", "demo-node", True)
    assert (doc["driver_version"], doc["cuda_version"]) == ("550.54.15", "12.4")
    assert json.loads(json.dumps(doc)) == doc


def test_the_allocation_document_of_a_session_without_devices_lists_none():
    doc = allocation_document(spec(), node="demo-node", mock=False, attributes={})
    assert doc["devices"] == []
    assert (doc["driver_version"], doc["cuda_version"]) == ("N/A", "N/A")


@pytest.mark.parametrize(("shares", "shown"), [("0.5", "0.50"), ("2", "2.00"), ("0.125", "0.125"), ("1.500", "1.50")])
def test_shares_are_shown_with_at_least_two_decimals_and_never_rounded(shares, shown):
    from protocol.units import fgpu_text

    assert fgpu_text(shares) == shown
