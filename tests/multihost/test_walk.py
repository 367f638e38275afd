"""The walkthrough across hosts (issue 37.1): the control plane in the host's network namespace (web
as uvicorn, a Celery manager, beat, the machine's PostgreSQL on 127.0.0.1, and a redis-server of
the test's own on the bed's bridge address), and two agent hosts, "a" and "b", each in a network
namespace of its own with an address of its own (tests/multihost/bed.py: how, and how each agent
reaches its session containers). Sessions run with the docker runtime (fgpu-session:test,
tests/images/build.sh); each agent relays its apps on its own address (agent.toml `app-relay`'s
default where `app-address` is not loopback), proven per node (protocol.app_relay: each node has an
agent key, `manage.py node_key`, from which the web and the agent derive the relay key).

On each host: a session is launched there; the terminal websocket runs nvidia-smi and shows the
slice (host a: its agent's direct stream, which the web opens to a's address from the bridge's;
host b: `terminal-direct = false`, the channel layer through Redis on the bridge); exec answers with
the session's id; the files API writes a file into the session and reads it back; a declared app (a
tornado HTTP and websocket server the files API put there) opens through the web's proxy, which
reaches it at the agent's relay on the host's address (HTTP and a websocket echo), while the web's
namespace cannot open a connection to the container itself, and the other host, connecting to the
relay without the web's proof, gets nothing from the app (the agent logs the refusal); JupyterLab,
the image's own app, opens through that host's relay too (its server's API answers); the
session's log holds the terminal's output. Then host b's
link goes down (its agent and container go on): b's node goes LOST; a session asked for meanwhile is
not placed on b's devices (its session holds them) nor granted a's; b's session is stopped meanwhile.
b's link comes back: b is ALIVE, its session ends (its container is removed), the waiting session
takes b's device (its app opens through b's relay again), and the database's sessions and grants
agree with the agents' containers: every device's grants within its capacity, no session with two
sets of grants. Last, every session stops, every container goes and every grant is released.
"""
from __future__ import annotations

import asyncio
import socket
import subprocess
from dataclasses import dataclass

import docker
import httpx
import pytest
from websockets.sync.client import connect

from tests.conftest import wait_until
from tests.multihost.bed import HostsBed
from tests.stack import Stack, StackNode, mock_inventory
from tests.test_e2e_distributed import api, get_ok, terminal_run
from tests.test_session_apps_e2e import login, on_apps_origin, open_app, ws_url

pytestmark = [pytest.mark.multihost, pytest.mark.e2e, pytest.mark.docker, pytest.mark.django_db(transaction=True)]

TEST_IMAGE = "fgpu-session:test"
HOSTS = ("a", "b")
APP_SOURCE = '''\
import os, sys
import tornado.ioloop, tornado.web, tornado.websocket

class Hello(tornado.web.RequestHandler):
    def get(self):
        self.write("hello from " + os.environ.get("FGPU_SESSION_ID", "?"))

class Echo(tornado.websocket.WebSocketHandler):
    def check_origin(self, origin):
        return True

    def on_message(self, message):
        self.write_message("echo:" + message)

tornado.web.Application([(r"/", Hello), (r"/ws", Echo)]).listen(int(sys.argv[1]), address=sys.argv[2])
tornado.ioloop.IOLoop.current().start()
'''
APP = {"name": "hello", "title": "Hello", "command": "exec python3 $HOME/hello_app.py {port} {host}", "port": 8500,
       "base_url": False, "timeout": 60}


@dataclass
class BedNode(StackNode):
    """A docker node whose agent runs in its host's namespace and listens on its host's address."""

    address: str = ""

    def agent_toml(self) -> str:
        return (super().agent_toml().replace('network = "none"', 'network = "outbound"')
                .replace("[container]\n", f'[container]\napp-address = "{self.address}"\n'))


def refused_from(bed: HostsBed, host: str, address: str, port: int) -> bytes:
    """What a client in host `host`'s namespace gets from address:port for a GET without the
    web's proof (b"": the connection closed without a byte)."""
    probe = ("import socket,sys\ns = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)\n"
             "s.settimeout(20)\ns.sendall(b'GET / HTTP/1.0\\r\\nHost: app\\r\\n\\r\\n')\nout = b''\n"
             "while (chunk := s.recv(65536)):\n    out += chunk\nsys.stdout.buffer.write(out)\n")
    done = subprocess.run([*bed.hosts[host].command_prefix(), "python3", "-c", probe, address, str(port)],
                          capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def bed(tmp_path):
    hosts = HostsBed(list(HOSTS), tmp_path / "bed").up()
    try:
        yield hosts
    finally:
        hosts.down()
        assert not hosts.leftovers(), hosts.leftovers()


@pytest.fixture
def cluster(bed, tmp_path, django_user_model, request):
    from agent.network import installation_id, network_names
    from sessions.models import SessionImage

    SessionImage.objects.update_or_create(reference=TEST_IMAGE, defaults={"apps": [APP]})
    nodes = []
    for name, host in bed.hosts.items():
        node = f"mh-{name}"
        bed.route_to_containers(name, network_names(node, installation_id(tmp_path / "nodes" / node / "scratches")).bridge)
        nodes.append(BedNode(node, mock_inventory(gpus=1), runtime="docker", command_prefix=host.command_prefix(),
                             env=bed.agent_env(), address=host.address,
                             container="terminal-direct = false\n" if name == "b" else ""))
    stack = Stack(nodes=nodes, work_dir=tmp_path, redis_address=bed.gateway, node_keys=True,
                  env={"FGPU_HEARTBEAT_TIMEOUT": "6"})
    try:
        stack.start(timeout=90)
        django_user_model.objects.create_user("alice", password="alice-pass-123")
        _, body = api(stack.base, "POST", "/api/v1/auth/token/", body={"username": "alice", "password": "alice-pass-123"})
        yield stack, body["token"]
    finally:
        report = getattr(request.node, "rep_call", None)
        stack.close()
        if report is not None and report.failed:
            import sys

            sys.stderr.write(stack.logs(tail=6000))
        client = docker.from_env()
        for node in nodes:
            for container in client.containers.list(all=True, filters={"label": f"fgpu.node={node.name}"}, sparse=True):
                try:
                    container.remove(force=True)
                except docker.errors.NotFound:  # its agent removed it meanwhile
                    pass


def session(base: str, token: str, session_id: str) -> dict:
    return get_ok(base, f"/api/v1/sessions/{session_id}/", token)


def launch(base: str, token: str, name: str) -> dict:
    status, created = api(base, "POST", "/api/v1/sessions/", token, {
        "name": name, "image": TEST_IMAGE, "resources": {"cuda.shares": "1.5", "cpu": 1, "mem": "512M"}})
    assert status == 201, created
    return created


def containers_by_node() -> dict[str, set[str]]:
    """Node → the session ids of the running containers Docker holds for it (the agents' truth)."""
    found: dict[str, set[str]] = {}
    # sparse: the list's own answer (with its labels), no inspect of each container after it, which
    # fails (404) for a container removed between the two, as a stopped session's is
    for container in docker.from_env().containers.list(filters={"label": "fgpu.node"}, sparse=True):
        labels = container.attrs.get("Labels") or {}
        if labels.get("fgpu.node", "").startswith("mh-"):
            found.setdefault(labels["fgpu.node"], set()).add(labels.get("fgpu.session", ""))
    return found


def grants_agree(nodes: list[str]) -> dict:
    """The database's view against the agents': RUNNING sessions by node, live grants by device
    (each within its capacity), sessions with more than one grant on a device; with what Docker runs."""
    from django.db import connection
    from django.db.models import Count, Sum

    from sessions.models import Allocation, ComputeSession

    connection.close_if_unusable_or_obsolete()
    running = {n: set(map(str, ComputeSession.objects.filter(node__name=n, status="RUNNING").values_list("pk", flat=True)))
               for n in nodes}
    live = Allocation.objects.filter(released_at__isnull=True, device__node__name__in=nodes)
    doubled = list(live.values("session_id", "device_id").annotate(n=Count("id")).filter(n__gt=1))
    per_device = list(live.values("device_id").annotate(memory=Sum("memory")))
    holders = {n: set(map(str, live.filter(device__node__name=n).values_list("session_id", flat=True))) for n in nodes}
    return {"running": running, "holders": holders, "doubled": doubled, "per_device": per_device,
            "containers": {n: containers_by_node().get(n, set()) for n in nodes}}


def test_the_walkthrough_runs_on_each_host_and_a_cut_host_converges_without_double_grants(cluster, bed):
    stack, token = cluster
    base = stack.base
    placed = {}
    for name in HOSTS:
        created = launch(base, token, f"walk-{name}")
        ran = wait_until(lambda sid=created["id"]: (s := session(base, token, sid))["status"] in ("RUNNING", "ERROR") and s,
                         timeout=120, what=f"session walk-{name} to run")
        assert ran["status"] == "RUNNING", ran
        placed[ran["node"]] = ran
    assert sorted(placed) == ["mh-a", "mh-b"], placed  # one on each host: 1.5 fGPU of 2 leaves no room beside it

    alice = login(base, "alice", "alice-pass-123")
    for node, ran in placed.items():
        host = bed.hosts[node.removeprefix("mh-")]
        sid = ran["id"]
        # terminal: the websocket, its stream from the agent's address
        status, ticket = api(base, "POST", f"/api/v1/sessions/{sid}/terminal-ticket/", token, {})
        assert status == 200, ticket
        output = asyncio.run(terminal_run(base.replace("http://", "ws://") + ticket["url"],
                                          "nvidia-smi; echo end-$((6*7))\r", "end-42", timeout=60))
        assert "6144MiB" in output, output  # 1.5 fGPU of an 8 GiB, 2-fGPU device
        direct = f"of session {sid} reads from {bed.gateway}:" in stack.agents[node].output()  # the web, from the bridge
        assert direct is (host.name == "a"), stack.agents[node].output()[-3000:]  # a: the direct stream; b: the layer
        # exec
        status, done = api(base, "POST", f"/api/v1/sessions/{sid}/exec/", token, {"command": "echo $FGPU_SESSION_ID"})
        assert status == 200 and done["stdout"].strip() == sid, done
        # files: in and back
        put = httpx.put(f"{base}/api/v1/sessions/{sid}/files/content/?path=hello_app.py", content=APP_SOURCE.encode(),
                        headers={"Authorization": f"Token {token}", "Content-Type": "application/octet-stream"},
                        timeout=60)
        assert put.status_code in (200, 201), put.text
        got = httpx.get(f"{base}/api/v1/sessions/{sid}/files/content/?path=hello_app.py",
                        headers={"Authorization": f"Token {token}"}, timeout=60)
        assert got.status_code == 200 and got.text == APP_SOURCE, got.text[:300]
        # the app, through the proxy and the agent's relay on the host's address
        opened = open_app(base, alice, sid, "hello")
        assert opened[-1]["type"] == "ready", opened
        browser = on_apps_origin(stack.apps_base, alice, f"/sessions/{sid}/apps/hello/")
        page = browser.get(f"/sessions/{sid}/apps/hello/")
        assert page.status_code == 200 and page.text == f"hello from {sid}", page.text[:300]
        cookie = "; ".join(f"{k}={v}" for k, v in browser.cookies.items())
        with connect(ws_url(stack.apps_base, f"/sessions/{sid}/apps/hello/ws"), open_timeout=30,
                     additional_headers={"Cookie": cookie, "Origin": stack.apps_base}) as ws:
            ws.send("across")
            assert ws.recv(timeout=30) == "echo:across"
        relayed = [line for line in stack.agents[node].output().splitlines()
                   if f"relaying app hello of session {sid} from {host.address}:" in line]
        assert relayed, stack.agents[node].output()[-3000:]
        container_address = relayed[0].rsplit(" to ", 1)[1].rsplit(":", 1)[0]
        with pytest.raises(OSError):  # the web's namespace cannot open a connection to the container itself
            socket.create_connection((container_address, APP["port"]), timeout=3).close()
        relay_port = int(relayed[0].split(f" from {host.address}:", 1)[1].split()[0])
        other = next(h for h in HOSTS if h != host.name)  # another host on the network, without the web's proof
        assert refused_from(bed, other, host.address, relay_port) == b""
        wait_until(lambda node=node: "refused a connection to an app relay" in stack.agents[node].output(), timeout=10,
                   what="the agent to log the refused connection")
        # JupyterLab, the image's own app (its service-ports label, as the agent reported the image),
        # through the same relay: its server's API answers through the proxy with the app's token
        wait_until(lambda sid=sid: "jupyterlab" in [a["name"] for a in get_ok(base, f"/api/v1/sessions/{sid}/", token)["apps"]],
                   timeout=60, what="the image's label to offer JupyterLab")
        opened = open_app(base, alice, sid, "jupyterlab")
        assert opened[-1]["type"] == "ready", opened
        lab = on_apps_origin(stack.apps_base, alice, f"/sessions/{sid}/apps/jupyterlab/")
        answer = lab.get(f"/sessions/{sid}/apps/jupyterlab/api/status")
        assert answer.status_code == 200 and "kernels" in answer.json(), answer.text[:300]
        assert any(f"relaying app jupyterlab of session {sid} from {host.address}:" in line
                   for line in stack.agents[node].output().splitlines()), stack.agents[node].output()[-3000:]
        # logs
        wait_until(lambda sid=sid: "end-42" in get_ok(base, f"/api/v1/sessions/{sid}/logs/", token)["text"], timeout=30,
                   what="the terminal's output in the session's log")

    # Host b's link goes down; its agent and container go on.
    on_b = placed["mh-b"]
    bed.cut("b")
    try:
        wait_until(lambda: get_ok(base, "/api/v1/nodes/mh-b/", token)["status"] == "LOST", timeout=60,
                   what="node mh-b to be LOST")
        waiting = launch(base, token, "walk-waiting")
        status, _ = api(base, "DELETE", f"/api/v1/sessions/{on_b['id']}/", token)
        assert status in (200, 202, 204)
        assert session(base, token, waiting["id"])["status"] == "PENDING"  # a's device is full, b's still held
        assert containers_by_node().get("mh-b") == {on_b["id"]}  # its container went on, unreachable
        during = grants_agree(["mh-a", "mh-b"])  # b's grant stays its session's while b may still run it
        assert during["holders"] == {"mh-a": {placed["mh-a"]["id"]}, "mh-b": {on_b["id"]}}, during
        assert during["doubled"] == [], during
    finally:
        bed.restore("b")
    wait_until(lambda: get_ok(base, "/api/v1/nodes/mh-b/", token)["status"] == "ALIVE", timeout=60,
               what="node mh-b to be ALIVE again")
    wait_until(lambda: session(base, token, on_b["id"])["status"] == "TERMINATED", timeout=90,
               what="b's session stopped during the cut to end once b is back")
    moved = wait_until(lambda: (s := session(base, token, waiting["id"]))["status"] == "RUNNING" and s, timeout=120,
                       what="the waiting session to take b's device")
    assert moved["node"] == "mh-b", moved
    put = httpx.put(f"{base}/api/v1/sessions/{moved['id']}/files/content/?path=hello_app.py", content=APP_SOURCE.encode(),
                    headers={"Authorization": f"Token {token}", "Content-Type": "application/octet-stream"}, timeout=60)
    assert put.status_code in (200, 201), put.text
    assert open_app(base, alice, moved["id"], "hello")[-1]["type"] == "ready"
    browser = on_apps_origin(stack.apps_base, alice, f"/sessions/{moved['id']}/apps/hello/")
    page = browser.get(f"/sessions/{moved['id']}/apps/hello/")
    assert page.status_code == 200 and page.text == f"hello from {moved['id']}", page.text[:300]
    a_id = placed["mh-a"]["id"]  # a's app went on through the cut
    page = on_apps_origin(stack.apps_base, alice, f"/sessions/{a_id}/apps/hello/").get(f"/sessions/{a_id}/apps/hello/")
    assert page.status_code == 200 and page.text == f"hello from {a_id}", page.text[:300]

    nodes = ["mh-a", "mh-b"]
    expected = {"mh-a": {placed["mh-a"]["id"]}, "mh-b": {moved["id"]}}
    agreed = wait_until(lambda: (v := grants_agree(nodes))["containers"] == expected and v, timeout=60,
                        what="the agents' containers to match the database")
    assert agreed["running"] == expected and agreed["holders"] == expected, agreed
    assert agreed["doubled"] == [], agreed
    assert all(row["memory"] <= 8 * 2**30 for row in agreed["per_device"]), agreed

    for sid in (placed["mh-a"]["id"], moved["id"]):
        status, _ = api(base, "DELETE", f"/api/v1/sessions/{sid}/", token)
        assert status in (200, 202, 204)
    wait_until(lambda: not containers_by_node(), timeout=60, what="every session container to be removed")
    wait_until(lambda: grants_agree(nodes)["holders"] == {"mh-a": set(), "mh-b": set()}, timeout=30,
               what="every grant to be released")
