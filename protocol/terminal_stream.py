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


# The control bytes json_string's quick path does not escape itself (it does \t \n \r \b and ESC).
_RARE_CONTROLS = bytes(c for c in range(32) if c not in (0x08, 0x09, 0x0A, 0x0D, 0x1B))


def json_string(text: str) -> str:
    """`text` as a JSON string literal, quotes included: what `json.dumps(text, ensure_ascii=False)`
    gives, about twice as fast for a terminal's usual output (140 µs against 270-320 for 25 kB of
    base64 lines; issue 35.3), by a bytes.replace for each character JSON escapes; text with
    another control character (or that UTF-8 cannot encode) goes to json.dumps."""
    try:
        raw = text.encode()
    except UnicodeEncodeError:
        return json.dumps(text, ensure_ascii=False)
    if len(raw.translate(None, _RARE_CONTROLS)) != len(raw):
        return json.dumps(text, ensure_ascii=False)
    raw = raw.replace(b"\\", b"\\\\").replace(b'"', b'\\"').replace(b"\n", b"\\n").replace(b"\r", b"\\r")
    raw = raw.replace(b"\t", b"\\t").replace(b"\x1b", b"\\u001b").replace(b"\x08", b"\\b")
    return '"' + raw.decode() + '"'


_OUTPUT_HEAD = b'{"type":"terminal.output","data":'
_OUTPUT_TAIL = b',"offset":'


def encode_output(data: str, offset: int, n: int) -> bytes:
    """The line of one output frame, `{"type": "terminal.output", "data", "offset", "n"}`: the
    same bytes as `encode` of that dict, its keys in that order, which `output_literal` relies on."""
    return b'%s%s%s%d,"n":%d}\n' % (_OUTPUT_HEAD, json_string(data).encode(), _OUTPUT_TAIL, offset, n)


def output_literal(line: bytes, message: dict[str, Any]) -> str | None:
    """The data of an output frame as the JSON string literal it is in its line (quotes included),
    for a web that relays it into the browser's frame as it is: a frame's text is then
    JSON-encoded once on its way, by the agent (json.dumps of a terminal's output costs 150-260 µs
    for 25 kB of base64 lines, 6-10 ms of CPU a MB; issue 35.3). `message`: json.loads of `line`,
    which checked that the line is JSON; None where the line is not encode_output's (the
    scrollback's, which has no offset; another layout), and the message's data is encoded anew.
    A JSON string escapes every `"` inside it, so the last `,"offset":` of the line follows it. The
    slice must decode to the message's data exactly (about 30 µs for 25 kB): a line with a key
    written twice (`"data":"x","type":"terminal.output",…`, which json.loads takes as its last) would
    otherwise put keys of the agent's choosing into the browser's frame."""
    if len(message) != 4 or "offset" not in message or not line.startswith(_OUTPUT_HEAD):
        return None
    split = line.rfind(_OUTPUT_TAIL)
    if split <= len(_OUTPUT_HEAD):
        return None
    literal = line[len(_OUTPUT_HEAD) : split].decode()
    try:
        if json.loads(literal) != message.get("data"):
            return None
    except ValueError:
        return None
    return literal
