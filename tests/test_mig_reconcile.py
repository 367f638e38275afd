"""Reconcile at agent start (issue 4): after an agent registers, the manager sends it the expected
layout of each MIG GPU; the agent re-creates the instances that are missing (they do not survive a
reboot) and reports those the manager never planned, which the manager records as "unknown" so
that the planner never hands their slices out, and the admin picture and layouts API show them."""
from __future__ import annotations

import asyncio
import uuid

import pytest
from channels.db import database_sync_to_async
from channels.layers import InMemoryChannelLayer
from django.db import connections
from django.utils import timezone

from accelerators.mig_selectors import mig_gpu_pictures
from accelerators.mig_services import node_mig_expected, node_mig_layout_apply, node_mig_report_apply
from common.celery import app as celery_app
from accelerators.models import GpuInstance, MigMode, Node
from sessions.models import ComputeSession, SessionStatus
from agent import mig as runtime_mig
from agent.core import Agent
from agent.manager_link import CeleryManager
from sessions.admission.launch import session_create
from tests.conftest import GiB, client_for, make_cluster, mock_gpu, wait_until_async
from tests.fakes.fake_pynvml import FakeNvml
from tests.test_agent_runtime import Harness, RecordingManager
from protocol.mig_messages import MigReport
from tests.test_mig_agent import H100, h100, manager_for, mig_block, reconcile_message
from tests.test_mig_scheduling import h100 as h100_info
from tests.test_mig_scheduling import end, mig_node, schedule

GPU = h100_info(uuid_text=H100)  # the inventory's view of the fake NVML's H100


def gpus_block() -> list[dict]:
    return [{"gpu": H100, "index": 0, "model_name": "H100-80GB", "memory_size": 80 * GiB, "subproc_count": 132}]


def on_gpu(fake: FakeNvml) -> list[tuple[str, int]]:
    return sorted((gi.profile.name, gi.start) for gi in fake.gpus[0].gpu_instances)


# --- the agent's side, against the fake NVML ------------------------------------------------------

def test_at_start_missing_instances_are_recreated_and_strangers_reported_once():
    fake = FakeNvml([h100()])
    stranger = manager_for(fake).prepare(mig_block("1g.10gb", 3))  # made by hand, before the agent started
    sent = []
    manager = runtime_mig.MigManager(runtime_mig.NvmlMigBackend(fake), on_report=lambda r: sent.append(r.encode()))

    report = manager.reconcile_at_start(reconcile_message(gpus_block(), {H100: [{"profile": "3g.40gb", "start": 4},
                                                                                {"profile": "1g.20gb", "start": 0}]})).encode()

    assert on_gpu(fake) == [("1g.10gb", 3), ("1g.20gb", 0), ("3g.40gb", 4)]
    assert report["gpus"] == [H100] and sent == [report]
    assert report["unknown"] == [{"gpu": H100, "profile": "1g.10gb", "start": 3, "uuid": stranger.uuid}]
    assert [(r["profile"], r["start"]) for r in report["recreated"]] == [("1g.20gb", 0), ("3g.40gb", 4)]
    made = manager.prepare(mig_block("1g.20gb", 0, reuse=True, layout=[{"profile": "1g.20gb", "start": 0}]))
    assert len(sent) == 2 and (sent[1]["gpus"], sent[1]["unknown"]) == ([], [])  # not reconciled again
    assert sent[1]["prepared"] == [{"gpu": H100, "profile": "1g.20gb", "start": 0, "uuid": made.uuid}]


def test_a_gpu_a_start_spec_reached_first_is_not_reconciled_again_at_start():
    fake = FakeNvml([h100()])
    sent = []
    manager = runtime_mig.MigManager(runtime_mig.NvmlMigBackend(fake), on_report=lambda r: sent.append(r.encode()))
    manager.prepare(mig_block("2g.20gb", 0, layout=[{"profile": "2g.20gb", "start": 0}]))

    stale = {H100: [{"profile": "7g.80gb", "start": 0}]}
    report = manager.reconcile_at_start(reconcile_message(gpus_block(), stale)).encode()

    assert report["gpus"] == [] and on_gpu(fake) == [("2g.20gb", 0)]
    assert [(r["gpus"], len(r.get("prepared", []))) for r in sent] == [([H100], 0), ([], 1), ([], 0)]


def test_the_instances_a_first_prepare_destroys_are_not_reported_unknown():
    fake = FakeNvml([h100()])
    manager_for(fake).prepare(mig_block("7g.80gb", 0))  # idle before the restart; the new plan destroys it
    sent = []
    manager = runtime_mig.MigManager(runtime_mig.NvmlMigBackend(fake), on_report=lambda r: sent.append(r.encode()))

    manager.prepare(mig_block("1g.10gb", 6, layout=[{"profile": "1g.10gb", "start": 6}],
                          destroy=[{"profile": "7g.80gb", "start": 0}]))

    report, prepared = sent
    assert report["unknown"] == [] and on_gpu(fake) == [("1g.10gb", 6)] and prepared["prepared"]


def test_a_gpu_nvml_cannot_list_is_an_error_and_not_marked_reconciled():
    fake = FakeNvml([h100()], root=True)
    fake.fail("nvmlDeviceGetHandleByUUID", 999)
    manager = runtime_mig.MigManager(runtime_mig.NvmlMigBackend(fake))

    report = manager.reconcile_at_start(reconcile_message(gpus_block(), {H100: []})).encode()

    assert report["gpus"] == [] and report["errors"][0]["gpu"] == H100


def test_the_agent_reconciles_when_the_manager_sends_the_layout_and_reports_back(tmp_path):
    fake = FakeNvml([h100()])
    stranger = manager_for(fake).prepare(mig_block("1g.10gb", 6))

    async def main():
        recorder = RecordingManager(asyncio.get_running_loop())
        agent = Agent(node=f"mig-{uuid.uuid4().hex[:6]}", inventory={"devices": [GPU.as_dict()], "plugins": [],
                                                                     "attributes": {}},
                      channel_layer=InMemoryChannelLayer(), manager=recorder, scratch_root=tmp_path, mock=False)
        agent.mig = runtime_mig.MigManager(runtime_mig.NvmlMigBackend(fake), on_report=agent._send_mig_report)
        await agent.start()
        try:
            await asyncio.to_thread(agent.submit_mig_reconcile, reconcile_message(gpus_block(), {H100: [{"profile": "4g.40gb",
                                                                                                           "start": 0}]}))
            return await recorder.wait_for(lambda: recorder.mig_reports, what="a MIG report")
        finally:
            await agent.shutdown()

    [(node, report)] = asyncio.run(main())
    assert node.startswith("mig-") and report["unknown"][0]["uuid"] == stranger.uuid
    assert on_gpu(fake) == [("1g.10gb", 6), ("4g.40gb", 0)]


# --- the manager's side --------------------------------------------------------------------------

@pytest.mark.django_db
def test_the_expected_layout_is_every_planned_instance_of_each_mig_gpu_of_a_dynamic_or_fixed_node():
    node = mig_node(devices=[GPU, mock_gpu(1)])
    gpu = node.devices.get(device_id=H100)
    GpuInstance.objects.create(node=node, parent=gpu, profile="3g.40gb", placement_start=4, placement_size=4)
    GpuInstance.objects.create(node=node, parent=gpu, profile="1g.10gb", placement_start=0, placement_size=1,
                               unknown_since=timezone.now())

    assert node_mig_expected(node=node).encode() == {"node": "mig-node", "gpus": gpus_block(), "expected": {
        H100: [{"profile": "3g.40gb", "start": 4}]}, "destroy": {}, "kind": "start", "seq": None}
    for mode in (MigMode.OFF, MigMode.STATIC):
        node.mig_mode = mode
        assert node_mig_expected(node=node) is None
    make_cluster(nodes={"plain": [mock_gpu(0)]})
    plain = Node.objects.get(name="plain")
    plain.mig_mode = MigMode.DYNAMIC
    assert node_mig_expected(node=plain) is None


def report_of(*unknown, recreated=(), gpus=(H100,)) -> MigReport:
    return MigReport.decode({"gpus": list(gpus), "errors": [],
            "unknown": [{"gpu": H100, "profile": p, "start": s, "uuid": f"MIG-{p}-{s}"} for p, s in unknown],
            "recreated": [{"gpu": H100, "profile": p, "start": s, "uuid": f"MIG-{p}-{s}"} for p, s in recreated]})


@pytest.mark.django_db
def test_unknown_instances_are_recorded_and_the_planner_never_hands_their_slices_out(
        alice, django_capture_on_commit_callbacks):
    mig_node(devices=[GPU])
    node_mig_report_apply(node_name="mig-node", report=report_of(("4g.40gb", 0)))

    [row] = GpuInstance.objects.all()
    assert (row.profile, row.placement_start, row.uuid, row.is_unknown, row.is_idle) == \
        ("4g.40gb", 0, "MIG-4g.40gb-0", True, False)
    whole = session_create(owner=alice, name="whole", resources={"mig_profile": "7g.80gb"})
    half = session_create(owner=alice, name="half", resources={"gpu_memory": "30G", "isolation": "mig"})
    [(_, spec)] = schedule(django_capture_on_commit_callbacks)
    assert spec["session_id"] == str(half.pk) and (spec["mig"]["profile"], spec["mig"]["start"]) == ("3g.40gb", 4)
    assert {"profile": "4g.40gb", "start": 0} not in spec["mig"]["layout"]  # not the manager's to re-create
    assert ComputeSession.objects.get(pk=whole.pk).status == SessionStatus.PENDING
    end(ComputeSession.objects.get(pk=half.pk))
    again = session_create(owner=alice, name="again", resources={"mig_profile": "4g.40gb"})
    schedule(django_capture_on_commit_callbacks)
    assert ComputeSession.objects.get(pk=again.pk).status == SessionStatus.PENDING  # never reused: not ours
    assert GpuInstance.objects.get(placement_start=0).is_unknown  # nor destroyed for a plan


@pytest.mark.django_db
def test_an_unknown_instance_no_longer_found_is_forgotten_and_one_still_there_keeps_its_first_sighting():
    mig_node(devices=[GPU])
    node_mig_report_apply(node_name="mig-node", report=report_of(("1g.10gb", 5), ("1g.10gb", 6)))
    first = GpuInstance.objects.get(placement_start=6).unknown_since

    node_mig_report_apply(node_name="mig-node", report=report_of(("1g.10gb", 6)))

    [row] = GpuInstance.objects.all()
    assert (row.placement_start, row.unknown_since) == (6, first)
    node_mig_report_apply(node_name="mig-node", report=report_of(gpus=()))  # the GPU could not be listed
    assert GpuInstance.objects.count() == 1


@pytest.mark.django_db
def test_an_idle_planned_instance_where_an_unknown_one_sits_is_replaced_and_one_in_use_is_kept(
        alice, django_capture_on_commit_callbacks):
    node = mig_node(devices=[GPU])
    held = session_create(owner=alice, name="held", resources={"mig_profile": "3g.40gb"})
    schedule(django_capture_on_commit_callbacks)
    used = GpuInstance.objects.get(session=held)
    gpu = node.devices.get()
    free_start = 0 if used.placement_start == 4 else 4
    GpuInstance.objects.create(node=node, parent=gpu, profile="2g.20gb", placement_start=free_start, placement_size=2)

    node_mig_report_apply(node_name="mig-node", report=report_of(
        ("1g.10gb", free_start), ("1g.10gb", used.placement_start), recreated=[("3g.40gb", used.placement_start)]))

    rows = {r.placement_start: r for r in GpuInstance.objects.all()}
    assert rows[free_start].profile == "1g.10gb" and rows[free_start].is_unknown
    assert rows[used.placement_start].session_id == held.pk and not rows[used.placement_start].is_unknown
    assert rows[used.placement_start].uuid == f"MIG-3g.40gb-{used.placement_start}"


@pytest.mark.django_db
def test_a_fixed_layout_leaves_unknown_instances_alone():
    node = mig_node(mode=MigMode.FIXED, devices=[GPU])
    node_mig_report_apply(node_name="mig-node", report=report_of(("1g.10gb", 6)))
    node.mig_layout = {"0": [{"profile": "4g.40gb", "start": 0}]}
    node.save()

    node_mig_layout_apply(node=node)

    assert sorted((r.profile, r.placement_start, r.is_unknown) for r in GpuInstance.objects.all()) == \
        [("1g.10gb", 6, True), ("4g.40gb", 0, False)]


@pytest.mark.django_db
def test_the_admin_picture_and_the_layouts_api_show_an_unknown_instance_and_what_it_is(admin, alice):
    node = mig_node(devices=[GPU])
    node_mig_report_apply(node_name="mig-node", report=report_of(("2g.20gb", 2)))

    [picture] = mig_gpu_pictures(node=node)
    assert [c.state for c in picture.memory][2:4] == ["unknown", "unknown"]
    assert picture.instances == (("2g.20gb@2", "unknown", "found by the agent: MIG-2g.20gb-2"),)
    [layout] = client_for(alice).get("/api/v1/mig/layouts/").json()["results"]
    assert [(i["profile"], i["state"], i["uuid"]) for i in layout["instances"]] == \
        [("2g.20gb", "unknown", "MIG-2g.20gb-2")]
    from django.test import Client

    page = Client()
    page.force_login(admin)
    assert "unknown 2g.20gb@2" in page.get(f"/admin/accelerators/node/{node.pk}/change/").content.decode()
    listing = page.get("/admin/accelerators/gpuinstance/?unknown_since__isnull=False").content.decode()
    assert "MIG-2g.20gb-2" in listing


@pytest.mark.django_db
def test_a_prepared_instance_gets_its_mig_device_uuid_and_leaves_unknown_ones_alone(
        alice, django_capture_on_commit_callbacks):
    mig_node(devices=[GPU])
    node_mig_report_apply(node_name="mig-node", report=report_of(("1g.10gb", 6)))
    session_create(owner=alice, name="a", resources={"mig_profile": "3g.40gb"})
    [(_, spec)] = schedule(django_capture_on_commit_callbacks)
    start = spec["mig"]["start"]

    node_mig_report_apply(node_name="mig-node", report=MigReport.decode({"prepared": [
        {"gpu": H100, "profile": "3g.40gb", "start": start, "uuid": "MIG-made"}]}))

    assert GpuInstance.objects.get(placement_start=start).uuid == "MIG-made"
    assert GpuInstance.objects.get(placement_start=6).is_unknown  # not a listing of the GPU: nothing forgotten


@pytest.mark.django_db
def test_a_report_from_a_node_that_never_registered_is_ignored():
    assert node_mig_report_apply(node_name="nowhere", report=report_of(("1g.10gb", 0))) == []


# --- the whole chain in one process: register task → mig_reconcile task → agent → mig_report task --

class ThreadTidyCeleryManager(CeleryManager):
    """The agent's Celery manager; with eager Celery the manager's tasks run in the agent's worker
    threads, whose database connections are closed after each call here (the test database is
    dropped at the end of the run)."""

    def register(self, *args):
        try:
            super().register(*args)
        finally:
            connections.close_all()

    def mig_report(self, *args):
        try:
            super().mig_report(*args)
        finally:
            connections.close_all()


@pytest.mark.django_db(transaction=True)
def test_after_registering_the_agent_gets_the_layout_recreates_it_and_the_manager_records_strangers(tmp_path):
    """Celery runs eagerly here (the manager's tasks in the agent's worker threads); the agent
    runs on its own loop with the fake NVML, where an idle instance the manager planned is gone
    (a reboot) and a stranger was made by hand."""
    import agent.tasks  # noqa: F401  (with eager Celery, a send by name runs only a task registered here:
    import sessions.tasks  # noqa: F401  the agent's and the manager's, as the whole suite has them)

    node = mig_node(name="gpu-node", devices=[GPU])
    gpu = node.devices.get()
    GpuInstance.objects.create(node=node, parent=gpu, profile="3g.40gb", placement_start=4, placement_size=4)
    fake = FakeNvml([h100()])
    stranger = manager_for(fake).prepare(mig_block("1g.10gb", 0))

    async def main():
        agent = Agent(node="gpu-node", inventory={"devices": [GPU.as_dict()], "plugins": [], "attributes": {},
                                                  "cpu_count": 8, "memory_size": 32 * GiB},
                      channel_layer=InMemoryChannelLayer(), manager=ThreadTidyCeleryManager(celery_app), scratch_root=tmp_path,
                      mock=False, heartbeat_s=60)
        agent.mig = runtime_mig.MigManager(runtime_mig.NvmlMigBackend(fake), on_report=agent._send_mig_report)
        await agent.start()
        try:
            await wait_until_async(database_sync_to_async(GpuInstance.objects.filter(unknown_since__isnull=False).exists),
                                   timeout=30, interval=0.05, what="the stranger recorded as unknown")
        finally:
            await agent.shutdown()

    asyncio.run(main())
    assert on_gpu(fake) == [("1g.10gb", 0), ("3g.40gb", 4)]
    rows = {r.placement_start: r for r in GpuInstance.objects.all()}
    assert rows[0].is_unknown and rows[0].uuid == stranger.uuid
    assert rows[4].uuid.startswith("MIG-") and not rows[4].is_unknown
