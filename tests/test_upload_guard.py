"""The web refuses a request body before reading it (console.upload_guard, issue 31.7), against a
real uvicorn serving console.asgi:application, with raw sockets: the client sends the request's
head only and the 401/413 comes back before it has sent a byte of the body; a chunked body past
the limit is cut off with 413 and the connection closed; what is authenticated and within the
limit reaches the view."""
from __future__ import annotations

import json
import os
import socket
import uuid

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import Client

from accounts.services import api_token_create
from tests.stack import Proc, database_url_default, free_port, wait_until, web_command

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

CAP = 1024 * 1024  # FGPU_FILES_USER_CAP for the web under test: 1 MiB
UPLOAD = "/api/v1/sessions/{}/files/content/?path=data/big.bin"


@pytest.fixture(scope="module")
def web(django_db_setup, django_db_blocker, tmp_path_factory):
    """One uvicorn for the module's tests (each test's rows are its own: a transactional test's are
    flushed after it); a uvicorn start cost each test 9-42 s of setup at a load of 12."""
    tmp_path = tmp_path_factory.mktemp("upload-guard-web")
    port = free_port()
    with django_db_blocker.unblock():
        database = database_url_default()
    env = {**os.environ, "DATABASE_URL": database, "FGPU_FILES_USER_CAP": str(CAP),
           "FGPU_DATA_DIR": str(tmp_path / "data"), "FGPU_SECRET_KEY": settings.SECRET_KEY}  # the sign-in cookies made here
    env.pop("REDIS_URL", None)
    proc = Proc("web", web_command(port), env=env, log_dir=tmp_path)

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0 or not proc.alive()

    wait_until(listening, timeout=60, what="uvicorn to listen")
    assert proc.alive(), proc.output()
    yield port, proc
    proc.stop(timeout=10)


@pytest.fixture
def alice_key(db):
    alice = get_user_model().objects.create_user("alice", password="pw-alice-123")
    key, _ = api_token_create(user=alice, name="uploads")
    return key


def head_only(port: int, head: str) -> tuple[int, dict, bytes]:
    """Send the request head `head` (no body) and read the answer: (status, headers, body).
    Fails if the server waits for the body instead of answering (5 s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
        client.sendall(head.encode())
        return read_answer(client)


def read_answer(client: socket.socket) -> tuple[int, dict, bytes]:
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = client.recv(65536)
        assert chunk, f"connection closed before an answer: {received!r}"
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = client.recv(65536)
        assert chunk
        body += chunk
    return status, headers, body


def put_head(port: int, *, length: int | None, auth: str = "", path: str | None = None) -> str:
    framing = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return (f"PUT {path or UPLOAD.format(uuid.uuid4())} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{auth}"
            f"Content-Type: application/octet-stream\r\n{framing}\r\n")


def test_an_unauthenticated_upload_declaring_20_gib_is_refused_401_before_its_body(web):
    port, _ = web
    status, headers, body = head_only(port, put_head(port, length=20 * 1024**3))
    assert status == 401, body
    assert json.loads(body)["type"] == "not-authenticated"
    assert headers["www-authenticate"] == "Token"
    assert headers["connection"] == "close"


def test_an_upload_with_a_wrong_token_is_refused_401_before_its_body(web, alice_key):
    port, _ = web
    status, _, body = head_only(port, put_head(port, length=200 * 1024**2, auth="Authorization: Token nope-nope\r\n"))
    assert status == 401, body


def test_an_authenticated_upload_declaring_more_than_the_cap_is_refused_413_before_its_body(web, alice_key):
    port, _ = web
    status, headers, body = head_only(port, put_head(port, length=CAP + 1, auth=f"Authorization: Token {alice_key}\r\n"))
    assert status == 413, body
    error = json.loads(body)
    assert set(error) == {"type", "title", "detail", "field_errors"}
    assert str(CAP) in error["detail"]
    assert headers["connection"] == "close"


def test_a_signed_in_session_cookie_counts_as_authenticated(web, alice_key):
    port, _ = web
    client = Client()
    client.force_login(get_user_model().objects.get(username="alice"))
    cookie = f"Cookie: sessionid={client.cookies['sessionid'].value}\r\n"
    status, _, body = head_only(port, put_head(port, length=CAP + 1, auth=cookie))
    assert status == 413, body  # past authentication: the size is what is refused
    status, _, body = head_only(port, put_head(port, length=CAP + 1, auth="Cookie: sessionid=forged\r\n"))
    assert status == 401, body


def test_an_authenticated_upload_within_the_cap_reaches_the_view(web, alice_key):
    port, _ = web
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(put_head(port, length=5, auth=f"Authorization: Token {alice_key}\r\n").encode() + b"hello")
        status, _, body = read_answer(client)
    assert status == 404, body  # no such session: the view answered, after the whole body arrived
    assert json.loads(body)["type"] == "not-found"


def test_a_chunked_upload_past_the_cap_is_cut_off_with_413_and_the_connection_closed(web, alice_key):
    port, proc = web
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(put_head(port, length=None, auth=f"Authorization: Token {alice_key}\r\n").encode())
        piece = b"x" * 65536
        chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        sent = 0
        try:
            while sent <= 4 * CAP:  # the web must stop it long before four times the cap
                client.sendall(chunk)
                sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, headers, body = read_answer(client)
        assert status == 413, body
        assert "cut off" in json.loads(body)["detail"]
        assert headers["connection"] == "close"
        client.settimeout(5)
        try:
            rest = client.recv(65536)
            while rest:
                rest = client.recv(65536)
        except ConnectionResetError:
            pass  # closed: the kernel resets a connection closed with unread data
    assert proc.alive(), proc.output()


def test_an_unauthenticated_large_body_anywhere_is_refused_401_but_a_small_one_passes(web):
    port, _ = web
    head = (f"POST /api/v1/auth/token/ HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {3 * 1024**2}\r\n\r\n")
    status, _, body = head_only(port, head)
    assert status == 401, body
    small = b'{"username": "nobody", "password": "wrong"}'
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall((f"POST /api/v1/auth/token/ HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
                        f"application/json\r\nContent-Length: {len(small)}\r\n\r\n").encode() + small)
        status, _, body = read_answer(client)
    assert status == 400, body  # the login endpoint answered: wrong credentials


def test_an_unauthenticated_chunked_body_is_cut_off_at_the_small_limit(web):
    port, _ = web
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall((f"POST /api/v1/auth/token/ HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
                        "application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode())
        piece = b" " * 65536
        try:
            for _ in range(200):  # 12.5 MiB: past 2.5 MiB the web must have stopped reading
                client.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, _, body = read_answer(client)
    assert status == 413, body
