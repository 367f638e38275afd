"""The app relay's proof (protocol/app_relay.py, issue 37.2) and the web's side that writes it
(sessions/serving/relay_connect.py), without a network: what the agent accepts and refuses, and
that the web's connections to a relay, and only those, start with the proof; and, on loopback, a
real relay that refuses the web's old key gets the request again under the agent's new one. The
relay itself, on a real container, is tests/test_docker_runtime.py's; across hosts, tests/multihost;
a real agent restarted, tests/test_session_apps_e2e.py's."""

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


@pytest.mark.parametrize(
    ("line", "why"),
    [  # each made when the test runs (`now`: the clock then)
        (lambda now: b"", "no relay proof"),
        (lambda now: b"GET / HTTP/1.1\r\n", "no relay proof"),
        (lambda now: relay_hello("k" * 43, node=NODE, session_id=SESSION, app=APP), "does not verify"),  # the node key itself
        (lambda now: relay_hello(relay_key("other"), node=NODE, session_id=SESSION, app=APP), "does not verify"),
        (lambda now: relay_hello(KEY, node="gpu-2", session_id=SESSION, app=APP), "does not verify"),
        (lambda now: relay_hello(KEY, node=NODE, session_id=SESSION, app="tensorboard"), "does not verify"),
        (lambda now: relay_hello(KEY, node=NODE, session_id=SESSION, app=APP, now=now - 120), "stale"),
        (lambda now: relay_hello(KEY, node=NODE, session_id=SESSION, app=APP, now=now + 120), "stale"),
    ],
    ids=["empty", "http", "node-key", "other-key", "other-node", "other-app", "old", "future"],
)
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


async def _restarted_agents_relay(*, node: str, session: str, target, refused: list, asked: list):
    """A keyless node's agent restarted: its relay (agent.session_apps.relay_pipe, on a new port) to
    the app at `target` under a new random key, turning away (into `refused`) the proof lines it does
    not take; the agent answering the web's `pty.app_status` (its type into `asked`) with that relay
    and key; and the web still remembering the old key for the relay's address. Returns (the relay's
    server, its port, the answering task)."""
    from channels.layers import get_channel_layer

    from agent.session_apps import relay_pipe
    from protocol.channel import AgentLink
    from sessions.serving import session_apps

    new, old = RelayGuard.for_node(node=node, node_key=""), RelayGuard.for_node(node=node, node_key="")

    def proof(line: bytes) -> None:
        try:
            new.check(line, session_id=session, app="echo")
        except RelayRefused:
            refused.append(line)
            raise

    relay = await asyncio.start_server(lambda r, w: relay_pipe(r, w, target, proof=proof, node=node), "127.0.0.1", 0)
    port = relay.sockets[0].getsockname()[1]

    async def agent() -> None:
        layer = get_channel_layer()
        channel = await layer.new_channel("h8-agent.")
        await layer.group_add(AgentLink(node=node, key="").pty_group(session), channel)
        while True:
            message = await layer.receive(channel)
            asked.append(message["type"])
            await layer.send(
                message["reply_channel"],
                {"type": "app.status", "running": True, "host": "127.0.0.1", "port": port, **new.answer_fields()},
            )

    answering = asyncio.create_task(agent())
    session_apps.APP_TARGETS[(session, "echo")] = ("127.0.0.1", port, time.monotonic() + 600)
    relay_remember("127.0.0.1", port, RelayProof(key=old.key, node=node, session_id=session, app="echo"))
    return relay, port, answering


@pytest.mark.django_db(transaction=True)  # the proxy's check reads on Channels' database thread
@pytest.mark.parametrize("size", [0, 100_000], ids=["get", "post"])
def test_a_relay_that_refuses_the_webs_old_key_on_the_same_address_gets_the_request_again_under_the_agents_new_one(
    settings, alices_session, alice, monkeypatch, size
):
    """A keyless node's agent restarted: its new relay (a real one: agent.session_apps.relay_pipe
    under a new random key) listens where the web still remembers the old relay, with the old key.
    The relay closes the web's connection at its proof, before a byte reaches the app; the proxy asks
    the agent again (its answer on the channel layer: the new key), and sends the request again, its body
    too (the part it kept, up to proxy.REPLAY_BYTES, then the rest as the browser sends it): the
    browser gets the app's answer, not a 502, and the app the body once."""
    from asgiref.sync import async_to_sync
    from django.core.cache import cache

    from sessions.serving import proxy, session_apps
    from tests.test_app_origin import _apps_request, _proxy_answer

    scope, session = _apps_request(settings, alices_session, alice)
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    if size:
        scope = {**scope, "method": "POST", "headers": [*scope["headers"], (b"content-length", str(size).encode())]}
    cache.set(session_apps.TOKEN_KEY.format(session=session, app="echo"), "app-token")
    node = alices_session.node.name
    asked, refused, received = [], [], []

    async def app(reader, writer):  # the app in the session: one answer per connection, after the body
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0
        )
        received.append(await reader.readexactly(length))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\nconnection: close\r\n\r\nhello\n")
        await writer.drain()
        writer.close()

    async def get() -> tuple[int, bytes]:
        app_server = await asyncio.start_server(app, "127.0.0.1", 0)
        target = app_server.sockets[0].getsockname()[:2]
        relay, port, answering = await _restarted_agents_relay(
            node=node, session=session, target=target, refused=refused, asked=asked
        )
        pieces = [body[at : at + 65536] for at in range(0, len(body), 65536)] or [b""]  # as the server hands it over
        try:
            answer = await _proxy_answer(scope, pieces)
        finally:
            answering.cancel()
            relay.close()
            app_server.close()
            RELAYS.pop(("127.0.0.1", port), None)
            session_apps.APP_TARGETS.pop((session, "echo"), None)
            await proxy._pools.pop(id(asyncio.get_running_loop())).aclose()
        return answer["status"], answer["body"]

    assert async_to_sync(get)() == (200, b"hello\n")
    assert len(refused) == 1 and asked == ["pty.app_status"]  # the old key once, then the agent asked once
    assert received == [body]  # the app got the body once, whole


@pytest.mark.django_db(transaction=True)
def test_a_websocket_to_a_relay_that_refuses_the_webs_old_key_is_opened_under_the_agents_new_one(settings, alices_session, alice):
    """As above, for a websocket before the browser's is accepted: the relay closes the web's
    connection at its proof, the agent is asked again, and the websocket opens through the relay."""
    from asgiref.sync import async_to_sync
    from django.core.cache import cache
    from websockets.asyncio.server import serve

    from sessions.serving import proxy, session_apps
    from tests.test_app_origin import _apps_request

    scope, session = _apps_request(settings, alices_session, alice)
    scope = {**scope, "type": "websocket", "scheme": "ws", "path": f"/sessions/{session}/apps/echo/ws", "subprotocols": []}
    cache.set(session_apps.TOKEN_KEY.format(session=session, app="echo"), "app-token")
    node = alices_session.node.name
    asked, refused = [], []

    async def echo(connection):  # the app in the session: its websocket echoes
        async for text in connection:
            await connection.send(text)

    async def talk() -> list[dict]:
        async with serve(echo, "127.0.0.1", 0) as app_server:
            target = next(iter(app_server.sockets)).getsockname()[:2]
            relay, port, answering = await _restarted_agents_relay(
                node=node, session=session, target=target, refused=refused, asked=asked
            )
            inbox: asyncio.Queue = asyncio.Queue()
            for message in ({"type": "websocket.connect"}, {"type": "websocket.receive", "text": "ping"}):
                inbox.put_nowait(message)
            sent: list[dict] = []

            async def send(message):
                sent.append(message)
                if message["type"] == "websocket.send":
                    inbox.put_nowait({"type": "websocket.disconnect", "code": 1000})

            try:
                await asyncio.wait_for(proxy.AppWebsocketProxy()(dict(scope), inbox.get, send), timeout=30)
            finally:
                answering.cancel()
                relay.close()
                RELAYS.pop(("127.0.0.1", port), None)
                session_apps.APP_TARGETS.pop((session, "echo"), None)
            return sent

    sent = async_to_sync(talk)()
    assert [m["type"] for m in sent[:2]] == ["websocket.accept", "websocket.send"] and sent[1]["text"] == "ping", sent
    assert len(refused) == 1 and asked == ["pty.app_status"]
