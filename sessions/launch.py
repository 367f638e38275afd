"""What the launch dialog may offer now: per slot the quantum and the largest placeable amount."""
from __future__ import annotations

from decimal import Decimal

from accelerators.allocation import core
from accelerators.models import AllocationMode, Device
from accelerators.selectors import fractional_settings_get, node_states, slot_format_get


def launch_options() -> dict:
    """`{"slots": [...], "cpu": {"max_now", "max_ever"}, "mem": {...}}`: for each slot with
    registered devices, min/step = the quantum, `max_now` = the largest amount one session could
    be given right now (a request may span one node's devices), `max_ever` = the same on empty
    nodes. Amounts as text; memory in bytes."""
    slots = []
    all_nodes: list[core.NodeState] = []
    for slot_name in sorted(set(Device.objects.filter(is_mig_device=False).values_list("slot_name", flat=True))):
        every = node_states(slot_name=slot_name)
        all_nodes = all_nodes or every
        nodes = [n for n in every if n.cpu_total - n.cpu_used >= 1]  # a session needs at least one core
        settings = fractional_settings_get(slot_name=slot_name)
        if settings.allocation_mode == AllocationMode.FRACTIONAL:
            pure = settings.as_allocation_settings()
            subtype, quantum = "shares", Decimal(settings.quantum_size).normalize()
            max_now, max_ever = core.max_shares(nodes, pure), core.max_shares(core.emptied(every), pure)
        else:
            subtype, quantum = "device", Decimal(1)
            max_now, max_ever = Decimal(core.max_devices(nodes)), Decimal(core.max_devices(core.emptied(every)))
        fmt = slot_format_get(slot_name=slot_name, subtype=subtype)
        slots.append({
            "slot": f"{slot_name}.{subtype}", "slot_name": slot_name, "subtype": subtype,
            "allocation_mode": settings.allocation_mode, "display_unit": fmt.display_unit,
            "display_icon": fmt.display_icon, "human_readable_name": fmt.human_readable_name,
            "binary": fmt.number_binary, "round_length": fmt.number_round_length,
            "quantum": str(quantum), "min": str(quantum), "step": str(quantum),
            "max_now": str(max_now), "max_ever": str(max_ever),
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
