"""Writes for MIG set by administrators (issue 4): a node's fixed MIG layout."""
from __future__ import annotations

from django.db import transaction

from accelerators.allocation import mig
from accelerators.allocation.errors import InvalidResourceRequest
from accelerators.mig_selectors import device_mig_catalog
from accelerators.models import GpuInstance, MigMode, Node


def mig_layout_check(*, node: Node, layout: object) -> dict:
    """`layout` as an administrator wrote it, `{"<GPU device id or index>": [{"profile":
    "3g.40gb", "start": 0}, …]}`, checked against each GPU's catalog (allowed starts, disjoint
    memory slices, max counts: `accelerators.allocation.mig.layout_problems`). Returns it keyed
    by device pk: {pk: [(profile, start), …]}. Raises InvalidResourceRequest naming the GPU and
    the problem."""
    if not isinstance(layout, dict):
        raise InvalidResourceRequest('mig_layout: expected {"<GPU id or index>": [{"profile": …, "start": …}]}')
    gpus = list(node.devices.filter(is_mig_device=False))
    out = {}
    for key, entries in layout.items():
        device = next((d for d in gpus if str(key) in (d.device_id, str(d.index))), None)
        if device is None:
            raise InvalidResourceRequest(f"mig_layout: node {node.name} has no GPU {key!r}")
        catalog = device_mig_catalog(device)
        if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("profile"), str)
                                                    and isinstance(e.get("start"), int) for e in entries):
            raise InvalidResourceRequest(f"mig_layout[{key!r}]: expected a list of {{\"profile\": …, \"start\": …}}")
        wanted = [mig.MigInstance(key=f"{e['profile']}@{e['start']}", profile=e["profile"].lower(), start=e["start"])
                  for e in entries]
        problems = mig.layout_problems(catalog, wanted)
        if problems:
            raise InvalidResourceRequest(f"mig_layout[{key!r}] on {catalog.model}: {'; '.join(problems)}")
        out[device.pk] = [(i.profile, i.start) for i in wanted]
    return out


@transaction.atomic
def node_mig_layout_apply(*, node: Node) -> None:
    """Make a fixed-layout node's GpuInstance rows match its `mig_layout`: missing instances are
    added (idle; its agent creates them on first use), idle ones not in the layout removed.
    Instances in use stay until their sessions end. No-op unless the mode is "fixed".
    Raises InvalidResourceRequest (see `mig_layout_check`)."""
    if node.mig_mode != MigMode.FIXED:
        return
    from sessions.models import ACTIVE_STATUSES

    layout = mig_layout_check(node=node, layout=node.mig_layout)
    rows = list(GpuInstance.objects.select_for_update(of=("self",)).filter(node=node).select_related("session", "parent"))
    kept = []
    for row in rows:
        wanted = (row.profile, row.placement_start) in layout.get(row.parent_id, [])
        active = row.session is not None and row.session.status in ACTIVE_STATUSES
        if wanted or active:
            kept.append(row)
        else:
            row.delete()
    existing = {(r.parent_id, r.profile, r.placement_start) for r in kept}
    taken = {(r.parent_id, r.placement_start) for r in kept}
    for device in node.devices.filter(pk__in=list(layout)):
        catalog = device_mig_catalog(device)
        for profile_name, start in layout[device.pk]:
            if (device.pk, profile_name, start) in existing:
                continue
            if (device.pk, start) in taken:
                continue  # an instance in use holds that start; the layout's takes it when it ends
            profile = catalog.profile(profile_name)
            GpuInstance.objects.create(node=node, parent=device, profile=profile.name, placement_start=start,
                                       placement_size=profile.size, memory_size=profile.memory,
                                       subproc_count=profile.sm_count_for(device.subproc_count))
