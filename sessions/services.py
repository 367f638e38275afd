"""Writes to compute sessions: create, terminate, apply agent reports, terminal tickets, the
output logs agents ship, and exec.

Status changes are compare-and-set (`filter(status__in=…).update(…)`): when two writers
race, exactly one wins and the other sees `updated == 0`. Allocations are released in the
same transaction as the move to a final status, so they are released exactly once.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
from datetime import timedelta
from decimal import Decimal
from functools import partial

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from accelerators.allocation import core
from accelerators.allocation.errors import AllocationError, InvalidResourceRequest, NeverSchedulable
from accelerators.allocation.requests import parse_resources, request_to_spec
from accelerators.mig_services import node_mig_pending_retry
from accelerators.models import AllocationMode, NodeStatus
from accelerators.selectors import fractional_settings_get, placement_scope, resource_group_get
from console.errors import ApplicationError
from sessions import events, mig_scheduling
from sessions.models import ACTIVE_STATUSES, Allocation, ComputeSession, SessionStatus, TerminalTicket

log = logging.getLogger(__name__)

MAX_NAME = 64


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
        if request.kind == "shares":
            core.check_quantum(request.amount, pure_settings)
        resource_group_get(name=request.resource_group)
    except AllocationError as exc:
        raise ApplicationError(str(exc), type="invalid-resources", field_errors={"resources": [str(exc)]}) from None
    return request, pure_settings


def session_create(*, owner, name: str, resources: dict, command: str = "", priority: int = 0) -> ComputeSession:
    """Validate `resources` (see accelerators.allocation.requests) and write the session PENDING;
    the scheduler runs after commit.

    Raises ApplicationError (400) for a malformed request, one off the quantum grid, one in the
    wrong mode, or one larger than any registered node could ever hold (naming the slot and the
    largest amount a node holds).
    """
    name = (name or "").strip() or "session"
    if priority > 0 and not owner.is_staff:
        raise ApplicationError("priority: only administrators may raise a session's priority above 0",
                               field_errors={"priority": ["only administrators may raise a session's priority above 0"]})
    if len(name) > MAX_NAME:
        raise ApplicationError(f"name: at most {MAX_NAME} characters", field_errors={"name": [f"at most {MAX_NAME} characters"]})
    request, pure_settings = request_validate(resources=resources)
    try:
        # Against every registered node, LOST ones included: a request that fits a node whose
        # agent is restarting waits for it instead of being refused.
        mig_scheduling.check_ever_fits(request, lambda: core.check_ever_fits(  # MIG requests: issue 4
            placement_scope(request=request, alive_only=False)[0], request, pure_settings))
    except NeverSchedulable as exc:
        raise ApplicationError(str(exc), type="never-schedulable", title="Request too large",
                               field_errors={"resources": [str(exc)]}) from None
    with transaction.atomic():
        _quota_check(owner, request, pure_settings)
        session = ComputeSession.objects.create(
            owner=owner, name=name, resources=resources, request_spec=request_to_spec(request),
            slot_name=request.slot, slot_subtype=request.kind if request.slot else "",
            amount=request.amount, cpu=request.cpu, mem=request.mem, command=command or "", priority=priority,
            status_reason="waiting for the scheduler",
        )
        events.session_notify(session)
        transaction.on_commit(_schedule_soon)
    return session


def _quota_check(owner, request: core.ResourceRequest, pure_settings: core.FractionalSettings | None) -> None:
    """The owner's and their projects' quotas (sessions.quotas), with this request's claim
    estimated as quota usage counts it: shares → fGPU and unit_mem × shares bytes; per-device
    sizes in bytes → count × bytes; device-relative sizes count 0 until placed."""
    from sessions.quotas import quota_check

    fgpu, memory = Decimal(0), 0
    if request.kind == "shares" and pure_settings is not None:
        fgpu, memory = request.amount, int(pure_settings.unit_mem * request.amount)
    elif request.kind == "per_device" and request.memory is not None and request.memory.bytes:
        memory = int(request.amount) * request.memory.bytes
    quota_check(user=owner, request=request, memory_estimate=memory, fgpu_estimate=fgpu)


def _schedule_soon() -> None:
    from sessions.tasks import schedule_pending_soon

    schedule_pending_soon()


def session_terminate(*, session: ComputeSession) -> ComputeSession:
    """End a session. PENDING → CANCELLED at once; a scheduled or running one → TERMINATING and
    the agent is told to kill its process group (it reports TERMINATED, which releases the
    allocations). On a LOST node the session ends at once, since no agent will answer. A
    session already ending or ended is left as it is (idempotent)."""
    now = timezone.now()
    with transaction.atomic():
        if ComputeSession.objects.filter(pk=session.pk, status=SessionStatus.PENDING).update(
            status=SessionStatus.CANCELLED, status_reason="cancelled before it was scheduled", terminated_at=now
        ):
            session.refresh_from_db()
            events.session_notify(session)
            return session
        node_lost = session.node_id is not None and session.node.status == NodeStatus.LOST
        if node_lost:
            _finish(session, status=SessionStatus.TERMINATED, reason="terminated while its node was lost", exit_code=None)
            session.refresh_from_db()
            return session
        moved = ComputeSession.objects.filter(
            pk=session.pk, status__in=(SessionStatus.SCHEDULED, SessionStatus.PREPARING, SessionStatus.RUNNING)
        ).update(status=SessionStatus.TERMINATING, status_reason="terminating at the user's request")
        session.refresh_from_db()
        if moved or session.status == SessionStatus.TERMINATING:
            if moved:
                events.session_notify(session)
            node_name, session_id = session.node.name, str(session.pk)
            transaction.on_commit(lambda: _send_stop(node_name, session_id))
    return session


def _send_stop(node_name: str, session_id: str) -> None:
    from sessions.tasks import session_stop

    session_stop.delay(node=node_name, session_id=session_id)


def _finish(session: ComputeSession, *, status: str, reason: str, exit_code: int | None) -> bool:
    """Move an active session to a final `status` and release its allocations, exactly once.
    Must run inside a transaction. False if another writer already ended it."""
    now = timezone.now()
    moved = ComputeSession.objects.filter(pk=session.pk, status__in=ACTIVE_STATUSES).update(
        status=status, status_reason=reason, exit_code=exit_code, terminated_at=now
    )
    if not moved:
        return False
    released = Allocation.objects.filter(session_id=session.pk, released_at__isnull=True).update(released_at=now)
    log.info("session %s → %s (%s); released %d allocation(s)", session.pk, status, reason, released)
    events.session_notify(session)
    if session.node_id is not None:  # a fixed MIG layout change may wait for this session (before the next pass)
        transaction.on_commit(partial(node_mig_pending_retry, node_id=session.node_id))
    transaction.on_commit(_schedule_soon)
    return True


_REPORT_SOURCES = {
    SessionStatus.PREPARING: (SessionStatus.SCHEDULED,),
    SessionStatus.RUNNING: (SessionStatus.SCHEDULED, SessionStatus.PREPARING),
}


def session_report_apply(*, session_id: str, status: str, reason: str = "", exit_code: int | None = None) -> bool:
    """Apply an agent's report about a session (compare-and-set on the status).

    PREPARING and RUNNING move the session forward only from earlier states; TERMINATED and
    ERROR end it from any active state and release its allocations. A report that arrives out
    of order (RUNNING after the user already asked to terminate) is ignored. Returns whether
    the session changed. Unknown ids are logged and ignored.
    """
    session = ComputeSession.objects.filter(pk=session_id).select_related("node", "owner").first()
    if session is None:
        log.warning("agent reported %s for unknown session %s", status, session_id)
        return False
    with transaction.atomic():
        if status in _REPORT_SOURCES:
            fields = {"status": status, "status_reason": reason}
            if status == SessionStatus.RUNNING:
                fields["started_at"] = timezone.now()
            moved = ComputeSession.objects.filter(pk=session.pk, status__in=_REPORT_SOURCES[status]).update(**fields)
            if moved:
                events.session_notify(session)
            elif status == SessionStatus.RUNNING and session.node_id and session.status not in ACTIVE_STATUSES:
                # It ended here while the agent was starting it: the process must not linger.
                node_name, sid = session.node.name, str(session.pk)
                transaction.on_commit(lambda: _send_stop(node_name, sid))
            return bool(moved)
        if status in (SessionStatus.TERMINATED, SessionStatus.ERROR):
            return _finish(session, status=status, reason=reason, exit_code=exit_code)
    log.warning("agent sent unknown status %r for session %s", status, session_id)
    return False


def sessions_reconcile_node(*, node_name: str, running: list[str]) -> list[str]:
    """After an agent (re)registers: sessions the manager holds active on that node but the
    agent does not run are ended in ERROR (their processes died with the agent) and their
    allocations released. Returns the ids of the sessions the agent may keep running."""
    active = ComputeSession.objects.filter(node__name=node_name, status__in=ACTIVE_STATUSES)
    keep = []
    for session in active:
        if str(session.pk) in running:
            keep.append(str(session.pk))
        elif session.status in (SessionStatus.PREPARING, SessionStatus.RUNNING, SessionStatus.TERMINATING):
            with transaction.atomic():
                _finish(session, status=SessionStatus.ERROR if session.status != SessionStatus.TERMINATING
                        else SessionStatus.TERMINATED, reason="the agent restarted and no longer runs this session",
                        exit_code=None)
        else:  # SCHEDULED: the start message may still be on its way in the agent's queue
            keep.append(str(session.pk))
    return keep


def _digest(ticket: str) -> str:
    return hashlib.sha256(ticket.encode()).hexdigest()


def terminal_ticket_create(*, session: ComputeSession, user) -> tuple[str, TerminalTicket]:
    """A one-time ticket for the session's terminal websocket, valid FGPU_TERMINAL_TICKET_TTL
    seconds. Raises ApplicationError 409 unless the session is RUNNING."""
    if session.status != SessionStatus.RUNNING:
        raise ApplicationError(f"the session is {session.status}; a terminal opens only while it is RUNNING",
                               type="session-not-running", title="Session not running", status=409)
    ticket = secrets.token_urlsafe(32)
    row = TerminalTicket.objects.create(
        digest=_digest(ticket), session=session, user=user,
        expires_at=timezone.now() + timedelta(seconds=settings.FGPU_TERMINAL_TICKET_TTL),
    )
    return ticket, row


def terminal_ticket_redeem(*, session_id: str, ticket: str) -> ComputeSession:
    """Spend a ticket (once: compare-and-set on `used_at`) and re-check that its user may still
    open this session's terminal and that the session is RUNNING. Raises ApplicationError
    (403 for a wrong, expired or reused ticket; 409 when not running)."""
    now = timezone.now()
    digest = _digest(ticket or "")
    spent = TerminalTicket.objects.filter(digest=digest, session_id=session_id, used_at__isnull=True,
                                          expires_at__gt=now).update(used_at=now)
    if spent != 1:
        raise ApplicationError("the terminal ticket is wrong, expired or already used", type="bad-ticket",
                               title="Bad ticket", status=403)
    row = TerminalTicket.objects.select_related("user", "session").get(digest=digest)
    session, user = row.session, row.user
    if not (user.is_active and (user.is_staff or session.owner_id == user.pk)):
        raise ApplicationError("the ticket's user may not open this terminal", type="bad-ticket", title="Bad ticket", status=403)
    if session.status != SessionStatus.RUNNING:
        raise ApplicationError(f"the session is {session.status}", type="session-not-running", title="Session not running",
                               status=409)
    return session


# --- output logs ----------------------------------------------------------------------------

def session_log_append(*, session_id: str, seq: int, offset: int, text: str, final: bool = False) -> bool:
    """Store one batch of a session's output shipped by its agent (sessions.runtime.agent).

    `seq` numbers the agent's batches from 0, `offset` is the batch's position in the output in
    characters. A batch already stored (same session and `seq`: a redelivered task) is ignored,
    so the task may be retried. `final` marks the session's last batch. Only the last
    FGPU_SESSION_LOG_MAX_CHARS characters are kept: older batches are deleted. NUL characters
    (PostgreSQL text cannot hold them) are stored as U+FFFD. Returns whether the batch was
    stored; unknown sessions are logged and ignored."""
    from sessions.models import SessionLog, SessionLogChunk

    if not ComputeSession.objects.filter(pk=session_id).exists():
        log.warning("agent shipped output for unknown session %s", session_id)
        return False
    text = text.replace("\x00", "\ufffd")
    end = offset + len(text)
    with transaction.atomic():
        SessionLog.objects.get_or_create(session_id=session_id)
        row = SessionLog.objects.select_for_update().get(session_id=session_id)
        if SessionLogChunk.objects.filter(session_id=session_id, seq=seq).exists():
            return False
        SessionLogChunk.objects.create(session_id=session_id, seq=seq, offset=offset, end=end, text=text)
        fields = ["updated_at"]
        if end > row.length:
            row.length = end
            fields.append("length")
        if final and not row.complete:
            row.complete = True
            fields.append("complete")
        row.save(update_fields=fields)
        SessionLogChunk.objects.filter(session_id=session_id,
                                       end__lte=row.length - settings.FGPU_SESSION_LOG_MAX_CHARS).delete()
    return True


# --- exec -------------------------------------------------------------------------------------

EXEC_REPLY_GRACE_S = 10  # how much longer than the command's timeout the web waits for the agent


def session_exec(*, session: ComputeSession, command, timeout: int) -> dict:
    """Run `command` in a RUNNING session on its node, beside the session's process: same
    environment (the virtual nvidia-smi on PATH, the allocation's limits), same working
    directory, stdin from /dev/null. `command` is an argument vector (a list of strings) or
    one shell command line (a string, run by bash -c). `timeout` in seconds.

    Transport: a `pty.exec` message to the session's `pty-<id>` group (which only its agent
    joins) with a reply channel; the agent answers on it (sessions.runtime.agent.Agent._exec).
    Returns `{"exit_code", "stdout", "stderr", "truncated", "duration_ms"}` (stdout and stderr
    at most 1 MiB each, `truncated` when cut).

    Raises ApplicationError: 409 "session-not-running" unless RUNNING; 504 "exec-timeout"
    when the command ran past `timeout` (it was killed) or the agent did not answer within
    `timeout` + EXEC_REPLY_GRACE_S seconds; 502 "exec-failed" when the agent could not start it.
    """
    if session.status != SessionStatus.RUNNING:
        raise ApplicationError(f"the session is {session.status}; commands run only while it is RUNNING",
                               type="session-not-running", title="Session not running", status=409)
    message = {"type": "pty.exec", "session_id": str(session.pk), "argv": command, "timeout": timeout}
    result = async_to_sync(_exec_roundtrip)(events.pty_group(session.pk), message, timeout + EXEC_REPLY_GRACE_S)
    node = session.node.name if session.node_id else "its node"
    if result is None:
        raise ApplicationError(f"the agent on {node} did not answer within {timeout + EXEC_REPLY_GRACE_S} s; "
                               "is the node up?", type="exec-timeout", title="Exec timed out", status=504)
    if result.get("error"):
        raise ApplicationError(result["error"], type="exec-failed", title="Exec failed", status=502)
    if result.get("timed_out"):
        raise ApplicationError(f"the command ran longer than its timeout of {timeout} s and was killed; "
                               "pass a larger \"timeout\"", type="exec-timeout", title="Exec timed out", status=504)
    return {key: result[key] for key in ("exit_code", "stdout", "stderr", "truncated", "duration_ms")}


async def _exec_roundtrip(group: str, message: dict, wait_s: float) -> dict | None:
    """Send `message` to `group` with a fresh reply channel; the reply, or None after `wait_s`."""
    layer = get_channel_layer()
    reply = await layer.new_channel("exec-reply.")
    await layer.group_send(group, {**message, "reply_channel": reply})
    try:
        async with asyncio.timeout(wait_s):
            while True:
                answer = await layer.receive(reply)
                if answer.get("type") == "exec.result":
                    return answer
    except TimeoutError:
        return None
