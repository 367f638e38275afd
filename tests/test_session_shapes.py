"""The session list's kept shapes (sessions.api.shapes) are never stale: after a write to any row a
session's API shape is made from, made the way no service makes it (a queryset update, bypassing
every signal and the session's `version`), the list shows what a fresh render shows, and the
page costs three queries whatever its length. On the real PostgreSQL with real commits
(`transaction=True`): the fingerprint is a committed row version's `xmin`, and the triggers of
migrations compute_sessions 0013 and usage 0004 are what is tested.
"""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from accelerators.models import Device, GpuInstance, Node, SlotFormat
from sessions.models import Allocation, ComputeSession, SessionImage
from sessions.selectors import session_get_for, sessions_shown
from sessions.api.serializers import SessionSerializer, session_shapes
from sessions.api.shapes import SHAPES
from tests.conftest import client_for
from tests.seed import gpu_cluster, sessions_in_every_style

pytestmark = pytest.mark.django_db(transaction=True)

SESSIONS = 24  # every request style (fGPU, memory, fraction, MIG, isolation "any", CPU only) four times


@pytest.fixture
def cluster(alice):
    """Alice's sessions of every style on two GPU nodes and a MIG node, the shapes of this
    process forgotten (another test's may share ids with nothing here, but start clean)."""
    SHAPES.clear()
    gpu_cluster(nodes=2, mig_gpus=4)
    return sessions_in_every_style(owner=alice, count=SESSIONS)


def listed(api) -> dict:
    response = api.get("/api/v1/sessions/", {"limit": 1000})
    assert response.status_code == 200, response.content
    return {shape["id"]: shape for shape in response.json()["results"]}


def fresh(user) -> dict:
    """What the serializer renders now for each of `user`'s sessions, nothing kept."""
    return {
        str(s.pk): SessionSerializer(session_get_for(user=user, session_id=s.pk)).data
        for s in ComputeSession.objects.filter(owner=user)
    }


def as_json(shapes: dict) -> dict:
    """Shapes as the API's JSON has them (DRF's representation holds some values as Python
    objects: compare through the same renderer)."""
    import json

    from rest_framework.utils.encoders import JSONEncoder

    return json.loads(json.dumps(shapes, cls=JSONEncoder))


def mig_session(sessions) -> ComputeSession:
    return next(s for s in sessions if GpuInstance.objects.filter(session=s).exists())


def shared_session(sessions) -> ComputeSession:
    return next(
        s for s in sessions if Allocation.objects.filter(session=s, released_at=None, device__is_mig_device=False).exists()
    )


def release_allocations(sessions, alice):
    Allocation.objects.filter(session=shared_session(sessions)).update(released_at=timezone.now())


def node_attributes(sessions, alice):
    Node.objects.filter(pk=shared_session(sessions).node_id).update(attributes={"fraction_enforcement": "hami-core", "mps": True})


def device_model(sessions, alice):
    Device.objects.filter(allocations__session=shared_session(sessions)).update(model_name="Renamed GPU")


def gpu_instance_uuid(sessions, alice):
    GpuInstance.objects.filter(session=mig_session(sessions)).update(uuid="MIG-11111111-2222-3333-4444-555555555555")


def gpu_instance_released(sessions, alice):
    GpuInstance.objects.filter(session=mig_session(sessions)).delete()


def image_apps(sessions, alice):
    SessionImage.objects.filter(pk=sessions[0].image_id).update(
        apps=[{"name": "jupyter", "title": "JupyterLab", "command": "jupyter lab", "port": 8888}]
    )


def owner_renamed(sessions, alice):
    type(alice).objects.filter(pk=alice.pk).update(username="alice-renamed")


def slot_format(sessions, alice):
    SlotFormat.objects.update_or_create(slot_name="cuda", subtype="shares", defaults={"display_unit": "vGPU"})


def session_row(sessions, alice):
    ComputeSession.objects.filter(pk=sessions[1].pk).update(status_reason="written by hand, no version bump")


def reclaim_warned(sessions, alice):
    from usage.models import SessionActivity

    SessionActivity.objects.update_or_create(
        session=sessions[2], defaults={"deadline": timezone.now(), "reason": "reached its maximum lifetime of 1 h"}
    )


WRITES = [
    release_allocations,
    node_attributes,
    device_model,
    gpu_instance_uuid,
    gpu_instance_released,
    image_apps,
    owner_renamed,
    slot_format,
    session_row,
    reclaim_warned,
]


@pytest.mark.parametrize("write", WRITES, ids=lambda write: write.__name__)
def test_the_list_shows_every_write_to_what_a_shape_is_made_from(cluster, alice, write):
    api = client_for(alice)
    before = listed(api)
    assert before == as_json(fresh(alice))  # rendered, then kept
    assert listed(api) == before  # served from what was kept

    write(cluster, alice)
    alice.refresh_from_db()

    after = listed(api)
    assert after != before  # the write shows in some shape (else this test could not fail)
    assert after == as_json(fresh(alice))


def test_a_heartbeat_rewrites_no_session(cluster, alice):
    """The node's heartbeat columns are not in any shape: writing them leaves every session row
    (and so every kept shape) as it was."""
    node = Node.objects.get(pk=shared_session(cluster).node_id)
    versions = sessions_xmin()
    Node.objects.filter(pk=node.pk).update(last_heartbeat=timezone.now())
    assert sessions_xmin() == versions
    Node.objects.filter(pk=node.pk).update(attributes={"fraction_enforcement": "mps"})
    changed = {i for i, xmin in sessions_xmin().items() if versions[i] != xmin}
    assert changed == {str(s.pk) for s in ComputeSession.objects.filter(node=node)}


def sessions_xmin() -> dict:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT id::text, xmin::text FROM {ComputeSession._meta.db_table}")
        return dict(cursor.fetchall())


@pytest.mark.parametrize("rows", [1, 100])
def test_a_kept_page_costs_three_queries_whatever_its_length(alice, rows):
    SHAPES.clear()
    gpu_cluster(nodes=2, mig_gpus=4)
    sessions_in_every_style(owner=alice, count=rows)
    api = client_for(alice)
    listed(api)  # renders and keeps every row
    with CaptureQueriesContext(connection) as queries:
        assert len(listed(api)) == rows
    # the token with its user; the page's COUNT; its rows' ids and fingerprints
    assert len(queries) == 3, [q["sql"][:120] for q in queries.captured_queries]


def test_the_etag_changes_with_a_shape_and_only_then(cluster, alice):
    api = client_for(alice)
    tag = api.get("/api/v1/sessions/")["ETag"]
    assert api.get("/api/v1/sessions/", HTTP_IF_NONE_MATCH=tag).status_code == 304
    Node.objects.filter(pk=shared_session(cluster).node_id).update(last_heartbeat=timezone.now())
    assert api.get("/api/v1/sessions/", HTTP_IF_NONE_MATCH=tag).status_code == 304
    node_attributes(cluster, alice)
    answer = api.get("/api/v1/sessions/", HTTP_IF_NONE_MATCH=tag)
    assert answer.status_code == 200 and answer["ETag"] != tag


def all_shown(user) -> list[ComputeSession]:
    return list(sessions_shown().filter(owner=user))


@pytest.mark.parametrize("write", WRITES, ids=lambda write: write.__name__)
def test_the_threads_kept_serializer_renders_what_a_new_one_renders_after_every_write(cluster, alice, write):
    """session_shapes keeps one SessionSerializer per thread (its fields built once): what it
    renders after a write, the slot formats' included (read anew at every call), is what a
    serializer made for the call renders."""
    before = session_shapes(all_shown(alice))
    assert before == SessionSerializer(all_shown(alice), many=True).data

    write(cluster, alice)

    after = session_shapes(all_shown(alice))
    assert after != before
    assert after == SessionSerializer(all_shown(alice), many=True).data
