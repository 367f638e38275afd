"""Preemption with notice on the real stack (issues 17.2, 32.2): PostgreSQL, Redis, uvicorn, a
Celery manager worker with beat, and an agent process with the demo node (one 2 fGPU GPU).

alice's batch session holds the whole GPU; an administrator's priority-5 session then waits for
it. The scheduler's pass puts alice's session under notice: the agent writes the notice into its
output (the terminal over the websocket, and the log `fgpu logs` reads) and sends its signal at
once (SIGTERM, or the one its launch named), its API shape carries the reason and `preempt_at`;
after the grace period (6 s here) a later pass stops what still runs, it ends with "preempted: …"
naming the session it made room for, its terminal gets the exit frame, the waiting session
starts, and alice's session is launched again (`requeued_as`), which runs once the room is free."""
from __future__ import annotations

import asyncio
import json
from datetime import datetime

import pytest
import websockets

from tests.conftest import ROOT, StackNode, wait_until, wait_until_async
from tests.test_e2e_distributed import api, get_ok

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

REDIS_DB = 12
GRACE_S = 6


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

    assert "[fgpu: preemption notice at " in terminal and ", SIGTERM sent: to be preempted at " in terminal, terminal
    assert "to make room for urgent of root (priority 5 over 0); save your work" in terminal
    assert terminal.index("preemption notice") < terminal.index("<exit")  # warned, then ended
    ended = wait_until(lambda: (s := get_ok(base, f"/api/v1/sessions/{job['id']}/", alice))["status"] in ("TERMINATED", "ERROR")
                       and s["requeued_as"] and s, timeout=60, what="alice's job to end and be requeued")
    # `echo …; sleep 600` has no handler: its shell ends on the SIGTERM at once, and it is requeued
    assert ended["status_reason"].startswith("preempted: "), ended
    assert f"(session {urgent_id})" in ended["status_reason"]
    assert ended["status_reason"].endswith(f"; requeued as session {ended['requeued_as']}")
    assert ended["preempted_for"] == urgent_id and ended["preempt_at"] is not None
    assert ended["allocations"][0]["released_at"] is not None
    started = wait_until(lambda: (s := get_ok(base, f"/api/v1/sessions/{urgent_id}/", root))["status"] == "RUNNING"
                         and s, timeout=60, what="the waiting session to start")
    assert started["node"] == "e2e-node"


# A batch job that says which signal it got and when (epoch seconds), and goes on working.
SIGNAL_REPORTER = (
    "python3 -u -c 'import signal, time\n"
    "def got(n, f): print(\"got %s at %.3f\" % (signal.Signals(n).name, time.time()), flush=True)\n"
    "signal.signal(signal.SIGUSR1, got)\n"
    "print(\"training started at %.3f\" % time.time(), flush=True)\n"
    "while True: time.sleep(0.1)'"
)


def log_text(base: str, session_id: str, token: str) -> str:
    return get_ok(base, f"/api/v1/sessions/{session_id}/logs/", token)["text"]


def test_a_batch_job_gets_its_signal_and_the_notice_in_its_log_at_selection_and_runs_again_once_requeued(
        preempting_cluster):
    base, alice, root = preempting_cluster
    status, job = api(base, "POST", "/api/v1/sessions/", alice, {
        "name": "job", "resources": {"cuda.shares": "2", "cpu": 1, "mem": "256M"}, "command": SIGNAL_REPORTER,
        "preempt_signal": "USR1"})
    assert status == 201, job
    assert (job["preempt_signal"], job["requeue"]) == ("SIGUSR1", True)
    wait_until(lambda: "training started" in log_text(base, job["id"], alice), timeout=60, what="alice's job to start")

    status, urgent = api(base, "POST", "/api/v1/sessions/", root, {
        "name": "urgent", "resources": {"cuda.shares": "1", "cpu": 1, "mem": "256M"}, "priority": 5})
    assert status == 201, urgent
    text = wait_until(lambda: t if "got SIGUSR1 at " in (t := log_text(base, job["id"], alice)) else None,
                      timeout=60, what="the signal in the job's log")

    shown = get_ok(base, f"/api/v1/sessions/{job['id']}/", alice)
    assert shown["status"] == "RUNNING" and shown["preempted_for"] == urgent["id"]  # it runs through its grace
    selected = datetime.fromisoformat(shown["preempt_at"]).timestamp() - GRACE_S  # when it was put under notice
    notice = text.index("[fgpu: preemption notice at ")
    assert ", SIGUSR1 sent: to be preempted at " in text[notice:] and "save your work" in text[notice:]
    got = text.index("got SIGUSR1 at ")
    assert notice < got  # the notice line first, then what the program printed on its signal
    signalled = float(text[got:].split()[3])
    assert selected - 1 <= signalled <= selected + 3, (selected, signalled)  # at selection, not at the stop
    assert text.count("got SIGUSR1") == 1  # once, though every pass re-sends the notice

    ended = wait_until(lambda: (s := get_ok(base, f"/api/v1/sessions/{job['id']}/", alice))["requeued_as"] and s,
                       timeout=60, what="the job to be stopped at its time and requeued")
    assert ended["status"] == "TERMINATED" and ended["status_reason"].startswith(
        "preempted: stopped to make room for urgent of root"), ended
    assert datetime.fromisoformat(ended["terminated_at"]).timestamp() >= selected + GRACE_S - 1  # after its grace
    again = get_ok(base, f"/api/v1/sessions/{ended['requeued_as']}/", alice)
    assert (again["requeued_from"], again["command"], again["preempt_signal"]) == (job["id"], SIGNAL_REPORTER, "SIGUSR1")
    assert again["created_at"] == job["created_at"]  # its place by arrival
    wait_until(lambda: get_ok(base, f"/api/v1/sessions/{urgent['id']}/", root)["status"] == "RUNNING", timeout=60,
               what="the waiting session to start")
    assert get_ok(base, f"/api/v1/sessions/{again['id']}/", alice)["status"] == "PENDING"  # 2 fGPU: it waits for room

    assert api(base, "DELETE", f"/api/v1/sessions/{urgent['id']}/", root)[0] in (200, 202, 204)
    wait_until(lambda: "training started" in log_text(base, again["id"], alice), timeout=60,
               what="the requeued job to run again")
