"""Celery tasks: thin wrappers that take ids and plain data and call one service.

`fgpu.manager.*` run in the manager worker (queue `manager`) and use the database.
`fgpu.agent.*` run in the agent of the node named by their `node` keyword (queue
`agent.<node>`) and never touch the database. Routes: `console.celery.route_task`.
"""
from __future__ import annotations

import logging

from celery import shared_task
from django.conf import settings

log = logging.getLogger(__name__)


# --- manager side -------------------------------------------------------------------------

@shared_task(name="fgpu.manager.agent_register", acks_late=True)
def agent_register(*, node: str, inventory: dict, running: list[str]) -> None:
    """An agent started: apply its inventory, reconcile its sessions, tell it which to keep."""
    from accelerators.mig_services import node_mig_push
    from accelerators.plugins.base import DeviceInfo
    from accelerators.services import node_inventory_apply, node_links_apply
    from sessions.services import sessions_reconcile_node

    registered = node_inventory_apply(
        node_name=node,
        devices=[DeviceInfo(**d) for d in inventory["devices"]],
        plugins=inventory.get("plugins", []),
        attributes=inventory.get("attributes", {}),
        cpu_count=inventory.get("cpu_count"),
        memory_size=inventory.get("memory_size"),
    )
    try:
        node_links_apply(node=registered, links=inventory.get("links", []))
    except ValueError as exc:  # a bad topology report must not keep the node's GPUs out of use
        log.warning("node %s reported unusable device links, ignored: %s", node, exc)
    keep = sessions_reconcile_node(node_name=node, running=running)
    sessions_sync.delay(node=node, keep=keep)
    node_mig_push(node=registered, kind="start")  # MIG GPUs: the agent re-applies the layout, reports strangers
    schedule_pending_soon()


@shared_task(name="fgpu.manager.mig_report", acks_late=True)
def mig_report(*, node: str, report: dict) -> None:
    """What an agent's MIG reconcile found (idempotent: the report replaces the last one per GPU)."""
    from accelerators.mig_services import node_mig_report_apply

    node_mig_report_apply(node_name=node, report=report)


@shared_task(name="fgpu.manager.agent_heartbeat", acks_late=True)
def agent_heartbeat(*, node: str, running: list[str], mig_digest: str | None = None) -> None:
    """`mig_digest`: the digest of the GPU instances the agent finds on its MIG GPUs (None: none
    known); a mismatch with the manager's asks for a full MIG reconcile (`node_mig_heartbeat_check`)."""
    from accelerators.mig_services import node_mig_heartbeat_check
    from accelerators.services import node_heartbeat

    if not node_heartbeat(node_name=node):
        log.warning("heartbeat from unregistered node %s", node)
        return
    node_mig_heartbeat_check(node_name=node, digest=mig_digest)


@shared_task(name="fgpu.manager.session_report", acks_late=True)
def session_report(*, session_id: str, status: str, reason: str = "", exit_code: int | None = None) -> None:
    from sessions.services import session_report_apply

    session_report_apply(session_id=session_id, status=status, reason=reason, exit_code=exit_code)


@shared_task(name="fgpu.manager.session_log_append", acks_late=True)
def session_log_append(*, session_id: str, seq: int, offset: int, text: str, final: bool = False) -> None:
    """Store one batch of a session's output (idempotent by `seq`, so acks_late is safe)."""
    from sessions.services import session_log_append as append

    append(session_id=session_id, seq=seq, offset=offset, text=text, final=final)


SCHEDULE_QUEUED_KEY = "fgpu:schedule-pending:queued"


def _redis():
    import redis

    return redis.Redis.from_url(settings.REDIS_URL)


def schedule_pending_soon() -> None:
    """Ask for a scheduler pass, coalescing requests: while one pass is queued and has not
    started, more launches and releases add none (each pass sees every session committed before
    it starts, because it clears the flag first). Without this, N launches queue N passes that
    run one after another and delay the agents' reports behind them. The flag expires after
    30 s in case its pass is lost; beat runs a pass every 10 s anyway."""
    from console.celery import app

    if settings.REDIS_URL and not app.conf.task_always_eager:
        if not _redis().set(SCHEDULE_QUEUED_KEY, 1, nx=True, ex=30):
            return
    schedule_pending.delay()


@shared_task(name="fgpu.manager.schedule_pending", acks_late=True)
def schedule_pending() -> None:
    from console.celery import app
    from sessions.scheduler import schedule_pending as run

    if settings.REDIS_URL and not app.conf.task_always_eager:
        _redis().delete(SCHEDULE_QUEUED_KEY)
    run()


@shared_task(name="fgpu.manager.node_check_heartbeats", acks_late=True)
def node_check_heartbeats() -> None:
    from accelerators.services import node_mark_lost

    node_mark_lost(timeout_s=settings.FGPU_HEARTBEAT_TIMEOUT)


# --- agent side ---------------------------------------------------------------------------

def _agent(node: str):
    from sessions.runtime.agent import agent_for

    return agent_for(node)


@shared_task(name="fgpu.agent.session_start")
def session_start(*, node: str, spec: dict) -> None:
    """Start a session's process on `node` (returns at once; the agent reports progress)."""
    _agent(node).submit_start(spec)


@shared_task(name="fgpu.agent.session_stop")
def session_stop(*, node: str, session_id: str) -> None:
    _agent(node).submit_stop(session_id)


@shared_task(name="fgpu.agent.sessions_sync")
def sessions_sync(*, node: str, keep: list[str]) -> None:
    """Kill every session the agent runs that the manager does not list in `keep`."""
    _agent(node).submit_sync(keep)


@shared_task(name="fgpu.agent.mig_reconcile")
def mig_reconcile(*, node: str, gpus: list[dict], expected: dict, destroy: dict | None = None, kind: str = "start",
                  seq: int | None = None) -> None:
    """Apply the manager's expected MIG layout on `node`'s GPUs: destroy the idle instances in
    `destroy`, re-create missing expected ones, report strangers; `kind` "start" (after
    registering), "layout" (an administrator's change) or "drift" (a heartbeat digest differed),
    `seq` echoed in the report (`accelerators.mig_services.node_mig_push` gives the arguments)."""
    _agent(node).submit_mig_reconcile(gpus, expected, destroy=destroy, kind=kind, seq=seq)
