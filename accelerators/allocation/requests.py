"""Request parsing: a session's `resources` object, in any supported dialect, → one normalised
ResourceRequest. Pure Python; raises InvalidResourceRequest naming the offending key.

Dialects (one per request; `cpu` — cores — and `mem` — bytes or a binary size — go with any):

| style | keys | source |
|---|---|---|
| fGPU | `<slot>.shares` ("2.5"), optional `strategy` (`evenly` / `fill`) | Backend.AI |
| whole devices | `<slot>.device` (2) | all |
| memory + cores | `gpu` (count), `gpu_memory` (size) or `gpu_memory_percentage`, `gpu_cores` (0–100) | HAMi, eGPU |
| fraction | `gpu_fraction` ("0.2": 20 % of one device's memory and SMs) | Run:ai `--gpu 0.2` |
| HAMi names | `nvidia.com/gpu`, `nvidia.com/gpumem` (MiB), `nvidia.com/gpumem-percentage`, `nvidia.com/gpucores`; `metax-tech.com/sgpu`, `metax-tech.com/vcore`, `metax-tech.com/vmemory` (bare number: GiB) | HAMi |
| MIG | `mig_profile` ("2g.20gb", or an inventory's "10g"), or `gpu_memory` with `isolation: "mig"` (the smallest MIG instance that holds it); `isolation: "any"` lets a `gpu_memory` request take a shared slice or a MIG instance, `"shared"` only a shared slice | Run:ai dynamic MIG |
| eGPU | `egpu`: {`GPU_MEM_PER_DEVICE` (bytes) or `ALIYUN_COM_GPU_MEM_CONTAINER` / `ALIYUN_COM_GPU_MEM_DEV`, `ALIYUN_COM_GPU_MEM_RESERVED` (MiB, default 10), `GPU_UTIL_PER_DEVICE`, `NVIDIA_VISIBLE_DEVICES`} | Alibaba eGPU |

Any style may add `devices` (pins: UUIDs or indexes), `exclude`, `policy` (`binpack`,
`spread`, `best-fit`, `fgd`, `fgd-plus`: accelerators/allocation/cluster.py), `numa` (true: one NUMA node) and `resource_group` (a node pool's name). Where HAMi clamps cores above 100 or below 0
silently (a bug its users reported), they are refused here.
"""

from __future__ import annotations

from dataclasses import fields
from decimal import Decimal
from collections.abc import Callable
from typing import Any, NoReturn

from accelerators.allocation import cluster
from accelerators.allocation.core import ZERO, MemorySpec, ResourceRequest
from accelerators.allocation.mig import PROFILE_NAME, MigResourceRequest
from accelerators.allocation.errors import InvalidResourceRequest
from protocol.units import SizeError, amount_text, parse_binary_size, parse_decimal

DEFAULT_CPU = 1
DEFAULT_MEM = 1 << 30  # 1 GiB
MiB = 1 << 20
GiB = 1 << 30
EGPU_RESERVED_DEFAULT_MIB = 10
MAX_COUNT = 1 << 16  # the most devices, cores or MiB a whole-number field takes (65536)

COMMON = {"cpu", "mem", "devices", "exclude", "policy", "numa", "strategy", "resource_group"}
HAMI_STYLE = {"gpu", "gpu_memory", "gpu_memory_percentage", "gpu_cores"}
FRACTION_STYLE = {"gpu_fraction"}
HAMI_NVIDIA = {"nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpumem-percentage", "nvidia.com/gpucores"}
HAMI_METAX = {"metax-tech.com/sgpu", "metax-tech.com/vcore", "metax-tech.com/vmemory"}
EGPU_KEYS = {
    "GPU_MEM_PER_DEVICE",
    "ALIYUN_COM_GPU_MEM_CONTAINER",
    "ALIYUN_COM_GPU_MEM_DEV",
    "ALIYUN_COM_GPU_MEM_RESERVED",
    "GPU_UTIL_PER_DEVICE",
    "NVIDIA_VISIBLE_DEVICES",
}


def fail(key: str, problem: str) -> NoReturn:
    raise InvalidResourceRequest(f"resources.{key}: {problem}")


def parse_resources(resources: object) -> ResourceRequest:
    """`{"cuda.shares": "0.5", "cpu": 1, "mem": "1G"}` → ResourceRequest(kind="shares",
    amount=0.5, cpu=1, mem=1073741824, slot="cuda"); every dialect of the module docstring
    likewise. One accelerator dialect per request. Raises InvalidResourceRequest."""
    if not isinstance(resources, dict):
        raise InvalidResourceRequest('resources: expected an object such as {"cuda.shares": "0.5"}')
    _check_text(resources)
    cpu = _parse_cpu(resources.get("cpu", DEFAULT_CPU))
    try:
        mem = parse_binary_size(resources.get("mem", DEFAULT_MEM))
    except SizeError as exc:
        raise InvalidResourceRequest(f"resources.mem: {exc}") from None
    common = _common_options(resources)
    accelerator = {k: v for k, v in resources.items() if k not in COMMON}
    isolation = "shared"
    if "mig_profile" in accelerator or "isolation" in accelerator:
        isolation, mig_request = _mig_request(accelerator, cpu=cpu, mem=mem, common=common)
        if mig_request is not None:
            return mig_request
        accelerator.pop("isolation", None)
    request = _parse_accelerator(accelerator, cpu=cpu, mem=mem, common=common)
    if isolation == "any":
        return MigResourceRequest(**{f.name: getattr(request, f.name) for f in fields(request)}, isolation="any")
    return request


def _check_text(resources: dict[str, Any]) -> None:
    """Refuse a NUL character or an unpaired surrogate in any key or text of `resources` (at
    any depth; lists by index: "devices.0"): PostgreSQL's text and jsonb cannot hold them."""
    stack: list[tuple[str, object]] = [("", resources)]
    while stack:
        path, value = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            where = f"{path}.{key}" if path else str(key)
            if not all(_storable(text) for text in (key, item) if isinstance(text, str)):
                fail(
                    where.encode("utf-8", "backslashreplace").decode().replace("\x00", "\\x00"),
                    "contains a NUL character or an unpaired surrogate (text that cannot be stored)",
                )
            stack.append((where, item))


def _storable(text: str) -> bool:
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _parse_accelerator(accelerator: dict[str, Any], *, cpu: int, mem: int, common: dict[str, Any]) -> ResourceRequest:
    styles = _styles(accelerator)
    if len(styles) > 1:
        raise InvalidResourceRequest(f"resources: one accelerator request per session, got {', '.join(sorted(accelerator))}")
    style = styles[0] if styles else "cpu"
    if style == "cpu":
        if common["pins"]:
            fail("devices", "pinning devices needs a GPU request")
        return ResourceRequest(
            kind="none", amount=ZERO, cpu=cpu, mem=mem, slot="", style="cpu", resource_group=common["resource_group"]
        )
    if common["strategy"] and not style.endswith(".shares"):
        fail("strategy", "applies to fGPU requests (<slot>.shares) only")
    parsed = _parser(style)(accelerator)
    kind, amount, slot = parsed["kind"], parsed["amount"], parsed["slot"]
    if amount == 0:
        return ResourceRequest(
            kind="none", amount=ZERO, cpu=cpu, mem=mem, slot="", style="cpu", resource_group=common["resource_group"]
        )
    pins = parsed.pop("pins", ()) or common["pins"]
    if style.startswith("slot:"):
        style = "fgpu" if kind == "shares" else "devices"
    return ResourceRequest(
        kind=kind,
        amount=Decimal(amount),
        cpu=cpu,
        mem=mem,
        slot=slot,
        memory=parsed.get("memory"),
        cores=parsed.get("cores", ZERO),
        pins=pins,
        exclude=common["exclude"],
        policy=common["policy"],
        strategy=common["strategy"],
        numa=common["numa"],
        style=style,
        resource_group=common["resource_group"],
    )


def _mig_request(
    accelerator: dict[str, Any], *, cpu: int, mem: int, common: dict[str, Any]
) -> tuple[str, ResourceRequest | None]:
    """(isolation, the MIG request) for `mig_profile` / `isolation` requests; (isolation, None)
    where the rest is parsed as a HAMi-style request ("shared", "any")."""
    isolation = accelerator.get("isolation", "mig" if "mig_profile" in accelerator else "shared")
    if isolation not in ("mig", "any", "shared"):
        fail("isolation", f"{isolation!r} is not an isolation (mig, any or shared)")
    if "mig_profile" in accelerator:
        if isolation != "mig":
            fail("isolation", 'a mig_profile request is a MIG instance: isolation must be "mig" or left out')
        others = sorted(set(accelerator) - {"mig_profile", "isolation"})
        if others:
            fail("mig_profile", f"one accelerator request per session, got mig_profile and {', '.join(others)}")
        profile = accelerator["mig_profile"]
        if not isinstance(profile, str) or not PROFILE_NAME.match(profile.strip().lower()):
            fail("mig_profile", f'{profile!r} is not a MIG profile (e.g. "1g.10gb", "2g.20gb" or "10g")')
        return isolation, _mig(cpu, mem, common, mig_profile=profile.strip().lower(), memory=None)
    if isolation == "shared":
        return isolation, None
    others = sorted(set(accelerator) - {"gpu", "gpu_memory", "isolation"})
    if others:
        fail("isolation", f"isolation {isolation!r} goes with gpu_memory (and gpu: 1) only, not {', '.join(others)}")
    if "gpu_memory" not in accelerator:
        fail("gpu_memory", f"isolation {isolation!r} needs gpu_memory, the memory the MIG instance must hold")
    if _count(accelerator.get("gpu", 1), "gpu") != 1:
        fail("gpu", "a MIG request is for one instance (gpu: 1)")
    if isolation == "any":
        return isolation, None
    return isolation, _mig(
        cpu, mem, common, mig_profile="", memory=MemorySpec(bytes=_size(accelerator["gpu_memory"], "gpu_memory"))
    )


def _mig(cpu: int, mem: int, common: dict[str, Any], *, mig_profile: str, memory: MemorySpec | None) -> MigResourceRequest:
    if common["pins"] or common["exclude"]:
        fail("devices", "MIG instances are chosen by the scheduler; devices and exclude do not apply")
    return MigResourceRequest(
        kind="mig",
        amount=Decimal(1),
        cpu=cpu,
        mem=mem,
        slot="cuda",
        memory=memory,
        style="mig",
        resource_group=common["resource_group"],
        mig_profile=mig_profile,
        isolation="mig",
    )


def _styles(accelerator: dict[str, Any]) -> list[str]:
    styles = []
    for key in sorted(accelerator):
        if key in HAMI_STYLE:
            style = "hami"
        elif key in FRACTION_STYLE:
            style = "runai"
        elif key in HAMI_NVIDIA or key in HAMI_METAX:
            style = "hami-names-metax" if key in HAMI_METAX else "hami-names"
        elif key == "egpu":
            style = "egpu"
        else:
            slot, _, subtype = key.partition(".")
            if not slot or subtype not in ("shares", "device"):
                fail(
                    key,
                    "unknown resource (expected <slot>.shares, <slot>.device, gpu/gpu_memory/gpu_cores, "
                    "gpu_fraction, nvidia.com/gpu…, egpu, cpu or mem, e.g. cuda.shares)",
                )
            style = f"slot:{key}"
        if style not in styles:
            styles.append(style)
    return styles


def _common_options(resources: dict[str, Any]) -> dict[str, Any]:
    policy = resources.get("policy")
    if policy is not None and policy not in cluster.POLICIES:
        fail("policy", f"{policy!r} is not a policy ({', '.join(cluster.POLICIES)})")
    strategy = resources.get("strategy")
    if strategy is not None and strategy not in ("evenly", "fill"):
        fail("strategy", f"{strategy!r} is not a strategy (evenly or fill)")
    numa = resources.get("numa", False)
    if not isinstance(numa, bool):
        fail("numa", "expected true or false")
    group = resources.get("resource_group", "")
    if not isinstance(group, str):
        fail("resource_group", "expected the name of a resource group")
    return {
        "pins": _device_list(resources.get("devices"), "devices"),
        "exclude": _device_list(resources.get("exclude"), "exclude"),
        "policy": policy,
        "strategy": strategy,
        "numa": numa,
        "resource_group": group,
    }


def _device_list(value: object, key: str) -> tuple[str, ...]:
    """["GPU-28df…", 3] or "0,GPU-…" → ("GPU-28df…", "3"): UUIDs and indexes, mixed."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list):
        fail(key, "expected a list of device UUIDs or indexes")
    out = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            fail(key, f"{item!r} is neither a device UUID nor an index")
        text = str(item).strip()
        if not text or (isinstance(item, int) and item < 0):
            fail(key, f"{item!r} is neither a device UUID nor an index")
        if text not in out:
            out.append(text)
    return tuple(out)


def _count(value: object, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        fail(key, f"a device count must be a whole number, got {value!r}")
    try:
        count = int(value)
    except ValueError:
        fail(key, f"a device count must be a whole number, got {value!r}")
    if count < 0:
        fail(key, f"a device count cannot be negative, got {value!r}")
    if count > MAX_COUNT:
        fail(key, f"{value!r} is too large (at most {MAX_COUNT})")
    return count


def _percent(value: object, key: str, *, allow_zero: bool = True) -> Decimal:
    try:
        number = parse_decimal(value, what=f"resources.{key}")
    except ValueError as exc:
        raise InvalidResourceRequest(str(exc)) from None
    if number > 100 or (number == 0 and not allow_zero):
        fail(key, f"{amount_text(number)} is not a percentage {'from 0' if allow_zero else 'above 0'} up to 100")
    return number


def _size(value: object, key: str, *, bare_unit: int = 1) -> int:
    """A size (at most protocol.units.MAX_SIZE, 1 EiB); a bare whole number counts in `bare_unit` bytes
    (MiB for HAMi's gpumem)."""
    bare = bare_unit != 1 and (
        isinstance(value, int) and not isinstance(value, bool) or isinstance(value, str) and value.strip().isdigit()
    )
    try:
        size = parse_binary_size(value)
        if bare:
            size = parse_binary_size(size * bare_unit)
    except SizeError as exc:
        fail(key, str(exc))
    if size <= 0:
        fail(key, "must be more than 0 bytes")
    return size


def _slot_style(accelerator: dict[str, Any]) -> dict[str, Any]:
    key, value = next(iter(accelerator.items()))
    slot, _, subtype = key.partition(".")
    try:
        amount = parse_decimal(value, what=f"resources.{key}")
    except ValueError as exc:
        raise InvalidResourceRequest(str(exc)) from None
    if subtype == "device" and amount != amount.to_integral_value():
        fail(key, f"a device count must be a whole number, got {value!r}")
    return {"kind": subtype, "amount": amount, "slot": slot}


def _per_device(count: int, memory: MemorySpec, cores: Decimal, slot: str = "cuda") -> dict[str, Any]:
    return {"kind": "per_device", "amount": Decimal(count), "slot": slot, "memory": memory, "cores": cores}


def _memory_and_percent(accelerator: dict[str, Any], size_key: str, percent_key: str, *, bare_unit: int = 1) -> MemorySpec:
    if size_key in accelerator and percent_key in accelerator:
        fail(percent_key, f"give {size_key} or {percent_key}, not both")
    if size_key in accelerator:
        return MemorySpec(bytes=_size(accelerator[size_key], size_key, bare_unit=bare_unit))
    if percent_key in accelerator:
        return MemorySpec(percent=_percent(accelerator[percent_key], percent_key, allow_zero=False))
    return MemorySpec(percent=Decimal(100))  # HAMi: without a memory limit the whole memory


def _hami_style(accelerator: dict[str, Any]) -> dict[str, Any]:
    count = _count(accelerator.get("gpu", 1), "gpu")
    memory = _memory_and_percent(accelerator, "gpu_memory", "gpu_memory_percentage")
    return _per_device(count, memory, _percent(accelerator.get("gpu_cores", 0), "gpu_cores"))


def _fraction_style(accelerator: dict[str, Any]) -> dict[str, Any]:
    try:
        fraction = parse_decimal(accelerator["gpu_fraction"], what="resources.gpu_fraction")
    except ValueError as exc:
        raise InvalidResourceRequest(str(exc)) from None
    if not 0 < fraction <= 1:
        fail("gpu_fraction", f"{amount_text(fraction)} is not a fraction of one GPU (above 0, at most 1)")
    percent = fraction * 100
    return _per_device(1, MemorySpec(percent=percent), percent)


def _hami_names(accelerator: dict[str, Any]) -> dict[str, Any]:
    count = _count(accelerator.get("nvidia.com/gpu", 1), "nvidia.com/gpu")
    memory = _memory_and_percent(accelerator, "nvidia.com/gpumem", "nvidia.com/gpumem-percentage", bare_unit=MiB)
    return _per_device(count, memory, _percent(accelerator.get("nvidia.com/gpucores", 0), "nvidia.com/gpucores"))


def _hami_metax(accelerator: dict[str, Any]) -> dict[str, Any]:
    count = _count(accelerator.get("metax-tech.com/sgpu", 1), "metax-tech.com/sgpu")
    memory = MemorySpec(percent=Decimal(100))
    if "metax-tech.com/vmemory" in accelerator:  # HAMi's Metax docs: a bare number is GiB
        memory = MemorySpec(bytes=_size(accelerator["metax-tech.com/vmemory"], "metax-tech.com/vmemory", bare_unit=GiB))
    cores = _percent(accelerator.get("metax-tech.com/vcore", 0), "metax-tech.com/vcore")
    return _per_device(count, memory, cores, slot="metax")


def _egpu(accelerator: dict[str, Any]) -> dict[str, Any]:
    block = accelerator["egpu"]
    if not isinstance(block, dict):
        fail("egpu", 'expected an object of eGPU settings such as {"GPU_MEM_PER_DEVICE": 4294967296}')
    for key in block:
        if key not in EGPU_KEYS:
            fail(f"egpu.{key}", f"unknown eGPU setting (known: {', '.join(sorted(EGPU_KEYS))})")
    reserved = (
        _count(block.get("ALIYUN_COM_GPU_MEM_RESERVED", EGPU_RESERVED_DEFAULT_MIB), "egpu.ALIYUN_COM_GPU_MEM_RESERVED") * MiB
    )
    if "GPU_MEM_PER_DEVICE" in block:
        if "ALIYUN_COM_GPU_MEM_CONTAINER" in block:
            fail("egpu.ALIYUN_COM_GPU_MEM_CONTAINER", "give GPU_MEM_PER_DEVICE or the proportional pair, not both")
        memory = MemorySpec(bytes=_size(block["GPU_MEM_PER_DEVICE"], "egpu.GPU_MEM_PER_DEVICE"))
    elif "ALIYUN_COM_GPU_MEM_CONTAINER" in block:
        container = _positive(block["ALIYUN_COM_GPU_MEM_CONTAINER"], "egpu.ALIYUN_COM_GPU_MEM_CONTAINER")
        dev = (
            _positive(block["ALIYUN_COM_GPU_MEM_DEV"], "egpu.ALIYUN_COM_GPU_MEM_DEV")
            if "ALIYUN_COM_GPU_MEM_DEV" in block
            else ZERO
        )
        if dev and container > dev:
            fail(
                "egpu.ALIYUN_COM_GPU_MEM_CONTAINER",
                f"{amount_text(container)} is more than ALIYUN_COM_GPU_MEM_DEV {amount_text(dev)}",
            )
        memory = MemorySpec(container=container, dev=dev, reserved=reserved)
    else:
        fail("egpu", "needs GPU_MEM_PER_DEVICE (bytes) or ALIYUN_COM_GPU_MEM_CONTAINER")
    util = _percent(block.get("GPU_UTIL_PER_DEVICE", 0), "egpu.GPU_UTIL_PER_DEVICE")
    cores = ZERO if util == 0 or util > 95 else util  # eGPU: 0 or above 95 means no compute limit
    pins = _device_list(block.get("NVIDIA_VISIBLE_DEVICES"), "egpu.NVIDIA_VISIBLE_DEVICES")
    parsed = _per_device(len(pins) or 1, memory, cores)
    parsed["pins"] = pins
    return parsed


def _positive(value: object, key: str) -> Decimal:
    try:
        number = parse_decimal(value, what=f"resources.{key}")
    except ValueError as exc:
        raise InvalidResourceRequest(str(exc)) from None
    if number <= 0:
        fail(key, "must be above 0")
    return number


_PARSERS = {
    "hami": _hami_style,
    "runai": _fraction_style,
    "hami-names": _hami_names,
    "hami-names-metax": _hami_metax,
    "egpu": _egpu,
}


def _parser(style: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return _slot_style if style.startswith("slot:") else _PARSERS[style]


def _parse_cpu(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidResourceRequest(f"resources.cpu: expected a whole number of cores, got {value!r}")
    try:
        cores = int(value)
    except ValueError:
        raise InvalidResourceRequest(f"resources.cpu: expected a whole number of cores, got {value!r}") from None
    if cores < 1:
        raise InvalidResourceRequest(f"resources.cpu: at least 1 core, got {value!r}")
    if cores > MAX_COUNT:
        raise InvalidResourceRequest(f"resources.cpu: at most {MAX_COUNT} cores, got {value!r}")
    return cores


# --- the normalised request as JSON (stored with the session) ------------------------------


def request_to_spec(request: ResourceRequest) -> dict[str, Any]:
    """A JSON-safe dict of `request` (Decimals as text); `request_from_spec` reads it back."""
    memory = request.memory
    mig = {"mig_profile": request.mig_profile, "isolation": request.isolation} if isinstance(request, MigResourceRequest) else {}
    return {
        **mig,
        "kind": request.kind,
        "amount": str(request.amount),
        "cpu": request.cpu,
        "mem": request.mem,
        "slot": request.slot,
        "cores": str(request.cores),
        "pins": list(request.pins),
        "exclude": list(request.exclude),
        "policy": request.policy,
        "strategy": request.strategy,
        "numa": request.numa,
        "style": request.style,
        "resource_group": request.resource_group,
        "memory": None
        if memory is None
        else {
            "bytes": memory.bytes,
            "percent": str(memory.percent),
            "container": str(memory.container),
            "dev": str(memory.dev),
            "reserved": memory.reserved,
        },
    }


def request_from_spec(spec: dict[str, Any]) -> ResourceRequest:
    memory = spec.get("memory")
    mig = {"mig_profile": spec.get("mig_profile", ""), "isolation": spec["isolation"]} if "isolation" in spec else {}
    return (MigResourceRequest if mig else ResourceRequest)(
        **mig,
        kind=spec["kind"],
        amount=Decimal(spec["amount"]),
        cpu=spec["cpu"],
        mem=spec["mem"],
        slot=spec["slot"],
        cores=Decimal(spec.get("cores", "0")),
        pins=tuple(spec.get("pins", ())),
        exclude=tuple(spec.get("exclude", ())),
        policy=spec.get("policy"),
        strategy=spec.get("strategy"),
        numa=spec.get("numa", False),
        style=spec.get("style", ""),
        resource_group=spec.get("resource_group", ""),
        memory=None
        if memory is None
        else MemorySpec(
            bytes=memory["bytes"],
            percent=Decimal(memory["percent"]),
            container=Decimal(memory["container"]),
            dev=Decimal(memory["dev"]),
            reserved=memory["reserved"],
        ),
    )


def describe_request(request: ResourceRequest) -> str:
    """The accelerator part of a request in words, for per-device styles: "2 GPU × 4 GiB, 60%
    cores", "1 GPU × 20% of the memory, 20% cores"; MIG: "MIG 2g.20gb", "MIG instance of at
    least 15 GiB", "1 GPU × 4 GiB, shared or MIG"."""
    if isinstance(request, MigResourceRequest) and request.kind == "mig":
        if request.mig_profile or request.memory is None:  # parse_resources gives one or the other
            return f"MIG {request.mig_profile}"
        return f"MIG instance of at least {request.memory.describe()}"
    memory = request.memory.describe() if request.memory else "all the memory"
    cores = f", {amount_text(request.cores)}% cores" if request.cores else ""
    either = ", shared or MIG" if isinstance(request, MigResourceRequest) else ""
    return f"{amount_text(request.amount)} GPU × {memory}{cores}{either}"
