"""The fragmentation map and compaction plan on the database (issue 17.4): GET
/api/v1/fragmentation/ (administrators), the admin page per resource group, and applying the
plan (one logged admin action): the moved session gets a preemption notice, stops at its time
with the reason and starts again, a non-preemptible session is never moved, and the waiting
session then starts."""
from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.conf import settings
from django.contrib.admin.models import LogEntry
from django.test import Client
from django.utils import timezone

from accelerators.models import Node, ResourceGroup
from sessions.models import ComputeSession, SessionStatus
from sessions.scheduling.scheduler import schedule_pending
from sessions.lifecycle.services import PREEMPTED, session_report_apply
from sessions.admission.launch import session_create
from tests.conftest import client_for
from tests.seed import make_cluster, mock_gpu

pytestmark = pytest.mark.django_db

GPU_N1 = "GPU-00000000-0000-0000-0000-000000000000"
GPU_N2 = "GPU-00000001-0000-0000-0000-000000000000"


def run(owner, name: str, fgpu: str, *, command: str = "sleep 1000", pin: str | None = None) -> ComputeSession:
    resources = {"cuda.shares": fgpu, "mem": "64M", **({"devices": [pin]} if pin else {})}
    session = session_create(owner=owner, name=name, resources=resources, command=command)
    schedule_pending()
    assert session_report_apply(session_id=str(session.pk), status=SessionStatus.RUNNING)
    ComputeSession.objects.filter(pk=session.pk).update(started_at=timezone.now() - timedelta(hours=2))
    return ComputeSession.objects.get(pk=session.pk)


@pytest.fixture
def fragmented(alice, bob):
    """Two nodes of one 2 fGPU GPU in group "default": n1 holds an interactive 1.5 (0.5 free),
    n2 a preemptible batch 0.5 and an interactive 1 (0.5 free); bob's 1 fGPU waits."""
    make_cluster(nodes={"n1": [mock_gpu(0, node=0)], "n2": [mock_gpu(0, node=1)]})
    group = ResourceGroup.objects.create(name="default", policy="binpack")
    Node.objects.update(resource_group=group)
    filler = run(alice, "filler", "2", pin=GPU_N1)  # n1 full while the job is placed: it goes to n2
    job = run(alice, "job", "0.5")
    assert job.node.name == "n2"
    session_report_apply(session_id=str(filler.pk), status=SessionStatus.TERMINATED, reason="done")
    shell = run(alice, "shell", "1.5", command="", pin=GPU_N1)
    notebook = run(alice, "notebook", "1", command="", pin=GPU_N2)
    waiting = session_create(owner=bob, name="waiting", resources={"cuda.shares": "1", "mem": "64M"})
    schedule_pending()
    assert ComputeSession.objects.get(pk=waiting.pk).status == SessionStatus.PENDING
    return group, job, shell, notebook, waiting


def test_the_api_shows_free_fgpu_stranded_capacity_and_a_plan_that_moves_only_the_preemptible_session(
        fragmented, admin, alice):
    group, job, shell, notebook, waiting = fragmented

    answer = client_for(admin).get("/api/v1/fragmentation/?group=default")

    assert answer.status_code == 200
    (body,) = answer.json()
    assert (body["free"], body["largest_fgpu"]) == ("1", "0.5")  # 0.5 + 0.5 free, on two nodes
    assert body["stranded"] == "0"  # the 0.5 fGPU job's shape uses either half
    assert body["target"]["id"] == str(waiting.pk)
    plan = body["plan"]
    assert plan["node"] == "n2" and plan["sessions_moved"] == 1 and not plan["fits_now"]
    assert [(m["session"], m["from_node"], m["to_node"]) for m in plan["moves"]] == [(str(job.pk), "n2", "n1")]
    assert plan["work_lost_fgpu_seconds"] == pytest.approx(0.5 * 7200, rel=0.01)
    assert client_for(alice).get("/api/v1/fragmentation/").status_code == 403
    assert client_for(admin).get("/api/v1/fragmentation/?group=nope").json() == []


def test_capacity_no_recent_shape_can_use_is_stranded(fragmented, admin, alice):
    ComputeSession.objects.filter(name="job").update(created_at=timezone.now() - timedelta(days=30))  # not recent
    answer = client_for(admin).get("/api/v1/fragmentation/?group=default").json()[0]
    # Seen lately: 1.5, 1 and 1 fGPU (and the filler's 2): no 0.5 fGPU half can serve any of them.
    assert answer["stranded"] == "1" and answer["largest_shape"] is None


def test_applying_the_plan_moves_the_session_logs_it_and_the_waiting_session_starts(fragmented, admin):
    group, job, shell, notebook, waiting = fragmented
    page = Client()
    page.force_login(admin)

    shown = page.get(f"/admin/compute_sessions/fragmentationmap/{group.pk}/change/")
    assert shown.status_code == 200
    html = shown.content.decode()
    assert "Move 1 session off <strong>n2</strong>" in html and "Apply the plan" in html

    applied = page.post(f"/admin/compute_sessions/fragmentationmap/{group.pk}/change/", {"expected": str(job.pk)})

    assert applied.status_code == 302
    job = ComputeSession.objects.get(pk=job.pk)  # the same notice and grace as a preemption (issue 32.2)
    assert job.status == SessionStatus.RUNNING and job.preempted_for_id == waiting.pk
    assert job.status_reason.startswith("to be moved at ") and "by root to compact resource group default" in job.status_reason
    grace = settings.FGPU_PREEMPTION_GRACE_SECONDS
    assert grace - 5 <= (job.preempt_at - timezone.now()).total_seconds() <= grace
    for untouched in (shell, notebook):
        assert ComputeSession.objects.get(pk=untouched.pk).status == SessionStatus.RUNNING
    entry = LogEntry.objects.get(object_id=str(group.pk))
    assert entry.user == admin and "moving 1 session(s) from n2 for waiting" in entry.change_message

    schedule_pending()  # before its time: it runs on
    assert ComputeSession.objects.get(pk=job.pk).status == SessionStatus.RUNNING
    ComputeSession.objects.filter(pk=job.pk).update(preempt_at=timezone.now() - timedelta(seconds=1))  # its time came
    schedule_pending()
    job = ComputeSession.objects.get(pk=job.pk)
    assert job.status == SessionStatus.TERMINATING and job.status_reason.startswith(PREEMPTED + "stopped to make room")

    session_report_apply(session_id=str(job.pk), status=SessionStatus.TERMINATED, reason="terminated")
    schedule_pending()  # places the waiting session, launches the moved one again
    schedule_pending()  # places the moved one

    assert ComputeSession.objects.get(pk=waiting.pk).node.name == "n2"
    job = ComputeSession.objects.get(pk=job.pk)
    again = ComputeSession.objects.get(pk=job.requeued_as_id)
    assert (again.command, again.preemptible, again.request_spec) == (job.command, True, job.request_spec)
    assert again.requeued_from_id == job.pk and again.created_at == job.created_at  # its place by arrival
    assert (again.status, again.node.name) == (SessionStatus.SCHEDULED, "n1")
    assert job.status_reason.startswith(PREEMPTED) and job.status_reason.endswith(f"requeued as session {again.pk}")


def test_a_plan_that_changed_is_refused_and_a_group_with_nothing_to_move_says_so(fragmented, admin):
    group, job, *_ = fragmented
    client = client_for(admin)

    changed = client.post("/api/v1/fragmentation/apply/", {"group": "default", "expected": [str(uuid.uuid4())]},
                          format="json")
    assert changed.status_code == 409 and changed.json()["type"] == "plan-changed"
    assert ComputeSession.objects.get(pk=job.pk).status == SessionStatus.RUNNING  # nothing done

    ComputeSession.objects.filter(pk=job.pk).update(preemptible=False)
    nothing = client.post("/api/v1/fragmentation/apply/", {"group": "default"}, format="json")
    assert nothing.status_code == 409 and nothing.json()["type"] == "nothing-to-apply"
    assert client.get("/api/v1/fragmentation/?group=default").json()[0]["plan"] is None


# --- the implicit default group (issue 32.5) ------------------------------------------------------------

@pytest.fixture
def ungrouped(alice, bob):
    """The fragmented cluster with its nodes in no resource group (as `make run` leaves them)."""
    make_cluster(nodes={"n1": [mock_gpu(0, node=0)], "n2": [mock_gpu(0, node=1)]})
    assert not ResourceGroup.objects.exists()
    filler = run(alice, "filler", "2", pin=GPU_N1)
    job = run(alice, "job", "0.5")
    session_report_apply(session_id=str(filler.pk), status=SessionStatus.TERMINATED, reason="done")
    run(alice, "shell", "1.5", command="", pin=GPU_N1)
    run(alice, "notebook", "1", command="", pin=GPU_N2)
    waiting = session_create(owner=bob, name="waiting", resources={"cuda.shares": "1", "mem": "64M"})
    schedule_pending()
    return job, waiting


def test_without_resource_groups_the_nodes_form_the_implicit_default_group_in_the_api(ungrouped, admin):
    job, waiting = ungrouped

    every = client_for(admin).get("/api/v1/fragmentation/").json()
    named = client_for(admin).get("/api/v1/fragmentation/?group=default").json()

    assert len(every) == len(named) == 1 and every[0]["devices"] == named[0]["devices"]
    (body,) = every
    assert (body["group"], body["implicit"]) == ("default", True)
    assert sorted({d["node"] for d in body["devices"]}) == ["n1", "n2"]
    assert (body["free"], body["largest_fgpu"]) == ("1", "0.5")
    assert body["target"]["id"] == str(waiting.pk)
    assert [m["session"] for m in body["plan"]["moves"]] == [str(job.pk)]


def test_a_real_group_named_default_replaces_the_implicit_one_and_ungrouped_nodes_beside_groups_keep_it(ungrouped, admin):
    ResourceGroup.objects.create(name="other")
    Node.objects.filter(name="n1").update(resource_group=ResourceGroup.objects.get(name="other"))

    beside = client_for(admin).get("/api/v1/fragmentation/").json()
    assert [(g["group"], g["implicit"]) for g in beside] == [("default", True), ("other", False)]

    ResourceGroup.objects.create(name="default")
    named = client_for(admin).get("/api/v1/fragmentation/").json()
    assert [(g["group"], g["implicit"]) for g in named] == [("default", False), ("other", False)]


def test_the_implicit_groups_page_shows_its_map_and_applies_its_plan(ungrouped, admin):
    job, waiting = ungrouped
    page = Client()
    page.force_login(admin)

    listed = page.get("/admin/compute_sessions/fragmentationmap/").content.decode()
    shown = page.get("/admin/compute_sessions/fragmentationmap/default/")

    assert "/admin/compute_sessions/fragmentationmap/default/" in listed
    assert shown.status_code == 200
    html = shown.content.decode()
    assert "the nodes in no resource group" in html and "Move 1 session off <strong>n2</strong>" in html
    applied = page.post("/admin/compute_sessions/fragmentationmap/default/", {"expected": str(job.pk)})
    assert applied.status_code == 302
    assert ComputeSession.objects.get(pk=job.pk).preempted_for_id == waiting.pk  # under notice (issue 32.2: moved with grace)


def test_the_implicit_group_is_applied_through_the_api_and_an_unknown_group_is_a_400(ungrouped, admin):
    job, waiting = ungrouped
    client = client_for(admin)

    unknown = client.post("/api/v1/fragmentation/apply/", {"group": "nope"}, format="json")
    applied = client.post("/api/v1/fragmentation/apply/", {"group": "default", "expected": [str(job.pk)]}, format="json")

    assert unknown.status_code == 400 and "no resource group 'nope'" in unknown.json()["detail"]
    assert applied.status_code == 200, applied.content
    assert applied.json()["moved"][0]["session"] == str(job.pk)
