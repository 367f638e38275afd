"""Reads of the accelerator inventory: fractional settings, device usage and free fGPU."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal

from django.db import connection
from django.db.models import Q

import protocol
from accelerators.allocation import cluster, core, topology
from accelerators.allocation.errors import InvalidResourceRequest
from accelerators.live_usage import device_state, devices_with_usage, nodes_with_usage
from accelerators.mig_selectors import mig_exclusion
from accelerators.models import (
    AllocationMode,
    Device,
    DeviceLink,
    FractionalSettings,
    MigMode,
    Node,
    NodeStatus,
    PlacementShape,
    ResourceGroup,
    SlotFormat,
)


@dataclass(frozen=True)
class FgpuSummary:
    """A device's fGPU figures. `capacity`/`free` are None where the slot is in discrete mode, and
    for a GPU that serves MIG instead (`mig` then says why: "MIG dynamic", "MIG fixed layout",
    "MIG slices"; one GPU is never MIG and fGPU at once)."""

    capacity: Decimal | None
    allocated: Decimal
    free: Decimal | None
    mig: str = ""


def fractional_settings_get(*, slot_name: str) -> FractionalSettings:
    """The slot's settings row, or an unsaved one with Backend.AI's defaults (discrete mode)."""
    return FractionalSettings.objects.filter(slot_name=slot_name).first() or FractionalSettings(slot_name=slot_name)


def slot_format_get(*, slot_name: str, subtype: str) -> SlotFormat:
    """The slot format for `<slot_name>.<subtype>`, or an unsaved default ("GPU" / "fGPU"). One
    query: where many amounts are formatted (a page of sessions), use `SlotFormats`."""
    found = SlotFormat.objects.filter(slot_name=slot_name, subtype=subtype).first()
    return found or _slot_format_default(slot_name=slot_name, subtype=subtype)


def _slot_format_default(*, slot_name: str, subtype: str) -> SlotFormat:
    if subtype == "shares":
        return SlotFormat(
            slot_name=slot_name, subtype=subtype, display_unit="fGPU", human_readable_name="fGPU", number_round_length=2
        )
    return SlotFormat(slot_name=slot_name, subtype=subtype)


class SlotFormats:
    """The slot formats of one request that formats many amounts (a page of sessions): every
    row read in one query at the first `get`, which then answers as `slot_format_get` does,
    from memory. Keep one for one request (a serializer's context), no longer, so an
    administrator's edit shows on the next request."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, str], SlotFormat] | None = None

    def get(self, *, slot_name: str, subtype: str) -> SlotFormat:
        if self._rows is None:
            self._rows = {(f.slot_name, f.subtype): f for f in SlotFormat.objects.all()}
        return self._rows.get((slot_name, subtype)) or _slot_format_default(slot_name=slot_name, subtype=subtype)


def device_fgpu_summary(devices: Iterable[Device]) -> dict:
    """{device pk: FgpuSummary} for `devices`, from live allocations. Capacity and free are
    computed with the device slot's fractional settings (min of memory and SMs, truncated to
    2 decimals); allocated is the sum of live shares (whole-device grants count 1 each).

    One query for the fractional settings, and one more that reads `devices` again with their
    usage unless every one was read by `devices_with_usage` with its node (a page's devices,
    `select_related("node")` or prefetched from their nodes): call it once for a whole page."""
    devices = list(devices)
    settings = {s.slot_name: s for s in FractionalSettings.objects.filter(slot_name__in={d.slot_name for d in devices})}
    if not all(hasattr(d, "session_count") and Device.node.is_cached(d) for d in devices):
        devices = devices_with_usage(Device.objects.filter(pk__in=[d.pk for d in devices]).select_related("node"))
    result = {}
    sliced = _mothers_with_mig_slices([d for d in devices if (s := settings.get(d.slot_name)) and s.is_fractional])
    for device in devices:
        slot = settings.get(device.slot_name)
        # shares_used: from devices_with_usage's annotate(), which django-stubs cannot follow through a function.
        allocated = Decimal(device.shares_used or 0)  # type: ignore[attr-defined]
        if slot is None or slot.allocation_mode != AllocationMode.FRACTIONAL or device.is_mig_device:
            result[device.pk] = FgpuSummary(capacity=None, allocated=allocated, free=None)
            continue
        if device.node.mig_mode in (MigMode.DYNAMIC, MigMode.FIXED) or device.mother_uuid in sliced:
            why = "MIG slices" if device.mother_uuid in sliced else f"MIG {device.node.get_mig_mode_display().split(' (')[0]}"
            result[device.pk] = FgpuSummary(capacity=None, allocated=allocated, free=None, mig=why)
            continue
        pure = slot.as_allocation_settings()
        state = device_state(device)
        capacity = core.device_capacity(memory_size=state.memory_total, subproc_count=state.proc_total, settings=pure)
        result[device.pk] = FgpuSummary(capacity=capacity, allocated=allocated, free=core.device_free_shares(state, pure))
    return result


def _mothers_with_mig_slices(devices: list[Device]) -> set[str]:
    """The `mother_uuid`s among `devices`' whole GPUs that have MIG slices in the inventory (as
    `mig_exclusion` rules: such a GPU serves no fGPU shares). One query, none without whole GPUs."""
    mothers = {d.mother_uuid for d in devices if not d.is_mig_device}
    if not mothers:
        return set()
    return set(Device.objects.filter(is_mig_device=True, mother_uuid__in=mothers).values_list("mother_uuid", flat=True))


DEFAULT_GROUP = "default"


def resource_group_get(*, name: str) -> ResourceGroup | None:
    """The named group, or None for "". Raises InvalidResourceRequest for an unknown name."""
    if not name:
        return None
    group = ResourceGroup.objects.filter(name=name).first()
    if group is None:
        known = ", ".join(ResourceGroup.objects.values_list("name", flat=True)) or "none defined"
        raise InvalidResourceRequest(f"resources.resource_group: no resource group {name!r} (known: {known})")
    return group


def placement_scope(
    *, request: core.ResourceRequest, for_update: bool = False, alive_only: bool = True, image: str = "", usage: bool = True
):
    """The nodes a request may go to, as the allocator sees them, and the placement options for
    `core.place` (`{"policy", "no_fragmentation"}`). A request naming a resource group goes to
    that group's nodes under its rules; one naming none may go to any node, under the rules of
    the group named "default" if there is one (else fgd-plus, fragmentation allowed:
    `placement_options`). `image`: a session image reference; only nodes holding it ("": any
    node). `usage`: as node_states."""
    group = resource_group_get(name=request.resource_group)
    nodes = node_states(
        slot_name=request.slot or "cuda", for_update=for_update, alive_only=alive_only, group=group, image=image, usage=usage
    )
    return nodes, placement_options(group=group)


def node_runs_image(reference: str) -> Q:
    """Nodes that can run sessions in the session image `reference`: those whose agent reports
    holding it (`Node.images`, by the reference as it is or in `protocol.image_key` form, how
    Docker lists its tags), and, for any image but the process runtime's built-in "host", those
    whose agent pulls images it lacks (`attributes.pulls_images`: a docker agent, unless its
    agent.toml says `pull-images = false`)."""
    held = Q(images__has_any_keys=sorted({reference, protocol.image_key(reference)}))
    return held if reference == protocol.HOST_IMAGE else held | Q(attributes__pulls_images=True)


def placement_options(*, group: ResourceGroup | None) -> dict:
    """`core.place`'s options under `group`'s rules, or the "default" group's for None (else
    fgd-plus, fragmentation allowed): `{"policy", "no_fragmentation"}`."""
    rules = group or ResourceGroup.objects.filter(name=DEFAULT_GROUP).first()
    return {"policy": rules.policy if rules else "fgd-plus", "no_fragmentation": rules.no_fragmentation if rules else False}


def placement_workload(*, resource_group: str, prefix: str) -> cluster.Workload:
    """The request shapes the scheduler has placed in `resource_group` ("" for requests naming
    none) whose keys start with `prefix` (slot and index units), as the workload distribution
    p that fragmentation-aware policies weigh by (Weng et al. ATC'23, "target workload")."""
    workload = cluster.Workload()
    rows = PlacementShape.objects.filter(resource_group=resource_group, key__startswith=prefix, count__gt=0)
    for key, count in rows.values_list("key", "count"):
        shape = cluster.shape_from_key(key[len(prefix) :])
        if shape is not None:
            workload.observe(shape, count)
    return workload


def node_states(
    *,
    slot_name: str,
    for_update: bool = False,
    alive_only: bool = True,
    group: ResourceGroup | None = None,
    image: str = "",
    usage: bool = True,
    kept: bool = True,
) -> list[core.NodeState]:
    """Every (alive, undrained) node as the allocator sees it: CPU/memory left after live sessions and the
    slot's non-MIG devices with their live usage. `for_update` locks the device rows (in pk
    order, so concurrent schedulers queue instead of deadlocking) inside the caller's
    transaction; the usage read afterwards is therefore current. `image`: only the nodes
    holding that session image (`node_runs_image`; "": every node). Without `usage`, nothing is
    read as used (no sums over sessions and allocations): for what a node could ever hold
    (`core.check_ever_fits` empties the nodes anyway; issue 14: a launch's admission).

    On PostgreSQL the nodes come from the kept cluster view (`accelerators.cluster_view`),
    brought up to date from the change log after the locks are taken; on SQLite, or with
    `kept=False` (a check of the view), they are read from the database."""
    nodes, device_rows = _scope_rows(slot_name=slot_name, alive_only=alive_only, group=group, image=image)
    if for_update:
        _rows_lock(nodes, device_rows)
    if kept and connection.vendor == "postgresql":  # the kept view, brought up to date after the locks (issue 35.1)
        from accelerators.cluster_view import view_node_states

        return view_node_states(slot_name=slot_name, alive_only=alive_only, group=group, image=image, usage=usage)
    if usage:
        nodes = nodes_with_usage(nodes)
    annotated = list(nodes.select_related("resource_group").order_by("name"))
    devices = device_rows.select_related("node")
    by_node: dict = {}
    for device in (devices_with_usage(devices) if usage else devices).order_by("index"):
        by_node.setdefault(device.node_id, []).append(device_state(device))
    # node_id is the node's name: unique, and what a user reads in a refusal's reason.
    links: dict = {}
    for link in DeviceLink.objects.filter(node__in=[n.pk for n in annotated], device_a__slot_name=slot_name):
        links.setdefault(link.node_id, []).append(
            topology.Link(a=str(link.device_a_id), b=str(link.device_b_id), kind=link.kind, count=link.count)
        )
    weights = {}
    for n in annotated:
        g = n.resource_group
        weights[n.pk] = (g.weight_memory, g.weight_cores, g.weight_sessions) if g else (Decimal(1),) * 3
    return [
        core.NodeState(
            node_id=n.name,
            cpu_total=n.cpu_count,
            mem_total=n.memory_size,
            cpu_used=int(getattr(n, "cpu_used", 0)),
            mem_used=int(getattr(n, "mem_used", 0)),
            devices=tuple(by_node.get(n.pk, ())),
            links=tuple(links.get(n.pk, ())),
            weights=weights[n.pk],
            shared_storage=n.shared_storage,
        )
        for n in annotated
    ]


def _scope_rows(*, slot_name: str, alive_only: bool, group: ResourceGroup | None, image: str):
    """(node rows, device rows) of `node_states`' scope, as querysets."""
    nodes = Node.objects.all()
    if alive_only:  # alive and in service: a draining node takes no new session (accelerators.drain)
        nodes = nodes.filter(status=NodeStatus.ALIVE, drain_since__isnull=True)
    if group is not None:
        nodes = nodes.filter(resource_group=group)
    if image:
        nodes = nodes.filter(node_runs_image(image))
    device_rows = Device.objects.filter(node__in=nodes, slot_name=slot_name, is_mig_device=False).exclude(mig_exclusion())
    return nodes, device_rows


def _rows_lock(nodes, device_rows) -> None:
    """Lock `nodes`, then `device_rows` (querysets), each in pk order: the one order every
    writer of placements takes them in, so that concurrent writers queue instead of
    deadlocking."""
    list(nodes.order_by("pk").select_for_update().values_list("pk", flat=True))
    list(device_rows.order_by("pk").select_for_update().values_list("pk", flat=True))


def scope_rows_lock(*, slot_name: str, group: ResourceGroup | None = None, image: str = "") -> None:
    """Lock, inside the caller's transaction, the rows `node_states(for_update=True)` locks for
    the alive, undrained nodes of `group` (None: every node) holding `image` ("": any): the
    node rows, then their devices of `slot_name` (non-MIG), in pk order."""
    _rows_lock(*_scope_rows(slot_name=slot_name, alive_only=True, group=group, image=image))


def placed_rows_lock(*, node_names: Iterable[str], device_ids: Iterable[str]) -> dict:
    """Lock, inside the caller's transaction, the nodes named `node_names`, then the devices
    `device_ids` (pks), each in pk order as every writer of placements does (`_rows_lock`): what
    a scheduler pass that read its scope without locks (`sessions.scheduling.scheduler`) takes
    before it writes its plans there. Returns {device pk text: Device, with its node}."""
    list(Node.objects.filter(name__in=sorted(set(node_names))).order_by("pk").select_for_update().values_list("pk", flat=True))
    devices = Device.objects.select_related("node").filter(pk__in=sorted(set(device_ids))).order_by("pk")
    return {str(d.pk): d for d in devices.select_for_update(of=("self",))}


def pinned_device_problem(*, pins: tuple[str, ...], slot: str, group: ResourceGroup | None) -> tuple[str, str, str]:
    """What is wrong with `pins` (a request's `devices`: UUIDs or indexes) that no node in
    reach has (`core.check_ever_fits` raised UnknownDevice for them): `(sentence, type, title)`
    for the launch's error, from the first pin: a device of another resource group's node
    ("device-not-in-group"), a MIG instance or a GPU that MIG holds, a GPU of another slot
    ("device-not-usable"), or none registered at all ("unknown-device"). `slot`: the request's
    slot ("" for none); `group`: its resource group (None: every node)."""
    pin = pins[0]
    rows = Device.objects.select_related("node", "node__resource_group")
    found = list(rows.filter(index=int(pin)) if pin.isdigit() else rows.filter(device_id=pin))
    slot = slot or "cuda"
    label = f"GPU {pin}" if pin.isdigit() else pin
    others = f" (and {', '.join(pins[1:])})" if len(pins) > 1 else ""
    if not found:
        what = f"no node has a GPU with index {pin}" if pin.isdigit() else f"no registered node has a device {pin}"
        return (
            f"devices: {what}{others}. Pin a device by the UUID or index the node list shows "
            "(GET /api/v1/nodes/), or leave Only these GPUs empty.",
            "unknown-device",
            "No such device",
        )
    in_group = [d for d in found if group is None or d.node.resource_group_id == group.pk]
    if not in_group:
        d = found[0]
        where = f"resource group {d.node.resource_group.name}" if d.node.resource_group else "no resource group"
        wanted = group.name if group else ""
        return (
            f"devices: {label}{others} is on node {d.node.name}, in {where}, not in resource group {wanted}: "
            "pin a device of that group, or launch in the device's group.",
            "device-not-in-group",
            "Device not in your resource group",
        )
    mig = [d for d in in_group if d.is_mig_device or Device.objects.filter(pk=d.pk).filter(mig_exclusion()).exists()]
    if mig:
        return (
            f"devices: {label}{others} on node {mig[0].node.name} is a MIG instance or a GPU in MIG mode: ask for a "
            "MIG profile instead (the MIG tab, or resources.mig_profile), without pins.",
            "device-not-usable",
            "Device serves MIG only",
        )
    other = [d for d in in_group if d.slot_name != slot]
    if other:
        return (
            f"devices: {label}{others} on node {other[0].node.name} is a {other[0].slot_name} device, and this request "
            f"asks for {slot}: pin a {slot} device.",
            "device-not-usable",
            "Device of another kind",
        )
    return (f"devices: {label}{others} is not a device any node in reach has.", "unknown-device", "No such device")
