"""Data folders on two nodes over one shared storage (issue 37.3), on the distributed stack (uvicorn,
a Celery manager worker, two agent processes; tests/stack.py): both agents' agent.toml put
`data-root` on one temporary directory standing for an NFS mount and say `[storage] shared = true`.
What one node's session writes into ~/data (from inside, and through its files API) the other
node's session reads through its own files API, and neither session is told its folders are local."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.conftest import StackNode, wait_until
from tests.stack import mock_inventory

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

REDIS_DB = 10  # a database of its own (FGPU_TEST_STACK_REDIS_DB overrides it), flushed first


def call(base: str, token: str, method: str, path: str, body: dict | bytes | None = None) -> tuple[int, bytes]:
    """One request; JSON bodies as dicts, file contents as bytes. Returns (status, raw answer)."""
    headers = {"Authorization": f"Token {token}"} if token else {}
    data = None
    if isinstance(body, dict):
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    elif isinstance(body, bytes):
        data, headers["Content-Type"] = body, "application/octet-stream"
    request = urllib.request.Request(base + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=40) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def answer(base: str, token: str, method: str, path: str, body: dict | bytes | None = None) -> tuple[int, dict]:
    status, raw = call(base, token, method, path, body)
    return status, json.loads(raw or b"null")


def test_a_file_one_nodes_session_writes_is_read_through_the_other_nodes_files_api(
    distributed_stack, django_user_model, tmp_path
):
    nfs = tmp_path / "nfs"  # the shared mount both "hosts" hold at the same path
    nfs.mkdir()
    shared = f'data-root = "{nfs}"\n[storage]\nshared = true'
    stack = distributed_stack(
        nodes=[StackNode(f"nfs-{x}", mock_inventory(gpus=1), container=shared) for x in "ab"], redis_db=REDIS_DB
    )
    from accelerators.models import Node

    assert dict(Node.objects.values_list("name", "shared_storage")) == {"nfs-a": True, "nfs-b": True}
    alice = django_user_model.objects.create_user("alice", password="alice-pass-123")
    status, body = answer(stack.base, "", "POST", "/api/v1/auth/token/", {"username": "alice", "password": "alice-pass-123"})
    assert status == 200, body
    token, ids = body["token"], []
    whole = {"cuda.shares": "2", "cpu": 1, "mem": "1G"}
    for name in ("writer", "reader"):  # a whole GPU each: one on each node
        status, created = answer(stack.base, token, "POST", "/api/v1/sessions/", {"name": name, "resources": whole})
        assert status == 201, created
        ids.append(created["id"])
    wait_until(
        lambda: all(answer(stack.base, token, "GET", f"/api/v1/sessions/{i}/")[1]["status"] == "RUNNING" for i in ids),
        timeout=90,
        what="both sessions RUNNING",
    )
    shown = [answer(stack.base, token, "GET", f"/api/v1/sessions/{i}/")[1] for i in ids]
    assert {s["node"] for s in shown} == {"nfs-a", "nfs-b"}
    assert [s["data_folders_note"] for s in shown] == ["", ""]
    writer, reader = ids

    status, ran = answer(
        stack.base, token, "POST", f"/api/v1/sessions/{writer}/exec/", {"command": "echo from-inside > data/inside.txt"}
    )
    assert (status, ran.get("exit_code")) == (200, 0), ran
    payload = b"written through the writer's files API\n" * 1000
    status, made = answer(stack.base, token, "PUT", f"/api/v1/sessions/{writer}/files/content/?path=data/api.bin", payload)
    assert status == 201, made

    status, listing = answer(stack.base, token, "GET", f"/api/v1/sessions/{reader}/files/?path=data")
    assert status == 200, listing
    assert {e["name"] for e in listing["entries"]} >= {"inside.txt", "api.bin"}
    assert call(stack.base, token, "GET", f"/api/v1/sessions/{reader}/files/content/?path=data/inside.txt") == (
        200,
        b"from-inside\n",
    )
    assert call(stack.base, token, "GET", f"/api/v1/sessions/{reader}/files/content/?path=data/api.bin") == (200, payload)
    assert (nfs / "users" / str(alice.pk) / "api.bin").read_bytes() == payload  # on the one shared directory

    # And back: the reader's node writes, the writer's reads.
    status, made = answer(stack.base, token, "PUT", f"/api/v1/sessions/{reader}/files/content/?path=data/back.txt", b"back\n")
    assert status == 201, made
    assert call(stack.base, token, "GET", f"/api/v1/sessions/{writer}/files/content/?path=data/back.txt") == (200, b"back\n")
    for session_id in ids:
        assert answer(stack.base, token, "DELETE", f"/api/v1/sessions/{session_id}/")[0] == 202
