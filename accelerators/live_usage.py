"""Live usage as the allocator counts it (issue 35.1 moved it here from accelerators.selectors,
which re-exports it): what live allocations hold of each device and what active sessions hold
of each node, as annotations, and a device row as the allocator's `core.DeviceState`. The one
computation both the database reads (`accelerators.selectors.node_states`) and the kept view
(`accelerators.cluster_view`) use."""

from __future__ import annotations

from decimal import Decimal

from django.db.models import Count, Q, Sum

import protocol
from accelerators.allocation import core

_LIVE = Q(allocations__released_at__isnull=True)


def devices_with_usage(devices):
    """Annotate a Device queryset with live usage: `memory_used` (bytes), `proc_used` (SMs),
    `shares_used` (fGPU), `session_count`."""
    return devices.annotate(
        memory_used=Sum("allocations__memory", filter=_LIVE, default=0),
        proc_used=Sum("allocations__procs", filter=_LIVE, default=Decimal(0)),
        shares_used=Sum("allocations__shares", filter=_LIVE, default=Decimal(0)),
        session_count=Count("allocations", filter=_LIVE),
    )


def device_state(device) -> core.DeviceState:
    """A Device annotated by `devices_with_usage` (its node loaded) → the allocator's
    DeviceState (id = pk text): totals scaled by the node's memory/core scaling, the node's
    split count as `max_sessions`. A Device not annotated is read as nothing used."""
    node = device.node
    return core.DeviceState(
        device_id=str(device.pk),
        memory_total=int(Decimal(device.memory_size) * node.memory_scaling),
        proc_total=int(Decimal(device.subproc_count) * node.core_scaling),
        memory_used=int(getattr(device, "memory_used", 0) or 0),
        proc_used=Decimal(getattr(device, "proc_used", 0) or 0),
        sessions=int(getattr(device, "session_count", 0) or 0),
        numa_node=device.numa_node,
        max_sessions=node.device_split_count,
        uuid=device.device_id,
        index=device.index,
        memory_physical=device.memory_size,
        proc_physical=device.subproc_count,
    )


def nodes_with_usage(nodes):
    """Annotate a Node queryset with what its active sessions (`protocol.SESSION_ACTIVE_STATES`)
    hold: `cpu_used` (cores) and `mem_used` (bytes), 0 for none. The one computation of a
    node's CPU and memory in use: the allocator's nodes (`node_states`) and the MIG choice's
    rooms (`sessions.scheduling.mig`) both read it. Not with `select_for_update` (PostgreSQL
    locks no aggregate): lock first, then read."""
    active = Q(sessions__status__in=protocol.SESSION_ACTIVE_STATES)
    return nodes.annotate(
        cpu_used=Sum("sessions__cpu", filter=active, default=0), mem_used=Sum("sessions__mem", filter=active, default=0)
    )
