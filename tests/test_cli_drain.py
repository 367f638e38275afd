"""`fgpu nodes drain NAME [--evict] [--reason TEXT]`, `fgpu nodes undrain NAME` and `fgpu nodes`'
DRAIN column against the real console (pytest-django's live server: the real URLconf, token auth,
services and PostgreSQL), the CLI run in-process as a user runs it (issue 37.4)."""
from __future__ import annotations

import json

import pytest

from accounts.services import login_token_issue
from accelerators.models import Node
from fgpu_cli import main as cli
from sessions.admission.launch import session_create
from sessions.scheduling.scheduler import schedule_pending
from tests.conftest import make_running


@pytest.fixture
def fgpu(live_server, demo_cluster, monkeypatch, tmp_path):
    """`fgpu(user, *args)` runs the CLI as `user` against the live console and returns its exit
    status (its output: capsys)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("FGPU_URL", live_server.url)

    def run(user, *args) -> int:
        monkeypatch.setenv("FGPU_TOKEN", login_token_issue(user=user))
        return cli.main(list(args))

    return run


def test_an_administrator_drains_and_undrains_a_node_and_fgpu_nodes_shows_it(fgpu, staff, alice, capsys):
    job = session_create(owner=alice, name="job", resources={"cuda.shares": "0.5"})
    schedule_pending()
    make_running(job)

    assert fgpu(staff, "nodes", "drain", "demo-node", "--reason", "driver upgrade") == 0
    assert capsys.readouterr().out == "demo-node: draining: 1 session left; reason: driver upgrade\n"
    assert fgpu(staff, "nodes", "drain", "demo-node", "--evict") == 0  # again: its state, eviction now on
    out = capsys.readouterr().out
    assert out.startswith("demo-node: draining: 1 session left; evicting: ") and "driver upgrade" in out, out
    node = Node.objects.get(name="demo-node")
    assert node.drain_evict and node.drain_reason == "driver upgrade" and node.drain_by == "root"

    assert fgpu(alice, "nodes") == 0
    header, row = capsys.readouterr().out.splitlines()[:2]
    assert header.split()[-1] == "DRAIN" and row.endswith("draining: 1 session left"), (header, row)

    assert fgpu(staff, "-o", "json", "nodes", "undrain", "demo-node") == 0
    assert json.loads(capsys.readouterr().out)["state"] == "in service"
    assert fgpu(alice, "nodes") == 0
    assert capsys.readouterr().out.splitlines()[1].endswith(" -")
    assert Node.objects.get(name="demo-node").drain_since is None


def test_a_user_may_not_drain_and_an_unknown_node_is_named(fgpu, staff, alice, capsys):
    assert fgpu(alice, "nodes", "drain", "demo-node") == 1
    assert capsys.readouterr().err.startswith("fgpu: error: ")
    assert Node.objects.get(name="demo-node").drain_since is None

    assert fgpu(staff, "nodes", "undrain", "nowhere") == 1
    assert capsys.readouterr().err == "fgpu: error: no node 'nowhere'\n"
