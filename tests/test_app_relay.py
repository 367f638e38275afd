"""The app relay's proof (protocol/app_relay.py, issue 37.2) and the web's side that writes it
(sessions/serving/relay_connect.py), without a network: what the agent accepts and refuses, and
that the web's connections to a relay, and only those, start with the proof. The relay itself, on
a real container, is tests/test_docker_runtime.py's; across hosts, tests/multihost."""
from __future__ import annotations

import asyncio
import time

import pytest

from protocol.app_relay import RelayGuard, RelayRefused, relay_hello, relay_key
from sessions.serving.relay_connect import RELAYS, RelayBackend, RelayProof, relay_remember, relay_socket

NODE, SESSION, APP = "gpu-1", "6f1c7e44-1f49-4f4f-a7a1-0d9d3c8a1b2c", "jupyterlab"


def guard(**kwargs) -> RelayGuard:
    return RelayGuard.for_node(node=NODE, node_key="k" * 43, **kwargs)


def test_a_fresh_proof_under_the_nodes_key_is_taken_once():
    key = relay_key("k" * 43)
    line = relay_hello(key, node=NODE, session_id=SESSION, app=APP)
    checked = guard()
    checked.check(line, session_id=SESSION, app=APP)
    with pytest.raises(RelayRefused, match="used already"):
        checked.check(line, session_id=SESSION, app=APP)


KEY = relay_key("k" * 43)


@pytest.mark.parametrize(("line", "why"), [  # each made when the test runs (`now`: the clock then)
    (lambda now: b"", "no relay proof"),
    (lambda now: b"GET / HTTP/1.1\r\n", "no relay proof"),
    (lambda now: relay_hello("k" * 43, node=NODE, session_id=SESSION, app=APP), "does not verify"),  # the node key itself
    (lambda now: relay_hello(relay_key("other"), node=NODE, session_id=SESSION, app=APP), "does not verify"),
    (lambda now: relay_hello(KEY, node="gpu-2", session_id=SESSION, app=APP), "does not verify"),
    (lambda now: relay_hello(KEY, node=NODE, session_id=SESSION, app="tensorboard"), "does not verify"),
    (lambda now: relay_hello(KEY, node=NODE, session_id=SESSION, app=APP, now=now - 120), "stale"),
    (lambda now: relay_hello(KEY, node=NODE, session_id=SESSION, app=APP, now=now + 120), "stale"),
], ids=["empty", "http", "node-key", "other-key", "other-node", "other-app", "old", "future"])
def test_a_connection_without_a_valid_fresh_proof_for_this_app_is_refused(line, why):
    with pytest.raises(RelayRefused, match=why):
        guard().check(line(time.time()), session_id=SESSION, app=APP)


def test_a_node_without_a_key_has_a_random_relay_key_that_its_answers_carry_and_one_with_a_key_never_tells_it():
    keyless, other = RelayGuard.for_node(node=NODE, node_key=""), RelayGuard.for_node(node=NODE, node_key="")
    assert len(keyless.key) == 64 and keyless.key != other.key
    assert keyless.answer_fields() == {"relayed": True, "relay_key": keyless.key}
    assert guard().answer_fields() == {"relayed": True}


class Stream:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    async def write(self, data: bytes, timeout=None) -> None:
        self.written.append(data)

    async def aclose(self) -> None:
        self.closed = True


class Inner:
    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        return Stream()


def test_the_webs_connections_to_a_relay_and_only_those_start_with_its_proof():
    key = relay_key("k" * 43)
    relay_remember("10.0.0.5", 40000, RelayProof(key=key, node=NODE, session_id=SESSION, app=APP))
    relay_remember("172.17.0.2", 8888, None)
    try:
        backend = RelayBackend(Inner())
        to_relay = asyncio.run(backend.connect_tcp("10.0.0.5", 40000))
        direct = asyncio.run(backend.connect_tcp("172.17.0.2", 8888))
        assert len(to_relay.written) == 1 and direct.written == []
        guard().check(to_relay.written[0], session_id=SESSION, app=APP)
        assert asyncio.run(relay_socket("172.17.0.2", 8888, timeout=1)) is None  # not a relay: websockets connects
        relay_remember("10.0.0.5", 40000, None)  # the address is an app's own now: no proof
        assert ("10.0.0.5", 40000) not in RELAYS
    finally:
        RELAYS.pop(("10.0.0.5", 40000), None)
        RELAYS.pop(("172.17.0.2", 8888), None)
