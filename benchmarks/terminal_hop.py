"""The floor of the web's part of a distributed terminal, for benchmarks/terminal.py (target
`distributed-hop`): the least a Python process between the browser and the agent can do.

    python benchmarks/terminal_hop.py PORT REDIS_URL SESSION_ID NODE

A websocket server (the `websockets` package, as benchmarks/terminal_relay.py) in place of
uvicorn and TerminalConsumer: for each connection it asks the session's agent for a direct
stream over the channel layer at REDIS_URL (`pty.attach` with `direct`, as the consumer does),
connects with the token it is offered (protocol.terminal_stream) and from then on relays the same
JSON frames both ways: client `input` and `resize` → `pty.input`, `pty.resize` lines; the agent's
`terminal.output` lines → `{"type": "output", "data"}`, each acknowledged (`pty.ack`) once the
websocket has taken it (`await ws.send` waits for the socket's buffer to drain), so the agent's
flow control holds and a slow reader loses nothing. No ticket, no user, no database, no
fallback to the layer: a measuring instrument, not a terminal to serve.

The distributed target's echo minus this one's is what uvicorn, Channels and the consumer add;
this one's minus the relay's is the cost of a second process on the path (its two wake-ups and
two loopback sends each way), which no web process can avoid.
"""

import asyncio
import json
import sys
from pathlib import Path

from websockets.asyncio.server import serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.layers import RedisChannelLayer  # noqa: E402 (the project's root on the path first)
from protocol import pty_group  # noqa: E402
from protocol.terminal_stream import DIRECT_OK, LINE_LIMIT, encode  # noqa: E402

PORT, REDIS_URL, SESSION_ID, NODE = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]  # a node without a key
layer = RedisChannelLayer(hosts=[{"address": REDIS_URL, "socket_timeout": None}])


async def agent_stream() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """The session's direct stream from its agent, the token presented and accepted."""
    channel = await layer.new_channel()
    attach = {"type": "pty.attach", "reply_channel": channel, "direct": True, "session_id": SESSION_ID}
    await layer.group_send(pty_group(NODE, SESSION_ID), attach)
    offer = await asyncio.wait_for(layer.receive(channel), 10)
    if not offer.get("host"):
        raise RuntimeError(f"the agent offers no direct stream: {offer}")
    reader, writer = await asyncio.open_connection(offer["host"], int(offer["port"]), limit=LINE_LIMIT)
    writer.write(encode({"token": offer["token"]}))
    answer = json.loads(await reader.readline() or b"null")
    if not isinstance(answer, dict) or answer.get("type") != DIRECT_OK:
        raise RuntimeError(f"the agent refused the direct stream: {answer}")
    return reader, writer


async def hop(ws) -> None:
    reader, writer = await agent_stream()

    async def agent_to_ws() -> None:
        while line := await reader.readline():
            event = json.loads(line)
            if event.get("type") == "terminal.output":
                await ws.send('{"type": "output", "data": ' + json.dumps(event["data"]) + "}")
                if "offset" in event:
                    writer.write(encode({"type": "pty.ack", "offset": event["offset"], "n": event["n"]}))
            elif event.get("type") == "terminal.exit":
                await ws.send(json.dumps({"type": "exit", "code": event["code"]}))
                await ws.close()
                return

    down = asyncio.create_task(agent_to_ws())
    try:
        async for text in ws:
            message = json.loads(text)
            if message.get("type") == "input":
                writer.write(encode({"type": "pty.input", "data": message["data"]}))
            elif message.get("type") == "resize":
                writer.write(encode({"type": "pty.resize", "cols": message["cols"], "rows": message["rows"]}))
    finally:
        down.cancel()
        writer.close()


async def main() -> None:
    async with serve(hop, "127.0.0.1", PORT, compression=None, max_size=2**24):
        await asyncio.get_running_loop().create_future()


if __name__ == "__main__":
    asyncio.run(main())
