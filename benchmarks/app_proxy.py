"""What the console's app proxy (issue 16, sessions/serving/proxy.py) adds: a session app reached
through `/sessions/<id>/apps/<name>/` on the apps origin (issue 31.4: make run's
http://localhost:<PORT + 1>, signed in there by the console's one-time ticket) against the same
app reached directly, in one run.

    .venv/bin/python benchmarks/app_proxy.py [--requests 500] [--download-mb 200] [--upload-mb 100] [--messages 500]
        [--repeat 5] [--downloads 3] [--client raw|httpx]

A standalone console (`manage.py standalone`: uvicorn, the embedded agent on the process runtime)
on a free port, with the image "host" declaring the app `echo` (tests/apps/echo_app.py served by
daphne inside a session; it writes the port and token the agent gave it to its home directory,
read back through the exec API, so the direct client can reach it with the token the proxy would
inject). The demo node's agent.toml is given a node key (`[manager] node-key`, which standalone
registers on the node's row), so the direct client derives the agent's relay key as the web does
(protocol.app_relay.relay_key) and starts each of its connections with the relay's proof, as the
web's proxy does (sessions.serving.relay_connect): a relay takes no connection without it.
One 0.5 fGPU session; the app is opened once; then, through the proxy and directly:

- latency: --requests sequential `GET echo` on one kept-alive connection (httpx): p50 / p99 ms;
- download: `GET bytes?n=…` of --download-mb MB (10^6 bytes), read as it streams, --downloads times a
  round (their median): MB/s, and the console process's CPU seconds per 100 MB (which moves less with
  the machine's load than the rate). `--client raw` (default): HTTP/1.1 on a plain socket, a new connection
  each, received into one buffer (as curl would), so the client is not the bottleneck; `--client
  httpx`: httpx's iter_raw on the kept connection (the figures before 2026-11-28 15:00; its parsing
  in this process held the direct download, which the proxy's figures were divided by);
- upload: `POST upload` of --upload-mb MB: MB/s (the app hashes it);
- websocket: --messages sequential round trips of a 100-byte text message: p50 / p99 ms;
- for scale, --requests `GET /api/v1/me/` of the console itself (Django with the same sign-in).

Prints a table and the proxy's added p50 latency; results go to stdout and are appended to --out (default
benchmarks/results/app_proxy.txt). The client runs in this process; the console and the app on
this machine (2 cores in CI): the figures include their competition for the CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import secrets
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpcore
import httpx
import psutil
from websockets.sync.client import connect

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from protocol.app_relay import relay_hello, relay_key  # noqa: E402
from tests.stack import PYTHON, Proc, free_port, wait_until  # noqa: E402

PASSWORD = "bench-app-proxy-password"
ECHO = (  # the app from the session's home (a sandboxed session sees no folder of this checkout), where it listens
    f'echo {{host}} {{port}} {{token}} > $HOME/.echo-app; PYTHONPATH="$HOME/apps" exec {PYTHON} -m daphne '
    "-b {host} -p {port} echo_app:application"
)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


NODE = "demo-node"  # demo/agent.toml's [agent] id


def keyed_agent_toml(work: Path, node_key: str) -> Path:
    """demo/agent.toml with `[manager] node-key`, in `work` (its mock inventory the demo's)."""
    demo = (ROOT / "demo" / "agent.toml").read_text()
    text = demo.replace('config = "mock-accelerator.toml"', f'config = "{ROOT / "demo" / "mock-accelerator.toml"}"')
    path = work / "agent.toml"
    path.write_text(text + f'\n[manager]\nnode-key = "{node_key}"\n')
    return path


class ProvenBackend(httpcore.SyncBackend):
    """httpcore's network backend that writes the relay's proof (`hello()`, a new one each time)
    first on each new connection, as the web's RelayBackend does."""

    def __init__(self, hello) -> None:
        self.hello = hello

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        stream = super().connect_tcp(host, port, timeout=timeout, local_address=local_address, socket_options=socket_options)
        stream.write(self.hello(), timeout=timeout)
        return stream


def proven_client(base_url: str, hello, **kwargs) -> httpx.Client:
    """An httpx client whose every new connection starts with `hello()` (None: a plain client)."""
    client = httpx.Client(base_url=base_url, **kwargs)
    if hello is not None:  # httpx offers no setting for the pool's network backend (as in the web's proxy)
        client._transport._pool._network_backend = ProvenBackend(hello)  # type: ignore[attr-defined]
    return client


def proven_socket(host: str, port: int, hello) -> socket.socket | None:
    """A socket connected to host:port with `hello()` written (None without `hello`)."""
    if hello is None:
        return None
    sock = socket.create_connection((host, port), timeout=30)
    sock.sendall(hello())
    return sock


def start_console(work: Path, node_key: str) -> tuple[Proc, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")}
    env.update(
        FGPU_AGENT_CONFIG=str(keyed_agent_toml(work, node_key)),
        FGPU_DATA_DIR=str(work / "data"),
        FGPU_ADMIN_PASSWORD=PASSWORD,
        PORT=str(port),
        PYTHONUNBUFFERED="1",
        FGPU_RUNTIME="process",  # the app runs from this checkout: not in a container (standalone picks docker where it runs)
        FGPU_STOP_SESSIONS_ON_EXIT="true",  # the session and its app end with the console (standalone keeps them else)
    )
    console = Proc("standalone", [PYTHON, "manage.py", "standalone"], env=env, log_dir=work)
    base = f"http://127.0.0.1:{port}"

    def ready():
        try:
            return httpx.get(base + "/login/", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, timeout=120, what="the standalone console")
    return console, base


def listeners(pid: int) -> set[tuple[str, int]]:
    """The TCP addresses process `pid` listens on."""
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}


def prepare(base: str, console_pid: int) -> tuple[httpx.Client, str, dict]:
    """An admin signed in (cookie), the session's id, and the app's direct address and token: where
    the proxy reaches it, the agent's relay into the session's sandbox (a network namespace of its
    own: the app listens on its loopback), found as the listener the console's process opened with
    the app."""
    api = httpx.Client(base_url=base, timeout=60)
    token = api.post("/api/v1/auth/token/", json={"username": "admin", "password": PASSWORD}).json()["token"]
    api.headers["Authorization"] = f"Token {token}"
    host = next(i for i in api.get("/api/v1/images/").json()["results"] if i["reference"] == "host")
    etag = api.get(f"/api/v1/images/{host['id']}/").headers["ETag"]
    api.patch(
        f"/api/v1/images/{host['id']}/",
        headers={"If-Match": etag},
        json={"apps": [{"name": "echo", "command": ECHO, "port": 8080, "timeout": 60}]},
    ).raise_for_status()
    session = api.post("/api/v1/sessions/", json={"name": "bench", "resources": {"cuda.shares": "0.5"}}).json()
    wait_until(
        lambda: api.get(f"/api/v1/sessions/{session['id']}/").json()["status"] == "RUNNING", timeout=60, what="the session to run"
    )
    api.put(
        f"/api/v1/sessions/{session['id']}/files/content/",
        params={"path": "apps/echo_app.py"},
        content=(ROOT / "tests" / "apps" / "echo_app.py").read_bytes(),
        headers={"Content-Type": "application/octet-stream"},
    ).raise_for_status()
    browser = httpx.Client(base_url=base, timeout=120)
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', browser.get("/login/").text).group(1)
    browser.post("/login/", data={"username": "admin", "password": PASSWORD, "csrfmiddlewaretoken": csrf})
    cookie = "; ".join(f"{k}={v}" for k, v in browser.cookies.items())
    before = listeners(console_pid)
    with connect(
        base.replace("http", "ws") + f"/ws/sessions/{session['id']}/open/echo/",
        additional_headers={"Cookie": cookie},
        open_timeout=60,
    ) as ws:
        answers = [json.loads(m) for m in ws]
    assert answers[-1]["type"] == "ready", answers
    out = api.post(f"/api/v1/sessions/{session['id']}/exec/", json={"command": "cat $HOME/.echo-app"}).json()
    bound, port, app_token = out["stdout"].split()
    relays = listeners(console_pid) - before
    host, port = next(iter(relays)) if len(relays) == 1 else (bound, int(port))  # no relay: the app on the node's network
    found = {"host": host, "port": port, "token": app_token, "cookie": cookie, "relayed": len(relays) == 1}
    return browser, session["id"], found


def apps_origin_client(base: str, browser: httpx.Client, prefix: str) -> tuple[str, httpx.Client]:
    """(the apps origin, a client signed in there to the app under `prefix`): the console's origin
    hands `browser` a one-time ticket (issue 31.4), which the apps origin turns into its cookie."""
    apps = f"http://localhost:{int(base.rsplit(':', 1)[1]) + 1}"  # make run's apps origin: localhost, PORT + 1
    hop = browser.get(prefix, follow_redirects=False)
    assert hop.status_code == 302 and hop.headers["location"].startswith(apps), hop.text
    client = httpx.Client(base_url=apps, timeout=120)
    landed = client.get(hop.headers["location"][len(apps) :], follow_redirects=False)
    assert landed.status_code == 302 and "fgpu_app" in client.cookies, landed.text
    return apps, client


def download_raw(address: tuple[str, int], target: str, headers: dict[str, str], hello=None) -> tuple[int, float]:
    """GET `target` on a new connection to `address` (`hello()` written first where given: the
    relay's proof), its body received into one buffer and dropped: (bytes of the body, seconds
    from the connection's start to its last byte). HTTP/1.1 on a plain socket, as curl would
    read it: the client is not what limits the rate (httpx's iter_raw spent more CPU a MB than
    the relay it measured)."""
    buffer = bytearray(4 << 20)
    view = memoryview(buffer)
    started = time.perf_counter()
    with socket.create_connection(address, timeout=120) as sock:
        if hello is not None:
            sock.sendall(hello())
        lines = [f"GET {target} HTTP/1.1", *(f"{name}: {value}" for name, value in headers.items()), "Connection: close"]
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        got = 0
        while (end := bytes(buffer[: min(got, 65536)]).find(b"\r\n\r\n")) < 0:
            n = sock.recv_into(view[got:])
            if not n:
                raise ConnectionError("the answer ended before its head")
            got += n
        head = bytes(buffer[:end]).decode("latin-1").split("\r\n")
        assert head[0].split()[1] == "200", head[0]
        fields = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in head[1:])}
        left = int(fields["content-length"]) - (got - end - 4)
        body = int(fields["content-length"])
        while left > 0:
            n = sock.recv_into(view)
            if not n:
                raise ConnectionError(f"the body ended {left} bytes short")
            left -= n
    return body, time.perf_counter() - started


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds process `pid` has spent so far."""
    return sum(psutil.Process(pid).cpu_times()[:2])


def measure(
    client: httpx.Client, prefix: str, ws_url: str, ws_headers: dict, args, ws_socket=lambda: None, raw=None, console=0
) -> dict:
    client.get(prefix + "echo").raise_for_status()  # warm: the connection, and the proxy's target
    times = []
    for _ in range(args.requests):
        started = time.perf_counter()
        client.get(prefix + "echo").raise_for_status()
        times.append((time.perf_counter() - started) * 1000)
    n = int(args.download_mb * 10**6)
    downloads = []
    spent = cpu_seconds(console)
    for _ in range(args.downloads):
        if raw is not None:  # (address, headers, hello): the raw client
            got, seconds = download_raw(raw[0], f"{prefix}bytes?n={n}", raw[1], raw[2])
        else:
            started, got = time.perf_counter(), 0
            with client.stream("GET", prefix + "bytes", params={"n": n}) as answer:
                for chunk in answer.iter_raw():
                    got += len(chunk)
            seconds = time.perf_counter() - started
        assert got == n, (got, n)
        downloads.append(seconds)
    download_s = statistics.median(downloads)
    download_cpu = (cpu_seconds(console) - spent) / (args.downloads * n / 1e8)  # the console's CPU s per 100 MB
    body = os.urandom(1 << 20) * int(args.upload_mb * 10**6 // (1 << 20))
    started = time.perf_counter()
    stored = client.post(prefix + "upload", content=body)
    upload_s = time.perf_counter() - started
    assert stored.json()["bytes"] == len(body), stored.text
    rtts, message = [], "m" * 100
    with connect(ws_url, additional_headers=ws_headers, open_timeout=30, compression=None, sock=ws_socket()) as ws:
        for _ in range(args.messages):
            started = time.perf_counter()
            ws.send(message)
            ws.recv(timeout=30)
            rtts.append((time.perf_counter() - started) * 1000)
    return {
        "p50_ms": statistics.median(times),
        "p99_ms": percentile(times, 99),
        "download_mb_s": n / 1e6 / download_s,
        "download_cpu_s": download_cpu,
        "upload_mb_s": len(body) / 1e6 / upload_s,
        "ws_p50_ms": statistics.median(rtts),
        "ws_p99_ms": percentile(rtts, 99),
    }


def web_parser() -> str:
    """The HTTP/1.1 parser the console's uvicorn runs (its `--http auto`: httptools where it can be
    imported, else h11); the console inherits this process's interpreter and PYTHONPATH."""
    return "httptools" if importlib.util.find_spec("httptools") else "h11"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--download-mb", type=float, default=200)
    parser.add_argument("--upload-mb", type=float, default=100)
    parser.add_argument("--messages", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=5, help="rounds, proxy and direct interleaved; medians are shown")
    parser.add_argument("--downloads", type=int, default=3, help="downloads a round (its figure: their median)")
    parser.add_argument(
        "--client",
        choices=["raw", "httpx"],
        default="raw",
        help="the downloads' client: HTTP/1.1 on a plain socket into one buffer (raw), or httpx's iter_raw",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "app_proxy.txt"))
    args = parser.parse_args()
    load = os.getloadavg()  # the machine may be shared: the figures include the competition for its CPUs
    node_key = secrets.token_urlsafe(32)  # as `manage.py node_key` makes one
    with tempfile.TemporaryDirectory(prefix="fgpu-app-proxy-") as tmp:
        console, base = start_console(Path(tmp), node_key)
        try:
            pid = console.popen.pid  # the web, its embedded agent and the agent's relays (not the app)
            browser, session_id, app = prepare(base, pid)
            prefix = f"/sessions/{session_id}/apps/echo/"
            apps, on_apps = apps_origin_client(base, browser, prefix)
            cookie = {"Cookie": f"fgpu_app={on_apps.cookies['fgpu_app']}"}
            direct_base = f"http://{_host(app['host'])}:{app['port']}"
            secret = relay_key(node_key)  # the relay key the web derives from the node's key

            def hello() -> bytes:
                return relay_hello(secret, node=NODE, session_id=session_id, app="echo")

            relayed = app["relayed"]
            proof = hello if relayed else None
            direct = proven_client(direct_base, proof, timeout=120, headers={"Authorization": f"token {app['token']}"})
            runs: dict[str, list[dict]] = {"proxy": [], "direct": []}
            api_times = []  # for scale: a small page of the console's own API on the same connection
            for round_ in range(args.repeat):  # interleaved, so that the machine's drift hits both alike
                for kind in ("proxy", "direct") if round_ % 2 == 0 else ("direct", "proxy"):
                    if kind == "proxy":
                        apps_host = {"Host": apps.split("//", 1)[1], **cookie}
                        raw: tuple | None = (
                            (("127.0.0.1", int(apps.rsplit(":", 1)[1])), apps_host, None) if args.client == "raw" else None
                        )
                        figures = measure(
                            on_apps, prefix, apps.replace("http", "ws") + prefix + "ws", cookie, args, raw=raw, console=pid
                        )
                    else:
                        direct_host = {"Host": direct_base.split("//", 1)[1], "Authorization": f"token {app['token']}"}
                        raw = ((app["host"], app["port"]), direct_host, proof) if args.client == "raw" else None
                        ws_url = direct_base.replace("http", "ws") + prefix + "ws"
                        figures = measure(
                            direct,
                            prefix,
                            ws_url,
                            {"Authorization": f"token {app['token']}"},
                            args,
                            ws_socket=lambda: proven_socket(app["host"], app["port"], proof),
                            raw=raw,
                            console=pid,
                        )
                    runs[kind].append({**figures, "load": os.getloadavg()[0]})
                    print(f"round {round_ + 1} {kind}: {json.dumps(runs[kind][-1])}", file=sys.stderr)
                for _ in range(args.requests):
                    started = time.perf_counter()
                    browser.get("/api/v1/me/").raise_for_status()
                    api_times.append((time.perf_counter() - started) * 1000)
        finally:
            console.stop()
    rows = [
        ("HTTP GET p50 (ms)", "p50_ms"),
        ("HTTP GET p99 (ms)", "p99_ms"),
        ("download (MB/s)", "download_mb_s"),
        ("download: console CPU s/100 MB", "download_cpu_s"),
        ("upload (MB/s)", "upload_mb_s"),
        ("websocket round trip p50 (ms)", "ws_p50_ms"),
        ("websocket round trip p99 (ms)", "ws_p99_ms"),
    ]
    proxy_loads = ", ".join(f"{run['load']:.1f}" for run in runs["proxy"])
    proxied = {key: statistics.median(run[key] for run in runs["proxy"]) for key in runs["proxy"][0]}
    straight = {key: statistics.median(run[key] for run in runs["direct"]) for key in runs["direct"][0]}
    lines = [
        f"app proxy vs direct ({args.requests} GETs, {args.download_mb:g} MB down, {args.upload_mb:g} MB up, "
        f"{args.messages} websocket messages; medians of {args.repeat} rounds, interleaved, a round's download the median of "
        f"{args.downloads} by the {args.client} client; standalone console, "
        + (
            "process runtime, direct: the agent's relay into the session's sandbox, which the proxy reaches, "
            "each connection proven as the web's are; "
            if relayed
            else "process runtime, no sandbox here (no relay: the app on the node's network), direct: the app's own "
            "address, which the proxy reaches; "
        )
        + f"uvicorn's HTTP/1.1 parser {web_parser()}; "
        + f"{os.cpu_count()} CPUs, load average {load[0]:.1f} before, {os.getloadavg()[0]:.1f} after, "
        f"{proxy_loads} after each proxy round)",
        f"{'':32}{'direct':>10}{'proxy':>10}{'proxy/direct':>14}",
    ]
    for label, key in rows:
        ratio = f"{proxied[key] / straight[key]:.2f}" if straight[key] else "-"  # direct CPU: the app's alone, none here
        lines.append(f"{label:32}{straight[key]:>10.2f}{proxied[key]:>10.2f}{ratio:>14}")
    lines.append(
        f"added latency per request (p50): {proxied['p50_ms'] - straight['p50_ms']:.2f} ms; per websocket "
        f"round trip (p50): {proxied['ws_p50_ms'] - straight['ws_p50_ms']:.2f} ms"
    )
    each = [p["download_mb_s"] / d["download_mb_s"] for p, d in zip(runs["proxy"], runs["direct"], strict=True)]
    lines.append(f"download proxy/direct by round: {', '.join(f'{x:.2f}' for x in each)}")
    lines.append(
        f"for scale, the console's own GET /api/v1/me/ (Django, sign-in by cookie): p50 "
        f"{statistics.median(api_times):.2f} ms, p99 {percentile(api_times, 99):.2f} ms"
    )
    text = "\n".join(lines) + "\n"
    print(text, end="")
    with Path(args.out).open("a") as out:  # appended: the file keeps every earlier run's figures and notes
        out.write(f"\n# {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {' '.join(sys.argv)}\n" + text)


if __name__ == "__main__":
    main()
