"""The terminal websocket (`/ws/sessions/<id>/terminal/?ticket=…`) from the command line.

Frames (DESIGN.md): client → `{"type": "input", "data"}`, `{"type": "resize", "cols", "rows"}`;
server → `{"type": "output", "data"}`, `{"type": "exit", "code"}`. On connect the node's agent
first sends the session's scrollback, then live output.

- `logs`: prints the scrollback (and, with follow, live output) — never sends input.
- `exec`: types one wrapped command line into the session's shell: the terminal's echo and
  NL→CRNL mapping are switched off (and restored after), the command runs in a subshell with
  stdin from /dev/null, and its output is delimited by markers that carry a random nonce, so
  only the command's own output is printed and its exit status is read back. The markers are
  built by printf at run time, so the echoed command line never contains them.
- `interactive`: the local TTY in raw mode ↔ the session's PTY, SIGWINCH → resize frames;
  Ctrl-] detaches (the session keeps running).
"""
from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import os
import re
import secrets
import shlex
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


# --- exec: wrapping and reading back ------------------------------------------------------

def exec_command_text(argv: list[str]) -> str:
    """One argument is a shell command line (`fgpu exec S -- 'nvidia-smi | head'`); several are
    an argument vector, quoted for the shell (`fgpu exec S -- sh -c 'exit 3'`)."""
    if len(argv) == 1:
        return argv[0]
    return shlex.join(argv)


def exec_line(command: str, nonce: str) -> str:
    """The line typed into the session's shell (ends with CR, as the Enter key sends). It starts
    with Ctrl-E Ctrl-U, which clears whatever someone had half typed at the prompt (readline
    keeps it for Ctrl-Y; without readline the terminal's own line kill drops it)."""
    return (f"\x05\x15 __fgpu_tty=$(stty -g 2>/dev/null); stty -echo -onlcr 2>/dev/null;"
            f" printf '\\n__FGPU_BEGIN_%s__\\n' {nonce};"
            f" ( eval {shlex.quote(command)} ) </dev/null;"
            f" printf '__FGPU_END_%s__ %d\\n' {nonce} $?;"
            f" stty \"$__fgpu_tty\" 2>/dev/null\r")


def exec_recovery_line(nonce: str, code: int = 130) -> str:
    """After Ctrl-C an interactive shell abandons the rest of the line: restore the terminal
    settings and print the end marker. (If the command survived the interrupt, the shell runs
    this after the first line, when nobody reads it any more.)"""
    return (f" stty \"$__fgpu_tty\" 2>/dev/null; printf '__FGPU_END_%s__ %d\\n' {nonce} {code}\r")


class ExecParser:
    """Feed output frames; returns the command's output between the markers, streaming.
    `done` and `code` once the end marker arrived."""

    def __init__(self, nonce: str) -> None:
        self.begin = f"__FGPU_BEGIN_{nonce}__"
        self.end_marker = f"__FGPU_END_{nonce}__ "
        self.end_re = re.compile(rf"__FGPU_END_{re.escape(nonce)}__ (\d+)\r?\n")
        self.tail_re = re.compile(rf"__FGPU_END_{re.escape(nonce)}__ \d*\r?$")
        self.started = False
        self.interrupted = False  # after Ctrl-C: only wait for the end marker (the rest is the shell's)
        self.done = False
        self.code: int | None = None
        self.buffer = ""

    def feed(self, data: str) -> str:
        if self.done:
            return ""
        self.buffer += data
        if not self.started:
            i = self.buffer.find(self.begin)
            if i < 0:
                self.buffer = self.buffer[-len(self.begin):]  # the marker may be split over frames
                return ""
            j = self.buffer.find("\n", i + len(self.begin))
            if j < 0:
                return ""
            self.buffer = self.buffer[j + 1:]
            self.started = True
        match = self.end_re.search(self.buffer)
        if match:
            out = "" if self.interrupted else self.buffer[:match.start()]
            self.code, self.done, self.buffer = int(match.group(1)), True, ""
            return out
        keep = self._undecided_tail()
        if self.interrupted:
            keep = min(len(self.buffer), len(self.end_marker) + 24)
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return ""
        out, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return out

    def _undecided_tail(self) -> int:
        """How many trailing characters may still turn out to be the end marker (which follows
        the command's output directly: its last byte, a newline or not, is the command's)."""
        match = self.tail_re.search(self.buffer)
        if match:
            return len(self.buffer) - match.start()
        for n in range(min(len(self.buffer), len(self.end_marker)), 0, -1):
            if self.buffer.endswith(self.end_marker[:n]):
                return n
        return 0

    def interrupt(self) -> str:
        """From now on only the end marker matters; returns the output held back so far."""
        self.interrupted = True
        out, self.buffer = (self.buffer if self.started else ""), ""
        return out

    def flush(self) -> str:
        out, self.buffer = (self.buffer if self.started and not self.interrupted else ""), ""
        return out


# --- the websocket --------------------------------------------------------------------------

def _closed_reason(exc) -> str:
    frame = getattr(exc, "rcvd", None)
    code = getattr(frame, "code", None)
    if code in CLOSE_REASONS:
        return CLOSE_REASONS[code]
    return f"the terminal connection closed ({code or 'no close frame'})"


@contextlib.asynccontextmanager
async def _connect(url: str):
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


async def logs(url: str, *, follow: bool, stdout=None, stderr=None) -> int:
    """Print the scrollback; with `follow`, then live output until the session exits."""
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    plain = not stdout.isatty()
    async with _connect(url) as ws:
        frames = _frames(ws)
        try:
            first = await asyncio.wait_for(anext(frames), FIRST_FRAME_TIMEOUT)
        except StopAsyncIteration:
            raise TerminalError("the terminal closed before sending any output") from None
        except asyncio.TimeoutError:
            raise TerminalError(f"no answer from the session's node within {FIRST_FRAME_TIMEOUT:g} s") from None
        pending = [first]
        while True:
            for frame in pending:
                if frame.get("type") == "output":
                    text = frame.get("data", "")
                    _write(stdout, text.replace("\r\n", "\n") if plain else text)
                    if not follow:
                        return 0
                elif frame.get("type") == "exit":
                    if follow:
                        stderr.write(f"fgpu: the session exited with code {frame.get('code')}\n")
                    return 0
            try:
                pending = [await anext(frames)]
            except StopAsyncIteration:
                return 0


async def execute(url: str, command: str, *, stdout=None, stderr=None) -> int:
    """Run `command` in the session's shell; stream its output; return its exit status.
    Ctrl-C interrupts the remote command (exit 130); a second Ctrl-C gives up at once."""
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    nonce = secrets.token_hex(8)
    parser = ExecParser(nonce)
    loop = asyncio.get_running_loop()
    interrupts = 0
    main = asyncio.current_task()
    async with _connect(url) as ws:

        def on_interrupt():
            nonlocal interrupts
            interrupts += 1
            if interrupts == 1 and parser.started:
                stderr.write("\nfgpu: interrupting the command (Ctrl-C again to give up)\n")
                held = parser.interrupt()
                if held:
                    _write(stdout, held)
                asyncio.ensure_future(ws.send(json.dumps(
                    {"type": "input", "data": "\x03" + exec_recovery_line(nonce)})))
            else:
                if not parser.started:
                    asyncio.ensure_future(ws.send(json.dumps({"type": "input", "data": "\x03"})))
                main.cancel()

        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGINT, on_interrupt)
        try:
            await ws.send(json.dumps({"type": "input", "data": exec_line(command, nonce)}))
            async for frame in _frames(ws):
                if frame.get("type") == "output":
                    text = parser.feed(frame.get("data", ""))
                    if text:
                        _write(stdout, text)
                    if parser.done:
                        return parser.code
                elif frame.get("type") == "exit":
                    rest = parser.flush()
                    if rest:
                        _write(stdout, rest)
                    return int(frame.get("code") or 0)
        except asyncio.CancelledError:
            await asyncio.sleep(0.1)  # let the interrupt reach the session
            return 130
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGINT)
    raise TerminalError("the terminal closed before the command finished")


async def interactive(url: str, *, stdin=None, stdout=None, stderr=None) -> int:
    """The local terminal ↔ the session's PTY until the session exits, the connection closes
    or Ctrl-] detaches. Returns the session's exit code (0 on detach)."""
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
                done, _ = await asyncio.wait({output, typing} - {t for t in (typing,) if t.done()},
                                             return_when=asyncio.FIRST_COMPLETED)
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
