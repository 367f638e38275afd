"""Writes to compute sessions once created (`sessions.admission.launch.session_create` creates
them): terminate, apply agent reports, terminal tickets, the output logs agents ship, and exec
(blocking, or streamed through the exec store).

Status changes are compare-and-set (`filter(status__in=…).update(…)`): when two writers
race, exactly one wins and the other sees `updated == 0`. Allocations are released in the
same transaction as the move to a final status, so they are released exactly once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import queue
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from functools import partial

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import transaction
from django.utils import timezone

import protocol
from accelerators.mig_services import node_mig_pending_retry
from accelerators.models import NodeStatus
from common.errors import ApplicationError
from sessions.lifecycle import events
from common.exec_store import exec_store_default
from protocol.channel import AgentLink, Refused, reply_prefix
from protocol.exec_store import LIVE_STATES, STREAM_NAMES, record_id
from protocol.messages import NodeName, SessionId, SessionNotice, SessionStop
from sessions.lifecycle.passes import schedule_pending_soon
from sessions.models import ACTIVE_STATUSES, NEXT_VERSION, Allocation, ComputeSession, SessionStatus, TerminalTicket

log = logging.getLogger(__name__)


def _schedule_soon() -> None:
    schedule_pending_soon()


RECLAIMED = "reclaimed: "  # the reason of a session the manager terminated (usage.services.usage_idle_check)
REQUESTED = "at the request of "  # + username: the reason of a session terminated through the API (sessions.api.sessions)
PREEMPTED = "preempted: "  # + why: the reason of a session stopped to make room for another (sessions.scheduling.preemption)


# The columns a session's transitions write (status, why, when, how it ended, version): a
# refresh of these keeps the relations read with the session.
SHOWN_STATE = ["status", "status_reason", "scheduled_at", "started_at", "terminated_at", "exit_code", "version"]


def session_terminate(*, session: ComputeSession, reason: str = "") -> ComputeSession:
    """End a session. PENDING → CANCELLED at once; a scheduled or running one → TERMINATING and
    the agent is told to kill its process group (it reports TERMINATED, which releases the
    allocations). On a LOST node the session ends at once, since no agent will answer. A
    session already ending or ended is left as it is (idempotent). `reason`: why, when not at
    the user's request (starting with RECLAIMED or PREEMPTED, it stays the session's reason once it
    ended; so does REQUESTED + the username of whoever asked, which the API gives).

    On a LOST node the session is fenced (issue 33): it moves to TERMINATING like any other and
    keeps its allocations, so no device it holds is granted again while its processes may still
    run; its reason says so (`fence_reason`). It ends, and its devices are released, when its
    agent reports it gone (sessions.lifecycle.reconcile: a heartbeat, or a registration, without it), when
    the node has been silent FGPU_FENCE_TIMEOUT_SECONDS, or when an administrator marks the node
    dead (`sessions.lifecycle.reconcile.node_sessions_end`); on a node already past its fence timeout it
    ends at once.

    `session` as read with its node (its status decides which move is tried first; each is a
    compare-and-set, so a stale read only costs a statement). The move to TERMINATING is one
    UPDATE, so outside a transaction the stop goes out as soon as it is committed (issue 14:
    terminate's latency); inside one, after that commits. That UPDATE also matches the version
    read, so the session is not read back after it unless it changed meanwhile (issue 35.3); the
    stop's task is handed to a thread of its own (`_send_stop`), so the caller does not wait for
    the broker."""
    if session.status == SessionStatus.PENDING:
        if _cancel_pending(session):
            return session
        session.refresh_from_db(fields=[*SHOWN_STATE, "node"])  # scheduled meanwhile: on a node now
    reason = reason or "terminating at the user's request"
    if session.node is not None and session.node.status == NodeStatus.LOST:
        fence = fence_reason(session.node)
        if fence is None:  # silent past its fence timeout: its processes are assumed gone
            with transaction.atomic():
                _finish(session, status=SessionStatus.TERMINATED, reason=f"{reason}{FENCE_EXPIRED}", exit_code=None)
            session.refresh_from_db()
            return session
        reason += fence
    placed = ComputeSession.objects.filter(pk=session.pk, status__in=_PLACED)
    # The state as read, unchanged since (same version): the UPDATE says all the session now holds,
    # so it is not read back (issue 35.3: one query less before the DELETE's answer).
    moved = session.status in _PLACED and placed.filter(version=session.version).update(
        status=SessionStatus.TERMINATING, status_reason=reason, version=session.version + 1
    )
    if moved:
        _stop_on_commit(session)  # first: the stop does not wait for the notice
        session.status, session.status_reason, session.version = SessionStatus.TERMINATING, reason, session.version + 1
    else:  # changed since it was read (a report meanwhile): moved by its status alone, then read back
        moved = placed.update(status=SessionStatus.TERMINATING, status_reason=reason, version=NEXT_VERSION)
        if moved:
            _stop_on_commit(session)
        session.refresh_from_db(fields=SHOWN_STATE)  # keeps the node read with it (unchanged here)
    if moved:
        events.session_notify(session, answered=True)  # the DELETE answers with its shape
    elif session.status == SessionStatus.TERMINATING:  # asked again: the stop may have been lost
        _stop_on_commit(session)
    return session


_PLACED = (SessionStatus.SCHEDULED, SessionStatus.PREPARING, SessionStatus.RUNNING)  # what session_terminate moves to TERMINATING

FENCED = "; releasing its devices when node "  # the rest of a fenced session's reason: `fence_reason`
FENCE_EXPIRED = "; its node was silent past FGPU_FENCE_TIMEOUT_SECONDS: its processes are assumed gone"


def fence_deadline(node) -> datetime | None:
    """When LOST `node` is assumed dead: its last heartbeat + FGPU_FENCE_TIMEOUT_SECONDS (None:
    never, with a timeout of 0, or for a node that never sent a heartbeat)."""
    timeout_s = settings.FGPU_FENCE_TIMEOUT_SECONDS
    if not timeout_s or node.last_heartbeat is None:
        return None
    return node.last_heartbeat + timedelta(seconds=timeout_s)


def fence_reason(node) -> str | None:
    """What a session terminated on LOST `node` says while it waits (appended to its reason, after
    FENCED): "; releasing its devices when node gpu-1 confirms its processes are gone, or in 287 s
    (01:40:12 UTC)"; or an administrator's "mark dead", with a fence timeout of 0. None when the
    node is already past its deadline (`fence_deadline`)."""
    deadline = fence_deadline(node)
    if deadline is None:
        return f"{FENCED}{node.name} confirms its processes are gone, or an administrator marks it dead"
    left = (deadline - timezone.now()).total_seconds()
    if left <= 0:
        return None
    at = deadline.astimezone(dt_timezone.utc).strftime("%H:%M:%S")
    return f"{FENCED}{node.name} confirms its processes are gone, or in {int(left + 0.999)} s ({at} UTC)"


def _stop_on_commit(session: ComputeSession) -> None:
    """`_send_stop` to the session's node once the current transaction commits (at once outside one)."""
    assert session.node is not None  # SCHEDULED, PREPARING, RUNNING and TERMINATING sessions have one
    link, session_id = events.agent_link(session.node), str(session.pk)  # the node as read with the session: its key too
    transaction.on_commit(lambda: _send_stop(link, session_id))


class _StopSender:
    """Sends the stops' SESSION_STOP tasks from one thread of this process, in the order they were
    made, so a DELETE's answer does not wait for the broker's round trip (issue 35.3); where Celery is
    eager (standalone, in-process tests) there is no broker to wait for and the task runs at once, in
    the caller. Best-effort as the send itself was: a process that dies loses the stops not yet
    sent, and a stop sent late is sent again by the reconciliation of the agent's next heartbeat
    (sessions.lifecycle.reconcile); the `pty.stop` beside it is not delayed. A process forked after
    the thread started (a Celery worker) starts its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def send(self, node: str, session_id: str) -> None:
        from common.celery import app

        if app.conf.task_always_eager:  # standalone, in-process tests: no broker to wait for, the task runs here
            self.deliver(node, session_id)
            return
        with self._lock:
            if self._pid != os.getpid():
                self._pid, self._queue = os.getpid(), queue.SimpleQueue()
                threading.Thread(target=self._run, args=(self._queue,), name="session-stops", daemon=True).start()
            self._queue.put((node, session_id))

    @classmethod
    def _run(cls, stops: queue.SimpleQueue) -> None:
        while True:
            cls.deliver(*stops.get())

    @staticmethod
    def deliver(node: str, session_id: str) -> None:
        """Send one stop's SESSION_STOP task now; a failure is logged, never raised."""
        from common.celery import TRANSIENT_ERRORS, agent_send

        try:
            agent_send(protocol.SESSION_STOP, **SessionStop(NodeName(node), SessionId(session_id)).encode())
        except TRANSIENT_ERRORS:
            log.warning(
                "could not send the stop of session %s to %s (the broker is unreachable); the next heartbeat's "
                "reconciliation sends it again",
                session_id,
                node,
            )
        except Exception:  # a thread that ended would lose every stop after this one
            log.exception("could not send the stop of session %s to %s", session_id, node)


_STOPS = _StopSender()


def _cancel_pending(session: ComputeSession) -> bool:
    """PENDING → CANCELLED (compare-and-set) and the notice; False if it was no longer pending."""
    if not ComputeSession.objects.filter(pk=session.pk, status=SessionStatus.PENDING).update(
        status=SessionStatus.CANCELLED,
        status_reason="cancelled before it was scheduled",
        terminated_at=timezone.now(),
        version=NEXT_VERSION,
    ):
        return False
    session.refresh_from_db()
    events.session_notify(session, answered=True)  # the DELETE answers with its shape
    return True


def session_notice(session: ComputeSession, text: str) -> None:
    """After commit: the session's current state to its page (`events.session_notify`) and
    `text` as a line in its terminal (task fgpu.agent.session_notice to its node's agent; a
    broker that cannot be reached costs the terminal that line, logged). For the manager's
    warnings: idle reclamation (usage.services), preemption (sessions.scheduling.preemption)."""
    events.session_notify(session)
    if session.node is None:
        return
    node, session_id = session.node.name, str(session.pk)

    def send() -> None:
        from common.celery import TRANSIENT_ERRORS, agent_send

        try:
            agent_send(protocol.SESSION_NOTICE, **SessionNotice(NodeName(node), SessionId(session_id), text).encode())
        except TRANSIENT_ERRORS:  # the page has it; the terminal misses one line
            log.warning("could not send the notice of session %s to %s", session_id, node)

    transaction.on_commit(send)


def _send_stop(link: AgentLink, session_id: str) -> None:
    """Tell the node's agent (`link`: how the web reaches it, protocol.channel) to stop the session:
    `pty.stop` over the channel layer, which it takes in a millisecond while it runs (best-effort),
    and the SESSION_STOP task, which waits in its queue while it does not (protocol), sent from
    `_StopSender`'s thread: the caller does not wait for either. A broker that cannot be reached is
    logged, not raised (the session is TERMINATING in the database): the reconciliation of the
    agent's next heartbeat sends the stop again (sessions.lifecycle.reconcile)."""
    events.pty_send(link, session_id, {"type": "pty.stop"})
    _STOPS.send(link.node, session_id)


def _finish(session: ComputeSession, *, status: str, reason: str, exit_code: int | None) -> bool:
    """Move an active session to a final `status` and release its allocations, exactly once.
    Must run inside a transaction. False if another writer already ended it."""
    now = timezone.now()
    moved = ComputeSession.objects.filter(pk=session.pk, status__in=ACTIVE_STATUSES).update(
        status=status, status_reason=reason, exit_code=exit_code, terminated_at=now, version=NEXT_VERSION
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


_REPORT_SOURCES: dict[str, tuple[str, ...]] = {
    SessionStatus.PREPARING: (SessionStatus.SCHEDULED, SessionStatus.PREPARING),  # again: progress (an image pull)
    SessionStatus.RUNNING: (SessionStatus.SCHEDULED, SessionStatus.PREPARING),
}


def session_report_apply(
    *,
    session_id: str,
    status: str,
    reason: str = "",
    exit_code: int | None = None,
    node: str | None = None,
    session: ComputeSession | None = None,
) -> bool:
    """Apply an agent's report about a session (compare-and-set on the status).

    PREPARING and RUNNING move the session forward only from earlier states; TERMINATED and
    ERROR end it from any active state and release its allocations. A report that arrives out
    of order (RUNNING after the user already asked to terminate) is ignored. Returns whether
    the session changed. Unknown ids are logged and ignored, and so is a report from `node`
    (the sending agent's, where it says) for a session that does not run on it. `session`: the
    session `session_id` as the caller read it with its node (else read here).
    """
    if session is None:
        session = ComputeSession.objects.filter(pk=session_id).select_related("node").first()
    if session is None:
        log.warning("agent reported %s for unknown session %s", status, session_id)
        return False
    if node is not None and (session.node is None or session.node.name != node):
        log.warning("refused a %s report for session %s from node %s: the session does not run there", status, session_id, node)
        return False
    if status in _REPORT_SOURCES:  # one compare-and-set UPDATE: no transaction of its own
        fields = {"status": status, "status_reason": reason, "version": NEXT_VERSION}
        if status == SessionStatus.RUNNING:
            fields["started_at"] = timezone.now()
        moved = ComputeSession.objects.filter(pk=session.pk, status__in=_REPORT_SOURCES[status]).update(**fields)
        if moved:
            events.session_notify(session)
        elif status == SessionStatus.RUNNING and session.node is not None and session.status not in ACTIVE_STATUSES:
            # It ended here while the agent was starting it: the process must not linger.
            _stop_on_commit(session)
        return bool(moved)
    with transaction.atomic():
        if status in (SessionStatus.TERMINATED, SessionStatus.ERROR):
            if status == SessionStatus.TERMINATED and session.status_reason.startswith((RECLAIMED, REQUESTED, PREEMPTED)):
                # the manager's reason (who asked), not the agent's "terminated"; a fence's wait is over
                reason = session.status_reason.split(FENCED, 1)[0]
            return _finish(session, status=status, reason=reason, exit_code=exit_code)
    log.warning("agent sent unknown status %r for session %s", status, session_id)
    return False


AGENT_RESTARTED = "the agent restarted and no longer runs this session"


def sessions_reconcile_node(*, node_name: str, running: list[str]) -> list[str]:
    """After an agent (re)registers: sessions the manager holds active on that node but the
    agent does not run are ended in ERROR (their processes died with the agent), TERMINATING ones
    TERMINATED (who asked stays their reason: `session_report_apply`), and their allocations
    released. Returns the ids of the sessions the agent may keep running."""
    active = ComputeSession.objects.filter(node__name=node_name, status__in=ACTIVE_STATUSES)
    keep = []
    for session in active:
        if str(session.pk) in running:
            keep.append(str(session.pk))
        elif session.status == SessionStatus.TERMINATING:  # the stop it waited for (a fenced one's too): who asked stays
            session_report_apply(
                session_id=str(session.pk), status=SessionStatus.TERMINATED, reason=AGENT_RESTARTED, session=session
            )
        elif session.status in (SessionStatus.PREPARING, SessionStatus.RUNNING):
            with transaction.atomic():
                _finish(session, status=SessionStatus.ERROR, reason=AGENT_RESTARTED, exit_code=None)
        else:  # SCHEDULED: the start message may still be on its way in the agent's queue
            keep.append(str(session.pk))
    return keep


def _digest(ticket: str) -> str:
    return hashlib.sha256(ticket.encode()).hexdigest()


def terminal_ticket_create(*, session: ComputeSession, user) -> tuple[str, TerminalTicket]:
    """A one-time ticket for the session's terminal websocket, valid FGPU_TERMINAL_TICKET_TTL
    seconds. Raises ApplicationError 409 unless the session is RUNNING."""
    if session.status != SessionStatus.RUNNING:
        raise ApplicationError(
            f"the session is {session.status}; a terminal opens only while it is RUNNING",
            type="session-not-running",
            title="Session not running",
            status=409,
        )
    ticket = secrets.token_urlsafe(32)
    row = TerminalTicket.objects.create(
        digest=_digest(ticket),
        session=session,
        user=user,
        expires_at=timezone.now() + timedelta(seconds=settings.FGPU_TERMINAL_TICKET_TTL),
    )
    return ticket, row


def terminal_ticket_redeem(*, session_id: str, ticket: str) -> ComputeSession:
    """Spend a ticket (once: compare-and-set on `used_at`) and re-check that its user may still
    open this session's terminal and that the session is RUNNING. Raises ApplicationError
    (403 for a wrong, expired or reused ticket; 409 when not running)."""
    now = timezone.now()
    digest = _digest(ticket or "")
    spent = TerminalTicket.objects.filter(digest=digest, session__pk=session_id, used_at__isnull=True, expires_at__gt=now).update(
        used_at=now
    )
    if spent != 1:
        raise ApplicationError(
            "the terminal ticket is wrong, expired or already used", type="bad-ticket", title="Bad ticket", status=403
        )
    row = TerminalTicket.objects.select_related("user", "session", "session__node").get(digest=digest)
    session, user = row.session, row.user
    if not (user.is_active and (user.is_staff or session.owner_id == user.pk)):
        raise ApplicationError("the ticket's user may not open this terminal", type="bad-ticket", title="Bad ticket", status=403)
    if session.status != SessionStatus.RUNNING:
        raise ApplicationError(
            f"the session is {session.status}", type="session-not-running", title="Session not running", status=409
        )
    return session


def terminal_ticket_unspend(*, session_id: str, ticket: str) -> bool:
    """Make a ticket spent by `terminal_ticket_redeem` usable again, when the terminal could not
    be opened through no fault of its holder (the channel layer was unreachable); it still
    expires at its time. Returns whether a spent, unexpired ticket was found."""
    return (
        TerminalTicket.objects.filter(
            digest=_digest(ticket or ""), session__pk=session_id, used_at__isnull=False, expires_at__gt=timezone.now()
        ).update(used_at=None)
        == 1
    )


# --- output logs ----------------------------------------------------------------------------


def session_log_append(*, session_id: str, seq: int, offset: int, text: str, final: bool = False, known: bool = False) -> bool:
    """Store one batch of a session's output shipped by its agent (agent.core).

    `seq` numbers the agent's batches from 0, `offset` is the batch's position in the output in
    characters. A batch already stored (same session and `seq`: a redelivered task) is ignored,
    so the task may be retried. `final` marks the session's last batch. Only the last
    FGPU_SESSION_LOG_MAX_CHARS characters are kept: older batches are deleted. NUL characters
    (PostgreSQL text cannot hold them) are stored as U+FFFD. Returns whether the batch was
    stored; unknown sessions are logged and ignored (`known`: the caller read the session).
    Four statements for a batch of a log under its limit (issue 14: the manager's share of a
    busy terminal)."""
    from sessions.models import SessionLog, SessionLogChunk

    if not known and not ComputeSession.objects.filter(pk=session_id).exists():
        log.warning("agent shipped output for unknown session %s", session_id)
        return False
    text = text.replace("\x00", "\ufffd")
    end = offset + len(text)
    with transaction.atomic():
        # django-stubs want a UUID where Django takes its text too (filters below: session__pk, which they accept).
        row, _ = SessionLog.objects.select_for_update().get_or_create(session_id=session_id)  # type: ignore[misc]
        if SessionLogChunk.objects.filter(session__pk=session_id, seq=seq).exists():
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
        if row.length > settings.FGPU_SESSION_LOG_MAX_CHARS:
            SessionLogChunk.objects.filter(
                session__pk=session_id, end__lte=row.length - settings.FGPU_SESSION_LOG_MAX_CHARS
            ).delete()
    return True


# --- exec -------------------------------------------------------------------------------------

EXEC_REPLY_GRACE_S = 10  # how much longer than the command's timeout the web waits for the agent


def session_exec(*, session: ComputeSession, command, timeout: int) -> dict:
    """Run `command` in a RUNNING session on its node and wait for its result: `session_exec_call`,
    then `session_exec_wait` (see both), for a caller that may block its thread (a test, a
    script). The API does not: it waits on the event loop (`common.api_async`)."""
    return async_to_sync(session_exec_wait)(session_exec_call(session=session, command=command, timeout=timeout))


@dataclass(frozen=True)
class ExecCall:
    """A blocking exec to send (`session_exec_call`): the group its session's agent joins, the
    message, the command's timeout (s) and its node's name (for errors)."""

    group: str
    message: dict
    timeout: int
    node: str
    link: AgentLink | None = None  # the node's (protocol.channel): seals the message, verifies the answer


def session_exec_call(*, session: ComputeSession, command, timeout: int) -> ExecCall:
    """The blocking exec of `command` in `session`, to hand to `session_exec_wait`: it runs on the
    session's node beside the session's process, with the same environment (the virtual
    nvidia-smi on PATH, the allocation's limits), the same working directory, stdin from
    /dev/null. `command` is an argument vector (a list of strings) or one shell command line (a
    string, run by bash -c); `timeout` in seconds. Reads nothing more from the database.

    Raises ApplicationError 409 "session-not-running" unless RUNNING."""
    _exec_check_running(session)
    message = {"type": "pty.exec", "session_id": str(session.pk), "argv": command, "timeout": timeout}
    link = _node_link(session)
    return ExecCall(group=link.pty_group(session.pk), message=message, timeout=timeout, node=link.node, link=link)


async def session_exec_wait(call: ExecCall) -> dict:
    """Send `call` and wait for its result on the event loop, holding no thread and no database
    connection. Transport: a `pty.exec` message to the session's `pty.<node>.<id>` group (which only its
    agent joins) with a reply channel; the agent answers on it (agent.core.Agent._exec).
    Returns `{"exit_code", "stdout", "stderr", "truncated", "duration_ms"}` (stdout and stderr
    at most 1 MiB each, `truncated` when cut).

    Raises ApplicationError: 504 "exec-timeout" when the command ran past its timeout (it was
    killed) or the agent did not answer within the timeout + EXEC_REPLY_GRACE_S seconds; 502
    "exec-failed" when the agent could not start it."""
    wait_s = call.timeout + EXEC_REPLY_GRACE_S
    result = await _exec_roundtrip(call.group, call.message, wait_s, link=call.link)
    if result is None:
        raise ApplicationError(
            f"the agent on {call.node} did not answer within {wait_s} s; is the node up?",
            type="exec-timeout",
            title="Exec timed out",
            status=504,
        )
    if result.get("error"):
        raise ApplicationError(result["error"], type="exec-failed", title="Exec failed", status=502)
    if result.get("timed_out"):
        raise ApplicationError(
            f'the command ran longer than its timeout of {call.timeout} s and was killed; pass a larger "timeout"',
            type="exec-timeout",
            title="Exec timed out",
            status=504,
        )
    return {key: result[key] for key in ("exit_code", "stdout", "stderr", "truncated", "duration_ms")}


def _node_link(session: ComputeSession) -> AgentLink:
    """The link to a RUNNING session's agent (protocol.channel); ApplicationError 409 when the
    session is on no node (none RUNNING is)."""
    if session.node is None:
        raise ApplicationError(
            "the session is not on a node", type="session-not-running", title="Session not running", status=409
        )
    return events.agent_link(session.node)


def _exec_check_running(session: ComputeSession) -> None:
    if session.status != SessionStatus.RUNNING:
        raise ApplicationError(
            f"the session is {session.status}; commands run only while it is RUNNING",
            type="session-not-running",
            title="Session not running",
            status=409,
        )


async def _exec_roundtrip(group: str, message: dict, wait_s: float, *, link: AgentLink | None = None) -> dict | None:
    """Send `message` to `group` with a fresh reply channel, sealed by `link` (the session's node);
    the reply that `link` verifies, or None after `wait_s` (answers that do not verify are
    logged and ignored)."""
    layer = get_channel_layer()
    link = link or AgentLink(node="")
    reply = await layer.new_channel(reply_prefix("exec"))
    await layer.group_send(group, link.command({**message, "reply_channel": reply}))
    try:
        async with asyncio.timeout(wait_s):
            while True:
                answer = await layer.receive(reply)
                try:
                    answer = link.answer(answer)
                except Refused as exc:
                    log.warning("ignored an exec answer claiming to come from node %s: %s", link.node, exc)
                    continue
                if answer.get("type") == "exec.result":
                    return answer
    except TimeoutError:
        return None


# --- streamed exec ----------------------------------------------------------------------------

EXEC_CANCEL_WAIT_S = 5  # how long a cancel waits for the agent to report the command ended
EXEC_CANCEL_POLL_S = 0.05
EXEC_READ_MAX_BYTES = 1024 * 1024  # one read returns chunks up to about this much text (at least one)
EXEC_READ_MAX_CHUNKS = 256


def session_exec_start(*, session: ComputeSession, command, timeout: int) -> dict:
    """Start `command` in a RUNNING session as `session_exec` runs it, without waiting: its
    output is pushed by the session's agent to the exec store (protocol.exec_store: Redis, so any
    web process serves it; memory in standalone mode) as it comes, at most
    FGPU_EXEC_STREAM_MAX_BYTES per stream, kept FGPU_EXEC_OUTPUT_TTL seconds after it ends.
    `command` is an argument vector or one shell command line; `timeout` in seconds.

    Transport: the record is written `starting`, then a `pty.exec_stream` message goes to the
    session's `pty.<node>.<id>` group (agent.exec_stream runs it). Returns the exec's state
    (see `session_exec_read`, without output). Raises ApplicationError 409 "session-not-running"
    unless RUNNING. An agent that does not take it within EXEC_REPLY_GRACE_S seconds shows as
    state `failed` on the next read."""
    _exec_check_running(session)
    link = _node_link(session)
    exec_id = str(uuid.uuid4())
    record = {
        "session": str(session.pk),
        "node": session.node.name if session.node else "",
        "command": json.dumps(command),
        "timeout": str(timeout),
        "cap": str(settings.FGPU_EXEC_STREAM_MAX_BYTES),
        "state": "starting",
        "cancel": "0",
        "truncated": "0",
        "created_ms": str(_now_ms()),
    }
    exec_store_default().create(
        record_id(link.node, exec_id), record, ttl_s=int(timeout + 3 * EXEC_REPLY_GRACE_S) + settings.FGPU_EXEC_OUTPUT_TTL
    )
    message = {
        "type": "pty.exec_stream",
        "session_id": str(session.pk),
        "exec_id": exec_id,
        "argv": command,
        "timeout": timeout,
        "ttl": settings.FGPU_EXEC_OUTPUT_TTL,
    }
    async_to_sync(get_channel_layer().group_send)(link.pty_group(session.pk), link.command(message))
    return _exec_shape(exec_id, record)


def session_exec_read(*, session: ComputeSession, exec_id: str, since: int = 0) -> dict:
    """A streamed exec of `session` and its output from chunk `since` on (0, or `next` of the
    previous read): the state (`id`, `session`, `command`, `timeout` (s), `state` (starting,
    running, exited, timed_out, cancelled, failed), `running`, `exit_code` (None until it ends;
    128+N when killed by signal N), `cancelled`, `timed_out`, `error`, `truncated` (a stream
    reached its cap, later output of it was dropped), `duration_ms`, `created_at`), plus
    `chunks` (`[{"stream": "stdout"|"stderr", "data": text}]`, in the order the agent read them),
    `since`, `next` (the `since` to send next; offsets count chunks, not bytes) and `complete`
    (it ended and this read reaches the end of its output: stop following). One read returns
    up to about EXEC_READ_MAX_BYTES of text.

    An exec that no agent took within EXEC_REPLY_GRACE_S seconds of its start, or whose agent
    has not reported its end 2 × EXEC_REPLY_GRACE_S seconds past its timeout, is moved to
    `failed` here. Raises ApplicationError 404 "not-found" when `session` has no such exec
    (or its output expired)."""
    store = exec_store_default()
    stored = _exec_record_id(session, exec_id)
    record, chunks, total = store.read(stored, since=since, max_chunks=EXEC_READ_MAX_CHUNKS)
    record = _exec_settle(store, stored, _exec_of(session, exec_id, record))
    out: list[dict] = []
    size = 0
    for stream, text in chunks:
        if out and size + len(text) > EXEC_READ_MAX_BYTES:
            break
        out.append({"stream": STREAM_NAMES[stream], "data": text})
        size += len(text)
    shape = _exec_shape(exec_id, record)
    after = since + len(out) if since < total else since
    return {**shape, "chunks": out, "since": since, "next": after, "complete": not shape["running"] and after >= total}


def session_exec_cancel(*, session: ComputeSession, exec_id: str) -> dict:
    """Stop a streamed exec of `session`: one the agent has not taken yet is `cancelled` at once
    (it never runs); for a running one the agent is asked (the record's `cancel` flag, which it
    reads every 0.2 s) to send SIGTERM to every process of the command's session and SIGKILL 2 s
    later, and this waits up to EXEC_CANCEL_WAIT_S seconds for it to report the end. An exec
    that already ended is left as it is (idempotent). Returns its state as `session_exec_read`
    does, without output: `running` false once it ended (`cancelled` true when this stopped it).
    Raises ApplicationError 404 "not-found" when `session` has no such exec."""
    store = exec_store_default()
    stored = _exec_record_id(session, exec_id)
    record = _exec_of(session, exec_id, store.get(stored))
    ended = {"state": "cancelled", "error": "", "duration_ms": "0"}
    if not store.transition(stored, from_states=("starting",), fields=ended, ttl_s=settings.FGPU_EXEC_OUTPUT_TTL):
        store.transition(stored, from_states=("running",), fields={"cancel": "1"})
    deadline = time.monotonic() + EXEC_CANCEL_WAIT_S
    while True:
        record = _exec_settle(store, stored, store.get(stored) or record)
        if record["state"] not in LIVE_STATES or time.monotonic() >= deadline:
            return _exec_shape(exec_id, record)
        time.sleep(EXEC_CANCEL_POLL_S)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _exec_record_id(session: ComputeSession, exec_id: str) -> str:
    """The exec store's id of `session`'s exec `exec_id` (per node: protocol.exec_store.record_id);
    ApplicationError 404 when the session was never placed on a node (it ran no exec)."""
    if session.node is None:
        raise ApplicationError(
            "this session has no such exec (or its output expired)", type="not-found", title="Not found", status=404
        )
    return record_id(session.node.name, exec_id)


def _exec_of(session: ComputeSession, exec_id: str, record: dict | None) -> dict:
    """`record` if it is an exec of `session`; else ApplicationError 404."""
    if record is None or record.get("session") != str(session.pk):
        raise ApplicationError(
            "this session has no such exec (or its output expired)", type="not-found", title="Not found", status=404
        )
    return record


def _exec_settle(store, exec_id: str, record: dict) -> dict:
    """Give up on an exec whose agent is silent (see `session_exec_read`): compare-and-set to
    `failed`, so an agent that turns up later cannot start it. `exec_id`: its store id
    (`_exec_record_id`). Returns the current record."""
    node = record.get("node") or "its node"
    age_ms = _now_ms() - int(record["created_ms"])  # the web's clock only: the agent's may be off
    if record["state"] == "starting" and age_ms > EXEC_REPLY_GRACE_S * 1000:
        error = f"the agent on {node} did not take the command within {EXEC_REPLY_GRACE_S:g} s; is the node up?"
    elif record["state"] == "running" and age_ms > (int(record["timeout"]) + 2 * EXEC_REPLY_GRACE_S) * 1000:
        error = f"the agent on {node} stopped reporting on the command; is the node up?"
    else:
        return record
    if store.transition(
        exec_id, from_states=(record["state"],), fields={"state": "failed", "error": error}, ttl_s=settings.FGPU_EXEC_OUTPUT_TTL
    ):
        return {**record, "state": "failed", "error": error}
    return store.get(exec_id) or record


def _exec_shape(exec_id: str, record: dict) -> dict:
    state = record["state"]
    return {
        "id": exec_id,
        "session": record["session"],
        "command": json.loads(record["command"]),
        "timeout": int(record["timeout"]),
        "state": state,
        "running": state in LIVE_STATES,
        "exit_code": int(record["exit_code"]) if record.get("exit_code") else None,
        "cancelled": state == "cancelled",
        "timed_out": state == "timed_out",
        "error": record.get("error", ""),
        "truncated": record.get("truncated") == "1",
        "duration_ms": int(record["duration_ms"]) if record.get("duration_ms") else None,
        "created_at": datetime.fromtimestamp(int(record["created_ms"]) / 1000, tz=dt_timezone.utc),
    }
