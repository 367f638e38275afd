"""The files API on the standalone console (`manage.py standalone`: the web and its embedded agent on
uvicorn's one event loop, the process runtime): a file's bytes pass between the view and the agent
inside the process (protocol.files.offer_local and take_local) with no connection of the console
to itself, both ways, byte-identical, and the agent's checks hold on that path (an upload without
Content-Length that passes the cap is refused as it crosses it, 413, leaving nothing)."""
from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

import httpx
import psutil
import pytest

from tests.conftest import wait_until
from tests.test_app_origin import ADMIN_PASSWORD, api, start_standalone

pytestmark = pytest.mark.e2e

MiB = 1024 * 1024
CAP = 100 * MiB  # FGPU_FILES_USER_CAP: a session's home may hold this much


def self_connections(pid: int) -> list:
    """The console's TCP connections to itself (one of its own sockets at the other end)."""
    connections = psutil.Process(pid).net_connections(kind="tcp")
    own = {(c.laddr.ip, c.laddr.port) for c in connections}
    return [c for c in connections if c.status == psutil.CONN_ESTABLISHED and c.raddr and tuple(c.raddr) in own]


def test_a_files_bytes_pass_inside_the_standalone_process_both_ways_and_the_cap_holds(procs, tmp_path):
    base, _, server = start_standalone(procs, tmp_path, FGPU_FILES_USER_CAP=str(CAP))
    token = api(base, "POST", "/api/v1/auth/token/", body={"username": "admin", "password": ADMIN_PASSWORD}).json()["token"]
    session = api(base, "POST", "/api/v1/sessions/", token, {"name": "files", "resources": {"cuda.shares": "0.5"}}).json()
    wait_until(lambda: api(base, "GET", f"/api/v1/sessions/{session['id']}/", token).json()["status"] == "RUNNING",
               timeout=60, what="the session to run")
    content = f"/api/v1/sessions/{session['id']}/files/content/"
    payload = os.urandom(64 * MiB + 5)  # more than the sockets on the way hold: the transfer is still going when looked at

    url = urlsplit(base)
    with socket.create_connection((url.hostname, url.port)) as upload:  # the body sent in two halves, looked at between
        upload.sendall((f"PUT {content}?path=big.bin HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Token {token}\r\n"
                        f"Content-Type: application/octet-stream\r\nContent-Length: {len(payload)}\r\n\r\n").encode())
        upload.sendall(payload[: len(payload) // 2])
        wait_until(lambda: any(part.stat().st_size for part in tmp_path.rglob(".fgpu-upload-*")),  # the agent writes it
                   timeout=30, what="the upload's temporary file (the listing hides it) to hold its first bytes")
        assert self_connections(server.pid) == []
        upload.sendall(payload[len(payload) // 2:])
        upload.settimeout(60)
        answer = upload.recv(65536)
    assert answer.startswith(b"HTTP/1.1 201"), answer[:400]

    with httpx.Client(base_url=base, headers={"Authorization": f"Token {token}"}, timeout=60) as client:
        with client.stream("GET", content, params={"path": "big.bin"}) as download:
            assert download.status_code == 200 and download.headers["Content-Length"] == str(len(payload))
            pieces = download.iter_raw(MiB)
            first = next(pieces)  # under way: the web now waits for this client to take more
            assert self_connections(server.pid) == []
            assert first + b"".join(pieces) == payload

        def over():  # no Content-Length (chunked): the cap is met mid-body, by the agent
            for _ in range(48):
                yield os.urandom(MiB)

        refused = client.put(content, params={"path": "over.bin"}, content=over(),
                             headers={"Content-Type": "application/octet-stream"})
        assert refused.status_code == 413 and refused.json()["type"] == "over-cap", refused.text
        names = [entry["name"] for entry in client.get(f"/api/v1/sessions/{session['id']}/files/").json()["entries"]]
    assert "big.bin" in names and "over.bin" not in names
    assert not [name for name in names if name.startswith(".fgpu-upload-")]
