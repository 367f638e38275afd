"""The fleet overview (issue 36.4): every node and GPU at a glance, for administrators.

What an administrator asks of a fleet (HAMi-WebUI's node and GPU views, Run:ai's overview
dashboards): per node its state, and per GPU what is *allocated* (live allocations: what the
scheduler handed out), what is *used* (the agent's newest usage sample: what the processes
really touch) and what is *free* (what a new session could still get), MIG GPUs by their slices.

Reads only, computed from the database (not from the kept cluster view,
`accelerators.cluster_view`): one aggregate query over every device and its live allocations
(summed in SQL), one over the nodes, one over the held MIG instances; then, for one page of
nodes only, their newest usage samples. At 1,000 nodes × 8 GPUs that is a few 10,000-row
reads, no query per node (tests/test_fleet.py counts them; README "Fleet overview" gives the
measured times).

Units: memory in bytes, compute in SMs, fGPU as `Decimal` (text "1.50" in the API), load in
percent (0–100), MIG in compute slices (7 a GPU; NVIDIA MIG User Guide).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from django.db.models import Q

import protocol
from accelerators.allocation import core, mig
from accelerators.allocation.errors import InvalidResourceRequest
from accelerators.models import AllocationMode, Device, FractionalSettings, GpuInstance, MigMode, Node, NodeStatus
from accelerators.selectors import devices_with_usage, nodes_with_usage

# A node's state, as the overview names it: ready (heartbeats arrive, nothing pending), draining
# (an administrator drains it, Node.drain_since: no new session is placed there; drained
# included; accelerators.drain), mig-pending (its agent has not applied the MIG layout the manager
# sent yet), mig-error (its agent reported a MIG layout it could not apply), lost (heartbeats
# stopped: nothing is placed there, its sessions are fenced; sessions.lifecycle).
STATES = ("ready", "draining", "mig-pending", "mig-error", "lost")
NO_GROUP = "-"  # the `resource_group` filter's value for the nodes in no resource group
SORTS = ("name", "free", "load", "-load")  # name; most free fGPU first; least loaded first; most loaded first
PAGE_SIZE = 50
PAGE_SIZE_MAX = 200
SAMPLE_HORIZON_S = 120  # a device sample older than this is not "used now": its agent is silent (unknown, not 0)
_MIG_PENDING = ("sent", "pending", "pending-agent-offline")


class DeviceSamples:
    """What the overview reads of the agents' device samples (usage.DeviceSample), through an
    interface the usage app provides (issue 34.3: usage sits above accelerators, which never
    imports it): usage's AppConfig.ready() sets `samples` to usage.selectors.FleetDeviceSamples.
    This default, without the usage app, knows no sample."""

    def newest(self, *, device_ids: list[Any], since: int) -> dict[Any, dict[str, Any]]:
        """Device pk → its newest sample since `since` (epoch seconds): `{"memory_used": bytes,
        "util": percent, "t": epoch seconds}`, for the devices of `device_ids` that have one."""
        return {}

    def used(self, *, since: int, node_ids: list[Any] | None) -> tuple[int, int, Any]:
        """Over the sampled GPUs (MIG devices aside) of the nodes `node_ids` (None: every node),
        each GPU's mean memory used (bytes) and utilisation (percent) over its samples since
        `since`: `(GPUs sampled, the sum of their memory means, the mean of their utilisation
        means or None)`, aggregated where the samples are (one row back, not one a GPU)."""
        return 0, 0, None


samples = DeviceSamples()  # set by usage.apps.UsageConfig.ready()
_PROFILE_SLICES = re.compile(r"^(\d+)g")


def profile_compute_slices(profile: str) -> int:
    """Compute slices of a MIG profile by its name's leading "<n>g" (NVIDIA's naming:
    "1g.10gb" → 1, "3g.40gb" → 3, "1g.20gb+me" → 1); 0 for a name without it."""
    found = _PROFILE_SLICES.match(profile or "")
    return int(found.group(1)) if found else 0


@dataclass
class GpuFigures:
    """One whole GPU of a node. `kind`: "fgpu" (fractional slot: shared by fGPU), "whole"
    (discrete slot: granted whole or by memory + cores) or "mig" (serves MIG instances, never
    fGPU: its node is in dynamic or fixed MIG mode, or its inventory declares MIG slices).
    `capacity`/`free` in fGPU (None but for "fgpu"); `allocated` fGPU held by live allocations
    (1 per whole-device grant); `memory_allocated` bytes and `proc_allocated` SMs held;
    `mig_total`/`mig_used` compute slices (0 but for "mig"); `load` percent: the larger of
    memory and SMs allocated (MIG: compute slices held)."""

    pk: Any
    node_id: Any
    index: int
    device_id: str
    model: str
    memory_size: int
    subproc_count: int
    kind: str
    capacity: Decimal | None
    allocated: Decimal
    free: Decimal | None
    memory_allocated: int
    proc_allocated: Decimal
    sessions: int
    mig_total: int = 0
    mig_used: int = 0
    load: int = 0
    used: dict | None = None  # the newest usage sample {"memory_used", "util", "t"} (set for a page's GPUs only)


@dataclass
class NodeFigures:
    """One node and its GPUs' sums: `fgpu_capacity`/`fgpu_free`/`fgpu_allocated` over its
    "fgpu" GPUs, `gpus_idle` its non-MIG GPUs nobody holds, `mig_*` compute slices over its
    "mig" GPUs, memory in bytes over every GPU, `load` the mean of its GPUs' (percent)."""

    pk: Any
    name: str
    status: str
    state: str
    last_heartbeat: Any
    resource_group: str
    mig_mode: str
    gpus: list[GpuFigures] = field(default_factory=list)
    fgpu_capacity: Decimal = Decimal(0)
    fgpu_free: Decimal = Decimal(0)
    fgpu_allocated: Decimal = Decimal(0)
    gpus_idle: int = 0
    mig_total: int = 0
    mig_free: int = 0
    memory_total: int = 0
    memory_allocated: int = 0
    sessions: int = 0
    load: int = 0
    cpu_used: int = 0  # cores its active sessions hold (set for a page's nodes only)
    mem_used: int = 0  # bytes of main memory they hold (idem)

    @property
    def models(self) -> list[str]:
        return sorted({g.model for g in self.gpus})

    @property
    def gpus_plain(self) -> int:
        """Its GPUs that serve no MIG (fGPU or whole)."""
        return sum(1 for g in self.gpus if g.kind != "mig")


@dataclass(frozen=True)
class FleetFilter:
    """What the overview shows: `state` one of STATES ("" any), `resource_group` a group's
    name (NO_GROUP: in none; "" any), `model` a text a GPU model name contains (any case),
    `name` a text the node's name contains, and at least `min_free_fgpu` fGPU free,
    `min_idle_gpus` idle GPUs, `min_free_mig` free MIG compute slices."""

    state: str = ""
    resource_group: str = ""
    model: str = ""
    name: str = ""
    min_free_fgpu: Decimal = Decimal(0)
    min_idle_gpus: int = 0
    min_free_mig: int = 0

    def keeps(self, node: NodeFigures) -> bool:
        if self.state and node.state != self.state:
            return False
        if self.resource_group and node.resource_group != ("" if self.resource_group == NO_GROUP else self.resource_group):
            return False
        if self.model and not any(self.model.lower() in g.model.lower() for g in node.gpus):
            return False
        if self.name and self.name.lower() not in node.name.lower():
            return False
        return (
            node.fgpu_free >= self.min_free_fgpu and node.gpus_idle >= self.min_idle_gpus and node.mig_free >= self.min_free_mig
        )


def node_fleet_state(*, status: str, mig_sync: dict | None, draining: bool = False) -> str:
    """A node's state for the overview (STATES) from its status, whether it is drained
    (`draining`) and its MIG layout sync (`accelerators.mig_services.node_mig_push`'s states)."""
    if status == NodeStatus.LOST:
        return "lost"
    if draining:
        return "draining"
    applied = (mig_sync or {}).get("state", "")
    if applied == "error":
        return "mig-error"
    return "mig-pending" if applied in _MIG_PENDING else "ready"


def fleet_nodes(*, only=None) -> list[NodeFigures]:
    """Every node (or those of the Node queryset `only`) with its whole GPUs' figures
    (`GpuFigures`, by index), by name. Four queries whatever the fleet's size: fractional
    settings, nodes, devices with their live allocations summed (SQL), held MIG instances."""
    fractional = {
        s.slot_name: s.as_allocation_settings()
        for s in FractionalSettings.objects.filter(allocation_mode=AllocationMode.FRACTIONAL)
    }
    nodes: dict[Any, NodeFigures] = {}
    scaling: dict[Any, tuple[Decimal, Decimal, int]] = {}
    scope = Node.objects.all() if only is None else only
    rows = scope.order_by("name").values_list(
        "pk", "name", "status", "last_heartbeat", "resource_group__name", "mig_mode", "mig_sync", "memory_scaling",
        "core_scaling", "device_split_count", "drain_since",
    )  # fmt: skip
    for pk, name, status, heartbeat, group, mig_mode, mig_sync, mem_scale, core_scale, split, drained in rows:
        state = node_fleet_state(status=status, mig_sync=mig_sync, draining=drained is not None)
        nodes[pk] = NodeFigures(pk, name, status, state, heartbeat, group or "", mig_mode)
        scaling[pk] = (mem_scale, core_scale, split)
    device_rows = Device.objects.all() if only is None else Device.objects.filter(node__in=scope)
    devices = devices_with_usage(device_rows).values_list(
        "pk", "node_id", "slot_name", "index", "device_id", "model_name", "memory_size", "subproc_count", "is_mig_device",
        "mother_uuid", "mig_profile", "memory_used", "proc_used", "shares_used", "session_count",
    )  # fmt: skip
    whole: list[tuple] = []
    slices: dict[tuple[Any, str], list[tuple[int, bool]]] = {}  # (node, mother uuid) → [(compute slices, held)]
    for row in devices:
        if row[8]:
            slices.setdefault((row[1], row[9]), []).append((profile_compute_slices(row[10]), row[14] > 0))
        else:
            whole.append(row)
    held: dict[Any, int] = {}  # GPU pk → compute slices its held instances take
    live = Q(session__status__in=protocol.SESSION_ACTIVE_STATES) | Q(unknown_since__isnull=False)
    instances = GpuInstance.objects.filter(live) if only is None else GpuInstance.objects.filter(live, node__in=scope)
    for parent, profile in instances.values_list("parent_id", "profile"):
        held[parent] = held.get(parent, 0) + profile_compute_slices(profile)
    mig_capable: dict[tuple[str, int], bool] = {}
    for pk, node_id, slot, index, uuid, model, memory, sms, _, mother, _, mem_used, proc_used, shares, count in whole:
        node = nodes[node_id]
        mem_scale, core_scale, split = scaling[node_id]
        gpu = GpuFigures(
            pk=pk, node_id=node_id, index=index, device_id=uuid, model=model, memory_size=memory, subproc_count=sms,
            kind="whole", capacity=None, allocated=Decimal(shares or 0), free=None, memory_allocated=int(mem_used or 0),
            proc_allocated=Decimal(proc_used or 0), sessions=count,
        )  # fmt: skip
        mine = slices.get((node_id, mother))
        if node.mig_mode in (MigMode.DYNAMIC, MigMode.FIXED) or mine:
            gpu.kind = "mig"
            if mine:  # static: the inventory's slices
                gpu.mig_total = sum(s for s, _ in mine)
                gpu.mig_used = sum(s for s, taken in mine if taken)
            else:
                key = (model, memory)
                if key not in mig_capable:
                    mig_capable[key] = _mig_capable(model, memory)
                gpu.mig_total = mig.COMPUTE_SLICES if mig_capable[key] else 0
                gpu.mig_used = min(gpu.mig_total, held.get(pk, 0))
            gpu.load = gpu.mig_used * 100 // gpu.mig_total if gpu.mig_total else 0
        else:
            counters = core.DeviceState(
                device_id=str(pk),
                memory_total=int(Decimal(memory) * mem_scale),
                proc_total=int(Decimal(sms) * core_scale),
                memory_used=gpu.memory_allocated,
                proc_used=gpu.proc_allocated,
                sessions=count,
                max_sessions=split,
            )
            gpu.load = _load(counters)
            pure = fractional.get(slot)
            if pure is not None:
                gpu.kind = "fgpu"
                gpu.capacity = core.device_capacity(
                    memory_size=counters.memory_total, subproc_count=counters.proc_total, settings=pure
                )
                gpu.free = core.device_free_shares(counters, pure)
        node.gpus.append(gpu)
    for node in nodes.values():
        node.gpus.sort(key=lambda g: (g.index, g.device_id))
        _sum_node(node)
    return list(nodes.values())


def _mig_capable(model: str, memory: int) -> bool:
    try:
        mig.catalog_get(model, memory_size=memory)
    except InvalidResourceRequest:
        return False
    return True


def _load(state: core.DeviceState) -> int:
    """Percent of a non-MIG GPU allocated: the larger of its memory and SMs held (a whole-device
    grant holds both), 100 at its split count."""
    if state.max_sessions and state.sessions >= state.max_sessions:
        return 100
    memory = state.memory_used * 100 // state.memory_total if state.memory_total else 0
    procs = int(state.proc_used * 100 // state.proc_total) if state.proc_total else 0
    return min(100, max(memory, procs))


def _sum_node(node: NodeFigures) -> None:
    for gpu in node.gpus:
        node.memory_total += gpu.memory_size
        node.memory_allocated += gpu.memory_allocated
        node.sessions += gpu.sessions
        if gpu.kind == "mig":
            node.mig_total += gpu.mig_total
            node.mig_free += gpu.mig_total - gpu.mig_used
            continue
        node.gpus_idle += gpu.sessions == 0
        if gpu.kind == "fgpu":
            node.fgpu_capacity += gpu.capacity or 0
            node.fgpu_free += gpu.free or 0
            node.fgpu_allocated += gpu.allocated
    node.load = sum(g.load for g in node.gpus) // len(node.gpus) if node.gpus else 0


def _sort_key(sort: str):
    if sort == "free":
        return lambda n: (-n.fgpu_free, -n.gpus_idle, -n.mig_free, n.name)
    if sort == "load":
        return lambda n: (n.load, n.name)
    if sort == "-load":
        return lambda n: (-n.load, n.name)
    return lambda n: n.name


def _totals(nodes: list[NodeFigures]) -> dict:
    gpus = [g for n in nodes for g in n.gpus]
    return {
        "nodes": len(nodes),
        "gpus": len(gpus),
        "gpus_idle": sum(n.gpus_idle for n in nodes),
        "fgpu_capacity": sum((n.fgpu_capacity for n in nodes), Decimal(0)),
        "fgpu_free": sum((n.fgpu_free for n in nodes), Decimal(0)),
        "fgpu_allocated": sum((n.fgpu_allocated for n in nodes), Decimal(0)),
        "memory_total": sum(n.memory_total for n in nodes),
        "memory_allocated": sum(n.memory_allocated for n in nodes),
        "mig_gpus": sum(1 for g in gpus if g.kind == "mig"),
        "mig_total": sum(n.mig_total for n in nodes),
        "mig_free": sum(n.mig_free for n in nodes),
        "sessions": sum(n.sessions for n in nodes),
        "load": sum(g.load for g in gpus) // len(gpus) if gpus else 0,
    }


def fleet_overview(
    *,
    filters: FleetFilter = FleetFilter(),
    sort: str = "name",
    page: int = 1,
    page_size: int = PAGE_SIZE,
    now: float | None = None,
) -> dict:
    """The overview: `{"states": {state: nodes}` (the whole fleet), `"groups"`: [names] and
    `"models"`: [GPU model names] (the filters' choices), `"totals"` (the nodes `filters` keep:
    `_totals`' keys), `"used"`: `{"gpus_sampled", "memory_used" bytes, "util" percent | None}`
    (the kept nodes' GPUs' newest samples of the last SAMPLE_HORIZON_S seconds), `"heat"`: [the
    kept nodes, sorted: `{"name", "state", "resource_group", "load", "fgpu_free", "gpus_idle",
    "mig_free"}`], `"count"`, `"page"`, `"pages"`, `"page_size"` and `"nodes"`: the page's
    NodeFigures, each GPU given `.used` `{"memory_used", "util", "t"}` or None (no sample in
    the horizon: its agent is silent, not idle), each node `.cpu_used` cores and `.mem_used`
    bytes. `sort` one of SORTS; `page` past the last gives the last. `now`: epoch seconds (the
    clock's by default)."""
    everything = fleet_nodes()
    states = {state: 0 for state in STATES}
    for node in everything:
        states[node.state] += 1
    kept = sorted((n for n in everything if filters.keeps(n)), key=_sort_key(sort))
    pages = max(1, -(-len(kept) // page_size))
    page = min(max(1, page), pages)
    shown = kept[(page - 1) * page_size : page * page_size]
    horizon = int(now if now is not None else time.time()) - SAMPLE_HORIZON_S
    newest = samples.newest(device_ids=[g.pk for n in shown for g in n.gpus], since=horizon)
    rooms = nodes_with_usage(Node.objects.filter(pk__in=[n.pk for n in shown])).values_list("pk", "cpu_used", "mem_used")
    held = {pk: (cpu_used, mem_used) for pk, cpu_used, mem_used in rooms}
    for node in shown:
        node.cpu_used, node.mem_used = (int(v or 0) for v in held.get(node.pk, (0, 0)))
        for gpu in node.gpus:
            gpu.used = newest.get(gpu.pk)
    return {
        "states": states,
        "groups": sorted({n.resource_group for n in everything if n.resource_group}),
        "models": sorted({g.model for n in everything for g in n.gpus}),
        "totals": _totals(kept),
        "used": _fleet_used(kept, horizon),
        "heat": [
            {
                "name": n.name,
                "state": n.state,
                "resource_group": n.resource_group,
                "load": n.load,
                "fgpu_free": n.fgpu_free,
                "gpus_idle": n.gpus_idle,
                "mig_free": n.mig_free,
            }
            for n in kept
        ],
        "count": len(kept),
        "page": page,
        "pages": pages,
        "page_size": page_size,
        "nodes": shown,
    }


def _fleet_used(nodes: list[NodeFigures], horizon: int) -> dict:
    """What the kept nodes' GPUs really use: each sampled GPU's mean memory used (bytes) and
    utilisation (percent) over its samples since `horizon`, summed and averaged over the GPUs
    in SQL (`DeviceSamples.used`); the whole fleet's samples when every node is kept (no list of
    ids to send)."""
    every = len(nodes) == Node.objects.count()
    gpus, memory, util = samples.used(since=horizon, node_ids=None if every else [n.pk for n in nodes])
    return {"gpus_sampled": gpus, "memory_used": int(memory), "util": None if util is None else round(util)}


def mig_capacity(*, nodes) -> list[NodeFigures]:
    """The nodes among `nodes` (a Node queryset) with GPUs that serve MIG (their node in dynamic
    or fixed MIG mode, or MIG slices in their inventory), as `fleet_nodes` figures them: their
    `mig_total` and `mig_free` compute slices are what "My resources" adds to the free GPU
    capacity, since such GPUs count no fGPU. Four queries, over those nodes only."""
    serving = Q(mig_mode__in=[MigMode.DYNAMIC, MigMode.FIXED]) | Q(devices__is_mig_device=True)
    found = fleet_nodes(only=Node.objects.filter(pk__in=nodes.filter(serving).values("pk")))
    return [n for n in found if n.mig_total]
