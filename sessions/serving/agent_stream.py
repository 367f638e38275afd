"""The web's connection to an agent's listener (agent.direct): a terminal's direct stream
(sessions.consumers) and a file transfer's bytes (sessions.serving.files) both start the same way,
at the address of the agent's offer (protocol.channel.DirectOffer) with its one-time token
presented as the first line (protocol.terminal_stream); the agent answers DIRECT_OK or
DIRECT_REFUSED {detail} on the connection.
"""

from __future__ import annotations

import asyncio
import json
import logging

from protocol.channel import DirectOffer, Malformed
from protocol.terminal_stream import DIRECT_OK, LINE_LIMIT, encode

log = logging.getLogger(__name__)

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def agent_stream_open(offer: dict, *, timeout_s: float, what: str, accepted: bool = False) -> Connection | None:
    """A connection to the agent's listener at `offer`'s host and port (a DirectOffer's dict) with
    its token presented, within `timeout_s` seconds; with `accepted`, also the agent's answer read
    within that time and DIRECT_OK required (else the caller reads the answer when it needs it: a
    transfer's bytes may follow the token at once). None, logged naming `what` (e.g. "terminal for
    <session id>"), where the offer is empty or malformed, the connection fails or times out, or
    the agent refused the token."""
    writer = None
    answer = None
    try:
        found = DirectOffer.from_dict(offer)
        if not found.host:
            return None
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(found.host, found.port, limit=LINE_LIMIT)
            writer.write(encode({"token": found.token}))
            if not accepted:
                return reader, writer
            answer = json.loads(await reader.readline() or b"null")
    except (Malformed, OSError, TimeoutError, ValueError) as exc:
        log.info(
            "%s: no direct stream from %s:%s (%s); through the channel layer",
            what,
            offer.get("host"),
            offer.get("port"),
            exc or type(exc).__name__,
        )
    if isinstance(answer, dict) and answer.get("type") == DIRECT_OK and writer is not None:
        return reader, writer
    if answer is not None:
        log.warning("%s: the agent refused the direct stream: %s", what, answer)
    if writer is not None:
        writer.close()
    return None
