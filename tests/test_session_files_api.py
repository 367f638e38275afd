"""/api/v1/sessions/<id>/files/…: a session's files through a real Agent listening on the Redis
channel layer (as on a GPU node) in a thread of this process: upload, list, download back
byte-identical, delete; who may; refused paths and the cap, with nothing written outside; the
owner's persistent folder under `data/`."""
from __future__ import annotations

import asyncio
import os

import pytest
from asgiref.sync import async_to_sync
from django.test import override_settings

from protocol.files import CHUNK_BYTES
from protocol.messages import StartSpec
from sessions.serving import files
from sessions.lifecycle import services
from sessions.models import Project
from sessions.scheduling.scheduler import owner_projects, session_start_spec
from tests.conftest import assert_error_shape, client_for, wait_until
from tests.test_agent_runtime import start_spec
from tests.test_api_logs_exec import agent_in_thread

pytestmark = pytest.mark.django_db


class Node:
    def __init__(self, agent, tmp_path):
        self.agent = agent
        self.scratch = tmp_path / "scratch"
        self.data_root = tmp_path / "user-data"
        self.outside = tmp_path / "outside"

    def home(self, session):
        return self.scratch / str(session.pk)


@pytest.fixture
def node(tmp_path):
    """A real Agent for demo-node (persistent folders under tmp/user-data) on its own loop in a
    thread, on the Redis channel layer; `run(session)` starts the session there."""
    agent, manager, loop, thread = agent_in_thread(tmp_path, data_root=tmp_path / "user-data")
    found = Node(agent, tmp_path)
    found.outside.mkdir()
    (found.outside / "secret.txt").write_text("secret")

    def run(session):
        spec = {**start_spec(command="sleep 120"), "session_id": str(session.pk), "owner_id": session.owner_id,
                "projects": owner_projects([session.owner_id]).get(session.owner_id, [])}
        agent.submit_start(StartSpec.decode(spec))
        wait_until(lambda: (str(session.pk), "RUNNING") in manager.reports, timeout=60, what="the agent's RUNNING")

    found.run = run
    yield found
    asyncio.run_coroutine_threadsafe(agent.shutdown(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def url(session, tail: str = "") -> str:
    return f"/api/v1/sessions/{session.pk}/files/{tail}"


def put(api, session, path: str, data: bytes):
    return api.put(url(session, "content/"), data=data, content_type="application/octet-stream",
                   QUERY_STRING=f"path={path}")


def download(api, session, path: str):
    response = api.get(url(session, "content/"), {"path": path})
    if response.status_code != 200:
        return response, None
    async def collect():  # the view streams with an async iterator (daphne serves it as it comes)
        return b"".join([chunk async for chunk in response.streaming_content])

    return response, async_to_sync(collect)()


def test_an_upload_is_seen_by_ls_in_the_session_and_downloads_back_byte_identical(alices_session, alice, staff,
                                                                                   node):
    node.run(alices_session)
    payload = os.urandom(2 * CHUNK_BYTES + 12345)  # three chunks on the way

    for user, name in ((alice, "mine.bin"), (staff, "admins.bin")):
        api = client_for(user)
        response = put(api, alices_session, f"up/{name}", payload)
        assert response.status_code == 201, response.content
        assert response.json()["name"] == name and response.json()["size"] == len(payload)
        seen = services.session_exec(session=alices_session, command=["ls", "-l", "up"], timeout=20)
        assert name in seen["stdout"] and str(len(payload)) in seen["stdout"]
        response, body = download(api, alices_session, f"up/{name}")
        assert body == payload
        assert response["Content-Length"] == str(len(payload))
        assert response["Content-Disposition"] == f'attachment; filename="{name}"'

    listing = client_for(alice).get(url(alices_session), {"path": "up"}).json()
    assert [(e["name"], e["type"], e["size"]) for e in listing["entries"]] == [
        ("admins.bin", "file", len(payload)), ("mine.bin", "file", len(payload))]
    home = client_for(alice).get(url(alices_session)).json()
    assert home["entries"][0] == {**home["entries"][0], "name": "data", "type": "dir", "persistent": True}

    assert client_for(alice).delete(url(alices_session) + "?path=up/mine.bin").status_code == 204
    assert not (node.home(alices_session) / "up" / "mine.bin").exists()
    assert client_for(alice).post(url(alices_session), {"path": "up/new/deeper"}, format="json").status_code == 201
    assert (node.home(alices_session) / "up" / "new" / "deeper").is_dir()
    assert client_for(alice).delete(url(alices_session) + "?path=up").status_code == 204
    assert not (node.home(alices_session) / "up").exists()


def test_the_persistent_folder_is_data_in_the_home_and_kept_per_user(alices_session, alice, node):
    node.run(alices_session)
    api = client_for(alice)

    assert put(api, alices_session, "data/model.pt", b"weights").status_code == 201

    folder = node.data_root / "users" / str(alice.pk)
    assert (folder / "model.pt").read_bytes() == b"weights"
    seen = services.session_exec(session=alices_session, command="cat ~/data/model.pt 2>/dev/null || cat data/model.pt",
                                 timeout=20)
    assert seen["stdout"] == "weights"
    assert api.get(url(alices_session), {"path": "data"}).json()["entries"][0]["name"] == "model.pt"


def test_another_user_gets_404_and_the_anonymous_401_for_every_file_operation(alices_session, bob, node):
    node.run(alices_session)
    (node.home(alices_session) / "private.txt").write_text("alice's")

    for api, code in ((client_for(bob), 404), (client_for(None), 401)):
        assert_error_shape(api.get(url(alices_session)), code)
        assert_error_shape(api.get(url(alices_session, "content/"), {"path": "private.txt"}), code)
        assert_error_shape(put(api, alices_session, "private.txt", b"bob's"), code)
        assert_error_shape(api.delete(url(alices_session) + "?path=private.txt"), code)
    assert (node.home(alices_session) / "private.txt").read_text() == "alice's"


@pytest.mark.parametrize("path, why", [
    ("../outside/x.txt", "'..'"), ("a/../../x.txt", "'..'"), ("/tmp/x.txt", "absolute"),
    ("x%00y.txt", "NUL"), ("x%0Ay.txt", "control"), ("x%1B[31m.txt", "control"),
])
def test_a_refused_path_is_a_400_naming_path_and_nothing_is_written(alices_session, alice, node, path, why):
    node.run(alices_session)
    home = node.home(alices_session)
    before = sorted(p for p in node.scratch.parent.rglob("*"))

    for response in (put(client_for(alice), alices_session, path, b"payload"),
                     client_for(alice).get(url(alices_session, "content/") + f"?path={path}"),
                     client_for(alice).delete(url(alices_session) + f"?path={path}")):
        body = assert_error_shape(response, 400)
        # A NUL is refused in front of every view (common/input_guard.py, issue 33.2), as any parameter's.
        kind = "invalid-parameter" if why == "NUL" else "bad-path"
        assert body["type"] == kind and why in body["detail"] and list(body["field_errors"]) == ["path"], body
    assert sorted(p for p in node.scratch.parent.rglob("*")) == before
    assert home.is_dir()


def test_a_symlink_pointing_out_of_the_home_is_refused_and_what_it_points_at_untouched(alices_session, alice, node):
    node.run(alices_session)
    services.session_exec(session=alices_session, command=f"ln -s {node.outside} escape && "
                                                          f"ln -s {node.outside}/secret.txt secret.txt", timeout=20)
    api = client_for(alice)

    for response in (api.get(url(alices_session), {"path": "escape"}),
                     api.get(url(alices_session, "content/"), {"path": "secret.txt"}),
                     api.get(url(alices_session, "content/"), {"path": "escape/secret.txt"}),
                     put(api, alices_session, "escape/planted.txt", b"x")):
        body = assert_error_shape(response, 400)
        assert body["type"] == "symlink" and "symbolic link" in body["detail"]
    assert sorted(os.listdir(node.outside)) == ["secret.txt"]
    assert (node.outside / "secret.txt").read_text() == "secret"


@override_settings(FGPU_FILES_USER_CAP=100 * 1024)
def test_a_file_over_the_users_cap_is_refused_with_413_and_leaves_nothing(alices_session, alice, node):
    node.run(alices_session)
    api = client_for(alice)

    assert put(api, alices_session, "data/a.bin", b"a" * 60 * 1024).status_code == 201
    body = assert_error_shape(put(api, alices_session, "data/b.bin", b"b" * 60 * 1024), 413)
    assert body["type"] == "over-cap" and "persistent folder" in body["detail"]
    assert assert_error_shape(put(api, alices_session, "c.bin", b"c" * 200 * 1024), 413)["type"] == "over-cap"
    assert sorted(os.listdir(node.data_root / "users" / str(alice.pk))) == ["a.bin"]
    assert not (node.home(alices_session) / "c.bin").exists()


def test_files_of_a_session_that_is_not_running_are_a_409(alices_session, alice):
    services.session_report_apply(session_id=str(alices_session.pk), status="TERMINATED", exit_code=0)

    body = assert_error_shape(client_for(alice).get(url(alices_session)), 409)
    assert body["type"] == "session-not-running"


def test_each_project_of_the_owner_is_mounted_under_projects_and_reached_by_the_api(alices_session, alice, bob, node):
    lab = Project.objects.create(name="lab")
    lab.members.add(alice, bob)
    Project.objects.create(name="elsewhere").members.add(bob)
    assert session_start_spec(alices_session, [])["projects"] == [{"id": str(lab.pk), "name": "lab"}]
    node.run(alices_session)
    api = client_for(alice)

    assert put(api, alices_session, "projects/lab/shared.txt", b"for the lab").status_code == 201

    assert (node.data_root / "projects" / str(lab.pk) / "shared.txt").read_bytes() == b"for the lab"
    seen = services.session_exec(session=alices_session, command="cat ~/projects/lab/shared.txt", timeout=20)
    assert seen["stdout"] == "for the lab"
    listing = api.get(url(alices_session), {"path": "projects"}).json()
    assert [(e["name"], e["persistent"]) for e in listing["entries"]] == [("lab", True)]


def test_files_of_a_session_whose_agent_does_not_answer_are_a_504_naming_the_node(alices_session, alice, monkeypatch):
    monkeypatch.setattr(files, "REPLY_WAIT_S", 0.5)

    body = assert_error_shape(client_for(alice).get(url(alices_session)), 504)

    assert body["type"] == "files-timeout" and "demo-node" in body["detail"]


def test_an_empty_file_uploads_and_downloads_as_empty(alices_session, alice, node):
    node.run(alices_session)

    assert put(client_for(alice), alices_session, "empty.txt", b"").json()["size"] == 0

    assert download(client_for(alice), alices_session, "empty.txt")[1] == b""


def _file_ops(node, monkeypatch) -> list[str]:
    """The ops the agent answers (its handler's `run`, called as it is), in order."""
    seen = []
    answer = node.agent.files.run

    def counted(running, message, **kwargs):
        seen.append(message.get("op"))
        return answer(running, message, **kwargs)

    monkeypatch.setattr(node.agent.files, "run", counted)
    return seen


def test_a_files_bytes_go_over_one_direct_connection_to_the_agent_not_a_layer_message_per_chunk(
        alices_session, alice, node, monkeypatch):
    node.run(alices_session)
    ops = _file_ops(node, monkeypatch)
    payload = os.urandom(8 * CHUNK_BYTES + 7)  # nine chunks through the layer

    assert put(client_for(alice), alices_session, "big.bin", payload).status_code == 201
    assert (node.home(alices_session) / "big.bin").read_bytes() == payload
    assert download(client_for(alice), alices_session, "big.bin")[1] == payload

    assert ops == ["upload_begin", "upload_commit", "read"]  # the bytes went over the agent's listener
    assert node.agent.files.own is not None and node.agent.files.own.serving


def test_where_the_agents_listener_cannot_be_reached_the_bytes_go_through_the_layer(alices_session, alice, node,
                                                                                     monkeypatch):
    from tests.stack import free_port

    node.run(alices_session)
    payload = os.urandom(2 * CHUNK_BYTES + 5)
    assert put(client_for(alice), alices_session, "first.bin", payload).status_code == 201  # starts the listener
    node.agent.files.own.port = free_port()  # its offers now name a port where nothing listens
    ops = _file_ops(node, monkeypatch)

    assert put(client_for(alice), alices_session, "second.bin", payload).status_code == 201
    assert (node.home(alices_session) / "second.bin").read_bytes() == payload
    assert download(client_for(alice), alices_session, "second.bin")[1] == payload

    assert ops == ["upload_begin"] + ["upload_chunk"] * 3 + ["upload_commit"] + ["read"] * 4  # the read asked again
