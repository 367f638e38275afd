"""A websocket app under the console's own middleware (console.asgi: GoneClientSendsDropped, then
Channels' AuthMiddlewareStack), for tests/test_web_server.py, served by the web server under test
(`uvicorn tests.apps.backlog_app:application` or `daphne tests.apps.backlog_app:application`).

Path `/fill`: sends 64 KiB text frames to a client that does not read until the server holds some
of them for it (sessions.consumers.websocket_backlog above 0, at most 64 MiB sent), prints
`backlog N`, then sends one last frame, `{"backlog": bytes, "transport": type name}`, and waits
for the client to close: a server-side close would time out its closing handshake while the slow
client still drains the backlog, and daphne (autobahn) then aborts the connection with a reset.
Path `/gone`: waits for the client's disconnect, then sends it 100 frames and prints
`sent 100 frames after the client went away` once every send returned.
Path `/server-send`: prints `server send <its qualified name>` of sessions.consumers.server_send
(what the terminal consumer sends its output with), then sends `hello` with it.
"""

from __future__ import annotations

import asyncio
import json
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

import django  # noqa: E402

django.setup()

from channels.auth import AuthMiddlewareStack  # noqa: E402

from console.asgi import GoneClientSendsDropped  # noqa: E402
from sessions.consumers import server_send, server_transport, websocket_backlog  # noqa: E402

FRAME = "x" * 65536
SEND_WAIT_S = 0.2  # a send that waits this long: the server holds what the client has not read


async def inner(scope, receive, send) -> None:
    assert (await receive())["type"] == "websocket.connect"
    await send({"type": "websocket.accept"})
    if scope["path"] == "/gone":
        while (await receive())["type"] != "websocket.disconnect":  # the client's word, then it is gone
            pass
        for _ in range(100):
            await send({"type": "websocket.send", "text": FRAME})
        print("sent 100 frames after the client went away", flush=True)
        return
    if scope["path"] == "/server-send":
        direct = server_send(send)
        print(f"server send {getattr(direct, 'func', direct).__qualname__}", flush=True)
        await direct({"type": "websocket.send", "text": "hello"})
        while (await receive())["type"] != "websocket.disconnect":
            pass
        return
    transport = server_transport(send)
    backlog = 0
    for _ in range(1024):
        try:
            await asyncio.wait_for(send({"type": "websocket.send", "text": FRAME}), SEND_WAIT_S)
        except TimeoutError:
            pass
        backlog = websocket_backlog(transport)
        if backlog:
            break
    print(f"backlog {backlog}", flush=True)
    await send({"type": "websocket.send", "text": json.dumps({"backlog": backlog, "transport": type(transport).__name__})})
    while (await receive())["type"] != "websocket.disconnect":
        pass


application = GoneClientSendsDropped(AuthMiddlewareStack(inner))
