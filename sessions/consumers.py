"""Websocket consumers: the terminal relay and the live session list. Thin: check, then relay.

Terminal frames (DESIGN.md): client → `{"type": "input", "data"}`, `{"type": "resize", "cols",
"rows"}`; server → `{"type": "output", "data"}`, `{"type": "exit", "code"}`.
"""
from __future__ import annotations

import asyncio
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


class TerminalConsumer(AsyncJsonWebsocketConsumer):
    """`/ws/sessions/<id>/terminal/?ticket=…`: spends the one-time ticket, re-checks that its
    user may open this session, then relays frames to and from the agent's PTY."""

    session_id: str = ""

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
        if self.session_id:
            await self.channel_layer.group_discard(events.terminal_group(self.session_id), self.channel_name)

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
        await self.send_json({"type": "output", "data": event["data"]})

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
