"""Building an agent from agent.toml: load the compute plugins, then the Agent itself."""
from __future__ import annotations

from sessions.runtime.agent import Agent, CeleryManager
from sessions.runtime.config import CUDA_PLUGIN, MOCK_PLUGIN, AgentConfig


def load_inventory(config: AgentConfig) -> dict:
    """Run the configured plugins and merge what they report into the inventory the agent
    registers: `{"devices": [DeviceInfo dicts], "links": [{"a", "b", "kind", "count"}], "plugins",
    "attributes", "cpu_count",
    "memory_size"}` (bytes). Plugin errors propagate with their own message."""
    devices, links, attributes, warnings = [], [], {}, []
    for plugin in config.plugins:
        if plugin == MOCK_PLUGIN:
            from accelerators.plugins import mock

            inventory = mock.load(config.mock_config)
        elif plugin == CUDA_PLUGIN:
            from accelerators.plugins import cuda

            inventory = cuda.load()
        else:  # load_agent_config refuses unknown plugins; this guards programming errors
            raise ValueError(f"unknown compute plugin {plugin!r}")
        devices.extend(d.as_dict() for d in inventory.devices)
        links.extend(inventory.links)
        attributes.update(inventory.attributes)
        warnings.extend(inventory.warnings)
    return {"devices": devices, "links": links, "plugins": list(config.plugins), "attributes": attributes,
            "cpu_count": config.cpu_count, "memory_size": config.memory_size, "warnings": warnings}


def build_agent(config: AgentConfig, *, channel_layer, heartbeat_s: float, exec_store=None) -> Agent:
    """The agent of `config`'s node. `exec_store`: where its streamed execs keep their output
    (sessions.exec_store; None: the one this process's settings name, as in standalone mode)."""
    inventory = load_inventory(config)
    return Agent(node=config.node_name, inventory=inventory, channel_layer=channel_layer, manager=CeleryManager(),
                 scratch_root=config.scratch_root, mock=CUDA_PLUGIN not in config.plugins, mps=config.mps,
                 heartbeat_s=heartbeat_s, exec_store=exec_store)
