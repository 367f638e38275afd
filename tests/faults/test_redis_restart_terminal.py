"""A terminal after a Redis restart (issue 33.4). Redis restarted empty forgets every group
membership, the agent's terminal groups among them, until the agent joins them again (each
heartbeat); the first terminal opened meanwhile was accepted and silent, its ticket spent. Now the
web waits for the session's agent to be in its terminal group before it sends the attach, and
re-sends an attach that goes unanswered: the first terminal opened after the restart works. One
that cannot attach at all (its agent gone) is closed with 1013 "try again later" and its ticket is
given back, never spent.

The stack's Redis is a private redis-server on a port of its own (tests/stack.py), never the
machine's; the heartbeat interval is the product's default, 5 s, where the agent must join its
groups again in time; 1 s where its agent is gone, so that the web gives up on it sooner (its wait is
two heartbeat intervals and 5 s: 7 s, not 15 s, twice; issue 34.5).
"""
from __future__ import annotations

import asyncio
import json
import time

import pytest
import websockets

from tests.conftest import wait_until
from tests.stack import ApiClient, Stack, StackNode, mock_inventory

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

FIRST_TERMINAL_S = 30  # the first terminal after the restart shows its echo within this (a heartbeat is 5 s)


@pytest.fixture
def stack(tmp_path, request):
    """The stack, its heartbeat interval the product's default (5 s) or the test's parameter (indirect)."""
    started = Stack(nodes=[StackNode("redis-node", mock_inventory(gpus=1), devices=1, scratch_retention=0)],
                    work_dir=tmp_path / "stack", heartbeat_interval=getattr(request, "param", 5),
                    env={"FGPU_HEARTBEAT_TIMEOUT": "60"})
    try:
        yield started.start()
    finally:
        report = getattr(request.node, "rep_call", None)
        if report is None or report.failed:
            print(started.logs(tail=6000))
        started.close()


def running_session(stack: Stack, token: str) -> str:
    client = ApiClient(stack.base, token)
    status, body = client.launch("shell", {"resources": {"cuda.shares": "0.5", "cpu": 1, "mem": "256M"}})
    assert status == 201, body
    wait_until(lambda: client.call("GET", f"/api/v1/sessions/{body['id']}/")[1]["status"] == "RUNNING", timeout=60,
               what="the session to be RUNNING")
    return body["id"]


def ticket_url(stack: Stack, token: str, session_id: str) -> tuple[str, str]:
    status, ticket = ApiClient(stack.base, token).call("POST", f"/api/v1/sessions/{session_id}/terminal-ticket/")
    assert status == 200, ticket
    return f"ws://127.0.0.1:{stack.port}{ticket['url']}", ticket["ticket"]


async def echo(url: str, word: str, *, timeout: float) -> tuple[str, float]:
    """Open the terminal, type `echo` of a sum that prints `word` (so the typed line itself does
    not match), and read until it shows; (output, seconds from opening). AssertionError on a close
    or the timeout."""
    started = time.monotonic()
    output = ""
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "input", "data": f"echo {word}-$((6*7))\r"}))
        async with asyncio.timeout(timeout):
            while f"{word}-42" not in output:
                frame = json.loads(await ws.recv())
                assert frame["type"] == "output", frame
                output += frame["data"]
    return output, time.monotonic() - started


def ticket_spent(ticket: str) -> bool:
    from django.db import connection

    from sessions.models import TerminalTicket
    from sessions.lifecycle.services import _digest

    connection.close()
    return TerminalTicket.objects.get(digest=_digest(ticket)).used_at is not None


def test_the_first_terminal_opened_right_after_a_redis_restart_works(stack, alice_token):
    session_id = running_session(stack, alice_token)
    url, _ = ticket_url(stack, alice_token, session_id)
    asyncio.run(echo(url, "before", timeout=20))  # the web's layer connections exist, as in a running console

    stack.redis_stop()
    stack.redis_start()
    url, ticket = ticket_url(stack, alice_token, session_id)
    output, took = asyncio.run(echo(url, "first", timeout=FIRST_TERMINAL_S))

    print(f"redis-restart: the first terminal after the restart echoed in {took:.1f} s")
    assert ticket_spent(ticket)
    url, _ = ticket_url(stack, alice_token, session_id)
    assert asyncio.run(echo(url, "second", timeout=10))[1] < 5  # and the next one at once


@pytest.mark.parametrize("stack", [1], indirect=True, ids=["heartbeat-1s"])
def test_a_terminal_that_cannot_attach_after_a_redis_restart_is_told_to_try_again_and_keeps_its_ticket(
        stack, alice_token):
    session_id = running_session(stack, alice_token)
    stack.kill(Stack.agent_name("redis-node"))  # its session runs on, as on a node whose agent restarts
    stack.redis_stop()
    stack.redis_start()
    url, ticket = ticket_url(stack, alice_token, session_id)

    async def refused():
        async with websockets.connect(url) as ws:
            async with asyncio.timeout(40):
                with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
                    while True:
                        frame = json.loads(await ws.recv())
                        assert frame["type"] == "output" and not frame["data"].strip(), frame
            return closed.value.rcvd.code

    started = time.monotonic()
    assert asyncio.run(refused()) == 1013
    waited = time.monotonic() - started
    assert not ticket_spent(ticket), "the ticket of a terminal that never attached was spent"
    assert asyncio.run(refused()) == 1013  # the same ticket again: not refused as used (4403)
    print(f"redis-restart: a terminal with no agent to attach to was told to try again after {waited:.1f} s")
