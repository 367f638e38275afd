"""What the launch dialog may offer now: per slot the quantum and the largest placeable amount."""
from __future__ import annotations

from decimal import Decimal

from accelerators.allocation import core
from accelerators.models import AllocationMode, Device
from accelerators.selectors import (
    fractional_settings_get,
    node_states,
    placement_scope,
    slot_format_get,
)
from accelerators.allocation.errors import InsufficientResource, NeverSchedulable
from sessions.quotas import quota_headroom
from sessions.selectors import request_configuration
from sessions.services import request_validate
from sessions.runtime.environment import shares_text, sm_percent


def launch_options(*, user=None) -> dict:
    """`{"slots": [...], "cpu": {"max_now", "max_ever"}, "mem": {...}}`: for each slot with
    registered devices, min/step = the quantum, `max_now` = the largest amount one session could
    be given right now (a request may span one node's devices), `max_ever` = the same on empty
    nodes; with `user`, `max_now` is also capped by their quota headroom. Amounts as text;
    memory in bytes."""
    slots = []
    all_nodes: list[core.NodeState] = []
    headroom = quota_headroom(user=user) if user is not None else {}
    for slot_name in sorted(set(Device.objects.filter(is_mig_device=False).values_list("slot_name", flat=True))):
        every = node_states(slot_name=slot_name)
        all_nodes = all_nodes or every
        nodes = [n for n in every if n.cpu_total - n.cpu_used >= 1]  # a session needs at least one core
        settings = fractional_settings_get(slot_name=slot_name)
        if settings.allocation_mode == AllocationMode.FRACTIONAL:
            pure = settings.as_allocation_settings()
            subtype, quantum = "shares", Decimal(settings.quantum_size).normalize()
            max_now, max_ever = core.max_shares(nodes, pure), core.max_shares(core.emptied(every), pure)
            quota = headroom.get("fgpu")
            if quota is not None:  # the slider never offers more than the user's quotas allow
                max_now = min(max_now, core.truncate(Decimal(quota), pure.quantum))
        else:
            subtype, quantum = "device", Decimal(1)
            max_now, max_ever = Decimal(core.max_devices(nodes)), Decimal(core.max_devices(core.emptied(every)))
            quota = headroom.get("devices")
            if quota is not None:
                max_now = min(max_now, Decimal(quota))
        fmt = slot_format_get(slot_name=slot_name, subtype=subtype)
        slots.append({
            "slot": f"{slot_name}.{subtype}", "slot_name": slot_name, "subtype": subtype,
            "allocation_mode": settings.allocation_mode, "display_unit": fmt.display_unit,
            "display_icon": fmt.display_icon, "human_readable_name": fmt.human_readable_name,
            "binary": fmt.number_binary, "round_length": fmt.number_round_length,
            "quantum": str(quantum), "min": str(quantum), "step": str(quantum),
            "max_now": shares_text(str(max_now)) if subtype == "shares" else str(max_now),
            "max_ever": shares_text(str(max_ever)) if subtype == "shares" else str(max_ever),
            "unit_mem": settings.unit_mem, "unit_proc": settings.unit_proc,
        })
    if not all_nodes:
        all_nodes = node_states(slot_name="cuda")
    return {
        "slots": slots,
        "cpu": {"max_now": max((n.cpu_total - n.cpu_used for n in all_nodes), default=0),
                "max_ever": max((n.cpu_total for n in all_nodes), default=0)},
        "mem": {"max_now": max((n.mem_total - n.mem_used for n in all_nodes), default=0),
                "max_ever": max((n.mem_total for n in all_nodes), default=0)},
    }


def launch_preview(*, resources: dict) -> dict:
    """What a request would get now, without creating anything: `{"fits_now", "never",
    "reason", "node", "configuration", "devices": [{"device", "device_index", "model_name",
    "memory" (bytes), "procs" (SMs), "sm_percent", "shares"}]}`. Raises ApplicationError for a
    malformed request (the same checks as session_create)."""
    request, settings = request_validate(resources=resources)
    configuration = request_configuration(request)
    result = {"fits_now": False, "never": False, "reason": "", "node": None, "configuration": configuration,
              "devices": []}
    try:
        nodes, options = placement_scope(request=request)
        placement = core.place(nodes, request, settings, **options)
    except NeverSchedulable as exc:
        return {**result, "never": True, "reason": str(exc)}
    except InsufficientResource as exc:
        return {**result, "reason": str(exc)}
    devices = {str(d.pk): d for d in Device.objects.filter(pk__in=[g.device_id for g in placement.grants])}
    result.update(fits_now=True, node=placement.node_id)
    for grant in placement.grants:
        device = devices[grant.device_id]
        result["devices"].append({
            "device": device.device_id, "device_index": device.index, "model_name": device.model_name,
            "memory": grant.memory, "procs": format(grant.procs.normalize(), "f"),
            "sm_percent": sm_percent({"procs": grant.procs, "subproc_count": device.subproc_count}),
            "shares": shares_text(str(grant.shares)),
        })
    return result
