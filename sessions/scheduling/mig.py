"""Placing MIG requests (issue 4): static MIG slices and dynamic MIG instances, manager side.

A request of kind "mig" (`{"mig_profile": "2g.20gb"}`, `{"gpu_memory": "15G", "isolation":
"mig"}`) goes to an alive node whose administrator set a MIG mode (`Node.mig_mode`), with the
CPU cores and memory left for it:

- static nodes: a free MIG slice of the inventory (`Device.is_mig_device`) of that profile
  (the inventory's name, e.g. "10g", or the full "2g.20gb"), or of at least that memory — the
  smallest that fits;
- dynamic nodes: on each MIG-capable GPU (its model in `accelerators.allocation.mig`'s catalog)
  the planner's choice (`plan_instance`) over the GPU's instances (`GpuInstance`; in use while
  their session is active); across GPUs the smallest profile wins, then reuse over creation,
  then fewest instances destroyed, then the fullest GPU (binpack);
- fixed-layout nodes: like dynamic, but only instances that exist are given (none created).

A physical GPU is never shared between MIG and fGPU: a GPU with live allocations that are not
MIG instances gets no MIG instance (and `accelerators.mig_selectors.mig_exclusion` keeps fGPU
off MIG GPUs).
`isolation: "any"` tries MIG first and falls back to a shared slice (the scheduler's ordinary
path) when no MIG node can hold it now.

For the launch dialog, `mig_preview` reads what a request would get now and
`mig_profile_availability` which profiles can be asked for and how many could be placed now
and ever, both through the same choice and planner, without locks or writes.

The scheduler decides with `sessions.scheduling.placement.placement_decide` (its MIG step: `mig_choose_in`
on the pass's MIG scope, read and locked once a pass and kept current with the pass's
placements, MIG and shared: `MigNodeRoom.take`) and writes the choice with the pass's other
writes (`_PassWrites.place_mig`): at its flush, in placement order, the GpuInstance rows and one
Allocation on the parent GPU or on the static slice (`mig_rows_write`), with the session's
transition and notice, and the agent's start spec with a `mig` block (see `agent.mig`).

`mig_choose` is a read (`mig_scope_read`: a `MigScope` of `MigNodeRoom`s) and a choice on what
was read (`mig_choose_in`, no database). The ETA's replay (`sessions.scheduling.eta`, issue 17.3) makes the
same choice on in-memory copies of the rooms, which its placements and ends keep current
(`MigNodeRoom.take` / `release`, as `mig_rows_write` and a session's end change the rows), and
`mig_smaller_now` names the smaller profiles a waiting request could get now.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import NamedTuple

from django.utils import timezone

from accelerators.allocation import core, mig
from accelerators.allocation.errors import AllocationError, InsufficientResource, InvalidResourceRequest, NeverSchedulable
from accelerators.allocation.mig import MigResourceRequest
from protocol.units import format_binary_size
from accelerators.mig_selectors import device_mig_catalog, gpu_instance_holds
from accelerators.models import Device, GpuInstance, MigMode, Node, NodeStatus
from accelerators.selectors import node_runs_image, nodes_with_usage, resource_group_get
from sessions.models import ACTIVE_STATUSES, Allocation, ComputeSession
from sessions.selectors import wants_mig
from sessions.lifecycle.start_spec import mig_block


def check_ever_fits(request, ordinary) -> None:
    """At launch: raises NeverSchedulable when no node, alive or LOST, could ever hold the
    request. `ordinary()` is the check for requests that are not MIG-only (called for them,
    and first for `isolation: "any"`, which MIG may then still hold)."""
    if not wants_mig(request):
        ordinary()
        return
    if request.isolation == "any":
        try:
            ordinary()
            return
        except NeverSchedulable:
            pass
    group = resource_group_get(name=request.resource_group)
    nodes = Node.objects.exclude(mig_mode=MigMode.OFF)
    if group is not None:
        nodes = nodes.filter(resource_group=group)
    enabled = list(nodes)
    if not enabled:
        raise NeverSchedulable("no node has MIG enabled (an administrator sets a node's MIG mode)")
    _check_ever_fits(enabled, list(Device.objects.filter(node__in=enabled, slot_name="cuda")), request.mig_request())


class MigRank(NamedTuple):
    """How good a MIG choice is: the lowest wins, compared field by field in this order. The
    smallest instance that holds the request (`memory` bytes, then its memory and compute
    slices), then one that reuses an idle instance (`creates` 0) over one that makes a new one
    (1), then fewer idle instances destroyed (`destroys`), then the GPU with the most instances
    in use (`busiest`: minus their count, so a busy GPU fills before an empty one is cut), then
    by name: `node`, `gpu_index`, `device_id`. A static slice has no slices to count nor
    instances to make: those fields are 0."""

    memory: int
    memory_slices: int
    compute_slices: int
    creates: int
    destroys: int
    busiest: int
    node: str
    gpu_index: int
    device_id: str


@dataclass(frozen=True)
class MigChoice:
    """What `mig_choose` picks: on `node`, the whole GPU `device` with the planner's `plan` for
    one GPU instance (created, reused; idle ones destroyed) under the GPU's `catalog` (dynamic
    and fixed-layout nodes), or the free static slice `device` (`plan` and `catalog` None);
    `rank` is why it won. The scheduler writes it (`mig_rows_write`)."""

    rank: MigRank
    node: Node
    device: Device  # the parent GPU (dynamic) or the static slice
    plan: mig.MigPlan | None = None
    catalog: mig.MigCatalog | None = None


def mig_choose(request: MigResourceRequest, *, lock: bool = True, image: str = "") -> MigChoice:
    """The best MIG choice for `request` on the alive MIG nodes (holding session image `image`;
    "": any); with `lock`, the candidate nodes, devices and GPU instances are locked (pk order)
    inside the caller's transaction. `mig_rows_write` writes its rows. Raises NeverSchedulable when no MIG
    node could ever hold it, InsufficientResource (the reasons per node) when none can now, also
    when only nodes without the image could. The read (`mig_scope_read`), then the choice on
    what was read (`mig_choose_in`)."""
    return mig_choose_in(mig_scope_read(resource_group=request.resource_group, image=image, lock=lock), request)


@dataclass
class MigNodeRoom:
    """One alive MIG node as a MIG choice sees it: the `node` row and its cuda `devices`; `cpu`
    cores and `mem` bytes its active sessions leave; `holders`, the live allocations per device
    (device pk text → {session key (its id text): whether it holds a GPU instance}); `layouts`,
    each MIG-capable GPU's instances as the planner sees them (GPU pk text → MigInstance tuple;
    a GPU without instances may be absent); `instances`, which session holds which instance
    (session key → (GPU pk text, instance key)).

    The scheduler's pass reads it (`mig_scope_read`) once and keeps it current with `take` for
    each placement on the node (the choices' rows written by `mig_rows_write`); the ETA's replay
    (`sessions.scheduling.eta`) keeps an in-memory copy current with `take` and `release`, which change it
    as those rows would: a session's end leaves its GPU
    instance idle (reusable; on a dynamic node the planner may destroy it for its slices, on a
    fixed layout only reuse it) and frees a static slice."""

    node: Node
    devices: list[Device]
    cpu: int
    mem: int
    holders: dict[str, dict[str, bool]] = field(default_factory=dict)
    layouts: dict[str, tuple[mig.MigInstance, ...]] = field(default_factory=dict)
    instances: dict[str, tuple[str, str]] = field(default_factory=dict)

    def copy(self) -> MigNodeRoom:
        """A copy whose changes leave this one as it is (the rows are shared, never changed)."""
        return replace(
            self,
            holders={d: dict(held) for d, held in self.holders.items()},
            layouts=dict(self.layouts),
            instances=dict(self.instances),
        )

    def busy(self) -> dict[str, set[str]]:
        """{"any": device pks (text) with live allocations, "shared": those whose live
        allocations are not all MIG instances (fGPU, per-device or static slices)}."""
        return {
            "any": {d for d, held in self.holders.items() if held},
            "shared": {d for d, held in self.holders.items() if not all(held.values())},
        }

    def take(self, key: str, *, cpu: int, mem: int, choice: MigChoice | None = None, devices: tuple[str, ...] = ()) -> None:
        """Session `key` starts here with `cpu` cores and `mem` bytes: on MIG `choice`
        (`mig_choose_in`'s, for this node: its plan applied, a created instance keyed
        "planned-<key>"), or on a shared slice of `devices` (device pk texts) or none (CPU only)."""
        self.cpu, self.mem = self.cpu - cpu, self.mem - mem
        for device in devices:
            self.holders.setdefault(device, {})[key] = False
        if choice is None:
            return
        device = str(choice.device.pk)
        if choice.plan is None:  # a static slice: no GPU instance
            self.holders.setdefault(device, {})[key] = False
            return
        instance = choice.plan.reuse or f"planned-{key}"
        self.layouts[device] = mig.apply_plan(self.layouts.get(device, ()), choice.plan, key=instance)
        self.holders.setdefault(device, {})[key] = True
        self.instances[key] = (device, instance)

    def release(self, key: str, *, cpu: int, mem: int) -> None:
        """Session `key`, holding `cpu` cores and `mem` bytes here, ends: its allocations go,
        its GPU instance stays, idle (`mig.release`)."""
        self.cpu, self.mem = self.cpu + cpu, self.mem + mem
        for held in self.holders.values():
            held.pop(key, None)
        found = self.instances.pop(key, None)
        if found is not None:
            gpu, instance = found
            self.layouts[gpu] = mig.release(self.layouts.get(gpu, ()), instance)


@dataclass
class MigScope:
    """What a MIG choice reads for a request of one resource group in one session image:
    `rooms`, the alive MIG nodes of the group holding the image (`MigNodeRoom`); `every`, the
    alive MIG nodes of the group and their cuda devices, any image (what "never" is judged
    on); `image` ("": any)."""

    rooms: list[MigNodeRoom]
    every: tuple[list[Node], list[Device]]
    image: str = ""

    def copy(self, rooms: dict[str, MigNodeRoom]) -> MigScope:
        """This scope over `rooms` (node pk text → room): the room already there for a node,
        else a copy of this scope's, added. Scopes copied into one `rooms` share their nodes'
        state (a node may be in several scopes)."""
        return replace(self, rooms=[rooms.setdefault(str(r.node.pk), r.copy()) for r in self.rooms])


def mig_scope_read(*, resource_group: str, image: str = "", lock: bool = False) -> MigScope:
    """Read the `MigScope` of a request naming `resource_group` ("" for any) in session image
    `image` ("": any node); `lock` locks the candidate nodes, devices and GPU instances (pk
    order) inside the caller's transaction. A few queries, whatever the number of nodes. Raises
    InvalidResourceRequest for an unknown resource group."""
    nodes, devices = _mig_scope(resource_group=resource_group, slot_name="cuda", lock=lock, image=image)
    every = _mig_scope(resource_group=resource_group, slot_name="cuda", lock=False) if image else (nodes, devices)
    free = _nodes_free(nodes)
    rows = list(GpuInstance.objects.filter(node__in=nodes).select_related("session"))
    mig_sessions = {str(i.session_id) for i in rows if i.session is not None and i.session.status in ACTIVE_STATUSES}
    live = Allocation.objects.filter(device__in=devices, released_at__isnull=True).values_list("device_id", "session_id")
    holders: dict[str, dict[str, bool]] = {}
    for device_id, session_id in live:
        holders.setdefault(str(device_id), {})[str(session_id)] = str(session_id) in mig_sessions
    rooms = []
    for node in nodes:
        mine = [d for d in devices if d.node_id == node.pk]
        pks = {str(d.pk) for d in mine}
        own = [i for i in rows if i.node_id == node.pk]
        rooms.append(
            MigNodeRoom(
                node=node,
                devices=mine,
                cpu=free[node.pk][0],
                mem=free[node.pk][1],
                holders={d: held for d, held in holders.items() if d in pks},
                layouts=_planner_layouts(own),
                instances={
                    str(i.session_id): (str(i.parent_id), str(i.pk))
                    for i in own
                    if i.unknown_since is None and str(i.session_id) in mig_sessions
                },
            )
        )
    rooms = core.storage_scope(rooms, shared=lambda r: r.node.shared_storage)  # the data folders' rule, as for shared slices
    return MigScope(rooms=rooms, every=every, image=image)


def mig_choose_in(scope: MigScope, request: MigResourceRequest) -> MigChoice:
    """`mig_choose` on a scope already read (or kept in memory: the ETA's replay): nothing is
    read from the database. Raises as `mig_choose`."""
    wanted = request.mig_request()
    image = scope.image
    if not scope.every[0]:
        raise NeverSchedulable("no node has MIG enabled (an administrator sets a node's MIG mode)")
    # "Never" is judged on every MIG node: the image may yet come to one that could hold it.
    _check_ever_fits(*scope.every, wanted)
    if image and not scope.rooms:
        raise InsufficientResource(f"no node with MIG enabled has image {image}")
    if image:
        try:
            _check_ever_fits([r.node for r in scope.rooms], [d for r in scope.rooms for d in r.devices], wanted)
        except NeverSchedulable as exc:
            raise InsufficientResource(f"the MIG nodes with image {image} cannot hold it: {exc}") from None
    choices: list[MigChoice] = []
    reasons: list[str] = []
    for room in sorted(scope.rooms, key=lambda r: r.node.name):
        node = room.node
        if room.cpu < request.cpu or room.mem < request.mem:
            reasons.append(f"{node.name}: not enough CPU cores or memory left")
            continue
        busy = room.busy()
        if node.mig_mode == MigMode.STATIC:
            found, why = _static_choice(node, room.devices, wanted, busy)
        else:
            found, why = _dynamic_choices(node, room.devices, wanted, busy, room.layouts)
        choices.extend(found)
        if not found:
            reasons.append(f"{node.name}: {why}")
    if choices:
        return min(choices, key=lambda c: c.rank)
    raise InsufficientResource("; ".join(reasons) or f"no MIG node can hold {wanted.describe()}")


def _check_ever_fits(nodes: list[Node], devices: list[Device], wanted: mig.MigRequest) -> None:
    """Raises NeverSchedulable when no MIG node could hold `wanted` even with all of it free."""
    static = {n.pk for n in nodes if n.mig_mode == MigMode.STATIC}
    for device in devices:
        if device.node_id in static:
            if device.is_mig_device and (
                wanted.profile in _slice_names(device) if wanted.profile else device.memory_size >= wanted.memory
            ):
                return
        elif not device.is_mig_device:
            try:
                mig.candidate_profiles(device_mig_catalog(device), wanted)
            except AllocationError:
                continue
            return
    raise NeverSchedulable(
        f"no MIG node could ever hold {wanted.describe()} (no such MIG slice or profile on "
        f"{', '.join(sorted(n.name for n in nodes))})"
    )


def _busy_devices(devices: list[Device]) -> dict[str, set]:
    """{"any": device pks (text) with live allocations, "shared": those whose live allocations are
    not MIG instances (fGPU or per-device slices)}."""
    live = Allocation.objects.filter(device__in=devices, released_at__isnull=True)
    any_pks = {str(pk) for pk in live.values_list("device_id", flat=True)}
    mig_sessions = GpuInstance.objects.filter(session__status__in=ACTIVE_STATUSES).values_list("session_id", flat=True)
    shared = {str(pk) for pk in live.exclude(session_id__in=mig_sessions).values_list("device_id", flat=True)}
    return {"any": any_pks, "shared": shared}


def _nodes_free(nodes: list[Node]) -> dict:
    """{node pk: (CPU cores, bytes of memory) that its active sessions leave} for `nodes`, in one
    query (`accelerators.selectors.nodes_with_usage`)."""
    if not nodes:
        return {}
    rows = nodes_with_usage(Node.objects.filter(pk__in=[n.pk for n in nodes])).values_list("pk", "cpu_used", "mem_used")
    used = {pk: (cpu, mem) for pk, cpu, mem in rows}
    return {n.pk: (n.cpu_count - used[n.pk][0], n.memory_size - used[n.pk][1]) for n in nodes}


def _slice_names(device: Device) -> set[str]:
    """The names a static MIG slice answers to: its profile ("2g.20gb", "10g") and the part of
    an inventory's model name after the dash ("MIG-10g" → "10g"), lower case."""
    return {device.mig_profile.lower(), device.model_name.lower().partition("-")[2]} - {""}


def _free_slices(devices: list[Device], busy: dict) -> list[Device]:
    """The static MIG slices among `devices` free now: none of their allocations is live and their
    GPU serves no fGPU shares (MIG and fGPU do not mix on one GPU)."""
    mothers_shared = {d.mother_uuid for d in devices if not d.is_mig_device and str(d.pk) in busy["shared"]}
    return [d for d in devices if d.is_mig_device and str(d.pk) not in busy["any"] and d.mother_uuid not in mothers_shared]


def _static_choice(node: Node, devices: list[Device], wanted: mig.MigRequest, busy: dict):
    fitting = []
    for device in _free_slices(devices, busy):
        if wanted.profile:
            if wanted.profile not in _slice_names(device):
                continue
        elif device.memory_size < wanted.memory:
            continue
        rank = MigRank(
            memory=device.memory_size,
            memory_slices=0,
            compute_slices=0,
            creates=0,
            destroys=0,
            busiest=0,
            node=node.name,
            gpu_index=device.index,
            device_id=device.device_id,
        )
        fitting.append(MigChoice(rank=rank, node=node, device=device))
    if not fitting:
        return [], f"no free MIG slice for {wanted.describe()}"
    return [min(fitting, key=lambda c: c.rank)], ""


def _mig_scope(*, resource_group: str, slot_name: str, lock: bool, image: str = "") -> tuple[list[Node], list[Device]]:
    """The alive nodes with a MIG mode a request naming `resource_group` may use ("" for any),
    holding session image `image` ("": any), and their devices of `slot_name`; `lock` locks them
    and their GPU instances (pk order) inside the caller's transaction."""
    group = resource_group_get(name=resource_group)
    nodes = Node.objects.filter(status=NodeStatus.ALIVE).exclude(mig_mode=MigMode.OFF)
    if group is not None:
        nodes = nodes.filter(resource_group=group)
    if image:
        nodes = nodes.filter(node_runs_image(image))
    devices = Device.objects.filter(node__in=nodes, slot_name=slot_name).order_by("pk")
    if not lock:
        return list(nodes.order_by("pk")), list(devices)
    locked_nodes = list(nodes.order_by("pk").select_for_update())
    locked_devices = list(devices.select_for_update())
    list(GpuInstance.objects.filter(node__in=locked_nodes).order_by("pk").select_for_update().values_list("pk", flat=True))
    return locked_nodes, locked_devices


def _planner_layouts(rows: list[GpuInstance]) -> dict[str, tuple[mig.MigInstance, ...]]:
    """GPU instance rows (with their sessions) → {GPU pk text: the instances as the planner sees
    them}: in use while their session is active, or unknown (never reused nor destroyed)."""
    layouts: dict[str, tuple[mig.MigInstance, ...]] = {}
    for i in rows:
        instance = mig.MigInstance(key=str(i.pk), profile=i.profile, start=i.placement_start, in_use=gpu_instance_holds(i))
        layouts[str(i.parent_id)] = (*layouts.get(str(i.parent_id), ()), instance)
    return layouts


def _gpu_layouts(node: Node, devices: list[Device], busy: dict, reasons: list[str], layouts: dict[str, tuple]):
    """[(GPU, its MIG catalog, its instances as the planner sees them)] for the node's
    MIG-capable whole GPUs that may hold a MIG instance; why a MIG-capable GPU may not is
    appended to `reasons`. `layouts`: the node's GPUs' instances (`_planner_layouts`)."""
    found = []
    for gpu in (d for d in devices if not d.is_mig_device):
        try:
            catalog = device_mig_catalog(gpu)
        except InvalidResourceRequest:
            continue
        if str(gpu.pk) in busy["shared"]:
            reasons.append(f"GPU {gpu.index} serves fGPU shares (MIG and fGPU do not mix on one GPU)")
            continue
        found.append((gpu, catalog, list(layouts.get(str(gpu.pk), ()))))
    return found


def _dynamic_choices(node: Node, devices: list[Device], wanted: mig.MigRequest, busy: dict, layouts: dict[str, tuple]):
    choices: list[MigChoice] = []
    reasons: list[str] = []
    for gpu, catalog, layout in _gpu_layouts(node, devices, busy, reasons, layouts):
        try:
            plan = mig.plan_instance(catalog, layout, wanted)
        except (NeverSchedulable, InsufficientResource) as exc:
            reasons.append(f"GPU {gpu.index}: {exc}")
            continue
        except InvalidResourceRequest as exc:  # a profile this model lacks, or a broken layout
            reasons.append(f"GPU {gpu.index}: {exc}")
            continue
        if node.mig_mode == MigMode.FIXED and not plan.reuse:
            reasons.append(f"GPU {gpu.index}: its fixed layout has no idle {plan.profile.name} instance")
            continue
        in_use = sum(1 for i in layout if i.in_use)
        profile = plan.profile
        rank = MigRank(
            memory=profile.memory,
            memory_slices=profile.memory_slices,
            compute_slices=profile.compute_slices,
            creates=0 if plan.reuse else 1,
            destroys=len(plan.destroy),
            busiest=-in_use,
            node=node.name,
            gpu_index=gpu.index,
            device_id=gpu.device_id,
        )
        choices.append(MigChoice(rank=rank, node=node, device=gpu, plan=plan, catalog=catalog))
    return choices, "; ".join(reasons) or "no MIG-capable GPU"


def mig_rows_write(*, session: ComputeSession, choice: MigChoice) -> tuple[Allocation, dict | None, str]:
    """Write the rows of `choice` (`mig_choose`'s) for `session`: the GpuInstance rows of its
    plan (destroyed, reused or created) and one Allocation on the parent GPU or on the static
    slice. Returns (that Allocation, the start spec's `mig` block — None for a static slice,
    see `agent.mig` —, the session's reason: "got a 1g.20gb MIG instance … on GPU 0 of n1").
    The session's own transition is the caller's (the scheduler's pass writes it with the
    others)."""
    now = timezone.now()
    device = choice.device
    block = None
    if choice.plan is None:  # a static slice
        allocation = Allocation.objects.create(
            session=session, device=device, shares=Decimal(1), memory=device.memory_size, procs=Decimal(device.subproc_count)
        )
        why = f"the free MIG slice {device.mig_profile or device.model_name} ({format_binary_size(device.memory_size)})"
    else:
        plan = choice.plan
        doomed = GpuInstance.objects.filter(pk__in=plan.destroy)
        doomed_rows = list(doomed.order_by("placement_start"))
        doomed.delete()
        if plan.reuse:
            instance = GpuInstance.objects.get(pk=plan.reuse)
            instance.session, instance.last_used_at = session, now
            instance.save(update_fields=["session", "last_used_at"])
        else:
            instance = GpuInstance.objects.create(
                node=choice.node,
                parent=device,
                profile=plan.profile.name,
                placement_start=plan.start,
                placement_size=plan.profile.size,
                memory_size=plan.profile.memory,
                subproc_count=plan.profile.sm_count_for(device.subproc_count),
                session=session,
                last_used_at=now,
            )
        allocation = Allocation.objects.create(
            session=session, device=device, shares=Decimal(0), memory=instance.memory_size, procs=Decimal(instance.subproc_count)
        )
        block = mig_block(gpu=device, instance=instance, reuse=bool(plan.reuse), destroy=doomed_rows).encode()
        why = f"a {plan.profile.name} MIG instance ({format_binary_size(plan.profile.memory)}): {plan.describe()}"
    return allocation, block, f"got {why} on GPU {device.index} of {choice.node.name}"


# --- reads for the launch dialog: what MIG would give now, and which profiles there are ------------


@dataclass(frozen=True)
class MigGrantPreview:
    """What a MIG request would get now: on `node`, the GPU instance of `profile` on the whole GPU
    `device` (dynamic, fixed) or the static slice `device`; `memory` in bytes, `procs` in SMs;
    `plan` says how, in words ("creates a 1g.20gb instance at memory slice 0")."""

    node: str
    device: Device
    profile: str
    memory: int
    procs: int
    plan: str


def mig_preview(*, request: MigResourceRequest, image: str = "") -> MigGrantPreview:
    """What the scheduler would give `request` in session image `image` ("": any node) now (its
    choice as in the scheduler's, `mig_choose`), read without locks and without writing
    anything. Raises NeverSchedulable (no alive MIG node could ever hold it), InsufficientResource (none can now;
    the reasons per node) and AllocationError for a layout the planner refuses."""
    choice = mig_choose(request, lock=False, image=image)
    device = choice.device
    if choice.plan is None:
        return MigGrantPreview(
            node=choice.node.name,
            device=device,
            profile=device.mig_profile or device.model_name,
            memory=device.memory_size,
            procs=device.subproc_count,
            plan=f"the free MIG slice {device.mig_profile or device.model_name}",
        )
    profile = choice.plan.profile
    return MigGrantPreview(
        node=choice.node.name,
        device=device,
        profile=profile.name,
        memory=profile.memory,
        procs=profile.sm_count_for(device.subproc_count),
        plan=choice.plan.describe(),
    )


FULL_PROFILE_NAME = re.compile(r"^(\d+)g\.\d+gb")


@dataclass(frozen=True)
class MigProfileAvailability:
    """One MIG profile sessions may ask for (`{"mig_profile": name}`) on the MIG nodes in reach.
    `memory` bytes and `sm_count` SMs: the least over the GPUs that have it (0 SMs: unknown);
    `compute_slices`, `memory_slices` of 7 and 8 (0: unknown, a static slice named by size
    such as "10g"); `models` the GPU models (or static slices' names) that have it.
    `max_now`: how many sessions could get one now, one after another (idle instances reused,
    new ones planned as the planner would place them, free static slices; capped by the
    nodes' free CPU cores, one per session); `idle_now` of those reuse an idle instance;
    `max_ever`: the same on emptied nodes (a fixed layout: the instances it has)."""

    name: str
    memory: int
    sm_count: int
    compute_slices: int
    memory_slices: int
    models: tuple[str, ...]
    max_now: int
    idle_now: int
    max_ever: int


def mig_profile_availability(*, resource_group: str = "", slot_name: str = "cuda") -> list[MigProfileAvailability]:
    """The MIG profiles of the alive nodes with a MIG mode (static slices, dynamic, fixed
    layout) that a request naming `resource_group` ("" for any) may use, smallest first (memory,
    then compute slices), with how many could be placed now and ever (see
    MigProfileAvailability). Empty when no such node has a MIG-capable GPU or a MIG slice.
    Counts come from the planner (`accelerators.allocation.mig.plan_instance`) over each GPU's
    current layout, as `mig_choose` would place them. Raises InvalidResourceRequest for an
    unknown resource group."""
    nodes, devices = _mig_scope(resource_group=resource_group, slot_name=slot_name, lock=False)
    busy = _busy_devices(devices)
    instances: dict = {}
    for instance in GpuInstance.objects.filter(node__in=nodes).select_related("session"):
        instances.setdefault(instance.node_id, []).append(instance)
    free_now = _nodes_free(nodes)
    found: dict[str, dict] = {}
    for node in nodes:
        mine = [d for d in devices if d.node_id == node.pk]
        counts: dict[str, list[int]] = {}  # name → [now, idle now, ever]
        if node.mig_mode == MigMode.STATIC:
            free = {d.pk for d in _free_slices(mine, busy)}
            for device in (d for d in mine if d.is_mig_device):
                name = device.mig_profile.lower() or device.model_name.lower().partition("-")[2]
                full = FULL_PROFILE_NAME.match(name)  # "2g.20gb": 2 compute slices; "10g" says only its size
                _profile_seen(
                    found, name, device.memory_size, device.subproc_count, int(full[1]) if full else 0, 0, device.model_name
                )
                count = counts.setdefault(name, [0, 0, 0])
                count[0] += device.pk in free
                count[2] += 1
        else:
            fixed = node.mig_mode == MigMode.FIXED
            # every MIG-capable GPU counts for "ever"; one serving fGPU shares gives nothing now
            layouts = _planner_layouts(instances.get(node.pk, []))
            for gpu, catalog, layout in _gpu_layouts(node, mine, {"any": set(), "shared": set()}, [], layouts):
                for profile in catalog.profiles:
                    _profile_seen(
                        found,
                        profile.name,
                        profile.memory,
                        profile.sm_count_for(gpu.subproc_count),
                        profile.compute_slices,
                        profile.memory_slices,
                        catalog.model,
                    )
                    count = counts.setdefault(profile.name, [0, 0, 0])
                    if str(gpu.pk) not in busy["shared"]:
                        count[0] += _placeable(catalog, layout, profile, reuse_only=fixed)
                        count[1] += sum(1 for i in layout if i.profile == profile.name and not i.in_use)
                    count[2] += (
                        sum(1 for i in layout if i.profile == profile.name)
                        if fixed
                        else _placeable(catalog, [], profile, reuse_only=False)
                    )
        cpu_free, _ = free_now[node.pk]
        for name, (now, idle, ever) in counts.items():
            totals = found[name]["counts"]
            totals[0] += min(now, max(cpu_free, 0))
            totals[1] += min(idle, max(cpu_free, 0))
            totals[2] += min(ever, node.cpu_count)
    offers = [
        MigProfileAvailability(
            name=name,
            memory=row["memory"],
            sm_count=row["sm_count"],
            compute_slices=row["compute_slices"],
            memory_slices=row["memory_slices"],
            models=tuple(sorted(row["models"])),
            max_now=row["counts"][0],
            idle_now=row["counts"][1],
            max_ever=row["counts"][2],
        )
        for name, row in found.items()
    ]
    return sorted(offers, key=lambda o: (o.memory, o.compute_slices, o.name))


def _profile_seen(found: dict, name: str, memory: int, sm_count: int, compute: int, slices: int, model: str) -> None:
    row = found.setdefault(
        name,
        {
            "memory": memory,
            "sm_count": sm_count,
            "compute_slices": compute,
            "memory_slices": slices,
            "models": set(),
            "counts": [0, 0, 0],
        },
    )
    row["memory"], row["sm_count"] = min(row["memory"], memory), min(row["sm_count"], sm_count)
    row["models"].add(model)


def _placeable(catalog: mig.MigCatalog, layout: list[mig.MigInstance], profile: mig.MigProfile, *, reuse_only: bool) -> int:
    """How many instances of `profile` one GPU laid out as `layout` could give, one request
    after another, as the planner would place them (`reuse_only`: idle instances only, a fixed
    layout)."""
    count, wanted = 0, mig.MigRequest(profile=profile.name)
    while True:
        try:
            plan = mig.plan_instance(catalog, layout, wanted)
        except AllocationError:
            return count
        if reuse_only and not plan.reuse:
            return count
        layout = list(mig.apply_plan(layout, plan, key=f"planned-{count}"))
        count += 1


@dataclass(frozen=True)
class MigOffer:
    """A MIG profile a request could get now instead of its own: `profile` ("2g.20gb", or a
    static slice's name) and its `memory` in bytes (the least over the GPUs that have it)."""

    profile: str
    memory: int


def mig_smaller_now(scope: MigScope, request: MigResourceRequest) -> list[MigOffer]:
    """The MIG profiles smaller than what `request` asks (less memory than its `mig_profile`
    on any GPU that has it, or than its memory size) that the choice (`mig_choose_in`) would
    give now on `scope`, each tried alone (the queue aside), largest first. Media-extension
    profiles are left out. Reads nothing from the database; `scope` is not changed."""
    sizes: dict[str, int] = {}
    for room in scope.rooms:
        for device in room.devices:
            if room.node.mig_mode == MigMode.STATIC:
                if device.is_mig_device:
                    name = device.mig_profile.lower() or device.model_name.lower().partition("-")[2]
                    sizes[name] = min(sizes.get(name, device.memory_size), device.memory_size)
                continue
            if device.is_mig_device:
                continue
            try:
                catalog = device_mig_catalog(device)
            except InvalidResourceRequest:
                continue
            for profile in catalog.profiles:
                if not profile.media_extensions:
                    sizes[profile.name] = min(sizes.get(profile.name, profile.memory), profile.memory)
    wanted = request.mig_request()
    limit = sizes.get(wanted.profile.lower(), 0) if wanted.profile else wanted.memory
    offers = []
    for name, memory in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        if memory >= limit:
            continue
        try:
            mig_choose_in(scope.copy({}), replace(request, mig_profile=name, isolation="mig"))
        except AllocationError:
            continue
        offers.append(MigOffer(profile=name, memory=memory))
    return offers
