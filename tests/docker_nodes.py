"""Docker nodes of the end-to-end tests: a node name of the test's own, and what that node's agent
left on the host (its session containers, its network, the network's iptables chain: agent.network)
removed when the test ends, whatever happened. A docker agent that stops keeps its sessions'
containers running by design (an agent restart adopts them), so a test must remove them itself."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest


def remove_leftovers(node: str) -> None:
    """Remove every container and network labelled `fgpu.node=<node>`, and each network's iptables
    chain; what is already gone is fine."""
    import docker
    from docker.errors import NotFound

    from agent.network import guard_remove, iptables_command, network_names

    client = docker.from_env()
    for container in client.containers.list(all=True, sparse=True, filters={"label": f"fgpu.node={node}"}):
        try:
            container.remove(force=True)
        except NotFound:
            pass
    iptables = None
    for network in client.networks.list(filters={"label": f"fgpu.node={node}"}):
        instance = (network.attrs.get("Labels") or {}).get("fgpu.instance", "")
        try:
            network.remove()
        except NotFound:
            pass
        if instance:
            iptables = iptables or iptables_command()[0]
            if iptables:
                guard_remove(network_names(node, instance), iptables=iptables)


@pytest.fixture
def docker_node() -> Iterator[str]:
    """`docker_node("apps")` is a node name of this test's own (`apps-<8 hex>`); at the end its
    containers, networks and iptables chains are removed (remove_leftovers)."""
    names: list[str] = []

    def named(prefix: str) -> str:
        names.append(f"{prefix}-{uuid.uuid4().hex[:8]}")
        return names[-1]

    yield named  # type: ignore[misc]
    for name in names:
        remove_leftovers(name)
