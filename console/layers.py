"""The channel layer of standalone mode: Channels' in-memory layer with backpressure.

Channels' `InMemoryChannelLayer` drops a message at once when the receiving channel holds
`capacity` messages (ChannelFull, swallowed by `group_send`): in standalone mode that dropped
half of a flooding terminal's output. Here a send of terminal output (`terminal.output`) to a
full channel waits for room, up to SEND_WAIT_S, so the agent's output pump (which awaits each `group_send`) stops reading the PTY
while a terminal consumer is behind, and nothing is lost; a consumer that takes nothing for
SEND_WAIT_S (stuck, or gone without leaving its groups) loses the message, as before.
"""
from __future__ import annotations

import asyncio

from channels.exceptions import ChannelFull
from channels.layers import InMemoryChannelLayer

SEND_WAIT_S = 10.0
WAITING_TYPES = frozenset({"terminal.output"})  # other notices are best-effort, as in Channels
POLL_S = 0.002  # how often a waiting send looks for room


class FlowControlledInMemoryChannelLayer(InMemoryChannelLayer):
    """InMemoryChannelLayer whose `send` (and so `group_send`) of terminal output waits for room
    in a full channel (see the module docstring). Raises ChannelFull after SEND_WAIT_S seconds
    without room."""

    async def send(self, channel, message):
        if message.get("type") not in WAITING_TYPES:
            return await super().send(channel, message)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SEND_WAIT_S
        while True:
            try:
                return await super().send(channel, message)
            except ChannelFull:
                if loop.time() >= deadline:
                    raise
                await asyncio.sleep(POLL_S)
