"""The agent's Celery tasks (`fgpu.agent.*`, protocol): consumed from queue `agent.<node>` by the
embedded worker of `python manage.py agent` (or run eagerly in standalone mode), each hands its
message to the node's Agent on its asyncio loop and returns at once; the agent reports progress
to the manager. Idempotent by session id (a redelivered start or stop changes nothing); they
never touch the database."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, TypeVar

from celery import shared_task

import protocol
from protocol.messages import Malformed, SessionNotice, SessionsSync, SessionStop, StartSpec
from protocol.mig_messages import MigReconcile

if TYPE_CHECKING:
    from agent.core import Agent

log = logging.getLogger(__name__)


def _agent(node: str) -> Agent:
    from agent.core import agent_for

    return agent_for(node)


@shared_task(name=protocol.SESSION_START)
def session_start(*, node: str, spec: dict[str, Any]) -> None:
    """Start a session's process on `node` (returns at once; the agent reports progress). `spec`:
    protocol.messages.StartSpec as sent; a malformed one is logged and dropped (the manager's
    heartbeat reconcile sends the start again while the session waits for it)."""
    try:
        start = StartSpec.decode(spec)
    except Malformed as exc:
        log.warning("agent %s: dropped a malformed start: %s", node, exc)
        return
    _agent(node).submit_start(start)


@shared_task(name=protocol.SESSION_STOP)
def session_stop(*, node: str, **message: Any) -> None:
    """Stop a session on `node` (protocol.messages.SessionStop, its keyword arguments as sent; a
    malformed one is logged and dropped: the heartbeat's reconcile sends the stop again)."""
    stop = _decoded(SessionStop, node, message)
    if stop is not None:
        _agent(stop.node).submit_stop(stop.session_id)


@shared_task(name=protocol.SESSIONS_SYNC)
def sessions_sync(*, node: str, **message: Any) -> None:
    """Kill every session the agent runs that the manager does not list in `keep`
    (protocol.messages.SessionsSync; a malformed one is logged and dropped, nothing killed)."""
    sync = _decoded(SessionsSync, node, message)
    if sync is not None:
        _agent(sync.node).submit_sync(list(sync.keep))


@shared_task(name=protocol.MIG_RECONCILE)
def mig_reconcile(*, node: str, **message: Any) -> None:
    """Apply the manager's expected MIG layout on the node's GPUs (protocol.mig_messages.MigReconcile,
    its keyword arguments as sent; `accelerators.mig_services.node_mig_push` sends it): destroy the
    idle instances in `destroy`, re-create missing expected ones, report strangers. A malformed
    one is logged and dropped (the manager asks again on the next registration, layout change or
    heartbeat whose digest differs)."""
    reconcile = _decoded(MigReconcile, node, message)
    if reconcile is None:
        return
    _agent(reconcile.node).submit_mig_reconcile(reconcile)


@shared_task(name=protocol.SESSION_NOTICE)
def session_notice(*, node: str, **message: Any) -> None:
    """Show a text in the session's terminal on `node` (protocol.messages.SessionNotice: the
    manager's idle warnings, issue 15); nothing if the session does not run there, or if the
    message is malformed (logged)."""
    notice = _decoded(SessionNotice, node, message)
    if notice is not None:
        _agent(notice.node).usage.notice(notice.session_id, notice.text)


M = TypeVar("M", SessionStop, SessionsSync, SessionNotice, MigReconcile)


def _decoded(kind: type[M], node: str, message: dict[str, Any]) -> M | None:
    """The task's keyword arguments (`node` and the others) decoded as `kind`, or None once
    logged when they are malformed: a bad message is dropped, and the agent runs on."""
    try:
        return kind.decode({"node": node, **message})
    except Malformed as exc:
        log.warning("agent %s: dropped a malformed %s: %s", str(node)[:64], kind.__name__, exc)
        return None
