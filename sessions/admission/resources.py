"""What a user can get, at a glance (issue 18.1, the sessions page's "My resources" panel and
`GET /api/v1/my-resources/`): their fGPU, GPU memory and sessions in use against the quota that
binds them, and the capacity free by resource group. Reads only; counting rules as
`sessions.policy.quotas` (one claim rule for the launch, the preview and this panel)."""

from __future__ import annotations

from decimal import Decimal

from accelerators.allocation import core
from accelerators.fleet import mig_capacity
from accelerators.models import AllocationMode, Node, NodeStatus, ResourceGroup
from accelerators.selectors import fractional_settings_get, node_states
from sessions.policy.quotas import fgpu_text, quota_label, quota_usage, quota_usage_of
from sessions.models import Quota
from sessions import usage_reads

FIGURES = ("fgpu", "gpu_memory", "sessions")  # what the panel shows of a user's usage


def my_resources(*, user, slot_name: str = "cuda") -> dict:
    """`{"usage": [{"key": "fgpu" | "gpu_memory" | "sessions", "used", "limit", "left", "quota"}],
    "groups": [{"name", "nodes", "nodes_alive", "allocation_mode", "free", "total", "memory_free",
    "memory_total", "mig_gpus", "mig_free", "mig_total"}]}` for `user`.

    `usage`: per figure, what the user holds (their own sessions: fGPU as text "0.50", GPU memory
    in bytes, sessions running or waiting) and, where a quota limits it, the binding quota (the
    one with the least left): its `limit`, what is `left` (never below 0) and `quota`, how a
    refusal names it ("your quota", 'quota of project "vision"'); those three null without one.
    `used` then counts that quota's subjects (a project's: all its members).

    `groups`: "" (every node: a request naming no group may go to any) and then each resource
    group by name: its registered and alive nodes, and for slot `slot_name` on the alive nodes
    the fGPU free and in all (`allocation_mode` "fractional", text "3.25") or the idle and all
    whole GPUs (discrete, integers), and device memory free and in all (bytes), these over the
    GPUs that serve no MIG; the GPUs that serve MIG instead (a node in dynamic or fixed MIG mode,
    MIG slices in the inventory) as `mig_gpus`, and their free and all MIG compute slices
    (`mig_free`, `mig_total`: 7 a GPU; `accelerators.fleet.mig_capacity`).

    `storage`: the user's data folders (`~/data`, each project's `~/projects/<name>`) per node, as
    its agent last measured them against the limit it enforces (usage.selectors.folder_use_list, read
    through sessions.usage_reads)."""
    own = quota_usage_of(quota=Quota(user=user))
    usages = quota_usage(user=user)
    figures = []
    for key in FIGURES:
        binding = None
        for usage in usages:
            left = usage.remaining()[key]
            if left is not None and (binding is None or left < binding[1]):
                binding = (usage, left)
        used = getattr(binding[0] if binding else own, key)
        limit = None if binding is None else getattr(binding[0].quota, f"max_{key}")
        figures.append(
            {
                "key": key,
                "used": _figure(key, used),
                "limit": None if limit is None else _figure(key, limit),
                "left": None if binding is None else _figure(key, binding[1]),
                "quota": None if binding is None else quota_label(binding[0].quota, user=user),
            }
        )
    return {"usage": figures, "groups": _groups(slot_name), "storage": usage_reads.reads.folder_use(user=user)}


def _figure(key: str, value) -> str | int:
    return fgpu_text(Decimal(value)) if key == "fgpu" else int(value)


def _groups(slot_name: str) -> list[dict]:
    settings = fractional_settings_get(slot_name=slot_name)
    fractional = settings.allocation_mode == AllocationMode.FRACTIONAL
    pure = settings.as_allocation_settings() if fractional else None
    rows = []
    mig_nodes = mig_capacity(nodes=Node.objects.filter(status=NodeStatus.ALIVE))
    for group in [None, *ResourceGroup.objects.order_by("name")]:
        mig = [n for n in mig_nodes if group is None or n.resource_group == group.name]
        nodes = Node.objects.all() if group is None else Node.objects.filter(resource_group=group)
        alive = node_states(slot_name=slot_name, group=group)
        devices = [d for n in alive for d in n.devices]
        free: str | int
        total: str | int
        if pure is not None:  # fractional
            free = fgpu_text(sum((core.device_free_shares(d, pure) for d in devices), Decimal(0)))
            total = fgpu_text(
                sum(
                    (
                        core.device_capacity(memory_size=d.memory_total, subproc_count=d.proc_total, settings=pure)
                        for d in devices
                    ),
                    Decimal(0),
                )
            )
        else:
            free, total = sum(1 for d in devices if d.is_idle), len(devices)
        rows.append(
            {
                "name": group.name if group else "",
                "nodes": nodes.count(),
                "nodes_alive": nodes.filter(status=NodeStatus.ALIVE).count(),
                "allocation_mode": settings.allocation_mode,
                "free": free,
                "total": total,
                "memory_free": sum(max(0, d.memory_total - d.memory_used) for d in devices),
                "memory_total": sum(d.memory_total for d in devices),
                "mig_gpus": sum(1 for n in mig for g in n.gpus if g.kind == "mig"),
                "mig_free": sum(n.mig_free for n in mig),
                "mig_total": sum(n.mig_total for n in mig),
            }
        )
    return rows
