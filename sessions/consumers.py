"""Websocket consumers: the terminal relay and the live session list. Thin: check, then relay.

Terminal frames (DESIGN.md): client → `{"type": "input", "data"}`, `{"type": "resize", "cols",
"rows"}`; server → `{"type": "output", "data"}`, `{"type": "exit", "code"}`.

Flow control (agent.terminal_pipe, READER_WINDOW_CHARS): the terminal consumer acknowledges the output its
websocket has taken (`pty.ack` with the last frame's `offset` and `n`), every ACK_CHARS characters
or ACK_FRAMES frames, and only once the server holds less than WEBSOCKET_BACKLOG_BYTES for the socket
that the client has not read yet; the agent sends a terminal at most a window past what it
acknowledged, and leaves the PTY unread while its output waits. So a slow client holds back its
own session's program, and the server's memory for it stays bounded.

The attach waits for the session's agent to be in the session's command group (agent_wait_s: a
Redis restarted empty forgets it until the agent's next heartbeat); with no agent by then, the
ticket is given back and the websocket closed with 1013 (CLOSE_TRY_AGAIN: the page connects again).

The direct stream (protocol.terminal_stream): the consumer's attach asks for one; where the agent
offers it (a host, a port and a one-time token, on this consumer's own reply channel), the
consumer connects (DIRECT_CONNECT_S at most) and from then on its output, input, resizes and
acknowledgements travel over that TCP connection, not through the channel layer; it stays in the
terminal group, whose output frames it then ignores (they are for the consumers on the layer).
Where the connection cannot be made or the token is refused, it attaches over the layer as
before. Until the agent answered (ATTACH_WAIT_S at most), what the client types waits, so input
never overtakes itself between the two paths. A direct stream that breaks without the session's
exit closes the websocket with 4502 (CLOSE_AGENT_LOST: the page connects again): no output is lost or reordered
silently.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import sys
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.exceptions import StopConsumer
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from channels.layers import get_channel_layer
from django.conf import settings

from common.api_errors import DATABASE_ERRORS
from common.errors import ApplicationError
from protocol.channel import AgentLink, DirectOffer, Refused
from protocol.terminal_stream import DIRECT_OFFER, encode, json_string, output_literal
from sessions.lifecycle import events
from sessions.lifecycle.services import terminal_ticket_redeem, terminal_ticket_unspend
from sessions.serving.agent_stream import agent_stream_open

log = logging.getLogger(__name__)

# Close codes in the 4000–4999 range are the application's own (RFC 6455 §7.4.2).
CLOSE_BAD_TICKET = 4403
CLOSE_NOT_RUNNING = 4409
CLOSE_UNAUTHENTICATED = 4401
CLOSE_TRY_AGAIN = 1013  # RFC 6455 "Try Again Later": the channel layer (Redis) or the database could not be reached
# The direct stream to the session's agent broke before the session's exit (the agent restarted,
# the network failed): the page connects again. An application code: autobahn (daphne) closes
# with 1000 or 3000-4999 only, and raises for 1013.
CLOSE_AGENT_LOST = 4502
LAYER_RETRY_S = 0.25  # a pooled connection that a Redis restart broke fails once; the retry gets a new one
MAX_INPUT = 64 * 1024
ACK_CHARS = 256 * 1024  # acknowledge output every this many characters (a quarter of the agent's window)
ACK_FRAMES = 16  # … or this many frames (a quarter of its window)
WEBSOCKET_BACKLOG_BYTES = 256 * 1024  # acknowledge only while the server holds less than this for the client
ACK_POLL_S = 0.005  # how often a held acknowledgement looks at the server's buffer again
ATTACH_WAIT_S = 2.0  # input waits this long at most for the agent's answer to the attach (direct or not)
AGENT_POLL_S = 0.25  # how often a terminal looks for its agent in the session's command group (agent_wait_s)
DIRECT_CONNECT_S = 1.0  # connecting to the agent's direct stream and its answer, at most
PENDING_MESSAGES = 1000  # client messages kept at most while the attach is unanswered
# Layer output frames kept at most meanwhile (the oldest go first: the scrollback that answers the
# attach holds them); an attach answered over the layer leaves the agent at most a window ahead.
HELD_FRAMES = 256


def agent_wait_s() -> float:
    """Seconds a terminal waits for its session's agent to be in the session's command group
    before it gives up (CLOSE_TRY_AGAIN, the ticket given back): two heartbeat intervals and 5 s,
    since an agent joins its groups again at each heartbeat (agent.core `_refresh_groups`), which
    is what a Redis restarted empty needs (15 s with the default FGPU_HEARTBEAT_INTERVAL, 5 s)."""
    return 2 * settings.FGPU_HEARTBEAT_INTERVAL + 5.0


def server_transport(send):
    """The transport under a consumer's `send` (Channels' session middleware wraps the server's
    own): daphne's `partial(Server.handle_reply, protocol)` or uvicorn's bound `send` of its
    websocket protocol; None under another server."""
    for _ in range(4):
        if isinstance(send, functools.partial):
            return getattr(send.args[0], "transport", None) if send.args else None
        owner = getattr(send, "__self__", None)
        send = getattr(owner, "real_send", None)
        if send is None:
            return getattr(owner, "transport", None)
    return None


def server_send(send):
    """The server's own `send` under a consumer's (server_transport's walk): Channels' session
    middleware and console.asgi.GoneClientSendsDropped pass a `websocket.send` through unchanged,
    at a few µs each on every frame of output; `send` itself under another stack."""
    for _ in range(4):
        owner = getattr(send, "__self__", None)
        inner = getattr(owner, "real_send", None)
        if inner is None:
            return send
        send = inner
    return send


def websocket_backlog(transport) -> int:
    """Bytes the server holds for this websocket that the client has not taken yet (`transport`:
    server_transport's). uvicorn's asyncio transport says so itself, and its `send` waits while
    it holds more than asyncio's high-water mark (64 KiB); daphne (Twisted) writes what the socket
    does not take into its transport's buffer without limit, and its `send` returns at once. 0
    under another server."""
    buffered = getattr(transport, "get_write_buffer_size", None)  # asyncio's and uvloop's transports
    if buffered is not None:
        return buffered()
    try:
        return len(transport.dataBuffer) - transport.offset + transport._tempDataLen
    except (AttributeError, TypeError):
        return 0


def write_now(transport) -> None:
    """Under daphne, hand what it holds for this websocket to the socket now rather than on the
    event loop's next turn: Twisted's `write` only buffers and asks the reactor to say when the
    socket is writable (two epoll_ctl calls and a loop iteration on a keystroke's echo). Where the
    socket takes less, or fails, the reactor finds the rest (or the error) as before, since the
    write left it watching the socket; a closing connection (whose last write the reactor must see
    to close it), a TLS or a non-Twisted transport (uvicorn's asyncio one writes at once) is left
    alone. Twisted is looked up, not imported: a transport of it exists only where daphne loaded
    it, and the web under uvicorn starts without it (issue 33.6)."""
    tcp = sys.modules.get("twisted.internet.tcp")
    if (
        tcp is not None
        and isinstance(transport, tcp.Connection)
        and transport.connected
        and not transport.disconnecting
        and transport._tempDataLen
    ):
        transport.doWrite()


class TerminalConsumer(AsyncJsonWebsocketConsumer):
    """`/ws/sessions/<id>/terminal/?ticket=…`: spends the one-time ticket, re-checks that its
    user may open this session, then relays frames to and from the agent's PTY."""

    session_id: str = ""
    link: AgentLink | None = None  # the session's node (protocol.channel): its groups; seals and verifies
    delivered: tuple[int, int] = (0, 0)  # (offset, n) of the last output frame sent to the client
    acked: tuple[int, int] = (0, 0)  # … and of the last one acknowledged to the agent
    ack_task: asyncio.Task | None = None  # an acknowledgement waiting for the server's buffer to drain
    pending: list | None = None  # messages to the agent held until it answered the attach; None once it did
    held: list  # layer output frames that came while the attach was unanswered
    attach_timer: asyncio.TimerHandle | None = None
    agent_lock: asyncio.Lock  # messages to the agent go out one at a time, in order
    direct_writer: asyncio.StreamWriter | None = None  # the direct stream, once it is used
    direct_task: asyncio.Task | None = None  # reads it
    layer_task: asyncio.Task | None = None  # relays over the layer after an unanswered attach
    layer_exit: int | None = None  # the session's exit code, when the layer said it before the direct stream
    attach_task: asyncio.Task | None = None  # waits for the agent in its group, then sends the attach
    output_send: Callable[[dict], Awaitable[None]]  # the server's own send (server_send), for output frames

    async def connect(self) -> None:
        self.session_id = str(self.scope["url_route"]["kwargs"]["session_id"])
        ticket = parse_qs(self.scope.get("query_string", b"").decode()).get("ticket", [""])[0]
        try:
            session = await database_sync_to_async(terminal_ticket_redeem)(session_id=self.session_id, ticket=ticket)
        except ApplicationError as exc:
            log.info("terminal for %s refused: %s", self.session_id, exc.detail)
            await self._refuse(CLOSE_NOT_RUNNING if exc.status == 409 else CLOSE_BAD_TICKET)
            return
        except DATABASE_ERRORS as exc:  # as the API's 503: the page connects again
            log.warning("terminal for %s: the database cannot be reached (%s); try again", self.session_id, exc)
            await self._refuse(CLOSE_TRY_AGAIN)
            return
        user = self.scope.get("user")
        if user is not None and user.is_authenticated and user.pk != session.owner_id and not user.is_staff:
            await self._refuse(CLOSE_BAD_TICKET)
            return
        if session.node is None:
            await self._refuse(CLOSE_NOT_RUNNING)
            return
        self.link = events.agent_link(session.node)
        try:
            await self._join(self.link.terminal_group(self.session_id))
        except Exception:
            # The relay cannot work without the layer: give the ticket back (the page asks again
            # with it after a moment) and say "try again later" instead of failing with 1011.
            log.warning("terminal for %s: the channel layer is unreachable", self.session_id, exc_info=True)
            await database_sync_to_async(terminal_ticket_unspend)(session_id=self.session_id, ticket=ticket)
            await self._refuse(CLOSE_TRY_AGAIN)
            return
        await self.accept()
        self.pending, self.held, self.agent_lock = [], [], asyncio.Lock()
        self.attach_task = asyncio.create_task(self._attach(ticket))

    async def _attach(self, ticket: str) -> None:
        """Ask the session's agent for the terminal (`pty.attach`) once the agent is in the
        session's command group, waiting agent_wait_s() at most, then for its answer
        (ATTACH_WAIT_S; see the module docstring). A Redis that restarted empty has forgotten the
        agent's membership until the agent joins again at its next heartbeat: an attach sent then
        reached nobody, and the first terminal opened after a restart stayed silent with its ticket
        spent (issue 33.4). With no agent in the group by then, nothing was attached: the ticket is
        given back and the terminal closed with CLOSE_TRY_AGAIN (the page connects again)."""
        try:
            joined = await self._agent_joined()
            if joined:
                await self._layer_send({"type": "pty.attach", "reply_channel": self.channel_name, "direct": True})
        except Exception:  # the layer failed the attach itself: nothing was attached either
            log.warning("terminal for %s: could not send the attach", self.session_id, exc_info=True)
            joined = False
        if not joined:
            log.warning(
                "terminal for %s: the session's agent is not listening on the channel layer (Redis restarted, or the "
                "agent is gone); the ticket is given back",
                self.session_id,
            )
            await database_sync_to_async(terminal_ticket_unspend)(session_id=self.session_id, ticket=ticket)
            await self.close(code=CLOSE_TRY_AGAIN)
            return
        self.attach_timer = asyncio.get_running_loop().call_later(ATTACH_WAIT_S, self._attach_unanswered)

    async def _agent_joined(self) -> bool:
        """Whether the session's command group has a member (its agent), polled every
        AGENT_POLL_S for agent_wait_s() at most; True at once on a layer that cannot say."""
        members = getattr(self.channel_layer, "group_members", None)
        if members is None or self.link is None:
            return True
        group = self.link.pty_group(self.session_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + agent_wait_s()
        while True:
            try:
                if await members(group):
                    return True
            except Exception:  # Redis coming back: ask again
                log.info("terminal for %s: cannot read the agent's group yet", self.session_id, exc_info=True)
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(AGENT_POLL_S)

    def _attach_unanswered(self) -> None:
        self.attach_timer = None
        if self.pending is not None:  # an agent from before direct streams, or none: relay as before
            self.layer_task = asyncio.create_task(self._use_layer())

    async def terminal_direct(self, event) -> None:
        """The agent's answer to the attach: a direct stream's address and token, or none."""
        if self.attach_timer is not None:
            self.attach_timer.cancel()
            self.attach_timer = None
        if self.pending is None:  # answered too late: the consumer relays over the layer already
            if event.get("host"):  # … and the agent did not count it as a reader
                await self._layer_send({"type": "pty.attach", "reply_channel": self.channel_name})
            return
        if event.get("host"):
            connection = await self._connect_direct(event)
            if connection is not None:
                await self._use_direct(*connection)
                return
            await self._layer_send({"type": "pty.attach", "reply_channel": self.channel_name})
        await self._use_layer()

    async def _connect_direct(self, offer: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The agent's direct stream with the token presented and accepted; None (logged) when it
        cannot be had within DIRECT_CONNECT_S (sessions.serving.agent_stream)."""
        return await agent_stream_open(offer, timeout_s=DIRECT_CONNECT_S, what=f"terminal for {self.session_id}", accepted=True)

    async def _use_direct(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with self.agent_lock:
            pending, self.pending, self.held = self.pending or [], None, []
            self.direct_writer = writer
            for message in pending:
                writer.write(encode(message))
        self.direct_task = asyncio.create_task(self._read_direct(reader))

    async def _use_layer(self) -> None:
        async with self.agent_lock:
            pending, self.pending = self.pending or [], None
            held, self.held = self.held, []
            for message in pending:
                await self._layer_send(message)
        for event in held:
            await self._deliver(event)

    async def _read_direct(self, reader: asyncio.StreamReader) -> None:
        """Relay the direct stream's frames to the client until the session's exit; a stream that
        ends before it closes the websocket with CLOSE_AGENT_LOST (the page connects again)."""
        try:
            while line := await reader.readline():
                event = json.loads(line)
                if event.get("type") == "terminal.output":
                    literal = output_literal(line, event)
                    await self._deliver(event, literal)
                elif event.get("type") == "terminal.exit":
                    await self.terminal_exit(event)
                    return
        except (ConnectionError, ValueError) as exc:
            log.info("terminal for %s: the direct stream broke: %s", self.session_id, exc)
        if self.layer_exit is not None:
            await self.terminal_exit({"code": self.layer_exit})
            return
        log.warning("terminal for %s: the direct stream ended before the session; closing", self.session_id)
        await self.close(code=CLOSE_AGENT_LOST, reason="the connection to the session's agent broke")

    async def _join(self, group: str) -> None:
        try:
            await self.channel_layer.group_add(group, self.channel_name)
        except Exception:
            await asyncio.sleep(LAYER_RETRY_S)
            await self.channel_layer.group_add(group, self.channel_name)

    async def _refuse(self, code: int) -> None:
        # Accept, then close with an application code, so a client can tell "bad ticket"
        # (4403) from "not running" (4409); nothing is relayed before the close.
        await self.accept()
        await self.close(code=code)
        self.session_id = ""

    async def disconnect(self, code) -> None:
        if self.attach_task is not None and self.attach_task is not asyncio.current_task():
            self.attach_task.cancel()
        if self.ack_task is not None:
            self.ack_task.cancel()
        if self.attach_timer is not None:
            self.attach_timer.cancel()
        for task in (self.direct_task, self.layer_task):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        if self.direct_writer is not None:  # the agent detaches the stream's reader when it closes
            self.direct_writer.close()
        if self.session_id and self.link is not None:
            await self.channel_layer.group_discard(self.link.terminal_group(self.session_id), self.channel_name)
            if self.direct_writer is not None:
                return
            try:  # the agent stops waiting for this terminal (else it would, READER_STALL_S, once it is behind)
                await self._layer_send({"type": "pty.detach", "channel": self.channel_name})
            except Exception:
                log.info("terminal for %s: could not tell the agent it closed", self.session_id, exc_info=True)

    async def __call__(self, scope, receive, send) -> None:
        """Channels' consumer loop (AsyncConsumer.__call__), except that each source (the
        websocket, the channel layer) is read by a task of its own that dispatches what it
        received itself, one message at a time across both (a lock), instead of through
        `await_many_dispatch`'s `asyncio.wait`: a keystroke reaches the agent two event-loop turns
        sooner. Ends, like Channels', when a dispatch raises StopConsumer (the websocket closed)."""
        self.scope = scope
        self.channel_layer = get_channel_layer(self.channel_layer_alias)
        self.channel_name = await self.channel_layer.new_channel()
        self.channel_receive = functools.partial(self.channel_layer.receive, self.channel_name)
        self.transport = server_transport(send)
        self.output_send = server_send(send)
        self.base_send = send
        lock = asyncio.Lock()

        async def read(source) -> None:
            while True:
                try:
                    message = await source()
                except Exception:
                    async with lock:  # as in Channels: after the dispatch in progress
                        raise
                async with lock:
                    await self.dispatch(message)

        readers = [asyncio.create_task(read(receive)), asyncio.create_task(read(self.channel_receive))]
        try:
            done, _ = await asyncio.wait(readers, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
        except StopConsumer:
            pass
        finally:
            for task in readers:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)

    async def dispatch(self, message) -> None:
        """Channels' dispatch, without its per-message `aclose_old_connections` (a round trip
        through a worker thread, the largest cost of a keystroke's echo in benchmarks/terminal.py)
        for the relay's own messages, which touch no database."""
        if message["type"] == "terminal.output":
            await self.terminal_output(message)
        elif message["type"] == DIRECT_OFFER:
            if self.link is None:
                return
            try:  # it names where this terminal connects: only its node's agent may say
                offer = DirectOffer.from_dict(self.link.answer(message)).to_dict()
            except Refused as exc:
                log.warning("terminal for %s: ignored a direct-stream offer not from its node: %s", self.session_id, exc)
                return
            await self.terminal_direct(offer)
        elif message["type"] == "websocket.receive":
            text = message.get("text")
            if text:  # as AsyncJsonWebsocketConsumer.receive, without its two awaited layers
                await self.receive_json(json.loads(text))
            else:
                await self.websocket_receive(message)
        else:
            await super().dispatch(message)

    async def receive_json(self, content, **kwargs) -> None:
        kind = content.get("type") if isinstance(content, dict) else None
        if kind == "input" and isinstance(content.get("data"), str):
            await self._to_agent({"type": "pty.input", "data": content["data"][:MAX_INPUT]})
        elif kind == "resize":
            try:
                cols, rows = int(content["cols"]), int(content["rows"])
            except (KeyError, TypeError, ValueError):
                return
            await self._to_agent({"type": "pty.resize", "cols": cols, "rows": rows})

    async def _to_agent(self, message: dict) -> None:
        """To the agent: over the direct stream where there is one, else through the layer; held
        while the attach is unanswered (at most PENDING_MESSAGES; more are dropped, logged)."""
        if not self.session_id:  # refused: nothing is relayed
            return
        async with self.agent_lock:
            if self.pending is not None:
                if len(self.pending) < PENDING_MESSAGES:
                    self.pending.append(message)
                else:
                    log.warning("terminal for %s: dropped a %s while the agent did not answer", self.session_id, message["type"])
            elif self.direct_writer is not None:
                self.direct_writer.write(encode(message))
                try:
                    await self.direct_writer.drain()
                except ConnectionError:
                    pass  # the stream's reader closes the terminal
            else:
                await self._layer_send(message)

    async def _layer_send(self, message: dict) -> None:
        """`message` to the session's agent through the layer, sealed with its node's key."""
        if self.link is None:
            return
        message["session_id"] = self.session_id
        await self.channel_layer.group_send(self.link.pty_group(self.session_id), self.link.command(message))

    async def terminal_output(self, event) -> None:
        """Output through the layer: for this consumer unless it reads a direct stream; held
        while the attach is unanswered (the scrollback of an agent from before direct streams
        ends that wait)."""
        if self.direct_writer is not None:
            return
        if self.pending is not None:
            if "offset" in event:
                self.held.append(event)
                if len(self.held) > HELD_FRAMES:
                    del self.held[0]
                return
            await self._use_layer()
        await self._deliver(event)

    async def _deliver(self, event, literal: str | None = None) -> None:
        """Output `event` (`{"data", "offset", "n"}`; no offset: the scrollback) to the client,
        its data as `literal` where the direct stream's line holds it JSON-encoded already
        (protocol.terminal_stream.output_literal), and acknowledged when due."""
        if literal is None:
            literal = json_string(event["data"])
        try:  # the server's own send (server_send), dropping a send to a gone client as GoneClientSendsDropped does
            await self.output_send({"type": "websocket.send", "text": '{"type": "output", "data": ' + literal + "}"})
        except OSError:
            pass
        write_now(self.transport)
        offset = event.get("offset")
        if offset is None:  # the scrollback (or an agent from before flow control)
            return
        self.delivered = (offset, event.get("n", 0))
        due = offset - self.acked[0] >= ACK_CHARS or self.delivered[1] - self.acked[1] >= ACK_FRAMES
        if due and self.ack_task is None:
            if websocket_backlog(self.transport) < WEBSOCKET_BACKLOG_BYTES:
                await self._ack()
            else:
                self.ack_task = asyncio.create_task(self._ack_when_drained())

    async def _ack_when_drained(self) -> None:
        while websocket_backlog(self.transport) >= WEBSOCKET_BACKLOG_BYTES:
            await asyncio.sleep(ACK_POLL_S)
        self.ack_task = None
        await self._ack()

    async def _ack(self) -> None:
        self.acked = self.delivered
        try:
            await self._to_agent({"type": "pty.ack", "channel": self.channel_name, "offset": self.acked[0], "n": self.acked[1]})
        except Exception:  # the agent stops waiting for a terminal that acknowledges nothing (READER_STALL_S)
            log.warning("terminal for %s: could not acknowledge output", self.session_id, exc_info=True)

    async def terminal_exit(self, event) -> None:
        if self.direct_writer is not None and self.direct_task is not asyncio.current_task():
            self.layer_exit = event["code"]  # the direct stream's last frames may still be on their way
            return
        await self.send_json({"type": "exit", "code": event["code"]})
        await self.close()

    async def session_update(self, event) -> None:  # not joined here; ignore if ever routed
        pass


class SessionEventsConsumer(AsyncJsonWebsocketConsumer):
    """`/ws/sessions/`: pushes `{"type": "session", "session": {…}}` whenever one of the user's
    sessions changes (staff see every session). Cookie-authenticated."""

    groups_joined: tuple[str, ...] = ()

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        self.groups_joined = (events.STAFF_GROUP,) if user.is_staff else (events.user_group(user.pk),)
        for group in self.groups_joined:
            await self.channel_layer.group_add(group, self.channel_name)
        await self.accept()

    async def disconnect(self, code) -> None:
        for group in self.groups_joined:
            await self.channel_layer.group_discard(group, self.channel_name)

    async def receive_json(self, content, **kwargs) -> None:
        pass  # server → client only

    async def session_update(self, event) -> None:
        await self.send_json({"type": "session", "session": event["session"]})


class AppOpenConsumer(AsyncJsonWebsocketConsumer):
    """`/ws/sessions/<id>/open/<app>/`: starts a session app (sessions.serving.session_apps) for the page
    that opens it, and says how it goes: `{"type": "progress", "text"}` while it starts, then
    `{"type": "ready", "url", "reused"}` or `{"type": "error", "title", "detail"}`, then closes.
    Cookie-authenticated; another user's session or an app its image lacks closes with 4404."""

    async def connect(self) -> None:
        from sessions.serving.session_apps import session_app_open

        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        kwargs = self.scope["url_route"]["kwargs"]
        try:
            session, app, node = await database_sync_to_async(_app_lookup)(user, kwargs["session_id"], kwargs["app"])
        except ApplicationError:
            await self.close(code=CLOSE_NOT_FOUND)
            return
        await self.accept()
        try:
            opened = await session_app_open(session=session, app=app, node=node, on_progress=self._progress)
        except ApplicationError as exc:
            await self.send_json({"type": "error", "title": exc.title, "detail": exc.detail, "error": exc.type})
        except Exception:
            log.exception("opening app %s of session %s failed", kwargs["app"], kwargs["session_id"])
            await self.send_json(
                {
                    "type": "error",
                    "title": "Server error",
                    "error": "server-error",
                    "detail": "the console could not reach the session's agent; try again",
                }
            )
        else:
            await self.send_json({"type": "ready", **opened})
        await self.close()

    async def _progress(self, text: str) -> None:
        await self.send_json({"type": "progress", "text": text})

    async def receive_json(self, content, **kwargs) -> None:
        pass  # server → client only


CLOSE_NOT_FOUND = 4404


def _app_lookup(user, session_id, name: str):
    """Blocking (database): (session, app, node name) for AppOpenConsumer. Raises ApplicationError
    404 for a session `user` may not see or an app its image does not declare."""
    from django.http import Http404

    from sessions.selectors import session_get_for
    from sessions.serving.session_apps import session_app_get

    try:
        session = session_get_for(user=user, session_id=session_id)
    except Http404:
        raise ApplicationError("no such session", type="not-found", status=404) from None
    app = session_app_get(session=session, name=name)
    return session, app, session.node.name if session.node else ""
