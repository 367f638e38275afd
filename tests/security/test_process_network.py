"""The process runtime's `outbound` network (issue 31, item 5), from inside a sandboxed session as
a non-administrator, with a real agent, real bubblewrap, slirp4netns and nftables: the session
reaches a package registry over HTTPS, and nothing of the node (a loopback listener and a
listener on every address of the node, both the test's own), link-local metadata or private
networks; it cannot change its rules. Each test fails if the connection it forbids is made."""

from __future__ import annotations

import socket
import threading

import pytest

from agent import sandbox as sandbox_module
from agent.boot import build_runtime
from agent.config import AgentConfigError, load_agent_config
from agent.network import SLIRP_GATEWAY, host_addresses
from tests.security.test_process_runtime import non_admin_spec, shell
from tests.test_agent_config import write_agent
from tests.test_agent_runtime import Harness, run_agent

REGISTRY = "deb.debian.org"  # what answers outside on the test machines: the package registries


class Listener:
    """A TCP listener of the test's own on the node (`host`: 127.0.0.1 or 0.0.0.0), counting what
    connects to it."""

    def __init__(self, host: str) -> None:
        self.sock = socket.create_server((host, 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def listeners():
    made = [Listener("127.0.0.1"), Listener("0.0.0.0")]
    yield made
    for listener in made:
        listener.close()


def connect(address: str, port: int, tag: str) -> str:
    """A shell command that tries a TCP connection (3 s at most) and prints `<tag>-open` when made."""
    return f'timeout 3 bash -c \'exec 3<>/dev/tcp/{address}/{port}\' 2>/dev/null && echo "{tag}-o""pen"'


def outbound(**options) -> dict:
    return {"network": "outbound", **options}


def test_an_outbound_session_reaches_a_package_registry_over_https(tmp_path):
    async def scenario(h: Harness):
        session_id = await h.start_session(non_admin_spec())
        channel = await h.watch_terminal(session_id)
        output = await shell(h, session_id, channel, connect(REGISTRY, 443, "registry"), "out")
        assert "registry-open" in output, f"the session could not reach {REGISTRY}:443: {output}"
        output = await shell(h, session_id, channel, 'echo "routes=$(grep -c tap0 /proc/net/route)"', "route")
        assert "routes=2" in output, output

    run_agent(tmp_path, scenario, runtime_options=outbound())


def test_an_outbound_session_cannot_reach_the_nodes_services_link_local_metadata_or_its_rules(tmp_path, listeners):
    loopback, everywhere = listeners
    targets = [(SLIRP_GATEWAY, loopback.port), (SLIRP_GATEWAY, everywhere.port), ("169.254.169.254", 80)]
    targets += [(address, everywhere.port) for address in host_addresses()]
    assert len(targets) > 3, "the node has no address of its own to try"

    async def scenario(h: Harness):
        session_id = await h.start_session(non_admin_spec())
        channel = await h.watch_terminal(session_id)
        for i, (address, port) in enumerate(targets):
            output = await shell(h, session_id, channel, connect(address, port, f"t{i}"), f"try{i}")
            assert f"t{i}-open" not in output, f"the session connected to {address}:{port}"
        # Its rules are its namespace's, and it has no capability there, even in a user namespace of its own.
        command = "nft flush ruleset; unshare -r nft flush ruleset; " + connect(SLIRP_GATEWAY, everywhere.port, "again")
        output = await shell(h, session_id, channel, command, "flush")
        assert "again-open" not in output, "the session removed its network rules"
        output = await shell(h, session_id, channel, connect(REGISTRY, 443, "still"), "out")
        assert "still-open" in output, output

    run_agent(tmp_path, scenario, runtime_options=outbound())
    assert loopback.accepted == 0 and everywhere.accepted == 0, "a session's connection reached the node"


@pytest.mark.parametrize("block_private", [True, False])
def test_a_private_address_the_node_gained_after_the_start_is_refused_while_private_networks_are_blocked(
    tmp_path, listeners, monkeypatch, block_private
):
    """The node's addresses are read when a session starts; one added later (Docker made a bridge)
    is kept out by the private ranges: here the node's private addresses are left out of that
    reading, and reached with block-private-networks = false (which shows the rule is what
    refuses them)."""
    everywhere = listeners[1]
    private = [a for a in host_addresses() if a.startswith(("10.", "172.", "192.168."))]
    if not private:
        pytest.skip("the node has no private address to try")
    monkeypatch.setattr(sandbox_module, "host_addresses", lambda: [a for a in host_addresses() if a not in private])

    async def scenario(h: Harness):
        session_id = await h.start_session(non_admin_spec())
        channel = await h.watch_terminal(session_id)
        output = await shell(h, session_id, channel, connect(private[0], everywhere.port, "private"), "priv")
        assert ("private-open" in output) is not block_private, output

    run_agent(tmp_path, scenario, runtime_options=outbound(block_private=block_private))
    assert (everywhere.accepted == 0) is block_private


def test_an_outbound_sessions_app_is_still_reached_through_the_agent_only(tmp_path):
    """An app listening on the session's own loopback is reached by the agent's relay (a socket
    made in the session's network namespace), with the outbound network attached."""
    server = (
        'python3 -c \'import socket; s = socket.create_server(("127.0.0.1", 8765)); print("listen" "ing", flush=True); '
        'c, _ = s.accept(); c.sendall(b"app-answer"); c.close()\' &'
    )

    async def scenario(h: Harness):
        session_id = await h.start_session(non_admin_spec())
        channel = await h.watch_terminal(session_id)
        await h.type(session_id, server + "\r")
        await h.read_until(channel, "listening")
        make_socket = h.agent.sessions[session_id].process.app_socket
        assert make_socket is not None, "the session's apps are on the node's network"
        sock = make_socket()
        try:
            sock.settimeout(5)
            sock.connect(("127.0.0.1", 8765))
            assert sock.recv(100) == b"app-answer"
        finally:
            sock.close()

    run_agent(tmp_path, scenario, runtime_options=outbound())


def test_agent_toml_gives_the_process_runtime_outbound_and_refuses_an_unknown_network(tmp_path):
    good = write_agent(tmp_path, '[container]\nnetwork = "outbound"\nblock-private-networks = false\n')
    config = load_agent_config(good)
    assert (config.runtime, config.network, config.block_private_networks) == ("process", "outbound", False)
    assert build_runtime(config).block_private is False
    bad = write_agent(tmp_path, '[container]\nnetwork = "bridge"\n', name="bad.toml")
    with pytest.raises(AgentConfigError, match="container.network"):
        load_agent_config(bad)


def test_slirp4netns_is_attached_only_once_the_sandbox_has_set_up_its_loopback(tmp_path):
    """bwrap says its init's pid before the init brings its loopback up; slirp4netns brought `lo` up
    first now and then, and bwrap's own address for it then failed the session's start."""
    from agent.sandbox import SandboxError, wait_loopback

    net = tmp_path / "42" / "net"
    net.mkdir(parents=True)
    (net / "fib_trie").write_text("")  # a new network namespace: no route yet
    with pytest.raises(SandboxError, match="loopback was not up"):
        wait_loopback(42, timeout=0.05, proc=str(tmp_path))
    (net / "fib_trie").write_text("Local:\n  +-- 127.0.0.0/8 2 0 2\n        |-- 127.0.0.1\n           /32 host LOCAL\n")
    wait_loopback(42, timeout=0.05, proc=str(tmp_path))
    wait_loopback(43, timeout=0.05, proc=str(tmp_path))  # gone: attaching says why
