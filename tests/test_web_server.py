"""The web server under the console's websockets, as real processes: uvicorn (the web command) and
daphne (which serves the same application). The terminal's flow control reads what the server
holds for a client that does not read (sessions.consumers.server_transport, websocket_backlog)
through Channels' middleware and the console's own, under either server; a send to a client that
has gone is dropped (console.asgi.GoneClientSendsDropped), not an error that ends the consumer.
The app: tests/apps/backlog_app.py."""
from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import subprocess

import pytest
import websockets

from tests.stack import BIN, PYTHON, ROOT, Proc, free_port, wait_until, web_command

pytestmark = pytest.mark.e2e

APP = "tests.apps.backlog_app:application"
SERVERS = {
    "uvicorn": lambda port: web_command(port, APP) + ["--ws-ping-interval", "600", "--ws-ping-timeout", "600"],
    # The raw client never answers a ping: daphne's (every 20 s, dropped after 30 s more) or uvicorn's
    # would end a slow run's connection before the backlog is read.
    "daphne": lambda port: [str(BIN / "daphne"), "-b", "127.0.0.1", "-p", str(port), "--ping-interval", "600",
                            "--ping-timeout", "600", APP],
}


@pytest.fixture(params=sorted(SERVERS))
def server(request, tmp_path):
    port = free_port()
    proc = Proc(request.param, SERVERS[request.param](port), env=dict(os.environ), log_dir=tmp_path)

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0 or not proc.alive()

    wait_until(listening, timeout=30, what=f"{request.param} to listen")
    assert proc.alive(), proc.output()
    yield request.param, port, proc
    proc.stop(timeout=5)


def test_the_backlog_of_a_client_that_does_not_read_is_seen_through_the_middleware(server):
    name, port, proc = server
    # A client that reads nothing after the handshake, with a small receive buffer: the kernel's
    # buffers fill, then the server's (a websocket library would go on reading into its own).
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.settimeout(30)
    client.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    client.sendall((f"GET /fill HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                    f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    received = b""
    while b"\r\n\r\n" not in received:
        received += client.recv(1)
    assert received.startswith(b"HTTP/1.1 101"), received
    wait_until(lambda: "backlog " in proc.output(), timeout=60, what=f"{name} to hold a backlog")
    received = b""
    while b'{"backlog"' not in received or b"}" not in received[received.index(b'{"backlog"'):]:
        chunk = client.recv(1 << 20)
        assert chunk, (received[-200:], proc.output())
        received += chunk
    client.close()
    start = received.index(b'{"backlog"')
    report = json.loads(received[start:received.index(b"}", start) + 1])
    assert report["backlog"] > 0, (report, proc.output())
    assert report["transport"] != "NoneType", report  # the server's transport was found


def test_sends_to_a_client_that_went_away_are_dropped(server):
    name, port, proc = server

    async def run() -> None:
        ws = await websockets.connect(f"ws://127.0.0.1:{port}/gone")
        await ws.send("bye")
        ws.transport.abort()  # gone without a close frame, as a browser whose network broke

    asyncio.run(run())
    wait_until(lambda: "sent 100 frames after the client went away" in proc.output(), timeout=15,
               what=f"{name}'s app to finish its sends")
    assert "Exception in ASGI application" not in proc.output()
    assert "Traceback" not in proc.output(), proc.output()


def test_the_terminals_output_send_is_the_servers_own_under_the_middleware(server):
    name, port, proc = server

    async def run() -> str:
        async with websockets.connect(f"ws://127.0.0.1:{port}/server-send") as ws:
            return await asyncio.wait_for(ws.recv(), 15)

    assert asyncio.run(run()) == "hello"
    wait_until(lambda: "server send " in proc.output(), timeout=15, what=f"{name}'s app to say its send")
    said = proc.output().split("server send ")[1].split()[0]
    assert said == {"uvicorn": "WebSocketsSansIOProtocol.send", "daphne": "Server.handle_reply"}[name], said


def test_standalone_on_a_taken_port_says_so_and_exits(tmp_path):
    """`manage.py standalone` embeds uvicorn: a port in use is one error line and exit status 1,
    not a traceback (uvicorn's startup exits the process by SystemExit)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
        env.update(FGPU_DATA_DIR=str(tmp_path), PORT=str(port), FGPU_ADMIN_PASSWORD="admin-pass-123")
        done = subprocess.run([PYTHON, "manage.py", "standalone"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
    assert done.returncode == 1, done.stderr
    assert f"CommandError: could not serve on 127.0.0.1:{port}" in done.stderr
    assert "address already in use" in done.stderr.lower()  # the OS's words (Errno 98), as uvicorn or the socket says them
    assert "Traceback" not in done.stderr, done.stderr
