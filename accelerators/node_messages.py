"""What the manager's tasks do first with a message an agent sent (sessions.tasks, usage.tasks):
decode it (protocol.messages: a malformed one is logged and dropped, never retried and never a
crash) and check that it comes from the node it names (`node_message_verify`: signed with the
node's key where it has one)."""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import protocol
from protocol.messages import Heartbeat, LogBatch, Malformed, Registration, SessionReport, UsageBatch

from accelerators.models import Node
from accelerators.services import node_message_verify

log = logging.getLogger(__name__)

M = TypeVar("M", Heartbeat, SessionReport, LogBatch, Registration, UsageBatch)


def node_message_decoded(kind: type[M], message: dict[str, Any]) -> M | None:
    """`message` (a task's keyword arguments, its signature among them) decoded as `kind`, or None
    once a warning says why it is malformed ("dropped an agent's malformed message: <the field>")."""
    try:
        return kind.decode({k: v for k, v in message.items() if k != protocol.SIGNATURE})
    except Malformed as exc:
        log.warning("dropped an agent's malformed message: %s", exc)
        return None


def node_message_authentic(task: str, sender: str | None, *, known: Node | None = None, **kwargs: Any) -> bool:
    """Whether an agent's message may be applied (node_message_verify, which logs a refusal):
    `task` its task name, `sender` the node it comes from (None: a report for a session on no node,
    or gone, which has nothing to be checked against: True), `kwargs` the task's keyword arguments
    as sent, its signature included; `known`: a Node row the task read already (used when it is
    the sender's: no second query)."""
    if sender is None:
        return True
    if kwargs.get("node") is None:
        kwargs.pop("node", None)  # an agent from before node keys sends no node: check what it signed
    return node_message_verify(node_name=sender, task=task, kwargs=kwargs, node=known)
