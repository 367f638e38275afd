"""Where a session's processes run: the runtime interface the agent drives, and the `process`
runtime (a PTY process group of the agent's own user on the node).

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

import fcntl
import logging
import os
import pty
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from dataclasses import dataclass
from pathlib import Path

import protocol

log = logging.getLogger(__name__)

PROCESS = "process"
DOCKER = "docker"
RUNTIMES = (PROCESS, DOCKER)


@dataclass(frozen=True)
class SessionPaths:
    """Where a session sees its files: its home (the working directory), the directory of the
    virtual nvidia-smi, and its allocation document."""

    home: str
    bin_dir: str
    allocation: str


class SessionHandle:
    """One running session as the agent drives it (the `process` runtime's; see DockerSession).

    `fd`: the terminal stream, non-blocking (`read` raises BlockingIOError when nothing waits,
    returns b"" at its end; `write` raises BlockingIOError when full). `pid`: the host pid of
    the session's leader, where there is one."""

    def __init__(self, session_id: str, process: subprocess.Popen, master_fd: int, *, env: dict, work_dir: Path):
        self.session_id = session_id
        self.process = process
        self.pid = process.pid
        self.started = _start_ticks("/proc", str(process.pid))  # no process older than its leader is the session's
        self.fd = master_fd
        self.env = env
        self.work_dir = work_dir

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
        return self.process.poll()

    def wait(self) -> int:
        """Blocking: the leader's exit status (negative: killed by that signal, as Popen says)."""
        return self.process.wait()

    def resize(self, rows: int, cols: int) -> None:
        set_winsize(self.fd, rows, cols)

    def signal_all(self, *sigs: int) -> None:
        """Blocking: each of `sigs`, in order, to every process of the session's process
        session: the leader first (an interactive shell ends on SIGHUP without waiting for the
        scan), then the others (one scan of /proc)."""
        for sig in sigs:
            _kill(self.pid, sig)
        signal_session(self.pid, *sigs)

    def kill_all(self) -> int:
        """Blocking: SIGKILL to every live process of the session, those that escaped its
        process session too (they carry its FGPU_SESSION_ID). Returns how many were signalled
        (0: none was left but zombies, so there is nothing to wait for)."""
        found = session_processes(self.session_id, self.pid, live_only=True, since=self.started)
        return sum(_kill(pid, signal.SIGKILL) for pid in found)

    def alive(self) -> bool:
        """Blocking: whether any process of the session is left (zombies do not count)."""
        return bool(session_processes(self.session_id, self.pid, live_only=True, since=self.started))

    def exec_popen(self, argv: list[str], *, stdout, stderr) -> subprocess.Popen:
        """Start `argv` beside the session: its environment and working directory, stdin from
        /dev/null, in a process session of its own (so `signal_session(popen.pid, …)` reaches
        all it starts). Raises FileNotFoundError / PermissionError as Popen does."""
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            cwd=self.work_dir,
            env=self.env,
            start_new_session=True,
            close_fds=True,
            preexec_fn=default_signals,
        )

    def signal_exec(self, process: subprocess.Popen, sig: int) -> None:
        """Blocking: `sig` to a command started by `exec_popen` and everything it started."""
        signal_session(process.pid, sig)

    def end_reason(self, exit_code: int) -> str:
        """Why it ended, where the runtime knows more than the exit code ("" here)."""
        return ""

    def remove(self) -> None:
        """Blocking: what is left once the session ended (nothing, for a process)."""


class ProcessRuntime:
    """Sessions as PTY process groups of the agent's own Unix user, sharing the node's files and
    processes: for the standalone default and GPU-less development. Nothing isolates one session
    from another or from the agent (use the docker runtime where more than one trusted person
    shares a node); `cpu` and `mem` are accounted, not enforced."""

    name = PROCESS

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

    def spawn(self, *, spec: dict, argv: list[str], env: dict, work_dir: Path, progress=None) -> SessionHandle:
        """Blocking: `argv` on a new PTY in its own process session, in `work_dir` with `env`
        (`progress`: unused, there is nothing to pull)."""
        master_fd, slave_fd = pty.openpty()
        set_winsize(slave_fd, 24, 80)
        try:
            process = subprocess.Popen(
                argv,
                stdin=slave_fd,
                stdout=slave_fd,
                stderr=slave_fd,
                cwd=work_dir,
                env=env,
                start_new_session=True,
                close_fds=True,
                preexec_fn=_make_controlling_tty,
            )
        except BaseException:
            os.close(master_fd)
            raise
        finally:
            os.close(slave_fd)
        os.set_blocking(master_fd, False)
        return SessionHandle(spec["session_id"], process, master_fd, env=env, work_dir=work_dir)

    def clean_up_at_start(self, scratch_root: Path) -> tuple[list[SessionHandle], int]:
        """Blocking, when the agent starts: sessions to adopt (none: a PTY does not survive its
        agent) and how many processes an earlier run's sessions left were killed."""
        return [], kill_orphans(scratch_root)

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


def _make_controlling_tty() -> None:
    # After setsid (start_new_session), make the PTY on stdin the controlling terminal so
    # job control and SIGWINCH work in the shell; and give the session default signal
    # handling (Ctrl-C would do nothing in the terminal otherwise).
    default_signals()
    try:
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    except OSError:
        pass


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


def kill_orphans(scratch_root: Path, *, proc: str = "/proc") -> int:
    """SIGKILL every process whose session working directory lies under `scratch_root` (its
    `FGPU_ALLOCATION` names a file there): what sessions of an earlier run of this agent left
    when the agent died. Returns how many were killed."""
    prefix = f"FGPU_ALLOCATION={Path(scratch_root).resolve()}/".encode()
    own, killed = os.getpid(), 0
    for entry in os.scandir(proc):
        if not entry.name.isdigit() or int(entry.name) == own:
            continue
        if any(var.startswith(prefix) for var in _environ(proc, entry.name).split(b"\0")):
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
