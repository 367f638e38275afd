"""The typed messages between the manager and its agents (issue 34, item 1): the start spec (with
its MIG block), a session's stop, the sessions to keep and a notice (manager → agent); the
registration with its inventory, the heartbeat with its state (the agent's view of its
sessions), the session report, the log batch and the usage batch (agent → manager); each a frozen
dataclass with a `version`, one encoder (`encode`: the message as it travels, JSON-safe) and one
decoder (`decode`: raises Malformed, saying which field, for anything else; the parts of a
heartbeat's state and of a usage batch are read one by one, a malformed one left out and counted).
Both sides use them: the manager builds its messages (sessions.lifecycle.start_spec,
sessions.lifecycle.services and reconcile, sessions.tasks) and decodes what agents send
(sessions.tasks); the agent decodes the manager's in its Celery tasks (agent.tasks: a malformed
one is logged and dropped) and builds the others (agent.manager_link.CeleryManager). The MIG
messages are in protocol.mig_messages.

The wire is the one of the untyped dicts these replaced, so that an agent and a manager of adjacent
versions interoperate: `encode` writes the same keys (a `version` only when it is not 1, which
every message is today: a manager's Celery task of an earlier version takes no such keyword), and
`decode` takes what an earlier version sent (a start spec without `image`, `shell`, `projects`,
`owner_id` or `owner_is_staff`; a report or log batch without `node`; a heartbeat without
`images`, `state` or its `ended`). Versions only add fields: a decoder reads the fields it knows of a later version's
message and leaves the others; a change that is not an addition takes a new task name.

Ids that cross the wire have their own types (NewType), so that they are not mixed up:
`HardwareId` is a device's id as its plugin reports it (accelerators.models.Device.device_id, a
GPU or MIG UUID); `RowId` a database row's primary key as text (a Device's, a GpuInstance's: the
allocator's `DeviceGrant.device_id` is one of these, not a hardware id); `SessionId` a session's
UUID as text; `UserId` a user's integer primary key; `NodeName` a node's name. The start spec's
device entries carry the hardware id, named `hardware_id` here and `device_id` on the wire (the
name the agent's inventory gives it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, NewType, TypeVar

from protocol.channel import Malformed

HardwareId = NewType("HardwareId", str)
RowId = NewType("RowId", str)
SessionId = NewType("SessionId", str)
UserId = NewType("UserId", int)
NodeName = NewType("NodeName", str)
T = TypeVar("T")

VERSION = 1  # the version this side writes
VERSION_KEY = "version"

__all__ = [
    "AGENT_SESSION_STATES",
    "VERSION",
    "AgentState",
    "DeviceUsage",
    "FolderUsage",
    "HardwareId",
    "Heartbeat",
    "Inventory",
    "LogBatch",
    "Malformed",
    "MigBlock",
    "MigGpu",
    "MigPlacement",
    "NodeName",
    "NodeStorage",
    "ProjectRef",
    "Registration",
    "RowId",
    "SessionId",
    "SessionNotice",
    "SessionEnd",
    "SessionReport",
    "SessionState",
    "SessionStop",
    "SessionUsage",
    "SessionsSync",
    "SharedFolderRef",
    "StartDevice",
    "StartSpec",
    "UsageBatch",
    "UserId",
]

# --- field readers: each raises Malformed naming the message and the field -----------------------


def _get(m: dict[str, Any], what: str, name: str, kind: type, default: Any = ..., *, nullable: bool = False) -> Any:
    if name not in m or (m[name] is None and not nullable):
        if default is ...:
            raise Malformed(f"a {what} without {name!r}")
        return default
    value = m[name]
    if value is None:
        return value
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise Malformed(f"{name!r} of a {what} is not a whole number")
    if not isinstance(value, kind):
        raise Malformed(f"{name!r} of a {what} is not {kind.__name__}")
    return value


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Malformed(f"a {what} that is not an object")
    return value


def _version(m: dict[str, Any], what: str) -> int:
    version = _get(m, what, VERSION_KEY, int, 1)
    if version < 1:
        raise Malformed(f"a {what} of version {version}")
    return int(version)


def _versioned(version: int, body: dict[str, Any]) -> dict[str, Any]:
    return body if version == 1 else {**body, VERSION_KEY: version}


def _count(m: dict[str, Any], what: str, name: str, default: Any = ...) -> Any:
    value = _get(m, what, name, int, default)
    if value is not None and value < 0:
        raise Malformed(f"{name!r} of a {what} is negative")
    return value


def _amount(m: dict[str, Any], what: str, name: str) -> str:
    text = _get(m, what, name, str)
    try:
        ok = Decimal(text).is_finite() and Decimal(text) >= 0
    except InvalidOperation:
        ok = False
    if not ok:
        raise Malformed(f"{name!r} of a {what} is not a decimal amount: {text[:40]!r}")
    return str(text)


def _node(m: dict[str, Any], what: str) -> NodeName | None:
    """The optional `node` of an agent's report or log batch (None from an agent before node keys)."""
    node = _get(m, what, "node", str, None)
    return NodeName(node) if node is not None else None


def _fields_encoded(message: SessionReport | LogBatch) -> dict[str, Any]:
    """The keyword arguments of a message whose fields are named as its wire keys, in order."""
    return _versioned(message.version, {f.name: getattr(message, f.name) for f in fields(message) if f.name != VERSION_KEY})


def _user_id(value: int | None) -> UserId | None:
    return UserId(value) if value is not None else None


def _strings(m: dict[str, Any], what: str, name: str, default: Any = ...) -> Any:
    value = _get(m, what, name, list, default)
    if value is not None and not all(isinstance(v, str) for v in value):
        raise Malformed(f"{name!r} of a {what} is not a list of strings")
    return value


# --- the start spec ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class MigPlacement:
    """A GPU instance's place on its GPU: its MIG `profile` ("1g.10gb") and its first memory
    slice `start` (0-7), as NVML names them."""

    profile: str
    start: int

    def encode(self) -> dict[str, Any]:
        return {"profile": self.profile, "start": self.start}

    @classmethod
    def decode(cls, value: Any) -> MigPlacement:
        m = _mapping(value, "MIG placement")
        return cls(profile=_get(m, "MIG placement", "profile", str), start=_count(m, "MIG placement", "start"))


@dataclass(frozen=True)
class MigGpu:
    """A MIG-capable GPU of the node: `gpu` its hardware id, `index` on the node, `model_name`,
    `memory_size` (bytes) and `subproc_count` (SMs): what the agent reads its MIG profiles with
    (agent.mig.MigManager.catalog). A MIG reconcile's `gpus` entries (protocol.mig_messages), and
    the first fields of a start spec's MIG block."""

    gpu: HardwareId
    index: int = 0
    model_name: str = ""
    memory_size: int = 0
    subproc_count: int = 0

    def encode(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "index": self.index,
            "model_name": self.model_name,
            "memory_size": self.memory_size,
            "subproc_count": self.subproc_count,
        }

    @classmethod
    def decode(cls, value: Any) -> MigGpu:
        return cls.read(_mapping(value, "MIG GPU"), "MIG GPU")

    @classmethod
    def read(cls, m: dict[str, Any], what: str) -> MigGpu:
        """The GPU's fields of mapping `m`, a `what` ("MIG GPU", "MIG block"). Raises Malformed."""
        return cls(
            gpu=HardwareId(_get(m, what, "gpu", str)),
            index=_count(m, what, "index", 0),
            model_name=_get(m, what, "model_name", str, ""),
            memory_size=_count(m, what, "memory_size", 0),
            subproc_count=_count(m, what, "subproc_count", 0),
        )


@dataclass(frozen=True)
class MigBlock:
    """The start spec's `mig` block (agent.mig.prepare_spec carries it out): the GPU instance the
    session gets on GPU `gpu` (its hardware id; `index`, `model_name`, `memory_size` in bytes and
    `subproc_count` in SMs describe the whole GPU): of MIG profile `profile` at slice `start`,
    reused (`reuse`) or created, whose row is `instance_id`; the idle instances to `destroy`
    first, and the GPU's whole expected `layout` once done (for the agent to re-apply after a
    reboot)."""

    gpu: HardwareId
    index: int
    model_name: str
    memory_size: int
    subproc_count: int
    profile: str
    start: int
    reuse: bool
    instance_id: RowId
    destroy: tuple[MigPlacement, ...] = ()
    layout: tuple[MigPlacement, ...] = ()

    @property
    def mig_gpu(self) -> MigGpu:
        """The block's GPU as the reconcile steps name MIG GPUs."""
        return MigGpu(
            gpu=self.gpu,
            index=self.index,
            model_name=self.model_name,
            memory_size=self.memory_size,
            subproc_count=self.subproc_count,
        )

    def encode(self) -> dict[str, Any]:
        return {
            **self.mig_gpu.encode(),
            "profile": self.profile,
            "start": self.start,
            "reuse": self.reuse,
            "instance_id": self.instance_id,
            "destroy": [p.encode() for p in self.destroy],
            "layout": [p.encode() for p in self.layout],
        }

    @classmethod
    def decode(cls, value: Any) -> MigBlock:
        w, m = "MIG block", _mapping(value, "MIG block")
        gpu = MigGpu.read(m, w)
        return cls(
            gpu=gpu.gpu,
            index=gpu.index,
            model_name=gpu.model_name,
            memory_size=gpu.memory_size,
            subproc_count=gpu.subproc_count,
            profile=_get(m, w, "profile", str),
            start=_count(m, w, "start"),
            reuse=_get(m, w, "reuse", bool, False),
            instance_id=RowId(_get(m, w, "instance_id", str, "")),
            destroy=tuple(MigPlacement.decode(p) for p in _get(m, w, "destroy", list, [])),
            layout=tuple(MigPlacement.decode(p) for p in _get(m, w, "layout", list, [])),
        )


@dataclass(frozen=True)
class StartDevice:
    """One device a session is given: `hardware_id` (the wire's `device_id`: the plugin's id of
    the GPU or MIG device, never a database row id), its `index` on the node, `model_name`,
    `memory_total` (bytes) and `subproc_count` (SMs); the session's share of it: `memory_limit`
    (bytes), `procs` (SMs) and `shares` (fGPU), both decimal text."""

    hardware_id: HardwareId
    index: int
    model_name: str
    memory_total: int
    subproc_count: int
    memory_limit: int
    procs: str
    shares: str
    is_mig_device: bool = False
    mig_profile: str = ""

    def encode(self) -> dict[str, Any]:
        return {
            "device_id": self.hardware_id,
            "index": self.index,
            "model_name": self.model_name,
            "memory_total": self.memory_total,
            "subproc_count": self.subproc_count,
            "memory_limit": self.memory_limit,
            "procs": self.procs,
            "shares": self.shares,
            "is_mig_device": self.is_mig_device,
            "mig_profile": self.mig_profile,
        }

    @classmethod
    def decode(cls, value: Any) -> StartDevice:
        w, m = "start spec's device", _mapping(value, "start spec's device")
        return cls(
            hardware_id=HardwareId(_get(m, w, "device_id", str)),
            index=_count(m, w, "index"),
            model_name=_get(m, w, "model_name", str, ""),
            memory_total=_count(m, w, "memory_total"),
            subproc_count=_count(m, w, "subproc_count"),
            memory_limit=_count(m, w, "memory_limit"),
            procs=_amount(m, w, "procs"),
            shares=_amount(m, w, "shares"),
            is_mig_device=_get(m, w, "is_mig_device", bool, False),
            mig_profile=_get(m, w, "mig_profile", str, ""),
        )


@dataclass(frozen=True)
class ProjectRef:
    """A project the session's owner is a member of (whose persistent folder the session gets as
    ~/projects/<name>): its row id as text and its name."""

    id: str
    name: str

    def encode(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name}

    @classmethod
    def decode(cls, value: Any) -> ProjectRef:
        m = _mapping(value, "project")
        return cls(id=_get(m, "project", "id", str), name=_get(m, "project", "name", str))


@dataclass(frozen=True)
class NodeStorage:
    """Where a node keeps the data folders (`<data-root>/users/<user id>`, `<data-root>/projects/<id>`):
    `shared` True when `data-root` is a shared mount (NFS, CephFS, …) that every node saying so
    mounts at the same path with the same contents, False when it is the node's own disk
    (agent.toml `[storage] shared`). Sent in the registration's inventory (`inventory["storage"]`);
    an agent from before it sends none: local. As Backend.AI's vfolder host, one shared host per
    cluster."""

    shared: bool = False

    def encode(self) -> dict[str, Any]:
        return {"shared": self.shared}

    @classmethod
    def decode(cls, value: Any) -> NodeStorage:
        """The storage of the inventory's `storage` (None: an older agent's, local). Raises Malformed."""
        if value is None:
            return cls()
        m = _mapping(value, "node storage")
        return cls(shared=_get(m, "node storage", "shared", bool, False))


@dataclass(frozen=True)
class SharedFolderRef:
    """A data folder shared with the session's owner (issue 36.5), seen at ~/shared/<name>:
    `kind` "user" (that user's persistent folder, `id` their user id as text) or "project" (`id`
    the project's id), `read_only` (the node mounts it read-only)."""

    name: str
    kind: str
    id: str
    read_only: bool = True

    def encode(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "id": self.id, "read_only": self.read_only}

    @classmethod
    def decode(cls, value: Any) -> SharedFolderRef:
        w, m = "shared folder", _mapping(value, "shared folder")
        kind = _get(m, w, "kind", str)
        if kind not in ("user", "project"):
            raise Malformed(f"a shared folder of kind {kind!r}")
        return cls(
            name=_get(m, w, "name", str), kind=kind, id=_get(m, w, "id", str), read_only=_get(m, w, "read_only", bool, True)
        )


@dataclass(frozen=True)
class StartSpec:
    """What an agent is sent to start a session (`fgpu.agent.session_start`'s `spec`): its
    `session_id`, `image` reference ("": the docker runtime's default image) and `shell` ("": the
    runtime's), its `name`, `owner` (user name), `owner_id` (None from a manager before persistent
    folders) and `owner_is_staff` (agent.sandbox), the owner's `projects`, the folders `shared` with
    the owner (issue 36.5: sent only when there are some; an agent from before ignores the key, so
    its sessions lack those folders and never get more; an older manager's spec has none), its `command` ("": an
    interactive shell), `cpu` (cores), `mem` (bytes; 0: the agent's default), its slot format
    (`slot_name`, `slot_subtype`), its `devices` by index and, for a MIG session, its `mig` block."""

    session_id: SessionId
    name: str
    owner: str
    command: str
    cpu: int
    mem: int
    devices: tuple[StartDevice, ...]
    image: str = ""
    shell: str = ""
    owner_id: UserId | None = None
    owner_is_staff: bool = False
    projects: tuple[ProjectRef, ...] = ()
    shared: tuple[SharedFolderRef, ...] = ()
    slot_name: str = ""
    slot_subtype: str = ""
    mig: MigBlock | None = None
    version: int = field(default=VERSION, compare=False)

    def encode(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "session_id": self.session_id,
            "image": self.image,
            "shell": self.shell,
            "name": self.name,
            "owner": self.owner,
            "owner_id": self.owner_id,
            "owner_is_staff": self.owner_is_staff,
            "projects": [p.encode() for p in self.projects],
            "command": self.command,
            "cpu": self.cpu,
            "mem": self.mem,
            "slot_name": self.slot_name,
            "slot_subtype": self.slot_subtype,
            "devices": [d.encode() for d in self.devices],
        }
        if self.shared:
            body["shared"] = [f.encode() for f in self.shared]
        if self.mig is not None:
            body["mig"] = self.mig.encode()
        return _versioned(self.version, body)

    @classmethod
    def decode(cls, value: Any) -> StartSpec:
        """The start spec of `value` (a dict as sent). Raises Malformed."""
        w, m = "start spec", _mapping(value, "start spec")
        mig = m.get("mig")
        return cls(
            session_id=SessionId(_get(m, w, "session_id", str)),
            image=_get(m, w, "image", str, ""),
            shell=_get(m, w, "shell", str, ""),
            name=_get(m, w, "name", str),
            owner=_get(m, w, "owner", str),
            owner_id=_user_id(_get(m, w, "owner_id", int, None)),
            owner_is_staff=_get(m, w, "owner_is_staff", bool, False),
            projects=tuple(ProjectRef.decode(p) for p in _get(m, w, "projects", list, [])),
            shared=tuple(SharedFolderRef.decode(f) for f in _get(m, w, "shared", list, [])),
            command=_get(m, w, "command", str, ""),
            cpu=_count(m, w, "cpu", 1),
            mem=_count(m, w, "mem", 0),
            slot_name=_get(m, w, "slot_name", str, ""),
            slot_subtype=_get(m, w, "slot_subtype", str, ""),
            devices=tuple(StartDevice.decode(d) for d in _get(m, w, "devices", list, [])),
            mig=MigBlock.decode(mig) if mig else None,
            version=_version(m, w),
        )


# --- manager → agent: a session's stop, the sessions to keep, a notice ------------------------------


@dataclass(frozen=True)
class SessionStop:
    """`fgpu.agent.session_stop`'s keyword arguments: stop session `session_id` on `node` (its
    agent reports the end; idempotent by session id)."""

    node: NodeName
    session_id: SessionId
    version: int = field(default=VERSION, compare=False)

    def encode(self) -> dict[str, Any]:
        """The task's keyword arguments."""
        return _versioned(self.version, {"node": self.node, "session_id": self.session_id})

    @classmethod
    def decode(cls, kwargs: Any) -> SessionStop:
        """Raises Malformed."""
        w, m = "session stop", _mapping(kwargs, "session stop")
        return cls(
            node=NodeName(_get(m, w, "node", str)),
            session_id=SessionId(_get(m, w, "session_id", str)),
            version=_version(m, w),
        )


@dataclass(frozen=True)
class SessionsSync:
    """`fgpu.agent.sessions_sync`'s keyword arguments: the sessions `node`'s agent may keep
    running (`keep`, session ids); it ends every other one (after it registered)."""

    node: NodeName
    keep: tuple[SessionId, ...]
    version: int = field(default=VERSION, compare=False)

    def encode(self) -> dict[str, Any]:
        """The task's keyword arguments."""
        return _versioned(self.version, {"node": self.node, "keep": list(self.keep)})

    @classmethod
    def decode(cls, kwargs: Any) -> SessionsSync:
        """Raises Malformed."""
        w, m = "sessions sync", _mapping(kwargs, "sessions sync")
        return cls(
            node=NodeName(_get(m, w, "node", str)),
            keep=tuple(SessionId(s) for s in _strings(m, w, "keep")),
            version=_version(m, w),
        )


@dataclass(frozen=True)
class SessionNotice:
    """`fgpu.agent.session_notice`'s keyword arguments: show `text` in the terminal of session
    `session_id` on `node` (the manager's idle and preemption warnings)."""

    node: NodeName
    session_id: SessionId
    text: str
    version: int = field(default=VERSION, compare=False)

    def encode(self) -> dict[str, Any]:
        """The task's keyword arguments."""
        return _versioned(self.version, {"node": self.node, "session_id": self.session_id, "text": self.text})

    @classmethod
    def decode(cls, kwargs: Any) -> SessionNotice:
        """Raises Malformed."""
        w, m = "session notice", _mapping(kwargs, "session notice")
        return cls(
            node=NodeName(_get(m, w, "node", str)),
            session_id=SessionId(_get(m, w, "session_id", str)),
            text=_get(m, w, "text", str),
            version=_version(m, w),
        )


# --- agent → manager ---------------------------------------------------------------------------------


def _objects(m: dict[str, Any], what: str, name: str, default: Any = ...) -> Any:
    value = _get(m, what, name, list, default)
    if value is not None and not all(isinstance(v, dict) for v in value):
        raise Malformed(f"{name!r} of a {what} is not a list of objects")
    return value


def _sent(body: dict[str, Any]) -> dict[str, Any]:
    """`body` without the fields that were not sent (None)."""
    return {key: value for key, value in body.items() if value is not None}


@dataclass(frozen=True)
class Inventory:
    """What a node has, as its agent registers it (agent.boot.load_inventory): `devices` (the
    compute plugins' accelerators.plugins.base.DeviceInfo, each as its dict: the manager builds
    the DeviceInfo, whose fields are the plugins' contract), `links` between them ({"a", "b",
    "kind", "count"}: checked by the manager's accelerators.services.node_links_apply), the
    `plugins` loaded, the node's `attributes`, `cpu_count` (cores), `memory_size` (bytes), the
    plugins' `warnings` and its `storage` (NodeStorage as sent: taken as sent, since the manager
    reads a malformed one as local rather than refuse the node). A field None was not sent (an
    agent before it, or a test's inventory): the encoder leaves it out."""

    devices: tuple[dict[str, Any], ...]
    links: tuple[dict[str, Any], ...] | None = None
    plugins: tuple[str, ...] | None = None
    attributes: dict[str, Any] | None = None
    cpu_count: int | None = None
    memory_size: int | None = None
    warnings: tuple[str, ...] | None = None
    storage: object = None

    def encode(self) -> dict[str, Any]:
        return _sent(
            {
                "devices": list(self.devices),
                "links": None if self.links is None else list(self.links),
                "plugins": None if self.plugins is None else list(self.plugins),
                "attributes": self.attributes,
                "cpu_count": self.cpu_count,
                "memory_size": self.memory_size,
                "warnings": None if self.warnings is None else list(self.warnings),
                "storage": self.storage,
            }
        )

    @classmethod
    def decode(cls, value: Any) -> Inventory:
        """Raises Malformed."""
        w, m = "node inventory", _mapping(value, "node inventory")
        links, plugins, warnings = (
            _objects(m, w, "links", None),
            _strings(m, w, "plugins", None),
            _strings(m, w, "warnings", None),
        )
        return cls(
            devices=tuple(_objects(m, w, "devices")),
            links=None if links is None else tuple(links),
            plugins=None if plugins is None else tuple(plugins),
            attributes=_get(m, w, "attributes", dict, None),
            cpu_count=_count(m, w, "cpu_count", None),
            memory_size=_count(m, w, "memory_size", None),
            warnings=None if warnings is None else tuple(warnings),
            storage=m.get("storage"),
        )


@dataclass(frozen=True)
class Registration:
    """`fgpu.manager.agent_register`'s keyword arguments: the agent of `node` started with its
    `inventory`, running the sessions `running` (ids), holding the session `images` and their
    `image_service_ports` labels (both as for Heartbeat: taken as sent, the manager keeps their
    well-formed entries; None: not sent, an agent before images, or no labels)."""

    node: NodeName
    inventory: Inventory
    running: tuple[SessionId, ...] = ()
    images: object = None
    image_service_ports: object = None
    version: int = field(default=VERSION, compare=False)

    def encode(self) -> dict[str, Any]:
        """The task's keyword arguments (before the signature)."""
        kwargs: dict[str, Any] = {"node": self.node, "inventory": self.inventory.encode(), "running": list(self.running)}
        if self.images is not None:
            kwargs["images"] = self.images
        if self.image_service_ports:
            kwargs["image_service_ports"] = self.image_service_ports
        return _versioned(self.version, kwargs)

    @classmethod
    def decode(cls, kwargs: Any) -> Registration:
        """The registration of the task's keyword arguments (its signature ignored). Raises Malformed."""
        w, m = "registration", _mapping(kwargs, "registration")
        return cls(
            node=NodeName(_get(m, w, "node", str)),
            inventory=Inventory.decode(_get(m, w, "inventory", dict)),
            running=tuple(SessionId(s) for s in _strings(m, w, "running", [])),
            images=m.get("images"),
            image_service_ports=m.get("image_service_ports"),
            version=_version(m, w),
        )


# --- the heartbeat's state: the agent's view of its sessions -----------------------------------------

AGENT_SESSION_STATES = ("PREPARING", "RUNNING", "TERMINATING")  # what an agent's heartbeat says of a session it runs
LAST_EPOCH_S = 253_402_300_799  # 9999-12-31T23:59:59Z, the last second a datetime holds: the latest `at` a state may carry


def _session_key(key: Any, what: str) -> SessionId:
    """The session id a state's entry is keyed by (JSON keys are text; a Python caller's may not be)."""
    if not isinstance(key, str):
        raise Malformed(f"a {what} keyed by {type(key).__name__}, not a session id")
    return SessionId(key)


@dataclass(frozen=True)
class SessionState:
    """A session the agent runs, as its heartbeat's state lists it: `session_id` and its `status`
    there, one of AGENT_SESSION_STATES (PREPARING: its start is under way; RUNNING; TERMINATING: its
    stop is under way). On the wire an entry `session_id: status` of the state's `sessions` object."""

    session_id: SessionId
    status: str

    def encode(self) -> str:
        """The entry's value (its key is `session_id`)."""
        return self.status

    @classmethod
    def decode(cls, key: Any, value: Any) -> SessionState:
        """The entry `key: value` of a state's `sessions`. Raises Malformed, a status this side does
        not know too (a later agent's: the manager then leaves that session as it is)."""
        session_id = _session_key(key, "heartbeat's session state")
        if not isinstance(value, str) or value not in AGENT_SESSION_STATES:
            shown = value[:40] if isinstance(value, str) else type(value).__name__
            raise Malformed(
                f"'status' of session {session_id[:80]!r} in a heartbeat's state is {shown!r}, "
                f"not one of {', '.join(AGENT_SESSION_STATES)}"
            )
        return cls(session_id=session_id, status=value)


@dataclass(frozen=True)
class SessionEnd:
    """A session's end the agent reported in its last ENDED_KEEP_S seconds (agent.manager_link),
    listed by each heartbeat's state for a manager that missed the report: its `status` (TERMINATED
    or ERROR; an upper-case state this side does not know reads as ERROR on the manager), `reason`
    and `exit_code` (None: unknown or none, e.g. a start that failed). On the wire an entry
    `session_id: {"status", "reason", "exit_code"}` of the state's `ended` object."""

    session_id: SessionId
    status: str
    reason: str = ""
    exit_code: int | None = None

    def encode(self) -> dict[str, Any]:
        """The entry's value (its key is `session_id`)."""
        return {"status": self.status, "reason": self.reason, "exit_code": self.exit_code}

    @classmethod
    def decode(cls, key: Any, value: Any) -> SessionEnd:
        """The entry `key: value` of a state's `ended` (keys a later agent adds are left). Raises Malformed."""
        session_id = _session_key(key, "heartbeat's session end")
        if type(value) is dict:  # what agents send, read without `read`'s messages: half the time (results/heartbeat_state.txt)
            status, reason, exit_code = value.get("status"), value.get("reason", ""), value.get("exit_code")
            if (
                type(status) is str
                and status.isupper()
                and len(status) <= 32
                and type(reason) is str
                and (exit_code is None or type(exit_code) is int)
            ):
                return cls(session_id, status, reason, exit_code)
        return cls.read(session_id, value)

    @classmethod
    def read(cls, session_id: SessionId, value: Any) -> SessionEnd:
        """`decode`'s reading of any entry, whose errors name the field. Raises Malformed."""
        w = f"heartbeat's end of session {session_id[:80]!r}"
        m = _mapping(value, w)
        status = _get(m, w, "status", str)
        if not status.isupper() or len(status) > 32:
            raise Malformed(f"'status' of a {w} is {status[:40]!r}, not a session state")
        return cls(
            session_id=session_id,
            status=status,
            reason=_get(m, w, "reason", str, ""),
            exit_code=_get(m, w, "exit_code", int, None),
        )


@dataclass(frozen=True)
class AgentState:
    """A heartbeat's `state`: the agent's view of its sessions (agent.core.Agent.state) at `at` (its
    clock, epoch seconds), which the manager reconciles with its database (sessions.lifecycle.reconcile):
    the `sessions` it runs and the `ended` ones it reported lately. On the wire `{"sessions": {id:
    status}, "ended": {id: {"status", "reason", "exit_code"}}, "at": seconds}`; an earlier agent's
    may lack `sessions` or `ended` (read as none), a later one's may carry keys this side does not
    know (left, in the state and in its entries).

    Decoding goes entry by entry: an entry malformed on its own is left out, its error (naming the
    session and the field) kept in `malformed` and its session id in `unreadable` (neither is sent),
    so the rest is reconciled and that session is left as it is for this heartbeat. A state that is
    not an object, whose `sessions` or `ended` is not one, or without a usable `at` (a number from 0
    to LAST_EPOCH_S) is refused whole (Malformed): nothing of it could be compared safely."""

    at: float
    sessions: tuple[SessionState, ...] = ()
    ended: tuple[SessionEnd, ...] = ()
    malformed: tuple[str, ...] = field(default=(), compare=False)
    unreadable: frozenset[SessionId] = field(default=frozenset(), compare=False)

    @property
    def statuses(self) -> dict[SessionId, str]:
        """{session id: its status} of the sessions the agent runs."""
        return {s.session_id: s.status for s in self.sessions}

    @property
    def ends(self) -> dict[SessionId, SessionEnd]:
        """{session id: its end} of the ended sessions."""
        return {e.session_id: e for e in self.ended}

    def encode(self) -> dict[str, Any]:
        return {
            "sessions": {s.session_id: s.encode() for s in self.sessions},
            "ended": {e.session_id: e.encode() for e in self.ended},
            "at": self.at,
        }

    @classmethod
    def decode(cls, value: Any) -> AgentState:
        """Raises Malformed for the state as a whole only (see the class)."""
        w, m = "heartbeat's state", _mapping(value, "heartbeat's state")
        at = m.get("at")
        if at is None:
            raise Malformed(f"a {w} without 'at'")
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not 0 <= at <= LAST_EPOCH_S:
            raise Malformed(f"'at' of a {w} is not a time in epoch seconds (0 to {LAST_EPOCH_S})")
        errors: list[str] = []
        unreadable: set[SessionId] = set()
        sessions = _entries(SessionState.decode, _get(m, w, "sessions", dict, {}), errors, unreadable)
        ended = _entries(SessionEnd.decode, _get(m, w, "ended", dict, {}), errors, unreadable)
        return cls(at=at, sessions=sessions, ended=ended, malformed=tuple(errors), unreadable=frozenset(unreadable))


def _entries(
    decode: Callable[[Any, Any], T], entries: dict[Any, Any], errors: list[str], unreadable: set[SessionId]
) -> tuple[T, ...]:
    """The entries of `entries` decoded one by one; a malformed one's error is added to `errors`
    and its key, when it is text, to `unreadable`."""
    out: list[T] = []
    for key, value in entries.items():
        try:
            out.append(decode(key, value))
        except Malformed as exc:
            errors.append(str(exc))
            if isinstance(key, str):
                unreadable.add(SessionId(key))
    return tuple(out)


@dataclass(frozen=True)
class Heartbeat:
    """`fgpu.manager.agent_heartbeat`'s keyword arguments: the agent's `node`, the session ids it
    `running`s, the digest of its MIG GPUs' instances (`mig_digest`; None: none known), its view of
    its sessions (`state`, an AgentState: agent.core.Agent.state; None: not sent, or refused whole,
    why in `state_error`, which is not sent: the rest of the heartbeat applies), the session images it holds
    (`images`, {reference: image id}; None from an agent before images: not sent) and their
    ai.backend.service-ports labels (`image_service_ports`, {image id: label}; sent when not empty).
    `images` and `image_service_ports` are taken as sent, of any type: the manager keeps their
    well-formed entries and logs the rest (accelerators.services.node_images_clean,
    sessions.policy.images.image_service_ports_apply), so one bad reference does not lose a heartbeat."""

    node: NodeName
    running: tuple[SessionId, ...]
    mig_digest: str | None = None
    state: AgentState | None = None
    images: object = None
    image_service_ports: object = None
    version: int = field(default=VERSION, compare=False)
    state_error: str = field(default="", compare=False)

    def encode(self) -> dict[str, Any]:
        """The task's keyword arguments (before the signature)."""
        kwargs: dict[str, Any] = {
            "node": self.node,
            "running": list(self.running),
            "mig_digest": self.mig_digest,
            "state": None if self.state is None else self.state.encode(),
        }
        if self.images is not None:
            kwargs["images"] = self.images
        if self.image_service_ports:
            kwargs["image_service_ports"] = self.image_service_ports
        return _versioned(self.version, kwargs)

    @classmethod
    def decode(cls, kwargs: dict[str, Any]) -> Heartbeat:
        """The heartbeat of the task's keyword arguments (its signature ignored). Raises Malformed,
        but for its `state`: a state refused whole reads as None, why in `state_error`."""
        w, m = "heartbeat", _mapping(kwargs, "heartbeat")
        state, state_error = None, ""
        if m.get("state") is not None:
            try:
                state = AgentState.decode(m["state"])
            except Malformed as exc:
                state_error = str(exc)
        return cls(
            node=NodeName(_get(m, w, "node", str)),
            running=tuple(SessionId(s) for s in _strings(m, w, "running")),
            mig_digest=_get(m, w, "mig_digest", str, None),
            state=state,
            images=m.get("images"),
            image_service_ports=m.get("image_service_ports"),
            version=_version(m, w),
            state_error=state_error,
        )


@dataclass(frozen=True)
class SessionReport:
    """`fgpu.manager.session_report`'s keyword arguments: session `session_id` is now `status`
    (one of the manager's session states: PREPARING, RUNNING, TERMINATED, ERROR, …) for `reason`,
    with `exit_code` once its process ended (None before, or when unknown); `node`: the reporting
    agent's (None from an agent before node keys: not sent)."""

    session_id: SessionId
    status: str
    reason: str = ""
    exit_code: int | None = None
    node: NodeName | None = None
    version: int = field(default=VERSION, compare=False)

    def encode(self) -> dict[str, Any]:
        return _fields_encoded(self)

    @classmethod
    def decode(cls, kwargs: dict[str, Any]) -> SessionReport:
        """Raises Malformed."""
        w, m = "session report", _mapping(kwargs, "session report")
        status = _get(m, w, "status", str)
        if not status.isupper() or len(status) > 32:
            raise Malformed(f"a session report of status {status[:40]!r}")
        return cls(
            session_id=SessionId(_get(m, w, "session_id", str)),
            status=status,
            reason=_get(m, w, "reason", str, ""),
            exit_code=_get(m, w, "exit_code", int, None),
            node=_node(m, w),
            version=_version(m, w),
        )


@dataclass(frozen=True)
class LogBatch:
    """`fgpu.manager.session_log_append`'s keyword arguments: batch `seq` (from 0) of session
    `session_id`'s output, `text` starting at character `offset` of it; `final`: the last batch
    (the session ended); `node` as for SessionReport."""

    session_id: SessionId
    seq: int
    offset: int
    text: str
    final: bool = False
    node: NodeName | None = None
    version: int = field(default=VERSION, compare=False)

    def encode(self) -> dict[str, Any]:
        return _fields_encoded(self)

    @classmethod
    def decode(cls, kwargs: dict[str, Any]) -> LogBatch:
        """Raises Malformed."""
        w, m = "log batch", _mapping(kwargs, "log batch")
        return cls(
            session_id=SessionId(_get(m, w, "session_id", str)),
            seq=_count(m, w, "seq"),
            offset=_count(m, w, "offset"),
            text=_get(m, w, "text", str),
            final=_get(m, w, "final", bool, False),
            node=_node(m, w),
            version=_version(m, w),
        )


# --- the usage batch ---------------------------------------------------------------------------------

USAGE_MAX_SAMPLES = 20_000  # samples one batch may carry (a node with 200 sessions, an hour of 5 s samples … is split)
USAGE_MAX_SPAN = 3600  # seconds one session sample may stand for
USAGE_MAX_FOLDERS = 64  # data folders one session's sample may name (its ~/data and its projects')
DATA_FOLDER, PROJECT_FOLDER = "~/data", "~/projects/"  # how a session sees its data folders (agent.storage)
_BYTES, _EPOCH = 2**62, 2**40


def _bounded(m: dict[str, Any], what: str, name: str, hi: int, default: Any = ..., *, lo: int = 0) -> Any:
    """Field `name` as a whole number in [lo, hi]; null (or missing, with a default) gives the default."""
    value = _get(m, what, name, int, default)
    if value is not None and not lo <= value <= hi:
        raise Malformed(f"{name!r} of a {what} is not from {lo} to {hi}")
    return value


@dataclass(frozen=True)
class DeviceUsage:
    """One device's sample of a usage batch (agent.usage): device `device` at `t` (epoch seconds)
    had `memory_used` of `memory_total` bytes in use and `util` percent (0-100, None unknown)."""

    device: HardwareId
    t: int
    memory_used: int
    memory_total: int
    util: int | None = None

    def encode(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def decode(cls, value: Any) -> DeviceUsage:
        """Raises Malformed (a null time or figure too: a device sample always has them)."""
        w, m = "device sample", _mapping(value, "device sample")
        return cls(
            device=HardwareId(_get(m, w, "device", str)),
            t=_bounded(m, w, "t", _EPOCH),
            memory_used=_bounded(m, w, "memory_used", _BYTES),
            memory_total=_bounded(m, w, "memory_total", _BYTES),
            util=_bounded(m, w, "util", 100, None),
        )


@dataclass(frozen=True)
class FolderUsage:
    """A data folder a session mounts, at its last measure (agent.storage): `folder` "~/data" or
    "~/projects/<name>" (at most 80 characters), `used` and `limit` bytes."""

    folder: str
    used: int
    limit: int

    def encode(self) -> dict[str, Any]:
        return {"folder": self.folder, "used": self.used, "limit": self.limit}

    @classmethod
    def decode(cls, value: Any) -> FolderUsage:
        """Raises Malformed."""
        w, m = "folder sample", _mapping(value, "folder sample")
        name = _get(m, w, "folder", str)
        if not (name == DATA_FOLDER or (name.startswith(PROJECT_FOLDER) and len(name) <= 80)):
            raise Malformed(f"folder {name[:80]!r} of a {w} is neither ~/data nor ~/projects/<name>")
        return cls(folder=name, used=_bounded(m, w, "used", _BYTES), limit=_bounded(m, w, "limit", _BYTES))


@dataclass(frozen=True)
class SessionUsage:
    """One session's sample of a usage batch (agent.usage's module docstring gives each field):
    at `t` (epoch seconds) standing for `span` seconds (1-3600), GPU memory (bytes) and
    utilisation (percent), CPU (milli-cores), resident memory (bytes), the last terminal input
    (epoch seconds), storage and its limit (bytes), each None where unknown, and its data `folders`.
    An earlier agent's sample without span, storage or folders reads as span 1, None and none."""

    session_id: SessionId
    t: int
    span: int = 1
    gpu_memory: int | None = None
    gpu_util: int | None = None
    cpu: int | None = None
    mem: int | None = None
    last_input: int | None = None
    storage: int | None = None
    storage_limit: int | None = None
    folders: tuple[FolderUsage, ...] = ()

    def encode(self) -> dict[str, Any]:
        body = {f.name: getattr(self, f.name) for f in fields(self)}
        body["folders"] = [f.encode() for f in self.folders]
        return body

    @classmethod
    def decode(cls, value: Any) -> SessionUsage:
        """Raises Malformed (a null time or span too: they are what the sample is stored under)."""
        w, m = "session sample", _mapping(value, "session sample")
        folders = _get(m, w, "folders", list, [])
        if len(folders) > USAGE_MAX_FOLDERS:
            raise Malformed(f"a {w} naming more than {USAGE_MAX_FOLDERS} folders")
        if "span" in m and m["span"] is None:
            raise Malformed(f"'span' of a {w} is null")
        return cls(
            session_id=SessionId(_get(m, w, "session_id", str)),
            t=_bounded(m, w, "t", _EPOCH),
            span=_bounded(m, w, "span", USAGE_MAX_SPAN, 1, lo=1),
            gpu_memory=_bounded(m, w, "gpu_memory", _BYTES, None),
            gpu_util=_bounded(m, w, "gpu_util", 100, None),
            cpu=_bounded(m, w, "cpu", 2**31 - 1, None),
            mem=_bounded(m, w, "mem", _BYTES, None),
            last_input=_bounded(m, w, "last_input", _EPOCH, None),
            storage=_bounded(m, w, "storage", _BYTES, None),
            storage_limit=_bounded(m, w, "storage_limit", _BYTES, None),
            folders=tuple(FolderUsage.decode(f) for f in folders),
        )


@dataclass(frozen=True)
class UsageBatch:
    """`fgpu.manager.usage_report`'s keyword arguments: `node`'s usage samples taken every
    `interval` seconds (agent.usage), on the wire `{"node", "batch": {"interval", "devices",
    "sessions"}}` (and the node's `signature`, which the manager checks on the keyword arguments as
    sent). Decoding refuses a batch that is not an object of two lists or carries more than
    USAGE_MAX_SAMPLES samples (Malformed); a sample that is malformed on its own is left out and
    counted in `malformed` (not sent), so the rest of the batch is stored (usage.services.usage_ingest
    counts it refused)."""

    node: NodeName
    interval: float | None = None
    devices: tuple[DeviceUsage, ...] = ()
    sessions: tuple[SessionUsage, ...] = ()
    version: int = field(default=VERSION, compare=False)
    malformed: int = field(default=0, compare=False)

    def encode(self) -> dict[str, Any]:
        """The task's keyword arguments."""
        batch = {
            "interval": self.interval,
            "devices": [d.encode() for d in self.devices],
            "sessions": [s.encode() for s in self.sessions],
        }
        return _versioned(self.version, {"node": self.node, "batch": batch})

    @classmethod
    def decode(cls, kwargs: Any) -> UsageBatch:
        """The batch of the task's keyword arguments (its signature ignored). Raises Malformed."""
        w, m = "usage report", _mapping(kwargs, "usage report")
        batch = _mapping(m.get("batch"), "usage batch")
        devices, sessions = _get(batch, "usage batch", "devices", list), _get(batch, "usage batch", "sessions", list)
        if len(devices) + len(sessions) > USAGE_MAX_SAMPLES:
            raise Malformed(f"a usage batch of more than {USAGE_MAX_SAMPLES} samples")
        interval = batch.get("interval")
        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval <= 0):
            raise Malformed("'interval' of a usage batch is not a positive number")
        good_devices, malformed = _each(DeviceUsage.decode, devices)
        good_sessions, bad = _each(SessionUsage.decode, sessions)
        return cls(
            node=NodeName(_get(m, w, "node", str)),
            interval=interval,
            devices=good_devices,
            sessions=good_sessions,
            version=_version(m, w),
            malformed=malformed + bad,
        )


def _each(decode: Callable[[Any], T], values: list[Any]) -> tuple[tuple[T, ...], int]:
    """`values` decoded one by one: those that decode, and how many did not."""
    out: list[T] = []
    for value in values:
        try:
            out.append(decode(value))
        except Malformed:
            continue
    return tuple(out), len(values) - len(out)
