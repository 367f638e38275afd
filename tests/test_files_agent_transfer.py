"""The agent's side of a direct upload (agent.files.SessionFiles: `_receive` over a real TCP
connection to an asyncio server as agent.direct serves it, `_write_upload` for the transfer taken
in the process): the bytes land as sent, whatever arrived with the token's line, and the cap and
the declared size hold to the byte. Real sockets and files; nothing is mocked."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import socket
import threading
import types

import pytest

from agent.files import UPLOAD_PREFIX, FileOps, SessionFiles
from protocol.terminal_stream import DIRECT_OK, DIRECT_REFUSED, LINE_LIMIT


def _files(tmp_path) -> tuple[SessionFiles, FileOps]:
    home = tmp_path / "home"
    home.mkdir(parents=True)
    return SessionFiles(types.SimpleNamespace(node="test", sessions={"s": None})), FileOps(home, None)


def _begin(files: SessionFiles, ops: FileOps, *, size: int | None, cap: int) -> str:
    upload_id = secrets.token_hex(8)
    files.uploads[upload_id] = ("s", ops.upload_begin("in/bench.bin", size, cap))
    return upload_id


def _send(body: bytes, *, size: int | None = None, cap: int = 1 << 40, tmp_path) -> tuple[dict, FileOps, str]:
    """`body` sent to `_receive` over TCP right behind the token's line (one sendall: part of it
    arrives with the line), the sender's side then ended; the agent's answer line, the files and
    the upload's id."""
    files, ops = _files(tmp_path)
    upload_id = _begin(files, ops, size=size, cap=cap)
    answers: list[bytes] = []

    async def run() -> None:
        served = asyncio.get_running_loop().create_future()

        async def handle(reader, writer) -> None:
            try:
                await reader.readline()
                await files._receive("s", upload_id, reader, writer)
            finally:
                writer.close()
                served.set_result(None)

        server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=LINE_LIMIT)
        port = server.sockets[0].getsockname()[1]

        def client() -> None:
            with socket.create_connection(("127.0.0.1", port)) as sock:
                try:
                    sock.sendall(b'{"token": "t"}\n' + body)
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass  # the agent refused and closed: its line says why
                answers.append(sock.makefile("rb").readline())

        thread = threading.Thread(target=client)
        thread.start()
        await served
        await asyncio.to_thread(thread.join)
        server.close()

    asyncio.run(run())
    return json.loads(answers[0]), ops, upload_id


def _temporaries(ops: FileOps) -> list[str]:
    return [name for name in os.listdir(ops.home / "in") if name.startswith(UPLOAD_PREFIX)]


@pytest.mark.parametrize("size", [0, 10, 3 * 1024 * 1024 + 17])
def test_a_direct_upload_lands_byte_for_byte_also_what_came_with_the_tokens_line(tmp_path, size):
    body = os.urandom(size)
    answer, ops, upload_id = _send(body, size=size, tmp_path=tmp_path)
    assert answer == {"type": DIRECT_OK, "written": size}
    temporary = _temporaries(ops)
    assert len(temporary) == 1
    with open(ops.home / "in" / temporary[0], "rb") as landed:
        assert hashlib.sha256(landed.read()).digest() == hashlib.sha256(body).digest()


def test_a_direct_upload_exactly_at_the_cap_is_taken_and_one_byte_past_it_is_refused_and_removed(tmp_path):
    cap = 2 * 1024 * 1024 + 5
    answer, ops, _ = _send(os.urandom(cap), cap=cap, tmp_path=tmp_path / "at")
    assert answer == {"type": DIRECT_OK, "written": cap}
    answer, ops, _ = _send(os.urandom(cap + 1), cap=cap, tmp_path=tmp_path / "past")
    assert answer["type"] == DIRECT_REFUSED and answer["error"] == "over-cap", answer
    assert _temporaries(ops) == []


def test_a_direct_upload_longer_than_its_declared_size_is_refused_and_removed(tmp_path):
    answer, ops, _ = _send(os.urandom(1000), size=999, tmp_path=tmp_path)
    assert answer["type"] == DIRECT_REFUSED and answer["error"] == "over-cap", answer
    assert _temporaries(ops) == []


def test_an_upload_taken_in_the_process_writes_its_pieces_in_order_and_stops_at_the_cap(tmp_path):
    pieces = [os.urandom(n) for n in (1, 65536, 300_000, 7, 1 << 20, 5)] * 5
    body = b"".join(pieces)

    async def given(chunks):
        for piece in chunks:
            await asyncio.sleep(0)  # noqa: TID251 - a turn of the loop between pieces, as a body's receive gives
            yield piece

    files, ops = _files(tmp_path)
    upload_id = _begin(files, ops, size=None, cap=len(body))
    answer = asyncio.run(files._write_upload("s", upload_id, given(pieces)))
    assert answer == {"type": DIRECT_OK, "written": len(body)}
    with open(ops.home / "in" / _temporaries(ops)[0], "rb") as landed:
        assert landed.read() == body

    files, ops = _files(tmp_path / "past")
    upload_id = _begin(files, ops, size=None, cap=len(body) - 1)
    answer = asyncio.run(files._write_upload("s", upload_id, given(pieces)))
    assert answer["type"] == DIRECT_REFUSED and answer["error"] == "over-cap", answer
    assert _temporaries(ops) == [] and upload_id not in files.uploads
