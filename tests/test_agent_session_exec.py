"""agent.session_exec alone: a blocking exec beside a session, with no agent or session around
it: the runtime's handle is a small stand-in that starts the command in a process session of its
own, as the runtimes do (their own exec_popen is tested with them: tests/test_agent_logs_exec.py,
tests/test_docker_runtime.py)."""

from __future__ import annotations

import os
import signal
import subprocess

from agent import session_exec
from tests.stack import wait_until


class Beside:
    """exec_popen / signal_exec as a runtime without sandbox or cgroup has them."""

    def exec_popen(self, argv, *, stdout, stderr):
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, start_new_session=True)

    def signal_exec(self, process, sig):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass


def run(argv, timeout=10.0):
    execs: set = set()
    result = session_exec.run_exec(Beside(), execs, argv, timeout, shell="/bin/sh")
    assert execs == set()  # no command left noted once it returned
    return result


def test_a_command_line_runs_in_the_shell_and_its_result_is_whole():
    result = run("echo out; echo err >&2; exit 3")
    assert {k: result[k] for k in ("exit_code", "stdout", "stderr", "timed_out", "truncated")} == {
        "exit_code": 3,
        "stdout": "out\n",
        "stderr": "err\n",
        "timed_out": False,
        "truncated": False,
    }
    assert result["duration_ms"] >= 0


def test_a_command_past_its_timeout_is_killed_with_what_it_started_and_said_so():
    result = run("sleep 30 & echo $! ; sleep 30", timeout=0.5)
    assert result["timed_out"] and result["exit_code"] == 128 + signal.SIGKILL
    background = int(result["stdout"].split()[0])

    def gone() -> bool:  # SIGKILL takes effect when the process next runs; a zombie holds nothing
        try:
            with open(f"/proc/{background}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    wait_until(gone, timeout=10, interval=0.01, what="the command's background job killed with it")


def test_output_is_cut_at_the_limit_and_marked(monkeypatch):
    monkeypatch.setattr(session_exec, "EXEC_OUTPUT_BYTES", 10)
    result = run(["/bin/sh", "-c", "printf 0123456789abcdef"])
    assert result["stdout"] == "0123456789" and result["truncated"]


def test_a_missing_command_answers_127_with_the_reason():
    result = run(["/nonexistent/fgpu-h1-command"])
    assert result["exit_code"] == 127 and "No such file or directory" in result["stderr"]


def test_the_answer_names_its_type_and_a_stop_kills_the_commands_still_running():
    assert session_exec.exec_result({"error": "x"}) == {"type": "exec.result", "error": "x"}
    command = Beside().exec_popen(["sleep", "30"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    session_exec.kill_execs(Beside(), {command})
    assert command.wait(timeout=10) == -signal.SIGKILL
