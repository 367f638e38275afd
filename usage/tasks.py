"""Usage tasks, thin: the agents' sample batches (queue `manager.usage`) and the periodic
rollup and idle check (beat, queue `manager`). Each calls one service in usage.services."""

from __future__ import annotations

from typing import Any

import protocol
from protocol.messages import UsageBatch
from accelerators.node_messages import node_message_authentic, node_message_decoded
from common.celery import manager_task


@manager_task(protocol.USAGE_REPORT)
def usage_report(**message: Any) -> dict:
    """Store one batch of a node's usage samples (protocol.messages.UsageBatch, its keyword
    arguments as sent: node, batch, signature; idempotent, so acks_late is safe); signed with the
    node's key where it has one. A malformed batch is logged and dropped (refused as one
    "malformed batch"). Returns the IngestResult's counts (for logs and tests)."""
    from usage.services import usage_ingest

    batch = node_message_decoded(UsageBatch, message)
    if batch is None:
        return {"stored": 0, "duplicates": 0, "refused": {"malformed batch": 1}}
    if not node_message_authentic(protocol.USAGE_REPORT, batch.node, **message):
        return {"stored": 0, "duplicates": 0, "refused": {"not authentic": 1}}
    result = usage_ingest(node_name=batch.node, batch=batch)
    return {"stored": result.stored, "duplicates": result.duplicates, "refused": result.refused}


@manager_task("fgpu.manager.usage_rollup")
def usage_rollup() -> dict:
    """5-minute means up to the watermark; retention (usage.services.usage_rollup)."""
    from usage.services import usage_rollup as run

    return run()


@manager_task("fgpu.manager.usage_idle_check")
def usage_idle_check() -> dict:
    """Warn and reclaim idle sessions and those past their maximum lifetime."""
    from usage.services import usage_idle_check as run

    return run()
