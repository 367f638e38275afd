"""Building an agent from agent.toml: load the compute plugins, then the Agent itself."""

from __future__ import annotations

import agent.tasks  # noqa: F401  (registers the agent's tasks with the app: in standalone mode they run here)
from agent.config import CUDA_PLUGIN, MOCK_PLUGIN, AgentConfig
from agent.core import Agent
from agent.manager_link import CeleryManager
from agent.network import installation_id
from agent.runtimes import DOCKER, ProcessRuntime
from protocol.messages import NodeStorage


def load_inventory(config: AgentConfig) -> dict:
    """Run the configured plugins and merge what they report into the inventory the agent
    registers: `{"devices": [DeviceInfo dicts], "links": [{"a", "b", "kind", "count"}], "plugins",
    "attributes", "cpu_count", "memory_size" (bytes), "storage" (protocol.messages.NodeStorage,
    encoded: agent.toml's [storage])}`. Plugin errors propagate with their own message."""
    devices: list[dict] = []
    links: list[dict] = []
    attributes: dict[str, object] = {}
    warnings: list[str] = []
    for plugin in config.plugins:
        if plugin == MOCK_PLUGIN:
            from accelerators.plugins import mock

            if config.mock_config is None:  # load_agent_config sets it with the plugin; this guards other callers
                raise ValueError("the mock plugin needs its device file (plugins.mock.config)")
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
    attributes["fraction_enforcement"] = config.fraction_enforcement
    attributes["pulls_images"] = config.pulls_images
    attributes["mps"] = config.mps  # sessions get the MPS limits too (protocol.environment.limits_environment)
    return {
        "devices": devices,
        "links": links,
        "plugins": list(config.plugins),
        "attributes": attributes,
        "cpu_count": config.cpu_count,
        "memory_size": config.memory_size,
        "warnings": warnings,
        "storage": NodeStorage(shared=config.storage_shared).encode(),  # [storage]: where data-root is
    }


def build_runtime(config: AgentConfig):
    """The runtime agent.toml's `[container] runtime` names (process: with its `cgroup-root`).
    Raises DockerRuntimeError (docker: Docker Engine unreachable)."""
    if config.runtime == DOCKER:
        from agent.docker_runtime import DockerRuntime

        return DockerRuntime(
            node=config.node_name,
            default_image=config.default_image,
            uid=config.uid,
            gid=config.gid,
            network=config.network,
            instance=installation_id(config.scratch_root),  # one network per installation (agent.network)
            block_private=config.block_private_networks,
            gpus=CUDA_PLUGIN in config.plugins,
            hami_core=config.hami_core,
            mps_pipe_directory=config.mps_pipe_directory if config.mps else None,
            pull=config.pull_images,
            limits=config.limits,  # default memory, pids a container and all of them together (agent.limits)
        )
    return ProcessRuntime(
        node=config.node_name,
        cgroup_root=config.cgroup_root,
        limits=config.limits,
        sandbox=config.sandbox,
        uid=config.uid,
        gid=config.gid,
        network=config.network,
        block_private=config.block_private_networks,
    )


def build_agent(
    config: AgentConfig, *, celery_app, channel_layer, heartbeat_s: float, exec_store=None, terminal_direct: bool = True
) -> Agent:
    """The agent of `config`'s node, sending to the manager through `celery_app` (the console's,
    common.celery.app). `exec_store`: where its streamed execs keep their output
    (protocol.exec_store; None: this process's memory store). `terminal_direct`: False keeps its
    terminals on the channel layer whatever agent.toml says (standalone mode: the consumers share
    the agent's process and loop, and its in-memory layer is the shorter path)."""
    inventory = load_inventory(config)
    agent = Agent(
        runtime=build_runtime(config),
        node=config.node_name,
        inventory=inventory,
        channel_layer=channel_layer,
        manager=CeleryManager(celery_app, node=config.node_name, key=config.node_key),
        scratch_root=config.scratch_root,
        mock=CUDA_PLUGIN not in config.plugins,
        mps=config.mps,
        heartbeat_s=heartbeat_s,
        exec_store=exec_store,
        scratch_retention_s=config.scratch_retention_s,
        app_address=config.app_address,
        data_root=config.data_root,
        app_relay=config.app_relay,
        terminal_direct=terminal_direct and config.terminal_direct,
        terminal_port=config.terminal_port,
        terminal_address=config.terminal_address,
    )
    agent.usage.configure(interval_s=config.usage_interval_s, flush_s=config.usage_flush_s)
    agent.storage.configure(config.limits)  # [limits] session-storage, user-data-storage (agent.storage)
    return agent
