"""The agent's side of streamed exec: run a command beside a session's process and push its
output to the exec store (protocol.exec_store) as it comes, until it exits, runs past its
timeout, or someone cancels it.

The web writes the exec's record (`starting`) and sends `pty.exec_stream` to the session's
`pty.<node>.<id>` group; the agent hands it to `start`, which runs the command on a thread of its own
(a streamed command may run for minutes: it must not hold the agent's event loop or its thread
pool). That thread claims the record (`starting` → `running`, so a command cancelled or given
up on before the agent took it never starts), starts the command in its own process session
with the session's environment and working directory, stdin from /dev/null, reads stdout and
stderr on two more threads, and appends what they read in order, adjacent pieces of one stream
coalesced (at most CHUNK_BYTES a chunk). A cancel is the record's `cancel` flag, which the
thread checks every CANCEL_POLL_S: it sends SIGTERM to every process of the command's session,
then SIGKILL after CANCEL_GRACE_S. The timeout kills with SIGKILL at once (as the blocking exec
does). The final state, exit code (128+N when killed by signal N) and duration are written only
after the last output is in, so a reader that sees `running` false has all of it.
"""

from __future__ import annotations

import codecs
import logging
import os
import queue
import shutil
import signal
import subprocess
import threading
import time

from protocol.exec_store import STDERR, STDOUT, record_id

log = logging.getLogger(__name__)

READ_BYTES = 64 * 1024  # one read of a pipe
CHUNK_BYTES = 64 * 1024  # the most text (UTF-8 bytes, about) coalesced into one stored chunk
CANCEL_POLL_S = 0.2  # how often the record's cancel flag is read
CANCEL_GRACE_S = 2.0  # SIGTERM, then SIGKILL after this
PIPE_GRACE_S = 1.0  # after the command ended, how long a pipe something escaped with may stay open
FINAL_TTL_S = 3600  # default; the web passes its FGPU_EXEC_OUTPUT_TTL in the message


def start(agent, running, message: dict) -> threading.Thread:
    """Run the streamed exec `message` (`{"exec_id", "argv", "timeout", "ttl"}`: argv a list, or
    one string run by bash -c; timeout and ttl in seconds) in session `running` of `agent` on a
    new daemon thread; returns the thread."""
    thread = threading.Thread(
        target=_run_logged, args=(agent, running, message), name=f"exec-{message.get('exec_id', '?')[:8]}", daemon=True
    )
    thread.start()
    return thread


def _run_logged(agent, running, message: dict) -> None:
    # The record of this node's exec (protocol.exec_store.record_id): never one of another node's.
    stored = {**message, "exec_id": record_id(agent.node, str(message["exec_id"]))}
    try:
        run(agent.exec_store, running, stored, shell=agent.runtime.shell())
    except Exception:
        log.exception("agent %s: streamed exec %s in session %s failed", agent.node, message.get("exec_id"), running.session_id)


def run(store, running, message: dict, *, shell: str | None = None) -> None:
    """Blocking: the whole life of one streamed exec (see the module docstring). `store` is an
    exec store, `running` the agent's RunningSession (its `process` handle, `execs`, `stopping`);
    `shell` runs a command given as one string (default: the node's bash)."""
    shell = shell or shutil.which("bash") or "/bin/sh"
    exec_id, timeout = message["exec_id"], float(message["timeout"])
    final_ttl = int(message.get("ttl") or FINAL_TTL_S)
    argv = message["argv"]
    if isinstance(argv, str):
        argv = [shell, "-c", argv]
    started = time.monotonic()
    if not store.transition(
        exec_id, from_states=("starting",), fields={"state": "running", "started_ms": str(int(time.time() * 1000))}
    ):
        return  # cancelled, given up on, or expired before this agent took it

    def finish(state: str, *, exit_code: int | None = None, error: str = "") -> None:
        fields = {"state": state, "duration_ms": str(int((time.monotonic() - started) * 1000)), "error": error}
        if exit_code is not None:
            fields["exit_code"] = str(exit_code)
        store.transition(exec_id, from_states=("running",), fields=fields, ttl_s=final_ttl)

    try:
        process = running.process.exec_popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except (FileNotFoundError, PermissionError) as exc:  # as a shell answers: 127 not found, 126 not executable
        store.append(exec_id, [(STDERR, f"{argv[0]}: {exc.strerror}\n")])
        finish("exited", exit_code=127 if isinstance(exc, FileNotFoundError) else 126)
        return
    except Exception as exc:
        finish("failed", error=f"could not run the command: {exc}")
        return
    running.execs.add(process)
    pieces: queue.Queue = queue.Queue()
    for pipe, stream in ((process.stdout, STDOUT), (process.stderr, STDERR)):
        threading.Thread(target=_read_pipe, args=(pipe, stream, pieces), daemon=True, name=f"exec-{exec_id[:8]}-{stream}").start()
    shipper = _Shipper(store, exec_id)
    outcome, killed_at, ended_at, next_poll = "", 0.0, None, 0.0  # killed_at: set with outcome "cancelled"
    try:
        while shipper.open_streams or process.poll() is None:
            shipper.ship(pieces, wait=0.05)
            now = time.monotonic()
            if process.poll() is not None:
                if ended_at is None:  # what it left running in the background goes with it
                    ended_at = now
                    running.process.signal_exec(process, signal.SIGKILL)
                elif now - ended_at > PIPE_GRACE_S:
                    break  # a process that left the session holds a pipe: stop reading it
            elif not outcome and now - started >= timeout:
                outcome = "timed_out"
                running.process.signal_exec(process, signal.SIGKILL)
            elif not outcome and now >= next_poll:
                next_poll = now + CANCEL_POLL_S
                record = store.get(exec_id) or {}
                if record.get("cancel") == "1":
                    outcome, killed_at = "cancelled", now
                    running.process.signal_exec(process, signal.SIGTERM)
            elif outcome == "cancelled" and now - killed_at >= CANCEL_GRACE_S:
                running.process.signal_exec(process, signal.SIGKILL)
        code = process.wait()
    finally:
        running.process.signal_exec(process, signal.SIGKILL)
        running.execs.discard(process)
    shipper.ship(pieces, wait=0)
    exit_code = code if code >= 0 else 128 - code
    error = f"killed: the session is ending ({running.stopping})" if running.stopping and not outcome else ""
    finish(outcome or "exited", exit_code=exit_code, error=error)


class _Shipper:
    """Moves what the pipe readers queued into the store, coalescing adjacent pieces of one
    stream; drops the output of streams the store says are full. `open_streams` counts the
    pipes not at their end yet."""

    def __init__(self, store, exec_id: str) -> None:
        self.store, self.exec_id = store, exec_id
        self.open_streams = 2
        self.full: set[str] = set()

    def ship(self, pieces: queue.Queue, *, wait: float) -> None:
        taken = []
        try:
            taken.append(pieces.get(timeout=wait) if wait else pieces.get_nowait())
            while len(taken) < 1024:
                taken.append(pieces.get_nowait())
        except queue.Empty:
            pass
        chunks: list[list] = []
        for stream, text in taken:
            if text is None:
                self.open_streams -= 1
            elif stream not in self.full:
                if chunks and chunks[-1][0] == stream and len(chunks[-1][1]) + len(text) <= CHUNK_BYTES:
                    chunks[-1][1] += text
                else:
                    chunks.append([stream, text])
        if not chunks:
            return
        try:
            full = self.store.append(self.exec_id, [(stream, text) for stream, text in chunks])
        except Exception:
            log.warning("could not store output of exec %s; dropped", self.exec_id, exc_info=True)
            return
        self.full |= full or set()


def _read_pipe(pipe, stream: str, pieces: queue.Queue) -> None:
    """Read `pipe` to its end, queueing `(stream, text)` (UTF-8, bad bytes replaced; a character
    split across reads is kept whole), then `(stream, None)`."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    try:
        while True:
            data = os.read(pipe.fileno(), READ_BYTES)
            if not data:
                break
            text = decoder.decode(data)
            if text:
                pieces.put((stream, text))
    except OSError:
        pass
    finally:
        tail = decoder.decode(b"", final=True)
        if tail:
            pieces.put((stream, tail))
        pieces.put((stream, None))
        pipe.close()
