"""`GET /api/v1/my-resources/` (issue 18.1) against the real database: a user's fGPU, GPU memory
and sessions in use against the quota that binds each, and the free capacity by resource group
with LOST nodes left out of what is free."""
from __future__ import annotations

from decimal import Decimal as D

from accelerators.models import MigMode, Node, NodeStatus, ResourceGroup
from sessions.models import Project, Quota
from tests.conftest import GiB, client_for, make_cluster, mock_gpu


def test_my_resources_shows_usage_against_the_binding_quota_and_free_capacity_by_group(
        db, django_user_model, django_capture_on_commit_callbacks):
    make_cluster(nodes={"a": [mock_gpu(0)], "b": [mock_gpu(0, node=1), mock_gpu(1, node=1)]})
    training = ResourceGroup.objects.create(name="training")
    Node.objects.filter(name="b").update(resource_group=training)
    alice = django_user_model.objects.create_user("alice")
    client = client_for(alice)
    with django_capture_on_commit_callbacks(execute=True):
        client.post("/api/v1/sessions/", {"resources": {"cuda.shares": "0.5", "resource_group": "training"}},
                    format="json")
    vision = Project.objects.create(name="vision")
    vision.members.set([alice])
    Quota.objects.create(user=alice, max_fgpu=D(2), max_sessions=4)
    Quota.objects.create(project=vision, max_fgpu=D("0.75"))  # binds: least left
    Node.objects.filter(name="a").update(status=NodeStatus.LOST)

    body = client.get("/api/v1/my-resources/").json()

    assert body["usage"] == [
        {"key": "fgpu", "used": "0.50", "limit": "0.75", "left": "0.25", "quota": 'quota of project "vision"'},
        {"key": "gpu_memory", "used": 2 * GiB, "limit": None, "left": None, "quota": None},
        {"key": "sessions", "used": 1, "limit": 4, "left": 3, "quota": "your quota"},
    ]
    assert body["groups"] == [
        {"name": "", "nodes": 2, "nodes_alive": 1, "allocation_mode": "fractional", "free": "3.50", "total": "4.00",
         "memory_free": 14 * GiB, "memory_total": 16 * GiB, "mig_gpus": 0, "mig_free": 0, "mig_total": 0},
        {"name": "training", "nodes": 1, "nodes_alive": 1, "allocation_mode": "fractional", "free": "3.50",
         "total": "4.00", "memory_free": 14 * GiB, "memory_total": 16 * GiB, "mig_gpus": 0, "mig_free": 0,
         "mig_total": 0},
    ]


def test_free_gpu_capacity_counts_the_mig_slices_of_a_dynamic_mig_gpu(db, django_user_model,
                                                                     django_capture_on_commit_callbacks):
    """Issue 36.4: a dynamic-MIG H100 with 7 free slices appeared nowhere under "Free GPU capacity"
    (its GPU serves no fGPU, so node_states leaves it out): it is counted by its compute slices."""
    h100 = mock_gpu(0, node=1, memory=80 * GiB, sms=132, model="H100-80GB")
    make_cluster(nodes={"a": [mock_gpu(0)], "m": [h100]})
    Node.objects.filter(name="m").update(mig_mode=MigMode.DYNAMIC, resource_group=ResourceGroup.objects.create(name="mig"))
    client = client_for(django_user_model.objects.create_user("alice"))

    before = {g["name"]: g for g in client.get("/api/v1/my-resources/").json()["groups"]}
    with django_capture_on_commit_callbacks(execute=True):
        client.post("/api/v1/sessions/", {"resources": {"mig_profile": "2g.20gb"}}, format="json")
    after = {g["name"]: g for g in client.get("/api/v1/my-resources/").json()["groups"]}

    assert [(g["mig_gpus"], g["mig_free"], g["mig_total"]) for g in before.values()] == [(1, 7, 7), (1, 7, 7)]
    assert (before["mig"]["free"], before["mig"]["total"]) == ("0.00", "0.00")  # no fGPU on it: MIG only
    assert (after[""]["mig_free"], after["mig"]["mig_free"]) == (5, 5)
    Node.objects.filter(name="m").update(status=NodeStatus.LOST)
    lost = {g["name"]: g for g in client.get("/api/v1/my-resources/").json()["groups"]}
    assert (lost["mig"]["mig_gpus"], lost["mig"]["mig_free"]) == (0, 0)  # a lost node's slices are not free
