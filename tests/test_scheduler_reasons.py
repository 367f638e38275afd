"""Every pending session gets an evaluated reason on each scheduler pass, however long the
queue (issue 12: the pass looked at 100 and left the rest "waiting for the scheduler"), and the
pass's database work does not grow with the number of sessions of one request shape."""
from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from sessions.lifecycle import services
from sessions.admission import launch as admission
from sessions.models import ComputeSession, SessionStatus
from sessions.scheduling.scheduler import schedule_pending

pytestmark = pytest.mark.django_db


def queue(owner, count: int, shares: str = "1.0") -> None:
    """`count` sessions written PENDING as a launch writes them (its own pass not run: no commit here)."""
    for i in range(count):
        admission.session_create(owner=owner, name=f"q{i}", resources={"cuda.shares": shares})


def test_a_queue_of_250_gets_250_evaluated_reasons_in_one_pass(demo_cluster, alice):
    queue(alice, 250)  # the demo GPU holds two sessions of 1.0 fGPU
    placed = schedule_pending()
    assert len(placed) == 2
    waiting = ComputeSession.objects.filter(status=SessionStatus.PENDING)
    assert waiting.count() == 248
    reasons = set(waiting.values_list("status_reason", flat=True))
    assert reasons and all(r.startswith(("waiting for capacity:", "queued behind")) for r in reasons), reasons


def test_a_pass_makes_as_many_queries_for_250_sessions_of_one_shape_as_for_25(demo_cluster, alice, bob):
    def queries_of_a_pass(owner, count: int) -> int:
        ComputeSession.objects.all().delete()
        queue(owner, count, shares="4.0")  # never fits now (2 fGPU GPU); fits a larger node, so not refused
        with CaptureQueriesContext(connection) as captured:
            schedule_pending()
        return len(captured)

    from accelerators.services import node_inventory_apply
    from tests.conftest import GiB, mock_gpu

    node_inventory_apply(node_name="big-node", devices=[mock_gpu(i, memory=16 * GiB, sms=160) for i in (1, 2)],
                         plugins=["ai.backend.accelerator.mock"], attributes={}, cpu_count=8, memory_size=32 * GiB)
    from accelerators.models import Node, NodeStatus

    Node.objects.filter(name="big-node").update(status=NodeStatus.LOST)  # 4 fGPU could fit there once it is back
    few, many = queries_of_a_pass(alice, 25), queries_of_a_pass(bob, 250)
    assert many <= few + 2, (few, many)
    assert not ComputeSession.objects.filter(status_reason="waiting for the scheduler").exists()
