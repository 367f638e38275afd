"""Level-triggered reconciliation of a node's sessions with what its agent says it runs.

Messages are hints, state is truth (DESIGN.md, "How the system heals"): every heartbeat carries
the agent's view of its sessions (`agent.core.Agent.state`), and
`sessions_reconcile_heartbeat` compares it with the database and repairs both sides, as a
kubelet's sync loop does. Each contradiction has a bound after which it is repaired, counted
from the moment the fault heals (the agent's next heartbeat, every FGPU_HEARTBEAT_INTERVAL
seconds, reaches the manager):

| database | agent says | repair |
|---|---|---|
| SCHEDULED, PREPARING | RUNNING / PREPARING | move it on (RUNNING / PREPARING) |
| any active state | ended (TERMINATED, ERROR) | end it as the agent says, release its allocations |
| SCHEDULED, PREPARING | nothing, START_RESEND_S after it was scheduled | send the start again |
| RUNNING | nothing | ERROR ("the agent no longer runs it"), allocations released |
| TERMINATING | RUNNING / PREPARING | send the stop again |
| TERMINATING | nothing | TERMINATED, allocations released |
| ended, or unknown | RUNNING / PREPARING / TERMINATING | tell the agent to stop it |

"nothing" counts only for sessions scheduled SKEW_S before the agent took its snapshot (its
clock, `state.at`), so a heartbeat that was on its way while a start was sent cannot end a
session that is just starting; heartbeats older than HEARTBEAT_EXPIRES_S are dropped unread.
So a session stuck by a lost message moves on within START_RESEND_S + two heartbeat intervals
of its agent being reachable again; a session whose entry in the state could not be read
(protocol.messages.AgentState.unreadable: a status a later agent knows, a field of the wrong type)
is left as it is for that heartbeat, neither moved, ended, started nor stopped; an agent that stays away is marked LOST after
FGPU_HEARTBEAT_TIMEOUT and its sessions end when it registers again.

Fencing (issue 33): a session terminated while its node is LOST stays TERMINATING and keeps its
devices (sessions.lifecycle.services.session_terminate), since its processes may still run there. What
ends it is proof that they are gone: the agent's own report of what runs (a heartbeat or a
registration without it; a restart alone is no proof, since the docker runtime adopts its
containers), or the node declared dead — silent past FGPU_FENCE_TIMEOUT_SECONDS
(`sessions_fence_expire`) or marked dead by an administrator (`node_sessions_end`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any

from django.db import transaction
from django.utils import timezone

import protocol
from protocol.messages import AgentState, NodeName, SessionId, SessionStop
from sessions.models import ACTIVE_STATUSES, Allocation, ComputeSession, SessionStatus

log = logging.getLogger(__name__)

START_RESEND_S = 10  # a SCHEDULED or PREPARING session its agent does not know gets its start again after this
SKEW_S = 5  # how far the agent's clock may be behind the manager's
ENDED_STATES = (SessionStatus.TERMINATED, SessionStatus.ERROR)


def sessions_reconcile_heartbeat(*, node_name: str, state: AgentState) -> dict[str, int]:
    """Compare `node_name`'s sessions in the database with its agent's `state` (the heartbeat's,
    protocol.messages.AgentState: the sessions it runs, those it reported ended, when) and repair
    the differences (see the module's table). Returns how many of each repair it made: {"moved",
    "ended", "starts", "stops"}, and "malformed" when some of the state's entries could not be read
    (logged; their sessions are left as they are)."""
    from sessions.lifecycle.services import session_report_apply

    reported, ended, unreadable = state.statuses, state.ends, state.unreadable
    if state.malformed:
        log.warning(
            "heartbeat of %s: %d entries of its state could not be read, their sessions left as they are: %s",
            node_name,
            len(state.malformed),
            "; ".join(state.malformed[:3]),
        )
    taken_at = datetime.fromtimestamp(state.at, tz=dt_timezone.utc)
    now = timezone.now()
    settled_before = min(taken_at, now) - timedelta(seconds=SKEW_S)
    counts = {"moved": 0, "ended": 0, "starts": 0, "stops": 0}
    starts, stops = [], []
    active = list(ComputeSession.objects.filter(node__name=node_name, status__in=ACTIVE_STATUSES).select_related("node", "owner"))
    for session in active:
        sid, status = SessionId(str(session.pk)), session.status
        if sid in unreadable:
            continue
        theirs, end = reported.get(sid), ended.get(sid)
        settled = session.scheduled_at is not None and session.scheduled_at < settled_before
        if end is not None and theirs is None:
            if session_report_apply(
                session_id=sid,
                status=end.status if end.status in ENDED_STATES else SessionStatus.ERROR,
                reason=end.reason,
                exit_code=end.exit_code,
            ):
                counts["ended"] += 1
        elif theirs in ("RUNNING", "PREPARING"):
            if status == SessionStatus.TERMINATING:
                stops.append(sid)
            elif status in (SessionStatus.SCHEDULED, SessionStatus.PREPARING) and theirs != status:
                if session_report_apply(
                    session_id=sid,
                    status=theirs,
                    reason="" if theirs == "RUNNING" else "preparing the working directory and environment",
                ):
                    counts["moved"] += 1
        elif theirs is None and settled:
            if status in (SessionStatus.SCHEDULED, SessionStatus.PREPARING):
                if session.scheduled_at is not None and session.scheduled_at < now - timedelta(seconds=START_RESEND_S):
                    starts.append(session)
            elif status in (SessionStatus.RUNNING, SessionStatus.TERMINATING):
                final = SessionStatus.ERROR if status == SessionStatus.RUNNING else SessionStatus.TERMINATED
                reason = (
                    "its agent no longer runs it (the process is gone)"
                    if status == SessionStatus.RUNNING
                    else "terminated (its agent no longer ran it)"
                )
                if session_report_apply(session_id=sid, status=final, reason=reason):
                    counts["ended"] += 1
    known = {str(s.pk) for s in active}
    strays = [sid for sid in reported if sid not in known]
    if strays:  # the agent runs sessions the database has ended (or never had): they must not linger
        still_active = set(
            ComputeSession.objects.filter(pk__in=valid_uuids(strays), status__in=ACTIVE_STATUSES).values_list("pk", flat=True)
        )
        stops.extend(sid for sid in strays if sid not in {str(pk) for pk in still_active})
    for session in starts:
        _resend_start(node_name, session)
    for sid in stops:
        _resend_stop(node_name, sid)
    counts["starts"], counts["stops"] = len(starts), len(stops)
    if any(counts.values()):
        log.info("reconciled node %s with its agent: %s", node_name, counts)
    if state.malformed:
        counts["malformed"] = len(state.malformed)
    return counts


def node_sessions_end(*, node_name: str, reason: str) -> int:
    """Fencing's last step (issue 33): node `node_name` is declared dead — an administrator marked
    it so, or it stayed silent past FGPU_FENCE_TIMEOUT_SECONDS (`sessions_fence_expire`) — so its
    processes are assumed gone: every active session on it ends, TERMINATING ones TERMINATED (the
    stop they waited for; a requester's reason is kept), the others ERROR, each with `reason`,
    and their allocations are released (sessions.lifecycle.services.session_report_apply: compare-and-set,
    exactly once). Should the node come back with them running, its agent's first heartbeat gets
    them stopped (the strays of `sessions_reconcile_heartbeat`). Returns how many ended."""
    from sessions.lifecycle.services import session_report_apply

    ended = 0
    for session in ComputeSession.objects.filter(node__name=node_name, status__in=ACTIVE_STATUSES).select_related("node"):
        final = SessionStatus.TERMINATED if session.status == SessionStatus.TERMINATING else SessionStatus.ERROR
        ended += session_report_apply(session_id=str(session.pk), status=final, reason=reason, session=session)
    if ended:
        log.warning("node %s declared dead: %d session(s) ended, their devices released (%s)", node_name, ended, reason)
    return ended


def sessions_fence_expire(*, timeout_s: int) -> dict[str, int]:
    """Declare dead every LOST node silent for more than `timeout_s` seconds (counted from its last
    heartbeat; 0: never) that still has active sessions, and end them (`node_sessions_end`). Each
    node is locked, LOST and still silent, while its sessions end, so a heartbeat landing meanwhile
    waits and then finds them ended (its agent is told to stop what still runs). Returns {node
    name: sessions ended}. Run every few seconds by the manager's beat (node_check_heartbeats)."""
    from accelerators.models import Node, NodeStatus

    if not timeout_s:
        return {}
    cutoff = timezone.now() - timedelta(seconds=timeout_s)
    silent = Node.objects.filter(status=NodeStatus.LOST, last_heartbeat__lt=cutoff)
    names = list(silent.filter(sessions__status__in=ACTIVE_STATUSES).values_list("name", flat=True).distinct())
    counts = {}
    for name in names:
        with transaction.atomic():
            if not list(silent.filter(name=name).select_for_update().values_list("pk", flat=True)):
                continue  # it came back meanwhile: its agent's reports decide
            counts[name] = node_sessions_end(
                node_name=name, reason=f"node {name} was silent for over {timeout_s} s: its processes are assumed gone"
            )
    return counts


def valid_uuids(values: Iterable[str]) -> list[str]:
    """The session ids an agent sent that are UUIDs, as text; the malformed ones are logged and
    left out (reconciliation here, usage batches in usage.services)."""
    out = []
    for value in values:
        try:
            out.append(str(uuid.UUID(value)))
        except ValueError:
            log.warning("an agent reported a session id that is no UUID: %r", value[:80])
    return out


def session_start_spec_again(session: ComputeSession) -> dict[str, Any]:
    """The start spec of a scheduled session rebuilt from the database, for a start the agent
    never got: the allocations' devices and, for a MIG session, its GPU instance to create or
    reuse (no idle instances to destroy: a lost first start may have left them, and the agent
    then reports a layout that needs reconciling)."""
    from accelerators.models import GpuInstance
    from sessions.lifecycle.start_spec import mig_block, session_start_message

    allocations = list(Allocation.objects.filter(session=session, released_at__isnull=True).select_related("device"))
    instance = GpuInstance.objects.filter(session=session).select_related("parent").first()
    block = mig_block(gpu=instance.parent, instance=instance, reuse=True) if instance is not None else None
    return session_start_message(session, allocations, mig=block).encode()


def _resend_start(node_name: str, session: ComputeSession) -> None:
    from common.celery import agent_send

    spec = session_start_spec_again(session)
    log.info(
        "session %s is %s but its agent on %s does not know it: sending its start again", session.pk, session.status, node_name
    )
    transaction.on_commit(lambda: agent_send(protocol.SESSION_START, node=node_name, spec=spec))


def _resend_stop(node_name: str, session_id: str) -> None:
    from common.celery import agent_send

    log.info("the agent on %s still runs session %s, which is ending or ended here: sending its stop", node_name, session_id)
    stop = SessionStop(NodeName(node_name), SessionId(session_id))
    transaction.on_commit(lambda: agent_send(protocol.SESSION_STOP, **stop.encode()))
