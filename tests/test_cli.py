"""The `fgpu` command line without the stack: flags → request bodies (checked against the
server's own request parser), session resolution, tables and formats, the config file's
permissions, exit codes against a small in-process HTTP server, and the exec wrapping against a
real local shell on a PTY. The whole flow against the distributed stack: test_cli_e2e.py."""
from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import threading
import urllib.parse
import uuid
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest


from accelerators.allocation.requests import parse_resources
from fgpu_cli import config, main as cli
from protocol.environment import DeviceLimit, limits_environment
from protocol.messages import HardwareId
from fgpu_cli.formatting import age, amount, printable, size, table
from fgpu_cli.launch import UsageError, build_body, build_resources
from fgpu_cli.sessions import NotFound, pick

GiB = 1 << 30
FGPU = str(Path(sys.executable).parent / "fgpu")
SID = "0c2b3c5e-7d1a-4a57-9f61-1a2b3c4d5e6f"


# --- a tiny API server --------------------------------------------------------------------

class FakeApi:
    """Routes: (method, path) → (status, body) or a callable(request) → (status, body).
    Every request is recorded as {"method", "path", "query", "body", "headers"}."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], object] = {}
        self.requests: list[dict] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _handle(self):
                parsed = urllib.parse.urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                request = {"method": self.command, "path": parsed.path,
                           "query": dict(urllib.parse.parse_qsl(parsed.query)),
                           "body": json.loads(raw) if raw else None, "headers": dict(self.headers)}
                api.requests.append(request)
                route = api.routes.get((self.command, parsed.path))
                if route is None:
                    status, body = 404, {"type": "not-found", "title": "Not found", "detail": "Not found.",
                                         "field_errors": {}}
                else:
                    status, body = route(request) if callable(route) else route
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api(monkeypatch, tmp_path):
    server = FakeApi()
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("FGPU_URL", server.url)
    monkeypatch.setenv("FGPU_TOKEN", "t0ken")
    monkeypatch.setattr(cli, "POLL_INTERVAL", 0.01)
    yield server
    server.close()


@pytest.fixture
def no_login(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("FGPU_URL", raising=False)
    monkeypatch.delenv("FGPU_TOKEN", raising=False)
    return tmp_path / "config" / "fgpu" / "config.json"


def error_json(status, detail, **fields):
    return status, {"type": "invalid-request", "title": "Invalid request", "detail": detail, "field_errors": fields}


def session(**kw):
    base = {"id": SID, "name": "demo", "owner": "alice", "status": "RUNNING", "status_reason": "", "node": "node-1",
            "resources": {"cuda.shares": "0.5"}, "priority": 0, "configuration": "0.50 fGPU · 1 core · 1 GiB",
            "allocations": [], "command": "", "created_at": "2026-01-01T00:00:00Z", "scheduled_at": None,
            "started_at": None, "terminated_at": None, "exit_code": None, "terminal_url": f"/sessions/{SID}/terminal/"}
    return {**base, **kw}


def allocation(**kw):
    return {"device": "GPU-aaaa", "device_index": 0, "model_name": "CUDA GPU", "shares": "0.500",
            "memory": 2 * GiB, "procs": "20.000", "released_at": None, **kw}


def one_line_error(err: str) -> str:
    assert err.startswith("fgpu: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err[len("fgpu: error: "):].strip()


# --- flags → request bodies -----------------------------------------------------------------

@pytest.mark.parametrize("flags, resources", [
    ({"gpu": "0.5"}, {"gpu_fraction": "0.5"}),
    ({"gpu": "0.25"}, {"gpu_fraction": "0.25"}),
    ({"gpu": "1"}, {"gpu": 1, "gpu_memory_percentage": 100, "gpu_cores": 100}),
    ({"gpu": "2.0"}, {"gpu": 2, "gpu_memory_percentage": 100, "gpu_cores": 100}),
    ({"gpu_memory": "4G"}, {"gpu": 1, "gpu_memory": "4G"}),
    ({"gpu_memory": "4G", "gpu_cores": 60, "gpus": 2}, {"gpu": 2, "gpu_memory": "4G", "gpu_cores": 60}),
    ({"gpu_cores": 30}, {"gpu": 1, "gpu_cores": 30}),
    ({"fgpu": "2.5"}, {"cuda.shares": "2.5"}),
    ({"fgpu": "0.50"}, {"cuda.shares": "0.5"}),
    ({"mig_profile": "2g.20gb"}, {"mig_profile": "2g.20gb"}),
    ({"gpu_memory": "15G", "isolation": "mig"}, {"gpu": 1, "gpu_memory": "15G", "isolation": "mig"}),
    ({"gpu_memory": "15G", "isolation": "any"}, {"gpu": 1, "gpu_memory": "15G", "isolation": "any"}),
    ({"fgpu": "1", "cpu": 2, "mem": "8G"}, {"cuda.shares": "1", "cpu": 2, "mem": "8G"}),
    ({"cpu": 4}, {"cpu": 4}),
    ({}, {}),
])
def test_launch_flags_map_to_the_request_styles(flags, resources):
    assert build_resources(**flags) == resources


@pytest.mark.parametrize("flags, kind, amount_, memory, cores", [
    ({"gpu": "0.5"}, "per_device", 1, ("percent", Decimal(50)), Decimal(50)),  # Run:ai: half its memory and SMs
    ({"gpu": "2"}, "per_device", 2, ("percent", Decimal(100)), Decimal(100)),
    ({"gpu_memory": "4G", "gpu_cores": 60, "gpus": 2}, "per_device", 2, ("bytes", 4 * GiB), Decimal(60)),
    ({"fgpu": "2.5"}, "shares", Decimal("2.5"), None, Decimal(0)),
])
def test_the_bodies_are_what_the_server_parses(flags, kind, amount_, memory, cores):
    request = parse_resources(build_resources(**flags))
    assert (request.kind, request.amount, request.cores) == (kind, Decimal(amount_), cores)
    if memory:
        assert getattr(request.memory, memory[0]) == memory[1]


@pytest.mark.parametrize("flags, message", [
    ({"gpu": "0.5", "fgpu": "1"}, "cannot be combined"),
    ({"gpu": "1", "gpu_memory": "4G"}, "cannot be combined"),
    ({"fgpu": "1", "mig_profile": "1g.5gb"}, "cannot be combined"),
    ({"gpu": "1.5"}, "use --fgpu 1.5"),
    ({"gpu": "0"}, "above 0"),
    ({"gpu": "-1"}, "above 0"),
    ({"gpu": "half"}, "not a number"),
    ({"fgpu": "NaN"}, "above 0"),
    ({"gpu_memory": "lots"}, "not a size"),
    ({"gpu_memory": "4G", "gpu_cores": 120}, "0 to 100"),
    ({"gpu_memory": "4G", "gpus": 0}, "at least 1"),
    ({"mem": "1.5"}, None),  # shape accepted here; the server refuses a bare fraction
    ({"cpu": 0}, "at least 1 core"),
    ({"isolation": "mig"}, "goes with --gpu-memory"),
    ({"gpu_cores": 30, "isolation": "mig"}, "goes with --gpu-memory"),
    ({"mig_profile": "1g.10gb", "isolation": "mig"}, "goes with --gpu-memory"),
])
def test_bad_launch_flags_are_usage_errors(flags, message):
    if message is None:
        build_resources(**flags)
        return
    with pytest.raises(UsageError, match=message):
        build_resources(**flags)


def test_name_command_and_priority_go_with_the_resources():
    assert build_body(name="n", command="python train.py", priority=5, fgpu="0.5") == {
        "resources": {"cuda.shares": "0.5"}, "name": "n", "command": "python train.py", "priority": 5}
    assert build_body(fgpu="0.5") == {"resources": {"cuda.shares": "0.5"}}


def test_bad_usage_exits_2_without_a_server(no_login, capsys):
    assert cli.main(["launch", "--gpu", "0.5", "--fgpu", "1"]) == 2
    assert "cannot be combined" in one_line_error(capsys.readouterr().err)
    with pytest.raises(SystemExit) as exc:
        cli.main(["launch", "--cpu", "many"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        cli.main(["frobnicate"])
    assert exc.value.code == 2
    assert cli.main(["exec", "demo"]) == 2  # no command


# --- session resolution ---------------------------------------------------------------------

SESSIONS = [
    {"id": "aaaa1111-0000-4000-8000-000000000001", "name": "train", "owner": "alice", "status": "RUNNING",
     "created_at": "2026-01-02T00:00:00Z"},
    {"id": "aaaa2222-0000-4000-8000-000000000002", "name": "train", "owner": "alice", "status": "TERMINATED",
     "created_at": "2026-01-01T00:00:00Z"},
    {"id": "bbbb3333-0000-4000-8000-000000000003", "name": "notebook", "owner": "alice", "status": "PENDING",
     "created_at": "2026-01-03T00:00:00Z"},
    {"id": "cccc4444-0000-4000-8000-000000000004", "name": "notebook", "owner": "bob", "status": "RUNNING",
     "created_at": "2026-01-03T00:00:00Z"},
    {"id": "dddd5555-0000-4000-8000-000000000005", "name": "old", "owner": "alice", "status": "ERROR",
     "created_at": "2026-01-01T00:00:00Z"},
    {"id": "dddd6666-0000-4000-8000-000000000006", "name": "old", "owner": "alice", "status": "TERMINATED",
     "created_at": "2026-01-04T00:00:00Z"},
    {"id": "eeee7777-0000-4000-8000-000000000007", "name": "twin", "owner": "alice", "status": "RUNNING",
     "created_at": "2026-01-01T00:00:00Z"},
    {"id": "eeee8888-0000-4000-8000-000000000008", "name": "twin", "owner": "alice", "status": "PENDING",
     "created_at": "2026-01-01T00:00:00Z"},
]


@pytest.mark.parametrize("ref, username, expected", [
    ("aaaa2222-0000-4000-8000-000000000002", "alice", "aaaa2222"),  # full id, even an ended one
    ("AAAA2222-0000-4000-8000-000000000002", "alice", "aaaa2222"),
    ("train", "alice", "aaaa1111"),  # the live one of two named alike
    ("old", "alice", "dddd6666"),  # all ended: the latest
    ("notebook", "alice", "bbbb3333"),  # the caller's own, not bob's
    ("bbbb", "alice", "bbbb3333"),  # unique prefix
    ("cccc4", "", "cccc4444"),
])
def test_a_session_is_named_by_id_prefix_or_name(ref, username, expected):
    assert pick(SESSIONS, ref, username=username)["id"].startswith(expected)


@pytest.mark.parametrize("ref, username, message", [
    ("aaaa", "alice", "start of 2 session ids"),
    ("twin", "alice", "2 live sessions are named 'twin'"),
    ("notebook", "", "2 live sessions"),  # staff without a known username: ambiguous
    ("nothing", "alice", "no session 'nothing'"),
    ("ffff", "alice", "no session 'ffff'"),
    ("", "alice", "needed"),
])
def test_ambiguous_or_unknown_references_are_refused(ref, username, message):
    with pytest.raises(NotFound, match=message):
        pick(SESSIONS, ref, username=username)


# --- formats --------------------------------------------------------------------------------

def test_tables_amounts_sizes_and_ages():
    assert table(["A", "LONGER"], [["x", None], ["yyyy", "z"]]).splitlines() == ["A     LONGER", "x     -", "yyyy  z"]
    assert amount("1.5") == "1.50 fGPU"
    assert amount("0.125", round_length=2) == "0.12 fGPU"  # truncated, never shown larger
    assert amount("2", unit="GPU", round_length=0) == "2 GPU"
    assert amount("1500", round_length=1) == "1.5k fGPU"
    assert amount(None) == "-"
    assert (size(8 * GiB), size(3 * GiB // 2), size(512 << 20)) == ("8 GiB", "1.5 GiB", "512 MiB")
    from datetime import datetime, timezone
    now = datetime(2026, 1, 1, 1, 0, 0, tzinfo=timezone.utc)
    assert [age(t, now) for t in ("2026-01-01T00:59:30Z", "2026-01-01T00:55:00Z", "2025-12-31T22:00:00+00:00",
                                  None)] == ["30s", "5m", "3h", "-"]


# --- login and the config file --------------------------------------------------------------

def test_login_stores_the_token_with_mode_0600(api, no_login, monkeypatch, capsys):
    api.routes[("POST", "/api/v1/auth/token/")] = (200, {"token": "s3cr3t"})
    api.routes[("GET", "/api/v1/me/")] = (200, {"username": "alice", "is_admin": False})
    no_login.parent.mkdir(parents=True)
    no_login.write_text("{}")
    os.chmod(no_login, 0o644)  # an old, too open file is replaced
    monkeypatch.setattr(sys, "stdin", io.StringIO("pass word\n"))
    assert cli.main(["login", api.url + "/", "--username", "alice", "--password-stdin"]) == 0
    token_request, confirmation = api.requests[-2:]
    assert token_request["body"] == {"username": "alice", "password": "pass word"}
    assert "Authorization" not in token_request["headers"]
    # The token is tried at once.
    assert (confirmation["path"], confirmation["headers"]["Authorization"]) == ("/api/v1/me/", "Token s3cr3t")
    assert stat.S_IMODE(no_login.stat().st_mode) == 0o600
    assert stat.S_IMODE(no_login.parent.stat().st_mode) == 0o700
    assert json.loads(no_login.read_text()) == {"url": api.url, "token": "s3cr3t", "username": "alice"}
    assert "Logged in" in capsys.readouterr().err

    # The stored login is used…
    api.routes[("GET", "/api/v1/sessions/")] = (200, {"count": 0, "next": None, "results": []})
    assert cli.main(["ps"]) == 0
    assert api.requests[-1]["headers"]["Authorization"] == "Token s3cr3t"
    # …unless the environment overrides it.
    monkeypatch.setenv("FGPU_TOKEN", "from-env")
    assert cli.main(["ps"]) == 0
    assert api.requests[-1]["headers"]["Authorization"] == "Token from-env"

    assert cli.main(["logout"]) == 0 and not no_login.exists()


def test_login_refused_and_password_prompt(api, no_login, monkeypatch, capsys):
    api.routes[("POST", "/api/v1/auth/token/")] = error_json(400, "Unable to log in with provided credentials.")
    monkeypatch.setattr(sys, "stdin", io.StringIO("wrong\n"))
    assert cli.main(["login", api.url, "-u", "alice", "--password-stdin"]) == 1
    assert one_line_error(capsys.readouterr().err) == "login refused: Unable to log in with provided credentials."
    assert not no_login.exists()

    api.routes[("POST", "/api/v1/auth/token/")] = (200, {"token": "tok"})
    monkeypatch.setattr(cli.getpass, "getpass", lambda prompt: "typed")
    api.routes[("GET", "/api/v1/me/")] = (200, {"username": "alice", "is_admin": True, "projects": [],
                                                "live_sessions": 0, "quota_headroom": {}})
    assert cli.main(["login", api.url, "-u", "alice"]) == 0
    assert api.requests[-2]["body"]["password"] == "typed"
    assert "as alice (administrator)" in capsys.readouterr().err


def test_whoami_shows_the_user_role_projects_and_headroom(api, capsys):
    api.routes[("GET", "/api/v1/me/")] = (200, {
        "username": "alice", "is_admin": False, "projects": ["vision", "nlp"], "live_sessions": 2,
        "quota_headroom": {"fgpu": "1.500", "devices": None, "gpu_memory": 6 * GiB, "sessions": 3}})

    assert cli.main(["whoami"]) == 0
    out = capsys.readouterr().out
    assert "User:           alice\n" in out and "Projects:       vision, nlp\n" in out
    assert "Headroom:       1.50 fGPU, unlimited devices, 6 GiB GPU memory, 3 sessions" in out
    assert cli.main(["whoami", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["projects"] == ["vision", "nlp"]


def test_config_path_follows_xdg(tmp_path):
    assert config.config_path({"XDG_CONFIG_HOME": str(tmp_path)}) == tmp_path / "fgpu" / "config.json"
    assert config.config_path({"HOME": "/x"}).name == "config.json"
    assert config.normalize_url("localhost:8000/") == "http://localhost:8000"
    with pytest.raises(ValueError):
        config.normalize_url("ftp://x")


# --- exit codes -----------------------------------------------------------------------------

def test_not_logged_in_and_unreachable_exit_3(no_login, monkeypatch, capsys):
    assert cli.main(["ps"]) == 3
    assert "not logged in" in one_line_error(capsys.readouterr().err)
    monkeypatch.setenv("FGPU_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("FGPU_TOKEN", "x")
    assert cli.main(["nodes"]) == 3
    assert "cannot reach http://127.0.0.1:1" in one_line_error(capsys.readouterr().err)


def test_a_rejected_token_exits_3(api, capsys):
    api.routes[("GET", "/api/v1/sessions/")] = (401, {"type": "not-authenticated", "title": "Not authenticated",
                                                      "detail": "Invalid token.", "field_errors": {}})
    assert cli.main(["ps"]) == 3
    assert one_line_error(capsys.readouterr().err).startswith("Invalid token.")


def test_a_refusal_exits_1_with_the_servers_detail_on_one_line(api, capsys):
    api.routes[("POST", "/api/v1/sessions/")] = error_json(
        400, "no node has 5 fGPU:\n node-1 has 2.00", **{"resources": ["too much"]})
    assert cli.main(["launch", "--fgpu", "5"]) == 1
    assert one_line_error(capsys.readouterr().err) == "no node has 5 fGPU: node-1 has 2.00"
    api.routes[("POST", "/api/v1/sessions/")] = (400, {"resources": ["resources.mig_profile: unknown resource"]})
    assert cli.main(["launch", "--mig-profile", "1g.5gb"]) == 1  # DRF's plain field errors are read too
    assert one_line_error(capsys.readouterr().err) == "resources: resources.mig_profile: unknown resource"
    api.routes[("POST", "/api/v1/sessions/")] = (500, None)
    assert cli.main(["launch", "--fgpu", "1"]) == 1
    assert "500" in one_line_error(capsys.readouterr().err)


def test_the_console_script_prints_no_traceback(tmp_path):
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path), "FGPU_URL": "http://127.0.0.1:1", "FGPU_TOKEN": "x"}
    out = subprocess.run([FGPU, "ps"], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 3 and out.stderr.startswith("fgpu: error: cannot reach") and "Traceback" not in out.stderr
    out = subprocess.run([FGPU, "launch", "--gpu"], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "Traceback" not in out.stderr


# --- commands against the fake API ----------------------------------------------------------

def test_launch_posts_the_body_and_prints_the_id(api, capsys):
    api.routes[("POST", "/api/v1/sessions/")] = (201, session(status="PENDING"))
    assert cli.main(["launch", "--name", "demo", "--gpu", "0.5", "--cpu", "2", "--mem", "8G"]) == 0
    assert api.requests[-1]["body"] == {"name": "demo", "resources": {"gpu_fraction": "0.5", "cpu": 2, "mem": "8G"}}
    out = capsys.readouterr()
    assert out.out == SID + "\n" and "PENDING" in out.err
    assert cli.main(["launch", "--fgpu", "0.5", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == SID


def test_launch_wait_follows_the_status_until_running(api, capsys):
    states = iter([session(status="PENDING", status_reason="waiting for 0.5 fGPU"), session(status="SCHEDULED"),
                   session(status="PREPARING"), session(status="RUNNING")])
    api.routes[("POST", "/api/v1/sessions/")] = (201, session(status="PENDING", status_reason="waiting for 0.5 fGPU"))
    api.routes[("GET", f"/api/v1/sessions/{SID}/")] = lambda request: (200, next(states))
    assert cli.main(["--output", "json", "launch", "--fgpu", "0.5", "--wait"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["status"] == "RUNNING"
    assert [line.split()[-1] for line in out.err.splitlines()[1:]] == ["SCHEDULED", "PREPARING", "RUNNING"]


def test_launch_wait_fails_with_the_reason_or_times_out(api, capsys):
    api.routes[("POST", "/api/v1/sessions/")] = (201, session(status="PENDING"))
    api.routes[("GET", f"/api/v1/sessions/{SID}/")] = (200, session(status="ERROR", status_reason="no such image"))
    assert cli.main(["launch", "--fgpu", "0.5", "--wait"]) == 1
    assert one_line_error(capsys.readouterr().err.splitlines()[-1] + "\n") == "session demo is ERROR: no such image"
    api.routes[("GET", f"/api/v1/sessions/{SID}/")] = (200, session(status="PENDING", status_reason="queue"))
    assert cli.main(["launch", "--fgpu", "0.5", "--wait", "--timeout", "0.2"]) == 1
    assert "timed out after 0.2 s: session demo is still PENDING (queue)" in capsys.readouterr().err


def test_ps_pages_filters_and_prints_json_or_a_table(api, capsys):
    second = f"{api.url}/api/v1/sessions/?limit=1&offset=1"
    pages = {None: {"count": 2, "next": second, "results": [session()]},
             "1": {"count": 2, "next": None, "results": [session(id="1" * 8 + SID[8:], name="other",
                                                                  status="PENDING", status_reason="no room")]}}
    api.routes[("GET", "/api/v1/sessions/")] = lambda request: (200, pages[request["query"].get("offset")])
    assert cli.main(["ps", "--output", "json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in listed] == ["demo", "other"]
    assert api.requests[0]["query"]["status"] == "PENDING,SCHEDULED,PREPARING,RUNNING,TERMINATING"
    assert cli.main(["ps", "--all"]) == 0
    assert "status" not in api.requests[-2]["query"]
    text = capsys.readouterr().out.splitlines()
    assert text[0].split() == ["ID", "NAME", "OWNER", "STATUS", "NODE", "RESOURCES", "AGE", "REASON"]
    assert text[1].startswith(SID[:8]) and "RUNNING" in text[1] and "no room" in text[2]
    assert cli.main(["ps", "--status", "running", "--owner", "alice", "--node", "node-1"]) == 0
    assert api.requests[-2]["query"] == {"limit": "500", "status": "RUNNING", "owner": "alice", "node": "node-1"}


def test_describe_shows_allocation_environment_and_pending_reason(api, capsys):
    environment = limits_environment([DeviceLimit(HardwareId("GPU-aaaa"), 2 * GiB, "20.000", 80)])  # as the server computes it
    api.routes[("GET", f"/api/v1/sessions/{SID}/")] = (200, session(allocations=[allocation()], environment=environment))
    assert cli.main(["describe", SID]) == 0
    out = capsys.readouterr().out
    for text in ("Status:", "RUNNING", "CUDA_DEVICE_MEMORY_LIMIT_0:  2048m", "CUDA_DEVICE_SM_LIMIT:        25",
                 "GPU-aaaa", "0.50"):
        assert text in out, out
    assert cli.main(["describe", SID, "-o", "json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["environment"] == environment and described["id"] == SID  # the API's, as it is

    api.routes[("GET", f"/api/v1/sessions/{SID}/")] = (200, session(status="PENDING", node=None,
                                                                     status_reason="waiting: node-1 has 0.25 fGPU free"))
    assert cli.main(["describe", SID]) == 0
    out = capsys.readouterr().out
    assert "Pending reason:  waiting: node-1 has 0.25 fGPU free" in out and "Allocation: none yet" in out

    # With the server's estimate (GET …/eta/): the band, the queue place, what would make room.
    api.routes[("GET", f"/api/v1/sessions/{SID}/eta/")] = (200, {
        "session": SID, "outcome": "estimate", "earliest": "2026-11-26T09:40:00Z", "latest": "2026-11-26T10:30:00Z",
        "reason": "", "position": 2, "waiting_reason": "waiting: node-1 has 0.25 fGPU free", "fits_now": False,
        "fits_after": [{"session": None, "name": None, "owner": None, "node": "node-1",
                        "ends_earliest": "2026-11-26T09:40:00Z", "ends_latest": "2026-11-26T10:30:00Z",
                        "basis": "maximum lifetime of 8 h"}], "computed_at": "2026-11-26T09:00:00Z"})
    assert cli.main(["describe", SID]) == 0
    out = capsys.readouterr().out
    assert "When will it start:" in out
    assert "Estimated start:      2026-11-26 09:40 UTC – 10:30 UTC (" in out, out
    assert "Place in queue:       2" in out
    assert ("Fits once these end:  another user's session on node-1 ends 2026-11-26 09:40 UTC – 10:30 UTC"
            in out), out
    assert cli.main(["describe", SID, "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["eta"]["position"] == 2


def test_describe_names_the_smaller_mig_profiles_free_now(api, capsys):
    api.routes[("GET", f"/api/v1/sessions/{SID}/")] = (200, session(status="PENDING", node=None,
                                                                     status_reason="waiting for capacity: mig-node: …"))
    api.routes[("GET", f"/api/v1/sessions/{SID}/eta/")] = (200, {
        "session": SID, "outcome": "unknown", "earliest": None, "latest": None, "reason": "no estimate", "position": 1,
        "waiting_reason": "", "fits_now": False, "fits_after": [], "computed_at": "2026-11-26T09:00:00Z",
        "mig_now": [{"profile": "3g.40gb", "memory": 42413948928}, {"profile": "1g.10gb", "memory": 10468982784}]})
    assert cli.main(["describe", SID]) == 0
    out = capsys.readouterr().out
    assert "Smaller MIG now:" in out and "3g.40gb (39.5 GiB), 1g.10gb (9.8 GiB)" in out, out

    api.routes.pop(("GET", f"/api/v1/sessions/{SID}/"))
    assert cli.main(["describe", SID]) == 1
    assert "no session" in one_line_error(capsys.readouterr().err)


def test_rm_ends_each_session_and_reports_the_unknown(api, capsys):
    api.routes[("GET", "/api/v1/sessions/")] = (200, {"count": 1, "next": None, "results": [session()]})
    api.routes[("DELETE", f"/api/v1/sessions/{SID}/")] = (202, session(status="TERMINATING"))
    assert cli.main(["rm", "demo", "ghost"]) == 1
    out = capsys.readouterr()
    assert out.out == f"{SID}  TERMINATING\n"
    assert one_line_error(out.err) == "ghost: no session 'ghost'"
    assert [r["method"] for r in api.requests].count("DELETE") == 1


def test_exec_refuses_a_session_that_is_not_running(api, capsys):
    api.routes[("GET", f"/api/v1/sessions/{SID}/")] = (200, session(status="PENDING", status_reason="no room"))
    assert cli.main(["exec", SID, "--", "nvidia-smi"]) == 1
    assert "is PENDING: no room" in one_line_error(capsys.readouterr().err)
    assert not [r for r in api.requests if r["path"].endswith("/exec/")]


DEVICE = {"id": 1, "node": "node-1", "slot_name": "cuda", "device_id": "GPU-aaaa", "index": 0, "model_name": "A100",
          "memory_size": 8 * GiB, "subproc_count": 80, "is_mig_device": False, "mig_profile": "",
          "capacity_fgpu": "2.00", "allocated_fgpu": "1.50", "free_fgpu": "0.50"}


def test_devices_and_nodes_tables_use_the_slot_format(api, capsys):
    api.routes[("GET", "/api/v1/devices/")] = (200, {"count": 1, "next": None, "results": [
        {**DEVICE, "allocated_memory": 6 * GiB, "allocated_procs": "60.000", "session_count": 2}]})
    api.routes[("GET", "/api/v1/slot-formats/")] = (200, {"count": 1, "next": None, "results": [
        {"slot_name": "cuda", "subtype": "shares", "display_unit": "fGPU",
         "number_format": {"binary": False, "round_length": 2}}]})
    assert cli.main(["devices"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:8] == ["NODE", "INDEX", "MODEL", "MEMORY", "SMs", "CAPACITY", "ALLOCATED", "FREE"]
    assert lines[1].split() == ["node-1", "0", "A100", "8", "GiB", "80", "2.00", "fGPU", "1.50", "fGPU", "0.50",
                                "fGPU", "6", "GiB", "60", "2"]

    api.routes[("GET", "/api/v1/devices/")] = lambda request: (200, {"count": 0, "next": None, "results": []})
    assert cli.main(["devices", "--node", "nowhere"]) == 1
    capsys.readouterr()
    node = {"name": "node-1", "status": "ALIVE", "resource_group": None, "cpu_count": 8, "memory_size": 32 * GiB,
            "last_heartbeat": None, "devices": [{k: v for k, v in DEVICE.items() if k != "node"}]}
    api.routes[("GET", "/api/v1/nodes/")] = (200, {"count": 1, "next": None, "results": [node]})
    assert cli.main(["nodes"]) == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert row.split()[:2] == ["node-1", "ALIVE"] and "2.00 fGPU" in row and "0.50 fGPU" in row
    assert cli.main(["nodes", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["devices"][0]["free_fgpu"] == "0.50"


def test_quota_table(api, capsys):
    figures = {"fgpu": "2.000", "devices": None, "gpu_memory": 8 * GiB, "sessions": 4}
    api.routes[("GET", "/api/v1/quota/")] = (200, {"user": "alice", "quotas": [
        {"id": "q", "scope": "user", "name": "alice", "limits": figures,
         "used": {"fgpu": "0.500", "devices": 1, "gpu_memory": 2 * GiB, "sessions": 1},
         "remaining": {"fgpu": "1.500", "devices": None, "gpu_memory": 6 * GiB, "sessions": 3}}],
        "headroom": {"fgpu": "1.500", "devices": None, "gpu_memory": 6 * GiB, "sessions": 3}})
    assert cli.main(["quota"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("  ") for line in out.splitlines()]
    assert [c.strip() for c in rows[2] if c.strip()] == ["user alice", "fGPU", "2.00 fGPU", "0.50 fGPU", "1.50 fGPU"]
    assert [c.strip() for c in rows[3] if c.strip()] == ["user alice", "devices", "unlimited", "1", "unlimited"]
    assert "Headroom (what you may still launch): 1.50 fGPU, unlimited devices, 6 GiB GPU memory, 3 sessions" in out
    assert cli.main(["quota", "--output", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["user"] == "alice"


# --- exec and logs through the REST API ----------------------------------------------------

def test_exec_past_its_timeout_exits_1_with_the_servers_reason(api, capsys):
    api.routes[("GET", f"/api/v1/sessions/{SID}/")] = (200, session())
    api.routes[("POST", f"/api/v1/sessions/{SID}/exec/")] = (504, {
        "type": "exec-timeout", "title": "Exec timed out", "field_errors": {},
        "detail": "the command ran longer than its timeout of 30 s and was killed; pass a larger \"timeout\""})

    assert cli.main(["exec", SID, "--", "sleep", "99"]) == 1
    assert "timeout of 30 s" in one_line_error(capsys.readouterr().err)


EID = "5b0f3c1e-8a52-4d3e-9c55-0d0c9f1b2a77"
EXEC_PATH = f"/api/v1/sessions/{SID}/exec/{EID}/"


def exec_state(**kw):
    state = kw.get("state", "running")
    return {"id": EID, "session": SID, "command": "x", "timeout": 30, "state": state,
            "running": state in ("starting", "running"), "exit_code": None, "cancelled": state == "cancelled",
            "timed_out": state == "timed_out", "error": "", "truncated": False, "duration_ms": None,
            "created_at": "2026-01-01T00:00:00Z", **kw}


def exec_read(since: int, *chunks, **kw):
    body = exec_state(**kw)
    return {**body, "chunks": [{"stream": stream, "data": data} for stream, data in chunks], "since": since,
            "next": since + len(chunks), "complete": not body["running"]}


@pytest.fixture
def streamed(api, monkeypatch):
    """A running session whose exec POST answers 202 with exec EID (the test routes its reads)."""
    monkeypatch.setattr(cli, "EXEC_POLL_INTERVAL", 0.01)
    api.routes[("GET", f"/api/v1/sessions/{SID}/")] = (200, session())
    api.routes[("POST", f"/api/v1/sessions/{SID}/exec/")] = (202, exec_state(state="starting"))


def test_exec_prints_stdout_and_stderr_as_they_come_and_exits_with_the_remote_status(api, streamed, capsys):
    before_the_end = []

    def second_read(request):  # the CLI waits for this answer: what it printed so far is out already
        before_the_end.append(capsys.readouterr())
        return exec_read(2, state="running")

    answers = iter([lambda r: exec_read(0, ("stdout", "one\n"), ("stderr", "warn\n")), second_read,
                    lambda r: exec_read(2, ("stdout", "two\n"), state="exited", exit_code=3, duration_ms=40)])
    api.routes[("GET", EXEC_PATH)] = lambda request: (200, next(answers)(request))

    assert cli.main(["exec", SID, "--", "echo one; echo warn >&2; sleep 1; echo two; exit 3"]) == 3

    rest = capsys.readouterr()
    assert (before_the_end[0].out, before_the_end[0].err) == ("one\n", "warn\n")
    assert (rest.out, rest.err) == ("two\n", "")
    post = next(r for r in api.requests if r["method"] == "POST")
    assert post["body"] == {"command": "echo one; echo warn >&2; sleep 1; echo two; exit 3", "timeout": 30,
                            "stream": True}
    assert [r["query"]["since"] for r in api.requests if r["path"] == EXEC_PATH] == ["0", "2", "2"]


def test_exec_sends_an_argument_vector_or_one_shell_line_with_its_timeout(api, streamed, capsys):
    api.routes[("GET", EXEC_PATH)] = (200, exec_read(0, ("stdout", "out\n"), state="exited", exit_code=3))

    assert cli.main(["exec", SID, "--", "sh", "-c", "exit 3"]) == 3
    assert api.requests[-2]["body"] == {"command": ["sh", "-c", "exit 3"], "timeout": 30, "stream": True}
    assert cli.main(["exec", "--timeout", "5", SID, "--", "nvidia-smi | head -3"]) == 3
    assert api.requests[-2]["body"] == {"command": "nvidia-smi | head -3", "timeout": 5,
                                        "stream": True}  # one argument: a shell line
    assert capsys.readouterr().out == "out\n" * 2


def test_exec_json_prints_the_result_object_at_the_end_only(api, streamed, capsys):
    answers = iter([exec_read(0, ("stdout", "a\n"), ("stderr", "b\n")),
                    exec_read(2, ("stdout", "c\n"), state="exited", exit_code=0, duration_ms=7, truncated=True)])
    api.routes[("GET", EXEC_PATH)] = lambda request: (200, next(answers))

    assert cli.main(["exec", "-o", "json", SID, "--", "true"]) == 0

    out = capsys.readouterr()
    assert json.loads(out.out) == {"exit_code": 0, "stdout": "a\nc\n", "stderr": "b\n", "truncated": True,
                                   "duration_ms": 7}
    assert out.err == ""


@pytest.mark.parametrize("answer, message", [
    (exec_state(state="cancelled", exit_code=143, duration_ms=900), "the remote command was stopped (exit code 143)"),
    (exec_state(state="running", cancel=True), "asked the server to stop the remote command; it has not confirmed"),
    (exec_state(state="exited", exit_code=0), "the remote command had already ended (exit code 0)"),
])
def test_ctrl_c_while_exec_streams_stops_the_remote_command_and_exits_130(api, streamed, capsys, monkeypatch,
                                                                         answer, message):
    api.routes[("GET", EXEC_PATH)] = lambda request: (
        200, exec_read(0, ("stdout", "up\n")) if request["query"]["since"] == "0" else exec_read(1))
    api.routes[("DELETE", EXEC_PATH)] = (200 if not answer["running"] else 202, answer)

    def interrupted(seconds):  # Ctrl-C while the CLI waits for more output
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.time, "sleep", interrupted)

    assert cli.main(["exec", SID, "--", "sleep 60"]) == 130

    out = capsys.readouterr()
    assert out.out == "up\n"
    assert message in out.err and "Traceback" not in out.err
    assert [r["method"] for r in api.requests if r["path"] == EXEC_PATH][-1] == "DELETE"


def test_ctrl_c_when_the_stop_itself_fails_says_the_command_runs_on(api, streamed, capsys, monkeypatch):
    api.routes[("GET", EXEC_PATH)] = (200, exec_read(0))
    api.routes[("DELETE", EXEC_PATH)] = error_json(404, "this session has no such exec (or its output expired)")
    monkeypatch.setattr(cli.time, "sleep", lambda seconds: (_ for _ in ()).throw(KeyboardInterrupt))

    assert cli.main(["exec", SID, "--", "sleep 60"]) == 130
    assert "it runs on until its timeout" in capsys.readouterr().err


@pytest.mark.parametrize("answer, message", [
    (exec_read(0, state="timed_out", exit_code=137, timeout=5), "ran longer than its timeout of 5 s"),
    (exec_read(0, state="failed", error="the agent on node-1 did not take the command within 10 s; is the node up?"),
     "did not take the command within 10 s"),
])
def test_a_streamed_exec_that_timed_out_or_failed_exits_1_with_the_reason(api, streamed, capsys, answer, message):
    api.routes[("GET", EXEC_PATH)] = (200, answer)

    assert cli.main(["exec", SID, "--", "sleep 60"]) == 1
    assert message in one_line_error(capsys.readouterr().err)


def test_logs_prints_the_log_and_follow_reads_from_the_cursor_until_complete(api, capsys):
    api.routes[("GET", f"/api/v1/sessions/{SID}/")] = (200, session(status="TERMINATED"))
    reads = iter([  # terminal output, CRLF, one cut between CR and LF: plain LF lines in a pipe
        {"text": "one\r", "start": 0, "next": 4, "length": 4, "truncated": False, "complete": False},
        {"text": "", "start": 4, "next": 4, "length": 4, "truncated": False, "complete": False},
        {"text": "\ntwo\r\n", "start": 4, "next": 10, "length": 10, "truncated": False, "complete": True},
    ])
    api.routes[("GET", f"/api/v1/sessions/{SID}/logs/")] = lambda request: (200, next(reads))

    assert cli.main(["logs", "-f", SID]) == 0
    out = capsys.readouterr()
    assert out.out == "one\ntwo\n"
    assert out.err == "fgpu: session demo ended: TERMINATED\n"
    assert [r["query"].get("since") for r in api.requests if r["path"].endswith("/logs/")] == ["0", "4", "4"]

    api.routes[("GET", f"/api/v1/sessions/{SID}/logs/")] = (200, {
        "text": "all\n", "start": 0, "next": 4, "length": 4, "truncated": False, "complete": True})
    assert cli.main(["logs", SID, "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"id": SID, "text": "all\n", "next": 4, "complete": True,
                                                  "truncated": False}


def test_logs_without_follow_stops_at_what_is_there(api, capsys):
    api.routes[("GET", f"/api/v1/sessions/{SID}/")] = (200, session())
    api.routes[("GET", f"/api/v1/sessions/{SID}/logs/")] = lambda request: (200, {
        "text": "" if request["query"]["since"] == "3" else "abc", "start": 0, "next": 3, "length": 3,
        "truncated": False, "complete": False})

    assert cli.main(["logs", SID]) == 0
    assert capsys.readouterr().out == "abc"


@pytest.mark.parametrize("isolation", ["mig", "any", "shared"])
def test_an_isolation_flag_is_a_memory_request_the_server_parses_with_that_isolation(isolation):
    request = parse_resources(build_resources(gpu_memory="15G", isolation=isolation))
    assert getattr(request, "isolation", "shared") == isolation


# --- idempotent launches and control characters (issue 12) ---------------------------------------

def test_each_launch_sends_a_fresh_idempotency_key(api, capsys):
    api.routes[("POST", "/api/v1/sessions/")] = (201, session(status="PENDING"))
    assert cli.main(["launch", "--fgpu", "0.5"]) == 0
    assert cli.main(["launch", "--fgpu", "0.5"]) == 0
    keys = [r["headers"].get("Idempotency-Key") for r in api.requests]
    assert len(keys) == 2 and keys[0] != keys[1] and all(str(uuid.UUID(k)) == k for k in keys)


def test_a_launch_without_an_answer_or_with_a_503_is_sent_again_with_the_same_key(api, capsys, monkeypatch):
    monkeypatch.setattr(cli, "LAUNCH_RETRY_DELAYS", (0.01, 0.01))
    answers = iter([ConnectionAbortedError, (503, error_json(503, "broker down")[1]), (201, session(status="PENDING"))])

    def flaky(request):
        answer = next(answers)
        if answer is ConnectionAbortedError:
            raise answer("dropped before answering")  # the server closes the connection: no answer at all
        return answer

    api.routes[("POST", "/api/v1/sessions/")] = flaky
    assert cli.main(["launch", "--fgpu", "0.5"]) == 0
    out = capsys.readouterr()
    assert out.out == SID + "\n"
    assert out.err.count("sending the launch again") == 2 and "broker down" in out.err
    keys = {r["headers"]["Idempotency-Key"] for r in api.requests}
    assert len(api.requests) == 3 and len(keys) == 1


def test_a_launch_refused_or_failing_with_a_500_is_not_sent_again(api, capsys, monkeypatch):
    monkeypatch.setattr(cli, "LAUNCH_RETRY_DELAYS", (0.01, 0.01))
    for status in (400, 500):
        api.requests.clear()
        api.routes[("POST", "/api/v1/sessions/")] = error_json(status, "no")
        assert cli.main(["launch", "--fgpu", "0.5"]) == 1
        assert len(api.requests) == 1 and "again" not in capsys.readouterr().err
    api.routes[("POST", "/api/v1/sessions/")] = error_json(503, "still down")
    assert cli.main(["launch", "--fgpu", "0.5"]) == 1  # the last answer once the retries are spent
    assert len(api.requests) == 4 and one_line_error(capsys.readouterr().err.splitlines()[-1] + "\n") == "still down"


EVIL = "\x1b]0;pwned\x07\x1b[2J\rname\nx\x9b31m\x7f"  # retitle, clear the screen, rewrite the line, C1 CSI, DEL
ESCAPED = "\\x1b]0;pwned\\x07\\x1b[2J\\rname\\nx\\x9b31m\\x7f"


def test_user_controlled_text_is_printed_with_its_control_characters_escaped(api, capsys):
    evil = session(name=EVIL, status="PENDING", status_reason=f"waiting; named {EVIL}", command=f"echo {EVIL}")
    api.routes[("GET", "/api/v1/sessions/")] = (200, {"count": 1, "next": None, "results": [evil]})
    api.routes[("GET", f"/api/v1/sessions/{SID}/")] = (200, evil)
    api.routes[("POST", "/api/v1/sessions/")] = (201, evil)

    for argv in (["ps"], ["describe", SID], ["launch", "--fgpu", "0.5"]):
        assert cli.main(argv) == 0
        out = capsys.readouterr()
        printed = out.out + out.err
        assert not any(c in printed for c in "\x1b\x07\r\x9b\x7f"), (argv, printed)
        assert ESCAPED in printed, (argv, printed)
        if argv == ["ps"]:
            assert len(out.out.splitlines()) == 2  # the header and one row: the newline did not split it


def test_printable_escapes_c0_del_and_c1_and_keeps_other_text():
    assert printable("tab\there\r\n") == "tab\\there\\r\\n"
    assert printable("\x00\x1f\x7f\x80\x9f") == "\\x00\\x1f\\x7f\\x80\\x9f"
    assert printable("Ärger über 日本 — 😀") == "Ärger über 日本 — 😀"
    assert table(["NAME"], [["a\x1bb"]]).splitlines() == ["NAME", "a\\x1bb"]
