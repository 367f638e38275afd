"""Where a session's processes run: the runtime interface the agent drives, and the `process`
runtime (a PTY process group of the agent's own user on the node, tracked by a cgroup v2 of its
own where the agent can create one, else by scanning /proc).

The agent (agent.core) is the same for every runtime: it reads and writes a
session's terminal through `SessionHandle.fd` when the loop says it is ready, learns of its end
from `exit_fd()` (or the terminal's end of file where a runtime has none), and stops it with
`signal_all` / `kill_all`. A runtime says how a session is started (`Runtime.spawn`), how a
command runs beside it (`SessionHandle.exec_popen`), and what an earlier run of the agent left
(`Runtime.clean_up_at_start`). `agent.docker_runtime` is the other runtime: one
container per session.

Paths a runtime gives a session: `paths(work_dir)` maps the agent's view of the session's
working directory and its `.fgpu` metadata to the session's own view (the same on the host;
`/home/work` and `/opt/fgpu` in a container).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import pty
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import protocol
from protocol.files import PROJECTS_DIR, SHARED_DIR
from protocol.units import format_binary_size
from protocol.messages import StartSpec
from agent.mounts import NO_FOLDERS, Folders
from agent.network import installation_id
from agent.holder import receive_fd
from agent.limits import Hierarchies, SessionLimits, cgroup_mounts, remove_dir
from agent.sandbox import SANDBOX_AUTO, SANDBOX_BUBBLEWRAP, SANDBOX_NONE, Sandbox, SandboxError, SlirpNetwork, read_init_pid
from agent.sandbox import NVIDIA_PROC, become_subreaper, gpu_devices, netns_socket, reap_orphans, spec_gpus, wait_set_up
from agent.sandbox import probe as probe_sandbox

log = logging.getLogger(__name__)

PROCESS = "process"
DOCKER = "docker"
RUNTIMES = (PROCESS, DOCKER)
CGROUP_AUTO = "auto"  # agent.toml [container] cgroup-root: find a writable cgroup2 hierarchy
CGROUP_NONE = "none"  # never: always the /proc scan
CGROUP_EMPTY_WAIT_S = 2.0  # how long removing a cgroup waits for its killed processes to be gone
SANDBOX_REAP_S = 1.0  # how long killing a sandboxed session waits for bwrap to reap the sandbox's init
CGROUP_RMDIR_RETRY_S = 0.005  # between tries to remove a cgroup whose killed processes are still exiting
# `SessionCgroup.wait_empty`'s first look again at cgroup.events (then twice as long each time, up to CGROUP_NOTIFY_S,
# the kernel's least time between two notifications of one file): every terminate of a held session removes its
# holder's cgroup right after killing the holder (issue 35.3: woken by the event only, that wait was 0.8-16.5 ms,
# median 7.6, where it waited at all, at load 12; read again as here, 0.7-10 ms, median 4.5).
CGROUP_EMPTY_POLL_S = 0.0005
CGROUP_NOTIFY_S = 0.01


@dataclass(frozen=True)
class SessionPaths:
    """Where a session sees its files: its home (the working directory), the directory of the
    virtual nvidia-smi, and its allocation document."""

    home: str
    bin_dir: str
    allocation: str


class Runtime(Protocol):
    """What agent.lifecycle's spawn asks of a runtime (ProcessRuntime here, agent.docker_runtime's
    DockerRuntime): where the session sees its files (`paths` of its working directory on the
    node), the shell of an image that names none, the PATH after the tools' directory, the tools
    (the virtual nvidia-smi) in `bin_dir`, and the session's process or container (`spawn`, blocking:
    the runtime's handle, a SessionHandle or a DockerSession)."""

    name: str

    def paths(self, work_dir: Path) -> SessionPaths: ...

    def shell(self) -> str: ...

    def base_path(self) -> str: ...

    def install_tools(self, bin_dir: Path) -> None: ...

    def spawn(
        self,
        *,
        spec: StartSpec,
        argv: list[str],
        env: dict[str, str],
        work_dir: Path,
        folders: Folders = ...,
        progress: Callable[[str], None] | None = ...,
    ) -> Any: ...


class SessionHandle:
    """One running session as the agent drives it (the `process` runtime's; see DockerSession).

    `fd`: the terminal stream, non-blocking (`read` raises BlockingIOError when nothing waits,
    returns b"" at its end; `write` raises BlockingIOError when full). `pid`: the host pid of
    the session's leader, where there is one."""

    outlives_agent = False  # its PTY's master is the agent's: the session ends with the agent (HeldSession's does not)

    def __init__(
        self,
        session_id: str,
        process: subprocess.Popen | None,
        master_fd: int,
        *,
        env: dict,
        work_dir: Path,
        cgroup: SessionCgroup | None = None,
        sandbox: Sandbox | None = None,
        init_pid: int = 0,
        status_fd: int = -1,
        network: SlirpNetwork | None = None,
    ):
        self.session_id = session_id
        self.process = process
        self.pid = process.pid if process is not None else 0  # a HeldSession's leader is its holder's child
        self.cgroup = cgroup  # its processes, where the runtime gave it a cgroup; else found by scanning /proc
        self.fd = master_fd
        self.env = env
        self.work_dir = work_dir
        self.sandbox = sandbox  # where it runs confined (agent.sandbox): exec enters it
        self.init_pid = init_pid  # host pid of its sandbox's init (bwrap's child), whose namespaces exec enters
        self._status_fd = status_fd  # bwrap's --json-status-fd, read end: open till the end (bwrap writes its exit there)
        self.network = network  # its outbound network's slirp4netns (agent.sandbox.SlirpNetwork), ended by `remove`
        # Its init's pidfd (to see it exit and reap it, whatever pid it leaves free) and its PID
        # namespace (which processes of its cgroup are inside the sandbox); -1 and "" without one.
        self._init_fd, self._pid_namespace = _open_init(init_pid) if sandbox is not None and init_pid else (-1, "")
        # No process older than its leader is the session's (what a scan reads the environment of).
        self.started = None if cgroup is not None else _start_ticks("/proc", str(self.pid))

    def read(self, size: int) -> bytes:
        try:
            return os.read(self.fd, size)
        except BlockingIOError:
            raise
        except OSError:  # EIO: the last process holding the PTY is gone
            return b""

    def write(self, data) -> int:
        return os.write(self.fd, data)

    def close_stream(self) -> None:
        os.close(self.fd)

    def exit_fd(self) -> int | None:
        """A descriptor that becomes readable when the leader exits (its pidfd), or None."""
        try:
            return os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            return None

    def poll(self) -> int | None:
        assert self.process is not None
        return self.process.poll()

    def wait(self) -> int:
        """Blocking: the leader's exit status (negative: killed by that signal, as Popen says)."""
        assert self.process is not None
        return self.process.wait()

    def resize(self, rows: int, cols: int) -> None:
        set_winsize(self.fd, rows, cols)

    @property
    def quick(self) -> bool:
        """Whether `signal_all`, `kill_all` and, once the leader exited, `wait` are a few system
        calls that take microseconds (kill(2), one read of cgroup.procs, one write of
        cgroup.kill): true for a session in its own cgroup, where the agent makes them on its
        event loop instead of a hop to a worker thread and back (issue 14: terminate's
        latency); false where they scan /proc, and in a sandbox (`kill_all` waits for its leader
        to reap the sandbox's init)."""
        return self.cgroup is not None and self.sandbox is None

    def signal_all(self, *sigs: int) -> None:
        """Blocking: each of `sigs`, in order, to every process of the session: the leader
        first (an interactive shell ends on SIGHUP without waiting for the rest), then the
        others: those in its cgroup (one read of cgroup.procs) or, without one, those in its
        process session (one scan of /proc). In a sandbox only the processes inside it (its PID
        namespace) but its init: the leader (bwrap) ends when the init does, which ends with the
        session's command, and an exec's nsenter when its child does (killed first, they would
        leave their child an orphan: `remove` reaps those)."""
        if self.sandbox is None:
            for sig in sigs:
                _kill(self.pid, sig)
        members = session_members(self.pid) if self.cgroup is None else self.cgroup.pids()
        for pid in members:
            if pid == self.pid or (self.sandbox is not None and (pid == self.init_pid or not self._inside(pid))):
                continue
            for sig in sigs:
                _kill(pid, sig)

    def signal_group(self, sig: int) -> int:
        """Blocking: `sig` to every process of the session's command's process group (a
        preemption notice, as Slurm's `--signal` reaches a job's processes): outside a sandbox
        the leader's group (killpg: the leader runs the command); in one, the processes inside it
        in the command's group, never its init or the leader (bwrap), which would end it.
        Returns how many were signalled (0: the group is gone)."""
        if self.sandbox is None:
            try:
                os.killpg(self.pid, sig)
                return 1
            except (ProcessLookupError, PermissionError):
                return 0
        try:
            group = os.getpgid(self.command_pid)
        except OSError:
            return 0
        members = session_members(self.pid) if self.cgroup is None else self.cgroup.pids()
        signalled = 0
        for pid in members:
            if pid in (self.pid, self.init_pid) or not self._inside(pid):
                continue
            try:
                if os.getpgid(pid) == group:
                    signalled += _kill(pid, sig)
            except OSError:  # gone
                continue
        return signalled

    @property
    def command_pid(self) -> int:
        """Blocking, one read of /proc: the host pid of the process that runs the session's
        command: in a sandbox its init's child (the leader is bwrap, outside it), else the leader
        (`pid`); the leader's once the command has ended."""
        if self.sandbox is None:
            return self.pid
        try:
            with open(f"/proc/{self.init_pid}/task/{self.init_pid}/children") as f:
                children = f.read().split()
        except OSError:
            return self.pid
        return int(children[0]) if children else self.pid

    def _inside(self, pid: int) -> bool:
        """Whether process `pid` lives in the session's sandbox (its PID namespace)."""
        try:
            return os.readlink(f"/proc/{pid}/ns/pid") == self._pid_namespace
        except OSError:  # gone
            return False

    def kill_all(self) -> int:
        """Blocking: SIGKILL to every live process of the session: its cgroup's (cgroup.kill),
        or without one those of its process session and those that escaped it (they carry its
        FGPU_SESSION_ID; one scan of /proc). Returns how many were signalled (0: none was left
        but zombies, so there is nothing to wait for). In a sandbox its init is killed first,
        which ends every process of its PID namespace, and the leader (bwrap) is given up to
        SANDBOX_REAP_S to reap it and exit before the rest is killed (`signal_all`)."""
        if self.sandbox is not None and _kill(self.init_pid, signal.SIGKILL):
            _wait_exit(self.pid, SANDBOX_REAP_S)
        if self.cgroup is not None:
            return self.cgroup.kill()
        found = session_processes(self.session_id, self.pid, live_only=True, since=self.started)
        return sum(_kill(pid, signal.SIGKILL) for pid in found)

    def alive(self) -> bool:
        """Blocking: whether any process of the session is left (zombies do not count)."""
        if self.cgroup is not None:
            return self.cgroup.populated()
        return bool(session_processes(self.session_id, self.pid, live_only=True, since=self.started))

    def pids(self) -> list[int]:
        """Blocking: the pids of the session's live processes (as `alive` finds them); with a
        cgroup, the leader's while the cgroup lists none: the leader joins it a moment after
        the spawn (LEADER_SCRIPT), and a usage sample meanwhile would find the session empty."""
        if self.cgroup is not None:
            found = self.cgroup.pids()
            if not found:
                fields = _stat_fields("/proc", str(self.pid))
                if fields is not None and fields[0] != "Z":
                    return [self.pid]
            return found
        return session_processes(self.session_id, self.pid, live_only=True, since=self.started)

    def watch(self) -> CgroupWatch | None:
        """A watch whose `fd` turns readable when the session's last process may have exited
        (its cgroup.events), or None (no cgroup: poll `alive`). The caller closes it."""
        return self.cgroup.watch() if self.cgroup is not None else None

    def exec_popen(self, argv: list[str], *, stdout, stderr) -> subprocess.Popen:
        """Start `argv` beside the session: its environment and working directory, stdin from
        /dev/null, in a process session of its own (so `signal_exec` reaches all it starts) and
        in the session's cgroup where it has one (so it ends with the session); inside its
        sandbox where it has one (its namespaces, uid and gid: Sandbox.enter, util-linux
        nsenter, whose exit status is the command's). Raises FileNotFoundError /
        PermissionError as Popen does (for the command itself only outside a sandbox: inside,
        a missing command is nsenter's exit status 127)."""
        if self.sandbox is not None:
            argv = self.sandbox.enter(self.init_pid, argv, cwd=self.work_dir)
        return popen_leader(
            argv, cgroup=self.cgroup, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, cwd=self.work_dir, env=self.env
        )

    @property
    def app_socket(self):
        """Where its apps listen in a network namespace of its own (a sandbox without the node's
        network): a blocking function that makes a TCP socket in that namespace (unconnected;
        agent.sandbox.netns_socket; raises OSError); None: its apps are on the node's network."""
        if self.sandbox is None or self.sandbox.share_net:
            return None
        return partial(netns_socket, self.init_pid)

    def signal_exec(self, process: subprocess.Popen, sig: int) -> None:
        """Blocking: `sig` to a command started by `exec_popen` and everything it started in its
        process session (with a cgroup: those of the cgroup's processes, by getsid). In a sandbox
        `process` is nsenter, which is spared: it ends when its child, the command, does (killed
        first, it would leave the command an orphan outside the sandbox's reach)."""
        if self.cgroup is None:
            for pid in session_members(process.pid):
                if self.sandbox is None or pid != process.pid:
                    _kill(pid, sig)
            return
        if self.sandbox is None:
            _kill(process.pid, sig)
        for pid in self.cgroup.pids():
            try:
                if pid != process.pid and os.getsid(pid) == process.pid:
                    _kill(pid, sig)
            except OSError:  # gone meanwhile
                pass

    def end_reason(self, exit_code: int) -> str:
        """Why it ended, where the runtime knows more than the exit code: its cgroup's OOM kills
        ("killed: out of memory at its 64 MiB limit (1 process; exit code -9)"), else ""."""
        kills = self.cgroup.oom_kills() if self.cgroup is not None else 0
        if not kills:
            return ""
        limit = self.cgroup.memory_limit() if self.cgroup is not None else 0
        at = f" at its {format_binary_size(limit)} limit" if limit else ""
        return f"killed: out of memory{at} ({kills} process{'es' if kills > 1 else ''}; exit code {exit_code})"

    def remove(self) -> None:
        """Blocking: what is left once the session ended: its cgroup, removed (what is still in
        it is killed first), its outbound network's slirp4netns ended, its sandbox's status pipe
        closed, and its sandbox's init and
        orphans reaped (agent.sandbox.reap_orphans: this process is their subreaper), waiting
        up to SANDBOX_REAP_S for the init to exit."""
        if self.cgroup is not None:
            self.cgroup.remove()
        if self.network is not None:
            self.network.close()
            self.network = None
        if self._status_fd >= 0:
            os.close(self._status_fd)
            self._status_fd = -1
        if self._init_fd >= 0:
            deadline = time.monotonic() + SANDBOX_REAP_S
            while True:
                reap_orphans()  # first: an orphaned zombie in its namespace holds the init until reaped
                if select.select([self._init_fd], [], [], 0)[0]:
                    break
                if time.monotonic() >= deadline:
                    log.warning("the sandbox init of session %s did not exit in time", self.session_id)
                    break
                select.select([self._init_fd], [], [], 0.01)
            reap_orphans()  # the init itself, where it came to this process
            os.close(self._init_fd)
            self._init_fd = -1


HOLDER_SCRIPT = Path(__file__).resolve().parent / "holder.py"  # run as a file (`python -I`): it imports only the stdlib
HOLDERS_DIR = ".holders"  # under the agent's scratch root: each held session's socket, exit status and record
# A held session's files there, `<id><suffix>`: its exit status, its record, its socket, its apps' ports
# (agent.session_apps.app_record); removed with the session, or where its holder is gone.
HOLDER_FILES = (".exit", ".json", "", ".apps")
HOLDER_RING_BYTES = 64 * 1024  # the scrollback a holder keeps and replays (agent.core's SCROLLBACK_BYTES)
HOLDER_START_TIMEOUT_S = 10.0  # how long a spawn waits for its holder to say its leader runs
HOLDER_INPUT_BUFFER = 16 * 1024  # the agent's send buffer towards a holder: input held back beside the PTY's own
HOLDER_EXIT_WAIT_S = 2.0  # how long `wait` waits for a holder to write the status of its leader, once it exited
# `wait`'s first pause before it looks for that status again (then twice as long each time, up to 5 ms): every
# terminate waits for it, and a fixed 5 ms was 5.4 ms of a terminate's p50 (issue 35.3).
HOLDER_EXIT_POLL_S = 0.0005


class HeldSession(SessionHandle):
    """A session whose PTY a holder process owns (agent.holder), which outlives the agent: `fd` is
    the holder's Unix socket (output as it comes, the scrollback first; what is written there is
    the terminal's input), the PTY's master (sent by the holder) serves `resize`, the leader is the
    holder's child (its exit status is read from the holder's `<socket>.exit`). An agent that
    starts again re-attaches to it (`ProcessRuntime.clean_up_at_start`: `adopt`). The rest (its
    processes, cgroup, sandbox, exec) is SessionHandle's."""

    outlives_agent = True  # an agent that stops gracefully leaves it running, for the next start to adopt

    def __init__(
        self,
        session_id: str,
        pid: int,
        connection: socket.socket,
        master_fd: int,
        *,
        env: dict,
        work_dir: Path,
        exit_path: Path,
        holder_cgroup: SessionCgroup | None,
        holder_pid: int,
        cgroup: SessionCgroup | None = None,
        sandbox: Sandbox | None = None,
        init_pid: int = 0,
        status_fd: int = -1,
        network: SlirpNetwork | None = None,
        holder: subprocess.Popen | None = None,
    ):
        self.holder = holder  # the holder where this agent started it (reaped by `remove`); None once adopted
        self.master_fd = master_fd
        self.exit_path = exit_path
        self.holder_cgroup = holder_cgroup
        self.holder_pid = holder_pid
        super().__init__(
            session_id, None, connection.detach(), env=env, work_dir=work_dir, cgroup=cgroup, sandbox=sandbox,
            init_pid=init_pid, status_fd=status_fd, network=network,
        )  # fmt: skip
        self.pid = pid  # `fd` is the holder's connection, read and written as a PTY is (os.read, os.write)
        if cgroup is None:
            self.started = _start_ticks("/proc", str(pid))

    def close_stream(self) -> None:
        os.close(self.fd)
        os.close(self.master_fd)

    def resize(self, rows: int, cols: int) -> None:
        set_winsize(self.master_fd, rows, cols)

    def exit_fd(self) -> int | None:
        """The leader's pidfd, or None once the holder recorded its end (its pid may be another's)."""
        return None if self.exit_path.exists() else super().exit_fd()

    def poll(self) -> int | None:
        """The leader's exit status once it exited (the holder's record; negative: killed by that
        signal), else None; -SIGKILL where it is gone and its holder too, without a record."""
        try:
            return int(self.exit_path.read_text().strip())
        except (OSError, ValueError):
            pass
        if _running(self.pid) or _running(self.holder_pid):
            return None
        return -signal.SIGKILL

    def wait(self) -> int:
        """Blocking: the leader's exit status (as `poll`), waiting for it to exit and then up to
        HOLDER_EXIT_WAIT_S for its holder to write it."""
        _wait_exit(self.pid, 365 * 86400.0)
        deadline, pause = time.monotonic() + HOLDER_EXIT_WAIT_S, HOLDER_EXIT_POLL_S
        while (code := self.poll()) is None and time.monotonic() < deadline:
            time.sleep(pause)  # the holder writes it as soon as it runs: looked for again soon, then less often
            pause = min(pause * 2, 0.005)
        return -signal.SIGKILL if code is None else code

    def remove(self) -> None:
        """Blocking: SessionHandle.remove, then its holder ended (its cgroup removed; without one,
        killed) and reaped where this agent started it, and its socket and records removed."""
        if self.cgroup is not None:
            self.cgroup.remove()
        if self.holder_cgroup is not None:
            self.holder_cgroup.remove()
        else:
            _kill(self.holder_pid, signal.SIGKILL)
        if self.holder is not None:
            self.holder.wait()
        super().remove()
        for path in (self.exit_path.with_suffix(suffix) for suffix in HOLDER_FILES):
            try:
                path.unlink()
            except OSError:
                pass


def _running(pid: int) -> bool:
    """Whether process `pid` lives (not a zombie)."""
    fields = _stat_fields("/proc", str(pid)) if pid > 0 else None
    return fields is not None and fields[0] not in "ZX"


def holder_connect(holders: Path, session_id: str, *, timeout: float = HOLDER_START_TIMEOUT_S) -> tuple[socket.socket, int]:
    """Blocking: a connection to session `session_id`'s holder, whose socket is in `holders`, and
    the PTY master it sent (agent.holder.receive_fd); the connection non-blocking. Raises OSError
    (no holder listens there)."""
    directory = os.open(holders, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.settimeout(timeout)
        connection.connect(f"/proc/self/fd/{directory}/{session_id}")  # any scratch root's length (sun_path: 108 bytes)
        master = receive_fd(connection)
    except BaseException:
        connection.close()
        raise
    finally:
        os.close(directory)
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, HOLDER_INPUT_BUFFER)
    connection.setblocking(False)
    return connection, master


class ProcessRuntime:
    """Sessions as PTY process groups on the node, each confined by bubblewrap (agent.sandbox): an
    unprivileged user that is never the agent's (`uid`/`gid`, agent.toml's `[container] uid`,
    where the agent is root), its own user, mount, PID, IPC, UTS and network namespaces, the host
    system read-only, its home and data folders read-write, nothing of the agent, the console or
    another session; only loopback (`network` "none"), or the internet and nothing of the node,
    link-local or (`block_private`) private addresses ("outbound": slirp4netns and nftables rules
    in the session's namespace, agent.network), or the node's network ("host": UNSAFE). Where no sandbox is
    possible (`sandbox`, agent.toml's `[container] sandbox`: "auto", "bubblewrap" or "none"; decided
    once when the agent starts, `clean_up_at_start`, and logged with the reason), "auto" runs
    only administrators' sessions (start spec `owner_is_staff`), unconfined, and refuses others'
    with the reason; "bubblewrap" refuses to start; "none" runs every session unconfined as the
    agent's user (UNSAFE, for a single-user machine).

    A session's processes: where the agent may create cgroups v2 (`cgroup_root`, agent.toml's
    `[container] cgroup-root`: "auto", a cgroup2 directory, or "none"), each session has its own,
    `<root>/fgpu-agent-<node>/session-<id>`, which its leader joins before it execs, so every
    process it starts is tracked and killed through it (a daemon that calls setsid and clears
    its environment too); elsewhere they are found by scanning /proc (process session and
    FGPU_SESSION_ID). Which of the two is decided when the agent starts (`clean_up_at_start`),
    and logged once with the reason. `node`: the agent's node name ("": "node"); the parent
    cgroup's name carries it and the agent's instance (`parent_cgroup_name`: its scratch root's
    hash, and FGPU_CGROUP_TAG where set, `cgroup_tag`).

    `limits` (agent.limits; default: SessionLimits()): each session's cgroup holds it to its
    memory (start spec `mem`, else the default), CPU (`cpu` cores) and pids, and all sessions
    together to the node's pids; what cannot be enforced on this machine is logged once at
    start, and nothing is enforced in the /proc scan mode (logged too)."""

    name = PROCESS

    def __init__(
        self,
        *,
        node: str = "",
        cgroup_root: str = CGROUP_AUTO,
        limits: SessionLimits | None = None,
        tag: str | None = None,
        sandbox: str = SANDBOX_AUTO,
        uid: int = 1000,
        gid: int = 1000,
        network: str = "none",
        block_private: bool = True,
        hold: bool = True,
    ) -> None:
        self.hold = hold  # each session's PTY held by a holder of its own, which outlives the agent (HeldSession)
        self.sandbox_setting = sandbox
        self.uid, self.gid, self.network, self.block_private = uid, gid, network, block_private
        self.sandbox: Sandbox | None = None  # set by `confine` where bubblewrap works
        self.unconfined_why: str | None = None  # why not (None: not probed yet)
        self.node = node
        self.cgroup_root = cgroup_root
        self.limits = limits if limits is not None else SessionLimits()
        self.tag = cgroup_tag() if tag is None else tag
        self.cgroups: SessionCgroups | None = None  # set by clean_up_at_start where cgroups work
        # Where a sandboxed session's granted GPUs are looked up (agent.sandbox.gpu_devices; tests give fakes).
        self.dev, self.nvidia_proc, self.nvml = "/dev", NVIDIA_PROC, None

    def paths(self, work_dir: Path) -> SessionPaths:
        meta = work_dir / ".fgpu"
        return SessionPaths(home=str(work_dir), bin_dir=str(meta / "bin"), allocation=str(meta / "allocation.json"))

    def shell(self) -> str:
        return shutil.which("bash") or "/bin/sh"

    def base_path(self) -> str:
        """PATH after the virtual nvidia-smi's directory: the agent's own."""
        return os.environ.get("PATH", "/usr/bin:/bin")

    def install_tools(self, bin_dir: Path) -> None:
        """The virtual nvidia-smi in `bin_dir`, run by the agent's Python (agent.nvidia_smi)."""
        from agent import nvidia_smi

        nvidia_smi.install(bin_dir)

    def confine(self) -> Sandbox | None:
        """Blocking, once (the agent's start calls it first): find whether sessions can run in
        a sandbox here (agent.sandbox.probe) and log what they run in. Returns the Sandbox, or
        None (`unconfined_why` says why). Raises SandboxError where agent.toml requires
        bubblewrap and it cannot run."""
        if self.unconfined_why is not None or self.sandbox is not None:
            return self.sandbox
        self.sandbox, why = probe_sandbox(
            self.sandbox_setting, uid=self.uid, gid=self.gid, network=self.network, block_private=self.block_private
        )
        if self.sandbox is None:
            self.unconfined_why = why
            if self.sandbox_setting == SANDBOX_BUBBLEWRAP:
                raise SandboxError(f'agent.toml says [container] sandbox = "bubblewrap", but it cannot run here: {why}')
            if self.sandbox_setting == SANDBOX_NONE:
                log.warning(
                    "UNSAFE: sessions run UNCONFINED as the agent's user (uid %d), seeing and reaching all it can: %s "
                    "(for a single-user machine only)",
                    os.getuid(),
                    why,
                )
            else:
                log.warning(
                    "sessions cannot be confined here (%s): only administrators' sessions will run, unconfined; "
                    "other users' launches are refused",
                    why,
                )
            return None
        who = (
            f"uid {self.sandbox.uid}, gid {self.sandbox.gid}"
            if self.sandbox.drop
            else f"the agent's own uid {self.sandbox.uid} (the agent is not root, so it cannot switch users)"
        )
        log.info("each session runs in a bubblewrap sandbox as %s", who)
        become_subreaper()  # what bwrap and nsenter leave comes to this process (agent.sandbox)
        if self.sandbox.share_net:
            log.warning(
                'UNSAFE: agent.toml says [container] network = "host": sessions share the node\'s network and reach '
                "Redis, PostgreSQL, the web and this agent"
            )
        elif self.sandbox.outbound:
            log.info(
                "sessions reach the internet through slirp4netns; not this node, link-local%s addresses",
                " or private" if self.sandbox.block_private else "",
            )
        return self.sandbox

    def spawn(
        self,
        *,
        spec: StartSpec,
        argv: list[str],
        env: dict[str, str],
        work_dir: Path,
        folders: Folders = NO_FOLDERS,
        progress: Callable[[str], None] | None = None,
    ) -> SessionHandle:
        """Blocking: `argv` of the session of start spec `spec` on a new PTY in its own process
        session, in `work_dir` with `env` (`progress`: unused, there is nothing to pull), in its
        sandbox (`confine`): its home and its data `folders` (agent.mounts: the read-write ones,
        then the read-only shares, mounted read-only) given to the session's user first, and of
        the node's NVIDIA device nodes only the control nodes and those of its granted devices
        (agent.sandbox.gpu_devices, looked up once here); in its cgroup with the limits of its
        `mem` and `cpu` where sessions have cgroups. Raises SandboxError (no sandbox here and the
        owner is no administrator, under "auto"; bubblewrap could not set it up: what it said on
        the terminal) and OSError."""
        sandbox = self.confine()
        if sandbox is None and self.sandbox_setting != SANDBOX_NONE and not spec.owner_is_staff:
            raise SandboxError(
                f"this node cannot confine sessions ({self.unconfined_why}), so it runs only administrators' sessions; "
                "ask an administrator to install bubblewrap there, or to run your session on another node"
            )
        data = folders.writable()  # ~/data, ~/projects/<name> and the read-write ~/shared/<name> (issue 36.5)
        read_only = folders.read_only()
        devices: list[str] = []
        if sandbox is not None:
            shown = [work_dir / d for d in (PROJECTS_DIR, SHARED_DIR) if (work_dir / d).is_dir()]
            sandbox.own(work_dir, *shown, *data, *read_only)  # a read-only share's folder too: its mount says read-only
            devices = gpu_devices(spec_gpus(spec), dev=self.dev, drivers=self.nvidia_proc, nvml=self.nvml)
        cgroup = self.cgroups.create(spec.session_id, mem=spec.mem, cpu=spec.cpu) if self.cgroups is not None else None
        if self.hold:
            return self._spawn_held(
                session_id=spec.session_id, argv=argv, env=env, work_dir=work_dir, cgroup=cgroup, sandbox=sandbox, data=data,
                devices=devices, read_only=read_only,
            )  # fmt: skip
        master_fd, slave_fd = pty.openpty()
        set_winsize(slave_fd, 24, 80)
        status_read, status_write = os.pipe() if sandbox is not None else (-1, -1)
        # With the outbound network, the sandbox's init waits on this pipe until its network and rules are in place.
        block_read, block_write = os.pipe() if sandbox is not None and sandbox.outbound else (-1, -1)
        if sandbox is not None:
            _check_executable(argv[0], cwd=work_dir, env=env)  # the host system is the sandbox's (read-only)
            argv = sandbox.command(
                argv, home=work_dir, data=data, status_fd=status_write, block_fd=block_read, devices=devices,
                read_only_data=read_only or (),
            )  # fmt: skip
        network, init_pid = None, 0
        try:
            try:
                process = popen_leader(
                    argv,
                    cgroup=cgroup,
                    tty=os.ttyname(slave_fd),
                    stdin=slave_fd,
                    stdout=slave_fd,
                    stderr=slave_fd,
                    cwd=work_dir,
                    env=env,
                    pass_fds=tuple(fd for fd in (status_write, block_read) if fd >= 0),
                )
            finally:
                os.close(slave_fd)
                for fd in (status_write, block_read):
                    if fd >= 0:
                        os.close(fd)
            if sandbox is not None:
                try:  # its init's pid, its network, then that the sandbox is set up (exec may enter it)
                    init_pid = read_init_pid(status_read)
                    if block_write >= 0:
                        block, block_write = block_write, -1  # _attach closes it, whatever happens
                        network = _attach(sandbox, init_pid, block)
                    wait_set_up(init_pid)
                except SandboxError as exc:
                    raise SandboxError(f"{exc}: {_said(process, master_fd)}") from None
        except BaseException:
            if block_write >= 0:  # never let a sandbox without its network rules go on: its init is killed first
                if init_pid:
                    _kill(init_pid, signal.SIGKILL)
                os.close(block_write)
            if network is not None:
                network.close()
            os.close(master_fd)
            if status_read >= 0:
                os.close(status_read)
            if cgroup is not None:
                cgroup.remove()
            raise
        os.set_blocking(master_fd, False)
        return SessionHandle(
            spec.session_id, process, master_fd, env=env, work_dir=work_dir, cgroup=cgroup, sandbox=sandbox,
            init_pid=init_pid, status_fd=status_read, network=network,
        )  # fmt: skip

    def _spawn_held(
        self, *, session_id: str, argv: list[str], env: dict, work_dir: Path, cgroup: SessionCgroup | None,
        sandbox: Sandbox | None, data: list[Path], devices: list[str], read_only: list[Path] | None = None,
    ) -> HeldSession:  # fmt: skip
        """Blocking: `spawn` through a holder (agent.holder) of the session's own: the holder, in
        a cgroup of its own (`holder-<id>` beside the session's, where sessions have cgroups) and a
        process session of its own, starts the leader (which joins `cgroup`) on the PTY; its socket,
        exit status and record (`<id>.json`: what `adopt` needs) lie in `<scratch root>/.holders`.
        Raises SandboxError and OSError as `spawn`, the holder and what it started ended."""
        holders = work_dir.parent / HOLDERS_DIR
        holders.mkdir(mode=0o700, exist_ok=True)
        master_fd, slave_fd = pty.openpty()
        set_winsize(slave_fd, 24, 80)
        status_read, status_write = os.pipe() if sandbox is not None else (-1, -1)
        block_read, block_write = os.pipe() if sandbox is not None and sandbox.outbound else (-1, -1)
        slirp_read, slirp_write = os.pipe() if block_write >= 0 else (-1, -1)  # slirp4netns ends with the holder
        if sandbox is not None:
            _check_executable(argv[0], cwd=work_dir, env=env)
            argv = sandbox.command(
                argv, home=work_dir, data=data, status_fd=status_write, block_fd=block_read, devices=devices,
                read_only_data=read_only or (),
            )  # fmt: skip
        procs = "\n".join(map(os.fsdecode, cgroup.procs_paths)) if cgroup is not None else ""
        leader = ["/bin/sh", "-c", LEADER_SCRIPT, "fgpu-session", procs, os.ttyname(slave_fd), *argv]
        holder_cgroup = None
        if self.cgroups is not None:
            holder_cgroup = SessionCgroup(self.cgroups.parent / f"holder-{session_id}")
            holder_cgroup.path.mkdir(exist_ok=True)
        directory = os.open(holders, os.O_PATH | os.O_DIRECTORY)
        inherited = [fd for fd in (status_write, block_read) if fd >= 0]
        holder_argv = [
            sys.executable, "-I", "-S", str(HOLDER_SCRIPT), f"/proc/self/fd/{directory}/{session_id}", str(HOLDER_RING_BYTES),
            str(master_fd), str(slave_fd), ",".join(map(str, inherited)), "--", *leader,
        ]  # fmt: skip
        holder = None
        network, init_pid, connection, master = None, 0, None, -1
        try:
            try:
                holder = popen_leader(
                    holder_argv, cgroup=holder_cgroup, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, cwd=work_dir,
                    env={"PATH": os.environ.get("PATH", os.defpath)},
                    pass_fds=(master_fd, slave_fd, directory, *inherited, *([slirp_write] if slirp_write >= 0 else [])),
                )  # fmt: skip
            finally:
                for fd in (slave_fd, directory, status_write, block_read, slirp_write, master_fd):
                    if fd >= 0:
                        os.close(fd)
            assert holder.stdin is not None and holder.stdout is not None
            holder.stdin.write(b"".join(os.fsencode(f"{name}={value}") + b"\0" for name, value in env.items()))
            holder.stdin.close()
            ready, _, _ = select.select([holder.stdout], [], [], HOLDER_START_TIMEOUT_S)
            line = holder.stdout.readline() if ready else b""
            if not line.strip().isdigit():
                holder.kill()
                said = holder.communicate()[1].decode(errors="replace").strip()[-1024:]
                raise SandboxError(f"the session's holder did not start: {said or f'exit status {holder.returncode}'}")
            pid = int(line)
            holder.stdout.close()
            holder.stderr.close()  # type: ignore[union-attr]
            connection, master = holder_connect(holders, session_id)
            if sandbox is not None:
                try:
                    init_pid = read_init_pid(status_read)
                    if block_write >= 0:
                        block, block_write = block_write, -1
                        network = _attach(sandbox, init_pid, block, exit_fd=slirp_read)
                    wait_set_up(init_pid)
                except SandboxError as exc:
                    _kill(pid, signal.SIGKILL)
                    raise SandboxError(f"{exc}: {_said_through(connection)}") from None
        except BaseException:
            if block_write >= 0:  # never let a sandbox without its network rules go on
                if init_pid:
                    _kill(init_pid, signal.SIGKILL)
                os.close(block_write)
            for fd in (status_read, slirp_read, master):
                if fd >= 0:
                    os.close(fd)
            if connection is not None:
                connection.close()
            if cgroup is not None:
                cgroup.remove()
            if holder_cgroup is not None:
                holder_cgroup.remove()
            if holder is not None:
                holder.kill()
                holder.wait()
            if network is not None:
                network.close()
            for path in (holders / session_id, holders / f"{session_id}.exit"):
                path.unlink(missing_ok=True)
            raise
        if slirp_read >= 0:
            os.close(slirp_read)
        handle = HeldSession(
            session_id, pid, connection, master, env=env, work_dir=work_dir, exit_path=holders / f"{session_id}.exit",
            holder_cgroup=holder_cgroup, holder_pid=holder.pid, cgroup=cgroup, sandbox=sandbox, init_pid=init_pid,
            status_fd=status_read, network=network, holder=holder,
        )  # fmt: skip
        record = {"pid": pid, "holder_pid": holder.pid, "init_pid": init_pid, "work_dir": str(work_dir), "env": env}
        (holders / f"{session_id}.json").write_text(json.dumps(record))
        return handle

    def clean_up_at_start(self, scratch_root: Path) -> tuple[list[SessionHandle], int]:
        """Blocking, when the agent starts: decide how sessions' processes are tracked (their
        own cgroups, or the /proc scan; logged with the reason), then return the sessions to
        adopt (those whose holder still runs, `adopt`; none where sessions are not held: a PTY
        does not survive its agent) and how many processes an earlier run's other sessions left
        were killed: through the cgroups under the agent's parent cgroup, and those found by the
        FGPU_ALLOCATION under `scratch_root` in their environment (one scan in either mode: a run
        that used the scan, or an agent from before cgroups, left its sessions in no cgroup of
        ours). First, whether sessions can be sandboxed (`confine`; raises SandboxError where
        agent.toml requires bubblewrap and it cannot run)."""
        self.confine()
        name = parent_cgroup_name(self.node, scratch_root, tag=self.tag)
        self.cgroups, why = open_session_cgroups(self.cgroup_root, name=name, limits=self.limits)
        adopted = self.adopt(scratch_root)
        keep = {handle.session_id for handle in adopted}
        if self.cgroups is None:
            log.warning("sessions' processes are found by scanning /proc (no cgroup of their own): %s", why)
            log.warning("sessions' memory, CPU and processes are not limited (no cgroup of their own)")
            return list(adopted), kill_orphans(scratch_root, keep=keep)
        log.info("each session's processes are tracked by its own cgroup under %s", self.cgroups.parent)
        hierarchies = self.cgroups.hierarchies
        for controller, reason in sorted(hierarchies.missing.items()) if hierarchies is not None else []:
            log.warning("sessions' %s is not limited: %s", controller, reason)
        kept = {f"{kind}-{session_id}" for session_id in keep for kind in ("session", "holder")}
        return list(adopted), self.cgroups.clean_up(keep=kept) + kill_orphans(scratch_root, keep=keep)

    def adopt(self, scratch_root: Path) -> list[HeldSession]:
        """Blocking, at the agent's start (after its cgroups are decided): the held sessions an
        earlier run of this agent left, re-attached: each record in `<scratch_root>/.holders`
        whose holder answers on its socket (its scrollback comes first on the new connection;
        a session that ended meanwhile is found ended, its status in the holder's record); the
        files of a holder that is gone are removed (its processes are then killed as any
        earlier run's)."""
        holders = scratch_root / HOLDERS_DIR
        found: list[HeldSession] = []
        for record in sorted(holders.glob("*.json")) if holders.is_dir() else []:
            session_id = record.stem
            try:
                data = json.loads(record.read_text())
                connection, master = holder_connect(holders, session_id, timeout=2.0)
            except (OSError, ValueError) as exc:
                log.info("session %s's holder is gone (%s): its session is not adopted", session_id, exc)
                for suffix in HOLDER_FILES:
                    (holders / f"{session_id}{suffix}").unlink(missing_ok=True)
                continue
            cgroups, sandboxed = self.cgroups, bool(data.get("init_pid")) and self.sandbox is not None
            hierarchies = cgroups.hierarchies if cgroups is not None else None
            cgroup = holder_cgroup = None
            if cgroups is not None:
                name = f"session-{session_id}"
                v1 = tuple(hierarchies.session_dirs(name)) if hierarchies is not None else ()
                cgroup = SessionCgroup(cgroups.parent / name, v1=v1, hierarchies=hierarchies)
                holder_cgroup = SessionCgroup(cgroups.parent / f"holder-{session_id}")
            found.append(
                HeldSession(
                    session_id,
                    int(data["pid"]),
                    connection,
                    master,
                    env=data["env"],
                    work_dir=Path(data["work_dir"]),
                    exit_path=holders / f"{session_id}.exit",
                    holder_cgroup=holder_cgroup,
                    holder_pid=int(data["holder_pid"]),
                    cgroup=cgroup,
                    sandbox=self.sandbox if sandboxed else None,
                    init_pid=int(data.get("init_pid") or 0),
                )  # fmt: skip
            )
        return found

    def close(self) -> None:
        """Blocking, when the agent shuts down (its sessions ended): remove the parent cgroup
        where it is empty."""
        if self.cgroups is not None:
            self.cgroups.close()

    def release_now(self) -> None:
        """Blocking, when the host process exits without ending its sessions (standalone mode's
        console): kill what the sessions' cgroups hold, then remove them and the parent."""
        if self.cgroups is not None:
            self.cgroups.clean_up()
            self.cgroups.close()

    def holds_image(self, reference: str) -> bool:
        return reference == protocol.HOST_IMAGE

    def images(self) -> dict[str, str]:
        """The session images this runtime holds: its one built-in image, "host"."""
        return dict(protocol.HOST_IMAGES)

    def image_service_ports(self) -> dict[str, str]:
        """The `ai.backend.service-ports` labels of its images: the host has none."""
        return {}


class HeldImages:
    """The session images a node holds, as its registration and heartbeats report them
    (`current`: {reference: image id}; None until first listed; `service_ports`: {image id: its
    ai.backend.service-ports label} of those that carry one), listed through the runtime
    (`runtime.images()`, blocking: Docker's image list for the docker runtime) at most every
    REFRESH_S seconds. The agent calls `claim()` on its loop and, when it answers True, `refresh()`
    on a worker pool. A listing that fails keeps the last one (the first: none held, so no
    session is sent to a node whose images are unknown) and is logged."""

    REFRESH_S = 30.0

    def __init__(self, runtime, *, clock=time.monotonic) -> None:
        self.runtime = runtime
        self.clock = clock
        self.current: dict[str, str] | None = None
        self.service_ports: dict[str, str] = {}  # image id → its ai.backend.service-ports label
        self._listed_at: float | None = None
        self._busy = False

    def claim(self) -> bool:
        """Whether a refresh is due (none for REFRESH_S seconds) and none is under way; True
        marks one under way until `refresh` returns."""
        if self._busy or (self._listed_at is not None and self.clock() - self._listed_at < self.REFRESH_S):
            return False
        self._busy = True
        return True

    def refresh(self) -> dict[str, str] | None:
        """Blocking: list the runtime's images now; returns `current`."""
        try:
            self.current = dict(sorted(self.runtime.images().items())[: protocol.MAX_IMAGES])
            held = set(self.current.values())
            labels: dict[str, str] = getattr(self.runtime, "image_service_ports", dict)()  # as the listing just read them
            self.service_ports = {ident: label for ident, label in labels.items() if ident in held}
        except Exception as exc:
            log.warning("could not list the node's session images (keeping the last list): %s", exc)
            if self.current is None:
                self.current = {}
        finally:
            self._listed_at = self.clock()
            self._busy = False
        return self.current


def set_winsize(fd: int, rows: int, cols: int) -> None:
    rows, cols = max(1, min(rows, 1000)), max(1, min(cols, 1000))
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def default_signals() -> None:
    # An agent started under nohup or `&` ignores SIGINT/SIGQUIT/SIGHUP, and ignored signals
    # are inherited: give the session's processes default signal handling.
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)


# A session's leader is readied for its command by /bin/sh, which then execs it, rather than by a
# preexec_fn: for a preexec_fn Python forks the whole agent (fork, not vfork), which took 13 ms
# at 120 MiB resident and 26 ms at 340 MiB (a standalone console) against 0.2 ms without one on
# a 2-core VM, on every launch (issue 14). `$1`: the cgroup.procs to move the shell into ("":
# none), so all the command starts is in its cgroup; `$2`: the terminal to make the session's
# controlling one ("": none): a session leader without one that opens a terminal (no
# O_NOCTTY) gets it as its controlling terminal. Then the command, with the shell's pid.
# `$1` holds every cgroup.procs the leader joins, one a line (SessionCgroup.procs_paths: cgroup v2's,
# then each v1 hierarchy's that limits the session; none holds whitespace; `set -f`: no globbing).
LEADER_SCRIPT = (
    'set -f; for p in $1; do echo 0 >"$p" || exit 126; done; if [ -n "$2" ]; then exec 0<>"$2"; fi; shift 2; exec "$@"'
)
# What `default_signals` gives the leader that the script cannot: a shell cannot reset a signal
# ignored when it started (POSIX), so where the agent ignores one of these the leader is readied
# by a preexec_fn as before (an agent started under nohup; `manage.py agent` stops ignoring them).
_RESET_SIGNALS = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)


def popen_leader(
    argv: list[str], *, cgroup: SessionCgroup | None, tty: str = "", stdin, stdout, stderr, cwd, env, pass_fds=()
) -> subprocess.Popen:
    """Blocking: start `argv` as the leader of a new process session (its pid is the session
    id) with `stdin`, `stdout` and `stderr` (as Popen takes them), in `cgroup` where given, with
    `tty` (stdin's terminal's path) as its controlling terminal where given, and the signals
    `default_signals` resets at their default disposition: without a preexec_fn
    (LEADER_SCRIPT) unless this process ignores one of those signals. Raises OSError as Popen
    does; where the script cannot join the cgroup, the leader ends with 126 instead (the shell
    says why on stderr). `pass_fds`: descriptors the command inherits (bwrap's status pipe)."""
    if _ignored(_RESET_SIGNALS):
        then = _make_controlling_tty if tty else default_signals
        preexec, argv = (then if cgroup is None else _joining(cgroup, then)), argv
    else:
        _check_executable(argv[0], cwd=cwd, env=env)
        procs = "\n".join(map(os.fsdecode, cgroup.procs_paths)) if cgroup is not None else ""  # v2's, then v1's (limits)
        preexec, argv = None, ["/bin/sh", "-c", LEADER_SCRIPT, "fgpu-session", procs, tty, *argv]
    return subprocess.Popen(
        argv, stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd, env=env, start_new_session=True, close_fds=True,
        preexec_fn=preexec, pass_fds=pass_fds,
    )  # fmt: skip


def _attach(sandbox: Sandbox, init_pid: int, block_write: int, *, exit_fd: int = -1) -> SlirpNetwork:
    """Blocking: the outbound network of the sandbox whose init is `init_pid` (Sandbox.attach_network),
    then the init let go on (a byte on `block_write`, which is closed). Raises SandboxError, the
    init killed before the pipe is closed (its end would let it go on without its rules)."""
    try:
        network = sandbox.attach_network(init_pid, exit_fd=exit_fd)
    except BaseException:
        _kill(init_pid, signal.SIGKILL)
        os.close(block_write)
        raise
    try:
        os.write(block_write, b"1")
    finally:
        os.close(block_write)
    return network


def _said_through(connection: socket.socket, *, timeout: float = 5.0) -> str:
    """Blocking: what a held leader that failed wrote on its terminal (the last 2 kB, as text),
    read from its holder's connection until it closes (at most `timeout` seconds)."""
    said, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not select.select([connection], [], [], max(0.0, deadline - time.monotonic()))[0]:
            break
        try:
            chunk = connection.recv(65536)
        except BlockingIOError:
            continue
        except OSError:
            break
        if not chunk:
            break
        said += chunk
    return said[-2048:].decode(errors="replace").strip() or "the sandbox could not be set up"


def _open_init(init_pid: int) -> tuple[int, str]:
    """A sandbox's init's pidfd and its PID namespace (/proc/<pid>/ns/pid's link); (-1, "")
    where it is gone already (its command failed at once: nothing inside to reach)."""
    try:
        fd = os.pidfd_open(init_pid)
    except OSError:
        return -1, ""
    try:
        return fd, os.readlink(f"/proc/{init_pid}/ns/pid")
    except OSError:
        return fd, ""


def _wait_exit(pid: int, timeout: float) -> bool:
    """Blocking: wait up to `timeout` seconds for process `pid` (a child of this process) to exit,
    without reaping it (its pidfd; its Popen's wait reaps it). Returns whether it exited."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return False
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def _said(process: subprocess.Popen, master_fd: int, *, timeout: float = 5.0) -> str:
    """Blocking: what a leader that failed wrote on its terminal (the last 2 kB, as text), once
    it ended (killed after `timeout` seconds)."""
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    os.set_blocking(master_fd, False)
    said = b""
    while True:
        try:
            chunk = os.read(master_fd, 65536)
        except OSError:  # nothing more (EAGAIN), or EIO: the terminal's last holder is gone
            break
        if not chunk:
            break
        said += chunk
    text = said[-2048:].decode(errors="replace").strip()
    return text or f"exit status {process.returncode}"


def _check_executable(program: str, *, cwd, env) -> None:
    """Raises FileNotFoundError or PermissionError where Popen would start no `program` (the
    script's exec would only end with 127 or 126): a path with a slash is taken from `cwd`, a name
    is looked up on `env`'s PATH (this process's where `env` is None)."""
    if "/" in program:
        candidates = [os.path.join(cwd or "", program)]
    else:
        path = (os.environ if env is None else env).get("PATH", os.defpath)
        if shutil.which(program, path=path) is not None:
            return
        candidates = [os.path.join(directory, program) for directory in path.split(os.pathsep)]
    present = [c for c in candidates if os.path.exists(c)]
    if present and "/" in program and os.access(present[0], os.X_OK) and not os.path.isdir(present[0]):
        return
    code = errno.EACCES if present else errno.ENOENT
    raise (PermissionError if present else FileNotFoundError)(code, os.strerror(code), program)


def stop_ignoring_session_signals() -> None:
    """In a process that runs sessions, from its main thread as it starts (the agent's and
    standalone's commands): a signal of `_RESET_SIGNALS` it ignores (started under nohup or
    `&`) is caught by a handler that does nothing instead. The process goes on ignoring it,
    but its sessions' leaders, which would inherit an ignored signal and not a handler, start
    without a preexec_fn (popen_leader). Raises ValueError off the main thread (signal.signal)."""
    for sig in _RESET_SIGNALS:
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, _still_ignored)


def _still_ignored(signum, frame) -> None:
    """A signal the process was started ignoring (stop_ignoring_session_signals)."""


def _ignored(signals) -> bool:
    """Whether this process ignores any of `signals` (the kernel's view, /proc/self/status's
    SigIgn mask: also what C code set, which signal.getsignal does not see)."""
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"SigIgn:"):
                mask = int(line.split()[1], 16)
                return any(mask & (1 << (sig - 1)) for sig in signals)
    return True  # no mask to read: assume the worst


def _make_controlling_tty() -> None:
    # After setsid (start_new_session), make the PTY on stdin the controlling terminal so
    # job control and SIGWINCH work in the shell; and give the session default signal
    # handling (Ctrl-C would do nothing in the terminal otherwise).
    default_signals()
    try:
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    except OSError:
        pass


def _joining(cgroup: SessionCgroup, then):
    """A preexec_fn: join `cgroup` (os.open/os.write only), then run `then()`."""

    def preexec() -> None:
        cgroup.join()
        then()

    return preexec


# --- a session's processes, from /proc ------------------------------------------------------


def session_members(sid: int, *, proc: str = "/proc", live_only: bool = False) -> list[int]:
    """Pids whose session id (field 6 of /proc/<pid>/stat) is `sid`: every process a session's
    shell started, whatever process group job control gave it; `live_only`: not zombies. A
    process that calls setsid() itself escapes this (`session_processes` finds those too)."""
    pids = []
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(proc, entry.name)
        if fields is not None and int(fields[3]) == sid and not (live_only and fields[0] == "Z"):
            pids.append(int(entry.name))
    return pids


def session_processes(
    session_id: str, sid: int, *, proc: str = "/proc", live_only: bool = False, since: int | None = None
) -> list[int]:
    """Pids of a session's processes, from one scan of `proc`: those in its process session
    `sid` (whatever process group job control gave them) and those whose environment carries
    its `FGPU_SESSION_ID` (a daemon that called setsid() or double-forked to get away);
    `live_only`: not zombies. `since`: the leader's start (clock ticks after boot, /proc stat's
    field 22): the environment of a process started before it is not read (only the session's
    descendants can carry its id, and each started after its leader), so a scan reads one
    small file per process of the node and a second one only for the newer ones. A process that
    also rewrote its environment escapes this; a session in a container (its own cgroup) has
    no such gap."""
    marker = f"FGPU_SESSION_ID={session_id}".encode()
    own = os.getpid()
    pids = []
    for entry in os.scandir(proc):
        if not entry.name.isdigit() or int(entry.name) == own:
            continue
        fields = _stat_fields(proc, entry.name)
        if fields is None or (live_only and fields[0] == "Z"):
            continue
        if int(fields[3]) == sid:
            pids.append(int(entry.name))
        elif (since is None or _started(fields) >= since) and marker in _environ(proc, entry.name):
            pids.append(int(entry.name))
    return pids


STARTTIME = 19  # of _stat_fields: /proc/<pid>/stat's field 22, the start in clock ticks after boot


def _started(fields: list[str]) -> int:
    """When the process of `_stat_fields`' `fields` started (clock ticks after boot); a stat
    without the field counts as the newest."""
    return int(fields[STARTTIME]) if len(fields) > STARTTIME else sys.maxsize


def _start_ticks(proc: str, pid: str) -> int | None:
    """When process `pid` started (clock ticks after boot), or None if it is gone."""
    fields = _stat_fields(proc, pid)
    return _started(fields) if fields is not None else None


def signal_session(sid: int, *sigs: int) -> None:
    """Each of `sigs`, in order, to every process of process session `sid` (one scan)."""
    for pid in session_members(sid):
        for sig in sigs:
            _kill(pid, sig)


def kill_orphans(scratch_root: Path, *, proc: str = "/proc", keep: set[str] | frozenset[str] = frozenset()) -> int:
    """SIGKILL every process whose session working directory lies under `scratch_root` (its
    `FGPU_ALLOCATION` names a file there): what sessions of an earlier run of this agent left
    when the agent died, but those of the sessions in `keep` (adopted: their FGPU_SESSION_ID).
    Returns how many were killed."""
    prefix = f"FGPU_ALLOCATION={Path(scratch_root).resolve()}/".encode()
    kept = {f"FGPU_SESSION_ID={session_id}".encode() for session_id in keep}
    own, killed = os.getpid(), 0
    for entry in os.scandir(proc):
        if not entry.name.isdigit() or int(entry.name) == own:
            continue
        variables = _environ(proc, entry.name).split(b"\0")
        if any(var.startswith(prefix) for var in variables) and not kept.intersection(variables):
            killed += _kill(int(entry.name), signal.SIGKILL)
    return killed


def _kill(pid: int, sig: int) -> int:
    try:
        os.kill(pid, sig)
        return 1
    except (ProcessLookupError, PermissionError):
        return 0


def _stat_fields(proc: str, pid: str) -> list[str] | None:
    """/proc/<pid>/stat after "pid (comm) ": state ppid pgrp session …; None if it is gone."""
    try:
        with open(f"{proc}/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields if len(fields) > 3 else None


def _environ(proc: str, pid: str) -> bytes:
    try:
        with open(f"{proc}/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:  # gone, or not ours to read
        return b""


# --- a session's processes, by its own cgroup (cgroup v2) -------------------------------------


def cgroup2_mounts(*, mountinfo: str = "/proc/self/mountinfo") -> list[Path]:
    """The mount points of cgroup v2 hierarchies (`cgroup2` file systems), as this process sees
    them; [] where /proc cannot tell."""
    return cgroup_mounts(("cgroup2",), mountinfo=mountinfo)


def cgroup2_root(setting: str, *, mountinfo: str = "/proc/self/mountinfo") -> tuple[Path | None, str]:
    """Where session cgroups may go for agent.toml's `[container] cgroup-root` (`setting`):
    "auto" picks /sys/fs/cgroup where it is cgroup v2 (unified hierarchy), else the first cgroup2
    mount (/sys/fs/cgroup/unified on a hybrid system); a path must lie in a cgroup2 mount; "none"
    picks nothing. Returns (directory, "") or (None, why not)."""
    if setting == CGROUP_NONE:
        return None, 'agent.toml says [container] cgroup-root = "none"'
    mounts = cgroup2_mounts(mountinfo=mountinfo)
    if setting != CGROUP_AUTO:
        wanted = Path(setting)
        if not any(wanted == m or m in wanted.parents for m in mounts):
            return None, f"{wanted} is not in a cgroup v2 hierarchy (cgroup2 mounts: {', '.join(map(str, mounts)) or 'none'})"
        return wanted, ""
    unified = Path("/sys/fs/cgroup")
    if unified in mounts:
        return unified, ""
    if mounts:
        return mounts[0], ""
    return None, "no cgroup v2 hierarchy is mounted (cgroup v1 only)"


def open_session_cgroups(
    setting: str, *, name: str, limits: SessionLimits | None = None, mountinfo: str = "/proc/self/mountinfo"
) -> tuple[SessionCgroups | None, str]:
    """Blocking: the parent cgroup `<root>/<name>` of an agent's sessions (`root`:
    `cgroup2_root(setting)`), created and checked by moving a short-lived child into a probe
    cgroup under it (what a session's leader does before it execs). With `limits`, the
    controllers that enforce them are found and readied (agent.limits.Hierarchies.open: cgroup
    v2's, else the v1 hierarchies', which the probe joins too; where it cannot, they are dropped
    and named in `hierarchies.missing`). Returns (its SessionCgroups, "") or (None, why sessions
    cannot have cgroups here: not cgroup v2, not writable, a path with whitespace, …)."""
    root, why = cgroup2_root(setting, mountinfo=mountinfo)
    if root is None:
        return None, why
    parent = root / name
    if any(c.isspace() for c in str(parent)):
        return None, f"{str(parent)!r} holds whitespace (a session's leader takes its cgroups' paths in one word each)"
    try:
        parent.mkdir(exist_ok=True)
    except OSError as exc:
        return None, f"cannot create {parent}: {exc.strerror or exc}"
    hierarchies = Hierarchies.open(parent, node_pids=limits.node_pids, mountinfo=mountinfo) if limits else None
    if hierarchies is not None and any(c.isspace() for d in hierarchies.v1_parents() for c in str(d)):
        hierarchies.drop_v1("a cgroup v1 mount point holds whitespace")
    cgroups = SessionCgroups(parent, hierarchies=hierarchies, limits=limits)
    why = _probe(cgroups)
    if why and hierarchies is not None and hierarchies.v1:
        hierarchies.drop_v1(f"a process cannot join the cgroup v1 hierarchies: {why}")
        why = _probe(cgroups)
    if why:
        cgroups.close()
        return None, f"cannot move a process into a cgroup under {parent}: {why}"
    return cgroups, ""


def _probe(cgroups: SessionCgroups) -> str:
    """Blocking: start a short-lived leader in a probe cgroup of `cgroups` (every hierarchy a
    session's leader joins), then remove it. Returns "" or why the leader could not join."""
    name = f"probe-{os.getpid()}"
    hierarchies = cgroups.hierarchies
    probe = SessionCgroup(cgroups.parent / name, v1=tuple(hierarchies.session_dirs(name)) if hierarchies else ())
    try:
        for directory in (probe.path, *probe.v1):
            directory.mkdir(exist_ok=True)
        child = popen_leader(
            ["/bin/sh", "-c", "exit 0"], cgroup=probe, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, cwd=None, env=None,
        )  # fmt: skip
        _, err = child.communicate(timeout=10)
        if child.returncode:
            raise subprocess.SubprocessError(err.decode(errors="replace").strip() or f"exit status {child.returncode}")
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    finally:
        probe.remove()
    return ""


def parent_cgroup_name(node: str, scratch_root: Path, *, tag: str = "") -> str:
    """The name of an agent's parent cgroup: `fgpu-agent-[<tag>-]<node>-<instance>`, where
    `<instance>` is the first 10 hex digits of the SHA-256 of the agent's resolved scratch root
    (a console's own: standalone's lies under its FGPU_DATA_DIR), so two consoles on one host
    whose nodes share a name (`demo-node`) have a parent each and clean up only their own
    (issue 31, item 8); `tag`: FGPU_CGROUP_TAG (`cgroup_tag`), e.g. a test run's, which then
    finds what it made by the prefix `fgpu-agent-<tag>-`. `node` "": "node"."""
    instance = installation_id(scratch_root)
    return f"fgpu-agent-{tag + '-' if tag else ''}{node or 'node'}-{instance}"


CGROUP_TAG_ENV = "FGPU_CGROUP_TAG"


def cgroup_tag(environ=os.environ) -> str:
    """FGPU_CGROUP_TAG: a word (letters, digits, '_'; at most 32) the names of this process's
    agents' parent cgroups carry (`parent_cgroup_name`); "" where unset. Raises ValueError for
    any other value."""
    tag = environ.get("FGPU_CGROUP_TAG", "")
    if tag and not (len(tag) <= 32 and tag.replace("_", "").isalnum() and tag.isascii()):
        raise ValueError(f"{CGROUP_TAG_ENV}={tag!r}: expected at most 32 letters, digits or '_'")
    return tag


class SessionCgroup:
    """One session's cgroup (v2): its leader joins it before it runs its command (LEADER_SCRIPT,
    or `join` in a preexec_fn), so every process it starts is in it too, whatever it does
    (setsid, double fork, a clean environment); only the cgroup's own processes count (none is
    put in a child cgroup). `v1`: its directories in the cgroup v1 hierarchies that hold the
    controllers limiting it where cgroup v2 has none (agent.limits: memory, cpu, pids on a hybrid
    machine), which the leader joins too; `hierarchies`: where its limits are (agent.limits).

    Files read: `cgroup.procs` (the pids, zombies not listed), `cgroup.events` ("populated 0"
    once the last process exited; pollable), `cgroup.kill` (kernel ≥ 5.14: SIGKILL to all at
    once; else each pid, the cgroup frozen meanwhile where `cgroup.freeze` exists)."""

    def __init__(self, path: Path, *, v1: tuple[Path, ...] = (), hierarchies: Hierarchies | None = None) -> None:
        self.path = Path(path)
        self.v1 = tuple(Path(d) for d in v1)
        self.hierarchies = hierarchies
        self._procs = os.fsencode(self.path / "cgroup.procs")  # encoded now: `join` runs between fork and exec
        self._all_procs = [self._procs, *(os.fsencode(d / "cgroup.procs") for d in self.v1)]

    @property
    def procs_path(self) -> bytes:
        """Its cgroup v2 cgroup.procs (encoded): a process that writes "0" into it joins the cgroup."""
        return self._procs

    @property
    def procs_paths(self) -> list[bytes]:
        """Every cgroup.procs a leader writes "0" into before it execs (encoded): the v2 one
        first, then one per v1 hierarchy (`v1`). None of them holds whitespace
        (open_session_cgroups refuses such a parent), so LEADER_SCRIPT takes them in one
        argument, separated by newlines."""
        return list(self._all_procs)

    def join(self) -> None:
        """In a child between fork and exec (a preexec_fn): move this process into the cgroup
        (and its v1 ones). Only os.open / os.write / os.close (nothing that allocates in C or
        takes locks). Raises OSError (the cgroup is gone, or not ours to write)."""
        for procs in self._all_procs:
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)

    def oom_kills(self) -> int:
        """Blocking: how many of its processes the kernel's OOM killer ended at its memory limit
        (0 where no memory limit is enforced)."""
        return self.hierarchies.oom_kills(self.path.name) if self.hierarchies is not None else 0

    def memory_limit(self) -> int:
        """Blocking: its memory limit in bytes (0: none enforced)."""
        return self.hierarchies.memory_limit(self.path.name) if self.hierarchies is not None else 0

    def pids(self) -> list[int]:
        """Blocking: the pids of the cgroup's processes (not zombies); [] once it is gone."""
        try:
            with open(self._procs, "rb") as f:
                return [int(pid) for pid in f.read().split()]
        except OSError:
            return []

    def populated(self) -> bool:
        """Blocking: whether any process (not a zombie) is left in it."""
        try:
            with open(self.path / "cgroup.events", "rb") as f:
                return b"populated 1" in f.read()
        except OSError:
            return False

    def kill(self) -> int:
        """Blocking: SIGKILL to every process in it. Returns how many there were (0: none was
        left, so there is nothing to wait for)."""
        found = self.pids()
        if not found:
            return 0
        try:
            _write(self.path / "cgroup.kill", b"1")
            return len(found)
        except OSError:  # no cgroup.kill (kernel < 5.14): each pid (none if the cgroup is gone)
            pass
        frozen = _write_quietly(self.path / "cgroup.freeze", b"1")  # no fork escapes the pass below
        try:
            for pid in self.pids():
                _kill(pid, signal.SIGKILL)  # a fatal signal ends a frozen process
        finally:
            if frozen:
                _write_quietly(self.path / "cgroup.freeze", b"0")
        return len(found)

    def watch(self) -> CgroupWatch | None:
        """A watch on its cgroup.events (None once it is gone)."""
        try:
            return CgroupWatch(self.path / "cgroup.events")
        except OSError:
            return None

    def wait_empty(self, timeout: float) -> bool:
        """Blocking: wait up to `timeout` seconds for the last process to exit: woken by
        cgroup.events, whose file is also read again CGROUP_EMPTY_POLL_S after the start, then
        twice as long each time up to 10 ms (the kernel notifies a cgroup.events file at most
        every 10 ms, cgroup_file_notify; its content is current at once). Returns whether none is
        left."""
        watch = self.watch()
        if watch is None:
            return True
        try:
            deadline, pause = time.monotonic() + timeout, CGROUP_EMPTY_POLL_S
            while watch.populated():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                watch.wait(min(remaining, pause))
                pause = min(pause * 2, CGROUP_NOTIFY_S)
            return True
        finally:
            watch.close()

    def remove(self, *, timeout: float = CGROUP_EMPTY_WAIT_S) -> bool:
        """Blocking: kill what is left, wait up to `timeout` seconds for it to be gone, remove
        the cgroup. Returns whether it is gone (False: a process would not die in time, e.g.
        in uninterruptible sleep; the agent's next start removes it). Processes killed just
        before (`kill`, cgroup.kill) are in no cgroup.procs while they exit, yet the kernel
        refuses the rmdir (EBUSY) until they are gone: it is tried again, every 5 ms, until
        `timeout` (seen when standalone's exit killed a Jupyter kernel's children)."""
        deadline = time.monotonic() + timeout
        while True:
            self.kill()
            self.wait_empty(max(0.0, deadline - time.monotonic()))
            try:
                self.path.rmdir()
            except FileNotFoundError:
                break
            except OSError as exc:
                if exc.errno == errno.EBUSY and time.monotonic() < deadline:
                    time.sleep(CGROUP_RMDIR_RETRY_S)
                    continue
                log.warning("could not remove cgroup %s: %s", self.path, exc.strerror or exc)
                return False
            break
        for directory in self.v1:
            _remove_v1(directory, deadline)
        return not any(directory.exists() for directory in self.v1)


class CgroupWatch:
    """Changes of one cgroup.events file: `fd` (an epoll descriptor, for an event loop's
    add_reader) turns readable when the file changes (the kernel notifies with POLLPRI, e.g.
    when the cgroup's last process exits); `clear()` consumes that. `close()` when done."""

    def __init__(self, events: Path) -> None:
        self._events = os.open(events, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._epoll = select.epoll()
            self._epoll.register(self._events, select.EPOLLPRI | select.EPOLLET)
        except BaseException:
            os.close(self._events)
            raise
        self.fd = self._epoll.fileno()
        self.clear()  # an open file starts out "changed"

    def populated(self) -> bool:
        """Whether any process is in the cgroup now (read after arming: no exit is missed)."""
        try:
            return b"populated 1" in os.pread(self._events, 256, 0)
        except OSError:  # removed meanwhile
            return False

    def clear(self) -> None:
        self._epoll.poll(0)

    def wait(self, timeout: float) -> bool:
        """Blocking: wait up to `timeout` seconds for a change. Returns whether one came."""
        return bool(self._epoll.poll(timeout))

    def close(self) -> None:
        self._epoll.close()
        os.close(self._events)


class SessionCgroups:
    """The cgroups of one agent's sessions: `parent/session-<id>` each (`parent`: e.g.
    /sys/fs/cgroup/fgpu-agent-<node>-<instance>, `parent_cgroup_name`; beside the agent's own
    cgroup, never inside it: cgroup v2 keeps processes out of a cgroup whose children have
    controllers). `hierarchies` (agent.limits): where the controllers limiting them are (cgroup
    v2 under `parent`, or the v1 hierarchies, `<mount>/<parent's name>/session-<id>`);
    `limits`: what each session gets (None: none enforced)."""

    def __init__(self, parent: Path, *, hierarchies: Hierarchies | None = None, limits: SessionLimits | None = None) -> None:
        self.parent = Path(parent)
        self.hierarchies = hierarchies
        self.limits = limits

    def create(self, session_id: str, *, mem: int = 0, cpu: int | str | Decimal = 1) -> SessionCgroup:
        """Blocking: session `session_id`'s cgroup, new (what an earlier start of it left is killed
        first), with its directories in the v1 hierarchies and the limits of a session that asks
        `mem` bytes and `cpu` cores (its start spec's; agent.limits.SessionLimits.for_session) written. Raises OSError (the
        cgroup removed again: a session is never started without the limits it should have)."""
        name = f"session-{session_id}"
        hierarchies = self.hierarchies
        cgroup = SessionCgroup(
            self.parent / name, v1=tuple(hierarchies.session_dirs(name)) if hierarchies else (), hierarchies=hierarchies
        )
        self.parent.mkdir(exist_ok=True)  # removed meanwhile (by hand): made again
        try:
            cgroup.path.mkdir()
        except FileExistsError:
            cgroup.kill()
        try:
            for directory in cgroup.v1:
                directory.parent.mkdir(exist_ok=True)
                directory.mkdir(exist_ok=True)
            if hierarchies is not None and self.limits is not None:
                hierarchies.apply(name, self.limits.for_session(mem=mem, cpu=cpu))
        except OSError:
            cgroup.remove()
            raise
        return cgroup

    def clean_up(self, *, keep: set[str] | frozenset[str] = frozenset()) -> int:
        """Blocking, when the agent starts: kill what every cgroup under the parent still holds
        (sessions of an earlier run of this agent) and remove them, but those named in `keep`
        (adopted sessions' and their holders'). Returns how many processes were killed."""
        killed = 0
        try:
            entries = [e for e in os.scandir(self.parent) if e.is_dir(follow_symlinks=False) and e.name not in keep]
        except OSError:
            return 0
        for entry in entries:
            cgroup = SessionCgroup(Path(entry.path))
            killed += len(cgroup.pids())
            cgroup.remove()
        for parent in self.hierarchies.v1_parents() if self.hierarchies is not None else []:
            try:
                left = [Path(e.path) for e in os.scandir(parent) if e.is_dir(follow_symlinks=False) and e.name not in keep]
            except OSError:
                continue
            deadline = time.monotonic() + CGROUP_EMPTY_WAIT_S
            for directory in left:  # their v2 cgroups are gone with their processes; a session's v1 one is left
                killed += _remove_v1(directory, deadline)
        return killed

    def close(self) -> None:
        """Blocking: remove the parent (and its directories in the v1 hierarchies) if no
        session's cgroup is left in it."""
        try:
            self.parent.rmdir()
        except OSError:
            pass
        for parent in self.hierarchies.v1_parents() if self.hierarchies is not None else []:
            remove_dir(parent)


def _remove_v1(directory: Path, deadline: float) -> int:
    """Blocking: remove session cgroup `directory` of a v1 hierarchy, killing what is still in it
    (a process of the session is in its v2 cgroup too, killed with it already; this is for a
    hierarchy a leader joined before its v2 cgroup was removed by hand) and retrying while the
    kernel says EBUSY (killed processes still exiting) until `deadline` (time.monotonic). Returns
    how many processes it killed; logs a directory it could not remove."""
    killed = 0
    while True:
        pids = SessionCgroup(directory).pids()
        killed += sum(_kill(pid, signal.SIGKILL) for pid in pids)
        try:
            directory.rmdir()
            return killed
        except FileNotFoundError:
            return killed
        except OSError as exc:
            if exc.errno == errno.EBUSY and time.monotonic() < deadline:
                time.sleep(CGROUP_RMDIR_RETRY_S)
                continue
            log.warning("could not remove cgroup %s: %s", directory, exc.strerror or exc)
            return killed


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _write_quietly(path: Path, data: bytes) -> bool:
    try:
        _write(path, data)
        return True
    except OSError:
        return False
