"""The `fgpu` command line against the distributed stack (uvicorn, a Celery manager worker and
an agent process with the demo mock node: one 8 GiB / 80-SM GPU, 1.0 fGPU = 4 GiB and 40 SMs).
Every step runs the installed console script as a subprocess, with its own config directory.
"""
from __future__ import annotations

import json
import os
import pty
import select
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import test_e2e_distributed as distributed
from tests.conftest import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

cluster = distributed.cluster  # the stack and user alice (password alice-pass-123)
FGPU = str(Path(sys.executable).parent / "fgpu")


@pytest.fixture
def fgpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("FGPU_URL", "FGPU_TOKEN")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")

    def run(*args, input: str | None = None, timeout: float = 60, extra_env: dict | None = None):
        out = subprocess.run([FGPU, *args], input=input, capture_output=True, text=True, timeout=timeout,
                             env={**env, **(extra_env or {})}, cwd=tmp_path)
        assert "Traceback" not in out.stderr, out.stderr
        return out

    run.env = env
    run.config = tmp_path / "config" / "fgpu" / "config.json"
    return run


def test_login_launch_exec_describe_ps_logs_rm(cluster, fgpu):
    base, _ = cluster

    out = fgpu("login", base, "--username", "alice", "--password-stdin", input="wrong-password\n")
    assert out.returncode == 1 and out.stderr.startswith("fgpu: error: login refused"), out.stderr
    out = fgpu("login", base, "--username", "alice", "--password-stdin", input="alice-pass-123\n")
    assert out.returncode == 0, out.stderr
    assert stat.S_IMODE(fgpu.config.stat().st_mode) == 0o600
    assert json.loads(fgpu.config.read_text())["url"] == base

    # Run:ai's --gpu 0.5: half of the 8 GiB GPU's memory (and SMs) → 4096 MiB.
    out = fgpu("launch", "--name", "half", "--gpu", "0.5", "--wait", "--timeout", "60")
    assert out.returncode == 0, out.stderr
    half = out.stdout.strip()
    assert len(half) == 36 and "RUNNING" in out.stderr

    # exec runs on the node beside the session's shell (server-side, not typed into the terminal).
    out = fgpu("exec", "half", "--", "nvidia-smi")
    assert out.returncode == 0, out.stderr
    assert "4096MiB" in out.stdout and "8192MiB /" not in out.stdout, out.stdout
    assert "\r\n" not in out.stdout  # pipes, not a terminal

    out = fgpu("exec", half[:8], "--", "sh", "-c", "echo to-stderr >&2; exit 3")
    assert (out.returncode, out.stdout, out.stderr) == (3, "", "to-stderr\n")
    out = fgpu("exec", "half", "--", "echo $CUDA_DEVICE_MEMORY_LIMIT_0 $CUDA_DEVICE_SM_LIMIT; echo two")
    assert (out.returncode, out.stdout) == (0, "4096m 50\ntwo\n"), (out.stdout, out.stderr)
    out = fgpu("exec", "half", "--", "printf", "%s|", "a b", "c")  # an argument vector stays one
    assert (out.returncode, out.stdout) == (0, "a b|c|"), (out.stdout, out.stderr)
    result = json.loads(fgpu("exec", "-o", "json", "half", "--", "pwd").stdout)
    assert result["exit_code"] == 0 and result["stdout"].rstrip().endswith(half), result
    out = fgpu("exec", "--timeout", "1", "half", "--", "sleep 20")
    assert out.returncode == 1 and "timeout of 1 s" in out.stderr, out.stderr

    out = fgpu("describe", "half")
    assert out.returncode == 0, out.stderr
    for text in ("RUNNING", "e2e-node", "CUDA_DEVICE_MEMORY_LIMIT_0:", "4096m", "CUDA_DEVICE_SM_LIMIT:"):
        assert text in out.stdout, out.stdout
    described = json.loads(fgpu("describe", half, "--output", "json").stdout)
    assert described["environment"]["CUDA_DEVICE_SM_LIMIT"] == "50"
    assert described["allocations"][0]["memory"] == 4 << 30

    # Backend.AI's fGPU: 0.5 fGPU = 2 GiB.
    out = fgpu("launch", "--name", "quarter", "--fgpu", "0.5", "--wait", "--timeout", "60")
    assert out.returncode == 0, out.stderr
    quarter = out.stdout.strip()
    out = fgpu("exec", quarter, "--", "nvidia-smi")
    assert out.returncode == 0 and "2048MiB" in out.stdout, (out.stdout, out.stderr)

    listed = json.loads(fgpu("ps", "--output", "json").stdout)
    assert {s["id"]: s["status"] for s in listed} == {half: "RUNNING", quarter: "RUNNING"}
    out = fgpu("ps")
    assert out.returncode == 0 and "half" in out.stdout and "quarter" in out.stdout, out.stdout

    out = fgpu("devices")
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("e2e-node"))
    assert "2.00 fGPU" in row and "1.50 fGPU" in row and "0.50 fGPU" in row, out.stdout
    assert json.loads(fgpu("nodes", "-o", "json").stdout)[0]["name"] == "e2e-node"

    # More than the node holds: refused at once, the server's reason on one line.
    out = fgpu("launch", "--fgpu", "5")
    assert out.returncode == 1 and out.stderr.startswith("fgpu: error: ") and out.stderr.count("\n") == 1, out.stderr

    # A batch session: exec reaches it too, and its output is kept after it ends.
    out = fgpu("launch", "--name", "job", "--fgpu", "0.25", "--command",
               "for i in 1 2 3; do echo tick-$i; sleep 0.5; done; sleep 2; echo done", "--wait", "--timeout", "60")
    assert out.returncode == 0, out.stderr
    out = fgpu("exec", "job", "--", "nvidia-smi")
    assert out.returncode == 0 and "1024MiB" in out.stdout, (out.stdout, out.stderr)
    followed = fgpu("logs", "-f", "job", timeout=60)
    assert followed.returncode == 0, followed.stderr
    assert followed.stdout.replace("\r\n", "\n") == "tick-1\ntick-2\ntick-3\ndone\n", followed.stdout
    assert "ended: TERMINATED (exit code 0)" in followed.stderr
    out = fgpu("logs", "job")  # after the end: the same output
    assert out.returncode == 0 and out.stdout == followed.stdout
    log = json.loads(fgpu("logs", "job", "-o", "json").stdout)
    assert log["complete"] is True and "tick-2" in log["text"]

    out = fgpu("rm", "half", "quarter")
    assert out.returncode == 0, out.stderr

    def ended():
        sessions = json.loads(fgpu("ps", "--all", "-o", "json").stdout)
        return all(s["status"] == "TERMINATED" for s in sessions) and sessions
    wait_until(ended, timeout=30, what="both sessions to be TERMINATED")
    out = fgpu("exec", "half", "--", "true")
    assert out.returncode == 1 and "TERMINATED" in out.stderr, out.stderr
    out = fgpu("rm", "no-such-session")
    assert out.returncode == 1 and "no session" in out.stderr

    out = fgpu("quota")
    assert out.returncode in (0, 1), out.stderr  # 1 with a clear message while the server has no quota API
    out = fgpu("ps", extra_env={"FGPU_URL": "http://127.0.0.1:1"})
    assert out.returncode == 3 and "cannot reach" in out.stderr
    out = fgpu("ps", extra_env={"FGPU_TOKEN": "not-a-token"})
    assert out.returncode == 3, out.stderr
    assert fgpu("logout").returncode == 0 and not fgpu.config.exists()
    assert fgpu("ps").returncode == 3


def read_from(pipe, until: bytes, timeout: float = 20) -> bytes:
    """Read a child's pipe until `until` has arrived (failing after `timeout` s): what was read."""
    seen = b""
    deadline = time.monotonic() + timeout
    while until not in seen:
        assert time.monotonic() < deadline, f"{until!r} not seen within {timeout} s: {seen!r}"
        ready, _, _ = select.select([pipe], [], [], 0.2)
        if ready:
            data = os.read(pipe.fileno(), 65536)
            assert data, f"the pipe closed before {until!r}: {seen!r}"
            seen += data
    return seen


def test_interactive_terminal_in_a_pty_with_resize_and_detach(cluster, fgpu):
    base, _ = cluster
    assert fgpu("login", base, "-u", "alice", "--password-stdin", input="alice-pass-123\n").returncode == 0
    out = fgpu("launch", "--name", "tty", "--fgpu", "0.5", "--wait", "--timeout", "60")
    assert out.returncode == 0, out.stderr

    # Streamed: the first line arrives while the command still waits for a file only this test creates.
    proc = subprocess.Popen([FGPU, "exec", "tty", "--", "echo first; until [ -e go ]; do sleep 0.1; done; "
                                                       "echo second; exit 5"], env=fgpu.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert read_from(proc.stdout, b"first\n") == b"first\n"
        assert proc.poll() is None  # it is still waiting
        assert fgpu("exec", "tty", "--", "touch go").returncode == 0
        rest, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert (proc.returncode, rest, err) == (5, b"second\n", b"")

    # Ctrl-C stops the remote command, with what it started in the background, and exits 130.
    # As an interactive shell starts its foreground job: SIGINT at its default disposition (in the
    # whole suite's process something earlier leaves it ignored, which a child inherits, as a
    # background job's is; Python then installs no KeyboardInterrupt handler, and Ctrl-C is lost).
    proc = subprocess.Popen([FGPU, "exec", "--timeout", "120", "tty", "--",
                             "sleep 300 & echo $! > child; echo $$ > pid; echo started; wait"], env=fgpu.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        read_from(proc.stdout, b"started\n")
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and b"Traceback" not in err, err
    assert b"the remote command was stopped" in err, err
    out = fgpu("exec", "tty", "--", "for p in $(cat pid child); do s=$(cut -d' ' -f3 /proc/$p/stat 2>/dev/null); "
                                    "[ -n \"$s\" ] && [ \"$s\" != Z ] && echo \"$p alive\"; done; echo checked")
    assert (out.returncode, out.stdout) == (0, "checked\n"), out.stderr
    out = fgpu("exec", "tty", "--", "echo alive")
    assert (out.returncode, out.stdout) == (0, "alive\n"), out.stderr

    master, slave = pty.openpty()
    import fcntl
    import struct
    import termios

    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 111, 0, 0))
    before = termios.tcgetattr(slave)
    proc = subprocess.Popen([FGPU, "terminal", "tty"], stdin=slave, stdout=slave, stderr=slave, env=fgpu.env,
                            start_new_session=True)
    seen = b""

    def read_until(text: bytes, timeout: float = 20) -> bytes:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while text not in seen:
            assert time.monotonic() < deadline, seen.decode(errors="replace")
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                seen += os.read(master, 65536)
        return seen

    try:
        read_until(b"Ctrl-] detaches")
        # Connected once fgpu put the local terminal in raw mode (then it sends the size, then the keys):
        # typed earlier, the line discipline would echo and translate the keys itself.
        wait_until(lambda: termios.tcgetattr(slave) != before, timeout=20, what="fgpu to set the terminal raw")
        os.write(master, b"echo size=$(stty size) sum=$((20+22))\r")
        read_until(b"echo size=$(stty size)")  # the session's shell echoes what is typed
        read_until(b"size=33 111 sum=42")
        os.write(master, b"\x1d")  # Ctrl-] detaches; the session keeps running
        assert proc.wait(timeout=15) == 0
        read_until(b"detached")
        assert termios.tcgetattr(slave) == before  # the local terminal is restored
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
        os.close(slave)
    [session] = json.loads(fgpu("ps", "-o", "json").stdout)
    assert session["status"] == "RUNNING"
    assert fgpu("rm", "tty").returncode == 0
