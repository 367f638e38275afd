"""`GET /api/v1/my-resources/` (issue 18.1) against the real database: a user's fGPU, GPU memory
and sessions in use against the quota that binds each, and the free capacity by resource group
with LOST nodes left out of what is free."""
from __future__ import annotations

from decimal import Decimal as D

from accelerators.models import Node, NodeStatus, ResourceGroup
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
         "memory_free": 14 * GiB, "memory_total": 16 * GiB},
        {"name": "training", "nodes": 1, "nodes_alive": 1, "allocation_mode": "fractional", "free": "3.50",
         "total": "4.00", "memory_free": 14 * GiB, "memory_total": 16 * GiB},
    ]
