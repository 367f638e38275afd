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
    `subproc_count` in SMs; `mig_profile` only for MIG slices ("1g.10gb", "10g");
    `mig_catalog` only for MIG-capable GPUs whose profiles were read from NVML
    (`accelerators.allocation.mig.catalog_as_dict`).
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
    mig_catalog: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class PluginInventory:
    """A plugin's whole report: its devices, attributes (driver versions …), warnings, and
    the links between its devices.

    `links`: one dict per linked pair of whole devices, `{"a": device_id, "b": device_id,
    "kind": "NVLINK", "count": 4}` (`accelerators.allocation.topology.Link.as_dict`; kinds
    NVLINK, METAXLINK, PIX, PXB, PHB, NODE, SYS; `count` is the lane count, 1 for the PCIe
    kinds). The manager stores them with `accelerators.services.node_links_apply`.
    """

    plugin: str
    slot_name: str
    devices: list[DeviceInfo]
    attributes: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    links: list[dict] = field(default_factory=list)
