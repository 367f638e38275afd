"""The kept cluster view (accelerators/cluster_view.py, issue 35.1) on PostgreSQL: it reads the
same nodes as `node_states` at every step of a session's life, reloads only the nodes the change
log names, never keeps what a transaction wrote before it commits, and the launch's "ever fits"
check sees one node of each kind."""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from accelerators import cluster_view
from accelerators.allocation.requests import parse_resources
from accelerators.models import Device, Node, NodeStatus, ResourceGroup
from accelerators.selectors import node_states
from tests.seed import gpu_cluster

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif("connection.vendor != 'postgresql'", reason="the change log is PostgreSQL's"),
]


def kept(**kwargs):
    return cluster_view.view_node_states(slot_name="cuda", **kwargs)


def read(**kwargs):
    return node_states(slot_name="cuda", kept=False, **kwargs)


@pytest.fixture
def view():
    cluster_view.cluster_view().forget()
    return cluster_view.cluster_view()


def test_the_view_reads_what_node_states_reads_through_launch_placement_and_end(view, alice):
    from sessions.admission.launch import session_create
    from sessions.lifecycle.services import session_report_apply
    from sessions.scheduling.scheduler import schedule_pending

    gpu_cluster(nodes=4, gpus=2)
    assert kept() == read() and kept(usage=False) == read(usage=False)
    sessions = [session_create(owner=alice, name=f"s{i}", resources={"cuda.shares": "0.75", "mem": "64M"}) for i in range(5)]
    schedule_pending()
    assert kept() == read()
    assert any(d.memory_used for n in kept() for d in n.devices)
    session_report_apply(session_id=str(sessions[0].pk), status="TERMINATED", reason="done", exit_code=0)
    Node.objects.filter(name="gpu-node-1").update(status=NodeStatus.LOST)
    assert kept() == read() and kept(alive_only=False) == read(alive_only=False)


def test_a_change_reloads_only_the_nodes_it_touched(view):
    gpu_cluster(nodes=20, gpus=2)
    kept()
    reads, reloaded = view.reads, view.reloaded
    Device.objects.filter(node__name="gpu-node-3", index=0).update(memory_size=16 << 30)
    assert kept() == read()
    assert (view.reads, view.reloaded) == (reads, reloaded + 1)
    Node.objects.filter(name="gpu-node-4").update(last_heartbeat="2026-01-01T00:00Z")  # a heartbeat: not a change
    kept()
    assert (view.reads, view.reloaded) == (reads, reloaded + 1)


def test_a_resource_group_change_reads_everything_again(view):
    gpu_cluster(nodes=3, gpus=1)
    group = ResourceGroup.objects.create(name="fast")
    Node.objects.filter(name="gpu-node-0").update(resource_group=group)
    assert kept(group=group) == read(group=group) and len(kept(group=group)) == 1
    reads = view.reads
    ResourceGroup.objects.filter(pk=group.pk).update(weight_memory=3)
    assert kept(group=ResourceGroup.objects.get(pk=group.pk)) == read(group=ResourceGroup.objects.get(pk=group.pk))
    assert view.reads == reads + 1


def test_what_a_transaction_wrote_is_never_kept_when_it_rolls_back(view):
    gpu_cluster(nodes=2, gpus=1)
    before = kept()

    class Undo(Exception):
        pass

    with pytest.raises(Undo), transaction.atomic():
        Node.objects.filter(name="gpu-node-0").update(cpu_count=1)
        inside = {n.node_id: n for n in kept()}
        assert inside["gpu-node-0"].cpu_total == 1  # its own write, for itself
        raise Undo
    assert kept() == before == read()


def test_a_write_committed_after_a_later_one_is_still_seen(view):
    """Log ids are handed out before commit: a transaction holding a smaller id that commits
    after a read that saw a larger one is read at the next use (by txid, not by id)."""
    import threading

    gpu_cluster(nodes=2, gpus=1)
    kept()
    slow_wrote, go_on = threading.Event(), threading.Event()

    def slow():
        try:
            with transaction.atomic():
                Node.objects.filter(name="gpu-node-0").update(cpu_count=3)
                slow_wrote.set()
                go_on.wait(30)
        finally:
            connection.close()

    writer = threading.Thread(target=slow)
    writer.start()
    assert slow_wrote.wait(30)
    Node.objects.filter(name="gpu-node-1").update(cpu_count=5)  # a larger log id, committed first
    assert {n.node_id: n.cpu_total for n in kept()} == {"gpu-node-0": 256, "gpu-node-1": 5}
    go_on.set()
    writer.join()
    assert {n.node_id: n.cpu_total for n in kept()} == {"gpu-node-0": 3, "gpu-node-1": 5}


def test_the_launch_checks_one_node_of_each_kind(view):
    gpu_cluster(nodes=8, gpus=8)
    gpu_cluster(nodes=2, gpus=4, prefix="small")
    request = parse_resources({"cuda.shares": "2"})
    nodes = cluster_view.ever_fits_nodes(request, group=None)
    assert sorted(n.node_id for n in nodes) == ["gpu-node-0", "small-0"]
    pinned = parse_resources({"cuda.shares": "1", "devices": ["GPU-00000001-0000-0000-0000-000000000000"]})
    assert len(cluster_view.ever_fits_nodes(pinned, group=None)) == 10


def test_rows_a_read_saw_are_not_read_again_while_an_old_transaction_holds_the_horizon(view):
    """The horizon is the oldest transaction still open anywhere on the server: while one stays
    open, each use reads only the log rows the last one could not see, not every row since it
    (issue 35.2: a thousand nodes' rows read again at every launch)."""
    import threading

    gpu_cluster(nodes=2, gpus=1)
    kept()
    holding, release = threading.Event(), threading.Event()

    def hold():
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SELECT pg_current_xact_id()")  # an xid: it holds every snapshot's xmin back
                holding.set()
                release.wait(30)
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(30)
        Node.objects.filter(name="gpu-node-0").update(cpu_count=3)
        reloaded = view.reloaded
        assert {n.node_id: n.cpu_total for n in kept()} == {"gpu-node-0": 3, "gpu-node-1": 256}
        assert view.reloaded == reloaded + 1
        _, _, again, _, _ = cluster_view._changes_since(view.horizon, last=view.last)
        _, _, everything, _, _ = cluster_view._changes_since(view.horizon)
        assert again == [] and len(everything) >= 1  # the row is still above the horizon, and not read again
        Node.objects.filter(name="gpu-node-1").update(cpu_count=5)
        assert (
            {n.node_id: n.cpu_total for n in kept()}
            == {"gpu-node-0": 3, "gpu-node-1": 5}
            == {n.node_id: n.cpu_total for n in read()}
        )
        assert view.reloaded == reloaded + 2
    finally:
        release.set()
        holder.join()
