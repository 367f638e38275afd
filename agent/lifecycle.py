"""A session's life on its node: its spawn as explicit stages, its stop, and what its end leaves.

Spawn (blocking, on the agent's work pool; `spawn`), stage by stage, each a function of the start
spec and what the stages before it made, as Backend.AI's agent provisions a kernel in stages
(`kernel_lifecycle`: scratch, resources, environ, mounts, container create/start):

1. `stage_mig`: the MIG instance the spec's `mig` block asks for, created or reused (issue 4);
   its device entry replaces the GPU's.
2. `stage_work_dir`: the session's working directory `<scratch_root>/<session id>` and its
   `.fgpu/bin`.
3. `stage_allocation`: the allocation document (`.fgpu/allocation.json`, protocol.environment) the
   virtual nvidia-smi reads.
4. `stage_tools`: the runtime's tools (the virtual nvidia-smi) in `.fgpu/bin`.
5. `stage_folders`: the owner's persistent folder, its projects' and those shared with the owner
   (agent.files), linked at ~/data, ~/projects/<name> and ~/shared/<name> (the process runtime)
   or named for the docker runtime to mount; a read-only share is mounted read-only by both.
6. `stage_environment`: the environment contract (DESIGN.md; protocol.environment) with the paths
   as the session sees them, and its prompt.
7. `stage_command`: the argv: the command through the shell, or an interactive shell.
8. `stage_process`: the process (or container) through the runtime.

A stage that raises ends the spawn (the agent reports ERROR with the reason; a process that
exists is killed: `Agent._abandon`). Stop (`signal_until_exit`): SIGHUP and SIGTERM to every
process of the session, SIGHUP again within KILL_GRACE_S, then SIGKILL. End: `reap_and_kill`,
`wait_gone` (every process of the session gone before TERMINATED frees its slice), and the sweep
of ended sessions' working directories (`sweep_scratch`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import protocol
from agent import files as session_files
from agent import mig as mig_runtime
from agent import session_exec
from agent.mounts import NO_FOLDERS, Folders
from agent.session_apps import SessionApps
from protocol.environment import allocation_document, session_environment
from agent.runtimes import ProcessRuntime, Runtime
from protocol.messages import NodeName, StartSpec

log = logging.getLogger(__name__)

KILL_GRACE_S = 3.0
# Within the grace, SIGHUP again after this many seconds, then after twice as long each time: an
# interactive bash that takes the first while it starts up (its handler installed, its readline
# loop not yet entered) notes it and then waits at its prompt (seen on about 1 stop in 100 made
# within 30 ms of the launch: benchmarks/launch.py); the next SIGHUP ends it.
RESIGNAL_S = 0.05
KILL_WAIT_S = 2.0  # after SIGKILL, how long TERMINATED waits for the session's processes to be gone


@dataclass(frozen=True)
class Node:
    """What a spawn needs of its node: its `name`, `scratch_root` (working directories), `data_root` (users'
    persistent folders; None: none), the `runtime` (agent.runtimes.Runtime: the process or docker
    runtime), the node's `mig` manager, `mock` (a mock node: the allocation document says so),
    `mps` (the node runs NVIDIA MPS) and its inventory's `attributes`."""

    name: NodeName
    scratch_root: Path
    data_root: Path | None
    runtime: Runtime
    mig: mig_runtime.MigManager
    mock: bool
    mps: bool
    attributes: dict[str, Any]


@dataclass(frozen=True)
class WorkDir:
    path: Path  # <scratch_root>/<session id>
    bin_dir: Path  # its .fgpu/bin, first on the session's PATH


@dataclass(frozen=True)
class Spawned:
    """What a spawn made: the runtime's `handle` and what the agent keeps of the session: its
    working directory, environment and data folders."""

    handle: Any
    work_dir: Path
    env: dict[str, str]
    folders: Folders = NO_FOLDERS


def stage_mig(node: Node, start: StartSpec) -> StartSpec:
    """The start spec with its MIG block carried out (agent.mig.prepare_spec: the GPU's device
    replaced by the MIG device); the same spec without one. Raises MigError."""
    return mig_runtime.prepare_spec(node.mig, start)


def stage_work_dir(node: Node, start: StartSpec) -> WorkDir:
    path = node.scratch_root / start.session_id
    bin_dir = path / ".fgpu" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    return WorkDir(path, bin_dir)


def stage_allocation(node: Node, start: StartSpec, work: WorkDir) -> Path:
    """Write the allocation document; returns its path (on the node)."""
    document = allocation_document(start, node=node.name, mock=node.mock, attributes=node.attributes)
    path = work.path / ".fgpu" / "allocation.json"
    path.write_text(json.dumps(document, indent=2))
    return path


def stage_tools(node: Node, work: WorkDir) -> None:
    node.runtime.install_tools(work.bin_dir)


def stage_folders(node: Node, start: StartSpec, work: WorkDir) -> Folders:
    """The owner's persistent folder, its projects' and those shared with it, made under the
    node's data root and shown in the working directory (agent.files.link_data: linked for the
    process runtime, empty mount points for the docker runtime's mounts)."""
    folder = session_files.data_folder(node.data_root, start.owner_id)  # the owner's persistent folder
    projects = session_files.project_folders(node.data_root, {p.name: p.id for p in start.projects})  # and its projects'
    shared = session_files.shared_folders(node.data_root, [f.encode() for f in start.shared])  # and those shared with it
    link = isinstance(node.runtime, ProcessRuntime)
    session_files.link_data(work_dir=work.path, folder=folder, link=link, projects=projects, shared=shared)
    return Folders(folder, projects, shared)


def stage_environment(node: Node, start: StartSpec, work: WorkDir) -> dict[str, str]:
    """The session's environment (protocol.environment.session_environment) with the paths where the
    session sees its files (`runtime.paths`), and its prompt."""
    inside = node.runtime.paths(work.path)
    env = session_environment(
        start,
        allocation_path=inside.allocation,
        bin_dir=inside.bin_dir,
        work_dir=inside.home,
        base_path=node.runtime.base_path(),
        mps=node.mps,
    )
    env["PS1"] = f"{start.owner}@{start.name}:\\w\\$ "
    return env


def stage_command(node: Node, start: StartSpec) -> list[str]:
    """The command through the shell (the session image's, where it names one), or an
    interactive shell (bash without its profile and rc files)."""
    shell = start.shell or node.runtime.shell()
    if start.command:
        return [shell, "-c", start.command]
    return [shell, "--noprofile", "--norc", "-i"] if shell.endswith("bash") else [shell, "-i"]


def stage_process(
    node: Node,
    start: StartSpec,
    folders: Folders,
    argv: list[str],
    env: dict[str, str],
    work: WorkDir,
    progress: Callable[[str], None],
) -> Any:
    """The session's process (its own process session, or its own container) through the runtime,
    with its data `folders`: the runtime's handle. `progress(text)`: the runtime's word on a slow
    start (an image pull)."""
    return node.runtime.spawn(spec=start, folders=folders, argv=argv, env=env, work_dir=work.path, progress=progress)


def spawn(node: Node, start: StartSpec, *, progress: Callable[[str], None]) -> Spawned:
    """Blocking: the stages in order (see the module docstring). Raises what a stage raises."""
    start = stage_mig(node, start)
    work = stage_work_dir(node, start)
    stage_allocation(node, start, work)
    stage_tools(node, work)
    folders = stage_folders(node, start, work)
    env = stage_environment(node, start, work)
    argv = stage_command(node, start)
    handle = stage_process(node, start, folders, argv, env, work, progress)
    return Spawned(handle, work.path, env, folders)


# --- stop and end ------------------------------------------------------------------------

OnProcess = Callable[..., Awaitable[Any]]  # on_process(fn, *args): a call on the session's process


async def signal_until_exit(
    process: Any, exited: asyncio.Event, on_process: OnProcess, *, grace_s: float = KILL_GRACE_S, resignal_s: float = RESIGNAL_S
) -> None:
    """Stop a session's processes: SIGHUP (ends an interactive shell, which ignores SIGTERM) and
    SIGTERM (what ignores SIGHUP: nohup) to every process of the session, every group; SIGHUP again
    after `resignal_s`, then after twice as long each time; SIGKILL to all once `grace_s` seconds
    passed without the leader's exit (`exited`). Returns when the leader exited or all got SIGKILL."""
    await on_process(process.signal_all, signal.SIGHUP, signal.SIGTERM)
    loop = asyncio.get_running_loop()
    deadline, pause = loop.time() + grace_s, resignal_s
    while not exited.is_set():
        remaining = deadline - loop.time()
        if remaining <= 0:  # the leader did not end in time (once it has, the agent's exit handling kills the rest)
            await on_process(process.kill_all)
            return
        try:
            await asyncio.wait_for(exited.wait(), timeout=min(pause, remaining))
        except TimeoutError:
            if loop.time() < deadline:
                await on_process(process.signal_all, signal.SIGHUP)
            pause *= 2


def reap_and_kill(process: Any) -> tuple[int, int]:
    """Blocking, in one hop to a worker thread: the exited leader's status (`process.wait`) and
    how many processes of its session were left and got SIGKILL (`process.kill_all`)."""
    return process.wait(), process.kill_all()


async def wait_gone(process: Any, *, deadline: float, alive: Callable[[], Awaitable[bool]]) -> bool:
    """Until no process of the session is left, or the loop's clock passes `deadline`: woken by
    its cgroup's events where it has a cgroup (`process.watch()`: the kernel says when its last
    process exited; it notifies a cgroup.events file at most every 10 ms, so a session ending
    within 10 ms of its last change may wait up to that), else `alive()` (the runtime's scan, off
    the loop) polled every 5 ms at first, then less often. Returns whether none is left (False:
    the deadline came first)."""
    loop = asyncio.get_running_loop()
    watch = getattr(process, "watch", lambda: None)()  # a docker session has none
    if watch is None:
        pause = 0.005
        while loop.time() < deadline:
            if not await alive():
                return True
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.1)
        return False
    changed = asyncio.Event()

    def on_change() -> None:
        watch.clear()
        changed.set()

    loop.add_reader(watch.fd, on_change)
    try:
        while watch.populated():  # read after arming: an exit in between still wakes us
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(changed.wait(), timeout=remaining)
            except TimeoutError:
                return not watch.populated()
            changed.clear()
        return True
    finally:
        loop.remove_reader(watch.fd)
        watch.close()


def exit_code_of(status: int) -> int:
    """A wait status as shells report it: killed by signal N → 128+N."""
    return status if status >= 0 else 128 - status


def outlives_agent(process: Any) -> bool:
    """Whether a session's process (a runtime's handle) runs on when its agent exits, for the next
    start to adopt: a held process-runtime session (agent.holder) or a docker container."""
    return bool(getattr(process, "outlives_agent", False))


def sweep_scratch(scratch_root: Path, *, keep: set[str], older_than_s: float) -> int:
    """Remove the working directories under `scratch_root` of sessions not in `keep` that were
    last changed more than `older_than_s` seconds ago (the agent touches one when its session
    ends); never the agent's own entries, whose names start with a dot (the process runtime's
    `.holders`: its held sessions' sockets and records, which the next start adopts them by).
    Returns how many were removed."""
    horizon, removed = time.time() - older_than_s, 0
    try:
        entries = list(os.scandir(scratch_root))
    except FileNotFoundError:
        return 0
    for entry in entries:
        try:
            stale = entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mtime < horizon
        except OSError:
            continue
        if stale and entry.name not in keep and not entry.name.startswith("."):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed += 1
    return removed


# --- start, stop and end, on the agent's loop -----------------------------------------------


class SessionLifecycle:
    """Start, stop and end of one agent's sessions, on its loop (idempotent by session id: the
    Agent's docstring says how the manager's re-sent starts and stops are answered).

    `agent`: the Agent that wires the parts this drives: its `sessions` ({id: RunningSession}),
    `_starting` and `_cancelled` (ids), `_spawn` (a RunningSession from a StartSpec, blocking) and
    `_attach` (its terminal pipe and log started, then `watch`), `link` (agent.manager_link:
    reports and remembered ends), `layer` and `channel` (its terminal groups), `loop`, `_in` and
    `_work` (blocking work off the loop), `_on_process` (a call on a session's process)."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.removals: set[asyncio.Future[None]] = set()  # ended sessions' removals under way (`wait_exit`, `removed`)

    async def start(self, spec: StartSpec) -> None:
        """Start a session (idempotent by its id: see the class docstring). Whatever fails once
        the process exists kills it and reports ERROR: no half-started session is left."""
        session_id = spec.session_id
        if session_id in self.agent._starting:
            return  # a redelivered start message: on its way
        running = self.agent.sessions.get(session_id)
        if running is not None:  # a re-sent start: the manager may have missed the report
            if not running.stopping:
                await self.agent.link.report(session_id, "RUNNING", "")
            return
        if session_id in self.agent.link.ended:  # it ran here and ended: never run it twice
            await self.agent.link.report_end(session_id)
            return
        self.agent._starting.add(session_id)
        # PREPARING is published while the session is prepared (the launch does not wait for the
        # publish), and before whatever is reported next (awaited below).
        preparing = asyncio.ensure_future(
            self.agent.link.report(session_id, "PREPARING", "preparing the working directory and environment", retry=False)
        )
        # Its terminal group is joined while it is prepared too, so RUNNING waits for neither (issue
        # 35.3: a Redis round trip); a message for it meanwhile is dropped, as before the join (no
        # such session here yet).
        group = protocol.pty_group(self.agent.node, session_id)
        joined = asyncio.ensure_future(self._join(group, session_id))
        try:
            running = await self.agent._in(self.agent._work, self.agent._spawn, spec)
            self.agent.sessions[session_id] = running
            self.agent._attach(running)
        except Exception as exc:
            log.exception("agent %s: session %s failed to start", self.agent.node, session_id)
            if running is not None:
                await self.abandon(running)
            await preparing
            if await joined:
                await self._leave(group, session_id)
            await self.agent.link.end(session_id, "ERROR", f"the agent could not start the session: {exc}", None)
            return
        finally:
            self.agent._starting.discard(session_id)
        await preparing
        await joined
        if session_id in self.agent._cancelled:  # terminated while it was being prepared
            self.agent._cancelled.discard(session_id)
            await self.stop(session_id, reason="terminated while starting")
            return
        await self.agent.link.report(session_id, "RUNNING", "")

    async def _join(self, group: str, session_id: str) -> bool:
        """Join a starting session's terminal group; False where the layer is down (logged: the
        heartbeat's group refresh joins it later, once the session runs)."""
        try:
            await self.agent.layer.group_add(group, self.agent.channel)
            return True
        except Exception:
            log.warning("agent %s: could not join the terminal group of %s yet", self.agent.node, session_id)
            return False

    async def _leave(self, group: str, session_id: str) -> None:
        try:
            await self.agent.layer.group_discard(group, self.agent.channel)
        except Exception:
            log.warning("agent %s: could not leave the terminal group of %s", self.agent.node, session_id)

    def watch(self, running: Any) -> None:
        """Watch a new session's exit (its leader's pidfd; a 0.2 s poll where the kernel has none)
        and handle its end once it comes (`wait_exit`, kept as `running.exited`)."""
        exit_fd = running.process.exit_fd()
        running.pidfd = -1 if exit_fd is None else exit_fd
        if running.pidfd >= 0:
            self.agent.loop.add_reader(running.pidfd, self._on_exit, running)
        else:
            running.exit_poll = asyncio.create_task(self._poll_exit(running))
        running.exited = asyncio.create_task(self.wait_exit(running))

    def _on_exit(self, running: Any) -> None:
        self.agent.loop.remove_reader(running.pidfd)
        os.close(running.pidfd)
        running.pidfd = -1
        running.exit_event.set()

    async def _poll_exit(self, running: Any) -> None:
        while await self.agent._in(self.agent._work, running.process.poll) is None:
            await asyncio.sleep(0.2)
        running.exit_event.set()

    async def abandon(self, running: Any) -> None:
        """Undo a start that failed after its process existed: kill every process, close the PTY."""
        self.agent.sessions.pop(running.session_id, None)
        self.let_go(running)
        await self.agent._in(self.agent._work, running.process.kill_all)
        await self.agent._in(self.agent._work, running.process.wait)
        await self.agent._in(self.agent._work, running.process.remove)

    def let_go(self, running: Any) -> None:
        """Stop watching a session and close this agent's ends of it (its stream, relays, direct
        streams, exit watch), leaving its processes alone."""
        SessionApps.close_relays(running)
        running.pipe.let_go()
        for task in (running.log.task, running.exited, running.exit_poll):
            if task is not None:
                task.cancel()
        if running.pidfd >= 0:
            self.agent.loop.remove_reader(running.pidfd)
            os.close(running.pidfd)
            running.pidfd = -1

    async def wait_exit(self, running: Any) -> None:
        """Once the session's leader exited: end every process of the session, drain and close
        the PTY, report TERMINATED, then ship the rest of the log (also when any step fails).
        What the session leaves once none of its processes is (its cgroup, a held session's
        holder, its outbound network's helper, its container) is removed beside the report,
        which does not wait for that (issue 35.3: 11-33 ms of a terminate at load 12-16); where
        some process may be left (it outlived KILL_WAIT_S, or ending it failed), the removal,
        which kills what is left, comes first, as before."""
        await running.exit_event.wait()
        log_ready = False  # the PTY drained: the log's last batch holds everything
        gone = False  # every process of the session is gone (zombies hold nothing)
        reason = ""
        try:
            # The session ends with its shell: background jobs (own process groups, nohup'd,
            # setsid'd) must not outlive the allocation that is about to be released.
            code, left = await self.agent._on_process(running, reap_and_kill, running.process)
            gone = not left
            if left:
                # A signal takes effect when its process next runs: report TERMINATED once none
                # is left (zombies hold nothing), so the slice is free when the manager releases
                # it.
                alive = partial(self.agent._in, self.agent._work, running.process.alive)
                gone = await wait_gone(running.process, deadline=self.agent.loop.time() + KILL_WAIT_S, alive=alive)
            # Let the PTY drain what the process wrote last (a background child may keep it
            # open: then give up after a second), then close it.
            try:
                await asyncio.wait_for(running.pipe.eof.wait(), timeout=1.0)
            except TimeoutError:
                pass
            running.pipe.end_output()
            try:
                assert running.pipe.pump_task is not None  # _attach started it before this task
                await asyncio.wait_for(asyncio.shield(running.pipe.pump_task), timeout=10)
            except TimeoutError:
                log.warning("agent %s: the last terminal output of %s was not sent in time", self.agent.node, running.session_id)
            log_ready = True
        except Exception as exc:
            log.exception("agent %s: ending session %s failed", self.agent.node, running.session_id)
            gone = False
            reason = f"the agent could not end the session cleanly: {exc}"
            running.pipe.close()
            await self.agent._on_process(running, running.process.kill_all)
            code = await self.agent._in(self.agent._work, running.process.wait)
        self.agent.sessions.pop(running.session_id, None)
        SessionApps.close_relays(running)
        exit_code = exit_code_of(code)  # killed by signal N → 128+N, as shells report it
        reason = (
            reason or running.stopping or running.process.end_reason(exit_code) or f"the process exited with code {exit_code}"
        )
        # Its reason is read first (its cgroup's OOM kills), the removal then started: beside the
        # report where none of its processes is left, else awaited before it.
        removal = asyncio.ensure_future(self._remove(running))
        self.removals.add(removal)
        removal.add_done_callback(self.removals.discard)
        if not gone:
            await removal
        running.pipe.exit_direct(exit_code)  # after the last frame on each direct stream, which then closes
        try:
            os.utime(running.work_dir)  # the retention of the working directory counts from here
        except OSError:
            pass
        # The report first (it frees the slice), the terminals' exit frame beside it; the rest of
        # the log after it, so that the manager takes the report first (the log reads as
        # incomplete until its last batch; the two were never ordered: two queues).
        await asyncio.gather(
            self.agent.link.end(running.session_id, "TERMINATED", reason, exit_code), self.exit_frame(running, exit_code)
        )
        await removal  # `stop` and the agent's shutdown return once it is done
        if log_ready:
            try:
                await running.log.close()
            except Exception:
                log.exception("agent %s: shipping the last output of %s failed", self.agent.node, running.session_id)

    async def removed(self) -> None:
        """Until what ended sessions left is removed: the agent's shutdown waits for it before its
        runtime closes (the process runtime's parent cgroup, once empty)."""
        while self.removals:
            await asyncio.wait(list(self.removals))

    async def _remove(self, running: Any) -> None:
        """What an ended session left (`process.remove`, on the work pool): its cgroup, a held
        session's holder, its network's helper, its container; a failure is logged."""
        try:
            await self.agent._in(self.agent._work, running.process.remove)
        except Exception:
            log.exception("agent %s: could not remove what session %s left", self.agent.node, running.session_id)

    async def exit_frame(self, running: Any, exit_code: int) -> None:
        """Tell the session's terminals it ended (`terminal.exit`) and leave its PTY group."""
        try:
            await self.agent.layer.group_send(
                protocol.terminal_group(self.agent.node, running.session_id), {"type": "terminal.exit", "code": exit_code}
            )
            await self.agent.layer.group_discard(protocol.pty_group(self.agent.node, running.session_id), self.agent.channel)
        except Exception:
            log.warning("agent %s: could not tell the terminal of %s that it ended", self.agent.node, running.session_id)

    async def stop(self, session_id: str, *, reason: str) -> None:
        running = self.agent.sessions.get(session_id)
        if running is None and session_id in self.agent._starting:
            self.agent._cancelled.add(session_id)  # _start kills it as soon as the process exists
            return
        if running is None:
            if session_id in self.agent.link.ended:  # ended here already: say so again (the report may be lost)
                await self.agent.link.report_end(session_id)
            else:  # never here (or the agent restarted): say so
                await self.agent.link.end(session_id, "TERMINATED", f"{reason} (no process was running)", None)
            return
        if running.stopping:
            return
        running.stopping = reason
        if running.execs:
            await self.agent._in(self.agent._work, session_exec.kill_execs, running.process, running.execs)
        await signal_until_exit(
            running.process,
            running.exit_event,
            partial(self.agent._on_process, running),
            grace_s=KILL_GRACE_S,
            resignal_s=RESIGNAL_S,
        )
        if running.exited is not None:
            await asyncio.shield(running.exited)  # returns once TERMINATED has been reported

    def preempt_notice(self, running: Any, command: Any) -> None:
        """A preemption notice (protocol.channel.PtyPreempt), once per notice and never to a session
        that is stopping: its text as a line of the session's output, terminal and log (before
        anything the signal makes the program print), then the signal to the session's command's
        process group (a container: to its init, which passes it on)."""
        if running.stopping or running.preempt_notice == command.notice:
            return  # the manager re-sends it every pass while the notice stands
        running.preempt_notice = command.notice
        self.agent._output(running, f"\r\n[fgpu: {command.text}]\r\n")
        running.log.wake.set()  # the log has it now, not at the next batch
        log.info(
            "agent %s: session %s preempted: %s sent (notice %s)",
            self.agent.node,
            running.session_id,
            command.signal,
            command.notice,
        )
        self.agent._in_background(self.agent._on_process(running, running.process.signal_group, signal.Signals[command.signal]))

    async def sync(self, keep: set[str]) -> None:
        await asyncio.gather(
            *(
                self.stop(session_id, reason="the manager no longer knows this session")
                for session_id in list(self.agent.sessions)
                if session_id not in keep
            )
        )
