"""The MIG REST API: catalogs per GPU model (built-in or read from NVML), the layout of every
MIG-capable GPU (who holds an instance shown only to that session's owner and administrators),
and a node's MIG settings written by administrators with If-Match, checked as the admin form
checks them."""
from __future__ import annotations

from dataclasses import replace

import pytest
from django.utils import timezone

from accelerators.allocation import mig
from accelerators.models import GpuInstance, MigMode, Node
from sessions.admission.launch import session_create
from tests.conftest import assert_error_shape, client_for, make_cluster, mock_gpu
from tests.test_mig_scheduling import H100_UUID, end, h100, mig_node, schedule

pytestmark = pytest.mark.django_db

PROFILES = "/api/v1/mig/profiles/"
LAYOUTS = "/api/v1/mig/layouts/"
NODE_MIG = "/api/v1/nodes/mig-node/mig/"


# --- profiles -------------------------------------------------------------------------------------

def test_profiles_list_every_built_in_model_with_slices_memory_sms_and_placements(alice):
    body = client_for(alice).get(PROFILES).json()

    assert body["count"] == len(mig.CATALOGS)
    h100_80 = next(c for c in body["results"] if c["model"] == "H100-80GB")
    assert h100_80["source"] == "built-in" and h100_80["nodes"] == []
    one = next(p for p in h100_80["profiles"] if p["name"] == "1g.20gb")
    assert one == {"name": "1g.20gb", "profile_id": 15, "nvml_profile": 9, "compute_slices": 1, "memory_slices": 2,
                   "memory": 20096 << 20, "memory_assumed": False, "sm_count": 26, "max_instances": 4,
                   "placements": [{"start": s, "size": 2} for s in (0, 2, 4, 6)]}


def test_profiles_filter_by_model_as_nvml_or_an_inventory_names_it(alice):
    for name in ("H100-80GB", "h100-80gb", "NVIDIA H100 80GB HBM3", "H100"):
        body = client_for(alice).get(PROFILES, {"model": name}).json()
        assert [c["model"] for c in body["results"]] == ["H100-80GB"], name


def test_a_model_that_is_no_mig_gpu_is_a_400_naming_the_parameter(alice):
    body = assert_error_shape(client_for(alice).get(PROFILES, {"model": "GeForce RTX 4090"}), 400)

    assert list(body["field_errors"]) == ["model"] and "not a MIG-capable GPU model" in body["detail"]


def test_a_catalog_an_agent_read_from_nvml_is_listed_as_such_with_its_nodes(alice):
    built_in = mig.CATALOGS["A100-80GB"]
    reported = replace(built_in, model="NVIDIA A100 80GB PCIe", source="NVML on the node",
                       profiles=tuple(p for p in built_in.profiles if p.name != "1g.20gb"))
    mig_node(devices=[replace(h100(), model_name="NVIDIA A100 80GB PCIe", mig_catalog=mig.catalog_as_dict(reported))])
    mig_node(name="other", devices=[h100()])

    body = client_for(alice).get(PROFILES, {"model": "A100-80GB"}).json()

    assert [(c["model"], c["source"], c["nodes"]) for c in body["results"]] == [
        ("A100-80GB", "built-in", []), ("NVIDIA A100 80GB PCIe", "nvml", ["mig-node"])]
    assert "1g.20gb" not in [p["name"] for p in body["results"][1]["profiles"]]
    assert body["results"][1]["built_in_model"] == "A100-80GB"
    h100_80 = client_for(alice).get(PROFILES, {"model": "H100-80GB"}).json()["results"]
    assert h100_80[0]["nodes"] == ["other"]


def test_profiles_are_paginated_and_answer_a_weak_etag(alice):
    api = client_for(alice)
    first = api.get(PROFILES, {"limit": 2})

    assert len(first.json()["results"]) == 2 and first.json()["next"]
    again = api.get(PROFILES, {"limit": 2}, HTTP_IF_NONE_MATCH=first["ETag"])
    assert again.status_code == 304


# --- layouts ------------------------------------------------------------------------------------

@pytest.fixture
def laid_out(alice, django_capture_on_commit_callbacks):
    """mig-node's H100: alice's 4g.40gb in use at 0, an idle 1g.10gb at 4 (its session ended),
    an unknown 1g.10gb at 6 (found by the agent)."""
    node = mig_node()
    gpu = node.devices.get()
    GpuInstance.objects.create(node=node, parent=gpu, profile="1g.10gb", placement_start=6, placement_size=1,
                               uuid="MIG-stranger", unknown_since=timezone.now())
    small = session_create(owner=alice, name="small", resources={"mig_profile": "1g.10gb"})
    schedule(django_capture_on_commit_callbacks)
    end(small)
    held = session_create(owner=alice, name="notebook", resources={"mig_profile": "4g.40gb"})
    schedule(django_capture_on_commit_callbacks)
    return held


def test_a_layout_shows_each_instance_its_placement_state_and_free_and_stranded_slices(laid_out, staff):
    [layout] = client_for(staff).get(LAYOUTS).json()["results"]

    assert (layout["node"], layout["mig_mode"], layout["model"], layout["catalog_source"]) == \
        ("mig-node", "dynamic", "H100-80GB", "built-in")
    assert layout["gpu"] == {"index": 0, "device_id": H100_UUID, "model_name": "H100-80GB"}
    got = [(i["profile"], i["placement"]["start"], i["placement"]["size"], i["state"]) for i in layout["instances"]]
    starts = {i["state"]: i["placement"]["start"] for i in layout["instances"]}
    assert sorted(got, key=lambda g: g[1]) == got and ("4g.40gb", 0, 4, "in_use") in got
    assert ("1g.10gb", 6, 1, "unknown") in got and ("1g.10gb", starts["idle"], 1, "idle") in got
    unknown = next(i for i in layout["instances"] if i["state"] == "unknown")
    assert unknown["uuid"] == "MIG-stranger" and unknown["unknown_since"] and unknown["session"] is None
    held = {0, 1, 2, 3, 6, starts["idle"]}
    assert layout["free_slices"] == sorted(set(range(8)) - held)
    assert set(layout["stranded_slices"]) <= set(layout["free_slices"])
    assert layout["free_compute_slices"] == 1


@pytest.mark.parametrize("who, sees", [("owner", True), ("admin", True), ("other", False)])
def test_the_session_on_an_instance_is_shown_to_its_owner_and_admins_only(laid_out, alice, bob, staff, who, sees):
    user = {"owner": alice, "admin": staff, "other": bob}[who]
    for path in (LAYOUTS, NODE_MIG):
        body = client_for(user).get(path).json()
        [layout] = body["results"] if "results" in body else body["gpus"]
        [used] = [i for i in layout["instances"] if i["state"] == "in_use"]
        if sees:
            assert used["session"] == {"id": str(laid_out.pk), "name": "notebook", "owner": "alice"}
        else:
            assert used["session"] is None
            assert str(laid_out.pk) not in str(body)


def test_layouts_filter_by_node_and_skip_gpus_without_mig(alice):
    mig_node()
    make_cluster(nodes={"plain": [mock_gpu(0)]})

    assert client_for(alice).get(LAYOUTS, {"node": "plain"}).json()["results"] == []
    assert [g["node"] for g in client_for(alice).get(LAYOUTS).json()["results"]] == ["mig-node"]
    assert client_for(alice).get(LAYOUTS, {"node": "nowhere"}).json()["count"] == 0


def test_the_anonymous_get_401_on_every_mig_endpoint():
    for path in (PROFILES, LAYOUTS, NODE_MIG):
        assert_error_shape(client_for(None).get(path), 401)


# --- a node's MIG settings --------------------------------------------------------------------------

def test_an_administrator_sets_a_fixed_layout_with_the_etag_and_it_is_applied(staff, django_capture_on_commit_callbacks):
    mig_node()
    api = client_for(staff)
    got = api.get(NODE_MIG)
    assert got.json()["mig_mode"] == "dynamic" and got["ETag"]
    layout = {"0": [{"profile": "3g.40gb", "start": 4}, {"profile": "2g.20gb", "start": 0}]}

    response = api.patch(NODE_MIG, {"mig_mode": "fixed", "mig_layout": layout}, format="json", HTTP_IF_MATCH=got["ETag"])

    assert response.status_code == 200, response.content
    assert response.json()["mig_mode"] == "fixed" and response["ETag"] != got["ETag"]
    assert [(i["profile"], i["state"]) for i in response.json()["gpus"][0]["instances"]] == \
        [("2g.20gb", "idle"), ("3g.40gb", "idle")]
    assert sorted(GpuInstance.objects.values_list("profile", "placement_start")) == [("2g.20gb", 0), ("3g.40gb", 4)]


def test_a_mig_write_without_if_match_is_428_and_with_a_stale_one_412(staff):
    mig_node()
    api = client_for(staff)
    tag = api.get(NODE_MIG)["ETag"]
    assert api.patch(NODE_MIG, {"mig_mode": "static"}, format="json", HTTP_IF_MATCH=tag).status_code == 200

    assert assert_error_shape(api.patch(NODE_MIG, {"mig_mode": "off"}, format="json"), 428)["type"] == \
        "precondition-required"
    assert assert_error_shape(api.patch(NODE_MIG, {"mig_mode": "off"}, format="json", HTTP_IF_MATCH=tag), 412)[
        "type"] == "precondition-failed"
    assert Node.objects.get(name="mig-node").mig_mode == MigMode.STATIC


def test_a_heartbeat_or_a_sharing_change_does_not_make_the_mig_etag_stale(staff):
    from accelerators.services import node_heartbeat

    mig_node()
    api = client_for(staff)
    tag = api.get(NODE_MIG)["ETag"]
    node_heartbeat(node_name="mig-node")
    Node.objects.filter(name="mig-node").update(device_split_count=3)

    assert api.patch(NODE_MIG, {"mig_mode": "off"}, format="json", HTTP_IF_MATCH=tag).status_code == 200


@pytest.mark.parametrize("layout, message", [
    ({"0": [{"profile": "4g.40gb", "start": 0}, {"profile": "2g.20gb", "start": 2}]}, "already held"),
    ({"0": [{"profile": "2g.20gb", "start": 1}]}, "cannot start at memory slice 1"),
    ({"7": [{"profile": "1g.10gb", "start": 0}]}, "has no GPU '7'"),
    ({"0": [{"profile": "9g.99gb", "start": 0}]}, "is not a MIG profile of H100-80GB"),
    ({"0": "3g.40gb"}, "expected a list"),
])
def test_a_bad_fixed_layout_is_a_400_naming_the_problem_as_the_admin_form_does_and_changes_nothing(
        staff, layout, message):
    mig_node()
    response = client_for(staff).put(NODE_MIG, {"mig_mode": "fixed", "mig_layout": layout}, format="json",
                                     HTTP_IF_MATCH="*")

    body = assert_error_shape(response, 400)
    assert list(body["field_errors"]) == ["mig_layout"] and message in body["detail"], body
    node = Node.objects.get(name="mig-node")
    assert (node.mig_mode, node.mig_layout, GpuInstance.objects.count()) == (MigMode.DYNAMIC, {}, 0)


def test_a_bad_mig_mode_is_a_400_naming_it(staff):
    mig_node()
    body = assert_error_shape(client_for(staff).patch(NODE_MIG, {"mig_mode": "sometimes"}, format="json",
                                                      HTTP_IF_MATCH="*"), 400)
    assert list(body["field_errors"]) == ["mig_mode"]


@pytest.mark.parametrize("who, status", [("anonymous", 401), ("user", 403)])
def test_the_anonymous_and_users_cannot_change_a_nodes_mig(alice, who, status):
    mig_node()
    client = client_for(alice if who == "user" else None)
    for method in ("put", "patch"):
        assert_error_shape(getattr(client, method)(NODE_MIG, {"mig_mode": "off"}, format="json", HTTP_IF_MATCH="*"),
                           status)
    assert Node.objects.get(name="mig-node").mig_mode == MigMode.DYNAMIC


def test_a_node_that_does_not_exist_is_a_404(alice):
    assert_error_shape(client_for(alice).get("/api/v1/nodes/nowhere/mig/"), 404)


def test_switching_a_node_to_dynamic_mig_starts_a_session_waiting_for_mig(alice, staff, django_capture_on_commit_callbacks):
    from sessions.models import ComputeSession, SessionStatus

    mig_node(mode=MigMode.FIXED)  # an empty fixed layout: no idle instance to hand out
    waiting = session_create(owner=alice, name="w", resources={"mig_profile": "1g.10gb"})
    schedule(django_capture_on_commit_callbacks)
    assert ComputeSession.objects.get(pk=waiting.pk).status == SessionStatus.PENDING

    with django_capture_on_commit_callbacks(execute=True):
        response = client_for(staff).patch(NODE_MIG, {"mig_mode": "dynamic"}, format="json", HTTP_IF_MATCH="*")
    assert response.status_code == 200

    assert ComputeSession.objects.get(pk=waiting.pk).status == SessionStatus.SCHEDULED
