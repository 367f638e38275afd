"""When will a waiting MIG request start? (issue 17.3 with issue 4): the replay places MIG
requests by the scheduler's own MIG choice (sessions.scheduling.mig.mig_choose_in, the planner
accelerators.allocation.mig.plan_instance) on an in-memory copy of the MIG nodes, where a
session's end leaves its GPU instance idle (dynamic: reusable or destroyed for its slices;
fixed layout: only reusable) or frees its static slice. First on MIG nodes built in memory (no
database), then through GET /api/v1/sessions/<id>/eta/ on the real database."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from accelerators.allocation import core, mig
from accelerators.allocation import replay as pure
from accelerators.allocation.requests import parse_resources
from accelerators.models import Device, GpuInstance, MigMode, Node, NodeStatus
from sessions.scheduling import eta
from sessions.scheduling.mig import MigNodeRoom, MigScope
from sessions.models import ComputeSession, SessionStatus
from sessions.scheduling.placement import PlacementScope, RememberingReadView
from sessions.scheduling.scheduler import schedule_pending
from sessions.lifecycle.services import session_report_apply
from sessions.admission.launch import session_create
from tests.conftest import GiB, client_for, make_cluster, mock_gpu
from tests.test_mig_scheduling import mig_node

NOW = 1_000_000.0
MIN = 60.0


# --- the replay on MIG nodes in memory ---------------------------------------------------------------------

class Settings(RememberingReadView):
    """Slot settings without the database: the cuda slot in discrete mode."""

    def settings(self, request):
        return None


def h100_room(name: str, mode: str, running: dict[str, tuple[str, int]]) -> tuple[MigNodeRoom, dict]:
    """A MIG node `name` with one H100 80GB whose instances `running` (session key → (profile,
    first memory slice)) are in use; its room and the sessions' holdings."""
    node = Node(name=name, mig_mode=mode, status=NodeStatus.ALIVE, cpu_count=64, memory_size=512 * GiB)
    gpu = Device(node=node, slot_name="cuda", device_id=f"GPU-{name}", index=0, model_name="H100-80GB",
                 mother_uuid=name, memory_size=80 * GiB, subproc_count=132)
    layout = tuple(mig.MigInstance(key=f"gi-{key}", profile=profile, start=start, in_use=True)
                   for key, (profile, start) in running.items())
    room = MigNodeRoom(node=node, devices=[gpu], cpu=64 - len(running), mem=(512 - len(running)) * GiB,
                       holders={str(gpu.pk): dict.fromkeys(running, True)}, layouts={str(gpu.pk): layout},
                       instances={key: (str(gpu.pk), f"gi-{key}") for key in running})
    holdings = {key: eta._Holding("cuda", name, 1, GiB, ()) for key in running}
    return room, holdings


def shared_scope(name: str, *, used_by: str | None) -> tuple[PlacementScope, dict]:
    """A plain node `name` with one 40 GiB GPU (not MIG), held whole by `used_by` (or free)."""
    device = core.DeviceState(device_id=f"{name}-gpu", memory_total=40 * GiB, proc_total=100, index=0)
    holdings = {}
    if used_by:
        device = core.DeviceState(device_id=device.device_id, memory_total=40 * GiB, proc_total=100, index=0,
                                  memory_used=40 * GiB, proc_used=core.Decimal(100), sessions=1)
        holdings[used_by] = eta._Holding("cuda", name, 1, GiB,
                                         (core.DeviceGrant(device.device_id, core.Decimal(1), 40 * GiB, core.Decimal(100)),))
    node = core.NodeState(node_id=name, cpu_total=64, mem_total=512 * GiB, cpu_used=len(holdings),
                          mem_used=len(holdings) * GiB, devices=(device,))
    scope = PlacementScope(group_name="", slot="cuda", nodes=[node], options={"policy": "binpack", "no_fragmentation": False},
                           rows={name: 0})
    return scope, holdings


def replay_starts(rooms, queued: dict[str, dict], ends: dict[str, float | None], holdings: dict, scopes=None):
    """Replay `queued` (key → resources, in queue order, 60 min each) on `rooms` (MIG) and
    `scopes` (shared) from NOW; each key's start."""
    requests = {key: parse_resources({**resources, "cpu": 1, "mem": "1G"}) for key, resources in queued.items()}
    mig_scope = MigScope(rooms=list(rooms), every=([r.node for r in rooms], [d for r in rooms for d in r.devices]))
    read = eta._Read(scopes={("", "cuda", ""): scope for scope in scopes or []}, holdings=holdings,
                     mig_scopes={("", ""): mig_scope}, reader=Settings())
    room = eta._Room(read, requests, dict.fromkeys(queued, ""))
    queue = [pure.Queued(key, key, runtime=60 * MIN, name=key) for key in queued]
    out = pure.replay(queue, ends=ends, room=room, now=NOW, backfill_limit=0)
    return out.starts


def test_on_a_dynamic_node_a_3g_request_starts_when_the_4g_instance_in_its_way_ends():
    room, held = h100_room("dyn", MigMode.DYNAMIC, {"four": ("4g.40gb", 0), "three": ("3g.40gb", 4)})

    starts = replay_starts([room], {"want": {"mig_profile": "3g.40gb"}}, {"four": NOW + 20 * MIN, "three": NOW + 90 * MIN}, held)

    # The 4g instance goes idle at 20 min; the planner destroys it for a 3g at slice 0.
    assert starts["want"] == pure.Start(NOW + 20 * MIN, pure.PLACED)


def test_on_a_dynamic_node_a_3g_request_waits_for_the_whole_gpu_7g_session():
    room, held = h100_room("dyn", MigMode.DYNAMIC, {"whole": ("7g.80gb", 0)})

    starts = replay_starts([room], {"a": {"mig_profile": "3g.40gb"}, "b": {"mig_profile": "3g.40gb"},
                                    "c": {"mig_profile": "3g.40gb"}}, {"whole": NOW + 30 * MIN}, held)

    # Two 3g instances fit on the emptied GPU; the third waits for one of them (60 min each).
    assert [starts[k].at for k in "abc"] == [NOW + 30 * MIN, NOW + 30 * MIN, NOW + 90 * MIN]


def test_on_a_fixed_layout_a_3g_request_waits_for_the_instance_of_its_profile_not_the_first_end():
    fixed, held = h100_room("fix", MigMode.FIXED, {"four": ("4g.40gb", 0), "three": ("3g.40gb", 4)})
    dynamic, _ = h100_room("fix", MigMode.DYNAMIC, {"four": ("4g.40gb", 0), "three": ("3g.40gb", 4)})
    ends = {"four": NOW + 20 * MIN, "three": NOW + 90 * MIN}

    on_fixed = replay_starts([fixed], {"want": {"mig_profile": "3g.40gb"}}, ends, held)
    on_dynamic = replay_starts([dynamic], {"want": {"mig_profile": "3g.40gb"}}, ends, held)

    assert on_fixed["want"] == pure.Start(NOW + 90 * MIN, pure.PLACED)  # the idle 3g is reused; no instance created
    assert on_dynamic["want"].at == NOW + 20 * MIN


def test_on_a_static_node_a_request_waits_for_a_slice_of_its_profile_to_come_free():
    node = Node(name="static", mig_mode=MigMode.STATIC, status=NodeStatus.ALIVE, cpu_count=64, memory_size=512 * GiB)
    slices = [Device(node=node, slot_name="cuda", device_id=f"MIG-{i}", index=i, model_name="A100-MIG-3g",
                     mig_profile=profile, is_mig_device=True, mother_uuid="gpu0", memory_size=size * GiB, subproc_count=42)
              for i, (profile, size) in enumerate([("3g.20gb", 20), ("2g.10gb", 10), ("1g.5gb", 5)])]
    holders = {str(slices[0].pk): {"big": False}, str(slices[1].pk): {"mid": False}}
    room = MigNodeRoom(node=node, devices=slices, cpu=62, mem=510 * GiB, holders=holders)
    held = {key: eta._Holding("cuda", "static", 1, GiB, ()) for key in ("big", "mid")}

    starts = replay_starts([room], {"small": {"gpu_memory": "8G", "isolation": "mig"}, "want": {"mig_profile": "3g.20gb"}},
                           {"big": NOW + 40 * MIN, "mid": NOW + 10 * MIN}, held)

    assert starts["want"] == pure.Start(NOW + 40 * MIN, pure.PLACED)  # its slice, not the first one freed
    assert starts["small"] == pure.Start(NOW + 10 * MIN, pure.PLACED)  # the 2g.10gb slice, the smallest of 8 GiB up


def test_a_fixed_layout_with_no_instance_of_the_profile_leaves_it_waiting_with_the_reason():
    fixed, held = h100_room("fix", MigMode.FIXED, {"four": ("4g.40gb", 0)})

    starts = replay_starts([fixed], {"want": {"gpu_memory": "15G", "isolation": "mig"}}, {"four": NOW + 20 * MIN}, held)

    assert starts["want"].outcome == pure.WAITING and "fixed layout has no idle" in starts["want"].reason


def test_a_memory_request_gets_the_smallest_instance_as_soon_as_one_is_free():
    room, held = h100_room("dyn", MigMode.DYNAMIC, {"a": ("3g.40gb", 0), "b": ("3g.40gb", 4)})

    starts = replay_starts([room], {"want": {"gpu_memory": "15G", "isolation": "mig"}}, {"a": NOW + 45 * MIN, "b": None}, held)

    assert starts["want"] == pure.Start(NOW + 45 * MIN, pure.PLACED)


def test_isolation_any_takes_a_shared_slice_when_that_is_sooner_and_mig_when_that_is():
    room, mig_held = h100_room("dyn", MigMode.DYNAMIC, {"whole": ("7g.80gb", 0)})
    either = {"want": {"gpu_memory": "10G", "isolation": "any"}}

    scope, shared_held = shared_scope("plain", used_by="user")
    shared_first = replay_starts([room], either, {"whole": NOW + 2 * 60 * MIN, "user": NOW + 30 * MIN},
                                 mig_held | shared_held, scopes=[scope])
    room, mig_held = h100_room("dyn", MigMode.DYNAMIC, {"whole": ("7g.80gb", 0)})
    scope, shared_held = shared_scope("plain", used_by="user")
    mig_first = replay_starts([room], either, {"whole": NOW + 30 * MIN, "user": NOW + 2 * 60 * MIN},
                              mig_held | shared_held, scopes=[scope])

    assert shared_first["want"] == pure.Start(NOW + 30 * MIN, pure.PLACED)
    assert mig_first["want"] == pure.Start(NOW + 30 * MIN, pure.PLACED)


def test_a_mig_session_the_replay_starts_holds_its_instance_for_its_runtime():
    room, held = h100_room("dyn", MigMode.DYNAMIC, {})

    starts = replay_starts([room], {"first": {"mig_profile": "7g.80gb"}, "second": {"mig_profile": "1g.10gb"}}, {}, held)

    assert starts["first"].at == NOW and starts["second"].at == NOW + 60 * MIN


def test_a_mig_session_leaves_the_node_cpu_to_shared_sessions_only_when_it_ends():
    room, held = h100_room("both", MigMode.DYNAMIC, {"whole": ("7g.80gb", 0)})
    room.cpu = 0  # the MIG session holds every core
    scope, _ = shared_scope("both", used_by=None)
    scope.nodes[0] = core.NodeState(node_id="both", cpu_total=64, mem_total=512 * GiB, cpu_used=64, mem_used=GiB,
                                    devices=scope.nodes[0].devices)
    held = {"whole": eta._Holding("cuda", "both", 64, GiB, ())}

    starts = replay_starts([room], {"cpu": {"cuda.device": "1"}}, {"whole": NOW + 25 * MIN}, held, scopes=[scope])

    assert starts["cpu"] == pure.Start(NOW + 25 * MIN, pure.PLACED)


def test_a_mig_request_no_mig_node_could_hold_never_starts():
    room, held = h100_room("dyn", MigMode.DYNAMIC, {})

    starts = replay_starts([room], {"huge": {"gpu_memory": "100G", "isolation": "mig"}}, {}, held)

    assert starts["huge"].outcome == pure.NEVER and "no MIG node could ever hold" in starts["huge"].reason


# --- on the real database ---------------------------------------------------------------------------------

@pytest.fixture
def two_hours(db):
    """Nodes in no group: a maximum lifetime of 2 h."""
    from usage.models import IdlePolicy

    IdlePolicy.objects.create(resource_group=None, max_lifetime=7200)


def started(owner, name: str, resources: dict, *, minutes_ago: float) -> ComputeSession:
    session = session_create(owner=owner, name=name, resources=resources)
    assert str(session.pk) in schedule_pending()
    session_report_apply(session_id=str(session.pk), status=SessionStatus.RUNNING)
    ComputeSession.objects.filter(pk=session.pk).update(started_at=timezone.now() - timedelta(minutes=minutes_ago))
    return ComputeSession.objects.get(pk=session.pk)


def pending(owner, name: str, resources: dict) -> ComputeSession:
    session = session_create(owner=owner, name=name, resources=resources)
    schedule_pending()
    session.refresh_from_db()
    assert session.status == SessionStatus.PENDING
    return session


def close(a, b, seconds: float = 5.0) -> bool:
    return abs((a - b).total_seconds()) <= seconds


def test_a_waiting_mig_session_gets_a_band_from_the_end_of_the_instance_in_its_way(two_hours, alice, bob):
    mig_node()
    four = started(bob, "four", {"mig_profile": "4g.40gb"}, minutes_ago=90)  # ends in 30 min
    started(bob, "three", {"mig_profile": "3g.40gb"}, minutes_ago=10)  # ends in 110 min
    mine = pending(alice, "mine", {"mig_profile": "3g.40gb"})

    answer = eta.session_eta(session=mine)

    assert answer.outcome == "estimate"
    assert close(answer.earliest, four.started_at + timedelta(hours=2))
    assert close(answer.latest, four.started_at + timedelta(hours=2))
    assert [(f.session.pk, f.node) for f in answer.fits_after] == [(four.pk, "mig-node")]
    assert not answer.fits_now and answer.mig_now == ()  # every memory slice is held: nothing smaller either
    assert GpuInstance.objects.count() == 2  # nothing written: no instance planned for it
    assert ComputeSession.objects.get(pk=mine.pk).status == SessionStatus.PENDING


def test_the_eta_api_gives_a_waiting_mig_session_on_a_fixed_layout_its_band(two_hours, alice, bob):
    node = mig_node(mode=MigMode.FIXED)
    gpu = node.devices.get()
    for start in (0, 4):
        GpuInstance.objects.create(node=node, parent=gpu, profile="3g.40gb", placement_start=start, placement_size=4,
                                   memory_size=39 * GiB, subproc_count=60)
    first = started(bob, "first", {"mig_profile": "3g.40gb"}, minutes_ago=100)  # ends in 20 min
    started(bob, "second", {"mig_profile": "3g.40gb"}, minutes_ago=30)
    mine = pending(alice, "mine", {"gpu_memory": "30G", "isolation": "mig"})  # a 3g.40gb

    response = client_for(alice).get(f"/api/v1/sessions/{mine.pk}/eta/")

    assert response.status_code == 200, response.content
    body = response.json()
    assert body["outcome"] == "estimate", (body["reason"], body)
    end = first.started_at + timedelta(hours=2)
    assert abs(timezone.datetime.fromisoformat(body["earliest"].replace("Z", "+00:00")) - end) < timedelta(seconds=5)
    assert "MIG instances are not replayed" not in response.content.decode()


def test_isolation_any_waits_for_whichever_comes_free_first_on_the_real_database(two_hours, alice, bob):
    mig_node()
    make_cluster(nodes={"plain": [mock_gpu(0)]})
    whole = started(bob, "whole", {"mig_profile": "7g.80gb"}, minutes_ago=100)  # MIG free in 20 min
    started(bob, "shared", {"cuda.shares": "2", "mem": "64M"}, minutes_ago=10)  # the plain GPU in 110 min
    mine = pending(alice, "mine", {"gpu_memory": "2G", "isolation": "any"})

    answer = eta.session_eta(session=mine)

    assert answer.outcome == "estimate" and close(answer.earliest, whole.started_at + timedelta(hours=2))
    assert [f.session.pk for f in answer.fits_after] == [whole.pk]


def test_a_waiting_mig_request_is_told_which_smaller_profiles_are_free_now(two_hours, alice, bob):
    mig_node()
    started(bob, "three", {"mig_profile": "3g.40gb"}, minutes_ago=10)  # slices 0-3 or 4-7
    mine = pending(alice, "mine", {"mig_profile": "7g.80gb"})

    answer = eta.session_eta(session=mine)
    body = client_for(alice).get(f"/api/v1/sessions/{mine.pk}/eta/").json()

    names = [o.profile for o in answer.mig_now]
    # The planner put the 3g at slice 4: 4 compute slices and slices 0-3 are left. Largest first.
    assert GpuInstance.objects.get().placement_start == 4
    assert names == ["3g.40gb", "4g.40gb", "1g.20gb", "2g.20gb", "1g.10gb"]
    assert [o["profile"] for o in body["mig_now"]] == names
    assert body["mig_now"][0]["memory"] == answer.mig_now[0].memory > 0


def test_a_shared_request_gets_no_mig_hint(two_hours, alice, bob):
    make_cluster(nodes={"plain": [mock_gpu(0)]})
    started(bob, "shared", {"cuda.shares": "2", "mem": "64M"}, minutes_ago=10)
    mine = pending(alice, "mine", {"cuda.shares": "1", "mem": "64M"})

    assert eta.session_eta(session=mine).mig_now == ()
