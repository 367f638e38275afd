"""The files API against `cp` (issue 35.3: at least 0.5x both ways), in one run: a file of --mb MB
(10^6 bytes, random) uploaded into a session's home with `PUT /api/v1/sessions/<id>/files/content/`
and downloaded back with `GET` of the same path, against `cp` of the same file between two folders
of this machine (into the console's data folder, where the session's home lives, and out of it).

    .venv/bin/python benchmarks/files_api.py [--mb 100] [--repeat 3] [--mode standalone|distributed]
        [--client raw|httpx] [--out benchmarks/results/files_api.txt]

`--mode standalone` (default): a standalone console (`manage.py standalone`, the embedded agent on
the process runtime, on uvicorn's event loop) on a free port. `--mode distributed`: tests/stack.py's
uvicorn, Celery manager and one agent in processes of their own, with a private redis-server and
PostgreSQL (benchmarks/terminal.py's DistributedTarget; the shared DATABASE_URL where no private
PostgreSQL can run), the bytes between the web and the agent over the agent's listener. One 0.5
fGPU session. Each round runs upload, `cp` in, download, `cp` out, in turn (every
other round `cp` first), so that the machine's drift hits them alike; each download's bytes
are checked against the file's SHA-256 after it is timed (so the upload's too). Prints MB/s
(medians of the rounds) and the ratios, with the load average, and the CPU seconds the console
(its web and agent processes) spent per 100 MB (medians: this moves less with the machine's load
than the rates); the figures include the console's competition for the machine's CPUs, and the
client's own.

The client (`--client raw`, default) is one that is not the bottleneck, as curl would be: HTTP/1.1
on a plain socket in this process, the upload's file sent with sendfile after the request's head,
the download received into one buffer and written to its file as it comes (as `cp` writes its
target). `--client httpx` streams from and to the file in 1 MiB pieces with httpx (the figures
before 2026-11-28 12:00 were taken with it: it spent 0.25-0.48 s of CPU per 100 MB downloaded).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.app_proxy import PASSWORD, start_console  # noqa: E402
from tests.stack import wait_until  # noqa: E402

PIECE = 1 << 20
ENDED = ("TERMINATED", "ERROR", "CANCELLED")  # sessions.models.FINAL_STATUSES


def _pieces(path: Path):
    with open(path, "rb") as source:
        while piece := source.read(PIECE):
            yield piece


def _raw_request(base: str, token: str, method: str, target: str, headers: str = "") -> socket.socket:
    """A connection to the console at `base` with the request's head sent (`Connection: close`)."""
    url = urlsplit(base)
    sock = socket.create_connection((url.hostname, url.port))
    head = (
        f"{method} {target} HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Token {token}\r\n{headers}Connection: close\r\n\r\n"
    )
    sock.sendall(head.encode())
    return sock


def _raw_head(sock: socket.socket, buffer: bytearray) -> tuple[int, dict[str, str], memoryview]:
    """The answer's status, headers (names lower-case) and the body's first bytes received with them."""
    got = 0
    while (end := bytes(buffer[:got]).find(b"\r\n\r\n")) < 0:
        n = sock.recv_into(memoryview(buffer)[got:])
        if not n:
            raise ConnectionError("the console closed before its answer's head")
        got += n
    lines = bytes(buffer[:end]).decode("latin-1").split("\r\n")
    headers = dict((name.strip().lower(), value.strip()) for name, _, value in (line.partition(":") for line in lines[1:]))
    return int(lines[0].split()[1]), headers, memoryview(buffer)[end + 4 : got]


def upload_raw(base: str, token: str, session_id: str, source: Path) -> float:
    """PUT the file with sendfile after the head; the seconds until the answer (201) came."""
    size = source.stat().st_size
    started = time.perf_counter()
    target = f"/api/v1/sessions/{session_id}/files/content/?path=bench.bin"
    headers = f"Content-Type: application/octet-stream\r\nContent-Length: {size}\r\n"
    with _raw_request(base, token, "PUT", target, headers) as sock, open(source, "rb") as body:
        sock.sendfile(body)
        status, _, _ = _raw_head(sock, bytearray(PIECE))
    elapsed = time.perf_counter() - started
    assert status == 201, f"upload answered {status}"
    return elapsed


def download_raw(base: str, token: str, session_id: str, target: Path) -> float:
    """GET the file into `target` (one receive buffer, each piece written as it comes)."""
    buffer = bytearray(4 * PIECE)
    started = time.perf_counter()
    with _raw_request(base, token, "GET", f"/api/v1/sessions/{session_id}/files/content/?path=bench.bin") as sock:
        status, headers, first = _raw_head(sock, buffer)
        assert status == 200, f"download answered {status}"
        left = int(headers["content-length"])
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, first)
            left -= len(first)
            view = memoryview(buffer)
            while left > 0:
                n = sock.recv_into(view)
                if not n:
                    raise ConnectionError(f"the download ended {left} bytes short")
                os.write(fd, view[:n])
                left -= n
        finally:
            os.close(fd)
    return time.perf_counter() - started


def upload(api: httpx.Client, session_id: str, source: Path) -> float:
    started = time.perf_counter()
    answer = api.put(
        f"/api/v1/sessions/{session_id}/files/content/",
        params={"path": "bench.bin"},
        content=_pieces(source),
        headers={"Content-Type": "application/octet-stream", "Content-Length": str(source.stat().st_size)},
    )
    elapsed = time.perf_counter() - started
    answer.raise_for_status()
    return elapsed


def download(api: httpx.Client, session_id: str, target: Path) -> float:
    started = time.perf_counter()
    with api.stream("GET", f"/api/v1/sessions/{session_id}/files/content/", params={"path": "bench.bin"}) as answer:
        answer.raise_for_status()
        with open(target, "wb") as out:
            for chunk in answer.iter_raw(PIECE):
                out.write(chunk)
    return time.perf_counter() - started


def sha256(path: Path) -> str:
    hashed = hashlib.sha256()
    with open(path, "rb") as source:
        while piece := source.read(PIECE):
            hashed.update(piece)
    return hashed.hexdigest()


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds the processes `pids` have spent so far."""
    return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids)


def cp(source: Path, target: Path) -> float:
    started = time.perf_counter()
    subprocess.run(["cp", str(source), str(target)], check=True)
    return time.perf_counter() - started


def main() -> None:
    # The consoles and agents it starts stop their sessions when they stop: a held process-runtime session
    # outlives its console by default, for the next start to adopt, and each run left its holders running.
    os.environ.setdefault("FGPU_STOP_SESSIONS_ON_EXIT", "true")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--client", choices=["raw", "httpx"], default="raw")
    parser.add_argument("--mode", choices=["standalone", "distributed"], default="standalone")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "files_api.txt"), help="appended to")
    args = parser.parse_args()
    size = int(args.mb * 10**6)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="fgpu-files-api-") as tmp:
        work = Path(tmp)
        session: dict = {}
        if args.mode == "distributed":
            (work / "data").mkdir()  # cp's folder (standalone's FGPU_DATA_DIR, where its homes are)
            from benchmarks.terminal import DistributedTarget

            console = DistributedTarget(work, os.environ.get("DATABASE_URL", ""))
            console.start()
            base, token, session = console.stack.base, console.api.token, {"id": console.api.session_id}
            api = httpx.Client(base_url=base, timeout=600, headers={"Authorization": f"Token {token}"})
            console.stop = console.close  # type: ignore[attr-defined]
            serving = [proc.pid for name, proc in console.stack.procs.items() if name == "web" or name.startswith("agent-")]
        else:
            console, base = start_console(work, secrets.token_urlsafe(32))
            serving = [console.pid]  # the web and its embedded agent
        try:
            if args.mode == "standalone":
                api = httpx.Client(base_url=base, timeout=600)
                token = api.post("/api/v1/auth/token/", json={"username": "admin", "password": PASSWORD}).json()["token"]
                api.headers["Authorization"] = f"Token {token}"
                session = api.post("/api/v1/sessions/", json={"name": "bench", "resources": {"cuda.shares": "0.5"}}).json()
                wait_until(
                    lambda: api.get(f"/api/v1/sessions/{session['id']}/").json()["status"] == "RUNNING",
                    timeout=60,
                    what="the session to run",
                )
            source, landed = work / "source.bin", work / "downloaded.bin"
            with open(source, "wb") as out:
                for _ in range(size // PIECE):
                    out.write(os.urandom(PIECE))
                out.write(os.urandom(size % PIECE))
            digest = sha256(source)
            into, back = work / "data" / "cp-in.bin", work / "cp-out.bin"  # on the disk of the sessions' homes
            times: dict[str, list[float]] = {"upload": [], "cp in": [], "download": [], "cp out": []}
            cpu: dict[str, list[float]] = {"upload": [], "download": []}  # the console's (web and agent) CPU seconds
            loads = []
            for round_ in range(args.repeat):
                order = (
                    ["upload", "cp in", "download", "cp out"] if round_ % 2 == 0 else ["cp in", "upload", "cp out", "download"]
                )
                for kind in order:
                    spent = cpu_seconds(serving)
                    if kind == "upload" and args.client == "raw":
                        times[kind].append(upload_raw(base, token, session["id"], source))
                    elif kind == "upload":
                        times[kind].append(upload(api, session["id"], source))
                    elif kind == "download":
                        if args.client == "raw":
                            times[kind].append(download_raw(base, token, session["id"], landed))
                        else:
                            times[kind].append(download(api, session["id"], landed))
                        assert sha256(landed) == digest, "the download differs from the file uploaded"
                    elif kind == "cp in":
                        times[kind].append(cp(source, into))
                    else:
                        times[kind].append(cp(into, back))
                    if kind in cpu:
                        cpu[kind].append(cpu_seconds(serving) - spent)
                loads.append(os.getloadavg()[0])
                print(f"round {round_ + 1}: " + ", ".join(f"{k} {size / 1e6 / v[-1]:.1f} MB/s" for k, v in times.items()))
            for path in (into, back, landed):
                path.unlink(missing_ok=True)
        finally:
            if session:  # ended before the console stops: its process would outlive it (sessions survive restarts)
                api.delete(f"/api/v1/sessions/{session['id']}/")
                wait_until(
                    lambda: api.get(f"/api/v1/sessions/{session['id']}/").json()["status"] in ENDED,
                    timeout=60,
                    what="the session to end",
                )
            console.stop()
            shutil.rmtree(work / "data", ignore_errors=True)
    rate = {kind: size / 1e6 / statistics.median(values) for kind, values in times.items()}
    up, down = rate["upload"] / rate["cp in"], rate["download"] / rate["cp out"]
    lines = [
        f"files API vs cp ({args.mb:g} MB, medians of {args.repeat} rounds, interleaved; {args.mode} console, process "
        f"runtime, client {args.client}, {os.cpu_count()} CPUs, load average {load[0]:.1f} before, "
        f"{', '.join(f'{x:.1f}' for x in loads)} after each round)",
        f"upload   {rate['upload']:8.1f} MB/s   cp in  {rate['cp in']:8.1f} MB/s   ratio {up:.2f}   "
        f"console CPU {statistics.median(cpu['upload']) / args.mb * 100:.2f} s per 100 MB",
        f"download {rate['download']:8.1f} MB/s   cp out {rate['cp out']:8.1f} MB/s   ratio {down:.2f}   "
        f"console CPU {statistics.median(cpu['download']) / args.mb * 100:.2f} s per 100 MB",
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    with open(args.out, "a") as out:
        out.write(text)


if __name__ == "__main__":
    main()
