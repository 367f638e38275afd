"""MIG through NVML (pynvml): a GPU's profile catalog, its GPU instances, creating and destroying them.

Calls, as the NVIDIA MIG User Guide and nvml.h describe them:

- catalog: `nvmlDeviceGetGpuInstanceProfileInfo(handle, NVML_GPU_INSTANCE_PROFILE_*)` for every
  profile index (NOT_SUPPORTED / INVALID_ARGUMENT: the GPU lacks it) and
  `nvmlDeviceGetGpuInstancePossiblePlacements(handle, info.id, placements, count)` (the
  `_v2` C call: every placement, whatever instances exist);
- instances: each GPU instance id through `nvmlDeviceGetGpuInstanceById` (NOT_FOUND: none),
  then `nvmlGpuInstanceGetInfo` (profile id, placement) and its compute instance's MIG device
  found by `nvmlDeviceGetMigDeviceHandleByIndex` + `nvmlDeviceGetGpuInstanceId`;
- create: `nvmlDeviceCreateGpuInstanceWithPlacement`, then a compute instance over the whole
  GPU instance (`nvmlGpuInstanceGetComputeInstanceProfileInfo` +
  `nvmlGpuInstanceCreateComputeInstance`); a failed compute instance destroys its GPU
  instance again, so no slices leak;
- destroy: compute instances first (`nvmlComputeInstanceDestroy`), then the GPU instance
  (`nvmlGpuInstanceDestroy`); both fail with NVML_ERROR_IN_USE while a process is attached.

Every NVML failure raises `MigNvmlError` with the reason in words (`reason_in_words`).
Pass `nvml=` the pynvml module (default) or a fake with the same functions.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import pynvml

from accelerators.allocation.mig import MigCatalog, MigProfile
from accelerators.plugins.nvml_names import mig_profile_name
from accelerators.plugins.nvml_names import nvml_text as _text

MiB = 1 << 20
MAX_GPU_INSTANCE_ID = 32  # NVML numbers GPU instances from 1; a GPU has at most 7 (+ none spare)
# NVML_GPU_INSTANCE_PROFILE_* index → the suffix nvidia-smi adds to the name (nvml.h comments).
_SUFFIXES = {
    7: "+me",
    8: "+me",
    13: "-me",
    14: "-me",
    15: "+me.all",
    16: "+me.all",
    10: "+gfx",
    11: "+gfx",
    12: "+gfx",
    17: "+gfx",
}
# compute slices → NVML_COMPUTE_INSTANCE_PROFILE_* (a compute instance over the whole GPU instance)
_CI_PROFILES = {1: 0, 2: 1, 3: 2, 4: 3, 6: 6, 7: 4, 8: 5}


class MigNvmlError(RuntimeError):
    """An NVML MIG call failed. `call` names it, `code` is NVML's error code, `reason` the
    cause in words (what `str()` gives, with the call)."""

    def __init__(self, call: str, code: int | None, reason: str) -> None:
        self.call, self.code, self.reason = call, code, reason
        super().__init__(f"{reason} ({call}: NVML error {code})")


def reason_in_words(code: int | None, *, call: str = "") -> str:
    """NVML's MIG error codes → what a user reads: IN_USE, INSUFFICIENT_RESOURCES,
    NO_PERMISSION, NOT_SUPPORTED (MIG mode off), RESET_REQUIRED, else NVML's own string."""
    words = {
        pynvml.NVML_ERROR_IN_USE: "the MIG instance is in use: a process is still attached to it",
        pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES: "the GPU has no room for this MIG instance at that placement "
        "(insufficient resources)",
        pynvml.NVML_ERROR_NO_PERMISSION: "the agent may not change MIG instances (it must run as root)",
        pynvml.NVML_ERROR_NOT_SUPPORTED: "MIG mode is off on this GPU (or the GPU does not support MIG)",
        pynvml.NVML_ERROR_RESET_REQUIRED: "the GPU must be reset before its MIG mode change takes effect",
        pynvml.NVML_ERROR_INVALID_ARGUMENT: "NVML refused the MIG placement or profile (invalid argument)",
        pynvml.NVML_ERROR_NOT_FOUND: "the MIG instance does not exist (any more)",
    }
    if code in words:
        return words[code]
    try:
        return f"NVML error: {pynvml.NVMLError(code)}"
    except Exception:  # noqa: BLE001 - an unknown code
        return f"NVML error {code}"


def call(nvml: Any, name: str, *args: Any) -> Any:
    """`nvml.<name>(*args)`; an NVMLError becomes MigNvmlError."""
    try:
        return getattr(nvml, name)(*args)
    except nvml.NVMLError as err:
        code = getattr(err, "value", None)
        raise MigNvmlError(name, code, reason_in_words(code, call=name)) from err


def mig_enabled(nvml: Any, handle: Any) -> None:
    """Raises MigNvmlError (NOT_SUPPORTED / RESET_REQUIRED in words) unless MIG mode is on now."""
    try:
        current, pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError as err:
        raise MigNvmlError("nvmlDeviceGetMigMode", err.value, reason_in_words(err.value)) from err
    if int(current) == pynvml.NVML_DEVICE_MIG_ENABLE:
        return
    code = pynvml.NVML_ERROR_RESET_REQUIRED if int(pending) == pynvml.NVML_DEVICE_MIG_ENABLE else pynvml.NVML_ERROR_NOT_SUPPORTED
    raise MigNvmlError("nvmlDeviceGetMigMode", code, reason_in_words(code))


def possible_placements(nvml: Any, handle: Any, profile_id: int) -> list[tuple[int, int]]:
    """[(start, size)] in memory slices for the profile with NVML id `profile_id`."""
    placements = (pynvml.c_nvmlGpuInstancePlacement_t * 8)()
    count = ctypes.c_uint(0)
    call(nvml, "nvmlDeviceGetGpuInstancePossiblePlacements", handle, profile_id, placements, ctypes.byref(count))
    return [(int(placements[i].start), int(placements[i].size)) for i in range(count.value)]


def catalog_from_nvml(nvml: Any, handle: Any, *, model: str, memory_total: int, sm_count: int = 0) -> MigCatalog:
    """The GPU's MIG catalog as NVML reports it: one MigProfile per profile index the GPU has,
    named as nvidia-smi names it (NVML's own name "MIG 1g.10gb" without "MIG ", else the
    go-nvlib rule of `mig_profile_name` plus "+me" etc.), memory from memorySizeMB (bytes),
    SMs from multiprocessorCount, max count from instanceCount, starts and size from the
    possible placements. `memory_total`: the whole GPU's memory in bytes."""
    profiles = []
    for index in range(int(getattr(nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT))):
        try:
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)
        except nvml.NVMLError as err:
            if err.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                continue
            raise MigNvmlError("nvmlDeviceGetGpuInstanceProfileInfo", err.value, reason_in_words(err.value)) from err
        placements = possible_placements(nvml, handle, int(info.id))
        if not placements:
            continue
        name = _text(getattr(info, "name", b"") or "").strip()
        name = name[4:] if name.startswith("MIG ") else ""
        if not name:
            name = mig_profile_name(
                gpu_slices=int(info.sliceCount),
                compute_slices=int(info.sliceCount),
                memory_mib=int(info.memorySizeMB),
                parent_memory=memory_total,
            ) + _SUFFIXES.get(index, "")
        size = placements[0][1]
        profiles.append(
            MigProfile(
                name=name.lower(),
                nvml_profile=index,
                profile_id=int(info.id),
                compute_slices=int(info.sliceCount),
                memory_slices=size,
                memory=int(info.memorySizeMB) * MiB,
                sm_count=int(info.multiprocessorCount),
                max_instances=int(info.instanceCount),
                starts=tuple(s for s, _ in placements),
                size=size,
            )
        )
    profiles.sort(key=lambda p: (p.memory, p.memory_slices, p.compute_slices, p.media_extensions, p.nvml_profile))
    return MigCatalog(model=model, profiles=tuple(profiles), source="NVML on the node")


@dataclass(frozen=True)
class LiveInstance:
    """A GPU instance found on (or created on) a GPU: its profile name, placement (memory
    slices), NVML ids, and the MIG device UUID of its compute instance ("" when it has none)."""

    gpu: str
    profile: str
    start: int
    size: int
    gpu_instance_id: int
    uuid: str = ""
    memory: int = 0
    sm_count: int = 0


def list_instances(nvml: Any, handle: Any, *, gpu: str, catalog: MigCatalog) -> list[LiveInstance]:
    """Every GPU instance of the GPU, by placement start. MIG mode off: none."""
    try:
        mig_enabled(nvml, handle)
    except MigNvmlError:
        return []
    devices = _mig_devices(nvml, handle)
    by_id = {p.profile_id: p for p in catalog.profiles}
    found = []
    for gi_id in range(1, MAX_GPU_INSTANCE_ID):
        try:
            gi = nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
        except nvml.NVMLError as err:
            if err.value in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                continue
            raise MigNvmlError("nvmlDeviceGetGpuInstanceById", err.value, reason_in_words(err.value)) from err
        info = call(nvml, "nvmlGpuInstanceGetInfo", gi)
        profile = by_id.get(int(info.profileId))
        uuid, memory, sms = devices.get(gi_id, ("", 0, 0))
        found.append(
            LiveInstance(
                gpu=gpu,
                profile=profile.name if profile else f"profile-id-{info.profileId}",
                start=int(info.placement.start),
                size=int(info.placement.size),
                gpu_instance_id=gi_id,
                uuid=uuid,
                memory=memory or (profile.memory if profile else 0),
                sm_count=sms or (profile.sm_count if profile else 0),
            )
        )
    return sorted(found, key=lambda i: i.start)


def create_instance(nvml: Any, handle: Any, *, gpu: str, profile: MigProfile, start: int) -> LiveInstance:
    """Create a GPU instance of `profile` at memory slice `start` and one compute instance over
    all of it; returns it with its MIG device UUID. Raises MigNvmlError; on a compute-instance
    failure the GPU instance is destroyed again (nothing is left behind)."""
    mig_enabled(nvml, handle)
    placement = pynvml.c_nvmlGpuInstancePlacement_t()
    placement.start, placement.size = start, profile.size
    gi = call(nvml, "nvmlDeviceCreateGpuInstanceWithPlacement", handle, profile.profile_id, ctypes.byref(placement))
    try:
        ci_profile = call(
            nvml,
            "nvmlGpuInstanceGetComputeInstanceProfileInfo",
            gi,
            _CI_PROFILES.get(profile.compute_slices, 0),
            pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
        )
        call(nvml, "nvmlGpuInstanceCreateComputeInstance", gi, int(ci_profile.id))
    except MigNvmlError:
        try:
            nvml.nvmlGpuInstanceDestroy(gi)
        except nvml.NVMLError:
            pass
        raise
    gi_id = int(call(nvml, "nvmlGpuInstanceGetInfo", gi).id)
    uuid, memory, sms = _mig_devices(nvml, handle).get(gi_id, ("", 0, 0))
    return LiveInstance(
        gpu=gpu,
        profile=profile.name,
        start=start,
        size=profile.size,
        gpu_instance_id=gi_id,
        uuid=uuid,
        memory=memory or profile.memory,
        sm_count=sms or profile.sm_count,
    )


def destroy_instance(nvml: Any, handle: Any, *, gpu_instance_id: int) -> None:
    """Destroy the GPU instance's compute instances, then the GPU instance. Raises MigNvmlError
    (IN_USE while a process is attached: the instance is then left as it was)."""
    gi = call(nvml, "nvmlDeviceGetGpuInstanceById", handle, gpu_instance_id)
    for ci_id in range(8):
        try:
            ci = nvml.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id)
        except nvml.NVMLError as err:
            if err.value in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                continue
            raise MigNvmlError("nvmlGpuInstanceGetComputeInstanceById", err.value, reason_in_words(err.value)) from err
        call(nvml, "nvmlComputeInstanceDestroy", ci)
    call(nvml, "nvmlGpuInstanceDestroy", gi)


def _mig_devices(nvml: Any, handle: Any) -> dict[int, tuple[str, int, int]]:
    """GPU instance id → (MIG device UUID, memory bytes, SMs) of the GPU's MIG devices."""
    out = {}
    for index in range(int(call(nvml, "nvmlDeviceGetMaxMigDeviceCount", handle))):
        try:
            device = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        except nvml.NVMLError:
            continue
        gi_id = int(call(nvml, "nvmlDeviceGetGpuInstanceId", device))
        memory = int(call(nvml, "nvmlDeviceGetMemoryInfo", device).total)
        sms = int(call(nvml, "nvmlDeviceGetAttributes", device).multiprocessorCount)
        out[gi_id] = (_text(call(nvml, "nvmlDeviceGetUUID", device)), memory, sms)
    return out
