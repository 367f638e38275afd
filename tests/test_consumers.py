"""Websocket consumers through the real ASGI application (`console.asgi.application`): the
origin check, session-cookie auth, one-time terminal tickets, and the relay between the
browser and the agent's PTY over the configured channel layer (Redis when REDIS_URL is set).

The agent's side of the relay is played by a channel of our own in the session's groups.
"""
from __future__ import annotations

import asyncio
import uuid

import pytest
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.test import Client

from console.asgi import application
from sessions.lifecycle import events
from sessions.lifecycle import services
from sessions.consumers import CLOSE_BAD_TICKET, CLOSE_NOT_RUNNING, CLOSE_TRY_AGAIN, CLOSE_UNAUTHENTICATED
from sessions.models import SessionStatus

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT = 10
GOOD_ORIGIN = (b"origin", b"http://localhost:8000")


def ticket_for(session, user) -> str:
    ticket, _ = services.terminal_ticket_create(session=session, user=user)
    return ticket


def terminal(session_id, ticket: str, *headers: tuple[bytes, bytes]) -> WebsocketCommunicator:
    return WebsocketCommunicator(application, f"/ws/sessions/{session_id}/terminal/?ticket={ticket}",
                                 headers=list(headers))


async def refused_with(communicator: WebsocketCommunicator) -> int:
    """The close code of a refused connection. A refusal may close before the handshake or
    accept and close at once with an application code (4000-4999); nothing comes in between."""
    connected, code = await communicator.connect(TIMEOUT)
    if connected:
        message = await communicator.receive_output(TIMEOUT)
        assert message["type"] == "websocket.close", f"expected a refusal, got {message}"
        code = message.get("code", 1000)
    return code


async def receive_of_type(layer, channel: str, kind: str) -> dict:
    async with asyncio.timeout(TIMEOUT):
        while True:
            message = await layer.receive(channel)
            if message["type"] == kind:
                return message


NODE = "demo-node"  # where alices_session runs (conftest.demo_cluster)


async def agent_side(session_id) -> tuple:
    """The configured channel layer and a channel of ours in the session's PTY group, as the
    session's agent joins it."""
    layer = get_channel_layer()
    channel = await layer.new_channel()  # the layer's own prefix: channels_redis serves one per process
    await layer.group_add(events.pty_group(NODE, session_id), channel)
    return layer, channel


def test_the_consumer_tests_use_the_configured_channel_layer(settings):
    backend = settings.CHANNEL_LAYERS["default"]["BACKEND"]
    if settings.REDIS_URL:
        assert backend == "common.layers.RedisChannelLayer"


# --- tickets and origins -------------------------------------------------------------------------

def test_a_wrong_ticket_is_refused(alices_session, alice):
    ticket_for(alices_session, alice)

    async def scenario():
        assert await refused_with(terminal(alices_session.pk, "not-the-ticket", GOOD_ORIGIN)) == CLOSE_BAD_TICKET

    asyncio.run(scenario())


def test_a_missing_ticket_is_refused(alices_session):
    async def scenario():
        communicator = WebsocketCommunicator(application, f"/ws/sessions/{alices_session.pk}/terminal/",
                                             headers=[GOOD_ORIGIN])
        assert await refused_with(communicator) == CLOSE_BAD_TICKET

    asyncio.run(scenario())


def test_a_ticket_opens_the_terminal_once_and_a_reused_ticket_is_refused(alices_session, alice):
    ticket = ticket_for(alices_session, alice)

    async def scenario():
        first = terminal(alices_session.pk, ticket, GOOD_ORIGIN)
        connected, _ = await first.connect(TIMEOUT)
        assert connected is True
        await first.disconnect()

        assert await refused_with(terminal(alices_session.pk, ticket, GOOD_ORIGIN)) == CLOSE_BAD_TICKET

    asyncio.run(scenario())


def test_a_ticket_for_another_session_is_refused(alices_session, alice):
    ticket = ticket_for(alices_session, alice)

    async def scenario():
        assert await refused_with(terminal(uuid.uuid4(), ticket, GOOD_ORIGIN)) == CLOSE_BAD_TICKET

    asyncio.run(scenario())


def test_a_ticket_for_a_session_that_stopped_running_is_refused_as_not_running(alices_session, alice):
    ticket = ticket_for(alices_session, alice)
    assert services.session_report_apply(session_id=str(alices_session.pk), status=SessionStatus.TERMINATED,
                                         reason="done", exit_code=0)

    async def scenario():
        assert await refused_with(terminal(alices_session.pk, ticket, GOOD_ORIGIN)) == CLOSE_NOT_RUNNING

    asyncio.run(scenario())


def test_a_foreign_origin_is_refused_without_spending_the_ticket(alices_session, alice):
    ticket = ticket_for(alices_session, alice)

    async def scenario():
        connected, _ = await terminal(alices_session.pk, ticket, (b"origin", b"http://evil.example")).connect(TIMEOUT)
        assert connected is False  # denied before the handshake

        # The refusal happened before the consumer: the ticket is still good.
        communicator = terminal(alices_session.pk, ticket, GOOD_ORIGIN)
        connected, _ = await communicator.connect(TIMEOUT)
        assert connected is True
        await communicator.disconnect()

    asyncio.run(scenario())


def test_a_client_without_an_origin_header_and_a_valid_ticket_is_accepted(alices_session, alice):
    ticket = ticket_for(alices_session, alice)

    async def scenario():
        communicator = terminal(alices_session.pk, ticket)
        connected, _ = await communicator.connect(TIMEOUT)
        assert connected is True
        await communicator.disconnect()

    asyncio.run(scenario())


# --- the relay -----------------------------------------------------------------------------------

def test_a_connected_terminal_asks_the_agent_for_the_scrollback_and_relays_input_and_resizes(alices_session, alice):
    ticket = ticket_for(alices_session, alice)
    session_id = str(alices_session.pk)

    async def scenario():
        layer, agent = await agent_side(session_id)
        communicator = terminal(session_id, ticket, GOOD_ORIGIN)
        connected, _ = await communicator.connect(TIMEOUT)
        assert connected is True
        try:
            attach = await receive_of_type(layer, agent, "pty.attach")
            assert attach["session_id"] == session_id
            assert attach["reply_channel"]

            await communicator.send_json_to({"type": "input", "data": "nvidia-smi\r"})
            message = await receive_of_type(layer, agent, "pty.input")
            assert message == {"type": "pty.input", "data": "nvidia-smi\r", "session_id": session_id}

            await communicator.send_json_to({"type": "resize", "cols": 120, "rows": 40})
            message = await receive_of_type(layer, agent, "pty.resize")
            assert (message["cols"], message["rows"], message["session_id"]) == (120, 40, session_id)

            # The scrollback the agent sends to the reply channel reaches the browser.
            await layer.send(attach["reply_channel"], {"type": "terminal.output", "data": "scrollback"})
            assert await communicator.receive_json_from(TIMEOUT) == {"type": "output", "data": "scrollback"}
        finally:
            await communicator.disconnect()
            await layer.group_discard(events.pty_group(NODE, session_id), agent)

    asyncio.run(scenario())


def test_terminal_output_and_exit_from_the_agent_reach_the_browser(alices_session, alice):
    ticket = ticket_for(alices_session, alice)
    session_id = str(alices_session.pk)

    async def scenario():
        layer = get_channel_layer()
        communicator = terminal(session_id, ticket, GOOD_ORIGIN)
        connected, _ = await communicator.connect(TIMEOUT)
        assert connected is True

        await layer.group_send(events.terminal_group(NODE, session_id), {"type": "terminal.output", "data": "2048MiB\r\n"})
        assert await communicator.receive_json_from(TIMEOUT) == {"type": "output", "data": "2048MiB\r\n"}

        await layer.group_send(events.terminal_group(NODE, session_id), {"type": "terminal.exit", "code": 129})
        assert await communicator.receive_json_from(TIMEOUT) == {"type": "exit", "code": 129}
        closed = await communicator.receive_output(TIMEOUT)
        assert closed["type"] == "websocket.close"

    asyncio.run(scenario())


def test_malformed_frames_from_the_browser_are_not_relayed(alices_session, alice):
    ticket = ticket_for(alices_session, alice)
    session_id = str(alices_session.pk)

    async def scenario():
        layer, agent = await agent_side(session_id)
        communicator = terminal(session_id, ticket, GOOD_ORIGIN)
        assert (await communicator.connect(TIMEOUT))[0] is True
        try:
            await receive_of_type(layer, agent, "pty.attach")
            await communicator.send_json_to({"type": "input", "data": 42})
            await communicator.send_json_to({"type": "resize", "cols": "wide"})
            await communicator.send_json_to({"type": "shell", "data": "rm -rf /"})
            await communicator.send_json_to({"type": "input", "data": "after\r"})  # a marker to wait on

            message = await receive_of_type(layer, agent, "pty.input")
            assert message["data"] == "after\r"  # nothing before it got through
        finally:
            await communicator.disconnect()
            await layer.group_discard(events.pty_group(NODE, session_id), agent)

    asyncio.run(scenario())


IDLE_S = 7  # longer than redis-py's default socket timeout (5 s) and channels_redis's BZPOPMIN (5 s)


def test_an_idle_receive_on_the_configured_channel_layer_outlives_the_redis_socket_timeout():
    """Consumers and the agent wait in `layer.receive` for as long as nobody types: a quiet
    terminal must not make that wait fail."""

    async def scenario():
        layer = get_channel_layer()
        channel = await layer.new_channel()
        waiting = asyncio.ensure_future(layer.receive(channel))
        try:
            done, _ = await asyncio.wait({waiting}, timeout=IDLE_S)  # an idle period, not a poll
            assert not done, f"receive ended while idle: {waiting.exception()!r}"
            await layer.send(channel, {"type": "terminal.output", "data": "late"})
            assert (await asyncio.wait_for(waiting, TIMEOUT))["data"] == "late"
        finally:
            waiting.cancel()

    asyncio.run(scenario())


def test_a_terminal_idle_for_longer_than_the_redis_socket_timeout_still_relays_output(alices_session, alice):
    ticket = ticket_for(alices_session, alice)
    session_id = str(alices_session.pk)

    async def scenario():
        communicator = terminal(session_id, ticket, GOOD_ORIGIN)
        assert (await communicator.connect(TIMEOUT))[0] is True
        assert await communicator.receive_nothing(timeout=IDLE_S, interval=0.5)  # a quiet terminal

        await get_channel_layer().group_send(events.terminal_group(NODE, session_id),
                                             {"type": "terminal.output", "data": "still here"})
        assert await communicator.receive_json_from(TIMEOUT) == {"type": "output", "data": "still here"}
        await communicator.disconnect()

    asyncio.run(scenario())


# --- the live session list -------------------------------------------------------------------------

def test_the_session_events_socket_refuses_an_anonymous_client():
    async def scenario():
        communicator = WebsocketCommunicator(application, "/ws/sessions/", headers=[GOOD_ORIGIN])
        assert await refused_with(communicator) == CLOSE_UNAUTHENTICATED

    asyncio.run(scenario())


def test_the_session_events_socket_pushes_a_signed_in_users_session_updates(alice):
    client = Client()
    client.force_login(alice)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()

    async def scenario():
        communicator = WebsocketCommunicator(application, "/ws/sessions/", headers=[GOOD_ORIGIN, (b"cookie", cookie)])
        connected, _ = await communicator.connect(TIMEOUT)
        assert connected is True
        try:
            marker = str(uuid.uuid4())
            await get_channel_layer().group_send(events.user_group(alice.pk),
                                                 {"type": "session.update", "session": {"id": marker, "status": "RUNNING"}})
            async with asyncio.timeout(TIMEOUT):
                while True:  # the Redis layer may be shared with other runs that use the same user ids
                    frame = await communicator.receive_json_from(TIMEOUT)
                    assert frame["type"] == "session"
                    if frame["session"]["id"] == marker:
                        break
            assert frame["session"]["status"] == "RUNNING"
        finally:
            await communicator.disconnect()

    asyncio.run(scenario())


def test_with_the_channel_layer_unreachable_a_terminal_says_try_again_and_keeps_the_ticket(alices_session, alice,
                                                                                         settings):
    """Redis down: the consumer cannot relay, so it closes with 1013 (try again later) instead of
    1011, and the ticket is not spent: the same ticket opens the terminal once the layer is back."""
    from channels.layers import channel_layers

    from tests.conftest import free_port

    ticket = ticket_for(alices_session, alice)
    good = settings.CHANNEL_LAYERS
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                                           "CONFIG": {"hosts": [f"redis://127.0.0.1:{free_port()}/0"]}}}
    channel_layers.backends.clear()

    async def refused():
        return await refused_with(terminal(alices_session.pk, ticket, GOOD_ORIGIN))

    assert asyncio.run(refused()) == CLOSE_TRY_AGAIN
    settings.CHANNEL_LAYERS = good
    channel_layers.backends.clear()

    async def opens():
        communicator = terminal(alices_session.pk, ticket, GOOD_ORIGIN)
        connected, _ = await communicator.connect(TIMEOUT)
        await communicator.disconnect()
        return connected

    assert asyncio.run(opens())
