"""Device accounting and placement: pure Python, `Decimal` and integer base units, all-or-nothing.

Every device is accounted in memory (bytes) and compute (SMs); fGPU is a unit over both
(DESIGN.md "one accounting for every dialect"): s fGPU = s × unit_mem bytes and s × unit_proc
SMs. Capacity formula and the `evenly` / `fill` strategies are Backend.AI's fractional mode;
where Backend.AI rounds a split below the request, this module grants exactly the request or
raises. Functions never mutate their inputs; the scheduler writes the returned plan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from decimal import ROUND_DOWN, Decimal
from typing import Any, Literal, TypeVar

import numpy as np

from accelerators.allocation import cluster, topology
from accelerators.allocation.errors import (
    InsufficientResource,
    InvalidResourceRequest,
    NeverSchedulable,
    NotMultipleOfQuantum,
    UnknownDevice,
)
from accelerators.allocation.packing import PackingPlan, plan_ranks
from protocol.units import amount_text, format_binary_size

CENT = Decimal("0.01")
T = TypeVar("T")
ZERO = Decimal(0)

Strategy = Literal["evenly", "fill"]
RequestKind = Literal["shares", "device", "per_device", "none", "mig"]  # "mig": MigResourceRequest
Policy = Literal["binpack", "spread"]  # per-device order within a node; node policies: cluster.POLICIES
PlanLookup = Callable[[int], PackingPlan | None]  # device capacity (quanta) → fgd-plus's packing plan


@dataclass(frozen=True)
class FractionalSettings:
    """1.0 fGPU = `unit_mem` bytes and `unit_proc` SMs; requests come in steps of `quantum` fGPU."""

    unit_mem: int
    unit_proc: int
    quantum: Decimal


@dataclass(frozen=True)
class DeviceState:
    """A device's accounted totals and what live allocations hold of it (bytes, SMs, session
    count). Totals may be scaled above the hardware for deliberate over-subscription
    (HAMi's deviceMemoryScaling / deviceCoreScaling); `memory_physical` / `proc_physical` keep
    the hardware's figures (0: same as the totals), which percentages of a device refer to.
    `max_sessions` is the node's split count (0: no limit). `uuid` and `index` name the
    device to users and let requests pin it."""

    device_id: str
    memory_total: int
    proc_total: int
    memory_used: int = 0
    proc_used: Decimal = ZERO
    sessions: int = 0
    numa_node: int | None = None
    max_sessions: int = 0
    uuid: str = ""
    index: int | None = None
    memory_physical: int = 0
    proc_physical: int = 0

    @property
    def is_idle(self) -> bool:
        return self.sessions == 0 and self.memory_used == 0 and self.proc_used == 0

    @property
    def is_full(self) -> bool:
        """No new session may join: split count reached, or every SM held (a whole-device or
        100 %-cores grant holds the device exclusively)."""
        return bool(self.max_sessions and self.sessions >= self.max_sessions) or self.proc_used >= self.proc_total

    @property
    def hardware_memory(self) -> int:
        return self.memory_physical or self.memory_total

    @property
    def hardware_procs(self) -> int:
        return self.proc_physical or self.proc_total

    @property
    def label(self) -> str:
        if self.uuid and self.index is not None:
            return f"device {self.index} ({self.uuid})"
        return f"device {self.uuid or self.device_id}"

    def matches(self, pin: str) -> bool:
        """A pin names a device by UUID or by its index on the node ("3")."""
        return pin in (self.device_id, self.uuid) or (self.index is not None and pin == str(self.index))


@dataclass(frozen=True)
class NodeState:
    """A node's CPU cores and memory (bytes), with what sessions hold, and its devices."""

    node_id: str
    cpu_total: int
    mem_total: int
    cpu_used: int = 0
    mem_used: int = 0
    devices: tuple[DeviceState, ...] = ()
    links: tuple[topology.Link, ...] = ()  # between its devices, by device_id (topology.py)
    weights: tuple[Decimal, Decimal, Decimal] = (Decimal(1), Decimal(1), Decimal(1))  # memory, SMs, sessions
    shared_storage: bool = False  # its data-root is the cluster's shared mount (NFS…): see storage_scope


@dataclass(frozen=True)
class MemorySpec:
    """Device memory per device for a per-device request: `bytes`, or `percent` of the device's
    memory, or eGPU's proportional pair (device memory × `container` / `dev`, `dev` 0 meaning
    the device's memory in GiB rounded up), minus `reserved` bytes."""

    bytes: int = 0
    percent: Decimal = ZERO
    container: Decimal = ZERO
    dev: Decimal = ZERO
    reserved: int = 0

    def for_device(self, memory: int) -> int:
        """Bytes this spec asks of a device with `memory` bytes (truncated, never negative)."""
        if self.bytes:
            wanted = Decimal(self.bytes)
        elif self.percent:
            wanted = Decimal(memory) * self.percent / 100
        elif self.container:
            dev = self.dev or Decimal(-(-memory // (1 << 30)))
            wanted = Decimal(memory) * self.container / dev
        else:
            wanted = Decimal(memory)
        return max(0, int(wanted.to_integral_value(rounding=ROUND_DOWN)) - self.reserved)

    def describe(self) -> str:
        if self.bytes:
            return format_binary_size(self.bytes)
        if self.percent:
            return f"{amount_text(self.percent)}% of the memory"
        if self.container:
            dev = amount_text(self.dev) if self.dev else "its GiB"
            return f"{amount_text(self.container)}/{dev} of the memory"
        return "all the memory"


@dataclass(frozen=True)
class ResourceRequest:
    """One session's request, normalised from any request style.

    `kind`: "shares" (`amount` fGPU, may span one node's devices), "device" (`amount` whole
    devices), "per_device" (`amount` distinct devices, each giving `memory` and `cores` percent
    of its SMs; 0 cores reserves no compute and sets no limit, 100 holds the device
    exclusively) or "none" (CPU only). `cpu` in cores, `mem` in bytes. `pins` / `exclude`
    name devices by UUID or index; `policy` overrides the node policy, `strategy` is the fGPU
    split strategy, `numa` keeps devices on one NUMA node; `style` records the dialect used.
    """

    kind: RequestKind
    amount: Decimal = ZERO
    cpu: int = 1
    mem: int = 0
    slot: str = "cuda"
    memory: MemorySpec | None = None
    cores: Decimal = ZERO
    pins: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    policy: str | None = None
    strategy: Strategy | None = None
    numa: bool = False
    style: str = ""
    resource_group: str = ""


@dataclass(frozen=True)
class DeviceGrant:
    """What one device gives a session: fGPU `shares` (device count 1 for a whole device),
    `memory` in bytes, `procs` in SMs."""

    device_id: str
    shares: Decimal
    memory: int
    procs: Decimal


@dataclass(frozen=True)
class Placement:
    node_id: str
    grants: tuple[DeviceGrant, ...] = field(default_factory=tuple)


def truncate(value: Decimal, step: Decimal = CENT) -> Decimal:
    """Round `value` down to a multiple of `step`."""
    return (value / step).to_integral_value(rounding=ROUND_DOWN) * step


def device_capacity(*, memory_size: int, subproc_count: int, settings: FractionalSettings) -> Decimal:
    """A device's capacity in fGPU: min(memory / unit_mem, SMs / unit_proc), truncated to
    2 decimals (Backend.AI's fractional mode). 8 GiB, 80 SMs, 4 GiB / 40 SMs per fGPU → 2.00."""
    by_mem = Decimal(memory_size) / Decimal(settings.unit_mem)
    by_proc = Decimal(subproc_count) / Decimal(settings.unit_proc)
    return truncate(min(by_mem, by_proc))


def device_free_shares(device: DeviceState, settings: FractionalSettings) -> Decimal:
    """fGPU still free on `device`: min(free memory / unit_mem, free SMs / unit_proc), truncated
    to 2 decimals. A device held whole (by a `cuda.device` grant) has no free memory left."""
    free_mem = Decimal(device.memory_total - device.memory_used)
    free_proc = Decimal(device.proc_total) - device.proc_used
    if free_mem <= 0 or device.is_full:
        return ZERO
    return truncate(min(free_mem / Decimal(settings.unit_mem), free_proc / Decimal(settings.unit_proc)))


def shares_grant(device_id: str, shares: Decimal, settings: FractionalSettings) -> DeviceGrant:
    """The memory (bytes, truncated) and SMs that `shares` fGPU stand for."""
    memory = int((Decimal(settings.unit_mem) * shares).to_integral_value(rounding=ROUND_DOWN))
    return DeviceGrant(device_id=device_id, shares=shares, memory=memory, procs=Decimal(settings.unit_proc) * shares)


def check_quantum(amount: Decimal, settings: FractionalSettings) -> None:
    """Raises InvalidResourceRequest for amount <= 0, NotMultipleOfQuantum off the quantum grid."""
    if amount <= 0:
        raise InvalidResourceRequest(f"an fGPU amount must be positive, got {amount_text(amount)}")
    if amount % settings.quantum != 0:
        raise NotMultipleOfQuantum(f"{amount_text(amount)} fGPU is not a multiple of the quantum {settings.quantum.normalize()}")


def allocate_shares(
    devices: Sequence[DeviceState],
    amount: Decimal,
    settings: FractionalSettings,
    *,
    strategy: Strategy = "evenly",
    plan_for: PlanLookup | None = None,
) -> tuple[DeviceGrant, ...]:
    """Split `amount` fGPU over `devices` of one node; the grants add up to exactly `amount`.

    `fill`: take from the device with the most free capacity first. `evenly` (default): a
    request that fits one device goes to the device with the least free capacity that still
    holds it; otherwise it is split as evenly as the quantum allows over as few devices as
    possible (Backend.AI's strategies, without its rounding below the request). `plan_for`
    (fgd-plus: `Workload.packing_plan`, capacity in quanta → plan or None): a request that
    fits one device goes first to a device in use that is on the packing plan for its amount,
    then to an idle device, then as `evenly` (the order fgd-plus ranks nodes by).
    Raises NotMultipleOfQuantum, InvalidResourceRequest, InsufficientResource.
    """
    check_quantum(amount, settings)
    quantum = settings.quantum
    want = int(amount / quantum)
    units = _units_table(settings)
    free = {d.device_id: _units(d, settings, units)[0] for d in devices}
    usable = [d for d in devices if free[d.device_id] > 0]
    total = sum(free[d.device_id] for d in usable)
    if total < want:
        detail = ", ".join(f"{d.label} {truncate(free[d.device_id] * quantum):.2f}" for d in devices)
        raise InsufficientResource(
            f"{amount_text(amount)} fGPU requested, {truncate(total * quantum):.2f} fGPU free on this node's devices"
            + (f" ({detail})" if detail else "")
        )
    # Most free first; ties keep inventory order (stable sort).
    by_free = sorted(usable, key=lambda d: -free[d.device_id])
    if strategy == "fill":
        taken: dict[str, int] = {}
        remaining = want
        for d in by_free:
            take = min(free[d.device_id], remaining)
            taken[d.device_id] = take
            remaining -= take
            if remaining == 0:
                break
    elif strategy == "evenly":
        fitting = [d for d in by_free if free[d.device_id] >= want]
        if fitting:
            rank = _plan_ranks(fitting, free, want, settings, plan_for, units) if plan_for else {}
            best = min(fitting, key=lambda d: (rank.get(d.device_id, 0), free[d.device_id]))
            taken = {best.device_id: want}
        else:
            count, acc = 0, 0
            while acc < want:
                acc += free[by_free[count].device_id]
                count += 1
            taken = _water_fill(by_free[:count], free, want)
    else:
        raise InvalidResourceRequest(f"unknown allocation strategy {strategy!r} (expected 'evenly' or 'fill')")
    return tuple(shares_grant(d.device_id, quantum * taken[d.device_id], settings) for d in devices if taken.get(d.device_id))


def _water_fill(chosen: Sequence[DeviceState], free: dict[str, int], want: int) -> dict[str, int]:
    """Spread `want` quanta over `chosen` as evenly as their free quanta allow; exact total."""
    ascending = sorted(chosen, key=lambda d: free[d.device_id])
    taken: dict[str, int] = {}
    remaining = want
    for i, d in enumerate(ascending):
        give = min(free[d.device_id], remaining // (len(ascending) - i))
        taken[d.device_id] = give
        remaining -= give
    for d in reversed(ascending):  # leftovers of the integer division, most free first
        if remaining == 0:
            break
        extra = min(free[d.device_id] - taken[d.device_id], remaining)
        taken[d.device_id] += extra
        remaining -= extra
    return taken


def allocate_devices(
    devices: Sequence[DeviceState], count: int, *, node: NodeState | None = None, numa_required: bool = False
) -> tuple[DeviceGrant, ...]:
    """Give `count` whole, idle devices: the best-linked set where `node` reports links,
    else devices that share one NUMA node (the smallest NUMA group that holds them all).
    Raises InsufficientResource."""
    if count <= 0:
        raise InvalidResourceRequest(f"a device count must be a positive whole number, got {count}")
    idle = [d for d in devices if d.is_idle]
    if len(idle) < count:
        raise InsufficientResource(f"{count} whole GPU(s) requested, {len(idle)} idle on this node")
    chosen = _topology_pick(idle, count, node, numa_required=numa_required)
    return tuple(
        DeviceGrant(device_id=d.device_id, shares=Decimal(1), memory=d.memory_total, procs=Decimal(d.proc_total)) for d in chosen
    )


def _by_numa(devices: Iterable[DeviceState]) -> dict[int | None, list[DeviceState]]:
    """`devices` grouped by NUMA node, groups in order of first appearance, each keeping the
    devices' order."""
    groups: dict[int | None, list[DeviceState]] = {}
    for d in devices:
        groups.setdefault(d.numa_node, []).append(d)
    return groups


def _numa_pick(devices: Sequence[DeviceState], count: int, *, required: bool) -> list[DeviceState]:
    """`count` of `devices` (already in preference order) on one NUMA node when one holds
    enough: the smallest such group, so larger groups stay whole. With `required`, raise
    InsufficientResource when no single NUMA node has `count`; otherwise fall back to the
    first `count`."""
    groups = _by_numa(devices)
    fitting = [g for g in groups.values() if len(g) >= count]
    if fitting:
        return min(fitting, key=len)[:count]
    if required:
        largest = max((len(g) for g in groups.values()), default=0)
        raise InsufficientResource(f"{count} device(s) on one NUMA node asked, at most {largest} fit on one here")
    return list(devices[:count])


def _topology_pick(
    ordered: Sequence[DeviceState], count: int, node: NodeState | None, *, numa_required: bool
) -> list[DeviceState]:
    """`count` devices from `ordered` (policy order). Where the node reports links between its
    devices: several devices → the best-linked set (`topology.best_set`); one device → the
    worst-connected one (`topology.loneliest`), keeping well-linked devices free together for
    later multi-device work (HAMi's topology-aware rule). Without links: NUMA grouping."""
    if node is None or not node.links or not ordered:
        return _numa_pick(ordered, count, required=numa_required)
    pool = list(ordered)
    if numa_required:
        groups = _by_numa(ordered)
        fitting = [g for g in groups.values() if len(g) >= count]
        if not fitting:
            return _numa_pick(ordered, count, required=True)  # raises, naming the shortfall
        pool = min(fitting, key=len)
    by_id = {d.device_id: d for d in pool}
    numa = {d.device_id: d.numa_node for d in node.devices}
    ids = [d.device_id for d in pool]
    if count == 1:
        free = [d.device_id for d in node.devices if not d.is_full]
        return [by_id[topology.loneliest(ids, free, node.links, numa=numa)]]
    return [by_id[i] for i in topology.best_set(ids, count, node.links, numa=numa)]


def per_device_shortfall(device: DeviceState, request: ResourceRequest) -> str:
    """Why `device` cannot give one share of a per-device request now ("" when it can):
    e.g. "1.5 GiB memory free, 4 GiB asked"."""
    if device.max_sessions and device.sessions >= device.max_sessions:
        return f"hosts {device.sessions} sessions, its split count is {device.max_sessions}"
    if device.proc_used >= device.proc_total:
        return "held exclusively by another session"
    if request.cores >= 100 and not device.is_idle:
        return f"100% of the cores asks for the device alone, and {device.sessions} session(s) use it"
    memory = request.memory.for_device(device.hardware_memory) if request.memory else device.hardware_memory
    free_mem = device.memory_total - device.memory_used
    if memory > free_mem:
        return f"{format_binary_size(max(free_mem, 0))} memory free, {format_binary_size(memory)} asked"
    procs = Decimal(device.hardware_procs) * request.cores / 100
    free_proc = Decimal(device.proc_total) - device.proc_used
    if procs > free_proc:
        return f"{amount_text(free_proc)} SMs free, {amount_text(procs)} asked ({amount_text(request.cores)}% of its cores)"
    return ""


def device_score(device: DeviceState, request: ResourceRequest, weights: tuple[Decimal, Decimal, Decimal]) -> Decimal:
    """How full `device` would be after one share of a per-device request: the weighted sum of
    its used memory, SMs and sessions, each as a fraction of the total (HAMi scores devices this
    way; the weights are the resource group's). `binpack` takes the highest, `spread` the lowest."""
    memory = request.memory.for_device(device.hardware_memory) if request.memory else device.hardware_memory
    procs = Decimal(device.hardware_procs) * request.cores / 100
    w_mem, w_proc, w_sessions = weights
    split = device.max_sessions or 10
    return (
        w_mem * Decimal(device.memory_used + memory) / max(device.memory_total, 1)
        + w_proc * (device.proc_used + procs) / max(device.proc_total, 1)
        + w_sessions * Decimal(device.sessions + 1) / split
    )


def allocate_per_device(
    devices: Sequence[DeviceState],
    request: ResourceRequest,
    settings: FractionalSettings | None,
    *,
    policy: Policy = "binpack",
    node: NodeState | None = None,
) -> tuple[DeviceGrant, ...]:
    """Give `request.amount` distinct devices, each `request.memory` and `request.cores`
    percent of its SMs (HAMi's per-device memory + core limits, Run:ai's fractions, eGPU's
    memory and utilisation). `binpack` takes the devices with the least memory left free
    (keeping emptier GPUs whole for later), `spread` the most; 100 % cores takes the device
    exclusively (all its SMs are accounted). `shares` of each grant is its fGPU equivalent
    (the larger of memory / unit_mem and SMs / unit_proc, truncated to 2 decimals; 0 without
    fractional settings). Raises InsufficientResource naming each device that lacked what.
    """
    count = int(request.amount)
    if count <= 0 or request.amount != count:
        raise InvalidResourceRequest(f"a device count must be a positive whole number, got {amount_text(request.amount)}")
    fits, reasons = [], []
    for d in devices:
        why = per_device_shortfall(d, request)
        if why:
            reasons.append(f"{d.label}: {why}")
        else:
            fits.append(d)
    if len(fits) < count:
        what = request.memory.describe() if request.memory else "all the memory"
        raise InsufficientResource(
            f"{count} device(s) with {what} and {amount_text(request.cores)}% of the cores asked, {len(fits)} can give it"
            + (f" ({'; '.join(reasons[:4])})" if reasons else "")
        )
    weights = node.weights if node is not None else (Decimal(1), Decimal(1), Decimal(1))
    order = sorted(fits, key=lambda d: device_score(d, request, weights), reverse=(policy == "binpack"))
    chosen = _topology_pick(order, count, node, numa_required=request.numa)
    grants = []
    for d in chosen:
        memory = request.memory.for_device(d.hardware_memory) if request.memory else d.hardware_memory
        procs = Decimal(d.proc_total) - d.proc_used if request.cores >= 100 else Decimal(d.hardware_procs) * request.cores / 100
        shares = ZERO
        if settings is not None:
            shares = truncate(max(Decimal(memory) / settings.unit_mem, procs / settings.unit_proc))
        grants.append(DeviceGrant(device_id=d.device_id, shares=shares, memory=memory, procs=procs))
    return tuple(grants)


def _eligible(devices: Sequence[DeviceState], request: ResourceRequest) -> tuple[DeviceState, ...]:
    """The devices a request may use: its pins (UUID or index) if it names any, minus its
    exclusions. Raises InsufficientResource naming pins this node does not have."""
    chosen = tuple(devices)
    if request.pins:
        missing = [p for p in request.pins if not any(d.matches(p) for d in devices)]
        if missing:
            raise InsufficientResource(f"pinned device(s) {', '.join(missing)} not on this node")
        chosen = tuple(d for d in devices if any(d.matches(p) for p in request.pins))
    if request.exclude:
        chosen = tuple(d for d in chosen if not any(d.matches(p) for p in request.exclude))
    return chosen


def _unfragmented(
    devices: Sequence[DeviceState], request: ResourceRequest, settings: FractionalSettings, grants: tuple[DeviceGrant, ...]
) -> tuple[DeviceGrant, ...]:
    """The no-fragmentation guard for an fGPU request split over several devices: instead of an
    even split that leaves every device it touched partly used (1.5 → 0.75 + 0.75), take
    devices whole and leave at most one remainder (1.5 → 1.00 + 0.50), so the free shares stay
    together for later requests. A request that fits one device is never split anyway."""
    return allocate_shares(devices, request.amount, settings, strategy="fill")


def _plan_ranks(
    devices: Sequence[DeviceState],
    free: dict[str, int],
    want: int,
    settings: FractionalSettings,
    plan_for: PlanLookup,
    units: _UnitsTable,
) -> dict[str, int]:
    """Per device id, `packing.plan_ranks` for `want` quanta (as cluster.ClusterIndex ranks
    the node's candidates); `units`: `_units_table(settings)`."""
    capacity = np.array([_units(d, settings, units)[2] for d in devices], dtype=np.int64)
    used = capacity - np.array([free[d.device_id] for d in devices], dtype=np.int64)
    ranks = plan_ranks(capacity, used, want, plan_for)
    return {d.device_id: int(r) for d, r in zip(devices, ranks)}


def _allocate_on_node(
    node: NodeState,
    request: ResourceRequest,
    settings: FractionalSettings | None,
    strategy: Strategy,
    policy: Policy = "binpack",
    no_fragmentation: bool = False,
    plan_for: PlanLookup | None = None,
) -> tuple[DeviceGrant, ...]:
    if request.cpu > node.cpu_total - node.cpu_used:
        raise InsufficientResource(f"{request.cpu} CPU cores requested, {node.cpu_total - node.cpu_used} free")
    if request.mem > node.mem_total - node.mem_used:
        raise InsufficientResource(
            f"{format_binary_size(request.mem)} memory requested, {format_binary_size(node.mem_total - node.mem_used)} free"
        )
    if request.kind == "none":
        return ()
    devices = _eligible(node.devices, request)
    if request.kind == "shares":
        if settings is None:
            raise InvalidResourceRequest("fGPU shares need fractional settings for the slot")
        if request.numa:
            grants = _shares_on_one_numa_node(devices, request, settings, strategy, plan_for)
        else:
            grants = allocate_shares(devices, request.amount, settings, strategy=strategy, plan_for=plan_for)
        if no_fragmentation and len(grants) > 1:
            grants = _unfragmented(devices, request, settings, grants)
        return grants
    if request.kind == "per_device":
        return allocate_per_device(devices, request, settings, policy=policy, node=node)
    if request.amount != request.amount.to_integral_value():
        raise InvalidResourceRequest(f"a device count must be whole, got {amount_text(request.amount)}")
    return allocate_devices(devices, int(request.amount), node=node, numa_required=request.numa)


def _shares_on_one_numa_node(
    devices: Sequence[DeviceState],
    request: ResourceRequest,
    settings: FractionalSettings,
    strategy: Strategy,
    plan_for: PlanLookup | None = None,
) -> tuple[DeviceGrant, ...]:
    """An fGPU request kept on one NUMA node: the first NUMA node (by its devices' order) that
    holds it. Raises the last node's InsufficientResource when none does."""
    groups = _by_numa(devices)
    error: InsufficientResource | None = None
    for numa, group in groups.items():
        try:
            return allocate_shares(group, request.amount, settings, strategy=strategy, plan_for=plan_for)
        except InsufficientResource as exc:
            error = InsufficientResource(f"NUMA node {numa}: {exc}")
    raise error or InsufficientResource("no device on this node")


def place(
    nodes: Sequence[NodeState],
    request: ResourceRequest,
    settings: FractionalSettings | None,
    *,
    policy: str = "binpack",
    strategy: Strategy = "evenly",
    no_fragmentation: bool = False,
    index: cluster.ClusterIndex | None = None,
    workload: cluster.Workload | None = None,
) -> Placement:
    """Pick a node and devices for `request`.

    The node comes from `policy` (cluster.POLICIES): `binpack` prefers the node whose devices
    are left fullest, `spread` the emptiest, `best-fit` the least resources left over, `fgd`
    and `fgd-plus` the least growth in expected fragmentation under `workload` (the request
    shapes seen so far; without one, this request's shape alone); ties go to the first node in
    `nodes`. The devices on that node come from the exact allocator (pins, exclusions, NUMA,
    topology, quantum, `strategy`, `no_fragmentation`); a node whose devices cannot give it
    after all is skipped for the next best. `index` is `cluster_index(nodes, settings)` kept
    by a caller that places many requests on the same nodes (then `nodes` and `index` must
    describe the same state: see `apply_placement`). The request's own `policy` and `strategy`
    win over the arguments (the resource group's). Raises InsufficientResource with the
    reason for the first nodes when nothing fits now, NeverSchedulable when no node could hold
    it even empty, and the request's own errors (quantum, mode) as they are.
    """
    policy = request.policy or policy
    strategy = request.strategy or strategy
    if not nodes:
        check_ever_fits(nodes, request, settings)
    if policy not in cluster.POLICIES:
        raise InvalidResourceRequest(f"unknown placement policy {policy!r} (known: {', '.join(cluster.POLICIES)})")
    if index is None:
        index = cluster_index(nodes, settings)
    shape = request_shape(request, settings)
    if workload is None and policy in cluster.FRAGMENTATION_AWARE:
        workload = cluster.Workload({shape: 1})
    plan_for = workload.packing_plan if policy == "fgd-plus" and workload is not None else None
    # The best node first (`ClusterIndex.choose`: scores only what can be best), the whole
    # ranking only when its devices cannot give it after all: a pass placing 1,000 sessions on
    # 1,000 nodes ranks no node it does not try.
    chosen = index.choose(shape, policy, workload)
    tried = -1
    if chosen is not None:
        tried = chosen[0]
        try:
            grants = _allocate_on_node(
                nodes[tried], request, settings, strategy, _device_policy(policy), no_fragmentation, plan_for
            )
            return Placement(nodes[tried].node_id, grants)
        except InsufficientResource:
            pass
    for row in index.ranking(shape, policy, workload) if chosen is not None else ():
        if row == tried:
            continue
        try:
            grants = _allocate_on_node(
                nodes[row], request, settings, strategy, _device_policy(policy), no_fragmentation, plan_for
            )
        except InsufficientResource:
            continue
        return Placement(nodes[row].node_id, grants)
    check_ever_fits(nodes, request, settings, strategy=strategy)
    reasons: list[str] = []
    for node in nodes[:3]:
        try:
            _allocate_on_node(node, request, settings, strategy, _device_policy(policy), no_fragmentation)
            reasons.append(f"{node.node_id}: its devices cannot give it this way")
        except InsufficientResource as exc:
            reasons.append(f"{node.node_id}: {exc}")
    more = len(nodes) - len(reasons)
    raise InsufficientResource("; ".join(reasons) + (f"; and {more} more nodes" if more > 0 else ""))


def _device_policy(policy: str) -> Policy:
    """The per-device order within a node: spread keeps spreading, every other policy packs."""
    return "spread" if policy == "spread" else "binpack"


def request_shape(request: ResourceRequest, settings: FractionalSettings | None) -> cluster.Shape:
    """`request` in the cluster index's units (see `cluster_index`): CPU cores, bytes, and
    fGPU quanta (fractional mode) or thousandths of a device's memory (discrete mode).
    Per-device requests are filtered on CPU and memory only; the exact allocator checks their
    devices. `device_fraction` lets binpack/spread count whole devices' memory per node."""
    cpu, mem = request.cpu, request.mem
    if request.kind == "shares" and settings is not None and request.amount > 0:
        quanta = int(request.amount / settings.quantum)
        memory = int(Decimal(settings.unit_mem) * request.amount)
        return cluster.Shape(cluster.SPAN, cpu=cpu, mem=mem, amount=quanta, memory=memory)
    if request.kind == "device" and request.amount == request.amount.to_integral_value() and request.amount > 0:
        count = int(request.amount)
        return cluster.Shape(cluster.WHOLE, cpu=cpu, mem=mem, count=count, device_fraction=float(count))
    if request.kind == "per_device":
        count = int(request.amount) if request.amount == request.amount.to_integral_value() else 0
        memory = request.memory.bytes if request.memory is not None else 0
        fraction = 0.0
        if request.memory is None:
            fraction = float(count)
        elif request.memory.percent:
            fraction = float(count * request.memory.percent / 100)
        return cluster.Shape(
            cluster.NONE, cpu=cpu, mem=mem, count=count, memory=count * memory, device_fraction=fraction, per_device=True
        )
    return cluster.Shape(cluster.NONE, cpu=cpu, mem=mem)


# A device's figures in quanta depend on six of its fields only, and a cluster's devices take few
# distinct values of them: each is converted (Decimal arithmetic, ~20 µs) once per settings, not
# for each device of each node at each placement and index build (issue 35.2: a replay of 1,000
# placements converted ~35,000 devices, a quarter of its time).
UNITS_KEPT = 1 << 14  # device figures kept per settings (then forgotten all at once)
_UnitsKey = tuple[int, int, int, Decimal, int, int]
_UnitsTable = dict[_UnitsKey, tuple[int, int, int]]
_units_kept: dict[FractionalSettings | None, _UnitsTable] = {}


def _units_table(settings: FractionalSettings | None) -> _UnitsTable:
    """The kept conversions for `settings` (`_units`)."""
    table = _units_kept.get(settings)
    if table is None or len(table) > UNITS_KEPT:
        if len(_units_kept) > 64:
            _units_kept.clear()
        table = _units_kept[settings] = {}
    return table


def _units(device: DeviceState, settings: FractionalSettings | None, table: _UnitsTable) -> tuple[int, int, int]:
    """(free quanta as `allocate_shares` counts them (0 without settings), free and total in the
    index's units as `device_units` gives them) of `device`, from `table` (`_units_table(settings)`)
    where a device with the same memory, SMs, use and split count was converted before: every
    figure is a function of those six fields (`device_free_shares`, `device_capacity`,
    `DeviceState.is_idle` and `is_full`) and of `settings`."""
    key = (device.memory_total, device.proc_total, device.memory_used, device.proc_used, device.sessions, device.max_sessions)
    found = table.get(key)
    if found is None:
        quanta = 0
        if settings is not None:
            quanta = int(truncate(device_free_shares(device, settings), settings.quantum) / settings.quantum)
        found = table[key] = (quanta, *_device_units_of(device, settings))
    return found


def device_units(device: DeviceState, settings: FractionalSettings | None) -> tuple[int, int]:
    """(free, total) of one device in the index's units: fGPU quanta, or thousandths of its
    memory in discrete mode. A full device (split count reached, all SMs held) has none free."""
    _, free, total = _units(device, settings, _units_table(settings))
    return free, total


def _device_units_of(device: DeviceState, settings: FractionalSettings | None) -> tuple[int, int]:
    """`device_units`, converted."""
    if settings is not None:
        quantum = settings.quantum
        cap = int(
            truncate(
                device_capacity(memory_size=device.memory_total, subproc_count=device.proc_total, settings=settings), quantum
            )
            / quantum
        )
        if cap == 0:  # too small for one quantum: still a whole device
            return int(device.is_idle), 1
        free = int(truncate(device_free_shares(device, settings), quantum) / quantum)
        return free, cap
    if device.is_full or device.memory_total <= 0:
        return 0, 1000
    return max(0, (device.memory_total - device.memory_used) * 1000 // device.memory_total), 1000


def node_row(node: NodeState, settings: FractionalSettings | None) -> dict[str, Any]:
    """One node's figures for the cluster index (see `cluster_index`)."""
    table = _units_table(settings)
    units = [_units(d, settings, table)[1:] for d in node.devices]
    return {
        "cpu_free": node.cpu_total - node.cpu_used,
        "mem_free": node.mem_total - node.mem_used,
        "free": [u[0] for u in units],
        "memory_free": sum(d.memory_total - d.memory_used for d in node.devices),
    }


def cluster_index(nodes: Sequence[NodeState], settings: FractionalSettings | None) -> cluster.ClusterIndex:
    """The vectorised index over `nodes` (same order) that `place` ranks nodes with: CPU in
    cores, memory in bytes, each device's free and total amount in fGPU quanta (fractional
    mode) or thousandths of its memory (discrete mode), device memory in bytes for
    binpack/spread. Cost: one pass over the devices; keep it across placements and update it
    with `apply_placement`."""
    width = max((len(n.devices) for n in nodes), default=0) or 1
    cap = [[0] * width for _ in nodes]
    free = [[0] * width for _ in nodes]
    memory_total, memory_free, device_memory = [], [], []
    table = _units_table(settings)
    for i, node in enumerate(nodes):
        for j, d in enumerate(node.devices):
            _, free[i][j], cap[i][j] = _units(d, settings, table)
        memory_total.append(sum(d.memory_total for d in node.devices))
        memory_free.append(sum(d.memory_total - d.memory_used for d in node.devices))
        device_memory.append(max((d.memory_total for d in node.devices), default=0))
    return cluster.ClusterIndex(
        names=[n.node_id for n in nodes],
        cpu_total=[n.cpu_total for n in nodes],
        mem_total=[n.mem_total for n in nodes],
        cpu_free=[n.cpu_total - n.cpu_used for n in nodes],
        mem_free=[n.mem_total - n.mem_used for n in nodes],
        models=["" for _ in nodes],
        cap=cap,
        free=free,
        memory_total=memory_total,
        memory_free=memory_free,
        device_memory=device_memory,
    )


def apply_placement(node: NodeState, request: ResourceRequest, placement: Placement) -> NodeState:
    """`node` after `placement` of `request` (what a scheduler writes as Allocation rows): CPU,
    memory and each granted device's memory, SMs and session count taken. Raises
    InsufficientResource if that over-commits (a caller bug: the plan was for another state)."""
    grants = {g.device_id: g for g in placement.grants}
    devices = []
    for d in node.devices:
        g = grants.get(d.device_id)
        if g is not None:
            d = replace(d, memory_used=d.memory_used + g.memory, proc_used=d.proc_used + g.procs, sessions=d.sessions + 1)
            if d.memory_used > d.memory_total or d.proc_used > d.proc_total:
                raise InsufficientResource(f"{d.label} on {node.node_id} would be over-committed")
        devices.append(d)
    after = replace(node, cpu_used=node.cpu_used + request.cpu, mem_used=node.mem_used + request.mem, devices=tuple(devices))
    if after.cpu_used > after.cpu_total or after.mem_used > after.mem_total:
        raise InsufficientResource(f"{node.node_id} would be over-committed on CPU or memory")
    return after


def release_placement(node: NodeState, *, cpu: int, mem: int, grants: Iterable[DeviceGrant]) -> NodeState:
    """`node` after a session holding `cpu` cores, `mem` bytes and `grants` on it ends: the
    inverse of `apply_placement` (what releasing its Allocation rows gives back). Never goes
    below nothing held (a session read while it was being released)."""
    given = {g.device_id: g for g in grants}
    devices = []
    for d in node.devices:
        g = given.get(d.device_id)
        if g is not None:
            d = replace(
                d,
                memory_used=max(0, d.memory_used - g.memory),
                proc_used=max(ZERO, d.proc_used - g.procs),
                sessions=max(0, d.sessions - 1),
            )
        devices.append(d)
    return replace(node, cpu_used=max(0, node.cpu_used - cpu), mem_used=max(0, node.mem_used - mem), devices=tuple(devices))


def _has_shared_storage(node: Any) -> bool:
    return bool(node.shared_storage)


def storage_scope(nodes: Sequence[T], shared: Callable[[T], bool] = _has_shared_storage) -> list[T]:
    """The nodes of a scope (a resource group's alive, undrained nodes holding the image) that a
    session may go to for its data folders: every session gets its owner's ~/data and project
    folders (`<data-root>/users/<id>`, `<data-root>/projects/<id>`) wherever it runs.

    The rule: when the scope holds more than one node and some of them have shared storage
    (`NodeState.shared_storage`: agent.toml `[storage] shared = true`, NFS or alike), only those
    are kept, so the folders are the same whichever of them the session lands on, as a Slurm user
    expects of a home on NFS and as Backend.AI's scheduler keeps a session to the agents that
    mount its vfolder host. Otherwise (one node, or none with shared storage) every node is kept,
    and a session placed on a node without it is told that its folders are local to that node
    (the launch preview, the session's page). A node with local storage beside shared ones takes
    no session of that scope: put it in a resource group of its own to use it. Order is kept.
    `shared`: whether an item has shared storage (default: a NodeState's `shared_storage`; the MIG
    scope passes its rooms'). Pure: never mutates `nodes`."""
    kept = [n for n in nodes if shared(n)]
    if len(nodes) > 1 and kept:
        return kept
    return list(nodes)


def check_ever_fits(
    nodes: Sequence[NodeState], request: ResourceRequest, settings: FractionalSettings | None, *, strategy: Strategy = "evenly"
) -> None:
    """Raise NeverSchedulable (naming the slot and the largest amount a node holds) when no
    node could hold `request` even with all its capacity free; the request's own errors
    (quantum, mode) propagate as they are."""
    if not nodes:
        raise NeverSchedulable("no GPU node is registered yet: start an agent (python manage.py agent --config agent.toml)")
    strategy = request.strategy or strategy
    empty = emptied(nodes)
    for node in empty:
        try:
            _allocate_on_node(node, request, settings, strategy, _device_policy(request.policy or "binpack"))
            return
        except InsufficientResource:
            continue
    missing = tuple(p for p in request.pins if not any(d.matches(p) for n in empty for d in n.devices))
    if missing:
        raise UnknownDevice(f"devices: {', '.join(missing)} is not a device of any registered node", pins=missing)
    if request.kind == "per_device":
        parts = _per_device_never(empty, request)
        if parts:
            raise NeverSchedulable(" ".join(parts.values()), parts=parts)
    raise NeverSchedulable(_never_reason(empty, request, settings))


def emptied(nodes: Iterable[NodeState]) -> list[NodeState]:
    """The same nodes and devices with nothing allocated: what the cluster could ever hold."""
    return [
        replace(
            n, cpu_used=0, mem_used=0, devices=tuple(replace(d, memory_used=0, proc_used=ZERO, sessions=0) for d in n.devices)
        )
        for n in nodes
    ]


def _never_reason(nodes: Sequence[NodeState], request: ResourceRequest, settings: FractionalSettings | None) -> str:
    """Name what no node has enough of: the accelerator slot when no node's devices could hold
    the request, else CPU cores or memory (a per-device request's devices: `_per_device_never`)."""
    if request.kind == "shares" and settings is not None and max_shares(nodes, settings) < request.amount:
        return (
            f"{request.slot}.shares: {amount_text(request.amount)} fGPU requested, but the largest any node can hold "
            f"is {max_shares(nodes, settings):.2f} fGPU"
        )
    if request.kind == "device" and max_devices(nodes) < request.amount:
        return (
            f"{request.slot}.device: {amount_text(request.amount)} GPU(s) requested, "
            f"but the largest node has {max_devices(nodes)}"
        )
    cpu = max((n.cpu_total for n in nodes), default=0)
    mem = max((n.mem_total for n in nodes), default=0)
    if request.cpu > cpu:
        return f"cpu: {request.cpu} CPU cores requested, but the largest node has {cpu}"
    if request.mem > mem:
        return f"mem: {format_binary_size(request.mem)} memory requested, but the largest node has {format_binary_size(mem)}"
    return (
        f"no single node has {request.cpu} CPU cores, {format_binary_size(request.mem)} memory and the "
        f"accelerator amount together"
    )


def _per_device_never(nodes: Sequence[NodeState], request: ResourceRequest) -> dict[str, str]:
    """Why no node (all free) could give a per-device request, as NeverSchedulable's parts:
    what was asked, the most any node can give, what to do (`{}` when some node could give it,
    so the reason lies elsewhere: CPU or memory). E.g. "cuda: 64 GPUs asked, each with 4 GiB
    and 25% of its cores." "The most one node can give is 8 such GPUs (n3)." "Ask for at most
    8 GPUs per session (a session runs on one node)."."""
    count = int(request.amount)
    each = request.memory.describe() if request.memory else "all its memory"
    if request.cores:
        each += f" and {amount_text(request.cores)}% of its cores"
    asked = f"{request.slot}: {count} GPU{'s' if count != 1 else ''} asked, each with {each}."
    best, best_node, shortfall = 0, "", ""
    for n in nodes:
        fitting = 0
        try:
            devices = _eligible(n.devices, request)
        except InsufficientResource:  # pins of another node's devices
            continue
        for d in devices:
            why = per_device_shortfall(d, request)
            if not why:
                fitting += 1
            elif not shortfall:
                shortfall = f"{d.label} of {n.node_id}: {why}"
        if fitting > best:
            best, best_node = fitting, n.node_id
    if best >= count:
        return {}
    if best == 0:
        return {
            "asked": asked,
            "most": f"No GPU of any node can give one ({shortfall or 'no GPU'}).",
            "advice": "Ask for less memory or fewer cores per GPU.",
        }
    plural = "s" if best != 1 else ""
    return {
        "asked": asked,
        "most": f"The most one node can give is {best} such GPU{plural} ({best_node}).",
        "advice": f"Ask for at most {best} GPU{plural} per session (a session runs on one node).",
    }


def max_shares(nodes: Iterable[NodeState], settings: FractionalSettings) -> Decimal:
    """The largest fGPU amount one request could get now: per node the sum of its devices' free
    shares rounded down to the quantum (a request may span one node's devices), max over nodes."""
    best = ZERO
    for node in nodes:
        total = sum((truncate(device_free_shares(d, settings), settings.quantum) for d in node.devices), ZERO)
        best = max(best, total)
    return truncate(best)


def max_devices(nodes: Iterable[NodeState]) -> int:
    """The most whole, idle devices one node offers now."""
    return max((sum(1 for d in n.devices if d.is_idle) for n in nodes), default=0)
