"""Draining a node (issue 37.4), as Kubernetes' `kubectl cordon` / `drain` and Slurm's
`scontrol update NodeName=… State=DRAIN`: an administrator takes a node out of service for
maintenance without killing what runs there.

A draining node (`Node.drain_since` set) takes no new session: the allocator's scope leaves it
out (`accelerators.selectors.node_states` and the kept view, `accelerators.cluster_view`, with
`alive_only`), so the scheduler's pass, the launch preview, the ETA and the what-if all see the
same. Its sessions run on to their end; with `evict`, each running one gets the preemption
notice and grace, is stopped and requeued as a new session (`sessions.scheduling.preemption`,
its drain part). The node is "draining: N sessions left" while any of its sessions is active
(`protocol.SESSION_ACTIVE_STATES`), then "drained"; `node_undrain` puts it back in service. Its
agent heartbeats as before; the drain is the database's, so it outlives restarts of the manager
and the agent.

Writes send `node_drain_changed` after commit (sessions asks for a scheduler pass: notices to
give, or room back for waiting sessions)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from functools import partial

from django.db import transaction
from django.db.models import Count, Q
from django.dispatch import Signal
from django.utils import timezone

import protocol
from accelerators.models import Node

log = logging.getLogger(__name__)

MAX_REASON_CHARS = 200  # Node.drain_reason's max_length

IN_SERVICE = "in service"
DRAINING = "draining"
DRAINED = "drained"

# Sent after commit of a drain or an undrain that changed something: sender=Node, node=the Node.
node_drain_changed = Signal()


@dataclass(frozen=True)
class DrainState:
    """A node's drain as the API, the admin and the CLI show it. `state`: "in service",
    "draining" (some of its sessions still active) or "drained" (none left); `sessions_left`:
    its active sessions (any state from SCHEDULED to TERMINATING); `evict`, `reason`, `by`
    (the administrator's username) and `since` as the drain set them (False, "", "", None in
    service)."""

    state: str
    sessions_left: int
    evict: bool
    reason: str
    by: str
    since: datetime | None

    @property
    def label(self) -> str:
        """ "draining: 2 sessions left", "drained", or "in service"."""
        if self.state == DRAINING:
            return f"draining: {self.sessions_left} session{'s' if self.sessions_left != 1 else ''} left"
        return self.state

    def as_dict(self) -> dict:
        """`{"state", "label", "sessions_left", "evict", "reason", "by", "since"}` (since: ISO time or None)."""
        return {
            "state": self.state,
            "label": self.label,
            "sessions_left": self.sessions_left,
            "evict": self.evict,
            "reason": self.reason,
            "by": self.by,
            "since": self.since.isoformat() if self.since else None,
        }


def drain_state(node: Node, sessions_left: int) -> DrainState:
    """`node`'s DrainState, given how many of its sessions are active."""
    if node.drain_since is None:
        return DrainState(state=IN_SERVICE, sessions_left=sessions_left, evict=False, reason="", by="", since=None)
    return DrainState(
        state=DRAINING if sessions_left else DRAINED,
        sessions_left=sessions_left,
        evict=node.drain_evict,
        reason=node.drain_reason,
        by=node.drain_by,
        since=node.drain_since,
    )


def nodes_sessions_left(pks) -> dict:
    """{node pk: how many of its sessions are active} for the nodes `pks` (absent: none). One query."""
    rows = (
        Node.objects.filter(pk__in=list(pks))
        .annotate(left=Count("sessions", filter=Q(sessions__status__in=protocol.SESSION_ACTIVE_STATES)))
        .values_list("pk", "left")
    )
    return {pk: left for pk, left in rows if left}


def node_drain_state(node: Node) -> DrainState:
    """`node`'s DrainState, read now (one query)."""
    return drain_state(node, nodes_sessions_left([node.pk]).get(node.pk, 0))


def node_drain(*, node_name: str, evict: bool = False, reason: str = "", by: str = "") -> tuple[Node, DrainState]:
    """Drain `node_name` (`by`: the administrator's username; `reason`: free text, at most
    MAX_REASON_CHARS, shown with the state). Idempotent: draining a draining node keeps its
    `drain_since`; `evict` only ever turns eviction on (`kubectl drain` after `cordon`), and a
    non-empty `reason` replaces the last. Returns the node and its DrainState. Raises
    Node.DoesNotExist for an unknown node, ValueError for a reason over MAX_REASON_CHARS."""
    if len(reason) > MAX_REASON_CHARS:
        raise ValueError(f"reason: at most {MAX_REASON_CHARS} characters")
    with transaction.atomic():
        node = Node.objects.select_for_update().get(name=node_name)
        changes: dict[str, object] = {}
        if node.drain_since is None:
            changes.update(drain_since=timezone.now(), drain_evict=evict, drain_reason=reason, drain_by=by)
        else:
            if evict and not node.drain_evict:
                changes["drain_evict"] = True
            if reason and reason != node.drain_reason:
                changes["drain_reason"] = reason
        if changes:
            Node.objects.filter(pk=node.pk).update(**changes)
            for field, value in changes.items():
                setattr(node, field, value)
            log.warning("node %s drained by %s (evict: %s): %s", node.name, by or "?", node.drain_evict, node.drain_reason)
            transaction.on_commit(partial(node_drain_changed.send, sender=Node, node=node))
    return node, node_drain_state(node)


def node_undrain(*, node_name: str, by: str = "") -> tuple[Node, DrainState]:
    """Put `node_name` back in service (Kubernetes' uncordon, Slurm's RESUME): new sessions may be
    placed on it again; notices a drain's eviction gave and that have not run out are taken back
    by the next scheduler pass. Idempotent (a node in service: nothing changes). Returns the node
    and its DrainState. Raises Node.DoesNotExist for an unknown node."""
    with transaction.atomic():
        node = Node.objects.select_for_update().get(name=node_name)
        if node.drain_since is not None:
            Node.objects.filter(pk=node.pk).update(drain_since=None, drain_evict=False, drain_reason="", drain_by="")
            node.drain_since, node.drain_evict, node.drain_reason, node.drain_by = None, False, "", ""
            log.warning("node %s undrained by %s", node.name, by or "?")
            transaction.on_commit(partial(node_drain_changed.send, sender=Node, node=node))
    return node, node_drain_state(node)
