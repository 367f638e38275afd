"""The walkthrough, distributed: real PostgreSQL and Redis, a uvicorn server, a separate Celery
manager worker (with beat) and a separate agent process with the demo mock node.

A 0.5 fGPU session is created through the REST API, reaches RUNNING, its terminal websocket
runs `nvidia-smi` and shows 2048MiB; deleting it ends it TERMINATED and the device is back
at 2.00 fGPU free, its allocation released exactly once.
"""
from __future__ import annotations

import asyncio
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import websockets

from tests.conftest import ROOT, StackNode, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

VENV_BIN = Path(sys.executable).parent
REDIS_DB = 7  # a database of its own, flushed first, so stale queues cannot interfere


def api(base: str, method: str, path: str, token: str | None = None, body: dict | None = None):
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Token {token}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def get_ok(base, path, token):
    status, body = api(base, "GET", path, token)
    assert status == 200, body
    return body


async def terminal_run(url: str, command: str, expect: str, *, timeout: float = 20.0) -> str:
    """Open the terminal websocket, type `command`, collect output until `expect` shows up."""
    output = ""
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "resize", "cols": 120, "rows": 40}))
        await ws.send(json.dumps({"type": "input", "data": command}))
        deadline = asyncio.get_running_loop().time() + timeout
        while expect not in output:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise AssertionError(f"{expect!r} not in terminal output:\n{output}")
            frame = json.loads(await asyncio.wait_for(ws.recv(), remaining))
            assert frame["type"] in ("output", "exit"), frame
            output += frame.get("data", "")
    return output


@pytest.fixture
def cluster(distributed_stack, django_user_model):
    """The stack with the demo node as `e2e-node` (one 8 GiB / 80-SM GPU) on Redis db REDIS_DB,
    and user alice (password alice-pass-123). Returns (base URL, alice's token)."""
    stack = distributed_stack(nodes=[StackNode("e2e-node", (ROOT / "demo" / "mock-accelerator.toml").read_text())],
                              redis_db=REDIS_DB)
    django_user_model.objects.create_user("alice", password="alice-pass-123")
    status, body = api(stack.base, "POST", "/api/v1/auth/token/", body={"username": "alice", "password": "alice-pass-123"})
    assert status == 200, body
    return stack.base, body["token"]


def test_a_half_fgpu_session_runs_nvidia_smi_with_2gib_and_gives_the_capacity_back(cluster):
    base, token = cluster
    status, created = api(base, "POST", "/api/v1/sessions/", token,
                          {"name": "demo", "resources": {"cuda.shares": "0.5", "cpu": 1, "mem": "1G"}})
    assert status == 201, created
    session_id = created["id"]
    assert created["status"] in ("PENDING", "SCHEDULED", "PREPARING", "RUNNING")

    session = wait_until(lambda: (s := get_ok(base, f"/api/v1/sessions/{session_id}/", token))["status"] == "RUNNING" and s,
                         timeout=60, what="the session to be RUNNING")
    assert session["node"] == "e2e-node"
    assert session["configuration"].startswith("0.50 fGPU")
    [allocation] = session["allocations"]
    assert (allocation["shares"], allocation["memory"], allocation["procs"]) == ("0.500", 2 * 1024**3, "20.000")

    status, ticket = api(base, "POST", f"/api/v1/sessions/{session_id}/terminal-ticket/", token)
    assert status == 200, ticket
    assert ticket["url"] == f"/ws/sessions/{session_id}/terminal/?ticket={ticket['ticket']}"
    output = asyncio.run(terminal_run(f"ws://127.0.0.1:{base.rsplit(':', 1)[1]}{ticket['url']}", "nvidia-smi\r", "2048MiB"))
    assert "0MiB /   2048MiB" in output
    assert "8192MiB /" not in output  # the card's full size never shows as the total

    # The same ticket cannot be used twice.
    async def reuse():
        with pytest.raises(websockets.exceptions.WebSocketException):
            async with websockets.connect(f"ws://127.0.0.1:{base.rsplit(':', 1)[1]}{ticket['url']}") as ws:
                await asyncio.wait_for(ws.recv(), 5)
    asyncio.run(reuse())

    node = get_ok(base, "/api/v1/nodes/e2e-node/", token)
    assert node["devices"][0]["free_fgpu"] == "1.50"

    status, body = api(base, "DELETE", f"/api/v1/sessions/{session_id}/", token)
    assert status == 202, body
    ended = wait_until(lambda: (s := get_ok(base, f"/api/v1/sessions/{session_id}/", token))["status"] == "TERMINATED" and s,
                       timeout=30, what="the session to be TERMINATED")
    assert ended["allocations"][0]["released_at"] is not None
    device = get_ok(base, "/api/v1/nodes/e2e-node/", token)["devices"][0]
    assert (device["capacity_fgpu"], device["allocated_fgpu"], device["free_fgpu"]) == ("2.00", "0.00", "2.00")
    from sessions.models import Allocation

    assert Allocation.objects.filter(session_id=session_id).count() == 1
    assert Allocation.objects.filter(session_id=session_id, released_at__isnull=False).count() == 1


def test_web_manager_and_agent_freeze_what_they_imported_out_of_garbage_collection(distributed_stack):
    """common.startup: once ready, each long-running process moves the objects of its imports
    out of the collector's reach (full collections measured 70-146 ms before, a stall of every
    terminal a process relays) and says how many it froze."""
    import re

    stack = distributed_stack(nodes=[StackNode("e2e-node", (ROOT / "demo" / "mock-accelerator.toml").read_text())],
                              redis_db=REDIS_DB)
    for name, what in (("web", "web"), ("manager", "worker"), (stack.agent_name("e2e-node"), "agent e2e-node")):
        line = re.compile(rf"{re.escape(what)}: (\d+) objects frozen out of garbage collection")
        wait_until(lambda: line.search(stack.procs[name].output()), timeout=30, what=f"{name}'s freeze")
        frozen = int(line.search(stack.procs[name].output()).group(1))
        assert frozen > 50_000, (name, frozen)  # Django and the rest: a few hundred thousand
