"""Accelerator configuration: slot formats, fractional settings, nodes, their devices and links.

Terms follow Backend.AI: a *slot name* is the accelerator family (`cuda`, `rocm`), a
*subtype* is how it is counted (`device` whole devices, `shares` fGPU, `*-mig` MIG slices).
Memory is in bytes, compute in sub-processors (SMs), fGPU amounts are `Decimal`.
"""

from __future__ import annotations

import uuid
from decimal import Decimal

from django.core.validators import MinValueValidator
from django.db import models

import protocol
from accelerators.allocation import cluster, topology
from protocol import units

GiB = 1 << 30
MiB = 1 << 20


class SlotFormat(models.Model):
    """How amounts of one slot subtype are shown ("0.50 fGPU", "2 GPU").

    Fields as in Backend.AI's mock-accelerator `[formats.<subtype>]` tables. `number_binary`
    picks 2^(10n) suffixes (KiB, MiB) over 10^(3n); `number_round_length` is the count of
    fixed-point digits (0: integer).
    """

    slot_name = models.CharField(max_length=32, help_text="Accelerator family: cuda, rocm, …")
    subtype = models.CharField(
        max_length=32, help_text='"device" (discrete mode), "shares" (fractional mode) or "*-mig" (MIG slices)'
    )
    display_icon = models.CharField(max_length=32, default="gpu1")
    display_unit = models.CharField(max_length=32, default="GPU")
    human_readable_name = models.CharField(max_length=64, default="GPU")
    description = models.CharField(max_length=255, blank=True)
    number_binary = models.BooleanField("binary", default=False)
    number_round_length = models.PositiveSmallIntegerField("round length", default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["slot_name", "subtype"], name="slotformat_unique_subtype")]
        ordering = ["slot_name", "subtype"]

    def __str__(self) -> str:
        return f"{self.slot_name}.{self.subtype} ({self.display_unit})"

    @property
    def slot_key(self) -> str:
        return f"{self.slot_name}.{self.subtype}"

    def format_amount(self, amount: Decimal | int) -> str:
        """`amount` in this subtype's unit → display text, e.g. Decimal("0.5") → "0.50 fGPU"."""
        number = units.format_number(Decimal(amount), binary=self.number_binary, round_length=self.number_round_length)
        return f"{number} {self.display_unit}"


class AllocationMode(models.TextChoices):
    DISCRETE = "discrete", "discrete (whole devices)"
    FRACTIONAL = "fractional", "fractional (fGPU shares)"


class FractionalSettings(models.Model):
    """Per-slot fractional settings (Backend.AI keeps these in etcd under
    `config/plugins/accelerator/<slot>`; defaults and minimums are Backend.AI's).

    1.0 fGPU = `unit_mem` bytes and `unit_proc` SMs. A device's capacity in fGPU is
    min(memory / unit_mem, subproc_count / unit_proc), truncated to 2 decimals.
    """

    slot_name = models.CharField(max_length=32, unique=True)
    allocation_mode = models.CharField(max_length=16, choices=AllocationMode.choices, default=AllocationMode.DISCRETE)
    unit_mem = models.BigIntegerField(
        "memory in 1.0 fGPU",
        default=2 * GiB,
        validators=[MinValueValidator(512 * MiB)],
        help_text="bytes of device memory in 1.0 fGPU",
    )
    unit_proc = models.PositiveIntegerField(
        "SMs in 1.0 fGPU", default=8, validators=[MinValueValidator(2)], help_text="sub-processors (SMs) in 1.0 fGPU"
    )
    quantum_size = models.DecimalField(
        "quantum",
        max_digits=6,
        decimal_places=3,
        default=Decimal("0.1"),
        validators=[MinValueValidator(Decimal("0.001"))],
        help_text="smallest step of an fGPU request",
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "fractional settings"
        verbose_name_plural = "fractional settings"

    def __str__(self) -> str:
        return f"{self.slot_name}: {self.allocation_mode}"

    @property
    def is_fractional(self) -> bool:
        return self.allocation_mode == AllocationMode.FRACTIONAL

    def as_allocation_settings(self):
        from accelerators.allocation.core import FractionalSettings as Pure

        return Pure(unit_mem=self.unit_mem, unit_proc=self.unit_proc, quantum=self.quantum_size)


PLACEMENT_POLICIES = [(name, name) for name in cluster.POLICIES]


class ResourceGroup(models.Model):
    """A node pool with its placement rules (Backend.AI's scaling groups, HAMi's scheduler
    policies). A session naming a group in `resources.resource_group` goes to its nodes under
    its rules; one naming none may go to any node, under the rules of the group "default".

    Device scores for `binpack` / `spread` combine how full a device would be in memory, SMs
    and sessions, each weighted (as HAMi scores devices); `no_fragmentation` refuses fGPU splits
    that would leave more than one device partly used (Backend.AI's guard)."""

    name = models.SlugField(max_length=64, unique=True)
    description = models.CharField(max_length=255, blank=True)
    policy = models.CharField(
        max_length=16,
        choices=PLACEMENT_POLICIES,
        default="fgd-plus",
        help_text="how nodes are chosen: binpack, spread, best-fit, fgd (fragmentation gradient "
        "descent, Weng et al. ATC'23) or fgd-plus (the default: FGD plus GPU "
        "stranded by CPU/memory, "
        "a best-fit term and GPU-model pressure)",
    )
    weight_memory = models.DecimalField(
        "memory weight", max_digits=5, decimal_places=2, default=Decimal("1"), validators=[MinValueValidator(Decimal("0"))]
    )
    weight_cores = models.DecimalField(
        "SM weight", max_digits=5, decimal_places=2, default=Decimal("1"), validators=[MinValueValidator(Decimal("0"))]
    )
    weight_sessions = models.DecimalField(
        "sessions weight", max_digits=5, decimal_places=2, default=Decimal("1"), validators=[MinValueValidator(Decimal("0"))]
    )
    no_fragmentation = models.BooleanField("no fragmentation", default=False)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class PlacementShape(models.Model):
    """How many sessions of one request shape the scheduler has placed in a resource group
    (`resource_group` is the group's name, "" for requests naming none): the workload
    distribution p that fragmentation-aware policies (fgd, fgd-plus) weigh by. `key` is the
    shape in the allocator's index units (`sessions.scheduling.scheduler.shape_key`)."""

    resource_group = models.CharField(max_length=64, blank=True)
    key = models.CharField(max_length=200)
    count = models.PositiveBigIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["resource_group", "key"], name="placement_shape_unique")]

    def __str__(self) -> str:
        return f"{self.resource_group or '(any)'} {self.key}: {self.count}"


class NodeStatus(models.TextChoices):
    ALIVE = "ALIVE"
    LOST = "LOST"


class MigMode(models.TextChoices):
    """How a node's MIG-capable GPUs are used (set by an administrator)."""

    OFF = "off", "off (whole GPUs and fGPU shares)"
    STATIC = "static", "static (the MIG slices its inventory declares or NVML finds)"
    DYNAMIC = "dynamic", "dynamic (instances created on demand, torn down lazily)"
    FIXED = "fixed", "fixed layout (the administrator's layout, created at agent start)"


def host_images() -> dict:
    """What a node holds when its agent reports no images: the process runtime's built-in "host"
    image (protocol.HOST_IMAGES)."""
    return dict(protocol.HOST_IMAGES)


class Node(models.Model):
    """One GPU node, i.e. one agent. Registered and kept alive by its agent's heartbeats."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=128, unique=True, help_text="the agent id from agent.toml")
    status = models.CharField(max_length=8, choices=NodeStatus.choices, default=NodeStatus.ALIVE)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    registered_at = models.DateTimeField(auto_now_add=True)
    cpu_count = models.PositiveIntegerField("CPU cores", default=1, help_text="CPU cores sessions may use")
    memory_size = models.BigIntegerField("main memory", default=0, help_text="bytes of main memory sessions may use")
    plugins = models.JSONField(default=list, blank=True, help_text="compute plugins the agent loaded")
    attributes = models.JSONField(default=dict, blank=True, help_text="driver and runtime versions reported by the agent")
    images = models.JSONField(
        default=host_images,
        blank=True,
        editable=False,
        help_text="the session images the agent reports holding: {reference: image id} (docker runtime: its local "
        'images\' tags and repository digests, as Docker lists them; process runtime: the built-in "host")',
    )
    shared_storage = models.BooleanField(
        default=False,
        editable=False,
        help_text="its agent's data-root is a shared mount (NFS, CephFS, …) every node saying so mounts alike "
        "(agent.toml [storage] shared, reported at registration); false: the node's own disk, so the data "
        "folders its sessions see are local to it",
    )
    resource_group = models.ForeignKey(
        ResourceGroup,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="nodes",
        help_text="node pool; empty: the default pool",
    )
    device_split_count = models.PositiveIntegerField(
        default=10,
        validators=[MinValueValidator(1)],
        help_text="the most sessions one device may host (HAMi's deviceSplitCount, default 10)",
    )
    memory_scaling = models.DecimalField(
        max_digits=5,
        decimal_places=2,
        default=Decimal("1"),
        validators=[MinValueValidator(Decimal("0.1"))],
        help_text="device memory is accounted as memory × this; above 1 is deliberate over-subscription "
        "(HAMi's deviceMemoryScaling)",
    )
    core_scaling = models.DecimalField(
        max_digits=5,
        decimal_places=2,
        default=Decimal("1"),
        validators=[MinValueValidator(Decimal("0.1"))],
        help_text="device SMs are accounted as SMs × this; above 1 is deliberate over-subscription (HAMi's deviceCoreScaling)",
    )
    mig_mode = models.CharField(
        "MIG mode",
        max_length=8,
        choices=MigMode.choices,
        default=MigMode.OFF,
        help_text="static: MIG slices are whole devices asked for by profile; dynamic: a MIG request gets the "
        "smallest instance that fits, created on demand; fixed: the layout below, kept as it is",
    )
    mig_layout = models.JSONField(
        "fixed MIG layout",
        default=dict,
        blank=True,
        help_text='for mode "fixed": {"<GPU device id or index>": [{"profile": "3g.40gb", "start": 0}, …]}',
    )
    agent_key = models.CharField(
        "agent key",
        max_length=64,
        blank=True,
        editable=False,
        help_text="the key the node's agent signs its messages with (manage.py node_key); empty: its messages are "
        "not authenticated (refused altogether when FGPU_REQUIRE_NODE_KEYS is on)",
    )
    mig_sync = models.JSONField(
        "MIG layout sync",
        default=dict,
        blank=True,
        editable=False,
        help_text="the last MIG layout the manager sent the node's agent and what the agent reported applying "
        "(accelerators.mig_services.node_mig_push: state, seq, pending, destroy, errors, times)",
    )
    mig_drift = models.JSONField(
        default=dict,
        blank=True,
        editable=False,
        help_text="heartbeat digest bookkeeping: a mismatch between the agent's MIG layout digest and the "
        "expected one seen once, and the last one a full reconcile was asked for",
    )

    drain_since = models.DateTimeField(
        "draining since",
        null=True,
        blank=True,
        editable=False,
        help_text="set while an administrator drains the node (accelerators.drain.node_drain): no new session is "
        "placed on it; empty: in service",
    )
    drain_evict = models.BooleanField(
        "evict on drain",
        default=False,
        editable=False,
        help_text="the drain evicts: its running sessions get the preemption notice and grace, then are stopped "
        "and requeued; off: they run to their end",
    )
    drain_reason = models.CharField("drain reason", max_length=200, blank=True, editable=False)
    drain_by = models.CharField("drained by", max_length=150, blank=True, editable=False)

    class Meta:
        ordering = ["name"]

    @property
    def is_draining(self) -> bool:
        """Whether an administrator drains the node (drained included: none of its sessions left)."""
        return self.drain_since is not None

    @property
    def is_oversubscribed(self) -> bool:
        return self.memory_scaling > 1 or self.core_scaling > 1

    def __str__(self) -> str:
        return self.name


class Device(models.Model):
    """One accelerator device of a node: a whole GPU or a MIG slice (`is_mig_device`).

    `memory_size` in bytes, `subproc_count` in SMs (compute units). `device_id` is the
    agent's stable id for it (the GPU UUID on real nodes); MIG slices point to their parent
    GPU when the inventory declares it, and always share its `mother_uuid`.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="devices")
    slot_name = models.CharField(max_length=32, default="cuda")
    device_id = models.CharField("device ID", max_length=128, help_text="agent-side id: the GPU (or MIG) UUID")
    index = models.PositiveIntegerField(default=0, help_text="order on the node, as nvidia-smi numbers GPUs")
    mother_uuid = models.CharField("mother UUID", max_length=128)
    model_name = models.CharField("model", max_length=128)
    numa_node = models.IntegerField("NUMA node", null=True, blank=True)
    subproc_count = models.PositiveIntegerField("SMs", help_text="SMs (compute units)")
    memory_size = models.BigIntegerField("memory", help_text="bytes")
    is_mig_device = models.BooleanField("MIG device", default=False)
    parent = models.ForeignKey("self", null=True, blank=True, on_delete=models.CASCADE, related_name="mig_devices")
    mig_profile = models.CharField("MIG profile", max_length=32, blank=True)
    mig_catalog = models.JSONField(
        "MIG catalog", default=dict, blank=True, help_text="MIG profiles NVML reported for this GPU (empty: the built-in table)"
    )

    class Meta:
        constraints = [models.UniqueConstraint(fields=["node", "slot_name", "device_id"], name="device_unique_per_node")]
        ordering = ["node__name", "slot_name", "index"]

    def __str__(self) -> str:
        return f"{self.node.name}/{self.slot_name}:{self.index} {self.model_name}"


class DeviceLink(models.Model):
    """A link between two devices of one node, as its agent reported it (or the mock
    inventory's `links` table declared it), in nvidia-smi topo's terms: NVLink or MetaXLink
    with `count` lanes, or how PCIe joins them (PIX, PXB, PHB, NODE, SYS; see
    `accelerators.allocation.topology`). One row per pair: `device_a` is the pair's device
    that comes first in the node's order (index, then device id).
    """

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="device_links")
    device_a = models.ForeignKey(Device, on_delete=models.CASCADE, related_name="+")
    device_b = models.ForeignKey(Device, on_delete=models.CASCADE, related_name="+")
    kind = models.CharField(max_length=16, choices=[(kind, topology.KIND_LABELS[kind]) for kind in topology.KINDS])
    count = models.PositiveSmallIntegerField(
        default=1, validators=[MinValueValidator(1)], help_text="NVLink / MetaXLink lanes; 1 for the PCIe kinds"
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["device_a", "device_b"], name="devicelink_unique_pair"),
            models.CheckConstraint(condition=~models.Q(device_a=models.F("device_b")), name="devicelink_two_devices"),
        ]
        ordering = ["node__name", "device_a__index", "device_b__index"]

    def __str__(self) -> str:
        lanes = f"×{self.count}" if self.kind in topology.LANE_KINDS else ""
        return f"{self.node.name}: #{self.device_a.index} — #{self.device_b.index} {self.kind}{lanes}"

    def as_link(self) -> topology.Link:
        """The pure form the placement code takes (device ids, kind, lanes)."""
        return topology.Link(a=self.device_a.device_id, b=self.device_b.device_id, kind=self.kind, count=self.count)


class GpuInstance(models.Model):
    """A MIG GPU instance (with its one compute instance) on a node's GPU, as the manager plans
    and the agent creates it: `profile` ("1g.20gb") at memory slices `placement_start` …
    `placement_start + placement_size - 1` (of 8), `memory_size` bytes, `subproc_count` SMs.
    `uuid` is the MIG device UUID ("MIG-…"). `session` holds it while it runs; an instance
    without one is idle and reusable (lazy teardown: it is destroyed only when its slices are
    needed for another layout). `unknown_since`: an instance the agent found on the GPU that the
    manager never planned (reported at agent start). Rules: NVIDIA MIG User Guide; planner in
    `accelerators.allocation.mig`."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpu_instances")
    parent = models.ForeignKey(Device, on_delete=models.CASCADE, related_name="gpu_instances", help_text="the physical GPU")
    profile = models.CharField("MIG profile", max_length=32)
    placement_start = models.PositiveSmallIntegerField("start", help_text="first memory slice (0–7)")
    placement_size = models.PositiveSmallIntegerField("size", help_text="memory slices")
    memory_size = models.BigIntegerField("memory", default=0, help_text="bytes")
    subproc_count = models.PositiveIntegerField("SMs", default=0, help_text="SMs")
    uuid = models.CharField("MIG device UUID", max_length=128, blank=True, help_text="MIG device UUID, once the agent created it")
    session = models.ForeignKey(
        "compute_sessions.ComputeSession",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="gpu_instances",
        help_text="the session using it; empty: idle",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    unknown_since = models.DateTimeField(
        null=True,
        blank=True,
        help_text="set when the node's agent found this instance on the GPU at start without the manager having "
        "planned it (made by hand or by another tool): its slices count as taken, it is never reused or "
        "destroyed here, and it is forgotten once an agent start no longer finds it",
    )

    class Meta:
        constraints = [models.UniqueConstraint(fields=["parent", "placement_start"], name="gpuinstance_unique_start")]
        ordering = ["node__name", "parent__index", "placement_start"]
        verbose_name = "GPU instance"

    def __str__(self) -> str:
        return f"{self.node.name}/{self.parent.index} {self.profile}@{self.placement_start}"

    @property
    def is_idle(self) -> bool:
        return self.session_id is None and self.unknown_since is None

    @property
    def is_unknown(self) -> bool:
        return self.unknown_since is not None
