"""Preemption with notice (issue 17.2) through the scheduler's pass, on the database: the warning,
the stop at its time with the reason kept, the waiting session placed after, the notice taken
back when it no longer waits, never a non-preemptible session nor one inside its minimum
runtime, every step idempotent; and the launch's fields. The clock is moved by writing
`preempt_at` / `started_at` (no sleeping)."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from sessions.models import ComputeSession, SessionStatus
from sessions.scheduler import schedule_pending
from sessions.services import PREEMPTED, session_create, session_report_apply, session_terminate
from tests.conftest import client_for
from tests.seed import make_cluster, mock_gpu

pytestmark = pytest.mark.django_db


@pytest.fixture
def one_gpu(settings):
    """A node with one 8 GiB GPU (2 fGPU), preemption on with a minute's notice."""
    settings.FGPU_PREEMPTION = True
    settings.FGPU_PREEMPTION_GRACE_SECONDS = 60
    make_cluster(nodes={"n1": [mock_gpu(0)]})


def running(owner, name: str, *, fgpu: str = "2", command: str = "sleep 1000", ran_s: int = 3600, **fields):
    """A session of `owner` placed by the scheduler and reported RUNNING, started `ran_s` ago."""
    session = session_create(owner=owner, name=name, resources={"cuda.shares": fgpu, "mem": "64M"}, command=command,
                             **fields)
    schedule_pending()
    assert session_report_apply(session_id=str(session.pk), status=SessionStatus.RUNNING)
    ComputeSession.objects.filter(pk=session.pk).update(started_at=timezone.now() - timedelta(seconds=ran_s))
    return ComputeSession.objects.get(pk=session.pk)


def fresh(session) -> ComputeSession:
    return ComputeSession.objects.get(pk=session.pk)


def test_a_batch_session_is_warned_stopped_at_its_time_with_the_reason_and_the_waiting_session_starts(one_gpu, alice, staff):
    job = running(alice, "job")
    urgent = session_create(owner=staff, name="urgent", resources={"cuda.shares": "1", "mem": "64M"}, priority=5)

    schedule_pending()

    job, urgent = fresh(job), fresh(urgent)
    assert job.status == SessionStatus.RUNNING and job.preempted_for_id == urgent.pk
    assert job.preempt_at is not None and 55 <= (job.preempt_at - timezone.now()).total_seconds() <= 60
    assert job.status_reason.startswith("to be preempted at ") and "to make room for urgent of root" in job.status_reason
    assert urgent.status == SessionStatus.PENDING
    assert urgent.status_reason.startswith("waiting for capacity: preempting 1 session(s) on n1 to make room (job;")
    warned = (job.preempt_at, job.status_reason, job.version)

    schedule_pending()  # again before its time: nothing moves

    assert (fresh(job).preempt_at, fresh(job).status_reason, fresh(job).version) == warned
    assert fresh(job).status == SessionStatus.RUNNING

    ComputeSession.objects.filter(pk=job.pk).update(preempt_at=timezone.now() - timedelta(seconds=1))  # its time came
    schedule_pending()

    job = fresh(job)
    assert job.status == SessionStatus.TERMINATING
    assert job.status_reason.startswith(PREEMPTED + "stopped to make room for urgent of root")
    schedule_pending()  # a pass while it stops: nothing preempted twice, the waiter still waits
    assert fresh(urgent).status == SessionStatus.PENDING and fresh(job).status == SessionStatus.TERMINATING

    session_report_apply(session_id=str(job.pk), status=SessionStatus.TERMINATED, reason="terminated")
    schedule_pending()

    job, urgent = fresh(job), fresh(urgent)
    assert job.status == SessionStatus.TERMINATED and job.status_reason.startswith(PREEMPTED)  # the agent's words do not replace it
    assert f"(session {urgent.pk})" in job.status_reason
    assert urgent.status == SessionStatus.SCHEDULED


def test_never_an_interactive_session_nor_one_inside_its_minimum_runtime(one_gpu, alice, staff):
    shell = running(alice, "shell", fgpu="1", command="")  # interactive: not preemptible by default
    young = running(alice, "young", fgpu="1", min_runtime=7200, ran_s=600)
    urgent = session_create(owner=staff, name="urgent", resources={"cuda.shares": "1", "mem": "64M"}, priority=5)

    schedule_pending()

    assert (fresh(shell).preemptible, fresh(young).preemptible) == (False, True)
    assert fresh(shell).preempt_at is None and fresh(young).preempt_at is None
    assert fresh(urgent).status_reason.startswith("waiting for capacity: ")
    assert "preempting" not in fresh(urgent).status_reason

    ComputeSession.objects.filter(pk=young.pk).update(started_at=timezone.now() - timedelta(seconds=7300))
    schedule_pending()  # past its minimum runtime now: it goes, the shell stays

    assert fresh(young).preempted_for_id == urgent.pk and fresh(shell).preempt_at is None


def test_nothing_is_preempted_for_an_equal_priority_or_for_room_the_request_could_not_use(one_gpu, alice, bob, staff):
    job = running(alice, "job", fgpu="1")
    running(alice, "shell", fgpu="1", command="")
    session_create(owner=staff, name="too-big", resources={"cuda.shares": "2", "mem": "64M"}, priority=5)

    schedule_pending()  # 2 fGPU needs the shell's fGPU too: preempting the job alone would not make it fit

    assert fresh(job).preempt_at is None

    ComputeSession.objects.filter(name="too-big").delete()
    session_create(owner=alice, name="same", resources={"cuda.shares": "1", "mem": "64M"})
    schedule_pending()  # the same owner, the same priority: not under its share against itself

    assert fresh(job).preempt_at is None


def test_a_session_under_its_share_preempts_one_of_an_owner_over_it(one_gpu, alice, bob):
    job = running(alice, "job", ran_s=2 * 86400)  # alice used the whole GPU for two days: far over her share
    bobs = session_create(owner=bob, name="bobs", resources={"cuda.shares": "1", "mem": "64M"})

    schedule_pending()

    job = fresh(job)
    assert job.preempted_for_id == bobs.pk and "its owner is under their fair share" in job.status_reason


def test_the_notice_is_withdrawn_when_the_waiting_session_no_longer_waits(one_gpu, alice, staff):
    job = running(alice, "job")
    urgent = session_create(owner=staff, name="urgent", resources={"cuda.shares": "1", "mem": "64M"}, priority=5)
    schedule_pending()
    assert fresh(job).preempt_at is not None

    session_terminate(session=fresh(urgent))  # cancelled while pending
    schedule_pending()

    job = fresh(job)
    assert job.status == SessionStatus.RUNNING and job.preempt_at is None and job.status_reason == ""


def test_preemption_off_stops_nothing(one_gpu, alice, staff, settings):
    settings.FGPU_PREEMPTION = False
    job = running(alice, "job")
    session_create(owner=staff, name="urgent", resources={"cuda.shares": "1", "mem": "64M"}, priority=5)

    schedule_pending()

    assert fresh(job).preempt_at is None


def test_the_launch_takes_preemptible_and_min_runtime_and_refuses_bad_values(one_gpu, alice):
    client = client_for(alice)
    batch = client.post("/api/v1/sessions/", {"resources": {"cuda.shares": "0.5"}, "command": "true"}, format="json")
    shell = client.post("/api/v1/sessions/", {"resources": {"cuda.shares": "0.5"}}, format="json")
    chosen = client.post("/api/v1/sessions/", {"resources": {"cuda.shares": "0.5"}, "preemptible": True,
                                               "min_runtime": 600}, format="json")
    bad = client.post("/api/v1/sessions/", {"resources": {"cuda.shares": "0.5"}, "min_runtime": -1}, format="json")
    loose = client.post("/api/v1/sessions/", {"resources": {"cuda.shares": "0.5"}, "preemptible": 0}, format="json")

    assert (batch.status_code, shell.status_code, chosen.status_code) == (201, 201, 201)
    assert (batch.json()["preemptible"], shell.json()["preemptible"], chosen.json()["preemptible"]) == (True, False, True)
    assert chosen.json()["min_runtime"] == 600 and chosen.json()["preempt_at"] is None
    assert bad.status_code == 400 and "min_runtime" in bad.json()["field_errors"]
    assert loose.status_code == 400 and "preemptible" in loose.json()["field_errors"]  # JSON true or false only
    assert ComputeSession.objects.count() == 3  # the refused launch kept nothing


def test_the_cli_sends_preemptible_and_min_runtime_only_when_given():
    from fgpu_cli.launch import UsageError, build_body
    from fgpu_cli.main import build_parser

    args = build_parser().parse_args(["launch", "--fgpu", "1", "--no-preemptible", "--min-runtime", "600"])
    assert (args.preemptible, args.min_runtime) == (False, 600)
    assert build_parser().parse_args(["launch", "--fgpu", "1"]).preemptible is None
    assert build_body(fgpu="1", preemptible=False, min_runtime=600) == {
        "resources": {"cuda.shares": "1"}, "preemptible": False, "min_runtime": 600}
    assert build_body(fgpu="1") == {"resources": {"cuda.shares": "1"}}
    with pytest.raises(UsageError, match="--min-runtime -5"):
        build_body(fgpu="1", min_runtime=-5)


def test_two_waiters_in_one_pass_never_share_a_victim(settings, alice, staff):
    settings.FGPU_PREEMPTION = True
    make_cluster(nodes={"n1": [mock_gpu(0)]})
    first = running(alice, "first", fgpu="1")
    second = running(alice, "second", fgpu="1", ran_s=7200)
    a = session_create(owner=staff, name="a", resources={"cuda.shares": "1", "mem": "64M"}, priority=5)
    b = session_create(owner=staff, name="b", resources={"cuda.shares": "1", "mem": "64M"}, priority=5)

    schedule_pending()

    assert fresh(first).preempted_for_id == a.pk  # the youngest for the first in the queue
    assert fresh(second).preempted_for_id == b.pk  # the other for the second
    assert "preempting 1 session(s) on n1 to make room (second;" in fresh(b).status_reason
