"""The terminal websocket (`/ws/sessions/<id>/terminal/?ticket=…`) from the command line.

Frames (DESIGN.md): client → `{"type": "input", "data"}`, `{"type": "resize", "cols", "rows"}`;
server → `{"type": "output", "data"}`, `{"type": "exit", "code"}`. On connect the node's agent
first sends the session's scrollback, then live output. (`fgpu logs` and `fgpu exec` use the
REST API: `/sessions/<id>/logs/` and `/sessions/<id>/exec/`.)

- `interactive`: the local TTY in raw mode ↔ the session's PTY, SIGWINCH → resize frames;
  Ctrl-] detaches (the session keeps running).
"""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import signal
import sys

DETACH = b"\x1d"  # Ctrl-]
FIRST_FRAME_TIMEOUT = 15.0
CLOSE_REASONS = {
    4403: "the terminal refused the ticket (wrong, expired or already used)",
    4409: "the session is not running",
    4401: "not authenticated",
}


class TerminalError(Exception):
    """The terminal could not be opened or closed early (exit 1)."""


class TerminalUnreachable(Exception):
    """No websocket connection to the server (exit 3)."""


def _closed_reason(exc) -> str:
    frame = getattr(exc, "rcvd", None)
    code = getattr(frame, "code", None)
    if code in CLOSE_REASONS:
        return CLOSE_REASONS[code]
    return f"the terminal connection closed ({code or 'no close frame'})"


@contextlib.asynccontextmanager
async def _connect(url: str):
    import asyncio  # here, not at the top: `fgpu --help` and the REST commands start without it
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidHandshake, InvalidStatus, InvalidURI

    try:
        ws = await connect(url, open_timeout=15, max_size=None, compression=None)
    except InvalidStatus as exc:
        status = getattr(getattr(exc, "response", None), "status_code", "?")
        raise TerminalError(f"the server refused the terminal websocket (HTTP {status})") from None
    except (InvalidURI, InvalidHandshake) as exc:
        raise TerminalError(f"cannot open the terminal websocket: {exc}") from None
    except (OSError, asyncio.TimeoutError) as exc:
        raise TerminalUnreachable(f"cannot reach {url.split('?', 1)[0]}: {exc or 'timed out'}") from None
    try:
        yield ws
    finally:
        await ws.close()


async def _frames(ws):
    """Decoded frames until the server closes; a refusal close code → TerminalError."""
    from websockets.exceptions import ConnectionClosedError, ConnectionClosedOK

    while True:
        try:
            message = await ws.recv()
        except ConnectionClosedOK as exc:
            code = getattr(getattr(exc, "rcvd", None), "code", None)
            if code in CLOSE_REASONS:
                raise TerminalError(CLOSE_REASONS[code]) from None
            return
        except ConnectionClosedError as exc:
            raise TerminalError(_closed_reason(exc)) from None
        try:
            frame = json.loads(message)
        except (TypeError, ValueError):
            continue
        if isinstance(frame, dict):
            yield frame


def _write(stream, text: str) -> None:
    data = text.encode("utf-8", "replace")
    buffer = getattr(stream, "buffer", None)
    if buffer is not None:
        buffer.write(data)
    else:
        stream.write(text)
    stream.flush()


async def interactive(url: str, *, stdin=None, stdout=None, stderr=None) -> int:
    """The local terminal ↔ the session's PTY until the session exits, the connection closes
    or Ctrl-] detaches. Returns the session's exit code (0 on detach)."""
    import asyncio
    import termios
    import tty

    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    in_fd, out_fd = stdin.fileno(), stdout.fileno()
    is_tty = os.isatty(in_fd)
    loop = asyncio.get_running_loop()
    async with _connect(url) as ws:
        saved = termios.tcgetattr(in_fd) if is_tty else None
        keys: asyncio.Queue = asyncio.Queue()
        decoder = codecs.getincrementaldecoder("utf-8")("replace")

        def on_stdin():
            try:
                data = os.read(in_fd, 4096)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            keys.put_nowait(data)

        def size_frame():
            try:
                cols, rows = os.get_terminal_size(out_fd if os.isatty(out_fd) else in_fd)
            except OSError:
                return None
            return json.dumps({"type": "resize", "cols": cols, "rows": rows})

        def on_winch():
            frame = size_frame()
            if frame:
                asyncio.ensure_future(ws.send(frame))

        async def pump_keys():
            while True:
                data = await keys.get()
                if not data:  # EOF on a pipe: stop sending, keep showing output
                    loop.remove_reader(in_fd)
                    return "eof"
                if DETACH in data and is_tty:
                    data = data.split(DETACH, 1)[0]
                    if data:
                        await ws.send(json.dumps({"type": "input", "data": decoder.decode(data)}))
                    return "detach"
                await ws.send(json.dumps({"type": "input", "data": decoder.decode(data)}))

        async def pump_output():
            async for frame in _frames(ws):
                if frame.get("type") == "output":
                    os.write(out_fd, frame.get("data", "").encode("utf-8", "replace"))
                elif frame.get("type") == "exit":
                    return int(frame.get("code") or 0)
            return None

        if is_tty:
            tty.setraw(in_fd)
        loop.add_reader(in_fd, on_stdin)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGWINCH, on_winch)
        output = asyncio.ensure_future(pump_output())
        typing = asyncio.ensure_future(pump_keys())
        try:
            frame = size_frame()
            if frame:
                await ws.send(frame)
            code = None
            while True:
                done, _ = await asyncio.wait(
                    {output, typing} - {t for t in (typing,) if t.done()}, return_when=asyncio.FIRST_COMPLETED
                )
                if output in done:
                    code = output.result()
                    break
                if typing in done and typing.result() == "detach":
                    stderr.write("\r\nfgpu: detached; the session keeps running\r\n")
                    code = 0
                    break
        finally:
            with contextlib.suppress(Exception):
                loop.remove_reader(in_fd)
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGWINCH)
            for task in (output, typing):
                task.cancel()
            if saved is not None:
                termios.tcsetattr(in_fd, termios.TCSADRAIN, saved)
        if code is None:
            stderr.write("fgpu: the terminal connection closed\n")
            return 1
        return code
