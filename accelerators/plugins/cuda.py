"""The agent's `ai.backend.accelerator.cuda` plugin: real NVIDIA devices discovered through NVML.

`load()` opens NVML (the `pynvml` module of nvidia-ml-py, or a fake passed as `nvml=`), reads
every GPU and, where MIG mode is on, every MIG device, and always shuts NVML down again.

What is read, per GPU (NVML call in brackets):

- `device_id` and `mother_uuid`: the GPU UUID, "GPU-c59395cd-…" (nvmlDeviceGetUUID);
- `model_name` (nvmlDeviceGetName), `index` (the NVML enumeration index);
- `memory_size`: total memory in bytes (nvmlDeviceGetMemoryInfo(handle).total);
- `subproc_count`: SMs, from nvmlDeviceGetAttributes(handle).multiprocessorCount; where NVML
  refuses that call for a full GPU (older drivers answer it for MIG devices only), CUDA cores
  (nvmlDeviceGetNumGpuCores) divided by the cores per SM of the GPU's architecture
  (nvmlDeviceGetArchitecture, refined by nvmlDeviceGetCudaComputeCapability where one
  architecture has two SM designs), table `_CORES_PER_SM_BY_ARCH` below;
- `numa_node` (nvmlDeviceGetNumaNodeId where the driver answers it, else the kernel's
  `/sys/bus/pci/devices/<bus id>/numa_node`; -1 or unavailable → None).

Per MIG device (when nvmlDeviceGetMigMode reports the current mode enabled): its own UUID
("MIG-…"), memory (nvmlDeviceGetMemoryInfo), SMs and slice counts (nvmlDeviceGetAttributes),
`mig_profile` such as "1g.10gb" (rule `mig_profile_name`), `parent_device_id` and `mother_uuid`
= the parent GPU's UUID, `index` and `numa_node` = the parent's.

MIG-capable GPUs also carry `mig_catalog`: their GPU-instance profiles, read with
nvmlDeviceGetGpuInstanceProfileInfo and nvmlDeviceGetGpuInstancePossiblePlacements
(`accelerators.plugins.cuda_mig.catalog_from_nvml`), which the manager's MIG planner uses
instead of its built-in table.

Attributes: `driver_version` ("550.54.15", nvmlSystemGetDriverVersion) and `cuda_version`
("12.4", nvmlSystemGetCudaDriverVersion_v2).

Links (`PluginInventory.links`), one per pair of whole GPUs, the best that joins them, as
`nvidia-smi topo -m` reports them:

- NVLink with its lane count: the GPU's links 0 … NVML_NVLINK_MAX_LINKS - 1 that are up
  (nvmlDeviceGetNvLinkState) and whose far end (nvmlDeviceGetNvLinkRemotePciInfo) has the
  other GPU's PCI bus id; on NVSwitch baseboards (nvmlDeviceGetNvLinkRemoteDeviceType is
  NVML_NVLINK_DEVICE_TYPE_SWITCH, as on DGX/HGX) every two GPUs with switch lanes are
  linked, with the smaller of their switch lane counts. A GPU without NVLink (NOT_SUPPORTED)
  or a link index it lacks (INVALID_ARGUMENT) adds no lane.
- otherwise the PCIe path (nvmlDeviceGetTopologyCommonAncestor): NVML_TOPOLOGY_INTERNAL
  and _SINGLE → PIX, _MULTIPLE → PXB, _HOSTBRIDGE → PHB, _NODE → NODE, _SYSTEM → SYS; where
  the driver does not answer it (NOT_SUPPORTED), no link (placement then falls back on the
  GPUs' NUMA nodes).

Errors: any NVML failure raises `CudaPluginError` naming the call and NVML's error string,
except "not supported" (or "function not found" on older drivers) for the optional fields —
NUMA node, MIG mode, the attributes of a full GPU, NVLink and the PCIe topology — which fall
back as described above.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pynvml

from accelerators.allocation import topology
from accelerators.plugins.base import DeviceInfo, PluginInventory
from accelerators.plugins.nvml_names import mig_profile_name
from accelerators.plugins.nvml_names import nvml_text as _text

PLUGIN_NAME = "ai.backend.accelerator.cuda"
SLOT_NAME = "cuda"

# CUDA cores per SM, by NVML architecture code (nvmlDeviceArchitecture_t in nvml.h).
# Source: the CUDA samples' `_ConvertSMVer2Cores` table in Common/helper_cuda.h, which gives
# cores per SM by compute capability; an architecture maps to one value except where noted.
_ARCH_KEPLER, _ARCH_MAXWELL, _ARCH_PASCAL, _ARCH_VOLTA = 2, 3, 4, 5
_ARCH_TURING, _ARCH_AMPERE, _ARCH_ADA, _ARCH_HOPPER, _ARCH_BLACKWELL = 6, 7, 8, 9, 10
_CORES_PER_SM_BY_ARCH = {
    _ARCH_KEPLER: 192,  # 3.x
    _ARCH_MAXWELL: 128,  # 5.x
    _ARCH_PASCAL: 64,  # 6.0 (GP100); 6.1/6.2 (GP10x) have 128, see _CORES_PER_SM_BY_CC
    _ARCH_VOLTA: 64,  # 7.0, 7.2
    _ARCH_TURING: 64,  # 7.5
    _ARCH_AMPERE: 64,  # 8.0 (GA100); 8.6/8.7 (GA10x) have 128, see _CORES_PER_SM_BY_CC
    _ARCH_ADA: 128,  # 8.9
    _ARCH_HOPPER: 128,  # 9.0
    _ARCH_BLACKWELL: 128,  # 10.x, 12.x
}
# Compute capability → cores per SM, for the architectures that hold two SM designs
# (same source: helper_cuda.h `_ConvertSMVer2Cores`).
_CORES_PER_SM_BY_CC = {(6, 0): 64, (6, 1): 128, (6, 2): 128, (8, 0): 64, (8, 6): 128, (8, 7): 128}
_ARCH_WITH_TWO_SM_DESIGNS = {_ARCH_PASCAL, _ARCH_AMPERE}
# Every architecture NVIDIA has shipped since Ampere GA10x has 128 cores per SM.
_CORES_PER_SM_DEFAULT = 128


class CudaPluginError(RuntimeError):
    """NVML refused a call the inventory cannot do without.

    `call` is the NVML function ("nvmlDeviceGetMemoryInfo"), `target` what it was asked about
    ("GPU 1", "" for system calls), `nvml_error` NVML's error string ("GPU is lost") and
    `nvml_code` its numeric code (NVML_ERROR_*), or None when NVML could not be loaded at all.
    """

    def __init__(self, call: str, nvml_error: str, *, nvml_code: int | None = None, target: str = "") -> None:
        self.call = call
        self.target = target
        self.nvml_error = nvml_error
        self.nvml_code = nvml_code
        where = f" for {target}" if target else ""
        code = f" (NVML error {nvml_code})" if nvml_code is not None else ""
        super().__init__(f"NVML call {call}{where} failed: {nvml_error}{code}")


def load(*, nvml: Any = None, sys_root: Path = Path("/sys")) -> PluginInventory:
    """Discover this node's NVIDIA GPUs (and MIG devices) through NVML.

    `nvml`: the pynvml module (default) or an object with the same functions (tests pass a
    fake). `sys_root`: where sysfs is mounted, read only for the NUMA fallback.
    Returns a PluginInventory of plugin "ai.backend.accelerator.cuda", slot "cuda", devices in
    NVML order with each GPU's MIG devices right after it, and the links between its whole
    GPUs (module text). Raises CudaPluginError.
    NVML is always shut down again once initialised.
    """
    nvml = pynvml if nvml is None else nvml
    _call(nvml, "nvmlInit")
    inventory = PluginInventory(plugin=PLUGIN_NAME, slot_name=SLOT_NAME, devices=[])
    try:
        inventory.attributes = {
            "driver_version": _text(_call(nvml, "nvmlSystemGetDriverVersion")),
            "cuda_version": cuda_version_text(_call(nvml, "nvmlSystemGetCudaDriverVersion_v2")),
        }
        count = _call(nvml, "nvmlDeviceGetCount")
        gpus = []
        for index in range(count):
            handle = _call(nvml, "nvmlDeviceGetHandleByIndex", index, target=f"GPU {index}")
            gpu = _gpu_info(nvml, handle, index, sys_root=sys_root, warnings=inventory.warnings)
            gpu = replace(gpu, mig_catalog=_mig_catalog(nvml, handle, gpu, warnings=inventory.warnings))
            gpus.append((handle, gpu))
            inventory.devices.append(gpu)
            inventory.devices.extend(_mig_devices(nvml, handle, gpu))
        inventory.links = _gpu_links(nvml, gpus)
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as err:
            inventory.warnings.append(f"NVML call nvmlShutdown failed: {err}")
    return inventory


def cuda_version_text(version: int) -> str:
    """NVML's CUDA driver version integer → "major.minor": 12040 → "12.4", 11080 → "11.8".

    Encoding as in nvml.h (NVML_CUDA_DRIVER_VERSION_MAJOR/MINOR): major = v / 1000,
    minor = (v % 1000) / 10.
    """
    return f"{version // 1000}.{(version % 1000) // 10}"


def pci_sysfs_name(bus_id: str) -> str:
    """NVML's PCI bus id → the kernel's device name under /sys/bus/pci/devices.

    NVML writes an 8-digit domain in capitals ("00000000:3B:00.0"); Linux names the device
    with the domain as `%04x` ("0000:3b:00.0", see pci_setup_device in drivers/pci/probe.c).
    """
    domain, _, rest = bus_id.strip().partition(":")
    try:
        return f"{int(domain, 16):04x}:{rest.lower()}"
    except ValueError:
        return bus_id.strip().lower()


# --- internals -----------------------------------------------------------------------------


def _gpu_info(nvml: Any, handle: Any, index: int, *, sys_root: Path, warnings: list[str]) -> DeviceInfo:
    target = f"GPU {index}"
    uuid = _text(_call(nvml, "nvmlDeviceGetUUID", handle, target=target))
    target = f"GPU {index} ({uuid})"
    return DeviceInfo(
        slot_name=SLOT_NAME,
        device_id=uuid,
        index=index,
        mother_uuid=uuid,
        model_name=_text(_call(nvml, "nvmlDeviceGetName", handle, target=target)),
        numa_node=_numa_node(nvml, handle, target=target, sys_root=sys_root),
        subproc_count=_sm_count(nvml, handle, target=target, warnings=warnings),
        memory_size=int(_call(nvml, "nvmlDeviceGetMemoryInfo", handle, target=target).total),
    )


def _mig_catalog(nvml: Any, handle: Any, gpu: DeviceInfo, *, warnings: list[str]) -> dict:
    """The GPU's MIG profiles as NVML reports them (`accelerators.plugins.cuda_mig`), in the
    JSON form of `catalog_as_dict`; {} for a GPU without MIG. A driver that cannot say adds a
    warning and no catalog (the manager then uses its built-in table for the model)."""
    from accelerators.allocation.mig import catalog_as_dict
    from accelerators.plugins.cuda_mig import MigNvmlError, catalog_from_nvml

    if getattr(nvml, "nvmlDeviceGetGpuInstanceProfileInfo", None) is None:
        return {}
    try:
        catalog = catalog_from_nvml(nvml, handle, model=gpu.model_name, memory_total=gpu.memory_size)
    except MigNvmlError as exc:
        warnings.append(f"GPU {gpu.index} ({gpu.device_id}): MIG profiles not read: {exc}")
        return {}
    return catalog_as_dict(catalog) if catalog.profiles else {}


def _sm_count(nvml: Any, handle: Any, *, target: str, warnings: list[str]) -> int:
    refused = {_code(nvml, "NVML_ERROR_INVALID_ARGUMENT", 2)}
    attributes = _optional(nvml, "nvmlDeviceGetAttributes", handle, target=target, also_unavailable=refused)
    if attributes is not None and attributes.multiprocessorCount:
        return int(attributes.multiprocessorCount)
    cores = int(_call(nvml, "nvmlDeviceGetNumGpuCores", handle, target=target))
    arch = int(_call(nvml, "nvmlDeviceGetArchitecture", handle, target=target))
    per_sm = _CORES_PER_SM_BY_ARCH.get(arch)
    if arch in _ARCH_WITH_TWO_SM_DESIGNS:
        capability = _optional(nvml, "nvmlDeviceGetCudaComputeCapability", handle, target=target)
        if capability is not None:
            per_sm = _CORES_PER_SM_BY_CC.get((int(capability[0]), int(capability[1])), per_sm)
    if per_sm is None:
        per_sm = _CORES_PER_SM_DEFAULT
        warnings.append(
            f"{target}: NVML architecture code {arch} is not in the cores-per-SM table; "
            f"assumed {per_sm} CUDA cores per SM ({cores} cores → {cores // per_sm} SMs). "
            "Correct subproc_count in the node's device inventory if this is wrong."
        )
    return cores // per_sm


def _numa_node(nvml: Any, handle: Any, *, target: str, sys_root: Path) -> int | None:
    node = _optional(nvml, "nvmlDeviceGetNumaNodeId", handle, target=target)
    if node is not None and int(node) >= 0:
        return int(node)
    pci = _optional(nvml, "nvmlDeviceGetPciInfo", handle, target=target)
    if pci is None:
        return None
    bus_id = _text(pci.busId)
    devices = sys_root / "bus" / "pci" / "devices"
    for name in dict.fromkeys([pci_sysfs_name(bus_id), bus_id.strip().lower()]):
        try:
            value = int((devices / name / "numa_node").read_text().strip())
        except (OSError, ValueError):
            continue
        return value if value >= 0 else None
    return None


def _mig_devices(nvml: Any, handle: Any, gpu: DeviceInfo) -> list[DeviceInfo]:
    target = f"GPU {gpu.index} ({gpu.device_id})"
    mode = _optional(nvml, "nvmlDeviceGetMigMode", handle, target=target)
    if mode is None or int(mode[0]) != _code(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
        return []
    not_found = _code(nvml, "NVML_ERROR_NOT_FOUND", 6)
    devices = []
    for slot in range(int(_call(nvml, "nvmlDeviceGetMaxMigDeviceCount", handle, target=target))):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except nvml.NVMLError as err:
            if err.value == not_found:  # NVML: no MIG device at this index
                continue
            raise _error("nvmlDeviceGetMigDeviceHandleByIndex", err, f"{target} MIG index {slot}") from err
        mig_target = f"{target} MIG index {slot}"
        uuid = _text(_call(nvml, "nvmlDeviceGetUUID", mig, target=mig_target))
        mig_target = f"MIG device {uuid} of {target}"
        attributes = _call(nvml, "nvmlDeviceGetAttributes", mig, target=mig_target)
        devices.append(
            DeviceInfo(
                slot_name=SLOT_NAME,
                device_id=uuid,
                index=gpu.index,
                mother_uuid=gpu.mother_uuid,
                model_name=gpu.model_name,
                numa_node=gpu.numa_node,
                subproc_count=int(attributes.multiprocessorCount),
                memory_size=int(_call(nvml, "nvmlDeviceGetMemoryInfo", mig, target=mig_target).total),
                is_mig_device=True,
                mig_profile=mig_profile_name(
                    gpu_slices=int(attributes.gpuInstanceSliceCount),
                    compute_slices=int(attributes.computeInstanceSliceCount),
                    memory_mib=int(attributes.memorySizeMB),
                    parent_memory=gpu.memory_size,
                ),
                parent_device_id=gpu.device_id,
            )
        )
    return devices


# NVML_TOPOLOGY_* level (nvmlGpuTopologyLevel_t) → nvidia-smi topo's kind; levels are ordered,
# so an unknown level between two known ones takes the next wider kind.
_TOPOLOGY_KINDS = (
    ("NVML_TOPOLOGY_INTERNAL", 0, topology.PIX),
    ("NVML_TOPOLOGY_SINGLE", 10, topology.PIX),
    ("NVML_TOPOLOGY_MULTIPLE", 20, topology.PXB),
    ("NVML_TOPOLOGY_HOSTBRIDGE", 30, topology.PHB),
    ("NVML_TOPOLOGY_NODE", 40, topology.NODE),
)


def _gpu_links(nvml: Any, gpus: list[tuple[Any, DeviceInfo]]) -> list[dict]:
    """`PluginInventory.links` for the whole GPUs `gpus` ((handle, info) in NVML order)."""
    if len(gpus) < 2:
        return []
    by_bus_id: dict[str, str] = {}
    for handle, gpu in gpus:
        pci = _optional(nvml, "nvmlDeviceGetPciInfo", handle, target=f"GPU {gpu.index} ({gpu.device_id})")
        if pci is not None:
            by_bus_id[pci_sysfs_name(_text(pci.busId))] = gpu.device_id
    direct: dict[str, Counter[str]] = {}  # device id → lanes to each other GPU, as it sees them
    switch_lanes: dict[str, int] = {}  # device id → its lanes to NVSwitches
    for handle, gpu in gpus:
        direct[gpu.device_id], switch_lanes[gpu.device_id] = _nvlink_lanes(nvml, handle, gpu, by_bus_id)

    links = []
    for i, (handle_a, a) in enumerate(gpus):
        for handle_b, b in gpus[i + 1 :]:
            lanes = max(direct[a.device_id][b.device_id], direct[b.device_id][a.device_id])
            lanes += min(switch_lanes[a.device_id], switch_lanes[b.device_id])
            if lanes:
                links.append(topology.Link(a.device_id, b.device_id, topology.NVLINK, lanes).as_dict())
                continue
            target = f"GPUs {a.index} and {b.index}"
            level = _optional(nvml, "nvmlDeviceGetTopologyCommonAncestor", handle_a, handle_b, target=target)
            if level is not None:
                links.append(topology.Link(a.device_id, b.device_id, _topology_kind(nvml, int(level))).as_dict())
    return links


def _nvlink_lanes(nvml: Any, handle: Any, gpu: DeviceInfo, by_bus_id: dict[str, str]) -> tuple[Counter[str], int]:
    """(lanes to each other GPU by device id, lanes to NVSwitches) of one GPU's active NVLinks."""
    target = f"GPU {gpu.index} ({gpu.device_id})"
    no_such_link = {_code(nvml, "NVML_ERROR_INVALID_ARGUMENT", 2)}
    enabled = _code(nvml, "NVML_FEATURE_ENABLED", 1)
    switch = _code(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    ibm_npu = _code(nvml, "NVML_NVLINK_DEVICE_TYPE_IBMNPU", 1)
    to_gpus: Counter[str] = Counter()
    to_switches = 0
    for link in range(_code(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        link_target = f"{target} NVLink {link}"
        state = _optional(nvml, "nvmlDeviceGetNvLinkState", handle, link, target=link_target, also_unavailable=no_such_link)
        if state is None or int(state) != enabled:
            continue
        remote_type = _optional(
            nvml, "nvmlDeviceGetNvLinkRemoteDeviceType", handle, link, target=link_target, also_unavailable=no_such_link
        )
        if remote_type is not None and int(remote_type) == switch:
            to_switches += 1
            continue
        if remote_type is not None and int(remote_type) == ibm_npu:
            continue  # NVLink to the CPU (IBM POWER), not to a GPU
        pci = _optional(nvml, "nvmlDeviceGetNvLinkRemotePciInfo", handle, link, target=link_target, also_unavailable=no_such_link)
        if pci is None:
            continue
        remote = by_bus_id.get(pci_sysfs_name(_text(pci.busId)))
        if remote is not None and remote != gpu.device_id:
            to_gpus[remote] += 1
    return to_gpus, to_switches


def _topology_kind(nvml: Any, level: int) -> str:
    for constant, default, kind in _TOPOLOGY_KINDS:
        if level <= _code(nvml, constant, default):
            return kind
    return topology.SYS


def _call(nvml: Any, name: str, *args: Any, target: str = "") -> Any:
    """`nvml.<name>(*args)`; an NVMLError becomes CudaPluginError naming the call."""
    try:
        return getattr(nvml, name)(*args)
    except nvml.NVMLError as err:
        raise _error(name, err, target) from err


def _optional(
    nvml: Any, name: str, *args: Any, target: str = "", also_unavailable: set[int] | frozenset[int] = frozenset()
) -> Any:
    """Like `_call`, but None where the driver does not offer the field (NOT_SUPPORTED,
    FUNCTION_NOT_FOUND, or a binding too old to have the function)."""
    unavailable = {_code(nvml, "NVML_ERROR_NOT_SUPPORTED", 3), _code(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13)}
    function = getattr(nvml, name, None)
    if function is None:
        return None
    try:
        return function(*args)
    except nvml.NVMLError as err:
        if err.value in unavailable or err.value in also_unavailable:
            return None
        raise _error(name, err, target) from err


def _error(name: str, err: Exception, target: str) -> CudaPluginError:
    return CudaPluginError(name, str(err), nvml_code=getattr(err, "value", None), target=target)


def _code(nvml: Any, constant: str, default: int) -> int:
    return int(getattr(nvml, constant, default))
