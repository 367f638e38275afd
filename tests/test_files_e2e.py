"""A session's files on the distributed stack (uvicorn, a Celery manager worker and an agent
process on the demo mock node; tests/stack.py), with the installed `fgpu` as a subprocess:
`fgpu cp` into a session and back out byte-identical, refusals, and the user's persistent
folder (`~/data`, the agent's `[container] data-root`) that outlives a session and is mounted
into the next one."""
from __future__ import annotations

import os

import pytest

from tests import test_e2e_distributed as distributed
from tests.test_cli_e2e import fgpu  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

cluster = distributed.cluster  # the stack and user alice (password alice-pass-123)


def ok(out):
    assert out.returncode == 0, out.stderr
    return out


def test_fgpu_cp_in_and_out_and_the_persistent_folder_outlives_the_session(cluster, fgpu, tmp_path):
    base, _ = cluster
    ok(fgpu("login", base, "--username", "alice", "--password-stdin", input="alice-pass-123\n"))
    ok(fgpu("launch", "--name", "first", "--fgpu", "0.5", "--wait", "--timeout", "90"))
    payload = os.urandom(600 * 1024 + 7)  # three 256 KiB chunks to the agent
    (tmp_path / "payload.bin").write_bytes(payload)

    out = ok(fgpu("cp", "payload.bin", "first:"))
    assert f"copied {len(payload)} bytes to first:payload.bin" in out.stderr
    assert f" {len(payload)} " in ok(fgpu("exec", "first", "--", "ls -l payload.bin")).stdout
    ok(fgpu("cp", "payload.bin", "first:~/data/"))
    ok(fgpu("cp", "first:payload.bin", "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == payload
    (tmp_path / "out").mkdir()
    ok(fgpu("cp", "first:data/payload.bin", "out"))
    assert (tmp_path / "out" / "payload.bin").read_bytes() == payload

    out = fgpu("cp", "payload.bin", "first:../escape.bin")
    assert out.returncode == 1 and "'..' is refused" in out.stderr, out.stderr
    out = fgpu("cp", "first:/etc/passwd", "passwd")
    assert out.returncode == 1 and "absolute paths are refused" in out.stderr, out.stderr
    assert not (tmp_path / "passwd").exists()
    out = fgpu("cp", "first:missing.bin", "missing.bin")
    assert out.returncode == 1 and "'missing.bin' does not exist" in out.stderr, out.stderr
    assert not (tmp_path / "missing.bin").exists() and not list(tmp_path.glob(".fgpu-cp-*"))
    out = fgpu("cp", "payload.bin", "back.bin")
    assert out.returncode == 2 and "one SESSION:PATH" in out.stderr

    ok(fgpu("rm", "first"))
    ok(fgpu("launch", "--name", "second", "--fgpu", "0.5", "--wait", "--timeout", "90"))
    listing = ok(fgpu("exec", "second", "--", "ls -l ~/data/ && ls")).stdout
    assert "payload.bin" in listing.split("\n", 2)[1], listing  # in data/, not in the new home
    ok(fgpu("cp", "second:data/payload.bin", "again.bin"))
    assert (tmp_path / "again.bin").read_bytes() == payload
    ok(fgpu("rm", "second"))
