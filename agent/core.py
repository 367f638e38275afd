"""The agent: one per node. Runs sessions through a runtime (agent.runtimes: PTY
process groups, or one container each with agent.docker_runtime) and relays their
terminals.

Everything runs on one asyncio loop (the agent's own in `manage.py agent`, uvicorn's in
standalone mode). Celery task handlers call the thread-safe `submit_*` methods, which
schedule work on that loop and return at once. Reports to the manager go through Celery
tasks (`fgpu.manager.*`), called from a worker thread so the loop never blocks. Terminal
frames travel through a direct TCP stream per terminal where the web reaches the agent
(agent.direct, protocol.terminal_stream), else through the channel layer: input from group
`pty.<node>.<session>` (which the agent joins), output to group `term.<node>.<session>` (which
terminal consumers join). The handshake is always on the layer. Every command on the layer is
sealed by the web with the node's key and opened before the agent acts on it; its answers are
sealed in turn (protocol.channel).

Session output is also shipped to the manager (`fgpu.manager.session_log_append`) in batches:
every LOG_FLUSH_S seconds, or sooner once LOG_BATCH_CHARS characters are waiting, at most one
batch per LOG_FLUSH_S (on queue `manager.logs`, never ahead of control messages); each batch
carries a sequence number and its offset in the log, so a retried delivery is stored once.
Server-side exec (`pty.exec` on the same group, answered on the message's `reply_channel`)
runs a command beside the session's process, in its environment and working directory;
streamed exec (`pty.exec_stream`) runs on a thread of its own and pushes its output to the
exec store as it comes (agent.exec_stream).
The agent never opens the database.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import protocol
from protocol import channel as protocol_channel
from protocol import files as protocol_files
from protocol.exec_store import exec_store_for
from agent import exec_stream
from agent.direct import DirectServer, DirectStream
from agent import files as session_files
from agent import lifecycle
from agent import mig as mig_runtime
from agent import session_exec
from agent.lifecycle import outlives_agent, sweep_scratch
from agent.log_shipper import LogLimits, SessionLog
from agent.manager_link import ManagerLink, service_ports_keyword
from agent.terminal_pipe import FlowLimits, OutputCap, TerminalPipe
from agent.runtimes import HeldImages, ProcessRuntime, SessionHandle
from agent.session_apps import SessionApps
from agent.storage import StorageWatch
from agent.usage import UsageSampler
from protocol.messages import AgentState, NodeName, SessionId, SessionState, StartSpec
from protocol.mig_messages import MigReconcile, MigReport

log = logging.getLogger(__name__)

# Thread pools, each bounded and separate, so that no kind of work waits behind another: blocking
# session work (spawning, signalling, /proc scans, files, NVML), reports and log batches to the
# manager, blocking execs (each holds a thread up to its timeout), and the heartbeat (one thread
# of its own: a node never goes LOST because its agent is busy).
WORK_THREADS = 8
EXEC_THREADS = 32

_AGENTS: dict[str, "Agent"] = {}


def agent_for(node: str) -> "Agent":
    """The agent running in this process for `node`. Raises LookupError if none."""
    try:
        return _AGENTS[node]
    except KeyError:
        raise LookupError(f"no agent for node {node!r} runs in this process") from None


@dataclass
class RunningSession:
    """One session the agent runs: the runtime's handle and the parts that serve it (its terminal
    pipe, its log), with what the lifecycle, exec, files and apps keep of it."""

    session_id: str
    process: SessionHandle  # the runtime's handle: its terminal stream, exit, signals, exec
    work_dir: Path
    pipe: TerminalPipe = field(init=False)  # its PTY and terminals, with their flow control (agent.terminal_pipe)
    log: SessionLog = field(default_factory=SessionLog)  # its output to the manager (the agent's LogLimits: Agent.log_limits)
    exit_event: asyncio.Event = field(default_factory=asyncio.Event)  # the session's leader process exited
    pidfd: int = -1  # the leader's pidfd (readable once it exits); -1 where the kernel has none
    exit_poll: asyncio.Task | None = None  # only where there is no pidfd
    exited: asyncio.Task | None = None  # SessionLifecycle.wait_exit: done once the session is reported ended
    stopping: str = ""  # why the agent is killing it; empty while nobody asked
    preempt_notice: str = ""  # the preemption notice it was signalled for (protocol.channel.PtyPreempt): acted on once
    env: dict = field(default_factory=dict)  # the session's environment, for exec
    data_dir: Path | None = None  # its owner's persistent folder (~/data), whose storage agent.storage measures
    project_dirs: dict = field(default_factory=dict)  # its projects' folders (~/projects/<name>: Path), measured too
    shared_dirs: dict = field(default_factory=dict)  # folders shared with its owner (~/shared/<name>: (Path, read-only))
    execs: set = field(default_factory=set)  # Popen of commands run by exec, killed with the session
    apps: dict = field(default_factory=dict)  # its web apps (agent.session_apps): name → AppProcess
    relays: list = field(default_factory=list)  # the agent's relays to its apps (agent.session_apps), closed with it

    def __post_init__(self) -> None:
        self.pipe = TerminalPipe(self.process)


class Agent:
    """Runs one node's sessions.

    `inventory`: {"devices": [DeviceInfo dicts], "plugins", "attributes", "cpu_count",
    "memory_size"}; `manager`: an object with `register`, `heartbeat`, `report`, `log` and
    `mig_report` methods that send the manager tasks (blocking calls; the agent calls them from
    a worker thread; see agent.manager_link.CeleryManager); `exec_store`: where streamed execs keep their output
    (protocol.exec_store; None: this process's memory store, `exec_store_for("")`); `scratch_retention_s`:
    seconds a session's working directory is kept after it ended; `flow` (agent.terminal_pipe.FlowLimits) and
    `log_limits` (agent.log_shipper.LogLimits): its sessions' terminal windows and log pace (None: those modules'
    defaults).

    Threads: none per session. A session's exit is an event on the loop (its leader's pidfd),
    its PTY is read and written only when the loop says it is ready, and blocking work runs on
    bounded pools of its own (WORK_THREADS, agent.manager_link's MANAGER_THREADS, EXEC_THREADS, one heartbeat
    thread), so one agent holds hundreds of sessions and its heartbeat never waits behind them.

    Healing (DESIGN.md, "How the system heals"): every heartbeat carries the agent's view of its
    sessions (`state()`: PREPARING, RUNNING or TERMINATING, and the ends it reported in the last
    ENDED_KEEP_S seconds); the manager compares it with the database and re-sends starts and
    stops, so a start or stop is idempotent by session id here: a second start of a running
    session re-reports RUNNING, of an ended one re-reports its end; a stop of an ended one
    re-reports its end. A report the broker does not take is tried again (REPORT_RETRY_S) in
    the background. Every process of a session ends with it: those in its process session and
    those carrying its `FGPU_SESSION_ID` (which escaped with setsid) — or, where the process
    runtime gives each session a cgroup, every process in it —, also after an agent restart
    (`Runtime.clean_up_at_start`).

    MIG (issue 4): after registering, the manager sends the expected layout of each MIG GPU
    (`submit_mig_reconcile`); the agent re-creates missing instances and reports the ones the
    manager does not know (`mig_report`), as it does when a start spec reaches a GPU first. The
    manager sends it again when an administrator changes the layout, and when a heartbeat's MIG
    layout digest (`_send_heartbeat`) differs from the one it expects.
    """

    loop: asyncio.AbstractEventLoop  # set by start(); thread-side callers check for it with getattr

    def __init__(
        self,
        *,
        node: str,
        inventory: dict,
        channel_layer,
        manager,
        scratch_root: Path,
        mock: bool,
        mps: bool = False,
        heartbeat_s: float = 5.0,
        exec_store=None,
        scratch_retention_s: float = 3600.0,
        runtime=None,
        app_address: str = "127.0.0.1",
        data_root: Path | None = None,
        app_relay: bool = False,
        terminal_direct: bool = False,
        terminal_port: int = 0,
        terminal_address: str = "",
        flow: FlowLimits | None = None,
        log_limits: LogLimits | None = None,
    ) -> None:
        self.node = node
        self.inventory = inventory
        self.layer = channel_layer
        self.manager = manager
        self.scratch_root = Path(scratch_root)
        self.mock = mock
        self.mps = mps
        self.heartbeat_s = heartbeat_s
        self.exec_store = exec_store or exec_store_for("")  # streamed exec output (protocol.exec_store)
        self.scratch_retention_s = scratch_retention_s
        self.runtime = runtime or ProcessRuntime(node=node)  # where sessions run (agent.runtimes)
        self.images = HeldImages(self.runtime)  # the session images it holds, for registration and heartbeats
        self.sessions: dict[str, RunningSession] = {}
        self._starting: set[str] = set()  # between the start message and the process existing
        self._cancelled: set[str] = set()  # stop messages that overtook their session's start
        self.output_cap = OutputCap()  # the node's output-rate policy (agent.terminal_pipe)
        self.flow = flow or FlowLimits()  # the terminal pipes' windows and bounds (agent.terminal_pipe)
        self.log_limits = log_limits or LogLimits()  # the log shippers' pace and bounds (agent.log_shipper)
        self.channel: str | None = None
        # Opens the commands it receives (sealed by the web with the node's key: protocol.channel) and seals its answers.
        self.guard = protocol_channel.CommandGuard(node=node, key=getattr(manager, "key", "") or "")
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()  # report retries, attach replies: kept until done
        self._work = ThreadPoolExecutor(WORK_THREADS, thread_name_prefix=f"agent-{node}-work")
        self._exec_pool = ThreadPoolExecutor(EXEC_THREADS, thread_name_prefix=f"agent-{node}-exec")
        # Registration, heartbeats and session reports, off the loop and retried (agent.manager_link).
        self.link = ManagerLink(node=node, manager=manager, background=self._in_background)
        # MIG instances the manager plans (issue 4): in memory on mock nodes, through NVML on real ones.
        self.mig = mig_runtime.MigManager(
            mig_runtime.MockMigBackend() if mock else mig_runtime.NvmlMigBackend(), on_report=self._send_mig_report
        )
        self.usage = UsageSampler(self)  # usage samples to the manager (issue 15; agent.usage)
        self.storage = StorageWatch(self)  # sessions' storage measured and limited (issue 31; agent.storage)
        self.app_address = app_address  # where the process runtime's session apps listen (agent.session_apps)
        self.app_relay = app_relay  # docker: relay container apps through the agent on app_address (agent.session_apps)
        self.apps = SessionApps(self)
        self.lifecycle = lifecycle.SessionLifecycle(self)  # start, stop and end of its sessions
        self.data_root = None if data_root is None else Path(data_root)  # users' persistent folders (agent.files)
        self.files = session_files.SessionFiles(self)
        # Direct terminal streams (agent.direct) on app_address, where agent.toml leaves them on.
        self.direct = (
            DirectServer(self, host=app_address, port=terminal_port, advertise=terminal_address or app_address)
            if terminal_direct
            else None
        )

    # --- life cycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """End what a previous run of this agent left running, join the channel layer, register
        with the manager (again on each heartbeat until the broker takes it), start heartbeats
        and the scratch directory sweep."""
        self.loop = asyncio.get_running_loop()
        _AGENTS[self.node] = self
        self.link.start(self.loop)
        self.scratch_root.mkdir(parents=True, exist_ok=True)
        adopted, orphans = await self._in(self._work, self.runtime.clean_up_at_start, self.scratch_root)
        if orphans:
            log.warning("agent %s: removed %d process(es) or container(s) left by sessions of an earlier run", self.node, orphans)
        for handle in adopted:  # sessions that outlived the agent in their containers: run them on
            running = RunningSession(
                session_id=handle.session_id,
                process=handle,
                work_dir=handle.work_dir,
                env=handle.env,
                log=SessionLog(limits=self.log_limits),
            )
            running.pipe.adopted = True
            self.sessions[handle.session_id] = running
            self._attach(running)
            log.info("agent %s: adopted session %s, still running", self.node, handle.session_id)
        if self.direct is not None:
            await self.direct.start()
        self.channel = await self.layer.new_channel(protocol_channel.agent_channel_prefix(self.node))
        await self._refresh_groups()  # adopted sessions' terminals and execs reach this agent again
        self._tasks.append(asyncio.create_task(self._receive_loop(), name=f"agent-{self.node}-receive"))
        await self._in(self._work, self.images.refresh)
        await self._register()
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name=f"agent-{self.node}-heartbeat"))
        self._tasks.append(asyncio.create_task(self._sweep_loop(), name=f"agent-{self.node}-sweep"))
        self._tasks.append(asyncio.create_task(self.usage.run(), name=f"agent-{self.node}-usage"))
        self._tasks.append(asyncio.create_task(self.storage.run(), name=f"agent-{self.node}-storage"))
        log.info("agent %s started with %d device(s)", self.node, len(self.inventory["devices"]))

    async def shutdown(self, *, keep_sessions: bool = False) -> int:
        """Stop the loops and return how many sessions keep running. `keep_sessions` False: stop
        every session (each reported TERMINATED). True (a graceful stop of `manage.py agent`, as a
        kubelet's or slurmd's restart leaves its pods or jobs running): the sessions that outlive
        their agent (`process.outlives_agent`: held process-runtime sessions, docker containers)
        are let go, running, for the next start to adopt (`Runtime.clean_up_at_start`); the
        others (an unheld process session's PTY dies with the agent) are stopped."""
        kept = [r for r in self.sessions.values() if keep_sessions and outlives_agent(r.process)]
        for running in kept:
            self.sessions.pop(running.session_id, None)
            self.lifecycle.let_go(running)
        await asyncio.gather(*(self._stop(session_id, reason="the agent shut down") for session_id in list(self.sessions)))
        await self.lifecycle.removed()  # what ended sessions left, removed beside their reports
        close = getattr(self.runtime, "close", None)  # the process runtime's parent cgroup, once empty
        if close is not None:
            try:
                await self._in(self._work, close)
            except Exception:
                log.exception("agent %s: could not close its runtime", self.node)
        for task in self._tasks:
            task.cancel()
        if self.direct is not None:
            self.direct.close()
        self.files.close()  # its own listener for file transfers, where it started one
        _AGENTS.pop(self.node, None)
        for pool in (self._work, self._exec_pool, self.files.pool):
            pool.shutdown(wait=False, cancel_futures=True)
        self.link.close()
        if kept:
            log.warning("agent %s: %d session(s) keep running; the next start adopts them", self.node, len(kept))
        return len(kept)

    def kill_all_now(self, *, keep_sessions: bool = False) -> int:
        """SIGKILL every process of every session, from any thread, without reporting: for a
        host process that is exiting after its event loop stopped. The manager learns at the
        agent's next registration (the sessions end in ERROR, their allocations released).
        Each killed session's remains go with it (`remove`: its cgroup, a held session's holder,
        which would otherwise wait ORPHAN_WAIT_S for an agent), then the runtime's own cgroups
        (the process runtime's) with what they held. `keep_sessions`: the sessions that outlive
        their agent (as `shutdown`) are left running for the next start to adopt, only the others
        killed. Returns how many sessions keep running."""
        killed = [r for r in self.sessions.values() if not (keep_sessions and outlives_agent(r.process))]
        for running in killed:
            running.process.kill_all()
        for running in killed:
            try:
                running.process.remove()
            except Exception:
                log.exception("agent %s: could not remove session %s", self.node, running.session_id)
        kept = len(self.sessions) - len(killed)
        release = getattr(self.runtime, "release_now", None)  # a docker runtime has none
        if release is not None and not kept:
            release()
        return kept

    async def _in(self, pool: ThreadPoolExecutor, fn, *args, **kwargs):
        """Run blocking `fn(*args, **kwargs)` on `pool` and await its result."""
        return await self.loop.run_in_executor(pool, partial(fn, *args, **kwargs))

    async def _on_process(self, running: RunningSession, fn, *args):
        """`fn(*args)`, a call on the session's process: on the loop where the runtime says it is
        quick (`process.quick`: a few system calls), else on the work pool."""
        if running.process.quick:
            return fn(*args)
        return await self._in(self._work, fn, *args)

    async def _call(self, fn, *args, **kwargs):
        """A call to the manager (a Celery publish; in standalone mode the manager's code itself,
        eagerly) on the manager pool: never on the loop, never behind session work."""
        return await self.link.call(fn, *args, **kwargs)

    async def _register(self) -> None:
        await self.link.register(
            self.inventory, list(self.sessions), self.images.current, service_ports_keyword(self.images.service_ports)
        )

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if not self.link.registered:
                await self._register()
                continue
            state = self.state()
            if self.images.claim():  # listed on the work pool, at most every HeldImages.REFRESH_S
                self._in_background(self._in(self._work, self.images.refresh))
            await self.link.heartbeat(partial(self._send_heartbeat, [s.session_id for s in state.sessions], state))
            self.link.forget_old_ends()
            await self._refresh_groups()

    def state(self) -> AgentState:
        """What this agent runs, for the manager's reconciliation (protocol.messages.AgentState): its
        sessions, each PREPARING, RUNNING or TERMINATING, the ends it reported in the last
        ENDED_KEEP_S seconds, and when (`at`, epoch seconds)."""
        sessions = {session_id: "PREPARING" for session_id in self._starting}
        for session_id, running in self.sessions.items():
            sessions[session_id] = "TERMINATING" if running.stopping else "RUNNING"
        return AgentState(
            at=time.time(),
            sessions=tuple(SessionState(SessionId(k), v) for k, v in sessions.items()),
            ended=self.link.ended_state(besides=sessions),
        )

    def _send_heartbeat(self, running: list[str], state: AgentState) -> None:
        """Blocking (the heartbeat thread): the heartbeat with the agent's `state`, and the
        digest of the GPU instances on the node's MIG GPUs (`MigManager.layout_digest`; None when
        it cannot be had) so the manager notices drift without a full report."""
        try:
            digest = self.mig.layout_digest()
        except Exception:
            log.exception("agent %s: could not compute the MIG layout digest", self.node)
            digest = None
        ports = service_ports_keyword(self.images.service_ports)
        self.manager.heartbeat(self.node, running, digest, state, self.images.current, **ports)

    async def _refresh_groups(self) -> None:
        """Join the node's `node.<node>` group and each running session's `pty.<node>.<id>` group again:
        channel layers forget a group membership after their group expiry (channels_redis: a
        day), and a restarted Redis forgets them all, after which terminal input, exec requests
        and the web's questions about the node would reach nobody."""
        try:
            await self.layer.group_add(protocol.node_group(self.node), self.channel)
        except Exception:
            log.warning("agent %s: could not renew the node's group", self.node)
            return
        for session_id in list(self.sessions):
            try:
                await self.layer.group_add(protocol.pty_group(self.node, session_id), self.channel)
            except Exception:
                log.warning("agent %s: could not renew the terminal group of %s", self.node, session_id)
                return  # the layer is down: the next heartbeat tries again

    async def _sweep_loop(self) -> None:
        """Remove the working directories of sessions that ended more than
        scratch_retention_s ago (at start, then every min(retention, 300) seconds)."""
        while True:
            keep = set(self.sessions) | self._starting
            try:
                removed = await self._in(
                    self._work, sweep_scratch, self.scratch_root, keep=keep, older_than_s=self.scratch_retention_s
                )
                if removed:
                    log.info("agent %s: removed %d ended session(s)' working directories", self.node, removed)
            except Exception:
                log.exception("agent %s: scratch sweep failed", self.node)
            await asyncio.sleep(max(1.0, min(self.scratch_retention_s, 300.0)))

    # --- thread-safe entry points (Celery task handlers) ----------------------------------

    def _submit(self, coro) -> None:
        if getattr(self, "loop", None) is None:
            raise RuntimeError(f"agent {self.node} is not started")
        asyncio.run_coroutine_threadsafe(coro, self.loop)

    def submit_start(self, spec: StartSpec) -> None:
        """Start a session (protocol.messages.StartSpec: decoded once, where it arrives, by the
        Celery task agent.tasks.session_start)."""
        self._submit(self._start(spec))

    def submit_stop(self, session_id: str) -> None:
        self._submit(self._stop(session_id, reason="terminated"))

    def submit_sync(self, keep: list[str]) -> None:
        self._submit(self._sync(set(keep)))

    def submit_mig_reconcile(self, message: MigReconcile) -> None:
        """Reconcile the MIG GPUs of `message` (protocol.mig_messages.MigReconcile) with the
        manager's expected layout, destroying the idle instances in its `destroy` first: kind
        "start" skips GPUs a start spec reached first (`MigManager.reconcile_at_start`), "layout"
        and "drift" do every GPU (`MigManager.apply_layout`). The report, with the message's
        `kind` and `seq`, goes to the manager."""
        self._submit(self._mig_reconcile(message))

    async def _mig_reconcile(self, message: MigReconcile) -> None:
        step = self.mig.reconcile_at_start if message.kind == "start" else self.mig.apply_layout
        try:
            await self._in(self._work, step, message)
        except Exception:
            log.exception("agent %s: MIG reconcile failed", self.node)

    def _send_mig_report(self, report: MigReport) -> None:
        """MigManager's on_report: blocking, called from a worker thread (never the loop)."""
        self.manager.mig_report(self.node, report)

    # --- sessions ----------------------------------------------------------------------

    async def _start(self, spec: StartSpec) -> None:
        """Start a session (agent.lifecycle.SessionLifecycle.start)."""
        await self.lifecycle.start(spec)

    async def _stop(self, session_id: str, *, reason: str) -> None:
        """Stop a session, reporting its end (agent.lifecycle.SessionLifecycle.stop)."""
        await self.lifecycle.stop(session_id, reason=reason)

    async def _sync(self, keep: set[str]) -> None:
        await self.lifecycle.sync(keep)

    def _attach(self, running: RunningSession) -> None:
        """Wire a new session's parts: its terminal pipe (reading the PTY, the output pump), its
        log shipping to the manager, and the watch of its exit (agent.lifecycle)."""
        session_id = running.session_id
        running.pipe.bind(
            loop=self.loop,
            node=self.node,
            session_id=session_id,
            send=partial(self.layer.group_send, protocol.terminal_group(self.node, session_id)),
            capped=partial(self._output_capped, running),
            on_log=running.log.add,
            limits=self.flow,
        )
        running.pipe.start()
        running.log.bind(
            send=partial(self._call, self.manager.log, running.session_id), node=self.node, session_id=running.session_id
        )
        running.log.start()
        self.lifecycle.watch(running)

    def _spawn(self, start: StartSpec) -> RunningSession:
        """The session's spawn, stage by stage (agent.lifecycle.spawn: MIG, working directory,
        allocation document, tools, folders, environment, command, process). Blocking; runs in a thread."""
        node = lifecycle.Node(
            name=NodeName(self.node),
            scratch_root=self.scratch_root,
            data_root=self.data_root,
            runtime=self.runtime,
            mig=self.mig,
            mock=self.mock,
            mps=self.mps,
            attributes=self.inventory.get("attributes", {}),
        )
        spawned = lifecycle.spawn(node, start, progress=partial(self._progress_from_thread, start.session_id))
        return RunningSession(
            session_id=start.session_id,
            process=spawned.handle,
            work_dir=spawned.work_dir,
            env=spawned.env,
            log=SessionLog(limits=self.log_limits),
            data_dir=spawned.folders.data_dir,
            project_dirs=spawned.folders.project_dirs,
            shared_dirs=spawned.folders.shared_dirs,
        )

    def _progress_from_thread(self, session_id: str, text: str) -> None:
        """A runtime's word on a slow start (an image pull), from the worker thread that spawns:
        reported as PREPARING with `text` as the reason, without waiting for it."""
        asyncio.run_coroutine_threadsafe(self.link.report(session_id, "PREPARING", text, retry=False), self.loop)

    # --- the terminal pipe (agent.terminal_pipe) -----------------------------------------

    def _output_capped(self, running: RunningSession, now: float) -> bool:
        """Whether the output rate cap holds the session now (agent.terminal_pipe.OutputCap)."""
        return self.output_cap.capped(running.session_id, now, read=bool(running.pipe.readers), starting=bool(self._starting))

    def _output(self, running: RunningSession, text: str, *, log_it: bool = True) -> None:
        """The agent's own line in the session's output: its terminals and (`log_it`) its log."""
        running.pipe.output(text, log_it=log_it)

    def _in_background(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- exec ----------------------------------------------------------------------------

    async def _exec(self, running: RunningSession, message: dict) -> None:
        """Run `message["argv"]` (a list; one string is a shell command line) in the session's
        environment and working directory, stdin from /dev/null, for at most
        `message["timeout"]` seconds; answer `{"type": "exec.result", "exit_code", "stdout",
        "stderr", "timed_out", "truncated", "duration_ms"}` on `message["reply_channel"]`
        (or `{"type": "exec.result", "error": "…"}` when the command could not be started)."""
        try:
            result = await self._in(self._exec_pool, self._run_exec, running, message["argv"], float(message["timeout"]))
        except Exception as exc:
            result = {"error": f"could not run the command: {exc}"}
        try:
            await self.layer.send(message["reply_channel"], self.guard.answer(session_exec.exec_result(result)))
        except Exception:
            log.exception("agent %s: could not answer an exec in session %s", self.node, running.session_id)

    def _run_exec(self, running: RunningSession, argv, timeout: float) -> dict:
        """Blocking; runs in a thread (agent.session_exec.run_exec, the runtime's shell for a command line)."""
        return session_exec.run_exec(running.process, running.execs, argv, timeout, shell=self.runtime.shell())

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

    async def _answer_processes(self, reply_channel: str) -> None:
        """Answer `node.processes` on `reply_channel` with the host's view of the node's GPUs
        (`UsageSampler.processes`, on the work pool: NVML and /proc are read there, never on the
        loop), or {ok: false, detail} when they cannot be read."""
        try:
            answer = {"ok": True, **await self._in(self._work, self.usage.processes)}
        except Exception as exc:
            log.exception("agent %s: could not list the GPU processes", self.node)
            answer = {"ok": False, "detail": f"the agent could not list the GPU processes: {exc}"}
        await self.layer.send(reply_channel, self.guard.answer({"type": protocol.NODE_PROCESSES_RESULT, **answer}))

    async def _send_all(self, channel: str, messages: list[dict]) -> None:
        for message in messages:
            await self.layer.send(channel, message)

    # --- direct terminal streams (agent.direct) -----------------------------------------

    def _direct_attach(self, running: RunningSession, channel: str, stream: DirectStream) -> None:
        """A consumer presented its token on `stream`: it reads the session (TerminalPipe.attach_direct)."""
        running.pipe.attach_direct(channel, stream)
        log.info("agent %s: terminal %s of session %s reads from %s", self.node, channel, running.session_id, stream.peer)

    def _direct_message(self, running: RunningSession, channel: str, message: dict) -> None:
        """`pty.input`, `pty.resize` or `pty.ack` from a direct stream (others are ignored)."""
        if not self._terminal_input(running, message) and message.get("type") == "pty.ack":
            running.pipe.ack(channel, int(message["offset"]), int(message["n"]), direct=True)

    def _terminal_input(self, running: RunningSession, message: dict) -> bool:
        """A terminal's `pty.input` (`data`: text, written to the PTY) or `pty.resize` (`rows`,
        `cols`), from a direct stream or the layer alike; False for any other message. Raises
        KeyError, TypeError or ValueError on a resize without whole rows and columns."""
        kind = message.get("type")
        if kind == "pty.input" and isinstance(message.get("data"), str):
            self.usage.note_input(running.session_id)
            running.pipe.write_input(message["data"].encode())
        elif kind == "pty.resize":
            self._in_background(self._in(self._work, running.process.resize, int(message["rows"]), int(message["cols"])))
        else:
            return False
        return True

    def _direct_detach(self, running: RunningSession, channel: str, stream: DirectStream) -> None:
        """The direct stream closed: its consumer no longer reads (as `pty.detach`)."""
        running.pipe.detach_direct(channel, stream)

    def _handle(self, message: dict) -> None:
        """Act on a command from the channel layer once it is opened (sealed by the web with the
        node's key, fresh, not replayed: protocol.channel.CommandGuard) and typed; what fails
        either is dropped and logged, and so is a command for a session this node does not run."""
        try:
            command = protocol_channel.command_from_dict(self.guard.open(message))
        except protocol_channel.Refused as exc:
            log.warning("agent %s: dropped a %r message: %s", self.node, str(message.get("type"))[:40], exc)
            return
        if isinstance(command, protocol_channel.NodeProcesses):  # the node's GPU processes (agent.usage)
            self._in_background(self._answer_processes(command.reply_channel))
            return
        session_id = command["session_id"] if isinstance(command, dict) else command.session_id
        running = self.sessions.get(session_id)
        if running is None:
            return
        if isinstance(command, (protocol_channel.PtyInput, protocol_channel.PtyResize)):
            self._terminal_input(running, command.to_dict())
        elif isinstance(command, protocol_channel.PtyAck):
            running.pipe.ack(command.channel, command.offset, command.n)
        elif isinstance(command, protocol_channel.PtyStop):  # the manager's stop, ahead of its task (protocol)
            self._in_background(self._stop(running.session_id, reason="terminated"))
        elif isinstance(command, protocol_channel.PtyPreempt):  # a preemption notice: a logged line, then its signal
            self.lifecycle.preempt_notice(running, command)
        elif isinstance(command, protocol_channel.PtyDetach):
            running.pipe.detach(command.channel)
        elif isinstance(command, protocol_channel.PtyAttach):  # a terminal opened: it reads the session from here on
            channel = command.reply_channel
            if command.direct and self.direct is not None and self.direct.serving and not running.pipe.output_closed:
                offer = self.guard.answer(
                    protocol_channel.DirectOffer(**self.direct.offer(running.session_id, channel)).to_dict()
                )
                self._in_background(self.layer.send(channel, offer))  # it reads from its stream once it connects
                return
            backlog = running.pipe.attach_layer(channel)
            replies = [{"type": "terminal.output", "data": backlog}]
            if command.direct:  # it asked for a direct stream: none (it waits for this answer first)
                replies.insert(0, self.guard.answer(protocol_channel.DirectOffer(host="").to_dict()))
            self._in_background(self._send_all(channel, replies))
        elif isinstance(command, protocol_channel.PtyExec):
            self._in_background(self._exec(running, command.to_dict()))
        elif isinstance(command, protocol_channel.PtyExecStream):  # runs on a thread of its own (agent.exec_stream)
            exec_stream.start(self, running, command.to_dict())
        elif isinstance(command, dict) and command["type"] in ("pty.app_open", "pty.app_status"):  # agent.session_apps
            self.apps.handle(running, command)
        elif isinstance(command, dict) and command["type"] == protocol_files.FILES:  # the session's files (agent.files)
            self.files.handle(running, command)
