"""The kept read of the queue and its replays (issue 35.2): ETAs and what-ifs asked again before a
change are answered from it, and a change — a session ends, a node is drained — is seen by the
next answer (no stale kept replay). The fragmentation map judged once per kind of node is the
pure map's."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from accelerators.allocation import compaction, core
from accelerators.drain import node_drain
from sessions.admission.launch import session_create
from sessions.lifecycle.services import session_report_apply
from sessions.models import SessionStatus
from sessions.scheduling import compaction as kept_map
from sessions.scheduling import eta
from tests.seed import make_cluster, mock_gpu
from tests.test_eta import WHOLE, one_gpu, running, waiting  # noqa: F401 (a fixture)

GiB = 1 << 30


@pytest.fixture
def two_gpus(db):
    """Nodes n1 and n2 with one 8 GiB GPU (2 fGPU) each; a maximum lifetime of 2 h."""
    from usage.models import IdlePolicy

    make_cluster(nodes={"n1": [mock_gpu(0)], "n2": [mock_gpu(0, node=1)]})
    IdlePolicy.objects.create(resource_group=None, max_lifetime=7200)


def replays_made(call) -> tuple[object, int]:
    """`call()`'s answer and how many replays of the queue it began."""
    made = []
    original = eta._Queue._new_replay

    def counted(self, *, late):
        made.append(late)
        return original(self, late=late)

    eta._Queue._new_replay = counted
    try:
        return call(), len(made)
    finally:
        eta._Queue._new_replay = original


def test_an_eta_asked_again_is_the_kept_answer_and_a_session_ending_is_seen_by_the_next(one_gpu, alice, bob):  # noqa: F811
    holder = running(bob, minutes_ago=30)
    mine = waiting(alice, "mine")
    first, replays = replays_made(lambda: eta.session_eta(session=mine))
    assert replays == 1 and not first.fits_now and first.outcome == "estimate"  # lifetimes: one way (Queue.one_way)

    again, replays = replays_made(lambda: eta.session_eta(session=mine))
    assert replays == 0 and again == first

    session_report_apply(session_id=str(holder.pk), status=SessionStatus.TERMINATED, exit_code=0)

    after, replays = replays_made(lambda: eta.session_eta(session=mine))
    assert replays == 1 and after.fits_now and after.outcome == "now" and after.fits_after == ()


def test_a_node_drained_is_seen_by_the_next_eta_though_no_session_changed(two_gpus, alice, bob):
    holder = running(bob, minutes_ago=30)
    mine = session_create(owner=alice, name="mine", resources=WHOLE)  # no pass runs after it: it waits
    free = "n2" if holder.node.name == "n1" else "n1"
    before = eta.session_eta(session=mine)
    assert before.fits_now and before.outcome == "now"

    node_drain(node_name=free)

    after = eta.session_eta(session=mine)
    assert not after.fits_now and after.outcome == "estimate"
    assert [f.session.pk for f in after.fits_after] == [holder.pk]


def test_a_what_if_asked_again_is_kept_and_a_drain_since_is_seen(two_gpus, alice, bob):
    on_a = running(bob, name="on-a", minutes_ago=30)
    running(bob, name="on-b", minutes_ago=60)
    later = waiting(alice, "later")

    first, replays = replays_made(lambda: eta.scheduler_what_if(policies={"": "spread"}))
    assert replays == 2  # today's and the changed queue's (each one way: lifetimes only)
    again, replays = replays_made(lambda: eta.scheduler_what_if(policies={"": "spread"}))
    assert replays == 0 and again is first
    assert [r.session.pk for r in first.rows] == [later.pk]

    node_drain(node_name=on_a.node.name)  # the drained node takes no new session: today's answer changes

    after, replays = replays_made(lambda: eta.scheduler_what_if(policies={"": "spread"}))
    assert replays == 2 and after is not first
    assert after.computed_at >= first.computed_at


def test_a_queue_whose_ends_are_a_band_replays_both_ways(one_gpu, alice, bob):  # noqa: F811
    from usage.models import IdlePolicy

    IdlePolicy.objects.filter(resource_group=None).update(idle_timeout=600)  # interactive: idle end … lifetime
    running(bob, minutes_ago=30)
    mine = waiting(alice, "mine")

    answer, replays = replays_made(lambda: eta.session_eta(session=mine))

    assert replays == 2 and answer.outcome == "estimate" and answer.earliest < answer.latest


def test_a_kept_eta_reads_only_the_stamps(one_gpu, alice, bob):  # noqa: F811
    running(bob, minutes_ago=30)
    mine = waiting(alice, "mine")
    eta.session_eta(session=mine)

    with CaptureQueriesContext(connection) as queries:
        eta.session_eta(session=mine)

    assert len(queries.captured_queries) <= 3, [q["sql"][:120] for q in queries.captured_queries]


def node(name: str, used: list[tuple[int, str, int]], *, links: bool = False) -> core.NodeState:
    """A node of four 8 GiB / 80-SM GPUs; `used`: (device, SMs held, sessions) per busy device."""
    busy = {i: (Decimal(sms), n) for i, sms, n in ((i, s, n) for i, s, n in used)}
    devices = tuple(
        core.DeviceState(
            device_id=f"{name}-dev{i}",
            memory_total=8 * GiB,
            proc_total=80,
            memory_used=int(busy[i][0] / 80 * 8 * GiB) if i in busy else 0,
            proc_used=busy[i][0] if i in busy else Decimal(0),
            sessions=busy[i][1] if i in busy else 0,
            numa_node=i // 2,
            uuid=f"GPU-{name}-{i}",
            index=i,
        )
        for i in range(4)
    )
    found = ()
    if links:
        from accelerators.allocation import topology

        found = (topology.Link(a=f"{name}-dev0", b=f"{name}-dev1", kind="NVLINK", count=4),)
    return core.NodeState(node_id=name, cpu_total=64, mem_total=256 * GiB, devices=devices, links=found)


def test_the_map_judged_once_per_kind_of_node_is_the_pure_maps():
    settings = core.FractionalSettings(unit_mem=4 * GiB, unit_proc=40, quantum=Decimal("0.25"))
    nodes = [
        node("a", []),
        node("b", [(0, "60", 1)]),
        node("c", [(0, "60", 1)]),  # like b
        node("d", [(0, "80", 1), (1, "70", 2), (2, "10", 1)], links=True),
        node("e", [(3, "60", 1)]),
        node("f", [(i, "80", 1) for i in range(4)]),
        node("g", [(1, "70", 2), (2, "10", 1), (0, "80", 1)]),  # d without its NVLink
    ]
    shapes = [
        core.ResourceRequest("shares", amount=Decimal("1.5")),
        core.ResourceRequest("shares", amount=Decimal("4")),
        core.ResourceRequest("device", amount=Decimal(2)),
    ]
    for options in ({"policy": "fgd-plus"}, {"policy": "binpack"}):
        kept_map._map_kept.clear()
        expected = compaction.fragmentation_map(nodes, settings, shapes=shapes, options=options)
        assert kept_map.fragmentation_map_kept(nodes, settings, shapes=shapes, options=options) == expected
        assert len(kept_map._map_kept) == 6  # b and c are one kind
        assert kept_map.fragmentation_map_kept(nodes, settings, shapes=shapes, options=options) == expected
    assert any(d.stranded for d in expected.devices) and expected.largest_shape is not None


def test_the_report_lists_the_mig_gpus_every_alive_node_holds(db):
    from accelerators.mig_selectors import mig_gpu_layouts
    from accelerators.models import Device, Node, NodeStatus
    from tests.seed import gpu_cluster

    gpu_cluster(nodes=3, gpus=2, mig_gpus=2)
    Device.objects.filter(node__name="gpu-node-1", index=1).update(mig_catalog={"x": 1})  # a catalog its agent read

    report = kept_map.fragmentation_report(group=None)

    every = mig_gpu_layouts(nodes=Node.objects.filter(status=NodeStatus.ALIVE))
    assert [(g.node.name, g.device.index) for g in report.mig] == [(g.node.name, g.device.index) for g in every]
    assert {g.node.name for g in report.mig} == {"mig-node"}  # gpu-node-1's catalog is no valid one: not listed


def test_a_replay_made_only_as_far_as_asked_gives_each_session_the_whole_replays_start():
    from accelerators.allocation import replay as pure
    from tests.test_eta import NOW, Gpus

    sizes = {f"q{i}": 1 + (i * 7) % 4 for i in range(40)} | {"huge": 9}
    held = {"r1": 3, "r2": 2, "r3": 1}
    ends = {"r1": NOW + 600.0, "r2": NOW + 60.0, "r3": None}

    def queue():
        return [pure.Queued(k, str(v), runtime=100.0 * (1 + i % 5)) for i, (k, v) in enumerate(sizes.items())]

    whole = pure.replay(queue(), ends=ends, room=Gpus(8, sizes | held, held), now=NOW, backfill_limit=2).starts
    asked = []

    class Counting(Gpus):
        def place(self, key):
            asked.append(key)
            return super().place(key)

    lazy = pure.Replaying(queue(), ends=ends, room=Counting(8, sizes | held, held), now=NOW, backfill_limit=2)
    assert lazy.start("q0") == whole["q0"] and asked == ["q0"]  # the head: its own placement only
    for key in reversed(list(sizes)):
        assert lazy.start(key) == whole[key], key
    assert lazy.start("nobody") is None
    assert lazy.finish().starts == whole
    assert {s.outcome for s in whole.values()} >= {pure.PLACED, pure.NEVER}


def test_a_kept_map_is_made_again_when_the_slots_settings_change(db):
    from accelerators.models import FractionalSettings
    from tests.seed import gpu_cluster

    gpu_cluster(nodes=2, gpus=2)
    first = kept_map.fragmentation_report_kept(group=None)
    assert kept_map.fragmentation_report_kept(group=None) is first  # nothing changed: the kept report

    FractionalSettings.objects.filter(slot_name="cuda").update(unit_mem=2 * GiB, unit_proc=20)  # 4 fGPU a GPU

    after = kept_map.fragmentation_report_kept(group=None)
    assert after is not first and after.map.free == 2 * first.map.free
