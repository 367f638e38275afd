"""The scheduler: places PENDING sessions, first in first out, and never over-commits.

One pass, in one transaction: lock the pending sessions (oldest first); then, once per scope (a
resource group's nodes, for one slot) the first session of the pass needs, read its nodes and
their live usage from the kept cluster view (`accelerators.cluster_view`), with the scope's
cluster index kept between passes (`cluster_view.kept_index`). On PostgreSQL the scope is read
without locks (issue 35.2: locking 10,000 nodes' 90,000 rows was 4.3 s of a pass): only the
nodes and devices the pass places on are locked (pk order, so writers queue instead of
deadlocking), as it writes there, and before its commit the pass checks them as the database
then holds them (`_PassView.verify`); where another writer took their room meanwhile, the pass
is rolled back and runs again, its last try (and a pass that may preempt) locking every row of a
scope before reading it, as every pass did before. Each session is placed by the pure allocator
(`accelerators.allocation.core.place`) under its group's policy, on that in-memory view and its
vectorised index; the plan is written as Allocation rows, the session moves PENDING → SCHEDULED,
and the view is updated with the plan (`core.apply_placement`) in every scope holding that node,
so later sessions of the same pass see it. MIG requests alike (issue 34.4): their scope
(`mig_scheduling.MigScope`, one room per MIG node) is read and locked once per pass too, the
choice made on it in memory (`mig_scheduling.mig_choose_in`), and every placement, MIG or
shared, kept in the rooms and the scopes of its node. The pass's rows are written in a few bulk
statements (`_PassWrites`; a MIG choice's GPU instance and Allocation rows in placement order),
flushed before anything reads usage from the database again (a new scope). After commit, one
batch of page notices (`events.sessions_notify`: one query, one event loop for every group send)
and the agents' start messages through one broker connection (`_send_starts`): 1,000 sessions in
well under 10 s end to end on PostgreSQL (benchmarks/scheduler_db.py). For the
fragmentation-aware policies the pass also counts the request shapes it placed per resource
group (`PlacementShape`): the workload distribution those policies weigh by.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import partial

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import F, Field
from django.utils import timezone

import protocol
from accelerators.allocation import cluster, core
from accelerators.allocation.errors import AllocationError, InsufficientResource
from accelerators.allocation.replay import Backfill
from accelerators.allocation.reservation import Reservation, Reservations
from accelerators.cluster_view import NodeEntry, cluster_view, kept_index
from accelerators.models import Node, NodeStatus, PlacementShape
from accelerators.selectors import placed_rows_lock, resource_group_get, scope_rows_lock
from sessions.lifecycle import events
from sessions.scheduling import fairshare
from sessions.scheduling import mig as mig_scheduling
from sessions.scheduling import pass_metrics
from sessions.scheduling import preemption
from sessions.scheduling.backfill import reservation_for
from sessions.models import NEXT_VERSION, Allocation, ComputeSession, SessionStatus
from sessions.selectors import session_request
from sessions.scheduling.placement import (
    PLACED,
    WAITING,
    PlacementScope,
    RememberingReadView,
    placement_decide,
    queue_shape,
    runtime_limits,
    shape_prefix,
)
from sessions.lifecycle.start_spec import owner_projects, session_start_spec
from sessions.policy.shares import shared_mounts_by_user

log = logging.getLogger(__name__)


def schedule_pending(*, limit: int | None = None) -> list[str]:
    """Place pending sessions (every one, or the first `limit` by priority and arrival), highest
    priority first, then by their owners' fair-share factor (`sessions.scheduling.fairshare`: who used less
    of their share lately first), then in arrival order; every one not placed gets the reason it
    waits. Returns the ids scheduled.

    The pass's cost stays bounded however long the queue: placements only fill the cluster
    within a pass, so a request shape (its normalised request) that did not fit once does not
    fit later in the same pass, and the sessions of that shape behind it get the same reason
    without another placement attempt; reasons are written only where they changed, in bulk.

    Backfill with reservations (issue 32.1; Slurm's backfill): a session that does not fit now
    does not block the ones behind it, but each time a later session starts past it its
    `overtaken` count grows, and once that reaches FGPU_BACKFILL_LIMIT (0: at once) it reserves
    the node and devices it would get when the sessions there are expected to end, within its
    resource group, pins and image (`sessions.scheduling.backfill.reservation_for`); its reason says where
    and from when. Later sessions start anywhere they do not delay a reservation: elsewhere
    freely, on reserved devices (or the node's CPU and memory it needs) only when their
    resource group's maximum lifetime ends them before the reservation's time
    (`accelerators.allocation.reservation`); one kept off is told whose reservation it is.

    Preemption (FGPU_PREEMPTION): after the placements, the pass takes back notices no longer
    needed, stops the sessions whose notice ran out, and puts under notice the fewest
    preemptible sessions that make room for a blocked session of higher priority or of an
    under-share owner (`sessions.scheduling.preemption.preemption_pass`); such a waiting session's reason
    says so.

    Images: a session with a session image goes only to a node whose agent reports holding it
    (`accelerators.selectors.node_runs_image`); while no alive node does, it waits "waiting for a
    node with image <reference>". Sessions from before images (no image) may go to any node.

    Figures (issue 34.6, as Kueue's scheduler exports its cycles): every pass, even of an empty
    queue, is counted with its duration, the sessions it placed, left waiting and preempted
    (`sessions.scheduling.pass_metrics`, exported at /metrics); a pass with a queue logs one line with its
    phases: read (lock the queue), scopes (lock and read nodes, devices and MIG rooms), decide,
    preempt, write (the bulk writes) and commit (the commit, the agents' starts, the notices).
    """
    # Optimistic on PostgreSQL (issue 35.2): the scopes are read from the kept cluster view
    # without locks, and only the nodes and devices the pass places on are locked, as it writes
    # there; before its commit the pass checks them as the database now holds them
    # (`_PassView.verify`) and, where another writer took their room meanwhile, is rolled back and
    # runs again. The last try, and every pass that may preempt, locks every row it reads first.
    optimistic = connection.vendor == "postgresql" and not preemption.preemption_enabled()
    tries = _OPTIMISTIC_TRIES if optimistic else 0
    for attempt in range(tries + 1):
        try:
            return _schedule(limit=limit, lock_all=attempt == tries)
        except _Conflict as conflict:
            log.info("scheduler pass: %s; running it again (try %d of %d)", conflict, attempt + 2, tries + 1)
    raise AssertionError("unreachable: the last try locks everything it reads")


_OPTIMISTIC_TRIES = 2  # passes tried without locking every row read before one that does


class _Conflict(Exception):
    """A node a pass placed on changed under it (read without locks) so that its plan no longer
    holds: the pass is rolled back and runs again."""


def _schedule(*, limit: int | None, lock_all: bool) -> list[str]:
    """One try of `schedule_pending`; `lock_all`: lock every node and device row of a scope
    before reading it (else only those placed on, and `_PassView.verify` before the commit:
    raises _Conflict, everything rolled back, where that finds a plan no longer holds)."""
    backfill_limit = settings.FGPU_BACKFILL_LIMIT
    scheduled: list[str] = []
    starts: list[tuple[str, dict]] = []
    started = time.monotonic()
    with transaction.atomic():
        queue = (
            # Owners read in the same query (the start specs name them), but only sessions locked.
            ComputeSession.objects.select_for_update(of=("self",))
            .select_related("owner", "image")
            .filter(status=SessionStatus.PENDING)
            .order_by("-priority", "created_at", "pk")
        )
        pending = list(queue if limit is None else queue[:limit])
        if len({s.owner_id for s in pending}) > 1:  # fair share orders owners within a priority
            factors = fairshare.owner_factors({s.owner_id for s in pending})
            pending.sort(key=lambda s: fairshare.queue_key(s, factors))
        # Sessions that others are being preempted for keep saying so while they wait.
        preempting = preemption.waiting_reasons(pending) if preemption.preemption_enabled() and pending else {}
        read_at = time.monotonic()
        writes = _PassWrites(starts)
        view = _PassView(writes, lock_all=lock_all)
        backfill = Backfill(backfill_limit)
        view.around = backfill.reservations
        no_room: dict[str, str] = {}  # request shape → why it did not fit in this pass
        now = timezone.now()

        def reserve(waiting: ComputeSession | None = None, reason: str = "") -> None:
            """`waiting` (if given) waits for `reason`; the sessions now at the backfill limit
            reserve what they wait for, their reasons saying where (written once)."""
            if waiting is not None:
                backfill.block(waiting)
            due = backfill.due()
            for holder in due:
                found = _reservation(holder, view, now, backfill.reservations.held)
                base = reason if holder is waiting else holder.status_reason
                if found is not None:
                    backfill.reservations.add(found)
                writes.wait(holder, base if found is None else f"{base}; {found.held_reason()}")
            if waiting is not None and not any(holder is waiting for holder in due):
                writes.wait(waiting, reason)

        for session in pending:
            image = session.image.reference if session.image else ""
            shape = queue_shape(session)
            if shape in no_room:  # the same request did not fit earlier in this pass: nor does this one
                reserve(session, preempting.get(session.pk) or no_room[shape])
                continue
            if image and view.image_missing(image):
                no_room[shape] = view.image_missing(image)
                reserve(session, no_room[shape])
                continue
            request = session_request(session)
            view.end = view.end_of(request, now)
            decision = placement_decide(request=request, image=image, view=view)
            if decision.outcome == WAITING:
                no_room[shape] = decision.reason
                reserve(session, preempting.get(session.pk) or decision.reason)
                continue
            if decision.outcome != PLACED:  # no longer satisfiable (e.g. the slot's mode changed)
                session.status, session.status_reason, session.terminated_at = (
                    SessionStatus.ERROR,
                    decision.reason,
                    timezone.now(),
                )
                writes.changed(session, "status", "status_reason", "terminated_at")
                continue
            if decision.mig is not None:  # a MIG instance or slice (issue 4)
                view.commit_mig(str(session.pk), request, decision.mig)
                writes.place_mig(session, decision.mig)
            else:
                assert decision.placement is not None  # PLACED, not on MIG: a shared slice
                pure_settings = view.settings(request)
                view.commit(view.scope(request, image=image), request, pure_settings, decision.placement, key=str(session.pk))
                writes.place(session, decision.placement)
            scheduled.append(str(session.pk))
            for earlier in backfill.placed():  # backfilled past them
                writes.changed(earlier, "overtaken")
            reserve()
        writes.flush()
        preempt_at, other = time.monotonic(), writes.seconds + view.seconds  # its flushes and reads: their own phases
        preempted = _preempt(backfill.blocked if preemption.preemption_enabled() else [], view, writes)  # notices kept either way
        preempt_seconds = time.monotonic() - preempt_at - (writes.seconds + view.seconds - other)
        view.verify()  # raises _Conflict (all of it rolled back) where a plan no longer holds
        view.record_shapes()
        decided_at = time.monotonic()
        # The starts first: the agents do not wait for the pages' notices. An agent's RUNNING may
        # reach a page before SCHEDULED does; the page keeps the higher version (the newer state).
        if starts:
            transaction.on_commit(partial(_send_starts, list(starts)))
        events.sessions_notify(writes.notices)
    done = time.monotonic()
    waiting = len(pending) - len(scheduled)
    pass_metrics.pass_record(
        seconds=done - started, placed=len(scheduled), waiting=waiting, noticed=preempted["noticed"], stopped=preempted["stopped"]
    )
    if pending:  # one line a pass, with its phases (commit: the commit, the agents' starts and the pages' notices)
        log.info(
            "scheduler pass: %d pending, %d placed, %d waiting, %d preempted (%d request shapes without room) in %.0f ms "
            "(read %.0f, scopes %.0f, decide %.0f, preempt %.0f, write %.0f, commit %.0f)",
            len(pending),
            len(scheduled),
            waiting,
            preempted["noticed"],
            len(no_room),
            (done - started) * 1000,
            (read_at - started) * 1000,
            view.seconds * 1000,
            (decided_at - read_at - writes.seconds - view.seconds - preempt_seconds) * 1000,
            preempt_seconds * 1000,
            writes.seconds * 1000,
            (done - decided_at) * 1000,
        )
    return scheduled


def _reservation(session: ComputeSession, view: _PassView, now, earlier: list[Reservation]) -> Reservation | None:
    """`sessions.scheduling.backfill.reservation_for` on the pass's view (its writes flushed first: the
    sessions placed in this pass hold room too). None for a request no longer valid."""
    try:
        request = session_request(session)
        pure_settings = view.settings(request)
    except AllocationError:
        return None
    view.writes.flush()
    image = session.image.reference if session.image else ""
    return reservation_for(
        session=session,
        request=request,
        scope=lambda: view.scope(request, image=image),
        pure_settings=pure_settings,
        now=now,
        earlier=earlier,
        cache=view.held,
    )


def _preempt(blocked: list[ComputeSession], view: _PassView, writes: _PassWrites) -> dict[str, int]:
    """The pass's preemption work (`sessions.scheduling.preemption.preemption_pass`) on its view: each
    blocked session's scope as this pass left it (rows locked); the reasons of the sessions it
    preempts for written with the pass's. `blocked` empty (preemption off): only the notices
    given already (a compaction's) are kept, stopped at their time and requeued. Returns
    {"noticed": sessions put under notice, "stopped": sessions stopped}, for the pass's figures."""

    def scope(session: ComputeSession) -> PlacementScope:
        return view.scope(session_request(session), image=session.image.reference if session.image is not None else "")

    found = preemption.preemption_pass(blocked=blocked, scope_of=lambda s: scope(s).nodes, options_of=lambda s: scope(s).options)
    for session in blocked:
        if session.pk in found["for"]:
            writes.wait(session, found["for"][session.pk])
    writes.flush()
    return {"noticed": len(found["warned"]), "stopped": len(found["stopped"])}


class _PassWrites:
    """A pass's writes, held and then written in a few statements (`flush`): the placed
    sessions' Allocation rows (one bulk insert), their status (one bulk update per set of
    changed fields), waiting reasons, overtaken counts, and the pages' notices (one after-commit
    batch, `events.sessions_notify`). Flushed before anything reads usage from the database
    again (a new scope), so the pass never sees a state without its own plans."""

    def __init__(self, starts: list[tuple[str, dict]]):
        self.starts = starts
        self.placed: list[tuple[ComputeSession, core.Placement]] = []
        self.placed_mig: list[tuple[ComputeSession, mig_scheduling.MigChoice]] = []
        self.queued: list[ComputeSession] = []  # placed and not flushed, in placement order (their starts')
        self.dirty: dict = {}  # session pk → (session, set of changed fields)
        self.notices: list[ComputeSession] = []
        self.seconds = 0.0  # spent in flush, for the pass's log line

    def changed(self, session: ComputeSession, *fields: str) -> None:
        self.dirty.setdefault(session.pk, (session, set()))[1].update(fields)
        if "overtaken" not in fields:
            self.notices.append(session)

    def wait(self, session: ComputeSession, reason: str) -> None:
        if session.status_reason != reason:
            session.status_reason = reason
            self.changed(session, "status_reason")

    def place(self, session: ComputeSession, placement: core.Placement) -> None:
        session.status, session.status_reason, session.scheduled_at = SessionStatus.SCHEDULED, "", timezone.now()
        self.placed.append((session, placement))
        self.queued.append(session)
        self.changed(session, "node", "status", "status_reason", "scheduled_at")

    def place_mig(self, session: ComputeSession, choice: mig_scheduling.MigChoice) -> None:
        """A MIG choice (`mig_scheduling.mig_choose_in`'s, on the pass's view): the session's
        transition to SCHEDULED and its notice with the pass's other writes; at the flush, its
        GPU instance and Allocation rows (`mig_scheduling.mig_rows_write`, in placement order:
        each start's layout holds the instances planned before it), its reason saying what it
        got, and its agent's start spec with its `mig` block appended to `starts`."""
        session.node, session.status, session.scheduled_at = choice.node, SessionStatus.SCHEDULED, timezone.now()
        self.placed_mig.append((session, choice))
        self.queued.append(session)
        self.changed(session, "node", "status", "status_reason", "scheduled_at")

    def flush(self) -> None:
        began = time.monotonic()
        self._flush()
        self.seconds += time.monotonic() - began

    def _flush(self) -> None:
        owners = {session.owner_id for session, _ in [*self.placed_mig, *self.placed]}
        projects = owner_projects(owners) if owners else {}  # one query a flush
        shared = shared_mounts_by_user(owners, projects=projects)  # the folders shared with them: one more
        specs = self._write_mig(projects, shared) if self.placed_mig else {}
        if self.placed:
            specs.update(self._write_placements(projects, shared))
        self.starts.extend(specs[session.pk] for session in self.queued)
        self.queued.clear()
        by_fields: dict = {}
        for session, fields in self.dirty.values():
            if fields - {"overtaken"}:  # shown on the pages: a newer state
                session.version = NEXT_VERSION
                fields.add("version")
            by_fields.setdefault(tuple(sorted(fields)), []).append(session)
        for fields, sessions in by_fields.items():
            _sessions_update(sessions, fields)
        self.dirty.clear()

    def _write_mig(self, projects: dict, shared: dict) -> dict:
        """The MIG choices' rows, in placement order, and each session's reason. Returns
        {session pk: (node name, its start spec with the `mig` block)}."""
        specs = {}
        for session, choice in self.placed_mig:
            allocation, block, session.status_reason = mig_scheduling.mig_rows_write(session=session, choice=choice)
            spec = session_start_spec(
                session, [allocation], projects=projects.get(session.owner_id, []), shared=shared[session.owner_id]
            )
            if block is not None:
                spec["mig"] = block
            specs[session.pk] = (choice.node.name, spec)
        self.placed_mig.clear()
        return specs

    def _write_placements(self, projects: dict, shared: dict) -> dict:
        """The allocator's plans as Allocation rows and each session's node. Returns {session
        pk: (node name, its agent's start spec)}."""
        device_ids = {g.device_id for _, placement in self.placed for g in placement.grants}
        # Locked before their rows are written (a pass that read its scope without locks locks
        # these only), in the order every writer of placements takes them.
        devices = placed_rows_lock(node_names={p.node_id for _, p in self.placed}, device_ids=device_ids)
        bare = {p.node_id for _, p in self.placed if not p.grants}  # no device: CPU and memory only
        nodes = {n.name: n for n in Node.objects.filter(name__in=bare)} if bare else {}
        rows: list[Allocation] = []
        specs = {}
        for session, placement in self.placed:
            mine = [
                Allocation(session=session, device=devices[g.device_id], shares=g.shares, memory=g.memory, procs=g.procs)
                for g in placement.grants
            ]
            session.node = mine[0].device.node if mine else nodes[placement.node_id]
            rows += mine
            specs[session.pk] = (
                placement.node_id,
                session_start_spec(session, mine, projects=projects.get(session.owner_id, []), shared=shared[session.owner_id]),
            )
        Allocation.objects.bulk_create(rows, batch_size=1000)
        self.placed.clear()
        return specs


_PLAIN_TYPES = frozenset(
    {"CharField", "TextField", "DateTimeField", "IntegerField", "PositiveIntegerField", "BooleanField", "ForeignKey", "UUIDField"}
)


def _sessions_update(sessions: list[ComputeSession], fields: tuple[str, ...]) -> None:
    """Write `fields` of `sessions` as each holds them; "version" is raised by one in the
    database (`NEXT_VERSION`). On PostgreSQL one statement per 1,000 sessions (UPDATE … FROM
    unnest of one array per column): Django's bulk_update builds a CASE of one expression per
    session and field, which at 1,000 placed sessions cost most of a pass (27 s of 100 in a
    profile of issue 35's benchmark). Elsewhere, or for a field of another type, bulk_update."""
    columns = [_field(name) for name in fields if name != "version"]
    if connection.vendor != "postgresql" or any(f.get_internal_type() not in _PLAIN_TYPES for f in columns):
        ComputeSession.objects.bulk_update(sessions, list(fields), batch_size=500)
        return
    table = connection.ops.quote_name(ComputeSession._meta.db_table)
    pk = _field(ComputeSession._meta.pk.name if ComputeSession._meta.pk else "id")
    names = [connection.ops.quote_name(str(f.column)) for f in columns]
    sets = [f"{name} = v.{name}" for name in names]
    if "version" in fields:
        sets.append('"version" = t."version" + 1')
    arrays = ", ".join(f"%s::{f.db_type(connection)}[]" for f in [pk, *columns])
    sql = (
        f"UPDATE {table} AS t SET {', '.join(sets)} FROM unnest({arrays}) AS v(pk, {', '.join(names)}) "
        f"WHERE t.{connection.ops.quote_name(str(pk.column))} = v.pk"
    )
    with connection.cursor() as cursor:
        for start in range(0, len(sessions), 1000):
            batch = sessions[start : start + 1000]
            params = [[pk.get_db_prep_value(s.pk, connection) for s in batch]]
            params += [[f.get_db_prep_value(getattr(s, f.attname), connection) for s in batch] for f in columns]
            cursor.execute(sql, params)


def _field(name: str) -> Field:
    """ComputeSession's concrete field `name`."""
    found = ComputeSession._meta.get_field(name)
    assert isinstance(found, Field)
    return found


class _PassView(RememberingReadView):
    """How `placement_decide` reads the cluster in a pass: the scopes the pass has read and
    locked, by (resource group name, slot, image), and the MIG scopes, by (resource group name,
    image), kept current with the pass's plans (a node's MIG room shared by the MIG scopes
    holding it, as in the ETA's replay); slot settings and image reasons read once per pass
    (RememberingReadView)."""

    def __init__(self, writes: _PassWrites, *, lock_all: bool = True):
        super().__init__()
        self.writes = writes
        self.lock_all = lock_all  # lock each scope's rows before reading it (else: `verify`)
        self.placed_on: dict[str, tuple[PlacementScope, set[str]]] = {}  # node name → a scope of it, devices granted
        self.scopes: dict[tuple[str, str, str], PlacementScope] = {}
        self.placed: Counter = Counter()
        self.around = Reservations()  # the pass's backfill reservations: placements go around them
        self.end: float | None = None  # when the session being placed would end at the latest (epoch seconds)
        self._limits: dict[str, int] | None = None
        self.held: dict = {}  # backfill.reservation_for's read of the sessions on a node set, until a placement
        self.mig_scopes: dict[tuple[str, str], mig_scheduling.MigScope] = {}
        self.rooms: dict[str, mig_scheduling.MigNodeRoom] = {}  # node pk text → its MIG room
        self.rooms_by_name: dict[str, mig_scheduling.MigNodeRoom] = {}
        self.seconds = 0.0  # spent reading (and locking) scopes, for the pass's log line

    def end_of(self, request: core.ResourceRequest, now) -> float | None:
        """When a session of `request` started `now` ends at the latest: its resource group's
        maximum lifetime (`runtime_limits`, read once a pass, and only once a reservation
        exists); None: no limit."""
        if not self.around.held:
            return None
        if self._limits is None:
            self._limits = runtime_limits()
        limit = self._limits.get(request.resource_group)
        return None if limit is None else now.timestamp() + limit

    def mig(self, request, image: str) -> mig_scheduling.MigChoice:
        """The MIG choice for `request` (`mig_scheduling.mig_choose_in`) on the pass's MIG scope
        of its group and `image`, read and locked at its first request (the pass's writes
        flushed first); raises as `mig_scheduling.mig_choose` does, and InsufficientResource
        while a reservation holds the MIG GPUs. The pass keeps it (`commit_mig`) and writes it
        (`_PassWrites.place_mig`)."""
        held = self.around.of_mig()
        if held is not None:
            raise InsufficientResource(held.blocked_reason())
        key = (request.resource_group, image)
        if key not in self.mig_scopes:
            self.writes.flush()  # the usage read below must hold this pass's plans
            began = time.monotonic()
            read = mig_scheduling.mig_scope_read(resource_group=request.resource_group, image=image, lock=True)
            self.mig_scopes[key] = read.copy(self.rooms)  # a node's room already planned on stays
            self.rooms_by_name = {room.node.name: room for room in self.rooms.values()}
            self.seconds += time.monotonic() - began
        return mig_scheduling.mig_choose_in(self.mig_scopes[key], request)

    def commit_mig(self, key: str, request, choice: mig_scheduling.MigChoice) -> None:
        """Session `key`'s MIG `choice` takes its instance or slice in its node's MIG room, and
        its CPU cores and memory in every scope holding the node."""
        self.rooms[str(choice.node.pk)].take(key, cpu=request.cpu, mem=request.mem, choice=choice)
        self.held.clear()
        for slot in {s.slot for s in self.scopes.values()}:
            found = next((s for s in self.scopes.values() if s.slot == slot and choice.node.name in s.rows), None)
            if found is not None:
                node = found.nodes[found.rows[choice.node.name]]
                self._update(slot, replace(node, cpu_used=node.cpu_used + request.cpu, mem_used=node.mem_used + request.mem))

    def place(self, request: core.ResourceRequest, pure_settings, image: str) -> core.Placement:
        return self.scope(request, image=image).place_around(request, pure_settings, self.around, self.end)

    def scope(self, request: core.ResourceRequest, *, image: str = "") -> PlacementScope:
        """The nodes of the request's resource group and slot, only those holding `image` ("":
        every one), read and locked once per pass."""
        slot = request.slot or "cuda"
        key = (request.resource_group, slot, image)
        if key not in self.scopes:
            self.writes.flush()  # the usage read below must hold this pass's plans
            began = time.monotonic()
            # A node another scope of this pass already planned on: take that scope's view.
            latest = {n.node_id: n for s in self.scopes.values() if s.slot == slot for n in s.nodes}
            if connection.vendor == "postgresql":
                self.scopes[key] = _KeptScope.read_kept(request, image=image, lock=self.lock_all, latest=latest)
            else:  # SQLite: one writer at a time anyway; each scope read anew
                self.scopes[key] = PlacementScope.read(request, image=image, for_update=True, latest=latest)
            self.seconds += time.monotonic() - began
        return self.scopes[key]

    def verify(self) -> None:
        """A pass that read its scopes without locks (not `lock_all`), after its last write:
        the nodes it placed on, locked since it wrote there (`_PassWrites`), as the database now
        holds them with the pass's own rows (the kept view brought up to date after those locks)
        must still be what it placed on — the same node, alive and in service, in the same group,
        holding the image, with the same devices — and none of the devices it granted, nor the
        node's CPU and memory, over-committed. Another writer's placement there since the pass
        read the node shows as one. Raises _Conflict naming the first node that is not."""
        if self.lock_all or not self.placed_on:
            return
        entries = cluster_view().snapshot().entries
        for name, (scope, granted) in self.placed_on.items():
            assert isinstance(scope, _KeptScope)
            base = scope.entries[scope.rows[name]]
            problem = _plan_problem(base, entries.get(base.pk), scope.slot, scope.image, granted)
            if problem:
                raise _Conflict(f"node {name} {problem} since the pass read it")

    def commit(
        self, scope: PlacementScope, request: core.ResourceRequest, pure_settings, placement: core.Placement, *, key: str
    ) -> None:
        """Session `key`'s `placement` (a shared slice, or CPU only) in every scope of its slot
        and its node's MIG room."""
        node = core.apply_placement(scope.nodes[scope.rows[placement.node_id]], request, placement)
        self.placed_on.setdefault(placement.node_id, (scope, set()))[1].update(g.device_id for g in placement.grants)
        self.held.clear()  # the sessions on its nodes changed: a reservation reads them again
        self._update(scope.slot, node)
        room = self.rooms_by_name.get(placement.node_id)
        if room is not None:
            room.take(key, cpu=request.cpu, mem=request.mem, devices=tuple(g.device_id for g in placement.grants))
        shape = core.request_shape(request, pure_settings)
        self.placed[(scope.group_name, shape_prefix(scope.slot, pure_settings) + cluster.shape_key(shape))] += 1

    def _update(self, slot: str, node: core.NodeState) -> None:
        for scope in self.scopes.values():
            if scope.slot == slot:
                scope.update(node)

    def record_shapes(self) -> None:
        """Add this pass's placed shapes to PlacementShape (one row per group and shape)."""
        for (group_name, key), n in sorted(self.placed.items()):
            updated = PlacementShape.objects.filter(resource_group=group_name, key=key).update(count=F("count") + n)
            if updated:
                continue
            try:
                with transaction.atomic():
                    PlacementShape.objects.create(resource_group=group_name, key=key, count=n)
            except IntegrityError:  # another pass created it first
                PlacementShape.objects.filter(resource_group=group_name, key=key).update(count=F("count") + n)


@dataclass
class _KeptScope(PlacementScope):
    """A PlacementScope read from the kept cluster view (PostgreSQL), with the view's entries
    of its nodes (same rows) and its cluster index kept between passes
    (`accelerators.cluster_view.kept_index`) instead of built from every device each pass."""

    entries: list[NodeEntry] = field(default_factory=list)
    image: str = ""

    @classmethod
    def read_kept(cls, request: core.ResourceRequest, *, image: str, lock: bool, latest: dict[str, core.NodeState]) -> _KeptScope:
        """As `PlacementScope.read`; `lock` locks the scope's node and device rows first (as
        `node_states(for_update=True)`), else nothing is locked."""
        slot = request.slot or "cuda"
        group = resource_group_get(name=request.resource_group)
        if lock:
            scope_rows_lock(slot_name=slot, group=group, image=image)
        snapshot = cluster_view().snapshot()  # brought up to date after the locks, where taken
        entries = core.storage_scope(snapshot.nodes(group_id=group.pk if group else None, image=image))
        nodes = [latest.get(e.name) or e.state(slot) for e in entries]
        return cls.of_nodes(request, group, slot, nodes, entries=entries, image=image)

    def index(self, pure_settings):
        if pure_settings not in self.indexes:
            index = kept_index((self.group_name, self.slot, self.image), self.entries, self.slot, pure_settings)
            for row, (entry, node) in enumerate(zip(self.entries, self.nodes)):
                if node is not entry.state(self.slot):  # planned on already in this pass
                    index.set_row(row, **core.node_row(node, pure_settings))
            self.indexes[pure_settings] = index
        return self.indexes[pure_settings]


def _plan_problem(base: NodeEntry, fresh: NodeEntry | None, slot: str, image: str, granted: set[str]) -> str:
    """What makes a pass's plans on a node read as `base` no longer hold on it as it is now
    (`fresh`; None: deleted), with the pass's own plans: "" when nothing (`_PassView.verify`)."""
    if fresh is None:
        return "was deleted"
    if fresh.status != NodeStatus.ALIVE or fresh.draining:
        return "left service"
    if (fresh.group_id, fresh.shared_storage) != (base.group_id, base.shared_storage) or (image and not fresh.runs_image(image)):
        return "changed its resource group, storage or images"
    if fresh.kind(slot) != base.kind(slot):
        return "changed its devices"
    state = fresh.state(slot)
    if state.cpu_used > state.cpu_total or state.mem_used > state.mem_total:
        return "would be over-committed on CPU or memory"
    devices = {d.device_id: d for d in state.devices}
    for device_id in granted:
        d = devices.get(device_id)
        if d is None:
            return "no longer has a device it granted"
        if d.memory_used > d.memory_total or d.proc_used > d.proc_total or (d.max_sessions and d.sessions > d.max_sessions):
            return f"would have {d.label} over-committed"
    return ""


def _send_starts(starts: list[tuple[str, dict]]) -> None:
    """Send the agents' start messages (`fgpu.agent.session_start`, one per session, to queue
    `agent.<node>`) through one broker connection, in batches of up to 500 (kombu's publish
    batch: one Redis pipeline a batch instead of a round trip a message, 1,000 starts being a
    third of a 1,000-session pass before; a broker without batches sends each at once)."""
    from common.celery import agent_send, app

    with app.producer_or_acquire() as producer:
        try:
            with producer.batch(max_size=500):
                for node_name, spec in starts:
                    try:
                        agent_send(protocol.SESSION_START, producer=producer, node=node_name, spec=spec)
                    except Exception:  # the heartbeat's reconcile (sessions.lifecycle.reconcile) sends the start again
                        log.exception("could not send the start of session %s to %s", spec["session_id"], node_name)
        except Exception:  # a batch's write failed: the reconcile sends those starts again, as above
            log.exception("could not send the starts of %d session(s) in one batch", len(starts))


def pending_position(session: ComputeSession) -> int:
    """1-based place of a PENDING session in the queue (`fairshare.queue_key`: priority, then its
    owner's fair-share factor, then arrival)."""
    rivals = list(
        ComputeSession.objects.filter(status=SessionStatus.PENDING, priority=session.priority).only(
            "pk", "priority", "owner_id", "created_at"
        )
    )
    factors = fairshare.owner_factors({s.owner_id for s in rivals} | {session.owner_id})
    mine = fairshare.queue_key(session, factors)
    higher = ComputeSession.objects.filter(status=SessionStatus.PENDING, priority__gt=session.priority).count()
    return higher + sum(1 for s in rivals if fairshare.queue_key(s, factors) <= mine)
