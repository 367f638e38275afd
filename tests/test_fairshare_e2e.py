"""Fair share end to end on the distributed stack (issue 17, "How it is checked"): two projects
of equal weight share a one-GPU node; one floods the queue, the other asks later and starts
ahead of the flood once its share is the lower, and GET /api/v1/fairshare/ says why.

Every session asks for the whole GPU (2 fGPU), so exactly one runs at a time and the order
they start in is the queue's order. The manager's scheduler pass, with the fair-share factor
computed from the database's allocations (sessions.scheduling.fairshare), decides it; nothing is mocked."""
from __future__ import annotations

import pytest

from sessions.models import Project
from tests.conftest import ROOT, StackNode, wait_until
from tests.test_e2e_distributed import api, get_ok

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

REDIS_DB = 7  # shared with the other distributed e2e tests (they run one after another), flushed first
WHOLE_GPU = {"cuda.shares": "2", "cpu": 1, "mem": "128M"}


def token_of(base: str, username: str) -> str:
    status, body = api(base, "POST", "/api/v1/auth/token/", body={"username": username, "password": f"{username}-pass-123"})
    assert status == 200, body
    return body["token"]


def launch(base: str, token: str, name: str, command: str) -> str:
    status, body = api(base, "POST", "/api/v1/sessions/", token, {"name": name, "resources": WHOLE_GPU, "command": command})
    assert status == 201, body
    return body["id"]


def test_the_project_that_used_less_starts_ahead_of_a_flood_it_arrived_after(distributed_stack, django_user_model):
    stack = distributed_stack(nodes=[StackNode("share-node", (ROOT / "demo" / "mock-accelerator.toml").read_text())],
                              redis_db=REDIS_DB)
    for username in ("alice", "bob"):
        django_user_model.objects.create_user(username, password=f"{username}-pass-123")
    Project.objects.create(name="vision").members.set(django_user_model.objects.filter(username="alice"))
    Project.objects.create(name="nlp").members.set(django_user_model.objects.filter(username="bob"))
    base = stack.base
    alice, bob = token_of(base, "alice"), token_of(base, "bob")

    # vision uses the whole GPU for a while, and queues three more behind it
    first = launch(base, alice, "vision-0", "sleep 4")
    wait_until(lambda: get_ok(base, f"/api/v1/sessions/{first}/", alice)["status"] == "RUNNING", timeout=60,
               what="vision's first session to run")
    flood = [launch(base, alice, f"vision-{i}", "sleep 2") for i in (1, 2, 3)]
    late = launch(base, bob, "nlp-0", "sleep 2")  # asks last

    assert all(get_ok(base, f"/api/v1/sessions/{s}/", alice)["status"] == "PENDING" for s in flood)
    # each user sees the account they belong to: vision has used the GPU, nlp nothing yet
    vision, = get_ok(base, "/api/v1/fairshare/", alice)["accounts"]
    nlp, = get_ok(base, "/api/v1/fairshare/", bob)["accounts"]
    assert (vision["name"], vision["pending"], nlp["name"], nlp["pending"], nlp["factor"]) == ("vision", 3, "nlp", 1, 1.0)
    assert vision["usage_fgpu_hours"] > 0 and vision["factor"] < nlp["factor"]

    def started(session_id: str, token: str):
        return get_ok(base, f"/api/v1/sessions/{session_id}/", token)["started_at"]

    wait_until(lambda: started(late, bob) is not None, timeout=90, what="nlp's session to start")
    wait_until(lambda: all(started(s, alice) is not None for s in flood), timeout=120, what="the flood to drain")
    starts = sorted([(started(s, alice), "vision") for s in flood] + [(started(late, bob), "nlp")])
    assert starts[0][1] == "nlp", starts  # the first to start after vision-0: bob's, though it asked last
    assert [name for _, name in starts[1:]] == ["vision"] * 3
