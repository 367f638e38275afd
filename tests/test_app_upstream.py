"""The app proxy's connections to apps (sessions/serving/upstream.py), on loopback: the bytes as the
app sent them, b"" at its end, httpcore's errors where it breaks or cannot be reached, reading ahead
of the proxy bounded, and a kept connection that the app closed seen as such by httpcore's pool."""

from __future__ import annotations

import asyncio
import socket
import struct

import httpcore
import pytest

from sessions.serving import upstream
from sessions.serving.upstream import AsyncioBackend
from tests.stack import wait_until_async


async def _server(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _read_all(stream, max_bytes: int) -> list[bytes]:
    pieces = []
    while piece := await stream.read(max_bytes):
        pieces.append(piece)
    return pieces


def test_a_stream_reads_what_the_app_sent_in_pieces_no_larger_than_asked_and_empty_bytes_at_its_end():
    payload = bytes(range(256)) * 4096  # 1 MiB

    async def run():
        async def app(reader, writer):
            writer.write(payload)
            await writer.drain()
            writer.close()

        server, port = await _server(app)
        async with server:
            stream = await AsyncioBackend().connect_tcp("127.0.0.1", port, timeout=5)
            pieces = await _read_all(stream, 100_000)
            assert await stream.read(100_000) == b""  # the end, again
            await stream.aclose()
        return pieces

    pieces = asyncio.run(run())
    assert b"".join(pieces) == payload
    assert max(len(piece) for piece in pieces) <= 100_000


def test_pieces_that_wait_together_are_read_as_one():
    async def run():
        done = asyncio.Event()

        async def app(reader, writer):
            for _ in range(8):
                writer.write(b"a" * 1000)
                await writer.drain()
                await asyncio.sleep(0)  # noqa: TID251 - a loop turn between pieces is what the test sends
            await done.wait()
            writer.close()

        server, port = await _server(app)
        async with server:
            stream = await AsyncioBackend().connect_tcp("127.0.0.1", port, timeout=5)
            # all eight arrived (one loop turn a piece at most)
            await wait_until_async(lambda: stream._size >= 8000, timeout=10, interval=0.01, what="the eight pieces")
            first = await stream.read(1_000_000)
            done.set()
            await stream.aclose()
        return first

    assert asyncio.run(run()) == b"a" * 8000


def test_a_connection_the_app_resets_raises_httpcores_read_error():
    async def run():
        async def app(reader, writer):
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
            writer.transport.abort()

        server, port = await _server(app)
        async with server:
            stream = await AsyncioBackend().connect_tcp("127.0.0.1", port, timeout=5)
            await stream.write(b"GET / HTTP/1.1\r\n\r\n")
            with pytest.raises(httpcore.ReadError):
                await _read_all(stream, 65536)
            with pytest.raises(httpcore.WriteError):
                await stream.write(b"more")

    asyncio.run(run())


def test_an_address_nothing_listens_on_raises_httpcores_connect_error():
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(httpcore.ConnectError):
            asyncio.run(AsyncioBackend().connect_tcp("127.0.0.1", port, timeout=5))


def test_a_read_with_a_timeout_raises_httpcores_read_timeout():
    async def run():
        hold = asyncio.Event()

        async def app(reader, writer):
            await hold.wait()
            writer.close()

        server, port = await _server(app)
        async with server:
            stream = await AsyncioBackend().connect_tcp("127.0.0.1", port, timeout=5)
            with pytest.raises(httpcore.ReadTimeout):
                await stream.read(100, timeout=0.05)
            hold.set()
            assert await stream.read(100) == b""
            await stream.aclose()

    asyncio.run(run())


def test_the_stream_reads_no_further_ahead_of_the_proxy_than_its_buffer():
    """An app sending 16 MiB to a proxy that does not read: the stream holds at most BUFFER_BYTES
    and one more piece (asyncio's recv size); the rest waits in the kernel and in the app."""
    sent = 16 * 1024 * 1024

    async def run():
        async def app(reader, writer):
            writer.write(b"z" * sent)
            await writer.drain()
            writer.close()

        server, port = await _server(app)
        async with server:
            stream = await AsyncioBackend().connect_tcp("127.0.0.1", port, timeout=5)
            held = []
            for _ in range(50):  # the loop turns while the app sends what the kernel takes
                await asyncio.sleep(0.01)  # noqa: TID251 - the read-ahead sampled every 10 ms as the app sends
                held.append(stream._size)
            got = sum(len(piece) for piece in await _read_all(stream, 256 * 1024))
            await stream.aclose()
        return max(held), got

    most, got = asyncio.run(run())
    assert got == sent
    assert most <= upstream.BUFFER_BYTES + 256 * 1024, most


def test_a_kept_connection_the_app_closed_is_readable_so_httpcores_pool_does_not_use_it_again():
    async def run():
        closed = asyncio.Event()

        async def app(reader, writer):
            writer.close()
            closed.set()

        server, port = await _server(app)
        async with server:
            stream = await AsyncioBackend().connect_tcp("127.0.0.1", port, timeout=5)
            assert stream.get_extra_info("server_addr")[1] == port
            await closed.wait()
            await wait_until_async(lambda: stream.get_extra_info("is_readable"), timeout=5, interval=0.01, what="readable")
            readable = stream.get_extra_info("is_readable")
            await stream.aclose()
        return readable

    assert asyncio.run(run()) is True


def test_httpcores_pool_on_the_backend_gets_an_apps_answer_on_a_kept_connection():
    async def run():
        connections = []

        async def app(reader, writer):
            connections.append(writer)
            while True:
                try:
                    await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 300000\r\n\r\n" + b"y" * 300_000)
                await writer.drain()

        server, port = await _server(app)
        async with server:
            async with httpcore.AsyncConnectionPool(network_backend=AsyncioBackend()) as pool:
                bodies = []
                for _ in range(2):
                    response = await pool.request("GET", f"http://127.0.0.1:{port}/")
                    bodies.append(response.content)
            for writer in connections:
                writer.close()
        return bodies, len(connections)

    bodies, connections = asyncio.run(run())
    assert bodies == [b"y" * 300_000] * 2 and connections == 1
