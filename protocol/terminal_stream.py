"""The direct terminal stream's wire format, which the web (sessions.consumers.TerminalConsumer)
and the agent (agent.direct) share: a terminal consumer's output, input, resizes and
acknowledgements over a TCP connection of its own to the session's agent, instead of through the
channel layer each way. The channel layer stays the handshake and the fallback.

Handshake: the consumer's `pty.attach` carries `"direct": true`; an agent that listens answers on
the consumer's reply channel (over the layer, as it answers attach: a token only ever reaches the
consumer's own channel) `{"type": "terminal.direct", "host", "port", "token"}`, the token one-time,
random, bound to the session and that consumer's channel, and short-lived (agent.direct.TOKEN_TTL_S).
An agent that does not listen answers `{"type": "terminal.direct", "host": ""}`, then attaches
the consumer over the layer as before (its scrollback, then the terminal group's frames).

The consumer connects to host:port and sends one line `{"token": …}`. The agent answers
`{"type": "direct.ok"}`, then the scrollback (`terminal.output` {data}, no offset: the output up to
the frame the reader starts after, so nothing shows twice), then every output frame of the session
(`terminal.output` {data, offset, n}, as on the layer), and at the session's end `terminal.exit`
{code}, after which it closes the connection. The consumer sends `pty.input` {data}, `pty.resize`
{rows, cols} and `pty.ack` {offset, n}; closing the connection detaches it. A wrong, expired or
reused token is answered `{"type": "direct.refused", "detail"}` and the connection closed.

Framing: one JSON object a line (UTF-8, `\\n`-terminated; JSON escapes the newlines inside
strings). A line is at most LINE_LIMIT bytes: a frame carries at most 64 Ki characters
(agent.core.FRAME_CHARS), 6 bytes each JSON-escaped at worst.
"""

from __future__ import annotations

import json
from typing import Any

LINE_LIMIT = 4 * 1024 * 1024  # bytes in one line at most, both ways
DIRECT_OFFER = "terminal.direct"  # the agent's answer to an attach that asked for a direct stream
DIRECT_OK = "direct.ok"
DIRECT_REFUSED = "direct.refused"


def encode(message: dict[str, Any]) -> bytes:
    """One line of the stream: `message` (a dict of plain types) as JSON, `\\n`-terminated, UTF-8."""
    return (json.dumps(message, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
