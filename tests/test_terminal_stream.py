"""Terminal output through the whole standalone console as `make run` starts it: a real uvicorn
server process, its embedded agent and in-memory channel layer, a real websocket client. Not a
timing: every line of a large output arrives, in order, also when the client stops reading for a
while (the agent then leaves the PTY unread: agent.core, READER_WINDOW_CHARS)."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
import websockets

from tests.stack import ApiClient
from tests.test_browser import ADMIN_PASSWORD, console_url  # noqa: F401 (fixture)
from tests.conftest import wait_until

pytestmark = pytest.mark.e2e

LINES = 2_000_000


def token_for(base: str) -> str:
    request = urllib.request.Request(base + "/api/v1/auth/token/", method="POST", headers={
        "Content-Type": "application/json"}, data=json.dumps({"username": "admin", "password": ADMIN_PASSWORD}).encode())
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["token"]


async def read_between(url: str, command: str, *, pause_after: int, pause_s: float, timeout: float = 120) -> str:
    """Type `command` (which prints BEGIN-42 … END-42) in the terminal at `url`; the text between
    the markers. The client stops reading for `pause_s` once `pause_after` characters arrived."""
    chunks, received, paused = [], 0, False
    async with websockets.connect(url, max_size=2**22, compression=None) as ws:
        await ws.send(json.dumps({"type": "input", "data": command}))
        async with asyncio.timeout(timeout):
            while True:
                frame = json.loads(await ws.recv())
                assert frame["type"] == "output", frame
                chunks.append(frame["data"])
                received += len(frame["data"])
                if "END-42" in "".join(chunks[-2:]):
                    break
                if not paused and received >= pause_after:
                    paused = True
                    await asyncio.sleep(pause_s)  # noqa: TID251 (the behaviour under test: a client that does not read; the agent must wait for it)
    text = "".join(chunks)
    begin = text.index("BEGIN-42\r\n") + len("BEGIN-42\r\n")
    return text[begin:text.index("END-42", begin)]


def test_two_million_lines_of_seq_arrive_complete_and_in_order_through_the_websocket(console_url):  # noqa: F811
    api = ApiClient(console_url, token_for(console_url))
    status, session = api.launch("seq", {"resources": {"cuda.shares": "0.5"}})
    assert status == 201, session
    wait_until(lambda: api.call("GET", f"/api/v1/sessions/{session['id']}/")[1]["status"] == "RUNNING", timeout=60,
               what="the session RUNNING")
    status, ticket = api.call("POST", f"/api/v1/sessions/{session['id']}/terminal-ticket/")
    assert status == 200, ticket
    url = console_url.replace("http://", "ws://") + ticket["url"]

    text = asyncio.run(read_between(url, f"echo BEGIN-$((6*7)); seq 1 {LINES}; echo END-$((6*7))\r",
                                    pause_after=3_000_000, pause_s=2.0))

    lines = text.split("\r\n")  # the PTY turns \n into \r\n
    wrong = next((i for i, line in enumerate(lines[:-1], 1) if line != str(i)), None)
    assert wrong is None, f"line {wrong} is {lines[wrong - 1]!r}, then {lines[wrong:wrong + 2]}"
    assert lines[-1] == "" and len(lines) - 1 == LINES, f"{len(lines) - 1} lines arrived of {LINES}: {lines[-3:]}"
