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
from sessions.scheduling.scheduler import schedule_pending
from sessions.lifecycle.services import PREEMPTED, REQUESTED, session_report_apply, session_terminate
from sessions.admission.launch import session_create
from tests.conftest import client_for
from tests.test_cli import SID, api  # noqa: F401 (the CLI's fake server, a fixture)
from tests.test_cli import session as cli_session
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


# --- issue 32.2: who goes, the signal, the requeue ---------------------------------------------------


def test_the_pass_preempts_the_lowest_priority_session_whatever_its_age(one_gpu, alice, bob, staff):
    low = running(alice, "low", fgpu="1", ran_s=4 * 3600, priority=0)  # older: more work lost, but priority 0
    high = running(staff, "high", fgpu="1", ran_s=60, priority=2)  # the youngest, the least work: priority 2
    urgent = session_create(owner=staff, name="urgent", resources={"cuda.shares": "1", "mem": "64M"}, priority=5)

    schedule_pending()

    assert fresh(low).preempted_for_id == urgent.pk and fresh(high).preempt_at is None

    mid = session_create(owner=staff, name="mid", resources={"cuda.shares": "1", "mem": "64M"}, priority=1)
    schedule_pending()  # priority 1 waits behind urgent and may not touch the priority-2 session
    assert fresh(high).preempt_at is None and fresh(mid).status == SessionStatus.PENDING


def test_a_notice_is_sent_to_the_agent_on_every_pass_while_it_stands(one_gpu, alice, staff):
    from sessions.scheduling import preemption

    job = running(alice, "job", preempt_signal="SIGUSR1")
    session_create(owner=staff, name="urgent", resources={"cuda.shares": "1", "mem": "64M"}, priority=5)

    schedule_pending()
    job = fresh(job)
    first = preemption.notices_send(timezone.now())
    again = preemption.notices_send(timezone.now())

    assert first == again == [str(job.pk)]  # the agent acts once per notice (its preempt_at)
    line = preemption.notice_line(job, job.preempt_signal_sent, timezone.now())
    assert line.startswith("preemption notice at ") and ", SIGUSR1 sent: to be preempted at " in line
    ComputeSession.objects.filter(pk=job.pk).update(preempt_at=timezone.now() - timedelta(seconds=1))
    assert preemption.notices_send(timezone.now()) == []  # its time came: stopped, not signalled again


def test_a_preempted_session_is_requeued_once_it_ended_keeping_its_arrival_and_runs_again(one_gpu, alice, staff):
    job = running(alice, "job", preempt_signal="SIGUSR2", min_runtime=5)
    urgent = session_create(owner=staff, name="urgent", resources={"cuda.shares": "1", "mem": "64M"}, priority=5)
    schedule_pending()
    ComputeSession.objects.filter(pk=job.pk).update(preempt_at=timezone.now() - timedelta(seconds=1))
    schedule_pending()  # stopped
    assert fresh(job).status == SessionStatus.TERMINATING and fresh(job).requeued_as_id is None  # not while it runs

    session_report_apply(session_id=str(job.pk), status=SessionStatus.TERMINATED, reason="terminated")
    schedule_pending()
    schedule_pending()  # a second pass creates nothing more

    job = fresh(job)
    again = ComputeSession.objects.get(requeued_from=job)
    assert job.requeued_as_id == again.pk and job.status_reason.endswith(f"; requeued as session {again.pk}")
    assert (again.command, again.request_spec, again.image_id, again.priority) == (job.command, job.request_spec,
                                                                                  job.image_id, job.priority)
    assert (again.preempt_signal, again.min_runtime, again.preemptible, again.requeue) == ("SIGUSR2", 5, True, True)
    assert again.created_at == job.created_at  # its place by arrival
    assert ComputeSession.objects.filter(name="job").count() == 2
    assert fresh(urgent).status == SessionStatus.SCHEDULED and again.status == SessionStatus.PENDING

    session_terminate(session=fresh(urgent))  # the room is free again: the requeued session runs
    session_report_apply(session_id=str(urgent.pk), status=SessionStatus.TERMINATED, reason="terminated")
    schedule_pending()
    assert fresh(again).status == SessionStatus.SCHEDULED


def test_a_session_that_exits_on_its_signal_is_requeued_but_not_one_launched_with_requeue_false(
        one_gpu, alice, bob, staff):
    quitter = running(alice, "quitter", fgpu="1")
    keeper = running(bob, "keeper", fgpu="1", requeue=False)
    urgent = session_create(owner=staff, name="urgent", resources={"cuda.shares": "2", "mem": "64M"}, priority=5)
    schedule_pending()
    assert fresh(quitter).preempted_for_id == urgent.pk and fresh(keeper).preempted_for_id == urgent.pk

    # Both exit on their signal during the grace: their own ends, not the scheduler's stop.
    session_report_apply(session_id=str(quitter.pk), status=SessionStatus.TERMINATED, reason="exited", exit_code=143)
    session_report_apply(session_id=str(keeper.pk), status=SessionStatus.TERMINATED, reason="exited", exit_code=0)
    schedule_pending()

    assert fresh(quitter).requeued_as_id is not None
    assert fresh(quitter).status_reason.startswith(PREEMPTED + "ended during its notice to make room for urgent of root")
    assert fresh(keeper).requeued_as_id is None
    assert fresh(urgent).status == SessionStatus.SCHEDULED



def test_a_victim_is_requeued_only_once_the_session_it_made_room_for_no_longer_waits(one_gpu, alice, staff):
    """Its copy keeps its arrival: launched while the waiting session still waits (a compaction's
    move, of the same priority), it could take the room back and be moved again, round after round."""
    from sessions.scheduling import preemption

    job, other = running(alice, "job", fgpu="1"), running(alice, "other", fgpu="1")
    waiter = session_create(owner=staff, name="waiter", resources={"cuda.shares": "1", "mem": "64M"})
    now = timezone.now()
    ComputeSession.objects.filter(pk=job.pk).update(
        status=SessionStatus.TERMINATED, terminated_at=now, preempt_at=now, preempted_for=waiter,
        status_reason=PREEMPTED + "stopped to make room",
    )  # fmt: skip
    assert preemption._requeue_ended(now) == [] and fresh(job).requeued_as_id is None  # the waiter still waits
    later = now + preemption.REQUEUE_AFTER_WAITER + timedelta(seconds=1)
    assert len(preemption._requeue_ended(later)) == 1  # it waited too long: the room went to someone else

    ComputeSession.objects.filter(pk=other.pk).update(
        status=SessionStatus.TERMINATED, terminated_at=now, preempt_at=now, preempted_for=waiter,
        status_reason=PREEMPTED + "stopped to make room",
    )  # fmt: skip
    ComputeSession.objects.filter(pk=waiter.pk).update(status=SessionStatus.SCHEDULED)
    assert len(preemption._requeue_ended(now)) == 1 and fresh(other).requeued_as_id is not None  # it started


def test_a_session_its_owner_ends_while_under_notice_is_not_requeued(one_gpu, alice, staff):
    mine = running(alice, "mine")
    session_create(owner=staff, name="urgent", resources={"cuda.shares": "1", "mem": "64M"}, priority=5)
    schedule_pending()
    assert fresh(mine).preempt_at is not None
    session_terminate(session=fresh(mine), reason=f"{REQUESTED}alice")
    session_report_apply(session_id=str(mine.pk), status=SessionStatus.TERMINATED, reason="terminated")
    schedule_pending()
    assert fresh(mine).requeued_as_id is None


def test_the_launch_takes_preempt_signal_and_requeue_and_refuses_bad_values(one_gpu, alice):
    client = client_for(alice)
    body = {"resources": {"cuda.shares": "0.5"}, "command": "true"}
    named = client.post("/api/v1/sessions/", {**body, "preempt_signal": "usr1", "requeue": False}, format="json")
    plain = client.post("/api/v1/sessions/", body, format="json")
    kill = client.post("/api/v1/sessions/", {**body, "preempt_signal": "KILL"}, format="json")
    bogus = client.post("/api/v1/sessions/", {**body, "preempt_signal": "SIGNOPE"}, format="json")
    loose = client.post("/api/v1/sessions/", {**body, "requeue": "no"}, format="json")

    assert (named.status_code, plain.status_code) == (201, 201)
    assert (named.json()["preempt_signal"], named.json()["requeue"]) == ("SIGUSR1", False)
    assert (plain.json()["preempt_signal"], plain.json()["requeue"]) == ("SIGTERM", True)
    assert plain.json()["requeued_from"] is None and plain.json()["requeued_as"] is None
    for refused in (kill, bogus):
        assert refused.status_code == 400 and "preempt_signal" in refused.json()["field_errors"]
    assert loose.status_code == 400 and "requeue" in loose.json()["field_errors"]
    assert ComputeSession.objects.count() == 2


def test_an_image_names_the_signal_its_sessions_get_unless_the_launch_names_one(one_gpu, alice, admin):
    from sessions.models import SessionImage

    host = SessionImage.objects.get(reference="host")
    images = client_for(admin)
    url = f"/api/v1/images/{host.pk}/"
    wrong = images.patch(url, {"preempt_signal": "SIGKILL"}, format="json", HTTP_IF_MATCH=images.get(url)["ETag"])
    assert wrong.status_code == 400 and "preempt_signal" in wrong.json()["field_errors"]
    answer = images.patch(url, {"preempt_signal": "SIGUSR2"}, format="json", HTTP_IF_MATCH=images.get(url)["ETag"])
    assert answer.status_code == 200, answer.json()

    client = client_for(alice)
    body = {"resources": {"cuda.shares": "0.5"}, "command": "true", "image": "host"}
    assert client.post("/api/v1/sessions/", body, format="json").json()["preempt_signal"] == "SIGUSR2"
    assert client.post("/api/v1/sessions/", {**body, "preempt_signal": "INT"}, format="json").json()["preempt_signal"] == "SIGINT"


def test_the_cli_sends_preempt_signal_and_requeue_and_shows_the_notice(api, capsys):
    from fgpu_cli import main as cli
    from fgpu_cli.launch import build_body
    from fgpu_cli.main import build_parser

    args = build_parser().parse_args(["launch", "--fgpu", "1", "--command", "x", "--preempt-signal", "USR1", "--no-requeue"])
    assert (args.preempt_signal, args.requeue) == ("USR1", False)
    assert build_parser().parse_args(["launch", "--fgpu", "1"]).requeue is None
    assert build_body(fgpu="1", preempt_signal="USR1", requeue=False) == {
        "resources": {"cuda.shares": "1"}, "preempt_signal": "USR1", "requeue": False}

    soon = (timezone.now() + timedelta(seconds=90)).isoformat()
    shown = cli_session(status="RUNNING", preempt_at=soon, preempted_for="7f000000-0000-0000-0000-000000000001",
                        preempt_signal="SIGUSR1", requeue=True, requeued_from=None, requeued_as=None)
    api.routes[("GET", f"/api/v1/sessions/{SID}/")] = (200, shown)
    api.routes[("GET", "/api/v1/sessions/")] = (200, {"results": [shown], "next": None})
    assert cli.main(["describe", SID]) == 0
    out = capsys.readouterr().out
    assert f"Preempted at:    {soon} (in 1m; SIGUSR1 sent at the notice; for session 7f000000)" in out, out
    assert "Preempt signal:  SIGUSR1" in out
    assert cli.main(["ps"]) == 0
    assert "preempted in 1m (SIGUSR1 sent)" in capsys.readouterr().out

    ended = cli_session(status="TERMINATED", preempt_at=soon, preempt_signal="SIGTERM", requeue=True,
                        requeued_as="7f000000-0000-0000-0000-000000000002", status_reason="preempted: …")
    api.routes[("GET", f"/api/v1/sessions/{SID}/")] = (200, ended)
    assert cli.main(["describe", SID]) == 0
    out = capsys.readouterr().out
    assert "Requeued as:     7f000000-0000-0000-0000-000000000002" in out and "Preempted at" not in out


def test_the_preempt_command_is_typed_sealed_per_node_and_refuses_a_signal_no_program_can_catch():
    from protocol.channel import (
        MAX_NOTICE_CHARS, AgentLink, CommandGuard, Malformed, PtyPreempt, Refused, command_from_dict, preempt_signal_name)

    assert [preempt_signal_name(v) for v in ("TERM", "usr1", " SIGHUP ")] == ["SIGTERM", "SIGUSR1", "SIGHUP"]
    for bad in ("KILL", "SIGSTOP", "", "9", "TERMINATE"):
        with pytest.raises(ValueError):
            preempt_signal_name(bad)
    command = PtyPreempt(session_id="s", signal="SIGUSR1", text="notice", notice="2026-11-28T01:00:00+00:00")
    sealed = AgentLink(node="n1", key="k" * 32).command(command.to_dict())
    assert command_from_dict(CommandGuard(node="n1", key="k" * 32).open(sealed)) == command
    with pytest.raises(Refused):  # another node's key: not acted on
        CommandGuard(node="n2", key="k" * 32).open(sealed)
    for bad in ({"signal": "SIGKILL"}, {"signal": 15}, {"text": "x" * (MAX_NOTICE_CHARS + 1)}, {"notice": ""}):
        with pytest.raises(Malformed):
            command_from_dict({**command.to_dict(), **bad})


def test_a_victim_that_ended_long_ago_is_not_requeued_and_costs_a_pass_one_query(one_gpu, alice, staff,
                                                                                  django_assert_max_num_queries):
    from sessions.scheduling import preemption

    job = running(alice, "job")
    urgent = session_create(owner=staff, name="urgent", resources={"cuda.shares": "1", "mem": "64M"}, priority=5)
    schedule_pending()
    session_report_apply(session_id=str(job.pk), status=SessionStatus.TERMINATED, reason="exited", exit_code=143)
    ComputeSession.objects.filter(pk=job.pk).update(terminated_at=timezone.now() - timedelta(hours=2))  # before an upgrade
    session_terminate(session=fresh(urgent))

    with django_assert_max_num_queries(1):
        found = preemption.preemption_pass(blocked=[], scope_of=None, options_of=None)
    assert found["requeued"] == [] and fresh(job).requeued_as_id is None
