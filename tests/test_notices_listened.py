"""A batch of session notices (a scheduler pass's) is rendered only for the sessions some page
listens for (issue 35.2): their own page's group, their owner's, or staff's has a member on the
configured channel layer (Redis where REDIS_URL is set); the others are neither read nor sent."""

from __future__ import annotations

import asyncio
import copy
import uuid

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from sessions.admission import launch as admission
from sessions.lifecycle import events

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def own_channel_layer():
    """A channel layer under a prefix of this test's own: the layer's groups live in Redis for a day,
    so a page an earlier test left in the staff group (another module's websocket, in the same
    pytest-xdist worker's database) would make every notice listened for, as staff's are."""
    from django.conf import settings
    from django.test import override_settings

    layers = copy.deepcopy(settings.CHANNEL_LAYERS)
    if "hosts" in layers["default"].get("CONFIG", {}):
        layers["default"]["CONFIG"]["prefix"] = f"notices-{uuid.uuid4().hex}"
    with override_settings(CHANNEL_LAYERS=layers):
        yield


def sessions_of(owner, count: int, prefix: str) -> list:
    return [admission.session_create(owner=owner, name=f"{prefix}{i}", resources={"cuda.shares": "0.25"}) for i in range(count)]


def listening(group: str) -> str:
    """A channel of ours in `group`, as a page's websocket joins it."""
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(group, channel)
    return channel


def received(channel: str) -> list[str]:
    """The ids in the session notices `channel` has now (each within 2 s of the last)."""

    async def drain() -> list[str]:
        layer, ids = get_channel_layer(), []
        while True:
            try:
                message = await asyncio.wait_for(layer.receive(channel), 2)
            except asyncio.TimeoutError:
                return ids
            ids.append(message["session"]["id"])

    return async_to_sync(drain)()


def notify(sessions, capture, *, answered: bool = False) -> set[str]:
    """`events.sessions_notify(sessions, answered=answered)` committed; the ids it rendered."""
    events._rendered.shapes = {}
    with capture(execute=True):
        events.sessions_notify(sessions, answered=answered)
    return set(events._rendered.shapes)


def test_only_the_session_whose_page_listens_is_rendered_and_sent(demo_cluster, alice, django_capture_on_commit_callbacks):
    sessions = sessions_of(alice, 10, "s")
    page = listening(events.session_group(sessions[3].pk))

    assert notify(sessions, django_capture_on_commit_callbacks) == {str(sessions[3].pk)}
    assert received(page) == [str(sessions[3].pk)]


def test_an_owner_listening_gets_all_of_theirs_and_no_one_elses(demo_cluster, alice, bob, django_capture_on_commit_callbacks):
    hers, his = sessions_of(alice, 6, "a"), sessions_of(bob, 6, "b")
    page = listening(events.user_group(alice.pk))

    assert notify([*hers, *his], django_capture_on_commit_callbacks) == {str(s.pk) for s in hers}
    assert received(page) == [str(s.pk) for s in hers]


def test_with_staff_listening_every_session_is_rendered(demo_cluster, alice, bob, django_capture_on_commit_callbacks):
    sessions = [*sessions_of(alice, 5, "a"), *sessions_of(bob, 5, "b")]
    page = listening(events.STAFF_GROUP)

    assert notify(sessions, django_capture_on_commit_callbacks) == {str(s.pk) for s in sessions}
    assert received(page) == [str(s.pk) for s in sessions]


def test_a_few_notices_of_a_write_that_answers_with_them_are_rendered_without_asking_who_listens(
    demo_cluster, alice, django_capture_on_commit_callbacks
):
    sessions = sessions_of(alice, events._ASK_FROM - 1, "s")

    assert notify(sessions, django_capture_on_commit_callbacks, answered=True) == {str(s.pk) for s in sessions}


def test_one_notice_no_answer_reuses_is_rendered_only_when_a_page_listens(
    demo_cluster, alice, django_capture_on_commit_callbacks
):
    (session,) = sessions_of(alice, 1, "s")

    assert notify([session], django_capture_on_commit_callbacks) == set()
    page = listening(events.user_group(alice.pk))
    assert notify([session], django_capture_on_commit_callbacks) == {str(session.pk)}
    assert received(page) == [str(session.pk)]


def test_an_agents_reports_of_a_session_nobody_watches_move_it_without_reading_it_for_a_notice(
    demo_cluster, alice, django_capture_on_commit_callbacks, django_assert_num_queries
):
    """An agent's PREPARING and RUNNING reports of a session launched through the API or the CLI (no
    page open): each reads the session with its node and makes its compare-and-set UPDATE; no
    notice reads or renders it (issue 35.3)."""
    from sessions.lifecycle.services import session_report_apply
    from sessions.scheduling.scheduler import schedule_pending

    (session,) = sessions_of(alice, 1, "s")
    assert schedule_pending() == [str(session.pk)]
    for status in ("PREPARING", "RUNNING"):
        events._rendered.shapes = {}
        with django_assert_num_queries(2), django_capture_on_commit_callbacks(execute=True):
            assert session_report_apply(session_id=str(session.pk), status=status)
        assert events._rendered.shapes == {}
        session.refresh_from_db()
        assert session.status == status
