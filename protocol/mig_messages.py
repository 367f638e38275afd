"""The typed MIG messages between the manager and its agents (issue 34, item 1), as
protocol.messages types the others: frozen dataclasses with a `version`, one encoder (`encode`:
the message as it travels, JSON-safe) and one decoder (`decode`: raises Malformed, saying which
field, for anything else), used by both sides.

- `MigReconcile` (manager → agent, `fgpu.agent.mig_reconcile`'s keyword arguments): the MIG GPUs
  of a node and the GPU instances the manager expects on each; accelerators.mig_services builds
  it, agent.tasks decodes it and agent.mig.MigManager carries it out.
- `MigReport` (agent → manager, `fgpu.manager.mig_report`'s `report`): what the agent found and
  did; agent.mig.MigManager builds it, sessions.tasks decodes it and
  accelerators.mig_services.node_mig_report_apply records it.

The wire is the one of the untyped dicts these replaced (the same keys, a `version` only when it
is not 1), so that an agent and a manager of adjacent versions interoperate; decoders take what
an earlier version sent (a report's lists and a reconcile's `destroy`, `kind` and `seq` may be
missing) and read the fields they know of a later version's message. GPUs are named by their
hardware id (protocol.messages.HardwareId: the GPU's UUID as NVML gives it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from protocol.messages import (
    VERSION,
    HardwareId,
    Malformed,
    MigGpu,
    MigPlacement,
    NodeName,
    _count,
    _get,
    _mapping,
    _strings,
    _version,
    _versioned,
)

__all__ = [
    "RECONCILE_KINDS",
    "Layout",
    "MigFailure",
    "MigGpu",
    "MigInstance",
    "MigReconcile",
    "MigReport",
    "MigSlot",
]

RECONCILE_KINDS = ("start", "layout", "drift")  # after registering, an administrator's change, a heartbeat's digest differed

Layout = Mapping[HardwareId, tuple[MigPlacement, ...]]  # GPU → GPU instances (profile and first memory slice)


def _layout(m: dict[str, Any], what: str, name: str) -> dict[HardwareId, tuple[MigPlacement, ...]]:
    """`{GPU UUID: [{"profile", "start"}]}` of field `name` (missing or null: empty)."""
    value = _get(m, what, name, dict, {})
    out: dict[HardwareId, tuple[MigPlacement, ...]] = {}
    for gpu, items in value.items():
        if not isinstance(items, list):
            raise Malformed(f"{name!r} of a {what} lists GPU {str(gpu)[:40]!r}'s instances as no list")
        out[HardwareId(gpu)] = tuple(MigPlacement.decode(item) for item in items)
    return out


def _layout_encoded(layout: Layout) -> dict[str, list[dict[str, Any]]]:
    return {gpu: [p.encode() for p in items] for gpu, items in layout.items()}


# --- manager → agent ------------------------------------------------------------------------------


@dataclass(frozen=True)
class MigReconcile:
    """`fgpu.agent.mig_reconcile`'s keyword arguments (accelerators.mig_services.node_mig_push
    sends it): on `node`, reconcile the MIG GPUs `gpus` with the GPU instances the manager
    `expected`s on each (every one it planned, in use or idle), destroying first the idle ones
    in `destroy` that the layout no longer holds; `kind` one of RECONCILE_KINDS ("start" skips the
    GPUs a start spec reached first), `seq` echoed in the report (None: none asked)."""

    node: NodeName
    gpus: tuple[MigGpu, ...]
    expected: Layout
    destroy: Layout = field(default_factory=dict)
    kind: str = "start"
    seq: int | None = None
    version: int = field(default=VERSION, compare=False)

    def encode(self) -> dict[str, Any]:
        """The task's keyword arguments."""
        return _versioned(
            self.version,
            {
                "node": self.node,
                "gpus": [g.encode() for g in self.gpus],
                "expected": _layout_encoded(self.expected),
                "destroy": _layout_encoded(self.destroy),
                "kind": self.kind,
                "seq": self.seq,
            },
        )

    @classmethod
    def decode(cls, kwargs: Any) -> MigReconcile:
        """The message of the task's keyword arguments. Raises Malformed."""
        w, m = "MIG reconcile", _mapping(kwargs, "MIG reconcile")
        kind = _get(m, w, "kind", str, "start")
        if kind not in RECONCILE_KINDS:
            raise Malformed(f"a MIG reconcile of kind {kind[:40]!r}")
        return cls(
            node=NodeName(_get(m, w, "node", str)),
            gpus=tuple(MigGpu.decode(g) for g in _get(m, w, "gpus", list)),
            expected=_layout(m, w, "expected"),
            destroy=_layout(m, w, "destroy"),
            kind=kind,
            seq=_get(m, w, "seq", int, None),
            version=_version(m, w),
        )


# --- agent → manager ------------------------------------------------------------------------------


@dataclass(frozen=True)
class MigSlot:
    """A GPU instance by its place: GPU `gpu`, MIG `profile`, first memory slice `start`."""

    gpu: HardwareId
    profile: str
    start: int

    def encode(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "profile": self.profile, "start": self.start}

    @classmethod
    def decode(cls, value: Any) -> MigSlot:
        w, m = "MIG instance", _mapping(value, "MIG instance")
        return cls(gpu=HardwareId(_get(m, w, "gpu", str)), profile=_get(m, w, "profile", str), start=_count(m, w, "start"))


@dataclass(frozen=True)
class MigInstance:
    """A GPU instance found or made on a GPU: its place and its MIG device's `uuid` ("MIG-…";
    "" where it has none)."""

    gpu: HardwareId
    profile: str
    start: int
    uuid: str = ""

    def encode(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "profile": self.profile, "start": self.start, "uuid": self.uuid}

    @classmethod
    def decode(cls, value: Any) -> MigInstance:
        w, m = "MIG instance", _mapping(value, "MIG instance")
        return cls(
            gpu=HardwareId(_get(m, w, "gpu", str)),
            profile=_get(m, w, "profile", str),
            start=_count(m, w, "start"),
            uuid=_get(m, w, "uuid", str, ""),
        )


@dataclass(frozen=True)
class MigFailure:
    """A MIG step that failed on GPU `gpu`, in words (`reason`): for instance `profile` at
    `start`, or for the whole GPU (`profile` "", `start` None: it could not be listed)."""

    gpu: HardwareId
    reason: str
    profile: str = ""
    start: int | None = None

    def encode(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "profile": self.profile, "start": self.start, "reason": self.reason}

    @classmethod
    def decode(cls, value: Any) -> MigFailure:
        w, m = "MIG error", _mapping(value, "MIG error")
        return cls(
            gpu=HardwareId(_get(m, w, "gpu", str)),
            reason=_get(m, w, "reason", str, ""),
            profile=_get(m, w, "profile", str, ""),
            start=_count(m, w, "start", None),
        )


@dataclass(frozen=True)
class MigReport:
    """`fgpu.manager.mig_report`'s `report` (agent.mig.MigManager builds it): `gpus` the GPUs whose
    instances the agent could list, on them the instances the manager does not know (`unknown`:
    left in place) and the expected ones it created again (`recreated`); `errors` what failed.
    Three shapes travel: a reconcile's on a GPU a start spec reached first (those four fields);
    an answer to a MigReconcile (`kind` set: its kind and `seq`, with the `destroyed` instances,
    those of its `destroy` no longer on the GPU); after a start spec's instance was made or
    reused, `prepared` (that instance, so the manager learns its MIG device's UUID)."""

    gpus: tuple[HardwareId, ...] = ()
    unknown: tuple[MigInstance, ...] = ()
    recreated: tuple[MigInstance, ...] = ()
    errors: tuple[MigFailure, ...] = ()
    prepared: tuple[MigInstance, ...] = ()
    destroyed: tuple[MigSlot, ...] = ()
    kind: str | None = None
    seq: int | None = None
    version: int = field(default=VERSION, compare=False)

    def encode(self) -> dict[str, Any]:
        """The report as it travels: `prepared` only when not empty, `destroyed`, `kind` and
        `seq` only in an answer to a MigReconcile."""
        body: dict[str, Any] = {
            "gpus": list(self.gpus),
            "unknown": [i.encode() for i in self.unknown],
            "recreated": [i.encode() for i in self.recreated],
            "errors": [e.encode() for e in self.errors],
        }
        if self.prepared:
            body["prepared"] = [i.encode() for i in self.prepared]
        if self.kind is not None:
            body.update(destroyed=[s.encode() for s in self.destroyed], kind=self.kind, seq=self.seq)
        return _versioned(self.version, body)

    @classmethod
    def decode(cls, value: Any) -> MigReport:
        """Raises Malformed."""
        w, m = "MIG report", _mapping(value, "MIG report")
        return cls(
            gpus=tuple(HardwareId(g) for g in _strings(m, w, "gpus", [])),
            unknown=tuple(MigInstance.decode(i) for i in _get(m, w, "unknown", list, [])),
            recreated=tuple(MigInstance.decode(i) for i in _get(m, w, "recreated", list, [])),
            errors=tuple(MigFailure.decode(e) for e in _get(m, w, "errors", list, [])),
            prepared=tuple(MigInstance.decode(i) for i in _get(m, w, "prepared", list, [])),
            destroyed=tuple(MigSlot.decode(s) for s in _get(m, w, "destroyed", list, [])),
            kind=_get(m, w, "kind", str, None),
            seq=_get(m, w, "seq", int, None),
            version=_version(m, w),
        )
