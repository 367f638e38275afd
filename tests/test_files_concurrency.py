"""The files API (`/api/v1/sessions/<id>/files/…`: list, download, upload) waits for the agent on
uvicorn's event loop: sixty requests held at once by an agent that does not answer take neither
the web process's threads nor its database connections (a pool of DATABASE_POOL["max_size"] =
32), the rest of the API answers meanwhile, and each request answers in full once the agent does.

Real processes (tests/stack.py): uvicorn, the manager worker and one agent, which the test stops
(SIGSTOP) while the requests are held and continues (SIGCONT) after. The test joins the
session's `pty.<node>.<id>` group itself, as a second listener that never answers, to see each
request's first op reach the agent's channel (then every request is waiting for the agent).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from common.layers import RedisChannelLayer
from console.settings import DATABASE_POOL
from protocol import files as proto
from sessions.lifecycle import events
from tests.conftest import StackNode, wait_until
from tests.stack import mock_inventory
from tests.test_exec_concurrency import call, threads_of

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

REDIS_DB = 9  # of its own, flushed first (FGPU_TEST_STACK_REDIS_DB overrides it)
HELD = 60  # well above the database pool (32): twenty each of listings, downloads and uploads
PAYLOAD = os.urandom(2 * proto.CHUNK_BYTES + 7)  # three chunks from the agent
UPLOAD = os.urandom(proto.CHUNK_BYTES + 11)  # two chunks to the agent


def raw(base: str, token: str, method: str, path: str, data: bytes | None = None, *, timeout: float = 150):
    """(status, body bytes) of one request with `data` as its body."""
    request = urllib.request.Request(base + path, method=method, data=data,
                                     headers={"Authorization": f"Token {token}",
                                              "Content-Type": "application/octet-stream"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class Listener(threading.Thread):
    """A member of `group` on the stack's channel layer (its own event loop, in this thread) that
    records the `op` of each files message it receives, up to `count`, and answers none."""

    def __init__(self, redis_url: str, group: str, count: int):
        super().__init__(daemon=True)
        self.redis_url, self.group, self.count = redis_url, group, count
        self.ops: list[str] = []
        self.joined = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._listen())
        except BaseException as exc:  # shown by the test's wait
            self.error = exc

    async def _listen(self) -> None:
        layer = RedisChannelLayer(hosts=[{"address": self.redis_url, "socket_timeout": None}], capacity=1000)
        channel = await layer.new_channel("files-listener.")
        await layer.group_add(self.group, channel)
        self.joined.set()
        try:
            async with asyncio.timeout(120):
                while len(self.ops) < self.count:
                    message = await layer.receive(channel)
                    if message.get("type") == proto.FILES:
                        self.ops.append(message["op"])
        finally:
            await layer.group_discard(self.group, channel)  # its receiving task ends with the loop

    def seen(self) -> int:
        assert self.error is None, self.error
        return len(self.ops)


@pytest.fixture
def running_session(distributed_stack, django_user_model):
    """One node with one 2-fGPU GPU and alice's session RUNNING on it, holding `payload.bin`
    (PAYLOAD): (stack, alice's token, the session's id)."""
    stack = distributed_stack(nodes=[StackNode("files-a", mock_inventory(gpus=1))], redis_db=REDIS_DB)
    django_user_model.objects.create_user("alice", password="alice-pass-123")
    status, body = call(stack.base, "", "POST", "/api/v1/auth/token/", {"username": "alice", "password": "alice-pass-123"})
    assert status == 200, body
    token = body["token"]
    status, created = call(stack.base, token, "POST", "/api/v1/sessions/",
                           {"name": "files", "resources": {"cuda.shares": "0.5", "cpu": 1, "mem": "1G"}})
    assert status == 201, created
    session = created["id"]
    wait_until(lambda: call(stack.base, token, "GET", f"/api/v1/sessions/{session}/")[1]["status"] == "RUNNING",
               timeout=60, what="the session RUNNING")
    status, _ = raw(stack.base, token, "PUT", f"/api/v1/sessions/{session}/files/content/?path=payload.bin", PAYLOAD)
    assert status == 201
    return stack, token, session


def test_sixty_file_requests_held_by_a_stopped_agent_hold_no_web_thread_and_answer_when_it_continues(
        running_session):
    stack, token, session = running_session
    files = f"/api/v1/sessions/{session}/files/"
    uploads = HELD // 3
    requests = [("GET", f"{files}?path=", None), ("GET", f"{files}content/?path=payload.bin", None)] * uploads
    requests += [("PUT", f"{files}content/?path=up-{i}.bin", UPLOAD) for i in range(uploads)]
    web, agent = stack.procs["web"].pid, stack.agents["files-a"].pid
    for _ in range(3):  # the web process's pools as any request leaves them
        assert call(stack.base, token, "GET", f"/api/v1/sessions/{session}/")[0] == 200
    idle_threads = threads_of(web)
    listener = Listener(stack.redis_url, events.pty_group("files-a", session), HELD)
    listener.start()
    assert listener.joined.wait(30)

    os.kill(agent, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(HELD) as pool:
            held = [pool.submit(raw, stack.base, token, method, path, data) for method, path, data in requests]
            wait_until(lambda: listener.seen() >= HELD, timeout=60, what=f"{HELD} file requests waiting for the agent")
            held_threads = threads_of(web)
            status, shown = call(stack.base, token, "GET", f"/api/v1/sessions/{session}/", timeout=60)
            answered_meanwhile = [f for f in held if f.done()]
            os.kill(agent, signal.SIGCONT)
            results = [f.result() for f in held]
    finally:
        os.kill(agent, signal.SIGCONT)

    assert status == 200 and shown["id"] == session
    assert answered_meanwhile == []  # the GET answered while all sixty were held
    assert sorted(listener.ops) == ["list"] * uploads + ["read"] * uploads + ["upload_begin"] * uploads
    # Without the fix each held request kept a thread (and with it a database connection) of its own.
    assert held_threads - idle_threads < 10, (idle_threads, held_threads)
    assert HELD > DATABASE_POOL["max_size"]
    for (method, path, _), (status, body) in zip(requests, results, strict=True):
        if method == "PUT":
            assert status == 201 and json.loads(body)["size"] == len(UPLOAD), (path, status, body[:300])
        elif "content/" in path:
            assert status == 200 and body == PAYLOAD, (path, status, len(body))
        else:
            assert status == 200 and "payload.bin" in {e["name"] for e in json.loads(body)["entries"]}, (path, status)
    status, listing = call(stack.base, token, "GET", f"{files}?path=")
    assert {e["name"] for e in listing["entries"]} >= {f"up-{i}.bin" for i in range(uploads)}
