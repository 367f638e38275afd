"""Writes to the accelerator inventory: agent registration, heartbeats, node liveness."""
from __future__ import annotations

import logging
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from accelerators.models import Device, FractionalSettings, Node, NodeStatus
from accelerators.plugins.base import DeviceInfo

log = logging.getLogger(__name__)


@transaction.atomic
def node_inventory_apply(
    *,
    node_name: str,
    devices: list[DeviceInfo],
    plugins: list[str],
    attributes: dict,
    cpu_count: int | None = None,
    memory_size: int | None = None,
) -> Node:
    """Create or update node `node_name` and make its device rows match `devices` exactly.

    Devices are matched by (slot_name, device_id): known ones are updated in place (their
    allocations survive an agent restart), new ones created, vanished ones deleted unless a
    live allocation still holds them (then they are kept and a warning is logged). Every
    slot seen gets a FractionalSettings row with Backend.AI's defaults if it has none.
    `memory_size` in bytes. Marks the node ALIVE with a fresh heartbeat.
    """
    node, _ = Node.objects.select_for_update().get_or_create(name=node_name)
    node.status = NodeStatus.ALIVE
    node.last_heartbeat = timezone.now()
    node.plugins = list(plugins)
    node.attributes = dict(attributes)
    if cpu_count is not None:
        node.cpu_count = cpu_count
    if memory_size is not None:
        node.memory_size = memory_size
    node.save()

    existing = {(d.slot_name, d.device_id): d for d in node.devices.all()}
    seen: dict[tuple[str, str], Device] = {}
    for info in sorted(devices, key=lambda i: i.is_mig_device):  # parents before their MIG slices
        key = (info.slot_name, info.device_id)
        device = existing.get(key) or Device(node=node, slot_name=info.slot_name, device_id=info.device_id)
        device.index = info.index
        device.mother_uuid = info.mother_uuid
        device.model_name = info.model_name
        device.numa_node = info.numa_node
        device.subproc_count = info.subproc_count
        device.memory_size = info.memory_size
        device.is_mig_device = info.is_mig_device
        device.mig_profile = info.mig_profile
        device.parent = seen.get((info.slot_name, info.parent_device_id)) if info.parent_device_id else None
        device.save()
        seen[key] = device
    for key, device in existing.items():
        if key in seen:
            continue
        if device.allocations.filter(released_at__isnull=True).exists():
            log.warning("node %s no longer reports %s, which live sessions hold; keeping it", node_name, key)
            continue
        device.delete()
    for slot_name in {i.slot_name for i in devices}:
        FractionalSettings.objects.get_or_create(slot_name=slot_name)
    return node


def node_heartbeat(*, node_name: str) -> bool:
    """Record a heartbeat; a LOST node comes back ALIVE. False if the node never registered."""
    updated = Node.objects.filter(name=node_name).update(last_heartbeat=timezone.now(), status=NodeStatus.ALIVE)
    return updated == 1


def node_mark_lost(*, timeout_s: int) -> list[str]:
    """Mark ALIVE nodes whose last heartbeat is older than `timeout_s` seconds LOST (compare-
    and-set, so a heartbeat that lands meanwhile wins). Returns the names marked."""
    cutoff = timezone.now() - timedelta(seconds=timeout_s)
    stale = list(Node.objects.filter(status=NodeStatus.ALIVE, last_heartbeat__lt=cutoff).values_list("name", flat=True))
    lost = []
    for name in stale:
        if Node.objects.filter(name=name, status=NodeStatus.ALIVE, last_heartbeat__lt=cutoff).update(status=NodeStatus.LOST):
            lost.append(name)
            log.warning("node %s missed heartbeats for %ss: marked LOST", name, timeout_s)
    return lost
