"""Level-triggered reconciliation (sessions.lifecycle.reconcile): each heartbeat's state of the agent is
compared with the database and both sides are repaired, so no lost message leaves a session
stuck or a process running after its session ended.

The database is real; the agent is outside the manager's process, so a recording stand-in
takes the start and stop messages the eager Celery tasks hand to "the agent of the node"."""
from __future__ import annotations

import logging
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from accelerators.models import Node
from protocol.messages import AgentState
from sessions.lifecycle import reconcile
from sessions.lifecycle import services
from sessions.admission import launch as admission
from sessions.models import Allocation, ComputeSession, SessionStatus
from agent import core as agent_runtime
from agent import tasks as _agent_tasks  # noqa: F401 (registers fgpu.agent.*: the eager sends reach the stand-in)
from sessions.tasks import agent_heartbeat

pytestmark = pytest.mark.django_db(transaction=True)
NODE = "demo-node"


class RecordingAgent:
    """Takes the messages `fgpu.agent.*` tasks hand the node's agent: starts, stops and the
    notices written into a session's terminal (`usage.notice`, tests/test_usage.py)."""

    def __init__(self):
        self.starts: list[dict] = []
        self.stops: list[str] = []
        self.notices: list[tuple[str, str]] = []
        self.usage = self

    def notice(self, session_id, text):
        self.notices.append((session_id, text))

    def submit_start(self, spec):
        self.starts.append(spec.encode())  # agent.tasks hands on the decoded StartSpec: kept as sent

    def submit_stop(self, session_id):
        self.stops.append(session_id)

    def submit_sync(self, keep):
        pass

    def submit_mig_reconcile(self, *args, **kwargs):
        pass


@pytest.fixture
def agent(demo_cluster):
    stand_in = RecordingAgent()
    agent_runtime._AGENTS[NODE] = stand_in
    yield stand_in
    agent_runtime._AGENTS.pop(NODE, None)


@pytest.fixture
def scheduled(agent, alice):
    """A session placed on demo-node (its start taken by the stand-in), scheduled a minute ago."""

    def make(shares: str = "0.5") -> ComputeSession:
        session = admission.session_create(owner=alice, name="", resources={"cuda.shares": shares})
        session.refresh_from_db()
        assert session.status == SessionStatus.SCHEDULED, session.status_reason
        ComputeSession.objects.filter(pk=session.pk).update(scheduled_at=timezone.now() - timedelta(minutes=1))
        session.refresh_from_db()
        session.first_spec = agent.starts[-1]  # what the scheduler sent
        agent.starts.clear()
        return session

    return make


def heartbeat(sessions: dict | None = None, ended: dict | None = None, *, at: float | None = None) -> None:
    state = {"sessions": {str(k): v for k, v in (sessions or {}).items()},
             "ended": {str(k): v for k, v in (ended or {}).items()}, "at": time.time() if at is None else at}
    agent_heartbeat.delay(node=NODE, running=list(state["sessions"]), state=state)


def status_of(session) -> str:
    session.refresh_from_db()
    return session.status


def unreleased(session) -> int:
    return Allocation.objects.filter(session=session, released_at__isnull=True).count()


def test_a_session_the_agent_runs_is_moved_to_running_when_its_report_was_lost(scheduled):
    session = scheduled()
    heartbeat({session.pk: "RUNNING"})
    assert status_of(session) == SessionStatus.RUNNING


def test_a_scheduled_session_the_agent_does_not_know_gets_its_start_again_with_its_devices(scheduled, agent):
    session = scheduled()
    heartbeat({})
    assert agent.starts == [session.first_spec]  # the same spec the scheduler sent
    assert status_of(session) == SessionStatus.SCHEDULED


def test_a_start_just_sent_is_not_sent_again(scheduled, agent):
    session = scheduled()
    ComputeSession.objects.filter(pk=session.pk).update(scheduled_at=timezone.now())
    heartbeat({})
    assert agent.starts == []
    assert status_of(session) == SessionStatus.SCHEDULED


def test_a_heartbeat_taken_before_the_session_was_scheduled_changes_nothing(scheduled, agent):
    session = scheduled()
    services.session_report_apply(session_id=str(session.pk), status="RUNNING")
    heartbeat({}, at=time.time() - 3600)  # the snapshot predates the start: its silence means nothing
    assert status_of(session) == SessionStatus.RUNNING
    assert agent.starts == []


def test_a_running_session_its_agent_no_longer_runs_ends_in_error_and_frees_its_slice(scheduled):
    session = scheduled()
    services.session_report_apply(session_id=str(session.pk), status="RUNNING")
    heartbeat({})
    assert status_of(session) == SessionStatus.ERROR
    assert "no longer runs" in session.status_reason
    assert unreleased(session) == 0


def test_an_end_the_manager_missed_is_taken_from_the_heartbeat_with_its_exit_code(scheduled):
    session = scheduled()
    services.session_report_apply(session_id=str(session.pk), status="RUNNING")
    heartbeat(ended={session.pk: {"status": "TERMINATED", "reason": "the process exited with code 3", "exit_code": 3}})
    assert status_of(session) == SessionStatus.TERMINATED
    assert (session.exit_code, unreleased(session)) == (3, 0)


def test_a_terminating_session_still_running_on_its_agent_gets_its_stop_again(scheduled, agent):
    session = scheduled()
    services.session_report_apply(session_id=str(session.pk), status="RUNNING")
    ComputeSession.objects.filter(pk=session.pk).update(status=SessionStatus.TERMINATING)
    heartbeat({session.pk: "RUNNING"})
    assert agent.stops == [str(session.pk)]
    assert status_of(session) == SessionStatus.TERMINATING


def test_a_terminating_session_its_agent_no_longer_runs_is_terminated_and_frees_its_slice(scheduled):
    session = scheduled()
    ComputeSession.objects.filter(pk=session.pk).update(status=SessionStatus.TERMINATING)
    heartbeat({})
    assert status_of(session) == SessionStatus.TERMINATED
    assert unreleased(session) == 0


def test_a_process_of_a_session_that_ended_here_is_told_to_stop(scheduled, agent):
    session = scheduled()
    services.session_report_apply(session_id=str(session.pk), status="ERROR", reason="gone")
    ghost = "00000000-0000-0000-0000-000000000042"  # not a session the database knows at all
    heartbeat({session.pk: "RUNNING", ghost: "RUNNING"})
    assert sorted(agent.stops) == sorted([str(session.pk), ghost])


def test_a_heartbeat_without_a_time_is_not_reconciled_but_still_keeps_its_node_alive(scheduled, agent, caplog):
    session = scheduled()
    services.session_report_apply(session_id=str(session.pk), status="RUNNING")
    Node.objects.filter(name=NODE).update(last_heartbeat=timezone.now() - timedelta(minutes=5))
    with caplog.at_level(logging.WARNING, logger="sessions.tasks"):
        agent_heartbeat.delay(node=NODE, running=[], state={"sessions": {}})
    assert "heartbeat of demo-node: its state could not be read, its sessions are not reconciled: " \
           "a heartbeat's state without 'at'" in caplog.text
    assert status_of(session) == SessionStatus.RUNNING  # its silence is not read as "the agent runs nothing"
    assert Node.objects.get(name=NODE).last_heartbeat > timezone.now() - timedelta(minutes=1)  # the rest applied


def test_one_malformed_entry_leaves_its_session_as_it_is_and_the_rest_of_the_state_is_reconciled(scheduled, agent, caplog):
    unreadable, moving, ending = scheduled(), scheduled("0.25"), scheduled("0.25")
    for session in (unreadable, ending):
        services.session_report_apply(session_id=str(session.pk), status="RUNNING")
    with caplog.at_level(logging.WARNING, logger="sessions.lifecycle.reconcile"):
        heartbeat({unreadable.pk: "PAUSED", moving.pk: "RUNNING"},  # a status a later agent may know
                  ended={ending.pk: {"status": "TERMINATED", "reason": "the process exited with code 0", "exit_code": 0}})
    assert "heartbeat of demo-node: 1 entries of its state could not be read, their sessions left as they are: " \
           f"'status' of session '{unreadable.pk}' in a heartbeat's state is 'PAUSED'" in caplog.text
    assert status_of(unreadable) == SessionStatus.RUNNING and unreleased(unreadable) > 0  # not ended as "no longer runs"
    assert status_of(moving) == SessionStatus.RUNNING
    assert (status_of(ending), ending.exit_code, unreleased(ending)) == (SessionStatus.TERMINATED, 0, 0)
    assert agent.stops == [] and agent.starts == []


def test_a_malformed_end_leaves_its_session_as_it_is_and_counts_it(scheduled, agent):
    session, other = scheduled(), scheduled("0.25")
    services.session_report_apply(session_id=str(session.pk), status="RUNNING")
    state = AgentState.decode({"sessions": {}, "ended": {str(session.pk): {"status": "TERMINATED", "exit_code": "0"},
                                                         str(other.pk): "gone"}, "at": time.time()})
    counts = reconcile.sessions_reconcile_heartbeat(node_name=NODE, state=state)
    assert counts == {"moved": 0, "ended": 0, "starts": 0, "stops": 0, "malformed": 2}
    assert (status_of(session), status_of(other)) == (SessionStatus.RUNNING, SessionStatus.SCHEDULED)
    assert agent.starts == []  # the scheduled one's start is not sent again either: its agent said something of it
