"""Celery tasks: thin wrappers that take ids and plain data and call one service.

`fgpu.manager.*` run in the manager worker (queue `manager`) and use the database. The agents'
tasks (`fgpu.agent.*`, queue `agent.<node>`) live on the node side, in agent/tasks.py: the
manager knows them by name only (protocol) and sends them with `agent_send`. Routes:
`common.celery.route_task`.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task
from django.conf import settings
from django.core.exceptions import ValidationError

import protocol
from protocol.messages import (
    Heartbeat,
    LogBatch,
    Malformed,
    NodeStorage,
    Registration,
    SessionId,
    SessionReport,
    SessionsSync,
)
from protocol.mig_messages import MigReport
from accelerators.node_messages import node_message_authentic, node_message_decoded
from common.celery import agent_send, manager_task  # noqa: F401 (agent_send: re-exported)
from sessions.lifecycle.passes import SCHEDULE_PENDING_TASK, SCHEDULE_QUEUED_KEY, _redis, schedule_pending_soon

log = logging.getLogger(__name__)


# --- manager side -------------------------------------------------------------------------


def _storage(node: str, value) -> NodeStorage:
    """The node's storage as its registration states it (protocol.messages.NodeStorage; none, from
    an agent before it: local). A malformed one is logged and read as local: safe, since a local
    node's sessions are told their folders are local to it."""
    try:
        return NodeStorage.decode(value)
    except Malformed as exc:
        log.warning("node %s reported malformed storage, read as local: %s", node, exc)
        return NodeStorage()


@manager_task(protocol.AGENT_REGISTER)
def agent_register(**message: Any) -> None:
    """An agent started (protocol.messages.Registration, its keyword arguments as sent, the
    signature among them; a malformed one is logged and dropped: the agent registers again on its
    next heartbeat): apply its inventory and the session images it holds (`images`, see protocol;
    None from an agent before images: the process runtime's "host"), reconcile its sessions, tell
    it which to keep. `image_service_ports`: the held images' ai.backend.service-ports labels,
    which the image records matching them take their apps from (image_service_ports_apply). A
    device entry the DeviceInfo of this version cannot take drops the registration the same way."""
    registration = node_message_decoded(Registration, message)
    if registration is None or not node_message_authentic(protocol.AGENT_REGISTER, registration.node, **message):
        return
    from accelerators.mig_services import node_mig_push
    from accelerators.plugins.base import DeviceInfo
    from accelerators.services import node_inventory_apply, node_links_apply
    from sessions.policy.images import image_service_ports_apply
    from sessions.lifecycle.services import sessions_reconcile_node

    node, inventory = registration.node, registration.inventory
    try:
        devices = [DeviceInfo(**d) for d in inventory.devices]
    except TypeError as exc:
        log.warning("dropped the registration of node %s: a device the manager cannot read: %s", node, exc)
        return
    registered = node_inventory_apply(
        node_name=node,
        devices=devices,
        plugins=list(inventory.plugins or ()),
        attributes=inventory.attributes or {},
        cpu_count=inventory.cpu_count,
        memory_size=inventory.memory_size,
        images=registration.images,
        shared_storage=_storage(node, inventory.storage).shared,
    )
    try:
        node_links_apply(node=registered, links=list(inventory.links or ()))
    except ValueError as exc:  # a bad topology report must not keep the node's GPUs out of use
        log.warning("node %s reported unusable device links, ignored: %s", node, exc)
    if registration.image_service_ports:
        image_service_ports_apply(node_name=node, images=registered.images, service_ports=registration.image_service_ports)
    keep = sessions_reconcile_node(node_name=node, running=list(registration.running))
    agent_send(protocol.SESSIONS_SYNC, **SessionsSync(node, tuple(SessionId(k) for k in keep)).encode())
    node_mig_push(node=registered, kind="start")  # MIG GPUs: the agent re-applies the layout, reports strangers
    schedule_pending_soon()


@manager_task(protocol.MIG_REPORT)
def mig_report(*, node: str, report: dict, signature: str | None = None) -> None:
    """What an agent's MIG reconcile found (protocol.mig_messages.MigReport, as sent; idempotent:
    the report replaces the last one per GPU). A malformed one is logged and dropped."""
    from accelerators.mig_services import node_mig_report_apply

    if not node_message_authentic(protocol.MIG_REPORT, node, node=node, report=report, signature=signature):
        return
    try:
        found = MigReport.decode(report)
    except Malformed as exc:
        log.warning("node %s: dropped a malformed MIG report: %s", node, exc)
        return
    node_mig_report_apply(node_name=node, report=found)


@shared_task(name=protocol.AGENT_HEARTBEAT, acks_late=True)
def agent_heartbeat(**message: Any) -> None:
    """An agent's heartbeat (protocol.messages.Heartbeat, its keyword arguments as sent, the
    signature among them; a malformed one is logged and dropped). `mig_digest`: the digest of
    the GPU instances the agent finds on its MIG GPUs (None: none known); a mismatch with the
    manager's asks for a full MIG reconcile (`node_mig_heartbeat_check`). `state`: the agent's
    view of its sessions (protocol.messages.AgentState: `Agent.state`), reconciled with the database
    (sessions.lifecycle.reconcile); a state refused whole is logged and not reconciled (the rest of
    the heartbeat applies), an entry malformed on its own is logged and its session left as it is.
    `images`: the session images the node holds ({reference: image id}; None, from an agent
    before images: left as registered); when they changed, a scheduler pass places the sessions
    waiting for them. `image_service_ports` as for agent_register, applied on every heartbeat
    that carries it (an image record created since takes its apps within one heartbeat; one
    query of the records its labels name). Not retried: the next heartbeat comes within seconds."""
    from accelerators.mig_services import node_mig_heartbeat_check
    from accelerators.services import node_heartbeat, node_images_apply
    from sessions.policy.images import image_service_ports_apply
    from sessions.lifecycle.reconcile import sessions_reconcile_heartbeat

    beat = node_message_decoded(Heartbeat, message)
    if beat is None or not node_message_authentic(protocol.AGENT_HEARTBEAT, beat.node, **message):
        return
    node = beat.node
    if not node_heartbeat(node_name=node):
        log.warning("heartbeat from unregistered node %s", node)
        return
    if beat.images is not None and node_images_apply(node_name=node, images=beat.images):
        schedule_pending_soon()
    if beat.images is not None and beat.image_service_ports:
        image_service_ports_apply(node_name=node, images=beat.images, service_ports=beat.image_service_ports)
    node_mig_heartbeat_check(node_name=node, digest=beat.mig_digest)
    if beat.state_error:
        log.warning("heartbeat of %s: its state could not be read, its sessions are not reconciled: %s", node, beat.state_error)
    elif beat.state is not None:
        sessions_reconcile_heartbeat(node_name=node, state=beat.state)


@manager_task(protocol.SESSION_REPORT)
def session_report(**message: Any) -> None:
    """An agent's report on a session (protocol.messages.SessionReport, its keyword arguments as
    sent; a malformed one is logged and dropped). `node`: the agent's node (agents from before
    node keys leave it out); the report applies only to a session on that node, and only when
    signed with its key where it has one."""
    from sessions.lifecycle.services import session_report_apply

    report = node_message_decoded(SessionReport, message)
    if report is None:
        return
    session, authentic = _session_message(protocol.SESSION_REPORT, report.session_id, report.node, message)
    if not authentic:
        return
    session_report_apply(
        session_id=report.session_id,
        status=report.status,
        reason=report.reason,
        exit_code=report.exit_code,
        node=report.node,
        session=session,
    )


@manager_task(protocol.SESSION_LOG_APPEND)
def session_log_append(**message: Any) -> None:
    """Store one batch of a session's output (protocol.messages.LogBatch, its keyword arguments as
    sent; a malformed one is logged and dropped), idempotent by `seq` (so acks_late is safe); from
    the session's own node only (see `session_report`)."""
    from sessions.lifecycle.services import session_log_append as append

    batch = node_message_decoded(LogBatch, message)
    if batch is None:
        return
    node = batch.node
    session, authentic = _session_message(protocol.SESSION_LOG_APPEND, batch.session_id, node, message)
    if not authentic:
        return
    if session is None:
        log.warning("agent shipped output for unknown session %s", batch.session_id)
        return
    placed = session.node
    if node is not None and (placed is None or placed.name != node):
        log.warning("refused output of session %s from node %s: the session does not run there", batch.session_id, node)
        return
    append(session_id=batch.session_id, seq=batch.seq, offset=batch.offset, text=batch.text, final=batch.final, known=True)


def _session_message(task: str, session_id: str, node: str | None, message: dict[str, Any]):
    """(The session of an agent's report or log batch with its node, or None; whether the message
    is authentic): signed by `node`, the sender (else, from an agent before node keys, the node the
    session is placed on), with its key where it has one."""
    session = _session_with_node(session_id)
    placed = session.node if session is not None else None
    return session, node_message_authentic(task, node or (placed.name if placed is not None else None), known=placed, **message)


def _session_with_node(session_id: str):
    """The session with its node (the node's key included: one query), or None for an unknown
    or malformed id: what an agent's report or log batch is checked against and applied to."""
    from sessions.models import ComputeSession

    try:
        return ComputeSession.objects.select_related("node").filter(pk=session_id).first()
    except (ValueError, TypeError, ValidationError):
        return None


@manager_task(SCHEDULE_PENDING_TASK)
def schedule_pending() -> None:
    from common.celery import app
    from sessions.scheduling.scheduler import schedule_pending as run

    if settings.REDIS_URL and not app.conf.task_always_eager:
        _redis().delete(SCHEDULE_QUEUED_KEY)
    run()


@manager_task("fgpu.manager.node_check_heartbeats")
def node_check_heartbeats() -> None:
    """Every few seconds (beat): nodes silent FGPU_HEARTBEAT_TIMEOUT seconds are marked LOST, and
    LOST ones silent FGPU_FENCE_TIMEOUT_SECONDS are declared dead, their sessions ended
    (sessions.lifecycle.reconcile.sessions_fence_expire)."""
    from accelerators.services import node_mark_lost
    from sessions.lifecycle.reconcile import sessions_fence_expire

    node_mark_lost(timeout_s=settings.FGPU_HEARTBEAT_TIMEOUT)
    sessions_fence_expire(timeout_s=settings.FGPU_FENCE_TIMEOUT_SECONDS)
