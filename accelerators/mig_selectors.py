"""Reads for MIG (issue 4): which devices MIG keeps to itself, and the admin's picture of each GPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db.models import Q

import protocol
from accelerators.allocation import mig
from accelerators.allocation.errors import InvalidResourceRequest
from accelerators.models import Device, GpuInstance, MigMode, Node


def device_mig_catalog(device: Device) -> mig.MigCatalog:
    """The MIG catalog of a GPU: what its agent read from NVML, else the built-in table for its
    model name. Raises InvalidResourceRequest for a GPU without MIG."""
    if device.mig_catalog:
        return mig.catalog_from_dict(device.mig_catalog)
    return mig.catalog_get(device.model_name, memory_size=device.memory_size)


def mig_exclusion() -> Q:
    """A Q over Device naming the whole GPUs that fGPU shares, whole-device and per-device
    requests must not use, because one physical GPU is never MIG and fGPU at once: every GPU
    of a node in dynamic or fixed-layout MIG mode, and every GPU with MIG slices in the
    inventory (a GPU in MIG mode runs no work outside its instances; NVIDIA MIG User Guide)."""
    with_slices = Device.objects.filter(is_mig_device=True).values("mother_uuid")
    return Q(is_mig_device=False) & (Q(node__mig_mode__in=[MigMode.DYNAMIC, MigMode.FIXED]) | Q(mother_uuid__in=with_slices))


def mig_catalog_source(device: Device) -> str:
    """Where `device_mig_catalog(device)` comes from: "nvml" (its agent read it from NVML) or
    "built-in" (`accelerators.allocation.mig.CATALOGS`)."""
    return "nvml" if device.mig_catalog else "built-in"


def gpu_instance_state(row: GpuInstance) -> str:
    """ "unknown" (its agent found it on the GPU at start, the manager never planned it), "in_use"
    (a live session holds it) or "idle" (nobody holds it: reusable, destroyed only when its
    slices are needed). Reads `row.session` (select_related it)."""
    if row.unknown_since is not None:
        return "unknown"
    return "in_use" if row.session is not None and row.session.status in protocol.SESSION_ACTIVE_STATES else "idle"


def gpu_instance_holds(row: GpuInstance) -> bool:
    """Whether the planner must leave `row` alone (neither reuse nor destroy it): in use by a
    live session, or unknown."""
    return gpu_instance_state(row) != "idle"


def node_mig_gpus(*, node: Node) -> list[Device]:
    """The MIG-capable whole GPUs of `node` (their model has a MIG catalog), by index."""
    gpus = []
    for device in node.devices.filter(is_mig_device=False).order_by("index"):
        try:
            device_mig_catalog(device)
        except InvalidResourceRequest:
            continue
        gpus.append(device)
    return gpus


def node_mig_layout_digest(*, node: Node) -> str | None:
    """The digest (`accelerators.allocation.mig.layout_digest`) of the GPU instances the manager
    has on record on `node`'s MIG-capable GPUs — planned ones (in use or idle) and unknown ones
    alike, since the agent's digest counts every instance on the GPU. None when the node has no
    MIG-capable GPU. Two queries."""
    gpus = node_mig_gpus(node=node)
    if not gpus:
        return None
    rows = GpuInstance.objects.filter(parent__in=gpus).values_list("parent__device_id", "profile", "placement_start")
    return mig.layout_digest([g.device_id for g in gpus], rows)


SYNC_DETAIL_KEYS = ("state", "detail", "kind", "seq", "changed_at", "sent_at", "reported_at")


def node_mig_sync_view(*, node: Node, gpu: str | None = None) -> dict:
    """How far `node`'s agent has applied the MIG layout the manager expects, for the API and
    the admin page: {"applied": state, "detail": words, "kind": what the last push was for
    ("start", "layout", "drift"), "seq", "changed_at", "sent_at", "reported_at" (ISO 8601 or
    null), "pending": [{"gpu", "index", "profile", "start", "action", "reason"}], "errors":
    [{"gpu", "profile", "start", "reason"}], "destroying": [{"gpu", "profile", "start"}]}.
    States (`accelerators.mig_services.node_mig_push`): "not-managed" (MIG mode off or static,
    or no MIG-capable GPU: nothing is sent), "pending-agent-offline" (applied at the agent's
    next start), "sent" (waiting for the agent's report), "applied", "pending" (applied but for
    changes waiting for sessions to end), "error" (see `errors`); "" before anything was sent.
    `gpu` (a GPU UUID): only that GPU's pending items, errors and instances to destroy (errors
    naming no GPU are kept)."""
    sync = node.mig_sync or {}
    view: dict[str, Any] = {key: sync.get(key) for key in SYNC_DETAIL_KEYS}
    view["applied"] = view.pop("state") or ""
    view["detail"] = view["detail"] or ""
    view["pending"] = list(sync.get("pending", []))
    view["errors"] = list(sync.get("errors", []))
    view["destroying"] = [{"gpu": g, **item} for g, items in sorted(sync.get("destroy", {}).items()) for item in items]
    if gpu is not None:
        for key in ("pending", "errors", "destroying"):
            view[key] = [item for item in view[key] if item.get("gpu") in (gpu, None, "")]
    return view


@dataclass(frozen=True)
class InstanceView:
    """One GPU instance of a GPU's layout: the row, its state (`gpu_instance_state`) and its
    compute slices (0 for a profile the GPU's catalog lacks)."""

    row: GpuInstance
    state: str
    compute_slices: int


@dataclass(frozen=True)
class GpuLayout:
    """A MIG-capable GPU of a node (its model in a MIG catalog) as the manager sees it: its GPU
    instances by memory start, its free memory slices (0–7) and which of those are stranded
    (no instance could be created over them as the GPU is laid out now)."""

    node: Node
    device: Device
    catalog: mig.MigCatalog
    catalog_source: str
    instances: tuple[InstanceView, ...]
    free: frozenset[int]
    stranded: frozenset[int]

    @property
    def free_compute_slices(self) -> int:
        return max(0, mig.COMPUTE_SLICES - sum(i.compute_slices for i in self.instances))


def mig_gpu_layouts(*, nodes) -> list[GpuLayout]:
    """The layout of every MIG-capable GPU (whole GPUs whose model has a MIG catalog, any MIG
    mode) of `nodes` (Node rows or a queryset), by node name then GPU index."""
    nodes = sorted(nodes, key=lambda n: n.name)
    rows = list(GpuInstance.objects.filter(node__in=nodes).select_related("session__owner").order_by("placement_start"))
    devices = Device.objects.filter(node__in=nodes, is_mig_device=False).select_related("node")
    layouts = []
    for device in sorted(devices, key=lambda d: (d.node.name, d.index, d.device_id)):
        try:
            catalog = device_mig_catalog(device)
        except InvalidResourceRequest:
            continue
        views = []
        for row in (r for r in rows if r.parent_id == device.pk):
            try:
                slices = catalog.profile(row.profile).compute_slices
            except InvalidResourceRequest:
                slices = 0
            views.append(InstanceView(row=row, state=gpu_instance_state(row), compute_slices=slices))
        layout = [
            mig.MigInstance(key=str(v.row.pk), profile=v.row.profile, start=v.row.placement_start, in_use=v.state != "idle")
            for v in views
        ]
        try:
            free, stranded = mig.free_slices(catalog, layout), mig.stranded_slices(catalog, layout)
        except KeyError:  # a profile the catalog lacks: count by the rows' own placements
            held = {s for v in views for s in range(v.row.placement_start, v.row.placement_start + v.row.placement_size)}
            free, stranded = set(range(mig.MEMORY_SLICES)) - held, set()
        layouts.append(
            GpuLayout(
                node=device.node,
                device=device,
                catalog=catalog,
                catalog_source=mig_catalog_source(device),
                instances=tuple(views),
                free=frozenset(free),
                stranded=frozenset(stranded),
            )
        )
    return layouts


@dataclass(frozen=True)
class SliceCell:
    """One memory or compute slice of a GPU's picture: `state` "used" (an instance a session
    holds), "idle" (an instance nobody holds: reusable), "unknown" (an instance the agent found
    that the manager never planned), "free", or "stranded" (free, but no instance could be
    created over it as the GPU is laid out now)."""

    slot: int
    state: str
    instance: str = ""  # "1g.20gb@6"
    session: str = ""  # "notebook (alice)"


@dataclass(frozen=True)
class GpuPicture:
    """A MIG-capable GPU of a node: its 8 memory slices, 7 compute slices and instances."""

    device: Device
    model: str
    memory: tuple[SliceCell, ...]
    compute: tuple[SliceCell, ...]
    instances: tuple[tuple[str, str, str], ...]  # (instance, state, session or the unknown one's MIG UUID)


_PICTURE_STATES = {"in_use": "used", "idle": "idle", "unknown": "unknown"}


def mig_gpu_pictures(*, node: Node) -> list[GpuPicture]:
    """For each MIG-capable GPU of `node` (`mig_gpu_layouts`), which memory slices (8) and
    compute slices (7) its GPU instances hold, by which session, which are idle, which unknown
    and which free slices are stranded. Compute slices are drawn in order of the instances'
    memory starts (NVML does not place compute slices)."""
    pictures = []
    for layout in mig_gpu_layouts(nodes=[node]):
        cells: dict = {}
        compute: list = []
        listing: list = []
        for view in layout.instances:
            row, state = view.row, _PICTURE_STATES[view.state]
            holder = row.session if view.state == "in_use" else None
            who = f"{holder.name} ({holder.owner.get_username()})" if holder is not None else ""
            if view.state == "unknown":
                who = f"found by the agent: {row.uuid or 'no MIG device'}"
            label = f"{row.profile}@{row.placement_start}"
            for slot in range(row.placement_start, row.placement_start + row.placement_size):
                cells[slot] = SliceCell(slot, state, label, who)
            compute.extend(SliceCell(len(compute) + k, state, label, who) for k in range(view.compute_slices))
            listing.append((label, state, who))
        memory = tuple(
            cells.get(slot) or SliceCell(slot, "stranded" if slot in layout.stranded else "free")
            for slot in range(mig.MEMORY_SLICES)
        )
        compute = compute[: mig.COMPUTE_SLICES]
        compute += [SliceCell(n, "free") for n in range(len(compute), mig.COMPUTE_SLICES)]
        pictures.append(
            GpuPicture(
                device=layout.device, model=layout.catalog.model, memory=memory, compute=tuple(compute), instances=tuple(listing)
            )
        )
    return pictures


@dataclass(frozen=True)
class CatalogView:
    """A MIG catalog as the profiles API lists it: `source` "built-in" (one per model of
    `accelerators.allocation.mig.CATALOGS`) or "nvml" (one per distinct catalog agents read from
    NVML); `nodes` the names of the nodes whose GPUs are planned with it."""

    catalog: mig.MigCatalog
    source: str
    nodes: tuple[str, ...]
    built_in_model: str = ""  # the built-in model the GPUs' names give ("" when none does)


def mig_catalog_list(*, model: str = "") -> list[CatalogView]:
    """Every MIG catalog the manager plans with: the built-in one of each model, then each
    distinct catalog an agent reported from NVML (`Device.mig_catalog`), by model name.
    `model` keeps those of one GPU model: a built-in key ("H100-80GB") or any name
    `accelerators.allocation.mig.catalog_get` reads ("H100", "NVIDIA A100-SXM4-40GB"); NVML
    catalogs match by their own model name or by the built-in model their GPUs' names give.
    Raises InvalidResourceRequest for a `model` that names no MIG-capable GPU."""
    users: dict[str, set[str]] = {}
    reported: dict[str, tuple[mig.MigCatalog, set[str], str]] = {}
    for device in Device.objects.filter(is_mig_device=False).select_related("node").order_by("node__name", "index"):
        try:
            built_in = mig.catalog_get(device.model_name, memory_size=device.memory_size).model
        except InvalidResourceRequest:
            built_in = ""
        if device.mig_catalog:
            try:
                catalog = mig.catalog_from_dict(device.mig_catalog)
            except InvalidResourceRequest:
                continue
            key = repr(mig.catalog_as_dict(catalog))
            reported.setdefault(key, (catalog, set(), built_in))[1].add(device.node.name)
        elif built_in:
            users.setdefault(built_in, set()).add(device.node.name)
    views = [
        CatalogView(catalog=c, source="built-in", nodes=tuple(sorted(users.get(name, ()))), built_in_model=name)
        for name, c in mig.CATALOGS.items()
    ]
    views += [
        CatalogView(catalog=c, source="nvml", nodes=tuple(sorted(names)), built_in_model=built_in)
        for c, names, built_in in sorted(reported.values(), key=lambda r: (r[0].model, sorted(r[1])))
    ]
    if not model:
        return views
    wanted = model.strip().lower()
    try:
        resolved = mig.catalog_get(model.strip()).model
    except InvalidResourceRequest:
        resolved = ""
    found = [v for v in views if v.catalog.model.lower() == wanted or (resolved and v.built_in_model == resolved)]
    if not found:
        raise InvalidResourceRequest(f"model: {model!r} is not a MIG-capable GPU model (known: {', '.join(mig.CATALOGS)})")
    return found
