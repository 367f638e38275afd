"""The agent runtime: one per node. Runs sessions as PTY process groups and relays terminals.

Everything runs on one asyncio loop (the agent's own in `manage.py agent`, daphne's in
standalone mode). Celery task handlers call the thread-safe `submit_*` methods, which
schedule work on that loop and return at once. Reports to the manager go through Celery
tasks (`fgpu.manager.*`), called from a worker thread so the loop never blocks. Terminal
frames travel through the channel layer: input from group `pty-<session>` (which the agent
joins), output to group `terminal-<session>` (which terminal consumers join).

Session output is also shipped to the manager (`fgpu.manager.session_log_append`) in batches:
every LOG_FLUSH_S seconds, or sooner once LOG_BATCH_CHARS characters are waiting; each batch
carries a sequence number and its offset in the log, so a retried delivery is stored once.
Server-side exec (`pty.exec` on the same group, answered on the message's `reply_channel`)
runs a command beside the session's process, in its environment and working directory;
streamed exec (`pty.exec_stream`) runs on a thread of its own and pushes its output to the
exec store as it comes (sessions.runtime.exec_stream).
The agent never opens the database.
"""
from __future__ import annotations

import asyncio
import codecs
import fcntl
import json
import logging
import os
import pty
import shutil
import signal
import struct
import subprocess
import tempfile
import termios
import time
from dataclasses import dataclass, field
from pathlib import Path

from asgiref.sync import sync_to_async

from sessions import events
from sessions.runtime import exec_stream
from sessions.runtime import mig as mig_runtime
from sessions.runtime import nvidia_smi
from sessions.runtime.environment import allocation_document, session_environment

log = logging.getLogger(__name__)

SCROLLBACK_BYTES = 64 * 1024
READ_CHUNK = 64 * 1024
KILL_GRACE_S = 3.0
KILL_WAIT_S = 2.0  # after SIGKILL, how long TERMINATED waits for the session's processes to be gone
LOG_FLUSH_S = 0.5  # seconds between log batches while output flows
LOG_BATCH_CHARS = 64 * 1024  # ship at once when this many characters wait
LOG_CHUNK_CHARS = 256 * 1024  # the most one batch carries
LOG_BACKLOG_CHARS = 4 * 1024 * 1024  # unshipped output kept while the manager is unreachable; older is dropped
EXEC_OUTPUT_BYTES = 1024 * 1024  # stdout and stderr of an exec are each cut to this many bytes

_AGENTS: dict[str, "Agent"] = {}


class CeleryManager:
    """How an agent talks to the manager: Celery tasks on queue `manager` (blocking calls)."""

    def register(self, node: str, inventory: dict, running: list[str]) -> None:
        from sessions.tasks import agent_register

        agent_register.delay(node=node, inventory=inventory, running=running)

    def heartbeat(self, node: str, running: list[str], mig_digest: str | None = None) -> None:
        from sessions.tasks import agent_heartbeat

        agent_heartbeat.delay(node=node, running=running, mig_digest=mig_digest)

    def report(self, session_id: str, status: str, reason: str, exit_code: int | None) -> None:
        from sessions.tasks import session_report

        session_report.delay(session_id=session_id, status=status, reason=reason, exit_code=exit_code)

    def log(self, session_id: str, seq: int, offset: int, text: str, final: bool) -> None:
        from sessions.tasks import session_log_append

        session_log_append.delay(session_id=session_id, seq=seq, offset=offset, text=text, final=final)

    def mig_report(self, node: str, report: dict) -> None:
        from sessions.tasks import mig_report

        mig_report.delay(node=node, report=report)


def agent_for(node: str) -> "Agent":
    """The agent running in this process for `node`. Raises LookupError if none."""
    try:
        return _AGENTS[node]
    except KeyError:
        raise LookupError(f"no agent for node {node!r} runs in this process") from None


@dataclass
class RunningSession:
    session_id: str
    process: subprocess.Popen
    master_fd: int
    work_dir: Path
    scrollback: bytearray = field(default_factory=bytearray)
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    eof: asyncio.Event = field(default_factory=asyncio.Event)
    exited: asyncio.Task | None = None  # _wait_exit: done once the session is reported ended
    stopping: str = ""  # why the agent is killing it; empty while nobody asked
    env: dict = field(default_factory=dict)  # the session's environment, for exec
    log_pending: list = field(default_factory=list)  # decoded output not yet batched
    log_pending_chars: int = 0
    log_seq: int = 0  # sequence number of the next batch
    log_offset: int = 0  # characters batched so far: the next batch's offset
    log_unsent: tuple | None = None  # (seq, offset, text, final): a batch the manager has not taken yet
    log_wake: asyncio.Event = field(default_factory=asyncio.Event)
    log_closed: bool = False
    log_task: asyncio.Task | None = None
    execs: set = field(default_factory=set)  # Popen of commands run by exec, killed with the session


class Agent:
    """Runs one node's sessions.

    `inventory`: {"devices": [DeviceInfo dicts], "plugins", "attributes", "cpu_count",
    "memory_size"}; `manager`: an object with `register`, `heartbeat`, `report`, `log` and
    `mig_report` methods that send the manager tasks (blocking calls; the agent calls them from
    a worker thread; see CeleryManager); `exec_store`: where streamed execs keep their output
    (sessions.exec_store; None: the one this process's settings name).

    MIG (issue 4): after registering, the manager sends the expected layout of each MIG GPU
    (`submit_mig_reconcile`); the agent re-creates missing instances and reports the ones the
    manager does not know (`mig_report`), as it does when a start spec reaches a GPU first. The
    manager sends it again when an administrator changes the layout, and when a heartbeat's MIG
    layout digest (`_send_heartbeat`) differs from the one it expects.
    """

    def __init__(self, *, node: str, inventory: dict, channel_layer, manager, scratch_root: Path,
                 mock: bool, mps: bool = False, heartbeat_s: float = 5.0, exec_store=None) -> None:
        self.node = node
        self.inventory = inventory
        self.layer = channel_layer
        self.manager = manager
        self.scratch_root = Path(scratch_root)
        self.mock = mock
        self.mps = mps
        self.heartbeat_s = heartbeat_s
        self.exec_store = exec_store  # streamed exec output (sessions.exec_store); None: the settings' store
        self.sessions: dict[str, RunningSession] = {}
        self._starting: set[str] = set()  # between the start message and the process existing
        self._cancelled: set[str] = set()  # stop messages that overtook their session's start
        self.loop: asyncio.AbstractEventLoop | None = None
        self.channel: str | None = None
        self._tasks: list[asyncio.Task] = []
        # MIG instances the manager plans (issue 4): in memory on mock nodes, through NVML on real ones.
        self.mig = mig_runtime.MigManager(mig_runtime.MockMigBackend() if mock else mig_runtime.NvmlMigBackend(),
                                          on_report=self._send_mig_report)

    # --- life cycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Join the channel layer, register with the manager, start heartbeats."""
        self.loop = asyncio.get_running_loop()
        _AGENTS[self.node] = self
        self.scratch_root.mkdir(parents=True, exist_ok=True)
        self.channel = await self.layer.new_channel(f"agent.{self.node}.")
        self._tasks.append(asyncio.create_task(self._receive_loop(), name=f"agent-{self.node}-receive"))
        await self._call(self.manager.register, self.node, self.inventory, list(self.sessions))
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name=f"agent-{self.node}-heartbeat"))
        log.info("agent %s started with %d device(s)", self.node, len(self.inventory["devices"]))

    async def shutdown(self) -> None:
        """Kill every session (reported TERMINATED) and stop the loops."""
        for session_id in list(self.sessions):
            await self._stop(session_id, reason="the agent shut down")
        for task in self._tasks:
            task.cancel()
        _AGENTS.pop(self.node, None)

    def kill_all_now(self) -> None:
        """SIGKILL every process of every session, from any thread, without reporting: for a
        host process that is exiting after its event loop stopped. The manager learns at the
        agent's next registration (the sessions end in ERROR, their allocations released)."""
        for running in list(self.sessions.values()):
            _signal_session(running.process.pid, signal.SIGKILL)

    async def _call(self, fn, *args, **kwargs):
        # thread_sensitive=False: a manager call may run the manager's code in-process (eager
        # Celery in standalone mode); it must not queue behind the web's sync thread.
        return await sync_to_async(fn, thread_sensitive=False)(*args, **kwargs)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self._call(self._send_heartbeat, list(self.sessions))
            except Exception:
                log.exception("agent %s: heartbeat failed", self.node)
            await self._refresh_groups()

    def _send_heartbeat(self, running: list[str]) -> None:
        """Blocking (a worker thread): the heartbeat, with the digest of the GPU instances on the
        node's MIG GPUs (`MigManager.layout_digest`; None when it cannot be had) so the manager
        notices drift without a full report."""
        try:
            digest = self.mig.layout_digest()
        except Exception:
            log.exception("agent %s: could not compute the MIG layout digest", self.node)
            digest = None
        self.manager.heartbeat(self.node, running, digest)

    async def _refresh_groups(self) -> None:
        """Join each running session's `pty-<id>` group again: channel layers forget a group
        membership after their group expiry (channels_redis: a day), after which terminal input
        and exec requests for a long-running session would reach nobody."""
        for session_id in list(self.sessions):
            try:
                await self.layer.group_add(events.pty_group(session_id), self.channel)
            except Exception:
                log.exception("agent %s: could not renew the terminal group of %s", self.node, session_id)

    # --- thread-safe entry points (Celery task handlers) ----------------------------------

    def _submit(self, coro) -> None:
        if self.loop is None:
            raise RuntimeError(f"agent {self.node} is not started")
        asyncio.run_coroutine_threadsafe(coro, self.loop)

    def submit_start(self, spec: dict) -> None:
        self._submit(self._start(spec))

    def submit_stop(self, session_id: str) -> None:
        self._submit(self._stop(session_id, reason="terminated"))

    def submit_sync(self, keep: list[str]) -> None:
        self._submit(self._sync(set(keep)))

    def submit_mig_reconcile(self, gpus: list[dict], expected: dict[str, list[dict]], *,
                             destroy: dict[str, list[dict]] | None = None, kind: str = "start",
                             seq: int | None = None) -> None:
        """Reconcile the MIG GPUs `gpus` with the manager's `expected` layout, destroying the
        idle instances in `destroy` first: kind "start" skips GPUs a start spec reached first
        (`MigManager.reconcile_at_start`), "layout" and "drift" do every GPU
        (`MigManager.apply_layout`). The report, with `kind` and `seq`, goes to the manager."""
        self._submit(self._mig_reconcile(gpus, expected, destroy=destroy, kind=kind, seq=seq))

    async def _mig_reconcile(self, gpus: list[dict], expected: dict[str, list[dict]], **how) -> None:
        step = self.mig.reconcile_at_start if how.get("kind") == "start" else self.mig.apply_layout
        try:
            await asyncio.to_thread(step, gpus, expected, **how)
        except Exception:
            log.exception("agent %s: MIG reconcile failed", self.node)

    def _send_mig_report(self, report: dict) -> None:
        """MigManager's on_report: blocking, called from a worker thread (never the loop)."""
        self.manager.mig_report(self.node, report)

    # --- sessions ----------------------------------------------------------------------

    async def _start(self, spec: dict) -> None:
        session_id = spec["session_id"]
        if session_id in self.sessions or session_id in self._starting:
            return  # a redelivered start message: already there
        self._starting.add(session_id)
        try:
            await self._report(session_id, "PREPARING", "preparing the working directory and environment")
            try:
                running = await asyncio.to_thread(self._spawn, spec)
            except Exception as exc:
                log.exception("agent %s: session %s failed to start", self.node, session_id)
                await self._report(session_id, "ERROR", f"the agent could not start the session: {exc}")
                return
        finally:
            self._starting.discard(session_id)
        self.sessions[session_id] = running
        await self.layer.group_add(events.pty_group(session_id), self.channel)
        self.loop.add_reader(running.master_fd, self._on_readable, running)
        asyncio.create_task(self._pump_output(running))
        running.log_task = asyncio.create_task(self._ship_logs(running))
        running.exited = asyncio.create_task(self._wait_exit(running))
        if session_id in self._cancelled:  # terminated while it was being prepared
            self._cancelled.discard(session_id)
            await self._stop(session_id, reason="terminated while starting")
            return
        await self._report(session_id, "RUNNING", "")

    def _spawn(self, spec: dict) -> RunningSession:
        """Work dir, allocation document, virtual nvidia-smi, then the process on a new PTY in
        its own session (so the whole process group can be killed). Blocking; runs in a thread."""
        spec = mig_runtime.prepare_spec(self.mig, spec)  # a MIG instance to create or reuse (issue 4)
        session_id = spec["session_id"]
        work_dir = self.scratch_root / session_id
        meta_dir = work_dir / ".fgpu"
        bin_dir = meta_dir / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        document = allocation_document(spec, node=self.node, mock=self.mock, attributes=self.inventory.get("attributes", {}))
        allocation_path = meta_dir / "allocation.json"
        allocation_path.write_text(json.dumps(document, indent=2))
        nvidia_smi.install(bin_dir)
        env = session_environment(spec, allocation_path=str(allocation_path), bin_dir=str(bin_dir),
                                  work_dir=str(work_dir), base_path=os.environ.get("PATH", "/usr/bin:/bin"), mps=self.mps)
        env["PS1"] = f"{spec['owner']}@{spec['name']}:\\w\\$ "
        shell = shutil.which("bash") or "/bin/sh"
        argv = [shell, "-c", spec["command"]] if spec.get("command") else (
            [shell, "--noprofile", "--norc", "-i"] if shell.endswith("bash") else [shell, "-i"])
        master_fd, slave_fd = pty.openpty()
        _set_winsize(slave_fd, 24, 80)
        try:
            process = subprocess.Popen(argv, stdin=slave_fd, stdout=slave_fd, stderr=slave_fd, cwd=work_dir, env=env,
                                       start_new_session=True, close_fds=True, preexec_fn=_make_controlling_tty)
        finally:
            os.close(slave_fd)
        os.set_blocking(master_fd, False)
        return RunningSession(session_id=session_id, process=process, master_fd=master_fd, work_dir=work_dir, env=env)

    def _on_readable(self, running: RunningSession) -> None:
        try:
            data = os.read(running.master_fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:  # EIO: the last process holding the PTY is gone
            data = b""
        if not data:
            self.loop.remove_reader(running.master_fd)
            running.eof.set()
            return
        running.scrollback += data
        del running.scrollback[:-SCROLLBACK_BYTES]
        text = running.decoder.decode(data)
        running.outbox.put_nowait(text)
        if text:
            running.log_pending.append(text)
            running.log_pending_chars += len(text)
            if running.log_pending_chars >= LOG_BATCH_CHARS:
                running.log_wake.set()
            if running.log_pending_chars > 2 * LOG_BACKLOG_CHARS:  # the manager unreachable for long
                _drop_oldest(running)

    async def _pump_output(self, running: RunningSession) -> None:
        """Send output frames in order, coalescing what piled up meanwhile."""
        group = events.terminal_group(running.session_id)
        while True:
            chunk = await running.outbox.get()
            closing = chunk is None
            parts = [] if closing else [chunk]
            while not running.outbox.empty():
                more = running.outbox.get_nowait()
                if more is None:
                    closing = True
                    break
                parts.append(more)
            if parts:
                try:
                    await self.layer.group_send(group, {"type": "terminal.output", "data": "".join(parts)})
                except Exception:
                    log.exception("agent %s: could not send terminal output of %s", self.node, running.session_id)
            if closing:
                return

    async def _wait_exit(self, running: RunningSession) -> None:
        code = await asyncio.to_thread(running.process.wait)
        # The session ends with its shell: background jobs (own process groups, nohup'd or
        # not) must not outlive the allocation that is about to be released.
        await asyncio.to_thread(_signal_session, running.process.pid, signal.SIGKILL)
        # A signal takes effect when its process next runs: report TERMINATED once none is left
        # (zombies hold nothing), so the slice is free when the manager releases it.
        deadline = self.loop.time() + KILL_WAIT_S
        while self.loop.time() < deadline and await asyncio.to_thread(session_members, running.process.pid,
                                                                      live_only=True):
            await asyncio.sleep(0.02)
        # Let the PTY drain what the process wrote last (a background child may keep it open:
        # then give up after a second), then close it.
        try:
            await asyncio.wait_for(running.eof.wait(), timeout=1.0)
        except TimeoutError:
            self.loop.remove_reader(running.master_fd)
        running.outbox.put_nowait(None)
        os.close(running.master_fd)
        tail = running.decoder.decode(b"", final=True)
        if tail:
            running.log_pending.append(tail)
            running.log_pending_chars += len(tail)
        await self._close_log(running)
        self.sessions.pop(running.session_id, None)
        exit_code = code if code >= 0 else 128 - code  # killed by signal N → 128+N, as shells report it
        await self.layer.group_send(events.terminal_group(running.session_id), {"type": "terminal.exit", "code": exit_code})
        await self.layer.group_discard(events.pty_group(running.session_id), self.channel)
        reason = running.stopping or f"the process exited with code {exit_code}"
        await self._report(running.session_id, "TERMINATED", reason, exit_code=exit_code)

    async def _stop(self, session_id: str, *, reason: str) -> None:
        running = self.sessions.get(session_id)
        if running is None and session_id in self._starting:
            self._cancelled.add(session_id)  # _start kills it as soon as the process exists
            return
        if running is None:  # not here (already ended, or the agent restarted): say so
            await self._report(session_id, "TERMINATED", f"{reason} (no process was running)")
            return
        if running.stopping:
            return
        running.stopping = reason
        for process in list(running.execs):
            await asyncio.to_thread(_signal_session, process.pid, signal.SIGKILL)
        leader = running.process.pid
        for sig in (signal.SIGHUP, signal.SIGTERM):  # every process of the session, every group
            await asyncio.to_thread(_signal_session, leader, sig)
        deadline = self.loop.time() + KILL_GRACE_S
        while running.process.poll() is None and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(_signal_session, leader, signal.SIGKILL)
        if running.exited is not None:
            await asyncio.shield(running.exited)  # returns once TERMINATED has been reported

    async def _sync(self, keep: set[str]) -> None:
        for session_id in list(self.sessions):
            if session_id not in keep:
                await self._stop(session_id, reason="the manager no longer knows this session")

    async def _report(self, session_id: str, status: str, reason: str, exit_code: int | None = None) -> None:
        try:
            await self._call(self.manager.report, session_id, status, reason, exit_code)
        except Exception:
            log.exception("agent %s: could not report %s for session %s", self.node, status, session_id)

    # --- output log --------------------------------------------------------------------

    async def _ship_logs(self, running: RunningSession) -> None:
        """Ship the session's output every LOG_FLUSH_S (sooner when a batch is full) until
        _close_log closes the log."""
        while not running.log_closed:
            try:
                await asyncio.wait_for(running.log_wake.wait(), timeout=LOG_FLUSH_S)
            except TimeoutError:
                pass
            running.log_wake.clear()
            if not running.log_closed:
                await self._ship_log(running, final=False)

    def _next_batch(self, running: RunningSession, *, final: bool) -> tuple | None:
        """Cut the next batch (at most LOG_CHUNK_CHARS) from the pending output. When the
        backlog outgrew LOG_BACKLOG_CHARS (the manager unreachable), its oldest part is dropped
        and the offset moves past it, so offsets stay positions in the session's output."""
        _drop_oldest(running)
        text = "".join(running.log_pending)
        batch, rest = text[:LOG_CHUNK_CHARS], text[LOG_CHUNK_CHARS:]
        running.log_pending = [rest] if rest else []
        running.log_pending_chars = len(rest)
        last = final and not rest
        if not batch and not last:
            return None
        chunk = (running.log_seq, running.log_offset, batch, last)
        running.log_seq += 1
        running.log_offset += len(batch)
        return chunk

    async def _ship_log(self, running: RunningSession, *, final: bool) -> bool:
        """Send the unsent batch (a retry keeps its sequence number) and then the pending
        output, in batches. Returns False if the manager could not be reached (the output
        stays pending for the next try)."""
        while True:
            if running.log_unsent is None:
                running.log_unsent = self._next_batch(running, final=final)
                if running.log_unsent is None:
                    return True
            try:
                await self._call(self.manager.log, running.session_id, *running.log_unsent)
            except Exception:
                log.warning("agent %s: could not ship the output of session %s; will retry", self.node,
                            running.session_id, exc_info=True)
                return False
            sent_final = running.log_unsent[3]
            running.log_unsent = None
            if sent_final or not (running.log_pending or final):
                return True

    async def _close_log(self, running: RunningSession) -> None:
        """Stop the periodic shipping and send the rest of the output with the final mark
        (a few tries, LOG_FLUSH_S apart), before the session is reported ended."""
        running.log_closed = True
        running.log_wake.set()
        if running.log_task is not None:
            await running.log_task
        for _ in range(5):
            if await self._ship_log(running, final=True):
                return
            await asyncio.sleep(LOG_FLUSH_S)
        log.error("agent %s: gave up shipping the last output of session %s", self.node, running.session_id)

    # --- exec ----------------------------------------------------------------------------

    async def _exec(self, running: RunningSession, message: dict) -> None:
        """Run `message["argv"]` (a list; one string is a shell command line) in the session's
        environment and working directory, stdin from /dev/null, for at most
        `message["timeout"]` seconds; answer `{"type": "exec.result", "exit_code", "stdout",
        "stderr", "timed_out", "truncated", "duration_ms"}` on `message["reply_channel"]`
        (or `{"type": "exec.result", "error": "…"}` when the command could not be started)."""
        try:
            result = await asyncio.to_thread(self._run_exec, running, message["argv"], float(message["timeout"]))
        except Exception as exc:
            result = {"error": f"could not run the command: {exc}"}
        try:
            await self.layer.send(message["reply_channel"], {"type": "exec.result", **result})
        except Exception:
            log.exception("agent %s: could not answer an exec in session %s", self.node, running.session_id)

    def _run_exec(self, running: RunningSession, argv, timeout: float) -> dict:
        """Blocking; runs in a thread. The command gets its own process session (killed whole
        on timeout, and when the session stops); output goes to temporary files so a chatty
        command cannot fill the agent's memory."""
        if isinstance(argv, str):
            shell = shutil.which("bash") or "/bin/sh"
            argv = [shell, "-c", argv]
        started = time.monotonic()
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                           cwd=running.work_dir, env=running.env, start_new_session=True,
                                           close_fds=True, preexec_fn=_default_signals)
            except (FileNotFoundError, PermissionError) as exc:
                return {"exit_code": 127 if isinstance(exc, FileNotFoundError) else 126, "stdout": "",
                        "stderr": f"{argv[0]}: {exc.strerror}\n", "timed_out": False, "truncated": False,
                        "duration_ms": 0}
            running.execs.add(process)
            timed_out = False
            try:
                code = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _signal_session(process.pid, signal.SIGKILL)
                code = process.wait()
            finally:
                _signal_session(process.pid, signal.SIGKILL)  # what it left running in the background
                running.execs.discard(process)
            outputs, truncated = [], False
            for f in (out, err):
                f.seek(0)
                data = f.read(EXEC_OUTPUT_BYTES + 1)
                truncated |= len(data) > EXEC_OUTPUT_BYTES
                outputs.append(data[:EXEC_OUTPUT_BYTES].decode("utf-8", "replace"))
        return {"exit_code": code if code >= 0 else 128 - code, "stdout": outputs[0], "stderr": outputs[1],
                "timed_out": timed_out, "truncated": truncated,
                "duration_ms": int((time.monotonic() - started) * 1000)}

    # --- terminal relay ------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            try:
                message = await self.layer.receive(self.channel)
            except asyncio.CancelledError:
                raise
            except Exception:  # e.g. Redis restarting: keep relaying once it is back
                log.exception("agent %s: channel layer receive failed; retrying in 1 s", self.node)
                await asyncio.sleep(1)
                continue
            try:
                self._handle(message)
            except Exception:
                log.exception("agent %s: bad terminal message %r", self.node, message.get("type"))

    def _handle(self, message: dict) -> None:
        running = self.sessions.get(message.get("session_id", ""))
        if running is None:
            return
        kind = message.get("type")
        if kind == "pty.input":
            data = message["data"].encode()
            while data:
                try:
                    written = os.write(running.master_fd, data)
                except BlockingIOError:
                    continue
                data = data[written:]
        elif kind == "pty.resize":
            _set_winsize(running.master_fd, int(message["rows"]), int(message["cols"]))
        elif kind == "pty.attach":
            backlog = bytes(running.scrollback).decode("utf-8", "replace")
            asyncio.create_task(self.layer.send(message["reply_channel"], {"type": "terminal.output", "data": backlog}))
        elif kind == "pty.exec":
            asyncio.create_task(self._exec(running, message))
        elif kind == "pty.exec_stream":  # runs on a thread of its own (sessions.runtime.exec_stream)
            exec_stream.start(self, running, message)


def _drop_oldest(running: RunningSession) -> None:
    """Keep the last LOG_BACKLOG_CHARS characters of the unshipped output; the next batch's
    offset moves past what is dropped, so offsets stay positions in the session's output."""
    if running.log_pending_chars <= LOG_BACKLOG_CHARS:
        return
    text = "".join(running.log_pending)
    dropped = len(text) - LOG_BACKLOG_CHARS
    running.log_offset += dropped
    running.log_pending = [text[dropped:]]
    running.log_pending_chars = LOG_BACKLOG_CHARS


def _set_winsize(fd: int, rows: int, cols: int) -> None:
    rows, cols = max(1, min(rows, 1000)), max(1, min(cols, 1000))
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _default_signals() -> None:
    # An agent started under nohup or `&` ignores SIGINT/SIGQUIT/SIGHUP, and ignored signals
    # are inherited: give the session's processes default signal handling.
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)


def _make_controlling_tty() -> None:
    # After setsid (start_new_session), make the PTY on stdin the controlling terminal so
    # job control and SIGWINCH work in the shell; and give the session default signal
    # handling (Ctrl-C would do nothing in the terminal otherwise).
    _default_signals()
    try:
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    except OSError:
        pass


def session_members(sid: int, *, proc: str = "/proc", live_only: bool = False) -> list[int]:
    """Pids whose session id (field 6 of /proc/<pid>/stat) is `sid`: every process a session's
    shell started, whatever process group job control gave it; `live_only`: not zombies. A
    process that calls setsid() itself escapes this (a cgroup would be needed to hold it)."""
    pids = []
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"{proc}/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp session …
        if len(fields) > 3 and int(fields[3]) == sid and not (live_only and fields[0] == "Z"):
            pids.append(int(entry.name))
    return pids


def _signal_session(sid: int, sig: int) -> None:
    for pid in session_members(sid):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
