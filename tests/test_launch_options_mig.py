"""Launch options and the launch preview with MIG (real database): the MIG profiles a user may
ask for where a node with MIG is in reach, how many could be placed now (idle instances reused,
new ones planned) and ever, the isolations of a memory-sized request, and what a MIG request
would get now."""
from __future__ import annotations

import pytest

from accelerators.config_import import parse_mock_accelerator_toml
from accelerators.models import GpuInstance, MigMode, Node, ResourceGroup
from sessions.models import ComputeSession, Quota
from tests.conftest import GiB, client_for, make_cluster, mock_gpu
from tests.test_mig_scheduling import MIG_TOML, end, mig_node, schedule

pytestmark = pytest.mark.django_db

H100_PROFILES = ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]


def mig_options(client, query: str = "") -> dict:
    response = client.get("/api/v1/launch-options/" + query)
    assert response.status_code == 200, response.json()
    return response.json()["mig"]


def by_name(mig: dict) -> dict[str, dict]:
    return {p["name"]: p for p in mig["profiles"]}


def counts(mig: dict, name: str) -> tuple[int, int, int]:
    profile = by_name(mig)[name]
    return profile["max_now"], profile["idle_now"], profile["max_ever"]


def preview(client, resources: dict) -> dict:
    response = client.post("/api/v1/sessions/preview/", {"resources": resources}, format="json")
    assert response.status_code == 200, response.json()
    return response.json()


def test_without_a_mig_node_no_profiles_and_no_isolation_choice_are_offered(demo_cluster, alice):
    mig = mig_options(client_for(alice))

    assert mig == {"slot_name": "cuda", "profiles": [], "isolation": []}


def test_a_node_left_in_mig_mode_off_offers_no_profiles_though_its_gpu_could_do_mig(alice):
    mig_node(mode=MigMode.OFF)

    assert mig_options(client_for(alice))["profiles"] == []


def test_a_dynamic_h100_offers_its_catalog_smallest_first_with_memory_and_slices(alice):
    mig_node()

    mig = mig_options(client_for(alice))

    assert [p["name"] for p in mig["profiles"]] == H100_PROFILES
    assert mig["isolation"] == ["shared", "mig", "any"]
    small = by_name(mig)["1g.20gb"]
    assert small["memory"] == 20096 << 20 and small["memory_text"] == "19.62 GiB"
    assert (small["compute_slices"], small["memory_slices"], small["sm_count"]) == (1, 2, 26)
    assert small["models"] == ["H100-80GB"]
    assert [counts(mig, n) for n in H100_PROFILES] == [
        (7, 0, 7), (1, 0, 1), (4, 0, 4), (3, 0, 3), (2, 0, 2), (1, 0, 1), (1, 0, 1)]


def test_instances_in_use_lower_what_is_free_now_and_an_idle_one_counts_as_reusable(alice, django_capture_on_commit_callbacks):
    mig_node()
    client = client_for(alice)
    held = ComputeSession.objects.get(pk=client.post("/api/v1/sessions/", {
        "name": "big", "resources": {"mig_profile": "4g.40gb"}}, format="json").json()["id"])
    schedule(django_capture_on_commit_callbacks)

    mig = mig_options(client)
    # 4g.40gb holds memory slices 0-3 and 4 of the 7 compute slices: 3 compute slices are left.
    assert counts(mig, "7g.80gb") == (0, 0, 1)
    assert counts(mig, "4g.40gb") == (0, 0, 1)
    assert counts(mig, "3g.40gb") == (1, 0, 2)
    assert counts(mig, "1g.10gb") == (3, 0, 7)
    assert counts(mig, "2g.20gb") == (1, 0, 3)

    end(held)
    mig = mig_options(client)
    assert counts(mig, "4g.40gb") == (1, 1, 1)  # the idle instance is reused
    assert counts(mig, "7g.80gb") == (1, 0, 1)  # the planner would destroy the idle 4g.40gb for it
    assert counts(mig, "1g.10gb") == (7, 0, 7)


def test_a_fixed_layout_offers_only_its_instances(alice, django_capture_on_commit_callbacks):
    node = mig_node(mode=MigMode.FIXED)
    gpu = node.devices.get()
    for start in (0, 4):
        GpuInstance.objects.create(node=node, parent=gpu, profile="3g.40gb", placement_start=start, placement_size=4,
                                   memory_size=39 * GiB, subproc_count=60)
    client = client_for(alice)
    assert counts(mig_options(client), "3g.40gb") == (2, 2, 2)
    assert counts(mig_options(client), "1g.10gb") == (0, 0, 0)

    client.post("/api/v1/sessions/", {"name": "a", "resources": {"mig_profile": "3g.40gb"}}, format="json")
    schedule(django_capture_on_commit_callbacks)

    assert counts(mig_options(client), "3g.40gb") == (1, 1, 2)


def test_static_slices_are_offered_by_their_inventory_names_with_free_and_total_counts(alice, django_capture_on_commit_callbacks):
    make_cluster(nodes={"static": list(parse_mock_accelerator_toml(MIG_TOML).devices)})
    Node.objects.filter(name="static").update(mig_mode=MigMode.STATIC)
    client = client_for(alice)

    mig = mig_options(client)

    assert [(p["name"], p["memory"], p["compute_slices"]) for p in mig["profiles"]] == [
        ("5g", 5 * GiB, 0), ("10g", 10 * GiB, 0), ("20g", 20 * GiB, 0)]
    assert [counts(mig, n) for n in ("5g", "10g", "20g")] == [(4, 0, 4), (2, 0, 2), (1, 0, 1)]

    client.post("/api/v1/sessions/", {"name": "a", "resources": {"mig_profile": "10g"}}, format="json")
    schedule(django_capture_on_commit_callbacks)

    assert counts(mig_options(client), "10g") == (1, 0, 2)


def test_what_is_free_now_is_capped_by_free_cpu_cores_and_the_session_quota(alice, django_capture_on_commit_callbacks):
    mig_node()
    Node.objects.filter(name="mig-node").update(cpu_count=2)
    client = client_for(alice)
    assert counts(mig_options(client), "1g.10gb") == (2, 0, 2)  # 2 cores: at most 2 sessions of 1 core

    Quota.objects.create(user=alice, max_sessions=1)
    assert counts(mig_options(client), "1g.10gb") == (1, 0, 2)

    client.post("/api/v1/sessions/", {"name": "a", "resources": {"mig_profile": "1g.10gb", "cpu": 2}}, format="json")
    schedule(django_capture_on_commit_callbacks)
    assert counts(mig_options(client), "1g.10gb") == (0, 0, 2)


def test_a_resource_group_limits_the_profiles_to_its_nodes(alice):
    node = mig_node()
    pool = ResourceGroup.objects.create(name="mig-pool")
    ResourceGroup.objects.create(name="plain-pool")
    node.resource_group = pool
    node.save(update_fields=["resource_group"])
    client = client_for(alice)

    assert [p["name"] for p in mig_options(client, "?resource_group=mig-pool")["profiles"]] == H100_PROFILES
    assert mig_options(client, "?resource_group=plain-pool") == {"slot_name": "cuda", "profiles": [], "isolation": []}
    refused = client.get("/api/v1/launch-options/?resource_group=nope")
    assert refused.status_code == 404 and "no resource group 'nope'" in refused.json()["detail"]


def test_the_preview_of_a_mig_request_names_the_profile_the_gpu_and_how(alice, django_capture_on_commit_callbacks):
    mig_node()
    client = client_for(alice)

    by_memory = preview(client, {"gpu_memory": "15G", "isolation": "mig"})

    assert by_memory["fits_now"] and by_memory["node"] == "mig-node"
    assert by_memory["mig"]["profile"] == "1g.20gb"
    assert by_memory["mig"]["plan"].startswith("creates a 1g.20gb instance at memory slice ")
    assert by_memory["configuration"] == "MIG instance of at least 15 GiB · 1 core · 1 GiB"
    [device] = by_memory["devices"]
    assert (device["device_index"], device["memory"], device["procs"]) == (0, 20096 << 20, "26")
    assert not GpuInstance.objects.exists()  # a preview creates nothing

    client.post("/api/v1/sessions/", {"name": "a", "resources": {"mig_profile": "7g.80gb"}}, format="json")
    schedule(django_capture_on_commit_callbacks)
    waits = preview(client, {"mig_profile": "2g.20gb"})
    assert not waits["fits_now"] and not waits["never"] and "7g.80gb@0" in waits["reason"]
    never = preview(client, {"mig_profile": "1g.5gb"})  # an A100 profile
    assert never["never"] and "no MIG node could ever hold MIG profile 1g.5gb" in never["reason"]


def test_the_preview_of_isolation_any_shows_mig_where_it_can_and_a_shared_slice_otherwise(
        alice, django_capture_on_commit_callbacks):
    mig_node()
    make_cluster(nodes={"plain": [mock_gpu(0)]})
    client = client_for(alice)
    assert preview(client, {"gpu_memory": "2G", "isolation": "any"})["mig"]["profile"] == "1g.10gb"

    client.post("/api/v1/sessions/", {"name": "a", "resources": {"mig_profile": "7g.80gb"}}, format="json")
    schedule(django_capture_on_commit_callbacks)
    shared = preview(client, {"gpu_memory": "2G", "isolation": "any"})

    assert shared["fits_now"] and shared["node"] == "plain" and shared["mig"] is None
    assert shared["devices"][0]["memory"] == 2 * GiB


def test_a_sessions_json_says_what_it_asked_for_which_mig_profile_it_got_and_why(alice, django_capture_on_commit_callbacks):
    mig_node()
    make_cluster(nodes={"plain": [mock_gpu(0)]})
    client = client_for(alice)
    mig_id = client.post("/api/v1/sessions/", {"name": "m", "resources": {"gpu_memory": "15G", "isolation": "mig"}},
                         format="json").json()["id"]
    plain_id = client.post("/api/v1/sessions/", {"name": "p", "resources": {"cuda.shares": "0.5"}},
                           format="json").json()["id"]
    pending = client.get(f"/api/v1/sessions/{mig_id}/").json()
    assert (pending["grant"], pending["mig_profile"]) == ("", "")  # not placed yet
    schedule(django_capture_on_commit_callbacks)

    mig = client.get(f"/api/v1/sessions/{mig_id}/").json()
    assert mig["requested"] == "MIG instance of at least 15 GiB · 1 core · 1 GiB" and mig["mig_profile"] == "1g.20gb"
    assert mig["grant"].startswith("got MIG 1g.20gb on GPU 0 (memory slices ")
    assert mig["configuration"] == f"{mig['requested']} — {mig['grant']}"
    plain = client.get(f"/api/v1/sessions/{plain_id}/").json()
    assert (plain["grant"], plain["mig_profile"]) == ("", "")
    assert plain["configuration"] == plain["requested"] == "0.50 fGPU · 1 core · 1 GiB"
