"""Data folders on every node (issue 37.3): a node states where its data-root is (agent.toml
`[storage] shared`), its agent reports it at registration (protocol.messages.NodeStorage) and the
manager keeps it on the node (Node.shared_storage). Sessions, which all get ~/data and their
projects' folders, go only to nodes with shared storage where their scope has some and more than
one node (accelerators.allocation.core.storage_scope); one placed on a node without it, in a
cluster of several, is told so in the launch preview, the API and on its page
(sessions.policy.data_folders). In process; the two agents over one shared data-root are
tests/test_e2e_distributed.py's."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from django.test import Client

from accelerators.allocation import core
from accelerators.models import Node
from agent.boot import load_inventory
from agent.config import AgentConfigError, load_agent_config
from protocol.messages import Malformed, NodeStorage
from sessions.admission.launch import launch_preview, session_create
from sessions.models import ComputeSession, SessionStatus
from sessions.scheduling.scheduler import schedule_pending
from tests.conftest import assert_error_shape, client_for, make_running
from tests.seed import make_cluster, mock_gpu

WHOLE = {"cuda.shares": "2", "mem": "64M"}  # one 8 GiB GPU: 2 fGPU


def state(name: str, shared: bool) -> core.NodeState:
    return core.NodeState(node_id=name, cpu_total=8, mem_total=1 << 30, shared_storage=shared)


# --- the rule, pure ---------------------------------------------------------------------------


def test_a_scope_with_shared_storage_keeps_only_its_shared_nodes_in_order():
    nodes = [state("a", False), state("b", True), state("c", False), state("d", True)]
    assert [n.node_id for n in core.storage_scope(nodes)] == ["b", "d"]


def test_a_scope_without_shared_storage_or_of_one_node_keeps_every_node():
    assert [n.node_id for n in core.storage_scope([state("a", False), state("b", False)])] == ["a", "b"]
    assert [n.node_id for n in core.storage_scope([state("a", False)])] == ["a"]
    assert [n.node_id for n in core.storage_scope([state("a", True)])] == ["a"]
    assert core.storage_scope([]) == []


# --- agent.toml and the registration ------------------------------------------------------------


def write_agent(tmp_path, storage: str):
    shutil.copy(Path(__file__).resolve().parent.parent / "demo" / "mock-accelerator.toml", tmp_path)
    path = tmp_path / "agent.toml"
    path.write_text(f'[agent]\nid = "n1"\n{storage}')
    return path


def test_agent_toml_states_shared_storage_and_the_inventory_carries_it(tmp_path):
    assert load_agent_config(write_agent(tmp_path, "")).storage_shared is False  # default: the node's own disk
    config = load_agent_config(write_agent(tmp_path, "[storage]\nshared = true\n"))
    assert config.storage_shared is True
    assert load_inventory(config)["storage"] == {"shared": True}


@pytest.mark.parametrize(
    ("storage", "key"),
    [('[storage]\nshared = "yes"\n', "storage.shared"), ("[storage]\nshraed = true\n", "storage.shraed")],
)
def test_a_bad_storage_table_is_refused_naming_its_key(tmp_path, storage, key):
    with pytest.raises(AgentConfigError, match=f"agent.toml: {key}: "):
        load_agent_config(write_agent(tmp_path, storage))


def test_node_storage_travels_and_an_older_agents_none_reads_as_local():
    assert NodeStorage.decode(NodeStorage(shared=True).encode()) == NodeStorage(shared=True)
    assert NodeStorage.decode(None) == NodeStorage(shared=False)
    with pytest.raises(Malformed):
        NodeStorage.decode({"shared": "yes"})


@pytest.mark.django_db
def test_the_manager_keeps_what_the_registration_states(django_capture_on_commit_callbacks):
    from sessions.tasks import agent_register

    make_cluster(nodes={})
    inventory = {"devices": [mock_gpu(0).as_dict()], "plugins": [], "attributes": {}}
    with django_capture_on_commit_callbacks(execute=True):
        agent_register(node="nfs-1", inventory={**inventory, "storage": {"shared": True}}, running=[])
        agent_register(node="old-1", inventory=inventory, running=[])  # an agent from before [storage]
        agent_register(node="odd-1", inventory={**inventory, "storage": "nfs"}, running=[])  # malformed: local
    assert dict(Node.objects.values_list("name", "shared_storage")) == {"nfs-1": True, "old-1": False, "odd-1": False}


# --- placement, the preview, the API and the page -----------------------------------------------


def fresh(session) -> ComputeSession:
    return ComputeSession.objects.get(pk=session.pk)


@pytest.fixture
def mixed(db):
    """n1 with shared storage, n2 with its own disk; one 8 GiB GPU (2 fGPU) each."""
    nodes = make_cluster(nodes={"n1": [mock_gpu(0)], "n2": [mock_gpu(0, node=1)]})
    Node.objects.filter(name="n1").update(shared_storage=True)
    return nodes


@pytest.fixture
def local_only(db):
    """n1 and n2, both with their own disks; one 8 GiB GPU (2 fGPU) each."""
    return make_cluster(nodes={"n1": [mock_gpu(0)], "n2": [mock_gpu(0, node=1)]})


def test_sessions_go_only_to_the_node_with_shared_storage_and_wait_for_it(mixed, alice):
    preview = launch_preview(resources=WHOLE, owner=alice)
    assert (preview["node"], preview["storage_note"]) == ("n1", ""), preview
    first = session_create(owner=alice, name="first", resources=WHOLE)
    schedule_pending()
    assert fresh(first).node.name == "n1"

    preview = launch_preview(resources=WHOLE, owner=alice)  # n1 is full; n2 is free but local
    assert preview["outcome"] == "waits" and preview["node"] is None, preview
    second = session_create(owner=alice, name="second", resources=WHOLE)
    schedule_pending()
    assert fresh(second).status == SessionStatus.PENDING, fresh(second).status_reason
    assert fresh(second).status_reason.startswith("waiting for capacity"), fresh(second).status_reason


def test_a_resource_group_of_local_nodes_alone_still_takes_sessions(mixed, alice):
    from accelerators.models import ResourceGroup

    group = ResourceGroup.objects.create(name="scratch")
    Node.objects.filter(name="n2").update(resource_group=group)
    preview = launch_preview(resources={**WHOLE, "resource_group": "scratch"}, owner=alice)
    assert preview["node"] == "n2", preview
    assert "local to node n2" in preview["storage_note"], preview


def test_without_shared_storage_a_session_is_told_its_folders_are_local_to_its_node(local_only, alice):
    preview = launch_preview(resources=WHOLE, owner=alice)
    assert preview["node"] == "n1", preview
    assert preview["storage_note"] == (
        "~/data and the project folders are local to node n1 (its own disk, no shared storage): a session on "
        "another node sees other folders, and their files are reached only while n1 is up"
    )
    session = session_create(owner=alice, name="job", resources=WHOLE, command="sleep 1000")
    schedule_pending()
    session = make_running(session)

    shown = client_for(alice).get(f"/api/v1/sessions/{session.pk}/").json()
    assert shown["data_folders_note"] == preview["storage_note"].replace("n1", session.node.name)
    browser = Client()
    browser.force_login(alice)
    page = browser.get(f"/sessions/{session.pk}/terminal/")
    assert page.status_code == 200
    assert b'id="session-folders"' in page.content and b"local to node " + session.node.name.encode() in page.content


def test_a_cluster_of_one_node_or_a_shared_node_says_nothing(db, alice):
    make_cluster(nodes={"solo": [mock_gpu(0)]})
    preview = launch_preview(resources=WHOLE, owner=alice)
    assert (preview["node"], preview["storage_note"]) == ("solo", "")
    session = session_create(owner=alice, name="job", resources=WHOLE, command="sleep 1000")
    schedule_pending()
    session = make_running(session)
    assert client_for(alice).get(f"/api/v1/sessions/{session.pk}/").json()["data_folders_note"] == ""


@pytest.mark.parametrize(
    ("shared", "said"),
    [(False, "local to that node (no shared storage)"), (True, "on the shared storage and come back with any session")],
)
def test_files_of_a_session_on_a_down_node_answer_503_at_once_saying_where_its_folders_are(db, alice, shared, said):
    make_cluster(nodes={"n1": [mock_gpu(0)], "n2": [mock_gpu(0, node=1)]})
    Node.objects.update(shared_storage=shared)
    session = session_create(owner=alice, name="job", resources=WHOLE, command="sleep 1000")
    schedule_pending()
    session = make_running(session)
    Node.objects.filter(pk=session.node_id).update(status="LOST")  # what node_mark_lost does past the heartbeat timeout

    body = assert_error_shape(client_for(alice).get(f"/api/v1/sessions/{session.pk}/files/", {"path": "data"}), 503)

    assert body["type"] == "node-down", body
    assert f"node {session.node.name} is down" in body["detail"] and said in body["detail"], body


def test_the_nodes_api_says_which_nodes_have_shared_storage(mixed, alice):
    nodes = client_for(alice).get("/api/v1/nodes/").json()
    rows = nodes["results"] if isinstance(nodes, dict) else nodes
    assert {n["name"]: n["shared_storage"] for n in rows} == {"n1": True, "n2": False}


@pytest.mark.parametrize("shared", ["mig-a", "mig-b"])
def test_mig_sessions_follow_the_same_rule(db, alice, shared):
    from accelerators.models import MigMode
    from tests.seed import GiB

    h100 = {"memory": 80 * GiB, "sms": 132, "model": "H100-80GB"}
    make_cluster(nodes={"mig-a": [mock_gpu(0, node=0, **h100)], "mig-b": [mock_gpu(0, node=1, **h100)]})
    Node.objects.update(mig_mode=MigMode.DYNAMIC)
    Node.objects.filter(name=shared).update(shared_storage=True)
    mig = {"mig_profile": "1g.10gb", "mem": "64M"}

    preview = launch_preview(resources=mig, owner=alice)
    assert (preview["node"], preview["mig"] is not None, preview["storage_note"]) == (shared, True, ""), preview
    session = session_create(owner=alice, name="mig", resources=mig)
    schedule_pending()
    assert fresh(session).node.name == shared


def test_the_kept_cluster_view_sees_a_nodes_storage_change_from_the_change_log(local_only):
    from accelerators.cluster_view import cluster_view
    from accelerators.selectors import node_states

    assert [n.shared_storage for n in node_states(slot_name="cuda")] == [False, False]  # the kept view (PostgreSQL)
    reads = cluster_view().reads
    Node.objects.filter(name="n2").update(shared_storage=True)  # as n2's agent registers again with [storage] shared

    assert [(n.node_id, n.shared_storage) for n in node_states(slot_name="cuda")] == [("n1", False), ("n2", True)]
    assert cluster_view().reads == reads  # the trigger logged it: no full read again
    assert [n.shared_storage for n in node_states(slot_name="cuda", kept=False)] == [False, True]  # the database's read
