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

`schedule_step` is the scheduler's one call (`mig_schedule` does the work); it writes the plan (GpuInstance rows, one
Allocation on the parent GPU or on the static slice) and returns the agent's start spec with a
`mig` block (see `sessions.runtime.mig`).
"""
from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from django.db.models import Sum
from django.utils import timezone

from accelerators.allocation import mig
from accelerators.allocation.errors import AllocationError, InsufficientResource, InvalidResourceRequest, NeverSchedulable
from accelerators.allocation.mig import MigResourceRequest
from accelerators.allocation.units import format_binary_size
from accelerators.mig_selectors import device_mig_catalog
from accelerators.models import Device, GpuInstance, MigMode, Node, NodeStatus
from accelerators.selectors import resource_group_get
from sessions import events
from sessions.models import ACTIVE_STATUSES, Allocation, ComputeSession, SessionStatus


@dataclass(frozen=True)
class MigOutcome:
    """What `mig_schedule` did: `started` (node name and start spec), or why it waits
    (`wait`, capacity may come) or fails (`error`, it never can)."""

    node: str = ""
    spec: dict | None = None
    wait: str = ""
    error: str = ""


def schedule_step(*, session: ComputeSession, request, wait, blocked: list, starts: list, scheduled: list) -> bool:
    """The scheduler's one call for MIG (issue 4). False: not for MIG, the ordinary path goes
    on. True: handled — placed (start appended to `starts`, the id to `scheduled`, sessions in
    `blocked` overtaken once more), waiting (`wait(session, reason)`, appended to `blocked`), or
    ended in ERROR with the reason."""
    outcome = mig_schedule(session=session, request=request)
    if outcome is None:
        return False
    if outcome.spec is not None:
        starts.append((outcome.node, outcome.spec))
        scheduled.append(str(session.pk))
        for earlier in blocked:
            earlier.overtaken += 1
            earlier.save(update_fields=["overtaken"])
    elif outcome.wait:
        wait(session, outcome.wait)
        blocked.append(session)
    else:
        session.status, session.status_reason, session.terminated_at = SessionStatus.ERROR, outcome.error, timezone.now()
        session.save(update_fields=["status", "status_reason", "terminated_at"])
        events.session_notify(session)
    return True


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
    nodes = list(nodes)
    if not nodes:
        raise NeverSchedulable("no node has MIG enabled (an administrator sets a node's MIG mode)")
    _check_ever_fits(nodes, list(Device.objects.filter(node__in=nodes, slot_name="cuda")), request.mig_request())


def wants_mig(request) -> bool:
    return isinstance(request, MigResourceRequest)


def mig_schedule(*, session: ComputeSession, request) -> MigOutcome | None:
    """Place `session` on MIG if its request asks for MIG. None: not a MIG request, or an
    `isolation: "any"` request that MIG cannot hold now (the ordinary path takes it). Locks
    the candidate nodes, devices and GPU instances (pk order) inside the caller's transaction."""
    if not wants_mig(request):
        return None
    try:
        choice = _choose(request)
    except NeverSchedulable as exc:
        return None if request.isolation == "any" else MigOutcome(error=str(exc))
    except InsufficientResource as exc:
        return None if request.isolation == "any" else MigOutcome(wait=f"waiting for capacity: {exc}")
    except AllocationError as exc:
        return None if request.isolation == "any" else MigOutcome(error=str(exc))
    return _write(session, choice)


@dataclass(frozen=True)
class _Choice:
    rank: tuple
    node: Node
    device: Device  # the parent GPU (dynamic) or the static slice
    plan: mig.MigPlan | None = None
    catalog: mig.MigCatalog | None = None


def _choose(request: MigResourceRequest) -> _Choice:
    wanted = request.mig_request()
    group = resource_group_get(name=request.resource_group)
    nodes = Node.objects.filter(status=NodeStatus.ALIVE).exclude(mig_mode=MigMode.OFF)
    if group is not None:
        nodes = nodes.filter(resource_group=group)
    nodes = list(nodes.order_by("pk").select_for_update())
    devices = list(Device.objects.filter(node__in=nodes, slot_name="cuda").order_by("pk").select_for_update())
    list(GpuInstance.objects.filter(node__in=nodes).order_by("pk").select_for_update().values_list("pk", flat=True))
    if not nodes:
        raise NeverSchedulable("no node has MIG enabled (an administrator sets a node's MIG mode)")
    _check_ever_fits(nodes, devices, wanted)
    busy = _busy_devices(devices)
    choices: list[_Choice] = []
    reasons: list[str] = []
    for node in sorted(nodes, key=lambda n: n.name):
        if not _node_has_room(node, request):
            reasons.append(f"{node.name}: not enough CPU cores or memory left")
            continue
        mine = [d for d in devices if d.node_id == node.pk]
        if node.mig_mode == MigMode.STATIC:
            found, why = _static_choice(node, mine, wanted, busy)
        else:
            found, why = _dynamic_choices(node, mine, wanted, busy)
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
                    wanted.profile in {device.mig_profile.lower(), device.model_name.lower().partition("-")[2]}
                    if wanted.profile else device.memory_size >= wanted.memory):
                return
        elif not device.is_mig_device:
            try:
                mig.candidate_profiles(device_mig_catalog(device), wanted)
            except AllocationError:
                continue
            return
    raise NeverSchedulable(f"no MIG node could ever hold {wanted.describe()} (no such MIG slice or profile on "
                           f"{', '.join(sorted(n.name for n in nodes))})")


def _busy_devices(devices: list[Device]) -> dict[str, set]:
    """{"any": device pks with live allocations, "shared": those whose live allocations are not
    MIG instances (fGPU or per-device slices)}."""
    live = Allocation.objects.filter(device__in=devices, released_at__isnull=True)
    any_pks = set(live.values_list("device_id", flat=True))
    mig_sessions = GpuInstance.objects.filter(session__status__in=ACTIVE_STATUSES).values_list("session_id", flat=True)
    shared = set(live.exclude(session_id__in=mig_sessions).values_list("device_id", flat=True))
    return {"any": any_pks, "shared": shared}


def _node_has_room(node: Node, request: MigResourceRequest) -> bool:
    used = ComputeSession.objects.filter(node=node, status__in=ACTIVE_STATUSES).aggregate(
        cpu=Sum("cpu", default=0), mem=Sum("mem", default=0))
    return node.cpu_count - used["cpu"] >= request.cpu and node.memory_size - used["mem"] >= request.mem


def _static_choice(node: Node, devices: list[Device], wanted: mig.MigRequest, busy: dict):
    slices = [d for d in devices if d.is_mig_device and d.pk not in busy["any"]]
    mothers_shared = {d.mother_uuid for d in devices if not d.is_mig_device and d.pk in busy["shared"]}
    fitting = []
    for device in slices:
        if device.mother_uuid in mothers_shared:
            continue  # its GPU serves fGPU shares: MIG and fGPU do not mix on one GPU
        if wanted.profile:
            names = {device.mig_profile.lower(), device.model_name.lower().partition("-")[2]}
            if wanted.profile not in names:
                continue
        elif device.memory_size < wanted.memory:
            continue
        fitting.append(_Choice(rank=(device.memory_size, 0, 0, 0, 0, node.name, device.index, device.device_id),
                               node=node, device=device))
    if not fitting:
        return [], f"no free MIG slice for {wanted.describe()}"
    return [min(fitting, key=lambda c: c.rank)], ""


def _dynamic_choices(node: Node, devices: list[Device], wanted: mig.MigRequest, busy: dict):
    choices, reasons = [], []
    instances = list(GpuInstance.objects.filter(node=node).select_related("session"))
    gpus = [d for d in devices if not d.is_mig_device]
    for gpu in gpus:
        try:
            catalog = device_mig_catalog(gpu)
        except InvalidResourceRequest:
            continue
        if gpu.pk in busy["shared"]:
            reasons.append(f"GPU {gpu.index} serves fGPU shares (MIG and fGPU do not mix on one GPU)")
            continue
        layout = [mig.MigInstance(key=str(i.pk), profile=i.profile, start=i.placement_start,
                                  in_use=i.session is not None and i.session.status in ACTIVE_STATUSES)
                  for i in instances if i.parent_id == gpu.pk]
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
        rank = (profile.memory, profile.memory_slices, profile.compute_slices, 0 if plan.reuse else 1,
                len(plan.destroy), -in_use, node.name, gpu.index, gpu.device_id)
        choices.append(_Choice(rank=rank, node=node, device=gpu, plan=plan, catalog=catalog))
    return choices, "; ".join(reasons) or "no MIG-capable GPU"


def _write(session: ComputeSession, choice: _Choice) -> MigOutcome:
    from sessions.scheduler import session_start_spec

    now = timezone.now()
    device = choice.device
    block = None
    if choice.plan is None:  # a static slice
        allocation = Allocation.objects.create(session=session, device=device, shares=Decimal(1),
                                               memory=device.memory_size, procs=Decimal(device.subproc_count))
        why = f"the free MIG slice {device.mig_profile or device.model_name} ({format_binary_size(device.memory_size)})"
    else:
        plan = choice.plan
        doomed = GpuInstance.objects.filter(pk__in=plan.destroy)
        destroy = [{"profile": g.profile, "start": g.placement_start} for g in doomed.order_by("placement_start")]
        doomed.delete()
        if plan.reuse:
            instance = GpuInstance.objects.get(pk=plan.reuse)
            instance.session, instance.last_used_at = session, now
            instance.save(update_fields=["session", "last_used_at"])
        else:
            instance = GpuInstance.objects.create(
                node=choice.node, parent=device, profile=plan.profile.name, placement_start=plan.start,
                placement_size=plan.profile.size, memory_size=plan.profile.memory,
                subproc_count=plan.profile.sm_count_for(device.subproc_count), session=session, last_used_at=now)
        allocation = Allocation.objects.create(session=session, device=device, shares=Decimal(0),
                                               memory=instance.memory_size, procs=Decimal(instance.subproc_count))
        block = {
            "gpu": device.device_id, "index": device.index, "model_name": device.model_name,
            "memory_size": device.memory_size, "subproc_count": device.subproc_count,
            "profile": plan.profile.name, "start": plan.start, "reuse": bool(plan.reuse),
            "instance_id": str(instance.pk), "destroy": destroy,
            # the GPU's whole expected layout after this plan, for the agent to re-apply after a reboot
            "layout": [{"profile": g.profile, "start": g.placement_start}
                       for g in GpuInstance.objects.filter(parent=device).order_by("placement_start")],
        }
        why = f"a {plan.profile.name} MIG instance ({format_binary_size(plan.profile.memory)}): {plan.describe()}"
    session.node = choice.node
    session.status = SessionStatus.SCHEDULED
    session.status_reason = f"got {why} on GPU {device.index} of {choice.node.name}"
    session.scheduled_at = now
    session.save(update_fields=["node", "status", "status_reason", "scheduled_at"])
    events.session_notify(session)
    spec = session_start_spec(session, [allocation])
    if block is not None:
        spec["mig"] = block
    return MigOutcome(node=choice.node.name, spec=spec)


def session_grant_text(session: ComputeSession, request) -> str:
    """What a MIG or isolation-"any" session got and why, for its page: "got MIG 1g.20gb on GPU
    0 (memory slices 6–7): the smallest MIG instance that holds 15 GiB". Empty for other
    requests and for sessions not placed yet."""
    if not wants_mig(request) or session.node_id is None:
        return ""
    instance = GpuInstance.objects.filter(session=session).select_related("parent").first()
    asked = "the profile asked for" if request.mig_profile else \
        f"the smallest MIG instance that holds {request.memory.describe() if request.memory else 'it'}"
    if request.isolation == "any":
        asked = f"MIG first, for its hardware isolation; {asked}"
    if instance is not None:
        last = instance.placement_start + instance.placement_size - 1
        return (f"got MIG {instance.profile} on GPU {instance.parent.index} (memory slices "
                f"{instance.placement_start}–{last}): {asked}")
    allocation = session.allocations.select_related("device").first()
    if allocation is None:
        return ""
    device = allocation.device
    if device.is_mig_device:
        return f"got the MIG slice {device.mig_profile or device.model_name} of GPU {device.index}: {asked}"
    if allocation.shares == 0 and session.node is not None and session.node.mig_mode != MigMode.OFF:
        return f"got a MIG instance on GPU {device.index} (since reused by another session): {asked}"
    return f"got a shared slice of GPU {device.index}: no MIG instance could hold it when it was placed"
