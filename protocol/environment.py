"""The environment contract of a session (DESIGN.md) and its allocation document: what the
agent puts into a session's environment and what the manager shows of it (the session API's
`environment`, the launch preview's SM percentages), so both sides compute it with one function.
Pure: the standard library and protocol.units only.

Variable names come from the systems that read them: `CUDA_VISIBLE_DEVICES` /
`NVIDIA_VISIBLE_DEVICES` (CUDA, NVIDIA container runtime), `CUDA_DEVICE_MEMORY_LIMIT_<i>` and
`CUDA_DEVICE_SM_LIMIT` (HAMi-core), `AMP_VGPU_ENABLE`, `GPU_MEM_PER_DEVICE`,
`GPU_UTIL_PER_DEVICE` (Alibaba eGPU), `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`,
`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` (NVIDIA MPS).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from decimal import ROUND_DOWN, Decimal
from typing import Any, Protocol

from protocol.messages import HardwareId, NodeName, StartSpec
from protocol.units import fgpu_text

MiB = 1 << 20


def sm_percent(procs: str | int | Decimal, subproc_count: int) -> int:
    """Granted SMs (`procs`, decimal text or a number) as a whole percentage of the device's
    `subproc_count` SMs (truncated, at least 1 when any SM was granted). 0 means no compute limit
    (a per-device request with no core share), as HAMi-core's CUDA_DEVICE_SM_LIMIT reads it; 100
    likewise means none."""
    granted = Decimal(procs)
    if not subproc_count or granted >= subproc_count:
        return 100
    if granted == 0:
        return 0
    share = granted * 100 / Decimal(subproc_count)
    return max(1, min(100, int(share.to_integral_value(rounding=ROUND_DOWN))))


class GrantedDevice(Protocol):
    """What the limits of one granted device are read from: a start spec's device
    (protocol.messages.StartDevice) or the manager's DeviceLimit. `hardware_id`: the device's
    (or MIG device's) UUID; `memory_limit`: bytes; `procs`: granted SMs; `subproc_count`: its SMs."""

    @property
    def hardware_id(self) -> str: ...

    @property
    def memory_limit(self) -> int: ...

    @property
    def procs(self) -> str | int | Decimal: ...

    @property
    def subproc_count(self) -> int: ...


@dataclass(frozen=True)
class DeviceLimit:
    """A granted device's limits where no start spec is at hand (the session API's `environment`,
    read from the allocations): as GrantedDevice says."""

    hardware_id: HardwareId
    memory_limit: int
    procs: str | int | Decimal
    subproc_count: int


def allocation_document(spec: StartSpec, *, node: NodeName, mock: bool, attributes: dict[str, Any]) -> dict[str, Any]:
    """The JSON the virtual nvidia-smi reads (`FGPU_ALLOCATION`) for start spec `spec`: devices
    numbered as the session sees them (0..n-1), memory in bytes, `uuid` their hardware ids."""
    return {
        "session_id": spec.session_id,
        "session_name": spec.name,
        "node": node,
        "mock": mock,
        "driver_version": attributes.get("nvidia_driver", "N/A"),
        "cuda_version": attributes.get("cuda_runtime", "N/A"),
        "cpu": spec.cpu,
        "mem": spec.mem,
        "devices": [
            {
                "index": i,
                "uuid": d.hardware_id,
                "model_name": d.model_name,
                "memory_limit": d.memory_limit,
                "memory_total": d.memory_total,
                "shares": fgpu_text(d.shares),
                "procs": d.procs,
                "subproc_count": d.subproc_count,
                "sm_limit_percent": sm_percent(d.procs, d.subproc_count),
                "is_mig_device": d.is_mig_device,
                "mig_profile": d.mig_profile,
                "pci_bus_id": "",
            }
            for i, d in enumerate(spec.devices)
        ],
    }


def session_environment(
    spec: StartSpec, *, allocation_path: str, bin_dir: str, work_dir: str, base_path: str, mps: bool = False
) -> dict[str, str]:
    """The variables of the contract for start spec `spec`: the session's own (PATH, HOME,
    FGPU_*) and `limits_environment` of its devices."""
    return {
        "PATH": f"{bin_dir}:{base_path}",
        "HOME": work_dir,
        "TERM": "xterm-256color",
        "LANG": "C.UTF-8",
        "FGPU_SESSION_ID": spec.session_id,
        "FGPU_SESSION_NAME": spec.name,
        "FGPU_ALLOCATION": allocation_path,
        **limits_environment(spec.devices, mps=mps),
    }


def limits_environment(devices: Sequence[GrantedDevice], *, mps: bool = False) -> dict[str, str]:
    """What a session's devices put into its environment: the devices granted and their limits
    (DESIGN.md, "Environment contract"). `devices`: the start spec's (or DeviceLimit), in the
    order the session numbers them; `mps`: the node runs NVIDIA MPS. The agent starts sessions
    with these, and the session API shows them (`environment`). No devices:
    `CUDA_VISIBLE_DEVICES=""` and `NVIDIA_VISIBLE_DEVICES=void`, so no GPU is visible. When the
    devices' SM shares differ, the compute caps use the smallest, so no device runs above its grant."""
    uuids = ",".join(d.hardware_id for d in devices)
    env = {"CUDA_VISIBLE_DEVICES": uuids, "NVIDIA_VISIBLE_DEVICES": uuids or "void"}
    if not devices:
        return env
    percents = [sm_percent(d.procs, d.subproc_count) for d in devices]
    limited = [p for p in percents if 0 < p < 100]
    percent = min(limited) if limited else 0  # 0: no compute limit on any device
    for i, d in enumerate(devices):
        env[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{d.memory_limit // MiB}m"
    env["CUDA_DEVICE_SM_LIMIT"] = str(percent)
    env["AMP_VGPU_ENABLE"] = "1"
    env["GPU_MEM_PER_DEVICE"] = str(min(d.memory_limit for d in devices))
    env["GPU_UTIL_PER_DEVICE"] = str(percent)
    if mps:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(f"{i}={d.memory_limit // MiB}M" for i, d in enumerate(devices))
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(percent or 100)  # MPS: 100 = the whole device
    return env
