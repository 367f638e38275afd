"""The blocking exec (`POST /api/v1/sessions/<id>/exec/` without `"stream": true`) waits for the
agent on uvicorn's event loop: many long execs held at once take neither the web process's
threads nor its database connections (a pool of DATABASE_POOL["max_size"] = 32), so the rest of
the API still answers while they run, and each exec still answers its result when it ends.

Real processes (tests/stack.py): uvicorn, the manager worker, and two agents (an agent runs at
most agent.core.EXEC_THREADS = 32 blocking execs at a time: 30 each keeps every command
running). Each command blocks reading a FIFO in its session's home until the test writes to it.
"""
from __future__ import annotations

import errno
import json
import os
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from console.settings import DATABASE_POOL
from tests.conftest import StackNode, wait_until
from tests.stack import mock_inventory

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

REDIS_DB = 12  # of its own, flushed first (FGPU_TEST_STACK_REDIS_DB overrides it)
HELD = 60  # well above the database pool (32) and twice what one agent runs at once
KEYS = {"exit_code", "stdout", "stderr", "truncated", "duration_ms"}


def call(base: str, token: str, method: str, path: str, body: dict | None = None, *, timeout: float = 150):
    headers = {"Content-Type": "application/json", **({"Authorization": f"Token {token}"} if token else {})}
    request = urllib.request.Request(base + path, method=method, data=json.dumps(body).encode() if body else None,
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def readers_of(name: str) -> list[int]:
    """The pids of the live `cat <name>` processes (the sessions' own: their sandboxes' PID namespaces
    lie below this one, so the node sees them)."""
    needle, found = name.encode(), []
    for entry in os.scandir("/proc"):
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"cat") and needle in argv:
            found.append(int(entry.name))
    return found


def release(name: str) -> None:
    """Give every `cat` blocked on the FIFO `name` in its session's home a writer (and EOF once it
    closes), through the cat's own working directory (/proc/<pid>/cwd: the home as its sandbox
    shows it); a cat not reading yet is served by the next call."""
    for pid in readers_of(name):
        try:
            fd = os.open(f"/proc/{pid}/cwd/{name}", os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno not in (errno.ENXIO, errno.ENOENT, errno.ESRCH):  # no reader right now, or it ended
                raise
            continue
        try:
            os.write(fd, b"go\n")
        except BrokenPipeError:
            pass
        finally:
            os.close(fd)


@pytest.fixture
def two_sessions(distributed_stack, django_user_model):
    """Two nodes with one 2-fGPU GPU each and alice's two whole-GPU sessions RUNNING, one on
    each: (stack, alice's token, [session ids])."""
    stack = distributed_stack(nodes=[StackNode("exec-a", mock_inventory(gpus=1)), StackNode("exec-b", mock_inventory(gpus=1))],
                              redis_db=REDIS_DB)
    django_user_model.objects.create_user("alice", password="alice-pass-123")
    status, body = call(stack.base, "", "POST", "/api/v1/auth/token/", {"username": "alice", "password": "alice-pass-123"})
    assert status == 200, body
    token, ids = body["token"], []
    for name in ("held-a", "held-b"):
        status, created = call(stack.base, token, "POST", "/api/v1/sessions/",
                               {"name": name, "resources": {"cuda.shares": "2", "cpu": 1, "mem": "1G"}})
        assert status == 201, created
        ids.append(created["id"])
    wait_until(lambda: all(call(stack.base, token, "GET", f"/api/v1/sessions/{i}/")[1]["status"] == "RUNNING"
                           for i in ids), timeout=60, what="both sessions RUNNING")
    nodes = {call(stack.base, token, "GET", f"/api/v1/sessions/{i}/")[1]["node"] for i in ids}
    assert nodes == {"exec-a", "exec-b"}
    return stack, token, ids


def test_sixty_held_execs_hold_no_web_thread_and_a_get_answers_meanwhile(two_sessions):
    stack, token, ids = two_sessions
    assert HELD > DATABASE_POOL["max_size"]
    fifo = f"release-{uuid.uuid4().hex[:8]}.fifo"  # in each session's home (what its sandbox shows it)
    for session_id in ids:
        status, made = call(stack.base, token, "POST", f"/api/v1/sessions/{session_id}/exec/", {"command": ["mkfifo", fifo]})
        assert (status, made.get("exit_code")) == (200, 0), made
    web = stack.procs["web"].pid
    for _ in range(3):  # the web process's pools as any request leaves them
        assert call(stack.base, token, "GET", f"/api/v1/sessions/{ids[0]}/")[0] == 200
    idle_threads = threads_of(web)

    with ThreadPoolExecutor(HELD) as pool:
        execs = [pool.submit(call, stack.base, token, "POST", f"/api/v1/sessions/{ids[i % 2]}/exec/",
                             {"command": ["cat", fifo], "timeout": 120}) for i in range(HELD)]
        try:
            wait_until(lambda: len(readers_of(fifo)) == HELD, timeout=60, what=f"{HELD} commands blocked on the FIFO")
            held_threads = threads_of(web)
            status, shown = call(stack.base, token, "GET", f"/api/v1/sessions/{ids[1]}/", timeout=60)
            answered_meanwhile = [f for f in execs if f.done()]
        finally:
            wait_until(lambda: release(fifo) or all(f.done() for f in execs), timeout=60, interval=0.05,
                       what="every exec to answer")

    assert status == 200 and shown["id"] == ids[1]
    assert answered_meanwhile == []  # the GET answered while all sixty were held
    # Without the fix each held exec kept a thread (and a database connection) of its own.
    assert held_threads - idle_threads < 10, (idle_threads, held_threads)
    results = [f.result() for f in execs]
    assert [status for status, _ in results] == [200] * HELD, results
    assert all(set(body) == KEYS and body["exit_code"] == 0 for _, body in results), results
    assert sum(body["stdout"].count("go") for _, body in results) >= 1
