"""The app proxy's upstream leg alone (issue 35.3): the CPU it costs the web process to read an app's
large answer through httpcore, on the proxy's own network backend (sessions.serving.upstream,
asyncio's transports) against httpcore's default, anyio's (`httpcore.AnyIOBackend`), in one run.

    .venv/bin/python benchmarks/app_upstream.py [--mb 100] [--rounds 6]

An HTTP/1.1 server in another process (so its CPU is not counted) answers each GET with --mb MB
(10^6 bytes) of a random 64 KiB chunk with a Content-Length, as tests/apps/echo_app.py's `bytes`
does; this process reads it with httpcore's pool (one kept connection per backend, httpcore's reads
of the proxy's READ_BYTES), the backends in turn, --rounds times each. Prints each backend's CPU
seconds per 100 MB (time.process_time: moves less with the machine's load than the rate) and MB/s,
and their ratios (medians), with the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpcore

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
os.environ.setdefault("FGPU_SECRET_KEY", "benchmark-app-upstream-" + "x" * 40)  # the settings refuse to start without one
import django  # noqa: E402

django.setup()
from sessions.serving.proxy import READ_BYTES, TIMEOUTS  # noqa: E402
from sessions.serving.upstream import AsyncioBackend  # noqa: E402

CHUNK = os.urandom(65536)


def serve(size: int, ports) -> None:
    """The app: each connection's GETs answered with `size` bytes, until the client closes it."""
    listener = socket.create_server(("127.0.0.1", 0))
    ports.put(listener.getsockname()[1])
    while True:
        connection, _ = listener.accept()
        threading.Thread(target=answer, args=(connection, size), daemon=True).start()


def answer(connection: socket.socket, size: int) -> None:
    pending = b""
    with connection:
        while True:
            while b"\r\n\r\n" not in pending:
                data = connection.recv(65536)
                if not data:
                    return
                pending += data
            pending = pending.split(b"\r\n\r\n", 1)[1]
            connection.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
            left = size
            while left > 0:
                piece = CHUNK[: min(left, len(CHUNK))]
                connection.sendall(piece)
                left -= len(piece)


async def download(pool: httpcore.AsyncConnectionPool, url: str, size: int) -> tuple[float, float]:
    """(CPU s, wall s) of one GET of `size` bytes, read as the proxy reads an answer (aiter_stream)."""
    began, cpu = time.perf_counter(), time.process_time()
    got = 0
    async with pool.stream("GET", url, extensions={"timeout": TIMEOUTS}) as response:
        async for piece in response.aiter_stream():
            got += len(piece)
    assert got == size, (got, size)
    return time.process_time() - cpu, time.perf_counter() - began


async def measure(url: str, size: int, rounds: int) -> dict[str, list[tuple[float, float]]]:
    httpcore.AsyncHTTP11Connection.READ_NUM_BYTES = READ_BYTES  # as the proxy's pool sets it
    backends = {"anyio": httpcore.AnyIOBackend(), "asyncio": AsyncioBackend()}
    pools = {name: httpcore.AsyncConnectionPool(network_backend=backend) for name, backend in backends.items()}
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in pools}
    for round_ in range(rounds + 1):  # the first round warms both up (connections, imports): not counted
        for name in list(pools) if round_ % 2 else reversed(list(pools)):
            figures = await download(pools[name], url, size)
            if round_:
                runs[name].append(figures)
    for pool in pools.values():
        await pool.aclose()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=100)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "app_proxy.txt"))
    args = parser.parse_args()
    size = int(args.mb * 1_000_000)
    ports: multiprocessing.Queue = multiprocessing.Queue()
    app = multiprocessing.Process(target=serve, args=(size, ports), daemon=True)
    app.start()
    load = os.getloadavg()[0]
    try:
        runs = asyncio.run(measure(f"http://127.0.0.1:{ports.get(timeout=30)}/", size, args.rounds))
    finally:
        app.terminate()
    per_100 = 100 / args.mb
    cpu = {name: statistics.median(c for c, _ in figures) * per_100 for name, figures in runs.items()}
    rate = {name: statistics.median(size / 1e6 / w for _, w in figures) for name, figures in runs.items()}
    lines = [
        f"the app proxy's upstream leg: httpcore reading {args.mb:g} MB answers, {args.rounds} rounds a backend in turn "
        f"(medians); {os.cpu_count()} CPUs, load average {load:.1f} before, {os.getloadavg()[0]:.1f} after",
        f"{'':28}{'anyio':>10}{'asyncio':>10}{'asyncio/anyio':>15}",
        f"{'CPU s per 100 MB':28}{cpu['anyio']:>10.3f}{cpu['asyncio']:>10.3f}{cpu['asyncio'] / cpu['anyio']:>15.2f}",
        f"{'MB/s':28}{rate['anyio']:>10.1f}{rate['asyncio']:>10.1f}{rate['asyncio'] / rate['anyio']:>15.2f}",
    ]
    for name, figures in runs.items():
        lines.append(f"{name} rounds, CPU s per 100 MB: {' '.join(f'{c * per_100:.3f}' for c, _ in figures)}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    with Path(args.out).open("a") as out:  # appended, as benchmarks/app_proxy.py's figures
        out.write(f"\n# {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {' '.join(sys.argv)}\n" + text)


if __name__ == "__main__":
    main()
