"""The files API against `cp` (issue 35.3: at least 0.5x both ways), in one run: a file of --mb MB
(10^6 bytes, random) uploaded into a session's home with `PUT /api/v1/sessions/<id>/files/content/`
and downloaded back with `GET` of the same path, against `cp` of the same file between two folders
of this machine (into the console's data folder, where the session's home lives, and out of it).

    .venv/bin/python benchmarks/files_api.py [--mb 100] [--repeat 3] [--out benchmarks/results/files_api.txt]

A standalone console (`manage.py standalone`, the embedded agent on the process runtime) on a free
port; one 0.5 fGPU session. Each round runs upload, `cp` in, download, `cp` out, in turn (every
other round `cp` first), so that the machine's drift hits them alike; each transfer's
bytes are checked (SHA-256 of the download against the file). The client streams from and to a
file in 1 MiB pieces (httpx), in this process. Prints MB/s (medians of the rounds) and the ratios,
with the load average; the figures include the console's competition for the machine's CPUs.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.app_proxy import PASSWORD, start_console  # noqa: E402
from tests.stack import wait_until  # noqa: E402

PIECE = 1 << 20


def _pieces(path: Path):
    with open(path, "rb") as source:
        while piece := source.read(PIECE):
            yield piece


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


def download(api: httpx.Client, session_id: str, target: Path, digest: str) -> float:
    started, hashed = time.perf_counter(), hashlib.sha256()
    with api.stream("GET", f"/api/v1/sessions/{session_id}/files/content/", params={"path": "bench.bin"}) as answer:
        answer.raise_for_status()
        with open(target, "wb") as out:
            for chunk in answer.iter_raw(PIECE):
                out.write(chunk)
                hashed.update(chunk)
    elapsed = time.perf_counter() - started
    assert hashed.hexdigest() == digest, "the download differs from the file uploaded"
    return elapsed


def cp(source: Path, target: Path) -> float:
    started = time.perf_counter()
    subprocess.run(["cp", str(source), str(target)], check=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "files_api.txt"))
    args = parser.parse_args()
    size = int(args.mb * 10**6)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="fgpu-files-api-") as tmp:
        work = Path(tmp)
        console, base = start_console(work)
        try:
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
            digest = hashlib.sha256(source.read_bytes()).hexdigest()
            into, back = work / "data" / "cp-in.bin", work / "cp-out.bin"  # the data folder holds the sessions' homes
            times: dict[str, list[float]] = {"upload": [], "cp in": [], "download": [], "cp out": []}
            loads = []
            for round_ in range(args.repeat):
                order = (
                    ["upload", "cp in", "download", "cp out"] if round_ % 2 == 0 else ["cp in", "upload", "cp out", "download"]
                )
                for kind in order:
                    if kind == "upload":
                        times[kind].append(upload(api, session["id"], source))
                    elif kind == "download":
                        times[kind].append(download(api, session["id"], landed, digest))
                    elif kind == "cp in":
                        times[kind].append(cp(source, into))
                    else:
                        times[kind].append(cp(into, back))
                loads.append(os.getloadavg()[0])
                print(f"round {round_ + 1}: " + ", ".join(f"{k} {size / 1e6 / v[-1]:.1f} MB/s" for k, v in times.items()))
            for path in (into, back, landed):
                path.unlink(missing_ok=True)
        finally:
            console.stop()
            shutil.rmtree(work / "data", ignore_errors=True)
    rate = {kind: size / 1e6 / statistics.median(values) for kind, values in times.items()}
    up, down = rate["upload"] / rate["cp in"], rate["download"] / rate["cp out"]
    lines = [
        f"files API vs cp ({args.mb:g} MB, medians of {args.repeat} rounds, interleaved; standalone console, process "
        f"runtime, {os.cpu_count()} CPUs, load average {load[0]:.1f} before, "
        f"{', '.join(f'{x:.1f}' for x in loads)} after each round)",
        f"upload   {rate['upload']:8.1f} MB/s   cp in  {rate['cp in']:8.1f} MB/s   ratio {up:.2f}",
        f"download {rate['download']:8.1f} MB/s   cp out {rate['cp out']:8.1f} MB/s   ratio {down:.2f}",
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
