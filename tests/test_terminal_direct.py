"""The distributed terminal's direct stream (protocol.terminal_stream, agent.direct): real uvicorn,
Celery manager and agent processes on Redis and PostgreSQL, real websocket and TCP clients.

A terminal whose agent listens reads and types through a TCP connection of its own to the agent:
the echo and a manager's notice come back over it, 2,000,000 lines of `seq` arrive complete and in order (also while the
client stops reading for a while: the agent waits for it), a terminal on the layer beside it sees
the same output, the session's exit arrives, a wrong or reused token is refused, and an agent that
dies closes the terminal with 4502 (the page connects again). Where the agent does not listen or
cannot be reached (direct streams off, an address that refuses, one that never answers), the
terminal works through the channel layer as before."""
from __future__ import annotations

import asyncio
import json
import re

import pytest
import websockets

import protocol
from common.celery import app
from common.layers import RedisChannelLayer
from protocol import pty_group, terminal_group
from protocol.terminal_stream import encode
from tests.conftest import ROOT, StackNode, wait_until
from tests.stack import ApiClient, free_port
from tests.test_e2e_distributed import api
from tests.test_terminal_stream import LINES, read_between

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

REDIS_DB = 12  # FGPU_TEST_STACK_REDIS_DB overrides it


def start_stack(distributed_stack, django_user_model, *, container: str = ""):
    """A one-node stack (the demo's GPU) whose agent.toml's [container] adds `container`; alice's
    API client and the node's agent process."""
    stack = distributed_stack(nodes=[StackNode("direct-node", (ROOT / "demo" / "mock-accelerator.toml").read_text(),
                                               container=container)], redis_db=REDIS_DB)
    django_user_model.objects.create_user("alice", password="alice-pass-123")
    status, body = api(stack.base, "POST", "/api/v1/auth/token/", body={"username": "alice", "password": "alice-pass-123"})
    assert status == 200, body
    return stack, ApiClient(stack.base, body["token"])


def running_session(stack, client: ApiClient, name: str, command: str | None = None) -> str:
    status, created = client.launch(name, {"resources": {"cuda.shares": "0.5"}, **({"command": command} if command else {})})
    assert status == 201, created
    wait_until(lambda: client.call("GET", f"/api/v1/sessions/{created['id']}/")[1]["status"] == "RUNNING", timeout=60,
               what="the session RUNNING")
    return created["id"]


def terminal_url(stack, client: ApiClient, session_id: str) -> str:
    status, ticket = client.call("POST", f"/api/v1/sessions/{session_id}/terminal-ticket/")
    assert status == 200, ticket
    return stack.base.replace("http://", "ws://") + ticket["url"]


async def type_and_read(ws, command: str, expect: str, *, timeout: float = 20) -> str:
    await ws.send(json.dumps({"type": "input", "data": command}))
    output = ""
    async with asyncio.timeout(timeout):
        while expect not in output:
            frame = json.loads(await ws.recv())
            assert frame["type"] == "output", frame
            output += frame["data"]
    return output


def agent_log(stack) -> str:
    return stack.agents["direct-node"].output()


def test_a_terminal_reads_and_types_through_its_direct_stream_and_its_session_ends_on_it(distributed_stack,
                                                                                          django_user_model):
    stack, client = start_stack(distributed_stack, django_user_model)
    session_id = running_session(stack, client, "direct")

    async def scenario():
        async with websockets.connect(terminal_url(stack, client, session_id), max_size=2**22) as ws:
            await ws.send(json.dumps({"type": "resize", "cols": 100, "rows": 30}))
            await type_and_read(ws, "echo HELLO-$((6*7)); stty size\r", "30 100")
            wait_until(lambda: f"of session {session_id} reads from 127.0.0.1:" in agent_log(stack), timeout=10,
                       what="the agent to say the terminal reads directly")
            # A manager's notice (idle reclamation, preemption: task fgpu.agent.session_notice) reaches it.
            with app.connection_for_write(stack.redis_url) as connection:
                app.send_task(protocol.SESSION_NOTICE, kwargs={"node": "direct-node", "session_id": session_id,
                                                               "text": "NOTICE-42"}, connection=connection)
            notice = ""
            async with asyncio.timeout(20):
                while "[fgpu: NOTICE-42]" not in notice:
                    notice += json.loads(await ws.recv())["data"]
            await ws.send(json.dumps({"type": "input", "data": "exit 3\r"}))
            async with asyncio.timeout(20):
                while (frame := json.loads(await ws.recv()))["type"] != "exit":
                    assert frame["type"] == "output", frame
            await ws.wait_closed()
            return frame

    frame = asyncio.run(scenario())
    assert frame == {"type": "exit", "code": 3}
    assert "no direct stream" not in stack.procs["web"].output()


def test_two_million_lines_of_seq_arrive_complete_and_in_order_over_the_direct_stream_with_a_slow_reader(
        distributed_stack, django_user_model):
    stack, client = start_stack(distributed_stack, django_user_model)
    session_id = running_session(stack, client, "seq")
    url = terminal_url(stack, client, session_id)

    # The client stops reading for 2 s after 3 MB: the agent waits for it (its window), nothing is lost.
    text = asyncio.run(read_between(url, f"echo BEGIN-$((6*7)); seq 1 {LINES}; echo END-$((6*7))\r",
                                    pause_after=3_000_000, pause_s=2.0))

    lines = text.split("\r\n")
    wrong = next((i for i, line in enumerate(lines[:-1], 1) if line != str(i)), None)
    assert wrong is None, f"line {wrong} is {lines[wrong - 1]!r}, then {lines[wrong:wrong + 2]}"
    assert lines[-1] == "" and len(lines) - 1 == LINES, f"{len(lines) - 1} lines arrived of {LINES}: {lines[-3:]}"
    assert f"of session {session_id} reads from 127.0.0.1:" in agent_log(stack)


def test_a_terminal_on_the_layer_beside_a_direct_one_sees_the_same_output_and_tokens_are_one_time(
        distributed_stack, django_user_model):
    port = free_port()
    stack, client = start_stack(distributed_stack, django_user_model, container=f"terminal-port = {port}")
    session_id = running_session(stack, client, "two")

    async def scenario():
        layer = RedisChannelLayer(hosts=[{"address": stack.redis_url, "socket_timeout": None}], capacity=1000, expiry=60)
        channel = await layer.new_channel("test.")
        await layer.group_add(terminal_group("direct-node", session_id), channel)

        async def from_layer(expect: str) -> str:
            output = ""
            async with asyncio.timeout(20):
                while expect not in output:
                    message = await layer.receive(channel)
                    if message["type"] == "terminal.output":
                        output += message["data"]
                        if "offset" in message:
                            await layer.group_send(pty_group("direct-node", session_id), {
                                "type": "pty.ack", "channel": channel, "offset": message["offset"], "n": message["n"],
                                "session_id": session_id})
            return output

        async with websockets.connect(terminal_url(stack, client, session_id), max_size=2**22) as ws:
            await type_and_read(ws, "echo FIRST-$((6*7))\r", "FIRST-42")
            # A second terminal, on the layer (as a web process whose agent it cannot reach): it attaches
            # without asking for a direct stream and reads the terminal group.
            await layer.group_send(pty_group("direct-node", session_id), {"type": "pty.attach", "reply_channel": channel,
                                                           "session_id": session_id})
            scrollback = await from_layer("FIRST-42")
            direct_side = await type_and_read(ws, "echo SECOND-$((6*7))\r", "SECOND-42")
            layer_side = await from_layer("SECOND-42")
            # A third terminal, direct too: its scrollback shows what came before it, once.
            async with websockets.connect(terminal_url(stack, client, session_id), max_size=2**22) as third:
                third_scrollback = json.loads(await asyncio.wait_for(third.recv(), 10))["data"]

            # Tokens: offered only on the asker's own channel; good once; a wrong one is refused.
            other = await layer.new_channel("test.")
            await layer.group_send(pty_group("direct-node", session_id), {"type": "pty.attach", "reply_channel": other,
                                                           "session_id": session_id, "direct": True})
            offer = await asyncio.wait_for(layer.receive(other), 10)
            answers = []
            for token in (offer["token"], offer["token"], "not-a-token"):
                reader, writer = await asyncio.open_connection(offer["host"], offer["port"])
                writer.write(encode({"token": token}))
                answers.append(json.loads(await asyncio.wait_for(reader.readline(), 10))["type"])
                writer.close()
            return scrollback, direct_side, layer_side, third_scrollback, offer, answers

    scrollback, direct_side, layer_side, third_scrollback, offer, answers = asyncio.run(scenario())
    assert "FIRST-42" in scrollback
    assert third_scrollback.count("FIRST-42") == 1 and third_scrollback.count("SECOND-42") == 1, third_scrollback
    assert "SECOND-42" in direct_side and "SECOND-42" in layer_side
    assert (offer["type"], offer["host"], offer["port"]) == ("terminal.direct", "127.0.0.1", port)
    assert answers == ["direct.ok", "direct.refused", "direct.refused"]
    wait_until(lambda: len(re.findall("refused a direct terminal stream", agent_log(stack))) == 2, timeout=10,
               what="the agent to log both refusals")


def test_a_direct_stream_that_breaks_closes_the_terminal_with_the_code_that_makes_the_page_reconnect(distributed_stack, django_user_model):
    stack, client = start_stack(distributed_stack, django_user_model)
    session_id = running_session(stack, client, "broken")

    async def scenario():
        async with websockets.connect(terminal_url(stack, client, session_id), max_size=2**22) as ws:
            await type_and_read(ws, "echo UP-$((6*7))\r", "UP-42")
            stack.kill("agent-direct-node")
            async with asyncio.timeout(20):
                with pytest.raises(websockets.ConnectionClosed):
                    while True:
                        await ws.recv()
            return ws.close_code

    assert asyncio.run(scenario()) == 4502  # the page connects again (static/js/terminal.js)


@pytest.mark.parametrize("container", ["terminal-direct = false", 'terminal-address = "127.0.0.3"',
                                       'terminal-address = "192.0.2.1"'],
                         ids=["direct off", "an address that refuses", "an address that never answers"])
def test_a_terminal_whose_agent_cannot_be_reached_directly_works_through_the_channel_layer(
        distributed_stack, django_user_model, container):
    stack, client = start_stack(distributed_stack, django_user_model, container=container)
    session_id = running_session(stack, client, "fallback")

    async def scenario():
        async with websockets.connect(terminal_url(stack, client, session_id), max_size=2**22) as ws:
            await ws.send(json.dumps({"type": "resize", "cols": 90, "rows": 20}))
            output = await type_and_read(ws, "echo LAYER-$((6*7)); stty size\r", "20 90")
            text = await asyncio.wait_for(read_rest(ws, "echo BEGIN-$((6*7)); seq 1 100000; echo DONE-$((6*7))\r"), 60)
            return output, text

    output, text = asyncio.run(scenario())
    assert "LAYER-42" in output
    assert text.split("\r\n")[:-1] == [str(i) for i in range(1, 100001)]
    assert "reads from" not in agent_log(stack)
    if "terminal-address" in container:
        assert "no direct stream" in stack.procs["web"].output()


async def read_rest(ws, command: str) -> str:
    """Type `command` (BEGIN-42, seq …, then DONE-42); the output between the markers."""
    await ws.send(json.dumps({"type": "input", "data": command}))
    output = ""
    while "DONE-42" not in output[-200:]:
        frame = json.loads(await ws.recv())
        output += frame.get("data", "")
    start = output.index("BEGIN-42\r\n") + len("BEGIN-42\r\n")
    return output[start:output.index("DONE-42", start)]
