"""Writes to the accelerator inventory: agent registration, device links, heartbeats, node liveness,
and administrators' changes of how a node's devices are shared."""

from __future__ import annotations

import logging
import secrets
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.dispatch import Signal
from django.utils import timezone

import protocol

from accelerators.allocation.topology import Link
from accelerators.models import Device, DeviceLink, FractionalSettings, Node, NodeStatus
from accelerators.plugins.base import DeviceInfo

log = logging.getLogger(__name__)

_MAX_LINK_COUNT = 32767  # DeviceLink.count is a PositiveSmallIntegerField

# Sent once the transaction commits after an administrator changed what a node can hold (its
# sharing settings, its pool, its MIG mode or layout), with `node`: room may have appeared for
# waiting sessions. The sessions app answers with a scheduler pass (sessions.apps), so that this
# app never imports it.
node_capacity_changed = Signal()

# Sent inside `node_mark_dead`'s transaction, with `node` (locked, LOST) and `reason`: the sessions
# app ends the node's sessions and answers how many (sessions.apps), so this app never imports it.
node_declared_dead = Signal()

# A node's settings an administrator changes to share its devices (the API's NodeSettingsSerializer
# and the admin form's "Sharing" fields).
SHARING_FIELDS = ("device_split_count", "memory_scaling", "core_scaling", "resource_group")


def node_settings_update(*, node: Node, changes: dict) -> Node:
    """Change `node`'s sharing settings (keys of SHARING_FIELDS: `device_split_count` sessions per
    GPU, `memory_scaling` and `core_scaling` as decimals, `resource_group` a ResourceGroup or
    None), validated by the caller, in one UPDATE of those columns, then `node_settings_saved`.
    The one write the API (PATCH /api/v1/nodes/<name>/) and the admin share. Returns `node`.
    Raises ValueError for a key that is not a sharing setting."""
    unknown = set(changes) - set(SHARING_FIELDS)
    if unknown:
        raise ValueError(f"not a node sharing setting: {', '.join(sorted(unknown))}")
    for name, value in changes.items():
        setattr(node, name, value)
    node.save(update_fields=list(changes))
    node_settings_saved(node=node, fields=changes)
    return node


def node_settings_saved(*, node: Node, fields) -> None:
    """After `fields` (names) of `node` were saved by an administrator, whoever saved them (the
    API, the admin form, the MIG settings): if what the node can hold changed (SHARING_FIELDS,
    `mig_mode`, `mig_layout`), send `node_capacity_changed` once the transaction commits."""
    if set(fields) & {*SHARING_FIELDS, "mig_mode", "mig_layout"}:
        transaction.on_commit(lambda: node_capacity_changed.send(sender=Node, node=node))


@transaction.atomic
def node_inventory_apply(
    *,
    node_name: str,
    devices: list[DeviceInfo],
    plugins: list[str],
    attributes: dict,
    cpu_count: int | None = None,
    memory_size: int | None = None,
    images: object = None,
    shared_storage: bool | None = None,
) -> Node:
    """Create or update node `node_name` and make its device rows match `devices` exactly.

    Devices are matched by (slot_name, device_id): known ones are updated in place (their
    allocations survive an agent restart), new ones created, vanished ones deleted unless a
    live allocation still holds them (then they are kept and a warning is logged). Every
    slot seen gets a FractionalSettings row with Backend.AI's defaults if it has none.
    `memory_size` in bytes. `images`: the session images the agent holds ({reference: image
    id}, `node_images_clean`); None (an agent from before images): the process runtime's
    "host". `shared_storage`: its data-root is a shared mount (protocol.messages.NodeStorage;
    None: left as it is). Marks the node ALIVE with a fresh heartbeat.
    """
    node, _ = Node.objects.select_for_update().get_or_create(name=node_name)
    node.status = NodeStatus.ALIVE
    node.last_heartbeat = timezone.now()
    node.plugins = list(plugins)
    node.attributes = dict(attributes)
    node.images = dict(protocol.HOST_IMAGES) if images is None else node_images_clean(node_name=node_name, images=images)
    if cpu_count is not None:
        node.cpu_count = cpu_count
    if memory_size is not None:
        node.memory_size = memory_size
    if shared_storage is not None:
        node.shared_storage = shared_storage
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
        device.mig_catalog = info.mig_catalog
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


@transaction.atomic
def node_links_apply(*, node: Node, links: list[dict]) -> None:
    """Make `node`'s device links match `links` exactly (rows not in `links` are deleted).

    `links`: `{"a": device_id, "b": device_id, "kind": "NVLINK", "count": 4}` as in
    `PluginInventory.links` (`count` defaults to 1; kinds and rules of
    `accelerators.allocation.topology.Link`). Device ids name the node's devices
    (`Device.device_id`); each pair is stored once, whatever order its ends come in.
    Apply the inventory first (`node_inventory_apply`), so that new devices exist.

    Raises ValueError, writing nothing, for ids the node does not have (all of them named),
    an id that names devices of two slots, a malformed link (unknown kind, lanes on a PCIe
    kind, more than 32767 lanes, a device linked to itself) or a pair given twice.
    """
    parsed = []
    for position, item in enumerate(links):
        try:
            link = Link.from_dict(item)
        except (ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"node {node.name}: links[{position}]: {exc}") from None
        if link.count > _MAX_LINK_COUNT:
            raise ValueError(f"node {node.name}: links[{position}]: {link.count} lanes is above {_MAX_LINK_COUNT}")
        parsed.append(link)

    # One writer of a node's links at a time (node_inventory_apply takes the same lock).
    list(Node.objects.select_for_update().filter(pk=node.pk).values_list("pk", flat=True))
    wanted = {end for link in parsed for end in (link.a, link.b)}
    devices: dict[str, Device] = {}
    ambiguous = set()
    for device in node.devices.filter(device_id__in=wanted):
        if device.device_id in devices:
            ambiguous.add(device.device_id)
        devices[device.device_id] = device
    unknown = sorted(wanted - devices.keys())
    if unknown:
        raise ValueError(f"node {node.name} has no devices {', '.join(unknown)}; cannot link them")
    if ambiguous:
        raise ValueError(f"node {node.name}: device ids {', '.join(sorted(ambiguous))} name devices of several slots")

    rows: dict[tuple, DeviceLink] = {}
    for link in parsed:
        first, second = sorted((devices[link.a], devices[link.b]), key=lambda d: (d.index, d.device_id))
        key = (first.pk, second.pk)
        if key in rows:
            raise ValueError(f"node {node.name}: {first.device_id} and {second.device_id} are linked twice")
        rows[key] = DeviceLink(node=node, device_a=first, device_b=second, kind=link.kind, count=link.count)
    DeviceLink.objects.filter(node=node).delete()
    DeviceLink.objects.bulk_create(rows.values())


def node_heartbeat(*, node_name: str) -> bool:
    """Record a heartbeat; a LOST node comes back ALIVE. False if the node never registered."""
    updated = Node.objects.filter(name=node_name).update(last_heartbeat=timezone.now(), status=NodeStatus.ALIVE)
    return updated == 1


def node_images_clean(*, node_name: str, images) -> dict[str, str]:
    """An agent's report of the session images it holds, as stored in `Node.images`: `{reference:
    image id}` with text keys of at most protocol.MAX_IMAGE_REFERENCE characters and text values;
    anything else is dropped and logged, and past protocol.MAX_IMAGES references the rest (in
    sorted order) too."""
    if not isinstance(images, dict):
        log.warning("node %s reported images that are not an object (%s): taken as none", node_name, type(images).__name__)
        return {}
    clean = {
        ref: ident
        for ref, ident in images.items()
        if isinstance(ref, str)
        and isinstance(ident, str)
        and 0 < len(ref) <= protocol.MAX_IMAGE_REFERENCE
        and "\x00" not in ref + ident
    }
    if len(clean) < len(images):
        log.warning("node %s reported %d unusable image reference(s): dropped", node_name, len(images) - len(clean))
    if len(clean) > protocol.MAX_IMAGES:
        log.warning("node %s reported %d images; kept the first %d", node_name, len(clean), protocol.MAX_IMAGES)
        clean = dict(sorted(clean.items())[: protocol.MAX_IMAGES])
    return clean


def node_images_apply(*, node_name: str, images) -> bool:
    """Store the session images a heartbeat says `node_name` holds (`node_images_clean`).
    Returns whether they changed (then pending sessions waiting for an image may be placed)."""
    clean = node_images_clean(node_name=node_name, images=images)
    return Node.objects.filter(name=node_name).exclude(images=clean).update(images=clean) == 1


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


@transaction.atomic
def node_mark_dead(*, node_name: str, by: str) -> int:
    """An administrator (`by`: their username) declares LOST node `node_name` dead: its processes
    are gone (the machine is off, reinstalled, unplugged), so its sessions end and their devices
    are released at once instead of waiting for its agent or FGPU_FENCE_TIMEOUT_SECONDS (issue
    33's fencing; as Slurm's `scontrol update NodeName=… State=DOWN` ends a node's jobs). The node
    stays LOST until its agent registers again, when whatever still runs there is stopped.
    Returns how many sessions ended (`node_declared_dead`'s receivers). Raises Node.DoesNotExist
    for an unknown node, ApplicationError 409 "node-alive" for a node that is not LOST (its agent
    reports what runs: no one may overrule it)."""
    from common.errors import ApplicationError

    node = Node.objects.select_for_update().get(name=node_name)
    if node.status != NodeStatus.LOST:
        raise ApplicationError(
            f"node {node_name} is {node.status}: only a LOST node can be marked dead (its agent reports what it runs)",
            type="node-alive",
            title="Node alive",
            status=409,
        )
    reason = f"node {node_name} was marked dead by {by}: its processes are assumed gone"
    log.warning("%s", reason)
    return sum(int(ended or 0) for _, ended in node_declared_dead.send(sender=Node, node=node, reason=reason))


def node_agent_key_rotate(*, node_name: str) -> str:
    """A new key for `node_name`'s agent to sign its messages with (agent.toml `[manager]
    node-key`); the old one stops working at once. A node not registered yet is created LOST,
    without devices, so keys can be handed out before the agents start. Returns the key."""
    key = secrets.token_urlsafe(32)
    node, _ = Node.objects.get_or_create(name=node_name, defaults={"status": NodeStatus.LOST})
    Node.objects.filter(pk=node.pk).update(agent_key=key)
    return key


def node_message_verify(*, node_name: str, task: str, kwargs: dict, node: Node | None = None) -> bool:
    """Whether a message an agent sent as `node_name` may be applied: signed with the node's
    key (protocol.sign) when it has one; unsigned only for a node without a key, and only while
    FGPU_REQUIRE_NODE_KEYS is off. A refusal is logged (a warning naming the node and task).
    `node`: that node's row where the caller read it already (its key is taken from it, no query)."""
    if node is not None and node.name == node_name:
        key = node.agent_key or ""
    else:
        key = Node.objects.filter(name=node_name).values_list("agent_key", flat=True).first() or ""
    if key:
        if protocol.verify(key, task, kwargs, kwargs.get(protocol.SIGNATURE)):
            return True
        log.warning("refused %s claiming to come from node %s: its signature does not verify", task, node_name)
        return False
    if settings.FGPU_REQUIRE_NODE_KEYS:
        log.warning("refused %s from node %s: the node has no agent key and FGPU_REQUIRE_NODE_KEYS is on", task, node_name)
        return False
    return True
