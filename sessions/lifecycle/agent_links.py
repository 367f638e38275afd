"""How the web and the manager reach a node's agent over the channel layer (issue 31, item 3):
`AgentLink`s (protocol.channel) built from the database, which name the node's groups, seal every
command with its agent key and verify every answer. Reads only `accelerators.Node`."""

from __future__ import annotations

from django.conf import settings

from accelerators.models import Node
from protocol.channel import AgentLink


def agent_link(node: Node) -> AgentLink:
    """How the web talks to `node`'s agent: the channel layer's names of that node and its agent
    key, which seals every command and verifies every answer (FGPU_REQUIRE_NODE_KEYS: answers of
    a node without a key are refused)."""
    return AgentLink(node=node.name, key=node.agent_key or "", required=settings.FGPU_REQUIRE_NODE_KEYS)


def agent_link_named(node_name: str) -> AgentLink:
    """`agent_link` of the node named `node_name` (one query for its key; none where unknown)."""
    key = Node.objects.filter(name=node_name).values_list("agent_key", flat=True).first() or ""
    return AgentLink(node=node_name, key=key, required=settings.FGPU_REQUIRE_NODE_KEYS)


def agent_link_of_session(session_id) -> AgentLink | None:
    """`agent_link` of the node session `session_id` is placed on (one query); None when it is on
    none (or there is no such session)."""
    node = Node.objects.filter(sessions__pk=session_id).only("name", "agent_key").first()
    return None if node is None else agent_link(node)
