"""Reads for MIG (issue 4): which devices MIG keeps to itself, and the admin's picture of each GPU."""
from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Q

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
    return Q(is_mig_device=False) & (Q(node__mig_mode__in=[MigMode.DYNAMIC, MigMode.FIXED])
                                     | Q(mother_uuid__in=with_slices))


@dataclass(frozen=True)
class SliceCell:
    """One memory or compute slice of a GPU's picture: `state` "used" (an instance a session
    holds), "idle" (an instance nobody holds: reusable), "free", or "stranded" (free, but no
    instance could be created over it as the GPU is laid out now)."""

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
    instances: tuple[tuple[str, str, str], ...]  # (instance, state, session)


def mig_gpu_pictures(*, node: Node) -> list[GpuPicture]:
    """For each MIG-capable GPU of `node` (its model in the built-in catalog), which memory
    slices (8) and compute slices (7) its GPU instances hold, by which session, which are idle
    and which free slices are stranded. Compute slices are drawn in order of the instances'
    memory starts (NVML does not place compute slices)."""
    from sessions.models import ACTIVE_STATUSES

    pictures = []
    instances = list(GpuInstance.objects.filter(node=node).select_related("session__owner").order_by("placement_start"))
    for device in node.devices.filter(is_mig_device=False).order_by("index"):
        try:
            catalog = device_mig_catalog(device)
        except InvalidResourceRequest:
            continue
        mine = [i for i in instances if i.parent_id == device.pk]
        layout, cells, listing = [], {}, []
        compute: list[SliceCell] = []
        for row in mine:
            active = row.session is not None and row.session.status in ACTIVE_STATUSES
            who = f"{row.session.name} ({row.session.owner.get_username()})" if active else ""
            label, state = f"{row.profile}@{row.placement_start}", "used" if active else "idle"
            layout.append(mig.MigInstance(key=str(row.pk), profile=row.profile, start=row.placement_start, in_use=active))
            for slot in range(row.placement_start, row.placement_start + row.placement_size):
                cells[slot] = SliceCell(slot, state, label, who)
            try:
                slices = catalog.profile(row.profile).compute_slices
            except InvalidResourceRequest:
                slices = 0
            compute.extend(SliceCell(len(compute) + k, state, label, who) for k in range(slices))
            listing.append((label, state, who))
        try:
            stranded = mig.stranded_slices(catalog, layout)
        except KeyError:  # a profile the catalog lacks: draw what is known
            stranded = set()
        memory = tuple(cells.get(slot) or SliceCell(slot, "stranded" if slot in stranded else "free")
                       for slot in range(mig.MEMORY_SLICES))
        compute = compute[:mig.COMPUTE_SLICES]
        compute += [SliceCell(n, "free") for n in range(len(compute), mig.COMPUTE_SLICES)]
        pictures.append(GpuPicture(device=device, model=catalog.model, memory=memory, compute=tuple(compute),
                                   instances=tuple(listing)))
    return pictures
