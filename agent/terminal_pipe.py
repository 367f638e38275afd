"""The terminal pipe: one session's PTY and the terminals that read it, with flow control both ways.

Output: the PTY is read when the loop says it is readable; what comes is kept as scrollback
(SCROLLBACK_BYTES), decoded (UTF-8, a split character held until its rest comes), handed to the
log shipper (`on_log`) and put in the outbox, from which `pump` sends frames
`{"type": "terminal.output", "data", "offset", "n"}` (at most FRAME_CHARS characters; `offset`:
the characters sent so far, `n`: the frames sent so far) to the terminal group (`send`: the
channel layer's group send) and to each direct stream (agent.direct).

Flow control, end to end: frames go only while every terminal that reads the session (`readers`:
the consumers that attached) has acknowledged (`ack`) all but READER_WINDOW_CHARS characters and
READER_WINDOW_FRAMES frames of what was sent, and the PTY is read only while fewer than
OUTBOX_HIGH characters wait to be sent (again once they drained below OUTBOX_LOW). So a slow
browser holds back its own session's program and nothing else, and no buffer between them holds
more than the window: the channel layers' own limits (capacity 100 messages in memory, 1000 in
channels_redis, which drops the oldest past it) are never reached. A reader that acknowledges
nothing for READER_STALL_S while it holds the window (its web process died) stops counting until
it acknowledges again. One frame carries at most FRAME_CHARS characters (JSON-escaped, well under
the smallest websocket message limit on the way, daphne's 1 MiB).

The output rate cap: a session's output is read from its PTY at OUTPUT_RATE_BYTES a second at
most (a token bucket of OUTPUT_BURST_BYTES) while the agent's policy says it is capped (`capped`:
nobody reads it at a terminal, a session is starting, or another session output something in the
last BUSY_S seconds: `OutputCap`). Past it the PTY is left unread, so the program blocks writing,
as it would behind a slow terminal (benchmarks/agent_scale.py, flood, 2 cores: 1.37-1.77x the quiet
launch latency next to two flooding sessions at this rate, 2.28x at 2 MiB/s, 2.52x uncapped).

Input: terminal input waits in a per-session buffer of at most INPUT_BUFFER_BYTES until the PTY is
writable; input past it (a paste into a program that does not read) is refused and said so.

The pipe runs on the agent's loop and knows nothing of sessions' lifecycles, the manager or the
channel layer's names: the agent binds it (`bind`) to a loop, a group send, the rate-cap policy and
the log. Its process is a runtime's handle (agent.runtimes.SessionHandle): `fd`, `read(n)`,
`write(data)`, `close_stream()`; nothing else of it is used.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.buffers import take_front
from protocol.terminal_stream import DIRECT_OK, encode, encode_output

if TYPE_CHECKING:
    from agent.direct import DirectStream

log = logging.getLogger(__name__)

SCROLLBACK_BYTES = 64 * 1024
READ_CHUNK = 64 * 1024
# A read of a PTY gives at most what its line discipline holds, about 4 KiB, and the kernel refills
# that from the tty's buffer (up to 64 KiB) meanwhile: a read of FULL_READ bytes or more says more
# is likely waiting, and it is read at once (up to READ_CHUNK in all) and handled as one piece,
# instead of one loop turn (a decode, the scrollback, the log, the rate cap, the pump's wake-up)
# for each 4 KiB. A keystroke's echo (a few bytes) is read once, as before.
FULL_READ = 2048
OUTBOX_HIGH = 256 * 1024
OUTBOX_LOW = 64 * 1024
FRAME_CHARS = 64 * 1024
READER_WINDOW_CHARS = 1024 * 1024
READER_WINDOW_FRAMES = 64
READER_STALL_S = 10.0
COALESCE_S = 0.001
# A direct stream's write takes no time, nor does a group send of the in-memory layer (standalone)
# to consumers with room, so nothing piles up behind them as behind a group send through Redis:
# after a frame of STREAM_CHARS or more (output streams), output that comes within STREAM_GAP_S
# waits COALESCE_S for more. A keystroke's echo after a quiet moment goes at once.
STREAM_CHARS = 1024
STREAM_GAP_S = 0.004
# A session alone on its node with a terminal open runs at its reader's pace (benchmarks/terminal.py:
# the cap held `head -c 1e8 /dev/zero | base64` to 0.57 MB/s).
OUTPUT_RATE_BYTES = 512 * 1024
OUTPUT_BURST_BYTES = 1024 * 1024
BUSY_S = 1.0
INPUT_BUFFER_BYTES = 1024 * 1024
SEND_TRIES = 3  # tries of a group send, 0.5 s apart, before its frame is dropped (the layer is unreachable)


@dataclass(frozen=True)
class FlowLimits:
    """The pipe's windows and bounds (characters, frames, bytes, seconds); the defaults are this
    module's."""

    reader_window_chars: int = READER_WINDOW_CHARS
    reader_window_frames: int = READER_WINDOW_FRAMES
    reader_stall_s: float = READER_STALL_S
    outbox_high: int = OUTBOX_HIGH
    outbox_low: int = OUTBOX_LOW
    frame_chars: int = FRAME_CHARS
    input_buffer_bytes: int = INPUT_BUFFER_BYTES
    output_rate_bytes: int = OUTPUT_RATE_BYTES
    output_burst_bytes: int = OUTPUT_BURST_BYTES


class OutputCap:
    """The node's output-rate policy: a session's output is capped (OUTPUT_RATE_BYTES) while nobody
    reads it at a terminal, a session is starting, or another session output something in the last
    BUSY_S seconds. `busy`: session id → loop time it last output something."""

    def __init__(self) -> None:
        self.busy: dict[str, float] = {}
        self._pruned = 0.0

    def capped(self, session_id: str, now: float, *, read: bool, starting: bool) -> bool:
        """Note that `session_id` output something at loop time `now` and say whether the cap holds
        it (`read`: a terminal reads it; `starting`: a session of the node is starting)."""
        self.busy[session_id] = now
        if now - self._pruned > BUSY_S / 4:
            self._pruned = now
            for other in [sid for sid, at in self.busy.items() if now - at > BUSY_S]:
                del self.busy[other]
        return not read or starting or len(self.busy) > 1


async def _nowhere(message: dict) -> None:
    raise RuntimeError("the terminal pipe is not bound to a channel layer")


class TerminalPipe:
    """One session's PTY relay (see the module docstring). Created with the runtime's handle,
    bound to the agent's loop (`bind`), then `start`ed; `close` (the PTY), `end_output` (no more
    output: the pump ends once the outbox is sent) and `let_go` (stop relaying, leave the process
    alone) end it."""

    loop: asyncio.AbstractEventLoop

    def __init__(self, process: Any, *, adopted: bool = False) -> None:
        self.process = process
        self.scrollback = bytearray()
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.outbox: list[str] = []  # decoded output not yet sent to the terminal group
        self.outbox_chars = 0
        self.outbox_wake = asyncio.Event()
        self.reading = False  # the PTY is registered with the loop for reading
        self.throttled = False  # the output rate was spent: the PTY is not read until the bucket refills
        self.tokens = float(OUTPUT_BURST_BYTES)  # bytes the session may still output now (token bucket)
        self.tokens_at = 0.0  # loop time of the last refill
        self.sent = 0  # characters sent to the terminal group: the `offset` of the last frame
        self.frames = 0  # frames sent to the terminal group: the `n` of the last frame
        self.readers: dict[str, list] = {}  # consumer channel → [acked offset, acked n, loop time of the ack]
        self.direct: dict[str, DirectStream] = {}  # consumer channel → its DirectStream: its frames go there
        self.layer_channels: set[str] = set()  # consumers that attached over the layer (until they detach)
        self.adopted = adopted  # run on from an earlier agent: consumers it never saw attach may read the group
        self.stall_check: asyncio.TimerHandle | None = None  # re-checks the readers once one may have stalled
        self.inbox = bytearray()  # terminal input the PTY has not taken yet
        self.writing = False  # the PTY is registered with the loop for writing (inbox not empty)
        self.eof = asyncio.Event()
        self.pty_closed = False
        self.output_closed = False  # no more output will come: the pump ends once the outbox is sent
        self.pump_task: asyncio.Task | None = None
        self.pump_idle = False  # the pump waits for output (outbox_wake): nothing is on its way
        self.large_at = -STREAM_GAP_S  # loop time of the last frame of STREAM_CHARS or more
        self.limits = FlowLimits()
        self.node = ""
        self.session_id = ""
        self.send: Callable[[dict], Awaitable[None]] = _nowhere
        self.capped: Callable[[float], bool] = lambda now: False
        self.on_log: Callable[[str], None] = lambda text: None

    def bind(
        self,
        *,
        loop: asyncio.AbstractEventLoop,
        node: str,
        session_id: str,
        send: Callable[[dict], Awaitable[None]],
        capped: Callable[[float], bool] | None = None,
        on_log: Callable[[str], None] | None = None,
        limits: FlowLimits | None = None,
    ) -> None:
        """`send`: sends one message to the session's terminal group (raises when the layer is
        unreachable); `capped(now)`: whether the output rate cap holds now (None: never);
        `on_log(text)`: the output for the session's log (None: nowhere)."""
        self.loop, self.node, self.session_id, self.send = loop, node, session_id, send
        if capped is not None:
            self.capped = capped
        if on_log is not None:
            self.on_log = on_log
        if limits is not None:
            self.limits = limits
        self.tokens = float(self.limits.output_burst_bytes)

    def start(self) -> None:
        """Read the PTY and start the output pump (on the bound loop)."""
        self.resume_reading()
        self.pump_task = self.loop.create_task(self.pump())

    # --- output: the PTY to the terminals ------------------------------------------------

    def resume_reading(self) -> None:
        if not self.reading and not self.throttled and not self.pty_closed and not self.eof.is_set():
            self.loop.add_reader(self.process.fd, self.on_readable)
            self.reading = True

    def pause_reading(self) -> None:
        if self.reading:
            self.loop.remove_reader(self.process.fd)
            self.reading = False

    def on_readable(self) -> None:
        try:
            data = self.process.read(READ_CHUNK)
        except BlockingIOError:
            return
        if not data:
            self.pause_reading()
            self.eof.set()
            self.outbox_wake.set()
            return
        if len(data) >= FULL_READ:
            data = self._read_more(data)
        self.scrollback += data
        if len(self.scrollback) > 2 * SCROLLBACK_BYTES:  # trimmed now and then, not on every read
            del self.scrollback[:-SCROLLBACK_BYTES]
        self.output(self.decoder.decode(data))
        if len(data) < FULL_READ:
            self.send_at_once()
        if self.outbox_chars >= self.limits.outbox_high:  # the terminal group is behind: stop reading until it drains
            self.pause_reading()
        self.spend_output_tokens(len(data))

    def _read_more(self, first: bytes) -> bytes:
        """`first` and what the PTY holds besides, read while each read comes FULL_READ bytes or
        more, READ_CHUNK bytes in all at most. The end of the output (b"") or nothing more
        (BlockingIOError) stops it; the loop's next readable event then sees the end as before."""
        parts, total, last = [first], len(first), len(first)
        while last >= FULL_READ and total < READ_CHUNK:
            try:
                more = self.process.read(READ_CHUNK - total)
            except BlockingIOError:
                break
            if not more:
                break
            parts.append(more)
            total += len(more)
            last = len(more)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def spend_output_tokens(self, size: int) -> None:
        """The output rate cap, where it holds (`capped`): refill the bucket for the time since the
        last read, take `size` bytes from it, and when it runs dry stop reading the PTY until it
        has refilled to zero."""
        now = self.loop.time()
        rate = self.limits.output_rate_bytes
        self.tokens = min(self.limits.output_burst_bytes, self.tokens + (now - self.tokens_at) * rate)
        self.tokens_at = now
        if not self.capped(now):
            return
        self.tokens -= size
        if self.tokens < 0:
            self.throttled = True
            self.pause_reading()
            self.loop.call_later(-self.tokens / rate, self._end_throttle)

    def _end_throttle(self) -> None:
        self.throttled = False
        if self.outbox_chars <= self.limits.outbox_low:  # else the output pump resumes once the terminal drained
            self.resume_reading()

    def output(self, text: str, *, log_it: bool = True) -> None:
        """Output for the terminals (and, `log_it`, the log): the PTY's, or the agent's own lines."""
        if not text:
            return
        self.outbox.append(text)
        self.outbox_chars += len(text)
        self.outbox_wake.set()
        if log_it:
            self.on_log(text)

    def take_frame(self) -> str:
        """Up to FRAME_CHARS characters from the front of the outbox."""
        frame = take_front(self.outbox, self.limits.frame_chars)
        self.outbox_chars -= len(frame)
        return frame

    def readers_behind(self) -> bool:
        """Whether a terminal reading the session is a window (READER_WINDOW_CHARS or _FRAMES)
        behind what was sent. A reader that has acknowledged nothing for READER_STALL_S stops
        counting (until it acknowledges again); a re-check is scheduled for the one that may."""
        limits = self.limits
        now, behind, stalled = self.loop.time(), False, []
        for channel, (offset, n, acked_at) in self.readers.items():
            if self.sent - offset <= limits.reader_window_chars and self.frames - n <= limits.reader_window_frames:
                continue
            if now - acked_at >= limits.reader_stall_s:
                stalled.append(channel)
            else:
                behind = True
                if self.stall_check is None:
                    self.stall_check = self.loop.call_at(acked_at + limits.reader_stall_s, self._recheck_readers)
        for channel in stalled:
            log.warning(
                "agent %s: the terminal %s of session %s acknowledged nothing for %.0f s; not waiting for it",
                self.node,
                channel,
                self.session_id,
                limits.reader_stall_s,
            )
            del self.readers[channel]
            stream = self.direct.pop(channel, None)
            if stream is not None:  # its buffer would grow: it closes, and its page connects again
                stream.close()
        return behind

    def _recheck_readers(self) -> None:
        self.stall_check = None
        self.outbox_wake.set()

    def send_at_once(self) -> None:
        """Where only direct streams read the session and the pump waits for output, a little of it
        (a keystroke's echo) is written to them now, as the pump would on its next turn (no
        reader a window behind, nothing streaming: see `pump`), without that turn: the pump's task
        wake-up was a tenth of the agent's work a keystroke (benchmarks/terminal.py, py-spy)."""
        if not (self.pump_idle and self.direct) or self.layer_channels or self.adopted or self.output_closed:
            return
        if self.outbox_chars >= STREAM_CHARS or self.loop.time() - self.large_at < STREAM_GAP_S:
            return
        if self.readers_behind():
            return
        frame = self.take_frame()
        self.sent += len(frame)
        self.frames += 1
        line = encode_output(frame, self.sent, self.frames)
        for stream in self.direct.values():
            stream.write(line)
        self.outbox_wake.clear()

    async def pump(self) -> None:
        """Send output frames in order (what piled up meanwhile coalesced, at most FRAME_CHARS a
        frame) while no reader is a window behind (woken by its acknowledgement), reading the PTY
        again once the outbox drained below OUTBOX_LOW; ends once the output is closed and sent.
        While output streams (more came while the last frame was on its way), the next frame waits
        COALESCE_S for more unless it is half full: fewer, larger frames cost less at every hop; a
        keystroke's echo (nothing in flight before it) goes at once. Output also streams while
        large frames follow one another (STREAM_CHARS, STREAM_GAP_S): what a direct stream or the
        in-memory layer sends is never on its way for long."""
        half = self.limits.frame_chars // 2
        streaming = False
        while True:
            self.pump_idle = True
            await self.outbox_wake.wait()
            self.pump_idle = False
            self.outbox_wake.clear()
            if self.loop.time() - self.large_at < STREAM_GAP_S and self.outbox_chars < half and not self.output_closed:
                await asyncio.sleep(COALESCE_S)
            while self.outbox and not (self.readers and self.readers_behind()):
                if streaming and self.outbox_chars < half and not self.output_closed:
                    await asyncio.sleep(COALESCE_S)
                frame = self.take_frame()
                self.sent += len(frame)
                self.frames += 1
                if len(frame) >= STREAM_CHARS:
                    self.large_at = self.loop.time()
                message = {"type": "terminal.output", "data": frame, "offset": self.sent, "n": self.frames}
                if self.direct:  # written before any await: a reader that attaches meanwhile starts after it
                    line = encode_output(frame, self.sent, self.frames)
                    for stream in self.direct.values():
                        stream.write(line)
                    if not (self.layer_channels or self.adopted):
                        if self.outbox_chars <= self.limits.outbox_low:
                            self.resume_reading()
                        streaming = bool(self.outbox)
                        continue
                await self._send_frame(message, len(frame))
                if self.outbox_chars <= self.limits.outbox_low:
                    self.resume_reading()
                streaming = bool(self.outbox)
            streaming = streaming and bool(self.outbox)
            if self.output_closed and not self.outbox:
                return

    async def _send_frame(self, message: dict, size: int) -> None:
        for attempt in range(SEND_TRIES):
            try:
                await self.send(message)
                return
            except Exception:
                if attempt == SEND_TRIES - 1:
                    log.warning(
                        "agent %s: dropped %d characters of terminal output of %s (the channel layer is unreachable)",
                        self.node,
                        size,
                        self.session_id,
                    )
                else:
                    await asyncio.sleep(0.5)

    # --- readers: attach, acknowledge, detach --------------------------------------------

    def ack(self, channel: str, offset: int, n: int, *, direct: bool = False) -> None:
        """A terminal consumer's websocket took the output up to `offset` (frame `n`). A reader
        over the layer that stalled (or attached to an earlier agent) counts again; a direct one
        that stalled lost its stream."""
        reader = self.readers.get(channel)
        if reader is None:
            if direct:
                return
            self.layer_channels.add(channel)
            self.readers[channel] = [offset, n, self.loop.time()]
        elif offset >= reader[0]:
            reader[:] = [offset, n, self.loop.time()]
        self.outbox_wake.set()

    def attach_layer(self, channel: str) -> str:
        """A terminal opened over the channel layer: it reads the session from the next frame on.
        Returns the scrollback (the last SCROLLBACK_BYTES of output) to send it first."""
        self.readers[channel] = [self.sent, self.frames, self.loop.time()]
        self.layer_channels.add(channel)
        return bytes(self.scrollback[-SCROLLBACK_BYTES:]).decode("utf-8", "replace")

    def detach(self, channel: str) -> None:
        """A terminal over the layer closed (`pty.detach`): it no longer holds the window."""
        self.readers.pop(channel, None)
        self.layer_channels.discard(channel)
        self.outbox_wake.set()

    def attach_direct(self, channel: str, stream: DirectStream) -> None:
        """A consumer presented its token on `stream` (agent.direct): it reads the session from the
        last frame sent on (flow control as a layer reader's), after the scrollback up to that frame."""
        stream.write(encode({"type": DIRECT_OK}))
        stream.write(encode({"type": "terminal.output", "data": self.scrollback_until_sent()}))
        self.readers[channel] = [self.sent, self.frames, self.loop.time()]
        self.direct[channel] = stream

    def detach_direct(self, channel: str, stream: DirectStream) -> None:
        """The direct stream closed: its consumer no longer reads (as `pty.detach`)."""
        if self.direct.get(channel) is stream:
            del self.direct[channel]
            self.readers.pop(channel, None)
            self.outbox_wake.set()

    def scrollback_until_sent(self) -> str:
        """The last SCROLLBACK_BYTES of output up to the last frame sent: the scrollback without
        what still waits in the decoder and the outbox (a direct reader gets that as frames), or
        nothing where the outbox holds more than the scrollback."""
        raw = bytes(self.scrollback[-SCROLLBACK_BYTES:])
        held = self.decoder.getstate()[0]
        if held:
            raw = raw[: -len(held)]
        text = raw.decode("utf-8", "replace")
        waiting = "".join(self.outbox)
        if not waiting:
            return text
        return text[: -len(waiting)] if text.endswith(waiting) else ""

    # --- input: the terminals to the PTY -------------------------------------------------

    def write_input(self, data: bytes) -> None:
        """Queue terminal input for the PTY (written as it becomes writable). Input that would
        grow the queue past INPUT_BUFFER_BYTES is refused, and the terminal says so."""
        if self.pty_closed or not data:
            return
        if len(self.inbox) + len(data) > self.limits.input_buffer_bytes:
            self.output(
                f"\r\n[fgpu: {len(data)} bytes of input dropped: the program has not read the "
                f"last {len(self.inbox) // 1024} KiB yet]\r\n",
                log_it=False,
            )
            return
        self.inbox += data
        self.flush_input()

    def flush_input(self) -> None:
        while self.inbox and not self.pty_closed:
            try:
                written = self.process.write(self.inbox)
            except BlockingIOError:
                break
            except OSError:  # the PTY is gone
                self.inbox.clear()
                break
            del self.inbox[:written]
        if self.inbox and not self.writing:
            self.loop.add_writer(self.process.fd, self.flush_input)
            self.writing = True
        elif not self.inbox and self.writing:
            self.loop.remove_writer(self.process.fd)
            self.writing = False

    # --- the end -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop reading and writing the PTY and close the agent's end of it (idempotent)."""
        if self.pty_closed:
            return
        self.pause_reading()
        if self.writing:
            self.loop.remove_writer(self.process.fd)
            self.writing = False
        self.pty_closed = True
        self.inbox.clear()
        self.process.close_stream()

    def end_output(self) -> None:
        """No more output comes (the PTY drained): close it, send what the decoder held, and let
        the pump end once the outbox is sent."""
        self.close()
        self.output(self.decoder.decode(b"", final=True))
        self.output_closed = True
        self.outbox_wake.set()

    def exit_direct(self, exit_code: int) -> None:
        """After the last frame, tell each direct stream the session ended (`terminal.exit`) and
        close it."""
        if self.direct:
            line = encode({"type": "terminal.exit", "code": exit_code})
            for stream in self.direct.values():
                stream.write(line)
                stream.close()
            self.direct.clear()

    def let_go(self) -> None:
        """Stop relaying: close the direct streams, stop the pump, close the PTY's end."""
        for stream in self.direct.values():
            stream.close()
        if self.pump_task is not None:
            self.pump_task.cancel()
        self.close()
