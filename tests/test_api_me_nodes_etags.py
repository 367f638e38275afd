"""GET /api/v1/me/, administrators' writes of a node's sharing settings (ETag-guarded like
the other settings endpoints), and weak ETags with 304 on list responses."""
from __future__ import annotations

from decimal import Decimal

import pytest

from accelerators.models import Node, ResourceGroup
from sessions.lifecycle import services
from sessions.admission import launch as admission
from sessions.models import ComputeSession, Project, Quota, SessionStatus
from tests.conftest import assert_error_shape, client_for

pytestmark = pytest.mark.django_db

NODE = "/api/v1/nodes/demo-node/"


# --- who am I ------------------------------------------------------------------------------------

def test_me_answers_a_users_name_role_projects_sessions_and_quota_headroom(demo_cluster, alice):
    Project.objects.create(name="vision").members.add(alice)
    Quota.objects.create(user=alice, max_fgpu=Decimal("1.5"), max_sessions=3)
    admission.session_create(owner=alice, name="s", resources={"cuda.shares": "0.5"})

    body = client_for(alice).get("/api/v1/me/").json()

    assert body == {"username": "alice", "is_admin": False, "projects": ["vision"], "live_sessions": 1,
                    "quota_headroom": {"fgpu": "1.00", "devices": None, "gpu_memory": None, "sessions": 2}}


def test_me_says_an_administrator_is_one_and_the_anonymous_get_a_401(staff):
    assert client_for(staff).get("/api/v1/me/").json()["is_admin"] is True
    assert_error_shape(client_for(None).get("/api/v1/me/"), 401)


# --- node sharing settings ------------------------------------------------------------------------

def test_an_administrator_changes_a_nodes_sharing_settings_with_the_etag_from_a_get(demo_cluster, staff):
    api = client_for(staff)
    ResourceGroup.objects.create(name="training")
    tag = api.get(NODE)["ETag"]

    response = api.patch(NODE, {"device_split_count": 4, "memory_scaling": "1.5", "resource_group": "training"},
                         format="json", HTTP_IF_MATCH=tag)

    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["device_split_count"], body["memory_scaling"], body["resource_group"], body["oversubscribed"]) == \
        (4, "1.50", "training", True)
    assert body["devices"][0]["device_id"]  # the whole node comes back
    assert response["ETag"] != tag
    node = Node.objects.get(name="demo-node")
    assert (node.device_split_count, node.memory_scaling, node.resource_group.name) == (4, Decimal("1.5"), "training")


def test_a_heartbeat_does_not_make_a_nodes_etag_stale(demo_cluster, staff):
    from accelerators.services import node_heartbeat

    api = client_for(staff)
    tag = api.get(NODE)["ETag"]
    node_heartbeat(node_name="demo-node")

    assert api.get(NODE)["ETag"] == tag
    assert api.patch(NODE, {"core_scaling": "2"}, format="json", HTTP_IF_MATCH=tag).status_code == 200


def test_a_node_write_without_if_match_is_428_and_with_a_stale_one_412(demo_cluster, staff):
    api = client_for(staff)
    tag = api.get(NODE)["ETag"]
    assert api.patch(NODE, {"device_split_count": 5}, format="json", HTTP_IF_MATCH=tag).status_code == 200

    assert assert_error_shape(api.patch(NODE, {"device_split_count": 6}, format="json"), 428)["type"] == \
        "precondition-required"
    assert assert_error_shape(api.patch(NODE, {"device_split_count": 6}, format="json", HTTP_IF_MATCH=tag), 412)[
        "type"] == "precondition-failed"
    assert Node.objects.get(name="demo-node").device_split_count == 5


@pytest.mark.parametrize("body, field", [
    ({"device_split_count": 0}, "device_split_count"),
    ({"memory_scaling": "0.05"}, "memory_scaling"),
    ({"core_scaling": "abc"}, "core_scaling"),
    ({"resource_group": "no-such-pool"}, "resource_group"),
])
def test_a_bad_node_setting_is_a_400_naming_it(demo_cluster, staff, body, field):
    response = client_for(staff).patch(NODE, body, format="json", HTTP_IF_MATCH="*")

    assert list(assert_error_shape(response, 400)["field_errors"]) == [field]


def test_only_the_sharing_settings_of_a_node_can_be_written(demo_cluster, staff):
    response = client_for(staff).patch(NODE, {"name": "renamed", "cpu_count": 999}, format="json", HTTP_IF_MATCH="*")

    assert response.status_code == 200
    node = Node.objects.get(pk=Node.objects.get(name="demo-node").pk)
    assert (node.name, node.cpu_count) == ("demo-node", 8)


@pytest.mark.parametrize("who, status", [("anonymous", 401), ("user", 403)])
def test_the_anonymous_and_users_cannot_change_a_node(demo_cluster, alice, who, status):
    client = client_for(alice if who == "user" else None)

    for method in ("put", "patch"):
        assert_error_shape(getattr(client, method)(NODE, {"device_split_count": 1}, format="json",
                                                   HTTP_IF_MATCH="*"), status)
    assert Node.objects.get(name="demo-node").device_split_count == 10


def test_raising_a_split_count_starts_a_session_that_waited_for_it(demo_cluster, alice, staff,
                                                                   django_capture_on_commit_callbacks):
    Node.objects.filter(name="demo-node").update(device_split_count=1)
    with django_capture_on_commit_callbacks(execute=True):
        first = admission.session_create(owner=alice, name="a", resources={"cuda.shares": "0.5"})
    with django_capture_on_commit_callbacks(execute=True):
        second = admission.session_create(owner=alice, name="b", resources={"cuda.shares": "0.5"})
    assert ComputeSession.objects.get(pk=second.pk).status == SessionStatus.PENDING

    with django_capture_on_commit_callbacks(execute=True):
        response = client_for(staff).patch(NODE, {"device_split_count": 2}, format="json", HTTP_IF_MATCH="*")

    assert response.status_code == 200
    assert ComputeSession.objects.get(pk=first.pk).status == SessionStatus.SCHEDULED
    assert ComputeSession.objects.get(pk=second.pk).status == SessionStatus.SCHEDULED


# --- ETags on lists --------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/api/v1/sessions/", "/api/v1/nodes/", "/api/v1/devices/", "/api/v1/slot-formats/",
                                  "/api/v1/fractional-settings/", "/api/v1/resource-groups/", "/api/v1/projects/",
                                  "/api/v1/quotas/"])
def test_a_list_answers_a_weak_etag_and_304_without_a_body_while_it_is_unchanged(demo_cluster, alice, path):
    api = client_for(alice)
    first = api.get(path)
    tag = first["ETag"]

    again = api.get(path, HTTP_IF_NONE_MATCH=tag)

    assert tag.startswith('W/"')
    assert (again.status_code, again.content, again["ETag"]) == (304, b"", tag)
    assert api.get(path, HTTP_IF_NONE_MATCH='W/"something-else"').status_code == 200


def test_a_lists_etag_changes_with_its_content(demo_cluster, alice):
    api = client_for(alice)
    tag = api.get("/api/v1/sessions/")["ETag"]
    admission.session_create(owner=alice, name="new", resources={"cuda.shares": "0.5"})

    response = api.get("/api/v1/sessions/", HTTP_IF_NONE_MATCH=tag)

    assert response.status_code == 200 and response["ETag"] != tag
    assert [s["name"] for s in response.json()["results"]] == ["new"]
