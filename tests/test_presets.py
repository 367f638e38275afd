"""Resource presets (issue 18, item 7): checked as a launch is checked when saved (service, API
and admin form), offered only to users who may use their resource group, and launched by name
or id with exactly their request, or merged with the body's own fields as `sessions.admission.presets`
documents. Real database, the demo cluster (one 8 GiB / 80-SM GPU = 2 fGPU, quantum 0.25)."""
from __future__ import annotations

import pytest

from accelerators.models import ResourceGroup
from common.errors import ApplicationError
from sessions.admin import ResourcePresetForm
from sessions.models import ComputeSession, Project, ResourcePreset, SessionImage
from sessions.admission.presets import preset_save
from tests.conftest import client_for

pytestmark = pytest.mark.django_db

GiB = 1 << 30


def preset(name="Small notebook", resources=None, cpu=2, mem=8 * GiB, **kw) -> ResourcePreset:
    return preset_save(preset=ResourcePreset(name=name, resources={"cuda.shares": "0.25"} if resources is None
                                             else resources, cpu=cpu, mem=mem, **kw))


@pytest.fixture
def reserved(demo_cluster, bob):
    """Resource group "training" (demo-node in it) reserved for project "vision", whose only
    member is bob; group "open" that no project names."""
    training = ResourceGroup.objects.create(name="training")
    ResourceGroup.objects.create(name="open")
    demo_cluster["demo-node"].resource_group = training
    demo_cluster["demo-node"].save(update_fields=["resource_group"])
    vision = Project.objects.create(name="vision")
    vision.members.add(bob)
    vision.resource_groups.add(training)
    return training


@pytest.fixture
def launch(django_capture_on_commit_callbacks):
    def post(user, body, path="/api/v1/sessions/"):
        with django_capture_on_commit_callbacks(execute=True):
            return client_for(user).post(path, body, format="json")

    return post


# --- checked as a launch is ---------------------------------------------------------------

@pytest.mark.parametrize("resources, message", [
    ({"cuda.shares": "0.3"}, "not a multiple of the quantum 0.25"),
    ({"cuda.shares": "3"}, "2.00 fGPU"),  # the node holds 2 fGPU: never schedulable, naming what a node holds
    ({"cuda.shares": "lots"}, "resources.cuda.shares"),
    ({"gpu": 1, "gpu_cores": 140}, "resources.gpu_cores"),
    ({"gpu_fraction": "0.2", "cuda.shares": "0.5"}, "one"),
    ({"cuda.device": 1}, "fractional mode"),
    ({"mig_profile": "1g.10gb"}, "MIG"),
    ({"cpu": 4}, "'cpu' has its own field"),
    ({"resource_group": "training"}, "'resource_group' has its own field"),
    ({"cuda.shares": "0.25", "resource_group": "nowhere"}, "resource_group"),
    (["cuda.shares"], "an object"),
])
def test_a_preset_with_an_impossible_or_malformed_request_is_refused_naming_the_problem(demo_cluster, resources,
                                                                                       message):
    with pytest.raises(ApplicationError) as refused:
        preset(resources=resources)
    assert message.lower() in refused.value.detail.lower(), refused.value.detail
    assert set(refused.value.field_errors) == {"resources"}
    assert not ResourcePreset.objects.exists()


def test_a_preset_too_large_for_host_memory_or_cores_is_refused(demo_cluster):
    with pytest.raises(ApplicationError) as refused:
        preset(mem=64 * GiB)  # demo-node has 32 GiB
    assert refused.value.type == "never-schedulable"
    with pytest.raises(ApplicationError) as refused:
        preset(cpu=9)  # and 8 cores
    assert refused.value.type == "never-schedulable"


def test_a_preset_image_must_support_its_slot(demo_cluster):
    cpu_only = SessionImage.objects.create(reference="cpu-tools:1", accelerators=["rocm"])
    with pytest.raises(ApplicationError) as refused:
        preset(image=cpu_only)
    assert refused.value.field_errors.keys() == {"image"}


def test_valid_presets_of_every_style_are_saved_with_their_whole_request(demo_cluster):
    saved = [preset(name=f"p{i}", resources=r) for i, r in enumerate([
        {"cuda.shares": "0.25", "strategy": "fill"}, {"gpu": 1, "gpu_memory": "2G", "gpu_cores": 50},
        {"gpu_fraction": "0.5"}, {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000}, {}])]
    assert [p.request() for p in saved][-1] == {"cpu": 2, "mem": 8 * GiB}
    assert saved[0].request() == {"cuda.shares": "0.25", "strategy": "fill", "cpu": 2, "mem": 8 * GiB}


def test_the_admin_form_shows_memory_in_gib_and_the_refusal_under_the_field(demo_cluster):
    form = ResourcePresetForm(data={"name": "Big", "resources": '{"cuda.shares": "5"}', "cpu": 2, "mem": "8 GiB"})
    assert not form.is_valid()
    assert "fGPU" in " ".join(form.errors["resources"]) or "2" in " ".join(form.errors["resources"])

    form = ResourcePresetForm(data={"name": "Small", "resources": '{"cuda.shares": "0.25"}', "cpu": 2, "mem": "8G"})
    assert form.is_valid(), form.errors
    saved = form.save()
    assert saved.mem == 8 * GiB
    assert 'value="8 GiB"' in str(ResourcePresetForm(instance=saved)["mem"])


# --- who sees which ---------------------------------------------------------------------------

def test_users_list_only_the_presets_of_groups_they_may_use(reserved, alice, bob, staff):
    preset(name="Anywhere")
    # "open" has no node, so no preset of it could be saved through the check: written directly.
    ResourcePreset.objects.create(name="Open group", resource_group=ResourceGroup.objects.get(name="open"))
    preset(name="Trainer", resource_group=reserved)

    def names(user):
        response = client_for(user).get("/api/v1/presets/")
        assert response.status_code == 200, response.content
        return [p["name"] for p in response.json()["results"]]

    assert names(alice) == ["Anywhere", "Open group"]
    assert names(bob) == ["Anywhere", "Open group", "Trainer"]
    assert names(staff) == ["Anywhere", "Open group", "Trainer"]
    hidden = ResourcePreset.objects.get(name="Trainer")
    assert client_for(alice).get(f"/api/v1/presets/{hidden.pk}/").status_code == 404
    assert client_for(None).get("/api/v1/presets/").status_code == 401


def test_an_administrator_reserves_a_group_for_a_project_through_the_api(demo_cluster, alice, staff):
    training = ResourceGroup.objects.create(name="training")
    demo_cluster["demo-node"].resource_group = training
    demo_cluster["demo-node"].save(update_fields=["resource_group"])
    preset(name="Trainer", resource_group=training)
    admin = client_for(staff)
    vision = admin.post("/api/v1/projects/", {"name": "vision", "resource_groups": ["training"]}, format="json")
    assert vision.status_code == 201, vision.content
    assert vision.json()["resource_groups"] == ["training"]
    assert client_for(alice).get("/api/v1/presets/").json()["results"] == []

    url = f"/api/v1/projects/{vision.json()['id']}/"
    joined = admin.patch(url, {"members": ["alice"]}, format="json", HTTP_IF_MATCH=admin.get(url)["ETag"])
    assert joined.status_code == 200, joined.content
    assert [p["name"] for p in client_for(alice).get("/api/v1/presets/").json()["results"]] == ["Trainer"]


def test_a_listed_preset_carries_its_request_and_configuration(demo_cluster, alice):
    preset()
    [shown] = client_for(alice).get("/api/v1/presets/").json()["results"]
    assert shown["request"] == {"cuda.shares": "0.25", "cpu": 2, "mem": 8 * GiB}
    assert shown["configuration"] == "0.25 fGPU · 2 cores · 8 GiB"
    assert (shown["resource_group"], shown["image"], shown["mem"]) == (None, None, 8 * GiB)


def test_only_administrators_write_presets_and_every_write_is_checked(demo_cluster, alice, staff):
    body = {"name": "Small notebook", "resources": {"cuda.shares": "0.25"}, "cpu": 2, "mem": "8G"}
    assert client_for(alice).post("/api/v1/presets/", body, format="json").status_code == 403

    admin = client_for(staff)
    created = admin.post("/api/v1/presets/", body, format="json")
    assert created.status_code == 201, created.content
    assert created.json()["mem"] == 8 * GiB
    url = f"/api/v1/presets/{created.json()['id']}/"

    refused = admin.patch(url, {"resources": {"cuda.shares": "0.3"}}, format="json", HTTP_IF_MATCH=created["ETag"])
    assert refused.status_code == 400, refused.content
    assert "quantum" in refused.json()["detail"]
    assert refused.json()["field_errors"].keys() == {"resources"}

    changed = admin.patch(url, {"mem": "16G"}, format="json", HTTP_IF_MATCH=created["ETag"])
    assert changed.status_code == 200, changed.content
    assert changed.json()["configuration"] == "0.25 fGPU · 2 cores · 16 GiB"
    assert client_for(alice).delete(url).status_code == 403
    assert admin.delete(url).status_code == 204
    assert not ResourcePreset.objects.exists()


def test_a_duplicate_name_is_refused(demo_cluster, staff):
    preset()
    response = client_for(staff).post("/api/v1/presets/", {"name": "Small notebook"}, format="json")
    assert response.status_code == 400
    assert "name" in response.json()["field_errors"]


# --- launching one ------------------------------------------------------------------------------

def test_a_launch_by_preset_name_or_id_gets_exactly_the_presets_request(demo_cluster, alice, launch):
    small = preset()
    for reference in (small.name, str(small.pk)):
        response = launch(alice, {"preset": reference})
        assert response.status_code == 201, response.content
        session = ComputeSession.objects.get(pk=response.json()["id"])
        assert session.resources == small.request()
        assert (session.slot_subtype, session.amount, session.cpu, session.mem) == ("shares", 0.25, 2, 8 * GiB)
        assert response.json()["requested"] == "0.25 fGPU · 2 cores · 8 GiB"


def test_a_preset_launches_in_its_image_and_its_resource_group(reserved, bob, launch):
    image = SessionImage.objects.create(reference="fgpu-session:test")
    trainer = preset(name="Trainer", resource_group=reserved, image=image)
    response = launch(bob, {"preset": "Trainer"})
    assert response.status_code == 201, response.content
    session = ComputeSession.objects.get(pk=response.json()["id"])
    assert session.resources == trainer.request()
    assert session.resources["resource_group"] == "training"
    assert session.image == image


def test_explicit_fields_merge_into_the_presets_request(demo_cluster, alice, launch):
    preset(resources={"cuda.shares": "0.25", "strategy": "fill"})
    more_cpu = launch(alice, {"preset": "Small notebook", "resources": {"cpu": 4}, "name": "four"})
    assert more_cpu.status_code == 201, more_cpu.content
    assert ComputeSession.objects.get(name="four").resources == {"cuda.shares": "0.25", "strategy": "fill",
                                                                  "cpu": 4, "mem": 8 * GiB}
    other_style = launch(alice, {"preset": "Small notebook", "resources": {"gpu_fraction": "0.5"}, "name": "frac"})
    assert other_style.status_code == 201, other_style.content
    assert ComputeSession.objects.get(name="frac").resources == {"gpu_fraction": "0.5", "cpu": 2, "mem": 8 * GiB}
    cpu_only = launch(alice, {"preset": "Small notebook", "resources": {"cuda.shares": None, "strategy": None},
                              "name": "cpu"})
    assert cpu_only.status_code == 201, cpu_only.content
    assert ComputeSession.objects.get(name="cpu").resources == {"cpu": 2, "mem": 8 * GiB}


def test_a_conflicting_resource_group_an_unknown_preset_and_a_hidden_one_are_refused(reserved, alice, bob, launch):
    preset(name="Trainer", resource_group=reserved)
    conflict = launch(bob, {"preset": "Trainer", "resources": {"resource_group": "open"}})
    assert conflict.status_code == 400
    assert conflict.json()["type"] == "preset-conflict"
    assert "'training'" in conflict.json()["detail"]

    hidden = launch(alice, {"preset": "Trainer"})
    assert hidden.status_code == 400
    assert hidden.json()["type"] == "unknown-preset"
    assert hidden.json()["field_errors"]["preset"] == ["no preset 'Trainer' you may use (yours: none)"]
    assert launch(alice, {}).json()["field_errors"] == {"resources": ["required (or name a `preset`)"]}
    assert not ComputeSession.objects.exists()


def test_a_group_reserved_for_a_project_refuses_other_users_launches(reserved, alice, bob, launch):
    body = {"resources": {"cuda.shares": "0.25", "resource_group": "training"}}
    refused = launch(alice, body)
    assert refused.status_code == 403, refused.content
    assert refused.json()["type"] == "resource-group-reserved"
    assert "vision" in refused.json()["detail"]
    assert launch(bob, body).status_code == 201


def test_the_preview_takes_a_preset_too(demo_cluster, alice, launch):
    preset()
    response = launch(alice, {"preset": "Small notebook"}, path="/api/v1/sessions/preview/")
    assert response.status_code == 200, response.content
    assert response.json()["configuration"] == "0.25 fGPU · 2 cores · 8 GiB"
    assert response.json()["fits_now"] is True
    assert [d["memory"] for d in response.json()["devices"]] == [1 * GiB]
