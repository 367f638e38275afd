"""The agent's side of the direct terminal stream (protocol.terminal_stream: the handshake and the
wire format): a TCP listener on the node's `[container] app-address` (agent.toml
`terminal-direct`, `terminal-port`), one-time tokens, and each connection's reading task. What
the stream carries is the agent's (agent.core: `_direct_attach`, `_direct_message`,
`_direct_detach`, and the output pump, which writes each frame to the session's direct readers).

Flow control is the layer's (agent.terminal_pipe, READER_WINDOW_CHARS): the agent writes a direct reader
at most a window past its acknowledgement, so the connection's buffers hold at most that; a direct
reader that acknowledges nothing for READER_STALL_S loses its connection (its consumer closes the
websocket with 4502 and the page connects again) instead of growing a buffer.

No thread per connection: one asyncio server on the agent's loop, one task per connection.

The same listener serves a session's file bytes (agent.files, protocol.files: a download sent with
sendfile, an upload read into its temporary file) on tokens of their own (`offer_stream`): one
connection per transfer instead of a round trip through the channel layer per chunk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Awaitable, Callable

from protocol.terminal_stream import DIRECT_REFUSED, LINE_LIMIT, encode


log = logging.getLogger(__name__)

TOKEN_TTL_S = 5.0  # how long an offered token may be presented
HELLO_TIMEOUT_S = 5.0  # a connection that presents no token in this time is closed
MAX_TOKENS = 10_000  # offered tokens kept at most (the oldest are dropped first)


StreamHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class DirectStream:
    """One consumer's direct connection, as the agent's output pump sees it: `write(line)`
    (bytes, a line of `encode`) never blocks (the window bounds what waits in the buffer), and
    `close()` flushes what waits, then closes."""

    def __init__(self, writer: asyncio.StreamWriter, peer: str) -> None:
        self.writer = writer
        self.peer = peer

    def write(self, line: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(line)

    def close(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()


class DirectServer:
    """The agent's listener for direct terminal streams on `host` (the node's `[container]
    app-address`), port `port` (0: a free one, chosen at start), which the web reaches at
    `advertise` (agent.toml `terminal-address`; default `host`). `offer(session_id, channel)`
    makes a token; a connection that presents it becomes that channel's direct reader of that
    session (`Agent._direct_attach`)."""

    def __init__(self, agent, *, host: str, port: int = 0, advertise: str = "", what: str = "direct terminal streams") -> None:
        self.agent = agent
        self.what = what  # what it listens for, as its log lines say
        self.host = host
        self.port = port
        self.advertise = advertise or host
        self.server: asyncio.Server | None = None
        self._tokens: dict[str, tuple[str, str, float]] = {}  # token → (session id, channel, expiry: loop time)
        self._streams: dict[str, tuple[StreamHandler, float]] = {}  # token → (its handler, expiry: loop time)

    @property
    def serving(self) -> bool:
        return self.server is not None

    async def start(self) -> None:
        """Listen. A failure (the address is not this host's, the port is taken) is logged and
        leaves the terminals on the channel layer."""
        try:
            self.server = await asyncio.start_server(self._serve, self.host, self.port, limit=LINE_LIMIT)
        except OSError as exc:
            log.warning(
                "agent %s: cannot listen for %s on %s:%s (%s); they use the channel layer",
                self.agent.node,
                self.what,
                self.host,
                self.port,
                exc,
            )
            return
        self.port = self.server.sockets[0].getsockname()[1]
        log.info("agent %s: %s on %s:%d", self.agent.node, self.what, self.host, self.port)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def offer(self, session_id: str, channel: str) -> dict:
        """`{"host", "port", "token"}` for the consumer on `channel` to read session
        `session_id` directly; the token is valid once, for TOKEN_TTL_S seconds."""
        now = asyncio.get_running_loop().time()
        for token in [t for t, (_, _, expiry) in self._tokens.items() if expiry < now]:
            del self._tokens[token]
        while len(self._tokens) >= MAX_TOKENS:
            del self._tokens[next(iter(self._tokens))]
        token = secrets.token_urlsafe(24)
        self._tokens[token] = (session_id, channel, now + TOKEN_TTL_S)
        return {"host": self.advertise, "port": self.port, "token": token}

    def offer_stream(self, handler: StreamHandler) -> dict:
        """`{"host", "port", "token"}` for one connection that `handler(reader, writer)` serves
        (a file's bytes: agent.files) once its token is presented; valid once, for TOKEN_TTL_S
        seconds. The handler runs on the agent's loop; the connection is closed when it returns."""
        now = asyncio.get_running_loop().time()
        for token in [t for t, (_, expiry) in self._streams.items() if expiry < now]:
            del self._streams[token]
        while len(self._streams) >= MAX_TOKENS:
            del self._streams[next(iter(self._streams))]
        token = secrets.token_urlsafe(24)
        self._streams[token] = (handler, now + TOKEN_TTL_S)
        return {"host": self.advertise, "port": self.port, "token": token}

    def _redeem(self, token: object) -> tuple[str, str] | str:
        """(session id, channel) of a valid token, spent now; else why it is refused."""
        if not isinstance(token, str):
            return "no token"
        entry = self._tokens.pop(token, None)
        if entry is None:
            return "unknown or already used token"
        session_id, channel, expiry = entry
        if asyncio.get_running_loop().time() > expiry:
            return "expired token"
        return session_id, channel

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = "%s:%s" % (writer.get_extra_info("peername") or ("?", "?"))[:2]
        stream = DirectStream(writer, peer)
        running = None  # agent.core.RunningSession, once the token is good
        channel = ""
        try:
            try:
                hello = json.loads(await asyncio.wait_for(reader.readline(), HELLO_TIMEOUT_S))
                token = hello.get("token") if isinstance(hello, dict) else None
                handled = self._streams.pop(token, None) if isinstance(token, str) else None
                if handled is not None and handled[1] >= asyncio.get_running_loop().time():
                    await handled[0](reader, writer)  # a file's bytes (agent.files)
                    return
                redeemed = self._redeem(token)
            except (TimeoutError, ValueError, asyncio.LimitOverrunError, ConnectionError) as exc:
                redeemed = f"no greeting ({type(exc).__name__})"
            if isinstance(redeemed, tuple):
                session_id, channel = redeemed
                running = self.agent.sessions.get(session_id)
                if running is None or running.pipe.output_closed:
                    redeemed, running = f"session {session_id} does not run here", None
            if running is None:
                log.warning("agent %s: refused a direct terminal stream from %s: %s", self.agent.node, peer, redeemed)
                stream.write(encode({"type": DIRECT_REFUSED, "detail": str(redeemed)}))
                return
            self.agent._direct_attach(running, channel, stream)
            while True:
                line = await reader.readline()
                if not line:
                    return
                message = json.loads(line)
                if isinstance(message, dict):
                    self.agent._direct_message(running, channel, message)
        except (ConnectionError, ValueError, KeyError, TypeError, asyncio.LimitOverrunError) as exc:
            log.info("agent %s: direct terminal stream from %s ended: %r", self.agent.node, peer, exc)
        finally:
            if running is not None:
                self.agent._direct_detach(running, channel, stream)
            stream.close()
