"""common.layers.RedisChannelLayer against a real Redis: channels_redis's semantics with fewer
round trips, and messages that channels_redis's own layer reads (web and agents of two versions
share one Redis)."""
from __future__ import annotations

import asyncio
import uuid

import pytest
from channels.exceptions import ChannelFull
from channels_redis.core import RedisChannelLayer as ChannelsRedisLayer
from django.conf import settings

from common.layers import RedisChannelLayer

pytestmark = pytest.mark.skipif(not settings.REDIS_URL, reason="needs REDIS_URL")

MESSAGE = {"type": "terminal.output", "data": "é\r\n" * 1000 + "\x1b[0m", "offset": 3005, "n": 7,
           "nested": {"list": [1, 2.5, None, True], "bytes": b"\x00\xff"}}


def layers(*classes, capacity: int = 100):
    return [cls(hosts=[{"address": settings.REDIS_URL, "socket_timeout": None}], capacity=capacity, expiry=60)
            for cls in classes]


async def receive(layer, channel: str) -> dict:
    async with asyncio.timeout(5):
        return await layer.receive(channel)


def run(scenario):
    return asyncio.run(scenario())  # what a test leaves in Redis expires after the layers' 60 s


def test_a_group_send_reaches_every_member_of_every_process_with_the_message_intact():
    async def scenario():
        ours, other, theirs = layers(RedisChannelLayer, RedisChannelLayer, ChannelsRedisLayer)
        mine_a, mine_b = await ours.new_channel(), await ours.new_channel()  # one process key, two channels
        elsewhere, old = await other.new_channel(), await theirs.new_channel()
        for channel, layer in ((mine_a, ours), (mine_b, ours), (elsewhere, other), (old, theirs)):
            await layer.group_add("terminal-x", channel)
        await ours.group_send("terminal-x", MESSAGE)
        return [await receive(layer, channel) for channel, layer in
                ((mine_a, ours), (mine_b, ours), (elsewhere, other), (old, theirs))]

    assert run(scenario) == [MESSAGE] * 4


def test_channels_redis_and_ours_read_each_others_sends_and_group_sends():
    async def scenario():
        ours, theirs = layers(RedisChannelLayer, ChannelsRedisLayer)
        to_ours, to_theirs = await ours.new_channel("agent.n."), await theirs.new_channel()
        await ours.group_add("pty-x", to_ours)
        await theirs.send(to_ours, {"type": "a"})
        await theirs.group_send("pty-x", {"type": "b"})
        await ours.send(to_theirs, {"type": "c"})
        return [(await receive(ours, to_ours))["type"], (await receive(ours, to_ours))["type"],
                (await receive(theirs, to_theirs))["type"]]

    assert run(scenario) == ["a", "b", "c"]


def test_messages_from_one_sender_arrive_in_order():
    async def scenario():
        sender, receiver = layers(RedisChannelLayer, RedisChannelLayer, capacity=1000)
        channel = await receiver.new_channel()
        await sender.group_add("terminal-y", channel)
        for i in range(500):
            if i % 2:
                await sender.send(channel, {"type": "m", "i": i})
            else:
                await sender.group_send("terminal-y", {"type": "m", "i": i})
        return [(await receive(receiver, channel))["i"] for _ in range(500)]

    assert run(scenario) == list(range(500))


def test_a_send_to_a_full_channel_raises_channel_full_and_a_group_send_skips_it():
    async def scenario():
        ours, reader = layers(RedisChannelLayer, RedisChannelLayer, capacity=3)
        full, free = await reader.new_channel(), await reader.new_channel("other.")
        for _ in range(3):
            await ours.send(full, {"type": "fill"})
        with pytest.raises(ChannelFull):
            await ours.send(full, {"type": "one too many"})
        await ours.group_add("g", full)
        await ours.group_add("g", free)
        await ours.group_send("g", {"type": "to both"})
        got = [(await receive(reader, full))["type"] for _ in range(3)]
        return got, (await receive(reader, free))["type"]

    got, free = run(scenario)
    assert got == ["fill"] * 3 and free == "to both"


def test_messages_for_made_up_channels_of_a_process_stop_growing_its_memory_at_max_inboxes(monkeypatch):
    """A writer that may write a web process's key (an agent: common.broker_acl) and names channels
    nobody receives on fills at most MAX_INBOXES inboxes; the process's own channels still get theirs."""
    import common.layers

    monkeypatch.setattr(common.layers, "MAX_INBOXES", 3)

    async def scenario():
        (ours,) = layers(RedisChannelLayer)
        mine = await ours.new_channel()
        prefix = mine.split("!")[0]
        for i in range(50):
            await ours.send(f"{prefix}!made-up-{i}", {"type": "junk"})
        await ours.send(mine, {"type": "mine"})
        got = await receive(ours, mine)
        return got, len(ours._inboxes), ours._dropped

    got, inboxes, dropped = run(scenario)
    assert got == {"type": "mine"} and inboxes <= 3 and dropped >= 47


def test_groups_members_counts_each_group_as_group_members_does_in_order_across_a_ring_of_two():
    """One pipelined call for many groups (a scheduler pass's notices, sessions.lifecycle.events):
    the same counts, in the order asked, where the groups hash to either server of a ring."""
    async def scenario():
        address = {"address": settings.REDIS_URL, "socket_timeout": None}
        # a prefix of this run's own: memberships live for the layer's group expiry (a day)
        ring = RedisChannelLayer(hosts=[address, dict(address)], prefix=f"members-{uuid.uuid4().hex}", expiry=60)
        groups = [f"user.members-{i}" for i in range(12)]
        for i, group in enumerate(groups):
            for _ in range(i % 3):  # 0, 1 or 2 members
                await ring.group_add(group, await ring.new_channel())
        assert {ring.consistent_hash(g) for g in groups} == {0, 1}  # both servers of the ring asked
        counted = await ring.groups_members(list(reversed(groups)))
        one_by_one = [await ring.group_members(g) for g in reversed(groups)]
        return counted, one_by_one

    counted, one_by_one = run(scenario)
    assert counted == one_by_one == [i % 3 for i in reversed(range(12))]
