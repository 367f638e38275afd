"""End-to-end flow control of a terminal's output in the agent (agent.core, READER_WINDOW_CHARS):
a terminal that attached is sent at most a window past what it acknowledged (`pty.ack`), its
session's program waits meanwhile, and nothing is lost; a terminal that closes (`pty.detach`) or
stops acknowledging for READER_STALL_S holds nothing back. And where the output rate cap holds."""
from __future__ import annotations

import asyncio
import json

from agent.terminal_pipe import FRAME_CHARS, READER_WINDOW_CHARS, READER_WINDOW_FRAMES, FlowLimits
from agent import direct as agent_direct
from protocol.terminal_stream import DIRECT_OFFER, LINE_LIMIT, encode
from tests.conftest import wait_until_async
from tests.test_agent_runtime import Harness, run_agent, start_spec

LINES = 400_000  # about 3 MB through the PTY: more than the window
EXPECTED = "".join(f"{i}\r\n" for i in range(1, LINES + 1))
GO = {"type": "pty.input", "data": "go\n"}  # the line start_seq's session waits for


async def attach(h: Harness, session_id: str) -> str:
    """A reader's channel in the terminal group that attached, as a terminal consumer does."""
    channel = await h.watch_terminal(session_id)
    await h.to_pty(session_id, {"type": "pty.attach", "reply_channel": channel})
    return channel


async def frames_until_quiet(h: Harness, channel: str, *, quiet_s: float = 0.5) -> list[dict]:
    """The output frames that arrive before none has come for `quiet_s` (the scrollback left out)."""
    frames = []
    while True:
        try:
            message = await asyncio.wait_for(h.layer.receive(channel), quiet_s)
        except TimeoutError:
            return frames
        if message["type"] == "terminal.output" and "offset" in message:
            frames.append(message)


async def read_to_the_end(h: Harness, channel: str, frames: list[dict], *, ack: bool) -> str:
    """Read frames (acknowledging each when `ack`) until the seq's output is complete; the text
    from its first line on."""
    text = "".join(f["data"] for f in frames)
    async with asyncio.timeout(60):
        while "\r\n" + str(LINES) + "\r\n" not in text:
            message = await h.layer.receive(channel)
            if message["type"] == "terminal.output" and "offset" in message:
                frames.append(message)
                text += message["data"]
                if ack:
                    await h.to_pty(h.session_id, {"type": "pty.ack", "channel": channel, "offset": message["offset"],
                                                   "n": message["n"]})
    return text[text.index("1\r\n2\r\n"):text.index("\r\n" + str(LINES) + "\r\n") + len(str(LINES)) + 4]


def start_seq(h: Harness):
    """A session whose seq starts only when a line is typed (`go`), once its readers attached: a
    loaded machine's slow attach can no longer leave the first lines in the scrollback."""
    spec = start_spec(command=f"read -r go; seq 1 {LINES}; sleep 30")
    h.session_id = spec["session_id"]
    return spec


def test_a_reader_is_sent_at_most_a_window_past_its_acknowledgement_and_then_everything_in_order(tmp_path):
    async def scenario(h: Harness):
        spec = start_seq(h)
        channel = await h.watch_terminal(spec["session_id"])
        await h.start_session(spec)
        await h.to_pty(spec["session_id"], {"type": "pty.attach", "reply_channel": channel})
        await h.to_pty(spec["session_id"], GO)
        held = await frames_until_quiet(h, channel)
        running = h.agent.sessions[spec["session_id"]]
        assert not running.pipe.reading  # the PTY is left unread: seq waits
        last = held[-1]
        await h.to_pty(spec["session_id"], {"type": "pty.ack", "channel": channel, "offset": last["offset"],
                                             "n": last["n"]})
        return held, await read_to_the_end(h, channel, list(held), ack=True)

    held, text = run_agent(tmp_path, scenario)
    sent = held[-1]["offset"] - held[0]["offset"] + len(held[0]["data"])
    assert len(held) <= READER_WINDOW_FRAMES + 1
    assert sent <= READER_WINDOW_CHARS + FRAME_CHARS
    assert text == EXPECTED


def test_a_reader_that_closes_or_stops_acknowledging_holds_the_session_back_no_longer(tmp_path):

    async def scenario(h: Harness):
        spec = start_seq(h)
        channels = [await h.watch_terminal(spec["session_id"]) for _ in range(3)]
        await h.start_session(spec)
        gone, closing, reader = channels  # acknowledges nothing; closes; reads and acknowledges
        for channel in channels:
            await h.to_pty(spec["session_id"], {"type": "pty.attach", "reply_channel": channel})
        await h.to_pty(spec["session_id"], GO)
        await frames_until_quiet(h, closing, quiet_s=0.3)  # the window is spent: all three hold it
        await h.to_pty(spec["session_id"], {"type": "pty.detach", "channel": closing})
        return await read_to_the_end(h, reader, [], ack=True)

    text = run_agent(tmp_path, scenario, flow=FlowLimits(reader_stall_s=1.0))
    assert text == EXPECTED


def test_the_output_rate_cap_holds_only_output_nobody_reads_or_next_to_other_work(tmp_path):
    async def scenario(h: Harness):
        quiet, other = start_spec(command="sleep 30"), start_spec(command="sleep 30")
        await h.start_session(quiet)
        await h.start_session(other)
        running, loop = h.agent.sessions[quiet["session_id"]], asyncio.get_running_loop()
        h.agent.output_cap.busy.clear()
        verdicts = {"nobody reads": h.agent._output_capped(running, loop.time())}
        await attach(h, quiet["session_id"])
        await wait_until_async(lambda: running.pipe.readers, timeout=10, interval=0.01, what="the terminal's reader")
        h.agent.output_cap.busy.clear()
        verdicts["read, alone"] = h.agent._output_capped(running, loop.time())
        h.agent.output_cap.busy[other["session_id"]] = loop.time()
        verdicts["read, another session outputs"] = h.agent._output_capped(running, loop.time())
        h.agent.output_cap.busy.clear()
        h.agent._starting.add("a-session-starting")
        verdicts["read, a session starts"] = h.agent._output_capped(running, loop.time())
        h.agent._starting.discard("a-session-starting")
        return verdicts

    assert run_agent(tmp_path, scenario) == {"nobody reads": True, "read, alone": False,
                                             "read, another session outputs": True, "read, a session starts": True}


# --- the same over a direct stream (agent.direct, protocol.terminal_stream) -------------------------------------

async def direct_reader(h: Harness, session_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A reader of the session on a direct stream, as a terminal consumer connects one: attach asking
    for it over the layer, connect to the offered address, present the token, read `direct.ok`."""
    channel = await h.watch_terminal(session_id)
    await h.to_pty(session_id, {"type": "pty.attach", "reply_channel": channel, "direct": True})
    offer = await h.receive_type(channel, DIRECT_OFFER, timeout=10)  # output the group got first is skipped
    assert offer["host"] == "127.0.0.1", offer
    reader, writer = await asyncio.open_connection(offer["host"], offer["port"], limit=LINE_LIMIT)
    writer.write(encode({"token": offer["token"]}))
    assert json.loads(await reader.readline()) == {"type": "direct.ok"}
    return reader, writer


async def direct_frames_until_quiet(reader: asyncio.StreamReader, *, quiet_s: float = 0.5) -> list[dict]:
    frames = []
    while True:
        try:
            line = await asyncio.wait_for(reader.readline(), quiet_s)
        except TimeoutError:
            return frames
        message = json.loads(line)
        if message["type"] == "terminal.output" and "offset" in message:
            frames.append(message)


def test_a_direct_reader_is_written_at_most_a_window_past_its_acknowledgement_and_then_everything_in_order(tmp_path):
    async def scenario(h: Harness):
        spec = start_seq(h)
        await h.start_session(spec)
        reader, writer = await direct_reader(h, spec["session_id"])
        writer.write(encode(GO))
        held = await direct_frames_until_quiet(reader)
        running = h.agent.sessions[spec["session_id"]]
        assert not running.pipe.reading and not running.pipe.layer_channels  # seq waits; the group is not sent to
        frames, text = list(held), "".join(f["data"] for f in held)
        async with asyncio.timeout(60):
            while "\r\n" + str(LINES) + "\r\n" not in text:
                last = frames[-1]
                writer.write(encode({"type": "pty.ack", "offset": last["offset"], "n": last["n"]}))
                message = json.loads(await reader.readline())
                assert message["type"] == "terminal.output" and "offset" in message, message
                frames.append(message)
                text += message["data"]
        writer.close()
        start = text.index("1\r\n2\r\n")
        return held, text[start:text.index("\r\n" + str(LINES) + "\r\n") + len(str(LINES)) + 4]

    held, text = run_agent(tmp_path, scenario, terminal_direct=True)
    sent = held[-1]["offset"] - held[0]["offset"] + len(held[0]["data"])
    assert len(held) <= READER_WINDOW_FRAMES + 1
    assert sent <= READER_WINDOW_CHARS + FRAME_CHARS
    assert text == EXPECTED


def test_an_expired_token_is_refused_and_the_terminal_can_still_attach_over_the_layer(tmp_path, monkeypatch):
    monkeypatch.setattr(agent_direct, "TOKEN_TTL_S", -1.0)  # expired as soon as it is offered

    async def scenario(h: Harness):
        spec = start_spec(command="echo READY; sleep 30")
        await h.start_session(spec)
        channel = await h.watch_terminal(spec["session_id"])
        await h.to_pty(spec["session_id"], {"type": "pty.attach", "reply_channel": channel, "direct": True})
        offer = await h.receive_type(channel, DIRECT_OFFER, timeout=10)  # READY may come first, to the group
        reader, writer = await asyncio.open_connection(offer["host"], offer["port"])
        writer.write(encode({"token": offer["token"]}))
        answer = json.loads(await reader.readline())
        closed = await reader.read() == b""
        writer.close()
        await h.to_pty(spec["session_id"], {"type": "pty.attach", "reply_channel": channel})
        return answer, closed, await h.read_until(channel, "READY")

    answer, closed, scrollback = run_agent(tmp_path, scenario, terminal_direct=True)
    assert answer == {"type": "direct.refused", "detail": "expired token"} and closed
    assert "READY" in scrollback
