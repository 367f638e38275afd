"""Concurrent launches on real PostgreSQL never over-commit a device.

Sixteen threads, each with its own database connection, are released together by a barrier;
each creates a session (whose commit runs a scheduler pass, eager Celery) and then runs
another scheduler pass itself. The scheduler's row locks must serialise the passes so that
the live allocations never exceed what the devices hold.
"""
from __future__ import annotations

import threading
import time
from decimal import Decimal

import pytest
from django.db import connection
from django.db.models import Sum

from accelerators.models import Device, Node
from sessions.lifecycle import services
from sessions.admission import launch as admission
from sessions.models import Allocation, ComputeSession, SessionStatus
from sessions.scheduling.scheduler import schedule_pending
from tests.conftest import GiB, make_cluster, mock_gpu

pytestmark = pytest.mark.django_db(transaction=True)

THREADS = 16


def launch_together(users, shares: str) -> list[BaseException]:
    """Every user creates one session and runs a scheduler pass, all at once. Returns the
    exceptions raised in the threads."""
    barrier = threading.Barrier(len(users))
    errors: list[BaseException] = []

    def work(user):
        try:
            barrier.wait(timeout=30)
            admission.session_create(owner=user, name=f"{user.username}-s", resources={"cuda.shares": shares})
            schedule_pending()
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=work, args=(user,), name=f"launch-{user.username}") for user in users]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a launching thread is stuck (deadlock?)"
    return errors


@pytest.fixture
def users(django_user_model):
    return [django_user_model.objects.create_user(f"user{i}") for i in range(THREADS)]


def live_on(device) -> dict:
    return Allocation.objects.filter(device=device, released_at__isnull=True).aggregate(
        shares=Sum("shares", default=Decimal(0)), memory=Sum("memory", default=0), procs=Sum("procs", default=Decimal(0)))


def test_the_concurrency_tests_run_on_postgresql(db):
    assert connection.vendor == "postgresql"


def test_sixteen_simultaneous_half_fgpu_launches_schedule_exactly_four_on_one_2_fgpu_device(users):
    assert connection.vendor == "postgresql"
    make_cluster(nodes={"demo-node": [mock_gpu(0)]})

    errors = launch_together(users, "0.5")

    assert errors == []
    assert ComputeSession.objects.count() == THREADS
    assert ComputeSession.objects.filter(status=SessionStatus.SCHEDULED).count() == 4
    assert ComputeSession.objects.filter(status=SessionStatus.PENDING).count() == THREADS - 4
    [device] = Device.objects.all()
    live = live_on(device)
    assert live["shares"] == Decimal("2.0")
    assert live["memory"] <= 8 * GiB
    assert live["procs"] <= Decimal(80)
    assert Allocation.objects.count() == 4
    for session in ComputeSession.objects.filter(status=SessionStatus.SCHEDULED):
        assert [a.shares for a in session.allocations.all()] == [Decimal("0.5")]
    pending = ComputeSession.objects.filter(status=SessionStatus.PENDING).order_by("created_at", "pk")
    assert not Allocation.objects.filter(session__in=pending).exists()
    assert pending.first().status_reason.startswith("waiting for capacity")  # the FIFO head says why


def test_sixteen_simultaneous_launches_of_1_5_fgpu_on_two_devices_schedule_one_per_device(users):
    assert connection.vendor == "postgresql"
    make_cluster(nodes={"twin": [mock_gpu(0), mock_gpu(1)]})

    errors = launch_together(users, "1.5")

    assert errors == []
    assert ComputeSession.objects.filter(status=SessionStatus.SCHEDULED).count() == 2
    assert ComputeSession.objects.filter(status=SessionStatus.PENDING).count() == THREADS - 2
    devices = list(Device.objects.order_by("index"))
    assert len(devices) == 2
    for device in devices:
        live = live_on(device)
        assert live["shares"] == Decimal("1.5")
        assert live["memory"] <= 8 * GiB
        assert live["procs"] <= Decimal(80)
    total = Allocation.objects.filter(released_at__isnull=True).aggregate(s=Sum("shares"))["s"]
    assert total == Decimal("3.0")


def test_a_pass_waits_for_a_node_whose_inventory_is_changing_and_places_by_the_new_one(django_user_model):
    """The pass locks its nodes and devices before it reads their capacity: while an agent's
    re-registration shrinks a GPU (8 → 4 GiB, uncommitted, its node row locked), the pass waits
    for it and then judges by the smaller GPU (where 1.5 fGPU can never fit). Without those locks it read the old 8 GiB and
    placed 1.5 fGPU (6 GiB) on a 4 GiB GPU (the mutation that removed them survived the tests
    above: passes serialise on the pending sessions' locks first)."""
    from accelerators.services import node_inventory_apply

    make_cluster(nodes={"demo-node": [mock_gpu(0)]})
    user = django_user_model.objects.create_user("alice")
    Node.objects.filter(name="demo-node").update(status="LOST")  # the launch's own pass places nothing
    session = admission.session_create(owner=user, name="big", resources={"cuda.shares": "1.5"})
    Node.objects.filter(name="demo-node").update(status="ALIVE")
    node = Node.objects.get(name="demo-node")
    locked, go, errors = threading.Event(), threading.Event(), []

    def reregister():  # the agent, back with half the memory, its transaction held open
        from django.db import transaction
        try:
            with transaction.atomic():
                node_inventory_apply(node_name="demo-node", devices=[mock_gpu(0, memory=4 * GiB)],
                                     plugins=list(node.plugins), attributes=dict(node.attributes))
                locked.set()
                assert go.wait(timeout=30)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    def scheduler_pass():
        try:
            schedule_pending()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    agent = threading.Thread(target=reregister)
    agent.start()
    assert locked.wait(timeout=30)
    passing = threading.Thread(target=scheduler_pass)
    passing.start()

    def pass_waits_on_a_lock() -> bool:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND wait_event_type = 'Lock'")
            return cursor.fetchone()[0] > 0
    deadline = time.monotonic() + 10
    while passing.is_alive() and not pass_waits_on_a_lock() and time.monotonic() < deadline:
        passing.join(timeout=0.05)
    go.set()
    agent.join(timeout=60)
    passing.join(timeout=60)

    assert errors == []
    [device] = Device.objects.all()
    assert device.memory_size == 4 * GiB
    assert live_on(device)["memory"] <= device.memory_size
    session.refresh_from_db()
    assert not session.allocations.exists()
    assert (session.status, session.status_reason) == (
        SessionStatus.ERROR, "cuda.shares: 1.5 fGPU requested, but the largest any node can hold is 1.00 fGPU")
