"""Device accounting and placement: pure Python, `Decimal` and integer base units, all-or-nothing.

Every device is accounted in memory (bytes) and compute (SMs); fGPU is a unit over both
(DESIGN.md "one accounting for every dialect"): s fGPU = s × unit_mem bytes and s × unit_proc
SMs. Capacity formula and the `evenly` / `fill` strategies are Backend.AI's fractional mode;
where Backend.AI rounds a split below the request, this module grants exactly the request or
raises. Functions never mutate their inputs; the scheduler writes the returned plan.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from decimal import ROUND_DOWN, Decimal
from typing import Literal

from accelerators.allocation.errors import (
    InsufficientResource,
    InvalidResourceRequest,
    NeverSchedulable,
    NotMultipleOfQuantum,
)
from accelerators.allocation.units import amount_text, format_binary_size

CENT = Decimal("0.01")
ZERO = Decimal(0)

Strategy = Literal["evenly", "fill"]
Policy = Literal["binpack", "spread"]


@dataclass(frozen=True)
class FractionalSettings:
    """1.0 fGPU = `unit_mem` bytes and `unit_proc` SMs; requests come in steps of `quantum` fGPU."""

    unit_mem: int
    unit_proc: int
    quantum: Decimal


@dataclass(frozen=True)
class DeviceState:
    """A device's totals and what live allocations hold of it (bytes, SMs, session count)."""

    device_id: str
    memory_total: int
    proc_total: int
    memory_used: int = 0
    proc_used: Decimal = ZERO
    sessions: int = 0
    numa_node: int | None = None

    @property
    def is_idle(self) -> bool:
        return self.sessions == 0 and self.memory_used == 0 and self.proc_used == 0


@dataclass(frozen=True)
class NodeState:
    """A node's CPU cores and memory (bytes), with what sessions hold, and its devices."""

    node_id: str
    cpu_total: int
    mem_total: int
    cpu_used: int = 0
    mem_used: int = 0
    devices: tuple[DeviceState, ...] = ()


@dataclass(frozen=True)
class ResourceRequest:
    """One session's request, normalised. `kind`: "shares" (amount in fGPU), "device" (amount
    = whole devices) or "none" (CPU only). `cpu` in cores, `mem` in bytes."""

    kind: Literal["shares", "device", "none"]
    amount: Decimal = ZERO
    cpu: int = 1
    mem: int = 0
    slot: str = "cuda"


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
    if free_mem <= 0 or free_proc <= 0:
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
    devices: Sequence[DeviceState], amount: Decimal, settings: FractionalSettings, *, strategy: Strategy = "evenly"
) -> tuple[DeviceGrant, ...]:
    """Split `amount` fGPU over `devices` of one node; the grants add up to exactly `amount`.

    `fill`: take from the device with the most free capacity first. `evenly` (default): a
    request that fits one device goes to the device with the least free capacity that still
    holds it; otherwise it is split as evenly as the quantum allows over as few devices as
    possible (Backend.AI's strategies, without its rounding below the request).
    Raises NotMultipleOfQuantum, InvalidResourceRequest, InsufficientResource.
    """
    check_quantum(amount, settings)
    quantum = settings.quantum
    want = int(amount / quantum)
    free = {d.device_id: int(truncate(device_free_shares(d, settings), quantum) / quantum) for d in devices}
    usable = [d for d in devices if free[d.device_id] > 0]
    total = sum(free[d.device_id] for d in usable)
    if total < want:
        raise InsufficientResource(
            f"{amount_text(amount)} fGPU requested, {truncate(total * quantum):.2f} fGPU free on this node's devices"
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
            best = min(fitting, key=lambda d: free[d.device_id])
            taken = {best.device_id: want}
        else:
            count, acc = 0, 0
            while acc < want:
                acc += free[by_free[count].device_id]
                count += 1
            taken = _water_fill(by_free[:count], free, want)
    else:
        raise InvalidResourceRequest(f"unknown allocation strategy {strategy!r} (expected 'evenly' or 'fill')")
    return tuple(
        shares_grant(d.device_id, quantum * taken[d.device_id], settings) for d in devices if taken.get(d.device_id)
    )


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


def allocate_devices(devices: Sequence[DeviceState], count: int) -> tuple[DeviceGrant, ...]:
    """Give `count` whole, idle devices, preferring devices that share one NUMA node (the
    smallest NUMA group that holds them all). Raises InsufficientResource."""
    if count <= 0:
        raise InvalidResourceRequest(f"a device count must be a positive whole number, got {count}")
    idle = [d for d in devices if d.is_idle]
    if len(idle) < count:
        raise InsufficientResource(f"{count} whole GPU(s) requested, {len(idle)} idle on this node")
    groups: dict[int | None, list[DeviceState]] = {}
    for d in idle:
        groups.setdefault(d.numa_node, []).append(d)
    fitting = [g for g in groups.values() if len(g) >= count]
    chosen = min(fitting, key=len)[:count] if fitting else idle[:count]
    return tuple(
        DeviceGrant(device_id=d.device_id, shares=Decimal(1), memory=d.memory_total, procs=Decimal(d.proc_total))
        for d in chosen
    )


def _allocate_on_node(node: NodeState, request: ResourceRequest, settings: FractionalSettings | None, strategy: Strategy):
    if request.cpu > node.cpu_total - node.cpu_used:
        raise InsufficientResource(f"{request.cpu} CPU cores requested, {node.cpu_total - node.cpu_used} free")
    if request.mem > node.mem_total - node.mem_used:
        raise InsufficientResource(
            f"{format_binary_size(request.mem)} memory requested, {format_binary_size(node.mem_total - node.mem_used)} free"
        )
    if request.kind == "shares":
        if settings is None:
            raise InvalidResourceRequest("fGPU shares need fractional settings for the slot")
        return allocate_shares(node.devices, request.amount, settings, strategy=strategy)
    if request.kind == "device":
        if request.amount != request.amount.to_integral_value():
            raise InvalidResourceRequest(f"a device count must be whole, got {amount_text(request.amount)}")
        return allocate_devices(node.devices, int(request.amount))
    return ()


def _remaining_gpu(node: NodeState, grants: Iterable[DeviceGrant]) -> Decimal:
    """Fraction of the node's device memory left free after `grants` (binpack/spread score)."""
    total = sum(d.memory_total for d in node.devices) or 1
    used = sum(d.memory_used for d in node.devices) + sum(g.memory for g in grants)
    return Decimal(total - used) / Decimal(total)


def place(
    nodes: Sequence[NodeState],
    request: ResourceRequest,
    settings: FractionalSettings | None,
    *,
    policy: Policy = "binpack",
    strategy: Strategy = "evenly",
) -> Placement:
    """Pick a node and devices for `request`.

    `binpack` prefers the node whose devices are left fullest (fewest stranded fragments),
    `spread` the emptiest; ties go to the first node in `nodes`. Raises InsufficientResource
    with the reason for the closest node when nothing fits now, NeverSchedulable when no
    node could hold it even empty, and the request's own errors (quantum, mode) as they are.
    """
    if not nodes:
        check_ever_fits(nodes, request, settings)
    candidates: list[tuple[Decimal, int, Placement]] = []
    reasons: list[str] = []
    for position, node in enumerate(nodes):
        try:
            grants = _allocate_on_node(node, request, settings, strategy)
        except InsufficientResource as exc:
            reasons.append(f"{node.node_id}: {exc}")
            continue
        score = _remaining_gpu(node, grants)
        candidates.append((score if policy == "binpack" else -score, position, Placement(node.node_id, grants)))
    if candidates:
        return min(candidates, key=lambda c: (c[0], c[1]))[2]
    check_ever_fits(nodes, request, settings, strategy=strategy)
    raise InsufficientResource("; ".join(reasons[:3]) + (f"; and {len(reasons) - 3} more nodes" if len(reasons) > 3 else ""))


def check_ever_fits(
    nodes: Sequence[NodeState], request: ResourceRequest, settings: FractionalSettings | None, *, strategy: Strategy = "evenly"
) -> None:
    """Raise NeverSchedulable (naming the slot and the largest amount a node holds) when no
    node could hold `request` even with all its capacity free; the request's own errors
    (quantum, mode) propagate as they are."""
    if not nodes:
        raise NeverSchedulable("no GPU node is registered yet: start an agent (python manage.py agent --config agent.toml)")
    empty = emptied(nodes)
    for node in empty:
        try:
            _allocate_on_node(node, request, settings, strategy)
            return
        except InsufficientResource:
            continue
    raise NeverSchedulable(_never_reason(empty, request, settings))


def emptied(nodes: Iterable[NodeState]) -> list[NodeState]:
    """The same nodes and devices with nothing allocated: what the cluster could ever hold."""
    return [
        NodeState(node_id=n.node_id, cpu_total=n.cpu_total, mem_total=n.mem_total,
                  devices=tuple(DeviceState(d.device_id, d.memory_total, d.proc_total, numa_node=d.numa_node)
                                for d in n.devices))
        for n in nodes
    ]


def _never_reason(nodes: Sequence[NodeState], request: ResourceRequest, settings: FractionalSettings | None) -> str:
    """Name what no node has enough of: the accelerator slot when no node's devices could hold
    the request, else CPU cores or memory."""
    if request.kind == "shares" and settings is not None and max_shares(nodes, settings) < request.amount:
        return (f"{request.slot}.shares: {amount_text(request.amount)} fGPU requested, but the largest any node can hold "
                f"is {max_shares(nodes, settings):.2f} fGPU")
    if request.kind == "device" and max_devices(nodes) < request.amount:
        return f"{request.slot}.device: {amount_text(request.amount)} GPU(s) requested, but the largest node has {max_devices(nodes)}"
    cpu = max((n.cpu_total for n in nodes), default=0)
    mem = max((n.mem_total for n in nodes), default=0)
    if request.cpu > cpu:
        return f"cpu: {request.cpu} CPU cores requested, but the largest node has {cpu}"
    if request.mem > mem:
        return f"mem: {format_binary_size(request.mem)} memory requested, but the largest node has {format_binary_size(mem)}"
    return (f"no single node has {request.cpu} CPU cores, {format_binary_size(request.mem)} memory and the "
            f"accelerator amount together")


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
