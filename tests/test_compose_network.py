"""compose's path to a session's app (compose.yaml, deploy/agent.toml; issue 31.4, 31.5), with real
Docker Engine, real containers of the test image and this machine's iptables. compose runs the agent
in the host's network namespace with the docker runtime's `outbound` network and `app-relay` on the
gateway of the stack's network; the web, on the stack's network, reaches apps through that relay.

Here the test process is that agent (it runs in the host's namespace, as root, as compose's agent
does), a bridge network of the test's own with a subnet of its own stands for the stack's network
(compose fixes 10.213.77.0/24; the test takes a free 10.213.N.0/24), and a container on it for the
web. The web container reads the session's app through the relay on the gateway; the session reaches
neither the relay nor the web container. Everything made is removed at the end."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from protocol.app_relay import RELAY_KEY, relay_hello
from tests.test_agent_runtime import start_spec
from tests.test_docker_runtime import RELAYED_APP, app_answer, relay_agent, run_removing
from tests.test_docker_runtime import docker_client, test_image  # noqa: F401 (fixtures)

pytestmark = pytest.mark.docker
SUBNETS = [f"10.213.{n}.0/24" for n in range(100, 160)]  # the stand-in's subnet: the first that Docker has free
LABEL = "fgpu.test"
CONNECT = ("import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)\n"
           "    print('connected')\nexcept OSError as exc:\n    print('refused', exc)\n")
# A GET through an agent's relay as the web makes it: the relay's proof first (protocol.app_relay), argv[3].
FETCH = ("import socket, sys\ns = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)\n"
         "s.sendall(sys.argv[3].encode() + b'GET /hello.txt HTTP/1.0\\r\\n\\r\\n')\nout = b''\n"
         "while (chunk := s.recv(65536)):\n    out += chunk\nprint(out.split(b'\\r\\n\\r\\n', 1)[-1].decode().strip())\n")


@pytest.fixture
def stack_network(docker_client):  # noqa: F811 (the fixture imported above)
    """(the network, its gateway): a bridge network as compose's default one, with the first subnet of
    SUBNETS that no network of this host holds; removed at the end."""
    import docker

    name = f"fgpu-test-stack-{uuid.uuid4().hex[:8]}"
    for subnet in SUBNETS:
        gateway = subnet.replace(".0/24", ".1")
        pool = docker.types.IPAMPool(subnet=subnet, gateway=gateway)
        try:
            network = docker_client.networks.create(name, driver="bridge", ipam=docker.types.IPAMConfig(pool_configs=[pool]),
                                                    labels={LABEL: "compose-network"})
            break
        except docker.errors.APIError as exc:
            if "overlap" not in str(exc).lower():
                raise
    else:
        pytest.fail(f"no subnet of {SUBNETS[0]} … {SUBNETS[-1]} is free on this host")
    try:
        yield network, gateway
    finally:
        for container in docker_client.containers.list(all=True, filters={"label": f"{LABEL}={name}"}):
            container.remove(force=True)
        network.remove()


def test_the_web_on_the_stacks_network_reaches_a_sessions_app_through_the_relay_on_its_gateway_and_the_session_neither(
        tmp_path, docker_client, test_image, stack_network):  # noqa: F811
    network, gateway = stack_network
    node = f"compose-node-{uuid.uuid4().hex[:8]}"
    web = docker_client.containers.run(test_image, ["python3", "-m", "http.server", "8000"], detach=True,
                                       network=network.name, labels={LABEL: network.name})
    web.reload()
    web_address = web.attrs["NetworkSettings"]["Networks"][network.name]["IPAddress"]

    def run_in(container, *argv: str) -> str:
        exit_code, output = container.exec_run(list(argv))
        return output.decode().strip()

    async def main():
        # deploy/agent.toml: network "outbound", app-relay on the stack network's gateway
        h = await relay_agent(tmp_path, docker_client, test_image, node, runtimes, network="outbound", app_address=gateway)
        try:
            assert runtimes[0].session_network.guarded, runtimes[0].network_warning
            session_id = await h.start_session(start_spec())
            answer = await app_answer(h, session_id, RELAYED_APP)
            assert answer["type"] == "app.ready", answer
            proof = relay_hello(answer[RELAY_KEY], node=node, session_id=session_id, app=RELAYED_APP["name"]).decode()
            fetched = await asyncio.to_thread(run_in, web, "python3", "-c", FETCH, answer["host"], str(answer["port"]), proof)
            session = h.agent.sessions[session_id].process.container
            to_relay = await asyncio.to_thread(run_in, session, "python3", "-c", CONNECT, answer["host"], str(answer["port"]))
            to_web = await asyncio.to_thread(run_in, session, "python3", "-c", CONNECT, web_address, "8000")
            return answer, fetched, to_relay, to_web
        finally:
            await h.agent.shutdown()

    runtimes: list = []
    answer, fetched, to_relay, to_web = run_removing(main, docker_client, node, runtimes)

    assert answer["host"] == gateway and answer["port"] != 8000  # the relay, on the stack network's gateway
    assert fetched == "relayed", fetched  # the web container read the session's app through it
    assert to_relay.startswith("refused"), f"the session reached the relay on the host: {to_relay}"
    assert to_web.startswith("refused"), f"the session reached a container of the stack: {to_web}"
