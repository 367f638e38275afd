"""The channel layers: standalone mode's in-memory layer with backpressure, and the Redis layer of
the distributed processes (web, agents), channels_redis with fewer round trips.

Channels' `InMemoryChannelLayer` drops a message at once when the receiving channel holds
`capacity` messages (ChannelFull, swallowed by `group_send`): in standalone mode that dropped
half of a flooding terminal's output. Here a send of terminal output (`terminal.output`) to a
full channel waits for room, up to SEND_WAIT_S, so the agent's output pump (which awaits each `group_send`) stops reading the PTY
while a terminal consumer is behind, and nothing is lost; a consumer that takes nothing for
SEND_WAIT_S (stuck, or gone without leaving its groups) loses the message, as before.

`RedisChannelLayer` is channels_redis's, with its keys, message format and limits (so it and
channels_redis serve one another), and fewer round trips to Redis, which are most of the terminal's
echo time in distributed mode (benchmarks/terminal.py): a `send` is one Lua call instead of four
commands, a `group_send` one Lua call (which reads the group and adds `__asgi_channel__` to the
msgpack map itself) instead of four, and a process's
messages are taken by one receiving task per event loop, a batch at a time (ZPOPMIN, then
BZPOPMIN when none waits), instead of four commands and two new tasks for every message; it keeps
no backup copy of a message it took (channels_redis's `$inflight` queue, for a receive cancelled
while Redis answered: that loses at most the message in flight when an event loop shuts down).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import random
import time

import msgpack

from channels.exceptions import ChannelFull
from channels.layers import InMemoryChannelLayer
from channels_redis.core import BoundedQueue
from channels_redis.core import RedisChannelLayer as ChannelsRedisLayer

log = logging.getLogger(__name__)

SEND_WAIT_S = 10.0
WAITING_TYPES = frozenset({"terminal.output"})  # other notices are best-effort, as in Channels
POLL_S = 0.002  # how often a waiting send looks for room
# How often the in-memory layer looks for expired messages and group memberships (Channels looks at
# every send and receive, each channel and group of the process each time: a tenth of a keystroke's
# echo in standalone mode, benchmarks/terminal.py). Its expiries are a minute and a day, so a second
# later changes nothing; `group_members` still looks every time.
CLEAN_EVERY_S = 1.0


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

    _cleaned = float("-inf")  # monotonic time of the last look for expired messages and memberships

    def _clean_expired(self):
        now = time.monotonic()
        if now - self._cleaned >= CLEAN_EVERY_S:
            self._cleaned = now
            super()._clean_expired()

    async def group_members(self, group) -> int:
        """How many channels `group` holds now (those not expired)."""
        super()._clean_expired()
        return len(self.groups.get(group, ()))

    async def groups_members(self, groups: list[str]) -> list[int]:
        """`group_members` of each of `groups`, in their order."""
        super()._clean_expired()
        return [len(self.groups.get(group, ())) for group in groups]

    async def group_send(self, group, message):
        """Channels' group_send, without a task for each member: a send to a channel with room
        (InMemoryChannelLayer's `send` never waits) is done at once, so a keystroke's input and
        its echo reach the other side two event-loop turns sooner; only the sends that wait for
        room (terminal output to a full channel) run as tasks, and the call returns once they
        are done, as Channels' does (a full channel's other messages are dropped, as there)."""
        assert isinstance(message, dict), "Message is not a dict"
        self.require_valid_group_name(group)
        self._clean_expired()
        waiting = []
        for channel in list(self.groups.get(group, ())):
            try:
                await super().send(channel, message)
            except ChannelFull:
                if message.get("type") in WAITING_TYPES:
                    waiting.append(asyncio.create_task(self.send(channel, message)))
        if not waiting:  # as_completed([]) alone costs more than the sends (a keystroke's echo does two)
            return
        for sent in asyncio.as_completed(waiting):
            try:
                await sent
            except ChannelFull:
                pass


# No KEYS. ARGV: n, n channel keys, their messages, their capacities, now (s), expiry (s). Drops
# each key's expired messages, adds the message where the key holds fewer than its capacity;
# answers how many keys were full (channels_redis's group_send script, with its expiry step folded
# in). The keys are arguments, not KEYS, and only commands that need no read permission touch them
# (ZREMRANGEBYSCORE, ZCARD, ZADD, EXPIRE): an agent's broker user may write to the web's channels
# but not read them (common.broker_acl), and Redis asks read and write permission for every key a
# script declares in KEYS.
_PUSH = """
local n, now, expiry = tonumber(ARGV[1]), tonumber(ARGV[#ARGV - 1]), tonumber(ARGV[#ARGV])
local full = 0
for i = 2, n + 1 do
  local key = ARGV[i]
  redis.call('ZREMRANGEBYSCORE', key, 0, math.floor(now) - expiry)
  if redis.call('ZCARD', key) < tonumber(ARGV[2 * n + i]) then
    redis.call('ZADD', key, now, ARGV[n + i])
    redis.call('EXPIRE', key, expiry)
  else
    full = full + 1
  end
end
return full
"""
# A group send in one call. KEYS[1]: the group. ARGV: key prefix, group cutoff (members added before
# it have expired), capacity, now, expiry, the message as channels_redis serializes it split in
# three (random prefix; its msgpack map header, one entry more; the map's entries) and the msgpack
# of "__asgi_channel__". Each member channel's key gets the message with `__asgi_channel__` the
# list of the members that share the key (as channels_redis's _map_channel_keys_to_connection).
# The members' keys are written with commands that need no read permission (see _PUSH).
_GROUP_PUSH = """
local prefix, cap, now, expiry = ARGV[1], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[1], 0, ARGV[2])
local members, by_key, keys = redis.call('ZRANGE', KEYS[1], 0, -1), {}, {}
for _, channel in ipairs(members) do
  local bang = string.find(channel, '!', 1, true)
  local key = prefix .. (bang and string.sub(channel, 1, bang) or channel)
  if not by_key[key] then by_key[key] = {}; keys[#keys + 1] = key end
  table.insert(by_key[key], channel)
end
local full = 0
for _, key in ipairs(keys) do
  redis.call('ZREMRANGEBYSCORE', key, 0, math.floor(now) - expiry)
  if redis.call('ZCARD', key) < cap then
    redis.call('ZADD', key, now, ARGV[6] .. ARGV[7] .. ARGV[8] .. ARGV[9] .. cmsgpack.pack(by_key[key]))
    redis.call('EXPIRE', key, expiry)
  else
    full = full + 1
  end
end
return full
"""
_ASGI_CHANNEL = msgpack.packb("__asgi_channel__")
RECEIVE_BATCH = 100  # the most messages one ZPOPMIN takes
# The most channels of one process with messages waiting and nobody receiving yet (a reply that
# came before its `receive`): past it, a message for a channel without an inbox is dropped. Agents
# may write to the web's channels (common.broker_acl); this keeps one that writes to made-up
# channel names from growing a web process's memory without bound.
MAX_INBOXES = 10_000


class RedisChannelLayer(ChannelsRedisLayer):
    """channels_redis's RedisChannelLayer with fewer round trips (see the module docstring). Same
    configuration; raises ChannelFull from `send` to a full channel, drops group messages to full
    channels, as channels_redis does."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._push = self._group_push = None
        self._receivers: dict = {}  # (event loop, channels' non-local name) → its receiving task
        self._inboxes: collections.defaultdict = collections.defaultdict(functools.partial(BoundedQueue, self.capacity))
        self._dropped = 0  # messages dropped for want of an inbox (MAX_INBOXES)

    def _push_script(self, connection):
        if self._push is None:
            self._push = connection.register_script(_PUSH)
        return self._push

    async def _push_to(self, index: int, keys: list, messages: list, capacities: list) -> int:
        connection = self.connection(index)
        return await self._push_script(connection)(
            keys=[], args=[len(keys), *keys, *messages, *capacities, time.time(), self.expiry], client=connection
        )

    async def send(self, channel, message):
        assert isinstance(message, dict), "message is not a dict"
        assert self.require_valid_channel_name(channel), "Channel name not valid"
        assert "__asgi_channel__" not in message
        if "!" in channel:
            message = {**message, "__asgi_channel__": channel}
            non_local = self.non_local_name(channel)
            index = self.consistent_hash(channel)
        else:
            non_local = channel
            index = next(self._send_index_generator)
        full = await self._push_to(index, [self.prefix + non_local], [self.serialize(message)], [self.get_capacity(channel)])
        if full:
            raise ChannelFull()

    async def group_members(self, group) -> int:
        """How many channels `group` holds now (those added within the group expiry): one ZCOUNT.
        0 after Redis restarted empty, until the members join again (an agent: at its heartbeat)."""
        assert self.require_valid_group_name(group), "Group name not valid"
        connection = self.connection(self.consistent_hash(group))
        return await connection.zcount(self._group_key(group), int(time.time()) - self.group_expiry, "+inf")

    async def groups_members(self, groups: list[str]) -> list[int]:
        """`group_members` of each of `groups`, in their order: their ZCOUNTs pipelined, one round
        trip per Redis server of the ring (a scheduler pass's notices ask about up to a thousand
        groups: 2.6 s of a 10,000-node pass one ZCOUNT at a time, issue 35.2)."""
        since = int(time.time()) - self.group_expiry
        by_server: dict[int, list[int]] = {}
        for position, group in enumerate(groups):
            assert self.require_valid_group_name(group), "Group name not valid"
            by_server.setdefault(self.consistent_hash(group), []).append(position)
        counts = [0] * len(groups)
        for index, positions in by_server.items():
            async with self.connection(index).pipeline(transaction=False) as pipe:
                for position in positions:
                    pipe.zcount(self._group_key(groups[position]), since, "+inf")
                answers = await pipe.execute()
            for position, count in zip(positions, answers):
                counts[position] = int(count)
        return counts

    async def group_send(self, group, message):
        assert self.require_valid_group_name(group), "Group name not valid"
        key = self._group_key(group)
        connection = self.connection(self.consistent_hash(group))
        serializer = self._serializer
        if (
            self.ring_size == 1
            and not self.channel_capacity
            and serializer.crypter is None
            and serializer.as_bytes is msgpack.packb
        ):
            packed = msgpack.packb(message)
            if 0x80 <= packed[0] < 0x8F:  # a map of fewer than 15 entries: one entry fits in
                if self._group_push is None:
                    self._group_push = connection.register_script(_GROUP_PUSH)
                size = serializer.random_prefix_length
                await self._group_push(
                    keys=[key],
                    args=[
                        self.prefix,
                        int(time.time()) - self.group_expiry,
                        self.capacity,
                        time.time(),
                        self.expiry,
                        random.getrandbits(8 * size).to_bytes(size, "big") if size else b"",
                        bytes([packed[0] + 1]),
                        packed[1:],
                        _ASGI_CHANNEL,
                    ],
                    client=connection,
                )
                return
        async with connection.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(key, min=0, max=int(time.time()) - self.group_expiry)
            pipe.zrange(key, 0, -1)
            _, members = await pipe.execute()
        by_connection, messages, capacities = self._map_channel_keys_to_connection(
            [member.decode() for member in members], message
        )
        for index, keys in by_connection.items():
            await self._push_to(index, keys, [messages[k] for k in keys], [capacities[k] for k in keys])

    async def receive(self, channel):
        if "!" not in channel:
            return await super().receive(channel)
        assert self.require_valid_channel_name(channel)
        real = self.non_local_name(channel)
        assert real.endswith(self.client_prefix + "!"), "Wrong client prefix"
        loop = asyncio.get_running_loop()
        receiver = self._receivers.get((loop, real))
        if receiver is None or receiver.done():
            self._receivers[(loop, real)] = loop.create_task(self._receive_loop(real), name=f"channel-layer-{real}")
            for gone in [key for key in self._receivers if key[0].is_closed()]:
                del self._receivers[gone]
        inbox = self._inboxes[channel]
        try:
            return await inbox.get()
        finally:
            if inbox.empty() and self._inboxes.get(channel) is inbox:
                del self._inboxes[channel]

    async def _receive_loop(self, real: str) -> None:
        """Take the messages of this process's channels named `real…` (`specific.<client prefix>!`
        and the like) off their key and put each in its channel's inbox, while the event loop
        runs: what waits, a batch at a time; else wait (BZPOPMIN) for the next one."""
        key, index = self.prefix + real, self.consistent_hash(real)
        failing = False
        while True:
            connection = self.connection(index)
            try:
                taken = await connection.zpopmin(key, RECEIVE_BATCH)
                if not taken:
                    popped = await connection.bzpopmin(key, timeout=self.brpop_timeout)
                    taken = [popped[1:]] if popped else []
            except asyncio.CancelledError:
                raise
            except Exception:  # Redis restarting: receives wait for it
                if not failing:
                    log.warning("channel layer: cannot take messages from Redis; retrying", exc_info=True)
                failing = True
                await asyncio.sleep(0.25)
                continue
            failing = False
            for member, _score in taken:
                channels, message = self._unpack(member)
                for name in channels:
                    if name not in self._inboxes and len(self._inboxes) >= MAX_INBOXES:
                        self._dropped += 1  # for a channel nobody receives on: a writer's guesses (below)
                        if self._dropped in (1, 1000) or self._dropped % 100_000 == 0:
                            log.warning("channel layer: dropped %d message(s) for channels nobody waits on", self._dropped)
                        continue
                    self._inboxes[name].put_nowait(message if len(channels) == 1 else dict(message))

    def _unpack(self, member: bytes) -> tuple[list, dict]:
        """The channels a taken message is for (its `__asgi_channel__`: one, or a group's list)
        and the message without that key."""
        message = self.deserialize(member)
        channels = message.pop("__asgi_channel__")
        return (channels if isinstance(channels, list) else [channels]), message
