"""The inventory, configuration and quota endpoints of `/api/v1/`: who may read and write each
(anonymous 401, user read-only 403 on writes, admin everything), ETag / If-Match on
administrators' edits (428 without, 412 stale, 200 fresh), filters, and the caller's quota."""
from __future__ import annotations

import dataclasses
from decimal import Decimal

import pytest
from rest_framework.test import APIClient

from accelerators.models import FractionalSettings, ResourceGroup, SlotFormat
from sessions.models import ComputeSession, Project, Quota, SessionImage
from tests.conftest import GiB, assert_error_shape, client_for, make_cluster, mock_gpu

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(demo_cluster, alice, bob, staff):
    """The demo cluster, a project "vision" with alice, quotas for alice, bob and the project,
    a resource group "training"."""
    vision = Project.objects.create(name="vision")
    vision.members.add(alice)
    Quota.objects.create(user=alice, max_fgpu=Decimal("1.5"), max_sessions=3)
    Quota.objects.create(user=bob, max_sessions=1)
    Quota.objects.create(project=vision, max_fgpu=Decimal("4"))
    ResourceGroup.objects.create(name="training", policy="spread")
    return {"vision": vision}


def launch(client, resources=None, capture=None, **body):
    if capture is None:
        return client.post("/api/v1/sessions/", {"resources": resources or {"cuda.shares": "0.5"}, **body},
                           format="json")
    with capture(execute=True):
        return client.post("/api/v1/sessions/", {"resources": resources or {"cuda.shares": "0.5"}, **body},
                           format="json")


# One entry per admin-written endpoint: its list URL, one object's URL, a body that creates a
# new object, a full body for PUT and a PATCH body.
WRITABLE = {
    "slot-formats": dict(
        item="/api/v1/slot-formats/cuda.shares/",
        create={"slot_name": "rocm", "subtype": "shares", "display_unit": "fGPU",
                "number_format": {"binary": False, "round_length": 2}},
        put={"slot_name": "cuda", "subtype": "shares", "display_icon": "gpu2", "display_unit": "vGPU",
             "human_readable_name": "vGPU", "description": "", "number_format": {"binary": False, "round_length": 1}},
        patch={"display_unit": "vGPU"},
    ),
    "fractional-settings": dict(
        item="/api/v1/fractional-settings/cuda/",
        create={"slot_name": "rocm", "allocation_mode": "fractional", "unit_mem": 4 * GiB, "unit_proc": 30,
                "quantum_size": "0.5"},
        put={"slot_name": "cuda", "allocation_mode": "fractional", "unit_mem": 2 * GiB, "unit_proc": 20,
             "quantum_size": "0.25"},
        patch={"quantum_size": "0.500"},
    ),
    "resource-groups": dict(
        item="/api/v1/resource-groups/training/",
        create={"name": "inference", "policy": "binpack"},
        put={"name": "training", "description": "long jobs", "policy": "binpack", "weight_memory": "1.00",
             "weight_cores": "2.00", "weight_sessions": "1.00", "no_fragmentation": True},
        patch={"policy": "binpack"},
    ),
    "projects": dict(
        item=None,  # the vision project's UUID, filled in by item_url
        create={"name": "nlp", "members": ["bob"]},
        put={"name": "vision", "description": "computer vision", "members": ["alice", "bob"]},
        patch={"description": "computer vision"},
    ),
    "quotas": dict(
        item=None,  # alice's quota's UUID
        create={"user": "root", "max_sessions": 10},
        put={"user": "alice", "max_fgpu": "2.000", "max_devices": 1, "max_gpu_memory": None, "max_sessions": 5},
        patch={"max_sessions": 4},
    ),
    "images": dict(
        item=None,  # the fgpu-session:test image's UUID
        create={"reference": "nvcr.io/nvidia/pytorch:24.05-py3", "accelerators": ["cuda"]},
        put={"reference": "fgpu-session:test", "display_name": "Debian minimal", "description": "", "accelerators": [],
             "shell": "/bin/bash", "labels": {"os": "debian"}, "is_default": False},
        patch={"description": "bash, python3 and procps"},
    ),
}


def item_url(name: str, world) -> str:
    if name == "projects":
        return f"/api/v1/projects/{world['vision'].pk}/"
    if name == "quotas":
        return f"/api/v1/quotas/{Quota.objects.get(user__username='alice').pk}/"
    if name == "images":
        return f"/api/v1/images/{SessionImage.objects.get_or_create(reference='fgpu-session:test')[0].pk}/"
    return WRITABLE[name]["item"]


def etag_of(client, url) -> str:
    response = client.get(url)
    assert response.status_code == 200, response.content
    return response["ETag"]


# --- permission matrix ------------------------------------------------------------------------

READ_ONLY_LISTS = ["/api/v1/devices/", "/api/v1/quota/"]


@pytest.mark.parametrize("path", [*(f"/api/v1/{name}/" for name in WRITABLE), *READ_ONLY_LISTS])
def test_anonymous_reads_get_401_in_the_error_shape(world, path):
    body = assert_error_shape(APIClient().get(path), 401)
    assert body["title"] == "Not authenticated"


@pytest.mark.parametrize("name", WRITABLE)
def test_anonymous_writes_get_401(world, name):
    url = item_url(name, world)
    client = APIClient()

    assert_error_shape(client.post(f"/api/v1/{name}/", WRITABLE[name]["create"], format="json"), 401)
    assert_error_shape(client.put(url, WRITABLE[name]["put"], format="json", HTTP_IF_MATCH="*"), 401)
    assert_error_shape(client.patch(url, WRITABLE[name]["patch"], format="json", HTTP_IF_MATCH="*"), 401)
    assert_error_shape(client.delete(url), 401)


@pytest.mark.parametrize("name", WRITABLE)
def test_a_user_reads_but_every_write_is_403_even_with_a_fresh_etag(world, alice, name):
    url = item_url(name, world)
    client = client_for(alice)
    assert client.get(f"/api/v1/{name}/").status_code == 200
    tag = etag_of(client, url)
    before = client.get(url).json()

    assert_error_shape(client.post(f"/api/v1/{name}/", WRITABLE[name]["create"], format="json"), 403)
    assert_error_shape(client.put(url, WRITABLE[name]["put"], format="json", HTTP_IF_MATCH=tag), 403)
    assert_error_shape(client.patch(url, WRITABLE[name]["patch"], format="json", HTTP_IF_MATCH=tag), 403)
    assert_error_shape(client.delete(url, HTTP_IF_MATCH=tag), 403)

    assert client.get(url).json() == before
    assert etag_of(client, url) == tag


@pytest.mark.parametrize("name", WRITABLE)
def test_an_admin_creates_replaces_patches_and_deletes(world, staff, name):
    client = client_for(staff)
    url = item_url(name, world)

    created = client.post(f"/api/v1/{name}/", WRITABLE[name]["create"], format="json")
    assert created.status_code == 201, created.content
    assert created["ETag"]

    replaced = client.put(url, WRITABLE[name]["put"], format="json", HTTP_IF_MATCH=etag_of(client, url))
    assert replaced.status_code == 200, replaced.content
    assert replaced["ETag"] == etag_of(client, url)

    patched = client.patch(url, WRITABLE[name]["patch"], format="json", HTTP_IF_MATCH=replaced["ETag"])
    assert patched.status_code == 200, patched.content
    for key, value in WRITABLE[name]["patch"].items():
        assert patched.json()[key] == value

    if name == "fractional-settings":  # sessions depend on them: not deletable through the API
        assert_error_shape(client.delete(url), 405)
        return
    assert client.delete(url).status_code == 204
    assert_error_shape(client.get(url), 404)


def test_devices_are_read_only_for_everyone_and_nodes_cannot_be_deleted_here(world, alice, staff):
    for client in (client_for(alice), client_for(staff)):
        device_id = client.get("/api/v1/devices/").json()["results"][0]["id"]
        assert client.get(f"/api/v1/devices/{device_id}/").status_code == 200
        assert_error_shape(client.post("/api/v1/devices/", {}, format="json"), 405)
        assert_error_shape(client.delete(f"/api/v1/devices/{device_id}/"), 405)
    # Nodes: administrators change sharing settings (tests/test_api_me_nodes_etags.py), never delete.
    assert_error_shape(client_for(staff).delete("/api/v1/nodes/demo-node/"), 405)
    assert_error_shape(client_for(alice).delete("/api/v1/nodes/demo-node/"), 403)


def test_an_unknown_api_path_is_a_404_in_the_error_shape(world, alice):
    assert_error_shape(client_for(alice).get("/api/v1/no-such-thing/"), 404)
    assert_error_shape(client_for(alice).get("/api/v1/slot-formats/cuda.nothing/"), 404)


# --- ETag / If-Match ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", WRITABLE)
@pytest.mark.parametrize("method", ["put", "patch"])
def test_a_write_without_if_match_is_428_and_changes_nothing(world, staff, name, method):
    client = client_for(staff)
    url = item_url(name, world)
    tag = etag_of(client, url)

    response = getattr(client, method)(url, WRITABLE[name][method], format="json")

    body = assert_error_shape(response, 428)
    assert body["type"] == "precondition-required"
    assert "If-Match" in body["field_errors"]
    assert etag_of(client, url) == tag


@pytest.mark.parametrize("name", WRITABLE)
@pytest.mark.parametrize("method", ["put", "patch"])
def test_a_write_with_a_stale_etag_is_412_and_keeps_the_other_admins_change(world, staff, django_user_model, name,
                                                                             method):
    first, second = client_for(staff), client_for(django_user_model.objects.create_user("ops", is_staff=True))
    url = item_url(name, world)
    read_by_both = etag_of(first, url)
    assert etag_of(second, url) == read_by_both

    won = first.patch(url, WRITABLE[name]["patch"], format="json", HTTP_IF_MATCH=read_by_both)
    assert won.status_code == 200, won.content
    assert won["ETag"] != read_by_both

    lost = getattr(second, method)(url, WRITABLE[name][method], format="json", HTTP_IF_MATCH=read_by_both)

    body = assert_error_shape(lost, 412)
    assert body["type"] == "precondition-failed"
    assert second.get(url).json() == won.json()


def test_a_fresh_etag_applies_the_change_and_answers_the_new_etag(world, staff):
    client = client_for(staff)
    tag = etag_of(client, "/api/v1/fractional-settings/cuda/")

    response = client.patch("/api/v1/fractional-settings/cuda/", {"quantum_size": "0.5"}, format="json",
                            HTTP_IF_MATCH=tag)

    assert response.status_code == 200, response.content
    assert response.json()["quantum_size"] == "0.500"
    assert FractionalSettings.objects.get(slot_name="cuda").quantum_size == Decimal("0.5")
    assert response["ETag"] != tag
    assert response["ETag"] == etag_of(client, "/api/v1/fractional-settings/cuda/")


def test_if_match_may_list_several_tags_or_a_star(world, staff):
    client = client_for(staff)
    url = "/api/v1/slot-formats/cuda.shares/"
    tag = etag_of(client, url)

    listed = client.patch(url, {"display_unit": "A"}, format="json", HTTP_IF_MATCH=f'"0000", {tag}')
    star = client.patch(url, {"display_unit": "B"}, format="json", HTTP_IF_MATCH="*")

    assert listed.status_code == 200, listed.content
    assert star.status_code == 200, star.content
    assert SlotFormat.objects.get(slot_name="cuda", subtype="shares").display_unit == "B"


def test_a_weak_etag_does_not_match(world, staff):
    client = client_for(staff)
    tag = etag_of(client, "/api/v1/slot-formats/cuda.shares/")

    response = client.patch("/api/v1/slot-formats/cuda.shares/", {"display_unit": "X"}, format="json",
                            HTTP_IF_MATCH=f"W/{tag}")

    assert_error_shape(response, 412)


def test_a_delete_with_a_stale_etag_is_412(world, staff):
    client = client_for(staff)
    tag = etag_of(client, "/api/v1/resource-groups/training/")
    client.patch("/api/v1/resource-groups/training/", {"policy": "binpack"}, format="json", HTTP_IF_MATCH=tag)

    assert_error_shape(client.delete("/api/v1/resource-groups/training/", HTTP_IF_MATCH=tag), 412)
    assert ResourceGroup.objects.filter(name="training").exists()


def test_changing_project_members_changes_the_etag(world, staff, bob):
    client = client_for(staff)
    url = f"/api/v1/projects/{world['vision'].pk}/"
    tag = etag_of(client, url)

    world["vision"].members.add(bob)

    assert etag_of(client, url) != tag


# --- validation -------------------------------------------------------------------------------------

def test_fractional_settings_below_backend_ais_minimums_are_400_naming_the_field(world, staff):
    client = client_for(staff)
    tag = etag_of(client, "/api/v1/fractional-settings/cuda/")

    response = client.patch("/api/v1/fractional-settings/cuda/", {"unit_mem": 1024, "unit_proc": 1},
                            format="json", HTTP_IF_MATCH=tag)

    body = assert_error_shape(response, 400)
    assert set(body["field_errors"]) == {"unit_mem", "unit_proc"}


def test_the_url_key_of_a_setting_cannot_be_changed(world, staff):
    client = client_for(staff)
    tag = etag_of(client, "/api/v1/fractional-settings/cuda/")

    response = client.patch("/api/v1/fractional-settings/cuda/", {"slot_name": "rocm"}, format="json",
                            HTTP_IF_MATCH=tag)

    assert "slot_name" in assert_error_shape(response, 400)["field_errors"]


def test_a_second_slot_format_for_the_same_subtype_is_400(world, staff):
    response = client_for(staff).post("/api/v1/slot-formats/", {"slot_name": "cuda", "subtype": "shares"},
                                      format="json")

    assert_error_shape(response, 400)


@pytest.mark.parametrize("body", [
    {"max_sessions": 1},                                   # neither user nor project
    {"user": "root", "project": "vision", "max_sessions": 1},  # both
    {"user": "alice", "max_sessions": 1},                  # alice already has one
    {"user": "nobody", "max_sessions": 1},                 # no such user
    {"user": "root", "max_fgpu": "-1"},                    # negative
])
def test_an_invalid_quota_is_a_400_and_nothing_is_written(world, staff, body):
    before = Quota.objects.count()

    response = client_for(staff).post("/api/v1/quotas/", body, format="json")

    assert_error_shape(response, 400)
    assert Quota.objects.count() == before


def test_moving_a_quota_onto_a_user_who_has_one_is_400(world, staff):
    client = client_for(staff)
    url = item_url("quotas", world)

    response = client.patch(url, {"user": "bob"}, format="json", HTTP_IF_MATCH=etag_of(client, url))

    assert_error_shape(response, 400)


# --- what users see --------------------------------------------------------------------------------

def test_users_see_only_the_quotas_that_apply_to_them(world, alice, bob, staff):
    mine = client_for(alice).get("/api/v1/quotas/").json()["results"]
    theirs = client_for(bob).get("/api/v1/quotas/").json()["results"]
    every = client_for(staff).get("/api/v1/quotas/").json()["results"]

    assert sorted((q["scope"], q["user"] or q["project"]) for q in mine) == [("project", "vision"), ("user", "alice")]
    assert [(q["scope"], q["user"]) for q in theirs] == [("user", "bob")]
    assert len(every) == 3


def test_another_users_quota_and_project_are_404(world, bob):
    client = client_for(bob)

    assert_error_shape(client.get(item_url("quotas", world)), 404)
    assert_error_shape(client.get(item_url("projects", world)), 404)
    assert client.get("/api/v1/projects/").json()["results"] == []


def test_users_see_the_projects_they_belong_to(world, alice):
    [project] = client_for(alice).get("/api/v1/projects/").json()["results"]

    assert (project["name"], project["members"]) == ("vision", ["alice"])


def test_my_quota_shows_limits_use_and_headroom(world, alice, django_capture_on_commit_callbacks):
    launch(client_for(alice), {"cuda.shares": "0.5"}, capture=django_capture_on_commit_callbacks)

    body = client_for(alice).get("/api/v1/quota/").json()

    assert body["user"] == "alice"
    [own, project] = body["quotas"]
    assert (own["scope"], own["name"], project["scope"], project["name"]) == ("user", "alice", "project", "vision")
    assert own["limits"] == {"fgpu": "1.50", "devices": None, "gpu_memory": None, "sessions": 3}
    assert own["used"] == {"fgpu": "0.50", "devices": 1, "gpu_memory": 2 * GiB, "sessions": 1}
    assert own["remaining"]["fgpu"] == "1.00"
    assert project["remaining"]["fgpu"] == "3.50"
    assert body["headroom"] == {"fgpu": "1.00", "devices": None, "gpu_memory": None, "sessions": 2}


def test_my_quota_without_any_quota_is_unlimited(demo_cluster, django_user_model):
    carol = django_user_model.objects.create_user("carol")

    body = client_for(carol).get("/api/v1/quota/").json()

    assert body == {"user": "carol", "quotas": [],
                    "headroom": {"fgpu": None, "devices": None, "gpu_memory": None, "sessions": None}}


def test_only_admins_look_at_another_users_quota(world, alice, bob, staff):
    assert_error_shape(client_for(bob).get("/api/v1/quota/?user=alice"), 403)
    assert client_for(alice).get("/api/v1/quota/?user=alice").status_code == 200
    assert client_for(staff).get("/api/v1/quota/?user=alice").json()["user"] == "alice"
    assert_error_shape(client_for(staff).get("/api/v1/quota/?user=nobody"), 404)


# --- filters ------------------------------------------------------------------------------------------

@pytest.fixture
def two_nodes(db, alice, bob, staff):
    mig = dataclasses.replace(mock_gpu(1, memory=10 * GiB, sms=14), device_id="MIG-1", is_mig_device=True,
                              mig_profile="1g.10gb")
    make_cluster(nodes={"node-a": [mock_gpu(0)], "node-b": [mock_gpu(0), mig]})


def test_sessions_filter_by_a_comma_list_of_statuses(demo_cluster, alice, django_capture_on_commit_callbacks):
    client = client_for(alice)
    scheduled = launch(client, capture=django_capture_on_commit_callbacks).json()["id"]
    pending = launch(client).json()["id"]  # no on-commit: stays PENDING
    cancelled = launch(client).json()["id"]
    client.delete(f"/api/v1/sessions/{cancelled}/")

    def ids(query):
        response = client.get(f"/api/v1/sessions/?{query}")
        assert response.status_code == 200, response.content
        return {s["id"] for s in response.json()["results"]}

    assert ids("status=pending,Scheduled") == {scheduled, pending}
    assert ids("status=CANCELLED") == {cancelled}
    assert ids("status=RUNNING") == set()


def test_an_unknown_status_filter_is_a_400_naming_it(demo_cluster, alice):
    body = assert_error_shape(client_for(alice).get("/api/v1/sessions/?status=pending,sleeping"), 400)

    assert "SLEEPING" in body["field_errors"]["status"][0]


def test_admins_filter_sessions_by_owner_and_node(two_nodes, alice, bob, staff, django_capture_on_commit_callbacks):
    launch(client_for(alice), {"cuda.shares": "2"}, capture=django_capture_on_commit_callbacks)
    launch(client_for(bob), {"cuda.shares": "2"}, capture=django_capture_on_commit_callbacks)
    sessions = {s.owner.username: s for s in ComputeSession.objects.select_related("owner", "node")}
    admin = client_for(staff)

    by_owner = admin.get("/api/v1/sessions/?owner=bob").json()["results"]
    by_node = admin.get(f"/api/v1/sessions/?node={sessions['alice'].node.name}").json()["results"]

    assert [s["owner"] for s in by_owner] == ["bob"]
    assert {sessions["alice"].node.name, sessions["bob"].node.name} == {"node-a", "node-b"}
    assert [s["owner"] for s in by_node] == ["alice"]


def test_a_user_filtering_by_another_owner_sees_nothing(demo_cluster, alice, bob):
    launch(client_for(bob))

    assert client_for(alice).get("/api/v1/sessions/?owner=bob").json()["results"] == []
    assert client_for(alice).get("/api/v1/sessions/").json()["count"] == 0


def test_devices_filter_by_node_slot_name_and_mig(two_nodes, alice):
    client = client_for(alice)

    def devices(query=""):
        return [(d["node"], d["device_id"]) for d in client.get(f"/api/v1/devices/?{query}").json()["results"]]

    gpu0 = "GPU-00000000-0000-0000-0000-000000000000"
    assert devices() == [("node-a", gpu0), ("node-b", gpu0), ("node-b", "MIG-1")]
    assert devices("node=node-b") == [("node-b", gpu0), ("node-b", "MIG-1")]
    assert devices("is_mig_device=true") == [("node-b", "MIG-1")]
    assert devices("is_mig_device=false&node=node-b") == [("node-b", gpu0)]
    assert devices("slot_name=rocm") == []
    for bad in ("yes", ""):  # an empty value is not "not sent"
        body = assert_error_shape(client.get(f"/api/v1/devices/?is_mig_device={bad}"), 400)
        assert body["field_errors"] == {"is_mig_device": ["expected true or false"]}


def test_devices_show_their_live_allocation(demo_cluster, alice, django_capture_on_commit_callbacks):
    launch(client_for(alice), {"cuda.shares": "0.5"}, capture=django_capture_on_commit_callbacks)

    [device] = client_for(alice).get("/api/v1/devices/?node=demo-node").json()["results"]

    assert (device["capacity_fgpu"], device["allocated_fgpu"], device["free_fgpu"]) == ("2.00", "0.50", "1.50")
    assert (device["allocated_memory"], device["allocated_procs"], device["session_count"]) == (2 * GiB, "20.000", 1)


def test_quotas_filter_by_user_and_project(world, staff):
    client = client_for(staff)

    assert [q["user"] for q in client.get("/api/v1/quotas/?user=bob").json()["results"]] == ["bob"]
    assert [q["project"] for q in client.get("/api/v1/quotas/?project=vision").json()["results"]] == ["vision"]


def test_nodes_filter_by_status_and_resource_group(two_nodes, alice):
    client = client_for(alice)

    assert [n["name"] for n in client.get("/api/v1/nodes/?status=ALIVE").json()["results"]] == ["node-a", "node-b"]
    assert client.get("/api/v1/nodes/?status=LOST").json()["results"] == []
    assert client.get("/api/v1/nodes/?resource_group=training").json()["results"] == []


def test_lists_paginate_with_limit_and_offset(world, staff):
    body = client_for(staff).get("/api/v1/quotas/?limit=1&offset=1").json()

    assert body["count"] == 3
    assert len(body["results"]) == 1
    assert "offset=2" in body["next"]
