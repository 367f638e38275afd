"""A request body read by the view as it arrives (issue 35.3: the files API's upload), not held
whole by Django's ASGI handler before the view runs.

Django's handler reads a whole body into a temporary file (memory, then disk) before any view runs:
an upload of 100 MB was received whole, written to disk and read back before a byte went on to the
session's agent. `StreamedBody` (ASGI middleware in front of Django, behind console.upload_guard,
which has already checked the caller and the declared size) hands Django an empty body at once on
the paths it is given, and the request's `scope[BODY_KEY]` the real one: a `RequestBody` the view
reads piece by piece as the server receives it, so that the body goes on while it arrives.

Django's own disconnect watch (it awaits `receive()` while the view runs) sees the client go away
when the view's reads do. A body the view leaves unread (it refused the request first) is read
and dropped before its answer is sent, as Django's handler read it before the view: a client that
sends its whole body before it reads the answer gets the answer, and a body cut off past its
limit (console.upload_guard) is answered 413 as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

BODY_KEY = "fgpu.request_body"  # where the scope carries the RequestBody (sessions.api.files reads it)


class RequestBody:
    """A request's body as the server hands it over: `await read(n)` returns the next at most `n`
    bytes as soon as some arrived (b"" at the end); raises ConnectionAbortedError when the client
    went away before its end."""

    def __init__(self, receive) -> None:
        self._receive = receive
        self._held = b""
        self.ended = False  # the last piece was received, or the client went away
        self._gone: asyncio.Future | None = None

    async def read(self, n: int) -> bytes:
        while not self._held and not self.ended:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.ended = True
                self._gone_future().set_result(message)
                raise ConnectionAbortedError("the client went away during the request's body")
            self.ended = not message.get("more_body", False)
            self._held = message.get("body", b"")
        piece, self._held = self._held[:n], self._held[n:]
        return piece

    def _gone_future(self) -> asyncio.Future:
        if self._gone is None:
            self._gone = asyncio.get_running_loop().create_future()
        return self._gone

    async def disconnected(self) -> dict:
        """The `http.disconnect` message, once a read met it (waits until then)."""
        return await asyncio.shield(self._gone_future())

    async def drain(self) -> None:
        """Read what is left, dropping it."""
        try:
            while not self.ended:
                self._held = b""
                await self.read(1 << 20)
        except ConnectionAbortedError:
            pass


class StreamedBody:
    """ASGI middleware (HTTP): requests that `streamed(scope)` picks reach `app` (Django) with an
    empty body and the real one as `scope[BODY_KEY]` (RequestBody); others pass untouched."""

    def __init__(self, app, *, streamed: Callable[[dict], bool]) -> None:
        self.app, self.streamed = app, streamed

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.streamed(scope):
            return await self.app(scope, receive, send)
        body = RequestBody(receive)
        handed = False

        async def django_receive():
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": b"", "more_body": False}
            return await body.disconnected()

        held: list[dict] = []  # what the app answered before the body's end (a refusal)

        async def held_send(message):
            if not body.ended:
                held.append(message)
                return
            while held:
                await send(held.pop(0))
            await send(message)

        try:
            await self.app({**scope, BODY_KEY: body}, django_receive, held_send)
        finally:
            await body.drain()
            while held:
                await send(held.pop(0))
