"""MIG requests planned on the scheduler pass's in-memory view (issue 34.4): the pass reads a MIG
scope once (rows locked) and keeps it current with its own placements, MIG and shared alike,
instead of flushing its writes and re-reading the database for each MIG request; the MIG
rows are written with the pass's other writes. Real PostgreSQL, queries counted."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from accelerators.models import GpuInstance, MigMode, Node
from accelerators.plugins.base import DeviceInfo
from sessions.models import Allocation, ComputeSession, SessionStatus
from sessions.scheduling.scheduler import _send_starts, schedule_pending
from sessions.admission.launch import session_create
from tests.conftest import GiB, make_cluster, mock_gpu

pytestmark = pytest.mark.django_db


def h100(index: int) -> DeviceInfo:
    uuid = f"GPU-a1000000-0000-0000-0000-00000000000{index}"
    return DeviceInfo(
        slot_name="cuda",
        device_id=uuid,
        index=index,
        mother_uuid=uuid[4:],
        model_name="H100-80GB",
        numa_node=0,
        subproc_count=132,
        memory_size=80 * GiB,
    )


def mig_and_shared_nodes(*, cpu: int = 64) -> None:
    """ "mig-node" (two H100s, dynamic MIG) and "gpu-node" (two 8 GiB GPUs, 2 fGPU each), `cpu`
    cores each."""
    make_cluster(nodes={"mig-node": [h100(0), h100(1)], "gpu-node": [mock_gpu(0), mock_gpu(1)]}, cpu=cpu)
    Node.objects.filter(name="mig-node").update(mig_mode=MigMode.DYNAMIC)


def launch(owner, count: int, resources: dict, prefix: str) -> list[ComputeSession]:
    return [session_create(owner=owner, name=f"{prefix}{i}", resources={**resources, "mem": "64M"}) for i in range(count)]


def pass_queries(alice, *, mig: int, shared: int) -> int:
    """The queries of one pass placing `mig` 1g.20gb MIG sessions and `shared` 0.5 fGPU ones,
    launched alternately; every one is placed."""
    for i in range(max(mig, shared)):
        if i < mig:
            launch(alice, 1, {"gpu_memory": "15G", "isolation": "mig"}, f"m{i}-")
        if i < shared:
            launch(alice, 1, {"cuda.shares": "0.5"}, f"s{i}-")
    with CaptureQueriesContext(connection) as queries:
        placed = schedule_pending()
    assert len(placed) == mig + shared
    return len(queries)


# Measured on PostgreSQL before the change (a flush and a full MIG read per MIG request, every
# scope read again after it): 1 MIG + 1 shared → 35 queries, 8 MIG + 8 shared → 203 (+24 a pair).
# After: 35 and 63 (+4 a pair: the MIG session's GpuInstance and Allocation rows written, its GPU's
# layout read for its agent's start, its shared neighbour's share of the bulk statements).
# Since issues 36.5 and 37.3 a pass also reads the folders shared with the owners it starts sessions for
# (sessions.policy.shares, once a flush) and the kept cluster view's change log (issue 35.1): 39 and 67.
# Since issue 35.2 the shared scope is read without locks (two statements fewer) and the pass locks
# the nodes it placed on (one more) and reads them again before its commit (the log and the nodes'
# rows: four more), once a pass: 42.
QUERIES_ONE_PAIR = 42
QUERIES_PER_MORE_PAIR = 4


def test_a_pass_with_one_mig_and_one_shared_request_reads_each_scope_once(alice):
    mig_and_shared_nodes()
    assert pass_queries(alice, mig=1, shared=1) <= QUERIES_ONE_PAIR


def test_each_more_mig_request_of_a_pass_costs_only_its_own_rows(alice):
    mig_and_shared_nodes()
    assert pass_queries(alice, mig=8, shared=8) <= QUERIES_ONE_PAIR + 7 * QUERIES_PER_MORE_PAIR


def test_mig_requests_of_one_pass_take_distinct_slices_and_are_all_written(alice, django_capture_on_commit_callbacks):
    mig_and_shared_nodes()
    sessions = launch(alice, 9, {"gpu_memory": "15G", "isolation": "mig"}, "m")  # 4 1g.20gb a GPU: one waits
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        placed = schedule_pending()
    assert len(placed) == 8
    starts = [pair for cb in callbacks if getattr(cb, "func", None) is _send_starts for pair in cb.args[0]]
    assert [spec["session_id"] for _, spec in starts] == placed  # the agents' starts in placement order
    instances = list(GpuInstance.objects.order_by("parent__index", "placement_start"))
    assert len(instances) == 8 and len({(i.parent_id, i.placement_start) for i in instances}) == 8
    assert {str(i.session_id) for i in instances} == set(placed)
    layouts = {spec["mig"]["gpu"]: len(spec["mig"]["layout"]) for _, spec in starts}
    assert sorted(layouts.values()) == [4, 4]  # the last start of each GPU names all its instances
    waiting = [s for s in sessions if str(s.pk) not in placed]
    waiting[0].refresh_from_db()
    assert waiting[0].status == SessionStatus.PENDING and "waiting for capacity" in waiting[0].status_reason
    for session in sessions:
        session.refresh_from_db()
    assert all("MIG instance" in s.status_reason for s in sessions if str(s.pk) in placed)


def mig_node_alone(cpu: int) -> None:
    """ "mig-node" alone (two H100s, dynamic MIG: no fGPU there) with `cpu` cores."""
    make_cluster(nodes={"mig-node": [h100(0), h100(1)]}, cpu=cpu)
    Node.objects.filter(name="mig-node").update(mig_mode=MigMode.DYNAMIC)


def test_the_cores_a_mig_session_takes_in_a_pass_are_not_given_again_to_a_later_session(alice):
    mig_node_alone(cpu=4)
    first = launch(alice, 1, {"cpu": 1}, "c")[0]  # CPU only: its scope is read first
    mig_session = launch(alice, 1, {"gpu_memory": "15G", "isolation": "mig", "cpu": 2}, "m")[0]
    last = launch(alice, 1, {"cpu": 2}, "d")[0]  # 1 + 2 of 4 cores taken: no room
    assert schedule_pending() == [str(first.pk), str(mig_session.pk)]
    last.refresh_from_db()
    assert last.status == SessionStatus.PENDING and "waiting for capacity" in last.status_reason


def test_the_cores_a_session_takes_in_a_pass_are_not_given_again_to_a_later_mig_request(alice):
    mig_node_alone(cpu=3)
    first = launch(alice, 1, {"gpu_memory": "15G", "isolation": "mig", "cpu": 1}, "m")[0]  # the MIG scope read first
    second = launch(alice, 1, {"cpu": 1}, "c")[0]
    last = launch(alice, 1, {"gpu_memory": "15G", "isolation": "mig", "cpu": 2}, "n")[0]  # 2 of 3 cores taken
    assert schedule_pending() == [str(first.pk), str(second.pk)]
    last.refresh_from_db()
    assert last.status == SessionStatus.PENDING and "not enough CPU cores" in last.status_reason
    assert GpuInstance.objects.count() == 1 and not Allocation.objects.filter(session=last).exists()
