"""Standalone mode runs scheduler passes on a thread of their own (sessions.lifecycle.passes
_BackgroundPasses), not inside the request that asked for one (issue 14): asking returns at
once, the pass places the session from its own database connection, and requests made while a
pass runs coalesce into one more pass."""
from __future__ import annotations

import threading
import time

import pytest
from django.test import override_settings

from sessions.lifecycle import passes as pass_requests
from sessions.scheduling import scheduler
from sessions.lifecycle import services
from sessions.admission import launch as admission
from sessions.models import ComputeSession, SessionStatus
from tests.conftest import make_cluster, mock_gpu
from tests.stack import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def passes(monkeypatch):
    """A fresh pass thread for the test; the real pass, counted (`ran` when each starts,
    `finished` when it ends), its start messages recorded."""
    runner, ran, starts = pass_requests._BackgroundPasses(), [], []
    monkeypatch.setattr(pass_requests, "_STANDALONE_PASSES", runner)
    monkeypatch.setattr(scheduler, "_send_starts", starts.extend)
    real = scheduler.schedule_pending
    finished: list[str] = []

    def counted(**kwargs):
        ran.append(threading.current_thread().name)
        try:
            return real(**kwargs)
        finally:
            finished.append(threading.current_thread().name)

    monkeypatch.setattr(scheduler, "schedule_pending", counted)
    return ran, starts, finished


@override_settings(STANDALONE=True)
def test_a_launch_in_standalone_mode_is_placed_by_the_pass_thread_not_the_request(django_user_model, passes):
    ran, starts, _ = passes
    make_cluster(nodes={"node-a": [mock_gpu(0)]})
    user = django_user_model.objects.create_user("alice")
    session = admission.session_create(owner=user, name="s", resources={"cuda.shares": "0.5"})  # asks on commit
    wait_until(lambda: ComputeSession.objects.get(pk=session.pk).status == SessionStatus.SCHEDULED, timeout=20,
               what="the session placed by the pass thread")
    assert ran == ["scheduler-passes"]  # not the caller's thread
    assert [spec["session_id"] for _, spec in starts] == [str(session.pk)]


@override_settings(STANDALONE=True)
def test_requests_made_while_a_pass_runs_coalesce_into_one_more_pass(django_user_model, passes, monkeypatch):
    ran, _, finished = passes
    entered, gate = threading.Event(), threading.Event()
    real = scheduler.schedule_pending

    def slow(**kwargs):
        entered.set()
        gate.wait(10)  # the first pass is held until every request was made
        return real(**kwargs)

    monkeypatch.setattr(scheduler, "schedule_pending", slow)
    started = time.monotonic()
    pass_requests.schedule_pending_soon()
    asking = time.monotonic() - started
    assert entered.wait(10), "the first pass did not start"
    started = time.monotonic()
    for _ in range(19):  # while the first pass runs
        pass_requests.schedule_pending_soon()
    asking += time.monotonic() - started
    assert asking < 1.0, "asking for a pass waited for it"
    gate.set()
    wait_until(lambda: len(finished) == 2, timeout=10, what="the held pass and one more to end")
    assert not pass_requests._STANDALONE_PASSES._wanted.is_set()  # no third pass is wanted, so none starts
    assert len(ran) == 2, ran  # the 19 requests made during the first pass: one more pass, not one each
