"""The agent's Celery tasks (`fgpu.agent.*`, protocol): consumed from queue `agent.<node>` by the
embedded worker of `python manage.py agent` (or run eagerly in standalone mode), each hands its
message to the node's Agent on its asyncio loop and returns at once; the agent reports progress
to the manager. Idempotent by session id (a redelivered start or stop changes nothing); they
never touch the database."""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task

import protocol
from protocol.messages import Malformed, StartSpec
from protocol.mig_messages import MigReconcile

log = logging.getLogger(__name__)


def _agent(node: str):
    from agent.core import agent_for

    return agent_for(node)


@shared_task(name=protocol.SESSION_START)
def session_start(*, node: str, spec: dict) -> None:
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
def session_stop(*, node: str, session_id: str) -> None:
    _agent(node).submit_stop(session_id)


@shared_task(name=protocol.SESSIONS_SYNC)
def sessions_sync(*, node: str, keep: list[str]) -> None:
    """Kill every session the agent runs that the manager does not list in `keep`."""
    _agent(node).submit_sync(keep)


@shared_task(name=protocol.MIG_RECONCILE)
def mig_reconcile(*, node: str, **message: Any) -> None:
    """Apply the manager's expected MIG layout on the node's GPUs (protocol.mig_messages.MigReconcile,
    its keyword arguments as sent; `accelerators.mig_services.node_mig_push` sends it): destroy the
    idle instances in `destroy`, re-create missing expected ones, report strangers. A malformed
    one is logged and dropped (the manager asks again on the next registration, layout change or
    heartbeat whose digest differs)."""
    try:
        reconcile = MigReconcile.decode({"node": node, **message})
    except Malformed as exc:
        log.warning("agent %s: dropped a malformed MIG reconcile: %s", str(node)[:64], exc)
        return
    _agent(reconcile.node).submit_mig_reconcile(reconcile)


@shared_task(name=protocol.SESSION_NOTICE)
def session_notice(*, node: str, session_id: str, text: str) -> None:
    """Show `text` in the session's terminal on `node` (the manager's idle warnings, issue 15);
    nothing if the session does not run there."""
    _agent(node).usage.notice(session_id, text)
