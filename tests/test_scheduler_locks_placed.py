"""A scheduler pass that reads its scope without locks (issue 35.2: it locks only the nodes and
devices it places on, as it writes there) never over-commits a device when another writer takes
the same room between its read and its write: the pass checks what it placed on as the database
then holds it, and is rolled back and run again where a plan no longer holds.

The race is made deterministic with two connections: a writer (a thread, its own connection)
locks the node's row first and holds it; the pass reads the node free, plans on it and queues
behind that lock (seen in pg_locks); the writer then writes a running session holding the whole
GPU and commits; the pass goes on. Real PostgreSQL, nothing mocked.
"""

from __future__ import annotations

import threading

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from accelerators.models import Device, Node
from sessions.admission.launch import session_create
from sessions.models import Allocation, ComputeSession, SessionStatus
from sessions.scheduling.scheduler import schedule_pending
from tests.seed import gpu_cluster
from tests.stack import wait_until
from tests.test_concurrency_processes import over_commits

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the pass reads without locks on PostgreSQL only"),
]

GiB = 1 << 30


def _lock_waiters() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' "
            "AND pid <> pg_backend_pid()"
        )
        return cursor.fetchone()[0]


class _Writer(threading.Thread):
    """Locks `node`'s row, says so (`locked`), waits until another transaction queues for a lock,
    then writes a RUNNING session of `owner` holding all of `device` and commits."""

    def __init__(self, *, node: Node, device: Device, owner) -> None:
        super().__init__(daemon=True)
        self.node, self.device, self.owner = node, device, owner
        self.locked = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with transaction.atomic():
                list(Node.objects.select_for_update().filter(pk=self.node.pk).values_list("pk", flat=True))
                self.locked.set()
                wait_until(lambda: _lock_waiters() > 0, timeout=60, what="the pass to queue behind the node's lock")
                taken = ComputeSession.objects.create(
                    owner=self.owner,
                    name="taken",
                    resources={},
                    request_spec={},
                    status=SessionStatus.RUNNING,
                    node=self.node,
                    cpu=1,
                    mem=64 << 20,
                )
                Allocation.objects.create(session=taken, device=self.device, shares="2", memory=8 * GiB, procs=80)
        except BaseException as exc:  # reported to the test
            self.error = exc
            self.locked.set()
        finally:
            connections.close_all()


def _waiting(owner) -> ComputeSession:
    """A PENDING session of 1 fGPU: launched while every node drains (the launch's own pass, run
    where it is asked in these tests, places nothing), the nodes back in service after."""
    Node.objects.update(drain_since=timezone.now())
    session = session_create(owner=owner, name="wants-one", resources={"cuda.shares": "1", "mem": "64M"})
    Node.objects.update(drain_since=None)
    assert ComputeSession.objects.get(pk=session.pk).status == SessionStatus.PENDING
    return session


def test_a_pass_that_read_a_gpu_free_does_not_place_on_it_once_another_writer_took_it_before_its_lock(
    django_user_model,
):
    gpu_cluster(nodes=1, gpus=1)  # one GPU of 2 fGPU
    owner = django_user_model.objects.create_user("racer")
    waiting = _waiting(owner)
    node = Node.objects.get()
    writer = _Writer(node=node, device=Device.objects.get(), owner=owner)
    writer.start()
    assert writer.locked.wait(60) and writer.error is None, writer.error

    placed = schedule_pending()  # reads the GPU free, plans on it, queues behind the writer's lock

    writer.join(60)
    assert writer.error is None, writer.error
    assert over_commits() == []
    assert placed == []
    waiting.refresh_from_db()
    assert waiting.status == SessionStatus.PENDING and "waiting for capacity" in waiting.status_reason
    assert not Allocation.objects.filter(session=waiting).exists()


def test_a_pass_whose_node_was_taken_places_on_another_with_room_in_the_same_call(django_user_model):
    gpu_cluster(nodes=2, gpus=1)
    owner = django_user_model.objects.create_user("racer")
    waiting = _waiting(owner)
    first = Node.objects.get(name="gpu-node-0")  # ties go to the first node by name
    writer = _Writer(node=first, device=Device.objects.get(node=first), owner=owner)
    writer.start()
    assert writer.locked.wait(60) and writer.error is None, writer.error

    placed = schedule_pending()

    writer.join(60)
    assert writer.error is None, writer.error
    assert over_commits() == []
    assert placed == [str(waiting.pk)]
    waiting.refresh_from_db()
    assert waiting.status == SessionStatus.SCHEDULED and waiting.node.name == "gpu-node-1"
