"""The docker runtime's session network (issue 31.5, agent.network), with real Docker Engine, real
containers of the test image (tests/images/build.sh) and the real iptables of this machine.

Each test's agent has its own node name and instance id, so its network (`fgpu-<node>-<instance>`),
its bridge and its iptables chain (`FGPU-<instance>`) are its own; all are removed at the end, and
nothing else is touched. The attacks on it are in tests/security/test_docker_runtime.py."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from agent.config import AgentConfigError, load_agent_config
from agent.network import guard_rules, network_names
from protocol.messages import SessionId, StartSpec

pytestmark = pytest.mark.docker
TEST_IMAGE = "fgpu-session:test"


class Sessions:
    """Session containers as the docker runtime configures them (DockerRuntime.container_config),
    started detached with a command of the test's; every one removed by `close`."""

    def __init__(self, runtime, tmp_path: Path):
        self.runtime, self.tmp_path = runtime, tmp_path

    def start(self, name: str, command: str):
        work = self.tmp_path / name
        (work / ".fgpu" / "bin").mkdir(parents=True)
        spec = StartSpec(session_id=SessionId(f"{name}-{uuid.uuid4().hex[:8]}"), name=name, owner="alice", command=command,
                         cpu=1, mem=256 << 20, devices=(), image=TEST_IMAGE)
        config = self.runtime.container_config(spec=spec, argv=["/bin/sh", "-c", command], env={}, work_dir=work)
        work.chmod(0o777)
        container = self.runtime.client.containers.run(**config, detach=True)
        container.reload()
        return container

    def close(self) -> None:
        for container in self.runtime.client.containers.list(all=True, filters={"label": f"fgpu.node={self.runtime.node}"}):
            container.remove(force=True)
        self.runtime.close()  # the network and its rules, and the containers' parent cgroup (agent.limits)


def make_runtime(network: str, **options):
    import docker

    from agent.docker_runtime import DockerRuntime

    client = docker.from_env()
    try:
        client.images.get(TEST_IMAGE)
    except docker.errors.ImageNotFound:
        pytest.fail(f"image {TEST_IMAGE} is missing: run tests/images/build.sh (.ci/run does)")
    return DockerRuntime(node=f"net-{uuid.uuid4().hex[:8]}", default_image=TEST_IMAGE, network=network,
                         instance=uuid.uuid4().hex[:10], client=client, **options)


@pytest.fixture
def outbound(tmp_path):
    """A docker runtime with network "outbound", its network and rules made as at agent start."""
    runtime = make_runtime("outbound")
    sessions = Sessions(runtime, tmp_path)
    try:
        runtime.clean_up_at_start(tmp_path)
        yield sessions
    finally:
        sessions.close()


def iptables_rules() -> str:
    from agent.network import iptables_command

    command, problem = iptables_command()
    assert command, problem
    return subprocess.run([command, "-w", "5", "-S"], capture_output=True, text=True, check=True).stdout


def test_the_agent_makes_its_own_network_with_inter_container_traffic_off_and_a_chain_for_its_bridge_only(outbound):
    runtime = outbound.runtime
    names = runtime.session_network.names
    assert runtime.session_network.guarded, runtime.network_warning
    network = runtime.client.networks.get(names.network)
    assert network.attrs["Options"]["com.docker.network.bridge.enable_icc"] == "false"
    assert network.attrs["Options"]["com.docker.network.bridge.name"] == names.bridge and len(names.bridge) <= 15
    rules = iptables_rules()
    assert f"-A INPUT -i {names.bridge} -j {names.chain}" in rules
    assert f"-A DOCKER-USER -i {names.bridge} -j {names.chain}" in rules
    assert f"-A {names.chain} -m addrtype --dst-type LOCAL -j DROP" in rules
    assert f"-A {names.chain} -d 169.254.0.0/16 -j DROP" in rules

    runtime.clean_up_at_start(outbound.tmp_path)  # the agent starts again: the same rules, once each
    again = iptables_rules()
    assert again.count(f"-j {names.chain}") == 2 and again.count(f"-A {names.chain} ") == rules.count(f"-A {names.chain} ")

    assert runtime.session_network.remove()
    gone = iptables_rules()
    assert names.chain not in gone and names.bridge not in gone
    assert not runtime.client.networks.list(names=[names.network])


def test_a_session_on_the_outbound_network_answers_the_host_which_opened_the_connection(outbound):
    """Replies pass (conntrack): the web and the agent's app relay on this host reach a session's app."""
    import urllib.request

    server = outbound.start("server", "cd /home/work && echo hello > index.txt && exec python3 -m http.server 8000")
    address = server.attrs["NetworkSettings"]["Networks"][outbound.runtime.session_network.names.network]["IPAddress"]

    def fetch():
        try:
            return urllib.request.urlopen(f"http://{address}:8000/index.txt", timeout=2).read()
        except OSError:
            return None

    from tests.stack import wait_until

    assert wait_until(fetch, timeout=30, what="the session's server to answer the host") == b"hello\n"


def test_with_network_none_a_session_has_no_interface_but_lo(tmp_path):
    runtime = make_runtime("none")
    sessions = Sessions(runtime, tmp_path)
    try:
        container = sessions.start("alone", "ls /sys/class/net; sleep 30")
        from tests.stack import wait_until

        logs = wait_until(lambda: container.logs().decode().split(), timeout=20, what="the session's interfaces")
        assert logs == ["lo"]
        assert runtime.session_network is None and container.attrs["HostConfig"]["NetworkMode"] == "none"
    finally:
        sessions.close()


def test_bridge_is_the_old_name_of_outbound_and_other_names_are_refused(tmp_path):
    mock = Path(__file__).resolve().parent.parent / "demo" / "mock-accelerator.toml"

    def config(line: str):
        path = tmp_path / "agent.toml"
        path.write_text(f'[agent]\nid = "n"\n[container]\nruntime = "docker"\n{line}\n[plugins.mock]\nconfig = "{mock}"\n')
        return load_agent_config(path)

    assert config('network = "bridge"').network == "outbound"
    assert config("").network == "outbound" and config("").block_private_networks is True
    assert config('network = "none"').network == "none"
    assert config("block-private-networks = false").block_private_networks is False
    with pytest.raises(AgentConfigError, match=r'container.network: .host.: expected "outbound"'):
        config('network = "host"')
    with pytest.raises(AgentConfigError, match="container.block-private-networks: expected true or false"):
        config('block-private-networks = "no"')


def test_the_chain_lets_replies_and_dns_to_the_hosts_nameservers_through_before_it_drops():
    rules = guard_rules(subnet="172.30.0.0/16", nameservers=["10.0.0.2"], block_private=True)
    assert rules[0] == ["-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "RETURN"]
    assert rules[1:3] == [["-d", "10.0.0.2", "-p", p, "--dport", "53", "-j", "RETURN"] for p in ("udp", "tcp")]
    drops = [rule[1] for rule in rules[3:]]
    assert drops == ["addrtype", "169.254.0.0/16", "172.30.0.0/16", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
                     "100.64.0.0/10"]
    assert ["-d", "10.0.0.0/8", "-j", "DROP"] not in guard_rules(subnet="", nameservers=[], block_private=False)
    names = network_names("gpu-node-1", "0123456789")
    assert (names.network, names.bridge, names.chain) == ("fgpu-gpu-node-1-0123456789", "fgpu-0123456789", "FGPU-0123456789")
