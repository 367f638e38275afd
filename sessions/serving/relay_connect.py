"""The web's side of the agents' app relays (protocol.app_relay, issue 37.2): each new connection
the proxy (sessions.serving.proxy) opens to an address an agent named as its relay starts with the
relay's proof, so the relay lets it through to the app; any other address is connected to as it is.

`RELAYS` maps (host, port) → RelayProof: filled where the web learns an app's address
(sessions.serving.session_apps._remember), read at each connect: by the proxy's httpx client
through `RelayBackend` (httpcore's network backend, wrapped: it writes the line right after the TCP
connect, before httpcore writes the request) and by its websocket client through `relay_socket`
(a connected socket handed to websockets.connect).
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from typing import Any

from protocol.app_relay import relay_hello

MAX_RELAYS = 10_000  # addresses remembered at most (the oldest are dropped first)


@dataclass(frozen=True)
class RelayProof:
    """What proves a connection to the relay of `app` of `session_id` on `node`: the node's relay
    `key` (protocol.app_relay)."""

    key: str
    node: str
    session_id: str
    app: str

    def hello(self) -> bytes:
        return relay_hello(self.key, node=self.node, session_id=self.session_id, app=self.app)


RELAYS: dict[tuple[str, int], RelayProof] = {}


def relay_remember(host: str, port: int, proof: RelayProof | None) -> None:
    """`host`:`port` is `proof`'s relay (None: it is no relay, an app's own address)."""
    RELAYS.pop((host, port), None)
    if proof is None:
        return
    while len(RELAYS) >= MAX_RELAYS:
        RELAYS.pop(next(iter(RELAYS)))
    RELAYS[(host, port)] = proof


class RelayBackend:
    """An httpcore network backend (httpcore.AsyncNetworkBackend's three methods) that writes the
    relay's proof on a new connection to a relay in RELAYS; `inner`: the backend it wraps."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def connect_tcp(self, host: str, port: int, timeout=None, local_address=None, socket_options=None):
        stream = await self.inner.connect_tcp(
            host, port, timeout=timeout, local_address=local_address, socket_options=socket_options
        )
        proof = RELAYS.get((host, port))
        if proof is not None:
            try:
                await stream.write(proof.hello(), timeout=timeout)
            except BaseException:
                await stream.aclose()
                raise
        return stream

    async def connect_unix_socket(self, path: str, timeout=None, socket_options=None):
        return await self.inner.connect_unix_socket(path, timeout=timeout, socket_options=socket_options)

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


async def relay_socket(host: str, port: int, *, timeout: float) -> socket.socket | None:
    """A socket connected to `host`:`port` with the relay's proof written, where it is a relay in
    RELAYS; None where it is not (the caller connects as it would). Raises OSError, TimeoutError."""
    proof = RELAYS.get((host, port))
    if proof is None:
        return None
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        async with asyncio.timeout(timeout):
            await loop.sock_connect(sock, (host, port))
            await loop.sock_sendall(sock, proof.hello())
    except BaseException:
        sock.close()
        raise
    return sock
