"""The agent's `ai.backend.accelerator.mock` compute plugin: devices from a TOML file.

Reads Backend.AI's mock-accelerator TOML (see `accelerators.config_parse`) and reports its
devices as if discovered on the node, with the file's `[attributes]` (`nvidia_driver`,
`cuda_runtime`, …) as driver attributes and the file's optional `links` table (our extension)
as the links between its devices. Nothing is written anywhere; the agent sends the
inventory to the manager, which applies it with `node_inventory_apply`.
"""

from __future__ import annotations

from pathlib import Path

from accelerators.config_parse import MOCK_PLUGIN_NAME, parse_mock_accelerator_toml
from accelerators.plugins.base import PluginInventory

PLUGIN_NAME = MOCK_PLUGIN_NAME


def load(config_path: str | Path) -> PluginInventory:
    """The inventory a mock node reports: devices in file order (memory in bytes, SMs), the
    file's attributes (for slot "cuda" `nvidia_driver` and `cuda_runtime` always present,
    Backend.AI's defaults filled in), the parser's warnings, and the file's links as
    `{"a": device_id, "b": device_id, "kind": "NVLINK", "count": 4}` (device ids, not
    positions; empty when the file declares none).

    Raises `accelerators.config_parse.ConfigError` (file, field, problem) for a file that
    Backend.AI's mock plugin would refuse or that this project cannot represent.
    """
    config = parse_mock_accelerator_toml(config_path)
    return PluginInventory(
        plugin=PLUGIN_NAME,
        slot_name=config.slot_name,
        devices=list(config.devices),
        attributes=dict(config.attributes),
        warnings=list(config.warnings),
        links=[link.as_dict() for link in config.links],
    )
