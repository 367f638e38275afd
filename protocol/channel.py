"""The channel layer between the web (and manager) and the agents, per node (issue 31, item 3: a
node can act only on its own sessions): the names of the groups and channels, which carry the
node so that a broker ACL can confine each agent to its own (common.broker_acl), and the
authentication of every message between the two sides.

Names (Channels allows [A-Za-z0-9_.-] and fewer than 100 characters in a group name):

| name | what | who reads, who writes |
|---|---|---|
| `pty.<tag>.<session id>` | a session's commands (`pty.*`) | its node's agent reads; the web writes |
| `term.<tag>.<session id>` | a session's terminal output (`terminal.output`, `.exit`) | terminals read; its agent writes |
| `node.<tag>` | questions about the node itself (`node.processes`) | its agent reads; the web writes |
| `agent.<tag>.<process>!<id>` | the agent's own channel (channels_redis key `asgiagent.<tag>.<process>!`) | its agent |
| `reply.<what>.<process>!<id>` | the web's reply channels (exec, files, apps, processes) | the web reads; agents write only |
| `specific.<process>!<id>` | the terminal consumers' channels (Channels' default) | the web reads; agents write only |

`<tag>` is `node_tag(node)`: the node's name where it is at most TAG_MAX letters, digits, `_` and
`-` (no `.`, so that no tag is the start of another followed by a dot: the ACL pattern
`pty.gpu.*` would otherwise match node `gpu.2`'s groups), else `_` and the first 40 hex digits of
its name's SHA-256 (a node name never starts with `_`: common.broker_acl, so the two never meet).

Authentication: a node with an agent key (`manage.py node_key NODE`, agent.toml `[manager]
node-key`) has every message to its agent *sealed* by the web or manager (`AgentLink.command`):
field AUTH `{"ts": epoch ms, "nonce": 16 hex digits, "sig": hex HMAC-SHA256}` over the canonical
JSON of `["to-agent", node, ts, nonce, the message's other fields]` (its `type` and `session_id`
among them; bytes by their SHA-256). The agent (`CommandGuard.open`) acts on it only when the
signature verifies under its key, the time is within MAX_AGE_S of its clock, and the nonce was
not seen in that time; else it drops and logs it. What the agent answers on a reply channel
(exec, files and app answers, the node's processes, the direct-stream offer) it seals the same
way as `"from-agent"` (`CommandGuard.answer`); the web uses an answer only when it verifies
(`AgentLink.answer`; no nonce store: each reply channel is new and read by one waiter). A node
without a key: nothing is sealed and unsealed messages are taken, unless the web requires keys
(FGPU_REQUIRE_NODE_KEYS: `AgentLink.required`), as for the agents' reports (protocol.sign).

Terminal output frames (`terminal.output`, `terminal.exit`) and the scrollback that answers an
attach are not sealed: a seal costs about as much as the rest of a keystroke's echo on the agent
(json and HMAC of up to 64 Ki characters a frame). They go to the session's `term.` group, whose
member list only its node's agent and the web may read or write (the ACL), so another node cannot
learn a terminal's channel (a random 128-bit name) to write to.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any

from protocol.terminal_stream import DIRECT_OFFER

AUTH = "auth"  # the field a sealed message carries its seal in
MAX_AGE_S = 60  # a sealed message older (or newer) than this by the receiver's clock is refused
TAG_MAX = 40  # a node name longer than this (or with a '.') is hashed into its tag
NONCES_MAX = 1_000_000  # the most nonces an agent remembers (about 8,000 commands a second for MAX_AGE_S * 2)
TO_AGENT, FROM_AGENT = "to-agent", "from-agent"
_PLAIN_TAG = re.compile(rf"[A-Za-z0-9_-]{{1,{TAG_MAX}}}")

NODE_PROCESSES = "node.processes"  # the web → the node's agent: {reply_channel}
NODE_PROCESSES_RESULT = "node.processes.result"  # the answer: {ok, at, source, processes, truncated}


class Refused(ValueError):
    """A message that is not acted on: unsigned where a key is required, a signature that does not
    verify, too old, replayed, or malformed. The text says which (it is logged, never answered)."""


def node_tag(node: str) -> str:
    """The part of the channel-layer names that says `node` (see the module's docstring): the name
    itself, or `_` + 40 hex digits of its SHA-256. Raises ValueError for an empty name."""
    if not node:
        raise ValueError("a node name is needed")
    if _PLAIN_TAG.fullmatch(node) and not node.startswith("_"):
        return node
    return "_" + hashlib.sha256(node.encode()).hexdigest()[:40]


def pty_group(node: str, session_id: object) -> str:
    """Where the web sends a session's commands; the session's agent (on `node`) joins it."""
    return f"pty.{node_tag(node)}.{session_id}"


def terminal_group(node: str, session_id: object) -> str:
    """Where the session's agent (on `node`) sends its terminal output; terminal consumers join it."""
    return f"term.{node_tag(node)}.{session_id}"


def node_group(node: str) -> str:
    """Where the web asks `node`'s agent about the node itself (`node.processes`); its agent joins it."""
    return f"node.{node_tag(node)}"


def agent_channel_prefix(node: str) -> str:
    """The prefix of `node`'s agent's own channel (`layer.new_channel(prefix)`)."""
    return f"agent.{node_tag(node)}"


def reply_prefix(what: str) -> str:
    """The prefix of a web reply channel for answers of kind `what` (`exec`, `files`, `app`, `processes`)."""
    return f"reply.{what}"


# --- seals --------------------------------------------------------------------------------------


def _bytes_digest(value: object) -> dict[str, str]:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"bytes-sha256": hashlib.sha256(value).hexdigest()}
    raise TypeError(f"{type(value).__name__} cannot be sealed")


def _mac(key: str, direction: str, node: str, ts: int, nonce: str, message: dict[str, Any]) -> str:
    body = {k: v for k, v in message.items() if k != AUTH}
    canonical = json.dumps(
        [direction, node, ts, nonce, body], sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_bytes_digest
    )
    return hmac.new(key.encode(), canonical.encode(), hashlib.sha256).hexdigest()


def seal(message: dict[str, Any], *, key: str, node: str, direction: str, now: float | None = None) -> dict[str, Any]:
    """`message` with its seal (field AUTH) under `key`, from the sender's side `direction`
    (TO_AGENT or FROM_AGENT) for `node`; `message` itself as it is when `key` is empty."""
    if not key:
        return message
    ts = int((time.time() if now is None else now) * 1000)
    nonce = secrets.token_hex(8)
    return {**message, AUTH: {"ts": ts, "nonce": nonce, "sig": _mac(key, direction, node, ts, nonce, message)}}


def unseal(
    message: dict[str, Any], *, key: str, node: str, direction: str, required: bool, now: float | None = None
) -> tuple[dict[str, Any], str]:
    """`message` without its seal, and the seal's nonce ("" when it had none), when its seal
    verifies under `key` for `node` and `direction` and its time is within MAX_AGE_S of `now`
    (epoch seconds; default the clock). Without `key`: a message without a seal, unless
    `required`. Raises Refused saying why."""
    auth = message.get(AUTH)
    body = {k: v for k, v in message.items() if k != AUTH}
    if not key:
        if required:
            raise Refused(f"node {node} has no agent key and keys are required")
        return body, ""
    if not isinstance(auth, dict):
        raise Refused("unsigned")
    ts, nonce, sig = auth.get("ts"), auth.get("nonce"), auth.get("sig")
    if not (isinstance(ts, int) and isinstance(nonce, str) and isinstance(sig, str) and 0 < len(nonce) <= 64):
        raise Refused("a malformed seal")
    if not hmac.compare_digest(_mac(key, direction, node, ts, nonce, body), sig):
        raise Refused("a signature that does not verify")
    age = (time.time() if now is None else now) - ts / 1000
    if abs(age) > MAX_AGE_S:
        raise Refused(f"sealed {age:.0f} s from now (more than {MAX_AGE_S} s: replayed, or the clocks differ)")
    return body, nonce


class CommandGuard:
    """The agent's side: opens the commands sent to it (verified, fresh, not replayed) and seals
    its answers. `node`: its node; `key`: its agent key ("" : nothing is verified or sealed)."""

    def __init__(self, *, node: str, key: str) -> None:
        self.node, self.key = node, key
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce → when it may be forgotten (epoch s)

    def open(self, message: dict[str, Any], *, now: float | None = None) -> dict[str, Any]:
        """`message` (a dict from the channel layer) without its seal, once verified and
        remembered. Raises Refused (unsigned while the agent has a key, bad signature, stale,
        replayed)."""
        now = time.time() if now is None else now
        body, nonce = unseal(message, key=self.key, node=self.node, direction=TO_AGENT, required=False, now=now)
        if nonce:
            while self._seen and (next(iter(self._seen.values())) < now or len(self._seen) >= NONCES_MAX):
                self._seen.popitem(last=False)
            if nonce in self._seen:
                raise Refused("replayed")
            self._seen[nonce] = now + 2 * MAX_AGE_S
        return body

    def answer(self, message: dict[str, Any]) -> dict[str, Any]:
        """`message`, an answer to the web, sealed with the agent's key (as it is without one)."""
        return seal(message, key=self.key, node=self.node, direction=FROM_AGENT)


@dataclass(frozen=True)
class AgentLink:
    """The web's or manager's side, for one node: its name, its agent key ("" : none) and whether
    answers must be sealed even without a key (FGPU_REQUIRE_NODE_KEYS)."""

    node: str
    key: str = ""
    required: bool = False

    def pty_group(self, session_id: object) -> str:
        return pty_group(self.node, session_id)

    def terminal_group(self, session_id: object) -> str:
        return terminal_group(self.node, session_id)

    def node_group(self) -> str:
        return node_group(self.node)

    def command(self, message: dict[str, Any]) -> dict[str, Any]:
        """`message` (a command to the node's agent, with its `type` and, for a session, its
        `session_id`) sealed with the node's key."""
        return seal(message, key=self.key, node=self.node, direction=TO_AGENT)

    def answer(self, message: dict[str, Any]) -> dict[str, Any]:
        """An answer of the node's agent without its seal, once verified. Raises Refused."""
        return unseal(message, key=self.key, node=self.node, direction=FROM_AGENT, required=self.required)[0]


# --- typed commands -----------------------------------------------------------------------------


class Malformed(Refused):
    """A command whose fields are missing or of the wrong type."""


def _field(
    message: dict[str, Any], name: str, kind: type | tuple[type, ...], *, optional: bool = False, default: Any = None
) -> Any:
    if name not in message or message[name] is None:
        if optional:
            return default
        raise Malformed(f"{message.get('type')!r} without {name!r}")
    value = message[name]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise Malformed(f"{name!r} of {message.get('type')!r} is not a whole number")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise Malformed(f"{name!r} of {message.get('type')!r} is not a number")
    if kind not in (int, float) and not isinstance(value, kind):
        raise Malformed(f"{name!r} of {message.get('type')!r} is not {getattr(kind, '__name__', kind)}")
    return value


@dataclass(frozen=True)
class Command:
    """A message to an agent: its `type` (TYPE), the session it is for ("" : the node itself)."""

    TYPE = ""
    session_id: str

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.TYPE, **{f.name: getattr(self, f.name) for f in fields(self)}}


@dataclass(frozen=True)
class PtyInput(Command):
    """Text typed at a terminal, written to the session's PTY."""

    TYPE = "pty.input"
    data: str

    @classmethod
    def from_dict(cls, m: dict[str, Any]) -> PtyInput:
        return cls(session_id=_field(m, "session_id", str), data=_field(m, "data", str))


@dataclass(frozen=True)
class PtyResize(Command):
    """A terminal's new size, in character cells (1 to 10,000 each)."""

    TYPE = "pty.resize"
    rows: int
    cols: int

    @classmethod
    def from_dict(cls, m: dict[str, Any]) -> PtyResize:
        rows, cols = _field(m, "rows", int), _field(m, "cols", int)
        if not (0 < rows <= 10_000 and 0 < cols <= 10_000):
            raise Malformed("a terminal size out of range")
        return cls(session_id=_field(m, "session_id", str), rows=rows, cols=cols)


@dataclass(frozen=True)
class PtyAttach(Command):
    """A terminal opened: its consumer's channel; `direct`: it can take a direct stream."""

    TYPE = "pty.attach"
    reply_channel: str
    direct: bool = False

    @classmethod
    def from_dict(cls, m: dict[str, Any]) -> PtyAttach:
        return cls(
            session_id=_field(m, "session_id", str),
            reply_channel=_field(m, "reply_channel", str),
            direct=bool(_field(m, "direct", bool, optional=True, default=False)),
        )


@dataclass(frozen=True)
class PtyAck(Command):
    """A terminal took the output up to character `offset` and frame `n`."""

    TYPE = "pty.ack"
    channel: str
    offset: int
    n: int

    @classmethod
    def from_dict(cls, m: dict[str, Any]) -> PtyAck:
        return cls(
            session_id=_field(m, "session_id", str),
            channel=_field(m, "channel", str),
            offset=_field(m, "offset", int),
            n=_field(m, "n", int),
        )


@dataclass(frozen=True)
class PtyDetach(Command):
    """A terminal closed."""

    TYPE = "pty.detach"
    channel: str

    @classmethod
    def from_dict(cls, m: dict[str, Any]) -> PtyDetach:
        return cls(session_id=_field(m, "session_id", str), channel=_field(m, "channel", str))


@dataclass(frozen=True)
class PtyStop(Command):
    """The manager's stop of the session (beside its SESSION_STOP task)."""

    TYPE = "pty.stop"

    @classmethod
    def from_dict(cls, m: dict[str, Any]) -> PtyStop:
        return cls(session_id=_field(m, "session_id", str))


@dataclass(frozen=True)
class PtyExec(Command):
    """A blocking exec: `argv` (a list of strings, or one shell command line), `timeout` (s)."""

    TYPE = "pty.exec"
    argv: list[str] | str
    timeout: float
    reply_channel: str

    @classmethod
    def from_dict(cls, m: dict[str, Any]) -> PtyExec:
        argv = _field(m, "argv", (list, str))
        if isinstance(argv, list) and not (argv and all(isinstance(a, str) for a in argv)):
            raise Malformed("an argv that is not a list of strings")
        return cls(
            session_id=_field(m, "session_id", str),
            argv=argv,
            timeout=_field(m, "timeout", float),
            reply_channel=_field(m, "reply_channel", str),
        )


@dataclass(frozen=True)
class PtyExecStream(Command):
    """A streamed exec (agent.exec_stream): `exec_id`, `argv`, `timeout` (s), `ttl` (s)."""

    TYPE = "pty.exec_stream"
    exec_id: str
    argv: list[str] | str
    timeout: float
    ttl: int

    @classmethod
    def from_dict(cls, m: dict[str, Any]) -> PtyExecStream:
        argv = PtyExec.from_dict({**m, "reply_channel": ""}).argv
        exec_id = _field(m, "exec_id", str)
        if not re.fullmatch(r"[0-9a-f-]{1,64}", exec_id):
            raise Malformed("an exec id that is not a UUID")
        return cls(
            session_id=_field(m, "session_id", str),
            exec_id=exec_id,
            argv=argv,
            timeout=_field(m, "timeout", float),
            ttl=_field(m, "ttl", int, optional=True, default=3600),
        )


@dataclass(frozen=True)
class NodeProcesses(Command):
    """The web asks the node's GPU processes; answered NODE_PROCESSES_RESULT on `reply_channel`."""

    TYPE = NODE_PROCESSES
    reply_channel: str

    @classmethod
    def from_dict(cls, m: dict[str, Any]) -> NodeProcesses:
        return cls(session_id="", reply_channel=_field(m, "reply_channel", str))


# Signals a session may ask for at a preemption notice (Slurm's `--signal`): those a program can
# catch and act on, by name. Not SIGKILL or SIGSTOP (no program can handle them: the grace would be lost).
PREEMPT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGCONT", "SIGWINCH", "SIGURG")
DEFAULT_PREEMPT_SIGNAL = "SIGTERM"
MAX_NOTICE_CHARS = 1000  # the longest preemption notice line


def preempt_signal_name(value: str) -> str:
    """A preemption signal's name as the agent takes it: `value` ("TERM", "sigusr1", "SIGUSR1")
    in upper case with the SIG prefix, one of PREEMPT_SIGNALS. Raises ValueError naming those."""
    name = value.strip().upper() if isinstance(value, str) else ""
    name = name if name.startswith("SIG") else f"SIG{name}"
    if name not in PREEMPT_SIGNALS:
        raise ValueError(
            f"{value!r} is not a signal a session may be sent at a preemption notice: one of {', '.join(PREEMPT_SIGNALS)}"
        )
    return name


@dataclass(frozen=True)
class PtyPreempt(Command):
    """The manager's preemption notice (sessions.scheduling.preemption): the agent writes `text` as a line of
    the session's output (its terminal and its log) and then sends `signal` (a name of
    PREEMPT_SIGNALS) to the session: the process runtime to its command's process group, the
    docker runtime to its container. `notice`: the notice's id (its stop time, ISO 8601): the
    manager re-sends the command on every pass while the notice stands, and the agent acts once
    per session and notice."""

    TYPE = "pty.preempt"
    signal: str
    text: str
    notice: str

    @classmethod
    def from_dict(cls, m: dict[str, Any]) -> PtyPreempt:
        try:
            name = preempt_signal_name(_field(m, "signal", str))
        except ValueError as exc:
            raise Malformed(str(exc)) from None
        text, notice = _field(m, "text", str), _field(m, "notice", str)
        if len(text) > MAX_NOTICE_CHARS or not (0 < len(notice) <= 64):
            raise Malformed("a preemption notice out of range")
        return cls(session_id=_field(m, "session_id", str), signal=name, text=text, notice=notice)


# --- typed answers -------------------------------------------------------------------------------


@dataclass(frozen=True)
class DirectOffer:
    """The agent's answer to an attach that asked for a direct stream (protocol.terminal_stream):
    where to connect (`host` "" : no direct stream; `port` 1-65535) and the one-time `token`."""

    TYPE = DIRECT_OFFER
    host: str
    port: int = 0
    token: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.TYPE, "host": self.host, "port": self.port, "token": self.token}

    @classmethod
    def from_dict(cls, m: dict[str, Any]) -> DirectOffer:
        host = _field(m, "host", str)
        if not host:
            return cls(host="")
        port, token = _field(m, "port", int), _field(m, "token", str)
        if not (0 < port < 65536 and 0 < len(host) <= 255 and 0 < len(token) <= 256):
            raise Malformed("a direct-stream offer out of range")
        return cls(host=host, port=port, token=token)


TYPED = {
    c.TYPE: c
    for c in (PtyInput, PtyResize, PtyAttach, PtyAck, PtyDetach, PtyStop, PtyPreempt, PtyExec, PtyExecStream, NodeProcesses)
}
# Commands whose content another module types (protocol.files; agent.session_apps): checked here
# for their session and reply channel only.
PASSED = frozenset({"pty.files", "pty.app_open", "pty.app_status"})


def command_from_dict(message: dict[str, Any]) -> Command | dict[str, Any]:
    """The typed command of `message` (an opened message to an agent), or, for a kind in PASSED,
    the message itself once its `session_id` and `reply_channel` are text. Raises Malformed for
    an unknown type or fields that are missing or of the wrong type."""
    kind = message.get("type")
    typed = TYPED.get(kind) if isinstance(kind, str) else None
    if typed is not None:
        return typed.from_dict(message)
    if kind in PASSED:
        _field(message, "session_id", str)
        _field(message, "reply_channel", str)
        return message
    raise Malformed(f"an unknown command {kind!r}")
