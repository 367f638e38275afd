"""What the manager side and the agents share: queue names, task names, group names and the
shapes of the messages between them. The only module both sides import (DESIGN.md, "Layout");
it imports nothing of either.

Queues (Celery, on the broker): `manager` takes the agents' control messages (registration,
session reports, MIG reports); `manager.heartbeats` their heartbeats, so that a node never looks
lost while launches and reports queue up (hundreds at once on a busy cluster); `manager.logs`
their log batches, so that a flooding session never queues ahead of either; `manager.usage` their
usage samples (issue 15: noisy, batched, never ahead of anything else); `agent.<node>` one
node's starts, stops, syncs and MIG layouts. A manager worker takes from its queues in turn.

Task names and their keyword arguments (typed, with one encoder and one decoder each, where
protocol.messages says: the start spec with its MIG block, the heartbeat, the session report and
the log batch):

| task | queue | kwargs |
|---|---|---|
| `fgpu.manager.agent_register` | manager | node, inventory, running (session ids), images, image_service_ports |
| `fgpu.manager.agent_heartbeat` | manager.heartbeats | node, running, mig_digest, state (protocol.messages.AgentState: |
| | | {sessions, ended, at}), images, image_service_ports |
| `fgpu.manager.session_report` | manager | session_id, status, reason, exit_code |
| `fgpu.manager.session_log_append` | manager.logs | session_id, seq, offset, text, final |
| `fgpu.manager.mig_report` | manager | node, report |
| `fgpu.manager.usage_report` | manager.usage | node, batch (protocol.messages.UsageBatch: {interval, devices, sessions}) |
| `fgpu.agent.session_start` | agent.<node> | node, spec (the scheduler's start spec: protocol.messages.StartSpec) |
| `fgpu.agent.session_stop` | agent.<node> | node, session_id |
| `fgpu.agent.sessions_sync` | agent.<node> | node, keep (session ids) |
| `fgpu.agent.mig_reconcile` | agent.<node> | node, gpus, expected, destroy, kind, seq |
| `fgpu.agent.session_notice` | agent.<node> | node, session_id, text (a line shown in its terminal) |

`images` (register and heartbeat): the session images the node holds, `{reference: image id}`:
for the docker runtime every tag and repository digest of its local images (`"fgpu-session:test":
"sha256:…"`), for the process runtime `{"host": "host"}`. An agent from before images sends no
`images` kwarg (and signs none); the manager then takes it to hold what the process runtime
implies (HOST_IMAGES). `image_service_ports` (register and heartbeat, sent only when not empty): `{image
id: its "ai.backend.service-ports" label}` for the held images whose inspect carries Backend.AI's
label (sessions.service_ports turns it into the image record's apps). A registered reference
matches a reported one as it is or in `image_key` form (the form in which Docker lists its tags).

Channel-layer groups (names per node, and every command sealed with the node's key:
protocol.channel): `pty.<node>.<session id>` (the session's agent joins it; terminal consumers and
the web send `pty.input` {data}, `pty.resize` {rows, cols}, `pty.attach` {reply_channel, direct} (direct: the
consumer can take a direct stream: protocol.terminal_stream),
`pty.ack` {channel, offset, n}, `pty.detach` {channel}, `pty.exec` and `pty.exec_stream`, and
the session apps' `pty.app_open` {app, base_url, token, timeout, reply_channel} and `pty.app_status`
{name, port, reply_channel}, answered on the reply channel: agent.session_apps, and a session's files'
`pty.files` {op, owner_id, path, …, reply_channel}: protocol.files, agent.files, and the
manager's `pty.stop` {}: the stop of SESSION_STOP sent beside its task, which arrives in a
millisecond while the agent listens; the task, kept in the agent's queue, is the one that
cannot be lost, and whichever arrives second finds the session stopping or ended;
and the manager's `pty.preempt` {signal, text, notice}: a preemption notice, written as a line of
the session's output (terminal and log) and then its signal sent (protocol.channel.PtyPreempt;
re-sent every scheduler pass while the notice stands, acted on once per notice),
`node.<node>` (the node's agent joins it; the web sends `node.processes` {reply_channel},
answered `node.processes.result` {ok, at, source, processes}: agent.usage.UsageSampler.processes),
`term.<node>.<session id>` (terminal consumers join it; the agent sends `terminal.output` {data,
offset, n} and `terminal.exit` {code}; the output unless every terminal that attached reads a
direct stream). Flow control (agent.terminal_pipe, READER_WINDOW_CHARS): `offset` counts the characters
sent up to the end of the frame and `n` the frames; a consumer that attached acknowledges what its
websocket took with `pty.ack`, and `pty.detach` when it closes. The scrollback that answers
`pty.attach` carries neither.
"""

from __future__ import annotations

from typing import Any

MANAGER_QUEUE = "manager"
LOG_QUEUE = "manager.logs"
HEARTBEAT_QUEUE = "manager.heartbeats"
USAGE_QUEUE = "manager.usage"
MANAGER_QUEUES = (MANAGER_QUEUE, HEARTBEAT_QUEUE, LOG_QUEUE, USAGE_QUEUE)  # what a manager worker consumes

AGENT_REGISTER = "fgpu.manager.agent_register"
AGENT_HEARTBEAT = "fgpu.manager.agent_heartbeat"
SESSION_REPORT = "fgpu.manager.session_report"
SESSION_LOG_APPEND = "fgpu.manager.session_log_append"
MIG_REPORT = "fgpu.manager.mig_report"
USAGE_REPORT = "fgpu.manager.usage_report"
SESSION_START = "fgpu.agent.session_start"
SESSION_STOP = "fgpu.agent.session_stop"
SESSIONS_SYNC = "fgpu.agent.sessions_sync"
MIG_RECONCILE = "fgpu.agent.mig_reconcile"
SESSION_NOTICE = "fgpu.agent.session_notice"

NOISY_TASKS = frozenset({SESSION_LOG_APPEND})  # travel on LOG_QUEUE

# Session states (DESIGN.md, "Launch, step by step"), as `session_report` carries them and the
# manager keeps them (sessions.models.SessionStatus): those whose session holds its allocations
# and its node's CPU and memory, and those on their way to RUNNING.
SESSION_ACTIVE_STATES = ("SCHEDULED", "PREPARING", "RUNNING", "TERMINATING")
SESSION_STARTING_STATES = ("SCHEDULED", "PREPARING")


def manager_queue(task: str) -> str:
    """The queue of manager task `task` (a `fgpu.manager.*` name)."""
    if task in NOISY_TASKS:
        return LOG_QUEUE
    if task == USAGE_REPORT:
        return USAGE_QUEUE
    return HEARTBEAT_QUEUE if task == AGENT_HEARTBEAT else MANAGER_QUEUE


HOST_IMAGE = "host"  # the process runtime's one built-in image: the node's own system
HOST_IMAGES = {HOST_IMAGE: HOST_IMAGE}  # what a process-runtime node holds (and an agent that reports no images)
MAX_IMAGES = 1000  # the most image references one node reports (its heartbeat stays small)
MAX_IMAGE_REFERENCE = 255  # characters
SERVICE_PORTS_LABEL = "ai.backend.service-ports"  # Backend.AI's image label naming its apps (sessions.service_ports)


def image_key(reference: str) -> str:
    """A container image reference in the form Docker lists local images in, so that an
    administrator's reference and a docker node's report compare equal: Docker Hub's implicit
    `docker.io/` and `library/` dropped, `:latest` added to a name without tag or digest, and a
    tag before a digest dropped (the digest names the image). `"docker.io/library/ubuntu"` →
    `"ubuntu:latest"`; `"nvcr.io/nvidia/pytorch:24.05-py3"` unchanged."""
    ref = reference.strip()
    for prefix in ("index.docker.io/", "docker.io/"):
        if ref.startswith(prefix):
            ref = ref[len(prefix) :]
            break
    if ref.startswith("library/"):
        ref = ref[len("library/") :]
    name, at, digest = ref.partition("@")
    head, slash, last = name.rpartition("/")
    if at:
        return f"{head}{slash}{last.split(':', 1)[0]}@{digest}"
    return name if ":" in last else f"{name}:latest"


def agent_queue(node: str) -> str:
    return f"agent.{node}"


# The channel layer's names carry the node (`pty.<node>.<session>`, `term.<node>.<session>`,
# `node.<node>`), so that a broker ACL confines each agent to its own: protocol.channel.
from protocol.channel import (  # noqa: E402 (re-exported: the explicit `x as x` form)
    NODE_PROCESSES as NODE_PROCESSES,
    NODE_PROCESSES_RESULT as NODE_PROCESSES_RESULT,
    node_group as node_group,
    pty_group as pty_group,
    terminal_group as terminal_group,
)

MAX_NODE_PROCESSES = 2000  # the most GPU processes one answer lists (the channel layer's messages stay small)


# --- message authentication --------------------------------------------------------------------
# An agent with a node key (agent.toml `[manager] node-key`, made by `manage.py node_key NODE`)
# signs every task it sends the manager: kwarg SIGNATURE is the HMAC-SHA256, under that key, of
# the task name and its other kwargs as canonical JSON. The manager applies a message for a node
# that has a key only when the signature verifies, and a session's report or log batch only from
# the node the session runs on; so credentials to the broker alone cannot forge a report.

SIGNATURE = "signature"


def _canonical(task: str, kwargs: dict[str, Any]) -> bytes:
    import json

    body = {k: v for k, v in kwargs.items() if k != SIGNATURE}
    return task.encode() + b"\n" + json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()


def sign(key: str, task: str, kwargs: dict[str, Any]) -> str:
    """The signature of `task` with `kwargs` under `key` (hex HMAC-SHA256)."""
    import hashlib
    import hmac

    return hmac.new(key.encode(), _canonical(task, kwargs), hashlib.sha256).hexdigest()


def verify(key: str, task: str, kwargs: dict[str, Any], signature: str | None) -> bool:
    """Whether `signature` is `task` with `kwargs` signed under `key` (constant time)."""
    import hmac

    return bool(signature) and hmac.compare_digest(sign(key, task, kwargs), str(signature))
