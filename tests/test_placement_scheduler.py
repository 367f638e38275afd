"""The database-backed scheduler with placement policies: a resource group's policy decides the
node, one pass reads (and locks) each scope once and never over-commits, and the request shapes
it places are counted per group for the fragmentation-aware policies.
"""
from __future__ import annotations

from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from accelerators.models import Node, PlacementShape, ResourceGroup
from sessions import services
from sessions.models import Allocation, ComputeSession, SessionStatus
from sessions.scheduler import schedule_pending
from tests.conftest import make_cluster, mock_gpu

pytestmark = pytest.mark.django_db


@pytest.fixture
def user(django_user_model):
    return django_user_model.objects.create_user("alice")


def pending(user, count: int, shares: str = "0.5", **extra) -> list[ComputeSession]:
    """`count` sessions written PENDING (their on-commit scheduling is not run)."""
    return [services.session_create(owner=user, name=f"s{i}", resources={"cuda.shares": shares, **extra})
            for i in range(count)]


def node_of(session: ComputeSession) -> str:
    session.refresh_from_db()
    assert session.status == SessionStatus.SCHEDULED, session.status_reason
    return session.node.name


@pytest.mark.parametrize(("policy", "second"), [("binpack", "node-a"), ("spread", "node-b"), ("best-fit", "node-a")])
def test_the_default_groups_policy_decides_the_node(user, policy, second):
    make_cluster(nodes={"node-a": [mock_gpu(0)], "node-b": [mock_gpu(1)]})
    ResourceGroup.objects.create(name="default", policy=policy)
    first, other = pending(user, 2)
    schedule_pending()
    assert node_of(first) == "node-a"  # equal nodes: the first
    assert node_of(other) == second


def test_a_named_groups_fgd_policy_keeps_a_device_whole_for_the_shapes_it_has_seen(user):
    # node-a's device has 1.25 fGPU free, node-b's 2.00. The group has placed 1.0 fGPU requests
    # before; a 0.5 on node-a would leave 0.75, a fragment for them, so FGD takes node-b
    # (binpack would fill node-a).
    make_cluster(nodes={"node-a": [mock_gpu(0)], "node-b": [mock_gpu(1)]})
    group = ResourceGroup.objects.create(name="train", policy="fgd")
    Node.objects.update(resource_group=group)
    pending(user, 1, "0.75", resource_group="train")
    schedule_pending()
    assert ComputeSession.objects.get(name="s0").node.name == "node-a"
    PlacementShape.objects.filter(resource_group="train").update(count=50)
    PlacementShape.objects.filter(resource_group="train").update(key=PlacementShape.objects.get().key.replace(":3:", ":4:"))
    session = pending(user, 1, "0.5", resource_group="train")[0]
    schedule_pending()
    assert node_of(session) == "node-b"


def test_the_scheduler_counts_the_shapes_it_places_per_resource_group(user):
    make_cluster(nodes={"node-a": [mock_gpu(0)]})
    pending(user, 3, "0.5")
    schedule_pending()
    [row] = PlacementShape.objects.all()
    assert (row.resource_group, row.count) == ("", 3)
    assert row.key.startswith("cuda|0.25:") and "|span:" in row.key


def test_one_pass_locks_the_nodes_once_and_never_over_commits(user):
    make_cluster(nodes={"node-a": [mock_gpu(0)], "node-b": [mock_gpu(1)]})  # 2.00 fGPU each
    sessions = pending(user, 7, "0.75")
    with CaptureQueriesContext(connection) as queries:
        scheduled = schedule_pending()
    assert len(scheduled) == 4  # two 0.75 per device, the rest wait
    node_locks = [q for q in queries.captured_queries
                  if q["sql"].startswith('SELECT "accelerators_node"."id"') and "FOR UPDATE" in q["sql"]]
    assert len(node_locks) == 1
    for node in ("node-a", "node-b"):
        held = sum((a.shares for a in Allocation.objects.filter(device__node__name=node, released_at__isnull=True)),
                   Decimal(0))
        assert held == Decimal("1.5")
    waiting = [s for s in sessions if (s.refresh_from_db() or s.status) == SessionStatus.PENDING]
    assert len(waiting) == 3 and all("waiting for capacity" in s.status_reason for s in waiting)
