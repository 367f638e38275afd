"""Usage tasks, thin: the agents' sample batches (queue `manager.usage`) and the periodic
rollup and idle check (beat, queue `manager`). Each calls one service in usage.services."""

from __future__ import annotations

import protocol
from sessions.tasks import manager_task


@manager_task(protocol.USAGE_REPORT)
def usage_report(*, node: str, batch: dict, signature: str | None = None) -> dict:
    """Store one batch of `node`'s usage samples (idempotent, so acks_late is safe); signed with
    the node's key where it has one. Returns the IngestResult's counts (for logs and tests)."""
    from accelerators.services import node_message_verify
    from usage.services import usage_ingest

    kwargs = {"node": node, "batch": batch, protocol.SIGNATURE: signature}
    if not node_message_verify(node_name=node, task=protocol.USAGE_REPORT, kwargs=kwargs):
        return {"stored": 0, "duplicates": 0, "refused": {"not authentic": 1}}
    result = usage_ingest(node_name=node, batch=batch)
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
