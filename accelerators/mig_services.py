"""Writes for MIG (issue 4): a node's MIG settings and fixed layout (set by administrators), and
what its agent found on its GPUs when it started (reconcile)."""
from __future__ import annotations

import logging

from django.db import transaction
from django.utils import timezone

from accelerators.allocation import mig
from accelerators.allocation.errors import InvalidResourceRequest
from accelerators.mig_selectors import device_mig_catalog, gpu_instance_holds
from accelerators.models import Device, GpuInstance, MigMode, Node

log = logging.getLogger(__name__)


def node_mig_settings_check(*, node: Node, mig_mode: str, mig_layout: object) -> None:
    """The check an administrator's change of a node's MIG settings passes, in the admin form and
    the API alike: in mode "fixed" the layout must be creatable on each named GPU
    (`mig_layout_check`); other modes keep the layout without using it. Raises
    InvalidResourceRequest naming the GPU and the problem."""
    if mig_mode == MigMode.FIXED and node.pk:
        mig_layout_check(node=node, layout=mig_layout or {})


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
    Instances in use, and unknown ones (found on the GPU, never planned here), stay. No-op
    unless the mode is "fixed". Raises InvalidResourceRequest (see `mig_layout_check`)."""
    if node.mig_mode != MigMode.FIXED:
        return
    layout = mig_layout_check(node=node, layout=node.mig_layout)
    rows = list(GpuInstance.objects.select_for_update(of=("self",)).filter(node=node).select_related("session", "parent"))
    kept = []
    for row in rows:
        wanted = (row.profile, row.placement_start) in layout.get(row.parent_id, [])
        if wanted or gpu_instance_holds(row):
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
                continue  # an instance in use (or unknown) holds that start; the layout's takes it when it ends
            profile = catalog.profile(profile_name)
            GpuInstance.objects.create(node=node, parent=device, profile=profile.name, placement_start=start,
                                       placement_size=profile.size, memory_size=profile.memory,
                                       subproc_count=profile.sm_count_for(device.subproc_count))


def node_mig_expected(*, node: Node) -> dict | None:
    """What the agent of `node` reconciles its MIG GPUs against when it starts, for the task
    `fgpu.agent.mig_reconcile`: {"gpus": [{"gpu": GPU UUID, "index", "model_name", "memory_size"
    (bytes), "subproc_count" (SMs)}], "expected": {GPU UUID: [{"profile", "start"}]}} — every
    GPU instance the manager planned (in use or idle; unknown ones are left out, so the agent
    reports them again if they are still there). None unless the node is in dynamic or fixed
    MIG mode and has a MIG-capable GPU."""
    if node.mig_mode not in (MigMode.DYNAMIC, MigMode.FIXED):
        return None
    gpus, expected = [], {}
    rows = GpuInstance.objects.filter(node=node, unknown_since__isnull=True).order_by("placement_start")
    for device in node.devices.filter(is_mig_device=False).order_by("index"):
        try:
            device_mig_catalog(device)
        except InvalidResourceRequest:
            continue
        gpus.append({"gpu": device.device_id, "index": device.index, "model_name": device.model_name,
                     "memory_size": device.memory_size, "subproc_count": device.subproc_count})
        expected[device.device_id] = [{"profile": r.profile, "start": r.placement_start}
                                      for r in rows if r.parent_id == device.pk]
    return {"gpus": gpus, "expected": expected} if gpus else None


@transaction.atomic
def node_mig_report_apply(*, node_name: str, report: dict) -> list[GpuInstance]:
    """Record what the agent of `node_name` found when it reconciled its MIG GPUs
    (`sessions.runtime.mig.MigManager.reconcile`: {"gpus": [GPU UUIDs it could list],
    "unknown": [{"gpu", "profile", "start", "uuid"}], "recreated": [...], "errors": [...]}; or,
    after a start spec's instance was made or reused, {"prepared": [...]}).

    For each listed GPU the unknown instances become GpuInstance rows with `unknown_since` set
    (the planner then counts their slices as taken and never reuses or destroys them), rows of
    unknown instances no longer found are deleted, and an idle planned row at the start an
    unknown instance holds is replaced by it (the GPU cannot hold both). Re-created and prepared
    instances get their MIG device UUID. A planned row in use where an unknown instance sits is kept and
    the clash logged. Returns the unknown rows of the listed GPUs. Unknown nodes, GPUs and
    profiles are logged and skipped."""
    gpu_ids = {*report.get("gpus", []), *(item.get("gpu") for item in report.get("prepared", []))}
    node = Node.objects.select_for_update().filter(name=node_name).first()
    if node is None:
        log.warning("MIG reconcile report from unregistered node %s", node_name)
        return []
    now = timezone.now()
    gpus = {d.device_id: d for d in Device.objects.filter(node=node, is_mig_device=False, device_id__in=gpu_ids)}
    listed = [d for gpu, d in gpus.items() if gpu in report.get("gpus", [])]  # those whose unknown ones are news
    rows = list(GpuInstance.objects.select_for_update(of=("self",)).filter(parent__in=listed)
                .select_related("session"))
    for item in [*report.get("recreated", []), *report.get("prepared", [])]:
        device = gpus.get(item.get("gpu"))
        if device is not None and item.get("uuid"):
            GpuInstance.objects.filter(parent=device, profile=item["profile"], placement_start=int(item["start"]),
                                       unknown_since__isnull=True).update(uuid=item["uuid"])
    for item in report.get("errors", []):
        log.warning("node %s could not re-create MIG instance %s@%s on GPU %s: %s", node_name, item.get("profile"),
                    item.get("start"), item.get("gpu"), item.get("reason"))
    listed_ids = {d.device_id for d in listed}
    found = {(item["gpu"], int(item["start"])): item for item in report.get("unknown", [])
             if item.get("gpu") in listed_ids}
    unknown, uuid_of = [], {d.pk: d.device_id for d in gpus.values()}
    for row in rows:
        key = (uuid_of[row.parent_id], row.placement_start)
        item = found.get(key)
        if row.unknown_since is not None:
            if item is not None and item["profile"] == row.profile:
                row.uuid = item.get("uuid", row.uuid)
                row.save(update_fields=["uuid"])
                unknown.append(row)
                found.pop(key)
            else:
                row.delete()  # gone from the GPU (or replaced by another one, recorded below)
        elif item is not None and not gpu_instance_holds(row):
            row.delete()  # planned and idle, but the GPU holds another instance there
    taken = {(r.parent_id, r.placement_start) for r in GpuInstance.objects.filter(parent__in=listed)}
    for (gpu, start), item in sorted(found.items()):
        device = gpus[gpu]
        if (device.pk, start) in taken:
            log.warning("node %s: MIG instance %s@%s (%s) on GPU %s is not the manager's, but a session's instance "
                        "is planned there", node_name, item["profile"], start, item.get("uuid"), gpu)
            continue
        try:
            profile = device_mig_catalog(device).profile(item["profile"])
        except InvalidResourceRequest as exc:
            log.warning("node %s: unknown MIG instance on GPU %s skipped: %s", node_name, gpu, exc)
            continue
        unknown.append(GpuInstance.objects.create(
            node=node, parent=device, profile=profile.name, placement_start=start, placement_size=profile.size,
            memory_size=profile.memory, subproc_count=profile.sm_count_for(device.subproc_count),
            uuid=item.get("uuid", ""), unknown_since=now))
        log.warning("node %s: MIG instance %s@%s (%s) on GPU %s was not planned by the manager; its slices count as "
                    "taken until it is gone", node_name, profile.name, start, item.get("uuid"), gpu)
    return unknown
