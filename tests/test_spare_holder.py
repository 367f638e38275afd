"""The process runtime's spare holder (issue 35.3): a holder (agent.holder, `--spare`) started
before any session needs it (ProcessRuntime.warm, at the agent's start and after each launch)
takes the next session, in the sandbox, its own cgroup and with the descriptors bwrap is told
about at the numbers it is told; a spare that died meanwhile costs the launch nothing but the
holder's start; the runtime's close ends the spare that still waits."""

from __future__ import annotations

import os
import select
import signal
import uuid
from pathlib import Path

from agent.runtimes import CGROUP_AUTO, HOLDER_SCRIPT, ProcessRuntime
from agent.holder import SPARE
from agent.sandbox import STAGE_POINT, Sandbox
from tests.stack import wait_until
from tests.test_agent_runtime import typed_spec

COMMAND = 'echo inside-$((40 + 2)) "$(id -u)"; exec sleep 30'


def spares() -> set[int]:
    """The pids of this process's children started as spare holders (those that took a session
    since too: their command line is the same)."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        except OSError:
            continue
        if str(HOLDER_SCRIPT).encode() in argv and SPARE.encode() in argv and int(parent) == os.getpid():
            found.add(int(pid))
    return found


def output(handle, wanted: bytes, timeout: float = 20.0) -> bytes:
    """What the session wrote on its terminal, through its holder's connection, up to `wanted`."""
    seen = b""
    while wanted not in seen:
        ready, _, _ = select.select([handle.fd], [], [], timeout)
        assert ready, f"the session did not write {wanted!r}: {seen!r}"
        try:
            chunk = handle.read(65536)
        except BlockingIOError:
            continue
        assert chunk, f"the session's terminal ended before {wanted!r}: {seen!r}"
        seen += chunk
    return seen


def spawn(runtime: ProcessRuntime, scratch: Path):
    work_dir = scratch / str(uuid.uuid4())
    work_dir.mkdir(parents=True)
    spec = typed_spec(session_id=work_dir.name, owner_is_staff=False, devices=[])
    argv = ["/bin/sh", "-c", COMMAND]
    return runtime.spawn(spec=spec, argv=argv, env={"PATH": "/usr/bin:/bin"}, work_dir=work_dir)


def end(handle) -> None:
    handle.kill_all()
    handle.wait()
    handle.close_stream()
    handle.remove()


def test_the_spare_holder_takes_a_sandboxed_session_in_its_cgroup_and_the_runtime_ends_the_next_one(tmp_path):
    others = spares()  # earlier tests' runtimes' (ended with this process)
    runtime = ProcessRuntime(node=f"spare-{uuid.uuid4().hex[:8]}", cgroup_root=CGROUP_AUTO, hold=True)
    scratch = tmp_path / "scratch"
    runtime.clean_up_at_start(scratch)
    handle = None
    try:
        [spare] = spares() - others  # the agent's start leaves one waiting
        assert runtime.sandbox is not None
        if runtime.sandbox.hidden(runtime.sandbox.read_only):  # the agent's Python is staged where the spare waits
            assert os.readlink(f"/proc/{spare}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
        handle = spawn(runtime, scratch)
        assert handle.holder_pid == spare, "the session got a holder of its own, not the spare"
        # bwrap said its init's pid on the descriptor its command line names: the leader has it at that number
        assert handle.init_pid > 0 and handle.sandbox is not None
        assert f"/holder-{handle.session_id}\n" in Path(f"/proc/{spare}/cgroup").read_text(), "the spare left in no cgroup"
        assert b"inside-42 1000" in output(handle, b"inside-42"), "the session did not run as the session's user"
        assert spares() - others == {spare}, "a spare waits before the runtime was asked for one"
        runtime.warm()
        runtime.warm()  # one waits already: no second
        assert len(spares() - others - {spare}) == 1
    finally:
        if handle is not None:
            end(handle)
        runtime.close()
    assert not spares() - others, "the runtime's close left a holder running"


def test_a_spare_holder_that_died_leaves_the_session_a_holder_of_its_own(tmp_path):
    others = spares()
    runtime = ProcessRuntime(node=f"spare-{uuid.uuid4().hex[:8]}", cgroup_root=CGROUP_AUTO, hold=True)
    scratch = tmp_path / "scratch"
    runtime.clean_up_at_start(scratch)
    handle = None
    try:
        [spare] = spares() - others
        os.kill(spare, signal.SIGKILL)
        wait_until(lambda: Path(f"/proc/{spare}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", what="the spare's end")
        handle = spawn(runtime, scratch)
        assert handle.holder_pid != spare and handle.holder is not None and SPARE not in handle.holder.args
        assert b"inside-42 1000" in output(handle, b"inside-42")
        assert not Path(f"/proc/{spare}").exists(), "the dead spare was not reaped"
    finally:
        if handle is not None:
            end(handle)
        runtime.close()


def test_a_leader_stages_nothing_where_its_holder_staged_all_it_would_and_everything_where_it_did_not(tmp_path):
    sandbox = Sandbox(
        bwrap="/usr/bin/bwrap", setpriv="/usr/bin/setpriv", unshare="/usr/bin/unshare", nsenter="/usr/bin/nsenter",
        uid=1000, gid=1000, drop=True, share_net=False, read_only=(str(tmp_path / "python"),),
    )  # fmt: skip
    (tmp_path / "python").mkdir()
    tmp_path.chmod(0o700)  # the session's user cannot reach it
    hidden = sandbox.hidden(sandbox.read_only)
    assert hidden == [str(tmp_path / "python")]
    argv, staged = sandbox.spare_command(["python", "holder.py", SPARE])
    assert staged == tuple(hidden) and argv[:4] == ["/usr/bin/unshare", "--mount", "--propagation", "slave"]
    assert argv[-3:] == ["python", "holder.py", SPARE]
    home = tmp_path / "home"  # hidden too: the leader stages both, as without a spare
    command = sandbox.command(["bash"], home=home, data=[], status_fd=5, staged=staged)
    assert command[:4] == ["/usr/bin/unshare", "--mount", "--propagation", "private"] and str(home) in command
    shown = Path("/tmp")  # searchable: only what the holder staged is hidden
    command = sandbox.command(["bash"], home=shown, data=[], status_fd=5, staged=staged)
    assert command[0] == "/usr/bin/setpriv" and "--ro-bind" in command
    assert command[command.index(str(STAGE_POINT / "0")) + 1] == str(tmp_path / "python")
