"""`fgpu exec`, `fgpu cp` and `fgpu logs` against the console as `make run` starts it (`manage.py standalone`):
there exec travels over the in-memory channel layer to the embedded agent on uvicorn's own event
loop, and the agent ships its output through eager Celery into SQLite — other transports than
the distributed stack's (tests/test_cli_e2e.py), the same code."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_browser import ADMIN_PASSWORD, console_url  # noqa: F401 (fixture)

pytestmark = pytest.mark.e2e

FGPU = str(Path(sys.executable).parent / "fgpu")


@pytest.fixture
def fgpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("FGPU_URL", "FGPU_TOKEN")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")

    def run(*args, input: str | None = None, timeout: float = 60):
        out = subprocess.run([FGPU, *args], input=input, capture_output=True, text=True, timeout=timeout, env=env)
        assert "Traceback" not in out.stderr, out.stderr
        return out

    return run


def test_exec_files_and_logs_work_in_standalone_mode(console_url, fgpu, tmp_path):  # noqa: F811
    login = fgpu("login", console_url, "-u", "admin", "--password-stdin", input=ADMIN_PASSWORD + "\n")
    assert login.returncode == 0 and "as admin (administrator)" in login.stderr, login.stderr
    me = json.loads(fgpu("whoami", "-o", "json").stdout)
    assert (me["username"], me["is_admin"]) == ("admin", True)

    assert fgpu("launch", "--name", "half", "--gpu", "0.5", "--wait", "--timeout", "60").returncode == 0
    out = fgpu("exec", "half", "--", "nvidia-smi")
    assert out.returncode == 0 and "4096MiB" in out.stdout, (out.stdout, out.stderr)
    out = fgpu("exec", "half", "--", "sh", "-c", "echo $CUDA_DEVICE_SM_LIMIT; exit 4")
    assert (out.returncode, out.stdout) == (4, "50\n"), out.stderr
    payload = os.urandom(600 * 1024 + 7)  # the files API too: three 256 KiB chunks each way
    (tmp_path / "payload.bin").write_bytes(payload)
    out = fgpu("cp", str(tmp_path / "payload.bin"), "half:payload.bin")
    assert out.returncode == 0, out.stderr
    out = fgpu("cp", "half:payload.bin", str(tmp_path / "back.bin"))
    assert out.returncode == 0 and (tmp_path / "back.bin").read_bytes() == payload, out.stderr

    launched = fgpu("launch", "--name", "job", "--fgpu", "0.5", "--command", "echo one; sleep 1; echo two",
                    "--wait", "--timeout", "60")
    assert launched.returncode == 0, launched.stderr
    followed = fgpu("logs", "-f", "job")
    assert (followed.returncode, followed.stdout) == (0, "one\ntwo\n"), followed.stderr
    assert json.loads(fgpu("logs", "-o", "json", "job").stdout)["complete"] is True

    assert fgpu("rm", "half").returncode == 0
