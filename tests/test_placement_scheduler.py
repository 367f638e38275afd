"""The database-backed scheduler with placement policies: a resource group's policy decides the
node, one pass reads (and locks) each scope once and never over-commits, and the request shapes
it places are counted per group for the fragmentation-aware policies.
"""
from __future__ import annotations

import asyncio
import re
from decimal import Decimal

import pytest
from channels.layers import get_channel_layer
from django.db import connection
from django.test.utils import CaptureQueriesContext

from accelerators.models import Node, PlacementShape, ResourceGroup
from sessions.lifecycle import events
from sessions.lifecycle import services
from sessions.admission import launch as admission
from sessions.models import Allocation, ComputeSession, SessionStatus
from sessions.scheduling.scheduler import _send_starts, schedule_pending
from tests.conftest import make_cluster, mock_gpu

pytestmark = pytest.mark.django_db


@pytest.fixture
def user(django_user_model):
    return django_user_model.objects.create_user("alice")


def pending(user, count: int, shares: str = "0.5", **extra) -> list[ComputeSession]:
    """`count` sessions written PENDING (their on-commit scheduling is not run)."""
    first = ComputeSession.objects.filter(owner=user).count()  # names apart from the user's earlier ones
    return [admission.session_create(owner=user, name=f"s{first + i}", resources={"cuda.shares": shares, **extra})
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


def test_a_pass_sends_each_sessions_update_to_its_page_its_owner_and_staff_after_commit_in_one_batch(
        user, django_capture_on_commit_callbacks):
    make_cluster(nodes={"node-a": [mock_gpu(0)]})  # 2.00 fGPU
    placed, waiting = pending(user, 2, "1.5")
    layer = get_channel_layer()

    async def join() -> str:
        channel = await layer.new_channel()
        for group in (events.session_group(placed.pk), events.session_group(waiting.pk), events.user_group(user.pk),
                      events.STAFF_GROUP):
            await layer.group_add(group, channel)
        return channel

    async def frames(channel: str, count: int) -> list[dict]:
        got = []
        async with asyncio.timeout(10):
            while len(got) < count:
                message = await layer.receive(channel)
                if message["session"]["id"] in (str(placed.pk), str(waiting.pk)):  # the layer may be shared
                    got.append(message)
        return got

    channel = asyncio.run(join())
    with CaptureQueriesContext(connection) as queries:
        with django_capture_on_commit_callbacks(execute=True) as callbacks:
            schedule_pending()
    updates = asyncio.run(frames(channel, 6))  # 2 sessions × (page, owner, staff)
    assert [(u["type"], u["session"]["id"], u["session"]["status"]) for u in updates] == \
        [("session.update", str(placed.pk), "SCHEDULED")] * 3 + [("session.update", str(waiting.pk), "PENDING")] * 3
    assert updates[0]["session"]["node"] == "node-a" and updates[0]["session"]["allocations"][0]["shares"] == "1.500"
    assert "waiting for capacity" in updates[3]["session"]["status_reason"]
    # One query reads both sessions for the notices; one callback sends the start messages.
    reads = [q for q in queries.captured_queries if q["sql"].startswith('SELECT "compute_sessions_computesession"')
             and "FOR UPDATE" not in q["sql"]]
    assert len(reads) == 1
    [starts] = [cb for cb in callbacks if getattr(cb, "func", None) is _send_starts]
    [(node, spec)] = starts.args[0]
    assert node == "node-a" and spec["session_id"] == str(placed.pk) and spec["devices"][0]["shares"] == "1.5"


def test_a_pass_logs_one_line_with_its_counts_and_the_durations_of_its_phases(user, caplog):
    make_cluster(nodes={"n1": [mock_gpu(0)]})  # one 8 GiB GPU: 2 fGPU at unit_mem 4 GiB
    pending(user, 3, shares="1")

    with caplog.at_level("INFO", logger="sessions.scheduling.scheduler"):
        schedule_pending()

    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("scheduler pass:")]
    assert len(lines) == 1, lines
    found = re.fullmatch(r"scheduler pass: 3 pending, 2 placed, 1 waiting, 0 preempted \(1 request shapes without room\) "
                         r"in (\d+) ms \(read (\d+), scopes (\d+), decide (\d+), preempt (\d+), write (\d+), commit (\d+)\)",
                         lines[0])
    assert found, lines[0]
    total, *phases = map(int, found.groups())
    assert abs(total - sum(phases)) <= len(phases), (total, phases)  # the phases add up to the pass (rounding)


def test_node_states_without_usage_read_the_inventory_as_free_for_the_launchs_admission(user):
    """What a node could ever hold needs no sums over its sessions and allocations (the launch's
    admission, `placement_decide` without a view, reads it so); the scheduler's read sums them."""
    from accelerators.selectors import node_states

    make_cluster(nodes={"node-a": [mock_gpu(0)]})
    session = pending(user, 1, "0.5", cpu=2)[0]
    schedule_pending()
    assert node_of(session) == "node-a"

    [used] = node_states(slot_name="cuda")
    [free] = node_states(slot_name="cuda", usage=False)

    assert (used.cpu_used, used.devices[0].sessions) == (2, 1) and used.devices[0].memory_used > 0
    assert (free.cpu_used, free.mem_used, free.devices[0].sessions, free.devices[0].memory_used) == (0, 0, 0, 0)
    assert free.devices[0].proc_used == 0 and (free.cpu_total, free.devices[0].memory_total) == (
        used.cpu_total, used.devices[0].memory_total)
    with CaptureQueriesContext(connection) as captured:  # the database read; the kept view sums changed nodes only
        node_states(slot_name="cuda", usage=False, kept=False)
    assert not [q["sql"] for q in captured if "SUM(" in q["sql"].upper()]
