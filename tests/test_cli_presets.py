"""`fgpu launch --preset` and `fgpu presets` against the real console (pytest-django's live
server: the real URLconf, token auth, services and PostgreSQL), the CLI run in-process as a user
runs it. The flag-to-body mapping alone is checked in tests/test_cli.py's style at the end."""
from __future__ import annotations

import json

import pytest

from accounts.services import login_token_issue
from fgpu_cli import main as cli
from fgpu_cli.launch import UsageError, build_body
from sessions.models import ComputeSession, ResourcePreset
from sessions.admission.presets import preset_save

GiB = 1 << 30


@pytest.fixture
def fgpu(live_server, demo_cluster, alice, monkeypatch, tmp_path):
    """`fgpu(*args)` runs the CLI as alice against the live console and returns its exit status
    (its output: capsys)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("FGPU_URL", live_server.url)
    monkeypatch.setenv("FGPU_TOKEN", login_token_issue(user=alice))

    def run(*args) -> int:
        return cli.main(list(args))

    return run


@pytest.fixture
def small(demo_cluster):
    return preset_save(preset=ResourcePreset(name="Small notebook", description="a quarter GPU",
                                             resources={"cuda.shares": "0.25"}, cpu=2, mem=8 * GiB))


def test_launch_preset_creates_a_session_with_exactly_the_presets_request(fgpu, small, alice, capsys):
    assert fgpu("launch", "--preset", "Small notebook", "--name", "nb") == 0
    printed = capsys.readouterr().out.strip()
    session = ComputeSession.objects.get(owner=alice, name="nb")
    assert printed == str(session.pk)
    assert session.resources == {"cuda.shares": "0.25", "cpu": 2, "mem": 8 * GiB}


def test_launch_preset_with_flags_merges_them_into_the_presets_request(fgpu, small, alice, capsys):
    assert fgpu("launch", "--preset", str(small.pk), "--cpu", "4", "--gpu", "0.5", "--name", "big") == 0
    assert ComputeSession.objects.get(name="big").resources == {"gpu_fraction": "0.5", "cpu": 4, "mem": 8 * GiB}


def test_an_unknown_preset_exits_1_naming_the_ones_you_may_use(fgpu, small, capsys):
    assert fgpu("launch", "--preset", "Huge") == 1
    err = capsys.readouterr().err
    assert "no preset 'Huge' you may use (yours: Small notebook)" in err
    assert not ComputeSession.objects.exists()


def test_dry_run_with_a_preset_previews_it(fgpu, small, capsys):
    assert fgpu("launch", "--preset", "Small notebook", "--dry-run") == 0
    out = capsys.readouterr().out
    assert "Small notebook" in out and "the preset's" in out
    assert "0.25 fGPU · 2 cores · 8 GiB" in out
    assert not ComputeSession.objects.exists()


def test_presets_lists_the_presets_as_a_table_or_json(fgpu, small, capsys):
    assert fgpu("presets") == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["PRESET", "REQUEST", "GROUP", "IMAGE", "DESCRIPTION"]
    assert "Small notebook" in out and "0.25 fGPU · 2 cores · 8 GiB" in out and "a quarter GPU" in out
    assert fgpu("presets", "-o", "json") == 0
    [shown] = json.loads(capsys.readouterr().out)
    assert shown["request"] == {"cuda.shares": "0.25", "cpu": 2, "mem": 8 * GiB}


def test_preset_flag_bodies():
    assert build_body(preset="Small notebook") == {"preset": "Small notebook"}
    assert build_body(preset="x", cpu=4, name="n") == {"preset": "x", "resources": {"cpu": 4}, "name": "n"}
    with pytest.raises(UsageError, match="--preset"):
        build_body(preset="  ")
