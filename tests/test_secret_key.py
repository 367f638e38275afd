"""The console's SECRET_KEY (common.secret_key, issue 31.7), as real processes: the web, the
manager worker and beat refuse to start without a key of their own (unset, short, a placeholder),
saying why; the agent starts without one; standalone makes a key once, keeps it in its data dir
(mode 0600) and uses the same one next time."""
from __future__ import annotations

import os
import secrets
import subprocess

import pytest

from common.secret_key import MIN_LENGTH, secret_key_problem
from tests.stack import (BIN, PYTHON, ROOT, Proc, StackNode, free_port, mock_inventory, remove_agent_cgroups, wait_until,
                         web_command)

BAD_KEYS = {"unset": None, "short": "k" * (MIN_LENGTH - 1), "placeholder": "change-me-change-me-change-me-change-me"}


def env_with_key(key: str | None, tmp_path) -> dict:
    env = {**os.environ, "FGPU_DATA_DIR": str(tmp_path / "data"), "PYTHONUNBUFFERED": "1"}
    env.pop("FGPU_SECRET_KEY", None)
    if key is not None:
        env["FGPU_SECRET_KEY"] = key
    return env


@pytest.mark.parametrize("value", ["", "x" * 31, "change-me", "CHANGE-ME-" + "a" * 40, "dev-only-insecure-key-" + "a" * 20])
def test_unusable_keys_are_named(value):
    assert secret_key_problem(value)


def test_a_random_key_is_usable():
    assert secret_key_problem(secrets.token_urlsafe(48)) is None


def run_to_exit(argv: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.e2e
@pytest.mark.parametrize("bad", sorted(BAD_KEYS))
def test_the_web_refuses_to_start_without_a_key_of_its_own(bad, tmp_path):
    out = run_to_exit(web_command(free_port()), env_with_key(BAD_KEYS[bad], tmp_path))

    assert out.returncode == 2, out.stderr[-2000:]
    assert "fgpu web: refusing to start: FGPU_SECRET_KEY" in out.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("process", ["manager", "beat"])
def test_the_manager_and_beat_refuse_to_start_without_a_key_of_their_own(process, tmp_path):
    argv = ([str(BIN / "celery"), "-A", "console", "worker", "-Q", "manager", "--pool", "threads"] if process == "manager"
            else [str(BIN / "celery"), "-A", "console", "beat", "--schedule", str(tmp_path / "beat-schedule")])

    out = run_to_exit(argv, env_with_key(None, tmp_path))

    assert out.returncode != 0, out.stderr[-2000:]
    assert f"fgpu {process}: refusing to start: FGPU_SECRET_KEY is not set" in out.stderr


@pytest.mark.e2e
def test_the_web_starts_with_a_key_of_its_own(tmp_path):
    port = free_port()
    proc = Proc("web", web_command(port), env=env_with_key(secrets.token_urlsafe(48), tmp_path), log_dir=tmp_path)
    try:
        wait_until(lambda: "Uvicorn running" in proc.output() or not proc.alive(), timeout=60, what="uvicorn to start")
        assert proc.alive(), proc.output()
    finally:
        proc.stop(timeout=10)


@pytest.mark.e2e
def test_the_agent_starts_without_a_key(tmp_path):
    node = StackNode("nokey", mock_toml=mock_inventory())
    node_dir = tmp_path / "nodes" / node.name  # as tests.stack lays a node out (remove_agent_cgroups)
    node_dir.mkdir(parents=True)
    (node_dir / "mock-accelerator.toml").write_text(node.mock_toml)
    (node_dir / "agent.toml").write_text(node.agent_toml())
    env = env_with_key(None, tmp_path)
    env["DATABASE_URL"] = "postgres://nobody@127.0.0.1:1/none"  # an agent has no database
    proc = Proc("agent", [PYTHON, "manage.py", "agent", "--config", str(node_dir / "agent.toml")], env=env,
                log_dir=tmp_path)
    try:
        # Its embedded Celery worker ready ("agent@nokey ready."): the worker's start, after the agent's,
        # is where a manager's key check once stopped it (compose's agent, issue 37.5).
        wait_until(lambda: "agent@nokey ready" in proc.output() or not proc.alive(), timeout=60,
                   what="the agent's worker to be ready")
        assert proc.alive(), proc.output()
        assert "refusing to start" not in proc.output()
    finally:
        proc.stop(timeout=15)
        remove_agent_cgroups([node.name], tmp_path)  # what a stopped agent leaves, as Stack.close


def standalone_key(tmp_path) -> subprocess.CompletedProcess:
    env = env_with_key(None, tmp_path)
    env["DJANGO_SETTINGS_MODULE"] = "console.settings_standalone"
    script = "from django.conf import settings; print(settings.SECRET_KEY); print(settings.SECRET_KEY_PROBLEM)"
    return run_to_exit([PYTHON, "-c", script], env)


def test_standalone_makes_its_key_once_keeps_it_0600_and_reuses_it(tmp_path):
    first = standalone_key(tmp_path)
    assert first.returncode == 0, first.stderr
    key_file = tmp_path / "data" / "secret_key"
    assert "made this console's secret key, kept in" in first.stderr and str(key_file) in first.stderr
    key, problem = first.stdout.split()
    assert problem == "None" and secret_key_problem(key) is None
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert key_file.read_text().strip() == key

    again = standalone_key(tmp_path)

    assert again.returncode == 0, again.stderr
    assert again.stdout.split()[0] == key
    assert "made" not in again.stderr


def test_standalone_refuses_a_key_file_others_may_read(tmp_path):
    assert standalone_key(tmp_path).returncode == 0
    (tmp_path / "data" / "secret_key").chmod(0o644)

    out = standalone_key(tmp_path)

    assert out.returncode != 0
    assert "must be 0600" in out.stderr
