"""The agent's side of a direct upload alone (issue 35.3): what `agent.files.SessionFiles` spends to
take an upload's bytes, with no web process and no HTTP, so that a change there shows apart from
the web server's cost and the machine's load.

    .venv/bin/python benchmarks/files_agent.py [--mb 100] [--repeat 5]

Two measures, each `--repeat` rounds of a file of --mb MB (10^6 bytes, random), medians printed
with the load average: `listener`, `_receive` on an asyncio server as agent.direct serves a
transfer (the token's line read first), fed by a client process that sends the file with sendfile
right behind the line; `in process`, `_write_upload` fed 128 KiB pieces with a turn of the loop
between them (standalone's path, the pieces a request body arrives in). Each round's upload is
committed (fsync) as the web would. Prints MB/s and the CPU seconds (user and system, all threads)
of this process per 100 MB. Run it from the tree to measure (cd there; PYTHONPATH=.).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import secrets
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, os.getcwd())
from agent.files import FileOps, SessionFiles  # noqa: E402
from protocol.terminal_stream import LINE_LIMIT  # noqa: E402

PIECE = 128 * 1024


def cpu_seconds() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


async def listener_round(files: SessionFiles, ops: FileOps, source: Path, size: int) -> tuple[float, float]:
    upload_id = secrets.token_hex(8)
    upload = ops.upload_begin("bench.bin", size, 1 << 50)
    files.uploads[upload_id] = ("s", upload)
    served = asyncio.get_running_loop().create_future()

    async def handle(reader, writer) -> None:
        await reader.readline()
        await files._receive("s", upload_id, reader, writer)
        writer.close()
        served.set_result(None)

    server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=LINE_LIMIT)
    port = server.sockets[0].getsockname()[1]
    send = (
        "import socket\n"
        f"s = socket.create_connection(('127.0.0.1', {port})); s.sendall(b'{{\"token\": \"t\"}}\\n')\n"
        f"s.sendfile(open({str(source)!r}, 'rb')); s.shutdown(socket.SHUT_WR); s.recv(100)\n"
    )
    spent, started = cpu_seconds(), time.perf_counter()
    client = await asyncio.create_subprocess_exec(sys.executable, "-c", send)
    await served
    await client.wait()
    FileOps.upload_commit(upload)
    FileOps.upload_close(upload, remove=False)
    elapsed, spent = time.perf_counter() - started, cpu_seconds() - spent
    server.close()
    return size / 1e6 / elapsed, spent / size * 1e8


async def in_process_round(files: SessionFiles, ops: FileOps, size: int) -> tuple[float, float]:
    upload_id = secrets.token_hex(8)
    upload = ops.upload_begin("bench.bin", size, 1 << 50)
    files.uploads[upload_id] = ("s", upload)
    blob = os.urandom(PIECE)

    async def pieces():
        left = size
        while left > 0:
            await asyncio.sleep(0)
            yield blob[: min(PIECE, left)]
            left -= PIECE

    spent, started = cpu_seconds(), time.perf_counter()
    answer = await files._write_upload("s", upload_id, pieces())
    FileOps.upload_commit(upload)
    FileOps.upload_close(upload, remove=False)
    assert answer.get("written") == size, answer
    return size / 1e6 / (time.perf_counter() - started), (cpu_seconds() - spent) / size * 1e8


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    size = int(args.mb * 10**6)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fgpu-files-agent-") as tmp:
        home, source = Path(tmp) / "home", Path(tmp) / "source.bin"
        home.mkdir()
        with open(source, "wb") as out:
            for _ in range(0, size, 1 << 20):
                out.write(os.urandom(min(1 << 20, size - out.tell())))
        files, ops = SessionFiles(types.SimpleNamespace(node="bench", sessions={"s": None})), FileOps(home, None)
        measured: dict[str, list[tuple[float, float]]] = {"listener": [], "in process": []}
        for _ in range(args.repeat):
            measured["listener"].append(await listener_round(files, ops, source, size))
            measured["in process"].append(await in_process_round(files, ops, size))
    after = os.getloadavg()[0]
    print(f"agent's upload side ({args.mb:g} MB, medians of {args.repeat}; load average {load:.1f} before, {after:.1f} after)")
    for kind, rounds in measured.items():
        rate, cpu = statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)
        print(f"{kind:10s} {rate:8.1f} MB/s   CPU {cpu:.3f} s per 100 MB")


if __name__ == "__main__":
    asyncio.run(main())
