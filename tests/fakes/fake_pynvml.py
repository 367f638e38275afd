"""A fake of the `pynvml` module (nvidia-ml-py) that behaves like NVML on a node with GPUs.

Pass a `FakeNvml` wherever production code takes `nvml=` (it defaults to the real `pynvml`
module). It exposes the NVML functions our code calls, under their pynvml names and with
pynvml's return shapes, and the module's `NVML_*` constants and `NVMLError` class (the real
ones, so `err.value` and `str(err)` read exactly as with the driver: "Not Supported", …).

Behaviour copied from NVML (nvml.h):

- every call before `nvmlInit` (or after the matching `nvmlShutdown`) raises
  NVML_ERROR_UNINITIALIZED; init/shutdown are reference-counted;
- fields a device does not have raise NVML_ERROR_NOT_SUPPORTED (fan, NUMA node, MIG mode,
  the attributes of a full GPU on older drivers, telemetry of MIG device handles);
- an unknown UUID raises NVML_ERROR_NOT_FOUND, an index out of range INVALID_ARGUMENT, an
  empty MIG index NOT_FOUND;
- with `legacy_bytes=True` text comes back as bytes and nvmlDeviceGetHandleByUUID wants
  bytes, as in pynvml releases before nvidia-ml-py 11.515;
- topology: nvmlDeviceGetTopologyCommonAncestor answers the level given in `topology=`
  for a pair of GPUs, else NVML_TOPOLOGY_NODE for two GPUs on one NUMA node and
  NVML_TOPOLOGY_SYSTEM otherwise; `topology_supported=False` makes it NOT_SUPPORTED;
- NVLink: a GPU's `nvlinks` lists what each of its links reaches (a GPU's UUID, a
  `FakeNvSwitch`, or None for an inactive link). nvmlDeviceGetNvLinkState answers
  NOT_SUPPORTED for every link of a GPU without NVLink (`nvlinks` None),
  INVALID_ARGUMENT for a link index the GPU does not have, else FEATURE_ENABLED /
  FEATURE_DISABLED; nvmlDeviceGetNvLinkRemotePciInfo gives the remote's PCI bus id and
  nvmlDeviceGetNvLinkRemoteDeviceType NVML_NVLINK_DEVICE_TYPE_GPU or _SWITCH.

- MIG instances (a GPU with `mig_model`, a model of the built-in catalog
  `accelerators.allocation.mig`, whose geometry and figures come from nvidia-smi captures):
  profile info and possible placements answer whatever the MIG mode (as NVML documents);
  creating a GPU instance (with an explicit placement) or a compute instance, and destroying
  them, need root (`root=False`: NO_PERMISSION) and MIG mode on (else NOT_SUPPORTED); a
  placement not allowed for the profile is INVALID_ARGUMENT, one over another instance or past
  the profile's max count INSUFFICIENT_RESOURCES; a compute instance adds a MIG device (UUID
  "MIG-…") at the first free MIG index; destroying a compute instance with a process attached,
  or a GPU instance that still has compute instances, is IN_USE. nvmlDeviceSetMigMode on a GPU
  with `mig_reset_required` only sets the pending mode (the current one changes at reset).

Configure with `FakeGpu`s (each with optional `FakeMigDevice`s and `FakeProcess`es), and
inject failures with `fake.fail("nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_GPU_IS_LOST)`.
Sizes are bytes, power milliwatts, as NVML reports them.
"""
from __future__ import annotations

import uuid as uuidlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

from accelerators.allocation import mig as mig_catalog

MiB = 1024 * 1024
GiB = 1024 * MiB
NO_INSTANCE = 0xFFFFFFFF  # NVML's gpuInstanceId/computeInstanceId for a process not in MIG


@dataclass
class FakeProcess:
    """A compute process on a device. `used_memory` in bytes; None = NVML's "not available"."""

    pid: int
    used_memory: int | None
    name: str = "/usr/bin/python3"
    gpu_instance_id: int = NO_INSTANCE
    compute_instance_id: int = NO_INSTANCE


@dataclass
class FakeMigDevice:
    """One MIG device (a GPU instance + compute instance) of a GPU in MIG mode.

    `memory_total` in bytes; `memory_mib` is what nvmlDeviceGetAttributes reports as
    memorySizeMB (defaults to memory_total in MiB); `compute_slices` defaults to `gpu_slices`.
    `profile` only shapes the name NVML gives the device ("<GPU name> MIG 1g.10gb").
    """

    uuid: str
    memory_total: int
    sm_count: int
    gpu_slices: int
    compute_slices: int | None = None
    memory_mib: int | None = None
    profile: str = ""
    gpu_instance_id: int = 1
    compute_instance_id: int = 0
    processes: list[FakeProcess] = field(default_factory=list)


@dataclass(frozen=True)
class FakeNvSwitch:
    """The far end of an NVLink that goes to an NVSwitch (DGX/HGX baseboards), by PCI bus id."""

    pci_bus_id: str = "00000000:C0:00.0"


@dataclass
class FakeGpu:
    """One physical GPU as NVML reports it.

    `numa_node`, `mig_mode`, `fan_speed`, `cuda_cores`, `ecc_uncorrected`: None → the call
    raises NOT_SUPPORTED. `attributes_supported=False`: nvmlDeviceGetAttributes refuses the
    full GPU (NOT_SUPPORTED), as drivers that answer it for MIG devices only do.
    `mig_devices[i]` is the MIG device at MIG index i (None: an empty index).
    `nvlinks[i]` is what NVLink i reaches: another GPU's UUID, a FakeNvSwitch, or None
    (inactive); `nvlinks` None: the GPU has no NVLink (PCIe cards).
    """

    uuid: str
    name: str = "NVIDIA A100-SXM4-80GB"
    memory_total: int = 80 * GiB
    sm_count: int = 108
    architecture: int = pynvml.NVML_DEVICE_ARCH_AMPERE
    compute_capability: tuple[int, int] = (8, 0)
    cuda_cores: int | None = 6912
    attributes_supported: bool = True
    numa_node: int | None = 0
    pci_bus_id: str = "00000000:07:00.0"
    mig_mode: int | None = pynvml.NVML_DEVICE_MIG_DISABLE
    max_mig_devices: int = 7
    mig_devices: list[FakeMigDevice | None] = field(default_factory=list)
    processes: list[FakeProcess] = field(default_factory=list)
    graphics_processes: list[FakeProcess] = field(default_factory=list)  # a display's (X, a renderer)
    utilization: int = 0
    temperature: int = 30
    power_usage_mw: int = 60_000
    power_limit_mw: int = 400_000
    perf_state: int = 0
    fan_speed: int | None = None
    persistence_mode: int = pynvml.NVML_FEATURE_ENABLED
    compute_mode: int = pynvml.NVML_COMPUTEMODE_DEFAULT
    display_active: int = pynvml.NVML_FEATURE_DISABLED
    ecc_uncorrected: int | None = 0
    nvlinks: list[str | FakeNvSwitch | None] | None = None
    mig_model: str | None = None  # a model of accelerators.allocation.mig.CATALOGS: MIG-capable
    mig_mode_pending: int | None = None  # None: as the current mode
    mig_reset_required: bool = False  # SetMigMode changes only the pending mode (A100 needs a reset)
    gpu_instances: list["FakeGpuInstance"] = field(default_factory=list)
    minor_number: int | None = None  # its /dev/nvidia<minor> (nvmlDeviceGetMinorNumber); None: its index


@dataclass(eq=False)
class FakeGpuInstance:
    """A GPU instance: `profile` from the GPU's catalog, at memory slice `start`; its compute
    instances map compute-instance id → the MIG device they make visible."""

    id: int
    profile: Any  # accelerators.allocation.mig.MigProfile
    start: int
    compute_instances: dict[int, FakeMigDevice] = field(default_factory=dict)


@dataclass(eq=False)
class FakeGiHandle:
    """An nvmlGpuInstance_t."""

    gpu: "FakeGpu"
    instance: FakeGpuInstance


@dataclass(eq=False)
class FakeCiHandle:
    """An nvmlComputeInstance_t."""

    gpu: "FakeGpu"
    instance: FakeGpuInstance
    ci_id: int


@dataclass(eq=False)
class FakeHandle:
    """An nvmlDevice_t: a full GPU (`mig` None) or one of its MIG devices."""

    gpu: FakeGpu
    mig: FakeMigDevice | None = None


class FakeNvml:
    """Stands in for the `pynvml` module. Methods are NVML's functions, pynvml-named."""

    NVMLError = pynvml.NVMLError

    def __init__(
        self,
        gpus: list[FakeGpu],
        *,
        driver_version: str = "550.54.15",
        cuda_driver_version: int = 12040,
        legacy_bytes: bool = False,
        topology: dict[tuple[str, str], int] | None = None,
        topology_supported: bool = True,
        root: bool = True,
    ) -> None:
        self.gpus = gpus
        self.root = root
        # (uuid, uuid) in either order → NVML_TOPOLOGY_* level of their common ancestor.
        self.topology = {frozenset(pair): level for pair, level in (topology or {}).items()}
        self.topology_supported = topology_supported
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self.legacy_bytes = legacy_bytes
        self.failures: dict[str, int] = {}
        self.init_count = 0
        self.shutdown_count = 0
        self._refcount = 0

    def __getattr__(self, name: str) -> Any:
        # The module's constants (NVML_ERROR_NOT_SUPPORTED, NVML_DEVICE_ARCH_HOPPER, …).
        if name.startswith("NVML_"):
            return getattr(pynvml, name)
        raise AttributeError(f"FakeNvml has no NVML function {name!r}")

    # --- test controls -------------------------------------------------------------------

    def fail(self, call: str, code: int) -> None:
        """Make every later `call` (an NVML function name) raise NVMLError(code)."""
        self.failures[call] = code

    @property
    def initialized(self) -> bool:
        return self._refcount > 0

    # --- init / system -----------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._check_failure("nvmlInit")
        self._refcount += 1
        self.init_count += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self._refcount -= 1
        self.shutdown_count += 1

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        self._enter("nvmlSystemGetDriverVersion")
        return self._text(self.driver_version)

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self.cuda_driver_version

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion_v2")
        return self.cuda_driver_version

    def nvmlSystemGetProcessName(self, pid: int) -> str | bytes:
        self._enter("nvmlSystemGetProcessName")
        for process in self._all_processes():
            if process.pid == pid:
                return self._text(process.name)
        raise self.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    # --- handles -----------------------------------------------------------------------

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise self.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return FakeHandle(self.gpus[index])

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByUUID")
        if isinstance(uuid, str):
            if self.legacy_bytes:  # old pynvml passed the argument straight to ctypes.c_char_p
                raise TypeError("bytes or integer address expected instead of str instance")
            uuid = uuid.encode()
        wanted = uuid.decode()
        for gpu in self.gpus:
            if gpu.uuid == wanted:
                return FakeHandle(gpu)
            for mig in gpu.mig_devices:
                if mig is not None and mig.uuid == wanted:
                    return FakeHandle(gpu, mig)
        raise self.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetIndex(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetIndex")
        self._full_gpu_only(handle)
        return self.gpus.index(handle.gpu)

    def nvmlDeviceGetMinorNumber(self, handle: FakeHandle) -> int:
        """The GPU's /dev/nvidia<minor>: `minor_number`, else its index (a MIG handle: INVALID_ARGUMENT)."""
        self._enter("nvmlDeviceGetMinorNumber")
        self._full_gpu_only(handle)
        return handle.gpu.minor_number if handle.gpu.minor_number is not None else self.gpus.index(handle.gpu)

    # --- identity and capacity ---------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str | bytes:
        self._enter("nvmlDeviceGetUUID")
        return self._text(handle.mig.uuid if handle.mig else handle.gpu.uuid)

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str | bytes:
        self._enter("nvmlDeviceGetName")
        if handle.mig:
            return self._text(f"{handle.gpu.name} MIG {handle.mig.profile}".rstrip())
        return self._text(handle.gpu.name)

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle, version: int | None = None) -> SimpleNamespace:
        self._enter("nvmlDeviceGetMemoryInfo")
        total = handle.mig.memory_total if handle.mig else handle.gpu.memory_total
        used = sum(p.used_memory or 0 for p in self._processes(handle))
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetAttributes(self, handle: FakeHandle) -> SimpleNamespace:
        self._enter("nvmlDeviceGetAttributes")
        mig, gpu = handle.mig, handle.gpu
        if mig is None:
            if not gpu.attributes_supported:
                raise self.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return self._attributes(gpu.sm_count, 0, 0, gpu.memory_total // MiB)
        compute_slices = mig.compute_slices if mig.compute_slices is not None else mig.gpu_slices
        memory_mib = mig.memory_mib if mig.memory_mib is not None else mig.memory_total // MiB
        return self._attributes(mig.sm_count, mig.gpu_slices, compute_slices, memory_mib)

    def nvmlDeviceGetNumGpuCores(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetNumGpuCores")
        self._full_gpu_only(handle)
        return self._supported(handle.gpu.cuda_cores)

    def nvmlDeviceGetArchitecture(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetArchitecture")
        return handle.gpu.architecture

    def nvmlDeviceGetCudaComputeCapability(self, handle: FakeHandle) -> tuple[int, int]:
        self._enter("nvmlDeviceGetCudaComputeCapability")
        return handle.gpu.compute_capability

    def nvmlDeviceGetNumaNodeId(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetNumaNodeId")
        return self._supported(handle.gpu.numa_node)

    def nvmlDeviceGetPciInfo(self, handle: FakeHandle) -> SimpleNamespace:
        self._enter("nvmlDeviceGetPciInfo")
        return self._pci_info(handle.gpu.pci_bus_id)

    @staticmethod
    def _pci_info(bus_id: str) -> SimpleNamespace:
        domain, bus, rest = bus_id.split(":")
        device = rest.split(".")[0]
        # pynvml returns the ctypes struct: busId is a char array, i.e. bytes, in every release.
        return SimpleNamespace(
            busId=bus_id.encode(), busIdLegacy=bus_id.encode(),
            domain=int(domain, 16), bus=int(bus, 16), device=int(device, 16),
        )

    # --- topology and NVLink -------------------------------------------------------------

    def nvmlDeviceGetTopologyCommonAncestor(self, first: FakeHandle, second: FakeHandle) -> int:
        self._enter("nvmlDeviceGetTopologyCommonAncestor")
        self._full_gpu_only(first)
        self._full_gpu_only(second)
        if not self.topology_supported:
            raise self.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        a, b = first.gpu, second.gpu
        if a is b:
            return pynvml.NVML_TOPOLOGY_INTERNAL
        level = self.topology.get(frozenset((a.uuid, b.uuid)))
        if level is not None:
            return level
        if a.numa_node is not None and a.numa_node == b.numa_node:
            return pynvml.NVML_TOPOLOGY_NODE
        return pynvml.NVML_TOPOLOGY_SYSTEM

    def nvmlDeviceGetNvLinkState(self, handle: FakeHandle, link: int) -> int:
        self._enter("nvmlDeviceGetNvLinkState")
        remote = self._nvlink(handle, link)
        return pynvml.NVML_FEATURE_DISABLED if remote is None else pynvml.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: FakeHandle, link: int) -> int:
        self._enter("nvmlDeviceGetNvLinkRemoteDeviceType")
        remote = self._active_nvlink(handle, link)
        if isinstance(remote, FakeNvSwitch):
            return pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
        return pynvml.NVML_NVLINK_DEVICE_TYPE_GPU

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: FakeHandle, link: int) -> SimpleNamespace:
        self._enter("nvmlDeviceGetNvLinkRemotePciInfo")
        remote = self._active_nvlink(handle, link)
        if isinstance(remote, FakeNvSwitch):
            return self._pci_info(remote.pci_bus_id)
        for gpu in self.gpus:
            if gpu.uuid == remote:
                return self._pci_info(gpu.pci_bus_id)
        raise self.NVMLError(pynvml.NVML_ERROR_UNKNOWN)  # a test wired a link to no GPU

    # --- MIG ---------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, handle: FakeHandle) -> list[int]:
        self._enter("nvmlDeviceGetMigMode")
        if handle.mig:
            raise self.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        mode = self._supported(handle.gpu.mig_mode)
        pending = mode if handle.gpu.mig_mode_pending is None else handle.gpu.mig_mode_pending
        return [mode, pending]  # [current, pending]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetMaxMigDeviceCount")
        self._full_gpu_only(handle)
        return handle.gpu.max_mig_devices if handle.gpu.mig_mode == pynvml.NVML_DEVICE_MIG_ENABLE else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeHandle, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex")
        self._full_gpu_only(handle)
        gpu = handle.gpu
        if gpu.mig_mode != pynvml.NVML_DEVICE_MIG_ENABLE:
            raise self.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not 0 <= index < gpu.max_mig_devices:
            raise self.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        mig = gpu.mig_devices[index] if index < len(gpu.mig_devices) else None
        if mig is None:
            raise self.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return FakeHandle(gpu, mig)

    def nvmlDeviceIsMigDeviceHandle(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceIsMigDeviceHandle")
        return int(handle.mig is not None)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: FakeHandle) -> FakeHandle:
        self._enter("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
        if handle.mig is None:
            raise self.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return FakeHandle(handle.gpu)

    def nvmlDeviceSetMigMode(self, handle: FakeHandle, mode: int) -> int:
        self._enter("nvmlDeviceSetMigMode")
        self._full_gpu_only(handle)
        gpu = handle.gpu
        if gpu.mig_model is None:
            raise self.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self._need_root()
        if gpu.gpu_instances and mode != pynvml.NVML_DEVICE_MIG_ENABLE:
            raise self.NVMLError(pynvml.NVML_ERROR_IN_USE)
        if gpu.mig_reset_required:
            gpu.mig_mode_pending = mode
            return pynvml.NVML_ERROR_RESET_REQUIRED  # pynvml returns the activation status
        gpu.mig_mode, gpu.mig_mode_pending = mode, None
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: FakeHandle, profile: int, version: int = 2) -> SimpleNamespace:
        self._enter("nvmlDeviceGetGpuInstanceProfileInfo")
        self._full_gpu_only(handle)
        if not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise self.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        found = self._catalog(handle.gpu).by_nvml_profile(profile)
        if found is None:
            raise self.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self._profile_info(handle.gpu, found)

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, handle: FakeHandle, profile_id: int, placements_ref: Any,
                                                   count_ref: Any) -> int:
        self._enter("nvmlDeviceGetGpuInstancePossiblePlacements")
        self._full_gpu_only(handle)
        profile = self._profile_by_id(handle.gpu, profile_id)
        count = _deref(count_ref)
        if placements_ref is not None:
            for i, start in enumerate(profile.starts):
                placements_ref[i].start, placements_ref[i].size = start, profile.size
        count.value = len(profile.starts)
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, handle: FakeHandle, profile_id: int) -> int:
        self._enter("nvmlDeviceGetGpuInstanceRemainingCapacity")
        self._full_gpu_only(handle)
        gpu = handle.gpu
        profile = self._profile_by_id(gpu, profile_id)
        if gpu.mig_mode != pynvml.NVML_DEVICE_MIG_ENABLE:
            return 0
        layout = self._layout(gpu)
        count = 0
        while True:  # how many more fit, placed one after another at the lowest free start
            start = next((s for s in profile.starts if self._placement_problem(gpu, profile, s, layout) is None), None)
            if start is None:
                return count
            layout.append(mig_catalog.MigInstance(key=f"r{count}", profile=profile.name, start=start, in_use=True))
            count += 1

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, handle: FakeHandle, profile_id: int, placement: Any) -> FakeGiHandle:
        self._enter("nvmlDeviceCreateGpuInstanceWithPlacement")
        self._full_gpu_only(handle)
        gpu = handle.gpu
        self._need_root()
        self._need_mig(gpu)
        profile = self._profile_by_id(gpu, profile_id)
        placement = _deref(placement)
        start, size = int(placement.start), int(placement.size)
        if start not in profile.starts or size != profile.size:
            raise self.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        problem = self._placement_problem(gpu, profile, start, self._layout(gpu))
        if problem is not None:
            raise self.NVMLError(problem)
        ids = {gi.id for gi in gpu.gpu_instances}
        instance = FakeGpuInstance(id=next(i for i in range(1, 64) if i not in ids), profile=profile, start=start)
        gpu.gpu_instances.append(instance)
        return FakeGiHandle(gpu, instance)

    def nvmlDeviceGetGpuInstanceById(self, handle: FakeHandle, gpu_instance_id: int) -> FakeGiHandle:
        self._enter("nvmlDeviceGetGpuInstanceById")
        self._full_gpu_only(handle)
        self._need_mig(handle.gpu)
        for instance in handle.gpu.gpu_instances:
            if instance.id == gpu_instance_id:
                return FakeGiHandle(handle.gpu, instance)
        raise self.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlGpuInstanceGetInfo(self, gi: FakeGiHandle) -> SimpleNamespace:
        self._enter("nvmlGpuInstanceGetInfo")
        self._live(gi)
        instance = gi.instance
        return SimpleNamespace(device=FakeHandle(gi.gpu), id=instance.id, profileId=instance.profile.profile_id,
                               placement=SimpleNamespace(start=instance.start, size=instance.profile.size))

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gi: FakeGiHandle, profile: int, eng_profile: int,
                                                     version: int = 2) -> SimpleNamespace:
        self._enter("nvmlGpuInstanceGetComputeInstanceProfileInfo")
        self._live(gi)
        slices = _CI_PROFILE_SLICES.get(profile)
        if slices is None or slices > gi.instance.profile.compute_slices:
            raise self.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        sms = gi.instance.profile.sm_count_for(gi.gpu.sm_count) * slices // gi.instance.profile.compute_slices
        return SimpleNamespace(id=profile, sliceCount=slices, instanceCount=gi.instance.profile.compute_slices // slices,
                               multiprocessorCount=sms)

    def nvmlGpuInstanceCreateComputeInstance(self, gi: FakeGiHandle, profile_id: int) -> FakeCiHandle:
        self._enter("nvmlGpuInstanceCreateComputeInstance")
        self._live(gi)
        self._need_root()
        gpu, instance = gi.gpu, gi.instance
        slices = _CI_PROFILE_SLICES.get(profile_id)
        if slices is None or slices > instance.profile.compute_slices:
            raise self.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if instance.compute_instances:  # the fake holds one compute instance per GPU instance
            raise self.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        if None not in gpu.mig_devices and len(gpu.mig_devices) >= gpu.max_mig_devices:
            raise self.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        profile = instance.profile
        device = FakeMigDevice(
            uuid=f"MIG-{uuidlib.uuid5(uuidlib.NAMESPACE_URL, f'{gpu.uuid}/{instance.id}/{self._serial()}')}",
            memory_total=profile.memory, sm_count=profile.sm_count_for(gpu.sm_count), gpu_slices=profile.compute_slices,
            compute_slices=slices, profile=profile.name, gpu_instance_id=instance.id, compute_instance_id=0)
        instance.compute_instances[0] = device
        if None in gpu.mig_devices:
            gpu.mig_devices[gpu.mig_devices.index(None)] = device
        else:
            gpu.mig_devices.append(device)
        return FakeCiHandle(gpu, instance, 0)

    def nvmlGpuInstanceGetComputeInstanceById(self, gi: FakeGiHandle, ci_id: int) -> FakeCiHandle:
        self._enter("nvmlGpuInstanceGetComputeInstanceById")
        self._live(gi)
        if ci_id not in gi.instance.compute_instances:
            raise self.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return FakeCiHandle(gi.gpu, gi.instance, ci_id)

    def nvmlComputeInstanceGetInfo(self, ci: FakeCiHandle) -> SimpleNamespace:
        self._enter("nvmlComputeInstanceGetInfo")
        self._live_ci(ci)
        return SimpleNamespace(device=FakeHandle(ci.gpu), gpuInstance=FakeGiHandle(ci.gpu, ci.instance), id=ci.ci_id,
                               profileId=0, placement=SimpleNamespace(start=0, size=ci.instance.profile.compute_slices))

    def nvmlComputeInstanceDestroy(self, ci: FakeCiHandle) -> int:
        self._enter("nvmlComputeInstanceDestroy")
        self._live_ci(ci)
        self._need_root()
        device = ci.instance.compute_instances[ci.ci_id]
        if device.processes:
            raise self.NVMLError(pynvml.NVML_ERROR_IN_USE)
        del ci.instance.compute_instances[ci.ci_id]
        ci.gpu.mig_devices[ci.gpu.mig_devices.index(device)] = None
        return pynvml.NVML_SUCCESS

    def nvmlGpuInstanceDestroy(self, gi: FakeGiHandle) -> int:
        self._enter("nvmlGpuInstanceDestroy")
        self._live(gi)
        self._need_root()
        if gi.instance.compute_instances:
            raise self.NVMLError(pynvml.NVML_ERROR_IN_USE)
        gi.gpu.gpu_instances.remove(gi.instance)
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetGpuInstanceId(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetGpuInstanceId")
        if handle.mig is None:
            raise self.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return handle.mig.gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetComputeInstanceId")
        if handle.mig is None:
            raise self.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return handle.mig.compute_instance_id

    # --- MIG internals -------------------------------------------------------------------

    def _catalog(self, gpu: FakeGpu):
        if gpu.mig_model is None:
            raise self.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return mig_catalog.CATALOGS[gpu.mig_model]

    def _profile_by_id(self, gpu: FakeGpu, profile_id: int):
        for profile in self._catalog(gpu).profiles:
            if profile.profile_id == profile_id:
                return profile
        raise self.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _profile_info(self, gpu: FakeGpu, profile) -> SimpleNamespace:
        return SimpleNamespace(
            version=2, id=profile.profile_id, isP2pSupported=0, sliceCount=profile.compute_slices,
            instanceCount=profile.max_instances, multiprocessorCount=profile.sm_count_for(gpu.sm_count),
            copyEngineCount=profile.compute_slices, decoderCount=0, encoderCount=0, jpegCount=0, ofaCount=0,
            memorySizeMB=profile.memory // MiB, name=self._text(f"MIG {profile.name}"))

    def _layout(self, gpu: FakeGpu) -> list:
        return [mig_catalog.MigInstance(key=str(gi.id), profile=gi.profile.name, start=gi.start, in_use=True)
                for gi in gpu.gpu_instances]

    def _placement_problem(self, gpu: FakeGpu, profile, start: int, layout: list) -> int | None:
        catalog = self._catalog(gpu)
        candidate = [*layout, mig_catalog.MigInstance(key="new", profile=profile.name, start=start, in_use=True)]
        return pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES if mig_catalog.layout_problems(catalog, candidate) else None

    def _need_root(self) -> None:
        if not self.root:
            raise self.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)

    def _need_mig(self, gpu: FakeGpu) -> None:
        if gpu.mig_mode != pynvml.NVML_DEVICE_MIG_ENABLE:
            raise self.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def _live(self, gi: FakeGiHandle) -> None:
        if gi.instance not in gi.gpu.gpu_instances:
            raise self.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # a destroyed instance's handle

    def _live_ci(self, ci: FakeCiHandle) -> None:
        self._live(FakeGiHandle(ci.gpu, ci.instance))
        if ci.ci_id not in ci.instance.compute_instances:
            raise self.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _serial(self) -> int:
        self._created = getattr(self, "_created", 0) + 1
        return self._created

    # --- processes and telemetry -------------------------------------------------------

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[SimpleNamespace]:
        self._enter("nvmlDeviceGetComputeRunningProcesses")
        return [
            SimpleNamespace(
                pid=p.pid, usedGpuMemory=p.used_memory,
                gpuInstanceId=p.gpu_instance_id, computeInstanceId=p.compute_instance_id,
            )
            for p in self._processes(handle)
        ]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeHandle) -> list[SimpleNamespace]:
        self._enter("nvmlDeviceGetGraphicsRunningProcesses")
        self._full_gpu_only(handle, code=pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [SimpleNamespace(pid=p.pid, usedGpuMemory=p.used_memory, gpuInstanceId=p.gpu_instance_id,
                                computeInstanceId=p.compute_instance_id) for p in handle.gpu.graphics_processes]

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> SimpleNamespace:
        self._enter("nvmlDeviceGetUtilizationRates")
        self._full_gpu_only(handle, code=pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=handle.gpu.utilization, memory=0)

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        self._enter("nvmlDeviceGetTemperature")
        self._full_gpu_only(handle, code=pynvml.NVML_ERROR_NOT_SUPPORTED)
        return handle.gpu.temperature

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetPowerUsage")
        self._full_gpu_only(handle, code=pynvml.NVML_ERROR_NOT_SUPPORTED)
        return handle.gpu.power_usage_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetEnforcedPowerLimit")
        self._full_gpu_only(handle, code=pynvml.NVML_ERROR_NOT_SUPPORTED)
        return handle.gpu.power_limit_mw

    def nvmlDeviceGetPerformanceState(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetPerformanceState")
        self._full_gpu_only(handle, code=pynvml.NVML_ERROR_NOT_SUPPORTED)
        return handle.gpu.perf_state

    def nvmlDeviceGetFanSpeed(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetFanSpeed")
        self._full_gpu_only(handle, code=pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self._supported(handle.gpu.fan_speed)

    def nvmlDeviceGetPersistenceMode(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetPersistenceMode")
        return handle.gpu.persistence_mode

    def nvmlDeviceGetComputeMode(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetComputeMode")
        return handle.gpu.compute_mode

    def nvmlDeviceGetDisplayActive(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetDisplayActive")
        return handle.gpu.display_active

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeHandle, error_type: int, counter_type: int) -> int:
        self._enter("nvmlDeviceGetTotalEccErrors")
        return self._supported(handle.gpu.ecc_uncorrected)

    # --- internals ---------------------------------------------------------------------

    def _enter(self, call: str) -> None:
        if self._refcount <= 0:
            raise self.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        self._check_failure(call)

    def _check_failure(self, call: str) -> None:
        if call in self.failures:
            raise self.NVMLError(self.failures[call])

    def _supported(self, value: Any) -> Any:
        if value is None:
            raise self.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    def _full_gpu_only(self, handle: FakeHandle, *, code: int = pynvml.NVML_ERROR_INVALID_ARGUMENT) -> None:
        if handle.mig is not None:
            raise self.NVMLError(code)

    def _nvlink(self, handle: FakeHandle, link: int) -> str | FakeNvSwitch | None:
        self._full_gpu_only(handle)
        links = handle.gpu.nvlinks
        if links is None:
            raise self.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < len(links):
            raise self.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return links[link]

    def _active_nvlink(self, handle: FakeHandle, link: int) -> str | FakeNvSwitch:
        remote = self._nvlink(handle, link)
        if remote is None:
            raise self.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return remote

    def _processes(self, handle: FakeHandle) -> list[FakeProcess]:
        if handle.mig is not None:
            return list(handle.mig.processes)
        # A full GPU's handle reports its own processes and those of all its MIG devices.
        return [*handle.gpu.processes, *(p for m in handle.gpu.mig_devices if m for p in m.processes)]

    def _all_processes(self) -> list[FakeProcess]:
        return [p for gpu in self.gpus for p in self._processes(FakeHandle(gpu))]

    def _text(self, value: str) -> str | bytes:
        return value.encode() if self.legacy_bytes else value

    @staticmethod
    def _attributes(sm_count: int, gpu_slices: int, compute_slices: int, memory_mib: int) -> SimpleNamespace:
        return SimpleNamespace(
            multiprocessorCount=sm_count, sharedCopyEngineCount=0, sharedDecoderCount=0,
            sharedEncoderCount=0, sharedJpegCount=0, sharedOfaCount=0,
            gpuInstanceSliceCount=gpu_slices, computeInstanceSliceCount=compute_slices,
            memorySizeMB=memory_mib,
        )


# NVML_COMPUTE_INSTANCE_PROFILE_* → compute slices (nvml.h).
_CI_PROFILE_SLICES = {
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE: 1, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE: 2,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE: 3, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE: 4,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE: 7,
}


def _deref(ref: Any) -> Any:
    """What a ctypes `byref(x)` points to (x), or the object itself when passed directly."""
    return getattr(ref, "_obj", ref)
