"""The floor for benchmarks/terminal.py: the least a Python PTY ↔ websocket relay can do.

    python benchmarks/terminal_relay.py PORT [SHELL ...]

One shell per websocket connection, on a PTY; the same JSON frames as the console's terminal
(client → `{"type": "input", "data"}`, `{"type": "resize", "cols", "rows"}`; server →
`{"type": "output", "data"}`). The PTY is read only while the websocket has taken the last
frame (`await ws.send` waits for the socket's buffer to drain), so a slow reader loses nothing.
"""

import asyncio
import codecs
import fcntl
import json
import os
import pty
import struct
import sys
import termios

from websockets.asyncio.server import serve

SHELL = sys.argv[2:] or ["bash", "--noprofile", "--norc", "-i"]


async def relay(ws) -> None:
    pid, fd = pty.fork()
    if pid == 0:
        os.execvpe(SHELL[0], SHELL, {**os.environ, "TERM": "xterm-256color", "PS1": "relay$ "})
    os.set_blocking(fd, False)
    loop = asyncio.get_running_loop()
    decoder = codecs.getincrementaldecoder("utf-8")("replace")

    async def pty_to_ws() -> None:
        while True:
            ready = loop.create_future()
            loop.add_reader(fd, ready.set_result, None)
            try:
                await ready
            finally:
                loop.remove_reader(fd)
            try:
                data = os.read(fd, 65536)
            except OSError:  # EIO: the shell exited
                return
            if not data:
                return
            await ws.send(json.dumps({"type": "output", "data": decoder.decode(data)}))

    reader = asyncio.create_task(pty_to_ws())
    try:
        async for message in ws:
            frame = json.loads(message)
            if frame.get("type") == "input":
                data = frame["data"].encode()
                while data:
                    try:
                        data = data[os.write(fd, data) :]
                    except BlockingIOError:
                        await asyncio.sleep(0.001)
            elif frame.get("type") == "resize":
                fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", frame["rows"], frame["cols"], 0, 0))
    finally:
        reader.cancel()
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(fd)


async def main(port: int) -> None:
    async with serve(relay, "127.0.0.1", port, max_size=2**24, compression=None):
        await asyncio.Future()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
