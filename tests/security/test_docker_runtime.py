"""Attacks from inside a docker-runtime session (issue 31.5 and "Done when"): each test does what an
untrusted user's code would try and FAILS if the attack succeeds. Real Docker Engine, containers
configured exactly as the agent configures them (DockerRuntime.container_config), the test image
of tests/images/build.sh, network "outbound" with its iptables chain (agent.network).

A probe that a connection attempt uses: it prints "connected" or "blocked <why>" within 2 s."""

from __future__ import annotations

import socket
import uuid

import pytest

from tests.stack import ROOT, wait_until
from tests.test_docker_network import outbound  # noqa: F401 (fixture)

pytestmark = pytest.mark.docker
PROBE = ("python3 -c 'import socket,sys\ns=socket.socket(); s.settimeout(2)\ntry:\n s.connect((sys.argv[1], int(sys.argv[2])))"
         "\n print(\"connected\")\nexcept OSError as e:\n print(\"blocked\", e)' {host} {port}")


@pytest.fixture
def sessions(outbound):
    """test_docker_network's outbound runtime, its rules in place (else these attacks prove nothing)."""
    assert outbound.runtime.session_network.guarded, outbound.runtime.network_warning
    return outbound


def run_in(container, command: str) -> str:
    """`command` in the session's container as its user; its output (stdout and stderr)."""
    result = container.exec_run(["/bin/sh", "-c", command], user=container.attrs["Config"]["User"])
    return result.output.decode(errors="replace")


def address_of(sessions, container) -> str:
    return container.attrs["NetworkSettings"]["Networks"][sessions.runtime.session_network.names.network]["IPAddress"]


def gateway_of(sessions) -> str:
    network = sessions.runtime.client.networks.get(sessions.runtime.session_network.names.network)
    return network.attrs["IPAM"]["Config"][0]["Gateway"]


def host_addresses() -> list[str]:
    """This host's own non-loopback IPv4 addresses (where its services listen on 0.0.0.0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: the kernel picks the source address
            return [s.getsockname()[0]]
        except OSError:
            return []


def test_a_session_cannot_connect_to_another_sessions_listener(sessions):
    listener = sessions.start("victim", "exec python3 -m http.server 8000 --bind 0.0.0.0")
    attacker = sessions.start("attacker", "sleep 300")
    victim = address_of(sessions, listener)
    wait_until(lambda: "connected" in run_in(listener, PROBE.format(host="127.0.0.1", port=8000)), timeout=30,
               what="the victim's server to listen (seen from inside it)")

    seen = run_in(attacker, PROBE.format(host=victim, port=8000))
    assert "blocked" in seen and "connected" not in seen, seen


@pytest.mark.parametrize("where", ["gateway", "host"])
def test_a_session_cannot_connect_to_a_service_of_the_host(sessions, where):
    """A listener on 0.0.0.0 of the node stands for Redis, PostgreSQL, the web and the agent's relay."""
    with socket.socket() as service:
        service.bind(("0.0.0.0", 0))
        service.listen()
        port = service.getsockname()[1]
        targets = [gateway_of(sessions)] if where == "gateway" else host_addresses()
        assert targets, "this host has no non-loopback address to try"
        attacker = sessions.start("attacker", "sleep 300")
        for target in targets:
            seen = run_in(attacker, PROBE.format(host=target, port=port))
            assert "blocked" in seen and "connected" not in seen, (target, seen)


def test_a_session_cannot_reach_the_cloud_metadata_address(sessions):
    attacker = sessions.start("attacker", "sleep 300")
    seen = run_in(attacker, PROBE.format(host="169.254.169.254", port=80))
    assert "blocked" in seen and "connected" not in seen, seen


def test_a_session_is_not_root_has_no_capabilities_and_no_docker_socket(sessions):
    attacker = sessions.start("attacker", "sleep 300")
    assert run_in(attacker, "id -u").strip() != "0"
    cap_eff = run_in(attacker, "grep CapEff /proc/self/status").split()
    assert cap_eff == ["CapEff:", "0000000000000000"], cap_eff
    seen = run_in(attacker, "ls -l /var/run/docker.sock /run/docker.sock 2>&1; echo end")
    assert seen.count("No such file or directory") == 2, seen


def test_a_session_cannot_read_the_hosts_files_only_its_home(sessions, tmp_path):
    secret = tmp_path / f"host-secret-{uuid.uuid4().hex[:6]}.txt"
    secret.write_text("node secret\n")
    secret.chmod(0o644)  # readable by anyone on the host: only the mount namespace keeps it out
    attacker = sessions.start("attacker", "sleep 300")
    seen = run_in(attacker, f"cat {secret} {ROOT}/console/settings.py /etc/shadow 2>&1; ls /home; echo end")
    assert "node secret" not in seen and "SECRET_KEY" not in seen and "root:" not in seen, seen
    assert seen.split()[-2:] == ["work", "end"], seen


def test_a_session_sees_only_its_own_processes(sessions):
    attacker = sessions.start("attacker", "sleep 300")
    processes = run_in(attacker, "ps -e -o pid=,comm=").split("\n")
    names = {line.split()[1] for line in processes if line.strip()}
    assert names <= {"docker-init", "sleep", "sh", "ps"}, processes
    assert run_in(attacker, "cat /proc/1/comm").strip() == "docker-init"
