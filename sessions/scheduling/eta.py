"""When will a pending session start? (issue 17.3) And what would the queue do under other
share weights or placement policies? (issue 17.5)

Both are one replay of the scheduler (`accelerators.allocation.replay.replay`) over the queue
as it stands, read without locks and nothing written:

- the queue: PENDING sessions in the pass's order (`fairshare.queue_key`: priority, fair-share
  factor, arrival), with their backfill counts;
- what fits: `sessions.scheduling.placement.placement_decide` on an in-memory copy of the nodes
  (`_ReplayView`), i.e. `core.place` under each resource group's policy, the pure placement
  the real pass runs; a placement takes its room (`core.apply_placement`), an end gives it
  back (`core.release_placement`); a MIG request (a MIG profile, a memory size with isolation
  "mig", isolation "any" where MIG is the choice) gets the pass's MIG choice
  (`mig_scheduling.mig_choose_in`, the planner `accelerators.allocation.mig.plan_instance`) on
  an in-memory copy of the MIG nodes (`mig_scheduling.MigNodeRoom`): an end leaves its GPU
  instance idle — reused, or on a dynamic node destroyed for its slices when they are needed,
  on a fixed layout only reused — and frees a static slice, as the real rows would;
- when room comes free: each active session's expected end (`expected_end`), from what the
  console knows: its resource group's maximum lifetime and idle timeout (usage.IdlePolicy),
  the preemption time it was warned of (`preempt_at`), the idle-reclamation deadline it was
  warned of (usage.SessionActivity), and for a batch session the runtimes of earlier completed
  runs of its command, keyed by command, image, request and project with coarser keys when a
  fine one has too little history (`accelerators.allocation.runtime_history`);
  a session the replay starts holds its room for its own expected runtime.

Two replays give a band: the optimistic one ends every session at its earliest expected end,
the pessimistic one at its latest (a session with no known latest end never ends). A session's
ETA is its start in the first to its start in the second; "unknown" (with why) when it starts
in neither, "never" when no node could ever hold it (the reason the launch would give).

Not replayed: the fair-share factors' drift while the queue runs (the order of now is kept),
sessions launched later, terminations by hand, and an administrator's changes (MIG modes and
layouts, nodes).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone as dt_timezone

from django.conf import settings
from django.db import connection
from django.db.models import Count, Max, Sum
from django.utils import timezone

from accelerators.allocation import cluster, core
from accelerators.allocation import replay as pure
from accelerators.allocation import runtime_history as history
from accelerators.allocation.errors import AllocationError, InsufficientResource
from accelerators.allocation.requests import request_to_spec
from accelerators.allocation.reservation import Reservation, Reservations, reservation_find
from accelerators.cluster_view import cluster_view
from accelerators.models import ResourceGroup
from sessions.scheduling import fairshare
from sessions.scheduling import mig as mig_scheduling
from sessions.scheduling.kept_sessions import queue_read
from sessions.models import ACTIVE_STATUSES, ComputeSession, Project, SessionStatus
from sessions import usage_reads
from sessions.scheduling.placement import (
    CAPACITY,
    PLACED,
    WAITING,
    PlacementScope,
    ReadView,
    RememberingReadView,
    placement_decide,
    queue_shape,
    runtime_limits,
)
from sessions.selectors import session_request

HISTORY_DAYS = 30  # batch sessions that ended within this many days make the history
HISTORY_ROWS = 5000  # the most recent ended runs of the queue's commands read
HISTORY_MIN, HISTORY_BAND = pure.HISTORY_MIN, pure.HISTORY_BAND  # shared with benchmarks/eta.py
FITS_AFTER_MAX = 200  # running sessions tried, soonest end first, for what would make room


@dataclass(frozen=True)
class End:
    """When a session is expected to end: `earliest` and `latest` (epoch seconds; None: no
    known end), and `basis`, the words saying why ("maximum lifetime of 8 h", "batch history
    (12 runs)", "idle deadline", "no declared end")."""

    earliest: float | None
    latest: float | None
    basis: str


@dataclass(frozen=True)
class Runtime:
    """How long a session runs once started: `earliest` / `latest` seconds (None: unknown) and
    its `basis` (as `End`'s)."""

    earliest: float | None
    latest: float | None
    basis: str


def _hours(seconds: float) -> str:
    seconds = int(seconds)
    if seconds % 3600 == 0:
        return f"{seconds // 3600} h"
    return f"{seconds // 60} min" if seconds % 60 == 0 else f"{seconds} s"


def run_outcome(*, status_reason: str, exit_code: int | None, preempted: bool) -> str:
    """How a TERMINATED batch session ended (`runtime_history.OUTCOMES`): "preempted" (stopped
    for another session: `preempted_for` set or a "preempted: " reason), "cancelled" (terminated
    at someone's request or reclaimed when idle), "failed" (a non-zero or no exit code), else
    "completed". Only completed runs make a history."""
    from sessions.lifecycle.services import PREEMPTED, RECLAIMED, REQUESTED

    if preempted or status_reason.startswith(PREEMPTED):
        return history.PREEMPTED
    if status_reason.startswith((REQUESTED, RECLAIMED)):
        return history.CANCELLED
    return history.COMPLETED if exit_code == 0 else history.FAILED


class _Facts:
    """What the estimates read, once per replay: the idle policies by resource group id, the
    running sessions' idle warnings and last terminal input (sessions.usage_reads: the usage app's), the batch histories
    (`runtime_history.History` of the completed runs of the commands the sessions run)."""

    def __init__(self, *, now: datetime, sessions: list[ComputeSession]):
        self.now = now
        self.policies = usage_reads.reads.lifetime_bounds()
        self.groups = dict(ResourceGroup.objects.values_list("name", "pk"))
        self.activity = usage_reads.reads.idle_watches(session_ids=[s.pk for s in sessions])
        self.history = history.History()
        self.projects: dict[int, str] = {}
        commands = {s.command.strip() for s in sessions if s.command.strip()}
        if not commands:
            return
        rows = list(
            ComputeSession.objects.filter(status=SessionStatus.TERMINATED, command__in=commands | {s.command for s in sessions})
            .filter(started_at__isnull=False, terminated_at__isnull=False, terminated_at__gte=now - timedelta(days=HISTORY_DAYS))
            .order_by("-terminated_at")
            .values_list(
                "owner_id",
                "command",
                "image__reference",
                "request_spec",
                "started_at",
                "terminated_at",
                "status_reason",
                "exit_code",
                "preempted_for_id",
            )[:HISTORY_ROWS]
        )
        owners = {row[0] for row in rows} | {s.owner_id for s in sessions}
        member: dict[int, list[str]] = {}
        for user_id, project_id in Project.members.through.objects.filter(user_id__in=owners).values_list(
            "user_id", "project_id"
        ):
            member.setdefault(user_id, []).append(str(project_id))
        self.projects = {user_id: "p" + ",".join(sorted(ids)) for user_id, ids in member.items()}
        for owner_id, command, image, spec, started, ended, reason, exit_code, preempted in rows:
            if started is None or ended is None:  # the filter leaves none; the type checker does not know
                continue
            outcome = run_outcome(status_reason=reason, exit_code=exit_code, preempted=preempted is not None)
            job = history.Job(command, image or "", _spec_text(spec), self._project(owner_id))
            self.history.add(job, (ended - started).total_seconds(), outcome)

    def _project(self, owner_id: int) -> str:
        return self.projects.get(owner_id, f"u{owner_id}")

    def policy(self, group_id):
        """The lifetime bounds (sessions.usage_reads.LifetimeBounds) of resource group `group_id`, or None."""
        return self.policies.get(group_id)

    def job(self, session: ComputeSession) -> history.Job:
        """`session`'s key for the history: command, image, normalised request, project."""
        image = session.image.reference if session.image_id and session.image else ""
        return history.Job(session.command, image, _spec_text(session.request_spec), self._project(session.owner_id))


def _spec_text(spec) -> str:
    return json.dumps(spec or {}, sort_keys=True)


def expected_end(session: ComputeSession, facts: _Facts) -> End:
    """When an active `session` (SCHEDULED … TERMINATING) is expected to end; known ends before
    predictions (Slurm's backfill takes a job's time limit before anything else), in this order:
    TERMINATING → now; under a preemption notice → its `preempt_at`; a warning of idle
    reclamation or of its maximum lifetime → its deadline; a batch session with a history
    (`runtime_history.History.band`: the completed runs of its command, keyed as finely as the
    history allows) → now + that band, capped by its maximum lifetime; an interactive one under
    an idle timeout → earliest when it would be reclaimed were it left idle from now, latest its
    maximum lifetime (or unknown); else its maximum lifetime, or no known end."""
    now = facts.now.timestamp()
    if session.status == SessionStatus.TERMINATING:
        return End(now, now, "terminating")
    started = session.started_at.timestamp() if session.started_at else now
    policy = facts.policy(session.node.resource_group_id if session.node else None)
    cap = started + policy.max_lifetime if policy and policy.max_lifetime else None
    if session.preempt_at is not None:
        at = max(now, session.preempt_at.timestamp())
        at = min(at, cap) if cap is not None else at
        return End(at, at, "preemption notice (stopped at the end of its grace period)")
    activity = facts.activity.get(session.pk)
    if activity is not None and activity.deadline is not None:
        at = max(now, activity.deadline.timestamp())
        return End(at, at, f"reclamation deadline ({activity.reason})" if activity.reason else "reclamation deadline")
    if session.command:
        band, named = facts.history.band(facts.job(session), now - started)
        if band is not None:
            early, late = now + band[0], now + band[1]
            if cap is not None:
                early, late = min(early, cap), min(late, cap)
            return End(early, late, named)
    elif policy and policy.idle_timeout:
        last = max(started, float((activity.last_input if activity else None) or 0))
        early = max(now, last + policy.idle_timeout) + policy.grace
        if cap is not None:
            early = min(early, cap)
        return End(
            early,
            cap,
            f"idle timeout of {_hours(policy.idle_timeout)}"
            + (f", maximum lifetime of {_hours(policy.max_lifetime)}" if cap else ""),
        )
    if cap is not None:
        return End(max(now, cap), max(now, cap), f"maximum lifetime of {_hours(policy.max_lifetime)}")
    return End(None, None, "no declared end (no maximum lifetime, idle timeout or batch history)")


def expected_runtime(session: ComputeSession, request: core.ResourceRequest, facts: _Facts) -> Runtime:
    """How long a PENDING `session` would run once started (the same sources as
    `expected_end`, from its start): a batch history's band, an idle timeout (earliest) and
    the maximum lifetime of the resource group it asks for (the policy of nodes in no group
    for a request naming none)."""
    policy = facts.policy(facts.groups.get(request.resource_group) if request.resource_group else None)
    cap = float(policy.max_lifetime) if policy and policy.max_lifetime else None
    if session.command:
        band, named = facts.history.band(facts.job(session))
        if band is not None:
            return Runtime(min(band[0], cap or band[0]), min(band[1], cap or band[1]), named)
    elif policy and policy.idle_timeout:
        early = float(policy.idle_timeout + policy.grace)
        return Runtime(min(early, cap or early), cap, f"idle timeout of {_hours(policy.idle_timeout)}")
    if cap is not None:
        return Runtime(cap, cap, f"maximum lifetime of {_hours(policy.max_lifetime)}")
    return Runtime(None, None, "no declared end")


@dataclass
class _Holding:
    slot: str  # "": CPU and memory only, or a MIG instance or slice (in every slot's scopes)
    node_id: str
    cpu: int
    mem: int
    grants: tuple[core.DeviceGrant, ...]


@dataclass
class _Read:
    """What `_ReplayView` copies (`_Queue` reads it from the database; a test may build it in
    memory): `scopes` ((resource group, slot, image) → PlacementScope), `mig_scopes` ((resource
    group, image) → mig_scheduling.MigScope), `holdings` (session key → what it holds),
    `policies` and `drain` (node names that take no session: the what-if's), the slot settings
    and image reasons."""

    scopes: dict[tuple, PlacementScope]
    holdings: dict[str, _Holding]
    mig_scopes: dict[tuple, mig_scheduling.MigScope] = field(default_factory=dict)
    policies: dict[str, str] = field(default_factory=dict)
    reader: ReadView = field(default_factory=RememberingReadView)
    drain: frozenset[str] = frozenset()

    def settings(self, request):
        return self.reader.settings(request)

    def image_missing(self, image: str) -> str:
        return self.reader.image_missing(image)


class _ReplayView(ReadView):
    """`placement_decide`'s view in a replay: every scope the queue needs, read once without
    locks (`_Queue`), copied per replay and kept current with the replay's placements and
    ends; slot settings and image reasons read once; MIG choices by the pass's own
    (`mig_scheduling.mig_choose_in`) on a copy of the MIG nodes (`MigNodeRoom`, one per node
    shared by every MIG scope holding it), which every placement and end on a MIG node keeps
    current (CPU cores and memory, allocations, GPU instances); `policies` (resource group name,
    "" for requests naming none → placement policy) replaces the groups' own (the what-if)."""

    def __init__(self, base: _Read):
        self.base = base
        self.scopes: dict[tuple, PlacementScope] = {key: self._copy(scope) for key, scope in base.scopes.items()}
        self.holdings: dict[str, _Holding] = dict(base.holdings)
        self.rooms: dict[str, mig_scheduling.MigNodeRoom] = {}  # node pk text → its MIG room, shared by the MIG scopes
        self.mig_scopes = {key: self._copy_mig(scope) for key, scope in base.mig_scopes.items()}
        self.rooms_by_name = {room.node.name: room for room in self.rooms.values()}
        self.around = Reservations()  # the replay pass's backfill reservations (`_Room.place_around`)
        self.end: float | None = None  # when the session being placed would end at the latest

    def _copy(self, scope: PlacementScope) -> PlacementScope:
        """A copy of `scope` this replay may change: the what-if's placement policy, without
        the drained nodes; with a copy of each cluster index `scope` holds (`ClusterIndex.copy`:
        numpy arrays, where building one walks every device of 1,000 nodes), of the nodes left
        where some were drained (`_index_of_rows`)."""
        options = dict(scope.options)
        if scope.group_name in self.base.policies:
            options["policy"] = self.base.policies[scope.group_name]
        keep = [i for i, n in enumerate(scope.nodes) if n.node_id not in self.base.drain]
        nodes = [scope.nodes[i] for i in keep]
        same = len(nodes) == len(scope.nodes)
        indexes = list(scope.indexes.items())
        return PlacementScope(
            group_name=scope.group_name,
            slot=scope.slot,
            nodes=nodes,
            options=options,
            rows={n.node_id: i for i, n in enumerate(nodes)} if not same else dict(scope.rows),
            indexes={key: index.copy() for key, index in indexes}
            if same
            else {key: _index_of_rows(index, keep, nodes) for key, index in indexes},
        )

    def _copy_mig(self, scope: mig_scheduling.MigScope) -> mig_scheduling.MigScope:
        copied = scope.copy(self.rooms)
        if not self.base.drain:
            return copied
        return replace(copied, rooms=[r for r in copied.rooms if r.node.name not in self.base.drain])

    def settings(self, request):
        return self.base.settings(request)

    def image_missing(self, image: str) -> str:
        return self.base.image_missing(image)

    def mig(self, request, image: str):
        """The pass's MIG choice on the replay's MIG nodes; raises as `mig_scheduling.mig_choose`
        (and InsufficientResource while a reservation holds the MIG GPUs, as the pass's view)."""
        held = self.around.of_mig()
        if held is not None:
            raise InsufficientResource(held.blocked_reason())
        return mig_scheduling.mig_choose_in(self.mig_scope(request, image), request)

    def mig_scope(self, request, image: str) -> mig_scheduling.MigScope:
        """The request's MIG scope; one the queue's read lacks is read now (an unknown group
        raises InvalidResourceRequest, as a real read does)."""
        key = (request.resource_group, image)
        if key not in self.mig_scopes:
            self.mig_scopes[key] = self._copy_mig(
                mig_scheduling.mig_scope_read(resource_group=request.resource_group, image=image)
            )
            self.rooms_by_name = {room.node.name: room for room in self.rooms.values()}
        return self.mig_scopes[key]

    def scope(self, request, image: str) -> PlacementScope:
        """The request's scope; one the queue's read lacks is read now (an unknown group raises
        InvalidResourceRequest, as a real read does)."""
        key = (request.resource_group, request.slot or "cuda", image)
        if key not in self.scopes:
            self.scopes[key] = self._copy(PlacementScope.read(request, image=image))
        return self.scopes[key]

    def place(self, request, pure_settings, image: str) -> core.Placement:
        return self.scope(request, image).place_around(request, pure_settings, self.around, self.end)

    def take(self, key: str, request, image: str, placement: core.Placement) -> None:
        """Queued session `key`'s placement takes its room (in every scope of its slot, and its
        node's MIG room)."""
        scope = self.scope(request, image)
        node = core.apply_placement(scope.nodes[scope.rows[placement.node_id]], request, placement)
        self._update(scope.slot, node)
        self.holdings[key] = _Holding(scope.slot, placement.node_id, request.cpu, request.mem, placement.grants)
        room = self.rooms_by_name.get(placement.node_id)
        if room is not None:
            room.take(key, cpu=request.cpu, mem=request.mem, devices=tuple(g.device_id for g in placement.grants))

    def take_mig(self, key: str, request, choice) -> None:
        """Queued session `key`'s MIG choice (`mig_choose_in`'s) takes its instance or slice in
        its node's MIG room, and its CPU cores and memory in every scope holding the node."""
        room = self.rooms[str(choice.node.pk)]
        room.take(key, cpu=request.cpu, mem=request.mem, choice=choice)
        done: set = set()
        for scope in self.scopes.values():
            if room.node.name not in scope.rows or scope.slot in done:
                continue
            node = scope.nodes[scope.rows[room.node.name]]
            self._update(scope.slot, replace(node, cpu_used=node.cpu_used + request.cpu, mem_used=node.mem_used + request.mem))
            done.add(scope.slot)
        self.holdings[key] = _Holding("", room.node.name, request.cpu, request.mem, ())

    def release(self, key: str) -> None:
        """What `key` holds comes free (in every scope of its slot; CPU-only: of every slot)."""
        held = self.holdings.pop(key, None)
        if held is None:
            return
        done: set = set()
        for scope in self.scopes.values():
            if (held.slot and scope.slot != held.slot) or held.node_id not in scope.rows or scope.slot in done:
                continue
            node = scope.nodes[scope.rows[held.node_id]]
            self._update(scope.slot, core.release_placement(node, cpu=held.cpu, mem=held.mem, grants=held.grants))
            done.add(scope.slot)
        room = self.rooms_by_name.get(held.node_id)
        if room is not None:
            room.release(key, cpu=held.cpu, mem=held.mem)

    def _update(self, slot: str, node: core.NodeState) -> None:
        """`node` (after a placement or an end) in every scope of `slot` and their cluster
        indexes: `PlacementScope.update`, with only the devices that changed (not the same
        objects: `apply_placement` and `release_placement` keep the others) converted to the
        index's units again (`_row_after`: a replay of 1,000 placements converted 8,000)."""
        for scope in self.scopes.values():
            row = scope.rows.get(node.node_id) if scope.slot == slot else None
            if row is None:
                continue
            before, scope.nodes[row] = scope.nodes[row], node
            for pure_settings, index in scope.indexes.items():
                index.set_row(row, **_row_after(index, row, before, node, pure_settings))


def _row_after(index: cluster.ClusterIndex, row: int, before: core.NodeState, node: core.NodeState, pure_settings) -> dict:
    """`core.node_row(node, pure_settings)` for `index`'s `row`, which holds `before`'s figures:
    the free units of the devices `node` shares with `before` (the same objects, in the same
    places) are the row's; the others' are converted (`core.device_units`, as `core.node_row` does)."""
    if len(before.devices) != len(node.devices):
        return core.node_row(node, pure_settings)
    free = index.free[row, : len(node.devices)].tolist()
    for j, (old, new) in enumerate(zip(before.devices, node.devices)):
        if old is not new:
            free[j] = core.device_units(new, pure_settings)[0]
    return {
        "cpu_free": node.cpu_total - node.cpu_used,
        "mem_free": node.mem_total - node.mem_used,
        "free": free,
        "memory_free": sum(d.memory_total - d.memory_used for d in node.devices),
    }


class _Room:
    """`replay.Room` over a `_ReplayView`: a queued session fits when `placement_decide` says
    PLACED. `requests` and `images`: the queued sessions' (by key); `where`: the node each
    placed one went to (key → node name)."""

    def __init__(self, base: _Read, requests: dict[str, core.ResourceRequest], images: dict[str, str]):
        self.requests, self.images = requests, images
        self.view = _ReplayView(base)
        self.where: dict[str, str] = {}

    def place(self, key: str) -> tuple[str, str]:
        request, image = self.requests[key], self.images[key]
        decision = placement_decide(request=request, image=image, view=self.view)
        if decision.outcome == PLACED and decision.mig is not None:
            self.view.take_mig(key, request, decision.mig)
            self.where[key] = decision.mig.node.name
            return pure.PLACED, ""
        if decision.outcome == PLACED and decision.placement is not None:
            self.view.take(key, request, image, decision.placement)
            self.where[key] = decision.placement.node_id
            return pure.PLACED, ""
        if decision.outcome == WAITING:
            return pure.WAITING, decision.reason
        return pure.NEVER, decision.reason or decision.outcome

    def release(self, key: str) -> None:
        self.view.release(key)

    def place_around(self, key: str, reservations: Reservations, end: float | None) -> tuple[str, str]:
        """`place` where it delays none of a replay pass's `reservations` (`replay.ReservingRoom`)."""
        self.view.around, self.view.end = reservations, end
        try:
            return self.place(key)
        finally:
            self.view.around, self.view.end = Reservations(), None

    def reserve(self, key: str, *, name: str, ends: dict, now: float, earlier: list[Reservation]) -> Reservation | None:
        """Where queued `key` reserves on its scope as this replay left it (`reservation_find`, the
        pass's rule in `sessions.scheduling.backfill`); a MIG request holds the MIG GPUs."""
        request, image = self.requests[key], self.images[key]
        if mig_scheduling.wants_mig(request):
            return Reservation.mig(key, name)
        try:
            pure_settings, scope = self.view.settings(request), self.view.scope(request, image)
        except AllocationError:
            return None
        return reservation_find(
            scope.nodes,
            key=key,
            name=name,
            request=request,
            settings=pure_settings,
            options=scope.options,
            holdings=self.view.holdings,
            ends=ends,
            now=now,
            earlier=earlier,
        )


def _index_of_rows(index: cluster.ClusterIndex, keep: list[int], nodes: list[core.NodeState]) -> cluster.ClusterIndex:
    """The cluster index `core.cluster_index` builds of `nodes`, the nodes of `index`'s rows
    `keep` (in that order), taken from `index`'s figures instead of their devices walked again
    (a what-if's drain: 1,000 nodes less one)."""
    width = max((len(n.devices) for n in nodes), default=0) or 1
    models = {i: name for name, i in index.model_ids.items()}
    return cluster.ClusterIndex(
        names=[index.names[r] for r in keep],
        cpu_total=index.cpu_total[keep],
        mem_total=index.mem_total[keep],
        cpu_free=index.cpu_free[keep],
        mem_free=index.mem_free[keep],
        models=[models[m] for m in index.model[keep].tolist()],
        cap=index.cap[keep, :width],
        free=index.free[keep, :width],
        memory_total=index.memory_total[keep],
        memory_free=index.memory_free[keep],
        device_memory=index.device_memory[keep],
    )


_scopes_kept: dict[tuple, PlacementScope] = {}  # the last read's scopes with their indexes (`_index_followed`)


def _totals(node: core.NodeState) -> tuple:
    """What a node's row in a cluster index holds besides its free figures (`core.cluster_index`):
    its CPU and memory, and its devices' sizes in order."""
    return node.cpu_total, node.mem_total, tuple((d.memory_total, d.proc_total) for d in node.devices)


def _index_followed(previous: PlacementScope | None, scope: PlacementScope, pure_settings) -> cluster.ClusterIndex | None:
    """`scope`'s cluster index for `pure_settings` from the one `previous` (the last read's scope
    of the same key) built: a copy with the rows of the nodes that changed since set anew
    (`ClusterIndex.set_row`, as a replay keeps its copy current) — a few nodes after a session
    starts or ends, where building one walks every device of 1,000 nodes (issue 35.2). None
    where it cannot follow: no previous index, other options, other nodes or node order, or a
    node whose CPU, memory or devices changed (not only what is free of them): built anew."""
    if previous is None or pure_settings not in previous.indexes or previous.options != scope.options:
        return None
    if len(previous.nodes) != len(scope.nodes) or len(previous.indexes[pure_settings]._state_ids) > 8 * len(scope.nodes) + 64:
        return None  # (states met since it was built are kept in it: a long-followed index starts afresh)
    changed = []
    for row, (old, new) in enumerate(zip(previous.nodes, scope.nodes)):
        if old is new or old == new:
            continue
        if old.node_id != new.node_id or _totals(old) != _totals(new):
            return None
        changed.append(row)
    index = previous.indexes[pure_settings].copy()
    for row in changed:
        index.set_row(row, **core.node_row(scope.nodes[row], pure_settings))
    return index


class _Queue:
    """The queue and the cluster as they stand, read once (no locks) for any number of
    replays: the PENDING sessions in the pass's order, their requests and expected runtimes,
    the active sessions' holdings and expected ends, and every scope the queue needs."""

    _pending_read: list[ComputeSession]
    _active_read: list[ComputeSession]
    _facts: _Facts
    _grants: dict[str, list]
    limits: dict[str, int]

    def __init__(
        self,
        *,
        now: datetime | None = None,
        weights: dict[str, int] | None = None,
        policies: dict[str, str] | None = None,
        backfill_limit: int | None = None,
        drain: frozenset[str] = frozenset(),
        extra: ComputeSession | None = None,
        base: _Queue | None = None,
    ):
        """`base`: a queue read at the same `now` (without `extra`) whose database reads this one
        takes instead of reading again (the what-if's changed queue beside today's): the
        sessions, the facts, the allocations, the scopes and the requests; only the order, the
        drain's moves and the policies are its own."""
        self.now = now or timezone.now()
        self.policies = policies or {}
        self.drain = drain
        self.backfill_limit = settings.FGPU_BACKFILL_LIMIT if backfill_limit is None else backfill_limit
        if base is not None:
            self._pending_read, self._active_read = base._pending_read, base._active_read
        else:  # only the sessions written since the last read are read whole (`kept_sessions`)
            self._pending_read, self._active_read = queue_read()
        pending = list(self._pending_read)
        if extra is not None:  # a request not launched (the preview): it joins the queue now, in its place
            pending.append(extra)
        active = list(self._active_read)
        # a drain stops the sessions on the drained nodes and requeues them by arrival (as a compaction's moves)
        self.moved = [s for s in active if s.node is not None and s.node.name in drain and s.status != SessionStatus.TERMINATING]
        active = [s for s in active if s not in self.moved]
        pending += self.moved
        factors = fairshare.owner_factors({s.owner_id for s in pending}, now=self.now, weights=weights)
        pending.sort(key=lambda s: fairshare.queue_key(s, factors))
        self.pending = pending
        self.active = {str(s.pk): s for s in active}
        # the same sessions whatever the drain moves: pending + active is the read's either way
        facts = base._facts if base is not None else _Facts(now=self.now, sessions=pending + active)
        self._facts = facts
        self.requests: dict[str, core.ResourceRequest] = {}
        self.images: dict[str, str] = {}
        self.runtimes: dict[str, Runtime] = {}
        self.never: dict[str, str] = {}
        for session in pending:
            key = str(session.pk)
            if base is not None and key in base.requests:
                self.requests[key], self.images[key] = base.requests[key], base.images[key]
                self.runtimes[key] = base.runtimes[key]
                continue
            if base is not None and key in base.never:
                self.never[key] = base.never[key]
                continue
            try:
                self.requests[key] = session_request(session)
            except AllocationError as exc:  # a stored request no longer valid
                self.never[key] = str(exc)
                continue
            self.images[key] = session.image.reference if session.image else ""
            self.runtimes[key] = expected_runtime(session, self.requests[key], facts)
        self.ends = {key: expected_end(s, facts) for key, s in self.active.items()}
        self.holdings: dict[str, _Holding] = {}
        grants: dict[str, list] = {}
        if base is not None:  # its active sessions are base's or fewer (a drain moves some)
            grants = base._grants
        else:  # the live allocations `queue_read` prefetched
            for s in active:
                live = getattr(s, "live", [])
                if live:
                    grants[str(s.pk)] = [core.DeviceGrant(str(a.device_id), a.shares, a.memory, a.procs) for a in live]
        self._grants = grants
        for key, s in self.active.items():
            if s.node is not None:
                self.holdings[key] = _Holding(s.slot_name, s.node.name, s.cpu, s.mem, tuple(grants.get(key, ())))
        # read without locks and never changed here (a replay copies them): base's are as good
        self.scopes: dict[tuple, PlacementScope] = dict(base.scopes) if base is not None else {}
        self.mig_scopes: dict[tuple, mig_scheduling.MigScope] = dict(base.mig_scopes) if base is not None else {}
        for key, request in self.requests.items():
            scope_key = (request.resource_group, request.slot or "cuda", self.images[key])
            try:
                if scope_key not in self.scopes:
                    self.scopes[scope_key] = PlacementScope.read(request, image=self.images[key])
                if mig_scheduling.wants_mig(request) and (request.resource_group, self.images[key]) not in self.mig_scopes:
                    self.mig_scopes[(request.resource_group, self.images[key])] = mig_scheduling.mig_scope_read(
                        resource_group=request.resource_group, image=self.images[key]
                    )
            except AllocationError:
                continue  # an unknown group: the decision says so
        # slot settings and image reasons read once for every replay
        self.read = _Read(self.scopes, self.holdings, self.mig_scopes, self.policies, RememberingReadView(), drain)
        for key, request in self.requests.items():  # each scope's cluster index built once, copied by each replay
            scope = self.scopes.get((request.resource_group, request.slot or "cuda", self.images[key]))
            try:
                pure_settings = self.read.settings(request)
            except AllocationError:
                continue
            if scope is not None and pure_settings not in scope.indexes:
                scope_key = (request.resource_group, request.slot or "cuda", self.images[key])
                followed = _index_followed(_scopes_kept.get(scope_key), scope, pure_settings) if base is None else None
                scope.indexes[pure_settings] = followed if followed is not None else scope.index(pure_settings)
        if base is None:
            with _kept_lock:
                _scopes_kept.clear()
                _scopes_kept.update(self.scopes)
        self.rooms: list[_Room] = []  # the replays' rooms: optimistic, pessimistic (the same where `one_way`)
        self._rooms: list[_Room] = []
        self._replays: list[pure.Replaying] = []
        self._replays_lock = threading.Lock()
        self.limits = base.limits if base is not None else runtime_limits()  # backfill's time limits (seconds), as the pass's

    def room(self) -> _Room:
        """A fresh `_Room` over the cluster as read (each replay changes its own copy)."""
        return _Room(self.read, self.requests, self.images)

    def queued(self, *, late: bool) -> list[pure.Queued]:
        out = []
        for place, session in enumerate(self.pending, start=1):
            key = str(session.pk)
            if key in self.never:
                continue
            runtime = self.runtimes[key]
            out.append(
                pure.Queued(
                    key=key,
                    shape=queue_shape(session),
                    overtaken=session.overtaken,
                    runtime=runtime.latest if late else runtime.earliest,
                    name=f"the session at place {place} in the queue",  # a reason names no one's session
                    limit=self.limits.get(self.requests[key].resource_group),
                )
            )
        return out

    def replaying(self, *, late: bool) -> pure.Replaying:
        """The optimistic (or the pessimistic: `late`) replay of the queue, made as far as it is
        asked (`replay.Replaying`); each is made once per read (the pessimistic one is the
        optimistic one where their inputs are the same: `one_way`)."""
        with self._replays_lock:
            if not self._replays:
                self._replays.append(self._new_replay(late=False))
                self._replays.append(self._replays[0] if self.one_way() else self._new_replay(late=True))
                self.rooms.extend([self._rooms[0], self._rooms[-1]])  # the moves' nodes (`where`): early, late
            return self._replays[1 if late else 0]

    def _new_replay(self, *, late: bool) -> pure.Replaying:
        ends = {key: (end.latest if late else end.earliest) for key, end in self.ends.items() if key in self.holdings}
        room = self.room()
        self._rooms.append(room)
        return pure.Replaying(
            self.queued(late=late), ends=ends, room=room, now=self.now.timestamp(), backfill_limit=self.backfill_limit
        )

    def replay(self, *, late: bool) -> pure.Replay:
        """The whole optimistic (or pessimistic) replay."""
        return self.replaying(late=late).finish()

    def one_way(self) -> bool:
        """Whether the optimistic and the pessimistic replay have the same inputs: every session
        holding room ends at one expected moment (or at none), and every queued one runs for one
        expected time (a maximum lifetime, a TERMINATING session, no declared end: a band of
        one point). A replay is deterministic: it is then made once (issue 35.2: each is 1,000
        placements on 1,000 nodes)."""
        held = all(self.ends[k].earliest == self.ends[k].latest for k in self.holdings if k in self.ends)
        return held and all(r.earliest == r.latest for r in self.runtimes.values())

    def band(self, key: str) -> pure.Band | None:
        """Queued session `key`'s ETA band from the two replays, each made only as far as `key`'s
        start (issue 35.2: the queue's head costs its own placement, not the queue's); None for a
        session not in the queue."""
        if key in self.never:
            return pure.Band(None, None, pure.NEVER, self.never[key])
        early = self.replaying(late=False).start(key)
        late = self.replaying(late=True).start(key)
        if early is None or late is None:
            return None
        return _band(early, late)

    def bands(self) -> dict[str, pure.Band]:
        """Every PENDING session's ETA band (key: its id): the whole replays."""
        early, late = self.replay(late=False), self.replay(late=True)
        out = {key: pure.Band(None, None, pure.NEVER, why) for key, why in self.never.items()}
        for key in early.starts:
            out[key] = _band(early.starts[key], late.starts[key])
        return out


def _band(early: pure.Start, late: pure.Start) -> pure.Band:
    """`replay.eta_band` with the reasons the ETA gives where a start or both are unknown."""
    band = pure.eta_band(early, late)
    if band.outcome == pure.PLACED and band.latest is None:
        return replace(band, reason=UNKNOWN_LATEST)
    if band.outcome == pure.WAITING and band.reason.startswith(CAPACITY):
        return replace(band, reason=f"{NO_KNOWN_END} ({band.reason})")
    return band


NO_KNOWN_END = (
    "no estimate: the sessions holding the room it needs have no declared end (no maximum lifetime, "
    "idle timeout or batch history)"
)
UNKNOWN_LATEST = (
    "the latest start is unknown: sessions holding the room it needs have no declared end "
    "(no maximum lifetime, idle timeout or batch history)"
)


def as_datetime(epoch: float | None) -> datetime | None:
    """Epoch seconds → an aware UTC datetime; None stays None."""
    return None if epoch is None else datetime.fromtimestamp(epoch, tz=dt_timezone.utc)


@dataclass(frozen=True)
class Eta:
    """One PENDING session's answer. `outcome`: "now" (fits now: starts at the next pass),
    "estimate" (a band: `earliest` … `latest`, `latest` None when unknown), "unknown" (no
    band: `reason` says why) or "never" (`reason`); `position` in the queue (1-based);
    `waiting_reason` the reason per node the last pass gave; `fits_after` the running sessions
    whose end would make it fit now (`FitsAfter`), soonest first; `computed_at`; `mig_now`, for
    a MIG request that does not fit now, the smaller MIG profiles it could get now
    (`mig_scheduling.MigOffer`, largest first)."""

    outcome: str
    earliest: datetime | None
    latest: datetime | None
    reason: str
    position: int
    waiting_reason: str
    fits_after: tuple
    fits_now: bool
    computed_at: datetime
    mig_now: tuple = ()


@dataclass(frozen=True)
class FitsAfter:
    """A session whose end would make room: its `session` (an ComputeSession), `node`, its
    expected `end` (`End`)."""

    session: ComputeSession
    node: str
    end: End


def band_outcome(band: pure.Band, now: float, *, fits_now: bool = True) -> str:
    """ "now", "estimate", "unknown" or "never" (see `Eta`); "now" only for a band at `now` of a
    request that fits now (`fits_now`: else sessions are due to end first, an "estimate")."""
    if band.outcome == pure.NEVER:
        return "never"
    if band.earliest is None:
        return "unknown"
    if band.earliest <= now and band.latest is not None and band.latest <= now and fits_now:
        return "now"
    return "estimate"


DUE = "it starts once the sessions holding its room end, which they are expected to do now (stopping, or past their expected end)"
AFTER_ENDS = "at the earliest when the sessions holding its room end; the latest start is unknown ({why})"


def band_agreed(band: pure.Band, *, fits_now: bool, after: list[FitsAfter], now: float) -> pure.Band:
    """`band` made to agree with what the same answer says beside it (issue 32.3: one story in
    the page, the API and the CLI): a request that does not fit now but whose band starts now
    gets `DUE` as its reason (never a bare "now" beside "fits now: no"); one with no band whose
    room is held by sessions with known ends (`after`) starts no earlier than the last of those
    ends: that is its earliest start, the latest unknown (`AFTER_ENDS`)."""
    if band.outcome == pure.NEVER or fits_now:
        return band
    if band.earliest is not None and band.earliest <= now and not band.reason:
        return replace(band, reason=DUE)
    if band.earliest is None and after and all(row.end.earliest is not None for row in after):
        earliest = max(now, *(row.end.earliest for row in after if row.end.earliest is not None))
        return pure.Band(earliest, None, pure.PLACED, AFTER_ENDS.format(why=band.reason or "the queue ahead of it"))
    return band


QUEUE_TTL_S = 30.0  # the longest one kept read of the queue and its replays serves (the clock moves on)


@dataclass
class _Kept:
    """One read of the queue (`_Queue`, with its two replays made as far as asked), kept for
    every ETA and what-if this process answers while they hold (`_queue_now`), with what was
    asked of them since: each session's `fits_after` and `mig_now` (key → answer) and each
    what-if's answer (its changes → `WhatIf`)."""

    stamp: tuple
    at: float
    queue: _Queue
    fits: dict[str, tuple[bool, list[FitsAfter], list]] = field(default_factory=dict)
    what_ifs: dict[tuple, WhatIf] = field(default_factory=dict)


_kept_lock = threading.Lock()
_kept: list[_Kept] = []  # the one kept read, or none


def queue_stamp() -> tuple:
    """What changes when any pending or active session is written (one aggregate query): how
    many there are, the sum of their versions (every transition bumps one) and the newest."""
    stamp = ComputeSession.objects.filter(status__in=(SessionStatus.PENDING, *ACTIVE_STATUSES)).aggregate(
        n=Count("pk"), versions=Sum("version"), newest=Max("created_at")
    )
    return stamp["n"], stamp["versions"], stamp["newest"]


def cluster_stamp() -> object:
    """What changes when the nodes the replays read change (a node drained, lost or added, an
    allocation made or released): the kept cluster view's version (`accelerators.cluster_view`,
    brought up to date from its change log); where this transaction wrote nodes itself (the
    view's overlay), the change log as this transaction sees it (its rows' count and ids' sum:
    the triggers write a row per node each write touches, in the writer's transaction). None on
    SQLite, which keeps no view or log: the queue's stamp and QUEUE_TTL_S alone hold there."""
    if connection.vendor != "postgresql":
        return None
    version = cluster_view().snapshot().version
    if version >= 0:
        return ("view", version)
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*), COALESCE(sum(id), 0) FROM accelerators_clusterchange")
        return ("log", *cursor.fetchone())


def _queue_now() -> _Kept:
    """The queue's kept read and its bands (`_Kept`), shared by every ETA and what-if this
    process answers while no pending or active session changed (`queue_stamp`) and the nodes
    did not (`cluster_stamp`), for up to QUEUE_TTL_S seconds: an open session page asks every
    15 s, and the read and the two replays are the whole queue's (seconds with 1,000 sessions
    on 1,000 nodes, issue 35.2), the same for every pending session; asked again, a dictionary
    read. A change read in either stamp is seen by the next answer: a new read."""
    stamp = (queue_stamp(), cluster_stamp())
    with _kept_lock:
        if _kept and _kept[0].stamp == stamp and time.monotonic() - _kept[0].at < QUEUE_TTL_S:
            return _kept[0]
    kept = _Kept(stamp=stamp, at=time.monotonic(), queue=_Queue())
    with _kept_lock:
        _kept[:] = [kept]
    return kept


def _kept_fits(kept: _Kept, key: str) -> tuple[bool, list[FitsAfter], list]:
    """`_fits_after` and `_mig_now` of queued `key` on the kept read, each worked out once."""
    found = kept.fits.get(key)
    if found is None:
        fits_now, after = _fits_after(kept.queue, key)
        found = kept.fits[key] = (fits_now, after, [] if fits_now else _mig_now(kept.queue, key))
    return found


def session_eta(*, session: ComputeSession, now: datetime | None = None) -> Eta:
    """The ETA of a PENDING `session` (module docstring): its band from the two replays of the
    whole queue, its place in the queue, the last pass's reason, and which running sessions'
    ends would make it fit now (`fits_after`). Reads without locks; writes nothing."""
    key = str(session.pk)
    if now is None:
        kept = _queue_now()
        queue = kept.queue
        fits_now, after, mig_now = _kept_fits(kept, key)
    else:
        queue = _Queue(now=now)
        fits_now, after = _fits_after(queue, key)
        mig_now = [] if fits_now else _mig_now(queue, key)
    band = queue.band(key) or pure.Band(None, None, pure.WAITING, "it is no longer waiting")
    position = next((i + 1 for i, s in enumerate(queue.pending) if str(s.pk) == key), 0)
    band = band_agreed(band, fits_now=fits_now, after=after, now=queue.now.timestamp())
    return Eta(
        mig_now=tuple(mig_now),
        outcome=band_outcome(band, queue.now.timestamp(), fits_now=fits_now),
        earliest=as_datetime(band.earliest),
        latest=as_datetime(band.latest),
        reason=band.reason,
        position=position,
        waiting_reason=session.status_reason,
        fits_after=tuple(after),
        fits_now=fits_now,
        computed_at=queue.now,
    )


def request_eta(
    *,
    owner,
    request: core.ResourceRequest,
    image=None,
    command: str = "",
    priority: int = 0,
    fits_now: bool | None = None,
    now: datetime | None = None,
) -> tuple[pure.Band, int, str]:
    """When a request not launched would start if it were launched now (issue 32.4: the launch
    preview): the queue replayed as `session_eta` replays it, with the request joining it now
    in its place (priority, its owner's fair share, arrival: last among equals). `request`: the
    normalised request; `image`: a SessionImage or None; `fits_now`: the preview's own answer
    (None: judged here). Returns (its band, its place in the queue (1-based), `band_outcome`).
    Reads without locks; writes nothing."""
    now = now or timezone.now()
    session = ComputeSession(
        owner=owner,
        name="this request",
        request_spec=request_to_spec(request),
        command=command,
        image=image,
        priority=priority,
        created_at=now,
    )
    queue = _Queue(now=now, extra=session)
    key = str(session.pk)
    band = queue.band(key) or pure.Band(None, None, pure.WAITING, "")
    position = next((i + 1 for i, s in enumerate(queue.pending) if str(s.pk) == key), 0)
    fits, after = _fits_after(queue, key)
    fits = fits if fits_now is None else fits_now
    band = band_agreed(band, fits_now=fits, after=after, now=now.timestamp())
    return band, position, band_outcome(band, now.timestamp(), fits_now=fits)


def _fits_after(queue: _Queue, key: str) -> tuple[bool, list[FitsAfter]]:
    """Whether queued session `key` fits on the cluster as it is now (the queue aside), and if
    not, the running sessions on its nodes whose ends make it fit: taken in order of their
    expected end (the first FITS_AFTER_MAX) until it fits, then those it fits without dropped.
    The nodes are its scope's and, for a MIG request, its MIG scope's (ends there free a GPU
    instance or slice as `MigNodeRoom.release` does). Empty when none would: it waits for
    something else (an image), or never fits."""
    if key not in queue.requests:
        return False, []
    if queue.room().place(key)[0] == pure.PLACED:
        return True, []
    request, image = queue.requests[key], queue.images[key]
    scope = queue.scopes.get((request.resource_group, request.slot or "cuda", image))
    nodes = set(scope.rows) if scope is not None else set()
    if mig_scheduling.wants_mig(request):
        if request.isolation != "any":
            nodes = set()  # a MIG-only request: only the MIG nodes' ends make room
        mig_scope = queue.mig_scopes.get((request.resource_group, image))
        nodes |= {room.node.name for room in mig_scope.rooms} if mig_scope is not None else set()
    near = [k for k, held in queue.holdings.items() if held.node_id in nodes]
    order = sorted(near, key=lambda k: (queue.ends[k].earliest is None, queue.ends[k].earliest or 0.0, k))
    taken: list[str] = []
    room = queue.room()  # ends taken one after another: a placement that fails changes nothing
    for other in order[:FITS_AFTER_MAX]:
        taken.append(other)
        room.release(other)
        if room.place(key)[0] == pure.PLACED:
            break
    else:
        return False, []
    needed = list(taken)
    for other in reversed(taken):  # drop those it fits without
        trial = queue.room()
        for k in needed:
            if k != other:
                trial.release(k)
        if trial.place(key)[0] == pure.PLACED:
            needed.remove(other)
    return False, [FitsAfter(queue.active[k], queue.holdings[k].node_id, queue.ends[k]) for k in needed]


def _mig_now(queue: _Queue, key: str) -> list[mig_scheduling.MigOffer]:
    """For queued MIG request `key`, the smaller MIG profiles free now (`mig_smaller_now` on the
    MIG nodes as read); empty for other requests."""
    request = queue.requests.get(key)
    if request is None or not mig_scheduling.wants_mig(request):
        return []
    scope = queue.mig_scopes.get((request.resource_group, queue.images[key]))
    return mig_scheduling.mig_smaller_now(scope, request) if scope is not None else []


# --- what-if (issue 17.5) --------------------------------------------------------------------------


@dataclass(frozen=True)
class WhatIfRow:
    """One PENDING session under today's rules and under the what-if's: its place in each queue
    and each band; `change` "sooner", "later", "same" or "unknown" (compared by the earliest
    start, then the latest)."""

    session: ComputeSession
    position_today: int
    position_what_if: int
    today: pure.Band
    what_if: pure.Band
    change: str


def _compare(today: pure.Band, other: pure.Band) -> str:
    def key(band: pure.Band):
        if band.outcome == pure.NEVER or band.earliest is None:
            return None
        return band.earliest, float("inf") if band.latest is None else band.latest

    a, b = key(today), key(other)
    if a is None or b is None:
        return "same" if a == b and today.outcome == other.outcome else "unknown"
    return "same" if a == b else ("sooner" if b < a else "later")


@dataclass(frozen=True)
class WhatIfMove:
    """A running session a drain would stop and requeue: its `session`, the drained node it
    runs on (`from_node`), its band to start again (`what_if`, from the moment of the drain) and
    the node each replay starts it on (`to_early`, `to_late`; "" where it does not start)."""

    session: ComputeSession
    from_node: str
    what_if: pure.Band
    to_early: str
    to_late: str


@dataclass(frozen=True)
class WhatIf:
    """`scheduler_what_if`'s answer: `rows` (every PENDING session, in today's queue order),
    `moves` (the running sessions a drain stops and requeues, in arrival order) and
    `computed_at` (the moment both queues were replayed from; None: not said)."""

    rows: list[WhatIfRow]
    moves: list[WhatIfMove]
    computed_at: datetime | None = None


def scheduler_what_if(
    *,
    weights: dict[str, int] | None = None,
    policies: dict[str, str] | None = None,
    backfill_limit: int | None = None,
    drain: frozenset[str] = frozenset(),
    now: datetime | None = None,
) -> WhatIf:
    """Replay the current queue today and under the changes — `weights` (project name → fair-share
    weight, 1 … fairshare.MAX_SHARE_WEIGHT), `policies` (resource group name, "" for requests
    naming none → placement policy, `accelerators.allocation.cluster.POLICIES`), `backfill_limit`
    (FGPU_BACKFILL_LIMIT's value), `drain` (node names: they take no new session, and their
    running sessions are stopped and requeued by arrival with their request, as `kubectl drain`
    evicts pods and a compaction moves sessions) — and return each PENDING session's place and
    band under both, in today's queue order, and where and when each drained session would
    start again. Nothing is written. The caller checks the names (`what_if_validate`).

    Without `now`, today's queue and bands are the kept read the ETAs share (`_queue_now`: read
    again only after a change) and the answer is kept with it, so the same what-if asked again
    before a change costs a dictionary read; `computed_at` says from when."""
    if now is not None:
        today = _Queue(now=now)
        return _what_if(today, today.bands(), weights=weights, policies=policies, backfill_limit=backfill_limit, drain=drain)
    kept = _queue_now()
    key = (
        tuple(sorted((weights or {}).items())),
        tuple(sorted((policies or {}).items())),
        backfill_limit,
        tuple(sorted(drain)),
    )
    found = kept.what_ifs.get(key)
    if found is None:
        found = _what_if(
            kept.queue, kept.queue.bands(), weights=weights, policies=policies, backfill_limit=backfill_limit, drain=drain
        )
        with _kept_lock:
            kept.what_ifs[key] = found
    return found


def _what_if(
    today: _Queue,
    bands_today: dict[str, pure.Band],
    *,
    weights: dict[str, int] | None,
    policies: dict[str, str] | None,
    backfill_limit: int | None,
    drain: frozenset[str],
) -> WhatIf:
    """`scheduler_what_if` against `today` (read at its `now`) and its `bands_today`."""
    changed = _Queue(now=today.now, weights=weights, policies=policies, backfill_limit=backfill_limit, drain=drain, base=today)
    bands_changed = changed.bands()
    where = {str(s.pk): i + 1 for i, s in enumerate(changed.pending)}
    rows = []
    for i, session in enumerate(today.pending):
        key = str(session.pk)
        a = bands_today.get(key, pure.Band(None, None, pure.WAITING, "no longer waiting"))
        b = bands_changed.get(key, pure.Band(None, None, pure.WAITING, "no longer waiting"))
        rows.append(WhatIfRow(session, i + 1, where.get(key, 0), a, b, _compare(a, b)))
    early, late = changed.rooms[0].where, changed.rooms[1].where
    moves = [
        WhatIfMove(
            session,
            session.node.name if session.node else "",
            bands_changed.get(str(session.pk), pure.Band(None, None, pure.WAITING, "")),
            early.get(str(session.pk), ""),
            late.get(str(session.pk), ""),
        )
        for session in sorted(changed.moved, key=lambda s: (s.created_at, str(s.pk)))
    ]
    return WhatIf(rows, moves, today.now)
