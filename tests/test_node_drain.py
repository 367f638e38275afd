"""Draining a node (issue 37.4; accelerators.drain): no new session is placed on a draining node
(the scheduler's pass, the launch preview, the kept cluster view and the database's read alike),
its running sessions go on, or with eviction get the preemption notice and grace, are stopped and
requeued elsewhere; "draining: N sessions left" then "drained"; undrain reverses it and takes
back the notices; the drain outlives the agent's heartbeats and re-registration (the database's).
REST (administrators only, idempotent, in the schema), the admin's actions and node page, and
the what-if answering a drain. The clock is moved by writing `preempt_at` (no sleeping)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from accelerators.drain import node_drain, node_drain_state, node_undrain
from accelerators.models import Node
from accelerators.selectors import node_states
from accelerators.services import node_heartbeat, node_inventory_apply
from sessions.admission.launch import launch_preview, session_create
from sessions.lifecycle.services import PREEMPTED, session_report_apply
from sessions.models import ComputeSession, SessionStatus
from sessions.scheduling import preemption
from sessions.scheduling.scheduler import schedule_pending
from tests.conftest import assert_error_shape, client_for, make_running
from tests.seed import GiB, make_cluster, mock_gpu

pytestmark = pytest.mark.django_db

WHOLE = {"cuda.shares": "2", "mem": "64M"}  # one 8 GiB GPU: 2 fGPU


@pytest.fixture
def two_nodes(settings):
    """n1 and n2, one 8 GiB GPU (2 fGPU) each; a minute's preemption notice (preemption itself off)."""
    settings.FGPU_PREEMPTION_GRACE_SECONDS = 60
    return make_cluster(nodes={"n1": [mock_gpu(0)], "n2": [mock_gpu(0, node=1)]})


def fresh(session) -> ComputeSession:
    return ComputeSession.objects.get(pk=session.pk)


def on(node: str, owner, name: str, **fields) -> ComputeSession:
    """A RUNNING session of `owner` holding a whole GPU of `node` (the other node drained meanwhile)."""
    other = "n2" if node == "n1" else "n1"
    node_drain(node_name=other)
    session = session_create(owner=owner, name=name, resources=WHOLE, command="sleep 1000", **fields)
    schedule_pending()
    node_undrain(node_name=other)
    session = make_running(session)
    assert session.node.name == node
    return session


def test_no_new_session_is_placed_on_a_draining_node_by_the_pass_the_preview_or_either_read(two_nodes, alice):
    from accelerators.cluster_view import cluster_view

    assert [n.node_id for n in node_states(slot_name="cuda")] == ["n1", "n2"]  # the kept view, read in full
    reads = cluster_view().reads
    node_drain(node_name="n1", reason="driver upgrade")

    assert [n.node_id for n in node_states(slot_name="cuda")] == ["n2"]  # the kept view (PostgreSQL), from the change log
    assert cluster_view().reads == reads  # the trigger logged the drain: no full read again
    assert [n.node_id for n in node_states(slot_name="cuda", kept=False)] == ["n2"]  # the database's read
    first = session_create(owner=alice, name="first", resources=WHOLE)
    schedule_pending()
    assert fresh(first).node.name == "n2"

    preview = launch_preview(resources=WHOLE, owner=alice)  # n2 is full, n1 draining
    assert not preview["fits_now"], preview
    second = session_create(owner=alice, name="second", resources=WHOLE)
    schedule_pending()
    assert fresh(second).status == SessionStatus.PENDING
    assert fresh(second).status_reason.startswith("waiting for capacity"), fresh(second).status_reason

    node_undrain(node_name="n1")
    schedule_pending()
    assert fresh(second).status == SessionStatus.SCHEDULED and fresh(second).node.name == "n1"


def test_without_evict_running_sessions_go_on_and_the_node_is_drained_once_none_is_left(two_nodes, alice):
    job = on("n1", alice, "job")

    node, state = node_drain(node_name="n1", reason="disk swap", by="root")
    schedule_pending()

    assert (state.state, state.label, state.sessions_left) == ("draining", "draining: 1 session left", 1)
    assert fresh(job).status == SessionStatus.RUNNING and fresh(job).preempt_at is None
    session_report_apply(session_id=str(job.pk), status=SessionStatus.TERMINATED, reason="exited")
    schedule_pending()
    assert node_drain_state(Node.objects.get(name="n1")).label == "drained"
    assert not ComputeSession.objects.filter(requeued_from=job).exists()  # ended on its own: not requeued


def test_evict_gives_the_preemption_notice_stops_at_its_time_and_requeues_on_another_node(two_nodes, alice):
    job = on("n1", alice, "job", preempt_signal="SIGUSR1")

    node_drain(node_name="n1", evict=True, reason="disk swap", by="root")
    schedule_pending()

    job = fresh(job)
    assert job.status == SessionStatus.RUNNING and job.preempted_for_id is None
    assert job.preempt_at is not None and 55 <= (job.preempt_at - timezone.now()).total_seconds() <= 60
    assert job.status_reason.startswith("to be evicted at ") and "node n1 is drained by root: disk swap" in job.status_reason
    assert preemption.notices_send(timezone.now()) == [str(job.pk)]  # pty.preempt: the line and SIGUSR1
    noticed = (job.preempt_at, job.version)
    schedule_pending()  # again before its time: the notice stands as it was
    assert (fresh(job).preempt_at, fresh(job).version) == noticed

    ComputeSession.objects.filter(pk=job.pk).update(preempt_at=timezone.now() - timedelta(seconds=1))  # its time came
    schedule_pending()
    job = fresh(job)
    assert job.status == SessionStatus.TERMINATING
    assert job.status_reason.startswith(PREEMPTED + "node n1 drained by root: disk swap")

    session_report_apply(session_id=str(job.pk), status=SessionStatus.TERMINATED, reason="terminated")
    schedule_pending()
    job = fresh(job)
    again = ComputeSession.objects.get(requeued_from=job)
    assert job.requeued_as_id == again.pk and "requeued as session" in job.status_reason
    assert again.created_at == job.created_at  # its place by arrival
    schedule_pending()  # the pass after the one that requeued it
    again = fresh(again)
    assert again.status == SessionStatus.SCHEDULED and again.node.name == "n2"  # never back on the drained node
    assert node_drain_state(Node.objects.get(name="n1")).state == "drained"


def test_undrain_reverses_a_drain_and_takes_back_its_eviction_notices(two_nodes, alice):
    job = on("n1", alice, "job")
    node_drain(node_name="n1", evict=True)
    schedule_pending()
    assert fresh(job).preempt_at is not None

    node, state = node_undrain(node_name="n1")
    schedule_pending()

    assert state.state == "in service" and node.drain_since is None
    assert fresh(job).preempt_at is None and fresh(job).status == SessionStatus.RUNNING
    assert fresh(job).status_reason == ""
    assert [n.node_id for n in node_states(slot_name="cuda")] == ["n1", "n2"]


def test_a_drain_survives_heartbeats_and_the_agent_registering_again(two_nodes):
    node_drain(node_name="n1", reason="maintenance")
    since = Node.objects.get(name="n1").drain_since

    assert node_heartbeat(node_name="n1")
    node_inventory_apply(node_name="n1", devices=[mock_gpu(0)], plugins=["ai.backend.accelerator.mock"], attributes={},
                         cpu_count=8, memory_size=32 * GiB)

    node = Node.objects.get(name="n1")
    assert (node.drain_since, node.drain_reason) == (since, "maintenance")
    assert [n.node_id for n in node_states(slot_name="cuda")] == ["n2"]


def test_draining_twice_keeps_its_start_and_evict_only_turns_on(two_nodes):
    node, _ = node_drain(node_name="n1", reason="first")
    again, state = node_drain(node_name="n1", evict=True)
    once_more, _ = node_drain(node_name="n1", evict=False, reason="second")

    assert again.drain_since == node.drain_since == once_more.drain_since
    assert once_more.drain_evict and once_more.drain_reason == "second"
    assert state.state == "drained" and state.evict


# --- REST -----------------------------------------------------------------------------------------


def test_an_administrator_drains_and_undrains_through_rest_idempotently(two_nodes, staff, alice):
    on("n1", alice, "job")
    admin = client_for(staff)

    first = admin.post("/api/v1/nodes/n1/drain/", {"evict": False, "reason": "driver upgrade"}, format="json")
    again = admin.post("/api/v1/nodes/n1/drain/", {}, format="json")

    assert first.status_code == again.status_code == 200, first.content
    body = first.json()
    assert {k: body[k] for k in ("node", "state", "label", "sessions_left", "evict", "reason", "by")} == {
        "node": "n1", "state": "draining", "label": "draining: 1 session left", "sessions_left": 1, "evict": False,
        "reason": "driver upgrade", "by": "root"}
    assert again.json() == body  # a 200 with its state, nothing changed
    listed = {n["name"]: n for n in client_for(alice).get("/api/v1/nodes/").json()["results"]}
    assert listed["n1"]["drain"]["label"] == "draining: 1 session left" and listed["n2"]["drain"] is None

    undrained = admin.post("/api/v1/nodes/n1/undrain/")
    assert undrained.status_code == 200 and undrained.json()["state"] == "in service"
    assert admin.post("/api/v1/nodes/n1/undrain/").json() == undrained.json()
    assert client_for(alice).get("/api/v1/nodes/n1/").json()["drain"] is None


def test_only_administrators_drain_and_bad_input_is_a_400_not_a_500(two_nodes, alice, staff):
    for path in ("/api/v1/nodes/n1/drain/", "/api/v1/nodes/n1/undrain/"):
        assert_error_shape(client_for(alice).post(path, {}, format="json"), 403)
        assert client_for(None).post(path, {}, format="json").status_code in (401, 403)
    assert Node.objects.get(name="n1").drain_since is None
    admin = client_for(staff)
    assert_error_shape(admin.post("/api/v1/nodes/n9/drain/", {}, format="json"), 404)
    assert_error_shape(admin.post("/api/v1/nodes/n9/undrain/"), 404)
    body = assert_error_shape(admin.post("/api/v1/nodes/n1/drain/", {"reason": "x" * 201}, format="json"), 400)
    assert "reason" in body["field_errors"]
    body = assert_error_shape(admin.post("/api/v1/nodes/n1/drain/", {"evict": "perhaps"}, format="json"), 400)
    assert "evict" in body["field_errors"]
    assert_error_shape(admin.post("/api/v1/nodes/n1/drain/", "[1]", content_type="application/json"), 400)
    assert admin.get("/api/v1/nodes/n1/drain/").status_code == 405
    assert Node.objects.get(name="n1").drain_since is None


def test_the_schema_names_drain_and_undrain():
    from tests.test_openapi import SCHEMA as schema  # as /api/schema/ served it (built once a run)

    drain = schema["paths"]["/api/v1/nodes/{name}/drain/"]["post"]
    assert "DrainRequest" in str(drain["requestBody"]) and "DrainState" in str(drain["responses"]["200"])
    assert "post" in schema["paths"]["/api/v1/nodes/{name}/undrain/"]


# --- what-if --------------------------------------------------------------------------------------


def test_the_what_if_answers_a_drain_before_it_is_done(two_nodes, alice, staff):
    job = on("n1", alice, "job")
    node_drain(node_name="n1")  # no eviction: job runs on; what if it were evicted now?

    answer = client_for(staff).post("/api/v1/scheduler/what-if/", {"drain": ["n1"]}, format="json")

    assert answer.status_code == 200, answer.content
    (move,) = answer.json()["moves"]
    assert move["session"] == str(job.pk) and move["from_node"] == "n1"


# --- the admin ------------------------------------------------------------------------------------


def test_the_admin_drains_from_the_list_and_the_node_page_shows_and_reverses_it(two_nodes, admin, alice):
    from django.test import Client

    on("n1", alice, "job")
    browser = Client()
    browser.force_login(admin)
    n1 = Node.objects.get(name="n1")

    listed = browser.post("/admin/accelerators/node/", {"action": "drain", "_selected_action": [str(n1.pk)]}, follow=True)
    assert listed.status_code == 200 and "Node n1: draining: 1 session left" in listed.content.decode()
    page = browser.get(f"/admin/accelerators/node/{n1.pk}/change/").content.decode()
    assert "draining: 1 session left" in page and ">Undrain</button>" in page
    assert "draining: 1 session left" in browser.get("/admin/accelerators/node/").content.decode()

    undrain = browser.post(f"/admin/accelerators/node/{n1.pk}/drain/undrain/", follow=True)
    assert "Node n1: in service" in undrain.content.decode()
    drained = browser.post(f"/admin/accelerators/node/{n1.pk}/drain/drain/",
                           {"drain_reason": "disk swap", "drain_evict": "1"}, follow=True)
    assert "Node n1: draining: 1 session left" in drained.content.decode()
    n1.refresh_from_db()
    assert (n1.drain_evict, n1.drain_reason, n1.drain_by) == (True, "disk swap", "root")
    assert browser.get(f"/admin/accelerators/node/{n1.pk}/drain/drain/").status_code == 405


def test_a_user_without_the_admin_cannot_post_the_node_pages_drain(two_nodes, staff):
    from django.test import Client

    browser = Client()
    browser.force_login(staff)  # staff without the change permission
    n1 = Node.objects.get(name="n1")
    assert browser.post(f"/admin/accelerators/node/{n1.pk}/drain/drain/").status_code == 403
    assert Node.objects.get(name="n1").drain_since is None


def test_a_session_that_starts_running_on_an_evicting_node_gets_its_notice_at_the_next_pass(two_nodes, alice):
    node_drain(node_name="n2")
    starting = session_create(owner=alice, name="starting", resources=WHOLE, command="sleep 1000")
    schedule_pending()
    node_undrain(node_name="n2")
    assert fresh(starting).status == SessionStatus.SCHEDULED and fresh(starting).node.name == "n1"

    node_drain(node_name="n1", evict=True)
    schedule_pending()
    assert fresh(starting).preempt_at is None  # not running yet: nothing to warn

    make_running(starting)
    schedule_pending()
    assert fresh(starting).preempt_at is not None and fresh(starting).status_reason.startswith("to be evicted at ")
