"""Keeping a running agent's MIG layout in step with the manager's: an administrator's change of
a node's MIG settings is pushed to its agent at once (idle instances that no longer belong
destroyed, missing ones created, instances in use kept until their sessions end), an offline
agent gets it when it registers again, and a heartbeat whose layout digest differs from the
expected one asks for a full reconcile that records unknown instances. The agent side runs
against the fake NVML; the chain runs with a real agent on a loop of its own and eager Celery."""
from __future__ import annotations

import asyncio
import threading
import uuid
from contextlib import contextmanager

import pytest
from channels.layers import InMemoryChannelLayer
from django.db import connections
from django.test import Client

from accelerators.allocation import mig
from accelerators.mig_selectors import node_mig_layout_digest, node_mig_sync_view
from accelerators.mig_services import (_send_mig_reconcile, node_mig_heartbeat_check, node_mig_layout_apply,
                                       node_mig_pending_retry, node_mig_report_apply, node_mig_settings_apply)
from accelerators.models import GpuInstance, MigMode, Node, NodeStatus
from sessions.models import ComputeSession, SessionStatus
from agent import mig as runtime_mig
from agent.core import Agent
from agent.manager_link import CeleryManager
from sessions.lifecycle.services import session_terminate
from sessions.admission.launch import session_create
from sessions.tasks import agent_register
from tests.conftest import GiB, client_for, wait_until
from tests.fakes.fake_pynvml import FakeNvml, FakeProcess
from protocol.mig_messages import MigReport
from tests.test_mig_agent import H100, h100, manager_for, mig_block, reconcile_message
from tests.test_mig_reconcile import GPU, gpus_block, on_gpu
from tests.test_mig_scheduling import end, mig_node, schedule

NODE_MIG = "/api/v1/nodes/{}/mig/"


def layout(*entries: tuple[str, int]) -> dict:
    return {"0": [{"profile": p, "start": s} for p, s in entries]}


def pushes(callbacks) -> list[tuple[str, dict]]:
    """The (node, message as sent) of each `fgpu.agent.mig_reconcile` a block of on-commit callbacks would send."""
    return [(cb.args[0], cb.args[1].encode()) for cb in callbacks if getattr(cb, "func", None) is _send_mig_reconcile]


def fixed_node(name: str = "mig-node", *entries: tuple[str, int]) -> Node:
    node = mig_node(name=name, mode=MigMode.FIXED, devices=[GPU])
    node.mig_layout = layout(*entries)
    node.save(update_fields=["mig_layout"])
    node_mig_layout_apply(node=node)
    return node


# --- the agent's side, against the fake NVML ---------------------------------------------------------

def test_applying_a_pushed_layout_destroys_the_listed_idle_instances_and_creates_the_missing_ones():
    fake = FakeNvml([h100()])
    made = manager_for(fake)
    made.prepare(mig_block("7g.80gb", 0))
    sent = []
    manager = runtime_mig.MigManager(runtime_mig.NvmlMigBackend(fake), on_report=lambda r: sent.append(r.encode()))

    report = manager.apply_layout(reconcile_message(gpus_block(), {H100: [{"profile": "3g.40gb", "start": 4},
                                                                          {"profile": "4g.40gb", "start": 0}]},
                                                    destroy={H100: [{"profile": "7g.80gb", "start": 0}]}, kind="layout",
                                                    seq=3)).encode()

    assert on_gpu(fake) == [("3g.40gb", 4), ("4g.40gb", 0)]
    assert sent == [report] and (report["kind"], report["seq"], report["errors"], report["unknown"]) == \
        ("layout", 3, [], [])
    assert report["destroyed"] == [{"gpu": H100, "profile": "7g.80gb", "start": 0}]
    assert [(r["profile"], r["start"]) for r in report["recreated"]] == [("4g.40gb", 0), ("3g.40gb", 4)]


def test_a_listed_instance_with_a_process_attached_stays_and_is_reported_and_one_expected_again_is_kept():
    fake = FakeNvml([h100()])
    manager = manager_for(fake)
    used = manager.prepare(mig_block("4g.40gb", 0))
    manager.prepare(mig_block("3g.40gb", 4))
    busy = next(m for m in fake.gpus[0].mig_devices if m and m.uuid == used.uuid)
    busy.processes.append(FakeProcess(pid=4242, used_memory=GiB))

    report = manager.apply_layout(reconcile_message(gpus_block(), {H100: [{"profile": "3g.40gb", "start": 4}]},
                                                    destroy={H100: [{"profile": "4g.40gb", "start": 0},
                                                                    {"profile": "3g.40gb", "start": 4}]},
                                                    kind="layout")).encode()

    assert on_gpu(fake) == [("3g.40gb", 4), ("4g.40gb", 0)]
    assert report["destroyed"] == []
    [error] = report["errors"]
    assert (error["profile"], error["start"]) == ("4g.40gb", 0) and "in use" in error["reason"]


def test_the_layout_digest_is_the_managers_function_over_what_is_on_the_gpu_and_changes_with_it():
    fake = FakeNvml([h100()])
    manager = manager_for(fake)
    assert manager.layout_digest() is None  # no MIG GPU named yet

    manager.apply_layout(reconcile_message(gpus_block(), {H100: [{"profile": "3g.40gb", "start": 4}]}, kind="layout"))

    assert manager.layout_digest() == mig.layout_digest([H100], [(H100, "3g.40gb", 4)])
    manager_for(fake).prepare(mig_block("1g.10gb", 0))  # made by hand beside the agent
    assert manager.layout_digest() == mig.layout_digest([H100], [(H100, "3g.40gb", 4), (H100, "1g.10gb", 0)])
    fake.fail("nvmlDeviceGetHandleByUUID", 999)
    assert manager.layout_digest() not in (None, mig.layout_digest([H100], [(H100, "3g.40gb", 4),
                                                                            (H100, "1g.10gb", 0)]))


# --- the manager's side ------------------------------------------------------------------------------

@pytest.mark.django_db
def test_an_instance_in_use_is_kept_and_the_layout_instance_over_its_slices_waits(
        alice, django_capture_on_commit_callbacks):
    node = fixed_node("mig-node", ("4g.40gb", 0), ("3g.40gb", 4))
    held = session_create(owner=alice, name="held", resources={"mig_profile": "4g.40gb"})
    schedule(django_capture_on_commit_callbacks)
    node.mig_layout = layout(("2g.20gb", 2), ("3g.40gb", 4))
    node.save(update_fields=["mig_layout"])

    change = node_mig_layout_apply(node=node)

    assert change.removed == () and change.added == ()
    assert [(p["profile"], p["start"], p["action"]) for p in change.pending] == \
        [("4g.40gb", 0, "destroy"), ("2g.20gb", 2, "create")]
    assert "4g.40gb@0 (in use)" in change.pending[1]["reason"]
    assert sorted(GpuInstance.objects.values_list("profile", "placement_start", "session")) == \
        [("3g.40gb", 4, None), ("4g.40gb", 0, held.pk)]  # nothing planned over the slices in use


@pytest.mark.django_db
def test_a_change_to_a_node_whose_agent_is_offline_is_sent_when_it_registers_again(
        staff, django_capture_on_commit_callbacks):
    node = fixed_node("mig-node", ("7g.80gb", 0))
    Node.objects.filter(pk=node.pk).update(status=NodeStatus.LOST)

    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = client_for(staff).patch(NODE_MIG.format("mig-node"), {"mig_layout": layout(("3g.40gb", 4))},
                                           format="json", HTTP_IF_MATCH="*")

    body = response.json()
    assert response.status_code == 200 and pushes(callbacks) == []
    assert body["applied"] == "pending-agent-offline" and "offline" in body["sync"]["detail"]
    assert body["sync"]["destroying"] == [{"gpu": H100, "profile": "7g.80gb", "start": 0}]
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        agent_register(node="mig-node", inventory={"devices": [GPU.as_dict()], "plugins": [], "attributes": {}},
                       running=[])
    [(name, message)] = pushes(callbacks)
    assert (name, message["kind"], message["expected"], message["destroy"]) == (
        "mig-node", "start", {H100: [{"profile": "3g.40gb", "start": 4}]}, {H100: [{"profile": "7g.80gb",
                                                                                   "start": 0}]})


@pytest.mark.django_db
def test_the_admin_form_pushes_a_mig_change_and_says_what_became_of_it(admin, django_capture_on_commit_callbacks):
    node = fixed_node("mig-node", ("7g.80gb", 0))
    client = Client()
    client.force_login(admin)
    url = f"/admin/accelerators/node/{node.pk}/change/"
    form = client.get(url).context["adminform"].form
    data = {k: v for k, v in form.initial.items() if v is not None and not isinstance(v, (list, dict))}
    data.update({"mig_mode": "fixed", "mig_layout": '{"0": [{"profile": "3g.40gb", "start": 4}]}',
                 "resource_group": "", "plugins": "[]", "attributes": "{}"})
    for prefix in ("devices", "device_links"):
        data.update({f"{prefix}-TOTAL_FORMS": "0", f"{prefix}-INITIAL_FORMS": "0"})

    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        page = client.post(url, data, follow=True)

    assert "MIG layout of mig-node: sent" in page.content.decode()
    [(_, message)] = pushes(callbacks)
    assert (message["kind"], message["destroy"]) == ("layout", {H100: [{"profile": "7g.80gb", "start": 0}]})
    data["device_split_count"] = "4"  # a change that is not MIG's: nothing is sent
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        client.post(url, data)
    assert pushes(callbacks) == [] and Node.objects.get(pk=node.pk).device_split_count == 4


@pytest.mark.django_db
def test_the_agents_report_on_the_latest_push_sets_the_state_and_an_older_ones_does_not(
        alice, admin, django_capture_on_commit_callbacks):
    node = fixed_node("mig-node", ("7g.80gb", 0))
    with django_capture_on_commit_callbacks(execute=False):
        node_mig_settings_apply(node=node)
        node.mig_layout = layout(("4g.40gb", 0))
        node.save(update_fields=["mig_layout"])
        node_mig_settings_apply(node=node)
    assert (node.mig_sync["state"], node.mig_sync["seq"]) == ("sent", 2)

    node_mig_report_apply(node_name="mig-node", report=MigReport.decode({"gpus": [H100], "unknown": [], "recreated": [],
                                                        "errors": [], "destroyed": [], "kind": "layout", "seq": 1}))
    assert node_mig_sync_view(node=Node.objects.get(pk=node.pk))["applied"] == "sent"

    node_mig_report_apply(node_name="mig-node", report=MigReport.decode({
        "gpus": [H100], "unknown": [], "recreated": [], "kind": "layout", "seq": 2,
        "destroyed": [{"gpu": H100, "profile": "7g.80gb", "start": 0}],
        "errors": [{"gpu": H100, "profile": "4g.40gb", "start": 0, "reason": "the GPU must be reset before its MIG "
                                                                            "mode change takes effect"}]}))
    view = node_mig_sync_view(node=Node.objects.get(pk=node.pk))
    assert (view["applied"], view["destroying"]) == ("error", [])
    assert "must be reset" in view["detail"] and view["errors"][0]["profile"] == "4g.40gb"
    [gpu] = client_for(alice).get("/api/v1/mig/layouts/", {"node": "mig-node"}).json()["results"]
    assert gpu["sync"]["applied"] == "error" and "must be reset" in gpu["sync"]["errors"][0]["reason"]
    page = Client()
    page.force_login(admin)
    text = page.get(f"/admin/accelerators/node/{node.pk}/change/").content.decode()
    assert "<strong>error</strong>" in text and "must be reset" in text


@pytest.mark.django_db
def test_a_heartbeat_digest_that_matches_sends_nothing_and_one_that_differs_twice_asks_once(
        django_capture_on_commit_callbacks):
    node = fixed_node("mig-node", ("3g.40gb", 4))
    expected = node_mig_layout_digest(node=node)
    stranger = mig.layout_digest([H100], [(H100, "3g.40gb", 4), (H100, "1g.10gb", 0)])

    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        assert node_mig_heartbeat_check(node_name="mig-node", digest=expected) is False
        assert node_mig_heartbeat_check(node_name="mig-node", digest=None) is False
        assert Node.objects.get(pk=node.pk).mig_drift == {}
        assert node_mig_heartbeat_check(node_name="mig-node", digest=stranger) is False  # seen once
        assert pushes(callbacks) == []
        assert node_mig_heartbeat_check(node_name="mig-node", digest=stranger) is True  # the same, again
        assert node_mig_heartbeat_check(node_name="mig-node", digest=stranger) is False  # asked already
        assert node_mig_heartbeat_check(node_name="mig-node", digest=stranger) is False

    [(_, message)] = pushes(callbacks)
    assert (message["kind"], message["expected"]) == ("drift", {H100: [{"profile": "3g.40gb", "start": 4}]})
    node_mig_report_apply(node_name="mig-node", report=MigReport.decode({
        "gpus": [H100], "recreated": [], "errors": [], "destroyed": [], "kind": "drift", "seq": message["seq"],
        "unknown": [{"gpu": H100, "profile": "1g.10gb", "start": 0, "uuid": "MIG-by-hand"}]}))
    assert GpuInstance.objects.get(placement_start=0).is_unknown
    assert node_mig_layout_digest(node=node) == stranger  # the record now matches the GPU
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        assert node_mig_heartbeat_check(node_name="mig-node", digest=stranger) is False
    assert pushes(callbacks) == [] and Node.objects.get(pk=node.pk).mig_drift == {}


@pytest.mark.django_db
def test_a_change_that_waits_for_a_session_is_pushed_when_the_session_ends(alice, django_capture_on_commit_callbacks):
    node = fixed_node("mig-node", ("4g.40gb", 0), ("3g.40gb", 4))
    held = session_create(owner=alice, name="held", resources={"mig_profile": "4g.40gb"})
    schedule(django_capture_on_commit_callbacks)
    node.mig_layout = layout(("3g.40gb", 4))
    node.save(update_fields=["mig_layout"])
    with django_capture_on_commit_callbacks(execute=False):
        node_mig_settings_apply(node=node)
    assert [p["profile"] for p in node.mig_sync["pending"]] == ["4g.40gb"]

    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        end(ComputeSession.objects.get(pk=held.pk))
    [retry] = [cb for cb in callbacks if getattr(cb, "func", None) is node_mig_pending_retry]
    with django_capture_on_commit_callbacks(execute=False) as sent:
        retry()

    [(_, message)] = pushes(sent)
    assert message["destroy"] == {H100: [{"profile": "4g.40gb", "start": 0}]}
    assert message["expected"] == {H100: [{"profile": "3g.40gb", "start": 4}]}
    assert Node.objects.get(pk=node.pk).mig_sync["pending"] == []


# --- the whole chain: PATCH / heartbeat → mig_reconcile task → agent → mig_report task ---------------

class TidyManager(CeleryManager):
    """The agent's Celery manager; with eager Celery the manager's tasks run in the agent's worker
    threads, whose database connections are closed after each call (the test database is dropped
    at the end of the run). Counts the heartbeats the manager has processed."""

    def __init__(self, node: str) -> None:
        from common.celery import app

        super().__init__(app, node=node)
        self.heartbeats = 0

    def _tidy(self, call, *args):
        try:
            call(*args)
        finally:
            connections.close_all()

    def register(self, *args):
        self._tidy(super().register, *args)

    def heartbeat(self, *args):
        self._tidy(super().heartbeat, *args)
        self.heartbeats += 1

    def report(self, *args):
        self._tidy(super().report, *args)

    def log(self, *args):
        self._tidy(super().log, *args)

    def mig_report(self, *args):
        self._tidy(super().mig_report, *args)


@contextmanager
def running_agent(node: str, fake: FakeNvml, tmp_path, *, heartbeat_s: float = 60.0):
    """A real Agent for `node` on an event loop of its own thread, its MIG through the fake NVML,
    registered (so the manager's start reconcile was answered) before the block runs."""
    import agent.tasks  # noqa: F401  (the agent's tasks: with eager Celery the manager's sends run them here)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=f"agent-{node}", daemon=True)
    thread.start()
    manager = TidyManager(node)
    agent = Agent(node=node, inventory={"devices": [GPU.as_dict()], "plugins": [], "attributes": {}, "cpu_count": 8,
                                        "memory_size": 32 * GiB},
                  channel_layer=InMemoryChannelLayer(), manager=manager, scratch_root=tmp_path / uuid.uuid4().hex,
                  mock=False, heartbeat_s=heartbeat_s)
    agent.mig = runtime_mig.MigManager(runtime_mig.NvmlMigBackend(fake), on_report=agent._send_mig_report)
    asyncio.run_coroutine_threadsafe(agent.start(), loop).result(30)
    try:
        wait_until(lambda: sync_of(node)["applied"] == "applied", what="the start reconcile's report")
        yield agent, manager
    finally:
        asyncio.run_coroutine_threadsafe(agent.shutdown(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def sync_of(node: str) -> dict:
    return node_mig_sync_view(node=Node.objects.get(name=node))


@pytest.mark.django_db(transaction=True)
def test_a_patch_reaches_the_running_agent_which_applies_it_and_the_layouts_api_says_so(staff, tmp_path):
    fixed_node("gpu-node", ("7g.80gb", 0))
    fake = FakeNvml([h100()])
    with running_agent("gpu-node", fake, tmp_path):
        assert on_gpu(fake) == [("7g.80gb", 0)]

        response = client_for(staff).patch(NODE_MIG.format("gpu-node"), {
            "mig_layout": layout(("4g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6))}, format="json", HTTP_IF_MATCH="*")

        assert response.status_code == 200 and response.json()["applied"] == "sent"
        wait_until(lambda: sync_of("gpu-node")["applied"] == "applied", what="the agent's report on the new layout")
        assert on_gpu(fake) == [("1g.10gb", 6), ("2g.20gb", 4), ("4g.40gb", 0)]
    [gpu] = client_for(staff).get("/api/v1/mig/layouts/", {"node": "gpu-node"}).json()["results"]
    assert (gpu["sync"]["applied"], gpu["sync"]["kind"], gpu["sync"]["destroying"]) == ("applied", "layout", [])
    assert sorted((i["profile"], i["state"], i["uuid"].startswith("MIG-")) for i in gpu["instances"]) == \
        [("1g.10gb", "idle", True), ("2g.20gb", "idle", True), ("4g.40gb", "idle", True)]


@pytest.mark.django_db(transaction=True)
def test_an_instance_in_use_survives_a_patch_as_pending_and_goes_when_its_session_ends(staff, alice, tmp_path):
    fixed_node("gpu-node", ("4g.40gb", 0), ("3g.40gb", 4))
    fake = FakeNvml([h100()])
    with running_agent("gpu-node", fake, tmp_path):
        session = session_create(owner=alice, name="held", resources={"mig_profile": "4g.40gb"})
        wait_until(lambda: ComputeSession.objects.get(pk=session.pk).status == SessionStatus.RUNNING,
                   what="the session to run on the 4g.40gb instance")

        response = client_for(staff).patch(NODE_MIG.format("gpu-node"), {
            "mig_layout": layout(("3g.40gb", 0), ("3g.40gb", 4))}, format="json", HTTP_IF_MATCH="*")

        body = response.json()
        assert body["applied"] == "sent"
        assert [(p["profile"], p["start"], p["action"]) for p in body["sync"]["pending"]] == \
            [("4g.40gb", 0, "destroy"), ("3g.40gb", 0, "create")]
        wait_until(lambda: sync_of("gpu-node")["applied"] == "pending", what="the agent's report, changes pending")
        assert on_gpu(fake) == [("3g.40gb", 4), ("4g.40gb", 0)]  # the instance in use is still there

        session_terminate(session=ComputeSession.objects.get(pk=session.pk))
        wait_until(lambda: sync_of("gpu-node")["applied"] == "applied", what="the layout once the session ended")
        assert on_gpu(fake) == [("3g.40gb", 0), ("3g.40gb", 4)]
    assert sorted(GpuInstance.objects.values_list("profile", "placement_start")) == [("3g.40gb", 0), ("3g.40gb", 4)]


@pytest.mark.django_db(transaction=True)
def test_heartbeats_whose_digest_matches_send_nothing_and_a_stranger_is_found_by_them(tmp_path):
    fixed_node("gpu-node", ("3g.40gb", 4))
    fake = FakeNvml([h100()])
    with running_agent("gpu-node", fake, tmp_path, heartbeat_s=0.05) as (agent, manager):
        wait_until(lambda: manager.heartbeats >= 6, what="six heartbeats the manager has processed")
        node = Node.objects.get(name="gpu-node")
        assert (node.mig_sync["seq"], node.mig_sync["kind"], node.mig_drift) == (1, "start", {})

        stranger = manager_for(fake).prepare(mig_block("1g.10gb", 0))  # made by hand while the agent runs

        row = wait_until(lambda: GpuInstance.objects.filter(unknown_since__isnull=False).first(),
                         what="the heartbeats to notice the stranger and the reconcile to record it")
        assert (row.profile, row.placement_start, row.uuid) == ("1g.10gb", 0, stranger.uuid)
        assert sync_of("gpu-node")["kind"] == "drift"
        assert on_gpu(fake) == [("1g.10gb", 0), ("3g.40gb", 4)]  # left in place: it may hold someone's work
