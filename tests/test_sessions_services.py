"""Session services against the real database: create, schedule, terminate, agent reports,
reconcile after an agent restart, and one-time terminal tickets.

Scheduling is the real on-commit path (`session_create` → `schedule_pending` task, eager);
the agent task it then sends fails harmlessly (LookupError) because no agent runs here.
"""
from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.conf import settings
from django.utils import timezone

from accelerators.allocation.reservation import EARLIER
from common.errors import ApplicationError
from sessions.lifecycle import services
from sessions.admission import launch as admission
from sessions.models import Allocation, ComputeSession, SessionStatus, TerminalTicket
from sessions.scheduling.scheduler import schedule_pending
from tests.conftest import GiB, make_cluster, mock_gpu

pytestmark = pytest.mark.django_db


@pytest.fixture
def user(django_user_model):
    return django_user_model.objects.create_user("alice")  # no password: hashing is slow and not under test


@pytest.fixture
def create(user, django_capture_on_commit_callbacks):
    """Create a session the way the API does and run its on-commit scheduling."""

    def create(shares: str | None = "0.5", *, owner=None, command: str = "", **extra) -> ComputeSession:
        resources = {"cuda.shares": shares, **extra} if shares is not None else dict(extra)
        with django_capture_on_commit_callbacks(execute=True):
            session = admission.session_create(owner=owner or user, name="", resources=resources, command=command)
        session.refresh_from_db()
        return session

    return create


@pytest.fixture
def report(django_capture_on_commit_callbacks):
    """Apply an agent report and run what it schedules on commit; returns whether it changed."""

    def report(session: ComputeSession, status: str, reason: str = "", exit_code: int | None = None) -> bool:
        with django_capture_on_commit_callbacks(execute=True):
            changed = services.session_report_apply(session_id=str(session.pk), status=status, reason=reason,
                                                    exit_code=exit_code)
        session.refresh_from_db()
        return changed

    return report


@pytest.fixture
def running(create, report):
    """A session that has been scheduled and reported RUNNING by its agent."""

    def running(shares: str = "0.5", **kwargs) -> ComputeSession:
        session = create(shares, **kwargs)
        assert session.status == SessionStatus.SCHEDULED, session.status_reason
        assert report(session, SessionStatus.PREPARING, "preparing")
        assert report(session, SessionStatus.RUNNING)
        return session

    return running


def live_allocations(session) -> list[Allocation]:
    return list(Allocation.objects.filter(session=session, released_at__isnull=True))


# --- create and schedule ----------------------------------------------------------------------

def test_a_new_session_is_pending_until_the_scheduler_runs(demo_cluster, user):
    session = admission.session_create(owner=user, name="s", resources={"cuda.shares": "0.5"})

    session.refresh_from_db()
    assert session.status == SessionStatus.PENDING
    assert session.amount == Decimal("0.5")
    assert session.slot_name == "cuda" and session.slot_subtype == "shares"
    assert not Allocation.objects.filter(session=session).exists()


def test_half_an_fgpu_is_scheduled_on_demo_node_with_one_allocation_of_2_gib_and_20_sms(demo_cluster, create):
    session = create("0.5")

    assert session.status == SessionStatus.SCHEDULED
    assert session.node.name == "demo-node"
    assert session.scheduled_at is not None
    [allocation] = Allocation.objects.filter(session=session)
    assert allocation.shares == Decimal("0.5")
    assert allocation.memory == 2 * GiB
    assert allocation.procs == Decimal(20)
    assert allocation.released_at is None


def test_calling_the_scheduler_directly_places_a_pending_session(demo_cluster, user):
    session = admission.session_create(owner=user, name="s", resources={"cuda.shares": "1.0"})

    scheduled = schedule_pending()

    assert scheduled == [str(session.pk)]
    session.refresh_from_db()
    assert session.status == SessionStatus.SCHEDULED


def test_a_request_larger_than_any_node_is_refused_at_once_naming_the_slot_and_the_largest_amount(demo_cluster, user):
    with pytest.raises(ApplicationError) as refused:
        admission.session_create(owner=user, name="s", resources={"cuda.shares": "3"})

    assert refused.value.status == 400
    assert "cuda.shares" in refused.value.detail
    assert "2.00 fGPU" in refused.value.detail
    assert "resources" in refused.value.field_errors
    assert not ComputeSession.objects.exists()


def test_an_amount_off_the_quantum_grid_is_refused(demo_cluster, user):
    with pytest.raises(ApplicationError) as refused:
        admission.session_create(owner=user, name="s", resources={"cuda.shares": "0.3"})

    assert refused.value.status == 400
    assert "quantum" in refused.value.detail
    assert "0.25" in refused.value.detail
    assert not ComputeSession.objects.exists()


def test_shares_are_refused_when_the_slot_is_in_discrete_mode(db, user):
    make_cluster(nodes={"demo-node": [mock_gpu(0)]}, mode="discrete")

    with pytest.raises(ApplicationError) as refused:
        admission.session_create(owner=user, name="s", resources={"cuda.shares": "0.5"})

    assert refused.value.status == 400
    assert "discrete mode" in refused.value.detail
    assert "cuda.device" in refused.value.detail
    assert not ComputeSession.objects.exists()


def test_a_request_that_fits_the_cluster_but_not_now_waits_and_starts_when_capacity_is_released(
        demo_cluster, create, running, report):
    first = running("2.0")

    waiting = create("0.5")

    assert waiting.status == SessionStatus.PENDING
    assert waiting.status_reason.startswith("waiting for capacity")
    assert not Allocation.objects.filter(session=waiting).exists()

    assert report(first, SessionStatus.TERMINATED, "the process exited with code 0", exit_code=0)

    waiting.refresh_from_db()
    assert waiting.status == SessionStatus.SCHEDULED
    assert [a.shares for a in live_allocations(waiting)] == [Decimal("0.5")]


def test_with_backfill_off_a_big_pending_head_blocks_a_smaller_later_request_strict_fifo(
        demo_cluster, create, running, settings):
    settings.FGPU_BACKFILL_LIMIT = 0
    running("1.5")  # 0.5 fGPU left

    head = create("1.0")
    later = create("0.5")  # would fit now, but must not overtake the head

    head.refresh_from_db()
    later.refresh_from_db()
    assert head.status == SessionStatus.PENDING
    assert later.status == SessionStatus.PENDING
    assert not Allocation.objects.filter(session=later).exists()
    assert schedule_pending() == []


def test_a_request_spanning_two_devices_gets_two_allocations_adding_up_to_the_request(db, create):
    make_cluster(nodes={"twin": [mock_gpu(0), mock_gpu(1)]})

    session = create("2.5")

    assert session.status == SessionStatus.SCHEDULED
    allocations = live_allocations(session)
    assert len(allocations) == 2
    assert len({a.device_id for a in allocations}) == 2
    assert sum(a.shares for a in allocations) == Decimal("2.5")
    assert sum(a.memory for a in allocations) == 10 * GiB
    assert sum(a.procs for a in allocations) == Decimal(100)
    assert all(a.shares <= Decimal("2.0") for a in allocations)


# --- terminate and reports --------------------------------------------------------------------

def test_terminating_a_pending_session_cancels_it(demo_cluster, user):
    session = admission.session_create(owner=user, name="s", resources={"cuda.shares": "0.5"})

    services.session_terminate(session=session)

    session.refresh_from_db()
    assert session.status == SessionStatus.CANCELLED
    assert session.terminated_at is not None
    assert schedule_pending() == []
    assert not Allocation.objects.filter(session=session).exists()


def test_terminating_a_running_session_waits_for_the_agent_then_releases_its_allocation(
        demo_cluster, running, report, django_capture_on_commit_callbacks):
    session = running("0.5")

    with django_capture_on_commit_callbacks(execute=True):  # the stop task fails: no agent here
        services.session_terminate(session=session)

    session.refresh_from_db()
    assert session.status == SessionStatus.TERMINATING
    assert len(live_allocations(session)) == 1  # held until the agent says the process is gone

    assert report(session, SessionStatus.TERMINATED, "terminated", exit_code=129)

    assert session.status == SessionStatus.TERMINATED
    assert session.status_reason == "terminated"
    assert session.exit_code == 129
    assert session.terminated_at is not None
    [allocation] = Allocation.objects.filter(session=session)
    assert allocation.released_at is not None


def test_a_second_terminated_report_changes_nothing_and_releases_nothing_again(demo_cluster, running, report):
    session = running("0.5")
    assert report(session, SessionStatus.TERMINATED, "first", exit_code=0)
    [allocation] = Allocation.objects.filter(session=session)
    released_at, terminated_at = allocation.released_at, session.terminated_at

    assert report(session, SessionStatus.TERMINATED, "second", exit_code=1) is False

    allocation.refresh_from_db()
    assert allocation.released_at == released_at
    assert session.terminated_at == terminated_at
    assert session.status_reason == "first"
    assert session.exit_code == 0


def test_a_running_report_after_the_user_asked_to_terminate_is_ignored(
        demo_cluster, create, report, django_capture_on_commit_callbacks):
    session = create("0.5")
    assert report(session, SessionStatus.PREPARING)
    with django_capture_on_commit_callbacks(execute=True):
        services.session_terminate(session=session)

    assert report(session, SessionStatus.RUNNING) is False

    assert session.status == SessionStatus.TERMINATING
    assert session.started_at is None


def test_terminating_an_ended_session_leaves_it_as_it_is(demo_cluster, running, report):
    session = running("0.5")
    assert report(session, SessionStatus.TERMINATED, "done", exit_code=0)

    services.session_terminate(session=session)

    session.refresh_from_db()
    assert session.status == SessionStatus.TERMINATED
    assert session.status_reason == "done"


def test_a_report_for_an_unknown_session_is_ignored(demo_cluster):
    assert services.session_report_apply(session_id="00000000-0000-0000-0000-000000000000",
                                         status=SessionStatus.RUNNING) is False


# --- reconcile after an agent restart ---------------------------------------------------------

def test_reconciling_a_node_ends_the_sessions_its_agent_no_longer_runs(demo_cluster, create, running):
    kept = running("0.5")
    lost = running("0.5")
    scheduled = create("0.5")  # its start message may still be in the agent's queue

    keep = services.sessions_reconcile_node(node_name="demo-node", running=[str(kept.pk)])

    assert sorted(keep) == sorted([str(kept.pk), str(scheduled.pk)])
    lost.refresh_from_db()
    kept.refresh_from_db()
    scheduled.refresh_from_db()
    assert lost.status == SessionStatus.ERROR
    assert "no longer runs" in lost.status_reason
    assert all(a.released_at is not None for a in Allocation.objects.filter(session=lost))
    assert kept.status == SessionStatus.RUNNING
    assert len(live_allocations(kept)) == 1
    assert scheduled.status == SessionStatus.SCHEDULED


# --- terminal tickets -------------------------------------------------------------------------

def test_a_terminal_ticket_opens_the_terminal_once(demo_cluster, running, user):
    session = running("0.5")
    ticket, row = services.terminal_ticket_create(session=session, user=user)

    assert services.terminal_ticket_redeem(session_id=str(session.pk), ticket=ticket) == session
    with pytest.raises(ApplicationError) as refused:
        services.terminal_ticket_redeem(session_id=str(session.pk), ticket=ticket)

    assert refused.value.status == 403
    row.refresh_from_db()
    assert row.used_at is not None


def test_only_the_digest_of_a_terminal_ticket_is_stored(demo_cluster, running, user):
    session = running("0.5")
    ticket, row = services.terminal_ticket_create(session=session, user=user)

    assert not TerminalTicket.objects.filter(digest=ticket).exists()
    assert ticket not in row.digest


def test_an_expired_terminal_ticket_is_refused(demo_cluster, running, user, monkeypatch):
    session = running("0.5")
    ticket, _ = services.terminal_ticket_create(session=session, user=user)
    later = timezone.now() + timedelta(seconds=settings.FGPU_TERMINAL_TICKET_TTL + 1)
    monkeypatch.setattr("django.utils.timezone.now", lambda: later)

    with pytest.raises(ApplicationError) as refused:
        services.terminal_ticket_redeem(session_id=str(session.pk), ticket=ticket)

    assert refused.value.status == 403


def test_a_terminal_ticket_is_still_good_just_before_it_expires(demo_cluster, running, user, monkeypatch):
    session = running("0.5")
    ticket, _ = services.terminal_ticket_create(session=session, user=user)
    later = timezone.now() + timedelta(seconds=settings.FGPU_TERMINAL_TICKET_TTL - 2)
    monkeypatch.setattr("django.utils.timezone.now", lambda: later)

    assert services.terminal_ticket_redeem(session_id=str(session.pk), ticket=ticket) == session


def test_a_wrong_terminal_ticket_is_refused(demo_cluster, running, user):
    session = running("0.5")
    services.terminal_ticket_create(session=session, user=user)

    with pytest.raises(ApplicationError) as refused:
        services.terminal_ticket_redeem(session_id=str(session.pk), ticket="not-the-ticket")

    assert refused.value.status == 403


def test_a_terminal_ticket_for_one_session_does_not_open_another(demo_cluster, running, user):
    first, second = running("0.5"), running("0.5")
    ticket, _ = services.terminal_ticket_create(session=first, user=user)

    with pytest.raises(ApplicationError) as refused:
        services.terminal_ticket_redeem(session_id=str(second.pk), ticket=ticket)

    assert refused.value.status == 403
    assert services.terminal_ticket_redeem(session_id=str(first.pk), ticket=ticket) == first


def test_no_terminal_ticket_is_issued_for_a_session_that_is_not_running(demo_cluster, create, user):
    session = create("0.5")
    assert session.status == SessionStatus.SCHEDULED

    with pytest.raises(ApplicationError) as refused:
        services.terminal_ticket_create(session=session, user=user)

    assert refused.value.status == 409
    assert not TerminalTicket.objects.exists()


def test_a_terminal_ticket_does_not_open_a_session_that_ended_after_it_was_issued(demo_cluster, running, report, user):
    session = running("0.5")
    ticket, _ = services.terminal_ticket_create(session=session, user=user)
    assert report(session, SessionStatus.TERMINATED, "done", exit_code=0)

    with pytest.raises(ApplicationError) as refused:
        services.terminal_ticket_redeem(session_id=str(session.pk), ticket=ticket)

    assert refused.value.status == 409


def test_a_pending_session_waits_instead_of_failing_while_its_only_node_is_lost(demo_cluster):
    from accelerators.models import Node, NodeStatus
    from django.contrib.auth import get_user_model

    from sessions.models import ComputeSession, SessionStatus
    from sessions.scheduling.scheduler import schedule_pending
    from sessions.admission.launch import session_create

    owner = get_user_model().objects.create_user("lost-node-owner")
    Node.objects.filter(name="demo-node").update(status=NodeStatus.LOST)
    session = session_create(owner=owner, name="patient", resources={"cuda.shares": "0.5"})
    schedule_pending()
    session.refresh_from_db()
    assert session.status == SessionStatus.PENDING
    assert "LOST" in session.status_reason

    Node.objects.filter(name="demo-node").update(status=NodeStatus.ALIVE)
    schedule_pending()
    assert ComputeSession.objects.get(pk=session.pk).status == SessionStatus.SCHEDULED


def test_a_smaller_later_request_backfills_past_a_big_head_until_the_head_has_been_overtaken_enough(
        demo_cluster, create, running, settings):
    settings.FGPU_BACKFILL_LIMIT = 1
    running("1.0")  # 1.0 fGPU left

    head = create("1.5")
    first_small = create("0.5")   # fits: starts past the head (overtaken 1)
    second_small = create("0.5")  # would fit, but the head may be overtaken only once

    head.refresh_from_db()
    first_small.refresh_from_db()
    second_small.refresh_from_db()
    assert (head.status, head.overtaken) == (SessionStatus.PENDING, 1)
    assert first_small.status == SessionStatus.SCHEDULED
    assert second_small.status == SessionStatus.PENDING  # the head's reservation holds the GPU (issue 32.1)
    assert "GPU 0 on demo-node reserved" in second_small.status_reason and f"for {EARLIER}," in second_small.status_reason


def test_a_higher_priority_session_is_scheduled_before_earlier_ones(demo_cluster, create, running, settings):
    from sessions.scheduling.scheduler import schedule_pending as run

    settings.FGPU_BACKFILL_LIMIT = 0
    blocker = running("2.0")
    low = create("1.0")
    high = create("1.0")
    ComputeSession.objects.filter(pk=high.pk).update(priority=5)
    ComputeSession.objects.filter(pk=blocker.pk).update(status=SessionStatus.TERMINATED)
    Allocation.objects.filter(session=blocker).update(released_at=timezone.now())

    assert run() == [str(high.pk), str(low.pk)]


def test_sessions_launched_without_a_name_get_names_unique_per_owner_in_launch_order(demo_cluster, user,
                                                                                    django_user_model):
    bob = django_user_model.objects.create_user("bob")
    launch = lambda owner, name="": admission.session_create(owner=owner, name=name,  # noqa: E731
                                                             resources={"cuda.shares": "0.25"}).name

    assert [launch(user), launch(user, "  "), launch(bob)] == ["session-1", "session-2", "session-1"]
    assert launch(user, "session-9") == "session-9"  # a name given is kept, whatever it looks like
    assert [launch(user), launch(bob)] == ["session-10", "session-2"]  # one past the largest
    assert admission.session_default_name(owner=user) == "session-11"


def test_a_session_terminated_at_someones_request_keeps_who_asked_once_the_agent_reports_it_ended(
        demo_cluster, running, report, django_capture_on_commit_callbacks):
    session = running("0.5")

    with django_capture_on_commit_callbacks(execute=True):  # the stop task fails: no agent here
        services.session_terminate(session=session, reason=services.REQUESTED + "alice")
    session.refresh_from_db()
    assert (session.status, session.status_reason) == (SessionStatus.TERMINATING, "at the request of alice")

    assert report(session, SessionStatus.TERMINATED, "terminated", exit_code=129)
    assert (session.status, session.status_reason, session.exit_code) == (
        SessionStatus.TERMINATED, "at the request of alice", 129)


def test_every_shown_change_raises_the_version_and_a_change_ignored_does_not(
        demo_cluster, create, running, report, user, django_capture_on_commit_callbacks):
    from sessions.api.serializers import SessionSerializer

    seen = []

    def version(session):
        session.refresh_from_db()
        seen.append((session.status, session.version))
        return session.version

    first = running("2.0")
    waiting = create("0.5")  # no room now: waits, and the pass gives its reason
    assert waiting.status == SessionStatus.PENDING and version(waiting) == 1
    services.session_terminate(session=waiting)
    assert version(waiting) == 2  # CANCELLED
    assert report(first, SessionStatus.TERMINATED, "the process exited with code 0", exit_code=0)

    session = create("0.5")
    assert session.status == SessionStatus.SCHEDULED
    placed = version(session)
    assert report(session, SessionStatus.PREPARING) and version(session) > placed
    assert report(session, SessionStatus.RUNNING) and version(session) > seen[-2][1]
    assert report(session, SessionStatus.RUNNING) is False and version(session) == seen[-2][1]  # again: no change
    with django_capture_on_commit_callbacks(execute=True):
        services.session_terminate(session=session)
    assert version(session) > seen[-2][1]
    assert report(session, SessionStatus.TERMINATED, "terminated", exit_code=0) and version(session) > seen[-2][1]
    assert report(session, SessionStatus.TERMINATED, "again", exit_code=1) is False and version(session) == seen[-2][1]
    assert [status for status, _ in seen[2:]] == ["SCHEDULED", "PREPARING", "RUNNING", "RUNNING", "TERMINATING",
                                                  "TERMINATED", "TERMINATED"]
    assert SessionSerializer(session).data["version"] == session.version
