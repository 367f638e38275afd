"""The app proxy's connections to the apps (sessions.serving.proxy): an httpcore network backend on
asyncio's own transports, through httpcore's public interface for one (`httpcore.AsyncNetworkBackend`
and `AsyncNetworkStream`'s methods, as its docs' "Network backends" describe them).

httpcore's own asyncio backend goes through anyio, whose stream copies and re-slices each piece
asyncio read and enters an error-mapping context manager and a cancel scope (`fail_after`, asking
sniffio for the loop) per read: 10-15 % of the console's samples in a proxied download (issue 35.3).
Here the socket's pieces are handed to httpcore as asyncio's transport read them (one recv each,
up to 256 KiB), joined only where several wait and fit one read, and a read that waits awaits one
future. The app's side is read ahead up to BUFFER_BYTES, then its socket is no longer read until
the proxy has taken its pieces (asyncio's pause_reading: the app's sends then wait in the kernel).

Errors are httpcore's, as its backends raise them: ConnectError/ConnectTimeout (nothing was sent),
ReadError/ReadTimeout, WriteError/WriteTimeout; a read at the end of the stream gives b"".
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from typing import Any

BUFFER_BYTES = 1024 * 1024  # what is read ahead of the proxy from an app's socket at most


class AppStream(asyncio.Protocol):
    """One connection to an app (httpcore.AsyncNetworkStream's methods): asyncio's transport's
    pieces queued as they arrive, read by httpcore one (or several joined) at a time."""

    def __init__(self) -> None:
        self._pieces: deque[bytes] = deque()
        self._size = 0  # bytes in _pieces
        self._transport: asyncio.Transport | None = None
        self._ended = False  # the app closed its side (or the connection was lost)
        self._error: BaseException | None = None  # why the connection was lost, where it broke
        self._reading_paused = False
        self._waiter: asyncio.Future[None] | None = None  # a read waiting for data
        self._drained: asyncio.Future[None] | None = None  # a write waiting for the kernel to take more

    # asyncio.Protocol's side

    def connection_made(self, transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._pieces.append(data)
        self._size += len(data)
        if self._size >= BUFFER_BYTES and not self._reading_paused and self._transport is not None:
            self._reading_paused = True
            self._transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._ended = True
        self._wake()
        return False  # the transport closes itself: the proxy never writes after the app's end

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended = True
        self._error = exc
        self._wake()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def pause_writing(self) -> None:
        if self._drained is None or self._drained.done():
            self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # httpcore.AsyncNetworkStream's side

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        """The next bytes from the app, at most `max_bytes`; b"" at the end. Raises
        httpcore.ReadError (the connection broke), httpcore.ReadTimeout."""
        if not self._pieces:
            if self._ended:
                return self._end()
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                if timeout is None:
                    await waiter
                else:
                    async with asyncio.timeout(timeout):
                        await waiter
            except TimeoutError as exc:
                import httpcore

                raise httpcore.ReadTimeout(exc) from exc
            finally:
                self._waiter = None
            if not self._pieces:
                return self._end()
        data = self._take(max_bytes)
        if self._reading_paused and self._size < BUFFER_BYTES // 2 and self._transport is not None:
            self._reading_paused = False
            self._transport.resume_reading()
        return data

    def _take(self, max_bytes: int) -> bytes:
        pieces = self._pieces
        first = pieces.popleft()
        if len(first) > max_bytes:
            pieces.appendleft(first[max_bytes:])
            first = first[:max_bytes]
        elif pieces and len(first) + len(pieces[0]) <= max_bytes:  # several wait: one read, one pass of the parsers
            taken = [first]
            room = max_bytes - len(first)
            while pieces and len(pieces[0]) <= room:
                room -= len(pieces[0])
                taken.append(pieces.popleft())
            first = b"".join(taken)
        self._size -= len(first)
        return first

    def _end(self) -> bytes:
        if self._error is not None:
            import httpcore

            raise httpcore.ReadError(str(self._error) or type(self._error).__name__) from self._error
        return b""

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        """Send `buffer` to the app, waiting while asyncio's write buffer is full. Raises
        httpcore.WriteError (the connection is closed or broke), httpcore.WriteTimeout."""
        import httpcore

        transport = self._transport
        if transport is None or transport.is_closing() or self._error is not None:
            raise httpcore.WriteError("the connection to the app is closed")
        if not buffer:
            return
        transport.write(buffer)
        drained = self._drained
        if drained is None or drained.done():
            return
        try:
            if timeout is None:
                await asyncio.shield(drained)
            else:
                async with asyncio.timeout(timeout):
                    await asyncio.shield(drained)
        except TimeoutError as exc:
            raise httpcore.WriteTimeout(exc) from exc
        if self._error is not None:
            raise httpcore.WriteError(str(self._error) or type(self._error).__name__) from self._error

    async def aclose(self) -> None:
        if self._transport is not None:
            self._transport.close()

    async def start_tls(self, ssl_context, server_hostname=None, timeout=None):
        import httpcore

        raise httpcore.UnsupportedProtocol("apps are reached by plain HTTP (the proxy's own connections)")

    def get_extra_info(self, info: str) -> Any:
        """`is_readable`: whether the app sent something (or closed) while the connection was idle,
        which httpcore's pool asks before it uses a kept connection again; "socket", "client_addr",
        "server_addr" as httpcore's backends answer them; None else (no "ssl_object": no TLS)."""
        if info == "is_readable":
            return bool(self._pieces) or self._ended
        transport = self._transport
        if transport is None:
            return None
        if info == "socket":
            return transport.get_extra_info("socket")
        if info == "client_addr":
            return transport.get_extra_info("sockname")
        if info == "server_addr":
            return transport.get_extra_info("peername")
        return None


class AsyncioBackend:
    """An httpcore network backend (httpcore.AsyncNetworkBackend's three methods) whose streams are
    AppStream, on the running asyncio loop."""

    async def connect_tcp(self, host: str, port: int, timeout=None, local_address=None, socket_options=None) -> AppStream:
        loop = asyncio.get_running_loop()
        local = (local_address, 0) if local_address else None
        transport = await _connected(loop.create_connection(AppStream, host, port, local_addr=local), timeout)
        return _with_options(transport, socket_options)

    async def connect_unix_socket(self, path: str, timeout=None, socket_options=None) -> AppStream:
        loop = asyncio.get_running_loop()
        transport = await _connected(loop.create_unix_connection(AppStream, path), timeout)
        return _with_options(transport, socket_options)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


async def _connected(connecting, timeout: float | None) -> asyncio.BaseTransport:
    import httpcore

    try:
        async with asyncio.timeout(timeout):
            transport, _ = await connecting
    except TimeoutError as exc:
        raise httpcore.ConnectTimeout(exc) from exc
    except OSError as exc:
        raise httpcore.ConnectError(exc) from exc
    return transport


def _with_options(transport: asyncio.BaseTransport, socket_options) -> AppStream:
    stream = transport.get_protocol()
    assert isinstance(stream, AppStream)
    sock: socket.socket | None = transport.get_extra_info("socket")
    for option in socket_options or ():
        if sock is not None:
            sock.setsockopt(*option)
    return stream
