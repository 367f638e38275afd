"""Backfill with reservations (issue 32.1): a session passed FGPU_BACKFILL_LIMIT times holds only
the capacity it can use (its resource group, pins), from when the sessions there are expected to
end, and later sessions start anywhere they do not delay it. Real PostgreSQL, the real pass."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from accelerators.allocation import core
from accelerators.allocation import replay as pure
from accelerators.allocation.errors import InsufficientResource
from accelerators.allocation.reservation import EARLIER, Holding, Reservations, clock, reservation_find
from accelerators.models import Node, ResourceGroup
from sessions.scheduling import eta
from sessions.lifecycle import services
from sessions.admission import launch as admission
from sessions.models import Allocation, ComputeSession, SessionStatus
from sessions.scheduling.scheduler import schedule_pending
from tests.conftest import client_for, make_running
from tests.seed import make_cluster, mock_gpu

pytestmark = pytest.mark.django_db

A0, A1 = mock_gpu(0, node=0).device_id, mock_gpu(1, node=0).device_id  # node-a's GPUs' UUIDs


@pytest.fixture
def two_nodes():
    """node-a and node-b, two whole GPUs each (discrete mode)."""
    return make_cluster(nodes={"node-a": [mock_gpu(0, node=0), mock_gpu(1, node=0)],
                               "node-b": [mock_gpu(0, node=1), mock_gpu(1, node=1)]}, mode="discrete")


def launch(owner, name: str, **resources) -> ComputeSession:
    return admission.session_create(owner=owner, name=name, resources={"cuda.device": 1, **resources})


def state(session: ComputeSession) -> ComputeSession:
    session.refresh_from_db()
    return session


def running(owner, name: str, **resources) -> ComputeSession:
    session = launch(owner, name, **resources)
    schedule_pending()
    assert state(session).status == SessionStatus.SCHEDULED, session.status_reason
    return make_running(session)


def gpus_of(session: ComputeSession) -> set[str]:
    return {a.device.device_id for a in Allocation.objects.filter(session=session).select_related("device")}


def test_a_user_who_pins_a_request_to_a_busy_gpu_through_the_api_does_not_stall_anyone_else(
        two_nodes, alice, bob, settings):
    settings.FGPU_BACKFILL_LIMIT = 0  # the harshest limit: a waiting session reserves at once
    running(alice, "busy", devices=[A0])  # node-a's GPU 0, no known end

    response = client_for(bob).post("/api/v1/sessions/", {"name": "stall", "resources": {"cuda.device": 1, "devices": [A0]}},
                                    format="json")
    assert response.status_code == 201, response.content
    stall = ComputeSession.objects.get(name="stall", owner=bob)
    others = [launch(alice, f"fits-{i}") for i in range(3)]
    assert [eta.session_eta(session=s, now=timezone.now()).outcome for s in others] == ["now"] * 3  # the ETA agrees
    schedule_pending()

    assert state(stall).status == SessionStatus.PENDING
    assert stall.overtaken == 3 and "reserved GPU 0 on node-a for it" in stall.status_reason
    assert "no known end" in stall.status_reason  # the busy session has no declared end
    assert all(state(s).status == SessionStatus.SCHEDULED for s in others), [s.status_reason for s in others]
    assert set().union(*(gpus_of(s) for s in others)) == {A1, mock_gpu(0, node=1).device_id, mock_gpu(1, node=1).device_id}

    version = stall.version
    schedule_pending()
    assert state(stall).version == version  # the same reservation next pass: nothing written, no notice

    late = launch(alice, "full")  # every GPU taken now: it waits for capacity, not behind bob's request
    schedule_pending()
    assert state(late).status == SessionStatus.PENDING
    assert late.status_reason.startswith("waiting for capacity") and "stall" not in late.status_reason


def test_a_session_waiting_in_another_resource_group_holds_only_that_groups_gpus(two_nodes, alice, settings):
    settings.FGPU_BACKFILL_LIMIT = 1
    Node.objects.filter(name="node-a").update(resource_group=ResourceGroup.objects.create(name="train"))
    Node.objects.filter(name="node-b").update(resource_group=ResourceGroup.objects.create(name="other"))
    running(alice, "busy", resource_group="train")  # one of node-a's GPUs, no known end
    big = launch(alice, "big", resource_group="train", **{"cuda.device": 2})
    first = launch(alice, "first", resource_group="other")  # passes big: big is overtaken once, then reserves node-a's GPUs
    behind_in_train = launch(alice, "train-small", resource_group="train")
    elsewhere = launch(alice, "second", resource_group="other")  # (one owner: the queue is in arrival order, no fair share)
    schedule_pending()

    assert state(big).status == SessionStatus.PENDING and "reserved GPU 0-1 on node-a for it" in big.status_reason
    assert state(first).status == SessionStatus.SCHEDULED and state(elsewhere).status == SessionStatus.SCHEDULED
    assert {first.node.name, elsewhere.node.name} == {"node-b"}
    # node-a's free GPU is big's (it has no runtime limit: it would not end before the reservation)
    assert state(behind_in_train).status == SessionStatus.PENDING
    assert f"GPU 0-1 on node-a reserved once the sessions there end (no known end) for {EARLIER}" in behind_in_train.status_reason


def test_a_big_request_starts_at_its_reservation_and_only_sessions_that_end_before_it_run_on_its_gpus(
        alice, settings):
    from usage.models import IdlePolicy, SessionActivity

    settings.FGPU_BACKFILL_LIMIT = 0
    make_cluster(nodes={"node-a": [mock_gpu(0, node=0), mock_gpu(1, node=0)]}, mode="discrete")
    policy = IdlePolicy.objects.create(resource_group=None, max_lifetime=3600)  # every session ends within 1 h
    busy = running(alice, "busy", devices=[A0])
    ends_at = timezone.now() + timedelta(hours=2)
    SessionActivity.objects.create(session=busy, deadline=ends_at, reason="idle")  # expected to end in 2 h
    big = launch(alice, "big", **{"cuda.device": 2})
    short = launch(alice, "short")  # ends within 1 h, before big's reservation: it may use GPU 1 meanwhile
    schedule_pending()

    assert state(short).status == SessionStatus.SCHEDULED and gpus_of(short) == {A1}
    assert state(big).status == SessionStatus.PENDING
    assert big.status_reason.endswith(f"reserved GPU 0-1 on node-a for it {clock(ends_at.timestamp())}")
    band = eta.session_eta(session=big)
    assert band.latest is not None and band.latest <= ends_at + timedelta(seconds=1)  # the ETA keeps the reservation

    make_running(short)
    ComputeSession.objects.filter(pk=short.pk).update(status=SessionStatus.TERMINATED)
    Allocation.objects.filter(session=short).update(released_at=timezone.now())
    policy.max_lifetime = 3 * 3600  # now a session may run 3 h: past big's reservation
    policy.save()
    long = launch(alice, "long")  # (one owner: the queue is in arrival order, no fair share)
    schedule_pending()
    assert state(long).status == SessionStatus.PENDING  # GPU 1 is free, but long would delay big
    assert "GPU 0-1 on node-a reserved" in long.status_reason and f"for {EARLIER}" in long.status_reason
    assert "big" not in long.status_reason  # the reserving session is not named

    ComputeSession.objects.filter(pk=busy.pk).update(status=SessionStatus.TERMINATED)  # busy ends at its deadline
    Allocation.objects.filter(session=busy).update(released_at=timezone.now())
    assert schedule_pending() == [str(big.pk)]  # big first, on both GPUs; long still waits
    assert gpus_of(state(big)) == {A0, A1}


class Cluster:
    """A `replay.ReservingRoom` over one node of whole GPUs (`core.place`), for the pure replay."""

    def __init__(self, gpus: int, sizes: dict[str, int], held: dict[str, int]):
        self.node = core.NodeState("n", 64, 1 << 40, devices=tuple(
            core.DeviceState(f"g{i}", 100, 100, index=i) for i in range(gpus)))
        self.sizes, self.holdings = sizes, {}
        for key in held:
            assert self.place(key) == (pure.PLACED, "")

    def _request(self, key):
        return core.ResourceRequest("device", amount=Decimal(self.sizes[key]), cpu=1)

    def place(self, key, reservations=None, end=None):
        request = self._request(key)
        try:
            placement = (reservations or Reservations()).place_around(
                [self.node], cpu=1, mem=0, end=end,
                place=lambda nodes: core.place(nodes or [self.node], request, None))
        except InsufficientResource as exc:
            return pure.WAITING, str(exc)
        self.node = core.apply_placement(self.node, request, placement)
        self.holdings[key] = Holding(placement.node_id, 1, 0, placement.grants)
        return pure.PLACED, ""

    def place_around(self, key, reservations, end):
        return self.place(key, reservations, end)

    def release(self, key):
        held = self.holdings.pop(key, None)
        if held is not None:
            self.node = core.release_placement(self.node, cpu=1, mem=0, grants=held.grants)

    def reserve(self, key, *, name, ends, now, earlier):
        return reservation_find([self.node], key=key, name=name, request=self._request(key), settings=None, options={},
                                holdings=self.holdings, ends=ends, now=now, earlier=earlier)


def test_in_the_replay_small_sessions_streaming_in_never_push_a_reserved_big_one_back():
    # 4 GPUs; 3 held until t=100; big (4 GPUs) reserves them all from 100. Small 1-GPU sessions
    # arrive every 10 s with a 30 s limit: they use the free GPU only while they end by 100.
    sizes = {"r": 3, "big": 4} | {f"s{i}": 1 for i in range(20)}
    room = Cluster(4, sizes, {"r": 3})
    queue = [pure.Queued("big", "4", runtime=50, name="big", limit=50)]
    queue += [pure.Queued(f"s{i}", "1", runtime=30, limit=30, arrives=1000.0 + 10 * i) for i in range(20)]

    out = pure.replay(queue, ends={"r": 1100.0}, room=room, now=1000.0, backfill_limit=0)

    assert out.starts["big"].at == 1100.0  # when r ends, as reserved
    early = [k for k, s in out.starts.items() if k != "big" and s.at is not None and s.at < 1100.0]
    assert early and all(out.starts[k].at + 30 <= 1100.0 for k in early)  # backfilled, each done by 100


def test_a_pass_reserves_for_the_first_sessions_at_the_limit_only_up_to_its_bound():
    class Waiting:
        overtaken = 3

    backfill = pure.Backfill(3)
    for _ in range(pure.RESERVATIONS_MAX + 4):
        backfill.block(Waiting())

    assert backfill.due() == backfill.blocked[: pure.RESERVATIONS_MAX]  # in queue order
    assert backfill.due() == []  # each once a pass, and no more than the bound


def test_a_second_reservation_takes_other_devices_when_there_are_any_else_it_queues_behind_the_first():
    room = Cluster(4, {"r1": 2, "r2": 2, "a": 2, "b": 2, "c": 4}, {"r1": 2, "r2": 2})
    ends = {"r1": 1100.0, "r2": 1200.0}

    first = room.reserve("a", name="a", ends=ends, now=1000.0, earlier=[])
    second = room.reserve("b", name="b", ends=ends, now=1000.0, earlier=[first])
    whole = room.reserve("c", name="c", ends=ends, now=1000.0, earlier=[first, second])

    assert (first.labels, first.at, second.labels, second.at) == ("GPU 0-1", 1100.0, "GPU 2-3", 1200.0)
    assert (whole.labels, whole.at) == ("GPU 0-3", None)  # only on theirs: after them, at no known time
