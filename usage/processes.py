"""The host's view of a node's GPUs (issue 16, item 5: the fGPU walkthrough's last step, the GPU
host's `nvidia-smi` showing each session's process on its slice): which process (pid, command)
of which session holds how much memory of which GPU, for the node admin page and `fgpu nodes
--processes` (`GET /api/v1/nodes/<name>/processes/`).

Asked for, not reported unasked: the web sends `node.processes` to the node's `node.<name>`
channel-layer group (only its agent joins it) and waits for the answer on a reply channel, as
a session's files are read (sessions.serving.files). The agent reads NVML's running processes on a real
node, the sessions' declared use on a mock one (agent.usage.UsageSampler.processes). Why on
request: the list is wanted only while someone looks at it, and it grows with the sessions and
their processes (hundreds of rows on a busy node); carried by every heartbeat (every few seconds,
from every node) it would cost the manager queue, the database and NVML that much all the time
for nobody, and its rows would be as old as the last heartbeat. Asked for, it costs one
channel-layer round trip per look, and nothing reaches the database but one read of the
sessions the answer names.
"""

from __future__ import annotations

import asyncio
import logging

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings

import protocol
from protocol.channel import AgentLink, Refused, reply_prefix
from accelerators.models import Node, NodeStatus
from common.errors import ApplicationError
from sessions.models import Allocation, ComputeSession

log = logging.getLogger(__name__)

REPLY_WAIT_S = 10  # how long the web waits for the agent (NVML answers in milliseconds; a busy node may lag)


async def _ask(link: AgentLink, wait_s: float) -> dict | None:
    """Ask `link`'s node (sealed with its key); its answer once verified, or None after `wait_s`."""
    layer = get_channel_layer()
    reply = await layer.new_channel(reply_prefix("processes"))
    await layer.group_send(link.node_group(), link.command({"type": protocol.NODE_PROCESSES, "reply_channel": reply}))
    try:
        async with asyncio.timeout(wait_s):
            while True:
                message = await layer.receive(reply)
                try:
                    message = link.answer(message)
                except Refused as exc:
                    log.warning("ignored an answer claiming to come from node %s: %s", link.node, exc)
                    continue
                if message.get("type") == protocol.NODE_PROCESSES_RESULT:
                    return message
    except TimeoutError:
        return None


def node_processes_check(*, node: Node) -> Node:
    """`node` if its agent can be asked; ApplicationError 409 "node-not-alive" otherwise (its
    agent is not heartbeating: nobody to ask)."""
    if node.status != NodeStatus.ALIVE:
        raise ApplicationError(
            f"node {node.name} is {node.status}: its agent is not there to ask",
            type="node-not-alive",
            title="Node not alive",
            status=409,
        )
    return node


async def node_processes_wait(node: Node, *, wait_s: float = REPLY_WAIT_S) -> dict:
    """What holds memory on `node`'s GPUs now, as its agent sees it: `{"node", "source": "nvml"
    (NVML's running processes) | "declared" (a mock node: each session's declared use, else its
    granted slice), "at": epoch seconds, "truncated": bool (more than protocol.MAX_NODE_PROCESSES
    rows), "processes": [{"device": UUID, "index": the device's index on the node, "model_name",
    "pid": host pid, "command", "memory": bytes or None (NVML could not tell), "kind": "compute" |
    "graphics" | "declared", "session": {"id", "name", "owner", "status", "granted_memory": bytes of
    that device the session holds} or None (a process of no session)}]}`.
    Raises ApplicationError 409 "node-not-alive" (its agent is not heartbeating: nobody to ask),
    504 "node-timeout" (the agent did not answer within `wait_s` seconds), 502 "node-processes-failed"
    (the agent could not read them; its words in `detail`). Awaited on the event loop (the API
    view: common.api_async), so no web thread nor database connection waits for the agent; the
    sessions the answer names are read after it came."""
    answer = await _ask(AgentLink(node=node.name, key=node.agent_key or "", required=settings.FGPU_REQUIRE_NODE_KEYS), wait_s)
    if answer is None:
        raise ApplicationError(
            f"the agent on {node.name} did not answer within {wait_s:.0f} s; is the node up?",
            type="node-timeout",
            title="Agent did not answer",
            status=504,
        )
    if not answer.get("ok"):
        raise ApplicationError(
            str(answer.get("detail") or "the agent could not list the GPU processes"),
            type="node-processes-failed",
            title="GPU processes unreadable",
            status=502,
        )
    return await sync_to_async(_shown)(node, answer)


def _shown(node: Node, answer: dict) -> dict:
    """The agent's `answer` with the sessions and devices it names read (three queries)."""
    rows = [row for row in answer.get("processes") or [] if isinstance(row, dict)]
    devices = {d.device_id: d for d in node.devices.all()}
    ids = {str(row["session_id"]) for row in rows if row.get("session_id")}
    sessions = {str(s.pk): s for s in ComputeSession.objects.filter(pk__in=ids).select_related("owner")}
    granted = {
        (str(a.session_id), a.device.device_id): a.memory
        for a in Allocation.objects.filter(session__pk__in=list(sessions), device__node=node, released_at=None).select_related(
            "device"
        )
    }
    out = []
    for row in rows:
        device = devices.get(str(row.get("device") or ""))
        session = sessions.get(str(row.get("session_id") or ""))
        out.append(
            {
                "device": str(row.get("device") or ""),
                "index": device.index if device else row.get("index"),
                "model_name": device.model_name if device else "",
                "pid": int(row.get("pid") or 0),
                "command": str(row.get("command") or ""),
                "memory": row.get("memory"),
                "kind": str(row.get("kind") or ""),
                "session": None
                if session is None
                else {
                    "id": str(session.pk),
                    "name": session.name,
                    "owner": session.owner.username,
                    "status": session.status,
                    "granted_memory": granted.get((str(session.pk), str(row.get("device") or ""))),
                },
            }
        )
    return {
        "node": node.name,
        "source": answer.get("source", ""),
        "at": answer.get("at"),
        "truncated": bool(answer.get("truncated")),
        "processes": out,
    }
