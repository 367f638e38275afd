"""The fragmentation map and the compaction plan of one resource group (issue 17.4). Pure Python.

Map (`fragmentation_map`): each device's free fGPU; the largest request that fits now (the
largest fGPU amount one request could get, `core.max_shares`, and the largest of the group's
recent request shapes that the allocator places now); and *stranded* capacity: free fGPU on a
device that none of the recent request shapes could use — no shape fits with the device pinned,
and no shape the allocator places on its node takes anything of it. That is the fragmentation
measure of Weng et al., "Beware of Fragmentation" (USENIX ATC'23, FGD): a GPU's free resources
are fragmented for the workload when no task of the target workload can be allocated there;
here the workload is the shapes seen lately (the caller says which).

Plan (`compaction_plan`): what would make a waiting `target` fit — the fewest sessions to move
(stop, and start again elsewhere) from one node, each of them preemptible and past its minimum
runtime, chosen so that the target fits there (the real allocator, the group's options) *and*
every moved session fits again on the cluster after the target took its place (largest first,
each placed by the allocator on the state the earlier ones left). Among sets of that size, the
least work lost first (fGPU × seconds run: what a restart throws away). A session that is not
preemptible is never moved. Its cost: sessions moved and fGPU-seconds of work lost.

MIG: the map lists MIG GPUs apart (their idle instances and stranded slices come from the MIG
planner, `accelerators.allocation.mig`), and the plan does not move MIG sessions: the planner
already reuses or destroys idle instances as a MIG request needs them.
"""

from __future__ import annotations

from typing import Any

from collections.abc import Sequence
from dataclasses import dataclass, replace
from decimal import Decimal

from accelerators.allocation import core
from accelerators.allocation.errors import AllocationError
from accelerators.allocation.preemption import Holder, Room, place_on, release, room_needed


@dataclass(frozen=True)
class DeviceFree:
    """One device of the map: `free` and `capacity` in fGPU; `stranded`: its free fGPU no recent
    request shape could use; `sessions` on it."""

    node_id: str
    device_id: str
    label: str
    free: Decimal
    capacity: Decimal
    sessions: int
    stranded: bool


@dataclass(frozen=True)
class FragmentationMap:
    """`devices` (node order, then device order); `free` and `stranded` in fGPU (sums);
    `largest_fgpu`: the largest fGPU amount one request could get now; `largest_shape`: the
    largest recent shape that fits now (None: none does); `shapes`: the recent shapes judged."""

    devices: tuple[DeviceFree, ...]
    free: Decimal
    stranded: Decimal
    largest_fgpu: Decimal
    largest_shape: core.ResourceRequest | None
    shapes: tuple[core.ResourceRequest, ...]


@dataclass(frozen=True)
class Move:
    """A session the plan stops and starts again: `holder` (where it is now) and `to_node`,
    where the allocator would place it after the target (the scheduler places the restarted
    session itself)."""

    holder: Holder
    to_node: str


@dataclass(frozen=True)
class CompactionPlan:
    """Moving `moves` (all from `node_id`) makes `target` fit there as `placement`. `fits_now`:
    nothing to move. `sessions_moved` and `work_lost` (fGPU-seconds) are its cost."""

    node_id: str
    moves: tuple[Move, ...]
    placement: core.Placement
    sessions_moved: int
    work_lost: float

    @property
    def fits_now(self) -> bool:
        return not self.moves


def request_fgpu(
    request: core.ResourceRequest, settings: core.FractionalSettings | None, nodes: Sequence[core.NodeState] = ()
) -> Decimal:
    """How large `request` is in fGPU, to compare shapes: the amount (fGPU); whole devices × the
    largest device's capacity among `nodes`; per-device × its memory in fGPU (or × the largest
    capacity when it asks for all the memory). 0 without fractional settings or for CPU only."""
    if settings is None or request.kind == "none":
        return core.ZERO
    if request.kind == "shares":
        return request.amount
    largest = max(
        (
            core.device_capacity(memory_size=d.memory_total, subproc_count=d.proc_total, settings=settings)
            for n in nodes
            for d in n.devices
        ),
        default=Decimal(1),
    )
    if request.kind == "per_device" and request.memory is not None and request.memory.bytes:
        return request.amount * Decimal(request.memory.bytes) / Decimal(settings.unit_mem)
    return request.amount * largest


def fragmentation_map(
    nodes: Sequence[core.NodeState],
    settings: core.FractionalSettings,
    *,
    shapes: Sequence[core.ResourceRequest],
    options: dict[str, Any] | None = None,
) -> FragmentationMap:
    """The map of `nodes` (one group's, fractional mode) against the recent request `shapes`
    (see the module); `options`: `core.place`'s (the group's policy). Pure; raises nothing of its own."""
    shapes = tuple(shapes)
    fitting = {}
    for n in nodes:
        fitting[n.node_id] = [(s, p) for s in shapes if (p := place_on(n, s, settings, options)) is not None]
    devices = []
    for n in nodes:
        for d in n.devices:
            free = core.device_free_shares(d, settings)
            capacity = core.device_capacity(memory_size=d.memory_total, subproc_count=d.proc_total, settings=settings)
            used = free > 0 and (
                any(any(g.device_id == d.device_id for g in p.grants) for _, p in fitting[n.node_id])
                or any(place_on(n, replace(s, pins=(d.device_id,), exclude=()), settings, options) for s in shapes)
            )
            devices.append(
                DeviceFree(n.node_id, d.device_id, d.label, free, capacity, d.sessions, stranded=free > 0 and not used)
            )
    placeable = [s for fits in fitting.values() for s, _ in fits]
    largest = max(placeable, key=lambda s: request_fgpu(s, settings, nodes), default=None)
    return FragmentationMap(
        devices=tuple(devices),
        free=sum((d.free for d in devices), core.ZERO),
        stranded=sum((d.free for d in devices if d.stranded), core.ZERO),
        largest_fgpu=core.max_shares(nodes, settings),
        largest_shape=largest,
        shapes=shapes,
    )


def movable(holder: Holder, now: float) -> bool:
    """Whether the plan may move `holder`: preemptible and past its minimum runtime."""
    return holder.preemptible and holder.ran(now) >= holder.min_runtime


def compaction_plan(
    nodes: Sequence[core.NodeState],
    holders: Sequence[Holder],
    target: core.ResourceRequest,
    settings: core.FractionalSettings | None,
    *,
    now: float,
    options: dict[str, Any] | None = None,
) -> CompactionPlan | None:
    """The plan that makes `target` fit (see the module): None when no set of movable sessions
    on one node does it with every moved session fitting again; a plan without moves when it
    fits now. `holders`: the sessions holding `nodes`' resources (their grants counted in the
    nodes' usage); `now` in epoch seconds. Pure; raises nothing of its own."""
    moves: dict[tuple[Any, ...], tuple[Move, ...]] = {}  # by `_key(room)`

    def relocatable(room: Room) -> bool:
        if room.placement is None:  # room_needed's candidates always carry their placement
            return False
        after = [
            core.apply_placement(release(n, room.victims), target, room.placement) if n.node_id == room.node_id else n
            for n in nodes
        ]
        placed = []
        for victim in sorted(room.victims, key=lambda h: (-h.shares, h.session_id)):
            request = _request_of(victim)
            try:
                placement = core.place(after, request, settings, **(options or {}))
            except AllocationError:
                return False
            row = next(i for i, n in enumerate(after) if n.node_id == placement.node_id)
            after[row] = core.apply_placement(after[row], request, placement)
            placed.append(Move(victim, placement.node_id))
        moves[_key(room)] = tuple(placed)
        return True

    room = room_needed(
        nodes,
        holders,
        target,
        settings,
        eligible=lambda h: movable(h, now),
        order=lambda h: (float(h.shares) * h.ran(now), h.session_id),
        options=options,
        accept=relocatable,
    )
    if room is None or room.placement is None:  # room_needed's rooms always carry their placement
        return None
    sessions_moved, lost = room.cost(now)
    return CompactionPlan(
        node_id=room.node_id, moves=moves[_key(room)], placement=room.placement, sessions_moved=sessions_moved, work_lost=lost
    )


def _key(room: Room) -> tuple[Any, ...]:
    return room.node_id, tuple(v.session_id for v in room.victims)


def _request_of(holder: Holder) -> core.ResourceRequest:
    """What a moved session asks for again: its own request where the caller gave it
    (`Holder.request`), else its fGPU (the sum of its grants), cores and memory."""
    if holder.request is not None:
        return holder.request
    return core.ResourceRequest("shares" if holder.grants else "none", amount=holder.shares, cpu=holder.cpu, mem=holder.mem)
