"""What a compute plugin reports to the agent: the node's devices and driver attributes.

Plugins are named as in Backend.AI's agent.toml `allowed-compute-plugins`
(`ai.backend.accelerator.mock`, `ai.backend.accelerator.cuda`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class DeviceInfo:
    """One device as a plugin discovered it.

    `device_id`: stable id (GPU or MIG UUID, e.g. "GPU-c59395cd-…"); `memory_size` in bytes;
    `subproc_count` in SMs; `mig_profile` only for MIG slices ("1g.10gb", "10g").
    """

    slot_name: str
    device_id: str
    index: int
    mother_uuid: str
    model_name: str
    numa_node: int | None
    subproc_count: int
    memory_size: int
    is_mig_device: bool = False
    mig_profile: str = ""
    parent_device_id: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class PluginInventory:
    """A plugin's whole report: its devices, attributes (driver versions …), warnings."""

    plugin: str
    slot_name: str
    devices: list[DeviceInfo]
    attributes: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
