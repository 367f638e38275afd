"""A session's files with the docker runtime: a real Agent with DockerRuntime (the test image,
network none) and a persistent folder root. The owner's folder is bind-mounted at
/home/work/data (a project's at /home/work/projects/<name>) and belongs to the container's
user; what the file API writes into the home and into data/ is read and changed inside the
container, and what the container writes into ~/data is on the node's folder."""
from __future__ import annotations

import pytest

from protocol import files as proto
from tests.conftest import GiB
from tests.test_agent_runtime import Harness, start_spec
from tests.test_docker_runtime import docker_client, run_docker, test_image  # noqa: F401 (fixtures)

pytestmark = pytest.mark.docker

OWNER = 7


async def ask(h: Harness, session_id: str, op: str, **fields) -> dict:
    reply = await h.layer.new_channel("files-reply.")
    await h.to_pty(session_id, {"type": proto.FILES, "op": op, "owner_id": OWNER, "reply_channel": reply, **fields})
    answer = await h.receive_type(reply, proto.RESULT)
    assert answer["ok"], answer
    return answer


async def put(h: Harness, session_id: str, path: str, data: bytes) -> None:
    upload = (await ask(h, session_id, "upload_begin", path=path, size=len(data), cap=GiB))["upload_id"]
    await ask(h, session_id, "upload_chunk", upload_id=upload, offset=0, data=data)
    await ask(h, session_id, "upload_commit", upload_id=upload)


async def run_in(h: Harness, session_id: str, command: str) -> dict:
    reply = await h.layer.new_channel("exec-reply.")
    await h.to_pty(session_id, {"type": "pty.exec", "argv": command, "timeout": 30, "reply_channel": reply})
    return await h.receive_type(reply, "exec.result", timeout=60)


def test_the_persistent_folder_is_mounted_at_data_and_files_written_either_side_are_seen_on_the_other(
        tmp_path, docker_client, test_image):  # noqa: F811
    folder = tmp_path / "user-data" / "users" / str(OWNER)

    async def scenario(h: Harness):
        h.agent.data_root = tmp_path / "user-data"  # agent.toml's [container] data-root
        session_id = await h.start_session({**start_spec(), "owner_id": OWNER,
                                            "projects": [{"id": "5e1f", "name": "lab"}]})
        await put(h, session_id, "hello.txt", b"hello from the panel")
        await put(h, session_id, "data/kept.txt", b"kept")
        seen = await run_in(h, session_id, "id -u; cat ~/hello.txt; echo; cat ~/data/kept.txt; echo; "
                                           "echo mine > ~/data/made-inside.txt && rm ~/hello.txt && echo removed && "
                                           "echo team > ~/projects/lab/t.txt")
        listing = await ask(h, session_id, "list", path="data")
        return seen, [e["name"] for e in listing["entries"]]

    seen, names = run_docker(tmp_path, docker_client, test_image, scenario)
    assert seen["exit_code"] == 0, seen
    assert seen["stdout"].split("\n") == ["1000", "hello from the panel", "kept", "removed", ""]
    assert names == ["kept.txt", "made-inside.txt"]
    assert (folder / "made-inside.txt").read_text() == "mine\n"
    assert (tmp_path / "user-data" / "projects" / "5e1f" / "t.txt").read_text() == "team\n"  # ~/projects/lab
