"""Fencing (issue 33.5): a session deleted while its node is LOST keeps its devices reserved until
its agent reports its processes gone, the node stays silent past FGPU_FENCE_TIMEOUT_SECONDS, or an
administrator marks the node dead; meanwhile the scheduler grants those devices to no one.

The database is real and so are the manager's tasks (eager Celery); the node's agent is a
recording stand-in (tests/test_reconcile.py's), and its heartbeats and registration are the
messages a real agent sends. A node's silence is made by moving its last heartbeat back, which is
what the clock would do. tests/faults/test_fencing_agents.py does the same with agent processes.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from accelerators.models import Node, NodeStatus
from sessions.lifecycle import services
from sessions.admission import launch as admission
from sessions.models import Allocation, ComputeSession, SessionStatus
from sessions.scheduling.scheduler import schedule_pending
from sessions.tasks import node_check_heartbeats
from tests.conftest import assert_error_shape, client_for, make_running
from tests.test_reconcile import NODE, agent, heartbeat, status_of, unreleased  # noqa: F401 (agent: a fixture)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def running(agent, alice):  # noqa: F811 (agent: the fixture imported above)
    """A RUNNING session of alice's on demo-node (one 8 GiB GPU: 2 fGPU), scheduled a minute ago
    (so a heartbeat without it is proof that it is gone)."""

    def make(shares: str) -> ComputeSession:
        session = admission.session_create(owner=alice, name="", resources={"cuda.shares": shares})
        session.refresh_from_db()
        assert session.status == SessionStatus.SCHEDULED, session.status_reason
        ComputeSession.objects.filter(pk=session.pk).update(scheduled_at=timezone.now() - timedelta(minutes=1))
        return ComputeSession.objects.select_related("node").get(pk=make_running(session).pk)

    return make


def lose(*, silent_s: float) -> None:
    """demo-node LOST, its last heartbeat `silent_s` seconds ago."""
    Node.objects.filter(name=NODE).update(status=NodeStatus.LOST, last_heartbeat=timezone.now() - timedelta(seconds=silent_s))


def delete(session: ComputeSession) -> ComputeSession:
    """The API's terminate (sessions.api.sessions): at alice's request."""
    return services.session_terminate(session=ComputeSession.objects.select_related("node").get(pk=session.pk),
                                      reason=services.REQUESTED + "alice")


def waiting(alice, shares: str) -> ComputeSession:
    session = admission.session_create(owner=alice, name="", resources={"cuda.shares": shares})
    schedule_pending()
    session.refresh_from_db()
    return session


def test_a_session_deleted_while_its_node_is_lost_keeps_its_devices_until_its_agent_reports_it_gone(running, alice, agent,
                                                                                                     settings):
    settings.FGPU_FENCE_TIMEOUT_SECONDS = 300
    whole = running("2.0")  # the whole GPU
    lose(silent_s=20)

    deleted = delete(whole)

    assert deleted.status == SessionStatus.TERMINATING
    assert "releasing its devices when node demo-node confirms its processes are gone, or in 280 s (" in deleted.status_reason
    assert unreleased(whole) == 1
    assert agent.stops == [str(whole.pk)]  # the stop waits in the node's queue for its agent

    # The node comes back and its agent still runs the session: the stop is sent again, and the
    # device is still the deleted session's: a new session waits for it.
    heartbeat({whole.pk: "RUNNING"})
    assert Node.objects.get(name=NODE).status == NodeStatus.ALIVE
    assert (status_of(whole), unreleased(whole)) == (SessionStatus.TERMINATING, 1)
    assert agent.stops == [str(whole.pk)] * 2
    newcomer = waiting(alice, "0.5")
    assert newcomer.status == SessionStatus.PENDING, newcomer.status_reason

    heartbeat({})  # the agent no longer runs it: proof that its processes are gone

    assert (status_of(whole), unreleased(whole)) == (SessionStatus.TERMINATED, 0)
    assert whole.status_reason == "at the request of alice"  # who asked, without the wait
    assert status_of(newcomer) == SessionStatus.SCHEDULED


def test_a_fenced_session_ends_when_its_agent_reports_it_ended(running, alice):
    session = running("1.0")
    lose(silent_s=20)
    delete(session)

    heartbeat({}, {session.pk: {"status": "TERMINATED", "reason": "terminated", "exit_code": 143}})

    assert (status_of(session), unreleased(session)) == (SessionStatus.TERMINATED, 0)
    assert (session.exit_code, session.status_reason) == (143, "at the request of alice")


def test_a_restarted_agent_that_no_longer_runs_a_fenced_session_ends_it_and_one_that_adopted_it_does_not(running, agent):
    gone, adopted = running("1.0"), running("1.0")
    lose(silent_s=20)
    delete(gone)
    delete(adopted)

    # The agent registers again (it restarted): the process runtime lists nothing it no longer
    # runs; the docker runtime adopted its containers, so a restart alone proves nothing.
    keep = services.sessions_reconcile_node(node_name=NODE, running=[str(adopted.pk)])

    assert keep == [str(adopted.pk)]
    assert (status_of(gone), unreleased(gone)) == (SessionStatus.TERMINATED, 0)
    assert gone.status_reason == "at the request of alice"
    assert (status_of(adopted), unreleased(adopted)) == (SessionStatus.TERMINATING, 1)


def test_the_scheduler_grants_a_fenced_sessions_devices_to_no_one_while_the_node_is_alive_again(running, alice):
    whole = running("2.0")
    lose(silent_s=20)
    delete(whole)
    Node.objects.filter(name=NODE).update(status=NodeStatus.ALIVE, last_heartbeat=timezone.now())

    newcomers = [waiting(alice, shares) for shares in ("0.25", "1.0", "2.0")]

    assert [s.status for s in newcomers] == [SessionStatus.PENDING] * 3
    assert not Allocation.objects.filter(session__in=newcomers).exists()


def test_a_lost_node_silent_past_the_fence_timeout_is_declared_dead_and_all_its_sessions_end(running, settings):
    settings.FGPU_FENCE_TIMEOUT_SECONDS = 60
    deleted, untouched = running("1.0"), running("1.0")
    lose(silent_s=30)
    delete(deleted)
    node_check_heartbeats.delay()
    assert [status_of(deleted), status_of(untouched)] == [SessionStatus.TERMINATING, SessionStatus.RUNNING]
    assert "or in 30 s (" in deleted.status_reason

    lose(silent_s=61)
    node_check_heartbeats.delay()

    assert (status_of(deleted), unreleased(deleted)) == (SessionStatus.TERMINATED, 0)
    assert deleted.status_reason == "at the request of alice"
    assert (status_of(untouched), unreleased(untouched)) == (SessionStatus.ERROR, 0)
    assert untouched.status_reason == "node demo-node was silent for over 60 s: its processes are assumed gone"


def test_a_session_deleted_on_a_node_already_past_its_fence_timeout_ends_at_once(running, settings):
    settings.FGPU_FENCE_TIMEOUT_SECONDS = 60
    session = running("1.0")
    lose(silent_s=61)

    ended = delete(session)

    assert (ended.status, unreleased(session)) == (SessionStatus.TERMINATED, 0)
    assert ended.status_reason.startswith("at the request of alice; its node was silent past FGPU_FENCE_TIMEOUT_SECONDS")


def test_a_fence_timeout_of_zero_waits_for_the_agent_or_an_administrator(running, settings):
    settings.FGPU_FENCE_TIMEOUT_SECONDS = 0
    session = running("1.0")
    lose(silent_s=86400)

    fenced = delete(session)
    node_check_heartbeats.delay()

    assert (status_of(session), unreleased(session)) == (SessionStatus.TERMINATING, 1)
    assert fenced.status_reason.endswith("confirms its processes are gone, or an administrator marks it dead")


def test_an_administrator_marks_a_lost_node_dead_through_the_api_and_its_sessions_end(running, alice, admin):
    deleted, untouched = running("1.0"), running("1.0")
    as_admin = client_for(admin)

    alive = as_admin.post(f"/api/v1/nodes/{NODE}/mark-dead/")
    assert assert_error_shape(alive, 409)["type"] == "node-alive"
    assert_error_shape(client_for(alice).post(f"/api/v1/nodes/{NODE}/mark-dead/"), 403)
    assert_error_shape(as_admin.post("/api/v1/nodes/no-such-node/mark-dead/"), 404)
    assert [status_of(deleted), status_of(untouched)] == [SessionStatus.RUNNING] * 2

    lose(silent_s=20)
    delete(deleted)
    answer = as_admin.post(f"/api/v1/nodes/{NODE}/mark-dead/")

    assert answer.status_code == 200, answer.content
    assert answer.json() == {"node": NODE, "sessions_ended": 2}
    assert (status_of(deleted), unreleased(deleted)) == (SessionStatus.TERMINATED, 0)
    assert (status_of(untouched), unreleased(untouched)) == (SessionStatus.ERROR, 0)
    assert untouched.status_reason == f"node {NODE} was marked dead by {admin.username}: its processes are assumed gone"
    assert Node.objects.get(name=NODE).status == NodeStatus.LOST  # until its agent registers again


def test_an_administrator_marks_a_lost_node_dead_in_the_admin(running, admin):
    from django.test import Client

    session = running("1.0")
    lose(silent_s=20)
    delete(session)
    browser = Client()
    browser.force_login(admin)

    page = browser.post("/admin/accelerators/node/", {"action": "mark_dead",
                                                       "_selected_action": [str(Node.objects.get(name=NODE).pk)]},
                        follow=True)

    assert page.status_code == 200
    assert "Node demo-node marked dead: 1 session(s) ended, their devices released" in page.content.decode()
    assert (status_of(session), unreleased(session)) == (SessionStatus.TERMINATED, 0)
