"""agent.terminal_pipe alone: a PTY's output to its terminals and their input to it, with the
flow control both ways, on a real pseudo-terminal and an event loop, with no agent, manager,
session or channel layer (the group send is a recording stand-in). Every wait is on a condition
with a deadline."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select

from agent.terminal_pipe import FlowLimits, OutputCap, TerminalPipe
from protocol.terminal_stream import DIRECT_OK
from tests.stack import wait_until_async

TIMEOUT = 10.0


class PtyHandle:
    """The parts of a runtime's handle the pipe uses, over a real PTY: the test writes the
    program's output to `slave`."""

    def __init__(self) -> None:
        self.fd, self.slave = os.openpty()
        os.set_blocking(self.fd, False)
        self.closed = False

    def read(self, size: int) -> bytes:
        return os.read(self.fd, size)

    def write(self, data: bytes) -> int:
        return os.write(self.fd, data)

    def close_stream(self) -> None:
        self.closed = True
        os.close(self.fd)


class BlockedHandle(PtyHandle):
    """A program that never reads its terminal: every write would block."""

    def write(self, data: bytes) -> int:
        raise BlockingIOError


def run(scenario, *, handle=None, capped=None, **limits):
    handle = handle or PtyHandle()
    frames: list[dict] = []

    async def send(message: dict) -> None:
        frames.append(message)

    async def main():
        pipe = TerminalPipe(handle)
        pipe.bind(
            loop=asyncio.get_running_loop(),
            node="pipe-node",
            session_id="s1",
            send=send,
            capped=capped,
            limits=FlowLimits(**limits),
        )
        pipe.start()
        try:
            return await scenario(pipe, handle, frames)
        finally:
            pipe.let_go()
            os.close(handle.slave)

    return asyncio.run(main())


def text_of(frames: list[dict]) -> str:
    return "".join(frame["data"] for frame in frames)


def test_a_reader_that_does_not_acknowledge_holds_the_output_at_its_window_and_the_pty_unread():
    async def scenario(pipe, handle, frames):
        pipe.attach_layer("reader")
        os.write(handle.slave, b"x" * 1000)
        await wait_until_async(lambda: not pipe.reading and pipe.outbox_chars >= 50, timeout=TIMEOUT, interval=0.01,
                               what="the PTY left unread")
        held = (pipe.sent, len(frames))
        pipe.ack("reader", pipe.sent, pipe.frames)  # its websocket took it all: on with the rest
        while pipe.sent < 1000:
            acked = pipe.sent
            await wait_until_async(lambda: pipe.sent - acked >= 100 or pipe.sent >= 1000, timeout=TIMEOUT,
                                   interval=0.01, what="the next window")
            pipe.ack("reader", pipe.sent, pipe.frames)
        return held

    sent, count = run(scenario, reader_window_chars=100, reader_window_frames=1000, frame_chars=10, outbox_high=50,
                      outbox_low=20, reader_stall_s=60.0)
    assert 100 <= sent <= 100 + 10 and count == sent // 10  # a window, and a frame past it at most


def test_frames_carry_their_end_offset_and_number_and_the_output_arrives_whole_and_in_order():
    async def scenario(pipe, handle, frames):
        os.write(handle.slave, "é".encode() * 300)  # 600 bytes: 300 characters in 64-character frames
        await wait_until_async(lambda: pipe.sent >= 300, timeout=TIMEOUT, interval=0.01, what="the output sent")
        return list(frames)

    frames = run(scenario, frame_chars=64)
    assert text_of(frames) == "é" * 300
    assert [f["n"] for f in frames] == list(range(1, len(frames) + 1))
    ends = [f["offset"] for f in frames]
    assert ends == sorted(ends) and ends[-1] == 300 and all(len(f["data"]) <= 64 for f in frames)


def test_a_reader_that_acknowledges_nothing_for_the_stall_time_stops_counting(caplog):
    async def scenario(pipe, handle, frames):
        pipe.attach_layer("gone")
        os.write(handle.slave, b"y" * 500)
        await wait_until_async(lambda: pipe.sent >= 500, timeout=TIMEOUT, interval=0.01, what="the output past the stall")
        return dict(pipe.readers)

    with caplog.at_level(logging.WARNING, logger="agent.terminal_pipe"):
        readers = run(scenario, reader_window_chars=100, frame_chars=10, outbox_high=50, outbox_low=20, reader_stall_s=0.2)
    assert readers == {}
    assert "acknowledged nothing for 0 s; not waiting for it" in caplog.text


def test_output_past_the_rate_cap_leaves_the_pty_unread_until_the_bucket_refills():
    async def scenario(pipe, handle, frames):
        os.write(handle.slave, b"z" * 5000)
        await wait_until_async(lambda: pipe.throttled, timeout=TIMEOUT, interval=0.001, what="the bucket spent")
        throttled_reading = pipe.reading
        await wait_until_async(lambda: pipe.sent >= 5000, timeout=TIMEOUT, interval=0.01, what="the rest, later")
        return throttled_reading

    assert run(scenario, capped=lambda now: True, output_rate_bytes=100_000, output_burst_bytes=1000) is False


def test_input_past_the_buffer_is_refused_and_the_terminal_says_so_without_reaching_the_log():
    logged: list[str] = []

    async def scenario(pipe, handle, frames):
        pipe.on_log = logged.append
        pipe.write_input(b"y" * 6)  # the program does not read: it waits in the buffer
        pipe.write_input(b"z" * 6)  # 12 > 8: refused
        await wait_until_async(lambda: "input dropped" in text_of(frames), timeout=TIMEOUT, interval=0.01,
                               what="the refusal")
        return bytes(pipe.inbox)

    assert run(scenario, handle=BlockedHandle(), input_buffer_bytes=8) == b"y" * 6
    assert logged == []


def test_a_direct_reader_gets_the_scrollback_up_to_the_last_frame_sent_then_the_frames_and_the_exit():
    class Stream:
        def __init__(self) -> None:
            self.lines: list[dict] = []
            self.closed = False

        def write(self, line: bytes) -> None:
            self.lines.append(json.loads(line))

        def close(self) -> None:
            self.closed = True

    async def scenario(pipe, handle, frames):
        os.write(handle.slave, b"before ")
        await wait_until_async(lambda: pipe.sent >= 7, timeout=TIMEOUT, interval=0.01, what="the first output")
        stream = Stream()
        pipe.attach_direct("direct", stream)
        os.write(handle.slave, b"after")
        await wait_until_async(lambda: pipe.sent >= 12, timeout=TIMEOUT, interval=0.01, what="the second output")
        pipe.exit_direct(3)
        return stream

    stream = run(scenario)
    kinds = [line["type"] for line in stream.lines]
    assert kinds[0] == DIRECT_OK
    assert stream.lines[1] == {"type": "terminal.output", "data": "before "}
    assert "".join(line["data"] for line in stream.lines[2:-1]) == "after"
    assert stream.lines[-1] == {"type": "terminal.exit", "code": 3} and stream.closed


def test_the_output_cap_holds_a_session_nobody_reads_or_while_another_outputs_or_one_starts():
    cap = OutputCap()
    assert cap.capped("a", 0.0, read=False, starting=False)  # nobody reads it
    cap.busy.clear()
    assert not cap.capped("a", 0.0, read=True, starting=False)  # read, alone
    assert cap.capped("a", 0.1, read=True, starting=True)  # a session starts
    assert cap.capped("b", 0.2, read=True, starting=False)  # "a" output 0.2 s ago
    assert not cap.capped("b", 5.0, read=True, starting=False)  # "a" quiet for longer than BUSY_S: forgotten


def test_full_reads_of_the_pty_are_read_on_at_once_up_to_the_read_chunk_and_a_short_one_alone():
    class ScriptedHandle(PtyHandle):
        """Reads give `script`'s chunks first (as a PTY gives its line discipline's 4 KiB at most),
        then the real PTY's bytes; the test's one byte on the PTY makes the loop call the pipe."""

        def __init__(self, script: list[bytes]) -> None:
            super().__init__()
            self.script = [bytearray(chunk) for chunk in script]

        def read(self, size: int) -> bytes:
            if not self.script:
                return os.read(self.fd, size)
            chunk = self.script[0]
            data = bytes(chunk[:size])
            del chunk[:size]
            if not chunk:
                self.script.pop(0)
            return data

    logged: list[str] = []

    async def scenario(pipe, handle, frames):
        pipe.on_log = logged.append
        os.write(handle.slave, b"!")
        await wait_until_async(lambda: pipe.sent >= 80_011, timeout=TIMEOUT, interval=0.01, what="the output sent")
        return text_of(frames)

    text = run(scenario, handle=ScriptedHandle([b"e" * 10] + [b"x" * 4000] * 20))
    assert text == "e" * 10 + "x" * 80_000 + "!"
    # the echo-sized read alone; then full reads taken on to READ_CHUNK (64 KiB); then the rest and the PTY's byte
    assert [len(piece) for piece in logged] == [10, 65_536, 80_000 - 65_536 + 1]


def test_a_keystrokes_echo_goes_to_direct_readers_from_the_read_itself_and_later_frames_number_on():
    class Stream:
        def __init__(self) -> None:
            self.lines: list[dict] = []

        def write(self, line: bytes) -> None:
            self.lines.append(json.loads(line))

        def close(self) -> None:
            pass

    async def scenario(pipe, handle, frames):
        stream = Stream()
        pipe.attach_direct("direct", stream)
        await wait_until_async(lambda: pipe.pump_idle, timeout=TIMEOUT, interval=0.01, what="the pump to wait")
        os.write(handle.slave, b"a")
        assert select.select([handle.fd], [], [], TIMEOUT)[0], "the PTY did not become readable"
        pipe.on_readable()  # the loop does not turn between the read and the frame: the pump cannot have sent it
        at_once = list(stream.lines[2:])
        os.write(handle.slave, b"bc")
        await wait_until_async(lambda: pipe.sent >= 3, timeout=TIMEOUT, interval=0.01, what="the next output")
        await wait_until_async(lambda: len(stream.lines) >= 4, timeout=TIMEOUT, interval=0.01, what="its frame")
        return at_once, stream.lines[2:], frames

    at_once, lines, frames = run(scenario)
    assert at_once == [{"type": "terminal.output", "data": "a", "offset": 1, "n": 1}]
    assert lines[1] == {"type": "terminal.output", "data": "bc", "offset": 3, "n": 2}
    assert frames == []  # no reader over the layer: nothing sent there
