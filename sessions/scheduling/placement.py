"""The one placement decision (issue 19): for a request, what launching it does now — starts
on a node and devices, waits (and why), or is refused (it could never fit, or a quota) — made
by one function, `placement_decide`, for all three callers:

- the launch (`sessions.admission.launch.session_create`): the admission part (with `owner`, no view):
  the request fits some registered node, LOST ones included, and the owner's quotas allow its
  claim (`sessions.policy.quotas.quota_refusals`); the session is then written PENDING;
- the scheduler (`sessions.scheduling.scheduler.schedule_pending`): the placement part on its pass view
  (rows locked, the pass's own plans applied), then its writes;
- the launch preview (`sessions.admission.launch.launch_preview`): both parts, read without locks, and
  nothing written: what the launch followed by the scheduler's next pass would do.

The view (`ReadView`, or the scheduler's subclass) says how nodes are read; the decision's
rules live here only: the slot's settings against the request, "ever fits" against every
registered node (a LOST node may come back; an image may come to a node), the quotas, the
session image, MIG first for MIG requests (isolation "any" falls back to a shared slice), and
the allocator under the resource group's policy with its placed workload
(`PlacementScope.place`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from accelerators.allocation import cluster, core
from accelerators.allocation.errors import (
    AllocationError,
    InsufficientResource,
    InvalidResourceRequest,
    NeverSchedulable,
    UnknownDevice,
)
from accelerators.allocation.reservation import Reservations
from accelerators.allocation.requests import parse_resources
from protocol.units import amount_text
from accelerators.cluster_view import ever_fits_nodes
from accelerators.models import AllocationMode
from accelerators.selectors import (
    fractional_settings_get,
    node_states,
    pinned_device_problem,
    placement_options,
    placement_workload,
    resource_group_get,
)
from common.errors import ApplicationError
from sessions.scheduling import mig as mig_scheduling
from sessions.policy.group_access import resource_group_check_usable
from sessions.policy.images import NO_ROOM_WITH_IMAGE, image_wait_reason
from sessions.scheduling.mig import MigChoice, MigGrantPreview
from sessions.models import ComputeSession
from sessions import usage_reads
from sessions.policy.quotas import quota_refusal_error, quota_refusals

PLACED = "placed"  # starts now: `placement` (a shared slice), or `mig` / `mig_preview` (MIG)
WAITING = "waiting"  # admitted, waits in the queue: `reason`
NEVER = "never"  # no registered node could ever hold it: refused at launch, ERROR in the queue
QUOTA = "quota"  # a quota of the owner (or of a project of theirs) refuses it: `problems`
RESERVED = "reserved"  # its resource group is reserved for projects the owner is not in: `error` (403)

ADMITTED_REASON = "waiting for the scheduler"  # a launched session's reason until the next pass
LOST_REASON = "the nodes that could hold it are not alive (LOST)"
CAPACITY = "waiting for capacity: "  # + why no node can hold it now


@dataclass(frozen=True)
class Decision:
    """What launching a request does now. `outcome`: PLACED, WAITING, NEVER or QUOTA; `reason`:
    the session's status reason for WAITING ("waiting for capacity: …"), the refusal for NEVER
    and QUOTA ("" for PLACED); `problems`: QUOTA's sentences, one per limit passed;
    `placement`: the allocator's plan (PLACED on a shared slice). PLACED on MIG, one of two,
    as the view's `mig` answers: `mig`, the choice the scheduler's pass writes and the ETA's
    replay plays (`mig_scheduling.MigChoice`), or `mig_preview`, what a read view shows (the
    launch preview: `mig_scheduling.MigGrantPreview`)."""

    outcome: str
    reason: str = ""
    problems: tuple[str, ...] = ()
    placement: core.Placement | None = None
    mig: MigChoice | None = None
    mig_preview: MigGrantPreview | None = None
    error: ApplicationError | None = None
    parts: dict[str, str] = field(default_factory=dict)  # NEVER's reason in parts (NeverSchedulable.parts)

    def refusal(self) -> ApplicationError | None:
        """The launch's error for a refused decision (None otherwise): NEVER → 400 type
        "never-schedulable", title "Request too large"; QUOTA → 400 type "quota-exceeded";
        RESERVED → 403 type "resource-group-reserved" (`sessions.policy.group_access`)."""
        if self.outcome == RESERVED:
            return self.error
        if self.outcome == NEVER and self.error is not None:  # a pinned device no node in reach has
            return self.error
        if self.outcome == NEVER:
            return ApplicationError(
                self.reason, type="never-schedulable", title="Request too large", field_errors={"resources": [self.reason]}
            )
        if self.outcome == QUOTA:
            return quota_refusal_error(list(self.problems))
        return None


def request_settings(request: core.ResourceRequest) -> core.FractionalSettings | None:
    """The slot's fractional settings for the allocator, after checking the request matches the
    slot's allocation mode. Raises InvalidResourceRequest naming the mode."""
    if request.kind == "none":
        return None
    slot = fractional_settings_get(slot_name=request.slot)
    if request.kind == "per_device":  # any mode; fGPU equivalents only where fractional
        return slot.as_allocation_settings() if slot.allocation_mode == AllocationMode.FRACTIONAL else None
    if request.kind == "shares" and slot.allocation_mode != AllocationMode.FRACTIONAL:
        raise InvalidResourceRequest(
            f"{request.slot}.shares: the {request.slot} slot is in discrete mode; ask for whole GPUs with "
            f"{request.slot}.device, or have an administrator switch it to fractional mode"
        )
    if request.kind == "device" and slot.allocation_mode == AllocationMode.FRACTIONAL:
        raise InvalidResourceRequest(
            f"{request.slot}.device: the {request.slot} slot is in fractional mode; ask for fGPU with {request.slot}.shares"
        )
    return slot.as_allocation_settings()


def request_validate(*, resources: dict) -> tuple[core.ResourceRequest, core.FractionalSettings | None]:
    """Parse `resources` and check it against the slot's mode, quantum and resource group.
    Returns the normalised request and the slot's settings for the allocator. Raises
    ApplicationError (400, type "invalid-resources") naming the field."""
    try:
        request = parse_resources(resources)
        pure_settings = request_settings(request)
        if request.kind == "shares" and pure_settings is not None:  # request_settings gives shares their slot's
            core.check_quantum(request.amount, pure_settings)
        resource_group_get(name=request.resource_group)
    except AllocationError as exc:
        raise ApplicationError(str(exc), type="invalid-resources", field_errors={"resources": [str(exc)]}) from None
    return request, pure_settings


def placement_decide(*, request: core.ResourceRequest, image: str = "", owner=None, view: ReadView | None = None) -> Decision:
    """The one decision for `request` in session image `image` (a registered reference; "": any
    node). With `owner`, the launch's admission first: RESERVED when the request's resource
    group is reserved for projects `owner` is not a member of, NEVER when no registered node (LOST ones
    included; MIG nodes for MIG requests) could ever hold it, then QUOTA when a quota refuses
    its claim (the quota rows stay locked until the caller's transaction ends). Without a
    `view` the decision stops there: WAITING with ADMITTED_REASON. With one, the placement on
    `view`'s nodes: NEVER for a request the slot's settings no longer allow; WAITING for an
    image no alive node holds, for a request only LOST nodes (or nodes without the image) could
    hold, or when no node has room now ("waiting for capacity: …"); else PLACED.
    Raises nothing of its own (the view's reads may raise database errors)."""
    view = view or AdmissionView()
    try:
        pure_settings = view.settings(request)
    except AllocationError as exc:
        return Decision(NEVER, str(exc))
    if owner is not None:
        try:
            resource_group_check_usable(user=owner, name=request.resource_group)
        except ApplicationError as exc:
            return Decision(RESERVED, exc.detail, error=exc)
        try:
            mig_scheduling.check_ever_fits(request, lambda: view.check_ever_fits(request, pure_settings))
        except NeverSchedulable as exc:
            return _never(exc, request)
        problems = quota_refusals(user=owner, request=request, lock=view.locks)
        if problems:
            return Decision(QUOTA, "; ".join(problems), problems=tuple(problems))
        if not view.places:
            return Decision(WAITING, ADMITTED_REASON)
    return _place(request, pure_settings, image, view)


def queue_shape(session: ComputeSession) -> str:
    """The key of a session's request in a pass: its image and normalised request. Sessions of
    one key find room or not together, so a pass tries each key once until one is placed."""
    image = session.image.reference if session.image else ""
    return f"{image}|{json.dumps(session.request_spec, sort_keys=True)}"


def runtime_limits() -> dict[str, int]:
    """Resource group name ("" for the nodes in no group) → the most seconds a session there may
    run (usage.IdlePolicy.max_lifetime, read through sessions.usage_reads), for the groups with a
    limit: what backfill takes as a session's time limit (Slurm's --time) to run it on capacity
    reserved from a later time."""
    return usage_reads.reads.max_lifetimes()


def _place(request: core.ResourceRequest, pure_settings, image: str, view: ReadView) -> Decision:
    """`placement_decide`'s placement part."""
    missing = view.image_missing(image) if image else ""
    if missing:
        return Decision(WAITING, missing)
    mig_reason = ""
    if mig_scheduling.wants_mig(request):
        try:
            found = view.mig(request, image)
            return Decision(PLACED, mig=found) if isinstance(found, MigChoice) else Decision(PLACED, mig_preview=found)
        except InsufficientResource as exc:
            if request.isolation != "any":
                return Decision(WAITING, CAPACITY + str(exc))
            mig_reason = str(exc)  # MIG may hold it later; a shared slice may hold it now
        except AllocationError as exc:  # never on MIG (NeverSchedulable), or a layout the planner refuses
            if request.isolation != "any":
                return Decision(NEVER, str(exc))
    try:
        placement = view.place(request, pure_settings, image)
    except NeverSchedulable as exc:
        # Only the alive nodes (with the image) are too small: wait while a LOST node that
        # could hold it may come back (an agent restart must not fail the queue), or while a
        # node that could hold it may get the image.
        try:
            view.check_ever_fits(request, pure_settings)
        except NeverSchedulable as ever:
            if mig_reason:
                return Decision(WAITING, f"{CAPACITY}no shared slice could ever hold it ({exc}); MIG: {mig_reason}")
            return _never(ever, request)
        return Decision(WAITING, CAPACITY + (NO_ROOM_WITH_IMAGE.format(image=image) if image else LOST_REASON))
    except InsufficientResource as exc:
        return Decision(WAITING, CAPACITY + str(exc))
    except AllocationError as exc:
        return Decision(NEVER, str(exc))
    return Decision(PLACED, placement=placement)


def _never(exc: NeverSchedulable, request: core.ResourceRequest) -> Decision:
    """NEVER for `exc` (with its parts: what was asked, the most any node can give, what to
    do, where it has them); for pinned devices no node in reach has (UnknownDevice) what is wrong
    with them, not "too large": none registered, on another resource group's node, a MIG
    instance, a device of another slot (`accelerators.selectors.pinned_device_problem`), as the
    launch's error (400, type "unknown-device", "device-not-in-group" or "device-not-usable")."""
    if not isinstance(exc, UnknownDevice) or not exc.pins:
        return Decision(NEVER, str(exc), parts=exc.parts)
    group = resource_group_get(name=request.resource_group)
    reason, kind, title = pinned_device_problem(pins=exc.pins, slot=request.slot, group=group)
    error = ApplicationError(reason, type=kind, title=title, field_errors={"resources.devices": [reason]})
    return Decision(NEVER, reason, error=error)


class ReadView:
    """How `placement_decide` reads the cluster: now, without locks (the launch and its
    preview). The scheduler's pass view overrides the reads to lock and to see its own plans."""

    places = True  # whether the decision goes on to placement (False: admission only)
    locks = False  # whether the admission locks the quota rows (the launch's transaction)

    def settings(self, request: core.ResourceRequest) -> core.FractionalSettings | None:
        """`request_settings`; raises its AllocationError."""
        return request_settings(request)

    def check_ever_fits(self, request: core.ResourceRequest, pure_settings) -> None:
        """Raises NeverSchedulable when no registered node (alive or LOST, any image) of the
        request's group could hold it with all of it free: one node of each kind is tried, from
        the kept cluster view (`accelerators.cluster_view.ever_fits_nodes`; issue 35.1)."""
        group = resource_group_get(name=request.resource_group)
        core.check_ever_fits(ever_fits_nodes(request, group=group), request, pure_settings)

    def image_missing(self, image: str) -> str:
        """Why a session in `image` waits although it may fit ("" when an alive node holds it)."""
        return image_wait_reason(reference=image)

    def mig(self, request, image: str) -> MigGrantPreview | MigChoice:
        """What MIG gives `request` now (`mig_scheduling.mig_preview`); raises as it does."""
        return mig_scheduling.mig_preview(request=request, image=image)

    def place(self, request: core.ResourceRequest, pure_settings, image: str) -> core.Placement:
        """The allocator's plan on the alive nodes (holding `image`) of the request's group, under
        its policy and placed workload; raises InsufficientResource / NeverSchedulable."""
        return PlacementScope.read(request, image=image).place(request, pure_settings)


class RememberingReadView(ReadView):
    """A ReadView whose slot settings and image reasons are read once (per slot and kind, per
    image) and then remembered: for the reads of many decisions over one state (the scheduler's
    pass, the ETA's replay). A settings read that raised raises the same error each time."""

    def __init__(self) -> None:
        self._settings: dict = {}
        self._images: dict[str, str] = {}

    def settings(self, request: core.ResourceRequest) -> core.FractionalSettings | None:
        key = (request.slot, request.kind)
        if key not in self._settings:
            try:
                self._settings[key] = super().settings(request)
            except AllocationError as exc:
                self._settings[key] = exc
        found = self._settings[key]
        if isinstance(found, AllocationError):
            raise type(found)(str(found))
        return found

    def image_missing(self, image: str) -> str:
        if image not in self._images:
            self._images[image] = super().image_missing(image)
        return self._images[image]


class AdmissionView(ReadView):
    """`placement_decide` for the launch itself: admission only (the scheduler places)."""

    places = False
    locks = True


def shape_prefix(slot: str, pure_settings: core.FractionalSettings | None) -> str:
    """The part of a PlacementShape key naming the slot and the index's units (fGPU quanta of a
    given size, or thousandths of a device's memory in discrete mode)."""
    if pure_settings is None:
        return f"{slot}|milli|"
    return f"{slot}|{amount_text(pure_settings.quantum)}:{pure_settings.unit_mem}:{pure_settings.unit_proc}|"


@dataclass
class PlacementScope:
    """One scope's nodes (a resource group's alive nodes for one slot, those holding an image,
    and of those the ones with shared storage where there are some: `core.storage_scope`) as the
    allocator sees them, with its placement options, a cluster index per unit system
    (the slot's settings, or none) and the group's placed workload. The scheduler reads and
    locks each once per pass and keeps it current with each plan (`update`)."""

    group_name: str
    slot: str
    nodes: list[core.NodeState]
    options: dict
    rows: dict[str, int] = field(default_factory=dict)
    indexes: dict = field(default_factory=dict)
    workloads: dict = field(default_factory=dict)

    @classmethod
    def read(
        cls,
        request: core.ResourceRequest,
        *,
        image: str = "",
        for_update: bool = False,
        latest: dict[str, core.NodeState] | None = None,
    ) -> PlacementScope:
        """The scope of `request` (its group and slot) for `image` ("": any node); `for_update`
        locks the node and device rows; `latest` (node name → state) replaces nodes already
        planned on elsewhere. Raises InvalidResourceRequest for an unknown group."""
        slot = request.slot or "cuda"
        group = resource_group_get(name=request.resource_group)
        nodes = node_states(slot_name=slot, for_update=for_update, group=group, image=image)
        if latest:
            nodes = [latest.get(n.node_id, n) for n in nodes]
        nodes = core.storage_scope(nodes)  # the data folders: shared storage where the scope has it
        return cls.of_nodes(request, group, slot, nodes)

    @classmethod
    def of_nodes(cls, request: core.ResourceRequest, group, slot: str, nodes: list[core.NodeState], **fields):
        """The scope of `request` in `group` (a ResourceGroup or None) and `slot` over `nodes`, as
        read (its placement options, a row per node); `fields`: a subclass's own."""
        return cls(
            group_name=request.resource_group,
            slot=slot,
            nodes=nodes,
            options=placement_options(group=group),
            rows={n.node_id: i for i, n in enumerate(nodes)},
            **fields,
        )

    def index(self, pure_settings):
        if pure_settings not in self.indexes:
            self.indexes[pure_settings] = core.cluster_index(self.nodes, pure_settings)
        return self.indexes[pure_settings]

    def workload(self, pure_settings) -> cluster.Workload:
        if pure_settings not in self.workloads:
            self.workloads[pure_settings] = placement_workload(
                resource_group=self.group_name, prefix=shape_prefix(self.slot, pure_settings)
            )
        return self.workloads[pure_settings]

    def place(self, request: core.ResourceRequest, pure_settings) -> core.Placement:
        """`core.place` on this scope under its options. Raises InsufficientResource /
        NeverSchedulable as it does."""
        workload = None
        if (request.policy or self.options["policy"]) in cluster.FRAGMENTATION_AWARE:
            # p counts the request being placed, as in the benchmark (in memory, for this pass;
            # PlacementShape counts it once it is placed).
            workload = self.workload(pure_settings)
            workload.observe(core.request_shape(request, pure_settings))
        return core.place(self.nodes, request, pure_settings, index=self.index(pure_settings), workload=workload, **self.options)

    def place_around(
        self, request: core.ResourceRequest, pure_settings, reservations: Reservations, end: float | None
    ) -> core.Placement:
        """`place` where it delays none of a pass's backfill `reservations`, for a session that
        ends at `end` (epoch seconds; None: no runtime limit): `Reservations.place_around`.
        Raises InsufficientResource (naming the reservation when only reserved room would hold
        it) / NeverSchedulable as `place` does."""
        if not reservations.held:
            return self.place(request, pure_settings)

        def place(nodes: list[core.NodeState] | None) -> core.Placement:
            if nodes is None:
                return self.place(request, pure_settings)
            aware = (request.policy or self.options["policy"]) in cluster.FRAGMENTATION_AWARE
            workload = self.workload(pure_settings) if aware else None  # observed by the first try
            return core.place(nodes, request, pure_settings, workload=workload, **self.options)

        return reservations.place_around(self.nodes, cpu=request.cpu, mem=request.mem, end=end, place=place)

    def update(self, node: core.NodeState) -> None:
        row = self.rows.get(node.node_id)
        if row is None:
            return
        self.nodes[row] = node
        for pure_settings, index in self.indexes.items():
            index.set_row(row, **core.node_row(node, pure_settings))
