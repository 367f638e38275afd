"""A process-runtime session's terminal holder (issue 33, item 7): a small process per session that
owns its PTY's master and is the parent of its leader, so that the session outlives its agent (a
restart of `make run`, an agent killed with SIGKILL) as a docker session outlives it in its
container; the agent that starts again re-attaches to it (ProcessRuntime.clean_up_at_start).

Run as `python -I holder.py SOCKET RING_BYTES MASTER_FD SLAVE_FD KEEP_FDS -- LEADER_ARGV...` by
the agent's Python (ProcessRuntime.spawn), in a process session and a cgroup of its own (so the
agent's terminal, process group, signals and cgroup do not reach it), with the PTY's two ends and
whatever the leader inherits besides (bwrap's status and block pipes: KEEP_FDS, comma-separated,
empty for none) passed as open descriptors; a descriptor it holds and passes on to no one (slirp4netns's exit
pipe) lives as long as it does. The leader's environment comes on stdin, `NAME=value` entries
each ended by a NUL (the holder's own has none of the session's: a scan for a session's processes
by FGPU_SESSION_ID does not find it). It starts the leader on the PTY's slave in the holder's working directory and says its pid
on stdout (a line; then stdout is closed), then serves one agent at a time on the Unix socket
SOCKET (mode 0600, in the agent's scratch root, out of every session's sight):

- on connect, one byte with the PTY's master attached (SCM_RIGHTS: the agent sets the window size
  on it), then the scrollback: the last RING_BYTES bytes of output, written before and while no
  agent was attached, then the output as it comes;
- what the agent writes is the terminal's input;
- a new connection replaces the last one (an agent that starts again).

Output is read only while the attached agent takes it (its socket buffer and PENDING_MAX: the
backpressure reaches the session's program) or, with no agent, into the ring (the oldest dropped).
When the leader exits, its status is written to `SOCKET.exit` ("<code>\\n", negative: killed by
that signal), what is left on the PTY is sent, and the connection is closed; the holder then
exits, or waits up to ORPHAN_WAIT_S for an agent to collect the rest. It imports only modules
of the standard library written in C (`_socket`, `select`, `array`, …; not `subprocess`,
`socket` or `selectors`, whose imports took 40 ms of its start on the busy 2-core VM).
"""

from __future__ import annotations

import _socket
import array
import errno
import os
import select
import signal
import sys
import time

PENDING_MAX = 16 * 1024  # bytes of output waiting for the attached agent before the PTY is no longer read
SEND_BUFFER = 32 * 1024  # the connection's socket buffer (SO_SNDBUF): with PENDING_MAX, all a holder holds back
INPUT_MAX = 4 * 1024  # bytes of input waiting for the PTY before the agent's socket is no longer read
ORPHAN_WAIT_S = 600.0  # how long an ended session's holder waits for an agent to collect its last output
CHUNK = 65536
IN, OUT = select.POLLIN, select.POLLOUT
DONE = select.POLLHUP | select.POLLERR | select.POLLNVAL


def send_fd(sock, fd: int) -> None:
    """One byte on `sock` (a socket) with descriptor `fd` attached (SCM_RIGHTS)."""
    sock.sendmsg([b"\0"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, array.array("i", [fd]))])


def receive_fd(sock) -> int:
    """Blocking: the descriptor `send_fd` attached to its byte. Raises OSError when none came."""
    fds = array.array("i")
    data, ancdata, _, _ = sock.recvmsg(1, _socket.CMSG_SPACE(fds.itemsize))
    for level, kind, payload in ancdata:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    if not data or not fds:
        raise OSError(errno.EPROTO, "the session's holder sent no terminal")
    return fds[0]


class Holder:
    """The holder's state and its poll loop (`run`): the PTY's `master`, the `listener` socket,
    the leader's pid and pidfd."""

    def __init__(self, listener, master: int, leader: int, ring_bytes: int, exit_path: str):
        self.listener, self.master, self.leader = listener, master, leader
        self.ring_bytes, self.exit_path = ring_bytes, exit_path
        self.ring = bytearray()
        self.agent: _socket.socket | None = None  # the attached agent's connection
        self.pending = bytearray()  # output for the attached agent
        self.input = bytearray()  # input for the PTY
        self.pty_done = False  # the PTY's end (EIO: no process holds its slave any more)
        self.code: int | None = None
        self.pidfd = os.pidfd_open(leader)

    def run(self) -> None:
        ended_at = None
        while True:
            if self.code is not None and self.pty_done and not self.pending:
                if self.agent is not None:  # everything sent: the agent sees the end of its stream
                    self._detach()
                    return
                ended_at = ended_at or time.monotonic()
                if time.monotonic() - ended_at > ORPHAN_WAIT_S:
                    return
            poller = select.poll()
            poller.register(self.listener.fileno(), IN)
            if self.code is None:
                poller.register(self.pidfd, IN)
            master = (IN if len(self.pending) < PENDING_MAX else 0) | (OUT if self.input else 0)
            if not self.pty_done and master:
                poller.register(self.master, master)
            if self.agent is not None:
                poller.register(self.agent.fileno(), (IN if len(self.input) < INPUT_MAX else 0) | (OUT if self.pending else 0))
            for fd, events in poller.poll(1000 if self.code is not None else None):
                if fd == self.listener.fileno():
                    self._accept()
                elif fd == self.pidfd:
                    self._exited()
                elif fd == self.master:
                    self._pty(events)
                elif self.agent is not None and fd == self.agent.fileno():
                    self._agent(events)

    def _accept(self) -> None:
        fd, _ = self.listener._accept()
        conn = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM, 0, fd)
        self._detach()
        try:
            send_fd(conn, self.master)
        except OSError:
            conn.close()
            return
        conn.setsockopt(_socket.SOL_SOCKET, _socket.SO_SNDBUF, SEND_BUFFER)
        conn.setblocking(False)
        self.agent = conn
        self.pending = bytearray(self.ring)  # the scrollback first

    def _detach(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        self.pending = bytearray()

    def _exited(self) -> None:
        _, status = os.waitpid(self.leader, 0)
        self.code = os.waitstatus_to_exitcode(status)  # negative: killed by that signal (as subprocess says)
        os.close(self.pidfd)
        tmp = f"{self.exit_path}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{self.code}\n")
        os.replace(tmp, self.exit_path)

    def _pty(self, events: int) -> None:
        if events & OUT and self.input:
            try:
                del self.input[: os.write(self.master, self.input)]
            except BlockingIOError:
                pass
            except OSError:
                self.input.clear()
        if events & (IN | DONE):
            try:
                data = os.read(self.master, CHUNK)
            except BlockingIOError:
                return
            except OSError:  # EIO: the slave's last holder is gone
                data = b""
            if not data:
                self.pty_done = True
                return
            self.ring += data
            if len(self.ring) > 2 * self.ring_bytes:
                del self.ring[: -self.ring_bytes]
            if self.agent is not None:
                self.pending += data

    def _agent(self, events: int) -> None:
        assert self.agent is not None
        if events & (IN | DONE):
            try:
                data = self.agent.recv(CHUNK)
            except BlockingIOError:
                data = None
            except OSError:
                data = b""
            if data == b"":  # the agent went away (ended, or restarting): keep the ring for the next
                self._detach()
                return
            if data:
                self.input += data
        if events & OUT and self.pending:
            try:
                del self.pending[: self.agent.send(self.pending)]
            except BlockingIOError:
                pass
            except OSError:
                self._detach()


def _ignore(signum, frame) -> None:
    """SIGHUP, SIGINT, SIGTERM reach the holder only by mistake (a caught signal, unlike an ignored
    one, is not passed on to the leader it starts)."""


def _read_env(fd: int) -> dict[str, str]:
    data = bytearray()
    while chunk := os.read(fd, CHUNK):
        data += chunk
    env = {}
    for entry in bytes(data).split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep:
            env[os.fsdecode(name)] = os.fsdecode(value)
    return env


def main(argv: list[str]) -> int:
    if len(argv) < 7 or argv[5] != "--":
        os.write(2, b"usage: python holder.py SOCKET RING_BYTES MASTER_FD SLAVE_FD KEEP_FDS -- ARGV...\n")
        return 2
    socket_path, ring_bytes, master, slave = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _ignore)
    keep = [int(fd) for fd in argv[4].split(",") if fd]
    env = _read_env(0)
    os.set_blocking(master, False)
    os.set_inheritable(master, False)
    for name in os.listdir("/proc/self/fd"):  # what the leader inherits: `keep` only (and the slave, as 0, 1, 2)
        fd = int(name)
        if fd > 2 and fd not in keep and fd != slave:
            try:
                os.set_inheritable(fd, False)
            except OSError:  # the listing's own descriptor, closed meanwhile
                pass
    leader = os.posix_spawn(
        argv[6],
        argv[6:],
        env,
        file_actions=[(os.POSIX_SPAWN_DUP2, slave, 0), (os.POSIX_SPAWN_DUP2, slave, 1), (os.POSIX_SPAWN_DUP2, slave, 2),
                      (os.POSIX_SPAWN_CLOSE, slave)],
        setsid=True,
        setsigdef=(signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGPIPE),
    )  # fmt: skip
    os.close(slave)
    for fd in keep:
        os.close(fd)
    listener = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(socket_path)
    finally:
        os.umask(old)
    listener.listen(4)
    os.write(1, f"{leader}\n".encode())  # the agent's go-ahead: its leader runs, its socket listens
    os.close(1)
    try:
        Holder(listener, master, leader, ring_bytes, socket_path + ".exit").run()
    finally:
        listener.close()
        try:
            os.unlink(socket_path)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
