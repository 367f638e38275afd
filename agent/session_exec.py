"""The agent's side of blocking exec (`pty.exec`): run a command beside a session's process, in
its environment and working directory (and its sandbox and cgroup, where it has them: the
runtime's `exec_popen`), stdin from /dev/null, for at most a timeout, and answer with its whole
result at once. Streamed exec (`pty.exec_stream`) is agent.exec_stream.

Blocking: each exec holds a thread of the agent's exec pool (EXEC_THREADS) up to its timeout.
Its output goes to temporary files, each cut to EXEC_OUTPUT_BYTES, so a chatty command cannot fill
the agent's memory. The command runs in a process session of its own: killed whole (SIGKILL) on
timeout, after it exits (what it left in the background), and when its session stops
(`kill_execs`).
"""

from __future__ import annotations

import signal
import subprocess
import tempfile
import time
from typing import Any

EXEC_OUTPUT_BYTES = 1024 * 1024  # stdout and stderr of an exec are each cut to this many bytes


def run_exec(process: Any, execs: set, argv: list[str] | str, timeout: float, *, shell: str) -> dict:
    """Blocking: run `argv` (a list; one string is a shell command line for `shell -c`) beside the
    session whose runtime handle is `process` (`exec_popen`, `signal_exec`), noting the running
    command in `execs` (the session's set, which its stop kills), for at most `timeout` seconds.
    Returns `{"exit_code", "stdout", "stderr", "timed_out", "truncated", "duration_ms"}`: exit
    code 128+N when killed by signal N, 127/126 when the command is missing/not executable (with
    the reason in stderr); stdout and stderr decoded as UTF-8 (replacing), each cut to
    EXEC_OUTPUT_BYTES (`truncated`). Raises what `exec_popen` raises otherwise (OSError)."""
    if isinstance(argv, str):
        argv = [shell, "-c", argv]
    started = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            command = process.exec_popen(argv, stdout=out, stderr=err)
        except (FileNotFoundError, PermissionError) as exc:
            return {
                "exit_code": 127 if isinstance(exc, FileNotFoundError) else 126,
                "stdout": "",
                "stderr": f"{argv[0]}: {exc.strerror}\n",
                "timed_out": False,
                "truncated": False,
                "duration_ms": 0,
            }
        execs.add(command)
        timed_out = False
        try:
            code = command.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            process.signal_exec(command, signal.SIGKILL)
            code = command.wait()
        finally:
            process.signal_exec(command, signal.SIGKILL)  # what it left running in the background
            execs.discard(command)
        outputs, truncated = [], False
        for f in (out, err):
            f.seek(0)
            data = f.read(EXEC_OUTPUT_BYTES + 1)
            truncated |= len(data) > EXEC_OUTPUT_BYTES
            outputs.append(data[:EXEC_OUTPUT_BYTES].decode("utf-8", "replace"))
    return {
        "exit_code": code if code >= 0 else 128 - code,
        "stdout": outputs[0],
        "stderr": outputs[1],
        "timed_out": timed_out,
        "truncated": truncated,
        "duration_ms": int((time.monotonic() - started) * 1000),
    }


def exec_result(result: dict) -> dict:
    """The answer on the exec's reply channel: `{"type": "exec.result", **result}` (`result`: as
    `run_exec` returns, or `{"error": "…"}` when the command could not be started)."""
    return {"type": "exec.result", **result}


def kill_execs(process: Any, execs: set) -> None:
    """Blocking: SIGKILL every command of `execs` still running beside the session (its stop)."""
    for command in list(execs):
        process.signal_exec(command, signal.SIGKILL)
