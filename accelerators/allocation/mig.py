"""MIG: the profile catalog of each MIG-capable GPU model and the dynamic-MIG planner. Pure Python.

Facts (NVIDIA MIG User Guide, "Supported MIG Profiles" and "Placement"; every `nvidia-smi mig
-lgip` / `-lgipp` capture in `shared/fixtures/mig/` agrees): a MIG-capable GPU has 8 memory
slices and 7 compute slices. A GPU instance of a profile occupies a contiguous range of
`placement_size` memory slices that starts at one of the profile's allowed starts; instances
coexist when their ranges are disjoint and no profile exceeds its max count. On A100, H100,
H200 and B200 the geometry is the same for every model (table `GEOMETRY`):

| kind | NVML profile | compute | memory slices | max | starts | size |
|---|---|---|---|---|---|---|
| 1g | NVML_GPU_INSTANCE_PROFILE_1_SLICE (0) | 1 | 1 | 7 | 0–6 | 1 |
| 1g+me | …_1_SLICE_REV1 (7) | 1 | 1 | 1 | 0–6 | 1 |
| 1g.2x | …_1_SLICE_REV2 (9) | 1 | 2 | 4 | 0, 2, 4, 6 | 2 |
| 2g | …_2_SLICE (1) | 2 | 2 | 3 | 0, 2, 4 | 2 |
| 3g | …_3_SLICE (2) | 3 | 4 | 2 | 0, 4 | 4 |
| 4g | …_4_SLICE (3) | 4 | 4 | 1 | 0 | 4 |
| 7g | …_7_SLICE (4) | 7 | 8 | 1 | 0 | 8 |

Names, memory and SM counts differ by model (`MODELS`, from `mig-profiles.csv`; its `source`
column is kept in each catalog's `source`). Memory in bytes: a captured figure in GiB
(2 decimals) rounded to the nearest 1/8 GiB (NVML reports MIG memory in 128 MiB steps:
9.62 → 9856 MiB); where no capture has it, the figure of a profile with as many memory
slices on the same model, else the whole GPU's memory × slices / 8 rounded down to 1/8 GiB,
and `memory_assumed` is set. SMs: captured, else those of a profile with as many compute
slices, else 0 (unknown: `sm_count_for` then divides the GPU's SMs by 7 compute slices).
On a real node read the catalog from NVML instead (`accelerators.plugins.cuda_mig`).

Planner (`plan_instance`): a request by profile name or by memory gets the smallest profile
that holds it and can be placed, reusing an idle instance of that profile before creating
one, and creating with the placement that leaves the most room (least stranding); idle
instances are destroyed only when their slices are needed (the plan names them). Errors are
`accelerators.allocation.errors`: InvalidResourceRequest (unknown profile), NeverSchedulable
(larger than the GPU's largest profile), InsufficientResource (no room now).
"""

from __future__ import annotations

from typing import Any

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from decimal import ROUND_HALF_EVEN, Decimal

from accelerators.allocation.core import ResourceRequest
from accelerators.allocation.errors import InsufficientResource, InvalidResourceRequest, NeverSchedulable
from protocol.units import format_binary_size

MiB = 1 << 20
GiB = 1 << 30
EIGHTH_GIB = GiB // 8
MEMORY_SLICES = 8
COMPUTE_SLICES = 7

# kind → (NVML_GPU_INSTANCE_PROFILE_* value, nvidia-smi profile id, compute slices, memory
# slices, max instances, allowed starts, placement size). mig-profiles.csv, identical rows for
# every model in it (MIG User Guide placement tables; lgipp captures).
GEOMETRY: dict[str, tuple[int, int, int, int, int, tuple[int, ...], int]] = {
    "1g": (0, 19, 1, 1, 7, (0, 1, 2, 3, 4, 5, 6), 1),
    "1g+me": (7, 20, 1, 1, 1, (0, 1, 2, 3, 4, 5, 6), 1),
    "1g.2x": (9, 15, 1, 2, 4, (0, 2, 4, 6), 2),
    "2g": (1, 14, 2, 2, 3, (0, 2, 4), 2),
    "3g": (2, 9, 3, 4, 2, (0, 4), 4),
    "4g": (3, 5, 4, 4, 1, (0,), 4),
    "7g": (4, 0, 7, 8, 1, (0,), 8),
}
KINDS = tuple(GEOMETRY)

# model → (family, whole-GPU memory in GiB as the names give it, source, {kind: (name,
# observed SMs or 0, observed memory GiB text or "")}). From mig-profiles.csv.
MODELS: dict[str, tuple[str, int, str, dict[str, tuple[str, int, str]]]] = {
    "A100-40GB": (
        "A100",
        40,
        "captured: MIG User Guide lgip/lgipp example (A100-SXM4-40GB)",
        {
            "1g": ("1g.5gb", 14, "4.75"),
            "1g+me": ("1g.5gb+me", 14, "4.75"),
            "1g.2x": ("1g.10gb", 14, "9.62"),
            "2g": ("2g.10gb", 28, "9.62"),
            "3g": ("3g.20gb", 42, "19.5"),
            "4g": ("4g.20gb", 56, "19.5"),
            "7g": ("7g.40gb", 98, "39.25"),
        },
    ),
    "A100-80GB": (
        "A100",
        80,
        "A100 80GB PCIe lgip capture (driver 515.86.01); names from mig-parted "
        "config-default.yaml; 1g.20gb assumed same as A100-40GB (same GA100 slot layout)",
        {
            "1g": ("1g.10gb", 14, "9.5"),
            "1g+me": ("1g.10gb+me", 14, "9.5"),
            "1g.2x": ("1g.20gb", 14, ""),
            "2g": ("2g.20gb", 28, "19.5"),
            "3g": ("3g.40gb", 42, "39.25"),
            "4g": ("4g.40gb", 56, "39.25"),
            "7g": ("7g.80gb", 98, "79.0"),
        },
    ),
    "H100-80GB": (
        "H100",
        80,
        "captured: H100 80GB HBM3 lgip/lgipp capture (public repo notes)",
        {
            "1g": ("1g.10gb", 16, "9.75"),
            "1g+me": ("1g.10gb+me", 16, "9.75"),
            "1g.2x": ("1g.20gb", 26, "19.62"),
            "2g": ("2g.20gb", 32, "19.62"),
            "3g": ("3g.40gb", 60, "39.5"),
            "4g": ("4g.40gb", 64, "39.5"),
            "7g": ("7g.80gb", 132, "79.25"),
        },
    ),
    "H100-94GB": (
        "H100",
        94,
        "captured: Azure NC40ads_H100_v5 (H100 NVL) lgip/lgipp capture",
        {
            "1g": ("1g.12gb", 16, "10.75"),
            "1g+me": ("1g.12gb+me", 16, "10.75"),
            "1g.2x": ("1g.24gb", 26, "21.62"),
            "2g": ("2g.24gb", 32, "21.62"),
            "3g": ("3g.47gb", 60, "46.38"),
            "4g": ("4g.47gb", 64, "46.38"),
            "7g": ("7g.94gb", 132, "93.12"),
        },
    ),
    "H100-96GB": (
        "H100",
        96,
        "not captured (assumed same layout): mig-parted config-default.yaml (H100 96GB, GH200 96GB, H20 96GB)",
        {
            "1g": ("1g.12gb", 0, ""),
            "1g+me": ("1g.12gb+me", 0, ""),
            "1g.2x": ("1g.24gb", 0, ""),
            "2g": ("2g.24gb", 0, ""),
            "3g": ("3g.48gb", 0, ""),
            "4g": ("4g.48gb", 0, ""),
            "7g": ("7g.96gb", 0, ""),
        },
    ),
    "H200-141GB": (
        "H200",
        141,
        "not captured (assumed same layout): MIG User Guide Table 8 (H200); partial lgip "
        "capture in a public test fixture; 3g SM=60 from third-party notes",
        {
            "1g": ("1g.18gb", 16, "16.0"),
            "1g+me": ("1g.18gb+me", 16, "16.0"),
            "1g.2x": ("1g.35gb", 0, ""),
            "2g": ("2g.35gb", 32, "32.5"),
            "3g": ("3g.71gb", 60, ""),
            "4g": ("4g.71gb", 0, ""),
            "7g": ("7g.141gb", 132, "140.0"),
        },
    ),
    "GH200-144GB": (
        "GH200",
        144,
        "not captured: mig-parted config-default.yaml (GH200 144GB HBM3e)",
        {
            "1g": ("1g.18gb", 0, ""),
            "1g+me": ("1g.18gb+me", 0, ""),
            "1g.2x": ("1g.36gb", 0, ""),
            "2g": ("2g.36gb", 0, ""),
            "3g": ("3g.72gb", 0, ""),
            "4g": ("4g.72gb", 0, ""),
            "7g": ("7g.144gb", 0, ""),
        },
    ),
    "B200-180GB": (
        "B200",
        180,
        "not captured: MIG User Guide Table 9 (B200); mig-parted config-default.yaml",
        {
            "1g": ("1g.23gb", 0, ""),
            "1g+me": ("1g.23gb+me", 0, ""),
            "1g.2x": ("1g.45gb", 0, ""),
            "2g": ("2g.45gb", 0, ""),
            "3g": ("3g.90gb", 0, ""),
            "4g": ("4g.90gb", 0, ""),
            "7g": ("7g.180gb", 0, ""),
        },
    ),
    "GB200-186GB": (
        "GB200",
        186,
        "not captured: mig-parted config-default.yaml (GB200 HGX)",
        {
            "1g": ("1g.23gb", 0, ""),
            "1g+me": ("1g.23gb+me", 0, ""),
            "1g.2x": ("1g.47gb", 0, ""),
            "2g": ("2g.47gb", 0, ""),
            "3g": ("3g.93gb", 0, ""),
            "4g": ("4g.93gb", 0, ""),
            "7g": ("7g.186gb", 0, ""),
        },
    ),
}
ALIASES = {
    "A100": "A100-40GB",
    "H100": "H100-80GB",
    "H200": "H200-141GB",
    "B200": "B200-180GB",
    "H100-NVL": "H100-94GB",
    "H20": "H100-96GB",
    "GH200": "GH200-144GB",
    "GB200": "GB200-186GB",
}


@dataclass(frozen=True)
class MigProfile:
    """One GPU-instance profile of a model. `memory` in bytes; `sm_count` SMs (0: unknown);
    `starts` the allowed first memory slices, `size` the memory slices a placement spans."""

    name: str
    nvml_profile: int
    profile_id: int
    compute_slices: int
    memory_slices: int
    memory: int
    sm_count: int
    max_instances: int
    starts: tuple[int, ...]
    size: int
    memory_assumed: bool = False

    @property
    def media_extensions(self) -> bool:
        return self.name.endswith("+me")

    def sm_count_for(self, gpu_sms: int) -> int:
        """SMs of an instance on a GPU with `gpu_sms` SMs: the catalog's figure, else a 7th
        of the GPU's per compute slice (truncated)."""
        return self.sm_count or gpu_sms * self.compute_slices // COMPUTE_SLICES


@dataclass(frozen=True)
class MigCatalog:
    """A GPU model's MIG profiles (smallest first). `memory_total` is the whole GPU's memory in
    bytes as the full-size profile sees it; `source` says where the figures come from."""

    model: str
    profiles: tuple[MigProfile, ...]
    source: str = ""

    def profile(self, name: str) -> MigProfile:
        """The profile named `name` ("1g.20gb", case-insensitive). Raises InvalidResourceRequest."""
        wanted = name.strip().lower()
        for profile in self.profiles:
            if profile.name == wanted:
                return profile
        known = ", ".join(p.name for p in self.profiles)
        raise InvalidResourceRequest(f"resources.mig_profile: {name!r} is not a MIG profile of {self.model} (known: {known})")

    def by_nvml_profile(self, nvml_profile: int) -> MigProfile | None:
        return next((p for p in self.profiles if p.nvml_profile == nvml_profile), None)

    @property
    def largest(self) -> MigProfile:
        return max(self.profiles, key=lambda p: (p.memory, p.compute_slices))


def catalog_as_dict(catalog: MigCatalog) -> dict[str, Any]:
    """A JSON-safe form of `catalog` (what an agent reports per GPU); `catalog_from_dict` reads it."""
    return {
        "model": catalog.model,
        "source": catalog.source,
        "profiles": [
            {
                "name": p.name,
                "nvml_profile": p.nvml_profile,
                "profile_id": p.profile_id,
                "compute_slices": p.compute_slices,
                "memory_slices": p.memory_slices,
                "memory": p.memory,
                "sm_count": p.sm_count,
                "max_instances": p.max_instances,
                "starts": list(p.starts),
                "size": p.size,
            }
            for p in catalog.profiles
        ],
    }


def catalog_from_dict(data: dict[str, Any]) -> MigCatalog:
    """`catalog_as_dict`'s form → MigCatalog. Raises InvalidResourceRequest for a malformed one."""
    try:
        profiles = tuple(
            sorted(
                (
                    MigProfile(
                        name=str(p["name"]),
                        nvml_profile=int(p["nvml_profile"]),
                        profile_id=int(p["profile_id"]),
                        compute_slices=int(p["compute_slices"]),
                        memory_slices=int(p["memory_slices"]),
                        memory=int(p["memory"]),
                        sm_count=int(p["sm_count"]),
                        max_instances=int(p["max_instances"]),
                        starts=tuple(int(x) for x in p["starts"]),
                        size=int(p["size"]),
                    )
                    for p in data["profiles"]
                ),
                key=_smallest_first,
            )
        )
        return MigCatalog(model=str(data["model"]), profiles=profiles, source=str(data.get("source", "")))
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidResourceRequest(f"a reported MIG catalog is malformed: {exc!r}") from None


def _gib_to_bytes(text: str) -> int:
    """Captured GiB with 2 decimals → bytes, rounded to the nearest 1/8 GiB (NVML's 128 MiB step)."""
    eighths = (Decimal(text) * 8).to_integral_value(rounding=ROUND_HALF_EVEN)
    return int(eighths) * EIGHTH_GIB


def _build(model: str) -> MigCatalog:
    family, whole_gib, source, rows = MODELS[model]
    observed_memory = {GEOMETRY[k][3]: _gib_to_bytes(m) for k, (_, _, m) in rows.items() if m}
    observed_sms = {GEOMETRY[k][2]: sms for k, (_, sms, _) in rows.items() if sms}
    profiles = []
    for kind, (name, sms, memory_text) in rows.items():
        nvml_profile, profile_id, compute, slices, max_count, starts, size = GEOMETRY[kind]
        if memory_text:
            memory, assumed = _gib_to_bytes(memory_text), False
        elif slices in observed_memory:
            memory, assumed = observed_memory[slices], True
        else:
            memory, assumed = (whole_gib * GiB * slices // MEMORY_SLICES) // EIGHTH_GIB * EIGHTH_GIB, True
        profiles.append(
            MigProfile(
                name=name,
                nvml_profile=nvml_profile,
                profile_id=profile_id,
                compute_slices=compute,
                memory_slices=slices,
                memory=memory,
                sm_count=sms or observed_sms.get(compute, 0),
                max_instances=max_count,
                starts=starts,
                size=size,
                memory_assumed=assumed,
            )
        )
    profiles.sort(key=_smallest_first)
    return MigCatalog(model=model, profiles=tuple(profiles), source=source)


def _smallest_first(profile: MigProfile) -> tuple[Any, ...]:
    return (profile.memory, profile.memory_slices, profile.compute_slices, profile.media_extensions, profile.nvml_profile)


CATALOGS: dict[str, MigCatalog] = {model: _build(model) for model in MODELS}


def catalog_get(model: str, *, memory_size: int = 0) -> MigCatalog:
    """The built-in catalog for a model name as an inventory or NVML gives it: "H100-80GB",
    "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "H100 NVL", "B200". The family (A100,
    H100, H20, H200, GH200, B200, GB200) comes from the name, the size from a "<n>GB" in it or
    else `memory_size` (bytes): the model of that family whose memory is nearest. Raises
    InvalidResourceRequest for a name that is no MIG-capable model."""
    text = model.upper().replace("_", "-")
    if model in CATALOGS:
        return CATALOGS[model]
    family = next((f for f in ("GB200", "GH200", "H200", "H100", "H20", "A100", "B200") if f in text), None)
    if family is None:
        raise InvalidResourceRequest(f"{model!r} is not a MIG-capable GPU model (known: {', '.join(CATALOGS)})")
    if family == "H100" and "NVL" in text:
        return CATALOGS["H100-94GB"]
    sized = re.search(r"(\d+)\s*G", text.split(family, 1)[1])
    wanted_gib = int(sized.group(1)) if sized else (memory_size / GiB if memory_size else 0)
    if family == "H20":
        family = "H100"
    options = [m for m, (fam, *_rest) in MODELS.items() if fam == family]
    if not wanted_gib:
        return CATALOGS[ALIASES[family] if ALIASES.get(family) in options else options[0]]
    return CATALOGS[min(options, key=lambda m: abs(MODELS[m][1] - wanted_gib))]


# --- the planner -----------------------------------------------------------------------------


@dataclass(frozen=True)
class MigInstance:
    """A GPU instance that exists (or is planned) on one GPU: `key` names it (the manager's
    GpuInstance id, or the MIG device UUID), `start` its first memory slice, `in_use` whether a
    session holds it (else it is idle and reusable)."""

    key: str
    profile: str
    start: int
    in_use: bool = False


@dataclass(frozen=True)
class MigRequest:
    """What a session asks of MIG: a profile by name, or at least `memory` bytes."""

    profile: str = ""
    memory: int = 0

    def describe(self) -> str:
        return f"MIG profile {self.profile}" if self.profile else f"a MIG instance of {format_binary_size(self.memory)}"


PROFILE_NAME = re.compile(r"^(\d+c\.)?\d+g(\.\d+gb)?(\+me(\.all)?|-me|\+gfx)?$")


@dataclass(frozen=True)
class MigResourceRequest(ResourceRequest):
    """A session's request that MIG may satisfy. `isolation` "mig" (kind "mig"): one MIG
    instance, of `mig_profile` ("2g.20gb"; on static nodes also an inventory's short name such
    as "10g") or of at least `memory.bytes`; "any" (kind "per_device", one device): a shared
    slice of `memory.bytes` on a GPU, or a MIG instance of at least that much, as placement
    decides (a shared slice where one fits, else MIG)."""

    mig_profile: str = ""
    isolation: str = "mig"

    def mig_request(self) -> MigRequest:
        return MigRequest(profile=self.mig_profile, memory=self.memory.bytes if self.memory else 0)


@dataclass(frozen=True)
class MigPlan:
    """What to do on the GPU: reuse the idle instance `reuse` (a key), or create `profile` at
    memory slice `start` after destroying the idle instances `destroy` (keys), in that order."""

    profile: MigProfile
    start: int
    reuse: str = ""
    destroy: tuple[str, ...] = ()

    @property
    def creates(self) -> bool:
        return not self.reuse

    def describe(self) -> str:
        if self.reuse:
            return f"reuses the idle {self.profile.name} instance at memory slice {self.start}"
        freed = f" after destroying {len(self.destroy)} idle instance(s)" if self.destroy else ""
        return f"creates a {self.profile.name} instance at memory slice {self.start}{freed}"


def slices_of(profile: MigProfile, start: int) -> range:
    return range(start, start + profile.size)


def candidate_profiles(catalog: MigCatalog, request: MigRequest) -> list[MigProfile]:
    """Profiles that satisfy `request`, smallest first: the named one, or every profile
    without media extensions with at least `request.memory` bytes, by (memory, memory slices,
    compute slices). Raises InvalidResourceRequest (unknown name, no amount) and
    NeverSchedulable (more memory than the largest profile)."""
    if request.profile:
        return [catalog.profile(request.profile)]
    if request.memory <= 0:
        raise InvalidResourceRequest("resources.gpu_memory: a MIG request needs a memory size or a mig_profile")
    fitting = [p for p in catalog.profiles if p.memory >= request.memory and not p.media_extensions]
    if not fitting:
        largest = catalog.largest
        raise NeverSchedulable(
            f"{format_binary_size(request.memory)} is more than the largest MIG instance of "
            f"{catalog.model} ({largest.name}, {format_binary_size(largest.memory)})"
        )
    return sorted(fitting, key=_smallest_first)


def plan_instance(catalog: MigCatalog, instances: Sequence[MigInstance], request: MigRequest) -> MigPlan:
    """The instance a request gets on one GPU whose current instances are `instances`.

    Takes the first of `candidate_profiles` that can be had: an idle instance of it is reused
    (lowest start first); else it is created at an allowed start whose range no instance in
    use overlaps, with the profile under its max count, choosing (in this order) the fewest
    idle instances destroyed, the fewest slices destroyed, the most free memory slices still
    usable afterwards (least stranding), the largest profile still creatable afterwards
    (memory slices, then compute slices), the longest free run of memory slices left, the lowest start.
    A profile that can be placed only by destroying idle instances is still preferred to a
    larger one (lazy teardown: idle instances hold no session). Raises as
    `candidate_profiles`, and InsufficientResource when no candidate can be placed now.
    """
    layout_check(catalog, instances)
    candidates = candidate_profiles(catalog, request)
    for profile in candidates:
        idle = sorted((i for i in instances if not i.in_use and i.profile == profile.name), key=lambda i: i.start)
        if idle:
            return MigPlan(profile=profile, start=idle[0].start, reuse=idle[0].key)
        best = None
        for start in profile.starts:
            option = _creation_option(catalog, instances, profile, start)
            if option is not None and (best is None or option[0] < best[0]):
                best = option
        if best is not None:
            return MigPlan(profile=profile, start=best[1], destroy=best[2])
    used = ", ".join(f"{i.profile}@{i.start}" for i in sorted(instances, key=lambda i: i.start) if i.in_use) or "none"
    names = ", ".join(p.name for p in candidates)
    raise InsufficientResource(f"no room for {request.describe()} ({names}) on this {catalog.model}: instances in use {used}")


def _creation_option(
    catalog: MigCatalog, instances: Sequence[MigInstance], profile: MigProfile, start: int
) -> tuple[tuple[int, ...], int, tuple[str, ...]] | None:
    blockers = _blockers(catalog, instances, profile, start)
    if blockers is None:
        return None
    by_name = {p.name: p for p in catalog.profiles}
    after = [*(i for i in instances if i not in blockers), MigInstance(key="", profile=profile.name, start=start)]
    largest = _largest_creatable(catalog, after)
    destroyed_slices = sum(by_name[i.profile].size for i in blockers)
    free = free_slices(catalog, after)
    usable = len(free - stranded_slices(catalog, after))
    key = (len(blockers), destroyed_slices, -usable, -largest[0], -largest[1], -_longest_run(free), start)
    return key, start, tuple(i.key for i in sorted(blockers, key=lambda i: i.start))


def _blockers(catalog: MigCatalog, instances: Sequence[MigInstance], profile: MigProfile, start: int) -> list[MigInstance] | None:
    """The idle instances in the way of creating `profile` at `start`, or None when it cannot
    be created there (past slice 7, over an instance in use, over the max count, over 7
    compute slices)."""
    wanted = set(slices_of(profile, start))
    if start not in profile.starts or max(wanted) >= MEMORY_SLICES:
        return None
    by_name = {p.name: p for p in catalog.profiles}
    blockers = []
    for instance in instances:
        if wanted & set(slices_of(by_name[instance.profile], instance.start)):
            if instance.in_use:
                return None
            blockers.append(instance)
    kept = [i for i in instances if i not in blockers]
    if sum(1 for i in kept if i.profile == profile.name) >= profile.max_instances:
        return None
    if sum(by_name[i.profile].compute_slices for i in kept) + profile.compute_slices > COMPUTE_SLICES:
        return None
    return blockers


def apply_plan(instances: Sequence[MigInstance], plan: MigPlan, *, key: str) -> tuple[MigInstance, ...]:
    """The layout after `plan`: destroyed instances gone, the reused one (or a new one named
    `key`) in use. Pure; `instances` is not changed."""
    kept = [i for i in instances if i.key not in plan.destroy]
    if plan.reuse:
        return tuple(replace(i, in_use=True) if i.key == plan.reuse else i for i in kept)
    return (*kept, MigInstance(key=key, profile=plan.profile.name, start=plan.start, in_use=True))


def release(instances: Sequence[MigInstance], key: str) -> tuple[MigInstance, ...]:
    """The layout after the session on instance `key` ended: the instance stays, idle (lazy
    teardown)."""
    return tuple(replace(i, in_use=False) if i.key == key else i for i in instances)


def layout_problems(catalog: MigCatalog, instances: Iterable[MigInstance]) -> list[str]:
    """Why a layout could not exist on the GPU, in words (empty: it is creatable): unknown
    profile, start not allowed, overlapping memory slices, a profile over its max count, more
    than 7 compute slices."""
    by_name = {p.name: p for p in catalog.profiles}
    problems = []
    owner: dict[int, str] = {}
    counts: dict[str, int] = {}
    compute = 0
    for instance in instances:
        profile = by_name.get(instance.profile)
        if profile is None:
            problems.append(f"{instance.key}: {instance.profile!r} is not a MIG profile of {catalog.model}")
            continue
        if instance.start not in profile.starts:
            problems.append(
                f"{instance.key}: {profile.name} cannot start at memory slice {instance.start} "
                f"(allowed: {', '.join(map(str, profile.starts))})"
            )
        for slot in slices_of(profile, instance.start):
            if slot in owner:
                problems.append(f"{instance.key}: memory slice {slot} is already held by {owner[slot]}")
            owner[slot] = instance.key
        counts[profile.name] = counts.get(profile.name, 0) + 1
        compute += profile.compute_slices
    for name, count in counts.items():
        if count > by_name[name].max_instances:
            problems.append(f"{count} instances of {name}, at most {by_name[name].max_instances}")
    if compute > COMPUTE_SLICES:
        problems.append(f"{compute} compute slices, at most {COMPUTE_SLICES}")
    return problems


def layout_check(catalog: MigCatalog, instances: Iterable[MigInstance]) -> None:
    """Raises InvalidResourceRequest naming every problem of `layout_problems`."""
    problems = layout_problems(catalog, instances)
    if problems:
        raise InvalidResourceRequest(f"MIG layout on {catalog.model} is not creatable: {'; '.join(problems)}")


def free_slices(catalog: MigCatalog, instances: Iterable[MigInstance]) -> set[int]:
    """Memory slices (0–7) no instance holds."""
    by_name = {p.name: p for p in catalog.profiles}
    held = {s for i in instances for s in slices_of(by_name[i.profile], i.start)}
    return set(range(MEMORY_SLICES)) - held


def creatable(catalog: MigCatalog, instances: Sequence[MigInstance]) -> list[tuple[MigProfile, int]]:
    """(profile, start) of every instance that could be created now without destroying any."""
    return [(p, s) for p in catalog.profiles for s in p.starts if _blockers(catalog, instances, p, s) == []]


def stranded_slices(catalog: MigCatalog, instances: Sequence[MigInstance]) -> set[int]:
    """Free memory slices that no creatable instance could use (slice 7 beside a 1g at 6, …)."""
    reachable = {s for p, start in creatable(catalog, instances) for s in slices_of(p, start)}
    return free_slices(catalog, instances) - reachable


def _largest_creatable(catalog: MigCatalog, instances: Sequence[MigInstance]) -> tuple[int, int]:
    """(memory slices, compute slices) of the largest instance still creatable."""
    return max(((p.size, p.compute_slices) for p, _ in creatable(catalog, instances)), default=(0, 0))


def _longest_run(free: set[int]) -> int:
    best = run = 0
    for slot in range(MEMORY_SLICES):
        run = run + 1 if slot in free else 0
        best = max(best, run)
    return best


def memory_text(profile: MigProfile) -> str:
    """ "19.62 GiB" for display (truncated to 2 decimals)."""
    return format_binary_size(profile.memory)


def layout_digest(gpus: Iterable[str], instances: Iterable[tuple[str, str, int]]) -> str:
    """A short digest of the GPU instances on a node's MIG GPUs, for the agent's heartbeat and
    the manager's comparison: `gpus` the GPU UUIDs in scope, `instances` (GPU UUID, profile,
    first memory slice) tuples (order does not matter). Both sides compute it with this one
    function, so equal layouts give equal digests. Returns 16 hex digits (SHA-256, cut)."""
    body = json.dumps(
        {"gpus": sorted(set(gpus)), "instances": sorted([g, p, int(s)] for g, p, s in instances)}, separators=(",", ":")
    )
    return hashlib.sha256(body.encode()).hexdigest()[:16]
