"""The scheduler: places PENDING sessions, first in first out, and never over-commits.

One pass, in one transaction: lock the pending sessions (oldest first), then for each lock
the node and device rows (pk order, so concurrent passes queue instead of deadlocking),
read live usage, ask the pure allocator (`accelerators.allocation.core.place`) for a plan,
write the plan as Allocation rows and move the session PENDING → SCHEDULED. The start
message goes to the node's agent after commit. A session that does not fit now stops the
pass (strict FIFO: later, smaller sessions do not overtake it); it waits for capacity.
"""
from __future__ import annotations

import logging

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from accelerators.allocation import core
from accelerators.allocation.errors import AllocationError, InsufficientResource, NeverSchedulable
from accelerators.allocation.units import amount_text
from accelerators.models import Device, Node
from accelerators.selectors import placement_scope
from sessions import events
from sessions.models import Allocation, ComputeSession, SessionStatus
from sessions.selectors import session_request
from sessions.services import request_settings

log = logging.getLogger(__name__)


def schedule_pending(*, limit: int = 100) -> list[str]:
    """Place up to `limit` pending sessions, highest priority first, then in arrival order.
    Returns the ids scheduled.

    Backfill: a session that does not fit now does not block smaller ones behind it, but each
    time a later session starts past it its `overtaken` count grows, and once that reaches
    FGPU_BACKFILL_LIMIT nothing behind it starts until it has (0: strict first in, first out).
    """
    backfill_limit = settings.FGPU_BACKFILL_LIMIT
    scheduled: list[str] = []
    starts: list[tuple[str, dict]] = []
    with transaction.atomic():
        pending = list(
            ComputeSession.objects.select_for_update().filter(status=SessionStatus.PENDING)
            .order_by("-priority", "created_at", "pk")[:limit]
        )
        blocked: list[ComputeSession] = []
        for session in pending:
            reserved = next((b for b in blocked if b.overtaken >= backfill_limit), None)
            if reserved is not None:
                _wait(session, f"queued behind {reserved.name}, which goes first (it has been overtaken "
                               f"{reserved.overtaken} time(s), the most the backfill limit allows)")
                continue
            request = session_request(session)
            try:
                pure_settings = request_settings(request)
                nodes, options = placement_scope(request=request, for_update=True)
                try:
                    placement = core.place(nodes, request, pure_settings, **options)
                except NeverSchedulable:
                    # Only the alive nodes are too small: wait while a LOST node that could hold
                    # it may come back (an agent restart must not fail the whole queue).
                    core.check_ever_fits(placement_scope(request=request, alive_only=False)[0], request, pure_settings)
                    raise InsufficientResource("the nodes that could hold it are not alive (LOST)") from None
            except InsufficientResource as exc:
                _wait(session, f"waiting for capacity: {exc}")
                blocked.append(session)
                continue
            except AllocationError as exc:  # no longer satisfiable (e.g. the slot's mode changed)
                session.status, session.status_reason, session.terminated_at = SessionStatus.ERROR, str(exc), timezone.now()
                session.save(update_fields=["status", "status_reason", "terminated_at"])
                events.session_notify(session)
                continue
            starts.append((placement.node_id, _write_placement(session, placement)))
            scheduled.append(str(session.pk))
            for earlier in blocked:  # backfilled past them
                earlier.overtaken += 1
                earlier.save(update_fields=["overtaken"])
        for node_name, spec in starts:
            transaction.on_commit(lambda n=node_name, s=spec: _send_start(n, s))
    return scheduled


def _wait(session: ComputeSession, reason: str) -> None:
    if session.status_reason != reason:
        session.status_reason = reason
        session.save(update_fields=["status_reason"])
        events.session_notify(session)


def _write_placement(session: ComputeSession, placement: core.Placement) -> dict:
    """Write the allocator's plan and return the agent's start spec."""
    devices = {str(d.pk): d for d in Device.objects.filter(pk__in=[g.device_id for g in placement.grants])}
    rows = [
        Allocation(session=session, device=devices[g.device_id], shares=g.shares, memory=g.memory, procs=g.procs)
        for g in placement.grants
    ]
    Allocation.objects.bulk_create(rows)
    session.node = Node.objects.get(name=placement.node_id)
    session.status = SessionStatus.SCHEDULED
    session.status_reason = ""
    session.scheduled_at = timezone.now()
    session.save(update_fields=["node", "status", "status_reason", "scheduled_at"])
    events.session_notify(session)
    return session_start_spec(session, rows)


def session_start_spec(session: ComputeSession, allocations: list[Allocation]) -> dict:
    """What the agent needs to start the session (JSON-safe). Sizes in bytes, procs in SMs."""
    return {
        "session_id": str(session.pk),
        "name": session.name,
        "owner": session.owner.get_username(),
        "command": session.command,
        "cpu": session.cpu,
        "mem": session.mem,
        "slot_name": session.slot_name,
        "slot_subtype": session.slot_subtype,
        "devices": [
            {
                "device_id": a.device.device_id,
                "index": a.device.index,
                "model_name": a.device.model_name,
                "memory_total": a.device.memory_size,
                "subproc_count": a.device.subproc_count,
                "memory_limit": a.memory,
                "procs": amount_text(a.procs),
                "shares": amount_text(a.shares),
                "is_mig_device": a.device.is_mig_device,
                "mig_profile": a.device.mig_profile,
            }
            for a in sorted(allocations, key=lambda a: a.device.index)
        ],
    }


def _send_start(node_name: str, spec: dict) -> None:
    from sessions.tasks import session_start

    session_start.delay(node=node_name, spec=spec)


def pending_position(session: ComputeSession) -> int:
    """1-based place of a PENDING session in the queue (priority, then arrival)."""
    ahead = ComputeSession.objects.filter(status=SessionStatus.PENDING).filter(
        Q(priority__gt=session.priority) | Q(priority=session.priority, created_at__lte=session.created_at))
    return ahead.count()


