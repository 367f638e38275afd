"""The fragmentation map and compaction plan of a resource group (issue 17.4): what the admin's
page (admin → Fragmentation maps) and `GET /api/v1/fragmentation/` show, and the one admin
action that applies the plan.

The map and the plan are the pure `accelerators.allocation.compaction`; this module reads their
inputs — the group's alive nodes for the slot, the sessions holding them
(`sessions.scheduling.preemption.session_holders`), the group's request shapes of the last RECENT_DAYS
days, the largest waiting request — and writes
the apply: each moved session gets the same notice and grace as a preempted one
(`sessions.scheduling.preemption.notice_give`: its reason, `preempt_at` = now + FGPU_PREEMPTION_GRACE_SECONDS,
a line in its output and its signal), is stopped at its time by the scheduler's pass, and is
then launched again as a new PENDING session with the same request, command, image and priority
and its place by arrival (`sessions.scheduling.preemption.session_requeue`, unless it was launched with
`requeue: false`; its work since its start is the plan's cost); the action is written to the
admin log (LogEntry on the group); the scheduler then places the waiting session where the moves
made room.
"""

from __future__ import annotations

import json
from decimal import Decimal
import logging
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta

from django.conf import settings
from django.contrib.admin.models import CHANGE, LogEntry
from django.db import transaction
from django.db.models import Count, Max, Min, Q
from django.utils import timezone

from accelerators.allocation import compaction, core
from accelerators.allocation import mig as pure_mig
from accelerators.allocation.errors import AllocationError, InvalidResourceRequest
from accelerators.allocation.preemption import place_on
from accelerators.mig_selectors import mig_gpu_layouts
from accelerators.models import AllocationMode, Device, FractionalSettings, GpuInstance, Node, NodeStatus, ResourceGroup
from accelerators.selectors import DEFAULT_GROUP, fractional_settings_get, node_states, placement_options
from common.errors import ApplicationError
from sessions.scheduling import mig as mig_scheduling
from sessions.scheduling.eta import cluster_stamp, queue_stamp
from sessions.scheduling.kept_sessions import active_on, queue_read
from sessions.models import ComputeSession, SessionStatus
from sessions.scheduling.preemption import notice_give, notices_send, session_holders
from sessions.selectors import session_request

log = logging.getLogger(__name__)

RECENT_DAYS = 7  # the request shapes of sessions launched this many days back count as "seen lately"
MAX_SHAPES = 64  # the most distinct recent shapes the map judges (the most frequent)


@dataclass(frozen=True)
class FragmentationReport:
    """One group's map and plan: `group` (None: every node, for requests naming no group),
    `slot`, `fractional` (False: the slot is in discrete mode, no fGPU map), `map`
    (compaction.FragmentationMap or None), `target` (the largest waiting session, or None),
    `plan` (compaction.CompactionPlan or None: nothing waits, or no move set makes it fit),
    `sessions` ({session id: ComputeSession} for the names the page shows), `mig` (the group's
    MIG GPU layouts: idle instances, stranded slices), `now`."""

    group: ResourceGroup | None
    slot: str
    fractional: bool
    map: compaction.FragmentationMap | None
    target: ComputeSession | None
    plan: compaction.CompactionPlan | None
    sessions: dict
    mig: list
    now: object

    @property
    def name(self) -> str:
        return self.group.name if self.group is not None else ""


def _in_group(request: core.ResourceRequest, group: ResourceGroup | None) -> bool:
    """Whether a request is the group's: it names it, or names none and the group is "default"."""
    name = group.name if group is not None else ""
    return request.resource_group == name or (not request.resource_group and name == DEFAULT_GROUP)


def _requests(sessions, group: ResourceGroup | None, slot: str) -> list[tuple[ComputeSession, core.ResourceRequest]]:
    out = []
    for session in sessions:
        try:
            request = session_request(session)
        except (AllocationError, KeyError, TypeError, ValueError):
            continue
        if (
            request.kind != "none"
            and (request.slot or "cuda") == slot
            and _in_group(request, group)
            and not mig_scheduling.wants_mig(request)
        ):
            out.append((session, request))
    return out


def _distinct(rows) -> list[tuple[ComputeSession, list]]:
    """`rows` (request_spec, slot_name, slot_subtype, amount, cpu, mem, then anything) grouped by
    the request they describe, in order of first appearance: (an unsaved session holding that
    request, the rows' trailing values). A queue of 1,000 sessions asks for a handful of distinct
    requests: each is parsed and judged once (issue 35.2: the map read and parsed every session)."""
    found: dict[str, tuple[ComputeSession, list]] = {}
    for spec, slot_name, subtype, amount, cpu, mem, *rest in rows:
        key = json.dumps([spec, slot_name, subtype, str(amount), cpu, mem], sort_keys=True, default=str)
        if key not in found:
            found[key] = (
                ComputeSession(request_spec=spec, slot_name=slot_name, slot_subtype=subtype, amount=amount, cpu=cpu, mem=mem),
                [],
            )
        found[key][1].append(rest[0] if len(rest) == 1 else tuple(rest))
    return list(found.values())


_REQUEST_COLUMNS = ("request_spec", "slot_name", "slot_subtype", "amount", "cpu", "mem")


def recent_shapes(*, group: ResourceGroup | None, slot: str = "cuda", now=None) -> list[core.ResourceRequest]:
    """The group's request shapes seen lately: the distinct normalised requests (no pins, no
    exclusions, no policy) of its sessions launched in the last RECENT_DAYS days, the most
    frequent first (of equals, the first launched first), at most MAX_SHAPES. One query: the
    distinct requests with their counts, grouped by the database (issue 35.2: thousands of rows
    read and compared at each first ask)."""
    now = now or timezone.now()
    launched = (
        ComputeSession.objects.filter(created_at__gte=now - timedelta(days=RECENT_DAYS))
        .values(*_REQUEST_COLUMNS)
        .annotate(times=Count("pk"), first=Min("created_at"))
        .order_by("first")
    )
    distinct = [(ComputeSession(**{c: row[c] for c in _REQUEST_COLUMNS}), row["times"]) for row in launched]
    times = {id(session): n for session, n in distinct}
    counts: dict = {}
    for session, request in _requests([session for session, _ in distinct], group, slot):
        shape = core.ResourceRequest(
            request.kind,
            amount=request.amount,
            cpu=request.cpu,
            mem=request.mem,
            slot=request.slot,
            memory=request.memory,
            cores=request.cores,
            numa=request.numa,
            style=request.style,
            resource_group=request.resource_group,
        )
        counts[shape] = counts.get(shape, 0) + times[id(session)]
    return [shape for shape, _ in sorted(counts.items(), key=lambda kv: -kv[1])][:MAX_SHAPES]


MAP_KEPT_MAX = 4096  # node kinds whose map this process keeps (then it starts again)
_map_kept: dict[tuple, tuple[tuple[compaction.DeviceFree, ...], tuple[int, ...]]] = {}
_map_kept_lock = threading.Lock()


def _anonymous(node: core.NodeState) -> core.NodeState:
    """`node` without its names: its id "n", its devices' ids and UUIDs "d<position>" (their
    links likewise); what the allocator decides on one node does not depend on them."""
    position = {d.device_id: f"d{i}" for i, d in enumerate(node.devices)}
    devices = tuple(replace(d, device_id=position[d.device_id], uuid=position[d.device_id]) for d in node.devices)
    links = tuple(replace(k, a=position.get(k.a, k.a), b=position.get(k.b, k.b)) for k in node.links)
    return replace(node, node_id="n", devices=devices, links=links)


_named_kept: dict[tuple, tuple[tuple[compaction.DeviceFree, ...], tuple[int, ...], Decimal]] = {}


def _node_part(
    node: core.NodeState, context: tuple, pure_settings: core.FractionalSettings, options: dict
) -> tuple[tuple[compaction.DeviceFree, ...], tuple[int, ...], Decimal]:
    """One node's part of the map, with its names (`fragmentation_map_kept`): its devices' rows,
    the shapes (their positions) it can take now, and the most fGPU one request could get on it
    (`core.max_shares` of it alone); judged on the node without its names (kept per kind), the
    whole kept per node state: a node that did not change since the last ask costs a dictionary
    read, not its devices' rows made again (issue 35.2: 8,000 of them at each first ask)."""
    shapes = list(context[0])
    plain = _anonymous(node)
    key = (plain, context)
    part = _map_kept.get(key)
    if part is None:
        one = compaction.fragmentation_map([plain], pure_settings, shapes=shapes, options=options)
        fits = tuple(i for i, s in enumerate(shapes) if place_on(plain, s, pure_settings, options) is not None)
        part = (one.devices, fits)
        with _map_kept_lock:
            if len(_map_kept) >= MAP_KEPT_MAX:
                _map_kept.clear()
            _map_kept[key] = part
    rows = tuple(
        replace(row, node_id=node.node_id, device_id=d.device_id, label=d.label) for d, row in zip(node.devices, part[0])
    )
    named = (rows, part[1], core.max_shares([node], pure_settings))
    with _map_kept_lock:
        if len(_named_kept) >= 4 * MAP_KEPT_MAX:
            _named_kept.clear()
        _named_kept[(node, context)] = named
    return named


def fragmentation_map_kept(
    nodes: list[core.NodeState], pure_settings: core.FractionalSettings, *, shapes: list[core.ResourceRequest], options: dict
) -> compaction.FragmentationMap:
    """`compaction.fragmentation_map` of `nodes`, each node's part (its devices' free and stranded
    fGPU, the shapes it can take now) judged once per kind of node and kept (issue 35.2: the map
    judged every shape on every node of 1,000 at each ask, 14-23 s): a node's part depends only
    on its state without its names (`_anonymous`), the shapes, the slot's settings and the
    group's options, so a node that did not change since, or that is like one judged before (1,000
    alike nodes holding alike sessions are a handful of kinds), costs a dictionary read. The
    same map as the pure function's, names put back; the largest fGPU one request could get
    (`core.max_shares`) is computed as there."""
    shapes = list(shapes)
    context = (tuple(shapes), pure_settings, tuple(sorted(options.items())))
    devices: list[compaction.DeviceFree] = []
    placeable: list[core.ResourceRequest] = []
    most = [core.max_shares([], pure_settings)]
    for node in nodes:
        named = _named_kept.get((node, context))
        if named is None:
            named = _node_part(node, context, pure_settings, options)
        devices.extend(named[0])
        placeable.extend(shapes[i] for i in named[1] if shapes[i] not in placeable)
        most.append(named[2])
    largest = max(placeable, key=lambda s: compaction.request_fgpu(s, pure_settings, nodes), default=None)
    return compaction.FragmentationMap(
        devices=tuple(devices),
        free=sum((d.free for d in devices), core.ZERO),
        stranded=sum((d.free for d in devices if d.stranded), core.ZERO),
        largest_fgpu=max(most),  # core.max_shares(nodes): each node's truncated, the largest of them
        largest_shape=largest,
        shapes=tuple(shapes),
    )


def _with_mig_gpus(nodes):
    """The nodes of `nodes` (a Node queryset) holding a MIG-capable GPU as
    `accelerators.mig_selectors.device_mig_catalog` judges one (a catalog its agent read, or a
    model the built-in catalogs know): those `mig_gpu_layouts` lists GPUs of. Two queries: the
    distinct kinds of GPU (model, memory, catalog) among them, each judged once, then the nodes
    holding a capable kind; the layouts then read those nodes only, not 1,000 nodes' 8,000 GPUs
    as model instances, nor their 8,000 rows at each first ask (issue 35.2)."""
    rows = Device.objects.filter(node__in=nodes, is_mig_device=False)
    capable = Q(pk__in=[])
    for model, memory, catalog in rows.values_list("model_name", "memory_size", "mig_catalog").distinct():
        if not catalog:
            try:
                pure_mig.catalog_get(model, memory_size=memory)
            except InvalidResourceRequest:
                continue
        capable |= Q(model_name=model, memory_size=memory, mig_catalog=catalog)
    return Node.objects.filter(pk__in=rows.filter(capable).values("node_id"))


def fragmentation_report(
    *, group: ResourceGroup | None, slot: str = "cuda", now=None, for_update: bool = False, stamp: object = None
) -> FragmentationReport:
    """The map and plan of `group` (see the module) now; `for_update` locks its node and device
    rows (inside the caller's transaction: the apply). Reads a handful of queries. `stamp`: the
    cluster's (`eta.cluster_stamp`) as the caller read it, not for an update: the holders are
    then the kept sessions (`kept_sessions.active_on`: only those written since the last read
    are read again)."""
    now = now or timezone.now()
    scope = Node.objects.filter(status=NodeStatus.ALIVE)
    if group is not None:
        scope = scope.filter(resource_group=group)
    kept = stamp is not None and not for_update
    mig = mig_gpu_layouts(nodes=_with_mig_gpus(scope))
    settings = fractional_settings_get(slot_name=slot)
    if settings.allocation_mode != AllocationMode.FRACTIONAL:
        return FragmentationReport(group, slot, False, None, None, None, {}, mig, now)
    pure = settings.as_allocation_settings()
    nodes = node_states(slot_name=slot, for_update=for_update, group=group)
    options = placement_options(group=group)
    found = fragmentation_map_kept(nodes, pure, shapes=recent_shapes(group=group, slot=slot, now=now), options=options)
    # the largest waiting request (the first in queue order of the largest), judged once per
    # distinct request; only that session is read whole
    pending, active = queue_read() if kept else ([], [])  # only those written since the last read are read again
    if kept:  # in the same order
        rows = [(*(getattr(s, c) for c in _REQUEST_COLUMNS), s.pk) for s in pending]
    else:
        queue = ComputeSession.objects.filter(status=SessionStatus.PENDING).order_by("-priority", "created_at", "pk")
        rows = list(queue.values_list(*_REQUEST_COLUMNS, "pk"))
    distinct = _distinct(rows)
    first = {id(session): pks[0] for session, pks in distinct}
    waiting = _requests([session for session, _ in distinct], group, slot)
    target, plan, sessions = None, None, {}
    if waiting:  # max keeps the first of equals: the distinct requests are in queue order
        largest, request = max(waiting, key=lambda sr: compaction.request_fgpu(sr[1], pure, nodes))
        # None if it ended since the read above: nothing to plan for this time
        target = ComputeSession.objects.select_related("owner").filter(pk=first[id(largest)]).first()
    if target is not None:
        names = [n.node_id for n in nodes]
        holders, stopping, _ = session_holders(node_names=names, sessions=active_on(names, active) if kept else None)
        plan = compaction.compaction_plan(nodes, holders, request, pure, now=now.timestamp(), options=options)
        if plan is not None and plan.moves:
            sessions = {
                str(s.pk): s
                for s in ComputeSession.objects.filter(pk__in=[m.holder.session_id for m in plan.moves]).select_related(
                    "owner", "node"
                )
            }
    return FragmentationReport(group, slot, True, found, target, plan, sessions, mig, now)


REPORT_TTL_S = 30.0  # the longest a kept report serves (the clock moves on: work lost, recent shapes)
_reports: dict[tuple, tuple[tuple, float, FragmentationReport]] = {}


def fragmentation_report_kept(*, group: ResourceGroup | None, slot: str = "cuda") -> FragmentationReport:
    """`fragmentation_report(group=group, slot=slot)` kept per group and slot while nothing it
    reads changed: no pending or active session (`eta.queue_stamp`), no node, device or
    allocation (`eta.cluster_stamp`: the kept cluster view's version), no GPU instance (their
    count, holders and newest use), not the slot's fractional settings, for up to REPORT_TTL_S
    seconds (issue 35.2: the map, the MIG layouts and the holders of 1,000 nodes read again at
    each ask); asked again, a dictionary read. On SQLite (no cluster stamp) read each time. The
    apply never uses it (it reads under lock)."""
    nodes = cluster_stamp()
    if nodes is None:
        return fragmentation_report(group=group, slot=slot)
    instances = GpuInstance.objects.aggregate(n=Count("pk"), held=Count("session"), used=Max("last_used_at"))
    slot_settings = tuple(
        FractionalSettings.objects.filter(slot_name=slot).values_list("allocation_mode", "unit_mem", "unit_proc", "quantum_size")
    )
    named = (group.pk, group.name) if group else None
    stamp = (queue_stamp(), nodes, tuple(instances.values()), slot_settings, named)
    key = (group.pk if group else None, slot)
    found = _reports.get(key)
    if found is not None and found[0] == stamp and time.monotonic() - found[1] < REPORT_TTL_S:
        return found[2]
    report = fragmentation_report(group=group, slot=slot, stamp=nodes)
    _reports[key] = (stamp, time.monotonic(), report)
    return report


def compaction_apply(*, admin, group: ResourceGroup | None, expected: list[str] | None = None, slot: str = "cuda") -> dict:
    """Apply `group`'s compaction plan as it stands now (recomputed under lock): each moved
    session is put under notice for the waiting session (reason "to be moved at … by <admin> …",
    `preempt_at` = now + FGPU_PREEMPTION_GRACE_SECONDS, a line in its output and its signal: the
    notice a preempted session gets), stopped at that time by the scheduler's pass with a
    "preempted: …" reason and then launched again (`sessions.scheduling.preemption.session_requeue`:
    `requeued_as`); a LogEntry on the group records it. `expected`: the moved sessions' ids the
    admin saw; another plan now is refused.
    Returns `{"target", "node", "moved": [{"session", "restarted_as" (None until it is stopped and
    requeued: see its `requeued_as`), "to_node", "preempt_at"}], "work_lost"}`.
    Raises ApplicationError 409 "nothing-to-apply" (nothing waits, it fits already, or no plan)
    and 409 "plan-changed"."""
    with transaction.atomic():
        report = fragmentation_report(group=group, slot=slot, for_update=True)
        plan = report.plan
        if report.target is None or plan is None or plan.fits_now:
            why = (
                "nothing waits in this group"
                if report.target is None
                else "the largest waiting session fits already: the scheduler's next pass places it"
                if plan is not None
                else "no set of preemptible sessions to move makes the largest waiting session fit"
            )
            raise ApplicationError(why, type="nothing-to-apply", title="Nothing to apply", status=409)
        ids = [m.holder.session_id for m in plan.moves]
        if expected is not None and sorted(expected) != sorted(ids):
            raise ApplicationError(
                "the plan changed since it was shown (sessions started or ended): look at it again",
                type="plan-changed",
                title="Plan changed",
                status=409,
            )
        target = report.target
        now = timezone.now()
        at = now + timedelta(seconds=settings.FGPU_PREEMPTION_GRACE_SECONDS)
        reason = (
            f"to be moved at {at:%Y-%m-%d %H:%M:%S} UTC by {admin.get_username()} to compact resource group "
            f"{report.name or '(any)'} for {target.name} of {target.owner.get_username()}: stopped then and "
            "launched again; save your work"
        )
        notice_give(waiter=target, ids=ids, reason=reason, at=at)
        notices_send(now)
        moved = [
            {"session": m.holder.session_id, "restarted_as": None, "to_node": m.to_node, "preempt_at": at} for m in plan.moves
        ]
        message = (
            f"compaction: moving {len(moved)} session(s) from {plan.node_id} for {target.name} ({target.pk}) at "
            f"{at.isoformat()}; {plan.work_lost / 3600:.2f} fGPU-hours of work lost: {json.dumps(ids)}"
        )
        if group is not None:
            LogEntry.objects.log_actions(admin.pk, [group], CHANGE, change_message=message, single_object=True)
        log.info("%s by %s", message, admin.get_username())
    return {"target": str(target.pk), "node": plan.node_id, "moved": moved, "work_lost": plan.work_lost}
