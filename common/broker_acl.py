"""Redis ACL users for the broker, one per role (issue 13): the web processes, the manager (worker
and beat) and each node's agent. No one reaches the broker without a password (the `default`
user is switched off), and an agent's user reaches only what its node needs:

| role | keys | why |
|---|---|---|
| web, manager | all (`~* &*`), every command but `@admin` and `@dangerous` | they publish to every queue and serve every terminal |
| agent of node N | its own queue `agent.N` and its unacknowledged-message keys `unacked.agent.N`, `…_index`, `…_mutex` | it takes its starts and stops; no other node's |
| | `manager`, `manager.heartbeats`, `manager.logs`: write only (`%W~`) | it posts reports, heartbeats and log batches, and reads none of them |
| | `_kombu.binding.Q` and `_kombu.binding_permanent.Q` for Q in those three queues | kombu's routing table for them |
| | the channel layer's keys of its node only (T = protocol.channel.node_tag(N)): its sessions' command and output groups `asgi:group:pty.T.*`, `asgi:group:term.T.*`, its node group `asgi:group:node.T`, its own channel `asgiagent.T.*` | terminals, execs, files and apps of its sessions |
| | the web's channels, write only: `%W~asgispecific.*` (terminal consumers), `%W~asgireply.*` (reply channels) | its answers and terminal frames; it reads none of them |
| | `fgpu:exec:T:*` (its sessions' streamed exec output: protocol.exec_store.record_id) | |

Commands: what kombu, the channel layer (common.layers) and the exec store run, and no command
that lists keys (SCAN, KEYS, RANDOMKEY, DBSIZE), so an agent cannot learn the names of other
nodes' keys (its key patterns do not give it their contents either). The web's channel names are
random (128 bits); an agent learns only those that attach to its own sessions.

The agent's Celery connection keeps its unacknowledged messages under `unacked.agent.N`
(`agent_transport_options`), not in the shared `unacked` hash, and runs without remote control
(no pidbox fanout); priority sub-queues are not used (`priority_steps` [0], in settings), so
each queue is one key. Every command to an agent is sealed with its node's key and every answer
it sends verified by the web (protocol.channel); its reports are signed (protocol.sign). A
session never holds any of these credentials: the docker runtime gives it neither the agent's
environment nor its configuration.

Source of the key names: kombu's Redis transport (queues are lists named as the queue;
`_kombu.binding.<exchange>` sets; `unacked`, `unacked_index`, `unacked_mutex` keys, renamable by
transport options) and channels_redis (prefix `asgi`).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from urllib.parse import quote, urlsplit, urlunsplit

import protocol
from protocol.channel import node_tag

WEB, MANAGER = "fgpu-web", "fgpu-manager"
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
SERVICE_RULES = "~* &* +@all -@admin -@dangerous"
# What an agent's connections run: kombu (lists, sets, sorted sets and hashes, MULTI/EXEC, Lua for
# its unacked bookkeeping), channels_redis (sorted sets, Lua) and the exec store (hashes, lists, Lua);
# nothing that lists the keyspace (@read holds SCAN, KEYS and RANDOMKEY; @keyspace DBSIZE).
AGENT_COMMANDS = (
    "-@all +@connection +@read +@write +@list +@set +@sortedset +@hash +@string "
    "+@scripting +@transaction -@admin -@dangerous -scan -keys -randomkey -dbsize"
)


def agent_user(node: str) -> str:
    """The ACL user name of `node`'s agent. Raises ValueError for a name a queue cannot carry."""
    if not _NODE.match(node):
        raise ValueError(f"{node!r}: a node name is letters, digits, '.', '_' and '-' (at most 128)")
    return f"fgpu-agent-{node}"


def agent_transport_options(node: str) -> dict:
    """kombu transport options of `node`'s agent: its unacknowledged messages under keys of its
    own (kombu's `unacked_key`, `unacked_index_key`, `unacked_mutex_key`)."""
    base = f"unacked.{protocol.agent_queue(node)}"
    return {"unacked_key": base, "unacked_index_key": f"{base}_index", "unacked_mutex_key": f"{base}_mutex"}


def agent_rules(node: str) -> str:
    """The ACL rules of `node`'s agent (see the module's table)."""
    queue, tag = protocol.agent_queue(node), node_tag(node)
    # Its unacknowledged-message keys by name (a pattern `unacked.agent.N*` would reach node N0's too).
    unacked = agent_transport_options(node).values()
    keys = [f"~{queue}", *(f"~{key}" for key in unacked), *(f"%W~{q}" for q in protocol.MANAGER_QUEUES)]
    keys += [f"~asgi:group:pty.{tag}.*", f"~asgi:group:term.{tag}.*", f"~asgi:group:node.{tag}", f"~asgiagent.{tag}.*"]
    keys += ["%W~asgispecific.*", "%W~asgireply.*", f"~fgpu:exec:{tag}:*"]
    for routed in (queue, *protocol.MANAGER_QUEUES):  # kombu's routing table of each
        keys += [f"~_kombu.binding.{routed}", f"~_kombu.binding_permanent.{routed}"]
    return f"resetkeys resetchannels {' '.join(keys)} {AGENT_COMMANDS}"


@dataclass(frozen=True)
class BrokerUser:
    name: str
    password: str
    rules: str

    def acl_line(self) -> str:
        """The user's line of a Redis ACL file; the password stored as its SHA-256 (`#<hex>`)."""
        digest = hashlib.sha256(self.password.encode()).hexdigest()
        return f"user {self.name} on #{digest} {self.rules}"

    def url(self, broker_url: str) -> str:
        """`broker_url` (redis://host:port/db) with this user's name and password in it."""
        parts = urlsplit(broker_url)
        host = parts.hostname or "127.0.0.1"
        netloc = f"{quote(self.name, safe='')}:{quote(self.password, safe='')}@{host}"
        if parts.port:
            netloc += f":{parts.port}"
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def broker_users(nodes: list[str], *, passwords: dict[str, str] | None = None) -> list[BrokerUser]:
    """The web's, the manager's and one agent user per node of `nodes`, with `passwords`
    ({user name: password}) where given, else new random ones (32 bytes, URL-safe). Raises
    ValueError for a node name no queue can carry, or a node named twice."""
    if len(set(nodes)) != len(nodes):
        raise ValueError("a node is named twice")
    passwords = passwords or {}
    users = [(WEB, SERVICE_RULES), (MANAGER, SERVICE_RULES)] + [(agent_user(n), agent_rules(n)) for n in nodes]
    return [BrokerUser(name, passwords.get(name) or secrets.token_urlsafe(32), rules) for name, rules in users]


def acl_file(users: list[BrokerUser]) -> str:
    """A Redis ACL file (`aclfile` in redis.conf): the default user off, then `users`."""
    return "user default off\n" + "".join(u.acl_line() + "\n" for u in users)
