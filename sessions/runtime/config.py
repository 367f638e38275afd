"""agent.toml: what one agent (one GPU node) runs with.

Where it overlaps it reads like Backend.AI's agent.toml, so a Backend.AI mock set-up carries
over::

    [agent]
    id = "gpu-node-1"                                   # the node's name
    allowed-compute-plugins = ["ai.backend.accelerator.mock"]
    cpu-count = 8                                       # optional; default: this machine's
    memory = "32G"                                      # optional; default: this machine's RAM
    mps = false                                         # export NVIDIA MPS limits too

    [manager]
    broker-url = "redis://127.0.0.1:6379/0"             # optional; default: $REDIS_URL

    [container]
    scratch-root = "./var/scratches"                    # sessions' working directories

    [plugins.mock]
    config = "mock-accelerator.toml"                    # relative to this file

Relative paths are relative to the directory of agent.toml.
"""
from __future__ import annotations

import os
import socket
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from accelerators.allocation.units import SizeError, parse_binary_size

MOCK_PLUGIN = "ai.backend.accelerator.mock"
CUDA_PLUGIN = "ai.backend.accelerator.cuda"
KNOWN_PLUGINS = (MOCK_PLUGIN, CUDA_PLUGIN)


class AgentConfigError(ValueError):
    """agent.toml is unusable; the message names the file, the key and the problem."""


@dataclass(frozen=True)
class AgentConfig:
    path: Path
    node_name: str
    plugins: tuple[str, ...]
    cpu_count: int
    memory_size: int
    mps: bool
    broker_url: str
    scratch_root: Path
    mock_config: Path | None = None
    extra: dict = field(default_factory=dict)


def _machine_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def load_agent_config(path: str | Path, *, default_broker: str = "") -> AgentConfig:
    """Read and check agent.toml. Raises AgentConfigError naming the file and key."""
    path = Path(path).resolve()
    where = path.name

    def fail(key: str, problem: str):
        raise AgentConfigError(f"{where}: {key}: {problem}")

    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise AgentConfigError(f"{path}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise AgentConfigError(f"{where}: not valid TOML: {exc}") from None
    def table(parent: dict, key: str, where_key: str) -> dict:
        value = parent.get(key, {})
        if not isinstance(value, dict):
            fail(where_key, f"expected a table, got {value!r}")
        return value

    def text(parent: dict, key: str, where_key: str, default: str) -> str:
        value = parent.get(key, default)
        if not isinstance(value, str):
            fail(where_key, f"expected text, got {value!r}")
        return value

    agent = table(data, "agent", "agent")
    node_name = agent.get("id", socket.gethostname())
    if not isinstance(node_name, str) or not node_name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        fail("agent.id", f"{node_name!r} is not a node name (letters, digits, '-', '_', '.')")
    plugins = agent.get("allowed-compute-plugins", [MOCK_PLUGIN])
    if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
        fail("agent.allowed-compute-plugins", "expected a list of plugin names")
    for plugin in plugins:
        if plugin not in KNOWN_PLUGINS:
            fail("agent.allowed-compute-plugins", f"unknown plugin {plugin!r} (known: {', '.join(KNOWN_PLUGINS)})")
    cpu_count = agent.get("cpu-count", os.cpu_count() or 1)
    if isinstance(cpu_count, bool) or not isinstance(cpu_count, int) or cpu_count < 1:
        fail("agent.cpu-count", f"{cpu_count!r} is not a positive whole number")
    try:
        memory_size = parse_binary_size(agent.get("memory", _machine_memory()))
    except SizeError as exc:
        fail("agent.memory", str(exc))
    mps = agent.get("mps", False)
    if not isinstance(mps, bool):
        fail("agent.mps", "expected true or false")
    broker_url = text(table(data, "manager", "manager"), "broker-url", "manager.broker-url", default_broker)
    if broker_url and not broker_url.startswith(("redis://", "rediss://", "memory://")):
        fail("manager.broker-url", f"{broker_url!r} is not a redis:// URL")
    scratch = text(table(data, "container", "container"), "scratch-root", "container.scratch-root", "scratches")
    mock_config = None
    if MOCK_PLUGIN in plugins:
        mock = table(table(data, "plugins", "plugins"), "mock", "plugins.mock")
        raw = text(mock, "config", "plugins.mock.config", "mock-accelerator.toml")
        mock_config = (path.parent / raw).resolve()
        if not mock_config.exists():
            fail("plugins.mock.config", f"{mock_config} does not exist")
    return AgentConfig(
        path=path, node_name=node_name, plugins=tuple(plugins), cpu_count=cpu_count, memory_size=memory_size,
        mps=mps, broker_url=broker_url, scratch_root=(path.parent / scratch).resolve(), mock_config=mock_config,
    )
