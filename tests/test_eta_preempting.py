"""A waiting session that others are preempted for (issue 36.3): its ETA panel gives one answer,
the time they are stopped (their `preempt_at`), the time its reason names; and its reason names
only its owner's own sessions among them (another user's are counted), as the panel's list of
the sessions it waits for already did. On the database, through the scheduler's pass."""

from __future__ import annotations

import pytest

from sessions.admission.launch import session_create
from sessions.models import ComputeSession
from sessions.scheduling import eta
from sessions.scheduling.scheduler import schedule_pending
from tests.conftest import client_for
from tests.test_preemption import fresh, one_gpu, running  # noqa: F401 (a fixture and helpers)

pytestmark = pytest.mark.django_db


def test_a_session_others_are_preempted_for_starts_at_their_stop_and_names_only_its_owners_sessions(
    one_gpu,  # noqa: F811
    alice,
    bob,
):
    theirs = running(alice, "alices-job", fgpu="1")
    mine = running(bob, "bobs-job", fgpu="1")
    urgent = session_create(owner=bob, name="urgent", resources={"cuda.shares": "2", "mem": "64M"})
    ComputeSession.objects.filter(pk=urgent.pk).update(priority=5)  # as an administrator may set it

    schedule_pending()
    urgent, theirs, mine = fresh(urgent), fresh(theirs), fresh(mine)
    stop = max(theirs.preempt_at, mine.preempt_at)

    answer = eta.session_eta(session=urgent)
    shown = client_for(bob).get(f"/api/v1/sessions/{urgent.pk}/eta/").json()

    assert theirs.preempted_for_id == urgent.pk and mine.preempted_for_id == urgent.pk
    assert "bobs-job" in urgent.status_reason and "1 of another user" in urgent.status_reason
    assert "alices-job" not in urgent.status_reason and "alices-job" not in str(shown)
    assert (answer.outcome, answer.earliest, answer.latest) == ("estimate", stop, stop)
    assert shown["outcome"] == "estimate" and shown["earliest"].replace("Z", "+00:00") == stop.isoformat()
    assert f"stopped at {stop:%H:%M:%S} UTC" in shown["waiting_reason"]  # the same time, said twice alike
