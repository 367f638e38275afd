"""Session apps end to end on the distributed stack (issue 16): uvicorn, a Celery manager and an
agent process; the session image "host" declares apps, among them `echo` (tests/apps/echo_app.py,
a real ASGI app served by daphne inside the session, refusing requests without its token, which
alice uploads into her session's home through the files API, as a user would: her sandboxed
session sees no folder of this checkout; its apps listen in the sandbox's own network namespace,
which the agent relays).

Opening the app starts it in the session (progress, then its URL; again: reused); the app is
served on the apps origin (the stack's http://localhost:<port>, issue 31.4), reached from the
console's origin through a one-time ticket; there the proxy forwards HTTP (a 50 MB upload, a
streamed answer that waits for a websocket message) and websockets both ways with the token
injected and the console's cookies kept back; another user gets 404s, a signed-out browser the
login page; escaping paths are refused; an app that exits,
one that never opens its port and a session that ends are each said so. Every wait has a deadline.
"""
from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import sys
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.conftest import ROOT, StackNode, wait_until
from tests.docker_nodes import docker_node  # noqa: F401 (fixture)
from tests.test_e2e_distributed import api, get_ok

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

REDIS_DB = 15  # of its own, flushed first (FGPU_TEST_STACK_REDIS_DB overrides it)
ECHO = (f'PYTHONPATH="$HOME/apps" exec {sys.executable} -m daphne -b {{host}} -p {{port}} '
        "echo_app:application")  # the agent's Python (and its daphne) is what a sandbox shows read-only
APPS = [
    {"name": "echo", "title": "Echo", "command": ECHO, "port": 8080, "base_url": True, "path": "echo?opened=1",
     "timeout": 60},
    {"name": "plain", "title": "Echo without prefix", "command": "ECHO_APP_PREFIXED=0 " + ECHO, "port": 8081,
     "base_url": False, "timeout": 60},
    {"name": "broken", "title": "Broken", "command": "echo broken-output; exit 4", "port": 8082},
    {"name": "mute", "title": "Mute", "command": "echo waiting-forever; exec sleep 600", "port": 8083, "timeout": 2},
]


def login(base: str, username: str, password: str) -> httpx.Client:
    """A browser-like client signed in through the login page (the session cookie)."""
    client = httpx.Client(base_url=base, timeout=60, follow_redirects=False)
    page = client.get("/login/")
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
    answer = client.post("/login/", data={"username": username, "password": password, "csrfmiddlewaretoken": csrf})
    assert answer.status_code == 302, answer.text[:500]
    return client


def ws_url(base: str, path: str) -> str:
    return "ws://" + urlsplit(base).netloc + path


def open_app(base: str, client: httpx.Client, session_id: str, app: str) -> list[dict]:
    """What the open page's websocket says, to its end."""
    messages = []
    cookie = "; ".join(f"{k}={v}" for k, v in client.cookies.items())
    with connect(ws_url(base, f"/ws/sessions/{session_id}/open/{app}/"), additional_headers={"Cookie": cookie},
                 open_timeout=30) as ws:
        for raw in ws:
            messages.append(json.loads(raw))
    return messages


def on_apps_origin(apps: str, console: httpx.Client, path: str) -> httpx.Client:
    """A browser on the apps origin, signed in to the app of `path` as `console`'s user: the
    console's origin hands it a one-time ticket, which the apps origin turns into its cookie."""
    hop = console.get(path)
    assert hop.status_code == 302 and hop.headers["location"].startswith(apps + "/_fgpu/app-login?ticket="), hop.text
    browser = httpx.Client(base_url=apps, timeout=60, follow_redirects=False)
    landed = browser.get(hop.headers["location"][len(apps):])
    assert landed.status_code == 302 and "fgpu_app=" in landed.headers["set-cookie"], landed.text
    return browser


def shows_token(text: str, token_sha256: str) -> bool:
    """Whether `text` holds the token whose SHA-256 is `token_sha256` (any 48 hex characters in it)."""
    return any(hashlib.sha256(m.encode()).hexdigest() == token_sha256 for m in re.findall(r"(?=([0-9a-f]{48}))", text))


def raw_get(base: str, path: str, cookies: dict) -> int:
    """GET `path` exactly as written (no client-side normalisation of dots or escapes)."""
    parts = urlsplit(base)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    connection.putrequest("GET", path, skip_accept_encoding=True)
    connection.putheader("Cookie", "; ".join(f"{k}={v}" for k, v in cookies.items()))
    connection.endheaders()
    status = connection.getresponse().status
    connection.close()
    return status


@pytest.fixture
def apps_stack(distributed_stack, django_user_model):
    """The stack with the demo node, the "host" image declaring APPS, alice (with a RUNNING
    interactive 0.5 fGPU session) and bob. Returns (base, apps base, alice's token, session id, the stack)."""
    from sessions.models import SessionImage

    SessionImage.objects.filter(reference="host").update(apps=APPS)
    stack = distributed_stack(nodes=[StackNode("apps-node", (ROOT / "demo" / "mock-accelerator.toml").read_text())],
                              redis_db=REDIS_DB)
    django_user_model.objects.create_user("alice", password="alice-pass-123")
    django_user_model.objects.create_user("bob", password="bob-pass-123")
    status, body = api(stack.base, "POST", "/api/v1/auth/token/", body={"username": "alice", "password": "alice-pass-123"})
    assert status == 200, body
    token = body["token"]
    # The image named, not the default one: a default image another module's console left in this
    # database (a pytest-xdist worker's, shared by its modules) declares other apps or none.
    status, created = api(stack.base, "POST", "/api/v1/sessions/", token,
                          {"name": "nb", "image": "host", "resources": {"cuda.shares": "0.5", "cpu": 1, "mem": "1G"}})
    assert status == 201, created
    wait_until(lambda: get_ok(stack.base, f"/api/v1/sessions/{created['id']}/", token)["status"] == "RUNNING",
               timeout=60, what="the session to be RUNNING")
    uploaded = httpx.put(f"{stack.base}/api/v1/sessions/{created['id']}/files/content/?path=apps/echo_app.py",
                         content=(ROOT / "tests" / "apps" / "echo_app.py").read_bytes(), timeout=60,
                         headers={"Authorization": f"Token {token}", "Content-Type": "application/octet-stream"})
    assert uploaded.status_code in (200, 201), uploaded.text
    return stack.base, stack.apps_base, token, created["id"], stack


def test_an_app_opens_through_the_proxy_for_its_owner_only_and_says_when_it_closed(apps_stack):
    base, apps, token, session_id, _ = apps_stack
    prefix = f"/sessions/{session_id}/apps/echo/"
    listed = get_ok(base, f"/api/v1/sessions/{session_id}/", token)["apps"]
    assert [a["name"] for a in listed] == ["echo", "plain", "broken", "mute"]
    assert listed[0] == {"name": "echo", "title": "Echo", "url": f"/sessions/{session_id}/open/echo/"}
    alice = login(base, "alice", "alice-pass-123")

    # Opening starts it (progress while its port is closed), then says where it is; again: reused.
    page = alice.get(f"/sessions/{session_id}/open/echo/")
    assert page.status_code == 200 and "Echo" in page.text
    messages = open_app(base, alice, session_id, "echo")
    assert messages[-1] == {"type": "ready", "url": prefix + "echo?opened=1", "reused": False}, messages
    assert all(m["type"] == "progress" for m in messages[:-1])
    assert open_app(base, alice, session_id, "echo")[-1]["reused"] is True

    # HTTP through the proxy, on the apps origin: the app got its token (it answers 403 without) and
    # not the console's cookies (nor the app origin's own).
    app = on_apps_origin(apps, alice, prefix + "echo")
    app.cookies.set("app-cookie", "kept")
    echoed = app.get(prefix + "echo", params={"q": "1"})
    assert echoed.status_code == 200, echoed.text
    body = echoed.json()
    assert body["authorized"] is True and body["console_cookie"] is False and "app-cookie=kept" in body["cookie"]
    assert body["path"] == prefix + "echo" and body["query"] == "q=1"
    assert body["host"] == urlsplit(apps).netloc
    for shown in (page.text, echoed.text, json.dumps(get_ok(base, f"/api/v1/sessions/{session_id}/", token))):
        assert not shows_token(shown, body["token_sha256"])

    # An app without the prefix gets the path after it.
    assert open_app(base, alice, session_id, "plain")[-1]["type"] == "ready"
    plain_path = f"/sessions/{session_id}/apps/plain/echo"
    plain = on_apps_origin(apps, alice, plain_path).get(plain_path).json()
    assert plain["path"] == "/echo" and plain["authorized"] is True

    # A 50 MB upload and a 50 MB download.
    upload = os.urandom(1 << 20) * 50
    stored = app.post(prefix + "upload", content=upload, headers={"Content-Type": "application/octet-stream"})
    assert stored.json() == {"bytes": len(upload), "sha256": hashlib.sha256(upload).hexdigest()}
    with app.stream("GET", prefix + "bytes", params={"n": 50 * 10 ** 6}) as download:
        assert download.status_code == 200
        assert sum(len(chunk) for chunk in download.iter_raw()) == 50 * 10 ** 6

    # A websocket both ways (with the subprotocol the app chose), and a streamed answer: its first
    # part arrives while the app still waits for the websocket's "release".
    cookie = "; ".join(f"{k}={v}" for k, v in app.cookies.items())
    with app.stream("GET", prefix + "gate") as gated:
        lines = gated.iter_lines()
        assert next(lines) == "first"
        with connect(ws_url(apps, prefix + "ws"), additional_headers={"Cookie": cookie},
                     subprotocols=["v1.kernel.websocket.jupyter.org"], open_timeout=30) as ws:
            assert ws.subprotocol == "v1.kernel.websocket.jupyter.org"
            ws.send("hello")
            assert ws.recv(timeout=30) == "echo:hello"
            ws.send(b"\x00\x01binary")
            assert ws.recv(timeout=30) == b"\x00\x01binary"
            ws.send("release")
            assert ws.recv(timeout=30) == "echo:release"
        assert next(lines) == "second"

    # Another user: 404 (HTTP, the open page: no ticket); with his console cookie on the apps
    # origin, nothing (HTTP 401, the websocket refused); signed out: the login page.
    bob = login(base, "bob", "bob-pass-123")
    assert bob.get(prefix + "echo").status_code == 404
    assert bob.get(f"/sessions/{session_id}/open/echo/").status_code == 404
    bob_cookie = "; ".join(f"{k}={v}" for k, v in bob.cookies.items())
    assert httpx.get(apps + prefix + "echo", headers={"Cookie": bob_cookie}, timeout=30).status_code == 401
    with pytest.raises(InvalidStatus):
        connect(ws_url(apps, prefix + "ws"), additional_headers={"Cookie": bob_cookie}, open_timeout=30)
    signed_out = httpx.get(base + prefix + "echo", follow_redirects=False, timeout=30)
    assert signed_out.status_code == 302 and signed_out.headers["location"] == f"/login/?next={prefix}echo"
    assert alice.get(f"/sessions/{session_id}/apps/nothing/").status_code == 404

    # Paths that try to leave the prefix.
    for escape in ("../../terminal/", "%2e%2e/%2e%2e/terminal/", "..%2f..%2fterminal/", "a/./b", "a%5c..%5cb"):
        assert raw_get(base, prefix + escape, dict(alice.cookies)) == 400, escape
        assert raw_get(apps, prefix + escape, dict(app.cookies)) == 400, escape

    # The app exits: its page says so, with a link that starts it again.
    assert app.get(prefix + "exit").status_code == 200
    closed = wait_until(lambda: (r := app.get(prefix + "echo")).status_code == 502 and "exited" in r.text and r,
                        timeout=30, what="the proxy to see the app gone, and its agent to say it exited")
    assert "Echo is not running" in closed.text and "exited with code 3" in closed.text
    assert f'href="{base}/sessions/{session_id}/open/echo/"' in closed.text  # on the console's origin
    assert open_app(base, alice, session_id, "echo")[-1]["reused"] is False

    # The session ends while a websocket is open: the websocket closes, the app's page says the session ended.
    with connect(ws_url(apps, prefix + "ws"), additional_headers={"Cookie": cookie}, open_timeout=30) as ws:
        status, _ = api(base, "DELETE", f"/api/v1/sessions/{session_id}/", token)
        assert status == 202
        wait_until(lambda: get_ok(base, f"/api/v1/sessions/{session_id}/", token)["status"] == "TERMINATED",
                   timeout=60, what="the session to end")
        with pytest.raises(Exception):
            while True:
                ws.recv(timeout=30)
    ended = app.get(prefix + "echo")
    assert ended.status_code == 410 and "Session ended" in ended.text
    failed = open_app(base, alice, session_id, "echo")[-1]
    assert failed["type"] == "error" and failed["error"] == "session-not-running"


def test_an_app_that_exits_or_never_answers_is_reported_with_its_output(apps_stack):
    base, _, token, session_id, _ = apps_stack
    alice = login(base, "alice", "alice-pass-123")

    # The same through the REST API (for scripts): the URL once it answers, the refusals in the error shape.
    status, opened = api(base, "POST", f"/api/v1/sessions/{session_id}/apps/echo/", token)
    assert (status, opened) == (200, {"url": f"/sessions/{session_id}/apps/echo/echo?opened=1", "reused": False})
    status, failed = api(base, "POST", f"/api/v1/sessions/{session_id}/apps/broken/", token)
    assert status == 502 and failed["type"] == "app-failed" and failed["detail"].endswith("broken-output"), failed
    status, unknown = api(base, "POST", f"/api/v1/sessions/{session_id}/apps/nothing/", token)
    assert status == 404 and unknown["type"] == "unknown-app", unknown
    _, bob = api(base, "POST", "/api/v1/auth/token/", body={"username": "bob", "password": "bob-pass-123"})
    status, hidden = api(base, "POST", f"/api/v1/sessions/{session_id}/apps/echo/", bob["token"])
    assert status == 404, hidden

    broken = open_app(base, alice, session_id, "broken")[-1]
    assert broken["type"] == "error" and broken["error"] == "app-failed"
    assert "broken exited with code 4 before it answered on port" in broken["detail"]
    assert broken["detail"].endswith("its last output:\nbroken-output")
    mute = open_app(base, alice, session_id, "mute")
    assert mute[-1]["type"] == "error" and mute[-1]["error"] == "app-failed", mute
    assert "mute did not answer on port" in mute[-1]["detail"] and "within 2 s and was stopped" in mute[-1]["detail"]
    assert mute[-1]["detail"].endswith("waiting-forever")
    assert any(m["type"] == "progress" and "waiting for it to answer" in m["text"] for m in mute)


def test_an_app_of_a_held_session_outlives_its_agents_restart_and_is_adopted_not_started_twice(apps_stack):
    """The process runtime's held session (agent.holder) runs on when its agent is killed, and so does
    its app (in the session's sandbox, with its own network): the restarted agent takes the app where
    it answers (the port recorded beside the holder's files), relays it anew, and the app keeps the
    token the web holds; a second copy would be another process."""
    base, apps, token, session_id, stack = apps_stack
    prefix = f"/sessions/{session_id}/apps/echo/"
    alice = login(base, "alice", "alice-pass-123")
    assert open_app(base, alice, session_id, "echo")[-1]["reused"] is False
    app = on_apps_origin(apps, alice, prefix + "echo")
    before = app.get(prefix + "echo").json()
    assert before["authorized"] is True

    stack.restart("agent-apps-node")  # SIGKILL, then started again
    wait_until(lambda: "adopted session" in stack.procs["agent-apps-node"].output(), timeout=60,
               what="the restarted agent to adopt the session")
    again = open_app(base, alice, session_id, "echo")
    assert again[-1] == {"type": "ready", "url": prefix + "echo?opened=1", "reused": True}, again
    after = app.get(prefix + "echo").json()
    assert (after["pid"], after["authorized"]) == (before["pid"], True), (before, after)
    assert "app echo of session" in stack.procs["agent-apps-node"].output()
    assert "started app echo" not in stack.procs["agent-apps-node"].output()  # the new agent started none


@dataclass
class BridgedDockerNode(StackNode):
    """A docker node whose sessions have a network (the stack's default is none), so their apps
    can be reached at the container's address."""

    def agent_toml(self) -> str:
        return super().agent_toml().replace('network = "none"', 'network = "bridge"')


@pytest.mark.docker
def test_in_the_docker_runtime_an_app_runs_in_the_sessions_container_and_is_reached_at_its_address(
        docker_node, distributed_stack, django_user_model):  # noqa: F811 (the fixture)
    from sessions.models import SessionImage

    SessionImage.objects.get_or_create(reference="fgpu-session:test", defaults={"apps": [
        {"name": "files", "title": "Files", "command": "cd $HOME && echo in-container > hello.txt && "
                                                        "exec python3 -m http.server {port} --bind {host}",
         "port": 8000, "base_url": False}]})
    node = docker_node("docker-apps")  # its containers, network and chain removed at the end
    stack = distributed_stack(nodes=[BridgedDockerNode(node, (ROOT / "demo" / "mock-accelerator.toml").read_text(),
                                                       runtime="docker")], redis_db=REDIS_DB)
    django_user_model.objects.create_user("alice", password="alice-pass-123")
    status, body = api(stack.base, "POST", "/api/v1/auth/token/", body={"username": "alice", "password": "alice-pass-123"})
    token = body["token"]
    status, created = api(stack.base, "POST", "/api/v1/sessions/", token,
                          {"name": "c", "image": "fgpu-session:test", "resources": {"cuda.shares": "0.5", "mem": "256M"}})
    assert status == 201, created
    wait_until(lambda: get_ok(stack.base, f"/api/v1/sessions/{created['id']}/", token)["status"] == "RUNNING",
               timeout=120, what="the container session to run")
    alice = login(stack.base, "alice", "alice-pass-123")
    opened = open_app(stack.base, alice, created["id"], "files")
    assert opened[-1] == {"type": "ready", "url": f"/sessions/{created['id']}/apps/files/", "reused": False}, opened
    app = on_apps_origin(stack.apps_base, alice, f"/sessions/{created['id']}/apps/files/")
    listing = app.get(f"/sessions/{created['id']}/apps/files/")
    assert listing.status_code == 200 and "hello.txt" in listing.text
    assert app.get(f"/sessions/{created['id']}/apps/files/hello.txt").text == "in-container\n"

    # The agent restarts; the container and the app in it run on: opening it again adopts it, not a
    # second copy (which could not listen on the same port).
    stack.restart(f"agent-{node}")
    wait_until(lambda: "adopted session" in stack.procs[f"agent-{node}"].output(), timeout=60,
               what="the restarted agent to adopt the session")
    again = open_app(stack.base, alice, created["id"], "files")
    assert again[-1] == {"type": "ready", "url": f"/sessions/{created['id']}/apps/files/", "reused": True}, again
    assert app.get(f"/sessions/{created['id']}/apps/files/hello.txt").text == "in-container\n"



# An app in the container that answers GET with its files and POST with the body it got.
ECHO_POST = """cd $HOME && echo in-container > hello.txt && cat > post_echo.py <<'PY'
import sys
from http.server import HTTPServer, SimpleHTTPRequestHandler
class Echo(SimpleHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
HTTPServer((sys.argv[1], int(sys.argv[2])), Echo).serve_forever()
PY
exec python3 post_echo.py {host} {port}"""


@pytest.mark.docker
def test_after_a_keyless_agent_restarts_the_first_requests_to_its_relayed_app_are_answered(
        docker_node, distributed_stack, django_user_model):  # noqa: F811 (the fixture)
    """A node without an agent key relays its apps under a random key it makes at each start
    (protocol.app_relay), on a new port: after its agent restarts (the container and its app run
    on), the web's first request (a POST with a body, and after another restart a GET) is answered by
    the app through the new relay under the new key (the proxy asks the agent again where the old
    relay is gone, or refuses a connection before answering, and sends the request again, as
    nothing of it reached the app), not a 502 first."""
    from sessions.models import SessionImage

    SessionImage.objects.update_or_create(reference="fgpu-session:test", defaults={"apps": [
        {"name": "files", "title": "Files", "command": ECHO_POST, "port": 8000, "base_url": False}]})
    node = BridgedDockerNode(docker_node("docker-relay"), (ROOT / "demo" / "mock-accelerator.toml").read_text(),
                             runtime="docker",
                             container="app-relay = true")  # on a loopback app-address too
    stack = distributed_stack(nodes=[node], redis_db=REDIS_DB)  # no node keys: a random relay key
    django_user_model.objects.create_user("alice", password="alice-pass-123")
    status, body = api(stack.base, "POST", "/api/v1/auth/token/", body={"username": "alice", "password": "alice-pass-123"})
    token = body["token"]
    status, created = api(stack.base, "POST", "/api/v1/sessions/", token,
                          {"name": "c", "image": "fgpu-session:test",
                           "resources": {"cuda.shares": "0.5", "mem": "256M"}})
    assert status == 201, created
    wait_until(lambda: get_ok(stack.base, f"/api/v1/sessions/{created['id']}/", token)["status"] == "RUNNING",
               timeout=120, what="the container session to run")
    alice = login(stack.base, "alice", "alice-pass-123")
    opened = open_app(stack.base, alice, created["id"], "files")
    assert opened[-1]["type"] == "ready", opened
    app = on_apps_origin(stack.apps_base, alice, f"/sessions/{created['id']}/apps/files/")
    prefix = f"/sessions/{created['id']}/apps/files/"
    assert app.get(prefix + "hello.txt").text == "in-container\n"
    assert app.post(prefix + "echo", content=b"before").content == b"before"
    assert stack.procs[f"agent-{node.name}"].output().count("relaying app files") == 1

    for request in ("post", "get"):
        stack.restart(f"agent-{node.name}")
        wait_until(lambda: "adopted session" in stack.procs[f"agent-{node.name}"].output(), timeout=60,
                   what="the restarted agent to adopt the session")
        if request == "post":
            first = app.post(prefix + "echo", content=b"x" * 100_000)
            assert (first.status_code, len(first.content)) == (200, 100_000), first.text[:500]
        else:
            first = app.get(prefix + "hello.txt")
            assert (first.status_code, first.text) == (200, "in-container\n"), first.text[:500]
        assert "relaying app files" in stack.procs[f"agent-{node.name}"].output()  # through the new agent's relay
