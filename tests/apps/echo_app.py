"""A small real web app for the session-app tests and benchmarks/app_proxy.py (issue 16): an ASGI
application served by daphne inside a session, as a session image's app would be
(`python -m daphne -b {host} -p {port} echo_app:application`, with this directory on PYTHONPATH).

It refuses every request without `Authorization: token $FGPU_APP_TOKEN` (403), so a test that
gets through shows the console's proxy injected the token. Under its prefix ($FGPU_APP_BASE_URL,
or none when the app is not given it):

| path | answer |
|---|---|
| `echo` | JSON: method, path, query, whether a console cookie or the app's token reached it (never the token) |
| `upload` (POST) | JSON: bytes received and their SHA-256 |
| `bytes?n=N` | N bytes (a random 64 KiB chunk again and again, streamed) |
| `gate` | "first\\n" at once, then "second\\n" once a websocket message "release" arrived: a streamed answer |
| `exit` | answers, then the app exits with code 3 |
| `ws` (websocket) | echoes each message back ("echo:" before text); "release" opens the gate; accepts the first subprotocol |
| anything else | a page that opens the `ws` websocket, sends "hi" and shows the answer |
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
from urllib.parse import parse_qs

TOKEN = os.environ.get("FGPU_APP_TOKEN", "")
PREFIX = os.environ.get("FGPU_APP_BASE_URL", "/").rstrip("/") if os.environ.get("ECHO_APP_PREFIXED", "1") == "1" \
    else ""
GATE = asyncio.Event()
CHUNK = os.urandom(65536)  # `bytes`' pieces: not one byte repeated, whose speed through the proxy's token mask depended on the token


def _headers(scope) -> dict[str, str]:
    return {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}


async def _answer(send, status: int, body: bytes, content_type: str = "text/plain") -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def application(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        return
    headers = _headers(scope)
    authorized = bool(TOKEN) and headers.get("authorization") == f"token {TOKEN}"
    path = scope["path"][len(PREFIX):] if scope["path"].startswith(PREFIX) else scope["path"]
    if scope["type"] == "websocket":
        await receive()  # websocket.connect
        if not authorized:
            await send({"type": "websocket.close", "code": 4403})
            return
        protocols = scope.get("subprotocols") or []
        await send({"type": "websocket.accept", "subprotocol": protocols[0] if protocols else None})
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                return
            if message.get("text") is not None:
                if message["text"] == "release":
                    GATE.set()
                await send({"type": "websocket.send", "text": "echo:" + message["text"]})
            else:
                await send({"type": "websocket.send", "bytes": message.get("bytes") or b""})
    if not authorized:
        await _answer(send, 403, b"no token\n")
        return
    digest, size = hashlib.sha256(), 0
    while True:
        message = await receive()
        digest.update(message.get("body", b""))
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    query = parse_qs(scope.get("query_string", b"").decode())
    if path == "/echo":
        cookie = headers.get("cookie", "")
        body = {"method": scope["method"], "path": scope["path"], "query": scope.get("query_string", b"").decode(),
                "authorized": authorized, "cookie": cookie, "console_cookie": any(f"{n}=" in cookie for n in ("sessionid", "csrftoken", "fgpu_app")),
                "host": headers.get("host", ""), "forwarded_host": headers.get("x-forwarded-host", ""),
                "token_sha256": hashlib.sha256(TOKEN.encode()).hexdigest(),  # which token it runs with, not the token
                "pid": os.getpid()}  # which copy answers
        await _answer(send, 200, json.dumps(body).encode(), "application/json")
    elif path == "/upload":
        await _answer(send, 200, json.dumps({"bytes": size, "sha256": digest.hexdigest()}).encode(), "application/json")
    elif path == "/bytes":
        n = int(query.get("n", ["0"])[0])
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/octet-stream"), (b"content-length", str(n).encode())]})
        if not n:
            await send({"type": "http.response.body", "body": b""})
        while n > 0:
            piece = CHUNK[:min(n, len(CHUNK))]
            n -= len(piece)
            await send({"type": "http.response.body", "body": piece, "more_body": n > 0})
    elif path == "/gate":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"first\n", "more_body": True})
        await GATE.wait()
        GATE.clear()
        await send({"type": "http.response.body", "body": b"second\n"})
    elif path == "/exit":
        await _answer(send, 200, b"bye\n")
        asyncio.get_running_loop().call_later(0.2, os._exit, 3)
    else:
        await _answer(send, 200, PAGE.encode(), "text/html; charset=utf-8")


PAGE = """<!doctype html><html><head><title>echo_app</title></head>
<body style="font: 16px system-ui; margin: 40px">
<h1>hello from echo_app</h1><p>served at <code id="where"></code></p><p id="ws">websocket: connecting</p>
<script>
document.getElementById("where").textContent = location.pathname;
const base = location.pathname.endsWith("/") ? location.pathname : location.pathname + "/";
const socket = new WebSocket((location.protocol === "https:" ? "wss://" : "ws://") + location.host + base + "ws");
socket.onopen = () => socket.send("hi");
socket.onmessage = (event) => { document.getElementById("ws").textContent = "websocket says: " + event.data; };
socket.onclose = (event) => { document.getElementById("ws").textContent += " (closed " + event.code + ")"; };
</script></body></html>
"""
