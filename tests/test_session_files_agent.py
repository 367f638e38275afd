"""The agent's side of a session's files (agent.files): confinement to the home and the owner's
persistent folder, uploads with their cap, listing, reading, deleting. On real files in a
temporary directory; nothing is mocked."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.files import UPLOAD_PREFIX, FileError, FileOps, data_folder, link_data, project_folders
from protocol.files import CHUNK_BYTES, PathRefused, path_parts

CAP = 1024 * 1024


@pytest.fixture
def tree(tmp_path):
    """home/ (a session's), data/ (its owner's persistent folder), outside/ (must stay untouched)."""
    home, data, outside = tmp_path / "home", tmp_path / "users" / "7", tmp_path / "outside"
    for folder in (home, data, outside):
        folder.mkdir(parents=True)
    (outside / "secret.txt").write_text("secret")
    link_data(work_dir=home, folder=data, link=True)
    return home, data, outside


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() and not p.is_symlink() else b"")
            for p in sorted(folder.rglob("*"))}


def upload(ops: FileOps, path: str, data: bytes, *, cap: int = CAP, size: int | None = -1) -> dict:
    up = ops.upload_begin(path, len(data) if size == -1 else size, cap)
    try:
        for offset in range(0, len(data), CHUNK_BYTES):
            ops.upload_chunk(up, offset, data[offset:offset + CHUNK_BYTES])
        result = ops.upload_commit(up)
        ops.upload_close(up, remove=False)
        return result
    except BaseException:
        ops.upload_close(up, remove=True)
        raise


def refused(code: str, fn, *args, **kwargs):
    with pytest.raises(FileError) as caught:
        fn(*args, **kwargs)
    assert caught.value.code == code, caught.value.detail
    return caught.value


@pytest.mark.parametrize("path, why", [
    ("../outside/x", "'..'"), ("a/../../x", "'..'"), ("./a", "'.'"), ("/etc/passwd", "absolute"),
    ("a\x00b", "NUL"), ("a\nb", "control"), ("a\x1b[31mb", "control"), ("a\x7fb", "control"), ("a\x85b", "control"),
    ("\ud800", "surrogate"), ("x" * 256, "longer than 255"),
])
def test_path_parts_refuses_what_could_leave_the_folder_or_confuse_a_terminal(path, why):
    with pytest.raises(PathRefused, match=why):
        path_parts(path)


def test_path_parts_keeps_ordinary_names_and_collapses_empty_parts():
    assert path_parts("") == []
    assert path_parts("a//b/") == ["a", "b"]
    assert path_parts("données/résumé v2.txt") == ["données", "résumé v2.txt"]
    assert path_parts("...") == ["..."]


@pytest.mark.parametrize("path", ["../outside/new.txt", "/tmp/new.txt", "a/../../outside/new.txt", "ne\x00w.txt",
                                  "new\r.txt", "data/../../outside/new.txt"])
def test_an_upload_to_a_refused_path_writes_nothing_anywhere(tree, path):
    home, data, outside = tree
    before = (files_under(home), files_under(data), files_under(outside))
    refused("bad-path", upload, FileOps(home, data), path, b"payload")
    assert (files_under(home), files_under(data), files_under(outside)) == before


def test_a_symlink_pointing_out_is_never_followed(tree):
    home, data, outside = tree
    os.symlink(outside, home / "escape")
    os.symlink(outside / "secret.txt", home / "secret-link")
    os.symlink(outside, data / "escape")
    ops = FileOps(home, data)
    refused("symlink", ops.list, "escape")
    refused("symlink", ops.list, "data/escape")
    refused("symlink", upload, ops, "escape/new.txt", b"x")
    refused("symlink", upload, ops, "data/escape/new.txt", b"x")
    refused("symlink", ops.read, "secret-link", 0, 100)
    refused("symlink", ops.read, "escape/secret.txt", 0, 100)
    refused("symlink", ops.mkdir, "escape/sub")
    refused("symlink", ops.delete, "escape/secret.txt")
    assert files_under(outside) == {"secret.txt": b"secret"}
    # a link is listed as a link, and deleting it removes the link, not what it points at
    assert {"name": "secret-link", "type": "link"}.items() <= {
        e["name"]: e for e in ops.list("")["entries"]}["secret-link"].items()
    ops.delete("secret-link")
    ops.delete("escape")
    assert not (home / "escape").exists() and not os.path.lexists(home / "secret-link")
    assert files_under(outside) == {"secret.txt": b"secret"}


def test_an_upload_over_the_link_itself_replaces_the_link_not_its_target(tree):
    home, data, outside = tree
    os.symlink(outside / "secret.txt", home / "notes.txt")
    upload(FileOps(home, data), "notes.txt", b"mine")
    assert (home / "notes.txt").read_bytes() == b"mine" and not (home / "notes.txt").is_symlink()
    assert (outside / "secret.txt").read_text() == "secret"


def test_a_replaced_data_link_in_the_home_does_not_redirect_the_persistent_folder(tree):
    """The session owns its home and may point `data` elsewhere; the file API still resolves
    `data/…` from the folder the agent knows (the owner's id), never from the link."""
    home, data, outside = tree
    (home / "data").unlink()
    os.symlink(outside, home / "data")
    ops = FileOps(home, data)
    upload(ops, "data/kept.txt", b"kept")
    assert (data / "kept.txt").read_bytes() == b"kept"
    assert files_under(outside) == {"secret.txt": b"secret"}
    refused("symlink", FileOps(home, None).list, "data")  # without a folder, `data` is the home's own entry


def test_a_file_over_the_cap_is_refused_before_and_while_it_is_written(tree):
    home, data, outside = tree
    ops = FileOps(home, data)
    upload(ops, "data/a.bin", b"a" * 600, cap=1000)
    error = refused("over-cap", upload, ops, "data/b.bin", b"b" * 500, cap=1000)
    assert "400 left" in error.detail
    refused("over-cap", upload, ops, "data/c.bin", b"c" * 500, cap=1000, size=None)  # size unknown: at the chunk
    refused("over-cap", upload, ops, "data/d.bin", b"d" * 50, cap=1000, size=10)  # more than it declared
    assert sorted(os.listdir(data)) == ["a.bin"]  # no temporary file left behind
    upload(ops, "data/e.bin", b"e" * 400, cap=1000)  # what fits still does
    upload(ops, "big.bin", b"h" * 900, cap=1000)  # the home has a cap of its own; data/ does not count in it


def test_upload_list_read_delete_round_trip_in_home_and_persistent_folder(tree):
    home, data, _ = tree
    ops = FileOps(home, data)
    payload = os.urandom(3 * CHUNK_BYTES + 17)
    assert upload(ops, "sub/dir/blob.bin", payload)["entry"]["size"] == len(payload)
    assert (home / "sub" / "dir" / "blob.bin").read_bytes() == payload
    got, offset = b"", 0
    while True:
        chunk = ops.read("sub/dir/blob.bin", offset, CHUNK_BYTES)
        got += chunk["data"]
        offset += len(chunk["data"])
        if chunk["eof"]:
            break
    assert got == payload
    listing = ops.list("")
    assert [e["name"] for e in listing["entries"]][:2] == ["data", "sub"]
    assert listing["entries"][0]["persistent"] is True
    upload(ops, "data/model.pt", b"weights")
    assert ops.list("data")["entries"] == [{"name": "model.pt", "type": "file", "size": 7,
                                            "mtime": ops.list("data")["entries"][0]["mtime"]}]
    assert ops.list("data")["path"] == "data"
    ops.delete("sub")
    assert not (home / "sub").exists()
    refused("not-found", ops.read, "sub/dir/blob.bin", 0, 10)
    refused("bad-path", ops.delete, "data")  # the persistent folder itself stays
    refused("bad-path", ops.delete, "")


def test_fifos_devices_and_folders_are_not_read_and_the_agents_own_files_are_read_only(tree):
    home, data, _ = tree
    os.mkfifo(home / "pipe")
    (home / ".fgpu").mkdir()
    (home / ".fgpu" / "allocation.json").write_text("{}")
    ops = FileOps(home, data)
    refused("not-a-file", ops.read, "pipe", 0, 10)
    refused("is-a-directory", ops.read, ".fgpu", 0, 10)
    assert ops.read(".fgpu/allocation.json", 0, 10)["data"] == b"{}"
    refused("read-only", ops.delete, ".fgpu/allocation.json")
    refused("read-only", upload, ops, ".fgpu/bin/nvidia-smi", b"#!/bin/sh\n")
    refused("bad-path", upload, ops, UPLOAD_PREFIX + "x", b"x")
    assert (home / ".fgpu" / "allocation.json").read_text() == "{}"


def test_each_user_gets_a_folder_of_their_own_shown_in_the_home(tmp_path):
    assert data_folder(tmp_path, 7) == tmp_path / "users" / "7"
    assert data_folder(None, 7) is None and data_folder(tmp_path, None) is None and data_folder(tmp_path, "x") is None
    home = tmp_path / "s1"
    home.mkdir()
    link_data(work_dir=home, folder=data_folder(tmp_path, 7), link=True)
    assert (home / "data").resolve() == (tmp_path / "users" / "7").resolve()
    assert oct((tmp_path / "users" / "7").stat().st_mode & 0o777) == "0o700"
    docker_home = tmp_path / "s2"
    docker_home.mkdir()
    link_data(work_dir=docker_home, folder=data_folder(tmp_path, 7), link=False)
    assert (docker_home / "data").is_dir() and not (docker_home / "data").is_symlink()


def test_each_project_of_the_owner_is_a_folder_of_its_own_under_projects(tmp_path):
    projects = project_folders(tmp_path / "roots", [{"id": "0b5e", "name": "lab"}, {"id": "77aa", "name": "../x"},
                                                    {"id": "../../etc", "name": "evil"}])
    assert projects == {"lab": tmp_path / "roots" / "projects" / "0b5e"}  # bad names and ids are left out
    home = tmp_path / "home"
    home.mkdir()
    link_data(work_dir=home, folder=None, link=True, projects=projects)
    assert (home / "projects" / "lab").resolve() == projects["lab"].resolve()
    ops = FileOps(home, None, projects)
    upload(ops, "projects/lab/shared.txt", b"for the lab")
    assert (projects["lab"] / "shared.txt").read_bytes() == b"for the lab"
    assert [e["name"] for e in ops.list("projects")["entries"]] == ["lab"]
    assert ops.list("projects/lab")["path"] == "projects/lab"
    refused("bad-path", ops.delete, "projects/lab")  # the folder itself stays
    error = refused("over-cap", upload, ops, "projects/lab/big.bin", b"b" * 100, cap=50)
    assert "project lab's folder" in error.detail


def test_agent_toml_names_the_persistent_folders_root_relative_to_itself(tmp_path):
    from agent.config import load_agent_config
    from tests.conftest import ROOT

    (tmp_path / "mock-accelerator.toml").write_text((ROOT / "demo" / "mock-accelerator.toml").read_text())
    (tmp_path / "agent.toml").write_text('[agent]\nid = "n1"\n[container]\ndata-root = "shared/fgpu-data"\n')
    assert load_agent_config(tmp_path / "agent.toml").data_root == tmp_path / "shared" / "fgpu-data"
    (tmp_path / "agent.toml").write_text('[agent]\nid = "n1"\n')
    assert load_agent_config(tmp_path / "agent.toml").data_root == tmp_path / "user-data"


def test_a_transfer_offered_in_process_is_taken_once_on_its_own_loop_only_and_not_after_its_time(monkeypatch):
    import asyncio

    from protocol import files as proto

    async def offer(token):
        proto.offer_local(token, f"transfer {token}")

    async def take(token):
        return proto.take_local(token)

    first, second = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        first.run_until_complete(offer("a"))
        assert second.run_until_complete(take("a")) is None  # another loop (an agent in another thread): not here
        assert first.run_until_complete(take("a")) == "transfer a"
        assert first.run_until_complete(take("a")) is None  # once
        assert first.run_until_complete(take(None)) is None
        first.run_until_complete(offer("b"))
        later = first.time() + proto.LOCAL_TTL_S + 1
        monkeypatch.setattr(first, "time", lambda: later)
        assert first.run_until_complete(take("b")) is None  # expired
    finally:
        first.close()
        second.close()
