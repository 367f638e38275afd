"""MIG across the real processes (uvicorn, a Celery manager worker, an agent process, Redis,
PostgreSQL): a dynamic-MIG H100 mock node whose manager expects an idle 3g.40gb instance. When
its agent starts and registers, the manager sends it that layout over its `agent.<node>` queue;
the agent (a fresh process: no instance exists) creates it and reports back over the `manager`
queue, so the instance's MIG device UUID is known before any session asked for it. A session
asking for the profile then reuses it, and a 15G request gets a new 1g.20gb whose UUID the agent
reports too."""
from __future__ import annotations

import pytest

from accelerators.models import Device, GpuInstance, MigMode, Node
from tests.conftest import GiB, ROOT, StackNode, wait_until
from tests.test_e2e_distributed import api, get_ok

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

REDIS_DB = 7  # shared with the other distributed e2e tests (they run one after another), flushed first
MOTHER = "5d1a0c3e-9b7f-4f40-8a55-0c2e6b1f4d80"  # demo/mock-accelerator-mig-h100.toml


def test_the_agent_recreates_the_managers_layout_at_start_and_reports_every_mig_device(
        distributed_stack, django_user_model):
    node = Node.objects.create(name="e2e-mig", mig_mode=MigMode.DYNAMIC)
    gpu = Device.objects.create(node=node, device_id=f"GPU-{MOTHER}", mother_uuid=MOTHER, index=0,
                                model_name="NVIDIA H100 80GB HBM3", subproc_count=132, memory_size=80 * GiB)
    planned = GpuInstance.objects.create(node=node, parent=gpu, profile="3g.40gb", placement_start=4,
                                         placement_size=4, memory_size=42412802048, subproc_count=60)
    stack = distributed_stack(redis_db=REDIS_DB, nodes=[StackNode(
        "e2e-mig", (ROOT / "demo" / "mock-accelerator-mig-h100.toml").read_text(), cpu_count=8, memory="64G")])

    uuid = wait_until(lambda: GpuInstance.objects.get(pk=planned.pk).uuid, timeout=30,
                      what="the agent to re-create the expected 3g.40gb at start and report its MIG device")
    assert uuid.startswith("MIG-") and not GpuInstance.objects.filter(unknown_since__isnull=False).exists()

    django_user_model.objects.create_user("alice", password="alice-pass-123")
    _, body = api(stack.base, "POST", "/api/v1/auth/token/", body={"username": "alice", "password": "alice-pass-123"})
    token = body["token"]
    ids = {}
    for name, resources in (("big", {"mig_profile": "3g.40gb"}), ("small", {"gpu_memory": "15G", "isolation": "mig"})):
        status, created = api(stack.base, "POST", "/api/v1/sessions/", token, {"name": name, "resources": resources})
        assert status == 201, created
        ids[name] = created["id"]
        wait_until(lambda: get_ok(stack.base, f"/api/v1/sessions/{ids[name]}/", token)["status"] == "RUNNING",
                   timeout=60, what=f"session {name} to be RUNNING")
    assert GpuInstance.objects.get(pk=planned.pk).session_id is not None  # reused, not created anew
    small = wait_until(lambda: GpuInstance.objects.filter(session_id=ids["small"]).exclude(uuid="").first(),
                       timeout=30, what="the 1g.20gb instance's MIG device UUID")
    assert small.profile == "1g.20gb" and small.uuid.startswith("MIG-") and small.uuid != uuid

    [layout] = get_ok(stack.base, "/api/v1/mig/layouts/?node=e2e-mig", token)["results"]
    assert sorted((i["profile"], i["state"], i["session"]["name"]) for i in layout["instances"]) == \
        [("1g.20gb", "in_use", "small"), ("3g.40gb", "in_use", "big")]
    for session_id in ids.values():
        assert api(stack.base, "DELETE", f"/api/v1/sessions/{session_id}/", token)[0] == 202
