"""Websocket consumers: the terminal relay and the live session list. Thin: check, then relay.

Terminal frames (DESIGN.md): client → `{"type": "input", "data"}`, `{"type": "resize", "cols",
"rows"}`; server → `{"type": "output", "data"}`, `{"type": "exit", "code"}`.

Flow control (agent.core, READER_WINDOW_CHARS): the terminal consumer acknowledges the output its
websocket has taken (`pty.ack` with the last frame's `offset` and `n`), every ACK_CHARS characters
or ACK_FRAMES frames, and only once daphne holds less than WEBSOCKET_BACKLOG_BYTES for the socket
that the client has not read yet; the agent sends a terminal at most a window past what it
acknowledged, and leaves the PTY unread while its output waits. So a slow client holds back its
own session's program, and daphne's memory for it stays bounded.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from console.errors import ApplicationError
from sessions import events
from sessions.services import terminal_ticket_redeem, terminal_ticket_unspend

log = logging.getLogger(__name__)

# Close codes in the 4000–4999 range are the application's own (RFC 6455 §7.4.2).
CLOSE_BAD_TICKET = 4403
CLOSE_NOT_RUNNING = 4409
CLOSE_UNAUTHENTICATED = 4401
CLOSE_TRY_AGAIN = 1013  # RFC 6455 "Try Again Later": the channel layer (Redis) could not be reached
LAYER_RETRY_S = 0.25  # a pooled connection that a Redis restart broke fails once; the retry gets a new one
MAX_INPUT = 64 * 1024
ACK_CHARS = 256 * 1024  # acknowledge output every this many characters (a quarter of the agent's window)
ACK_FRAMES = 16  # … or this many frames (a quarter of its window)
WEBSOCKET_BACKLOG_BYTES = 256 * 1024  # acknowledge only while daphne holds less than this for the client
ACK_POLL_S = 0.005  # how often a held acknowledgement looks at daphne's buffer again


def websocket_backlog(send) -> int:
    """Bytes the ASGI server holds for this websocket that the client has not taken yet: daphne
    (Twisted) writes what the socket does not take into its transport's buffer without limit, and
    its ASGI `send` returns at once. `send` is the consumer's `base_send` (Channels' session
    middleware wraps daphne's `partial(Server.handle_reply, protocol)`). 0 under another server."""
    for _ in range(4):
        if isinstance(send, functools.partial):
            transport = getattr(send.args[0], "transport", None) if send.args else None
            if transport is None:
                return 0
            try:
                return len(transport.dataBuffer) - transport.offset + transport._tempDataLen
            except (AttributeError, TypeError):
                return 0
        send = getattr(getattr(send, "__self__", None), "real_send", None)
    return 0


class TerminalConsumer(AsyncJsonWebsocketConsumer):
    """`/ws/sessions/<id>/terminal/?ticket=…`: spends the one-time ticket, re-checks that its
    user may open this session, then relays frames to and from the agent's PTY."""

    session_id: str = ""
    delivered: tuple[int, int] = (0, 0)  # (offset, n) of the last output frame sent to the client
    acked: tuple[int, int] = (0, 0)  # … and of the last one acknowledged to the agent
    ack_task: asyncio.Task | None = None  # an acknowledgement waiting for daphne's buffer to drain

    async def connect(self) -> None:
        self.session_id = str(self.scope["url_route"]["kwargs"]["session_id"])
        ticket = parse_qs(self.scope.get("query_string", b"").decode()).get("ticket", [""])[0]
        try:
            session = await database_sync_to_async(terminal_ticket_redeem)(session_id=self.session_id, ticket=ticket)
        except ApplicationError as exc:
            log.info("terminal for %s refused: %s", self.session_id, exc.detail)
            await self._refuse(CLOSE_NOT_RUNNING if exc.status == 409 else CLOSE_BAD_TICKET)
            return
        user = self.scope.get("user")
        if user is not None and user.is_authenticated and user.pk != session.owner_id and not user.is_staff:
            await self._refuse(CLOSE_BAD_TICKET)
            return
        try:
            await self._join(events.terminal_group(self.session_id))
        except Exception:
            # The relay cannot work without the layer: give the ticket back (the page asks again
            # with it after a moment) and say "try again later" instead of failing with 1011.
            log.warning("terminal for %s: the channel layer is unreachable", self.session_id, exc_info=True)
            await database_sync_to_async(terminal_ticket_unspend)(session_id=self.session_id, ticket=ticket)
            await self._refuse(CLOSE_TRY_AGAIN)
            return
        await self.accept()
        await self._to_agent({"type": "pty.attach", "reply_channel": self.channel_name})

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
        if self.ack_task is not None:
            self.ack_task.cancel()
        if self.session_id:
            await self.channel_layer.group_discard(events.terminal_group(self.session_id), self.channel_name)
            try:  # the agent stops waiting for this terminal (else it would, READER_STALL_S, once it is behind)
                await self._to_agent({"type": "pty.detach", "channel": self.channel_name})
            except Exception:
                log.info("terminal for %s: could not tell the agent it closed", self.session_id, exc_info=True)

    async def dispatch(self, message) -> None:
        """Channels' dispatch, without its per-message `aclose_old_connections` (a round trip
        through a worker thread, the largest cost of a keystroke's echo in benchmarks/terminal.py)
        for the relay's own messages, which touch no database."""
        if message["type"] == "terminal.output":
            await self.terminal_output(message)
        elif message["type"] == "websocket.receive":
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
        message["session_id"] = self.session_id
        await self.channel_layer.group_send(events.pty_group(self.session_id), message)

    async def terminal_output(self, event) -> None:
        await self.send(text_data='{"type": "output", "data": ' + json.dumps(event["data"]) + "}")
        offset = event.get("offset")
        if offset is None:  # the scrollback (or an agent from before flow control)
            return
        self.delivered = (offset, event.get("n", 0))
        due = offset - self.acked[0] >= ACK_CHARS or self.delivered[1] - self.acked[1] >= ACK_FRAMES
        if due and self.ack_task is None:
            if websocket_backlog(self.base_send) < WEBSOCKET_BACKLOG_BYTES:
                await self._ack()
            else:
                self.ack_task = asyncio.create_task(self._ack_when_drained())

    async def _ack_when_drained(self) -> None:
        while websocket_backlog(self.base_send) >= WEBSOCKET_BACKLOG_BYTES:
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
    """`/ws/sessions/<id>/open/<app>/`: starts a session app (sessions.session_apps) for the page
    that opens it, and says how it goes: `{"type": "progress", "text"}` while it starts, then
    `{"type": "ready", "url", "reused"}` or `{"type": "error", "title", "detail"}`, then closes.
    Cookie-authenticated; another user's session or an app its image lacks closes with 4404."""

    async def connect(self) -> None:
        from sessions.session_apps import session_app_open

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
    from sessions.session_apps import session_app_get

    try:
        session = session_get_for(user=user, session_id=session_id)
    except Http404:
        raise ApplicationError("no such session", type="not-found", status=404) from None
    app = session_app_get(session=session, name=name)
    return session, app, session.node.name if session.node else ""
