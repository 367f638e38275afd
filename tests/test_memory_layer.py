"""common.layers.FlowControlledInMemoryChannelLayer (standalone mode's layer): a group send puts
the message in every member with room before it returns, without a turn of the event loop; it
waits for room only where terminal output meets a full channel."""
from __future__ import annotations

import asyncio
import time

import pytest

from common.layers import FlowControlledInMemoryChannelLayer

OUTPUT = {"type": "terminal.output", "data": "a", "offset": 1, "n": 1}


async def two_members(layer, group: str = "terminal.s1") -> tuple[str, str]:
    first, second = await layer.new_channel(), await layer.new_channel()
    await layer.group_add(group, first)
    await layer.group_add(group, second)
    return first, second


def test_a_group_send_to_members_with_room_is_done_before_it_returns_without_a_turn_of_the_loop():
    async def scenario():
        layer = FlowControlledInMemoryChannelLayer()
        first, second = await two_members(layer)
        send = layer.group_send("terminal.s1", OUTPUT)
        with pytest.raises(StopIteration):  # finished on its first step: it never gave the loop a turn
            send.send(None)
        return [await asyncio.wait_for(layer.receive(channel), 1) for channel in (first, second)]

    assert asyncio.run(scenario()) == [OUTPUT, OUTPUT]


def test_terminal_output_waits_for_room_in_a_full_member_while_the_other_has_it_at_once():
    async def scenario():
        layer = FlowControlledInMemoryChannelLayer(capacity=1)
        full, free = await two_members(layer)
        await layer.send(full, {"type": "terminal.output", "data": "older"})
        send = asyncio.create_task(layer.group_send("terminal.s1", OUTPUT))
        at_once = await asyncio.wait_for(layer.receive(free), 1)
        waiting = not send.done()  # the full member still holds the older message
        older = await asyncio.wait_for(layer.receive(full), 1)
        await asyncio.wait_for(send, 1)
        return waiting, at_once, older, await asyncio.wait_for(layer.receive(full), 1)

    waiting, at_once, older, newer = asyncio.run(scenario())
    assert waiting
    assert at_once == OUTPUT
    assert (older["data"], newer) == ("older", OUTPUT)


def test_a_notice_to_a_full_member_is_dropped_and_the_others_have_it():
    async def scenario():
        layer = FlowControlledInMemoryChannelLayer(capacity=1)
        full, free = await two_members(layer)
        await layer.send(full, {"type": "session.update", "n": 1})
        await asyncio.wait_for(layer.group_send("terminal.s1", {"type": "session.update", "n": 2}), 1)
        got_free = await asyncio.wait_for(layer.receive(free), 1)
        got_full = await asyncio.wait_for(layer.receive(full), 1)
        try:
            extra = await asyncio.wait_for(layer.receive(full), 0.05)
        except TimeoutError:
            extra = None
        return got_free, got_full, extra

    got_free, got_full, extra = asyncio.run(scenario())
    assert got_free["n"] == 2
    assert got_full["n"] == 1
    assert extra is None


def test_sends_look_for_expired_memberships_once_a_second_and_the_members_count_at_once():
    async def scenario():
        layer = FlowControlledInMemoryChannelLayer(group_expiry=60)
        first, second = await two_members(layer)
        await layer.group_send("terminal.s1", OUTPUT)  # looked for expiries: none
        layer.groups["terminal.s1"][first] = time.time() - 120  # as if it joined two minutes ago
        await layer.group_send("terminal.s1", OUTPUT)  # within the second: not looked for again
        kept = [await asyncio.wait_for(layer.receive(first), 1) for _ in range(2)]
        return kept, await layer.group_members("terminal.s1"), sorted(layer.groups["terminal.s1"])

    kept, members, left = asyncio.run(scenario())
    assert kept == [OUTPUT, OUTPUT]
    assert members == 1 and len(left) == 1


def test_groups_members_counts_each_group_in_the_order_asked():
    async def scenario():
        layer = FlowControlledInMemoryChannelLayer()
        await two_members(layer, "terminal.s1")
        await layer.group_add("user.1", await layer.new_channel())
        return await layer.groups_members(["user.2", "terminal.s1", "user.1"])

    assert asyncio.run(scenario()) == [0, 2, 1]
