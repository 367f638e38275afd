"""Shared data folders (issue 36.5): who may share what with whom (sessions.policy.shares), what a
recipient's sessions mount (the start spec's `shared`, version-compatible), the API
(/api/v1/shares/), and the file API's and the node's refusal of writes to a read-only share:
through a real Agent on the Redis channel layer (tests.test_session_files_api's) whose process runtime runs the session in
bubblewrap, where a read-only share is a read-only bind mount."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from protocol.messages import SharedFolderRef, StartSpec
from sessions.admission import launch as admission
from sessions.lifecycle import services
from sessions.lifecycle.start_spec import session_start_message
from sessions.models import FolderShare, Project
from sessions.policy import shares
from sessions.scheduling.scheduler import owner_projects, schedule_pending
from tests.conftest import assert_error_shape, client_for, make_running, wait_until
from tests.test_agent_runtime import start_spec
from tests import test_cli_drain, test_session_files_api

pytestmark = pytest.mark.django_db
node = test_session_files_api.node  # the fixture: a real Agent with data folders under tmp/user-data


@pytest.fixture
def team(alice, bob, django_user_model):
    """Project "team" with carol as its only member."""
    carol = django_user_model.objects.create_user("carol")
    project = Project.objects.create(name="team")
    project.members.add(carol)
    return project, carol


# --- the rules ---------------------------------------------------------------------------------


def test_a_user_shares_their_data_read_only_and_the_recipient_mounts_it_read_only(alice, bob):
    share = shares.folder_share_set(actor=alice, folder="data", user="bob", permission="ro")

    assert share.share_name == "alice-data"
    assert shares.shared_mounts(user_id=bob.pk) == [
        shares.SharedMount(name="alice-data", kind="user", id=str(alice.pk), read_only=True)
    ]
    assert shares.shared_mounts(user_id=alice.pk) == []  # the owner has it as ~/data, not again


def test_sharing_again_changes_the_permission_and_keeps_one_share(alice, bob):
    first = shares.folder_share_set(actor=alice, folder="data", user="bob", permission="ro")
    again = shares.folder_share_set(actor=alice, folder="data", user="bob", permission="rw")

    assert first.pk == again.pk and FolderShare.objects.count() == 1
    assert shares.shared_mounts(user_id=bob.pk)[0].read_only is False


def test_a_share_with_a_project_reaches_its_members_and_any_rw_share_makes_it_writable(alice, bob, team):
    project, carol = team
    shares.folder_share_set(actor=alice, folder="data", project="team", permission="ro")
    assert shares.shared_mounts(user_id=carol.pk)[0].read_only is True
    assert shares.shared_mounts(user_id=bob.pk) == []  # not a member

    shares.folder_share_set(actor=alice, folder="data", user="carol", permission="rw")
    assert [(m.name, m.read_only) for m in shares.shared_mounts(user_id=carol.pk)] == [("alice-data", False)]


def test_only_administrators_share_a_projects_folder_and_members_do_not_get_it_twice(alice, staff, team):
    project, carol = team
    with pytest.raises(shares.ApplicationError) as refused:
        shares.folder_share_set(actor=carol, folder="projects/team", user="alice")
    assert refused.value.status == 403
    with pytest.raises(shares.ApplicationError) as hidden:  # not a member: the project is not named to them
        shares.folder_share_set(actor=alice, folder="projects/team", user="carol")
    assert hidden.value.status == 404

    shares.folder_share_set(actor=staff, folder="projects/team", user="alice", permission="rw")
    shares.folder_share_set(actor=staff, folder="projects/team", user="carol")  # a member: has it at ~/projects/team

    assert shares.shared_mounts(user_id=alice.pk) == [
        shares.SharedMount(name="team-project", kind="project", id=str(project.pk), read_only=False)
    ]
    assert shares.shared_mounts(user_id=carol.pk) == []


def test_a_scheduler_flush_reads_everyones_shares_at_once_as_each_alone(alice, bob, team, staff, django_assert_num_queries):
    project, carol = team
    shares.folder_share_set(actor=alice, folder="data", project="team", permission="ro")
    shares.folder_share_set(actor=alice, folder="data", user="bob", permission="rw")
    shares.folder_share_set(actor=staff, folder="projects/team", user="alice")
    users = [alice.pk, bob.pk, carol.pk, staff.pk]
    alone = {user_id: shares.shared_mounts(user_id=user_id) for user_id in users}

    with django_assert_num_queries(2):
        assert shares.shared_mounts_by_user(users) == alone
    with django_assert_num_queries(2):  # the flush's own read of everyone's projects, then the shares
        assert shares.shared_mounts_by_user(users, projects=owner_projects(users)) == alone
    assert [m.name for m in alone[carol.pk]] == ["alice-data"] and alone[staff.pk] == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"folder": "data", "user": "nobody"}, "user"),
        ({"folder": "data", "user": "alice"}, "user"),  # the owner
        ({"folder": "data", "user": "bob", "project": "team"}, "user"),
        ({"folder": "data"}, "user"),
        ({"folder": "data", "project": "nope"}, "project"),
        ({"folder": "data", "user": "bob", "permission": "x"}, "permission"),
        ({"folder": "../etc", "user": "bob"}, "folder"),
    ],
)
def test_a_share_that_names_nothing_sensible_is_refused_with_400(alice, bob, team, kwargs, field):
    with pytest.raises(shares.ApplicationError) as refused:
        shares.folder_share_set(actor=alice, **kwargs)
    assert refused.value.status == 400 and field in refused.value.field_errors
    assert not FolderShare.objects.exists()


def test_the_owner_revokes_the_recipient_leaves_and_nobody_else_sees_the_share(alice, bob, team, staff):
    project, carol = team
    to_bob = shares.folder_share_set(actor=alice, folder="data", user="bob")
    to_team = shares.folder_share_set(actor=alice, folder="data", project="team")

    for actor, share, status in ((carol, to_bob, 404), (carol, to_team, 403), (bob, to_team, 404)):
        with pytest.raises(shares.ApplicationError) as refused:
            shares.folder_share_revoke(actor=actor, share_id=share.pk)
        assert refused.value.status == status
    shares.folder_share_revoke(actor=bob, share_id=to_bob.pk)  # leaves it
    shares.folder_share_revoke(actor=alice, share_id=to_team.pk)
    assert not FolderShare.objects.exists()
    with pytest.raises(shares.ApplicationError):
        shares.folder_share_revoke(actor=staff, share_id="not-a-uuid")


def test_the_path_check_refuses_unknown_shared_folders_and_writes_to_read_only_ones_and_passes_the_rest():
    mounts = {"alice-data": {"read_only": True}, "team-project": {"read_only": False}}
    for parts, status in ((["shared", "alice-data", "x"], 403), (["shared", "nope", "x"], 404), (["shared"], 404),
                          (["shared", "team-project"], 403)):  # fmt: skip
        with pytest.raises(shares.ApplicationError) as refused:
            shares.shared_path_check(mounts=mounts, path_parts=parts, write=True)
        assert refused.value.status == status, parts
    shares.shared_path_check(mounts=mounts, path_parts=["shared", "team-project", "x"], write=True)
    shares.shared_path_check(mounts=mounts, path_parts=["data", "x"], write=True)
    shares.shared_path_check(mounts=mounts, path_parts=["shared", "alice-data", "x"], write=False)
    shares.shared_path_check(mounts=mounts, path_parts=["shared"], write=False)
    with pytest.raises(shares.ApplicationError):
        shares.shared_path_check(mounts=mounts, path_parts=["shared", "nope"], write=False)


# --- the start spec ----------------------------------------------------------------------------


def test_the_start_spec_names_the_shared_folders_and_an_older_spec_has_none(alice, bob, demo_cluster):
    shares.folder_share_set(actor=alice, folder="data", user="bob")
    session = admission.session_create(owner=bob, name="bobs", resources={"cuda.shares": "0.5"})
    schedule_pending()
    session.refresh_from_db()

    spec = session_start_message(session, list(session.allocations.select_related("device")))
    assert spec.shared == (SharedFolderRef(name="alice-data", kind="user", id=str(alice.pk), read_only=True),)
    encoded = spec.encode()
    assert StartSpec.decode(encoded) == spec
    older = {k: v for k, v in encoded.items() if k != "shared"}
    assert StartSpec.decode(older).shared == ()
    assert "shared" not in dataclasses.replace(spec, shared=()).encode()  # none: the spec an older agent knew


# --- the API -----------------------------------------------------------------------------------


def test_the_api_shares_lists_and_revokes(alice, bob, staff):
    api = client_for(alice)
    made = api.post("/api/v1/shares/", {"folder": "data", "user": "bob", "permission": "ro"}, format="json")
    assert made.status_code == 201, made.content
    body = made.json()
    assert body | {"id": body["id"], "created_at": body["created_at"]} == {
        **body, "folder": "data", "name": "alice-data", "owner": "alice", "project": None, "user": "bob",
        "to_project": None, "permission": "ro", "managed": True, "received": False,
    }  # fmt: skip

    seen = client_for(bob).get("/api/v1/shares/").json()
    assert [(s["name"], s["received"], s["managed"]) for s in seen["shares"]] == [("alice-data", True, False)]
    assert seen["folders"] == ["data"]

    assert_error_shape(client_for(bob).post("/api/v1/shares/", {"folder": "data", "user": "bob"}, format="json"), 400)
    assert_error_shape(api.post("/api/v1/shares/", {"folder": "projects/x", "user": "bob"}, format="json"), 404)
    assert_error_shape(client_for(None).get("/api/v1/shares/"), 401)
    seen = client_for(staff).get("/api/v1/shares/").json()  # an administrator manages every share
    assert [(s["name"], s["received"], s["managed"]) for s in seen["shares"]] == [("alice-data", False, True)]
    assert client_for(bob).delete(f"/api/v1/shares/{body['id']}/").status_code == 204
    assert_error_shape(api.delete(f"/api/v1/shares/{body['id']}/"), 404)


# --- the file API and the node -----------------------------------------------------------------


def run(node, session) -> None:
    """Start `session` on `node` (tests.test_session_files_api's agent) as the scheduler would, with
    its owner's projects and the folders shared with them."""
    spec = {
        **start_spec(command="sleep 120"),
        "session_id": str(session.pk),
        "owner_id": session.owner_id,
        "projects": owner_projects([session.owner_id]).get(session.owner_id, []),
        "shared": [m.encode() for m in shares.shared_mounts(user_id=session.owner_id)],
    }
    node.agent.submit_start(StartSpec.decode(spec))
    wait_until(lambda: (str(session.pk), "RUNNING") in node.agent.manager.reports, timeout=60, what="the agent's RUNNING")


def files_url(session) -> str:
    return f"/api/v1/sessions/{session.pk}/files/"


def test_a_read_only_share_is_read_but_not_written_through_the_api_nor_from_inside_the_session(
    alice, bob, demo_cluster, node, tmp_path
):
    owners = tmp_path / "user-data" / "users" / str(alice.pk)
    owners.mkdir(parents=True)
    (owners / "notes.txt").write_text("alice's notes")
    shares.folder_share_set(actor=alice, folder="data", user="bob", permission="ro")
    session = admission.session_create(owner=bob, name="bobs", resources={"cuda.shares": "0.5"})
    schedule_pending()
    session = make_running(session)
    run(node, session)
    api = client_for(bob)

    listing = api.get(files_url(session), {"path": "shared"}).json()
    assert [(e["name"], e["read_only"]) for e in listing["entries"]] == [("alice-data", True)]
    content = api.get(files_url(session) + "content/", {"path": "shared/alice-data/notes.txt"})
    assert content.status_code == 200
    refused = api.put(files_url(session) + "content/", data=b"x", content_type="application/octet-stream",
                      QUERY_STRING="path=shared/alice-data/mine.txt")  # fmt: skip
    assert assert_error_shape(refused, 403)["type"] == "read-only"
    assert_error_shape(api.delete(files_url(session) + "?path=shared/alice-data/notes.txt"), 403)
    assert_error_shape(api.post(files_url(session), {"path": "shared/alice-data/d"}, format="json"), 403)
    assert_error_shape(api.post(files_url(session), {"path": "shared/bobs-own/d"}, format="json"), 404)

    seen = services.session_exec(session=session, command="cat ~/shared/alice-data/notes.txt", timeout=30)
    assert seen["stdout"] == "alice's notes"
    written = services.session_exec(
        session=session, command="echo x > ~/shared/alice-data/mine.txt; rm -f ~/shared/alice-data/notes.txt", timeout=30
    )
    assert "Read-only file system" in written["stdout"] + written.get("stderr", ""), written
    remounted = services.session_exec(  # the mount's read-only flag is locked: neither here nor in a new user namespace
        session=session,
        command='d=$(readlink -f ~/shared/alice-data); mount -o remount,bind,rw "$d"; '
        "unshare -rm sh -c \"mount -o remount,bind,rw '$d' && touch '$d/mine.txt'\"; echo done",
        timeout=30,
    )
    assert remounted["stdout"].rstrip().endswith("done") and "permission denied" in remounted["stderr"], remounted
    assert sorted(p.name for p in owners.iterdir()) == ["notes.txt"]

    # revoked: gone from the file API at once, whatever the running session mounted
    shares.folder_share_revoke(actor=alice, share_id=FolderShare.objects.get().pk)
    assert api.get(files_url(session), {"path": "shared"}).json()["entries"] == []
    assert_error_shape(api.get(files_url(session) + "content/", {"path": "shared/alice-data/notes.txt"}), 404)


def test_a_read_write_share_is_written_from_inside_the_session(alice, bob, demo_cluster, node, tmp_path):
    shares.folder_share_set(actor=alice, folder="data", user="bob", permission="rw")
    session = admission.session_create(owner=bob, name="bobs", resources={"cuda.shares": "0.5"})
    schedule_pending()
    session = make_running(session)
    run(node, session)

    services.session_exec(session=session, command="echo from-bob > ~/shared/alice-data/bob.txt", timeout=30)
    assert (tmp_path / "user-data" / "users" / str(alice.pk) / "bob.txt").read_text() == "from-bob\n"
    made = client_for(bob).post(files_url(session), {"path": "shared/alice-data/d"}, format="json")
    assert made.status_code == 201, made.content


# --- fgpu shares ---------------------------------------------------------------------------------

fgpu = test_cli_drain.fgpu  # the fixture: the CLI in-process against pytest-django's live server


@pytest.mark.django_db(transaction=True)
def test_fgpu_shares_adds_lists_and_removes_a_share(fgpu, alice, bob, capsys):
    assert fgpu(alice, "shares", "add", "data", "--user", "bob") == 0
    said = capsys.readouterr().out
    assert "data/ shared read-only with bob: they see it at ~/shared/alice-data" in said
    assert fgpu(bob, "shares") == 0
    listed = capsys.readouterr().out
    assert "data/ of alice" in listed and "read-only" in listed and "~/shared/alice-data" in listed
    share_id = str(FolderShare.objects.get().pk)
    assert fgpu(bob, "shares", "rm", share_id) == 0  # bob leaves it
    assert fgpu(alice, "shares", "rm", share_id) == 1
    assert "no share" in capsys.readouterr().err
    assert fgpu(alice, "shares", "add", "data") == 2  # neither --user nor --project


def test_a_read_write_share_counts_against_its_folders_limit_in_the_recipients_sessions_and_a_read_only_one_does_not(
    tmp_path,
):
    import dataclasses as dc
    from types import SimpleNamespace

    from agent.limits import SessionLimits
    from agent.storage import StorageWatch

    owners = tmp_path / "user-data" / "users" / "7"
    owners.mkdir(parents=True)
    (owners / "big").write_bytes(b"x" * 300_000)
    limits = dc.replace(SessionLimits(), user_data_storage=100_000)

    def session(read_only: bool):
        home = tmp_path / ("ro" if read_only else "rw")
        home.mkdir()
        return SimpleNamespace(work_dir=home, process=None, data_dir=None, project_dirs={},
                               shared_dirs={"ann-data": (owners, read_only)})  # fmt: skip

    watch = StorageWatch(SimpleNamespace(sessions={"ro": session(True), "rw": session(False)}), limits=limits)
    over = watch.measure_all()
    assert [sid for sid, _ in over] == ["rw"]  # blocks allocated vary by file system: the words, not the figure
    assert over[0][1].endswith("of its 97.7 KiB storage limit (~/shared/ann-data)"), over


def test_the_docker_runtime_mounts_a_read_only_share_as_a_read_only_volume(tmp_path):
    """The container's configuration as Docker gets it (a stand-in client: no container is made)."""
    from agent.docker_runtime import HOME, DockerRuntime

    from types import SimpleNamespace

    runtime = DockerRuntime(node="n1", default_image="img", network="none", client=SimpleNamespace(ping=lambda: True))
    from agent.mounts import Folders
    from tests.test_agent_runtime import typed_spec

    folders = Folders(shared_dirs={"ann-data": (Path("/d/users/7"), True), "team-project": (Path("/d/projects/p"), False)})
    config = runtime.container_config(spec=typed_spec(), folders=folders, argv=["sh"], env={}, work_dir=tmp_path)
    mounts = {m["Target"]: m for m in config["mounts"]}

    assert mounts[f"{HOME}/shared/ann-data"]["Source"] == "/d/users/7" and mounts[f"{HOME}/shared/ann-data"]["ReadOnly"]
    assert not mounts[f"{HOME}/shared/team-project"].get("ReadOnly")
