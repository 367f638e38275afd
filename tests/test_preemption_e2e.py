"""Preemption with notice on the real stack (issue 17.2): PostgreSQL, Redis, uvicorn, a Celery
manager worker with beat, and an agent process with the demo node (one 2 fGPU GPU).

alice's batch session holds the whole GPU; an administrator's priority-5 session then waits for
it. The scheduler's pass puts alice's session under notice: the line arrives in its terminal
over the websocket and its API shape carries the reason and `preempt_at`; after the grace period
(3 s here) a later pass stops it, it ends TERMINATED with "preempted: …" naming the session it
made room for, its terminal gets the exit frame, and the waiting session starts."""
from __future__ import annotations

import asyncio
import json

import pytest
import websockets

from tests.conftest import ROOT, StackNode, wait_until, wait_until_async
from tests.test_e2e_distributed import api, get_ok

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

REDIS_DB = 12
GRACE_S = 3


@pytest.fixture
def preempting_cluster(distributed_stack, django_user_model, monkeypatch):
    """The stack with FGPU_PREEMPTION on and a 3 s grace period; alice and the administrator root.
    Returns (base URL, alice's token, root's token)."""
    monkeypatch.setenv("FGPU_PREEMPTION", "1")
    monkeypatch.setenv("FGPU_PREEMPTION_GRACE_SECONDS", str(GRACE_S))
    stack = distributed_stack(nodes=[StackNode("e2e-node", (ROOT / "demo" / "mock-accelerator.toml").read_text())],
                              redis_db=REDIS_DB)
    tokens = []
    for name, staff in (("alice", False), ("root", True)):
        django_user_model.objects.create_user(name, password=f"{name}-pass-123", is_staff=staff)
        status, body = api(stack.base, "POST", "/api/v1/auth/token/", body={"username": name,
                                                                            "password": f"{name}-pass-123"})
        assert status == 200, body
        tokens.append(body["token"])
    return stack.base, *tokens


async def watch_terminal(url: str, until: str, *, timeout: float, connected: asyncio.Event | None = None) -> str:
    """Everything the terminal websocket sends until a frame of type `until` ("exit"), as text
    (an exit frame as "<exit N>"). `connected` is set once the websocket is open."""
    output = ""
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "resize", "cols": 200, "rows": 40}))
        if connected is not None:
            connected.set()
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise AssertionError(f"no {until!r} frame within {timeout} s; the terminal showed:\n{output}")
            try:
                frame = json.loads(await asyncio.wait_for(ws.recv(), remaining))
            except websockets.exceptions.ConnectionClosed:
                return output + "<closed>"
            if frame["type"] == "exit":
                return output + f"<exit {frame['code']}>"
            output += frame.get("data", "")


def test_a_preemptible_session_is_warned_in_its_terminal_ends_with_the_reason_and_the_waiting_one_starts(
        preempting_cluster):
    base, alice, root = preempting_cluster
    status, job = api(base, "POST", "/api/v1/sessions/", alice, {
        "name": "job", "resources": {"cuda.shares": "2", "cpu": 1, "mem": "256M"},
        "command": "echo training started; sleep 600"})
    assert status == 201, job
    assert job["preemptible"] is True and job["min_runtime"] == 0  # a batch session: preemptible by default
    wait_until(lambda: get_ok(base, f"/api/v1/sessions/{job['id']}/", alice)["status"] == "RUNNING", timeout=60,
               what="alice's job to be RUNNING")
    status, ticket = api(base, "POST", f"/api/v1/sessions/{job['id']}/terminal-ticket/", alice)
    assert status == 200, ticket
    url = f"ws://127.0.0.1:{base.rsplit(':', 1)[1]}{ticket['url']}"

    async def scenario() -> str:
        connected = asyncio.Event()
        watching = asyncio.create_task(watch_terminal(url, "exit", timeout=90, connected=connected))
        # the websocket connects before the launch below (a failed connection ends the wait too)
        await wait_until_async(lambda: connected.is_set() or watching.done(), timeout=30, what="the terminal connected")
        if watching.done():
            watching.result()  # raises why it ended
        status, urgent = await asyncio.to_thread(api, base, "POST", "/api/v1/sessions/", root, {
            "name": "urgent", "resources": {"cuda.shares": "1", "cpu": 1, "mem": "256M"}, "priority": 5})
        assert status == 201, urgent
        return urgent["id"], await watching

    urgent_id, terminal = asyncio.run(scenario())

    assert "this session will be preempted at " in terminal, terminal
    assert "to make room for urgent of root (priority 5 over 0): save your work" in terminal
    assert terminal.index("will be preempted") < terminal.index("<exit")  # warned, then stopped
    ended = wait_until(lambda: (s := get_ok(base, f"/api/v1/sessions/{job['id']}/", alice))["status"] == "TERMINATED"
                       and s, timeout=60, what="alice's job to end")
    assert ended["status_reason"].startswith("preempted: stopped to make room for urgent of root"), ended
    assert f"(session {urgent_id})" in ended["status_reason"]
    assert ended["preempted_for"] == urgent_id and ended["preempt_at"] is not None
    assert ended["allocations"][0]["released_at"] is not None
    started = wait_until(lambda: (s := get_ok(base, f"/api/v1/sessions/{urgent_id}/", root))["status"] == "RUNNING"
                         and s, timeout=60, what="the waiting session to start")
    assert started["node"] == "e2e-node"
