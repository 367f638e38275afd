"""A resource group's maximum lifetime is kept whatever its grace (issue 36.3): the lifetime's
deadline is the session's start plus the lifetime, never "now + grace", so a 60 s limit with
120 s grace ends the session at 60 s (it ran 125 s before); of an idle deadline and the
lifetime's end the earlier is kept; the lifetime's warning does not say "unless it is used"
(nothing averts it). The admin refuses such a pair. The clock is given to usage_idle_check
explicitly; nothing else is mocked."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.test import Client

from tests.test_reconcile import agent  # noqa: F401 (fixture: the node's agent, a recording stand-in)
from tests.test_usage import NODE, batch, quiet, running, sample  # noqa: F401 (a fixture and helpers)
from usage.models import IdlePolicy, SessionActivity
from usage.services import usage_idle_check, usage_ingest

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_lifetime_shorter_than_the_grace_ends_the_session_at_its_lifetime_not_after_the_grace(running, agent):  # noqa: F811 (fixtures)
    IdlePolicy.objects.create(resource_group=None, max_lifetime=60, grace=120)
    session = running(command="train", age=0)
    started = session.started_at

    warned = usage_idle_check(now=started + timedelta(seconds=5))
    deadline = SessionActivity.objects.get(session=session).deadline
    before = usage_idle_check(now=started + timedelta(seconds=59))
    at_limit = usage_idle_check(now=started + timedelta(seconds=61))

    assert warned["warned"] == [str(session.pk)]
    assert deadline == started + timedelta(seconds=60)
    assert before == {"warned": [], "terminated": [], "cleared": []}
    assert at_limit["terminated"] == [str(session.pk)] and agent.stops == [str(session.pk)]


def test_the_lifetime_warning_names_its_end_and_never_says_unless_it_is_used(running, agent):  # noqa: F811 (fixtures)
    IdlePolicy.objects.create(resource_group=None, max_lifetime=3600, grace=600)
    session = running(age=3100)

    usage_idle_check(now=session.started_at + timedelta(seconds=3100))

    ((sid, text),) = agent.notices
    end = session.started_at + timedelta(seconds=3600)
    assert sid == str(session.pk)
    assert f"will be terminated at {end:%Y-%m-%d %H:%M:%S} UTC" in text
    assert "unless it is used" not in text and text.startswith("reached its maximum lifetime of 1 h")


def test_of_an_idle_deadline_and_the_lifetimes_end_the_earlier_is_kept(running, agent):  # noqa: F811 (fixtures)
    IdlePolicy.objects.create(resource_group=None, idle_timeout=600, max_lifetime=3600, grace=600, gpu_util_threshold=1)
    session = running(age=2900)
    quiet(session)
    now = session.started_at + timedelta(seconds=2900)

    warned = usage_idle_check(now=now)  # idle: terminated at 3500 s unless used again
    within = usage_idle_check(now=now + timedelta(seconds=100))  # 3000 s: the lifetime's end (3600 s) is later
    quiet(session, until=int(now.timestamp()) + 601)  # its agent's samples, idle still
    done = usage_idle_check(now=now + timedelta(seconds=601))

    assert warned["warned"] == [str(session.pk)] and within["warned"] == []
    assert "unless it is used again" in agent.notices[0][1] and len(agent.notices) == 1
    assert done["terminated"] == [str(session.pk)]


def test_an_idle_session_used_again_near_its_lifetime_ends_at_its_lifetime_not_at_the_idle_deadline(running, agent):  # noqa: F811 (fixtures)
    IdlePolicy.objects.create(resource_group=None, idle_timeout=600, max_lifetime=3600, grace=600, gpu_util_threshold=1)
    session = running(age=2900)
    quiet(session)
    now = session.started_at + timedelta(seconds=2900)
    usage_idle_check(now=now)  # idle: 3500 s

    typed = int(time.time())
    usage_ingest(node_name=NODE, batch=batch(sample(session, typed + 1, last_input=typed)))
    used = usage_idle_check(now=now + timedelta(seconds=100))  # 3000 s: no longer idle, within the lifetime's grace
    activity = SessionActivity.objects.get(session=session)
    past_idle_deadline = usage_idle_check(now=now + timedelta(seconds=601))
    past_lifetime = usage_idle_check(now=session.started_at + timedelta(seconds=3601))

    assert used["warned"] == [str(session.pk)] and used["cleared"] == []
    assert (activity.deadline, activity.reason) == (
        session.started_at + timedelta(seconds=3600),
        "reached its maximum lifetime of 1 h",
    )
    assert past_idle_deadline["terminated"] == [] and past_lifetime["terminated"] == [str(session.pk)]


def test_the_admin_refuses_a_grace_not_shorter_than_the_maximum_lifetime(admin):
    client = Client()
    client.force_login(admin)
    form = {"gpu_util_threshold": 1, "idle_timeout": "", "max_lifetime": 60, "grace": 120}

    refused = client.post("/admin/usage/idlepolicy/add/", form)
    accepted = client.post("/admin/usage/idlepolicy/add/", {**form, "grace": 30})

    assert refused.status_code == 200 and "must be shorter than the maximum lifetime (60 s)" in refused.content.decode()
    assert accepted.status_code == 302
    assert list(IdlePolicy.objects.values_list("max_lifetime", "grace")) == [(60, 30)]


def test_the_sessions_api_shows_the_warnings_deadline_and_reason_and_null_once_withdrawn(running, agent, alice):  # noqa: F811
    from tests.conftest import client_for

    IdlePolicy.objects.create(resource_group=None, max_lifetime=3600, grace=600)
    session = running(age=3100)
    api = client_for(alice)
    before = api.get(f"/api/v1/sessions/{session.pk}/").json()

    usage_idle_check(now=session.started_at + timedelta(seconds=3100))
    warned = api.get(f"/api/v1/sessions/{session.pk}/").json()
    listed = api.get("/api/v1/sessions/").json()["results"]
    SessionActivity.objects.filter(session=session).update(deadline=None, reason="")
    withdrawn = api.get(f"/api/v1/sessions/{session.pk}/").json()

    assert (before["deadline"], before["deadline_reason"]) == (None, "")
    end = session.started_at + timedelta(seconds=3600)
    assert warned["deadline"].replace("Z", "+00:00") == end.isoformat()
    assert warned["deadline_reason"] == "reached its maximum lifetime of 1 h"
    assert [(s["id"], s["deadline"]) for s in listed] == [(str(session.pk), warned["deadline"])]
    assert (withdrawn["deadline"], withdrawn["deadline_reason"]) == (None, "")
